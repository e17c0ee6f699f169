/*
 * CPU backend ops against naive scalar references written here (double accumulation), on every
 * ISA level this machine supports (portable, avx2, avx512 where present).
 *
 * References: quantised weights are random blocks dequantised with tdm_dequantize (model/
 * quant.c, itself checked against the gguf Python package), then multiplied in double. The
 * tolerances:
 *   matmul      |out - ref| <= 1e-5 * sum_c |w_c x_c| (+ 1e-6 * |bias|): fp32 accumulation of
 *               up to a few thousand products, relative to the magnitude of the terms, so that
 *               cancellation in the sum cannot fail a correct kernel;
 *   norms, rope, silu: 1e-6 relative to the magnitude of the values involved;
 *   attention   1e-5 absolute on outputs of O(1) (softmax weights sum to one, |v| <= 1).
 * Invariance checks are bit-exact (memcmp): a row of a batched matmul against the same row
 * alone, a sequence's attention alone against inside a mixed step, 1 vs 2 vs 3 threads.
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

/* ---- helpers ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_u64(void)
{
    return tdm_test_splitmix64(&rng_state);
}

/* uniform in [lo, hi) */
static float rng_f(float lo, float hi)
{
    return tdm_test_uniform(&rng_state, lo, hi);
}

static float *rand_vec(size_t n, float lo, float hi)
{
    return tdm_test_rand_vec(&rng_state, n, lo, hi);
}

static tdm_backend_t *make_backend(enum tdm_cpu_isa isa, int n_threads, bool batch_invariant)
{
    struct tdm_backend_cpu_opts o = {.n_threads = n_threads, .batch_invariant = batch_invariant};
    tdm_backend_t *b = NULL;
    assert_int_equal(tdm_backend_cpu_create_isa(&o, isa, &b), TDM_OK);
    assert_non_null(b);
    return b;
}

static const enum tdm_dtype DTYPES[] = {TDM_DTYPE_F32, TDM_DTYPE_BF16, TDM_DTYPE_Q8_0,
                                        TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1};

static void put_f16(uint8_t *p, float f)
{
    const uint16_t h = tdm_f32_to_f16(f);
    memcpy(p, &h, 2);
}

/* A random weight; data sits 4 bytes past an aligned address (GGUF data need not be aligned
 * to a vector). Free with free_weight. */
struct test_weight {
    struct tdm_weight w;
    uint8_t *alloc;
    float *deq; /* [rows][cols] reference values from tdm_dequantize */
};

static void make_weight(enum tdm_dtype dt, int64_t rows, int64_t cols, struct test_weight *tw)
{
    const size_t rb = tdm_dtype_row_bytes(dt, cols);
    assert_true(rb > 0);
    tw->alloc = malloc(rb * (size_t)rows + 64);
    assert_non_null(tw->alloc);
    uint8_t *data = tw->alloc + 4;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = data + (size_t)r * rb;
        switch (dt) {
        case TDM_DTYPE_F32:
            for (int64_t c = 0; c < cols; c++) {
                const float f = rng_f(-1, 1);
                memcpy(row + 4 * c, &f, 4);
            }
            break;
        case TDM_DTYPE_BF16:
            for (int64_t c = 0; c < cols; c++) {
                const uint16_t h = tdm_f32_to_bf16(rng_f(-1, 1));
                memcpy(row + 2 * c, &h, 2);
            }
            break;
        case TDM_DTYPE_Q8_0:
            for (int64_t b = 0; b < cols / 32; b++) {
                uint8_t *blk = row + b * sizeof(struct block_q8_0);
                put_f16(blk + offsetof(struct block_q8_0, d), rng_f(0.001f, 0.02f));
                for (int j = 0; j < 32; j++)
                    blk[offsetof(struct block_q8_0, qs) + j] = (uint8_t)(rng_u64() % 255 + 129);
            }
            break;
        case TDM_DTYPE_Q4_0:
            for (int64_t b = 0; b < cols / 32; b++) {
                uint8_t *blk = row + b * sizeof(struct block_q4_0);
                put_f16(blk + offsetof(struct block_q4_0, d), rng_f(-0.2f, 0.2f));
                for (int j = 0; j < 16; j++)
                    blk[offsetof(struct block_q4_0, qs) + j] = (uint8_t)rng_u64();
            }
            break;
        case TDM_DTYPE_Q4_1:
            for (int64_t b = 0; b < cols / 32; b++) {
                uint8_t *blk = row + b * sizeof(struct block_q4_1);
                put_f16(blk + offsetof(struct block_q4_1, d), rng_f(0.01f, 0.2f));
                put_f16(blk + offsetof(struct block_q4_1, m), rng_f(-1.5f, 0.1f));
                for (int j = 0; j < 16; j++)
                    blk[offsetof(struct block_q4_1, qs) + j] = (uint8_t)rng_u64();
            }
            break;
        default:
            fail();
        }
    }
    tw->w =
        (struct tdm_weight){.dtype = dt, .rows = rows, .cols = cols, .row_bytes = rb, .data = data};
    tw->deq = malloc((size_t)rows * (size_t)cols * sizeof(float));
    assert_non_null(tw->deq);
    for (int64_t r = 0; r < rows; r++)
        assert_int_equal(tdm_dequantize(dt, data + (size_t)r * rb, tw->deq + r * cols, cols),
                         TDM_OK);
}

static void free_weight(struct test_weight *tw)
{
    free(tw->alloc);
    free(tw->deq);
}

static int n_isas(void)
{
    return (int)tdm_cpu_isa_detect() + 1;
}

