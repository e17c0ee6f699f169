/* Unit tests for sampling and text streaming: greedy ties, penalties computed by hand, the
 * distributions that top-k / top-p / min-p leave (checked empirically against the softmax
 * renormalised over the hand-derived candidate set), RNG keying, logprobs, validation, and
 * stop strings split across pieces and UTF-8 boundaries. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/sample.h"

enum { V = 8 };
static struct tdm_sample_scratch scratch;

static int setup(void **s)
{
    (void)s;
    return tdm_sample_scratch_init(&scratch, V) == TDM_OK ? 0 : -1;
}
static int teardown(void **s)
{
    (void)s;
    tdm_sample_scratch_free(&scratch);
    return 0;
}

static const float base[V] = {1.0f, 3.0f, 2.5f, 3.0f, -1.0f, 0.5f, 2.0f, -4.0f};

/* tdm_argmax's vector scan (every value finite) against the plain one, at every length
 * through 100 and at a vocabulary's: the first of tied maxima, and the plain scan's answer
 * whenever a NaN or an infinity is anywhere (its own rules: nothing beats a NaN at 0). */
static int32_t naive_argmax(const float *x, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static void test_argmax_scan(void **state)
{
    (void)state;
    enum { N = 49157 };
    float *x = malloc(N * sizeof *x);
    uint64_t r = 12345;
    const float odd[] = {NAN, INFINITY, -INFINITY};
    for (int len = 1; len <= 101; len++) {
        const int n = len <= 100 ? len : N;
        for (int trial = 0; trial < 8; trial++) {
            for (int i = 0; i < n; i++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                x[i] = (float)((int)(r >> 40) % 64) - 40.0f; /* small integers: many ties */
            }
            if (trial >= 5) x[(r >> 20) % (uint64_t)n] = odd[trial - 5];
            if (trial == 4) x[0] = NAN;
            assert_int_equal(tdm_argmax(x, n), naive_argmax(x, n));
        }
    }
    free(x);
}

static void test_greedy_ties(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
    float l[V];
    memcpy(l, base, sizeof l);
    float lp;
    assert_int_equal(tdm_sampler_sample(&smp, l, 0, &scratch, &lp), 1); /* 1 and 3 tie: lowest */
    double lse = 0;
    for (int i = 0; i < V; i++)
        lse += exp(base[i]);
    assert_true(fabs(lp - (3.0 - log(lse))) < 1e-5);
    tdm_sampler_free(&smp);
}

static void test_penalties(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
    tdm_sampler_accept(&smp, 1, true);  /* prompt: repetition only */
    tdm_sampler_accept(&smp, 3, false); /* output twice */
    tdm_sampler_accept(&smp, 3, false);
    tdm_sampler_accept(&smp, 4, false);
    float l[V];
    memcpy(l, base, sizeof l);
    /* 1: 3/2 = 1.5; 3: 3/2 - 0.25 - 2*0.5 = 0.25; 4: -1*2 - 0.25 - 0.5 = -2.75; 2 wins (2.5) */
    float lp;
    assert_int_equal(tdm_sampler_sample(&smp, l, 0, &scratch, &lp), 2);
    assert_true(fabsf(l[1] - 1.5f) < 1e-6f);
    assert_true(fabsf(l[3] - 0.25f) < 1e-6f);
    assert_true(fabsf(l[4] + 2.75f) < 1e-6f);
    double lse = 0;
    for (int i = 0; i < V; i++)
        lse += exp(base[i]);
    assert_true(fabs(lp - (2.5 - log(lse))) < 1e-5); /* logprob under the raw logits */
    tdm_sampler_free(&smp);
}

/* logit_bias, worked by hand: added after the penalties, before greedy and the temperature;
 * the log-probability stays the raw one; a repeated id takes its last value; out-of-range ids
 * and values are refused; the distribution is the softmax of (penalised + bias) / T. */
static void test_logit_bias(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
    /* greedy: 1 and 3 tie at 3.0; -100 on both leaves 2 (2.5); +1 on 7 (-4 + 1) changes nothing */
    int32_t ids[] = {1, 3, 7, 3};
    float vals[] = {-100.0f, 5.0f, 1.0f, -100.0f};
    assert_int_equal(tdm_sampler_set_bias(&smp, ids, vals, 4), TDM_OK);
    assert_int_equal(smp.n_bias, 3);
    float l[V], lp;
    memcpy(l, base, sizeof l);
    assert_int_equal(tdm_sampler_sample(&smp, l, 0, &scratch, &lp), 2);
    double lse = 0;
    for (int i = 0; i < V; i++)
        lse += exp(base[i]);
    assert_true(fabs(lp - (2.5 - log(lse))) < 1e-5); /* under the raw logits */
    /* +100 on the least likely token makes it the choice */
    int32_t low = 7;
    float big = 100.0f;
    assert_int_equal(tdm_sampler_set_bias(&smp, &low, &big, 1), TDM_OK);
    memcpy(l, base, sizeof l);
    assert_int_equal(tdm_sampler_sample(&smp, l, 0, &scratch, &lp), 7);
    assert_true(fabs(lp - (-4.0 - log(lse))) < 1e-5);
    /* refused: an id outside the vocabulary, a value outside [-100, 100], NaN */
    int32_t bad_id = V;
    float nan_v = NAN, over = 100.5f;
    assert_int_equal(tdm_sampler_set_bias(&smp, &bad_id, &big, 1), TDM_EINVAL);
    assert_int_equal(tdm_sampler_set_bias(&smp, &low, &over, 1), TDM_EINVAL);
    assert_int_equal(tdm_sampler_set_bias(&smp, &low, &nan_v, 1), TDM_EINVAL);
    assert_int_equal(tdm_sampler_set_bias(&smp, NULL, NULL, 0), TDM_OK);
    assert_null(smp.bias);
    tdm_sampler_free(&smp);

    /* with penalties and a temperature: the distribution, against the hand computation */
    p.temperature = 0.7f;
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 0.25f;
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
    tdm_sampler_accept(&smp, 1, true);
    tdm_sampler_accept(&smp, 3, false);
    int32_t bids[] = {3, 5};
    float bvals[] = {1.5f, -0.5f};
    assert_int_equal(tdm_sampler_set_bias(&smp, bids, bvals, 2), TDM_OK);
    double want[V], sum = 0;
    for (int i = 0; i < V; i++) {
        double x = base[i];
        if (i == 1) x = 3.0 / 2.0;              /* prompt: repetition */
        if (i == 3) x = 3.0 / 2.0 - 0.25 + 1.5; /* output: repetition, presence; bias */
        if (i == 5) x = 0.5 - 0.5;              /* bias alone */
        want[i] = exp(x / 0.7);
        sum += want[i];
    }
    float dist[V];
    memcpy(l, base, sizeof l);
    assert_int_equal(tdm_sampler_dist(&smp, l, &scratch, dist), V);
    for (int i = 0; i < V; i++)
        assert_true(fabs(dist[i] - want[i] / sum) < 1e-6);
    tdm_sampler_free(&smp);
}

/* Undoing accepts newest first gives back the exact earlier state: counts, the prompt marks,
 * the seen list (a device sampler's penalty list) and so the same penalised logits. */
static void test_unaccept(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.repetition_penalty = 1.5f;
    p.frequency_penalty = 0.5f;
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
    tdm_sampler_accept(&smp, 1, true);
    tdm_sampler_accept(&smp, 3, false);
    uint32_t count0[V];
    int32_t seen0[V];
    memcpy(count0, smp.out_count, sizeof count0);
    int n_seen0 = smp.n_seen;
    memcpy(seen0, smp.seen, (size_t)n_seen0 * sizeof *seen0);
    float before[V];
    memcpy(before, base, sizeof before);
    int32_t t0 = tdm_sampler_sample(&smp, before, 0, &scratch, NULL);
    /* drafts: a new token twice, a prompt token, an output token again, another new one */
    const int32_t drafts[] = {5, 5, 1, 3, 6};
    for (int i = 0; i < 5; i++)
        tdm_sampler_accept(&smp, drafts[i], false);
    assert_int_equal(smp.n_seen, n_seen0 + 2); /* 5 and 6 */
    assert_int_equal(smp.out_count[5], 2);
    for (int i = 4; i >= 0; i--)
        tdm_sampler_unaccept(&smp, drafts[i]);
    assert_memory_equal(smp.out_count, count0, sizeof count0);
    assert_int_equal(smp.n_seen, n_seen0);
    assert_memory_equal(smp.seen, seen0, (size_t)n_seen0 * sizeof *seen0);
    assert_int_equal(smp.prompt_seen[1], 1); /* the prompt mark survives an output undo */
    float after[V];
    memcpy(after, base, sizeof after);
    assert_int_equal(tdm_sampler_sample(&smp, after, 0, &scratch, NULL), t0);
    assert_memory_equal(after, before, sizeof after);
    /* undoing what was never accepted, or an id outside the vocabulary, changes nothing */
    tdm_sampler_unaccept(&smp, 7);
    tdm_sampler_unaccept(&smp, -1);
    tdm_sampler_unaccept(&smp, V);
    assert_memory_equal(smp.out_count, count0, sizeof count0);
    tdm_sampler_free(&smp);
    /* without penalties there is no state: a no-op */
    struct tdm_sampler g;
    struct tdm_sampling_params gp = tdm_sampling_defaults();
    assert_int_equal(tdm_sampler_init(&g, &gp, 1, V), TDM_OK);
    tdm_sampler_accept(&g, 2, false);
    tdm_sampler_unaccept(&g, 2);
    assert_null(g.out_count);
    tdm_sampler_free(&g);
}

/* Any float reaches the sampler: tiny temperatures are greedy, NaN is never chosen, +inf wins,
 * nothing is read out of bounds and no log-probability is NaN (issue: a temperature of 1e-40
 * with top_k 5 looped forever). */
/* A row's undo list is the state before those tokens: a verified row sampled with the span's
 * later drafts held in the sampler and listed in undo draws what the sampler draws once they
 * are unaccepted (the order speculation's commit used to sample in), and a proposal's
 * distribution is tdm_sampler_dist of that state; exact verification keeps a draft only when
 * it is that draw. Over random logits, histories and penalty settings, including a draft
 * repeated in the list and one also in the prompt. */
static void test_undo_rows(void **s)
{
    (void)s;
    enum { V = 300 };
    float lg[V], a[V], b[V], da[V], db[V];
    struct tdm_sample_scratch sc;
    assert_int_equal(tdm_sample_scratch_init(&sc, V), TDM_OK);
    uint64_t st = 12345;
    int differ = 0;
    for (int it = 0; it < 400; it++) {
        struct tdm_sampling_params p = tdm_sampling_defaults();
        p.temperature = it % 4 == 0 ? 0.0f : 0.9f;
        p.top_k = it % 3 == 0 ? 20 : 0;
        p.repetition_penalty = 1.4f;
        p.presence_penalty = 0.7f;
        p.frequency_penalty = 0.5f;
        p.seed = (uint64_t)it;
        struct tdm_sampler smp;
        assert_int_equal(tdm_sampler_init(&smp, &p, 7, V), TDM_OK);
        for (int i = 0; i < V; i++) {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            lg[i] = (float)((double)(st >> 11) / 9007199254740992.0) * 6.0f - 3.0f;
        }
        int32_t top = tdm_argmax(lg, V);
        tdm_sampler_accept(&smp, top, true); /* in the prompt as well */
        for (int i = 0; i < 5; i++)
            tdm_sampler_accept(&smp, (int32_t)((it * 7 + i * 13) % V), false);
        int n_undo = 1 + it % TDM_SAMPLE_MAX_UNDO;
        int32_t undo[TDM_SAMPLE_MAX_UNDO];
        for (int j = 0; j < n_undo; j++) { /* the row's favourites, repeated */
            undo[j] = j % 3 == 0 ? top : (int32_t)((it + j * 31) % V);
            tdm_sampler_accept(&smp, undo[j], false);
        }
        uint32_t pos = (uint32_t)(100 + it);
        struct tdm_sample_row row = {.smp = &smp,
                                     .position = pos,
                                     .n_top = 0,
                                     .mode = TDM_SAMPLE_VERIFY,
                                     .draft = undo[0],
                                     .undo = undo,
                                     .n_undo = n_undo};
        memcpy(a, lg, sizeof lg);
        tdm_sample_row_host(&row, a, &sc);
        struct tdm_sample_row prop = row;
        prop.mode = TDM_SAMPLE_PROPOSE;
        prop.dist = da;
        memcpy(a, lg, sizeof lg);
        tdm_sample_row_host(&prop, a, &sc);
        /* the reference: the state with the drafts unaccepted, newest first */
        for (int j = n_undo - 1; j >= 0; j--)
            tdm_sampler_unaccept(&smp, undo[j]);
        memcpy(b, lg, sizeof lg);
        float lp = 0.0f;
        int32_t want = tdm_sampler_sample(&smp, b, pos, &sc, &lp);
        memcpy(b, lg, sizeof lg);
        tdm_sampler_dist(&smp, b, &sc, db);
        assert_int_equal(row.token, want);
        assert_true(row.logprob == lp);
        assert_int_equal(row.kept, want == undo[0]);
        assert_memory_equal(da, db, sizeof da);
        /* without the undo list the penalties would see the drafts: the choice moves */
        for (int j = 0; j < n_undo; j++)
            tdm_sampler_accept(&smp, undo[j], false);
        memcpy(b, lg, sizeof lg);
        differ += tdm_sampler_sample(&smp, b, pos, &sc, NULL) != want;
        tdm_sampler_free(&smp);
    }
    assert_true(differ > 20); /* the test can tell an ignored undo list */
    tdm_sample_scratch_free(&sc);
}

/* TDM_SAMPLE_TREE: a node's children tested one after another as point masses, then a draw from
 * what is left. The token's distribution is the row's p, whatever the candidates: Pearson's
 * chi-squared over 40000 rows (positions and seeds vary the uniforms) at significance 0.001,
 * for a full and a top-k-cut distribution (a candidate with no mass) and candidate orders; the
 * same counts against a verifier that does not renormalise what is left after a refusal (it
 * keeps candidate i with probability p(d_i) itself) are rejected: the test can tell. kept says
 * whether the token is a candidate; a greedy row keeps a candidate exactly when it is the
 * argmax. */
static void test_tree_rows(void **s)
{
    (void)s;
    enum { V = 8, N = 40000 };
    const float lg[V] = {0.2f, -1.0f, 1.1f, 0.4f, -0.3f, 0.9f, 0.0f, -2.0f};
    const int32_t cands[2][3] = {{2, 5, 0}, {7, 2, 3}};
    struct tdm_sample_scratch sc;
    assert_int_equal(tdm_sample_scratch_init(&sc, V), TDM_OK);
    for (int cfg = 0; cfg < 4; cfg++) {
        const int32_t *cand = cands[cfg & 1];
        struct tdm_sampling_params p = tdm_sampling_defaults();
        p.temperature = 1.0f;
        if (cfg >= 2) p.top_k = 4; /* token 7 (a candidate of the second list) has no mass */
        double pv[V] = {0}, naive[V] = {0};
        float buf[V], dist[V];
        int counts[V] = {0};
        {
            struct tdm_sampler smp;
            assert_int_equal(tdm_sampler_init(&smp, &p, 0, V), TDM_OK);
            memcpy(buf, lg, sizeof buf);
            tdm_sampler_dist(&smp, buf, &sc, dist);
            tdm_sampler_free(&smp);
        }
        double left = 1.0, rest = 1.0;
        for (int v = 0; v < V; v++)
            pv[v] = dist[v];
        for (int i = 0; i < 3; i++) { /* the verifier that forgets to renormalise */
            naive[cand[i]] = left * pv[cand[i]];
            left *= 1 - pv[cand[i]];
            rest -= pv[cand[i]];
        }
        for (int v = 0; v < V; v++)
            if (v != cand[0] && v != cand[1] && v != cand[2]) naive[v] = left * pv[v] / rest;
        for (int i = 0; i < N; i++) {
            p.seed = (uint64_t)(i / 1000) + 100 * (uint64_t)cfg;
            struct tdm_sampler smp;
            assert_int_equal(tdm_sampler_init(&smp, &p, (uint64_t)cfg, V), TDM_OK);
            struct tdm_sample_row row = {.smp = &smp,
                                         .position = (uint32_t)(i % 1000),
                                         .n_top = -1,
                                         .mode = TDM_SAMPLE_TREE,
                                         .cand = cand,
                                         .n_cand = 3};
            memcpy(buf, lg, sizeof buf);
            tdm_sample_row_host(&row, buf, &sc);
            assert_true(row.token >= 0 && row.token < V);
            const bool is_cand =
                row.token == cand[0] || row.token == cand[1] || row.token == cand[2];
            assert_int_equal(row.kept, is_cand);
            counts[row.token]++;
            tdm_sampler_free(&smp);
        }
        double x = 0, xn = 0;
        int bins = 0;
        for (int v = 0; v < V; v++) {
            if (pv[v] == 0) {
                assert_int_equal(counts[v], 0); /* never a token p cannot draw */
                continue;
            }
            x += (counts[v] - N * pv[v]) * (counts[v] - N * pv[v]) / (N * pv[v]);
            xn += (counts[v] - N * naive[v]) * (counts[v] - N * naive[v]) / (N * naive[v]);
            bins++;
        }
        const double k = bins - 1, z = 3.0902;
        const double crit = k * pow(1 - 2 / (9 * k) + z * sqrt(2 / (9 * k)), 3);
        print_message("tree rows, config %d: chi2 %.1f, against the naive verifier %.1f "
                      "(critical %.1f)\n",
                      cfg, x, xn, crit);
        assert_true(x < crit);
        assert_true(xn > crit);
    }
    /* greedy: the argmax (2) always; kept when it is a candidate */
    struct tdm_sampling_params g = tdm_sampling_defaults();
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &g, 0, V), TDM_OK);
    for (int c = 0; c < 2; c++) {
        float buf[V];
        memcpy(buf, lg, sizeof buf);
        struct tdm_sample_row row = {
            .smp = &smp, .n_top = -1, .mode = TDM_SAMPLE_TREE, .cand = cands[c], .n_cand = 3};
        tdm_sample_row_host(&row, buf, &sc);
        assert_int_equal(row.token, 2);
        assert_true(row.kept);
        row.n_cand = 1; /* only the first candidate: 2 for list 0, 7 for list 1 */
        memcpy(buf, lg, sizeof buf);
        tdm_sample_row_host(&row, buf, &sc);
        assert_int_equal(row.token, 2);
        assert_int_equal(row.kept, c == 0);
    }
    tdm_sampler_free(&smp);
    tdm_sample_scratch_free(&sc);
}

