/*
 * The disaggregation control messages on the wire: fixed little-endian fields behind a magic and
 * a version, every length checked against the buffer before it is read. Bytes come from a peer
 * process, so decode validates everything (there is a libFuzzer target for it).
 *
 *   header: "TDMD" u8 version(1) u8 type u16 reserved
 *   PREFILL: u64 req_id, u32 slot, epoch, n_tokens, chunk, n_layers, n_kv_heads, head_dim,
 *            page_size, elem_bytes, kv_head_begin, kv_head_end, d_model, vocab, n_pages,
 *            kv_dtype (GGML's type id: 0 f32, 30 bf16, 1 f16; this was a reserved 0 before 2-byte
 *            pools, and f32 is still 0), u8 want_logits, u8 flags, u8[2] pad, u64 dst_layer_stride,
 *            ctx_offset, rmem kv[96], rmem ctx[96],
 *            [flags & HEAD: u64 head_fingerprint, u32 head_n_layers, head_n_heads,
 *             head_n_kv_heads, head_head_dim, head_d_ff, u32 head_feature_width,
 *             u64 head_dst_layer_stride, rmem head_kv[96]],
 *            [flags & CACHED: u32 cached_tokens, u32 reserved],
 *            [flags & SHARDED: u32 dst_ranks, src_ranks, dst_sets, src_sets, u64 shard_seed,
 *             (dst_ranks - 1) x {u64 dst_layer_stride, rmem kv[96]} (ranks 1 ..)],
 *            i32 tokens[n_tokens], u32 pages[n_pages]
 *            flags: bit 0 HEAD (want_head), bit 1 CACHED (cached_tokens > 0), bit 2 SHARDED
 *            (the decoder knows sharded transfers: both sides' schemes); the other bits are
 *            reserved. Without them the message is byte for byte what it was before heads,
 *            prefix caching and sharding existed, and a node that predates them refuses such a
 *            request (its reserved bytes are set; a decoder of TP 1 then asks it without
 *            SHARDED). With CACHED, pages name the pages from cached_tokens / page_size on.
 *            With SHARDED, both ranks counts shard kv_heads (tdm_tp_kv_shard_of) into the
 *            replica sets named, and the head range is the whole model's.
 *            head_feature_width (a reserved 0 before EAGLE-3 heads, and still 0 for a head
 *            of d_model-wide features): the floats of the head's feature in the context, a
 *            multiple n d_model, 1 <= n <= TDM_DISAGG_HEAD_MAX_FEATURES.
 *   NACK:    u32 slot, epoch, i32 status, u16 len, char error[len]
 *   CANCEL, CANCEL_ACK: u32 slot, epoch
 *   SCHEME:  u32 slot, epoch, ranks, kv_heads
 */
#include <string.h>

#include "tandem/disagg.h"

#define HDR           8
#define PREFILL_FIXED (8 + 15 * 4 + 4 + 8 + 8 + 2 * TDM_XFER_RMEM_WIRE)
#define HEAD_BLOCK    (8 + 6 * 4 + 8 + TDM_XFER_RMEM_WIRE)
#define CACHED_BLOCK  8
#define SHARD_FIXED   24
#define SHARD_RANK    (8 + TDM_XFER_RMEM_WIRE)
#define FLAG_HEAD     0x01
#define FLAG_CACHED   0x02
#define FLAG_SHARDED  0x04
#define MAX_TOKENS    (1u << 24)
#define MAX_GEOMETRY  (1u << 20) /* kv heads, head size, d_ff: sanity bounds on a peer's values */

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

static size_t shard_block(uint32_t dst_ranks)
{
    return dst_ranks ? SHARD_FIXED + (size_t)(dst_ranks - 1) * SHARD_RANK : 0;
}

size_t tdm_disagg_prefill_msg_size(uint32_t n_tokens, uint32_t n_pages, bool head, bool cached,
                                   uint32_t dst_ranks)
{
    return HDR + PREFILL_FIXED + (head ? HEAD_BLOCK : 0) + (cached ? CACHED_BLOCK : 0) +
           shard_block(dst_ranks) + 4 * (size_t)n_tokens + 4 * (size_t)n_pages;
}

