/*
 * The scheduler: one thread that owns the engine and turns queued requests into forward steps
 * (include/tandem/sched.h has the policy and the lifecycle diagram).
 *
 * Locks, in the order they may nest: s->mu (waiting queue, running count, flags) is never held
 * while a request's r->mu is taken by the scheduler... except in publish paths, which take only
 * r->mu. s->mmu guards the metrics. The engine and everything under "scheduler thread only"
 * are touched by the scheduler thread alone, so a step runs without locks.
 *
 * Invariants: a request is in exactly one of {waiting list, running array, neither (finished)};
 * a waiting request holds no KV page; a finished request has released all of its pages before
 * its finish reason is published, so a reader that sees it finished sees the pool without it.
 */
#include "tandem/sched.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_MAX_WAITING 1024

enum req_state { REQ_WAITING, REQ_RUNNING, REQ_FINISHED };
/* A remote prefill (disaggregation): none, sent and not landed, landed, failed. */
enum { REMOTE_NONE, REMOTE_PENDING, REMOTE_OK, REMOTE_FAILED };

struct tdm_req {
    _Atomic int refs;
    uint64_t id;
    atomic_bool cancel;

    /* immutable after submit */
    int n_prompt, max_tokens, min_tokens, top_k_lp; /* top_k_lp: -1 = no logprobs */
    bool ignore_eos;
    int32_t stop_ids[TDM_MAX_STOP_IDS];
    int n_stop_ids;
    bool prefill_only;
    int fixed_chunk;
    void *user;
    struct tdm_sched *sched;
    _Atomic int remote; /* REMOTE_*: written by tdm_req_remote_done, read by the scheduler */

    /* scheduler thread only */
    int32_t *tokens; /* [n_prompt + max_tokens]: prompt, then outputs */
    int n_tokens;    /* prompt + outputs so far */
    int n_cached;    /* tokens whose KV is in kv */
    struct tdm_kv_seq kv;
    struct tdm_sampler smp;
    struct tdm_text_stream ts;
    enum req_state state;
    int batch_slot; /* index in this step's batch, or -1 */
    bool counted;   /* its prompt is in the prompt-token counter */
    int64_t t_last_ns;
    struct tdm_req *next; /* waiting list */

    /* output, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_out;
    float *logprobs;
    int32_t *top_ids;
    float *top_lps;
    size_t *text_end;
    char *text;
    size_t text_len, text_cap;
    enum tdm_finish finish;
    tdm_status error;
    char error_msg[256];
    int64_t t_submit_ns, t_first_ns, t_end_ns;
    int n_preempted;
};

struct tdm_sched {
    tdm_engine_t *engine;
    const tdm_tok_t *tok;
    tdm_kv_pool_t *kv;
    struct tdm_sched_opts o;
    int vocab, max_ctx, page_size;
    int64_t total_pages;
    int eos[TDM_MAX_EOS + 1];
    int n_eos;

    pthread_mutex_t mu; /* everything below up to the scheduler-only part */
    pthread_cond_t cv_work, cv_idle;
    struct tdm_req *wait_head; /* FCFS by id */
    int n_waiting, n_running;
    bool accepting, stop, started;
    uint64_t next_id;
    pthread_t thread;

    /* scheduler thread only */
    struct tdm_req **running; /* [max_seqs], ascending id */
    struct tdm_batch_seq *bseqs;
    struct tdm_req **breqs;
    float *logits;                     /* [max_seqs][vocab], with hooks (which want the rows) */
    struct tdm_sample_scratch scratch; /* sampling those rows here, with hooks */
    struct tdm_sample_row *srows;      /* [max_seqs]: what to sample from each logit row */
    struct tdm_sched_hooks hooks;
    bool have_hooks;
    int d_model;
    float *hidden; /* [max_seqs][d_model], with hooks */
    struct tdm_step_span *spans;

    pthread_mutex_t mmu;
    struct tdm_sched_metrics_snapshot m;
};

/* ---- helpers ---- */

const char *tdm_finish_name(enum tdm_finish f)
{
    switch (f) {
    case TDM_FINISH_STOP:
        return "stop";
    case TDM_FINISH_LENGTH:
        return "length";
    case TDM_FINISH_CANCELLED:
        return "cancelled";
    case TDM_FINISH_ERROR:
        return "error";
    default:
        return "none";
    }
}

void tdm_hist_observe(struct tdm_hist *h, double v)
{
    int i = 0;
    while (i < h->n_buckets && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->n++;
    h->sum += v;
}

void tdm_hist_prom(struct tdm_sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                   const char *labels)
{
    const char *l = labels && *labels ? labels : "", *sep = *l ? "," : "";
    tdm_sbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        tdm_sbuf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, l, sep, h->bounds[i],
                        (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    tdm_sbuf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, l, sep, (unsigned long long)cum);
    if (*l)
        tdm_sbuf_printf(b, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, l, h->sum, name, l,
                        (unsigned long long)h->n);
    else
        tdm_sbuf_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name,
                        (unsigned long long)h->n);
}

