/*
 * The decode side of the KV messenger (include/tandem/disagg.h has the protocol and the state
 * diagram).
 *
 * Slots. Each remote prefill in progress owns a slot: a counter slot in the transfer engine and a
 * context buffer of (d_model + the head's feature width + vocab) floats (tdm_disagg_ctx_layout). A
 * slot is FREE, PENDING (request sent, counter armed) or FENCED (the attempt was abandoned; its
 * pages are held until the prefiller acknowledges the cancel or dies). Its epoch changes on every
 * use (a random value, never the last one).
 *
 * The head. A decoder that drafts with an mtp head (opts.head) asks each prefill for the head's
 * KV too (one more layer per chunk, into the head's layer group of the pool) and the feature of
 * the last prefilled position in the context. When the counter fires, the feature goes to the
 * scheduler with the request (tdm_req_remote_done_feed, copied out of the slot's context before
 * the slot is free again), and the drafter starts from it at the first step. A peer that
 * answers a head request with a NACK of TDM_EUNSUPPORTED (no head, or another: its message
 * says which) is marked head_refused: that attempt does not count against the request, which
 * goes back to the same peer without the head (it then decodes without drafts), and so do
 * later requests, until the peer has been down and up again (it may have restarted with the
 * right head). Prefilling here instead would give up disaggregation for a drafting feature.
 *
 * Locking. d->mu guards the slots and peers. Transfer-engine calls that may call back
 * synchronously (counter cancel) are made with d->mu released. tdm_req_remote_done is called
 * with d->mu held, which is what keeps the request alive: the connector's `finished` detaches a
 * request from its slot under d->mu before the request can be freed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "disagg/disagg_int.h"

/* A slot's life (d->mu held for every transition; a new random epoch at each admit):
 *
 *          admit                 on_counter (all writes landed; into the pool itself)
 *   FREE ----------> PENDING -------------------------------------> FREE
 *     ^   ^             |  \  on_counter (all landed, into landing pages)      ^
 *     |   |             |   +-----------------------------------> LANDING ----+
 *     |   |             |      (copies into the pool; the pool pages held)  last copy ended
 *     |   |             |  on_counter (timeout, dead peer, NACK, send error, the request
 *     |   |             v  finished: finished() cancels the counter)
 *     |   +--------- FENCED  (pages held IN_FLIGHT, and landing pages kept; a CANCEL goes out)
 *      unfence_locked: CANCEL_ACK or NACK (on_msg), the peer's connection failed (on_peer),
 *      its process found gone (the reviver's probe), destroy. Silence alone never unfences: a
 *      stopped prefill node's queued writes land when it resumes.
 *
 *   transition         function                         thread
 *   FREE -> PENDING    admit                            scheduler
 *   PENDING -> FREE    on_counter, TDM_OK               xfer progress
 *   PENDING -> LANDING on_counter, TDM_OK, staged       xfer progress
 *   LANDING -> FREE    on_landed (the last copy)        the copier's (or xfer progress when
 *                                                       no copy could start)
 *   PENDING -> FENCED  on_counter, an error             xfer progress, or the scheduler
 *                                                       (finished -> counter cancel)
 *   FENCED -> FREE     unfence_locked                   xfer progress (on_msg, on_peer), the
 *                                                       reviver, or the destroying thread
 * A request the connector hears has finished while PENDING or LANDING is detached from its
 * slot first (slot.req = NULL), so on_counter and on_landed never touch it again. Its pages are
 * held before the scheduler drops its references (tdm_sched_finish calls finished() first): by
 * finished() itself for a PENDING slot (slot.held; the counter may already have fired, its
 * callback waiting for d->mu), by the landing copies for a LANDING one. on_counter then frees
 * them (all landed), or keeps that hold as the fence.
 *
 * Host staging (landing pages). A peer marked staged gets, in place of the pool's region and
 * page ids, the landing region and as many landing pages as the request has pool pages (taken
 * at admit, all or nothing: too few and the request is prefilled here, counted as
 * landing_full). When every immediate has landed the copier scatters them into the pool, one
 * page list per layer group; the landing pages go back when the copies end, or when a fenced
 * attempt is unfenced (a stopped prefiller may still write into them). A peer becomes staged
 * when it answers a request for the pool itself with TDM_EUNREACHABLE (it cannot open our GPU
 * memory: another host), without counting that attempt; every peer is staged from the start
 * with --kv-staging always, or when the pool cannot be offered at all. */
enum slot_state { SLOT_FREE, SLOT_PENDING, SLOT_LANDING, SLOT_FENCED };
enum {
    ERR_TIMEOUT,
    ERR_PEER,
    ERR_NACK,
    ERR_SEND,
    ERR_CANCELLED,
    ERR_HEAD,
    ERR_UNREACHABLE,
    ERR_SCHEME,
    ERR_OTHER,
    N_ERR
};
static const char *const err_names[N_ERR] = {
    "timeout", "peer", "nack", "send", "cancelled", "head", "unreachable", "scheme", "other"};

struct dslot {
    struct tdm_disagg_decode *d; /* for the copier's callbacks */
    enum slot_state state;
    uint32_t epoch;
    tdm_req_t *req; /* NULL once detached (the request finished while pending) */
    uint64_t req_id;
    int peer;                        /* index in d->peers */
    int32_t *pages;                  /* [cap] copy, for fencing */
    int n_pages, n_tokens, n_cached; /* n_tokens: prompt[:-1]; its first n_cached were ours */
    bool acked;                      /* the prefiller said nothing more will land */
    bool head;                       /* the attempt asked for the head's KV and feature */
    bool head_nack;                  /* the peer refused the head (TDM_EUNSUPPORTED) */
    bool unreachable_nack; /* the peer cannot write the pool: asked again with landing pages */
    bool sharded;          /* the request carried the SHARDED block */
    bool scheme_nack;      /* the peer is sharded otherwise: asked again with its scheme */
    uint32_t src_ranks;    /* the prefill sharding the request counted on */
    bool held;     /* its pool pages are held: the request finished while pending (finished()
                    * holds them before the scheduler lets go), or the attempt is fenced */
    bool staged;   /* the pages land in host landing pages (land), then are copied in */
    int32_t *land; /* [cap] the landing page of each pool page (staged) */
    int copies;    /* LANDING: copies into the pool not yet completed */
    bool copy_failed;
    int64_t t_sent;
};

struct dpeer {
    char addr[TDM_XFER_ADDR_MAX];
    char *file; /* where addr comes from (re-read before a retry), or NULL */
    uint32_t xid;
    bool alive;
    bool head_refused; /* it cannot make our head's KV: ask it without (until it comes back) */
    bool staged;       /* it cannot reach the pool: lend it landing pages (until it comes back) */
    /* its sharding (--tp: p), as it last said (TDM_DMSG_SCHEME; 1 until then); legacy: it
     * predates sharded transfers (refused the SHARDED block), asked without it (this node
     * TP 1) until it comes back */
    int src_ranks;
    bool legacy;
    int64_t next_try_ns; /* while down: the next handshake attempt */
    int backoff_ms;
    int64_t outstanding_tokens;
    uint64_t sent, landed, failed;
};

struct tried {
    uint64_t req_id;
    uint32_t mask; /* peers tried */
    int attempts;
};

struct tdm_disagg_decode {
    struct tdm_disagg_decode_opts o;
    tdm_engine_t *engine;
    tdm_sched_t *sched;
    tdm_kv_pool_t *kv;
    struct disagg_endpoint ep;
    struct tdm_xfer_rmem kv_rmem, ctx_rmem, head_rmem;
    float *ctx_mem;
    size_t ctx_bytes;
    int n_layers, n_kv_heads, head_dim, page_size, d_model, vocab, chunk;
    int head_layers; /* the head's KV layers (0: no head) */
    /* tensor parallelism: the engine's ranks (d), each rank's pool as peers write it
     * (rank_rmem[0] is kv_rmem) and its layer stride */
    int n_ranks;
    struct tdm_xfer_rmem rank_rmem[TDM_DISAGG_MAX_RANKS];
    uint64_t rank_layer_bytes[TDM_DISAGG_MAX_RANKS];
    bool stage_all; /* every peer writes into landing pages (--kv-staging always, or no IPC) */