size_t tdm_disagg_ctx_layout(uint32_t d_model, uint32_t feature_width, uint32_t vocab,
                             bool want_logits, size_t *feature_at, size_t *logits_at)
{
    size_t at = d_model;
    if (feature_at) *feature_at = at;
    at += feature_width;
    if (logits_at) *logits_at = at;
    if (want_logits) at += vocab;
    return at;
}

uint32_t tdm_disagg_expected_writes(uint32_t n_tokens, uint32_t cached, uint32_t chunk,
                                    uint32_t n_layers)
{
    if (!chunk || cached >= n_tokens) return 0;
    return (n_tokens - cached + chunk - 1) / chunk * n_layers + 1;
}

size_t tdm_disagg_msg_encode(const struct tdm_disagg_msg *m, uint8_t *buf, size_t cap)
{
    size_t need;
    switch (m->type) {
    case TDM_DMSG_PREFILL:
        if (m->prefill.sharded &&
            (!m->prefill.dst_ranks || m->prefill.dst_ranks > TDM_DISAGG_MAX_RANKS))
            return 0;
        need = tdm_disagg_prefill_msg_size(m->prefill.n_tokens, m->prefill.n_pages,
                                           m->prefill.want_head, m->prefill.cached_tokens > 0,
                                           m->prefill.sharded ? m->prefill.dst_ranks : 0);
        break;
    case TDM_DMSG_NACK:
        need = HDR + 14 + strnlen(m->error, TDM_DMSG_MAX_ERROR);
        break;
    case TDM_DMSG_CANCEL:
    case TDM_DMSG_CANCEL_ACK:
        need = HDR + 8;
        break;
    case TDM_DMSG_SCHEME:
        need = HDR + 16;
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
        put32(p, f->kv_dtype);
        p += 4;
        p[0] = f->want_logits;
        p[1] = (uint8_t)((f->want_head ? FLAG_HEAD : 0) | (f->cached_tokens ? FLAG_CACHED : 0) |
                         (f->sharded ? FLAG_SHARDED : 0));
        p[2] = p[3] = 0;
        p += 4;
        put64(p, f->dst_layer_stride);
        p += 8;
        put64(p, f->ctx_offset);
        p += 8;
        tdm_xfer_rmem_pack(&f->kv, p);
        p += TDM_XFER_RMEM_WIRE;
        tdm_xfer_rmem_pack(&f->ctx, p);
        p += TDM_XFER_RMEM_WIRE;
        if (f->want_head) {
            const struct tdm_disagg_head_req *h = &f->head;
            put64(p, h->fingerprint);
            p += 8;
            const uint32_t fw = h->feature_width == f->d_model ? 0 : h->feature_width;
            const uint32_t hu[] = {h->n_layers, h->n_heads, h->n_kv_heads,
                                   h->head_dim, h->d_ff,    fw};
            for (size_t i = 0; i < sizeof hu / sizeof *hu; i++, p += 4)
                put32(p, hu[i]);
            put64(p, h->dst_layer_stride);
            p += 8;
            tdm_xfer_rmem_pack(&h->kv, p);
            p += TDM_XFER_RMEM_WIRE;
        }
        if (f->cached_tokens) {
            put32(p, f->cached_tokens);
            put32(p + 4, 0);
            p += CACHED_BLOCK;
        }
        if (f->sharded) {
            const uint32_t su[] = {f->dst_ranks, f->src_ranks, f->dst_sets, f->src_sets};
            for (size_t i = 0; i < sizeof su / sizeof *su; i++, p += 4)
                put32(p, su[i]);
            put64(p, f->shard_seed);
            p += 8;
            for (uint32_t r = 1; r < f->dst_ranks; r++) {
                put64(p, f->ranks[r].dst_layer_stride);
                p += 8;
                tdm_xfer_rmem_pack(&f->ranks[r].kv, p);
                p += TDM_XFER_RMEM_WIRE;
            }
        }
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
        if (m->type == TDM_DMSG_SCHEME) {
            put32(p + 8, m->scheme_ranks);
            put32(p + 12, m->scheme_kv_heads);
        }
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
    case TDM_DMSG_SCHEME:
        if (body != 16) return tdm_err_set(TDM_EFORMAT, "disagg: scheme message of %zu bytes", len);
        out->slot = get32(p);
        out->epoch = get32(p + 4);
        out->scheme_ranks = get32(p + 8);
        out->scheme_kv_heads = get32(p + 12);
        if (!out->scheme_ranks || out->scheme_ranks > TDM_DISAGG_MAX_RANKS ||
            !out->scheme_kv_heads || out->scheme_kv_heads > MAX_GEOMETRY)
            return tdm_err_set(TDM_EFORMAT, "disagg: a prefill scheme of %u ranks over %u KV heads",
                               out->scheme_ranks, out->scheme_kv_heads);
        return TDM_OK;
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
    f->kv_dtype = u[14];
    f->want_logits = p[0];
    if ((p[1] & ~(FLAG_HEAD | FLAG_CACHED | FLAG_SHARDED)) || p[2] || p[3] || f->want_logits > 1)
        return tdm_err_set(TDM_EFORMAT, "disagg: reserved bytes set in a prefill request");
    f->want_head = (p[1] & FLAG_HEAD) != 0;
    const bool cached = (p[1] & FLAG_CACHED) != 0;
    f->sharded = (p[1] & FLAG_SHARDED) != 0;
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
    size_t fixed = PREFILL_FIXED + (f->want_head ? HEAD_BLOCK : 0) + (cached ? CACHED_BLOCK : 0);
    if (body < fixed) return tdm_err_set(TDM_EFORMAT, "disagg: short prefill request");
    if (f->want_head) {
        struct tdm_disagg_head_req *h = &f->head;
        h->fingerprint = get64(p);
        p += 8;
        uint32_t hu[6];
        for (int i = 0; i < 6; i++, p += 4)
            hu[i] = get32(p);
        h->n_layers = hu[0];
        h->n_heads = hu[1];
        h->n_kv_heads = hu[2];
        h->head_dim = hu[3];
        h->d_ff = hu[4];
        h->feature_width = hu[5] ? hu[5] : f->d_model;
        h->dst_layer_stride = get64(p);
        p += 8;
        if ((st = tdm_xfer_rmem_unpack(p, TDM_XFER_RMEM_WIRE, &h->kv)) != TDM_OK) return st;
        p += TDM_XFER_RMEM_WIRE;
        if (!h->n_layers || h->n_layers > TDM_DISAGG_HEAD_MAX_LAYERS || !h->n_heads ||
            h->n_heads > MAX_GEOMETRY || !h->n_kv_heads || h->n_kv_heads > h->n_heads ||
            !h->head_dim || h->head_dim > MAX_GEOMETRY || !h->d_ff || h->d_ff > MAX_GEOMETRY)
            return tdm_err_set(TDM_EFORMAT, "disagg: inconsistent head geometry in a prefill "
                                            "request");
        /* the context's feature: whole d_model rows of a few target layers (d_model itself
         * is written as 0, so that a message has one encoding) */
        if (!f->d_model || f->d_model > MAX_GEOMETRY || hu[5] == f->d_model ||
            h->feature_width % f->d_model ||
            h->feature_width / f->d_model > TDM_DISAGG_HEAD_MAX_FEATURES)
            return tdm_err_set(TDM_EFORMAT,
                               "disagg: a head feature of %u floats in a prefill request "
                               "(d_model %u)",
                               h->feature_width, f->d_model);
    }
    if (cached) {
        f->cached_tokens = get32(p);
        if (get32(p + 4))
            return tdm_err_set(TDM_EFORMAT, "disagg: reserved bytes set in a cached block");
        p += CACHED_BLOCK;
        if (!f->cached_tokens)
            return tdm_err_set(TDM_EFORMAT, "disagg: a cached block of 0 tokens");
    }
    f->dst_ranks = f->src_ranks = f->dst_sets = f->src_sets = 1;
    if (f->sharded) {
        if (body < fixed + SHARD_FIXED)
            return tdm_err_set(TDM_EFORMAT, "disagg: short prefill request");
        f->dst_ranks = get32(p);
        f->src_ranks = get32(p + 4);
        f->dst_sets = get32(p + 8);
        f->src_sets = get32(p + 12);
        f->shard_seed = get64(p + 16);
        p += SHARD_FIXED;
        if (!f->dst_ranks || f->dst_ranks > TDM_DISAGG_MAX_RANKS || !f->src_ranks ||
            f->src_ranks > TDM_DISAGG_MAX_RANKS)
            return tdm_err_set(TDM_EFORMAT, "disagg: a sharded request of %u to %u ranks",
                               f->src_ranks, f->dst_ranks);
        fixed += shard_block(f->dst_ranks);
        if (body < fixed) return tdm_err_set(TDM_EFORMAT, "disagg: short prefill request");
        for (uint32_t r = 1; r < f->dst_ranks; r++) {
            f->ranks[r].dst_layer_stride = get64(p);
            p += 8;
            if ((st = tdm_xfer_rmem_unpack(p, TDM_XFER_RMEM_WIRE, &f->ranks[r].kv)) != TDM_OK)
                return st;
            p += TDM_XFER_RMEM_WIRE;
        }
    }
    if (!f->n_tokens || f->n_tokens > MAX_TOKENS || !f->n_pages || f->n_pages > MAX_TOKENS)
        return tdm_err_set(TDM_EFORMAT, "disagg: prefill request with %u tokens and %u pages",
                           f->n_tokens, f->n_pages);
    if (body != fixed + 4 * (size_t)f->n_tokens + 4 * (size_t)f->n_pages)
        return tdm_err_set(TDM_EFORMAT, "disagg: prefill request length mismatch");
    if (f->n_tokens > tokens_cap || f->n_pages > pages_cap)
        return tdm_err_set(TDM_ERANGE,
                           "disagg: prefill request of %u tokens / %u pages is over "
                           "this node's limits (%u / %u)",
                           f->n_tokens, f->n_pages, tokens_cap, pages_cap);
    if (!f->page_size || !f->chunk || f->chunk % f->page_size || !f->n_layers || !f->n_kv_heads ||
        !f->head_dim || f->kv_dtype >= TDM_DTYPE_COUNT ||
        !tdm_kv_elem_bytes((enum tdm_dtype)f->kv_dtype) ||
        tdm_kv_elem_bytes((enum tdm_dtype)f->kv_dtype) != f->elem_bytes ||
        f->kv_head_begin >= f->kv_head_end || f->kv_head_end > f->n_kv_heads)
        return tdm_err_set(TDM_EFORMAT, "disagg: inconsistent geometry in a prefill request");
    if (f->sharded) { /* both schemes must shard the heads as they say (DESIGN.md §5) */
        struct tdm_tp_kv_shard ds, ss;
        if (f->n_kv_heads > UINT16_MAX || f->kv_head_begin || f->kv_head_end != f->n_kv_heads ||
            tdm_tp_kv_shard_of((int)f->n_kv_heads, (int)f->dst_ranks, 0, &ds) != TDM_OK ||
            tdm_tp_kv_shard_of((int)f->n_kv_heads, (int)f->src_ranks, 0, &ss) != TDM_OK ||
            (uint32_t)ds.n_replica_sets != f->dst_sets ||
            (uint32_t)ss.n_replica_sets != f->src_sets)
            return tdm_err_set(TDM_EFORMAT,
                               "disagg: sharding of %u KV heads from %u ranks (%u sets) to %u "
                               "ranks (%u sets) breaks the sharding contract",
                               f->n_kv_heads, f->src_ranks, f->src_sets, f->dst_ranks, f->dst_sets);
    }
    f->ranks[0] =
        (struct tdm_disagg_rank_dst){.dst_layer_stride = f->dst_layer_stride, .kv = f->kv};
    if (f->cached_tokens % f->page_size || f->cached_tokens >= f->n_tokens)
        return tdm_err_set(TDM_EFORMAT,
                           "disagg: %u cached tokens of %u (page size %u): not whole pages short "
                           "of the prompt",
                           f->cached_tokens, f->n_tokens, f->page_size);
    if (f->n_pages !=
        (f->n_tokens + f->page_size - 1) / f->page_size - f->cached_tokens / f->page_size)
        return tdm_err_set(TDM_EFORMAT, "disagg: %u pages for tokens %u..%u of page size %u",
                           f->n_pages, f->cached_tokens, f->n_tokens, f->page_size);
    for (uint32_t i = 0; i < f->n_tokens; i++, p += 4)
        tokens_out[i] = (int32_t)get32(p);
    for (uint32_t i = 0; i < f->n_pages; i++, p += 4)
        pages_out[i] = get32(p);
    f->tokens = tokens_out;
    f->pages = pages_out;
    return TDM_OK;
}
