/*
 * `tandem topo`: where N ranks would run on this machine (or on a topology XML file): each
 * rank's GPU, NUMA node and cores, and nearest NICs (include/tandem/topo.h). `tandem serve` uses
 * the same placement (tdm_tool_place) to pin its transfer threads and to export
 * tandem_rank_placement_info.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tandem/server.h"
#include "tools/tools_int.h"

static void topo_usage(FILE *f)
{
    fprintf(f, "usage: tandem topo [--ranks N] [--gpus BUSID[,BUSID...]] [--xml PATH] [--json]\n"
               "  --ranks N   ranks to place (1-64; default 1)\n"
               "  --gpus L    each rank's GPU by PCI bus id (default: the NVIDIA GPUs in bus "
               "order, or the NUMA nodes when there are fewer GPUs than ranks)\n"
               "  --xml PATH  a topology written by hwloc (lstopo PATH.xml) instead of this "
               "machine\n");
}

int tdm_tool_place(const char *xml, int n_ranks, const char *const *gpus, struct tdm_placement *out,
                   bool *this_system)
{
    tdm_topo_t *t = NULL;
    tdm_status st = tdm_topo_open(xml, &t);
    if (st == TDM_OK) st = tdm_topo_place(t, n_ranks, gpus, out);
    if (this_system) *this_system = t && tdm_topo_is_this_system(t);
    tdm_topo_close(t);
    if (st != TDM_OK) {
        fprintf(stderr, "tandem: %s\n", tdm_err_msg());
        return 1;
    }
    return 0;
}

char *tdm_tool_placement_metrics(const struct tdm_placement *p, int n_ranks)
{
    struct tdm_sbuf b = {0};
    tdm_prom_family(&b, "tandem_rank_placement_info", "gauge",
                    "Where each rank's transfers run: its GPU, NUMA node, cores and first NIC "
                    "(1 per rank; near says how the NIC was chosen)");
    for (int r = 0; r < n_ranks; r++) {
        char labels[512];
        snprintf(labels, sizeof labels,
                 "rank=\"%d\",gpu=\"%s\",numa=\"%d\",cpus=\"%s\",nic=\"%s\",nics=\"%d\","
                 "near=\"%s\"",
                 r, p[r].gpu_pci, p[r].numa, p[r].cpus, p[r].n_nics ? p[r].nics[0].name : "",
                 p[r].n_nics, tdm_topo_near_name(p[r].near));
        tdm_prom_sample(&b, "tandem_rank_placement_info", labels, 1);
    }
    return b.s;
}

int tdm_tool_serve_placement(int n_ranks, bool cuda, int cuda_device, const char *cpus,
                             struct tdm_placement *out, char *pin, size_t pin_cap)
{
    char ids[64][32];
    const char *gpus[64] = {0};
    for (int r = 0; r < n_ranks && r < 64; r++) {
        ids[r][0] = '\0';
        if (cuda && tdm_cuda_device_pci(cuda_device + r, ids[r], sizeof ids[r]) != TDM_OK)
            ids[r][0] = '\0';
        gpus[r] = ids[r];
    }
    bool here = false;
    if (tdm_tool_place(NULL, n_ranks, gpus, out, &here)) {
        fprintf(stderr, "tandem serve: warning: no placement; transfer threads not pinned\n");
        if (pin_cap) pin[0] = '\0';
        return 1;
    }
    for (int r = 0; r < n_ranks; r++) {
        char line[1024];
        tdm_placement_describe(&out[r], line, sizeof line);
        fprintf(stderr, "tandem serve: placement: %s\n", line);
    }
    /* the leader's cores take the node's transfer threads; a topology that is not this
     * machine's (HWLOC_XMLFILE) is reported, never pinned to */
    snprintf(pin, pin_cap, "%s", cpus ? cpus : here ? out[0].cpus : "");
    if (!cpus && !here)
        fprintf(stderr, "tandem serve: the topology is not this machine's (HWLOC_XMLFILE?): "
                        "transfer threads not pinned\n");
    return 0;
}

int tdm_cmd_topo(int argc, char **argv)
{
    const char *gpus_arg = NULL, *xml = NULL;
    int64_t n_ranks = 1;
    bool json = false;
    const struct tdm_opt own[] = {TDM_OPT_I("ranks", &n_ranks, 1, 64), TDM_OPT_S("gpus", &gpus_arg),
                                  TDM_OPT_S("xml", &xml), TDM_OPT_B("json", &json), TDM_OPT_END};
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("topo", argc, argv, tables, topo_usage);
    if (prc) return prc == 1 ? 0 : 2;

    char list[64 * 20] = "";
    const char *gpus[64] = {0};
    if (gpus_arg) {
        snprintf(list, sizeof list, "%s", gpus_arg);
        int n = 0;
        for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok;
             tok = strtok_r(NULL, ",", &save)) {
            if (n == n_ranks) {
                fprintf(stderr, "tandem topo: --gpus names more GPUs than --ranks %d\n",
                        (int)n_ranks);
                return 2;
            }
            gpus[n++] = tok;
        }
        if (n != n_ranks) {
            fprintf(stderr, "tandem topo: --gpus names %d GPU%s for %d ranks\n", n,
                    n == 1 ? "" : "s", (int)n_ranks);
            return 2;
        }
    }
    struct tdm_placement p[64];
    bool here = false;
    if (tdm_tool_place(xml, (int)n_ranks, gpus_arg ? gpus : NULL, p, &here)) return 1;
    if (!json) {
        for (int r = 0; r < (int)n_ranks; r++) {
            char line[1024];
            tdm_placement_describe(&p[r], line, sizeof line);
            printf("%s\n", line);
        }
        return 0;
    }
    json_t *ranks = json_array();
    for (int r = 0; r < (int)n_ranks; r++) {
        json_t *nics = json_array();
        for (int i = 0; i < p[r].n_nics; i++)
            json_array_append_new(nics,
                                  json_pack("{s:s, s:s, s:b}", "name", p[r].nics[i].name, "pci",
                                            p[r].nics[i].pci, "rdma", p[r].nics[i].rdma));
        json_array_append_new(ranks, json_pack("{s:i, s:s?, s:i, s:s, s:o, s:s}", "rank", r, "gpu",
                                               p[r].gpu_pci[0] ? p[r].gpu_pci : NULL, "numa",
                                               p[r].numa, "cpus", p[r].cpus, "nics", nics, "near",
                                               tdm_topo_near_name(p[r].near)));
    }
    json_t *obj = json_pack("{s:b, s:o}", "this_system", here, "ranks", ranks);
    char *s = json_dumps(obj, JSON_INDENT(2));
    printf("%s\n", s);
    free(s);
    json_decref(obj);
    return 0;
}
