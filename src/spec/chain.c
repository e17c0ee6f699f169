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
 * keyed uniform: a coupled draw); rejection samples its rows in TDM_SAMPLE_PROPOSE mode, which
 * leaves the model's distribution q in backend memory (on the device, next to the logits, where
 * the target's verify rows read it) and draws from it with RNG stream 3 (independent of the
 * verifier's 1 and 2); one-hot keeps q as the proposal alone (vLLM's default, to measure what
 * the full q gains). Penalties see the drafts as they come (accepted into the request's
 * sampler, unaccepted before returning).
 *
 * Ownership: owns its scratch (q in the backend's memory), and the engine when it made it
 * (draft); borrows the model, the
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
    struct tdm_buf qbuf;         /* rejection: [max_seqs][TDM_SPEC_MAX_K][vocab], the backend's */
    float *q;                    /* its view */
    struct tdm_spec_draws dw;
};

/* Request i's draft at depth j from its row (pass entry p): the row's token, drawn by its
 * sampling (exact: the request's draw; rejection: PROPOSE, which also left q in place). */
static bool run_pass(struct chain_drafter *dd, struct tdm_spec *sp, int m, int rows)
{
    struct tdm_batch b = {.seqs = dd->seqs, .n_seqs = m};
    struct tdm_engine_out out = {.want = dd->want, .samples = dd->rows, .n_layers = dd->n_layers};
    for (int r = 0; r < rows; r++)
        dd->want[r] = TDM_ROW_SAMPLE;
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
                tdm_spec_set_row(&dd->dw, &d[i], i, 0, rows, (uint32_t)d[i].n_tokens);
                dd->idx[rows++] = i;
            }
            dd->fed[i] += span;
            budget -= span;
        }
        if (!m) break;
        if (!(ok = run_pass(dd, sp, m, rows))) break;
        for (int r = 0; r < rows; r++) {
            struct tdm_sched_draft *x = &d[dd->idx[r]];
            x->out[0] = tdm_spec_take(&dd->dw, x, dd->idx[r], r);
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
            tdm_spec_set_row(&dd->dw, &d[i], i, j, m, (uint32_t)(pos + 1));
            dd->idx[m++] = i;
        }
        if (!m || !(ok = run_pass(dd, sp, m, m))) break;
        for (int q = 0; q < m; q++) {
            struct tdm_sched_draft *x = &d[dd->idx[q]];
            x->out[j] = tdm_spec_take(&dd->dw, x, dd->idx[q], q);
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
    free(dd->seqs);
    free(dd->rows);
    free(dd->want);
    free(dd->tok);
    free(dd->idx);
    free(dd->n_acc);
    free(dd->fed);
    tdm_backend_buf_release(tdm_engine_backend(dd->e), &dd->qbuf);
    if (dd->owns_engine) tdm_engine_destroy(dd->e);
    free(dd);
}

tdm_status tdm_spec_q_alloc(tdm_engine_t *e, const struct tdm_engine_opts *sized_by,
                            const char *name, struct tdm_buf *out)
{
    /* q lives where the rows are sampled: the backend's memory when it samples (the device),
     * which is where the target's verify rows read it too */
    tdm_backend_t *be = tdm_engine_backend(e);
    if (!tdm_engine_samples_on_device(e) && tdm_backend_buf_place(be).kind != TDM_MEM_HOST)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "spec %s: rejection acceptance needs device sampling on this "
                           "backend (a vocabulary it samples)",
                           name);
    /* what tdm_spec_engine_opts held back */
    return tdm_backend_buf_new(be, tdm_spec_q_bytes(sized_by, tdm_engine_model(e)->cfg.vocab_size),
                               "the drafts' distributions", out);
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
    if (!dd->seqs || !dd->rows || !dd->want || !dd->tok || !dd->idx || !dd->n_acc || !dd->fed) {
        chain_destroy(dd);
        return tdm_err_set(TDM_ENOMEM, "spec %s: out of memory", name);
    }
    if (dd->rejection) {
        tdm_status st = tdm_spec_q_alloc(e, eo, name, &dd->qbuf);
        if (st != TDM_OK) {
            chain_destroy(dd);
            return st;
        }
        dd->q = dd->qbuf.ptr;
    }
    dd->dw = (struct tdm_spec_draws){dd->rows, dd->q, dd->vocab, dd->rejection, dd->one_hot};
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
