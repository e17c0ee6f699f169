/*
 * The libfabric transport: one RDM endpoint, its completion queue and address vector, and the
 * progress thread that drives them.
 *
 * Shape. User threads never touch the endpoint: tdm_xfer_write_pages / _write / _send validate,
 * merge pages into runs, take a job from a fixed pool and append it to the submit queue (bounded:
 * TDM_EAGAIN when the pool is empty). The progress thread alone posts fabric operations, reads
 * the CQ (this is what keeps tcp;ofi_rxm's manual progress moving on both sides), counts
 * immediates, runs timers (deadlines, heartbeats, peer liveness, delayed immediates) and fires
 * callbacks. Only memory registration and address-vector inserts are called from user threads,
 * which the FI_THREAD_SAFE domain allows.
 *
 * A job's life (the progress thread performs every transition after QUEUED):
 *
 *            submit            taken by the thread        all runs completed
 *   FREE ----------> QUEUED -------------------> ACTIVE --------------------> FREE   done(OK)
 *                      |                          |  deadline / peer death / completion error /
 *                      | peer dead, stop          |  injected failure
 *                      +------> FREE done(err)    v
 *                                               DONE (done(err) fired; fabric ops still in flight)
 *                                                 |  last in-flight op completes (or destroy)
 *                                                 +----> FREE
 *
 * A write job posts its runs concurrently; the run carrying the immediate goes last. When the
 * provider orders write data (FI_ORDER_WAW without a size limit: tcp;ofi_rxm) it is posted right
 * behind the others; otherwise the runs are delivery-complete writes (when offered) and the
 * immediate run waits until they have completed. Either way an immediate means "all bytes of
 * this write landed" (DESIGN.md §4: the decoder counts immediates, never completion messages).
 *
 * Op contexts: every posted operation's context is an entry of `ops` (fixed pool, max_ops for
 * transmit plus one per preposted receive); an op outlives a timed-out job until the provider
 * reports it, so a late completion never touches freed memory.
 *
 * Peers: a peer entry is made by tdm_xfer_peer_add (we send hello) or by a hello from an unknown
 * sender (we insert its address and hello back). Every message carries the sender's random nonce,
 * which maps it to its entry; any message refreshes last_seen. Dead is final for an entry: a
 * restarted process has a new nonce and becomes a new peer.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "xfer/xfer_int.h"

#define ADDR_RAW_MAX    256
#define N_TX_BUFS       64
#define REORDER_HOLD_NS (20ull * 1000000ull) /* a held immediate is released after 20 ms */
#define DELAY_RING      65536
#define HELD_MAX        64

enum job_state { JOB_FREE = 0, JOB_QUEUED, JOB_ACTIVE, JOB_DONE };
enum job_kind { JOB_WRITE = 0, JOB_SEND };
enum op_kind { OP_FREE = 0, OP_WRITE, OP_SEND, OP_HEARTBEAT, OP_RECV };

struct job {
    enum job_state state;
    enum job_kind kind;
    uint32_t peer;
    uint64_t deadline_ns;
    tdm_xfer_done_fn done;
    void *ctx;
    int next; /* submit queue or active list link; -1 ends */
    /* write */
    tdm_xfer_mr_t *src;
    struct tdm_xfer_rmem dst;
    struct tdm_xfer_run *runs; /* [n_runs], malloc'd at submit */
    uint32_t n_runs, next_run, ops_in_flight;
    bool has_imm;
    uint64_t imm_data;
    /* send: the whole message, header included */
    uint8_t *msg;
    size_t msg_bytes;
};

struct op {
    struct fi_context2 fctx; /* first: the provider hands &fctx back */
    enum op_kind kind;
    int job;
    uint32_t peer;
    int buf; /* tx or rx buffer index */
};

struct peer {
    bool used, dead, known; /* known: its hello arrived (nonce bound) */
    bool hello_sent;
    fi_addr_t fi;
    uint8_t addr[ADDR_RAW_MAX];
    size_t addr_bytes;
    uint64_t nonce;
    uint64_t last_seen_ns, last_hb_ns;
};

struct held_imm {
    uint64_t data;
    uint64_t since_ns;
};

struct tdm_xfer {
    struct tdm_xfer_config cfg;
    char provider_name[64];
    char node[64];
    struct tdm_xfer_faults faults;
    struct tdm_xfer_caps caps;
    uint64_t nonce;

    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    uint8_t my_addr[ADDR_RAW_MAX];
    size_t my_addr_bytes;

    /* message buffers: [n_tx + n_rx][buf_bytes], one registered region */
    uint8_t *bufs;
    size_t buf_bytes;
    struct fid_mr *bufs_mr;
    void *bufs_desc;
    int tx_free[N_TX_BUFS];
    int n_tx_free;

    struct op *ops; /* [n_ops]: transmit ops then ctrl_rx_depth receive ops */
    int n_ops;
    int *op_free; /* stack of free transmit op indices */
    int n_op_free;
    int *repost; /* receive ops whose fi_recv met -FI_EAGAIN */
    int n_repost;

    pthread_mutex_t mu; /* guards jobs' FREE/QUEUED states, free list, submit queue, peers */
    pthread_cond_t cv;  /* peer state changes */
    struct job *jobs;   /* [max_jobs] */
    int job_free;       /* free list head */
    int submit_head, submit_tail;
    struct peer *peers; /* [max_peers] */
    uint32_t n_peers;
    uint64_t next_key;

    int active_head, active_tail; /* progress thread only */

    tdm_xfer_counters_t *counters;
    struct tdm_xfer_stats stats; /* updated with atomics */

    /* fault injection state (progress thread only) */
    uint64_t imm_seq, write_seq;
    struct {
        uint64_t release_ns, data;
    } * delay_ring;
    uint32_t delay_head, delay_count;
    struct held_imm held[HELD_MAX];
    int n_held;

    bool ordered_writes;   /* the provider places write data in posting order */
    bool traffic;          /* a completion other than a heartbeat's since the last poll */
    bool pushed_back;      /* the provider or the op pool refused a post: wait for completions */
    int pushed_back_polls; /* polls since, bounded so a push-back can never stall posting */

