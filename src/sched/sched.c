/*
 * The scheduler's front: creation, submission and the request API (any thread), metrics, and
 * the thread that runs steps (include/tandem/sched.h has the policy and the lifecycle;
 * sched_int.h the locks and invariants).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched/sched_int.h"

#define DEFAULT_MAX_WAITING 1024

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

static void hist_init(struct tdm_hist *h, const double *bounds, int n)
{
    memset(h, 0, sizeof *h);
    h->n_buckets = n;
    memcpy(h->bounds, bounds, (size_t)n * sizeof *bounds);
}

/* A request's buffers and the request (a submit that failed after allocating them, or the
 * last reference's req_free). */
static void req_buffers_free(struct tdm_req *r)
{
    free(r->tokens);
    free(r->logprobs);
    free(r->top_ids);
    free(r->top_lps);
    free(r->p_lps);
    free(r->p_top_ids);
    free(r->p_top_lps);
    free(r->dstate);
    free(r->remote_feature);
    free(r);
}

static void req_free(struct tdm_req *r)
{
    struct tdm_req *leader = r->leader;
    tdm_sampler_free(&r->smp);
    tdm_grammar_unref(r->grammar);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    req_buffers_free(r);
    if (leader) tdm_sched_req_unref(leader);
}

void tdm_sched_req_unref(struct tdm_req *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1) req_free(r);
}

const char *tdm_req_state_name(enum tdm_req_state st)
{
    switch (st) {
    case TDM_REQ_WAITING:
        return "waiting";
    case TDM_REQ_WAITING_REMOTE_KV:
        return "waiting_remote_kv";
    case TDM_REQ_RUNNING:
        return "running";
    case TDM_REQ_FINISHED:
        return "finished";
    }
    return "unknown";
}

enum tdm_req_state tdm_req_state(const tdm_req_t *r)
{
    return (enum tdm_req_state)atomic_load(&((struct tdm_req *)r)->state);
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
    out->kv = tdm_kv_pool_stats(s->kv); /* with the cache's figures: prefix_turn */
    pthread_mutex_unlock(&s->mmu);
    pthread_mutex_lock(&s->mu);
    out->running = s->n_running;
    out->waiting = s->n_waiting;
    out->accepting = s->accepting;
    pthread_mutex_unlock(&s->mu);
    out->stalled_ms = tdm_sched_stall_ms(s);
}

tdm_status tdm_sched_enable_prefix_cache(tdm_sched_t *s, uint64_t salt)
{
    if (s->started || s->prefix)
        return tdm_err_set(TDM_EINVAL, "prefix caching is turned on once, before the start");
    if (s->drafter && s->drafter->feed && !s->drafter->kv_len)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "prefix caching does not work with a drafter that reads the target's "
                           "features and does not say how far its own KV goes: a reused prefix "
                           "would be a gap in them");
    tdm_status st = tdm_prefix_cache_create(s->kv, salt, &s->prefix);
    if (st != TDM_OK) return st;
    tdm_kv_pool_set_reclaim(s->kv, tdm_prefix_cache_reclaim, s->prefix);
    pthread_mutex_lock(&s->mmu);
    s->m.prefix_on = true;
    pthread_mutex_unlock(&s->mmu);
    return TDM_OK;
}

tdm_status tdm_sched_set_prefix_listener(tdm_sched_t *s, const struct tdm_prefix_listener *l)
{
    if (s->started || !s->prefix)
        return tdm_err_set(TDM_EINVAL, "a prefix cache listener is set after the cache is on, "
                                       "before the start");
    tdm_prefix_cache_set_listener(s->prefix, l);
    return TDM_OK;
}

void tdm_sched_flush_prefix_cache(tdm_sched_t *s)
{
    if (!s->prefix) return;
    atomic_store(&s->flush_prefix, true);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
}

/* Scheduler thread: a flush asked for, and the cache's figures for the metrics. The flush and
 * the figures are published under s->mmu, under which tdm_sched_metrics also reads the pool:
 * a snapshot never sees the pages back in the pool and the cache still naming them. */
static void prefix_turn(struct tdm_sched *s)
{
    if (!s->prefix) return;
    pthread_mutex_lock(&s->mmu);
    if (atomic_exchange(&s->flush_prefix, false)) tdm_prefix_cache_flush(s->prefix);
    s->m.prefix = tdm_prefix_cache_stats(s->prefix);
    pthread_mutex_unlock(&s->mmu);
}

int tdm_sched_max_ctx(const tdm_sched_t *s)
{
    return s->max_ctx;
}

int tdm_sched_vocab(const tdm_sched_t *s)
{
    return s->vocab;
}

int tdm_sched_eos(const tdm_sched_t *s, const int **ids)
{
    *ids = s->eos;
    return s->n_eos;
}

/* ---- creation ---- */

/* The overlap's second set of plan buffers, the gens and the kept page tables (sched_int.h). */
static void free_overlap_sets(struct tdm_sched *s)
{
    free(s->kept);
    free(s->kept_step);
    free(s->pseqs2);
    free(s->slots2);
    free(s->want2);
    free(s->srows2);
    free(s->pgen);
    free(s->pgen2);
}

