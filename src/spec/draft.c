/*
 * The draft-model drafter: a separate, smaller checkpoint with the target's vocabulary, run by
 * the chain machinery (chain.c) on an engine of its own.
 *
 * KV. The draft's layers are layer group 1 of the target's pool (the target engine was created
 * with the draft's geometry as an extra group), so a request's one page table covers both, and
 * the scheduler's page reservations, trims and releases serve the draft too. The draft's engine
 * borrows that pool (tdm_engine_opts.kv_shared) and the target's backend; it catches up on the
 * tokens it has not seen (tdm_draft_stats.cursor).
 *
 * Memory. On a backend with a memory plan (CUDA), the target engine holds back the draft's
 * weights and scratch (tdm_engine_opts.co_model) and the rejection drafts' distributions
 * (reserve_bytes) before it sizes the KV pool: tdm_spec_engine_opts sets both.
 *
 * Ownership: the chain drafter owns the draft engine; the draft model is the caller's.
 * Scheduler thread.
 */
#include "spec/spec_int.h"

#include <string.h>

void tdm_spec_kv_group(const struct tdm_model *draft, struct tdm_kv_group *out)
{
    *out = (struct tdm_kv_group){.n_layers = draft->cfg.n_layers,
                                 .n_kv_heads = draft->cfg.n_kv_heads,
                                 .head_dim = draft->cfg.head_dim,
                                 .latent_v_dim = draft->cfg.kv_lora_rank};
}

size_t tdm_spec_q_bytes(const struct tdm_engine_opts *target_opts, int vocab)
{
    int n = TDM_MIN(target_opts->max_seqs, target_opts->max_logit_rows);
    return (size_t)TDM_MAX(n, 0) * TDM_SPEC_MAX_K * (size_t)vocab * sizeof(float);
}

void tdm_spec_engine_opts(const struct tdm_spec_opts *o, const struct tdm_model *target,
                          struct tdm_kv_group *group, struct tdm_engine_opts *eo)
{
    if (o->method == TDM_SPEC_NONE) return;
    if ((o->method == TDM_SPEC_DRAFT || o->method == TDM_SPEC_MTP || o->method == TDM_SPEC_EAGLE) &&
        o->draft_model) {
        tdm_spec_kv_group(o->draft_model, group);
        eo->kv_extra = group;
        eo->n_kv_extra = 1;
        eo->co_model = o->draft_model;
        const struct tdm_head *h = o->draft_model->head;
        if (o->method != TDM_SPEC_DRAFT && h && h->n_aux > 0) { /* EAGLE-3's fused features */
            memcpy(eo->feature_layers, h->aux_layers, sizeof h->aux_layers);
            eo->n_feature_layers = h->n_aux;
        }
    }
    if (o->method == TDM_SPEC_EAGLE) { /* a verified tree's rows: the root and every node */
        const int rows = 1 + (o->tree_budget > 0 ? o->tree_budget : TDM_SPEC_TREE_BUDGET);
        struct tdm_engine_opts f = *eo;
        tdm_engine_fill_defaults(&target->cfg, &f);
        eo->max_logit_rows = TDM_MAX(f.max_logit_rows, rows);
    }
    if (o->accept == TDM_SPEC_ACCEPT_REJECTION && o->method != TDM_SPEC_EAGLE) {
        /* (a tree's rejection tests point masses: no distributions to keep) */
        struct tdm_engine_opts f = *eo;
        tdm_engine_fill_defaults(&target->cfg, &f);
        eo->reserve_bytes += tdm_spec_q_bytes(&f, target->cfg.vocab_size);
    }
}

void tdm_spec_beside_opts(tdm_engine_t *target, struct tdm_engine_opts *eo)
{
    const struct tdm_engine_opts *to = tdm_engine_opts(target);
    int n = TDM_MIN(to->max_seqs, to->max_logit_rows);
    *eo = (struct tdm_engine_opts){.n_threads = to->n_threads,
                                   .batch_invariant = to->batch_invariant,
                                   .exact_activations = to->exact_activations,
                                   .max_ctx = to->max_ctx,
                                   .max_batch_tokens = to->max_batch_tokens,
                                   .max_seqs = n,
                                   .max_logit_rows = n,
                                   .kv_shared = tdm_engine_kv(target),
                                   .kv_group = 1,
                                   .backend = tdm_engine_backend(target)};
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
    tdm_kv_pool_t *kv = tdm_engine_kv(target);
    struct tdm_kv_group want, have;
    tdm_spec_kv_group(draft, &want);
    if (!tdm_kv_pool_group(kv, 1, &have) || memcmp(&have, &want, sizeof have))
        return tdm_err_set(TDM_EINVAL, "spec draft: the target's KV pool has no layer group "
                                       "for this draft (create the target engine with "
                                       "tdm_spec_kv_group's group in kv_extra)");
    struct tdm_engine_opts eo;
    tdm_spec_beside_opts(target, &eo);
    tdm_engine_t *e = NULL;
    tdm_status st = tdm_engine_create(draft, &eo, &e);
    if (st != TDM_OK) return st;
    return tdm_spec_chain_create(e, true, 0, true, "draft", accept, one_hot, out);
}
