/*
 * fp32 GEMMs on the GPU over host memory (backend.h, tdm_cuda_gemm): the head trainer's
 * `--backend cuda` (src/spec/train.c). The trainer keeps its activations in host memory, where
 * its elementwise passes, attention and loss run on the CPU's cores; its dense GEMMs, nearly all
 * of a step's arithmetic, come here.
 *
 * A call copies A and B (and C when beta is not 0) to device buffers, runs cuBLASLt with fp32
 * compute (no TF32: the trainer's gradient check holds to fp32 rounding), copies C back and
 * waits. Host memory from tdm_cuda_gemm_host_alloc is pinned, so the copies run at the bus's
 * speed. A B marked constant (a frozen matrix: the target's LM head) is copied once and kept,
 * keyed by its address and size, until the object is destroyed.
 *
 * Layout: row-major X [r][c] (leading dimension ld) is, to cuBLASLt's column-major view, X^T.
 * So C = A' B' (row-major) is computed as C^T = B'^T A'^T: the first operand is B's memory, the
 * second A's, with m = N, n = M.
 *
 * Errors: a CUDA or cuBLASLt failure is returned (the object is then unusable); nothing aborts.
 *
 * Threading: one thread uses an object; one stream.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_int.h"
#include "tandem/core.h"

enum { MAX_CONST = 8 };

struct dev_buf {
    void *p;
    size_t bytes;
};
struct const_entry {
    const void *host;
    size_t bytes;
    void *dev;
};
struct tdm_cuda_gemm {
    int device;
    cudaStream_t stream;
    const struct tdm_cu_lt *ltf; /* cuBLASLt's entry points (tdm_cu_lt) */
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_bytes;
    struct dev_buf a, b, c;
    struct const_entry cst[MAX_CONST];
    int n_cst;
    bool broken;
};

static tdm_status cu_err(const char *what, cudaError_t e)
{
    return tdm_err_set(TDM_EIO, "cuda gemm: %s: %s", what, cudaGetErrorString(e));
}

static tdm_status grow(struct dev_buf *b, size_t bytes)
{
    if (b->bytes >= bytes) return TDM_OK;
    if (b->p) cudaFree(b->p);
    b->p = NULL;
    b->bytes = 0;
    cudaError_t e = cudaMalloc(&b->p, bytes);
    if (e != cudaSuccess) return cu_err("cudaMalloc", e);
    b->bytes = bytes;
    return TDM_OK;
}

tdm_status tdm_cuda_gemm_create(int device, tdm_cuda_gemm_t **out)
{
    *out = NULL;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= device || device < 0)
        return tdm_err_set(TDM_EUNSUPPORTED, "cuda gemm: no CUDA device %d (%s)", device,
                           e != cudaSuccess ? cudaGetErrorString(e) : "not present");
    struct tdm_cuda_gemm *g = calloc(1, sizeof *g);
    if (!g) return tdm_err_set(TDM_ENOMEM, "cuda gemm: out of memory");
    g->device = device;
    tdm_status st = TDM_OK;
    if ((e = cudaSetDevice(device)) != cudaSuccess) {
        st = cu_err("cudaSetDevice", e);
    } else if ((e = cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        st = cu_err("cudaStreamCreate", e);
    } else if (!(g->ltf = tdm_cu_lt())) {
        st = TDM_EUNSUPPORTED; /* tdm_cu_lt said why */
    } else if (g->ltf->create(&g->lt) != CUBLAS_STATUS_SUCCESS) {
        g->lt = NULL;
        st = tdm_err_set(TDM_EIO, "cuda gemm: cublasLtCreate failed");
    } else {
        g->ws_bytes = 32u << 20;
        if ((e = cudaMalloc(&g->ws, g->ws_bytes)) != cudaSuccess) st = cu_err("workspace", e);
    }
    if (st != TDM_OK) {
        tdm_cuda_gemm_destroy(g);
        return st;
    }
    *out = g;
    return TDM_OK;
}

void tdm_cuda_gemm_destroy(tdm_cuda_gemm_t *g)
{
    if (!g) return;
    cudaSetDevice(g->device);
    if (g->stream) cudaStreamSynchronize(g->stream);
    for (int i = 0; i < g->n_cst; i++)
        cudaFree(g->cst[i].dev);
    cudaFree(g->a.p);
    cudaFree(g->b.p);
    cudaFree(g->c.p);
    cudaFree(g->ws);
    if (g->lt) g->ltf->destroy(g->lt);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g);
}

void *tdm_cuda_gemm_host_alloc(tdm_cuda_gemm_t *g, size_t bytes)
{
    void *p = NULL;
    cudaSetDevice(g->device);
    return cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault) == cudaSuccess ? p : NULL;
}

void tdm_cuda_gemm_host_free(tdm_cuda_gemm_t *g, void *p)
{
    (void)g;
    if (p) cudaFreeHost(p);
}

