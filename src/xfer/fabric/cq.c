/*
 * Completions of the libfabric transport (progress thread only): write and send completions
 * finish their jobs (under tx_mu, once per batch read from the CQ), received messages are
 * parsed (untrusted bytes) and dispatched, and arriving immediates go through the fault layer
 * (drop, duplicate, reorder, delay) to the immediate counters; those two take no engine lock
 * (a proven peer is found by its published nonce, its liveness refreshed with an atomic).
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

static void imm_deliver_now(tdm_xfer_t *x, uint64_t data, uint32_t peer)
{
    struct tdm_xfer_imm imm;
    tdm_xfer_imm_decode(x->caps.imm_bits, data, &imm);
    tdm_xfer_counters_deliver_from(x->counters, &imm, peer);
}

static void release_held(tdm_xfer_t *x, uint64_t now, bool all)
{
    int k = 0;
    for (int i = 0; i < x->n_held; i++) {
        if (all || now - x->held[i].since_ns >= REORDER_HOLD_NS)
            imm_deliver_now(x, x->held[i].data, x->held[i].peer);
        else
            x->held[k++] = x->held[i];
    }
    x->n_held = k;
}

/* Delivery after the optional delay; a delivery also releases the immediates held for reorder,
 * so they land after it. */
static void imm_deliver(tdm_xfer_t *x, uint64_t data, uint32_t peer)
{
    imm_deliver_now(x, data, peer);
    if (x->n_held) release_held(x, 0, true);
}

static void imm_schedule(tdm_xfer_t *x, uint64_t data, uint32_t peer)
{
    if (x->faults.delay_imm_ms > 0 && x->delay_count < DELAY_RING) {
        uint32_t at = (x->delay_head + x->delay_count) % DELAY_RING;
        x->delay_ring[at].release_ns = tdm_now_ns() + (uint64_t)x->faults.delay_imm_ms * 1000000ull;
        x->delay_ring[at].data = data;
        x->delay_ring[at].peer = peer;
        x->delay_count++;
        STAT_ADD(x, imm_delayed, 1);
        return;
    }
    imm_deliver(x, data, peer);
}

/* An immediate from `peer` (TDM_XFER_ANY_PEER: the provider did not say who sent it). */
static void imm_arrived(tdm_xfer_t *x, uint64_t data, uint32_t peer)
{
    STAT_ADD(x, imm_received, 1);
    switch (tdm_xfer_faults_imm(&x->faults, x->imm_seq++)) {
    case TDM_XFER_IMM_DROP:
        STAT_ADD(x, imm_dropped, 1);
        return;
    case TDM_XFER_IMM_DUP:
        STAT_ADD(x, imm_duplicated, 1);
        imm_schedule(x, data, peer);
        imm_schedule(x, data, peer);
        return;
    case TDM_XFER_IMM_REORDER:
        if (x->n_held < HELD_MAX) {
            STAT_ADD(x, imm_reordered, 1);
            x->held[x->n_held++] = (struct held_imm){data, tdm_now_ns(), peer};
            return;
        }
        /* fallthrough */
    case TDM_XFER_IMM_DELIVER:
        imm_schedule(x, data, peer);
        return;
    }
}

void tdm_fab_fault_timers(tdm_xfer_t *x, uint64_t now)
{
    while (x->delay_count && x->delay_ring[x->delay_head].release_ns <= now) {
        uint64_t d = x->delay_ring[x->delay_head].data;
        uint32_t p = x->delay_ring[x->delay_head].peer;
        x->delay_head = (x->delay_head + 1) % DELAY_RING;
        x->delay_count--;
        imm_deliver(x, d, p);
    }
    if (x->n_held) release_held(x, now, false);
}

static struct op *op_of(tdm_xfer_t *x, void *ctx)
{
    struct op *o = ctx;
    if (!ctx || o < x->ops || o >= x->ops + x->n_ops) return NULL;
    return o;
}

