/*
 * tandem backend: the compute interface the engine drives, one op at a time.
 *
 * The engine owns the architecture (the order of ops for llama / qwen2 / qwen3); a backend owns
 * how each op runs. Ops are fused where that saves a pass over memory (residual add + RMSNorm,
 * RoPE + KV append). Every op reads and writes backend memory: host memory for the CPU
 * backend, device memory for CUDA. Activations are fp32, row-major [n_tokens][dim].
 *
 * Determinism (contract): for every op, the value computed for one token row depends only on
 * that row's inputs (and, for attention, its own sequence's KV), never on how many other rows
 * or sequences share the call. Reductions run in a fixed order per row. This is what makes a
 * greedy request produce the same tokens alone or in a batch of 64. One exception: an F32
 * weight multiplied by more than one row goes to OpenBLAS sgemm, whose blocking depends on the
 * row count; `batch_invariant` in tdm_backend_cpu_opts sends those to our own kernel instead.
 *
 * Threading: a backend instance is driven by one thread (the engine's compute thread). The CPU
 * backend fans each op out over its own thread pool.
 */
#ifndef TANDEM_BACKEND_H
#define TANDEM_BACKEND_H

#include <stdatomic.h>

#include "tandem/core.h"
#include "tandem/model.h"
#include "tandem/sample.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_backend tdm_backend_t;

/* One step's batch, flattened to tokens. Built by the engine; all arrays in host memory. */
struct tdm_step {
    int n_tokens;
    int n_seqs;
    const int32_t *tokens;          /* [n_tokens] */
    const int32_t *positions;       /* [n_tokens] absolute position of each token */
    const int32_t *slots;           /* [n_tokens] KV slot: page_id * page_size + offset */
    const int32_t *token_seq;       /* [n_tokens] index of the token's sequence */
    const int32_t *seq_token_start; /* [n_seqs + 1] the tokens of seq s: [start[s], start[s+1]) */
    const int32_t *seq_kv_len;      /* [n_seqs] KV positions valid after this step's append */
    const int32_t *seq_page_start;  /* [n_seqs + 1] offsets into page_ids */
    const int32_t *page_ids;        /* concatenated page tables: seq s, logical page j */
    int page_size;
    int n_layers; /* layers this step runs (fewer than the model's: an early-exit draft pass) */
    /* > 0: tokens may hold TDM_TOKEN_PREV(j) (engine.h), j < n_prev_rows, the token the last
     * sampling (sample or sample_launch) chose for its row j, which the backend reads where
     * that sampling left it. Only a backend with sample_launch gets such a step. */
    int n_prev_rows;
    /* Token trees (engine.h, struct tdm_batch_tree); all NULL in a step without one. A
     * sequence s is a tree when tree_node_start[s] < tree_node_start[s + 1]: its nodes' KV
     * slots are tree_slots[tree_node_start[s] ..] (at most TDM_TREE_MAX_NODES), and its tree
     * tokens (tree_mask[t] != 0) see KV positions [0, seq_prefix[s]) through the page table,
     * then the nodes their mask names (below). tree_mask[t] is 0 for every other token. */
    const uint64_t *tree_mask;      /* [n_tokens] bit j: node j of the token's tree is visible */
    const int32_t *seq_prefix;      /* [n_seqs] */
    const int32_t *tree_node_start; /* [n_seqs + 1] offsets into tree_slots */
    const int32_t *tree_slots;      /* the trees' nodes' KV slots, by sequence */
};

/* Attention (contract). A token at position p attends to KV positions [0, p] of its own
 * sequence (causal), read through the page table. A tree token at position p (tree_mask[t] !=
 * 0, prefix P = seq_prefix[s]) attends to positions [0, P) through the page table, then to the
 * positions P .. p held by the nodes of its mask: the i-th set bit (from the lowest) is the
 * node at position P + i, read from its slot (the engine checks that there are p - P + 1 of
 * them and that the highest is the token's own). So a tree token sees exactly what a chain
 * token at p sees, with its ancestors' KV in place of earlier positions' (a token tree's
 * path). Backends run the prefix part as the causal kernel does: the mask never reaches it,
 * and a tree costs what a chain of as many tokens costs. */