/* ---- matmul ---- */

static void check_matmul_ref(const struct test_weight *tw, const float *x, int n, const float *bias,
                             const float *out, const char *what)
{
    const int64_t rows = tw->w.rows, cols = tw->w.cols;
    for (int i = 0; i < n; i++) {
        for (int64_t r = 0; r < rows; r++) {
            double s = 0, mag = 0;
            for (int64_t c = 0; c < cols; c++) {
                const double p = (double)tw->deq[r * cols + c] * (double)x[i * cols + c];
                s += p;
                mag += fabs(p);
            }
            double tol = 1e-5 * mag + 1e-30;
            if (bias) {
                s += bias[r];
                tol += 1e-6 * fabs(bias[r]);
            }
            const double got = out[(size_t)i * rows + r];
            if (!(fabs(got - s) <= tol)) {
                print_error("%s: %s rows=%lld cols=%lld n=%d: out[%d][%lld] = %.9g, ref %.9g "
                            "(tol %.3g)\n",
                            what, tdm_dtype_name(tw->w.dtype), (long long)rows, (long long)cols, n,
                            i, (long long)r, got, s, tol);
                fail();
            }
        }
    }
}

struct mm_shape {
    int64_t rows, cols;
    int n;
    bool bias;
};

static void test_matmul_reference(void **state)
{
    const struct mm_shape shapes[] = {
        {1, 32, 1, false},    {7, 64, 3, true},    {37, 96, 17, false},  {130, 256, 5, true},
        {33, 1536, 2, false}, {50, 128, 70, true}, {576, 576, 1, false}, {19, 32, 4, false},
    };
    /* F32 and BF16 rows of any length: vector tails and scalar tails */
    const struct mm_shape plain_shapes[] = {
        {5, 9, 1, false}, {13, 45, 3, true}, {3, 100, 17, false},
        {17, 7, 2, true}, {9, 1, 1, false},
    };
    for (int isa = 0; isa < n_isas(); isa++) {
        for (int bi = 0; bi < 2; bi++) {
            tdm_backend_t *b = make_backend((enum tdm_cpu_isa)isa, 2, bi == 1);
            char what[64];
            snprintf(what, sizeof what, "%s%s", tdm_cpu_isa_name((enum tdm_cpu_isa)isa),
                     bi ? " batch_invariant" : "");
            for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
                const bool plain = DTYPES[d] == TDM_DTYPE_F32 || DTYPES[d] == TDM_DTYPE_BF16;
                const size_t n_shapes =
                    TDM_ARRAY_LEN(shapes) + (plain ? TDM_ARRAY_LEN(plain_shapes) : 0);
                for (size_t s = 0; s < n_shapes; s++) {
                    const struct mm_shape sh = s < TDM_ARRAY_LEN(shapes)
                                                   ? shapes[s]
                                                   : plain_shapes[s - TDM_ARRAY_LEN(shapes)];
                    struct test_weight tw;
                    make_weight(DTYPES[d], sh.rows, sh.cols, &tw);
                    float *x = rand_vec((size_t)sh.n * sh.cols, -1, 1);
                    float *bias = sh.bias ? rand_vec((size_t)sh.rows, -1, 1) : NULL;
                    float *out = malloc((size_t)sh.n * sh.rows * sizeof(float));
                    b->iface->matmul(b, &tw.w, x, sh.n, bias, out);
                    check_matmul_ref(&tw, x, sh.n, bias, out, what);
                    free(out);
                    free(bias);
                    free(x);
                    free_weight(&tw);
                }
            }
            tdm_backend_destroy(b);
        }
    }
}

/* Realistic widths: accumulated rounding over 1536-4096 products stays within bounds. */
static void test_matmul_wide(void **state)
{
    const struct mm_shape shapes[] = {{24, 4096, 1, false}, {16, 1536, 9, true}};
    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *b = make_backend((enum tdm_cpu_isa)isa, 2, true);
        for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
            for (size_t s = 0; s < TDM_ARRAY_LEN(shapes); s++) {
                const struct mm_shape sh = shapes[s];
                struct test_weight tw;
                make_weight(DTYPES[d], sh.rows, sh.cols, &tw);
                float *x = rand_vec((size_t)sh.n * sh.cols, -2, 2);
                float *bias = sh.bias ? rand_vec((size_t)sh.rows, -1, 1) : NULL;
                float *out = malloc((size_t)sh.n * sh.rows * sizeof(float));
                b->iface->matmul(b, &tw.w, x, sh.n, bias, out);
                check_matmul_ref(&tw, x, sh.n, bias, out, tdm_cpu_isa_name((enum tdm_cpu_isa)isa));
                free(out);
                free(bias);
                free(x);
                free_weight(&tw);
            }
        }
        tdm_backend_destroy(b);
    }
}

/* Bit-exact comparison of float arrays that names the case on failure. */
static void assert_same_bits(const float *a, const float *b, size_t n, const char *fmt, ...)
{
    if (memcmp(a, b, n * sizeof(float)) == 0) return;
    va_list ap;
    va_start(ap, fmt);
    char what[256];
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            print_error("%s: first difference at [%zu]: %.9g vs %.9g\n", what, i, a[i], b[i]);
            break;
        }
    }
    fail();
}

/* Row i of an n = 13 (and n = 70, past one prefill block) matmul is bit-identical to the n = 1
 * result and to the same row inside a sub-batch that starts elsewhere; 1, 2 and 3 threads
 * agree bit for bit. */
