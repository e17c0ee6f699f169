/*
 * Quantised weights kept in their blocks on the device (cuda_kernels.h: tdm_cu_qgemv,
 * tdm_cu_qdequant, tdm_cu_qembed; the layout is qweight.h's).
 *
 * Matrix-vector products (up to TDM_CU_QGEMV_MAX_N tokens): a block owns 16 weight rows and a
 * tile of 8 * NT tokens; its 8 warps take interleaved 64-column chunks of k (warp w: chunks w,
 * w + 8, w + 16, ...). The matrix is stored in tiles of 16 rows x 16 chunks (qkind.h), so that a
 * warp's two chunks of a tile (w and w + 8) for rows r and r + 8 come in two 16-byte loads a lane
 * of 512 contiguous bytes a warp (Q8_0: four), their scales in one more, and the activations of
 * a 32-column group in one 16-byte load. Fewer, fuller requests are what this kernel needs: an
 * earlier row-major layout fed the L1 8 rows' cache lines per 256-byte load, and it was the L1,
 * not DRAM, that saturated (bench/RESULTS.md, 2026-12-05). A lane turns its bytes into bf16
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
 * Two forms carry the weight bytes in, with the same arithmetic and so the same bits: the
 * register form (qgemv_kernel: each warp loads its chunks' bytes into registers, SPANS tiles
 * in flight) and the staged form (qgemv_bulk_kernel: the copy engine streams the block's tiles
 * into shared memory, one copy an array, STAGES tiles ahead, each completing on an mbarrier).
 * With the row-major layout the staged form was 4-30% slower at batch 1 and 8 for every kind
 * (an H100, bench/RESULTS.md 2026-12-05: 512-byte copies a row a stage); with tiles (one bulk
 * copy an array a tile) it is the faster one, and the default, for every kind but Q4_K (an H100,
 * two rounds, 2026-12-06: batch 1 +12% Q4_0, +5% Q4_1, +3% Q8_0, equal Q6_K; batch 8 +3-13%;
 * Q4_K +1% at batch 1 but -2% at batch 8, so it keeps the register form).
 * $TANDEM_CUDA_QGEMV=regs|bulk (or tdm_cu_qgemv_set_form) forces one form for every kind; the
 * staged one runs where its alignment and shared-memory needs are met.
 *
 * The staged form's blocks stay: the grid is what the SMs hold at once, and a block runs
 * through row blocks blockIdx.y, blockIdx.y + gridDim.y, ..., its stages running on from one
 * row block into the next, so that the next one's first spans are in flight while it finishes
 * this one. With a block a row block, a block of a 4,096-column matrix had all its spans in
 * flight at its start and none while it computed, and the SMs' blocks tended to do both at the
 * same time. $TANDEM_CUDA_QGEMV_PERSIST=0 launches a block a row block again, for comparison.
 * Each row block's arithmetic is the same either way.
 *
 * Larger batches (prefill) dequantise row chunks to bf16 (tdm_cu_qdequant) for cuBLASLt.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>

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

/* loads through the read-only path (global) or plain (shared memory) */
template <bool GLOBAL, class T> __device__ __forceinline__ T ld(const uint8_t *p)
{
    return GLOBAL ? __ldg(reinterpret_cast<const T *>(p)) : *reinterpret_cast<const T *>(p);
}

/* where one tile (qkind.h: 16 rows x one span of 16 chunks) of a matrix begins in each array,
 * in global memory or in a stage of shared memory */
struct tile {
    const uint8_t *q, *qh, *s, *dd;
};

template <int KIND>
__device__ __forceinline__ tile tile_of(const tdm_cu_qgemv_part &p, int nc, int rb, int s)
{
    tile T;
    T.q = p.q + tdm_qt_tile(tdm_qt_qb(KIND), nc, rb, s);
    T.qh = KIND == TDM_CU_Q6_K ? p.qh + tdm_qt_tile(TDM_QT_HB(KIND), nc, rb, s) : nullptr;
    T.s = p.s + tdm_qt_tile(tdm_qt_sb(KIND), nc, rb, s);
    T.dd = tdm_qt_db(KIND) ? p.dd + tdm_qt_dd_tile(tdm_qt_db(KIND), nc / 4, rb, s) : nullptr;
    return T;
}

/* the super-block scales of chunk cc of a tile for rows g (A) and g + 8 (B) */
template <int KIND, bool GLOBAL>
__device__ __forceinline__ void load_dd(const tile &T, int cc, int g, raw<KIND> &A, raw<KIND> &B)
{
    if (KIND == TDM_CU_Q4_K) {
        const uint2 v = ld<GLOBAL, uint2>(T.dd + tdm_qt_dd(TDM_QT_DB(KIND), cc / 4, g));
        A.s.y = v.x, B.s.y = v.y;
    } else if (KIND == TDM_CU_Q6_K) {
        const uint32_t v = ld<GLOBAL, uint32_t>(T.dd + tdm_qt_dd(TDM_QT_DB(KIND), cc / 4, g));
        A.s.y = v & 0xffffu, B.s.y = v >> 16;
    }
}

