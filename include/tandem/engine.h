/*
 * tandem engine: the forward pass of a decoder-only transformer over a backend, for batches of
 * (sequence, token span) pairs reading and writing the paged KV cache.
 *
 * The batch interface (contract; the scheduler, chunked prefill, speculation and the
 * disaggregated prefill node all call it):
 *   - a batch is a list of sequences; each contributes a span of consecutive tokens starting at
 *     absolute position pos0, and a page table covering positions [0, pos0 + n_tokens);
 *   - KV for positions [0, pos0) must already be in those pages; the span's KV is appended;
 *   - a sequence asks for logits (and hidden states) of its last n_logits tokens: 1 for a
 *     prefill chunk that ends the prompt or a decode step, 0 for a middle prefill chunk, up to
 *     n_tokens for speculative verification.
 * Prefill chunks and decode steps of different sequences mix freely in one batch.
 *
 * Ownership: the engine borrows the model (which must outlive it) and owns its backend (unless
 * one is passed in), its KV pool and all scratch, reserved at creation for the worst case
 * (max_batch_tokens, max_logit_rows): the forward pass does not allocate.
 *
 * Threading: one thread drives an engine (forward calls are not concurrent). The KV pool may be
 * used from other threads (it locks). The layer counter is written by the compute thread and
 * read by anyone (tdm_engine_layer_counter).
 */
#ifndef TANDEM_ENGINE_H
#define TANDEM_ENGINE_H

#include <stdatomic.h>

#include "tandem/backend.h"
#include "tandem/core.h"
#include "tandem/kv.h"
#include "tandem/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_engine tdm_engine_t;

/* The KV pool's element type (tdm_engine_opts.kv_dtype). AUTO: bf16 on CUDA, f32 on the CPU
 * (which keeps the CPU's fidelity to the fp32 reference). */
enum tdm_kv_dtype { TDM_KV_DTYPE_AUTO = 0, TDM_KV_DTYPE_F32, TDM_KV_DTYPE_BF16, TDM_KV_DTYPE_F16 };
/* "auto", "f32", "bf16", "f16" to the enum; false for anything else. */
bool tdm_kv_dtype_parse(const char *s, enum tdm_kv_dtype *out);