tdm_status tdm_sched_create_exec(const struct tdm_sched_exec *x, const tdm_tok_t *tok,
                                 const struct tdm_sched_opts *opts, tdm_sched_t **out)
{
    if (!x->iface || !x->iface->run || !x->kv || x->vocab <= 0 || x->max_ctx <= 0 ||
        x->max_batch_tokens <= 0 || x->max_seqs <= 0 || x->max_rows <= 0)
        return tdm_err_set(TDM_EINVAL, "sched: the executor lacks its run call or its limits");
    struct tdm_sched *s = calloc(1, sizeof *s);
    if (!s) return tdm_err_set(TDM_ENOMEM, "sched: out of memory");
    tdm_status fail = TDM_ENOMEM;
    s->x = *x;
    s->feat_dim = x->feature_dim > 0 ? x->feature_dim : x->d_model;
    s->tok = tok;
    s->kv = x->kv;
    s->o = opts ? *opts : (struct tdm_sched_opts){0};
    if (s->o.max_batch_tokens <= 0 || s->o.max_batch_tokens > x->max_batch_tokens)
        s->o.max_batch_tokens = x->max_batch_tokens;
    int seq_cap = TDM_MIN(x->max_seqs, x->max_rows);
    if (s->o.max_seqs <= 0 || s->o.max_seqs > seq_cap) s->o.max_seqs = seq_cap;
    if (s->o.prefill_chunk <= 0 || s->o.prefill_chunk > s->o.max_batch_tokens)
        s->o.prefill_chunk = s->o.max_batch_tokens;
    if (s->o.max_waiting <= 0) s->o.max_waiting = DEFAULT_MAX_WAITING;
    s->vocab = x->vocab;
    s->max_ctx = x->max_ctx;
    s->max_rows = x->max_rows;
    s->page_size = tdm_kv_pool_config(s->kv)->page_size;
    s->total_pages = tdm_kv_pool_stats(s->kv).total;
    if (s->o.watermark_pages == 0) s->o.watermark_pages = (int)(s->total_pages / 100);
    if (s->o.watermark_pages < 0) s->o.watermark_pages = 0;
    for (int i = 0; i < x->n_eos && s->n_eos < TDM_MAX_EOS; i++)
        s->eos[s->n_eos++] = x->eos[i];
    if (tok && tdm_tok_eos(tok) >= 0) s->eos[s->n_eos++] = tdm_tok_eos(tok);

    size_t n = (size_t)s->o.max_seqs, rows = (size_t)s->max_rows;
    s->running = calloc(n, sizeof *s->running);
    s->pseqs = calloc(n, sizeof *s->pseqs);
    s->drafts = calloc(n, sizeof *s->drafts);
    s->decodes = calloc(n, sizeof *s->decodes);
    s->slots = calloc((size_t)s->o.max_batch_tokens, sizeof *s->slots);
    s->want = calloc(rows, sizeof *s->want);
    s->srows = calloc(rows, sizeof *s->srows);
    s->deny_all = calloc((size_t)tdm_grammar_mask_words(s->vocab), sizeof *s->deny_all);
    s->held = calloc(n, sizeof *s->held);
    s->wsnap = calloc((size_t)s->o.max_waiting, sizeof *s->wsnap);
    if (!s->running || !s->pseqs || !s->drafts || !s->decodes || !s->slots || !s->want ||
        !s->srows || !s->deny_all || !s->held || !s->wsnap)
        goto out_free;
    if (x->iface->launch && x->iface->sample && x->iface->wait && s->o.overlap >= 0) {
        /* the second plan set */
        s->pseqs2 = calloc(n, sizeof *s->pseqs2);
        s->slots2 = calloc((size_t)s->o.max_batch_tokens, sizeof *s->slots2);
        s->want2 = calloc(rows, sizeof *s->want2);
        s->srows2 = calloc(rows, sizeof *s->srows2);
        s->pgen = calloc(n, sizeof *s->pgen);
        s->pgen2 = calloc(n, sizeof *s->pgen2);
        /* every request of two launched plans (grown if ever short) */
        s->kept_cap = 2 * s->o.max_seqs + 8;
        s->kept = calloc((size_t)s->kept_cap, sizeof *s->kept);
        s->kept_step = calloc((size_t)s->kept_cap, sizeof *s->kept_step);
        if (!s->pseqs2 || !s->slots2 || !s->want2 || !s->srows2 || !s->pgen || !s->pgen2 ||
            !s->kept || !s->kept_step)
            goto out_free;
    }
    const char *spans = getenv("TANDEM_SCHED_OVERLAP_SPANS"); /* for comparisons */
    s->overlap_spans = spans && *spans == '1';
    const char *faults = getenv("TANDEM_SCHED_FAULTS");
    if (faults && *faults) {
        unsigned long long step = 0;
        long long ms = 0;
        int used = 0;
        if (sscanf(faults, "stall:%llu:%lld%n", &step, &ms, &used) != 2 || faults[used] || !step) {
            fail = tdm_err_set(TDM_EINVAL, "TANDEM_SCHED_FAULTS: want stall:STEP:MS, got \"%s\"",
                               faults);
            goto out_fail;
        }
        s->fault_step = step;
        s->fault_ms = ms;
        TDM_WARN("sched: fault injection: step %llu sleeps %lld ms", step, ms);
    }
    if (s->o.row_outputs && !tdm_sched_row_outputs(s)) goto out_free;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->mmu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_idle, NULL);
    pthread_mutex_init(&s->wmu, NULL);
    pthread_cond_init(&s->wcv, NULL);
    metrics_init(&s->m);
    s->accepting = true;
    s->next_id = 1;
    *out = s;
    return TDM_OK;

out_free:
    fail = tdm_err_set(TDM_ENOMEM, "sched: out of memory");
out_fail:
    free_overlap_sets(s);
    free(s->held);
    free(s->wsnap);
    free(s->running);
    free(s->pseqs);
    free(s->drafts);
    free(s->decodes);
    free(s->slots);
    free(s->want);
    free(s->srows);
    free(s->deny_all);
    free(s->logits);
    free(s->hidden);
    free(s->features);
    free(s->feeds);
    free(s->launches);
    free(s->launch_next);
    free(s);
    return fail;
}

tdm_status tdm_sched_create(tdm_engine_t *engine, const tdm_tok_t *tok,
                            const struct tdm_sched_opts *opts, tdm_sched_t **out)
{
    struct tdm_sched_exec x;
    struct tdm_engine_exec *ex = NULL;
    int max_seqs = opts && opts->max_seqs > 0 ? opts->max_seqs : 0;
    tdm_status st = tdm_sched_engine_exec_create(engine, max_seqs, &x, &ex);
    if (st != TDM_OK) return st;
    if ((st = tdm_sched_create_exec(&x, tok, opts, out)) != TDM_OK) {
        tdm_sched_engine_exec_destroy(ex);
        return st;
    }
    (*out)->engine_exec = ex;
    return TDM_OK;
}

/* Reserves the logit and hidden rows; false when out of memory. */
bool tdm_sched_row_outputs(struct tdm_sched *s)
{
    if (s->row_outputs) return true;
    size_t rows = (size_t)s->max_rows;
    if (!s->logits) s->logits = malloc(rows * (size_t)s->vocab * sizeof(float));
    if (!s->hidden) s->hidden = malloc(rows * (size_t)TDM_MAX(s->x.d_model, 1) * sizeof(float));
    s->row_outputs = s->logits && s->hidden;
    return s->row_outputs;
}

/* ---- submission (any thread) ---- */

