/*
 * The router (include/tandem/server.h, tdm_router_*): the public OpenAI endpoint over several
 * `tandem serve` nodes. It parses nothing of the API itself: each generation request's body goes
 * to one backend unchanged, and the backend's status, Content-Type and body come back byte for
 * byte, SSE events as they arrive. Only routing, authentication, the body cap and the router's
 * own errors (OpenAI-style JSON) are decided here.
 *
 * Choosing a backend: the healthy backend with the fewest requests the router has in flight to
 * it; ties go round robin (a cursor that moves past each pick). In-flight counts cover a request
 * from the pick until its response is fully relayed or abandoned. With --route prefix the cost
 * is in_flight + prefix_weight * (the share of the prompt's blocks the backend was not sent
 * before + half its share of all the blocks sent: server/affinity.c), so a prompt follows its
 * prefix to the backend that has probably cached it, unless that one is busier by more than
 * about prefix_weight requests, and a new prefix goes where less is cached. With --route kv
 * the same cost reads what each backend has really cached: the prompt is tokenized as the
 * backends do (the model's tokenizer and chat template, tdm_api_prompt_ids) and its whole
 * blocks are matched against an index fed by the backends' KV cache events (server/kv_sub.c,
 * kv_index.c), a block held, in flight there, or landed from a request that ended less than
 * TDM_KV_LANDING_MS ago whose events are not in, worth 1; one only sent there before (evicted
 * since, or its event later still) worth half, so a prefix stays where it went after an
 * eviction rather than moving by load; a body the router cannot make a prompt of goes least loaded.
 *
 * Health: each backend is up or down.
 *
 *     down --(GET /health answers 200 in time)--> up
 *     up --(GET /health fails: refused, timed out, not 200)--> down
 *     up --(a forwarded request hits a connection error)--> down
 *
 *   transition        performed by
 *   -> up / -> down   health_check_all() on the health thread, every health_interval_ms
 *                     (also once in tdm_router_start, so a fresh router routes at once)
 *   -> down           mark_down() on an event-loop thread (fwd_step() or relay_read())
 *
 * Failures: a connection error (refused, reset, cut short or garbled) before the backend's
 * response head arrives leaves nothing sent to the client, so the request is retried once on
 * another backend. After the head the router is committed: an error mid-body cuts the client's
 * response. No backend picked: 503; none could answer: 502; a backend silent past the timeout:
 * 504 (not retried: it may still be working on the request, and it is not marked down, since a
 * long generation is not a fault; a hung backend fails its health checks instead).
 *
 * Cancellation: while a connection waits on its backend the pump also polls its client's socket
 * for a hang-up (POLLRDHUP). A client that leaves makes the router close the backend connection,
 * which the backend sees as its own client leaving: it cancels the request and frees its KV pages.
 *
 * Threading: libmicrohttpd's event loop on http_threads threads (front.h). No handler waits: a
 * forward connects and sends (bounded by connect_timeout_ms), then looks for the response head
 * and relays body bytes only as far as they have come; when the backend has nothing new the
 * connection parks in the pump (pump.h), one thread polling every parked backend socket, which
 * resumes it when bytes come, the client hangs up or a deadline passes. So 1,000 relayed streams
 * cost sockets and memory, not threads. One health thread probes the backends in turn. Backend
 * state is atomics, plus a mutex so that a pick and its in-flight increment are one step.
 * tdm_router_stop resumes every parked connection, then stops the daemon and the threads.
 *
 * Bounds: bodies over max_body get 413; connections are capped by max_connections; every
 * backend wait has a deadline (connect_timeout_ms, then timeout_s for the head and between body
 * pieces); response heads over 64 KiB are refused by the client (server/httpc.h).
 */
#include <errno.h>
#include <microhttpd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include "server/httpc.h"
#include "server/front.h"
#include "server/reply.h"
#include "tandem/server.h"
#include "server/pump.h"
#include "server/server_int.h"

#define RELAY_BLOCK_BYTES   16384
#define TDM_ROUTER_MAX_KEYS 512 /* prompt blocks a prefix pick looks at (64 KiB of text) */
#define MAX_BEARER_BYTES    512

/* Why a forward failed, for tandem_router_proxy_errors_total{kind}. */
enum proxy_err {
    PE_CONNECT,
    PE_SEND,
    PE_TRUNCATED,
    PE_TIMEOUT,
    PE_PROTOCOL,
    PE_NOMEM,
    PE_CLIENT_GONE,
    PE_NO_BACKEND,
    PE_COUNT
};
static const char *const proxy_err_name[PE_COUNT] = {
    "connect",  "send",  "truncated",         "timeout",
    "protocol", "nomem", "client_disconnect", "no_healthy_backend"};

struct backend {
    struct tdm_bh_target target;
    char *url;   /* as given, trailing slashes dropped: logs and metric labels */
    char *label; /* url escaped for a Prometheus label value */
    atomic_bool up;
    _Atomic int in_flight;        /* changed under tdm_router.mu */
    _Atomic uint64_t by_class[6]; /* responses relayed, by status class */
    _Atomic uint64_t health_ok, health_fail;
};