    pthread_mutex_t mu;
    struct dslot *slots;
    int n_slots;
    struct dpeer peers[TDM_DISAGG_MAX_PEERS];
    int n_peers;
    struct tried *tried;
    int n_tried_cap;
    /* the reviver thread: dead peers are tried again with backoff */
    pthread_cond_t rcv;
    pthread_t reviver;
    bool reviving, stop;
    /* metrics */
    struct tdm_hist landed_s;
    uint64_t errors[N_ERR], remote_ok, local_fallbacks, fenced_now;
    uint64_t cached_requests, cached_tokens; /* remote prefills that skipped a cached prefix */
    uint64_t head_ok;                        /* remote prefills that brought the head's KV */
    uint64_t staged_ok, landing_full;        /* through landing pages; admits that found too few */
    /* requests that named their prefill node: sent there; it was down or already tried; no
     * such peer; added as a new peer */
    uint64_t named_used, named_down, named_unknown, named_added;
    uint32_t *copy_src, *copy_dst; /* [TDM_XFER_COPY_MAX_PAGES] landing copies' page lists */
};

/* ---- tried-peers table: which peers a request has used (by request id) ---- */

static struct tried *tried_get(struct tdm_disagg_decode *d, uint64_t id, bool create)
{
    struct tried *free_e = NULL;
    for (int i = 0; i < d->n_tried_cap; i++) {
        if (d->tried[i].req_id == id) return &d->tried[i];
        if (!d->tried[i].req_id && !free_e) free_e = &d->tried[i];
    }
    if (!create || !free_e) return NULL;
    *free_e = (struct tried){.req_id = id};
    return free_e;
}

/* The slot's attempt does not count against its request, and its peer may be tried again
 * (a refusal that the next attempt, on the same peer, answers differently). d->mu held. */
static void uncount_attempt_locked(struct tdm_disagg_decode *d, const struct dslot *sl)
{
    struct tried *t = tried_get(d, sl->req_id, false);
    if (t) {
        t->mask &= ~(1u << sl->peer);
        if (t->attempts) t->attempts--;
    }
}

/* ---- fencing ---- */

static void unfence_locked(struct tdm_disagg_decode *d, struct dslot *sl)
{
    tdm_kv_pool_unhold(d->kv, sl->n_pages, sl->pages);
    sl->held = false;
    if (sl->staged) tdm_disagg_landing_give(&d->ep.land, sl->n_pages, sl->land);
    d->fenced_now -= (uint64_t)sl->n_pages;
    sl->state = SLOT_FREE;
    sl->req = NULL;
}

static int err_kind(tdm_status st)
{
    switch (st) {
    case TDM_ETIMEDOUT:
        return ERR_TIMEOUT;
    case TDM_EPEER:
        return ERR_PEER;
    case TDM_ECANCELED:
        return ERR_CANCELLED;
    default:
        return ERR_OTHER;
    }
}

static void send_cancel(struct tdm_disagg_decode *d, uint32_t xpeer, uint32_t slot, uint32_t epoch)
{
    struct tdm_disagg_msg m = {.type = TDM_DMSG_CANCEL, .slot = slot, .epoch = epoch};
    uint8_t buf[32];
    size_t n = tdm_disagg_msg_encode(&m, buf, sizeof buf);
    if (d->ep.tp.iface->send(d->ep.tp.t, xpeer, buf, n, d->o.timeout_ms, NULL, NULL) != TDM_OK)
        TDM_WARN("disagg: cannot send a cancel for slot %u: %s (its pages stay fenced until "
                 "the peer is declared dead)",
                 slot, tdm_err_msg());
}

/* Every write of the slot's attempt is in the pool: the request runs (its head's feature with
 * it). The slot is free again. d->mu held. */
static void deliver_locked(struct tdm_disagg_decode *d, struct dslot *sl)
{
    struct dpeer *p = &d->peers[sl->peer];
    int64_t now = (int64_t)tdm_now_ns();
    size_t slot = (size_t)(sl - d->slots);
    p->landed++;
    d->remote_ok++;
    tdm_hist_observe(&d->landed_s, (double)(now - sl->t_sent) * 1e-9);
    TDM_DEBUG("disagg: request %llu: KV landed from %s in %.3f ms (slot %zu epoch %u%s)",
              (unsigned long long)sl->req_id, p->addr, (double)(now - sl->t_sent) * 1e-6, slot,
              sl->epoch, sl->staged ? ", through landing pages" : "");
    tdm_req_t *r = sl->req;
    sl->state = SLOT_FREE;
    sl->req = NULL;
    if (r && sl->head) {
        /* the head's KV of [0, n - 1) landed, and the feature of n - 1 (n prefilled) */
        size_t feature_at;
        tdm_disagg_ctx_layout((uint32_t)d->d_model, d->ep.head.id.feature_width, (uint32_t)d->vocab,
                              d->o.want_logits, &feature_at, NULL);
        const float *ctx_buf = d->ctx_mem + slot * (d->ctx_bytes / sizeof(float));
        d->head_ok++;
        tdm_req_remote_done_feed(r, ctx_buf + feature_at, sl->n_tokens - 1);
    } else if (r) {
        tdm_req_remote_done(r, TDM_OK);
    }
}

/* The landing copies of a slot are done. d->mu held. */
static void finish_landing_locked(struct tdm_disagg_decode *d, struct dslot *sl)
{
    tdm_kv_pool_unhold(d->kv, sl->n_pages, sl->pages);
    tdm_disagg_landing_give(&d->ep.land, sl->n_pages, sl->land);
    if (!sl->copy_failed) {
        d->staged_ok++;
        deliver_locked(d, sl);
        return;
    }
    d->errors[ERR_OTHER]++;
    d->peers[sl->peer].failed++;
    TDM_WARN("disagg: request %llu: copying its KV from the landing pages into the pool failed; "
             "%s",
             (unsigned long long)sl->req_id, sl->req ? "retrying" : "request gone");
    tdm_req_t *r = sl->req;
    sl->state = SLOT_FREE;
    sl->req = NULL;
    if (r) tdm_req_remote_done(r, TDM_EIO);
}

/* One landing copy ended (the copier's thread). */
static void on_landed(void *ctx, tdm_status st)
{
    struct dslot *sl = ctx;
    struct tdm_disagg_decode *d = sl->d;
    pthread_mutex_lock(&d->mu);
    if (st != TDM_OK) sl->copy_failed = true;
    if (--sl->copies == 0) finish_landing_locked(d, sl);
    pthread_mutex_unlock(&d->mu);
}

/* Every write of a staged attempt is in the landing pages: the copier scatters them into the
 * pool's pages (one page list per group of layers, cut at the copier's cap), and the request
 * runs when the last copy ends. The pool pages are held meanwhile, so a request that finishes
 * first cannot have them reused under the copy. d->mu held. */
