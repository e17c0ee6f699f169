/*
 * Token trees (EAGLE-2's verification, spec.h and sched.h) on the real engine and scheduler
 * over tiny random models:
 *   - the engine: every token of a tree span gives, bit for bit, the logits of the chain that
 *     is its path (the prefix, then its ancestors), alone and beside another sequence, at
 *     random tree shapes; malformed trees are refused before any KV is written;
 *   - the scheduler, exact acceptance: an oracle tree drafter that hides the target's own
 *     continuation among wrong siblings (often not as the first child, and sometimes nowhere)
 *     gives every request the tokens, log-probabilities and top log-probabilities of the run
 *     without speculation, for every sampling setting (penalties included: each tree row's
 *     penalties see its own path only), with a pool small enough to preempt; drafts are kept
 *     from other children than the first; the pool ends at its baseline. Log-probabilities of
 *     later positions read the KV the commit moved into place, so a compaction that left a
 *     wrong branch's KV there, or none, changes them;
 *   - the scheduler, rejection acceptance (multi-draft rejection over each node's children,
 *     TDM_SAMPLE_TREE): the joint distribution of two outputs that come out of a fixed tree,
 *     against the target's exact distribution by Pearson's chi-squared at significance 0.001,
 *     and the test's power: the same counts against "the first candidate always kept".
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

#include "lib/test_rng.h"
#include "lib/tiny_model.h"
#include "tandem/engine.h"
#include "tandem/sched.h"
#include "tandem/spec.h"

enum { NL = 3, VOCAB = 64, PS = 4, MAX_OUT = 32, N_REQ = 4, N_PROMPT = 10, TOPLP = 3 };

static struct tdm_test_model tiny;

static void make_model(uint64_t seed, int vocab)
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

static tdm_engine_t *make_engine(int64_t kv_pages)
{
    struct tdm_engine_opts o = {.n_threads = 1,
                                .batch_invariant = true,
                                .page_size = PS,
                                .kv_pages = kv_pages,
                                .max_batch_tokens = 160,
                                .max_seqs = 8,
                                .max_logit_rows = 160};
    tdm_engine_t *e = NULL;
    assert_int_equal(tdm_engine_create(&tiny.m, &o, &e), TDM_OK);
    return e;
}

/* ---- the engine: a tree span's rows are its paths' chains ---- */

struct tree {
    int n; /* span tokens: the root (a chain token) and n - 1 nodes */
    int32_t tok[TDM_TREE_MAX_NODES + 1], pos[TDM_TREE_MAX_NODES + 1];
    int32_t slot[TDM_TREE_MAX_NODES + 1], parent[TDM_TREE_MAX_NODES + 1];
    int32_t node_slot[TDM_TREE_MAX_NODES]; /* the nodes' slots: span token j + 1's */
    uint64_t mask[TDM_TREE_MAX_NODES + 1];
    struct tdm_batch_tree bt;
};

/* A random tree of n span tokens over a prefix of P positions, in pages[]: token i > 0
 * continues a random earlier one (its depth at most 8), in the slot of position P + i. */
static void random_tree(uint64_t *rng, struct tree *t, int n, int P, const int32_t *pages)
{
    t->n = n;
    for (int i = 0; i < n; i++) {
        t->tok[i] = (int32_t)(tdm_test_splitmix64(rng) % VOCAB);
        t->slot[i] = pages[(P + i) / PS] * PS + (P + i) % PS;
        if (i == 0) {
            t->parent[i] = -1;
            t->pos[i] = P;
            t->mask[i] = 0;
            continue;
        }
        t->node_slot[i - 1] = t->slot[i];
        int par;
        do
            par = (int)(tdm_test_splitmix64(rng) % (uint64_t)i);
        while (t->pos[par] - P >= 8);
        t->parent[i] = par;
        t->pos[i] = t->pos[par] + 1;
        t->mask[i] = t->mask[par] | (uint64_t)1 << (i - 1);
    }
    t->bt = (struct tdm_batch_tree){
        .positions = t->pos, .mask = t->mask, .node_slots = t->node_slot, .n_nodes = n - 1};
}

