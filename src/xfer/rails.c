/*
 * Rails: several NICs per node (issue 17, item 4; include/tandem/xfer.h has the contract).
 *
 * Why this shape. A node with several NICs near its GPU moves KV pages fastest when every NIC
 * carries a share, as pplx-garden's fabric-lib shards a transfer over a GPU's NICs. The
 * transfer engine (src/xfer/fabric/) is one endpoint with its own progress thread, peers and
 * counters; rather than teach it several endpoints, a rail set is several engines, one per NIC,
 * of which rail 0 is the control engine the rest of the program already talks to (its peer
 * indices, control messages, liveness and counters are the set's). Rails 1 .. n-1 are plain
 * engines that borrow rail 0's counter table (tdm_xfer_config.counters), so an immediate
 * counts the same whichever rail carried it, and the decoder's counter for a request completes
 * with immediates from every rail. The set is a transport of the ops table: disagg moves pages
 * through it as through the single engine, and a node with one NIC never opens a set at all
 * (its behaviour and wire are those of one engine, bit for bit).
 *
 * Pairing. When a control peer becomes known, the hook (xfer_int.h) sends it a RAILS message
 * with the raw addresses of rails 1 .. n-1; its RAILS message tells us its own. Rail r of this
 * node pairs with the peer's rail r, for r below both counts (min(n, its n)). The keeper thread
 * adds the peer's rail addresses to the matching rail engines (tdm_xfer_peer_add: a hello, and
 * with a fabric key a proof of its own), and a rail is usable to a peer (link up) once that
 * handshake is done. The control progress thread never calls into the rail engines: it only
 * records what it heard and wakes the keeper.
 *
 * A link (rail r of one peer):
 *
 *              RAILS names its address          handshake done (rail r's on_peer up,
 *   UNPAIRED ------------------------> PAIRING  or the keeper sees it known)
 *      ^                                  |  ----------------------------------> UP
 *      |  control peer down, or a new     |                                      |
 *      |  address in a later RAILS        |  <---- backoff passed: peer_add -----+-- rail r's
 *      +----------------------------------+        again (DOWN = PAIRING with      on_peer down
 *                                                  a later next_try)              (fails P's
 *                                                                                  counters)
 *   transition          function            thread
 *   -> PAIRING          on_rails            control progress (records; keeper adds)
 *   PAIRING -> UP       on_rail_peer, keep  rail r's progress, keeper
 *   UP -> PAIRING       on_rail_peer (down) rail r's progress; a write refused with
 *                       write_on_rail       TDM_EPEER (the submitting thread)
 *   -> UNPAIRED         on_control_peer     control progress
 *
 * Writes. A paged or single write to peer P goes to the next rail, round robin per peer, among
 * rail 0 and P's links that are up and for which the destination's descriptor carries a key
 * (struct tdm_xfer_rmem.rails: a decoder with fewer rails, or a region registered on one
 * engine, gets rail 0 only). A write is wholly on one rail, so the one-rail ordering rule holds
 * for each ("an immediate never overtakes its data"); writes of one request on several rails
 * need no order among them (a counter counts distinct indices). A rail that answers TDM_EPEER
 * (its peer just died) is marked down and the write goes to rail 0.
 *
 * Failure. A link that dies while up (silence or a completion error on rail r) may have lost
 * writes that rail 0's peer still expects: every counter bound to P is failed with TDM_EPEER
 * at once (the decoder fences the request and cancels it over rail 0, like a dead peer's), and
 * the rail is left out until it comes back. The writer's side sees its writes on the rail fail
 * (TDM_EPEER) and fails its job (a NACK). A write that timed out on a rail whose provider still
 * holds it may land late, exactly as on one engine (epochs fence its immediate).
 *
 * Locking. s->mu guards the peers' links and the round-robin cursors; engine calls that may
 * take an engine's locks (peer_add, write posting, counters_fail_peer, which fires callbacks)
 * are made with it released. Per-rail write counts are atomics.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "xfer/xfer_int.h"

#define RETRY_FIRST_MS  500
#define RETRY_MAX_MS    10000
#define KEEPER_TICK_MS  100
#define KEEPER_BATCH    64 /* links handled per turn; more: another turn at once */
#define NO_XID          UINT32_MAX
#define RAIL_CTRL_BYTES 2048 /* a rail's largest message: a hello (address and challenge) */

