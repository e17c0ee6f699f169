/*
 * The HTTP/1.1 client (see httpc.h for the contract): `tandem bench serve` pushes requests
 * through it, the router pulls backend responses through it.
 *
 * A response is read by one state machine fed with whatever recv() returns:
 *
 *     HEAD --(blank line; 1xx)--> HEAD
 *     HEAD --(blank line)--> BODY_LENGTH | BODY_CHUNKED | BODY_TO_CLOSE
 *     BODY_LENGTH --(remaining == 0)--> DONE
 *     BODY_TO_CLOSE --(peer closes)--> DONE
 *     BODY_CHUNKED: SIZE --(n > 0)--> DATA --(n bytes)--> DATA_END --(CRLF)--> SIZE
 *                   SIZE --(0)--> TRAILER --(blank line)--> DONE
 *
 *   transition                       performed by
 *   bytes in -> any state            feed(), called from pump() (one recv per call)
 *   head parsed -> body state        parse_head()
 *   peer closes (BODY_TO_CLOSE: DONE) rx_close(), from pump()
 *
 * tdm_bh_parser_* (httpc.h) runs the same machine on bytes its caller feeds: the unit test and
 * the fuzz target drive it that way.
 *
 * Push and pull mode share pump(): push mode hands decoded body bytes to the caller's handler;
 * pull mode's own handler copies them into the connection's out buffer, which is drained before
 * the next recv. A recv of at most RECV_CAP bytes decodes to at most RECV_CAP body bytes, so that
 * buffer never overflows.
 *
 * Every wait is a poll() bounded by a deadline, so no peer can make a call outlive it. Bytes from
 * the peer are validated: an over-long head or chunk line, a bad status line, a bad or
 * conflicting Content-Length, or a bad chunk size ends the request with TDM_BH_PROTOCOL.
 */
#include "server/httpc.h"

#include <errno.h>
#include <fcntl.h>
#include <gnutls/gnutls.h>
#include <gnutls/x509.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#define LINE_CAP 4096
#define RECV_CAP 16384

const char *tdm_bh_fail_str(enum tdm_bh_fail f)
{
    switch (f) {
    case TDM_BH_OK:
        return "ok";
    case TDM_BH_CONNECT:
        return "connect";
    case TDM_BH_TIMEOUT:
        return "timeout";
    case TDM_BH_SEND:
        return "send";
    case TDM_BH_TRUNCATED:
        return "truncated";
    case TDM_BH_PROTOCOL:
        return "protocol";
    case TDM_BH_ABORTED:
        return "aborted";
    case TDM_BH_NOMEM:
        return "nomem";
    }
    return "unknown";
}

/* The trust anchors for https: ca_file's certificates, or the system's. */
static tdm_status tls_creds(const char *url, const char *ca_file, void **out)
{
    gnutls_certificate_credentials_t cr;
    if (gnutls_certificate_allocate_credentials(&cr) != GNUTLS_E_SUCCESS)
        return tdm_err_set(TDM_ENOMEM, "%s: out of memory", url);
    int n = ca_file ? gnutls_certificate_set_x509_trust_file(cr, ca_file, GNUTLS_X509_FMT_PEM)
                    : gnutls_certificate_set_x509_system_trust(cr);
    if (n <= 0) {
        gnutls_certificate_free_credentials(cr);
        if (ca_file)
            return tdm_err_set(TDM_EINVAL, "%s: no CA certificate could be read from %s (%s)", url,
                               ca_file, n < 0 ? gnutls_strerror(n) : "none in the file");
        return tdm_err_set(TDM_ENOTFOUND,
                           "%s: the system's trust store is empty or unreadable (%s); give a CA "
                           "file",
                           url, n < 0 ? gnutls_strerror(n) : "no certificate");
    }
    *out = cr;
    return TDM_OK;
}

void tdm_bh_target_free(struct tdm_bh_target *t)
{
    if (t && t->tls_creds) gnutls_certificate_free_credentials(t->tls_creds);
    if (t) t->tls_creds = NULL;
}

