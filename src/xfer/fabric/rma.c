/*
 * Jobs of the libfabric transport: submission from user threads (paged writes merged into runs,
 * single writes, sends; bounded, TDM_EAGAIN when full) and, on the progress thread, posting
 * them as fabric operations from the fixed op pool, immediate last.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

static int job_alloc_locked(tdm_xfer_t *x)
{
    int j = x->job_free;
    if (j >= 0) x->job_free = x->jobs[j].next;
    return j;
}

static void job_release(tdm_xfer_t *x, int j)
{
    struct job *jb = &x->jobs[j];
    free(jb->runs);
    free(jb->msg);
    pthread_mutex_lock(&x->mu);
    memset(jb, 0, sizeof(*jb));
    jb->next = x->job_free;
    x->job_free = j;
    pthread_mutex_unlock(&x->mu);
}

/* Fires the job's callback once with st and the message currently set on this thread. */
void tdm_fab_job_finish(tdm_xfer_t *x, int j, tdm_status st)
{
    struct job *jb = &x->jobs[j];
    if (jb->state == JOB_DONE) return;
    jb->state = JOB_DONE;
    if (jb->done) jb->done(jb->ctx, st);
}

static tdm_status submit(tdm_xfer_t *x, struct job *tmpl)
{
    pthread_mutex_lock(&x->mu);
    if (tmpl->peer >= x->n_peers) {
        pthread_mutex_unlock(&x->mu);
        return tdm_err_set(TDM_ENOTFOUND, "xfer: no peer %u", tmpl->peer);
    }
    if (x->peers[tmpl->peer].dead) {
        pthread_mutex_unlock(&x->mu);
        return tdm_err_set(TDM_EPEER, "xfer: peer %u is dead", tmpl->peer);
    }
    int j = job_alloc_locked(x);
    if (j < 0) {
        pthread_mutex_unlock(&x->mu);
        return tdm_err_set(TDM_EAGAIN, "xfer: %d operations already queued", x->cfg.max_jobs);
    }
    struct job *jb = &x->jobs[j];
    *jb = *tmpl;
    jb->state = JOB_QUEUED;
    jb->next = -1;
    if (x->submit_tail >= 0)
        x->jobs[x->submit_tail].next = j;
    else
        x->submit_head = j;
    x->submit_tail = j;
    pthread_mutex_unlock(&x->mu);
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
    t.runs = malloc(sizeof(*t.runs) * pages->n_pages);
    if (!t.runs) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory for %u runs", pages->n_pages);
    t.n_runs = tdm_xfer_pages_merge(pages, x->caps.max_write_bytes, t.runs);
    if ((st = submit(x, &t)) != TDM_OK) free(t.runs);
    return st;
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
    tdm_status st = submit(x, &t);
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

/* Posts what a job can post now; returns false when the provider pushed back (stop posting). */
static bool job_post(tdm_xfer_t *x, int j)
{
    struct job *jb = &x->jobs[j];
    struct peer *p = &x->peers[jb->peer];
    if (jb->kind == JOB_SEND) {
        if (jb->ops_in_flight || jb->next_run) return true;
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
        bool last = jb->next_run == jb->n_runs - 1;
        if (last && jb->has_imm && jb->ops_in_flight && !x->ordered_writes)
            return true; /* the immediate goes after the rest have completed */
        int o = tdm_fab_op_get(x, OPS_RESERVED);
        if (o < 0) return false;
        const struct tdm_xfer_run *r = &jb->runs[jb->next_run];
        if (tdm_xfer_faults_write(&x->faults, x->write_seq++)) {
            tdm_fab_op_put(x, o);
            STAT_ADD(x, injected_failures, 1);
            tdm_err_set(TDM_EIO, "xfer: injected write failure (run %u of %u)", jb->next_run,
                        jb->n_runs);
            tdm_fab_job_finish(x, j, TDM_EIO);
            return true;
        }
        x->ops[o] = (struct op){.kind = OP_WRITE, .job = j, .peer = jb->peer, .buf = -1};
        void *src = (uint8_t *)jb->src->base + r->src_off;
        uint64_t raddr = jb->dst.addr + r->dst_off;
        int rc;
        if (last && jb->has_imm)
            rc = (int)fi_writedata(x->ep, src, r->bytes, jb->src->desc, jb->imm_data, p->fi, raddr,
                                   jb->dst.key, &x->ops[o].fctx);
        else
            rc = (int)fi_write(x->ep, src, r->bytes, jb->src->desc, p->fi, raddr, jb->dst.key,
                               &x->ops[o].fctx);
        if (rc == -FI_EAGAIN) {
            tdm_fab_op_put(x, o);
            x->write_seq--; /* the retry is the same write */
            STAT_ADD(x, eagain_retries, 1);
            return false;
        }
        if (rc) {
            tdm_fab_op_put(x, o);
            tdm_err_set(TDM_EPEER, "xfer: fi_write to peer %u: %s", jb->peer, fi_msg(rc));
            tdm_fab_job_finish(x, j, TDM_EPEER);
            return true;
        }
        jb->ops_in_flight++;
        jb->next_run++;
        STAT_ADD(x, writes_posted, 1);
        STAT_ADD(x, write_bytes, r->bytes);
    }
    return true;
}

/* Removes finished jobs from the active list and frees those with nothing in flight. */
void tdm_fab_reap_and_post(tdm_xfer_t *x)
{
    int prev = -1, j = x->active_head;
    bool can_post = !x->pushed_back;
    while (j >= 0) {
        struct job *jb = &x->jobs[j];
        int next = jb->next;
        if (jb->state == JOB_ACTIVE && can_post) {
            can_post = job_post(x, j);
            if (!can_post) x->pushed_back = true;
        }
        if (jb->state == JOB_ACTIVE && jb->ops_in_flight == 0 && jb->next_run >= jb->n_runs &&
            jb->kind == JOB_WRITE)
            tdm_fab_job_finish(x, j, TDM_OK);
        if (jb->state == JOB_DONE && jb->ops_in_flight == 0) {
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
}

void tdm_fab_take_submissions(tdm_xfer_t *x)
{
    pthread_mutex_lock(&x->mu);
    int head = x->submit_head;
    x->submit_head = x->submit_tail = -1;
    pthread_mutex_unlock(&x->mu);
    while (head >= 0) {
        int j = head;
        struct job *jb = &x->jobs[j];
        head = jb->next;
        jb->next = -1;
        jb->state = JOB_ACTIVE;
        if (x->active_tail >= 0)
            x->jobs[x->active_tail].next = j;
        else
            x->active_head = j;
        x->active_tail = j;
        if (x->peers[jb->peer].dead) {
            tdm_err_set(TDM_EPEER, "xfer: peer %u is dead", jb->peer);
            tdm_fab_job_finish(x, j, TDM_EPEER);
        }
    }
}