static void test_matmul_invariance(void **state)
{
    const int ns[] = {13, 70};
    const int64_t rows = 45, cols = 320; /* 45: not a multiple of any tile or split size */
    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *bk[3];
        for (int t = 0; t < 3; t++)
            bk[t] = make_backend((enum tdm_cpu_isa)isa, t + 1, true);
        for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
            struct test_weight tw;
            make_weight(DTYPES[d], rows, cols, &tw);
            for (size_t ni = 0; ni < TDM_ARRAY_LEN(ns); ni++) {
                const int n = ns[ni];
                float *x = rand_vec((size_t)n * cols, -1, 1);
                float *bias = rand_vec((size_t)rows, -1, 1);
                float *full = malloc((size_t)n * rows * sizeof(float));
                float *part = malloc((size_t)n * rows * sizeof(float));
                float *one = malloc((size_t)rows * sizeof(float));
                bk[1]->iface->matmul(bk[1], &tw.w, x, n, bias, full);
                for (int t = 0; t < 3; t += 2) {
                    bk[t]->iface->matmul(bk[t], &tw.w, x, n, bias, part);
                    assert_same_bits(full, part, (size_t)n * rows, "%s %s n=%d: %d vs 2 threads",
                                     tdm_cpu_isa_name((enum tdm_cpu_isa)isa),
                                     tdm_dtype_name(DTYPES[d]), n, t + 1);
                }
                for (int i = 0; i < n; i++) {
                    for (int t = 0; t < 3; t++) {
                        bk[t]->iface->matmul(bk[t], &tw.w, x + (size_t)i * cols, 1, bias, one);
                        assert_same_bits(one, full + (size_t)i * rows, (size_t)rows,
                                         "%s %s: row %d alone (%d threads) vs in n=%d",
                                         tdm_cpu_isa_name((enum tdm_cpu_isa)isa),
                                         tdm_dtype_name(DTYPES[d]), i, t + 1, n);
                    }
                }
                /* a sub-batch of 5 rows starting at row 3 */
                bk[1]->iface->matmul(bk[1], &tw.w, x + 3 * cols, 5, bias, part);
                assert_same_bits(part, full + 3 * rows, 5 * (size_t)rows, "%s %s: rows 3-7 vs n=%d",
                                 tdm_cpu_isa_name((enum tdm_cpu_isa)isa), tdm_dtype_name(DTYPES[d]),
                                 n);
                free(one);
                free(part);
                free(full);
                free(bias);
                free(x);
            }
            free_weight(&tw);
        }
        for (int t = 0; t < 3; t++)
            tdm_backend_destroy(bk[t]);
    }
}

/* matmul_multi and matmul_swiglu give, bit for bit, what the separate ops give (on
 * batch_invariant instances, where F32 takes our own kernel too), for every ISA, 1 to 3
 * threads, decode and prefill sizes (n = 70 crosses a prefill block), biased and unbiased
 * parts of different heights, and a gate/up pair of different dtypes; and on an instance
 * without batch_invariant the parts still match the float64 reference. */
static void test_matmul_fused(void **state)
{
    const int ns[] = {1, 5, 70};
    const int64_t cols = 96;                            /* 3 blocks: an odd count */
    const int64_t part_rows[3] = {45, 17, 33}, ff = 37; /* not multiples of tiles or splits */
    for (int isa = 0; isa < n_isas(); isa++) {
        const char *isa_name = tdm_cpu_isa_name((enum tdm_cpu_isa)isa);
        for (int t = 1; t <= 3; t++) {
            tdm_backend_t *b = make_backend((enum tdm_cpu_isa)isa, t, true);
            tdm_backend_t *fast = make_backend((enum tdm_cpu_isa)isa, t, false);
            for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
                struct test_weight tw[3], gate, up;
                for (int j = 0; j < 3; j++)
                    make_weight(DTYPES[(d + (size_t)j) % TDM_ARRAY_LEN(DTYPES)], part_rows[j], cols,
                                &tw[j]);
                make_weight(DTYPES[d], ff, cols, &gate);
                make_weight(DTYPES[(d + 2) % TDM_ARRAY_LEN(DTYPES)], ff, cols, &up);
                for (size_t ni = 0; ni < TDM_ARRAY_LEN(ns); ni++) {
                    const int n = ns[ni];
                    float *x = rand_vec((size_t)n * cols, -1, 1);
                    float *bias0 = rand_vec((size_t)part_rows[0], -1, 1);
                    float *bias2 = rand_vec((size_t)part_rows[2], -1, 1);
                    const float *bias[3] = {bias0, NULL, bias2};
                    float *fused[3], *alone[3];
                    struct tdm_matmul_part parts[3];
                    for (int j = 0; j < 3; j++) {
                        fused[j] = malloc((size_t)n * part_rows[j] * sizeof(float));
                        alone[j] = malloc((size_t)n * part_rows[j] * sizeof(float));
                        parts[j] = (struct tdm_matmul_part){&tw[j].w, bias[j], fused[j]};
                    }
                    b->iface->matmul_multi(b, x, n, parts, 3);
                    for (int j = 0; j < 3; j++) {
                        b->iface->matmul(b, &tw[j].w, x, n, bias[j], alone[j]);
                        assert_same_bits(fused[j], alone[j], (size_t)n * part_rows[j],
                                         "%s %d threads %s n=%d: matmul_multi part %d", isa_name, t,
                                         tdm_dtype_name(tw[j].w.dtype), n, j);
                    }
                    fast->iface->matmul_multi(fast, x, n, parts, 3);
                    for (int j = 0; j < 3; j++)
                        check_matmul_ref(&tw[j], x, n, bias[j], fused[j], "matmul_multi");

                    const size_t len = (size_t)n * ff;
                    float *sw = malloc(len * sizeof(float));
                    float *g = malloc(len * sizeof(float));
                    float *u = malloc(len * sizeof(float));
                    b->iface->matmul_swiglu(b, &gate.w, &up.w, x, n, sw);
                    b->iface->matmul(b, &gate.w, x, n, NULL, g);
                    b->iface->matmul(b, &up.w, x, n, NULL, u);
                    b->iface->silu_mul(b, g, u, n, (int)ff, g);
                    assert_same_bits(sw, g, len, "%s %d threads %s/%s n=%d: matmul_swiglu",
                                     isa_name, t, tdm_dtype_name(gate.w.dtype),
                                     tdm_dtype_name(up.w.dtype), n);
                    /* and against float64: silu(x Wgate) * (x Wup) from the dequantised
                     * weights (|silu'| < 1.1 bounds how the products' rounding propagates) */
                    for (int i = 0; i < n; i++) {
                        for (int64_t r = 0; r < ff; r++) {
                            double gs = 0, gm = 0, us = 0, um = 0;
                            for (int64_t c = 0; c < cols; c++) {
                                const double xv = x[(size_t)i * cols + c];
                                gs += gate.deq[r * cols + c] * xv;
                                gm += fabs(gate.deq[r * cols + c] * xv);
                                us += up.deq[r * cols + c] * xv;
                                um += fabs(up.deq[r * cols + c] * xv);
                            }
                            const double silu = gs / (1.0 + exp(-gs));
                            const double ref = silu * us;
                            const double tol =
                                1e-5 * (1.1 * gm * fabs(us) + fabs(silu) * um) + 1e-6 * fabs(ref);
                            const double got = sw[(size_t)i * ff + r];
                            if (!(fabs(got - ref) <= tol)) {
                                print_error("matmul_swiglu %s n=%d [%d][%lld]: %.9g, ref %.9g\n",
                                            isa_name, n, i, (long long)r, got, ref);
                                fail();
                            }
                        }
                    }
                    free(u);
                    free(g);
                    free(sw);
                    for (int j = 0; j < 3; j++) {
                        free(fused[j]);
                        free(alone[j]);
                    }
                    free(bias2);
                    free(bias0);
                    free(x);
                }
                for (int j = 0; j < 3; j++)
                    free_weight(&tw[j]);
                free_weight(&gate);
                free_weight(&up);
            }
            tdm_backend_destroy(fast);
            tdm_backend_destroy(b);
        }
    }
}

