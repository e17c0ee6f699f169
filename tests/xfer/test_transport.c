/* One check of the transport ops table (include/tandem/xfer.h), run over every transport:
 *   - libfabric (shm) between two engines of this process, host memory;
 *   - CUDA IPC between two processes (the real IPC path: the writer opens the owner's handle,
 *     and the immediate crosses to the owner's engine over the control channel);
 *   - CUDA IPC inside one process (the destination written through its own pointer);
 *   - host staging (the staged writer over shm, with host memory, then GPU memory through the
 *     CUDA copier), and the staging ring's pieces, back-pressure and failures, driven by a
 *     copier whose copies end when the test says.
 * Each registers a source and a destination, posts a paged write (three scattered pages) and a
 * single write, each with an immediate, and checks that the owner's counter fired once with
 * TDM_OK and that every byte landed where the page lists say, and nowhere else. The CUDA cases
 * skip, saying so, where there is no GPU. The cross-process case forks before this process
 * touches CUDA, so it runs first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef TDM_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "fire_log.h"
#include "tandem/xfer.h"

enum { PAGE = 4096, NP = 8, DST_BYTES = (NP + 1) * PAGE, SLOT = 3, EPOCH = 1 };
static const uint32_t SRC_PAGES[] = {7, 0, 3}, DST_PAGES[] = {0, 5, 2};

/* ---- memory of one kind ---- */
struct mem_ops {
    enum tdm_xfer_mem_kind kind;
    void *(*alloc)(size_t bytes); /* zeroed */
    void (*release)(void *p);
    void (*put)(void *dst, const void *host, size_t bytes);
    void (*get)(void *host, const void *src, size_t bytes);
};

static void *host_alloc(size_t bytes)
{
    return calloc(1, bytes);
}
static void host_put(void *dst, const void *src, size_t bytes)
{
    memcpy(dst, src, bytes);
}
static const struct mem_ops HOST_MEM = {TDM_XFER_MEM_HOST, host_alloc, free, host_put, host_put};

#ifdef TDM_HAVE_CUDA
static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    if (cudaMalloc(&p, bytes) != cudaSuccess) return NULL;
    cudaMemset(p, 0, bytes);
    return p;
}
static void dev_release(void *p)
{
    cudaFree(p);
}
static void dev_put(void *dst, const void *src, size_t bytes)
{
    cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
}
static void dev_get(void *dst, const void *src, size_t bytes)
{
    cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
}
static const struct mem_ops DEV_MEM = {TDM_XFER_MEM_CUDA, dev_alloc, dev_release, dev_put, dev_get};
#endif

static uint8_t src_byte(size_t i)
{
    return (uint8_t)(i * 13 + 5);
}

/* The destination as it must be after both writes: 0 where nothing was written. */
static void expected_dst(uint8_t *want)
{
    memset(want, 0, DST_BYTES);
    for (int i = 0; i < 3; i++)
        for (int b = 0; b < PAGE; b++)
            want[DST_PAGES[i] * PAGE + b] = src_byte(SRC_PAGES[i] * PAGE + (size_t)b);
    for (int b = 0; b < PAGE; b++) /* the single write: source page 1 to the spare page */
        want[NP * PAGE + b] = src_byte(PAGE + (size_t)b);
}

static tdm_xfer_t *open_engine(void)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = "shm";
    cfg.faults = "";
    tdm_xfer_t *x = NULL;
    return tdm_xfer_create(&cfg, &x) == TDM_OK ? x : NULL;
}

