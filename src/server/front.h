/*
 * The HTTP front that the server (http.c) and the router (router.c) share: listening with
 * libmicrohttpd (see tdm_front_start), the request body as it accumulates under a hard cap,
 * the bearer-key check, and whether a connection's client is still there.
 *
 * Ownership: a connection's body belongs to libmicrohttpd's per-connection pointer from the
 * first call of the access handler until tdm_front_completed frees it, with the owner's own
 * per-request state (app, freed by app_free). Threading: tdm_front_feed, tdm_front_bearer_ok
 * and tdm_front_client_gone run on whichever thread serves the connection; tdm_front_start
 * and tdm_front_stop on the owner's; the sweeper on its own.
 */
#ifndef TANDEM_SERVER_FRONT_H
#define TANDEM_SERVER_FRONT_H

#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>

#include "tandem/core.h"

struct tdm_front_body {
    char *body; /* NUL-terminated; NULL while empty */
    size_t len, cap;
    bool too_big;
    bool started;                /* the access handler has seen it */
    const char *raw_uri;         /* the request target as it came (libmicrohttpd's memory) */
    size_t raw_len;              /* its length up to the first NUL */
    void *app;                   /* the owner's per-request state */
    void (*app_free)(void *app); /* called when the request ends */
};

enum tdm_front_step {
    TDM_FRONT_MORE,    /* return MHD_YES: more of the body (or the first call) */
    TDM_FRONT_DONE,    /* the whole body is in *body: answer now */
    TDM_FRONT_TOO_BIG, /* over max_body (Content-Length said so, or the bytes did): answer 413 */
    TDM_FRONT_OOM,     /* return MHD_NO */
};
/* Feeds one access-handler call; *body is set for DONE and TOO_BIG. A body over max_body is
 * dropped as it arrives, so memory never passes the cap. */
enum tdm_front_step tdm_front_feed(struct MHD_Connection *c, void **con_cls, const char *upload,
                                   size_t *upload_size, size_t max_body,
                                   struct tdm_front_body **body);
/* libmicrohttpd's request-completed callback: frees the connection's body. */
void tdm_front_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe);
/* Authorization: Bearer <key>, compared in time independent of where it differs. A NULL key
 * lets everyone in. */
bool tdm_front_bearer_ok(struct MHD_Connection *c, const char *key);
/* CORS, by cfg.allowed_origins. tdm_front_cors adds Access-Control-Allow-Origin (the request's
 * Origin when it is one of the list, "*" when the list is "*") and Vary: Origin to a response;
 * nothing when the request has no Origin or another one. tdm_front_preflight: the request is a
 * preflight (OPTIONS with Origin and Access-Control-Request-Method) from an allowed origin;
 * *allow_headers is then what to answer in Access-Control-Allow-Headers (the requested header
 * names when they are plain names, else a fixed list). */
void tdm_front_cors(struct MHD_Connection *c, struct MHD_Response *r);
bool tdm_front_preflight(struct MHD_Connection *c, const char *method, const char **allow_headers);
/* The client hung up (or its socket errs). */
bool tdm_front_client_gone(struct MHD_Connection *c);
/* The connection's socket, or -1. */
int tdm_front_client_fd(struct MHD_Connection *c);
/* The listening side: a libmicrohttpd daemon, and a sweeper thread that enforces the
 * connections' deadlines and calls the owner's sweep hook.
 *
 * Two modes. threads > 0: an event loop (epoll) served by that many threads, with
 * suspend/resume allowed: handlers must never block (a handler that waits suspends its
 * connection and is resumed by whoever has news), so idle and slow connections cost memory and
 * a socket, not a thread (the server: the scheduler's news resumes; the router: its pump,
 * when a backend sends). threads == 0: a thread per connection, for a handler that blocks.
 *
 * A connection's phases and their deadlines (the sweeper shuts the socket down past them, and
 * libmicrohttpd then closes it):
 *
 *   accept --> HEADERS --(headers in: first handler call)--> BODY --(body in)--> ANSWER
 *                ^                                                                 |
 *                +-------------------(response done: keep-alive)------------------+
 *
 *   HEADERS  header_timeout_ms from the accept or from the previous response's end
 *   BODY     body_timeout_ms from the end of the headers
 *   ANSWER   none (a long generation is not a fault; idle_timeout_s still applies while
 *            the connection is not suspended)
 */
struct tdm_front_cfg {
    const char *who;       /* prefixes error messages: "server", "router" */
    const char *host;      /* numeric IPv4 or IPv6 */
    int port;              /* 0: any free port */
    int threads;           /* > 0: event loop with this many threads; 0: a thread per connection */
    int max_connections;   /* 0: 10000 */
    int idle_timeout_s;    /* inactivity limit of a connection; 0: 30 */
    int header_timeout_ms; /* 0: 10000 */
    int body_timeout_ms;   /* 0: 30000 */
    /* HTTPS (libmicrohttpd's GnuTLS): the certificate chain and its private key, PEM text, both
     * or neither; NULL: plain HTTP. Copied. */
    const char *tls_cert_pem, *tls_key_pem;
    const char *allowed_origins; /* CORS: "*" or origins separated by commas; NULL: none */
    MHD_AccessHandlerCallback handler;
    void *cls;
    void (*sweep)(void *cls); /* called by the sweeper about every 100 ms; NULL: none */
};
struct tdm_front;
tdm_status tdm_front_start(const struct tdm_front_cfg *cfg, struct tdm_front **out);
int tdm_front_port(const struct tdm_front *f);
/* Connections the sweeper closed for missing a deadline. */
uint64_t tdm_front_deadline_closed(const struct tdm_front *f);
/* Stops the sweeper, then the daemon (every suspended connection must have been resumed:
 * the owner's job). NULL is a no-op. */
void tdm_front_stop(struct tdm_front *f);

/* The request is bad at the framing level (duplicate Content-Length, a NUL in the request
 * target, ...): a message for a 400, or NULL when it is fine. libmicrohttpd passes those. */
const char *tdm_front_framing_error(struct MHD_Connection *c, const struct tdm_front_body *b,
                                    const char *version);

#endif
