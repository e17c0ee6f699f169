/*
 * Tests of the GGUF reader and the element-type tables / dequantisers.
 *
 * GGUF images are built in memory by a small writer in this file (independent of the reader:
 * it emits the byte layout of the GGUF spec directly), in versions 2 and 3, with every value
 * type, string arrays, a custom alignment, and tensors whose contents and dequantised values
 * are derived by hand. A table of malformed images (every truncation of a valid file, bad
 * magic, huge counts, strings past the end, bad tensor offsets, overflowing dims, unknown
 * types, duplicates, ...) must each give an error; under the sanitizer build any overread,
 * crash or leak on those paths fails the run.
 *
 * Block dequantisation is checked here against hand-built blocks whose values follow from the
 * GGML layouts; tests/model/test_dequant.py checks it bit-exactly against gguf-py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tandem/model.h"

/* ---- a minimal GGUF writer ---- */

struct wbuf {
    uint8_t *p;
    size_t len, cap;
};

static void wb_put(struct wbuf *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void wb_u8(struct wbuf *b, uint8_t v)
{
    wb_put(b, &v, 1);
}
static void wb_u16(struct wbuf *b, uint16_t v)
{
    uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)};
    wb_put(b, x, 2);
}
static void wb_u32(struct wbuf *b, uint32_t v)
{
    uint8_t x[4];
    for (int i = 0; i < 4; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    wb_put(b, x, 4);
}
static void wb_u64(struct wbuf *b, uint64_t v)
{
    uint8_t x[8];
    for (int i = 0; i < 8; i++)
        x[i] = (uint8_t)(v >> (8 * i));
    wb_put(b, x, 8);
}
static void wb_f32(struct wbuf *b, float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    wb_u32(b, u);
}
static void wb_f64(struct wbuf *b, double f)
{
    uint64_t u;
    memcpy(&u, &f, 8);
    wb_u64(b, u);
}
static void wb_strn(struct wbuf *b, const char *s, size_t n)
{
    wb_u64(b, n);
    wb_put(b, s, n);
}
static void wb_str(struct wbuf *b, const char *s)
{
    wb_strn(b, s, strlen(s));
}
static void wb_header(struct wbuf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    wb_put(b, "GGUF", 4);
    wb_u32(b, version);
    wb_u64(b, n_tensors);
    wb_u64(b, n_kv);
}
static void wb_key(struct wbuf *b, const char *key, uint32_t type)
{
    wb_str(b, key);
    wb_u32(b, type);
}
static void wb_tensor(struct wbuf *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                      uint32_t dtype, uint64_t offset)
{
    wb_str(b, name);
    wb_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        wb_u64(b, ne[i]);
    wb_u32(b, dtype);
    wb_u64(b, offset);
}
static void wb_pad(struct wbuf *b, size_t align)
{
    while (b->len % align)
        wb_u8(b, 0);
}

static size_t align_up(size_t x, size_t a)
{
    return (x + a - 1) / a * a;
}

/* ---- the valid reference image ----
 * Tensors (hand-derived contents):
 *   "tok.f32"   f32  ne {3, 2}: values 0.5 * i, i = 0..5
 *   "blk.q8"    q8_0 ne {32}:   d = 0.25 (f16 0x3400), qs[i] = i - 16 -> 0.25 * (i - 16)
 *   "blk.q4_1"  q4_1 ne {32, 2}:
 *       block 0: d = 0.5 (0x3800), m = -1 (0xbc00), qs[j] = j | (15 - j) << 4
 *                -> x[j] = 0.5 j - 1, x[16 + j] = 0.5 (15 - j) - 1
 *       block 1: d = 2 (0x4000), m = 1 (0x3c00), qs[j] = 0x21 -> x[j] = 3, x[16 + j] = 5
 * The file ends exactly at the end of the last tensor's data, so every strict prefix is
 * invalid. */
#define N_VALID_KV_BASE 19

static struct wbuf make_valid(uint32_t version, uint32_t alignment)
{
    struct wbuf b = {0};
    size_t align = alignment ? alignment : 32;
    wb_header(&b, version, 3, N_VALID_KV_BASE + (alignment ? 1 : 0));
    wb_key(&b, "general.architecture", 8), wb_str(&b, "llama");
    if (alignment) wb_key(&b, "general.alignment", 4), wb_u32(&b, alignment);
    wb_key(&b, "k.u8", 0), wb_u8(&b, 200);
    wb_key(&b, "k.i8", 1), wb_u8(&b, (uint8_t)-5);
    wb_key(&b, "k.u16", 2), wb_u16(&b, 60000);
    wb_key(&b, "k.i16", 3), wb_u16(&b, (uint16_t)-30000);
    wb_key(&b, "k.u32", 4), wb_u32(&b, 4000000000u);
    wb_key(&b, "k.i32", 5), wb_u32(&b, (uint32_t)-2000000000);
    wb_key(&b, "k.f32", 6), wb_f32(&b, 1.5f);
    wb_key(&b, "k.bool", 7), wb_u8(&b, 1);
    wb_key(&b, "k.u64", 10), wb_u64(&b, 0x8000000000000005ull);
    wb_key(&b, "k.i64", 11), wb_u64(&b, (uint64_t) - (INT64_C(1) << 40));
    wb_key(&b, "k.f64", 12), wb_f64(&b, 0.1);
    wb_key(&b, "k.u64small", 10), wb_u64(&b, 7);
    wb_key(&b, "k.inexact", 4), wb_u32(&b, 16777217u);
    wb_key(&b, "k.arr_i32", 9), wb_u32(&b, 5), wb_u64(&b, 3);
    wb_u32(&b, 1), wb_u32(&b, (uint32_t)-2), wb_u32(&b, 3);
    wb_key(&b, "k.arr_str", 9), wb_u32(&b, 8), wb_u64(&b, 3);
    wb_str(&b, "a"), wb_str(&b, "bc"), wb_str(&b, "");
    wb_key(&b, "k.arr_empty", 9), wb_u32(&b, 0), wb_u64(&b, 0);
    wb_key(&b, "k.arr_bool", 9), wb_u32(&b, 7), wb_u64(&b, 2), wb_u8(&b, 0), wb_u8(&b, 1);
    wb_key(&b, "k.str_empty", 8), wb_str(&b, "");

    uint64_t ne_f32[2] = {3, 2}, ne_q8[1] = {32}, ne_q41[2] = {32, 2};
    size_t off_f32 = 0, off_q8 = align_up(off_f32 + 24, align),
           off_q41 = align_up(off_q8 + 34, align);
    wb_tensor(&b, "tok.f32", 2, ne_f32, 0, off_f32);
    wb_tensor(&b, "blk.q8", 1, ne_q8, 8, off_q8);
    wb_tensor(&b, "blk.q4_1", 2, ne_q41, 3, off_q41);
    wb_pad(&b, align);

    size_t data_start = b.len;
    for (int i = 0; i < 6; i++)
        wb_f32(&b, 0.5f * (float)i);
    wb_pad(&b, align);
    assert_int_equal(b.len - data_start, off_q8);
    wb_u16(&b, 0x3400);
    for (int i = 0; i < 32; i++)
        wb_u8(&b, (uint8_t)(int8_t)(i - 16));
    while (b.len - data_start < off_q41)
        wb_u8(&b, 0);
    wb_u16(&b, 0x3800), wb_u16(&b, 0xbc00);
    for (int j = 0; j < 16; j++)
        wb_u8(&b, (uint8_t)(j | (15 - j) << 4));
    wb_u16(&b, 0x4000), wb_u16(&b, 0x3c00);
    for (int j = 0; j < 16; j++)
        wb_u8(&b, 0x21);
    return b;
}

/* Opens an exact-size heap copy, so that ASan sees any read past the end. */
static tdm_status open_copy(const struct wbuf *b, size_t len, tdm_gguf_t **g, void **copy)
{
    *copy = malloc(len ? len : 1);
    assert_non_null(*copy);
    if (len) memcpy(*copy, b->p, len);
    return tdm_gguf_open_memory(*copy, len, g);
}

static void check_valid(uint32_t version, uint32_t alignment)
{
    struct wbuf b = make_valid(version, alignment);
    void *copy;
    tdm_gguf_t *g = NULL;
    tdm_status st = open_copy(&b, b.len, &g, &copy);
    if (st) fail_msg("valid v%u file rejected: %s", version, tdm_err_msg());
    assert_int_equal(tdm_gguf_version(g), version);
    assert_int_equal(tdm_gguf_n_kv(g), N_VALID_KV_BASE + (alignment ? 1 : 0));
    assert_int_equal(tdm_gguf_n_tensors(g), 3);

    /* iteration order is file order */
    struct tdm_str k0 = tdm_gguf_kv_key(g, 0);
    assert_int_equal(k0.len, strlen("general.architecture"));
    assert_memory_equal(k0.ptr, "general.architecture", k0.len);
    assert_int_equal(tdm_gguf_kv_type(g, 0), TDM_GGUF_STRING);
    for (int64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        struct tdm_str k = tdm_gguf_kv_key(g, i);
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)k.len, k.ptr);
        assert_int_equal(tdm_gguf_find(g, name), i);
    }
    assert_int_equal(tdm_gguf_find(g, "nope"), -1);
    assert_int_equal(tdm_gguf_find(g, "k.u8x"), -1);
    assert_int_equal(tdm_gguf_find(g, "k.u"), -1);

    struct tdm_str s;
    assert_int_equal(tdm_gguf_get_str(g, "general.architecture", &s), TDM_OK);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.ptr, "llama", 5);
    assert_int_equal(tdm_gguf_get_str(g, "k.str_empty", &s), TDM_OK);
    assert_int_equal(s.len, 0);

    int64_t v;
    assert_int_equal(tdm_gguf_get_i64(g, "k.u8", &v), TDM_OK), assert_int_equal(v, 200);
    assert_int_equal(tdm_gguf_get_i64(g, "k.i8", &v), TDM_OK), assert_int_equal(v, -5);
    assert_int_equal(tdm_gguf_get_i64(g, "k.u16", &v), TDM_OK), assert_int_equal(v, 60000);
    assert_int_equal(tdm_gguf_get_i64(g, "k.i16", &v), TDM_OK), assert_int_equal(v, -30000);
    assert_int_equal(tdm_gguf_get_i64(g, "k.u32", &v), TDM_OK);
    assert_true(v == 4000000000ll);
    assert_int_equal(tdm_gguf_get_i64(g, "k.i32", &v), TDM_OK);
    assert_true(v == -2000000000ll);
    assert_int_equal(tdm_gguf_get_i64(g, "k.i64", &v), TDM_OK);
    assert_true(v == -(INT64_C(1) << 40));
    assert_int_equal(tdm_gguf_get_i64(g, "k.u64small", &v), TDM_OK), assert_int_equal(v, 7);
    assert_int_equal(tdm_gguf_get_i64(g, "k.u64", &v), TDM_EFORMAT); /* > INT64_MAX */
    assert_int_equal(tdm_gguf_get_i64(g, "k.f32", &v), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_i64(g, "k.bool", &v), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_i64(g, "general.architecture", &v), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_i64(g, "missing", &v), TDM_ENOTFOUND);

    float f;
    assert_int_equal(tdm_gguf_get_f32(g, "k.f32", &f), TDM_OK);
    assert_true(f == 1.5f);
    assert_int_equal(tdm_gguf_get_f32(g, "k.f64", &f), TDM_OK);
    assert_true(f == (float)0.1);
    assert_int_equal(tdm_gguf_get_f32(g, "k.u32", &f), TDM_OK);
    assert_true(f == 4000000000.0f);
    assert_int_equal(tdm_gguf_get_f32(g, "k.i8", &f), TDM_OK);
    assert_true(f == -5.0f);
    assert_int_equal(tdm_gguf_get_f32(g, "k.inexact", &f), TDM_EFORMAT); /* 2^24 + 1 */
    assert_int_equal(tdm_gguf_get_f32(g, "general.architecture", &f), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_f32(g, "missing", &f), TDM_ENOTFOUND);

    bool bl = false;
    assert_int_equal(tdm_gguf_get_bool(g, "k.bool", &bl), TDM_OK);
    assert_true(bl);
    assert_int_equal(tdm_gguf_get_bool(g, "k.u8", &bl), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_str(g, "k.u8", &s), TDM_EFORMAT);

    enum tdm_gguf_type et;
    int64_t n;
    const void *data;
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_i32", &et, &n, &data), TDM_OK);
    assert_int_equal(et, TDM_GGUF_I32);
    assert_int_equal(n, 3);
    int32_t iv[3];
    memcpy(iv, data, sizeof iv);
    assert_int_equal(iv[0], 1), assert_int_equal(iv[1], -2), assert_int_equal(iv[2], 3);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_empty", &et, &n, &data), TDM_OK);
    assert_int_equal(et, TDM_GGUF_U8), assert_int_equal(n, 0);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_bool", &et, &n, &data), TDM_OK);
    assert_int_equal(et, TDM_GGUF_BOOL), assert_int_equal(n, 2);
    assert_int_equal(((const uint8_t *)data)[1], 1);
    assert_int_equal(tdm_gguf_get_arr(g, "k.arr_str", &et, &n, &data), TDM_OK);
    assert_int_equal(et, TDM_GGUF_STRING), assert_int_equal(n, 3);
    assert_int_equal(tdm_gguf_get_arr(g, "k.u8", &et, &n, &data), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_get_arr(g, "missing", &et, &n, &data), TDM_ENOTFOUND);
    const char *want[3] = {"a", "bc", ""};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tdm_gguf_get_arr_str(g, "k.arr_str", i, &s), TDM_OK);
        assert_int_equal(s.len, strlen(want[i]));
        if (s.len) assert_memory_equal(s.ptr, want[i], s.len);
    }
    assert_int_not_equal(tdm_gguf_get_arr_str(g, "k.arr_str", 3, &s), TDM_OK);
    assert_int_not_equal(tdm_gguf_get_arr_str(g, "k.arr_str", -1, &s), TDM_OK);
    assert_int_equal(tdm_gguf_get_arr_str(g, "k.arr_i32", 0, &s), TDM_EFORMAT);

    /* tensors */
    size_t align = alignment ? alignment : 32;
    const struct tdm_tensor_info *t = tdm_gguf_tensor(g, 0);
    assert_string_equal(t->name, "tok.f32");
    assert_int_equal(t->dtype, TDM_DTYPE_F32);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 3), assert_int_equal(t->ne[1], 2);
    assert_int_equal(t->ne[2], 1), assert_int_equal(t->ne[3], 1);
    assert_int_equal(t->nbytes, 24);
    size_t data_start = (size_t)((const uint8_t *)t->data - (const uint8_t *)copy);
    assert_int_equal(data_start % align, 0);
    float fv[6];
    memcpy(fv, t->data, sizeof fv);
    for (int i = 0; i < 6; i++)
        assert_true(fv[i] == 0.5f * (float)i);

    t = tdm_gguf_find_tensor(g, "blk.q8");
    assert_non_null(t);
    assert_ptr_equal(t, tdm_gguf_tensor(g, 1));
    assert_int_equal(t->dtype, TDM_DTYPE_Q8_0);
    assert_int_equal(t->n_dims, 1);
    assert_int_equal(t->ne[0], 32), assert_int_equal(t->ne[1], 1);
    assert_int_equal(t->nbytes, 34);
    assert_int_equal((const uint8_t *)t->data - (const uint8_t *)copy,
                     data_start + align_up(24, align));
    float out[64];
    assert_int_equal(tdm_dequantize(t->dtype, t->data, out, 32), TDM_OK);
    for (int i = 0; i < 32; i++)
        assert_true(out[i] == 0.25f * (float)(i - 16));

    t = tdm_gguf_find_tensor(g, "blk.q4_1");
    assert_non_null(t);
    assert_int_equal(t->dtype, TDM_DTYPE_Q4_1);
    assert_int_equal(t->ne[0], 32), assert_int_equal(t->ne[1], 2);
    assert_int_equal(t->nbytes, 40);
    assert_ptr_equal((const uint8_t *)t->data + t->nbytes, (const uint8_t *)copy + b.len);
    assert_int_equal(tdm_dequantize(t->dtype, t->data, out, 64), TDM_OK);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == 0.5f * (float)j - 1.0f);
        assert_true(out[16 + j] == 0.5f * (float)(15 - j) - 1.0f);
        assert_true(out[32 + j] == 3.0f);
        assert_true(out[48 + j] == 5.0f);
    }
    assert_null(tdm_gguf_find_tensor(g, "blk"));
    assert_null(tdm_gguf_find_tensor(g, "blk.q8 "));

    tdm_gguf_close(g);
    free(copy);
    free(b.p);
}