struct tdm_engine_opts {
    int n_threads;        /* CPU threads; <= 0: one per core */
    bool batch_invariant; /* see backend.h */
    /* CPU: Q8_0/Q4_0/Q4_1 matrices take fp32 activations (within 1e-4 of an fp32 reference)
     * instead of the default quantised ones (tdm_backend_cpu_opts.quant_activations) */
    bool exact_activations;
    int page_size;        /* tokens per KV page; 0: 16 */
    int64_t kv_pages;     /* 0: from kv_bytes */
    size_t kv_bytes;      /* 0 (with kv_pages 0): room for max_seqs full contexts, capped */
    int max_ctx;          /* 0: the model's context length */
    int max_batch_tokens; /* tokens per forward call; 0: 512 */
    int max_logit_rows;   /* logit rows per forward call; 0: max(max_seqs, 64) */
    int max_seqs;         /* sequences per forward call; 0: 64 */
    int kv_dtype;         /* enum tdm_kv_dtype; a borrowed pool (kv_shared) keeps its own */
    /* The forward pass stores layer+1 in the engine's layer counter after each layer's
     * attention output projection (DESIGN.md §1.1), and 0 when a forward call begins. Off by
     * default: on a GPU each store is one more kernel per layer. */
    bool count_layers;
    /* Speculation with a draft model. The target's engine: extra KV layer groups for its pool
     * (the draft's layers; same page ids, one page table per sequence). The draft's engine:
     * kv_shared, the pool it uses instead of creating one (its layers are group kv_group; the
     * page size and page count are the pool's), usually with the target's backend. */
    const struct tdm_kv_group *kv_extra;
    int n_kv_extra;
    tdm_kv_pool_t *kv_shared;
    int kv_group;
    /* Speculation beside this engine on its backend: co_model (a draft model that will run on
     * this backend: its weights as the backend stores them, and an engine's scratch for it
     * with these limits) and reserve_bytes more (the drafts' distributions) are held back from
     * the KV pool when the backend's memory plan sizes it, and the backend's workspace covers
     * co_model's shapes too. tdm_spec_engine_opts fills both. */
    const struct tdm_model *co_model;
    size_t reserve_bytes;
    tdm_backend_t *backend;     /* NULL: the engine creates one of backend_kind and owns it */
    int backend_kind;           /* enum tdm_backend_kind: TDM_BACKEND_CPU (0) or TDM_BACKEND_CUDA */
    double gpu_memory_fraction; /* CUDA: share of device memory for weights, workspace and the
                                 * KV pool, which gets what is left (when kv_pages and kv_bytes
                                 * are 0); <= 0: 0.9 */
    bool gpu_bf16_weights;      /* CUDA: dequantise GGUF blocks to bf16 (tdm_backend_cuda_opts) */
    bool gpu_no_graphs;         /* CUDA: decode steps op by op, never as graphs */
    /* Tensor parallelism inside this process (tp.h, DESIGN.md §5); 0 or 1: none. N > 1: N
     * ranks, each with its shard of the weights (KV heads with their query heads, MLP columns),
     * its KV heads' pool and a backend of backend_kind: on the CPU, n_threads / N threads (at
     * least 1); on CUDA, GPU r modulo the GPUs present, joined by NCCL when every rank has a
     * GPU, else by the peer all-reduce without graphs (backend.h, tdm_cuda_tp_plan). The caller's
     * thread is rank 0, the leader: it alone samples and returns outputs; ranks 1 .. N-1 are
     * threads of the engine. The plan's step is built once, by the leader, and handed to every
     * rank; partial output projections are summed after attention and after the MLP
     * (tdm_tp_allreduce); the LM head is split by vocabulary, each rank writing its rows of the
     * leader's logits. tdm_engine_kv is the leader's pool: it allocates
     * page ids for every rank's pool (one page table, one page count: the one TP = 1 would
     * have; on CUDA without kv_pages or kv_bytes, the smallest of the ranks' memory plans).
     * Dense attention models only (TDM_EUNSUPPORTED names the rest).
     * A speculation head's extra KV group (co_model a head, kv_extra its one group) is sharded
     * over the ranks' pools like the head (its KV heads); a draft model's stays whole in the
     * leader's pool (the draft runs on the leader alone). */
    int tp;
    /* A speculation head's engine beside a sharded target (tp > 1; NULL or an unsharded
     * target: ignored): the head is sharded like it, each rank's view of the head on that
     * target rank's backend and pool (layer group kv_group, which the target made from its
     * co_model), run by the target's rank threads. kv_shared and backend are then the
     * leader's (tdm_spec_beside_opts); the target must outlive the head's engine. */
    tdm_engine_t *shard_like;
    /* Features for an EAGLE-3 head (model.h): n_feature_layers > 0 makes a sequence's features
     * (tdm_batch_seq.features) the residual stream entering each of these layers (0 ..
     * n_layers - 1), concatenated in this order ([n_tokens][n_feature_layers * d_model]),
     * instead of the final-normed state; copied in the layer loop. tdm_spec_engine_opts sets
     * them from the head. 0: the final-normed state (every other head). */
    int feature_layers[TDM_HEAD_MAX_AUX];
    int n_feature_layers;
};

struct tdm_batch_seq {
    const int32_t *tokens; /* [n_tokens] */
    int n_tokens;
    int pos0;             /* absolute position of tokens[0] */
    const int32_t *pages; /* page table: page j holds positions [j*page_size, (j+1)*page_size) */
    int n_pages;
    /* [n_tokens] the KV slot (page_id * page_size + offset) each token's K and V are written
     * to; NULL: the slot of its position in the page table. The plan gives them explicitly so
     * that tree verification can give siblings at one depth slots of their own. */
    const int32_t *slots;
    int n_logits; /* output rows for the last n_logits tokens of the span */
    /* A head model (tdm_model.head) only: [n_tokens][feature_width] host, the target's
     * feature that goes with each token (see struct tdm_head); or, with own_hidden,
     * [n_tokens][d_model], the head's own feature of the row before (a deeper draft). Heads
     * whose target feature is their own width (all but EAGLE-3) read both alike; an EAGLE-3
     * head's batch is all of one kind (TDM_EINVAL otherwise). Required there, ignored
     * elsewhere. */
    const float *hidden;
    bool own_hidden;
    /* NULL, or host memory that receives every token's feature: [n_tokens][d_model], the
     * final-normed hidden state (the LM head's input; what a head takes as h); an engine with
     * feature_layers: [n_tokens][n_feature_layers * d_model] (tdm_engine_opts); an EAGLE-3
     * head's engine: its state before the final norm (what it feeds itself). */
    float *features;
    /* NULL: the span is a chain (token i at position pos0 + i, causal). Otherwise a token tree
     * (below); slots are then required. */
    const struct tdm_batch_tree *tree;
};

