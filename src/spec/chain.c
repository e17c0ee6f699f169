/*
 * The chain drafters: a drafting model run pass by pass, one pass per draft depth, over every
 * request of the batch still drafting. Two drafters are this machinery with different models:
 *   - self (self.c): the target's own engine with an early exit (out.n_layers = N), writing
 *     layers [0, N) of the request's own pages; the verify pass overwrites them with the
 *     target's, so what is kept is the target's own KV and there is nothing to catch up on;
 *   - draft (draft.c): a second checkpoint's engine, whose layers are layer group 1 of the
 *     target's pool (one page table per request); tdm_draft_stats.cursor says which positions
 *     of that KV hold the request's tokens.
 *
 * A step, for each request with k > 0 (committed tokens [0, n)):
 *   1. catch-up: the model runs tokens [cursor, n) (self: cursor is always n - 1; draft: the
 *      prompt on its first step, else the accepted drafts and the target's bonus token: "run
 *      again to put the bonus token in its KV"), in chunks that fit its batch, and samples
 *      position n from the last: draft 1;
 *   2. depth j = 1 .. k - 1: it runs draft j at position n - 1 + j and samples draft j + 1;
 *   3. draft: its KV now holds positions [0, n + k - 1); after the commit (accepted) only the
 *      kept ones count: cursor = min(n + k - 1, n + accepted).
 * Draws: exact acceptance samples with the request's sampler at each position (the target's
 * keyed uniform: a coupled draw); rejection keeps the model's distribution q and draws from it
 * with RNG stream 3 (independent of the verifier's 1 and 2); one-hot keeps q as the proposal
 * alone (vLLM's default, to measure what the full q gains). Penalties see the drafts as they
 * come (accepted into the request's sampler, unaccepted before returning).
 *
 * Ownership: owns its scratch, and the engine when it made it (draft); borrows the model, the
 * target's pool and backend. Scheduler thread.
 */
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

struct chain_drafter {
    tdm_engine_t *e; /* the drafting engine */
    bool owns_engine;
    int n_layers; /* layers each pass runs; 0: all */
    bool own_kv;  /* the model's KV is its own (a layer group), caught up by cursor */
    int max_seqs, max_tokens, vocab;
    bool rejection, one_hot;
    struct tdm_batch_seq *seqs;  /* [max_seqs] */
    struct tdm_sample_row *rows; /* [max_seqs] */
    uint8_t *want;               /* [max_seqs] */
    int32_t *tok;                /* [max_seqs] */
    int *idx;                    /* [max_seqs] */
    int *n_acc;                  /* [max_seqs] */
    int *fed;                    /* [max_seqs] catch-up tokens fed so far */
    float *logits;               /* rejection: [max_seqs][vocab] */
    float *q;                    /* rejection: [max_seqs][TDM_SPEC_MAX_K][vocab] */
    struct tdm_sample_scratch scratch;
};

/* Request i's draft at depth j from its row (pass entry p): sampled by the engine (exact) or
 * drawn from q (rejection, stream 3). */
static int32_t take(struct chain_drafter *dd, struct tdm_sched_draft *x, int i, int j, int p)
{
    if (!dd->rejection) return dd->rows[p].token;
    int V = dd->vocab;
    float *qd = dd->q + ((size_t)i * TDM_SPEC_MAX_K + (size_t)j) * V;
    tdm_sampler_dist(x->smp, dd->logits + (size_t)p * V, &dd->scratch, qd);
    const struct tdm_sampler *smp = x->smp;
    uint32_t pos = (uint32_t)(x->n_tokens + j);
    int32_t t = tdm_dist_draw(qd, V, tdm_rng_uniform(smp->params.seed, smp->request_id, pos, 3));
    if (t < 0) t = 0;
    if (dd->one_hot) {
        memset(qd, 0, (size_t)V * sizeof *qd);
        qd[t] = 1.0f;
    }
    x->q = dd->q + (size_t)i * TDM_SPEC_MAX_K * V;
    return t;
}