/* A full span: chunks w and w + 8 of the tile (a warp's pair) for rows g (A) and g + 8 (B), in
 * one 16-byte load of each row's weights (Q8_0: one a chunk) and one of their scales (Q4_1: two).
 */
template <int KIND, bool GLOBAL>
__device__ __forceinline__ void load_pair(const tile &T, int w, int g, int t, raw<KIND> (&A)[2],
                                          raw<KIND> (&B)[2])
{
    if (KIND == TDM_CU_Q8_0) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            A[u].w = ld<GLOBAL, uint4>(T.q + tdm_qt_piece(1, TDM_QT_QB(KIND), 1, w + 8 * u, g, t));
            B[u].w =
                ld<GLOBAL, uint4>(T.q + tdm_qt_piece(1, TDM_QT_QB(KIND), 1, w + 8 * u, g + 8, t));
        }
    } else {
        const uint4 va = ld<GLOBAL, uint4>(T.q + tdm_qt_piece(0, TDM_QT_QB(KIND), 1, w, g, t));
        const uint4 vb = ld<GLOBAL, uint4>(T.q + tdm_qt_piece(0, TDM_QT_QB(KIND), 1, w, g + 8, t));
        A[0].w.x = va.x, A[0].w.y = va.y, A[1].w.x = va.z, A[1].w.y = va.w;
        B[0].w.x = vb.x, B[0].w.y = vb.y, B[1].w.x = vb.z, B[1].w.y = vb.w;
    }
    if (KIND == TDM_CU_Q6_K) {
        const uint2 ha = ld<GLOBAL, uint2>(T.qh + tdm_qt_piece(0, TDM_QT_HB(KIND), 1, w, g, t));
        const uint2 hb = ld<GLOBAL, uint2>(T.qh + tdm_qt_piece(0, TDM_QT_HB(KIND), 1, w, g + 8, t));
        A[0].qh = ha.x, A[1].qh = ha.y, B[0].qh = hb.x, B[1].qh = hb.y;
    }
    if (KIND == TDM_CU_Q4_1) {
        const uint4 sa = ld<GLOBAL, uint4>(T.s + tdm_qt_scales(TDM_QT_SB(KIND), 1, w, g));
        const uint4 sb = ld<GLOBAL, uint4>(T.s + tdm_qt_scales(TDM_QT_SB(KIND), 1, w, g) + 16);
        A[0].s = make_uint2(sa.x, sa.y), A[1].s = make_uint2(sa.z, sa.w);
        B[0].s = make_uint2(sb.x, sb.y), B[1].s = make_uint2(sb.z, sb.w);
    } else {
        const uint4 v = ld<GLOBAL, uint4>(T.s + tdm_qt_scales(TDM_QT_SB(KIND), 1, w, g));
        A[0].s.x = v.x, A[1].s.x = v.y, B[0].s.x = v.z, B[1].s.x = v.w;
    }
    load_dd<KIND, GLOBAL>(T, w, g, A[0], B[0]);
    load_dd<KIND, GLOBAL>(T, w + 8, g, A[1], B[1]);
}

/* A partial span (a row's last): chunk cc of the tile for rows g (A) and g + 8 (B). */
template <int KIND, bool GLOBAL>
__device__ __forceinline__ void load_one(const tile &T, int cc, int g, int t, raw<KIND> &A,
                                         raw<KIND> &B)
{
    if (KIND == TDM_CU_Q8_0) {
        A.w = ld<GLOBAL, uint4>(T.q + tdm_qt_piece(1, TDM_QT_QB(KIND), 0, cc, g, t));
        B.w = ld<GLOBAL, uint4>(T.q + tdm_qt_piece(1, TDM_QT_QB(KIND), 0, cc, g + 8, t));
    } else {
        const uint2 va = ld<GLOBAL, uint2>(T.q + tdm_qt_piece(0, TDM_QT_QB(KIND), 0, cc, g, t));
        const uint2 vb = ld<GLOBAL, uint2>(T.q + tdm_qt_piece(0, TDM_QT_QB(KIND), 0, cc, g + 8, t));
        A.w.x = va.x, A.w.y = va.y, B.w.x = vb.x, B.w.y = vb.y;
    }
    if (KIND == TDM_CU_Q6_K) {
        A.qh = ld<GLOBAL, uint32_t>(T.qh + tdm_qt_piece(0, TDM_QT_HB(KIND), 0, cc, g, t));
        B.qh = ld<GLOBAL, uint32_t>(T.qh + tdm_qt_piece(0, TDM_QT_HB(KIND), 0, cc, g + 8, t));
    }
    if (KIND == TDM_CU_Q4_1) {
        const uint4 v = ld<GLOBAL, uint4>(T.s + tdm_qt_scales(TDM_QT_SB(KIND), 0, cc, g));
        A.s = make_uint2(v.x, v.y), B.s = make_uint2(v.z, v.w);
    } else {
        const uint2 v = ld<GLOBAL, uint2>(T.s + tdm_qt_scales(TDM_QT_SB(KIND), 0, cc, g));
        A.s.x = v.x, B.s.x = v.y;
    }
    load_dd<KIND, GLOBAL>(T, cc, g, A, B);
}