static void test_valid_v3(void **state)
{
    check_valid(3, 0);
}

static void test_valid_v2(void **state)
{
    check_valid(2, 0);
}

static void test_valid_alignment(void **state)
{
    check_valid(3, 64);
    check_valid(3, 8);
    check_valid(2, 1);
}

static void test_empty_file_header_only(void **state)
{
    struct wbuf b = {0};
    wb_header(&b, 3, 0, 0);
    tdm_gguf_t *g = NULL;
    void *copy;
    assert_int_equal(open_copy(&b, b.len, &g, &copy), TDM_OK);
    assert_int_equal(tdm_gguf_n_kv(g), 0);
    assert_int_equal(tdm_gguf_n_tensors(g), 0);
    assert_int_equal(tdm_gguf_find(g, "general.alignment"), -1);
    assert_null(tdm_gguf_find_tensor(g, "x"));
    tdm_gguf_close(g);
    free(copy);
    free(b.p);
    tdm_gguf_close(NULL);
}

static void test_open_file(void **state)
{
    struct wbuf b = make_valid(3, 0);
    const char *path = "test_gguf_tmp.gguf";
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b.p, 1, b.len, f), b.len);
    fclose(f);
    tdm_gguf_t *g = NULL;
    assert_int_equal(tdm_gguf_open(path, &g), TDM_OK);
    assert_int_equal(tdm_gguf_n_tensors(g), 3);
    const struct tdm_tensor_info *t = tdm_gguf_find_tensor(g, "blk.q8");
    assert_non_null(t);
    assert_int_equal(((uintptr_t)t->data) % 32, 0); /* page-aligned map + aligned offsets */
    tdm_gguf_close(g);

    /* a truncated file on disk reports the path */
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b.p, 1, b.len - 1, f), b.len - 1);
    fclose(f);
    g = NULL;
    assert_int_equal(tdm_gguf_open(path, &g), TDM_EFORMAT);
    assert_null(g);
    assert_non_null(strstr(tdm_err_msg(), path));
    remove(path);

    assert_int_equal(tdm_gguf_open("/nonexistent/dir/x.gguf", &g), TDM_EIO);
    free(b.p);
}