/* A validated request with its buffers, not yet queued (req_discard undoes it). */
static tdm_status req_new(struct tdm_sched *s, const struct tdm_req_params *p, struct tdm_req **out)
{
    if (!p->prompt || p->n_prompt < 1) return tdm_err_set(TDM_EINVAL, "the prompt is empty");
    if (p->kv_peer && strlen(p->kv_peer) >= TDM_REQ_KV_PEER_MAX)
        return tdm_err_set(TDM_EINVAL, "the KV peer name is over %d bytes",
                           TDM_REQ_KV_PEER_MAX - 1);
    if (p->n_prompt >= s->max_ctx)
        return tdm_err_set(TDM_ERANGE,
                           "the prompt has %d tokens; this model's context is %d tokens (at "
                           "least one must be left to generate)",
                           p->n_prompt, s->max_ctx);
    if (p->max_tokens < (p->prompt_logprobs ? 0 : 1))
        return tdm_err_set(TDM_EINVAL, "max_tokens must be at least 1 (0 only when the prompt "
                                       "is scored)");
    if (p->prompt_logprobs && (p->prefill_only || p->want_logits || p->want_hidden))
        return tdm_err_set(TDM_EINVAL, "prompt log-probabilities are for a request that "
                                       "samples here (not prefill_only, want_logits or "
                                       "want_hidden)");
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
    if (p->fixed_chunk > 0 && (p->chunk_phase < 0 || p->chunk_phase >= p->fixed_chunk))
        return tdm_err_set(TDM_EINVAL, "chunk_phase must be between 0 and fixed_chunk - 1");
    if (p->grammar && tdm_grammar_vocab_size(p->grammar) != s->vocab)
        return tdm_err_set(TDM_EINVAL, "the grammar was made for %d tokens; the model has %d",
                           tdm_grammar_vocab_size(p->grammar), s->vocab);
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
    if ((p->want_logits || p->want_hidden) && !s->row_outputs)
        return tdm_err_set(TDM_EINVAL, "this scheduler keeps no logit or hidden-state rows "
                                       "(tdm_sched_opts.row_outputs)");

    struct tdm_req *r = calloc(1, sizeof *r);
    if (!r) return tdm_err_set(TDM_ENOMEM, "out of memory");
    /* a tree drafter's nodes all join the token list until the commit, however few of them
     * can still be published */
    int cap =
        p->n_prompt + p->max_tokens + (s->drafter && s->drafter->tree ? TDM_TREE_MAX_NODES : 0);
    size_t nout = (size_t)p->max_tokens;
    r->tokens = malloc((size_t)cap * sizeof *r->tokens);
    r->tokens_cap = cap;
    bool lp = p->top_logprobs >= 0;
    if (lp) r->logprobs = malloc(nout * sizeof *r->logprobs);
    if (p->top_logprobs > 0) {
        r->top_ids = malloc(nout * (size_t)p->top_logprobs * sizeof *r->top_ids);
        r->top_lps = malloc(nout * (size_t)p->top_logprobs * sizeof *r->top_lps);
    }
    const int ptop = TDM_MAX(p->top_logprobs, 0);
    if (p->prompt_logprobs) {
        const size_t np = (size_t)p->n_prompt;
        r->p_lps = malloc(np * sizeof *r->p_lps);
        if (ptop) {
            r->p_top_ids = malloc(np * (size_t)ptop * sizeof *r->p_top_ids);
            r->p_top_lps = malloc(np * (size_t)ptop * sizeof *r->p_top_lps);
        }
    }
    if (!r->tokens || (lp && !r->logprobs) ||
        (p->top_logprobs > 0 && (!r->top_ids || !r->top_lps)) ||
        (p->prompt_logprobs && (!r->p_lps || (ptop && (!r->p_top_ids || !r->p_top_lps))))) {
        st = tdm_err_set(TDM_ENOMEM, "out of memory");
        goto out_buffers;
    }
    if (s->drafter && s->drafter->state_bytes &&
        !(r->dstate = calloc(1, s->drafter->state_bytes))) {
        st = tdm_err_set(TDM_ENOMEM, "out of memory");
        goto out_buffers;
    }
    /* a remote fill may bring a feature drafter its inputs (tdm_req_remote_done_feed) */
    if (s->drafter && s->drafter->feed && s->conn && s->conn->admit && !p->prefill_only &&
        !(r->remote_feature = malloc((size_t)s->feat_dim * sizeof(float)))) {
        st = tdm_err_set(TDM_ENOMEM, "out of memory");
        goto out_buffers;
    }
    if ((st = tdm_sampler_init(&r->smp, &p->sampling, 0, s->vocab)) != TDM_OK) goto out_buffers;
    if (p->n_bias &&
        (st = tdm_sampler_set_bias(&r->smp, p->bias_ids, p->bias_vals, p->n_bias)) != TDM_OK) {
        tdm_sampler_free(&r->smp);
        goto out_buffers;
    }
    memcpy(r->tokens, p->prompt, (size_t)p->n_prompt * sizeof *r->tokens);
    for (int i = 0; i < p->n_prompt; i++)
        tdm_sampler_accept(&r->smp, p->prompt[i], true);
    r->n_prompt = r->n_tokens = p->n_prompt;
    if (p->kv_peer) snprintf(r->kv_peer, sizeof r->kv_peer, "%s", p->kv_peer);
    r->max_tokens = p->max_tokens;
    r->min_tokens = p->min_tokens;
    r->top_k_lp = p->top_logprobs;
    r->score = p->prompt_logprobs;
    if (p->grammar && !p->prefill_only) {
        r->grammar = tdm_grammar_ref(p->grammar);
        r->gstate = tdm_grammar_start(r->grammar);
    }
    r->p_top = p->prompt_logprobs ? ptop : 0;
    r->ignore_eos = p->ignore_eos;
    memcpy(r->stop_ids, p->stop_ids, sizeof r->stop_ids);
    r->n_stop_ids = p->n_stop_ids;
    r->prefill_only = p->prefill_only;
    r->fixed_chunk = p->fixed_chunk;
    r->chunk_phase = p->fixed_chunk > 0 ? p->chunk_phase : 0;
    r->spec_k = p->spec_k;
    r->penalties = r->smp.out_count != NULL;
    r->want =
        (uint8_t)((p->prefill_only ? 0 : TDM_ROW_SAMPLE) | (p->want_logits ? TDM_ROW_LOGITS : 0) |
                  (p->want_hidden ? TDM_ROW_HIDDEN : 0));
    r->user = p->user;
    r->notify = p->notify;
    r->notify_ctx = p->notify_ctx;
    r->sched = s;
    atomic_init(&r->remote, REMOTE_NONE);
    atomic_init(&r->state, TDM_REQ_WAITING);
    r->batch_slot = -1;
    r->stop_at = -1;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    atomic_init(&r->refs, 2); /* the submitter's and the scheduler's */
    r->t_submit_ns = (int64_t)tdm_now_ns();
    *out = r;
    return TDM_OK;

out_buffers:
    req_buffers_free(r);
    return st;
}

/* A request that req_new made and that was never queued (no one else holds it). */
static void req_discard(struct tdm_req *r)
{
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    tdm_sampler_free(&r->smp);
    tdm_grammar_unref(r->grammar);
    req_buffers_free(r);
}