/* Bytes of one KV element of type t: 4 (f32), 2 (bf16, f16), and 0 for a type no KV cache
 * takes: the one statement of which types those are. */
static inline size_t tdm_kv_elem_bytes(enum tdm_dtype t)
{
    return t == TDM_DTYPE_F32 ? 4 : t == TDM_DTYPE_BF16 || t == TDM_DTYPE_F16 ? 2 : 0;
}

/* One layer of the paged KV pool (kv.h), HND: [n_pages][2][n_kv_heads][page_size][head_dim]
 * elements of dtype (f32, bf16 or f16), K then V. Ops compute in fp32: rope_kv_append rounds
 * to dtype as it stores (round to nearest even), attention and kv_copy read dtype. */
struct tdm_kv_layer {
    void *base;
    enum tdm_dtype dtype;
    int n_kv_heads;
    int head_dim;
    int page_size;
    int64_t n_pages;
    /* 0: pages hold K then V. > 0: a latent layer (MLA, kv.h): pages hold K rows only,
     * [n_pages][n_kv_heads][page_size][head_dim], and the values are each K row's first v_dim
     * elements (attention's output is then v_dim wide per query head). */
    int v_dim;
};

struct tdm_rope {
    int head_dim;
    bool neox;             /* see tdm_model_config.rope_neox */
    const float *inv_freq; /* [rot_dim / 2], scaling already applied; host memory */
    /* the dimensions rotated: each row's last rot_dim (0: all head_dim of them); and a factor
     * on cos and sin (0 or 1: none) */
    int rot_dim;
    float mscale;
};

/* One product of matmul_multi: out = x W (+ bias). */
struct tdm_matmul_part {
    const struct tdm_weight *w;
    const float *bias; /* [w->rows] or NULL */
    float *out;        /* [n][w->rows] */
};
#define TDM_MATMUL_MULTI_MAX 4   /* parts per matmul_multi call */
#define TDM_MAX_HEAD_DIM     512 /* every backend supports head_dim up to this (even) value */
#define TDM_TREE_MAX_NODES   64  /* nodes of one token tree (a token's visible nodes: 64 bits) */

/* What the engine will ask of a backend at most (tdm_backend_i.reserve). */
struct tdm_backend_limits {
    int max_tokens; /* tokens per step */
    int max_seqs;   /* sequences per step */
    int max_rows;   /* logit rows per step */
    int max_pages;  /* page-table entries per step, all sequences together */
    int n_heads, n_kv_heads, head_dim, d_model, d_ff, vocab;
    /* bytes the memory plan leaves out of the KV pool for what comes later on this backend
     * (speculation's draft model and its buffers) */
    size_t reserve_bytes;
};

struct tdm_backend_i {
    const char *name;
    void (*destroy)(tdm_backend_t *b);
    /* memory that ops read and write */
    void *(*buf_alloc)(tdm_backend_t *b, size_t bytes); /* NULL on failure */
    void (*buf_free)(tdm_backend_t *b, void *p);
    /* Where buf_alloc's memory lives; NULL: host memory. */
    struct tdm_mem_place (*buf_place)(tdm_backend_t *b);
    void (*upload)(tdm_backend_t *b, void *dst, const void *src, size_t bytes);
    void (*download)(tdm_backend_t *b, void *dst, const void *src, size_t bytes);
    /* Makes a host weight usable by this backend (CPU: the same pointer; CUDA: converted and
     * uploaded). The backend owns what it creates and frees it in destroy. */
    tdm_status (*weight_prepare)(tdm_backend_t *b, const struct tdm_weight *host,
                                 struct tdm_weight *out);
    /* Optional: the bytes of backend memory weight_prepare will take for this weight (a
     * memory plan's input); NULL: none (the CPU uses host weights where they are). */
    size_t (*weight_bytes)(tdm_backend_t *b, const struct tdm_weight *host);