/* The writer's half: source registered on `ta`, both writes posted to `peer`, then waited. */
static void write_side(struct tdm_xfer_transport ta, const struct mem_ops *m, uint32_t peer,
                       const struct tdm_xfer_rmem *dst)
{
    uint8_t *host = malloc(NP * PAGE);
    for (size_t i = 0; i < NP * PAGE; i++)
        host[i] = src_byte(i);
    void *src = m->alloc(NP * PAGE);
    assert_non_null(src);
    m->put(src, host, NP * PAGE);
    struct tdm_xfer_region rs;
    assert_int_equal(ta.iface->mr_reg(ta.t, src, NP * PAGE, m->kind, &rs), TDM_OK);
    assert_ptr_equal(rs.base, src);
    struct tdm_xfer_pages p = {SRC_PAGES, DST_PAGES, 3, PAGE, PAGE, PAGE, 0, 0};
    /* a page past the destination is refused, and its done never fires */
    uint32_t bad_dst[] = {0, 5, NP + 1};
    struct tdm_xfer_pages bad = p;
    bad.dst_pages = bad_dst;
    struct tdm_xfer_imm i0 = {SLOT, EPOCH, 0}, i1 = {SLOT, EPOCH, 1};
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    assert_int_not_equal(
        ta.iface->write_pages(ta.t, peer, &rs, dst, &bad, &i0, 0, tdm_xfer_sync_done, &s), TDM_OK);
    tdm_xfer_sync_add(&s, 2);
    assert_int_equal(
        ta.iface->write_pages(ta.t, peer, &rs, dst, &p, &i0, 0, tdm_xfer_sync_done, &s), TDM_OK);
    assert_int_equal(ta.iface->write(ta.t, peer, &rs, PAGE, dst, (uint64_t)NP * PAGE, PAGE, &i1, 0,
                                     tdm_xfer_sync_done, &s),
                     TDM_OK);
    assert_int_equal(tdm_xfer_sync_wait(&s, 10000), TDM_OK);
    assert_int_equal(ta.iface->poll(ta.t), 0); /* both transports progress on their own */
    tdm_xfer_sync_destroy(&s);
    ta.iface->mr_dereg(ta.t, &rs);
    assert_null(rs.impl);
    m->release(src);
    free(host);
}

/* The owner's half: destination registered on `tb`, its counter armed for two immediates. */
struct owner {
    void *dst;
    struct tdm_xfer_region rd;
    struct tdm_xfer_rmem rmem;
    struct fire_log fl;
};
static void owner_open(struct owner *o, struct tdm_xfer_transport tb, tdm_xfer_t *b,
                       const struct mem_ops *m)
{
    memset(o, 0, sizeof(*o));
    o->dst = m->alloc(DST_BYTES);
    assert_non_null(o->dst);
    assert_int_equal(tb.iface->mr_reg(tb.t, o->dst, DST_BYTES, m->kind, &o->rd), TDM_OK);
    assert_int_equal(o->rd.bytes, DST_BYTES);
    tb.iface->mr_remote(tb.t, &o->rd, &o->rmem);
    assert_int_equal(o->rmem.bytes, DST_BYTES);
    assert_int_equal(o->rmem.kind, m->kind);
    assert_int_equal(tdm_xfer_counters_arm(tdm_xfer_get_counters(b), SLOT, EPOCH, 2,
                                           TDM_XFER_ANY_PEER, 10000, on_fire, &o->fl),
                     TDM_OK);
}
/* Returns the number of wrong bytes after the counter fired (or -1 when it did not). */
static int owner_check(struct owner *o, struct tdm_xfer_transport tb, const struct mem_ops *m)
{
    int fired = wait_fired(&o->fl, 10000);
    int bad = -1;
    if (fired == 1 && o->fl.last == TDM_OK) {
        uint8_t *got = malloc(DST_BYTES), *want = malloc(DST_BYTES);
        m->get(got, o->dst, DST_BYTES);
        expected_dst(want);
        bad = 0;
        for (int i = 0; i < DST_BYTES; i++)
            bad += got[i] != want[i];
        free(got);
        free(want);
    } else {
        fprintf(stderr, "counter fired %d times, last status %d\n", fired, (int)o->fl.last);
    }
    tb.iface->mr_dereg(tb.t, &o->rd);
    m->release(o->dst);
    return bad;
}

