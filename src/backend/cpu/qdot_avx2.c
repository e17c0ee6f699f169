/*
 * Quantised tiles for AVX2 CPUs (built with -mavx2 -mfma -mf16c), in two variants chosen at run
 * time: VPMADDUBSW + VPMADDWD, and AVX-VNNI's VPDPBUSD (functions with a target attribute, run
 * only on CPUs that have it); and the vector activation quantiser. qdot_x86.h holds the tile;
 * qdot.c the arithmetic every variant reproduces bit for bit.
 */
#include "backend/cpu/qdot_x86.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* maddubs: u8 x s8 pairs to int16 (no saturation here: see qdot_x86.h); madd: pairs to int32,
 * the high plane's weighted by 256 */
QAI __m256i dot1_avx2(__m256i u, __m256i h, __m256i l)
{
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, h), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, l), _mm256_set1_epi16(1)));
}

#define QDOT_KERNEL qtile_avx2
#define QDOT_DOT1   dot1_avx2
#define QDOT_I16    1
#include "backend/cpu/qdot_x86.h"

TDM_CPU_DEF_QTILE_TABLE(tdm_cpu_qtiles_avx2, qt, , qtile_avx2)

#define VNNI __attribute__((target("avxvnni")))

/* the high plane's sums, times 256, accumulate the low plane's */
QAI VNNI __m256i dot1_avx2_vnni(__m256i u, __m256i h, __m256i l)
{
    return _mm256_dpbusd_avx_epi32(
        _mm256_slli_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, h), 8), u, l);
}

#define QDOT_KERNEL  qtile_avx2_vnni
#define QDOT_DOT1    dot1_avx2_vnni
#define QDOT_Q8_BIAS 1
#define QDOT_FN_ATTR VNNI
#include "backend/cpu/qdot_x86.h"

TDM_CPU_DEF_QTILE_TABLE(tdm_cpu_qtiles_avx2_vnni, qv, VNNI, qtile_avx2_vnni)

/* int32 x 32 (four vectors of 8, in order) to int8 x 32 in order: the packs interleave 128-bit
 * lanes, the permute undoes it. Every value is in [-127, 127]. */
static inline __attribute__((always_inline)) __m256i pack32(const __m256i *q)
{
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* int32 x 16 (two vectors of 8, in order) to int16 x 16 in order (each in [-32639, 32639]). */
static inline __attribute__((always_inline)) __m256i pack16(const __m256i *q)
{
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
}

static inline __attribute__((always_inline)) int32_t hsum_epi32(__m256i v)
{
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

/* The portable quantiser's bits (qdot.c): amax by lane maxima (exact), the same IEEE division,
 * multiplications, fused multiply-add and round-to-nearest-even, an exact integer sum. */
void tdm_cpu_quantise_avx2(const float *x, int64_t nb, struct tdm_cpu_xblock *out)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 hi127 = _mm256_set1_ps(127.0f), lo127 = _mm256_set1_ps(-127.0f);
    for (int64_t b = 0; b < nb; b++, x += 32) {
        __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float step = _mm_cvtss_f32(m4) / 127.0f;
        struct tdm_cpu_xblock *o = &out[b];
        if (_mm256_movemask_ps(nan) || !(step >= TDM_CPU_XQ_MIN_STEP && step <= FLT_MAX)) {
            memset(o, 0, sizeof *o);
            continue;
        }
        const float id = 1.0f / step;
        const __m256 idv = _mm256_set1_ps(id), idlo = _mm256_set1_ps(id * 256.0f);
        const __m256 nstep = _mm256_set1_ps(-step);
        __m256i qh[4], ql[4], v16[4];
        __m256i sum = _mm256_setzero_si256(), sum16 = sum;
        for (int k = 0; k < 4; k++) {
            const __m256 h = _mm256_max_ps(
                _mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(v[k], idv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                              hi127),
                lo127);
            const __m256 r = _mm256_fmadd_ps(nstep, h, v[k]);
            const __m256 l = _mm256_max_ps(
                _mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(r, idlo),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                              hi127),
                lo127);
            qh[k] = _mm256_cvtps_epi32(h);
            ql[k] = _mm256_cvtps_epi32(l);
            v16[k] = _mm256_add_epi32(_mm256_slli_epi32(qh[k], 8), ql[k]);
            sum = _mm256_add_epi32(sum, v16[k]);
            if (k == 1) sum16 = sum;
        }
        _mm256_storeu_si256((__m256i *)o->hi, pack32(qh));
        _mm256_storeu_si256((__m256i *)o->lo, pack32(ql));
        _mm256_storeu_si256((__m256i *)o->v, pack16(v16));
        _mm256_storeu_si256((__m256i *)(o->v + 16), pack16(v16 + 2));
        o->d = step / 256.0f;
        o->s = hsum_epi32(sum);
        o->s16 = hsum_epi32(sum16);
        o->ds = o->d * (float)o->s;
    }
}