static void start_landing_locked(struct tdm_disagg_decode *d, struct dslot *sl)
{
    const struct disagg_landing *l = &d->ep.land;
    const struct tdm_xfer_copier *c = &d->ep.copier;
    sl->state = SLOT_LANDING;
    sl->copies = 1; /* ours, until every copy is submitted */
    sl->copy_failed = false;
    tdm_kv_pool_hold(d->kv, sl->n_pages, sl->pages);
    size_t pool_pages = d->ep.kv.layer_bytes / d->ep.kv.page_bytes;
    for (int g = 0; g < (sl->head ? 2 : 1); g++) {
        int layers = g ? d->head_layers : d->n_layers;
        size_t page_bytes = g ? d->ep.head.page_bytes : d->ep.kv.page_bytes;
        uint8_t *pool = g ? d->ep.head.base : d->ep.kv.base;
        size_t pool_bytes = g ? d->ep.head.bytes : d->ep.kv.bytes;
        const uint8_t *land = l->base + (g ? l->head_at : 0);
        size_t land_bytes = g ? l->bytes - l->head_at : l->head_at;
        uint32_t n = 0;
        for (int layer = 0; layer < layers; layer++)
            for (int i = 0; i < sl->n_pages; i++) {
                d->copy_src[n] =
                    (uint32_t)((size_t)layer * (size_t)l->n_pages + (size_t)sl->land[i]);
                d->copy_dst[n] = (uint32_t)((size_t)layer * pool_pages + (size_t)sl->pages[i]);
                bool last = layer == layers - 1 && i == sl->n_pages - 1;
                if (++n < TDM_XFER_COPY_MAX_PAGES && !last) continue;
                struct tdm_xfer_pages pg = {.src_pages = d->copy_src,
                                            .dst_pages = d->copy_dst,
                                            .n_pages = n,
                                            .page_bytes = page_bytes,
                                            .src_stride = page_bytes,
                                            .dst_stride = page_bytes};
                if (c->iface->copy_pages(c->c, land, land_bytes, pool, pool_bytes, &pg, on_landed,
                                         sl) == TDM_OK)
                    sl->copies++;
                else
                    sl->copy_failed = true;
                n = 0;
            }
    }
    if (--sl->copies == 0) finish_landing_locked(d, sl);
}

/* The counter of (slot, epoch) ended. Runs on the progress thread, or on the thread that
 * cancelled it. */
static void on_counter(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct tdm_disagg_decode *d = ctx;
    pthread_mutex_lock(&d->mu);
    struct dslot *sl = slot < (uint32_t)d->n_slots ? &d->slots[slot] : NULL;
    if (!sl || sl->epoch != epoch || sl->state != SLOT_PENDING) {
        pthread_mutex_unlock(&d->mu);
        return;
    }
    struct dpeer *p = &d->peers[sl->peer];
    p->outstanding_tokens -= sl->n_tokens - sl->n_cached;
    if (st == TDM_OK && sl->staged && sl->req) { /* into the landing pages: now the pool's */
        start_landing_locked(d, sl);
        pthread_mutex_unlock(&d->mu);
        return;
    }
    if (st == TDM_OK) {
        /* a request that finished meanwhile: its pages were held by finished(); nothing
         * more lands (every write is in), so they go, and a staged attempt's landing pages
         * are not copied anywhere */
        if (sl->held) {
            tdm_kv_pool_unhold(d->kv, sl->n_pages, sl->pages);
            sl->held = false;
        }
        if (sl->staged && !sl->req) {
            tdm_disagg_landing_give(&d->ep.land, sl->n_pages, sl->land);
            sl->state = SLOT_FREE;
        } else {
            deliver_locked(d, sl);
        }
        pthread_mutex_unlock(&d->mu);
        return;
    }
    /* failure: fence the pages, tell the prefiller, hand the request back */
    int kind = sl->acked && st == TDM_ECANCELED ? (sl->head_nack          ? ERR_HEAD
                                                   : sl->unreachable_nack ? ERR_UNREACHABLE
                                                   : sl->scheme_nack      ? ERR_SCHEME
                                                                          : ERR_NACK)
                                                : err_kind(st);
    d->errors[kind]++;
    p->failed++;
    if (kind == ERR_SCHEME) /* it told us its sharding: asked again, not a failure */
        TDM_INFO("disagg: request %llu: asked %s again by its sharding",
                 (unsigned long long)sl->req_id, p->addr);
    else
        TDM_WARN("disagg: request %llu: remote prefill on %s failed (%s: %s); %s",
                 (unsigned long long)sl->req_id, p->addr, err_names[kind], tdm_status_str(st),
                 sl->req ? "retrying" : "request gone");
    tdm_req_t *r = sl->req;
    sl->req = NULL;
    if (!sl->held) /* the request is alive (its references keep the pages): hold them */
        tdm_kv_pool_hold(d->kv, sl->n_pages, sl->pages);
    sl->held = true;
    d->fenced_now += (uint64_t)sl->n_pages;
    sl->state = SLOT_FENCED;
    bool cancel = false;
    if (sl->acked || !p->alive)
        unfence_locked(d, sl);
    else
        cancel = true;
    if (r) tdm_req_remote_done(r, st);
    uint32_t xpeer = p->xid;
    pthread_mutex_unlock(&d->mu);
    if (cancel) send_cancel(d, xpeer, slot, epoch);
}

static void on_send_done(void *ctx, tdm_status st)
{
    struct send_ctx *sc = ctx;
    if (st != TDM_OK) {
        pthread_mutex_lock(&sc->d->mu);
        sc->d->errors[ERR_SEND]++;
        pthread_mutex_unlock(&sc->d->mu);
        tdm_xfer_counters_cancel(tdm_xfer_get_counters(sc->d->ep.x), sc->slot, sc->epoch);
    }
    free(sc);
}

static void on_msg(void *ctx, uint32_t xpeer, const void *data, size_t bytes)
{
    struct tdm_disagg_decode *d = ctx;
    struct tdm_disagg_msg m;
    if (tdm_disagg_msg_decode(data, bytes, &m, NULL, 0, NULL, 0) != TDM_OK) {
        TDM_WARN("disagg: bad control message from peer %u: %s", xpeer, tdm_err_msg());
        return;
    }
    if (m.type != TDM_DMSG_NACK && m.type != TDM_DMSG_CANCEL_ACK && m.type != TDM_DMSG_SCHEME)
        return;
    pthread_mutex_lock(&d->mu);
    struct dslot *sl = m.slot < (uint32_t)d->n_slots ? &d->slots[m.slot] : NULL;
    if (!sl || sl->epoch != m.epoch || d->peers[sl->peer].xid != xpeer) {
        pthread_mutex_unlock(&d->mu);
        return;
    }
    bool cancel_counter = false;
    sl->acked = true;
    struct dpeer *p = &d->peers[sl->peer];
    if (m.type == TDM_DMSG_SCHEME) {
        /* it is sharded otherwise than the request counted on (nothing landed): the request
         * goes back to it with its scheme, and so do the next ones (not counted against this
         * request, unless it says what we sent: then something else is wrong) */
        if (m.scheme_kv_heads != (uint32_t)d->n_kv_heads)
            TDM_WARN("disagg: prefill peer %s holds %u KV heads, this model %d: another model",
                     p->addr, m.scheme_kv_heads, d->n_kv_heads);
        if (m.scheme_ranks != sl->src_ranks) {
            TDM_INFO("disagg: prefill peer %s runs --tp %u (this node --tp %d): its KV heads "
                     "arrive in slices by that scheme",
                     p->addr, m.scheme_ranks, d->n_ranks);
            p->src_ranks = (int)m.scheme_ranks;
            uncount_attempt_locked(d, sl);
        }
        sl->scheme_nack = true;
    } else if (m.type == TDM_DMSG_NACK && sl->sharded && m.status == TDM_EFORMAT &&
               d->n_ranks == 1 && sl->src_ranks == 1 && !p->legacy) {
        /* a node that predates sharded transfers refuses the SHARDED block; both sides of
         * TP 1 need none: ask it without (not counted against this request) */
        TDM_WARN("disagg: prefill peer %s predates sharded KV transfers (%s); it is asked "
                 "without the sharding block",
                 p->addr, m.error);
        p->legacy = true;
        sl->scheme_nack = true;
        uncount_attempt_locked(d, sl);
    } else if (m.type == TDM_DMSG_NACK && sl->head && m.status == TDM_EUNSUPPORTED) {
        /* it cannot make our head's KV: the request goes back to it without the head, and
         * so do the next ones (the attempt is not counted against this request) */
        if (!p->head_refused)
            TDM_WARN("disagg: prefill peer %s cannot make the speculation head's KV: %s; its "
                     "prefills go on without the head, and those requests decode without drafts",
                     p->addr, m.error);
        p->head_refused = true;
        sl->head_nack = true;
        uncount_attempt_locked(d, sl);
    } else if (m.type == TDM_DMSG_NACK && m.status == TDM_EUNREACHABLE && !sl->staged &&
               d->ep.land.on) {
        /* it cannot write our pool (another host): the request goes back to it with landing
         * pages, and so do the next ones (not counted against this request) */
        if (!p->staged)
            TDM_WARN("disagg: prefill peer %s cannot write our KV pool (%s); its prefills come "
                     "through host landing pages from now on",
                     p->addr, m.error);
        p->staged = true;
        sl->unreachable_nack = true;
        uncount_attempt_locked(d, sl);
    } else if (m.type == TDM_DMSG_NACK) {
        TDM_WARN("disagg: prefill peer %s refused request %llu: %s", p->addr,
                 (unsigned long long)sl->req_id, m.error);
    }
    if (sl->state == SLOT_FENCED)
        unfence_locked(d, sl);
    else if (sl->state == SLOT_PENDING)
        cancel_counter = true;
    pthread_mutex_unlock(&d->mu);
    if (cancel_counter) tdm_xfer_counters_cancel(tdm_xfer_get_counters(d->ep.x), m.slot, m.epoch);
}