static void test_fabric(void **state)
{
    (void)state;
    tdm_xfer_t *a = open_engine(), *b = open_engine();
    assert_non_null(a);
    assert_non_null(b);
    struct tdm_xfer_transport ta = tdm_xfer_fabric_transport(a), tb = tdm_xfer_fabric_transport(b);
    assert_string_equal(ta.iface->name, "libfabric");
    struct tdm_xfer_caps caps;
    ta.iface->get_caps(ta.t, &caps);
    assert_string_equal(caps.provider, "shm");
    uint32_t peer = connect_engines(a, b);
    struct owner o;
    owner_open(&o, tb, b, &HOST_MEM);
    write_side(ta, &HOST_MEM, peer, &o.rmem);
    assert_int_equal(owner_check(&o, tb, &HOST_MEM), 0);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
}

/* ---- host staging: the staged writer over the fabric (shm), host memory standing in for
 * device memory ---- */
static void test_staged(void **state)
{
    (void)state;
    tdm_xfer_t *a = open_engine(), *b = open_engine();
    assert_non_null(a);
    assert_non_null(b);
    struct tdm_xfer_copier cp;
    assert_int_equal(tdm_xfer_copier_host(&cp), TDM_OK);
    struct tdm_xfer_staged_config sc = {.fabric = tdm_xfer_fabric_transport(a), .copier = cp};
    tdm_xfer_staged_t *st = NULL;
    assert_int_equal(tdm_xfer_staged_create(&sc, &st), TDM_OK);
    struct tdm_xfer_transport ta = tdm_xfer_staged_transport(st), tb = tdm_xfer_fabric_transport(b);
    assert_string_equal(ta.iface->name, "staged");
    uint32_t peer = connect_engines(a, b);
    struct owner o;
    owner_open(&o, tb, b, &HOST_MEM);
    /* a GPU destination is refused: staging writes into host landing pages */
    struct tdm_xfer_rmem gpu = o.rmem;
    gpu.kind = TDM_XFER_MEM_CUDA;
    uint8_t src[PAGE];
    struct tdm_xfer_region rs;
    assert_int_equal(ta.iface->mr_reg(ta.t, src, sizeof src, TDM_XFER_MEM_HOST, &rs), TDM_OK);
    assert_int_equal(ta.iface->write(ta.t, peer, &rs, 0, &gpu, 0, PAGE, NULL, 0, NULL, NULL),
                     TDM_EINVAL);
    ta.iface->mr_dereg(ta.t, &rs);
    write_side(ta, &HOST_MEM, peer, &o.rmem);
    assert_int_equal(owner_check(&o, tb, &HOST_MEM), 0);
    struct tdm_xfer_staged_stats ss;
    tdm_xfer_staged_get_stats(st, &ss);
    assert_int_equal(ss.writes, 2);
    assert_int_equal(ss.bytes, 4 * PAGE);
    assert_int_equal(ss.ring_used, 0);
    assert_int_equal(ss.failed, 0);
    tdm_xfer_staged_destroy(st);
    tdm_xfer_copier_destroy(&cp);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
}

