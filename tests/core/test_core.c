/* Unit tests for the core module: Philox known-answer vectors, the RNG's keying, the thread
 * pool's coverage and determinism, range splitting, the arena, number parsing and float
 * conversions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/core.h"

/* Known-answer vectors published with Random123 (kat_vectors, philox4x32 10 rounds). */
static void test_philox_kat(void **state)
{
    (void)state;
    static const struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
         {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint32_t out[4];
        tdm_philox4x32(kat[i].ctr, kat[i].key, out);
        assert_memory_equal(out, kat[i].out, sizeof out);
    }
}

static void test_rng_keying(void **state)
{
    (void)state;
    double a = tdm_rng_uniform(7, 3, 100, 0);
    assert_true(a >= 0.0 && a < 1.0);
    assert_true(a == tdm_rng_uniform(7, 3, 100, 0)); /* a pure function of its key */
    assert_true(a != tdm_rng_uniform(8, 3, 100, 0));
    assert_true(a != tdm_rng_uniform(7, 4, 100, 0));
    assert_true(a != tdm_rng_uniform(7, 3, 101, 0));
    assert_true(a != tdm_rng_uniform(7, 3, 100, 1));
    /* mean of many draws near 1/2 */
    double sum = 0;
    for (uint32_t p = 0; p < 20000; p++)
        sum += tdm_rng_uniform(1, 2, p, 0);
    assert_true(fabs(sum / 20000 - 0.5) < 0.01);
}

struct pool_ctx {
    int64_t n;
    int *hits;
    int *who;
    pthread_t caller;
    int on_caller[4]; /* shares run on the calling thread, by ith */
};

static void pool_fill(void *p, int ith, int nth)
{
    struct pool_ctx *c = p;
    int64_t b, e;
    tdm_split_range(c->n, ith, nth, 8, &b, &e);
    for (int64_t i = b; i < e; i++) {
        c->hits[i]++;
        c->who[i] = ith;
    }
    if (pthread_equal(pthread_self(), c->caller) && ith < 4) c->on_caller[ith]++;
}

static void test_pool(void **state)
{
    (void)state;
    /* the default spin, none (a worker sleeps as soon as it is idle: every job wakes it), and
     * a short one; the suite's environment sets its own, restored after */
    const char *env = getenv("TANDEM_POOL_SPIN_US");
    char *saved = env ? strdup(env) : NULL;
    const char *spins[] = {NULL, "0", "20"};
    for (int sp = 0; sp < 3; sp++) {
        if (spins[sp])
            setenv("TANDEM_POOL_SPIN_US", spins[sp], 1);
        else
            unsetenv("TANDEM_POOL_SPIN_US");
        for (int nt = 1; nt <= 4; nt++) {
            tdm_pool_t *pool;
            assert_int_equal(tdm_pool_create(nt, &pool), TDM_OK);
            assert_int_equal(tdm_pool_size(pool), nt);
            enum { N = 1001 };
            int hits[N], who[N], who0[N];
            struct pool_ctx c = {N, hits, who, pthread_self(), {0}};
            for (int rep = 0; rep < 200; rep++) {
                memset(hits, 0, sizeof hits);
                tdm_pool_run(pool, pool_fill, &c);
                for (int i = 0; i < N; i++)
                    assert_int_equal(hits[i], 1);
                if (rep == 0)
                    memcpy(who0, who, sizeof who);
                else
                    assert_memory_equal(who, who0, sizeof who); /* same split every time */
                if (rep == 100) usleep(2000); /* let workers fall asleep, then wake them */
            }
            assert_int_equal(c.on_caller[0], 200); /* share 0 is always the caller's */
            /* a worker that sleeps as soon as it is idle is woken by every job, and the caller,
             * done with its tiny share long before, runs the worker's share itself: each share
             * still once (the hits above), the same split (who) */
            if (spins[sp] && !strcmp(spins[sp], "0") && nt > 1) assert_true(c.on_caller[1] > 0);
            tdm_pool_destroy(pool);
        }
    }
    /* a malformed or out-of-range spin is refused, not read as some other number */
    const char *bad[] = {"-1", "100001", "x", "20us", "1e3"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        setenv("TANDEM_POOL_SPIN_US", bad[i], 1);
        tdm_pool_t *pool = NULL;
        assert_int_equal(tdm_pool_create(2, &pool), TDM_EINVAL);
        assert_null(pool);
    }
    if (saved)
        setenv("TANDEM_POOL_SPIN_US", saved, 1);
    else
        unsetenv("TANDEM_POOL_SPIN_US");
    free(saved);
    tdm_pool_destroy(NULL);
}

