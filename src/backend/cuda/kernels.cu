/*
 * The CUDA backend's element-wise and row kernels: embedding gather, RMSNorm (fused with the
 * residual add, and qwen3's per-head norm), RoPE fused with the paged KV append, SiLU * mul,
 * bias add, fp32 -> bf16 conversion, row gather, the layer-completion store and random fills.
 *
 * Numerics follow the CPU backend (src/backend/cpu) so that the cross-backend op test can hold
 * them to fp32 rounding: the RMS sum of squares runs in double, the scale is rounded to float
 * once and applied as (x * scale) * w; RoPE angles are (float)pos * inv_freq[i] in fp32 with
 * the precise cosf/sinf; silu uses the precise expf.
 *
 * bf16 shadows: a kernel whose output feeds a matmul (the norms, silu_mul) may also write
 * that output as bf16, so the matmul skips a conversion pass (cuda_backend.c tracks which
 * fp32 buffer the shadow belongs to).
 *
 * Threading: all launchers enqueue on the given stream; a row or token is computed whole by
 * one block (or one warp), so results do not depend on the batch.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/kv_elem.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace
{

__device__ __forceinline__ float bf16_to_f32(uint16_t h)
{
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t f32_to_bf16(float f)
{
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&b);
}

unsigned grid_for(size_t n, unsigned block)
{
    size_t g = (n + block - 1) / block;
    return (unsigned)(g > 65535u * 16u ? 65535u * 16u : (g ? g : 1));
}

__global__ void embed_kernel(const uint16_t *emb, int64_t cols, const int32_t *tokens, float *out,
                             uint16_t *out_bf16)
{
    tdm_pdl_wait();
    const int i = blockIdx.x;
    const uint16_t *row = emb + (size_t)tokens[i] * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        const uint16_t h = row[c];
        out[(size_t)i * cols + c] = bf16_to_f32(h);
        if (out_bf16) out_bf16[(size_t)i * cols + c] = h;
    }
}

/* Block-wide sum in double; every thread gets the result. */
template <int BLOCK> __device__ double block_sum(double v)
{
    __shared__ double part[BLOCK / 32];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (BLOCK == 32) return v;
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) part[w] = v;
    __syncthreads();
    double t = 0;
    for (int i = 0; i < BLOCK / 32; i++)
        t += part[i];
    return t;
}

template <int BLOCK>
__global__ void rmsnorm_kernel(float *res, const float *add, const float *w, float eps, int dim,
                               float *out, uint16_t *out_bf16)
{
    tdm_pdl_wait();
    const size_t off = (size_t)blockIdx.x * dim;
    float *r = res + off;
    double ss = 0;
    for (int j = threadIdx.x; j < dim; j += BLOCK) {
        float x = r[j];
        if (add) {
            x += add[off + j];
            r[j] = x;
        }
        ss += (double)x * (double)x;
    }
    ss = block_sum<BLOCK>(ss);
    const float scale = (float)(1.0 / sqrt(ss / (double)dim + (double)eps));
    for (int j = threadIdx.x; j < dim; j += BLOCK) {
        const float y = (r[j] * scale) * w[j];
        out[off + j] = y;
        if (out_bf16) out_bf16[off + j] = f32_to_bf16(y);
    }
}

__global__ void f32_to_bf16_kernel(const float *x, size_t n, uint16_t *out, bool vec)
{
    tdm_pdl_wait();
    const size_t n4 = vec ? n / 4 : 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4;
         i += (size_t)gridDim.x * blockDim.x) {
        const float4 v = reinterpret_cast<const float4 *>(x)[i];
        ushort4 o;
        o.x = f32_to_bf16(v.x);
        o.y = f32_to_bf16(v.y);
        o.z = f32_to_bf16(v.z);
        o.w = f32_to_bf16(v.w);
        reinterpret_cast<ushort4 *>(out)[i] = o;
    }
    for (size_t i = n4 * 4 + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

__global__ void add_bias_kernel(float *out, const float *bias, size_t n, int rows)
{
    tdm_pdl_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] += bias[i % rows];
}

__global__ void silu_mul_kernel(const float *g, const float *u, size_t n, float *out,
                                uint16_t *out_bf16)
{
    tdm_pdl_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = g[i];
        const float y = tdm_silu_mul(x, u[i]);
        out[i] = y;
        if (out_bf16) out_bf16[i] = f32_to_bf16(y);
    }
}

/* silu_mul_kernel on bf16 gate and up (GEMM outputs rounded by cuBLASLt): eight elements a
 * thread, one 16-byte load of each (vec: every pointer 16-byte aligned); the rest a thread an
 * element */
