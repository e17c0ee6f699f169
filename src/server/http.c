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
#include <ctype.h>
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

#include <ctype.h>

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
    char *fabric_address; /* GET /disagg/address (owned); NULL: 404 */
    char disagg_role[16];
};

/* One candidate of a generation: its request, its reader (text and stop strings), the reader's
 * last view, and, streamed, where its events stand. */
struct cand {
    tdm_req_t *req;
    tdm_req_reader_t *rd;
    struct tdm_req_view v;
    int prompt; /* tdm_api_prompt's index */
    int index;  /* its choice's index when streamed (best_of == n: prompt * n + its place) */
    int sent_out;
    size_t sent_text;
    bool first_sent, finish_sent;
    struct api_tool_scan ts; /* chat with tools: the output's calls, as text arrives */
};

/* A generation: its candidates (prompts x best_of, prompt-major; a prompt's are one scheduler
 * group), and one waiter that any of them wakes. The non-streaming kind is only this. */
struct gen {
    struct tdm_server *srv;
    struct api_req ar;
    char kv_peer[TDM_REQ_KV_PEER_MAX]; /* x-prefiller-host-port, "" for none */
    char id[48];
    long created;
    struct waiter w;
    int n_cand;
    struct cand *c;
    struct api_choice *ch; /* [n_cand] the response's choices */
};

