/*
 * tandem spec: speculative decoding (DESIGN.md §1.2). A drafter proposes up to k tokens per
 * decoding request; the target verifies every drafted span in the step's one forward pass
 * (n_logits = k + 1) and keeps the longest prefix that passes acceptance, plus one token of
 * its own. This module holds the drafters, the controller that chooses k, and the statistics;
 * verification, acceptance and the rewind of what was rejected are the scheduler's commit
 * (sched.h), shared by every drafter.
 *
 * Drafters.
 *   self   the target's first N layers, then its final norm and LM head (an early-exit pass,
 *          tdm_engine_out.n_layers). It writes those layers' KV into the request's own pages
 *          at the drafts' positions; the verify pass overwrites them with the target's, so
 *          for accepted tokens the KV is the target's own: one page table, nothing computed
 *          twice that is kept.
 *   draft  a separate checkpoint with the target's vocabulary (refused otherwise). Its KV is
 *          a layer group of the target's pool (same page ids, one page table per sequence).
 *          It catches up on the tokens it has not seen (the prompt, then each step's accepted
 *          tokens and bonus token), runs k steps, and its KV keeps what was accepted. On CUDA
 *          the target's memory plan holds back its weights and scratch
 *          (tdm_spec_engine_opts) before the KV pool is sized.
 *   mtp    a one-layer head fed with the target's hidden states (model.h, struct tdm_head;
 *          docs/HEADS.md), run as a chain (mtp.c): the scheduler hands it the target's
 *          features of the kept positions after each commit; its one layer is a layer group of
 *          the target's pool, like a draft model's.
 *   eagle  the same head's proposals as EAGLE-2 dynamic token trees (eagle.c): top-k expansion
 *          by cumulative draft probability, then the best `budget` nodes, verified in the
 *          step's one pass with attention masked over the tree's tokens only (engine.h).
 *
 * Acceptance.
 *   exact  a draft is kept when it equals the target's own draw at its position, drawn with
 *          the counter-based RNG keyed on (seed, request, position): the output is
 *          bit-identical to decoding without speculation, at every temperature and setting.
 *          Drafters draw with the same keyed uniform (a coupled draw: inverse-CDF sampling of
 *          their own distribution at the same u), so at T > 0 a draft that is close to the
 *          target is often kept.
 *   rejection  standard speculative sampling with the draft's full (truncated) distribution q,
 *          in fp32: a draft is kept with probability min(1, p/q), else the token is drawn
 *          from the normalised residual max(0, p - q). The draft draws its proposals, the
 *          verifier its acceptances and its residual draws from independent RNG streams
 *          (shared noise would bias the residual). The output has the target's distribution,
 *          not its exact tokens. For trees (eagle), multi-draft rejection: each node's
 *          children, in the drafter's order, are point-mass proposals (sample.h
 *          TDM_SAMPLE_TREE: the proof of losslessness is there); no q is kept.
 *
 * The controller (k = auto). Per request and step it chooses k from the request's observed
 * acceptance at each draft position (tdm_draft_stats, decayed, with the batch's acceptance as
 * a prior) and two cost models fitted online: the verify pass's time as a function of the
 * step's tokens, and one draft pass's time as a function of the drafting requests. A draft
 * position is taken when the tokens it is expected to add pay for what it costs at the
 * step's current throughput, deepest positions first cut; when the step with drafts is not
 * expected to beat the step without, nothing is drafted (k = 0, no pass run). A request that
 * has drafted nothing for a while probes with one draft so its estimate can recover.
 *
 * Ownership and threading. A tdm_spec_t borrows the target engine (and its model), which must
 * outlive it. Everything but tdm_spec_get_stats runs on the scheduler thread; the statistics
 * are read under a mutex from any thread.
 */
#ifndef TANDEM_SPEC_H
#define TANDEM_SPEC_H

#include "tandem/backend.h"
#include "tandem/core.h"
#include "tandem/engine.h"
#include "tandem/sched.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_spec tdm_spec_t;