/* ---- malformed images ---- */

static void check_rejected(const struct wbuf *b, size_t len, const char *what)
{
    tdm_gguf_t *g = NULL;
    void *copy;
    tdm_status st = open_copy(b, len, &g, &copy);
    if (st == TDM_OK) {
        tdm_gguf_close(g);
        free(copy);
        fail_msg("%s (%zu bytes): accepted", what, len);
    }
    assert_null(g);
    if (strlen(tdm_err_msg()) == 0) fail_msg("%s: no error message", what);
    free(copy);
}

static void test_truncated_prefixes(void **state)
{
    for (uint32_t version = 2; version <= 3; version++) {
        struct wbuf b = make_valid(version, version == 2 ? 64 : 0);
        for (size_t len = 0; len < b.len; len++)
            check_rejected(&b, len, "truncated");
        free(b.p);
    }
}

static void test_null_args(void **state)
{
    tdm_gguf_t *g = NULL;
    assert_int_equal(tdm_gguf_open_memory(NULL, 10, &g), TDM_EINVAL);
    assert_int_equal(tdm_gguf_open_memory(NULL, 0, &g), TDM_EFORMAT);
    assert_int_equal(tdm_gguf_open(NULL, &g), TDM_EINVAL);
}

typedef void (*build_fn)(struct wbuf *b);

