/*
 * Matmul: out[i][r] = sum_c x[i][c] * W[r][c] (+ bias[r]), with W in F32, BF16, Q8_0, Q4_0,
 * Q4_1, Q4_K or Q6_K and the activations x in fp32 (the K-quants' fp32 tiles are portable code at
 * every level: a fallback, since the loader widens K-quants to F32 for an fp32 run). Also the
 * portable fp32 kernels and the one-row dequantiser that embed uses.
 *
 * Two paths for quantised weights. Exact (fp32 activations): weights are expanded to fp32 in
 * registers (exactly: each dequantised weight is the same float the reference dequantiser
 * yields, up to one rounding for q4_1) and multiplied with fp32 activations, which keeps the
 * backend within 1e-4 relative of an fp32 reference. Quantised (an instance created with
 * quant_activations): Q8_0, Q4_0, Q4_1, Q4_K and Q6_K parts take the input quantised to 16-bit
 * integers (two int8 planes a block of 32), once per op (mm_quantise: the parts of a matmul_multi
 * and a matmul_swiglu share it), and run qdot.c's integer tiles; F32 and BF16 parts of the same op
 * keep fp32 x. On an instance with amx set (cpu.c), the Q8_0, Q4_0 and Q4_1 parts of an op of at
 * least AMX_MIN_ROWS activation rows run on the AMX int8 tiles instead (qdot_amx.c): the
 * quantised rows are also laid out once per op as tiles of 16 activation rows (tdm_cpu_xtile),
 * and the parts walk 16 weight rows x 16 activation rows at a time. The same bits as the other
 * tiles, so a row's value does not depend on which path its op took.
 *
 * Work split: the weight rows are divided over the pool's threads (tdm_split_range, chunks of
 * 16 rows so that no two threads write one cache line of out). matmul_multi (q, k and v of one
 * input) runs as one pool job in which each thread takes its share of every weight in turn,
 * and matmul_swiglu computes the gate and up tiles of the same rows back to back and applies
 * silu(gate) * up to the tile before it moves on: both cut the pool hand-offs (each a barrier
 * of all threads) per decoded token. Each thread walks its rows in tiles of R weight rows x C
 * activation rows (cpu_int.h): n == 1 (decode) streams R rows at
 * once against the single activation row, which keeps several independent FMA chains in
 * flight while the weights stream from memory (a quantised part's R rows are R runs of the
 * thread's share apart, each its own stream: mm_rows); n > 1 (prefill) keeps a block of RB weight
 * rows hot in cache and runs it against IB activation rows, dequantising each weight vector once
 * per C activation rows.
 *
 * Determinism: every tile shape (fp32 or quantised) performs the same operations, in the same
 * order, for each (weight row, activation row) pair, and each activation row is quantised alone, so
 * a value never depends on n, on the thread count or on where a tile boundary fell, nor on whether
 * the product ran alone, in a matmul_multi or in a matmul_swiglu. The exception is F32 weights with
 * n > 1, which go to OpenBLAS sgemm (blocking depends on n) unless the instance was created with
 * batch_invariant; matmul_swiglu never uses OpenBLAS (its tiles are fused), so there it matches the
 * batch_invariant matmul.
 *
 * Portable kernel order, per pair: 8 lanes; lane l sums the products of elements 8j + l in
 * increasing j (products and sums rounded separately: ISO C11 does not contract to FMA), then
 * lanes fold as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then any tail elements (F32/BF16 rows
 * whose length is not a multiple of 8) are added one by one, then the bias.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"

#include <cblas.h>
#include <stddef.h>
#include <string.h>

#define RB 16 /* weight rows kept hot per prefill block */
#define IB 64 /* activation rows per prefill block */

/* ---- dequantisation of one 32-element chunk, natural element order ---- */

static inline float rd_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return tdm_f16_to_f32(h);
}

