/*
 * Quantised activations: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights times activations quantised to
 * 16-bit integers held in two int8 planes, with integer dot products. The portable kernels live
 * here; the AVX2 and AVX-VNNI ones in qdot_avx2.c, the AVX512-VNNI one in qdot_avx512.c (an
 * AVX-512 CPU without VNNI runs the AVX2 tiles), and for Q8_0/Q4_0/Q4_1 times several
 * activation rows the AMX int8 one in qdot_amx.c (CPUs and OSes that run it). matmul.c decides
 * when this path runs (an instance created with quant_activations, a part whose weight is one of
 * those types) and quantises each activation row once per op, so the q, k and v parts of a
 * matmul_multi and the gate and up of a matmul_swiglu share one quantised input.
 *
 * Why: a 4-bit weight widened to fp32 costs more instructions than its bytes take to stream, so
 * the fp32 kernels are compute-bound at decode. Here a 32-element block of weight and activation
 * is a few byte-wise multiply-adds (VPMADDUBSW + VPMADDWD, or VPDPBUSD), and the scales come in
 * once per block. The K-quants would otherwise be widened to F32 at load (7x the bytes of Q4_K).
 *
 * Two int8 planes, not one: one int8 per activation (llama.cpp's Q8 activations) rounds each to
 * 1/254 of its block's largest, and on the default model that changed the greedy token at 3.3%
 * of the exact path's positions (bench/RESULTS.md); a second plane holding what the first left
 * (lo, in units 256 times finer) makes each activation a 16-bit integer v = 256 hi + lo for
 * twice the integer work and no more weight bytes, which a memory-bound decode does not feel.
 * The quantiser also writes v itself (xblock.v, int16): the AVX2 tiles without VPDPBUSD take
 * Q8_0, Q4_0, Q4_1 and Q4_K against it with VPMADDWD, two multiply-adds a block where the planes
 * take four (one thread, this project's 2-core EPYC: prefill +27%, batch-8 decode +20%,
 * bench/RESULTS.md).
 * The fp32 path stays (--exact-activations) and the 1e-4 fidelity tests against the numpy
 * reference run on it.
 *
 * Activation quantisation (tdm_cpu_quantise_*), per block of 32: step = amax / 127; a block
 * whose step is below TDM_CPU_XQ_MIN_STEP (zeros, values under 2^-93) or not finite, or that
 * holds a NaN, is all zero;
 * otherwise, with id = 1 / step: hi = rint(x * id), lo = rint(fma(-step, hi, x) * (256 id)),
 * each clamped to [-127, 127]; d = step / 256; s = sum (256 hi + lo); s16 = the same sum over the
 * first 16; ds = d * s. Every step is a correctly rounded IEEE operation, so the vector quantiser
 * gives the portable bits.
 *
 * A (weight row, activation row) pair, over its activation blocks b in increasing order, acc = 0
 * (a K-quant super-block of 256 is 8 consecutive activation blocks; its sub-block of 32, or its
 * two sub-blocks of 16 for Q6_K, line up with one activation block):
 *   isum = sum_j wq[j] * (256 hi[j] + lo[j]) as an exact int32 (|isum| < 2^28), where wq is
 *          Q8_0's int8, Q4_0's nibble (the offset of 8 folded in afterwards: isum - 8 * s),
 *          Q4_1's or Q4_K's nibble;
 *   dw   = the block's scale as fp32: Q8_0/Q4_0/Q4_1 their fp16 d; Q4_K d * sc (d the super-
 *          block's fp16 scale, sc the sub-block's 6-bit scale; exact);
 *   dd   = dw * d (one rounding);
 *   Q8_0, Q4_0: acc = fma(dd, (float)isum, acc);
 *   Q4_1:       acc = acc + fma(dd, (float)isum, dm * ds) (dm the block's fp16 minimum);
 *   Q4_K:       the same with dm = -(dmin * m) (dmin the super-block's fp16, m the sub-block's
 *               6-bit minimum; exact);
 *   Q6_K:       per half k = 0, 1 of the block (elements 16k to 16k + 15, one int8 scale sc_k):
 *               isum_k = sum over the half of q[j] * v[j] - 32 * (s16, or s - s16), q the 6-bit
 *               value (|isum_k| <= 32 * 32639 * 16 < 2^24: exact as a float); then
 *               acc = fma((d * sc_k) * d_x, (float)isum_k, acc), half 0 first (d * sc_k exact);
 * then acc + bias. (float)isum rounds to nearest past 2^24 (Q8_0 only), the same in every ISA.
 * These are the same operations in every ISA and every tile shape (the vector kernels only put
 * four rows' pairs in the lanes of one register, the AMX one sixteen activation rows'), so a value
 * depends on neither the ISA, the batch, the tile shape nor the thread split: the batch-invariance
 * argument, and what tests/backend/test_cpu_ops.c checks bit for bit.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

static inline float clamp127(float v)
{
    return v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
}

void tdm_cpu_quantise_portable(const float *x, int64_t nb, struct tdm_cpu_xblock *out)
{
    for (int64_t b = 0; b < nb; b++, x += 32) {
        struct tdm_cpu_xblock *o = &out[b];
        memset(o, 0, sizeof *o);
        float amax = 0;
        bool nan = false;
        for (int j = 0; j < 32; j++) {
            amax = fmaxf(amax, fabsf(x[j]));
            nan |= isnan(x[j]);
        }
        const float step = amax / 127.0f;
        if (nan || !(step >= TDM_CPU_XQ_MIN_STEP && step <= FLT_MAX)) continue; /* a zero block */
        const float id = 1.0f / step, id_lo = id * 256.0f;
        int32_t s = 0;
        for (int j = 0; j < 32; j++) {
            const float hi = clamp127(rintf(x[j] * id));
            const float lo = clamp127(rintf(fmaf(-step, hi, x[j]) * id_lo));
            o->hi[j] = (int8_t)hi;
            o->lo[j] = (int8_t)lo;
            o->v[j] = (int16_t)(256 * o->hi[j] + o->lo[j]);
            s += o->v[j];
            if (j == 15) o->s16 = s;
        }
        o->d = step / 256.0f;
        o->s = s;
        o->ds = o->d * (float)s;
    }
}

