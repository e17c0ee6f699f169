/*
 * xfer_shard_bench: bandwidth of sharded KV transfers (disagg.h, "sharded KV transfers"; issue
 * 17) for every (p, d) pair of prefill and decode TP, against the unsharded case (p = d = 1)
 * measured in the same run, over a libfabric provider.
 *
 *   xfer_shard_bench [--provider P] [--kv-heads H] [--head-dim D] [--layers L]
 *                    [--tokens N] [--chunk C] [--rounds R] [--tps 1,2,4]
 *
 * Shape: one process, two transfer engines joined over the provider, as two nodes are: the
 * prefill node's engine with each of its p ranks' pools registered, the decode node's with each
 * of its d ranks' pools (DESIGN.md §1.1: one transfer engine per node, every rank's KV memory
 * in it). A request of N tokens (page size 16, f32 pools: the CPU's) is sent as the prefill
 * node sends it: for every chunk of C tokens and every layer, one paged write per run of each
 * slice of the plan (tdm_disagg_shard_plan; pages in a random order on both sides, as a pool
 * hands them out, so runs do not merge across pages), each with its immediate; the decoder's
 * counter, armed for the plan's count, fires when the last lands, and that ends the timing.
 * The figure is the request's KV bytes over that time (every pair moves the same bytes); the
 * median of R rounds after an untimed one. Each round of a pair goes with a round of the
 * reference (p = d = 1, its pools kept open; before it in even rounds, after it in odd ones),
 * whose median is printed beside it with the ratio: the load of a shared machine drifts
 * within a table's run.
 *
 * Output check: every source rank's pages hold a pattern of (layer, page, K/V, KV head,
 * element), the same on each replica; after the last round every destination rank's pages are
 * compared with the pattern of its own heads (a page rebuilt from several ranks' slices must be
 * whole), and a checksum of the destination pools is printed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/disagg.h"
#include "tandem/xfer.h"

#define PAGE_SIZE 16
#define ELEM      4 /* f32 */

static struct {
    const char *provider;
    int heads, head_dim, layers, tokens, chunk, rounds;
    int tps[8], n_tps;
} opt = {"tcp;ofi_rxm", 8, 128, 8, 2048, 512, 5, {1, 2, 4}, 3};

static void die(const char *what)
{
    fprintf(stderr, "xfer_shard_bench: %s: %s\n", what, tdm_err_msg());
    exit(1);
}

static uint32_t pattern(int layer, uint32_t page, int kv, int head, size_t e)
{
    uint64_t x = ((uint64_t)layer << 48) ^ ((uint64_t)page << 28) ^ ((uint64_t)kv << 27) ^
                 ((uint64_t)head << 20) ^ e;
    x *= 0x9e3779b97f4a7c15ull;
    return (uint32_t)(x >> 32);
}

struct side {
    tdm_xfer_t *x;
    struct tdm_xfer_transport t;
    int ranks;
    uint32_t *pool[TDM_DISAGG_MAX_RANKS]; /* [layers][n_pages][2][heads_r][PAGE_SIZE][dim] */
    size_t page_bytes[TDM_DISAGG_MAX_RANKS], layer_bytes[TDM_DISAGG_MAX_RANKS];
    struct tdm_tp_kv_shard shard[TDM_DISAGG_MAX_RANKS];
    struct tdm_xfer_region reg[TDM_DISAGG_MAX_RANKS];
    struct tdm_xfer_rmem rmem[TDM_DISAGG_MAX_RANKS];
};

static tdm_xfer_t *engine(void)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = opt.provider;
    cfg.faults = "";
    cfg.max_jobs = 8192;
    cfg.peer_timeout_ms = 60000; /* a loaded machine may starve the heartbeats for seconds */
    tdm_xfer_t *x = NULL;
    if (tdm_xfer_create(&cfg, &x) != TDM_OK) die("opening the fabric");
    return x;
}