    pthread_t thread;
    bool thread_started;
    volatile int stop;
};

struct tdm_xfer_mr {
    tdm_xfer_t *x;
    struct fid_mr *mr;
    void *base;
    size_t bytes;
    enum tdm_xfer_mem_kind kind;
    uint64_t key;
    void *desc;
};

#define STAT_ADD(x, field, n) __atomic_fetch_add(&(x)->stats.field, (n), __ATOMIC_RELAXED)

static const char *fi_msg(int rc)
{
    return fi_strerror(rc < 0 ? -rc : rc);
}

void tdm_xfer_config_default(struct tdm_xfer_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->provider = "tcp;ofi_rxm";
    cfg->op_timeout_ms = 10000;
    cfg->heartbeat_ms = 200;
    cfg->peer_timeout_ms = 2000;
    cfg->max_jobs = 1024;
    cfg->max_ops = 256;
    cfg->ctrl_bytes = 8192;
    cfg->ctrl_rx_depth = 64;
    cfg->max_peers = 64;
    cfg->max_slots = 4096;
    cfg->max_pages_per_write = 65536;
}

/* ---- jobs ---- */

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
static void job_finish(tdm_xfer_t *x, int j, tdm_status st)
{
    struct job *jb = &x->jobs[j];
    if (jb->state == JOB_DONE) return;
    jb->state = JOB_DONE;
    if (jb->done) jb->done(jb->ctx, st);
}

/* ---- peers ---- */

static void peer_declare_dead(tdm_xfer_t *x, uint32_t p, const char *why)
{
    pthread_mutex_lock(&x->mu);
    bool was = x->peers[p].dead;
    x->peers[p].dead = true;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->mu);
    if (was) return;
    if (strstr(why, "goodbye"))
        TDM_DEBUG("xfer: peer %u left: %s", p, why);
    else
        TDM_WARN("xfer: peer %u is dead: %s", p, why);
    /* active jobs for it */
    for (int j = x->active_head; j >= 0; j = x->jobs[j].next) {
        struct job *jb = &x->jobs[j];
        if (jb->peer == p && jb->state == JOB_ACTIVE) {
            tdm_err_set(TDM_EPEER, "xfer: peer %u died: %s", p, why);
            job_finish(x, j, TDM_EPEER);
        }
    }
    tdm_xfer_counters_fail_peer(x->counters, p, TDM_EPEER);
    if (x->cfg.on_peer) x->cfg.on_peer(x->cfg.on_peer_ctx, p, false);
}

/* Finds or inserts the peer with this raw address (mu held). */
static tdm_status peer_find_or_insert_locked(tdm_xfer_t *x, const uint8_t *raw, size_t n,
                                             uint32_t *out, bool *inserted)
{
    *inserted = false;
    for (uint32_t i = 0; i < x->n_peers; i++) {
        struct peer *p = &x->peers[i];
        if (!p->dead && p->addr_bytes == n && !memcmp(p->addr, raw, n)) {
            *out = i;
            return TDM_OK;
        }
    }
    if (x->n_peers >= (uint32_t)x->cfg.max_peers)
        return tdm_err_set(TDM_ERANGE, "xfer: more than %d peers", x->cfg.max_peers);
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    int rc = fi_av_insert(x->av, raw, 1, &fa, 0, NULL);
    if (rc != 1) return tdm_err_set(TDM_EINVAL, "xfer: fi_av_insert failed: %s", fi_msg(rc));
    uint32_t i = x->n_peers++;
    struct peer *p = &x->peers[i];
    memset(p, 0, sizeof(*p));
    p->used = true;
    p->fi = fa;
    memcpy(p->addr, raw, n);
    p->addr_bytes = n;
    p->last_seen_ns = tdm_now_ns();
    *out = i;
    *inserted = true;
    return TDM_OK;
}

/* ---- submission ---- */

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
    uint32_t zero = 0;
    struct tdm_xfer_pages p = {.src_pages = &zero,
                               .dst_pages = &zero,
                               .n_pages = 1,
                               .page_bytes = bytes,
                               .src_offset = src_offset,
                               .dst_offset = dst_offset};
    return tdm_xfer_write_pages(x, peer, src, dst, &p, imm, timeout_ms, done, ctx);
}

static tdm_status send_typed(tdm_xfer_t *x, uint32_t peer, uint8_t type, const void *payload,
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
    return send_typed(x, peer, TDM_XFER_MSG_USER, msg, bytes, timeout_ms, done, ctx);
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
    return send_typed(x, peer, TDM_XFER_MSG_IMM, payload, sizeof(payload), timeout_ms, done, ctx);
}

static void send_hello(tdm_xfer_t *x, uint32_t peer)
{
    uint8_t payload[3 + ADDR_RAW_MAX];
    size_t n = tdm_xfer_wire_hello_put(payload, sizeof(payload), x->caps.imm_bits, x->my_addr,
                                       x->my_addr_bytes);
    if (send_typed(x, peer, TDM_XFER_MSG_HELLO, payload, n, 0, NULL, NULL) != TDM_OK)
        TDM_WARN("xfer: hello to peer %u not queued: %s", peer, tdm_err_msg());
}

/* ---- immediates on the receiver, through the fault layer ---- */

static void imm_deliver_now(tdm_xfer_t *x, uint64_t data)
{
    struct tdm_xfer_imm imm;
    tdm_xfer_imm_decode(x->caps.imm_bits, data, &imm);
    tdm_xfer_counters_deliver(x->counters, &imm);
}

static void release_held(tdm_xfer_t *x, uint64_t now, bool all)
{
    int k = 0;
    for (int i = 0; i < x->n_held; i++) {
        if (all || now - x->held[i].since_ns >= REORDER_HOLD_NS)
            imm_deliver_now(x, x->held[i].data);
        else
            x->held[k++] = x->held[i];
    }
    x->n_held = k;
}

/* Delivery after the optional delay; a delivery also releases the immediates held for reorder,
 * so they land after it. */