static void test_engine_tree_equals_chains(void **state)
{
    (void)state;
    make_model(5, VOCAB);
    tdm_engine_t *e = make_engine(256);
    uint64_t rng = 77;
    int32_t pages_a[32], pages_b[32], pages_c[32];
    for (int i = 0; i < 32; i++) {
        pages_a[i] = i;
        pages_b[i] = 64 + i;
        pages_c[i] = 128 + i;
    }
    for (int round = 0; round < 6; round++) {
        const int P = 5 + 7 * round, n = round == 5 ? TDM_TREE_MAX_NODES + 1 : 3 + 11 * round;
        int32_t prefix[64];
        for (int i = 0; i < P; i++)
            prefix[i] = (int32_t)(tdm_test_splitmix64(&rng) % VOCAB);
        struct tdm_batch_seq pre = {
            .tokens = prefix, .n_tokens = P, .pages = pages_a, .n_pages = 32};
        struct tdm_batch b1 = {&pre, 1};
        assert_int_equal(tdm_engine_run(e, &b1, &(struct tdm_engine_out){0}), TDM_OK);
        struct tree t;
        random_tree(&rng, &t, n, P, pages_a);
        float *lg = malloc((size_t)n * VOCAB * sizeof(float));
        float *lg2 = malloc((size_t)n * VOCAB * sizeof(float));
        struct tdm_batch_seq ts = {.tokens = t.tok,
                                   .n_tokens = n,
                                   .pos0 = P,
                                   .pages = pages_a,
                                   .n_pages = 32,
                                   .slots = t.slot,
                                   .n_logits = n,
                                   .tree = &t.bt};
        struct tdm_batch bt = {&ts, 1};
        assert_int_equal(tdm_engine_run(e, &bt, &(struct tdm_engine_out){.logits = lg}), TDM_OK);
        /* again beside another sequence's prefill: the same bits (a row's values are its own) */
        int32_t other[20];
        for (int i = 0; i < 20; i++)
            other[i] = (int32_t)((i * 11 + round) % VOCAB);
        struct tdm_batch_seq two[2] = {
            {.tokens = other, .n_tokens = 20, .pages = pages_c, .n_pages = 32, .n_logits = 1}, ts};
        float *lg3 = malloc((size_t)(n + 1) * VOCAB * sizeof(float));
        struct tdm_batch b2 = {two, 2};
        assert_int_equal(tdm_engine_run(e, &b2, &(struct tdm_engine_out){.logits = lg3}), TDM_OK);
        assert_memory_equal(lg3 + VOCAB, lg, (size_t)n * VOCAB * sizeof(float));
        /* each token against its path as a chain in other pages */
        for (int i = 0; i < n; i++) {
            int32_t chain[64 + 16];
            int path[16], depth = 0;
            for (int x = i; x >= 0; x = t.parent[x])
                path[depth++] = x;
            memcpy(chain, prefix, (size_t)P * sizeof *chain);
            for (int d = 0; d < depth; d++)
                chain[P + d] = t.tok[path[depth - 1 - d]];
            assert_int_equal(t.pos[i], P + depth - 1);
            struct tdm_batch_seq cs = {.tokens = chain,
                                       .n_tokens = P + depth,
                                       .pages = pages_b,
                                       .n_pages = 32,
                                       .n_logits = 1};
            struct tdm_batch bc = {&cs, 1};
            assert_int_equal(tdm_engine_run(e, &bc, &(struct tdm_engine_out){.logits = lg2}),
                             TDM_OK);
            if (memcmp(lg2, lg + (size_t)i * VOCAB, VOCAB * sizeof(float))) {
                print_error("round %d: tree token %d (depth %d) differs from its chain\n", round, i,
                            depth - 1);
                fail();
            }
        }
        free(lg), free(lg2), free(lg3);
    }
    /* malformed trees: refused, and nothing written (the next good run still matches) */
    {
        const int P = 6, n = 6;
        int32_t prefix[6] = {1, 2, 3, 4, 5, 6};
        struct tree t;
        random_tree(&rng, &t, n, P, pages_a);
        struct tdm_batch_seq ts = {.tokens = t.tok,
                                   .n_tokens = n,
                                   .pos0 = P,
                                   .pages = pages_a,
                                   .n_pages = 32,
                                   .slots = t.slot,
                                   .tree = &t.bt};
        struct tdm_batch bt = {&ts, 1};
        struct tdm_engine_out none = {0};
        (void)prefix;
        t.mask[2] ^= (uint64_t)1 << 1; /* a node it does not have, or one it had lost */
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        t.mask[2] ^= (uint64_t)1 << 1;
        t.node_slot[2] += 1; /* token 3's slot is not its node's */
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        t.node_slot[2] -= 1;
        t.mask[4] = 0; /* a chain token after tree tokens */
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        random_tree(&rng, &t, n, P, pages_a);
        t.mask[1] |= (uint64_t)1 << 40; /* past the nodes */
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        random_tree(&rng, &t, n, P, pages_a);
        t.bt.n_nodes = 0;
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        t.bt.n_nodes = n - 1;
        t.node_slot[2] = 256 * PS; /* a node outside the pool */
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        random_tree(&rng, &t, n, P, pages_a);
        ts.slots = NULL;
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_EINVAL);
        ts.slots = t.slot;
        assert_int_equal(tdm_engine_run(e, &bt, &none), TDM_OK);
    }
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

