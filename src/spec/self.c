/*
 * The self drafter: the target's first N layers, then its final norm and LM head.
 *
 * Depth j of a step (j = 0 .. max k - 1) is one early-exit pass (tdm_engine_run with
 * out.n_layers = N) over every request still drafting: request i feeds its token at position
 * n_i - 1 + j (its last committed token, then its own drafts) and samples position n_i + j
 * with its own sampler, keyed like the target's draw there. So the draft and the target draw
 * from the same uniform (a coupled draw), and at T = 0 both take the argmax. Penalties see the
 * drafts before each draw: they are accepted into the request's sampler as they come and
 * unaccepted, newest first, before returning (the scheduler accepts them again).
 *
 * KV. Each pass writes layers [0, N) of the request's own pages at the drafted positions,
 * which the scheduler reserved; the verify pass writes every layer there, so what is kept is
 * the target's own KV.
 *
 * Ownership: borrows the target engine; owns its batch scratch. Scheduler thread.
 */
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

struct self_drafter {
    tdm_engine_t *e;
    int n_layers;
    int max_seqs;
    struct tdm_batch_seq *seqs;  /* [max_seqs] */
    struct tdm_sample_row *rows; /* [max_seqs] */
    int32_t *tok;                /* [max_seqs] */
    int *idx;                    /* [max_seqs] which draft each batch entry is */
    int *n_acc;                  /* [max_seqs] tokens accepted into each sampler */
    /* rejection acceptance: the drafts' distributions, drawn from with RNG stream 3 */
    bool rejection, one_hot;
    int vocab;
    float *logits; /* [max_seqs][vocab] a pass's rows */
    float *q;      /* [max_seqs][TDM_SPEC_MAX_K][vocab] */
    struct tdm_sample_scratch scratch;
};

/* Rejection acceptance: draft i's distribution at depth j from its pass row (batch entry q),
 * kept for the commit, and a proposal drawn from it with RNG stream 3 (independent of the
 * verifier's streams 1 and 2). One-hot: q is kept as the proposal alone (vLLM's default, for
 * measuring what the full q gains). */
static int32_t draw_q(struct self_drafter *sd, struct tdm_sched_draft *x, int i, int j, int q)
{
    int V = sd->vocab;
    float *qd = sd->q + ((size_t)i * TDM_SPEC_MAX_K + (size_t)j) * V;
    tdm_sampler_dist(x->smp, sd->logits + (size_t)q * V, &sd->scratch, qd);
    const struct tdm_sampler *smp = x->smp;
    uint32_t pos = (uint32_t)(x->n_tokens + j);
    int32_t t = tdm_dist_draw(qd, V, tdm_rng_uniform(smp->params.seed, smp->request_id, pos, 3));
    if (t < 0) t = 0;
    if (sd->one_hot) {
        memset(qd, 0, (size_t)V * sizeof *qd);
        qd[t] = 1.0f;
    }
    x->q = sd->q + (size_t)i * TDM_SPEC_MAX_K * V;
    return t;
}

