/*
 * Sampling on the GPU (the CUDA backend's `sample` hook, src/backend/cuda/sample.cu) against
 * the host sampler (src/sample/sampler.c: a sort-based implementation sharing no code with
 * the kernel's radix selects) on the same logits.
 *
 * Logit rows of several shapes (normal, peaked, flat, and quantised to quarters so that many
 * probabilities tie exactly) and vocabularies (1,000, 49,152, 128,256, and one that is not a
 * multiple of the block), each row with its own parameters drawn from a grid: temperature,
 * top-k, top-p, min-p, repetition / presence / frequency penalties over a random history, a
 * logit bias on a third of the rows, top log-probabilities, seed, request id, position.
 *
 * Required: greedy rows choose the host's token every time; sampled rows choose it in all but
 * at most one row in a thousand (the kernel's sums run in another order and its exponential
 * may differ from glibc's expf in the last bit, so a draw that lands within ~1e-7 of a boundary
 * between two candidates may go the other way; every mismatch is printed with both tokens'
 * host probabilities); the chosen token's log-probability within 1e-4; the top log-
 * probabilities the same ids in the same order, values within 1e-4. The sampling time for a
 * batch is printed for the record (tests never assert timings).
 *
 * Without a GPU every test is skipped with a message.
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

#include "tandem/backend.h"
#include "tandem/sample.h"
#include "lib/test_rng.h"

static char skip_reason[512];
static tdm_backend_t *gpu;

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static uint64_t rng_u64(void)
{
    return tdm_test_splitmix64(&rng_state);
}
static double rng_d(void)
{
    return (double)(rng_u64() >> 11) / 9007199254740992.0;
}
static float rng_normal(void)
{
    double u1 = rng_d() + 1e-300, u2 = rng_d();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

enum shape { NORMAL, PEAKED, FLAT, QUARTERS, N_SHAPES };

static void fill_row(float *row, int vocab, enum shape sh)
{
    for (int i = 0; i < vocab; i++) {
        float g = rng_normal();
        switch (sh) {
        case NORMAL:
            row[i] = 3.0f * g;
            break;
        case PEAKED:
            row[i] = g;
            break;
        case FLAT:
            row[i] = 0.05f * g;
            break;
        default:
            row[i] = roundf(8.0f * g) / 4.0f;
            break;
        }
    }
    if (sh == PEAKED)
        for (int j = 0; j < 3; j++)
            row[rng_u64() % (uint64_t)vocab] += 12.0f + 2.0f * (float)j;
}

static struct tdm_sampling_params draw_params(void)
{
    static const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.0f, 1.5f};
    static const int ks[] = {0, 0, 1, 5, 50, 1000, 40000};
    static const float ps[] = {1.0f, 1.0f, 0.9f, 0.5f, 0.99f, 0.95f};
    static const float mins[] = {0.0f, 0.0f, 0.05f, 0.2f};
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = temps[rng_u64() % TDM_ARRAY_LEN(temps)];
    p.top_k = ks[rng_u64() % TDM_ARRAY_LEN(ks)];
    p.top_p = ps[rng_u64() % TDM_ARRAY_LEN(ps)];
    p.min_p = mins[rng_u64() % TDM_ARRAY_LEN(mins)];
    if (rng_u64() % 3 == 0) {
        p.repetition_penalty = 1.3f;
        p.presence_penalty = 0.5f;
        p.frequency_penalty = 0.3f;
    } else if (rng_u64() % 4 == 0) {
        p.repetition_penalty = 0.8f;
    }
    p.seed = rng_u64();
    return p;
}

struct stats {
    int rows, greedy, greedy_same, sampled, sampled_same, lp_checked, top_checked;
    double worst_lp, worst_top;
};

/* Samples n rows of one vocabulary on both sides and compares them. */
/* A logit bias on a third of the rows: the row's most likely token pushed down (so that the
 * bias moves the choice), a token of its penalty list when it has one (a listed token's bias),
 * and a few random ones. */
static void maybe_bias(struct tdm_sampler *smp, const float *row, int vocab)
{
    if (rng_u64() % 3) return;
    int32_t ids[6];
    float vals[6];
    int n = 0;
    ids[n] = tdm_argmax(row, vocab);
    vals[n++] = -1.0f - (float)(rng_u64() % 30);
    if (smp->seen && smp->n_seen) {
        ids[n] = smp->seen[rng_u64() % (uint64_t)smp->n_seen];
        vals[n++] = 2.5f;
    }
    while (n < 6) {
        ids[n] = (int32_t)(rng_u64() % (uint64_t)vocab);
        vals[n++] = (float)((int)(rng_u64() % 201) - 100) * 0.37f;
    }
    assert_int_equal(tdm_sampler_set_bias(smp, ids, vals, n), TDM_OK);
}

