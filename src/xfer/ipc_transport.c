/*
 * The CUDA IPC writer (cuda_ipc.cu) as a transport of the ops table (include/tandem/xfer.h), so
 * GPU pages move inside a node with no change to the callers of the table (disagg).
 *
 * Data. A region is device memory, exported with an IPC handle (tdm_xfer_cuda_export); its
 * remote descriptor carries the handle, the region's offset in its allocation (addr) and its
 * length. A writer opens a destination's handle once and keeps the mapping (a small cache keyed
 * by the handle's bytes, closed at destroy, or when the peer it was written for is gone
 * (tdm_xfer_ipc_forget_peer: an exporter's memory is freed only once every importer has closed
 * it); an entry with writes in flight is never evicted, and a forgotten one is closed when its
 * last write completes).
 * A destination registered in this same process (another transport of the process, or this
 * one) is written through its own pointer: CUDA refuses to open a handle in the process that
 * exported it. Bounds come from the mapping's true allocation size, never from the peer's
 * descriptor alone. Each paged write is one gather/scatter kernel; a single write is a paged
 * write of one page.
 *
 * Immediates. When a write's kernel has completed, its immediate goes to the destination's
 * owner over the control engine (tdm_xfer_send_imm: an IMM message that the owner's engine
 * counts exactly like an RMA immediate), and the write's done fires when that send completes.
 * With no control engine (one process, tests) it is delivered to the `local` counter table.
 * Either way the immediate follows the data, as the table promises. Sends and liveness are the
 * control engine's.
 *
 * Ownership and threading. The transport owns its writer, the opened mappings and a progress
 * thread; it borrows the control engine and the local counters, which must outlive it. Every
 * op is thread-safe (one mutex guards the writer and the cache). The progress thread polls the
 * writer's events while writes are pending and sleeps on a condition variable otherwise; it runs
 * done callbacks and sends immediates with no lock held, so a callback may post again. poll()
 * has nothing to do. The writer binds its CUDA device on the threads that post and poll.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "xfer/xfer_int.h"

enum { IPC_CACHE = 64, IPC_OWN = 64, IPC_POLL_US = 20 };

struct ipc_mapping {
    uint8_t handle[64];
    void *base;     /* the opened allocation's base */
    size_t bytes;   /* its true size */
    int in_flight;  /* writes into it not yet completed */
    uint64_t stamp; /* last use, for eviction */
    uint32_t peer;  /* the peer it was last written for */
    bool forget;    /* its peer is gone: close it once in_flight is 0 */
};

/* A region registered by some transport of this process. */
struct ipc_own {
    uint8_t handle[64];
    uint8_t *alloc_base; /* the allocation's base here: region base - rmem.addr */
    size_t alloc_bytes;
    bool used;
};

/* process-wide: destinations exported here are written through their own pointers */
static pthread_mutex_t g_own_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ipc_own g_own[IPC_OWN];

struct ipc_op {
    struct tdm_xfer_ipc *t;
    uint32_t peer;
    bool has_imm;
    struct tdm_xfer_imm imm;
    int timeout_ms;
    struct ipc_mapping *map; /* NULL when the destination is our own */
    tdm_xfer_done_fn done;
    void *ctx;
    tdm_status st;
    struct ipc_op *next;
};

struct tdm_xfer_ipc {
    struct tdm_xfer_ipc_config cfg;
    tdm_xfer_cuda_t *w;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool thread_up, stopping;
    int pending;                          /* writes posted to the writer, not yet completed */
    struct ipc_op *done_head, *done_tail; /* completed by the writer, callbacks not yet run */
    struct ipc_mapping cache[IPC_CACHE];
    uint64_t clock;
};