/* One row's piece of chunk c (for the element-wise kernels). */
template <int KIND>
__device__ __forceinline__ void load_row(const tdm_cu_qgemv_part &p, int nc, int row, int c, int t,
                                         raw<KIND> &r)
{
    if (KIND == TDM_CU_Q8_0) {
        r.w = ld<true, uint4>(p.q + tdm_qt_q_at(KIND, nc, row, c, t));
    } else {
        const uint2 v = ld<true, uint2>(p.q + tdm_qt_q_at(KIND, nc, row, c, t));
        r.w.x = v.x, r.w.y = v.y;
    }
    if (KIND == TDM_CU_Q6_K) r.qh = ld<true, uint32_t>(p.qh + tdm_qt_qh_at(nc, row, c, t));
    if (KIND == TDM_CU_Q4_1)
        r.s = ld<true, uint2>(p.s + tdm_qt_s_at(KIND, nc, row, c));
    else
        r.s.x = ld<true, uint32_t>(p.s + tdm_qt_s_at(KIND, nc, row, c));
    if (KIND == TDM_CU_Q4_K) r.s.y = ld<true, uint32_t>(p.dd + tdm_qt_dd_at(KIND, nc, row, c / 4));
    if (KIND == TDM_CU_Q6_K) r.s.y = ld<true, uint16_t>(p.dd + tdm_qt_dd_at(KIND, nc, row, c / 4));
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

/* The activations of chunk c for this lane's token of each tile, as the B fragments take them
 * (tdm_qt_col: X[nt][gi][h] holds the columns of elements (gi, h, 0..3)): one 16-byte load a
 * group, or for Q6_K 8 bytes a half group. Loads only, so that they can be in flight ahead of
 * their use. */
template <int KIND, int NT>
__device__ __forceinline__ void load_x_raw(const uint16_t *const (&xr)[NT], int c, int t,
                                           uint2 (&X)[NT][2][2])
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int gi = 0; gi < 2; gi++) {
            if (KIND == TDM_CU_Q6_K) {
#pragma unroll
                for (int h = 0; h < 2; h++)
                    X[nt][gi][h] = xr[nt] ? __ldg(reinterpret_cast<const uint2 *>(
                                                xr[nt] + 64 * c + 32 * gi + 16 * h + 4 * t))
                                          : make_uint2(0, 0);
            } else {
                const uint4 v =
                    xr[nt]
                        ? __ldg(reinterpret_cast<const uint4 *>(xr[nt] + 64 * c + 32 * gi + 8 * t))
                        : make_uint4(0, 0, 0, 0);
                X[nt][gi][0] = make_uint2(v.x, v.y);
                X[nt][gi][1] = make_uint2(v.z, v.w);
            }
        }
}

/* For kinds with a minimum, each group's sum of the activations over the two tokens this
 * lane's C fragment holds (the whole warp takes part); zeros otherwise. */
template <int KIND, int NT>
__device__ __forceinline__ void x_sums(const uint2 (&X)[NT][2][2], int t, float (&sx)[NT][2][2])
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int gi = 0; gi < 2; gi++) {
            if (has_min(KIND)) {
                float own = 0.0f;
#pragma unroll
                for (int h = 0; h < 2; h++)
                    own += (bf_lo(X[nt][gi][h].x) + bf_hi(X[nt][gi][h].x)) +
                           (bf_lo(X[nt][gi][h].y) + bf_hi(X[nt][gi][h].y));
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
}

/* load_x_raw and x_sums of chunk c at once */
template <int KIND, int NT>
__device__ __forceinline__ void load_x(const uint16_t *const (&xr)[NT], int c, int t,
                                       uint2 (&X)[NT][2][2], float (&sx)[NT][2][2])
{
    load_x_raw<KIND, NT>(xr, c, t, X);
    x_sums<KIND, NT>(X, t, sx);
}

/* The block's matrix (its index in a.p) and first row: grid.y counts the 16-row blocks of
 * every part in turn. */
__device__ __forceinline__ int block_part_of(const qargs &a, int blk, int &r0)
{
    int part = 0;
    while (blk >= a.blk_start[part + 1])
        part++;
    r0 = (blk - a.blk_start[part]) * 16;
    return part;
}

__device__ __forceinline__ int block_part(const qargs &a, int &r0)
{
    return block_part_of(a, blockIdx.y, r0);
}

/* This lane's token row in each tile from tok0 (nullptr past n), and zeroed accumulators. */
template <int NT>
__device__ __forceinline__ void tile_start(const qargs &a, int tok0, int g,
                                           const uint16_t *(&xr)[NT], float (&acc)[NT][4],
                                           float (&accu)[NT][4])
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int tok = tok0 + nt * 8 + g;
        xr[nt] = tok < a.n ? a.x + (size_t)tok * a.k : nullptr;
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[nt][e] = accu[nt][e] = 0.0f;
    }
}

