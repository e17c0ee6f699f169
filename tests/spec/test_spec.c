/*
 * Speculative decoding (src/spec) on the real engine and scheduler, over tiny random models:
 *   - exact acceptance is lossless: every request's tokens equal those of the same request
 *     decoded without speculation, over many seeds and sampling settings (greedy, T = 0.8,
 *     top-k, top-p, min-p, every penalty), for the self drafter at 1 layer and at all layers
 *     (the model drafting for itself), several requests at once, with fixed and adaptive k;
 *   - the model drafting for itself has every draft kept, at T = 0 and at T > 0 (the coupled
 *     draw: draft and target draw from the same keyed uniform);
 *   - preemption in the middle (a pool too small for every request at once) and cancels leave
 *     the output unchanged and the KV pool at its baseline;
 *   - a request can turn speculation off (spec_k < 0) or cap it;
 *   - the controller: with costs like a GPU's (verify nearly flat in tokens, cheap drafts) it
 *     drafts for a drafter that agrees and not for one that never does; with costs like a
 *     CPU's (verify cost in proportion to tokens, a draft pass as dear as a decode) it drafts
 *     nothing even for a perfect drafter, since that could only be slower.
 * The reference for "without speculation" is the same scheduler with no drafter, which the
 * engine tests check against the independent numpy forward pass.
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

#include "lib/tiny_model.h"
#include "spec/spec_int.h"
#include "tandem/engine.h"
#include "tandem/sched.h"
#include "tandem/spec.h"

enum { NL = 4, VOCAB = 64, MAX_OUT = 40, N_REQ = 4 };

static struct tdm_test_model tiny;

static void make_model_v(uint64_t seed, int vocab)
{
    struct tdm_test_model_opts o = {.arch = TDM_ARCH_LLAMA,
                                    .dtype = TDM_DTYPE_F32,
                                    .n_layers = NL,
                                    .d_model = 32,
                                    .n_heads = 4,
                                    .n_kv_heads = 2,
                                    .head_dim = 8,
                                    .d_ff = 64,
                                    .vocab = vocab,
                                    .max_ctx = 256,
                                    .rope_neox = true,
                                    .seed = seed};
    tdm_test_model_make(&tiny, &o);
}

static void make_model(uint64_t seed)
{
    make_model_v(seed, VOCAB);
}

/* An engine whose pool also holds `draft`'s layers (group 1), for the draft-model drafter. */
static tdm_engine_t *make_engine_for(int64_t kv_pages, const struct tdm_model *draft)
{
    struct tdm_kv_group g;
    tdm_spec_kv_group(draft, &g);
    struct tdm_engine_opts o = {.n_threads = 1,
                                .batch_invariant = true,
                                .page_size = 4,
                                .kv_pages = kv_pages,
                                .max_batch_tokens = 128,
                                .max_seqs = 8,
                                .max_logit_rows = 8 * (1 + TDM_SPEC_AUTO_K),
                                .kv_extra = &g,
                                .n_kv_extra = 1};
    tdm_engine_t *e = NULL;
    assert_int_equal(tdm_engine_create(&tiny.m, &o, &e), TDM_OK);
    return e;
}

static tdm_engine_t *make_engine(int64_t kv_pages)
{
    struct tdm_engine_opts o = {.n_threads = 1,
                                .batch_invariant = true,
                                .page_size = 4,
                                .kv_pages = kv_pages,
                                .max_batch_tokens = 128,
                                .max_seqs = 8,
                                .max_logit_rows = 8 * (1 + TDM_SPEC_AUTO_K)};
    tdm_engine_t *e = NULL;
    assert_int_equal(tdm_engine_create(&tiny.m, &o, &e), TDM_OK);
    return e;
}

struct run_cfg {
    struct tdm_sampling_params sp;
    int n_req;
    int spec_k[N_REQ]; /* per request */
    int cancel_at;     /* request 0 is cancelled after this many steps (0: never) */
    int32_t prompts[N_REQ][12];
};

struct run_out {
    int32_t tokens[N_REQ][MAX_OUT];
    int n_out[N_REQ];
    enum tdm_finish finish[N_REQ];
    struct tdm_spec_stats st;
    int64_t preemptions;
};

