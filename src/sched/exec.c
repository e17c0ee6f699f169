/*
 * The engine as the scheduler's executor: a plan becomes one tdm_engine_run call (or, with
 * overlap, tdm_engine_launch, _launch_sample and _wait). The plan's
 * sequences map one to one onto batch sequences (span, pos0, page table, slots, rows), and its
 * row arrays are the engine's output rows, so nothing is copied but the sequence headers.
 * Scheduler thread; the batch headers are reserved at creation.
 */
#include <stdlib.h>

#include "sched/sched_int.h"

struct tdm_engine_exec {
    tdm_engine_t *engine;
    struct tdm_batch_seq *bseqs; /* [max_seqs] */
};

/* The plan as the engine's batch and outputs (the sequence headers in x->bseqs). */
static struct tdm_batch batch_of(struct tdm_engine_exec *x, const struct tdm_sched_plan *p,
                                 struct tdm_engine_out *out)
{
    for (int i = 0; i < p->n_seqs; i++) {
        const struct tdm_plan_seq *q = &p->seqs[i];
        x->bseqs[i] = (struct tdm_batch_seq){.tokens = q->tokens,
                                             .n_tokens = q->n_tokens,
                                             .pos0 = q->pos0,
                                             .pages = q->pages,
                                             .n_pages = q->n_pages,
                                             .slots = q->slots,
                                             .n_logits = q->n_rows,
                                             .features = q->features,
                                             .tree = q->tree};
    }
    *out = (struct tdm_engine_out){
        .want = p->want, .samples = p->samples, .logits = p->logits, .hidden = p->hidden};
    return (struct tdm_batch){.seqs = x->bseqs, .n_seqs = p->n_seqs};
}

static tdm_status engine_run(void *ctx, struct tdm_sched_plan *p)
{
    struct tdm_engine_exec *x = ctx;
    struct tdm_engine_out out;
    struct tdm_batch b = batch_of(x, p, &out);
    return tdm_engine_run(x->engine, &b, &out);
}

static tdm_status engine_launch(void *ctx, struct tdm_sched_plan *p)
{
    struct tdm_engine_exec *x = ctx;
    struct tdm_engine_out out;
    struct tdm_batch b = batch_of(x, p, &out);
    return tdm_engine_launch(x->engine, &b, &out);
}

static tdm_status engine_sample(void *ctx, struct tdm_sched_plan *p)
{
    (void)p; /* the engine kept the launched plan's rows */
    return tdm_engine_launch_sample(((struct tdm_engine_exec *)ctx)->engine);
}

static tdm_status engine_wait(void *ctx, struct tdm_sched_plan *p)
{
    (void)p; /* the engine keeps the launched plan's rows */
    return tdm_engine_wait(((struct tdm_engine_exec *)ctx)->engine);
}

static const struct tdm_sched_exec_i engine_exec_i = {
    .run = engine_run, .launch = engine_launch, .sample = engine_sample, .wait = engine_wait};

tdm_status tdm_sched_engine_exec_create(tdm_engine_t *e, int max_seqs, struct tdm_sched_exec *out,
                                        struct tdm_engine_exec **owned)
{
    const struct tdm_engine_opts *eo = tdm_engine_opts(e);
    const struct tdm_model *m = tdm_engine_model(e);
    int n = eo->max_seqs;
    if (max_seqs > 0 && max_seqs < n) n = max_seqs;
    struct tdm_engine_exec *x = calloc(1, sizeof *x);
    if (x) x->bseqs = calloc((size_t)n, sizeof *x->bseqs);
    if (!x || !x->bseqs) {
        free(x);
        return tdm_err_set(TDM_ENOMEM, "sched: out of memory");
    }
    x->engine = e;
    *out = (struct tdm_sched_exec){.iface = &engine_exec_i,
                                   .ctx = x,
                                   .kv = tdm_engine_kv(e),
                                   .vocab = m->cfg.vocab_size,
                                   .d_model = m->cfg.d_model,
                                   .feature_dim = eo->n_feature_layers * m->cfg.d_model,
                                   .max_ctx = eo->max_ctx,
                                   .max_batch_tokens = eo->max_batch_tokens,
                                   .max_seqs = n,
                                   .max_rows = eo->max_logit_rows,
                                   .eos = m->cfg.eos_ids,
                                   .n_eos = m->cfg.n_eos,
                                   .async = tdm_engine_launches_async(e)};
    *owned = x;
    return TDM_OK;
}

void tdm_sched_engine_exec_destroy(struct tdm_engine_exec *x)
{
    if (!x) return;
    free(x->bseqs);
    free(x);
}