/* A streaming generation: the generation, and where its events stand. */
struct stream {
    struct gen g;
    int next; /* the candidate looked at first next time (round robin) */
    bool usage_sent, done, failed;
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

/* ---- generations ---- */

/* Ends a generation: its requests are released first (no notify after that, so the waiter can
 * go), then everything it owns. */
static void gen_end(struct gen *g)
{
    for (int k = 0; k < g->n_cand; k++)
        if (g->c[k].req) tdm_req_release(g->c[k].req);
    waiter_fini(&g->w);
    for (int k = 0; k < g->n_cand; k++)
        tdm_req_reader_destroy(g->c[k].rd);
    free(g->c);
    free(g->ch);
    tdm_api_req_free(&g->ar);
    atomic_fetch_sub(&g->srv->active, 1);
}

/* The choice a candidate renders as: its prompt's first candidate holds the prompt's scores. */
static struct api_choice choice_of(const struct gen *g, const struct cand *cd, int index)
{
    return (struct api_choice){.index = index,
                               .prompt = cd->prompt,
                               .v = &cd->v,
                               .pv = &g->c[cd->prompt * g->ar.best_of].v};
}

/* Prompt tokens (each prompt once) and the completion tokens of the choices given. */
static struct api_usage usage_of(const struct gen *g, const struct api_choice *ch, int n)
{
    struct api_usage u = {0};
    for (int i = 0; i < g->ar.n_prompts; i++) { /* a prompt's first candidate looked it up */
        u.prompt_tokens += tdm_api_prompt(&g->ar, i).n;
        u.cached_tokens += g->c[i * g->ar.best_of].v.cached_tokens;
    }
    for (int i = 0; i < n; i++)
        u.completion_tokens += ch[i].v->n_out;
    return u;
}

/* An error event or reply's status and message for a candidate that ended without an answer. */
static int failure_of(const struct tdm_req_view *v, char *msg, size_t cap)
{
    if (v->finish == TDM_FINISH_CANCELLED) {
        snprintf(msg, cap, "the request was cancelled (server shutting down)");
        return 503;
    }
    snprintf(msg, cap, "generation failed: %s", v->error_msg);
    /* a stalled scheduler (the watchdog's TDM_ETIMEDOUT) is worth retrying elsewhere */
    return v->error == TDM_ETIMEDOUT ? 503 : 500;
}

static bool failed(const struct tdm_req_view *v)
{
    return v->finish == TDM_FINISH_ERROR || v->finish == TDM_FINISH_CANCELLED;
}

/* ---- streaming ---- */

static void stream_free(void *cls)
{
    struct stream *st = cls;
    gen_end(&st->g);
    free(st->pend);
    free(st);
}

/* Candidate cd's next event into *ev (*want: one was due, so NULL means out of memory).
 * Returns false when it has nothing new. */
static bool cand_next(struct stream *st, struct cand *cd, char **ev, bool *want)
{
    struct tdm_server *s = st->g.srv;
    const struct gen *g = &st->g;
    if (cd->finish_sent) return false;
    tdm_req_reader_update(cd->rd, cd->req, &cd->v);
    const struct tdm_req_view v = cd->v;
    const struct api_choice ch = choice_of(g, cd, cd->index);
    if (v.n_out > cd->sent_out) {
        /* one event per token; a token whose text is held back joins the next one */
        int from = cd->sent_out, to = from + 1;
        while (to < v.n_out && v.text_end[to - 1] == cd->sent_text && !v.logprobs)
            to++;
        bool last = to == v.n_out && v.finish != TDM_FINISH_NONE && !failed(&v);
        if (v.text_end[to - 1] > cd->sent_text || v.logprobs || !cd->first_sent || last) {
            *ev = g->ar.tools_parse
                      ? tdm_api_render_tool_chunk(&s->api, &g->ar, g->id, g->created, &ch, from, to,
                                                  &cd->ts, !cd->first_sent, last)
                      : tdm_api_render_chunk(&s->api, &g->ar, g->id, g->created, &ch, from, to,
                                             cd->sent_text, !cd->first_sent, last);
            *want = true;
            cd->first_sent = true;
            cd->sent_text = last ? v.text_len : v.text_end[to - 1];
            if (last) cd->finish_sent = true;
        }
        cd->sent_out = to; /* without an event: nothing to show for these tokens yet */
        return true;
    }
    if (v.finish == TDM_FINISH_NONE) return false;
    if (failed(&v)) {
        char msg[300];
        struct api_err e;
        tdm_api_err_set(&e, failure_of(&v, msg, sizeof msg), NULL, "%s", msg);
        char *j = tdm_api_error_json(&e);
        if (j && asprintf(ev, "data: %s\n\n", j) < 0) *ev = NULL;
        free(j);
        st->failed = true; /* the stream ends with it */
    } else {
        *ev = g->ar.tools_parse
                  ? tdm_api_render_tool_chunk(&s->api, &g->ar, g->id, g->created, &ch, v.n_out,
                                              v.n_out, &cd->ts, !cd->first_sent, true)
                  : tdm_api_render_chunk(&s->api, &g->ar, g->id, g->created, &ch, v.n_out, v.n_out,
                                         cd->sent_text, !cd->first_sent, true);
        cd->first_sent = true;
    }
    *want = true;
    cd->finish_sent = true;
    return true;
}

/* Renders the next SSE event into st->pend: the candidates' events in turn, then (every one
 * finished) the usage event when asked, and [DONE]. Returns false when there is nothing to
 * send yet. The readers take in what the scheduler published; nothing here holds a request's
 * lock. */
static bool stream_next(struct stream *st)
{
    struct gen *g = &st->g;
    char *ev = NULL;
    bool want = false, all = true;
    for (int k = 0; k < g->n_cand; k++)
        all &= g->c[k].finish_sent;
    if (st->failed || all) {
        if (!st->failed && g->ar.include_usage && !st->usage_sent) {
            for (int k = 0; k < g->n_cand; k++)
                g->ch[k] = choice_of(g, &g->c[k], k);
            ev = tdm_api_render_usage_chunk(&g->srv->api, &g->ar, g->id, g->created,
                                            usage_of(g, g->ch, g->n_cand));
            st->usage_sent = true;
        } else {
            ev = strdup("data: [DONE]\n\n");
            st->done = true;
        }
        want = true;
    } else {
        bool progress = false;
        for (int t = 0; t < g->n_cand && !progress; t++) {
            int k = (st->next + t) % g->n_cand;
            if (cand_next(st, &g->c[k], &ev, &want)) {
                progress = true;
                st->next = (k + 1) % g->n_cand;
            }
        }
        if (!progress) return false;
        if (!want) return true;
    }
    free(st->pend);
    st->pend = ev;
    st->pend_len = ev ? strlen(ev) : 0;
    st->pend_off = 0;
    if (!ev) st->done = true; /* out of memory while rendering: end the stream */
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

/* A candidate's cumulative log-probability (best_of's ranking). */
static double cum_logprob(const struct tdm_req_view *v)
{
    double sum = 0.0;
    for (int i = 0; v->logprobs && i < v->n_out; i++)
        sum += v->logprobs[i];
    return sum;
}

/* The response's choices: of each prompt's best_of candidates, the n with the highest
 * cumulative log-probability (all of them, in order, when best_of == n). */
static int pick_choices(struct gen *g)
{
    const int B = g->ar.best_of, n = g->ar.n;
    int m = 0;
    for (int i = 0; i < g->ar.n_prompts; i++) {
        struct cand *c = g->c + (size_t)i * B;
        bool taken[TDM_SCHED_MAX_GROUP] = {0};
        for (int rank = 0; rank < n; rank++) {
            int best = -1;
            for (int j = 0; j < B; j++)
                if (!taken[j] &&
                    (best < 0 || (B > n && cum_logprob(&c[j].v) > cum_logprob(&c[best].v))))
                    best = j;
            taken[best] = true;
            g->ch[m++] = choice_of(g, &c[best], i * n + rank);
        }
    }
    return m;
}

/* A non-streaming generation: answers when every candidate has finished (or at once when one
 * failed), else suspends (and is called again when resumed). The requests end in gen_free,
 * when libmicrohttpd completes the connection's request. */
static enum MHD_Result gen_continue(struct tdm_server *s, struct MHD_Connection *c, struct gen *g)
{
    int bad = -1;
    for (;;) {
        waiter_look(&g->w);
        int done = 0;
        for (int k = 0; k < g->n_cand; k++) {
            tdm_req_reader_update(g->c[k].rd, g->c[k].req, &g->c[k].v);
            done += g->c[k].v.finish != TDM_FINISH_NONE;
            if (failed(&g->c[k].v) && bad < 0) bad = k;
        }
        if (bad >= 0 || done == g->n_cand) break;
        if (atomic_load(&g->w.gone) || tdm_front_client_gone(c)) return MHD_NO;
        if (waiter_suspend(&g->w)) return MHD_YES;
    }
    if (bad >= 0) {
        char msg[300];
        int status = failure_of(&g->c[bad].v, msg, sizeof msg);
        return tdm_reply_errf(c, s->http, status, "%s", msg);
    }
    int m = pick_choices(g);
    char *body =
        tdm_api_render_full(&s->api, &g->ar, g->id, g->created, g->ch, m, usage_of(g, g->ch, m));
    return tdm_reply_send(c, s->http, 200, body, "application/json");
}

/* Creates the candidates' readers and submits each prompt's candidates as one group. Returns
 * TDM_OK, or the first failure with every request made so far released. */
static tdm_status gen_submit(struct tdm_server *s, struct gen *g)
{
    const struct api_req *ar = &g->ar;
    const int B = ar->best_of;
    tdm_status st = TDM_OK;
    for (int k = 0; k < g->n_cand && st == TDM_OK; k++) {
        g->c[k].prompt = k / B;
        g->c[k].index = k;
        st = tdm_req_reader_create(s->api.tok, (const char *const *)ar->stops, ar->n_stops,
                                   ar->p.max_tokens, ar->p.top_logprobs, &g->c[k].rd);
    }
    struct tdm_req_params ps[TDM_SCHED_MAX_GROUP];
    tdm_req_t *rs[TDM_SCHED_MAX_GROUP];
    for (int i = 0; i < ar->n_prompts && st == TDM_OK; i++) {
        for (int j = 0; j < B; j++) {
            tdm_api_candidate(ar, i, j, &ps[j]);
            ps[j].kv_peer = g->kv_peer[0] ? g->kv_peer : NULL;
            ps[j].notify = waiter_notify;
            ps[j].notify_ctx = &g->w;
        }
        st = tdm_sched_submit_group(s->sched, ps, B, rs);
        for (int j = 0; st == TDM_OK && j < B; j++)
            g->c[i * B + j].req = rs[j];
    }
    if (st != TDM_OK)
        for (int k = 0; k < g->n_cand; k++)
            if (g->c[k].req) {
                tdm_req_release(g->c[k].req); /* cancels it */
                g->c[k].req = NULL;
            }
    return st;
}

/* llm-d's P/D sidecar names the prefill node of a request in this header (HOST:PORT, its HTTP
 * address): a host name or address and a port, nothing else. */
#define PREFILLER_HEADER "x-prefiller-host-port"
static bool prefiller_ok(const char *v)
{
    size_t n = strlen(v);
    if (!n || n >= TDM_REQ_KV_PEER_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)v[i]) && !strchr(".-_:[]", v[i])) return false;
    const char *colon = strrchr(v, ':');
    if (!colon || colon == v || !colon[1] || strlen(colon + 1) > 5) return false;
    for (const char *p = colon + 1; *p; p++) /* a port: digits */
        if (!isdigit((unsigned char)*p)) return false;
    return true;
}