static inline float rd_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return tdm_f16_to_f32(h);
}

/* The exact integer dot product of weight block blk with activation block x's v = 256 hi + lo
 * (Q4_0's offset folded in). */
static inline int32_t block_isum(int wtype, const uint8_t *blk, const struct tdm_cpu_xblock *x)
{
    int32_t hi = 0, lo = 0;
    if (wtype == TDM_CPU_W_Q8_0) {
        const int8_t *qs = (const int8_t *)(blk + offsetof(struct block_q8_0, qs));
        for (int j = 0; j < 32; j++) {
            hi += (int32_t)qs[j] * x->hi[j];
            lo += (int32_t)qs[j] * x->lo[j];
        }
        return 256 * hi + lo;
    }
    const uint8_t *qs = blk + (wtype == TDM_CPU_W_Q4_0 ? offsetof(struct block_q4_0, qs)
                                                       : offsetof(struct block_q4_1, qs));
    for (int j = 0; j < 16; j++) {
        const int32_t a = qs[j] & 0x0F, b = qs[j] >> 4;
        hi += a * x->hi[j] + b * x->hi[j + 16];
        lo += a * x->lo[j] + b * x->lo[j + 16];
    }
    const int32_t isum = 256 * hi + lo;
    return wtype == TDM_CPU_W_Q4_0 ? isum - 8 * x->s : isum;
}

static inline size_t block_bytes(int wtype)
{
    return wtype == TDM_CPU_W_Q8_0   ? sizeof(struct block_q8_0)
           : wtype == TDM_CPU_W_Q4_0 ? sizeof(struct block_q4_0)
                                     : sizeof(struct block_q4_1);
}

/* The pair's value as the top comment defines it. */
static inline float pair_dot(int wtype, const uint8_t *row, const struct tdm_cpu_xblock *x,
                             int64_t nb)
{
    const size_t bsz = block_bytes(wtype);
    float acc = 0;
    for (int64_t b = 0; b < nb; b++, row += bsz, x++) {
        const float dd = rd_f16(row) * x->d; /* d is every block's first field */
        const float isum = (float)block_isum(wtype, row, x);
        if (wtype == TDM_CPU_W_Q4_1)
            acc = acc + fmaf(dd, isum, rd_f16(row + offsetof(struct block_q4_1, m)) * x->ds);
        else
            acc = fmaf(dd, isum, acc);
    }
    return acc;
}

/* The 6-bit scale and minimum of Q4_K sub-block j as fp32 lanes of the pair: dw = d * sc and
 * dm = -(dmin * m), both exact. */
