/*
 * One op test over every backend (in the style of ggml's test-backend-ops): each op of the
 * backend interface (backend.h) on every backend this machine has (the CPU backend at each ISA
 * level it supports, once batch-invariant, and the CUDA backend when a GPU is present), against
 * naive references written here in double precision on the same random inputs. A new backend
 * is one more entry in open_backends() with its tolerances.
 *
 * References: quantised weights are random blocks dequantised with tdm_dequantize (model/
 * quant.c, itself checked against the gguf Python package), then multiplied in double.
 * Inputs go to the backend through its own buf_alloc/upload and come back through download;
 * outputs are poisoned with NaN first, so an element the op does not write fails.
 *
 * Tolerances, per backend:
 *   matmul family  |out - ref| <= mm * sum_c |w_c x_c| + 1e-5 * |bias|. CPU mm = 1e-5 (fp32
 *                  accumulation of up to a few thousand products, relative to the magnitude of
 *                  the terms, so cancellation cannot fail a correct kernel). CUDA mm = 1e-2:
 *                  weights and inputs are rounded to bf16 (u = 2^-8 each) and accumulated in
 *                  fp32;
 *   embed          CPU exact (the row dequantised); CUDA 2^-8 relative (the table is bf16);
 *   norms, rope, silu, add: CPU 1e-6, CUDA 1e-5 relative to the magnitude of the values; gather
 *                  and the V half of the KV append exact;
 *   attention      CPU 1e-5 absolute on outputs of O(1); CUDA 1e-4, and 2e-2 for steps with
 *                  prefill chunks at head_dim 64 or 128 (the tensor cores take bf16 Q, K, V and
 *                  P: scores move by scale * sum|q k| * 2u ~ 1.1% for head_dim 128, plus 0.2%
 *                  each for P and V, against max|v| = 1).
 * Contracts checked bit for bit on every backend: matmul_multi equals matmul part by part, and
 * (for quantised weights) matmul_swiglu equals matmul, matmul, silu_mul (CUDA's prefill form,
 * gate and up out of cuBLASLt as bf16: within that rounding of them); kv_copy moves exactly
 * its pairs' rows, in order. Token trees' attention (a chain beside a tree, random shapes up to
 * 64 nodes) against the same double reference; on the CPU each tree token also equals the
 * chain token that sees the same KV, bit for bit.
 *
 * What stays backend-specific: the CPU's invariance across batch sizes and thread counts and
 * its ISA selection (tests/backend/test_cpu_ops.c), and the CUDA engine's graphs
 * (tests/backend_cuda/test_cuda_engine.c). Without a GPU the CUDA entry is skipped with a
 * message. MLA's ops (head_matmul, a latent layer's rope, attention and kv_copy) are held to
 * the matmul and attention tolerances.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"
#include "tandem/backend.h"
#include "tandem/model.h"
#include "lib/test_rng.h"
#include "lib/tiny_model.h"

/* ---- the backends ---- */

struct be {
    char name[48];
    tdm_backend_t *b;
    bool cuda;
    bool invariant; /* CUDA --batch-invariant: a token's row the same bits at any batch */
    bool blocks;    /* CUDA keeping GGUF blocks (not --gpu-weights bf16): their kernel is too */
    bool tails;     /* weights of any width (not only multiples of 32) for F32 and BF16 */
    double mm, emb, elem, att, att_tc;
};
static struct be bes[8];
static int n_bes;

static void open_backends(void)
{
    for (int isa = 0; isa <= (int)tdm_cpu_isa_detect(); isa++)
        for (int inv = 0; inv < (isa == (int)tdm_cpu_isa_detect() ? 2 : 1); inv++) {
            struct tdm_backend_cpu_opts o = {.n_threads = 2, .batch_invariant = inv == 1};
            struct be *e = &bes[n_bes];
            if (tdm_backend_cpu_create_isa(&o, (enum tdm_cpu_isa)isa, &e->b) != TDM_OK) continue;
            snprintf(e->name, sizeof e->name, "cpu %s%s", tdm_cpu_isa_name((enum tdm_cpu_isa)isa),
                     inv ? " batch_invariant" : "");
            e->tails = true;
            e->mm = 1e-5, e->emb = 0, e->elem = 1e-6, e->att = 1e-5, e->att_tc = 1e-5;
            n_bes++;
        }
    struct be *e = &bes[n_bes];
    if (tdm_backend_cuda_create(NULL, &e->b) == TDM_OK) {
        snprintf(e->name, sizeof e->name, "cuda");
        e->cuda = e->blocks = true;
        e->mm = 1e-2, e->emb = 1.0 / 256, e->elem = 1e-5, e->att = 1e-4, e->att_tc = 2e-2;
        n_bes++;
        /* the same device with every GGUF matrix dequantised to bf16 at load (the path of
         * types the block kernels do not take) */
        const struct tdm_backend_cuda_opts bo = {.bf16_weights = true};
        e = &bes[n_bes];
        if (tdm_backend_cuda_create(&bo, &e->b) == TDM_OK) {
            snprintf(e->name, sizeof e->name, "cuda bf16-weights");
            e->cuda = true;
            e->mm = 1e-2, e->emb = 1.0 / 256, e->elem = 1e-5, e->att = 1e-4, e->att_tc = 2e-2;
            n_bes++;
        }
        const struct tdm_backend_cuda_opts bi = {.batch_invariant = true};
        e = &bes[n_bes];
        if (tdm_backend_cuda_create(&bi, &e->b) == TDM_OK) {
            snprintf(e->name, sizeof e->name, "cuda batch_invariant");
            e->cuda = e->invariant = e->blocks = true;
            e->mm = 1e-2, e->emb = 1.0 / 256, e->elem = 1e-5, e->att = 1e-4, e->att_tc = 2e-2;
            n_bes++;
        }
    } else {
        printf("SKIP: test_backend_ops: the cuda backend: %s\n", tdm_err_msg());
    }
}

/* ---- data ---- */

static uint64_t rng_state = 0x5851F42D4C957F2Dull;
static uint64_t rng_u64(void)
{
    return tdm_test_splitmix64(&rng_state);
}
static float rng_f(float lo, float hi)
{
    return tdm_test_uniform(&rng_state, lo, hi);
}
static float *rand_vec(size_t n, float lo, float hi)
{
    return tdm_test_rand_vec(&rng_state, n, lo, hi);
}

/* backend memory holding a copy of host[n] */
static float *put(const struct be *e, const float *host, size_t n)
{
    float *d = e->b->iface->buf_alloc(e->b, n * sizeof(float) + 64);
    assert_non_null(d);
    e->b->iface->upload(e->b, d, host, n * sizeof(float));
    return d;
}
/* backend memory of n NaNs */
static float *poisoned(const struct be *e, size_t n)
{
    float *h = malloc(n * sizeof(float) + 4);
    assert_non_null(h);
    for (size_t i = 0; i < n; i++)
        h[i] = NAN;
    float *d = put(e, h, n);
    free(h);
    return d;
}
/* a host copy of backend memory */
static float *get(const struct be *e, const float *d, size_t n)
{
    float *h = malloc(n * sizeof(float) + 4);
    assert_non_null(h);
    e->b->iface->download(e->b, h, d, n * sizeof(float));
    e->b->iface->sync(e->b);
    return h;
}
static void drop(const struct be *e, void *d)
{
    e->b->iface->buf_free(e->b, d);
}

/* |got - ref| <= rel * max(|ref|, floor) everywhere */
static void check_rel(const char *be, const char *what, const float *got, const double *ref,
                      size_t n, double rel, double floor)
{
    for (size_t i = 0; i < n; i++) {
        const double tol = rel * fmax(fabs(ref[i]), floor) + 1e-30;
        if (!(fabs((double)got[i] - ref[i]) <= tol)) {
            print_error("%s: %s [%zu] = %.9g, ref %.9g (tol %.3g)\n", be, what, i, got[i], ref[i],
                        tol);
            fail();
        }
    }
}

/* the backend's own form of a weight (the CPU: the same bytes; CUDA: a bf16 device copy it
 * owns until it is destroyed) */
static struct tdm_weight prepared(const struct be *e, const struct tdm_test_weight *tw)
{
    struct tdm_weight w;
    assert_int_equal(e->b->iface->weight_prepare(e->b, &tw->w, &w), TDM_OK);
    return w;
}

/* whether the CPU backend runs weights of type t as they are (the loader turns the others,
 * such as the K-quants, into F32 before a CPU engine sees them; CUDA keeps them in blocks) */
static bool cpu_runs(enum tdm_dtype t)
{
    return t != TDM_DTYPE_Q4_K && t != TDM_DTYPE_Q6_K;
}

static const enum tdm_dtype DTYPES[] = {TDM_DTYPE_F32, TDM_DTYPE_BF16, TDM_DTYPE_Q8_0,
                                        TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1};

/* ---- matmul family ---- */

static void check_matmul(const struct be *e, const struct tdm_test_weight *tw, const float *x,
                         int n, const float *bias, const float *out, const char *what)
{
    const int64_t rows = tw->w.rows, cols = tw->w.cols;
    for (int i = 0; i < n; i++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0, mag = 0;
            for (int64_t c = 0; c < cols; c++) {
                const double p = (double)tw->deq[r * cols + c] * (double)x[i * cols + c];
                s += p;
                mag += fabs(p);
            }
            double tol = e->mm * mag + 1e-30;
            if (bias) s += bias[r], tol += 1e-5 * fabs(bias[r]);
            const double got = out[(size_t)i * rows + r];
            if (!(fabs(got - s) <= tol)) {
                print_error("%s: %s %s %lldx%lld n=%d: out[%d][%lld] = %.9g, ref %.9g (tol "
                            "%.3g)\n",
                            e->name, what, tdm_dtype_name(tw->w.dtype), (long long)rows,
                            (long long)cols, n, i, (long long)r, got, s, tol);
                fail();
            }
        }
}

struct mm_shape {
    int64_t rows, cols;
    int n;
    bool bias;
};

/* matmul of weight tw by x [sh->n][cols] (+ bias) on backend e against the reference; with
 * alone_every > 0, also every alone_every-th token's row alone, which must be the same bits as
 * its row in the batch (the backend's kernel then does not depend on the batch). */
static void matmul_check(const struct be *e, const struct tdm_test_weight *tw,
                         const struct mm_shape *sh, const float *x, const float *bias,
                         int alone_every, const char *what)
{
    const size_t n_out = (size_t)sh->n * sh->rows;
    struct tdm_weight w = prepared(e, tw);
    float *dx = put(e, x, (size_t)sh->n * sh->cols);
    float *db = bias ? put(e, bias, (size_t)sh->rows) : NULL;
    float *dout = poisoned(e, n_out);
    e->b->iface->matmul(e->b, &w, dx, sh->n, db, dout);
    float *out = get(e, dout, n_out);
    check_matmul(e, tw, x, sh->n, bias, out, what);
    for (int i = 0; alone_every > 0 && i < sh->n; i += alone_every) {
        float *d1 = poisoned(e, (size_t)sh->rows);
        e->b->iface->matmul(e->b, &w, dx + (size_t)i * sh->cols, 1, db, d1);
        float *o1 = get(e, d1, (size_t)sh->rows);
        if (memcmp(o1, out + (size_t)i * sh->rows, (size_t)sh->rows * 4)) {
            print_error("%s: %s %s %lldx%lld: token %d of %d differs from itself alone\n", e->name,
                        what, tdm_dtype_name(tw->w.dtype), (long long)sh->rows, (long long)sh->cols,
                        i, sh->n);
            fail();
        }
        free(o1);
        drop(e, d1);
    }
    free(out);
    drop(e, dout), drop(e, dx);
    if (db) drop(e, db);
}