static void test_hostile_floats(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    const float tiny[] = {1e-40f, 1e-30f, 1e-6f, 9.9e-6f};
    const int ks[] = {0, 5};
    const float tops[] = {1.0f, 0.5f};
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 2; c++) {
                p.temperature = tiny[a];
                p.top_k = ks[b];
                p.top_p = tops[c];
                assert_int_equal(tdm_sampling_validate(&p), TDM_OK);
                struct tdm_sampler smp;
                assert_int_equal(tdm_sampler_init(&smp, &p, 1, V), TDM_OK);
                assert_true(smp.params.temperature == 0.0f); /* below the floor: greedy */
                float l[V], lp;
                memcpy(l, base, sizeof l);
                assert_int_equal(tdm_sampler_sample(&smp, l, 3, &scratch, &lp),
                                 tdm_argmax(base, V));
                assert_false(isnan(lp));
                tdm_sampler_free(&smp);
            }
    /* at the floor itself the temperature is kept */
    p = tdm_sampling_defaults();
    p.temperature = TDM_SAMPLE_TEMPERATURE_FLOOR;
    struct tdm_sampler keep;
    assert_int_equal(tdm_sampler_init(&keep, &p, 1, V), TDM_OK);
    assert_true(keep.params.temperature == TDM_SAMPLE_TEMPERATURE_FLOOR);
    tdm_sampler_free(&keep);

    /* non-finite and huge logits, with every kind of parameters */
    const float nan = NAN, inf = INFINITY;
    const float rows[][V] = {
        {nan, 1, 2, nan, 0, -1, 5, 3},            /* NaN beside finite values */
        {nan, nan, nan, nan, nan, nan, nan, nan}, /* nothing finite */
        {1, 2, inf, 0, inf, -inf, nan, 1},        /* +inf wins: the first one */
        {-inf, -inf, -inf, -inf, -inf, -inf, -inf, -inf},
        {3e38f, -3e38f, 3e38f, 0, 1, -1, 2, 3.4e38f}, /* huge, finite */
        {-1e30f, -1e30f, -2e30f, -1e30f, -1e30f, -1e30f, -1e30f, -1e30f},
    };
    const int want_greedy[] = {6, 0, 2, 0, 7, 0};
    struct tdm_sampling_params ps[4];
    for (int i = 0; i < 4; i++)
        ps[i] = tdm_sampling_defaults();
    ps[1].temperature = 1.0f;
    ps[2].temperature = 0.7f, ps[2].top_k = 3, ps[2].top_p = 0.9f, ps[2].min_p = 0.1f;
    ps[3].temperature = 100.0f, ps[3].repetition_penalty = 2.0f, ps[3].presence_penalty = 2.0f;
    for (int r = 0; r < 6; r++)
        for (int q = 0; q < 4; q++) {
            struct tdm_sampler smp;
            assert_int_equal(tdm_sampler_init(&smp, &ps[q], 7, V), TDM_OK);
            tdm_sampler_accept(&smp, 6, false);
            for (uint32_t pos = 0; pos < 16; pos++) {
                struct tdm_sample_row row = {.smp = &smp, .position = pos, .n_top = 5};
                float l[V];
                memcpy(l, rows[r], sizeof l);
                tdm_sample_row_host(&row, l, &scratch);
                assert_true(row.token >= 0 && row.token < V);
                assert_false(isnan(row.logprob));
                for (int k = 0; k < 5; k++)
                    assert_false(isnan(row.top_lps[k]));
                if (q == 0) assert_int_equal(row.token, want_greedy[r]);
                if (r == 2) assert_int_equal(row.token, 2);                /* +inf is certain */
                if (r == 0) assert_true(row.token != 0 && row.token != 3); /* NaN never */
            }
            tdm_sampler_free(&smp);
        }
}