tdm_status tdm_bh_target_init(const char *url, const char *ca_file, struct tdm_bh_target *out)
{
    struct tdm_bh_target t;
    memset(&t, 0, sizeof t);
    size_t skip;
    if (!strncasecmp(url, "https://", 8)) {
        t.tls = true;
        skip = 8;
    } else if (!strncasecmp(url, "http://", 7)) {
        skip = 7;
    } else {
        return tdm_err_set(TDM_EINVAL,
                           "%s: expected a URL of the form http[s]://host[:port][/path]", url);
    }
    const char *p = url + skip, *host_end, *port = NULL;
    size_t port_len = 0;
    if (*p == '[') { /* IPv6 literal */
        host_end = strchr(p, ']');
        if (!host_end) return tdm_err_set(TDM_EINVAL, "%s: unterminated IPv6 address", url);
        if ((size_t)(host_end - p - 1) >= sizeof t.host)
            return tdm_err_set(TDM_EINVAL, "%s: host name too long", url);
        memcpy(t.host, p + 1, (size_t)(host_end - p - 1));
        p = host_end + 1;
    } else {
        size_t n = strcspn(p, ":/");
        if (n >= sizeof t.host) return tdm_err_set(TDM_EINVAL, "%s: host name too long", url);
        memcpy(t.host, p, n);
        p += n;
    }
    if (!t.host[0]) return tdm_err_set(TDM_EINVAL, "%s: no host", url);
    if (*p == ':') {
        port = ++p;
        port_len = strcspn(p, "/");
        p += port_len;
    }
    if (port) {
        char buf[8];
        int64_t v;
        if (port_len == 0 || port_len >= sizeof buf)
            return tdm_err_set(TDM_EINVAL, "%s: bad port", url);
        memcpy(buf, port, port_len);
        buf[port_len] = '\0';
        if (!tdm_parse_i64(buf, 1, 65535, &v)) return tdm_err_set(TDM_EINVAL, "%s: bad port", url);
        snprintf(t.port, sizeof t.port, "%d", (int)v);
    } else {
        strcpy(t.port, t.tls ? "443" : "80");
    }
    if (*p && *p != '/') return tdm_err_set(TDM_EINVAL, "%s: bad URL", url);
    size_t plen = strlen(p);
    while (plen > 0 && p[plen - 1] == '/')
        plen--;
    if (plen >= sizeof t.base_path) return tdm_err_set(TDM_EINVAL, "%s: path too long", url);
    memcpy(t.base_path, p, plen);
    for (size_t i = 0; i < plen; i++)
        if ((unsigned char)p[i] <= ' ' || p[i] == 0x7f)
            return tdm_err_set(TDM_EINVAL, "%s: the path holds spaces or control bytes", url);

    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gai = getaddrinfo(t.host, t.port, &hints, &res);
    if (gai != 0 || !res)
        return tdm_err_set(TDM_ENOTFOUND, "%s: cannot resolve %s: %s", url, t.host,
                           gai_strerror(gai));
    memcpy(&t.addr, res->ai_addr, res->ai_addrlen);
    t.addr_len = res->ai_addrlen;
    freeaddrinfo(res);
    if (t.tls) {
        tdm_status st = tls_creds(url, ca_file, &t.tls_creds);
        if (st != TDM_OK) return st;
    }
    *out = t;
    return TDM_OK;
}

/* ---- socket steps, each bounded by a deadline ---- */

static int ms_until(uint64_t deadline_ns)
{
    uint64_t now = tdm_now_ns();
    if (now >= deadline_ns) return 0;
    uint64_t ms = (deadline_ns - now + 999999) / 1000000;
    return ms > 1000000 ? 1000000 : (int)ms;
}

/* 1: ready; 0: deadline passed; -1: poll failed. */
static int wait_fd(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        int ms = ms_until(deadline_ns);
        if (ms == 0) return 0;
        struct pollfd pfd = {.fd = fd, .events = events};
        int r = poll(&pfd, 1, ms);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return -1;
    }
}

static enum tdm_bh_fail do_connect(const struct tdm_bh_target *t, uint64_t deadline_ns, int *fd_out)
{
    int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        tdm_err_set(TDM_EIO, "socket: %s", strerror(errno));
        return TDM_BH_CONNECT;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (const struct sockaddr *)&t->addr, t->addr_len) != 0) {
        if (errno != EINPROGRESS) {
            tdm_err_set(TDM_EIO, "connect to %s:%s: %s", t->host, t->port, strerror(errno));
            goto out_close;
        }
        int r = wait_fd(fd, POLLOUT, deadline_ns);
        if (r <= 0) {
            tdm_err_set(TDM_ETIMEDOUT, "connect to %s:%s: %s", t->host, t->port,
                        r == 0 ? "timed out" : strerror(errno));
            goto out_close;
        }
        int err = 0;
        socklen_t len = sizeof err;
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        if (err) {
            tdm_err_set(TDM_EIO, "connect to %s:%s: %s", t->host, t->port, strerror(err));
            goto out_close;
        }
    }
    *fd_out = fd;
    return TDM_BH_OK;
