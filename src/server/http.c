/*
 * The HTTP side of the server (include/tandem/server.h): libmicrohttpd as an event loop over a
 * few threads (src/server/front.h), routing, authentication, body limits, and the SSE writer.
 *
 * No handler ever blocks. A generation submits its request, then reads what the scheduler has
 * published through its reader (which renders the text and runs the stop strings on the
 * handler's thread); when there is nothing new it suspends its connection. The scheduler's
 * notify hook (struct tdm_req_params.notify) resumes it on news; so idle streams and slow
 * clients cost no thread. A waiter's states:
 *
 *   RUNNING --(nothing new: suspend)--> SUSPENDED --(notify: resume)--> RUNNING
 *      |  ^                                 |
 *      |  +--(news came first: go again)    +--(sweeper: the client hung up, or the server
 *      |                                         is closing: gone, resume)--> RUNNING
 *      +--(finished, or gone) --> the response ends; the request is released (cancelled)
 *
 *   from       to         who                       when
 *   RUNNING    SUSPENDED  the handler / the reader  no news since its last look
 *   SUSPENDED  RUNNING    notify (scheduler thread) a token or the finish was published
 *   SUSPENDED  RUNNING    the sweeper (front.c)     the client is gone, or closing
 *   RUNNING    RUNNING    notify                    news while it ran: `news` makes it look again
 *
 * Locks: notify runs under the request's lock and takes the waiter's (r->mu -> w->mu); the
 * handler never holds the waiter's lock while it reads the request; the sweeper takes the
 * server's waiter list lock, then a waiter's (wmu -> w->mu).
 *
 * Streaming responses are callback responses: the callback writes one SSE event per output token
 * (tokens whose text is still held back for a possible stop string are folded into the next
 * event), then the finish event, the usage event when asked, and "data: [DONE]".
 */
#include <errno.h>
#include <pthread.h>
#include <microhttpd.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/front.h"
#include "server/reply.h"
#include "server/server_int.h"

struct waiter {
    struct tdm_server *srv;
    struct MHD_Connection *conn;
    pthread_mutex_t mu;
    bool suspended, news;
    atomic_bool gone;           /* the client hung up, or the server is closing */
    struct waiter *prev, *next; /* in srv's list, under srv->wmu */
};

struct tdm_server {
    struct tdm_front *front;
    pthread_mutex_t wmu; /* the waiters' list, closing */
    struct waiter *waiters;
    bool closing;
    tdm_sched_t *sched;
    struct api_ctx api;
    char *api_key;
    char *model_name;
    size_t max_body;
    atomic_bool ready, draining;
    _Atomic uint64_t http[6]; /* responses by status class */
    int port;
    _Atomic uint64_t next_id;
    bool no_generate;
    _Atomic int active; /* generation requests whose response is not finished */
    char *(*extra_metrics)(void *ctx);
    void *extra_metrics_ctx;
};

/* A generation: its request, reader and waiter (the non-streaming kind is only this). */
struct gen {
    struct tdm_server *srv;
    tdm_req_t *req;
    tdm_req_reader_t *rd; /* this request's text and stop strings */
    struct api_req ar;
    char id[48];
    long created;
    struct waiter w;
};

/* A streaming generation: the generation, and where its events stand. */
struct stream {
    struct gen g;
    struct tdm_req_view v; /* the reader's last view */
    int sent_out;
    size_t sent_text;
    bool first_sent, finish_sent, usage_sent, done;
    char *pend;
    size_t pend_len, pend_off;
};

/* ---- waiters ---- */

static void waiter_init(struct waiter *w, struct tdm_server *s, struct MHD_Connection *c)
{
    w->srv = s;
    w->conn = c;
    pthread_mutex_init(&w->mu, NULL);
    pthread_mutex_lock(&s->wmu);
    atomic_init(&w->gone, s->closing);
    w->prev = NULL;
    w->next = s->waiters;
    if (s->waiters) s->waiters->prev = w;
    s->waiters = w;
    pthread_mutex_unlock(&s->wmu);
}

