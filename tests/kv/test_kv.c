/* Unit tests for the KV page pool: all-or-nothing allocation, the page state machine
 * (owner references and in-flight holds in every order), accounting, page tables, and the HND
 * layer layout; and for the prefix cache over it (below). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/kv.h"

static tdm_backend_t *backend;

static int setup(void **state)
{
    (void)state;
    struct tdm_backend_cpu_opts o = {.n_threads = 1};
    return tdm_backend_cpu_create(&o, &backend) == TDM_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tdm_backend_destroy(backend);
    return 0;
}

static struct tdm_kv_config cfg(int64_t pages)
{
    return (struct tdm_kv_config){
        .n_layers = 3, .n_kv_heads = 2, .head_dim = 8, .page_size = 4, .n_pages = pages};
}

static void expect(tdm_kv_pool_t *p, int64_t free_, int64_t used, int64_t in_flight)
{
    struct tdm_kv_stats s = tdm_kv_pool_stats(p);
    assert_int_equal(s.free, free_);
    assert_int_equal(s.used, used);
    assert_int_equal(s.in_flight, in_flight);
    assert_int_equal(s.free + s.used + s.in_flight, s.total);
}

static void test_alloc_all_or_nothing(void **state)
{
    (void)state;
    struct tdm_kv_config c = cfg(10);
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    int32_t ids[10], more[4];
    assert_int_equal(tdm_kv_pool_alloc(p, 7, ids), TDM_OK);
    expect(p, 3, 7, 0);
    memset(more, 0x7f, sizeof more);
    assert_int_equal(tdm_kv_pool_alloc(p, 4, more), TDM_ENOMEM);
    assert_int_equal(more[0], 0x7f7f7f7f); /* untouched on failure */
    expect(p, 3, 7, 0);
    for (int i = 0; i < 7; i++)
        for (int j = i + 1; j < 7; j++)
            assert_int_not_equal(ids[i], ids[j]);
    tdm_kv_pool_free(p, 7, ids);
    expect(p, 10, 0, 0);
    tdm_kv_pool_destroy(p);
}

static void test_states(void **state)
{
    (void)state;
    struct tdm_kv_config c = cfg(4);
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    int32_t a[2];
    assert_int_equal(tdm_kv_pool_alloc(p, 2, a), TDM_OK);
    /* hold, then the owner leaves: the pages stay in flight until the hold ends */
    tdm_kv_pool_hold(p, 2, a);
    expect(p, 2, 0, 2);
    tdm_kv_pool_free(p, 2, a);
    expect(p, 2, 0, 2);
    tdm_kv_pool_unhold(p, 2, a);
    expect(p, 4, 0, 0);
    /* two holds and a retained owner */
    assert_int_equal(tdm_kv_pool_alloc(p, 1, a), TDM_OK);
    tdm_kv_pool_retain(p, 1, a);
    tdm_kv_pool_hold(p, 1, a);
    tdm_kv_pool_hold(p, 1, a);
    expect(p, 3, 0, 1);
    tdm_kv_pool_unhold(p, 1, a);
    expect(p, 3, 0, 1);
    tdm_kv_pool_unhold(p, 1, a);
    expect(p, 3, 1, 0);
    tdm_kv_pool_free(p, 1, a);
    expect(p, 3, 1, 0);
    tdm_kv_pool_free(p, 1, a);
    expect(p, 4, 0, 0);
    tdm_kv_pool_destroy(p);
}

static void test_random_ops(void **state)
{
    (void)state;
    struct tdm_kv_config c = cfg(64);
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    struct tdm_kv_seq seqs[8];
    memset(seqs, 0, sizeof seqs);
    unsigned r = 1;
    for (int it = 0; it < 5000; it++) {
        r = r * 1103515245u + 12345u;
        int s = (r >> 16) % 8;
        if ((r >> 8) % 4 == 0) {
            tdm_kv_seq_release(p, &seqs[s]);
        } else {
            int64_t want = (int64_t)(seqs[s].n_pages * 4) + (r >> 20) % 9;
            int before = seqs[s].n_pages;
            tdm_status st = tdm_kv_seq_reserve(p, &seqs[s], want);
            if (st == TDM_OK)
                assert_true(seqs[s].n_pages * 4 >= want);
            else
                assert_int_equal(seqs[s].n_pages, before); /* all or nothing */
        }
        int64_t owned = 0;
        for (int k = 0; k < 8; k++)
            owned += seqs[k].n_pages;
        expect(p, 64 - owned, owned, 0);
    }
    for (int k = 0; k < 8; k++)
        tdm_kv_seq_release(p, &seqs[k]);
    expect(p, 64, 0, 0);
    tdm_kv_seq_release(p, &seqs[0]); /* on a zeroed table: no-op */
    tdm_kv_pool_destroy(p);
    tdm_kv_pool_destroy(NULL);
}