/* A fenced slot's cancel, to send again (d->mu released). */
struct recancel {
    uint32_t slot, epoch;
};

/* The fenced slots of peer i, for their cancels to go out again now that it is back (their
 * acks unfence them). d->mu held. */
static int collect_fenced(struct tdm_disagg_decode *d, int i, struct recancel *out, int cap)
{
    int n = 0;
    for (int s = 0; s < d->n_slots && n < cap; s++)
        if (d->slots[s].state == SLOT_FENCED && d->slots[s].peer == i)
            out[n++] = (struct recancel){(uint32_t)s, d->slots[s].epoch};
    return n;
}

static void on_peer(void *ctx, uint32_t xpeer, bool up)
{
    struct tdm_disagg_decode *d = ctx;
    /* fenced pages are reused only when nothing of the peer can still land: its connection
     * failed, or (once it is back) it acknowledged the cancels. A peer dead by silence may be a
     * stopped process whose writes land when it resumes. */
    bool gone = !up && tdm_xfer_peer_gone(d->ep.x, xpeer);
    struct recancel cancels[64];
    int n_cancels = 0;
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < d->n_peers; i++) {
        if (d->peers[i].xid != xpeer) continue;
        if (d->peers[i].alive != up)
            TDM_INFO("disagg: prefill peer %s is %s", d->peers[i].addr, up ? "up" : "down");
        /* a peer back from being down may have restarted with the right head */
        if (up && !d->peers[i].alive) {
            d->peers[i].head_refused = false;
            d->peers[i].legacy = false;        /* or a newer tandem */
            d->peers[i].staged = d->stage_all; /* and may now be a node of this host */
        }
        d->peers[i].alive = up;
        if (up) {
            d->peers[i].backoff_ms = d->o.revive_ms;
            n_cancels = collect_fenced(d, i, cancels, (int)TDM_ARRAY_LEN(cancels));
            continue;
        }
        d->peers[i].next_try_ns = (int64_t)tdm_now_ns() + (int64_t)d->peers[i].backoff_ms * 1000000;
        if (!gone) {
            TDM_INFO("disagg: prefill peer %s is silent; its fenced pages stay held until it "
                     "answers or its connection fails",
                     d->peers[i].addr);
            continue;
        }
        for (int s = 0; s < d->n_slots; s++)
            if (d->slots[s].state == SLOT_FENCED && d->slots[s].peer == i)
                unfence_locked(d, &d->slots[s]);
    }
    pthread_mutex_unlock(&d->mu);
    for (int k = 0; k < n_cancels; k++)
        send_cancel(d, xpeer, cancels[k].slot, cancels[k].epoch);
}

/* ---- the KV connector (scheduler thread) ---- */

/* Whether peer p is the prefill node named HOST:PORT (its source http(s)://HOST:PORT, with or
 * without a trailing slash). */
static bool peer_named(const struct dpeer *p, const char *name)
{
    if (!p->file) return false;
    const char *u = p->file;
    if (!strncmp(u, "http://", 7))
        u += 7;
    else if (!strncmp(u, "https://", 8))
        u += 8;
    else
        return false;
    size_t n = strlen(name); /* host names are not case-sensitive */
    return !strncasecmp(u, name, n) && (!u[n] || (u[n] == '/' && !u[n + 1]));
}

/* The peer a request names (tdm_disagg_decode_opts.add_named_peers), with d->mu held: its
 * index when it can take this request now, else -1 (the usual choice follows); an unknown
 * name becomes a new peer when allowed (the reviver resolves and connects it). */
static int named_peer_locked(struct tdm_disagg_decode *d, const char *name, uint32_t tried)
{
    for (int i = 0; i < d->n_peers; i++) {
        if (!peer_named(&d->peers[i], name)) continue;
        if (d->peers[i].alive && !(tried >> i & 1)) return i; /* counted once it is sent */
        d->named_down++;
        return -1;
    }
    if (!d->o.add_named_peers || d->n_peers == TDM_DISAGG_MAX_PEERS) {
        d->named_unknown++;
        return -1;
    }
    struct dpeer *p = &d->peers[d->n_peers];
    char *src = malloc(strlen(name) + 8);
    if (!src) {
        d->named_unknown++;
        return -1;
    }
    sprintf(src, "http://%s", name);
    *p = (struct dpeer){.file = src,
                        .xid = UINT32_MAX,
                        .src_ranks = 1,
                        .staged = d->stage_all,
                        .backoff_ms = d->o.revive_ms,
                        .next_try_ns = (int64_t)tdm_now_ns()};
    TDM_INFO("disagg: prefill peer %d: %s, named by a request; connecting", d->n_peers, src);
    d->n_peers++;
    d->named_added++;
    pthread_cond_signal(&d->rcv);
    return -1;
}

