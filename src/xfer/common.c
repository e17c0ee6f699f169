/*
 * The transport-independent pieces of the transfer engine: page-list validation and run merging,
 * immediate encoding, fault-injection parsing and decisions, printable addresses, the internal
 * wire header, packed remote-memory descriptors and the synchronous waiter.
 *
 * Everything here is a pure function of its arguments (fault decisions draw from the
 * counter-based RNG keyed on (seed, stream, sequence number), so a given spec and arrival order
 * always give the same fates). Bytes from peers (addresses, headers, hello payloads, packed
 * descriptors) are validated and never trusted; fuzz_xfer_wire exercises those parsers.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <gnutls/crypto.h>

#include "xfer/xfer_int.h"

/* ---- pages ---- */

tdm_status tdm_xfer_pages_check(const struct tdm_xfer_pages *p, uint64_t src_bytes,
                                uint64_t dst_bytes, uint32_t max_pages)
{
    if (!p || p->n_pages == 0 || !p->src_pages || !p->dst_pages)
        return tdm_err_set(TDM_EINVAL, "xfer: empty page list");
    if (p->n_pages > max_pages)
        return tdm_err_set(TDM_ERANGE, "xfer: %u pages in one write (cap %u)", p->n_pages,
                           max_pages);
    if (p->page_bytes == 0) return tdm_err_set(TDM_EINVAL, "xfer: page_bytes is 0");
    for (uint32_t i = 0; i < p->n_pages; i++) {
        uint64_t so, doff;
        if (__builtin_mul_overflow((uint64_t)p->src_pages[i], p->src_stride, &so) ||
            __builtin_add_overflow(so, p->src_offset, &so) || so > src_bytes ||
            src_bytes - so < p->page_bytes)
            return tdm_err_set(TDM_ERANGE, "xfer: source page %u (entry %u) outside the region",
                               p->src_pages[i], i);
        if (__builtin_mul_overflow((uint64_t)p->dst_pages[i], p->dst_stride, &doff) ||
            __builtin_add_overflow(doff, p->dst_offset, &doff) || doff > dst_bytes ||
            dst_bytes - doff < p->page_bytes)
            return tdm_err_set(TDM_ERANGE,
                               "xfer: destination page %u (entry %u) outside the region",
                               p->dst_pages[i], i);
    }
    return TDM_OK;
}

uint32_t tdm_xfer_pages_merge(const struct tdm_xfer_pages *p, uint64_t max_run_bytes,
                              struct tdm_xfer_run *runs)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->n_pages; i++) {
        uint64_t so = p->src_offset + (uint64_t)p->src_pages[i] * p->src_stride;
        uint64_t doff = p->dst_offset + (uint64_t)p->dst_pages[i] * p->dst_stride;
        if (n > 0) {
            struct tdm_xfer_run *r = &runs[n - 1];
            if (r->src_off + r->bytes == so && r->dst_off + r->bytes == doff &&
                r->bytes + p->page_bytes <= max_run_bytes) {
                r->bytes += p->page_bytes;
                r->n_pages++;
                continue;
            }
        }
        runs[n++] = (struct tdm_xfer_run){so, doff, p->page_bytes, i, 1};
    }
    return n;
}

/* ---- immediates ---- */

struct imm_layout {
    int slot_bits, epoch_bits, index_bits;
};

static struct imm_layout imm_layout(int imm_bits)
{
    return imm_bits >= 64 ? (struct imm_layout){24, 16, 24} : (struct imm_layout){12, 8, 12};
}

tdm_status tdm_xfer_imm_encode(int imm_bits, const struct tdm_xfer_imm *imm, uint64_t *out)
{
    struct imm_layout l = imm_layout(imm_bits);
    if (imm->slot >> l.slot_bits || imm->epoch >> l.epoch_bits || imm->index >> l.index_bits)
        return tdm_err_set(TDM_ERANGE,
                           "xfer: immediate (slot %u, epoch %u, index %u) does not fit %d bits",
                           imm->slot, imm->epoch, imm->index, imm_bits);
    *out = ((uint64_t)imm->slot << (l.epoch_bits + l.index_bits)) |
           ((uint64_t)imm->epoch << l.index_bits) | imm->index;
    return TDM_OK;
}