static void test_matmul(void **state)
{
    (void)state;
    const struct mm_shape shapes[] = {
        {1, 32, 1, false},    {7, 64, 3, true},    {37, 96, 17, false},   {130, 256, 5, true},
        {33, 1536, 2, false}, {50, 128, 70, true}, {576, 576, 1, false},  {19, 32, 4, false},
        {24, 4096, 1, false}, {16, 1536, 9, true}, {256, 512, 300, true}, {1000, 64, 8, false},
        {256, 512, 4, true},  {64, 96, 8, false},  {48, 4096, 3, false},  {512, 4096, 1, true},
        {96, 320, 2, false},
    };
    /* F32 and BF16 rows of any length: the CPU's vector and scalar tails */
    const struct mm_shape tails[] = {
        {5, 9, 1, false}, {13, 45, 3, true}, {3, 100, 17, false},
        {17, 7, 2, true}, {9, 1, 1, false},
    };
    const size_t n_main = TDM_ARRAY_LEN(shapes), n_all = n_main + TDM_ARRAY_LEN(tails);
    for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
        const bool plain = DTYPES[d] == TDM_DTYPE_F32 || DTYPES[d] == TDM_DTYPE_BF16;
        for (size_t s = 0; s < (plain ? n_all : n_main); s++) {
            const struct mm_shape sh = s < n_main ? shapes[s] : tails[s - n_main];
            struct tdm_test_weight tw;
            tdm_test_weight_make(&rng_state, DTYPES[d], sh.rows, sh.cols, &tw);
            float *x = rand_vec((size_t)sh.n * sh.cols, -1, 1);
            float *bias = sh.bias ? rand_vec((size_t)sh.rows, -1, 1) : NULL;
            for (int k = 0; k < n_bes; k++) {
                const struct be *e = &bes[k];
                if (s >= n_main && !e->tails) continue;
                matmul_check(e, &tw, &sh, x, bias, e->invariant && sh.n > 1 ? 1 + sh.n / 3 : 0,
                             "matmul");
            }
            free(bias);
            free(x);
            tdm_test_weight_free(&tw);
        }
    }
}

/* Whether matmul_swiglu on e at n rows is the prefill's form (backend.h): on CUDA, not batch
 * invariant, where gate and up go to cuBLASLt (past TDM_CU_QGEMV_MAX_N = 64 rows for a matrix
 * kept in blocks, TDM_CU_GEMV_MAX_N = 8 for a bf16 one), they come out as bf16. */
static bool swiglu_bf16_between(const struct be *e, enum tdm_dtype gate, int n)
{
    if (!e->cuda || e->invariant) return false;
    const bool in_blocks =
        e->blocks && (gate == TDM_DTYPE_Q8_0 || gate == TDM_DTYPE_Q4_0 || gate == TDM_DTYPE_Q4_1 ||
                      gate == TDM_DTYPE_Q4_K || gate == TDM_DTYPE_Q6_K);
    return n > (in_blocks ? 64 : 8);
}

/* matmul_multi of three weights (q, k, v; bias on q) and matmul_swiglu on backend e at n rows:
 * against the references, and bit for bit against the plain ops they fuse (matmul_swiglu in its
 * prefill form, gate and up rounded to bf16: within that rounding of them). */
static void fused_check(const struct be *e, const struct tdm_test_weight *tw, const int64_t *rows,
                        const struct tdm_test_weight *gatew, const struct tdm_test_weight *upw,
                        int64_t D, int64_t F, const float *x, const float *bq, int n)
{
    const struct tdm_test_weight gate = *gatew, up = *upw;
    const float *bias[3] = {bq, NULL, NULL};
    const struct tdm_backend_i *o = e->b->iface;
    struct tdm_weight w[3], wg = prepared(e, &gate), wu = prepared(e, &up);
    float *dx = put(e, x, (size_t)n * D), *dbq = put(e, bq, (size_t)rows[0]);
    float *fused[3], *alone[3];
    struct tdm_matmul_part parts[3];
    for (int j = 0; j < 3; j++) {
        w[j] = prepared(e, &tw[j]);
        fused[j] = poisoned(e, (size_t)n * rows[j]);
        alone[j] = poisoned(e, (size_t)n * rows[j]);
        parts[j] = (struct tdm_matmul_part){&w[j], j == 0 ? dbq : NULL, fused[j]};
    }
    o->matmul_multi(e->b, dx, n, parts, 3);
    for (int j = 0; j < 3; j++) {
        o->matmul(e->b, &w[j], dx, n, j == 0 ? dbq : NULL, alone[j]);
        float *hf = get(e, fused[j], (size_t)n * rows[j]);
        float *ha = get(e, alone[j], (size_t)n * rows[j]);
        check_matmul(e, &tw[j], x, n, bias[j], hf, "matmul_multi");
        if (memcmp(hf, ha, (size_t)n * rows[j] * sizeof(float))) {
            print_error("%s: matmul_multi part %d (%s, n=%d) differs from matmul\n", e->name, j,
                        tdm_dtype_name(tw[j].w.dtype), n);
            fail();
        }
        free(hf), free(ha);
        drop(e, fused[j]), drop(e, alone[j]);
    }
    float *sw = poisoned(e, (size_t)n * F), *g = poisoned(e, (size_t)n * F),
          *u = poisoned(e, (size_t)n * F), *su = poisoned(e, (size_t)n * F);
    o->matmul_swiglu(e->b, &wg, &wu, dx, n, sw);
    o->matmul(e->b, &wg, dx, n, NULL, g);
    o->matmul(e->b, &wu, dx, n, NULL, u);
    o->silu_mul(e->b, g, u, n, (int)F, su);
    float *hs = get(e, sw, (size_t)n * F), *hsu = get(e, su, (size_t)n * F);
    if (swiglu_bf16_between(e, gate.w.dtype, n)) {
        /* d(silu(g) u) = silu'(g) u dg + silu(g) du, |silu'| <= 1.1; bf16 g and u are each
         * within 2^-9 (and the bf16-out GEMM may sum in another order): 2^-7 of each term */
        float *hg = get(e, g, (size_t)n * F), *hu = get(e, u, (size_t)n * F);
        for (size_t i = 0; i < (size_t)n * F; i++) {
            const double gi = hg[i], ui = hu[i], sg = gi / (1 + exp(-gi));
            const double tol = (1.1 * fabs(gi * ui) + fabs(sg * ui)) / 128 + 1e-6;
            if (!(fabs((double)hs[i] - hsu[i]) <= tol)) {
                print_error("%s: matmul_swiglu (n=%d) [%zu] = %.9g, matmul, matmul, silu_mul "
                            "%.9g: past bf16 rounding (tol %.3g)\n",
                            e->name, n, i, hs[i], hsu[i], tol);
                fail();
            }
        }
        free(hg), free(hu);
    } else if (memcmp(hs, hsu, (size_t)n * F * sizeof(float))) {
        print_error("%s: matmul_swiglu (n=%d) differs from matmul, matmul, silu_mul\n", e->name, n);
        fail();
    }
    /* and the reference: silu(x Wg) * (x Wu), with both products' error propagated
     * (|d silu(g) u| <= 1.1 |dg| |u| + |silu(g)| |du|) */
    for (int i = 0; i < n; i++)
        for (int64_t r = 0; r < F; r++) {
            double sg = 0, su_ = 0, mg = 0, mu = 0;
            for (int64_t c = 0; c < D; c++) {
                const double a = (double)gate.deq[r * D + c] * x[i * D + c];
                const double b = (double)up.deq[r * D + c] * x[i * D + c];
                sg += a, su_ += b, mg += fabs(a), mu += fabs(b);
            }
            const double ref = sg / (1 + exp(-sg)) * su_;
            const double tol =
                1.1 * e->mm * mg * (fabs(su_) + e->mm * mu) + fabs(sg) * e->mm * mu + 1e-6;
            const double got = hs[(size_t)i * F + r];
            if (!(fabs(got - ref) <= tol)) {
                print_error("%s: swiglu [%d][%lld] = %.9g, ref %.9g (tol %.3g)\n", e->name, i,
                            (long long)r, got, ref, tol);
                fail();
            }
        }
    free(hs), free(hsu);
    drop(e, sw), drop(e, g), drop(e, u), drop(e, su), drop(e, dx), drop(e, dbq);
}

/* matmul_multi (q, k, v of mixed types) and matmul_swiglu, at 1, 5, 9 and 70 rows (on CUDA: the
 * CUDA-core, tensor-core, and cuBLASLt paths): against the references, and bit for bit against
 * the plain ops they fuse. */
static void test_matmul_fused(void **state)
{
    (void)state;
    const int ns[] = {1, 5, 9, 70};
    const int64_t D = 256, F = 96, rows[3] = {128, 64, 64};
    for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
        struct tdm_test_weight tw[3], gate, up;
        for (int j = 0; j < 3; j++)
            tdm_test_weight_make(&rng_state, DTYPES[(d + (size_t)j) % TDM_ARRAY_LEN(DTYPES)],
                                 rows[j], D, &tw[j]);
        /* swiglu with quantised weights (F32 ones may take OpenBLAS alone: see backend.h) */
        tdm_test_weight_make(&rng_state, DTYPES[2 + d % 3], F, D, &gate);
        tdm_test_weight_make(&rng_state, DTYPES[2 + (d + 1) % 3], F, D, &up);
        for (size_t ni = 0; ni < TDM_ARRAY_LEN(ns); ni++) {
            const int n = ns[ni];
            float *x = rand_vec((size_t)n * D, -1, 1), *bq = rand_vec((size_t)rows[0], -1, 1);
            for (int k = 0; k < n_bes; k++)
                fused_check(&bes[k], tw, rows, &gate, &up, D, F, x, bq, n);
            free(x), free(bq);
        }
        for (int j = 0; j < 3; j++)
            tdm_test_weight_free(&tw[j]);
        tdm_test_weight_free(&gate), tdm_test_weight_free(&up);
    }
}

/* Matrices in GGUF blocks at the widths every kind takes (the K-quants' 256 columns), at batch
 * sizes that cover CUDA's paths for matrices kept in blocks (tensor-core tiles of 8, 16 and 32
 * tokens up to TDM_CU_QGEMV_MAX_N, then dequantised chunks through cuBLASLt): matmul against
 * the reference; matmul_multi and matmul_swiglu of one kind bit for bit against the ops they
 * fuse; and on CUDA, where the block kernels do not depend on the batch, each token's row at
 * every batch up to 64 bit for bit its row alone. */