static void hist_init(struct tdm_hist *h, const double *bounds, int n)
{
    memset(h, 0, sizeof *h);
    h->n_buckets = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof *bounds);
}

static void req_free(struct tdm_req *r)
{
    tdm_sampler_free(&r->smp);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->tokens);
    free(r->logprobs);
    free(r->top_ids);
    free(r->top_lps);
    free(r->text_end);
    free(r->text);
    free(r);
}

static void req_unref(struct tdm_req *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1) req_free(r);
}

/* ---- metrics ---- */

static void metrics_init(struct tdm_sched_metrics_snapshot *m)
{
    static const double lat[] = {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                 0.1,   0.15,   0.2,   0.3,  0.4,  0.5,  0.75, 1,
                                 2.5,   5,      7.5,   10,   20,   40,   80,   160};
    static const double itl[] = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025,
                                 0.03,  0.04,   0.05,  0.075,  0.1,  0.15,  0.2,  0.3,
                                 0.4,   0.5,    0.75,  1,      2.5,  5,     7.5,  10};
    static const double e2e[] = {0.1, 0.25, 0.5, 1,  2,  3,   4,   5,   7.5, 10,  15,  20,
                                 30,  40,   50,  60, 90, 120, 180, 240, 300, 480, 600, 900};
    static const double tok[] = {1,    2,    4,    8,    16,   32,    64,    96,
                                 128,  192,  256,  384,  512,  768,   1024,  1536,
                                 2048, 3072, 4096, 6144, 8192, 12288, 16384, 32768};
    memset(m, 0, sizeof *m);
    hist_init(&m->ttft_s, lat, 24);
    hist_init(&m->itl_s, itl, 24);
    hist_init(&m->e2e_s, e2e, 24);
    hist_init(&m->batch_tokens, tok, 24);
    hist_init(&m->batch_seqs, tok, 14);
}

void tdm_sched_metrics(tdm_sched_t *s, struct tdm_sched_metrics_snapshot *out)
{
    pthread_mutex_lock(&s->mmu);
    *out = s->m;
    pthread_mutex_unlock(&s->mmu);
    pthread_mutex_lock(&s->mu);
    out->running = s->n_running;
    out->waiting = s->n_waiting;
    out->accepting = s->accepting;
    pthread_mutex_unlock(&s->mu);
    out->kv = tdm_kv_pool_stats(s->kv);
}

int tdm_sched_max_ctx(const tdm_sched_t *s)
{
    return s->max_ctx;
}

/* ---- creation ---- */

tdm_status tdm_sched_create(tdm_engine_t *engine, const tdm_tok_t *tok,
                            const struct tdm_sched_opts *opts, tdm_sched_t **out)
{
    const struct tdm_engine_opts *eo = tdm_engine_opts(engine);
    const struct tdm_model *m = tdm_engine_model(engine);
    struct tdm_sched *s = calloc(1, sizeof *s);
    if (!s) return tdm_err_set(TDM_ENOMEM, "sched: out of memory");
    s->engine = engine;
    s->tok = tok;
    s->kv = tdm_engine_kv(engine);
    s->o = opts ? *opts : (struct tdm_sched_opts){0};
    if (s->o.max_batch_tokens <= 0 || s->o.max_batch_tokens > eo->max_batch_tokens)
        s->o.max_batch_tokens = eo->max_batch_tokens;
    int seq_cap = TDM_MIN(eo->max_seqs, eo->max_logit_rows);
    if (s->o.max_seqs <= 0 || s->o.max_seqs > seq_cap) s->o.max_seqs = seq_cap;
    if (s->o.prefill_chunk <= 0 || s->o.prefill_chunk > s->o.max_batch_tokens)
        s->o.prefill_chunk = s->o.max_batch_tokens;
    if (s->o.max_waiting <= 0) s->o.max_waiting = DEFAULT_MAX_WAITING;
    s->vocab = m->cfg.vocab_size;
    s->d_model = m->cfg.d_model;
    s->max_ctx = eo->max_ctx;
    s->page_size = eo->page_size;
    s->total_pages = tdm_kv_pool_stats(s->kv).total;
    if (s->o.watermark_pages == 0) s->o.watermark_pages = (int)(s->total_pages / 100);
    if (s->o.watermark_pages < 0) s->o.watermark_pages = 0;
    for (int i = 0; i < m->cfg.n_eos; i++)
        s->eos[s->n_eos++] = m->cfg.eos_ids[i];
    if (tok && tdm_tok_eos(tok) >= 0) s->eos[s->n_eos++] = tdm_tok_eos(tok);

    int n = s->o.max_seqs;
    s->running = calloc((size_t)n, sizeof *s->running);
    s->bseqs = calloc((size_t)n, sizeof *s->bseqs);
    s->breqs = calloc((size_t)n, sizeof *s->breqs);
    s->spans = calloc((size_t)n, sizeof *s->spans);
    s->srows = calloc((size_t)n, sizeof *s->srows);
    tdm_status st = TDM_ENOMEM;
    if (!s->running || !s->bseqs || !s->breqs || !s->spans || !s->srows) {
        tdm_err_set(TDM_ENOMEM, "sched: out of memory");
        goto out_free;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->mmu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_idle, NULL);
    metrics_init(&s->m);
    s->accepting = true;
    s->next_id = 1;
    *out = s;
    return TDM_OK;

out_free:
    free(s->running);
    free(s->bseqs);
    free(s->breqs);
    free(s->spans);
    free(s->srows);
    free(s);
    return st;
}