out_close:
    close(fd);
    return TDM_BH_CONNECT;
}

/* ---- response parser ---- */

enum rx_state {
    RX_HEAD,
    RX_LENGTH,
    RX_TO_CLOSE,
    RX_CH_SIZE,
    RX_CH_DATA,
    RX_CH_DATA_END,
    RX_CH_TRAILER,
    RX_DONE
};

struct rx {
    enum rx_state state;
    const struct tdm_bh_handler *h;
    char *head; /* [TDM_BH_MAX_HEAD_BYTES + 1] */
    size_t head_len;
    char line[LINE_CAP + 1]; /* a chunk-size or trailer line being assembled */
    size_t line_len;
    uint64_t remaining; /* body bytes left (RX_LENGTH) or chunk bytes left (RX_CH_DATA) */
    /* the final head, once parsed */
    bool head_done;
    int status;
    int64_t content_length; /* -1: chunked or to the close */
    char content_type[256];
};

static enum tdm_bh_fail proto(const char *msg)
{
    tdm_err_set(TDM_EFORMAT, "bad HTTP response: %s", msg);
    return TDM_BH_PROTOCOL;
}

/* Value of header `name` within the head's header lines, trimmed; NULL if absent. Writes into
 * `out` (cap bytes). Sets *dup when the header appears more than once with different values. */
static const char *header_value(const char *head, const char *name, char *out, size_t cap,
                                bool *dup)
{
    const char *found = NULL;
    size_t nlen = strlen(name);
    const char *p = strstr(head, "\r\n");
    *dup = false;
    while (p && p[2] && !(p[2] == '\r' && p[3] == '\n')) {
        const char *ln = p + 2, *end = strstr(ln, "\r\n");
        if (!end) break;
        if ((size_t)(end - ln) > nlen && !strncasecmp(ln, name, nlen) && ln[nlen] == ':') {
            const char *v = ln + nlen + 1, *ve = end;
            while (v < ve && (*v == ' ' || *v == '\t'))
                v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            size_t n = TDM_MIN((size_t)(ve - v), cap - 1);
            if (found && (strlen(out) != n || strncmp(out, v, n))) *dup = true;
            memcpy(out, v, n);
            out[n] = '\0';
            found = out;
        }
        p = end;
    }
    return found;
}

/* Parses a complete head (NUL-terminated, ending in CRLF CRLF). */
static enum tdm_bh_fail parse_head(struct rx *rx, bool *informational)
{
    const char *h = rx->head;
    if (strncmp(h, "HTTP/1.", 7) || (h[7] != '0' && h[7] != '1') || h[8] != ' ')
        return proto("no HTTP/1.x status line");
    if (h[9] < '1' || h[9] > '5' || h[10] < '0' || h[10] > '9' || h[11] < '0' || h[11] > '9' ||
        (h[12] != ' ' && h[12] != '\r'))
        return proto("bad status code");
    int status = (h[9] - '0') * 100 + (h[10] - '0') * 10 + (h[11] - '0');
    *informational = status < 200;
    if (*informational) return TDM_BH_OK;

    char val[256], ctype[256] = "";
    bool dup;
    const char *te = header_value(h, "Transfer-Encoding", val, sizeof val, &dup);
    bool chunked = false;
    if (te) {
        if (strcasecmp(te, "chunked")) return proto("unsupported Transfer-Encoding");
        chunked = true;
    }
    const char *cl = header_value(h, "Content-Length", val, sizeof val, &dup);
    if (chunked) {
        rx->state = RX_CH_SIZE;
    } else if (cl) {
        int64_t n;
        if (dup) return proto("conflicting Content-Length headers");
        if (!tdm_parse_i64(cl, 0, INT64_MAX / 2, &n)) return proto("bad Content-Length");
        rx->remaining = (uint64_t)n;
        rx->state = n == 0 ? RX_DONE : RX_LENGTH;
    } else {
        rx->state = RX_TO_CLOSE;
    }
    header_value(h, "Content-Type", ctype, sizeof ctype, &dup);
    rx->head_done = true;
    rx->status = status;
    rx->content_length =
        rx->state == RX_LENGTH || rx->state == RX_DONE ? (int64_t)rx->remaining : -1;
    memcpy(rx->content_type, ctype, sizeof ctype);
    if (rx->h->on_head && !rx->h->on_head(rx->h->ctx, status, ctype)) {
        tdm_err_set(TDM_ECANCELED, "stopped by the caller after the head");
        return TDM_BH_ABORTED;
    }
    return TDM_BH_OK;
}