static void test_split_range(void **state)
{
    (void)state;
    for (int64_t n = 0; n < 70; n++)
        for (int nth = 1; nth <= 5; nth++) {
            int64_t prev = 0;
            for (int i = 0; i < nth; i++) {
                int64_t b, e;
                tdm_split_range(n, i, nth, 4, &b, &e);
                assert_true(b == prev && e >= b);
                if (e < n) assert_int_equal(e % 4, 0);
                prev = e;
            }
            assert_int_equal(prev, n);
        }
}

static void test_arena(void **state)
{
    (void)state;
    struct tdm_arena a;
    assert_int_equal(tdm_arena_init(&a, 1024), TDM_OK);
    void *p = tdm_arena_alloc(&a, 100);
    void *q = tdm_arena_alloc(&a, 100);
    assert_non_null(p);
    assert_non_null(q);
    assert_int_equal((uintptr_t)q % 64, 0);
    assert_true((char *)q >= (char *)p + 100);
    assert_null(tdm_arena_alloc(&a, 2000)); /* over capacity: NULL and a message */
    assert_true(strstr(tdm_err_msg(), "arena") != NULL);
    tdm_arena_reset(&a);
    assert_ptr_equal(tdm_arena_alloc(&a, 10), p);
    assert_true(a.high_water_bytes >= 200);
    tdm_arena_free(&a);
    tdm_arena_free(&a);
}

static void test_parse(void **state)
{
    (void)state;
    int64_t v;
    double d;
    assert_true(tdm_parse_i64("42", 0, 100, &v) && v == 42);
    assert_false(tdm_parse_i64("101", 0, 100, &v));
    assert_false(tdm_parse_i64("4x", 0, 100, &v));
    assert_false(tdm_parse_i64("", 0, 100, &v));
    assert_false(tdm_parse_i64("99999999999999999999999", INT64_MIN, INT64_MAX, &v));
    assert_true(tdm_parse_f64("0.5", &d) && d == 0.5);
    assert_false(tdm_parse_f64("nan", &d));
    assert_false(tdm_parse_f64("1e999", &d));
    assert_false(tdm_parse_f64("1.0abc", &d));
}