/* A header with one string key, then whatever follows. */
static void one_tensor_file(struct wbuf *b, uint32_t n_dims, const uint64_t *ne, uint32_t dtype,
                            uint64_t offset, size_t data_bytes)
{
    wb_header(b, 3, 1, 0);
    wb_tensor(b, "t", n_dims, ne, dtype, offset);
    wb_pad(b, 32);
    for (size_t i = 0; i < data_bytes; i++)
        wb_u8(b, 0);
}

static void bad_magic(struct wbuf *b)
{
    wb_put(b, "GGUG", 4), wb_u32(b, 3), wb_u64(b, 0), wb_u64(b, 0);
}
static void bad_version_1(struct wbuf *b)
{
    wb_header(b, 1, 0, 0);
}
static void bad_version_4(struct wbuf *b)
{
    wb_header(b, 4, 0, 0);
}
static void bad_version_0(struct wbuf *b)
{
    wb_header(b, 0, 0, 0);
}
static void big_endian(struct wbuf *b)
{
    wb_put(b, "GGUF", 4), wb_u32(b, 0x03000000u);
    wb_u64(b, 0), wb_u64(b, 0);
}
static void huge_n_kv(struct wbuf *b)
{
    wb_header(b, 3, 0, UINT64_C(1) << 40);
}
static void huge_n_tensors(struct wbuf *b)
{
    wb_header(b, 3, UINT64_MAX, 0);
}
static void n_kv_past_file(struct wbuf *b)
{
    wb_header(b, 3, 0, 1000); /* under the cap, but 1000 keys cannot fit */
    wb_key(b, "a", 0), wb_u8(b, 1);
}
static void n_tensors_past_file(struct wbuf *b)
{
    uint64_t ne[1] = {1};
    wb_header(b, 3, 100, 0);
    wb_tensor(b, "t", 1, ne, 0, 0);
}
static void key_len_past_end(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_u64(b, 1000), wb_put(b, "abcdefgh", 8), wb_u32(b, 0), wb_u8(b, 0);
}
static void key_len_max(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_u64(b, UINT64_MAX), wb_put(b, "abcdefgh", 8), wb_u32(b, 0), wb_u8(b, 0);
}
static void empty_key(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "", 0), wb_u8(b, 1), wb_put(b, "pad-pad-pad-pad", 15);
}
static void key_with_nul(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_strn(b, "a\0b", 3), wb_u32(b, 0), wb_u8(b, 1);
}
static void str_value_past_end(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "s", 8), wb_u64(b, 5), wb_put(b, "abc", 3);
}
static void str_value_len_max(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "s", 8), wb_u64(b, UINT64_MAX - 3), wb_put(b, "abcdefgh", 8);
}
static void unknown_value_type(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "x", 13), wb_u64(b, 0);
}
static void unknown_value_type_huge(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "x", 0xffffffffu), wb_u64(b, 0);
}
static void bool_value_2(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "b", 7), wb_u8(b, 2), wb_put(b, "pad-pad-pad", 11);
}
static void scalar_past_end(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "x", 10), wb_u32(b, 0); /* u64 needs 8 bytes */
    wb_put(b, "\0\0", 2);
}
static void nested_array(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 9), wb_u64(b, 1);
    wb_u32(b, 0), wb_u64(b, 1), wb_u8(b, 7);
}
static void array_unknown_elem(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 77), wb_u64(b, 1), wb_u64(b, 0);
}
static void array_count_huge(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 12), wb_u64(b, UINT64_C(1) << 61), wb_u64(b, 0);
}
static void array_count_past_end(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 4), wb_u64(b, 5), wb_u32(b, 1), wb_u32(b, 2);
}
static void str_array_count_huge(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 8), wb_u64(b, UINT64_MAX), wb_str(b, "x");
}
static void str_array_elem_past_end(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 8), wb_u64(b, 2), wb_str(b, "x");
    wb_u64(b, 100), wb_put(b, "yy", 2);
}
static void bool_array_bad(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "a", 9), wb_u32(b, 7), wb_u64(b, 3), wb_u8(b, 0), wb_u8(b, 1), wb_u8(b, 9);
}
static void duplicate_key(struct wbuf *b)
{
    wb_header(b, 3, 0, 2);
    wb_key(b, "dup", 4), wb_u32(b, 1);
    wb_key(b, "dup", 0), wb_u8(b, 2);
}
static void alignment_not_u32(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "general.alignment", 10), wb_u64(b, 32);
}
static void alignment_zero(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "general.alignment", 4), wb_u32(b, 0);
}
static void alignment_not_pow2(struct wbuf *b)
{
    wb_header(b, 3, 0, 1);
    wb_key(b, "general.alignment", 4), wb_u32(b, 48);
}
static void tensor_offset_out_of_range(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    one_tensor_file(b, 1, ne, 0, 32, 16); /* 16 bytes at 32 in a 16-byte data section */
}
static void tensor_data_past_end(struct wbuf *b)
{
    uint64_t ne[1] = {8};
    one_tensor_file(b, 1, ne, 0, 0, 31); /* needs 32 bytes */
}
static void tensor_offset_huge(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    one_tensor_file(b, 1, ne, 0, UINT64_MAX - 31, 16);
}
static void tensor_offset_misaligned(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    one_tensor_file(b, 1, ne, 0, 4, 64);
}
static void tensor_dims_overflow(struct wbuf *b)
{
    uint64_t ne[2] = {UINT64_C(1) << 62, UINT64_C(1) << 62};
    one_tensor_file(b, 2, ne, 0, 0, 64);
}
static void tensor_bytes_overflow(struct wbuf *b)
{
    uint64_t ne[2] = {UINT64_C(1) << 61, 4}; /* 2^63 elements: the product overflows i64 */
    one_tensor_file(b, 2, ne, 0, 0, 64);
}
static void tensor_nbytes_overflow(struct wbuf *b)
{
    uint64_t ne[1] = {UINT64_C(1) << 62}; /* 2^62 f32 = 2^64 bytes */
    one_tensor_file(b, 1, ne, 0, 0, 64);
}
static void tensor_dim_negative(struct wbuf *b)
{
    uint64_t ne[1] = {UINT64_MAX};
    one_tensor_file(b, 1, ne, 0, 0, 64);
}
static void tensor_dim_zero(struct wbuf *b)
{
    uint64_t ne[2] = {4, 0};
    one_tensor_file(b, 2, ne, 0, 0, 64);
}
static void tensor_ndims_zero(struct wbuf *b)
{
    one_tensor_file(b, 0, NULL, 0, 0, 64);
}
static void tensor_ndims_five(struct wbuf *b)
{
    uint64_t ne[5] = {1, 1, 1, 1, 1};
    one_tensor_file(b, 5, ne, 0, 0, 64);
}
static void tensor_unknown_dtype(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    one_tensor_file(b, 1, ne, 4, 0, 64); /* id 4 was q4_2, removed */
}
static void tensor_unknown_dtype_big(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    one_tensor_file(b, 1, ne, 1000, 0, 64);
}
static void tensor_row_not_blocks(struct wbuf *b)
{
    uint64_t ne[1] = {33};
    one_tensor_file(b, 1, ne, 8, 0, 128); /* q8_0 needs a multiple of 32 */
}
static void tensor_name_past_end(struct wbuf *b)
{
    wb_header(b, 3, 1, 0);
    wb_u64(b, 500), wb_put(b, "abc", 3);
    for (int i = 0; i < 40; i++)
        wb_u8(b, 0);
}
static void tensor_name_with_nul(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    wb_header(b, 3, 1, 0);
    wb_strn(b, "a\0b", 3), wb_u32(b, 1), wb_u64(b, ne[0]), wb_u32(b, 0), wb_u64(b, 0);
    wb_pad(b, 32);
    for (int i = 0; i < 16; i++)
        wb_u8(b, 0);
}
static void tensor_name_empty(struct wbuf *b)
{
    uint64_t ne[1] = {4};
    wb_header(b, 3, 1, 0);
    wb_tensor(b, "", 1, ne, 0, 0);
    wb_pad(b, 32);
    for (int i = 0; i < 16; i++)
        wb_u8(b, 0);
}
static void tensor_name_too_long(struct wbuf *b)
{
    char name[300];
    memset(name, 'x', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    uint64_t ne[1] = {4};
    wb_header(b, 3, 1, 0);
    wb_tensor(b, name, 1, ne, 0, 0);
    wb_pad(b, 32);
    for (int i = 0; i < 16; i++)
        wb_u8(b, 0);
}
static void duplicate_tensor(struct wbuf *b)
{
    uint64_t ne[1] = {8};
    wb_header(b, 3, 2, 0);
    wb_tensor(b, "w", 1, ne, 0, 0);
    wb_tensor(b, "w", 1, ne, 0, 32);
    wb_pad(b, 32);
    for (int i = 0; i < 64; i++)
        wb_u8(b, 0);
}
static void data_start_past_end(struct wbuf *b)
{
    /* zero-sized data cannot exist (dims > 0), so a tensor whose padding is missing fails */
    uint64_t ne[1] = {1};
    wb_header(b, 3, 1, 0);
    wb_tensor(b, "t", 1, ne, 0, 0);
}

static const struct {
    const char *name;
    build_fn build;
    tdm_status want; /* 0: any error */
} MALFORMED[] = {
    {"bad magic", bad_magic, TDM_EFORMAT},
    {"version 1", bad_version_1, TDM_EUNSUPPORTED},
    {"version 4", bad_version_4, TDM_EUNSUPPORTED},
    {"version 0", bad_version_0, 0},
    {"big-endian", big_endian, TDM_EUNSUPPORTED},
    {"huge n_kv", huge_n_kv, TDM_ERANGE},
    {"huge n_tensors", huge_n_tensors, TDM_ERANGE},
    {"n_kv past file", n_kv_past_file, TDM_EFORMAT},
    {"n_tensors past file", n_tensors_past_file, TDM_EFORMAT},
    {"key length past end", key_len_past_end, TDM_EFORMAT},
    {"key length max", key_len_max, TDM_EFORMAT},
    {"empty key", empty_key, TDM_EFORMAT},
    {"key with NUL", key_with_nul, TDM_EFORMAT},
    {"string value past end", str_value_past_end, TDM_EFORMAT},
    {"string value length max", str_value_len_max, TDM_EFORMAT},
    {"unknown value type", unknown_value_type, TDM_EFORMAT},
    {"unknown value type 2^32-1", unknown_value_type_huge, TDM_EFORMAT},
    {"bool value 2", bool_value_2, TDM_EFORMAT},
    {"scalar past end", scalar_past_end, TDM_EFORMAT},
    {"nested array", nested_array, 0},
    {"array of unknown type", array_unknown_elem, TDM_EFORMAT},
    {"array count huge", array_count_huge, TDM_EFORMAT},
    {"array count past end", array_count_past_end, TDM_EFORMAT},
    {"string array count huge", str_array_count_huge, TDM_EFORMAT},
    {"string array element past end", str_array_elem_past_end, TDM_EFORMAT},
    {"bool array value 9", bool_array_bad, TDM_EFORMAT},
    {"duplicate key", duplicate_key, TDM_EFORMAT},
    {"alignment not u32", alignment_not_u32, TDM_EFORMAT},
    {"alignment 0", alignment_zero, TDM_EFORMAT},
    {"alignment 48", alignment_not_pow2, TDM_EFORMAT},
    {"tensor offset out of range", tensor_offset_out_of_range, TDM_EFORMAT},
    {"tensor data past end", tensor_data_past_end, TDM_EFORMAT},
    {"tensor offset huge", tensor_offset_huge, TDM_EFORMAT},
    {"tensor offset misaligned", tensor_offset_misaligned, TDM_EFORMAT},
    {"tensor dims overflow", tensor_dims_overflow, TDM_EFORMAT},
    {"tensor elements overflow", tensor_bytes_overflow, TDM_EFORMAT},
    {"tensor bytes overflow", tensor_nbytes_overflow, TDM_EFORMAT},
    {"tensor dim 2^64-1", tensor_dim_negative, TDM_EFORMAT},
    {"tensor dim 0", tensor_dim_zero, TDM_EFORMAT},
    {"tensor n_dims 0", tensor_ndims_zero, TDM_EFORMAT},
    {"tensor n_dims 5", tensor_ndims_five, TDM_EFORMAT},
    {"tensor dtype 4", tensor_unknown_dtype, TDM_EFORMAT},
    {"tensor dtype 1000", tensor_unknown_dtype_big, TDM_EFORMAT},
    {"tensor row not whole blocks", tensor_row_not_blocks, TDM_EFORMAT},
    {"tensor name past end", tensor_name_past_end, TDM_EFORMAT},
    {"tensor name with NUL", tensor_name_with_nul, TDM_EFORMAT},
    {"tensor name empty", tensor_name_empty, TDM_EFORMAT},
    {"tensor name too long", tensor_name_too_long, TDM_EFORMAT},
    {"duplicate tensor", duplicate_tensor, TDM_EFORMAT},
    {"data section past end", data_start_past_end, TDM_EFORMAT},
};

static void test_malformed(void **state)
{
    for (size_t i = 0; i < sizeof MALFORMED / sizeof MALFORMED[0]; i++) {
        struct wbuf b = {0};
        MALFORMED[i].build(&b);
        tdm_gguf_t *g = NULL;
        void *copy;
        tdm_status st = open_copy(&b, b.len, &g, &copy);
        if (st == TDM_OK) {
            tdm_gguf_close(g);
            fail_msg("%s: accepted", MALFORMED[i].name);
        }
        if (MALFORMED[i].want && st != MALFORMED[i].want)
            fail_msg("%s: got %s (%s), want %s", MALFORMED[i].name, tdm_status_str(st),
                     tdm_err_msg(), tdm_status_str(MALFORMED[i].want));
        assert_null(g);
        assert_true(strlen(tdm_err_msg()) > 0);
        free(copy);
        free(b.p);
    }
}

/* The malformed builders differ from valid files only where intended: a fixed one opens. */
static void test_one_tensor_file_valid(void **state)
{
    uint64_t ne[2] = {32, 3};
    struct wbuf b = {0};
    one_tensor_file(&b, 2, ne, 8, 0, 3 * 34);
    tdm_gguf_t *g = NULL;
    void *copy;
    assert_int_equal(open_copy(&b, b.len, &g, &copy), TDM_OK);
    const struct tdm_tensor_info *t = tdm_gguf_find_tensor(g, "t");
    assert_non_null(t);
    assert_int_equal(t->nbytes, 3 * 34);
    tdm_gguf_close(g);
    free(copy);
    free(b.p);
}

/* ---- element types ---- */

static void test_dtype_tables(void **state)
{
    static const struct {
        enum tdm_dtype t;
        int64_t elems;
        size_t bytes;
        const char *name;
    } want[] = {
        {TDM_DTYPE_F32, 1, 4, "f32"},       {TDM_DTYPE_F16, 1, 2, "f16"},
        {TDM_DTYPE_BF16, 1, 2, "bf16"},     {TDM_DTYPE_Q8_0, 32, 34, "q8_0"},
        {TDM_DTYPE_Q4_0, 32, 18, "q4_0"},   {TDM_DTYPE_Q4_1, 32, 20, "q4_1"},
        {TDM_DTYPE_Q5_0, 32, 22, "q5_0"},   {TDM_DTYPE_Q5_1, 32, 24, "q5_1"},
        {TDM_DTYPE_Q8_1, 32, 36, "q8_1"},   {TDM_DTYPE_Q2_K, 256, 84, "q2_K"},
        {TDM_DTYPE_Q3_K, 256, 110, "q3_K"}, {TDM_DTYPE_Q4_K, 256, 144, "q4_K"},
        {TDM_DTYPE_Q5_K, 256, 176, "q5_K"}, {TDM_DTYPE_Q6_K, 256, 210, "q6_K"},
        {TDM_DTYPE_Q8_K, 256, 292, "q8_K"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        assert_true(tdm_dtype_known(want[i].t));
        assert_int_equal(tdm_dtype_block_elems(want[i].t), want[i].elems);
        assert_int_equal(tdm_dtype_block_bytes(want[i].t), want[i].bytes);
        assert_string_equal(tdm_dtype_name(want[i].t), want[i].name);
    }
    assert_false(tdm_dtype_known(4));
    assert_false(tdm_dtype_known(5));
    assert_false(tdm_dtype_known(-1));
    assert_false(tdm_dtype_known(TDM_DTYPE_COUNT));
    assert_false(tdm_dtype_known(1 << 30));
    assert_true(tdm_dtype_known(20)); /* iq4_nl: listed, not dequantised */
    assert_string_equal(tdm_dtype_name((enum tdm_dtype)4), "unknown");
    assert_int_equal(tdm_dtype_block_elems((enum tdm_dtype)4), 0);
    assert_int_equal(tdm_dtype_block_bytes((enum tdm_dtype)4), 0);

    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_Q4_1, 64), 40);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_Q4_1, 33), 0);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_Q4_1, 0), 0);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_Q4_1, -32), 0);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_F32, 7), 28);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_Q6_K, 512), 420);
    assert_int_equal(tdm_dtype_row_bytes((enum tdm_dtype)4, 32), 0);
    assert_int_equal(tdm_dtype_row_bytes(TDM_DTYPE_F32, INT64_MAX), 0); /* overflows size_t */
}