static enum tdm_bh_fail emit(struct rx *rx, const char *p, size_t n)
{
    if (n && rx->h->on_body && !rx->h->on_body(rx->h->ctx, p, n)) {
        tdm_err_set(TDM_ECANCELED, "stopped by the caller");
        return TDM_BH_ABORTED;
    }
    return TDM_BH_OK;
}

/* Takes bytes up to and including '\n' into rx->line. Returns bytes consumed; *complete when the
 * line (without CRLF) is in rx->line. */
static size_t take_line(struct rx *rx, const char *p, size_t n, bool *complete, bool *too_long)
{
    const char *nl = memchr(p, '\n', n);
    size_t take = nl ? (size_t)(nl - p) + 1 : n;
    *complete = nl != NULL;
    *too_long = false;
    size_t keep = nl ? take - 1 : take;
    if (rx->line_len + keep > LINE_CAP) {
        *too_long = true;
        return take;
    }
    memcpy(rx->line + rx->line_len, p, keep);
    rx->line_len += keep;
    if (*complete) {
        if (rx->line_len && rx->line[rx->line_len - 1] == '\r') rx->line_len--;
        rx->line[rx->line_len] = '\0';
    }
    return take;
}

static enum tdm_bh_fail feed(struct rx *rx, const char *p, size_t n)
{
    enum tdm_bh_fail f;
    while (n > 0 && rx->state != RX_DONE) {
        switch (rx->state) {
        case RX_HEAD: {
            size_t room = TDM_BH_MAX_HEAD_BYTES - rx->head_len;
            size_t take = TDM_MIN(n, room);
            /* Search for the blank line across the old/new boundary. */
            size_t from = rx->head_len >= 3 ? rx->head_len - 3 : 0;
            memcpy(rx->head + rx->head_len, p, take);
            rx->head_len += take;
            rx->head[rx->head_len] = '\0';
            char *end = NULL;
            for (size_t i = from; i + 4 <= rx->head_len; i++)
                if (!memcmp(rx->head + i, "\r\n\r\n", 4)) {
                    end = rx->head + i;
                    break;
                }
            if (!end) {
                if (rx->head_len >= TDM_BH_MAX_HEAD_BYTES) return proto("head over 64 KiB");
                p += take;
                n -= take;
                break;
            }
            if (memchr(rx->head, '\0', (size_t)(end - rx->head)))
                return proto("NUL byte in the head");
            size_t head_bytes = (size_t)(end - rx->head) + 4;
            size_t used_now = head_bytes - (rx->head_len - take);
            end[4] = '\0';
            bool info;
            if ((f = parse_head(rx, &info))) return f;
            p += used_now;
            n -= used_now;
            rx->head_len = 0;
            if (info) rx->state = RX_HEAD;
            break;
        }
        case RX_TO_CLOSE:
            return emit(rx, p, n);
        case RX_LENGTH:
        case RX_CH_DATA: {
            size_t k = (size_t)TDM_MIN((uint64_t)n, rx->remaining);
            if ((f = emit(rx, p, k))) return f;
            p += k;
            n -= k;
            rx->remaining -= k;
            if (rx->remaining == 0) rx->state = rx->state == RX_LENGTH ? RX_DONE : RX_CH_DATA_END;
            break;
        }
        case RX_CH_SIZE:
        case RX_CH_DATA_END:
        case RX_CH_TRAILER: {
            bool complete, too_long;
            size_t k = take_line(rx, p, n, &complete, &too_long);
            p += k;
            n -= k;
            if (too_long) return proto("chunk line over 4 KiB");
            if (!complete) break;
            rx->line_len = 0;
            if (rx->state == RX_CH_DATA_END) {
                if (rx->line[0]) return proto("no CRLF after chunk data");
                rx->state = RX_CH_SIZE;
            } else if (rx->state == RX_CH_TRAILER) {
                if (!rx->line[0]) rx->state = RX_DONE;
            } else {
                uint64_t size = 0;
                int digits = 0;
                const char *s = rx->line;
                for (; *s; s++, digits++) {
                    int d;
                    if (*s >= '0' && *s <= '9')
                        d = *s - '0';
                    else if (*s >= 'a' && *s <= 'f')
                        d = *s - 'a' + 10;
                    else if (*s >= 'A' && *s <= 'F')
                        d = *s - 'A' + 10;
                    else
                        break;
                    if (digits >= 15) return proto("chunk size too large");
                    size = size * 16 + (uint64_t)d;
                }
                while (*s == ' ' || *s == '\t')
                    s++;
                if (digits == 0 || (*s && *s != ';')) return proto("bad chunk size");
                if (size == 0) {
                    rx->state = RX_CH_TRAILER;
                } else {
                    rx->remaining = size;
                    rx->state = RX_CH_DATA;
                }
            }
            break;
        }
        case RX_DONE:
            break;
        }
    }
    return TDM_BH_OK;
}