static void test_matmul_blocks(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K,
                                  TDM_DTYPE_Q6_K};
    const struct mm_shape shapes[] = {
        {48, 256, 1, true},  {37, 512, 3, false},  {64, 1536, 8, true},  {40, 768, 9, false},
        {16, 256, 16, true}, {33, 512, 17, false}, {96, 1024, 32, true}, {24, 256, 40, false},
        {80, 512, 64, true}, {48, 768, 65, false}, {32, 256, 130, true}};
    for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++)
        for (size_t s = 0; s < TDM_ARRAY_LEN(shapes); s++) {
            const struct mm_shape sh = shapes[s];
            struct tdm_test_weight tw;
            tdm_test_weight_make(&rng_state, dts[d], sh.rows, sh.cols, &tw);
            float *x = rand_vec((size_t)sh.n * sh.cols, -1, 1);
            float *bias = sh.bias ? rand_vec((size_t)sh.rows, -1, 1) : NULL;
            for (int k = 0; k < n_bes; k++) {
                const struct be *e = &bes[k];
                if (!e->cuda && !cpu_runs(dts[d])) continue;
                const bool alone = e->blocks && (sh.n <= 64 || e->invariant);
                matmul_check(e, &tw, &sh, x, bias, alone ? TDM_MAX(1, sh.n / 4) : 0,
                             "matmul in blocks");
            }
            free(bias);
            free(x);
            tdm_test_weight_free(&tw);
        }
    /* the fused ops with every part of one kind */
    const int ns[] = {1, 5, 9, 40, 70};
    const int64_t D = 512, F = 96, rows[3] = {128, 64, 64};
    for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++) {
        struct tdm_test_weight tw[3], gate, up;
        for (int j = 0; j < 3; j++)
            tdm_test_weight_make(&rng_state, dts[d], rows[j], D, &tw[j]);
        tdm_test_weight_make(&rng_state, dts[d], F, D, &gate);
        tdm_test_weight_make(&rng_state, dts[d], F, D, &up);
        for (size_t ni = 0; ni < TDM_ARRAY_LEN(ns); ni++) {
            const int n = ns[ni];
            float *x = rand_vec((size_t)n * D, -1, 1), *bq = rand_vec((size_t)rows[0], -1, 1);
            for (int k = 0; k < n_bes; k++)
                if (bes[k].cuda || cpu_runs(dts[d]))
                    fused_check(&bes[k], tw, rows, &gate, &up, D, F, x, bq, n);
            free(x), free(bq);
        }
        for (int j = 0; j < 3; j++)
            tdm_test_weight_free(&tw[j]);
        tdm_test_weight_free(&gate), tdm_test_weight_free(&up);
    }
}

#ifdef TDM_HAVE_CUDA
/* backend/cuda/cuda_kernels.h: which form of the block kernel runs (0 auto, 1 registers, 2 the
 * copy engine's stages); the two must give the same bits */
void tdm_cu_qgemv_set_form(int form);

/* The block kernel's two forms on shapes that take the staged one through several refills of
 * its 4 stages (up to 14,336 columns), a partial last stage, rows past the last 16-row block
 * and token tiles of 8, 16 and 32: each against the reference, and the two bit for bit, for
 * matmul, matmul_multi and matmul_swiglu. */
static void test_matmul_block_forms(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K,
                                  TDM_DTYPE_Q6_K};
    const struct mm_shape shapes[] = {{40, 8192, 3, true},   {37, 4352, 9, false},
                                      {24, 14336, 1, false}, {300, 2048, 20, true},
                                      {16, 1024, 64, false}, {129, 256, 2, true}};
    for (int k = 0; k < n_bes; k++) {
        const struct be *e = &bes[k];
        if (!e->blocks) continue;
        for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++)
            for (size_t si = 0; si < TDM_ARRAY_LEN(shapes); si++) {
                const struct mm_shape sh = shapes[si];
                struct tdm_test_weight tw;
                tdm_test_weight_make(&rng_state, dts[d], sh.rows, sh.cols, &tw);
                float *x = rand_vec((size_t)sh.n * sh.cols, -1, 1);
                float *bias = sh.bias ? rand_vec((size_t)sh.rows, -1, 1) : NULL;
                const size_t n_out = (size_t)sh.n * sh.rows;
                struct tdm_weight w = prepared(e, &tw);
                float *dx = put(e, x, (size_t)sh.n * sh.cols);
                float *db = bias ? put(e, bias, (size_t)sh.rows) : NULL;
                float *out[2];
                for (int f = 0; f < 2; f++) {
                    tdm_cu_qgemv_set_form(f ? 2 : 1);
                    float *dout = poisoned(e, n_out);
                    e->b->iface->matmul(e->b, &w, dx, sh.n, db, dout);
                    out[f] = get(e, dout, n_out);
                    drop(e, dout);
                    check_matmul(e, &tw, x, sh.n, bias, out[f], f ? "matmul (staged)" : "matmul");
                }
                if (memcmp(out[0], out[1], n_out * sizeof(float))) {
                    print_error("%s: %s %lldx%lld n=%d: the staged block kernel differs from the "
                                "register one\n",
                                e->name, tdm_dtype_name(dts[d]), (long long)sh.rows,
                                (long long)sh.cols, sh.n);
                    fail();
                }
                free(out[0]), free(out[1]);
                drop(e, dx);
                if (db) drop(e, db);
                free(bias), free(x);
                tdm_test_weight_free(&tw);
            }
        /* the fused ops (3 parts; SwiGLU's two matrices share a stage) in both forms */
        const int64_t D = 4352, F = 48, rows[3] = {64, 32, 32};
        for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++) {
            struct tdm_test_weight tw[3], gate, up;
            for (int j = 0; j < 3; j++)
                tdm_test_weight_make(&rng_state, dts[d], rows[j], D, &tw[j]);
            tdm_test_weight_make(&rng_state, dts[d], F, D, &gate);
            tdm_test_weight_make(&rng_state, dts[d], F, D, &up);
            float *x = rand_vec((size_t)5 * D, -1, 1), *bq = rand_vec((size_t)rows[0], -1, 1);
            struct tdm_weight wg = prepared(e, &gate), wu = prepared(e, &up);
            float *dx = put(e, x, (size_t)5 * D);
            float *sw[2];
            for (int f = 0; f < 2; f++) {
                tdm_cu_qgemv_set_form(f ? 2 : 1);
                fused_check(e, tw, rows, &gate, &up, D, F, x, bq, 5);
                float *d_sw = poisoned(e, (size_t)5 * F);
                e->b->iface->matmul_swiglu(e->b, &wg, &wu, dx, 5, d_sw);
                sw[f] = get(e, d_sw, (size_t)5 * F);
                drop(e, d_sw);
            }
            if (memcmp(sw[0], sw[1], (size_t)5 * F * sizeof(float))) {
                print_error("%s: matmul_swiglu %s: the staged block kernel differs from the "
                            "register one\n",
                            e->name, tdm_dtype_name(dts[d]));
                fail();
            }
            free(sw[0]), free(sw[1]);
            drop(e, dx);
            free(x), free(bq);
            for (int j = 0; j < 3; j++)
                tdm_test_weight_free(&tw[j]);
            tdm_test_weight_free(&gate), tdm_test_weight_free(&up);
        }
        tdm_cu_qgemv_set_form(0);
    }
}
#else
static void test_matmul_block_forms(void **state)
{
    (void)state;
    printf("SKIP: test_matmul_block_forms: this build has no CUDA\n");
}
#endif

static void test_embed(void **state)
{
    (void)state;
    const int V = 300, n = 37;
    const int64_t dims[] = {96, 64, 256};
    /* the K-quants at 256 columns: CUDA embeds rows of a table kept in blocks */
    const enum tdm_dtype dts[] = {TDM_DTYPE_F32,  TDM_DTYPE_BF16, TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0,
                                  TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K, TDM_DTYPE_Q6_K};
    for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++)
        for (size_t di = 0; di < TDM_ARRAY_LEN(dims); di++) {
            const int64_t D = dims[di];
            if (tdm_dtype_block_elems(dts[d]) > 32 && D % 256) continue;
            struct tdm_test_weight tw;
            tdm_test_weight_make(&rng_state, dts[d], V, D, &tw);
            int32_t tok[37];
            for (int i = 0; i < n; i++)
                tok[i] = (int32_t)(rng_u64() % V);
            tok[0] = V - 1;
            double *ref = malloc((size_t)n * D * sizeof(double));
            for (int i = 0; i < n; i++)
                for (int64_t c = 0; c < D; c++)
                    ref[i * D + c] = tw.deq[tok[i] * D + c];
            for (int k = 0; k < n_bes; k++) {
                const struct be *e = &bes[k];
                if (!e->cuda && !cpu_runs(dts[d])) continue;
                struct tdm_weight w = prepared(e, &tw);
                float *dout = poisoned(e, (size_t)n * D);
                e->b->iface->embed(e->b, &w, tok, n, dout);
                float *out = get(e, dout, (size_t)n * D);
                check_rel(e->name, "embed", out, ref, (size_t)n * D, e->emb, 0);
                free(out);
                drop(e, dout);
            }
            free(ref);
            tdm_test_weight_free(&tw);
        }
}

/* ---- norms and elementwise ops ---- */

static void ref_rmsnorm(const double *x, const float *w, float eps, int n, int dim, double *out)
{
    for (int i = 0; i < n; i++) {
        double ss = 0;
        for (int c = 0; c < dim; c++)
            ss += x[(size_t)i * dim + c] * x[(size_t)i * dim + c];
        const double inv = 1.0 / sqrt(ss / dim + eps);
        for (int c = 0; c < dim; c++)
            out[(size_t)i * dim + c] = x[(size_t)i * dim + c] * inv * w[c];
    }
}