/* A copier whose copies finish only when the test opens its gate (memcpy then). */
struct gated {
    pthread_mutex_t mu;
    int n_held;
    struct held {
        const void *src;
        void *dst;
        struct tdm_xfer_pages p;
        uint32_t ids[64];
        tdm_xfer_done_fn done;
        void *ctx;
    } held[64];
};
static void *gated_alloc(void *c, size_t bytes)
{
    (void)c;
    return calloc(1, bytes);
}
static void gated_free(void *c, void *p, size_t bytes)
{
    (void)c, (void)bytes;
    free(p);
}
static tdm_status gated_copy(void *c, const void *src, size_t src_bytes, void *dst,
                             size_t dst_bytes, const struct tdm_xfer_pages *p,
                             tdm_xfer_done_fn done, void *ctx)
{
    (void)src_bytes, (void)dst_bytes;
    struct gated *g = c;
    pthread_mutex_lock(&g->mu);
    assert_true(g->n_held < 64 && p->n_pages <= 32);
    struct held *h = &g->held[g->n_held++];
    *h = (struct held){.src = src, .dst = dst, .p = *p, .done = done, .ctx = ctx};
    memcpy(h->ids, p->src_pages, 4 * p->n_pages);
    memcpy(h->ids + 32, p->dst_pages, 4 * p->n_pages);
    h->p.src_pages = h->ids;
    h->p.dst_pages = h->ids + 32;
    pthread_mutex_unlock(&g->mu);
    return TDM_OK;
}
/* Completes every held copy (with st; memcpy when TDM_OK). */
static int gated_open(struct gated *g, tdm_status st)
{
    pthread_mutex_lock(&g->mu);
    int n = g->n_held;
    struct held h[64];
    memcpy(h, g->held, sizeof(struct held) * (size_t)n);
    g->n_held = 0;
    pthread_mutex_unlock(&g->mu);
    for (int k = 0; k < n; k++) {
        for (uint32_t i = 0; st == TDM_OK && i < h[k].p.n_pages; i++)
            memcpy((uint8_t *)h[k].dst + h[k].p.dst_offset +
                       (uint64_t)h[k].ids[32 + i] * h[k].p.dst_stride,
                   (const uint8_t *)h[k].src + h[k].p.src_offset +
                       (uint64_t)h[k].ids[i] * h[k].p.src_stride,
                   h[k].p.page_bytes);
        h[k].done(h[k].ctx, st);
    }
    return n;
}
static void gated_noop(void *c)
{
    (void)c;
}
static const struct tdm_xfer_copier_i GATED = {"gated",    gated_alloc, gated_free,
                                               gated_copy, gated_noop,  gated_noop};

static int held_now(struct gated *g)
{
    pthread_mutex_lock(&g->mu);
    int n = g->n_held;
    pthread_mutex_unlock(&g->mu);
    return n;
}

/* A 16-page write through a 16 KiB ring (pieces of a quarter: 4 pages of 1 KiB): four pieces,
 * the immediate on the last one only, once the others are in place. While its copies are held,
 * the ring is full and a second write is refused (back-pressure), then goes through. */