/* Runs the requests to the end on engine e, with speculation `so` (NULL: none). */
static void run(tdm_engine_t *e, const struct tdm_spec_opts *so, const struct run_cfg *c,
                struct run_out *out)
{
    memset(out, 0, sizeof *out);
    tdm_kv_pool_t *kv = tdm_engine_kv(e);
    int64_t base_free = tdm_kv_pool_stats(kv).free;
    struct tdm_sched_opts sched_o = {.max_batch_tokens = 64, .watermark_pages = -1};
    tdm_sched_t *s = NULL;
    assert_int_equal(tdm_sched_create(e, NULL, &sched_o, &s), TDM_OK);
    tdm_spec_t *sp = NULL;
    if (so) {
        assert_int_equal(tdm_spec_create(e, so, &sp), TDM_OK);
        assert_int_equal(tdm_spec_attach(sp, s), TDM_OK);
    }
    tdm_req_t *r[N_REQ] = {0};
    for (int i = 0; i < c->n_req; i++) {
        struct tdm_req_params p = {.prompt = c->prompts[i],
                                   .n_prompt = 12,
                                   .max_tokens = MAX_OUT,
                                   .ignore_eos = true,
                                   .sampling = c->sp,
                                   .top_logprobs = -1,
                                   .spec_k = c->spec_k[i]};
        p.sampling.seed = c->sp.seed + (uint64_t)i;
        assert_int_equal(tdm_sched_submit(s, &p, &r[i]), TDM_OK);
    }
    for (int step = 1; step < 2000; step++) {
        bool live = false;
        for (int i = 0; i < c->n_req; i++)
            live |= tdm_req_state(r[i]) != TDM_REQ_FINISHED;
        if (!live) break;
        if (step == c->cancel_at) tdm_req_cancel(r[0]);
        tdm_sched_step(s);
    }
    for (int i = 0; i < c->n_req; i++) {
        struct tdm_req_view v;
        tdm_req_lock(r[i], &v);
        out->n_out[i] = v.n_out;
        out->finish[i] = v.finish;
        memcpy(out->tokens[i], v.tokens, (size_t)v.n_out * sizeof(int32_t));
        tdm_req_unlock(r[i]);
        tdm_req_release(r[i]);
    }
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(s, &m);
    out->preemptions = (int64_t)m.preemptions;
    if (sp) tdm_spec_get_stats(sp, &out->st);
    tdm_sched_destroy(s);
    tdm_spec_destroy(sp);
    /* every page back: rejections, trims, cancels and preemptions leak nothing */
    assert_int_equal(tdm_kv_pool_stats(kv).free, base_free);
}

static void make_prompts(struct run_cfg *c, uint64_t seed)
{
    uint64_t st = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < N_REQ; i++)
        for (int j = 0; j < 12; j++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            c->prompts[i][j] = (int32_t)((st >> 33) % VOCAB);
        }
}

static void expect_same(const struct run_out *a, const struct run_out *b, int n_req,
                        const char *what)
{
    for (int i = 0; i < n_req; i++) {
        if (a->n_out[i] != b->n_out[i] ||
            memcmp(a->tokens[i], b->tokens[i], (size_t)a->n_out[i] * sizeof(int32_t))) {
            print_error("%s: request %d differs with speculation\n", what, i);
            fail();
        }
        assert_int_equal(a->finish[i], b->finish[i]);
    }
}

static struct tdm_sampling_params settings(int which, uint64_t seed)
{
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.seed = seed;
    switch (which) {
    case 0: /* greedy */
        break;
    case 1:
        p.temperature = 0.8f;
        break;
    case 2:
        p.temperature = 1.0f;
        p.top_k = 8;
        p.top_p = 0.9f;
        break;
    case 3:
        p.temperature = 0.7f;
        p.min_p = 0.05f;
        p.repetition_penalty = 1.3f;
        break;
    default:
        p.temperature = 1.2f;
        p.presence_penalty = 0.8f;
        p.frequency_penalty = 0.5f;
        p.top_p = 0.95f;
        break;
    }
    return p;
}

/* Exact mode: the same tokens as without speculation, for every setting and both extremes of
 * the self drafter, fixed and adaptive k. */
