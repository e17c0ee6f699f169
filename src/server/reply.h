/*
 * Complete (non-streamed) responses that the server (http.c) and the router (router.c) write
 * themselves: a body queued in one piece, and OpenAI-style errors ({"error": {...}}, rendered by
 * tdm_api_error_json in openai.c).
 *
 * Each response is counted in the caller's own per-status-class counters, so that the server and
 * the router each keep their /metrics: `by_class` is an array of 6 counters indexed by
 * status / 100 (1xx..5xx; index 0 is unused).
 *
 * Threading: any connection thread may call these; the counters are atomics.
 */
#ifndef TANDEM_SERVER_REPLY_H
#define TANDEM_SERVER_REPLY_H

#include <microhttpd.h>
#include <stdint.h>

#include "server/server_int.h"

/* Queues `body` (malloc'd, taken in every case) with Content-Type `ctype`. A NULL body (out of
 * memory) becomes a 500 error. A 405 gets an Allow header: POST when the body names POST, else
 * GET. */
enum MHD_Result tdm_reply_send(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                               unsigned status, char *body, const char *ctype);

/* Queues `e` as an application/json error with status e->status. */
enum MHD_Result tdm_reply_err(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                              const struct api_err *e);

/* Queues an error with no "param" and a printf-style message (truncated to api_err.message). */
enum MHD_Result tdm_reply_errf(struct MHD_Connection *c, _Atomic uint64_t *by_class, int status,
                               const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Answers a CORS preflight that tdm_front_preflight accepted: 204 with the allowed methods and
 * `allow_headers`. */
enum MHD_Result tdm_reply_preflight(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                                    const char *allow_headers);

#endif
