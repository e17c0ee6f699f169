/*
 * The router (include/tandem/server.h, tdm_router_*): the public OpenAI endpoint over several
 * `tandem serve` nodes. It parses nothing of the API itself: each generation request's body goes
 * to one backend unchanged, and the backend's status, Content-Type and body come back byte for
 * byte, SSE events as they arrive. Only routing, authentication, the body cap and the router's
 * own errors (OpenAI-style JSON) are decided here.
 *
 * Choosing a backend: the healthy backend with the fewest requests the router has in flight to
 * it; ties go round robin (a cursor that moves past each pick). In-flight counts cover a request
 * from the pick until its response is fully relayed or abandoned.
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
 *   -> down           mark_down() on a connection thread (forward() or relay_read())
 *
 * Failures: a connection error (refused, reset, cut short or garbled) before the backend's
 * response head arrives leaves nothing sent to the client, so the request is retried once on
 * another backend. After the head the router is committed: an error mid-body cuts the client's
 * response. No backend picked: 503; none could answer: 502; a backend silent past the timeout:
 * 504 (not retried: it may still be working on the request, and it is not marked down, since a
 * long generation is not a fault; a hung backend fails its health checks instead).
 *
 * Cancellation: while a connection thread waits on its backend it also polls its client's socket
 * for a hang-up (POLLRDHUP). A client that leaves makes the router close the backend connection,
 * which the backend sees as its own client leaving: it cancels the request and frees its KV pages.
 *
 * Threading: libmicrohttpd runs one thread per client connection; that thread does the whole
 * forward (connect, send, wait, relay) with blocking calls bounded by timeouts, checking the
 * client and the stop flag at least every POLL_SLICE_MS. One health thread probes the backends
 * in turn. Backend state is atomics, plus a mutex so that a pick and its in-flight increment are
 * one step. tdm_router_stop waits for every thread.
 *
 * Bounds: bodies over max_body get 413; connections are capped by max_connections; every
 * backend wait has a deadline (connect_timeout_ms, then timeout_s for the head and between body
 * pieces); response heads over 64 KiB are refused by the client (server/httpc.h).
 */
#include <errno.h>
#include <microhttpd.h>
#include <poll.h>
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
#include "server/server_int.h"

#define POLL_SLICE_MS     250
#define RELAY_BLOCK_BYTES 16384
#define MAX_BEARER_BYTES  512

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
    int client_fd; /* -1: unknown, not watched */
    uint64_t idle_deadline_ns;
    char tail[SSE_DONE_LEN]; /* the last bytes relayed, oldest first */
    size_t n_tail;
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