/* The device copy of a constant matrix: made on first use. */
static tdm_status constant(struct tdm_cuda_gemm *g, const void *host, size_t bytes, void **dev)
{
    for (int i = 0; i < g->n_cst; i++)
        if (g->cst[i].host == host && g->cst[i].bytes == bytes) {
            *dev = g->cst[i].dev;
            return TDM_OK;
        }
    if (g->n_cst == MAX_CONST) { /* the oldest goes */
        cudaFree(g->cst[0].dev);
        memmove(&g->cst[0], &g->cst[1], (MAX_CONST - 1) * sizeof g->cst[0]);
        g->n_cst--;
    }
    void *d = NULL;
    cudaError_t e = cudaMalloc(&d, bytes);
    if (e != cudaSuccess) return cu_err("cudaMalloc", e);
    if ((e = cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, g->stream)) != cudaSuccess) {
        cudaFree(d);
        return cu_err("copy in", e);
    }
    g->cst[g->n_cst++] = (struct const_entry){host, bytes, d};
    *dev = d;
    return TDM_OK;
}

/* Bytes a row-major operand of r rows (leading dimension ld, c used columns) spans. */
static size_t span(int r, int c, int ld)
{
    return r > 0 ? ((size_t)(r - 1) * (size_t)ld + (size_t)c) * sizeof(float) : 0;
}

tdm_status tdm_cuda_gemm_run(tdm_cuda_gemm_t *g, bool ta, bool tb, int M, int N, int K,
                             const float *A, int lda, const float *B, int ldb, bool b_const,
                             float beta, float *C, int ldc)
{
    if (g->broken) return tdm_err_set(TDM_EIO, "cuda gemm: an earlier call failed");
    if (M <= 0 || N <= 0) return TDM_OK;
    if (K <= 0) { /* C = beta C */
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++)
                C[(size_t)i * ldc + j] *= beta;
        return TDM_OK;
    }
    /* stored shapes (row-major): A is M x K, or K x M when ta; B is K x N, or N x K when tb */
    int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    if (lda < ac || ldb < bc || ldc < N)
        return tdm_err_set(TDM_EINVAL, "cuda gemm: a leading dimension is too small");
    size_t a_bytes = span(ar, ac, lda), b_bytes = span(br, bc, ldb), c_bytes = span(M, N, ldc);
    tdm_status st = TDM_OK;
    cudaError_t e = cudaSetDevice(g->device);
    if (e != cudaSuccess) return cu_err("cudaSetDevice", e);
    void *db = NULL;
    if ((st = grow(&g->a, a_bytes)) != TDM_OK || (st = grow(&g->c, c_bytes)) != TDM_OK) goto fail;
    if (b_const) {
        if ((st = constant(g, B, b_bytes, &db)) != TDM_OK) goto fail;
    } else {
        if ((st = grow(&g->b, b_bytes)) != TDM_OK) goto fail;
        db = g->b.p;
        if ((e = cudaMemcpyAsync(db, B, b_bytes, cudaMemcpyHostToDevice, g->stream)))
            goto cuda_fail;
    }
    if ((e = cudaMemcpyAsync(g->a.p, A, a_bytes, cudaMemcpyHostToDevice, g->stream)))
        goto cuda_fail;
    if (beta != 0.0f &&
        (e = cudaMemcpyAsync(g->c.p, C, c_bytes, cudaMemcpyHostToDevice, g->stream)))
        goto cuda_fail;
    {
        /* C^T (N x M, col-major, ld ldc) = op1(B mem) op2(A mem) */
        cublasOperation_t o1 = tb ? CUBLAS_OP_T : CUBLAS_OP_N, o2 = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
        cublasLtMatmulDesc_t op = NULL;
        cublasLtMatrixLayout_t l1 = NULL, l2 = NULL, lc = NULL;
        cublasStatus_t s = g->ltf->desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        if (!s) s = g->ltf->desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &o1, sizeof o1);
        if (!s) s = g->ltf->desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &o2, sizeof o2);
        /* column-major views: B's memory is bc x br (ld ldb), A's ac x ar (ld lda) */
        if (!s) s = g->ltf->layout_create(&l1, CUDA_R_32F, bc, br, ldb);
        if (!s) s = g->ltf->layout_create(&l2, CUDA_R_32F, ac, ar, lda);
        if (!s) s = g->ltf->layout_create(&lc, CUDA_R_32F, N, M, ldc);
        const float alpha = 1.0f;
        if (!s)
            s = g->ltf->matmul(g->lt, op, &alpha, db, l1, g->a.p, l2, &beta, g->c.p, lc, g->c.p, lc,
                               NULL, g->ws, g->ws_bytes, g->stream);
        if (lc) g->ltf->layout_destroy(lc);
        if (l2) g->ltf->layout_destroy(l2);
        if (l1) g->ltf->layout_destroy(l1);
        if (op) g->ltf->desc_destroy(op);
        if (s != CUBLAS_STATUS_SUCCESS) {
            st = tdm_err_set(TDM_EIO, "cuda gemm: cublasLtMatmul (%d x %d x %d): status %d", M, N,
                             K, (int)s);
            goto fail;
        }
    }
    if ((e = cudaMemcpyAsync(C, g->c.p, c_bytes, cudaMemcpyDeviceToHost, g->stream)))
        goto cuda_fail;
    if ((e = cudaStreamSynchronize(g->stream))) goto cuda_fail;
    return TDM_OK;
cuda_fail:
    st = cu_err("copy or run", e);
fail:
    g->broken = true;
    cudaStreamSynchronize(g->stream);
    return st;
}
