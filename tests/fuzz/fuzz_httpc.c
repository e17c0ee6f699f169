/*
 * libFuzzer target for the HTTP/1.1 client's response parser (src/server/httpc.c, through
 * tdm_bh_parser_*): the router reads backends' responses with it, `tandem bench serve` a
 * server's. The input's first byte picks a piece size; the rest is one response, fed whole and
 * fed in pieces of that size, each followed by a close. Both feeds must agree on everything
 * (the verdict, completeness, status, Content-Length and every body byte), a complete response
 * with a Content-Length must have exactly that many body bytes, and the body can never hold more
 * bytes than were fed. Anything else, or a crash, leak or out-of-bounds access, is a finding.
 *
 * Seed corpus: tests/fuzz/corpus/httpc/ (Content-Length, chunked with a trailer, 1xx before
 * the final head, a body to the close).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/httpc.h"

struct sink {
    char *body;
    size_t n, cap;
    int heads, status;
};

static bool on_head(void *ctx, int status, const char *ctype)
{
    struct sink *s = ctx;
    if (strlen(ctype) > 255) abort();
    s->heads++;
    s->status = status;
    return true;
}

static bool on_body(void *ctx, const char *data, size_t n)
{
    struct sink *s = ctx;
    if (n > s->cap - s->n) abort(); /* more body than input */
    memcpy(s->body + s->n, data, n);
    s->n += n;
    return true;
}

struct outcome {
    enum tdm_bh_fail f;
    bool done;
    int status;
    int64_t clen;
};

static struct outcome run(const char *p, size_t n, size_t piece, struct sink *s)
{
    struct tdm_bh_handler h = {on_head, on_body, s};
    tdm_bh_parser_t *ps = tdm_bh_parser_new(&h);
    struct outcome o = {TDM_BH_NOMEM, false, 0, -1};
    if (!ps) return o;
    o.f = TDM_BH_OK;
    for (size_t at = 0; at < n && !o.f; at += piece)
        o.f = tdm_bh_parser_feed(ps, p + at, n - at < piece ? n - at : piece);
    if (!o.f) o.f = tdm_bh_parser_close(ps);
    o.done = tdm_bh_parser_done(ps);
    o.status = tdm_bh_parser_status(ps);
    o.clen = tdm_bh_parser_content_length(ps);
    if (s->heads > 1) abort(); /* one final head */
    if (s->heads && s->status != o.status) abort();
    if (o.status && (o.status < 200 || o.status > 599)) abort();
    if (!o.f && o.clen >= 0 && (uint64_t)o.clen != s->n) abort();
    tdm_bh_parser_free(ps);
    return o;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const size_t piece = (size_t)data[0] % 64 + 1;
    const char *p = (const char *)data + 1;
    const size_t n = size - 1;
    struct sink a = {malloc(n + 1), 0, n, 0, 0}, b = {malloc(n + 1), 0, n, 0, 0};
    if (!a.body || !b.body) {
        free(a.body);
        free(b.body);
        return 0;
    }
    struct outcome whole = run(p, n, n ? n : 1, &a), cut = run(p, n, piece, &b);
    if (whole.f != TDM_BH_NOMEM && cut.f != TDM_BH_NOMEM &&
        (whole.f != cut.f || whole.done != cut.done || whole.status != cut.status ||
         whole.clen != cut.clen || a.n != b.n || memcmp(a.body, b.body, a.n)))
        abort();
    free(a.body);
    free(b.body);
    return 0;
}