struct rail_link { /* rail r of one peer */
    char *addr;    /* printable address of the peer's rail r (malloc'd); NULL: unpaired */
    uint32_t xid;  /* rail r's index for it; NO_XID before the keeper added it */
    bool up;       /* handshake done, not dead since */
    uint64_t next_try_ns;
    int backoff_ms;
};

struct rail_peer { /* by control peer index */
    bool up;       /* known and alive on the control engine */
    bool heard;    /* its RAILS message came (this incarnation): ours went back once */
    int n;         /* rails paired: min(ours, its), 1 until its RAILS message */
    uint32_t rr;   /* round-robin cursor */
    struct rail_link link[TDM_XFER_MAX_RAILS]; /* [1 .. n-1] */
};

struct rail_ctx {
    tdm_xfer_rails_t *set;
    int rail;
};

struct tdm_xfer_rails {
    int n;
    tdm_xfer_t *x[TDM_XFER_MAX_RAILS]; /* [0]: control */
    struct rail_ctx ctx[TDM_XFER_MAX_RAILS];
    char nic[TDM_XFER_MAX_RAILS][64];
    uint8_t raw[TDM_XFER_MAX_RAILS][TDM_XFER_RAIL_ADDR_MAX]; /* each rail's fi_getname */
    size_t raw_bytes[TDM_XFER_MAX_RAILS];
    uint8_t rails_msg[1 + (TDM_XFER_MAX_RAILS - 1) * (2 + TDM_XFER_RAIL_ADDR_MAX)];
    size_t rails_msg_bytes;

    pthread_mutex_t mu;
    pthread_cond_t cv; /* wakes the keeper */
    struct rail_peer *peers;
    uint32_t max_peers;
    bool ready; /* every rail is open: RAILS messages may go out */
    bool stop;
    bool wake;
    pthread_t keeper;
    bool keeper_started;

    uint64_t writes[TDM_XFER_MAX_RAILS], bytes[TDM_XFER_MAX_RAILS]; /* atomics */
    uint64_t fallbacks[TDM_XFER_MAX_RAILS];
};

struct rail_mr {
    int n;
    tdm_xfer_mr_t *mr[TDM_XFER_MAX_RAILS];
    enum tdm_xfer_mem_kind kind;
};

/* ---- NICs ---- */

/* An address is the endpoint's node; an interface name, its first IPv4 address; anything else
 * is taken as the provider's domain name (an RDMA device). */
void tdm_xfer_nic_resolve(const char *nic, char *node, size_t node_cap, char *domain,
                          size_t domain_cap)
{
    node[0] = domain[0] = '\0';
    if (!nic || !*nic) return;
    struct in6_addr a6;
    if (inet_pton(AF_INET, nic, &a6) == 1 || inet_pton(AF_INET6, nic, &a6) == 1) {
        snprintf(node, node_cap, "%s", nic);
        return;
    }
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) == 0) {
        for (struct ifaddrs *i = ifs; i; i = i->ifa_next)
            if (i->ifa_name && !strcmp(i->ifa_name, nic) && i->ifa_addr &&
                i->ifa_addr->sa_family == AF_INET) {
                const struct sockaddr_in *sin = (const struct sockaddr_in *)i->ifa_addr;
                if (inet_ntop(AF_INET, &sin->sin_addr, node, (socklen_t)node_cap)) break;
                node[0] = '\0';
            }
        freeifaddrs(ifs);
    }
    if (!node[0]) snprintf(domain, domain_cap, "%s", nic);
}

/* ---- links ---- */

static void link_reset(struct rail_link *l)
{
    free(l->addr);
    *l = (struct rail_link){.xid = NO_XID, .backoff_ms = RETRY_FIRST_MS};
}