/* ---- submission (any thread) ---- */

tdm_status tdm_sched_submit(tdm_sched_t *s, const struct tdm_req_params *p, tdm_req_t **out)
{
    if (!p->prompt || p->n_prompt < 1) return tdm_err_set(TDM_EINVAL, "the prompt is empty");
    if (p->n_prompt >= s->max_ctx)
        return tdm_err_set(TDM_ERANGE,
                           "the prompt has %d tokens; this model's context is %d tokens (at "
                           "least one must be left to generate)",
                           p->n_prompt, s->max_ctx);
    if (p->max_tokens < 1) return tdm_err_set(TDM_EINVAL, "max_tokens must be at least 1");
    if ((int64_t)p->n_prompt + p->max_tokens > s->max_ctx)
        return tdm_err_set(TDM_ERANGE,
                           "the prompt (%d tokens) plus max_tokens (%d) is more than this "
                           "model's context of %d tokens",
                           p->n_prompt, p->max_tokens, s->max_ctx);
    int64_t pages = ((int64_t)p->n_prompt + p->max_tokens + s->page_size - 1) / s->page_size;
    if (pages > s->total_pages)
        return tdm_err_set(TDM_ERANGE,
                           "the request needs up to %lld KV pages; the pool has %lld in all",
                           (long long)pages, (long long)s->total_pages);
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return tdm_err_set(TDM_EINVAL, "min_tokens must be between 0 and max_tokens");
    if (p->top_logprobs < -1 || p->top_logprobs > TDM_MAX_TOP_LOGPROBS)
        return tdm_err_set(TDM_ERANGE, "top_logprobs must be between 0 and %d",
                           TDM_MAX_TOP_LOGPROBS);
    if (p->fixed_chunk < 0 || p->fixed_chunk > s->o.max_batch_tokens)
        return tdm_err_set(TDM_EINVAL, "fixed_chunk must be between 0 and %d (tokens per step)",
                           s->o.max_batch_tokens);
    if (p->n_stop_ids < 0 || p->n_stop_ids > TDM_MAX_STOP_IDS)
        return tdm_err_set(TDM_ERANGE, "at most %d stop token ids", TDM_MAX_STOP_IDS);
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= s->vocab)
            return tdm_err_set(TDM_EINVAL,
                               "prompt token %d at index %d is outside the "
                               "vocabulary (size %d)",
                               p->prompt[i], i, s->vocab);
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= s->vocab)
            return tdm_err_set(TDM_EINVAL, "stop token id %d is outside the vocabulary",
                               p->stop_ids[i]);
    tdm_status st = tdm_sampling_validate(&p->sampling);
    if (st != TDM_OK) return st;

    struct tdm_req *r = calloc(1, sizeof *r);
    if (!r) return tdm_err_set(TDM_ENOMEM, "out of memory");
    int cap = p->n_prompt + p->max_tokens;
    size_t nout = (size_t)p->max_tokens;
    r->tokens = malloc((size_t)cap * sizeof *r->tokens);
    r->text_end = malloc(nout * sizeof *r->text_end);
    r->text_cap = 256;
    r->text = malloc(r->text_cap);
    bool lp = p->top_logprobs >= 0;
    if (lp) r->logprobs = malloc(nout * sizeof *r->logprobs);
    if (p->top_logprobs > 0) {
        r->top_ids = malloc(nout * (size_t)p->top_logprobs * sizeof *r->top_ids);
        r->top_lps = malloc(nout * (size_t)p->top_logprobs * sizeof *r->top_lps);
    }
    if (!r->tokens || !r->text_end || !r->text || (lp && !r->logprobs) ||
        (p->top_logprobs > 0 && (!r->top_ids || !r->top_lps))) {
        st = tdm_err_set(TDM_ENOMEM, "out of memory");
        goto out_buffers;
    }
    if ((st = tdm_text_stream_init(&r->ts, p->stops, p->n_stops)) != TDM_OK) goto out_buffers;
    if ((st = tdm_sampler_init(&r->smp, &p->sampling, 0, s->vocab)) != TDM_OK) goto out_buffers;
    memcpy(r->tokens, p->prompt, (size_t)p->n_prompt * sizeof *r->tokens);
    for (int i = 0; i < p->n_prompt; i++)
        tdm_sampler_accept(&r->smp, p->prompt[i], true);
    r->n_prompt = r->n_tokens = p->n_prompt;
    r->max_tokens = p->max_tokens;
    r->min_tokens = p->min_tokens;
    r->top_k_lp = p->top_logprobs;
    r->ignore_eos = p->ignore_eos;
    memcpy(r->stop_ids, p->stop_ids, sizeof r->stop_ids);
    r->n_stop_ids = p->n_stop_ids;
    r->prefill_only = p->prefill_only;
    r->fixed_chunk = p->fixed_chunk;
    r->user = p->user;
    r->sched = s;
    atomic_init(&r->remote, REMOTE_NONE);
    r->batch_slot = -1;
    r->state = REQ_WAITING;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    atomic_init(&r->refs, 2); /* the submitter's and the scheduler's */
    r->t_submit_ns = (int64_t)tdm_now_ns();

    pthread_mutex_lock(&s->mu);
    if (!s->accepting || s->n_waiting >= s->o.max_waiting) {
        bool stopping = !s->accepting;
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&s->mmu);
        s->m.rejected++;
        pthread_mutex_unlock(&s->mmu);
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->cv);
        tdm_sampler_free(&r->smp);
        st = stopping ? tdm_err_set(TDM_ECANCELED, "the server is shutting down")
                      : tdm_err_set(TDM_EAGAIN, "the waiting queue is full (%d requests)",
                                    s->o.max_waiting);
        goto out_buffers;
    }
    r->id = s->next_id++;
    struct tdm_req **pp = &s->wait_head;
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    s->n_waiting++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    *out = r;
    return TDM_OK;

