/*
 * Element-wise ops: silu_mul (the SwiGLU gate, out = silu(gate) * up) and add (x += y).
 *
 * silu(g) = g / (1 + expf(-g)) with libm's expf; for g below about -88 expf(-g) is +inf and the
 * quotient is -0, the correct limit.
 *
 * Threading: the flat element range is split over the pool in 16-element chunks (one cache
 * line), and each element depends only on its own inputs, so the split never changes a value.
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>

struct ew_job {
    const float *a;
    const float *b;
    float *out;
    int64_t n;
};

static void silu_mul_worker(void *ctx, int ith, int nth)
{
    const struct ew_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 16, &i0, &i1);
    for (int64_t i = i0; i < i1; i++) {
        job->out[i] = tdm_cpu_silu_mul1(job->a[i], job->b[i]);
    }
}

static void add_worker(void *ctx, int ith, int nth)
{
    const struct ew_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 16, &i0, &i1);
    for (int64_t i = i0; i < i1; i++)
        job->out[i] += job->b[i];
}

void tdm_cpu_silu_mul(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                      float *out)
{
    if (n <= 0 || dim <= 0) return;
    struct ew_job job = {.a = gate, .b = up, .out = out, .n = (int64_t)n * dim};
    /* expf costs about as much as a dozen element-operations elsewhere */
    tdm_cpu_run(tdm_cpu_of(b), job.n * 16, silu_mul_worker, &job);
}

void tdm_cpu_add(tdm_backend_t *b, float *x, const float *y, size_t n)
{
    if (n == 0) return;
    struct ew_job job = {.b = y, .out = x, .n = (int64_t)n};
    tdm_cpu_run(tdm_cpu_of(b), job.n, add_worker, &job);
}