/* ---- the scheduler with an oracle tree drafter ---- */

struct oracle {
    const int32_t (*ref)[MAX_OUT]; /* [N_REQ] the run without speculation */
    uint64_t ids[N_REQ];           /* the requests' ids, by index */
    int n_req;
    bool rejection, fixed; /* fixed: the rejection test's tree */
    int budget;
    uint64_t rng;
    /* what the commits reported */
    long drafted, accepted, off_first, tree_steps, calls;
};

static int req_index(const struct oracle *o, const tdm_req_t *r)
{
    for (int i = 0; i < o->n_req; i++)
        if (o->ids[i] == tdm_req_id(r)) return i;
    fail_msg("a request the oracle does not know");
    return -1;
}

static int32_t other_than(struct oracle *o, int32_t t, int vocab)
{
    int32_t x = (int32_t)(tdm_test_splitmix64(&o->rng) % (uint64_t)(vocab - 1));
    return x >= t ? x + 1 : x;
}

/* Adds a node; returns its index, or -1 when the tree is full. */
static int add_node(struct tdm_sched_draft *x, int parent, int32_t tok)
{
    if (x->n >= x->k) return -1;
    x->out[x->n] = tok;
    x->parent[x->n] = parent;
    return x->n++;
}

/* The oracle's tree: at each depth 1 to 3 siblings, the target's own next token among them at
 * a random rank (one time in six nowhere), the walk going on below it; a wrong sibling gets a
 * wrong child now and then, a branch the target never takes. */
static void oracle_tree(struct oracle *o, struct tdm_sched_draft *x, const int32_t *truth,
                        int n_truth)
{
    int parent = -1;
    for (int depth = 0; depth < x->depth_cap && depth < 8; depth++) {
        const int32_t right = depth < n_truth ? truth[depth] : (int32_t)(o->rng % VOCAB);
        const int sib = 1 + (int)(tdm_test_splitmix64(&o->rng) % 3);
        int at = (int)(tdm_test_splitmix64(&o->rng) % (uint64_t)sib);
        if (tdm_test_splitmix64(&o->rng) % 6 == 0) at = -1; /* the target's token is not there */
        int next = -1;
        for (int s = 0; s < sib; s++) {
            const int32_t tok = s == at ? right : other_than(o, right, VOCAB);
            int me = add_node(x, parent, tok);
            if (me < 0) return;
            if (s == at)
                next = me;
            else if (tdm_test_splitmix64(&o->rng) % 2)
                add_node(x, me, (int32_t)(tdm_test_splitmix64(&o->rng) % VOCAB));
        }
        if (next < 0) return;
        parent = next;
    }
}

/* The rejection test's tree (vocabulary 8): depth 1 [1, 5, 2]; under 1: [3, 6]; under 5: [0]. */
static void fixed_tree(struct tdm_sched_draft *x)
{
    const int a = add_node(x, -1, 1), b = add_node(x, -1, 5);
    add_node(x, -1, 2);
    if (a >= 0) add_node(x, a, 3);
    if (a >= 0) add_node(x, a, 6);
    if (b >= 0) add_node(x, b, 0);
}

static void oracle_propose(void *ctx, struct tdm_sched_draft *d, int n, int base_tokens)
{
    struct oracle *o = ctx;
    (void)base_tokens;
    o->calls++;
    for (int i = 0; i < n; i++) {
        struct tdm_sched_draft *x = &d[i];
        assert_non_null(x->parent);
        x->n = 0;
        x->tree_rejection = o->rejection;
        if (o->budget) x->k = TDM_MIN(x->k, o->budget);
        if (o->fixed) {
            fixed_tree(x);
            continue;
        }
        const int r = req_index(o, x->req), done = x->n_tokens - N_PROMPT;
        oracle_tree(o, x, o->ref[r] + done, MAX_OUT - done);
    }
}