void tdm_xfer_imm_decode(int imm_bits, uint64_t data, struct tdm_xfer_imm *out)
{
    struct imm_layout l = imm_layout(imm_bits);
    out->index = (uint32_t)(data & ((1ull << l.index_bits) - 1));
    out->epoch = (uint32_t)((data >> l.index_bits) & ((1ull << l.epoch_bits) - 1));
    out->slot = (uint32_t)((data >> (l.index_bits + l.epoch_bits)) & ((1ull << l.slot_bits) - 1));
}

/* ---- fault injection ---- */

static bool parse_prob(const char *v, double *out)
{
    double d;
    if (!tdm_parse_f64(v, &d) || !(d >= 0.0 && d <= 1.0)) return false;
    *out = d;
    return true;
}

tdm_status tdm_xfer_faults_parse(const char *spec, struct tdm_xfer_faults *out)
{
    struct tdm_xfer_faults f = {.seed = 1};
    if (spec && *spec) {
        if (strlen(spec) > 512) return tdm_err_set(TDM_EINVAL, "xfer faults: spec too long");
        char buf[520];
        strcpy(buf, spec);
        char *save = NULL;
        for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(tok, '=');
            if (!eq) return tdm_err_set(TDM_EINVAL, "xfer faults: '%s' is not key=value", tok);
            *eq = '\0';
            const char *k = tok, *v = eq + 1;
            bool ok;
            int64_t i64;
            if (!strcmp(k, "drop_imm"))
                ok = parse_prob(v, &f.drop_imm);
            else if (!strcmp(k, "dup_imm"))
                ok = parse_prob(v, &f.dup_imm);
            else if (!strcmp(k, "reorder_imm"))
                ok = parse_prob(v, &f.reorder_imm);
            else if (!strcmp(k, "fail_write"))
                ok = parse_prob(v, &f.fail_write);
            else if (!strcmp(k, "delay_imm_ms")) {
                ok = tdm_parse_i64(v, 0, 60000, &i64);
                f.delay_imm_ms = (int)i64;
            } else if (!strcmp(k, "seed")) {
                ok = tdm_parse_i64(v, 0, INT64_MAX, &i64);
                f.seed = (uint64_t)i64;
            } else
                return tdm_err_set(TDM_EINVAL, "xfer faults: unknown key '%s'", k);
            if (!ok) return tdm_err_set(TDM_EINVAL, "xfer faults: bad value for %s: '%s'", k, v);
        }
    }
    if (f.drop_imm + f.dup_imm + f.reorder_imm > 1.0)
        return tdm_err_set(TDM_EINVAL, "xfer faults: drop_imm + dup_imm + reorder_imm > 1");
    f.any = f.drop_imm > 0 || f.dup_imm > 0 || f.reorder_imm > 0 || f.delay_imm_ms > 0 ||
            f.fail_write > 0;
    *out = f;
    return TDM_OK;
}

/* Streams of the counter-based RNG, so imm and write decisions never share draws. */
enum { FAULT_STREAM_IMM = 0x494d4d, FAULT_STREAM_WRITE = 0x575254 };

enum tdm_xfer_imm_fate tdm_xfer_faults_imm(const struct tdm_xfer_faults *f, uint64_t seq)
{
    if (!f->any) return TDM_XFER_IMM_DELIVER;
    double u = tdm_rng_uniform(f->seed, FAULT_STREAM_IMM, (uint32_t)seq, (uint32_t)(seq >> 32));
    if (u < f->drop_imm) return TDM_XFER_IMM_DROP;
    if (u < f->drop_imm + f->dup_imm) return TDM_XFER_IMM_DUP;
    if (u < f->drop_imm + f->dup_imm + f->reorder_imm) return TDM_XFER_IMM_REORDER;
    return TDM_XFER_IMM_DELIVER;
}

