/*
 * What is the CPU backend's own, on every ISA level this machine supports (portable, avx2,
 * avx512 where present): its invariance contracts, checked bit for bit (memcmp) - a row of a
 * batched matmul against the same row alone, matmul_multi and matmul_swiglu against the plain
 * ops at 1, 2 and 3 threads, a sequence's attention alone against inside a mixed step and across
 * thread counts - and its plumbing (buffers, weight checks, ISA selection). The values of every
 * op against references are tests/backend/test_backend_ops.c, which runs over every backend.
 * The fused ops are also checked against the double reference here (tolerance 1e-5 of the
 * magnitude of the terms), since the non-invariant instance takes other kernels.
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

static int n_isas(void)
{
    return (int)tdm_cpu_isa_detect() + 1;
}

/* The kernel variants this machine runs: each ISA level, its VNNI variant where present, and
 * the avx512+vnni level with the AMX tiles where the CPU and OS run them. */
struct variant {
    enum tdm_cpu_isa isa;
    bool vnni;
    bool amx;
    char name[32];
};
#define VARIANTS_MAX (2 * TDM_CPU_ISA_COUNT + 1)
static bool amx_skip_reported;
static int variants(struct variant v[VARIANTS_MAX])
{
    int n = 0;
    for (int isa = 0; isa < n_isas(); isa++)
        for (int vnni = 0; vnni <= (int)tdm_cpu_isa_vnni((enum tdm_cpu_isa)isa); vnni++) {
            v[n] = (struct variant){.isa = (enum tdm_cpu_isa)isa, .vnni = vnni};
            snprintf(v[n].name, sizeof v[n].name, "%s%s", tdm_cpu_isa_name((enum tdm_cpu_isa)isa),
                     vnni ? "+vnni" : "");
            n++;
        }
    if (tdm_cpu_amx_available() && tdm_cpu_isa_vnni(TDM_CPU_ISA_AVX512)) {
        v[n] = (struct variant){.isa = TDM_CPU_ISA_AVX512, .vnni = true, .amx = true};
        snprintf(v[n].name, sizeof v[n].name, "avx512+vnni+amx");
        n++;
    } else if (!amx_skip_reported) {
        printf("SKIP: the AMX int8 tiles: not available on this machine (CPU or OS)\n");
        amx_skip_reported = true;
    }
    return n;
}

/* A backend of one variant on quantised activations. */
static tdm_backend_t *make_qbackend(const struct variant *v, int n_threads)
{
    struct tdm_backend_cpu_opts o = {
        .n_threads = n_threads, .batch_invariant = true, .quant_activations = true};
    tdm_backend_t *b = NULL;
    assert_int_equal(tdm_backend_cpu_create_variant(&o, v->isa, v->vnni, &b), TDM_OK);
    assert_int_equal(tdm_cpu_amx_set(b, v->amx), TDM_OK);
    return b;
}

/* ---- matmul ---- */

static void check_matmul_ref(const struct tdm_test_weight *tw, const float *x, int n,
                             const float *bias, const float *out, const char *what)
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
 * agree bit for bit. On fp32 activations at every ISA level, and on quantised ones in every
 * kernel variant (VNNI included). */