static void compare_batch(int vocab, int n, struct stats *st)
{
    float *logits = malloc((size_t)n * vocab * sizeof(float));
    float *host = malloc((size_t)n * vocab * sizeof(float));
    struct tdm_sampler *smp = calloc((size_t)n, sizeof *smp);
    struct tdm_sample_row *dev = calloc((size_t)n, sizeof *dev);
    struct tdm_sample_row *ref = calloc((size_t)n, sizeof *ref);
    struct tdm_sample_scratch scratch;
    assert_non_null(logits);
    assert_non_null(host);
    assert_non_null(smp);
    assert_non_null(dev);
    assert_non_null(ref);
    assert_int_equal(tdm_sample_scratch_init(&scratch, vocab), TDM_OK);
    static const int tops[] = {-1, 0, 5, 20};
    for (int r = 0; r < n; r++) {
        fill_row(logits + (size_t)r * vocab, vocab, (enum shape)(rng_u64() % N_SHAPES));
        struct tdm_sampling_params p = draw_params();
        assert_int_equal(tdm_sampler_init(&smp[r], &p, rng_u64(), vocab), TDM_OK);
        if (smp[r].out_count) { /* a history: prompt tokens, and outputs with repeats */
            int n_prompt = 1 + (int)(rng_u64() % 200), n_out = (int)(rng_u64() % 100);
            for (int i = 0; i < n_prompt; i++)
                tdm_sampler_accept(&smp[r], (int32_t)(rng_u64() % (uint64_t)vocab), true);
            for (int i = 0; i < n_out; i++)
                tdm_sampler_accept(&smp[r], (int32_t)(rng_u64() % (uint64_t)TDM_MIN(vocab, 300)),
                                   false);
        }
        maybe_bias(&smp[r], logits + (size_t)r * vocab, vocab);
        uint32_t pos = (uint32_t)(rng_u64() % 100000);
        int n_top = tops[rng_u64() % TDM_ARRAY_LEN(tops)];
        dev[r] = (struct tdm_sample_row){.smp = &smp[r], .position = pos, .n_top = n_top};
        ref[r] = dev[r];
    }
    memcpy(host, logits, (size_t)n * vocab * sizeof(float));

    const struct tdm_backend_i *ops = gpu->iface;
    float *d = ops->buf_alloc(gpu, (size_t)n * vocab * sizeof(float));
    assert_non_null(d);
    ops->upload(gpu, d, logits, (size_t)n * vocab * sizeof(float));
    ops->sync(gpu);
    double t0 = tdm_now_s();
    assert_int_equal(ops->sample(gpu, d, n, vocab, dev), TDM_OK);
    double dt = tdm_now_s() - t0;
    /* again on fresh logits, timed warm */
    ops->upload(gpu, d, logits, (size_t)n * vocab * sizeof(float));
    ops->sync(gpu);
    t0 = tdm_now_s();
    struct tdm_sample_row *again = calloc((size_t)n, sizeof *again);
    assert_non_null(again);
    for (int r = 0; r < n; r++)
        again[r] = ref[r];
    assert_int_equal(ops->sample(gpu, d, n, vocab, again), TDM_OK);
    dt = tdm_now_s() - t0;
    print_message("vocab %d: %d rows sampled on the GPU in %.1f us (warm, with transfers)\n", vocab,
                  n, dt * 1e6);

    for (int r = 0; r < n; r++) {
        /* the same inputs give the same outputs on the device, run after run */
        assert_int_equal(again[r].token, dev[r].token);
        assert_true(again[r].logprob == dev[r].logprob);

        float *row = host + (size_t)r * vocab;
        float *raw = malloc((size_t)vocab * sizeof(float));
        assert_non_null(raw);
        memcpy(raw, row, (size_t)vocab * sizeof(float));
        tdm_sample_row_host(&ref[r], row, &scratch);
        const struct tdm_sampling_params *p = &smp[r].params;
        bool greedy = p->temperature == 0.0f || p->top_k == 1;
        st->rows++;
        assert_true(dev[r].token >= 0 && dev[r].token < vocab);
        if (greedy) {
            st->greedy++;
            st->greedy_same += dev[r].token == ref[r].token;
            if (dev[r].token != ref[r].token)
                print_message("greedy row %d (vocab %d): gpu %d, host %d\n", r, vocab, dev[r].token,
                              ref[r].token);
        } else {
            st->sampled++;
            st->sampled_same += dev[r].token == ref[r].token;
            if (dev[r].token != ref[r].token)
                print_message("sampled row %d (vocab %d, T %.2f k %d p %.2f min_p %.2f pen %d): "
                              "gpu %d (raw logit %.6f), host %d (raw logit %.6f)\n",
                              r, vocab, p->temperature, p->top_k, p->top_p, p->min_p,
                              smp[r].out_count != NULL, dev[r].token, raw[dev[r].token],
                              ref[r].token, raw[ref[r].token]);
        }
        if (ref[r].n_top >= 0 && dev[r].token == ref[r].token) {
            st->lp_checked++;
            double e = fabs((double)dev[r].logprob - ref[r].logprob);
            if (e > st->worst_lp) st->worst_lp = e;
        }
        for (int j = 0; j < ref[r].n_top; j++) {
            assert_int_equal(dev[r].top_ids[j], ref[r].top_ids[j]);
            double e = fabs((double)dev[r].top_lps[j] - ref[r].top_lps[j]);
            if (e > st->worst_top) st->worst_top = e;
            st->top_checked++;
        }
        free(raw);
    }
    ops->buf_free(gpu, d);
    for (int r = 0; r < n; r++)
        tdm_sampler_free(&smp[r]);
    tdm_sample_scratch_free(&scratch);
    free(again);
    free(logits);
    free(host);
    free(smp);
    free(dev);
    free(ref);
}