static void test_dequant_errors(void **state)
{
    uint8_t src[512] = {0};
    float dst[256];
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q8_0, src, dst, 33), TDM_EINVAL);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q8_0, src, dst, -32), TDM_EINVAL);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q2_K, src, dst, 256), TDM_EUNSUPPORTED);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q8_1, src, dst, 32), TDM_EUNSUPPORTED);
    assert_int_equal(tdm_dequantize((enum tdm_dtype)4, src, dst, 32), TDM_EUNSUPPORTED);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q8_0, NULL, dst, 32), TDM_EINVAL);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q8_0, NULL, NULL, 0), TDM_OK);
}

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8);
}

static void test_dequant_scalar_types(void **state)
{
    uint8_t src[8];
    float out[4];
    put16(src, 0x3c00), put16(src + 2, 0xc000), put16(src + 4, 0x0001), put16(src + 6, 0x7bff);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_F16, src, out, 4), TDM_OK);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0x1p-24f && out[3] == 65504.0f);
    put16(src, 0x3fc0), put16(src + 2, 0xc2f7), put16(src + 4, 0x0000), put16(src + 6, 0x8000);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_BF16, src, out, 4), TDM_OK);
    assert_true(out[0] == 1.5f && out[1] == -123.5f && out[2] == 0.0f && out[3] == 0.0f);
    float f32[2] = {3.25f, -0.0f};
    /* F32 from an odd address */
    uint8_t odd[9];
    memcpy(odd + 1, f32, 8);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_F32, odd + 1, out, 2), TDM_OK);
    assert_memory_equal(out, f32, 8);
}