static void test_matmul_invariance(void **state)
{
    const int ns[] = {13, 70};
    const int64_t rows = 45, cols = 320; /* 45: not a multiple of any tile or split size */
    struct variant vs[VARIANTS_MAX];
    const int n_vs = variants(vs);
    /* each ISA on fp32 activations, then each variant on quantised ones */
    for (int iv = 0; iv < n_isas() + n_vs; iv++) {
        const bool quant = iv >= n_isas();
        const enum tdm_cpu_isa isa = quant ? vs[iv - n_isas()].isa : (enum tdm_cpu_isa)iv;
        tdm_backend_t *bk[3];
        for (int t = 0; t < 3; t++)
            bk[t] =
                quant ? make_qbackend(&vs[iv - n_isas()], t + 1) : make_backend(isa, t + 1, true);
        for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
            struct tdm_test_weight tw;
            tdm_test_weight_make(&rng_state, DTYPES[d], rows, cols, &tw);
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
            tdm_test_weight_free(&tw);
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
    struct variant vs[VARIANTS_MAX];
    const int n_vs = variants(vs);
    /* each ISA on fp32 activations, then each variant on quantised ones (the float64 checks
     * are for fp32 activations: test_qdot bounds the quantised ones' error) */
    for (int iv = 0; iv < n_isas() + n_vs; iv++) {
        const bool quant = iv >= n_isas();
        const enum tdm_cpu_isa isa = quant ? vs[iv - n_isas()].isa : (enum tdm_cpu_isa)iv;
        const char *isa_name = quant ? vs[iv - n_isas()].name : tdm_cpu_isa_name(isa);
        for (int t = 1; t <= 3; t++) {
            tdm_backend_t *b = quant ? make_qbackend(&vs[iv - n_isas()], t)
                                     : make_backend((enum tdm_cpu_isa)isa, t, true);
            tdm_backend_t *fast = make_backend((enum tdm_cpu_isa)isa, t, false);
            for (size_t d = 0; d < TDM_ARRAY_LEN(DTYPES); d++) {
                struct tdm_test_weight tw[3], gate, up;
                for (int j = 0; j < 3; j++)
                    tdm_test_weight_make(&rng_state,
                                         DTYPES[(d + (size_t)j) % TDM_ARRAY_LEN(DTYPES)],
                                         part_rows[j], cols, &tw[j]);
                tdm_test_weight_make(&rng_state, DTYPES[d], ff, cols, &gate);
                tdm_test_weight_make(&rng_state, DTYPES[(d + 2) % TDM_ARRAY_LEN(DTYPES)], ff, cols,
                                     &up);
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
                    for (int i = 0; i < n && !quant; i++) {
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
                    tdm_test_weight_free(&tw[j]);
                tdm_test_weight_free(&gate);
                tdm_test_weight_free(&up);
            }
            tdm_backend_destroy(fast);
            tdm_backend_destroy(b);
        }
    }
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

/* ---- attention ---- */

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

    for (int isa = 0; isa < n_isas(); isa++) {
        tdm_backend_t *bk[3];
        for (int t = 0; t < 3; t++)
            bk[t] = make_backend((enum tdm_cpu_isa)isa, t + 1, false);
        /* the values against a reference: tests/backend/test_backend_ops.c; here the bits */
        bk[1]->iface->attention(bk[1], q, n_heads, &ps.st, &kv, scale, out);
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
    run_attention_case(8, 1, 96, 16); /* the AVX2 step's 64-column block, then 8-column ones */
}

/* ---- MLA: latent pages, partial rope, per-head products ---- */

/* A latent layer (one KV head, K rows only, V = each row's first vd elements): rope_kv_append
 * stores [latent ; rotated rope key] and rotates only q's last rd dimensions; attention reads
 * the rows as keys and their prefixes as values. Both against a double-precision reference
 * written here, and each ISA's bits the same whatever the thread count. */
static void test_latent_attention(void **state)
{
    (void)state;
    const int H = 5, lora = 24, rd = 8, hd = lora + rd, ps = 4;
    const struct seq_spec seqs[] = {{9, 9}, {150, 1}, {40, 2}};
    const int n_seqs = 3;
    int64_t n_pages = 8;
    for (int s = 0; s < n_seqs; s++)
        n_pages += (seqs[s].len + ps - 1) / ps;
    struct paged_step st;
    build_step(seqs, n_seqs, ps, n_pages, &st);
    const size_t kv_floats = (size_t)n_pages * ps * hd; /* no V half */
    float *base = malloc(kv_floats * sizeof(float));
    for (size_t i = 0; i < kv_floats; i++)
        base[i] = NAN;
    struct tdm_kv_layer kv = {.base = base,
                              .n_kv_heads = 1,
                              .head_dim = hd,
                              .page_size = ps,
                              .n_pages = n_pages,
                              .v_dim = lora};
    float inv_freq[4];
    for (int i = 0; i < rd / 2; i++)
        inv_freq[i] = powf(500.0f, -2.0f * i / rd);
    struct tdm_rope rope = {
        .head_dim = hd, .neox = false, .inv_freq = inv_freq, .rot_dim = rd, .mscale = 0.75f};
    /* every position's row: each sequence's earlier positions written by an append of their
     * own (a step of all positions), then this step's */
    const int T = st.st.n_tokens;
    tdm_backend_t *b = make_backend(TDM_CPU_ISA_PORTABLE, 1, false);
    double *rows = calloc((size_t)n_pages * ps * hd, sizeof(double)); /* reference rows by slot */
    for (int s = 0; s < n_seqs; s++) {
        const struct seq_spec whole = {seqs[s].len, seqs[s].len};
        struct paged_step one;
        build_step(&whole, 1, ps, n_pages, &one);
        /* the same pages as in the step */
        for (int j = 0; j < (seqs[s].len + ps - 1) / ps; j++)
            one.page_ids[j] = st.page_ids[st.seq_page_start[s] + j];
        for (int t = 0; t < one.st.n_tokens; t++)
            one.slots[t] = one.page_ids[one.positions[t] / ps] * ps + one.positions[t] % ps;
        const int n = one.st.n_tokens;
        float *c = rand_vec((size_t)n * lora, -1, 1), *kr = rand_vec((size_t)n * rd, -1, 1);
        float *q = rand_vec((size_t)n * H * hd, -1, 1), *q0 = malloc((size_t)n * H * hd * 4);
        memcpy(q0, q, (size_t)n * H * hd * 4);
        b->iface->rope_kv_append(b, q, c, kr, H, &one.st, &rope, &kv);
        for (int t = 0; t < n; t++) {
            const int pos = one.positions[t];
            double *row = rows + (size_t)one.slots[t] * hd;
            for (int i = 0; i < lora; i++)
                row[i] = c[(size_t)t * lora + i];
            for (int i = 0; i < rd / 2; i++) {
                const double a = (double)(float)((float)pos * inv_freq[i]);
                const double cs = cos(a) * 0.75, sn = sin(a) * 0.75;
                const double x = kr[(size_t)t * rd + 2 * i], y = kr[(size_t)t * rd + 2 * i + 1];
                row[lora + 2 * i] = x * cs - y * sn;
                row[lora + 2 * i + 1] = x * sn + y * cs;
                for (int h = 0; h < H; h++) { /* q: the latent part kept, the rope part turned */
                    const float *qi = q0 + ((size_t)t * H + h) * hd;
                    const float *qo = q + ((size_t)t * H + h) * hd;
                    assert_true(fabs(qo[lora + 2 * i] -
                                     (qi[lora + 2 * i] * cs - qi[lora + 2 * i + 1] * sn)) < 1e-5);
                    assert_true(fabs(qo[lora + 2 * i + 1] -
                                     (qi[lora + 2 * i] * sn + qi[lora + 2 * i + 1] * cs)) < 1e-5);
                }
            }
            for (int h = 0; h < H; h++)
                assert_memory_equal(q + ((size_t)t * H + h) * hd, q0 + ((size_t)t * H + h) * hd,
                                    (size_t)lora * sizeof(float));
            const int32_t page = one.slots[t] / ps;
            const float *stored = base + ((size_t)page * ps + one.slots[t] % ps) * hd;
            for (int i = 0; i < hd; i++)
                assert_true(fabs(stored[i] - row[i]) < 1e-6);
        }
        free(c), free(kr), free(q), free(q0);
        free_step(&one);
    }
    /* attention over the rows: scores over all hd, values the first lora */
    const float scale = 0.3f;
    float *q = rand_vec((size_t)T * H * hd, -2, 2);
    float *out = malloc((size_t)T * H * lora * sizeof(float));
    float *out2 = malloc((size_t)T * H * lora * sizeof(float));
    b->iface->attention(b, q, H, &st.st, &kv, scale, out);
    for (int t = 0; t < T; t++) {
        const int s = st.token_seq[t], n = st.positions[t] + 1;
        for (int h = 0; h < H; h++) {
            const float *qh = q + ((size_t)t * H + h) * hd;
            double *w = malloc((size_t)n * sizeof(double)), mx = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) {
                const int32_t slot = st.page_ids[st.seq_page_start[s] + j / ps] * ps + j % ps;
                const double *row = rows + (size_t)slot * hd;
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += qh[i] * row[i];
                w[j] = d * scale;
                mx = fmax(mx, w[j]);
            }
            for (int j = 0; j < n; j++)
                sum += (w[j] = exp(w[j] - mx));
            for (int i = 0; i < lora; i++) {
                double acc = 0;
                for (int j = 0; j < n; j++) {
                    const int32_t slot = st.page_ids[st.seq_page_start[s] + j / ps] * ps + j % ps;
                    acc += w[j] * rows[(size_t)slot * hd + i];
                }
                assert_true(fabs(out[((size_t)t * H + h) * lora + i] - acc / sum) < 1e-5);
            }
            free(w);
        }
    }
    float *first = malloc((size_t)T * H * lora * sizeof(float));
    for (int isa = 0; isa < n_isas(); isa++) /* each ISA its own bits, whatever the threads */
        for (int th = 1; th <= 3; th++) {
            tdm_backend_t *bk = make_backend((enum tdm_cpu_isa)isa, th, false);
            bk->iface->attention(bk, q, H, &st.st, &kv, scale, th == 1 ? first : out2);
            if (th > 1) assert_memory_equal(first, out2, (size_t)T * H * lora * sizeof(float));
            for (size_t i = 0; i < (size_t)T * H * lora; i++) /* and near the reference */
                assert_true(fabsf(first[i] - out[i]) < 1e-5f);
            tdm_backend_destroy(bk);
        }
    free(first);
    tdm_backend_destroy(b);
    free(out), free(out2), free(q), free(rows), free(base);
    free_step(&st);
}

/* head_matmul: each (row, head) block against a double-precision product, strided in and out,
 * and a row's values the same whatever rows share the call. */
static void test_head_matmul(void **state)
{
    (void)state;
    const int H = 3, R = 5, C = 19, n = 7;
    const size_t xs = (size_t)H * 24 + 3, xh = 24, os = (size_t)H * 8 + 1, oh = 8;
    float *W = rand_vec((size_t)H * R * C, -1, 1), *x = rand_vec((size_t)n * xs, -1, 1);
    float *out = calloc((size_t)n * os, sizeof(float)), *one = calloc(os, sizeof(float));
    struct tdm_weight w = {TDM_DTYPE_F32, (int64_t)H * R, C, (size_t)C * 4, W};
    tdm_backend_t *b = make_backend(TDM_CPU_ISA_PORTABLE, 3, false);
    b->iface->head_matmul(b, &w, H, x, n, xs, xh, out, os, oh);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < H; j++)
            for (int r = 0; r < R; r++) {
                double d = 0;
                for (int c = 0; c < C; c++)
                    d += (double)W[((size_t)j * R + r) * C + c] * x[i * xs + j * xh + c];
                assert_true(fabs(out[i * os + j * oh + r] - d) < 1e-5);
            }
        b->iface->head_matmul(b, &w, H, x + i * xs, 1, xs, xh, one, os, oh);
        for (int j = 0; j < H; j++)
            assert_memory_equal(one + j * oh, out + i * os + j * oh, (size_t)R * sizeof(float));
    }
    tdm_backend_destroy(b);
    free(W), free(x), free(out), free(one);
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

    struct tdm_test_weight tw;
    tdm_test_weight_make(&rng_state, TDM_DTYPE_Q4_1, 4, 64, &tw);
    struct tdm_weight prepared;
    assert_int_equal(b->iface->weight_prepare(b, &tw.w, &prepared), TDM_OK);
    assert_ptr_equal(prepared.data, tw.w.data);
    struct tdm_weight bad = tw.w;
    bad.row_bytes += 1;
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EINVAL);
    bad = tw.w;
    bad.dtype = TDM_DTYPE_Q5_K;
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EUNSUPPORTED);
    bad = tw.w;
    bad.cols = 48; /* not a whole number of blocks */
    assert_int_equal(b->iface->weight_prepare(b, &bad, &prepared), TDM_EINVAL);
    const struct tdm_weight absent = {.dtype = TDM_DTYPE_F32};
    assert_int_equal(b->iface->weight_prepare(b, &absent, &prepared), TDM_OK);
    assert_null(prepared.data);
    tdm_test_weight_free(&tw);

    tdm_backend_destroy(b);
    tdm_backend_destroy(NULL);
}

