/*
 * The x86 quantised tile (qdot.c gives the arithmetic it must reproduce), shared by qdot_avx2.c
 * and qdot_avx512.c. Included alone, it gives the common helpers; included again after
 * defining the following, it defines one variant's kernel:
 *   QDOT_KERNEL  the name of the always-inline tile kernel to define here,
 *   QDOT_FN_ATTR (optional) a target attribute the kernel needs (its multiply-add's ISA),
 *   QDOT_Q8_BIAS (optional, 0 by default) 1 where QDOT_DOT1 takes unsigned bytes up to 255
 *                without saturating (VPDPBUSD): Q8_0's weights then enter as w + 128 (one XOR)
 *                and 128 s comes off the sum, in place of |w| and w's sign on both planes, and
 *   QDOT_DOT1    a function (u, h, l) -> __m256i whose int32 lane k is the exact sum over
 *                bytes 4k to 4k + 3 of u (unsigned) times 256 h + l (h, l signed: an activation
 *                block's two planes): the variant's own multiply-adds (VPMADDUBSW + VPMADDWD,
 *                or VPDPBUSD). Lanes 0-3 cover elements 0-15, lanes 4-7 elements 16-31 (Q6_K's
 *                two halves, each with its own scale).
 *   QDOT_I16     (optional, 0 by default) 1 where Q8_0, Q4_0, Q4_1 and Q4_K take the activation's
 *                16-bit values (xblock.v) with VPMADDWD instead of the two planes: without
 *                VPDPBUSD, the planes cost four multiply-adds a block where v costs two.
 * Everything else (unpacking a block's weights to bytes, the scales, the fp32 accumulation) is
 * the same 256/128-bit code in every variant, so the variants differ only where they may: in
 * how an exact integer is computed.
 *
 * Layout of a tile: the R <= 4 weight rows of one block are four byte vectors; for each of the
 * C activation rows four QDOT_DOT1 and one reduction give the four rows' integer sums in the
 * lanes of one register, and one fp32 register per activation row accumulates the four rows'
 * pairs. The K-quants run the same per activation block (a sub-block of 32, or Q6_K's two of
 * 16), with each super-block's sub-block scales (and Q4_K's minimums) unpacked once, turned to
 * fp32 and transposed so that sub-block j's four rows sit in the lanes of one register.
 * Q8_0's signed weights enter as |w| and the activation's bytes with w's sign (|w| <= 128,
 * |h|, |l| <= 127: no pair of products leaves int16), or with VPDPBUSD as w + 128 (its four
 * products go straight to int32; |sum (w + 128) v| < 2^29); 4-bit weights enter as their
 * nibbles.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#ifndef QDOT_X86_COMMON
#define QDOT_X86_COMMON
#define QAI              static inline __attribute__((always_inline))
#define QDOT_AHEAD_BYTES 4096 /* qdot_ahead: 2 and 8 KiB measured the same (2026-12-07) */

/* The next tile's copy of a row's `lines` 64-byte lines (each row prefetches the same bytes of
 * the rows `ahead` further on). */
QAI void qdot_prefetch(const uint8_t *blk, size_t ahead, int lines)
{
#pragma GCC unroll 4
    for (int l = 0; l < lines; l++)
        _mm_prefetch((const char *)blk + ahead + 64 * l, _MM_HINT_T0);
}

/* How far ahead the VPMADDWD tile prefetches its rows: the walk's next tile (`next` bytes on), or
 * as many tiles on as read 4 KiB. A decode step's matrices have short rows (SmolLM2's 576
 * columns are 360 bytes of Q4_1), and one tile ahead then keeps too few bytes in flight for one
 * core to stream them at the memory's rate (bench/RESULTS.md, 2026-12-07). */
QAI size_t qdot_ahead(int R, size_t next, size_t row_len)
{
    const size_t tile = (size_t)R * row_len;
    return next * ((QDOT_AHEAD_BYTES + tile - 1) / tile);
}

/* A tile's results: row i of column c (its bias added) from lane i of acc[c]. */
QAI void qdot_store(const struct tdm_cpu_qtile *t, const __m128 *acc, int R, int C)
{
#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
        float v[4];
        _mm_storeu_ps(v, acc[c]);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
            t->out[c * t->ldo + i * t->ldr] = t->bias ? v[i] + t->bias[i * t->ldr] : v[i];
    }
}