tdm_status tdm_sched_submit_group(tdm_sched_t *s, const struct tdm_req_params *ps, int n,
                                  tdm_req_t **out)
{
    if (n < 1 || n > TDM_SCHED_MAX_GROUP)
        return tdm_err_set(TDM_ERANGE, "a group has 1 to %d requests, not %d", TDM_SCHED_MAX_GROUP,
                           n);
    for (int i = 1; i < n; i++)
        if (ps[i].n_prompt != ps[0].n_prompt || !ps[i].prompt || !ps[0].prompt ||
            memcmp(ps[i].prompt, ps[0].prompt, (size_t)ps[0].n_prompt * sizeof(int32_t)) ||
            ps[i].prefill_only || ps[0].prefill_only)
            return tdm_err_set(TDM_EINVAL, "the requests of a group share one prompt, and none is "
                                           "prefill-only");
    struct tdm_req *rs[TDM_SCHED_MAX_GROUP];
    for (int i = 0; i < n; i++) {
        tdm_status st = req_new(s, &ps[i], &rs[i]);
        if (st != TDM_OK) {
            while (i-- > 0)
                req_discard(rs[i]);
            return st;
        }
    }
    pthread_mutex_lock(&s->mu);
    bool stalled = atomic_load(&s->stall_since_ns) != 0;
    if (!s->accepting || s->n_waiting + n > s->o.max_waiting || stalled) {
        bool stopping = !s->accepting;
        pthread_mutex_unlock(&s->mu);
        pthread_mutex_lock(&s->mmu);
        s->m.rejected += (uint64_t)n;
        pthread_mutex_unlock(&s->mmu);
        for (int i = 0; i < n; i++)
            req_discard(rs[i]);
        return stopping  ? tdm_err_set(TDM_ECANCELED, "the server is shutting down")
               : stalled ? tdm_err_set(TDM_EAGAIN,
                                       "the scheduler is stalled: a step has run for "
                                       "%lld ms",
                                       (long long)tdm_sched_stall_ms(s))
                         : tdm_err_set(TDM_EAGAIN, "the waiting queue is full (%d requests)",
                                       s->o.max_waiting);
    }
    struct tdm_req **pp = &s->wait_head;
    while (*pp)
        pp = &(*pp)->next;
    for (int i = 0; i < n; i++) {
        rs[i]->id = s->next_id++;
        if (i) { /* a follower holds its leader until it is freed */
            rs[i]->leader = rs[0];
            rs[0]->has_followers = true;
            atomic_fetch_add(&rs[0]->refs, 1);
        }
        *pp = rs[i];
        pp = &rs[i]->next;
        out[i] = rs[i];
    }
    s->n_waiting += n;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return TDM_OK;
}

tdm_status tdm_sched_submit(tdm_sched_t *s, const struct tdm_req_params *p, tdm_req_t **out)
{
    return tdm_sched_submit_group(s, p, 1, out);
}

uint64_t tdm_req_id(const tdm_req_t *r)
{
    return r->id;
}

const char *tdm_req_kv_peer(const tdm_req_t *r)
{
    return r->kv_peer[0] ? r->kv_peer : NULL;
}

void tdm_req_cancel(tdm_req_t *r)
{
    atomic_store(&r->cancel, true);
}

void tdm_req_stop(tdm_req_t *r)
{
    atomic_store(&r->stop, true);
    atomic_store(&r->cancel, true);
}

void tdm_req_release(tdm_req_t *r)
{
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->notify = NULL; /* the hook's context may go away now */
    pthread_mutex_unlock(&r->mu);
    atomic_store(&r->cancel, true);
    tdm_sched_req_unref(r);
}

bool tdm_req_wait(tdm_req_t *r, int seen_out, int timeout_ms)
{
    struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, timeout_ms);
    pthread_mutex_lock(&r->mu);
    bool news;
    while (!(news = r->n_out > seen_out || r->finish)) {
        if (pthread_cond_timedwait(&r->cv, &r->mu, &dl)) break;
    }
    news = r->n_out > seen_out || r->finish;
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
    v->stop_at = r->stop_at;
    v->text_end = NULL;
    v->text = NULL;
    v->text_len = 0;
    v->finish = r->finish;
    v->error = r->error;
    memcpy(v->error_msg, r->error_msg, sizeof v->error_msg);
    v->n_prompt = r->n_prompt;
    v->prompt_lps = r->p_lps;
    v->prompt_top_ids = r->p_top_ids;
    v->prompt_top_lps = r->p_top_lps;
    v->prompt_top = r->p_top;
    v->n_scored = r->n_scored;
    v->cached_tokens = r->cached_tokens;
    v->t_submit_ns = r->t_submit_ns;
    v->t_first_ns = r->t_first_ns;
    v->t_end_ns = r->t_end_ns;
    v->n_preempted = r->n_preempted;
}

void tdm_req_unlock(tdm_req_t *r)
{
    pthread_mutex_unlock(&r->mu);
}

static void drafter_join(struct tdm_sched *s);
static tdm_status overlap_collect(struct tdm_sched *s);

static void *sched_main(void *arg)
{
    struct tdm_sched *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && !s->n_waiting && !s->n_running && !s->inflight &&
               !atomic_load(&s->flush_prefix))
            pthread_cond_wait(&s->cv_work, &s->mu);
        bool stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop) break;
        drafter_join(s);
        /* the step's plan takes the prefix cache's turn first (a flush asked for); after it,
         * the figures its inserts and evictions left, before a sleep */
        const bool ran = tdm_sched_step(s);
        prefix_turn(s);
        if (!ran) {
            /* Waiting requests that cannot be admitted yet, nothing running: sleep briefly
             * (pages come back only through cancellation, which also signals). */
            pthread_mutex_lock(&s->mu);
            struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, 5);
            if (!s->stop) pthread_cond_timedwait(&s->cv_work, &s->mu, &dl);
            pthread_mutex_unlock(&s->mu);
        }
    }
    drafter_join(s);
    overlap_collect(s);
    tdm_sched_reap_cancelled(s, true);
    return NULL;
}

/* ---- the watchdog ---- */

int64_t tdm_sched_stall_ms(const tdm_sched_t *s)
{
    uint64_t t0 = atomic_load(&((struct tdm_sched *)s)->stall_since_ns);
    return t0 ? (int64_t)((tdm_now_ns() - t0) / 1000000u) : 0;
}

/* Fails a request the stalled scheduler holds: its client gets the error now; the scheduler
 * drops it when (if) its step comes back. The caller holds a reference. Counted before the
 * client can see it, as every finish is. */
static void fail_hung(struct tdm_sched *s, struct tdm_req *r, int64_t ms)
{
    if (atomic_exchange(&r->hung, true)) return;
    atomic_store(&r->cancel, true);
    pthread_mutex_lock(&s->mmu);
    s->m.watchdog_failed++;
    pthread_mutex_unlock(&s->mmu);
    pthread_mutex_lock(&r->mu);
    if (r->finish == TDM_FINISH_NONE) {
        r->finish = TDM_FINISH_ERROR;
        r->error = TDM_ETIMEDOUT;
        snprintf(r->error_msg, sizeof r->error_msg,
                 "the scheduler is stalled: a step has made no progress for %lld ms",
                 (long long)ms);
        r->t_end_ns = (int64_t)tdm_now_ns();
    }
    tdm_sched_req_news(r);
    pthread_mutex_unlock(&r->mu);
}

