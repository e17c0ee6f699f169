/*
 * The HTTP/1.1 client's response parser (src/server/httpc.c, through tdm_bh_parser_*): the
 * router reads backends' responses with it, so every byte it sees is a peer's. Each valid
 * response is fed whole and then cut at every byte, and must give the same head and body, the
 * body written out here by hand (chunked coding removed); each malformed one must fail with
 * TDM_BH_PROTOCOL however it is cut, and a close in the wrong place with TDM_BH_TRUNCATED.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/httpc.h"

struct sink {
    int heads, status;
    char ctype[64];
    char body[4096];
    size_t n;
    bool stop_at_head;
};

static bool on_head(void *ctx, int status, const char *ctype)
{
    struct sink *s = ctx;
    s->heads++;
    s->status = status;
    snprintf(s->ctype, sizeof s->ctype, "%s", ctype);
    return !s->stop_at_head;
}

static bool on_body(void *ctx, const char *data, size_t n)
{
    struct sink *s = ctx;
    assert_true(s->n + n <= sizeof s->body);
    memcpy(s->body + s->n, data, n);
    s->n += n;
    return true;
}

/* Feeds text cut at `cut` (0: whole), then a close when `close` is set. Returns the first
 * failure, or what the close says, or TDM_BH_OK. *done: complete afterwards. */
static enum tdm_bh_fail parse(const char *text, size_t len, size_t cut, bool close, struct sink *s,
                              bool *done, int64_t *clen)
{
    struct tdm_bh_handler h = {on_head, on_body, s};
    tdm_bh_parser_t *p = tdm_bh_parser_new(&h);
    assert_non_null(p);
    enum tdm_bh_fail f = TDM_BH_OK;
    if (cut && cut < len) {
        f = tdm_bh_parser_feed(p, text, cut);
        if (!f) f = tdm_bh_parser_feed(p, text + cut, len - cut);
    } else {
        f = tdm_bh_parser_feed(p, text, len);
    }
    if (!f && close) f = tdm_bh_parser_close(p);
    *done = tdm_bh_parser_done(p);
    *clen = tdm_bh_parser_content_length(p);
    if (s->heads) assert_int_equal(tdm_bh_parser_status(p), s->status);
    tdm_bh_parser_free(p);
    return f;
}

/* A valid response: the same status, type and body however it is cut, byte by byte too. */
static void expect_ok(const char *text, bool close, int status, const char *ctype, const char *body,
                      int64_t clen)
{
    const size_t len = strlen(text);
    for (size_t cut = 0; cut < len; cut++) {
        struct sink s = {0};
        bool done;
        int64_t cl;
        enum tdm_bh_fail f = parse(text, len, cut, close, &s, &done, &cl);
        if (f != TDM_BH_OK) fail_msg("cut at %zu: %s", cut, tdm_bh_fail_str(f));
        assert_true(done);
        assert_int_equal(s.heads, 1);
        assert_int_equal(s.status, status);
        assert_string_equal(s.ctype, ctype);
        assert_int_equal(s.n, strlen(body));
        assert_memory_equal(s.body, body, s.n);
        assert_int_equal(cl, clen);
    }
    /* one byte at a time */
    struct sink s = {0};
    struct tdm_bh_handler h = {on_head, on_body, &s};
    tdm_bh_parser_t *p = tdm_bh_parser_new(&h);
    for (size_t i = 0; i < len; i++)
        assert_int_equal(tdm_bh_parser_feed(p, text + i, 1), TDM_BH_OK);
    if (close) assert_int_equal(tdm_bh_parser_close(p), TDM_BH_OK);
    assert_true(tdm_bh_parser_done(p));
    assert_int_equal(s.n, strlen(body));
    assert_memory_equal(s.body, body, s.n);
    tdm_bh_parser_free(p);
}

/* A response that must fail with `want`, however it is cut. */
static void expect_fail(const char *text, size_t len, bool close, enum tdm_bh_fail want)
{
    for (size_t cut = 0; cut < len; cut++) {
        struct sink s = {0};
        bool done;
        int64_t cl;
        enum tdm_bh_fail f = parse(text, len, cut, close, &s, &done, &cl);
        if (f != want)
            fail_msg("cut at %zu: %s, not %s", cut, tdm_bh_fail_str(f), tdm_bh_fail_str(want));
    }
}

static void test_content_length(void **state)
{
    (void)state;
    expect_ok("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n"
              "{\"a\": true}",
              false, 200, "application/json", "{\"a\": true}", 11);
    /* bytes past the end are not the body */
    expect_ok("HTTP/1.1 404 Not Found\r\ncontent-length:  3 \r\n\r\nabcEXTRA", false, 404, "",
              "abc", 3);
    expect_ok("HTTP/1.0 204 No Content\r\nContent-Length: 0\r\n\r\n", false, 204, "", "", 0);
    /* the same length twice is one length */
    expect_ok("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok", false, 200, "",
              "ok", 2);
}

