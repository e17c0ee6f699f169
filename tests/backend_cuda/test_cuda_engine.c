/*
 * The engine on the CUDA backend against the engine on the CPU backend: a random model built in
 * memory (llama, qwen2 with q/k/v biases, qwen3 with q/k norms; Q8_0 and BF16 matrices), many
 * prompts of random lengths prefilled together (some in chunks over their own prefix), then
 * decode steps of all sequences in one batch (CUDA graphs, padded to a bucket), teacher-forced
 * with the CPU's greedy tokens so the two runs see the same inputs.
 *
 * Tolerance (documented in DESIGN.md §8): the CUDA backend rounds weights and matmul inputs to
 * bf16, so per row we require max|logit_cuda - logit_cpu| <= 5e-2 * max|logit_cpu| (measured
 * values are printed), and greedy agreement (argmax equal) on at least 90% of rows; the
 * figures are printed for the record. CUDA graphs against op-by-op CUDA: 2e-3 of the row max
 * (the same kernels; only cuBLASLt's choice for the padded shape may differ). The layer counter
 * must read n_layers after every forward call, graphs or not.
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

#include "tandem/engine.h"
#include "lib/test_rng.h"
#include "lib/tiny_model.h"

enum { D = 256, NH = 8, NKV = 2, HD = 32, FF = 512, VOCAB = 1000, NL = 3, NSEQ = 24, NDEC = 10 };

static char skip_reason[512];
static bool have_gpu;
/* Every GPU test starts so: skipped with the reason when there is no GPU. */
#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!have_gpu) {                                                                           \
            print_message("SKIP: %s\n", skip_reason);                                              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static uint64_t rng_state = 0x13198A2E03707344ull;
static uint64_t rng_u64(void)
{
    return tdm_test_splitmix64(&rng_state);
}

/* The tiny model: lib/tiny_model.c builds it (weights scaled by 1/sqrt(fan-in), seeded). */
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
                                    .max_ctx = 512,
                                    .rope_neox = arch != TDM_ARCH_LLAMA,
                                    .fan_in_scale = true,
                                    .seed = rng_u64()};
    tdm_test_model_make(&tiny, &o);
    *m = tiny.m;
}

static void free_model(void)
{
    tdm_test_model_free(&tiny);
}

struct run {
    tdm_engine_t *e;
    struct tdm_kv_seq kv[NSEQ];
};

/* An engine of kind (or on backend), batch-invariant or not, over tp ranks (0: none). */
static void run_open_tp(struct run *r, const struct tdm_model *m, int kind, tdm_backend_t *backend,
                        bool bi, int tp)
{
    memset(r, 0, sizeof *r);
    struct tdm_engine_opts o = {.n_threads = 2,
                                .batch_invariant = bi,
                                .page_size = 16,
                                .kv_pages = 2048,
                                .max_batch_tokens = 4096,
                                .max_seqs = NSEQ,
                                .max_logit_rows = 64,
                                .count_layers = true,
                                .backend = backend,
                                .backend_kind = kind,
                                .tp = tp};
    assert_int_equal(tdm_engine_create(m, &o, &r->e), TDM_OK);
    assert_int_equal(tdm_engine_tp_ranks(r->e), tp > 1 ? tp : 1);
}

static void run_open_bi(struct run *r, const struct tdm_model *m, int kind, tdm_backend_t *backend,
                        bool bi)
{
    run_open_tp(r, m, kind, backend, bi, 0);
}

/* the CPU batch-invariant (the fidelity references), CUDA in its default mode */
static void run_open(struct run *r, const struct tdm_model *m, int kind, tdm_backend_t *backend)
{
    run_open_bi(r, m, kind, backend, kind == TDM_BACKEND_CPU);
}

static void run_close(struct run *r)
{
    for (int s = 0; s < NSEQ; s++)
        tdm_kv_seq_release(tdm_engine_kv(r->e), &r->kv[s]);
    tdm_engine_destroy(r->e);
}