static void test_against_host(void **state)
{
    (void)state;
    if (!gpu) {
        print_message("SKIP: %s\n", skip_reason);
        skip();
    }
    struct stats st = {0};
    static const int vocabs[] = {1000, 49152, 128256, 100003};
    for (size_t v = 0; v < TDM_ARRAY_LEN(vocabs); v++)
        for (int b = 0; b < 4; b++)
            compare_batch(vocabs[v], b == 0 ? 1 : 96, &st);
    printf("gpu vs host sampling: %d rows; greedy %d/%d identical; sampled %d/%d identical; "
           "chosen logprob worst |diff| %.3g over %d; top logprobs worst |diff| %.3g over %d\n",
           st.rows, st.greedy_same, st.greedy, st.sampled_same, st.sampled, st.worst_lp,
           st.lp_checked, st.worst_top, st.top_checked);
    assert_true(st.greedy > 50 && st.sampled > 500);
    assert_int_equal(st.greedy_same, st.greedy);
    assert_true(1000 * (st.sampled - st.sampled_same) <= st.sampled);
    assert_true(st.worst_lp <= 1e-4);
    assert_true(st.worst_top <= 1e-4);
}

/*
 * Speculation's modes (sample.h) on the device against the host, row by row: draws whose
 * penalties leave out an undo list, exact verification, a drafter's proposal (its
 * distribution written to device memory) and rejection verification (q read from device
 * memory). Each row's mode, draft and undo list are random; a verified draft is the host's own
 * token half the time, so both outcomes occur. The same tolerance as test_against_host: (token,
 * kept) the host's in all but one row in a thousand, and a proposal's distribution within 1e-6
 * of the host's tdm_sampler_dist at every token. A third of the rows carry a grammar's mask
 * (dense, sparse or nearly full; sometimes the previous row's, the same pointer, which the
 * device stages once): the token must be one it allows whenever the host's is.
 */