    /* out[i] = emb[tokens[i]] as fp32. out: [n][emb.cols] */
    void (*embed)(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                  float *out);
    /* out = x / rms(x) * w, per row. x, out: [n][dim]; w: [dim] */
    void (*rmsnorm)(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                    float *out);
    /* residual += x; out = rmsnorm(residual) * w. */
    void (*add_rmsnorm)(tdm_backend_t *b, float *residual, const float *x, const float *w,
                        float eps, int n, int dim, float *out);
    /* out[i][r] = sum_c x[i][c] * W[r][c] (+ bias[r]). x: [n][w.cols]; out: [n][w.rows];
     * bias: [w.rows] or NULL. */
    void (*matmul)(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                   const float *bias, float *out);
    /* Several matmuls of one input as one op (q, k, v): for each of the n_parts (1 to
     * TDM_MATMUL_MULTI_MAX) parts, part.out = x part.w (+ part.bias), every value bit-identical
     * to what matmul computes. All weights have x's width. */
    void (*matmul_multi)(tdm_backend_t *b, const float *x, int n,
                         const struct tdm_matmul_part *parts, int n_parts);
    /* The SwiGLU up-projection as one op: out = silu(x w_gate) * (x w_up), every value
     * bit-identical to matmul, matmul, silu_mul (for F32 weights: to those ops on a
     * batch_invariant instance). One exception, CUDA's prefill: where both products go to
     * cuBLASLt (not batch_invariant, n past its own kernels' batches) they leave it as bf16, so
     * out is silu_mul of the two rounded to bf16. w_gate and w_up: same shape, no bias; out:
     * [n][w_gate.rows], not aliasing x. */
    void (*matmul_swiglu)(tdm_backend_t *b, const struct tdm_weight *w_gate,
                          const struct tdm_weight *w_up, const float *x, int n, float *out);
    /* In place RMSNorm of each head_dim-long row. x: [n_rows][head_dim]; w: [head_dim] */
    void (*head_rmsnorm)(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                         int head_dim);
    /* Rotates q [n_tokens][n_heads][hd] in place, rotates k [n_tokens][n_kv_heads][hd] and
     * writes k and v [n_tokens][n_kv_heads][hd] into kv at each token's slot. The rotation
     * takes each row's last rope->rot_dim elements. A latent layer (kv->v_dim > 0, one KV
     * head): k [n_tokens][hd - rot_dim] is the latent, stored as it is, and v
     * [n_tokens][rot_dim] the rope key, rotated and stored after it in the row. */
    void (*rope_kv_append)(tdm_backend_t *b, float *q, const float *k, const float *v, int n_heads,
                           const struct tdm_step *st, const struct tdm_rope *rope,
                           const struct tdm_kv_layer *kv);
    /* Causal GQA attention over the paged KV. q: [n_tokens][n_heads][hd];
     * out: [n_tokens][n_heads][hd] (a latent layer's: [n_tokens][n_heads][kv->v_dim]). */
    void (*attention)(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                      const struct tdm_kv_layer *kv, float scale, float *out);
    /* out = silu(gate) * up. gate, up, out: [n][dim]; out may be gate. */
    void (*silu_mul)(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                     float *out);
    /* x += y, n elements */
    void (*add)(tdm_backend_t *b, float *x, const float *y, size_t n);
    /* out[i] = x[rows[i]], copying rows of dim floats */
    void (*gather_rows)(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                        float *out);
    /* Mixture of experts (NULL on a backend that does not run expert layers): x[0, n) = 0; and
     * out[rows[i]] += weights[i] * x[i] for i < n (x: [n][dim]; rows distinct; rows and
     * weights are host arrays). The engine adds a row's experts one call after another, in
     * expert order, so a row's sum never depends on the other rows. */
    void (*zero)(tdm_backend_t *b, float *x, size_t n);
    void (*rows_scale_add)(tdm_backend_t *b, const float *x, const int32_t *rows,
                           const float *weights, int n, int dim, float *out);
    /* Per-head products (MLA's absorbed projections; NULL on a backend that does not run
     * them): for row i < n and head j < n_heads, with R = w->rows / n_heads and C = w->cols,
     *   out[i * out_stride + j * out_hstride + r] = sum_c W[j * R + r][c] *
     *                                               x[i * x_stride + j * x_hstride + c]
     * for r < R (strides in floats; w: what weight_prepare made of an F32 host matrix: the
     * CPU's F32, CUDA's bf16). Each value depends on its own row only. */
    void (*head_matmul)(tdm_backend_t *b, const struct tdm_weight *w, int n_heads, const float *x,
                        int n, size_t x_stride, size_t x_hstride, float *out, size_t out_stride,
                        size_t out_hstride);
    /* out[i][cols[c]] = x[i][c] for c < n_cols, and -inf in every other column of out's
     * width-long rows: a reduced draft vocabulary's logits in the whole vocabulary's places.
     * x: [n][n_cols]; cols: [n_cols] distinct, < width, in backend memory; out: [n][width]. */
    void (*scatter_cols)(tdm_backend_t *b, const float *x, const int32_t *cols, int n, int n_cols,
                         int width, float *out);
    /* Copies the K and V rows of n slots (every KV head) in n_layers layers of one region:
     * layer l starts layer_bytes after layer l - 1 (at kv->base), and slot dst[i] gets what slot
     * src[i] holds, the pairs applied in order (a later pair may overwrite an earlier one's source,
     * or read what an earlier one wrote). src, dst: host arrays (a tree's accepted path moved
     * into its positions, kv.h). */
    void (*kv_copy)(tdm_backend_t *b, const struct tdm_kv_layer *kv, int n_layers,
                    size_t layer_bytes, const int32_t *src, const int32_t *dst, int n);
    /* Publishes "layer `layer` has finished its attention output projection" (DESIGN.md
     * §1.1): stores layer + 1 into *counter once the work before it has completed. */
    void (*layer_done)(tdm_backend_t *b, int layer, _Atomic int32_t *counter);
    /* Waits for all submitted work. */
    void (*sync)(tdm_backend_t *b);

