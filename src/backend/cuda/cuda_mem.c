/*
 * Device memory and weights of the CUDA backend: buffers, uploads and downloads, grown scratch,
 * and weight conversion: a matrix in GGUF blocks of a kind the kernels know (qweight.h: Q8_0,
 * Q4_0, Q4_1, Q4_K, Q6_K, at a width they take) is kept in its blocks, rearranged; any other
 * matrix is dequantised on the host and held as bf16 (so are all, with bf16_weights); vectors
 * are fp32. One thread drives an instance (cuda_backend.c has the contract).
 */
#include "backend/cuda/cuda_int.h"
#include "backend/cuda/qweight.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- memory ---- */

/* Makes the instance's device current on the calling thread (the engine may be driven from a
 * thread other than the one that created it; the runtime's current device is per thread).
 * Tensor-parallel ranks put devices other than 0 in one process, and one thread (the leader's)
 * may touch several of them (a head's hidden states uploaded to every rank, slot copies in
 * every rank's pool), so the device is compared, not assumed. */
void tdm_cuda_bind(struct tdm_cuda *cu)
{
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != cu->device) cudaSetDevice(cu->device);
}

void *tdm_cuda_buf_alloc(tdm_backend_t *b, size_t bytes)
{
    tdm_cuda_bind(tdm_cu_of(b));
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

void tdm_cuda_buf_free(tdm_backend_t *b, void *p)
{
    if (p) cudaFree(p);
}

void tdm_cuda_upload(tdm_backend_t *b, void *dst, const void *src, size_t bytes)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (!bytes) return;
    tdm_cuda_bind(cu);
    TDM_CU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cu->stream));
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
}

void tdm_cuda_download(tdm_backend_t *b, void *dst, const void *src, size_t bytes)
{
    tdm_cuda_upload(b, dst, src, bytes);
}

/* Grows a workspace buffer to `need` bytes. Only outside a capture: graphs recorded with the
 * old buffer are dropped. */
void tdm_cuda_grow(struct tdm_cuda *cu, void **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return;
    if (cu->capturing)
        tdm_cu_fatal("workspace growth", "inside a CUDA-graph capture (reserve too small)",
                     __FILE__, __LINE__);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    tdm_cuda_drop_graphs(cu);
    if (*buf) cudaFree(*buf);
    *buf = NULL;
    *cap = 0;
    TDM_CU_CHECK(cudaMalloc(buf, need));
    *cap = need;
}

/* ---- weights ---- */

static bool is_device_ptr(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

tdm_status tdm_cuda_own(struct tdm_cuda *cu, void *dev, const struct tdm_weight *w)
{
    if (cu->n_owned == cu->cap_owned) {
        int cap = cu->cap_owned ? 2 * cu->cap_owned : 64;
        struct tdm_cu_owned *n = realloc(cu->owned, (size_t)cap * sizeof *n);
        if (!n) return tdm_err_set(TDM_ENOMEM, "cuda backend: out of memory");
        cu->owned = n;
        cu->cap_owned = cap;
    }
    cu->owned[cu->n_owned++] = (struct tdm_cu_owned){.dev = dev, .w = *w};
    return TDM_OK;
}

/* Whether a host matrix stays in its blocks on this instance (and its layout then). */
static bool kept_quantised(const struct tdm_cuda *cu, const struct tdm_weight *host,
                           struct tdm_cu_qlayout *L)
{
    return !cu->bf16_weights && host->rows > 1 &&
           tdm_cu_qlayout(host->dtype, host->rows, host->cols, L);
}

/* The device bytes of a host weight as tdm_cuda_weight_prepare holds it: a matrix in its blocks
 * (qweight.h) or as bf16, a vector as fp32 followed by a bf16 copy. */
static size_t prepared_bytes(const struct tdm_cuda *cu, const struct tdm_weight *host)
{
    const size_t cols = (size_t)host->cols;
    struct tdm_cu_qlayout L;
    if (kept_quantised(cu, host, &L)) return L.bytes;
    return host->rows == 1 ? cols * sizeof(float) + cols * 2
                           : cols * sizeof(uint16_t) * (size_t)host->rows;
}

size_t tdm_cuda_weight_bytes(tdm_backend_t *b, const struct tdm_weight *host)
{
    if (!host->data || host->rows < 1 || host->cols < 1 || is_device_ptr(host->data)) return 0;
    return prepared_bytes(tdm_cu_of(b), host);
}

size_t tdm_backend_cuda_held_bytes(tdm_backend_t *b, const struct tdm_weight *w)
{
    if (!w->data || !tdm_backend_is_cuda(b)) return 0;
    if (w->rows == 1) return (size_t)w->cols * sizeof(float); /* what a step reads of a vector */
    return prepared_bytes(tdm_cu_of(b), w);
}

#define DEQ_BYTES ((size_t)64 << 20) /* the bf16 dequantisation buffer, at most */

int64_t tdm_cuda_deq_rows(int64_t rows, int64_t k)
{
    const int64_t fit = (int64_t)(DEQ_BYTES / ((size_t)k * 2)) & ~(int64_t)15;
    return TDM_MIN(rows, TDM_MAX(16, fit));
}

tdm_status tdm_cuda_deq_reserve(struct tdm_cuda *cu, int64_t rows, int64_t cols)
{
    const size_t deq = (size_t)tdm_cuda_deq_rows(rows, cols) * (size_t)cols * 2;
    if (deq <= cu->deq_cap) return TDM_OK;
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    tdm_cuda_drop_graphs(cu);
    if (cu->deq) cudaFree(cu->deq);
    cu->deq = NULL;
    cu->deq_cap = 0;
    if (cudaMalloc((void **)&cu->deq, deq) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes to dequantise",
                           deq);
    }
    cu->deq_cap = deq;
    return TDM_OK;
}

