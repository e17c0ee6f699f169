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

tdm_status tdm_backend_buf_new(tdm_backend_t *b, size_t bytes, const char *what,
                               struct tdm_buf *out)
{
    *out = (struct tdm_buf){0};
    void *p = bytes ? b->iface->buf_alloc(b, bytes) : NULL;
    if (bytes && !p)
        return tdm_err_set(TDM_ENOMEM, "%s backend: cannot allocate %zu bytes for %s",
                           b->iface->name, bytes, what);
    *out = (struct tdm_buf){.ptr = p, .bytes = bytes, .place = tdm_backend_buf_place(b)};
    return TDM_OK;
}

void tdm_backend_buf_release(tdm_backend_t *b, struct tdm_buf *buf)
{
    if (buf->ptr) b->iface->buf_free(b, buf->ptr);
    *buf = (struct tdm_buf){0};
}

static bool in_range(const struct tdm_buf *buf, size_t off, size_t n)
{
    return off <= buf->bytes && n <= buf->bytes - off;
}

tdm_status tdm_buf_upload(tdm_backend_t *b, struct tdm_buf *dst, size_t off, const void *src,
                          size_t n)
{
    if (!in_range(dst, off, n))
        return tdm_err_set(TDM_ERANGE, "buffer: %zu bytes at %zu past the end of %zu", n, off,
                           dst->bytes);
    if (n) b->iface->upload(b, (char *)dst->ptr + off, src, n);
    return TDM_OK;
}

tdm_status tdm_buf_download(tdm_backend_t *b, void *dst, const struct tdm_buf *src, size_t off,
                            size_t n)
{
    if (!in_range(src, off, n))
        return tdm_err_set(TDM_ERANGE, "buffer: %zu bytes at %zu past the end of %zu", n, off,
                           src->bytes);
    if (n) b->iface->download(b, dst, (const char *)src->ptr + off, n);
    return TDM_OK;
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

tdm_status tdm_cuda_device_pci(int device, char *busid, size_t cap)
{
    (void)device, (void)busid, (void)cap;
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

size_t tdm_backend_cuda_held_bytes(tdm_backend_t *b, const struct tdm_weight *w)
{
    (void)b, (void)w;
    return 0;
}

tdm_status tdm_cuda_gemm_create(int device, tdm_cuda_gemm_t **out)
{
    (void)device;
    *out = NULL;
    return no_cuda();
}
void tdm_cuda_gemm_destroy(tdm_cuda_gemm_t *g)
{
    (void)g;
}
tdm_status tdm_cuda_gemm_run(tdm_cuda_gemm_t *g, bool ta, bool tb, int M, int N, int K,
                             const float *A, int lda, const float *B, int ldb, bool b_const,
                             float beta, float *C, int ldc)
{
    (void)g, (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)A, (void)lda, (void)B;
    (void)ldb, (void)b_const, (void)beta, (void)C, (void)ldc;
    return no_cuda();
}
void *tdm_cuda_gemm_host_alloc(tdm_cuda_gemm_t *g, size_t bytes)
{
    (void)g, (void)bytes;
    return NULL;
}
void tdm_cuda_gemm_host_free(tdm_cuda_gemm_t *g, void *p)
{
    (void)g, (void)p;
}

int tdm_cuda_device_count(void)
{
    return 0;
}

tdm_status tdm_cuda_tp_plan(int n_ranks, int *devices, enum tdm_cuda_tp_mode *mode, char *why,
                            size_t why_cap)
{
    (void)n_ranks, (void)devices, (void)mode, (void)why, (void)why_cap;
    return no_cuda();
}

tdm_status tdm_cuda_tp_create(tdm_backend_t *const *ranks, int n, enum tdm_cuda_tp_mode mode,
                              struct tdm_tp_group *group, size_t max_floats, tdm_cuda_tp_t **out)
{
    (void)ranks, (void)n, (void)mode, (void)group, (void)max_floats;
    *out = NULL;
    return no_cuda();
}

void tdm_cuda_tp_destroy(tdm_cuda_tp_t *t)
{
    (void)t;
}

void tdm_cuda_tp_lm_open(tdm_backend_t *leader)
{
    (void)leader;
}

void tdm_cuda_tp_lm_put(tdm_backend_t *b, const float *part, int n_rows, int64_t nv, float *dst,
                        int64_t width, int64_t v0)
{
    (void)b, (void)part, (void)n_rows, (void)nv, (void)dst, (void)width, (void)v0;
}

void tdm_cuda_tp_lm_close(tdm_backend_t *leader)
{
    (void)leader;
}

void tdm_backend_cuda_bind_thread(tdm_backend_t *b)
{
    (void)b;
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