/* ---- quantised activations (src/backend/cpu/qdot.c) ---- */

/* The specification of an activation block (qdot.c), written out here on its own: step =
 * amax / 127 (a zero block below 2^-100, past FLT_MAX or with a NaN), hi = rint(x / step) and
 * lo = rint((x - step hi) * 256 / step) (through 1 / step and one fma), each clamped to
 * [-127, 127]; d = step / 256, s = sum (256 hi + lo), s16 = that sum over the first 16 elements,
 * ds = d * s. */
static void spec_quantise(const float *x, struct tdm_cpu_xblock *o)
{
    float amax = 0;
    bool nan = false;
    for (int j = 0; j < 32; j++) {
        amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        nan = nan || x[j] != x[j];
    }
    memset(o, 0, sizeof *o);
    const float step = amax / 127.0f;
    if (nan || step < 0x1p-100f || step > 3.4028235e38f) return;
    const float id = 1.0f / step;
    for (int j = 0; j < 32; j++) {
        float h = rintf(x[j] * id);
        h = h > 127 ? 127 : h < -127 ? -127 : h;
        float l = rintf(fmaf(-step, h, x[j]) * (id * 256.0f));
        l = l > 127 ? 127 : l < -127 ? -127 : l;
        o->hi[j] = (int8_t)h;
        o->lo[j] = (int8_t)l;
        o->v[j] = (int16_t)(256 * (int)h + (int)l);
        o->s += 256 * (int)h + (int)l;
        if (j < 16) o->s16 += 256 * (int)h + (int)l;
    }
    o->d = step / 256.0f;
    o->ds = o->d * (float)o->s;
}

