/*
 * The draft-model drafter: a separate, smaller checkpoint with the target's vocabulary.
 *
 * KV. The draft's layers are layer group 1 of the target's pool (the target engine was created
 * with the draft's geometry as an extra group), so a request's one page table covers both, and
 * the scheduler's page reservations, trims and releases serve the draft too. The draft's own
 * engine borrows that pool (tdm_engine_opts.kv_shared) and the target's backend. Per request,
 * tdm_draft_stats.cursor says which positions of the draft's KV hold the request's tokens.
 *
 * A step, for each request with k > 0 (committed tokens [0, n)):
 *   1. catch-up: the draft runs tokens [cursor, n) (the prompt on its first step, else the
 *      accepted drafts and the target's bonus token: "run again to put the bonus token in its
 *      KV"), in chunks that fit its batch, and samples position n from the last: draft 1;
 *   2. depth j = 1 .. k - 1: it runs draft j at position n - 1 + j and samples draft j + 1;
 *   3. its KV now holds positions [0, n + k - 1); after the commit (accepted) only the kept
 *      ones count: cursor = min(n + k - 1, n + accepted).
 * Draws: exact acceptance samples with the request's sampler at each position (the target's
 * keyed uniform: a coupled draw); rejection keeps the draft's distribution q and draws from it
 * with RNG stream 3. Penalties see the drafts as they come (accepted into the request's
 * sampler, unaccepted before returning).
 *
 * The CUDA backend's memory plan does not reserve a draft's weights yet, so this drafter runs
 * on the CPU backend only (refused with a message on CUDA).
 *
 * Ownership: owns the draft engine and its scratch; borrows the draft model (the caller's),
 * the target's pool and backend. Scheduler thread.
 */
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

struct draft_drafter {
    tdm_engine_t *e; /* the draft's engine, on the target's pool (group 1) and backend */
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
static int32_t take(struct draft_drafter *dd, struct tdm_sched_draft *x, int i, int j, int p)
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
static bool run_pass(struct draft_drafter *dd, struct tdm_spec *sp, int m, int rows)
{
    struct tdm_batch b = {.seqs = dd->seqs, .n_seqs = m};
    struct tdm_engine_out out = {.want = dd->want, .samples = dd->rows};
    if (dd->rejection) out = (struct tdm_engine_out){.want = dd->want, .logits = dd->logits};
    for (int r = 0; r < rows; r++)
        dd->want[r] = dd->rejection ? TDM_ROW_LOGITS : TDM_ROW_SAMPLE;
    uint64_t t0 = tdm_now_ns();
    tdm_status st = tdm_engine_run(dd->e, &b, &out);
    tdm_spec_note_pass(sp, m, tdm_now_ns() - t0);
    if (st != TDM_OK) TDM_WARN("spec: a draft-model pass failed: %s", tdm_err_msg());
    return st == TDM_OK;
}

static void draft_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct draft_drafter *dd = ctx;
    n = TDM_MIN(n, dd->max_seqs);
    int kmax = 0;
    for (int i = 0; i < n; i++) {
        d[i].n = 0;
        dd->n_acc[i] = 0;
        int c = d[i].stats->cursor;
        if (c < 0 || c > d[i].n_tokens - 1) c = 0; /* never trust a stale cursor */
        d[i].stats->cursor = c;
        d[i].stats->base = d[i].n_tokens;
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
    if (!ok) { /* nothing proposed; the draft's KV is caught up again from scratch next time */
        for (int i = 0; i < n; i++) {
            d[i].n = 0;
            d[i].stats->cursor = 0;
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
        /* the draft's KV: the catch-up, plus every draft fed at depth >= 1 */
        d[i].stats->cursor = d[i].n ? d[i].n_tokens + d[i].n - 1 : 0;
    }
}

static void draft_accepted(void *ctx, struct tdm_draft_stats *st, int n_draft, int n_accepted)
{
    (void)ctx;
    if (!n_draft) return;
    st->cursor = TDM_MIN(st->cursor, st->base + n_accepted);
}

static void draft_destroy(void *ctx)
{
    struct draft_drafter *dd = ctx;
    if (!dd) return;
    tdm_engine_destroy(dd->e);
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

void tdm_spec_kv_group(const struct tdm_model *draft, struct tdm_kv_group *out)
{
    *out = (struct tdm_kv_group){.n_layers = draft->cfg.n_layers,
                                 .n_kv_heads = draft->cfg.n_kv_heads,
                                 .head_dim = draft->cfg.head_dim};
}

tdm_status tdm_spec_draft_create(tdm_engine_t *target, const struct tdm_model *draft,
                                 enum tdm_spec_accept accept, bool one_hot,
                                 struct tdm_spec_drafter *out)
{
    if (!draft)
        return tdm_err_set(TDM_EINVAL, "spec draft: no draft model (load --spec-draft first)");
    const struct tdm_model_config *tc = &tdm_engine_model(target)->cfg, *dc = &draft->cfg;
    if (dc->vocab_size != tc->vocab_size)
        return tdm_err_set(TDM_EINVAL,
                           "spec draft: the draft's vocabulary has %d tokens, the target's %d: a "
                           "draft must share the target's tokenizer",
                           dc->vocab_size, tc->vocab_size);
    tdm_backend_t *be = tdm_engine_backend(target);
    if (tdm_backend_is_cuda(be))
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "--spec draft runs on the CPU backend only for now: the CUDA memory "
                           "plan does not reserve a draft's weights yet (--spec self works on "
                           "both)");
    tdm_kv_pool_t *kv = tdm_engine_kv(target);
    struct tdm_kv_group want, have;
    tdm_spec_kv_group(draft, &want);
    if (!tdm_kv_pool_group(kv, 1, &have) || have.n_layers != want.n_layers ||
        have.n_kv_heads != want.n_kv_heads || have.head_dim != want.head_dim)
        return tdm_err_set(TDM_EINVAL, "spec draft: the target's KV pool has no layer group "
                                       "for this draft (create the target engine with "
                                       "tdm_spec_kv_group's group in kv_extra)");
    const struct tdm_engine_opts *to = tdm_engine_opts(target);
    struct draft_drafter *dd = calloc(1, sizeof *dd);
    if (!dd) return tdm_err_set(TDM_ENOMEM, "spec draft: out of memory");
    int n = TDM_MIN(to->max_seqs, to->max_logit_rows);
    struct tdm_engine_opts eo = {.n_threads = to->n_threads,
                                 .batch_invariant = to->batch_invariant,
                                 .max_ctx = to->max_ctx,
                                 .max_batch_tokens = to->max_batch_tokens,
                                 .max_seqs = n,
                                 .max_logit_rows = n,
                                 .kv_shared = kv,
                                 .kv_group = 1,
                                 .backend = be};
    tdm_status st = tdm_engine_create(draft, &eo, &dd->e);
    if (st != TDM_OK) {
        free(dd);
        return st;
    }
    dd->max_seqs = n;
    dd->max_tokens = to->max_batch_tokens;
    dd->vocab = tc->vocab_size;
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
        draft_destroy(dd);
        return tdm_err_set(TDM_ENOMEM, "spec draft: out of memory");
    }
    *out = (struct tdm_spec_drafter){.name = "draft",
                                     .ctx = dd,
                                     .propose = draft_propose,
                                     .accepted = draft_accepted,
                                     .destroy = draft_destroy};
    return TDM_OK;
}