/* Per 128-bit lane, the four vectors' sums side by side: lane i of each half is v[i]'s sum over
 * that half. A transpose by unpacks and three adds (single-uop shuffles), where VPHADDD costs
 * several uops apiece; the sums are exact, so the order does not show in the result. */
QAI __m256i qdot_sum4_lanes(__m256i a, __m256i b, __m256i c, __m256i d)
{
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* Exact int32 lane sums of four 8-lane vectors: lane i of the result is the sum of v[i]. */
QAI __m128i qdot_reduce4(__m256i a, __m256i b, __m256i c, __m256i d)
{
    const __m256i h = qdot_sum4_lanes(a, b, c, d);
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* As qdot_reduce4, the halves apart: lane i of *lo0 sums lanes 0-3 of v[i] (elements 0-15),
 * of *hi16 lanes 4-7 (elements 16-31). By VPHADDD: in Q6_K's tile, which holds more in
 * registers, the unpacks of qdot_sum4_lanes measured 3-10% slower. */
QAI void qdot_reduce4_halves(__m256i a, __m256i b, __m256i c, __m256i d, __m128i *lo0,
                             __m128i *hi16)
{
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    *lo0 = _mm256_castsi256_si128(h);
    *hi16 = _mm256_extracti128_si256(h, 1);
}

/* A 4 x 8 transpose: out[j] lane i is r[i] lane j. */
QAI void qdot_transpose4x8(const __m256 *r, __m128 *out)
{
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 c[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        out[k] = _mm256_castps256_ps128(c[k]);
        out[k + 4] = _mm256_extractf128_ps(c[k], 1);
    }
}

QAI int32_t qdot_ld32(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The two fp16 at the start of each of R blocks (p + i * stride; 0 past R) as fp32 lanes: d
 * gets each block's first (its scale), m its second (Q4_1's minimum; meaningless otherwise).
 * Four 32-bit loads straight into the lanes (an array on the stack, stored in pieces and loaded
 * whole, stalled every block on store forwarding). */
QAI void qdot_scales(const uint8_t *p, size_t stride, int R, __m128 *d, __m128 *m)
{
    const int32_t l0 = qdot_ld32(p), l1 = R > 1 ? qdot_ld32(p + stride) : 0;
    const int32_t l2 = R > 2 ? qdot_ld32(p + 2 * stride) : 0;
    const int32_t l3 = R > 3 ? qdot_ld32(p + 3 * stride) : 0;
    const __m256 f = _mm256_cvtph_ps(_mm_setr_epi32(l0, l1, l2, l3));
    const __m256 g = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    *d = _mm256_castps256_ps128(g);
    *m = _mm256_extractf128_ps(g, 1);
}

/* A Q8_0, Q4_0 or Q4_1 block's size and its quants' offset in it. */
QAI void qdot_block_layout(int wtype, size_t *bsz, size_t *qoff)
{
    const bool q8 = wtype == TDM_CPU_W_Q8_0, q40 = wtype == TDM_CPU_W_Q4_0;
    *bsz = q8    ? sizeof(struct block_q8_0)
           : q40 ? sizeof(struct block_q4_0)
                 : sizeof(struct block_q4_1);
    *qoff = q8    ? offsetof(struct block_q8_0, qs)
            : q40 ? offsetof(struct block_q4_0, qs)
                  : offsetof(struct block_q4_1, qs);
}

/* One block's four rows' exact sums into a column's accumulator (qdot.c): dd = dw * d, then
 * acc + fma(dd, isum, dm * ds) where the block has a minimum (Q4_1, a Q4_K sub-block: q41),
 * fma(dd, isum, acc) otherwise. */
QAI __m128 qdot_accumulate(__m128 acc, __m128i isum, __m128 dw, __m128 dm,
                           const struct tdm_cpu_xblock *xb, bool q41)
{
    const __m128 dd = _mm_mul_ps(dw, _mm_set1_ps(xb->d));
    const __m128 fsum = _mm_cvtepi32_ps(isum);
    if (q41) return _mm_add_ps(acc, _mm_fmadd_ps(dd, fsum, _mm_mul_ps(dm, _mm_set1_ps(xb->ds))));
    return _mm_fmadd_ps(dd, fsum, acc);
}

/* One fp16 of each of R blocks (p + i * stride; 0 past R) as fp32 lanes. */
QAI __m128 qdot_scale16(const uint8_t *p, size_t stride, int R)
{
    uint16_t h[4] = {0, 0, 0, 0};
    for (int i = 0; i < R; i++)
        memcpy(&h[i], p + (size_t)i * stride, 2);
    return _mm_cvtph_ps(
        _mm_set_epi16(0, 0, 0, 0, (short)h[3], (short)h[2], (short)h[1], (short)h[0]));
}

/* A Q4_K super-block's 6-bit scales (*sc) and minimums (*mn), 8 of each, as fp32 lanes
 * (tdm_k_scale_min's unpacking, four sub-blocks a 32-bit word at a time). */
QAI void qdot_q4k_scale_mins(const uint8_t *scales, __m256 *sc, __m256 *mn)
{
    uint32_t u[3];
    memcpy(u, scales, 12);
    const uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    const uint64_t s8 = (u[0] & k6) | (uint64_t)((u[2] & k4) | (((u[0] >> 6) & k2) << 4)) << 32;
    const uint64_t m8 = (u[1] & k6) | (uint64_t)(((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4))
                                          << 32;
    *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)));
    *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)));
}
#endif