static void oracle_accepted(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                            int n_accepted, int n_published)
{
    struct oracle *o = ctx;
    (void)r;
    assert_true(n_accepted <= n_draft && n_published <= n_accepted + 1);
    if (n_draft) assert_true(st->tree_depth >= 1 && n_accepted <= st->tree_depth);
    o->drafted += n_draft;
    o->accepted += n_accepted;
    o->off_first += st->tree_off_first;
    o->tree_steps += n_draft > 0;
}

static const struct tdm_sched_drafter_i oracle_i = {
    .propose = oracle_propose, .accepted = oracle_accepted, .tree = true};

struct outs {
    int32_t tokens[N_REQ][MAX_OUT];
    float lps[N_REQ][MAX_OUT];
    int32_t top_ids[N_REQ][MAX_OUT * TOPLP];
    float top_lps[N_REQ][MAX_OUT * TOPLP];
    int n_out[N_REQ];
};

static struct tdm_sampling_params settings(int which, uint64_t seed)
{
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.seed = seed;
    if (which == 1) p.temperature = 0.8f;
    if (which == 2) {
        p.temperature = 1.0f;
        p.top_k = 8;
        p.top_p = 0.9f;
    }
    if (which == 3) {
        p.temperature = 0.7f;
        p.repetition_penalty = 1.3f;
        p.presence_penalty = 0.6f;
        p.frequency_penalty = 0.4f;
    }
    return p;
}

/* Runs N_REQ requests to the end, with the oracle (NULL: no drafter). */
static void run(tdm_engine_t *e, struct oracle *o, int k_max, int which, uint64_t seed,
                const int32_t (*prompts)[N_PROMPT], struct outs *out)
{
    memset(out, 0, sizeof *out);
    tdm_kv_pool_t *kv = tdm_engine_kv(e);
    const int64_t base_free = tdm_kv_pool_stats(kv).free;
    struct tdm_sched_opts so = {.max_batch_tokens = 128, .watermark_pages = -1};
    tdm_sched_t *s = NULL;
    assert_int_equal(tdm_sched_create(e, NULL, &so, &s), TDM_OK);
    if (o) assert_int_equal(tdm_sched_set_drafter(s, &oracle_i, o, k_max), TDM_OK);
    tdm_req_t *r[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        struct tdm_req_params p = {.prompt = prompts[i],
                                   .n_prompt = N_PROMPT,
                                   .max_tokens = MAX_OUT,
                                   .ignore_eos = true,
                                   .sampling = settings(which, seed + (uint64_t)i),
                                   .top_logprobs = TOPLP};
        assert_int_equal(tdm_sched_submit(s, &p, &r[i]), TDM_OK);
        if (o) o->ids[i] = tdm_req_id(r[i]);
    }
    if (o) o->n_req = N_REQ;
    for (int step = 0; step < 4000; step++) {
        bool live = false;
        for (int i = 0; i < N_REQ; i++)
            live |= tdm_req_state(r[i]) != TDM_REQ_FINISHED;
        if (!live) break;
        tdm_sched_step(s);
    }
    for (int i = 0; i < N_REQ; i++) {
        struct tdm_req_view v;
        tdm_req_lock(r[i], &v);
        assert_int_equal(v.finish, TDM_FINISH_LENGTH);
        out->n_out[i] = v.n_out;
        memcpy(out->tokens[i], v.tokens, (size_t)v.n_out * sizeof(int32_t));
        memcpy(out->lps[i], v.logprobs, (size_t)v.n_out * sizeof(float));
        memcpy(out->top_ids[i], v.top_ids, (size_t)v.n_out * TOPLP * sizeof(int32_t));
        memcpy(out->top_lps[i], v.top_lps, (size_t)v.n_out * TOPLP * sizeof(float));
        tdm_req_unlock(r[i]);
        tdm_req_release(r[i]);
    }
    tdm_sched_destroy(s);
    assert_int_equal(tdm_kv_pool_stats(kv).free, base_free); /* every page back */
}