static void test_layout(void **state)
{
    (void)state;
    struct tdm_kv_config c = cfg(5);
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    /* [2][n_kv_heads][page_size][head_dim] floats per page */
    assert_int_equal(tdm_kv_page_bytes(&c), 2 * 2 * 4 * 8 * sizeof(float));
    size_t layer_floats = 5 * 2 * 2 * 4 * 8;
    struct tdm_kv_layer l0 = tdm_kv_pool_layer(p, 0), l2 = tdm_kv_pool_layer(p, 2);
    assert_ptr_equal(l2.base, (uint8_t *)l0.base + 2 * layer_floats * sizeof(float));
    assert_int_equal(l0.dtype, TDM_DTYPE_F32);
    assert_int_equal(l0.n_pages, 5);
    assert_int_equal(l0.page_size, 4);
    assert_int_equal(tdm_kv_pages_for_bytes(&c, 3 * tdm_kv_page_bytes(&c) * 7 + 1), 7);
    /* the geometry transfers use: place, element type, HND strides, the same region */
    struct tdm_kv_geometry g = tdm_kv_pool_geometry(p);
    assert_int_equal(g.place.kind, TDM_MEM_HOST);
    assert_int_equal(g.dtype, TDM_DTYPE_F32);
    assert_int_equal(g.elem_bytes, 4);
    assert_ptr_equal(g.base, l0.base);
    assert_int_equal(g.layer_bytes, layer_floats * sizeof(float));
    assert_int_equal(g.bytes, 3 * g.layer_bytes);
    assert_int_equal(g.page_bytes, tdm_kv_page_bytes(&c));
    assert_int_equal(g.head_bytes, 4 * 8 * sizeof(float)); /* page_size * head_dim */
    assert_int_equal(g.v_offset, 2 * g.head_bytes);        /* n_kv_heads K runs, then V */
    assert_int_equal(2 * g.v_offset, g.page_bytes);
    /* the whole region is writable (ASan checks the bounds) */
    memset(l0.base, 0, layer_floats * 3 * sizeof(float));
    tdm_kv_pool_destroy(p);
    /* 2-byte pools: half the bytes, the same strides in elements */
    const enum tdm_dtype two[] = {TDM_DTYPE_BF16, TDM_DTYPE_F16};
    for (int i = 0; i < 2; i++) {
        c.dtype = two[i];
        assert_int_equal(tdm_kv_page_bytes(&c), 2 * 2 * 4 * 8 * 2);
        assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
        g = tdm_kv_pool_geometry(p);
        l0 = tdm_kv_pool_layer(p, 0), l2 = tdm_kv_pool_layer(p, 2);
        assert_int_equal(g.dtype, two[i]);
        assert_int_equal(l2.dtype, two[i]);
        assert_int_equal(g.elem_bytes, 2);
        assert_int_equal(g.head_bytes, 4 * 8 * 2);
        assert_int_equal(g.layer_bytes, layer_floats * 2);
        assert_ptr_equal(l2.base, (uint8_t *)l0.base + 2 * g.layer_bytes);
        memset(l0.base, 0, g.bytes);
        tdm_kv_pool_destroy(p);
    }
    /* an element type no backend stores KV in is refused, with a reason */
    c.dtype = TDM_DTYPE_Q8_0;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "q8_0"));
}

static void test_bad_config(void **state)
{
    (void)state;
    tdm_kv_pool_t *p;
    struct tdm_kv_config c = cfg(0);
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_EINVAL);
    c = cfg(4);
    c.page_size = 4096;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_ERANGE);
    c = cfg(4);
    struct tdm_kv_seq seq = {0};
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    assert_int_equal(tdm_kv_seq_reserve(p, &seq, 17), TDM_ENOMEM); /* 5 pages > 4 */
    assert_int_equal(seq.n_pages, 0);
    tdm_kv_seq_release(p, &seq);
    tdm_kv_pool_destroy(p);
}