static void test_float_formats(void **state)
{
    (void)state;
    /* bf16/f16 of exactly representable values round-trip; known encodings */
    assert_int_equal(tdm_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(tdm_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(tdm_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(tdm_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(tdm_f32_to_f16(1e6f), 0x7c00);
    assert_true(tdm_f16_to_f32(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
    assert_true(tdm_f16_to_f32(0x3555) == 0.333251953125f);
    assert_true(isinf(tdm_f16_to_f32(0x7c00)));
    assert_true(isnan(tdm_f16_to_f32(0x7e00)));
    /* round to nearest even: 1 + 2^-8 is halfway between two bf16 values -> even (1.0) */
    assert_int_equal(tdm_f32_to_bf16(1.00390625f), 0x3f80);
    assert_int_equal(tdm_f32_to_bf16(1.01171875f), 0x3f82);
    for (uint32_t h = 0; h < 0x7c00; h++) /* every finite positive f16 round-trips */
        assert_int_equal(tdm_f32_to_f16(tdm_f16_to_f32((uint16_t)h)), h);
}

static void test_status(void **state)
{
    (void)state;
    assert_string_equal(tdm_status_str(TDM_OK), "ok");
    assert_string_equal(tdm_status_str(TDM_EAGAIN), "try again");
    assert_int_equal(tdm_err_set(TDM_EFORMAT, "bad %d", 7), TDM_EFORMAT);
    assert_string_equal(tdm_err_msg(), "bad 7");
}

static void test_file_read_cap(void **state)
{
    (void)state;
    char path[] = "/tmp/tdm_core_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    char buf[10000];
    memset(buf, 'a', sizeof buf);
    assert_int_equal(write(fd, buf, sizeof buf), (ssize_t)sizeof buf);
    close(fd);
    char *out;
    size_t len;
    assert_int_equal(tdm_file_read(path, 100, &out, &len), TDM_ERANGE);
    assert_int_equal(tdm_file_read(path, 1 << 20, &out, &len), TDM_OK);
    assert_int_equal(len, sizeof buf);
    free(out);
    struct tdm_mmap m;
    assert_int_equal(tdm_mmap_open(path, &m), TDM_OK);
    assert_int_equal(m.size, sizeof buf);
    tdm_mmap_close(&m);
    unlink(path);
    assert_int_equal(tdm_mmap_open(path, &m), TDM_EIO);
}

/* tdm_deadline_ms: now on the given clock plus the delay, normalised. */
static void test_deadline(void **state)
{
    (void)state;
    clockid_t clocks[] = {CLOCK_REALTIME, CLOCK_MONOTONIC};
    int64_t delays[] = {0, 1, 999, 1000, 1500, 61999, -5};
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 7; i++) {
            struct timespec before, after;
            clock_gettime(clocks[c], &before);
            struct timespec d = tdm_deadline_ms(clocks[c], delays[i]);
            clock_gettime(clocks[c], &after);
            assert_true(d.tv_nsec >= 0 && d.tv_nsec < 1000000000L);
            int64_t want = delays[i] < 0 ? 0 : delays[i] * 1000000;
            int64_t lo = (int64_t)(before.tv_sec * 1000000000LL + before.tv_nsec) + want;
            int64_t hi = (int64_t)(after.tv_sec * 1000000000LL + after.tv_nsec) + want;
            int64_t got = (int64_t)(d.tv_sec * 1000000000LL + d.tv_nsec);
            assert_true(got >= lo && got <= hi);
        }
}

/* tdm_dl_load: a library and its symbols (one at a version), a missing library and a missing
 * symbol each refused with its reason. libm is in every process's search path. */
static void test_dl_load(void **state)
{
    (void)state;
    double (*cos_fn)(double) = NULL, (*sqrt_fn)(double) = NULL;
    char why[256] = "";
#if defined(__x86_64__)
    const char *sqrt_ver = "GLIBC_2.2.5"; /* glibc's first version on x86-64 */
#else
    const char *sqrt_ver = NULL;
#endif
    const struct tdm_dl_sym ok[] = {{"cos", NULL, &cos_fn}, {"sqrt", sqrt_ver, &sqrt_fn}};
    assert_true(tdm_dl_load("libm.so.6", NULL, ok, 2, why, sizeof why));
    assert_non_null(cos_fn);
    assert_non_null(sqrt_fn);
    assert_true(cos_fn(0.0) == 1.0 && sqrt_fn(9.0) == 3.0);

    void (*none)(void) = NULL;
    const struct tdm_dl_sym missing[] = {{"tdm_no_such_symbol", NULL, &none}};
    assert_false(tdm_dl_load("libm.so.6", NULL, missing, 1, why, sizeof why));
    assert_non_null(strstr(why, "libm.so.6 has no tdm_no_such_symbol"));
    assert_null(none);
    const struct tdm_dl_sym badver[] = {{"cos", "NO_SUCH_VERSION", &none}};
    assert_false(tdm_dl_load("libm.so.6", NULL, badver, 1, why, sizeof why));
    assert_non_null(strstr(why, "has no cos at version NO_SUCH_VERSION"));

    assert_false(
        tdm_dl_load("libtdm-no-such-library.so.9", "/nonexistent", ok, 2, why, sizeof why));
    assert_non_null(strstr(why, "libtdm-no-such-library.so.9"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_kat),  cmocka_unit_test(test_rng_keying),
        cmocka_unit_test(test_deadline),    cmocka_unit_test(test_pool),
        cmocka_unit_test(test_split_range), cmocka_unit_test(test_arena),
        cmocka_unit_test(test_parse),       cmocka_unit_test(test_float_formats),
        cmocka_unit_test(test_status),      cmocka_unit_test(test_file_read_cap),
        cmocka_unit_test(test_dl_load),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