/* Samples n times at successive positions and checks frequencies against `expect`. */
static void check_distribution(const struct tdm_sampling_params *p, const double *expect)
{
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, p, 42, V), TDM_OK);
    enum { N = 40000 };
    int count[V] = {0};
    for (uint32_t pos = 0; pos < N; pos++) {
        float l[V];
        memcpy(l, base, sizeof l);
        int32_t t = tdm_sampler_sample(&smp, l, pos, &scratch, NULL);
        assert_true(t >= 0 && t < V);
        count[t]++;
    }
    for (int i = 0; i < V; i++) {
        double f = (double)count[i] / N;
        if (expect[i] == 0.0)
            assert_int_equal(count[i], 0);
        else
            assert_true(fabs(f - expect[i]) < 4.0 * sqrt(expect[i] * (1 - expect[i]) / N) + 1e-3);
    }
    tdm_sampler_free(&smp);
}

static void softmax_over(const int *keep, int n, float temp, double *out)
{
    memset(out, 0, V * sizeof *out);
    double z = 0;
    for (int i = 0; i < n; i++)
        z += exp(base[keep[i]] / temp);
    for (int i = 0; i < n; i++)
        out[keep[i]] = exp(base[keep[i]] / temp) / z;
}

static void test_filters(void **s)
{
    (void)s;
    double expect[V];
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = 1.0f;
    int all[V] = {0, 1, 2, 3, 4, 5, 6, 7};
    softmax_over(all, V, 1.0f, expect);
    check_distribution(&p, expect);

    p.top_k = 3; /* ranks: 1, 3 (tie, by id), 2 */
    int k3[] = {1, 3, 2};
    softmax_over(k3, 3, 1.0f, expect);
    check_distribution(&p, expect);

    p.top_k = 0;
    p.temperature = 0.5f;
    p.top_p = 0.9f; /* at T=0.5 probs: 1,3: .4319 each; 2: .1589 -> cum .4319,.8638,1.02 */
    int nuc[] = {1, 3, 2};
    softmax_over(nuc, 3, 0.5f, expect);
    check_distribution(&p, expect);

    p.top_p = 1.0f;
    p.temperature = 1.0f;
    p.min_p = 0.3f; /* keep p >= 0.3 * p_max: logit >= 3 + ln 0.3 = 1.796 -> 1, 3, 2, 6 */
    int mp[] = {1, 3, 2, 6};
    softmax_over(mp, 4, 1.0f, expect);
    check_distribution(&p, expect);
}

