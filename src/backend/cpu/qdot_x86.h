/*
 * The x86 quantised tile (qdot.c gives the arithmetic it must reproduce), shared by qdot_avx2.c
 * and qdot_avx512.c. Included alone, it gives the common helpers; included again after
 * defining the following, it defines one variant's kernel:
 *   QDOT_KERNEL  the name of the always-inline tile kernel to define here,
 *   QDOT_FN_ATTR (optional) a target attribute the kernel needs (its multiply-add's ISA), and
 *   QDOT_DOT4    a function (u[4], h[4], l[4]) -> __m128i whose lane i is the exact int32
 *                sum over the 32 bytes of u[i] (unsigned) times 256 h[i] + l[i] (h, l signed:
 *                an activation block's two planes): the variant's own multiply-adds
 *                (VPMADDUBSW + VPMADDWD, or VPDPBUSD).
 * Everything else (unpacking a block's weights to bytes, the scales, the fp32 accumulation) is
 * the same 256/128-bit code in every variant, so the variants differ only where they may: in
 * how an exact integer is computed.
 *
 * Layout of a tile: the R <= 4 weight rows of one block are four byte vectors; for each of the
 * C activation rows one QDOT_DOT4 gives the four rows' integer sums in the lanes of one
 * register, and one fp32 register per activation row accumulates the four rows' pairs.
 * Q8_0's signed weights enter as |w| and the activation's bytes with w's sign (|w| <= 128,
 * |h|, |l| <= 127: no pair of products leaves int16); 4-bit weights enter as their nibbles.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#ifndef QDOT_X86_COMMON
#define QDOT_X86_COMMON
#define QAI static inline __attribute__((always_inline))

/* Exact int32 lane sums of four 8-lane vectors: lane i of the result is the sum of v[i]. */
QAI __m128i qdot_reduce4(__m256i a, __m256i b, __m256i c, __m256i d)
{
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
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
#endif

#ifdef QDOT_KERNEL
#ifndef QDOT_FN_ATTR
#define QDOT_FN_ATTR
#endif
QAI QDOT_FN_ATTR void QDOT_KERNEL(const struct tdm_cpu_qtile *t, int wtype, int R, int C)
{
    const bool q8 = wtype == TDM_CPU_W_Q8_0, q41 = wtype == TDM_CPU_W_Q4_1;
    const size_t bsz = q8                        ? sizeof(struct block_q8_0)
                       : wtype == TDM_CPU_W_Q4_0 ? sizeof(struct block_q4_0)
                                                 : sizeof(struct block_q4_1);
    const size_t qoff = q8                        ? offsetof(struct block_q8_0, qs)
                        : wtype == TDM_CPU_W_Q4_0 ? offsetof(struct block_q4_0, qs)
                                                  : offsetof(struct block_q4_1, qs);
    const size_t rb = t->row_bytes;
    /* each row prefetches the same bytes of the next tile's rows (see matmul_avx2.c) */
    const size_t ahead = (size_t)R * rb;
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
                u[i] = _mm256_abs_epi8(w[i]);
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
                h[i] = q8 ? _mm256_sign_epi8(xh, w[i]) : xh;
                l[i] = q8 ? _mm256_sign_epi8(xl, w[i]) : xl;
            }
            __m128i isum = QDOT_DOT4(u, h, l);
            if (wtype == TDM_CPU_W_Q4_0) isum = _mm_sub_epi32(isum, _mm_set1_epi32(8 * xb->s));
            const __m128 dd = _mm_mul_ps(dw, _mm_set1_ps(xb->d));
            const __m128 fsum = _mm_cvtepi32_ps(isum);
            if (q41)
                acc[c] =
                    _mm_add_ps(acc[c], _mm_fmadd_ps(dd, fsum, _mm_mul_ps(dm, _mm_set1_ps(xb->ds))));
            else
                acc[c] = _mm_fmadd_ps(dd, fsum, acc[c]);
        }
    }

#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
        float v[4];
        _mm_storeu_ps(v, acc[c]);
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
            t->out[c * t->ldo + i] = t->bias ? v[i] + t->bias[i] : v[i];
    }
}

#undef QDOT_KERNEL
#undef QDOT_DOT4
#undef QDOT_FN_ATTR
#endif
