/* Unit tests for tensor parallelism's shard geometry (the sharding contract, DESIGN.md §5) and
 * its rank group: every split of query heads, KV heads, MLP columns and vocabulary over N ranks
 * for H KV heads, replica sets included, checked against the contract's own statements; the
 * refusals; and the all-reduce, whose sum must be every buffer's, in rank order, run after run.
 * The pool side (a shard pool follows the leader's slot copies) is at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/kv.h"
#include "tandem/tp.h"

static struct tdm_model_config config(int q_heads, int kv_heads, int d_ff, int vocab)
{
    struct tdm_model_config c = {0};
    c.n_heads = q_heads;
    c.n_kv_heads = kv_heads;
    c.head_dim = 16;
    c.d_ff = d_ff;
    c.vocab_size = vocab;
    return c;
}

/* Every shard of N ranks: each replica set covers the KV heads once, in contiguous ranges of
 * H / min(N, H) heads where that divides; each query head is computed by exactly one rank and
 * reads a KV head its rank holds; the MLP columns and the vocabulary are covered once, in
 * order, the MLP in whole blocks. */
static void check_split(int Q, int H, int N, int d_ff, int64_t align, int vocab)
{
    struct tdm_model_config c = config(Q, H, d_ff, vocab);
    const int S = N < H ? N : H, g = Q / H;
    int q_seen[64] = {0};
    int64_t ff_next = 0, v_next = 0;
    int kv_next[64] = {0}; /* per replica set */
    for (int r = 0; r < N; r++) {
        struct tdm_tp_shard s;
        assert_int_equal(tdm_tp_shard_of(&c, N, r, align, &s), TDM_OK);
        assert_int_equal(s.rank, r);
        assert_int_equal(s.n_replica_sets, N / S);
        assert_int_equal(s.replica_set, r / S);
        assert_int_equal(s.kv_head0, kv_next[s.replica_set]); /* members in order */
        assert_true(s.n_kv_heads >= 1);
        if (H % S == 0)
            assert_int_equal(s.n_kv_heads, H / S);
        else
            assert_true(s.n_kv_heads == H / S || s.n_kv_heads == H / S + 1);
        kv_next[s.replica_set] += s.n_kv_heads;
        /* an even split: Q / N each (a share of one KV head's when N > H); else its heads' */
        assert_int_equal(s.n_q_heads, H % S == 0 ? Q / N : s.n_kv_heads * g);
        for (int q = s.q_head0; q < s.q_head0 + s.n_q_heads; q++) {
            q_seen[q]++;
            int kv = q / g; /* the KV head query head q reads */
            assert_true(kv >= s.kv_head0 && kv < s.kv_head0 + s.n_kv_heads);
        }
        assert_int_equal(s.ff0, ff_next);
        assert_int_equal(s.ff0 % align, 0);
        assert_int_equal(s.n_ff % align, 0);
        assert_true(s.n_ff > 0);
        ff_next += s.n_ff;
        assert_int_equal(s.vocab0, v_next);
        v_next += s.n_vocab;
    }
    for (int set = 0; set < N / S; set++)
        assert_int_equal(kv_next[set], H);
    for (int q = 0; q < Q; q++)
        assert_int_equal(q_seen[q], 1);
    assert_int_equal(ff_next, d_ff);
    assert_int_equal(v_next, vocab);
}

static void test_shard_matrix(void **state)
{
    (void)state;
    const int Hs[] = {1, 2, 4, 8}, Ns[] = {1, 2, 4};
    for (size_t i = 0; i < sizeof Hs / sizeof *Hs; i++)
        for (size_t j = 0; j < sizeof Ns / sizeof *Ns; j++) {
            check_split(8, Hs[i], Ns[j], 256, 1, 272);
            check_split(32, Hs[i], Ns[j], 1536, 32, 49152);
        }
    check_split(9, 3, 2, 1536, 32, 49152); /* the default model: 2 + 1 KV heads */
    /* ... and the MLP balancing the heads: 672 + 864 columns (in units of 64 x 576 weights:
     * 2 (6 + 2) + 3 x 672 / 64 = 47.5 against 2 (3 + 1) + 3 x 864 / 64 = 48.5) */
    struct tdm_model_config smol = config(9, 3, 1536, 49152);
    smol.head_dim = 64;
    struct tdm_tp_shard a, b;
    assert_int_equal(tdm_tp_shard_of(&smol, 2, 0, 32, &a), TDM_OK);
    assert_int_equal(tdm_tp_shard_of(&smol, 2, 1, 32, &b), TDM_OK);
    assert_int_equal(a.n_kv_heads, 2);
    assert_int_equal(a.n_ff, 672);
    assert_int_equal(b.ff0, 672);
    assert_int_equal(b.n_ff, 864);
    /* an even head split: an even MLP split */
    struct tdm_model_config even = config(8, 4, 1024, 272);
    assert_int_equal(tdm_tp_shard_of(&even, 4, 3, 32, &a), TDM_OK);
    assert_int_equal(a.ff0, 768);
    assert_int_equal(a.n_ff, 256);
    check_split(9, 3, 3, 1536, 32, 49152);
    check_split(6, 3, 2, 192, 1, 272);
    check_split(8, 2, 8, 256, 32, 271); /* 4 replica sets of 2, one query head a rank */
}

