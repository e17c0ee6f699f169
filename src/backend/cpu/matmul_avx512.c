/*
 * AVX-512 matmul tiles (built with -mavx512f/bw/vl/dq plus the AVX2 set; chosen at run time
 * only on CPUs that have them). The same scheme as matmul_avx2.c with 16-lane accumulators.
 *
 * Weights are widened to fp32 in registers (no AVX512_BF16 dot products: those take bf16
 * activations, which would quantise them):
 *   F32   loaded as is;
 *   BF16  zero-extended to 32 bits and shifted left 16 (exact);
 *   Q8_0  q widened to int32, converted, times d;
 *   Q4_0  fma(q, d, -8d) (exactly (q - 8) * d rounded once);
 *   Q4_1  fma(q, d, m).
 * Per-pair order (the same for every tile shape): vectors of 16 consecutive elements in
 * increasing order (inside a 4-bit block: the low nibbles, elements 0-15, then the high
 * nibbles, 16-31); lanes fold as the upper 8 lanes added onto the lower 8, then the AVX2 fold
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)); then tail elements (F32/BF16 rows whose length is not
 * a multiple of 16) one by one; then the bias.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define AI static inline __attribute__((always_inline))

/* The 4-bit paths read d (and q4_1's m right after it) from the start of a block. */
static_assert(offsetof(struct block_q4_0, d) == 0 && offsetof(struct block_q4_1, d) == 0 &&
                  offsetof(struct block_q4_1, m) == 2,
              "4-bit block scales at the block start");

/* The fp16 at p, broadcast to 16 lanes. */
AI __m512 f16x16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* The fp16 pair (d, m) at p, each broadcast to 16 lanes. */
AI void f16x2x16_at(const uint8_t *p, __m512 *d, __m512 *m)
{
    uint32_t dm;
    memcpy(&dm, p, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    *d = _mm512_broadcastss_ps(f);
    *m = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
}

AI float hsum16(__m512 v)
{
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 v8 = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI __m512 load_bf16x16(const uint8_t *p)
{
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

AI float scalar_plain(int wtype, const uint8_t *row, int64_t k)
{
    float f;
    if (wtype == TDM_CPU_W_F32) {
        memcpy(&f, row + 4 * k, 4);
    } else {
        uint16_t h;
        memcpy(&h, row + 2 * k, 2);
        const uint32_t u = (uint32_t)h << 16;
        memcpy(&f, &u, 4);
    }
    return f;
}

AI void tile_avx512(const struct tdm_cpu_tile *t, int wtype, int R, int C)
{
    __m512 acc[TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX];
    const float *x = t->x;
    const int64_t ldx = t->ldx, cols = t->cols;
    const size_t rb = t->row_bytes;
    /* each row prefetches the same bytes of the next tile's rows (see matmul_avx2.c) */
    const size_t ahead = (size_t)R * rb;
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++)
            acc[i][c] = _mm512_setzero_ps();

    int64_t k = 0;
    if (wtype == TDM_CPU_W_F32 || wtype == TDM_CPU_W_BF16) {
        for (; k + 16 <= cols; k += 16) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *row = t->w + i * rb;
                if (wtype == TDM_CPU_W_BF16) /* F32 rows stream well without help */
                    _mm_prefetch((const char *)row + ahead + 2 * k, _MM_HINT_T0);
                const __m512 w = wtype == TDM_CPU_W_F32 ? _mm512_loadu_ps((const float *)row + k)
                                                        : load_bf16x16(row + 2 * k);
#pragma GCC unroll 4
                for (int c = 0; c < C; c++)
                    acc[i][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + c * ldx + k), acc[i][c]);
            }
        }
    } else if (wtype == TDM_CPU_W_Q8_0) {
        const uint8_t *blk0 = t->w;
        for (; k < cols; k += 32, blk0 += sizeof(struct block_q8_0)) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *blk = blk0 + i * rb;
                _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
                const __m512 d = f16x16_at(blk + offsetof(struct block_q8_0, d));
                const uint8_t *qs = blk + offsetof(struct block_q8_0, qs);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m512i q =
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * h)));
                    const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++)
                        acc[i][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + c * ldx + k + 16 * h),
                                                    acc[i][c]);
                }
            }
        }
    } else { /* Q4_0, Q4_1 */
        const bool q41 = wtype == TDM_CPU_W_Q4_1;
        const size_t bsz = q41 ? sizeof(struct block_q4_1) : sizeof(struct block_q4_0);
        const size_t qoff = q41 ? offsetof(struct block_q4_1, qs) : offsetof(struct block_q4_0, qs);
        const __m512i nib = _mm512_set1_epi32(0x0F);
        const uint8_t *blk0 = t->w;
        for (; k < cols; k += 32, blk0 += bsz) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *blk = blk0 + i * rb;
                _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
                __m512 d, m;
                if (q41) {
                    f16x2x16_at(blk, &d, &m);
                } else {
                    d = f16x16_at(blk);
                    m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
                }
                const __m512i q =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + qoff)));
                const __m512 wl =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, nib)), d, m);
                const __m512 wh =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    const float *xc = x + c * ldx + k;
                    acc[i][c] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xc), acc[i][c]);
                    acc[i][c] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xc + 16), acc[i][c]);
                }
            }
        }
    }

#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float s = hsum16(acc[i][c]);
            for (int64_t kk = k; kk < cols; kk++) /* F32/BF16 only */
                s += scalar_plain(wtype, t->w + i * rb, kk) * x[c * ldx + kk];
            if (t->bias) s += t->bias[i];
            t->out[c * t->ldo + i] = s;
        }
    }
}

TDM_CPU_DEF_TILES(F32, tile_avx512)
TDM_CPU_DEF_TILES(BF16, tile_avx512)
TDM_CPU_DEF_TILES(Q8_0, tile_avx512)
TDM_CPU_DEF_TILES(Q4_0, tile_avx512)
TDM_CPU_DEF_TILES(Q4_1, tile_avx512)

const tdm_cpu_tile_table tdm_cpu_tiles_avx512 = {
    TDM_CPU_TILE_TABLE(F32),  TDM_CPU_TILE_TABLE(BF16), TDM_CPU_TILE_TABLE(Q8_0),
    TDM_CPU_TILE_TABLE(Q4_0), TDM_CPU_TILE_TABLE(Q4_1),
};