static void test_rng_keyed(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = 1.5f;
    struct tdm_sampler a, b, c;
    tdm_sampler_init(&a, &p, 5, V);
    tdm_sampler_init(&b, &p, 5, V);
    p.seed = 99;
    tdm_sampler_init(&c, &p, 5, V);
    int differ = 0;
    for (uint32_t pos = 0; pos < 200; pos++) {
        float l1[V], l2[V], l3[V];
        memcpy(l1, base, sizeof l1);
        memcpy(l2, base, sizeof l2);
        memcpy(l3, base, sizeof l3);
        /* b samples the positions in reverse order: the result depends on position only */
        uint32_t rpos = 199 - pos;
        int32_t t1 = tdm_sampler_sample(&a, l1, rpos, &scratch, NULL);
        int32_t t2 = tdm_sampler_sample(&b, l2, rpos, &scratch, NULL);
        assert_int_equal(t1, t2);
        differ += tdm_sampler_sample(&c, l3, rpos, &scratch, NULL) != t1;
    }
    assert_true(differ > 20);
    tdm_sampler_free(&a);
    tdm_sampler_free(&b);
    tdm_sampler_free(&c);
}

static void test_logprobs_top(void **s)
{
    (void)s;
    int32_t ids[3];
    float lps[3];
    tdm_logprobs_top(base, V, 3, ids, lps);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 2);
    double lse = 0;
    for (int i = 0; i < V; i++)
        lse += exp(base[i]);
    assert_true(fabs(lps[2] - (2.5 - log(lse))) < 1e-5);
    assert_true(fabs(tdm_logprob_of(base, V, 7) - (-4.0 - log(lse))) < 1e-5);
}