struct tdm_router {
    struct tdm_front *front;
    struct backend *b;
    int n_backends;
    pthread_mutex_t mu; /* pick + in-flight increment; rr */
    int rr;             /* round-robin cursor for ties */
    char *api_key, *backend_api_key;
    size_t max_body;
    uint64_t connect_timeout_ms, timeout_ns, health_interval_ms, health_timeout_ms;
    atomic_bool stopping, draining;
    _Atomic uint64_t own_by_class[6]; /* the router's own answers (no backend) */
    _Atomic uint64_t errors[PE_COUNT];
    _Atomic uint64_t retries;
    pthread_mutex_t health_mu;
    pthread_cond_t health_cv; /* signalled on stop */
    pthread_t health_thread;
    bool health_running;
    int port;
    struct tdm_pump *pump; /* waits on backends for the suspended connections */
    /* --route prefix: where prompts' blocks were sent (under mu), and how the picks matched */
    struct tdm_affinity *aff;
    /* --route kv: the backends' caches from their KV events, and the tokenizer that makes a
     * request's prompt as they would */
    struct tdm_kv_sub *kv;
    struct tdm_affinity *sent; /* where prompts' token blocks were sent (under mu) */
    struct api_ctx api;
    double prefix_weight;
    _Atomic uint64_t prefix_matched, prefix_missed; /* blocks of the chosen backends */
};

/* Per client request: the body being received. */
/* Per relayed response: owns the backend connection and one in-flight count. */
/* The end of an OpenAI stream: once it has been relayed, a client that closes is done, not
 * gone (clients close on it, before the backend's chunked terminator has come through). */
#define SSE_DONE     "data: [DONE]\n\n"
#define SSE_DONE_LEN (sizeof SSE_DONE - 1)

struct relay {
    struct tdm_router *r;
    int be;
    tdm_bh_conn_t *bc;
    struct tdm_park *park; /* where the connection waits for the backend's next bytes */
    struct MHD_Connection *park_conn;
    uint64_t idle_deadline_ns;
    char tail[SSE_DONE_LEN]; /* the last bytes relayed, oldest first */
    size_t n_tail;
    /* the backend's body: its length (-1: to its end), what has come of it; once it has all
     * come the request is no longer in flight there (released), although the client may not
     * have read the last bytes yet: its next request must not see this one as load */
    int64_t len;
    uint64_t got;
    bool released;
    struct prompt_blocks *pb; /* the request's, its fwd's: read in relay_read only (the fwd
                               * outlives the reads, not the relay) */
};

/* Keeps the last SSE_DONE_LEN bytes relayed. */
static void remember_tail(struct relay *rl, const char *buf, size_t n)
{
    if (n >= SSE_DONE_LEN) {
        memcpy(rl->tail, buf + n - SSE_DONE_LEN, SSE_DONE_LEN);
        rl->n_tail = SSE_DONE_LEN;
        return;
    }
    size_t keep = TDM_MIN(rl->n_tail, SSE_DONE_LEN - n);
    memmove(rl->tail, rl->tail + rl->n_tail - keep, keep);
    memcpy(rl->tail + keep, buf, n);
    rl->n_tail = keep + n;
}

static bool stream_done(const struct relay *rl)
{
    return rl->n_tail == SSE_DONE_LEN && !memcmp(rl->tail, SSE_DONE, SSE_DONE_LEN);
}

/* ---- backend state ---- */

/* What a pick knows of a request's prompt: its block keys (--route prefix), or how many
 * leading blocks each backend holds by its KV events and its share of what they hold (--route
 * kv). n_keys 0: least loaded. */
struct prompt_blocks {
    uint64_t keys[TDM_ROUTER_MAX_KEYS];
    int n_keys;
    int matched[TDM_ROUTER_MAX_BACKENDS];
    double share[TDM_ROUTER_MAX_BACKENDS];
    int pended; /* --route kv: the backend its keys are in flight to (-1: none) */
};

/* --route kv: the request's blocks are no longer in flight to the backend it was sent to. */
static void unpend(struct tdm_router *r, struct prompt_blocks *pb)
{
    if (r->kv && pb->pended >= 0) tdm_kv_sub_pend(r->kv, pb->pended, pb->keys, pb->n_keys, -1);
    pb->pended = -1;
}