enum tdm_spec_method {
    TDM_SPEC_NONE = 0,
    TDM_SPEC_DRAFT,
    TDM_SPEC_SELF,
    TDM_SPEC_MTP,
    TDM_SPEC_EAGLE,
};
enum tdm_spec_accept {
    TDM_SPEC_ACCEPT_EXACT = 0,
    TDM_SPEC_ACCEPT_REJECTION,
};
#define TDM_SPEC_AUTO_K 8 /* the cap of k = auto */

struct tdm_spec_opts {
    enum tdm_spec_method method;
    const char *draft_path; /* draft: the checkpoint; mtp/eagle: the head */
    int self_layers;        /* self: N, 1 .. n_layers - 1; 0: a quarter of the layers */
    int k;                  /* > 0: exactly this many drafts a step (fixed); 0: auto */
    enum tdm_spec_accept accept;
    bool q_one_hot; /* rejection with q = the proposal alone (vLLM's default; to measure) */
    /* draft: the loaded draft model (borrowed; outlives the tdm_spec_t). The target's engine
     * must have been created with its layer group (tdm_spec_kv_group) in kv_extra. */
    const struct tdm_model *draft_model;
    /* eagle: the trees (eagle.c). tree_budget: drafted tokens a tree keeps (1 ..
     * TDM_TREE_MAX_NODES; 0: TDM_SPEC_TREE_BUDGET); tree_topk: children per expanded node and
     * nodes expanded per depth (1 .. TDM_SAMPLE_MAX_CAND; 0: TDM_SPEC_TREE_TOPK); tree_depth:
     * the deepest drafts (1 .. TDM_SPEC_MAX_K; 0: TDM_SPEC_TREE_DEPTH), and with k fixed, at
     * most k. The head's own tree (topk * (depth - 1) nodes) must fit TDM_TREE_MAX_NODES. */
    int tree_budget, tree_topk, tree_depth;
    /* mtp: the seed's single-token MTP schedule. The head runs over every row the target just
     * verified, on a thread of its own, while the scheduler commits; the next step draws
     * draft 1 from the row its acceptance ended on, with no catch-up pass in between. The
     * drafts are those of the synchronous chain (src/spec/mtp.c). */
    bool overlap;
};
#define TDM_SPEC_TREE_BUDGET 16
#define TDM_SPEC_TREE_TOPK   8
#define TDM_SPEC_TREE_DEPTH  6
/* The KV layer group a draft model needs in the target's pool. */
void tdm_spec_kv_group(const struct tdm_model *draft, struct tdm_kv_group *out);
/* What speculation needs of the target engine's options, set before it is created: for a
 * draft model, its layer group (stored in *group, which must outlive the creation) and the
 * draft as co_model (its weights and scratch held back from the KV pool); for an EAGLE-3 head,
 * the target layers whose residual its features fuse (feature_layers); for rejection
 * acceptance, the drafts' distributions' bytes in reserve_bytes. */
void tdm_spec_engine_opts(const struct tdm_spec_opts *o, const struct tdm_model *target,
                          struct tdm_kv_group *group, struct tdm_engine_opts *eo);
/* The bytes of a rejection drafter's distributions for an engine with these (defaulted)
 * options: [min(max_seqs, max_logit_rows)][TDM_SPEC_MAX_K][vocab] floats. */
size_t tdm_spec_q_bytes(const struct tdm_engine_opts *target_opts, int vocab);

/* "none", "draft", "self", "mtp", "eagle"; TDM_EINVAL with a message otherwise. */
tdm_status tdm_spec_method_parse(const char *s, enum tdm_spec_method *out);
const char *tdm_spec_method_name(enum tdm_spec_method m);
/* "exact", "rejection". */
tdm_status tdm_spec_accept_parse(const char *s, enum tdm_spec_accept *out);
const char *tdm_spec_accept_name(enum tdm_spec_accept a);
/* "auto" -> 0; "0" .. TDM_SPEC_MAX_K -> that many (0 from "0" sets *off). */
tdm_status tdm_spec_k_parse(const char *s, int *k, bool *off);

