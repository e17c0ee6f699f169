/*
 * Unit tests for the scheduler, driven step by step (tdm_sched_step) against a fake executor,
 * a fake KV connector and a fake drafter: admission, chunking, mixed batches, preemption,
 * remote KV (landing, failure, local fallback), cancel in every state, drafts with rewind and
 * trim, executor errors, and the KV pool back at its baseline after each.
 *
 * The fake executor is a stand-in model whose next token depends on every earlier token, read
 * back from its own KV store: a span's tokens are written at the plan's slots, and a row's
 * token hashes the tokens at positions [0, x] found through the page table. A wrong slot, a
 * stale page, a position fed twice or skipped, or KV left behind by a rewind changes the
 * output, which is checked against the same hash computed straight from the token list. The
 * store is the KV pool's own memory (one layer, one head of size 1: K holds the token, V the
 * request that wrote it), so what the scheduler moves in the pool (a token tree's accepted
 * path, tdm_kv_pool_copy_slots) moves in the store. A tree span's row hashes what its token
 * sees: the prefix through the page table, then its mask's nodes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/kv.h"
#include "tandem/sched.h"

#define VOCAB    97
#define D_MODEL  4
#define PS       4
#define MAX_CTX  256
#define MAX_PLAN 512

/* ---- the stand-in model ---- */

static uint64_t hash_step(uint64_t h, int32_t tok)
{
    return (h ^ (uint64_t)(tok + 1)) * 1099511628211ull;
}
#define HASH0 1469598103934665603ull

static int32_t next_of(uint64_t h)
{
    return (int32_t)((h >> 20) % VOCAB);
}

/* The stand-in's log-probability of token t after the tokens hashed into h (a score row's). */
static float score_of(uint64_t h, int32_t t)
{
    return -(float)(((h >> 7) ^ (uint64_t)t) % 1000) / 64.0f;
}

/* The reference: greedy continuation of `prompt` by n tokens, from the token list alone. */
static void reference(const int32_t *prompt, int n_prompt, int n, int32_t *out)
{
    uint64_t h = HASH0;
    for (int i = 0; i < n_prompt; i++)
        h = hash_step(h, prompt[i]);
    for (int i = 0; i < n; i++) {
        out[i] = next_of(h);
        h = hash_step(h, out[i]);
    }
}

/* ---- the fake executor ---- */

struct plan_rec { /* one sequence of one recorded plan */
    uint64_t step, req_id;
    int pos0, n_tokens, n_rows, n_draft, n_score;
    uint8_t want;
};

struct fake_exec {
    tdm_kv_pool_t *kv;
    int n_slots;
    float *store;      /* the pool's layer: slot s's K (the token) at kv_k(s), V (the writer's id,
                        * 0: never written) at kv_v(s) */
    int fail_at_step;  /* run returns TDM_EINTERNAL on this step */
    int block_at_step; /* run waits on this step until `unblock` (the watchdog test) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool unblock, blocked;
    struct plan_rec rec[MAX_PLAN];
    int n_rec;
    int max_seqs_seen;
    uint64_t leader_of[64]; /* by request id: the group leader whose KV it may read (0: none) */
    /* the overlap's halves (fake_launch): the last launch's row tokens, the launched plans'
     * results held back until their waits (oldest first), and counts */
    int32_t prev[64];
    int n_prev;
    struct tdm_sample_row held[2][64];
    int held_rows[2], n_held;
    int launches, launched_behind, placeholders;
    int n_prompt_of[64]; /* by request id, where a test sets it: a penalised row's check */
    int penalty_rows;
    bool in_launch, sampled; /* fake_launch runs the plan; the last launch was sampled */
    /* the wait of this step fails, and then, as in the engine, the tokens of the launch before
     * are gone: a later launch naming them fails with TDM_EINVAL */
    uint64_t fail_wait_at_step, last_launch_step;
    bool prev_lost;
};

/* The store's two floats of a slot in the pool's HND layer [page][K, V][1 head][PS][1]. */
static float *kv_k(struct fake_exec *x, int slot)
{
    return &x->store[(size_t)(slot / PS) * 2 * PS + slot % PS];
}
static float *kv_v(struct fake_exec *x, int slot)
{
    return &x->store[(size_t)(slot / PS) * 2 * PS + PS + slot % PS];
}
static void kv_put(struct fake_exec *x, int slot, int32_t tok, uint64_t id)
{
    *kv_k(x, slot) = (float)tok;
    *kv_v(x, slot) = (float)id;
}
/* The hash over slot's token, checking that request id wrote it (or its group's leader, whose
 * prompt KV a follower shares). */
static uint64_t kv_hash(struct fake_exec *x, uint64_t h, int slot, uint64_t id)
{
    uint64_t writer = (uint64_t)*kv_v(x, slot);
    if (writer != id || !id)
        assert_int_equal(writer, id < 64 && x->leader_of[id] ? x->leader_of[id] : id);
    return hash_step(h, (int32_t)*kv_k(x, slot));
}

/* A sampling row's penalty state holds every output before its position. */
static void check_penalties(struct fake_exec *x, const struct tdm_sample_row *sr, uint64_t id)
{
    const struct tdm_sampler *smp = sr->smp;
    if (!smp || !smp->out_count || id >= 64 || !x->n_prompt_of[id]) return;
    int outs = 0;
    for (int j = 0; j < smp->n_seen; j++)
        outs += (int)smp->out_count[smp->seen[j]];
    assert_int_equal(outs, (int)sr->position - x->n_prompt_of[id]);
    x->penalty_rows++;
}

static tdm_status fake_run(void *ctx, struct tdm_sched_plan *p)
{
    struct fake_exec *x = ctx;
    if ((int)p->step == x->fail_at_step)
        return tdm_err_set(TDM_EINTERNAL, "fake executor: step %d fails", x->fail_at_step);
    if ((int)p->step == x->block_at_step) {
        pthread_mutex_lock(&x->mu);
        x->blocked = true;
        while (!x->unblock)
            pthread_cond_wait(&x->cv, &x->mu);
        pthread_mutex_unlock(&x->mu);
    }
    if (p->n_seqs > x->max_seqs_seen) x->max_seqs_seen = p->n_seqs;
    int rows = 0, tokens = 0;
    for (int s = 0; s < p->n_seqs; s++) {
        const struct tdm_plan_seq *q = &p->seqs[s];
        uint64_t id = tdm_req_id(q->req);
        assert_int_equal(q->row0, rows);
        assert_true(q->n_rows <= q->n_tokens);
        assert_true((q->pos0 + q->n_tokens + PS - 1) / PS <= q->n_pages);
        if (x->n_rec < MAX_PLAN)
            x->rec[x->n_rec++] = (struct plan_rec){.step = p->step,
                                                   .req_id = id,
                                                   .pos0 = q->pos0,
                                                   .n_tokens = q->n_tokens,
                                                   .n_rows = q->n_rows,
                                                   .n_draft = q->n_draft,
                                                   .n_score = q->n_score,
                                                   .want = q->want};
        for (int i = 0; i < q->n_tokens; i++) {
            int pos = q->pos0 + i;
            /* the slot of its position in the page table (a tree's nodes: of its index) */
            assert_int_equal(q->slots[i], q->pages[pos / PS] * PS + pos % PS);
            kv_put(x, q->slots[i], q->tokens[i], id);
        }
        if (q->tree) { /* a verified tree: every token a row, each seeing its own path */
            const struct tdm_batch_tree *tr = q->tree;
            assert_int_equal(q->n_rows, q->n_tokens);
            assert_int_equal(tr->n_nodes, q->n_tokens - 1);
            for (int i = 0; i < q->n_rows; i++) {
                const int row = q->row0 + i;
                uint64_t h = HASH0;
                for (int pos = 0; pos < q->pos0 + 1; pos++) /* the prefix and the root */
                    h = kv_hash(x, h, q->pages[pos / PS] * PS + pos % PS, id);
                for (uint64_t m = tr->mask[i]; m; m &= m - 1)
                    h = kv_hash(x, h, tr->node_slots[__builtin_ctzll(m)], id);
                assert_int_equal(tr->positions[i], q->pos0 + __builtin_popcountll(tr->mask[i]));
                struct tdm_sample_row *sr = &p->samples[row];
                assert_int_equal(sr->position, (uint32_t)tr->positions[i] + 1);
                /* penalties see the row's path: the other drafts are its undo list */
                assert_int_equal(sr->n_undo, tr->n_nodes - __builtin_popcountll(tr->mask[i]));
                assert_true(sr->mode == TDM_SAMPLE_DRAW || sr->mode == TDM_SAMPLE_TREE);
                sr->token = next_of(h);
                sr->kept = false;
                for (int c = 0; sr->mode == TDM_SAMPLE_TREE && c < sr->n_cand; c++)
                    sr->kept |= sr->cand[c] == sr->token;
                sr->logprob = -0.5f;
            }
            rows += q->n_rows;
            tokens += q->n_tokens;
            continue;
        }
        for (int i = 0; i < q->n_rows; i++) {
            int row = q->row0 + i, x_pos = q->pos0 + q->n_tokens - q->n_rows + i;
            assert_int_equal(p->want[row], q->want);
            uint64_t h = HASH0;
            for (int pos = 0; pos <= x_pos; pos++)
                h = kv_hash(x, h, q->pages[pos / PS] * PS + pos % PS, id);
            int32_t tok = next_of(h);
            if (q->want & TDM_ROW_SAMPLE) {
                struct tdm_sample_row *sr = &p->samples[row];
                assert_int_equal(sr->position, (uint32_t)x_pos + 1);
                /* a verified row names the span's next token as its draft, and the drafts
                 * from there to the span's end as what its penalties must not see */
                int next = x_pos + 1 - q->pos0, n_after = q->n_tokens - next;
                if (i < q->n_score) {
                    /* a score row: the prompt's next token given, its log-probability and
                     * the top ones out (the token list goes on past a span that is not the
                     * last) */
                    assert_int_equal(sr->mode, TDM_SAMPLE_SCORE);
                    assert_int_equal(sr->draft, q->tokens[next]);
                    sr->token = sr->draft;
                    sr->logprob = score_of(h, sr->draft);
                    for (int j = 0; j < sr->n_top; j++) {
                        sr->top_ids[j] = (sr->draft + j) % VOCAB;
                        sr->top_lps[j] = score_of(h, sr->draft) - (float)j;
                    }
                    continue;
                }
                if (i - q->n_score < q->n_draft) {
                    assert_int_equal(sr->mode, TDM_SAMPLE_VERIFY);
                    assert_int_equal(sr->draft, q->tokens[next]);
                    assert_int_equal(sr->n_undo, n_after);
                    for (int j = 0; j < n_after; j++)
                        assert_int_equal(sr->undo[j], q->tokens[next + j]);
                } else {
                    assert_int_equal(sr->mode, TDM_SAMPLE_DRAW);
                    assert_int_equal(sr->n_undo, 0);
                    /* penalties see every output before the row's position (a launched
                     * plan's, when it is sampled: fake_sample) */
                    if (!x->in_launch) check_penalties(x, sr, id);
                }
                sr->token = tok;
                sr->kept = sr->mode == TDM_SAMPLE_VERIFY && tok == sr->draft;
                sr->logprob = -0.5f;
            }
            if (q->want & TDM_ROW_LOGITS)
                for (int v = 0; v < VOCAB; v++)
                    p->logits[(size_t)row * VOCAB + v] = v == tok ? 10.0f : 0.0f;
            if (q->want & TDM_ROW_HIDDEN)
                for (int d = 0; d < D_MODEL; d++)
                    p->hidden[(size_t)row * D_MODEL + d] = (float)(x_pos * 10 + d);
        }
        rows += q->n_rows;
        tokens += q->n_tokens;
    }
    assert_int_equal(rows, p->n_rows);
    assert_int_equal(tokens, p->n_tokens);
    return TDM_OK;
}

