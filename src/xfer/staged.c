/*
 * The staged writer (include/tandem/xfer.h, "host staging"): paged writes from memory the fabric
 * cannot register (GPU memory without FI_HMEM), bounced through a ring of registered pinned
 * host memory.
 *
 * A paged write (an op) is cut into pieces of at most a quarter of the ring (and of the copier's
 * page cap). Each piece takes a contiguous span of the ring, is gathered there by the copier,
 * then posted as one fabric paged write from the ring to its destination pages; its span is
 * returned when that write completes. Only the last piece carries the op's immediate, and it is
 * posted only once every other piece's write has completed, so the immediate still means that
 * the whole paged write is in place. A piece's life:
 *
 *   NEW --ring span--> COPYING --copied--> COPIED --posted--> POSTED --write done--> DONE
 *    |                    |                   |  (EAGAIN: stays COPIED, tried again)
 *    |                    +--copy failed------+--op failed or stopping: not posted--> DONE
 *    +--op failed, or stopping, before it took ring space---------------------------> DONE
 *
 *   transition          function       thread
 *   NEW -> COPYING      take_pieces    the caller of write_pages (first piece), the worker
 *   NEW -> DONE         worker_main    the worker
 *   COPYING -> COPIED   on_copied      the copier's
 *   COPIED -> POSTED    post_pieces    the worker
 *   POSTED -> DONE      on_posted      the fabric's progress thread
 *   COPIED -> DONE      post_pieces    the worker (op failed, or the transport stopping)
 *
 * An op ends (its done runs, on the worker, no lock held) when every piece is DONE, with the
 * first error any piece met (a failed copy or write, TDM_ETIMEDOUT when its deadline passed
 * while it waited for ring space or for the fabric's queue, TDM_ECANCELED at destroy).
 *
 * The ring. Spans are taken in order at the head and returned in any order; the tail moves past
 * the oldest spans once they are returned. A span that does not fit before the end starts at 0
 * (the end is left unused until the tail passes it). Ops take ring space strictly in arrival
 * order, so a large write waiting for room is not starved by small ones; a new write while any
 * op waits, or with no room for its first piece, is refused with TDM_EAGAIN: that is the
 * back-pressure the caller sees.
 *
 * Ownership and threading. The transport owns the ring (allocated by the copier, registered
 * with the fabric transport once) and the worker thread; it borrows the fabric transport and
 * the copier. s->mu guards everything; fabric posts and copier submissions only enqueue, so
 * they are made under it, and their completions take it.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "xfer/xfer_int.h"

enum { RING_SPANS = 4096, RETRY_US = 200, DEFAULT_TIMEOUT_MS = 10000 };
#define DEFAULT_RING (64u << 20)

enum piece_state { P_NEW, P_COPYING, P_COPIED, P_POSTED, P_DONE };

struct sop;
struct piece {
    struct sop *op;
    uint32_t first, n; /* entries [first, first + n) of the op's page list */
    uint64_t ring_off, bytes;
    int span; /* its entry in the ring's span table */
    enum piece_state state;
    uint64_t t_copy;
};

struct sop {
    struct sop *next; /* s->ops, in arrival order */
    struct tdm_xfer_staged *s;
    uint32_t peer;
    const uint8_t *src;
    size_t src_bytes;
    struct tdm_xfer_rmem dst;
    struct tdm_xfer_pages pages; /* arrays point at ids */
    bool has_imm;
    struct tdm_xfer_imm imm;
    int timeout_ms;
    uint64_t deadline_ns;
    tdm_xfer_done_fn done;
    void *ctx;
    tdm_status st;       /* the first error */
    char err[160];       /* its message, for the done callback's thread */
    uint32_t n_pieces;   /* pieces[] */
    uint32_t started;    /* pieces that took ring space */
    uint32_t completed;  /* pieces DONE */
    uint32_t ok_written; /* pieces whose fabric write completed OK */
    struct piece *pieces;
    uint32_t *ids; /* src pages, then dst pages */
};