static void imm_deliver(tdm_xfer_t *x, uint64_t data)
{
    imm_deliver_now(x, data);
    if (x->n_held) release_held(x, 0, true);
}

static void imm_schedule(tdm_xfer_t *x, uint64_t data)
{
    if (x->faults.delay_imm_ms > 0 && x->delay_count < DELAY_RING) {
        uint32_t at = (x->delay_head + x->delay_count) % DELAY_RING;
        x->delay_ring[at].release_ns = tdm_now_ns() + (uint64_t)x->faults.delay_imm_ms * 1000000ull;
        x->delay_ring[at].data = data;
        x->delay_count++;
        STAT_ADD(x, imm_delayed, 1);
        return;
    }
    imm_deliver(x, data);
}

static void imm_arrived(tdm_xfer_t *x, uint64_t data)
{
    STAT_ADD(x, imm_received, 1);
    switch (tdm_xfer_faults_imm(&x->faults, x->imm_seq++)) {
    case TDM_XFER_IMM_DROP:
        STAT_ADD(x, imm_dropped, 1);
        return;
    case TDM_XFER_IMM_DUP:
        STAT_ADD(x, imm_duplicated, 1);
        imm_schedule(x, data);
        imm_schedule(x, data);
        return;
    case TDM_XFER_IMM_REORDER:
        if (x->n_held < HELD_MAX) {
            STAT_ADD(x, imm_reordered, 1);
            x->held[x->n_held++] = (struct held_imm){data, tdm_now_ns()};
            return;
        }
        /* fallthrough */
    case TDM_XFER_IMM_DELIVER:
        imm_schedule(x, data);
        return;
    }
}

static void fault_timers(tdm_xfer_t *x, uint64_t now)
{
    while (x->delay_count && x->delay_ring[x->delay_head].release_ns <= now) {
        uint64_t d = x->delay_ring[x->delay_head].data;
        x->delay_head = (x->delay_head + 1) % DELAY_RING;
        x->delay_count--;
        imm_deliver(x, d);
    }
    if (x->n_held) release_held(x, now, false);
}

/* ---- posting (progress thread) ---- */

/* Writes and user sends leave OPS_RESERVED ops free, so heartbeats are never starved by a full
 * pipeline of writes (a starved heartbeat would make the peer declare us dead). */
#define OPS_RESERVED 4
static int op_get(tdm_xfer_t *x, int reserve)
{
    return x->n_op_free > reserve ? x->op_free[--x->n_op_free] : -1;
}

static void op_put(tdm_xfer_t *x, int o)
{
    x->ops[o].kind = OP_FREE;
    x->op_free[x->n_op_free++] = o;
}

static tdm_status post_recv(tdm_xfer_t *x, int o)
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
        int o = op_get(x, OPS_RESERVED);
        if (o < 0) return false;
        int b = x->tx_free[x->n_tx_free - 1];
        uint8_t *buf = x->bufs + (size_t)b * x->buf_bytes;
        memcpy(buf, jb->msg, jb->msg_bytes);
        x->ops[o] = (struct op){.kind = OP_SEND, .job = j, .peer = jb->peer, .buf = b};
        int rc = (int)fi_send(x->ep, buf, jb->msg_bytes, x->bufs_desc, p->fi, &x->ops[o].fctx);
        if (rc == -FI_EAGAIN) {
            op_put(x, o);
            STAT_ADD(x, eagain_retries, 1);
            return false;
        }
        if (rc) {
            op_put(x, o);
            tdm_err_set(TDM_EPEER, "xfer: fi_send to peer %u: %s", jb->peer, fi_msg(rc));
            job_finish(x, j, TDM_EPEER);
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
        int o = op_get(x, OPS_RESERVED);
        if (o < 0) return false;
        const struct tdm_xfer_run *r = &jb->runs[jb->next_run];
        if (tdm_xfer_faults_write(&x->faults, x->write_seq++)) {
            op_put(x, o);
            STAT_ADD(x, injected_failures, 1);
            tdm_err_set(TDM_EIO, "xfer: injected write failure (run %u of %u)", jb->next_run,
                        jb->n_runs);
            job_finish(x, j, TDM_EIO);
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
            op_put(x, o);
            x->write_seq--; /* the retry is the same write */
            STAT_ADD(x, eagain_retries, 1);
            return false;
        }
        if (rc) {
            op_put(x, o);
            tdm_err_set(TDM_EPEER, "xfer: fi_write to peer %u: %s", jb->peer, fi_msg(rc));
            job_finish(x, j, TDM_EPEER);
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
static void reap_and_post(tdm_xfer_t *x)
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
            job_finish(x, j, TDM_OK);
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

static void take_submissions(tdm_xfer_t *x)
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
            job_finish(x, j, TDM_EPEER);
        }
    }
}

/* ---- completions ---- */

static struct op *op_of(tdm_xfer_t *x, void *ctx)
{
    struct op *o = ctx;
    if (!ctx || o < x->ops || o >= x->ops + x->n_ops) return NULL;
    return o;
}