/* ---- embed ---- */

static void test_embed(void **state)
{
    tdm_backend_t *b = make_backend(tdm_cpu_isa_detect(), 2, false);
    const int64_t cols[] = {64, 576};
    const int32_t tokens[] = {3, 0, 99, 3, 57};
    const int n = (int)TDM_ARRAY_LEN(tokens);
    for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
        for (size_t c = 0; c < TDM_ARRAY_LEN(cols); c++) {
            struct test_weight tw;
            make_weight(DTYPES[d], 100, cols[c], &tw);
            float *out = malloc((size_t)n * cols[c] * sizeof(float));
            b->iface->embed(b, &tw.w, tokens, n, out);
            for (int i = 0; i < n; i++)
                assert_memory_equal(out + i * cols[c], tw.deq + tokens[i] * cols[c],
                                    cols[c] * sizeof(float));
            free(out);
            free_weight(&tw);
        }
    }
    tdm_backend_destroy(b);
}

/* ---- norms ---- */

static void ref_rmsnorm_row(const float *x, const float *w, float eps, int dim, double *out)
{
    double ss = 0;
    for (int j = 0; j < dim; j++)
        ss += (double)x[j] * x[j];
    const double inv = 1.0 / sqrt(ss / dim + eps);
    for (int j = 0; j < dim; j++)
        out[j] = x[j] * inv * w[j];
}

/* |got - ref| <= rel * (|ref| + floor): floor is the magnitude of the inputs where a result
 * may cancel (a rotation of unit-sized values), 1e-3 for the rest. */
static void check_close_floor(const float *got, const double *ref, size_t n, double rel,
                              double floor, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (!(fabs(got[i] - ref[i]) <= rel * (fabs(ref[i]) + floor))) {
            print_error("%s: [%zu] = %.9g, ref %.9g\n", what, i, got[i], ref[i]);
            fail();
        }
    }
}

static void check_close(const float *got, const double *ref, size_t n, double rel, const char *what)
{
    check_close_floor(got, ref, n, rel, 1e-3, what);
}

