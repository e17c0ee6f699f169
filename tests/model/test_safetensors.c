/*
 * Tests of the safetensors reader (src/model/safetensors.c).
 *
 * Images are built here byte by byte (8-byte length, JSON text, data), independent of the
 * reader, with hand-chosen shapes and offsets; expected shapes, pointers and values follow from
 * that layout. A table of malformed images (every truncation of a valid one, lengths past the
 * end or over the cap, bad JSON, wrong types, offsets out of range, size mismatches, unknown
 * dtypes, rank 5, duplicate names, overlaps) must each be refused with an error and no handle;
 * under the sanitizer build an overread or leak on those paths fails the run. Folder tests
 * cover single files, sharded indexes, a missing shard and shard names that try to leave the
 * folder. tests/model/test_loader.py checks the reader against files written by the Python
 * safetensors package.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "model/model_int.h"

/* An image: 8-byte little-endian header length, the JSON, then `data_len` bytes of data. */
static uint8_t *make_image(const char *json, const void *data, size_t data_len, size_t *len)
{
    size_t hlen = strlen(json);
    uint8_t *p = malloc(8 + hlen + data_len + 1);
    assert_non_null(p);
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(p + 8, json, hlen);
    if (data_len) memcpy(p + 8 + hlen, data, data_len);
    *len = 8 + hlen + data_len;
    return p;
}

static uint8_t *image_hlen(uint64_t hlen, const char *rest, size_t *len)
{
    size_t n = strlen(rest);
    uint8_t *p = malloc(8 + n + 1);
    assert_non_null(p);
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(p + 8, rest, n);
    *len = 8 + n;
    return p;
}

/* Three tensors: a F32 [2, 3] at 0, a BF16 [4] at 24, a F16 [1, 2, 2] at 32; 40 data bytes. */
static const char *VALID_JSON =
    "{\"__metadata__\": {\"format\": \"pt\"},"
    " \"a\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]},"
    " \"b\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [24, 32]},"
    " \"c\": {\"dtype\": \"F16\", \"shape\": [1, 2, 2], \"data_offsets\": [32, 40]}}    ";

static void valid_data(uint8_t data[40])
{
    float a[6] = {1, 2, 3, 4, 5, 6};
    memcpy(data, a, 24);
    uint16_t b[4] = {0x3f80, 0x4000, 0xbf80, 0x0000}; /* bf16: 1, 2, -1, 0 */
    memcpy(data + 24, b, 8);
    uint16_t c[4] = {0x3c00, 0x4000, 0x4200, 0xc400}; /* f16: 1, 2, 3, -4 */
    memcpy(data + 32, c, 8);
}

static void test_valid(void **state)
{
    (void)state;
    uint8_t data[40];
    valid_data(data);
    size_t len;
    uint8_t *img = make_image(VALID_JSON, data, sizeof(data), &len);
    const uint8_t *base = img + 8 + strlen(VALID_JSON);
    tdm_st_t *st = NULL;
    assert_int_equal(tdm_st_open_memory(img, len, &st), TDM_OK);
    assert_int_equal(tdm_st_n_tensors(st), 3);

    const struct tdm_tensor_info *a = tdm_st_find_tensor(st, "a");
    assert_non_null(a);
    assert_string_equal(a->name, "a");
    assert_int_equal(a->dtype, TDM_DTYPE_F32);
    assert_int_equal(a->n_dims, 2);
    assert_int_equal(a->ne[0], 3); /* reversed: contiguous dimension first */
    assert_int_equal(a->ne[1], 2);
    assert_int_equal(a->ne[2], 1);
    assert_int_equal(a->ne[3], 1);
    assert_ptr_equal(a->data, base);
    assert_int_equal(a->nbytes, 24);
    float f[6];
    memcpy(f, a->data, 24);
    assert_true(f[0] == 1.0f && f[5] == 6.0f);

    const struct tdm_tensor_info *b = tdm_st_find_tensor(st, "b");
    assert_non_null(b);
    assert_int_equal(b->dtype, TDM_DTYPE_BF16);
    assert_int_equal(b->n_dims, 1);
    assert_int_equal(b->ne[0], 4);
    assert_ptr_equal(b->data, base + 24);
    uint16_t h;
    memcpy(&h, (const uint8_t *)b->data + 4, 2);
    assert_true(tdm_bf16_to_f32(h) == -1.0f);

    const struct tdm_tensor_info *c = tdm_st_find_tensor(st, "c");
    assert_non_null(c);
    assert_int_equal(c->dtype, TDM_DTYPE_F16);
    assert_int_equal(c->n_dims, 3);
    assert_int_equal(c->ne[0], 2);
    assert_int_equal(c->ne[1], 2);
    assert_int_equal(c->ne[2], 1);
    assert_ptr_equal(c->data, base + 32);
    memcpy(&h, (const uint8_t *)c->data + 6, 2);
    assert_true(tdm_f16_to_f32(h) == -4.0f);
    assert_string_equal(tdm_st_dtype_str(st, c), "F16");

    assert_null(tdm_st_find_tensor(st, "__metadata__"));
    assert_null(tdm_st_find_tensor(st, "d"));
    assert_null(tdm_st_tensor(st, 3));
    assert_null(tdm_st_tensor(st, -1));
    int seen = 0;
    for (int64_t i = 0; i < 3; i++)
        seen |= 1 << (tdm_st_tensor(st, i)->name[0] - 'a');
    assert_int_equal(seen, 7);
    tdm_st_close(st);
    tdm_st_close(NULL);
    free(img);
}

