/* Unit tests for sharded KV transfers' arithmetic (disagg.h, "sharded KV transfers"; DESIGN.md
 * §5): for every (p, d) in {1, 2, 3, 4}^2 and H in {1, 2, 3, 4, 8} that the contract shards,
 * and many seeds, the plan's slices are applied to HND pages of every prefill rank (each
 * element naming its K/V, KV head, token and dimension) and every decode rank's pages must come
 * out whole: each of its elements written exactly once, with the value of its own head. Then
 * the counts (one write a slice where both pages are the slice, two otherwise; the same for
 * every draw), the draw itself (every source replica set takes its turn), the refusals, and
 * the SHARDED block and SCHEME message on the wire. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/disagg.h"

#define PAGE_SIZE  4 /* tokens a page */
#define HEAD_DIM   3
#define HEAD_ELEMS (PAGE_SIZE * HEAD_DIM)

/* The value of element (kv, head, token, dim) of a page: what every rank holding that head
 * has there. */
static uint32_t value(int kv, int head, int t, int dim)
{
    return 0x80000000u | (uint32_t)kv << 24 | (uint32_t)head << 12 | (uint32_t)(t * HEAD_DIM + dim);
}

/* A page of a rank holding heads [h0, h0 + n): [2][n][PAGE_SIZE][HEAD_DIM] */
static uint32_t *make_page(int h0, int n)
{
    uint32_t *pg = malloc(sizeof *pg * 2 * (size_t)n * HEAD_ELEMS);
    for (int kv = 0; kv < 2; kv++)
        for (int h = 0; h < n; h++)
            for (int e = 0; e < HEAD_ELEMS; e++)
                pg[((size_t)kv * n + h) * HEAD_ELEMS + e] =
                    value(kv, h0 + h, e / HEAD_DIM, e % HEAD_DIM);
    return pg;
}

static bool shardable(int H, int tp)
{
    return tp <= H || tp % H == 0;
}

/* Applies the plan of (H, p, d, seed) to the pages and checks every destination page. Returns
 * the writes a layer took. */
static int apply_plan(int H, int p, int d, uint64_t seed)
{
    struct tdm_disagg_shard_plan plan;
    assert_int_equal(tdm_disagg_shard_plan(H, p, d, seed, &plan), TDM_OK);
    assert_int_equal(plan.src_ranks, p);
    assert_int_equal(plan.dst_ranks, d);
    assert_true(plan.n_slices <= TDM_DISAGG_MAX_SLICES);
    uint32_t *src[8], *dst[8];
    uint8_t *seen[8];
    struct tdm_tp_kv_shard ss[8], ds[8];
    for (int r = 0; r < p; r++) {
        assert_int_equal(tdm_tp_kv_shard_of(H, p, r, &ss[r]), TDM_OK);
        src[r] = make_page(ss[r].kv_head0, ss[r].n_kv_heads);
    }
    for (int r = 0; r < d; r++) {
        assert_int_equal(tdm_tp_kv_shard_of(H, d, r, &ds[r]), TDM_OK);
        size_t n = 2 * (size_t)ds[r].n_kv_heads * HEAD_ELEMS;
        dst[r] = calloc(n, sizeof *dst[r]);
        seen[r] = calloc(n * sizeof(uint32_t), 1);
    }
    const uint64_t head_bytes = HEAD_ELEMS * sizeof(uint32_t);
    int writes = 0;
    for (int i = 0; i < plan.n_slices; i++) {
        const struct tdm_disagg_slice *sl = &plan.slices[i];
        assert_true(sl->src_rank < p && sl->dst_rank < d && sl->n_heads >= 1);
        /* the source rank belongs to the set its destination's set drew */
        assert_int_equal(ss[sl->src_rank].replica_set,
                         plan.src_set_of[ds[sl->dst_rank].replica_set]);
        assert_int_equal(sl->write0, writes);
        struct tdm_disagg_run runs[2];
        int n = tdm_disagg_slice_runs(sl, head_bytes, runs);
        assert_int_equal(n, sl->whole ? 1 : 2);
        /* one write exactly where the slice is both pages */
        assert_int_equal(sl->whole, sl->n_heads == ss[sl->src_rank].n_kv_heads &&
                                        sl->n_heads == ds[sl->dst_rank].n_kv_heads);
        writes += n;
        for (int k = 0; k < n; k++) {
            uint64_t src_page = 2 * (uint64_t)ss[sl->src_rank].n_kv_heads * head_bytes;
            uint64_t dst_page = 2 * (uint64_t)ds[sl->dst_rank].n_kv_heads * head_bytes;
            assert_true(runs[k].src_offset + runs[k].bytes <= src_page);
            assert_true(runs[k].dst_offset + runs[k].bytes <= dst_page);
            memcpy((uint8_t *)dst[sl->dst_rank] + runs[k].dst_offset,
                   (const uint8_t *)src[sl->src_rank] + runs[k].src_offset, runs[k].bytes);
            for (uint64_t b = 0; b < runs[k].bytes; b++)
                seen[sl->dst_rank][runs[k].dst_offset + b]++;
        }
    }
    assert_int_equal(writes, plan.writes);
    for (int r = 0; r < d; r++) {
        const int n = ds[r].n_kv_heads;
        for (size_t b = 0; b < 2 * (size_t)n * head_bytes; b++)
            if (seen[r][b] != 1)
                fail_msg("H=%d p=%d d=%d: byte %zu of rank %d written %d times", H, p, d, b, r,
                         seen[r][b]);
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < n; h++)
                for (int e = 0; e < HEAD_ELEMS; e++)
                    assert_int_equal(dst[r][((size_t)kv * n + h) * HEAD_ELEMS + e],
                                     value(kv, ds[r].kv_head0 + h, e / HEAD_DIM, e % HEAD_DIM));
        free(dst[r]);
        free(seen[r]);
    }
    for (int r = 0; r < p; r++)
        free(src[r]);
    return writes;
}

