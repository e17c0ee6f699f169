/*
 * Small-batch matrix-vector products for decode steps (cuda_kernels.h: tdm_cu_gemv).
 *
 * Decode multiplies a handful of token rows by every weight: the work is reading the weights
 * once, so each warp streams one bf16 weight row with 16-byte loads, eight in flight per lane,
 * against the n bf16 input rows (tiny, served from L1/L2), accumulating in fp32. Several
 * weights that share the input (q, k, v; gate, up) go in one launch: the grid covers their
 * rows end to end. For SwiGLU the warp owning row r reads gate row r and up row r and writes
 * silu(g) * u directly, so neither product goes to memory.
 *
 * Order of operations per (row, token): lane l sums the products of its columns in column
 * order, then the 32 lanes fold by xor-shuffle. Nothing depends on n or on the other rows.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <stdlib.h>

namespace
{

struct gemv_args {
    tdm_cu_gemv_part p[4];
    int row_start[5];
    int n_parts, k;
    const uint16_t *x;
    bool swiglu;
    uint16_t *out_bf16;
};

__device__ __forceinline__ void dot8(const uint4 &w, const uint4 &x, float &acc)
{
    const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, xv[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(__uint_as_float(wv[i] << 16), __uint_as_float(xv[i] << 16), acc);
        acc = fmaf(__uint_as_float(wv[i] & 0xffff0000u), __uint_as_float(xv[i] & 0xffff0000u), acc);
    }
}

constexpr int UNROLL = 8;

template <int N, bool SWIGLU> __global__ void __launch_bounds__(256) gemv_kernel(gemv_args a)
{
    /* programmatic launch (pdl.cuh): the first weight loads go out before the wait for the
     * kernel that produced x (see the main loop) */
    const int row = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32);
    const int lane = threadIdx.x % 32;
    if (row >= a.row_start[a.n_parts]) return;
    int part = 0;
    while (row >= a.row_start[part + 1])
        part++;
    const int r = row - a.row_start[part], k = a.k;
    const uint4 *w = reinterpret_cast<const uint4 *>(a.p[part].w + (size_t)r * k);
    const uint4 *w2 = SWIGLU ? reinterpret_cast<const uint4 *>(a.p[1].w + (size_t)r * k) : nullptr;
    const uint4 *x = reinterpret_cast<const uint4 *>(a.x);
    const int k8 = k / 8;
    float acc[N], acc2[N];