static void test_staged_pieces_and_backpressure(void **state)
{
    (void)state;
    enum { KP = 1024, N = 16 };
    tdm_xfer_t *a = open_engine(), *b = open_engine();
    assert_non_null(a);
    assert_non_null(b);
    struct gated g = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct tdm_xfer_staged_config sc = {
        .fabric = tdm_xfer_fabric_transport(a), .copier = {&GATED, &g}, .ring_bytes = 16 * KP};
    tdm_xfer_staged_t *st = NULL;
    assert_int_equal(tdm_xfer_staged_create(&sc, &st), TDM_OK);
    struct tdm_xfer_transport ta = tdm_xfer_staged_transport(st), tb = tdm_xfer_fabric_transport(b);
    uint32_t peer = connect_engines(a, b);
    uint8_t *src = malloc(N * KP), *dst = calloc(1, 2 * N * KP);
    for (int i = 0; i < N * KP; i++)
        src[i] = (uint8_t)(i * 7 + 3);
    struct tdm_xfer_region rs, rd;
    assert_int_equal(ta.iface->mr_reg(ta.t, src, N * KP, TDM_XFER_MEM_HOST, &rs), TDM_OK);
    assert_int_equal(tb.iface->mr_reg(tb.t, dst, 2 * N * KP, TDM_XFER_MEM_HOST, &rd), TDM_OK);
    struct tdm_xfer_rmem rm;
    tb.iface->mr_remote(tb.t, &rd, &rm);
    struct fire_log fl = {0};
    assert_int_equal(tdm_xfer_counters_arm(tdm_xfer_get_counters(b), SLOT, EPOCH, 2,
                                           TDM_XFER_ANY_PEER, 10000, on_fire, &fl),
                     TDM_OK);
    uint32_t sp[N], dp[N], dp2[N];
    for (int i = 0; i < N; i++) /* reversed pages: nothing merges by accident */
        sp[i] = (uint32_t)i, dp[i] = (uint32_t)(N - 1 - i), dp2[i] = (uint32_t)(2 * N - 1 - i);
    struct tdm_xfer_pages pg = {sp, dp, N, KP, KP, KP, 0, 0}, pg2 = {sp, dp2, N, KP, KP, KP, 0, 0};
    /* a page larger than a quarter of the ring cannot be staged */
    struct tdm_xfer_pages big = {sp, dp, 1, 5 * KP, 5 * KP, 5 * KP, 0, 0};
    assert_int_equal(ta.iface->write_pages(ta.t, peer, &rs, &rm, &big, NULL, 0, NULL, NULL),
                     TDM_ERANGE);
    struct tdm_xfer_imm i0 = {SLOT, EPOCH, 0}, i1 = {SLOT, EPOCH, 1};
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    tdm_xfer_sync_add(&s, 1);
    assert_int_equal(
        ta.iface->write_pages(ta.t, peer, &rs, &rm, &pg, &i0, 0, tdm_xfer_sync_done, &s), TDM_OK);
    for (int i = 0; i < 500 && held_now(&g) < 4; i++) /* the worker takes the other pieces */
        usleep(2000);
    assert_int_equal(held_now(&g), 4);
    struct tdm_xfer_staged_stats ss;
    tdm_xfer_staged_get_stats(st, &ss);
    assert_int_equal(ss.ring_used, 16 * KP);
    assert_int_equal(
        ta.iface->write_pages(ta.t, peer, &rs, &rm, &pg2, &i1, 0, tdm_xfer_sync_done, &s),
        TDM_EAGAIN);
    /* nothing landed before its copy: the immediate waits for every piece */
    assert_int_equal(__atomic_load_n(&fl.n, __ATOMIC_SEQ_CST), 0);
    assert_int_equal(gated_open(&g, TDM_OK), 4);
    assert_int_equal(tdm_xfer_sync_wait(&s, 10000), TDM_OK);
    tdm_xfer_sync_add(&s, 1);
    tdm_status rc;
    while ((rc = ta.iface->write_pages(ta.t, peer, &rs, &rm, &pg2, &i1, 0, tdm_xfer_sync_done,
                                       &s)) == TDM_EAGAIN) /* the ring drains as writes end */
        usleep(1000);
    assert_int_equal(rc, TDM_OK);
    for (int i = 0; i < 2000 && tdm_xfer_sync_wait(&s, 1) != TDM_OK; i++)
        gated_open(&g, TDM_OK);
    assert_int_equal(wait_fired(&fl, 10000), 1);
    assert_int_equal(fl.last, TDM_OK);
    for (int i = 0; i < N; i++)
        for (int k = 0; k < KP; k++) {
            assert_int_equal(dst[(N - 1 - i) * KP + k], src[i * KP + k]);
            assert_int_equal(dst[(2 * N - 1 - i) * KP + k], src[i * KP + k]);
        }
    tdm_xfer_staged_get_stats(st, &ss);
    assert_int_equal(ss.writes, 2);
    assert_int_equal(ss.pieces, 8);
    assert_true(ss.ring_full >= 1);
    assert_int_equal(ss.ring_used, 0);
    assert_int_equal(ss.ring_high, 16 * KP);
    tdm_xfer_sync_destroy(&s);
    ta.iface->mr_dereg(ta.t, &rs);
    tb.iface->mr_dereg(tb.t, &rd);
    tdm_xfer_staged_destroy(st);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
    free(src);
    free(dst);
}

struct one_done {
    int n;
    tdm_status st;
};
static void one_done_fn(void *ctx, tdm_status st)
{
    struct one_done *d = ctx;
    d->st = st;
    __atomic_add_fetch(&d->n, 1, __ATOMIC_SEQ_CST);
}
static void wait_done(struct one_done *d)
{
    for (int i = 0; i < 5000 && !__atomic_load_n(&d->n, __ATOMIC_SEQ_CST); i++)
        usleep(2000);
}

/* One page written through the staged writer; its copy held until delay_us after it started,
 * then ended with copy_st. Returns how the write ended. */