/* Row error: max|a - b| / max|b|. */
static double row_err(const float *a, const float *b, int n)
{
    double e = 0, m = 0;
    for (int i = 0; i < n; i++) {
        e = fmax(e, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return e / (m > 0 ? m : 1);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Runs prompts + decode on `n_runs` engines in lockstep, tokens from run 0's greedy choice;
 * compares every other run's logits with run 0's. */
static void lockstep(struct run *runs, int n_runs, double tol, double min_agree, const char *what)
{
    static int32_t toks[NSEQ][256];
    int len[NSEQ];
    for (int s = 0; s < NSEQ; s++) {
        len[s] = 1 + (int)(rng_u64() % 150);
        for (int i = 0; i < len[s]; i++)
            toks[s][i] = (int32_t)(rng_u64() % VOCAB);
        for (int r = 0; r < n_runs; r++)
            assert_int_equal(
                tdm_kv_seq_reserve(tdm_engine_kv(runs[r].e), &runs[r].kv[s], len[s] + NDEC + 1),
                TDM_OK);
    }
    float *lg[4];
    for (int r = 0; r < n_runs; r++)
        lg[r] = malloc((size_t)NSEQ * VOCAB * sizeof(float));
    double worst = 0;
    int agree = 0, rows = 0;
    /* prefill: even sequences whole, odd ones in chunks of 37 over their own prefix */
    int done[NSEQ] = {0};
    for (bool more = true; more;) {
        struct tdm_batch_seq bs[NSEQ];
        int nb = 0, map[NSEQ];
        more = false;
        for (int s = 0; s < NSEQ; s++) {
            if (done[s] >= len[s]) continue;
            const int n = s % 2 ? TDM_MIN(37, len[s] - done[s]) : len[s];
            bs[nb] = (struct tdm_batch_seq){.tokens = toks[s] + done[s],
                                            .n_tokens = n,
                                            .pos0 = done[s],
                                            .n_logits = done[s] + n == len[s]};
            map[nb++] = s;
            done[s] += n;
            more |= done[s] < len[s];
        }
        int n_logit_rows = 0;
        for (int r = 0; r < n_runs; r++) {
            for (int i = 0; i < nb; i++) {
                bs[i].pages = runs[r].kv[map[i]].pages;
                bs[i].n_pages = runs[r].kv[map[i]].n_pages;
            }
            struct tdm_batch b = {bs, nb};
            assert_int_equal(tdm_engine_forward(runs[r].e, &b, lg[r], NULL), TDM_OK);
            assert_int_equal(atomic_load(tdm_engine_layer_counter(runs[r].e)), NL);
        }
        for (int i = 0; i < nb; i++)
            n_logit_rows += bs[i].n_logits;
        for (int i = 0; i < n_logit_rows; i++) {
            for (int r = 1; r < n_runs; r++) {
                const double e =
                    row_err(lg[r] + (size_t)i * VOCAB, lg[0] + (size_t)i * VOCAB, VOCAB);
                worst = fmax(worst, e);
                agree += argmax(lg[r] + (size_t)i * VOCAB, VOCAB) ==
                         argmax(lg[0] + (size_t)i * VOCAB, VOCAB);
                rows++;
            }
        }
    }
    /* decode: the first token of each sequence is random, later ones run 0's argmax */
    int32_t next[NSEQ];
    for (int s = 0; s < NSEQ; s++)
        next[s] = (int32_t)(rng_u64() % VOCAB);
    for (int step = 0; step < NDEC; step++) {
        struct tdm_batch_seq bs[NSEQ];
        for (int r = 0; r < n_runs; r++) {
            for (int s = 0; s < NSEQ; s++)
                bs[s] = (struct tdm_batch_seq){.tokens = &next[s],
                                               .n_tokens = 1,
                                               .pos0 = len[s] + step,
                                               .pages = runs[r].kv[s].pages,
                                               .n_pages = runs[r].kv[s].n_pages,
                                               .n_logits = 1};
            /* batch sizes vary over the steps: 24, then 24 - step sequences (graph buckets) */
            struct tdm_batch b = {bs, NSEQ - (step % 3 == 2 ? 7 : 0)};
            assert_int_equal(tdm_engine_forward(runs[r].e, &b, lg[r], NULL), TDM_OK);
            assert_int_equal(atomic_load(tdm_engine_layer_counter(runs[r].e)), NL);
        }
        const int nb = NSEQ - (step % 3 == 2 ? 7 : 0);
        for (int s = 0; s < nb; s++) {
            for (int r = 1; r < n_runs; r++) {
                const double e =
                    row_err(lg[r] + (size_t)s * VOCAB, lg[0] + (size_t)s * VOCAB, VOCAB);
                worst = fmax(worst, e);
                agree += argmax(lg[r] + (size_t)s * VOCAB, VOCAB) ==
                         argmax(lg[0] + (size_t)s * VOCAB, VOCAB);
                rows++;
            }
            next[s] = (int32_t)argmax(lg[0] + (size_t)s * VOCAB, VOCAB);
        }
        /* sequences left out of this step repeat their position next step: skip them by
         * giving them the same pos0 again (their KV slot is simply rewritten) */
        if (nb < NSEQ)
            for (int s = nb; s < NSEQ; s++)
                len[s]--;
    }
    printf("%s: %d rows, worst row error %.3g (max |diff| / max |logit|), greedy agreement "
           "%d/%d = %.1f%%\n",
           what, rows, worst, agree, rows, 100.0 * agree / rows);
    for (int r = 0; r < n_runs; r++)
        free(lg[r]);
    assert_true(worst <= tol);
    assert_true((double)agree >= min_agree * rows);
}

static void cpu_vs_cuda(enum tdm_dtype dt, enum tdm_arch arch)
{
    NEED_GPU();
    struct tdm_model m;
    make_model(&m, dt, arch);
    struct run runs[3];
    struct tdm_backend_cuda_opts go = {.no_graphs = true};
    tdm_backend_t *eager = NULL;
    assert_int_equal(tdm_backend_cuda_create(&go, &eager), TDM_OK);
    run_open(&runs[0], &m, TDM_BACKEND_CPU, NULL);
    run_open(&runs[1], &m, TDM_BACKEND_CUDA, NULL);
    run_open(&runs[2], &m, TDM_BACKEND_CUDA, eager);
    char what[96];
    snprintf(what, sizeof what, "cpu vs cuda (graphs) and cuda (op by op), %s %s",
             tdm_arch_name(arch), tdm_dtype_name(dt));
    lockstep(runs, 3, 5e-2, 0.9, what);
    for (int r = 0; r < 3; r++)
        run_close(&runs[r]);
    /* graphs against op by op, tighter */
    run_open(&runs[0], &m, TDM_BACKEND_CUDA, eager);
    run_open(&runs[1], &m, TDM_BACKEND_CUDA, NULL);
    snprintf(what, sizeof what, "cuda op by op vs cuda graphs, %s %s", tdm_arch_name(arch),
             tdm_dtype_name(dt));
    lockstep(runs, 2, 2e-3, 0.97, what);
    run_close(&runs[0]);
    run_close(&runs[1]);
    tdm_backend_destroy(eager);
    free_model();
}

static void test_llama_q8(void **state)
{
    (void)state;
    cpu_vs_cuda(TDM_DTYPE_Q8_0, TDM_ARCH_LLAMA);
}
static void test_qwen2_bf16(void **state)
{
    (void)state;
    cpu_vs_cuda(TDM_DTYPE_BF16, TDM_ARCH_QWEN2);
}
static void test_qwen3_f32(void **state)
{
    (void)state;
    cpu_vs_cuda(TDM_DTYPE_F32, TDM_ARCH_QWEN3);
}

/* --batch-invariant on CUDA (engine-owned backends, graphs on): every sequence's logits are the
 * same bits alone as among the others, at prefill (one prompt a forward call against all at
 * once) and at decode (alone against the whole batch, a graph's bucket); and a chain of K
 * tokens verified in one step gives each token the bits of its own one-token step, which is
 * what makes exact speculation lossless on the GPU. Matrices bf16 and in Q8_0 blocks. */
/* Step `step` of a sequence of bi_case's: its prompt (step 0), then one token a step. */
static struct tdm_batch_seq bi_span(const int32_t *toks, int len, int step,
                                    const struct tdm_kv_seq *kv)
{
    return (struct tdm_batch_seq){.tokens = step ? &toks[len + step - 1] : toks,
                                  .n_tokens = step ? 1 : len,
                                  .pos0 = step ? len + step - 1 : 0,
                                  .pages = kv->pages,
                                  .n_pages = kv->n_pages,
                                  .n_logits = 1};
}

static void bi_case(enum tdm_dtype dt)
{
    struct tdm_model m;
    make_model(&m, dt, TDM_ARCH_LLAMA);
    enum { S = 8, K = 4 };
    struct run alone, together, chain;
    run_open_bi(&alone, &m, TDM_BACKEND_CUDA, NULL, true);
    run_open_bi(&together, &m, TDM_BACKEND_CUDA, NULL, true);
    run_open_bi(&chain, &m, TDM_BACKEND_CUDA, NULL, true);
    static int32_t toks[S][200 + K];
    int len[S];
    for (int s = 0; s < S; s++) {
        len[s] = 1 + (int)(rng_u64() % 150);
        for (int i = 0; i < len[s] + K; i++)
            toks[s][i] = (int32_t)(rng_u64() % VOCAB);
        struct run *rs[] = {&alone, &together, &chain};
        for (int r = 0; r < 3; r++)
            assert_int_equal(
                tdm_kv_seq_reserve(tdm_engine_kv(rs[r]->e), &rs[r]->kv[s], len[s] + K + 1), TDM_OK);
    }
    float *la = malloc((size_t)S * (K + 1) * VOCAB * sizeof(float));
    float *lt = malloc((size_t)S * VOCAB * sizeof(float));
    float *lc = malloc((size_t)S * K * VOCAB * sizeof(float));
    int differ = 0;
    /* alone: each prompt, then K decode steps, one sequence a call */
    for (int s = 0; s < S; s++)
        for (int step = 0; step <= K; step++) {
            struct tdm_batch_seq bs = bi_span(toks[s], len[s], step, &alone.kv[s]);
            struct tdm_batch b = {&bs, 1};
            assert_int_equal(
                tdm_engine_forward(alone.e, &b, la + ((size_t)s * (K + 1) + step) * VOCAB, NULL),
                TDM_OK);
        }
    /* together: all prompts in one call, then all sequences a step */
    for (int step = 0; step <= K; step++) {
        struct tdm_batch_seq bs[S];
        for (int s = 0; s < S; s++)
            bs[s] = bi_span(toks[s], len[s], step, &together.kv[s]);
        struct tdm_batch b = {bs, S};
        assert_int_equal(tdm_engine_forward(together.e, &b, lt, NULL), TDM_OK);
        for (int s = 0; s < S; s++)
            differ += memcmp(lt + (size_t)s * VOCAB, la + ((size_t)s * (K + 1) + step) * VOCAB,
                             VOCAB * sizeof(float)) != 0;
    }
    /* chain: all prompts, then the K tokens of every sequence verified in one step */
    struct tdm_batch_seq bs[S];
    for (int s = 0; s < S; s++)
        bs[s] = (struct tdm_batch_seq){.tokens = toks[s],
                                       .n_tokens = len[s],
                                       .pages = chain.kv[s].pages,
                                       .n_pages = chain.kv[s].n_pages,
                                       .n_logits = 1};
    struct tdm_batch b = {bs, S};
    assert_int_equal(tdm_engine_forward(chain.e, &b, lt, NULL), TDM_OK);
    for (int s = 0; s < S; s++)
        bs[s] = (struct tdm_batch_seq){.tokens = &toks[s][len[s]],
                                       .n_tokens = K,
                                       .pos0 = len[s],
                                       .pages = chain.kv[s].pages,
                                       .n_pages = chain.kv[s].n_pages,
                                       .n_logits = K};
    assert_int_equal(tdm_engine_forward(chain.e, &b, lc, NULL), TDM_OK);
    int chain_differ = 0;
    for (int s = 0; s < S; s++)
        for (int j = 0; j < K; j++)
            chain_differ +=
                memcmp(lc + ((size_t)s * K + j) * VOCAB, la + ((size_t)s * (K + 1) + j + 1) * VOCAB,
                       VOCAB * sizeof(float)) != 0;
    printf("cuda --batch-invariant, llama %s: %d of %d rows differ alone vs together, %d of %d "
           "verified chain rows differ from their one-token steps\n",
           tdm_dtype_name(dt), differ, S * (K + 1), chain_differ, S * K);
    free(la), free(lt), free(lc);
    run_close(&alone), run_close(&together), run_close(&chain);
    free_model();
    assert_int_equal(differ, 0);
    assert_int_equal(chain_differ, 0);
}

static void test_batch_invariant(void **state)
{
    (void)state;
    NEED_GPU();
    bi_case(TDM_DTYPE_BF16);
    bi_case(TDM_DTYPE_Q8_0);
}

/* Early-exit passes (tdm_engine_out.n_layers, a self drafter's) through CUDA graphs: decode
 * steps alternate 1 layer and all NL, and the graph run must match op by op each time (a graph
 * recorded for one layer count and replayed for the other would be far off). */
static void test_early_exit_graphs(void **state)
{
    (void)state;
    NEED_GPU();
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_Q8_0, TDM_ARCH_LLAMA);
    struct tdm_backend_cuda_opts go = {.no_graphs = true};
    tdm_backend_t *eager = NULL;
    assert_int_equal(tdm_backend_cuda_create(&go, &eager), TDM_OK);
    struct run runs[2];
    run_open(&runs[0], &m, TDM_BACKEND_CUDA, eager);
    run_open(&runs[1], &m, TDM_BACKEND_CUDA, NULL);
    enum { S = 8, P = 20, STEPS = 8 };
    static int32_t toks[S][P + STEPS];
    for (int s = 0; s < S; s++)
        for (int i = 0; i < P + STEPS; i++)
            toks[s][i] = (int32_t)(rng_u64() % VOCAB);
    float *lg[2];
    for (int r = 0; r < 2; r++) {
        lg[r] = malloc((size_t)S * VOCAB * sizeof(float));
        struct tdm_batch_seq bs[S];
        for (int s = 0; s < S; s++) {
            assert_int_equal(
                tdm_kv_seq_reserve(tdm_engine_kv(runs[r].e), &runs[r].kv[s], P + STEPS), TDM_OK);
            bs[s] = (struct tdm_batch_seq){.tokens = toks[s],
                                           .n_tokens = P,
                                           .pages = runs[r].kv[s].pages,
                                           .n_pages = runs[r].kv[s].n_pages,
                                           .n_logits = 1};
        }
        struct tdm_batch b = {bs, S};
        assert_int_equal(tdm_engine_forward(runs[r].e, &b, lg[r], NULL), TDM_OK);
    }
    double worst = 0;
    for (int step = 0; step < STEPS; step++) {
        int nl = step % 2 ? NL : 1;
        for (int r = 0; r < 2; r++) {
            struct tdm_batch_seq bs[S];
            for (int s = 0; s < S; s++)
                bs[s] = (struct tdm_batch_seq){.tokens = &toks[s][P + step],
                                               .n_tokens = 1,
                                               .pos0 = P + step,
                                               .pages = runs[r].kv[s].pages,
                                               .n_pages = runs[r].kv[s].n_pages,
                                               .n_logits = 1};
            struct tdm_batch b = {bs, S};
            struct tdm_engine_out out = {.logits = lg[r], .n_layers = nl};
            assert_int_equal(tdm_engine_run(runs[r].e, &b, &out), TDM_OK);
            assert_int_equal(atomic_load(tdm_engine_layer_counter(runs[r].e)), nl);
        }
        for (int s = 0; s < S; s++)
            worst =
                fmax(worst, row_err(lg[1] + (size_t)s * VOCAB, lg[0] + (size_t)s * VOCAB, VOCAB));
    }
    printf("early exit, graphs vs op by op: worst row error %.3g\n", worst);
    assert_true(worst <= 2e-3);
    for (int r = 0; r < 2; r++) {
        free(lg[r]);
        run_close(&runs[r]);
    }
    tdm_backend_destroy(eager);
    free_model();
}

/* tdm_engine_launch (the scheduler's overlap): decode steps launched two deep, each naming
 * the tokens the step before it samples as TDM_TOKEN_PREV, its sampling queued after the wait
 * for the step before, give the tokens of the same steps run one at a time with the tokens on
 * the host; and the launches were queued (the engine says so). Sampled at temperature 0.8 with
 * seeds, so a token taken from a wrong row, or a position off by one, shows. */
static void test_launch_ahead(void **state)
{
    (void)state;
    NEED_GPU();
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_BF16, TDM_ARCH_LLAMA);
    enum { S = 6, P = 24, STEPS = 12 };
    struct run runs[2];
    for (int r = 0; r < 2; r++) {
        memset(&runs[r], 0, sizeof runs[r]);
        struct tdm_engine_opts o = {.page_size = 16,
                                    .kv_pages = 512,
                                    .max_batch_tokens = 1024,
                                    .max_seqs = NSEQ,
                                    .max_logit_rows = 64,
                                    .backend_kind = TDM_BACKEND_CUDA};
        assert_int_equal(tdm_engine_create(&m, &o, &runs[r].e), TDM_OK);
    }
    assert_true(tdm_engine_launches_async(runs[1].e));
    struct tdm_sampling_params sp = tdm_sampling_defaults();
    sp.temperature = 0.8f;
    struct tdm_sampler smp[S];
    static int32_t toks[2][S][P + STEPS + 1];
    for (int s = 0; s < S; s++) {
        sp.seed = 1000 + (uint64_t)s;
        assert_int_equal(tdm_sampler_init(&smp[s], &sp, (uint64_t)s + 1, VOCAB), TDM_OK);
        for (int i = 0; i < P; i++)
            toks[0][s][i] = toks[1][s][i] = (int32_t)(rng_u64() % VOCAB);
        for (int r = 0; r < 2; r++)
            assert_int_equal(
                tdm_kv_seq_reserve(tdm_engine_kv(runs[r].e), &runs[r].kv[s], P + STEPS + 1),
                TDM_OK);
    }
    /* steps[k]: the prompt (k 0), then one token a step; rows[r][k % 3]: its samples */
    static struct tdm_sample_row rows[2][3][S];
    static int32_t prev_ref[S];
    int launched = 0, waited = 0;
    for (int k = 0; k <= STEPS; k++) {
        for (int r = 0; r < 2; r++) {
            struct tdm_batch_seq bs[S];
            for (int s = 0; s < S; s++) {
                const int pos0 = k ? P + k - 1 : 0;
                if (r == 1 && k) prev_ref[s] = TDM_TOKEN_PREV(s);
                bs[s] =
                    (struct tdm_batch_seq){.tokens = r == 1 && k ? &prev_ref[s] : &toks[r][s][pos0],
                                           .n_tokens = k ? 1 : P,
                                           .pos0 = pos0,
                                           .pages = runs[r].kv[s].pages,
                                           .n_pages = runs[r].kv[s].n_pages,
                                           .n_logits = 1};
                rows[r][k % 3][s] = (struct tdm_sample_row){
                    .smp = &smp[s], .position = (uint32_t)(pos0 + bs[s].n_tokens), .n_top = -1};
            }
            struct tdm_batch b = {bs, S};
            struct tdm_engine_out out = {.samples = rows[r][k % 3]};
            if (r == 0) {
                assert_int_equal(tdm_engine_run(runs[0].e, &b, &out), TDM_OK);
                for (int s = 0; s < S; s++)
                    toks[0][s][P + k] = rows[0][k % 3][s].token;
                continue;
            }
            /* the scheduler's order: this step's forward pass, the wait for the step before,
             * then this step's sampling */
            assert_int_equal(tdm_engine_launch(runs[1].e, &b, &out), TDM_OK);
            launched++;
            if (k > 0) {
                assert_int_equal(tdm_engine_wait(runs[1].e), TDM_OK);
                for (int s = 0; s < S; s++)
                    toks[1][s][P + waited] = rows[1][waited % 3][s].token;
                waited++;
            }
            assert_int_equal(tdm_engine_launch_sample(runs[1].e), TDM_OK);
        }
    }
    assert_int_equal(tdm_engine_wait(runs[1].e), TDM_OK);
    for (int s = 0; s < S; s++)
        toks[1][s][P + waited] = rows[1][waited % 3][s].token;
    waited++;
    assert_int_equal(launched, waited);
    int differ = 0;
    for (int s = 0; s < S; s++)
        for (int i = 0; i <= STEPS; i++)
            differ += toks[0][s][P + i] != toks[1][s][P + i];
    printf("launched two deep vs one at a time: %d of %d sampled tokens differ\n", differ,
           S * (STEPS + 1));
    assert_int_equal(differ, 0);
    /* a TDM_TOKEN_PREV past the last step's rows is refused before any work */
    struct tdm_batch_seq bad = {.tokens = &prev_ref[0],
                                .n_tokens = 1,
                                .pos0 = P + STEPS,
                                .pages = runs[1].kv[0].pages,
                                .n_pages = runs[1].kv[0].n_pages,
                                .n_logits = 1};
    prev_ref[0] = TDM_TOKEN_PREV(S);
    struct tdm_batch bb = {&bad, 1};
    struct tdm_engine_out bo = {.samples = rows[1][0]};
    assert_int_equal(tdm_engine_launch(runs[1].e, &bb, &bo), TDM_EINVAL);
    assert_int_equal(tdm_engine_run(runs[1].e, &bb, &bo), TDM_EINVAL);
    for (int s = 0; s < S; s++)
        tdm_sampler_free(&smp[s]);
    for (int r = 0; r < 2; r++)
        run_close(&runs[r]);
    free_model();
}

/* Engines come and go on one backend (a drafter per configuration in bench spec, one per k in
 * train-mtp's validation): a new engine may get a freed one's address, and must never replay
 * the graphs recorded for it (their buffers are gone). Each round's engine runs a prompt and
 * decode steps, which graphs record, against an engine on a backend without graphs. */
static void test_engines_come_and_go(void **state)
{
    (void)state;
    NEED_GPU();
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_Q8_0, TDM_ARCH_LLAMA);
    struct tdm_backend_cuda_opts go = {.no_graphs = true};
    tdm_backend_t *eager = NULL, *shared = NULL;
    assert_int_equal(tdm_backend_cuda_create(&go, &eager), TDM_OK);
    assert_int_equal(tdm_backend_cuda_create(NULL, &shared), TDM_OK);
    enum { S = 4, P = 12, STEPS = 4, ROUNDS = 4 };
    static int32_t toks[S][P + STEPS];
    float *lg[2];
    for (int r = 0; r < 2; r++)
        lg[r] = malloc((size_t)S * VOCAB * sizeof(float));
    double worst = 0;
    const void *seen[ROUNDS];
    int reused = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (int s = 0; s < S; s++)
            for (int i = 0; i < P + STEPS; i++)
                toks[s][i] = (int32_t)(rng_u64() % VOCAB);
        struct run runs[2];
        run_open(&runs[0], &m, TDM_BACKEND_CUDA, eager);
        run_open(&runs[1], &m, TDM_BACKEND_CUDA, shared);
        seen[round] = runs[1].e;
        for (int q = 0; q < round; q++)
            reused += seen[q] == seen[round];
        for (int step = -1; step < STEPS; step++) {
            for (int r = 0; r < 2; r++) {
                struct tdm_batch_seq bs[S];
                for (int s = 0; s < S; s++) {
                    if (step < 0)
                        assert_int_equal(
                            tdm_kv_seq_reserve(tdm_engine_kv(runs[r].e), &runs[r].kv[s], P + STEPS),
                            TDM_OK);
                    bs[s] =
                        (struct tdm_batch_seq){.tokens = step < 0 ? toks[s] : &toks[s][P + step],
                                               .n_tokens = step < 0 ? P : 1,
                                               .pos0 = step < 0 ? 0 : P + step,
                                               .pages = runs[r].kv[s].pages,
                                               .n_pages = runs[r].kv[s].n_pages,
                                               .n_logits = 1};
                }
                struct tdm_batch b = {bs, S};
                assert_int_equal(tdm_engine_forward(runs[r].e, &b, lg[r], NULL), TDM_OK);
            }
            for (int s = 0; s < S; s++)
                worst = fmax(worst,
                             row_err(lg[1] + (size_t)s * VOCAB, lg[0] + (size_t)s * VOCAB, VOCAB));
        }
        for (int r = 0; r < 2; r++)
            run_close(&runs[r]);
    }
    printf("engines come and go on one backend: %d rounds (an engine at a freed one's address %d "
           "times), graphs vs op by op: worst row error %.3g\n",
           ROUNDS, reused, worst);
    assert_true(worst <= 2e-3);
    for (int r = 0; r < 2; r++)
        free(lg[r]);
    tdm_backend_destroy(shared);
    tdm_backend_destroy(eager);
    free_model();
}