/* The control engine's hook: a peer known (send it our rails) or dead (its links unpaired). */
static void on_control_peer(void *ctx, uint32_t peer, bool up)
{
    tdm_xfer_rails_t *s = ctx;
    if (peer >= s->max_peers) return;
    pthread_mutex_lock(&s->mu);
    struct rail_peer *p = &s->peers[peer];
    p->up = up;
    if (!up) {
        for (int r = 1; r < TDM_XFER_MAX_RAILS; r++)
            link_reset(&p->link[r]);
        p->n = 1;
        p->heard = false;
    }
    bool send = up && s->ready && s->n > 1;
    pthread_mutex_unlock(&s->mu);
    if (send && tdm_xfer_send_rails(s->x[0], peer, s->rails_msg, s->rails_msg_bytes) != TDM_OK)
        TDM_WARN("xfer: rails: cannot tell peer %u our rails: %s", peer, tdm_err_msg());
}

/* The control engine's hook: a peer's RAILS message (untrusted bytes). */
static void on_rails(void *ctx, uint32_t peer, const uint8_t *payload, size_t bytes)
{
    tdm_xfer_rails_t *s = ctx;
    struct tdm_xfer_rails_msg m;
    if (tdm_xfer_wire_rails_parse(payload, bytes, &m) != TDM_OK) {
        TDM_WARN("xfer: rails: bad rails message from peer %u: %s", peer, tdm_err_msg());
        return;
    }
    if (peer >= s->max_peers) return;
    int n = TDM_MIN(m.n_rails, s->n);
    char *addrs[TDM_XFER_MAX_RAILS] = {0};
    for (int r = 1; r < n; r++) {
        addrs[r] = malloc(TDM_XFER_ADDR_MAX);
        if (!addrs[r] || tdm_xfer_addr_encode(m.addr[r], m.addr_bytes[r], addrs[r],
                                              TDM_XFER_ADDR_MAX) != TDM_OK) {
            for (int k = 1; k <= r; k++)
                free(addrs[k]);
            TDM_WARN("xfer: rails: peer %u's rail %d address not kept", peer, r);
            return;
        }
    }
    pthread_mutex_lock(&s->mu);
    struct rail_peer *p = &s->peers[peer];
    bool changed = p->n != n;
    for (int r = 1; r < TDM_XFER_MAX_RAILS; r++) {
        struct rail_link *l = &p->link[r];
        if (r >= n) {
            link_reset(l);
        } else if (!l->addr || strcmp(l->addr, addrs[r])) {
            link_reset(l); /* a new incarnation's rail: paired afresh */
            l->addr = addrs[r];
            addrs[r] = NULL;
            changed = true;
        }
    }
    p->n = n;
    /* ours once more at its first: the one we sent when it became known to us may have come
     * before it knew us (and was dropped unread) */
    bool reply = !p->heard && s->ready && s->n > 1;
    p->heard = true;
    s->wake = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (int r = 1; r < TDM_XFER_MAX_RAILS; r++)
        free(addrs[r]);
    if (reply && tdm_xfer_send_rails(s->x[0], peer, s->rails_msg, s->rails_msg_bytes) != TDM_OK)
        TDM_WARN("xfer: rails: cannot tell peer %u our rails: %s", peer, tdm_err_msg());
    if (changed)
        TDM_INFO("xfer: rails: peer %u has %d rail%s, %d paired with ours", peer, m.n_rails,
                 m.n_rails == 1 ? "" : "s", n);
}

/* Rail r's engine: its peer (the other side's rail r) became known or died. */
static void on_rail_peer(void *ctx, uint32_t xid, bool up)
{
    const struct rail_ctx *rc = ctx;
    tdm_xfer_rails_t *s = rc->set;
    const int r = rc->rail;
    uint32_t failed[64];
    int n_failed = 0;
    uint64_t now = tdm_now_ns();
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < s->max_peers; i++) {
        struct rail_link *l = &s->peers[i].link[r];
        if (l->xid != xid || !l->addr) continue;
        if (up && !l->up) {
            TDM_INFO("xfer: rails: rail %d (%s) to peer %u is up", r,
                     s->nic[r][0] ? s->nic[r] : "default", i);
            l->backoff_ms = RETRY_FIRST_MS;
        } else if (!up && l->up) {
            TDM_WARN("xfer: rails: rail %d (%s) to peer %u is down: the requests bound to the "
                     "peer are failed; the rail is tried again in %d ms",
                     r, s->nic[r][0] ? s->nic[r] : "default", i, l->backoff_ms);
            if (n_failed < (int)TDM_ARRAY_LEN(failed)) failed[n_failed++] = i;
        }
        if (!up) {
            l->next_try_ns = now + (uint64_t)l->backoff_ms * 1000000ull;
            l->backoff_ms = TDM_MIN(2 * l->backoff_ms, RETRY_MAX_MS);
        }
        l->up = up;
    }
    pthread_mutex_unlock(&s->mu);
    for (int k = 0; k < n_failed; k++)
        tdm_xfer_counters_fail_peer(tdm_xfer_get_counters(s->x[0]), failed[k], TDM_EPEER);
}