/* The backend for a request with these prompt blocks. */
static int pick(struct tdm_router *r, int exclude, struct prompt_blocks *pb)
{
    const int n_keys = pb->n_keys;
    pthread_mutex_lock(&r->mu);
    if (r->aff && n_keys) {
        tdm_affinity_match(r->aff, pb->keys, n_keys, r->n_backends, pb->matched);
        for (int i = 0; i < r->n_backends; i++)
            pb->share[i] = tdm_affinity_share(r->aff, i, r->n_backends);
    }
    /* what a block is worth: 1 where held (for kv, by the events, in flight there or just
     * landed); for kv, half where only sent before (evicted since, or its event later than
     * TDM_KV_LANDING_MS): a prefix stays with its backend rather than going by load */
    double worth[TDM_ROUTER_MAX_BACKENDS];
    if (r->kv && n_keys) {
        int sent[TDM_ROUTER_MAX_BACKENDS];
        tdm_kv_sub_match(r->kv, pb->keys, n_keys, r->n_backends, pb->matched, pb->share);
        tdm_affinity_match(r->sent, pb->keys, n_keys, r->n_backends, sent);
        for (int i = 0; i < r->n_backends; i++)
            worth[i] = pb->matched[i] + 0.5 * TDM_MAX(sent[i] - pb->matched[i], 0);
    } else {
        for (int i = 0; i < r->n_backends; i++)
            worth[i] = n_keys ? pb->matched[i] : 0;
    }
    int best = -1;
    double best_cost = 0;
    for (int k = 0; k < r->n_backends; k++) {
        int i = (r->rr + k) % r->n_backends;
        if (i == exclude || !atomic_load(&r->b[i].up)) continue;
        double cost = atomic_load(&r->b[i].in_flight);
        if (n_keys) /* the prompt's unmatched share, and what the backend holds */
            cost += r->prefix_weight * ((n_keys - worth[i]) / n_keys + 0.5 * pb->share[i]);
        if (best < 0 || cost < best_cost) best = i, best_cost = cost;
    }
    if (best >= 0) {
        atomic_fetch_add(&r->b[best].in_flight, 1);
        r->rr = (best + 1) % r->n_backends;
        if (n_keys) {
            if (r->aff) tdm_affinity_insert(r->aff, best, pb->keys, n_keys);
            if (r->sent) tdm_affinity_insert(r->sent, best, pb->keys, n_keys);
            if (r->kv) { /* in flight there until it ends (unpend) */
                tdm_kv_sub_pend(r->kv, best, pb->keys, n_keys, +1);
                pb->pended = best;
            }
            atomic_fetch_add(&r->prefix_matched, (uint64_t)pb->matched[best]);
            atomic_fetch_add(&r->prefix_missed, (uint64_t)(n_keys - pb->matched[best]));
        }
    }
    pthread_mutex_unlock(&r->mu);
    return best;
}

static void release(struct tdm_router *r, int be)
{
    pthread_mutex_lock(&r->mu);
    atomic_fetch_sub(&r->b[be].in_flight, 1);
    pthread_mutex_unlock(&r->mu);
}

static void mark_down(struct tdm_router *r, int be, const char *why)
{
    if (atomic_exchange(&r->b[be].up, false)) {
        TDM_WARN("router: backend %s is down (%s)", r->b[be].url, why);
        if (r->aff || r->sent) { /* what it had cached is not to be counted on when back */
            pthread_mutex_lock(&r->mu);
            if (r->aff) tdm_affinity_forget(r->aff, be);
            if (r->sent) tdm_affinity_forget(r->sent, be);
            pthread_mutex_unlock(&r->mu);
        }
    }
}

static bool is_connection_error(enum tdm_bh_fail f)
{
    return f == TDM_BH_CONNECT || f == TDM_BH_SEND || f == TDM_BH_TRUNCATED || f == TDM_BH_PROTOCOL;
}

static enum proxy_err err_kind(enum tdm_bh_fail f)
{
    switch (f) {
    case TDM_BH_CONNECT:
        return PE_CONNECT;
    case TDM_BH_SEND:
        return PE_SEND;
    case TDM_BH_TRUNCATED:
        return PE_TRUNCATED;
    case TDM_BH_TIMEOUT:
        return PE_TIMEOUT;
    case TDM_BH_PROTOCOL:
        return PE_PROTOCOL;
    default:
        return PE_NOMEM; /* NOMEM; ABORTED cannot happen in pull mode */
    }
}

static void count_error(struct tdm_router *r, enum proxy_err k)
{
    atomic_fetch_add(&r->errors[k], 1);
}

/* ---- health checks ---- */

static bool health_on_head(void *ctx, int status, const char *content_type)
{
    *(int *)ctx = status;
    return true;
}

static void health_check_all(struct tdm_router *r, bool first)
{
    for (int i = 0; i < r->n_backends && !atomic_load(&r->stopping); i++) {
        struct backend *b = &r->b[i];
        int status = 0;
        struct tdm_bh_request rq = {.method = "GET",
                                    .path = "/health",
                                    .deadline_ns = tdm_now_ns() + r->health_timeout_ms * 1000000ull,
                                    .connect_timeout_ms = r->health_timeout_ms};
        struct tdm_bh_handler h = {health_on_head, NULL, &status};
        enum tdm_bh_fail f = tdm_bh_request(&b->target, &rq, &h);
        bool ok = f == TDM_BH_OK && status == 200;
        atomic_fetch_add(ok ? &b->health_ok : &b->health_fail, 1);
        if (ok) {
            if (!atomic_exchange(&b->up, true)) TDM_INFO("router: backend %s is up", b->url);
        } else {
            char why[300];
            if (f != TDM_BH_OK)
                snprintf(why, sizeof why, "health check: %s", tdm_err_msg());
            else
                snprintf(why, sizeof why, "health check: status %d", status);
            mark_down(r, i, why);
            if (first) TDM_WARN("router: backend %s is down at start (%s)", b->url, why);
        }
    }
}

static void *health_main(void *arg)
{
    struct tdm_router *r = arg;
    for (;;) {
        struct timespec next = tdm_deadline_ms(CLOCK_MONOTONIC, (int64_t)r->health_interval_ms);
        pthread_mutex_lock(&r->health_mu);
        while (!atomic_load(&r->stopping))
            if (pthread_cond_timedwait(&r->health_cv, &r->health_mu, &next) == ETIMEDOUT) break;
        pthread_mutex_unlock(&r->health_mu);
        if (atomic_load(&r->stopping)) return NULL;
        health_check_all(r, false);
    }
}

/* ---- relaying a response ---- */

