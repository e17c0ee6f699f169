/* Engine tests on a tiny random model built in memory: the batch interface's invariances (a
 * sequence's logits are bit-identical alone or batched with others, prefilled in one call or
 * in chunks, and wherever its pages sit in the pool), batch validation, hidden-state output,
 * and the layer-completion counter. Numerical fidelity against an independent reference is
 * tests/engine/test_fidelity.py's job. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/tiny_model.h"
#include "tandem/engine.h"

enum { D = 32, NH = 4, NKV = 2, HD = 8, FF = 64, VOCAB = 50, NL = 2 };

/* The tiny model: lib/tiny_model.c builds it (fixed weight scales, seeded). */
static struct tdm_test_model tiny;

static void make_model(struct tdm_model *m, enum tdm_dtype dt, enum tdm_arch arch)
{
    struct tdm_test_model_opts o = {.arch = arch,
                                    .dtype = dt,
                                    .n_layers = NL,
                                    .d_model = D,
                                    .n_heads = NH,
                                    .n_kv_heads = NKV,
                                    .head_dim = HD,
                                    .d_ff = FF,
                                    .vocab = VOCAB,
                                    .max_ctx = 256,
                                    .rope_neox = true,
                                    .seed = 1};
    tdm_test_model_make(&tiny, &o);
    *m = tiny.m;
}

static void free_model(void)
{
    tdm_test_model_free(&tiny);
}

static int32_t toks[64];

static tdm_engine_t *make_engine(const struct tdm_model *m, int threads, bool count_layers)
{
    struct tdm_engine_opts o = {.n_threads = threads,
                                .batch_invariant = true,
                                .page_size = 4,
                                .kv_pages = 64,
                                .max_batch_tokens = 64,
                                .max_seqs = 8,
                                .count_layers = count_layers};
    tdm_engine_t *e = NULL;
    assert_int_equal(tdm_engine_create(m, &o, &e), TDM_OK);
    return e;
}

/* Runs a 20-token prompt alone (one call), returns last logits; also decodes 2 steps. */
static void run_alone(tdm_engine_t *e, const int32_t *pages, float *out, int chunk)
{
    for (int done = 0; done < 20;) {
        int n = TDM_MIN(chunk, 20 - done);
        struct tdm_batch_seq s = {.tokens = toks + done,
                                  .n_tokens = n,
                                  .pos0 = done,
                                  .pages = pages,
                                  .n_pages = 6,
                                  .n_logits = done + n == 20};
        struct tdm_batch b = {&s, 1};
        assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_OK);
        done += n;
    }
    for (int step = 0; step < 2; step++) {
        struct tdm_batch_seq s = {.tokens = toks + 20 + step,
                                  .n_tokens = 1,
                                  .pos0 = 20 + step,
                                  .pages = pages,
                                  .n_pages = 6,
                                  .n_logits = 1};
        struct tdm_batch b = {&s, 1};
        assert_int_equal(tdm_engine_forward(e, &b, out + (1 + step) * VOCAB, NULL), TDM_OK);
    }
}