bool tdm_xfer_faults_write(const struct tdm_xfer_faults *f, uint64_t seq)
{
    if (f->fail_write <= 0) return false;
    return tdm_rng_uniform(f->seed, FAULT_STREAM_WRITE, (uint32_t)seq, (uint32_t)(seq >> 32)) <
           f->fail_write;
}

/* ---- printable addresses ---- */

tdm_status tdm_xfer_addr_encode(const void *raw, size_t n, char *buf, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    if (cap < 3 + 2 * n + 1) return tdm_err_set(TDM_ERANGE, "xfer: address buffer too small");
    memcpy(buf, "x1:", 3);
    const uint8_t *p = raw;
    for (size_t i = 0; i < n; i++) {
        buf[3 + 2 * i] = hex[p[i] >> 4];
        buf[3 + 2 * i + 1] = hex[p[i] & 15];
    }
    buf[3 + 2 * n] = '\0';
    return TDM_OK;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

tdm_status tdm_xfer_addr_decode(const char *s, void *raw, size_t cap, size_t *n)
{
    if (!s || strncmp(s, "x1:", 3) != 0)
        return tdm_err_set(TDM_EFORMAT, "xfer: address must start with 'x1:'");
    s += 3;
    size_t len = strnlen(s, 2 * cap + 2);
    if (len == 0 || len % 2) return tdm_err_set(TDM_EFORMAT, "xfer: address has odd length");
    if (len / 2 > cap) return tdm_err_set(TDM_ERANGE, "xfer: address longer than %zu bytes", cap);
    uint8_t *p = raw;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return tdm_err_set(TDM_EFORMAT, "xfer: address is not hex");
        p[i] = (uint8_t)(hi << 4 | lo);
    }
    *n = len / 2;
    return TDM_OK;
}

/* ---- wire ---- */

void tdm_xfer_wire_put_hdr(uint8_t *buf, uint8_t type, uint64_t nonce, uint32_t payload_bytes)
{
    tdm_put_u32(buf, TDM_XFER_WIRE_MAGIC);
    buf[4] = TDM_XFER_WIRE_VERSION;
    buf[5] = type;
    tdm_put_u16(buf + 6, 0);
    tdm_put_u64(buf + 8, nonce);
    tdm_put_u32(buf + 16, payload_bytes);
}

tdm_status tdm_xfer_wire_parse(const uint8_t *buf, size_t n, struct tdm_xfer_wire_hdr *hdr,
                               const uint8_t **payload)
{
    if (n < TDM_XFER_WIRE_HDR) return tdm_err_set(TDM_EFORMAT, "xfer: short message (%zu)", n);
    if (tdm_get_u32(buf) != TDM_XFER_WIRE_MAGIC)
        return tdm_err_set(TDM_EFORMAT, "xfer: bad message magic");
    if (buf[4] != TDM_XFER_WIRE_VERSION)
        return tdm_err_set(TDM_EFORMAT, "xfer: message version %u", buf[4]);
    uint8_t type = buf[5];
    if (type < TDM_XFER_MSG_HELLO || type > TDM_XFER_MSG_LAST)
        return tdm_err_set(TDM_EFORMAT, "xfer: unknown message type %u", type);
    uint32_t len = tdm_get_u32(buf + 16);
    if ((uint64_t)len != n - TDM_XFER_WIRE_HDR)
        return tdm_err_set(TDM_EFORMAT, "xfer: payload length %u but %zu bytes arrived", len,
                           n - TDM_XFER_WIRE_HDR);
    if (type == TDM_XFER_MSG_IMM && len != 8)
        return tdm_err_set(TDM_EFORMAT, "xfer: immediate message of %u bytes", len);
    if (type == TDM_XFER_MSG_AUTH && len != TDM_XFER_PROOF)
        return tdm_err_set(TDM_EFORMAT, "xfer: proof of %u bytes", len);
    if (type == TDM_XFER_MSG_HEARTBEAT && len != 0)
        return tdm_err_set(TDM_EFORMAT, "xfer: heartbeat with payload");
    hdr->type = type;
    hdr->nonce = tdm_get_u64(buf + 8);
    hdr->payload_bytes = len;
    *payload = buf + TDM_XFER_WIRE_HDR;
    return TDM_OK;
}