/* ---- the process-wide table of own regions ---- */
static void own_add(const struct tdm_xfer_rmem *r, void *base)
{
    size_t alloc = 0;
    if (tdm_xfer_cuda_alloc_size((uint8_t *)base - r->addr, &alloc) != TDM_OK) return;
    pthread_mutex_lock(&g_own_mu);
    for (int i = 0; i < IPC_OWN; i++)
        if (!g_own[i].used) {
            memcpy(g_own[i].handle, r->ipc_handle, 64);
            g_own[i].alloc_base = (uint8_t *)base - r->addr;
            g_own[i].alloc_bytes = alloc;
            g_own[i].used = true;
            break;
        }
    pthread_mutex_unlock(&g_own_mu);
}

static void own_remove(const uint8_t handle[64])
{
    pthread_mutex_lock(&g_own_mu);
    for (int i = 0; i < IPC_OWN; i++)
        if (g_own[i].used && !memcmp(g_own[i].handle, handle, 64)) {
            g_own[i].used = false;
            break;
        }
    pthread_mutex_unlock(&g_own_mu);
}

static bool own_find(const uint8_t handle[64], uint8_t **base, size_t *bytes)
{
    bool found = false;
    pthread_mutex_lock(&g_own_mu);
    for (int i = 0; i < IPC_OWN && !found; i++)
        if (g_own[i].used && !memcmp(g_own[i].handle, handle, 64)) {
            *base = g_own[i].alloc_base;
            *bytes = g_own[i].alloc_bytes;
            found = true;
        }
    pthread_mutex_unlock(&g_own_mu);
    return found;
}

/* ---- the destination: own pointer or a cached mapping (t->mu held) ---- */
static tdm_status resolve_dst(struct tdm_xfer_ipc *t, const struct tdm_xfer_rmem *dst,
                              uint8_t **ptr, size_t *bytes, struct ipc_mapping **map)
{
    if (dst->kind != TDM_XFER_MEM_CUDA)
        return tdm_err_set(TDM_EINVAL, "xfer ipc: the destination is not a CUDA region");
    uint8_t *base = NULL;
    size_t alloc = 0;
    *map = NULL;
    if (!own_find(dst->ipc_handle, &base, &alloc)) {
        struct ipc_mapping *m = NULL, *victim = NULL;
        for (int i = 0; i < IPC_CACHE && !m; i++)
            if (t->cache[i].base && !memcmp(t->cache[i].handle, dst->ipc_handle, 64))
                m = &t->cache[i];
        if (!m) {
            for (int i = 0; i < IPC_CACHE; i++) {
                struct ipc_mapping *c = &t->cache[i];
                if (c->in_flight) continue;
                if (!c->base) {
                    victim = c;
                    break;
                }
                if (!victim || c->stamp < victim->stamp) victim = c;
            }
            if (!victim)
                return tdm_err_set(TDM_EAGAIN, "xfer ipc: %d destinations busy", IPC_CACHE);
            if (victim->base) tdm_xfer_cuda_close(victim->base);
            *victim = (struct ipc_mapping){0};
            void *p = NULL;
            tdm_status st = tdm_xfer_cuda_open(dst, &p);
            if (st != TDM_OK) return st;
            size_t sz = 0;
            if ((st = tdm_xfer_cuda_alloc_size(p, &sz)) != TDM_OK) {
                tdm_xfer_cuda_close(p);
                return st;
            }
            memcpy(victim->handle, dst->ipc_handle, 64);
            victim->base = p;
            victim->bytes = sz;
            m = victim;
        }
        m->stamp = ++t->clock;
        m->forget = false;
        base = m->base;
        alloc = m->bytes;
        *map = m;
    }
    if (dst->addr > alloc || dst->bytes > alloc - dst->addr)
        return tdm_err_set(TDM_ERANGE,
                           "xfer ipc: the destination (offset %llu, %llu bytes) runs past its "
                           "allocation of %zu bytes",
                           (unsigned long long)dst->addr, (unsigned long long)dst->bytes, alloc);
    *ptr = base + dst->addr;
    *bytes = dst->bytes;
    return TDM_OK;
}

