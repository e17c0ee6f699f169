/*
 * Jobs of the libfabric transport: submission (paged writes merged into runs held in the run
 * ring, single writes, sends; bounded, TDM_EAGAIN when full), posting them as fabric operations
 * from the fixed op pool, immediate last, from the submitting thread where the domain allows it
 * and otherwise (and for what it left) from the progress thread; their ends, whose callbacks the
 * progress thread fires outside tx_mu (see fabric_int.h).
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

/* ---- the run ring (tx_mu held) ---- */

/* Reserves n runs for jb: contiguous in the ring, freed in allocation order. False when the
 * ring (or its segment list) is full. Returns the segment's start in *start. */
static bool runs_alloc(tdm_xfer_t *x, uint32_t n, struct job *jb, uint64_t *start)
{
    if (n > x->run_cap || x->seg_head - x->seg_tail >= x->n_segs) return false;
    uint64_t at = x->run_head, pos = at % x->run_cap;
    if (pos + n > x->run_cap) at += x->run_cap - pos; /* no room before the end: wrap */
    if (at + n - x->run_tail > x->run_cap) return false;
    uint32_t e = x->seg_head % x->n_segs;
    x->run_segs[e].end = at + n;
    x->run_segs[e].held = true;
    x->seg_head++;
    x->run_head = at + n;
    jb->ring_entry = e;
    jb->runs = &x->runs[at % x->run_cap];
    *start = at;
    return true;
}

/* Gives back the unused tail of the newest segment (the merge made fewer runs than pages). */
static void runs_trim(tdm_xfer_t *x, const struct job *jb, uint64_t start)
{
    x->run_head = start + jb->n_runs;
    x->run_segs[jb->ring_entry].end = x->run_head;
}

static void runs_release(tdm_xfer_t *x, struct job *jb)
{
    if (!jb->runs) return;
    jb->runs = NULL;
    x->run_segs[jb->ring_entry].held = false;
    while (x->seg_tail != x->seg_head && !x->run_segs[x->seg_tail % x->n_segs].held) {
        x->run_tail = x->run_segs[x->seg_tail % x->n_segs].end;
        x->seg_tail++;
    }
}

/* ---- jobs (tx_mu held) ---- */

static int job_alloc(tdm_xfer_t *x)
{
    int j = x->job_free;
    if (j >= 0) x->job_free = x->jobs[j].next;
    return j;
}

static void job_release(tdm_xfer_t *x, int j)
{
    struct job *jb = &x->jobs[j];
    runs_release(x, jb);
    free(jb->msg);
    memset(jb, 0, sizeof(*jb));
    jb->next = x->job_free;
    x->job_free = j;
}

void tdm_fab_job_finish(tdm_xfer_t *x, int j, tdm_status st)
{
    struct job *jb = &x->jobs[j];
    if (jb->state != JOB_ACTIVE) return;
    jb->state = JOB_DONE;
    runs_release(x, jb);
    __atomic_store_n(&x->work, true, __ATOMIC_RELEASE);
    if (!jb->done) return;
    struct firing *f = &x->fireq[x->n_fireq++]; /* a job is queued once: max_jobs entries */
    f->done = jb->done;
    f->ctx = jb->ctx;
    f->st = st;
    snprintf(f->msg, sizeof(f->msg), "%s", st == TDM_OK ? "" : tdm_err_msg());
    jb->firing = true;
}

void tdm_fab_fire_queued(tdm_xfer_t *x)
{
    pthread_mutex_lock(&x->tx_mu);
    int n = x->n_fireq;
    if (n) {
        memcpy(x->firing_now, x->fireq, sizeof(*x->fireq) * (size_t)n);
        x->n_fireq = 0;
        for (int j = x->active_head; j >= 0; j = x->jobs[j].next)
            x->jobs[j].firing = false;
        __atomic_store_n(&x->work, true, __ATOMIC_RELEASE); /* the next reap frees them */
    }
    pthread_mutex_unlock(&x->tx_mu);
    for (int i = 0; i < n; i++) {
        const struct firing *f = &x->firing_now[i];
        if (f->st != TDM_OK) tdm_err_set(f->st, "%s", f->msg);
        f->done(f->ctx, f->st);
    }
}