static void test_tree_exact_is_lossless(void **state)
{
    (void)state;
    make_model(9, VOCAB);
    int32_t prompts[N_REQ][N_PROMPT];
    uint64_t prng = 3;
    for (int i = 0; i < N_REQ; i++)
        for (int j = 0; j < N_PROMPT; j++)
            prompts[i][j] = (int32_t)(tdm_test_splitmix64(&prng) % VOCAB);
    /* a roomy pool, and one that preempts: 4 requests of up to 42 positions and 64 more of
     * drafts each, in 40 pages of 4 */
    const int64_t pools[] = {256, 40};
    long off_first = 0, accepted = 0, steps = 0;
    for (int pi = 0; pi < 2; pi++) {
        tdm_engine_t *e = make_engine(pools[pi]);
        for (int which = 0; which < 4; which++)
            for (uint64_t seed = 1; seed <= 2; seed++) {
                struct outs ref, got;
                run(e, NULL, 0, which, seed * 5, (const int32_t(*)[N_PROMPT])prompts, &ref);
                struct oracle o = {.ref = (const int32_t(*)[MAX_OUT])ref.tokens,
                                   .rng = seed * 1000 + (uint64_t)which,
                                   .budget = which == 2 ? 5 : 0};
                /* budgets up to the limit (one request's tree may take a step's budget) */
                run(e, &o, seed == 1 ? 12 : TDM_TREE_MAX_NODES, which, seed * 5,
                    (const int32_t(*)[N_PROMPT])prompts, &got);
                for (int i = 0; i < N_REQ; i++) {
                    assert_int_equal(got.n_out[i], MAX_OUT);
                    if (memcmp(got.tokens[i], ref.tokens[i], sizeof got.tokens[i]) ||
                        memcmp(got.lps[i], ref.lps[i], sizeof got.lps[i]) ||
                        memcmp(got.top_ids[i], ref.top_ids[i], sizeof got.top_ids[i]) ||
                        memcmp(got.top_lps[i], ref.top_lps[i], sizeof got.top_lps[i])) {
                        print_error("pool %lld setting %d seed %llu: request %d differs with "
                                    "tree drafts\n",
                                    (long long)pools[pi], which, (unsigned long long)seed, i);
                        fail();
                    }
                }
                assert_true(o.calls > 0 && o.drafted > 0);
                off_first += o.off_first;
                accepted += o.accepted;
                steps += o.tree_steps;
            }
        tdm_engine_destroy(e);
    }
    print_message("tree steps %ld, drafts kept %ld, of them off the first child %ld\n", steps,
                  accepted, off_first);
    /* the oracle's truth is mostly not the first child: the walk took other branches */
    assert_true(accepted > steps && off_first > accepted / 4);
    tdm_test_model_free(&tiny);
}

/* ---- rejection acceptance over trees reproduces the target's distribution ----
 * Vocabulary 8, a 6-token prompt, 4 outputs per request, each request its own seed: the first
 * output comes from the prompt's step; the next ones from a fixed tree (depth 1: [1, 5, 2];
 * under 1: [3, 6]; under 5: [0]) verified in TDM_SAMPLE_TREE rows, the candidates point
 * masses; the second and third outputs are counted (the third is a depth-2 node's when the
 * walk goes down). Their joint distribution, marginal over the first output, is computed exactly
 * from the target's logits (double precision), and compared with the counts by Pearson's
 * chi-squared at significance 0.001 (bins under 5 expected draws pooled). N = 20000 draws: a
 * sampler off by total variation 0.03 moves the statistic's mean by >= 72 against a critical
 * value near 95 for 63 degrees of freedom (the argument of tests/spec/test_spec.c). The power
 * check: the counts against "the first candidate kept whenever the target can draw it" (a
 * verifier that does not renormalise the residual would be near it) are rejected. */
enum { CV = 8, CHI_N = 20000, CHI_BATCH = 8 };

static void softmax_ref(const float *lg, double temp, double *p)
{
    double mx = -1e300, sum = 0;
    for (int v = 0; v < CV; v++)
        mx = lg[v] > mx ? lg[v] : mx;
    for (int v = 0; v < CV; v++)
        sum += (p[v] = exp((lg[v] - mx) / temp));
    for (int v = 0; v < CV; v++)
        p[v] /= sum;
}

