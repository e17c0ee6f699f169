/*
 * Quantised weights kept in their blocks on the device (cuda_kernels.h: tdm_cu_qgemv,
 * tdm_cu_qdequant, tdm_cu_qembed; the layout is qweight.h's).
 *
 * Matrix-vector products (up to TDM_CU_QGEMV_MAX_N tokens): a block owns 16 weight rows and a
 * tile of 8 * NT tokens; its 8 warps take interleaved 64-column chunks of k. Per chunk a lane
 * loads its 8 (4-bit) or 16 (8-bit) bytes of two rows, r and r + 8, and turns them into bf16
 * operands in registers: the stored integers, which bf16 holds exactly (|q| <= 128), never the
 * scaled values. A 4-bit nibble q becomes the bf16 number 128 + q by placing it under the
 * exponent byte 0x43 (__byte_perm), then the kind's offset is subtracted in bf16, exactly. Each
 * 32-column group (16 for Q6_K) is one or two mma.sync m16n8k16 products into a fresh
 * accumulator, which is then scaled by the group's scale in fp32 and added to the running sum;
 * kinds with a minimum (Q4_1, Q4_K) add min * sum(x over the group), the sum taken from the
 * same bf16 inputs. So the weights are exactly the file's, and the only rounding besides fp32
 * accumulation is the activations' to bf16, as on the bf16 path.
 *
 * Order of operations per (row, token): chunks in warp order, groups in column order, the
 * eight warps' sums folded in warp order. Nothing depends on n or on the other tokens (the
 * tensor cores sum each output column on its own), so a row's product is the same at any
 * batch up to TDM_CU_QGEMV_MAX_N, and matmul_multi and matmul_swiglu give matmul's bits.
 *
 * Larger batches (prefill) dequantise row chunks to bf16 (tdm_cu_qdequant) for cuBLASLt.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace
{

struct qargs {
    tdm_cu_qgemv_part p[4];
    int blk_start[5]; /* first 16-row block of each part */
    int n_parts, k, n;
    const uint16_t *x;
    uint16_t *out_bf16;
};

__device__ __forceinline__ float bf_lo(uint32_t v)
{
    return __uint_as_float(v << 16);
}
__device__ __forceinline__ float bf_hi(uint32_t v)
{
    return __uint_as_float(v & 0xffff0000u);
}

__device__ __forceinline__ uint32_t bsub(uint32_t a, uint32_t b)
{
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162 *>(&a);
    __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162 *>(&b);
    __nv_bfloat162 r = __hsub2(x, y);
    return *reinterpret_cast<uint32_t *>(&r);
}

/* four small unsigned integers (one a byte, each < 128) as two bf16 pairs, minus `off` */
__device__ __forceinline__ void u8x4_to_bf16(uint32_t v, uint32_t off2, uint32_t &p01,
                                             uint32_t &p23)
{
    p01 = bsub(__byte_perm(v, 0x43434343u, 0x4140), off2);
    p23 = bsub(__byte_perm(v, 0x43434343u, 0x4342), off2);
}

/* four int8 as two bf16 pairs */
__device__ __forceinline__ void i8x4_to_bf16(uint32_t v, uint32_t &p01, uint32_t &p23)
{
    const float f0 = (float)(int8_t)(v & 0xff), f1 = (float)(int8_t)((v >> 8) & 0xff);
    const float f2 = (float)(int8_t)((v >> 16) & 0xff), f3 = (float)(int8_t)(v >> 24);
    __nv_bfloat162 a = __floats2bfloat162_rn(f0, f1), b = __floats2bfloat162_rn(f2, f3);
    p01 = *reinterpret_cast<uint32_t *>(&a);
    p23 = *reinterpret_cast<uint32_t *>(&b);
}

/* bf16 bits of 128 + off, twice */
__host__ __device__ constexpr uint32_t off2_of(int kind)
{
    return kind == TDM_CU_Q4_0   ? 0x43084308u  /* 136: q - 8 */
           : kind == TDM_CU_Q6_K ? 0x43204320u  /* 160: q - 32 */
                                 : 0x43004300u; /* 128: q */
}

/* What one lane loads of one row and one 64-column chunk, before any arithmetic: its weight
 * bytes, and the raw scales of the chunk's two groups (qweight.h's arrays), so that the loads of
 * several chunks can all be in flight before the first is used. */