/* The exact integer sum of a weight block against an activation block, in int64 from the
 * block's bytes as quant_int.h lays them out (Q4_0's values are nibble - 8). */
static int64_t spec_isum(enum tdm_dtype dt, const uint8_t *blk, const struct tdm_cpu_xblock *x)
{
    int64_t sum = 0;
    for (int j = 0; j < 32; j++) {
        int64_t wq;
        if (dt == TDM_DTYPE_Q8_0) {
            wq = ((const int8_t *)blk)[offsetof(struct block_q8_0, qs) + j];
        } else {
            const size_t off = dt == TDM_DTYPE_Q4_0 ? offsetof(struct block_q4_0, qs)
                                                    : offsetof(struct block_q4_1, qs);
            const uint8_t byte = blk[off + (j & 15)];
            wq = j < 16 ? (byte & 0x0F) : (byte >> 4);
            if (dt == TDM_DTYPE_Q4_0) wq -= 8;
        }
        sum += wq * (256 * x->hi[j] + x->lo[j]);
    }
    return sum;
}

static float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return tdm_f16_to_f32(h);
}

/* Element i (0..255) of a K-quant super-block as quant_int.h describes it: Q4_K's nibble q and
 * its sub-block i / 32; Q6_K's 6-bit q (value q - 32) and its sub-block i / 16. */
static int kq_elem(enum tdm_dtype dt, const uint8_t *sblk, int i)
{
    if (dt == TDM_DTYPE_Q4_K) {
        const uint8_t byte = sblk[offsetof(struct block_q4_K, qs) + 32 * (i / 64) + i % 32];
        return (i % 64) < 32 ? (byte & 0x0F) : (byte >> 4);
    }
    const int h = i / 128, r = i % 128;
    const uint8_t lo = sblk[offsetof(struct block_q6_K, ql) + 64 * h + r % 64];
    const uint8_t hi = sblk[offsetof(struct block_q6_K, qh) + 32 * h + r % 32];
    return ((r >= 64 ? lo >> 4 : lo & 0x0F) | (((hi >> (2 * (r / 32))) & 3) << 4));
}

/* qdot.c's value of a K-quant pair, from the specification: per activation block, Q4_K's
 * sub-block as a Q4_1 block of scale d * sc and minimum -(dmin * m); Q6_K's two halves, each
 * an exact integer sum of (q - 32) v, scaled by (d * sc) * d_x. The integers in int64. */
static float spec_pair_k(const struct tdm_weight *w, int64_t r, const struct tdm_cpu_xblock *x)
{
    const int64_t nsb = w->cols / 256;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
    const bool q4 = w->dtype == TDM_DTYPE_Q4_K;
    float acc = 0;
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk =
            row + (size_t)sb * (q4 ? sizeof(struct block_q4_K) : sizeof(struct block_q6_K));
        for (int j = 0; j < 8; j++) {
            const struct tdm_cpu_xblock *xb = &x[sb * 8 + j];
            int64_t isum[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                const int64_t q = kq_elem(w->dtype, blk, 32 * j + l) - (q4 ? 0 : 32);
                isum[l / 16] += q * (256 * xb->hi[l] + xb->lo[l]);
            }
            if (q4) {
                uint8_t sc, mn;
                tdm_k_scale_min(blk + offsetof(struct block_q4_K, scales), j, &sc, &mn);
                const int64_t is = isum[0] + isum[1];
                assert_true(is > -(1 << 24) && is < (1 << 24)); /* exact as a float */
                const float dw = f16_at(blk + offsetof(struct block_q4_K, d)) * (float)sc;
                const float dm = -(f16_at(blk + offsetof(struct block_q4_K, dmin)) * (float)mn);
                acc = acc + fmaf(dw * xb->d, (float)is, dm * xb->ds);
            } else {
                const float d = f16_at(blk + offsetof(struct block_q6_K, d));
                const int8_t *sc = (const int8_t *)(blk + offsetof(struct block_q6_K, scales));
                for (int k = 0; k < 2; k++) {
                    assert_true(isum[k] >= -(1 << 24) && isum[k] <= (1 << 24));
                    acc = fmaf((d * (float)sc[2 * j + k]) * xb->d, (float)isum[k], acc);
                }
            }
        }
    }
    return acc;
}

/* qdot.c's value of one (weight row, activation row) pair, from the specification. */
static float spec_pair(const struct tdm_weight *w, int64_t r, const struct tdm_cpu_xblock *x)
{
    if (w->dtype == TDM_DTYPE_Q4_K || w->dtype == TDM_DTYPE_Q6_K) return spec_pair_k(w, r, x);
    const int64_t nb = w->cols / 32;
    const size_t bsz = w->row_bytes / (size_t)nb;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)r * w->row_bytes;
    float acc = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (size_t)b * bsz;
        const int64_t isum = spec_isum(w->dtype, blk, &x[b]);
        assert_true(isum > -(1 << 28) && isum < (1 << 28)); /* an int32, a float past 2^24 */
        const float dd = f16_at(blk) * x[b].d;
        if (w->dtype == TDM_DTYPE_Q4_1)
            acc = acc + fmaf(dd, (float)isum, f16_at(blk + 2) * x[b].ds);
        else
            acc = fmaf(dd, (float)isum, acc);
    }
    return acc;
}

/* The activation quantisers of every ISA give the specification's bytes, on random blocks and
 * on edge cases: an all-zero block, exact halves (ties to even), one huge element among tiny
 * ones, subnormals, a NaN, an infinity, equal magnitudes of both signs. And each value is
 * within half a unit d of x (one where the clamp of lo takes the other half). */