static void test_chunked(void **state)
{
    (void)state;
    expect_ok("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream"
              "\r\n\r\n5\r\ndata:\r\n19;ext=1\r\n {\"x\":1}\n\nmore bytes here\r\n0\r\n"
              "Trailer: x\r\n\r\n",
              false, 200, "text/event-stream", "data: {\"x\":1}\n\nmore bytes here", -1);
    /* upper-case hex, a size line with spaces before the end */
    expect_ok("HTTP/1.1 200 OK\r\ntransfer-encoding: CHUNKED\r\n\r\nA  \r\n0123456789\r\n0\r\n\r\n",
              false, 200, "", "0123456789", -1);
}

static void test_informational_then_final(void **state)
{
    (void)state;
    expect_ok("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
              "HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\ndone",
              false, 201, "", "done", 4);
}

static void test_body_to_the_close(void **state)
{
    (void)state;
    expect_ok("HTTP/1.1 200 OK\r\n\r\nuntil the peer closes", true, 200, "",
              "until the peer closes", -1);
    /* not complete before the close */
    struct sink s = {0};
    bool done;
    int64_t cl;
    const char *t = "HTTP/1.1 200 OK\r\n\r\nabc";
    assert_int_equal(parse(t, strlen(t), 0, false, &s, &done, &cl), TDM_BH_OK);
    assert_false(done);
}

static void test_malformed(void **state)
{
    (void)state;
    const char *bad[] = {
        "HTTP/2 200 OK\r\n\r\n",
        "HTTP/1.1 20 OK\r\n\r\n",
        "HTTP/1.1 600 Nope\r\n\r\n",
        "HTTP/1.1 2x0 OK\r\n\r\n",
        "HTTP/1.1 200OK\r\n\r\n",
        "ICY 200 OK\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 1e3\r\n\r\n",
        "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1000000000000000\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3 x\r\nabc\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        expect_fail(bad[i], strlen(bad[i]), false, TDM_BH_PROTOCOL);
    /* a NUL inside the head */
    static const char nul[] = "HTTP/1.1 200 OK\r\nX: a\0b\r\n\r\n";
    expect_fail(nul, sizeof nul - 1, false, TDM_BH_PROTOCOL);
    /* a head over 64 KiB, and a chunk line over 4 KiB */
    size_t big = TDM_BH_MAX_HEAD_BYTES + 100;
    char *t = malloc(big + 1);
    assert_non_null(t);
    memcpy(t, "HTTP/1.1 200 OK\r\nX: ", 20);
    memset(t + 20, 'a', big - 20);
    t[big] = '\0';
    struct sink s = {0};
    bool done;
    int64_t cl;
    assert_int_equal(parse(t, big, 0, false, &s, &done, &cl), TDM_BH_PROTOCOL);
    assert_int_equal(parse(t, big, 7000, false, &s, &done, &cl), TDM_BH_PROTOCOL);
    const char *ch = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;";
    size_t n0 = strlen(ch);
    memcpy(t, ch, n0);
    memset(t + n0, 'e', 5000);
    assert_int_equal(parse(t, n0 + 5000, 0, false, &s, &done, &cl), TDM_BH_PROTOCOL);
    free(t);
}

static void test_truncated(void **state)
{
    (void)state;
    const char *cut[] = {
        "",
        "HTTP/1.1 200 OK\r\nContent-Le",
        "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n",
        "HTTP/1.1 100 Continue\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof cut / sizeof *cut; i++) {
        struct sink s = {0};
        bool done;
        int64_t cl;
        assert_int_equal(parse(cut[i], strlen(cut[i]), 0, true, &s, &done, &cl), TDM_BH_TRUNCATED);
        assert_false(done);
    }
}

static void test_handler_stops(void **state)
{
    (void)state;
    const char *t = "HTTP/1.1 503 Busy\r\nContent-Length: 3\r\n\r\nabc";
    struct sink s = {.stop_at_head = true};
    bool done;
    int64_t cl;
    assert_int_equal(parse(t, strlen(t), 0, false, &s, &done, &cl), TDM_BH_ABORTED);
    assert_int_equal(s.heads, 1);
    assert_int_equal(s.n, 0);
    /* without a handler the body is dropped, and the response still completes */
    tdm_bh_parser_t *p = tdm_bh_parser_new(NULL);
    assert_int_equal(tdm_bh_parser_feed(p, t, strlen(t)), TDM_BH_OK);
    assert_true(tdm_bh_parser_done(p));
    assert_int_equal(tdm_bh_parser_status(p), 503);
    tdm_bh_parser_free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_content_length),
        cmocka_unit_test(test_chunked),
        cmocka_unit_test(test_informational_then_final),
        cmocka_unit_test(test_body_to_the_close),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_handler_stops),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