    /* ---- optional hooks: NULL where a backend has nothing to do (the CPU backend sets none) */
    /* Called once by the engine after its weights and scratch exist: the backend reserves its
     * worst-case workspace for these limits (so the forward pass never allocates) and writes
     * the bytes it can give the KV pool (0: no opinion; the engine's default applies). */
    tdm_status (*reserve)(tdm_backend_t *b, const struct tdm_backend_limits *lim, size_t *kv_bytes);
    /* Called at the start of every forward pass, before any op, with the flattened step, the
     * logit rows and the engine's layer counter (may be NULL). `owner` names the engine (its
     * scratch buffers) so recorded work is never replayed for another one. The backend may
     * raise st->n_tokens (padding a decode step to a CUDA-graph bucket: the extra tokens write
     * no KV and only their own activation rows) and the engine then passes that count to the
     * ops. *replayed = true: the whole layer loop (embed to the last add_rmsnorm) has been
     * issued already (a recorded graph), and the engine goes on with the logits. */
    tdm_status (*step_begin)(tdm_backend_t *b, struct tdm_step *st, const int32_t *rows, int n_rows,
                             const void *owner, _Atomic int32_t *counter, bool *replayed);
    /* Called after the layer loop when step_begin did not replay it (ends a recording). */
    tdm_status (*step_end)(tdm_backend_t *b);
    /* Optional: `owner` (an engine that shares this backend) is gone: what was recorded for it
     * must never replay, since a new engine may get its address (its buffers are freed). */
    void (*step_forget)(tdm_backend_t *b, const void *owner);
    /* Samples n_rows logit rows where they are (logits: [n_rows][vocab] backend memory, which
     * may be overwritten) and fills each row's outputs: the same tokens tdm_sample_row_host
     * chooses for the same logits (the same RNG draw, the same candidate order), and the
     * same log-probabilities up to the order of a sum. Returns TDM_EUNSUPPORTED (with
     * nothing done) for a vocabulary it cannot take (n_rows 0: only that check). Waits for
     * its results. */
    tdm_status (*sample)(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                         struct tdm_sample_row *rows);
    /* Optional, beside `sample`: the same sampling queued behind the step's work, returning
     * before its results exist (a step launched while the one before it still runs: the
     * scheduler's overlap, sched.h). rows are read before it returns; their results reach
     * sample_wait's rows. It also ends the step: the arrays step_begin was given may change
     * once it returns. At most two launches are outstanding; each is waited once, in order.
     * The launched rows' tokens stay in backend memory until the next sampling, where a later
     * step's TDM_TOKEN_PREV tokens (tdm_step.n_prev_rows) take them. TDM_EUNSUPPORTED with
     * nothing done: the engine samples synchronously instead. */
    tdm_status (*sample_launch)(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                                const struct tdm_sample_row *rows, int *ticket);
    tdm_status (*sample_wait)(tdm_backend_t *b, int ticket, struct tdm_sample_row *rows,
                              int n_rows);
    /* Optional: tensor parallelism's all-reduce where the backend's memory is not the host's
     * (CUDA ranks joined by tdm_cuda_tp_create): x[0, n) summed over the ranks' calls, in
     * place, queued behind the backend's work; every rank gets the same bits. NULL: the engine
     * sums host memory itself (tdm_tp_allreduce). */
    void (*allreduce)(tdm_backend_t *b, float *x, size_t n);
};