static void self_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct self_drafter *sd = ctx;
    n = TDM_MIN(n, sd->max_seqs);
    int kmax = 0;
    for (int i = 0; i < n; i++) {
        kmax = TDM_MAX(kmax, d[i].k);
        d[i].n = 0;
        sd->n_acc[i] = 0;
    }
    for (int j = 0; j < kmax; j++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (d[i].k <= j || d[i].n < j) continue; /* done, or stopped by an error */
            if (j > 0) {
                tdm_sampler_accept(d[i].smp, d[i].out[j - 1], false);
                sd->n_acc[i]++;
            }
            int pos = d[i].n_tokens - 1 + j;
            sd->tok[m] = j ? d[i].out[j - 1] : d[i].tokens[d[i].n_tokens - 1];
            sd->seqs[m] = (struct tdm_batch_seq){.tokens = &sd->tok[m],
                                                 .n_tokens = 1,
                                                 .pos0 = pos,
                                                 .pages = d[i].pages,
                                                 .n_pages = d[i].n_pages,
                                                 .n_logits = 1};
            sd->rows[m] = (struct tdm_sample_row){
                .smp = d[i].smp, .position = (uint32_t)(pos + 1), .n_top = -1, .token = -1};
            sd->idx[m++] = i;
        }
        if (!m) break;
        struct tdm_batch b = {.seqs = sd->seqs, .n_seqs = m};
        struct tdm_engine_out out = {.samples = sd->rows, .n_layers = sd->n_layers};
        if (sd->rejection)
            out = (struct tdm_engine_out){.logits = sd->logits, .n_layers = sd->n_layers};
        uint64_t t0 = tdm_now_ns();
        tdm_status st = tdm_engine_run(sd->e, &b, &out);
        tdm_spec_note_pass(sp, m, tdm_now_ns() - t0);
        if (st != TDM_OK) {
            TDM_WARN("spec: a self-draft pass failed (%s); this step drafts %d tokens",
                     tdm_err_msg(), j);
            break;
        }
        for (int q = 0; q < m; q++) {
            struct tdm_sched_draft *x = &d[sd->idx[q]];
            x->out[j] = sd->rejection ? draw_q(sd, x, sd->idx[q], j, q) : sd->rows[q].token;
            x->n = j + 1;
        }
    }
    for (int i = 0; i < n; i++) /* the scheduler accepts the drafts itself */
        for (int a = sd->n_acc[i]; a > 0; a--)
            tdm_sampler_unaccept(d[i].smp, d[i].out[a - 1]);
}

static void self_destroy(void *ctx)
{
    struct self_drafter *sd = ctx;
    if (!sd) return;
    free(sd->seqs);
    free(sd->rows);
    free(sd->tok);
    free(sd->idx);
    free(sd->n_acc);
    free(sd->logits);
    free(sd->q);
    tdm_sample_scratch_free(&sd->scratch);
    free(sd);
}

tdm_status tdm_spec_self_create(tdm_engine_t *target, int n_layers, enum tdm_spec_accept accept,
                                bool one_hot, struct tdm_spec_drafter *out)
{
    const struct tdm_model *m = tdm_engine_model(target);
    int L = m->cfg.n_layers;
    if (n_layers <= 0) n_layers = TDM_MAX(1, L / 4);
    if (n_layers > L) /* N = L: the model drafting for itself, the upper bound of acceptance */
        return tdm_err_set(TDM_EINVAL, "spec self: --spec-self-layers %d: the model has %d layers",
                           n_layers, L);
    struct self_drafter *sd = calloc(1, sizeof *sd);
    if (!sd) return tdm_err_set(TDM_ENOMEM, "spec self: out of memory");
    const struct tdm_engine_opts *eo = tdm_engine_opts(target);
    int n = TDM_MIN(eo->max_seqs, eo->max_logit_rows);
    sd->e = target;
    sd->n_layers = n_layers;
    sd->max_seqs = n;
    sd->seqs = calloc((size_t)n, sizeof *sd->seqs);
    sd->rows = calloc((size_t)n, sizeof *sd->rows);
    sd->tok = calloc((size_t)n, sizeof *sd->tok);
    sd->idx = calloc((size_t)n, sizeof *sd->idx);
    sd->n_acc = calloc((size_t)n, sizeof *sd->n_acc);
    sd->vocab = m->cfg.vocab_size;
    sd->rejection = accept == TDM_SPEC_ACCEPT_REJECTION;
    sd->one_hot = one_hot;
    bool rej_ok = !sd->rejection ||
                  ((sd->logits = malloc((size_t)n * sd->vocab * sizeof(float))) &&
                   (sd->q = malloc((size_t)n * TDM_SPEC_MAX_K * sd->vocab * sizeof(float))) &&
                   tdm_sample_scratch_init(&sd->scratch, sd->vocab) == TDM_OK);
    if (!sd->seqs || !sd->rows || !sd->tok || !sd->idx || !sd->n_acc || !rej_ok) {
        self_destroy(sd);
        return tdm_err_set(TDM_ENOMEM, "spec self: out of memory");
    }
    *out = (struct tdm_spec_drafter){
        .name = "self", .ctx = sd, .propose = self_propose, .destroy = self_destroy};
    return TDM_OK;
}

int tdm_spec_self_layers(const struct tdm_spec_drafter *d)
{
    return ((const struct self_drafter *)d->ctx)->n_layers;
}
