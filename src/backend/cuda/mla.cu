/*
 * Multi-head latent attention on the GPU (backend.h: a latent KV layer, head_matmul): the
 * kernels the CPU backend's MLA ops have, in their first, plain form.
 *
 *   mla_rope_kernel    one block per token: the angles of the rope part (rot_dim / 2 pairs,
 *                      cos and sin times mscale), q's last rot_dim elements of each head turned,
 *                      and the cached row [latent ; turned rope key] stored at the token's slot
 *                      of a K-only page ([n_pages][page_size][head_dim]).
 *   head_mm_kernel     one block per (row, head): a warp per output element, the dot product of
 *                      a bf16 weight row (as weight_prepare holds matrices) and the head's fp32
 *                      input slice, lane-strided, then a butterfly sum.
 *   mla_attn_kernel    one block per (token, query head): positions 32 at a time, each warp
 *                      scoring 8 of them against the token's query row (in shared memory), an
 *                      online softmax, and each thread accumulating its own value dimensions
 *                      (V is each cached row's first v_dim elements); token trees as backend.h
 *                      says (the prefix through the page table, then the nodes of the token's
 *                      mask from their slots); a padding token (KV length 0) writes zeros.
 *
 * Cost: every query head reads the latent rows itself (H times the bytes a shared read would
 * take), and nothing uses the tensor cores; the GPU performance issue owns the fast form.
 * Numerics: fp32 throughout (2-byte KV widened exactly as it is read), expf the precise one.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/kv_elem.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <climits>
#include <math.h>

namespace
{

constexpr int ATT_THREADS = 128, ATT_CHUNK = 32, ATT_VPT = 8; /* v_dim <= 128 * 8 */

__device__ __forceinline__ void turn(float *x, int ia, int ib, float c, float s)
{
    const float a = x[ia], b = x[ib];
    x[ia] = a * c - b * s;
    x[ib] = a * s + b * c;
}

__global__ void mla_rope_kernel(float *q, const float *lat, const float *kr, int n_heads, int hd,
                                int rd, bool neox, float mscale, const float *inv_freq,
                                const int32_t *positions, const int32_t *slots, int page_size,
                                void *kv_base, int kv_t)
{
    tdm_pdl_wait();
    extern __shared__ float sm[];
    const int half = rd / 2, lora = hd - rd, t = blockIdx.x;
    float *cs = sm, *sn = sm + half;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float ang = pos * inv_freq[i];
        cs[i] = cosf(ang) * mscale;
        sn[i] = sinf(ang) * mscale;
    }
    __syncthreads();
    float *qt = q + (size_t)t * n_heads * hd;
    for (int it = threadIdx.x; it < n_heads * half; it += blockDim.x) {
        const int h = it / half, i = it % half;
        turn(qt + (size_t)h * hd + lora, neox ? i : 2 * i, neox ? i + half : 2 * i + 1, cs[i],
             sn[i]);
    }
    const int slot = slots[t];
    if (slot < 0) return;
    const size_t row = ((size_t)(slot / page_size) * page_size + slot % page_size) * hd;
    for (int d = threadIdx.x; d < lora; d += blockDim.x)
        tdm_kv_st(kv_base, row + d, kv_t, lat[(size_t)t * lora + d]);
    const float *k = kr + (size_t)t * rd;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        tdm_kv_st(kv_base, row + lora + ia, kv_t, k[ia] * cs[i] - k[ib] * sn[i]);
        tdm_kv_st(kv_base, row + lora + ib, kv_t, k[ia] * sn[i] + k[ib] * cs[i]);
    }
}

__global__ void head_mm_kernel(const uint16_t *w, int n_heads, int R, int C, const float *x,
                               size_t xs, size_t xh, float *out, size_t os, size_t oh)
{
    tdm_pdl_wait();
    const int i = blockIdx.x, j = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const float *xi = x + (size_t)i * xs + (size_t)j * xh;
    for (int r = warp; r < R; r += warps) {
        const uint16_t *wr = w + ((size_t)j * R + r) * (size_t)C;
        float s = 0.0f;
        for (int c = lane; c < C; c += 32)
            s += __uint_as_float((uint32_t)wr[c] << 16) * xi[c];
        for (int o = 16; o > 0; o >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) out[(size_t)i * os + (size_t)j * oh + r] = s;
    }
}

struct mla_args {
    const float *q;
    float *out;
    const void *kv_base;
    int kv_t, n_heads, hd, vd, page_size;
    float scale;
    const int32_t *positions, *token_seq, *seq_kv_len, *seq_page_start, *page_ids;
    const unsigned long long *tree_mask;
    const int32_t *seq_prefix, *tree_node_start, *tree_slots;
};