static void check_invariance(enum tdm_dtype dt, enum tdm_arch arch)
{
    struct tdm_model m;
    make_model(&m, dt, arch);
    for (int i = 0; i < 64; i++)
        toks[i] = (i * 7 + 3) % VOCAB;
    tdm_engine_t *e = make_engine(&m, 2, true);
    _Atomic int32_t *ctr = tdm_engine_layer_counter(e);
    assert_non_null(ctr);
    atomic_store(ctr, -1);
    int32_t pages_a[6] = {0, 1, 2, 3, 4, 5}, pages_b[6] = {17, 9, 30, 2, 40, 11};
    float ref[3 * VOCAB], got[3 * VOCAB];
    run_alone(e, pages_a, ref, 20);
    assert_int_equal(atomic_load(ctr), NL);

    /* chunked prefill, other pages: identical */
    run_alone(e, pages_b, got, 7);
    assert_memory_equal(ref, got, sizeof ref);

    /* the same sequence inside a batch with two others (a prefill and a decode) */
    tdm_engine_t *e2 = make_engine(&m, 3, false);
    assert_null(tdm_engine_layer_counter(e2));
    int32_t pa[6] = {5, 6, 7, 8, 9, 10}, pb[6] = {20, 21, 22, 23, 24, 25},
            pc[6] = {30, 31, 32, 33, 34, 35};
    int32_t other[20];
    for (int i = 0; i < 20; i++)
        other[i] = (i * 13 + 1) % VOCAB;
    float out[4 * VOCAB];
    struct tdm_batch_seq s3[3] = {
        {.tokens = other, .n_tokens = 9, .pos0 = 0, .pages = pb, .n_pages = 6, .n_logits = 1},
        {.tokens = toks, .n_tokens = 20, .pos0 = 0, .pages = pa, .n_pages = 6, .n_logits = 1},
        {.tokens = other + 3, .n_tokens = 5, .pos0 = 0, .pages = pc, .n_pages = 6, .n_logits = 2},
    };
    struct tdm_batch b3 = {s3, 3};
    assert_int_equal(tdm_engine_forward(e2, &b3, out, NULL), TDM_OK);
    assert_memory_equal(out + VOCAB, ref, VOCAB * sizeof(float)); /* row 1: our sequence */
    /* decode steps, batched with a decode of another sequence */
    for (int step = 0; step < 2; step++) {
        struct tdm_batch_seq s2[2] = {
            {.tokens = other + 12 + step,
             .n_tokens = 1,
             .pos0 = 9 + step,
             .pages = pb,
             .n_pages = 6,
             .n_logits = 1},
            {.tokens = toks + 20 + step,
             .n_tokens = 1,
             .pos0 = 20 + step,
             .pages = pa,
             .n_pages = 6,
             .n_logits = 1},
        };
        struct tdm_batch b2 = {s2, 2};
        float hidden[2 * D];
        assert_int_equal(tdm_engine_forward(e2, &b2, out, hidden), TDM_OK);
        assert_memory_equal(out + VOCAB, ref + (1 + step) * VOCAB, VOCAB * sizeof(float));
        for (int i = 0; i < 2 * D; i++)
            assert_true(isfinite(hidden[i]));
    }
    tdm_engine_destroy(e2);
    tdm_engine_destroy(e);
    free_model();
}

static void test_invariance_f32(void **s)
{
    (void)s;
    check_invariance(TDM_DTYPE_F32, TDM_ARCH_LLAMA);
}
static void test_invariance_bf16_qwen2(void **s)
{
    (void)s;
    check_invariance(TDM_DTYPE_BF16, TDM_ARCH_QWEN2);
}
static void test_invariance_qwen3(void **s)
{
    (void)s;
    check_invariance(TDM_DTYPE_F32, TDM_ARCH_QWEN3);
}

