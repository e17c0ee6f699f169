/*
 * Peers of the libfabric transport: the address table, hello, liveness (heartbeats,
 * last_seen), and death, which fails everything queued, pending or armed for the peer. Under
 * x->mu, except what the hot paths read without it: n_peers, each peer's `dead`, `live_nonce`
 * and `last_seen_ns` (written with atomics). The progress thread declares deaths, user threads
 * add and wait for peers.
 */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <gnutls/crypto.h>

#include "xfer/fabric/fabric_int.h"

void tdm_fab_peer_publish(struct peer *p)
{
    uint64_t live = p->nonce_set && p->known && !p->dead ? p->nonce : 0;
    __atomic_store_n(&p->live_nonce, live, __ATOMIC_RELEASE);
}

void tdm_fab_peer_declare_dead(tdm_xfer_t *x, uint32_t p, const char *why, bool gone)
{
    pthread_mutex_lock(&x->mu);
    bool was = x->peers[p].dead;
    __atomic_store_n(&x->peers[p].dead, true, __ATOMIC_RELEASE);
    x->peers[p].known = false;
    tdm_fab_peer_publish(&x->peers[p]);
    if (gone) x->peers[p].gone = true;
    pthread_cond_broadcast(&x->cv);
    pthread_mutex_unlock(&x->mu);
    if (was) return;
    if (strstr(why, "goodbye"))
        TDM_DEBUG("xfer: peer %u left: %s", p, why);
    else
        TDM_WARN("xfer: peer %u is dead: %s", p, why);
    /* active jobs for it */
    pthread_mutex_lock(&x->tx_mu);
    for (int j = x->active_head; j >= 0; j = x->jobs[j].next) {
        struct job *jb = &x->jobs[j];
        if (jb->peer == p && jb->state == JOB_ACTIVE) {
            tdm_err_set(TDM_EPEER, "xfer: peer %u died: %s", p, why);
            tdm_fab_job_finish(x, j, TDM_EPEER);
        }
    }
    pthread_mutex_unlock(&x->tx_mu);
    tdm_fab_fire_queued(x);
    if (!x->counters_borrowed) tdm_xfer_counters_fail_peer(x->counters, p, TDM_EPEER);
    if (x->hook.on_peer) x->hook.on_peer(x->hook.ctx, p, false);
    if (x->cfg.on_peer) x->cfg.on_peer(x->cfg.on_peer_ctx, p, false);
}

/* Finds or inserts the peer with this raw address (mu held). */
tdm_status tdm_fab_peer_find_or_insert_locked(tdm_xfer_t *x, const uint8_t *raw, size_t n,
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
    /* a dead entry of the same address comes back in place, with a fresh handshake: a peer
     * that stalled or restarted is used again, and its index (what callers keep) is the same.
     * Everything of the dead incarnation (jobs, counters) was failed when it died, and its
     * messages (its old nonce) no longer match once the new hello binds a nonce. */
    uint32_t i = UINT32_MAX;
    fi_addr_t fa = FI_ADDR_NOTAVAIL;
    for (uint32_t k = 0; k < x->n_peers; k++) {
        struct peer *p = &x->peers[k];
        if (p->dead && p->addr_bytes == n && !memcmp(p->addr, raw, n)) {
            i = k;
            fa = p->fi;
            break;
        }
    }
    if (i == UINT32_MAX && x->n_peers >= (uint32_t)x->cfg.max_peers) {
        /* a full table: the entry of a dead peer at another address is recycled, one known
         * to be gone first, else the one silent longest (past 4 peer timeouts), so a node
         * whose peers restart at new addresses, again and again, keeps finding them */
        uint64_t now = tdm_now_ns(), quiet = 4ull * (uint64_t)x->cfg.peer_timeout_ms * 1000000ull;
        for (uint32_t k = 0; k < x->n_peers; k++) {
            const struct peer *q = &x->peers[k];
            if (!q->dead || now - q->last_seen_ns < quiet) continue;
            if (i == UINT32_MAX || (q->gone && !x->peers[i].gone) ||
                (q->gone == x->peers[i].gone && q->last_seen_ns < x->peers[i].last_seen_ns))
                i = k;
        }
        if (i == UINT32_MAX)
            return tdm_err_set(TDM_ERANGE, "xfer: more than %d peers, none of them long dead",
                               x->cfg.max_peers);
        TDM_INFO("xfer: peer table full: entry %u (dead%s) is reused for a new address", i,
                 x->peers[i].gone ? ", gone" : "");
        fi_addr_t old = x->peers[i].fi;
        (void)fi_av_remove(x->av, &old, 1, 0);
        int rc = fi_av_insert(x->av, raw, 1, &fa, 0, NULL);
        if (rc != 1) return tdm_err_set(TDM_EINVAL, "xfer: fi_av_insert failed: %s", fi_msg(rc));
        STAT_ADD(x, peers_recycled, 1);
    } else if (i == UINT32_MAX) {
        int rc = fi_av_insert(x->av, raw, 1, &fa, 0, NULL);
        if (rc != 1) return tdm_err_set(TDM_EINVAL, "xfer: fi_av_insert failed: %s", fi_msg(rc));
        i = x->n_peers;
    }
    struct peer *p = &x->peers[i];
    memset(p, 0, sizeof(*p)); /* dead no more, live_nonce 0 until its hello */
    p->used = true;
    p->fi = fa;
    memcpy(p->addr, raw, n);
    p->addr_bytes = n;
    __atomic_store_n(&p->last_seen_ns, tdm_now_ns(), __ATOMIC_RELAXED);
    if (i == x->n_peers) __atomic_store_n(&x->n_peers, i + 1, __ATOMIC_RELEASE);
    if (!tdm_xfer_random(p->my_chal, sizeof p->my_chal))
        return tdm_err_set(TDM_EIO, "xfer: no random bytes for a challenge");
    *out = i;
    *inserted = true;
    return TDM_OK;
}