/* The step in flight is past the limit (wmu held): flag the stall, fail what it holds. */
static void stall(struct tdm_sched *s, uint64_t now)
{
    int64_t ms = (int64_t)((now - s->step_t0_ns) / 1000000u);
    if (s->step_failed) {
        atomic_store(&s->stall_since_ns, s->step_t0_ns);
        return;
    }
    s->step_failed = true;
    pthread_mutex_lock(&s->mmu);
    s->m.stalls++;
    pthread_mutex_unlock(&s->mmu);
    atomic_store(&s->stall_since_ns, s->step_t0_ns);
    TDM_ERROR("sched: stalled: a step has run for %lld ms (limit %d ms); failing its %d "
              "running requests and the waiting ones",
              (long long)ms, s->o.watchdog_ms, s->n_held);
    for (int i = 0; i < s->n_held; i++)
        fail_hung(s, s->held[i], ms);
    /* the waiting list, copied with a reference each (s->mu and r->mu never nest) */
    int n = 0;
    pthread_mutex_lock(&s->mu);
    for (struct tdm_req *r = s->wait_head; r && n < s->o.max_waiting; r = r->next) {
        atomic_fetch_add(&r->refs, 1);
        s->wsnap[n++] = r;
    }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < n; i++) {
        fail_hung(s, s->wsnap[i], ms);
        tdm_sched_req_unref(s->wsnap[i]);
    }
}

static void *watchdog_main(void *arg)
{
    struct tdm_sched *s = arg;
    int tick = TDM_MAX(10, TDM_MIN(s->o.watchdog_ms / 8, 1000));
    pthread_mutex_lock(&s->wmu);
    while (!s->wstop) {
        struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, tick);
        pthread_cond_timedwait(&s->wcv, &s->wmu, &dl);
        uint64_t now = tdm_now_ns();
        if (s->step_t0_ns && now - s->step_t0_ns > (uint64_t)s->o.watchdog_ms * 1000000u)
            stall(s, now);
    }
    pthread_mutex_unlock(&s->wmu);
    return NULL;
}

/* What the step holds: the running requests (a reference each), taken when it begins and
 * again once its plan has admitted new ones. */
static void watch_held(struct tdm_sched *s, bool begin)
{
    if (!s->wstarted) return;
    pthread_mutex_lock(&s->wmu);
    for (int i = 0; i < s->n_held; i++)
        tdm_sched_req_unref(s->held[i]);
    s->n_held = s->n_running;
    for (int i = 0; i < s->n_running; i++) {
        atomic_fetch_add(&s->running[i]->refs, 1);
        s->held[i] = s->running[i];
    }
    if (begin) {
        s->step_failed = false;
        s->step_t0_ns = tdm_now_ns();
    } else if (s->step_failed) { /* stalled in the plan: the admitted ones fail too */
        int64_t ms = (int64_t)((tdm_now_ns() - s->step_t0_ns) / 1000000u);
        for (int i = 0; i < s->n_held; i++)
            fail_hung(s, s->held[i], ms);
    }
    pthread_mutex_unlock(&s->wmu);
}

static void watch_end(struct tdm_sched *s)
{
    if (!s->wstarted) return;
    pthread_mutex_lock(&s->wmu);
    if (atomic_load(&s->stall_since_ns))
        TDM_WARN("sched: the stalled step came back after %lld ms; going on",
                 (long long)((tdm_now_ns() - s->step_t0_ns) / 1000000u));
    atomic_store(&s->stall_since_ns, 0);
    s->step_t0_ns = 0;
    int n = s->n_held;
    s->n_held = 0;
    pthread_mutex_unlock(&s->wmu);
    for (int i = 0; i < n; i++)
        tdm_sched_req_unref(s->held[i]); /* the step has ended: no one else reads held */
}

tdm_status tdm_sched_start(tdm_sched_t *s)
{
    if (s->started) return TDM_OK;
    if (s->o.watchdog_ms > 0 && !s->wstarted) {
        s->wstop = false;
        if (pthread_create(&s->wthread, NULL, watchdog_main, s))
            return tdm_err_set(TDM_EINTERNAL, "sched: cannot start the watchdog thread");
        s->wstarted = true;
    }
    if (pthread_create(&s->thread, NULL, sched_main, s))
        return tdm_err_set(TDM_EINTERNAL, "sched: cannot start the scheduler thread");
    s->started = true;
    return TDM_OK;
}

static void watchdog_stop(struct tdm_sched *s)
{
    if (!s->wstarted) return;
    pthread_mutex_lock(&s->wmu);
    s->wstop = true;
    pthread_cond_broadcast(&s->wcv);
    pthread_mutex_unlock(&s->wmu);
    pthread_join(s->wthread, NULL);
    s->wstarted = false;
}

bool tdm_sched_stop(tdm_sched_t *s, int drain_ms)
{
    if (s->abandoned) return false;
    pthread_mutex_lock(&s->mu);
    s->accepting = false;
    struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, TDM_MAX(drain_ms, 0));
    if (drain_ms > 0 && s->started) {
        while (s->n_running || s->n_waiting)
            if (pthread_cond_timedwait(&s->cv_idle, &s->mu, &dl)) break;
    }
    s->stop = true;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    if (s->started) {
        /* a healthy thread is joined however long its last step takes; a stalled one is
         * given up at the drain deadline */
        for (;;) {
            struct timespec slice = tdm_deadline_ms(CLOCK_REALTIME, 50);
            if (pthread_timedjoin_np(s->thread, NULL, &slice) == 0) break;
            struct timespec now;
            clock_gettime(CLOCK_REALTIME, &now);
            bool past =
                now.tv_sec > dl.tv_sec || (now.tv_sec == dl.tv_sec && now.tv_nsec >= dl.tv_nsec);
            if (past && tdm_sched_stall_ms(s) > 0) {
                TDM_ERROR("sched: the scheduler thread is stalled in a step (%lld ms); giving "
                          "it up",
                          (long long)tdm_sched_stall_ms(s));
                s->abandoned = true;
                return false;
            }
        }
        s->started = false;
    } else {
        drafter_join(s);
        overlap_collect(s);
        tdm_sched_reap_cancelled(s, true);
    }
    watchdog_stop(s);
    return true;
}

/* The drafter's launched work (tdm_sched_drafter_i.launch) is done: the pages of the spans it
 * reads and writes may change hands after this. */
