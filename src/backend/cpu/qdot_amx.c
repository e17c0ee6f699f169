/*
 * Quantised tiles on the AMX int8 tiles (Sapphire Rapids and later Xeons): Q8_0, Q4_0 and Q4_1
 * weights times several activation rows quantised as qdot.c describes, with the same value for
 * every (weight row, activation row) pair as qdot.c's specification, bit for bit. matmul.c takes
 * this path for an op of at least AMX_MIN_ROWS activation rows (prefill, batched decode, a
 * speculation's verify) on an instance with amx set; one activation row keeps the AVX512-VNNI
 * tile, which gives the same bits.
 *
 * Why: the vector tiles spend most of a block on the integer sums' reduction and scales, per pair
 * (qdot_avx512.c); a tile multiply (TDPBUSD, TDPBSSD) makes a 16 x 16 block of int32 sums of 32
 * products each in one instruction, and the per-pair floating-point work then runs 16 pairs to a
 * 512-bit register. llama.cpp built native takes these tiles for its batched products and led
 * tandem 2x at prefill on this project's Xeon VM (bench/RESULTS.md).
 *
 * Layout of one product (tdm_cpu_amx_qtile): R <= 16 weight rows against one column group of
 * C <= 16 activation rows. Per activation block b, in increasing order:
 *   tmm2 (A, 16 rows x 32 bytes): the weight rows' block b as bytes: Q8_0's int8 straight from
 *        the matrix (a tile load with the row stride) when R is 16, else from a zero-padded copy;
 *        Q4's nibbles unpacked to bytes (element order: low nibbles 0-15, high ones 16-31);
 *   tmm3, tmm4 (B, 8 rows x 64 bytes): the group's hi and lo planes of block b (struct
 *        tdm_cpu_xtile, packed once per op by tdm_cpu_xtile_pack; a narrow group's both in
 *        tmm3, see below);
 *   tmm0, tmm1 (C, 16 x 16 int32; tmm5, tmm6 for odd blocks): zeroed, then H = A . hi and
 *        L = A . lo (TDPBSSD for Q8_0's signed weights, TDPBUSD for the nibbles), stored to the
 *        stack; block b + 1's tile step is issued before block b's floating-point step, so the
 *        two overlap (about 20% less time than one C pair in turn);
 *   then for each weight row i, 16 activation rows to a register: isum = 256 H + L (Q4_0: less
 *   8 s), (float)isum, dd = dw_i * d, and acc_i = fma(dd, isum, acc_i) (Q4_1: acc_i + fma(dd,
 *   isum, dm_i * ds)): qdot.c's operations, in its order. The integer sums are exact (each is
 *   a sum of 32 products of int8 by int8, |H|, |L| < 2^17, and 256 H + L the exact int32 the
 *   vector tiles compute), so each pair's value is the specification's whatever the batch, the
 *   tile shape or the thread split: the batch-invariance argument holds across the paths.
 *
 * The block of K = 32 (not the tiles' 64) is forced by the arithmetic: every block's integer sum
 * is scaled on its own before the fp32 accumulation, so two blocks cannot share a C tile.
 * Measured (bench/RESULTS.md, bench/cpu_qmatmul.c): 2.4-3.6x less CPU time than the AVX512-VNNI
 * tile from 16 activation rows, 1.6-2.2x at 8. A column group of 8 rows or fewer is packed
 * narrow (tdm_cpu_xtile_pack): the lo plane beside the hi one in the same B tile (activation
 * rows in dwords 0-7, their lo in 8-15), so one product and one C tile store serve both planes;
 * half the tile's loads and stores, 5-18% less time at 8 rows, the same bits. Not kept, for no
 * gain: plain loads for the scales with the weight tiles unpacked two blocks ahead.
 *
 * Compiled with per-function target attributes, so the library still runs on CPUs without AMX;
 * tdm_cpu_amx_available() asks CPUID, XCR0 and the Linux kernel, which must grant each process
 * the 8 KB tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before a tile
 * instruction runs (other systems: no AMX). A refusal leaves the AVX-512 tiles in place. Each
 * kernel call loads its tile configuration (a thread's first tile instruction needs one, and a
 * configuration belongs to the thread); nothing is released between calls.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define TDM_AMX_BUILD 1
#endif

bool tdm_cpu_amx_wtype(int wtype)
{
    return wtype == TDM_CPU_W_Q8_0 || wtype == TDM_CPU_W_Q4_0 || wtype == TDM_CPU_W_Q4_1;
}

void tdm_cpu_xtile_pack(const struct tdm_cpu_xblock *xq, int64_t ldx, int n_rows, int64_t nb,
                        struct tdm_cpu_xtile *out)
{
    TDM_ASSERT(n_rows >= 1 && n_rows <= TDM_CPU_AMX_TILE);
    for (int64_t b = 0; b < nb; b++) {
        struct tdm_cpu_xtile *t = &out[b];
        memset(t, 0, sizeof *t);
        const bool narrow = n_rows <= TDM_CPU_AMX_TILE / 2;
        for (int c = 0; c < n_rows; c++) {
            const struct tdm_cpu_xblock *x = &xq[(size_t)c * (size_t)ldx + (size_t)b];
            for (int k = 0; k < 8; k++) {
                memcpy(&t->hi[k][4 * c], &x->hi[4 * k], 4);
                memcpy(narrow ? &t->hi[k][32 + 4 * c] : &t->lo[k][4 * c], &x->lo[4 * k], 4);
            }
            t->d[c] = x->d;
            t->ds[c] = x->ds;
            t->s[c] = x->s;
        }
    }
}

#ifdef TDM_AMX_BUILD

#define ARCH_REQ_XCOMP_PERM_ 0x1023
#define XFEATURE_XTILEDATA_  18

static bool amx_probe(void)
{
    if (tdm_cpu_isa_detect() < TDM_CPU_ISA_AVX512) return false;
    unsigned a, b, c, d;
    /* leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8 */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return false;
    /* leaf 1: ECX bit 27 OSXSAVE, then XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA) */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