__global__ void __launch_bounds__(ATT_THREADS) mla_attn_kernel(mla_args a)
{
    tdm_pdl_wait();
    extern __shared__ float sm[];
    float *qs = sm, *sc = sm + a.hd; /* the query row, a chunk's scores */
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int s = a.token_seq[t], hd = a.hd, vd = a.vd, ps = a.page_size;
    float *o = a.out + ((size_t)t * a.n_heads + h) * vd;
    if (a.seq_kv_len[s] <= 0) { /* a padding token */
        for (int d = tid; d < vd; d += ATT_THREADS)
            o[d] = 0.0f;
        return;
    }
    const float *qrow = a.q + ((size_t)t * a.n_heads + h) * hd;
    for (int d = tid; d < hd; d += ATT_THREADS)
        qs[d] = qrow[d] * a.scale;
    const int32_t *pages = a.page_ids + a.seq_page_start[s];
    /* the columns: a chain token sees positions [0, pos] through the page table; a tree token
     * the prefix [0, tp) so, then of the nodes (columns tp ..) those of its mask, from their
     * slots */
    int tp = INT_MAX, n_cols = a.positions[t] + 1;
    const int32_t *nodes = nullptr;
    const unsigned long long mask = a.tree_mask ? a.tree_mask[t] : 0ull;
    if (mask) {
        const int n0 = a.tree_node_start[s];
        tp = a.seq_prefix[s];
        nodes = a.tree_slots + n0;
        n_cols = tp + (a.tree_node_start[s + 1] - n0);
    }
    __syncthreads();
    float m = -INFINITY, sum = 0.0f, acc[ATT_VPT];
    for (int k = 0; k < ATT_VPT; k++)
        acc[k] = 0.0f;
    for (int c0 = 0; c0 < n_cols; c0 += ATT_CHUNK) {
        for (int jj = warp; jj < ATT_CHUNK; jj += ATT_THREADS / 32) {
            const int p = c0 + jj;
            float v = -INFINITY;
            if (p < n_cols && (p < tp || ((mask >> (p - tp)) & 1ull))) {
                const int slot = p < tp ? pages[p / ps] * ps + p % ps : nodes[p - tp];
                const size_t row = (size_t)slot * hd;
                float d = 0.0f;
                for (int e = lane; e < hd; e += 32)
                    d += qs[e] * tdm_kv_ld(a.kv_base, row + e, a.kv_t);
                for (int off = 16; off > 0; off >>= 1)
                    d += __shfl_xor_sync(0xffffffffu, d, off);
                v = d;
            }
            if (lane == 0) sc[jj] = v;
        }
        __syncthreads();
        float cmax = m;
        for (int jj = 0; jj < ATT_CHUNK; jj++)
            cmax = fmaxf(cmax, sc[jj]);
        if (cmax > m) {
            const float alpha = expf(m - cmax); /* 0 on the first chunk */
            sum *= alpha;
            for (int k = 0; k < ATT_VPT; k++)
                acc[k] *= alpha;
            m = cmax;
        }
        for (int jj = 0; jj < ATT_CHUNK; jj++) {
            if (sc[jj] == -INFINITY) continue;
            const int p = c0 + jj;
            const float wgt = expf(sc[jj] - m);
            sum += wgt;
            const int slot = p < tp ? pages[p / ps] * ps + p % ps : nodes[p - tp];
            const size_t row = (size_t)slot * hd;
            for (int k = 0, d = tid; k < ATT_VPT && d < vd; k++, d += ATT_THREADS)
                acc[k] += wgt * tdm_kv_ld(a.kv_base, row + d, a.kv_t);
        }
        __syncthreads();
    }
    for (int k = 0, d = tid; k < ATT_VPT && d < vd; k++, d += ATT_THREADS)
        o[d] = acc[k] / sum;
}

} // namespace

extern "C" void tdm_cu_mla_rope(cudaStream_t s, float *q, const float *lat, const float *kr,
                                int n_heads, int hd, int rot_dim, bool neox, float mscale,
                                const float *inv_freq, const struct tdm_cu_step *st, void *kv_base,
                                int kv_type)
{
    if (st->n_tokens <= 0) return;
    tdm_pdl_launch(mla_rope_kernel, st->n_tokens, 256, (size_t)rot_dim * sizeof(float), s, q, lat,
                   kr, n_heads, hd, rot_dim, neox, mscale, inv_freq, st->positions, st->slots,
                   st->page_size, kv_base, kv_type);
}

extern "C" void tdm_cu_head_matmul(cudaStream_t s, const uint16_t *w, int n_heads, int rows,
                                   int cols, const float *x, int n, size_t x_stride,
                                   size_t x_hstride, float *out, size_t out_stride,
                                   size_t out_hstride)
{
    if (n <= 0) return;
    dim3 grid(n, n_heads);
    tdm_pdl_launch(head_mm_kernel, grid, 256, 0, s, w, n_heads, rows, cols, x, x_stride, x_hstride,
                   out, out_stride, out_hstride);
}

extern "C" bool tdm_cu_mla_attention(cudaStream_t s, const float *q, int n_heads, int hd, int vd,
                                     const struct tdm_cu_step *st, const void *kv_base, int kv_type,
                                     float scale, float *out)
{
    if (vd > ATT_THREADS * ATT_VPT || vd > hd || hd > 1024) return false;
    if (st->n_tokens <= 0) return true;
    mla_args a = {q,
                  out,
                  kv_base,
                  kv_type,
                  n_heads,
                  hd,
                  vd,
                  st->page_size,
                  scale,
                  st->positions,
                  st->token_seq,
                  st->seq_kv_len,
                  st->seq_page_start,
                  st->page_ids,
                  st->tree_mask,
                  st->seq_prefix,
                  st->tree_node_start,
                  st->tree_slots};
    dim3 grid(st->n_tokens, n_heads);
    tdm_pdl_launch(mla_attn_kernel, grid, ATT_THREADS, (size_t)(hd + ATT_CHUNK) * sizeof(float), s,
                   a);
    return true;
}
