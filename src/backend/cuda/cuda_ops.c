/*
 * The CUDA backend's ops (the vtable's compute entries): each converts its input to bf16 where a
 * matmul needs it (skipped when a producer wrote the bf16 shadow), launches its kernel on the
 * instance's stream, and is timed when profiling. Also the layer-completion counter and sync.
 * One thread drives an instance.
 */
#include "backend/cuda/cuda_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- ops ---- */

static inline void check_launch(void)
{
    TDM_CU_CHECK(cudaGetLastError());
}

static void shadow_clear(struct tdm_cuda *cu)
{
    cu->sh_ptr = NULL;
}

/* A bf16 buffer a producer may write next to its fp32 output of n elements: the shadow buffer
 * not holding the current shadow (which may be the producer's tdm_cuda_own input). NULL inside a
 * capture when it is too small (the producer then writes fp32 only). */
static uint16_t *shadow_for(struct tdm_cuda *cu, const float *out, size_t n)
{
    const int i = cu->sh_cur ^ 1;
    if (n > cu->shb_cap[i] / sizeof(uint16_t)) {
        if (cu->capturing) {
            shadow_clear(cu);
            return NULL;
        }
        tdm_cuda_grow(cu, (void **)&cu->shb[i], &cu->shb_cap[i], n * sizeof(uint16_t));
    }
    cu->sh_cur = i;
    cu->sh_ptr = out;
    cu->sh_elems = n;
    return cu->shb[i];
}

/* The bf16 form of a matmul input x [n][cols]: the shadow if it mirrors x, else a conversion. */
static const uint16_t *bf16_input(struct tdm_cuda *cu, const float *x, int n, int64_t cols)
{
    const size_t elems = (size_t)n * (size_t)cols;
    if (cu->sh_ptr == x && cu->sh_elems == elems) return cu->shb[cu->sh_cur];
    tdm_cuda_grow(cu, (void **)&cu->xb, &cu->xb_cap, elems * sizeof(uint16_t));
    tdm_cu_f32_to_bf16(cu->stream, x, elems, cu->xb);
    check_launch();
    return cu->xb;
}