#ifdef QDOT_KERNEL
#ifndef QDOT_FN_ATTR
#define QDOT_FN_ATTR
#endif
#ifndef QDOT_Q8_BIAS
#define QDOT_Q8_BIAS 0
#endif
#ifndef QDOT_I16
#define QDOT_I16 0
#endif
#define QDOT_CAT_(a, b) a##b
#define QDOT_CAT(a, b)  QDOT_CAT_(a, b)

/* Q4_K: a sub-block of 32 is a Q4_1 block whose scale is d * sc and minimum -(dmin * m). */
QAI QDOT_FN_ATTR void QDOT_CAT(QDOT_KERNEL, _q4k)(const struct tdm_cpu_qtile *t, int R, int C)
{
    const size_t rb = t->row_stride, bsz = sizeof(struct block_q4_K), ahead = t->next;
#if !QDOT_I16
    const __m256i nib = _mm256_set1_epi8(0x0F);
#endif
    __m128 acc[TDM_CPU_TILE_MAX];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
        acc[c] = _mm_setzero_ps();
    const uint8_t *blk0 = t->w;
    for (int64_t sb = 0; sb < t->nb / 8; sb++, blk0 += bsz) {
        __m256 sc[4], mn[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (i >= R) {
                sc[i] = mn[i] = _mm256_setzero_ps();
                continue;
            }
            const uint8_t *blk = blk0 + (size_t)i * rb;
            qdot_prefetch(blk, ahead, 3);
            qdot_q4k_scale_mins(blk + offsetof(struct block_q4_K, scales), &sc[i], &mn[i]);
        }
        __m128 d, dmin, dw[8], dm[8];
        qdot_scales(blk0, rb, R, &d, &dmin);
        qdot_transpose4x8(sc, dw);
        qdot_transpose4x8(mn, dm);
        const __m128 ndmin = _mm_xor_ps(dmin, _mm_set1_ps(-0.0f));
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            dw[j] = _mm_mul_ps(dw[j], d);
            dm[j] = _mm_mul_ps(dm[j], ndmin);
        }
        const struct tdm_cpu_xblock *xs = t->x + sb * 8;
        for (int q = 0; q < 4; q++) {
#if QDOT_I16
            /* the group's 32 bytes as int16, bytes 0-15 and 16-31 (elements 0-15 and 16-31 of
             * sub-block 2q in their low nibbles, of 2q + 1 in their high ones) */
            __m256i qa[4], qc[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const uint8_t *qs =
                    blk0 + (size_t)i * rb + offsetof(struct block_q4_K, qs) + 32 * q;
                qa[i] = i < R ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs))
                              : _mm256_setzero_si256();
                qc[i] = i < R ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 16)))
                              : _mm256_setzero_si256();
            }
            const __m256i nib16 = _mm256_set1_epi16(0x0F);
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int j = 2 * q + half;
                __m256i w0[4], w1[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    w0[i] = half ? _mm256_srli_epi16(qa[i], 4) : _mm256_and_si256(qa[i], nib16);
                    w1[i] = half ? _mm256_srli_epi16(qc[i], 4) : _mm256_and_si256(qc[i], nib16);
                }
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    const struct tdm_cpu_xblock *xb = xs + c * t->ldx + j;
                    const __m256i v0 = _mm256_loadu_si256((const __m256i *)xb->v);
                    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(xb->v + 16));
                    __m256i p[4];
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        p[i] = _mm256_add_epi32(_mm256_madd_epi16(w0[i], v0),
                                                _mm256_madd_epi16(w1[i], v1));
                    const __m128i isum = qdot_reduce4(p[0], p[1], p[2], p[3]);