static void test_seq_trim(void **state)
{
    (void)state;
    struct tdm_kv_config c = cfg(10);
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    struct tdm_kv_seq s = {0};
    assert_int_equal(tdm_kv_seq_reserve(p, &s, 17), TDM_OK); /* 5 pages of 4 */
    expect(p, 5, 5, 0);
    int32_t first[5];
    memcpy(first, s.pages, sizeof first);
    tdm_kv_seq_trim(p, &s, 18); /* longer: nothing */
    expect(p, 5, 5, 0);
    tdm_kv_seq_trim(p, &s, 9); /* 3 pages cover 9 positions */
    assert_int_equal(s.n_pages, 3);
    expect(p, 7, 3, 0);
    assert_memory_equal(s.pages, first, 3 * sizeof(int32_t)); /* the kept prefix unchanged */
    /* a trimmed page a transfer still holds stays in flight until released */
    tdm_kv_pool_hold(p, 1, &s.pages[2]);
    int32_t held = s.pages[2];
    tdm_kv_seq_trim(p, &s, 8);
    expect(p, 7, 2, 1);
    tdm_kv_pool_unhold(p, 1, &held);
    expect(p, 8, 2, 0);
    /* a shared page loses only this sequence's reference */
    tdm_kv_pool_retain(p, 1, &s.pages[1]);
    int32_t shared = s.pages[1];
    tdm_kv_seq_trim(p, &s, 0);
    assert_int_equal(s.n_pages, 0);
    expect(p, 9, 1, 0);
    tdm_kv_pool_free(p, 1, &shared);
    expect(p, 10, 0, 0);
    /* the table grows again after a trim */
    assert_int_equal(tdm_kv_seq_reserve(p, &s, 5), TDM_OK);
    expect(p, 8, 2, 0);
    tdm_kv_seq_release(p, &s);
    expect(p, 10, 0, 0);
    tdm_kv_pool_destroy(p);
}

/* ---- the prefix cache (src/kv/prefix.c): matches by content in whole pages, token for token
 * (a page whose tokens differ is a miss even under the same chain), reference counts (the
 * cache's one, a match's one), least-recently-used eviction of pages only the cache holds
 * (leaves before the prefixes they continue, pinned pages passed over), the pool's reclaim
 * hook, flush, and a randomised run: the pool is back at its baseline after each. ---- */

#define PREFIX_PS 4

static tdm_kv_pool_t *prefix_pool(int64_t pages)
{
    struct tdm_kv_config c = {
        .n_layers = 1, .n_kv_heads = 1, .head_dim = 2, .page_size = PREFIX_PS, .n_pages = pages};
    tdm_kv_pool_t *p;
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_OK);
    return p;
}

static int64_t pages_used(tdm_kv_pool_t *p)
{
    return tdm_kv_pool_stats(p).used;
}

/* A sequence of n tokens with pages, offered to the cache, then released by its owner. */
static void run_and_offer(tdm_prefix_cache_t *c, tdm_kv_pool_t *p, const int32_t *t, int n)
{
    struct tdm_kv_seq s = {0};
    assert_int_equal(tdm_kv_seq_reserve(p, &s, n), TDM_OK);
    tdm_prefix_cache_insert(c, t, &s, n / PREFIX_PS);
    tdm_kv_seq_release(p, &s);
}

