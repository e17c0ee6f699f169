/*
 * The disaggregation control messages on the wire: fixed little-endian fields behind a magic and
 * a version, every length checked against the buffer before it is read. Bytes come from a peer
 * process, so decode validates everything (there is a libFuzzer target for it).
 *
 *   header: "TDMD" u8 version(1) u8 type u16 reserved
 *   PREFILL: u64 req_id, u32 slot, epoch, n_tokens, chunk, n_layers, n_kv_heads, head_dim,
 *            page_size, elem_bytes, kv_head_begin, kv_head_end, d_model, vocab, n_pages,
 *            u8 want_logits, u8[3] pad, u64 dst_layer_stride, ctx_offset,
 *            rmem kv[96], rmem ctx[96], i32 tokens[n_tokens], u32 pages[n_pages]
 *   NACK:    u32 slot, epoch, i32 status, u16 len, char error[len]
 *   CANCEL, CANCEL_ACK: u32 slot, epoch
 */
#include <string.h>

#include "tandem/disagg.h"

#define HDR           8
#define PREFILL_FIXED (8 + 15 * 4 + 4 + 8 + 8 + 2 * TDM_XFER_RMEM_WIRE)
#define MAX_TOKENS    (1u << 24)

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

size_t tdm_disagg_prefill_msg_size(uint32_t n_tokens, uint32_t n_pages)
{
    return HDR + PREFILL_FIXED + 4 * (size_t)n_tokens + 4 * (size_t)n_pages;
}

uint32_t tdm_disagg_expected_writes(uint32_t n_tokens, uint32_t chunk, uint32_t n_layers)
{
    if (!chunk) return 0;
    return (n_tokens + chunk - 1) / chunk * n_layers + 1;
}

size_t tdm_disagg_msg_encode(const struct tdm_disagg_msg *m, uint8_t *buf, size_t cap)
{
    size_t need;
    switch (m->type) {
    case TDM_DMSG_PREFILL:
        need = tdm_disagg_prefill_msg_size(m->prefill.n_tokens, m->prefill.n_pages);
        break;
    case TDM_DMSG_NACK:
        need = HDR + 14 + strnlen(m->error, TDM_DMSG_MAX_ERROR);
        break;
    case TDM_DMSG_CANCEL:
    case TDM_DMSG_CANCEL_ACK:
        need = HDR + 8;
        break;
    default:
        return 0;
    }
    if (need > cap) return 0;
    memcpy(buf, "TDMD", 4);
    buf[4] = 1;
    buf[5] = (uint8_t)m->type;
    buf[6] = buf[7] = 0;
    uint8_t *p = buf + HDR;
    if (m->type == TDM_DMSG_PREFILL) {
        const struct tdm_disagg_prefill_msg *f = &m->prefill;
        put64(p, f->req_id);
        p += 8;
        const uint32_t u[] = {f->slot,       f->epoch,         f->n_tokens,    f->chunk,
                              f->n_layers,   f->n_kv_heads,    f->head_dim,    f->page_size,
                              f->elem_bytes, f->kv_head_begin, f->kv_head_end, f->d_model,
                              f->vocab,      f->n_pages};
        for (size_t i = 0; i < sizeof u / sizeof *u; i++, p += 4)
            put32(p, u[i]);
        put32(p, 0); /* the 15th u32 slot is reserved */
        p += 4;
        p[0] = f->want_logits;
        p[1] = p[2] = p[3] = 0;
        p += 4;
        put64(p, f->dst_layer_stride);
        p += 8;
        put64(p, f->ctx_offset);
        p += 8;
        tdm_xfer_rmem_pack(&f->kv, p);
        p += TDM_XFER_RMEM_WIRE;
        tdm_xfer_rmem_pack(&f->ctx, p);
        p += TDM_XFER_RMEM_WIRE;
        for (uint32_t i = 0; i < f->n_tokens; i++, p += 4)
            put32(p, (uint32_t)f->tokens[i]);
        for (uint32_t i = 0; i < f->n_pages; i++, p += 4)
            put32(p, f->pages[i]);
    } else if (m->type == TDM_DMSG_NACK) {
        size_t n = strnlen(m->error, TDM_DMSG_MAX_ERROR);
        put32(p, m->slot);
        put32(p + 4, m->epoch);
        put32(p + 8, (uint32_t)m->status);
        p[12] = (uint8_t)n;
        p[13] = (uint8_t)(n >> 8);
        memcpy(p + 14, m->error, n);
    } else {
        put32(p, m->slot);
        put32(p + 4, m->epoch);
    }
    return need;
}