static void test_norms(void **state)
{
    const int dims[] = {1, 7, 64, 576, 1001};
    const int ns[] = {1, 3, 17};
    const float eps = 1e-5f;
    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *b = make_backend((enum tdm_cpu_isa)isa, 2, false);
        tdm_backend_t *b1 = make_backend((enum tdm_cpu_isa)isa, 1, false);
        for (size_t di = 0; di < TDM_ARRAY_LEN(dims); di++) {
            for (size_t ni = 0; ni < TDM_ARRAY_LEN(ns); ni++) {
                const int dim = dims[di], n = ns[ni];
                const size_t len = (size_t)n * dim;
                float *x = rand_vec(len, -3, 3);
                float *y = rand_vec(len, -1, 1);
                float *w = rand_vec((size_t)dim, 0.5f, 1.5f);
                float *out = malloc(len * sizeof(float));
                float *out1 = malloc(len * sizeof(float));
                float *res = malloc(len * sizeof(float));
                double *ref = malloc(len * sizeof(double));
                float *xsum = malloc(len * sizeof(float));

                b->iface->rmsnorm(b, x, w, eps, n, dim, out);
                for (int i = 0; i < n; i++)
                    ref_rmsnorm_row(x + i * dim, w, eps, dim, ref + (size_t)i * dim);
                check_close(out, ref, len, 1e-6, "rmsnorm");
                b1->iface->rmsnorm(b1, x, w, eps, n, dim, out1);
                assert_memory_equal(out, out1, len * sizeof(float));

                /* add_rmsnorm: residual += y, then the norm of the new residual */
                memcpy(res, x, len * sizeof(float));
                b->iface->add_rmsnorm(b, res, y, w, eps, n, dim, out);
                for (size_t i = 0; i < len; i++)
                    xsum[i] = x[i] + y[i];
                assert_memory_equal(res, xsum, len * sizeof(float));
                for (int i = 0; i < n; i++)
                    ref_rmsnorm_row(xsum + i * dim, w, eps, dim, ref + (size_t)i * dim);
                check_close(out, ref, len, 1e-6, "add_rmsnorm");

                /* head_rmsnorm: n rows of dim, in place */
                memcpy(out, x, len * sizeof(float));
                b->iface->head_rmsnorm(b, out, w, eps, n, dim);
                for (int i = 0; i < n; i++)
                    ref_rmsnorm_row(x + i * dim, w, eps, dim, ref + (size_t)i * dim);
                check_close(out, ref, len, 1e-6, "head_rmsnorm");

                free(xsum);
                free(ref);
                free(res);
                free(out1);
                free(out);
                free(w);
                free(y);
                free(x);
            }
        }
        tdm_backend_destroy(b1);
        tdm_backend_destroy(b);
    }
}

/* ---- element-wise and row ops ---- */

static void test_elementwise(void **state)
{
    tdm_backend_t *b = make_backend(tdm_cpu_isa_detect(), 3, false);
    const int n = 17, dim = 1537;
    const size_t len = (size_t)n * dim;
    float *g = rand_vec(len, -12, 12);
    float *u = rand_vec(len, -2, 2);
    float *out = malloc(len * sizeof(float));
    double *ref = malloc(len * sizeof(double));
    g[0] = -100.0f; /* expf(100) overflows: silu must give -0, not NaN */
    b->iface->silu_mul(b, g, u, n, dim, out);
    for (size_t i = 0; i < len; i++)
        ref[i] = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
    check_close(out, ref, len, 1e-6, "silu_mul");
    assert_false(isnan(out[0]));

    float *x = rand_vec(len, -1, 1);
    float *x0 = malloc(len * sizeof(float));
    memcpy(x0, x, len * sizeof(float));
    b->iface->add(b, x, u, len);
    for (size_t i = 0; i < len; i++)
        assert_true(x[i] == x0[i] + u[i]);

    const int32_t rows[] = {16, 0, 5, 5};
    b->iface->gather_rows(b, x0, rows, 4, dim, out);
    for (int i = 0; i < 4; i++)
        assert_memory_equal(out + (size_t)i * dim, x0 + (size_t)rows[i] * dim, dim * sizeof(float));

    free(x0);
    free(x);
    free(ref);
    free(out);
    free(u);
    free(g);
    tdm_backend_destroy(b);
}

/* ---- paged KV fixtures ---- */

/* A step over several sequences. Sequence s has `len` positions of KV in total, of which the
 * last `n_new` are this step's tokens. Its pages are random distinct ids of the pool. */
struct seq_spec {
    int len, n_new;
};

struct paged_step {
    struct tdm_step st;
    int32_t *tokens, *positions, *slots, *token_seq, *seq_token_start, *seq_kv_len, *seq_page_start,
        *page_ids;
};

static void build_step(const struct seq_spec *seqs, int n_seqs, int page_size, int64_t n_pages,
                       struct paged_step *ps)
{
    int n_tokens = 0, total_pages = 0;
    for (int s = 0; s < n_seqs; s++) {
        n_tokens += seqs[s].n_new;
        total_pages += (seqs[s].len + page_size - 1) / page_size;
    }
    assert_true(total_pages <= n_pages);
    ps->tokens = calloc((size_t)n_tokens + 1, sizeof(int32_t));
    ps->positions = calloc((size_t)n_tokens + 1, sizeof(int32_t));
    ps->slots = calloc((size_t)n_tokens + 1, sizeof(int32_t));
    ps->token_seq = calloc((size_t)n_tokens + 1, sizeof(int32_t));
    ps->seq_token_start = calloc((size_t)n_seqs + 1, sizeof(int32_t));
    ps->seq_kv_len = calloc((size_t)n_seqs + 1, sizeof(int32_t));
    ps->seq_page_start = calloc((size_t)n_seqs + 1, sizeof(int32_t));
    ps->page_ids = calloc((size_t)total_pages + 1, sizeof(int32_t));
    /* a random permutation of the pool's pages, handed out in order */
    int32_t *perm = malloc((size_t)n_pages * sizeof(int32_t));
    for (int64_t i = 0; i < n_pages; i++)
        perm[i] = (int32_t)i;
    for (int64_t i = n_pages - 1; i > 0; i--) {
        const int64_t j = (int64_t)(rng_u64() % (uint64_t)(i + 1));
        const int32_t tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    int t = 0, p = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int np = (seqs[s].len + page_size - 1) / page_size;
        ps->seq_page_start[s] = p;
        for (int j = 0; j < np; j++)
            ps->page_ids[p + j] = perm[p + j];
        ps->seq_token_start[s] = t;
        ps->seq_kv_len[s] = seqs[s].len;
        for (int k = 0; k < seqs[s].n_new; k++, t++) {
            const int pos = seqs[s].len - seqs[s].n_new + k;
            ps->positions[t] = pos;
            ps->token_seq[t] = s;
            ps->slots[t] = ps->page_ids[p + pos / page_size] * page_size + pos % page_size;
        }
        p += np;
    }
    ps->seq_token_start[n_seqs] = t;
    ps->seq_page_start[n_seqs] = p;
    free(perm);
    ps->st = (struct tdm_step){
        .n_tokens = n_tokens,
        .n_seqs = n_seqs,
        .tokens = ps->tokens,
        .positions = ps->positions,
        .slots = ps->slots,
        .token_seq = ps->token_seq,
        .seq_token_start = ps->seq_token_start,
        .seq_kv_len = ps->seq_kv_len,
        .seq_page_start = ps->seq_page_start,
        .page_ids = ps->page_ids,
        .page_size = page_size,
    };
}