static void test_dequant_q4_0_q5(void **state)
{
    uint8_t blk[1 + 24]; /* + 1: exercise an odd source address */
    uint8_t *b = blk + 1;
    float out[32];

    /* q4_0: d = 1, qs[j] = j | (15 - j) << 4 -> x[j] = j - 8, x[16 + j] = 7 - j */
    put16(b, 0x3c00);
    for (int j = 0; j < 16; j++)
        b[2 + j] = (uint8_t)(j | (15 - j) << 4);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q4_0, b, out, 32), TDM_OK);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == (float)(j - 8));
        assert_true(out[16 + j] == (float)(7 - j));
    }

    /* q5_0: d = 0.5, qh = 0xffff0000 (bit 4 set for elements 16..31), qs[j] = j | j << 4
     * -> x[j] = 0.5 (j - 16), x[16 + j] = 0.5 (j + 16 - 16) */
    put16(b, 0x3800);
    b[2] = 0x00, b[3] = 0x00, b[4] = 0xff, b[5] = 0xff;
    for (int j = 0; j < 16; j++)
        b[6 + j] = (uint8_t)(j | j << 4);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q5_0, b, out, 32), TDM_OK);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == 0.5f * (float)(j - 16));
        assert_true(out[16 + j] == 0.5f * (float)j);
    }

    /* q5_1: d = 1, m = 0.5, qh = 0x0000ffff, qs[j] = j | j << 4
     * -> x[j] = (j + 16) + 0.5, x[16 + j] = j + 0.5 */
    put16(b, 0x3c00), put16(b + 2, 0x3800);
    b[4] = 0xff, b[5] = 0xff, b[6] = 0x00, b[7] = 0x00;
    for (int j = 0; j < 16; j++)
        b[8 + j] = (uint8_t)(j | j << 4);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q5_1, b, out, 32), TDM_OK);
    for (int j = 0; j < 16; j++) {
        assert_true(out[j] == (float)(j + 16) + 0.5f);
        assert_true(out[16 + j] == (float)j + 0.5f);
    }
}