/* After the request is released (no notify can come any more). */
static void waiter_fini(struct waiter *w)
{
    struct tdm_server *s = w->srv;
    pthread_mutex_lock(&s->wmu);
    if (w->prev)
        w->prev->next = w->next;
    else
        s->waiters = w->next;
    if (w->next) w->next->prev = w->prev;
    pthread_mutex_unlock(&s->wmu);
    pthread_mutex_destroy(&w->mu);
}

/* The scheduler's notify hook (under the request's lock). */
static void waiter_notify(void *ctx)
{
    struct waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    if (w->suspended) {
        w->suspended = false;
        MHD_resume_connection(w->conn);
    } else {
        w->news = true;
    }
    pthread_mutex_unlock(&w->mu);
}

/* Before looking at the request: news from now on makes waiter_suspend refuse. */
static void waiter_look(struct waiter *w)
{
    pthread_mutex_lock(&w->mu);
    w->news = false;
    pthread_mutex_unlock(&w->mu);
}

/* Suspends the connection unless news came (or the client went) since waiter_look: true
 * when suspended (return and wait to be called again), false to look again. */
static bool waiter_suspend(struct waiter *w)
{
    pthread_mutex_lock(&w->mu);
    bool sus = !w->news && !atomic_load(&w->gone);
    if (sus) {
        w->suspended = true;
        MHD_suspend_connection(w->conn);
    }
    pthread_mutex_unlock(&w->mu);
    return sus;
}

/* The front's sweeper: a suspended connection's hang-up is not seen by libmicrohttpd, so look
 * for it here (and resume everything when closing). */
static void sweep(void *cls)
{
    struct tdm_server *s = cls;
    pthread_mutex_lock(&s->wmu);
    for (struct waiter *w = s->waiters; w; w = w->next) {
        pthread_mutex_lock(&w->mu);
        /* closing: every waiter is gone, so none suspends again */
        if (s->closing) atomic_store(&w->gone, true);
        if (w->suspended && (s->closing || tdm_front_client_gone(w->conn))) {
            atomic_store(&w->gone, true);
            w->suspended = false;
            MHD_resume_connection(w->conn);
        }
        pthread_mutex_unlock(&w->mu);
    }
    pthread_mutex_unlock(&s->wmu);
}

/* ---- streaming ---- */

/* Ends a generation: its request is released first (no notify after that, so the waiter can
 * go), then everything it owns. */
static void gen_end(struct gen *g)
{
    tdm_req_release(g->req);
    waiter_fini(&g->w);
    tdm_req_reader_destroy(g->rd);
    tdm_api_req_free(&g->ar);
    atomic_fetch_sub(&g->srv->active, 1);
}

static void stream_free(void *cls)
{
    struct stream *st = cls;
    gen_end(&st->g);
    free(st->pend);
    free(st);
}

/* Renders the next SSE event into st->pend. Returns false when there is nothing to send yet.
 * The reader takes in what the scheduler published; nothing here holds the request's lock. */
