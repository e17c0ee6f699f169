/*
 * The HTTP front shared by the server and the router (front.h has the contract).
 */
#include "server/front.h"

#include <dlfcn.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "server/server_int.h"

/* ---- libmicrohttpd's own error pages, answered in OpenAI JSON ----
 *
 * libmicrohttpd refuses some requests before any handler runs: a malformed request line or
 * header line, headers over the connection's memory (431), a Content-Length it cannot read or
 * a body too large for it (413), a bad chunk, an HTTP version it does not speak (505), an
 * HTTP/1.1 request without Host. The bodies of those answers are HTML pages compiled into the
 * library, and it offers no option to replace them.
 *
 * It builds each of them with its own exported MHD_create_response_from_buffer, called through
 * its procedure linkage table, so this executable's definition below is the one its calls
 * bind to. A persistent buffer that lies in the library's own image and is one of its HTML
 * pages becomes {"error": {...}} with the page's text as the message; every other call (ours
 * included) goes to the library's function unchanged. The status line stays the library's.
 * tests/server/test_hardening.py checks each of these answers, so a libmicrohttpd that stops
 * binding its calls here fails a test rather than going back to HTML unseen.
 *
 * Threading: any of libmicrohttpd's threads; the library's function is looked up once. */

typedef struct MHD_Response *(*from_buffer_fn)(size_t, void *, enum MHD_ResponseMemoryMode);
static from_buffer_fn mhd_from_buffer;
static pthread_once_t mhd_from_buffer_once = PTHREAD_ONCE_INIT;

static void find_mhd_from_buffer(void)
{
    mhd_from_buffer = (from_buffer_fn)dlsym(RTLD_NEXT, "MHD_create_response_from_buffer");
}

/* The text of an HTML page: between <body> and </body>, tags dropped, &quot; and &amp; read,
 * spaces collapsed. */
static void page_text(const char *page, size_t n, char *out, size_t cap)
{
    const char *end = page + n, *b = memmem(page, n, "<body>", 6);
    b = b ? b + 6 : page;
    const char *e = memmem(b, (size_t)(end - b), "</body>", 7);
    if (e) end = e;
    size_t j = 0;
    bool tag = false;
    for (const char *p = b; p < end && j + 1 < cap; p++) {
        if (*p == '<') tag = true;
        if (tag) {
            if (*p == '>') tag = false;
            continue;
        }
        char ch = *p;
        if (ch == '&') {
            if (end - p >= 6 && !memcmp(p, "&quot;", 6))
                ch = '"', p += 5;
            else if (end - p >= 5 && !memcmp(p, "&amp;", 5))
                p += 4;
        }
        if ((unsigned char)ch < 0x20) ch = ' ';
        if (ch == ' ' && (j == 0 || out[j - 1] == ' ')) continue;
        out[j++] = ch;
    }
    while (j && out[j - 1] == ' ')
        j--;
    out[j] = '\0';
}