static void test_match_insert_refs(void **state)
{
    (void)state;
    tdm_kv_pool_t *p = prefix_pool(32);
    tdm_prefix_cache_t *c;
    assert_int_equal(tdm_prefix_cache_create(p, 42, &c), TDM_OK);
    int32_t a[14] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    run_and_offer(c, p, a, 14); /* 3 full pages cached; the partial one is not */
    assert_int_equal(tdm_prefix_cache_stats(c).pages, 3);
    assert_int_equal(pages_used(p), 3);
    assert_int_equal(tdm_prefix_cache_evictable(c), 3);
    /* a longer prompt with the same start: 3 pages; capped by max_pages */
    int32_t b[20];
    memcpy(b, a, sizeof a);
    for (int i = 14; i < 20; i++)
        b[i] = 100 + i;
    struct tdm_kv_seq s = {0};
    assert_int_equal(tdm_prefix_cache_match(c, b, 20, 2, &s), 2);
    assert_int_equal(s.n_pages, 2);
    assert_int_equal(tdm_kv_pool_owners(p, s.pages[0]), 2);
    assert_int_equal(tdm_prefix_cache_evictable(c), 1); /* two are the match's too */
    tdm_kv_seq_release(p, &s);
    assert_int_equal(tdm_prefix_cache_match(c, b, 20, 99, &s), 3);
    tdm_kv_seq_release(p, &s);
    /* a different second page: one page only, though the third page's tokens are the same */
    b[5] = 999;
    assert_int_equal(tdm_prefix_cache_match(c, b, 20, 99, &s), 1);
    tdm_kv_seq_release(p, &s);
    /* another salt (another model) finds nothing */
    tdm_prefix_cache_t *other;
    assert_int_equal(tdm_prefix_cache_create(p, 43, &other), TDM_OK);
    assert_int_equal(tdm_prefix_cache_match(other, a, 14, 99, &s), 0);
    tdm_prefix_cache_destroy(other);
    /* offering the same pages again adds nothing */
    assert_int_equal(tdm_prefix_cache_match(c, a, 14, 99, &s), 3);
    tdm_prefix_cache_insert(c, a, &s, 3);
    assert_int_equal(tdm_prefix_cache_stats(c).pages, 3);
    assert_int_equal(tdm_prefix_cache_stats(c).stored_pages, 3);
    tdm_kv_seq_release(p, &s);
    struct tdm_prefix_stats st = tdm_prefix_cache_stats(c);
    assert_int_equal(st.hit_tokens, (2 + 3 + 1 + 3) * PREFIX_PS);
    /* the pool's count of the cache's pages: evictable while the cache's is the only reference
     * and no transfer holds them */
    struct tdm_kv_stats ks = tdm_kv_pool_stats(p);
    assert_int_equal(ks.cached, 3);
    assert_int_equal(ks.evictable, 3);
    assert_int_equal(tdm_prefix_cache_match(c, a, 14, 1, &s), 1);
    const int32_t held = s.pages[0];
    tdm_kv_pool_hold(p, 1, &held);
    ks = tdm_kv_pool_stats(p);
    assert_int_equal(ks.evictable, 2);
    tdm_kv_seq_release(p, &s); /* the hold keeps it from the cache's hands */
    assert_int_equal(tdm_kv_pool_stats(p).evictable, 2);
    assert_int_equal(tdm_prefix_cache_evict(c, 3), 2); /* not the held one */
    tdm_kv_pool_unhold(p, 1, &held);
    assert_int_equal(tdm_kv_pool_stats(p).evictable, 1);
    run_and_offer(c, p, a, 14); /* the two evicted come back */
    assert_int_equal(tdm_kv_pool_stats(p).evictable, 3);
    assert_int_equal(tdm_prefix_cache_flush(c), 3);
    ks = tdm_kv_pool_stats(p);
    assert_int_equal(ks.cached + ks.evictable + ks.used, 0);
    tdm_prefix_cache_destroy(c);
    tdm_kv_pool_destroy(p);
}

static void test_eviction_order_and_reclaim(void **state)
{
    (void)state;
    tdm_kv_pool_t *p = prefix_pool(8);
    tdm_prefix_cache_t *c;
    assert_int_equal(tdm_prefix_cache_create(p, 1, &c), TDM_OK);
    int32_t x[12], y[8];
    for (int i = 0; i < 12; i++)
        x[i] = i;
    for (int i = 0; i < 8; i++)
        y[i] = 50 + i;
    run_and_offer(c, p, x, 12); /* chain x0 -> x1 -> x2 */
    run_and_offer(c, p, y, 8);  /* chain y0 -> y1, more recent */
    /* evicting one takes x's leaf: x keeps its first two pages */
    assert_int_equal(tdm_prefix_cache_evict(c, 1), 1);
    struct tdm_kv_seq s = {0};
    assert_int_equal(tdm_prefix_cache_match(c, x, 12, 99, &s), 2);
    /* x's pages are pinned by s now: eviction passes over them to y's leaf */
    assert_int_equal(tdm_prefix_cache_evict(c, 1), 1);
    struct tdm_kv_seq t = {0};
    assert_int_equal(tdm_prefix_cache_match(c, y, 8, 99, &t), 1);
    tdm_kv_seq_release(p, &t);
    /* the pool's reclaim hook: an allocation that finds too few pages evicts for it */
    tdm_kv_pool_set_reclaim(p, tdm_prefix_cache_reclaim, c);
    assert_int_equal(pages_used(p), 3); /* x0, x1 (cache + s), y0 (cache) */
    int32_t ids[6];
    assert_int_equal(tdm_kv_pool_alloc(p, 6, ids), TDM_OK); /* 5 free + y0 evicted */
    assert_int_equal(tdm_prefix_cache_stats(c).pages, 2);
    assert_int_equal(tdm_kv_pool_alloc(p, 1, ids + 5), TDM_ENOMEM); /* x is pinned */
    tdm_kv_pool_free(p, 6, ids);
    tdm_kv_seq_release(p, &s);
    assert_int_equal(tdm_prefix_cache_evictable(c), 2);
    tdm_kv_pool_set_reclaim(p, NULL, NULL);
    tdm_prefix_cache_destroy(c);
    assert_int_equal(pages_used(p), 0);
    tdm_kv_pool_destroy(p);
}

