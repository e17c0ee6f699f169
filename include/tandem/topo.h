/*
 * tandem topo: where each rank's transfer work runs (issue 17, placement; DESIGN.md §5).
 *
 * A rank moves KV pages through a NIC, and the copies and completions of that traffic run on
 * CPU cores. Both should be the ones nearest the rank's GPU: a NIC under the same PCIe switch
 * reaches the GPU's memory without crossing the CPU's root complex or the socket link, and cores
 * of the GPU's NUMA node touch the staging buffers in local memory. This module reads the
 * machine with hwloc (its PCI tree included) and answers, for N ranks:
 *
 *   rank r  ->  GPU (a PCI bus id, or none)
 *               NUMA node and its cores (a cpulist such as "0-15,64-79")
 *               NICs, nearest first, and why they are the nearest
 *
 * GPUs. The caller names each rank's GPU by PCI bus id (the CUDA backend gives it: what the
 * device ordinal maps to). Without names, NVIDIA display or 3D controllers are taken in PCI bus
 * order (CUDA_DEVICE_ORDER=PCI_BUS_ID's order), rank r on the r-th; with fewer GPUs than ranks,
 * or none (CI, a CPU server), the ranks are spread over the NUMA nodes instead: rank r on node
 * r * nodes / N, so consecutive ranks share a node and every node is used.
 *
 * NICs. RDMA devices (hwloc's OpenFabrics OS devices: mlx5_0, efa0) when the machine has any,
 * else network interfaces (eth0). The nearest to a GPU are found by walking up from it: the
 * first ancestor with a NIC below it decides, and every NIC below that ancestor is in the set
 * (the same PCIe switch, then the same root port or host bridge, then the same NUMA node or
 * package, then the host). The nearest to a NUMA node (no GPU) are the NICs whose locality lies
 * inside that node, else all of the host's. Ranks with the same nearest set take it rotated by
 * their order among those ranks, so that the first NIC (the one a rank's transfers use when they
 * use one) differs between them when the set has several. No NIC at all: the rank's transfers
 * use the loopback, and the placement says so.
 *
 * A topology may come from an XML file instead of this machine (hwloc's own HWLOC_XMLFILE
 * variable, or tdm_topo_open's argument): tests describe a multi-GPU node that way, and the
 * placement of such a topology is computed but never used to pin (its cores are not ours).
 *
 * Ownership and threading. A tdm_topo_t owns its hwloc topology; open and place from one thread
 * (start-up). A tdm_placement is plain data, copied freely. tdm_thread_pin affects only the
 * calling thread and may be called from any thread.
 */
#ifndef TANDEM_TOPO_H
#define TANDEM_TOPO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_topo tdm_topo_t;

#define TDM_TOPO_MAX_NICS 8

/* How the NICs of a placement were chosen, nearest first. */
enum tdm_topo_near {
    TDM_NEAR_NONE = 0,    /* the machine has no NIC: transfers use the loopback */
    TDM_NEAR_PCIE_SWITCH, /* under the same PCIe switch as the GPU */
    TDM_NEAR_PCIE_ROOT,   /* under the same host bridge (root complex) as the GPU */
    TDM_NEAR_NUMA,        /* attached to the same NUMA node (or package) as the GPU or rank */
    TDM_NEAR_HOST,        /* only elsewhere on the host (another socket) */
};

struct tdm_topo_nic {
    char name[32]; /* the OS device: "mlx5_0", "efa0", "eth0" */
    char pci[16];  /* its PCI bus id, "0000:19:00.0" ("" when not on PCI) */
    bool rdma;     /* an RDMA device (verbs, EFA), not a plain network interface */
};

struct tdm_placement {
    int rank;
    char gpu_pci[16]; /* the rank's GPU ("" without one) */
    int numa;         /* the OS index of the NUMA node whose cores serve the rank; -1 when the
                       * locality spans several nodes or is unknown */
    char cpus[128];   /* those cores as a cpulist ("" when unknown) */
    int n_nics;
    struct tdm_topo_nic nics[TDM_TOPO_MAX_NICS]; /* the nearest, the rank's own first */
    enum tdm_topo_near near;
};

/* Reads this machine (xml_path NULL; hwloc's HWLOC_XMLFILE still applies) or a topology XML
 * file written by hwloc (lstopo foo.xml) or by hand in its format. */
tdm_status tdm_topo_open(const char *xml_path, tdm_topo_t **out);
void tdm_topo_close(tdm_topo_t *t);
/* True when the topology describes the machine this process runs on (so its cores may be
 * pinned to). */
bool tdm_topo_is_this_system(const tdm_topo_t *t);
/* GPUs the topology holds (NVIDIA controllers), in PCI bus order. */
int tdm_topo_n_gpus(const tdm_topo_t *t);

/* Places n_ranks ranks (1 .. 64): out[r] for rank r. gpu_pci: each rank's GPU bus id, or NULL
 * to take the topology's GPUs in bus order. A bus id the topology lacks is TDM_ENOTFOUND. */
tdm_status tdm_topo_place(tdm_topo_t *t, int n_ranks, const char *const *gpu_pci,
                          struct tdm_placement *out);

/* One line for the log: "rank 0: GPU 0000:18:00.0, NUMA node 0 (cores 0-3), NIC mlx5_0 (same
 * PCIe switch as the GPU)". Returns what snprintf returns. */
int tdm_placement_describe(const struct tdm_placement *p, char *buf, size_t cap);
/* "pcie-switch", "pcie-root", "numa", "host", "none" (metric labels, JSON). */
const char *tdm_topo_near_name(enum tdm_topo_near n);

/* Pins the calling thread to a cpulist ("0-3,8"); "" or NULL leaves it as it is. TDM_EINVAL for
 * a malformed list, TDM_EIO when the OS refuses (cores outside this process's cgroup). */
tdm_status tdm_thread_pin(const char *cpulist);

/* The calling thread's CPU set, saved before pinning it for the threads it is about to create
 * (a new thread inherits its creator's set) and restored after. */
struct tdm_thread_mask {
    uint64_t bits[16]; /* CPUs 0 .. 1023 */
};
tdm_status tdm_thread_mask_get(struct tdm_thread_mask *m);
tdm_status tdm_thread_mask_set(const struct tdm_thread_mask *m);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_TOPO_H */
