/*
 * GEMMs of the CUDA backend through cuBLASLt: bf16 operands, fp32 accumulation, fp32 output (or
 * bf16, rounded by cuBLASLt's epilogue, for outputs that only feed bf16 consumers).
 *
 * Layout: a weight W [m][k] row-major is, to cuBLASLt's column-major view, a k x m matrix with
 * leading dimension k; an activation x [n][k] a k x n matrix; the output d [n][m] an m x n
 * matrix. So d = op(W)^T x with op A = transposed ("TN"), the layout cuBLASLt handles best.
 *
 * Plans: the descriptors and the algorithm the heuristic picks are cached per (m, n, k, ldd, output
 * type), up to
 * TDM_CU_GEMM_PLANS, least recently used evicted. The heuristic query runs on the host and is
 * legal inside a CUDA-graph capture, so a captured decode step and its replays use the same
 * algorithm. The workspace is the instance's (32 MiB), fixed for its lifetime.
 *
 * Threading: one thread drives an instance.
 */
#include "backend/cuda/cuda_int.h"

#include <string.h>

#define LT_CHECK(call)                                                                             \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            tdm_cu_fatal(#call, "cuBLASLt error", __FILE__, __LINE__);                             \
    } while (0)

static void plan_free(const struct tdm_cuda *cu, struct tdm_cu_gemm_plan *p)
{
    cu->ltf->layout_destroy(p->a);
    cu->ltf->layout_destroy(p->b);
    cu->ltf->layout_destroy(p->d);
    cu->ltf->desc_destroy(p->op);
}

static struct tdm_cu_gemm_plan *plan_get(struct tdm_cuda *cu, int m, int n, int k, int ldd,
                                         bool d_bf16)
{
    for (int i = 0; i < cu->n_plans; i++) {
        struct tdm_cu_gemm_plan *p = &cu->plans[i];
        if (p->m == m && p->n == n && p->k == k && p->ldd == ldd && p->d_bf16 == d_bf16) {
            p->used = ++cu->plan_clock;
            return p;
        }
    }
    struct tdm_cu_gemm_plan *p;
    if (cu->n_plans < TDM_CU_GEMM_PLANS) {
        p = &cu->plans[cu->n_plans++];
    } else {
        p = &cu->plans[0];
        for (int i = 1; i < cu->n_plans; i++)
            if (cu->plans[i].used < p->used) p = &cu->plans[i];
        plan_free(cu, p);
    }
    memset(p, 0, sizeof *p);
    p->m = m;
    p->n = n;
    p->k = k;
    p->ldd = ldd;
    p->d_bf16 = d_bf16;
    p->used = ++cu->plan_clock;
    LT_CHECK(cu->ltf->desc_create(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cu->ltf->desc_set(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_CHECK(cu->ltf->desc_set(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LT_CHECK(cu->ltf->layout_create(&p->a, CUDA_R_16BF, k, m, k));
    LT_CHECK(cu->ltf->layout_create(&p->b, CUDA_R_16BF, k, n, k));
    LT_CHECK(cu->ltf->layout_create(&p->d, d_bf16 ? CUDA_R_16BF : CUDA_R_32F, m, n, ldd));
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cu->ltf->pref_create(&pref));
    LT_CHECK(cu->ltf->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &cu->lt_ws_bytes,
                               sizeof cu->lt_ws_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    LT_CHECK(cu->ltf->heuristic(cu->lt, p->op, p->a, p->b, p->d, p->d, pref, 1, &res, &found));
    cu->ltf->pref_destroy(pref);
    if (found < 1)
        tdm_cu_fatal("cublasLtMatmulAlgoGetHeuristic", "no algorithm", __FILE__, __LINE__);
    p->algo = res.algo;
    return p;
}

void tdm_cu_gemm(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x, int n,
                 float *d)
{
    tdm_cu_gemm_ld(cu, w, m, k, x, n, d, m);
}

static void gemm(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x, int n,
                 void *d, int ldd, bool d_bf16)
{
    if (n <= 0 || m <= 0) return;
    struct tdm_cu_gemm_plan *p = plan_get(cu, m, n, k, ldd, d_bf16);
    const float alpha = 1.0f, beta = 0.0f;
    LT_CHECK(cu->ltf->matmul(cu->lt, p->op, &alpha, w, p->a, x, p->b, &beta, d, p->d, d, p->d,
                             &p->algo, cu->lt_ws, cu->lt_ws_bytes, cu->stream));
}

void tdm_cu_gemm_ld(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x, int n,
                    float *d, int ldd)
{
    gemm(cu, w, m, k, x, n, d, ldd, false);
}

void tdm_cu_gemm_bf16_ld(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x,
                         int n, uint16_t *d, int ldd)
{
    gemm(cu, w, m, k, x, n, d, ldd, true);
}

void tdm_cu_gemm_destroy(struct tdm_cuda *cu)
{
    for (int i = 0; i < cu->n_plans; i++)
        plan_free(cu, &cu->plans[i]);
    cu->n_plans = 0;
}