struct tdm_backend {
    const struct tdm_backend_i *iface;
    void *impl;
};

struct tdm_backend_cpu_opts {
    int n_threads;        /* <= 0: one per online core */
    bool batch_invariant; /* never use OpenBLAS (see the determinism contract above) */
    /* Q8_0, Q4_0 and Q4_1 weights multiply activations quantised to 16-bit integers (two int8
     * planes a block of 32), with integer dot products (src/backend/cpu/qdot.c; still
     * batch-invariant); false: fp32 activations, within 1e-4 of an fp32 reference */
    bool quant_activations;
};
tdm_status tdm_backend_cpu_create(const struct tdm_backend_cpu_opts *opts, tdm_backend_t **out);
void tdm_backend_destroy(tdm_backend_t *b); /* NULL is a no-op */
/* Where the backend's buffers (activations, the KV pool) live. */
struct tdm_mem_place tdm_backend_buf_place(tdm_backend_t *b);
/* A typed buffer of `bytes` from b's buf_alloc, its place stated (TDM_ENOMEM with a message
 * naming `what`). Release with tdm_backend_buf_release (which zeroes it; an empty one is a
 * no-op). */
tdm_status tdm_backend_buf_new(tdm_backend_t *b, size_t bytes, const char *what,
                               struct tdm_buf *out);
void tdm_backend_buf_release(tdm_backend_t *b, struct tdm_buf *buf);
/* Host memory to a typed buffer of b at byte offset off, and back: TDM_ERANGE past its end. */
tdm_status tdm_buf_upload(tdm_backend_t *b, struct tdm_buf *dst, size_t off, const void *src,
                          size_t n);
tdm_status tdm_buf_download(tdm_backend_t *b, void *dst, const struct tdm_buf *src, size_t off,
                            size_t n);

enum tdm_backend_kind { TDM_BACKEND_CPU = 0, TDM_BACKEND_CUDA = 1 };

/* ---- the CUDA backend (src/backend/cuda; DESIGN.md §8 and that folder's files) ----
 * Weights are bf16 on the device (quantised GGUF weights are dequantised at load; vectors stay
 * fp32); GEMMs run through cuBLASLt with bf16 operands and fp32 accumulation and output (bf16 for
 * the SwiGLU's gate and up, which only feed SiLU * mul), the fp32 activations being rounded to
 * bf16 on the way in, or taken from the bf16 copy their producer wrote. Activations are fp32; the
 * KV cache is bf16 by default (--kv-dtype). Decode steps run as CUDA graphs, one per batch-size
 * bucket. Logit rows are sampled on the device (the `sample` hook: vocabularies up to 2^18 tokens),
 * so only tokens and log-probabilities come back to the host. Not batch-invariant: cuBLASLt picks
 * its algorithm by shape, so a row's logits may differ in the last bits between batch sizes. A CUDA
 * error inside an op (which cannot return one) is fatal: logged, then abort(). Without CUDA in the
 * build, or without a GPU, create returns TDM_EUNSUPPORTED with a message. */