static void test_quantise(void **state)
{
    (void)state;
    enum { NB = 64 };
    float *x = rand_vec(NB * 32, -3, 3);
    for (int j = 0; j < 32; j++) {
        x[j] = 0;                                         /* block 0: zeros */
        x[32 + j] = (float)(j - 16) * 0.5f;               /* block 1: amax 8 */
        x[64 + j] = j == 7 ? 1e30f : 1e-3f;               /* block 2: one huge element */
        x[96 + j] = (j % 2 ? -1 : 1) * 1e-40f;            /* block 3: subnormals: zeros */
        x[128 + j] = j % 3 ? 127.0f : -127.0f;            /* block 4: step 1 exactly */
        x[160 + j] = j ? (float)(j - 16) + 0.5f : 127.0f; /* block 5: step 1, exact halves */
        x[192 + j] = j == 3 ? NAN : 1.0f;                 /* block 6: a NaN: zeros */
        x[224 + j] = j == 9 ? -INFINITY : 1.0f;           /* block 7: an infinity: zeros */
        x[256 + j] = (float)j * (1.0f / 256.0f) + 3.0f;   /* block 8: lo holds the fraction */
    }
    struct tdm_cpu_xblock spec[NB], got[NB];
    for (int b = 0; b < NB; b++) {
        spec_quantise(x + 32 * b, &spec[b]);
        if (b == 2 || b == 3 || b == 6 || b == 7) continue; /* lo cannot hold 1e-3 of 1e30 */
        /* 256 hi + lo is x in units of d, within half a unit, or one where hi was a tie (its
         * rest is half a step: lo = +-128, clamped to +-127) */
        for (int j = 0; j < 32; j++) {
            const double v = 256.0 * spec[b].hi[j] + spec[b].lo[j];
            const double unit = abs(spec[b].lo[j]) == 127 ? 1.01 : 0.51;
            if (!(fabs(x[32 * b + j] - spec[b].d * v) <= unit * spec[b].d + 1e-30))
                fail_msg("block %d [%d]: %g quantised to %g * %g", b, j, x[32 * b + j], v,
                         spec[b].d);
        }
    }
    for (int b = 0; b < NB; b++)
        if (b == 0 || b == 3 || b == 6 || b == 7) {
            assert_true(spec[b].d == 0.0f && spec[b].s == 0);
        } else {
            assert_true(spec[b].d > 0.0f);
        }
    /* step 1: hi ties to even (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0, -1.5 -> -2), and lo
     * holds the rest exactly (the halves: +-128 units clamp to +-127) */
    assert_true(spec[5].d == 1.0f / 256);
    assert_int_equal(spec[5].hi[16], 0);
    assert_int_equal(spec[5].hi[17], 2);
    assert_int_equal(spec[5].hi[18], 2);
    assert_int_equal(spec[5].hi[15], 0);
    assert_int_equal(spec[5].hi[14], -2);
    assert_int_equal(spec[5].lo[16], 127);
    assert_int_equal(spec[5].lo[17], -127);
    /* block 8: x = 3 + j / 256, amax 3 + 31 / 256: each value is hi steps plus lo units */
    for (int j = 0; j < 32; j++) {
        const double v = 256.0 * spec[8].hi[j] + spec[8].lo[j];
        assert_true(fabs(spec[8].d * v - x[256 + j]) <= 0.5 * spec[8].d);
    }
    tdm_cpu_quantise_portable(x, NB, got);
    assert_memory_equal(spec, got, sizeof spec);
    if (tdm_cpu_isa_detect() >= TDM_CPU_ISA_AVX2) {
        memset(got, 0x55, sizeof got);
        tdm_cpu_quantise_avx2(x, NB, got);
        assert_memory_equal(spec, got, sizeof spec);
    } else {
        printf("SKIP: the AVX2 quantiser: no AVX2 on this machine\n");
    }
    free(x);
}