static bool admit(void *ctx, tdm_req_t *r, void *user, const int32_t *tokens, int n_tokens,
                  int n_cached, const int32_t *pages, int n_pages)
{
    struct tdm_disagg_decode *d = ctx;
    if (d->o.max_attempts < 0 || n_cached < 0 || n_cached % d->page_size || n_cached >= n_tokens)
        return false;
    /* the pages past the cached prefix: the prefill node fills those only */
    const int first_page = n_cached / d->page_size;
    int need_pages = (n_tokens + d->page_size - 1) / d->page_size - first_page;
    if (first_page + need_pages > n_pages) return false;
    pages += first_page;
    pthread_mutex_lock(&d->mu);
    struct tried *t = tried_get(d, tdm_req_id(r), true);
    if (!t || t->attempts >= d->o.max_attempts) {
        if (t && t->attempts) d->local_fallbacks++;
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    const char *name = tdm_req_kv_peer(r);
    const int named = name ? named_peer_locked(d, name, t->mask) : -1;
    int best = named;
    for (int i = 0; i < d->n_peers && (!name || best < 0); i++) {
        struct dpeer *p = &d->peers[i];
        if (!p->alive || (t->mask >> i & 1)) continue;
        if (best < 0 || p->outstanding_tokens < d->peers[best].outstanding_tokens) best = i;
    }
    /* a free slot from a random start, and a random epoch: what an immediate must name to
     * count is not guessable from the order of requests (docs/SECURITY.md) */
    uint32_t rnd[2] = {0, 0};
    if (!tdm_xfer_random(rnd, sizeof rnd)) rnd[0] = (uint32_t)tdm_now_ns(), rnd[1] = rnd[0] >> 7;
    int slot = -1;
    for (int k = 0; k < d->n_slots && best >= 0; k++) {
        int i = (int)((rnd[0] + (uint32_t)k) % (uint32_t)d->n_slots);
        if (d->slots[i].state == SLOT_FREE) {
            slot = i;
            break;
        }
    }
    if (best < 0 || slot < 0) {
        if (t->attempts) d->local_fallbacks++;
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    /* the writes to expect, from both schemes (disagg.h): the peer's sharding as it last said,
     * ours, and the seed that draws its replica sets for ours (any draw: the same count) */
    const bool legacy = d->peers[best].legacy && d->n_ranks == 1;
    const uint32_t src_ranks = legacy ? 1 : (uint32_t)d->peers[best].src_ranks;
    uint64_t seed = ((uint64_t)rnd[0] << 32 | rnd[1]) ^ tdm_req_id(r) ^ tdm_now_ns();
    struct tdm_disagg_shard_plan plan;
    if (tdm_disagg_shard_plan(d->n_kv_heads, (int)src_ranks, d->n_ranks, seed, &plan) != TDM_OK) {
        TDM_WARN("disagg: no sharded transfer from prefill peer %s: %s; prefilled here",
                 d->peers[best].addr, tdm_err_msg());
        d->errors[ERR_SCHEME]++;
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    uint32_t expected =
        tdm_disagg_expected_writes((uint32_t)n_tokens, (uint32_t)n_cached, (uint32_t)d->chunk,
                                   tdm_disagg_chunk_writes(&plan, (uint32_t)d->n_layers, 0));
    /* the head's KV is one more layer per chunk, when the immediates can name it */
    uint32_t expected_head = tdm_disagg_expected_writes(
        (uint32_t)n_tokens, (uint32_t)n_cached, (uint32_t)d->chunk,
        tdm_disagg_chunk_writes(&plan, (uint32_t)d->n_layers, (uint32_t)d->head_layers));
    if (expected - 1 > d->ep.caps.max_index) { /* too many chunks for the immediates */
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    bool head = d->head_layers > 0 && expected_head - 1 <= d->ep.caps.max_index;
    bool staged = d->peers[best].staged;
    if (staged && !tdm_disagg_landing_take(&d->ep.land, need_pages, d->slots[slot].land)) {
        d->landing_full++; /* every landing page lent: prefilled here */
        if (t->attempts) d->local_fallbacks++;
        pthread_mutex_unlock(&d->mu);
        return false;
    }
    t->attempts++;
    t->mask |= 1u << best;
    if (named >= 0) d->named_used++;
    head = head && !d->peers[best].head_refused;
    if (head) expected = expected_head;
    struct dslot *sl = &d->slots[slot];
    uint32_t fresh = rnd[1] % (d->ep.caps.max_epoch + 1);
    if (fresh == sl->epoch) fresh = (fresh + 1) % (d->ep.caps.max_epoch + 1); /* never the last */
    sl->epoch = fresh;
    sl->state = SLOT_PENDING;
    sl->req = r;
    sl->req_id = tdm_req_id(r);
    sl->peer = best;
    sl->n_pages = need_pages;
    sl->n_tokens = n_tokens;
    sl->n_cached = n_cached;
    sl->acked = false;
    sl->head = head;
    sl->head_nack = false;
    sl->unreachable_nack = false;
    sl->sharded = !legacy;
    sl->scheme_nack = false;
    sl->src_ranks = src_ranks;
    sl->held = false;
    sl->staged = staged;
    sl->t_sent = (int64_t)tdm_now_ns();
    memcpy(sl->pages, pages, (size_t)need_pages * sizeof *pages);
    struct dpeer *p = &d->peers[best];
    p->outstanding_tokens += n_tokens - n_cached;
    p->sent++;
    if (n_cached) {
        d->cached_requests++;
        d->cached_tokens += (uint64_t)n_cached;
    }
    uint32_t epoch = sl->epoch, xpeer = p->xid;
    pthread_mutex_unlock(&d->mu);

    /* the message */
    struct tdm_disagg_msg m = {.type = TDM_DMSG_PREFILL};
    struct tdm_disagg_prefill_msg *f = &m.prefill;
    *f = (struct tdm_disagg_prefill_msg){.req_id = sl->req_id,
                                         .slot = (uint32_t)slot,
                                         .epoch = epoch,
                                         .n_tokens = (uint32_t)n_tokens,
                                         .chunk = (uint32_t)d->chunk,
                                         .n_layers = (uint32_t)d->n_layers,
                                         .n_kv_heads = (uint32_t)d->n_kv_heads,
                                         .head_dim = (uint32_t)d->head_dim,
                                         .page_size = (uint32_t)d->page_size,
                                         .elem_bytes = (uint32_t)d->ep.kv.elem_bytes,
                                         .kv_dtype = (uint32_t)d->ep.kv.dtype,
                                         .kv_head_begin = 0,
                                         .kv_head_end = (uint32_t)d->n_kv_heads,
                                         .dst_layer_stride = d->ep.kv.layer_bytes,
                                         .kv = d->kv_rmem,
                                         .ctx = d->ctx_rmem,
                                         .ctx_offset = (uint64_t)slot * d->ctx_bytes,
                                         .d_model = (uint32_t)d->d_model,
                                         .vocab = (uint32_t)d->vocab,
                                         .want_logits = d->o.want_logits,
                                         .want_head = head,
                                         .cached_tokens = (uint32_t)n_cached,
                                         .n_pages = (uint32_t)need_pages,
                                         .tokens = tokens,
                                         .pages = (const uint32_t *)pages};
    if (head) {
        f->head = d->ep.head.id;
        f->head.dst_layer_stride = d->ep.head.layer_bytes;
        f->head.kv = d->head_rmem;
    }
    if (!legacy) { /* both schemes, and where each of our ranks keeps its KV heads */
        struct tdm_tp_kv_shard ss, ds;
        (void)tdm_tp_kv_shard_of(d->n_kv_heads, (int)src_ranks, 0, &ss); /* planned above */
        (void)tdm_tp_kv_shard_of(d->n_kv_heads, d->n_ranks, 0, &ds);
        f->sharded = 1;
        f->dst_ranks = (uint32_t)d->n_ranks;
        f->src_ranks = src_ranks;
        f->dst_sets = (uint32_t)ds.n_replica_sets;
        f->src_sets = (uint32_t)ss.n_replica_sets;
        f->shard_seed = seed;
        for (int k = 1; k < d->n_ranks; k++)
            f->ranks[k] = (struct tdm_disagg_rank_dst){.dst_layer_stride = d->rank_layer_bytes[k],
                                                       .kv = d->rank_rmem[k]};
    }
    if (staged) { /* the prefiller writes into our landing pages, laid out like the pool */
        f->kv = d->ep.land.rmem;
        f->dst_layer_stride = d->ep.land.layer_bytes;
        f->pages = (const uint32_t *)sl->land;
        if (head) {
            f->head.kv = d->ep.land.head_rmem;
            f->head.dst_layer_stride = d->ep.land.head_layer_bytes;
        }
    }
    size_t size = tdm_disagg_prefill_msg_size(f->n_tokens, f->n_pages, head, n_cached > 0,
                                              f->sharded ? f->dst_ranks : 0);
    uint8_t *buf = malloc(size);
    struct send_ctx *sc = malloc(sizeof *sc);
    tdm_xfer_counters_t *ctr = tdm_xfer_get_counters(d->ep.x);
    tdm_status st = TDM_ENOMEM;
    if (buf && sc && tdm_disagg_msg_encode(&m, buf, size) == size)
        st = tdm_xfer_counters_arm(ctr, (uint32_t)slot, epoch, expected, xpeer, d->o.timeout_ms,
                                   on_counter, d);
    if (st == TDM_OK) {
        *sc = (struct send_ctx){.d = d, .slot = (uint32_t)slot, .epoch = epoch};
        st = d->ep.tp.iface->send(d->ep.tp.t, xpeer, buf, size, d->o.timeout_ms, on_send_done, sc);
        if (st != TDM_OK) {
            free(sc);
            pthread_mutex_lock(&d->mu);
            d->errors[ERR_SEND]++;
            pthread_mutex_unlock(&d->mu);
            tdm_xfer_counters_cancel(ctr, (uint32_t)slot, epoch); /* -> on_counter */
        }
        free(buf);
        TDM_DEBUG("disagg: request %llu: %d tokens sent to %s (slot %d epoch %u, %u writes)",
                  (unsigned long long)sl->req_id, n_tokens, p->addr, slot, epoch, expected);
        return true; /* on_counter reports the outcome either way */
    }
    free(buf);
    free(sc);
    /* never armed: undo the slot */
    pthread_mutex_lock(&d->mu);
    if (staged) tdm_disagg_landing_give(&d->ep.land, need_pages, sl->land);
    sl->state = SLOT_FREE;
    sl->req = NULL;
    p->outstanding_tokens -= n_tokens - n_cached;
    d->errors[ERR_OTHER]++;
    pthread_mutex_unlock(&d->mu);
    TDM_WARN("disagg: cannot start a remote prefill: %s", tdm_err_msg());
    return false;
}

static void finished(void *ctx, tdm_req_t *r, void *user, enum tdm_finish why)
{
    struct tdm_disagg_decode *d = ctx;
    int slot = -1;
    uint32_t epoch = 0;
    pthread_mutex_lock(&d->mu);
    uint64_t id = tdm_req_id(r);
    for (int i = 0; i < d->n_slots; i++) {
        if (d->slots[i].req != r) continue;
        if (d->slots[i].state == SLOT_LANDING) { /* its copies end on their own */
            d->slots[i].req = NULL;
        } else if (d->slots[i].state == SLOT_PENDING) {
            struct dslot *sl = &d->slots[i];
            sl->req = NULL; /* detached: on_counter will not touch r again */
            /* its writes may still land in its pages, and the counter may have fired
             * already (its callback waiting for d->mu): hold them now, before the scheduler
             * lets go of them, for on_counter to release or fence */
            tdm_kv_pool_hold(d->kv, sl->n_pages, sl->pages);
            sl->held = true;
            slot = i;
            epoch = sl->epoch;
        }
    }
    struct tried *t = tried_get(d, id, false);
    if (t) t->req_id = 0;
    pthread_mutex_unlock(&d->mu);
    /* a request that ends while its KV is in flight: its pages are held (above); the counter's
     * end (this cancel, or its firing) fences or frees them */
    if (slot >= 0) tdm_xfer_counters_cancel(tdm_xfer_get_counters(d->ep.x), (uint32_t)slot, epoch);
}

/* ---- peers coming back ---- */

/* The first line of a peer's address file, or false. */
bool tdm_disagg_read_addr_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    bool ok = fgets(out, (int)cap, f) != NULL;
    fclose(f);
    if (ok) out[strcspn(out, " \r\n\t")] = '\0';
    return ok && out[0];
}

/* Every peer that is down, once its backoff has passed: its file read again (the node may have
 * restarted elsewhere), then a fresh handshake (the transfer engine brings a dead entry back in
 * place, or makes a new one for a new address). */
static void *reviver_main(void *arg)
{
    struct tdm_disagg_decode *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->stop) {
        struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, 100);
        pthread_cond_timedwait(&d->rcv, &d->mu, &dl);
        for (int i = 0; i < d->n_peers && !d->stop; i++) {
            struct dpeer *p = &d->peers[i];
            int64_t now = (int64_t)tdm_now_ns();
            if (p->alive || now < p->next_try_ns) continue;
            /* fenced pages of a silent peer: is its process gone (then nothing can land)? */
            uint32_t old = p->xid;
            bool fenced = false;
            for (int s = 0; s < d->n_slots && !fenced; s++)
                fenced = d->slots[s].state == SLOT_FENCED && d->slots[s].peer == i;
            if (fenced) {
                pthread_mutex_unlock(&d->mu);
                bool gone = tdm_xfer_peer_gone(d->ep.x, old) ||
                            tdm_xfer_peer_probe(d->ep.x, old, 200) == TDM_OK;
                pthread_mutex_lock(&d->mu);
                if (gone && p->xid == old)
                    for (int s = 0; s < d->n_slots; s++)
                        if (d->slots[s].state == SLOT_FENCED && d->slots[s].peer == i)
                            unfence_locked(d, &d->slots[s]);
            }
            char addr[TDM_XFER_ADDR_MAX], fresh[TDM_XFER_ADDR_MAX];
            snprintf(addr, sizeof addr, "%s", p->addr);
            char *file = p->file;
            p->next_try_ns = now + (int64_t)p->backoff_ms * 1000000;
            p->backoff_ms = TDM_MIN(p->backoff_ms * 2, 10000);
            pthread_mutex_unlock(&d->mu);
            bool (*rd)(void *, const char *, char *, size_t) = d->o.read_peer;
            if (file &&
                (rd ? rd(d->o.read_peer_ctx, file, fresh, sizeof fresh)
                    : tdm_disagg_read_addr_file(file, fresh, sizeof fresh)) &&
                fresh[0] && strcmp(fresh, addr)) {
                TDM_INFO("disagg: prefill peer %d %s: %s now gives %s", i,
                         addr[0] ? "moved" : "found", file, fresh);
                snprintf(addr, sizeof addr, "%s", fresh);
            }
            if (!addr[0]) { /* still no address */
                pthread_mutex_lock(&d->mu);
                continue;
            }
            uint32_t xid = 0;
            tdm_status st = tdm_xfer_peer_add(d->ep.x, addr, &xid);
            if (st != TDM_OK) TDM_WARN("disagg: prefill peer %d (%s): %s", i, addr, tdm_err_msg());
            pthread_mutex_lock(&d->mu);
            if (st != TDM_OK) continue;
            snprintf(p->addr, sizeof p->addr, "%s", addr);
            p->xid = xid;
            /* the transfer engine may have recycled another dead peer's entry for this address
             * (a full table, the entry long silent): that peer's address was dropped with it,
             * so nothing of its old incarnation can land any more (its fences go), and it is
             * re-added by address when its turn comes */
            for (int j = 0; j < d->n_peers; j++) {
                if (j == i || d->peers[j].xid != xid) continue;
                d->peers[j].xid = UINT32_MAX;
                for (int s = 0; s < d->n_slots; s++)
                    if (d->slots[s].state == SLOT_FENCED && d->slots[s].peer == j)
                        unfence_locked(d, &d->slots[s]);
            }
            pthread_mutex_unlock(&d->mu);
            /* its answer may have come before xid was set (on_peer then matched nothing) */
            bool up = tdm_xfer_peer_wait(d->ep.x, xid, 1) == TDM_OK;
            pthread_mutex_lock(&d->mu);
            if (up && p->xid == xid && !p->alive) {
                TDM_INFO("disagg: prefill peer %s is up", p->addr);
                p->alive = true;
                p->head_refused = false;
                p->legacy = false;
                p->staged = d->stage_all; /* it may be a node of this host now */
                p->backoff_ms = d->o.revive_ms;
                struct recancel rc[64];
                int n = collect_fenced(d, i, rc, (int)TDM_ARRAY_LEN(rc));
                pthread_mutex_unlock(&d->mu);
                for (int k = 0; k < n; k++)
                    send_cancel(d, xid, rc[k].slot, rc[k].epoch);
                pthread_mutex_lock(&d->mu);
            }
        }
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---- lifecycle ---- */

tdm_status tdm_disagg_decode_create(const struct tdm_disagg_decode_opts *o, tdm_engine_t *e,
                                    tdm_sched_t *s, tdm_disagg_decode_t **out)
{
    const struct tdm_model_config *c = &tdm_engine_model(e)->cfg;
    const struct tdm_engine_opts *eo = tdm_engine_opts(e);
    if (o->head && tdm_engine_tp_ranks(e) > 1) return tdm_disagg_refuse_tp_head(e);
    if (o->n_peers < 0 || o->n_peers > TDM_DISAGG_MAX_PEERS)
        return tdm_err_set(TDM_ERANGE, "disagg: at most %d prefill peers", TDM_DISAGG_MAX_PEERS);
    struct tdm_disagg_decode *d = calloc(1, sizeof *d);
    if (!d) return tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
    d->o = *o;
    if (d->o.timeout_ms <= 0) d->o.timeout_ms = 30000;
    if (!d->o.max_attempts) d->o.max_attempts = 2;
    if (d->o.revive_ms <= 0) d->o.revive_ms = 500;
    d->engine = e;
    d->sched = s;
    d->kv = tdm_engine_kv(e);
    d->n_layers = c->n_layers;
    d->n_kv_heads = c->n_kv_heads;
    d->head_dim = c->head_dim;
    d->d_model = c->d_model;
    d->vocab = c->vocab_size;
    d->page_size = eo->page_size;
    d->n_ranks = tdm_engine_tp_ranks(e);
    int chunk = o->chunk > 0 ? o->chunk : 256;
    d->chunk = (chunk + d->page_size - 1) / d->page_size * d->page_size;
    pthread_mutex_init(&d->mu, NULL);
    static const double lat[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                 0.1,   0.15,   0.2,   0.3,  0.4,  0.5,  0.75, 1,
                                 1.5,   2,      3,     5,    7.5,  10,   20,   40};
    d->landed_s.n_buckets = 24;
    memcpy(d->landed_s.bounds, lat, sizeof lat);

    tdm_status st;
    /* slots: one per sequence the engine runs at once (the transfer engine caps them too) */
    int max_pages = (eo->max_ctx + d->page_size - 1) / d->page_size;
    d->n_slots = eo->max_seqs;
    d->slots = calloc((size_t)d->n_slots, sizeof *d->slots);
    d->n_tried_cap = 4 * eo->max_seqs + 1024;
    d->tried = calloc((size_t)d->n_tried_cap, sizeof *d->tried);
    /* room for the largest context: hidden state, feature (the head's: d_model, or an EAGLE-3
     * head's fused one), logits */
    const int fw = o->head && o->head->head && o->head->head->feature_width > 0
                       ? o->head->head->feature_width
                       : d->d_model;
    d->ctx_bytes = (tdm_disagg_ctx_layout((uint32_t)d->d_model, (uint32_t)fw, (uint32_t)d->vocab,
                                          true, NULL, NULL) *
                        sizeof(float) +
                    63) /
                   64 * 64;
    d->head_layers = o->head ? o->head->cfg.n_layers : 0;
    d->ctx_mem = aligned_alloc(64, d->ctx_bytes * (size_t)d->n_slots);
    if (!d->slots || !d->tried || !d->ctx_mem) {
        st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
        goto out_free;
    }
    for (int i = 0; i < d->n_slots; i++) {
        d->slots[i].d = d;
        if (!(d->slots[i].pages = malloc((size_t)max_pages * sizeof(int32_t))) ||
            !(d->slots[i].land = malloc((size_t)max_pages * sizeof(int32_t)))) {
            st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
            goto out_free;
        }
    }
    d->copy_src = malloc(TDM_XFER_COPY_MAX_PAGES * sizeof *d->copy_src);
    d->copy_dst = malloc(TDM_XFER_COPY_MAX_PAGES * sizeof *d->copy_dst);
    if (!d->copy_src || !d->copy_dst) {
        st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
        goto out_free;
    }
    tdm_kv_pool_t *rank_kv[TDM_DISAGG_MAX_RANKS] = {0};
    for (int r = 0; r < d->n_ranks && r < TDM_DISAGG_MAX_RANKS; r++)
        rank_kv[r] = tdm_engine_rank_kv(e, r);
    struct disagg_endpoint_opts eopts = {.xfer = &o->xfer,
                                         .max_ctx = eo->max_ctx,
                                         .rank_kv = rank_kv,
                                         .n_ranks = d->n_ranks,
                                         .page_size = d->page_size,
                                         .kv = d->kv,
                                         .ctx_mem = d->ctx_mem,
                                         .ctx_bytes = d->ctx_bytes * (size_t)d->n_slots,
                                         .head = o->head,
                                         .landing = true,
                                         .on_msg = on_msg,
                                         .on_peer = on_peer,
                                         .ctx = d};
    if ((st = tdm_disagg_endpoint_open(&d->ep, &eopts)) != TDM_OK) goto out_free;
    for (; d->n_slots > (int)d->ep.caps.max_slot + 1;
         d->n_slots--) { /* the immediates name fewer */
        free(d->slots[d->n_slots - 1].pages);
        free(d->slots[d->n_slots - 1].land);
    }
    /* landing pages for every peer: forced, or the pool cannot be written by any */
    d->stage_all =
        d->ep.land.on && (o->xfer.staging == TDM_DISAGG_STAGING_ALWAYS || !d->ep.kv_direct);
    if (d->ep.kv_direct) d->ep.kv_tp.iface->mr_remote(d->ep.kv_tp.t, &d->ep.kv_reg, &d->kv_rmem);
    d->rank_rmem[0] = d->kv_rmem;
    d->rank_layer_bytes[0] = d->ep.kv.layer_bytes;
    for (int r = 1; r < d->n_ranks; r++) { /* host pools by the fabric (the endpoint checked) */
        d->ep.kv_tp.iface->mr_remote(d->ep.kv_tp.t, &d->ep.rank_reg[r], &d->rank_rmem[r]);
        d->rank_layer_bytes[r] = d->ep.rank_kv[r].layer_bytes;
    }
    d->ep.tp.iface->mr_remote(d->ep.tp.t, &d->ep.ctx_reg, &d->ctx_rmem);
    if (d->ep.head.on && d->ep.kv_direct)
        d->ep.kv_tp.iface->mr_remote(d->ep.kv_tp.t, &d->ep.head_reg, &d->head_rmem);

    for (int i = 0; i < o->n_peers; i++) {
        struct dpeer *p = &d->peers[d->n_peers];
        snprintf(p->addr, sizeof p->addr, "%s", o->peers[i]);
        p->src_ranks = 1;
        p->backoff_ms = d->o.revive_ms;
        p->staged = d->stage_all;
        p->next_try_ns = (int64_t)tdm_now_ns() + (int64_t)p->backoff_ms * 1000000;
        if (o->peer_files[i] && !(p->file = strdup(o->peer_files[i]))) {
            st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
            goto out_ep;
        }
        if (!p->addr[0] && p->file) { /* not readable yet: the reviver reads it again */
            p->xid = UINT32_MAX;
            p->next_try_ns = (int64_t)tdm_now_ns();
            d->n_peers++;
            TDM_WARN("disagg: prefill peer %d (%s) has no address yet; it is asked again until "
                     "it has one",
                     i, p->file);
            continue;
        }
        if ((st = tdm_xfer_peer_add(d->ep.x, p->addr, &p->xid)) != TDM_OK) {
            free(p->file);
            p->file = NULL;
            goto out_ep;
        }
        d->n_peers++;
        if (tdm_xfer_peer_wait(d->ep.x, p->xid, 5000) == TDM_OK) {
            pthread_mutex_lock(&d->mu);
            p->alive = true;
            pthread_mutex_unlock(&d->mu);
        } else {
            TDM_WARN("disagg: prefill peer %d (%s) does not answer yet; requests go elsewhere "
                     "until it does",
                     i, p->addr);
        }
    }
    pthread_cond_init(&d->rcv, NULL);
    if (pthread_create(&d->reviver, NULL, reviver_main, d)) {
        st = tdm_err_set(TDM_EINTERNAL, "disagg: cannot start the peer reviver");
        pthread_cond_destroy(&d->rcv);
        goto out_ep;
    }
    d->reviving = true;
    static const struct tdm_kv_connector_i conn = {.admit = admit, .finished = finished};
    tdm_sched_set_connector(s, &conn, d);
    *out = d;
    return TDM_OK;

out_ep:
    for (int i = 0; i < d->n_peers; i++)
        free(d->peers[i].file);
    tdm_disagg_endpoint_stop(&d->ep);
    tdm_disagg_endpoint_release(&d->ep);
out_free:
    for (int i = 0; d->slots && i < d->n_slots; i++) {
        free(d->slots[i].pages);
        free(d->slots[i].land);
    }
    free(d->slots);
    free(d->copy_src);
    free(d->copy_dst);
    free(d->tried);
    free(d->ctx_mem);
    pthread_mutex_destroy(&d->mu);
    free(d);
    return st;
}

tdm_status tdm_disagg_decode_addr(const tdm_disagg_decode_t *d, char *buf, size_t cap)
{
    return tdm_xfer_addr(d->ep.x, buf, cap);
}

void tdm_disagg_decode_destroy(tdm_disagg_decode_t *d)
{
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_broadcast(&d->rcv);
    pthread_mutex_unlock(&d->mu);
    if (d->reviving) pthread_join(d->reviver, NULL);
    pthread_cond_destroy(&d->rcv);
    for (int i = 0; i < d->n_peers; i++)
        free(d->peers[i].file);
    /* the scheduler is stopped: nothing pending can land any more */
    tdm_disagg_endpoint_stop(&d->ep); /* fires armed counters with TDM_ECANCELED */
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < d->n_slots; i++)
        if (d->slots[i].state == SLOT_FENCED) unfence_locked(d, &d->slots[i]);
    pthread_mutex_unlock(&d->mu);
    tdm_disagg_endpoint_release(&d->ep);
    for (int i = 0; i < d->n_slots; i++) {
        free(d->slots[i].pages);
        free(d->slots[i].land);
    }
    free(d->slots);
    free(d->copy_src);
    free(d->copy_dst);
    free(d->tried);
    free(d->ctx_mem);
    pthread_mutex_destroy(&d->mu);
    free(d);
}

char *tdm_disagg_decode_metrics(void *ctx)
{
    struct tdm_disagg_decode *d = ctx;
    struct tdm_sbuf b = {0};
    char lab[64];
    pthread_mutex_lock(&d->mu);
    tdm_hist_prom(&b, "tandem_disagg_kv_landed_seconds",
                  "Remote prefill: from sending the request to the last immediate landing.",
                  &d->landed_s, NULL);
    tdm_prom_scalar(&b, "tandem_disagg_remote_prefills_total", "counter",
                    "Remote prefills whose KV landed.", NULL, (double)d->remote_ok);
    tdm_prom_scalar(&b, "tandem_disagg_head_kv_landed_total", "counter",
                    "Remote prefills that also brought the speculation head's KV and feature "
                    "(those requests draft from their first step).",
                    NULL, (double)d->head_ok);
    tdm_prom_scalar(&b, "tandem_disagg_cached_prefix_requests_total", "counter",
                    "Remote prefills asked for the part past a prefix this node had cached.", NULL,
                    (double)d->cached_requests);
    tdm_prom_scalar(&b, "tandem_disagg_cached_prefix_tokens_total", "counter",
                    "Prompt tokens whose KV a remote prefill did not send: this node's cached "
                    "prefixes.",
                    NULL, (double)d->cached_tokens);
    tdm_prom_scalar(&b, "tandem_disagg_local_fallbacks_total", "counter",
                    "Requests prefilled here after remote attempts failed.", NULL,
                    (double)d->local_fallbacks);
    tdm_prom_family(&b, "tandem_disagg_transfer_errors_total", "counter",
                    "Failed remote prefills, by kind.");
    for (int i = 0; i < N_ERR; i++) {
        snprintf(lab, sizeof lab, "kind=\"%s\"", err_names[i]);
        tdm_prom_sample(&b, "tandem_disagg_transfer_errors_total", lab, (double)d->errors[i]);
    }
    tdm_prom_scalar(&b, "tandem_disagg_fenced_pages", "gauge",
                    "KV pages held until a prefiller confirms a cancel.", NULL,
                    (double)d->fenced_now);
    if (d->ep.land.on) {
        tdm_prom_scalar(&b, "tandem_disagg_landing_pages", "gauge",
                        "Host landing pages (host staging) that prefill nodes of other hosts "
                        "write into.",
                        NULL, (double)d->ep.land.n_pages);
        tdm_prom_scalar(&b, "tandem_disagg_landing_pages_used", "gauge",
                        "Landing pages lent to remote prefills, or held by fenced ones.", NULL,
                        (double)(d->ep.land.n_pages - d->ep.land.n_free));
        tdm_prom_scalar(&b, "tandem_disagg_staged_prefills_total", "counter",
                        "Remote prefills whose KV came through landing pages.", NULL,
                        (double)d->staged_ok);
        tdm_prom_scalar(&b, "tandem_disagg_landing_full_total", "counter",
                        "Requests prefilled here because every landing page was lent.", NULL,
                        (double)d->landing_full);
        tdm_prom_family(&b, "tandem_disagg_peer_staged", "gauge",
                        "Whether a prefill peer writes into landing pages (1) or the pool itself.");
        for (int i = 0; i < d->n_peers; i++) {
            snprintf(lab, sizeof lab, "peer=\"%d\"", i);
            tdm_prom_sample(&b, "tandem_disagg_peer_staged", lab, d->peers[i].staged ? 1 : 0);
        }
    }
    tdm_prom_family(&b, "tandem_disagg_named_prefill_total", "counter",
                    "Requests that named their prefill node (x-prefiller-host-port), by what came "
                    "of it.");
    const char *named[] = {"used", "down", "unknown", "added"};
    const uint64_t named_n[] = {d->named_used, d->named_down, d->named_unknown, d->named_added};
    for (int i = 0; i < 4; i++) {
        snprintf(lab, sizeof lab, "result=\"%s\"", named[i]);
        tdm_prom_sample(&b, "tandem_disagg_named_prefill_total", lab, (double)named_n[i]);
    }
    tdm_prom_family(&b, "tandem_disagg_peer_outstanding_tokens", "gauge",
                    "Prefill tokens sent to a peer and not landed (its queue depth seen from "
                    "here).");
    for (int i = 0; i < d->n_peers; i++) {
        snprintf(lab, sizeof lab, "peer=\"%d\"", i);
        tdm_prom_sample(&b, "tandem_disagg_peer_outstanding_tokens", lab,
                        (double)d->peers[i].outstanding_tokens);
    }
    tdm_prom_family(&b, "tandem_disagg_peer_up", "gauge", "Whether a prefill peer is alive.");
    for (int i = 0; i < d->n_peers; i++) {
        snprintf(lab, sizeof lab, "peer=\"%d\"", i);
        tdm_prom_sample(&b, "tandem_disagg_peer_up", lab, d->peers[i].alive ? 1 : 0);
    }
    if (d->head_layers) {
        tdm_prom_family(&b, "tandem_disagg_peer_head", "gauge",
                        "Whether a prefill peer is asked for the speculation head's KV (0: it "
                        "refused: another head, or none).");
        for (int i = 0; i < d->n_peers; i++) {
            snprintf(lab, sizeof lab, "peer=\"%d\"", i);
            tdm_prom_sample(&b, "tandem_disagg_peer_head", lab, d->peers[i].head_refused ? 0 : 1);
        }
    }
    pthread_mutex_unlock(&d->mu);
    tdm_disagg_endpoint_metrics(&d->ep, &b);
    return tdm_sbuf_take(&b);
}
