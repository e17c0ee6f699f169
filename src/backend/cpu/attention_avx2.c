/*
 * The AVX2 + FMA attention step (see attention.c for the online-softmax scheme and
 * cpu_int.h for the step's contract). Used by the avx2 and avx512 levels.
 *
 * Per (head, position) the score is one 8-lane FMA chain over head_dim (the first product a
 * plain multiply), folded ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) and times scale. Weights come
 * from exp_neg below, 8 positions at a time; they are added to the running sum one by one in
 * position order. V accumulation: each 8-float slice of acc takes fma(weight_j, v_j, acc) for
 * j in position order. head_dim that is not a multiple of 8 goes to the portable step.
 *
 * exp_neg: e^x for x <= 0 by the Cody-Waite reduction x = n ln2 + r (n = round(x / ln2), ln2
 * split in a short exact high part and a low part) and the Cephes degree-7 polynomial for e^r
 * on |r| <= ln2/2, then scaling by 2^n through the exponent bits; about 1 ulp. Below -86 the
 * result is 0 (the true value is under 5e-38, and 2^n would leave the normal range).
 *
 * Threading: pure function of its arguments; scratch on the stack.
 */
#include "backend/cpu/cpu_int.h"

#include <immintrin.h>
#include <math.h>

#define AI static inline __attribute__((always_inline))

AI float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI __m256 exp_neg(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-86.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
    return _mm256_andnot_ps(under, p);
}

void tdm_cpu_attn_step_avx2(const struct tdm_cpu_attn_step *s)
{
    if (s->hd % 8 != 0 || s->vd % 8 != 0) {
        tdm_cpu_attn_step_portable(s);
        return;
    }
    const int hd = s->hd, vd = s->vd, cn = s->cn, gs = s->gs;
    float w[TDM_CPU_ATTN_GROUP][TDM_CPU_ATTN_CHUNK] __attribute__((aligned(32)));

    for (int h = 0; h < gs; h++) {
        const float *q = s->q + (size_t)h * hd;
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        float cmax = s->m[h];
        for (int j = 0; j < cn; j++) {
            const float *k = s->k[j];
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
            for (int d = 8; d < hd; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
            w[h][j] = hsum8(a) * s->scale;
            if (w[h][j] > cmax) cmax = w[h][j];
        }
        if (cmax > s->m[h]) {
            const float alpha = expf(s->m[h] - cmax); /* 0 on the first step */
            s->sum[h] *= alpha;
            const __m256 va = _mm256_set1_ps(alpha);
            for (int d = 0; d < vd; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), va));
            s->m[h] = cmax;
        }
        for (int j = cn; j < ((cn + 7) & ~7); j++)
            w[h][j] = s->m[h]; /* lanes never read */
        const __m256 vm = _mm256_set1_ps(s->m[h]);
        for (int j = 0; j < cn; j += 8)
            _mm256_store_ps(&w[h][j], exp_neg(_mm256_sub_ps(_mm256_load_ps(&w[h][j]), vm)));
        float sum = s->sum[h];
        for (int j = 0; j < cn; j++)
            sum += w[h][j];
        s->sum[h] = sum;
    }
    for (int h = 0; h < gs; h++) {
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        for (int d = 0; d < vd; d += 8) {
            __m256 a = _mm256_loadu_ps(acc + d);
            for (int j = 0; j < cn; j++)
                a = _mm256_fmadd_ps(_mm256_set1_ps(w[h][j]), _mm256_loadu_ps(s->v[j] + d), a);
            _mm256_storeu_ps(acc + d, a);
        }
    }
}