template <int KIND> struct raw {
    uint4 w;     /* Q8_0: 16 bytes; 4-bit kinds: .x, .y (8 bytes) */
    uint32_t qh; /* Q6_K: the high bits */
    uint2 s;     /* group scales: Q8_0, Q4_0 two halves in .x; Q4_1 two half2; Q4_K (sc, mn) x2 in
                  * .x and (d, dmin) in .y; Q6_K four int8 scales in .x and d in .y */
};

template <int KIND>
__device__ __forceinline__ void load_raw(const tdm_cu_qgemv_part &p, int k, int row, int c, int t,
                                         raw<KIND> &r)
{
    const size_t g = (size_t)row * (k / 32) + 2 * c; /* the chunk's first 32-column group */
    if (KIND == TDM_CU_Q8_0) {
        r.w = __ldg(reinterpret_cast<const uint4 *>(p.q + (size_t)row * k + 64 * c + 16 * t));
    } else {
        const uint2 w =
            __ldg(reinterpret_cast<const uint2 *>(p.q + (size_t)row * (k / 2) + 32 * c + 8 * t));
        r.w.x = w.x, r.w.y = w.y;
    }
    if (KIND == TDM_CU_Q6_K)
        r.qh = __ldg(
            reinterpret_cast<const uint32_t *>(p.qh + (size_t)row * (k / 4) + 16 * c + 4 * t));
    if (KIND == TDM_CU_Q8_0 || KIND == TDM_CU_Q4_0) {
        r.s.x = __ldg(reinterpret_cast<const uint32_t *>(p.s + g * 2));
    } else if (KIND == TDM_CU_Q4_1) {
        r.s = __ldg(reinterpret_cast<const uint2 *>(p.s + g * 4));
    } else if (KIND == TDM_CU_Q4_K) {
        r.s.x = __ldg(reinterpret_cast<const uint32_t *>(p.s + g * 2));
        r.s.y =
            __ldg(reinterpret_cast<const uint32_t *>(p.dd + ((size_t)row * (k / 256) + c / 4) * 4));
    } else if (KIND == TDM_CU_Q6_K) {
        r.s.x = __ldg(reinterpret_cast<const uint32_t *>(p.s + (size_t)row * (k / 16) + 4 * c));
        r.s.y = __ldg(reinterpret_cast<const uint16_t *>(p.dd) + (size_t)row * (k / 256) + c / 4);
    }
}

__device__ __forceinline__ float half_bits(uint32_t h)
{
    return __half2float(__ushort_as_half((unsigned short)(h & 0xffffu)));
}

/* The operands of (gi, h): a[0] = columns (4t, 4t+1), a[1] = (4t+2, 4t+3), as bf16 pairs of
 * stored integers (minus the kind's offset). */
template <int KIND>
__device__ __forceinline__ void operands(const raw<KIND> &r, int gi, int h, uint32_t &a0,
                                         uint32_t &a1)
{
    if (KIND == TDM_CU_Q8_0) {
        const uint32_t words[4] = {r.w.x, r.w.y, r.w.z, r.w.w};
        i8x4_to_bf16(words[2 * gi + h], a0, a1);
    } else {
        uint32_t v = ((gi ? r.w.y : r.w.x) >> (4 * h)) & 0x0F0F0F0Fu;
        if (KIND == TDM_CU_Q6_K) v |= ((r.qh >> (2 * (2 * gi + h))) & 0x03030303u) << 4;
        u8x4_to_bf16(v, off2_of(KIND), a0, a1);
    }
}

/* group gi's scale and minimum (Q6_K: the scale of its half h) */
template <int KIND>
__device__ __forceinline__ void scale_of(const raw<KIND> &r, int gi, int h, float &s, float &mn)
{
    mn = 0.0f;
    if (KIND == TDM_CU_Q8_0 || KIND == TDM_CU_Q4_0) {
        s = half_bits(r.s.x >> (16 * gi));
    } else if (KIND == TDM_CU_Q4_1) {
        const uint32_t dm = gi ? r.s.y : r.s.x;
        s = half_bits(dm);
        mn = half_bits(dm >> 16);
    } else if (KIND == TDM_CU_Q4_K) {
        const uint32_t sm = r.s.x >> (16 * gi);
        s = half_bits(r.s.y) * (float)(sm & 0xff);
        mn = -(half_bits(r.s.y >> 16) * (float)((sm >> 8) & 0xff));
    } else if (KIND == TDM_CU_Q6_K) {
        s = half_bits(r.s.y) * (float)(int8_t)((r.s.x >> (8 * (2 * gi + h))) & 0xff);
    }
}

constexpr bool has_min(int kind)
{
    return kind == TDM_CU_Q4_1 || kind == TDM_CU_Q4_K;
}