/* The backend is done with the request: no longer in flight there, its blocks no longer
 * pending (landed: kv_index.c). */
static void relay_end(struct relay *rl)
{
    if (rl->released) return;
    rl->released = true;
    release(rl->r, rl->be);
    if (rl->pb) unpend(rl->r, rl->pb);
}

static void relay_free(void *cls)
{
    struct relay *rl = cls;
    tdm_bh_close(rl->bc); /* the backend sees its client leave if it was not done */
    rl->pb = NULL;        /* its fwd may be gone: fwd_free unpends what is left */
    relay_end(rl);
    tdm_park_free(rl->park);
    free(rl);
}

/* The response body's reader, on an event-loop thread: what the backend has sent so far, or
 * (nothing yet) the connection parks until the backend sends more, and this is called again. */
static ssize_t relay_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct relay *rl = cls;
    struct tdm_router *r = rl->r;
    (void)pos;
    if (max == 0) return 0;
    size_t cap = TDM_MIN(max, (size_t)RELAY_BLOCK_BYTES);
    for (;;) {
        size_t n = 0;
        enum tdm_bh_fail f = tdm_bh_read(rl->bc, buf, cap, 0, &n); /* what is there now */
        if (f == TDM_BH_OK) {
            if (n == 0) {
                relay_end(rl);
                return MHD_CONTENT_READER_END_OF_STREAM;
            }
            rl->idle_deadline_ns = tdm_now_ns() + r->timeout_ns;
            remember_tail(rl, buf, n);
            rl->got += n;
            if (rl->len >= 0 && rl->got >= (uint64_t)rl->len) relay_end(rl);
            return (ssize_t)n;
        }
        if (f != TDM_BH_TIMEOUT) {
            count_error(r, err_kind(f));
            if (is_connection_error(f)) mark_down(r, rl->be, tdm_err_msg());
            TDM_WARN("router: %s: response cut short: %s", r->b[rl->be].url, tdm_err_msg());
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (atomic_load(&r->stopping)) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (tdm_park_gone(rl->park) || tdm_front_client_gone(rl->park_conn)) {
            /* after the stream's last event it is a normal close, not a client leaving */
            if (!stream_done(rl)) count_error(r, PE_CLIENT_GONE);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (tdm_now_ns() >= rl->idle_deadline_ns) {
            count_error(r, PE_TIMEOUT);
            TDM_WARN("router: %s: no response bytes for %llu s; cutting the response",
                     r->b[rl->be].url, (unsigned long long)(r->timeout_ns / 1000000000ull));
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (tdm_park_wait(rl->park, tdm_bh_fd(rl->bc), rl->idle_deadline_ns))
            return 0; /* suspended: called again when the backend has more */
    }
}

/* Queues the backend's response (head received) for relaying. Takes bc and the in-flight count
 * of `be` in every case. */
static enum MHD_Result relay_start(struct tdm_router *r, struct MHD_Connection *c, int be,
                                   tdm_bh_conn_t *bc, struct prompt_blocks *pb)
{
    struct relay *rl = calloc(1, sizeof *rl);
    struct tdm_park *park = rl ? tdm_park_new(r->pump, c) : NULL;
    if (!park) {
        free(rl);
        tdm_bh_close(bc);
        release(r, be);
        count_error(r, PE_NOMEM);
        return tdm_reply_errf(c, r->own_by_class, 500, "out of memory");
    }
    *rl = (struct relay){.r = r,
                         .be = be,
                         .bc = bc,
                         .park = park,
                         .park_conn = c,
                         .idle_deadline_ns = tdm_now_ns() + r->timeout_ns,
                         .pb = pb};
    int status = tdm_bh_status(bc);
    int64_t len = tdm_bh_content_length(bc);
    rl->len = len;
    const char *ctype = tdm_bh_content_type(bc);
    struct MHD_Response *resp = MHD_create_response_from_callback(
        len >= 0 ? (uint64_t)len : MHD_SIZE_UNKNOWN, RELAY_BLOCK_BYTES, relay_read, rl, relay_free);
    if (!resp) {
        relay_free(rl);
        return MHD_NO;
    }
    if (ctype[0]) MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (!strncasecmp(ctype, "text/event-stream", 17)) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    }
    tdm_front_cors(c, resp);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, resp);
    MHD_destroy_response(resp);
    atomic_fetch_add(&r->b[be].by_class[TDM_MIN(status / 100, 5)], 1);
    return ret;
}

/* ---- forwarding ---- */

/* The bearer token to send to backends: --backend-api-key; without it, the client's own token
 * when the router checks none itself (a transparent proxy); else none. */
static const char *backend_bearer(struct tdm_router *r, struct MHD_Connection *c)
{
    if (r->backend_api_key) return r->backend_api_key;
    if (r->api_key) return NULL;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7) || strlen(h + 7) > MAX_BEARER_BYTES ||
        strpbrk(h + 7, "\r\n"))
        return NULL;
    return h + 7;
}

/* A forwarded request waiting for its backend's response head: the attempt in progress (at
 * most two, the second on another backend after a connection error) and the last failure.
 * Lives in the connection's tdm_front_body.app until the request ends. */