size_t tdm_xfer_wire_hello_put(uint8_t *buf, size_t cap, int imm_bits, const void *addr,
                               size_t addr_bytes, uint8_t flags,
                               const uint8_t challenge[TDM_XFER_CHALLENGE])
{
    size_t n = 3 + addr_bytes + 1 + TDM_XFER_CHALLENGE;
    if (cap < n || addr_bytes > UINT16_MAX) return 0;
    buf[0] = (uint8_t)imm_bits;
    tdm_put_u16(buf + 1, (uint16_t)addr_bytes);
    memcpy(buf + 3, addr, addr_bytes);
    buf[3 + addr_bytes] = flags;
    memcpy(buf + 4 + addr_bytes, challenge, TDM_XFER_CHALLENGE);
    return n;
}

tdm_status tdm_xfer_wire_hello_parse(const uint8_t *p, size_t n, struct tdm_xfer_hello *out)
{
    if (n < 3) return tdm_err_set(TDM_EFORMAT, "xfer: short hello");
    if (p[0] != 32 && p[0] != 64) return tdm_err_set(TDM_EFORMAT, "xfer: hello imm_bits %u", p[0]);
    size_t len = tdm_get_u16(p + 1);
    if (len == 0 || len + 1 + TDM_XFER_CHALLENGE != n - 3)
        return tdm_err_set(TDM_EFORMAT, "xfer: hello address of %zu bytes in %zu", len, n - 3);
    if (p[3 + len] & ~TDM_XFER_HELLO_FLAGS)
        return tdm_err_set(TDM_EFORMAT, "xfer: hello flags %#x", p[3 + len]);
    *out = (struct tdm_xfer_hello){.imm_bits = p[0],
                                   .addr = p + 3,
                                   .addr_bytes = len,
                                   .flags = p[3 + len],
                                   .challenge = p + 4 + len};
    return TDM_OK;
}

size_t tdm_xfer_wire_rails_put(uint8_t *buf, size_t cap, int n_rails, const uint8_t *const *addr,
                               const size_t *addr_bytes)
{
    if (n_rails < 2 || n_rails > TDM_XFER_MAX_RAILS || cap < 1) return 0;
    size_t at = 1;
    buf[0] = (uint8_t)n_rails;
    for (int r = 1; r < n_rails; r++) {
        size_t len = addr_bytes[r];
        if (len == 0 || len > TDM_XFER_RAIL_ADDR_MAX || cap - at < 2 + len) return 0;
        tdm_put_u16(buf + at, (uint16_t)len);
        memcpy(buf + at + 2, addr[r], len);
        at += 2 + len;
    }
    return at;
}

tdm_status tdm_xfer_wire_rails_parse(const uint8_t *p, size_t n, struct tdm_xfer_rails_msg *out)
{
    if (n < 1) return tdm_err_set(TDM_EFORMAT, "xfer: empty rails message");
    struct tdm_xfer_rails_msg m = {.n_rails = p[0]};
    if (m.n_rails < 2 || m.n_rails > TDM_XFER_MAX_RAILS)
        return tdm_err_set(TDM_EFORMAT, "xfer: rails message of %d rails", m.n_rails);
    size_t at = 1;
    for (int r = 1; r < m.n_rails; r++) {
        if (n - at < 2) return tdm_err_set(TDM_EFORMAT, "xfer: rails message cut at rail %d", r);
        size_t len = tdm_get_u16(p + at);
        if (len == 0 || len > TDM_XFER_RAIL_ADDR_MAX || n - at - 2 < len)
            return tdm_err_set(TDM_EFORMAT, "xfer: rail %d's address of %zu bytes", r, len);
        m.addr[r] = p + at + 2;
        m.addr_bytes[r] = len;
        at += 2 + len;
    }
    if (at != n) return tdm_err_set(TDM_EFORMAT, "xfer: %zu bytes after the rails", n - at);
    *out = m;
    return TDM_OK;
}

bool tdm_xfer_random(void *buf, size_t n)
{
    return gnutls_rnd(GNUTLS_RND_KEY, buf, n) == 0;
}