static void test_qdot(void **state)
{
    (void)state;
    const enum tdm_dtype qts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K,
                                  TDM_DTYPE_Q6_K};
    const int64_t rows = 23, cols = 512;
    const int nb = (int)(cols / 32);
    struct variant vs[VARIANTS_MAX];
    const int n_vs = variants(vs);
    for (size_t d = 0; d < TDM_ARRAY_LEN(qts); d++) {
        struct tdm_test_weight tw;
        tdm_test_weight_make(&rng_state, qts[d], rows, cols, &tw);
        /* row 0 block 0 and row 1 block 1 (a K-quant's super-blocks 0 and 1): the extremes of
         * the integers */
        const bool kq = qts[d] == TDM_DTYPE_Q4_K || qts[d] == TDM_DTYPE_Q6_K;
        const int bpr = kq ? nb / 8 : nb; /* weight blocks a row */
        for (int r = 0; r < 2; r++) {
            uint8_t *blk = (uint8_t *)tw.w.data + (size_t)r * tw.w.row_bytes +
                           (size_t)r * (tw.w.row_bytes / (size_t)bpr);
            if (qts[d] == TDM_DTYPE_Q8_0) {
                memset(blk + offsetof(struct block_q8_0, qs), r ? 0x7F : 0x80, 32);
            } else if (qts[d] == TDM_DTYPE_Q4_K) { /* q = 15 or 0 at scale and minimum 63 */
                memset(blk + offsetof(struct block_q4_K, scales), 0xFF, TDM_K_SCALE_BYTES);
                memset(blk + offsetof(struct block_q4_K, qs), r ? 0x00 : 0xFF, TDM_QK_K / 2);
            } else if (qts[d] == TDM_DTYPE_Q6_K) { /* q - 32 = -32 at scale -128, or 31 at 127 */
                memset(blk, r ? 0xFF : 0x00, offsetof(struct block_q6_K, scales));
                memset(blk + offsetof(struct block_q6_K, scales), r ? 0x7F : 0x80, TDM_QK_K / 16);
            } else {
                memset(blk + (qts[d] == TDM_DTYPE_Q4_0 ? offsetof(struct block_q4_0, qs)
                                                       : offsetof(struct block_q4_1, qs)),
                       r ? 0xFF : 0x00, 16);
            }
            assert_int_equal(tdm_dequantize(qts[d],
                                            (const uint8_t *)tw.w.data + (size_t)r * tw.w.row_bytes,
                                            tw.deq + (size_t)r * cols, cols),
                             TDM_OK);
        }
        /* the backend's own row dequantiser (embed, fp32 tiles) gives the reference's bits */
        float *row = malloc((size_t)cols * sizeof(float));
        for (int64_t r = 0; r < rows; r++) {
            tdm_cpu_weight_row(&tw.w, r, row);
            assert_memory_equal(row, tw.deq + (size_t)r * cols, (size_t)cols * sizeof(float));
        }
        free(row);
        enum { NMAX = 6 };
        float *x = rand_vec((size_t)NMAX * cols, -2, 2);
        for (int j = 0; j < 64; j++) /* row 0, blocks 0 and 1: +-amax, so hi = +-127 */
            x[j] = j % 5 ? -2.0f : 2.0f;
        for (int j = 0; j < 32; j++) /* row 1, block 0: all 2: hi = 127, s = 32 * 256 * 127 */
            x[cols + j] = 2.0f;
        for (int j = 0; j < 32; j++) /* row 2, block 0: step 1, +-63.5: hi +-64, lo -+127 */
            x[2 * cols + j] = j ? (j % 2 ? 63.5f : -63.5f) : 127.0f;
        float *bias = rand_vec((size_t)rows, -1, 1);
        struct tdm_cpu_xblock *xq = malloc((size_t)NMAX * nb * sizeof *xq);
        float *want = malloc((size_t)NMAX * rows * sizeof(float));
        float *pair = malloc((size_t)NMAX * rows * sizeof(float));
        for (int i = 0; i < NMAX; i++) {
            for (int b = 0; b < nb; b++)
                spec_quantise(x + (size_t)i * cols + 32 * b, &xq[i * nb + b]);
            for (int64_t r = 0; r < rows; r++) {
                pair[i * rows + r] = spec_pair(&tw.w, r, xq + i * nb);
                want[i * rows + r] = pair[i * rows + r] + bias[r];
                /* the quantised product against float64 */
                double ref = bias[r], bound = 0, mag = 0;
                for (int b = 0; b < nb; b++) {
                    double wabs = 0;
                    for (int j = 0; j < 32; j++) {
                        const double wv = tw.deq[r * cols + 32 * b + j];
                        const double xv = x[(size_t)i * cols + 32 * b + j];
                        ref += wv * xv;
                        wabs += fabs(wv);
                        mag += fabs(wv * xv);
                    }
                    bound += 0.5 * xq[i * nb + b].d * wabs * (1 + 1e-6);
                }
                bound += 1e-5 * (mag + bound) + 1e-6 * fabs(bias[r]);
                const double err = fabs(want[i * rows + r] - ref);
                if (!(err <= bound))
                    fail_msg("%s row %lld act %d: quantised %.9g vs float64 %.9g, bound %.3g",
                             tdm_dtype_name(qts[d]), (long long)r, i, want[i * rows + r], ref,
                             bound);
            }
        }
        float *got = malloc((size_t)NMAX * rows * sizeof(float));
        float *g2 = malloc((size_t)NMAX * rows * sizeof(float));
        for (int v = 0; v < n_vs; v++) {
            for (int th = 1; th <= 2; th++) {
                tdm_backend_t *b = make_qbackend(&vs[v], th);
                const int ns[] = {1, NMAX};
                for (int k = 0; k < 2; k++) {
                    memset(got, 0, (size_t)NMAX * rows * sizeof(float));
                    b->iface->matmul(b, &tw.w, x, ns[k], bias, got);
                    assert_same_bits(got, want, (size_t)ns[k] * rows,
                                     "qdot %s %s n=%d %d threads vs specification", vs[v].name,
                                     tdm_dtype_name(qts[d]), ns[k], th);
                }
                /* swiglu: silu(gate) * up of the same weight, from the specification's values
                 * (n = 1 takes the strided decode walk, NMAX the prefill tiles) */
                for (int i = 0; i < NMAX * rows; i++)
                    g2[i] = tdm_cpu_silu_mul1(pair[i], pair[i]);
                for (int k = 0; k < 2; k++) {
                    memset(got, 0, (size_t)NMAX * rows * sizeof(float));
                    b->iface->matmul_swiglu(b, &tw.w, &tw.w, x, ns[k], got);
                    assert_same_bits(got, g2, (size_t)ns[k] * rows,
                                     "qdot %s %s swiglu n=%d vs specification", vs[v].name,
                                     tdm_dtype_name(qts[d]), ns[k]);
                }
                tdm_backend_destroy(b);
            }
        }
        free(g2);
        free(got);
        free(pair);
        free(want);
        free(xq);
        free(bias);
        free(x);
        tdm_test_weight_free(&tw);
    }
}

/* The AMX tiles (qdot_amx.c). The integer part: one block of weights (scale 1) against one
 * packed block of activations (d 1, so each output is (float) of the exact sum): every pair's
 * sum of random and extreme bytes, against int64, for R and C of 1 to 16 (C <= 8: a narrow
 * group, both planes in one tile). Whole rows: Q8_0,
 * Q4_0 and Q4_1 matrices of odd shapes (rows not a multiple of 16, K not one of 64) times
 * batches of 1 to 33 rows on 1 and 2 threads, each value the specification's bits and each row
 * what the same row gives alone (on the AVX512-VNNI tile), swiglu included. Skipped, with a
 * message, where the CPU or OS has no AMX. */