/* A span that is a token tree (speculation: EAGLE-2's verification and its drafting, spec.h).
 * The span may open with c chain tokens (mask 0, positions pos0 .. pos0 + c - 1, causal: a
 * verified tree's root, the last committed token); every later token is a tree token: it sits
 * at positions[i], writes its KV at slots[i], and attends to KV positions [0, pos0 + c)
 * through the page table, then to the tree's nodes its mask names, one per position from
 * pos0 + c up to its own (backend.h, the attention contract): its ancestors and itself. Nodes
 * are the tree's tokens with KV, this span's and earlier passes' (a drafter adds a depth per
 * pass); node j's KV is at node_slots[j], and a token's own node is the highest bit of its
 * mask. The engine checks all of this (TDM_EINVAL) before any KV is written. */
struct tdm_batch_tree {
    const int32_t *positions;  /* [n_tokens] absolute positions */
    const uint64_t *mask;      /* [n_tokens] bit j: node j is visible; 0: a chain token */
    const int32_t *node_slots; /* [n_nodes] KV slots (page_id * page_size + offset) */
    int n_nodes;               /* 1 .. TDM_TREE_MAX_NODES */
};

struct tdm_batch {
    const struct tdm_batch_seq *seqs;
    int n_seqs;
};

tdm_status tdm_engine_create(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                             tdm_engine_t **out);
void tdm_engine_destroy(tdm_engine_t *e);

/* What each output row of a forward call produces (tdm_engine_run). */
enum tdm_row_want {
    TDM_ROW_SAMPLE = 1 << 0, /* a token, sampled with the row's tdm_sample_row */
    TDM_ROW_LOGITS = 1 << 1, /* its logits [vocab] in host memory, as the LM head gave them */
    TDM_ROW_HIDDEN = 1 << 2, /* its hidden state [d_model]: the residual after the last layer */
};
/* Output rows are the batch's n_logits rows in batch order. Each buffer is indexed by row and
 * only the rows that want it are written; a buffer no row wants may be NULL. */
struct tdm_engine_out {
    const uint8_t *want;            /* [n_rows] tdm_row_want bits; NULL: every row gets what
                                     * the non-NULL buffers below hold room for */
    struct tdm_sample_row *samples; /* [n_rows]: parameters in, token and logprobs out */
    float *logits;                  /* [n_rows][vocab], host */
    float *hidden;                  /* [n_rows][d_model], host */
    /* Early exit: run only the first n_layers layers, then the final norm and the LM head (a
     * self-drafting pass). 0: every layer. KV is written for those layers only. */
    int n_layers;
};
/* Runs one forward pass. Logits are downloaded only for LOGITS rows, so a step whose rows only
 * sample moves tokens, not [rows][vocab] floats; SAMPLE rows are sampled on the device where
 * the backend can (tdm_engine_samples_on_device), else on the host. Invalid batches (a token
 * outside the vocabulary, a page table too short, a slot outside the pool, limits exceeded)
 * return TDM_EINVAL / TDM_ERANGE before any KV is written. */
tdm_status tdm_engine_run(tdm_engine_t *e, const struct tdm_batch *batch,
                          const struct tdm_engine_out *out);

/* A token not known yet when a step is launched: the token that row j of the step launched
 * before it samples (tdm_engine_launch). */
#define TDM_TOKEN_PREV(j) (-1 - (int32_t)(j))

/* tdm_engine_run in three parts, so that the caller can prepare the next step while this one
 * runs (the scheduler's overlap, sched.h). tdm_engine_launch checks and queues the forward
 * pass and returns; tdm_engine_launch_sample queues its sampling, reading the rows' parameters
 * (out->samples: a grammar's mask, the sampler's penalty state) only then, so the caller may
 * change them in between (once the step before is committed); tdm_engine_wait returns the
 * status once out->samples hold the results. Where the backend cannot queue the sampling (no
 * sample_launch, rows that want logits or hidden states, features, a sharded engine or a head)
 * tdm_engine_launch_sample samples and waits for the step. Each launched step is
 * sampled before the next launch; steps are waited in launch order, at most two outstanding,
 * and tdm_engine_run needs none. The batch's arrays are read at the launch; out's buffers (and
 * want) must stay until the wait. A wait of a step never sampled samples it first.
 *
 * A launched step's tokens may be TDM_TOKEN_PREV(j), j below the row count of the step
 * sampled just before it, whose every row sampled: the token its row j chooses, taken where
 * it was sampled (on the device, or from the host copy the engine kept), so the caller need
 * not wait for it. Any other negative token is refused as tdm_engine_run refuses it. */