out_buffers:
    free(r->tokens);
    free(r->text_end);
    free(r->text);
    free(r->logprobs);
    free(r->top_ids);
    free(r->top_lps);
    free(r);
    return st;
}

uint64_t tdm_req_id(const tdm_req_t *r)
{
    return r->id;
}

void tdm_req_cancel(tdm_req_t *r)
{
    atomic_store(&r->cancel, true);
}

void tdm_req_release(tdm_req_t *r)
{
    if (!r) return;
    atomic_store(&r->cancel, true);
    req_unref(r);
}

bool tdm_req_wait(tdm_req_t *r, int seen_out, size_t seen_text, int timeout_ms)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&r->mu);
    bool news;
    while (!(news = r->n_out > seen_out || r->text_len > seen_text || r->finish)) {
        if (pthread_cond_timedwait(&r->cv, &r->mu, &dl)) break;
    }
    news = r->n_out > seen_out || r->text_len > seen_text || r->finish;
    pthread_mutex_unlock(&r->mu);
    return news;
}

void tdm_req_lock(tdm_req_t *r, struct tdm_req_view *v)
{
    pthread_mutex_lock(&r->mu);
    v->n_out = r->n_out;
    v->tokens = r->tokens + r->n_prompt;
    v->logprobs = r->logprobs;
    v->top_ids = r->top_ids;
    v->top_lps = r->top_lps;
    v->text_end = r->text_end;
    v->text = r->text;
    v->text_len = r->text_len;
    v->finish = r->finish;
    v->error = r->error;
    memcpy(v->error_msg, r->error_msg, sizeof v->error_msg);
    v->n_prompt = r->n_prompt;
    v->t_submit_ns = r->t_submit_ns;
    v->t_first_ns = r->t_first_ns;
    v->t_end_ns = r->t_end_ns;
    v->n_preempted = r->n_preempted;
}

void tdm_req_unlock(tdm_req_t *r)
{
    pthread_mutex_unlock(&r->mu);
}

/* ---- the scheduler thread ---- */

/* Appends released text to r's output; called with r->mu held. */
static bool text_append(struct tdm_req *r, const char *b, size_t n)
{
    if (!n) return true;
    if (r->text_len + n + 1 > r->text_cap) {
        size_t cap = r->text_cap;
        while (r->text_len + n + 1 > cap)
            cap *= 2;
        char *t = realloc(r->text, cap);
        if (!t) return false;
        r->text = t;
        r->text_cap = cap;
    }
    memcpy(r->text + r->text_len, b, n);
    r->text_len += n;
    r->text[r->text_len] = '\0';
    return true;
}

/* Ends a request: returns its pages, publishes the reason, drops the scheduler's reference.
 * The caller has removed it from the running array or the waiting list. */
static void finish_req(struct tdm_sched *s, struct tdm_req *r, enum tdm_finish why, tdm_status err,
                       const char *msg)
{
    if (s->have_hooks && s->hooks.finished) s->hooks.finished(s->hooks.ctx, r, r->user, why);
    r->state = REQ_FINISHED;
    int64_t now = (int64_t)tdm_now_ns();
    pthread_mutex_lock(&r->mu);
    if (why != TDM_FINISH_STOP || !r->ts.stopped) {
        char out[TDM_STREAM_CAP + 8];
        size_t n_out = 0;
        tdm_text_stream_flush(&r->ts, out, &n_out);
        if (!text_append(r, out, n_out) && why != TDM_FINISH_ERROR) {
            why = TDM_FINISH_ERROR;
            err = TDM_ENOMEM;
            msg = "out of memory";
        }
        if (r->n_out) r->text_end[r->n_out - 1] = r->text_len;
    }
    pthread_mutex_unlock(&r->mu);
    /* the metrics and the pages before the client can see the end: whoever reads /metrics
     * or the pool after a response finds this request counted and its pages back */
    pthread_mutex_lock(&s->mmu);
    s->m.finished[why]++;
    if (why == TDM_FINISH_STOP || why == TDM_FINISH_LENGTH)
        tdm_hist_observe(&s->m.e2e_s, (double)(now - r->t_submit_ns) * 1e-9);
    pthread_mutex_unlock(&s->mmu);
    tdm_kv_seq_release(s->kv, &r->kv);
    r->n_cached = 0;
    pthread_mutex_lock(&r->mu);
    r->finish = why;
    r->error = err;
    if (msg) snprintf(r->error_msg, sizeof r->error_msg, "%s", msg);
    r->t_end_ns = now;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    req_unref(r);
}

