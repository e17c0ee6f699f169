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
 * That fixes every lane's sequence of operations; the code only interleaves independent
 * chains so that they overlap (the FMA's latency, not its throughput, bounded the plain
 * loops): four positions' scores share each load of q; the V accumulation keeps eight slices
 * (64 columns) in registers across the positions, one broadcast weight a position; the heads'
 * running sums advance side by side. The chunk's maximum is taken 8 lanes at a time (exact in
 * any order; maxps returns its second operand on a NaN, so a NaN score is passed over as by
 * the scalar comparison). On the default model this made the attention of a 720-token prompt
 * about a third cheaper and decode at 2k context about a fifth faster, with the same bits
 * (bench/RESULTS.md, 2026-12-06).
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

/* acc[0 .. 64) += sum over j < cn of w[j] * v[j][d0 .. d0 + 64), j in order: eight
 * independent 8-lane chains (each lane's order is the plain loop's) */
AI void v_block64(float *acc, const float *w, const float *const *v, int cn, int d0)
{
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8), a2 = _mm256_loadu_ps(acc + 16),
           a3 = _mm256_loadu_ps(acc + 24), a4 = _mm256_loadu_ps(acc + 32),
           a5 = _mm256_loadu_ps(acc + 40), a6 = _mm256_loadu_ps(acc + 48),
           a7 = _mm256_loadu_ps(acc + 56);
    for (int j = 0; j < cn; j++) {
        const __m256 wj = _mm256_set1_ps(w[j]);
        const float *r = v[j] + d0;
        a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r), a0);
        a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 8), a1);
        a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 16), a2);
        a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 24), a3);
        a4 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 32), a4);
        a5 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 40), a5);
        a6 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 48), a6);
        a7 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 56), a7);
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
    _mm256_storeu_ps(acc + 32, a4);
    _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6);
    _mm256_storeu_ps(acc + 56, a7);
}

/* the same for 8 columns */
AI void v_block8(float *acc, const float *w, const float *const *v, int cn, int d0)
{
    __m256 a = _mm256_loadu_ps(acc);
    for (int j = 0; j < cn; j++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v[j] + d0), a);
    _mm256_storeu_ps(acc, a);
}

void tdm_cpu_attn_step_avx2(const struct tdm_cpu_attn_step *s)
{
    if (s->hd % 8 != 0 || s->vd % 8 != 0) {
        tdm_cpu_attn_step_portable(s);
        return;
    }
    const int hd = s->hd, vd = s->vd, cn = s->cn, gs = s->gs;
    float w[TDM_CPU_ATTN_GROUP][TDM_CPU_ATTN_CHUNK] __attribute__((aligned(32)));

    /* scores, four positions at a time: four independent chains share each load of q */
    for (int h = 0; h < gs; h++) {
        const float *q = s->q + (size_t)h * hd;
        int j = 0;
        for (; j + 4 <= cn; j += 4) {
            const float *k0 = s->k[j], *k1 = s->k[j + 1], *k2 = s->k[j + 2], *k3 = s->k[j + 3];
            __m256 qd = _mm256_loadu_ps(q);
            __m256 a0 = _mm256_mul_ps(qd, _mm256_loadu_ps(k0));
            __m256 a1 = _mm256_mul_ps(qd, _mm256_loadu_ps(k1));
            __m256 a2 = _mm256_mul_ps(qd, _mm256_loadu_ps(k2));
            __m256 a3 = _mm256_mul_ps(qd, _mm256_loadu_ps(k3));
            for (int d = 8; d < hd; d += 8) {
                qd = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k3 + d), a3);
            }
            w[h][j] = hsum8(a0) * s->scale;
            w[h][j + 1] = hsum8(a1) * s->scale;
            w[h][j + 2] = hsum8(a2) * s->scale;
            w[h][j + 3] = hsum8(a3) * s->scale;
        }
        for (; j < cn; j++) {
            const float *k = s->k[j];
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
            for (int d = 8; d < hd; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a);
            w[h][j] = hsum8(a) * s->scale;
        }
    }
    for (int h = 0; h < gs; h++) {
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        /* the chunk's max: exact whatever the order; a NaN score is passed over, as by the
         * plain comparison (maxps returns its second operand when one is NaN) */
        __m256 mx = _mm256_set1_ps(s->m[h]);
        int j = 0;
        for (; j + 8 <= cn; j += 8)
            mx = _mm256_max_ps(_mm256_load_ps(&w[h][j]), mx);
        float cmax = s->m[h];
        float lanes[8] __attribute__((aligned(32)));
        _mm256_store_ps(lanes, mx);
        for (int l = 0; l < 8; l++)
            if (lanes[l] > cmax) cmax = lanes[l];
        for (; j < cn; j++)
            if (w[h][j] > cmax) cmax = w[h][j];
        if (cmax > s->m[h]) {
            const float alpha = expf(s->m[h] - cmax); /* 0 on the first step */
            s->sum[h] *= alpha;
            const __m256 va = _mm256_set1_ps(alpha);
            for (int d = 0; d < vd; d += 8)
                _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), va));
            s->m[h] = cmax;
        }
        for (j = cn; j < ((cn + 7) & ~7); j++)
            w[h][j] = s->m[h]; /* lanes never read */
        const __m256 vm = _mm256_set1_ps(s->m[h]);
        for (j = 0; j < cn; j += 8)
            _mm256_store_ps(&w[h][j], exp_neg(_mm256_sub_ps(_mm256_load_ps(&w[h][j]), vm)));
    }
    /* the weights' sums, each in position order, the heads' chains side by side */
    float sums[TDM_CPU_ATTN_GROUP];
    for (int h = 0; h < gs; h++)
        sums[h] = s->sum[h];
    for (int j = 0; j < cn; j++)
        for (int h = 0; h < gs; h++)
            sums[h] += w[h][j];
    for (int h = 0; h < gs; h++)
        s->sum[h] = sums[h];
    /* V: per head, blocks of 64 columns (8 chains), then of 8 */
    for (int h = 0; h < gs; h++) {
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        const float *wh = w[h];
        int d = 0;
        for (; d + 64 <= vd; d += 64)
            v_block64(acc + d, wh, s->v, cn, d);
        for (; d < vd; d += 8)
            v_block8(acc + d, wh, s->v, cn, d);
    }
}