__global__ void silu_mul_bf16_kernel(const uint16_t *g, const uint16_t *u, size_t n, float *out,
                                     uint16_t *out_bf16, bool vec)
{
    tdm_pdl_wait();
    const size_t n8 = vec ? n / 8 : 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8 + (n - 8 * n8);
         i += (size_t)gridDim.x * blockDim.x) {
        if (i >= n8) {
            const size_t j = 8 * n8 + (i - n8);
            const float x = bf16_to_f32(g[j]);
            const float y = tdm_silu_mul(x, bf16_to_f32(u[j]));
            out[j] = y;
            if (out_bf16) out_bf16[j] = f32_to_bf16(y);
            continue;
        }
        const uint4 gv = ((const uint4 *)g)[i], uv = ((const uint4 *)u)[i];
        const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
        float y[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float x = bf16_to_f32((uint16_t)(gw[e / 2] >> (16 * (e % 2))));
            y[e] = tdm_silu_mul(x, bf16_to_f32((uint16_t)(uw[e / 2] >> (16 * (e % 2)))));
        }
        float4 *o = (float4 *)(out + 8 * i);
        o[0] = make_float4(y[0], y[1], y[2], y[3]);
        o[1] = make_float4(y[4], y[5], y[6], y[7]);
        if (out_bf16) {
            uint32_t b[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                b[e] = (uint32_t)f32_to_bf16(y[2 * e]) | (uint32_t)f32_to_bf16(y[2 * e + 1]) << 16;
            ((uint4 *)out_bf16)[i] = make_uint4(b[0], b[1], b[2], b[3]);
        }
    }
}

__global__ void add_kernel(float *x, const float *y, size_t n)
{
    tdm_pdl_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

/* Rank order, one float at a time: the sum is the same whichever rank computes it. Not a
 * PDL launch: it follows waits on other streams' events. */
__global__ void tp_sum_kernel(tdm_cu_tp_srcs src, float *x, size_t n)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float acc = src.p[0][i];
        for (int r = 1; r < src.n; r++)
            acc += src.p[r][i];
        x[i] = acc;
    }
}

__global__ void gather_kernel(const float *x, const int32_t *rows, int dim, float *out)
{
    tdm_pdl_wait();
    const float *src = x + (size_t)rows[blockIdx.x] * dim;
    float *dst = out + (size_t)blockIdx.x * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        dst[j] = src[j];
}

/* out[rows[i]] += w[i] * x[i]: block i, rows distinct (a mixture-of-experts layer's expert) */
__global__ void rows_scale_add_kernel(const float *x, const int32_t *rows, const float *w, int dim,
                                      float *out)
{
    tdm_pdl_wait();
    const float *src = x + (size_t)blockIdx.x * dim;
    float *dst = out + (size_t)rows[blockIdx.x] * dim;
    const float wi = w[blockIdx.x];
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        dst[j] += wi * src[j];
}

__global__ void scatter_cols_kernel(const float *x, const int32_t *cols, int n_cols, int width,
                                    float *out)
{
    tdm_pdl_wait();
    float *o = out + (size_t)blockIdx.x * width;
    const float *xr = x + (size_t)blockIdx.x * n_cols;
    for (int j = threadIdx.x; j < width; j += blockDim.x)
        o[j] = -INFINITY;
    __syncthreads();
    for (int c = threadIdx.x; c < n_cols; c += blockDim.x)
        o[cols[c]] = xr[c];
}

__device__ __forceinline__ void rotate_pair(float *x, int ia, int ib, float c, float s)
{
    const float a = x[ia], b = x[ib];
    x[ia] = a * c - b * s;
    x[ib] = a * s + b * c;
}

/* One block per token: the token's angles go to shared memory, then every (head, pair) of q and
 * k is rotated and k, v are stored at the token's KV slot. */