/* A speculation set-up for a target engine. TDM_EUNSUPPORTED for methods this build lacks,
 * TDM_EINVAL for bad options (the message says why). method NONE is TDM_EINVAL: no object. */
tdm_status tdm_spec_create(tdm_engine_t *target, const struct tdm_spec_opts *o, tdm_spec_t **out);
void tdm_spec_destroy(tdm_spec_t *sp); /* NULL is a no-op */
/* Installs it as the scheduler's drafter (before tdm_sched_start). */
tdm_status tdm_spec_attach(tdm_spec_t *sp, tdm_sched_t *s);
/* What it is, in one line: "self (N layers of L), k auto (at most 8), exact". */
void tdm_spec_describe(const tdm_spec_t *sp, char *buf, size_t cap);

/* ---- a head's KV for a decoder elsewhere (speculation across disaggregation, disagg.h) ----
 * A prefill node whose decoders draft with an mtp head runs the same head over what it
 * prefilled: the head's row at p reads t(p+1) and the target's feature h(p), so of a prefill
 * of P tokens the rows [0, P - 1) can run here (row P - 1 needs the prompt's last token, which
 * the decoder keeps), writing the head's layer group of the target's pool (group 1, the same
 * page ids) exactly as the decoder's drafter would (the same engine, op for op: bit for bit on
 * a batch-invariant backend). The decoder then holds the head's KV of [0, P - 1) and the
 * feature h(P - 1) from the context, and drafts at its first step. */
typedef struct tdm_spec_head_kv tdm_spec_head_kv_t;
/* A span of head rows: rows [pos0, pos0 + n) of a request, each reading tokens[p + 1] and the
 * target's feature of p (features: [n][feature width] host: d_model, or an EAGLE-3 head's fused
 * feature_width, which the target engine gives when tdm_spec_engine_opts made it), writing the
 * head's KV at p through the request's page table. All borrowed for the call. */
struct tdm_spec_head_rows {
    const int32_t *tokens;
    int pos0, n;
    const float *features;
    const int32_t *pages;
    int n_pages;
};
/* The head's engine beside `target` (borrowed, as `head`, a tdm_head_load model; both outlive
 * it). The target's pool must have the head's layer group (tdm_spec_engine_opts). TDM_EINVAL
 * with a message naming both sides when the head does not fit. */
tdm_status tdm_spec_head_kv_create(tdm_engine_t *target, const struct tdm_model *head,
                                   tdm_spec_head_kv_t **out);
void tdm_spec_head_kv_destroy(tdm_spec_head_kv_t *h); /* NULL is a no-op */
/* Runs the head over n spans (rows of 0 are skipped), in as many passes as its limits need.
 * No logits. The caller's thread drives the target's backend meanwhile (the scheduler's). */
tdm_status tdm_spec_head_kv_run(tdm_spec_head_kv_t *h, const struct tdm_spec_head_rows *rows,
                                int n);
/* A 64-bit fingerprint of a head: its configuration and every weight it holds of its own
 * (input stage, layer, final norm; not the target's shared embeddings and LM head). Two nodes
 * that loaded the same head file get the same value; a different head, almost surely not. */
uint64_t tdm_spec_head_fingerprint(const struct tdm_model *head);

/* ---- statistics ---- */
#define TDM_SPEC_TAU_BUCKETS (TDM_SPEC_MAX_K + 1)
/* (with token trees, eagle: drafted_at and accepted_at count by depth; tree_steps counts the
 * steps that verified a tree and accepted_other_branch the kept drafts that were not their
 * parent's first child, a branch other than the drafter's best guess) */