#define TDM_GPU_MEMORY_FRACTION_DEFAULT 0.9 /* tdm_backend_cuda_opts.gpu_memory_fraction <= 0 */
struct tdm_backend_cuda_opts {
    int device;                 /* CUDA device ordinal */
    double gpu_memory_fraction; /* share of the device's memory this process may fill (weights,
                                 * workspace, KV pool); <= 0: 0.9 */
    bool no_graphs;             /* run decode steps op by op instead of as CUDA graphs */
    bool bf16_weights;    /* dequantise every GGUF matrix to bf16 at load; by default Q8_0, Q4_0,
                           * Q4_1, Q4_K and Q6_K matrices stay in their blocks on the device */
    bool batch_invariant; /* each row's result independent of the rows beside it (kernels
                           * chosen by shape alone; see src/backend/cuda/cuda_ops.c) */
};
tdm_status tdm_backend_cuda_create(const struct tdm_backend_cuda_opts *opts, tdm_backend_t **out);
bool tdm_backend_is_cuda(const tdm_backend_t *b);
/* Device name and memory (for banners). */
tdm_status tdm_backend_cuda_info(tdm_backend_t *b, char *name, size_t cap, size_t *total_bytes);
/* The PCI bus id ("0000:18:00.0", lower case) of CUDA device ordinal `device`, for placement
 * (topo.h); needs no backend. TDM_EUNSUPPORTED without CUDA or without that device. */
tdm_status tdm_cuda_device_pci(int device, char *busid, size_t cap);
/* Rooflines measured on the device now: cudaMemcpy device-to-device bandwidth (bytes read +
 * written per second) and the cuBLASLt bf16 GEMM rate (FLOP/s, 8192^3, fp32 accumulation). */
tdm_status tdm_backend_cuda_measure(tdm_backend_t *b, double *copy_bytes_per_s,
                                    double *gemm_flops_per_s);
/* A weight made on the device, values uniform in [lo, hi) from `seed` (benchmarks with random
 * weights need no host copy): dtype TDM_DTYPE_BF16 (matrix) or TDM_DTYPE_F32 (vector), or a
 * matrix in GGUF blocks the device keeps (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) with random integers and
 * scales, values within about the same range. The backend owns it; weight_prepare passes such
 * device weights through. */
tdm_status tdm_backend_cuda_random_weight(tdm_backend_t *b, enum tdm_dtype dtype, int64_t rows,
                                          int64_t cols, uint64_t seed, float lo, float hi,
                                          struct tdm_weight *out);
/* The device bytes weight w (host or device) occupies once on CUDA backend b, as a step reads
 * it: a matrix kept in GGUF blocks its rearranged blocks, another matrix two bytes an element
 * (bf16), a vector four (f32). */
size_t tdm_backend_cuda_held_bytes(tdm_backend_t *b, const struct tdm_weight *w);
/* ---- tensor parallelism over CUDA backends (src/backend/cuda/cuda_tp.c) ----
 * N ranks in one process, rank r's backend on device devices[r]. Two collectives behind one
 * interface:
 *   - NCCL: every rank has a device of its own and libnccl.so.2 loads (opened on first use,
 *     not linked). ncclAllReduce in place on each rank's stream, which CUDA graphs record, so
 *     decode steps stay graphs on every rank.
 *   - peer: ranks that share a device (a one-GPU machine), or NCCL absent or refused. Each
 *     rank copies its partial sums to its staging, records an event, meets the others at the
 *     host barrier, then waits on their events and sums every rank's staging in rank order
 *     (the same bits everywhere). A host barrier inside a step cannot be recorded: the rank
 *     backends must have no graphs (tdm_backend_cuda_opts.no_graphs).
 * $TANDEM_TP_COMM=nccl or peer forces one (nccl refuses ranks that share a device). */
enum tdm_cuda_tp_mode { TDM_CUDA_TP_NCCL = 0, TDM_CUDA_TP_PEER = 1 };
typedef struct tdm_cuda_tp tdm_cuda_tp_t;
struct tdm_tp_group;
/* CUDA devices present (0 without CUDA in the build or without a GPU). */
int tdm_cuda_device_count(void);
/* Where n_ranks ranks go (devices[r] = r modulo the devices present) and which collective
 * joins them; *why says it in words ("NCCL 2.27.3" or why peer). TDM_EUNSUPPORTED without a
 * GPU, or for nccl forced over shared devices or without the library. */
tdm_status tdm_cuda_tp_plan(int n_ranks, int *devices, enum tdm_cuda_tp_mode *mode, char *why,
                            size_t why_cap);