static int masked_rows;
static void modes_batch(int vocab, int n, int *rows, int *same, double *worst_dist, int *kept_n,
                        int *modes_seen)
{
    const int words = (vocab + 31) / 32;
    uint32_t *masks = calloc((size_t)n * (size_t)words, sizeof *masks);
    assert_non_null(masks);
    const size_t V = (size_t)vocab;
    float *logits = malloc((size_t)n * V * sizeof(float));
    float *host = malloc((size_t)n * V * sizeof(float));
    float *q = malloc((size_t)n * V * sizeof(float));     /* rejection rows' q, host copy */
    float *hdist = malloc((size_t)n * V * sizeof(float)); /* proposals, host side */
    float *ddist = malloc((size_t)n * V * sizeof(float)); /* proposals, device side, fetched */
    int32_t(*undo)[TDM_SAMPLE_MAX_UNDO] = calloc((size_t)n, sizeof *undo);
    struct tdm_sampler *smp = calloc((size_t)n, sizeof *smp);
    struct tdm_sample_row *dev = calloc((size_t)n, sizeof *dev);
    struct tdm_sample_row *ref = calloc((size_t)n, sizeof *ref);
    struct tdm_sample_scratch scratch;
    assert_true(logits && host && q && hdist && ddist && undo && smp && dev && ref);
    assert_int_equal(tdm_sample_scratch_init(&scratch, vocab), TDM_OK);
    const struct tdm_backend_i *ops = gpu->iface;
    float *d_logits = ops->buf_alloc(gpu, (size_t)n * V * sizeof(float));
    float *d_q = ops->buf_alloc(gpu, (size_t)n * V * sizeof(float));
    float *d_dist = ops->buf_alloc(gpu, (size_t)n * V * sizeof(float));
    assert_true(d_logits && d_q && d_dist);
    for (int r = 0; r < n; r++) {
        float *row = logits + (size_t)r * V;
        fill_row(row, vocab, (enum shape)(rng_u64() % N_SHAPES));
        struct tdm_sampling_params p = draw_params();
        if (rng_u64() % 2) { /* penalties on half the rows, so undo lists matter */
            p.repetition_penalty = 1.3f;
            p.presence_penalty = 0.6f;
            p.frequency_penalty = 0.4f;
        }
        assert_int_equal(tdm_sampler_init(&smp[r], &p, rng_u64(), vocab), TDM_OK);
        int n_undo = 0;
        if (smp[r].out_count) {
            for (int i = 0; i < 1 + (int)(rng_u64() % 50); i++)
                tdm_sampler_accept(&smp[r], (int32_t)(rng_u64() % V), true);
            /* outputs, the last few of them the span's drafts (the undo list), favouring the
             * tokens the row likes so that the penalties move its choice */
            int n_out = 1 + (int)(rng_u64() % 40);
            n_undo = (int)(rng_u64() % (TDM_SAMPLE_MAX_UNDO + 1));
            n_undo = TDM_MIN(n_undo, n_out);
            int32_t top = tdm_argmax(row, vocab);
            for (int i = 0; i < n_out; i++) {
                int32_t t = rng_u64() % 2 ? top : (int32_t)(rng_u64() % TDM_MIN(V, 300));
                tdm_sampler_accept(&smp[r], t, false);
                if (i >= n_out - n_undo) undo[r][i - (n_out - n_undo)] = t;
            }
        }
        maybe_bias(&smp[r], row, vocab);
        uint8_t mode = (uint8_t)(rng_u64() % 4);
        if (mode == 3) mode = TDM_SAMPLE_SCORE; /* trees have their own test */
        dev[r] = (struct tdm_sample_row){.smp = &smp[r],
                                         .position = (uint32_t)(rng_u64() % 100000),
                                         .n_top = (int)(rng_u64() % 3) - 1,
                                         .mode = mode,
                                         .undo = n_undo ? undo[r] : NULL,
                                         .n_undo = n_undo};
        if (rng_u64() % 3 == 0) {
            uint32_t *m = masks + (size_t)r * words;
            if (r > 0 && dev[r - 1].allow && rng_u64() % 2) {
                dev[r].allow = dev[r - 1].allow; /* a request's rows share one */
            } else {
                int kind = (int)(rng_u64() % 3);
                for (int w = 0; w < words; w++)
                    m[w] = kind == 0 ? (uint32_t)rng_u64() : kind == 1 ? 0u : ~0u;
                for (int k = 0; k < 20; k++) { /* a few exceptions, the row's top among them */
                    int32_t t = k == 0 ? tdm_argmax(row, vocab) : (int32_t)(rng_u64() % V);
                    if (kind == 2)
                        m[t >> 5] &= ~(1u << (t & 31));
                    else
                        m[t >> 5] |= 1u << (t & 31);
                }
                for (int t = vocab; t < words * 32; t++)
                    m[t >> 5] &= ~(1u << (t & 31));
                dev[r].allow = m;
            }
            masked_rows++;
        }
        ref[r] = dev[r];
        modes_seen[mode]++;
        if (mode == TDM_SAMPLE_SCORE) { /* a prompt token, given: any, and its top ones */
            dev[r].draft = ref[r].draft = (int32_t)(rng_u64() % V);
            dev[r].n_top = ref[r].n_top = (int)(rng_u64() % (TDM_TOP_LOGPROBS_MAX + 1));
        } else if (mode == TDM_SAMPLE_PROPOSE) {
            bool oh = rng_u64() % 4 == 0;
            dev[r].one_hot = ref[r].one_hot = oh;
            dev[r].dist = d_dist + (size_t)r * V;
            ref[r].dist = hdist + (size_t)r * V;
        } else if (mode == TDM_SAMPLE_VERIFY) {
            /* the draft: the host's own draw half the time, else any token */
            struct tdm_sample_row probe = ref[r];
            probe.mode = TDM_SAMPLE_DRAW;
            memcpy(host, row, V * sizeof(float));
            tdm_sample_row_host(&probe, host, &scratch);
            int32_t dft = rng_u64() % 2 ? probe.token : (int32_t)(rng_u64() % V);
            dev[r].draft = ref[r].draft = dft;
            if (rng_u64() % 2) { /* rejection: q from a perturbed row, holding the draft */
                float *qr = q + (size_t)r * V;
                for (size_t i = 0; i < V; i++)
                    host[i] = row[i] + 0.5f * rng_normal();
                struct tdm_sampler qs;
                struct tdm_sampling_params qp = p;
                qp.temperature = qp.temperature > 0 ? qp.temperature : 1.0f;
                qp.repetition_penalty = 1.0f;
                qp.presence_penalty = qp.frequency_penalty = 0.0f;
                assert_int_equal(tdm_sampler_init(&qs, &qp, 1, vocab), TDM_OK);
                tdm_sampler_dist(&qs, host, &scratch, qr);
                tdm_sampler_free(&qs);
                if (rng_u64() % 2) qr[dft] = TDM_MAX(qr[dft], 0.3f); /* often q(d) > 0 */
                ref[r].q = qr;
                dev[r].q = d_q + (size_t)r * V;
            }
        }
    }
    memcpy(host, logits, (size_t)n * V * sizeof(float));
    ops->upload(gpu, d_logits, logits, (size_t)n * V * sizeof(float));
    ops->upload(gpu, d_q, q, (size_t)n * V * sizeof(float));
    ops->sync(gpu);
    assert_int_equal(ops->sample(gpu, d_logits, n, vocab, dev), TDM_OK);
    ops->download(gpu, ddist, d_dist, (size_t)n * V * sizeof(float));
    ops->sync(gpu);
    for (int r = 0; r < n; r++) {
        tdm_sample_row_host(&ref[r], host + (size_t)r * V, &scratch);
        (*rows)++;
        bool ok = dev[r].token == ref[r].token && dev[r].kept == ref[r].kept;
        if (ref[r].mode == TDM_SAMPLE_SCORE) {
            /* the given token, and its log-probability and the top ones as the host's */
            assert_int_equal(dev[r].token, ref[r].draft);
            double e = fabs((double)dev[r].logprob - ref[r].logprob);
            if (!(e <= 1e-4) && !(isinf(dev[r].logprob) && dev[r].logprob == ref[r].logprob))
                fail_msg("score row %d: gpu logprob %g, host %g", r, dev[r].logprob,
                         ref[r].logprob);
            for (int j = 0; j < ref[r].n_top; j++) {
                double t = fabs((double)dev[r].top_lps[j] - ref[r].top_lps[j]);
                if (!(t <= 1e-4) && dev[r].top_lps[j] != ref[r].top_lps[j])
                    fail_msg("score row %d: top %d gpu %g, host %g", r, j, dev[r].top_lps[j],
                             ref[r].top_lps[j]);
            }
        }
        const uint32_t *al = ref[r].allow;
        if (al && ref[r].mode != TDM_SAMPLE_SCORE &&
            (al[ref[r].token >> 5] >> (ref[r].token & 31) & 1) &&
            !(al[dev[r].token >> 5] >> (dev[r].token & 31) & 1))
            fail_msg("row %d: the device chose token %d, which its mask refuses", r, dev[r].token);
        *same += ok;
        *kept_n += ref[r].kept;
        if (!ok)
            print_message("mode %d row %d (vocab %d, T %.2f k %d p %.2f, undo %d, q %d): gpu %d "
                          "kept %d, host %d kept %d\n",
                          ref[r].mode, r, vocab, smp[r].params.temperature, smp[r].params.top_k,
                          smp[r].params.top_p, ref[r].n_undo, ref[r].q != NULL, dev[r].token,
                          dev[r].kept, ref[r].token, ref[r].kept);
        if (ref[r].mode == TDM_SAMPLE_PROPOSE && ok)
            for (size_t i = 0; i < V; i++) {
                double e = fabs((double)ddist[(size_t)r * V + i] - hdist[(size_t)r * V + i]);
                if (e > *worst_dist) *worst_dist = e;
            }
    }
    ops->buf_free(gpu, d_logits);
    ops->buf_free(gpu, d_q);
    ops->buf_free(gpu, d_dist);
    for (int r = 0; r < n; r++)
        tdm_sampler_free(&smp[r]);
    tdm_sample_scratch_free(&scratch);
    free(logits);
    free(host);
    free(q);
    free(hdist);
    free(ddist);
    free(undo);
    free(smp);
    free(dev);
    free(ref);
    free(masks);
}