/* Elements [k, k + 32) of a row; k is a multiple of 32. Quantised rows hold blocks of 32. */
static inline void deq_chunk32(int wtype, const uint8_t *row, int64_t k, float *dst)
{
    switch (wtype) {
    case TDM_CPU_W_F32:
        memcpy(dst, row + 4 * k, 32 * sizeof(float));
        break;
    case TDM_CPU_W_BF16:
        for (int j = 0; j < 32; j++) {
            uint16_t h;
            memcpy(&h, row + 2 * (k + j), 2);
            const uint32_t u = (uint32_t)h << 16;
            memcpy(&dst[j], &u, 4);
        }
        break;
    case TDM_CPU_W_Q8_0: {
        const uint8_t *blk = row + (k / 32) * sizeof(struct block_q8_0);
        const float d = rd_f16(blk + offsetof(struct block_q8_0, d));
        const int8_t *qs = (const int8_t *)(blk + offsetof(struct block_q8_0, qs));
        for (int j = 0; j < 32; j++)
            dst[j] = (float)qs[j] * d;
        break;
    }
    case TDM_CPU_W_Q4_0: {
        const uint8_t *blk = row + (k / 32) * sizeof(struct block_q4_0);
        const float d = rd_f16(blk + offsetof(struct block_q4_0, d));
        const uint8_t *qs = blk + offsetof(struct block_q4_0, qs);
        for (int j = 0; j < 16; j++) {
            dst[j] = (float)((qs[j] & 0x0F) - 8) * d;
            dst[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
        break;
    }
    case TDM_CPU_W_Q4_1: {
        const uint8_t *blk = row + (k / 32) * sizeof(struct block_q4_1);
        const float d = rd_f16(blk + offsetof(struct block_q4_1, d));
        const float m = rd_f16(blk + offsetof(struct block_q4_1, m));
        const uint8_t *qs = blk + offsetof(struct block_q4_1, qs);
        for (int j = 0; j < 16; j++) {
            const float lo = d * (float)(qs[j] & 0x0F);
            const float hi = d * (float)(qs[j] >> 4);
            dst[j] = lo + m;
            dst[j + 16] = hi + m;
        }
        break;
    }
    case TDM_CPU_W_Q4_K: { /* sub-block j of super-block k / 256 (quant.c's deq_k_super) */
        const uint8_t *blk = row + (k / 256) * sizeof(struct block_q4_K);
        const int j = (int)(k % 256) / 32;
        uint8_t sc, mn;
        tdm_k_scale_min(blk + offsetof(struct block_q4_K, scales), j, &sc, &mn);
        const float d = rd_f16(blk + offsetof(struct block_q4_K, d)) * (float)sc;
        const float m = rd_f16(blk + offsetof(struct block_q4_K, dmin)) * (float)mn;
        const uint8_t *qs = blk + offsetof(struct block_q4_K, qs) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            const float p = d * (float)((qs[l] >> (4 * (j & 1))) & 0x0F);
            dst[l] = p - m;
        }
        break;
    }
    case TDM_CPU_W_Q6_K: { /* group g of half h (quant.c's deq_q6_K) */
        const uint8_t *blk = row + (k / 256) * sizeof(struct block_q6_K);
        const int j = (int)(k % 256) / 32, h = j / 4, g = j % 4;
        const float d = rd_f16(blk + offsetof(struct block_q6_K, d));
        const uint8_t *ql = blk + offsetof(struct block_q6_K, ql) + 64 * h + 32 * (g & 1);
        const uint8_t *qh = blk + offsetof(struct block_q6_K, qh) + 32 * h;
        const int8_t *sc = (const int8_t *)(blk + offsetof(struct block_q6_K, scales));
        for (int l = 0; l < 32; l++) {
            const int q =
                (((ql[l] >> (4 * (g >> 1))) & 0x0F) | (((qh[l] >> (2 * g)) & 3) << 4)) - 32;
            const float ds = d * (float)sc[8 * h + 2 * g + l / 16];
            dst[l] = ds * (float)q;
        }
        break;
    }
    default:
        TDM_ASSERT(!"unsupported weight type");
    }
}

/* One element of an F32 or BF16 row. */
static inline float elem_plain(int wtype, const uint8_t *row, int64_t k)
{
    if (wtype == TDM_CPU_W_F32) {
        float f;
        memcpy(&f, row + 4 * k, 4);
        return f;
    }
    uint16_t h;
    memcpy(&h, row + 2 * k, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void tdm_cpu_weight_row(const struct tdm_weight *w, int64_t row, float *dst)
{
    const int wtype = tdm_cpu_wtype_of(w->dtype);
    TDM_ASSERT(wtype >= 0);
    const uint8_t *p = (const uint8_t *)w->data + (size_t)row * w->row_bytes;
    int64_t k = 0;
    for (; k + 32 <= w->cols; k += 32)
        deq_chunk32(wtype, p, k, dst + k);
    for (; k < w->cols; k++)
        dst[k] = elem_plain(wtype, p, k); /* F32/BF16 only */
}

/* ---- portable tile kernel ---- */

static inline float fold8(const float *l)
{
    const float a = l[0] + l[4], b = l[1] + l[5], c = l[2] + l[6], d = l[3] + l[7];
    return (a + c) + (b + d);
}

static inline void tile_portable(const struct tdm_cpu_tile *t, int wtype, int R, int C)
{
    const int64_t cols = t->cols;
    for (int i = 0; i < R; i++) {
        const uint8_t *row = t->w + (size_t)i * t->row_bytes;
        float acc[TDM_CPU_TILE_MAX][8] = {{0}};
        float wv[32];
        int64_t k = 0;
        for (; k + 32 <= cols; k += 32) {
            deq_chunk32(wtype, row, k, wv);
            for (int c = 0; c < C; c++) {
                const float *x = t->x + c * t->ldx + k;
                for (int j = 0; j < 32; j += 8)
                    for (int l = 0; l < 8; l++)
                        acc[c][l] += wv[j + l] * x[j + l];
            }
        }
        for (; k + 8 <= cols; k += 8) { /* F32/BF16 only */
            for (int l = 0; l < 8; l++)
                wv[l] = elem_plain(wtype, row, k + l);
            for (int c = 0; c < C; c++) {
                const float *x = t->x + c * t->ldx + k;
                for (int l = 0; l < 8; l++)
                    acc[c][l] += wv[l] * x[l];
            }
        }
        for (int c = 0; c < C; c++) {
            float s = fold8(acc[c]);
            for (int64_t kk = k; kk < cols; kk++)
                s += elem_plain(wtype, row, kk) * t->x[c * t->ldx + kk];
            if (t->bias) s += t->bias[i];
            t->out[c * t->ldo + i] = s;
        }
    }
}

TDM_CPU_DEF_TILES(F32, tile_portable)
TDM_CPU_DEF_TILES(BF16, tile_portable)
TDM_CPU_DEF_TILES(Q8_0, tile_portable)
TDM_CPU_DEF_TILES(Q4_0, tile_portable)
TDM_CPU_DEF_TILES(Q4_1, tile_portable)
TDM_CPU_DEF_TILES(Q4_K, tile_portable)
TDM_CPU_DEF_TILES(Q6_K, tile_portable)

const tdm_cpu_tile_table tdm_cpu_tiles_portable = {
    TDM_CPU_TILE_TABLE(F32),  TDM_CPU_TILE_TABLE(BF16), TDM_CPU_TILE_TABLE(Q8_0),
    TDM_CPU_TILE_TABLE(Q4_0), TDM_CPU_TILE_TABLE(Q4_1), TDM_CPU_TILE_TABLE(Q4_K),
    TDM_CPU_TILE_TABLE(Q6_K),
};

/* ---- driver ---- */

/* One weight of a job and where its product goes. */
struct mm_part {
    const struct tdm_weight *w;
    int wtype;
    bool blas; /* F32 times several rows on an instance without batch_invariant */
    bool q;    /* on the quantised activations (qdot.c) */
    bool amx;  /* q, on the AMX tiles (qdot_amx.c) */
    const float *bias;
    float *out;
};

/* A matmul, a matmul_multi (n_parts products of x, each thread taking its share of every
 * part) or a matmul_swiglu (parts[0] gate, parts[1] up, out = parts[0].out). */
struct mm_job {
    const struct tdm_cpu_kernels *k;
    const float *x;
    int n;
    int n_parts;
    bool swiglu;
    const struct tdm_cpu_xblock *xq; /* [n][cols / 32] x quantised, when a part is q */
    const struct tdm_cpu_xtile *xt;  /* [ceil(n / 16)][cols / 32] xq as tiles, when a part is amx */
    struct mm_part parts[TDM_MATMUL_MULTI_MAX];
};

/* Where one tile's values go: out[c * ldo + j * ldr] for activation row c and tile row j. */
struct mm_out {
    float *out;
    int64_t ldo, ldr;
};

/* Weight rows r + j * q (j < R) against activation rows [i, i + C), written to o. q is 1 (a
 * tile of adjacent rows) but in the decode walk of a quantised part (mm_rows). */
static void run_tile(const struct mm_job *job, const struct mm_part *p, int64_t r, int64_t q, int i,
                     int R, int C, struct mm_out o)
{
    const struct tdm_weight *w = p->w;
    if (p->q) {
        const int64_t nb = w->cols / 32;
        const struct tdm_cpu_qtile t = {
            .w = (const uint8_t *)w->data + (size_t)r * w->row_bytes,
            .row_stride = (size_t)q * w->row_bytes,
            /* the walk's next tile: the next R rows, or each row's successor when strided */
            .next = (q == 1 ? (size_t)R : 1) * w->row_bytes,
            .nb = nb,
            .x = job->xq + (size_t)i * (size_t)nb,
            .ldx = nb,
            .out = o.out,
            .ldo = o.ldo,
            .ldr = o.ldr,
            .bias = p->bias ? p->bias + r : NULL,
        };
        job->k->qtile[p->wtype - TDM_CPU_W_Q8_0][R - 1][C - 1](&t);
        return;
    }
    TDM_ASSERT(q == 1 && o.ldr == 1);
    const struct tdm_cpu_tile t = {
        .w = (const uint8_t *)w->data + (size_t)r * w->row_bytes,
        .row_bytes = w->row_bytes,
        .cols = w->cols,
        .x = job->x + (size_t)i * (size_t)w->cols,
        .ldx = w->cols,
        .out = o.out,
        .ldo = o.ldo,
        .bias = p->bias ? p->bias + r : NULL,
    };
    /* the K-quants' fp32 tiles are the portable ones at every level (a fallback: the loader keeps
     * K-quant blocks for the CPU only when its activations are quantised) */
    const tdm_cpu_tile_fn(*tiles)[TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX] =
        p->wtype >= TDM_CPU_W_Q4_K ? tdm_cpu_tiles_portable : job->k->tile;
    tiles[p->wtype][R - 1][C - 1](&t);
}

/* As run_tile on the AMX tiles: adjacent rows, R, C <= 16, i a multiple of 16. */
static void run_tile_amx(const struct mm_job *job, const struct mm_part *p, int64_t r, int i, int R,
                         int C, struct mm_out o)
{
    const struct tdm_weight *w = p->w;
    TDM_ASSERT(o.ldr == 1);
    const int64_t nb = w->cols / 32;
    const struct tdm_cpu_amx_tile t = {
        .w = (const uint8_t *)w->data + (size_t)r * w->row_bytes,
        .row_bytes = w->row_bytes,
        .nb = nb,
        .x = job->xt + (size_t)(i / TDM_CPU_AMX_TILE) * (size_t)nb,
        .out = o.out,
        .ldo = o.ldo,
        .bias = p->bias ? p->bias + r : NULL,
    };
    tdm_cpu_amx_qtile(&t, p->wtype, R, C);
}

static void any_tile(const struct mm_job *job, const struct mm_part *p, int64_t r, int64_t q, int i,
                     int R, int C, struct mm_out o)
{
    if (p->amx)
        run_tile_amx(job, p, r, i, R, C, o);
    else
        run_tile(job, p, r, q, i, R, C, o);
}

/* The tile of rows r + j * q (j < R) and activation rows [i, i + C) of one part, into that
 * part's output. */
static void part_tile(const struct mm_job *job, const struct mm_part *p, int64_t r, int64_t q,
                      int i, int R, int C)
{
    const int64_t rows = p->w->rows;
    any_tile(job, p, r, q, i, R, C,
             (struct mm_out){p->out + (size_t)i * (size_t)rows + (size_t)r, rows, q});
}

/* The SwiGLU tile at (r, q, i): the gate tile into out, the up tile into scratch, then
 * out = silu(gate) * up on the tile. */
static void swiglu_tile(const struct mm_job *job, int64_t r, int64_t q, int i, int R, int C)
{
    const struct mm_part *gate = &job->parts[0], *up = &job->parts[1];
    const int64_t rows = gate->w->rows;
    float *out = gate->out + (size_t)i * (size_t)rows + (size_t)r;
    float u[TDM_CPU_AMX_TILE * TDM_CPU_AMX_TILE]; /* [C][R] */
    any_tile(job, gate, r, q, i, R, C, (struct mm_out){out, rows, q});
    any_tile(job, up, r, q, i, R, C, (struct mm_out){u, R, 1});
    for (int c = 0; c < C; c++)
        for (int j = 0; j < R; j++)
            out[c * rows + j * q] = tdm_cpu_silu_mul1(out[c * rows + j * q], u[c * R + j]);
}

/* One tile of mm_rows' walk: of part p, or of the SwiGLU pair when p is NULL. */
static void walk_tile(const struct mm_job *job, const struct mm_part *p, int64_t r, int64_t q,
                      int i, int R, int C)
{
    if (p)
        part_tile(job, p, r, q, i, R, C);
    else
        swiglu_tile(job, r, q, i, R, C);
}

/* Weight rows per prefill tile: the quantised tiles hold a row per lane of a 4-lane register. */
static int prefill_rows(const struct tdm_cpu_kernels *k, const struct mm_part *p)
{
    return p->q && k->isa != TDM_CPU_ISA_PORTABLE ? TDM_CPU_TILE_MAX : k->prefill_r[p->wtype];
}

/* Weight rows [r0, r1) of part p (or of the SwiGLU pair when p is NULL) against all
 * activation rows, in tiles (the top comment gives the walk). */
static void mm_rows(const struct mm_job *job, const struct mm_part *p, int64_t r0, int64_t r1)
{
    const int R_prefill =
        p ? prefill_rows(job->k, p)
          : TDM_MIN(prefill_rows(job->k, &job->parts[0]), prefill_rows(job->k, &job->parts[1]));
    if (job->n == 1) {
        /* Quantised parts stride: the thread's rows are R runs of q rows, and tile t takes row t
         * of each run, so that each tile row streams through memory on its own. Four adjacent
         * short rows (a 576-column row of Q8_0 is 612 bytes) read the LM head at 8 GB/s on one
         * core, four runs 12 GB/s (bench/RESULTS.md, 2026-12-07). The rows past R runs, and
         * fp32-activation parts, take adjacent tiles. */
        const int R = job->k->decode_r;
        const bool strided = p ? p->q : job->parts[0].q && job->parts[1].q;
        const int64_t q = strided ? (r1 - r0) / R : 0;
        for (int64_t t = 0; t < q; t++)
            walk_tile(job, p, r0 + t, q, 0, R, 1);
        for (int64_t r = r0 + R * q; r < r1; r += R)
            walk_tile(job, p, r, 1, 0, (int)TDM_MIN(R, r1 - r), 1);
        return;
    }
    if (p ? p->amx : job->parts[0].amx && job->parts[1].amx) {
        /* 16 x 16 tiles; a block of IB activation rows (column groups of 16) at a time, so that
         * a 16-row weight panel stays in cache across its groups */
        enum { T = TDM_CPU_AMX_TILE };
        static_assert(IB % T == 0, "prefill blocks hold whole column groups");
        for (int i0 = 0; i0 < job->n; i0 += IB) {
            const int i1 = TDM_MIN(job->n, i0 + IB);
            for (int64_t r = r0; r < r1; r += T) {
                const int rr = (int)TDM_MIN(T, r1 - r);
                for (int i = i0; i < i1; i += T) {
                    const int cc = TDM_MIN(T, i1 - i);
                    walk_tile(job, p, r, 1, i, rr, cc);
                }
            }
        }
        return;
    }
    const int R = R_prefill, C = job->k->prefill_c;
    for (int i0 = 0; i0 < job->n; i0 += IB) {
        const int i1 = TDM_MIN(job->n, i0 + IB);
        for (int64_t rb = r0; rb < r1; rb += RB) {
            const int64_t rb1 = TDM_MIN(r1, rb + RB);
            for (int i = i0; i < i1; i += C) {
                const int cc = TDM_MIN(C, i1 - i);
                for (int64_t r = rb; r < rb1; r += R) {
                    const int rr = (int)TDM_MIN(R, rb1 - r);
                    walk_tile(job, p, r, 1, i, rr, cc);
                }
            }
        }
    }
}

/* F32 weights, several rows: OpenBLAS on weight rows [r0, r1) of part p. */
static void sgemm_rows(const struct mm_job *job, const struct mm_part *p, int64_t r0, int64_t r1)
{
    const struct tdm_weight *w = p->w;
    if (r1 <= r0) return;
    const float *wdata = (const float *)w->data + (size_t)r0 * (size_t)w->cols;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, job->n, (int)(r1 - r0), (int)w->cols, 1.0f,
                job->x, (int)w->cols, wdata, (int)w->cols, 0.0f, p->out + r0, (int)w->rows);
    if (p->bias)
        for (int i = 0; i < job->n; i++)
            for (int64_t r = r0; r < r1; r++)
                p->out[(size_t)i * w->rows + r] += p->bias[r];
}

static void mm_worker(void *ctx, int ith, int nth)
{
    const struct mm_job *job = ctx;
    int64_t r0, r1;
    if (job->swiglu) {
        tdm_split_range(job->parts[0].w->rows, ith, nth, 16, &r0, &r1);
        mm_rows(job, NULL, r0, r1);
        return;
    }
    for (int j = 0; j < job->n_parts; j++) {
        const struct mm_part *p = &job->parts[j];
        tdm_split_range(p->w->rows, ith, nth, 16, &r0, &r1);
        if (p->blas)
            sgemm_rows(job, p, r0, r1);
        else
            mm_rows(job, p, r0, r1);
    }
}

/* Activation rows from which an op's Q8_0/Q4_0/Q4_1 parts take the AMX tiles: below, a 16 x 16
 * tile would be mostly padding and the AVX512-VNNI tiles are as fast. */
#define AMX_MIN_ROWS 6

static struct mm_part make_part(const struct tdm_cpu *cpu, const struct tdm_weight *w, int n,
                                const float *bias, float *out)
{
    const int wtype = tdm_cpu_wtype_of(w->dtype);
    TDM_ASSERT(wtype >= 0 && w->row_bytes == tdm_dtype_row_bytes(w->dtype, w->cols));
    const bool blas = wtype == TDM_CPU_W_F32 && n > 1 && !cpu->batch_invariant &&
                      w->row_bytes == (size_t)w->cols * sizeof(float);
    const bool q = cpu->quant_activations && wtype >= TDM_CPU_W_Q8_0;
    const bool amx = q && cpu->amx && n >= AMX_MIN_ROWS && tdm_cpu_amx_wtype(wtype);
    return (struct mm_part){
        .w = w, .wtype = wtype, .blas = blas, .q = q, .amx = amx, .bias = bias, .out = out};
}

#define QUANT_POOL_ROWS 16 /* activation rows from which quantising them is a pool job */

struct quant_job {
    const struct tdm_cpu_kernels *k;
    const float *x;
    int n;
    int64_t nb;
    struct tdm_cpu_xblock *out;
    struct tdm_cpu_xtile *xt; /* also lay the rows out as AMX tiles, when not NULL */
};

static void quant_worker(void *ctx, int ith, int nth)
{
    const struct quant_job *q = ctx;
    int64_t i0, i1;
    if (q->xt) { /* by column groups: a thread quantises the rows of its groups, then packs them */
        enum { T = TDM_CPU_AMX_TILE };
        tdm_split_range((q->n + T - 1) / T, ith, nth, 1, &i0, &i1);
        for (int64_t g = i0; g < i1; g++) {
            const int r0 = (int)g * T, rn = TDM_MIN(T, q->n - r0);
            for (int r = r0; r < r0 + rn; r++)
                q->k->quantise(q->x + (size_t)r * (size_t)q->nb * 32, q->nb,
                               q->out + (size_t)r * q->nb);
            tdm_cpu_xtile_pack(q->out + (size_t)r0 * q->nb, q->nb, rn, q->nb,
                               q->xt + (size_t)g * q->nb);
        }
        return;
    }
    tdm_split_range(q->n, ith, nth, 1, &i0, &i1);
    for (int64_t i = i0; i < i1; i++)
        q->k->quantise(q->x + (size_t)i * (size_t)q->nb * 32, q->nb, q->out + (size_t)i * q->nb);
}

/* Quantises x once for every part on the quantised path (they share it). Without room for it
 * (the scratch could not grow) every part falls back to fp32 activations, with a warning. */
static void mm_quantise(struct tdm_cpu *cpu, struct mm_job *job)
{
    bool any = false;
    for (int j = 0; j < job->n_parts; j++)
        any |= job->parts[j].q;
    if (!any) return;
    const int64_t nb = job->parts[0].w->cols / 32;
    const size_t need = (size_t)job->n * (size_t)nb;
    if (need > cpu->xq_blocks) {
        /* grows geometrically, like attention's scratch: a few times per process */
        struct tdm_cpu_xblock *p = tdm_alloc_aligned(2 * need * sizeof *p);
        if (!p) {
            TDM_WARN("cpu backend: no memory to quantise activations; using fp32 ones");
            for (int j = 0; j < job->n_parts; j++)
                job->parts[j].q = job->parts[j].amx = false;
            return;
        }
        tdm_free_aligned(cpu->xq);
        cpu->xq = p;
        cpu->xq_blocks = 2 * need;
    }
    bool amx = false;
    for (int j = 0; j < job->n_parts; j++)
        amx |= job->parts[j].amx;
    const size_t need_t = (size_t)((job->n + TDM_CPU_AMX_TILE - 1) / TDM_CPU_AMX_TILE) * (size_t)nb;
    if (amx && need_t > cpu->xt_tiles) {
        struct tdm_cpu_xtile *p = tdm_alloc_aligned(2 * need_t * sizeof *p);
        if (p) {
            tdm_free_aligned(cpu->xt);
            cpu->xt = p;
            cpu->xt_tiles = 2 * need_t;
        } else { /* the vector tiles need no layout of their own */
            TDM_WARN("cpu backend: no memory for AMX tiles; using the vector tiles");
            for (int j = 0; j < job->n_parts; j++)
                job->parts[j].amx = false;
            amx = false;
        }
    }
    struct quant_job qj = {.k = cpu->k,
                           .x = job->x,
                           .n = job->n,
                           .nb = nb,
                           .out = cpu->xq,
                           .xt = amx ? cpu->xt : NULL};
    /* a decode step's few rows on this thread; a prefill's over the pool (each row alone) */
    tdm_cpu_run(cpu, job->n >= QUANT_POOL_ROWS ? (int64_t)job->n * nb * 32 : 0, quant_worker, &qj);
    job->xq = cpu->xq;
    job->xt = amx ? cpu->xt : NULL;
}

/* Runs a prepared job (parts' outputs at row 0) over the pool. */
static void mm_run(struct tdm_cpu *cpu, struct mm_job *job)
{
    int64_t work = 0;
    for (int j = 0; j < job->n_parts; j++)
        work += job->parts[j].w->rows * job->parts[j].w->cols * (int64_t)job->n;
    mm_quantise(cpu, job);
    tdm_cpu_run(cpu, work, mm_worker, job);
}

void tdm_cpu_matmul_multi(tdm_backend_t *b, const float *x, int n,
                          const struct tdm_matmul_part *parts, int n_parts)
{
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    TDM_ASSERT(n_parts >= 1 && n_parts <= TDM_MATMUL_MULTI_MAX);
    if (n <= 0) return;
    struct mm_job job = {.k = cpu->k, .x = x, .n = n, .n_parts = n_parts};
    for (int j = 0; j < n_parts; j++) {
        TDM_ASSERT(parts[j].w->cols == parts[0].w->cols);
        job.parts[j] = make_part(cpu, parts[j].w, n, parts[j].bias, parts[j].out);
    }
    mm_run(cpu, &job);
}

void tdm_cpu_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                    const float *bias, float *out)
{
    const struct tdm_matmul_part part = {.w = w, .bias = bias, .out = out};
    tdm_cpu_matmul_multi(b, x, n, &part, 1);
}

void tdm_cpu_matmul_swiglu(tdm_backend_t *b, const struct tdm_weight *w_gate,
                           const struct tdm_weight *w_up, const float *x, int n, float *out)
{
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    TDM_ASSERT(w_gate->rows == w_up->rows && w_gate->cols == w_up->cols);
    if (n <= 0) return;
    struct mm_job job = {.k = cpu->k, .x = x, .n = n, .n_parts = 2, .swiglu = true};
    job.parts[0] = make_part(cpu, w_gate, n, NULL, out);
    job.parts[1] = make_part(cpu, w_up, n, NULL, NULL);
    job.parts[0].blas = job.parts[1].blas = false; /* the fused tiles never use OpenBLAS */
    if (!(job.parts[0].amx && job.parts[1].amx))   /* the fused tiles share one walk */
        job.parts[0].amx = job.parts[1].amx = false;
    mm_run(cpu, &job);
}