struct tdm_spec_stats {
    uint64_t drafted;      /* tokens proposed */
    uint64_t accepted;     /* of them kept */
    uint64_t target_steps; /* decode steps of requests (one per request and step) */
    uint64_t tokens;       /* tokens those steps published */
    double tau;            /* tokens / target_steps (1 without speculation) */
    uint64_t drafted_at[TDM_SPEC_MAX_K], accepted_at[TDM_SPEC_MAX_K]; /* by draft position */
    uint64_t tau_hist[TDM_SPEC_TAU_BUCKETS]; /* steps that published 1, 2, ... tokens */
    uint64_t k_hist[TDM_SPEC_MAX_K + 1];     /* k chosen, per request and step */
    uint64_t draft_passes;                   /* draft forward passes run */
    double draft_s;                          /* time in them */
    /* the cost models: verify_ns(T) = verify_a_ns + verify_b_ns * T, draft pass likewise in
     * the number of drafting requests; 0 until measured */
    double verify_a_ns, verify_b_ns, draft_a_ns, draft_b_ns;
    uint64_t tree_steps, accepted_other_branch;
    /* --spec-overlap: rows the launched head passes ran, and first drafts drawn from them */
    uint64_t overlap_rows, overlap_drafts;
    /* a head while the gate was shut (--spec-k auto): requests whose head state was dropped
     * rather than run over its parked rows, and those rows (the head passes saved) */
    uint64_t head_dropped, head_rows_skipped;
};
void tdm_spec_get_stats(tdm_spec_t *sp, struct tdm_spec_stats *out);
/* One JSON object: drafted, accepted, target_steps, tokens, tau, accept_by_position (the
 * share of drafts kept at each position, up to the deepest drafted), and where they happened,
 * tree_steps and accepted_other_branch (trees), overlap_rows and overlap_drafts (overlap),
 * head_dropped and head_rows_skipped (a head the gate kept off). Returns
 * the length (snprintf's rule). */
int tdm_spec_stats_json(const struct tdm_spec_stats *st, char *buf, size_t cap);
/* The statistics as a Prometheus text block (malloc'd; NULL when out of memory): drafted and
 * accepted tokens, both by position, the tokens-per-step (tau) and k histograms, draft time
 * and the cost models. ctx: the tdm_spec_t. Any thread. */
char *tdm_spec_metrics(void *ctx);

/* ---- training heads (train.c: the math; train_data.c: the data; `tandem train-mtp`) ----
 * A head of tandem's layout (docs/HEADS.md) is trained on what the target computes on its own
 * continuations: its features and next-token distributions (self-distillation). The trainer
 * holds the head's parameters, their gradients and AdamW's state, and f32 copies of the
 * target's embeddings and LM head rows, which stay frozen. See train.c for the loss and the
 * unrolled passes. One thread drives a trainer; its ops fan out over a pool of its own. */
#define TDM_TRAIN_MAX_UNROLL 6  /* passes per row (draft depths trained) */
#define TDM_TRAIN_MAX_TOPK   64 /* target probabilities kept per position */
#define TDM_TRAIN_MAX_LEN    4096

typedef struct tdm_head_trainer tdm_head_trainer_t;

/* The head's shape: width, head size and vocabulary are the target's; the rest may differ. */
struct tdm_train_geom {
    int d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab;
    bool qkv_bias, qk_norm, rope_neox;
    float rms_eps;
};
/* The target's own layer shape. */
void tdm_train_geom_of(const struct tdm_model *target, struct tdm_train_geom *g);

struct tdm_train_opts {
    int unroll;            /* passes: 1 teacher forcing; j + 1 also trains depth j + 1 on the
                            * head's own features (train.c) */
    float unroll_decay;    /* pass j's weight: decay^j */
    float reg_weight;      /* the feature regression's weight beside the cross-entropy */
    float lr, min_lr_frac; /* peak learning rate; the cosine ends at lr * min_lr_frac */
    float weight_decay, beta1, beta2, adam_eps;
    float clip;          /* global gradient norm clip; <= 0: none */
    float feature_noise; /* uniform noise U(-f, f), times the row's RMS, added to the target's
                          * features a batch feeds pass 0 (EAGLE's augmentation); 0: none */
    int64_t warmup_steps, total_steps;
    uint64_t seed;                   /* the initial weights */
    int n_threads;                   /* <= 0: one per core */
    int max_rows, max_seqs, max_len; /* a batch's rows (sum of len - 1), sequences, length */
    tdm_cuda_gemm_t *gpu; /* non-NULL: the dense GEMMs run on this GPU (backend.h), the rest
                           * on the pool; borrowed, outlives the trainer */
};
void tdm_train_opts_default(struct tdm_train_opts *o);