static void test_qdot_amx(void **state)
{
    (void)state;
    if (!tdm_cpu_amx_available() || !tdm_cpu_isa_vnni(TDM_CPU_ISA_AVX512)) {
        printf("SKIP: test_qdot_amx: no AMX int8 tiles on this machine (CPU or OS)\n");
        /* without AMX an instance refuses them */
        tdm_backend_t *b = NULL;
        struct tdm_backend_cpu_opts o = {.n_threads = 1, .quant_activations = true};
        assert_int_equal(tdm_backend_cpu_create(&o, &b), TDM_OK);
        assert_false(tdm_cpu_of(b)->amx);
        assert_int_equal(tdm_cpu_amx_set(b, true), TDM_EUNSUPPORTED);
        tdm_backend_destroy(b);
        return;
    }
    /* the integer part */
    const enum tdm_dtype qts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1};
    for (size_t d = 0; d < TDM_ARRAY_LEN(qts); d++) {
        const size_t bsz = qts[d] == TDM_DTYPE_Q8_0   ? sizeof(struct block_q8_0)
                           : qts[d] == TDM_DTYPE_Q4_0 ? sizeof(struct block_q4_0)
                                                      : sizeof(struct block_q4_1);
        const int wtype = tdm_cpu_wtype_of(qts[d]);
        uint8_t w[16][sizeof(struct block_q8_0)];
        struct tdm_cpu_xblock xb[16];
        struct tdm_cpu_xtile *xt = tdm_alloc_aligned(sizeof *xt);
        for (int rep = 0; rep < 40; rep++) {
            for (int i = 0; i < 16; i++) {
                for (size_t k = 0; k < bsz; k++)
                    w[i][k] = (uint8_t)rng_u64();
                if (rep < 4) /* the extremes: -128 or 127 bytes, nibbles 0 or 15 */
                    memset(w[i] + 2, (rep + i) % 2 ? 0x7F : 0x80, bsz - 2);
                const uint16_t one = 0x3C00, zero = 0; /* scale 1, Q4_1 minimum 0 */
                memcpy(w[i], &one, 2);
                if (qts[d] == TDM_DTYPE_Q4_1) memcpy(w[i] + 2, &zero, 2);
                memset(&xb[i], 0, sizeof xb[i]);
                for (int j = 0; j < 32; j++) {
                    xb[i].hi[j] = rep < 4 ? ((rep / 2 + i + j) % 2 ? 127 : -127)
                                          : (int8_t)(rng_u64() % 255 - 127);
                    xb[i].lo[j] =
                        rep < 4 ? (rep % 2 ? 127 : -127) : (int8_t)(rng_u64() % 255 - 127);
                    xb[i].s += 256 * xb[i].hi[j] + xb[i].lo[j];
                }
                xb[i].d = 1.0f;
            }
            const int R = 1 + (int)(rng_u64() % 16), C = 1 + (int)(rng_u64() % 16);
            const int RR = rep < 4 ? 16 : R, CC = rep < 4 ? 16 : C;
            tdm_cpu_xtile_pack(xb, 1, CC, 1, xt);
            float out[16 * 16];
            const struct tdm_cpu_amx_tile t = {
                .w = &w[0][0], .row_bytes = sizeof w[0], .nb = 1, .x = xt, .out = out, .ldo = 16};
            tdm_cpu_amx_qtile(&t, wtype, RR, CC);
            for (int c = 0; c < CC; c++)
                for (int i = 0; i < RR; i++) {
                    const int64_t want = spec_isum(qts[d], w[i], &xb[c]);
                    if (out[c * 16 + i] != (float)want)
                        fail_msg("AMX %s integer sum, row %d act %d of %d x %d: %.9g vs %lld",
                                 tdm_dtype_name(qts[d]), i, c, RR, CC, out[c * 16 + i],
                                 (long long)want);
                }
        }
        tdm_free_aligned(xt);
    }
    /* whole rows of odd shapes */
    const int64_t shapes[][2] = {{37, 96}, {17, 224}, {5, 32}, {50, 544}};
    struct variant amx = {.isa = TDM_CPU_ISA_AVX512, .vnni = true, .amx = true};
    struct variant vec = {.isa = TDM_CPU_ISA_AVX512, .vnni = true};
    enum { NMAX = 33 };
    for (size_t d = 0; d < TDM_ARRAY_LEN(qts); d++)
        for (size_t sh = 0; sh < TDM_ARRAY_LEN(shapes); sh++) {
            const int64_t rows = shapes[sh][0], cols = shapes[sh][1];
            const int nb = (int)(cols / 32);
            struct tdm_test_weight tw;
            tdm_test_weight_make(&rng_state, qts[d], rows, cols, &tw);
            float *x = rand_vec((size_t)NMAX * cols, -2, 2);
            float *bias = rand_vec((size_t)rows, -1, 1);
            struct tdm_cpu_xblock *xq = malloc((size_t)NMAX * nb * sizeof *xq);
            float *want = malloc((size_t)NMAX * rows * sizeof(float));
            float *sw = malloc((size_t)NMAX * rows * sizeof(float));
            float *one = malloc((size_t)NMAX * rows * sizeof(float));
            float *got = malloc((size_t)NMAX * rows * sizeof(float));
            for (int i = 0; i < NMAX; i++) {
                for (int b = 0; b < nb; b++)
                    spec_quantise(x + (size_t)i * cols + 32 * b, &xq[i * nb + b]);
                for (int64_t r = 0; r < rows; r++) {
                    const float p = spec_pair(&tw.w, r, xq + i * nb);
                    want[i * rows + r] = p + bias[r];
                    sw[i * rows + r] = tdm_cpu_silu_mul1(p, p);
                }
            }
            tdm_backend_t *bv = make_qbackend(&vec, 1);
            for (int i = 0; i < NMAX; i++)
                bv->iface->matmul(bv, &tw.w, x + (size_t)i * cols, 1, bias, one + i * rows);
            assert_same_bits(one, want, (size_t)NMAX * rows, "AMX test: %s rows alone vs spec",
                             tdm_dtype_name(qts[d]));
            tdm_backend_destroy(bv);
            for (int th = 1; th <= 2; th++) {
                tdm_backend_t *b = make_qbackend(&amx, th);
                for (int n = 1; n <= NMAX; n++) {
                    memset(got, 0xFF, (size_t)n * rows * sizeof(float));
                    b->iface->matmul(b, &tw.w, x, n, bias, got);
                    assert_same_bits(got, one, (size_t)n * rows,
                                     "AMX %s %lld x %lld n=%d %d threads vs each row alone",
                                     tdm_dtype_name(qts[d]), (long long)rows, (long long)cols, n,
                                     th);
                }
                for (int n = 1; n <= NMAX; n += 8) {
                    b->iface->matmul_swiglu(b, &tw.w, &tw.w, x, n, got);
                    assert_same_bits(got, sw, (size_t)n * rows, "AMX %s n=%d swiglu vs spec",
                                     tdm_dtype_name(qts[d]), n);
                }
                tdm_backend_destroy(b);
            }
            free(got);
            free(one);
            free(sw);
            free(want);
            free(xq);
            free(bias);
            free(x);
            tdm_test_weight_free(&tw);
        }
}