static const struct tdm_sched_exec_i fake_exec_i = {.run = fake_run};

/* launch runs the plan at once, as a device runs it behind the step before: its
 * TDM_TOKEN_PREV tokens become the previous launch's row tokens. The scheduler sees the rows'
 * results only at the wait (each launch's are held back until then), so a commit that read a
 * row early, or a placeholder naming a wrong row, changes the output. The rows' parameters
 * are checked at the sampling (fake_sample), where the device reads them. */
static tdm_status fake_launch(void *ctx, struct tdm_sched_plan *p)
{
    struct fake_exec *x = ctx;
    assert_true(x->n_held < 2);
    assert_true(x->n_held == 0 || x->sampled); /* each sampled before the next launch */
    assert_true(p->n_rows <= 64 && p->n_seqs <= 16);
    x->launches++;
    x->launched_behind += x->n_held == 1;
    static int32_t tokens[MAX_CTX * 16];
    struct tdm_plan_seq seqs[16];
    int n = 0;
    for (int j = 0; j < p->n_seqs; j++) {
        seqs[j] = p->seqs[j];
        for (int i = 0; i < p->seqs[j].n_tokens; i++) {
            int32_t t = p->seqs[j].tokens[i];
            if (t < 0) {
                const int row = -1 - t;
                if (x->prev_lost)
                    return tdm_err_set(TDM_EINVAL,
                                       "fake executor: a placeholder names row %d "
                                       "of a step whose sampling failed",
                                       row);
                assert_true(row < x->n_prev);
                t = x->prev[row];
                x->placeholders++;
            }
            assert_true(t >= 0 && t < VOCAB);
            tokens[n + i] = t;
        }
        seqs[j].tokens = tokens + n;
        n += p->seqs[j].n_tokens;
    }
    const int k = x->n_held;
    memcpy(x->held[k], p->samples, (size_t)p->n_rows * sizeof *p->samples);
    struct tdm_sched_plan run = *p;
    run.seqs = seqs;
    run.samples = x->held[k];
    x->last_launch_step = p->step;
    x->in_launch = true;
    tdm_status st = fake_run(ctx, &run);
    x->in_launch = false;
    if (st != TDM_OK) return st;
    x->held_rows[k] = p->n_rows;
    x->n_held++;
    x->sampled = false;
    x->prev_lost = false;
    x->n_prev = p->n_rows;
    for (int i = 0; i < p->n_rows; i++)
        x->prev[i] = x->held[k][i].token;
    return TDM_OK;
}

/* The launched plan's rows as the scheduler left them at its sampling: the penalty state of
 * each sampling row holds every output before it (the commit before came first). */
static tdm_status fake_sample(void *ctx, struct tdm_sched_plan *p)
{
    struct fake_exec *x = ctx;
    assert_true(x->n_held > 0 && !x->sampled);
    assert_int_equal(x->held_rows[x->n_held - 1], p->n_rows);
    x->sampled = true;
    for (int j = 0; j < p->n_seqs; j++) {
        const struct tdm_plan_seq *q = &p->seqs[j];
        for (int i = q->n_score; i < q->n_rows; i++)
            if (p->samples[q->row0 + i].mode == TDM_SAMPLE_DRAW &&
                tdm_req_state(q->req) != TDM_REQ_FINISHED)
                check_penalties(x, &p->samples[q->row0 + i], tdm_req_id(q->req));
    }
    return TDM_OK;
}

static tdm_status fake_wait(void *ctx, struct tdm_sched_plan *p)
{
    struct fake_exec *x = ctx;
    assert_true(x->n_held > 0);
    assert_int_equal(x->held_rows[0], p->n_rows);
    memcpy(p->samples, x->held[0], (size_t)p->n_rows * sizeof *p->samples);
    memcpy(x->held[0], x->held[1], sizeof x->held[0]);
    x->held_rows[0] = x->held_rows[1];
    x->n_held--;
    if (p->step == x->fail_wait_at_step) {
        x->prev_lost = true;
        return tdm_err_set(TDM_EINTERNAL, "fake executor: the sampling of step %llu failed",
                           (unsigned long long)p->step);
    }
    return TDM_OK;
}

static const struct tdm_sched_exec_i fake_async_i = {
    .run = fake_run, .launch = fake_launch, .sample = fake_sample, .wait = fake_wait};

/* ---- fixture ---- */

struct fix {
    tdm_backend_t *backend;
    tdm_kv_pool_t *kv;
    struct fake_exec x;
    tdm_sched_t *s;
};

static void fix_open(struct fix *f, int64_t n_pages, const struct tdm_sched_opts *so,
                     int max_batch_tokens, int max_seqs)
{
    memset(f, 0, sizeof *f);
    struct tdm_backend_cpu_opts bo = {.n_threads = 1};
    assert_int_equal(tdm_backend_cpu_create(&bo, &f->backend), TDM_OK);
    struct tdm_kv_config kc = {
        .n_layers = 1, .n_kv_heads = 1, .head_dim = 1, .page_size = PS, .n_pages = n_pages};
    assert_int_equal(tdm_kv_pool_create(&kc, f->backend, &f->kv), TDM_OK);
    f->x.kv = f->kv;
    pthread_mutex_init(&f->x.mu, NULL);
    pthread_cond_init(&f->x.cv, NULL);
    f->x.n_slots = (int)n_pages * PS;
    f->x.store = tdm_kv_pool_layer(f->kv, 0).base;
    memset(f->x.store, 0, (size_t)n_pages * 2 * PS * sizeof(float));
    struct tdm_sched_exec ex = {.iface = so && so->overlap > 0 ? &fake_async_i : &fake_exec_i,
                                .ctx = &f->x,
                                .kv = f->kv,
                                .vocab = VOCAB,
                                .d_model = D_MODEL,
                                .max_ctx = MAX_CTX,
                                .max_batch_tokens = max_batch_tokens,
                                .max_seqs = max_seqs,
                                .max_rows = 2 * max_seqs + 8};
    assert_int_equal(tdm_sched_create_exec(&ex, NULL, so, &f->s), TDM_OK);
}

static void expect_baseline(struct fix *f)
{
    struct tdm_kv_stats st = tdm_kv_pool_stats(f->kv);
    assert_int_equal(st.used, 0);
    assert_int_equal(st.in_flight, 0);
    assert_int_equal(st.free, st.total);
}

static void fix_close(struct fix *f)
{
    tdm_sched_destroy(f->s);
    expect_baseline(f);
    tdm_kv_pool_destroy(f->kv);
    tdm_backend_destroy(f->backend);
    pthread_mutex_destroy(&f->x.mu);
    pthread_cond_destroy(&f->x.cv);
}

static void make_prompt(int32_t *p, int n, int seed)
{
    for (int i = 0; i < n; i++)
        p[i] = (int32_t)((seed * 13 + i * 7 + 1) % VOCAB);
}

static tdm_req_t *submit(struct fix *f, const int32_t *prompt, int n_prompt, int max_tokens,
                         void *user)
{
    struct tdm_req_params rp = {.prompt = prompt,
                                .n_prompt = n_prompt,
                                .max_tokens = max_tokens,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1,
                                .user = user};
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f->s, &rp, &r), TDM_OK);
    return r;
}

/* Steps until every request given has finished (bounded). */
static void run_until_done(struct fix *f, tdm_req_t **rs, int n)
{
    for (int it = 0; it < 2000; it++) {
        bool all = true;
        for (int i = 0; i < n; i++)
            all &= tdm_req_state(rs[i]) == TDM_REQ_FINISHED;
        if (all) return;
        tdm_sched_step(f->s);
    }
    fail_msg("requests did not finish in 2000 steps");
}

/* Overlap: steps until nothing is left to plan, which collects the launched step (bounded). */
static void collect_launched(struct fix *f)
{
    for (int it = 0; it < 4 && tdm_sched_step(f->s);)
        it++;
}

/* The request finished with `why` and produced the reference continuation. */
static void expect_output(tdm_req_t *r, const int32_t *prompt, int n_prompt, int n,
                          enum tdm_finish why)
{
    int32_t want[MAX_CTX];
    reference(prompt, n_prompt, n, want);
    struct tdm_req_view v;
    tdm_req_lock(r, &v);
    assert_int_equal(v.finish, why);
    assert_int_equal(v.n_out, n);
    for (int i = 0; i < n; i++)
        assert_int_equal(v.tokens[i], want[i]);
    tdm_req_unlock(r);
}