static void cu_embed_impl(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens,
                          int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    if (n <= 0) return;
    struct tdm_cu_qgemv_part qp;
    int kind;
    const bool quantised = tdm_cuda_qpart(emb, &qp, &kind);
    TDM_ASSERT(quantised || emb->dtype == TDM_DTYPE_BF16);
    const int32_t *dt;
    if (cu->cur_st && tokens == cu->cur_st->tokens) {
        dt = cu->dstep.tokens;
    } else {
        tdm_cuda_grow(cu, (void **)&cu->d_rows, &cu->rows_cap, (size_t)n * sizeof(int32_t));
        TDM_CU_CHECK(
            cudaMemcpyAsync(cu->d_rows, tokens, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        dt = cu->d_rows;
    }
    if (quantised)
        tdm_cu_qembed(cu->stream, kind, &qp, (int)emb->cols, dt, n, out);
    else
        tdm_cu_embed(cu->stream, emb->data, emb->cols, dt, n, out, NULL);
    check_launch();
}

static void cu_rmsnorm_impl(tdm_backend_t *b, const float *x, const float *w, float eps, int n,
                            int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    uint16_t *sh = shadow_for(cu, out, (size_t)n * dim);
    tdm_cu_rmsnorm(cu->stream, (float *)x, NULL, w, eps, n, dim, out, sh, cu->batch_invariant);
    check_launch();
}

static void cu_add_rmsnorm_impl(tdm_backend_t *b, float *residual, const float *x, const float *w,
                                float eps, int n, int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    uint16_t *sh = shadow_for(cu, out, (size_t)n * dim);
    tdm_cu_rmsnorm(cu->stream, residual, x, w, eps, n, dim, out, sh, cu->batch_invariant);
    check_launch();
}

/* The bf16 matrix of a prepared weight (a 1-row fp32 "vector" carries a bf16 copy after it). */
static const uint16_t *bf16_matrix(const struct tdm_weight *w)
{
    if (w->dtype == TDM_DTYPE_BF16) return w->data;
    TDM_ASSERT(w->dtype == TDM_DTYPE_F32 && w->rows == 1);
    return (const uint16_t *)((const float *)w->data + w->cols);
}

/* Whether n rows go to the matrix-vector kernels (bf16 matrices; matrices in blocks) rather
 * than cuBLASLt: small batches, or any batch when the instance is batch-invariant. */
static inline bool gemv_takes(const struct tdm_cuda *cu, int n)
{
    return n <= TDM_CU_GEMV_MAX_N || cu->batch_invariant;
}
static inline bool qgemv_takes(const struct tdm_cuda *cu, int n)
{
    return n <= TDM_CU_QGEMV_MAX_N || cu->batch_invariant;
}

/* A matrix kept in its blocks times n > TDM_CU_QGEMV_MAX_N rows: chunks of its rows
 * dequantised to bf16, each multiplied by cuBLASLt into its columns of out (fp32, or bf16 when
 * out_bf16). */
static void qmatmul_chunks(struct tdm_cuda *cu, const struct tdm_weight *w,
                           const struct tdm_cu_qgemv_part *qp, int kind, const uint16_t *xb, int n,
                           void *out, bool out_bf16)
{
    const int m = (int)w->rows, k = (int)w->cols;
    const int chunk = (int)tdm_cuda_deq_rows(w->rows, w->cols);
    TDM_ASSERT((size_t)chunk * (size_t)k * 2 <= cu->deq_cap);
    for (int r0 = 0; r0 < m; r0 += chunk) {
        const int nr = TDM_MIN(chunk, m - r0);
        tdm_cu_qdequant(cu->stream, kind, qp, k, r0, nr, cu->deq);
        if (out_bf16)
            tdm_cu_gemm_bf16_ld(cu, cu->deq, nr, k, xb, n, (uint16_t *)out + r0, m);
        else
            tdm_cu_gemm_ld(cu, cu->deq, nr, k, xb, n, (float *)out + r0, m);
    }
}

static void qmatmul_gemm(struct tdm_cuda *cu, const struct tdm_weight *w,
                         const struct tdm_cu_qgemv_part *qp, int kind, const uint16_t *xb, int n,
                         const float *bias, float *out)
{
    qmatmul_chunks(cu, w, qp, kind, xb, n, out, false);
    if (bias) tdm_cu_add_bias(cu->stream, out, bias, n, (int)w->rows);
    check_launch();
}

/* w times n rows into bf16 out [n][w->rows] through cuBLASLt, whatever n (no bias; qp: w's
 * blocks, or NULL for a bf16 matrix): for a product whose result only feeds bf16 consumers,
 * half the bytes of an fp32 output written and read again. */
static void matmul_bf16_out(struct tdm_cuda *cu, const struct tdm_weight *w,
                            const struct tdm_cu_qgemv_part *qp, int kind, const uint16_t *xb, int n,
                            uint16_t *out)
{
    if (qp)
        qmatmul_chunks(cu, w, qp, kind, xb, n, out, true);
    else
        tdm_cu_gemm_bf16_ld(cu, bf16_matrix(w), (int)w->rows, (int)w->cols, xb, n, out,
                            (int)w->rows);
    check_launch();
}

static void matmul_into(struct tdm_cuda *cu, const struct tdm_weight *w, const uint16_t *xb, int n,
                        const float *bias, float *out)
{
    if (out == cu->sh_ptr) shadow_clear(cu);
    struct tdm_cu_qgemv_part qp;
    int kind;
    if (tdm_cuda_qpart(w, &qp, &kind)) {
        qp.bias = bias;
        qp.out = out;
        if (qgemv_takes(cu, n) &&
            tdm_cu_qgemv(cu->stream, kind, &qp, 1, (int)w->cols, xb, n, false, NULL)) {
            check_launch();
            return;
        }
        qmatmul_gemm(cu, w, &qp, kind, xb, n, bias, out);
        return;
    }
    const struct tdm_cu_gemv_part p = {bf16_matrix(w), bias, out, (int)w->rows};
    if (gemv_takes(cu, n) &&
        tdm_cu_gemv(cu->stream, &p, 1, (int)w->cols, xb, n, false, NULL, cu->batch_invariant)) {
        check_launch();
        return;
    }
    tdm_cu_gemm(cu, bf16_matrix(w), (int)w->rows, (int)w->cols, xb, n, out);
    if (bias) tdm_cu_add_bias(cu->stream, out, bias, n, (int)w->rows);
    check_launch();
}

static void cu_matmul_impl(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                           const float *bias, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0) return;
    const uint16_t *xb = bf16_input(cu, x, n, w->cols);
    matmul_into(cu, w, xb, n, bias, out);
}

static void cu_matmul_multi_impl(tdm_backend_t *b, const float *x, int n,
                                 const struct tdm_matmul_part *parts, int n_parts)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0 || n_parts <= 0) return;
    const uint16_t *xb = bf16_input(cu, x, n, parts[0].w->cols);
    struct tdm_cu_qgemv_part qp[4];
    int kinds[4] = {0}, n_q = 0; /* parts in blocks */
    bool one_kind = n_parts <= 4;
    for (int i = 0; i < n_parts; i++) {
        struct tdm_cu_qgemv_part p;
        int kind;
        if (!tdm_cuda_qpart(parts[i].w, &p, &kind)) continue;
        n_q++;
        if (i >= 4) continue;
        p.bias = parts[i].bias;
        p.out = parts[i].out;
        qp[i] = p;
        kinds[i] = kind;
        one_kind &= kind == kinds[0];
    }
    if (n_q == n_parts && one_kind && qgemv_takes(cu, n)) {
        for (int i = 0; i < n_parts; i++)
            if (parts[i].out == cu->sh_ptr) shadow_clear(cu);
        if (tdm_cu_qgemv(cu->stream, kinds[0], qp, n_parts, (int)parts[0].w->cols, xb, n, false,
                         NULL)) {
            check_launch();
            return;
        }
    }
    if (gemv_takes(cu, n) && n_parts <= 4 && n_q == 0) {
        /* one launch for all parts */
        struct tdm_cu_gemv_part gp[4];
        for (int i = 0; i < n_parts; i++) {
            if (parts[i].out == cu->sh_ptr) shadow_clear(cu);
            gp[i] = (struct tdm_cu_gemv_part){bf16_matrix(parts[i].w), parts[i].bias, parts[i].out,
                                              (int)parts[i].w->rows};
        }
        if (tdm_cu_gemv(cu->stream, gp, n_parts, (int)parts[0].w->cols, xb, n, false, NULL,
                        cu->batch_invariant)) {
            check_launch();
            return;
        }
    }
    for (int i = 0; i < n_parts; i++)
        matmul_into(cu, parts[i].w, xb, n, parts[i].bias, parts[i].out);
}

