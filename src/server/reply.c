/*
 * Complete responses and OpenAI-style errors, shared by the server and the router (reply.h).
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/reply.h"

#include "server/front.h"

enum MHD_Result tdm_reply_send(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                               unsigned status, char *body, const char *ctype)
{
    if (!body) {
        body = strdup("{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                      "\"param\":null,\"code\":null}}");
        status = 500;
        ctype = "application/json";
        if (!body) return MHD_NO;
    }
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (status == 405)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, strstr(body, "POST") ? "POST" : "GET");
    tdm_front_cors(c, r);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    if (status / 100 >= 1 && status / 100 <= 5) atomic_fetch_add(&by_class[status / 100], 1);
    return ret;
}

enum MHD_Result tdm_reply_err(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                              const struct api_err *e)
{
    return tdm_reply_send(c, by_class, (unsigned)e->status, tdm_api_error_json(e),
                          "application/json");
}

enum MHD_Result tdm_reply_errf(struct MHD_Connection *c, _Atomic uint64_t *by_class, int status,
                               const char *fmt, ...)
{
    struct api_err e;
    char msg[sizeof e.message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tdm_api_err_set(&e, status, NULL, "%s", msg);
    return tdm_reply_err(c, by_class, &e);
}

enum MHD_Result tdm_reply_preflight(struct MHD_Connection *c, _Atomic uint64_t *by_class,
                                    const char *allow_headers)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
    if (!r) return MHD_NO;
    tdm_front_cors(c, r);
    MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
    MHD_add_response_header(r, "Access-Control-Allow-Headers", allow_headers);
    MHD_add_response_header(r, "Access-Control-Max-Age", "600");
    enum MHD_Result ret = MHD_queue_response(c, 204, r);
    MHD_destroy_response(r);
    atomic_fetch_add(&by_class[2], 1);
    return ret;
}