/* One pass over the m entries built in dd->seqs; false when it failed. */
static bool run_pass(struct chain_drafter *dd, struct tdm_spec *sp, int m, int rows)
{
    struct tdm_batch b = {.seqs = dd->seqs, .n_seqs = m};
    struct tdm_engine_out out = {.want = dd->want, .samples = dd->rows, .n_layers = dd->n_layers};
    if (dd->rejection)
        out = (struct tdm_engine_out){
            .want = dd->want, .logits = dd->logits, .n_layers = dd->n_layers};
    for (int r = 0; r < rows; r++)
        dd->want[r] = dd->rejection ? TDM_ROW_LOGITS : TDM_ROW_SAMPLE;
    uint64_t t0 = tdm_now_ns();
    tdm_status st = tdm_engine_run(dd->e, &b, &out);
    tdm_spec_note_pass(sp, m, tdm_now_ns() - t0);
    if (st != TDM_OK) TDM_WARN("spec: a draft pass failed: %s", tdm_err_msg());
    return st == TDM_OK;
}

static void chain_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct chain_drafter *dd = ctx;
    n = TDM_MIN(n, dd->max_seqs);
    int kmax = 0;
    for (int i = 0; i < n; i++) {
        d[i].n = 0;
        dd->n_acc[i] = 0;
        int c = d[i].n_tokens - 1; /* self: the target's KV holds everything before */
        if (dd->own_kv) {
            c = d[i].stats->cursor;
            if (c < 0 || c > d[i].n_tokens - 1) c = 0; /* never trust a stale cursor */
            d[i].stats->cursor = c;
            d[i].stats->base = d[i].n_tokens;
        }
        dd->fed[i] = c;
        kmax = TDM_MAX(kmax, d[i].k);
    }
    /* 1. catch-up to position n - 1, whose row draws draft 1; chunks fit the draft's batch */
    bool ok = true;
    while (ok) {
        int m = 0, rows = 0, budget = dd->max_tokens;
        for (int i = 0; i < n && m < dd->max_seqs && budget > 0; i++) {
            int left = d[i].n_tokens - dd->fed[i];
            if (left <= 0) continue;
            int span = TDM_MIN(left, budget);
            bool last = span == left;
            dd->seqs[m++] = (struct tdm_batch_seq){.tokens = d[i].tokens + dd->fed[i],
                                                   .n_tokens = span,
                                                   .pos0 = dd->fed[i],
                                                   .pages = d[i].pages,
                                                   .n_pages = d[i].n_pages,
                                                   .n_logits = last ? 1 : 0};
            if (last) {
                dd->rows[rows] = (struct tdm_sample_row){
                    .smp = d[i].smp, .position = (uint32_t)d[i].n_tokens, .n_top = -1, .token = -1};
                dd->idx[rows++] = i;
            }
            dd->fed[i] += span;
            budget -= span;
        }
        if (!m) break;
        if (!(ok = run_pass(dd, sp, m, rows))) break;
        for (int r = 0; r < rows; r++) {
            struct tdm_sched_draft *x = &d[dd->idx[r]];
            x->out[0] = take(dd, x, dd->idx[r], 0, r);
            x->n = 1;
        }
    }
    if (!ok) { /* nothing proposed; a draft's KV is caught up again from scratch next time */
        for (int i = 0; i < n; i++) {
            d[i].n = 0;
            if (dd->own_kv) d[i].stats->cursor = 0;
        }
        return;
    }
    /* 2. the deeper drafts, one pass per depth */
    for (int j = 1; j < kmax && ok; j++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (d[i].k <= j || d[i].n < j) continue;
            tdm_sampler_accept(d[i].smp, d[i].out[j - 1], false);
            dd->n_acc[i]++;
            int pos = d[i].n_tokens - 1 + j;
            dd->tok[m] = d[i].out[j - 1];
            dd->seqs[m] = (struct tdm_batch_seq){.tokens = &dd->tok[m],
                                                 .n_tokens = 1,
                                                 .pos0 = pos,
                                                 .pages = d[i].pages,
                                                 .n_pages = d[i].n_pages,
                                                 .n_logits = 1};
            dd->rows[m] = (struct tdm_sample_row){
                .smp = d[i].smp, .position = (uint32_t)(pos + 1), .n_top = -1, .token = -1};
            dd->idx[m++] = i;
        }
        if (!m || !(ok = run_pass(dd, sp, m, m))) break;
        for (int q = 0; q < m; q++) {
            struct tdm_sched_draft *x = &d[dd->idx[q]];
            x->out[j] = take(dd, x, dd->idx[q], j, q);
            x->n = j + 1;
        }
    }
    for (int i = 0; i < n; i++) {
        for (int a = dd->n_acc[i]; a > 0; a--) /* the scheduler accepts the drafts itself */
            tdm_sampler_unaccept(d[i].smp, d[i].out[a - 1]);
        /* a draft's KV: the catch-up, plus every draft fed at depth >= 1 */
        if (dd->own_kv) d[i].stats->cursor = d[i].n ? d[i].n_tokens + d[i].n - 1 : 0;
    }
}