/* The end of a block: the 8 warps' partial sums folded in warp order (red: the block's shared
 * scratch), then the outputs of its 16 rows and 8 * NT tokens (bias, or SwiGLU of gate and up). */
template <int NT, bool SWIGLU>
__device__ __forceinline__ void
finish(const qargs &a, const tdm_cu_qgemv_part &P, float (*red)[NT * 4 * (SWIGLU ? 2 : 1)][32],
       float (&acc)[NT][4], float (&accu)[NT][4], int warp, int lane, int r0, int tok0)
{
    constexpr int NV = NT * 4 * (SWIGLU ? 2 : 1);
    const int g = lane / 4, t = lane % 4, m = P.m;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            red[warp][nt * 4 + e][lane] = acc[nt][e];
            if (SWIGLU) red[warp][NT * 4 + nt * 4 + e][lane] = accu[nt][e];
        }
    __syncthreads();
    if (warp != 0) return; /* the caller's next use of red waits on a barrier */
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
                y = tdm_silu_mul(gv, accu[nt][e]);
            } else {
                y = acc[nt][e] + (bias ? bias[row] : 0.0f);
            }
            out[(size_t)tok * m + row] = y;
            if (SWIGLU && a.out_bf16) a.out_bf16[(size_t)tok * m + row] = tdm_to_bf16(y);
        }
}

/* a warp's chunks of one span (w and w + 8 of its tile) for rows g and g + 8: one pair load in a
 * full span, the chunks one by one in a partial one (a chunk past the row: not loaded, not used) */
template <int KIND, bool GLOBAL>
__device__ __forceinline__ void load_span(const tile &T, bool full, int nc_left, int w, int g,
                                          int t, raw<KIND> (&A)[2], raw<KIND> (&B)[2])
{
    if (full) {
        load_pair<KIND, GLOBAL>(T, w, g, t, A, B);
        return;
    }
#pragma unroll
    for (int u = 0; u < 2; u++)
        if (w + 8 * u < nc_left) load_one<KIND, GLOBAL>(T, w + 8 * u, g, t, A[u], B[u]);
}

/* spans whose loads a warp puts in flight together (4 was 13% slower at batch 1 on an H100,
 * bench/RESULTS.md 2026-12-06: twice the registers a lane) */
constexpr int SPANS = 2;

/* grid: (token tiles of 8 * NT, 16-row blocks of all parts). SWIGLU: parts 0 (gate) and 1 (up)
 * of equal rows, one block reads both. Each warp takes chunks warp, warp + 8, warp + 16, ...:
 * the pair of each span (qkind.h), SPANS spans a round, every load of the round issued before
 * the first product. */
template <int KIND, int NT, bool SWIGLU>
__global__ void __launch_bounds__(256) qgemv_kernel(qargs a)
{
    constexpr int NV = NT * 4 * (SWIGLU ? 2 : 1);
    __shared__ float red[8][NV][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int r0;
    const int part = block_part(a, r0);
    const tdm_cu_qgemv_part &P = a.p[part];
    const int k = a.k, nc = k / 64, rb = r0 / 16, n_spans = (nc + 15) / 16;
    const int tok0 = blockIdx.x * 8 * NT;
    const uint16_t *xr[NT];
    float acc[NT][4], accu[NT][4];
    tile_start<NT>(a, tok0, g, xr, acc, accu);
    bool waited = false;
    for (int s0 = 0; s0 < n_spans; s0 += SPANS) {
        raw<KIND> A[SPANS][2], B[SPANS][2], AU[SPANS][2], BU[SPANS][2];
#pragma unroll
        for (int i = 0; i < SPANS; i++) {
            const int s = s0 + i;
            if (s >= n_spans) break;
            const bool full = tdm_qt_full(nc, s);
            load_span<KIND, true>(tile_of<KIND>(P, nc, rb, s), full, nc - 16 * s, warp, g, t, A[i],
                                  B[i]);
            if (SWIGLU)
                load_span<KIND, true>(tile_of<KIND>(a.p[1], nc, rb, s), full, nc - 16 * s, warp, g,
                                      t, AU[i], BU[i]);
        }
        if (!waited) { /* the weights are ours; x is the kernel before's (pdl.cuh) */
            tdm_pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int i = 0; i < SPANS; i++)
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = 16 * (s0 + i) + warp + 8 * u;
                if (c >= nc) break;
                uint2 X[NT][2][2];
                float sx[NT][2][2];
                load_x<KIND, NT>(xr, c, t, X, sx);
                chunk_mma<KIND, NT>(A[i][u], B[i][u], X, sx, acc);
                if (SWIGLU) chunk_mma<KIND, NT>(AU[i][u], BU[i][u], X, sx, accu);
            }
    }
    if (!waited) tdm_pdl_wait();
    finish<NT, SWIGLU>(a, P, red, acc, accu, warp, lane, r0, tok0);
}