static void test_modes_against_host(void **state)
{
    (void)state;
    if (!gpu) {
        print_message("SKIP: %s\n", skip_reason);
        skip();
    }
    int rows = 0, same = 0, kept = 0, modes[TDM_SAMPLE_SCORE + 1] = {0};
    double worst = 0.0;
    static const int vocabs[] = {1000, 49152, 100003};
    for (size_t v = 0; v < TDM_ARRAY_LEN(vocabs); v++)
        for (int b = 0; b < 4; b++)
            modes_batch(vocabs[v], 128, &rows, &same, &worst, &kept, modes);
    printf("gpu vs host sampling modes: %d rows (draw %d, propose %d, verify %d, score %d; %d "
           "masked); (token, kept) identical in %d, %d drafts kept; proposals' distributions "
           "worst |diff| %.3g\n",
           rows, modes[0], modes[1], modes[2], modes[TDM_SAMPLE_SCORE], masked_rows, same, kept,
           worst);
    assert_true(modes[0] > 100 && modes[1] > 100 && modes[2] > 100 &&
                modes[TDM_SAMPLE_SCORE] > 100 && kept > 50 && masked_rows > 200);
    assert_true(1000 * (rows - same) <= rows + 1000); /* at most one, or one in a thousand */
    assert_true(worst <= 1e-6);
}