struct MHD_Response *MHD_create_response_from_buffer(size_t size, void *buffer,
                                                     enum MHD_ResponseMemoryMode mode)
{
    pthread_once(&mhd_from_buffer_once, find_mhd_from_buffer);
    if (!mhd_from_buffer) return NULL; /* libmicrohttpd is not loaded: nothing to answer with */
    Dl_info in_buf, in_lib;
    if (mode != MHD_RESPMEM_PERSISTENT || !buffer || size < 6 || memcmp(buffer, "<html>", 6) ||
        !dladdr(buffer, &in_buf) || !dladdr((void *)mhd_from_buffer, &in_lib) ||
        in_buf.dli_fbase != in_lib.dli_fbase)
        return mhd_from_buffer(size, buffer, mode);
    char text[400];
    page_text(buffer, size, text, sizeof text);
    struct api_err e;
    tdm_api_err_set(&e, strstr(text, "developer of this Web server") ? 500 : 400, NULL, "%s",
                    text[0] ? text : "the HTTP request is malformed");
    char *json = tdm_api_error_json(&e);
    if (!json) return mhd_from_buffer(size, buffer, mode);
    struct MHD_Response *r = mhd_from_buffer(strlen(json), json, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(json);
        return NULL;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    return r;
}

/* ---- connections and their deadlines ---- */

enum { PHASE_HEADERS, PHASE_BODY, PHASE_ANSWER };

struct fconn {
    struct tdm_front *f;
    int fd;
    atomic_bool nul_target; /* this request's target decodes to a NUL byte (%00) */
    _Atomic int phase;
    _Atomic uint64_t t0_ns; /* when the phase began */
    bool shut;              /* the sweeper shut it down (under the front's mu) */
    struct fconn *prev, *next;
};

struct tdm_front {
    struct MHD_Daemon *d;
    struct tdm_front_cfg cfg;
    int port;
    pthread_mutex_t mu; /* the connection list, stop */
    pthread_cond_t cv;
    struct fconn *head;
    bool stop, sweeping;
    pthread_t sweeper;
    _Atomic uint64_t closed;
    char *tls_cert, *tls_key; /* copies of the PEM text (the daemon may read them later) */
    char *origins;            /* a copy of cfg.allowed_origins, checked; NULL: no CORS */
};

static struct fconn *conn_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static void conn_phase(struct MHD_Connection *c, int phase)
{
    struct fconn *fc = conn_of(c);
    if (!fc) return;
    atomic_store(&fc->t0_ns, tdm_now_ns());
    atomic_store(&fc->phase, phase);
}

static void notify_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                              enum MHD_ConnectionNotificationCode toe)
{
    struct tdm_front *f = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        struct fconn *fc = calloc(1, sizeof *fc);
        if (!fc) return; /* untracked: its deadlines and CORS are lost */
        fc->f = f;
        fc->fd = tdm_front_client_fd(c);
        atomic_init(&fc->phase, PHASE_HEADERS);
        atomic_init(&fc->t0_ns, tdm_now_ns());
        pthread_mutex_lock(&f->mu);
        fc->next = f->head;
        if (f->head) f->head->prev = fc;
        f->head = fc;
        pthread_mutex_unlock(&f->mu);
        *socket_context = fc;
    } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED) {
        struct fconn *fc = *socket_context;
        if (!fc) return;
        /* unlinked before libmicrohttpd closes the socket, so the sweeper never shuts down
         * a descriptor that was reused */
        pthread_mutex_lock(&f->mu);
        if (fc->prev)
            fc->prev->next = fc->next;
        else
            f->head = fc->next;
        if (fc->next) fc->next->prev = fc->prev;
        pthread_mutex_unlock(&f->mu);
        free(fc);
        *socket_context = NULL;
    }
}

static void *sweeper_main(void *arg)
{
    struct tdm_front *f = arg;
    const uint64_t hdr = (uint64_t)f->cfg.header_timeout_ms * 1000000u,
                   body = (uint64_t)f->cfg.body_timeout_ms * 1000000u;
    pthread_mutex_lock(&f->mu);
    while (!f->stop) {
        struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, 100);
        pthread_cond_timedwait(&f->cv, &f->mu, &dl);
        if (f->stop) break;
        uint64_t now = tdm_now_ns();
        for (struct fconn *fc = f->head; fc; fc = fc->next) {
            int ph = atomic_load(&fc->phase);
            uint64_t t0 = atomic_load(&fc->t0_ns);
            uint64_t limit = ph == PHASE_HEADERS ? hdr : ph == PHASE_BODY ? body : 0;
            if (!limit || fc->shut || fc->fd < 0 || now < t0 || now - t0 <= limit) continue;
            /* libmicrohttpd owns the socket: shut it down (not close), and its loop sees the
             * end and closes the connection */
            shutdown(fc->fd, SHUT_RDWR);
            fc->shut = true;
            atomic_fetch_add(&f->closed, 1);
        }
        if (f->cfg.sweep) {
            pthread_mutex_unlock(&f->mu);
            f->cfg.sweep(f->cfg.cls);
            pthread_mutex_lock(&f->mu);
        }
    }
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static enum MHD_Result count_content_length(void *cls, enum MHD_ValueKind kind, const char *key,
                                            const char *value)
{
    (void)kind, (void)value;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) ++*(int *)cls;
    return MHD_YES;
}