static void running_remove(struct tdm_sched *s, int i)
{
    memmove(&s->running[i], &s->running[i + 1],
            (size_t)(s->n_running - i - 1) * sizeof *s->running);
    pthread_mutex_lock(&s->mu);
    s->n_running--;
    if (!s->n_running && !s->n_waiting) pthread_cond_broadcast(&s->cv_idle);
    pthread_mutex_unlock(&s->mu);
}

static void running_insert(struct tdm_sched *s, struct tdm_req *r)
{
    int i = s->n_running;
    while (i > 0 && s->running[i - 1]->id > r->id) {
        s->running[i] = s->running[i - 1];
        i--;
    }
    s->running[i] = r;
    r->state = REQ_RUNNING;
    pthread_mutex_lock(&s->mu);
    s->n_running++;
    pthread_mutex_unlock(&s->mu);
}

/* Preemption by recompute: the pages go back, the request returns to the waiting list in id
 * order (it is older than anything behind it) and will feed its whole token list again. */
static void requeue(struct tdm_sched *s, int i, bool count);
static void preempt(struct tdm_sched *s, int i)
{
    requeue(s, i, true);
}

/* Takes running[i] back to the waiting list, pages released. */
static void requeue(struct tdm_sched *s, int i, bool count)
{
    struct tdm_req *r = s->running[i];
    tdm_kv_seq_release(s->kv, &r->kv);
    r->n_cached = 0;
    r->batch_slot = -1;
    running_remove(s, i);
    pthread_mutex_lock(&s->mu);
    struct tdm_req **pp = &s->wait_head;
    while (*pp && (*pp)->id < r->id)
        pp = &(*pp)->next;
    r->next = *pp;
    *pp = r;
    s->n_waiting++;
    r->state = REQ_WAITING;
    pthread_mutex_unlock(&s->mu);
    if (!count) return;
    pthread_mutex_lock(&r->mu);
    r->n_preempted++;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->mmu);
    s->m.preemptions++;
    pthread_mutex_unlock(&s->mmu);
}

static int running_index(struct tdm_sched *s, struct tdm_req *r)
{
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i] == r) return i;
    return -1;
}

/* Makes r's page table cover n tokens, preempting the newest running requests that are not in
 * this step's batch. Returns false if r itself had to go (or nothing could be freed and
 * may_self is set), true when the pages are there, and -1-style "skip" as false with r kept
 * when !may_preempt. */
static bool reserve_or_preempt(struct tdm_sched *s, struct tdm_req *r, int64_t n, bool may_self)
{
    for (;;) {
        if (tdm_kv_seq_reserve(s->kv, &r->kv, n) == TDM_OK) return true;
        int victim = -1;
        for (int i = s->n_running - 1; i >= 0; i--) {
            struct tdm_req *v = s->running[i];
            if (v != r && v->batch_slot < 0 && v->id > r->id &&
                atomic_load(&v->remote) == REMOTE_NONE) {
                victim = i;
                break;
            }
        }
        if (victim < 0) {
            if (may_self) preempt(s, running_index(s, r));
            return false;
        }
        preempt(s, victim);
    }
}

static bool is_stop_token(struct tdm_sched *s, struct tdm_req *r, int32_t t)
{
    int n_out = r->n_tokens - r->n_prompt; /* outputs including t */
    if (n_out <= r->min_tokens) return false;
    if (!r->ignore_eos)
        for (int i = 0; i < s->n_eos; i++)
            if (s->eos[i] == t) return true;
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == t) return true;
    return false;
}

/* What r's next token is sampled with (its logit row's parameters). */
static struct tdm_sample_row sample_row_of(const struct tdm_req *r)
{
    return (struct tdm_sample_row){
        .smp = &r->smp, .position = (uint32_t)r->n_tokens, .n_top = r->top_k_lp};
}

