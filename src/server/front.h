/*
 * The HTTP front that the server (http.c) and the router (router.c) share: listening with
 * libmicrohttpd (thread per connection), the request body as it accumulates under a hard cap,
 * the bearer-key check, and whether a connection's client is still there.
 *
 * Ownership: a connection's body belongs to libmicrohttpd's per-connection pointer from the
 * first call of the access handler until tdm_front_completed frees it. Threading: every
 * function but tdm_front_listen runs on the connection's own thread.
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
/* The client hung up (or its socket errs). */
bool tdm_front_client_gone(struct MHD_Connection *c);
/* The connection's socket, or -1. */
int tdm_front_client_fd(struct MHD_Connection *c);
/* Listens on a numeric host and port (0: any free one) with `handler`; `who` prefixes the
 * error messages ("server", "router"). *bound_port: the port actually bound. */
tdm_status tdm_front_listen(const char *who, const char *host, int port, int max_connections,
                            int idle_timeout_s, MHD_AccessHandlerCallback handler, void *cls,
                            struct MHD_Daemon **out, int *bound_port);

#endif