static struct one_done staged_one(struct tdm_xfer_transport ta, uint32_t peer,
                                  const struct tdm_xfer_region *rs, const struct tdm_xfer_rmem *rm,
                                  struct gated *g, int timeout_ms, int delay_us, tdm_status copy_st)
{
    struct one_done d = {0};
    assert_int_equal(
        ta.iface->write(ta.t, peer, rs, 0, rm, 0, PAGE, NULL, timeout_ms, one_done_fn, &d), TDM_OK);
    while (held_now(g) < 1)
        usleep(1000);
    usleep((useconds_t)delay_us);
    gated_open(g, copy_st);
    wait_done(&d);
    return d;
}

/* Failures end a staged write exactly once, with the ring given back: a failed copy, a fabric
 * write that fails (the engine's fault injection), a write that waits past its deadline, and
 * writes still held when the transport is destroyed. */
static void test_staged_failures(void **state)
{
    (void)state;
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    cfg.provider = "shm";
    cfg.faults = "fail_write=1.0,seed=3";
    tdm_xfer_t *a = NULL, *b = open_engine();
    assert_int_equal(tdm_xfer_create(&cfg, &a), TDM_OK);
    assert_non_null(b);
    struct gated g = {.mu = PTHREAD_MUTEX_INITIALIZER};
    struct tdm_xfer_staged_config sc = {
        .fabric = tdm_xfer_fabric_transport(a), .copier = {&GATED, &g}, .ring_bytes = 64 * 1024};
    tdm_xfer_staged_t *st = NULL;
    assert_int_equal(tdm_xfer_staged_create(&sc, &st), TDM_OK);
    struct tdm_xfer_transport ta = tdm_xfer_staged_transport(st), tb = tdm_xfer_fabric_transport(b);
    uint32_t peer = connect_engines(a, b);
    uint8_t src[4 * PAGE], dst[4 * PAGE];
    struct tdm_xfer_region rs, rd;
    assert_int_equal(ta.iface->mr_reg(ta.t, src, sizeof src, TDM_XFER_MEM_HOST, &rs), TDM_OK);
    assert_int_equal(tb.iface->mr_reg(tb.t, dst, sizeof dst, TDM_XFER_MEM_HOST, &rd), TDM_OK);
    struct tdm_xfer_rmem rm;
    tb.iface->mr_remote(tb.t, &rd, &rm);
    struct tdm_xfer_staged_stats ss;
    /* a failed copy */
    struct one_done d = staged_one(ta, peer, &rs, &rm, &g, 0, 0, TDM_EIO);
    assert_int_equal(d.n, 1);
    assert_int_equal(d.st, TDM_EIO);
    /* a fabric write that fails */
    d = staged_one(ta, peer, &rs, &rm, &g, 0, 0, TDM_OK);
    assert_int_equal(d.n, 1);
    assert_int_equal(d.st, TDM_EIO);
    /* a write whose copy does not end before its deadline of 50 ms: it ends when the copy
     * does, with TDM_ETIMEDOUT, and is never posted */
    d = staged_one(ta, peer, &rs, &rm, &g, 50, 200000, TDM_OK);
    assert_int_equal(d.n, 1);
    assert_int_equal(d.st, TDM_ETIMEDOUT);
    /* held at destroy: the copy ends (the gate opens from here), the write is cancelled */
    struct one_done d4 = {0};
    assert_int_equal(ta.iface->write(ta.t, peer, &rs, 0, &rm, 0, PAGE, NULL, 0, one_done_fn, &d4),
                     TDM_OK);
    while (held_now(&g) < 1)
        usleep(1000);
    tdm_xfer_staged_get_stats(st, &ss);
    assert_int_equal(ss.failed, 3);
    assert_int_equal(ss.ring_used, PAGE);
    gated_open(&g, TDM_OK);
    tdm_xfer_staged_destroy(st);
    assert_int_equal(d4.n, 1);
    assert_true(d4.st == TDM_ECANCELED || d4.st == TDM_EIO);
    ta.iface->mr_dereg(ta.t, &rs);
    tb.iface->mr_dereg(tb.t, &rd);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
}