static void side_open(struct side *s, tdm_xfer_t *x, int ranks, int n_pages, bool fill)
{
    *s = (struct side){.x = x, .t = tdm_xfer_fabric_transport(x), .ranks = ranks};
    const size_t head_elems = (size_t)PAGE_SIZE * (size_t)opt.head_dim;
    for (int r = 0; r < ranks; r++) {
        if (tdm_tp_kv_shard_of(opt.heads, ranks, r, &s->shard[r]) != TDM_OK) die("sharding");
        const int nh = s->shard[r].n_kv_heads;
        s->page_bytes[r] = 2 * (size_t)nh * head_elems * ELEM;
        s->layer_bytes[r] = s->page_bytes[r] * (size_t)n_pages;
        size_t bytes = s->layer_bytes[r] * (size_t)opt.layers;
        s->pool[r] = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
        if (!s->pool[r]) die("out of memory");
        if (fill) {
            uint32_t *w = s->pool[r];
            for (int l = 0; l < opt.layers; l++)
                for (uint32_t pg = 0; pg < (uint32_t)n_pages; pg++)
                    for (int kv = 0; kv < 2; kv++)
                        for (int h = 0; h < nh; h++)
                            for (size_t e = 0; e < head_elems; e++)
                                *w++ = pattern(l, pg, kv, s->shard[r].kv_head0 + h, e);
        } else {
            memset(s->pool[r], 0, bytes);
        }
        if (s->t.iface->mr_reg(s->t.t, s->pool[r], bytes, TDM_XFER_MEM_HOST, &s->reg[r]) != TDM_OK)
            die("registering a pool");
        s->t.iface->mr_remote(s->t.t, &s->reg[r], &s->rmem[r]);
    }
}

static void side_close(struct side *s)
{
    for (int r = 0; r < s->ranks; r++) {
        s->t.iface->mr_dereg(s->t.t, &s->reg[r]);
        free(s->pool[r]);
    }
}

struct fired {
    int n;
    tdm_status st;
};
static void on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    (void)slot, (void)epoch;
    struct fired *f = ctx;
    f->st = st;
    __atomic_add_fetch(&f->n, 1, __ATOMIC_SEQ_CST);
}

/* One request from src to dst under plan; returns seconds from the first post to the last
 * immediate. */
static double request(struct side *src, struct side *dst, uint32_t peer,
                      const struct tdm_disagg_shard_plan *plan, const uint32_t *src_pages,
                      const uint32_t *dst_pages, uint32_t epoch)
{
    const int pages = opt.tokens / PAGE_SIZE, chunk_pages = opt.chunk / PAGE_SIZE;
    const int chunks = (pages + chunk_pages - 1) / chunk_pages;
    const uint32_t per_chunk = tdm_disagg_chunk_writes(plan, (uint32_t)opt.layers, 0);
    const uint64_t head_bytes = (uint64_t)PAGE_SIZE * (uint64_t)opt.head_dim * ELEM;
    struct fired f = {0};
    if (tdm_xfer_counters_arm(tdm_xfer_get_counters(dst->x), 0, epoch, (uint32_t)chunks * per_chunk,
                              TDM_XFER_ANY_PEER, 120000, on_fire, &f) != TDM_OK)
        die("arming the counter");
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    double t0 = (double)tdm_now_ns() * 1e-9;
    for (int c = 0; c < chunks; c++) {
        const int p0 = c * chunk_pages, n = TDM_MIN(chunk_pages, pages - p0);
        for (int l = 0; l < opt.layers; l++)
            for (int i = 0; i < plan->n_slices; i++) {
                const struct tdm_disagg_slice *sl = &plan->slices[i];
                struct tdm_disagg_run runs[2];
                int n_runs = tdm_disagg_slice_runs(sl, head_bytes, runs);
                for (int k = 0; k < n_runs; k++) {
                    struct tdm_xfer_pages pg = {
                        .src_pages = src_pages + p0,
                        .dst_pages = dst_pages + p0,
                        .n_pages = (uint32_t)n,
                        .page_bytes = runs[k].bytes,
                        .src_stride = src->page_bytes[sl->src_rank],
                        .dst_stride = dst->page_bytes[sl->dst_rank],
                        .src_offset =
                            (uint64_t)l * src->layer_bytes[sl->src_rank] + runs[k].src_offset,
                        .dst_offset =
                            (uint64_t)l * dst->layer_bytes[sl->dst_rank] + runs[k].dst_offset};
                    struct tdm_xfer_imm imm = {0, epoch,
                                               (uint32_t)c * per_chunk +
                                                   (uint32_t)(l * plan->writes + sl->write0 + k)};
                    tdm_xfer_sync_add(&s, 1);
                    tdm_status st;
                    while ((st = src->t.iface->write_pages(src->t.t, peer, &src->reg[sl->src_rank],
                                                           &dst->rmem[sl->dst_rank], &pg, &imm, 0,
                                                           tdm_xfer_sync_done, &s)) == TDM_EAGAIN)
                        usleep(20); /* back-pressure: the engine's queue is full */
                    if (st != TDM_OK) die("posting a write");
                }
            }
    }
    while (!__atomic_load_n(&f.n, __ATOMIC_SEQ_CST))
        usleep(20);
    double secs = (double)tdm_now_ns() * 1e-9 - t0;
    if (f.st != TDM_OK) die("the counter");
    if (tdm_xfer_sync_wait(&s, 120000) != TDM_OK) die("a write");
    tdm_xfer_sync_destroy(&s);
    return secs;
}