struct fwd {
    struct tdm_router *r;
    struct tdm_park *park;
    struct tdm_bh_request rq; /* borrows the connection's headers and body */
    int attempts, tried, be;
    struct prompt_blocks pb; /* --route prefix or kv */
    tdm_bh_conn_t *bc;
    enum tdm_bh_fail last;
    char last_msg[400];
};

static void fwd_free(void *app)
{
    struct fwd *w = app;
    unpend(w->r, &w->pb);
    if (w->bc) {
        tdm_bh_close(w->bc);
        release(w->r, w->be);
    }
    tdm_park_free(w->park);
    free(w);
}

/* Ends the attempt in progress with failure f (its backend marked down for a connection
 * error); true when another backend may be tried. */
static bool fwd_failed(struct fwd *w, enum tdm_bh_fail f, const char *msg)
{
    struct tdm_router *r = w->r;
    snprintf(w->last_msg, sizeof w->last_msg, "%s: %s", r->b[w->be].url, msg);
    tdm_bh_close(w->bc);
    w->bc = NULL;
    release(r, w->be);
    unpend(r, &w->pb);
    count_error(r, err_kind(f));
    w->last = f;
    if (!is_connection_error(f)) return false;
    mark_down(r, w->be, w->last_msg);
    w->tried = w->be;
    return true;
}

/* Runs the forward as far as it can without waiting: opens an attempt, and relays once the head
 * is in; parks the connection while the backend has not answered (the pump resumes it, and
 * the handler calls this again). */
static enum MHD_Result fwd_step(struct tdm_router *r, struct MHD_Connection *c, struct fwd *w)
{
    for (;;) {
        if (!w->bc) {
            int be = w->attempts < 2 ? pick(r, w->tried, &w->pb) : -1;
            if (be < 0) break;
            if (w->attempts++ > 0) atomic_fetch_add(&r->retries, 1);
            w->be = be;
            w->rq.deadline_ns = tdm_now_ns() + r->timeout_ns;
            /* connect and send: a loopback or LAN connect, bounded by connect_timeout_ms */
            enum tdm_bh_fail f = tdm_bh_open(&r->b[be].target, &w->rq, &w->bc);
            if (f != TDM_BH_OK) {
                w->bc = NULL;
                if (fwd_failed(w, f, tdm_err_msg())) continue;
                break;
            }
        }
        enum tdm_bh_fail f = tdm_bh_wait_head(w->bc, 0); /* what is there now */
        if (f == TDM_BH_OK) {
            tdm_bh_conn_t *bc = w->bc;
            w->bc = NULL; /* the relay takes it, and the in-flight count */
            return relay_start(r, c, w->be, bc, &w->pb);
        }
        if (f != TDM_BH_TIMEOUT) {
            if (fwd_failed(w, f, tdm_err_msg())) continue;
            break;
        }
        if (tdm_park_gone(w->park) || tdm_front_client_gone(c)) {
            count_error(r, PE_CLIENT_GONE);
            return MHD_NO; /* fwd_free closes the backend connection */
        }
        if (atomic_load(&r->stopping))
            return tdm_reply_errf(c, r->own_by_class, 503, "the router is shutting down");
        if (tdm_now_ns() >= w->rq.deadline_ns) {
            fwd_failed(w, TDM_BH_TIMEOUT, "no response before the timeout");
            break;
        }
        if (tdm_park_wait(w->park, tdm_bh_fd(w->bc), w->rq.deadline_ns)) return MHD_YES;
    }
    switch (w->last) {
    case TDM_BH_OK:
        count_error(r, PE_NO_BACKEND);
        return tdm_reply_errf(c, r->own_by_class, 503, "no healthy backend (0 of %d up)",
                              r->n_backends);
    case TDM_BH_TIMEOUT:
        return tdm_reply_errf(c, r->own_by_class, 504, "the backend did not answer in time (%s)",
                              w->last_msg);
    case TDM_BH_NOMEM:
        return tdm_reply_errf(c, r->own_by_class, 500, "out of memory");
    default:
        return tdm_reply_errf(c, r->own_by_class, 502, "no backend could answer (%s)", w->last_msg);
    }
}

static enum MHD_Result forward(struct tdm_router *r, struct MHD_Connection *c, const char *method,
                               const char *url, struct tdm_front_body *cc)
{
    if (atomic_load(&r->draining))
        return tdm_reply_errf(c, r->own_by_class, 503, "the router is shutting down");
    struct fwd *w = calloc(1, sizeof *w);
    if (w && !(w->park = tdm_park_new(r->pump, c))) {
        free(w);
        w = NULL;
    }
    if (!w) {
        count_error(r, PE_NOMEM);
        return tdm_reply_errf(c, r->own_by_class, 500, "out of memory");
    }
    bool post = !strcmp(method, "POST");
    *w = (struct fwd){.r = r,
                      .park = w->park,
                      .rq = {.method = method,
                             .path = url,
                             .bearer = backend_bearer(r, c),
                             .body = post ? (cc->body ? cc->body : "") : NULL,
                             .body_len = post ? cc->len : 0,
                             .connect_timeout_ms = r->connect_timeout_ms},
                      .tried = -1,
                      .pb = {.pended = -1}};
    if (r->aff && post && cc->body)
        w->pb.n_keys = tdm_affinity_keys(cc->body, cc->len, w->pb.keys, TDM_ROUTER_MAX_KEYS);
    bool chat = !strcmp(url, "/v1/chat/completions");
    if (r->kv && post && cc->body && (chat || !strcmp(url, "/v1/completions"))) {
        int32_t *ids = NULL;
        int n = 0; /* the prompt as the backends will run it (a body they refuse: least loaded) */
        if (tdm_api_prompt_ids(&r->api, chat, cc->body, cc->len, &ids, &n))
            w->pb.n_keys = tdm_kv_sub_keys(r->kv, ids, n, w->pb.keys, TDM_ROUTER_MAX_KEYS);
        free(ids);
    }
    cc->app = w;
    cc->app_free = fwd_free;
    return fwd_step(r, c, w);
}