/* The draw follows the counter RNG: the same seed, request and position give the same token;
 * other positions give the distribution's other tokens. */
static void test_rng_keyed(void **state)
{
    (void)state;
    if (!gpu) {
        print_message("SKIP: %s\n", skip_reason);
        skip();
    }
    enum { V = 4096, N = 64 };
    float *logits = malloc((size_t)N * V * sizeof(float));
    assert_non_null(logits);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < V; i++) /* every row the same flat-ish distribution */
            logits[(size_t)r * V + i] = (float)(i % 7) * 0.1f;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = 1.0f;
    p.seed = 42;
    struct tdm_sampler smp;
    assert_int_equal(tdm_sampler_init(&smp, &p, 7, V), TDM_OK);
    struct tdm_sample_row rows[N];
    for (int r = 0; r < N; r++) /* positions 100, 100, 101, 101, ... */
        rows[r] =
            (struct tdm_sample_row){.smp = &smp, .position = 100 + (uint32_t)(r / 2), .n_top = -1};
    const struct tdm_backend_i *ops = gpu->iface;
    float *d = ops->buf_alloc(gpu, sizeof(float) * N * V);
    assert_non_null(d);
    ops->upload(gpu, d, logits, sizeof(float) * N * V);
    assert_int_equal(ops->sample(gpu, d, N, V, rows), TDM_OK);
    int distinct = 0;
    for (int r = 0; r < N; r += 2) {
        assert_int_equal(rows[r].token, rows[r + 1].token);
        distinct += r == 0 || rows[r].token != rows[r - 2].token;
    }
    assert_true(distinct > N / 4);
    /* a vocabulary the kernel cannot take is refused, with nothing done */
    assert_int_equal(ops->sample(gpu, d, 0, (1 << 18) + 1, NULL), TDM_EUNSUPPORTED);
    ops->buf_free(gpu, d);
    tdm_sampler_free(&smp);
    free(logits);
}

/* Hostile floats, from any source (the model included): NaN, infinities and huge finite
 * logits, with every kind of parameters and a temperature far below the floor. The device must
 * never choose a NaN, must give the host's token wherever the choice is forced (a +inf, nothing
 * finite, greedy) and must never report a NaN log-probability. */