/* ---- the staged form: the copy engine streams the weights into shared memory ----
 *
 * Same blocks, warps, chunk order and arithmetic as qgemv_kernel (so the same bits); what
 * differs is how the weight bytes arrive. A stage is one span (qkind.h): the block's tile of
 * each array, contiguous in global memory, so one bulk copy (cp.async.bulk) an array and matrix,
 * completing on the stage's mbarrier; STAGES of them are in flight, issued by one lane before the
 * block waits for the kernel before it. A warp reads its pair of each stage out of shared
 * memory with the register form's loads (a tile in shared memory has the layout it has in
 * global memory, and a warp's loads of it are 512 contiguous bytes, so they hit distinct banks);
 * after the block's barrier, the stage is refilled. */

/* Stages a block: 2, since the blocks stay and their stages run on across row blocks. A stage
 * less is a block more an SM (the SwiGLU's two matrices: 37 KB of stages a block, not 74),
 * and the kernel is latency-bound at low occupancy: on an H200 (bench/RESULTS.md 2026-12-06),
 * 2 stages against 4 at batch 1: Q4_0 +8%, Q8_0 +9%, Q6_K +16%, Q4_1 +1%; 3 in between. */
constexpr int STAGES = 2;

/* one matrix's tile a stage in shared memory: q, qh (Q6_K), s, dd (the K-quants) */
template <int KIND> struct stage_geom {
    static constexpr int Q = 16 * 16 * TDM_QT_QB(KIND);
    static constexpr int QH = 16 * 16 * TDM_QT_HB(KIND);
    static constexpr int S = 16 * 16 * TDM_QT_SB(KIND);
    static constexpr int DD = 4 * 16 * TDM_QT_DB(KIND);
    static constexpr int TILE = Q + QH + S + DD; /* each a multiple of 128 */
};

/* one matrix's share of the block's dynamic shared memory */
template <int KIND> __host__ __device__ constexpr int part_smem()
{
    return STAGES * stage_geom<KIND>::TILE;
}

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bar_init(uint64_t *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t *bar, uint32_t parity)
{
    asm volatile("{\n"
                 ".reg .pred P1;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\n"
                 "bra WAIT;\n"
                 "DONE:\n"
                 "}\n" ::"r"(smem_addr(bar)),
                 "r"(parity)
                 : "memory");
}

/* bytes (a multiple of 16, both addresses 16-aligned) from global src to shared dst,
 * completing on bar */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

/* stage slot of one matrix in shared memory, as a tile */
template <int KIND> __device__ __forceinline__ tile slot_tile(uint8_t *base, int slot)
{
    using G = stage_geom<KIND>;
    uint8_t *p = base + slot * G::TILE;
    tile T;
    T.q = p;
    T.qh = p + G::Q;
    T.s = p + G::Q + G::QH;
    T.dd = p + G::Q + G::QH + G::S;
    return T;
}

/* One lane issues stage st (span st) of the block's tiles: the bytes announced, then one copy
 * an array and matrix. */
template <int KIND, bool SWIGLU>
__device__ __forceinline__ void issue_stage(const qargs &a, int part, uint8_t *smem, uint64_t *bars,
                                            int st, int rb, int slot)
{
    using G = stage_geom<KIND>;
    constexpr int NP = SWIGLU ? 2 : 1;
    const int nc = a.k / 64, n = min(16, nc - 16 * st); /* chunks */
    const uint32_t q = (uint32_t)(n * 16 * tdm_qt_qb(KIND)),
                   qh = (uint32_t)(n * 16 * tdm_qt_hb(KIND));
    const uint32_t sb = (uint32_t)(n * 16 * tdm_qt_sb(KIND));
    const uint32_t dd = (uint32_t)(n / 4 * 16 * tdm_qt_db(KIND));
    bar_expect(&bars[slot], NP * (q + qh + sb + dd));
#pragma unroll
    for (int pi = 0; pi < NP; pi++) {
        const tile src = tile_of<KIND>(a.p[part + pi], nc, rb, st);
        const tile dst = slot_tile<KIND>(smem + pi * part_smem<KIND>(), slot);
        bulk_copy((void *)dst.q, src.q, q, &bars[slot]);
        if (qh) bulk_copy((void *)dst.qh, src.qh, qh, &bars[slot]);
        bulk_copy((void *)dst.s, src.s, sb, &bars[slot]);
        if (dd) bulk_copy((void *)dst.dd, src.dd, dd, &bars[slot]);
    }
}