static void handle_message(tdm_xfer_t *x, const uint8_t *buf, size_t n)
{
    struct tdm_xfer_wire_hdr h;
    const uint8_t *payload;
    if (tdm_xfer_wire_parse(buf, n, &h, &payload) != TDM_OK) {
        TDM_WARN("xfer: dropped a malformed message: %s", tdm_err_msg());
        return;
    }
    uint32_t peer = UINT32_MAX;
    bool newly_known = false, send_back = false;
    pthread_mutex_lock(&x->mu);
    for (uint32_t i = 0; i < x->n_peers; i++)
        if (x->peers[i].known && x->peers[i].nonce == h.nonce) peer = i;
    if (h.type == TDM_XFER_MSG_HELLO && peer == UINT32_MAX) {
        int imm_bits;
        const uint8_t *addr;
        size_t addr_bytes;
        bool inserted;
        if (tdm_xfer_wire_hello_parse(payload, h.payload_bytes, &imm_bits, &addr, &addr_bytes) !=
                TDM_OK ||
            addr_bytes > ADDR_RAW_MAX) {
            pthread_mutex_unlock(&x->mu);
            TDM_WARN("xfer: bad hello: %s", tdm_err_msg());
            return;
        } else if (imm_bits != x->caps.imm_bits) {
            pthread_mutex_unlock(&x->mu);
            TDM_WARN("xfer: peer uses %d-bit immediates, we use %d; ignored", imm_bits,
                     x->caps.imm_bits);
            return;
        } else if (peer_find_or_insert_locked(x, addr, addr_bytes, &peer, &inserted) != TDM_OK) {
            pthread_mutex_unlock(&x->mu);
            TDM_WARN("xfer: hello from a peer we cannot add: %s", tdm_err_msg());
            return;
        }
        struct peer *p = &x->peers[peer];
        p->known = true;
        p->nonce = h.nonce;
        newly_known = true;
        send_back = !p->hello_sent;
        p->hello_sent = true;
        pthread_cond_broadcast(&x->cv);
    }
    if (peer != UINT32_MAX) x->peers[peer].last_seen_ns = tdm_now_ns();
    bool dead = peer != UINT32_MAX && x->peers[peer].dead;
    pthread_mutex_unlock(&x->mu);
    if (peer == UINT32_MAX || dead) return; /* unknown sender or a dead incarnation */
    STAT_ADD(x, msgs_received, 1);
    if (send_back) send_hello(x, peer);
    if (newly_known && x->cfg.on_peer) x->cfg.on_peer(x->cfg.on_peer_ctx, peer, true);
    switch (h.type) {
    case TDM_XFER_MSG_USER:
        if (x->cfg.on_msg) x->cfg.on_msg(x->cfg.on_msg_ctx, peer, payload, h.payload_bytes);
        break;
    case TDM_XFER_MSG_IMM:
        imm_arrived(x, tdm_get_u64(payload));
        break;
    case TDM_XFER_MSG_BYE:
        peer_declare_dead(x, peer, "it said goodbye");
        break;
    default:
        break;
    }
}

static void handle_completion(tdm_xfer_t *x, const struct fi_cq_data_entry *e)
{
    if ((e->flags & FI_REMOTE_CQ_DATA) && (e->flags & (FI_RMA | FI_REMOTE_WRITE))) {
        imm_arrived(x, e->data);
        x->traffic = true;
    }
    struct op *op = op_of(x, e->op_context);
    if (!op) return;
    int o = (int)(op - x->ops);
    if (op->kind != OP_HEARTBEAT &&
        !(op->kind == OP_RECV && e->len == TDM_XFER_WIRE_HDR)) /* heartbeats are not traffic */
        x->traffic = true;
    switch (op->kind) {
    case OP_RECV:
        if (e->flags & FI_RECV) handle_message(x, x->bufs + (size_t)op->buf * x->buf_bytes, e->len);
        if (!x->stop && post_recv(x, o) != TDM_OK) TDM_ERROR("xfer: %s", tdm_err_msg());
        break;
    case OP_SEND:
    case OP_HEARTBEAT:
        x->tx_free[x->n_tx_free++] = op->buf;
        /* fallthrough */
    case OP_WRITE:
        /* a completed operation is proof of life, even when heartbeats queue behind writes */
        pthread_mutex_lock(&x->mu);
        x->peers[op->peer].last_seen_ns = tdm_now_ns();
        pthread_mutex_unlock(&x->mu);
        if (op->job >= 0) x->jobs[op->job].ops_in_flight--;
        if (op->job >= 0 && op->kind == OP_SEND && x->jobs[op->job].state == JOB_ACTIVE)
            job_finish(x, op->job, TDM_OK);
        op_put(x, o);
        break;
    default:
        break;
    }
}

static void handle_error(tdm_xfer_t *x)
{
    struct fi_cq_err_entry err;
    memset(&err, 0, sizeof(err));
    if (fi_cq_readerr(x->cq, &err, 0) != 1) return;
    char pbuf[256];
    const char *pmsg = fi_cq_strerror(x->cq, err.prov_errno, err.err_data, pbuf, sizeof(pbuf));
    STAT_ADD(x, cq_errors, 1);
    struct op *op = op_of(x, err.op_context);
    if (!op) {
        TDM_WARN("xfer: completion error without context: %s (%s)", fi_msg(err.err),
                 pmsg ? pmsg : "");
        return;
    }
    int o = (int)(op - x->ops);
    if (op->kind == OP_RECV) {
        if (err.err != FI_ECANCELED)
            TDM_WARN("xfer: receive failed: %s (%s)", fi_msg(err.err), pmsg ? pmsg : "");
        if (!x->stop && post_recv(x, o) != TDM_OK) TDM_ERROR("xfer: %s", tdm_err_msg());
        return;
    }
    char why[384];
    snprintf(why, sizeof(why), "%s: %s", fi_msg(err.err), pmsg ? pmsg : "");
    uint32_t peer = op->peer;
    int j = op->job;
    if (op->kind == OP_SEND || op->kind == OP_HEARTBEAT) x->tx_free[x->n_tx_free++] = op->buf;
    op_put(x, o);
    if (j >= 0) {
        x->jobs[j].ops_in_flight--;
        tdm_err_set(TDM_EPEER, "xfer: operation to peer %u failed: %s", peer, why);
        job_finish(x, j, TDM_EPEER);
    }
    peer_declare_dead(x, peer, why);
}

/* ---- timers ---- */

/* Returns false when it could not be posted now (retried at the next timer tick). */
static bool send_heartbeat(tdm_xfer_t *x, uint32_t peer)
{
    if (!x->n_tx_free) return false;
    int o = op_get(x, 0);
    if (o < 0) return false;
    int b = x->tx_free[x->n_tx_free - 1];
    uint8_t *buf = x->bufs + (size_t)b * x->buf_bytes;
    tdm_xfer_wire_put_hdr(buf, TDM_XFER_MSG_HEARTBEAT, x->nonce, 0);
    x->ops[o] = (struct op){.kind = OP_HEARTBEAT, .job = -1, .peer = peer, .buf = b};
    int rc = (int)fi_send(x->ep, buf, TDM_XFER_WIRE_HDR, x->bufs_desc, x->peers[peer].fi,
                          &x->ops[o].fctx);
    if (rc) {
        op_put(x, o);
        return false;
    }
    x->n_tx_free--;
    STAT_ADD(x, heartbeats_sent, 1);
    return true;
}