/* Every destination rank's written pages hold its own heads' pattern; returns a checksum. */
static uint64_t check(const struct side *dst, const uint32_t *src_pages, const uint32_t *dst_pages)
{
    const int pages = opt.tokens / PAGE_SIZE;
    const size_t head_elems = (size_t)PAGE_SIZE * (size_t)opt.head_dim;
    uint64_t sum = 1469598103934665603ull;
    for (int r = 0; r < dst->ranks; r++) {
        const int nh = dst->shard[r].n_kv_heads;
        for (int l = 0; l < opt.layers; l++)
            for (int i = 0; i < pages; i++) {
                const uint32_t *w =
                    (const uint32_t *)((const uint8_t *)dst->pool[r] + l * dst->layer_bytes[r] +
                                       dst_pages[i] * dst->page_bytes[r]);
                for (int kv = 0; kv < 2; kv++)
                    for (int h = 0; h < nh; h++)
                        for (size_t e = 0; e < head_elems; e++, w++) {
                            if (*w != pattern(l, src_pages[i], kv, dst->shard[r].kv_head0 + h, e)) {
                                fprintf(stderr,
                                        "xfer_shard_bench: rank %d layer %d page %d kv %d head %d: "
                                        "wrong bytes\n",
                                        r, l, i, kv, dst->shard[r].kv_head0 + h);
                                exit(1);
                            }
                            sum = (sum ^ *w) * 1099511628211ull;
                        }
            }
    }
    return sum;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) break;
        if (!strcmp(a, "--provider"))
            opt.provider = v;
        else if (!strcmp(a, "--kv-heads"))
            opt.heads = atoi(v);
        else if (!strcmp(a, "--head-dim"))
            opt.head_dim = atoi(v);
        else if (!strcmp(a, "--layers"))
            opt.layers = atoi(v);
        else if (!strcmp(a, "--tokens"))
            opt.tokens = atoi(v);
        else if (!strcmp(a, "--chunk"))
            opt.chunk = atoi(v);
        else if (!strcmp(a, "--rounds"))
            opt.rounds = atoi(v);
        else if (!strcmp(a, "--tps")) {
            opt.n_tps = 0;
            for (const char *p = v; *p && opt.n_tps < 8;
                 p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
                opt.tps[opt.n_tps++] = atoi(p);
        } else {
            fprintf(stderr, "xfer_shard_bench: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (opt.tokens % PAGE_SIZE || opt.chunk % PAGE_SIZE || opt.rounds < 1 || opt.layers < 1) {
        fprintf(stderr, "xfer_shard_bench: tokens and chunk must be whole pages of %d\n",
                PAGE_SIZE);
        return 2;
    }
    const int pages = opt.tokens / PAGE_SIZE, pool_pages = 2 * pages;
    /* the request's pages: distinct ids in a random order on each side (no runs merge) */
    uint32_t *src_pages = malloc(sizeof(uint32_t) * (size_t)pool_pages);
    uint32_t *dst_pages = malloc(sizeof(uint32_t) * (size_t)pool_pages);
    uint64_t rng = 0x5eed;
    for (int k = 0; k < 2; k++) {
        uint32_t *perm = k ? dst_pages : src_pages;
        for (int i = 0; i < pool_pages; i++)
            perm[i] = (uint32_t)i;
        for (int i = pool_pages - 1; i > 0; i--) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            int j = (int)((rng >> 33) % (uint64_t)(i + 1));
            uint32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
    }
    tdm_xfer_t *a = engine(), *b = engine();
    char addr[TDM_XFER_ADDR_MAX];
    uint32_t peer;
    if (tdm_xfer_addr(b, addr, sizeof addr) != TDM_OK ||
        tdm_xfer_peer_add(a, addr, &peer) != TDM_OK || tdm_xfer_peer_wait(a, peer, 10000) != TDM_OK)
        die("connecting the engines");
    const double kv_mib =
        (double)opt.layers * pages * 2.0 * opt.heads * PAGE_SIZE * opt.head_dim * ELEM / (1 << 20);
    printf("provider %s: a request of %d tokens, %d layers, %d KV heads of %d (f32, page %d): "
           "%.1f MiB of KV in chunks of %d tokens\n",
           opt.provider, opt.tokens, opt.layers, opt.heads, opt.head_dim, PAGE_SIZE, kv_mib,
           opt.chunk);
    printf("%-6s %-6s %10s %10s %10s %10s %9s  %s\n", "p", "d", "writes/l", "GB/s", "ms",
           "1x1 GB/s", "vs 1x1", "check");
    /* The reference (p = d = 1) stays open, and its rounds alternate with each pair's, so a
     * pair is compared with the reference measured in the same stretch of time: on a shared
     * machine the load drifts faster than a table's run. */
    struct side ref_src, ref_dst;
    side_open(&ref_src, a, 1, pool_pages, true);
    side_open(&ref_dst, b, 1, pool_pages, false);
    uint32_t epoch = 1;
    for (int k = 0; k < opt.n_tps * opt.n_tps; k++) {
        const int p = opt.tps[k / opt.n_tps], d = opt.tps[k % opt.n_tps];
        struct tdm_disagg_shard_plan plan, ref_plan;
        if (tdm_disagg_shard_plan(opt.heads, p, d, 0, &plan) != TDM_OK) {
            printf("%-6d %-6d  refused: %s\n", p, d, tdm_err_msg());
            continue;
        }
        if (tdm_disagg_shard_plan(opt.heads, 1, 1, 0, &ref_plan) != TDM_OK) die("planning");
        struct side src, dst;
        side_open(&src, a, p, pool_pages, true);
        side_open(&dst, b, d, pool_pages, false);
        double t[64], tr[64];
        int rounds = TDM_MIN(opt.rounds, 64);
        for (int r = -1; r < rounds; r++) {
            /* a new draw of replica sets per request, as the decoder seeds it */
            if (tdm_disagg_shard_plan(opt.heads, p, d, (uint64_t)(r + 2) * 7919, &plan) != TDM_OK)
                die("planning");
            double secs = 0, ref_secs = 0;
            for (int k = 0; k < 2; k++) { /* the reference first in even rounds, second in odd */
                epoch = epoch % 200 + 1;
                if ((k == 0) == (r % 2 == 0))
                    ref_secs =
                        request(&ref_src, &ref_dst, peer, &ref_plan, src_pages, dst_pages, epoch);
                else
                    secs = request(&src, &dst, peer, &plan, src_pages, dst_pages, epoch);
            }
            if (r >= 0) t[r] = secs, tr[r] = ref_secs;
        }
        qsort(t, (size_t)rounds, sizeof *t, cmp_double);
        qsort(tr, (size_t)rounds, sizeof *tr, cmp_double);
        const double bytes = kv_mib * (1 << 20);
        double gbs = bytes / t[rounds / 2] * 1e-9, ref_gbs = bytes / tr[rounds / 2] * 1e-9;
        uint64_t sum = check(&dst, src_pages, dst_pages);
        printf("%-6d %-6d %10d %10.2f %10.2f %10.2f %9.2f  ok %016llx\n", p, d, plan.writes, gbs,
               t[rounds / 2] * 1e3, ref_gbs, gbs / ref_gbs, (unsigned long long)sum);
        fflush(stdout);
        side_close(&src);
        side_close(&dst);
    }
    uint64_t ref_sum = check(&ref_dst, src_pages, dst_pages);
    printf("reference pages checked: ok %016llx\n", (unsigned long long)ref_sum);
    side_close(&ref_src);
    side_close(&ref_dst);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
    free(src_pages);
    free(dst_pages);
    return 0;
}