/* A parser at the start of a response, reading the head into `head` (TDM_BH_MAX_HEAD_BYTES + 1
 * bytes, owned by the caller) and handing it and the body to h. */
static void rx_start(struct rx *rx, char *head, const struct tdm_bh_handler *h)
{
    rx->head = head;
    rx->h = h;
    rx->state = RX_HEAD;
}

/* The peer closed the connection: what that means in the parser's state. */
static enum tdm_bh_fail rx_close(struct rx *rx)
{
    if (rx->state == RX_DONE) return TDM_BH_OK;
    if (rx->state == RX_TO_CLOSE) {
        rx->state = RX_DONE;
        return TDM_BH_OK;
    }
    tdm_err_set(TDM_EPEER, "the server closed the connection %s",
                rx->state == RX_HEAD ? "before the response head" : "mid-body");
    return TDM_BH_TRUNCATED;
}

/* ---- the parser alone (httpc.h) ---- */

struct tdm_bh_parser {
    struct rx rx;
    struct tdm_bh_handler drop; /* the handler of a parser made without one */
};

tdm_bh_parser_t *tdm_bh_parser_new(const struct tdm_bh_handler *h)
{
    tdm_bh_parser_t *p = calloc(1, sizeof *p);
    char *head = malloc(TDM_BH_MAX_HEAD_BYTES + 1);
    if (!p || !head) {
        free(p);
        free(head);
        return NULL;
    }
    rx_start(&p->rx, head, h ? h : &p->drop);
    return p;
}

enum tdm_bh_fail tdm_bh_parser_feed(tdm_bh_parser_t *p, const char *data, size_t n)
{
    return feed(&p->rx, data, n);
}

enum tdm_bh_fail tdm_bh_parser_close(tdm_bh_parser_t *p)
{
    return rx_close(&p->rx);
}

bool tdm_bh_parser_done(const tdm_bh_parser_t *p)
{
    return p->rx.state == RX_DONE;
}

int tdm_bh_parser_status(const tdm_bh_parser_t *p)
{
    return p->rx.head_done ? p->rx.status : 0;
}

int64_t tdm_bh_parser_content_length(const tdm_bh_parser_t *p)
{
    return p->rx.head_done ? p->rx.content_length : -1;
}

void tdm_bh_parser_free(tdm_bh_parser_t *p)
{
    if (!p) return;
    free(p->rx.head);
    free(p);
}

/* ---- one connection, driven by pump() ---- */

struct tdm_bh_conn {
    int fd;
    gnutls_session_t tls;    /* https: the session over fd; NULL: plain */
    int tls_err;             /* the GnuTLS error that failed a record call */
    enum tdm_bh_fail failed; /* sticky: once a call fails for good, every later call does */
    struct rx rx;
    struct tdm_bh_handler pull; /* pull mode: on_body fills out[] */
    size_t out_len, out_off;
    char out[RECV_CAP];
    char raw[RECV_CAP];
};

/* ---- bytes over the socket, plain or TLS ---- */

/* The socket's own semantics for both: > 0 bytes, 0 the peer closed, -1 with errno (EAGAIN:
 * wait for io_events(c)). A TLS failure sets errno EPROTO and keeps GnuTLS's code in tls_err. */
/* A GnuTLS record call's failure as the socket's: errno EAGAIN or EINTR, or EPROTO with
 * GnuTLS's code kept in tls_err. Returns -1. */