static inline void q4k_sub_scales(const uint8_t *sblk, int j, float *dw, float *dm)
{
    uint8_t sc, m;
    tdm_k_scale_min(sblk + offsetof(struct block_q4_K, scales), j, &sc, &m);
    *dw = rd_f16(sblk + offsetof(struct block_q4_K, d)) * (float)sc;
    *dm = -(rd_f16(sblk + offsetof(struct block_q4_K, dmin)) * (float)m);
}

/* Sub-block j's 32 nibbles of a Q4_K super-block against activation block x. */
static inline int32_t q4k_isum(const uint8_t *sblk, int j, const struct tdm_cpu_xblock *x)
{
    const uint8_t *qs = sblk + offsetof(struct block_q4_K, qs) + 32 * (j / 2);
    const int shift = 4 * (j & 1);
    int32_t hi = 0, lo = 0;
    for (int l = 0; l < 32; l++) {
        const int32_t q = (qs[l] >> shift) & 0x0F;
        hi += q * x->hi[l];
        lo += q * x->lo[l];
    }
    return 256 * hi + lo;
}

/* The 6-bit value of element l of activation block j (0..7) of a Q6_K super-block. */
static inline int32_t q6k_q(const uint8_t *sblk, int j, int l)
{
    const int h = j / 4, g = j % 4;
    const uint8_t *ql = sblk + offsetof(struct block_q6_K, ql) + 64 * h + 32 * (g & 1);
    const uint8_t *qh = sblk + offsetof(struct block_q6_K, qh) + 32 * h;
    return ((ql[l] >> (4 * (g >> 1))) & 0x0F) | (((qh[l] >> (2 * g)) & 3) << 4);
}

/* The pair's value for a K-quant row (the top comment defines it). */
static inline float pair_dot_k(int wtype, const uint8_t *row, const struct tdm_cpu_xblock *x,
                               int64_t nb)
{
    float acc = 0;
    if (wtype == TDM_CPU_W_Q4_K) {
        for (int64_t sb = 0; sb < nb / 8; sb++, row += sizeof(struct block_q4_K))
            for (int j = 0; j < 8; j++, x++) {
                float dw, dm;
                q4k_sub_scales(row, j, &dw, &dm);
                const float dd = dw * x->d;
                acc = acc + fmaf(dd, (float)q4k_isum(row, j, x), dm * x->ds);
            }
        return acc;
    }
    for (int64_t sb = 0; sb < nb / 8; sb++, row += sizeof(struct block_q6_K)) {
        const float d = rd_f16(row + offsetof(struct block_q6_K, d));
        const int8_t *sc = (const int8_t *)(row + offsetof(struct block_q6_K, scales));
        for (int j = 0; j < 8; j++, x++) {
            int32_t hi[2] = {0, 0}, lo[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                const int32_t q = q6k_q(row, j, l);
                hi[l / 16] += q * x->hi[l];
                lo[l / 16] += q * x->lo[l];
            }
            const int32_t off[2] = {32 * x->s16, 32 * (x->s - x->s16)};
            for (int k = 0; k < 2; k++) {
                const int32_t isum = 256 * hi[k] + lo[k] - off[k];
                acc = fmaf((d * (float)sc[2 * j + k]) * x->d, (float)isum, acc);
            }
        }
    }
    return acc;
}

static inline void qtile_portable(const struct tdm_cpu_qtile *t, int wtype, int R, int C)
{
    for (int c = 0; c < C; c++)
        for (int i = 0; i < R; i++) {
            const uint8_t *row = t->w + (size_t)i * t->row_stride;
            const struct tdm_cpu_xblock *x = t->x + c * t->ldx;
            float s = wtype >= TDM_CPU_W_Q4_K ? pair_dot_k(wtype, row, x, t->nb)
                                              : pair_dot(wtype, row, x, t->nb);
            if (t->bias) s = s + t->bias[i * t->ldr];
            t->out[c * t->ldo + i * t->ldr] = s;
        }
}

static_assert(offsetof(struct block_q8_0, d) == 0 && offsetof(struct block_q4_0, d) == 0 &&
                  offsetof(struct block_q4_1, d) == 0,
              "every block's scale first");

TDM_CPU_DEF_QTILE_TABLE(tdm_cpu_qtiles_portable, qt, , qtile_portable)