/* Other dtypes load and are listed, marked unsupported; scalars and empty tensors are fine. */
static void test_other_dtypes(void **state)
{
    (void)state;
    const char *json =
        "{\"i\": {\"dtype\": \"I8\", \"shape\": [3], \"data_offsets\": [0, 3]},"
        " \"d\": {\"dtype\": \"F64\", \"shape\": [], \"data_offsets\": [8, 16]},"
        " \"e\": {\"dtype\": \"F32\", \"shape\": [0, 5], \"data_offsets\": [16, 16]},"
        " \"f4\": {\"dtype\": \"F4\", \"shape\": [3], \"data_offsets\": [16, 18]}}";
    uint8_t data[18] = {0};
    size_t len;
    uint8_t *img = make_image(json, data, sizeof(data), &len);
    tdm_st_t *st = NULL;
    assert_int_equal(tdm_st_open_memory(img, len, &st), TDM_OK);
    const struct tdm_tensor_info *i8 = tdm_st_find_tensor(st, "i");
    assert_non_null(i8);
    assert_int_equal(i8->dtype, TDM_DTYPE_ST_UNSUPPORTED);
    assert_false(tdm_dtype_known((int)i8->dtype));
    assert_string_equal(tdm_st_dtype_str(st, i8), "I8");
    const struct tdm_tensor_info *d = tdm_st_find_tensor(st, "d");
    assert_int_equal(d->n_dims, 0);
    assert_int_equal(d->nbytes, 8);
    assert_string_equal(tdm_st_dtype_str(st, d), "F64");
    const struct tdm_tensor_info *e = tdm_st_find_tensor(st, "e");
    assert_int_equal(e->nbytes, 0);
    assert_int_equal(e->ne[0], 5);
    assert_int_equal(e->ne[1], 0);
    tdm_st_close(st);
    free(img);
}

struct bad_case {
    const char *what;
    const char *json; /* NULL: use raw */
    uint64_t hlen;    /* for raw cases */
    const char *raw;  /* bytes after the length */
    size_t data_len;
};

