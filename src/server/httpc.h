/*
 * A small HTTP/1.1 client (private to tandem: the router and `tandem bench serve` use it).
 *
 * What: one request per TCP connection (`Connection: close`), blocking calls over a non-blocking
 * socket driven by poll(), so that every step (connect, send, each read) honours a deadline. The
 * response head is parsed here; the body is handed over de-framed (Content-Length, chunked, or
 * read-to-close) in whatever pieces the socket delivers, so that a streaming (SSE) response is
 * seen as it arrives and is never buffered whole.
 *
 * Two ways to drive a request:
 *   - push: tdm_bh_request() runs it to the end under one absolute deadline and calls a handler
 *     with the head and each body piece (the load generator: exact arrival times);
 *   - pull: tdm_bh_open() connects and sends, then the caller waits for the head
 *     (tdm_bh_wait_head) and reads body pieces (tdm_bh_read), each call under its own deadline,
 *     and may give up at any point with tdm_bh_close(), which closes the socket: the peer sees
 *     the connection go away (the router: it forwards pieces to its own client as they come and
 *     drops the backend connection when that client leaves).
 *
 * Why this shape: a proxy and a load generator both need to see stream pieces as they arrive, to
 * bound every wait, and to know precisely what went wrong (refused, timed out, cut short,
 * malformed), and nothing more: no redirects, no keep-alive. A fresh connection per request
 * costs a loopback connect (tens of microseconds), plus a handshake over https.
 *
 * TLS (https:// targets): GnuTLS over the same non-blocking socket, every handshake and record
 * step under the same deadlines. The server's certificate is always verified, against the CA
 * file given to tdm_bh_target_init or the system's trust store, and against the URL's host
 * (a name, or an IP address literal matched against the certificate's IP addresses); a failure
 * is TDM_BH_CONNECT with GnuTLS's reason. The server name is sent (SNI) for names, not for IP
 * literals.
 *
 * Threading: tdm_bh_request() keeps all its state on the caller's stack and heap; a tdm_bh_conn_t
 * belongs to one thread at a time. Any number of threads may run requests at once against one
 * (read-only) struct tdm_bh_target.
 *
 * Caps: the response head is at most TDM_BH_MAX_HEAD_BYTES; chunk-size and trailer lines at most
 * 4 KiB; the body itself is not capped here (the caller decides).
 */
#ifndef TANDEM_SERVER_HTTPC_H
#define TANDEM_SERVER_HTTPC_H

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
    bool tls;        /* https:// */
    void *tls_creds; /* GnuTLS credentials (the trusted CAs), shared by every connection */
};

/* Parses and resolves `url` (http:// or https://). ca_file: PEM CA certificates to trust for
 * https (NULL: the system's store); ignored for http. Free with tdm_bh_target_free. */
tdm_status tdm_bh_target_init(const char *url, const char *ca_file, struct tdm_bh_target *out);
/* Frees what tdm_bh_target_init allocated (TLS credentials); no request may be running. A
 * zeroed target is fine. */
void tdm_bh_target_free(struct tdm_bh_target *t);

/* Why a request did not complete. */
enum tdm_bh_fail {
    TDM_BH_OK = 0,
    TDM_BH_CONNECT,   /* refused, unreachable, connect timed out */
    TDM_BH_TIMEOUT,   /* the deadline passed after connecting */
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
    uint64_t deadline_ns;        /* absolute, on tdm_now_ns()'s clock (pull: connect and send) */
    uint64_t connect_timeout_ms; /* also bounded by deadline_ns */
};

/* Runs one request to completion. Borrows everything it is given. On failure the reason is also
 * in tdm_err_msg() on this thread. */
enum tdm_bh_fail tdm_bh_request(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                                const struct tdm_bh_handler *h);

/* ---- pull mode ---- */

typedef struct tdm_bh_conn tdm_bh_conn_t;

/* Connects and sends the whole request, within rq->connect_timeout_ms and rq->deadline_ns.
 * Borrows t and rq for the call only. On success the caller owns *out (tdm_bh_close). */
enum tdm_bh_fail tdm_bh_open(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                             tdm_bh_conn_t **out);
/* Waits until the final response head is in, or deadline_ns passes: TDM_BH_TIMEOUT then leaves
 * the connection usable (call again with a later deadline). Any other failure is final. */
enum tdm_bh_fail tdm_bh_wait_head(tdm_bh_conn_t *c, uint64_t deadline_ns);
/* The head's status, Content-Type ("" when absent) and Content-Length (-1: none, the body is
 * chunked or runs to the close). Valid once tdm_bh_wait_head has returned TDM_BH_OK. */
int tdm_bh_status(const tdm_bh_conn_t *c);
const char *tdm_bh_content_type(const tdm_bh_conn_t *c);
int64_t tdm_bh_content_length(const tdm_bh_conn_t *c);
/* Up to cap body bytes into buf, after the head. Returns TDM_BH_OK with *n > 0 for data, with
 * *n == 0 at the end of the body; TDM_BH_TIMEOUT (usable, as above) when nothing came before
 * deadline_ns (a deadline in the past takes only what is already there). */
enum tdm_bh_fail tdm_bh_read(tdm_bh_conn_t *c, char *buf, size_t cap, uint64_t deadline_ns,
                             size_t *n);
/* The socket, for the caller to poll (with POLLIN) alongside other descriptors. Poll it only
 * after tdm_bh_read has returned TDM_BH_TIMEOUT: until then the connection may hold bytes it has
 * already received. */
int tdm_bh_fd(const tdm_bh_conn_t *c);
/* Closes the socket and frees. NULL is a no-op. */
void tdm_bh_close(tdm_bh_conn_t *c);

/* ---- the response parser alone ----
 * The state machine above, fed by the caller instead of a socket: for tests and the fuzz target
 * (tests/fuzz/fuzz_httpc.c). One response per parser; one thread drives it. */

typedef struct tdm_bh_parser tdm_bh_parser_t;

/* A parser whose head and body go to h (borrowed; NULL: dropped). NULL when out of memory. */
tdm_bh_parser_t *tdm_bh_parser_new(const struct tdm_bh_handler *h);
/* Feeds n bytes, in pieces of any size. TDM_BH_PROTOCOL (the reason in tdm_err_msg()) on bytes
 * no valid response holds, TDM_BH_ABORTED when h stopped it; bytes past the response's end are
 * ignored. After a failure the parser is done with. */
enum tdm_bh_fail tdm_bh_parser_feed(tdm_bh_parser_t *p, const char *data, size_t n);
/* The peer closed: TDM_BH_OK when that ends the response (complete, or a body read to the
 * close), TDM_BH_TRUNCATED when it cuts the head or a body of known end. */
enum tdm_bh_fail tdm_bh_parser_close(tdm_bh_parser_t *p);
/* Whether the response is complete. */
bool tdm_bh_parser_done(const tdm_bh_parser_t *p);
/* The final head's status (0 before it) and Content-Length (-1: chunked, to the close, or no
 * head yet). */
int tdm_bh_parser_status(const tdm_bh_parser_t *p);
int64_t tdm_bh_parser_content_length(const tdm_bh_parser_t *p);
/* NULL is a no-op. */
void tdm_bh_parser_free(tdm_bh_parser_t *p);

#endif
