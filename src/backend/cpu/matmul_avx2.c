/*
 * AVX2 + FMA + F16C matmul tiles (built with -mavx2 -mfma -mf16c; chosen at run time only on
 * CPUs that have all three).
 *
 * A tile keeps one 8-lane fp32 accumulator per (weight row, activation row) pair. Weights are
 * widened to fp32 in registers and reused across the tile's C activation rows:
 *   F32   loaded as is;
 *   BF16  zero-extended to 32 bits and shifted left 16 (exact);
 *   Q8_0  q widened to int32, converted, times d (the reference's own rounding);
 *   Q4_0  q in 0..15 converted, fma(q, d, -8d) (exactly (q - 8) * d rounded once, as the
 *         reference);
 *   Q4_1  fma(q, d, m) (one rounding where the reference rounds d * q and then + m).
 * Per-pair order (the same for every tile shape, which is the batch-invariance argument):
 * vectors of 8 consecutive elements are FMA'd into the accumulator in increasing order, except
 * that inside a 4-bit block the order is elements 0-7, 16-23, 8-15, 24-31 (each 8-byte half of
 * qs yields a low-nibble and a high-nibble vector); then lanes fold as
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)); then tail elements (F32/BF16 rows whose length is not a
 * multiple of 8) are added one by one; then the bias.
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

/* The fp16 at p, broadcast to 8 lanes. */
AI __m256 f16x8_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* The fp16 pair (d, m) at p, each broadcast to 8 lanes. */
AI void f16x2x8_at(const uint8_t *p, __m256 *d, __m256 *m)
{
    uint32_t dm;
    memcpy(&dm, p, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
    *d = _mm256_broadcastss_ps(f);
    *m = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

AI float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI __m256 load_bf16x8(const uint8_t *p)
{
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
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

AI void tile_avx2(const struct tdm_cpu_tile *t, int wtype, int R, int C)
{
    __m256 acc[TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX];
    const float *x = t->x;
    const int64_t ldx = t->ldx, cols = t->cols;
    const size_t rb = t->row_bytes;
    /* Decode streams weights from DRAM faster when each row prefetches the same bytes of the
     * next tile's rows; the hardware prefetcher alone leaves quantised rows latency-bound. */
    const size_t ahead = (size_t)R * rb;
#pragma GCC unroll 4
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++)
            acc[i][c] = _mm256_setzero_ps();

    int64_t k = 0;
    if (wtype == TDM_CPU_W_F32 || wtype == TDM_CPU_W_BF16) {
        for (; k + 8 <= cols; k += 8) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *row = t->w + i * rb;
                if (wtype == TDM_CPU_W_BF16) /* F32 rows stream well without help */
                    _mm_prefetch((const char *)row + ahead + 2 * k, _MM_HINT_T0);
                const __m256 w = wtype == TDM_CPU_W_F32 ? _mm256_loadu_ps((const float *)row + k)
                                                        : load_bf16x8(row + 2 * k);
#pragma GCC unroll 4
                for (int c = 0; c < C; c++)
                    acc[i][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + c * ldx + k), acc[i][c]);
            }
        }
    } else if (wtype == TDM_CPU_W_Q8_0) {
        const uint8_t *blk0 = t->w;
        for (; k < cols; k += 32, blk0 += sizeof(struct block_q8_0)) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *blk = blk0 + i * rb;
                _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
                const __m256 d = f16x8_at(blk + offsetof(struct block_q8_0, d));
                const uint8_t *qs = blk + offsetof(struct block_q8_0, qs);
#pragma GCC unroll 4
                for (int h = 0; h < 4; h++) {
                    const __m256i q =
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
                    const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d);
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++)
                        acc[i][c] =
                            _mm256_fmadd_ps(w, _mm256_loadu_ps(x + c * ldx + k + 8 * h), acc[i][c]);
                }
            }
        }
    } else { /* Q4_0, Q4_1 */
        const bool q41 = wtype == TDM_CPU_W_Q4_1;
        const size_t bsz = q41 ? sizeof(struct block_q4_1) : sizeof(struct block_q4_0);
        const size_t qoff = q41 ? offsetof(struct block_q4_1, qs) : offsetof(struct block_q4_0, qs);
        const __m256i nib = _mm256_set1_epi32(0x0F);
        const uint8_t *blk0 = t->w;
        for (; k < cols; k += 32, blk0 += bsz) {
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const uint8_t *blk = blk0 + i * rb;
                _mm_prefetch((const char *)blk + ahead, _MM_HINT_T0);
                __m256 d, m;
                if (q41) {
                    f16x2x8_at(blk, &d, &m);
                } else {
                    d = f16x8_at(blk);
                    m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
                }
                const uint8_t *qs = blk + qoff;
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i q =
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
                    const __m256 wl =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, nib)), d, m);
                    const __m256 wh =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d, m);
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        const float *xc = x + c * ldx + k + 8 * h;
                        acc[i][c] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xc), acc[i][c]);
                        acc[i][c] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xc + 16), acc[i][c]);
                    }
                }
            }
        }
    }

#pragma GCC unroll 4
    for (int c = 0; c < C; c++) {
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float s = hsum8(acc[i][c]);
            for (int64_t kk = k; kk < cols; kk++) /* F32/BF16 only */
                s += scalar_plain(wtype, t->w + i * rb, kk) * x[c * ldx + kk];
            if (t->bias) s += t->bias[i];
            t->out[c * t->ldo + i] = s;
        }
    }
}

TDM_CPU_DEF_TILES(F32, tile_avx2)
TDM_CPU_DEF_TILES(BF16, tile_avx2)
TDM_CPU_DEF_TILES(Q8_0, tile_avx2)
TDM_CPU_DEF_TILES(Q4_0, tile_avx2)
TDM_CPU_DEF_TILES(Q4_1, tile_avx2)

const tdm_cpu_tile_table tdm_cpu_tiles_avx2 = {
    TDM_CPU_TILE_TABLE(F32),  TDM_CPU_TILE_TABLE(BF16), TDM_CPU_TILE_TABLE(Q8_0),
    TDM_CPU_TILE_TABLE(Q4_0), TDM_CPU_TILE_TABLE(Q4_1),
};