/* ---- /health and /metrics ---- */

static int backends_up(struct tdm_router *r)
{
    int up = 0;
    for (int i = 0; i < r->n_backends; i++)
        up += atomic_load(&r->b[i].up);
    return up;
}

static char *metrics_text(struct tdm_router *r)
{
    struct tdm_sbuf b = {0};
    char lab[3200]; /* an escaped backend URL (host and path are bounded: httpc.h) and more */
    static const char *const cls[6] = {"", "1xx", "2xx", "3xx", "4xx", "5xx"};
    tdm_prom_family(&b, "tandem_router_requests_total", "counter",
                    "Responses sent to clients, by the backend that answered (none: the router "
                    "itself) and status class.");
    for (int i = -1; i < r->n_backends; i++)
        for (int k = 2; k <= 5; k++) {
            snprintf(lab, sizeof lab, "backend=\"%s\",class=\"%s\"", i < 0 ? "none" : r->b[i].label,
                     cls[k]);
            tdm_prom_sample(
                &b, "tandem_router_requests_total", lab,
                (double)atomic_load(i < 0 ? &r->own_by_class[k] : &r->b[i].by_class[k]));
        }
    tdm_prom_family(&b, "tandem_router_backend_up", "gauge",
                    "Whether the backend passes its health checks.");
    for (int i = 0; i < r->n_backends; i++) {
        snprintf(lab, sizeof lab, "backend=\"%s\"", r->b[i].label);
        tdm_prom_sample(&b, "tandem_router_backend_up", lab, atomic_load(&r->b[i].up) ? 1 : 0);
    }
    tdm_prom_family(&b, "tandem_router_backend_in_flight", "gauge",
                    "Requests the router has in flight to the backend.");
    for (int i = 0; i < r->n_backends; i++) {
        snprintf(lab, sizeof lab, "backend=\"%s\"", r->b[i].label);
        tdm_prom_sample(&b, "tandem_router_backend_in_flight", lab,
                        atomic_load(&r->b[i].in_flight));
    }
    tdm_prom_family(&b, "tandem_router_health_checks_total", "counter",
                    "Health checks, by backend and result.");
    for (int i = 0; i < r->n_backends; i++) {
        snprintf(lab, sizeof lab, "backend=\"%s\",result=\"ok\"", r->b[i].label);
        tdm_prom_sample(&b, "tandem_router_health_checks_total", lab,
                        (double)atomic_load(&r->b[i].health_ok));
        snprintf(lab, sizeof lab, "backend=\"%s\",result=\"fail\"", r->b[i].label);
        tdm_prom_sample(&b, "tandem_router_health_checks_total", lab,
                        (double)atomic_load(&r->b[i].health_fail));
    }
    tdm_prom_family(&b, "tandem_router_proxy_errors_total", "counter",
                    "Forwarding failures, by kind.");
    for (int k = 0; k < PE_COUNT; k++) {
        snprintf(lab, sizeof lab, "kind=\"%s\"", proxy_err_name[k]);
        tdm_prom_sample(&b, "tandem_router_proxy_errors_total", lab,
                        (double)atomic_load(&r->errors[k]));
    }
    tdm_prom_scalar(&b, "tandem_router_retries_total", "counter",
                    "Requests retried on another backend after a connection error.", NULL,
                    (double)atomic_load(&r->retries));
    if (r->kv) {
        const char *labels[TDM_ROUTER_MAX_BACKENDS];
        for (int i = 0; i < r->n_backends; i++)
            labels[i] = r->b[i].label;
        tdm_kv_sub_metrics(r->kv, &b, labels);
    }
    if (r->aff || r->kv) {
        tdm_prom_family(&b, "tandem_router_prefix_blocks_total", "counter",
                        "Prompt blocks of routed requests (--route prefix: sent before to the "
                        "chosen backend; --route kv: in its cache by its KV events): matched "
                        "or missed.");
        tdm_prom_sample(&b, "tandem_router_prefix_blocks_total", "result=\"matched\"",
                        (double)atomic_load(&r->prefix_matched));
        tdm_prom_sample(&b, "tandem_router_prefix_blocks_total", "result=\"missed\"",
                        (double)atomic_load(&r->prefix_missed));
    }
    return tdm_sbuf_take(&b);
}

/* ---- routing ---- */