static void test_validation(void **s)
{
    (void)s;
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_F32, TDM_ARCH_LLAMA);
    tdm_engine_t *e = make_engine(&m, 1, false);
    int32_t pages[6] = {0, 1, 2, 3, 4, 5}, bad_pages[2] = {0, 64};
    int32_t t[3] = {1, 2, 3}, bad_tok[2] = {1, VOCAB};
    float out[VOCAB];
    struct tdm_batch_seq q = {
        .tokens = bad_tok, .n_tokens = 2, .pages = pages, .n_pages = 6, .n_logits = 1};
    struct tdm_batch b = {&q, 1};
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_EINVAL);
    q = (struct tdm_batch_seq){.tokens = t,
                               .n_tokens = 3,
                               .pos0 = 14,
                               .pages = pages,
                               .n_pages = 4,
                               .n_logits = 1}; /* needs 5 pages */
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_EINVAL);
    q = (struct tdm_batch_seq){
        .tokens = t, .n_tokens = 3, .pages = bad_pages, .n_pages = 2, .n_logits = 1};
    q.pos0 = 4;
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_EINVAL); /* page 64 not in pool */
    q = (struct tdm_batch_seq){
        .tokens = t, .n_tokens = 3, .pages = pages, .n_pages = 6, .n_logits = 4};
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_EINVAL);
    q.n_logits = 1;
    q.pos0 = 255; /* past the context */
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_ERANGE);
    b.n_seqs = 0;
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_EINVAL);
    b.n_seqs = 9;
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_ERANGE);
    /* and a valid call still works */
    b.n_seqs = 1;
    q.pos0 = 0;
    assert_int_equal(tdm_engine_forward(e, &b, out, NULL), TDM_OK);
    tdm_engine_destroy(e);
    tdm_engine_destroy(NULL);
    /* a head_dim no backend supports is refused at creation, not asserted on later */
    m.cfg.head_dim = TDM_MAX_HEAD_DIM + 2;
    struct tdm_engine_opts o = {.n_threads = 1, .kv_pages = 4};
    assert_int_equal(tdm_engine_create(&m, &o, &e), TDM_EUNSUPPORTED);
    free_model();
}

/* forward_sample on a backend without a device sampler (the CPU) samples each logit row on the
 * host: the same tokens and log-probabilities as forward followed by tdm_sample_row_host. */
static void test_forward_sample_host(void **s)
{
    (void)s;
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_F32, TDM_ARCH_LLAMA);
    tdm_engine_t *e = make_engine(&m, 1, false);
    assert_false(tdm_engine_samples_on_device(e));
    int32_t pa[6] = {0, 1, 2, 3, 4, 5}, pb[6] = {6, 7, 8, 9, 10, 11};
    int32_t ta[9], tb[5];
    for (int i = 0; i < 9; i++)
        ta[i] = (i * 5 + 2) % VOCAB;
    for (int i = 0; i < 5; i++)
        tb[i] = (i * 11 + 7) % VOCAB;
    struct tdm_batch_seq q[2] = {
        {.tokens = ta, .n_tokens = 9, .pages = pa, .n_pages = 6, .n_logits = 1},
        {.tokens = tb, .n_tokens = 5, .pages = pb, .n_pages = 6, .n_logits = 1},
    };
    struct tdm_batch b = {q, 2};
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = 1.5f;
    p.top_p = 0.8f;
    p.seed = 99;
    struct tdm_sampler smp[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(tdm_sampler_init(&smp[i], &p, 10 + (uint64_t)i, VOCAB), TDM_OK);
    struct tdm_sample_row rows[2] = {{.smp = &smp[0], .position = 9, .n_top = 3},
                                     {.smp = &smp[1], .position = 5, .n_top = -1}};
    assert_int_equal(tdm_engine_forward_sample(e, &b, rows, NULL), TDM_OK);
    /* again with logits, on fresh pages of a second engine, sampled here */
    tdm_engine_t *e2 = make_engine(&m, 1, false);
    float logits[2 * VOCAB];
    assert_int_equal(tdm_engine_forward(e2, &b, logits, NULL), TDM_OK);
    struct tdm_sample_scratch sc;
    assert_int_equal(tdm_sample_scratch_init(&sc, VOCAB), TDM_OK);
    for (int i = 0; i < 2; i++) {
        struct tdm_sample_row ref = {
            .smp = &smp[i], .position = rows[i].position, .n_top = rows[i].n_top};
        tdm_sample_row_host(&ref, logits + i * VOCAB, &sc);
        assert_int_equal(rows[i].token, ref.token);
        assert_true(rows[i].logprob == ref.logprob);
        for (int j = 0; j < ref.n_top; j++) {
            assert_int_equal(rows[i].top_ids[j], ref.top_ids[j]);
            assert_true(rows[i].top_lps[j] == ref.top_lps[j]);
        }
    }
    assert_true(rows[0].logprob < 0.0f && rows[0].top_lps[0] >= rows[0].top_lps[2]);
    tdm_sample_scratch_free(&sc);
    for (int i = 0; i < 2; i++)
        tdm_sampler_free(&smp[i]);
    tdm_engine_destroy(e2);
    tdm_engine_destroy(e);
    free_model();
}