bool tdm_cuda_qpart(const struct tdm_weight *w, struct tdm_cu_qgemv_part *p, int *kind)
{
    struct tdm_cu_qlayout L;
    if (w->rows < 2 || !tdm_cu_qlayout(w->dtype, w->rows, w->cols, &L)) return false;
    const uint8_t *base = w->data;
    *p = (struct tdm_cu_qgemv_part){.q = base + L.q_off,
                                    .qh = L.qh_off ? base + L.qh_off : NULL,
                                    .s = base + L.s_off,
                                    .dd = L.dd_off ? base + L.dd_off : NULL,
                                    .m = (int)w->rows};
    *kind = L.kind;
    return true;
}

tdm_status tdm_cuda_own_blocks(struct tdm_cuda *cu, void *dev, const struct tdm_cu_qlayout *L,
                               enum tdm_dtype dtype, struct tdm_weight *out)
{
    tdm_status st = tdm_cuda_deq_reserve(cu, L->rows, L->cols);
    if (st != TDM_OK) return st;
    *out = (struct tdm_weight){.dtype = dtype,
                               .rows = L->rows,
                               .cols = L->cols,
                               .row_bytes = tdm_dtype_row_bytes(dtype, L->cols),
                               .data = dev};
    if ((st = tdm_cuda_own(cu, dev, out)) != TDM_OK) return st;
    cu->weight_bytes += L->bytes;
    cu->max_cols = TDM_MAX(cu->max_cols, L->cols);
    return TDM_OK;
}