static void drafter_join(struct tdm_sched *s)
{
    if (!s->launched) return;
    s->launched = false;
    s->drafter->join(s->drafter_ctx);
}

/* Hands the drafter the decode spans this run verified (before their commit): every position
 * of each, and the token the target's row chose there. */
static void drafter_launch(struct tdm_sched *s, const struct tdm_sched_plan *p)
{
    int n = 0, rows = 0;
    for (int j = 0; j < p->n_seqs; j++) {
        const struct tdm_plan_seq *q = &p->seqs[j];
        struct tdm_req *r = q->req;
        /* a chain's decode span: the last committed token and its drafts, every row sampled */
        if (!q->last || q->tree || !q->features || q->n_score || q->n_rows != q->n_tokens ||
            r->prefill_only || !r->dstate || r->spec_k < 0 || q->pos0 + 1 < r->n_prompt)
            continue;
        for (int i = 0; i < q->n_rows; i++)
            s->launch_next[rows + i] = p->samples[q->row0 + i].token;
        s->launches[n] = tdm_sched_feed_of(r, q->pos0, q->n_tokens, q->features);
        s->launches[n++].next = s->launch_next + rows;
        rows += q->n_rows;
    }
    if (!n) return;
    s->drafter->launch(s->drafter_ctx, s->launches, n);
    s->launched = true;
}

/* ---- the overlap (sched.h) ---- */

static bool overlap_on(const struct tdm_sched *s)
{
    if (!s->pseqs2 || (s->o.overlap == 0 && !s->x.async) || s->drafter) return false;
    return !(s->conn && (s->conn->step_begin || s->conn->step_end));
}

void tdm_sched_release_kv(struct tdm_sched *s, struct tdm_req *r)
{
    if (!r->launches || !r->kv.n_pages) {
        tdm_kv_seq_release(s->kv, &r->kv);
        return;
    }
    /* A launched plan may still write these pages on the device, and read this page table
     * (a step launched after its commit). A remote fill (RDMA, a copier) into a page given
     * out again is not ordered with the device: the table is kept, pages and all, until the
     * plan launched last is collected. */
    if (s->n_kept == s->kept_cap) {
        int cap = TDM_MAX(2 * s->kept_cap, 16);
        struct tdm_kv_seq *k = realloc(s->kept, (size_t)cap * sizeof *k);
        uint64_t *ks = k ? realloc(s->kept_step, (size_t)cap * sizeof *ks) : NULL;
        if (k) s->kept = k;
        if (!ks) {
            TDM_ERROR("sched: out of memory to keep the pages of a request a launched step may "
                      "still write; released now");
            tdm_kv_seq_release(s->kv, &r->kv);
            return;
        }
        s->kept_step = ks;
        s->kept_cap = cap;
    }
    s->kept[s->n_kept] = r->kv;
    s->kept_step[s->n_kept++] = s->launched_step;
    r->kv = (struct tdm_kv_seq){0};
}

/* Releases the page tables kept for plans up to `step` (all of them: UINT64_MAX). */
static void release_kept_until(struct tdm_sched *s, uint64_t step)
{
    int n = 0;
    while (n < s->n_kept && s->kept_step[n] <= step)
        tdm_kv_seq_release(s->kv, &s->kept[n++]);
    if (!n) return;
    memmove(s->kept, s->kept + n, (size_t)(s->n_kept - n) * sizeof *s->kept);
    memmove(s->kept_step, s->kept_step + n, (size_t)(s->n_kept - n) * sizeof *s->kept_step);
    s->n_kept -= n;
}

/* A launched plan has run (or never will): its requests' pages are no longer written by it. */
static void overlap_ran(struct tdm_sched_plan *p)
{
    for (int j = 0; j < p->n_seqs; j++)
        p->seqs[j].req->launches--;
}

/* Drops the references a launched plan's spans took. */
static void overlap_unref(struct tdm_sched_plan *p)
{
    for (int j = 0; j < p->n_seqs; j++)
        tdm_sched_req_unref(p->seqs[j].req);
}

/* Waits for the launched plan and commits it (its buffers: the second set), drops the
 * references its spans held, and releases the page tables kept for it. Armed for the watchdog
 * when the caller's step is not (the wait may be where a stuck device shows). */
static tdm_status overlap_collect(struct tdm_sched *s)
{
    if (!s->inflight) return TDM_OK;
    bool arm = s->wstarted && !s->step_t0_ns;
    if (arm) watch_held(s, true);
    s->inflight = false;
    s->n_blocked = 0;
    struct tdm_sched_plan *p = &s->fl;
    tdm_status st = s->x.iface->wait(s->x.ctx, p);
    overlap_ran(p); /* what its commit releases is free unless a later plan holds it */
    tdm_sched_commit(s, p, s->pgen2, st);
    overlap_unref(p);
    release_kept_until(s, p->step);
    if (arm) watch_end(s);
    return st;
}

/* After a failed wait, the plan built behind that step (launched references taken, gens in
 * s->pgen) keeps only the requests its commit left running: an error fails every request of
 * a step, and their spans here name that step's tokens (TDM_TOKEN_PREV), which the executor
 * no longer has, so launched as they are they would fail the whole plan, and with it requests
 * the failed step never held. What the dropped spans reserved goes with their requests. */
static void plan_drop_ended(struct tdm_sched *s, struct tdm_sched_plan *p)
{
    struct tdm_plan_seq *seqs = s->pseqs;
    int n = 0, rows = 0, tokens = 0;
    for (int j = 0; j < p->n_seqs; j++) {
        struct tdm_plan_seq q = seqs[j];
        struct tdm_req *r = q.req;
        if (tdm_req_state(r) == TDM_REQ_FINISHED || r->gen != s->pgen[j]) {
            r->launches--;
            tdm_sched_req_unref(r);
            continue;
        }
        memmove(s->want + rows, s->want + q.row0, (size_t)q.n_rows * sizeof *s->want);
        memmove(s->srows + rows, s->srows + q.row0, (size_t)q.n_rows * sizeof *s->srows);
        q.row0 = rows;
        seqs[n] = q;
        s->pgen[n] = s->pgen[j];
        r->batch_slot = n++;
        rows += q.n_rows;
        tokens += q.n_tokens;
    }
    if (n < p->n_seqs)
        TDM_WARN("sched: step %llu failed; the next step runs %d of its %d requests (the rest were "
                 "in it)",
                 (unsigned long long)(p->step - 1), n, p->n_seqs);
    p->n_seqs = n;
    p->n_rows = rows;
    p->n_tokens = tokens;
}

/* What the launched plan s->fl will have done, as the next plan sees it: its spans are in the
 * KV, and a sampling row's token is TDM_TOKEN_PREV of that row. A plan with a row that wants
 * more than a token (logits, hidden states: the executor's single buffers; or nothing, a
 * prefill-only span's, after which the engine names no tokens) is committed before the next
 * is planned (n_blocked), and names none. */