static void timers(tdm_xfer_t *x, uint64_t now)
{
    for (int j = x->active_head; j >= 0; j = x->jobs[j].next) {
        struct job *jb = &x->jobs[j];
        if (jb->state == JOB_ACTIVE && jb->deadline_ns <= now) {
            STAT_ADD(x, ops_timed_out, 1);
            tdm_err_set(TDM_ETIMEDOUT,
                        "xfer: operation to peer %u timed out (%u of %u runs "
                        "posted, %u in flight)",
                        jb->peer, jb->next_run, jb->n_runs, jb->ops_in_flight);
            job_finish(x, j, TDM_ETIMEDOUT);
        }
    }
    tdm_xfer_counters_expire(x->counters, now);
    uint64_t hb_ns = (uint64_t)x->cfg.heartbeat_ms * 1000000ull;
    uint64_t dead_ns = (uint64_t)x->cfg.peer_timeout_ms * 1000000ull;
    for (uint32_t i = 0;; i++) {
        pthread_mutex_lock(&x->mu);
        if (i >= x->n_peers) {
            pthread_mutex_unlock(&x->mu);
            break;
        }
        struct peer p = x->peers[i];
        pthread_mutex_unlock(&x->mu);
        if (p.dead) continue;
        if (dead_ns && now > p.last_seen_ns && now - p.last_seen_ns > dead_ns) {
            char why[96];
            snprintf(why, sizeof(why), "nothing heard for %d ms", x->cfg.peer_timeout_ms);
            peer_declare_dead(x, i, why);
            continue;
        }
        if (hb_ns && p.known && now - p.last_hb_ns >= hb_ns && send_heartbeat(x, i)) {
            pthread_mutex_lock(&x->mu);
            x->peers[i].last_hb_ns = now;
            pthread_mutex_unlock(&x->mu);
        }
    }
    fault_timers(x, now);
}

/* Handles what one fi_cq_read / fi_cq_sread returned; true when anything happened. */
static bool handle_cq_result(tdm_xfer_t *x, const struct fi_cq_data_entry *e, ssize_t n)
{
    if (n > 0) {
        for (ssize_t i = 0; i < n; i++)
            handle_completion(x, &e[i]);
        return true;
    }
    if (n == -FI_EAVAIL) {
        handle_error(x);
        return true;
    }
    if (n != -FI_EAGAIN && n != -FI_ETIMEDOUT && n != -FI_EINTR)
        TDM_ERROR("xfer: reading the completion queue: %s", fi_msg((int)n));
    return false;
}

/* Idle policy: keep polling (yielding the core between polls) for IDLE_SPIN_NS after the last
 * traffic (incoming RMA makes no completion on the target until its immediate, yet tcp;ofi_rxm
 * and shm need the target's progress to move the bytes), then poll every IDLE_SLEEP_NS, and
 * every IDLE_DEEP_SLEEP_NS once idle for IDLE_DEEP_NS (an idle server costs little CPU).
 * Heartbeats are not traffic, so an idle engine mostly sleeps. No fi_cq_sread: Debian's 1.17 shm
 * blocked in it past its timeout. */
#define IDLE_SPIN_NS       20000000ull
#define IDLE_SLEEP_NS      50000
#define IDLE_DEEP_NS       200000000ull
#define IDLE_DEEP_SLEEP_NS 500000