/* ---- tests ---- */

static void test_admission_and_decode(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8);
    int32_t p[3][20];
    tdm_req_t *rs[3];
    int lens[3] = {5, 17, 1};
    for (int i = 0; i < 3; i++) {
        make_prompt(p[i], lens[i], i);
        rs[i] = submit(&f, p[i], lens[i], 9 + i, NULL);
        assert_int_equal(tdm_req_state(rs[i]), TDM_REQ_WAITING);
    }
    assert_true(tdm_sched_step(f.s));
    /* one step admitted all three: whole prompts, one row each, sampled only */
    assert_int_equal(f.x.n_rec, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tdm_req_state(rs[i]), TDM_REQ_RUNNING);
        assert_int_equal(f.x.rec[i].n_tokens, lens[i]);
        assert_int_equal(f.x.rec[i].n_rows, 1);
        assert_int_equal(f.x.rec[i].want, TDM_ROW_SAMPLE);
    }
    run_until_done(&f, rs, 3);
    for (int i = 0; i < 3; i++) {
        expect_output(rs[i], p[i], lens[i], 9 + i, TDM_FINISH_LENGTH);
        tdm_req_release(rs[i]);
    }
    /* later steps were decodes: one token, one row */
    for (int i = 3; i < f.x.n_rec; i++) {
        assert_int_equal(f.x.rec[i].n_tokens, 1);
        assert_int_equal(f.x.rec[i].n_rows, 1);
    }
    assert_false(tdm_sched_step(f.s)); /* nothing left */
    fix_close(&f);
}

static void test_chunking_and_mixed_batches(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.prefill_chunk = 5, .max_batch_tokens = 8};
    fix_open(&f, 64, &so, 64, 8);
    int32_t a[4], b[23];
    make_prompt(a, 4, 1);
    make_prompt(b, 23, 2);
    tdm_req_t *ra = submit(&f, a, 4, 6, NULL);
    assert_true(tdm_sched_step(f.s)); /* a's prompt alone */
    tdm_req_t *rb = submit(&f, b, 23, 3, NULL);
    tdm_req_t *rs[2] = {ra, rb};
    run_until_done(&f, rs, 2);
    expect_output(ra, a, 4, 6, TDM_FINISH_LENGTH);
    expect_output(rb, b, 23, 3, TDM_FINISH_LENGTH);
    /* b's prefill: chunks of at most 5, consecutive, none past the step budget; a decoded
     * beside them */
    int next = 0, mixed = 0;
    for (int i = 0; i < f.x.n_rec; i++) {
        const struct plan_rec *q = &f.x.rec[i];
        if (q->req_id != tdm_req_id(rb) || q->pos0 >= 23) continue;
        assert_int_equal(q->pos0, next);
        assert_true(q->n_tokens <= 5);
        next += q->n_tokens;
        assert_int_equal(q->n_rows, next == 23 ? 1 : 0);
        for (int j = 0; j < f.x.n_rec; j++)
            mixed += f.x.rec[j].step == q->step && f.x.rec[j].req_id == tdm_req_id(ra);
    }
    assert_int_equal(next, 23);
    assert_true(mixed >= 1);
    tdm_req_release(ra);
    tdm_req_release(rb);
    fix_close(&f);
}

static void test_preemption(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.watermark_pages = -1};
    fix_open(&f, 12, &so, 64, 8); /* 48 slots: three requests growing to 30 tokens cannot fit */
    int32_t p[3][8];
    tdm_req_t *rs[3];
    for (int i = 0; i < 3; i++) {
        make_prompt(p[i], 8, 10 + i);
        rs[i] = submit(&f, p[i], 8, 22, NULL);
    }
    run_until_done(&f, rs, 3);
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(f.s, &m);
    assert_true(m.preemptions > 0);
    for (int i = 0; i < 3; i++) {
        expect_output(rs[i], p[i], 8, 22, TDM_FINISH_LENGTH);
        tdm_req_release(rs[i]);
    }
    expect_baseline(&f);
    fix_close(&f);
}

/* Whether toks[at] occurs in toks[0, at): a stop id equal to it would end the output earlier. */
static bool seen_before(const int32_t *toks, int at)
{
    for (int j = 0; j < at; j++)
        if (toks[j] == toks[at]) return true;
    return false;
}

/* Overlap (sched.h): each step plans and launches the next before the one before it is
 * committed, its decodes naming tokens not sampled yet. Outputs stay the reference's through
 * admissions, preemptions (a small pool), stop tokens (a request that ran one position past
 * its end), max_tokens, a cancel, and requests whose next row depends on their last token
 * (penalties: the step waits for that commit), and the pool ends at its baseline. */
static void test_overlap(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.watermark_pages = -1, .overlap = 1, .prefill_chunk = 8};
    fix_open(&f, 24, &so, 32, 8); /* 96 slots: not enough for all of them at once */
    enum { N = 8 };
    int32_t p[N][20];
    int lens[N] = {5, 17, 1, 9, 3, 12, 7, 2}, maxt[N] = {20, 7, 15, 25, 12, 18, 9, 30};
    int stop_at[N], want_n[N];
    tdm_req_t *rs[N];
    for (int i = 0; i < N; i++) {
        make_prompt(p[i], lens[i], 20 + i);
        int32_t ref[64];
        reference(p[i], lens[i], maxt[i], ref);
        struct tdm_req_params rp = {.prompt = p[i],
                                    .n_prompt = lens[i],
                                    .max_tokens = maxt[i],
                                    .ignore_eos = true,
                                    .sampling = tdm_sampling_defaults(),
                                    .top_logprobs = -1};
        /* requests 1 and 4 stop at a token of their continuation (its first occurrence) */
        stop_at[i] = -1;
        if (i == 1 || i == 4) {
            int at = maxt[i] / 2;
            while (seen_before(ref, at))
                at--;
            rp.stop_ids[0] = ref[at];
            rp.n_stop_ids = 1;
            stop_at[i] = at;
        }
        if (i == 5) rp.sampling.repetition_penalty = 1.1f; /* its rows wait for its commits */
        want_n[i] = stop_at[i] >= 0 ? stop_at[i] + 1 : maxt[i];
        assert_int_equal(tdm_sched_submit(f.s, &rp, &rs[i]), TDM_OK);
        f.x.n_prompt_of[tdm_req_id(rs[i])] = lens[i];
    }
    /* request 7 is cancelled after a few steps */
    for (int it = 0; it < 6; it++)
        tdm_sched_step(f.s);
    tdm_req_cancel(rs[7]);
    run_until_done(&f, rs, N);
    for (int i = 0; i < N; i++) {
        if (i == 7) {
            struct tdm_req_view v;
            tdm_req_lock(rs[i], &v);
            assert_int_equal(v.finish, TDM_FINISH_CANCELLED);
            int32_t ref[64];
            reference(p[i], lens[i], maxt[i], ref);
            for (int j = 0; j < v.n_out; j++)
                assert_int_equal(v.tokens[j], ref[j]);
            tdm_req_unlock(rs[i]);
        } else {
            expect_output(rs[i], p[i], lens[i], want_n[i],
                          stop_at[i] >= 0 ? TDM_FINISH_STOP : TDM_FINISH_LENGTH);
        }
        tdm_req_release(rs[i]);
    }
    collect_launched(&f); /* once nothing is left to plan */
    expect_baseline(&f);
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(f.s, &m);
    assert_true(m.preemptions > 0);
    assert_true(f.x.launched_behind > 0);
    assert_true(f.x.placeholders > 0);
    assert_true(f.x.penalty_rows >= maxt[5] - 1);
    assert_int_equal(f.x.n_held, 0);
    fix_close(&f);
}

/* Overlap: a request that a stop token ends at step N's commit is in step N+1 too, which may
 * still write its pages on the device: its page table is kept, pages in use (no remote fill
 * may land in them), until N+1 is collected, then they are free. A request whose last step has
 * run gives its pages back at once. */
static void test_overlap_holds_pages(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.overlap = 1};
    fix_open(&f, 16, &so, 32, 8);
    int32_t a[6], ref[16];
    make_prompt(a, 6, 50);
    reference(a, 6, 10, ref);
    int at = 4; /* the stop token: its first occurrence from output 4 down */
    while (seen_before(ref, at))
        at--;
    struct tdm_req_params rp = {.prompt = a,
                                .n_prompt = 6,
                                .max_tokens = 10,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1,
                                .stop_ids = {ref[at]},
                                .n_stop_ids = 1};
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_OK);
    int steps = 0;
    while (tdm_req_state(r) != TDM_REQ_FINISHED && steps++ < 50)
        tdm_sched_step(f.s);
    expect_output(r, a, 6, at + 1, TDM_FINISH_STOP);
    struct tdm_kv_stats st = tdm_kv_pool_stats(f.kv);
    assert_int_equal(st.used, (6 + at + 1 + PS - 1) / PS); /* its pages, kept */
    assert_int_equal(st.in_flight, 0);
    assert_true(tdm_sched_step(f.s)); /* nothing to plan: the launched step is collected */
    expect_baseline(&f);
    /* a request whose last token ends it by max_tokens is in no later step: freed at once */
    rp.stop_ids[0] = -1;
    rp.n_stop_ids = 0;
    rp.max_tokens = 3;
    tdm_req_release(r);
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_OK);
    steps = 0;
    while (tdm_req_state(r) != TDM_REQ_FINISHED && steps++ < 50)
        tdm_sched_step(f.s);
    expect_output(r, a, 6, 3, TDM_FINISH_LENGTH);
    expect_baseline(&f);
    tdm_req_release(r);
    while (tdm_sched_step(f.s))
        ;
    fix_close(&f);
}

/* Overlap: the pool runs dry while a newer request's token is in flight, and that token stops
 * it. Preempting it would free nothing while a launched step holds its pages (and a pool that
 * kept preempting such requests made no progress), so the scheduler commits the launched step
 * before it plans: the token ends the request, its pages come back, and the older request
 * goes on without any preemption. */