tdm_status tdm_engine_launch(tdm_engine_t *e, const struct tdm_batch *batch,
                             const struct tdm_engine_out *out);
tdm_status tdm_engine_launch_sample(tdm_engine_t *e);
tdm_status tdm_engine_wait(tdm_engine_t *e);
/* Whether tdm_engine_launch and _launch_sample really return before the work ends (a backend
 * that samples on the device with sample_launch, an unsharded engine). */
bool tdm_engine_launches_async(const tdm_engine_t *e);

/* Runs one forward pass. logits: [sum n_logits][vocab] host memory, rows in batch order (NULL
 * if no sequence asks for logits). hidden (may be NULL): [sum n_logits][d_model], the residual
 * stream after the last layer (before the final norm). Invalid batches (a token outside the
 * vocabulary, a page table too short, limits exceeded) return TDM_EINVAL / TDM_ERANGE before
 * any KV is written. */
tdm_status tdm_engine_forward(tdm_engine_t *e, const struct tdm_batch *batch, float *logits,
                              float *hidden);

/* Whether the backend samples on the device (a `sample` hook that takes this vocabulary). */
bool tdm_engine_samples_on_device(const tdm_engine_t *e);
/* tdm_engine_forward, but each logit row is sampled and only tokens and log-probabilities come
 * back: rows[i] describes logit row i (batch order) and receives its results. With device
 * sampling the rows are sampled where the logits are; otherwise on the host
 * (tdm_sample_row_host), from the engine's own buffer (CPU) or a host copy of it. */
tdm_status tdm_engine_forward_sample(tdm_engine_t *e, const struct tdm_batch *batch,
                                     struct tdm_sample_row *rows, float *hidden);

const struct tdm_model *tdm_engine_model(const tdm_engine_t *e);
tdm_kv_pool_t *tdm_engine_kv(tdm_engine_t *e);
/* Tensor parallelism: the ranks of a sharded engine (1 for one that is not), and rank r's KV
 * pool (r 0: tdm_engine_kv), holding its KV heads (tdm_tp_kv_shard_of over the model's KV
 * heads) at the leader's page ids; owned by the engine. Sharded KV transfers (disagg.h)
 * register every rank's pool. NULL for a rank out of range. */
int tdm_engine_tp_ranks(const tdm_engine_t *e);
tdm_kv_pool_t *tdm_engine_rank_kv(tdm_engine_t *e, int rank);
const struct tdm_engine_opts *tdm_engine_opts(const tdm_engine_t *e); /* with defaults filled */
/* Fills o's zero limits with the defaults tdm_engine_create would use for this model. */
void tdm_engine_fill_defaults(const struct tdm_model_config *cfg, struct tdm_engine_opts *o);
tdm_backend_t *tdm_engine_backend(tdm_engine_t *e);
/* The engine's layer counter (count_layers), readable from any thread while a forward call
 * runs; NULL when the engine was created without count_layers. The engine owns it: on the
 * CUDA backend it is the backend's mapped pinned counter, so it also moves inside graphs. */
_Atomic int32_t *tdm_engine_layer_counter(tdm_engine_t *e);
/* Mixture of experts: token-expert assignments each expert has run since creation, summed
 * over the sparse layers (imbalance shows as uneven counts). Writes min(n_experts, cap) counts
 * and returns the model's expert count (0 for a dense model). Any thread. */
int tdm_engine_expert_tokens(const tdm_engine_t *e, uint64_t *out, int cap);
/* Expert FFN passes run since creation (an active expert of a sparse layer in a step: one pass
 * over its weights), for rooflines of the bytes a step really reads. Any thread. */
uint64_t tdm_engine_expert_passes(const tdm_engine_t *e);

/* The RoPE inverse frequencies [head_dim/2] for a config (base theta, linear or llama3 scaling,
 * or per-dimension factors from a GGUF rope_freqs tensor when not NULL). */
void tdm_rope_inv_freq(const struct tdm_model_config *cfg, const float *rope_freqs, float *out);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_ENGINE_H */