/* tdm_engine_run: each row gets only what it wants (logits, hidden state, a sample), and
 * explicit KV slots equal to the page table's give the same logits as derived ones. */
static void test_run_rows_and_slots(void **s)
{
    (void)s;
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_F32, TDM_ARCH_LLAMA);
    tdm_engine_t *e = make_engine(&m, 1, false), *e2 = make_engine(&m, 1, false);
    int32_t pa[6] = {3, 1, 4, 0, 5, 2}, pb[6] = {6, 7, 8, 9, 10, 11};
    int32_t ta[9], tb[5], slots[9];
    for (int i = 0; i < 9; i++) {
        ta[i] = (i * 5 + 2) % VOCAB;
        slots[i] = pa[i / 4] * 4 + i % 4; /* page size 4 */
    }
    for (int i = 0; i < 5; i++)
        tb[i] = (i * 11 + 7) % VOCAB;
    /* reference: all three rows' logits and hidden states, slots derived, on engine 2 */
    struct tdm_batch_seq q[2] = {
        {.tokens = ta, .n_tokens = 9, .pages = pa, .n_pages = 6, .n_logits = 2},
        {.tokens = tb, .n_tokens = 5, .pages = pb, .n_pages = 6, .n_logits = 1},
    };
    struct tdm_batch b = {q, 2};
    float ref[3 * VOCAB], ref_h[3 * 64];
    assert_int_equal(tdm_engine_forward(e2, &b, ref, ref_h), TDM_OK);
    int d = m.cfg.d_model;
    assert_true(d <= 64);

    /* row 0: logits only; row 1: hidden only; row 2: a sample and its logits */
    q[0].slots = slots;
    float lg[3 * VOCAB], hid[3 * 64];
    for (int i = 0; i < 3 * VOCAB; i++)
        lg[i] = -7.0f;
    for (int i = 0; i < 3 * 64; i++)
        hid[i] = -7.0f;
    uint8_t want[3] = {TDM_ROW_LOGITS, TDM_ROW_HIDDEN, TDM_ROW_SAMPLE | TDM_ROW_LOGITS};
    struct tdm_sampler smp;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, VOCAB), TDM_OK);
    struct tdm_sample_row rows[3] = {
        {.token = -1}, {.token = -1}, {.smp = &smp, .position = 5, .n_top = -1, .token = -1}};
    struct tdm_engine_out out = {.want = want, .samples = rows, .logits = lg, .hidden = hid};
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_OK);
    for (int v = 0; v < VOCAB; v++) {
        assert_true(lg[v] == ref[v]);                         /* row 0 */
        assert_true(lg[VOCAB + v] == -7.0f);                  /* row 1: untouched */
        assert_true(lg[2 * VOCAB + v] == ref[2 * VOCAB + v]); /* row 2, before sampling */
    }
    for (int i = 0; i < d; i++) {
        assert_true(hid[i] == -7.0f);
        assert_true(hid[d + i] == ref_h[d + i]);
        assert_true(hid[2 * d + i] == -7.0f);
    }
    assert_int_equal(rows[0].token, -1);
    assert_int_equal(rows[1].token, -1);
    int best = 0;
    for (int v = 1; v < VOCAB; v++)
        if (ref[2 * VOCAB + v] > ref[2 * VOCAB + best]) best = v;
    assert_int_equal(rows[2].token, best);

    /* a row wanting what it has no buffer for, and a slot outside the pool */
    out.hidden = NULL;
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_EINVAL);
    out.hidden = hid;
    slots[3] = 64 * 4;
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_EINVAL);
    slots[3] = -1;
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_EINVAL);
    tdm_sampler_free(&smp);
    tdm_engine_destroy(e2);
    tdm_engine_destroy(e);
    free_model();
}