static void test_malformed(void **state)
{
    (void)state;
    const struct bad_case cases[] = {
        {"header length past EOF", NULL, 100, "{}", 0},
        {"huge header length", NULL, (uint64_t)1 << 40, "{}", 0},
        {"header just over cap", NULL, TDM_ST_MAX_HEADER_BYTES + 1ull, "{}", 0},
        {"all-ones header length", NULL, ~0ull, "{}", 0},
        {"bad JSON", "{\"a\": ", 0, NULL, 0},
        {"trailing junk", "{} x", 0, NULL, 0},
        {"empty header", "", 0, NULL, 0},
        {"not an object", "[1, 2, 3]", 0, NULL, 0},
        {"entry not an object", "{\"a\": 5}", 0, NULL, 0},
        {"dtype missing", "{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 0, NULL, 4},
        {"dtype not a string", "{\"a\": {\"dtype\": 5, \"shape\": [1], \"data_offsets\": [0, 4]}}",
         0, NULL, 4},
        {"unknown dtype", "{\"a\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
         0, NULL, 4},
        {"shape missing", "{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 0, NULL, 4},
        {"shape not ints",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}", 0, NULL, 4},
        {"negative dim", "{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}",
         0, NULL, 4},
        {"rank 5",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1], \"data_offsets\": [0, 4]}}", 0,
         NULL, 4},
        {"shape product overflow",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
         "\"data_offsets\": [0, 4]}}",
         0, NULL, 4},
        {"byte size overflow",
         "{\"a\": {\"dtype\": \"F64\", \"shape\": [4611686018427387904], \"data_offsets\": [0, "
         "4]}}",
         0, NULL, 4},
        {"offsets missing", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 0, NULL, 4},
        {"offsets wrong count",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", 0, NULL, 8},
        {"offsets negative",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", 0, NULL, 4},
        {"offsets past the data",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", 0, NULL, 4},
        {"begin after end",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 0]}}", 0, NULL, 4},
        {"size mismatch",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 20]}}", 0, NULL,
         24},
        {"duplicate names",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
         " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
         0, NULL, 8},
        {"overlap",
         "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
         " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
         0, NULL, 12},
        {"NUL in a name",
         "{\"a\\u0000b\": {\"dtype\": \"F32\", \"shape\": [1], "
         "\"data_offsets\": [0, 4]}}",
         0, NULL, 4},
    };
    uint8_t zeros[64] = {0};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct bad_case *bc = &cases[i];
        size_t len;
        uint8_t *img = bc->json ? make_image(bc->json, zeros, bc->data_len, &len)
                                : image_hlen(bc->hlen, bc->raw, &len);
        tdm_st_t *st = (tdm_st_t *)(uintptr_t)1; /* must stay untouched */
        tdm_status rc = tdm_st_open_memory(img, len, &st);
        if (rc == TDM_OK) fail_msg("case \"%s\" was accepted", bc->what);
        assert_ptr_equal(st, (tdm_st_t *)(uintptr_t)1);
        assert_true(strlen(tdm_err_msg()) > 0);
        free(img);
    }

    /* every strict prefix of a valid image is refused */
    uint8_t data[40];
    valid_data(data);
    size_t len;
    uint8_t *img = make_image(VALID_JSON, data, sizeof(data), &len);
    for (size_t n = 0; n < len; n++) {
        uint8_t *copy = malloc(n + 1); /* exact-size copies let ASan see overreads */
        memcpy(copy, img, n);
        tdm_st_t *st = NULL;
        if (tdm_st_open_memory(copy, n, &st) == TDM_OK) fail_msg("prefix %zu accepted", n);
        free(copy);
    }
    free(img);
}

static void test_specific_errors(void **state)
{
    (void)state;
    size_t len;
    tdm_st_t *st = NULL;
    uint8_t *img = image_hlen((uint64_t)1 << 40, "{}", &len);
    assert_int_equal(tdm_st_open_memory(img, len, &st), TDM_ERANGE);
    free(img);
    img = make_image("{\"a\": {\"dtype\": \"F32\", \"shape\": [1, 1, 1, 1, 1], \"data_offsets\": "
                     "[0, 4]}}",
                     "abcd", 4, &len);
    assert_int_equal(tdm_st_open_memory(img, len, &st), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "rank 5"));
    free(img);
    img = make_image("{\"w\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 20]}}",
                     "01234567890123456789", 20, &len);
    assert_int_equal(tdm_st_open_memory(img, len, &st), TDM_EFORMAT);
    assert_non_null(strstr(tdm_err_msg(), "\"w\""));
    free(img);
    assert_int_equal(tdm_st_open_memory(NULL, 0, &st), TDM_EFORMAT);
    assert_int_equal(tdm_st_open_memory("x", 1, NULL), TDM_EINVAL);
}

/* ---- folders ---- */

static char tmpdir[64];

static void write_file(const char *name, const void *p, size_t n)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(p, 1, n, f), n);
    fclose(f);
}

static void write_text(const char *name, const char *text)
{
    write_file(name, text, strlen(text));
}

static void remove_file(const char *name)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    unlink(path);
}

static int setup_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/tdm_st_test_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    const char *names[] = {"model.safetensors", "model.safetensors.index.json", "s1.safetensors",
                           "s2.safetensors"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        remove_file(names[i]);
    return rmdir(tmpdir);
}