/* A score row (TDM_SAMPLE_SCORE) gives its token back and the token's log-probability under
 * the raw logits, whatever the sampler's penalties, bias and temperature (computed here in
 * double, independently); a NaN logit's is -inf, never NaN. */
static void test_score_rows(void **s)
{
    (void)s;
    enum { V = 50 };
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = 0.7f;
    p.top_k = 3;
    p.repetition_penalty = 1.5f;
    p.presence_penalty = 1.0f;
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 9, V), TDM_OK);
    const int32_t ids[1] = {7};
    const float vals[1] = {50.0f};
    assert_int_equal(tdm_sampler_set_bias(&smp, ids, vals, 1), TDM_OK);
    tdm_sampler_accept(&smp, 3, true);
    tdm_sampler_accept(&smp, 3, false);
    struct tdm_sample_scratch sc;
    assert_int_equal(tdm_sample_scratch_init(&sc, V), TDM_OK);
    float logits[V], raw[V];
    for (int i = 0; i < V; i++)
        raw[i] = (float)((i * 37) % 11) * 0.3f - 1.0f;
    double sum = 0.0, mx = -1e30;
    for (int i = 0; i < V; i++)
        mx = raw[i] > mx ? raw[i] : mx;
    for (int i = 0; i < V; i++)
        sum += exp((double)raw[i] - mx);
    for (int32_t t = 0; t < V; t++) {
        memcpy(logits, raw, sizeof logits);
        struct tdm_sample_row row = {
            .smp = &smp, .position = 5, .n_top = 2, .mode = TDM_SAMPLE_SCORE, .draft = t};
        tdm_sample_row_host(&row, logits, &sc);
        assert_int_equal(row.token, t);
        assert_false(row.kept);
        assert_float_equal(row.logprob, (double)raw[t] - mx - log(sum), 1e-5);
        assert_float_equal(row.top_lps[0], 2.0 - mx - log(sum), 1e-5); /* the largest, raw */
    }
    memcpy(logits, raw, sizeof logits);
    logits[4] = NAN;
    struct tdm_sample_row row = {
        .smp = &smp, .position = 5, .n_top = 0, .mode = TDM_SAMPLE_SCORE, .draft = 4};
    tdm_sample_row_host(&row, logits, &sc);
    assert_int_equal(row.token, 4);
    assert_true(isinf(row.logprob) && row.logprob < 0);
    tdm_sample_scratch_free(&sc);
    tdm_sampler_free(&smp);
}