static bool stream_next(struct stream *st)
{
    struct tdm_server *s = st->g.srv;
    char *ev = NULL;
    tdm_req_reader_update(st->g.rd, st->g.req, &st->v);
    const struct tdm_req_view v = st->v;
    if (st->finish_sent) {
        if (st->g.ar.include_usage && !st->usage_sent && v.finish != TDM_FINISH_ERROR &&
            v.finish != TDM_FINISH_CANCELLED) {
            ev = tdm_api_render_usage_chunk(&s->api, &st->g.ar, st->g.id, st->g.created, &v);
            st->usage_sent = true;
        } else {
            ev = strdup("data: [DONE]\n\n");
            st->done = true;
        }
    } else if (v.n_out > st->sent_out) {
        /* one event per token; a token whose text is held back joins the next one */
        int from = st->sent_out, to = from + 1;
        while (to < v.n_out && v.text_end[to - 1] == st->sent_text && !v.logprobs)
            to++;
        bool last = to == v.n_out && v.finish != TDM_FINISH_NONE && v.finish != TDM_FINISH_ERROR &&
                    v.finish != TDM_FINISH_CANCELLED;
        if (v.text_end[to - 1] > st->sent_text || v.logprobs || !st->first_sent || last) {
            ev = tdm_api_render_chunk(&s->api, &st->g.ar, st->g.id, st->g.created, &v, from, to,
                                      st->sent_text, !st->first_sent, last);
            st->first_sent = true;
            st->sent_text = last ? v.text_len : v.text_end[to - 1];
            if (last) st->finish_sent = true;
        }
        st->sent_out = to;
        if (!ev && !st->finish_sent && v.text_end[to - 1] == st->sent_text) {
            /* nothing to show for these tokens yet */
            return true;
        }
    } else if (v.finish != TDM_FINISH_NONE) {
        if (v.finish == TDM_FINISH_ERROR || v.finish == TDM_FINISH_CANCELLED) {
            struct api_err e;
            tdm_api_err_set(
                &e, v.finish == TDM_FINISH_CANCELLED || v.error == TDM_ETIMEDOUT ? 503 : 500, NULL,
                "%s",
                v.finish == TDM_FINISH_CANCELLED ? "the request was cancelled (server "
                                                   "shutting down)"
                                                 : v.error_msg);
            char *j = tdm_api_error_json(&e);
            if (j && asprintf(&ev, "data: %s\n\n", j) < 0) ev = NULL;
            free(j);
        } else {
            ev = tdm_api_render_chunk(&s->api, &st->g.ar, st->g.id, st->g.created, &v, v.n_out,
                                      v.n_out, st->sent_text, !st->first_sent, true);
            st->first_sent = true;
        }
        st->finish_sent = true;
    } else {
        return false;
    }
    free(st->pend);
    st->pend = ev;
    st->pend_len = ev ? strlen(ev) : 0;
    st->pend_off = 0;
    if (!ev && !st->done) {
        /* out of memory while rendering: end the stream */
        st->done = true;
    }
    return true;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct stream *st = cls;
    for (;;) {
        if (st->pend && st->pend_off < st->pend_len) {
            size_t n = TDM_MIN(max, st->pend_len - st->pend_off);
            memcpy(buf, st->pend + st->pend_off, n);
            st->pend_off += n;
            return (ssize_t)n;
        }
        if (st->done) return MHD_CONTENT_READER_END_OF_STREAM;
        waiter_look(&st->g.w);
        if (stream_next(st)) continue;
        if (atomic_load(&st->g.w.gone)) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (waiter_suspend(&st->g.w)) return 0; /* resumed on news: called again */
    }
}

/* ---- generation endpoints ---- */

static void gen_free(void *app)
{
    gen_end(app);
    free(app);
}

/* A non-streaming generation: answers when it has finished, else suspends (and is called again
 * when resumed). The request ends in gen_free, when libmicrohttpd completes the connection's
 * request. */
static enum MHD_Result gen_continue(struct tdm_server *s, struct MHD_Connection *c, struct gen *g)
{
    struct tdm_req_view v;
    for (;;) {
        waiter_look(&g->w);
        tdm_req_reader_update(g->rd, g->req, &v);
        if (v.finish != TDM_FINISH_NONE) break;
        if (atomic_load(&g->w.gone) || tdm_front_client_gone(c)) return MHD_NO;
        if (waiter_suspend(&g->w)) return MHD_YES;
    }
    if (v.finish == TDM_FINISH_ERROR) {
        char msg[300];
        snprintf(msg, sizeof msg, "generation failed: %s", v.error_msg);
        /* a stalled scheduler (the watchdog's TDM_ETIMEDOUT) is worth retrying elsewhere */
        return tdm_reply_errf(c, s->http, v.error == TDM_ETIMEDOUT ? 503 : 500, "%s", msg);
    }
    if (v.finish == TDM_FINISH_CANCELLED)
        return tdm_reply_errf(c, s->http, 503, "the request was cancelled (server shutting down)");
    char *body = tdm_api_render_full(&s->api, &g->ar, g->id, g->created, &v);
    return tdm_reply_send(c, s->http, 200, body, "application/json");
}