/* Random prompts over a two-token alphabet (so prefixes are shared often) in a pool too small
 * to keep them all: a match is stable (the matched prefix matched again gives the same pages),
 * what was just offered is found whole, and the pool's pages are the cache's alone between
 * rounds. */
static void test_random_against_reference(void **state)
{
    (void)state;
    enum { PAGES = 24, MAXP = 6 };
    tdm_kv_pool_t *p = prefix_pool(PAGES);
    tdm_prefix_cache_t *c;
    assert_int_equal(tdm_prefix_cache_create(p, 7, &c), TDM_OK);
    tdm_kv_pool_set_reclaim(p, tdm_prefix_cache_reclaim, c);
    uint64_t rng = 12345;
    for (int it = 0; it < 3000; it++) {
        int32_t t[MAXP * PREFIX_PS];
        int n = 1 + (int)((rng = rng * 6364136223846793005ull + 1442695040888963407ull) >> 33) %
                        (MAXP * PREFIX_PS);
        for (int i = 0; i < n; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            t[i] = (int32_t)((rng >> 40) % 2); /* two tokens: many shared prefixes */
        }
        struct tdm_kv_seq s = {0};
        int hit = tdm_prefix_cache_match(c, t, n, MAXP, &s);
        assert_true(hit <= n / PREFIX_PS);
        assert_int_equal(s.n_pages, hit);
        /* every hit page is cached under exactly that prefix: matching again finds as many */
        struct tdm_kv_seq s2 = {0};
        assert_int_equal(tdm_prefix_cache_match(c, t, hit * PREFIX_PS, MAXP, &s2), hit);
        for (int k = 0; k < hit; k++)
            assert_int_equal(s2.pages[k], s.pages[k]);
        tdm_kv_seq_release(p, &s2);
        bool offered = tdm_kv_seq_reserve(p, &s, n) == TDM_OK;
        if (offered) tdm_prefix_cache_insert(c, t, &s, n / PREFIX_PS);
        tdm_kv_seq_release(p, &s);
        if (offered) {
            assert_int_equal(tdm_prefix_cache_match(c, t, n, MAXP, &s), n / PREFIX_PS);
            tdm_kv_seq_release(p, &s);
        }
        struct tdm_kv_stats st = tdm_kv_pool_stats(p);
        assert_int_equal(st.used, tdm_prefix_cache_stats(c).pages);
        assert_int_equal(st.cached, st.used); /* every used page is the cache's alone */
        assert_int_equal(st.evictable, st.used);
        assert_int_equal(st.free + st.used, PAGES);
    }
    assert_true(tdm_prefix_cache_stats(c).evicted_pages > 0);
    assert_true(tdm_prefix_cache_stats(c).hit_tokens > 0);
    tdm_kv_pool_set_reclaim(p, NULL, NULL);
    tdm_prefix_cache_destroy(c);
    assert_int_equal(pages_used(p), 0);
    tdm_kv_pool_destroy(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_all_or_nothing),
        cmocka_unit_test(test_states),
        cmocka_unit_test(test_random_ops),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_seq_trim),
        cmocka_unit_test(test_match_insert_refs),
        cmocka_unit_test(test_eviction_order_and_reclaim),
        cmocka_unit_test(test_random_against_reference),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
