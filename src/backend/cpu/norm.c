/*
 * RMSNorm family: rmsnorm, add_rmsnorm (residual add fused with the norm that follows it) and
 * head_rmsnorm (qwen3's per-head norm of q and k, in place).
 *
 * out = x * (1 / sqrt(mean(x^2) + eps)) * w. The sum of squares runs in double over four
 * interleaved partial sums (element j goes to sum j % 4; the four fold as (s0+s1)+(s2+s3)),
 * which keeps the norm well inside the fidelity bound for any width and breaks the add
 * dependency chain; the scale is rounded to float once and applied as (x * scale) * w.
 *
 * Threading: rows are split over the pool; a row is always computed whole by one thread, so
 * results do not depend on the thread count or on the other rows. In-place use (out == x, or
 * add_rmsnorm's out == x) is allowed: a row is read completely before it is written.
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>

static float rms_scale(const float *x, int dim, float eps)
{
    double s[4] = {0, 0, 0, 0};
    int j = 0;
    for (; j + 4 <= dim; j += 4)
        for (int l = 0; l < 4; l++)
            s[l] += (double)x[j + l] * (double)x[j + l];
    for (int l = 0; j < dim; j++, l++)
        s[l] += (double)x[j] * (double)x[j];
    const double mean = ((s[0] + s[1]) + (s[2] + s[3])) / (double)dim;
    return (float)(1.0 / sqrt(mean + (double)eps));
}

static void norm_row(const float *x, const float *w, float eps, int dim, float *out)
{
    const float scale = rms_scale(x, dim, eps);
    for (int j = 0; j < dim; j++)
        out[j] = (x[j] * scale) * w[j];
}

struct norm_job {
    float *residual; /* add_rmsnorm only */
    const float *x;
    const float *w;
    float eps;
    int n, dim;
    float *out;
};

static void rmsnorm_worker(void *ctx, int ith, int nth)
{
    const struct norm_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 1, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        const size_t off = (size_t)i * (size_t)job->dim;
        norm_row(job->x + off, job->w, job->eps, job->dim, job->out + off);
    }
}

static void add_rmsnorm_worker(void *ctx, int ith, int nth)
{
    const struct norm_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 1, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        const size_t off = (size_t)i * (size_t)job->dim;
        float *r = job->residual + off;
        const float *x = job->x + off;
        for (int j = 0; j < job->dim; j++)
            r[j] += x[j];
        norm_row(r, job->w, job->eps, job->dim, job->out + off);
    }
}

void tdm_cpu_rmsnorm(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                     float *out)
{
    if (n <= 0 || dim <= 0) return;
    struct norm_job job = {.x = x, .w = w, .eps = eps, .n = n, .dim = dim, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * dim, rmsnorm_worker, &job);
}

void tdm_cpu_add_rmsnorm(tdm_backend_t *b, float *residual, const float *x, const float *w,
                         float eps, int n, int dim, float *out)
{
    if (n <= 0 || dim <= 0) return;
    struct norm_job job = {
        .residual = residual, .x = x, .w = w, .eps = eps, .n = n, .dim = dim, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n * dim, add_rmsnorm_worker, &job);
}

void tdm_cpu_head_rmsnorm(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                          int head_dim)
{
    if (n_rows <= 0 || head_dim <= 0) return;
    struct norm_job job = {.x = x, .w = w, .eps = eps, .n = n_rows, .dim = head_dim, .out = x};
    tdm_cpu_run(tdm_cpu_of(b), (int64_t)n_rows * head_dim, rmsnorm_worker, &job);
}