static void test_validate(void **s)
{
    (void)s;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    assert_int_equal(tdm_sampling_validate(&p), TDM_OK);
    p.top_p = 0.0f;
    assert_int_equal(tdm_sampling_validate(&p), TDM_EINVAL);
    p = tdm_sampling_defaults();
    p.temperature = NAN;
    assert_int_equal(tdm_sampling_validate(&p), TDM_EINVAL);
    p = tdm_sampling_defaults();
    p.top_k = -1;
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 0, V), TDM_EINVAL);
}

static void push_all(struct tdm_text_stream *ts, const char *const *pieces, int n, char *out,
                     size_t *len, bool *stopped)
{
    *len = 0;
    *stopped = false;
    char buf[TDM_STREAM_CAP + 64];
    for (int i = 0; i < n && !*stopped; i++) {
        size_t k;
        *stopped = tdm_text_stream_push(ts, pieces[i], strlen(pieces[i]), buf, &k);
        memcpy(out + *len, buf, k);
        *len += k;
    }
    if (!*stopped) {
        size_t k;
        tdm_text_stream_flush(ts, buf, &k);
        memcpy(out + *len, buf, k);
        *len += k;
    }
    out[*len] = '\0';
}

static void test_stream(void **s)
{
    (void)s;
    struct tdm_text_stream ts;
    const char *stops[] = {"###", "\nUser:"};
    char out[512];
    size_t len;
    bool stopped;
    assert_int_equal(tdm_text_stream_init(&ts, stops, 2), TDM_OK);
    const char *p1[] = {"Hello", " wor", "ld #", "#", "# tail"};
    push_all(&ts, p1, 5, out, &len, &stopped);
    assert_true(stopped);
    assert_string_equal(out, "Hello world ");

    assert_int_equal(tdm_text_stream_init(&ts, stops, 2), TDM_OK);
    const char *p2[] = {"a #", "# b\nUse", "d"};
    push_all(&ts, p2, 3, out, &len, &stopped);
    assert_false(stopped); /* near misses are released in the end */
    assert_string_equal(out, "a ## b\nUsed");

    /* "é" = c3 a9 split across two pieces is never emitted half */
    assert_int_equal(tdm_text_stream_init(&ts, NULL, 0), TDM_OK);
    char buf[TDM_STREAM_CAP];
    size_t k;
    tdm_text_stream_push(&ts, "caf\xc3", 4, buf, &k);
    assert_int_equal(k, 3);
    tdm_text_stream_push(&ts, "\xa9!", 2, buf, &k);
    assert_int_equal(k, 3);
    assert_memory_equal(buf, "\xc3\xa9!", 3);
    /* an unfinished sequence at the end becomes U+FFFD */
    tdm_text_stream_push(&ts, "x\xe2\x82", 3, buf, &k);
    assert_int_equal(k, 1);
    tdm_text_stream_flush(&ts, buf, &k);
    assert_int_equal(k, 3);
    assert_memory_equal(buf, "\xef\xbf\xbd", 3);

    const char *empty[] = {""};
    assert_int_equal(tdm_text_stream_init(&ts, empty, 1), TDM_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_argmax_scan), cmocka_unit_test(test_greedy_ties),
        cmocka_unit_test(test_penalties),   cmocka_unit_test(test_filters),
        cmocka_unit_test(test_rng_keyed),   cmocka_unit_test(test_logprobs_top),
        cmocka_unit_test(test_validate),    cmocka_unit_test(test_stream),
        cmocka_unit_test(test_unaccept),    cmocka_unit_test(test_hostile_floats),
        cmocka_unit_test(test_undo_rows),   cmocka_unit_test(test_tree_rows),
        cmocka_unit_test(test_logit_bias),  cmocka_unit_test(test_score_rows),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