static void test_norms_elementwise(void **state)
{
    (void)state;
    const int dims[] = {8, 64, 96, 576, 4096, 5000};
    for (size_t di = 0; di < TDM_ARRAY_LEN(dims); di++) {
        const int dim = dims[di], n = 13;
        const size_t N = (size_t)n * dim;
        float *x = rand_vec(N, -2, 2), *y = rand_vec(N, -2, 2), *w = rand_vec(dim, 0.5f, 1.5f);
        double *xd = malloc(N * sizeof(double)), *sum = malloc(N * sizeof(double));
        double *r_norm = malloc(N * sizeof(double)), *r_add = malloc(N * sizeof(double));
        double *r_head = malloc(N * sizeof(double)), *r_silu = malloc(N * sizeof(double));
        double *yd = malloc(N * sizeof(double));
        for (size_t i = 0; i < N; i++) {
            xd[i] = x[i], yd[i] = y[i];
            sum[i] = (double)x[i] + y[i];
            r_silu[i] = x[i] / (1 + exp(-(double)x[i])) * y[i];
        }
        ref_rmsnorm(xd, w, 1e-5f, n, dim, r_norm);
        ref_rmsnorm(sum, w, 1e-6f, n, dim, r_add);
        ref_rmsnorm(yd, w, 1e-6f, n, dim, r_head);
        const int32_t pick[5] = {12, 0, 7, 7, 3};
        double *r_gather = malloc((size_t)5 * dim * sizeof(double));
        for (int i = 0; i < 5; i++)
            for (int c = 0; c < dim; c++)
                r_gather[(size_t)i * dim + c] = x[(size_t)pick[i] * dim + c];
        for (int k = 0; k < n_bes; k++) {
            const struct be *e = &bes[k];
            const struct tdm_backend_i *o = e->b->iface;
            float *dx = put(e, x, N), *dy = put(e, y, N), *dw = put(e, w, (size_t)dim);
            float *dout = poisoned(e, N);
            o->rmsnorm(e->b, dx, dw, 1e-5f, n, dim, dout);
            float *h = get(e, dout, N);
            check_rel(e->name, "rmsnorm", h, r_norm, N, e->elem, 1.0);
            free(h);
            float *dr = put(e, x, N); /* the residual: x += y, out = rmsnorm(x) */
            o->add_rmsnorm(e->b, dr, dy, dw, 1e-6f, n, dim, dout);
            h = get(e, dout, N);
            check_rel(e->name, "add_rmsnorm out", h, r_add, N, e->elem, 1.0);
            free(h);
            h = get(e, dr, N);
            check_rel(e->name, "add_rmsnorm residual", h, sum, N, e->elem, 1.0);
            free(h);
            float *dh = put(e, y, N);
            o->head_rmsnorm(e->b, dh, dw, 1e-6f, n, dim);
            h = get(e, dh, N);
            check_rel(e->name, "head_rmsnorm", h, r_head, N, e->elem, 1.0);
            free(h);
            o->silu_mul(e->b, dx, dy, n, dim, dout);
            h = get(e, dout, N);
            check_rel(e->name, "silu_mul", h, r_silu, N, e->elem, 1.0);
            free(h);
            float *da = put(e, x, N);
            o->add(e->b, da, dy, N);
            h = get(e, da, N);
            check_rel(e->name, "add", h, sum, N, e->elem, 1.0);
            free(h);
            float *dg = poisoned(e, (size_t)5 * dim);
            o->gather_rows(e->b, dx, pick, 5, dim, dg);
            h = get(e, dg, (size_t)5 * dim);
            check_rel(e->name, "gather_rows", h, r_gather, (size_t)5 * dim, 0, 0);
            free(h);
            /* zero, then rows_scale_add of 4 rows (an expert's) into 13, twice (two experts) */
            if (o->zero && o->rows_scale_add) {
                const int32_t to[4] = {12, 0, 7, 3}, to2[2] = {7, 5};
                const float wts[4] = {0.25f, -1.5f, 0.75f, 2.0f}, wts2[2] = {0.5f, 1.0f};
                double *r_sa = calloc(N, sizeof(double));
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < dim; c++)
                        r_sa[(size_t)to[i] * dim + c] += (double)wts[i] * x[(size_t)i * dim + c];
                for (int i = 0; i < 2; i++)
                    for (int c = 0; c < dim; c++)
                        r_sa[(size_t)to2[i] * dim + c] += (double)wts2[i] * y[(size_t)i * dim + c];
                float *ds = poisoned(e, N);
                o->zero(e->b, ds, N);
                o->rows_scale_add(e->b, dx, to, wts, 4, dim, ds);
                o->rows_scale_add(e->b, dy, to2, wts2, 2, dim, ds);
                h = get(e, ds, N);
                check_rel(e->name, "zero + rows_scale_add", h, r_sa, N, e->elem, 1.0);
                free(h);
                free(r_sa);
                drop(e, ds);
            }
            /* scatter_cols: x's 13 rows of min(dim, 40) columns into rows of dim + 7 */
            const int nc = dim < 40 ? dim : 40, wide = dim + 7;
            int32_t *cols = malloc((size_t)nc * sizeof *cols);
            for (int c = 0; c < nc; c++)
                cols[c] = (int32_t)((c * 7 + 3) % wide);         /* distinct: 7 is prime to wide */
            float *dc = put(e, (const float *)cols, (size_t)nc); /* int32s, float-sized */
            float *dsc = poisoned(e, (size_t)n * wide);
            float *dxs = put(e, x, (size_t)n * nc);
            o->scatter_cols(e->b, dxs, (const int32_t *)dc, n, nc, wide, dsc);
            h = get(e, dsc, (size_t)n * wide);
            for (int i = 0; i < n; i++)
                for (int c = 0; c < wide; c++) {
                    float want = -INFINITY;
                    for (int k = 0; k < nc; k++)
                        if (cols[k] == c) want = x[(size_t)i * nc + k];
                    if (memcmp(&h[(size_t)i * wide + c], &want, sizeof want))
                        fail_msg("%s: scatter_cols row %d column %d: %g, want %g", e->name, i, c,
                                 h[(size_t)i * wide + c], want);
                }
            free(h);
            free(cols);
            drop(e, dc), drop(e, dsc), drop(e, dxs);
            drop(e, dx), drop(e, dy), drop(e, dw), drop(e, dout), drop(e, dr), drop(e, dh);
            drop(e, da), drop(e, dg);
        }
        free(x), free(y), free(w), free(xd), free(yd), free(sum), free(r_norm), free(r_add);
        free(r_head), free(r_silu), free(r_gather);
    }
}

/* ---- paged steps: rope + KV append, attention ---- */

/* Sequence s has `len` positions of KV, the last n_new of them this step's tokens. */
struct seq_spec {
    int len, n_new;
};

struct paged_step {
    struct tdm_step st;
    int32_t *buf;
    int64_t n_pages;
};

/* A step over n_seqs sequences whose pages are distinct random pages of a pool with 5 more
 * pages than they need. */
static void build_step(const struct seq_spec *ss, int n_seqs, int ps, struct paged_step *p)
{
    int T = 0, P = 0;
    for (int s = 0; s < n_seqs; s++) {
        T += ss[s].n_new;
        P += (ss[s].len + ps - 1) / ps;
    }
    p->n_pages = P + 5;
    p->buf = malloc(sizeof(int32_t) * (size_t)(4 * T + 3 * (n_seqs + 1) + P + p->n_pages + 1));
    assert_non_null(p->buf);
    int32_t *tok = p->buf, *pos = tok + T, *slot = pos + T, *tseq = slot + T, *sts = tseq + T,
            *kvl = sts + n_seqs + 1, *sps = kvl + n_seqs + 1, *pid = sps + n_seqs + 1,
            *perm = pid + P;
    for (int64_t i = 0; i < p->n_pages; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = p->n_pages - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rng_u64() % (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int t = 0, pg = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int need = (ss[s].len + ps - 1) / ps;
        sts[s] = t, sps[s] = pg, kvl[s] = ss[s].len;
        for (int j = 0; j < need; j++)
            pid[pg + j] = perm[pg + j];
        for (int i = 0; i < ss[s].n_new; i++, t++) {
            const int q = ss[s].len - ss[s].n_new + i;
            tok[t] = 0, pos[t] = q, tseq[t] = s;
            slot[t] = pid[pg + q / ps] * ps + q % ps;
        }
        pg += need;
    }
    sts[n_seqs] = t, sps[n_seqs] = pg;
    p->st = (struct tdm_step){.n_tokens = T,
                              .n_seqs = n_seqs,
                              .tokens = tok,
                              .positions = pos,
                              .slots = slot,
                              .token_seq = tseq,
                              .seq_token_start = sts,
                              .seq_kv_len = kvl,
                              .seq_page_start = sps,
                              .page_ids = pid,
                              .page_size = ps};
}

/* Offset of K (which = 0) or V (1) of KV head g at slot `slot` in an HND layer. */
static size_t kv_off(int nkv, int ps, int hd, int slot, int which, int g)
{
    return ((((size_t)slot / ps) * 2 + which) * nkv + g) * ps * hd + (size_t)(slot % ps) * hd;
}

static void test_rope_kv_append(void **state)
{
    (void)state;
    const int n_heads = 6, nkv = 2, hds[] = {8, 18, 64, 96, 128}, pss[] = {5, 16};
    for (size_t hi = 0; hi < TDM_ARRAY_LEN(hds); hi++)
        for (size_t pi = 0; pi < TDM_ARRAY_LEN(pss); pi++)
            for (int neox = 0; neox < 2; neox++) {
                const int hd = hds[hi], ps = pss[pi];
                const struct seq_spec seqs[] = {{12, 12}, {33, 2}, {40, 1}};
                struct paged_step p;
                build_step(seqs, 3, ps, &p);
                const int T = p.st.n_tokens;
                int32_t *positions = (int32_t *)p.st.positions;
                /* a large position exercises the fp32 angle (positions are read for angles only;
                 * the slot says where k and v go) */
                positions[T - 1] = 9000 + 12;
                const size_t kvn = (size_t)p.n_pages * 2 * nkv * ps * hd;
                float *sentinel = malloc(kvn * sizeof(float));
                for (size_t i = 0; i < kvn; i++)
                    sentinel[i] = 12345.0f;
                float *inv = malloc((size_t)hd / 2 * sizeof(float));
                for (int i = 0; i < hd / 2; i++)
                    inv[i] = (float)pow(10000.0, -2.0 * i / hd);
                struct tdm_rope rope = {.head_dim = hd, .neox = neox, .inv_freq = inv};
                const size_t nq = (size_t)T * n_heads * hd, nk = (size_t)T * nkv * hd;
                float *q = rand_vec(nq, -1, 1), *k = rand_vec(nk, -1, 1), *v = rand_vec(nk, -1, 1);
                /* the reference: q and k rotated in double by the fp32 angle pos * inv_freq */
                double *rq = malloc(nq * sizeof(double)), *rk = malloc(nk * sizeof(double));
                for (int t = 0; t < T; t++)
                    for (int h = 0; h < n_heads + nkv; h++) {
                        const float *src = h < n_heads ? q + ((size_t)t * n_heads + h) * hd
                                                       : k + ((size_t)t * nkv + h - n_heads) * hd;
                        double *dst = h < n_heads ? rq + ((size_t)t * n_heads + h) * hd
                                                  : rk + ((size_t)t * nkv + h - n_heads) * hd;
                        for (int i = 0; i < hd / 2; i++) {
                            const int a = neox ? i : 2 * i, c = neox ? i + hd / 2 : 2 * i + 1;
                            const double ang = (double)((float)positions[t] * inv[i]);
                            dst[a] = src[a] * cos(ang) - src[c] * sin(ang);
                            dst[c] = src[a] * sin(ang) + src[c] * cos(ang);
                        }
                    }
                for (int b = 0; b < n_bes; b++) {
                    const struct be *e = &bes[b];
                    char what[64];
                    snprintf(what, sizeof what, "rope%s hd=%d ps=%d", neox ? " neox" : "", hd, ps);
                    float *dq = put(e, q, nq), *dk = put(e, k, nk), *dv = put(e, v, nk);
                    float *dkv = put(e, sentinel, kvn);
                    struct tdm_kv_layer kv = {.base = dkv,
                                              .n_kv_heads = nkv,
                                              .head_dim = hd,
                                              .page_size = ps,
                                              .n_pages = p.n_pages};
                    e->b->iface->rope_kv_append(e->b, dq, dk, dv, n_heads, &p.st, &rope, &kv);
                    float *hq = get(e, dq, nq), *hkv = get(e, dkv, kvn);
                    check_rel(e->name, what, hq, rq, nq, e->elem, 1.0);
                    float *gk = malloc((size_t)hd * sizeof(float));
                    size_t touched = 0;
                    for (size_t i = 0; i < kvn; i++)
                        touched += hkv[i] != 12345.0f;
                    for (int t = 0; t < T; t++)
                        for (int g = 0; g < nkv; g++) {
                            const int slot = p.st.slots[t];
                            memcpy(gk, hkv + kv_off(nkv, ps, hd, slot, 0, g), hd * sizeof(float));
                            check_rel(e->name, what, gk, rk + ((size_t)t * nkv + g) * hd,
                                      (size_t)hd, e->elem, 1.0);
                            if (memcmp(hkv + kv_off(nkv, ps, hd, slot, 1, g),
                                       v + ((size_t)t * nkv + g) * hd, hd * sizeof(float))) {
                                print_error("%s: %s: V of token %d head %d not appended as is\n",
                                            e->name, what, t, g);
                                fail();
                            }
                        }
                    if (touched != (size_t)T * 2 * nkv * hd) { /* nothing else was written */
                        print_error("%s: %s: %zu KV values written, not %zu\n", e->name, what,
                                    touched, (size_t)T * 2 * nkv * hd);
                        fail();
                    }
                    free(gk), free(hq), free(hkv);
                    drop(e, dq), drop(e, dk), drop(e, dv), drop(e, dkv);
                }
                free(rq), free(rk), free(q), free(k), free(v), free(inv), free(sentinel);
                free(p.buf);
            }
}

/* The dense reference for token t: a softmax over positions 0..p in double. */
static void ref_attention(const float *q, int n_heads, const struct tdm_step *st, const float *kv,
                          int nkv, int hd, float scale, int t, double *out)
{
    const int group = n_heads / nkv, s = st->token_seq[t], n_pos = st->positions[t] + 1;
    const int ps = st->page_size;
    double *w = malloc((size_t)n_pos * sizeof(double));
    for (int h = 0; h < n_heads; h++) {
        const int g = h / group;
        const float *qh = q + ((size_t)t * n_heads + h) * hd;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < n_pos; j++) {
            const int slot = st->page_ids[st->seq_page_start[s] + j / ps] * ps + j % ps;
            const float *kr = kv + kv_off(nkv, ps, hd, slot, 0, g);
            double d = 0;
            for (int i = 0; i < hd; i++)
                d += (double)qh[i] * kr[i];
            w[j] = d * scale;
            if (w[j] > mx) mx = w[j];
        }
        for (int j = 0; j < n_pos; j++)
            sum += (w[j] = exp(w[j] - mx));
        for (int i = 0; i < hd; i++) {
            double o = 0;
            for (int j = 0; j < n_pos; j++) {
                const int slot = st->page_ids[st->seq_page_start[s] + j / ps] * ps + j % ps;
                o += w[j] * kv[kv_off(nkv, ps, hd, slot, 1, g) + i];
            }
            out[(size_t)h * hd + i] = o / sum;
        }
    }
    free(w);
}