/* Adds one 64-column chunk of rows ra (A) and rb (B) times NT token tiles into acc. */
template <int KIND, int NT>
__device__ __forceinline__ void chunk_mma(const raw<KIND> &A, const raw<KIND> &B,
                                          const uint2 (&X)[NT][2][2], const float (&sx)[NT][2][2],
                                          float (&acc)[NT][4])
{
#pragma unroll
    for (int gi = 0; gi < 2; gi++) {
        uint32_t a[2][2], b[2][2];
        operands<KIND>(A, gi, 0, a[0][0], a[0][1]);
        operands<KIND>(A, gi, 1, a[1][0], a[1][1]);
        operands<KIND>(B, gi, 0, b[0][0], b[0][1]);
        operands<KIND>(B, gi, 1, b[1][0], b[1][1]);
        if (KIND == TDM_CU_Q6_K) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float sa, sb, m_;
                scale_of<KIND>(A, gi, h, sa, m_);
                scale_of<KIND>(B, gi, h, sb, m_);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    float ct[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    tdm_mma16816(ct, a[h][0], b[h][0], a[h][1], b[h][1], X[nt][gi][h].x,
                                 X[nt][gi][h].y);
                    acc[nt][0] = fmaf(sa, ct[0], acc[nt][0]);
                    acc[nt][1] = fmaf(sa, ct[1], acc[nt][1]);
                    acc[nt][2] = fmaf(sb, ct[2], acc[nt][2]);
                    acc[nt][3] = fmaf(sb, ct[3], acc[nt][3]);
                }
            }
        } else {
            float sa, ma, sb, mb;
            scale_of<KIND>(A, gi, 0, sa, ma);
            scale_of<KIND>(B, gi, 0, sb, mb);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float ct[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                tdm_mma16816(ct, a[0][0], b[0][0], a[0][1], b[0][1], X[nt][gi][0].x,
                             X[nt][gi][0].y);
                tdm_mma16816(ct, a[1][0], b[1][0], a[1][1], b[1][1], X[nt][gi][1].x,
                             X[nt][gi][1].y);
                acc[nt][0] = fmaf(sa, ct[0], acc[nt][0]);
                acc[nt][1] = fmaf(sa, ct[1], acc[nt][1]);
                acc[nt][2] = fmaf(sb, ct[2], acc[nt][2]);
                acc[nt][3] = fmaf(sb, ct[3], acc[nt][3]);
                if (has_min(KIND)) {
                    acc[nt][0] = fmaf(ma, sx[nt][gi][0], acc[nt][0]);
                    acc[nt][1] = fmaf(ma, sx[nt][gi][1], acc[nt][1]);
                    acc[nt][2] = fmaf(mb, sx[nt][gi][0], acc[nt][2]);
                    acc[nt][3] = fmaf(mb, sx[nt][gi][1], acc[nt][3]);
                }
            }
        }
    }
}

/* chunks whose loads a warp puts in flight together */
constexpr int UNROLL = 4;

/* grid: (16-row blocks of all parts, token tiles of 8 * NT). SWIGLU: parts 0 (gate) and 1 (up)
 * of equal rows, one block reads both. Each warp takes chunks warp, warp + 8, ...: UNROLL of
 * them a round, every load of the round issued before the first product. */
