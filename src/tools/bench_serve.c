/*
 * `tandem bench serve`: a load generator for OpenAI-compatible servers.
 *
 * What it does: sends --num-prompts streaming requests to /v1/completions or
 * /v1/chat/completions, with arrival times drawn from a Poisson process at --rate (or all at once
 * for `inf`), never more than --concurrency in flight, and measures per request the time to first
 * token (TTFT), the gaps between streamed chunks (ITL), the time per output token after the first
 * (TPOT = (e2e - ttft) / (n_out - 1)) and the end-to-end latency. It prints percentiles and
 * throughputs, and writes a JSON summary with one record per request.
 *
 * Shape: a fixed pool of min(concurrency, num_prompts) worker threads pulls request indices in
 * order from an atomic counter; a worker that takes request i sleeps until i's arrival time, then
 * runs it to completion. This is exactly "start each request at max(its arrival, the moment a
 * slot frees)", the semantics of a semaphore-bounded open loop, without a dispatcher thread.
 * The main thread only draws the progress bar and, at the end, the statistics.
 *
 * Determinism: every random draw (prompt lengths, token ids, words, arrival gaps) comes from the
 * counter-based RNG keyed by (seed, request index, position), so the workload depends on the
 * seed alone, never on thread timing. Request bodies are built by the worker that sends them, so
 * memory stays O(concurrency x prompt), not O(num_prompts x prompt).
 *
 * Counting: a "token chunk" is a stream event whose first choice carries non-empty text
 * (completions: choices[0].text; chat: choices[0].delta.content or reasoning_content). Output
 * tokens come from the usage of the final chunk (requested with stream_options.include_usage)
 * when the server sends it, else from the number of token chunks. Input tokens likewise come
 * from usage.prompt_tokens, else from the planned prompt length (token ids or words).
 *
 * Errors are counted by kind: connect, timeout, send, truncated (closed mid-stream or no
 * [DONE]), protocol (bad HTTP, SSE or JSON), error_event (an {"error":...} chunk), no_output,
 * http_<status>. A failed request counts in no latency statistic.
 *
 * Ownership: the plan (struct bs_plan) is read-only once the workers start; each request record
 * is written only by the worker running it and read by the main thread after the joins (the
 * progress bar reads only atomics).
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "server/httpc.h"
#include "tools/tools_int.h"

#define MAX_PROMPTS        1000000
#define MAX_CONCURRENCY    4096
#define MAX_LEN            1000000
#define MAX_EVENT_BYTES    (8u << 20)  /* one SSE line or event, or one JSON response body */
#define MAX_ERR_BODY_BYTES 1024        /* kept from an error response for the message */
#define MAX_ITL_TOTAL      (32l << 20) /* ITL samples kept over the whole run (8 bytes each) */
#define MAX_DATASET_BYTES  ((size_t)1 << 30)

enum bs_endpoint { EP_COMPLETIONS, EP_CHAT };
enum bs_source { SRC_IDS, SRC_WORDS, SRC_FILE };

struct bs_line {      /* one JSONL dataset line, validated at load */
    json_t *prompt;   /* string or array of ids (completions), or NULL */
    json_t *messages; /* array (chat), or NULL */
    int max_tokens;   /* 0: use the output length distribution */
    int n_in_planned; /* ids: their count; text: 0 (unknown) */
};

struct bs_plan {
    struct tdm_bh_target target;
    enum bs_endpoint endpoint;
    enum bs_source source;
    const char *url, *model, *api_key, *dataset;
    double rate; /* req/s; INFINITY for all at once */
    int concurrency, num_prompts;
    int input_len, output_len;
    int prefix_len; /* synthetic: a prefix of this many tokens (words) every prompt shares */
    double input_range, output_range;
    int64_t token_lo, token_hi; /* synthetic ids drawn from [lo, hi) */
    uint64_t seed;
    bool ignore_eos;
    double timeout_s;
    json_t *extra_body; /* object merged into each request, or NULL */
    struct bs_line *lines;
    int n_lines;
    double *sched_s; /* [num_prompts] arrival offsets from the start, seconds */
};

struct bs_req {                    /* one request's outcome */
    double start_s, ttft_s, end_s; /* from the run's start; ttft relative to start_s; -1: none */
    int n_in, n_out, n_chunks;
    bool in_from_usage, out_from_usage, ok;
    double *itl_s; /* gaps between token chunks, seconds */
    int n_itl, cap_itl;
    char err[24];
    char msg[160];
};

struct bs_run {
    const struct bs_plan *plan;
    struct bs_req *reqs;
    uint64_t t0_ns;
    atomic_int next, done, failed, in_flight, peak_in_flight;
    atomic_long itl_total;
};

/* ---- workload ---- */

static const char *const WORDS[] = {
    "the",    "of",      "and",      "to",     "in",      "is",     "was",    "that",
    "for",    "on",      "with",     "as",     "by",      "at",     "from",   "his",
    "her",    "an",      "which",    "they",   "time",    "people", "water",  "house",
    "world",  "school",  "number",   "part",   "place",   "case",   "week",   "system",
    "group",  "point",   "fact",     "river",  "city",    "light",  "music",  "story",
    "night",  "paper",   "table",    "window", "garden",  "market", "letter", "animal",
    "summer", "winter",  "mountain", "forest", "bridge",  "stone",  "green",  "small",
    "large",  "early",   "young",    "simple", "quiet",   "bright", "open",   "slowly",
    "always", "never",   "often",    "today",  "about",   "after",  "before", "under",
    "over",   "between", "through",  "during", "without", "again",  "later",  "walk",
    "read",   "write",   "think",    "build",  "carry",   "follow", "listen", "travel",
    "answer", "remember"};

static double rng(const struct bs_plan *p, int i, uint32_t pos, uint32_t draw)
{
    return tdm_rng_uniform(p->seed, (uint64_t)i, pos, draw);
}