static void test_dequant_q4_K(void **state)
{
    uint8_t b[144] = {0};
    float out[256];
    /* d = 1, dmin = 0.5; sub-block j has scale sc[j] and min mn[j] below; j = 5's min and
     * j = 7's scale need the high 2 bits stored in the top of bytes 5 and 3. */
    const uint8_t sc[8] = {1, 2, 3, 4, 5, 6, 7, 40}, mn[8] = {0, 1, 2, 3, 4, 33, 6, 7};
    put16(b, 0x3c00), put16(b + 2, 0x3800);
    uint8_t *scales = b + 4;
    for (int j = 0; j < 4; j++)
        scales[j] = sc[j], scales[4 + j] = mn[j];
    for (int j = 4; j < 8; j++) {
        scales[j + 4] = (uint8_t)((sc[j] & 0x0f) | (mn[j] & 0x0f) << 4);
        scales[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        scales[j] |= (uint8_t)((mn[j] >> 4) << 6);
    }
    memset(b + 16, 0x53, 128); /* low nibble 3 (even sub-blocks), high 5 (odd sub-blocks) */
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q4_K, b, out, 256), TDM_OK);
    for (int i = 0; i < 256; i++) {
        int s = i / 32;
        float q = (s % 2 == 0) ? 3.0f : 5.0f;
        float want = (1.0f * (float)sc[s]) * q - 0.5f * (float)mn[s];
        if (out[i] != want) fail_msg("q4_K[%d] = %g, want %g", i, out[i], want);
    }
}