static ssize_t tls_fail(struct tdm_bh_conn *c, ssize_t r)
{
    if (r == GNUTLS_E_AGAIN) {
        errno = EAGAIN;
    } else if (r == GNUTLS_E_INTERRUPTED) {
        errno = EINTR;
    } else {
        c->tls_err = (int)r;
        errno = EPROTO;
    }
    return -1;
}

static ssize_t io_recv(struct tdm_bh_conn *c, void *buf, size_t n)
{
    if (!c->tls) return recv(c->fd, buf, n, 0);
    ssize_t r = gnutls_record_recv(c->tls, buf, n);
    if (r >= 0) return r;
    if (r == GNUTLS_E_PREMATURE_TERMINATION) return 0; /* closed without close_notify */
    return tls_fail(c, r);
}

static ssize_t io_send(struct tdm_bh_conn *c, const void *p, size_t n)
{
    if (!c->tls) return send(c->fd, p, n, MSG_NOSIGNAL);
    ssize_t w = gnutls_record_send(c->tls, p, n);
    return w >= 0 ? w : tls_fail(c, w);
}

/* What to wait for after EAGAIN: TLS may need to write while reading, and the reverse. */
static short io_events(struct tdm_bh_conn *c, short plain)
{
    if (!c->tls) return plain;
    return gnutls_record_get_direction(c->tls) ? POLLOUT : POLLIN;
}

static const char *io_error(struct tdm_bh_conn *c)
{
    return c->tls && c->tls_err ? gnutls_strerror(c->tls_err) : strerror(errno);
}

/* GnuTLS's transport: the socket, without SIGPIPE. */
static ssize_t tls_push(gnutls_transport_ptr_t p, const void *data, size_t n)
{
    return send((int)(intptr_t)p, data, n, MSG_NOSIGNAL);
}

static ssize_t tls_pull(gnutls_transport_ptr_t p, void *data, size_t n)
{
    return recv((int)(intptr_t)p, data, n, 0);
}

static int tls_pull_timeout(gnutls_transport_ptr_t p, unsigned ms)
{
    struct pollfd pfd = {.fd = (int)(intptr_t)p, .events = POLLIN};
    return poll(&pfd, 1, ms == GNUTLS_INDEFINITE_TIMEOUT ? -1 : (int)ms);
}

/* The TLS handshake and the certificate's verification, within deadline_ns. */
static enum tdm_bh_fail tls_start(const struct tdm_bh_target *t, struct tdm_bh_conn *c,
                                  uint64_t deadline_ns)
{
    if (gnutls_init(&c->tls, GNUTLS_CLIENT | GNUTLS_NONBLOCK) != GNUTLS_E_SUCCESS) {
        c->tls = NULL;
        tdm_err_set(TDM_ENOMEM, "TLS: out of memory");
        return TDM_BH_NOMEM;
    }
    gnutls_session_t s = c->tls;
    unsigned char ip[16];
    bool literal = inet_pton(AF_INET, t->host, ip) == 1 || inet_pton(AF_INET6, t->host, ip) == 1;
    if (gnutls_set_default_priority(s) != GNUTLS_E_SUCCESS ||
        gnutls_credentials_set(s, GNUTLS_CRD_CERTIFICATE, t->tls_creds) != GNUTLS_E_SUCCESS ||
        (!literal && gnutls_server_name_set(s, GNUTLS_NAME_DNS, t->host, strlen(t->host)))) {
        tdm_err_set(TDM_EINTERNAL, "TLS to %s:%s: cannot set the session up", t->host, t->port);
        return TDM_BH_CONNECT;
    }
    gnutls_session_set_verify_cert(s, t->host, 0);
    gnutls_transport_set_ptr(s, (gnutls_transport_ptr_t)(intptr_t)c->fd);
    gnutls_transport_set_push_function(s, tls_push);
    gnutls_transport_set_pull_function(s, tls_pull);
    gnutls_transport_set_pull_timeout_function(s, tls_pull_timeout);
    gnutls_handshake_set_timeout(s, 0); /* ours: deadline_ns */
    for (;;) {
        int r = gnutls_handshake(s);
        if (r == GNUTLS_E_SUCCESS) return TDM_BH_OK;
        if (r == GNUTLS_E_AGAIN || r == GNUTLS_E_INTERRUPTED) {
            int w = wait_fd(c->fd, io_events(c, POLLIN), deadline_ns);
            if (w > 0) continue;
            tdm_err_set(TDM_ETIMEDOUT, "TLS to %s:%s: handshake %s", t->host, t->port,
                        w == 0 ? "timed out" : strerror(errno));
            return TDM_BH_CONNECT;
        }
        if (!gnutls_error_is_fatal(r)) continue; /* a warning alert */
        if (r == GNUTLS_E_CERTIFICATE_VERIFICATION_ERROR) {
            gnutls_datum_t why = {NULL, 0};
            unsigned st = gnutls_session_get_verify_cert_status(s);
            gnutls_certificate_verification_status_print(st, gnutls_certificate_type_get(s), &why,
                                                         0);
            for (size_t n = why.data ? strlen((char *)why.data) : 0;
                 n > 0 && why.data[n - 1] == ' ';)
                why.data[--n] = '\0';
            tdm_err_set(TDM_EPEER, "TLS to %s:%s: the server's certificate is refused: %s", t->host,
                        t->port, why.data ? (const char *)why.data : "not trusted");
            gnutls_free(why.data);
        } else {
            tdm_err_set(TDM_EPEER, "TLS to %s:%s: handshake failed: %s", t->host, t->port,
                        gnutls_strerror(r));
        }
        return TDM_BH_CONNECT;
    }
}