/* Uniform integer in [round(mean(1-r)), round(mean(1+r))], at least 1. */
static int draw_len(int mean, double range, double u)
{
    long lo = lround(mean * (1.0 - range)), hi = lround(mean * (1.0 + range));
    if (lo < 1) lo = 1;
    if (hi < lo) hi = lo;
    long v = lo + (long)(u * (double)(hi - lo + 1));
    return (int)(v > hi ? hi : v);
}

/* Builds request i's JSON body (malloc'd, caller frees). Sets its planned lengths. */
static char *build_body(const struct bs_plan *p, int i, int *n_in_planned, int *max_tokens)
{
    json_t *root = json_object(), *prompt = NULL;
    char *out = NULL, *text = NULL;
    if (!root) return NULL;
    int n_out = draw_len(p->output_len, p->output_range, rng(p, i, 0, 1));
    int n_in = draw_len(p->input_len, p->input_range, rng(p, i, 0, 0));
    /* the shared prefix's draws are request -1's, the same for every request */
    const int pre = p->source == SRC_FILE ? 0 : p->prefix_len;
    if (p->source == SRC_IDS) {
        prompt = json_array();
        for (int k = 0; prompt && k < pre + n_in; k++) {
            double u =
                k < pre ? rng(p, -1, (uint32_t)k + 1, 2) : rng(p, i, (uint32_t)(k - pre) + 1, 0);
            int64_t id = p->token_lo + (int64_t)(u * (double)(p->token_hi - p->token_lo));
            if (json_array_append_new(prompt, json_integer(id))) goto out_free;
        }
    } else if (p->source == SRC_WORDS) {
        size_t cap = (size_t)(pre + n_in) * 12 + 1, len = 0;
        text = malloc(cap);
        if (!text) goto out_free;
        for (int k = 0; k < pre + n_in; k++) {
            double u =
                k < pre ? rng(p, -1, (uint32_t)k + 1, 2) : rng(p, i, (uint32_t)(k - pre) + 1, 0);
            size_t w = (size_t)(u * TDM_ARRAY_LEN(WORDS));
            len += (size_t)snprintf(text + len, cap - len, "%s%s", k ? " " : "", WORDS[w]);
        }
        prompt = json_string(text);
    } else {
        const struct bs_line *ln = &p->lines[i % p->n_lines];
        n_in = ln->n_in_planned;
        if (ln->max_tokens > 0) n_out = ln->max_tokens;
        prompt = json_deep_copy(ln->messages ? ln->messages : ln->prompt);
    }
    if (!prompt) goto out_free;
    if (p->endpoint == EP_CHAT && !json_is_array(prompt)) { /* wrap text as one user message */
        json_t *msgs = json_pack("[{s:s, s:O}]", "role", "user", "content", prompt);
        json_decref(prompt);
        prompt = msgs;
        if (!prompt) goto out_free;
    }
    if (json_object_set_new(root, "model", json_string(p->model)) ||
        json_object_set(root, p->endpoint == EP_CHAT ? "messages" : "prompt", prompt) ||
        json_object_set_new(root, "max_tokens", json_integer(n_out)) ||
        json_object_set_new(root, "stream", json_true()) ||
        json_object_set_new(root, "stream_options", json_pack("{s:b}", "include_usage", 1)))
        goto out_free;
    if (p->ignore_eos && (json_object_set_new(root, "ignore_eos", json_true()) ||
                          json_object_set_new(root, "min_tokens", json_integer(n_out))))
        goto out_free;
    if (p->extra_body && json_object_update(root, p->extra_body)) goto out_free;
    out = json_dumps(root, JSON_COMPACT);
    *n_in_planned = pre + n_in;
    *max_tokens = n_out;
out_free:
    free(text);
    json_decref(prompt);
    json_decref(root);
    return out;
}

static tdm_status load_dataset(struct bs_plan *p)
{
    char *buf = NULL;
    size_t len = 0;
    tdm_status st = tdm_file_read(p->dataset, MAX_DATASET_BYTES, &buf, &len);
    if (st) return st;
    int cap = 0, lineno = 0;
    char *save = NULL;
    for (char *ln = strtok_r(buf, "\n", &save); ln; ln = strtok_r(NULL, "\n", &save)) {
        lineno++;
        size_t n = strlen(ln);
        while (n && (ln[n - 1] == '\r' || ln[n - 1] == ' ' || ln[n - 1] == '\t'))
            ln[--n] = '\0';
        if (!n) continue;
        json_error_t jerr;
        json_t *o = json_loadb(ln, n, 0, &jerr);
        struct bs_line L = {0};
        const char *why = NULL;
        if (!json_is_object(o)) {
            why = "not a JSON object";
            goto bad;
        }
        json_t *pr = json_object_get(o, "prompt"), *ms = json_object_get(o, "messages");
        json_t *mt = json_object_get(o, "max_tokens");
        if (mt && (!json_is_integer(mt) || json_integer_value(mt) < 1 ||
                   json_integer_value(mt) > MAX_LEN)) {
            why = "max_tokens must be an integer in [1, 1000000]";
            goto bad;
        }
        L.max_tokens = mt ? (int)json_integer_value(mt) : 0;
        if (ms) {
            if (!json_is_array(ms) || !json_array_size(ms)) {
                why = "messages must be a non-empty array";
                goto bad;
            }
            if (p->endpoint != EP_CHAT) {
                why = "has messages, which need --endpoint chat";
                goto bad;
            }
            L.messages = json_incref(ms);
        } else if (json_is_string(pr) && json_string_length(pr) > 0) {
            L.prompt = json_incref(pr);
        } else if (json_is_array(pr) && json_array_size(pr) > 0) {
            size_t k;
            json_t *v;
            json_array_foreach(pr, k, v)
            {
                if (!json_is_integer(v) || json_integer_value(v) < 0) {
                    why = "prompt ids must be non-negative integers";
                    goto bad;
                }
            }
            if (p->endpoint == EP_CHAT) {
                why = "token-id prompts need --endpoint completions";
                goto bad;
            }
            L.prompt = json_incref(pr);
            L.n_in_planned = (int)json_array_size(pr);
        } else {
            why = "needs a non-empty \"prompt\" (string or token ids) or \"messages\"";
            goto bad;
        }
        json_decref(o);
        if (p->n_lines == cap) {
            cap = cap ? cap * 2 : 64;
            struct bs_line *nl = realloc(p->lines, (size_t)cap * sizeof *nl);
            if (!nl) {
                json_decref(L.prompt);
                json_decref(L.messages);
                st = tdm_err_set(TDM_ENOMEM, "out of memory");
                goto out;
            }
            p->lines = nl;
        }
        p->lines[p->n_lines++] = L;
        continue;
    bad:
        json_decref(o);
        st = tdm_err_set(TDM_EFORMAT, "%s line %d: %s", p->dataset, lineno, why ? why : jerr.text);
        goto out;
    }
    if (!p->n_lines) st = tdm_err_set(TDM_EFORMAT, "%s: no prompts", p->dataset);
out:
    free(buf);
    return st;
}

