/*
 * xfer_stage_bench: measures host staging (src/xfer/staged.c, src/xfer/copier.c), the path of GPU
 * KV pages between hosts whose fabric cannot register GPU memory, against references measured
 * in the same run.
 *
 *   xfer_stage_bench [--provider P] [--page KIB] [--pages-per-write N] [--mib TOTAL] [--host]
 *
 * Pages are scattered (a random permutation of a region's pages, N per paged write, like a
 * layer's pages of one prefill chunk). Three measurements, each with its reference:
 *   gather:  the copier's gather of pages from the region into pinned host memory, against one
 *            contiguous copy of the same bytes (cudaMemcpyAsync device to pinned host: the
 *            link's bandwidth, measured now);
 *   scatter: the copier's scatter from pinned host memory into the region's pages, against one
 *            contiguous host-to-device copy;
 *   staged:  paged writes through the staged writer (gather into its ring, then an RMA write
 *            into a second engine's host pages, immediates counted there), against the same
 *            paged writes from registered host memory straight through the fabric.
 * Without a GPU (or with --host) the region is host memory and the copier memcpy, and the
 * references are one memcpy of the same bytes. Each line prints GB/s and the ratio of ours to
 * the reference (1: as fast).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef TDM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "tandem/xfer.h"

static struct {
    const char *provider;
    size_t page, per_write, total;
    bool host;
} opt = {"shm", 64 * 1024, 16, 1024ull << 20, false};

static double now_s(void)
{
    return (double)tdm_now_ns() * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "xfer_stage_bench: %s: %s\n", what, tdm_err_msg());
    exit(1);
}

/* ---- memory of the region: device (CUDA) or host ---- */
static bool use_gpu;
static void *region_alloc(size_t bytes)
{
#ifdef TDM_HAVE_CUDA
    if (use_gpu) {
        void *p = NULL;
        if (cudaMalloc(&p, bytes) != cudaSuccess) return NULL;
        cudaMemset(p, 0x5a, bytes);
        cudaDeviceSynchronize();
        return p;
    }
#endif
    void *p = malloc(bytes);
    if (p) memset(p, 0x5a, bytes);
    return p;
}
static void region_free(void *p)
{
#ifdef TDM_HAVE_CUDA
    if (use_gpu) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}
/* One contiguous copy of `bytes` (to_host: region -> host), the reference; seconds. */
static double reference_copy(void *region, void *host, size_t bytes, bool to_host, int reps)
{
    double t0 = now_s();
#ifdef TDM_HAVE_CUDA
    if (use_gpu) {
        for (int r = 0; r < reps; r++)
            cudaMemcpyAsync(to_host ? host : region, to_host ? region : host, bytes,
                            to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice, 0);
        cudaDeviceSynchronize();
        return (now_s() - t0) / reps;
    }
#endif
    for (int r = 0; r < reps; r++)
        memcpy(to_host ? host : region, to_host ? region : host, bytes);
    return (now_s() - t0) / reps;
}

/* ---- copies through the copier ---- */
static void wait_sync(struct tdm_xfer_sync *s)
{
    if (tdm_xfer_sync_wait(s, 120000) != TDM_OK) die("waiting");
}

static double copier_run(struct tdm_xfer_copier *c, void *region, void *host, size_t region_pages,
                         const uint32_t *perm, bool gather)
{
    size_t n_writes = region_pages / opt.per_write;
    static uint32_t iota[TDM_XFER_COPY_MAX_PAGES];
    for (uint32_t i = 0; i < TDM_XFER_COPY_MAX_PAGES; i++)
        iota[i] = i;
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    double t0 = now_s();
    for (size_t w = 0; w < n_writes; w++) {
        const uint32_t *scattered = perm + w * opt.per_write;
        struct tdm_xfer_pages p = {.src_pages = gather ? scattered : iota,
                                   .dst_pages = gather ? iota : scattered,
                                   .n_pages = (uint32_t)opt.per_write,
                                   .page_bytes = opt.page,
                                   .src_stride = opt.page,
                                   .dst_stride = opt.page,
                                   .src_offset = gather ? 0 : w * opt.per_write * opt.page,
                                   .dst_offset = gather ? w * opt.per_write * opt.page : 0};
        size_t bytes = region_pages * opt.page;
        tdm_xfer_sync_add(&s, 1);
        if (c->iface->copy_pages(c->c, gather ? region : host, bytes, gather ? host : region, bytes,
                                 &p, tdm_xfer_sync_done, &s) != TDM_OK)
            die("copy");
    }
    wait_sync(&s);
    double t = now_s() - t0;
    tdm_xfer_sync_destroy(&s);
    return t;
}