struct span {
    uint64_t start, end;
    bool live, returned;
};

struct tdm_xfer_staged {
    struct tdm_xfer_staged_config cfg;
    const struct tdm_xfer_transport_i *fab;
    struct tdm_xfer_caps fcaps;
    uint8_t *ring;
    struct tdm_xfer_region ring_reg;
    uint64_t ring_bytes, piece_max;
    uint32_t *iota; /* 0, 1, 2, ...: a piece's pages in the ring */
    /* the span table: a ring of RING_SPANS entries in allocation order */
    struct span spans[RING_SPANS];
    int span_head, n_spans;
    uint64_t head; /* where the next span starts (if it fits) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool thread_up, stopping;
    struct sop *ops;
    struct tdm_xfer_staged_stats stats;
};

/* ---- the ring (s->mu held) ---- */
static bool ring_take(struct tdm_xfer_staged *s, uint64_t bytes, uint64_t *off, int *span)
{
    if (s->n_spans == RING_SPANS) return false;
    if (s->n_spans == 0) s->head = 0;
    uint64_t tail = s->n_spans ? s->spans[s->span_head].start : s->head;
    uint64_t at;
    if (s->n_spans == 0 || s->head > tail) { /* free: [head, end) and [0, tail) */
        if (s->ring_bytes - s->head >= bytes)
            at = s->head;
        else if (tail >= bytes)
            at = 0;
        else
            return false;
    } else if (s->head < tail && tail - s->head >= bytes) { /* wrapped: free [head, tail) */
        at = s->head;
    } else {
        return false;
    }
    int i = (s->span_head + s->n_spans) % RING_SPANS;
    s->spans[i] = (struct span){.start = at, .end = at + bytes, .live = true};
    s->n_spans++;
    s->head = at + bytes;
    s->stats.ring_used += bytes;
    if (s->stats.ring_used > s->stats.ring_high) s->stats.ring_high = s->stats.ring_used;
    *off = at;
    *span = i;
    return true;
}

static void ring_return(struct tdm_xfer_staged *s, int span)
{
    struct span *e = &s->spans[span];
    e->returned = true;
    s->stats.ring_used -= e->end - e->start;
    while (s->n_spans && s->spans[s->span_head].returned) {
        s->spans[s->span_head] = (struct span){0};
        s->span_head = (s->span_head + 1) % RING_SPANS;
        s->n_spans--;
    }
}

/* ---- pieces ---- */
static void op_fail(struct sop *op, tdm_status st, const char *msg)
{
    if (op->st != TDM_OK) return;
    op->st = st;
    snprintf(op->err, sizeof op->err, "%s", msg);
}

static void piece_done(struct piece *pc)
{
    pc->state = P_DONE;
    pc->op->completed++;
    ring_return(pc->op->s, pc->span);
}

static void on_copied(void *ctx, tdm_status st)
{
    struct piece *pc = ctx;
    struct tdm_xfer_staged *s = pc->op->s;
    pthread_mutex_lock(&s->mu);
    s->stats.copy_ns += tdm_now_ns() - pc->t_copy;
    if (st == TDM_OK) {
        pc->state = P_COPIED;
    } else {
        op_fail(pc->op, st, "xfer staged: copying pages into the staging ring failed");
        piece_done(pc);
    }
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void on_posted(void *ctx, tdm_status st)
{
    struct piece *pc = ctx;
    struct tdm_xfer_staged *s = pc->op->s;
    char msg[160];
    if (st != TDM_OK) snprintf(msg, sizeof msg, "%s", tdm_err_msg());
    pthread_mutex_lock(&s->mu);
    if (st == TDM_OK)
        pc->op->ok_written++;
    else
        op_fail(pc->op, st, msg);
    s->stats.pieces++;
    piece_done(pc);
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Gives op's next pieces ring space and starts their copies, while there is room. Returns
 * false when the op still has pieces that found none. s->mu held. */
static bool take_pieces(struct tdm_xfer_staged *s, struct sop *op)
{
    while (op->started < op->n_pieces && op->st == TDM_OK && !s->stopping) {
        struct piece *pc = &op->pieces[op->started];
        if (!ring_take(s, pc->bytes, &pc->ring_off, &pc->span)) return false;
        op->started++;
        pc->state = P_COPYING;
        pc->t_copy = tdm_now_ns();
        struct tdm_xfer_pages cp = {.src_pages = op->ids + pc->first,
                                    .dst_pages = s->iota,
                                    .n_pages = pc->n,
                                    .page_bytes = op->pages.page_bytes,
                                    .src_stride = op->pages.src_stride,
                                    .dst_stride = op->pages.page_bytes,
                                    .src_offset = op->pages.src_offset,
                                    .dst_offset = pc->ring_off};
        tdm_status st = s->cfg.copier.iface->copy_pages(s->cfg.copier.c, op->src, op->src_bytes,
                                                        s->ring, s->ring_bytes, &cp, on_copied, pc);
        if (st != TDM_OK) {
            op_fail(op, st, tdm_err_msg());
            piece_done(pc);
        }
    }
    return op->started == op->n_pieces || op->st != TDM_OK || s->stopping;
}

/* Posts op's copied pieces (the last one once the others have completed). Returns true when
 * one met a full fabric queue and must be tried again. s->mu held. */
static bool post_pieces(struct tdm_xfer_staged *s, struct sop *op)
{
    for (uint32_t k = 0; k < op->started; k++) {
        struct piece *pc = &op->pieces[k];
        if (pc->state != P_COPIED) continue;
        if (op->st != TDM_OK || s->stopping) { /* never posted */
            op_fail(op, TDM_ECANCELED, "xfer staged: the transport is shutting down");
            piece_done(pc);
            continue;
        }
        bool last = k == op->n_pieces - 1;
        if (last && op->ok_written < op->n_pieces - 1) continue; /* the others first */
        struct tdm_xfer_pages wp = {.src_pages = s->iota,
                                    .dst_pages = op->ids + op->pages.n_pages + pc->first,
                                    .n_pages = pc->n,
                                    .page_bytes = op->pages.page_bytes,
                                    .src_stride = op->pages.page_bytes,
                                    .dst_stride = op->pages.dst_stride,
                                    .src_offset = pc->ring_off,
                                    .dst_offset = op->pages.dst_offset};
        tdm_status st = s->fab->write_pages(s->cfg.fabric.t, op->peer, &s->ring_reg, &op->dst, &wp,
                                            last && op->has_imm ? &op->imm : NULL, op->timeout_ms,
                                            on_posted, pc);
        if (st == TDM_EAGAIN) return true;
        if (st != TDM_OK) {
            op_fail(op, st, tdm_err_msg());
            piece_done(pc);
            continue;
        }
        pc->state = P_POSTED;
    }
    return false;
}

static void *worker_main(void *arg)
{
    struct tdm_xfer_staged *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        uint64_t now = tdm_now_ns();
        bool waiting_ring = false, retry = false;
        struct sop *finished = NULL, **link = &s->ops;
        while (*link) {
            struct sop *op = *link;
            /* the deadline bounds the wait for ring room, copies and the fabric's queue; a
             * piece on the wire is the fabric's to time out */
            bool waiting = op->started < op->n_pieces;
            for (uint32_t k = 0; k < op->started && !waiting; k++)
                waiting = op->pieces[k].state == P_COPYING || op->pieces[k].state == P_COPIED;
            if (op->st == TDM_OK && now > op->deadline_ns && waiting)
                op_fail(op, TDM_ETIMEDOUT,
                        "xfer staged: a paged write waited past its deadline for staging room "
                        "or the fabric");
            /* ring space strictly in arrival order */
            if (!waiting_ring && !take_pieces(s, op)) waiting_ring = true;
            retry |= post_pieces(s, op);
            bool unstarted_dropped = op->st != TDM_OK || s->stopping;
            if (unstarted_dropped && op->started < op->n_pieces) {
                for (uint32_t k = op->started; k < op->n_pieces; k++) /* never took ring space */
                    op->pieces[k].state = P_DONE;
                op->completed += op->n_pieces - op->started;
                op->started = op->n_pieces;
                if (op->st == TDM_OK)
                    op_fail(op, TDM_ECANCELED, "xfer staged: the transport is shutting down");
            }
            if (op->completed == op->n_pieces) {
                *link = op->next;
                op->next = finished;
                finished = op;
                if (op->st == TDM_OK) {
                    s->stats.writes++;
                    s->stats.bytes += (uint64_t)op->pages.n_pages * op->pages.page_bytes;
                } else {
                    s->stats.failed++;
                }
                continue;
            }
            link = &op->next;
        }
        if (finished) {
            pthread_mutex_unlock(&s->mu);
            while (finished) {
                struct sop *next = finished->next;
                if (finished->st != TDM_OK) tdm_err_set(finished->st, "%s", finished->err);
                if (finished->done) finished->done(finished->ctx, finished->st);
                free(finished->pieces);
                free(finished->ids);
                free(finished);
                finished = next;
            }
            pthread_mutex_lock(&s->mu);
            continue;
        }
        if (s->stopping && !s->ops) break;
        if (s->ops) { /* deadlines and fabric retries need the clock */
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long add = retry ? RETRY_US * 1000L : 5000000L;
            ts.tv_nsec += add;
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        } else {
            pthread_cond_wait(&s->cv, &s->mu);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- the ops ---- */
static tdm_status st_mr_reg(void *tp, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                            struct tdm_xfer_region *out)
{
    if (!base || !bytes) return tdm_err_set(TDM_EINVAL, "xfer staged: empty region");
    /* a source: the copier reads it; nothing is registered with the fabric */
    *out = (struct tdm_xfer_region){.base = base, .bytes = bytes, .kind = kind, .impl = tp};
    return TDM_OK;
}

static void st_mr_dereg(void *tp, struct tdm_xfer_region *r)
{
    (void)tp;
    *r = (struct tdm_xfer_region){0};
}

static void st_mr_remote(void *tp, const struct tdm_xfer_region *r, struct tdm_xfer_rmem *out)
{
    (void)tp, (void)r;
    *out = (struct tdm_xfer_rmem){0}; /* staged regions are sources only */
}

static tdm_status st_write_pages(void *tp, uint32_t peer, const struct tdm_xfer_region *src,
                                 const struct tdm_xfer_rmem *dst,
                                 const struct tdm_xfer_pages *pages, const struct tdm_xfer_imm *imm,
                                 int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_staged *s = tp;
    if (!src || src->impl != s || !dst || !pages)
        return tdm_err_set(TDM_EINVAL, "xfer staged: the source must be a region of this "
                                       "transport");
    if (dst->kind != TDM_XFER_MEM_HOST)
        return tdm_err_set(TDM_EINVAL, "xfer staged: the destination must be host memory");
    tdm_status st = tdm_xfer_pages_check(pages, src->bytes, dst->bytes, UINT32_MAX);
    if (st != TDM_OK) return st;
    if (pages->page_bytes > s->piece_max)
        return tdm_err_set(TDM_ERANGE,
                           "xfer staged: a page of %llu bytes is more than a quarter of the "
                           "staging ring (%llu bytes)",
                           (unsigned long long)pages->page_bytes,
                           (unsigned long long)s->ring_bytes);
    uint32_t per = (uint32_t)TDM_MIN(s->piece_max / pages->page_bytes, TDM_XFER_COPY_MAX_PAGES);
    uint32_t n_pieces = (pages->n_pages + per - 1) / per;
    struct sop *op = calloc(1, sizeof *op);
    struct piece *pcs = calloc(n_pieces, sizeof *pcs);
    uint32_t *ids = malloc(2 * sizeof(uint32_t) * pages->n_pages);
    if (!op || !pcs || !ids) {
        free(op), free(pcs), free(ids);
        return tdm_err_set(TDM_ENOMEM, "xfer staged: out of memory");
    }
    memcpy(ids, pages->src_pages, sizeof(uint32_t) * pages->n_pages);
    memcpy(ids + pages->n_pages, pages->dst_pages, sizeof(uint32_t) * pages->n_pages);
    int wait_ms = timeout_ms > 0 ? timeout_ms : DEFAULT_TIMEOUT_MS;
    *op = (struct sop){.s = s,
                       .peer = peer,
                       .src = src->base,
                       .src_bytes = src->bytes,
                       .dst = *dst,
                       .pages = *pages,
                       .has_imm = imm != NULL,
                       .timeout_ms = timeout_ms,
                       .deadline_ns = tdm_now_ns() + (uint64_t)wait_ms * 1000000ull,
                       .done = done,
                       .ctx = ctx,
                       .n_pieces = n_pieces,
                       .pieces = pcs,
                       .ids = ids};
    op->pages.src_pages = ids;
    op->pages.dst_pages = ids + pages->n_pages;
    if (imm) op->imm = *imm;
    for (uint32_t k = 0; k < n_pieces; k++) {
        uint32_t first = k * per, n = TDM_MIN(per, pages->n_pages - first);
        pcs[k] = (struct piece){
            .op = op, .first = first, .n = n, .bytes = (uint64_t)n * pages->page_bytes};
    }
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        st = tdm_err_set(TDM_ECANCELED, "xfer staged: the transport is shutting down");
    } else {
        /* an earlier write still waiting for room goes first */
        bool behind = false;
        for (struct sop *o = s->ops; o && !behind; o = o->next)
            behind = o->started < o->n_pieces && o->st == TDM_OK;
        st = behind ? TDM_EAGAIN : TDM_OK;
    }
    if (st == TDM_OK) {
        struct sop **tail = &s->ops;
        while (*tail)
            tail = &(*tail)->next;
        *tail = op;
        take_pieces(s, op);
        if (op->started == 0 && op->st == TDM_OK) { /* not even the first piece fits */
            *tail = NULL;
            st = TDM_EAGAIN;
        } else {
            pthread_cond_signal(&s->cv);
        }
    }
    if (st == TDM_EAGAIN) {
        s->stats.ring_full++;
        tdm_err_set(TDM_EAGAIN, "xfer staged: the staging ring is full (%llu of %llu bytes)",
                    (unsigned long long)s->stats.ring_used, (unsigned long long)s->ring_bytes);
    }
    pthread_mutex_unlock(&s->mu);
    if (st != TDM_OK) {
        free(ids), free(pcs), free(op);
    }
    return st;
}

static tdm_status st_write(void *tp, uint32_t peer, const struct tdm_xfer_region *src,
                           uint64_t src_offset, const struct tdm_xfer_rmem *dst,
                           uint64_t dst_offset, uint64_t bytes, const struct tdm_xfer_imm *imm,
                           int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_pages p = tdm_xfer_pages_one(src_offset, dst_offset, bytes);
    return st_write_pages(tp, peer, src, dst, &p, imm, timeout_ms, done, ctx);
}

static tdm_status st_send(void *tp, uint32_t peer, const void *msg, size_t bytes, int timeout_ms,
                          tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_staged *s = tp;
    return s->fab->send(s->cfg.fabric.t, peer, msg, bytes, timeout_ms, done, ctx);
}

static tdm_status st_send_imm(void *tp, uint32_t peer, const struct tdm_xfer_imm *imm,
                              int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    struct tdm_xfer_staged *s = tp;
    return s->fab->send_imm(s->cfg.fabric.t, peer, imm, timeout_ms, done, ctx);
}

static int st_poll(void *tp)
{
    (void)tp; /* the worker advances everything */
    return 0;
}

static void st_get_caps(void *tp, struct tdm_xfer_caps *out)
{
    struct tdm_xfer_staged *s = tp;
    *out = s->fcaps;
    out->hmem_cuda = false;        /* device sources are staged, not registered */
    out->delivery_complete = true; /* done fires once every piece has completed */
    out->max_write_bytes = s->piece_max;
}

static const struct tdm_xfer_transport_i STAGED_TRANSPORT = {
    .name = "staged",
    .mr_reg = st_mr_reg,
    .mr_dereg = st_mr_dereg,
    .mr_remote = st_mr_remote,
    .write_pages = st_write_pages,
    .write = st_write,
    .send = st_send,
    .send_imm = st_send_imm,
    .poll = st_poll,
    .get_caps = st_get_caps,
};

tdm_status tdm_xfer_staged_create(const struct tdm_xfer_staged_config *cfg, tdm_xfer_staged_t **out)
{
    *out = NULL;
    if (!cfg->fabric.iface || !cfg->copier.iface)
        return tdm_err_set(TDM_EINVAL, "xfer staged: a fabric transport and a copier are needed");
    struct tdm_xfer_staged *s = calloc(1, sizeof *s);
    if (!s) return tdm_err_set(TDM_ENOMEM, "xfer staged: out of memory");
    s->cfg = *cfg;
    s->fab = cfg->fabric.iface;
    s->fab->get_caps(cfg->fabric.t, &s->fcaps);
    s->ring_bytes = cfg->ring_bytes ? cfg->ring_bytes : DEFAULT_RING;
    s->ring_bytes = (s->ring_bytes + 4095) & ~(uint64_t)4095;
    s->piece_max = s->ring_bytes / 4;
    if (s->fcaps.max_write_bytes && s->piece_max > s->fcaps.max_write_bytes)
        s->piece_max = s->fcaps.max_write_bytes;
    s->stats.ring_bytes = s->ring_bytes;
    s->iota = malloc(sizeof(uint32_t) * TDM_XFER_COPY_MAX_PAGES);
    s->ring = cfg->copier.iface->host_alloc(cfg->copier.c, s->ring_bytes);
    tdm_status st;
    if (!s->iota || !s->ring) {
        st = tdm_err_set(TDM_ENOMEM, "xfer staged: cannot allocate a staging ring of %llu MiB",
                         (unsigned long long)(s->ring_bytes >> 20));
        goto fail;
    }
    for (uint32_t i = 0; i < TDM_XFER_COPY_MAX_PAGES; i++)
        s->iota[i] = i;
    if ((st = s->fab->mr_reg(cfg->fabric.t, s->ring, s->ring_bytes, TDM_XFER_MEM_HOST,
                             &s->ring_reg)) != TDM_OK)
        goto fail;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, worker_main, s) != 0) {
        st = tdm_err_set(TDM_ENOMEM, "xfer staged: cannot start its thread");
        s->fab->mr_dereg(cfg->fabric.t, &s->ring_reg);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        goto fail;
    }
    s->thread_up = true;
    *out = s;
    return TDM_OK;
fail:
    if (s->ring) cfg->copier.iface->host_free(cfg->copier.c, s->ring, s->ring_bytes);
    free(s->iota);
    free(s);
    return st;
}

void tdm_xfer_staged_destroy(tdm_xfer_staged_t *s)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    s->fab->mr_dereg(s->cfg.fabric.t, &s->ring_reg);
    s->cfg.copier.iface->host_free(s->cfg.copier.c, s->ring, s->ring_bytes);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s->iota);
    free(s);
}

struct tdm_xfer_transport tdm_xfer_staged_transport(tdm_xfer_staged_t *s)
{
    return (struct tdm_xfer_transport){.iface = &STAGED_TRANSPORT, .t = s};
}

void tdm_xfer_staged_get_stats(tdm_xfer_staged_t *s, struct tdm_xfer_staged_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->mu);
}