/* ---- one request ---- */

struct bs_stream { /* parse state of one response, on the worker's stack */
    struct bs_run *run;
    struct bs_req *r;
    uint64_t start_ns, last_ns, now_ns;
    int status;
    bool sse, done, stop_err;
    char *line; /* partial SSE line, or the whole body of a non-SSE response */
    size_t line_len, line_cap;
    char *data; /* the current event's data lines, '\n'-joined */
    size_t data_len, data_cap;
};

static void copy_str(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strnlen(src, cap - 1) : 0;
    if (n) memcpy(dst, src, n);
    dst[n] = '\0';
}

static void set_err(struct bs_req *r, const char *kind, const char *msg)
{
    copy_str(r->err, sizeof r->err, kind);
    copy_str(r->msg, sizeof r->msg, msg);
}

static bool append(char **buf, size_t *len, size_t *cap, const char *p, size_t n)
{
    if (*len + n + 1 > MAX_EVENT_BYTES) return false;
    if (*len + n + 1 > *cap) {
        size_t nc = TDM_MAX(*cap * 2, *len + n + 1);
        if (nc < 4096) nc = 4096;
        if (nc > MAX_EVENT_BYTES) nc = MAX_EVENT_BYTES;
        char *nb = realloc(*buf, nc);
        if (!nb) return false;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = '\0';
    return true;
}

static void token_chunk(struct bs_stream *s)
{
    struct bs_req *r = s->r;
    if (r->n_chunks++ == 0) {
        r->ttft_s = (double)(s->now_ns - s->start_ns) * 1e-9;
    } else if (atomic_fetch_add(&s->run->itl_total, 1) < MAX_ITL_TOTAL) {
        if (r->n_itl == r->cap_itl) {
            int nc = r->cap_itl ? r->cap_itl * 2 : 64;
            double *n = realloc(r->itl_s, (size_t)nc * sizeof *n);
            if (!n) return;
            r->itl_s = n;
            r->cap_itl = nc;
        }
        r->itl_s[r->n_itl++] = (double)(s->now_ns - s->last_ns) * 1e-9;
    }
    s->last_ns = s->now_ns;
}

static const char *first_text(json_t *choice)
{
    const char *keys[][2] = {{"text", NULL},
                             {"delta", "content"},
                             {"delta", "reasoning_content"},
                             {"message", "content"}};
    for (size_t k = 0; k < TDM_ARRAY_LEN(keys); k++) {
        json_t *v = json_object_get(choice, keys[k][0]);
        if (keys[k][1]) v = json_is_object(v) ? json_object_get(v, keys[k][1]) : NULL;
        if (json_is_string(v) && json_string_length(v) > 0) return json_string_value(v);
    }
    return NULL;
}

/* Handles one event's data (or a whole JSON response). False stops the stream. */
static bool on_event(struct bs_stream *s, const char *data, size_t n)
{
    struct bs_req *r = s->r;
    if (n == 6 && !memcmp(data, "[DONE]", 6)) {
        s->done = true;
        r->end_s = (double)(s->now_ns - s->run->t0_ns) * 1e-9;
        return false;
    }
    json_error_t jerr;
    json_t *o = json_loadb(data, n, 0, &jerr);
    if (!json_is_object(o)) {
        char msg[256];
        snprintf(msg, sizeof msg, "a stream event is not a JSON object: %.100s",
                 o ? "another JSON value" : jerr.text);
        set_err(r, "protocol", msg);
        json_decref(o);
        s->stop_err = true;
        return false;
    }
    json_t *e = json_object_get(o, "error");
    if (e && !json_is_null(e)) {
        json_t *m = json_is_object(e) ? json_object_get(e, "message") : e;
        set_err(r, "error_event", json_is_string(m) ? json_string_value(m) : "error event");
        json_decref(o);
        s->stop_err = true;
        return false;
    }
    json_t *ch = json_object_get(o, "choices");
    if (json_is_array(ch) && json_array_size(ch) > 0 && first_text(json_array_get(ch, 0)))
        token_chunk(s);
    json_t *u = json_object_get(o, "usage");
    if (json_is_object(u)) {
        json_t *ct = json_object_get(u, "completion_tokens"), *pt;
        pt = json_object_get(u, "prompt_tokens");
        if (json_is_integer(ct) && json_integer_value(ct) >= 0 &&
            json_integer_value(ct) < INT32_MAX) {
            r->n_out = (int)json_integer_value(ct);
            r->out_from_usage = true;
        }
        if (json_is_integer(pt) && json_integer_value(pt) >= 0 &&
            json_integer_value(pt) < INT32_MAX) {
            r->n_in = (int)json_integer_value(pt);
            r->in_from_usage = true;
        }
    }
    json_decref(o);
    return true;
}

static bool sse_line(struct bs_stream *s, char *ln, size_t n)
{
    if (n && ln[n - 1] == '\r') ln[--n] = '\0';
    if (n == 0) { /* blank line: dispatch */
        if (!s->data_len) return true;
        size_t dn = s->data_len - 1; /* drop the last '\n' */
        bool go = on_event(s, s->data, dn);
        s->data_len = 0;
        return go;
    }
    if (n >= 5 && !memcmp(ln, "data:", 5)) {
        const char *v = ln + 5;
        if (*v == ' ') v++;
        if (!append(&s->data, &s->data_len, &s->data_cap, v, n - (size_t)(v - ln)) ||
            !append(&s->data, &s->data_len, &s->data_cap, "\n", 1)) {
            set_err(s->r, "protocol", "a stream event is over 8 MiB");
            s->stop_err = true;
            return false;
        }
    }
    return true; /* comments, event:, id:, retry: carry nothing we measure */
}

static bool cb_head(void *ctx, int status, const char *content_type)
{
    struct bs_stream *s = ctx;
    s->status = status;
    s->sse = !strncasecmp(content_type, "text/event-stream", 17);
    return true;
}

static bool cb_body(void *ctx, const char *p, size_t n)
{
    struct bs_stream *s = ctx;
    s->now_ns = tdm_now_ns();
    if (s->status != 200) { /* keep the start of an error body for the message */
        size_t room = s->line_len < MAX_ERR_BODY_BYTES ? MAX_ERR_BODY_BYTES - s->line_len : 0;
        if (room && !append(&s->line, &s->line_len, &s->line_cap, p, TDM_MIN(n, room)))
            return false;
        return true;
    }
    if (!s->sse) {
        if (append(&s->line, &s->line_len, &s->line_cap, p, n)) return true;
        set_err(s->r, "protocol", "a JSON response is over 8 MiB");
        s->stop_err = true;
        return false;
    }
    while (n > 0) {
        const char *nl = memchr(p, '\n', n);
        size_t k = nl ? (size_t)(nl - p) : n;
        if (!append(&s->line, &s->line_len, &s->line_cap, p, k)) {
            set_err(s->r, "protocol", "a stream line is over 8 MiB");
            s->stop_err = true;
            return false;
        }
        if (!nl) break;
        p += k + 1;
        n -= k + 1;
        size_t line_len = s->line_len;
        s->line_len = 0;
        if (!sse_line(s, s->line, line_len)) return false;
    }
    return true;
}

static void error_message_from_body(struct bs_stream *s, char *msg, size_t cap)
{
    msg[0] = '\0';
    if (!s->line_len) return;
    json_t *o = json_loadb(s->line, s->line_len, 0, NULL);
    json_t *e = json_object_get(o, "error");
    json_t *m = json_is_object(e) ? json_object_get(e, "message") : e;
    if (!json_is_string(m)) m = json_object_get(o, "message");
    if (json_is_string(m))
        snprintf(msg, cap, "%s", json_string_value(m));
    else
        snprintf(msg, cap, "%.*s", (int)TDM_MIN(s->line_len, cap - 1), s->line);
    json_decref(o);
}

static void run_one(struct bs_run *run, int i)
{
    const struct bs_plan *p = run->plan;
    struct bs_req *r = &run->reqs[i];
    struct bs_stream s = {.run = run, .r = r};
    int n_in = 0, max_tokens = 0;
    char *body = build_body(p, i, &n_in, &max_tokens);
    r->ttft_s = -1;
    r->n_in = n_in;
    s.start_ns = s.now_ns = tdm_now_ns();
    r->start_s = (double)(s.start_ns - run->t0_ns) * 1e-9;
    if (!body) {
        set_err(r, "nomem", "cannot build the request body");
        goto out;
    }
    struct tdm_bh_request rq = {
        .method = "POST",
        .path = p->endpoint == EP_CHAT ? "/v1/chat/completions" : "/v1/completions",
        .bearer = p->api_key,
        .body = body,
        .body_len = strlen(body),
        .deadline_ns = s.start_ns + (uint64_t)(p->timeout_s * 1e9),
        .connect_timeout_ms = 10000,
    };
    struct tdm_bh_handler h = {cb_head, cb_body, &s};
    enum tdm_bh_fail f = tdm_bh_request(&p->target, &rq, &h);
    s.now_ns = tdm_now_ns();
    if (s.stop_err) goto out; /* kind already set */
    if (f != TDM_BH_OK && !(f == TDM_BH_ABORTED && s.done)) {
        set_err(r, tdm_bh_fail_str(f), tdm_err_msg());
        goto out;
    }
    if (s.status != 200) {
        char kind[24], msg[160];
        snprintf(kind, sizeof kind, "http_%d", s.status);
        error_message_from_body(&s, msg, sizeof msg);
        set_err(r, kind, msg);
        goto out;
    }
    if (!s.sse) { /* the server ignored "stream": one JSON response */
        r->end_s = (double)(s.now_ns - run->t0_ns) * 1e-9;
        if (!on_event(&s, s.line ? s.line : "", s.line_len)) goto out;
        s.done = true;
    } else if (!s.done) {
        if (s.line_len) sse_line(&s, s.line, s.line_len); /* unterminated last line */
        if (!s.done && !s.stop_err) sse_line(&s, (char[]){""}, 0);
        if (s.stop_err) goto out;
        if (!s.done) {
            set_err(r, "truncated", "the stream ended without data: [DONE]");
            goto out;
        }
    }
    if (!r->out_from_usage) r->n_out = r->n_chunks;
    if (r->n_out <= 0 || r->n_chunks == 0) {
        set_err(r, "no_output", "the response carried no output text");
        goto out;
    }
    r->ok = true;
out:
    if (r->end_s < 0 || !r->ok) r->end_s = (double)(s.now_ns - run->t0_ns) * 1e-9;
    if (!r->ok) r->n_itl = 0;
    free(body);
    free(s.line);
    free(s.data);
}

static void *worker(void *arg)
{
    struct bs_run *run = arg;
    const struct bs_plan *p = run->plan;
    for (;;) {
        int i = atomic_fetch_add(&run->next, 1);
        if (i >= p->num_prompts) break;
        uint64_t at = run->t0_ns + (uint64_t)(p->sched_s[i] * 1e9);
        struct timespec ts = {(time_t)(at / 1000000000ull), (long)(at % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        int now = atomic_fetch_add(&run->in_flight, 1) + 1,
            peak = atomic_load(&run->peak_in_flight);
        while (now > peak && !atomic_compare_exchange_weak(&run->peak_in_flight, &peak, now)) {
        }
        run->reqs[i].end_s = -1;
        run_one(run, i);
        atomic_fetch_sub(&run->in_flight, 1);
        if (!run->reqs[i].ok) atomic_fetch_add(&run->failed, 1);
        atomic_fetch_add(&run->done, 1);
    }
    return NULL;
}

/* ---- statistics and report ---- */

struct bs_stat {
    int n;
    double mean, p50, p90, p99, min, max; /* milliseconds */
};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Percentiles by linear interpolation between order statistics (numpy's default). */
static struct bs_stat stat_of(double *v, int n)
{
    struct bs_stat s = {.n = n};
    if (n == 0) return s;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    double q[3] = {50, 90, 99}, out[3];
    for (int k = 0; k < 3; k++) {
        double pos = q[k] / 100.0 * (n - 1);
        int lo = (int)floor(pos);
        int hi = lo + 1 < n ? lo + 1 : lo;
        out[k] = v[lo] + (v[hi] - v[lo]) * (pos - lo);
    }
    s.mean = sum / n * 1e3;
    s.p50 = out[0] * 1e3;
    s.p90 = out[1] * 1e3;
    s.p99 = out[2] * 1e3;
    s.min = v[0] * 1e3;
    s.max = v[n - 1] * 1e3;
    return s;
}

static json_t *stat_json(const struct bs_stat *s)
{
    if (!s->n)
        return json_pack("{s:i,s:n,s:n,s:n,s:n,s:n,s:n}", "n", 0, "mean", "p50", "p90", "p99",
                         "min", "max");
    return json_pack("{s:i,s:f,s:f,s:f,s:f,s:f,s:f}", "n", s->n, "mean", s->mean, "p50", s->p50,
                     "p90", s->p90, "p99", s->p99, "min", s->min, "max", s->max);
}

static void print_stat(const char *name, const struct bs_stat *s)
{
    if (!s->n) {
        printf("%-6s %10s %10s %10s %10s %10s   (no samples)\n", name, "-", "-", "-", "-", "-");
        return;
    }
    printf("%-6s %10.2f %10.2f %10.2f %10.2f %10.2f   (%d samples)\n", name, s->mean, s->p50,
           s->p90, s->p99, s->max, s->n);
}

static void progress(struct bs_run *run, bool final)
{
    int n = run->plan->num_prompts, done = atomic_load(&run->done);
    int failed = atomic_load(&run->failed), width = 30, fill = (int)((int64_t)done * width / n);
    double el = (double)(tdm_now_ns() - run->t0_ns) * 1e-9;
    fprintf(stderr, "\r[");
    for (int i = 0; i < width; i++)
        fputc(i < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %d/%d  failed %d  in flight %d  %.1f s ", done, n, failed,
            atomic_load(&run->in_flight), el);
    if (final) fputc('\n', stderr);
    fflush(stderr);
}

struct bs_errcount {
    char kind[24];
    int n;
    char example[160];
};

static int report(const struct bs_plan *p, struct bs_run *run, const char *json_path)
{
    int n = p->num_prompts, ok = 0, n_err_kinds = 0, from_usage = 0;
    int64_t in_tok = 0, out_tok = 0, n_itl = 0;
    double end = 0;
    struct bs_errcount errs[32];
    for (int i = 0; i < n; i++) {
        struct bs_req *r = &run->reqs[i];
        if (r->end_s > end) end = r->end_s;
        if (r->ok) {
            ok++;
            in_tok += r->n_in;
            out_tok += r->n_out;
            n_itl += r->n_itl;
            from_usage += r->out_from_usage;
            continue;
        }
        int k = 0;
        while (k < n_err_kinds && strcmp(errs[k].kind, r->err))
            k++;
        if (k == n_err_kinds && n_err_kinds < (int)TDM_ARRAY_LEN(errs)) {
            copy_str(errs[k].kind, sizeof errs[k].kind, r->err);
            copy_str(errs[k].example, sizeof errs[k].example, r->msg);
            errs[k].n = 0;
            n_err_kinds++;
        }
        if (k < n_err_kinds) errs[k].n++;
    }
    double *ttft = malloc(sizeof(double) * (size_t)(ok + 1));
    double *tpot = malloc(sizeof(double) * (size_t)(ok + 1));
    double *e2e = malloc(sizeof(double) * (size_t)(ok + 1));
    double *itl = malloc(sizeof(double) * (size_t)(n_itl + 1));
    int rc = 1;
    json_t *root = NULL;
    if (!ttft || !tpot || !e2e || !itl) {
        fprintf(stderr, "tandem: bench serve: out of memory for the statistics\n");
        goto out_free;
    }
    int nt = 0, np = 0, ni = 0;
    for (int i = 0; i < n; i++) {
        struct bs_req *r = &run->reqs[i];
        if (!r->ok) continue;
        double lat = r->end_s - r->start_s;
        ttft[nt] = r->ttft_s;
        e2e[nt++] = lat;
        if (r->n_out > 1) tpot[np++] = (lat - r->ttft_s) / (r->n_out - 1);
        if (r->n_itl) memcpy(itl + ni, r->itl_s, (size_t)r->n_itl * sizeof *itl);
        ni += r->n_itl;
    }
    struct bs_stat s_ttft = stat_of(ttft, nt), s_tpot = stat_of(tpot, np);
    struct bs_stat s_itl = stat_of(itl, ni), s_e2e = stat_of(e2e, nt);
    double dur = end > 0 ? end : 1e-9;

    printf("==================== tandem bench serve ====================\n");
    printf("url:              %s (%s)\n", p->url,
           p->endpoint == EP_CHAT ? "/v1/chat/completions" : "/v1/completions");
    printf("model:            %s\n", p->model);
    char rate[32];
    if (isinf(p->rate))
        snprintf(rate, sizeof rate, "inf");
    else
        snprintf(rate, sizeof rate, "%g req/s", p->rate);
    printf("load:             rate %s, concurrency %d (peak in flight %d)\n", rate, p->concurrency,
           atomic_load(&run->peak_in_flight));
    printf("requests:         %d sent, %d ok, %d failed\n", n, ok, n - ok);
    for (int k = 0; k < n_err_kinds; k++)
        printf("  %-15s %d  (e.g. %s)\n", errs[k].kind, errs[k].n, errs[k].example);
    printf("duration:         %.3f s\n", dur);
    printf("input tokens:     %lld  (%.1f tok/s)\n", (long long)in_tok, (double)in_tok / dur);
    printf("output tokens:    %lld  (%.1f tok/s; %d of %d counts from usage)\n", (long long)out_tok,
           (double)out_tok / dur, from_usage, ok);
    printf("request rate:     %.3f req/s\n", ok / dur);
    printf("%-6s %10s %10s %10s %10s %10s   (ms)\n", "", "mean", "p50", "p90", "p99", "max");
    print_stat("TTFT", &s_ttft);
    print_stat("TPOT", &s_tpot);
    print_stat("ITL", &s_itl);
    print_stat("E2E", &s_e2e);
    fflush(stdout);

    rc = ok > 0 ? 0 : 1;
    if (!ok) fprintf(stderr, "tandem: bench serve: every request failed\n");
    if (!json_path) goto out_free;

    json_t *errors = json_object(), *reqs = json_array(), *cfg;
    char date[32];
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    cfg = json_pack("{s:o,s:i,s:i,s:s,s:i,s:f,s:i,s:f,s:I,s:b,s:f}", "rate",
                    isinf(p->rate) ? json_string("inf") : json_real(p->rate), "concurrency",
                    p->concurrency, "num_prompts", p->num_prompts, "dataset",
                    p->source == SRC_IDS     ? "random-ids"
                    : p->source == SRC_WORDS ? "random-words"
                                             : p->dataset,
                    "input_len", p->input_len, "input_len_range", p->input_range, "output_len",
                    p->output_len, "output_len_range", p->output_range, "seed", (json_int_t)p->seed,
                    "ignore_eos", p->ignore_eos, "timeout_s", p->timeout_s);
    if (cfg) json_object_set_new(cfg, "prefix_len", json_integer(p->prefix_len));
    for (int k = 0; k < n_err_kinds; k++)
        json_object_set_new(errors, errs[k].kind, json_integer(errs[k].n));
    for (int i = 0; reqs && i < n; i++) {
        struct bs_req *r = &run->reqs[i];
        json_t *o = json_pack(
            "{s:f,s:f,s:o,s:f,s:i,s:i,s:i,s:b,s:o,s:o}", "scheduled_s", p->sched_s[i], "start_s",
            r->start_s, "ttft_ms", r->ok ? json_real(r->ttft_s * 1e3) : json_null(), "e2e_ms",
            (r->end_s - r->start_s) * 1e3, "input_tokens", r->n_in, "output_tokens",
            r->ok ? r->n_out : 0, "chunks", r->n_chunks, "output_tokens_from_usage",
            r->out_from_usage, "error", r->ok ? json_null() : json_string(r->err), "error_message",
            r->ok ? json_null() : json_string(r->msg));
        if (!o || json_array_append_new(reqs, o)) {
            json_decref(reqs);
            reqs = NULL;
        }
    }
    root = json_pack(
        "{s:s,s:s,s:s,s:s,s:s,s:s,s:o,s:f,s:i,s:i,s:i,s:o,s:I,s:I,s:i,s:f,s:f,s:f,s:f,s:o,s:o,s:o,"
        "s:o,s:i,s:o}",
        "tool", "tandem bench serve", "version", TDM_VERSION, "date", date, "url", p->url,
        "endpoint", p->endpoint == EP_CHAT ? "chat" : "completions", "model", p->model, "config",
        cfg, "duration_s", dur, "num_requests", n, "completed", ok, "failed", n - ok, "errors",
        errors, "total_input_tokens", (json_int_t)in_tok, "total_output_tokens",
        (json_int_t)out_tok, "output_tokens_from_usage", from_usage, "request_throughput", ok / dur,
        "input_token_throughput", (double)in_tok / dur, "output_token_throughput",
        (double)out_tok / dur, "total_token_throughput", (double)(in_tok + out_tok) / dur,
        "ttft_ms", stat_json(&s_ttft), "tpot_ms", stat_json(&s_tpot), "itl_ms", stat_json(&s_itl),
        "e2e_ms", stat_json(&s_e2e), "peak_in_flight", atomic_load(&run->peak_in_flight),
        "requests", reqs ? reqs : json_null());
    if (!root || json_dump_file(root, json_path, JSON_INDENT(1)) != 0) {
        fprintf(stderr, "tandem: bench serve: cannot write %s\n", json_path);
        rc = 1;
    }
out_free:
    json_decref(root);
    free(ttft);
    free(tpot);
    free(e2e);
    free(itl);
    return rc;
}

/* ---- model discovery ---- */

struct bs_collect {
    int status;
    char *buf;
    size_t len, cap;
};

static bool collect_head(void *ctx, int status, const char *ct)
{
    ((struct bs_collect *)ctx)->status = status;
    return true;
}

static bool collect_body(void *ctx, const char *p, size_t n)
{
    struct bs_collect *c = ctx;
    return append(&c->buf, &c->len, &c->cap, p, n);
}

static char *discover_model(const struct bs_plan *p)
{
    struct bs_collect c = {0};
    struct tdm_bh_request rq = {.method = "GET",
                                .path = "/v1/models",
                                .bearer = p->api_key,
                                .deadline_ns =
                                    tdm_now_ns() + (uint64_t)(TDM_MIN(p->timeout_s, 30) * 1e9),
                                .connect_timeout_ms = 10000};
    struct tdm_bh_handler h = {collect_head, collect_body, &c};
    char *out = NULL;
    enum tdm_bh_fail f = tdm_bh_request(&p->target, &rq, &h);
    if (f) {
        fprintf(stderr, "tandem: bench serve: GET %s/v1/models: %s\n", p->url, tdm_err_msg());
        goto out;
    }
    if (c.status != 200) {
        fprintf(stderr, "tandem: bench serve: GET %s/v1/models: HTTP %d (pass --model)\n", p->url,
                c.status);
        goto out;
    }
    json_t *o = json_loadb(c.buf ? c.buf : "", c.len, 0, NULL);
    json_t *d = json_object_get(o, "data");
    json_t *id = json_is_array(d) ? json_object_get(json_array_get(d, 0), "id") : NULL;
    if (json_is_string(id))
        out = strdup(json_string_value(id));
    else
        fprintf(stderr, "tandem: bench serve: GET %s/v1/models: no data[0].id (pass --model)\n",
                p->url);
    json_decref(o);
out:
    free(c.buf);
    return out;
}

/* ---- command line ---- */

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: tandem bench serve [options]\n"
        "\n"
        "Load generator for OpenAI-compatible servers: streaming requests, Poisson arrivals,\n"
        "bounded concurrency; prints TTFT, TPOT, ITL and E2E latency (mean, p50, p90, p99)\n"
        "and request/token throughput.\n"
        "\n"
        "  --url URL              server base URL (default http://127.0.0.1:8000; https too)\n"
        "  --ca FILE              PEM CA certificates for an https URL (default: the system's)\n"
        "  --model NAME           model name sent in requests (default: GET /v1/models)\n"
        "  --endpoint E           completions (default) or chat\n"
        "  --rate R               Poisson arrival rate in req/s, or inf (default inf)\n"
        "  --concurrency N        max requests in flight (default 256, max 4096)\n"
        "  --num-prompts N        requests to send (default 100)\n"
        "  --input-len N          prompt length, tokens or words (default 128)\n"
        "  --input-len-range F    uniform in [N(1-F), N(1+F)], 0 <= F < 1 (default 0)\n"
        "  --prefix-len N         synthetic: every prompt starts with the same N tokens (words),\n"
        "                         as a shared system prompt (default 0)\n"
        "  --output-len N         max_tokens (default 128)\n"
        "  --output-len-range F   as for the input (default 0)\n"
        "  --dataset D            synthetic (random ids for completions, random words for\n"
        "                         chat), random-ids, random-words, or a JSONL file with\n"
        "                         {\"prompt\": str|[ids]} or {\"messages\": [...]} lines and an\n"
        "                         optional \"max_tokens\"\n"
        "  --token-range LO:HI    synthetic token ids in [LO, HI) (default 100:32000)\n"
        "  --seed N               workload seed (default 0)\n"
        "  --api-key KEY          sent as Authorization: Bearer KEY\n"
        "  --timeout S            per-request timeout in seconds (default 600)\n"
        "  --no-ignore-eos        do not send ignore_eos/min_tokens (output may end early)\n"
        "  --extra-body JSON      object merged into every request body\n"
        "  --json FILE            write the summary, with one record per request, as JSON\n"
        "  --no-progress          no progress bar (it is drawn only when stderr is a tty)\n"
        "\n"
        "Exit status: 0 when at least one request succeeded, 1 when none did or the server\n"
        "could not be reached, 2 on a usage error.\n");
}

static bool opt_endpoint(const char *arg, void *dst)
{
    struct bs_plan *p = dst;
    if (!strcmp(arg, "completions"))
        p->endpoint = EP_COMPLETIONS;
    else if (!strcmp(arg, "chat"))
        p->endpoint = EP_CHAT;
    else {
        fprintf(stderr, "tandem: --endpoint: expected completions or chat, got '%s'\n", arg);
        return false;
    }
    return true;
}

static bool opt_rate(const char *arg, void *dst)
{
    double *rate = dst;
    if (!strcmp(arg, "inf")) {
        *rate = INFINITY;
        return true;
    }
    return tdm_tool_float("rate", arg, 1e-6, 1e6, rate);
}

static bool opt_token_range(const char *arg, void *dst)
{
    struct bs_plan *p = dst;
    char buf[64];
    const char *colon = strchr(arg, ':');
    int64_t lo, hi;
    if (colon && (size_t)(colon - arg) < sizeof buf) {
        memcpy(buf, arg, (size_t)(colon - arg));
        buf[colon - arg] = '\0';
        if (tdm_parse_i64(buf, 0, INT32_MAX, &lo) && tdm_parse_i64(colon + 1, 1, INT32_MAX, &hi) &&
            hi > lo) {
            p->token_lo = lo;
            p->token_hi = hi;
            return true;
        }
    }
    fprintf(stderr, "tandem: --token-range: expected LO:HI with 0 <= LO < HI, got '%s'\n", arg);
    return false;
}

static bool opt_api_key(const char *arg, void *dst)
{
    if (!arg[0] || strlen(arg) > 512 || strpbrk(arg, "\r\n")) {
        fprintf(stderr, "tandem: --api-key: expected 1 to 512 bytes with no line break\n");
        return false;
    }
    *(const char **)dst = arg;
    return true;
}

static bool opt_extra_body(const char *arg, void *dst)
{
    json_t **body = dst;
    json_error_t jerr;
    json_decref(*body);
    *body = json_loads(arg, 0, &jerr);
    if (!json_is_object(*body)) {
        fprintf(stderr, "tandem: --extra-body: expected a JSON object\n");
        return false;
    }
    return true;
}

int tdm_cmd_bench_serve(int argc, char **argv)
{
    struct bs_plan p = {.url = "http://127.0.0.1:8000",
                        .rate = INFINITY,
                        .concurrency = 256,
                        .num_prompts = 100,
                        .input_len = 128,
                        .output_len = 128,
                        .token_lo = 100,
                        .token_hi = 32000,
                        .ignore_eos = true,
                        .timeout_s = 600};
    const char *dataset = "synthetic", *json_path = NULL, *ca_file = NULL;
    bool show_progress = true, no_progress = false, no_ignore_eos = false;
    int rc = 2;
    char *model_owned = NULL;
    struct bs_run run = {0};
    pthread_t *threads = NULL;
    int n_threads = 0;
    int64_t conc = p.concurrency, num = p.num_prompts, in_len = p.input_len, out_len = p.output_len,
            seed = 0, prefix_len = 0;
    const struct tdm_opt own[] = {
        TDM_OPT_S("url", &p.url),
        TDM_OPT_S("model", &p.model),
        TDM_OPT_P("endpoint", opt_endpoint, &p),
        TDM_OPT_P("rate", opt_rate, &p.rate),
        TDM_OPT_I("concurrency", &conc, 1, MAX_CONCURRENCY),
        TDM_OPT_I("num-prompts", &num, 1, MAX_PROMPTS),
        TDM_OPT_I("input-len", &in_len, 1, MAX_LEN),
        TDM_OPT_F("input-len-range", &p.input_range, 0, 0.999),
        TDM_OPT_I("prefix-len", &prefix_len, 0, MAX_LEN),
        TDM_OPT_I("output-len", &out_len, 1, MAX_LEN),
        TDM_OPT_F("output-len-range", &p.output_range, 0, 0.999),
        TDM_OPT_S("dataset", &dataset),
        TDM_OPT_P("token-range", opt_token_range, &p),
        TDM_OPT_I("seed", &seed, 0, 9.0e18),
        TDM_OPT_P("api-key", opt_api_key, &p.api_key),
        TDM_OPT_F("timeout", &p.timeout_s, 0.001, 86400),
        TDM_OPT_B("no-ignore-eos", &no_ignore_eos),
        TDM_OPT_P("extra-body", opt_extra_body, &p.extra_body),
        TDM_OPT_S("json", &json_path),
        TDM_OPT_S("ca", &ca_file),
        TDM_OPT_B("no-progress", &no_progress),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("bench serve", argc, argv, tables, usage);
    if (prc) {
        rc = prc == 1 ? 0 : 2;
        goto out;
    }
    p.concurrency = (int)conc;
    p.num_prompts = (int)num;
    p.input_len = (int)in_len;
    p.prefix_len = (int)prefix_len;
    p.output_len = (int)out_len;
    p.seed = (uint64_t)seed;
    p.ignore_eos = !no_ignore_eos;
    show_progress = !no_progress;
    if (!strcmp(dataset, "synthetic"))
        p.source = p.endpoint == EP_CHAT ? SRC_WORDS : SRC_IDS;
    else if (!strcmp(dataset, "random-ids"))
        p.source = SRC_IDS;
    else if (!strcmp(dataset, "random-words"))
        p.source = SRC_WORDS;
    else {
        p.source = SRC_FILE;
        p.dataset = dataset;
        if (load_dataset(&p)) {
            fprintf(stderr, "tandem: --dataset: %s\n", tdm_err_msg());
            goto out;
        }
    }
    if (p.source == SRC_IDS && p.endpoint == EP_CHAT) {
        fprintf(stderr, "tandem: --dataset random-ids needs --endpoint completions (chat "
                        "messages are text)\n");
        goto out;
    }
    if (tdm_bh_target_init(p.url, ca_file, &p.target)) {
        fprintf(stderr, "tandem: --url: %s\n", tdm_err_msg());
        goto out;
    }

    rc = 1;
    if (!p.model) {
        p.model = model_owned = discover_model(&p);
        if (!p.model) goto out;
    }
    p.sched_s = malloc((size_t)p.num_prompts * sizeof *p.sched_s);
    run.reqs = calloc((size_t)p.num_prompts, sizeof *run.reqs);
    n_threads = TDM_MIN(p.concurrency, p.num_prompts);
    threads = calloc((size_t)n_threads, sizeof *threads);
    if (!p.sched_s || !run.reqs || !threads) {
        fprintf(stderr, "tandem: bench serve: out of memory\n");
        goto out;
    }
    double t = 0;
    for (int i = 0; i < p.num_prompts; i++) { /* first arrival at 0, then exponential gaps */
        p.sched_s[i] = t;
        if (!isinf(p.rate)) t += -log1p(-rng(&p, i, 0, 2)) / p.rate;
    }
    /* One socket per in-flight request: raise the descriptor limit when it is below that. */
    struct rlimit nofile;
    rlim_t need = (rlim_t)n_threads + 64;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < need) {
        nofile.rlim_cur = nofile.rlim_max < need ? nofile.rlim_max : need;
        if (setrlimit(RLIMIT_NOFILE, &nofile) != 0 || nofile.rlim_cur < need)
            fprintf(stderr,
                    "tandem: bench serve: the open-file limit (%llu) is below --concurrency; "
                    "some connections may fail\n",
                    (unsigned long long)nofile.rlim_cur);
    }
    run.plan = &p;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    run.t0_ns = tdm_now_ns();
    int started = 0;
    for (; started < n_threads; started++)
        if (pthread_create(&threads[started], &attr, worker, &run) != 0) break;
    pthread_attr_destroy(&attr);
    if (started == 0) {
        fprintf(stderr, "tandem: bench serve: cannot start threads\n");
        goto out;
    }
    if (started < n_threads)
        fprintf(stderr, "tandem: bench serve: only %d of %d threads started\n", started, n_threads);
    bool tty = show_progress && isatty(STDERR_FILENO);
    while (atomic_load(&run.done) < p.num_prompts) {
        if (tty) progress(&run, false);
        struct timespec ts = {0, 100 * 1000000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < started; i++)
        pthread_join(threads[i], NULL);
    if (tty) progress(&run, true);
    rc = report(&p, &run, json_path);
out:
    if (run.reqs)
        for (int i = 0; i < p.num_prompts; i++)
            free(run.reqs[i].itl_s);
    free(run.reqs);
    free(threads);
    free(p.sched_s);
    free(model_owned);
    for (int i = 0; i < p.n_lines; i++) {
        json_decref(p.lines[i].prompt);
        json_decref(p.lines[i].messages);
    }
    free(p.lines);
    json_decref(p.extra_body);
    tdm_bh_target_free(&p.target);
    return rc;
}