__global__ void rope_kv_kernel(float *q, const float *k, const float *v, int n_heads, int nkv,
                               int hd, bool neox, const float *inv_freq, const int32_t *positions,
                               const int32_t *slots, int page_size, void *kv_base, int kv_t)
{
    tdm_pdl_wait();
    extern __shared__ float sm[];
    float *cs = sm, *sn = sm + hd / 2;
    const int t = blockIdx.x, half = hd / 2;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float ang = pos * inv_freq[i];
        cs[i] = cosf(ang);
        sn[i] = sinf(ang);
    }
    __syncthreads();
    float *qt = q + (size_t)t * n_heads * hd;
    for (int it = threadIdx.x; it < n_heads * half; it += blockDim.x) {
        const int h = it / half, i = it % half;
        rotate_pair(qt + (size_t)h * hd, neox ? i : 2 * i, neox ? i + half : 2 * i + 1, cs[i],
                    sn[i]);
    }
    const int slot = slots[t];
    if (slot < 0) return;
    const int64_t page = slot / page_size, off = slot % page_size;
    /* element offsets of the page's K and V */
    const size_t kpage = (size_t)page * 2 * nkv * page_size * hd;
    const size_t vpage = kpage + (size_t)nkv * page_size * hd;
    const float *kt = k + (size_t)t * nkv * hd, *vt = v + (size_t)t * nkv * hd;
    for (int it = threadIdx.x; it < nkv * half; it += blockDim.x) {
        const int g = it / half, i = it % half;
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float a = kt[(size_t)g * hd + ia], b = kt[(size_t)g * hd + ib];
        const size_t dst = kpage + ((size_t)g * page_size + off) * hd;
        tdm_kv_st(kv_base, dst + ia, kv_t, a * cs[i] - b * sn[i]);
        tdm_kv_st(kv_base, dst + ib, kv_t, a * sn[i] + b * cs[i]);
    }
    for (int it = threadIdx.x; it < nkv * hd; it += blockDim.x) {
        const int g = it / hd, d = it % hd;
        tdm_kv_st(kv_base, vpage + ((size_t)g * page_size + off) * hd + d, kv_t, vt[it]);
    }
}

__global__ void store_counter_kernel(int32_t *counter, int32_t value)
{
    tdm_pdl_wait();
    /* the kernels before this one on the stream have completed (stream order, or the wait
     * above under programmatic launch); the fence makes their global writes visible
     * system-wide before the counter moves */
    __threadfence_system();
    *(volatile int32_t *)counter = value;
    __threadfence_system();
}

__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

__global__ void fill_bf16_kernel(uint16_t *out, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(lo + (hi - lo) * hash_uniform(seed, i));
}

__global__ void fill_f16_kernel(uint16_t *out, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        __half h = __float2half_rn(lo + (hi - lo) * hash_uniform(seed, i));
        out[i] = *reinterpret_cast<uint16_t *>(&h);
    }
}

__global__ void fill_bytes_kernel(uint8_t *out, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = (uint8_t)(hash_uniform(seed, i) * 256.0f);
}

__global__ void fill_f32_kernel(float *out, size_t n, uint64_t seed, float lo, float hi)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = lo + (hi - lo) * hash_uniform(seed, i);
}

} // namespace

