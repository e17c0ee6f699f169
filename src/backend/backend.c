/*
 * Backend-independent entry points of the compute interface (backend.h). Each backend
 * implements struct tdm_backend_i; this file only holds what is common to all of them, and the
 * CUDA entry points of a build without CUDA (they fail with a clear message).
 */
#include "tandem/backend.h"

void tdm_backend_destroy(tdm_backend_t *b)
{
    if (!b) return;
    b->iface->destroy(b);
}

struct tdm_mem_place tdm_backend_buf_place(tdm_backend_t *b)
{
    if (b->iface->buf_place) return b->iface->buf_place(b);
    return (struct tdm_mem_place){.kind = TDM_MEM_HOST};
}

#ifndef TDM_HAVE_CUDA
static tdm_status no_cuda(void)
{
    return tdm_err_set(TDM_EUNSUPPORTED,
                       "this tandem was built without CUDA (nvcc was not found at build time)");
}

tdm_status tdm_backend_cuda_create(const struct tdm_backend_cuda_opts *opts, tdm_backend_t **out)
{
    (void)opts;
    (void)out;
    return no_cuda();
}

bool tdm_backend_is_cuda(const tdm_backend_t *b)
{
    (void)b;
    return false;
}

tdm_status tdm_backend_cuda_info(tdm_backend_t *b, char *name, size_t cap, size_t *total_bytes)
{
    (void)b, (void)name, (void)cap, (void)total_bytes;
    return no_cuda();
}

tdm_status tdm_backend_cuda_measure(tdm_backend_t *b, double *copy_bytes_per_s,
                                    double *gemm_flops_per_s)
{
    (void)b, (void)copy_bytes_per_s, (void)gemm_flops_per_s;
    return no_cuda();
}

tdm_status tdm_backend_cuda_random_weight(tdm_backend_t *b, enum tdm_dtype dtype, int64_t rows,
                                          int64_t cols, uint64_t seed, float lo, float hi,
                                          struct tdm_weight *out)
{
    (void)b, (void)dtype, (void)rows, (void)cols, (void)seed, (void)lo, (void)hi, (void)out;
    return no_cuda();
}

void *tdm_backend_cuda_host_alloc(tdm_backend_t *b, size_t bytes)
{
    (void)b, (void)bytes;
    no_cuda();
    return NULL;
}

void tdm_backend_cuda_host_free(tdm_backend_t *b, void *p)
{
    (void)b, (void)p;
}

tdm_status tdm_backend_cuda_memset(tdm_backend_t *b, void *dev, int value, size_t bytes)
{
    (void)b, (void)dev, (void)value, (void)bytes;
    return no_cuda();
}

_Atomic int32_t *tdm_backend_cuda_counter(tdm_backend_t *b)
{
    (void)b;
    return NULL;
}
#endif