#pragma unroll
    for (int j = 0; j < N; j++)
        acc[j] = acc2[j] = 0.0f;
    int c = lane;
    bool waited = false;
    for (; c + 32 * (UNROLL - 1) < k8; c += 32 * UNROLL) {
        uint4 wv[UNROLL], wv2[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            wv[u] = __ldg(w + c + 32 * u);
            if (SWIGLU) wv2[u] = __ldg(w2 + c + 32 * u);
        }
        if (!waited) {
            tdm_pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
#pragma unroll
            for (int j = 0; j < N; j++) {
                const uint4 xv = __ldg(x + (size_t)j * k8 + c + 32 * u);
                dot8(wv[u], xv, acc[j]);
                if (SWIGLU) dot8(wv2[u], xv, acc2[j]);
            }
    }
    if (!waited) tdm_pdl_wait();
    for (; c < k8; c += 32) {
        const uint4 wv = __ldg(w + c);
        uint4 wv2;
        if (SWIGLU) wv2 = __ldg(w2 + c);
#pragma unroll
        for (int j = 0; j < N; j++) {
            const uint4 xv = __ldg(x + (size_t)j * k8 + c);
            dot8(wv, xv, acc[j]);
            if (SWIGLU) dot8(wv2, xv, acc2[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < N; j++)
        for (int o = 16; o > 0; o >>= 1) {
            acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
            if (SWIGLU) acc2[j] += __shfl_xor_sync(0xffffffffu, acc2[j], o);
        }
    if (lane != 0) return;
    const int m = a.p[part].m;
    float *out = a.p[part].out;
#pragma unroll
    for (int j = 0; j < N; j++) {
        float y;
        if (SWIGLU) {
            const float g = acc[j];
            y = tdm_silu_mul(g, acc2[j]);
        } else {
            y = acc[j] + (a.p[part].bias ? a.p[part].bias[r] : 0.0f);
        }
        out[(size_t)j * m + r] = y;
        if (SWIGLU && a.out_bf16) a.out_bf16[(size_t)j * m + r] = tdm_to_bf16(y);
    }
}

/* The tensor-core form (every part's rows a multiple of 16, k a multiple of 32): a block owns 16
 * weight rows and multiplies them by up to NT * 8 tokens with mma.sync m16n8k16 (bf16 in, fp32
 * accumulation). Each lane loads 16 contiguous bytes of two weight rows and of one token row per
 * 32 columns (the block's 8 warps take interleaved 32-column slices of k and fold their
 * partial sums in shared memory, in warp order); since a dot product may visit its k in any order,
 * the fragments' k slots are mapped onto those contiguous runs (the same map for weights and
 * tokens), so no shuffling or shared memory is needed. Tokens past n read as zeros and are not
 * written. */
template <int NT, bool SWIGLU>
__global__ void __launch_bounds__(256) gemv_mma_kernel(gemv_args a, int n)
{
    tdm_pdl_wait();
    const int tok0 = blockIdx.y * 8 * NT;         /* the block's tile of tokens */
    constexpr int NV = NT * 4 * (SWIGLU ? 2 : 1); /* accumulator values per lane */
    __shared__ float red[8][NV][32];
    const int row0 = blockIdx.x * 16; /* the block's 16 rows; its 8 warps split k */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, rr = lane / 4, q = lane % 4;
    int part = 0;
    while (row0 >= a.row_start[part + 1])
        part++;
    const int r = row0 - a.row_start[part], k = a.k;
    const uint16_t *w0 = a.p[part].w + (size_t)(r + rr) * k + q * 8, *w1 = w0 + (size_t)8 * k;
    const uint16_t *u0 = SWIGLU ? a.p[1].w + (size_t)(r + rr) * k + q * 8 : nullptr;
    const uint16_t *u1 = SWIGLU ? u0 + (size_t)8 * k : nullptr;
    const uint16_t *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
        xr[nt] = tok0 + nt * 8 + rr < n ? a.x + (size_t)(tok0 + nt * 8 + rr) * k + q * 8 : nullptr;
    float c[NT][4], cu[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            c[nt][e] = cu[nt][e] = 0.0f;
#pragma unroll 4
    for (int kk = warp * 32; kk < k; kk += 256) {
        const uint4 A0 = __ldg(reinterpret_cast<const uint4 *>(w0 + kk));
        const uint4 A1 = __ldg(reinterpret_cast<const uint4 *>(w1 + kk));
        uint4 U0, U1;
        if (SWIGLU) {
            U0 = __ldg(reinterpret_cast<const uint4 *>(u0 + kk));
            U1 = __ldg(reinterpret_cast<const uint4 *>(u1 + kk));
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint4 X = xr[nt] ? __ldg(reinterpret_cast<const uint4 *>(xr[nt] + kk))
                                   : make_uint4(0, 0, 0, 0);
            tdm_mma16816(c[nt], A0.x, A1.x, A0.y, A1.y, X.x, X.y);
            tdm_mma16816(c[nt], A0.z, A1.z, A0.w, A1.w, X.z, X.w);
            if (SWIGLU) {
                tdm_mma16816(cu[nt], U0.x, U1.x, U0.y, U1.y, X.x, X.y);
                tdm_mma16816(cu[nt], U0.z, U1.z, U0.w, U1.w, X.z, X.w);
            }
        }
    }
    /* fold the 8 warps' partial sums in warp order */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            red[warp][nt * 4 + e][lane] = c[nt][e];
            if (SWIGLU) red[warp][NT * 4 + nt * 4 + e][lane] = cu[nt][e];
        }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int v = 0; v < NV; v++) {
        float t = red[0][v][lane];
#pragma unroll
        for (int w = 1; w < 8; w++)
            t += red[w][v][lane];
        if (v < NT * 4)
            c[v / 4][v % 4] = t;
        else
            cu[(v - NT * 4) / 4][v % 4] = t;
    }
    const int m = a.p[part].m;
    float *out = a.p[part].out;
    const float *bias = a.p[part].bias;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = tok0 + nt * 8 + q * 2 + (e & 1), row = r + rr + (e >> 1) * 8;
            if (tok >= n) continue;
            float y;
            if (SWIGLU) {
                const float g = c[nt][e];
                y = tdm_silu_mul(g, cu[nt][e]);
            } else {
                y = c[nt][e] + (bias ? bias[row] : 0.0f);
            }
            out[(size_t)tok * m + row] = y;
            if (SWIGLU && a.out_bf16) a.out_bf16[(size_t)tok * m + row] = tdm_to_bf16(y);
        }
}

template <bool SW> void launch(cudaStream_t s, const gemv_args &a, int n, unsigned blocks)
{
    switch (n) {
#define CASE(N)                                                                                    \
    case N:                                                                                        \
        tdm_pdl_launch(gemv_kernel<N, SW>, blocks, 256, 0, s, a);                                  \
        break;
        CASE(1)
        CASE(2)
        CASE(3)
        CASE(4)
        CASE(5)
        CASE(6)
        CASE(7)
        CASE(8)
#undef CASE
    }
}

bool getenv_flag(const char *name)
{
    const char *e = getenv(name);
    return e && *e == '1';
}

} // namespace