/* ---- packed remote memory ----
 *   u64 addr | u64 key | u64 bytes | u32 kind | u32 extra rails (0) | 64 bytes ipc handle  = 96
 * A rail set's host region (extra rails e, 1 .. TDM_XFER_MAX_RAILS - 1): the 64 bytes are
 * e u64 keys (rails 1 .. e), then zeros. */

void tdm_xfer_rmem_pack(const struct tdm_xfer_rmem *r, uint8_t out[TDM_XFER_RMEM_WIRE])
{
    tdm_put_u64(out, r->addr);
    tdm_put_u64(out + 8, r->key);
    tdm_put_u64(out + 16, r->bytes);
    tdm_put_u32(out + 24, r->kind);
    if (r->kind == TDM_XFER_MEM_HOST && r->rails > 1 && r->rails <= TDM_XFER_MAX_RAILS) {
        /* a rail set's host region: the other rails' keys where an IPC handle would be */
        tdm_put_u32(out + 28, r->rails - 1);
        memset(out + 32, 0, 64);
        for (uint32_t k = 1; k < r->rails; k++)
            tdm_put_u64(out + 32 + 8 * (k - 1), r->rail_key[k]);
        return;
    }
    tdm_put_u32(out + 28, 0);
    memcpy(out + 32, r->ipc_handle, 64);
}

tdm_status tdm_xfer_rmem_unpack(const uint8_t *in, size_t bytes, struct tdm_xfer_rmem *out)
{
    if (bytes < TDM_XFER_RMEM_WIRE)
        return tdm_err_set(TDM_EFORMAT, "xfer: remote memory descriptor of %zu bytes", bytes);
    struct tdm_xfer_rmem r;
    r.addr = tdm_get_u64(in);
    r.key = tdm_get_u64(in + 8);
    r.bytes = tdm_get_u64(in + 16);
    r.kind = tdm_get_u32(in + 24);
    if (r.kind != TDM_XFER_MEM_HOST && r.kind != TDM_XFER_MEM_CUDA)
        return tdm_err_set(TDM_EFORMAT, "xfer: remote memory kind %u", r.kind);
    uint32_t extra = tdm_get_u32(in + 28); /* rails beyond the first (a rail set's host region) */
    if (extra && (r.kind != TDM_XFER_MEM_HOST || extra >= TDM_XFER_MAX_RAILS))
        return tdm_err_set(TDM_EFORMAT, "xfer: %u more rails for a region of kind %u", extra,
                           r.kind);
    if (r.bytes == 0 || r.addr + r.bytes < r.addr)
        return tdm_err_set(TDM_EFORMAT, "xfer: remote memory range wraps or is empty");
    memset(r.ipc_handle, 0, sizeof r.ipc_handle);
    r.rails = 0;
    memset(r.rail_key, 0, sizeof r.rail_key);
    if (!extra) {
        memcpy(r.ipc_handle, in + 32, 64);
    } else {
        for (size_t i = 8 * extra; i < 64; i++)
            if (in[32 + i]) return tdm_err_set(TDM_EFORMAT, "xfer: bytes after the rail keys");
        r.rails = extra + 1;
        r.rail_key[0] = r.key;
        for (uint32_t k = 1; k <= extra; k++)
            r.rail_key[k] = tdm_get_u64(in + 32 + 8 * (k - 1));
    }
    *out = r;
    return TDM_OK;
}

/* ---- sync waiter ---- */

void tdm_xfer_sync_init(struct tdm_xfer_sync *s)
{
    memset(s, 0, sizeof(*s));
    pthread_mutex_init(&s->mu, NULL);
    tdm_cond_init_monotonic(&s->cv);
}

