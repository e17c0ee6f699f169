/*
 * The HTTP front shared by the server and the router (front.h has the contract).
 */
#include "server/front.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

enum tdm_front_step tdm_front_feed(struct MHD_Connection *c, void **con_cls, const char *upload,
                                   size_t *upload_size, size_t max_body,
                                   struct tdm_front_body **body)
{
    struct tdm_front_body *b = *con_cls;
    if (!b) {
        if (!(b = calloc(1, sizeof *b))) return TDM_FRONT_OOM;
        *con_cls = b;
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > max_body) {
            b->too_big = true;
            *body = b;
            return TDM_FRONT_TOO_BIG;
        }
        return TDM_FRONT_MORE;
    }
    *body = b;
    if (*upload_size) {
        if (!b->too_big) {
            if (b->len + *upload_size > max_body) {
                b->too_big = true;
                free(b->body);
                b->body = NULL;
                b->len = b->cap = 0;
            } else {
                if (b->len + *upload_size + 1 > b->cap) {
                    size_t cap =
                        TDM_MIN(TDM_MAX(b->cap * 2, b->len + *upload_size + 1), max_body + 1);
                    char *nb = realloc(b->body, cap);
                    if (!nb) return TDM_FRONT_OOM;
                    b->body = nb;
                    b->cap = cap;
                }
                memcpy(b->body + b->len, upload, *upload_size);
                b->len += *upload_size;
                b->body[b->len] = '\0';
            }
        }
        *upload_size = 0;
        return TDM_FRONT_MORE;
    }
    return b->too_big ? TDM_FRONT_TOO_BIG : TDM_FRONT_DONE;
}

void tdm_front_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)c, (void)toe;
    struct tdm_front_body *b = *con_cls;
    if (!b) return;
    free(b->body);
    free(b);
    *con_cls = NULL;
}

bool tdm_front_bearer_ok(struct MHD_Connection *c, const char *key)
{
    if (!key) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7)) return false;
    h += 7;
    size_t a = strlen(h), b = strlen(key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a; i++) /* time independent of where the key differs */
        diff |= (unsigned)(h[i] ^ key[i % (b ? b : 1)]);
    return diff == 0;
}

int tdm_front_client_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

bool tdm_front_client_gone(struct MHD_Connection *c)
{
    int fd = tdm_front_client_fd(c);
    if (fd < 0) return true;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    if (p.revents & POLLIN) {
        char b;
        ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0) return true;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return true;
    }
    return false;
}

tdm_status tdm_front_listen(const char *who, const char *host, int port, int max_connections,
                            int idle_timeout_s, MHD_AccessHandlerCallback handler, void *cls,
                            struct MHD_Daemon **out, int *bound_port)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", port);
    if (getaddrinfo(host, port_s, &hints, &ai) || !ai)
        return tdm_err_set(TDM_EINVAL, "%s: '%s' is not a numeric IPv4 or IPv6 address", who, host);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_ERROR_LOG | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, 0, NULL, NULL, handler, cls, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_NOTIFY_COMPLETED, tdm_front_completed, NULL, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)(max_connections > 0 ? max_connections : 1024), MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)(idle_timeout_s > 0 ? idle_timeout_s : 600), MHD_OPTION_CONNECTION_MEMORY_LIMIT,
        (size_t)(256 * 1024), MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024u, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!d)
        return tdm_err_set(TDM_EIO, "%s: cannot listen on %s:%d (%s)", who, host, port,
                           strerror(errno));
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = di ? di->port : port;
    *out = d;
    return TDM_OK;
}
