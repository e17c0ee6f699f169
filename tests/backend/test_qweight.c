/*
 * The CUDA backend's device layout of GGUF-quantised matrices (src/backend/cuda/qweight.h), on
 * the host: every element of a packed matrix, decoded the way the kernels decode it, equals the
 * file's value as tdm_dequantize gives it (bit for bit), for each kind at widths of one chunk,
 * of several, and past the packer's 4,096-column stride; the widths a kind cannot take are
 * refused; the bytes are what qweight.h states; and every address of qkind.h's tiles lies in its
 * array, no two pieces overlap, and the pieces that the kernels fetch in one vector load
 * (a lane's pair of chunks, its rows' scales) are side by side, as qgemv.cu assumes. Runs
 * without a GPU.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/qweight.h"
#include "lib/test_rng.h"
#include "lib/tiny_model.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static void check_kind(enum tdm_dtype dt, int64_t rows, int64_t cols)
{
    struct tdm_test_weight tw;
    tdm_test_weight_make(&rng_state, dt, rows, cols, &tw);
    struct tdm_cu_qlayout L;
    assert_true(tdm_cu_qlayout(dt, rows, cols, &L));
    uint8_t *packed = malloc(L.bytes);
    assert_non_null(packed);
    memset(packed, 0xA5, L.bytes); /* the packer must not depend on what was there */
    /* in two calls, as a caller packing a chunk of rows at a time would */
    const int64_t half = rows / 2;
    tdm_cu_qpack_rows(&L, tw.w.data, tw.w.row_bytes, 0, half, packed);
    tdm_cu_qpack_rows(&L, (const uint8_t *)tw.w.data + (size_t)half * tw.w.row_bytes,
                      tw.w.row_bytes, half, rows - half, packed);
    int64_t bad = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const float got = tdm_cu_qget(&L, packed, r, c), want = tw.deq[r * cols + c];
            if (memcmp(&got, &want, 4) != 0 && bad++ < 5)
                print_error("%s %lldx%lld: [%lld][%lld] = %.9g, the file's %.9g\n",
                            tdm_dtype_name(dt), (long long)rows, (long long)cols, (long long)r,
                            (long long)c, got, want);
        }
    assert_int_equal(bad, 0);
    free(packed);
    tdm_test_weight_free(&tw);
}

static void test_every_element_is_the_files(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K,
                                  TDM_DTYPE_Q6_K};
    const int64_t widths[] = {256, 576, 1536, 4608, 8448};
    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
        for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
            const bool kq = dts[d] == TDM_DTYPE_Q4_K || dts[d] == TDM_DTYPE_Q6_K;
            if (kq && widths[w] % 256) continue;
            check_kind(dts[d], w % 2 ? 17 : 6, widths[w]);
        }
}

static void test_widths_and_types_refused(void **state)
{
    (void)state;
    struct tdm_cu_qlayout L;
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q8_0, 4, 96, &L)); /* not a multiple of 64 */
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q4_0, 4, 32, &L));
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q4_K, 4, 64, &L)); /* K-quants: 256 */
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q6_K, 4, 576, &L));
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q5_0, 4, 256, &L)); /* no kernel */
    assert_false(tdm_cu_qlayout(TDM_DTYPE_BF16, 4, 256, &L));
    assert_false(tdm_cu_qlayout(TDM_DTYPE_F32, 4, 256, &L));
    assert_false(tdm_cu_qlayout(TDM_DTYPE_Q8_0, 0, 256, &L));
    assert_true(tdm_cu_qlayout(TDM_DTYPE_Q8_0, 4, 64, &L));
}

/* bits a weight (qweight.h): within the 256-byte padding of each array */
static void test_bytes(void **state)
{
    (void)state;
    const struct {
        enum tdm_dtype dt;
        double bits;
    } k[] = {{TDM_DTYPE_Q8_0, 8.5},
             {TDM_DTYPE_Q4_0, 4.5},
             {TDM_DTYPE_Q4_1, 5.0},
             {TDM_DTYPE_Q4_K, 4.625},
             {TDM_DTYPE_Q6_K, 6.5625}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        struct tdm_cu_qlayout L;
        const int64_t rows = 4096, cols = 4096;
        assert_true(tdm_cu_qlayout(k[i].dt, rows, cols, &L));
        const double want = k[i].bits * (double)rows * (double)cols / 8.0;
        assert_true((double)L.bytes >= want && (double)L.bytes <= want + 4 * 256);
        /* the arrays do not overlap and each starts on 256 bytes */
        assert_true(L.q_off % 256 == 0 && L.s_off % 256 == 0 && L.qh_off % 256 == 0 &&
                    L.dd_off % 256 == 0);
        assert_true(L.s_off > L.q_off && (L.dd_off == 0 || L.dd_off > L.s_off));
    }
}

/* marks [off, off + n) in used[] (size cap); false if any byte was marked or lies past cap */
static bool mark(uint8_t *used, size_t cap, size_t off, size_t n)
{
    if (off + n > cap) return false;
    for (size_t i = 0; i < n; i++)
        if (used[off + i]++) return false;
    return true;
}