extern "C" {

void tdm_cu_embed(cudaStream_t s, const uint16_t *emb, int64_t cols, const int32_t *tokens, int n,
                  float *out, uint16_t *out_bf16)
{
    if (n <= 0) return;
    tdm_pdl_launch(embed_kernel, n, 256, 0, s, emb, cols, tokens, out, out_bf16);
}

void tdm_cu_rmsnorm(cudaStream_t s, float *res, const float *add, const float *w, float eps, int n,
                    int dim, float *out, uint16_t *out_bf16, bool invariant)
{
    if (n <= 0 || dim <= 0) return;
    /* a decode step has a few long rows: a wide block per row shortens each thread's serial
     * loop (the kernel is latency-bound there); many rows get narrower blocks. The block width
     * sets the order of a row's sum, so batch-invariant runs take it from dim alone. */
    if (dim <= 512)
        tdm_pdl_launch(rmsnorm_kernel<32>, n, 32, 0, s, res, add, w, eps, dim, out, out_bf16);
    else if ((n <= 64 || invariant) && dim >= 2048)
        tdm_pdl_launch(rmsnorm_kernel<1024>, n, 1024, 0, s, res, add, w, eps, dim, out, out_bf16);
    else
        tdm_pdl_launch(rmsnorm_kernel<256>, n, 256, 0, s, res, add, w, eps, dim, out, out_bf16);
}

void tdm_cu_f32_to_bf16(cudaStream_t s, const float *x, size_t n, uint16_t *out)
{
    if (!n) return;
    if ((uintptr_t)x % 16 || (uintptr_t)out % 8) /* the vector path needs aligned rows */
        tdm_pdl_launch(f32_to_bf16_kernel, grid_for(n, 256), 256, 0, s, x, n, out, false);
    else
        tdm_pdl_launch(f32_to_bf16_kernel, grid_for(n / 4 + 1, 256), 256, 0, s, x, n, out, true);
}

void tdm_cu_add_bias(cudaStream_t s, float *out, const float *bias, int n, int rows)
{
    const size_t total = (size_t)n * rows;
    if (!total) return;
    tdm_pdl_launch(add_bias_kernel, grid_for(total, 256), 256, 0, s, out, bias, total, rows);
}

void tdm_cu_silu_mul(cudaStream_t s, const float *gate, const float *up, size_t n, float *out,
                     uint16_t *out_bf16)
{
    if (!n) return;
    tdm_pdl_launch(silu_mul_kernel, grid_for(n, 256), 256, 0, s, gate, up, n, out, out_bf16);
}

void tdm_cu_silu_mul_bf16(cudaStream_t s, const uint16_t *gate, const uint16_t *up, size_t n,
                          float *out, uint16_t *out_bf16)
{
    if (!n) return;
    const bool vec =
        !(((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out | (uintptr_t)out_bf16) % 16);
    const size_t threads = vec ? n / 8 + n % 8 : n;
    tdm_pdl_launch(silu_mul_bf16_kernel, grid_for(threads, 256), 256, 0, s, gate, up, n, out,
                   out_bf16, vec);
}

void tdm_cu_add(cudaStream_t s, float *x, const float *y, size_t n)
{
    if (!n) return;
    tdm_pdl_launch(add_kernel, grid_for(n, 256), 256, 0, s, x, y, n);
}

void tdm_cu_tp_sum(cudaStream_t s, const struct tdm_cu_tp_srcs *src, float *x, size_t n)
{
    if (!n) return;
    tp_sum_kernel<<<grid_for(n, 256), 256, 0, s>>>(*src, x, n);
}

void tdm_cu_gather_rows(cudaStream_t s, const float *x, const int32_t *rows, int n, int dim,
                        float *out)
{
    if (n <= 0 || dim <= 0) return;
    tdm_pdl_launch(gather_kernel, n, 256, 0, s, x, rows, dim, out);
}

void tdm_cu_rows_scale_add(cudaStream_t s, const float *x, const int32_t *rows, const float *w,
                           int n, int dim, float *out)
{
    if (n <= 0 || dim <= 0) return;
    tdm_pdl_launch(rows_scale_add_kernel, n, 256, 0, s, x, rows, w, dim, out);
}

void tdm_cu_scatter_cols(cudaStream_t s, const float *x, const int32_t *cols, int n, int n_cols,
                         int width, float *out)
{
    if (n <= 0 || width <= 0) return;
    tdm_pdl_launch(scatter_cols_kernel, n, 256, 0, s, x, cols, n_cols, width, out);
}

void tdm_cu_rope_kv_append(cudaStream_t s, float *q, const float *k, const float *v, int n_heads,
                           int n_kv_heads, int hd, bool neox, const float *inv_freq,
                           const struct tdm_cu_step *st, void *kv_base, int kv_type)
{
    if (st->n_tokens <= 0) return;
    /* few tokens (decode): wide blocks, as for the norms */
    const int threads = st->n_tokens <= 64 ? 1024 : 256;
    tdm_pdl_launch(rope_kv_kernel, st->n_tokens, threads, (size_t)hd * sizeof(float), s, q, k, v,
                   n_heads, n_kv_heads, hd, neox, inv_freq, st->positions, st->slots, st->page_size,
                   kv_base, kv_type);
}

void tdm_cu_store_counter(cudaStream_t s, int32_t *counter, int32_t value)
{
    tdm_pdl_launch(store_counter_kernel, 1, 1, 0, s, counter, value);
}

void tdm_cu_fill_uniform_bf16(cudaStream_t s, uint16_t *out, size_t n, uint64_t seed, float lo,
                              float hi)
{
    if (n) fill_bf16_kernel<<<grid_for(n, 256), 256, 0, s>>>(out, n, seed, lo, hi);
}

void tdm_cu_fill_uniform_f16(cudaStream_t s, uint16_t *out, size_t n, uint64_t seed, float lo,
                             float hi)
{
    if (n) fill_f16_kernel<<<grid_for(n, 256), 256, 0, s>>>(out, n, seed, lo, hi);
}

void tdm_cu_fill_bytes(cudaStream_t s, void *out, size_t n, uint64_t seed)
{
    if (n) fill_bytes_kernel<<<grid_for(n, 256), 256, 0, s>>>((uint8_t *)out, n, seed);
}

void tdm_cu_fill_uniform_f32(cudaStream_t s, float *out, size_t n, uint64_t seed, float lo,
                             float hi)
{
    if (n) fill_f32_kernel<<<grid_for(n, 256), 256, 0, s>>>(out, n, seed, lo, hi);
}

} // extern "C"