static void active_append(tdm_xfer_t *x, int j)
{
    x->jobs[j].next = -1;
    if (x->active_tail >= 0)
        x->jobs[x->active_tail].next = j;
    else
        x->active_head = j;
    x->active_tail = j;
}

static bool job_post(tdm_xfer_t *x, int j, bool caller);

/* Whether job j still has runs to post that nothing but posting holds back. */
static bool job_backlogged(const tdm_xfer_t *x, const struct job *jb)
{
    if (jb->state != JOB_ACTIVE || jb->kind != JOB_WRITE || jb->next_run >= jb->n_runs)
        return false;
    bool imm_waits = jb->next_run == jb->n_runs - 1 && jb->has_imm && jb->ops_in_flight &&
                     x->order == ORDER_DRAIN;
    return !imm_waits;
}

/* Takes a job for tmpl (its runs merged from `pages` when a write), appends it to the active
 * list and, for a write on a thread-safe domain, posts it from this thread. */
static tdm_status submit(tdm_xfer_t *x, const struct job *tmpl, const struct tdm_xfer_pages *pages)
{
    uint32_t n_peers = __atomic_load_n(&x->n_peers, __ATOMIC_ACQUIRE);
    if (tmpl->peer >= n_peers) return tdm_err_set(TDM_ENOTFOUND, "xfer: no peer %u", tmpl->peer);
    if (__atomic_load_n(&x->peers[tmpl->peer].dead, __ATOMIC_ACQUIRE))
        return tdm_err_set(TDM_EPEER, "xfer: peer %u is dead", tmpl->peer);
    pthread_mutex_lock(&x->tx_mu);
    int j = job_alloc(x);
    if (j < 0) {
        pthread_mutex_unlock(&x->tx_mu);
        if (tmpl->kind == JOB_WRITE) STAT_ADD(x, writes_refused, 1); /* not a heartbeat's send */
        return tdm_err_set(TDM_EAGAIN, "xfer: %d operations already queued", x->cfg.max_jobs);
    }
    struct job *jb = &x->jobs[j];
    *jb = *tmpl;
    if (pages) {
        uint64_t start;
        if (!runs_alloc(x, pages->n_pages, jb, &start)) {
            job_release(x, j);
            pthread_mutex_unlock(&x->tx_mu);
            STAT_ADD(x, writes_refused, 1);
            return tdm_err_set(TDM_EAGAIN, "xfer: the run ring (%llu runs) is full",
                               (unsigned long long)x->run_cap);
        }
        jb->n_runs = tdm_xfer_pages_merge(pages, x->caps.max_write_bytes, jb->runs);
        runs_trim(x, jb, start);
    }
    jb->state = JOB_ACTIVE;
    active_append(x, j);
    if (jb->kind == JOB_WRITE) {
        if (x->caller_posts && !x->backlog && !x->pushed_back) {
            if (!job_post(x, j, true)) x->pushed_back = true;
            STAT_ADD(x, caller_posts, 1);
        }
        if (x->pushed_back || job_backlogged(x, jb)) x->backlog = true;
    } else {
        __atomic_store_n(&x->work, true, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&x->tx_mu);
    tdm_fab_wake(x); /* what was posted needs progress; what was not, posting */
    return TDM_OK;
}

static uint64_t deadline_after(const tdm_xfer_t *x, int timeout_ms)
{
    int ms = timeout_ms > 0 ? timeout_ms : x->cfg.op_timeout_ms;
    return tdm_now_ns() + (uint64_t)ms * 1000000ull;
}

tdm_status tdm_xfer_write_pages(tdm_xfer_t *x, uint32_t peer, tdm_xfer_mr_t *src,
                                const struct tdm_xfer_rmem *dst, const struct tdm_xfer_pages *pages,
                                const struct tdm_xfer_imm *imm, int timeout_ms,
                                tdm_xfer_done_fn done, void *ctx)
{
    if (!x || !src || !dst || !pages || timeout_ms < 0)
        return tdm_err_set(TDM_EINVAL, "xfer: write_pages: missing argument");
    if (src->x != x) return tdm_err_set(TDM_EINVAL, "xfer: region of another engine");
    if (dst->kind != TDM_XFER_MEM_HOST && !x->caps.hmem_cuda)
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer: the provider cannot write cuda memory");
    if (pages->page_bytes > x->caps.max_write_bytes)
        return tdm_err_set(TDM_ERANGE, "xfer: page of %llu bytes over the provider's %zu",
                           (unsigned long long)pages->page_bytes, x->caps.max_write_bytes);
    tdm_status st =
        tdm_xfer_pages_check(pages, src->bytes, dst->bytes, (uint32_t)x->cfg.max_pages_per_write);
    if (st != TDM_OK) return st;
    struct job t = {.kind = JOB_WRITE,
                    .peer = peer,
                    .deadline_ns = deadline_after(x, timeout_ms),
                    .done = done,
                    .ctx = ctx,
                    .src = src,
                    .dst = *dst};
    if (imm) {
        if ((st = tdm_xfer_imm_encode(x->caps.imm_bits, imm, &t.imm_data)) != TDM_OK) return st;
        t.has_imm = true;
    }
    return submit(x, &t, pages);
}

tdm_status tdm_xfer_write(tdm_xfer_t *x, uint32_t peer, tdm_xfer_mr_t *src, uint64_t src_offset,
                          const struct tdm_xfer_rmem *dst, uint64_t dst_offset, uint64_t bytes,
                          const struct tdm_xfer_imm *imm, int timeout_ms, tdm_xfer_done_fn done,
                          void *ctx)
{
    struct tdm_xfer_pages p = tdm_xfer_pages_one(src_offset, dst_offset, bytes);
    return tdm_xfer_write_pages(x, peer, src, dst, &p, imm, timeout_ms, done, ctx);
}

tdm_status tdm_fab_send_typed(tdm_xfer_t *x, uint32_t peer, uint8_t type, const void *payload,
                              size_t bytes, int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    if (bytes > (size_t)x->cfg.ctrl_bytes)
        return tdm_err_set(TDM_ERANGE, "xfer: control message of %zu bytes (cap %d)", bytes,
                           x->cfg.ctrl_bytes);
    struct job t = {.kind = JOB_SEND,
                    .peer = peer,
                    .deadline_ns = deadline_after(x, timeout_ms),
                    .done = done,
                    .ctx = ctx};
    t.msg_bytes = TDM_XFER_WIRE_HDR + bytes;
    t.msg = malloc(t.msg_bytes);
    if (!t.msg) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
    tdm_xfer_wire_put_hdr(t.msg, type, x->nonce, (uint32_t)bytes);
    if (bytes) memcpy(t.msg + TDM_XFER_WIRE_HDR, payload, bytes);
    tdm_status st = submit(x, &t, NULL);
    if (st != TDM_OK) free(t.msg);
    return st;
}

tdm_status tdm_xfer_send(tdm_xfer_t *x, uint32_t peer, const void *msg, size_t bytes,
                         int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    if (!x || (!msg && bytes) || timeout_ms < 0)
        return tdm_err_set(TDM_EINVAL, "xfer: send: bad argument");
    return tdm_fab_send_typed(x, peer, TDM_XFER_MSG_USER, msg, bytes, timeout_ms, done, ctx);
}

tdm_status tdm_xfer_send_imm(tdm_xfer_t *x, uint32_t peer, const struct tdm_xfer_imm *imm,
                             int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    if (!x || !imm || timeout_ms < 0)
        return tdm_err_set(TDM_EINVAL, "xfer: send_imm: bad argument");
    uint64_t data;
    tdm_status st = tdm_xfer_imm_encode(x->caps.imm_bits, imm, &data);
    if (st != TDM_OK) return st;
    uint8_t payload[8];
    tdm_put_u64(payload, data);
    return tdm_fab_send_typed(x, peer, TDM_XFER_MSG_IMM, payload, sizeof(payload), timeout_ms, done,
                              ctx);
}

int tdm_fab_op_get(tdm_xfer_t *x, int reserve)
{
    return x->n_op_free > reserve ? x->op_free[--x->n_op_free] : -1;
}

void tdm_fab_op_put(tdm_xfer_t *x, int o)
{
    x->ops[o].kind = OP_FREE;
    x->op_free[x->n_op_free++] = o;
}

tdm_status tdm_fab_post_recv(tdm_xfer_t *x, int o)
{
    struct op *op = &x->ops[o];
    uint8_t *buf = x->bufs + (size_t)op->buf * x->buf_bytes;
    int rc = (int)fi_recv(x->ep, buf, x->buf_bytes, x->bufs_desc, FI_ADDR_UNSPEC, &op->fctx);
    if (rc == -FI_EAGAIN) { /* retried after progress, from the progress loop */
        x->repost[x->n_repost++] = o;
        STAT_ADD(x, eagain_retries, 1);
        return TDM_OK;
    }
    if (rc) return tdm_err_set(TDM_EIO, "xfer: fi_recv: %s", fi_msg(rc));
    return TDM_OK;
}

/* Posts what job j can post now (tx_mu held); false when the provider or the op pool pushed
 * back (stop posting). From a submitting thread (caller) it never ends the job: a failure is
 * left for the progress thread, which fires the callbacks. */
static bool job_post(tdm_xfer_t *x, int j, bool caller)
{
    struct job *jb = &x->jobs[j];
    struct peer *p = &x->peers[jb->peer];
    if (jb->post_err) {
        if (caller) return true;
        tdm_err_set(TDM_EPEER, "xfer: fi_write to peer %u: %s", jb->peer, fi_msg(jb->post_err));
        tdm_fab_job_finish(x, j, TDM_EPEER);
        return true;
    }
    if (jb->kind == JOB_SEND) {
        if (caller || jb->ops_in_flight || jb->next_run) return true;
        if (!x->n_tx_free) return false;
        int o = tdm_fab_op_get(x, OPS_RESERVED);
        if (o < 0) return false;
        int b = x->tx_free[x->n_tx_free - 1];
        uint8_t *buf = x->bufs + (size_t)b * x->buf_bytes;
        memcpy(buf, jb->msg, jb->msg_bytes);
        x->ops[o] = (struct op){.kind = OP_SEND, .job = j, .peer = jb->peer, .buf = b};
        int rc = (int)fi_send(x->ep, buf, jb->msg_bytes, x->bufs_desc, p->fi, &x->ops[o].fctx);
        if (rc == -FI_EAGAIN) {
            tdm_fab_op_put(x, o);
            STAT_ADD(x, eagain_retries, 1);
            return false;
        }
        if (rc) {
            tdm_fab_op_put(x, o);
            tdm_err_set(TDM_EPEER, "xfer: fi_send to peer %u: %s", jb->peer, fi_msg(rc));
            tdm_fab_job_finish(x, j, TDM_EPEER);
            return true;
        }
        x->n_tx_free--;
        jb->ops_in_flight = 1;
        jb->next_run = 1;
        STAT_ADD(x, sends_posted, 1);
        return true;
    }
    while (jb->next_run < jb->n_runs && jb->state == JOB_ACTIVE) {
        bool imm = jb->next_run == jb->n_runs - 1 && jb->has_imm;
        if (imm && jb->ops_in_flight && x->order == ORDER_DRAIN)
            return true; /* the immediate goes after the rest have completed */
        if (tdm_xfer_faults_write(&x->faults, x->write_seq)) {
            if (caller) return true; /* the progress thread fails it */
            x->write_seq++;
            STAT_ADD(x, injected_failures, 1);
            tdm_err_set(TDM_EIO, "xfer: injected write failure (run %u of %u)", jb->next_run,
                        jb->n_runs);
            tdm_fab_job_finish(x, j, TDM_EIO);
            return true;
        }
        int o = tdm_fab_op_get(x, OPS_RESERVED);
        if (o < 0) return false;
        const struct tdm_xfer_run *r = &jb->runs[jb->next_run];
        x->ops[o] = (struct op){.kind = OP_WRITE, .job = j, .peer = jb->peer, .buf = -1};
        void *src = (uint8_t *)jb->src->base + r->src_off;
        uint64_t raddr = jb->dst.addr + r->dst_off;
        int rc;
        if (imm && x->order == ORDER_FENCE) {
            struct iovec iov = {.iov_base = src, .iov_len = r->bytes};
            struct fi_rma_iov riov = {.addr = raddr, .len = r->bytes, .key = jb->dst.key};
            void *desc = jb->src->desc;
            struct fi_msg_rma m = {.msg_iov = &iov,
                                   .desc = &desc,
                                   .iov_count = 1,
                                   .addr = p->fi,
                                   .rma_iov = &riov,
                                   .rma_iov_count = 1,
                                   .context = &x->ops[o].fctx,
                                   .data = jb->imm_data};
            rc = (int)fi_writemsg(x->ep, &m, FI_FENCE | FI_REMOTE_CQ_DATA | FI_COMPLETION);
        } else if (imm) {
            rc = (int)fi_writedata(x->ep, src, r->bytes, jb->src->desc, jb->imm_data, p->fi, raddr,
                                   jb->dst.key, &x->ops[o].fctx);
        } else {
            rc = (int)fi_write(x->ep, src, r->bytes, jb->src->desc, p->fi, raddr, jb->dst.key,
                               &x->ops[o].fctx);
        }
        if (rc == -FI_EAGAIN) {
            tdm_fab_op_put(x, o);
            STAT_ADD(x, eagain_retries, 1);
            return false;
        }
        if (rc) {
            tdm_fab_op_put(x, o);
            if (caller) {
                jb->post_err = rc;
                return true;
            }
            tdm_err_set(TDM_EPEER, "xfer: fi_write to peer %u: %s", jb->peer, fi_msg(rc));
            tdm_fab_job_finish(x, j, TDM_EPEER);
            return true;
        }
        x->write_seq++;
        jb->ops_in_flight++;
        jb->next_run++;
        STAT_ADD(x, writes_posted, 1);
        STAT_ADD(x, write_bytes, r->bytes);
    }
    if (jb->next_run >= jb->n_runs) runs_release(x, jb); /* every run is posted */
    return true;
}

/* After completions (or a bounded number of idle polls) a push-back ends; then posts what the
 * active jobs can post, in submission order, ends the writes whose runs all completed, and
 * frees the jobs that are done with nothing in flight. Progress thread. */
void tdm_fab_reap_and_post(tdm_xfer_t *x, bool progressed)
{
    /* nothing completed, ended, was left to post or was submitted: leave tx_mu to the posters */
    if (!progressed && !__atomic_load_n(&x->backlog, __ATOMIC_RELAXED) &&
        !__atomic_load_n(&x->pushed_back, __ATOMIC_RELAXED) &&
        !__atomic_exchange_n(&x->work, false, __ATOMIC_ACQ_REL))
        return;
    pthread_mutex_lock(&x->tx_mu);
    if (x->pushed_back && (progressed || ++x->pushed_back_polls > 64)) {
        x->pushed_back = false;
        x->pushed_back_polls = 0;
    }
    int prev = -1, j = x->active_head;
    bool backlog = false;
    while (j >= 0) {
        struct job *jb = &x->jobs[j];
        int next = jb->next;
        if (jb->state == JOB_ACTIVE && !x->pushed_back) {
            if (!job_post(x, j, false)) x->pushed_back = true;
        }
        if (jb->state == JOB_ACTIVE && jb->ops_in_flight == 0 && jb->next_run >= jb->n_runs &&
            jb->kind == JOB_WRITE)
            tdm_fab_job_finish(x, j, TDM_OK);
        if (job_backlogged(x, jb)) backlog = true;
        if (jb->state == JOB_DONE && jb->ops_in_flight == 0 && !jb->firing) {
            if (prev >= 0)
                x->jobs[prev].next = next;
            else
                x->active_head = next;
            if (x->active_tail == j) x->active_tail = prev;
            job_release(x, j);
        } else {
            prev = j;
        }
        j = next;
    }
    x->backlog = backlog || x->pushed_back;
    pthread_mutex_unlock(&x->tx_mu);
    tdm_fab_fire_queued(x);
}

/* A transmit op completed (tx_mu held): its job moves on, and a write whose runs have all
 * completed ends here. */
void tdm_fab_tx_done(tdm_xfer_t *x, struct op *op)
{
    int o = (int)(op - x->ops);
    int j = op->job;
    enum op_kind kind = op->kind;
    tdm_fab_op_put(x, o);
    if (j < 0) return;
    struct job *jb = &x->jobs[j];
    jb->ops_in_flight--;
    if (jb->state != JOB_ACTIVE) return;
    if (kind == OP_SEND)
        tdm_fab_job_finish(x, j, TDM_OK);
    else if (jb->ops_in_flight == 0 && jb->next_run >= jb->n_runs)
        tdm_fab_job_finish(x, j, TDM_OK);
    else if (jb->ops_in_flight == 0 && x->order == ORDER_DRAIN && !x->pushed_back)
        job_post(x, j, false); /* the drained immediate goes at once */
}