static void test_overlap_preempt_in_flight(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.watermark_pages = -1, .overlap = 1};
    fix_open(&f, 4, &so, 32, 8); /* 16 slots: two 4-token prompts and their next 4 positions */
    int32_t a[4], b[4], ref_b[16];
    make_prompt(a, 4, 40);
    int seed = 41;
    for (;; seed++) { /* b's fifth output appears there first: a stop id that ends it there */
        make_prompt(b, 4, seed);
        reference(b, 4, 5, ref_b);
        if (!seen_before(ref_b, 4)) break;
    }
    tdm_req_t *ra = submit(&f, a, 4, 8, NULL);
    struct tdm_req_params rp = {.prompt = b,
                                .n_prompt = 4,
                                .max_tokens = 10,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1,
                                .stop_ids = {ref_b[4]},
                                .n_stop_ids = 1};
    tdm_req_t *rb = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &rb), TDM_OK);
    tdm_req_t *rs[2] = {ra, rb};
    run_until_done(&f, rs, 2);
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(f.s, &m);
    assert_int_equal(m.preemptions, 0);
    expect_output(ra, a, 4, 8, TDM_FINISH_LENGTH);
    expect_output(rb, b, 4, 5, TDM_FINISH_STOP);
    tdm_req_release(ra);
    tdm_req_release(rb);
    while (tdm_sched_step(f.s))
        ;
    expect_baseline(&f);
    fix_close(&f);
}

/* ---- the fake connector ---- */

struct fake_conn {
    struct fix *f;
    int admits, finishes, steps_seen;
    bool take;      /* admit() takes requests remote */
    int fail_first; /* this many remote fills fail */
    tdm_req_t *pending[8];
    const int32_t *pending_tokens[8];
    const int32_t *pending_pages[8];
    int pending_n[8], pending_cached[8];
    int n_pending;
    int last_cached;     /* the n_cached of the last admit */
    bool hold_on_finish; /* finished() holds the pages (a transfer in flight) */
    int32_t held[64];
    int n_held;
    int64_t used_at_finish;
    uint8_t last_want;
};

static bool conn_admit(void *ctx, tdm_req_t *r, void *user, const int32_t *tokens, int n_tokens,
                       int n_cached, const int32_t *pages, int n_pages)
{
    struct fake_conn *c = ctx;
    (void)user;
    c->admits++;
    c->last_cached = n_cached;
    assert_int_equal(tdm_req_state(r), TDM_REQ_WAITING_REMOTE_KV);
    assert_true(n_pages * PS >= n_tokens + 1);
    /* a cached prefix is whole pages, and leaves at least one token to fill */
    assert_true(n_cached >= 0 && n_cached % PS == 0 && n_cached < n_tokens);
    if (!c->take) return false;
    c->pending[c->n_pending] = r;
    c->pending_tokens[c->n_pending] = tokens;
    c->pending_pages[c->n_pending] = pages;
    c->pending_n[c->n_pending] = n_tokens;
    c->pending_cached[c->n_pending] = n_cached;
    c->n_pending++;
    return true;
}

/* The "remote" fills: the KV of prompt[:-1] past the cached prefix lands in the request's
 * pages, then done. */
static void conn_land(struct fake_conn *c)
{
    struct fake_exec *x = &c->f->x;
    for (int i = 0; i < c->n_pending; i++) {
        tdm_req_t *r = c->pending[i];
        if (c->fail_first > 0) {
            c->fail_first--;
            tdm_req_remote_done(r, TDM_EPEER);
            continue;
        }
        for (int pos = c->pending_cached[i]; pos < c->pending_n[i]; pos++) {
            int slot = c->pending_pages[i][pos / PS] * PS + pos % PS;
            kv_put(x, slot, c->pending_tokens[i][pos], tdm_req_id(r));
        }
        tdm_req_remote_done(r, TDM_OK);
    }
    c->n_pending = 0;
}

static void conn_step_begin(void *ctx, const struct tdm_sched_plan *plan)
{
    struct fake_conn *c = ctx;
    c->steps_seen++;
    for (int i = 0; i < plan->n_seqs; i++) {
        tdm_req_t *r = plan->seqs[i].req;
        /* nothing waiting for its KV is ever planned */
        assert_int_equal(tdm_req_state(r), TDM_REQ_RUNNING);
        c->last_want = plan->seqs[i].want;
    }
}

static void conn_finished(void *ctx, tdm_req_t *r, void *user, enum tdm_finish why)
{
    struct fake_conn *c = ctx;
    (void)r;
    (void)user;
    (void)why;
    c->finishes++;
    /* the request still owns its pages when the connector hears of its end */
    c->used_at_finish = tdm_kv_pool_stats(c->f->kv).used;
    if (c->hold_on_finish && c->n_pending) {
        for (int i = 0; i < c->n_pending; i++) {
            if (c->pending[i] != r) continue;
            int n = (c->pending_n[i] + PS) / PS;
            tdm_kv_pool_hold(c->f->kv, n, c->pending_pages[i]);
            memcpy(c->held, c->pending_pages[i], (size_t)n * sizeof(int32_t));
            c->n_held = n;
            c->pending[i] = c->pending[--c->n_pending];
            c->pending_tokens[i] = c->pending_tokens[c->n_pending];
            c->pending_pages[i] = c->pending_pages[c->n_pending];
            c->pending_n[i] = c->pending_n[c->n_pending];
            break;
        }
    }
}

static const struct tdm_kv_connector_i fake_conn_i = {
    .admit = conn_admit, .step_begin = conn_step_begin, .finished = conn_finished};

static void test_remote_kv(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8);
    struct fake_conn c = {.f = &f, .take = true};
    tdm_sched_set_connector(f.s, &fake_conn_i, &c);
    int32_t a[12], one[1] = {5};
    make_prompt(a, 12, 3);
    tdm_req_t *ra = submit(&f, a, 12, 5, NULL);
    tdm_req_t *r1 = submit(&f, one, 1, 4, NULL); /* a 1-token prompt needs no remote fill */
    tdm_sched_step(f.s);
    assert_int_equal(c.admits, 1);
    assert_int_equal(tdm_req_state(ra), TDM_REQ_WAITING_REMOTE_KV);
    for (int i = 0; i < 3; i++)
        tdm_sched_step(f.s); /* r1 decodes; ra waits */
    assert_int_equal(tdm_req_state(ra), TDM_REQ_WAITING_REMOTE_KV);
    for (int i = 0; i < f.x.n_rec; i++)
        assert_int_not_equal(f.x.rec[i].req_id, tdm_req_id(ra));
    /* rows want a sample only, though a connector is set */
    assert_int_equal(c.last_want, TDM_ROW_SAMPLE);
    conn_land(&c);
    int before = f.x.n_rec;
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(ra), TDM_REQ_RUNNING);
    /* its first step is prompt[-1] alone */
    bool seen = false;
    for (int i = before; i < f.x.n_rec; i++)
        if (f.x.rec[i].req_id == tdm_req_id(ra)) {
            assert_int_equal(f.x.rec[i].pos0, 11);
            assert_int_equal(f.x.rec[i].n_tokens, 1);
            seen = true;
        }
    assert_true(seen);
    tdm_req_t *rs[2] = {ra, r1};
    run_until_done(&f, rs, 2);
    expect_output(ra, a, 12, 5, TDM_FINISH_LENGTH);
    expect_output(r1, one, 1, 4, TDM_FINISH_LENGTH);
    assert_int_equal(c.finishes, 2);
    tdm_req_release(ra);
    tdm_req_release(r1);
    fix_close(&f);
}

static void test_remote_failure_then_local(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8);
    struct fake_conn c = {.f = &f, .take = true, .fail_first = 1};
    tdm_sched_set_connector(f.s, &fake_conn_i, &c);
    int32_t a[9];
    make_prompt(a, 9, 4);
    tdm_req_t *ra = submit(&f, a, 9, 4, NULL);
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(ra), TDM_REQ_WAITING_REMOTE_KV);
    conn_land(&c);  /* fails */
    c.take = false; /* asked again, it declines: prefilled here */
    tdm_sched_step(f.s);
    assert_int_equal(c.admits, 2);
    assert_int_equal(tdm_req_state(ra), TDM_REQ_RUNNING);
    run_until_done(&f, &ra, 1);
    expect_output(ra, a, 9, 4, TDM_FINISH_LENGTH);
    tdm_req_release(ra);
    fix_close(&f);
}

/* Cancel in every state; the pool returns to its baseline each time. */
static void test_cancel_everywhere(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.prefill_chunk = 4, .max_batch_tokens = 4};
    fix_open(&f, 64, &so, 64, 8);
    struct fake_conn c = {.f = &f, .hold_on_finish = true};
    tdm_sched_set_connector(f.s, &fake_conn_i, &c);
    int32_t a[16];
    make_prompt(a, 16, 5);

    /* WAITING */
    tdm_req_t *r = submit(&f, a, 16, 4, NULL);
    tdm_req_cancel(r);
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(r), TDM_REQ_FINISHED);
    tdm_req_release(r);
    expect_baseline(&f);

    /* RUNNING, mid-prefill (chunks of 4 of a 16-token prompt) */
    r = submit(&f, a, 16, 4, NULL);
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(r), TDM_REQ_RUNNING);
    tdm_req_cancel(r);
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(r), TDM_REQ_FINISHED);
    tdm_req_release(r);
    expect_baseline(&f);

    /* RUNNING, decoding */
    r = submit(&f, a, 3, 50, NULL);
    for (int i = 0; i < 4; i++)
        tdm_sched_step(f.s);
    tdm_req_cancel(r);
    tdm_sched_step(f.s);
    struct tdm_req_view v;
    tdm_req_lock(r, &v);
    assert_int_equal(v.finish, TDM_FINISH_CANCELLED);
    assert_true(v.n_out >= 2 && v.n_out < 50);
    tdm_req_unlock(r);
    tdm_req_release(r);
    expect_baseline(&f);

    /* WAITING_REMOTE_KV: the connector hears of the end while the request still owns its
     * pages and fences them (holds); they stay IN_FLIGHT until it lets go */
    c.take = true;
    r = submit(&f, a, 16, 4, NULL);
    tdm_sched_step(f.s);
    assert_int_equal(tdm_req_state(r), TDM_REQ_WAITING_REMOTE_KV);
    int64_t used = tdm_kv_pool_stats(f.kv).used;
    assert_int_equal(used, 16 / PS); /* the whole prompt's pages, reserved at admission */
    tdm_req_release(r);              /* the client goes away: a cancel */
    tdm_sched_step(f.s);
    assert_int_equal(c.used_at_finish, used);
    assert_int_equal(c.n_held, used);
    struct tdm_kv_stats st = tdm_kv_pool_stats(f.kv);
    assert_int_equal(st.in_flight, used);
    assert_int_equal(st.used, 0);
    tdm_kv_pool_unhold(f.kv, c.n_held, c.held);
    expect_baseline(&f);
    fix_close(&f);
}