static void test_hostile_floats(void **state)
{
    (void)state;
    if (!gpu) {
        print_message("SKIP: %s\n", skip_reason);
        skip();
    }
    enum { V = 1000, SHAPES = 7, PARAMS = 5, POS = 8, N = SHAPES * PARAMS * POS };
    const float nan = NAN, inf = INFINITY;
    float *rows = malloc(sizeof(float) * SHAPES * V);
    assert_non_null(rows);
    for (int sh = 0; sh < SHAPES; sh++) {
        float *r = rows + (size_t)sh * V;
        for (int i = 0; i < V; i++) {
            float g = 3.0f * rng_normal();
            switch (sh) {
            case 0:
                r[i] = i % 10 == 3 ? nan : g;
                break; /* NaN beside finite */
            case 1:
                r[i] = nan;
                break; /* nothing finite */
            case 2:
                r[i] = i == 17 || i == 500 ? inf : i % 7 ? g : nan;
                break; /* +inf wins */
            case 3:
                r[i] = -inf;
                break;
            case 4:
                r[i] = i == 999 ? 3.4e38f : i % 2 ? 3e38f : -3e38f;
                break; /* huge */
            case 5:
                r[i] = i == 2 ? -2e30f : -1e30f;
                break;
            default:
                r[i] = i % 2 ? nan : -inf;
                break;
            }
        }
    }
    static const int greedy_token[SHAPES] = {-1, 0, 17, 0, 999, 0, 0};
    struct tdm_sampling_params ps[PARAMS];
    for (int q = 0; q < PARAMS; q++)
        ps[q] = tdm_sampling_defaults();
    ps[1].temperature = 1.0f;
    ps[2].temperature = 0.7f, ps[2].top_k = 3, ps[2].top_p = 0.9f, ps[2].min_p = 0.1f;
    ps[3].temperature = 100.0f, ps[3].repetition_penalty = 2.0f, ps[3].presence_penalty = 2.0f;
    ps[4].temperature = 1e-40f, ps[4].top_k = 5; /* the reproducer: below the floor */
    struct tdm_sampler smp[SHAPES * PARAMS];
    struct tdm_sample_row dev[N], ref[N];
    float *logits = malloc(sizeof(float) * N * V), *host = malloc(sizeof(float) * N * V);
    assert_non_null(logits);
    assert_non_null(host);
    for (int sh = 0; sh < SHAPES; sh++)
        for (int q = 0; q < PARAMS; q++) {
            struct tdm_sampler *m = &smp[sh * PARAMS + q];
            assert_int_equal(tdm_sampler_init(m, &ps[q], 7, V), TDM_OK);
            tdm_sampler_accept(m, 17, true);
            tdm_sampler_accept(m, 6, false);
            for (int k = 0; k < POS; k++) {
                int r = (sh * PARAMS + q) * POS + k;
                memcpy(logits + (size_t)r * V, rows + (size_t)sh * V, sizeof(float) * V);
                dev[r] = (struct tdm_sample_row){
                    .smp = m, .position = (uint32_t)(3 + k), .n_top = k % 2 ? 5 : 0};
                ref[r] = dev[r];
            }
        }
    memcpy(host, logits, sizeof(float) * N * V);
    const struct tdm_backend_i *ops = gpu->iface;
    float *d = ops->buf_alloc(gpu, sizeof(float) * N * V);
    assert_non_null(d);
    ops->upload(gpu, d, logits, sizeof(float) * N * V);
    assert_int_equal(ops->sample(gpu, d, N, V, dev), TDM_OK);
    struct tdm_sample_scratch scratch;
    assert_int_equal(tdm_sample_scratch_init(&scratch, V), TDM_OK);
    int forced = 0, same = 0;
    for (int r = 0; r < N; r++) {
        int sh = r / (PARAMS * POS), q = (r / POS) % PARAMS;
        tdm_sample_row_host(&ref[r], host + (size_t)r * V, &scratch);
        const float raw = rows[(size_t)sh * V + dev[r].token];
        assert_true(dev[r].token >= 0 && dev[r].token < V);
        assert_false(isnan(dev[r].logprob));
        for (int k = 0; k < dev[r].n_top; k++) {
            assert_false(isnan(dev[r].top_lps[k]));
            assert_true(dev[r].top_ids[k] >= 0 && dev[r].top_ids[k] < V);
        }
        if (sh == 0) assert_false(isnan(raw)); /* NaN is never chosen beside finite values */
        bool is_forced = sh != 0 && sh != 4 && sh != 5 ? true : q == 0 || q == 4;
        if (sh == 5 && q != 0 && q != 4) is_forced = false;
        if (is_forced) {
            forced++;
            assert_int_equal(dev[r].token, ref[r].token);
            if (greedy_token[sh] >= 0) assert_int_equal(dev[r].token, greedy_token[sh]);
        }
        same += dev[r].token == ref[r].token;
    }
    printf("hostile floats: %d rows, %d forced (all identical to the host), %d/%d identical\n", N,
           forced, same, N);
    assert_true(forced >= N / 2);
    tdm_sample_scratch_free(&scratch);
    ops->buf_free(gpu, d);
    for (int i = 0; i < SHAPES * PARAMS; i++)
        tdm_sampler_free(&smp[i]);
    free(rows);
    free(logits);
    free(host);
}