#if defined(__linux__)
    /* the kernel hands the tile state to a process only on request (Linux 5.16+) */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM_, XFEATURE_XTILEDATA_) == 0;
#else
    return false; /* no way here to know that the OS saves the tile state */
#endif
}

bool tdm_cpu_amx_available(void)
{
    static _Atomic int cached; /* 0 unknown, 1 no, 2 yes */
    int v = atomic_load_explicit(&cached, memory_order_acquire);
    if (!v) {
        v = amx_probe() ? 2 : 1; /* the request is idempotent: racing callers agree */
        atomic_store_explicit(&cached, v, memory_order_release);
    }
    return v == 2;
}

#define AMX_ATTR                                                                                   \
    __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* The tile instructions as asm with a memory clobber: gcc 12's _tile_loadd and _tile_stored
 * tell the compiler of no memory they read or write. */
#define TILE_LOAD(T, BASE, STRIDE)                                                                 \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"((const void *)(BASE)),                  \
                     "r"((long)(STRIDE))                                                           \
                     : "memory")
#define TILE_STORE(T, BASE, STRIDE)                                                                \
    __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"((void *)(BASE)),                    \
                     "r"((long)(STRIDE))                                                           \
                     : "memory")
#define TILE_ZERO(T)         __asm__ volatile("tilezero %%tmm" #T ::)
#define TILE_DPBSSD(C, A, B) __asm__ volatile("tdpbssd %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)
#define TILE_DPBUSD(C, A, B) __asm__ volatile("tdpbusd %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)

/* Palette 1: tmm0, tmm1 and tmm5, tmm6 two pairs of C tiles (16 x 64 bytes: even and odd
 * blocks), tmm2 the weights (16 x 32), tmm3, tmm4 the activation planes (8 x 64). */
struct amx_cfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(struct amx_cfg) == 64, "a tile configuration is 64 bytes");

static const struct amx_cfg AMX_CFG __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 32, 64, 64, 64, 64},
    .rows = {16, 16, 16, 8, 8, 16, 16},
};

/* What one block's tile step leaves for its floating-point step. */
struct amx_step {
    int32_t h[16][16], l[16][16]; /* H and L, [weight row][activation row] */
    float dw[16], dm[16];         /* the weight rows' scales and (Q4_1) minimums */
};

/* The block's weight tile into tmm2 and its scales into st (rows past R: zeros). */
AMX_ATTR static inline __attribute__((always_inline)) void
amx_weights(const uint8_t *blk0, size_t rb, int R, bool q8, bool q41, size_t qoff, __m512i row_off,
            __mmask16 rmask, uint8_t (*a)[32], struct amx_step *st)
{
    /* every block's first dword: its fp16 scale, then Q4_1's fp16 minimum */
    const __m512i dword =
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rmask, row_off, blk0, 1);
    _mm512_store_ps(st->dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dword)));
    if (q41)
        _mm512_store_ps(st->dm,
                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dword, 16))));
    if (q8 && R == 16) {
        TILE_LOAD(2, blk0 + qoff, rb);
        return;
    }
    if (q8) {
        for (int i = 0; i < R; i++)
            _mm256_store_si256((__m256i *)a[i],
                               _mm256_loadu_si256((const __m256i *)(blk0 + i * rb + qoff)));
    } else {
        const __m256i nib = _mm256_set1_epi8(0x0F), nib_shift = _mm256_setr_epi64x(0, 0, 4, 4);
        for (int i = 0; i < R; i++) {
            const __m256i q = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(blk0 + i * rb + qoff)));
            _mm256_store_si256((__m256i *)a[i],
                               _mm256_and_si256(_mm256_srlv_epi64(q, nib_shift), nib));
        }
    }
    TILE_LOAD(2, a, 32);
}