static void free_step(struct paged_step *ps)
{
    free(ps->tokens);
    free(ps->positions);
    free(ps->slots);
    free(ps->token_seq);
    free(ps->seq_token_start);
    free(ps->seq_kv_len);
    free(ps->seq_page_start);
    free(ps->page_ids);
}

/* Address of K (kv = 0) or V (kv = 1) of KV head g at position pos of sequence s. */
static float *kv_at(const struct tdm_kv_layer *kv, const struct tdm_step *st, int s, int pos,
                    int which, int g)
{
    const int32_t page = st->page_ids[st->seq_page_start[s] + pos / kv->page_size];
    return kv->base + ((((size_t)page * 2 + which) * kv->n_kv_heads + g) * kv->page_size +
                       pos % kv->page_size) *
                          kv->head_dim;
}

/* ---- rope_kv_append ---- */

static void test_rope_kv_append(void **state)
{
    const int n_heads = 6, nkv = 2, page_size = 5;
    const int64_t n_pages = 40;
    const int hds[] = {8, 18, 64};
    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *b = make_backend((enum tdm_cpu_isa)isa, 2, false);
        for (size_t hi = 0; hi < TDM_ARRAY_LEN(hds); hi++) {
            for (int neox = 0; neox < 2; neox++) {
                const int hd = hds[hi];
                const struct seq_spec seqs[] = {{12, 12}, {33, 2}};
                struct paged_step ps;
                build_step(seqs, 2, page_size, n_pages, &ps);
                const int n_tok = ps.st.n_tokens;
                const size_t kv_floats = (size_t)n_pages * 2 * nkv * page_size * hd;
                float *base = malloc(kv_floats * sizeof(float));
                for (size_t i = 0; i < kv_floats; i++)
                    base[i] = 12345.0f;
                struct tdm_kv_layer kv = {.base = base,
                                          .n_kv_heads = nkv,
                                          .head_dim = hd,
                                          .page_size = page_size,
                                          .n_pages = n_pages};
                float *inv = malloc((size_t)hd / 2 * sizeof(float));
                for (int i = 0; i < hd / 2; i++)
                    inv[i] = (float)pow(10000.0, -2.0 * i / hd);
                struct tdm_rope rope = {.head_dim = hd, .neox = neox, .inv_freq = inv};
                /* a large position exercises the fp32 angle contract (rope reads positions for
                 * angles only; the slot says where k and v go) */
                ps.positions[n_tok - 1] = 9000 + 12;
                float *q = rand_vec((size_t)n_tok * n_heads * hd, -1, 1);
                float *k = rand_vec((size_t)n_tok * nkv * hd, -1, 1);
                float *v = rand_vec((size_t)n_tok * nkv * hd, -1, 1);
                float *q0 = malloc((size_t)n_tok * n_heads * hd * sizeof(float));
                memcpy(q0, q, (size_t)n_tok * n_heads * hd * sizeof(float));
                b->iface->rope_kv_append(b, q, k, v, n_heads, &ps.st, &rope, &kv);

                double *ref = malloc((size_t)hd * sizeof(double));
                for (int t = 0; t < n_tok; t++) {
                    const float pos = (float)ps.positions[t];
                    for (int h = 0; h < n_heads + nkv; h++) {
                        const float *src = h < n_heads ? q0 + ((size_t)t * n_heads + h) * hd
                                                       : k + ((size_t)t * nkv + h - n_heads) * hd;
                        for (int i = 0; i < hd / 2; i++) {
                            const int a = neox ? i : 2 * i, c = neox ? i + hd / 2 : 2 * i + 1;
                            const double ang = (double)(pos * inv[i]); /* fp32 product */
                            ref[a] = src[a] * cos(ang) - src[c] * sin(ang);
                            ref[c] = src[a] * sin(ang) + src[c] * cos(ang);
                        }
                        const float *got;
                        if (h < n_heads) {
                            got = q + ((size_t)t * n_heads + h) * hd;
                        } else {
                            const int slot = ps.slots[t];
                            got = base + ((((size_t)slot / page_size) * 2 * nkv + (h - n_heads)) *
                                              page_size +
                                          slot % page_size) *
                                             hd;
                        }
                        check_close_floor(got, ref, (size_t)hd, 1e-6, 1.0,
                                          neox ? "rope neox" : "rope");
                    }
                    for (int g = 0; g < nkv; g++) {
                        const int slot = ps.slots[t];
                        const float *got =
                            base + ((((size_t)slot / page_size) * 2 * nkv + nkv + g) * page_size +
                                    slot % page_size) *
                                       hd;
                        assert_memory_equal(got, v + ((size_t)t * nkv + g) * hd,
                                            hd * sizeof(float));
                    }
                }
                /* nothing else was written (written values are in [-2, 2]) */
                size_t touched = 0;
                for (size_t i = 0; i < kv_floats; i++)
                    touched += base[i] != 12345.0f;
                assert_int_equal(touched, (size_t)n_tok * 2 * nkv * hd);

                free(ref);
                free(q0);
                free(v);
                free(k);
                free(q);
                free(inv);
                free(base);
                free_step(&ps);
            }
        }
        tdm_backend_destroy(b);
    }
}