#else
            __m256i qb[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                qb[i] = i < R ? _mm256_loadu_si256(
                                    (const __m256i *)(blk0 + (size_t)i * rb +
                                                      offsetof(struct block_q4_K, qs) + 32 * q))
                              : _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int j = 2 * q + half;
                __m256i u[4];
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    u[i] = _mm256_and_si256(half ? _mm256_srli_epi16(qb[i], 4) : qb[i], nib);
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    const struct tdm_cpu_xblock *xb = xs + c * t->ldx + j;
                    const __m256i xh = _mm256_loadu_si256((const __m256i *)xb->hi);
                    const __m256i xl = _mm256_loadu_si256((const __m256i *)xb->lo);
                    const __m128i isum =
                        qdot_reduce4(QDOT_DOT1(u[0], xh, xl), QDOT_DOT1(u[1], xh, xl),
                                     QDOT_DOT1(u[2], xh, xl), QDOT_DOT1(u[3], xh, xl));
#endif
                    acc[c] = qdot_accumulate(acc[c], isum, dw[j], dm[j], xb, true);
                }
            }
        }
    }
    qdot_store(t, acc, R, C);
}

/* Q6_K: an activation block is two sub-blocks of 16, each with its own int8 scale; the 6-bit
 * values enter unsigned and their offset of 32 comes off each half's integer sum. */
QAI QDOT_FN_ATTR void QDOT_CAT(QDOT_KERNEL, _q6k)(const struct tdm_cpu_qtile *t, int R, int C)
{
    const size_t rb = t->row_stride, bsz = sizeof(struct block_q6_K), ahead = t->next;
    const __m256i nib = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    __m128 acc[TDM_CPU_TILE_MAX];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
        acc[c] = _mm_setzero_ps();
    const uint8_t *blk0 = t->w;
    for (int64_t sb = 0; sb < t->nb / 8; sb++, blk0 += bsz) {
        __m256 s0[4], s1[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (i >= R) {
                s0[i] = s1[i] = _mm256_setzero_ps();
                continue;
            }
            const uint8_t *blk = blk0 + (size_t)i * rb;
            qdot_prefetch(blk, ahead, 4);
            const __m128i s8 =
                _mm_loadu_si128((const __m128i *)(blk + offsetof(struct block_q6_K, scales)));
            s0[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
            s1[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(s8, s8)));
        }
        const __m128 d = qdot_scale16(blk0 + offsetof(struct block_q6_K, d), rb, R);
        __m128 ds[16]; /* ds[k] lane i: row i's d * scale k */
        qdot_transpose4x8(s0, ds);
        qdot_transpose4x8(s1, ds + 8);
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++)
            ds[k] = _mm_mul_ps(ds[k], d);
        const struct tdm_cpu_xblock *xs = t->x + sb * 8;
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, g = j % 4;
            const size_t lo_off = offsetof(struct block_q6_K, ql) + 64 * h + 32 * (g & 1);
            const size_t hi_off = offsetof(struct block_q6_K, qh) + 32 * h;
            __m256i u[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                if (i >= R) {
                    u[i] = _mm256_setzero_si256();
                    continue;
                }
                const uint8_t *blk = blk0 + (size_t)i * rb;
                const __m256i l4 = _mm256_loadu_si256((const __m256i *)(blk + lo_off));
                const __m256i h2 = _mm256_loadu_si256((const __m256i *)(blk + hi_off));
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(l4, 4 * (g >> 1)), nib);
                const __m256i hi =
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h2, 2 * g), two), 4);
                u[i] = _mm256_or_si256(lo, hi);
            }
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) {
                const struct tdm_cpu_xblock *xb = xs + c * t->ldx + j;
                const __m256i xh = _mm256_loadu_si256((const __m256i *)xb->hi);
                const __m256i xl = _mm256_loadu_si256((const __m256i *)xb->lo);
                __m128i i0, i1;
                qdot_reduce4_halves(QDOT_DOT1(u[0], xh, xl), QDOT_DOT1(u[1], xh, xl),
                                    QDOT_DOT1(u[2], xh, xl), QDOT_DOT1(u[3], xh, xl), &i0, &i1);
                i0 = _mm_sub_epi32(i0, _mm_set1_epi32(32 * xb->s16));
                i1 = _mm_sub_epi32(i1, _mm_set1_epi32(32 * (xb->s - xb->s16)));
                const __m128 xd = _mm_set1_ps(xb->d);
                acc[c] = _mm_fmadd_ps(_mm_mul_ps(ds[2 * j], xd), _mm_cvtepi32_ps(i0), acc[c]);
                acc[c] = _mm_fmadd_ps(_mm_mul_ps(ds[2 * j + 1], xd), _mm_cvtepi32_ps(i1), acc[c]);
            }
        }
    }
    qdot_store(t, acc, R, C);
}