static void test_every_sharding_rebuilds_pages(void **state)
{
    (void)state;
    static const int heads[] = {1, 2, 3, 4, 8};
    int combos = 0;
    for (size_t hi = 0; hi < sizeof heads / sizeof *heads; hi++)
        for (int p = 1; p <= 4; p++)
            for (int d = 1; d <= 4; d++) {
                const int H = heads[hi];
                if (!shardable(H, p) || !shardable(H, d)) continue;
                combos++;
                int w0 = apply_plan(H, p, d, 0);
                for (uint64_t seed = 1; seed < 40; seed++) /* the count never depends on the draw */
                    assert_int_equal(apply_plan(H, p, d, seed * 0x9e3779b97f4a7c15ull), w0);
                if (p == d) /* identical sharding: ranks pair one to one, a page a write */
                    assert_int_equal(w0, d);
            }
    assert_true(combos >= 60);
}

/* The counts the decoder expects for the matrix, worked by hand. */
static void test_writes_per_layer(void **state)
{
    (void)state;
    struct {
        int H, p, d, writes;
    } cases[] = {
        {8, 1, 1, 1}, {8, 2, 4, 8}, /* each decode rank: half of one prefill rank's heads, K+V */
        {8, 4, 2, 8},               /* each decode rank: two prefill ranks' pages, K+V each */
        {8, 2, 2, 2}, {8, 4, 4, 4}, {4, 1, 4, 8},
        {4, 4, 1, 8}, {2, 4, 4, 4}, /* replica sets on both sides: rank to rank within the drawn set
                                     */
        {2, 4, 1, 4},               /* a whole page from the two ranks of one drawn set */
        {1, 4, 2, 2}, /* MLA-like: each decode rank's page whole from one random rank */
        {1, 1, 4, 4}, {1, 4, 1, 1}, {2, 1, 4, 8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        struct tdm_disagg_shard_plan plan;
        assert_int_equal(tdm_disagg_shard_plan(cases[i].H, cases[i].p, cases[i].d, 7, &plan),
                         TDM_OK);
        if (plan.writes != cases[i].writes)
            fail_msg("H=%d p=%d d=%d: %d writes a layer, expected %d", cases[i].H, cases[i].p,
                     cases[i].d, plan.writes, cases[i].writes);
        /* a chunk of 30 layers, no head; 100 tokens in chunks of 32: 4 chunks + the context */
        assert_int_equal(tdm_disagg_chunk_writes(&plan, 30, 0), 30u * (uint32_t)cases[i].writes);
        assert_int_equal(
            tdm_disagg_expected_writes(100, 0, 32, tdm_disagg_chunk_writes(&plan, 30, 1)),
            4u * (30u * (uint32_t)cases[i].writes + 1u) + 1u);
    }
}

/* Every destination replica set draws its source set at random: over many seeds each source
 * set sends, and the draw is the seed's alone. */
static void test_replica_sets_drawn_per_seed(void **state)
{
    (void)state;
    struct tdm_disagg_shard_plan a, b;
    int used[4] = {0};
    for (uint64_t seed = 0; seed < 200; seed++) {
        assert_int_equal(tdm_disagg_shard_plan(1, 4, 2, seed, &a), TDM_OK); /* H = 1: 4 sets */
        assert_int_equal(tdm_disagg_shard_plan(1, 4, 2, seed, &b), TDM_OK);
        assert_memory_equal(a.src_set_of, b.src_set_of, sizeof a.src_set_of);
        assert_int_equal(a.src_sets, 4);
        assert_int_equal(a.dst_sets, 2);
        for (int s = 0; s < a.dst_sets; s++)
            used[a.src_set_of[s]]++;
    }
    for (int s = 0; s < 4; s++)
        assert_true(used[s] > 40); /* 400 draws over 4 sets */
}

static void test_refusals(void **state)
{
    (void)state;
    struct tdm_disagg_shard_plan plan;
    assert_int_equal(tdm_disagg_shard_plan(3, 4, 1, 0, &plan), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "prefill node"));
    assert_int_equal(tdm_disagg_shard_plan(2, 1, 3, 0, &plan), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "decode node"));
    assert_int_equal(tdm_disagg_shard_plan(0, 1, 1, 0, &plan), TDM_EINVAL);
    assert_int_equal(tdm_disagg_shard_plan(8, 0, 1, 0, &plan), TDM_EINVAL);
    assert_int_equal(tdm_disagg_shard_plan(8, 1, TDM_DISAGG_MAX_RANKS + 1, 0, &plan), TDM_EINVAL);
}