template <int KIND, int NT, bool SWIGLU>
__global__ void __launch_bounds__(256) qgemv_kernel(qargs a)
{
    constexpr int NV = NT * 4 * (SWIGLU ? 2 : 1);
    __shared__ float red[8][NV][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int blk = blockIdx.x;
    int part = 0;
    while (blk >= a.blk_start[part + 1])
        part++;
    const tdm_cu_qgemv_part &P = a.p[part];
    const int m = P.m, k = a.k, r0 = (blk - a.blk_start[part]) * 16;
    const int ra = min(r0 + g, m - 1), rb = min(r0 + g + 8, m - 1);
    const int tok0 = blockIdx.y * 8 * NT;
    const uint16_t *xr[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int tok = tok0 + nt * 8 + g;
        xr[nt] = tok < a.n ? a.x + (size_t)tok * k : nullptr;
    }
    float acc[NT][4], accu[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[nt][e] = accu[nt][e] = 0.0f;
    const int n_chunks = k / 64;
    bool waited = false;
    for (int c0 = warp; c0 < n_chunks; c0 += 8 * UNROLL) {
        raw<KIND> A[UNROLL], B[UNROLL], AU[UNROLL], BU[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = min(c0 + 8 * u, n_chunks - 1); /* past the end: loaded, not used */
            load_raw<KIND>(P, k, ra, c, t, A[u]);
            load_raw<KIND>(P, k, rb, c, t, B[u]);
            if (SWIGLU) {
                load_raw<KIND>(a.p[1], k, ra, c, t, AU[u]);
                load_raw<KIND>(a.p[1], k, rb, c, t, BU[u]);
            }
        }
        if (!waited) { /* the weights are ours; x is the kernel before's (pdl.cuh) */
            tdm_pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int c = c0 + 8 * u;
            if (c >= n_chunks) break;
            uint2 X[NT][2][2];
            float sx[NT][2][2];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int gi = 0; gi < 2; gi++) {
                    float own = 0.0f;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        X[nt][gi][h] = xr[nt] ? __ldg(reinterpret_cast<const uint2 *>(
                                                    xr[nt] + 64 * c + 32 * gi + 16 * h + 4 * t))
                                              : make_uint2(0, 0);
                        if (has_min(KIND))
                            own += (bf_lo(X[nt][gi][h].x) + bf_hi(X[nt][gi][h].x)) +
                                   (bf_lo(X[nt][gi][h].y) + bf_hi(X[nt][gi][h].y));
                    }
                    if (has_min(KIND)) {
                        /* the group's sum for token g, then the two tokens this lane's C holds */
                        own += __shfl_xor_sync(0xffffffffu, own, 1);
                        own += __shfl_xor_sync(0xffffffffu, own, 2);
                        sx[nt][gi][0] = __shfl_sync(0xffffffffu, own, 8 * t);
                        sx[nt][gi][1] = __shfl_sync(0xffffffffu, own, 8 * t + 4);
                    } else {
                        sx[nt][gi][0] = sx[nt][gi][1] = 0.0f;
                    }
                }
            }
            chunk_mma<KIND, NT>(A[u], B[u], X, sx, acc);
            if (SWIGLU) chunk_mma<KIND, NT>(AU[u], BU[u], X, sx, accu);
        }
    }
    if (!waited) tdm_pdl_wait();
        /* fold the 8 warps' partial sums in warp order */
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            red[warp][nt * 4 + e][lane] = acc[nt][e];
            if (SWIGLU) red[warp][NT * 4 + nt * 4 + e][lane] = accu[nt][e];
        }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int v = 0; v < NV; v++) {
        float s = red[0][v][lane];
#pragma unroll
        for (int w = 1; w < 8; w++)
            s += red[w][v][lane];
        if (v < NT * 4)
            acc[v / 4][v % 4] = s;
        else
            accu[(v - NT * 4) / 4][v % 4] = s;
    }
    float *out = P.out;
    const float *bias = P.bias;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int tok = tok0 + nt * 8 + 2 * t + (e & 1), row = r0 + g + (e >> 1) * 8;
            if (tok >= a.n || row >= m) continue;
            float y;
            if (SWIGLU) {
                const float gv = acc[nt][e];
                y = (gv / (1.0f + expf(-gv))) * accu[nt][e];
            } else {
                y = acc[nt][e] + (bias ? bias[row] : 0.0f);
            }
            out[(size_t)tok * m + row] = y;
            if (SWIGLU && a.out_bf16) a.out_bf16[(size_t)tok * m + row] = tdm_to_bf16(y);
        }
}

/* element (row, col) of a packed matrix (qweight.h), as a float: the same loads and scale
 * arithmetic as the matrix-vector kernel, one element at a time */
template <int KIND>
__device__ __forceinline__ float qelem(const tdm_cu_qgemv_part &p, int k, int row, int col)
{
    const int c = col / 64, r = col % 64, gi = r / 32, h = (r / 16) % 2, t = (r / 4) % 4, b = r % 4;
    raw<KIND> w;
    load_raw<KIND>(p, k, row, c, t, w);
    float s, mn;
    scale_of<KIND>(w, gi, h, s, mn);
    if (KIND == TDM_CU_Q8_0) {
        const uint32_t words[4] = {w.w.x, w.w.y, w.w.z, w.w.w};
        return s * (float)(int8_t)((words[2 * gi + h] >> (8 * b)) & 0xff);
    }
    int q = (int)((((gi ? w.w.y : w.w.x) >> (4 * h)) >> (8 * b)) & 0x0F);
    if (KIND == TDM_CU_Q6_K)
        return s * (float)((q | (int)((w.qh >> (8 * b + 2 * (2 * gi + h))) & 3) << 4) - 32);
    if (KIND == TDM_CU_Q4_0) return s * (float)(q - 8);
    return s * (float)q + mn;
}