static void next_dist(tdm_engine_t *e, const int32_t *prefix, int n, double temp, double *p)
{
    int32_t pages[8] = {200, 201, 202, 203, 204, 205, 206, 207};
    struct tdm_batch_seq q = {
        .tokens = prefix, .n_tokens = n, .pages = pages, .n_pages = 8, .n_logits = 1};
    struct tdm_batch b = {&q, 1};
    float lg[CV];
    assert_int_equal(tdm_engine_run(e, &b, &(struct tdm_engine_out){.logits = lg}), TDM_OK);
    softmax_ref(lg, temp, p);
}

/* joint[a * CV + b]: P(second output a, third b); first_kept: the same when the first
 * candidate of each node is kept whenever p gives it any mass. */
static void joint_ref(tdm_engine_t *e, const int32_t *prompt, double temp, double *joint,
                      double *first_kept)
{
    int32_t pre[9];
    memcpy(pre, prompt, 6 * sizeof *pre);
    double p1[CV], p2[CV], p3[CV];
    next_dist(e, pre, 6, temp, p1);
    memset(joint, 0, CV * CV * sizeof *joint);
    memset(first_kept, 0, CV * CV * sizeof *first_kept);
    for (int t1 = 0; t1 < CV; t1++) {
        pre[6] = t1;
        next_dist(e, pre, 7, temp, p2);
        for (int t2 = 0; t2 < CV; t2++) {
            pre[7] = t2;
            next_dist(e, pre, 8, temp, p3);
            for (int t3 = 0; t3 < CV; t3++)
                joint[t2 * CV + t3] += p1[t1] * p2[t2] * p3[t3];
        }
        /* the biased verifier: token 1 at depth 1 always, then 3 (under 1) always */
        first_kept[1 * CV + 3] += p1[t1];
    }
}

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
    double k = TDM_MAX(bins - 1, 1), z = 3.0902;
    *crit = k * pow(1 - 2 / (9 * k) + z * sqrt(2 / (9 * k)), 3);
    return stat;
}

static void test_tree_rejection_distribution(void **state)
{
    (void)state;
    make_model(21, CV);
    tdm_engine_t *e = make_engine(512);
    const int32_t prompt[6] = {3, 1, 4, 1, 5, 2};
    const double temp = 1.0;
    double joint[CV * CV], biased[CV * CV];
    joint_ref(e, prompt, temp, joint, biased);
    struct tdm_sched_opts so = {.max_batch_tokens = 64, .watermark_pages = -1};
    tdm_sched_t *s = NULL;
    assert_int_equal(tdm_sched_create(e, NULL, &so, &s), TDM_OK);
    struct oracle o = {.rejection = true, .fixed = true};
    assert_int_equal(tdm_sched_set_drafter(s, &oracle_i, &o, 6), TDM_OK); /* the tree's size */
    int counts[CV * CV] = {0};
    for (int done = 0; done < CHI_N; done += CHI_BATCH) {
        tdm_req_t *r[CHI_BATCH];
        for (int i = 0; i < CHI_BATCH; i++) {
            struct tdm_req_params p = {.prompt = prompt,
                                       .n_prompt = 6,
                                       .max_tokens = 4, /* the tree two deep */
                                       .ignore_eos = true,
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = (float)temp;
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
            assert_int_equal(v.n_out, 4);
            counts[v.tokens[1] * CV + v.tokens[2]]++;
            tdm_req_unlock(r[i]);
            tdm_req_release(r[i]);
        }
    }
    double crit, crit2;
    double x = chi2(counts, joint, CV * CV, CHI_N, &crit);
    double x_biased = chi2(counts, biased, CV * CV, CHI_N, &crit2);
    print_message("tree rejection: chi2 %.1f (critical %.1f); against the first candidate kept "
                  "%.1f (critical %.1f); drafted %ld, kept %ld (off the first child %ld) in %ld "
                  "steps\n",
                  x, crit, x_biased, crit2, o.drafted, o.accepted, o.off_first, o.tree_steps);
    assert_true(o.tree_steps >= CHI_N && o.drafted >= 5 * CHI_N); /* trees really ran */
    assert_true(o.accepted > 0 && o.off_first > 0);               /* other branches were kept */
    assert_true(x < crit);
    assert_true(x_biased > crit2); /* the test can tell a wrong distribution */
    tdm_sched_destroy(s);
    tdm_engine_destroy(e);
    tdm_test_model_free(&tiny);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_tree_equals_chains),
        cmocka_unit_test(test_tree_exact_is_lossless),
        cmocka_unit_test(test_tree_rejection_distribution),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