/* libmicrohttpd's request-line hook: the per-request body starts here, with the raw target
 * (the URI with its query, before any decoding) and its length up to the first NUL. */
static void *uri_log(void *cls, const char *uri, struct MHD_Connection *c)
{
    (void)cls;
    struct fconn *fc = conn_of(c);
    if (fc) atomic_store(&fc->nul_target, false);
    struct tdm_front_body *b = calloc(1, sizeof *b);
    if (b) {
        b->raw_uri = uri;
        b->raw_len = strlen(uri);
    }
    return b;
}

/* libmicrohttpd's percent-decoding, with a %00 noted (it would cut the path short). */
static size_t unescape(void *cls, struct MHD_Connection *c, char *s)
{
    (void)cls;
    for (const char *p = s; (p = strchr(p, '%')); p++)
        if (p[1] == '0' && p[2] == '0') {
            struct fconn *fc = conn_of(c);
            if (fc) atomic_store(&fc->nul_target, true);
            break;
        }
    return MHD_http_unescape(s);
}

const char *tdm_front_framing_error(struct MHD_Connection *c, const struct tdm_front_body *b,
                                    const char *version)
{
    /* A NUL byte in the request target: libmicrohttpd parses the request line in place, so
     * the version follows the raw target and the space after it; a NUL inside the target
     * makes the target's string end before that. */
    if (b && b->raw_uri && version && *version && version > b->raw_uri &&
        version - b->raw_uri < 1 << 20 && version != b->raw_uri + b->raw_len + 1)
        return "the request target holds a NUL byte";
    struct fconn *fc = conn_of(c);
    if (fc && atomic_load(&fc->nul_target)) return "the request target decodes to a NUL byte";
    int n = 0;
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_content_length, &n);
    if (n > 1) return "the request has more than one Content-Length header";
    return NULL;
}

enum tdm_front_step tdm_front_feed(struct MHD_Connection *c, void **con_cls, const char *upload,
                                   size_t *upload_size, size_t max_body,
                                   struct tdm_front_body **body)
{
    struct tdm_front_body *b = *con_cls; /* made by uri_log, when it could */
    if (!b || !b->started) {
        if (!b && !(b = calloc(1, sizeof *b))) return TDM_FRONT_OOM;
        *con_cls = b;
        b->started = true;
        conn_phase(c, PHASE_BODY); /* the headers are in */
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
    conn_phase(c, PHASE_ANSWER);
    return b->too_big ? TDM_FRONT_TOO_BIG : TDM_FRONT_DONE;
}

void tdm_front_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)toe;
    conn_phase(c, PHASE_HEADERS); /* keep-alive: the next request's headers are due */
    struct tdm_front_body *b = *con_cls;
    if (!b) return;
    if (b->app_free) b->app_free(b->app);
    free(b->body);
    free(b);
    *con_cls = NULL;
}

/* ---- CORS ---- */

/* An origin as the list may name it: scheme://host[:port] in printable ASCII, no space or
 * comma (so that it can never split a header). */
static bool origin_ok(const char *s, size_t n)
{
    if (n == 0 || n > 256 || !memmem(s, n, "://", 3)) return false;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= ' ' || s[i] >= 0x7f || s[i] == ',') return false;
    return true;
}