/* Publishes r's next token, sampled into sr. Returns the finish reason (NONE to go on). */
static enum tdm_finish publish(struct tdm_sched *s, struct tdm_req *r,
                               const struct tdm_sample_row *sr)
{
    int k = r->top_k_lp;
    float lp = sr->logprob;
    int32_t t = sr->token;
    tdm_sampler_accept(&r->smp, t, false);
    r->tokens[r->n_tokens++] = t;
    int64_t now = (int64_t)tdm_now_ns();

    bool stop = is_stop_token(s, r, t);
    char out[TDM_STREAM_CAP + 256 + 8];
    bool stop_str = false, oom = false;
    pthread_mutex_lock(&r->mu);
    int i = r->n_out;
    if (r->logprobs) r->logprobs[i] = lp;
    if (k > 0) {
        memcpy(r->top_ids + (size_t)i * k, sr->top_ids, (size_t)k * sizeof(int32_t));
        memcpy(r->top_lps + (size_t)i * k, sr->top_lps, (size_t)k * sizeof(float));
    }
    if (!stop && s->tok && !tdm_tok_is_special(s->tok, t)) {
        size_t len = 0;
        const char *piece = tdm_tok_piece(s->tok, t, &len);
        for (size_t off = 0; piece && off < len && !stop_str; off += 256) {
            size_t n_out = 0;
            stop_str =
                tdm_text_stream_push(&r->ts, piece + off, TDM_MIN(len - off, 256), out, &n_out);
            if (!text_append(r, out, n_out)) oom = true;
        }
    }
    r->text_end[i] = r->text_len;
    r->n_out = i + 1;
    bool first = i == 0;
    if (first) r->t_first_ns = now;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);

    pthread_mutex_lock(&s->mmu);
    s->m.generated_tokens++;
    if (first)
        tdm_hist_observe(&s->m.ttft_s, (double)(now - r->t_submit_ns) * 1e-9);
    else
        tdm_hist_observe(&s->m.itl_s, (double)(now - r->t_last_ns) * 1e-9);
    pthread_mutex_unlock(&s->mmu);
    r->t_last_ns = now;

    if (oom) return TDM_FINISH_ERROR;
    if (stop || stop_str) return TDM_FINISH_STOP;
    if (r->n_tokens - r->n_prompt >= r->max_tokens || r->n_tokens >= s->max_ctx)
        return TDM_FINISH_LENGTH;
    return TDM_FINISH_NONE;
}

/* Drops cancelled requests: waiting ones and running ones. */
static void reap_cancelled(struct tdm_sched *s, bool cancel_all)
{
    struct tdm_req *dead = NULL;
    pthread_mutex_lock(&s->mu);
    struct tdm_req **pp = &s->wait_head;
    while (*pp) {
        struct tdm_req *r = *pp;
        if (cancel_all || atomic_load(&r->cancel)) {
            *pp = r->next;
            s->n_waiting--;
            r->next = dead;
            dead = r;
        } else {
            pp = &r->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
    while (dead) {
        struct tdm_req *r = dead;
        dead = r->next;
        finish_req(s, r, TDM_FINISH_CANCELLED, TDM_ECANCELED, "cancelled");
    }
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct tdm_req *r = s->running[i];
        if (cancel_all || atomic_load(&r->cancel)) {
            running_remove(s, i);
            finish_req(s, r, TDM_FINISH_CANCELLED, TDM_ECANCELED, "cancelled");
        }
    }
    pthread_mutex_lock(&s->mu);
    if (!s->n_running && !s->n_waiting) pthread_cond_broadcast(&s->cv_idle);
    pthread_mutex_unlock(&s->mu);
}

static void add_to_batch(struct tdm_sched *s, struct tdm_req *r, int span, int *nb)
{
    struct tdm_batch_seq *b = &s->bseqs[*nb];
    b->tokens = r->tokens + r->n_cached;
    b->n_tokens = span;
    b->pos0 = r->n_cached;
    b->pages = r->kv.pages;
    b->n_pages = r->kv.n_pages;
    b->n_logits = r->n_cached + span == r->n_tokens ? 1 : 0;
    r->batch_slot = *nb;
    s->breqs[*nb] = r;
    (*nb)++;
}

/* Builds and runs one step. Returns false when there was nothing to run. */
/* The span a request runs next: all that is left, capped by the budget and the chunk size. A
 * fixed-chunk request takes exactly its chunk (or what is left) or nothing. Returns 0 when it
 * must wait. */
static int next_span(struct tdm_sched *s, struct tdm_req *r, int budget)
{
    int left = r->n_tokens - r->n_cached;
    if (r->fixed_chunk > 0) {
        int span = TDM_MIN(left, r->fixed_chunk);
        return span <= budget ? span : 0;
    }
    return TDM_MIN(TDM_MIN(left, budget), s->o.prefill_chunk);
}

/* Lands finished remote prefills: OK joins the decode batches, a failure goes back to the
 * waiting queue with its pages released (the hook fenced them). */
static void land_remote(struct tdm_sched *s)
{
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct tdm_req *r = s->running[i];
        int st = atomic_load(&r->remote);
        if (st == REMOTE_OK) {
            atomic_store(&r->remote, REMOTE_NONE);
            r->n_cached = r->n_tokens - 1;
        } else if (st == REMOTE_FAILED) {
            atomic_store(&r->remote, REMOTE_NONE);
            requeue(s, i, false);
        }
    }
}