static void cu_matmul_swiglu_impl(tdm_backend_t *b, const struct tdm_weight *w_gate,
                                  const struct tdm_weight *w_up, const float *x, int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0) return;
    const size_t elems = (size_t)n * (size_t)w_gate->rows;
    const uint16_t *xb = bf16_input(cu, x, n, w_gate->cols);
    struct tdm_cu_qgemv_part qp[2];
    int kg = 0, ku = 0;
    const bool qg = tdm_cuda_qpart(w_gate, &qp[0], &kg), qu = tdm_cuda_qpart(w_up, &qp[1], &ku);
    if (qg && qu && kg == ku && qgemv_takes(cu, n)) {
        if (out == cu->sh_ptr) shadow_clear(cu);
        qp[0].out = out;
        uint16_t *sh = shadow_for(cu, out, elems);
        if (tdm_cu_qgemv(cu->stream, kg, qp, 2, (int)w_gate->cols, xb, n, true, sh)) {
            check_launch();
            return;
        }
        shadow_clear(cu);
    }
    if (gemv_takes(cu, n) && !qg && !qu) {
        /* gate, up and silu * mul in one launch */
        if (out == cu->sh_ptr) shadow_clear(cu);
        const struct tdm_cu_gemv_part gp[2] = {{bf16_matrix(w_gate), NULL, out, (int)w_gate->rows},
                                               {bf16_matrix(w_up), NULL, NULL, (int)w_up->rows}};
        uint16_t *sh = shadow_for(cu, out, elems);
        if (tdm_cu_gemv(cu->stream, gp, 2, (int)w_gate->cols, xb, n, true, sh,
                        cu->batch_invariant)) {
            check_launch();
            return;
        }
        shadow_clear(cu);
    }
    tdm_cuda_grow(cu, (void **)&cu->up, &cu->up_cap, (elems + 8) * sizeof(float));
    /* where matmul_into would send both products to cuBLASLt (no kernel of ours takes n) */
    const bool gemm_g = qg ? !qgemv_takes(cu, n) : !gemv_takes(cu, n);
    const bool gemm_u = qu ? !qgemv_takes(cu, n) : !gemv_takes(cu, n);
    if (gemm_g && gemm_u) {
        /* prefill: gate and up leave cuBLASLt as bf16 (the up buffer holds both, up from a
         * 16-byte boundary), so that SiLU * mul reads half the bytes; its product was rounded
         * to bf16 for the down projection anyway */
        if (out == cu->sh_ptr) shadow_clear(cu);
        uint16_t *gb = (uint16_t *)cu->up, *ub = gb + ((elems + 7) & ~(size_t)7);
        matmul_bf16_out(cu, w_gate, qg ? &qp[0] : NULL, kg, xb, n, gb);
        matmul_bf16_out(cu, w_up, qu ? &qp[1] : NULL, ku, xb, n, ub);
        uint16_t *sh = shadow_for(cu, out, elems);
        tdm_cu_silu_mul_bf16(cu->stream, gb, ub, elems, out, sh);
        check_launch();
        return;
    }
    matmul_into(cu, w_gate, xb, n, NULL, out);
    matmul_into(cu, w_up, xb, n, NULL, cu->up);
    uint16_t *sh = shadow_for(cu, out, elems);
    tdm_cu_silu_mul(cu->stream, out, cu->up, elems, out, sh);
    check_launch();
}