#if QDOT_I16
/* Q8_0, Q4_0, Q4_1 on the 16-bit values (QDOT_I16): each weight widened to int16 once a tile
 * row, then one VPMADDWD per 16 elements a column (two per block) where the planes take four
 * multiply-adds (two VPMADDUBSW, two VPMADDWD) and Q8_0 two VPSIGNB more. The lanes group other
 * elements than QDOT_DOT1's, but their sum is the same exact integer (|w v| <= 128 * 32639). */
QAI QDOT_FN_ATTR void QDOT_CAT(QDOT_KERNEL, _i16)(const struct tdm_cpu_qtile *t, int wtype, int R,
                                                  int C)
{
    const bool q8 = wtype == TDM_CPU_W_Q8_0, q41 = wtype == TDM_CPU_W_Q4_1;
    size_t bsz, qoff;
    qdot_block_layout(wtype, &bsz, &qoff);
    const size_t rb = t->row_stride, ahead = qdot_ahead(R, t->next, (size_t)t->nb * bsz);
    const __m256i nib = _mm256_set1_epi16(0x0F);
    __m128 acc[TDM_CPU_TILE_MAX];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
        acc[c] = _mm_setzero_ps();

    const uint8_t *blk0 = t->w;
    for (int64_t b = 0; b < t->nb; b++, blk0 += bsz) {
        __m256i w0[4], w1[4]; /* row i's elements 0-15 and 16-31 as int16 */
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (i >= R) {
                w0[i] = w1[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *blk = blk0 + (size_t)i * rb;
            _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
            const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + qoff));
            if (q8) {
                w0[i] = _mm256_cvtepi8_epi16(q0);
                w1[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + qoff + 16)));
            } else { /* low nibbles are elements 0-15, high ones 16-31 */
                const __m256i q = _mm256_cvtepu8_epi16(q0);
                w0[i] = _mm256_and_si256(q, nib);
                w1[i] = _mm256_srli_epi16(q, 4);
            }
        }
        __m128 dw, dm;
        qdot_scales(blk0, rb, R, &dw, &dm);
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const struct tdm_cpu_xblock *xb = t->x + c * t->ldx + b;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)xb->v);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(xb->v + 16));
            __m256i p[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                p[i] = _mm256_add_epi32(_mm256_madd_epi16(w0[i], v0), _mm256_madd_epi16(w1[i], v1));
            __m128i isum = qdot_reduce4(p[0], p[1], p[2], p[3]);
            if (wtype == TDM_CPU_W_Q4_0) isum = _mm_sub_epi32(isum, _mm_set1_epi32(8 * xb->s));
            acc[c] = qdot_accumulate(acc[c], isum, dw, dm, xb, q41);
        }
    }

    qdot_store(t, acc, R, C);
}
#endif

