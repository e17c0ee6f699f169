/*
 * Placement of ranks on the machine's topology (include/tandem/topo.h says what and why).
 *
 * Ownership: a tdm_topo owns its hwloc topology and the lists of GPUs and NICs found at open
 * (pointers into that topology, valid until close). Threading: none of its own; callers open and
 * place at start-up from one thread. tdm_thread_pin acts on the calling thread only.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "tandem/topo.h"

#include <hwloc.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEVS 256

struct tdm_topo {
    hwloc_topology_t hw;
    int n_gpus, n_nics;
    hwloc_obj_t gpus[MAX_DEVS]; /* NVIDIA controllers, PCI bus order */
    hwloc_obj_t nics[MAX_DEVS]; /* RDMA OS devices if any, else network interfaces */
    bool nics_rdma;
};

static int busid_cmp(const void *a, const void *b)
{
    const struct hwloc_pcidev_attr_s *x = &(*(const hwloc_obj_t *)a)->attr->pcidev;
    const struct hwloc_pcidev_attr_s *y = &(*(const hwloc_obj_t *)b)->attr->pcidev;
    const unsigned long kx = ((unsigned long)x->domain << 24) | ((unsigned long)x->bus << 16) |
                             ((unsigned long)x->dev << 8) | x->func;
    const unsigned long ky = ((unsigned long)y->domain << 24) | ((unsigned long)y->bus << 16) |
                             ((unsigned long)y->dev << 8) | y->func;
    return kx < ky ? -1 : kx > ky;
}

static void pci_name(hwloc_obj_t pci, char *buf, size_t cap)
{
    if (!pci || pci->type != HWLOC_OBJ_PCI_DEVICE) {
        if (cap) buf[0] = '\0';
        return;
    }
    const struct hwloc_pcidev_attr_s *a = &pci->attr->pcidev;
    snprintf(buf, cap, "%04x:%02x:%02x.%01x", (unsigned)a->domain, (unsigned)a->bus,
             (unsigned)a->dev, (unsigned)a->func);
}

static void find_devices(struct tdm_topo *t)
{
    for (hwloc_obj_t o = hwloc_get_next_pcidev(t->hw, NULL); o && t->n_gpus < MAX_DEVS;
         o = hwloc_get_next_pcidev(t->hw, o))
        if (o->attr->pcidev.vendor_id == 0x10de && (o->attr->pcidev.class_id >> 8) == 0x03)
            t->gpus[t->n_gpus++] = o;
    qsort(t->gpus, (size_t)t->n_gpus, sizeof t->gpus[0], busid_cmp);

    int n_rdma = 0, n_net = 0;
    hwloc_obj_t rdma[MAX_DEVS], net[MAX_DEVS];
    for (hwloc_obj_t o = hwloc_get_next_osdev(t->hw, NULL); o; o = hwloc_get_next_osdev(t->hw, o)) {
        if (!o->name) continue;
        if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_OPENFABRICS && n_rdma < MAX_DEVS)
            rdma[n_rdma++] = o;
        else if (o->attr->osdev.type == HWLOC_OBJ_OSDEV_NETWORK && n_net < MAX_DEVS)
            net[n_net++] = o;
    }
    t->nics_rdma = n_rdma > 0;
    t->n_nics = n_rdma ? n_rdma : n_net;
    memcpy(t->nics, n_rdma ? rdma : net, (size_t)t->n_nics * sizeof(hwloc_obj_t));
}