/* ---- attention ---- */

/* Dense reference for token t: softmax over positions 0..p in double. */
static void ref_attention(const float *q, int n_heads, const struct tdm_step *st,
                          const struct tdm_kv_layer *kv, float scale, int t, double *out)
{
    const int hd = kv->head_dim, group = n_heads / kv->n_kv_heads;
    const int s = st->token_seq[t], n_pos = st->positions[t] + 1;
    double *w = malloc((size_t)n_pos * sizeof(double));
    for (int h = 0; h < n_heads; h++) {
        const int g = h / group;
        const float *qh = q + ((size_t)t * n_heads + h) * hd;
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < n_pos; j++) {
            const float *kr = kv_at(kv, st, s, j, 0, g);
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
            for (int j = 0; j < n_pos; j++)
                o += w[j] * kv_at(kv, st, s, j, 1, g)[i];
            out[(size_t)h * hd + i] = o / sum;
        }
    }
    free(w);
}

static void fill_kv(const struct tdm_kv_layer *kv, const struct tdm_step *st,
                    const struct seq_spec *seqs, int n_seqs)
{
    for (int s = 0; s < n_seqs; s++)
        for (int pos = 0; pos < seqs[s].len; pos++)
            for (int which = 0; which < 2; which++)
                for (int g = 0; g < kv->n_kv_heads; g++) {
                    float *p = kv_at(kv, st, s, pos, which, g);
                    for (int i = 0; i < kv->head_dim; i++)
                        p[i] = rng_f(-1, 1);
                }
}

static void run_attention_case(int n_heads, int nkv, int hd, int page_size)
{
    /* a prefill chunk, decodes (past several softmax chunks; past several 128-position
     * segments, which alone in a step are spread over the threads and merged, while inside
     * this step they are computed whole), and short chunks in the middle of sequences, one of
     * them straddling a segment boundary */
    const struct seq_spec seqs[] = {{10, 10}, {97, 1}, {23, 3}, {2, 1}, {600, 1}, {258, 3}};
    const int n_seqs = (int)TDM_ARRAY_LEN(seqs);
    int64_t n_pages = 16;
    for (int s = 0; s < n_seqs; s++)
        n_pages += (seqs[s].len + page_size - 1) / page_size;
    const float scale = 1.0f / sqrtf((float)hd);
    struct paged_step ps;
    build_step(seqs, n_seqs, page_size, n_pages, &ps);
    const size_t kv_floats = (size_t)n_pages * 2 * nkv * page_size * hd;
    float *base = malloc(kv_floats * sizeof(float));
    for (size_t i = 0; i < kv_floats; i++)
        base[i] = NAN; /* unused slots must never be read */
    struct tdm_kv_layer kv = {.base = base,
                              .n_kv_heads = nkv,
                              .head_dim = hd,
                              .page_size = page_size,
                              .n_pages = n_pages};
    fill_kv(&kv, &ps.st, seqs, n_seqs);
    const int n_tok = ps.st.n_tokens;
    const size_t qlen = (size_t)n_tok * n_heads * hd;
    /* larger |q| makes the softmax peaky, exercising the running-max rescaling */
    float *q = rand_vec(qlen, -4, 4);
    float *out = malloc(qlen * sizeof(float));
    float *out2 = malloc(qlen * sizeof(float));
    double *ref = malloc((size_t)n_heads * hd * sizeof(double));

    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *bk[3];
        for (int t = 0; t < 3; t++)
            bk[t] = make_backend((enum tdm_cpu_isa)isa, t + 1, false);
        bk[1]->iface->attention(bk[1], q, n_heads, &ps.st, &kv, scale, out);
        for (int t = 0; t < n_tok; t++) {
            ref_attention(q, n_heads, &ps.st, &kv, scale, t, ref);
            for (int i = 0; i < n_heads * hd; i++) {
                const float got = out[(size_t)t * n_heads * hd + i];
                if (!(fabs(got - ref[i]) <= 1e-5)) {
                    print_error("attention h=%d kv=%d hd=%d ps=%d: token %d [%d] = %.9g, ref "
                                "%.9g\n",
                                n_heads, nkv, hd, page_size, t, i, got, ref[i]);
                    fail();
                }
            }
        }
        for (int t = 0; t < 3; t += 2) {
            bk[t]->iface->attention(bk[t], q, n_heads, &ps.st, &kv, scale, out2);
            assert_memory_equal(out, out2, qlen * sizeof(float));
        }
        /* each sequence alone in its own step gives the same bits */
        for (int s = 0; s < n_seqs; s++) {
            const int t0 = ps.seq_token_start[s], nt = ps.seq_token_start[s + 1] - t0;
            int32_t pstart[2] = {0, ps.seq_page_start[s + 1] - ps.seq_page_start[s]};
            int32_t tstart[2] = {0, nt};
            int32_t *tseq = calloc((size_t)nt, sizeof(int32_t));
            struct tdm_step one = {
                .n_tokens = nt,
                .n_seqs = 1,
                .tokens = ps.tokens + t0,
                .positions = ps.positions + t0,
                .slots = ps.slots + t0,
                .token_seq = tseq,
                .seq_token_start = tstart,
                .seq_kv_len = ps.seq_kv_len + s,
                .seq_page_start = pstart,
                .page_ids = ps.page_ids + ps.seq_page_start[s],
                .page_size = page_size,
            };
            for (int t = 0; t < 3; t++) {
                bk[t]->iface->attention(bk[t], q + (size_t)t0 * n_heads * hd, n_heads, &one, &kv,
                                        scale, out2);
                assert_memory_equal(out2, out + (size_t)t0 * n_heads * hd,
                                    (size_t)nt * n_heads * hd * sizeof(float));
            }
            free(tseq);
        }
        for (int t = 0; t < 3; t++)
            tdm_backend_destroy(bk[t]);
    }
    free(ref);
    free(out2);
    free(out);
    free(q);
    free(base);
    free_step(&ps);
}