static void overlap_advance(struct tdm_sched *s)
{
    const struct tdm_sched_plan *p = &s->fl;
    for (int i = 0; i < p->n_rows; i++)
        s->n_blocked += p->want[i] != TDM_ROW_SAMPLE;
    if (s->n_blocked) return; /* the next call commits it first: n_cached there */
    for (int j = 0; j < p->n_seqs; j++) {
        const struct tdm_plan_seq *q = &p->seqs[j];
        struct tdm_req *r = q->req;
        if (tdm_req_state(r) == TDM_REQ_FINISHED || r->gen != s->pgen2[j]) continue;
        r->n_cached = q->pos0 + q->n_tokens;
        if (!q->last || r->prefill_only || !r->max_tokens || q->n_rows <= q->n_score || r->n_draft)
            continue;
        r->tokens[r->n_tokens++] = TDM_TOKEN_PREV(q->row0 + q->n_score);
        r->pending = true;
    }
}

static void swap_sets(struct tdm_sched *s)
{
#define SWAP(a, b)                                                                                 \
    do {                                                                                           \
        void *t_ = (void *)(a);                                                                    \
        (a) = (b);                                                                                 \
        (b) = t_;                                                                                  \
    } while (0)
    SWAP(s->pseqs, s->pseqs2);
    SWAP(s->slots, s->slots2);
    SWAP(s->want, s->want2);
    SWAP(s->srows, s->srows2);
    SWAP(s->pgen, s->pgen2);
#undef SWAP
}

static void fault_sleep(struct tdm_sched *s)
{
    if (!s->fault_step || s->n_steps != s->fault_step) return; /* plan.c counted this step */
    TDM_WARN("sched: fault injection: step %llu sleeps %lld ms", (unsigned long long)s->fault_step,
             (long long)s->fault_ms);
    for (int64_t left = s->fault_ms; left != 0;) {
        int64_t ms = left < 0 ? 1000 : TDM_MIN(left, 1000);
        struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        if (left > 0) left -= ms;
    }
}

static void count_step(struct tdm_sched *s, const struct tdm_sched_plan *p)
{
    pthread_mutex_lock(&s->mmu);
    s->m.steps++;
    tdm_hist_observe(&s->m.batch_tokens, p->n_tokens);
    tdm_hist_observe(&s->m.batch_seqs, p->n_seqs);
    pthread_mutex_unlock(&s->mmu);
}

/* A step's start: the watchdog's hold, the reaping, the prefix cache's turn and the plan
 * (tdm_sched_plan_build's result). */
static bool plan_step(struct tdm_sched *s)
{
    watch_held(s, true);
    tdm_sched_reap_cancelled(s, false);
    prefix_turn(s);
    bool progress = tdm_sched_plan_build(s);
    watch_held(s, false);
    return progress;
}

/* One step with overlap: plan N+1, launch its forward pass behind N, wait for N and commit
 * it, then queue N+1's sampling. */
/* The pool cannot give every running request a page: preemption may be needed, and a
 * request a launched step holds frees nothing until that step is collected. */
static bool pool_dry(struct tdm_sched *s)
{
    int64_t free_pages = tdm_kv_pool_stats(s->kv).free;
    if (s->prefix) free_pages += tdm_prefix_cache_evictable(s->prefix);
    return free_pages < s->n_running;
}

static bool step_overlap(struct tdm_sched *s)
{
    /* committed first: a plan that needs its outputs, or one that may preempt (then the step
     * is as without overlap) */
    if (s->inflight && (s->n_blocked || pool_dry(s))) overlap_collect(s);
    bool progress = plan_step(s);
    struct tdm_sched_plan *p = &s->plan;
    if (!p->n_seqs) {
        if (s->inflight) { /* its commit brings what the plan waits for */
            overlap_collect(s);
            progress = true;
        }
        watch_end(s);
        return progress;
    }
    fault_sleep(s);
    for (int j = 0; j < p->n_seqs; j++) { /* alive until its commit, whatever ends it first */
        struct tdm_req *r = p->seqs[j].req;
        atomic_fetch_add(&r->refs, 1);
        r->launches++;
        s->pgen[j] = r->gen;
    }
    s->launched_step = p->step; /* what N's commit releases is kept for it */
    struct tdm_sched_plan launched;
    tdm_status st;
    if (s->inflight && p->n_tokens > p->n_seqs && !s->overlap_spans) {
        /* A span of several tokens (a prefill chunk) makes a step the device runs op by op,
         * whose launch keeps the host for milliseconds: N is committed first, so that its
         * tokens reach their readers on time (launched ahead, they waited for that launch,
         * and the ITL's tail grew). Its placeholders then read the committed tokens. */
        if (overlap_collect(s) != TDM_OK) plan_drop_ended(s, p);
        if (!p->n_seqs) { /* nothing left to launch, and nothing in flight */
            release_kept_until(s, UINT64_MAX);
            watch_end(s);
            return true;
        }
        launched = *p;
        st = s->x.iface->launch(s->x.ctx, p);
    } else {
        launched = *p;
        st = s->x.iface->launch(s->x.ctx, p);
        if (s->inflight) {
            pthread_mutex_lock(&s->mmu);
            s->m.overlapped_steps++;
            pthread_mutex_unlock(&s->mmu);
        }
        overlap_collect(s);
    }
    count_step(s, p);
    tdm_status sst = TDM_OK;
    if (st == TDM_OK) { /* its rows as N's commit left their requests */
        tdm_sched_refresh_rows(s, &launched);
        sst = s->x.iface->sample(s->x.ctx, &launched);
    }
    swap_sets(s);       /* the launched plan's buffers are the second set now */
    if (st != TDM_OK) { /* nothing to wait for: its requests fail */
        overlap_ran(&launched);
        tdm_sched_commit(s, &launched, s->pgen2, st);
        overlap_unref(&launched);
        release_kept_until(s, UINT64_MAX); /* nothing is in flight */
    } else {
        s->fl = launched;
        s->inflight = true;
        if (sst == TDM_OK)
            overlap_advance(s);
        else /* its wait reports the error: commit it before planning, naming nothing */
            s->n_blocked++;
    }
    watch_end(s);
    return true;
}