/* One block's tile step into the C pair (C0, C1), stored to st. */
#define AMX_BLOCK(C0, C1, B, ST)                                                                   \
    do {                                                                                           \
        const struct tdm_cpu_xtile *xt_ = t->x + (B);                                              \
        TILE_LOAD(3, xt_->hi, 64);                                                                 \
        TILE_LOAD(4, xt_->lo, 64);                                                                 \
        amx_weights(t->w + (size_t)(B)*bsz, rb, R, q8, q41, qoff, row_off, rmask, a, (ST));        \
        TILE_ZERO(C0);                                                                             \
        TILE_ZERO(C1);                                                                             \
        if (q8) {                                                                                  \
            TILE_DPBSSD(C0, 2, 3);                                                                 \
            TILE_DPBSSD(C1, 2, 4);                                                                 \
        } else {                                                                                   \
            TILE_DPBUSD(C0, 2, 3);                                                                 \
            TILE_DPBUSD(C1, 2, 4);                                                                 \
        }                                                                                          \
        TILE_STORE(C0, (ST)->h, 64);                                                               \
        TILE_STORE(C1, (ST)->l, 64);                                                               \
    } while (0)

/* One block's floating-point step: qdot.c's operations on 16 pairs a register. */
AMX_ATTR static inline __attribute__((always_inline)) void
amx_accumulate(const struct amx_step *st, const struct tdm_cpu_xtile *xt, bool q40, bool q41,
               __m512 *acc)
{
    const __m512 xd = _mm512_load_ps(xt->d);
    const __m512 xds = _mm512_load_ps(xt->ds);
    const __m512i s8 = _mm512_slli_epi32(_mm512_load_si512(xt->s), 3);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(st->h[i]), 8),
                                        _mm512_load_si512(st->l[i]));
        if (q40) isum = _mm512_sub_epi32(isum, s8);
        const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(st->dw[i]), xd);
        const __m512 f = _mm512_cvtepi32_ps(isum);
        if (q41)
            acc[i] = _mm512_add_ps(
                acc[i], _mm512_fmadd_ps(dd, f, _mm512_mul_ps(_mm512_set1_ps(st->dm[i]), xds)));
        else
            acc[i] = _mm512_fmadd_ps(dd, f, acc[i]);
    }
}

/* A narrow group's tile step: one C tile holds H (dwords 0-7 of a row) and L (8-15). */
#define AMX_BLOCK_NARROW(C0, B, ST)                                                                \
    do {                                                                                           \
        TILE_LOAD(3, t->x[(B)].hi, 64);                                                            \
        amx_weights(t->w + (size_t)(B)*bsz, rb, R, q8, q41, qoff, row_off, rmask, a, (ST));        \
        TILE_ZERO(C0);                                                                             \
        if (q8)                                                                                    \
            TILE_DPBSSD(C0, 2, 3);                                                                 \
        else                                                                                       \
            TILE_DPBUSD(C0, 2, 3);                                                                 \
        TILE_STORE(C0, (ST)->h, 64);                                                               \
    } while (0)

/* amx_accumulate for a narrow group: 8 activation rows, 8 lanes. */
AMX_ATTR static inline __attribute__((always_inline)) void
amx_accumulate_narrow(const struct amx_step *st, const struct tdm_cpu_xtile *xt, bool q40, bool q41,
                      __m256 *acc)
{
    const __m256 xd = _mm256_load_ps(xt->d);
    const __m256 xds = _mm256_load_ps(xt->ds);
    const __m256i s8 = _mm256_slli_epi32(_mm256_load_si256((const __m256i *)xt->s), 3);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        __m256i isum =
            _mm256_add_epi32(_mm256_slli_epi32(_mm256_load_si256((const __m256i *)st->h[i]), 8),
                             _mm256_load_si256((const __m256i *)&st->h[i][8]));
        if (q40) isum = _mm256_sub_epi32(isum, s8);
        const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(st->dw[i]), xd);
        const __m256 f = _mm256_cvtepi32_ps(isum);
        if (q41)
            acc[i] = _mm256_add_ps(
                acc[i], _mm256_fmadd_ps(dd, f, _mm256_mul_ps(_mm256_set1_ps(st->dm[i]), xds)));
        else
            acc[i] = _mm256_fmadd_ps(dd, f, acc[i]);
    }
}

/* The blocks are pipelined: block b + 1's tile step (into the other C pair and step buffer) is
 * issued before block b's floating-point step, so the two overlap. */