static void chain_accepted(void *ctx, struct tdm_draft_stats *st, int n_draft, int n_accepted)
{
    const struct chain_drafter *dd = ctx;
    if (!n_draft || !dd->own_kv) return;
    st->cursor = TDM_MIN(st->cursor, st->base + n_accepted);
}

static void chain_destroy(void *ctx)
{
    struct chain_drafter *dd = ctx;
    if (!dd) return;
    if (dd->owns_engine) tdm_engine_destroy(dd->e);
    free(dd->seqs);
    free(dd->rows);
    free(dd->want);
    free(dd->tok);
    free(dd->idx);
    free(dd->n_acc);
    free(dd->fed);
    free(dd->logits);
    free(dd->q);
    tdm_sample_scratch_free(&dd->scratch);
    free(dd);
}

tdm_status tdm_spec_chain_create(tdm_engine_t *e, bool owns_engine, int n_layers, bool own_kv,
                                 const char *name, enum tdm_spec_accept accept, bool one_hot,
                                 struct tdm_spec_drafter *out)
{
    struct chain_drafter *dd = calloc(1, sizeof *dd);
    if (!dd) {
        if (owns_engine) tdm_engine_destroy(e);
        return tdm_err_set(TDM_ENOMEM, "spec %s: out of memory", name);
    }
    const struct tdm_engine_opts *eo = tdm_engine_opts(e);
    int n = TDM_MIN(eo->max_seqs, eo->max_logit_rows);
    dd->e = e;
    dd->owns_engine = owns_engine;
    dd->n_layers = n_layers;
    dd->own_kv = own_kv;
    dd->max_seqs = n;
    dd->max_tokens = eo->max_batch_tokens;
    dd->vocab = tdm_engine_model(e)->cfg.vocab_size;
    dd->rejection = accept == TDM_SPEC_ACCEPT_REJECTION;
    dd->one_hot = one_hot;
    dd->seqs = calloc((size_t)n, sizeof *dd->seqs);
    dd->rows = calloc((size_t)n, sizeof *dd->rows);
    dd->want = calloc((size_t)n, sizeof *dd->want);
    dd->tok = calloc((size_t)n, sizeof *dd->tok);
    dd->idx = calloc((size_t)n, sizeof *dd->idx);
    dd->n_acc = calloc((size_t)n, sizeof *dd->n_acc);
    dd->fed = calloc((size_t)n, sizeof *dd->fed);
    bool rej_ok = !dd->rejection ||
                  ((dd->logits = malloc((size_t)n * dd->vocab * sizeof(float))) &&
                   (dd->q = malloc((size_t)n * TDM_SPEC_MAX_K * dd->vocab * sizeof(float))) &&
                   tdm_sample_scratch_init(&dd->scratch, dd->vocab) == TDM_OK);
    if (!dd->seqs || !dd->rows || !dd->want || !dd->tok || !dd->idx || !dd->n_acc || !dd->fed ||
        !rej_ok) {
        chain_destroy(dd);
        return tdm_err_set(TDM_ENOMEM, "spec %s: out of memory", name);
    }
    *out = (struct tdm_spec_drafter){.name = name,
                                     .ctx = dd,
                                     .propose = chain_propose,
                                     .accepted = chain_accepted,
                                     .destroy = chain_destroy};
    return TDM_OK;
}

int tdm_spec_chain_layers(const struct tdm_spec_drafter *d)
{
    return ((const struct chain_drafter *)d->ctx)->n_layers;
}