/* HMAC-SHA256(key, label | challenge | from | to): `from` proves to `to` that it holds the
 * key, for the challenge `to` sent. */
void tdm_fab_proof(const tdm_xfer_t *x, const uint8_t chal[TDM_XFER_CHALLENGE], uint64_t from,
                   uint64_t to, uint8_t out[TDM_XFER_PROOF])
{
    static const char label[] = "tandem fabric auth v1";
    uint8_t msg[sizeof label + TDM_XFER_CHALLENGE + 16];
    memcpy(msg, label, sizeof label);
    memcpy(msg + sizeof label, chal, TDM_XFER_CHALLENGE);
    tdm_put_u64(msg + sizeof label + TDM_XFER_CHALLENGE, from);
    tdm_put_u64(msg + sizeof label + TDM_XFER_CHALLENGE + 8, to);
    if (gnutls_hmac_fast(GNUTLS_MAC_SHA256, x->key, x->key_bytes, msg, sizeof msg, out))
        memset(out, 0, TDM_XFER_PROOF); /* never a valid proof: the check compares HMACs */
}

void tdm_fab_send_auth(tdm_xfer_t *x, uint32_t peer)
{
    uint8_t proof[TDM_XFER_PROOF];
    pthread_mutex_lock(&x->mu);
    uint8_t chal[TDM_XFER_CHALLENGE];
    memcpy(chal, x->peers[peer].their_chal, sizeof chal);
    uint64_t to = x->peers[peer].nonce;
    pthread_mutex_unlock(&x->mu);
    tdm_fab_proof(x, chal, x->nonce, to, proof);
    if (tdm_fab_send_typed(x, peer, TDM_XFER_MSG_AUTH, proof, sizeof proof, 0, NULL, NULL) !=
        TDM_OK)
        TDM_WARN("xfer: proof to peer %u not queued: %s", peer, tdm_err_msg());
}

void tdm_fab_send_hello(tdm_xfer_t *x, uint32_t peer)
{
    uint8_t payload[4 + ADDR_RAW_MAX + TDM_XFER_CHALLENGE];
    uint8_t chal[TDM_XFER_CHALLENGE];
    pthread_mutex_lock(&x->mu);
    memcpy(chal, x->peers[peer].my_chal, sizeof chal);
    uint8_t flags = (uint8_t)((x->key_bytes ? TDM_XFER_HELLO_KEYED : 0) |
                              (x->peers[peer].known ? 0 : TDM_XFER_HELLO_ANSWER));
    pthread_mutex_unlock(&x->mu);
    size_t n = tdm_xfer_wire_hello_put(payload, sizeof(payload), x->caps.imm_bits, x->my_addr,
                                       x->my_addr_bytes, flags, chal);
    if (tdm_fab_send_typed(x, peer, TDM_XFER_MSG_HELLO, payload, n, 0, NULL, NULL) != TDM_OK)
        TDM_WARN("xfer: hello to peer %u not queued: %s", peer, tdm_err_msg());
}