/* Tensor parallelism on CUDA ranks (engine.c, cuda_tp.c): --tp 2 and --tp 4 (2 KV heads: two
 * replica sets) against --tp 1 on the same model, in lockstep. On one GPU the ranks share it
 * (the peer all-reduce, no graphs); with a GPU a rank, NCCL and graphs. The ranks multiply
 * other shapes than --tp 1 (fewer heads and MLP columns each; the sums come from the
 * all-reduce), so the tolerance is CPU-vs-CUDA's. Then a pool sized by the ranks' own memory
 * plans: one page count in every rank's pool. */
static void test_tp_ranks(void **state)
{
    (void)state;
    NEED_GPU();
    struct tdm_model m;
    make_model(&m, TDM_DTYPE_Q8_0, TDM_ARCH_LLAMA);
    struct run runs[3];
    run_open_tp(&runs[0], &m, TDM_BACKEND_CUDA, NULL, false, 1);
    run_open_tp(&runs[1], &m, TDM_BACKEND_CUDA, NULL, false, 2);
    run_open_tp(&runs[2], &m, TDM_BACKEND_CUDA, NULL, false, 4);
    lockstep(runs, 3, 5e-2, 0.9, "cuda --tp 1 vs --tp 2 and --tp 4, llama Q8_0");
    for (int r = 0; r < 3; r++)
        run_close(&runs[r]);
    /* pools from the memory plans (kv_pages 0): every rank's the same page count */
    struct tdm_engine_opts o = {.page_size = 16,
                                .max_batch_tokens = 256,
                                .max_seqs = 8,
                                .gpu_memory_fraction = 0.3,
                                .backend_kind = TDM_BACKEND_CUDA,
                                .tp = 2};
    tdm_engine_t *e = NULL;
    assert_int_equal(tdm_engine_create(&m, &o, &e), TDM_OK);
    const int64_t p0 = tdm_kv_pool_config(tdm_engine_rank_kv(e, 0))->n_pages;
    const int64_t p1 = tdm_kv_pool_config(tdm_engine_rank_kv(e, 1))->n_pages;
    printf("--tp 2 from the memory plans: %lld and %lld pages\n", (long long)p0, (long long)p1);
    assert_true(p0 > 0);
    assert_int_equal(p0, p1);
    tdm_engine_destroy(e);
    free_model();
}

static void test_create_error(void **state)
{
    (void)state;
    tdm_backend_t *b = NULL;
    struct tdm_backend_cuda_opts o = {.device = 4096};
    assert_int_not_equal(tdm_backend_cuda_create(&o, &b), TDM_OK);
    assert_null(b);
    assert_true(strlen(tdm_err_msg()) > 0);
}

int main(void)
{
    tdm_backend_t *probe = NULL;
    if (tdm_backend_cuda_create(NULL, &probe) == TDM_OK) {
        have_gpu = true;
        tdm_backend_destroy(probe);
    } else {
        snprintf(skip_reason, sizeof skip_reason, "no CUDA backend: %s", tdm_err_msg());
        printf("SKIP: test_cuda_engine: %s\n", skip_reason);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_error),      cmocka_unit_test(test_llama_q8),
        cmocka_unit_test(test_qwen2_bf16),        cmocka_unit_test(test_qwen3_f32),
        cmocka_unit_test(test_early_exit_graphs), cmocka_unit_test(test_engines_come_and_go),
        cmocka_unit_test(test_batch_invariant),   cmocka_unit_test(test_launch_ahead),
        cmocka_unit_test(test_tp_ranks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
