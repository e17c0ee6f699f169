/*
 * Completions of the libfabric transport (progress thread only): write and send completions
 * finish their jobs, received messages are parsed (untrusted bytes) and dispatched, and
 * arriving immediates go through the fault layer (drop, duplicate, reorder, delay) to the
 * immediate counters.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

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

void tdm_fab_fault_timers(tdm_xfer_t *x, uint64_t now)
{
    while (x->delay_count && x->delay_ring[x->delay_head].release_ns <= now) {
        uint64_t d = x->delay_ring[x->delay_head].data;
        x->delay_head = (x->delay_head + 1) % DELAY_RING;
        x->delay_count--;
        imm_deliver(x, d);
    }
    if (x->n_held) release_held(x, now, false);
}

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
        } else if (tdm_fab_peer_find_or_insert_locked(x, addr, addr_bytes, &peer, &inserted) !=
                   TDM_OK) {
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
    if (send_back) tdm_fab_send_hello(x, peer);
    if (newly_known && x->cfg.on_peer) x->cfg.on_peer(x->cfg.on_peer_ctx, peer, true);
    switch (h.type) {
    case TDM_XFER_MSG_USER:
        if (x->cfg.on_msg) x->cfg.on_msg(x->cfg.on_msg_ctx, peer, payload, h.payload_bytes);
        break;
    case TDM_XFER_MSG_IMM:
        imm_arrived(x, tdm_get_u64(payload));
        break;
    case TDM_XFER_MSG_BYE:
        tdm_fab_peer_declare_dead(x, peer, "it said goodbye");
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
        if (!x->stop && tdm_fab_post_recv(x, o) != TDM_OK) TDM_ERROR("xfer: %s", tdm_err_msg());
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
            tdm_fab_job_finish(x, op->job, TDM_OK);
        tdm_fab_op_put(x, o);
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
        if (!x->stop && tdm_fab_post_recv(x, o) != TDM_OK) TDM_ERROR("xfer: %s", tdm_err_msg());
        return;
    }
    char why[384];
    snprintf(why, sizeof(why), "%s: %s", fi_msg(err.err), pmsg ? pmsg : "");
    uint32_t peer = op->peer;
    int j = op->job;
    if (op->kind == OP_SEND || op->kind == OP_HEARTBEAT) x->tx_free[x->n_tx_free++] = op->buf;
    tdm_fab_op_put(x, o);
    if (j >= 0) {
        x->jobs[j].ops_in_flight--;
        tdm_err_set(TDM_EPEER, "xfer: operation to peer %u failed: %s", peer, why);
        tdm_fab_job_finish(x, j, TDM_EPEER);
    }
    tdm_fab_peer_declare_dead(x, peer, why);
}

/* Handles what one fi_cq_read / fi_cq_sread returned; true when anything happened. */
bool tdm_fab_handle_cq_result(tdm_xfer_t *x, const struct fi_cq_data_entry *e, ssize_t n)
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