static void test_attention_paged(void **state)
{
    run_attention_case(6, 2, 16, 16); /* GQA 3:1 */
    run_attention_case(4, 4, 20, 5);  /* MHA, head_dim not a multiple of 8, odd page size */
    run_attention_case(18, 1, 8, 7);  /* one KV head shared by more than GROUP_MAX heads */
    run_attention_case(2, 1, 64, 1);  /* one position per page */
}

/* ---- interface plumbing ---- */

static void test_misc(void **state)
{
    tdm_backend_t *b = NULL;
    struct tdm_backend_cpu_opts o = {.n_threads = 2};
    assert_int_equal(tdm_backend_cpu_create(&o, &b), TDM_OK);
    assert_string_equal(b->iface->name, "cpu");

    _Atomic int32_t counter = 0;
    b->iface->layer_done(b, 4, &counter);
    assert_int_equal(atomic_load(&counter), 5);
    b->iface->sync(b);

    float *buf = b->iface->buf_alloc(b, 1000);
    assert_non_null(buf);
    assert_int_equal((uintptr_t)buf % 64, 0);
    float src[250], dst[250];
    for (int i = 0; i < 250; i++)
        src[i] = (float)i;
    b->iface->upload(b, buf, src, sizeof src);
    b->iface->download(b, dst, buf, sizeof dst);
    assert_memory_equal(src, dst, sizeof src);
    b->iface->buf_free(b, buf);
    b->iface->buf_free(b, NULL);

    struct test_weight tw;
    make_weight(TDM_DTYPE_Q4_1, 4, 64, &tw);
    struct tdm_weight prepared;
    assert_int_equal(b->iface->weight_prepare(b, &tw.w, &prepared), TDM_OK);
    assert_ptr_equal(prepared.data, tw.w.data);
    struct tdm_weight bad = tw.w;
    bad.row_bytes += 1;
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EINVAL);
    bad = tw.w;
    bad.dtype = TDM_DTYPE_Q6_K;
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EUNSUPPORTED);
    bad = tw.w;
    bad.cols = 48; /* not a whole number of blocks */
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EINVAL);
    const struct tdm_weight absent = {.dtype = TDM_DTYPE_F32};
    assert_int_equal(b->iface->weight_prepare(b, &absent, &prepared), TDM_OK);
    assert_null(prepared.data);
    free_weight(&tw);

    tdm_backend_destroy(b);
    tdm_backend_destroy(NULL);
}

static void test_isa_selection(void **state)
{
    const char *best = tdm_cpu_isa_name(tdm_cpu_isa_detect());
    unsetenv("TANDEM_CPU_ISA");
    assert_string_equal(tdm_backend_cpu_isa(), best);
    setenv("TANDEM_CPU_ISA", "portable", 1);
    assert_string_equal(tdm_backend_cpu_isa(), "portable");
    tdm_backend_t *b = NULL;
    assert_int_equal(tdm_backend_cpu_create(NULL, &b), TDM_OK);
    assert_int_equal(tdm_cpu_of(b)->k->isa, TDM_CPU_ISA_PORTABLE);
    tdm_backend_destroy(b);
    setenv("TANDEM_CPU_ISA", "avx512", 1); /* capped at what the CPU has */
    const char *want = tdm_cpu_isa_detect() >= TDM_CPU_ISA_AVX512 ? "avx512" : best;
    assert_string_equal(tdm_backend_cpu_isa(), want);
    setenv("TANDEM_CPU_ISA", "nonsense", 1);
    assert_string_equal(tdm_backend_cpu_isa(), best);
    unsetenv("TANDEM_CPU_ISA");
    if (tdm_cpu_isa_detect() < TDM_CPU_ISA_AVX512) {
        struct tdm_backend_cpu_opts o = {.n_threads = 1};
        assert_int_equal(tdm_backend_cpu_create_isa(&o, TDM_CPU_ISA_AVX512, &b), TDM_EUNSUPPORTED);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_reference),
        cmocka_unit_test(test_matmul_wide),
        cmocka_unit_test(test_matmul_invariance),
        cmocka_unit_test(test_matmul_fused),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_norms),
        cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_rope_kv_append),
        cmocka_unit_test(test_attention_paged),
        cmocka_unit_test(test_misc),
        cmocka_unit_test(test_isa_selection),
    };
    fprintf(stderr, "cpu backend: best ISA here is %s\n", tdm_cpu_isa_name(tdm_cpu_isa_detect()));
    if (getenv("TDM_TEST_FILTER")) cmocka_set_test_filter(getenv("TDM_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