/* ---- the fake drafter: proposes the reference continuation, wrong from a chosen index ---- */

struct fake_drafter {
    const int32_t *prompt;
    int n_prompt;
    int right; /* this many proposals are right, the rest wrong */
    int proposed, accepted, calls, steps, published;
};

static void drafter_propose(void *ctx, struct tdm_sched_draft *dr, int n, int base_tokens)
{
    struct fake_drafter *d = ctx;
    assert_true(n >= 1 && base_tokens >= n);
    for (int j = 0; j < n; j++) {
        int32_t ref[MAX_CTX];
        reference(dr[j].tokens, dr[j].n_tokens, dr[j].k, ref);
        for (int i = 0; i < dr[j].k; i++)
            dr[j].out[i] = i < d->right ? ref[i] : (ref[i] + 1) % VOCAB;
        dr[j].n = dr[j].k;
        /* pages exist for every position a draft may take */
        assert_true(dr[j].n_pages * PS >= dr[j].n_tokens + dr[j].k);
    }
    d->calls++;
}

static void drafter_accepted(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                             int n_accepted, int n_published)
{
    struct fake_drafter *d = ctx;
    (void)r;
    /* the leading right proposals are kept, the first wrong one ends the run */
    assert_int_equal(n_accepted, TDM_MIN(d->right, n_draft));
    assert_true(n_published >= 1 && n_published <= n_accepted + 1);
    if (n_draft) {
        assert_true(st->reached[0] >= 1);
        assert_true(st->kept[0] <= st->reached[0]);
    }
    d->proposed += n_draft;
    d->accepted += n_accepted;
    d->steps++;
    d->published += n_published;
}

static const struct tdm_sched_drafter_i fake_drafter_i = {.propose = drafter_propose,
                                                          .accepted = drafter_accepted};

static void run_drafted(int right, bool penalties)
{
    struct fix f;
    struct tdm_sched_opts so = {.row_outputs = true};
    fix_open(&f, 64, &so, 64, 8);
    struct fake_drafter d = {.right = right};
    assert_int_equal(tdm_sched_set_drafter(f.s, &fake_drafter_i, &d, 3), TDM_OK);
    int32_t a[4];
    make_prompt(a, 4, 6);
    struct tdm_req_params rp = {.prompt = a,
                                .n_prompt = 4,
                                .max_tokens = 20,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1};
    if (penalties) rp.sampling.repetition_penalty = 1.1f;
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_OK);
    tdm_sched_step(f.s); /* the prompt; no drafts yet */
    int steps = 1;
    while (tdm_req_state(r) != TDM_REQ_FINISHED && steps < 100) {
        tdm_sched_step(f.s);
        steps++;
        if (tdm_req_state(r) == TDM_REQ_FINISHED) break;
        /* after each commit the KV keeps only the kept tokens' positions: outputs so far
         * minus the newest, whose KV the next step writes */
        struct tdm_req_view v;
        tdm_req_lock(r, &v);
        int n_cached = 4 + v.n_out - 1;
        tdm_req_unlock(r);
        assert_int_equal(tdm_kv_pool_stats(f.kv).used, (n_cached + PS - 1) / PS);
    }
    expect_output(r, a, 4, 20, TDM_FINISH_LENGTH);
    assert_true(d.calls > 0);
    assert_int_equal(d.published, 20 - 1); /* every output but the prompt's is a decode step's */
    assert_int_equal(d.steps, steps - 1);
    if (right == 0) assert_int_equal(d.accepted, 0);
    if (right >= 3) assert_int_equal(d.accepted, d.proposed);
    /* drafted spans: one row per draft plus one, each a sampled token (verified where it is
     * sampled, penalties or not) */
    bool drafted = false;
    for (int i = 0; i < f.x.n_rec; i++)
        if (f.x.rec[i].n_draft) {
            drafted = true;
            assert_int_equal(f.x.rec[i].n_rows, f.x.rec[i].n_draft + 1);
            assert_int_equal(f.x.rec[i].n_tokens, f.x.rec[i].n_draft + 1);
            assert_int_equal(f.x.rec[i].want, TDM_ROW_SAMPLE);
        }
    assert_true(drafted);
    if (right >= 3) assert_true(steps < 20); /* several tokens a step */
    tdm_req_release(r);
    fix_close(&f);
}

static void test_drafts_all_rejected(void **state)
{
    (void)state;
    run_drafted(0, false);
}

static void test_drafts_partly_accepted(void **state)
{
    (void)state;
    run_drafted(1, false);
    run_drafted(2, false);
}

static void test_drafts_all_accepted(void **state)
{
    (void)state;
    run_drafted(3, false);
}

/* ---- a fake tree drafter: the reference continuation on second children ----
 * At each depth: a wrong first child (with a wrong child of its own), then the right token,
 * under which the next depth goes on. The verified path runs through second children only, so
 * each kept draft was verified in a slot other than its position's: the commit must move its
 * KV down (the store is the pool's memory), or the next step's hash reads the wrong branch. */
struct fake_tree {
    int depth;
    bool rejection;
    long proposed, accepted, off_first, steps, published;
};

static int tree_add(struct tdm_sched_draft *x, int parent, int32_t tok)
{
    if (x->n >= x->k) return -1;
    x->out[x->n] = tok;
    x->parent[x->n] = parent;
    return x->n++;
}

static void tree_propose(void *ctx, struct tdm_sched_draft *dr, int n, int base_tokens)
{
    struct fake_tree *d = ctx;
    assert_true(n >= 1 && base_tokens >= n);
    for (int j = 0; j < n; j++) {
        struct tdm_sched_draft *x = &dr[j];
        assert_non_null(x->parent);
        int32_t ref[MAX_CTX];
        reference(x->tokens, x->n_tokens, d->depth, ref);
        x->n = 0;
        x->tree_rejection = d->rejection;
        int parent = -1;
        for (int dep = 0; dep < d->depth && dep < x->depth_cap && x->n + 3 <= x->k; dep++) {
            int wrong = tree_add(x, parent, (ref[dep] + 1) % VOCAB);
            tree_add(x, wrong, (ref[dep] + 2) % VOCAB);
            parent = tree_add(x, parent, ref[dep]);
        }
        assert_true(x->n_pages * PS >= x->n_tokens + x->k);
    }
}

static void tree_accepted(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                          int n_accepted, int n_published)
{
    struct fake_tree *d = ctx;
    (void)r;
    if (n_draft) {
        /* every kept draft is a second child */
        assert_int_equal(st->tree_off_first, n_accepted);
        assert_true(n_accepted <= st->tree_depth);
    }
    d->proposed += n_draft;
    d->accepted += n_accepted;
    d->off_first += st->tree_off_first;
    d->steps++;
    d->published += n_published;
}

static const struct tdm_sched_drafter_i fake_tree_i = {
    .propose = tree_propose, .accepted = tree_accepted, .tree = true};

static void run_tree(int depth, bool rejection, bool penalties)
{
    struct fix f;
    struct tdm_sched_opts so = {0};
    fix_open(&f, 64, &so, 64, 8);
    struct fake_tree d = {.depth = depth, .rejection = rejection};
    assert_int_equal(tdm_sched_set_drafter(f.s, &fake_tree_i, &d, 12), TDM_OK);
    int32_t a[5];
    make_prompt(a, 5, 9);
    struct tdm_req_params rp = {.prompt = a,
                                .n_prompt = 5,
                                .max_tokens = 30,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1};
    if (penalties) rp.sampling.repetition_penalty = 1.1f;
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_OK);
    int steps = 0;
    while (tdm_req_state(r) != TDM_REQ_FINISHED && steps < 100) {
        tdm_sched_step(f.s);
        steps++;
        if (tdm_req_state(r) == TDM_REQ_FINISHED) break;
        /* the KV keeps the kept positions only: the verified tree's other slots are trimmed */
        struct tdm_req_view v;
        tdm_req_lock(r, &v);
        int n_cached = 5 + v.n_out - 1;
        tdm_req_unlock(r);
        assert_int_equal(tdm_kv_pool_stats(f.kv).used, (n_cached + PS - 1) / PS);
    }
    expect_output(r, a, 5, 30, TDM_FINISH_LENGTH);
    assert_int_equal(d.published, 30 - 1);
    if (depth > 0) {
        assert_true(d.accepted > 0 && d.off_first == d.accepted);
        /* depth + 1 tokens a step (the budget of 12 holds the whole tree): the prompt's step,
         * then 29 outputs */
        assert_true(steps <= 1 + (29 + depth) / (depth + 1) + 1);
    }
    for (int i = 0; i < f.x.n_rec; i++) /* a tree span: one row a token */
        if (f.x.rec[i].n_draft) assert_int_equal(f.x.rec[i].n_rows, f.x.rec[i].n_tokens);
    tdm_req_release(r);
    fix_close(&f);
}

static void test_tree_drafts(void **state)
{
    (void)state;
    run_tree(1, false, false);
    run_tree(3, false, false);
    run_tree(3, true, false); /* rejection: each node's children as point masses */
    run_tree(4, false, true); /* penalties: each row's undo list is off its path */
}