static void cu_head_rmsnorm_impl(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                                 int head_dim)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_rmsnorm(cu->stream, x, NULL, w, eps, n_rows, head_dim, x, NULL, cu->batch_invariant);
    check_launch();
}

static const float *inv_freq_dev(struct tdm_cuda *cu, const struct tdm_rope *rope)
{
    const int half = (rope->rot_dim > 0 ? rope->rot_dim : rope->head_dim) / 2;
    TDM_ASSERT(half > 0 && half <= INV_FREQ_MAX);
    if (cu->inv_n != half || memcmp(cu->h_inv_freq, rope->inv_freq, (size_t)half * 4) != 0) {
        /* inside a capture this copy becomes a graph node reading the pinned copy, which
         * keeps these values until the next change (which drops the graphs) */
        if (cu->inv_n != 0 && !cu->capturing) {
            TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
            tdm_cuda_drop_graphs(cu);
        }
        memcpy(cu->h_inv_freq, rope->inv_freq, (size_t)half * 4);
        cu->inv_n = half;
        TDM_CU_CHECK(cudaMemcpyAsync(cu->d_inv_freq, cu->h_inv_freq, (size_t)half * 4,
                                     cudaMemcpyHostToDevice, cu->stream));
    }
    return cu->d_inv_freq;
}