static void test_exact_is_lossless(void **state)
{
    (void)state;
    make_model(11);
    tdm_engine_t *e = make_engine(256);
    int checks = 0;
    for (int which = 0; which < 5; which++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            struct run_cfg c = {.sp = settings(which, seed * 7), .n_req = N_REQ};
            make_prompts(&c, seed + 10 * (uint64_t)which);
            struct run_out ref, got;
            run(e, NULL, &c, &ref);
            const int layers[] = {1, NL};
            const int ks[] = {3, 0};
            for (int li = 0; li < 2; li++)
                for (int ki = 0; ki < 2; ki++) {
                    struct tdm_spec_opts so = {
                        .method = TDM_SPEC_SELF, .self_layers = layers[li], .k = ks[ki]};
                    run(e, &so, &c, &got);
                    char what[96];
                    snprintf(what, sizeof what, "setting %d seed %llu layers %d k %d", which,
                             (unsigned long long)seed, layers[li], ks[ki]);
                    expect_same(&got, &ref, c.n_req, what);
                    if (ks[ki]) assert_true(got.st.drafted > 0);
                    /* the model drafting for itself: every draft is kept, at any temperature */
                    if (layers[li] == NL) assert_int_equal(got.st.accepted, got.st.drafted);
                    checks++;
                }
            if (which == 0) { /* greedy: rejection acceptance gives the same tokens too */
                struct tdm_spec_opts so = {.method = TDM_SPEC_SELF,
                                           .self_layers = 1,
                                           .k = 3,
                                           .accept = TDM_SPEC_ACCEPT_REJECTION};
                run(e, &so, &c, &got);
                expect_same(&got, &ref, c.n_req, "greedy, rejection acceptance");
            }
        }
    assert_int_equal(checks, 5 * 3 * 4);
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

/* A pool too small for all four requests: preemptions happen mid-speculation; a cancel in the
 * middle; per-request caps. Outputs equal the runs without speculation. */
static void test_preempt_cancel_and_caps(void **state)
{
    (void)state;
    make_model(12);
    tdm_engine_t *e = make_engine(30); /* 4 requests of up to 52 tokens need 52 pages */
    struct run_cfg c = {.sp = settings(1, 5), .n_req = N_REQ};
    make_prompts(&c, 99);
    struct run_out ref, got;
    run(e, NULL, &c, &ref);
    assert_true(ref.preemptions > 0);
    struct tdm_spec_opts so = {.method = TDM_SPEC_SELF, .self_layers = NL, .k = 4};
    run(e, &so, &c, &got);
    assert_true(got.preemptions > 0);
    expect_same(&got, &ref, c.n_req, "with preemptions");
    assert_true(got.st.accepted > 0);

    /* request 1 speculates not at all, request 2 at most one token a step */
    c.spec_k[1] = -1;
    c.spec_k[2] = 1;
    run(e, &so, &c, &got);
    expect_same(&got, &ref, c.n_req, "with per-request caps");

    /* request 0 cancelled mid-way: the others are unchanged, and the pool is whole (run) */
    c.cancel_at = 9;
    run(e, &so, &c, &got);
    assert_int_equal(got.finish[0], TDM_FINISH_CANCELLED);
    for (int i = 1; i < N_REQ; i++) {
        assert_int_equal(got.n_out[i], ref.n_out[i]);
        assert_memory_equal(got.tokens[i], ref.tokens[i], (size_t)ref.n_out[i] * sizeof(int32_t));
    }
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

/* ---- the controller, on costs given to it ---- */
static void feed_costs(struct tdm_spec_ctl *c, double va, double vb, double da, double db)
{
    for (int i = 0; i < 64; i++) {
        int t = 1 + i % 32;
        tdm_spec_cost_observe(&c->verify, t, va + vb * t);
        int n = 1 + i % 8;
        tdm_spec_cost_observe(&c->draft, n, da + db * n);
    }
    c->warmup = 0;
}

/* n requests decoding, each with an acceptance record of `rate` at every position (and the
 * batch-wide prior learnt the same); returns the total k chosen. */
static int choose(struct tdm_spec_ctl *c, int n, float rate)
{
    for (int j = 0; j < TDM_SPEC_MAX_K; j++)
        c->prior[j] = rate;
    struct tdm_draft_stats st[8];
    struct tdm_sched_draft d[8];
    for (int i = 0; i < n; i++) {
        st[i] = (struct tdm_draft_stats){.steps = 100};
        for (int j = 0; j < TDM_SPEC_MAX_K; j++) {
            st[i].reached[j] = 50;
            st[i].kept[j] = 50 * rate;
        }
        d[i] = (struct tdm_sched_draft){.stats = &st[i], .k = 8, .cap = 8};
    }
    tdm_spec_ctl_choose(c, d, n, n);
    int total = 0;
    for (int i = 0; i < n; i++) {
        assert_true(d[i].k >= 0 && d[i].k <= 8);
        total += d[i].k;
    }
    return total;
}

static void test_controller(void **state)
{
    (void)state;
    struct tdm_spec_ctl c;
    /* GPU-like: a 10 ms verify that grows 0.02 ms a token; a 0.3 ms draft pass */
    assert_int_equal(tdm_spec_ctl_init(&c, 8), TDM_OK);
    feed_costs(&c, 10e6, 0.02e6, 0.3e6, 0.01e6);
    assert_true(choose(&c, 1, 0.9f) >= 4);    /* a drafter that agrees: long drafts */
    assert_true(choose(&c, 8, 0.9f) >= 16);   /* at batch 8 too */
    assert_int_equal(choose(&c, 1, 0.0f), 0); /* one that never agrees: none */
    assert_int_equal(choose(&c, 8, 0.0f), 0);
    int mid = choose(&c, 1, 0.5f), high = choose(&c, 1, 0.95f);
    assert_true(mid <= high); /* better acceptance never drafts less */
    tdm_spec_ctl_free(&c);

    /* CPU-like: verify cost in proportion to tokens (8 ms each), a draft pass as dear as a
     * decode: even a perfect drafter cannot win, so nothing is drafted */
    assert_int_equal(tdm_spec_ctl_init(&c, 8), TDM_OK);
    feed_costs(&c, 0, 8e6, 0, 8e6);
    assert_int_equal(choose(&c, 1, 1.0f), 0);
    assert_int_equal(choose(&c, 8, 1.0f), 0);
    /* but a draft pass 1/10 of a decode with flat-ish verify pays */
    tdm_spec_ctl_free(&c);
    assert_int_equal(tdm_spec_ctl_init(&c, 8), TDM_OK);
    feed_costs(&c, 8e6, 0.5e6, 0.8e6, 0.05e6);
    assert_true(choose(&c, 1, 0.9f) > 0);
    tdm_spec_ctl_free(&c);

    /* a request idle for 32, 64, ... steps probes with one token, and not in between */
    assert_int_equal(tdm_spec_ctl_init(&c, 8), TDM_OK);
    feed_costs(&c, 10e6, 0.02e6, 0.3e6, 0.01e6);
    struct tdm_draft_stats st = {.idle_steps = 32};
    for (int j = 0; j < TDM_SPEC_MAX_K; j++) {
        st.reached[j] = 50; /* never kept, here or anywhere */
        c.prior[j] = 0;
    }
    struct tdm_sched_draft d = {.stats = &st, .k = 8, .cap = 8};
    tdm_spec_ctl_choose(&c, &d, 1, 1);
    assert_int_equal(d.k, 1);
    st.idle_steps = 33;
    d.k = 8;
    tdm_spec_ctl_choose(&c, &d, 1, 1);
    assert_int_equal(d.k, 0);
    tdm_spec_ctl_free(&c);
}

/* ---- the gate: measured results overrule the cost model ---- */
static bool gate_step(struct tdm_spec_gate *g, int n, int tokens_off, int tokens_on, bool mixed)
{
    bool a = tdm_spec_gate_begin(g, n);
    tdm_spec_gate_planned(g, a, n + (a ? n : 0));
    tdm_spec_gate_time(g, 1000);
    tdm_spec_gate_ran(g, n + (a ? n : 0) + (mixed ? 5 : 0));
    tdm_spec_gate_tokens(g, a ? tokens_on : tokens_off);
    return a;
}

static void test_gate(void **state)
{
    (void)state;
    /* drafting measures slower: after the baseline and a few tries, off, with exploration
     * steps thinning out (32, 64, 128, ...) */
    struct tdm_spec_gate g = {0};
    int on = 0;
    for (int i = 0; i < 600; i++)
        on += gate_step(&g, 4, 10, 5, false);
    assert_true(on >= 3 && on <= 3 + 7);
    /* once drafting measured losing, every step says so, exploring ones too: a head parks its
     * rows on each and drops a request whose rows overflow, whichever step that falls on */
    g = (struct tdm_spec_gate){0};
    int explored = 0;
    for (int i = 0; i < 600; i++) {
        bool a = gate_step(&g, 4, 10, 5, false);
        if (i < 4) {
            assert_false(g.losing); /* the baseline, then the first tries */
        } else {
            assert_true(g.losing);
            explored += a;
        }
    }
    assert_true(explored >= 1);
    /* a bucket that starts off because a smaller one lost: its explorations are losing too */
    g = (struct tdm_spec_gate){0};
    for (int i = 0; i < 40; i++)
        gate_step(&g, 1, 10, 5, false);
    explored = 0;
    for (int i = 0; i < 200; i++) {
        bool a = gate_step(&g, 16, 10, 5, false);
        if (g.arm[4][1].n < 2 && g.arm[4][0].n >= 2) {
            assert_true(g.losing);
            explored += a;
        }
    }
    assert_true(explored >= 1);
    /* a drafting step 50 times dearer: after the first tries, exploring is spaced so that it
     * costs at most 1% (an interval of at least 100 * 49 steps) */
    g = (struct tdm_spec_gate){0};
    on = 0;
    for (int i = 0; i < 6000; i++)
        on += gate_step(&g, 4, 50, 1, false);
    assert_true(on >= 2 && on <= 4);
    /* faster: on nearly always, with a baseline refresh in 32 */
    g = (struct tdm_spec_gate){0};
    on = 0;
    for (int i = 0; i < 600; i++)
        on += gate_step(&g, 4, 10, 20, false);
    assert_true(on >= 600 - 3 - 600 / 30 && on < 600);
    /* buckets are separate: batch 1 may lose while batch 16 wins */
    g = (struct tdm_spec_gate){0};
    int on1 = 0, on16 = 0;
    for (int i = 0; i < 400; i++) {
        on1 += gate_step(&g, 1, 10, 5, false);
        on16 += gate_step(&g, 16, 10, 20, false);
    }
    assert_true(on1 <= 12 && on16 >= 350);
    /* a larger batch after a smaller one lost: it starts off and only explores */
    g = (struct tdm_spec_gate){0};
    for (int i = 0; i < 40; i++)
        gate_step(&g, 1, 10, 5, false);
    on16 = 0;
    for (int i = 0; i < 40; i++)
        on16 += gate_step(&g, 16, 10, 5, false);
    assert_true(on16 <= 1);
    /* steps with prefill chunks are not counted: only the baseline's first steps happen */
    g = (struct tdm_spec_gate){0};
    on = 0;
    for (int i = 0; i < 100; i++)
        on += gate_step(&g, 2, 10, 20, true);
    assert_int_equal(on, 0);
    assert_int_equal(g.arm[1][0].n, 0);
}

static void test_cost_fit(void **state)
{
    (void)state;
    struct tdm_spec_cost c = {0};
    double a, b;
    assert_false(tdm_spec_cost_fit(&c, &a, &b));
    tdm_spec_cost_observe(&c, 4, 400);
    assert_true(tdm_spec_cost_fit(&c, &a, &b)); /* one x: in proportion */
    assert_true(a == 0 && b == 100);
    for (int i = 1; i <= 20; i++)
        tdm_spec_cost_observe(&c, i, 1000 + 10.0 * i);
    assert_true(tdm_spec_cost_fit(&c, &a, &b));
    /* the early point weighs little after twenty exact ones */
    assert_true(b > 8 && b < 30);
    assert_true(a > 700 && a < 1100);
}

static void test_options(void **state)
{
    (void)state;
    enum tdm_spec_method m;
    enum tdm_spec_accept a;
    int k;
    bool off;
    assert_int_equal(tdm_spec_method_parse("self", &m), TDM_OK);
    assert_int_equal(m, TDM_SPEC_SELF);
    assert_int_equal(tdm_spec_method_parse("selff", &m), TDM_EINVAL);
    assert_int_equal(tdm_spec_accept_parse("rejection", &a), TDM_OK);
    assert_int_equal(tdm_spec_accept_parse("", &a), TDM_EINVAL);
    assert_int_equal(tdm_spec_k_parse("auto", &k, &off), TDM_OK);
    assert_true(k == 0 && !off);
    assert_int_equal(tdm_spec_k_parse("0", &k, &off), TDM_OK);
    assert_true(off);
    assert_int_equal(tdm_spec_k_parse("5", &k, &off), TDM_OK);
    assert_int_equal(k, 5);
    assert_int_equal(tdm_spec_k_parse("17", &k, &off), TDM_EINVAL);
    assert_int_equal(tdm_spec_k_parse("3x", &k, &off), TDM_EINVAL);
    assert_int_equal(tdm_spec_k_parse("-1", &k, &off), TDM_EINVAL);
    make_model(3);
    tdm_engine_t *e = make_engine(64);
    tdm_spec_t *sp = NULL;
    struct tdm_spec_opts so = {.method = TDM_SPEC_SELF, .self_layers = NL + 1};
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    so = (struct tdm_spec_opts){.method = TDM_SPEC_DRAFT}; /* no draft model given */
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    so.draft_model = &tiny.m; /* the pool has no layer group for it */
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    so = (struct tdm_spec_opts){.method = TDM_SPEC_SELF, .accept = 7};
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    so = (struct tdm_spec_opts){.method = TDM_SPEC_SELF, .k = TDM_SPEC_MAX_K + 1};
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    assert_null(sp);
    so = (struct tdm_spec_opts){.method = TDM_SPEC_SELF};
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_OK);
    char d[160];
    tdm_spec_describe(sp, d, sizeof d);
    assert_non_null(strstr(d, "self (1 layers of 4)"));
    struct tdm_spec_stats st = {.drafted = 4, .accepted = 3, .target_steps = 2, .tokens = 5};
    st.drafted_at[0] = 2;
    st.accepted_at[0] = 2;
    st.drafted_at[1] = 2;
    st.accepted_at[1] = 1;
    char json[512];
    tdm_spec_stats_json(&st, json, sizeof json);
    assert_string_equal(json, "{\"drafted\":4,\"accepted\":3,\"target_steps\":2,\"tokens\":5,"
                              "\"tau\":2.5000,\"accept_by_position\":[1.0000,0.5000]}");
    tdm_spec_destroy(sp);
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

/* ---- rejection acceptance reproduces the target's distribution ----
 * A vocabulary of 8, a fixed 6-token prompt, 3 tokens per request, each request its own seed.
 * The first output comes from the prompt's step; the next two come out of speculation (k = 2
 * drafts a step from a 1-layer self drafter, whose distribution differs a lot from the
 * target's). Their joint distribution, marginal over the first output, is computed exactly
 * from the target's logits (64 prefixes through the engine, softmax at the temperature and
 * top-k here, in double precision) and compared with the counts by Pearson's chi-squared at
 * significance 0.001 (bins with fewer than 5 expected draws pooled).
 * The number of draws: N = 20000. A sampler off by total variation d shifts the statistic's
 * mean by at least N (2d)^2 (Cauchy-Schwarz: sum D^2/p >= (sum |D|)^2), 72 for d = 0.03,
 * against a critical value near dof + 3.1 sqrt(2 dof) (~95 for 63 degrees): such a sampler
 * fails with probability > 0.9, while a correct one passes 999 times in 1000 (the seeds are
 * fixed, so the result is reproducible). The test also shows its power: the same counts
 * against the draft's own joint distribution (what a verifier keeping every draft would give)
 * are rejected. */
enum { CV = 8, CHI_N = 20000, CHI_BATCH = 8 };

static void softmax_ref(const float *lg, double temp, int top_k, double *p)
{
    double mx = -1e300;
    for (int v = 0; v < CV; v++)
        mx = lg[v] > mx ? lg[v] : mx;
    double sum = 0;
    for (int v = 0; v < CV; v++)
        sum += (p[v] = exp((lg[v] - mx) / temp));
    for (int v = 0; v < CV; v++)
        p[v] /= sum;
    if (top_k > 0 && top_k < CV) { /* keep the top_k most likely (ties: lower id), renormalise */
        double kept = 0;
        bool keep[CV] = {0};
        for (int r = 0; r < top_k; r++) {
            int best = -1;
            for (int v = 0; v < CV; v++)
                if (!keep[v] && (best < 0 || p[v] > p[best])) best = v;
            keep[best] = true;
            kept += p[best];
        }
        for (int v = 0; v < CV; v++)
            p[v] = keep[v] ? p[v] / kept : 0;
    }
}

/* The next-token distribution after `prefix` (n tokens), through n_layers layers. */
static void next_dist(tdm_engine_t *e, const int32_t *prefix, int n, int n_layers, double temp,
                      int top_k, double *p)
{
    int32_t pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    struct tdm_batch_seq q = {
        .tokens = prefix, .n_tokens = n, .pages = pages, .n_pages = 8, .n_logits = 1};
    struct tdm_batch b = {&q, 1};
    float lg[CV];
    struct tdm_engine_out out = {.logits = lg, .n_layers = n_layers};
    assert_int_equal(tdm_engine_run(e, &b, &out), TDM_OK);
    softmax_ref(lg, temp, top_k, p);
}

/* joint[a * CV + b]: P(second output a, third output b), marginal over the first. */
static void joint_ref(tdm_engine_t *e, const int32_t *prompt, int n_layers, double temp, int top_k,
                      double *joint)
{
    int32_t pre[9];
    memcpy(pre, prompt, 6 * sizeof *pre);
    double p1[CV], p2[CV], p3[CV];
    next_dist(e, pre, 6, NL, temp, top_k, p1); /* the first output: always the target's */
    memset(joint, 0, CV * CV * sizeof *joint);
    for (int t1 = 0; t1 < CV; t1++) {
        if (p1[t1] == 0) continue;
        pre[6] = t1;
        next_dist(e, pre, 7, n_layers, temp, top_k, p2);
        for (int t2 = 0; t2 < CV; t2++) {
            if (p2[t2] == 0) continue;
            pre[7] = t2;
            next_dist(e, pre, 8, n_layers, temp, top_k, p3);
            for (int t3 = 0; t3 < CV; t3++)
                joint[t2 * CV + t3] += p1[t1] * p2[t2] * p3[t3];
        }
    }
}

/* Pearson's statistic of counts against probabilities (bins under 5 expected draws pooled);
 * *crit: the 0.001 critical value (Wilson-Hilferty). */
static double chi2(const int *counts, const double *p, int n_cells, int n, double *crit)
{
    double stat = 0, pool_e = 0, pool_o = 0;
    int bins = 0;
    for (int i = 0; i < n_cells; i++) {
        double e = p[i] * n;
        if (e < 5) {
            pool_e += e;
            pool_o += counts[i];
            continue;
        }
        stat += (counts[i] - e) * (counts[i] - e) / e;
        bins++;
    }
    if (pool_e > 0) {
        stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        bins++;
    }
    double k = bins - 1, z = 3.0902;
    *crit = k * pow(1 - 2 / (9 * k) + z * sqrt(2 / (9 * k)), 3);
    return stat;
}

static void check_rejection_distribution(double temp, int top_k)
{
    make_model_v(21, CV);
    tdm_engine_t *e = make_engine(512);
    const int32_t prompt[6] = {3, 1, 4, 1, 5, 2};
    double joint[CV * CV], draft_joint[CV * CV];
    joint_ref(e, prompt, NL, temp, top_k, joint);
    joint_ref(e, prompt, 1, temp, top_k, draft_joint);
    int counts[CV * CV] = {0};
    /* the first requests' outputs without speculation: rejection acceptance must differ from
     * them somewhere (equal everywhere would mean exact acceptance ran instead) */
    enum { CMP = 64 };
    int32_t plain[CMP][3];
    {
        tdm_sched_t *s0 = NULL;
        struct tdm_sched_opts o0 = {.max_batch_tokens = 64, .watermark_pages = -1};
        assert_int_equal(tdm_sched_create(e, NULL, &o0, &s0), TDM_OK);
        for (int i = 0; i < CMP; i++) {
            struct tdm_req_params p = {.prompt = prompt,
                                       .n_prompt = 6,
                                       .max_tokens = 3,
                                       .ignore_eos = true,
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = (float)temp;
            p.sampling.top_k = top_k;
            p.sampling.seed = (uint64_t)i * 2654435761u + 17;
            tdm_req_t *r = NULL;
            assert_int_equal(tdm_sched_submit(s0, &p, &r), TDM_OK);
            while (tdm_req_state(r) != TDM_REQ_FINISHED)
                tdm_sched_step(s0);
            struct tdm_req_view v;
            tdm_req_lock(r, &v);
            memcpy(plain[i], v.tokens, sizeof plain[i]);
            tdm_req_unlock(r);
            tdm_req_release(r);
        }
        tdm_sched_destroy(s0);
    }
    int differ = 0;
    struct tdm_sched_opts so_s = {.max_batch_tokens = 64, .watermark_pages = -1};
    tdm_sched_t *s = NULL;
    assert_int_equal(tdm_sched_create(e, NULL, &so_s, &s), TDM_OK);
    tdm_spec_t *sp = NULL;
    struct tdm_spec_opts so = {
        .method = TDM_SPEC_SELF, .self_layers = 1, .k = 2, .accept = TDM_SPEC_ACCEPT_REJECTION};
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_OK);
    assert_int_equal(tdm_spec_attach(sp, s), TDM_OK);
    for (int done = 0; done < CHI_N; done += CHI_BATCH) {
        tdm_req_t *r[CHI_BATCH];
        for (int i = 0; i < CHI_BATCH; i++) {
            struct tdm_req_params p = {.prompt = prompt,
                                       .n_prompt = 6,
                                       .max_tokens = 3,
                                       .ignore_eos = true,
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = (float)temp;
            p.sampling.top_k = top_k;
            p.sampling.seed = (uint64_t)(done + i) * 2654435761u + 17;
            assert_int_equal(tdm_sched_submit(s, &p, &r[i]), TDM_OK);
        }
        for (int guard = 0; guard < 100; guard++) {
            bool live = false;
            for (int i = 0; i < CHI_BATCH; i++)
                live |= tdm_req_state(r[i]) != TDM_REQ_FINISHED;
            if (!live) break;
            tdm_sched_step(s);
        }
        for (int i = 0; i < CHI_BATCH; i++) {
            struct tdm_req_view v;
            tdm_req_lock(r[i], &v);
            assert_int_equal(v.n_out, 3);
            counts[v.tokens[1] * CV + v.tokens[2]]++;
            if (done + i < CMP) differ += memcmp(v.tokens, plain[done + i], sizeof plain[0]) != 0;
            tdm_req_unlock(r[i]);
            tdm_req_release(r[i]);
        }
    }
    struct tdm_spec_stats st;
    tdm_spec_get_stats(sp, &st);
    double crit, crit2;
    double x = chi2(counts, joint, CV * CV, CHI_N, &crit);
    double x_draft = chi2(counts, draft_joint, CV * CV, CHI_N, &crit2);
    print_message("rejection T=%.2f top_k=%d: chi2 %.1f (critical %.1f); against the draft's "
                  "distribution %.1f (critical %.1f); drafted %llu, kept %llu\n",
                  temp, top_k, x, crit, x_draft, crit2, (unsigned long long)st.drafted,
                  (unsigned long long)st.accepted);
    assert_true(st.drafted > CHI_N / 2);                      /* speculation really ran */
    assert_true(st.accepted > 0 && st.accepted < st.drafted); /* and both branches */
    assert_true(differ > 0);
    assert_true(x < crit);
    assert_true(x_draft > crit2); /* the test can tell a wrong distribution */
    tdm_sched_destroy(s);
    tdm_spec_destroy(sp);
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

static void test_rejection_distribution(void **state)
{
    (void)state;
    check_rejection_distribution(1.0, 0);
    check_rejection_distribution(0.9, 5);
}

/* The draft-model drafter: a second random model (2 layers, other widths, the same
 * vocabulary) whose KV is layer group 1 of the target's pool. Exact mode gives the target's
 * tokens for every setting; the target drafting for itself through this path keeps every draft;
 * a pool too small for all requests preempts mid-speculation (the draft's KV is caught up
 * again) and still gives the same tokens; a draft with another vocabulary is refused. */
static void test_draft_model(void **state)
{
    (void)state;
    struct tdm_test_model draft;
    struct tdm_test_model_opts dopt = {.arch = TDM_ARCH_LLAMA,
                                       .dtype = TDM_DTYPE_F32,
                                       .n_layers = 2,
                                       .d_model = 16,
                                       .n_heads = 2,
                                       .n_kv_heads = 1,
                                       .head_dim = 8,
                                       .d_ff = 32,
                                       .vocab = VOCAB,
                                       .max_ctx = 256,
                                       .rope_neox = true,
                                       .seed = 77};
    tdm_test_model_make(&draft, &dopt);
    make_model(31);
    tdm_engine_t *e = make_engine_for(256, &draft.m);
    for (int which = 0; which < 5; which++) {
        struct run_cfg c = {.sp = settings(which, 5 + (uint64_t)which), .n_req = N_REQ};
        make_prompts(&c, 40 + (uint64_t)which);
        struct run_out ref, got;
        run(e, NULL, &c, &ref);
        const int ks[] = {3, 0};
        for (int ki = 0; ki < 2; ki++) {
            struct tdm_spec_opts so = {
                .method = TDM_SPEC_DRAFT, .draft_model = &draft.m, .k = ks[ki]};
            run(e, &so, &c, &got);
            expect_same(&got, &ref, c.n_req, "draft model");
            if (ks[ki]) assert_true(got.st.drafted > 0);
        }
    }
    tdm_engine_destroy(e);
    /* the target drafting for itself, its copy of the KV in group 1 */
    e = make_engine_for(256, &tiny.m);
    struct run_cfg c = {.sp = settings(1, 9), .n_req = N_REQ};
    make_prompts(&c, 50);
    struct run_out ref, got;
    run(e, NULL, &c, &ref);
    struct tdm_spec_opts self_o = {.method = TDM_SPEC_DRAFT, .draft_model = &tiny.m, .k = 4};
    run(e, &self_o, &c, &got);
    expect_same(&got, &ref, c.n_req, "the target as its own draft model");
    assert_true(got.st.drafted > 0);
    assert_int_equal(got.st.accepted, got.st.drafted);
    tdm_engine_destroy(e);
    /* preemption mid-speculation */
    e = make_engine_for(30, &draft.m);
    run(e, NULL, &c, &ref);
    assert_true(ref.preemptions > 0);
    struct tdm_spec_opts so = {.method = TDM_SPEC_DRAFT, .draft_model = &draft.m, .k = 3};
    run(e, &so, &c, &got);
    assert_true(got.preemptions > 0);
    expect_same(&got, &ref, c.n_req, "draft model with preemptions");
    tdm_engine_destroy(e);
    /* another vocabulary */
    struct tdm_test_model other;
    dopt.vocab = VOCAB + 1;
    tdm_test_model_make(&other, &dopt);
    e = make_engine_for(64, &other.m);
    tdm_spec_t *sp = NULL;
    so.draft_model = &other.m;
    assert_int_equal(tdm_spec_create(e, &so, &sp), TDM_EINVAL);
    assert_non_null(strstr(tdm_err_msg(), "vocabulary"));
    tdm_engine_destroy(e);
    tdm_test_model_free(&other);
    tdm_test_model_free(&draft);
    tdm_test_model_free(&tiny);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_options),
        cmocka_unit_test(test_cost_fit),
        cmocka_unit_test(test_controller),
        cmocka_unit_test(test_gate),
        cmocka_unit_test(test_exact_is_lossless),
        cmocka_unit_test(test_preempt_cancel_and_caps),
        cmocka_unit_test(test_rejection_distribution),
        cmocka_unit_test(test_draft_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