/* The keeper: adds paired addresses to their rails, notices finished handshakes, and retries
 * dead links after their backoff, while the control peer lives. */
static void *keeper_main(void *arg)
{
    tdm_xfer_rails_t *s = arg;
    struct work {
        uint32_t peer;
        int rail;
        uint32_t xid; /* NO_XID: add addr; else: see whether it is known */
        char addr[TDM_XFER_ADDR_MAX];
    } *todo = malloc(sizeof(*todo) * KEEPER_BATCH);
    if (!todo) {
        TDM_ERROR("xfer: rails: out of memory: rails beyond the first stay unused");
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        if (!s->wake) {
            struct timespec ts = tdm_deadline_ms(CLOCK_MONOTONIC, KEEPER_TICK_MS);
            pthread_cond_timedwait(&s->cv, &s->mu, &ts);
            if (s->stop) break;
        }
        s->wake = false;
        uint64_t now = tdm_now_ns();
        size_t n = 0;
        for (uint32_t i = 0; i < s->max_peers; i++) {
            struct rail_peer *p = &s->peers[i];
            if (!p->up) continue;
            for (int r = 1; r < p->n; r++) {
                struct rail_link *l = &p->link[r];
                if (!l->addr || l->up) continue;
                if (n == KEEPER_BATCH) {
                    s->wake = true;
                    break;
                }
                if (now >= l->next_try_ns) {
                    todo[n] = (struct work){.peer = i, .rail = r, .xid = NO_XID};
                    snprintf(todo[n++].addr, TDM_XFER_ADDR_MAX, "%s", l->addr);
                    l->next_try_ns = now + (uint64_t)l->backoff_ms * 1000000ull;
                } else if (l->xid != NO_XID) {
                    todo[n++] = (struct work){.peer = i, .rail = r, .xid = l->xid};
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
        for (size_t k = 0; k < n; k++) {
            struct work *w = &todo[k];
            uint32_t xid = w->xid;
            if (xid == NO_XID && tdm_xfer_peer_add(s->x[w->rail], w->addr, &xid) != TDM_OK) {
                TDM_WARN("xfer: rails: rail %d to peer %u: %s", w->rail, w->peer, tdm_err_msg());
                continue;
            }
            bool known = tdm_xfer_peer_wait(s->x[w->rail], xid, 0) == TDM_OK;
            pthread_mutex_lock(&s->mu);
            struct rail_link *l = &s->peers[w->peer].link[w->rail];
            if (l->addr && (w->xid == NO_XID ? !strcmp(l->addr, w->addr) : l->xid == w->xid)) {
                l->xid = xid;
                if (known && !l->up) {
                    l->up = true;
                    l->backoff_ms = RETRY_FIRST_MS;
                    TDM_INFO("xfer: rails: rail %d (%s) to peer %u is up", w->rail,
                             s->nic[w->rail][0] ? s->nic[w->rail] : "default", w->peer);
                }
            }
            pthread_mutex_unlock(&s->mu);
        }
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    free(todo);
    return NULL;
}

/* ---- the transport ---- */

static tdm_status rails_mr_reg(void *t, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                               struct tdm_xfer_region *out)
{
    tdm_xfer_rails_t *s = t;
    struct rail_mr *m = calloc(1, sizeof(*m));
    if (!m) return tdm_err_set(TDM_ENOMEM, "xfer: rails: out of memory");
    m->kind = kind;
    tdm_status st = TDM_OK;
    struct tdm_xfer_rmem first, other;
    for (int r = 0; r < s->n && st == TDM_OK; r++) {
        if ((st = tdm_xfer_mr_reg(s->x[r], base, bytes, kind, &m->mr[r])) != TDM_OK) break;
        m->n = r + 1;
        tdm_xfer_mr_remote(m->mr[r], r ? &other : &first);
        if (r && other.addr != first.addr) /* one descriptor's addr serves every rail */
            st = tdm_err_set(TDM_EUNSUPPORTED,
                             "xfer: rails: rail %d addresses a region otherwise than rail 0", r);
    }
    if (st != TDM_OK) {
        for (int r = 0; r < m->n; r++)
            tdm_xfer_mr_dereg(m->mr[r]);
        free(m);
        return st;
    }
    *out = (struct tdm_xfer_region){.base = base, .bytes = bytes, .kind = kind, .impl = m};
    return TDM_OK;
}

static void rails_mr_dereg(void *t, struct tdm_xfer_region *reg)
{
    (void)t;
    struct rail_mr *m = reg->impl;
    if (m) {
        for (int r = 0; r < m->n; r++)
            tdm_xfer_mr_dereg(m->mr[r]);
        free(m);
    }
    *reg = (struct tdm_xfer_region){0};
}

static void rails_mr_remote(void *t, const struct tdm_xfer_region *reg, struct tdm_xfer_rmem *out)
{
    (void)t;
    const struct rail_mr *m = reg->impl;
    tdm_xfer_mr_remote(m->mr[0], out);
    if (m->n < 2 || m->kind != TDM_XFER_MEM_HOST) return; /* GPU regions: rail 0 only */
    out->rails = (uint32_t)m->n;
    for (int r = 0; r < m->n; r++) {
        struct tdm_xfer_rmem one;
        tdm_xfer_mr_remote(m->mr[r], &one);
        out->rail_key[r] = one.key;
    }
}

/* The rail for the next write to `peer` into `dst`, and the peer's index on it. */
static int pick_rail(tdm_xfer_rails_t *s, uint32_t peer, const struct tdm_xfer_rmem *dst,
                     uint32_t *xid)
{
    *xid = peer;
    if (peer >= s->max_peers || dst->rails < 2) return 0;
    int rail[TDM_XFER_MAX_RAILS] = {0};
    uint32_t ids[TDM_XFER_MAX_RAILS] = {peer};
    int nc = 1;
    pthread_mutex_lock(&s->mu);
    struct rail_peer *p = &s->peers[peer];
    int lim = TDM_MIN(p->n, (int)TDM_MIN(dst->rails, (uint32_t)s->n));
    if (p->up)
        for (int r = 1; r < lim; r++)
            if (p->link[r].up && p->link[r].xid != NO_XID) {
                rail[nc] = r;
                ids[nc++] = p->link[r].xid;
            }
    int k = (int)(p->rr++ % (uint32_t)nc);
    pthread_mutex_unlock(&s->mu);
    *xid = ids[k];
    return rail[k];
}

/* Rail r's link to `peer` refused a write (its peer is dead): out of the round robin. */
static void link_refused(tdm_xfer_rails_t *s, uint32_t peer, int r, uint32_t xid)
{
    pthread_mutex_lock(&s->mu);
    struct rail_link *l = &s->peers[peer].link[r];
    if (l->xid == xid && l->up) {
        l->up = false;
        l->next_try_ns = tdm_now_ns() + (uint64_t)l->backoff_ms * 1000000ull;
    }
    pthread_mutex_unlock(&s->mu);
    __atomic_fetch_add(&s->fallbacks[r], 1, __ATOMIC_RELAXED);
}

/* One write (paged: pages set; single: pages NULL) on the next rail; rail 0 when that rail's
 * peer turns out dead. */
static tdm_status rails_post(tdm_xfer_rails_t *s, uint32_t peer, const struct tdm_xfer_region *src,
                             const struct tdm_xfer_rmem *dst, const struct tdm_xfer_pages *pages,
                             uint64_t src_offset, uint64_t dst_offset, uint64_t bytes,
                             const struct tdm_xfer_imm *imm, int timeout_ms, tdm_xfer_done_fn done,
                             void *ctx)
{
    const struct rail_mr *m = src ? src->impl : NULL;
    if (!m || !dst) return tdm_err_set(TDM_EINVAL, "xfer: rails: no source region or destination");
    uint32_t xid;
    int r = pick_rail(s, peer, dst, &xid);
    for (;;) {
        struct tdm_xfer_rmem d = *dst;
        if (r) d.key = dst->rail_key[r];
        tdm_status st = pages ? tdm_xfer_write_pages(s->x[r], xid, m->mr[r], &d, pages, imm,
                                                     timeout_ms, done, ctx)
                              : tdm_xfer_write(s->x[r], xid, m->mr[r], src_offset, &d, dst_offset,
                                               bytes, imm, timeout_ms, done, ctx);
        if (st == TDM_EPEER && r) {
            link_refused(s, peer, r, xid);
            r = 0;
            xid = peer;
            continue;
        }
        if (st == TDM_OK) {
            uint64_t b = pages ? (uint64_t)pages->n_pages * pages->page_bytes : bytes;
            __atomic_fetch_add(&s->writes[r], 1, __ATOMIC_RELAXED);
            __atomic_fetch_add(&s->bytes[r], b, __ATOMIC_RELAXED);
        }
        return st;
    }
}

static tdm_status rails_write_pages(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                                    const struct tdm_xfer_rmem *dst,
                                    const struct tdm_xfer_pages *pages,
                                    const struct tdm_xfer_imm *imm, int timeout_ms,
                                    tdm_xfer_done_fn done, void *ctx)
{
    if (!pages) return tdm_err_set(TDM_EINVAL, "xfer: rails: no pages");
    return rails_post(t, peer, src, dst, pages, 0, 0, 0, imm, timeout_ms, done, ctx);
}

static tdm_status rails_write(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                              uint64_t src_offset, const struct tdm_xfer_rmem *dst,
                              uint64_t dst_offset, uint64_t bytes, const struct tdm_xfer_imm *imm,
                              int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    return rails_post(t, peer, src, dst, NULL, src_offset, dst_offset, bytes, imm, timeout_ms, done,
                      ctx);
}

static tdm_status rails_send(void *t, uint32_t peer, const void *msg, size_t bytes, int timeout_ms,
                             tdm_xfer_done_fn done, void *ctx)
{
    tdm_xfer_rails_t *s = t;
    return tdm_xfer_send(s->x[0], peer, msg, bytes, timeout_ms, done, ctx);
}

static tdm_status rails_send_imm(void *t, uint32_t peer, const struct tdm_xfer_imm *imm,
                                 int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    tdm_xfer_rails_t *s = t;
    return tdm_xfer_send_imm(s->x[0], peer, imm, timeout_ms, done, ctx);
}

static int rails_poll(void *t)
{
    (void)t;
    return 0;
}

static void rails_get_caps(void *t, struct tdm_xfer_caps *out)
{
    tdm_xfer_rails_t *s = t;
    tdm_xfer_get_caps(s->x[0], out);
}

static const struct tdm_xfer_transport_i RAILS_TRANSPORT = {
    .name = "libfabric rails",
    .mr_reg = rails_mr_reg,
    .mr_dereg = rails_mr_dereg,
    .mr_remote = rails_mr_remote,
    .write_pages = rails_write_pages,
    .write = rails_write,
    .send = rails_send,
    .send_imm = rails_send_imm,
    .poll = rails_poll,
    .get_caps = rails_get_caps,
};

struct tdm_xfer_transport tdm_xfer_rails_transport(tdm_xfer_rails_t *r)
{
    return (struct tdm_xfer_transport){.iface = &RAILS_TRANSPORT, .t = r};
}

/* ---- the set ---- */

tdm_status tdm_xfer_rails_create(const struct tdm_xfer_rails_config *cfg, tdm_xfer_rails_t **out)
{
    if (!cfg || cfg->n_rails < 1 || cfg->n_rails > TDM_XFER_MAX_RAILS)
        return tdm_err_set(TDM_EINVAL, "xfer: rails: %d rails (1 to %d)", cfg ? cfg->n_rails : 0,
                           TDM_XFER_MAX_RAILS);
    if (cfg->base.max_peers <= 0 || cfg->base.max_peers > 4096)
        return tdm_err_set(TDM_EINVAL, "xfer: rails: max_peers %d", cfg->base.max_peers);
    tdm_xfer_rails_t *s = calloc(1, sizeof(*s));
    if (!s) return tdm_err_set(TDM_ENOMEM, "xfer: rails: out of memory");
    s->n = cfg->n_rails;
    s->max_peers = (uint32_t)cfg->base.max_peers;
    s->peers = calloc(s->max_peers, sizeof(*s->peers));
    if (!s->peers) {
        free(s);
        return tdm_err_set(TDM_ENOMEM, "xfer: rails: out of memory");
    }
    for (uint32_t i = 0; i < s->max_peers; i++) {
        s->peers[i].n = 1;
        for (int r = 0; r < TDM_XFER_MAX_RAILS; r++)
            s->peers[i].link[r] = (struct rail_link){.xid = NO_XID, .backoff_ms = RETRY_FIRST_MS};
    }
    pthread_mutex_init(&s->mu, NULL);
    tdm_cond_init_monotonic(&s->cv);

    tdm_status st = TDM_OK;
    struct tdm_xfer_caps caps0;
    for (int r = 0; r < s->n && st == TDM_OK; r++) {
        struct tdm_xfer_config c = cfg->base;
        char node[64], domain[64];
        snprintf(s->nic[r], sizeof s->nic[r], "%s", cfg->nics[r] ? cfg->nics[r] : "");
        tdm_xfer_nic_resolve(s->nic[r], node, sizeof node, domain, sizeof domain);
        if (node[0] || domain[0]) {
            c.node = node[0] ? node : NULL;
            c.domain = domain[0] ? domain : NULL;
        }
        if (r == 0) {
            struct tdm_xfer_rail_hook h = {
                .on_peer = on_control_peer, .on_rails = on_rails, .ctx = s};
            st = tdm_xfer_create_hooked(&c, &h, &s->x[0]);
            if (st == TDM_OK) tdm_xfer_get_caps(s->x[0], &caps0);
        } else {
            s->ctx[r] = (struct rail_ctx){.set = s, .rail = r};
            c.on_msg = NULL;
            c.on_peer = on_rail_peer;
            c.on_peer_ctx = &s->ctx[r];
            c.counters = tdm_xfer_get_counters(s->x[0]);
            /* a rail carries writes, and of messages only its own handshake and heartbeats */
            c.ctrl_bytes = TDM_MIN(c.ctrl_bytes, RAIL_CTRL_BYTES);
            st = tdm_xfer_create(&c, &s->x[r]);
            struct tdm_xfer_caps cr;
            if (st == TDM_OK) tdm_xfer_get_caps(s->x[r], &cr);
            if (st == TDM_OK &&
                (cr.imm_bits != caps0.imm_bits || strcmp(cr.provider, caps0.provider)))
                st = tdm_err_set(TDM_EINVAL,
                                 "xfer: rails: rail %d is %s with %d-bit immediates, rail 0 %s "
                                 "with %d",
                                 r, cr.provider, cr.imm_bits, caps0.provider, caps0.imm_bits);
        }
        if (st != TDM_OK) {
            tdm_err_set(st, "xfer: rails: rail %d (%s): %s", r,
                        s->nic[r][0] ? s->nic[r] : "default", tdm_err_msg());
            break;
        }
        s->raw_bytes[r] = tdm_xfer_addr_raw(s->x[r], s->raw[r], sizeof s->raw[r]);
        if (!s->raw_bytes[r])
            st = tdm_err_set(TDM_ERANGE, "xfer: rails: rail %d's address is too long", r);
    }
    if (st == TDM_OK && s->n > 1) {
        const uint8_t *addr[TDM_XFER_MAX_RAILS];
        for (int r = 0; r < s->n; r++)
            addr[r] = s->raw[r];
        s->rails_msg_bytes =
            tdm_xfer_wire_rails_put(s->rails_msg, sizeof s->rails_msg, s->n, addr, s->raw_bytes);
        if (!s->rails_msg_bytes) st = tdm_err_set(TDM_EINTERNAL, "xfer: rails: message");
        if (st == TDM_OK && pthread_create(&s->keeper, NULL, keeper_main, s) != 0)
            st = tdm_err_set(TDM_EINTERNAL, "xfer: rails: cannot start the keeper thread");
        s->keeper_started = st == TDM_OK;
    }
    if (st != TDM_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", tdm_err_msg());
        tdm_xfer_rails_destroy(s);
        return tdm_err_set(st, "%s", msg);
    }
    /* peers that became known while the rails opened get our rails now (a hook that saw
     * `ready` sends them itself; a peer told twice is harmless) */
    uint32_t *up = malloc(sizeof(uint32_t) * s->max_peers);
    uint32_t n_up = 0;
    pthread_mutex_lock(&s->mu);
    s->ready = true;
    for (uint32_t i = 0; up && i < s->max_peers; i++)
        if (s->peers[i].up) up[n_up++] = i;
    pthread_mutex_unlock(&s->mu);
    for (uint32_t k = 0; s->n > 1 && k < n_up; k++)
        (void)tdm_xfer_send_rails(s->x[0], up[k], s->rails_msg, s->rails_msg_bytes);
    free(up);
    for (int r = 0; r < s->n; r++) {
        char a[TDM_XFER_ADDR_MAX] = "";
        tdm_xfer_addr(s->x[r], a, sizeof a);
        TDM_DEBUG("xfer: rails: rail %d on %s: %s", r, s->nic[r][0] ? s->nic[r] : "default", a);
    }
    *out = s;
    return TDM_OK;
}

void tdm_xfer_rails_destroy(tdm_xfer_rails_t *s)
{
    if (!s) return;
    if (s->keeper_started) {
        pthread_mutex_lock(&s->mu);
        s->stop = true;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->keeper, NULL);
    }
    for (int r = s->n - 1; r >= 0; r--) /* the rails borrow rail 0's counters: it goes last */
        tdm_xfer_destroy(s->x[r]);
    for (uint32_t i = 0; i < s->max_peers; i++)
        for (int r = 0; r < TDM_XFER_MAX_RAILS; r++)
            free(s->peers[i].link[r].addr);
    free(s->peers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

tdm_xfer_t *tdm_xfer_rails_control(tdm_xfer_rails_t *r)
{
    return r->x[0];
}

int tdm_xfer_rails_count(const tdm_xfer_rails_t *r)
{
    return r->n;
}

void tdm_xfer_rails_get_stats(tdm_xfer_rails_t *s, int rail, struct tdm_xfer_rail_stats *out)
{
    memset(out, 0, sizeof(*out));
    if (rail < 0 || rail >= s->n) return;
    snprintf(out->nic, sizeof out->nic, "%s", s->nic[rail]);
    tdm_xfer_addr(s->x[rail], out->addr, sizeof out->addr);
    out->writes = __atomic_load_n(&s->writes[rail], __ATOMIC_RELAXED);
    out->bytes = __atomic_load_n(&s->bytes[rail], __ATOMIC_RELAXED);
    out->fallbacks = __atomic_load_n(&s->fallbacks[rail], __ATOMIC_RELAXED);
    struct tdm_xfer_stats xs;
    tdm_xfer_get_stats(s->x[rail], &xs);
    out->imm_received = xs.imm_received;
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < s->max_peers; i++)
        out->peers_up += rail ? s->peers[i].up && s->peers[i].link[rail].up : s->peers[i].up;
    pthread_mutex_unlock(&s->mu);
}

int tdm_xfer_rails_peer_rails(tdm_xfer_rails_t *s, uint32_t peer)
{
    if (peer >= s->max_peers) return 0;
    pthread_mutex_lock(&s->mu);
    const struct rail_peer *p = &s->peers[peer];
    int n = 1;
    for (int r = 1; r < p->n; r++)
        n += p->up && p->link[r].up;
    pthread_mutex_unlock(&s->mu);
    return n;
}