static void test_drafts_with_penalties(void **state)
{
    (void)state;
    run_drafted(0, true);
    run_drafted(2, true);
    run_drafted(3, true);
}

static void test_executor_error(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8);
    f.x.fail_at_step = 3;
    int32_t a[6], b[6];
    make_prompt(a, 6, 7);
    make_prompt(b, 6, 8);
    tdm_req_t *rs[2] = {submit(&f, a, 6, 10, NULL), submit(&f, b, 6, 10, NULL)};
    run_until_done(&f, rs, 2);
    for (int i = 0; i < 2; i++) {
        struct tdm_req_view v;
        tdm_req_lock(rs[i], &v);
        assert_int_equal(v.finish, TDM_FINISH_ERROR);
        assert_int_equal(v.n_out, 2); /* steps 1 and 2 each published one token */
        tdm_req_unlock(rs[i]);
        tdm_req_release(rs[i]);
    }
    expect_baseline(&f);
    fix_close(&f);
}

/* Overlap: step N's sampling fails at its wait, which comes first when the plan behind it has a
 * prefill span (the collect-first path). That plan was built with N's token of request A as a
 * placeholder, which the executor no longer has; A fails with N, and B, whose first span is in
 * N + 1 only, runs on and finishes as it would have. The pool ends at its baseline. */
static void test_overlap_failed_sampling_spares_the_next_step(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.overlap = 1};
    fix_open(&f, 64, &so, 64, 8);
    int32_t a[6], b[10];
    make_prompt(a, 6, 60);
    make_prompt(b, 10, 61);
    tdm_req_t *ra = submit(&f, a, 6, 20, NULL);
    for (int it = 0; it < 4; it++) /* A's prefill, then decodes: one launched behind another */
        assert_true(tdm_sched_step(f.s));
    assert_int_equal(f.x.n_held, 1);
    tdm_req_t *rb = submit(&f, b, 10, 7, NULL);
    f.x.fail_wait_at_step = f.x.last_launch_step; /* the step in flight: A's decode */
    tdm_req_t *rs[2] = {ra, rb};
    run_until_done(&f, rs, 2);
    struct tdm_req_view v;
    tdm_req_lock(ra, &v);
    assert_int_equal(v.finish, TDM_FINISH_ERROR);
    assert_true(v.n_out >= 2 && v.n_out < 20);
    tdm_req_unlock(ra);
    expect_output(rb, b, 10, 7, TDM_FINISH_LENGTH);
    tdm_req_release(ra);
    tdm_req_release(rb);
    collect_launched(&f);
    assert_int_equal(f.x.n_held, 0);
    expect_baseline(&f);
    fix_close(&f);
}

/* The same failure when every request of the plan behind it was in the failed step (a prompt
 * prefilled in chunks, one a step): nothing is left to launch, nothing is in flight, and the
 * pages the plan reserved are back at once. */
static void test_overlap_failed_wait_empties_the_next_step(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.overlap = 1, .prefill_chunk = 4};
    fix_open(&f, 64, &so, 64, 8);
    int32_t c[20];
    make_prompt(c, 20, 62);
    tdm_req_t *rc = submit(&f, c, 20, 5, NULL);
    assert_true(tdm_sched_step(f.s)); /* chunk 1 launched */
    assert_int_equal(f.x.n_held, 1);
    f.x.fail_wait_at_step = f.x.last_launch_step;
    const int launches = f.x.launches;
    assert_true(tdm_sched_step(f.s));         /* chunk 2 planned, chunk 1 collected: it failed */
    assert_int_equal(f.x.launches, launches); /* chunk 2 was not launched */
    assert_int_equal(f.x.n_held, 0);
    struct tdm_req_view v;
    tdm_req_lock(rc, &v);
    assert_int_equal(v.finish, TDM_FINISH_ERROR);
    tdm_req_unlock(rc);
    tdm_req_release(rc);
    expect_baseline(&f);
    /* and the scheduler goes on */
    int32_t d[6];
    make_prompt(d, 6, 63);
    tdm_req_t *rd = submit(&f, d, 6, 4, NULL);
    run_until_done(&f, &rd, 1);
    expect_output(rd, d, 6, 4, TDM_FINISH_LENGTH);
    tdm_req_release(rd);
    collect_launched(&f);
    expect_baseline(&f);
    fix_close(&f);
}

/* Waits (at most 100 x 100 ms) for r to finish; returns how it finished. */
static enum tdm_finish wait_finished(tdm_req_t *r)
{
    struct tdm_req_view v;
    for (int it = 0; it < 100; it++) {
        tdm_req_lock(r, &v);
        const enum tdm_finish fin = v.finish;
        tdm_req_unlock(r);
        if (fin != TDM_FINISH_NONE) return fin;
        tdm_req_wait(r, v.n_out, 100);
    }
    tdm_req_lock(r, &v);
    const enum tdm_finish fin = v.finish;
    tdm_req_unlock(r);
    return fin;
}

/* Waits (bounded) until cond(f) holds. */
static bool wait_for(struct fix *f, bool (*cond)(struct fix *), int ms)
{
    for (int i = 0; i < ms / 5; i++) {
        if (cond(f)) return true;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    return cond(f);
}
static bool is_stalled(struct fix *f)
{
    return tdm_sched_stall_ms(f->s) > 0;
}
static bool is_unstalled_and_empty(struct fix *f)
{
    return tdm_sched_stall_ms(f->s) == 0 && tdm_kv_pool_stats(f->kv).used == 0;
}

/* A step that never ends (the executor blocks): the watchdog fails the running and the
 * waiting requests with TDM_ETIMEDOUT, refuses submissions and reports the stall; when the
 * step comes back, the scheduler drops the failed requests, its pages come back, and the next
 * request is served as if nothing had happened. */
static void test_watchdog(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.watchdog_ms = 150};
    fix_open(&f, 64, &so, 64, 1); /* one sequence at a time: the second request waits */
    f.x.block_at_step = 3;
    assert_int_equal(tdm_sched_start(f.s), TDM_OK);
    int32_t a[6], b[6], c[6];
    make_prompt(a, 6, 1);
    make_prompt(b, 6, 2);
    make_prompt(c, 6, 3);
    tdm_req_t *rs[2] = {submit(&f, a, 6, 10, NULL), submit(&f, b, 6, 10, NULL)};
    for (int i = 0; i < 2; i++) {
        struct tdm_req_view v;
        wait_finished(rs[i]);
        tdm_req_lock(rs[i], &v);
        assert_int_equal(v.finish, TDM_FINISH_ERROR);
        assert_int_equal(v.error, TDM_ETIMEDOUT);
        assert_non_null(strstr(v.error_msg, "stalled"));
        assert_int_equal(v.n_out, i == 0 ? 2 : 0); /* steps 1 and 2 ran; b never did */
        tdm_req_unlock(rs[i]);
    }
    assert_true(is_stalled(&f));
    assert_true(f.x.blocked);
    /* while stalled: submissions are refused, the stall is counted, the pages are still held
     * by the stuck step */
    struct tdm_req_params rp = {.prompt = c,
                                .n_prompt = 6,
                                .max_tokens = 4,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1};
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_EAGAIN);
    assert_non_null(strstr(tdm_err_msg(), "stalled"));
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(f.s, &m);
    assert_int_equal(m.stalls, 1);
    assert_int_equal(m.watchdog_failed, 2);
    assert_true(m.stalled_ms > 0);
    assert_true(m.kv.used > 0);
    /* the step comes back */
    pthread_mutex_lock(&f.x.mu);
    f.x.unblock = true;
    pthread_cond_broadcast(&f.x.cv);
    pthread_mutex_unlock(&f.x.mu);
    assert_true(wait_for(&f, is_unstalled_and_empty, 5000));
    tdm_sched_metrics(f.s, &m);
    assert_int_equal(m.finished[TDM_FINISH_ERROR], 2);
    assert_int_equal(m.running + m.waiting, 0);
    for (int i = 0; i < 2; i++)
        tdm_req_release(rs[i]);
    /* and serves the next request as if nothing had happened */
    r = submit(&f, c, 6, 4, NULL);
    wait_finished(r);
    expect_output(r, c, 6, 4, TDM_FINISH_LENGTH);
    tdm_req_release(r);
    assert_true(tdm_sched_stop(f.s, 1000));
    fix_close(&f);
}

/* A prefill-only request (a prefill node's) samples nothing, wants its last row's hidden state
 * and finishes after its last span. */
static void test_prefill_only_rows(void **state)
{
    (void)state;
    struct fix f;
    struct tdm_sched_opts so = {.row_outputs = true};
    fix_open(&f, 64, &so, 64, 8);
    int32_t a[10];
    make_prompt(a, 10, 9);
    struct tdm_req_params rp = {.prompt = a,
                                .n_prompt = 10,
                                .max_tokens = 1,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = -1,
                                .prefill_only = true,
                                .fixed_chunk = 4,
                                .want_hidden = true};
    tdm_req_t *r = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &r), TDM_OK);
    run_until_done(&f, &r, 1);
    assert_int_equal(f.x.n_rec, 3); /* 4 + 4 + 2 */
    assert_int_equal(f.x.rec[2].n_rows, 1);
    assert_int_equal(f.x.rec[2].want, TDM_ROW_HIDDEN);
    assert_int_equal(f.x.rec[0].n_rows, 0);
    struct tdm_req_view v;
    tdm_req_lock(r, &v);
    assert_int_equal(v.finish, TDM_FINISH_STOP);
    assert_int_equal(v.n_out, 0);
    tdm_req_unlock(r);
    tdm_req_release(r);
    /* without row outputs a request cannot ask for them */
    struct fix g;
    fix_open(&g, 16, NULL, 64, 8);
    assert_int_equal(tdm_sched_submit(g.s, &rp, &r), TDM_EINVAL);
    /* ... until they are reserved (what the prefill connector does) */
    assert_int_equal(tdm_sched_reserve_rows(g.s), TDM_OK);
    assert_int_equal(tdm_sched_submit(g.s, &rp, &r), TDM_OK);
    run_until_done(&g, &r, 1);
    tdm_req_release(r);
    fix_close(&g);
    fix_close(&f);
}