static enum MHD_Result generate(struct tdm_server *s, struct MHD_Connection *c, bool chat,
                                struct tdm_front_body *cc)
{
    if (atomic_load(&s->draining))
        return tdm_reply_errf(c, s->http, 503, "the server is shutting down");
    const char *prefiller = MHD_lookup_connection_value(c, MHD_HEADER_KIND, PREFILLER_HEADER);
    if (prefiller && !prefiller_ok(prefiller))
        return tdm_reply_errf(c, s->http, 400,
                              "%s: '%.64s' is not HOST:PORT (a host name or address and a port, "
                              "under %d bytes)",
                              PREFILLER_HEADER, prefiller, TDM_REQ_KV_PEER_MAX);
    struct api_req ar;
    struct api_err e;
    if (!tdm_api_parse(&s->api, chat, cc->body ? cc->body : "", cc->len, &ar, &e))
        return tdm_reply_err(c, s->http, &e);
    /* the waiter lives in the stream or the generation, made before the submits so that the
     * scheduler's first notify finds it */
    struct stream *sm = NULL;
    struct gen *g = NULL;
    if (ar.stream && (sm = calloc(1, sizeof *sm))) g = &sm->g;
    if (!ar.stream) g = calloc(1, sizeof *g);
    const int n_cand = ar.n_prompts * ar.best_of;
    if (g) {
        g->c = calloc((size_t)n_cand, sizeof *g->c);
        g->ch = calloc((size_t)n_cand, sizeof *g->ch);
    }
    if (!g || !g->c || !g->ch) {
        if (g) {
            free(g->c);
            free(g->ch);
        }
        free(sm ? (void *)sm : (void *)g);
        tdm_api_req_free(&ar);
        return tdm_reply_errf(c, s->http, 500, "out of memory");
    }
    g->srv = s;
    g->ar = ar;
    g->n_cand = n_cand;
    if (prefiller) snprintf(g->kv_peer, sizeof g->kv_peer, "%s", prefiller);
    atomic_fetch_add(&s->active, 1);
    waiter_init(&g->w, s, c);
    tdm_status st = gen_submit(s, g);
    if (st != TDM_OK) {
        int status = st == TDM_EAGAIN || st == TDM_ECANCELED ? 503 : st == TDM_ENOMEM ? 500 : 400;
        tdm_api_err_set(&e, status, NULL, "%s", tdm_err_msg());
        gen_end(g);
        free(sm ? (void *)sm : (void *)g);
        return tdm_reply_err(c, s->http, &e);
    }
    snprintf(g->id, sizeof g->id, "%s-%llx%08llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)tdm_now_ns() & 0xffffffffffull,
             (unsigned long long)tdm_req_id(g->c[0].req));
    g->created = (long)time(NULL);

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
    /* Kubernetes probes: /live fails only when the scheduler is stalled (restart it); /ready
     * is /health's answer (serving: loaded, not draining, not stalled) */
    if (!strcmp(url, "/live") || !strcmp(url, "/ready")) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET %s", url);
        bool live = !strcmp(url, "/live"), stalled = tdm_sched_stall_ms(s->sched) > 0;
        bool ok =
            live ? !stalled : atomic_load(&s->ready) && !atomic_load(&s->draining) && !stalled;
        return tdm_reply_send(
            c, s->http, ok ? 200 : 503,
            strdup(ok        ? (live ? "{\"status\":\"live\"}" : "{\"status\":\"ready\"}")
                   : stalled ? "{\"status\":\"stalled\"}"
                             : "{\"status\":\"not ready\"}"),
            "application/json");
    }
    /* where this node's fabric endpoint listens (a decoder's --prefill-peers http://...) */
    if (!strcmp(url, "/disagg/address")) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET %s", url);
        if (!s->fabric_address)
            return tdm_reply_errf(c, s->http, 404, "not a prefill or decode node");
        json_t *o =
            json_pack("{s:s, s:s}", "role", s->disagg_role, "fabric_address", s->fabric_address);
        char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        return tdm_reply_send(c, s->http, 200, body, "application/json");
    }
    if (!strcmp(url, "/metrics")) {
        if (!get) return tdm_reply_errf(c, s->http, 405, "use GET /metrics");
        struct tdm_sched_metrics_snapshot m;
        tdm_sched_metrics(s->sched, &m);
        uint64_t http[6];
        for (int i = 0; i < 6; i++)
            http[i] = atomic_load(&s->http[i]);
        struct api_grammar_metrics gm = {.on = s->api.gvocab != NULL};
        if (gm.on) tdm_gvocab_cache_stats(s->api.gvocab, &gm.entries, &gm.hits, &gm.misses);
        char *text = tdm_metrics_render(&m, &gm, http, s->model_name);
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
         is_detok = !strcmp(url, "/detokenize"), is_reset = !strcmp(url, "/reset_prefix_cache");
    if (is_reset) { /* vLLM's: drops the prefix cache's entries (a cache off: nothing to do) */
        if (!tdm_front_bearer_ok(c, s->api_key))
            return tdm_reply_errf(c, s->http, 401,
                                  "missing or invalid API key (send Authorization: Bearer <key>)");
        if (!post) return tdm_reply_errf(c, s->http, 405, "use POST /reset_prefix_cache");
        tdm_sched_flush_prefix_cache(s->sched);
        return tdm_reply_send(c, s->http, 200, strdup("{\"status\":\"ok\"}"), "application/json");
    }
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
    s->fabric_address = o->fabric_address ? strdup(o->fabric_address) : NULL;
    snprintf(s->disagg_role, sizeof s->disagg_role, "%s", o->disagg_role ? o->disagg_role : "");
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
    if (!o->no_generate) { /* structured output's view of the vocabulary (the model's rows) */
        const int *eos;
        int n_eos = tdm_sched_eos(sched, &eos);
        if (tdm_gvocab_create(m->tok, tdm_sched_vocab(sched), eos, n_eos, &s->api.gvocab) != TDM_OK)
            TDM_WARN("server: structured output is off: %s", tdm_err_msg());
    }
    struct tdm_sched_metrics_snapshot ms;
    tdm_sched_metrics(sched, &ms);
    s->api.prefix_caching = ms.prefix_on;
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
    tdm_gvocab_free(s->api.gvocab);
    free(s->model_name);
    free(s->api_key);
    free(s->fabric_address);
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
    tdm_gvocab_free(s->api.gvocab); /* after the scheduler let go of every request's grammar */
    free(s->model_name);
    free(s->api_key);
    free(s->fabric_address);
    free(s);
}