static void attention_case(int nh, int nkv, int hd, int ps, const struct seq_spec *ss, int n)
{
    struct paged_step p;
    build_step(ss, n, ps, &p);
    const int T = p.st.n_tokens;
    const size_t kvn = (size_t)p.n_pages * 2 * nkv * ps * hd, nq = (size_t)T * nh * hd;
    /* the sequences' positions hold values; every other slot is NaN, and must never be read */
    float *kv = malloc(kvn * sizeof(float));
    for (size_t i = 0; i < kvn; i++)
        kv[i] = NAN;
    for (int s = 0; s < n; s++)
        for (int j = 0; j < ss[s].len; j++) {
            const int slot = p.st.page_ids[p.st.seq_page_start[s] + j / ps] * ps + j % ps;
            for (int which = 0; which < 2; which++)
                for (int g = 0; g < nkv; g++)
                    for (int i = 0; i < hd; i++)
                        kv[kv_off(nkv, ps, hd, slot, which, g) + i] = rng_f(-1, 1);
        }
    /* larger |q| makes the softmax peaky, exercising the running-max rescaling */
    float *q = rand_vec(nq, -4, 4);
    const float scale = 1.0f / sqrtf((float)hd);
    double *ref = malloc(nq * sizeof(double));
    for (int t = 0; t < T; t++)
        ref_attention(q, nh, &p.st, kv, nkv, hd, scale, t, ref + (size_t)t * nh * hd);
    bool prefill = false;
    for (int i = 0; i < n; i++)
        prefill |= ss[i].n_new > 1;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        float *dq = put(e, q, nq), *dkv = put(e, kv, kvn), *dout = poisoned(e, nq);
        struct tdm_kv_layer L = {
            .base = dkv, .n_kv_heads = nkv, .head_dim = hd, .page_size = ps, .n_pages = p.n_pages};
        e->b->iface->attention(e->b, dq, nh, &p.st, &L, scale, dout);
        float *got = get(e, dout, nq);
        char what[96];
        snprintf(what, sizeof what, "attention nh=%d nkv=%d hd=%d ps=%d seqs=%d", nh, nkv, hd, ps,
                 n);
        /* absolute on outputs within [-1, 1]: a convex combination of values of V */
        check_rel(e->name, what, got, ref, nq,
                  prefill && (hd == 64 || hd == 128) ? e->att_tc : e->att, 1.0);
        free(got);
        drop(e, dq), drop(e, dkv), drop(e, dout);
    }
    free(ref), free(q), free(kv), free(p.buf);
}

static void test_attention(void **state)
{
    (void)state;
    const struct {
        int nh, nkv, hd, ps;
    } heads[] = {
        {6, 2, 16, 16}, /* GQA 3:1 */
        {4, 4, 20, 5},  /* MHA, head_dim not a multiple of 8, odd page size */
        {18, 1, 8, 7},  /* one KV head shared by many heads */
        {2, 1, 64, 1},  /* one position per page */
        {9, 3, 64, 16},  {32, 8, 128, 7}, {8, 1, 96, 16}, {16, 2, 128, 16},
        {4, 2, 256, 16}, {16, 1, 64, 16}, /* 16 heads a KV head: the widest decode tile of the
                                             pipelined kernel */
        {4, 4, 128, 16},                  /* MHA at head_dim 128: a decode tile of one row */
    };
    /* prefill chunks (one over an existing prefix), decodes past several softmax chunks and
     * 128-position segments (split-KV), and short chunks in the middle of sequences */
    const struct seq_spec mixed[] = {{10, 10}, {97, 1}, {23, 3}, {2, 1}, {600, 1}, {258, 3}};
    const struct seq_spec prefill[] = {{45, 45}, {1, 1}, {103, 33}, {100, 100}};
    const struct seq_spec decode[] = {{1500, 1}, {3, 1}, {777, 1}};
    const struct seq_spec one[] = {{4000, 1}};
    for (size_t h = 0; h < TDM_ARRAY_LEN(heads); h++) {
        const int nh = heads[h].nh, nkv = heads[h].nkv, hd = heads[h].hd, ps = heads[h].ps;
        attention_case(nh, nkv, hd, ps, mixed, (int)TDM_ARRAY_LEN(mixed));
        attention_case(nh, nkv, hd, ps, prefill, (int)TDM_ARRAY_LEN(prefill));
        attention_case(nh, nkv, hd, ps, decode, (int)TDM_ARRAY_LEN(decode));
        if (hd >= 64) attention_case(nh, nkv, hd, ps, one, 1);
    }
}

/* ---- token trees: the attention contract's tree tokens (backend.h) ----
 * One step: a chain sequence (2 new tokens over 35, pages of its own) beside a tree sequence:
 * a prefix of P positions, the root (a chain token at P) and n nodes, node i - 1 being span
 * token i, of a random parent (depth at most 10), at position P + its depth, in the slot of
 * position P + i (a verified tree's layout). Every tree token is checked against a
 * double-precision softmax over positions [0, P] through the page table and the nodes of its
 * mask; KV that no token may see is NaN. On the CPU each tree token's output also equals, bit
 * for bit, that of a chain token at the same position whose earlier positions hold the same K
 * and V (its path laid out as a sequence): what makes tree verification exact. */
struct tree_step {
    struct paged_step chain; /* the chain sequence's, reused for its arrays */
    struct tdm_step st;
    int32_t *buf;
    uint64_t *mask;
    int64_t n_pages;
    int T, P, n_nodes;
};