/* Constant-time comparison of two proofs. */
static bool proof_equal(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;
    for (int i = 0; i < TDM_XFER_PROOF; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

/* A hello: binds the sender's nonce and challenge to its entry (inserted when new). Under mu.
 * Returns the peer, or UINT32_MAX when the hello is refused. */
static uint32_t take_hello(tdm_xfer_t *x, const struct tdm_xfer_wire_hdr *h, const uint8_t *payload,
                           bool *send_back, bool *send_auth, bool *newly_known)
{
    struct tdm_xfer_hello hl;
    if (tdm_xfer_wire_hello_parse(payload, h->payload_bytes, &hl) != TDM_OK ||
        hl.addr_bytes > ADDR_RAW_MAX) {
        TDM_WARN("xfer: bad hello: %s", tdm_err_msg());
        return UINT32_MAX;
    }
    if (hl.imm_bits != x->caps.imm_bits) {
        TDM_WARN("xfer: peer uses %d-bit immediates, we use %d; ignored", hl.imm_bits,
                 x->caps.imm_bits);
        return UINT32_MAX;
    }
    if (x->key_bytes && !(hl.flags & TDM_XFER_HELLO_KEYED)) {
        STAT_ADD(x, auth_failed, 1);
        TDM_WARN("xfer: a hello from a peer without the fabric key; ignored");
        return UINT32_MAX;
    }
    if (!x->key_bytes && (hl.flags & TDM_XFER_HELLO_KEYED)) {
        TDM_WARN("xfer: a peer wants a fabric key and this node has none (--fabric-key); "
                 "ignored");
        return UINT32_MAX;
    }
    uint32_t peer = UINT32_MAX;
    bool inserted;
    if (tdm_fab_peer_find_or_insert_locked(x, hl.addr, hl.addr_bytes, &peer, &inserted) != TDM_OK) {
        TDM_WARN("xfer: hello from a peer we cannot add: %s", tdm_err_msg());
        return UINT32_MAX;
    }
    struct peer *p = &x->peers[peer];
    if (p->nonce_set && p->nonce != h->nonce) {
        /* the same address with another nonce: a restarted process, or someone claiming its
         * address. Without a key the newest wins (as before keys existed); with one, a proven
         * incarnation keeps the entry until it dies, and an unproven one is replaced */
        if (x->key_bytes && p->known) {
            TDM_DEBUG("xfer: peer %u said hello with another nonce while proven; ignored", peer);
            return UINT32_MAX;
        }
    }
    p->nonce = h->nonce;
    p->nonce_set = true;
    memcpy(p->their_chal, hl.challenge, TDM_XFER_CHALLENGE);
    /* hello back when we never did, or when it does not know us (it restarted its side of
     * the handshake: a revived entry) */
    uint64_t now = tdm_now_ns();
    *send_back = !p->hello_sent ||
                 ((hl.flags & TDM_XFER_HELLO_ANSWER) && now - p->last_hello_ns >= HELLO_GAP_NS);
    if (*send_back) p->last_hello_ns = now; /* at most one answer per gap: no ping-pong */
    p->hello_sent = true;
    if (x->key_bytes) {
        *send_auth = true; /* every hello gets our proof: the first may have been lost */
    } else if (!p->known) {
        p->known = true;
        *newly_known = true;
        pthread_cond_broadcast(&x->cv);
    }
    tdm_fab_peer_publish(p);
    return peer;
}

/* What a known peer's message says. */
static void dispatch(tdm_xfer_t *x, const struct tdm_xfer_wire_hdr *h, const uint8_t *payload,
                     uint32_t peer)
{
    STAT_ADD(x, msgs_received, 1);
    switch (h->type) {
    case TDM_XFER_MSG_USER:
        if (x->cfg.on_msg) x->cfg.on_msg(x->cfg.on_msg_ctx, peer, payload, h->payload_bytes);
        break;
    case TDM_XFER_MSG_IMM:
        /* a rail's peer indices are not its counters' (their owner's): only RMA immediates,
         * which name no sender, are taken there */
        if (!x->counters_borrowed) imm_arrived(x, tdm_get_u64(payload), peer);
        break;
    case TDM_XFER_MSG_RAILS:
        if (x->hook.on_rails) x->hook.on_rails(x->hook.ctx, peer, payload, h->payload_bytes);
        break;
    case TDM_XFER_MSG_BYE:
        tdm_fab_peer_declare_dead(x, peer, "it said goodbye", true);
        break;
    default:
        break;
    }
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
    bool newly_known = false, send_back = false, send_auth = false;
    if (h.type != TDM_XFER_MSG_HELLO && h.type != TDM_XFER_MSG_AUTH) {
        /* the hot path: a proven, live peer, found without the lock */
        uint32_t n = __atomic_load_n(&x->n_peers, __ATOMIC_ACQUIRE);
        for (uint32_t i = 0; i < n; i++)
            if (__atomic_load_n(&x->peers[i].live_nonce, __ATOMIC_ACQUIRE) == h.nonce) peer = i;
        if (peer != UINT32_MAX) {
            __atomic_store_n(&x->peers[peer].last_seen_ns, tdm_now_ns(), __ATOMIC_RELAXED);
            dispatch(x, &h, payload, peer);
            return;
        }
    }
    pthread_mutex_lock(&x->mu);
    for (uint32_t i = 0; i < x->n_peers; i++)
        if (x->peers[i].nonce_set && x->peers[i].nonce == h.nonce && !x->peers[i].dead) peer = i;
    if (h.type == TDM_XFER_MSG_HELLO) {
        peer = take_hello(x, &h, payload, &send_back, &send_auth, &newly_known);
    } else if (h.type == TDM_XFER_MSG_AUTH && peer != UINT32_MAX && x->key_bytes &&
               !x->peers[peer].known) {
        uint8_t want[TDM_XFER_PROOF];
        tdm_fab_proof(x, x->peers[peer].my_chal, h.nonce, x->nonce, want);
        if (proof_equal(want, payload)) {
            x->peers[peer].known = true;
            tdm_fab_peer_publish(&x->peers[peer]);
            newly_known = true;
            STAT_ADD(x, auth_ok, 1);
            pthread_cond_broadcast(&x->cv);
        } else {
            STAT_ADD(x, auth_failed, 1);
            if (!x->peers[peer].auth_warned)
                TDM_WARN("xfer: peer %u's proof of the fabric key is wrong (another key?); "
                         "ignored",
                         peer);
            x->peers[peer].auth_warned = true;
        }
    }
    bool known = peer != UINT32_MAX && x->peers[peer].known;
    if (known) __atomic_store_n(&x->peers[peer].last_seen_ns, tdm_now_ns(), __ATOMIC_RELAXED);
    pthread_mutex_unlock(&x->mu);
    if (peer == UINT32_MAX) { /* unknown sender, a dead incarnation, a refused hello */
        if (h.type != TDM_XFER_MSG_HELLO) STAT_ADD(x, unauth_dropped, 1);
        return;
    }
    if (send_back) tdm_fab_send_hello(x, peer);
    if (send_auth) tdm_fab_send_auth(x, peer);
    if (!known) {
        /* not proven yet: nothing else it says is read */
        if (h.type != TDM_XFER_MSG_HELLO && h.type != TDM_XFER_MSG_AUTH)
            STAT_ADD(x, unauth_dropped, 1);
        return;
    }
    if (newly_known && x->hook.on_peer) x->hook.on_peer(x->hook.ctx, peer, true);
    if (newly_known && x->cfg.on_peer) x->cfg.on_peer(x->cfg.on_peer_ctx, peer, true);
    dispatch(x, &h, payload, peer);
}

static bool is_tx(const struct op *op)
{
    return op && (op->kind == OP_WRITE || op->kind == OP_SEND || op->kind == OP_HEARTBEAT);
}

/* The receive side of a completion: an RMA immediate, a received message. No lock. */
static void handle_rx(tdm_xfer_t *x, const struct fi_cq_data_entry *e)
{
    if ((e->flags & FI_REMOTE_CQ_DATA) && (e->flags & (FI_RMA | FI_REMOTE_WRITE))) {
        /* The writer is not named (providers' source reports for remote writes are not
         * reliable: tcp;ofi_rxm's do not match the address table); such an immediate is fenced
         * by the region's random key, which only proven peers were given (docs/SECURITY.md). */
        imm_arrived(x, e->data, TDM_XFER_ANY_PEER);
        x->traffic = true;
    }
    struct op *op = op_of(x, e->op_context);
    if (!op || op->kind != OP_RECV) return;
    if (e->len != TDM_XFER_WIRE_HDR) x->traffic = true; /* heartbeats are not traffic */
    if (e->flags & FI_RECV) handle_message(x, x->bufs + (size_t)op->buf * x->buf_bytes, e->len);
    if (!x->stop && tdm_fab_post_recv(x, (int)(op - x->ops)) != TDM_OK)
        TDM_ERROR("xfer: %s", tdm_err_msg());
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
    pthread_mutex_lock(&x->tx_mu);
    tdm_fab_op_put(x, o);
    if (j >= 0) {
        x->jobs[j].ops_in_flight--;
        tdm_err_set(TDM_EPEER, "xfer: operation to peer %u failed: %s", peer, why);
        tdm_fab_job_finish(x, j, TDM_EPEER);
    }
    pthread_mutex_unlock(&x->tx_mu);
    tdm_fab_fire_queued(x);
    tdm_fab_peer_declare_dead(x, peer, why, true);
}

/* Handles what one fi_cq_read / fi_cq_sread returned; true when anything happened. */
bool tdm_fab_handle_cq_result(tdm_xfer_t *x, const struct fi_cq_data_entry *e, ssize_t n)
{
    if (n > 0) {
        /* transmit completions first, under one lock for the batch */
        bool tx = false;
        for (ssize_t i = 0; i < n && !tx; i++)
            tx = is_tx(op_of(x, e[i].op_context));
        if (tx) {
            pthread_mutex_lock(&x->tx_mu);
            for (ssize_t i = 0; i < n; i++) {
                struct op *op = op_of(x, e[i].op_context);
                if (!is_tx(op)) continue;
                if (op->kind != OP_HEARTBEAT) x->traffic = true;
                /* not proof of life: a send completes into the kernel's buffer of a stopped
                 * peer; only what the peer sends (its heartbeats) refreshes last_seen */
                if (op->kind != OP_WRITE) x->tx_free[x->n_tx_free++] = op->buf;
                tdm_fab_tx_done(x, op);
            }
            pthread_mutex_unlock(&x->tx_mu);
        }
        for (ssize_t i = 0; i < n; i++)
            handle_rx(x, &e[i]);
        if (tx) tdm_fab_fire_queued(x);
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