/* One training sequence: len positions, each with its token, the target's feature there
 * ([len][d_model]) and the target's top-k next-token distribution there (ids [len][k],
 * descending probabilities [len][k]; an id < 0 pads). Borrowed for a call. */
struct tdm_train_seq {
    const int32_t *tokens;
    const float *feats;
    const int32_t *top_ids;
    const float *top_p;
    int len;
    int first; /* rows p < first are context (attended to, not scored): the prompt's */
};
struct tdm_train_pass_loss {
    int rows;       /* scored */
    double ce;      /* mean cross-entropy over rows whose target has mass in the draft vocab */
    double reg;     /* mean smooth-L1 of the feature regression */
    double top1;    /* share of those rows whose argmax is the target's most likely token */
    double covered; /* share of rows whose target has mass in the draft vocabulary */
};
struct tdm_train_loss {
    double loss; /* what is minimised: sum over passes of decay^j * (CE + reg_weight * reg) */
    double grad_norm, lr; /* of a step (before clipping) */
    int n_passes;
    struct tdm_train_pass_loss pass[TDM_TRAIN_MAX_UNROLL];
};

/* A trainer for a head of geometry g beside `target` (borrowed; must outlive it), with draft
 * vocabulary draft_vocab ([n_draft] ascending target ids; NULL: the whole vocabulary), its
 * weights initialised from o->seed. TDM_EINVAL with a message for what does not fit. */
tdm_status tdm_head_trainer_create(const struct tdm_model *target, const struct tdm_train_geom *g,
                                   const struct tdm_train_opts *o, const int32_t *draft_vocab,
                                   int n_draft, tdm_head_trainer_t **out);
void tdm_head_trainer_destroy(tdm_head_trainer_t *t); /* NULL is a no-op */
/* One optimiser step on a batch: the loss, its gradient, clipping, AdamW at the scheduled
 * learning rate. top_k: the batch's ids/probabilities per position. */
tdm_status tdm_head_trainer_step(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss);
/* The loss only (validation), and the loss with its gradient left in the trainer (tests). */
tdm_status tdm_head_trainer_eval(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss);
tdm_status tdm_head_trainer_grad(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss);
/* The learning rate of a step: linear warm-up, then cosine decay to lr * min_lr_frac. */
double tdm_head_trainer_lr(const tdm_head_trainer_t *t, int64_t step);
/* The parameters' tensors (at most TDM_TRAIN_MAX_TENSORS), pointing into the trainer. fc.weight
 * comes as two tensors, fc_half 1 (the embedding's columns) and 2 (the feature's). */
#define TDM_TRAIN_MAX_TENSORS 19
struct tdm_train_tensor {
    const char *name;
    float *data;
    const float *grad;
    int64_t rows, cols;
    int fc_half;
};
int tdm_head_trainer_tensors(const tdm_head_trainer_t *t, struct tdm_train_tensor *out);
/* The state a checkpoint holds: the parameters, AdamW's moments and the step count. */
float *tdm_head_trainer_params(tdm_head_trainer_t *t, size_t *n);
const float *tdm_head_trainer_grads(const tdm_head_trainer_t *t);
float *tdm_head_trainer_moments(tdm_head_trainer_t *t, float **v);
int64_t tdm_head_trainer_steps(const tdm_head_trainer_t *t);
void tdm_head_trainer_set_steps(tdm_head_trainer_t *t, int64_t step);
/* Moves the end of the cosine schedule (a run that must end by a deadline re-plans it once it
 * knows its step time); steps already taken keep their rates. */