static enum MHD_Result generate(struct tdm_server *s, struct MHD_Connection *c, bool chat,
                                struct tdm_front_body *cc)
{
    if (atomic_load(&s->draining))
        return tdm_reply_errf(c, s->http, 503, "the server is shutting down");
    struct api_req ar;
    struct api_err e;
    if (!tdm_api_parse(&s->api, chat, cc->body ? cc->body : "", cc->len, &ar, &e))
        return tdm_reply_err(c, s->http, &e);
    tdm_req_reader_t *rd = NULL;
    tdm_status st = tdm_req_reader_create(s->api.tok, (const char *const *)ar.stops, ar.n_stops,
                                          ar.p.max_tokens, ar.p.top_logprobs, &rd);
    /* the waiter lives in the stream or the generation, created before the submit so that
     * the scheduler's first notify finds it */
    struct stream *sm = NULL;
    struct gen *g = NULL;
    if (st == TDM_OK) {
        if (ar.stream && (sm = calloc(1, sizeof *sm))) g = &sm->g;
        if (!ar.stream) g = calloc(1, sizeof *g);
        if (!g) st = tdm_err_set(TDM_ENOMEM, "out of memory");
    }
    tdm_req_t *req = NULL;
    if (st == TDM_OK) {
        waiter_init(&g->w, s, c);
        ar.p.notify = waiter_notify;
        ar.p.notify_ctx = &g->w;
        st = tdm_sched_submit(s->sched, &ar.p, &req);
        if (st != TDM_OK) waiter_fini(&g->w);
    }
    if (st != TDM_OK) {
        int status = st == TDM_EAGAIN || st == TDM_ECANCELED ? 503 : st == TDM_ENOMEM ? 500 : 400;
        tdm_api_err_set(&e, status, NULL, "%s", tdm_err_msg());
        if (sm)
            free(sm);
        else
            free(g);
        tdm_req_reader_destroy(rd);
        tdm_api_req_free(&ar);
        return tdm_reply_err(c, s->http, &e);
    }
    g->srv = s;
    g->req = req;
    g->rd = rd;
    g->ar = ar;
    snprintf(g->id, sizeof g->id, "%s-%llx%08llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)tdm_now_ns() & 0xffffffffffull,
             (unsigned long long)tdm_req_id(req));
    g->created = (long)time(NULL);
    atomic_fetch_add(&s->active, 1);

    if (sm) {
        struct MHD_Response *r =
            MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, sm, stream_free);
        if (!r) {
            stream_free(sm);
            return MHD_NO;
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        tdm_front_cors(c, r);
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        atomic_fetch_add(&s->http[2], 1);
        return ret;
    }
    cc->app = g;
    cc->app_free = gen_free;
    return gen_continue(s, c, g);
}