/* The K-quants on fp32 activations (the portable tile at every level: a fallback, since the
 * loader widens them to F32 unless activations are quantised): within float rounding of the
 * float64 product of the reference dequantiser's values, and each row the same bits alone, in a
 * batch and on 1 or 2 threads. */
static void test_kquant_fp32(void **state)
{
    (void)state;
    const enum tdm_dtype kts[] = {TDM_DTYPE_Q4_K, TDM_DTYPE_Q6_K};
    const int64_t rows = 19, cols = 512;
    enum { N = 5 };
    for (size_t d = 0; d < TDM_ARRAY_LEN(kts); d++) {
        struct tdm_test_weight tw;
        tdm_test_weight_make(&rng_state, kts[d], rows, cols, &tw);
        float *x = rand_vec((size_t)N * cols, -1, 1);
        float full[N * 19], one[19];
        for (int iv = 0; iv < n_isas(); iv++)
            for (int th = 1; th <= 2; th++) {
                tdm_backend_t *b = make_backend((enum tdm_cpu_isa)iv, th, true);
                b->iface->matmul(b, &tw.w, x, N, NULL, full);
                for (int i = 0; i < N; i++) {
                    b->iface->matmul(b, &tw.w, x + (size_t)i * cols, 1, NULL, one);
                    assert_same_bits(one, full + i * rows, (size_t)rows, "%s %s row %d alone",
                                     tdm_cpu_isa_name((enum tdm_cpu_isa)iv), tdm_dtype_name(kts[d]),
                                     i);
                    for (int64_t r = 0; r < rows; r++) {
                        double ref = 0, mag = 0;
                        for (int64_t c = 0; c < cols; c++) {
                            ref += (double)tw.deq[r * cols + c] * x[(size_t)i * cols + c];
                            mag += fabs((double)tw.deq[r * cols + c] * x[(size_t)i * cols + c]);
                        }
                        if (!(fabs(full[i * rows + r] - ref) <= 1e-5 * mag + 1e-30))
                            fail_msg("%s %s [%d][%lld]: %.9g vs float64 %.9g",
                                     tdm_cpu_isa_name((enum tdm_cpu_isa)iv), tdm_dtype_name(kts[d]),
                                     i, (long long)r, full[i * rows + r], ref);
                    }
                }
                tdm_backend_destroy(b);
            }
        free(x);
        tdm_test_weight_free(&tw);
    }
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

/* The KV element conversions of every ISA give the portable ones' bits: every 16-bit pattern
 * widened, and narrowed from floats of every class (zeros, subnormals of both types, ties,
 * values that round to the largest finite and past it, infinities, NaNs with payloads), plus
 * random bit patterns. Tails (lengths that are not multiples of 8) included. */
static void test_kv_convert_isas(void **state)
{
    (void)state;
    if (tdm_cpu_isa_detect() < TDM_CPU_ISA_AVX2) {
        printf("SKIP: test_kv_convert_isas: no AVX2 on this machine\n");
        return;
    }
    enum { N = 65536 + 5 };
    uint16_t *h = malloc(N * sizeof *h), *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
    float *f = malloc(N * sizeof *f), *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    assert_true(h && a && b && f && x && y);
    for (int i = 0; i < N; i++)
        h[i] = (uint16_t)i;
    const enum tdm_dtype dts[] = {TDM_DTYPE_BF16, TDM_DTYPE_F16};
    for (int d = 0; d < 2; d++) {
        tdm_cpu_kv_widen_portable(dts[d], h, x, N);
        tdm_cpu_kv_widen_avx2(dts[d], h, y, N);
        assert_memory_equal(x, y, N * sizeof *x);
    }
    const uint32_t special[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x33800000u,
                                0x33000001u, 0x387fc000u, 0x38800000u, 0x477fe000u, 0x477ff000u,
                                0x477fefffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u,
                                0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu, 0x3f808000u,
                                0x3f818000u, 0x3f80ffffu, 0xc0490fdbu};
    uint64_t r = 0x9E3779B97F4A7C15ull;
    for (int i = 0; i < N; i++) {
        uint32_t u;
        if (i < (int)(sizeof special / sizeof *special)) {
            u = special[i];
        } else {
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            u = (uint32_t)(r >> 16);
            if (i % 3 == 0) u = (u & 0x807fffffu) | ((uint32_t)(100 + (u >> 24) % 60) << 23);
        }
        memcpy(&f[i], &u, 4);
    }
    for (int d = 0; d < 2; d++)
        for (int n = N - 7; n <= N; n += 7) {
            tdm_cpu_kv_narrow_portable(dts[d], f, a, n);
            tdm_cpu_kv_narrow_avx2(dts[d], f, b, n);
            for (int i = 0; i < n; i++)
                if (a[i] != b[i])
                    fail_msg("%s narrow of %08x: portable %04x, avx2 %04x", tdm_dtype_name(dts[d]),
                             *(uint32_t *)&f[i], a[i], b[i]);
        }
    free(h), free(a), free(b), free(f), free(x), free(y);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_invariance), cmocka_unit_test(test_matmul_fused),
        cmocka_unit_test(test_attention_paged),   cmocka_unit_test(test_misc),
        cmocka_unit_test(test_isa_selection),     cmocka_unit_test(test_kv_convert_isas),
        cmocka_unit_test(test_latent_attention),  cmocka_unit_test(test_head_matmul),
        cmocka_unit_test(test_quantise),          cmocka_unit_test(test_qdot),
        cmocka_unit_test(test_kquant_fp32),       cmocka_unit_test(test_qdot_amx),
    };
    fprintf(stderr, "cpu backend: best ISA here is %s\n", tdm_cpu_isa_name(tdm_cpu_isa_detect()));
    if (getenv("TDM_TEST_FILTER")) cmocka_set_test_filter(getenv("TDM_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