/* For the record (never asserted): the time of one sampling call per kind of row, for 1 and 64
 * rows of a 128,256 vocabulary of normal logits. */
static void test_timing(void **state)
{
    (void)state;
    if (!gpu) {
        print_message("SKIP: %s\n", skip_reason);
        skip();
    }
    enum { V = 128256, N = 64 };
    float *logits = malloc((size_t)N * V * sizeof(float));
    assert_non_null(logits);
    for (int r = 0; r < N; r++)
        fill_row(logits + (size_t)r * V, V, NORMAL);
    const struct tdm_backend_i *ops = gpu->iface;
    float *d = ops->buf_alloc(gpu, sizeof(float) * N * V);
    assert_non_null(d);
    struct {
        const char *name;
        float t, top_p, min_p, rep;
        int top_k, n_top;
    } kinds[] = {
        {"greedy", 0.0f, 1.0f, 0.0f, 1.0f, 0, -1},
        {"greedy + logprob", 0.0f, 1.0f, 0.0f, 1.0f, 0, 0},
        {"greedy + top-20 logprobs", 0.0f, 1.0f, 0.0f, 1.0f, 0, 20},
        {"T=1", 1.0f, 1.0f, 0.0f, 1.0f, 0, -1},
        {"T=1 min_p=0.05", 1.0f, 1.0f, 0.05f, 1.0f, 0, -1},
        {"T=0.7 top_p=0.9", 0.7f, 0.9f, 0.0f, 1.0f, 0, -1},
        {"T=0.7 top_k=50", 0.7f, 1.0f, 0.0f, 1.0f, 50, -1},
        {"T=0.7 top_k=50 top_p=0.9", 0.7f, 0.9f, 0.0f, 1.0f, 50, -1},
        {"T=1 top_k=5000", 1.0f, 1.0f, 0.0f, 1.0f, 5000, -1},
        {"T=0.7 top_p=0.9 penalties", 0.7f, 0.9f, 0.0f, 1.2f, 0, -1},
    };
    struct tdm_sampler smp[N];
    struct tdm_sample_row rows[N];
    for (size_t k = 0; k < TDM_ARRAY_LEN(kinds); k++) {
        struct tdm_sampling_params p = tdm_sampling_defaults();
        p.temperature = kinds[k].t;
        p.top_p = kinds[k].top_p;
        p.min_p = kinds[k].min_p;
        p.top_k = kinds[k].top_k;
        p.repetition_penalty = kinds[k].rep;
        p.seed = 1;
        for (int r = 0; r < N; r++) {
            assert_int_equal(tdm_sampler_init(&smp[r], &p, (uint64_t)r, V), TDM_OK);
            for (int i = 0; smp[r].out_count && i < 512; i++)
                tdm_sampler_accept(&smp[r], (int32_t)(rng_u64() % V), i < 400);
            rows[r] =
                (struct tdm_sample_row){.smp = &smp[r], .position = 9, .n_top = kinds[k].n_top};
        }
        double us[2];
        for (int j = 0; j < 2; j++) {
            int n = j ? N : 1;
            double best = 1e30;
            for (int rep = 0; rep < 5; rep++) {
                ops->upload(gpu, d, logits, sizeof(float) * (size_t)n * V);
                ops->sync(gpu);
                double t0 = tdm_now_s();
                assert_int_equal(ops->sample(gpu, d, n, V, rows), TDM_OK);
                double dt = tdm_now_s() - t0;
                if (dt < best) best = dt;
            }
            us[j] = best * 1e6;
        }
        printf("sampling time, vocab %d, %-28s 1 row %7.1f us, %d rows %7.1f us\n", V,
               kinds[k].name, us[0], N, us[1]);
        for (int r = 0; r < N; r++)
            tdm_sampler_free(&smp[r]);
    }
    ops->buf_free(gpu, d);
    free(logits);
}

int main(void)
{
    if (tdm_backend_cuda_create(NULL, &gpu) != TDM_OK) {
        gpu = NULL;
        snprintf(skip_reason, sizeof skip_reason, "no CUDA backend: %s", tdm_err_msg());
        printf("SKIP: test_cuda_sample: %s\n", skip_reason);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_host), cmocka_unit_test(test_modes_against_host),
        cmocka_unit_test(test_rng_keyed),    cmocka_unit_test(test_hostile_floats),
        cmocka_unit_test(test_timing),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    tdm_backend_destroy(gpu);
    return rc;
}