static void cu_rope_kv_append_impl(tdm_backend_t *b, float *q, const float *k, const float *v,
                                   int n_heads, const struct tdm_step *st,
                                   const struct tdm_rope *rope, const struct tdm_kv_layer *kv)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_ASSERT(rope->head_dim == kv->head_dim && st->page_size == kv->page_size);
    const struct tdm_cu_step *ds = tdm_cuda_dev_step(cu, st, 0, kv->head_dim);
    const float *inv = inv_freq_dev(cu, rope);
    const float ms = rope->mscale != 0.0f ? rope->mscale : 1.0f;
    if (kv->v_dim > 0) { /* a latent row: k the latent, v the rope key */
        TDM_ASSERT(kv->n_kv_heads == 1 && rope->rot_dim > 0);
        tdm_cu_mla_rope(cu->stream, q, k, v, n_heads, kv->head_dim, rope->rot_dim, rope->neox, ms,
                        inv, ds, kv->base, tdm_cuda_kv_type(kv->dtype));
        check_launch();
        return;
    }
    /* rotating part of a row, or a magnitude, is MLA's (YaRN is DeepSeek's only) */
    TDM_ASSERT((rope->rot_dim == 0 || rope->rot_dim == rope->head_dim) && ms == 1.0f);
    tdm_cu_rope_kv_append(cu->stream, q, k, v, n_heads, kv->n_kv_heads, rope->head_dim, rope->neox,
                          inv, ds, kv->base, tdm_cuda_kv_type(kv->dtype));
    check_launch();
}

static void cu_attention_impl(tdm_backend_t *b, const float *q, int n_heads,
                              const struct tdm_step *st, const struct tdm_kv_layer *kv, float scale,
                              float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    if (kv->v_dim > 0) { /* latent rows (MLA) */
        const struct tdm_cu_step *ls = tdm_cuda_dev_step(cu, st, 0, kv->head_dim);
        if (!tdm_cu_mla_attention(cu->stream, q, n_heads, kv->head_dim, kv->v_dim, ls, kv->base,
                                  tdm_cuda_kv_type(kv->dtype), scale, out))
            tdm_cu_fatal("attention", "unsupported latent shape (v_dim > 1024)", __FILE__,
                         __LINE__);
        check_launch();
        return;
    }
    const int gs = n_heads / kv->n_kv_heads, hd = kv->head_dim;
    const struct tdm_cu_step *ds = tdm_cuda_dev_step(cu, st, gs, hd);
    /* split-KV when the (tile, KV head) blocks would not fill the GPU cu->attn_fill times over; a
     * batch-invariant instance always cuts a token's KV into BI_SPLITS parts (reserve sized the
     * states for its largest step), so the split depends on the token alone */
    const int blocks = ds->n_tiles * kv->n_kv_heads;
    int splits = 1;
    if (cu->batch_invariant) {
        splits = BI_SPLITS;
        const size_t per = (size_t)ds->n_tokens * n_heads * (hd + 2);
        if ((size_t)splits * per > cu->part_cap / sizeof(float)) {
            TDM_ASSERT(!cu->capturing);
            tdm_cuda_grow(cu, (void **)&cu->part, &cu->part_cap,
                          (size_t)splits * per * sizeof(float));
        }
    } else if (blocks < cu->attn_fill * cu->n_sms) {
        splits = TDM_MIN(MAX_SPLITS, (cu->attn_fill * cu->n_sms + blocks - 1) / blocks);
        if (!cu->dstep_graph) splits = TDM_MIN(splits, (cu->dstep_max_kv + 31) / 32);
        const size_t per = (size_t)ds->n_tokens * n_heads * (hd + 2);
        while (splits > 1 && (size_t)splits * per > cu->part_cap / sizeof(float)) {
            if (!cu->capturing && !cu->reserved) {
                tdm_cuda_grow(cu, (void **)&cu->part, &cu->part_cap,
                              TDM_MIN((size_t)splits * per, PART_FLOATS) * sizeof(float));
                if ((size_t)splits * per <= cu->part_cap / sizeof(float)) break;
            }
            splits--;
        }
        splits = TDM_MAX(splits, 1);
    }
    uint16_t *sh = shadow_for(cu, out, (size_t)st->n_tokens * n_heads * hd);
    if (!tdm_cu_attention(cu->stream, q, n_heads, kv->n_kv_heads, hd, ds, kv->base,
                          tdm_cuda_kv_type(kv->dtype), scale, out, sh, splits, cu->part))
        tdm_cu_fatal("attention", "unsupported shape (head_dim > 512 or > 64 heads per KV head)",
                     __FILE__, __LINE__);
    check_launch();
}