static void *progress_main(void *arg)
{
    tdm_xfer_t *x = arg;
    uint64_t last_timer = 0, last_activity = tdm_now_ns();
    while (!x->stop) {
        if (x->n_repost) {
            int n = x->n_repost;
            x->n_repost = 0;
            for (int i = 0; i < n; i++)
                if (post_recv(x, x->repost[i]) != TDM_OK) TDM_ERROR("xfer: %s", tdm_err_msg());
        }
        take_submissions(x);
        reap_and_post(x);
        struct fi_cq_data_entry e[32];
        bool busy = handle_cq_result(x, e, fi_cq_read(x->cq, e, TDM_ARRAY_LEN(e)));
        /* after a push-back (-FI_EAGAIN or no free op), post again only once something completed,
         * yielding meanwhile so the peer's progress (often on the same cores) can drain */
        if (x->pushed_back) {
            if (busy) {
                x->pushed_back = false;
                x->pushed_back_polls = 0;
            } else if (++x->pushed_back_polls > 64) {
                x->pushed_back = false;
                x->pushed_back_polls = 0;
            } else
                sched_yield();
        }
        uint64_t now = tdm_now_ns();
        if (now - last_timer >= 1000000ull) {
            timers(x, now);
            last_timer = now;
        }
        if (x->traffic || x->active_head >= 0) {
            x->traffic = false;
            last_activity = now;
            continue;
        }
        if (now - last_activity < IDLE_SPIN_NS) {
            sched_yield(); /* spin, but let the kernel's network work and the peer run */
            continue;
        }
        struct timespec ts = {0, now - last_activity > IDLE_DEEP_NS ? IDLE_DEEP_SLEEP_NS
                                                                    : IDLE_SLEEP_NS};
        nanosleep(&ts, NULL);
    }
    /* tell live peers we are leaving, so they need not wait for the liveness timeout */
    uint8_t bye[TDM_XFER_WIRE_HDR];
    tdm_xfer_wire_put_hdr(bye, TDM_XFER_MSG_BYE, x->nonce, 0);
    struct fi_cq_data_entry drain[16];
    for (uint32_t i = 0; i < x->n_peers; i++)
        if (!x->peers[i].dead && x->peers[i].known)
            for (int tries = 0; tries < 100; tries++) {
                ssize_t rc = fi_inject(x->ep, bye, sizeof(bye), x->peers[i].fi);
                if (rc != -FI_EAGAIN) break;
                fi_cq_read(x->cq, drain, TDM_ARRAY_LEN(drain));
            }
    /* a few rounds of progress push the goodbyes out; completions now are discarded */
    uint64_t until = tdm_now_ns() + 20000000ull;
    while (tdm_now_ns() < until) {
        ssize_t n = fi_cq_read(x->cq, drain, TDM_ARRAY_LEN(drain));
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof(err));
            fi_cq_readerr(x->cq, &err, 0);
        }
        if (n <= 0) {
            struct timespec ts = {0, 500000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

/* ---- setup and teardown ---- */

static tdm_status open_fabric(tdm_xfer_t *x)
{
    struct fi_info *hints = fi_allocinfo();
    if (!hints) return tdm_err_set(TDM_ENOMEM, "xfer: fi_allocinfo failed");
    hints->caps = FI_MSG | FI_RMA;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->fabric_attr->prov_name = strdup(x->provider_name);
    const char *node = x->node[0] ? x->node : NULL;
    uint64_t flags = node ? FI_SOURCE : 0;
    int rc;
    /* Writes must be visible before the immediate that follows them. A provider that orders
     * write data (FI_ORDER_WAW without a size limit, e.g. tcp;ofi_rxm over one stream) gives that
     * for free; otherwise ask for delivery-complete writes (the immediate write is then posted
     * after the others complete), falling back to the provider's default. */
    hints->tx_attr->op_flags = 0;
    rc = fi_getinfo(FI_VERSION(1, 17), node, NULL, flags, hints, &x->info);
    x->ordered_writes = rc == 0 && (x->info->tx_attr->msg_order & FI_ORDER_WAW) &&
                        x->info->ep_attr->max_order_waw_size >= (1ull << 30);
    if (rc == 0 && !x->ordered_writes) {
        fi_freeinfo(x->info);
        x->info = NULL;
        hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
        rc = fi_getinfo(FI_VERSION(1, 17), node, NULL, flags, hints, &x->info);
        if (rc) {
            hints->tx_attr->op_flags = 0;
            rc = fi_getinfo(FI_VERSION(1, 17), node, NULL, flags, hints, &x->info);
        }
    }
    fi_freeinfo(hints);
    if (rc)
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer: no provider '%s'%s%s: %s", x->provider_name,
                           node ? " on " : "", node ? node : "", fi_msg(rc));
    struct fi_info *info = x->info;
    x->caps.delivery_complete = (info->tx_attr->op_flags & FI_DELIVERY_COMPLETE) != 0;
    x->caps.ordered_writes = x->ordered_writes;
    x->caps.mr_mode = (uint64_t)info->domain_attr->mr_mode;
    x->caps.imm_bits = info->domain_attr->cq_data_size >= 8 ? 64 : 32;
    x->caps.hmem_cuda = (info->caps & FI_HMEM) != 0;
    x->caps.max_write_bytes = info->ep_attr->max_msg_size;
    if (x->caps.max_write_bytes == 0 || x->caps.max_write_bytes > (1ull << 30))
        x->caps.max_write_bytes = 1ull << 30;
    if (info->domain_attr->cq_data_size < 4) {
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer: provider %s carries %zu bytes of cq data",
                           info->fabric_attr->prov_name, info->domain_attr->cq_data_size);
    }
    snprintf(x->caps.provider, sizeof(x->caps.provider), "%s", info->fabric_attr->prov_name);
    x->caps.max_slot = x->caps.imm_bits == 64 ? (1u << 24) - 1 : (1u << 12) - 1;
    x->caps.max_epoch = x->caps.imm_bits == 64 ? (1u << 16) - 1 : (1u << 8) - 1;
    x->caps.max_index = x->caps.max_slot;

    if ((rc = fi_fabric(info->fabric_attr, &x->fabric, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_fabric: %s", fi_msg(rc));
    if ((rc = fi_domain(x->fabric, info, &x->domain, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_domain: %s", fi_msg(rc));
    struct fi_av_attr av_attr = {.type = FI_AV_UNSPEC, .count = (size_t)x->cfg.max_peers};
    if ((rc = fi_av_open(x->domain, &av_attr, &x->av, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_av_open: %s", fi_msg(rc));
    struct fi_cq_attr cq_attr = {
        .format = FI_CQ_FORMAT_DATA, .size = (size_t)(x->n_ops + 64), .wait_obj = FI_WAIT_NONE};
    if ((rc = fi_cq_open(x->domain, &cq_attr, &x->cq, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_cq_open: %s", fi_msg(rc));
    if ((rc = fi_endpoint(x->domain, info, &x->ep, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_endpoint: %s", fi_msg(rc));
    if ((rc = fi_ep_bind(x->ep, &x->av->fid, 0)) ||
        (rc = fi_ep_bind(x->ep, &x->cq->fid, FI_TRANSMIT | FI_RECV)))
        return tdm_err_set(TDM_EIO, "xfer: fi_ep_bind: %s", fi_msg(rc));
    if ((rc = fi_enable(x->ep))) return tdm_err_set(TDM_EIO, "xfer: fi_enable: %s", fi_msg(rc));
    size_t len = sizeof(x->my_addr);
    if ((rc = fi_getname(&x->ep->fid, x->my_addr, &len)))
        return tdm_err_set(TDM_EIO, "xfer: fi_getname: %s", fi_msg(rc));
    x->my_addr_bytes = len;
    return TDM_OK;
}

static tdm_status reg_raw(tdm_xfer_t *x, void *base, size_t bytes, struct fid_mr **mr,
                          uint64_t *key, void **desc)
{
    uint64_t access = FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    pthread_mutex_lock(&x->mu);
    uint64_t requested = x->next_key++;
    pthread_mutex_unlock(&x->mu);
    int rc = fi_mr_reg(x->domain, base, bytes, access, 0, requested, 0, mr, NULL);
    if (rc) return tdm_err_set(TDM_EIO, "xfer: fi_mr_reg of %zu bytes: %s", bytes, fi_msg(rc));
    if (x->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(*mr, &x->ep->fid, 0)) || (rc = fi_mr_enable(*mr))) {
            fi_close(&(*mr)->fid);
            return tdm_err_set(TDM_EIO, "xfer: binding a region to the endpoint: %s", fi_msg(rc));
        }
    }
    *key = fi_mr_key(*mr);
    *desc = fi_mr_desc(*mr);
    return TDM_OK;
}

tdm_status tdm_xfer_create(const struct tdm_xfer_config *cfg_in, tdm_xfer_t **out)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    if (cfg_in) cfg = *cfg_in;
    if (!cfg.provider || strlen(cfg.provider) >= 64 || (cfg.node && strlen(cfg.node) >= 64))
        return tdm_err_set(TDM_EINVAL, "xfer: bad provider or node");
    if (cfg.op_timeout_ms <= 0 || cfg.heartbeat_ms < 0 || cfg.peer_timeout_ms < 0 ||
        cfg.max_jobs <= 0 || cfg.max_jobs > (1 << 20) || cfg.max_ops <= OPS_RESERVED ||
        cfg.max_ops > (1 << 16) || cfg.ctrl_bytes <= 0 || cfg.ctrl_bytes > (1 << 20) ||
        cfg.ctrl_rx_depth <= 0 || cfg.ctrl_rx_depth > 4096 || cfg.max_peers <= 0 ||
        cfg.max_peers > 4096 || cfg.max_slots <= 0 || cfg.max_pages_per_write <= 0)
        return tdm_err_set(TDM_EINVAL, "xfer: configuration value out of range");
    if (cfg.heartbeat_ms && cfg.peer_timeout_ms && cfg.peer_timeout_ms <= 2 * cfg.heartbeat_ms)
        return tdm_err_set(TDM_EINVAL, "xfer: peer_timeout_ms must exceed 2 x heartbeat_ms");
    const char *fspec = cfg.faults ? cfg.faults : getenv("TANDEM_XFER_FAULTS");
    struct tdm_xfer_faults faults;
    tdm_status st = tdm_xfer_faults_parse(fspec, &faults);
    if (st != TDM_OK) return st;

    tdm_xfer_t *x = calloc(1, sizeof(*x));
    if (!x) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
    x->cfg = cfg;
    x->faults = faults;
    snprintf(x->provider_name, sizeof(x->provider_name), "%s", cfg.provider);
    snprintf(x->node, sizeof(x->node), "%s", cfg.node ? cfg.node : "");
    x->cfg.provider = x->provider_name;
    x->cfg.node = x->node[0] ? x->node : NULL;
    x->cfg.faults = NULL;
    pthread_mutex_init(&x->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&x->cv, &ca);
    pthread_condattr_destroy(&ca);
    x->submit_head = x->submit_tail = x->active_head = x->active_tail = -1;
    x->next_key = 1;
    uint32_t seed[4] = {(uint32_t)getpid(), (uint32_t)tdm_now_ns(), (uint32_t)(uintptr_t)x, 7};
    uint32_t key[2] = {(uint32_t)(tdm_now_ns() >> 32), 0x9e3779b9u}, r[4];
    tdm_philox4x32(seed, key, r);
    x->nonce = ((uint64_t)r[0] << 32 | r[1]) | 1;

    int n_rx = cfg.ctrl_rx_depth;
    x->n_ops = cfg.max_ops + n_rx;
    x->ops = calloc((size_t)x->n_ops, sizeof(*x->ops));
    x->op_free = calloc((size_t)cfg.max_ops, sizeof(int));
    x->repost = calloc((size_t)n_rx, sizeof(int));
    x->jobs = calloc((size_t)cfg.max_jobs, sizeof(*x->jobs));
    x->peers = calloc((size_t)cfg.max_peers, sizeof(*x->peers));
    x->buf_bytes = ((size_t)TDM_XFER_WIRE_HDR + (size_t)cfg.ctrl_bytes + 63) & ~(size_t)63;
    x->bufs = tdm_alloc_aligned(x->buf_bytes * (size_t)(N_TX_BUFS + n_rx));
    if (faults.delay_imm_ms > 0) x->delay_ring = calloc(DELAY_RING, sizeof(*x->delay_ring));
    if (!x->ops || !x->op_free || !x->repost || !x->jobs || !x->peers || !x->bufs ||
        (faults.delay_imm_ms > 0 && !x->delay_ring)) {
        st = tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
        goto out_destroy;
    }
    for (int i = 0; i < cfg.max_ops; i++)
        x->op_free[x->n_op_free++] = cfg.max_ops - 1 - i;
    for (int i = 0; i < cfg.max_jobs; i++)
        x->jobs[i].next = i + 1 < cfg.max_jobs ? i + 1 : -1;
    x->job_free = 0;
    for (int i = 0; i < N_TX_BUFS; i++)
        x->tx_free[x->n_tx_free++] = i;

    if ((st = open_fabric(x)) != TDM_OK) goto out_destroy;
    uint32_t slots = TDM_MIN((uint32_t)cfg.max_slots, x->caps.max_slot + 1);
    if ((st = tdm_xfer_counters_create(slots, x->caps.max_index + 1, &x->counters)) != TDM_OK)
        goto out_destroy;
    uint64_t key_unused;
    if ((st = reg_raw(x, x->bufs, x->buf_bytes * (size_t)(N_TX_BUFS + n_rx), &x->bufs_mr,
                      &key_unused, &x->bufs_desc)) != TDM_OK)
        goto out_destroy;
    for (int i = 0; i < n_rx; i++) {
        int o = cfg.max_ops + i;
        x->ops[o] =
            (struct op){.kind = OP_RECV, .job = -1, .peer = UINT32_MAX, .buf = N_TX_BUFS + i};
        if ((st = post_recv(x, o)) != TDM_OK) goto out_destroy;
    }
    if (pthread_create(&x->thread, NULL, progress_main, x) != 0) {
        st = tdm_err_set(TDM_EINTERNAL, "xfer: cannot start the progress thread");
        goto out_destroy;
    }
    x->thread_started = true;
    TDM_DEBUG("xfer: %s endpoint up (%d-bit immediates, mr_mode 0x%llx, delivery complete %d)",
              x->caps.provider, x->caps.imm_bits, (unsigned long long)x->caps.mr_mode,
              x->caps.delivery_complete);
    *out = x;
    return TDM_OK;

out_destroy : {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", tdm_err_msg());
    tdm_xfer_destroy(x);
    return tdm_err_set(st, "%s", msg);
}
}

void tdm_xfer_destroy(tdm_xfer_t *x)
{
    if (!x) return;
    if (x->thread_started) {
        x->stop = 1;
        pthread_join(x->thread, NULL);
    }
    /* everything not finished ends as cancelled, on this thread */
    take_submissions(x);
    for (int j = x->active_head; j >= 0; j = x->jobs[j].next)
        if (x->jobs[j].state == JOB_ACTIVE) {
            tdm_err_set(TDM_ECANCELED, "xfer: engine destroyed");
            job_finish(x, j, TDM_ECANCELED);
        }
    if (x->ep) fi_close(&x->ep->fid);
    if (x->bufs_mr) fi_close(&x->bufs_mr->fid);
    if (x->av) fi_close(&x->av->fid);
    if (x->cq) fi_close(&x->cq->fid);
    if (x->domain) fi_close(&x->domain->fid);
    if (x->fabric) fi_close(&x->fabric->fid);
    if (x->info) fi_freeinfo(x->info);
    tdm_xfer_counters_destroy(x->counters);
    if (x->jobs)
        for (int j = 0; j < x->cfg.max_jobs; j++) {
            free(x->jobs[j].runs);
            free(x->jobs[j].msg);
        }
    free(x->delay_ring);
    tdm_free_aligned(x->bufs);
    free(x->peers);
    free(x->jobs);
    free(x->repost);
    free(x->op_free);
    free(x->ops);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    free(x);
}

tdm_status tdm_xfer_addr(const tdm_xfer_t *x, char *buf, size_t cap)
{
    return tdm_xfer_addr_encode(x->my_addr, x->my_addr_bytes, buf, cap);
}

void tdm_xfer_get_caps(const tdm_xfer_t *x, struct tdm_xfer_caps *out)
{
    *out = x->caps;
}

void tdm_xfer_get_stats(tdm_xfer_t *x, struct tdm_xfer_stats *out)
{
    const uint64_t *src = (const uint64_t *)&x->stats;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof(*out) / sizeof(uint64_t); i++)
        dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

tdm_xfer_counters_t *tdm_xfer_get_counters(tdm_xfer_t *x)
{
    return x->counters;
}

tdm_status tdm_xfer_peer_add(tdm_xfer_t *x, const char *addr, uint32_t *peer)
{
    uint8_t raw[ADDR_RAW_MAX];
    size_t n;
    tdm_status st = tdm_xfer_addr_decode(addr, raw, sizeof(raw), &n);
    if (st != TDM_OK) return st;
    bool inserted, hello;
    uint32_t p;
    pthread_mutex_lock(&x->mu);
    st = peer_find_or_insert_locked(x, raw, n, &p, &inserted);
    if (st == TDM_OK) {
        hello = !x->peers[p].hello_sent;
        x->peers[p].hello_sent = true;
        x->peers[p].last_seen_ns = tdm_now_ns();
    }
    pthread_mutex_unlock(&x->mu);
    if (st != TDM_OK) return st;
    if (hello) send_hello(x, p);
    *peer = p;
    return TDM_OK;
}

bool tdm_xfer_peer_alive(tdm_xfer_t *x, uint32_t peer)
{
    pthread_mutex_lock(&x->mu);
    bool alive = peer < x->n_peers && !x->peers[peer].dead;
    pthread_mutex_unlock(&x->mu);
    return alive;
}

tdm_status tdm_xfer_peer_wait(tdm_xfer_t *x, uint32_t peer, int timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    tdm_status st = TDM_OK;
    pthread_mutex_lock(&x->mu);
    for (;;) {
        if (peer >= x->n_peers) {
            st = tdm_err_set(TDM_ENOTFOUND, "xfer: no peer %u", peer);
            break;
        }
        if (x->peers[peer].dead) {
            st = tdm_err_set(TDM_EPEER, "xfer: peer %u is dead", peer);
            break;
        }
        if (x->peers[peer].known) break;
        if (pthread_cond_timedwait(&x->cv, &x->mu, &ts) == ETIMEDOUT) {
            st = tdm_err_set(TDM_ETIMEDOUT, "xfer: peer %u did not answer in %d ms", peer,
                             timeout_ms);
            break;
        }
    }
    pthread_mutex_unlock(&x->mu);
    return st;
}

/* ---- memory regions ---- */

tdm_status tdm_xfer_mr_reg(tdm_xfer_t *x, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                           tdm_xfer_mr_t **out)
{
    if (!x || !base || !bytes) return tdm_err_set(TDM_EINVAL, "xfer: empty region");
    if (kind != TDM_XFER_MEM_HOST) {
        if (kind != TDM_XFER_MEM_CUDA) return tdm_err_set(TDM_EINVAL, "xfer: memory kind %d", kind);
        if (!x->caps.hmem_cuda)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "xfer: provider %s cannot register cuda memory; stage through a "
                               "registered host buffer",
                               x->caps.provider);
    }
    tdm_xfer_mr_t *mr = calloc(1, sizeof(*mr));
    if (!mr) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
    tdm_status st = reg_raw(x, base, bytes, &mr->mr, &mr->key, &mr->desc);
    if (st != TDM_OK) {
        free(mr);
        return st;
    }
    mr->x = x;
    mr->base = base;
    mr->bytes = bytes;
    mr->kind = kind;
    *out = mr;
    return TDM_OK;
}

void tdm_xfer_mr_dereg(tdm_xfer_mr_t *mr)
{
    if (!mr) return;
    fi_close(&mr->mr->fid);
    free(mr);
}

void tdm_xfer_mr_remote(const tdm_xfer_mr_t *mr, struct tdm_xfer_rmem *out)
{
    memset(out, 0, sizeof(*out));
    out->addr =
        (mr->x->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)mr->base : 0;
    out->key = mr->key;
    out->bytes = mr->bytes;
    out->kind = (uint32_t)mr->kind;
}
