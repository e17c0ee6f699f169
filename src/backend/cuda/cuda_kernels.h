/*
 * The CUDA backend's kernel launchers: a plain C interface between the C half of the backend
 * (cuda_backend.c: the vtable, memory, cuBLASLt, graphs) and the CUDA C++ half (kernels.cu,
 * attention.cu).
 *
 * Why a separate header: the public headers use C11 _Atomic, which C++17 (nvcc's dialect)
 * does not accept, so the .cu files see only this file: plain pointers, sizes and a stream.
 *
 * Conventions: every launcher enqueues on `s` and returns at once; pointers are device memory
 * unless named h_*. Activations are fp32 row-major; bf16 values travel as uint16_t (the top
 * half of the fp32 bit pattern, rounded to nearest even). A NULL bf16 output means "fp32
 * only". Launch errors are caught by the caller (cudaGetLastError after the op).
 */
#ifndef TANDEM_BACKEND_CUDA_KERNELS_H
#define TANDEM_BACKEND_CUDA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "backend/cuda/qkind.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Step metadata as device arrays (copied from the engine's host tdm_step by the backend). */
struct tdm_cu_step {
    int n_tokens, n_seqs, page_size;
    const int32_t *tokens, *positions, *slots, *token_seq;
    const int32_t *seq_token_start, *seq_kv_len, *seq_page_start, *page_ids;
    /* token trees (backend.h's tdm_step): NULL in a step without one */
    const unsigned long long *tree_mask;
    const int32_t *seq_prefix, *tree_node_start, *tree_slots;
    /* attention work list: tile i covers tokens [tiles[3i+1], +tiles[3i+2]) of seq tiles[3i] */
    const int32_t *tiles;
    int n_tiles;
    int tile_tokens; /* most tokens in one tile */
};

/* out[i] = bf16 row tokens[i] of emb as fp32 */
void tdm_cu_embed(cudaStream_t s, const uint16_t *emb, int64_t cols, const int32_t *tokens, int n,
                  float *out, uint16_t *out_bf16);
/* if add: res += add (stored back); out = res / rms(res) * w; out_bf16 (may be NULL) too.
 * Rows of dim floats. out may equal res when add is NULL. */
void tdm_cu_rmsnorm(cudaStream_t s, float *res, const float *add, const float *w, float eps, int n,
                    int dim, float *out, uint16_t *out_bf16, bool invariant);
void tdm_cu_f32_to_bf16(cudaStream_t s, const float *x, size_t n, uint16_t *out);
/* out[i][r] += bias[r] */
void tdm_cu_add_bias(cudaStream_t s, float *out, const float *bias, int n, int rows);
/* out = silu(gate) * up (out may be gate) */
void tdm_cu_silu_mul(cudaStream_t s, const float *gate, const float *up, size_t n, float *out,
                     uint16_t *out_bf16);
/* The same on bf16 gate and up (none of the four arrays overlapping; vector loads and stores
 * where all are 16-byte aligned) */
void tdm_cu_silu_mul_bf16(cudaStream_t s, const uint16_t *gate, const uint16_t *up, size_t n,
                          float *out, uint16_t *out_bf16);
void tdm_cu_add(cudaStream_t s, float *x, const float *y, size_t n);
/* Tensor parallelism's peer all-reduce (cuda_tp.c): x[i] = p[0][i] + p[1][i] + ... +
 * p[n - 1][i], added in that order whatever the caller's rank, so every rank gets the same
 * bits. The p[r] may be other devices' memory (peer access). */
#define TDM_CU_TP_MAX 64
struct tdm_cu_tp_srcs {
    const float *p[TDM_CU_TP_MAX];
    int n;
};
void tdm_cu_tp_sum(cudaStream_t s, const struct tdm_cu_tp_srcs *src, float *x, size_t n);
void tdm_cu_scatter_cols(cudaStream_t s, const float *x, const int32_t *cols, int n, int n_cols,
                         int width, float *out);
void tdm_cu_gather_rows(cudaStream_t s, const float *x, const int32_t *rows, int n, int dim,
                        float *out);
/* out[rows[i]] += w[i] * x[i] (rows, w: device arrays; rows distinct) */
void tdm_cu_rows_scale_add(cudaStream_t s, const float *x, const int32_t *rows, const float *w,
                           int n, int dim, float *out);
/* The KV cache's element types as the kernels know them (kv.h: f32, bf16, f16). Kernels
 * compute in fp32: stores round to nearest even, loads widen exactly. */
enum tdm_cu_kv { TDM_CU_KV_F32 = 0, TDM_CU_KV_BF16 = 1, TDM_CU_KV_F16 = 2 };
/* Copies K and V rows of n slots (every KV head) in n_layers layers of one region (layer l at
 * base + l * layer_bytes): slot dst[i] gets slot src[i]'s, the pairs in order. src, dst: host
 * arrays, at most TDM_CU_KV_COPY_MAX pairs a call (they travel as kernel arguments). */