static void fill_spans(struct tdm_sched *s, int nb, bool with_rows)
{
    int row = 0;
    for (int j = 0; j < nb; j++) {
        struct tdm_req *r = s->breqs[j];
        const struct tdm_batch_seq *b = &s->bseqs[j];
        struct tdm_step_span *sp = &s->spans[j];
        *sp = (struct tdm_step_span){.req = r,
                                     .user = r->user,
                                     .pos0 = b->pos0,
                                     .n_tokens = b->n_tokens,
                                     .pages = b->pages,
                                     .n_pages = b->n_pages,
                                     .last = b->n_logits > 0};
        if (b->n_logits && with_rows) {
            sp->logits = s->logits + (size_t)row * s->vocab;
            sp->hidden = s->hidden + (size_t)row * s->d_model;
        }
        row += b->n_logits;
    }
}

/* Builds and runs one step. Returns false when there was nothing to run. */
static bool step(struct tdm_sched *s)
{
    reap_cancelled(s, false);
    land_remote(s);
    int budget = s->o.max_batch_tokens, nb = 0;
    for (int i = 0; i < s->n_running; i++)
        s->running[i]->batch_slot = -1;

    /* 1. decodes, oldest first */
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct tdm_req *r = s->running[i];
        if (r->n_tokens - r->n_cached != 1 || atomic_load(&r->remote) != REMOTE_NONE) continue;
        if (!reserve_or_preempt(s, r, r->n_tokens, true)) {
            i--; /* r left the array */
            continue;
        }
        add_to_batch(s, r, 1, &nb);
        budget--;
    }
    /* 2. prefill spans of running requests */
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct tdm_req *r = s->running[i];
        if (r->batch_slot >= 0 || atomic_load(&r->remote) != REMOTE_NONE) continue;
        int span = next_span(s, r, budget);
        if (!span || !reserve_or_preempt(s, r, r->n_cached + span, false)) continue;
        add_to_batch(s, r, span, &nb);
        budget -= span;
    }
    /* 3. admissions, FCFS: stop at the first request that does not fit */
    while (budget > 0 && s->n_running < s->o.max_seqs) {
        pthread_mutex_lock(&s->mu);
        struct tdm_req *r = s->wait_head;
        pthread_mutex_unlock(&s->mu);
        if (!r) break;
        int64_t need = (r->n_tokens + 1 + s->page_size - 1) / s->page_size;
        int64_t free_pages = tdm_kv_pool_stats(s->kv).free;
        if (need + (s->n_running ? s->o.watermark_pages : 0) > free_pages) break;
        bool remote =
            s->have_hooks && s->hooks.remote_prefill && !r->prefill_only && r->n_tokens >= 2;
        int span = remote ? r->n_tokens : next_span(s, r, budget);
        if (!span || tdm_kv_seq_reserve(s->kv, &r->kv, span) != TDM_OK) break;
        pthread_mutex_lock(&s->mu);
        s->wait_head = r->next;
        r->next = NULL;
        s->n_waiting--;
        pthread_mutex_unlock(&s->mu);
        running_insert(s, r);
        if (!r->counted) {
            r->counted = true;
            pthread_mutex_lock(&s->mmu);
            s->m.prompt_tokens += (uint64_t)r->n_prompt;
            pthread_mutex_unlock(&s->mmu);
        }
        if (remote) {
            atomic_store(&r->remote, REMOTE_PENDING);
            if (s->hooks.remote_prefill(s->hooks.ctx, r, r->user, r->tokens, r->n_tokens - 1,
                                        r->kv.pages, r->kv.n_pages))
                continue;
            /* prefill here after all */
            atomic_store(&r->remote, REMOTE_NONE);
            span = next_span(s, r, budget);
            if (!span) continue;
        }
        add_to_batch(s, r, span, &nb);
        budget -= span;
    }
    if (!nb) {
        /* Nothing could run. If two or more requests are prefilling here and the pool is dry,
         * the newest gives its pages back so the older ones can go on. */
        int stuck = 0, newest = -1;
        for (int i = 0; i < s->n_running; i++)
            if (atomic_load(&s->running[i]->remote) == REMOTE_NONE) {
                stuck++;
                newest = i;
            }
        if (stuck > 1) {
            preempt(s, newest);
            return true;
        }
        return false;
    }

    struct tdm_batch batch = {.seqs = s->bseqs, .n_seqs = nb};
    if (s->have_hooks && s->hooks.step_begin) {
        fill_spans(s, nb, false);
        s->hooks.step_begin(s->hooks.ctx, s->spans, nb);
    }
    /* without hooks (which want the logit rows themselves) the engine samples (on a device,
     * where the logits are) and only tokens come back; with them the rows are sampled here */
    tdm_status st;
    if (!s->have_hooks) {
        int row = 0;
        for (int j = 0; j < nb; j++)
            if (s->bseqs[j].n_logits) s->srows[row++] = sample_row_of(s->breqs[j]);
        st = tdm_engine_forward_sample(s->engine, &batch, s->srows, NULL);
    } else {
        st = tdm_engine_forward(s->engine, &batch, s->logits, s->hidden);
    }
    if (s->have_hooks && s->hooks.step_end) {
        fill_spans(s, nb, st == TDM_OK);
        s->hooks.step_end(s->hooks.ctx, s->spans, nb, st);
    }
    pthread_mutex_lock(&s->mmu);
    s->m.steps++;
    tdm_hist_observe(&s->m.batch_tokens, s->o.max_batch_tokens - budget);
    tdm_hist_observe(&s->m.batch_seqs, nb);
    pthread_mutex_unlock(&s->mmu);
    if (st != TDM_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "forward pass failed: %s", tdm_err_msg());
        TDM_ERROR("sched: %s", msg);
        for (int j = 0; j < nb; j++) {
            struct tdm_req *r = s->breqs[j];
            running_remove(s, running_index(s, r));
            finish_req(s, r, TDM_FINISH_ERROR, st, msg);
        }
        return true;
    }
    int row = 0;
    for (int j = 0; j < nb; j++) {
        struct tdm_req *r = s->breqs[j];
        r->batch_slot = -1;
        r->n_cached += s->bseqs[j].n_tokens;
        if (!s->bseqs[j].n_logits) continue;
        struct tdm_sample_row *sr = &s->srows[row];
        if (s->have_hooks && !r->prefill_only) {
            *sr = sample_row_of(r);
            tdm_sample_row_host(sr, s->logits + (size_t)row * s->vocab, &s->scratch);
        }
        row++;
        enum tdm_finish f = r->prefill_only ? TDM_FINISH_STOP : publish(s, r, sr);
        if (f != TDM_FINISH_NONE) {
            running_remove(s, running_index(s, r));
            finish_req(s, r, f, f == TDM_FINISH_ERROR ? TDM_ENOMEM : TDM_OK,
                       f == TDM_FINISH_ERROR ? "out of memory" : NULL);
        }
    }
    return true;
}