/* The SHARDED block and the SCHEME message survive the wire; a block that breaks the
 * contract does not decode. */
static void test_wire(void **state)
{
    (void)state;
    int32_t tokens[40];
    uint32_t pages[3] = {7, 8, 9};
    for (int i = 0; i < 40; i++)
        tokens[i] = i + 100;
    struct tdm_disagg_msg m = {.type = TDM_DMSG_PREFILL};
    struct tdm_disagg_prefill_msg *f = &m.prefill;
    *f = (struct tdm_disagg_prefill_msg){.req_id = 5,
                                         .slot = 1,
                                         .epoch = 2,
                                         .n_tokens = 40,
                                         .chunk = 16,
                                         .n_layers = 2,
                                         .n_kv_heads = 2,
                                         .head_dim = 8,
                                         .page_size = 16,
                                         .elem_bytes = 4,
                                         .kv_head_end = 2,
                                         .dst_layer_stride = 4096,
                                         .kv = {.addr = 1, .key = 2, .bytes = 1 << 20},
                                         .ctx = {.bytes = 1 << 16},
                                         .d_model = 16,
                                         .vocab = 32,
                                         .sharded = 1,
                                         .dst_ranks = 4,
                                         .src_ranks = 2,
                                         .dst_sets = 2,
                                         .src_sets = 1,
                                         .shard_seed = 0xabcdef,
                                         .n_pages = 3,
                                         .tokens = tokens,
                                         .pages = pages};
    for (int r = 1; r < 4; r++)
        f->ranks[r] = (struct tdm_disagg_rank_dst){
            .dst_layer_stride = 1000u * (unsigned)r,
            .kv = {.addr = 10u * (unsigned)r, .key = (uint64_t)r, .bytes = 1 << 19}};
    size_t size = tdm_disagg_prefill_msg_size(40, 3, false, false, 4);
    uint8_t *buf = malloc(size);
    assert_int_equal(tdm_disagg_msg_encode(&m, buf, size), size);
    struct tdm_disagg_msg out;
    int32_t tk[64];
    uint32_t pg[8];
    assert_int_equal(tdm_disagg_msg_decode(buf, size, &out, tk, 64, pg, 8), TDM_OK);
    assert_true(out.prefill.sharded);
    assert_int_equal(out.prefill.dst_ranks, 4);
    assert_int_equal(out.prefill.src_ranks, 2);
    assert_int_equal(out.prefill.dst_sets, 2);
    assert_int_equal(out.prefill.shard_seed, 0xabcdef);
    assert_int_equal(out.prefill.ranks[0].dst_layer_stride, 4096); /* rank 0: the main fields */
    assert_int_equal(out.prefill.ranks[0].kv.addr, 1);
    for (int r = 1; r < 4; r++) {
        assert_int_equal(out.prefill.ranks[r].dst_layer_stride, 1000 * r);
        assert_int_equal(out.prefill.ranks[r].kv.addr, 10 * r);
        assert_int_equal(out.prefill.ranks[r].kv.key, r);
    }
    /* replica sets that the contract does not give: 4 ranks over 2 heads are 2 sets */
    f->dst_sets = 1;
    assert_int_equal(tdm_disagg_msg_encode(&m, buf, size), size);
    assert_int_equal(tdm_disagg_msg_decode(buf, size, &out, tk, 64, pg, 8), TDM_EFORMAT);
    /* 3 ranks over 2 heads: no sharding */
    f->dst_sets = 2;
    f->src_ranks = 3;
    assert_int_equal(tdm_disagg_msg_encode(&m, buf, size), size);
    assert_int_equal(tdm_disagg_msg_decode(buf, size, &out, tk, 64, pg, 8), TDM_EFORMAT);
    /* a message cut inside the block */
    f->src_ranks = 2;
    assert_int_equal(tdm_disagg_msg_encode(&m, buf, size), size);
    assert_int_equal(tdm_disagg_msg_decode(buf, 8 + 280 + 30, &out, tk, 64, pg, 8), TDM_EFORMAT);
    free(buf);
    /* without the block: TP 1 both sides, byte for byte the old message */
    f->sharded = 0;
    size = tdm_disagg_prefill_msg_size(40, 3, false, false, 0);
    buf = malloc(size);
    assert_int_equal(tdm_disagg_msg_encode(&m, buf, size), size);
    assert_int_equal(tdm_disagg_msg_decode(buf, size, &out, tk, 64, pg, 8), TDM_OK);
    assert_false(out.prefill.sharded);
    assert_int_equal(out.prefill.dst_ranks, 1);
    assert_int_equal(out.prefill.src_ranks, 1);
    free(buf);
    /* SCHEME */
    struct tdm_disagg_msg s = {
        .type = TDM_DMSG_SCHEME, .slot = 3, .epoch = 9, .scheme_ranks = 4, .scheme_kv_heads = 8};
    uint8_t sb[32];
    size_t n = tdm_disagg_msg_encode(&s, sb, sizeof sb);
    assert_int_equal(n, 24);
    assert_int_equal(tdm_disagg_msg_decode(sb, n, &out, NULL, 0, NULL, 0), TDM_OK);
    assert_int_equal(out.type, TDM_DMSG_SCHEME);
    assert_int_equal(out.slot, 3);
    assert_int_equal(out.epoch, 9);
    assert_int_equal(out.scheme_ranks, 4);
    assert_int_equal(out.scheme_kv_heads, 8);
    s.scheme_ranks = 0;
    n = tdm_disagg_msg_encode(&s, sb, sizeof sb);
    assert_int_equal(tdm_disagg_msg_decode(sb, n, &out, NULL, 0, NULL, 0), TDM_EFORMAT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_sharding_rebuilds_pages),
        cmocka_unit_test(test_writes_per_layer),
        cmocka_unit_test(test_replica_sets_drawn_per_seed),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_wire),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