/* Stage q of a block's sequence: span q % n_st of its row block q / n_st (the block's row
 * blocks are blockIdx.y, blockIdx.y + gridDim.y, ...), into slot q % STAGES. */
template <int KIND, bool SWIGLU>
__device__ __forceinline__ void issue_q(const qargs &a, uint8_t *smem, uint64_t *bars, int q,
                                        int n_st)
{
    int r0;
    const int part = block_part_of(a, blockIdx.y + (q / n_st) * gridDim.y, r0);
    issue_stage<KIND, SWIGLU>(a, part, smem, bars, q % n_st, r0 / 16, q % STAGES);
}

/* A block of the staged form runs through row blocks blockIdx.y, blockIdx.y + gridDim.y, ...
 * (the grid is about what the SMs hold at once: launch_one), and its stages run on across
 * them: the first spans of its next row block are in flight while it finishes this one. */
template <int KIND, int NT, bool SWIGLU>
__global__ void __launch_bounds__(256) qgemv_bulk_kernel(qargs a)
{
    constexpr int NV = NT * 4 * (SWIGLU ? 2 : 1);
    __shared__ float red[8][NV][32];
    __shared__ __align__(8) uint64_t bars[STAGES];
    extern __shared__ __align__(128) uint8_t smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k = a.k, nc = k / 64, n_st = (nc + 15) / 16;
    const int n_blk = a.blk_start[a.n_parts];
    const int mine = ((int)blockIdx.y < n_blk)
                         ? (n_blk - (int)blockIdx.y + (int)gridDim.y - 1) / (int)gridDim.y
                         : 0;
    const int n_q = mine * n_st;
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++)
            bar_init(&bars[i], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) /* the weights are ours: in flight before the wait (pdl.cuh) */
        for (int q = 0; q < min(STAGES, n_q); q++)
            issue_q<KIND, SWIGLU>(a, smem, bars, q, n_st);
    tdm_pdl_wait();
    const int tok0 = blockIdx.x * 8 * NT;
    /* the activations of the warp's next chunk are loaded a chunk ahead of their use: the
     * stages' weights are in shared memory by then, and an L1 round trip per chunk would
     * otherwise be on the critical path; after a row block's last chunk, the next one's first */
    uint2 Xn[NT][2][2];
    const uint16_t *xr[NT];
    float acc[NT][4], accu[NT][4];
    tile_start<NT>(a, tok0, g, xr, acc, accu);
    if (warp < nc) load_x_raw<KIND, NT>(xr, warp, t, Xn);
    for (int i = 0; i < mine; i++) {
        int r0;
        const int part = block_part_of(a, blockIdx.y + i * gridDim.y, r0);
        const tdm_cu_qgemv_part &P = a.p[part];
        if (i > 0) tile_start<NT>(a, tok0, g, xr, acc, accu);
        for (int st = 0; st < n_st; st++) {
            const int q = i * n_st + st, slot = q % STAGES;
            bar_wait(&bars[slot], (uint32_t)((q / STAGES) & 1));
            const bool full = tdm_qt_full(nc, st);
            raw<KIND> A[2], B[2], AU[2], BU[2];
            load_span<KIND, false>(slot_tile<KIND>(smem, slot), full, nc - 16 * st, warp, g, t, A,
                                   B);
            if (SWIGLU)
                load_span<KIND, false>(slot_tile<KIND>(smem + part_smem<KIND>(), slot), full,
                                       nc - 16 * st, warp, g, t, AU, BU);
#pragma unroll
            for (int u = 0; u < 2; u++) {
                const int c = 16 * st + warp + 8 * u;
                if (c >= nc) break;
                uint2 X[NT][2][2];
                float sx[NT][2][2];
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int gi = 0; gi < 2; gi++)
#pragma unroll
                        for (int h = 0; h < 2; h++)
                            X[nt][gi][h] = Xn[nt][gi][h];
                if (c + 8 < nc)
                    load_x_raw<KIND, NT>(xr, c + 8, t, Xn);
                else if (i + 1 < mine)
                    load_x_raw<KIND, NT>(xr, warp, t, Xn);
                x_sums<KIND, NT>(X, t, sx);
                chunk_mma<KIND, NT>(A[u], B[u], X, sx, acc);
                if (SWIGLU) chunk_mma<KIND, NT>(AU[u], BU[u], X, sx, accu);
            }
            if (q + STAGES < n_q) {
                __syncthreads(); /* every warp is done with the slot */
                if (threadIdx.x == 0) issue_q<KIND, SWIGLU>(a, smem, bars, q + STAGES, n_st);
            }
        }
        if (i > 0) __syncthreads(); /* warp 0 has read the last row block's partial sums */
        finish<NT, SWIGLU>(a, P, red, acc, accu, warp, lane, r0, tok0);
    }
}

