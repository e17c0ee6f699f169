/*
 * Matmul: out[i][r] = sum_c x[i][c] * W[r][c] (+ bias[r]), with W in F32, BF16, Q8_0, Q4_0 or
 * Q4_1 and the activations x in fp32. Also the portable kernels and the one-row dequantiser
 * that embed uses.
 *
 * Why no activation quantisation: the CPU backend must stay within 1e-4 relative of an fp32
 * reference, so weights are expanded to fp32 in registers (exactly: each dequantised weight is
 * the same float the reference dequantiser yields, up to one rounding for q4_1) and multiplied
 * with fp32 activations.
 *
 * Work split: the weight rows are divided over the pool's threads (tdm_split_range, chunks of
 * 16 rows so that no two threads write one cache line of out). Each thread walks its rows in
 * tiles of R weight rows x C activation rows (cpu_int.h): n == 1 (decode) streams R rows at
 * once against the single activation row, which keeps several independent FMA chains in
 * flight while the weights stream from memory; n > 1 (prefill) keeps a block of RB weight rows
 * hot in cache and runs it against IB activation rows, dequantising each weight vector once
 * per C activation rows.
 *
 * Determinism: every tile shape performs the same operations, in the same order, for each
 * (weight row, activation row) pair, so a value never depends on n, on the thread count or on
 * where a tile boundary fell. The exception is F32 weights with n > 1, which go to OpenBLAS
 * sgemm (blocking depends on n) unless the instance was created with batch_invariant.
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

const tdm_cpu_tile_table tdm_cpu_tiles_portable = {
    TDM_CPU_TILE_TABLE(F32),  TDM_CPU_TILE_TABLE(BF16), TDM_CPU_TILE_TABLE(Q8_0),
    TDM_CPU_TILE_TABLE(Q4_0), TDM_CPU_TILE_TABLE(Q4_1),
};

/* ---- driver ---- */

struct mm_job {
    const struct tdm_cpu_kernels *k;
    const struct tdm_weight *w;
    int wtype;
    const float *x;
    int n;
    const float *bias;
    float *out;
};

static void run_tile(const struct mm_job *job, int64_t r, int i, int R, int C)
{
    const struct tdm_weight *w = job->w;
    const struct tdm_cpu_tile t = {
        .w = (const uint8_t *)w->data + (size_t)r * w->row_bytes,
        .row_bytes = w->row_bytes,
        .cols = w->cols,
        .x = job->x + (size_t)i * (size_t)w->cols,
        .ldx = w->cols,
        .out = job->out + (size_t)i * (size_t)w->rows + (size_t)r,
        .ldo = w->rows,
        .bias = job->bias ? job->bias + r : NULL,
    };
    job->k->tile[job->wtype][R - 1][C - 1](&t);
}

static void mm_worker(void *ctx, int ith, int nth)
{
    const struct mm_job *job = ctx;
    int64_t r0, r1;
    tdm_split_range(job->w->rows, ith, nth, 16, &r0, &r1);
    if (job->n == 1) {
        const int R = job->k->decode_r;
        for (int64_t r = r0; r < r1; r += R)
            run_tile(job, r, 0, (int)TDM_MIN(R, r1 - r), 1);
        return;
    }
    const int R = job->k->prefill_r[job->wtype], C = job->k->prefill_c;
    for (int i0 = 0; i0 < job->n; i0 += IB) {
        const int i1 = TDM_MIN(job->n, i0 + IB);
        for (int64_t rb = r0; rb < r1; rb += RB) {
            const int64_t rb1 = TDM_MIN(r1, rb + RB);
            for (int i = i0; i < i1; i += C) {
                const int cc = TDM_MIN(C, i1 - i);
                for (int64_t r = rb; r < rb1; r += R)
                    run_tile(job, r, i, (int)TDM_MIN(R, rb1 - r), cc);
            }
        }
    }
}

/* F32 weights, several rows: OpenBLAS on this thread's slice of weight rows. */
static void sgemm_worker(void *ctx, int ith, int nth)
{
    const struct mm_job *job = ctx;
    const struct tdm_weight *w = job->w;
    int64_t r0, r1;
    tdm_split_range(w->rows, ith, nth, 16, &r0, &r1);
    if (r1 <= r0) return;
    const float *wdata = (const float *)w->data + (size_t)r0 * (size_t)w->cols;
    float *out = job->out + r0;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, job->n, (int)(r1 - r0), (int)w->cols, 1.0f,
                job->x, (int)w->cols, wdata, (int)w->cols, 0.0f, out, (int)w->rows);
    if (job->bias)
        for (int i = 0; i < job->n; i++)
            for (int64_t r = r0; r < r1; r++)
                job->out[(size_t)i * w->rows + r] += job->bias[r];
}

void tdm_cpu_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                    const float *bias, float *out)
{
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    const int wtype = tdm_cpu_wtype_of(w->dtype);
    TDM_ASSERT(wtype >= 0 && w->row_bytes == tdm_dtype_row_bytes(w->dtype, w->cols));
    if (n <= 0) return;
    struct mm_job job = {
        .k = cpu->k, .w = w, .wtype = wtype, .x = x, .n = n, .bias = bias, .out = out};
    const bool blas = wtype == TDM_CPU_W_F32 && n > 1 && !cpu->batch_invariant &&
                      w->row_bytes == (size_t)w->cols * sizeof(float);
    const int64_t work = w->rows * w->cols * (int64_t)n;
    tdm_cpu_run(cpu, work, blas ? sgemm_worker : mm_worker, &job);
}