void tdm_cuda_silu_mul(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                       float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_silu_mul(cu->stream, gate, up, (size_t)n * dim, out, NULL);
    check_launch();
}

void tdm_cuda_add(tdm_backend_t *b, float *x, const float *y, size_t n)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_add(cu->stream, x, y, n);
    check_launch();
}

static void cu_gather_rows_impl(tdm_backend_t *b, const float *x, const int32_t *rows, int n,
                                int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    if (n <= 0) return;
    const int32_t *dr;
    if (cu->cur_st && rows == cu->cur_rows) {
        dr = cu->d_step_rows;
    } else {
        tdm_cuda_grow(cu, (void **)&cu->d_rows, &cu->rows_cap, (size_t)n * sizeof(int32_t));
        TDM_CU_CHECK(
            cudaMemcpyAsync(cu->d_rows, rows, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        dr = cu->d_rows;
    }
    tdm_cu_gather_rows(cu->stream, x, dr, n, dim, out);
    check_launch();
}

void tdm_cuda_embed(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                    float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_EMBED);
    cu_embed_impl(b, emb, tokens, n, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_rmsnorm(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                      float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_NORM);
    cu_rmsnorm_impl(b, x, w, eps, n, dim, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_add_rmsnorm(tdm_backend_t *b, float *residual, const float *x, const float *w,
                          float eps, int n, int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_NORM);
    cu_add_rmsnorm_impl(b, residual, x, w, eps, n, dim, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                     const float *bias, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_MATMUL);
    cu_matmul_impl(b, w, x, n, bias, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_matmul_multi(tdm_backend_t *b, const float *x, int n,
                           const struct tdm_matmul_part *parts, int n_parts)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_MULTI);
    cu_matmul_multi_impl(b, x, n, parts, n_parts);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_matmul_swiglu(tdm_backend_t *b, const struct tdm_weight *w_gate,
                            const struct tdm_weight *w_up, const float *x, int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_SWIGLU);
    cu_matmul_swiglu_impl(b, w_gate, w_up, x, n, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_head_rmsnorm(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                           int head_dim)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_HEADNORM);
    cu_head_rmsnorm_impl(b, x, w, eps, n_rows, head_dim);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_rope_kv_append(tdm_backend_t *b, float *q, const float *k, const float *v,
                             int n_heads, const struct tdm_step *st, const struct tdm_rope *rope,
                             const struct tdm_kv_layer *kv)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_ROPE);
    cu_rope_kv_append_impl(b, q, k, v, n_heads, st, rope, kv);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                        const struct tdm_kv_layer *kv, float scale, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_ATTN);
    cu_attention_impl(b, q, n_heads, st, kv, scale, out);
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_scatter_cols(tdm_backend_t *b, const float *x, const int32_t *cols, int n, int n_cols,
                           int width, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_GATHER);
    shadow_clear(cu);
    tdm_cu_scatter_cols(cu->stream, x, cols, n, n_cols, width, out);
    check_launch();
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_zero(tdm_backend_t *b, float *x, size_t n)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_CU_CHECK(cudaMemsetAsync(x, 0, n * sizeof(float), cu->stream));
}

/* The row list and weights go up through one device buffer; the copy is ordered after the
 * kernels before it and waited for, so the host arrays may change as soon as this returns
 * (mixture-of-experts layers run op by op: never inside a graph). */
void tdm_cuda_rows_scale_add(tdm_backend_t *b, const float *x, const int32_t *rows,
                             const float *weights, int n, int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_GATHER);
    shadow_clear(cu);
    if (n > 0) {
        tdm_cuda_grow(cu, &cu->d_moe, &cu->moe_cap, (size_t)n * 8);
        int32_t *dr = cu->d_moe;
        float *dw = (float *)(dr + n);
        TDM_CU_CHECK(cudaMemcpyAsync(dr, rows, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(
            cudaMemcpyAsync(dw, weights, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        tdm_cu_rows_scale_add(cu->stream, x, dr, dw, n, dim, out);
        check_launch();
    }
    tdm_cuda_prof_end(cu);
}

void tdm_cuda_gather_rows(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                          float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_prof_begin(cu, P_GATHER);
    cu_gather_rows_impl(b, x, rows, n, dim, out);
    tdm_cuda_prof_end(cu);
}

/* The device alias of a counter; registers a caller's counter page once (not while capturing). */
int32_t *tdm_cuda_counter_dev(struct tdm_cuda *cu, _Atomic int32_t *counter)
{
    if ((void *)counter == (void *)cu->h_counter) return cu->d_counter;
    for (int i = 0; i < cu->n_counters; i++)
        if (cu->counters[i].host == counter) return cu->counters[i].dev;
    if (cu->capturing || cu->n_counters == TDM_CU_MAX_COUNTERS) return NULL;
    const long pg = sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)counter & ~(uintptr_t)(pg - 1));
    int32_t *dev = NULL;
    cudaError_t e = cudaHostRegister(page, (size_t)pg, cudaHostRegisterMapped);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        page = NULL; /* someone else's registration: use it, do not unregister it */
    } else if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (cudaHostGetDevicePointer((void **)&dev, (void *)counter, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        if (page) cudaHostUnregister(page);
        return NULL;
    }
    cu->counters[cu->n_counters].host_page = page;
    cu->counters[cu->n_counters].host = counter;
    cu->counters[cu->n_counters].dev = dev;
    cu->n_counters++;
    return dev;
}

void tdm_cuda_layer_done(tdm_backend_t *b, int layer, _Atomic int32_t *counter)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    int32_t *d = tdm_cuda_counter_dev(cu, counter);
    if (!d) {
        /* not mappable: publish after the work completes (not possible inside a capture) */
        if (cu->capturing) tdm_cu_fatal("layer_done", "counter not registered", __FILE__, __LINE__);
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        atomic_store_explicit(counter, layer + 1, memory_order_release);
        return;
    }
    tdm_cu_store_counter(cu->stream, d, layer + 1);
    check_launch();
}

void tdm_cuda_step_detach(struct tdm_cuda *cu)
{
    cu->cur_st = NULL;
    cu->cur_rows = NULL;
    shadow_clear(cu);
}

void tdm_cuda_sync(tdm_backend_t *b)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    if (cu->prof) tdm_cuda_prof_collect(cu);
    tdm_cuda_step_detach(cu);
}