static void write_shards(void)
{
    size_t len;
    float v1[2] = {1.5f, 2.5f}, v2[3] = {7, 8, 9};
    uint8_t *img = make_image(
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", v1, 8, &len);
    write_file("s1.safetensors", img, len);
    free(img);
    img = make_image("{\"y\": {\"dtype\": \"F32\", \"shape\": [3, 1], \"data_offsets\": [0, 12]},"
                     " \"z\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [12, 12]}}",
                     v2, 12, &len);
    write_file("s2.safetensors", img, len);
    free(img);
}

static void test_folder_single(void **state)
{
    (void)state;
    tdm_st_t *st = NULL;
    assert_int_equal(tdm_st_open(tmpdir, &st), TDM_ENOTFOUND); /* empty folder */
    uint8_t data[40];
    valid_data(data);
    size_t len;
    uint8_t *img = make_image(VALID_JSON, data, sizeof(data), &len);
    write_file("model.safetensors", img, len);
    free(img);
    assert_int_equal(tdm_st_open(tmpdir, &st), TDM_OK);
    assert_int_equal(tdm_st_n_tensors(st), 3);
    const struct tdm_tensor_info *a = tdm_st_find_tensor(st, "a");
    float f;
    memcpy(&f, (const uint8_t *)a->data + 8, 4);
    assert_true(f == 3.0f);
    tdm_st_close(st);

    char path[256];
    snprintf(path, sizeof(path), "%s/model.safetensors", tmpdir);
    assert_int_equal(tdm_st_open(path, &st), TDM_OK); /* the file itself */
    assert_int_equal(tdm_st_n_tensors(st), 3);
    tdm_st_close(st);
    snprintf(path, sizeof(path), "%s/nope.safetensors", tmpdir);
    assert_int_not_equal(tdm_st_open(path, &st), TDM_OK);
    remove_file("model.safetensors");
}

static void test_folder_sharded(void **state)
{
    (void)state;
    write_shards();
    write_text("model.safetensors.index.json",
               "{\"metadata\": {\"total_size\": 20}, \"weight_map\": {\"x\": \"s1.safetensors\","
               " \"y\": \"s2.safetensors\", \"z\": \"s2.safetensors\"}}");
    tdm_st_t *st = NULL;
    assert_int_equal(tdm_st_open(tmpdir, &st), TDM_OK);
    assert_int_equal(tdm_st_n_tensors(st), 3);
    const struct tdm_tensor_info *x = tdm_st_find_tensor(st, "x");
    const struct tdm_tensor_info *y = tdm_st_find_tensor(st, "y");
    assert_non_null(x);
    assert_non_null(y);
    assert_int_equal(y->ne[0], 1);
    assert_int_equal(y->ne[1], 3);
    float f;
    memcpy(&f, x->data, 4);
    assert_true(f == 1.5f);
    memcpy(&f, (const uint8_t *)y->data + 8, 4);
    assert_true(f == 9.0f);
    tdm_st_close(st);

    const char *bad_indexes[] = {
        /* a missing shard */
        "{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"s3.safetensors\"}}",
        /* escaping the folder */
        "{\"weight_map\": {\"x\": \"../s1.safetensors\"}}",
        "{\"weight_map\": {\"x\": \"sub/s1.safetensors\"}}",
        "{\"weight_map\": {\"x\": \"..\"}}",
        "{\"weight_map\": {\"x\": \"\"}}",
        "{\"weight_map\": {\"x\": \"/etc/passwd\"}}",
        /* the named shard lacks the tensor */
        "{\"weight_map\": {\"x\": \"s2.safetensors\"}}",
        "{\"weight_map\": {\"x\": \"s1.safetensors\", \"w\": \"s1.safetensors\"}}",
        /* structure */
        "{\"weight_map\": {\"x\": 5}}",
        "{\"weight_map\": []}",
        "{\"weight_map\": {}}",
        "{}",
        "[]",
        "{\"weight_map\": {\"x\": \"s1.safetensors\", ",
    };
    for (size_t i = 0; i < sizeof(bad_indexes) / sizeof(bad_indexes[0]); i++) {
        write_text("model.safetensors.index.json", bad_indexes[i]);
        st = NULL;
        if (tdm_st_open(tmpdir, &st) == TDM_OK) fail_msg("index %zu accepted", i);
        assert_null(st);
    }
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"x\": \"s1.safetensors\", \"y\": \"../s2.safetensors\"}}");
    assert_int_equal(tdm_st_open(tmpdir, &st), TDM_EFORMAT);
    assert_non_null(strstr(tdm_err_msg(), "../s2.safetensors"));

    /* a name in two shards */
    size_t len;
    float v[2] = {0};
    uint8_t *img = make_image(
        "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}}", v, 8, &len);
    write_file("s2.safetensors", img, len);
    free(img);
    write_text("model.safetensors.index.json",
               "{\"weight_map\": {\"x\": \"s1.safetensors\", \"q\": \"s2.safetensors\"}}");
    assert_int_equal(tdm_st_open(tmpdir, &st), TDM_EFORMAT);
    assert_non_null(strstr(tdm_err_msg(), "\"x\""));
    remove_file("model.safetensors.index.json");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),         cmocka_unit_test(test_other_dtypes),
        cmocka_unit_test(test_malformed),     cmocka_unit_test(test_specific_errors),
        cmocka_unit_test(test_folder_single), cmocka_unit_test(test_folder_sharded),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