static void build_tree_step(int ps, int P, int n_nodes, struct tree_step *ts)
{
    const int Lc = 35, Nc = 2, T = Nc + 1 + n_nodes;
    const int pages_c = (Lc + ps - 1) / ps, pages_t = (P + 1 + n_nodes + ps - 1) / ps;
    ts->T = T, ts->P = P, ts->n_nodes = n_nodes;
    ts->n_pages = pages_c + pages_t + 3;
    ts->buf = malloc(sizeof(int32_t) * (size_t)(5 * T + 16 + pages_c + pages_t + ts->n_pages));
    ts->mask = calloc((size_t)T, sizeof *ts->mask);
    assert_non_null(ts->buf);
    assert_non_null(ts->mask);
    int32_t *tok = ts->buf, *pos = tok + T, *slot = pos + T, *tseq = slot + T, *nslot = tseq + T,
            *sts = nslot + T, *kvl = sts + 3, *sps = kvl + 2, *pre = sps + 3, *tns = pre + 2,
            *pid = tns + 3, *perm = pid + pages_c + pages_t;
    for (int64_t i = 0; i < ts->n_pages; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = ts->n_pages - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rng_u64() % (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int j = 0; j < pages_c + pages_t; j++)
        pid[j] = perm[j];
    /* the chain sequence: positions Lc - Nc .. Lc - 1 */
    for (int i = 0; i < Nc; i++) {
        const int q = Lc - Nc + i;
        tok[i] = 0, pos[i] = q, tseq[i] = 0, slot[i] = pid[q / ps] * ps + q % ps;
    }
    /* the tree sequence: the root, then the nodes */
    const int32_t *tp = pid + pages_c;
    int depth_max = 0;
    for (int i = 0; i <= n_nodes; i++) {
        const int t = Nc + i, q = P + i;
        tok[t] = 0, tseq[t] = 1, slot[t] = tp[q / ps] * ps + q % ps;
        if (i == 0) {
            pos[t] = P;
            continue;
        }
        int par;
        do
            par = (int)(rng_u64() % (uint64_t)i);
        while (pos[Nc + par] - P >= 10);
        pos[t] = pos[Nc + par] + 1;
        ts->mask[t] = ts->mask[Nc + par] | (uint64_t)1 << (i - 1);
        nslot[i - 1] = slot[t];
        depth_max = TDM_MAX(depth_max, pos[t] - P);
    }
    sts[0] = 0, sts[1] = Nc, sts[2] = T;
    kvl[0] = Lc, kvl[1] = P + depth_max + 1;
    sps[0] = 0, sps[1] = pages_c, sps[2] = pages_c + pages_t;
    pre[0] = Lc, pre[1] = P + 1;
    tns[0] = 0, tns[1] = 0, tns[2] = n_nodes;
    ts->st = (struct tdm_step){.n_tokens = T,
                               .n_seqs = 2,
                               .tokens = tok,
                               .positions = pos,
                               .slots = slot,
                               .token_seq = tseq,
                               .seq_token_start = sts,
                               .seq_kv_len = kvl,
                               .seq_page_start = sps,
                               .page_ids = pid,
                               .page_size = ps,
                               .tree_mask = ts->mask,
                               .seq_prefix = pre,
                               .tree_node_start = tns,
                               .tree_slots = nslot};
}

/* The KV slots token t sees, in position order; returns how many. */
static int tree_seen(const struct tdm_step *st, int t, int32_t *out)
{
    const int s = st->token_seq[t], ps = st->page_size;
    const int32_t *pages = st->page_ids + st->seq_page_start[s];
    const uint64_t m = st->tree_mask[t];
    const int paged = m ? st->seq_prefix[s] : st->positions[t] + 1;
    int n = 0;
    for (int p = 0; p < paged; p++)
        out[n++] = pages[p / ps] * ps + p % ps;
    for (uint64_t x = m; x; x &= x - 1)
        out[n++] = st->tree_slots[st->tree_node_start[s] + __builtin_ctzll(x)];
    return n;
}

static void tree_attention_case(int nh, int nkv, int hd, int ps, int P, int n_nodes)
{
    struct tree_step ts;
    build_tree_step(ps, P, n_nodes, &ts);
    const struct tdm_step *st = &ts.st;
    const int T = st->n_tokens, group = nh / nkv;
    const size_t kvn = (size_t)ts.n_pages * 2 * nkv * ps * hd, nq = (size_t)T * nh * hd;
    float *kv = malloc(kvn * sizeof(float));
    for (size_t i = 0; i < kvn; i++)
        kv[i] = NAN;
    int32_t *seen = malloc((size_t)(P + 64 + 64) * sizeof *seen);
    for (int t = 0; t < T; t++) { /* values where some token looks */
        const int n = tree_seen(st, t, seen);
        for (int j = 0; j < n; j++)
            for (int which = 0; which < 2; which++)
                for (int g = 0; g < nkv; g++)
                    for (int i = 0; i < hd; i++) {
                        float *x = &kv[kv_off(nkv, ps, hd, seen[j], which, g) + i];
                        if (isnan(*x)) *x = rng_f(-1, 1);
                    }
    }
    float *q = rand_vec(nq, -4, 4);
    const float scale = 1.0f / sqrtf((float)hd);
    double *ref = malloc(nq * sizeof(double)), *w = malloc((size_t)(P + 128) * sizeof(double));
    for (int t = 0; t < T; t++) {
        const int n = tree_seen(st, t, seen);
        for (int h = 0; h < nh; h++) {
            const int g = h / group;
            const float *qh = q + ((size_t)t * nh + h) * hd;
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) {
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += (double)qh[i] * kv[kv_off(nkv, ps, hd, seen[j], 0, g) + i];
                w[j] = d * scale;
                mx = fmax(mx, w[j]);
            }
            for (int j = 0; j < n; j++)
                sum += (w[j] = exp(w[j] - mx));
            for (int i = 0; i < hd; i++) {
                double o = 0;
                for (int j = 0; j < n; j++)
                    o += w[j] * kv[kv_off(nkv, ps, hd, seen[j], 1, g) + i];
                ref[((size_t)t * nh + h) * hd + i] = o / sum;
            }
        }
    }
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        float *dq = put(e, q, nq), *dkv = put(e, kv, kvn), *dout = poisoned(e, nq);
        struct tdm_kv_layer L = {
            .base = dkv, .n_kv_heads = nkv, .head_dim = hd, .page_size = ps, .n_pages = ts.n_pages};
        e->b->iface->attention(e->b, dq, nh, st, &L, scale, dout);
        float *got = get(e, dout, nq);
        char what[112];
        snprintf(what, sizeof what, "tree attention nh=%d nkv=%d hd=%d ps=%d P=%d nodes=%d", nh,
                 nkv, hd, ps, P, n_nodes);
        check_rel(e->name, what, got, ref, nq, hd == 64 || hd == 128 ? e->att_tc : e->att, 1.0);
        if (!e->cuda) { /* each tree token equals the chain token that sees the same KV */
            for (int t = 2; t < T; t++) {
                const int n = tree_seen(st, t, seen);
                const int pages = (n + ps - 1) / ps;
                const size_t ckvn = (size_t)pages * 2 * nkv * ps * hd;
                float *ckv = malloc(ckvn * sizeof(float));
                for (int j = 0; j < n; j++)
                    for (int which = 0; which < 2; which++)
                        for (int g = 0; g < nkv; g++)
                            memcpy(&ckv[kv_off(nkv, ps, hd, j, which, g)],
                                   &kv[kv_off(nkv, ps, hd, seen[j], which, g)],
                                   (size_t)hd * sizeof(float));
                int32_t pid[1024], z = 0, sts[2] = {0, 1}, kvl[1] = {n}, sps[2] = {0, pages};
                for (int j = 0; j < pages; j++)
                    pid[j] = j;
                int32_t p1 = n - 1, s1 = n - 1;
                struct tdm_step cs = {.n_tokens = 1,
                                      .n_seqs = 1,
                                      .tokens = &z,
                                      .positions = &p1,
                                      .slots = &s1,
                                      .token_seq = &z,
                                      .seq_token_start = sts,
                                      .seq_kv_len = kvl,
                                      .seq_page_start = sps,
                                      .page_ids = pid,
                                      .page_size = ps};
                float *cq = put(e, q + (size_t)t * nh * hd, (size_t)nh * hd);
                float *cd = put(e, ckv, ckvn), *co = poisoned(e, (size_t)nh * hd);
                struct tdm_kv_layer CL = {.base = cd,
                                          .n_kv_heads = nkv,
                                          .head_dim = hd,
                                          .page_size = ps,
                                          .n_pages = pages};
                e->b->iface->attention(e->b, cq, nh, &cs, &CL, scale, co);
                float *cg = get(e, co, (size_t)nh * hd);
                if (memcmp(cg, got + (size_t)t * nh * hd, (size_t)nh * hd * sizeof(float))) {
                    print_error("%s: %s: tree token %d differs from its chain\n", e->name, what, t);
                    fail();
                }
                free(cg), free(ckv);
                drop(e, cq), drop(e, cd), drop(e, co);
            }
        }
        free(got);
        drop(e, dq), drop(e, dkv), drop(e, dout);
    }
    free(ref), free(w), free(q), free(kv), free(seen), free(ts.buf), free(ts.mask);
}

static void test_tree_attention(void **state)
{
    (void)state;
    const struct {
        int nh, nkv, hd, ps;
    } heads[] = {
        {6, 2, 16, 16}, {4, 4, 20, 5},   {18, 1, 8, 7},
        {9, 3, 64, 16}, {32, 8, 128, 7}, {8, 1, 96, 16},
    };
    const struct {
        int P, nodes;
    } shapes[] = {{0, 5}, {3, 1}, {40, 24}, {130, 63}, {600, 64}, {1300, 16}};
    for (size_t h = 0; h < TDM_ARRAY_LEN(heads); h++)
        for (size_t sh = 0; sh < TDM_ARRAY_LEN(shapes); sh++) {
#ifdef TDM_SANITIZE
            /* instrumented, the widest head's long prefixes are half of the suite's slowest C
             * test; the other heads run them, and the widest runs the short ones */
            if (heads[h].nh * heads[h].hd >= 4096 && shapes[sh].P >= 600) continue;
#endif
            tree_attention_case(heads[h].nh, heads[h].nkv, heads[h].hd, heads[h].ps, shapes[sh].P,
                                shapes[sh].nodes);
        }
}

/* ---- KV of 2-byte element types (bf16, f16) ----
 * rope_kv_append stores each K and V element rounded to nearest even: V (appended as is) bit
 * for bit what tdm_f32_to_bf16 / tdm_f32_to_f16 (core/util.c) make of it; K (rotated in fp32)
 * within the op's elem tolerance plus the type's unit roundoff (2^-8 for bf16, 2^-11 for
 * f16, relative) of the double reference. Attention over a 2-byte pool gives, bit for bit, what it
 * gives over an fp32 pool that holds the same values widened (widening is exact, and the arithmetic
 * after it is the fp32 path's), and meets the fp32 tolerance against the double reference over
 * those values. Every backend, every case (test_kv_copy moves 2-byte rows). */
static uint16_t narrow(enum tdm_dtype dt, float f)
{
    return dt == TDM_DTYPE_BF16 ? tdm_f32_to_bf16(f) : tdm_f32_to_f16(f);
}
static float widen(enum tdm_dtype dt, uint16_t h)
{
    return dt == TDM_DTYPE_BF16 ? tdm_bf16_to_f32(h) : tdm_f16_to_f32(h);
}
static void *put_bytes(const struct be *e, const void *host, size_t bytes)
{
    void *d = e->b->iface->buf_alloc(e->b, bytes + 64);
    assert_non_null(d);
    e->b->iface->upload(e->b, d, host, bytes);
    return d;
}
static void *get_bytes(const struct be *e, const void *d, size_t bytes)
{
    void *h = malloc(bytes + 4);
    assert_non_null(h);
    e->b->iface->download(e->b, h, d, bytes);
    e->b->iface->sync(e->b);
    return h;
}

