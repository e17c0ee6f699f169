/* Unit tests for the KV page pool: all-or-nothing allocation, the page state machine
 * (owner references and in-flight holds in every order), accounting, page tables, and the HND
 * layer layout. */
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
    assert_ptr_equal(l2.base, l0.base + 2 * layer_floats);
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
    assert_int_equal(g.v_offset, 2 * g.head_bytes);         /* n_kv_heads K runs, then V */
    assert_int_equal(2 * g.v_offset, g.page_bytes);
    /* the whole region is writable (ASan checks the bounds) */
    memset(l0.base, 0, layer_floats * 3 * sizeof(float));
    tdm_kv_pool_destroy(p);
    /* an element type no backend computes in is refused, with a reason */
    c.dtype = TDM_DTYPE_BF16;
    assert_int_equal(tdm_kv_page_bytes(&c), 2 * 2 * 4 * 8 * 2);
    assert_int_equal(tdm_kv_pool_create(&c, backend, &p), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "bf16"));
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_all_or_nothing), cmocka_unit_test(test_states),
        cmocka_unit_test(test_random_ops),           cmocka_unit_test(test_layout),
        cmocka_unit_test(test_bad_config),           cmocka_unit_test(test_seq_trim),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