/* A matrix kept in its blocks: packed on the host, uploaded once. */
static tdm_status prepare_quantised(struct tdm_cuda *cu, const struct tdm_weight *host,
                                    const struct tdm_cu_qlayout *L, struct tdm_weight *out)
{
    void *dev = NULL, *packed = calloc(1, L->bytes);
    if (!packed) return tdm_err_set(TDM_ENOMEM, "cuda backend: out of host memory");
    tdm_cu_qpack_rows(L, host->data, host->row_bytes, 0, host->rows, packed);
    tdm_status st = TDM_OK;
    if (cudaMalloc(&dev, L->bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        free(packed);
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes for a weight",
                           L->bytes);
    }
    if (cudaMemcpy(dev, packed, L->bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
        (void)cudaGetLastError();
        st = tdm_err_set(TDM_EIO, "cuda backend: weight upload failed");
        goto fail;
    }
    if ((st = tdm_cuda_own_blocks(cu, dev, L, host->dtype, out)) != TDM_OK) goto fail;
    free(packed);
    return TDM_OK;
fail:
    cudaFree(dev);
    free(packed);
    return st;
}

tdm_status tdm_cuda_weight_prepare(tdm_backend_t *b, const struct tdm_weight *host,
                                   struct tdm_weight *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_bind(cu);
    if (!host->data) {
        *out = *host;
        return TDM_OK;
    }
    if (host->rows < 1 || host->cols < 1 || host->rows > INT32_MAX || host->cols > INT32_MAX)
        return tdm_err_set(TDM_EINVAL, "cuda backend: weight of %lld x %lld", (long long)host->rows,
                           (long long)host->cols);
    const bool vec = host->rows == 1;
    struct tdm_cu_qlayout L;
    if (is_device_ptr(host->data)) {
        if (!vec && tdm_cu_qlayout(host->dtype, host->rows, host->cols, &L)) { /* ours, again */
            *out = *host;
            return TDM_OK;
        }
        if (host->dtype != (vec ? TDM_DTYPE_F32 : TDM_DTYPE_BF16))
            return tdm_err_set(TDM_EUNSUPPORTED, "cuda backend: a device weight must be %s, not %s",
                               vec ? "f32" : "bf16", tdm_dtype_name(host->dtype));
        *out = *host;
        if (!vec) cu->max_cols = TDM_MAX(cu->max_cols, host->cols);
        return TDM_OK;
    }
    const size_t rb = tdm_dtype_row_bytes(host->dtype, host->cols);
    if (rb == 0 || host->row_bytes != rb)
        return tdm_err_set(TDM_EINVAL,
                           "cuda backend: %s weight with %lld columns has row_bytes %zu",
                           tdm_dtype_name(host->dtype), (long long)host->cols, host->row_bytes);
    if (kept_quantised(cu, host, &L)) return prepare_quantised(cu, host, &L, out);
    /* a vector is held as fp32 followed by a bf16 copy (used if it is ever a 1-row matrix) */
    const size_t esz = vec ? sizeof(float) : sizeof(uint16_t);
    const size_t row_out = (size_t)host->cols * esz;
    const size_t bytes = prepared_bytes(cu, host);
    void *dev = NULL;
    if (cudaMalloc(&dev, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes for a weight",
                           bytes);
    }
    tdm_status st = TDM_OK;
    float *row = malloc((size_t)host->cols * sizeof(float));
    uint8_t *staging = NULL;
    if (!row || cudaMallocHost((void **)&staging, STAGING_BYTES) != cudaSuccess) {
        (void)cudaGetLastError();
        st = tdm_err_set(TDM_ENOMEM, "cuda backend: out of host memory");
        goto out_free;
    }
    const int64_t rows_per_chunk = TDM_MAX(1, (int64_t)(STAGING_BYTES / row_out));
    for (int64_t r0 = 0; r0 < host->rows; r0 += rows_per_chunk) {
        const int64_t nr = TDM_MIN(rows_per_chunk, host->rows - r0);
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *src = (const uint8_t *)host->data + (size_t)(r0 + r) * host->row_bytes;
            uint8_t *dst = staging + (size_t)r * row_out;
            if (!vec && host->dtype == TDM_DTYPE_BF16) {
                memcpy(dst, src, row_out);
                continue;
            }
            if ((st = tdm_dequantize(host->dtype, src, row, host->cols)) != TDM_OK) goto out_free;
            if (vec) {
                memcpy(dst, row, row_out);
                uint16_t *d16 = (uint16_t *)(dst + row_out);
                for (int64_t c = 0; c < host->cols; c++)
                    d16[c] = tdm_f32_to_bf16(row[c]);
            } else {
                uint16_t *d16 = (uint16_t *)dst;
                for (int64_t c = 0; c < host->cols; c++)
                    d16[c] = tdm_f32_to_bf16(row[c]);
            }
        }
        if (cudaMemcpy((uint8_t *)dev + (size_t)r0 * row_out, staging,
                       (size_t)nr * row_out + (vec ? (size_t)host->cols * 2 : 0),
                       cudaMemcpyHostToDevice) != cudaSuccess) {
            (void)cudaGetLastError();
            st = tdm_err_set(TDM_EIO, "cuda backend: weight upload failed");
            goto out_free;
        }
    }
    *out = (struct tdm_weight){.dtype = vec ? TDM_DTYPE_F32 : TDM_DTYPE_BF16,
                               .rows = host->rows,
                               .cols = host->cols,
                               .row_bytes = row_out,
                               .data = dev};
    if ((st = tdm_cuda_own(cu, dev, out)) != TDM_OK) goto out_free;
    cu->weight_bytes += bytes;
    if (!vec) cu->max_cols = TDM_MAX(cu->max_cols, host->cols);
    cudaFreeHost(staging);
    free(row);
    return TDM_OK;
out_free:
    if (staging) cudaFreeHost(staging);
    free(row);
    cudaFree(dev);
    return st;
}