static void test_shard_refusals(void **state)
{
    (void)state;
    struct tdm_tp_shard s;
    struct tdm_model_config c = config(9, 3, 1536, 49152);
    assert_int_equal(tdm_tp_shard_of(&c, 4, 0, 32, &s), TDM_EUNSUPPORTED); /* 4 % 3 */
    assert_non_null(strstr(tdm_err_msg(), "3 KV heads"));
    c = config(4, 2, 128, 272);
    assert_int_equal(tdm_tp_shard_of(&c, 8, 0, 1, &s), TDM_EUNSUPPORTED); /* 2 q over 4 */
    assert_non_null(strstr(tdm_err_msg(), "replicas"));
    c = config(8, 8, 64, 272);
    assert_int_equal(tdm_tp_shard_of(&c, 4, 0, 32, &s), TDM_EUNSUPPORTED); /* 2 blocks */
    assert_non_null(strstr(tdm_err_msg(), "intermediate"));
    assert_int_equal(tdm_tp_shard_of(&c, 2, 2, 1, &s), TDM_EINVAL); /* no rank 2 of 2 */
    assert_int_equal(tdm_tp_shard_of(&c, 0, 0, 1, &s), TDM_EINVAL);
}

enum { N_RANKS = 4, N_VALUES = 1003, ROUNDS = 50 };

struct rank_arg {
    tdm_tp_group_t *g;
    int rank;
    float buf[ROUNDS][N_VALUES];
};

static float value(int round, int rank, int i)
{
    /* rank 0 and rank 2 cancel (+-B, B >= 1e8), rank 1 is below B's half ulp, rank 3 is small
     * and never 0: in rank order the sum is exactly rank 3's value, in any order that adds
     * rank 3's before B has cancelled it is 0 */
    const int k = (i * 7919 + round * 13) % 1000;
    switch (rank) {
    case 0:
        return (float)(k + 1) * 1e8f;
    case 1:
        return (float)((i + round) % 4) * 0.5f;
    case 2:
        return -(float)(k + 1) * 1e8f;
    default:
        return (float)((i * 31 + round) % 1000 + 1) * 1e-3f;
    }
}

static void *rank_main(void *p)
{
    struct rank_arg *a = p;
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < N_VALUES; i++)
            a->buf[round][i] = value(round, a->rank, i);
        tdm_tp_allreduce(a->g, a->rank, a->buf[round], N_VALUES);
    }
    return NULL;
}

static void test_allreduce(void **state)
{
    (void)state;
    tdm_tp_group_t *g;
    assert_int_equal(tdm_tp_group_create(N_RANKS, N_VALUES, &g), TDM_OK);
    assert_int_equal(tdm_tp_group_size(g), N_RANKS);
    struct rank_arg *a = calloc(N_RANKS, sizeof *a);
    assert_non_null(a);
    pthread_t t[N_RANKS];
    for (int r = 0; r < N_RANKS; r++) {
        a[r].g = g;
        a[r].rank = r;
        if (r) assert_int_equal(pthread_create(&t[r], NULL, rank_main, &a[r]), 0);
    }
    rank_main(&a[0]);
    for (int r = 1; r < N_RANKS; r++)
        pthread_join(t[r], NULL);
    for (int round = 0; round < ROUNDS; round++)
        for (int i = 0; i < N_VALUES; i++) {
            float want = value(round, 0, i);
            for (int r = 1; r < N_RANKS; r++)
                want += value(round, r, i);
            for (int r = 0; r < N_RANKS; r++) /* rank order, bit for bit, in every buffer */
                assert_memory_equal(&a[r].buf[round][i], &want, sizeof want);
        }
    free(a);
    tdm_tp_group_destroy(g);
    tdm_tp_group_destroy(NULL);
}

/* A shard pool holds its heads at the leader's page ids: a slot copy on the leader's pool
 * reaches it. */
static void test_pool_shard_copies(void **state)
{
    (void)state;
    tdm_backend_t *b;
    struct tdm_backend_cpu_opts bo = {.n_threads = 1};
    assert_int_equal(tdm_backend_cpu_create(&bo, &b), TDM_OK);
    struct tdm_kv_config c = {
        .n_layers = 2, .n_kv_heads = 1, .head_dim = 4, .page_size = 4, .n_pages = 8};
    tdm_kv_pool_t *lead, *shard, *other;
    assert_int_equal(tdm_kv_pool_create(&c, b, &lead), TDM_OK);
    assert_int_equal(tdm_kv_pool_create(&c, b, &shard), TDM_OK);
    c.n_pages = 9;
    assert_int_equal(tdm_kv_pool_create(&c, b, &other), TDM_OK);
    assert_int_equal(tdm_kv_pool_add_shard(lead, other), TDM_EINVAL); /* another page count */
    assert_int_equal(tdm_kv_pool_add_shard(lead, lead), TDM_EINVAL);
    assert_int_equal(tdm_kv_pool_add_shard(lead, shard), TDM_OK);
    struct tdm_kv_geometry gs = tdm_kv_pool_geometry(shard);
    float *mem = gs.base;
    for (size_t i = 0; i < gs.bytes / sizeof(float); i++)
        mem[i] = (float)i;
    const int32_t src[] = {5}, dst[] = {17}; /* page 1 offset 1 -> page 4 offset 1 */
    tdm_kv_pool_copy_slots(lead, src, dst, 1);
    for (int l = 0; l < 2; l++)
        for (int kv = 0; kv < 2; kv++) { /* K and V rows of the slot, each layer */
            size_t at = l * gs.layer_bytes + kv * gs.v_offset;
            const float *from = (const float *)((uint8_t *)gs.base + at + 1 * gs.page_bytes) + 4;
            const float *to = (const float *)((uint8_t *)gs.base + at + 4 * gs.page_bytes) + 4;
            assert_memory_equal(from, to, 4 * sizeof(float));
        }
    tdm_kv_pool_destroy(lead);
    tdm_kv_pool_destroy(shard);
    tdm_kv_pool_destroy(other);
    tdm_backend_destroy(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_matrix),
        cmocka_unit_test(test_shard_refusals),
        cmocka_unit_test(test_allreduce),
        cmocka_unit_test(test_pool_shard_copies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