QAI QDOT_FN_ATTR void QDOT_KERNEL(const struct tdm_cpu_qtile *t, int wtype, int R, int C)
{
#if QDOT_I16
    if (wtype != TDM_CPU_W_Q4_K && wtype != TDM_CPU_W_Q6_K) {
        QDOT_CAT(QDOT_KERNEL, _i16)(t, wtype, R, C);
        return;
    }
#endif
    if (wtype == TDM_CPU_W_Q4_K) {
        QDOT_CAT(QDOT_KERNEL, _q4k)(t, R, C);
        return;
    }
    if (wtype == TDM_CPU_W_Q6_K) {
        QDOT_CAT(QDOT_KERNEL, _q6k)(t, R, C);
        return;
    }
    const bool q8 = wtype == TDM_CPU_W_Q8_0, q41 = wtype == TDM_CPU_W_Q4_1;
    size_t bsz, qoff;
    qdot_block_layout(wtype, &bsz, &qoff);
    /* each row prefetches the same bytes of the next tile's rows (see matmul_avx2.c) */
    const size_t rb = t->row_stride, ahead = t->next;
    const __m256i nib = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
    __m128 acc[TDM_CPU_TILE_MAX];
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
        acc[c] = _mm_setzero_ps();

    const uint8_t *blk0 = t->w;
    for (int64_t b = 0; b < t->nb; b++, blk0 += bsz) {
        __m256i w[4], u[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (i >= R) {
                w[i] = u[i] = _mm256_setzero_si256();
                continue;
            }
            const uint8_t *blk = blk0 + (size_t)i * rb;
            _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
            if (q8) {
                w[i] = _mm256_loadu_si256((const __m256i *)(blk + qoff));
                u[i] = QDOT_Q8_BIAS ? _mm256_xor_si256(w[i], _mm256_set1_epi8(-128))
                                    : _mm256_abs_epi8(w[i]);
            } else {
                /* qs in both halves, the high half shifted by a nibble: low nibbles are
                 * elements 0-15, high ones 16-31 */
                const __m256i q =
                    _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + qoff)));
                u[i] = _mm256_and_si256(_mm256_srlv_epi64(q, nib_shift), nib);
            }
        }
        __m128 dw, dm;
        qdot_scales(blk0, rb, R, &dw, &dm);
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const struct tdm_cpu_xblock *xb = t->x + c * t->ldx + b;
            const __m256i xh = _mm256_loadu_si256((const __m256i *)xb->hi);
            const __m256i xl = _mm256_loadu_si256((const __m256i *)xb->lo);
            __m256i h[4], l[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                h[i] = q8 && !QDOT_Q8_BIAS ? _mm256_sign_epi8(xh, w[i]) : xh;
                l[i] = q8 && !QDOT_Q8_BIAS ? _mm256_sign_epi8(xl, w[i]) : xl;
            }
            __m128i isum = qdot_reduce4(QDOT_DOT1(u[0], h[0], l[0]), QDOT_DOT1(u[1], h[1], l[1]),
                                        QDOT_DOT1(u[2], h[2], l[2]), QDOT_DOT1(u[3], h[3], l[3]));
            if (wtype == TDM_CPU_W_Q4_0) isum = _mm_sub_epi32(isum, _mm_set1_epi32(8 * xb->s));
            if (q8 && QDOT_Q8_BIAS) isum = _mm_sub_epi32(isum, _mm_set1_epi32(128 * xb->s));
            acc[c] = qdot_accumulate(acc[c], isum, dw, dm, xb, q41);
        }
    }

    qdot_store(t, acc, R, C);
}

#undef QDOT_KERNEL
#undef QDOT_DOT1
#undef QDOT_FN_ATTR
#undef QDOT_Q8_BIAS
#undef QDOT_I16
#undef QDOT_CAT
#undef QDOT_CAT_
#endif