/* element (gi, h, b) of a lane's loaded piece, as a float: the matrix-vector kernel's scale
 * arithmetic, one element at a time */
template <int KIND>
__device__ __forceinline__ float piece_elem(const raw<KIND> &w, int gi, int h, int b)
{
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

/* element (row, col) of a packed matrix (qweight.h) */
template <int KIND>
__device__ __forceinline__ float qelem(const tdm_cu_qgemv_part &p, int k, int row, int col)
{
    int c, t, gi, h, b;
    tdm_qt_where(KIND, col, &c, &t, &gi, &h, &b);
    raw<KIND> w;
    load_row<KIND>(p, k / 64, row, c, t, w);
    return piece_elem<KIND>(w, gi, h, b);
}

/* out[i][col] (bf16) = row r0 + i of the matrix: a thread a lane's piece (16 elements of one
 * row and chunk), loaded once. A warp takes lanes t of rows r0 + 16 rb + (0..7 or 8..15) of one
 * chunk, so that its loads are the tile's side-by-side pieces (qkind.h), and a thread writes
 * its elements in runs of adjacent columns: two 16-byte stores (Q6_K: four of 8 bytes), where
 * 16 stores of 2 bytes a thread made the old form 11% slower at prefill than row-major blocks. */
template <int KIND>
__global__ void qdequant_kernel(tdm_cu_qgemv_part p, int k, int r0, int n_rows, uint16_t *out)
{
    const int nc = k / 64;
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const int t = (int)(i % 4), r = (int)((i / 4) % 16);
    const size_t rest = i / 64;
    const int c = (int)(rest % (size_t)nc);
    const size_t row = (rest / (size_t)nc) * 16 + (size_t)r;
    if (row >= (size_t)n_rows) return;
    raw<KIND> w;
    load_row<KIND>(p, nc, r0 + (int)row, c, t, w);
    uint16_t *o = out + row * (size_t)k;
#pragma unroll
    for (int gi = 0; gi < 2; gi++) {
        uint32_t v[4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int b = 0; b < 4; b += 2)
                v[2 * h + b / 2] = (uint32_t)tdm_to_bf16(piece_elem<KIND>(w, gi, h, b)) |
                                   (uint32_t)tdm_to_bf16(piece_elem<KIND>(w, gi, h, b + 1)) << 16;
        if (KIND == TDM_CU_Q6_K) {
            /* (gi, h)'s four elements are columns tdm_qt_col(.., gi, h, 0..3), adjacent */
            *(uint2 *)(o + tdm_qt_col(KIND, c, t, gi, 0, 0)) = make_uint2(v[0], v[1]);
            *(uint2 *)(o + tdm_qt_col(KIND, c, t, gi, 1, 0)) = make_uint2(v[2], v[3]);
        } else {
            /* (gi, h = 0, 1, b = 0..3) are eight adjacent columns */
            *(uint4 *)(o + tdm_qt_col(KIND, c, t, gi, 0, 0)) = make_uint4(v[0], v[1], v[2], v[3]);
        }
    }
}

/* out[i] = row tokens[i] as fp32 */
template <int KIND>
__global__ void qembed_kernel(tdm_cu_qgemv_part p, int k, const int32_t *tokens, float *out)
{
    const int i = blockIdx.x, row = tokens[i];
    for (int col = threadIdx.x; col < k; col += blockDim.x)
        out[(size_t)i * k + col] = qelem<KIND>(p, k, row, col);
}

/* $TANDEM_CUDA_QGEMV_PERSIST=0: the staged form launches a block per row block (the form before
 * the blocks stayed), for comparison; read once */
const bool g_no_persist = [] {
    const char *e = getenv("TANDEM_CUDA_QGEMV_PERSIST");
    return e && !strcmp(e, "0");
}();

/* the largest dynamic shared memory a staged block may take (a Hopper SM has 227 KB) */
constexpr int BULK_SMEM_MAX = 160 * 1024;

/* Raises the staged kernel's dynamic shared-memory limit, once per instantiation and device
 * (the backend drives a device from one thread; two threads racing here both set the same
 * value). */
template <int KIND, int NT, bool SWIGLU> bool allow_smem()
{
    static bool done[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
    if (!done[dev]) {
        if (cudaFuncSetAttribute(qgemv_bulk_kernel<KIND, NT, SWIGLU>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 BULK_SMEM_MAX) != cudaSuccess) {
            (void)cudaGetLastError(); /* not sticky: the register form runs instead */
            return false;
        }
        done[dev] = true;
    }
    return true;
}

/* How many staged blocks of this instantiation the device holds at once (its SMs times the
 * blocks an SM takes), once per device; 0 if the runtime cannot say. */
template <int KIND, int NT, bool SWIGLU> int resident_blocks(size_t smem)
{
    static int cached[64];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
    if (!cached[dev]) {
        int sms = 0, per_sm = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &per_sm, qgemv_bulk_kernel<KIND, NT, SWIGLU>, 256, smem) != cudaSuccess ||
            sms <= 0 || per_sm <= 0) {
            (void)cudaGetLastError();
            return 0;
        }
        cached[dev] = sms * per_sm;
    }
    return cached[dev];
}