static void test_rope_llama3(void **s)
{
    (void)s;
    /* Llama 3.1 scaling, computed by hand for head_dim 8: wavelengths 2*pi*theta^(2i/8) */
    struct tdm_model_config c = {.head_dim = 8,
                                 .rope_theta = 500000.0f,
                                 .rope_scaling = TDM_ROPE_SCALING_LLAMA3,
                                 .rope_factor = 8.0f,
                                 .rope_low_freq_factor = 1.0f,
                                 .rope_high_freq_factor = 4.0f,
                                 .rope_original_max_ctx = 8192};
    float f[4];
    tdm_rope_inv_freq(&c, NULL, f);
    for (int i = 0; i < 4; i++) {
        double base = 1.0 / pow(500000.0, 2.0 * i / 8.0), wl = 2 * M_PI / base, want;
        if (wl < 8192 / 4.0)
            want = base;
        else if (wl > 8192 / 1.0)
            want = base / 8;
        else {
            double sm = (8192 / wl - 1.0) / 3.0;
            want = (1 - sm) * base / 8 + sm * base;
        }
        assert_true(fabs(f[i] - want) <= 1e-6 * want);
    }
    float factors[4] = {1, 2, 4, 8};
    c.rope_scaling = TDM_ROPE_SCALING_NONE;
    tdm_rope_inv_freq(&c, factors, f);
    assert_true(fabs(f[3] - 1.0 / pow(500000.0, 0.75) / 8) < 1e-9);
}

/* An early-exit pass (out.n_layers = N) gives what a model of those N layers gives: the same
 * logits and hidden states bit for bit, on a second engine over a model that holds only the
 * first N layers (the same weights); and 0 or more layers than the model are refused or mean
 * "all". */
static void test_early_exit(void **s)
{
    (void)s;
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_F32, TDM_ARCH_LLAMA);
    assert_true(NL >= 2);
    struct tdm_model cut = m;
    cut.cfg.n_layers = 1;
    tdm_engine_t *e = make_engine(&m, 1, false), *e1 = make_engine(&cut, 1, false);
    int32_t pages[6] = {0, 1, 2, 3, 4, 5}, t[9];
    for (int i = 0; i < 9; i++)
        t[i] = (i * 7 + 3) % VOCAB;
    struct tdm_batch_seq q = {
        .tokens = t, .n_tokens = 9, .pages = pages, .n_pages = 6, .n_logits = 3};
    struct tdm_batch b = {&q, 1};
    float lg[3 * VOCAB], ref[3 * VOCAB], hid[3 * 64], ref_h[3 * 64], full[3 * VOCAB];
    assert_int_equal(tdm_engine_forward(e1, &b, ref, ref_h), TDM_OK);
    struct tdm_engine_out out = {.logits = lg, .hidden = hid, .n_layers = 1};
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_OK);
    assert_memory_equal(lg, ref, sizeof(lg));
    assert_memory_equal(hid, ref_h, (size_t)3 * m.cfg.d_model * sizeof(float));
    /* the full pass differs (it has more layers), and n_layers = NL is the full pass */
    assert_int_equal(tdm_engine_forward(e, &b, full, NULL), TDM_OK);
    assert_memory_not_equal(full, ref, sizeof(full));
    out = (struct tdm_engine_out){.logits = lg, .n_layers = NL};
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_OK);
    assert_memory_equal(lg, full, sizeof(lg));
    out.n_layers = NL + 1;
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_EINVAL);
    tdm_engine_destroy(e);
    tdm_engine_destroy(e1);
    free_model();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariance_f32),     cmocka_unit_test(test_invariance_bf16_qwen2),
        cmocka_unit_test(test_invariance_qwen3),   cmocka_unit_test(test_validation),
        cmocka_unit_test(test_rope_llama3),        cmocka_unit_test(test_forward_sample_host),
        cmocka_unit_test(test_run_rows_and_slots), cmocka_unit_test(test_early_exit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