static bool all_marked(const uint8_t *used, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (used[i] != 1) return false;
    return true;
}

static void check_tiles(enum tdm_dtype dt, int64_t rows, int64_t cols)
{
    struct tdm_cu_qlayout L;
    assert_true(tdm_cu_qlayout(dt, rows, cols, &L));
    const int kind = L.kind, nc = (int)(cols / 64), qb = tdm_qt_qb(kind), sb = tdm_qt_sb(kind);
    const int db = tdm_qt_db(kind);
    const int64_t R = (rows + 15) / 16 * 16; /* the padding rows are addressed too */
    uint8_t *uq = calloc(1, L.q_bytes), *us = calloc(1, L.s_bytes);
    uint8_t *uh = calloc(1, L.qh_bytes + 1), *ud = calloc(1, L.dd_bytes + 1);
    assert_true(uq && us && uh && ud);
    for (int64_t r = 0; r < R; r++) {
        for (int c = 0; c < nc; c++) {
            assert_true(mark(us, L.s_bytes, tdm_qt_s_at(kind, nc, r, c), (size_t)sb));
            for (int t = 0; t < 4; t++) {
                assert_true(mark(uq, L.q_bytes, tdm_qt_q_at(kind, nc, r, c, t), (size_t)qb / 4));
                if (kind == TDM_CU_Q6_K)
                    assert_true(mark(uh, L.qh_bytes, tdm_qt_qh_at(nc, r, c, t), 4));
            }
        }
        if (db)
            for (int b = 0; b < nc / 4; b++)
                assert_true(mark(ud, L.dd_bytes, tdm_qt_dd_at(kind, nc, r, b), (size_t)db));
    }
    /* every byte of each array is some piece's */
    assert_true(all_marked(uq, L.q_bytes) && all_marked(us, L.s_bytes));
    assert_true(all_marked(uh, L.qh_bytes) && all_marked(ud, L.dd_bytes));
    /* what one vector load of qgemv.cu brings */
    for (int64_t rb = 0; rb < R / 16; rb++)
        for (int s = 0; s < (nc + 15) / 16; s++) {
            const bool full = tdm_qt_full(nc, s);
            for (int w = 0; w < 8; w++)
                for (int g = 0; g < 8; g++) {
                    const int64_t ra = 16 * rb + g, rbb = ra + 8;
                    const int c = 16 * s + w;
                    if (c >= nc) continue;
                    const size_t s0 = tdm_qt_s_at(kind, nc, ra, c);
                    assert_int_equal(tdm_qt_s_at(kind, nc, rbb, c),
                                     s0 + (size_t)sb * (full ? 2 : 1));
                    if (db)
                        assert_int_equal(tdm_qt_dd_at(kind, nc, rbb, c / 4),
                                         tdm_qt_dd_at(kind, nc, ra, c / 4) + (size_t)db);
                    if (!full) continue;
                    assert_int_equal(tdm_qt_s_at(kind, nc, ra, c + 8), s0 + (size_t)sb);
                    assert_int_equal(tdm_qt_s_at(kind, nc, rbb, c + 8), s0 + 3 * (size_t)sb);
                    /* a warp's load of rows 16 rb .. + 7 (or + 8 .. + 15): 512 contiguous bytes */
                    const size_t q0 = tdm_qt_q_at(kind, nc, 16 * rb, c, 0);
                    for (int t = 0; t < 4; t++) {
                        const size_t qa = tdm_qt_q_at(kind, nc, ra, c, t);
                        assert_int_equal(qa, q0 + (size_t)g * 64 + (size_t)t * 16);
                        /* the lane's pieces of c and c + 8: one 16-byte load (4-bit kinds), or
                         * a second warp load of 512 contiguous bytes (Q8_0) */
                        assert_int_equal(tdm_qt_q_at(kind, nc, ra, c + 8, t),
                                         qa + (kind == TDM_CU_Q8_0 ? 1024 : 8));
                        if (kind == TDM_CU_Q6_K)
                            assert_int_equal(tdm_qt_qh_at(nc, ra, c + 8, t),
                                             tdm_qt_qh_at(nc, ra, c, t) + 4);
                    }
                }
        }
    free(uq), free(us), free(uh), free(ud);
}

static void test_tile_addresses(void **state)
{
    (void)state;
    const enum tdm_dtype dts[] = {TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0, TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K,
                                  TDM_DTYPE_Q6_K};
    const int64_t widths[] = {256, 576, 1024, 1536, 4608, 8448};
    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++)
        for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
            const bool kq = dts[d] == TDM_DTYPE_Q4_K || dts[d] == TDM_DTYPE_Q6_K;
            if (kq && widths[w] % 256) continue;
            check_tiles(dts[d], w % 2 ? 40 : 16, widths[w]);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_element_is_the_files),
        cmocka_unit_test(test_widths_and_types_refused),
        cmocka_unit_test(test_bytes),
        cmocka_unit_test(test_tile_addresses),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