void tdm_cuda_kv_copy(tdm_backend_t *b, const struct tdm_kv_layer *kv, int n_layers,
                      size_t layer_bytes, const int32_t *src, const int32_t *dst, int n)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_bind(cu);
    for (int i = 0; i < n; i += TDM_CU_KV_COPY_MAX) { /* pairs travel as kernel arguments */
        tdm_cu_kv_copy(cu->stream, kv->base, tdm_cuda_kv_type(kv->dtype), n_layers, layer_bytes,
                       kv->n_kv_heads, kv->head_dim, kv->page_size, kv->v_dim > 0, src + i, dst + i,
                       TDM_MIN(n - i, TDM_CU_KV_COPY_MAX));
        check_launch();
    }
}

void tdm_cuda_head_matmul(tdm_backend_t *b, const struct tdm_weight *w, int n_heads, const float *x,
                          int n, size_t x_stride, size_t x_hstride, float *out, size_t out_stride,
                          size_t out_hstride)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_ASSERT(w->dtype == TDM_DTYPE_BF16 && n_heads > 0 && w->rows % n_heads == 0);
    tdm_cu_head_matmul(cu->stream, w->data, n_heads, (int)(w->rows / n_heads), (int)w->cols, x, n,
                       x_stride, x_hstride, out, out_stride, out_hstride);
    check_launch();
}