/* Joins ranks[0 .. n) (CUDA backends, rank r's on devices[r] as planned) into one group:
 * communicators (NCCL) or staging of max_floats floats and peer access (peer), and the events
 * that gather the LM head's rows on rank 0. `group` is the ranks' host barrier (peer). Until
 * tdm_cuda_tp_destroy, each backend's allreduce hook serves its rank. One thread, while no
 * rank runs. */
tdm_status tdm_cuda_tp_create(tdm_backend_t *const *ranks, int n, enum tdm_cuda_tp_mode mode,
                              struct tdm_tp_group *group, size_t max_floats, tdm_cuda_tp_t **out);
void tdm_cuda_tp_destroy(tdm_cuda_tp_t *t); /* NULL: no-op; before the backends go */
/* The LM head's rows by vocabulary (engine.c, lm_head): rank 0 opens a step's gathering on its
 * stream once its buffers may be written (lm_open, before the ranks start the step); each rank
 * puts its part [n_rows][nv] (its device) at column v0 of rank 0's dst [n_rows][width] (rank
 * 0's device) once they may (lm_put); after the ranks' barrier rank 0's stream waits for
 * every put (lm_close). */
void tdm_cuda_tp_lm_open(tdm_backend_t *leader);
void tdm_cuda_tp_lm_put(tdm_backend_t *b, const float *part, int n_rows, int64_t nv, float *dst,
                        int64_t width, int64_t v0);
void tdm_cuda_tp_lm_close(tdm_backend_t *leader);
/* Makes the calling thread's current device b's (a rank thread's first call; CUDA calls made
 * on another backend's device leave it elsewhere). */
void tdm_backend_cuda_bind_thread(tdm_backend_t *b);
/* Pinned host memory (fast device-to-host copies, e.g. logits); NULL on failure. */
void *tdm_backend_cuda_host_alloc(tdm_backend_t *b, size_t bytes);
void tdm_backend_cuda_host_free(tdm_backend_t *b, void *p);
/* Sets `bytes` of device memory at dev to the byte `value` (and waits). */
tdm_status tdm_backend_cuda_memset(tdm_backend_t *b, void *dev, int value, size_t bytes);
/* The backend's own layer counter in mapped pinned host memory (a host thread may poll it). */
_Atomic int32_t *tdm_backend_cuda_counter(tdm_backend_t *b);
/* ---- fp32 GEMMs on the GPU over host memory (src/backend/cuda/cuda_host_gemm.c) ----
 * For a caller whose data lives in host memory (the head trainer's --backend cuda):
 * C[M][N] = A' B' + beta C, row-major fp32, A' = A (M x K) or A^T (A stored K x M) when ta, B'
 * = B (K x N) or B^T (B stored N x K) when tb. Each call copies its operands over, runs cuBLASLt
 * with fp32 compute, copies C back and waits. A b_const B (a matrix that never changes) is
 * copied once and kept by address and size. Memory from host_alloc is pinned (full-speed
 * copies). One thread uses an object. Without CUDA in the build or a GPU, create returns
 * TDM_EUNSUPPORTED; after a failed call every call fails. */
typedef struct tdm_cuda_gemm tdm_cuda_gemm_t;
tdm_status tdm_cuda_gemm_create(int device, tdm_cuda_gemm_t **out);
void tdm_cuda_gemm_destroy(tdm_cuda_gemm_t *g);
tdm_status tdm_cuda_gemm_run(tdm_cuda_gemm_t *g, bool ta, bool tb, int M, int N, int K,
                             const float *A, int lda, const float *B, int ldb, bool b_const,
                             float beta, float *C, int ldc);
void *tdm_cuda_gemm_host_alloc(tdm_cuda_gemm_t *g, size_t bytes);
void tdm_cuda_gemm_host_free(tdm_cuda_gemm_t *g, void *p);

/* Which CPU kernels were chosen at run time: "avx512bf16", "avx512", "avx2" or "portable". */
const char *tdm_backend_cpu_isa(void);
/* Whether a CPU backend created now runs its quantised products of several activation rows on
 * the AMX int8 tiles (the CPU has them, the OS grants them, $TANDEM_CPU_AMX is not 0). */
bool tdm_backend_cpu_amx(void);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_BACKEND_H */
