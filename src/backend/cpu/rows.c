/*
 * Row ops: embed (token rows of the embedding table, dequantised to fp32), gather_rows
 * (copies selected activation rows, e.g. the last token of each sequence before the LM head)
 * and scatter_cols (a reduced draft vocabulary's logits into the whole vocabulary's columns);
 * zero and rows_scale_add (an expert's output rows, weighted, into a mixture-of-experts layer's
 * output: a few rows at a time, on the calling thread); head_matmul (MLA's per-head products:
 * each output value one dot product over 8 lanes in a fixed order, so a row's values never
 * depend on the others).
 *
 * Embedding rows are dequantised with tdm_cpu_weight_row (matmul.c), which yields the same
 * floats as the reference dequantiser. Token ids and row indices are the engine's to validate
 * (it checks prompts against the vocabulary); here an out-of-range index is a programmer error
 * and trips TDM_ASSERT rather than reading outside the table.
 *
 * Threading: output rows are split over the pool; each row is independent. gather_rows's out
 * must not overlap x.
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>
#include <string.h>

struct embed_job {
    const struct tdm_weight *emb;
    const int32_t *tokens;
    int n;
    float *out;
};

static void embed_worker(void *ctx, int ith, int nth)
{
    const struct embed_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 1, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        const int32_t tok = job->tokens[i];
        TDM_ASSERT(tok >= 0 && tok < job->emb->rows);
        tdm_cpu_weight_row(job->emb, tok, job->out + (size_t)i * (size_t)job->emb->cols);
    }
}

void tdm_cpu_embed(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                   float *out)
{
    TDM_ASSERT(tdm_cpu_wtype_of(emb->dtype) >= 0);
    if (n <= 0) return;
    struct embed_job job = {.emb = emb, .tokens = tokens, .n = n, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * emb->cols * 4, embed_worker, &job);
}

struct gather_job {
    const float *x;
    const int32_t *rows;
    int n, dim;
    float *out;
};

static void gather_worker(void *ctx, int ith, int nth)
{
    const struct gather_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 1, &i0, &i1);
    const size_t row_bytes = (size_t)job->dim * sizeof(float);
    for (int64_t i = i0; i < i1; i++) {
        TDM_ASSERT(job->rows[i] >= 0);
        memcpy(job->out + (size_t)i * job->dim, job->x + (size_t)job->rows[i] * job->dim,
               row_bytes);
    }
}

void tdm_cpu_gather_rows(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                         float *out)
{
    if (n <= 0 || dim <= 0) return;
    struct gather_job job = {.x = x, .rows = rows, .n = n, .dim = dim, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * dim, gather_worker, &job);
}

void tdm_cpu_zero(tdm_backend_t *b, float *x, size_t n)
{
    (void)b;
    memset(x, 0, n * sizeof *x);
}

void tdm_cpu_rows_scale_add(tdm_backend_t *b, const float *x, const int32_t *rows,
                            const float *weights, int n, int dim, float *out)
{
    (void)b;
    /* a few rows of one expert: not worth the pool */
    for (int i = 0; i < n; i++) {
        TDM_ASSERT(rows[i] >= 0);
        float *o = out + (size_t)rows[i] * dim;
        const float *xi = x + (size_t)i * dim;
        const float w = weights[i];
        for (int c = 0; c < dim; c++)
            o[c] += w * xi[c];
    }
}

struct scatter_job {
    const float *x;
    const int32_t *cols;
    int n, n_cols, width;
    float *out;
};

static void scatter_worker(void *ctx, int ith, int nth)
{
    const struct scatter_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 1, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        float *o = job->out + (size_t)i * job->width;
        const float *x = job->x + (size_t)i * job->n_cols;
        for (int c = 0; c < job->width; c++)
            o[c] = -INFINITY;
        for (int c = 0; c < job->n_cols; c++) {
            TDM_ASSERT(job->cols[c] >= 0 && job->cols[c] < job->width);
            o[job->cols[c]] = x[c];
        }
    }
}

void tdm_cpu_scatter_cols(tdm_backend_t *b, const float *x, const int32_t *cols, int n, int n_cols,
                          int width, float *out)
{
    if (n <= 0 || width <= 0) return;
    struct scatter_job job = {
        .x = x, .cols = cols, .n = n, .n_cols = n_cols, .width = width, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * width, scatter_worker, &job);
}

struct head_mm_job {
    const struct tdm_weight *w;
    int n_heads, n;
    const float *x;
    size_t xs, xh;
    float *out;
    size_t os, oh;
};

static void head_mm_worker(void *ctx, int ith, int nth)
{
    const struct head_mm_job *job = ctx;
    const int64_t R = job->w->rows / job->n_heads, C = job->w->cols;
    const float *W = job->w->data;
    int64_t i0, i1;
    tdm_split_range((int64_t)job->n * job->n_heads, ith, nth, 1, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) { /* (row, head) items */
        const int64_t i = it / job->n_heads, j = it % job->n_heads;
        const float *x = job->x + (size_t)i * job->xs + (size_t)j * job->xh;
        float *o = job->out + (size_t)i * job->os + (size_t)j * job->oh;
        const float *wj = W + (size_t)(j * R) * (size_t)C;
        for (int64_t r = 0; r < R; r++)
            o[r] = tdm_cpu_dot8(wj + (size_t)r * (size_t)C, x, (int)C);
    }
}

void tdm_cpu_head_matmul(tdm_backend_t *b, const struct tdm_weight *w, int n_heads, const float *x,
                         int n, size_t x_stride, size_t x_hstride, float *out, size_t out_stride,
                         size_t out_hstride)
{
    TDM_ASSERT(w->dtype == TDM_DTYPE_F32 && n_heads > 0 && w->rows % n_heads == 0);
    if (n <= 0) return;
    struct head_mm_job job = {.w = w,
                              .n_heads = n_heads,
                              .n = n,
                              .x = x,
                              .xs = x_stride,
                              .xh = x_hstride,
                              .out = out,
                              .os = out_stride,
                              .oh = out_hstride};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * w->rows * w->cols, head_mm_worker, &job);
}