#define TDM_CU_KV_COPY_MAX 64
void tdm_cu_kv_copy(cudaStream_t s, void *base, int kv_type, int n_layers, size_t layer_bytes,
                    int n_kv_heads, int hd, int page_size, bool latent, const int32_t *src,
                    const int32_t *dst, int n);
/* MLA (mla.cu; backend.h's latent layers and head_matmul): the rope of q's last rot_dim
 * elements a head, and the cached row [lat ; turned kr] at each token's slot of a K-only page;
 * the per-head products of a bf16 weight [n_heads * rows][cols]; attention over latent rows
 * (values: each row's first vd elements), false for a shape it does not take (vd > 1024). */
void tdm_cu_mla_rope(cudaStream_t s, float *q, const float *lat, const float *kr, int n_heads,
                     int hd, int rot_dim, bool neox, float mscale, const float *inv_freq,
                     const struct tdm_cu_step *st, void *kv_base, int kv_type);
void tdm_cu_head_matmul(cudaStream_t s, const uint16_t *w, int n_heads, int rows, int cols,
                        const float *x, int n, size_t x_stride, size_t x_hstride, float *out,
                        size_t out_stride, size_t out_hstride);
bool tdm_cu_mla_attention(cudaStream_t s, const float *q, int n_heads, int hd, int vd,
                          const struct tdm_cu_step *st, const void *kv_base, int kv_type,
                          float scale, float *out);
/* RoPE of q (in place) and k, k and v written to the KV cache (elements of kv_type) at each
 * token's slot (slot < 0: a padding token, nothing written). inv_freq: [hd/2] device. */
void tdm_cu_rope_kv_append(cudaStream_t s, float *q, const float *k, const float *v, int n_heads,
                           int n_kv_heads, int hd, bool neox, const float *inv_freq,
                           const struct tdm_cu_step *st, void *kv_base, int kv_type);
/* Attention. part: scratch of n_splits * n_tokens * n_heads * (hd + 2) floats when n_splits >
 * 1. Returns false when the shape is not supported (head_dim > 512 or more than 64 query heads
 * per KV head). */
bool tdm_cu_attention(cudaStream_t s, const float *q, int n_heads, int n_kv_heads, int hd,
                      const struct tdm_cu_step *st, const void *kv_base, int kv_type, float scale,
                      float *out, uint16_t *out_bf16, int n_splits, float *part);
/* Small-batch matrix-vector products (decode): out_p[j][r] = x[j] . W_p[r] (+ bias_p[r]) for
 * up to 4 weights of k columns sharing the input x [n][k] bf16, n <= TDM_CU_GEMV_MAX_N:
 * for 3..8 tokens, tensor cores over 16 weight rows per block when rows % 16 == 0 and
 * k % 32 == 0, else one warp per row on the CUDA cores; 16-byte weight loads, fp32 accumulation in
 * an order that does not depend on n. swiglu: exactly two parts (gate, up) of equal rows; writes
 * silu(gate) * up into part 0's out (and out_bf16 when not NULL). Returns false when the shape
 * does not suit (k % 8, alignment, n), and the caller uses cuBLASLt. invariant: any n, the
 * kernel chosen by the shape alone (tensor cores in tiles of up to 32 tokens when rows % 16 == 0
 * and k % 32 == 0, else the CUDA-core kernel 8 tokens a launch), so that a token's row does not
 * depend on n. */
#define TDM_CU_GEMV_MAX_N 8
struct tdm_cu_gemv_part {
    const uint16_t *w;
    const float *bias;
    float *out;
    int m;
};
bool tdm_cu_gemv(cudaStream_t s, const struct tdm_cu_gemv_part *parts, int n_parts, int k,
                 const uint16_t *x, int n, bool swiglu, uint16_t *out_bf16, bool invariant);

/* Quantised weights (qgemv.cu; the layout is qweight.h's): a part is one matrix's arrays (q,
 * qh, s, dd: NULL where its kind has none), its bias, output [n][m] and rows m. tdm_cu_qgemv:
 * out_p[j][r] = x[j] . W_p[r] (+ bias_p[r]) for up to 4 matrices of one kind sharing x [n][k]
 * (bf16, 8-byte aligned), k % 64 == 0; swiglu as tdm_cu_gemv's (two parts of one kind). A row's
 * result does not depend on n. Any n works (tiles of 32 tokens, each re-reading the weights,
 * mostly from L2); the backend uses it up to TDM_CU_QGEMV_MAX_N, or always when batch-invariant.
 * False when the shape does not suit.
 * tdm_cu_qdequant: rows [r0, r0 + n_rows) as bf16 [n_rows][k]. tdm_cu_qembed: out[i] = row
 * tokens[i] (a device array) as fp32. */
#define TDM_CU_QGEMV_MAX_N 64
struct tdm_cu_qgemv_part {
    const uint8_t *q, *qh, *s, *dd;
    const float *bias;
    float *out;
    int m;
};
bool tdm_cu_qgemv(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *parts, int n_parts,
                  int k, const uint16_t *x, int n, bool swiglu, uint16_t *out_bf16);