/* ---- paged writes through a transport, immediates counted by the receiver ---- */
struct fired {
    int n;
};
static void on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    (void)slot, (void)epoch;
    if (st == TDM_OK) __atomic_add_fetch(&((struct fired *)ctx)->n, 1, __ATOMIC_SEQ_CST);
}

static double writes_run(struct tdm_xfer_transport t, const struct tdm_xfer_region *src,
                         uint32_t peer, const struct tdm_xfer_rmem *dst, tdm_xfer_t *owner,
                         size_t region_pages, const uint32_t *perm, uint32_t slot)
{
    size_t n_writes = region_pages / opt.per_write;
    struct fired f = {0};
    if (tdm_xfer_counters_arm(tdm_xfer_get_counters(owner), slot, 1, (uint32_t)n_writes,
                              TDM_XFER_ANY_PEER, 120000, on_fire, &f) != TDM_OK)
        die("arming the counter");
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    double t0 = now_s();
    for (size_t w = 0; w < n_writes; w++) {
        const uint32_t *scattered = perm + w * opt.per_write;
        struct tdm_xfer_pages p = {.src_pages = scattered,
                                   .dst_pages = scattered,
                                   .n_pages = (uint32_t)opt.per_write,
                                   .page_bytes = opt.page,
                                   .src_stride = opt.page,
                                   .dst_stride = opt.page};
        struct tdm_xfer_imm imm = {slot, 1, (uint32_t)w};
        tdm_xfer_sync_add(&s, 1);
        tdm_status st;
        while ((st = t.iface->write_pages(t.t, peer, src, dst, &p, &imm, 0, tdm_xfer_sync_done,
                                          &s)) == TDM_EAGAIN)
            usleep(20); /* back-pressure: the queue or the ring is full */
        if (st != TDM_OK) die("posting a write");
    }
    wait_sync(&s);
    while (!__atomic_load_n(&f.n, __ATOMIC_SEQ_CST))
        usleep(50);
    double secs = now_s() - t0;
    tdm_xfer_sync_destroy(&s);
    return secs;
}