AMX_ATTR static inline __attribute__((always_inline)) void
amx_qtile(const struct tdm_cpu_amx_tile *t, int wtype, int R, int C)
{
    const bool q8 = wtype == TDM_CPU_W_Q8_0, q40 = wtype == TDM_CPU_W_Q4_0;
    const bool q41 = wtype == TDM_CPU_W_Q4_1;
    const size_t bsz = q8    ? sizeof(struct block_q8_0)
                       : q40 ? sizeof(struct block_q4_0)
                             : sizeof(struct block_q4_1);
    const size_t qoff = q8    ? offsetof(struct block_q8_0, qs)
                        : q40 ? offsetof(struct block_q4_0, qs)
                              : offsetof(struct block_q4_1, qs);
    const size_t rb = t->row_bytes;
    const int64_t nb = t->nb;
    __attribute__((aligned(64))) uint8_t a[16][32]; /* the weight tile when not read in place */
    __attribute__((aligned(64))) struct amx_step st[2];
    if (R < 16) memset(a, 0, sizeof a);
    __asm__ volatile("ldtilecfg %0" ::"m"(AMX_CFG));
    /* each weight row's offset (rows past R are masked off) */
    const __m512i row_off =
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)rb));
    const __mmask16 rmask = (__mmask16)((1u << R) - 1);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();

    if (C <= TDM_CPU_AMX_TILE / 2) { /* a narrow group (tdm_cpu_xtile_pack) */
        __m256 acc8[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            acc8[i] = _mm256_setzero_ps();
        AMX_BLOCK_NARROW(0, 0, &st[0]);
        for (int64_t b = 0; b < nb; b += 2) {
            if (b + 1 < nb) AMX_BLOCK_NARROW(5, b + 1, &st[1]);
            amx_accumulate_narrow(&st[0], t->x + b, q40, q41, acc8);
            if (b + 1 >= nb) break;
            if (b + 2 < nb) AMX_BLOCK_NARROW(0, b + 2, &st[0]);
            amx_accumulate_narrow(&st[1], t->x + b + 1, q40, q41, acc8);
        }
        __attribute__((aligned(32))) float v8[16][8];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            _mm256_store_ps(v8[i], acc8[i]);
        for (int c = 0; c < C; c++)
            for (int i = 0; i < R; i++)
                t->out[c * t->ldo + i] = t->bias ? v8[i][c] + t->bias[i] : v8[i][c];
        return;
    }
    AMX_BLOCK(0, 1, 0, &st[0]);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) AMX_BLOCK(5, 6, b + 1, &st[1]);
        amx_accumulate(&st[0], t->x + b, q40, q41, acc);
        if (b + 1 >= nb) break;
        if (b + 2 < nb) AMX_BLOCK(0, 1, b + 2, &st[0]);
        amx_accumulate(&st[1], t->x + b + 1, q40, q41, acc);
    }
    __attribute__((aligned(64))) float v[16][16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(v[i], acc[i]);
    for (int c = 0; c < C; c++)
        for (int i = 0; i < R; i++)
            t->out[c * t->ldo + i] = t->bias ? v[i][c] + t->bias[i] : v[i][c];
}

AMX_ATTR static void amx_qtile_q8_0(const struct tdm_cpu_amx_tile *t, int R, int C)
{
    amx_qtile(t, TDM_CPU_W_Q8_0, R, C);
}
AMX_ATTR static void amx_qtile_q4_0(const struct tdm_cpu_amx_tile *t, int R, int C)
{
    amx_qtile(t, TDM_CPU_W_Q4_0, R, C);
}
AMX_ATTR static void amx_qtile_q4_1(const struct tdm_cpu_amx_tile *t, int R, int C)
{
    amx_qtile(t, TDM_CPU_W_Q4_1, R, C);
}

void tdm_cpu_amx_qtile(const struct tdm_cpu_amx_tile *t, int wtype, int R, int C)
{
    TDM_ASSERT(R >= 1 && R <= TDM_CPU_AMX_TILE && C >= 1 && C <= TDM_CPU_AMX_TILE);
    switch (wtype) {
    case TDM_CPU_W_Q8_0:
        amx_qtile_q8_0(t, R, C);
        break;
    case TDM_CPU_W_Q4_0:
        amx_qtile_q4_0(t, R, C);
        break;
    case TDM_CPU_W_Q4_1:
        amx_qtile_q4_1(t, R, C);
        break;
    default:
        TDM_ASSERT(!"no AMX tile for this weight type");
    }
}

#else /* not x86-64 with GNU C */

bool tdm_cpu_amx_available(void)
{
    return false;
}

void tdm_cpu_amx_qtile(const struct tdm_cpu_amx_tile *t, int wtype, int R, int C)
{
    (void)t, (void)wtype, (void)R, (void)C;
    TDM_ASSERT(!"AMX tiles are not built on this platform");
}

#endif