/* A group (n and best_of): the leader prefills the prompt, the followers wait for it and then
 * take its KV (full pages shared, the partial one copied) and run prompt[-1] alone; their
 * output is the stand-in's, read through pages the leader wrote. A follower that finds no
 * running slot prefills alone; one cancelled while it waits ends cancelled; a leader that ends
 * in the step its prompt completes (max_tokens 1) still hands the KV over. The pool is back at
 * its baseline after each. */
static void run_group(int max_seqs, int chunk, int n, int leader_max, int cancel_one, int overlap)
{
    struct fix f;
    struct tdm_sched_opts so = {.prefill_chunk = chunk, .overlap = overlap};
    fix_open(&f, 64, &so, 64, max_seqs);
    int32_t a[10];
    make_prompt(a, 10, 7);
    struct tdm_req_params ps[4];
    for (int i = 0; i < n; i++)
        ps[i] = (struct tdm_req_params){.prompt = a,
                                        .n_prompt = 10,
                                        .max_tokens = i ? 6 : leader_max,
                                        .ignore_eos = true,
                                        .sampling = tdm_sampling_defaults(),
                                        .top_logprobs = -1};
    tdm_req_t *rs[4];
    assert_int_equal(tdm_sched_submit_group(f.s, ps, n, rs), TDM_OK);
    for (int i = 1; i < n; i++)
        f.x.leader_of[tdm_req_id(rs[i])] = tdm_req_id(rs[0]);
    if (cancel_one) tdm_req_cancel(rs[n - 1]);
    run_until_done(&f, rs, n);
    int shared = 0, leader_last_step = 0;
    for (int i = 0; i < f.x.n_rec; i++)
        if (f.x.rec[i].req_id == tdm_req_id(rs[0]) && f.x.rec[i].pos0 + f.x.rec[i].n_tokens == 10)
            leader_last_step = (int)f.x.rec[i].step;
    for (int j = 1; j < n; j++) {
        int first = -1;
        for (int i = 0; i < f.x.n_rec && first < 0; i++)
            if (f.x.rec[i].req_id == tdm_req_id(rs[j])) first = i;
        if (cancel_one && j == n - 1) {
            assert_int_equal(first, -1); /* never ran */
            continue;
        }
        assert_true(first >= 0);
        if (f.x.rec[first].pos0 == 9) { /* took the KV: prompt[-1] alone, after the leader's */
            assert_int_equal(f.x.rec[first].n_tokens, 1);
            assert_true((int)f.x.rec[first].step > leader_last_step);
            shared++;
        } else {
            assert_int_equal(f.x.rec[first].pos0, 0);
        }
    }
    expect_output(rs[0], a, 10, leader_max, TDM_FINISH_LENGTH);
    for (int j = 1; j < n; j++) {
        if (cancel_one && j == n - 1) {
            struct tdm_req_view v;
            tdm_req_lock(rs[j], &v);
            assert_int_equal(v.finish, TDM_FINISH_CANCELLED);
            tdm_req_unlock(rs[j]);
        } else {
            expect_output(rs[j], a, 10, 6, TDM_FINISH_LENGTH);
        }
    }
    /* room for everyone: every follower shared; one running slot: none could */
    assert_int_equal(shared, max_seqs >= n ? n - 1 - cancel_one : 0);
    for (int i = 0; i < n; i++)
        tdm_req_release(rs[i]);
    fix_close(&f);
}

static void test_groups_share_the_prompt(void **state)
{
    (void)state;
    run_group(8, 4, 4, 5, 0, 0);  /* three spans of the prompt, then three followers */
    run_group(8, 64, 3, 1, 0, 0); /* the leader ends as it hands over */
    run_group(8, 4, 4, 5, 1, 0);  /* a follower cancelled while it waits */
    run_group(1, 4, 3, 5, 0, 0);  /* one slot: each prefills alone */
    /* overlap: the leader's first output is in flight when the followers' turn comes; they
     * still wait for its commit and take the prompt's KV */
    run_group(8, 4, 4, 5, 0, 1);
    run_group(8, 64, 3, 1, 0, 1);
    /* a group shares one prompt */
    struct fix f;
    fix_open(&f, 16, NULL, 64, 8);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 5};
    struct tdm_req_params ps[2] = {{.prompt = a,
                                    .n_prompt = 4,
                                    .max_tokens = 2,
                                    .sampling = tdm_sampling_defaults(),
                                    .top_logprobs = -1},
                                   {.prompt = b,
                                    .n_prompt = 4,
                                    .max_tokens = 2,
                                    .sampling = tdm_sampling_defaults(),
                                    .top_logprobs = -1}};
    tdm_req_t *rs[2];
    assert_int_equal(tdm_sched_submit_group(f.s, ps, 2, rs), TDM_EINVAL);
    assert_int_equal(tdm_sched_submit_group(f.s, ps, 0, rs), TDM_ERANGE);
    /* a one-token prompt: nothing to share, each runs its token */
    ps[0].n_prompt = ps[1].n_prompt = 1;
    assert_int_equal(tdm_sched_submit_group(f.s, ps, 2, rs), TDM_OK);
    f.x.leader_of[tdm_req_id(rs[1])] = tdm_req_id(rs[0]);
    run_until_done(&f, rs, 2);
    for (int i = 0; i < 2; i++) {
        expect_output(rs[i], a, 1, 2, TDM_FINISH_LENGTH);
        tdm_req_release(rs[i]);
    }
    fix_close(&f);
}

/* The metrics of a cache being flushed by the scheduler thread: every snapshot taken meanwhile
 * has the cache's pages among the pool's used ones (a snapshot once saw the pages back in the
 * pool and the cache still naming them, and a test read a flushed cache as full), and the last
 * one has none. */
static void test_prefix_metrics_during_a_flush(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 1024, NULL, 64, 8);
    assert_int_equal(tdm_sched_enable_prefix_cache(f.s, 1), TDM_OK);
    enum { N = 24, LEN = 120 };
    static int32_t p[N][LEN];
    tdm_req_t *rs[N];
    for (int i = 0; i < N; i++) {
        make_prompt(p[i], LEN, 100 + i);
        rs[i] = submit(&f, p[i], LEN, 1, NULL);
    }
    run_until_done(&f, rs, N);
    for (int i = 0; i < N; i++)
        tdm_req_release(rs[i]);
    assert_int_equal(tdm_sched_start(f.s), TDM_OK);
    for (int round = 0; round < 8; round++) {
        struct tdm_sched_metrics_snapshot m;
        tdm_sched_metrics(f.s, &m);
        assert_true(m.prefix.pages >= (int64_t)N * (LEN / PS - 1) / (round ? N : 1));
        tdm_sched_flush_prefix_cache(f.s);
        for (long it = 0;; it++) {
            tdm_sched_metrics(f.s, &m);
            assert_true(m.prefix.pages <= m.kv.used);
            if (m.kv.used == 0 && m.prefix.pages == 0) break;
            assert_true(it < 50000000);
        }
        /* fill it again from the scheduler thread */
        rs[0] = submit(&f, p[round], LEN, 1, NULL);
        assert_int_equal(wait_finished(rs[0]), TDM_FINISH_LENGTH);
        tdm_req_release(rs[0]);
        for (long it = 0;; it++) { /* the figures come after the step that stored the pages */
            tdm_sched_metrics(f.s, &m);
            assert_true(m.prefix.pages <= m.kv.used);
            if (m.prefix.pages >= LEN / PS - 1) break;
            assert_true(it < 50000000);
        }
    }
    fix_close(&f);
}

/* Prefix caching: a request reuses the whole pages of an earlier one's token list that its own
 * starts with (its first span starts past them, at least its last token left to run), reads
 * them through its page table (the stand-in's output is right only if they hold that prefix),
 * and reports them as cached; a small pool evicts what only the cache holds instead of
 * failing; a flush gives every page back. */