static enum tdm_bh_fail send_all(struct tdm_bh_conn *c, const char *p, size_t n,
                                 uint64_t deadline_ns)
{
    while (n > 0) {
        ssize_t w = io_send(c, p, n);
        if (w > 0) {
            p += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int r = wait_fd(c->fd, io_events(c, POLLOUT), deadline_ns);
            if (r == 0) {
                tdm_err_set(TDM_ETIMEDOUT, "timed out sending the request");
                return TDM_BH_TIMEOUT;
            }
            if (r > 0) continue;
        }
        tdm_err_set(TDM_EPEER, "sending the request: %s", io_error(c));
        return TDM_BH_SEND;
    }
    return TDM_BH_OK;
}

static bool pull_body(void *ctx, const char *data, size_t n)
{
    struct tdm_bh_conn *c = ctx;
    TDM_ASSERT(c->out_len + n <= sizeof c->out);
    memcpy(c->out + c->out_len, data, n);
    c->out_len += n;
    return true;
}

/* Connects and sends; on success the connection is ready for pump(). */
static enum tdm_bh_fail conn_open(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                                  const struct tdm_bh_handler *h, struct tdm_bh_conn **out)
{
    enum tdm_bh_fail f;
    uint64_t connect_deadline = tdm_now_ns() + rq->connect_timeout_ms * 1000000ull;
    if (connect_deadline > rq->deadline_ns) connect_deadline = rq->deadline_ns;

    struct tdm_bh_conn *c = calloc(1, sizeof *c);
    char *head = malloc(TDM_BH_MAX_HEAD_BYTES + 1);
    char *req = NULL;
    if (!c || !head) {
        tdm_err_set(TDM_ENOMEM, "out of memory");
        f = TDM_BH_NOMEM;
        goto out_free;
    }
    c->fd = -1;
    rx_start(&c->rx, head, h ? h : &c->pull);
    c->pull = (struct tdm_bh_handler){NULL, pull_body, c};

    /* Request line and headers, then the body, in one buffer: one send for small requests. */
    char auth[600] = "";
    if (rq->bearer) {
        if (strlen(rq->bearer) > 512 || strpbrk(rq->bearer, "\r\n")) {
            tdm_err_set(TDM_EINVAL, "the API key is over 512 bytes or holds a line break");
            f = TDM_BH_PROTOCOL;
            goto out_free;
        }
        snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", rq->bearer);
    }
    size_t body_len = rq->body ? rq->body_len : 0;
    size_t cap = 2048 + strlen(t->base_path) + strlen(rq->path) + strlen(auth) + body_len;
    req = malloc(cap);
    if (!req) {
        tdm_err_set(TDM_ENOMEM, "out of memory");
        f = TDM_BH_NOMEM;
        goto out_free;
    }
    bool v6 = strchr(t->host, ':') != NULL;
    int hl = snprintf(req, cap,
                      "%s %s%s HTTP/1.1\r\nHost: %s%s%s:%s\r\nUser-Agent: tandem\r\n"
                      "Accept: */*\r\nConnection: close\r\n%s",
                      rq->method, t->base_path, rq->path, v6 ? "[" : "", t->host, v6 ? "]" : "",
                      t->port, auth);
    if (rq->body)
        hl += snprintf(req + hl, cap - (size_t)hl,
                       "Content-Type: application/json\r\nContent-Length: %zu\r\n", body_len);
    hl += snprintf(req + hl, cap - (size_t)hl, "\r\n");
    TDM_ASSERT((size_t)hl + body_len < cap);
    if (body_len) memcpy(req + hl, rq->body, body_len);