static int pick(struct tdm_router *r, int exclude)
{
    pthread_mutex_lock(&r->mu);
    int best = -1, best_load = 0;
    for (int k = 0; k < r->n_backends; k++) {
        int i = (r->rr + k) % r->n_backends;
        if (i == exclude || !atomic_load(&r->b[i].up)) continue;
        int load = atomic_load(&r->b[i].in_flight);
        if (best < 0 || load < best_load) best = i, best_load = load;
    }
    if (best >= 0) {
        atomic_fetch_add(&r->b[best].in_flight, 1);
        r->rr = (best + 1) % r->n_backends;
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
    if (atomic_exchange(&r->b[be].up, false))
        TDM_WARN("router: backend %s is down (%s)", r->b[be].url, why);
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

/* ---- waiting on a backend while watching the client ---- */

/* Sleeps until the backend socket is readable, the client hangs up, or ms pass. Only a hang-up
 * is watched on the client's side: bytes it sends (a pipelined request) stay unread. Returns
 * true when the client is gone. */
static bool wait_backend_or_hangup(int backend_fd, int client_fd, int ms)
{
    struct pollfd p[2] = {{.fd = backend_fd, .events = POLLIN},
                          {.fd = client_fd, .events = POLLRDHUP}};
    int n = poll(p, client_fd >= 0 ? 2 : 1, ms);
    return n > 0 && client_fd >= 0 &&
           (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

/* How one slice of waiting on the backend ended (AGAIN: look at the backend again). */
enum wait_end { WAIT_AGAIN, WAIT_FAILED, WAIT_CLIENT_GONE, WAIT_STOPPING, WAIT_TIMEOUT };

/* Sleeps one slice (at most POLL_SLICE_MS), unless the deadline has passed or the router is
 * stopping. */
static enum wait_end wait_slice(struct tdm_router *r, tdm_bh_conn_t *bc, int client_fd,
                                uint64_t deadline_ns)
{
    uint64_t now = tdm_now_ns();
    if (atomic_load(&r->stopping)) return WAIT_STOPPING;
    if (now >= deadline_ns) return WAIT_TIMEOUT;
    uint64_t left_ms = (deadline_ns - now + 999999) / 1000000;
    int ms = (int)TDM_MIN(left_ms, (uint64_t)POLL_SLICE_MS);
    if (wait_backend_or_hangup(tdm_bh_fd(bc), client_fd, ms)) return WAIT_CLIENT_GONE;
    return WAIT_AGAIN;
}

/* ---- relaying a response ---- */

static void relay_free(void *cls)
{
    struct relay *rl = cls;
    tdm_bh_close(rl->bc); /* the backend sees its client leave if it was not done */
    release(rl->r, rl->be);
    free(rl);
}

static ssize_t relay_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct relay *rl = cls;
    struct tdm_router *r = rl->r;
    if (max == 0) return 0;
    size_t cap = TDM_MIN(max, (size_t)RELAY_BLOCK_BYTES);
    for (;;) {
        size_t n = 0;
        enum tdm_bh_fail f = tdm_bh_read(rl->bc, buf, cap, 0, &n);
        if (f == TDM_BH_OK) {
            if (n == 0) return MHD_CONTENT_READER_END_OF_STREAM;
            rl->idle_deadline_ns = tdm_now_ns() + r->timeout_ns;
            remember_tail(rl, buf, n);
            return (ssize_t)n;
        }
        if (f != TDM_BH_TIMEOUT) {
            count_error(r, err_kind(f));
            if (is_connection_error(f)) mark_down(r, rl->be, tdm_err_msg());
            TDM_WARN("router: %s: response cut short: %s", r->b[rl->be].url, tdm_err_msg());
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        switch (wait_slice(r, rl->bc, rl->client_fd, rl->idle_deadline_ns)) {
        case WAIT_AGAIN:
            continue;
        case WAIT_CLIENT_GONE:
            /* after the stream's last event it is a normal close, not a client leaving */
            if (!stream_done(rl)) count_error(r, PE_CLIENT_GONE);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        case WAIT_TIMEOUT:
            count_error(r, PE_TIMEOUT);
            TDM_WARN("router: %s: no response bytes for %llu s; cutting the response",
                     r->b[rl->be].url, (unsigned long long)(r->timeout_ns / 1000000000ull));
            return MHD_CONTENT_READER_END_WITH_ERROR;
        default:
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

/* Queues the backend's response (head received) for relaying. Takes bc and the in-flight count
 * of `be` in every case. */
static enum MHD_Result relay_start(struct tdm_router *r, struct MHD_Connection *c, int be,
                                   tdm_bh_conn_t *bc, int client_fd)
{
    struct relay *rl = calloc(1, sizeof *rl);
    if (!rl) {
        tdm_bh_close(bc);
        release(r, be);
        count_error(r, PE_NOMEM);
        return tdm_reply_errf(c, r->own_by_class, 500, "out of memory");
    }
    *rl = (struct relay){.r = r,
                         .be = be,
                         .bc = bc,
                         .client_fd = client_fd,
                         .idle_deadline_ns = tdm_now_ns() + r->timeout_ns};
    int status = tdm_bh_status(bc);
    int64_t len = tdm_bh_content_length(bc);
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

static enum MHD_Result forward(struct tdm_router *r, struct MHD_Connection *c, const char *method,
                               const char *url, const struct tdm_front_body *cc)
{
    if (atomic_load(&r->draining))
        return tdm_reply_errf(c, r->own_by_class, 503, "the router is shutting down");
    bool post = !strcmp(method, "POST");
    int client_fd = tdm_front_client_fd(c);
    struct tdm_bh_request rq = {.method = method,
                                .path = url,
                                .bearer = backend_bearer(r, c),
                                .body = post ? (cc->body ? cc->body : "") : NULL,
                                .body_len = post ? cc->len : 0,
                                .connect_timeout_ms = r->connect_timeout_ms};
    enum tdm_bh_fail last = TDM_BH_OK;
    char last_msg[400] = "";
    int tried = -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        int be = pick(r, tried);
        if (be < 0) break;
        if (attempt > 0) atomic_fetch_add(&r->retries, 1);
        rq.deadline_ns = tdm_now_ns() + r->timeout_ns;
        tdm_bh_conn_t *bc = NULL;
        enum tdm_bh_fail f = tdm_bh_open(&r->b[be].target, &rq, &bc);
        enum wait_end end = WAIT_FAILED;
        while (f == TDM_BH_OK) {
            f = tdm_bh_wait_head(bc, 0);
            if (f == TDM_BH_OK) return relay_start(r, c, be, bc, client_fd);
            if (f != TDM_BH_TIMEOUT) break;
            end = wait_slice(r, bc, client_fd, rq.deadline_ns);
            if (end == WAIT_AGAIN) f = TDM_BH_OK;
        }
        snprintf(last_msg, sizeof last_msg, "%s: %s", r->b[be].url,
                 end == WAIT_TIMEOUT ? "no response before the timeout" : tdm_err_msg());
        tdm_bh_close(bc);
        release(r, be);
        if (end == WAIT_CLIENT_GONE) {
            count_error(r, PE_CLIENT_GONE);
            return MHD_NO;
        }
        if (end == WAIT_STOPPING)
            return tdm_reply_errf(c, r->own_by_class, 503, "the router is shutting down");
        count_error(r, err_kind(f));
        last = f;
        if (!is_connection_error(f)) break;
        mark_down(r, be, last_msg);
        tried = be;
    }
    switch (last) {
    case TDM_BH_OK:
        count_error(r, PE_NO_BACKEND);
        return tdm_reply_errf(c, r->own_by_class, 503, "no healthy backend (0 of %d up)",
                              r->n_backends);
    case TDM_BH_TIMEOUT:
        return tdm_reply_errf(c, r->own_by_class, 504, "the backend did not answer in time (%s)",
                              last_msg);
    case TDM_BH_NOMEM:
        return tdm_reply_errf(c, r->own_by_class, 500, "out of memory");
    default:
        return tdm_reply_errf(c, r->own_by_class, 502, "no backend could answer (%s)", last_msg);
    }
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
    const char *bad = tdm_front_framing_error(c, cc, version);
    if (bad) return tdm_reply_errf(c, r->own_by_class, 400, "%s", bad);

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
    bool is_models = !strcmp(url, "/v1/models"), is_cmpl = !strcmp(url, "/v1/completions"),
         is_chat = !strcmp(url, "/v1/chat/completions");
    if (!is_models && !is_cmpl && !is_chat)
        return tdm_reply_errf(c, r->own_by_class, 404, "no route for %s %.100s", method, url);
    if (!tdm_front_bearer_ok(c, r->api_key))
        return tdm_reply_errf(c, r->own_by_class, 401,
                              "missing or invalid API key (send Authorization: Bearer <key>)");
    if (is_models && !get) return tdm_reply_errf(c, r->own_by_class, 405, "use GET /v1/models");
    if (!is_models && !post)
        return tdm_reply_errf(c, r->own_by_class, 405, "%s",
                              is_chat ? "use POST /v1/chat/completions"
                                      : "use POST /v1/completions");
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
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->health_cv, &ca);
    pthread_condattr_destroy(&ca);
    r->max_body = o->max_body ? o->max_body : TDM_SERVER_DEFAULT_MAX_BODY;
    r->connect_timeout_ms = o->connect_timeout_ms > 0 ? (uint64_t)o->connect_timeout_ms : 2000;
    r->timeout_ns = (o->timeout_s > 0 ? (uint64_t)o->timeout_s : 600) * 1000000000ull;
    r->health_interval_ms = o->health_interval_ms > 0 ? (uint64_t)o->health_interval_ms : 1000;
    r->health_timeout_ms = o->health_timeout_ms > 0 ? (uint64_t)o->health_timeout_ms : 1000;

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
                               .threads = 0, /* the relay blocks on its backend */
                               .max_connections = o->max_connections,
                               .idle_timeout_s = o->idle_timeout_s,
                               .header_timeout_ms = o->header_timeout_ms,
                               .body_timeout_ms = o->body_timeout_ms,
                               .tls_cert_pem = o->tls_cert_pem,
                               .tls_key_pem = o->tls_key_pem,
                               .handler = handler,
                               .cls = r};
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
    tdm_front_stop(r->front);
out_free:
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
    tdm_front_stop(r->front); /* connection threads see `stopping` within POLL_SLICE_MS */
    router_free(r);
}