bool tdm_sched_step(tdm_sched_t *s)
{
    if (overlap_on(s)) return step_overlap(s);
    overlap_collect(s);
    drafter_join(s); /* before the reaping and the plan hand pages out */
    bool progress = plan_step(s);
    struct tdm_sched_plan *p = &s->plan;
    if (!p->n_seqs) {
        watch_end(s);
        return progress; /* a preemption made room: go again at once */
    }
    if (s->conn && s->conn->step_begin) s->conn->step_begin(s->conn_ctx, p);
    uint64_t t0 = tdm_now_ns();
    fault_sleep(s);
    tdm_status st = s->x.iface->run(s->x.ctx, p);
    uint64_t run_ns = tdm_now_ns() - t0;
    if (s->conn && s->conn->step_end) s->conn->step_end(s->conn_ctx, p, st);
    if (s->drafter && s->drafter->step_done && st == TDM_OK)
        s->drafter->step_done(s->drafter_ctx, p, run_ns);
    if (s->drafter && s->drafter->launch && st == TDM_OK) drafter_launch(s, p);
    count_step(s, p);
    tdm_sched_commit(s, p, NULL, st);
    watch_end(s);
    return true;
}

void tdm_sched_destroy(tdm_sched_t *s)
{
    if (!s) return;
    if (!tdm_sched_stop(s, 0)) return; /* stalled and given up: its thread may touch all of it */
    if (s->prefix) { /* every page back to the pool, which outlives the scheduler */
        tdm_kv_pool_set_reclaim(s->kv, NULL, NULL);
        tdm_prefix_cache_destroy(s->prefix);
    }
    pthread_mutex_destroy(&s->wmu);
    pthread_cond_destroy(&s->wcv);
    free(s->held);
    free(s->wsnap);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->mmu);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_idle);
    tdm_sched_engine_exec_destroy(s->engine_exec);
    free_overlap_sets(s);
    free(s->running);
    free(s->pseqs);
    free(s->drafts);
    free(s->decodes);
    free(s->slots);
    free(s->want);
    free(s->srows);
    free(s->deny_all);
    free(s->hidden);
    free(s->logits);
    free(s->features);
    free(s->feeds);
    free(s->launches);
    free(s->launch_next);
    free(s->trees);
    free(s->tree_pos);
    free(s->tree_undo);
    free(s->tree_cand);
    free(s->tree_mask);
    free(s);
}

tdm_status tdm_sched_reserve_rows(tdm_sched_t *s)
{
    if (tdm_sched_row_outputs(s)) return TDM_OK;
    return tdm_err_set(TDM_ENOMEM, "sched: out of memory for %d logit and hidden-state rows",
                       s->max_rows);
}

void tdm_sched_set_connector(tdm_sched_t *s, const struct tdm_kv_connector_i *c, void *ctx)
{
    s->conn = c;
    s->conn_ctx = ctx;
}

tdm_status tdm_sched_set_drafter(tdm_sched_t *s, const struct tdm_sched_drafter_i *d, void *ctx,
                                 int k_max)
{
    s->drafter = d && d->propose && k_max > 0 ? d : NULL;
    s->drafter_ctx = ctx;
    if (s->drafter && d->feature_dim > 0) {
        if (d->feature_dim != s->feat_dim || !d->feed) {
            s->drafter = NULL;
            return tdm_err_set(TDM_EINVAL,
                               "sched: the drafter reads %d-wide features, the "
                               "executor's are %d wide",
                               d->feature_dim, s->feat_dim);
        }
        free(s->features);
        free(s->feeds);
        s->features =
            malloc((size_t)s->o.max_batch_tokens * (size_t)d->feature_dim * sizeof(float));
        s->feeds = calloc((size_t)s->o.max_seqs, sizeof *s->feeds);
        if (!s->features || !s->feeds) {
            s->drafter = NULL;
            return tdm_err_set(TDM_ENOMEM, "sched: out of memory for the drafter's features");
        }
    }
    if (s->drafter && d->launch) {
        if (!d->join || !d->feed) {
            s->drafter = NULL;
            return tdm_err_set(TDM_EINVAL, "sched: a drafter that launches must join and feed");
        }
        free(s->launches);
        free(s->launch_next);
        s->launches = calloc((size_t)s->o.max_seqs, sizeof *s->launches);
        s->launch_next = calloc((size_t)s->o.max_batch_tokens, sizeof *s->launch_next);
        if (!s->launches || !s->launch_next) {
            s->drafter = NULL;
            return tdm_err_set(TDM_ENOMEM, "sched: out of memory for the drafter's launches");
        }
    }
    if (s->drafter && d->tree) {
        const size_t n = (size_t)s->o.max_seqs, rows = (size_t)s->max_rows;
        const size_t per = 1 + TDM_TREE_MAX_NODES;
        free(s->trees);
        free(s->tree_pos);
        free(s->tree_undo);
        free(s->tree_cand);
        free(s->tree_mask);
        s->trees = calloc(n, sizeof *s->trees);
        s->tree_pos = calloc(n * per, sizeof *s->tree_pos);
        s->tree_mask = calloc(n * per, sizeof *s->tree_mask);
        s->tree_undo = calloc(rows * TDM_TREE_MAX_NODES, sizeof *s->tree_undo);
        s->tree_cand = calloc(rows * TDM_SAMPLE_MAX_CAND, sizeof *s->tree_cand);
        if (!s->trees || !s->tree_pos || !s->tree_mask || !s->tree_undo || !s->tree_cand) {
            s->drafter = NULL;
            return tdm_err_set(TDM_ENOMEM, "sched: out of memory for the drafter's trees");
        }
    }
    const int k_cap = s->drafter && d->tree ? TDM_TREE_MAX_NODES : TDM_SPEC_MAX_K;
    s->draft_k = TDM_MIN(TDM_MIN(TDM_MAX(k_max, 0), k_cap), s->o.max_batch_tokens - 1);
    /* verification needs no logits: its rows verify where they are sampled (TDM_SAMPLE_VERIFY) */
    return TDM_OK;
}

tdm_status tdm_sched_reserve_features(tdm_sched_t *s)
{
    if (s->features) return TDM_OK;
    s->features =
        malloc((size_t)s->o.max_batch_tokens * (size_t)TDM_MAX(s->feat_dim, 1) * sizeof(float));
    if (!s->features)
        return tdm_err_set(TDM_ENOMEM, "sched: out of memory for %d tokens' features",
                           s->o.max_batch_tokens);
    return TDM_OK;
}

void tdm_req_remote_done_feed(tdm_req_t *r, const float *feature, int drafter_kv)
{
    /* the scheduler does not touch the mailbox while the request waits for its KV */
    if (r->remote_feature && feature) {
        memcpy(r->remote_feature, feature, (size_t)r->sched->feat_dim * sizeof(float));
        r->remote_drafter_kv = drafter_kv;
        r->remote_fed = true;
    }
    tdm_req_remote_done(r, TDM_OK);
}

void tdm_req_remote_done(tdm_req_t *r, tdm_status st)
{
    struct tdm_sched *s = r->sched;
    atomic_store(&r->remote, st == TDM_OK ? REMOTE_OK : REMOTE_FAILED);
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
}