static void test_prefix_cache(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8);
    assert_int_equal(tdm_sched_enable_prefix_cache(f.s, 1), TDM_OK);
    int32_t a[22], b[30];
    make_prompt(a, 22, 5);
    memcpy(b, a, sizeof a);
    for (int i = 22; i < 30; i++)
        b[i] = (int32_t)(i % VOCAB);
    tdm_req_t *ra = submit(&f, a, 22, 5, NULL);
    run_until_done(&f, &ra, 1);
    expect_output(ra, a, 22, 5, TDM_FINISH_LENGTH);
    /* b shares a's prompt; a's outputs (positions 22..25) differ from b's tokens there */
    int before = f.x.n_rec;
    tdm_req_t *rb = submit(&f, b, 30, 4, NULL);
    tdm_req_t *rc = submit(&f, a, 22, 5, NULL);
    f.x.leader_of[tdm_req_id(rb)] = f.x.leader_of[tdm_req_id(rc)] = tdm_req_id(ra);
    tdm_req_t *rs[2] = {rb, rc};
    run_until_done(&f, rs, 2);
    expect_output(rb, b, 30, 4, TDM_FINISH_LENGTH);
    expect_output(rc, a, 22, 5, TDM_FINISH_LENGTH); /* the same as the first time */
    for (int i = before; i < f.x.n_rec; i++)
        if (f.x.rec[i].req_id == tdm_req_id(rb) || f.x.rec[i].req_id == tdm_req_id(rc)) {
            assert_int_equal(f.x.rec[i].pos0, 20); /* five pages of 4 reused */
            break;
        }
    for (int k = 0; k < 2; k++) {
        struct tdm_req_view v;
        tdm_req_lock(rs[k], &v);
        assert_int_equal(v.cached_tokens, 20);
        tdm_req_unlock(rs[k]);
    }
    struct tdm_sched_metrics_snapshot m;
    tdm_sched_metrics(f.s, &m);
    assert_true(m.prefix_on && m.prefix.hit_tokens == 40 && m.prefix.pages > 0);
    assert_int_equal(m.kv.used, m.prefix.pages); /* idle: the cache's pages alone */
    tdm_req_release(ra);
    tdm_req_release(rb);
    tdm_req_release(rc);
    tdm_sched_flush_prefix_cache(f.s);
    tdm_sched_step(f.s);
    expect_baseline(&f);
    fix_close(&f);

    /* a pool of 12 pages: thirty distinct requests (each up to 5 pages) finish, evicting */
    struct tdm_sched_opts so = {.watermark_pages = -1};
    fix_open(&f, 12, &so, 64, 8);
    assert_int_equal(tdm_sched_enable_prefix_cache(f.s, 1), TDM_OK);
    int32_t p[30][12];
    tdm_req_t *many[30];
    for (int i = 0; i < 30; i++) {
        make_prompt(p[i], 12, 40 + i);
        many[i] = submit(&f, p[i], 12, 6, NULL);
    }
    run_until_done(&f, many, 30);
    for (int i = 0; i < 30; i++) {
        expect_output(many[i], p[i], 12, 6, TDM_FINISH_LENGTH);
        tdm_req_release(many[i]);
    }
    tdm_sched_metrics(f.s, &m);
    assert_true(m.prefix.evicted_pages > 0);
    fix_close(&f); /* destroying the scheduler drops the cache: the pool at its baseline */

    /* with a connector (a decode node): a request that reuses a cached prefix asks for the
     * rest only, and one whose prompt[:-1] is all cached is not asked for at all */
    fix_open(&f, 64, NULL, 64, 8);
    struct fake_conn c = {.f = &f, .take = true};
    tdm_sched_set_connector(f.s, &fake_conn_i, &c);
    assert_int_equal(tdm_sched_enable_prefix_cache(f.s, 1), TDM_OK);
    ra = submit(&f, a, 22, 5, NULL);
    tdm_sched_step(f.s);
    assert_int_equal(c.last_cached, 0);
    conn_land(&c);
    run_until_done(&f, &ra, 1);
    expect_output(ra, a, 22, 5, TDM_FINISH_LENGTH);
    rb = submit(&f, b, 30, 4, NULL);                /* shares a's first 20 tokens (five pages) */
    f.x.leader_of[tdm_req_id(rb)] = tdm_req_id(ra); /* whose KV it reads below 20 */
    tdm_sched_step(f.s);
    assert_int_equal(c.admits, 2);
    assert_int_equal(c.last_cached, 20);
    assert_int_equal(tdm_req_state(rb), TDM_REQ_WAITING_REMOTE_KV);
    conn_land(&c);
    run_until_done(&f, &rb, 1);
    expect_output(rb, b, 30, 4, TDM_FINISH_LENGTH);
    int32_t d[21]; /* a's first 20 tokens and one more: prompt[:-1] all cached */
    memcpy(d, a, 20 * sizeof *d);
    d[20] = 7;
    tdm_req_t *rd = submit(&f, d, 21, 3, NULL);
    f.x.leader_of[tdm_req_id(rd)] = tdm_req_id(ra);
    run_until_done(&f, &rd, 1);
    assert_int_equal(c.admits, 2); /* run here */
    expect_output(rd, d, 21, 3, TDM_FINISH_LENGTH);
    tdm_req_release(ra);
    tdm_req_release(rb);
    tdm_req_release(rd);
    tdm_sched_flush_prefix_cache(f.s);
    tdm_sched_step(f.s);
    expect_baseline(&f);
    fix_close(&f);
}

/* The reference score of prompt token x (x >= 1): the stand-in's, after prompt[0, x). */
static float ref_score(const int32_t *prompt, int x)
{
    uint64_t h = HASH0;
    for (int i = 0; i < x; i++)
        h = hash_step(h, prompt[i]);
    return score_of(h, prompt[x]);
}

static void expect_scores(tdm_req_t *r, const int32_t *prompt, int n_prompt, int top)
{
    struct tdm_req_view v;
    tdm_req_lock(r, &v);
    assert_int_equal(v.n_scored, n_prompt - 1);
    assert_int_equal(v.prompt_top, top);
    for (int x = 1; x < n_prompt; x++) {
        assert_float_equal(v.prompt_lps[x], ref_score(prompt, x), 0.0f);
        for (int j = 0; j < top; j++) {
            assert_int_equal(v.prompt_top_ids[x * top + j], (prompt[x] + j) % VOCAB);
            assert_float_equal(v.prompt_top_lps[x * top + j], ref_score(prompt, x) - (float)j,
                               0.0f);
        }
    }
    tdm_req_unlock(r);
}

/* A request that scores its prompt (prompt_logprobs): every prompt span brings back a row per
 * token (SCORE rows, then the sampled one at the prompt's end), spans are cut to the rows a
 * step has left, a connector never takes it, and with max_tokens 0 it ends once scored. The
 * scores are the stand-in's for each prefix, read back through the page table. */
static void test_prompt_scores(void **state)
{
    (void)state;
    struct fix f;
    fix_open(&f, 64, NULL, 64, 8); /* 24 rows a step */
    struct fake_conn c = {.f = &f, .take = true};
    tdm_sched_set_connector(f.s, &fake_conn_i, &c);
    int32_t a[60], b[9], d[7];
    make_prompt(a, 60, 4);
    make_prompt(b, 9, 5);
    make_prompt(d, 7, 6);
    struct tdm_req_params rp = {.prompt = a,
                                .n_prompt = 60,
                                .max_tokens = 4,
                                .ignore_eos = true,
                                .sampling = tdm_sampling_defaults(),
                                .top_logprobs = 3,
                                .prompt_logprobs = true};
    tdm_req_t *ra = NULL, *rb = NULL;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &ra), TDM_OK);
    rp.prompt = b, rp.n_prompt = 9, rp.max_tokens = 0, rp.top_logprobs = -1; /* scores only */
    assert_int_equal(tdm_sched_submit(f.s, &rp, &rb), TDM_OK);
    tdm_req_t *rc = submit(&f, d, 7, 5, NULL); /* an ordinary one, taken remote */
    tdm_req_t *rs[3] = {ra, rb, rc};
    for (int it = 0; it < 200 && c.admits == 0; it++)
        tdm_sched_step(f.s);
    conn_land(&c);
    run_until_done(&f, rs, 3);
    assert_int_equal(c.admits, 1); /* rc alone */
    int scored_rows = 0;
    for (int i = 0; i < f.x.n_rec; i++) {
        const struct plan_rec *pr = &f.x.rec[i];
        assert_true(pr->n_rows <= 24);
        if (pr->req_id == tdm_req_id(rc)) assert_int_equal(pr->n_score, 0);
        if (pr->req_id != tdm_req_id(ra) && pr->req_id != tdm_req_id(rb)) continue;
        if (pr->pos0 + pr->n_tokens <= (pr->req_id == tdm_req_id(ra) ? 60 : 9)) {
            /* a prompt span: a row a token, the last one sampled */
            assert_int_equal(pr->n_rows, pr->n_tokens);
            scored_rows += pr->n_score;
        } else {
            assert_int_equal(pr->n_score, 0); /* decodes score nothing */
        }
    }
    assert_int_equal(scored_rows, 59 + 8);
    expect_output(ra, a, 60, 4, TDM_FINISH_LENGTH);
    expect_scores(ra, a, 60, 3);
    expect_output(rb, b, 9, 0, TDM_FINISH_LENGTH);
    expect_scores(rb, b, 9, 0);
    expect_output(rc, d, 7, 5, TDM_FINISH_LENGTH);
    struct tdm_req_view v;
    tdm_req_lock(rc, &v);
    assert_null(v.prompt_lps);
    tdm_req_unlock(rc);
    /* the reader copies them out once final, and takes max_tokens 0 */
    tdm_req_reader_t *rdr = NULL;
    assert_int_equal(tdm_req_reader_create(NULL, NULL, 0, 4, 3, &rdr), TDM_OK);
    tdm_req_reader_update(rdr, ra, &v);
    assert_non_null(v.prompt_lps);
    assert_int_equal(v.n_scored, 59);
    assert_float_equal(v.prompt_lps[59], ref_score(a, 59), 0.0f);
    assert_int_equal(v.prompt_top_ids[59 * 3 + 2], (a[59] + 2) % VOCAB);
    tdm_req_reader_destroy(rdr);
    for (int i = 0; i < 3; i++)
        tdm_req_release(rs[i]);
    /* a one-token prompt has nothing to score: it is prefilled and ends */
    rp.n_prompt = 1;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &ra), TDM_OK);
    run_until_done(&f, &ra, 1);
    expect_output(ra, b, 1, 0, TDM_FINISH_LENGTH);
    expect_scores(ra, b, 1, 0);
    tdm_req_release(ra);
    /* what cannot score: a prefill-only request; max_tokens 0 without scoring */
    rp.n_prompt = 9, rp.prefill_only = true;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &ra), TDM_EINVAL);
    rp.prefill_only = false, rp.prompt_logprobs = false;
    assert_int_equal(tdm_sched_submit(f.s, &rp, &ra), TDM_EINVAL);
    fix_close(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admission_and_decode),
        cmocka_unit_test(test_chunking_and_mixed_batches),
        cmocka_unit_test(test_preemption),
        cmocka_unit_test(test_overlap),
        cmocka_unit_test(test_overlap_preempt_in_flight),
        cmocka_unit_test(test_overlap_failed_sampling_spares_the_next_step),
        cmocka_unit_test(test_overlap_failed_wait_empties_the_next_step),
        cmocka_unit_test(test_overlap_holds_pages),
        cmocka_unit_test(test_remote_kv),
        cmocka_unit_test(test_remote_failure_then_local),
        cmocka_unit_test(test_cancel_everywhere),
        cmocka_unit_test(test_drafts_all_rejected),
        cmocka_unit_test(test_drafts_partly_accepted),
        cmocka_unit_test(test_drafts_all_accepted),
        cmocka_unit_test(test_drafts_with_penalties),
        cmocka_unit_test(test_tree_drafts),
        cmocka_unit_test(test_executor_error),
        cmocka_unit_test(test_watchdog),
        cmocka_unit_test(test_prefill_only_rows),
        cmocka_unit_test(test_prompt_scores),
        cmocka_unit_test(test_groups_share_the_prompt),
        cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_prefix_metrics_during_a_flush),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