    if ((f = do_connect(t, connect_deadline, &c->fd))) goto out_free;
    if (t->tls && (f = tls_start(t, c, connect_deadline))) goto out_close;
    if ((f = send_all(c, req, (size_t)hl + body_len, rq->deadline_ns))) goto out_close;
    free(req);
    *out = c;
    return TDM_BH_OK;

out_close:
    if (c->tls) gnutls_deinit(c->tls);
    close(c->fd);
out_free:
    free(req);
    free(head);
    free(c);
    return f;
}

/* One receive step: feeds what one recv() returns (or notes the peer's close). TDM_BH_TIMEOUT
 * when deadline_ns passes with nothing received; the connection stays usable then. */
static enum tdm_bh_fail pump(struct tdm_bh_conn *c, uint64_t deadline_ns)
{
    if (c->failed) return c->failed;
    enum tdm_bh_fail f;
    for (;;) {
        ssize_t r = io_recv(c, c->raw, sizeof c->raw);
        if (r > 0) {
            f = feed(&c->rx, c->raw, (size_t)r);
            break;
        }
        if (r == 0) {
            if ((f = rx_close(&c->rx)) == TDM_BH_OK) return TDM_BH_OK;
            break;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(c->fd, io_events(c, POLLIN), deadline_ns);
            if (w > 0) continue;
            if (w == 0) {
                tdm_err_set(TDM_ETIMEDOUT, "the request timed out");
                return TDM_BH_TIMEOUT;
            }
        }
        tdm_err_set(TDM_EPEER, "receiving: %s", io_error(c));
        f = TDM_BH_TRUNCATED;
        break;
    }
    c->failed = f;
    return f;
}

void tdm_bh_close(tdm_bh_conn_t *c)
{
    if (!c) return;
    if (c->tls) gnutls_deinit(c->tls);
    if (c->fd >= 0) close(c->fd);
    free(c->rx.head);
    free(c);
}

enum tdm_bh_fail tdm_bh_request(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                                const struct tdm_bh_handler *h)
{
    static const struct tdm_bh_handler none = {0};
    struct tdm_bh_conn *c;
    enum tdm_bh_fail f = conn_open(t, rq, h ? h : &none, &c);
    if (f) return f;
    while (c->rx.state != RX_DONE)
        if ((f = pump(c, rq->deadline_ns))) break;
    tdm_bh_close(c);
    return f;
}

/* ---- pull mode ---- */

enum tdm_bh_fail tdm_bh_open(const struct tdm_bh_target *t, const struct tdm_bh_request *rq,
                             tdm_bh_conn_t **out)
{
    return conn_open(t, rq, NULL, out);
}

enum tdm_bh_fail tdm_bh_wait_head(tdm_bh_conn_t *c, uint64_t deadline_ns)
{
    while (!c->rx.head_done) {
        enum tdm_bh_fail f = pump(c, deadline_ns);
        if (f) return f;
    }
    return TDM_BH_OK;
}

int tdm_bh_status(const tdm_bh_conn_t *c)
{
    return c->rx.status;
}
const char *tdm_bh_content_type(const tdm_bh_conn_t *c)
{
    return c->rx.content_type;
}
int64_t tdm_bh_content_length(const tdm_bh_conn_t *c)
{
    return c->rx.content_length;
}
int tdm_bh_fd(const tdm_bh_conn_t *c)
{
    return c->fd;
}

enum tdm_bh_fail tdm_bh_read(tdm_bh_conn_t *c, char *buf, size_t cap, uint64_t deadline_ns,
                             size_t *n)
{
    TDM_ASSERT(c->rx.head_done && cap > 0);
    for (;;) {
        if (c->out_off < c->out_len) {
            size_t k = TDM_MIN(cap, c->out_len - c->out_off);
            memcpy(buf, c->out + c->out_off, k);
            c->out_off += k;
            *n = k;
            return TDM_BH_OK;
        }
        c->out_off = c->out_len = 0;
        if (c->rx.state == RX_DONE) {
            *n = 0;
            return TDM_BH_OK;
        }
        enum tdm_bh_fail f = pump(c, deadline_ns);
        if (f) return f;
    }
}