#ifdef TDM_HAVE_CUDA
/* Decided without touching CUDA, so that a fork can still follow. */
static bool have_gpu(void)
{
    return access("/dev/nvidia0", F_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0;
}

static tdm_xfer_ipc_t *open_ipc(tdm_xfer_t *control)
{
    struct tdm_xfer_ipc_config cfg = {.device = 0, .control = control};
    tdm_xfer_ipc_t *t = NULL;
    tdm_status st = tdm_xfer_ipc_create(&cfg, &t);
    if (st != TDM_OK) fprintf(stderr, "ipc transport: %s\n", tdm_err_msg());
    return t;
}

static int owner_process(int wfd)
{
    tdm_xfer_t *b = open_engine();
    tdm_xfer_ipc_t *ib = b ? open_ipc(b) : NULL;
    if (!ib) return 77;
    char addr[TDM_XFER_ADDR_MAX];
    if (tdm_xfer_addr(b, addr, sizeof(addr)) != TDM_OK) return 2;
    struct tdm_xfer_transport tb = tdm_xfer_ipc_transport(ib);
    struct owner o;
    owner_open(&o, tb, b, &DEV_MEM);
    if (write(wfd, addr, sizeof(addr)) != (ssize_t)sizeof(addr) ||
        write(wfd, &o.rmem, sizeof(o.rmem)) != (ssize_t)sizeof(o.rmem))
        return 3;
    close(wfd);
    int bad = owner_check(&o, tb, &DEV_MEM);
    fprintf(stderr, "owner: %d wrong bytes\n", bad);
    tdm_xfer_ipc_destroy(ib);
    tdm_xfer_destroy(b);
    return bad == 0 ? 0 : 1;
}

static void test_cuda_ipc_two_processes(void **state)
{
    (void)state;
    if (!have_gpu()) {
        fprintf(stderr,
                "skipped: no NVIDIA GPU here, the CUDA IPC transport runs on GPU machines\n");
        skip();
    }
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        _exit(owner_process(fds[1]));
    }
    close(fds[1]);
    char addr[TDM_XFER_ADDR_MAX];
    struct tdm_xfer_rmem rmem;
    bool got = read(fds[0], addr, sizeof(addr)) == (ssize_t)sizeof(addr) &&
               read(fds[0], &rmem, sizeof(rmem)) == (ssize_t)sizeof(rmem);
    close(fds[0]);
    if (!got) {
        int status = 0;
        waitpid(pid, &status, 0);
        if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
            fprintf(stderr, "skipped: the owner process found no usable GPU\n");
            skip();
        }
        fail_msg("the owner process ended before sending its region (status %d)", status);
    }
    tdm_xfer_t *a = open_engine();
    assert_non_null(a);
    tdm_xfer_ipc_t *ia = open_ipc(a);
    assert_non_null(ia);
    struct tdm_xfer_transport ta = tdm_xfer_ipc_transport(ia);
    assert_string_equal(ta.iface->name, "cuda_ipc");
    uint32_t peer;
    assert_int_equal(tdm_xfer_peer_add(a, addr, &peer), TDM_OK);
    assert_int_equal(tdm_xfer_peer_wait(a, peer, 5000), TDM_OK);
    write_side(ta, &DEV_MEM, peer, &rmem);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    tdm_xfer_ipc_destroy(ia);
    tdm_xfer_destroy(a);
}