void tdm_xfer_sync_destroy(struct tdm_xfer_sync *s)
{
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

void tdm_xfer_sync_add(struct tdm_xfer_sync *s, int n)
{
    pthread_mutex_lock(&s->mu);
    s->pending += n;
    pthread_mutex_unlock(&s->mu);
}

void tdm_xfer_sync_done(void *ctx, tdm_status st)
{
    struct tdm_xfer_sync *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (st != TDM_OK && s->first_error == TDM_OK) {
        s->first_error = st;
        snprintf(s->first_error_msg, sizeof(s->first_error_msg), "%s", tdm_err_msg());
    }
    s->pending--;
    /* only a thread that waits, and only once what it waits for holds: no wake-up per op */
    if (s->waiters && s->pending < s->wake_below) pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

tdm_status tdm_xfer_sync_wait_below(struct tdm_xfer_sync *s, int n, int timeout_ms)
{
    struct timespec ts = tdm_deadline_ms(CLOCK_MONOTONIC, timeout_ms);
    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (s->pending >= n && rc != ETIMEDOUT) {
        s->waiters++;
        s->wake_below = s->waiters > 1 ? TDM_MAX(s->wake_below, n) : n;
        rc = pthread_cond_timedwait(&s->cv, &s->mu, &ts);
        s->waiters--;
    }
    tdm_status st = s->pending >= n ? TDM_ETIMEDOUT : s->first_error;
    int pending = s->pending;
    char msg[256];
    snprintf(msg, sizeof(msg), "%s", s->first_error_msg);
    pthread_mutex_unlock(&s->mu);
    if (st == TDM_ETIMEDOUT)
        return tdm_err_set(st, "xfer: %d operations still pending after %d ms", pending,
                           timeout_ms);
    if (st != TDM_OK) return tdm_err_set(st, "%s", msg);
    return TDM_OK;
}

tdm_status tdm_xfer_sync_wait(struct tdm_xfer_sync *s, int timeout_ms)
{
    return tdm_xfer_sync_wait_below(s, 1, timeout_ms);
}

struct tdm_xfer_pages tdm_xfer_pages_one(uint64_t src_offset, uint64_t dst_offset, uint64_t bytes)
{
    static const uint32_t zero = 0;
    return (struct tdm_xfer_pages){.src_pages = &zero,
                                   .dst_pages = &zero,
                                   .n_pages = 1,
                                   .page_bytes = bytes,
                                   .src_offset = src_offset,
                                   .dst_offset = dst_offset};
}

/* ---- the CUDA IPC transport when the library is built without CUDA ---- */
#ifndef TDM_HAVE_CUDA
static tdm_status no_cuda(void)
{
    return tdm_err_set(TDM_EUNSUPPORTED, "xfer: built without CUDA");
}
tdm_status tdm_xfer_cuda_create(int device, int max_pending, tdm_xfer_cuda_t **out)
{
    return no_cuda();
}
void tdm_xfer_cuda_destroy(tdm_xfer_cuda_t *c) {}
tdm_status tdm_xfer_cuda_export(void *dptr, size_t bytes, struct tdm_xfer_rmem *out)
{
    return no_cuda();
}
tdm_status tdm_xfer_cuda_open(const struct tdm_xfer_rmem *r, void **dptr)
{
    return no_cuda();
}
void tdm_xfer_cuda_close(void *dptr) {}
tdm_status tdm_xfer_cuda_alloc_size(const void *dptr, size_t *bytes)
{
    return no_cuda();
}
tdm_status tdm_xfer_cuda_device_of(const void *dptr, int *device)
{
    return no_cuda();
}
tdm_status tdm_xfer_cuda_write_pages(tdm_xfer_cuda_t *c, const void *src, size_t src_bytes,
                                     void *dst, size_t dst_bytes,
                                     const struct tdm_xfer_pages *pages,
                                     const struct tdm_xfer_imm *imm, tdm_xfer_counters_t *counters,
                                     tdm_xfer_done_fn done, void *ctx)
{
    return no_cuda();
}
int tdm_xfer_cuda_poll(tdm_xfer_cuda_t *c)
{
    return 0;
}
tdm_status tdm_xfer_cuda_drain(tdm_xfer_cuda_t *c, int timeout_ms)
{
    return no_cuda();
}
void *tdm_xfer_cuda_host_alloc(size_t bytes)
{
    return NULL;
}
void tdm_xfer_cuda_host_free(void *p) {}
#endif
