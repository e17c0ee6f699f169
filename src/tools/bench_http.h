/*
 * A small HTTP/1.1 client for `tandem bench serve` (private to src/tools/).
 *
 * What: one request per TCP connection (`Connection: close`), blocking calls over a non-blocking
 * socket driven by poll(), so that every step (connect, send, each read) honours one absolute
 * deadline. The response head is parsed here; the body is handed to the caller de-framed
 * (Content-Length, chunked, or read-to-close) in whatever pieces the socket delivers, so that a
 * streaming (SSE) response is seen as it arrives and is never buffered whole.
 *
 * Why this shape: the load generator needs exact arrival times of stream pieces and a precise
 * classification of what went wrong (refused, timed out, cut short, malformed), and nothing more:
 * no TLS, no redirects, no keep-alive. A fresh connection per request costs a loopback connect
 * (tens of microseconds), far below the latencies being measured.
 *
 * Threading: tdm_bh_request() keeps all its state on the caller's stack and heap; any number of
 * threads may run requests at once against one (read-only) struct tdm_bh_target.
 *
 * Caps: the response head is at most TDM_BH_MAX_HEAD_BYTES; chunk-size and trailer lines at most
 * 4 KiB; the body itself is not capped here (the caller's callback decides).
 */
#ifndef TANDEM_TOOLS_BENCH_HTTP_H
#define TANDEM_TOOLS_BENCH_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "tandem/core.h"

#define TDM_BH_MAX_HEAD_BYTES (64 * 1024)

/* Where requests go: http://host[:port][/base/path]. Resolved once, at parse time. */
struct tdm_bh_target {
    char host[256];
    char port[8];
    char base_path[1024]; /* "" or "/prefix" without a trailing slash */
    struct sockaddr_storage addr;
    socklen_t addr_len;
};

/* Parses and resolves `url`. https:// is refused (no TLS here). */
tdm_status tdm_bh_target_init(const char *url, struct tdm_bh_target *out);

/* Why a request did not complete. */
enum tdm_bh_fail {
    TDM_BH_OK = 0,
    TDM_BH_CONNECT,   /* refused, unreachable, connect timed out */
    TDM_BH_TIMEOUT,   /* the request's deadline passed after connecting */
    TDM_BH_SEND,      /* the peer went away while the request was being sent */
    TDM_BH_TRUNCATED, /* the peer closed or reset before the response was complete */
    TDM_BH_PROTOCOL,  /* the response does not follow HTTP/1.x */
    TDM_BH_ABORTED,   /* a callback returned false */
    TDM_BH_NOMEM,
};
const char *tdm_bh_fail_str(enum tdm_bh_fail f); /* "connect", "timeout", ... */

struct tdm_bh_handler {
    /* Called once, for the final (non-1xx) response; content_type is "" when absent.
     * Return false to stop reading (the request then ends with TDM_BH_ABORTED). */
    bool (*on_head)(void *ctx, int status, const char *content_type);
    /* Body bytes as they arrive, transfer coding removed. Return false to stop reading. */
    bool (*on_body)(void *ctx, const char *data, size_t n);
    void *ctx;
};

struct tdm_bh_request {
    const char *method; /* "GET", "POST" */
    const char *path;   /* appended to the target's base path, e.g. "/v1/completions" */
    const char *bearer; /* API key for "Authorization: Bearer"; NULL for none */
    const char *body;   /* NULL for none; sent as application/json */
    size_t body_len;
    uint64_t deadline_ns;        /* absolute, on tdm_now_ns()'s clock */
    uint64_t connect_timeout_ms; /* also bounded by deadline_ns */
};

/* Runs one request to completion. Borrows everything it is given. On failure the reason is also
 * in tdm_err_msg() on this thread. */
enum tdm_bh_fail tdm_bh_request(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                                const struct tdm_bh_handler *h);

#endif