template <int KIND, int NT, bool SWIGLU>
void launch_one(cudaStream_t s, const qargs &a, unsigned blocks, bool bulk)
{
    /* the token tiles of a row block side by side in launch order, so that the tiles after the
     * first find its rows in L2 */
    const unsigned tiles = (unsigned)((a.n + 8 * NT - 1) / (8 * NT));
    const size_t smem = (size_t)(SWIGLU ? 2 : 1) * (size_t)part_smem<KIND>();
    if (bulk && smem <= BULK_SMEM_MAX && allow_smem<KIND, NT, SWIGLU>()) {
        /* the staged blocks stay: as many as the SMs hold (for each token tile), each running
         * through its share of the row blocks */
        const int res = resident_blocks<KIND, NT, SWIGLU>(smem);
        unsigned by = blocks;
        if (res > 0 && !g_no_persist) by = std::min(blocks, std::max(1u, (unsigned)res / tiles));
        tdm_pdl_launch(qgemv_bulk_kernel<KIND, NT, SWIGLU>, dim3(tiles, by), 256, smem, s, a);
    } else {
        tdm_pdl_launch(qgemv_kernel<KIND, NT, SWIGLU>, dim3(tiles, blocks), 256, 0, s, a);
    }
}

template <int KIND, int NT>
void launch_nt(cudaStream_t s, const qargs &a, bool swiglu, unsigned blocks, bool bulk)
{
    if (swiglu)
        launch_one<KIND, NT, true>(s, a, blocks, bulk);
    else
        launch_one<KIND, NT, false>(s, a, blocks, bulk);
}

template <int KIND>
void launch_kind(cudaStream_t s, const qargs &a, bool swiglu, unsigned blocks, bool bulk)
{
    if (a.n <= 8)
        launch_nt<KIND, 1>(s, a, swiglu, blocks, bulk);
    else if (a.n <= 16)
        launch_nt<KIND, 2>(s, a, swiglu, blocks, bulk);
    else
        launch_nt<KIND, 4>(s, a, swiglu, blocks, bulk);
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

/* the form tdm_cu_qgemv launches: TDM_CU_QGEMV_AUTO until set; $TANDEM_CUDA_QGEMV=regs or
 * bulk chooses for the process (read once) */
int g_form = -1;

int qgemv_form()
{
    if (g_form < 0) {
        const char *e = getenv("TANDEM_CUDA_QGEMV");
        g_form = e && !strcmp(e, "regs")   ? TDM_CU_QGEMV_REGS
                 : e && !strcmp(e, "bulk") ? TDM_CU_QGEMV_BULK
                                           : TDM_CU_QGEMV_AUTO;
    }
    return g_form;
}

} // namespace

extern "C" bool tdm_cu_qgemv(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *parts,
                             int n_parts, int k, const uint16_t *x, int n, bool swiglu,
                             uint16_t *out_bf16)
{
    if (n < 1 || n > (1 << 20) || n_parts < 1 || n_parts > 4 || k % 64 || k <= 0 ||
        (uintptr_t)x % 16)
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
    if (blocks > 65535) return false; /* grid.y; the rows of a 1M-token vocabulary */
    /* the staged form needs 16-byte aligned arrays (the layout's are 256-aligned from an
     * aligned base) */
    const int form = qgemv_form();
    bool bulk = form == TDM_CU_QGEMV_BULK || (form == TDM_CU_QGEMV_AUTO && kind != TDM_CU_Q4_K);
    for (int i = 0; i < n_parts; i++)
        bulk = bulk && !(((uintptr_t)parts[i].q | (uintptr_t)parts[i].qh | (uintptr_t)parts[i].s |
                          (uintptr_t)parts[i].dd) %
                         16);
    return with_kind(
        kind, [&](auto kc) { launch_kind<decltype(kc)::value>(s, a, swiglu, blocks, bulk); });
}

extern "C" void tdm_cu_qgemv_set_form(int form)
{
    g_form = form;
}

extern "C" void tdm_cu_qdequant(cudaStream_t s, int kind, const struct tdm_cu_qgemv_part *p, int k,
                                int r0, int n_rows, uint16_t *out)
{
    /* pieces, the rows rounded up to blocks of 16 (the kernel skips those past n_rows); out
     * must be 16-byte aligned */
    const size_t n = (size_t)((n_rows + 15) / 16) * 16 * (size_t)(k / 64) * 4;
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