template <int NT>
void launch_mma(cudaStream_t s, const gemv_args &a, int n, bool swiglu, unsigned blocks)
{
    const dim3 grid(blocks, (unsigned)((n + 8 * NT - 1) / (8 * NT)));
    if (swiglu)
        tdm_pdl_launch(gemv_mma_kernel<NT, true>, grid, 256, 0, s, a, n);
    else
        tdm_pdl_launch(gemv_mma_kernel<NT, false>, grid, 256, 0, s, a, n);
}

extern "C" bool tdm_cu_gemv(cudaStream_t s, const struct tdm_cu_gemv_part *parts, int n_parts,
                            int k, const uint16_t *x, int n, bool swiglu, uint16_t *out_bf16,
                            bool invariant)
{
    if (n < 1 || (n > TDM_CU_GEMV_MAX_N && !invariant) || n_parts < 1 || n_parts > 4 || k % 8 ||
        k <= 0 || (uintptr_t)x % 16)
        return false;
    if (swiglu && (n_parts != 2 || parts[0].m != parts[1].m)) return false;
    gemv_args a = {};
    a.n_parts = swiglu ? 1 : n_parts;
    a.k = k;
    a.x = x;
    a.swiglu = swiglu;
    a.out_bf16 = out_bf16;
    a.row_start[0] = 0;
    for (int i = 0; i < n_parts; i++) {
        if ((uintptr_t)parts[i].w % 16) return false;
        a.p[i] = parts[i];
    }
    for (int i = 0; i < a.n_parts; i++)
        a.row_start[i + 1] = a.row_start[i] + parts[i].m;
    /* measured on an H200 (bench/RESULTS.md, 2026-11-30): the CUDA-core kernel is faster for
     * one or two tokens (8B shape, batch 1: 5.6 vs 6.1 ms a step), the tensor-core one from three
     * (batch 8: 7.4 vs 11.9 ms); past 8 tokens cuBLASLt wins (batch 16: 8.7 vs 9.7 ms). */
    bool mma_shape = k % 32 == 0;
    for (int i = 0; i < n_parts; i++)
        mma_shape &= parts[i].m % 16 == 0;
    /* batch-invariant: the kernel is chosen by the shape alone, and both kernels give a token's
     * row independently of the tokens beside it (the tensor-core one in tiles of up to 32
     * tokens, the CUDA-core one 8 at a time) */
    const bool mma = mma_shape && (invariant || (n >= 3 && n <= 8));
    if (mma && !getenv_flag("TANDEM_CUDA_GEMV_SIMT")) {
        const unsigned blocks = (unsigned)(a.row_start[a.n_parts] / 16);
        if (n <= 8)
            launch_mma<1>(s, a, n, swiglu, blocks);
        else if (n <= 16)
            launch_mma<2>(s, a, n, swiglu, blocks);
        else
            launch_mma<4>(s, a, n, swiglu, blocks);
        return true;
    }
    if (n > 8 && !invariant) return false;
    const unsigned blocks = (unsigned)((a.row_start[a.n_parts] + 7) / 8);
    for (int j0 = 0; j0 < n; j0 += 8) { /* 8 tokens a launch */
        gemv_args g = a;
        g.x = x + (size_t)j0 * k;
        const int nj = n - j0 < 8 ? n - j0 : 8;
        for (int i = 0; i < g.n_parts + (swiglu ? 1 : 0); i++)
            if (g.p[i].out) g.p[i].out += (size_t)j0 * g.p[i].m;
        if (g.out_bf16) g.out_bf16 += (size_t)j0 * parts[0].m;
        if (swiglu)
            launch<true>(s, g, nj, blocks);
        else
            launch<false>(s, g, nj, blocks);
    }
    return true;
}
