/*
 * KV elements of 2-byte types to and from fp32 with AVX2 and F16C, 8 at a time (cpu_int.h has
 * the contract; kv_convert.c is the portable twin, and these give its bits):
 * - bf16 to fp32: the 16 bits shifted into the high half;
 * - fp32 to bf16: u + 0x7fff + ((u >> 16) & 1), high half; a NaN becomes (u >> 16) | 0x40;
 * - f16 both ways: F16C, round to nearest even; a NaN becomes sign | 0x7e00, as the portable
 *   conversion makes it (F16C would keep payload bits).
 * Tails (n not a multiple of 8) go through the portable functions.
 *
 * Threading: pure functions.
 */
#include "backend/cpu/cpu_int.h"

#include <immintrin.h>

void tdm_cpu_kv_widen_avx2(enum tdm_dtype dt, const uint16_t *src, float *dst, int n)
{
    int i = 0;
    if (dt == TDM_DTYPE_BF16) {
        for (; i + 8 <= n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    } else {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
    if (i < n) tdm_cpu_kv_widen_portable(dt, src + i, dst + i, n - i);
}

void tdm_cpu_kv_narrow_avx2(enum tdm_dtype dt, const float *src, uint16_t *dst, int n)
{
    int i = 0;
    if (dt == TDM_DTYPE_BF16) {
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
        for (; i + 8 <= n; i += 8) {
            const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, odd)), 16);
            const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
            r = _mm256_blendv_epi8(r, q, nan);
            /* 8 x 32-bit values under 2^16 to 8 x 16-bit, in order */
            const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
            _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi32(lo, hi));
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(src + i);
            __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* NaN lanes: keep sign | 0x7e00 (the quiet bit), drop the payload */
            const __m256 isnan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
            const __m128i m32lo = _mm256_castsi256_si128(_mm256_castps_si256(isnan));
            const __m128i m32hi = _mm256_extracti128_si256(_mm256_castps_si256(isnan), 1);
            const __m128i m16 = _mm_packs_epi32(m32lo, m32hi);
            const __m128i keep = _mm_or_si128(_mm_andnot_si128(m16, _mm_set1_epi16(-1)),
                                              _mm_and_si128(m16, _mm_set1_epi16((short)0xfe00)));
            h = _mm_and_si128(h, keep);
            _mm_storeu_si128((__m128i *)(dst + i), h);
        }
    }
    if (i < n) tdm_cpu_kv_narrow_portable(dt, src + i, dst + i, n - i);
}