static void test_dequant_q5_K(void **state)
{
    uint8_t b[176] = {0};
    float out[256];
    /* d = 2, dmin = 1, every sub-block scale 1 and min 0; qs all zero; qh[l] = 1 << (l % 8)
     * -> element l of sub-block s is 16 when l % 8 == s, else 0; times 2 */
    put16(b, 0x4000), put16(b + 2, 0x3c00);
    uint8_t *scales = b + 4;
    for (int j = 0; j < 4; j++)
        scales[j] = 1;
    for (int j = 8; j < 12; j++)
        scales[j] = 0x01;
    for (int l = 0; l < 32; l++)
        b[16 + l] = (uint8_t)(1u << (l % 8));
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q5_K, b, out, 256), TDM_OK);
    for (int i = 0; i < 256; i++) {
        int s = i / 32, l = i % 32;
        float want = (l % 8 == s) ? 32.0f : 0.0f;
        if (out[i] != want) fail_msg("q5_K[%d] = %g, want %g", i, out[i], want);
    }
}

static void test_dequant_q6_K(void **state)
{
    uint8_t b[210] = {0};
    float out[256];
    /* ql all 0x21, qh all 0xe4 (2-bit fields 0,1,2,3), scales[i] = i - 8, d = 1:
     * in each half, group g of 32 takes the low 4 bits from nibble g >> 1 of ql (1 or 2) and
     * the high 2 bits from field g of qh; q = lo | g << 4, minus 32; scale 8h + 2g + l / 16 */
    memset(b, 0x21, 128);
    memset(b + 128, 0xe4, 64);
    for (int i = 0; i < 16; i++)
        b[192 + i] = (uint8_t)(int8_t)(i - 8);
    put16(b + 208, 0x3c00);
    assert_int_equal(tdm_dequantize(TDM_DTYPE_Q6_K, b, out, 256), TDM_OK);
    for (int i = 0; i < 256; i++) {
        int h = i / 128, g = (i % 128) / 32, l = i % 32;
        int lo = g < 2 ? 1 : 2;
        int q = (lo | g << 4) - 32;
        float want = (float)(8 * h + 2 * g + l / 16 - 8) * (float)q;
        if (out[i] != want) fail_msg("q6_K[%d] = %g, want %g", i, out[i], want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid_v3),
        cmocka_unit_test(test_valid_v2),
        cmocka_unit_test(test_valid_alignment),
        cmocka_unit_test(test_empty_file_header_only),
        cmocka_unit_test(test_open_file),
        cmocka_unit_test(test_truncated_prefixes),
        cmocka_unit_test(test_null_args),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_one_tensor_file_valid),
        cmocka_unit_test(test_dtype_tables),
        cmocka_unit_test(test_dequant_errors),
        cmocka_unit_test(test_dequant_scalar_types),
        cmocka_unit_test(test_dequant_q4_0_q5),
        cmocka_unit_test(test_dequant_q4_K),
        cmocka_unit_test(test_dequant_q5_K),
        cmocka_unit_test(test_dequant_q6_K),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