/* ---- routing ---- */

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls)
{
    struct tdm_server *s = cls;
    struct tdm_front_body *cc = NULL;
    switch (tdm_front_feed(c, con_cls, upload, upload_size, s->max_body, &cc)) {
    case TDM_FRONT_MORE:
        return MHD_YES;
    case TDM_FRONT_OOM:
        return MHD_NO;
    case TDM_FRONT_TOO_BIG:
        return tdm_reply_errf(c, s->http, 413, "the request body is larger than the %zu-byte limit",
                              s->max_body);
    case TDM_FRONT_DONE:
        break;
    }
    if (cc->app) return gen_continue(s, c, cc->app); /* resumed */
    const char *bad = tdm_front_framing_error(c, cc, version);
    if (bad) return tdm_reply_errf(c, s->http, 400, "%s", bad);

    const char *allow_headers;
    if (tdm_front_preflight(c, method, &allow_headers))
        return tdm_reply_preflight(c, s->http, allow_headers);
    bool get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET /health");
        int64_t stall = tdm_sched_stall_ms(s->sched);
        bool ok = atomic_load(&s->ready) && !atomic_load(&s->draining) && !stall;
        char *body = NULL;
        if (stall &&
            asprintf(&body, "{\"status\":\"stalled\",\"stalled_ms\":%lld}", (long long)stall) < 0)
            body = NULL;
        if (!stall)
            body = strdup(ok                          ? "{\"status\":\"ok\"}"
                          : atomic_load(&s->draining) ? "{\"status\":\"draining\"}"
                                                      : "{\"status\":\"starting\"}");
        return tdm_reply_send(c, s->http, ok ? 200 : 503, body, "application/json");
    }
    if (!strcmp(url, "/metrics")) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET /metrics");
        struct tdm_sched_metrics_snapshot m;
        tdm_sched_metrics(s->sched, &m);
        uint64_t http[6];
        for (int i = 0; i < 6; i++)
            http[i] = atomic_load(&s->http[i]);
        char *text = tdm_metrics_render(&m, http, s->model_name);
        if (text && s->extra_metrics) {
            char *more = s->extra_metrics(s->extra_metrics_ctx);
            char *both = NULL;
            if (more && asprintf(&both, "%s%s", text, more) < 0) both = NULL;
            free(more);
            free(text);
            text = both;
        }
        return tdm_reply_send(c, s->http, 200, text, "text/plain; version=0.0.4; charset=utf-8");
    }
    bool is_models = !strcmp(url, "/v1/models"), is_cmpl = !strcmp(url, "/v1/completions"),
         is_chat = !strcmp(url, "/v1/chat/completions"),
         is_model = !strncmp(url, "/v1/models/", 11) && url[11], is_tok = !strcmp(url, "/tokenize"),
         is_detok = !strcmp(url, "/detokenize");
    if (is_model || is_tok || is_detok) {
        if (!tdm_front_bearer_ok(c, s->api_key))
            return tdm_reply_errf(c, s->http, 401,
                                  "missing or invalid API key (send Authorization: Bearer <key>)");
        if (is_model) {
            if (!get) return tdm_reply_errf(c, s->http, 405, "use GET /v1/models/{model}");
            struct api_err e;
            if (!tdm_api_model_known(&s->api, url + 11, &e)) return tdm_reply_err(c, s->http, &e);
            return tdm_reply_send(c, s->http, 200, tdm_api_render_model(&s->api, (long)time(NULL)),
                                  "application/json");
        }
        if (!post)
            return tdm_reply_errf(c, s->http, 405, "use POST %s",
                                  is_tok ? "/tokenize" : "/detokenize");
        struct api_err e;
        const char *b = cc->body ? cc->body : "";
        char *out = is_tok ? tdm_api_tokenize(&s->api, b, cc->len, &e)
                           : tdm_api_detokenize(&s->api, b, cc->len, &e);
        return out ? tdm_reply_send(c, s->http, 200, out, "application/json")
                   : tdm_reply_err(c, s->http, &e);
    }
    if (!is_models && !is_cmpl && !is_chat) {
        char msg[200];
        snprintf(msg, sizeof msg, "no route for %s %.100s", method, url);
        return tdm_reply_errf(c, s->http, 404, "%s", msg);
    }
    if (s->no_generate && !is_models) {
        char msg[200];
        snprintf(msg, sizeof msg,
                 "this is a prefill node: it takes prefill requests from decode "
                 "nodes over the fabric, not %s",
                 url);
        return tdm_reply_errf(c, s->http, 404, "%s", msg);
    }
    if (!tdm_front_bearer_ok(c, s->api_key))
        return tdm_reply_errf(c, s->http, 401,
                              "missing or invalid API key (send Authorization: Bearer <key>)");
    if (is_models) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET /v1/models");
        return tdm_reply_send(c, s->http, 200, tdm_api_render_models(&s->api, (long)time(NULL)),
                              "application/json");
    }
    if (!post)
        return tdm_reply_errf(c, s->http, 405, "%s",
                              is_chat ? "use POST /v1/chat/completions"
                                      : "use POST /v1/completions");
    return generate(s, c, is_chat, cc);
}