/* ---- completions ---- */
/* The writer's done (under t->mu, from tdm_xfer_cuda_poll): queue the op for the thread. */
static void on_kernel_done(void *ctx, tdm_status st)
{
    struct ipc_op *op = ctx;
    struct tdm_xfer_ipc *t = op->t;
    op->st = st;
    op->next = NULL;
    if (t->done_tail)
        t->done_tail->next = op;
    else
        t->done_head = op;
    t->done_tail = op;
    t->pending--;
    if (op->map && --op->map->in_flight == 0 && op->map->forget) {
        tdm_xfer_cuda_close(op->map->base);
        *op->map = (struct ipc_mapping){0};
    }
}

/* No lock held: forward the immediate, then the caller's done. */
static void finish_op(struct ipc_op *op)
{
    struct tdm_xfer_ipc *t = op->t;
    tdm_status st = op->st;
    if (st == TDM_OK && op->has_imm) {
        if (t->cfg.control) {
            st = tdm_xfer_send_imm(t->cfg.control, op->peer, &op->imm, op->timeout_ms, op->done,
                                   op->ctx);
            if (st == TDM_OK) { /* the send's completion is the write's */
                free(op);
                return;
            }
        } else {
            tdm_xfer_counters_deliver(t->cfg.local, &op->imm);
        }
    }
    if (op->done) op->done(op->ctx, st);
    free(op);
}