static void *sched_main(void *arg)
{
    struct tdm_sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !s->n_waiting && !s->n_running)
            pthread_cond_wait(&s->cv_work, &s->mu);
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        if (!step(s)) {
            /* Waiting requests that cannot be admitted yet, nothing running: sleep briefly
             * (pages come back only through cancellation, which also signals). */
            pthread_mutex_lock(&s->mu);
            struct timespec dl;
            clock_gettime(CLOCK_REALTIME, &dl);
            dl.tv_nsec += 5000000L;
            if (dl.tv_nsec >= 1000000000L) {
                dl.tv_sec++;
                dl.tv_nsec -= 1000000000L;
            }
            if (!s->stop) pthread_cond_timedwait(&s->cv_work, &s->mu, &dl);
            pthread_mutex_unlock(&s->mu);
        }
    }
    reap_cancelled(s, true);
    return NULL;
}

tdm_status tdm_sched_start(tdm_sched_t *s)
{
    if (s->started) return TDM_OK;
    if (pthread_create(&s->thread, NULL, sched_main, s))
        return tdm_err_set(TDM_EINTERNAL, "sched: cannot start the scheduler thread");
    s->started = true;
    return TDM_OK;
}

void tdm_sched_stop(tdm_sched_t *s, int drain_ms)
{
    pthread_mutex_lock(&s->mu);
    s->accepting = false;
    if (drain_ms > 0 && s->started) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += drain_ms / 1000;
        dl.tv_nsec += (long)(drain_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        while (s->n_running || s->n_waiting)
            if (pthread_cond_timedwait(&s->cv_idle, &s->mu, &dl)) break;
    }
    s->stop = true;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    if (s->started) {
        pthread_join(s->thread, NULL);
        s->started = false;
    } else {
        reap_cancelled(s, true);
    }
}

void tdm_sched_destroy(tdm_sched_t *s)
{
    if (!s) return;
    tdm_sched_stop(s, 0);
    tdm_sample_scratch_free(&s->scratch);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->mmu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_idle);
    free(s->running);
    free(s->bseqs);
    free(s->breqs);
    free(s->spans);
    free(s->hidden);
    free(s->logits);
    free(s->srows);
    free(s);
}

void tdm_sched_set_hooks(tdm_sched_t *s, const struct tdm_sched_hooks *h)
{
    const size_t n = (size_t)s->o.max_seqs;
    if (!s->hidden) s->hidden = malloc(n * (size_t)s->d_model * sizeof(float));
    if (!s->logits) s->logits = malloc(n * (size_t)s->vocab * sizeof(float));
    if (!s->scratch.probs) tdm_sample_scratch_init(&s->scratch, s->vocab);
    s->hooks = *h;
    s->have_hooks = s->hidden && s->logits && s->scratch.probs;
    if (!s->have_hooks)
        TDM_ERROR("sched: out of memory for the logit and hidden-state rows; hooks off");
}

void tdm_req_remote_done(tdm_req_t *r, tdm_status st)
{
    struct tdm_sched *s = r->sched;
    atomic_store(&r->remote, st == TDM_OK ? REMOTE_OK : REMOTE_FAILED);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
}