/* ---- lifecycle ---- */

tdm_status tdm_server_start(const struct tdm_server_opts *o, tdm_sched_t *sched,
                            const struct tdm_server_model *m, tdm_server_t **out)
{
    if (!m || !m->tok) return tdm_err_set(TDM_EINVAL, "server: a tokenizer is required");
    struct tdm_server *s = calloc(1, sizeof *s);
    if (!s) return tdm_err_set(TDM_ENOMEM, "server: out of memory");
    s->sched = sched;
    s->model_name = strdup(o->model_name ? o->model_name : "tandem");
    s->api_key = o->api_key && *o->api_key ? strdup(o->api_key) : NULL;
    s->max_body = o->max_body ? o->max_body : TDM_SERVER_DEFAULT_MAX_BODY;
    s->no_generate = o->no_generate;
    s->extra_metrics = o->extra_metrics;
    s->extra_metrics_ctx = o->extra_metrics_ctx;
    s->api = (struct api_ctx){.tok = m->tok,
                              .chat = m->chat,
                              .add_bos = m->add_bos,
                              .model_name = s->model_name,
                              .max_ctx = tdm_sched_max_ctx(sched),
                              .vocab = tdm_tok_vocab_size(m->tok)};
    for (int i = 0; i < s->api.vocab; i++) {
        size_t len = 0;
        if (tdm_tok_piece(m->tok, i, &len) && len > s->api.max_piece) s->api.max_piece = len;
    }
    tdm_api_find_fim(&s->api);
    tdm_status st;
    if (!s->model_name || (o->api_key && *o->api_key && !s->api_key)) {
        st = tdm_err_set(TDM_ENOMEM, "server: out of memory");
        goto out_free;
    }
    if (o->port < 0 || o->port > 65535) {
        st = tdm_err_set(TDM_EINVAL, "server: port %d is not in 0..65535", o->port);
        goto out_free;
    }
    pthread_mutex_init(&s->wmu, NULL);
    struct tdm_front_cfg fc = {.who = "server",
                               .host = o->host ? o->host : "127.0.0.1",
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
                               .cls = s,
                               .sweep = sweep};
    if ((st = tdm_front_start(&fc, &s->front)) != TDM_OK) {
        pthread_mutex_destroy(&s->wmu);
        goto out_free;
    }
    s->port = tdm_front_port(s->front);
    *out = s;
    return TDM_OK;

out_free:
    free(s->model_name);
    free(s->api_key);
    free(s);
    return st;
}

int tdm_server_port(const tdm_server_t *s)
{
    return s->port;
}
void tdm_server_set_ready(tdm_server_t *s, bool ready)
{
    atomic_store(&s->ready, ready);
}
void tdm_server_drain(tdm_server_t *s)
{
    atomic_store(&s->draining, true);
}

bool tdm_server_wait_idle(tdm_server_t *s, int timeout_ms)
{
    int64_t deadline = (int64_t)tdm_now_ns() + (int64_t)timeout_ms * 1000000;
    while (atomic_load(&s->active) > 0) {
        if ((int64_t)tdm_now_ns() > deadline) return false;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    return true;
}

void tdm_server_stop(tdm_server_t *s)
{
    if (!s) return;
    /* every suspended connection is resumed (gone: its response ends) before the daemon stops,
     * as libmicrohttpd requires; a waiter made from now on starts gone */
    pthread_mutex_lock(&s->wmu);
    s->closing = true;
    pthread_mutex_unlock(&s->wmu);
    sweep(s);
    tdm_front_stop(s->front);
    pthread_mutex_destroy(&s->wmu);
    free(s->model_name);
    free(s->api_key);
    free(s);
}