/* Returns false when it could not be posted now (retried at the next timer tick). */
bool tdm_fab_send_heartbeat(tdm_xfer_t *x, uint32_t peer)
{
    if (!x->n_tx_free) return false;
    pthread_mutex_lock(&x->tx_mu);
    int o = tdm_fab_op_get(x, 0);
    if (o < 0) {
        pthread_mutex_unlock(&x->tx_mu);
        return false;
    }
    int b = x->tx_free[x->n_tx_free - 1];
    uint8_t *buf = x->bufs + (size_t)b * x->buf_bytes;
    tdm_xfer_wire_put_hdr(buf, TDM_XFER_MSG_HEARTBEAT, x->nonce, 0);
    x->ops[o] = (struct op){.kind = OP_HEARTBEAT, .job = -1, .peer = peer, .buf = b};
    int rc = (int)fi_send(x->ep, buf, TDM_XFER_WIRE_HDR, x->bufs_desc, x->peers[peer].fi,
                          &x->ops[o].fctx);
    if (rc) tdm_fab_op_put(x, o);
    pthread_mutex_unlock(&x->tx_mu);
    if (rc) return false;
    x->n_tx_free--;
    STAT_ADD(x, heartbeats_sent, 1);
    return true;
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
    st = tdm_fab_peer_find_or_insert_locked(x, raw, n, &p, &inserted);
    if (st == TDM_OK) {
        hello = !x->peers[p].hello_sent;
        x->peers[p].hello_sent = true;
        __atomic_store_n(&x->peers[p].last_seen_ns, tdm_now_ns(), __ATOMIC_RELAXED);
    }
    pthread_mutex_unlock(&x->mu);
    if (st != TDM_OK) return st;
    if (hello) tdm_fab_send_hello(x, p);
    *peer = p;
    return TDM_OK;
}

bool tdm_xfer_peer_gone(tdm_xfer_t *x, uint32_t peer)
{
    pthread_mutex_lock(&x->mu);
    bool gone = peer < x->n_peers && x->peers[peer].dead && x->peers[peer].gone;
    pthread_mutex_unlock(&x->mu);
    return gone;
}

tdm_status tdm_xfer_peer_probe(tdm_xfer_t *x, uint32_t peer, int timeout_ms)
{
    struct sockaddr_storage sa;
    socklen_t len = 0;
    pthread_mutex_lock(&x->mu);
    bool dead = peer < x->n_peers && x->peers[peer].dead;
    if (dead) {
        const struct peer *p = &x->peers[peer];
        sa_family_t fam = AF_UNSPEC;
        if (p->addr_bytes >= sizeof fam) memcpy(&fam, p->addr, sizeof fam);
        if ((fam == AF_INET && p->addr_bytes == sizeof(struct sockaddr_in)) ||
            (fam == AF_INET6 && p->addr_bytes == sizeof(struct sockaddr_in6))) {
            len = (socklen_t)p->addr_bytes;
            memcpy(&sa, p->addr, p->addr_bytes);
        }
    }
    pthread_mutex_unlock(&x->mu);
    if (!dead) return TDM_EAGAIN;
    if (!len) return tdm_err_set(TDM_EUNSUPPORTED, "xfer: peer %u has no socket address", peer);
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return TDM_EAGAIN;
    bool refused = false;
    if (connect(fd, (struct sockaddr *)&sa, len) != 0) {
        if (errno == ECONNREFUSED) {
            refused = true;
        } else if (errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            int err = 0;
            socklen_t el = sizeof err;
            if (poll(&pf, 1, timeout_ms) == 1 && !getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el))
                refused = err == ECONNREFUSED;
        }
    }
    close(fd);
    if (!refused) return TDM_EAGAIN;
    pthread_mutex_lock(&x->mu);
    if (x->peers[peer].dead) x->peers[peer].gone = true;
    pthread_mutex_unlock(&x->mu);
    TDM_INFO("xfer: peer %u's address refuses connections: its process is gone", peer);
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
    struct timespec ts = tdm_deadline_ms(CLOCK_MONOTONIC, timeout_ms);
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

tdm_status tdm_xfer_send_rails(tdm_xfer_t *x, uint32_t peer, const void *payload, size_t bytes)
{
    return tdm_fab_send_typed(x, peer, TDM_XFER_MSG_RAILS, payload, bytes, 0, NULL, NULL);
}