static tdm_xfer_t *engine(void)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = opt.provider;
    cfg.faults = "";
    cfg.max_jobs = 4096;
    tdm_xfer_t *x = NULL;
    if (tdm_xfer_create(&cfg, &x) != TDM_OK) die("opening the fabric");
    return x;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--provider") && i + 1 < argc)
            opt.provider = argv[++i];
        else if (!strcmp(argv[i], "--page") && i + 1 < argc)
            opt.page = (size_t)atol(argv[++i]) * 1024;
        else if (!strcmp(argv[i], "--pages-per-write") && i + 1 < argc)
            opt.per_write = (size_t)atol(argv[++i]);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc)
            opt.total = (size_t)atol(argv[++i]) << 20;
        else if (!strcmp(argv[i], "--host"))
            opt.host = true;
        else {
            fprintf(stderr, "usage: xfer_stage_bench [--provider P] [--page KIB] "
                            "[--pages-per-write N] [--mib TOTAL] [--host]\n");
            return 2;
        }
    }
    if (!opt.page || !opt.per_write || opt.per_write > TDM_XFER_COPY_MAX_PAGES ||
        opt.total < opt.page * opt.per_write) {
        fprintf(stderr, "xfer_stage_bench: bad sizes\n");
        return 2;
    }
    struct tdm_xfer_copier cp = {0};
    use_gpu = !opt.host && tdm_xfer_copier_cuda(0, &cp) == TDM_OK;
    if (!use_gpu && tdm_xfer_copier_host(&cp) != TDM_OK) die("the host copier");
    size_t pages = opt.total / opt.page / opt.per_write * opt.per_write;
    size_t bytes = pages * opt.page;
    uint32_t *perm = malloc(pages * sizeof *perm);
    srand(7);
    for (size_t i = 0; i < pages; i++)
        perm[i] = (uint32_t)i;
    for (size_t i = pages - 1; i > 0; i--) {
        size_t j = (size_t)rand() % (i + 1);
        uint32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    void *region = region_alloc(bytes);
    void *pinned = cp.iface->host_alloc(cp.c, bytes);
    if (!region || !pinned) die("allocating");
    memset(pinned, 0xa5, bytes);
    printf("xfer_stage_bench: %s region, copier %s, fabric %s; %zu pages of %zu KiB, %zu per "
           "write, %zu MiB\n",
           use_gpu ? "GPU" : "host", cp.iface->name, opt.provider, pages, opt.page >> 10,
           opt.per_write, bytes >> 20);
    /* warm-up, then the measurements */
    copier_run(&cp, region, pinned, pages, perm, true);
    reference_copy(region, pinned, bytes, true, 1);
    double ref_d2h = reference_copy(region, pinned, bytes, true, 3);
    double gather = copier_run(&cp, region, pinned, pages, perm, true);
    double ref_h2d = reference_copy(region, pinned, bytes, false, 3);
    double scatter = copier_run(&cp, region, pinned, pages, perm, false);
    double gb = (double)bytes * 1e-9;
    printf("gather  (region -> pinned, scattered pages): %7.2f GB/s; one contiguous copy %7.2f "
           "GB/s; ratio %.2f\n",
           gb / gather, gb / ref_d2h, ref_d2h / gather);
    printf("scatter (pinned -> region, scattered pages): %7.2f GB/s; one contiguous copy %7.2f "
           "GB/s; ratio %.2f\n",
           gb / scatter, gb / ref_h2d, ref_h2d / scatter);

    /* staged writes vs fabric writes from host memory, into a second engine's host pages */
    tdm_xfer_t *a = engine(), *b = engine();
    char addr[TDM_XFER_ADDR_MAX];
    uint32_t peer;
    if (tdm_xfer_addr(b, addr, sizeof addr) != TDM_OK ||
        tdm_xfer_peer_add(a, addr, &peer) != TDM_OK || tdm_xfer_peer_wait(a, peer, 10000) != TDM_OK)
        die("connecting the engines");
    struct tdm_xfer_transport fa = tdm_xfer_fabric_transport(a), fb = tdm_xfer_fabric_transport(b);
    void *dst = malloc(bytes);
    memset(dst, 0, bytes);
    struct tdm_xfer_region rdst, rhost, rstage;
    struct tdm_xfer_rmem rm;
    if (fb.iface->mr_reg(fb.t, dst, bytes, TDM_XFER_MEM_HOST, &rdst) != TDM_OK ||
        fa.iface->mr_reg(fa.t, pinned, bytes, TDM_XFER_MEM_HOST, &rhost) != TDM_OK)
        die("registering");
    fb.iface->mr_remote(fb.t, &rdst, &rm);
    struct tdm_xfer_staged_config sc = {.fabric = fa, .copier = cp};
    tdm_xfer_staged_t *st = NULL;
    if (tdm_xfer_staged_create(&sc, &st) != TDM_OK) die("the staged writer");
    struct tdm_xfer_transport ts = tdm_xfer_staged_transport(st);
    if (ts.iface->mr_reg(ts.t, region, bytes, use_gpu ? TDM_XFER_MEM_CUDA : TDM_XFER_MEM_HOST,
                         &rstage) != TDM_OK)
        die("registering the staged source");
    writes_run(fa, &rhost, peer, &rm, b, pages, perm, 1); /* warm-up */
    double direct = writes_run(fa, &rhost, peer, &rm, b, pages, perm, 2);
    writes_run(ts, &rstage, peer, &rm, b, pages, perm, 3);
    double staged = writes_run(ts, &rstage, peer, &rm, b, pages, perm, 4);
    struct tdm_xfer_staged_stats ss;
    tdm_xfer_staged_get_stats(st, &ss);
    printf("staged  (region -> ring -> %s -> host pages): %7.2f GB/s; the fabric from host "
           "memory %7.2f GB/s; ratio %.2f (ring %llu MiB, at most %.1f MiB held, %llu refusals)\n",
           opt.provider, gb / staged, gb / direct, direct / staged,
           (unsigned long long)(ss.ring_bytes >> 20), (double)ss.ring_high / (1 << 20),
           (unsigned long long)ss.ring_full);
    ts.iface->mr_dereg(ts.t, &rstage);
    tdm_xfer_staged_destroy(st);
    fa.iface->mr_dereg(fa.t, &rhost);
    fb.iface->mr_dereg(fb.t, &rdst);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
    cp.iface->host_free(cp.c, pinned, bytes);
    tdm_xfer_copier_destroy(&cp);
    region_free(region);
    free(dst);
    free(perm);
    return 0;
}