static void test_cuda_ipc_one_process(void **state)
{
    (void)state;
    int n = 0;
    if (!have_gpu() || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr,
                "skipped: no NVIDIA GPU here, the CUDA IPC transport runs on GPU machines\n");
        skip();
    }
    tdm_xfer_t *a = open_engine(), *b = open_engine();
    assert_non_null(a);
    assert_non_null(b);
    tdm_xfer_ipc_t *ia = open_ipc(a), *ib = open_ipc(b);
    assert_non_null(ia);
    assert_non_null(ib);
    struct tdm_xfer_transport ta = tdm_xfer_ipc_transport(ia), tb = tdm_xfer_ipc_transport(ib);
    struct tdm_xfer_caps caps;
    ta.iface->get_caps(ta.t, &caps);
    assert_string_equal(caps.provider, "cuda_ipc");
    assert_true(caps.hmem_cuda);
    /* host memory is refused: this transport moves device memory only */
    uint8_t host[64];
    struct tdm_xfer_region hr;
    assert_int_equal(ta.iface->mr_reg(ta.t, host, sizeof(host), TDM_XFER_MEM_HOST, &hr),
                     TDM_EINVAL);
    uint32_t peer = connect_engines(a, b);
    struct owner o;
    owner_open(&o, tb, b, &DEV_MEM);
    /* a descriptor claiming more than its allocation is refused */
    struct tdm_xfer_rmem lie = o.rmem;
    lie.bytes = (uint64_t)DST_BYTES * 1024;
    const uint32_t first[] = {0};
    struct tdm_xfer_pages p = {first, first, 1, PAGE, PAGE, PAGE, 0, (uint64_t)DST_BYTES * 512};
    struct tdm_xfer_region rs;
    void *src = dev_alloc(NP * PAGE);
    assert_int_equal(ta.iface->mr_reg(ta.t, src, NP * PAGE, TDM_XFER_MEM_CUDA, &rs), TDM_OK);
    assert_int_equal(ta.iface->write_pages(ta.t, peer, &rs, &lie, &p, NULL, 0, NULL, NULL),
                     TDM_ERANGE);
    ta.iface->mr_dereg(ta.t, &rs);
    dev_release(src);
    write_side(ta, &DEV_MEM, peer, &o.rmem);
    assert_int_equal(owner_check(&o, tb, &DEV_MEM), 0);
    tdm_xfer_ipc_destroy(ia);
    tdm_xfer_ipc_destroy(ib);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
}
/* GPU pages through the CUDA copier: device memory -> pinned ring -> fabric -> host pages. */
static void test_staged_cuda(void **state)
{
    (void)state;
    int n = 0;
    if (!have_gpu() || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "skipped: no NVIDIA GPU here, the CUDA copier runs on GPU machines\n");
        skip();
    }
    tdm_xfer_t *a = open_engine(), *b = open_engine();
    assert_non_null(a);
    assert_non_null(b);
    struct tdm_xfer_copier cp;
    assert_int_equal(tdm_xfer_copier_cuda(0, &cp), TDM_OK);
    assert_string_equal(cp.iface->name, "cuda");
    struct tdm_xfer_staged_config sc = {.fabric = tdm_xfer_fabric_transport(a), .copier = cp};
    tdm_xfer_staged_t *st = NULL;
    assert_int_equal(tdm_xfer_staged_create(&sc, &st), TDM_OK);
    struct tdm_xfer_transport ta = tdm_xfer_staged_transport(st), tb = tdm_xfer_fabric_transport(b);
    uint32_t peer = connect_engines(a, b);
    struct owner o;
    owner_open(&o, tb, b, &HOST_MEM);
    write_side(ta, &DEV_MEM, peer, &o.rmem);
    assert_int_equal(owner_check(&o, tb, &HOST_MEM), 0);
    tdm_xfer_staged_destroy(st);
    tdm_xfer_copier_destroy(&cp);
    tdm_xfer_destroy(a);
    tdm_xfer_destroy(b);
}
#else
static void test_staged_cuda(void **state)
{
    (void)state;
    fprintf(stderr, "skipped: built without CUDA\n");
    skip();
}
static void test_cuda_ipc_two_processes(void **state)
{
    (void)state;
    fprintf(stderr, "skipped: built without CUDA\n");
    skip();
}
static void test_cuda_ipc_one_process(void **state)
{
    (void)state;
    fprintf(stderr, "skipped: built without CUDA\n");
    skip();
}
#endif

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_ipc_two_processes), /* first: it forks before CUDA starts */
        cmocka_unit_test(test_fabric),
        cmocka_unit_test(test_cuda_ipc_one_process),
        cmocka_unit_test(test_staged),
        cmocka_unit_test(test_staged_pieces_and_backpressure),
        cmocka_unit_test(test_staged_failures),
        cmocka_unit_test(test_staged_cuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