static void kv16_append_case(enum tdm_dtype dt, int hd, int ps)
{
    const int n_heads = 6, nkv = 2;
    const struct seq_spec seqs[] = {{12, 12}, {33, 2}, {40, 1}};
    struct paged_step p;
    build_step(seqs, 3, ps, &p);
    const int T = p.st.n_tokens;
    const size_t kvn = (size_t)p.n_pages * 2 * nkv * ps * hd;
    uint16_t *sentinel = malloc(kvn * sizeof(uint16_t));
    for (size_t i = 0; i < kvn; i++)
        sentinel[i] = 0x7bcd; /* a finite value in both types, never a rounded input here */
    float *inv = malloc((size_t)hd / 2 * sizeof(float));
    for (int i = 0; i < hd / 2; i++)
        inv[i] = (float)pow(10000.0, -2.0 * i / hd);
    struct tdm_rope rope = {.head_dim = hd, .neox = true, .inv_freq = inv};
    const size_t nq = (size_t)T * n_heads * hd, nk = (size_t)T * nkv * hd;
    float *q = rand_vec(nq, -1, 1), *k = rand_vec(nk, -1, 1), *v = rand_vec(nk, -1, 1);
    double *rk = malloc(nk * sizeof(double));
    for (int t = 0; t < T; t++)
        for (int g = 0; g < nkv; g++)
            for (int i = 0; i < hd / 2; i++) {
                const float *src = k + ((size_t)t * nkv + g) * hd;
                double *dst = rk + ((size_t)t * nkv + g) * hd;
                const double ang = (double)((float)p.st.positions[t] * inv[i]);
                dst[i] = src[i] * cos(ang) - src[i + hd / 2] * sin(ang);
                dst[i + hd / 2] = src[i] * sin(ang) + src[i + hd / 2] * cos(ang);
            }
    const double half_ulp = dt == TDM_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048; /* unit roundoff */
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        float *dq = put(e, q, nq), *dk = put(e, k, nk), *dv = put(e, v, nk);
        void *dkv = put_bytes(e, sentinel, kvn * sizeof(uint16_t));
        struct tdm_kv_layer kv = {.base = dkv,
                                  .dtype = dt,
                                  .n_kv_heads = nkv,
                                  .head_dim = hd,
                                  .page_size = ps,
                                  .n_pages = p.n_pages};
        e->b->iface->rope_kv_append(e->b, dq, dk, dv, n_heads, &p.st, &rope, &kv);
        uint16_t *h = get_bytes(e, dkv, kvn * sizeof(uint16_t));
        size_t touched = 0;
        for (size_t i = 0; i < kvn; i++)
            touched += h[i] != 0x7bcd;
        for (int t = 0; t < T; t++)
            for (int g = 0; g < nkv; g++)
                for (int i = 0; i < hd; i++) {
                    const int slot = p.st.slots[t];
                    const float got = widen(dt, h[kv_off(nkv, ps, hd, slot, 0, g) + i]);
                    const double want = rk[((size_t)t * nkv + g) * hd + i];
                    if (!(fabs(got - want) <= (e->elem + half_ulp) * fmax(fabs(want), 1e-3)))
                        fail_msg("%s: %s K of token %d head %d [%d] = %.9g, ref %.9g", e->name,
                                 tdm_dtype_name(dt), t, g, i, got, want);
                    const uint16_t vv = h[kv_off(nkv, ps, hd, slot, 1, g) + i];
                    const uint16_t wv = narrow(dt, v[((size_t)t * nkv + g) * hd + i]);
                    if (vv != wv)
                        fail_msg("%s: %s V of token %d head %d [%d] = %04x, not %04x", e->name,
                                 tdm_dtype_name(dt), t, g, i, vv, wv);
                }
        /* no input rounds to the sentinel (|values| <= 2 here), so exactly these changed */
        if (touched != (size_t)T * 2 * nkv * hd)
            fail_msg("%s: %s: %zu KV elements written, not %zu", e->name, tdm_dtype_name(dt),
                     touched, (size_t)T * 2 * nkv * hd);
        free(h);
        drop(e, dq), drop(e, dk), drop(e, dv), drop(e, dkv);
    }
    free(rk), free(q), free(k), free(v), free(inv), free(sentinel), free(p.buf);
}

static void kv16_attention_case(enum tdm_dtype dt, int nh, int nkv, int hd, int ps,
                                const struct seq_spec *ss, int n)
{
    struct paged_step p;
    build_step(ss, n, ps, &p);
    const int T = p.st.n_tokens;
    const size_t kvn = (size_t)p.n_pages * 2 * nkv * ps * hd, nq = (size_t)T * nh * hd;
    uint16_t *kv16 = malloc(kvn * sizeof(uint16_t));
    float *kv32 = malloc(kvn * sizeof(float));
    for (size_t i = 0; i < kvn; i++)
        kv16[i] = narrow(dt, rng_f(-1, 1)), kv32[i] = widen(dt, kv16[i]);
    float *q = rand_vec(nq, -4, 4);
    const float scale = 1.0f / sqrtf((float)hd);
    double *ref = malloc(nq * sizeof(double));
    for (int t = 0; t < T; t++)
        ref_attention(q, nh, &p.st, kv32, nkv, hd, scale, t, ref + (size_t)t * nh * hd);
    bool prefill = false;
    for (int i = 0; i < n; i++)
        prefill |= ss[i].n_new > 1;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        float *dq = put(e, q, nq), *d32 = put(e, kv32, kvn), *o32 = poisoned(e, nq),
              *o16 = poisoned(e, nq);
        void *d16 = put_bytes(e, kv16, kvn * sizeof(uint16_t));
        struct tdm_kv_layer L32 = {
            .base = d32, .n_kv_heads = nkv, .head_dim = hd, .page_size = ps, .n_pages = p.n_pages};
        struct tdm_kv_layer L16 = L32;
        L16.base = d16, L16.dtype = dt;
        e->b->iface->attention(e->b, dq, nh, &p.st, &L32, scale, o32);
        e->b->iface->attention(e->b, dq, nh, &p.st, &L16, scale, o16);
        float *g32 = get(e, o32, nq), *g16 = get(e, o16, nq);
        char what[96];
        snprintf(what, sizeof what, "attention %s nh=%d nkv=%d hd=%d ps=%d", tdm_dtype_name(dt), nh,
                 nkv, hd, ps);
        check_rel(e->name, what, g16, ref, nq,
                  prefill && (hd == 64 || hd == 128) ? e->att_tc : e->att, 1.0);
        if (memcmp(g16, g32, nq * sizeof(float)))
            fail_msg("%s: %s differs from the fp32 pool holding the same values", e->name, what);
        free(g32), free(g16);
        drop(e, dq), drop(e, d32), drop(e, o32), drop(e, o16), drop(e, d16);
    }
    free(ref), free(q), free(kv16), free(kv32), free(p.buf);
}

static void test_kv_dtypes(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_BF16, TDM_DTYPE_F16};
    const struct seq_spec mixed[] = {{10, 10}, {97, 1}, {23, 3}, {300, 1}};
    const struct seq_spec prefill[] = {{45, 45}, {70, 30}};
    const struct seq_spec decode[] = {{300, 1}, {77, 1}, {5, 1}}; /* the decode kernel's steps */
    /* chunks enough to go round the tensor-core kernel's stages, over a prefix */
    const struct seq_spec long_prefill[] = {{300, 200}, {150, 150}};
    for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++) {
        kv16_attention_case(dts[d], 9, 3, 64, 16, decode, (int)TDM_ARRAY_LEN(decode));
        kv16_attention_case(dts[d], 32, 8, 128, 7, decode, (int)TDM_ARRAY_LEN(decode));
        kv16_attention_case(dts[d], 4, 2, 256, 16, decode, (int)TDM_ARRAY_LEN(decode));
        kv16_append_case(dts[d], 64, 16);
        kv16_append_case(dts[d], 18, 5);
        kv16_attention_case(dts[d], 6, 2, 16, 16, mixed, (int)TDM_ARRAY_LEN(mixed));
        kv16_attention_case(dts[d], 4, 4, 20, 5, mixed, (int)TDM_ARRAY_LEN(mixed));
        kv16_attention_case(dts[d], 9, 3, 64, 16, mixed, (int)TDM_ARRAY_LEN(mixed));
        kv16_attention_case(dts[d], 9, 3, 64, 16, prefill, (int)TDM_ARRAY_LEN(prefill));
        kv16_attention_case(dts[d], 16, 2, 128, 16, prefill, (int)TDM_ARRAY_LEN(prefill));
        kv16_attention_case(dts[d], 8, 2, 128, 16, long_prefill, (int)TDM_ARRAY_LEN(long_prefill));
        /* a page size that is not a power of two (the page table by division) */
        kv16_attention_case(dts[d], 8, 2, 128, 7, long_prefill, (int)TDM_ARRAY_LEN(long_prefill));
        kv16_attention_case(dts[d], 6, 3, 64, 12, long_prefill, (int)TDM_ARRAY_LEN(long_prefill));
    }
}

/* kv_copy: the pairs in order (a later pair reading what an earlier one wrote, and
 * overwriting what an earlier one read), every KV head of every layer, nothing else; rows of
 * each element type (f32, bf16, f16: the bytes move, whatever they hold). */
static void test_kv_copy(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_F32, TDM_DTYPE_BF16, TDM_DTYPE_F16};
    const int nkv = 3, hd = 24, ps = 5, n_pages = 7, n_layers = 2;
    const size_t layer = (size_t)n_pages * 2 * nkv * ps * hd, n = layer * n_layers;
    for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++) {
        const size_t eb = tdm_kv_elem_bytes(dts[d]);
        uint8_t *kv = malloc(n * eb), *want = malloc(n * eb);
        for (size_t i = 0; i < n * eb; i++)
            kv[i] = (uint8_t)rng_u64();
        /* a path compaction: 7 -> 1, 9 -> 2 (1 and 2 are read first by nobody); then 2 -> 3:
         * reads what the pair before wrote; and 12 -> 7: overwrites the first pair's source */
        const int32_t src[] = {7, 9, 2, 12}, dst[] = {1, 2, 3, 7};
        memcpy(want, kv, n * eb);
        for (int l = 0; l < n_layers; l++)
            for (int i = 0; i < 4; i++)
                for (int which = 0; which < 2; which++)
                    for (int g = 0; g < nkv; g++)
                        memmove(&want[(l * layer + kv_off(nkv, ps, hd, dst[i], which, g)) * eb],
                                &want[(l * layer + kv_off(nkv, ps, hd, src[i], which, g)) * eb],
                                (size_t)hd * eb);
        for (int b = 0; b < n_bes; b++) {
            const struct be *e = &bes[b];
            void *dk = put_bytes(e, kv, n * eb);
            struct tdm_kv_layer L = {.base = dk,
                                     .dtype = dts[d],
                                     .n_kv_heads = nkv,
                                     .head_dim = hd,
                                     .page_size = ps,
                                     .n_pages = n_pages};
            e->b->iface->kv_copy(e->b, &L, n_layers, layer * eb, src, dst, 4);
            uint8_t *got = get_bytes(e, dk, n * eb);
            if (memcmp(got, want, n * eb))
                fail_msg("%s: kv_copy of %s rows", e->name, tdm_dtype_name(dts[d]));
            free(got);
            drop(e, dk);
        }
        free(kv), free(want);
    }
}

/* ---- MLA: head_matmul, latent rows (rope and attention), kv_copy of K-only pages ---- */