/* The allowed value for this request's Origin: the list's own copy of it, "*", or NULL. */
static const char *cors_origin(struct MHD_Connection *c)
{
    struct fconn *fc = conn_of(c);
    if (!fc || !fc->f->origins) return NULL;
    const char *o = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!o) return NULL;
    const char *list = fc->f->origins;
    if (!strcmp(list, "*")) return "*";
    size_t n = strlen(o);
    for (const char *p = list; *p;) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        if (len == n && !memcmp(p, o, n)) return p; /* ends at the comma: see tdm_front_cors */
        if (!e) break;
        p = e + 1;
    }
    return NULL;
}

void tdm_front_cors(struct MHD_Connection *c, struct MHD_Response *r)
{
    const char *o = cors_origin(c);
    if (!o) return;
    if (!strcmp(o, "*")) {
        MHD_add_response_header(r, "Access-Control-Allow-Origin", "*");
        return;
    }
    char buf[260];
    size_t len = strcspn(o, ",");
    snprintf(buf, sizeof buf, "%.*s", (int)len, o);
    MHD_add_response_header(r, "Access-Control-Allow-Origin", buf);
    MHD_add_response_header(r, "Vary", "Origin");
}

bool tdm_front_preflight(struct MHD_Connection *c, const char *method, const char **allow_headers)
{
    if (strcmp(method, "OPTIONS") ||
        !MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Method") ||
        !cors_origin(c))
        return false;
    const char *h =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Access-Control-Request-Headers");
    bool plain = h && *h && strlen(h) <= 1024;
    for (const char *p = h; plain && *p; p++)
        plain = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
                *p == '-' || *p == '_' || *p == ',' || *p == ' ';
    *allow_headers = plain ? h : "Authorization, Content-Type";
    return true;
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

/* Room for every connection's socket: the soft descriptor limit raised toward the hard one. */
static void raise_fd_limit(int want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return;
    rlim_t need = (rlim_t)want + 256;
    if (rl.rlim_cur >= need) return;
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
}

tdm_status tdm_front_start(const struct tdm_front_cfg *cfg, struct tdm_front **out)
{
    struct tdm_front *f = calloc(1, sizeof *f);
    if (!f) return tdm_err_set(TDM_ENOMEM, "%s: out of memory", cfg->who);
    f->cfg = *cfg;
    struct tdm_front_cfg *c = &f->cfg;
    if (c->max_connections <= 0) c->max_connections = 10000;
    /* a blocked connection thread is not idle to libmicrohttpd's clock: longer there */
    if (c->idle_timeout_s <= 0) c->idle_timeout_s = c->threads > 0 ? 30 : 600;
    if (c->header_timeout_ms <= 0) c->header_timeout_ms = 10000;
    if (c->body_timeout_ms <= 0) c->body_timeout_ms = 30000;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);

    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_PASSIVE};
    struct addrinfo *ai = NULL;
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", c->port);
    tdm_status st;
    if (getaddrinfo(c->host, port_s, &hints, &ai) || !ai) {
        st = tdm_err_set(TDM_EINVAL, "%s: '%s' is not a numeric IPv4 or IPv6 address", c->who,
                         c->host);
        goto out_free;
    }
    if (!c->tls_cert_pem != !c->tls_key_pem) {
        freeaddrinfo(ai);
        st = tdm_err_set(TDM_EINVAL, "%s: TLS needs both a certificate and its key", c->who);
        goto out_free;
    }
    if (c->allowed_origins) {
        const char *o = c->allowed_origins;
        bool ok = *o != '\0';
        if (ok && strcmp(o, "*"))
            for (const char *p = o; ok;) {
                const char *e = strchr(p, ',');
                ok = origin_ok(p, e ? (size_t)(e - p) : strlen(p));
                if (!e) break;
                p = e + 1;
            }
        if (!ok) {
            freeaddrinfo(ai);
            st = tdm_err_set(TDM_EINVAL,
                             "%s: --allowed-origins '%.300s': give * or origins such as "
                             "https://app.example.com:8443, separated by commas, without spaces",
                             c->who, o);
            goto out_free;
        }
        if (!(f->origins = strdup(o))) {
            freeaddrinfo(ai);
            st = tdm_err_set(TDM_ENOMEM, "%s: out of memory", c->who);
            goto out_free;
        }
    }
    if (c->tls_cert_pem &&
        (!(f->tls_cert = strdup(c->tls_cert_pem)) || !(f->tls_key = strdup(c->tls_key_pem)))) {
        freeaddrinfo(ai);
        st = tdm_err_set(TDM_ENOMEM, "%s: out of memory", c->who);
        goto out_free;
    }
    raise_fd_limit(c->max_connections);
    /* HTTPS options, or none: passed as an array since varargs cannot be conditional */
    struct MHD_OptionItem tls[3] = {{MHD_OPTION_END, 0, NULL}};
    if (c->tls_cert_pem) {
        tls[0] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, f->tls_cert};
        tls[1] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, f->tls_key};
        tls[2] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    flags |= c->threads > 0 ? MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME
                            : MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    if (c->tls_cert_pem) flags |= MHD_USE_TLS;
    /* a thread per connection gets a small stack: it runs a handler, not a deep recursion */
    size_t stack = c->threads > 0 ? 0 : (size_t)512 * 1024;
    f->d = MHD_start_daemon(
        flags, 0, NULL, NULL, c->handler, c->cls, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_NOTIFY_COMPLETED, tdm_front_completed, f, MHD_OPTION_NOTIFY_CONNECTION,
        notify_connection, f, MHD_OPTION_CONNECTION_LIMIT, (unsigned)c->max_connections,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)c->idle_timeout_s,
        MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(128 * 1024), MHD_OPTION_LISTEN_BACKLOG_SIZE,
        4096u, MHD_OPTION_THREAD_POOL_SIZE, (unsigned)(c->threads > 1 ? c->threads : 0),
        MHD_OPTION_THREAD_STACK_SIZE, stack, MHD_OPTION_URI_LOG_CALLBACK, uri_log, NULL,
        MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL, MHD_OPTION_ARRAY, tls, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!f->d) {
        st = c->tls_cert_pem
                 ? tdm_err_set(TDM_EINVAL,
                               "%s: cannot listen on %s:%d with TLS (%s; is the certificate and "
                               "key PEM, and the key the certificate's?)",
                               c->who, c->host, c->port, strerror(errno))
                 : tdm_err_set(TDM_EIO, "%s: cannot listen on %s:%d (%s)", c->who, c->host, c->port,
                               strerror(errno));
        goto out_free;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(f->d, MHD_DAEMON_INFO_BIND_PORT);
    f->port = di ? di->port : c->port;
    if (pthread_create(&f->sweeper, NULL, sweeper_main, f)) {
        MHD_stop_daemon(f->d);
        st = tdm_err_set(TDM_EINTERNAL, "%s: cannot start the connection sweeper", c->who);
        goto out_free;
    }
    f->sweeping = true;
    *out = f;
    return TDM_OK;

out_free:
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f->tls_cert);
    free(f->tls_key);
    free(f->origins);
    free(f);
    return st;
}

int tdm_front_port(const struct tdm_front *f)
{
    return f->port;
}

uint64_t tdm_front_deadline_closed(const struct tdm_front *f)
{
    return atomic_load(&((struct tdm_front *)f)->closed);
}

void tdm_front_stop(struct tdm_front *f)
{
    if (!f) return;
    pthread_mutex_lock(&f->mu);
    f->stop = true;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    if (f->sweeping) pthread_join(f->sweeper, NULL);
    MHD_stop_daemon(f->d);
    pthread_mutex_destroy(&f->mu);
    pthread_cond_destroy(&f->cv);
    free(f->tls_cert);
    free(f->tls_key);
    free(f->origins);
    free(f);
}