void tdm_head_trainer_set_total_steps(tdm_head_trainer_t *t, int64_t total);
const int32_t *tdm_head_trainer_draft_vocab(const tdm_head_trainer_t *t, int *n);
/* Writes the head in tandem's layout (docs/HEADS.md): dtype "F32", "BF16" or "F16"; with a
 * reduced draft vocabulary, its d2t map. meta: n_meta key/value pairs for "__metadata__". */
tdm_status tdm_head_trainer_save(const tdm_head_trainer_t *t, const char *path, const char *dtype,
                                 const char *const *meta, int n_meta);
/* A checkpoint: the state above, with meta pairs (the run's options) that a resume compares. */
tdm_status tdm_head_trainer_save_checkpoint(tdm_head_trainer_t *t, const char *path,
                                            const char *const *meta, int n_meta);
/* Restores a checkpoint written for a trainer of the same shape; `check` (n_check pairs) must
 * equal the checkpoint's metadata values of those keys, else TDM_EINVAL naming the first. */
tdm_status tdm_head_trainer_load_checkpoint(tdm_head_trainer_t *t, const char *path,
                                            const char *const *check, int n_check);

/* ---- the trainer's data (train_data.c): the target on its own continuations ---- */
typedef struct tdm_train_data tdm_train_data_t;
struct tdm_train_gen_opts {
    int max_new_tokens;        /* per continuation (it may stop earlier, at EOS) */
    int batch;                 /* requests in flight */
    int top_k;                 /* target probabilities kept per position */
    const float *temperatures; /* each prompt is continued once per temperature; */
    int n_temperatures;        /* none: greedy */
    uint64_t seed;             /* continuation i samples with seed + i */
    uint64_t fingerprint;      /* stored in the data: what made it (the caller's hash) */
    int n_threads;             /* the teacher pass's host threads; <= 0: one per core */
    /* called as it goes: phase "generate" or "teacher", the share done, positions so far */
    void (*progress)(void *ctx, const char *phase, double fraction, int64_t positions);
    void *progress_ctx;
};
/* Continues each prompt (token ids; the chat template already applied) with the target's
 * engine through a scheduler of its own, records the target's feature of every position and
 * then its top-k next-token distribution (train_data.c). The engine's KV pool must hold
 * `batch` whole sequences. On success the caller owns *out. */
tdm_status tdm_train_data_generate(tdm_engine_t *target, const tdm_tok_t *tok,
                                   int32_t *const *prompts, const int *n_prompt, int n,
                                   const struct tdm_train_gen_opts *o, tdm_train_data_t **out);
/* The cache file: written through a temporary file and a rename; read back memory-mapped,
 * every byte checked (tdm_train_data_parse: from a 64-byte aligned buffer, which *out points
 * into and which must outlive it). A fingerprint, width or vocabulary other than the caller's
 * is refused with a message. */
tdm_status tdm_train_data_save(const tdm_train_data_t *d, const char *path);
tdm_status tdm_train_data_load(const char *path, uint64_t fingerprint, int d_model, int vocab,
                               tdm_train_data_t **out);
tdm_status tdm_train_data_parse(const void *buf, size_t size, uint64_t fingerprint, int d_model,
                                int vocab, tdm_train_data_t **out);
void tdm_train_data_free(tdm_train_data_t *d); /* NULL is a no-op */
int tdm_train_data_n_seqs(const tdm_train_data_t *d);
int64_t tdm_train_data_positions(const tdm_train_data_t *d);
int tdm_train_data_top_k(const tdm_train_data_t *d);
int tdm_train_data_prompt(const tdm_train_data_t *d, int i); /* sequence i's prompt index */
/* Sequence i, scored from the row that predicts its first output token. */
void tdm_train_data_seq(const tdm_train_data_t *d, int i, struct tdm_train_seq *out);
/* The n tokens that carry the most of the target's probability at scored positions, as
 * ascending ids; *coverage: the share of that probability they carry. */
tdm_status tdm_train_data_draft_vocab(const tdm_train_data_t *d, int n, int32_t *ids,
                                      double *coverage);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_SPEC_H */