static enum MHD_Result too_big(struct tdm_router *r, struct MHD_Connection *c)
{
    return tdm_reply_errf(c, r->own_by_class, 413,
                          "the request body is larger than the %zu-byte limit", r->max_body);
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls)
{
    struct tdm_router *r = cls;
    struct tdm_front_body *cc = NULL;
    switch (tdm_front_feed(c, con_cls, upload, upload_size, r->max_body, &cc)) {
    case TDM_FRONT_MORE:
        return MHD_YES;
    case TDM_FRONT_OOM:
        return MHD_NO;
    case TDM_FRONT_TOO_BIG:
        return too_big(r, c);
    case TDM_FRONT_DONE:
        break;
    }
    if (cc->app) return fwd_step(r, c, cc->app); /* resumed by the pump */
    const char *bad = tdm_front_framing_error(c, cc, version);
    if (bad) return tdm_reply_errf(c, r->own_by_class, 400, "%s", bad);

    const char *allow_headers;
    if (tdm_front_preflight(c, method, &allow_headers))
        return tdm_reply_preflight(c, r->own_by_class, allow_headers);
    bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) {
        if (!get) return tdm_reply_errf(c, r->own_by_class, 405, "use GET /health");
        int up = backends_up(r);
        bool draining = atomic_load(&r->draining), ok = up > 0 && !draining;
        char *body = NULL;
        if (asprintf(&body, "{\"status\":\"%s\",\"backends_up\":%d,\"backends\":%d}",
                     draining ? "draining"
                     : ok     ? "ok"
                              : "no healthy backend",
                     up, r->n_backends) < 0)
            body = NULL;
        return tdm_reply_send(c, r->own_by_class, ok ? 200 : 503, body, "application/json");
    }
    if (!strcmp(url, "/metrics")) {
        if (!get) return tdm_reply_errf(c, r->own_by_class, 405, "use GET /metrics");
        return tdm_reply_send(c, r->own_by_class, 200, metrics_text(r),
                              "text/plain; version=0.0.4; charset=utf-8");
    }
    /* a backend's routes: GET /v1/models, /v1/models/{model}; POST the rest */
    bool is_get = !strcmp(url, "/v1/models") || (!strncmp(url, "/v1/models/", 11) && url[11]);
    bool is_post = !strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions") ||
                   !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize");
    if (!is_get && !is_post)
        return tdm_reply_errf(c, r->own_by_class, 404, "no route for %s %.100s", method, url);
    if (!tdm_front_bearer_ok(c, r->api_key))
        return tdm_reply_errf(c, r->own_by_class, 401,
                              "missing or invalid API key (send Authorization: Bearer <key>)");
    if (is_get && !get) return tdm_reply_errf(c, r->own_by_class, 405, "use GET %.100s", url);
    if (is_post && !post) return tdm_reply_errf(c, r->own_by_class, 405, "use POST %.100s", url);
    return forward(r, c, method, url, cc);
}

/* ---- lifecycle ---- */

/* A Prometheus label value: backslash, double quote and newline escaped. */
static char *label_escape(const char *s)
{
    size_t n = strlen(s);
    char *o = malloc(2 * n + 1), *p = o;
    if (!o) return NULL;
    for (; *s; s++) {
        if (*s == '\\' || *s == '"' || *s == '\n') *p++ = '\\';
        *p++ = *s == '\n' ? 'n' : *s;
    }
    *p = '\0';
    return o;
}

static void router_free(struct tdm_router *r)
{
    for (int i = 0; r->b && i < r->n_backends; i++) {
        tdm_bh_target_free(&r->b[i].target);
        free(r->b[i].url);
        free(r->b[i].label);
    }
    free(r->b);
    free(r->api_key);
    free(r->backend_api_key);
    tdm_affinity_free(r->aff);
    tdm_affinity_free(r->sent);
    tdm_kv_sub_stop(r->kv);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->health_mu);
    pthread_cond_destroy(&r->health_cv);
    free(r);
}