/* out[i][col] (bf16) = row r0 + i of the matrix */
template <int KIND>
__global__ void qdequant_kernel(tdm_cu_qgemv_part p, int k, int r0, int n_rows, uint16_t *out)
{
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)n_rows * k) return;
    const int row = (int)(i / k), col = (int)(i % k);
    out[i] = tdm_to_bf16(qelem<KIND>(p, k, r0 + row, col));
}

/* out[i] = row tokens[i] as fp32 */
template <int KIND>
__global__ void qembed_kernel(tdm_cu_qgemv_part p, int k, const int32_t *tokens, float *out)
{
    const int i = blockIdx.x, row = tokens[i];
    for (int col = threadIdx.x; col < k; col += blockDim.x)
        out[(size_t)i * k + col] = qelem<KIND>(p, k, row, col);
}

template <int KIND, int NT>
void launch_nt(cudaStream_t s, const qargs &a, bool swiglu, unsigned blocks)
{
    const dim3 grid(blocks, (unsigned)((a.n + 8 * NT - 1) / (8 * NT)));
    if (swiglu)
        tdm_pdl_launch(qgemv_kernel<KIND, NT, true>, grid, 256, 0, s, a);
    else
        tdm_pdl_launch(qgemv_kernel<KIND, NT, false>, grid, 256, 0, s, a);
}

template <int KIND> void launch_kind(cudaStream_t s, const qargs &a, bool swiglu, unsigned blocks)
{
    if (a.n <= 8)
        launch_nt<KIND, 1>(s, a, swiglu, blocks);
    else if (a.n <= 16)
        launch_nt<KIND, 2>(s, a, swiglu, blocks);
    else
        launch_nt<KIND, 4>(s, a, swiglu, blocks);
}

/* Calls f with the kind as a compile-time constant (std::integral_constant-like), for the kernels
 * templated on it; false for a kind with no kernel. */
template <int K> struct kind_c {
    static constexpr int value = K;
};
template <class F> bool with_kind(int kind, F f)
{
    switch (kind) {
    case TDM_CU_Q8_0:
        f(kind_c<TDM_CU_Q8_0>());
        return true;
    case TDM_CU_Q4_0:
        f(kind_c<TDM_CU_Q4_0>());
        return true;
    case TDM_CU_Q4_1:
        f(kind_c<TDM_CU_Q4_1>());
        return true;
    case TDM_CU_Q4_K:
        f(kind_c<TDM_CU_Q4_K>());
        return true;
    case TDM_CU_Q6_K:
        f(kind_c<TDM_CU_Q6_K>());
        return true;
    default:
        return false;
    }
}

} // namespace

extern "C" bool tdm_cu_qgemv(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *parts,
                             int n_parts, int k, const uint16_t *x, int n, bool swiglu,
                             uint16_t *out_bf16)
{
    if (n < 1 || n > (1 << 20) || n_parts < 1 || n_parts > 4 || k % 64 || k <= 0 ||
        (uintptr_t)x % 8)
        return false;
    if (swiglu && (n_parts != 2 || parts[0].m != parts[1].m)) return false;
    qargs a = {};
    a.n_parts = swiglu ? 1 : n_parts;
    a.k = k;
    a.n = n;
    a.x = x;
    a.out_bf16 = out_bf16;
    for (int i = 0; i < n_parts; i++)
        a.p[i] = parts[i];
    a.blk_start[0] = 0;
    for (int i = 0; i < a.n_parts; i++)
        a.blk_start[i + 1] = a.blk_start[i] + (parts[i].m + 15) / 16;
    const unsigned blocks = (unsigned)a.blk_start[a.n_parts];
    return with_kind(kind,
                     [&](auto kc) { launch_kind<decltype(kc)::value>(s, a, swiglu, blocks); });
}

extern "C" void tdm_cu_qdequant(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *p, int k,
                                int r0, int n_rows, uint16_t *out)
{
    const size_t n = (size_t)n_rows * k;
    const unsigned blocks = (unsigned)((n + 255) / 256);
    if (!n) return;
    with_kind(kind, [&](auto kc) {
        qdequant_kernel<decltype(kc)::value><<<blocks, 256, 0, s>>>(*p, k, r0, n_rows, out);
    });
}

extern "C" void tdm_cu_qembed(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *p, int k,
                              const int32_t *tokens, int n, float *out)
{
    if (n <= 0) return;
    with_kind(kind, [&](auto kc) {
        qembed_kernel<decltype(kc)::value><<<n, 256, 0, s>>>(*p, k, tokens, out);
    });
}