/* Which form of the kernel tdm_cu_qgemv launches (the same bits either way): AUTO (the faster
 * one measured per kind: the staged form but for Q4_K), REGS (each warp loads its weights into
 * registers), BULK (the copy engine stages them in shared memory, where alignment and shared memory
 * allow). $TANDEM_CUDA_QGEMV=regs|bulk sets it at start; this call overrides it (benchmarks,
 * tests). */
enum { TDM_CU_QGEMV_AUTO = 0, TDM_CU_QGEMV_REGS = 1, TDM_CU_QGEMV_BULK = 2 };
void tdm_cu_qgemv_set_form(int form);
void tdm_cu_qdequant(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *p, int k, int r0,
                     int n_rows, uint16_t *out);
void tdm_cu_qembed(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *p, int k,
                   const int32_t *tokens, int n, float *out);

/* Sampling (sample.cu): one block per logit row, the host sampler's choice for the same
 * logits (sample.h), in the row's mode (a draw, a drafter's proposal, or a draft's
 * verification). logits [n_rows][vocab] is overwritten (penalties); pens: each row's
 * distinct seen tokens at [pen_off, pen_off + pen_n) (raw is written: the logit before the
 * penalty); masks: the rows' grammar masks, row i's at word allow_off (-1: none; bit t of word
 * t / 32 set when token t may be chosen, the others -inf after the penalties); scratch:
 * tdm_cu_sample_scratch_bytes(n_rows, vocab). Returns false for a vocabulary
 * it cannot take (n_rows 0: only that check). */
#define TDM_CU_SAMPLE_MAX_TOP   20
#define TDM_CU_SAMPLE_MAX_VOCAB (1 << 18)
#define TDM_CU_SAMPLE_MAX_UNDO  64
#define TDM_CU_SAMPLE_MAX_CAND  16
/* mode: sample.h's enum tdm_sample_mode (0 draw, 1 propose, 2 verify, 3 a tree's node) */
struct tdm_cu_sample_row {
    float temperature, top_p, min_p, repetition, presence, frequency;
    int32_t top_k, n_top, pen_off, pen_n;
    uint32_t position, mode;
    uint64_t seed, request_id;
    int32_t draft, one_hot, n_undo, n_cand;
    int32_t allow_off;                    /* the grammar mask's first word in masks, or -1 */
    int32_t cand[TDM_CU_SAMPLE_MAX_CAND]; /* tree: the candidates, tested in this order */
    int32_t undo[TDM_CU_SAMPLE_MAX_UNDO]; /* tokens whose penalty counts this row leaves out */
    const float *q;                       /* verify: the draft's distribution, or NULL */
    float *dist;                          /* propose: the row's distribution, out */
};
struct tdm_cu_sample_pen {
    int32_t id;
    uint32_t count, in_prompt;
    float raw;
    float bias; /* logit_bias, added after the penalties; 0: none */
};
struct tdm_cu_sample_out {
    int32_t token, kept;
    float logprob;
    int32_t top_ids[TDM_CU_SAMPLE_MAX_TOP];
    float top_lps[TDM_CU_SAMPLE_MAX_TOP];
};
bool tdm_cu_sample(cudaStream_t s, float *logits, int n_rows, int vocab,
                   const struct tdm_cu_sample_row *rows, struct tdm_cu_sample_pen *pens,
                   const uint32_t *masks, struct tdm_cu_sample_out *out, void *scratch);
/* Replaces the TDM_TOKEN_PREV tokens (negative) in d_tokens [n] with the tokens of the last
 * sampling's rows (prev [n_prev], stream-ordered after it). */
void tdm_cu_resolve_tokens(cudaStream_t s, int32_t *d_tokens, int n,
                           const struct tdm_cu_sample_out *prev, int n_prev, int vocab);
/* The sampling scratch: exponentials (4 bytes a token) then candidate keys (8 bytes a token). */
static inline size_t tdm_cu_sample_scratch_keys_at(int n_rows, int vocab)
{
    return ((size_t)n_rows * (size_t)vocab * 4 + 255) & ~(size_t)255;
}
static inline size_t tdm_cu_sample_scratch_bytes(int n_rows, int vocab)
{
    return tdm_cu_sample_scratch_keys_at(n_rows, vocab) + (size_t)n_rows * (size_t)vocab * 8;
}

/* Stores value into *counter (a device alias of mapped pinned host memory) after all work
 * before it on the stream; works inside a CUDA graph. */
void tdm_cu_store_counter(cudaStream_t s, int32_t *counter, int32_t value);
/* Fills n values uniformly in [lo, hi) from a counter-based hash of (seed, index). */
void tdm_cu_fill_uniform_bf16(cudaStream_t s, uint16_t *out, size_t n, uint64_t seed, float lo,
                              float hi);
void tdm_cu_fill_uniform_f32(cudaStream_t s, float *out, size_t n, uint64_t seed, float lo,
                             float hi);
void tdm_cu_fill_uniform_f16(cudaStream_t s, uint16_t *out, size_t n, uint64_t seed, float lo,
                             float hi);
/* n bytes, each uniform in 0..255 */
void tdm_cu_fill_bytes(cudaStream_t s, void *out, size_t n, uint64_t seed);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_BACKEND_CUDA_KERNELS_H */