tdm_status tdm_router_start(const struct tdm_router_opts *o, tdm_router_t **out)
{
    if (!o->backends || o->n_backends <= 0)
        return tdm_err_set(TDM_EINVAL, "router: at least one backend is required");
    if (o->n_backends > TDM_ROUTER_MAX_BACKENDS)
        return tdm_err_set(TDM_ERANGE, "router: %d backends; at most %d", o->n_backends,
                           TDM_ROUTER_MAX_BACKENDS);
    if (o->port < 0 || o->port > 65535)
        return tdm_err_set(TDM_EINVAL, "router: port %d is not in 0..65535", o->port);
    if (o->backend_api_key &&
        (strlen(o->backend_api_key) > MAX_BEARER_BYTES || strpbrk(o->backend_api_key, "\r\n")))
        return tdm_err_set(TDM_EINVAL,
                           "router: the backend API key is over %d bytes or holds a line break",
                           MAX_BEARER_BYTES);
    struct tdm_router *r = calloc(1, sizeof *r);
    if (!r) return tdm_err_set(TDM_ENOMEM, "router: out of memory");
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->health_mu, NULL);
    tdm_cond_init_monotonic(&r->health_cv);
    r->max_body = o->max_body ? o->max_body : TDM_SERVER_DEFAULT_MAX_BODY;
    r->connect_timeout_ms = o->connect_timeout_ms > 0 ? (uint64_t)o->connect_timeout_ms : 2000;
    r->timeout_ns = (o->timeout_s > 0 ? (uint64_t)o->timeout_s : 600) * 1000000000ull;
    r->health_interval_ms = o->health_interval_ms > 0 ? (uint64_t)o->health_interval_ms : 1000;
    r->health_timeout_ms = o->health_timeout_ms > 0 ? (uint64_t)o->health_timeout_ms : 1000;
    r->prefix_weight = o->prefix_weight > 0 ? o->prefix_weight : 2.0;
    if (o->route == TDM_ROUTE_PREFIX && o->n_backends > 32) {
        router_free(r);
        return tdm_err_set(TDM_ERANGE, "router: --route prefix takes at most 32 backends");
    }
    if (o->route == TDM_ROUTE_PREFIX && tdm_affinity_new((size_t)1 << 20, &r->aff) != TDM_OK) {
        router_free(r);
        return tdm_err_set(TDM_ENOMEM, "router: out of memory for the prefix index");
    }
    if (o->route == TDM_ROUTE_KV) {
        if (!o->kv_events || !o->model || !o->model->tok) {
            router_free(r);
            return tdm_err_set(TDM_EINVAL, "router: --route kv needs the backends' KV event "
                                           "endpoints and the model's tokenizer");
        }
        r->api = (struct api_ctx){.tok = o->model->tok,
                                  .chat = o->model->chat,
                                  .add_bos = o->model->add_bos,
                                  .model_name = "",
                                  .max_ctx = 1 << 24,
                                  .vocab = tdm_tok_vocab_size(o->model->tok)};
        if (o->n_backends > 32) {
            router_free(r);
            return tdm_err_set(TDM_ERANGE, "router: --route kv takes at most 32 backends");
        }
        tdm_status kst = tdm_affinity_new((size_t)1 << 20, &r->sent);
        if (kst == TDM_OK) kst = tdm_kv_sub_start(o->kv_events, o->n_backends, &r->kv);
        if (kst != TDM_OK) {
            router_free(r);
            return kst;
        }
    }

    tdm_status st;
    r->api_key = o->api_key && *o->api_key ? strdup(o->api_key) : NULL;
    r->backend_api_key =
        o->backend_api_key && *o->backend_api_key ? strdup(o->backend_api_key) : NULL;
    r->b = calloc((size_t)o->n_backends, sizeof *r->b);
    if ((o->api_key && *o->api_key && !r->api_key) ||
        (o->backend_api_key && *o->backend_api_key && !r->backend_api_key) || !r->b) {
        st = tdm_err_set(TDM_ENOMEM, "router: out of memory");
        goto out_free;
    }
    r->n_backends = o->n_backends;
    for (int i = 0; i < o->n_backends; i++) {
        struct backend *b = &r->b[i];
        if ((st = tdm_bh_target_init(o->backends[i], o->backend_ca_file, &b->target)) != TDM_OK) {
            st = tdm_err_set(st, "router: backend %s", tdm_err_msg());
            goto out_free;
        }
        size_t n = strlen(o->backends[i]);
        while (n > 0 && o->backends[i][n - 1] == '/')
            n--;
        b->url = strndup(o->backends[i], n);
        b->label = b->url ? label_escape(b->url) : NULL;
        if (!b->label) {
            st = tdm_err_set(TDM_ENOMEM, "router: out of memory");
            goto out_free;
        }
    }

    /* One round of checks before listening, so that a router over live backends routes at once. */
    health_check_all(r, true);
    const char *host = o->host ? o->host : "127.0.0.1";
    struct tdm_front_cfg fc = {.who = "router",
                               .host = host,
                               .port = o->port,
                               .threads = o->http_threads > 0 ? o->http_threads : 4,
                               .max_connections = o->max_connections,
                               .idle_timeout_s = o->idle_timeout_s,
                               .header_timeout_ms = o->header_timeout_ms,
                               .body_timeout_ms = o->body_timeout_ms,
                               .tls_cert_pem = o->tls_cert_pem,
                               .allowed_origins = o->allowed_origins,
                               .tls_key_pem = o->tls_key_pem,
                               .handler = handler,
                               .cls = r};
    if ((st = tdm_pump_start(&r->pump)) != TDM_OK) goto out_free;
    if ((st = tdm_front_start(&fc, &r->front)) != TDM_OK) goto out_free;
    r->port = tdm_front_port(r->front);
    if (pthread_create(&r->health_thread, NULL, health_main, r) != 0) {
        st = tdm_err_set(TDM_EIO, "router: cannot start the health-check thread");
        goto out_stop_daemon;
    }
    r->health_running = true;
    *out = r;
    return TDM_OK;

out_stop_daemon:
    tdm_pump_close(r->pump);
    tdm_front_stop(r->front);
out_free:
    tdm_pump_stop(r->pump);
    router_free(r);
    return st;
}

int tdm_router_port(const tdm_router_t *r)
{
    return r->port;
}

void tdm_router_drain(tdm_router_t *r)
{
    atomic_store(&r->draining, true);
}

int tdm_router_in_flight(tdm_router_t *r)
{
    int n = 0;
    for (int i = 0; i < r->n_backends; i++)
        n += atomic_load(&r->b[i].in_flight);
    return n;
}

void tdm_router_stop(tdm_router_t *r)
{
    if (!r) return;
    atomic_store(&r->stopping, true);
    pthread_mutex_lock(&r->health_mu);
    pthread_cond_broadcast(&r->health_cv);
    pthread_mutex_unlock(&r->health_mu);
    if (r->health_running) pthread_join(r->health_thread, NULL);
    tdm_pump_close(r->pump); /* every parked connection resumed: its response ends */
    tdm_front_stop(r->front);
    tdm_pump_stop(r->pump);
    router_free(r);
}
