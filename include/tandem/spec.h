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
 *   eagle  the same head's proposals as dynamic trees (not in this build yet).
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
 *          not its exact tokens.
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
};
/* The KV layer group a draft model needs in the target's pool. */
void tdm_spec_kv_group(const struct tdm_model *draft, struct tdm_kv_group *out);
/* What speculation needs of the target engine's options, set before it is created: for a
 * draft model, its layer group (stored in *group, which must outlive the creation) and the
 * draft as co_model (its weights and scratch held back from the KV pool); for rejection
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

/* ---- statistics ---- */
#define TDM_SPEC_TAU_BUCKETS (TDM_SPEC_MAX_K + 1)
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
};
void tdm_spec_get_stats(tdm_spec_t *sp, struct tdm_spec_stats *out);
/* One JSON object: drafted, accepted, target_steps, tokens, tau, accept_by_position (the
 * share of drafts kept at each position, up to the deepest drafted). Returns the length
 * (snprintf's rule). */
int tdm_spec_stats_json(const struct tdm_spec_stats *st, char *buf, size_t cap);
/* The statistics as a Prometheus text block (malloc'd; NULL when out of memory): drafted and
 * accepted tokens, both by position, the tokens-per-step (tau) and k histograms, draft time
 * and the cost models. ctx: the tdm_spec_t. Any thread. */
char *tdm_spec_metrics(void *ctx);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_SPEC_H */