tdm_status tdm_topo_open(const char *xml_path, tdm_topo_t **out)
{
    *out = NULL;
    struct tdm_topo *t = calloc(1, sizeof *t);
    if (!t) return tdm_err_set(TDM_ENOMEM, "topology: out of memory");
    if (hwloc_topology_init(&t->hw)) {
        free(t);
        return tdm_err_set(TDM_EINTERNAL, "topology: hwloc_topology_init failed");
    }
    /* GPUs, NICs and the bridges above them; other PCI devices are dropped */
    hwloc_topology_set_io_types_filter(t->hw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (xml_path && hwloc_topology_set_xml(t->hw, xml_path)) {
        hwloc_topology_destroy(t->hw);
        free(t);
        return tdm_err_set(TDM_EFORMAT, "topology: cannot use %s as an hwloc XML file", xml_path);
    }
    if (hwloc_topology_load(t->hw)) {
        hwloc_topology_destroy(t->hw);
        free(t);
        return tdm_err_set(TDM_EFORMAT, "topology: hwloc could not load %s",
                           xml_path ? xml_path : "this machine's topology");
    }
    find_devices(t);
    *out = t;
    return TDM_OK;
}

void tdm_topo_close(tdm_topo_t *t)
{
    if (!t) return;
    hwloc_topology_destroy(t->hw);
    free(t);
}

bool tdm_topo_is_this_system(const tdm_topo_t *t)
{
    return hwloc_topology_is_thissystem(t->hw) != 0;
}

int tdm_topo_n_gpus(const tdm_topo_t *t)
{
    return t->n_gpus;
}

const char *tdm_topo_near_name(enum tdm_topo_near n)
{
    switch (n) {
    case TDM_NEAR_PCIE_SWITCH:
        return "pcie-switch";
    case TDM_NEAR_PCIE_ROOT:
        return "pcie-root";
    case TDM_NEAR_NUMA:
        return "numa";
    case TDM_NEAR_HOST:
        return "host";
    case TDM_NEAR_NONE:
        break;
    }
    return "none";
}

/* The cores and NUMA node of a normal (non-I/O) object. */
static void locality(struct tdm_placement *p, hwloc_obj_t o)
{
    hwloc_bitmap_list_snprintf(p->cpus, sizeof p->cpus, o->cpuset);
    p->numa = hwloc_bitmap_weight(o->nodeset) == 1 ? hwloc_bitmap_first(o->nodeset) : -1;
}

static void add_nic(const struct tdm_topo *t, struct tdm_placement *p, hwloc_obj_t nic)
{
    if (p->n_nics >= TDM_TOPO_MAX_NICS) return;
    struct tdm_topo_nic *n = &p->nics[p->n_nics++];
    snprintf(n->name, sizeof n->name, "%s", nic->name);
    pci_name(nic->parent, n->pci, sizeof n->pci);
    n->rdma = t->nics_rdma;
}

/* How near an ancestor `a` of a GPU is: the kind of the object both sit under. */
static enum tdm_topo_near nearness(hwloc_obj_t a)
{
    if (a->type == HWLOC_OBJ_BRIDGE)
        return a->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST ? TDM_NEAR_PCIE_ROOT
                                                                      : TDM_NEAR_PCIE_SWITCH;
    if (a->type == HWLOC_OBJ_PCI_DEVICE) return TDM_NEAR_PCIE_SWITCH;
    return hwloc_bitmap_weight(a->nodeset) <= 1 ? TDM_NEAR_NUMA : TDM_NEAR_HOST;
}

/* hwloc_obj_is_in_subtree compares cpusets, which I/O objects lack: walk the parents instead */
static bool is_under(hwloc_obj_t o, hwloc_obj_t a)
{
    for (; o; o = o->parent)
        if (o == a) return true;
    return false;
}

static void place_on_gpu(struct tdm_topo *t, hwloc_obj_t gpu, struct tdm_placement *p)
{
    pci_name(gpu, p->gpu_pci, sizeof p->gpu_pci);
    locality(p, hwloc_get_non_io_ancestor_obj(t->hw, gpu));
    for (hwloc_obj_t a = gpu->parent; a && !p->n_nics; a = a->parent) {
        for (int i = 0; i < t->n_nics; i++)
            if (is_under(t->nics[i], a)) add_nic(t, p, t->nics[i]);
        if (p->n_nics) p->near = nearness(a);
    }
}

static void place_on_node(struct tdm_topo *t, hwloc_obj_t node, struct tdm_placement *p)
{
    locality(p, node);
    p->numa = (int)node->os_index;
    for (int i = 0; i < t->n_nics; i++) {
        hwloc_obj_t home = hwloc_get_non_io_ancestor_obj(t->hw, t->nics[i]);
        if (home && hwloc_bitmap_isincluded(home->cpuset, node->cpuset)) add_nic(t, p, t->nics[i]);
    }
    if (p->n_nics) {
        p->near = TDM_NEAR_NUMA;
        return;
    }
    for (int i = 0; i < t->n_nics; i++)
        add_nic(t, p, t->nics[i]);
    p->near = p->n_nics ? TDM_NEAR_HOST : TDM_NEAR_NONE;
}

static bool same_nics(const struct tdm_placement *a, const struct tdm_placement *b)
{
    if (a->n_nics != b->n_nics) return false;
    for (int i = 0; i < a->n_nics; i++)
        if (strcmp(a->nics[i].name, b->nics[i].name)) return false;
    return true;
}

tdm_status tdm_topo_place(tdm_topo_t *t, int n_ranks, const char *const *gpu_pci,
                          struct tdm_placement *out)
{
    if (n_ranks < 1 || n_ranks > 64)
        return tdm_err_set(TDM_EINVAL, "topology: %d ranks (1 to 64)", n_ranks);
    hwloc_obj_t gpu[64] = {0};
    bool on_gpus = false;
    if (gpu_pci) {
        for (int r = 0; r < n_ranks; r++) {
            if (!gpu_pci[r] || !gpu_pci[r][0]) continue;
            gpu[r] = hwloc_get_pcidev_by_busidstring(t->hw, gpu_pci[r]);
            if (!gpu[r])
                return tdm_err_set(TDM_ENOTFOUND,
                                   "topology: rank %d's GPU %s is not on this machine's PCI tree",
                                   r, gpu_pci[r]);
            on_gpus = true;
        }
    } else if (t->n_gpus >= n_ranks) {
        for (int r = 0; r < n_ranks; r++)
            gpu[r] = t->gpus[r];
        on_gpus = true;
    }
    const int n_nodes = hwloc_get_nbobjs_by_type(t->hw, HWLOC_OBJ_NUMANODE);
    for (int r = 0; r < n_ranks; r++) {
        struct tdm_placement *p = &out[r];
        memset(p, 0, sizeof *p);
        p->rank = r;
        p->numa = -1;
        if (on_gpus && gpu[r]) {
            place_on_gpu(t, gpu[r], p);
        } else if (n_nodes > 0) {
            const int k = (int)((long)r * n_nodes / n_ranks);
            place_on_node(t, hwloc_get_obj_by_type(t->hw, HWLOC_OBJ_NUMANODE, (unsigned)k), p);
        } else {
            locality(p, hwloc_get_root_obj(t->hw));
        }
    }
    /* ranks sharing a NIC set start on different NICs of it */
    struct tdm_placement orig[64];
    memcpy(orig, out, (size_t)n_ranks * sizeof *out);
    for (int r = 0; r < n_ranks; r++) {
        int before = 0;
        for (int q = 0; q < r; q++)
            before += same_nics(&orig[q], &orig[r]);
        const int n = orig[r].n_nics;
        for (int i = 0; n && i < n; i++)
            out[r].nics[i] = orig[r].nics[(i + before) % n];
    }
    return TDM_OK;
}

int tdm_placement_describe(const struct tdm_placement *p, char *buf, size_t cap)
{
    static const char *const why[] = {
        [TDM_NEAR_NONE] = "no NIC on this machine: the loopback",
        [TDM_NEAR_PCIE_SWITCH] = "same PCIe switch as the GPU",
        [TDM_NEAR_PCIE_ROOT] = "same PCIe root complex as the GPU",
        [TDM_NEAR_NUMA] = "same NUMA node",
        [TDM_NEAR_HOST] = "none on this NUMA node: the host's",
    };
    char nics[TDM_TOPO_MAX_NICS * 34] = "";
    size_t off = 0;
    for (int i = 0; i < p->n_nics && off < sizeof nics; i++)
        off +=
            (size_t)snprintf(nics + off, sizeof nics - off, "%s%s", i ? ", " : "", p->nics[i].name);
    char numa[32] = "NUMA node ?";
    if (p->numa >= 0) snprintf(numa, sizeof numa, "NUMA node %d", p->numa);
    return snprintf(buf, cap, "rank %d: GPU %s, %s (cores %s), NIC%s %s (%s)", p->rank,
                    p->gpu_pci[0] ? p->gpu_pci : "none", numa, p->cpus[0] ? p->cpus : "?",
                    p->n_nics > 1 ? "s" : "", p->n_nics ? nics : "-", why[p->near]);
}

tdm_status tdm_thread_pin(const char *cpulist)
{
    if (!cpulist || !cpulist[0]) return TDM_OK;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (!set) return tdm_err_set(TDM_ENOMEM, "pin: out of memory");
    if (hwloc_bitmap_list_sscanf(set, cpulist) || hwloc_bitmap_iszero(set) ||
        hwloc_bitmap_last(set) >= CPU_SETSIZE || hwloc_bitmap_last(set) < 0) {
        hwloc_bitmap_free(set);
        return tdm_err_set(TDM_EINVAL, "pin: '%s' is not a list of cores", cpulist);
    }
    cpu_set_t cs;
    CPU_ZERO(&cs);
    unsigned cpu;
    hwloc_bitmap_foreach_begin(cpu, set) CPU_SET(cpu, &cs);
    hwloc_bitmap_foreach_end();
    hwloc_bitmap_free(set);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof cs, &cs);
    if (rc) return tdm_err_set(TDM_EIO, "pin: the OS refused cores %s (error %d)", cpulist, rc);
    return TDM_OK;
}

_Static_assert(sizeof(cpu_set_t) <= sizeof(struct tdm_thread_mask), "cpu_set_t is larger");

tdm_status tdm_thread_mask_get(struct tdm_thread_mask *m)
{
    cpu_set_t cs;
    CPU_ZERO(&cs);
    const int rc = pthread_getaffinity_np(pthread_self(), sizeof cs, &cs);
    if (rc) return tdm_err_set(TDM_EIO, "pin: cannot read this thread's cores (error %d)", rc);
    memset(m, 0, sizeof *m);
    memcpy(m->bits, &cs, sizeof cs);
    return TDM_OK;
}

tdm_status tdm_thread_mask_set(const struct tdm_thread_mask *m)
{
    cpu_set_t cs;
    memcpy(&cs, m->bits, sizeof cs);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof cs, &cs);
    if (rc) return tdm_err_set(TDM_EIO, "pin: cannot restore this thread's cores (error %d)", rc);
    return TDM_OK;
}