static void *progress_main(void *arg)
{
    struct tdm_xfer_ipc *t = arg;
    pthread_mutex_lock(&t->mu);
    for (;;) {
        if (t->pending > 0) tdm_xfer_cuda_poll(t->w);
        struct ipc_op *list = t->done_head;
        t->done_head = t->done_tail = NULL;
        if (list) {
            pthread_mutex_unlock(&t->mu);
            while (list) {
                struct ipc_op *next = list->next;
                finish_op(list);
                list = next;
            }
            pthread_mutex_lock(&t->mu);
            continue;
        }
        if (t->stopping && t->pending == 0) break;
        if (t->pending > 0) {
            pthread_mutex_unlock(&t->mu);
            nanosleep(&(struct timespec){0, IPC_POLL_US * 1000}, NULL);
            pthread_mutex_lock(&t->mu);
        } else {
            pthread_cond_wait(&t->cv, &t->mu);
        }
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ---- the ops ---- */
static tdm_status ipc_mr_reg(void *tp, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                             struct tdm_xfer_region *out)
{
    (void)tp;
    if (kind != TDM_XFER_MEM_CUDA)
        return tdm_err_set(TDM_EINVAL,
                           "xfer ipc: CUDA IPC moves device memory only (a %s "
                           "region was given)",
                           kind == TDM_XFER_MEM_HOST ? "host" : "unknown");
    struct tdm_xfer_rmem *r = calloc(1, sizeof(*r));
    if (!r) return tdm_err_set(TDM_ENOMEM, "xfer ipc: out of memory");
    tdm_status st = tdm_xfer_cuda_export(base, bytes, r);
    if (st != TDM_OK) {
        free(r);
        return st;
    }
    own_add(r, base);
    *out = (struct tdm_xfer_region){.base = base, .bytes = bytes, .kind = kind, .impl = r};
    return TDM_OK;
}

static void ipc_mr_dereg(void *tp, struct tdm_xfer_region *r)
{
    (void)tp;
    if (r->impl) {
        struct tdm_xfer_rmem *rm = r->impl;
        own_remove(rm->ipc_handle);
        free(rm);
    }
    *r = (struct tdm_xfer_region){0};
}

static void ipc_mr_remote(void *tp, const struct tdm_xfer_region *r, struct tdm_xfer_rmem *out)
{
    (void)tp;
    if (r->impl)
        *out = *(const struct tdm_xfer_rmem *)r->impl;
    else
        *out = (struct tdm_xfer_rmem){0};
}

static tdm_status ipc_write_pages(void *tp, uint32_t peer, const struct tdm_xfer_region *src,
                                  const struct tdm_xfer_rmem *dst,
                                  const struct tdm_xfer_pages *pages,
                                  const struct tdm_xfer_imm *imm, int timeout_ms,
                                  tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_ipc *t = tp;
    if (!src || !src->impl || src->kind != TDM_XFER_MEM_CUDA || !dst || !pages)
        return tdm_err_set(TDM_EINVAL, "xfer ipc: the source must be a CUDA region of this "
                                       "transport");
    if (imm && !t->cfg.control && !t->cfg.local)
        return tdm_err_set(TDM_EINVAL, "xfer ipc: an immediate needs a control engine");
    if (t->cfg.control && !tdm_xfer_peer_alive(t->cfg.control, peer))
        return tdm_err_set(TDM_EPEER, "xfer ipc: peer %u is not alive", peer);
    struct ipc_op *op = calloc(1, sizeof(*op));
    if (!op) return tdm_err_set(TDM_ENOMEM, "xfer ipc: out of memory");
    *op = (struct ipc_op){.t = t,
                          .peer = peer,
                          .has_imm = imm != NULL,
                          .timeout_ms = timeout_ms,
                          .done = done,
                          .ctx = ctx};
    if (imm) op->imm = *imm;
    int wait_ms = timeout_ms > 0 ? timeout_ms : 10000;
    uint64_t until = tdm_now_ns() + (uint64_t)wait_ms * 1000000ull;
    pthread_mutex_lock(&t->mu);
    tdm_status st;
    for (;;) {
        uint8_t *dp = NULL;
        size_t db = 0;
        st = resolve_dst(t, dst, &dp, &db, &op->map);
        if (st == TDM_OK)
            st = tdm_xfer_cuda_write_pages(t->w, src->base, src->bytes, dp, db, pages, NULL, NULL,
                                           on_kernel_done, op);
        /* every writer slot busy: the kernels take microseconds, so wait for one */
        if (st != TDM_EAGAIN || tdm_now_ns() > until) break;
        pthread_mutex_unlock(&t->mu);
        nanosleep(&(struct timespec){0, IPC_POLL_US * 1000}, NULL);
        pthread_mutex_lock(&t->mu);
    }
    if (st == TDM_OK) {
        t->pending++;
        if (op->map) {
            op->map->in_flight++;
            op->map->peer = peer;
        }
        pthread_cond_signal(&t->cv);
    }
    pthread_mutex_unlock(&t->mu);
    if (st != TDM_OK) free(op);
    return st;
}

static tdm_status ipc_write(void *tp, uint32_t peer, const struct tdm_xfer_region *src,
                            uint64_t src_offset, const struct tdm_xfer_rmem *dst,
                            uint64_t dst_offset, uint64_t bytes, const struct tdm_xfer_imm *imm,
                            int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_pages p = tdm_xfer_pages_one(src_offset, dst_offset, bytes);
    return ipc_write_pages(tp, peer, src, dst, &p, imm, timeout_ms, done, ctx);
}

static tdm_status ipc_send(void *tp, uint32_t peer, const void *msg, size_t bytes, int timeout_ms,
                           tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_ipc *t = tp;
    if (!t->cfg.control)
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer ipc: no control engine to send through");
    return tdm_xfer_send(t->cfg.control, peer, msg, bytes, timeout_ms, done, ctx);
}

static tdm_status ipc_send_imm(void *tp, uint32_t peer, const struct tdm_xfer_imm *imm,
                               int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_ipc *t = tp;
    if (t->cfg.control) return tdm_xfer_send_imm(t->cfg.control, peer, imm, timeout_ms, done, ctx);
    if (!t->cfg.local)
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer ipc: no control engine and no local counters");
    tdm_xfer_counters_deliver(t->cfg.local, imm);
    if (done) done(ctx, TDM_OK);
    return TDM_OK;
}

static int ipc_poll(void *tp)
{
    (void)tp; /* the progress thread completes everything */
    return 0;
}

static void ipc_get_caps(void *tp, struct tdm_xfer_caps *out)
{
    struct tdm_xfer_ipc *t = tp;
    if (t->cfg.control) {
        tdm_xfer_get_caps(t->cfg.control, out);
    } else {
        *out = (struct tdm_xfer_caps){.imm_bits = 64,
                                      .max_slot = (1u << 24) - 1,
                                      .max_epoch = (1u << 16) - 1,
                                      .max_index = (1u << 24) - 1};
    }
    snprintf(out->provider, sizeof(out->provider), "cuda_ipc");
    out->hmem_cuda = true;         /* device regions, nothing staged */
    out->delivery_complete = true; /* done fires after the kernel and the immediate */
    out->ordered_writes = true;    /* the immediate is sent once the data is in place */
    out->mr_mode = 0;
    out->max_write_bytes = SIZE_MAX;
}

static const struct tdm_xfer_transport_i IPC_TRANSPORT = {
    .name = "cuda_ipc",
    .mr_reg = ipc_mr_reg,
    .mr_dereg = ipc_mr_dereg,
    .mr_remote = ipc_mr_remote,
    .write_pages = ipc_write_pages,
    .write = ipc_write,
    .send = ipc_send,
    .send_imm = ipc_send_imm,
    .poll = ipc_poll,
    .get_caps = ipc_get_caps,
};

tdm_status tdm_xfer_ipc_reach(tdm_xfer_ipc_t *t, const struct tdm_xfer_rmem *dst, uint32_t peer)
{
    if (!t) return tdm_err_set(TDM_EUNSUPPORTED, "xfer ipc: no CUDA IPC here");
    pthread_mutex_lock(&t->mu);
    uint8_t *p = NULL;
    size_t bytes = 0;
    struct ipc_mapping *map = NULL;
    tdm_status st = resolve_dst(t, dst, &p, &bytes, &map);
    if (st == TDM_OK && map) map->peer = peer; /* closed with the peer (forget_peer) */
    pthread_mutex_unlock(&t->mu);
    return st;
}

void tdm_xfer_ipc_forget_peer(tdm_xfer_ipc_t *t, uint32_t peer)
{
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < IPC_CACHE; i++) {
        struct ipc_mapping *m = &t->cache[i];
        if (!m->base || m->peer != peer) continue;
        if (m->in_flight) {
            m->forget = true; /* on_kernel_done closes it */
        } else {
            tdm_xfer_cuda_close(m->base);
            *m = (struct ipc_mapping){0};
        }
    }
    pthread_mutex_unlock(&t->mu);
}

tdm_status tdm_xfer_ipc_create(const struct tdm_xfer_ipc_config *cfg, tdm_xfer_ipc_t **out)
{
    *out = NULL;
    struct tdm_xfer_ipc *t = calloc(1, sizeof(*t));
    if (!t) return tdm_err_set(TDM_ENOMEM, "xfer ipc: out of memory");
    t->cfg = *cfg;
    if (t->cfg.max_pending <= 0) t->cfg.max_pending = 64;
    tdm_status st = tdm_xfer_cuda_create(cfg->device, t->cfg.max_pending, &t->w);
    if (st != TDM_OK) {
        free(t);
        return st;
    }
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (pthread_create(&t->thread, NULL, progress_main, t) != 0) {
        tdm_xfer_ipc_destroy(t);
        return tdm_err_set(TDM_ENOMEM, "xfer ipc: cannot start the progress thread");
    }
    t->thread_up = true;
    *out = t;
    return TDM_OK;
}

void tdm_xfer_ipc_destroy(tdm_xfer_ipc_t *t)
{
    if (!t) return;
    if (t->thread_up) { /* the thread drains what is pending, runs its callbacks, then ends */
        pthread_mutex_lock(&t->mu);
        t->stopping = true;
        pthread_cond_signal(&t->cv);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
    }
    tdm_xfer_cuda_destroy(t->w);
    for (int i = 0; i < IPC_CACHE; i++)
        if (t->cache[i].base) tdm_xfer_cuda_close(t->cache[i].base);
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

struct tdm_xfer_transport tdm_xfer_ipc_transport(tdm_xfer_ipc_t *t)
{
    return (struct tdm_xfer_transport){.iface = &IPC_TRANSPORT, .t = t};
}