static void test_head_matmul(void **state)
{
    (void)state;
    const int H = 3, R = 40, C = 64, n = 5;
    const size_t xs = (size_t)H * 70 + 3, xh = 70, os = (size_t)H * 48 + 1, oh = 48;
    struct tdm_weight host = {TDM_DTYPE_F32, (int64_t)H * R, C, (size_t)C * 4,
                              rand_vec((size_t)H * R * C, -1, 1)};
    float *x = rand_vec((size_t)n * xs, -1, 1);
    const float *W = host.data;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        struct tdm_weight w;
        assert_int_equal(e->b->iface->weight_prepare(e->b, &host, &w), TDM_OK);
        float *dx = put(e, x, (size_t)n * xs), *dout = poisoned(e, (size_t)n * os);
        e->b->iface->head_matmul(e->b, &w, H, dx, n, xs, xh, dout, os, oh);
        float *out = get(e, dout, (size_t)n * os);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < H; j++)
                for (int r = 0; r < R; r++) {
                    double ref = 0, mag = 0;
                    for (int c = 0; c < C; c++) {
                        const double t = (double)W[((size_t)j * R + r) * C + c] *
                                         x[(size_t)i * xs + (size_t)j * xh + c];
                        ref += t, mag += fabs(t);
                    }
                    const float got = out[(size_t)i * os + (size_t)j * oh + r];
                    if (!(fabs(got - ref) <= e->mm * mag + 1e-6))
                        fail_msg("%s: head_matmul [%d][%d][%d] = %.9g, ref %.9g", e->name, i, j, r,
                                 got, ref);
                }
        free(out);
        drop(e, dx), drop(e, dout); /* w: the backend's until it is destroyed */
    }
    free((void *)host.data), free(x);
}

/* A latent layer (one KV head, K-only pages; V = a row's first vd elements): rope_kv_append
 * stores [latent ; rope key turned, times mscale] and turns q's last rd elements; attention
 * over the rows the backend stored, against double references. */
static void test_latent_rows(void **state)
{
    (void)state;
    const int H = 5, lora = 48, rd = 16, hd = lora + rd, ps = 16;
    const struct seq_spec seqs[] = {{20, 20}, {150, 1}, {37, 3}};
    struct paged_step p;
    build_step(seqs, 3, ps, &p);
    const int T = p.st.n_tokens;
    const size_t kvn = (size_t)p.n_pages * ps * hd;
    float *pool = rand_vec(kvn, -1, 1); /* every row: earlier positions' rows stand in place */
    float inv[8];
    for (int i = 0; i < rd / 2; i++)
        inv[i] = (float)pow(10000.0, -2.0 * i / rd);
    const float ms = 0.8f;
    struct tdm_rope rope = {
        .head_dim = hd, .neox = false, .inv_freq = inv, .rot_dim = rd, .mscale = ms};
    const size_t nq = (size_t)T * H * hd;
    float *q = rand_vec(nq, -1, 1), *lat = rand_vec((size_t)T * lora, -1, 1);
    float *kr = rand_vec((size_t)T * rd, -1, 1);
    double *rq = malloc(nq * sizeof(double)), *rrow = malloc((size_t)T * hd * sizeof(double));
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++)
            for (int i = 0; i < hd; i++)
                rq[((size_t)t * H + h) * hd + i] = q[((size_t)t * H + h) * hd + i];
        for (int i = 0; i < lora; i++)
            rrow[(size_t)t * hd + i] = lat[(size_t)t * lora + i];
        for (int i = 0; i < rd / 2; i++) {
            const double ang = (double)((float)p.st.positions[t] * inv[i]);
            const double c = cos(ang) * ms, sn = sin(ang) * ms;
            for (int h = 0; h <= H; h++) { /* H: the rope key */
                const float *src =
                    h < H ? q + ((size_t)t * H + h) * hd + lora : kr + (size_t)t * rd;
                double *dst =
                    h < H ? rq + ((size_t)t * H + h) * hd + lora : rrow + (size_t)t * hd + lora;
                dst[2 * i] = src[2 * i] * c - src[2 * i + 1] * sn;
                dst[2 * i + 1] = src[2 * i] * sn + src[2 * i + 1] * c;
            }
        }
    }
    const float scale = 0.2f;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        float *dq = put(e, q, nq), *dl = put(e, lat, (size_t)T * lora);
        float *dr = put(e, kr, (size_t)T * rd), *dkv = put(e, pool, kvn);
        struct tdm_kv_layer kv = {.base = dkv,
                                  .n_kv_heads = 1,
                                  .head_dim = hd,
                                  .page_size = ps,
                                  .n_pages = p.n_pages,
                                  .v_dim = lora};
        e->b->iface->rope_kv_append(e->b, dq, dl, dr, H, &p.st, &rope, &kv);
        float *hq = get(e, dq, nq), *hkv = get(e, dkv, kvn);
        check_rel(e->name, "latent rope q", hq, rq, nq, e->elem, 1.0);
        for (int t = 0; t < T; t++)
            check_rel(e->name, "latent row", hkv + (size_t)p.st.slots[t] * hd,
                      rrow + (size_t)t * hd, (size_t)hd, e->elem, 1.0);
        /* attention over what was stored */
        float *dout = poisoned(e, (size_t)T * H * lora);
        e->b->iface->attention(e->b, dq, H, &p.st, &kv, scale, dout);
        float *out = get(e, dout, (size_t)T * H * lora);
        for (int t = 0; t < T; t++) {
            const int s = p.st.token_seq[t], n = p.st.positions[t] + 1;
            const int32_t *pages = p.st.page_ids + p.st.seq_page_start[s];
            for (int h = 0; h < H; h++) {
                const float *qh = hq + ((size_t)t * H + h) * hd;
                double *w = malloc((size_t)n * sizeof(double)), mx = -INFINITY, sum = 0;
                for (int j = 0; j < n; j++) {
                    const float *row = hkv + ((size_t)pages[j / ps] * ps + j % ps) * hd;
                    double d = 0;
                    for (int i = 0; i < hd; i++)
                        d += (double)qh[i] * row[i];
                    w[j] = d * scale;
                    mx = fmax(mx, w[j]);
                }
                for (int j = 0; j < n; j++)
                    sum += (w[j] = exp(w[j] - mx));
                double ref[64];
                for (int i = 0; i < lora; i++) {
                    ref[i] = 0;
                    for (int j = 0; j < n; j++)
                        ref[i] += w[j] * hkv[((size_t)pages[j / ps] * ps + j % ps) * hd + i];
                    ref[i] /= sum;
                }
                check_rel(e->name, "latent attention", out + ((size_t)t * H + h) * lora, ref,
                          (size_t)lora, e->att, 1.0);
                free(w);
            }
        }
        /* kv_copy moves K rows only: no V half to move */
        const int32_t src[] = {p.st.slots[0], p.st.slots[T - 1]}, dst[] = {p.st.slots[1], 3};
        e->b->iface->kv_copy(e->b, &kv, 1, kvn * sizeof(float), src, dst, 2);
        float *moved = get(e, dkv, kvn);
        for (int i = 0; i < 2; i++)
            assert_memory_equal(moved + (size_t)dst[i] * hd, hkv + (size_t)src[i] * hd,
                                (size_t)hd * sizeof(float));
        size_t changed = 0;
        for (size_t i = 0; i < kvn; i++)
            changed += moved[i] != hkv[i];
        assert_true(changed <= 2 * (size_t)hd);
        free(moved), free(out), free(hq), free(hkv);
        drop(e, dq), drop(e, dl), drop(e, dr), drop(e, dkv), drop(e, dout);
    }
    free(pool), free(q), free(lat), free(kr), free(rq), free(rrow), free(p.buf);
}

/* layer_done stores layer + 1 once the work before it is done: into the backend's own counter
 * (CUDA: mapped pinned memory) and into ordinary host memory */
static void test_layer_done(void **state)
{
    (void)state;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        static _Atomic int32_t mine;
        atomic_store(&mine, 0);
        e->b->iface->layer_done(e->b, 2, &mine);
        e->b->iface->sync(e->b);
        assert_int_equal(atomic_load(&mine), 3);
        if (e->cuda) {
            _Atomic int32_t *own = tdm_backend_cuda_counter(e->b);
            assert_non_null(own);
            e->b->iface->layer_done(e->b, 6, own);
            e->b->iface->sync(e->b);
            assert_int_equal(atomic_load(own), 7);
        }
    }
}

/* Typed buffers: each states the backend's place (the CPU: host; CUDA: device 0), copies
 * through them are bounds-checked, and a release empties them. */
static void test_typed_buffers(void **state)
{
    (void)state;
    for (int b = 0; b < n_bes; b++) {
        const struct be *e = &bes[b];
        struct tdm_buf buf;
        assert_int_equal(tdm_backend_buf_new(e->b, 1000, "a test", &buf), TDM_OK);
        assert_non_null(buf.ptr);
        assert_int_equal(buf.bytes, 1000);
        assert_int_equal(buf.place.kind, e->cuda ? TDM_MEM_DEVICE : TDM_MEM_HOST);
        uint8_t src[1000], dst[1000];
        for (int i = 0; i < 1000; i++)
            src[i] = (uint8_t)(i * 7);
        assert_int_equal(tdm_buf_upload(e->b, &buf, 0, src, 1000), TDM_OK);
        memset(dst, 0, sizeof dst);
        assert_int_equal(tdm_buf_download(e->b, dst + 10, &buf, 10, 990), TDM_OK);
        e->b->iface->sync(e->b);
        assert_memory_equal(dst + 10, src + 10, 990);
        assert_int_equal(tdm_buf_upload(e->b, &buf, 999, src, 2), TDM_ERANGE);
        assert_int_equal(tdm_buf_upload(e->b, &buf, SIZE_MAX, src, 2), TDM_ERANGE);
        assert_int_equal(tdm_buf_download(e->b, dst, &buf, 1, 1000), TDM_ERANGE);
        assert_int_equal(tdm_buf_download(e->b, dst, &buf, 1000, 0), TDM_OK);
        tdm_backend_buf_release(e->b, &buf);
        assert_null(buf.ptr);
        assert_int_equal(buf.bytes, 0);
        tdm_backend_buf_release(e->b, &buf); /* an empty one: a no-op */
        assert_int_equal(tdm_backend_buf_new(e->b, 0, "nothing", &buf), TDM_OK);
        assert_null(buf.ptr);
    }
}

int main(void)
{
    open_backends();
    printf("test_backend_ops over %d backends:", n_bes);
    for (int i = 0; i < n_bes; i++)
        printf(" [%s]", bes[i].name);
    printf("\n");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_fused),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_norms_elementwise),
        cmocka_unit_test(test_rope_kv_append),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_layer_done),
        cmocka_unit_test(test_typed_buffers),
        cmocka_unit_test(test_tree_attention),
        cmocka_unit_test(test_kv_copy),
        cmocka_unit_test(test_kv_dtypes),
        cmocka_unit_test(test_matmul_blocks),
        cmocka_unit_test(test_matmul_block_forms),
        cmocka_unit_test(test_head_matmul),
        cmocka_unit_test(test_latent_rows),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < n_bes; i++)
        tdm_backend_destroy(bes[i].b);
    return rc;
}