tdm_status tdm_disagg_msg_decode(const uint8_t *buf, size_t len, struct tdm_disagg_msg *out,
                                 int32_t *tokens_out, uint32_t tokens_cap, uint32_t *pages_out,
                                 uint32_t pages_cap)
{
    memset(out, 0, sizeof *out);
    if (len < HDR || memcmp(buf, "TDMD", 4))
        return tdm_err_set(TDM_EFORMAT, "disagg: not a tandem control message");
    if (buf[6] || buf[7]) return tdm_err_set(TDM_EFORMAT, "disagg: reserved header bytes set");
    if (buf[4] != 1)
        return tdm_err_set(TDM_EFORMAT, "disagg: control message version %u (expected 1)", buf[4]);
    const uint8_t *p = buf + HDR;
    size_t body = len - HDR;
    out->type = (enum tdm_disagg_msg_type)buf[5];
    switch (out->type) {
    case TDM_DMSG_CANCEL:
    case TDM_DMSG_CANCEL_ACK:
        if (body != 8) return tdm_err_set(TDM_EFORMAT, "disagg: cancel message of %zu bytes", len);
        out->slot = get32(p);
        out->epoch = get32(p + 4);
        return TDM_OK;
    case TDM_DMSG_NACK: {
        if (body < 14) return tdm_err_set(TDM_EFORMAT, "disagg: short NACK");
        out->slot = get32(p);
        out->epoch = get32(p + 4);
        out->status = (int32_t)get32(p + 8);
        size_t n = (size_t)p[12] | (size_t)p[13] << 8;
        if (n > TDM_DMSG_MAX_ERROR || body != 14 + n)
            return tdm_err_set(TDM_EFORMAT, "disagg: NACK message length mismatch");
        memcpy(out->error, p + 14, n);
        out->error[n] = '\0';
        for (size_t i = 0; i < n; i++) /* keep it printable for logs */
            if ((unsigned char)out->error[i] < 0x20 || out->error[i] == 0x7f) out->error[i] = '?';
        return TDM_OK;
    }
    case TDM_DMSG_PREFILL:
        break;
    default:
        return tdm_err_set(TDM_EFORMAT, "disagg: unknown control message type %u", buf[5]);
    }
    if (body < PREFILL_FIXED) return tdm_err_set(TDM_EFORMAT, "disagg: short prefill request");
    struct tdm_disagg_prefill_msg *f = &out->prefill;
    f->req_id = get64(p);
    p += 8;
    uint32_t u[15];
    for (int i = 0; i < 15; i++, p += 4)
        u[i] = get32(p);
    f->slot = u[0];
    f->epoch = u[1];
    f->n_tokens = u[2];
    f->chunk = u[3];
    f->n_layers = u[4];
    f->n_kv_heads = u[5];
    f->head_dim = u[6];
    f->page_size = u[7];
    f->elem_bytes = u[8];
    f->kv_head_begin = u[9];
    f->kv_head_end = u[10];
    f->d_model = u[11];
    f->vocab = u[12];
    f->n_pages = u[13];
    f->want_logits = p[0];
    if (u[14] || p[1] || p[2] || p[3] || f->want_logits > 1)
        return tdm_err_set(TDM_EFORMAT, "disagg: reserved bytes set in a prefill request");
    p += 4;
    f->dst_layer_stride = get64(p);
    p += 8;
    f->ctx_offset = get64(p);
    p += 8;
    tdm_status st = tdm_xfer_rmem_unpack(p, TDM_XFER_RMEM_WIRE, &f->kv);
    if (st != TDM_OK) return st;
    p += TDM_XFER_RMEM_WIRE;
    if ((st = tdm_xfer_rmem_unpack(p, TDM_XFER_RMEM_WIRE, &f->ctx)) != TDM_OK) return st;
    p += TDM_XFER_RMEM_WIRE;
    if (!f->n_tokens || f->n_tokens > MAX_TOKENS || !f->n_pages || f->n_pages > MAX_TOKENS)
        return tdm_err_set(TDM_EFORMAT, "disagg: prefill request with %u tokens and %u pages",
                           f->n_tokens, f->n_pages);
    if (body != PREFILL_FIXED + 4 * (size_t)f->n_tokens + 4 * (size_t)f->n_pages)
        return tdm_err_set(TDM_EFORMAT, "disagg: prefill request length mismatch");
    if (f->n_tokens > tokens_cap || f->n_pages > pages_cap)
        return tdm_err_set(TDM_ERANGE,
                           "disagg: prefill request of %u tokens / %u pages is over "
                           "this node's limits (%u / %u)",
                           f->n_tokens, f->n_pages, tokens_cap, pages_cap);
    if (!f->page_size || !f->chunk || f->chunk % f->page_size || !f->n_layers || !f->n_kv_heads ||
        !f->head_dim || (f->elem_bytes != 2 && f->elem_bytes != 4) ||
        f->kv_head_begin >= f->kv_head_end || f->kv_head_end > f->n_kv_heads)
        return tdm_err_set(TDM_EFORMAT, "disagg: inconsistent geometry in a prefill request");
    if (f->n_pages != (f->n_tokens + f->page_size - 1) / f->page_size)
        return tdm_err_set(TDM_EFORMAT, "disagg: %u pages for %u tokens of page size %u",
                           f->n_pages, f->n_tokens, f->page_size);
    for (uint32_t i = 0; i < f->n_tokens; i++, p += 4)
        tokens_out[i] = (int32_t)get32(p);
    for (uint32_t i = 0; i < f->n_pages; i++, p += 4)
        pages_out[i] = get32(p);
    f->tokens = tokens_out;
    f->pages = pages_out;
    return TDM_OK;
}
