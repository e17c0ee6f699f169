/*
 * libFuzzer target for the disaggregation control messages (src/disagg/wire.c): bytes from a
 * peer process. Accepted messages must satisfy what the messengers rely on (counts within the
 * caps, pages consistent with tokens and page size, chunk a multiple of the page size, a
 * head block within its bounds when the HEAD flag is set (its feature width whole d_model rows
 * of at most TDM_DISAGG_HEAD_MAX_FEATURES layers) and nothing of it read otherwise, a
 * SHARDED block whose two schemes shard the KV heads by the contract (rank counts within
 * TDM_DISAGG_MAX_RANKS, replica sets as tdm_tp_kv_shard_of gives them, the head range the whole
 * model's, a plan that tdm_disagg_shard_plan makes with a count of writes the immediates can
 * carry) and rank 0's pool the main fields, TP 1 on both sides without it, a SCHEME within its
 * bounds, a printable NACK text), and must encode back to the same bytes; anything else must
 * be an error, never a crash or an out-of-bounds read.
 *
 * Seed corpus: tests/fuzz/corpus/disagg_wire/ (one message of each type, a PREFILL with a head
 * block: prefill_head, and with an EAGLE-3 head's fused feature width (3 d_model):
 * prefill_head_eagle3, with a cached prefix: prefill_cached, with the SHARDED block:
 * prefill_sharded (3 KV heads from 3 ranks to 2) and prefill_sharded_tp1).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/disagg.h"

#define CAP 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int32_t tokens[CAP];
    static uint32_t pages[CAP];
    struct tdm_disagg_msg m;
    if (tdm_disagg_msg_decode(data, size, &m, tokens, CAP, pages, CAP) != TDM_OK) return 0;
    if (m.type == TDM_DMSG_PREFILL) {
        const struct tdm_disagg_prefill_msg *f = &m.prefill;
        if (!f->n_tokens || f->n_tokens > CAP || f->n_pages > CAP || !f->page_size ||
            f->chunk % f->page_size || f->cached_tokens % f->page_size ||
            f->cached_tokens >= f->n_tokens ||
            f->n_pages !=
                (f->n_tokens + f->page_size - 1) / f->page_size - f->cached_tokens / f->page_size ||
            f->kv_head_end > f->n_kv_heads || f->kv_head_begin >= f->kv_head_end)
            abort();
        if (f->want_head > 1) abort();
        if (f->want_head) { /* the head block's bounds (what the prefill node relies on) */
            const struct tdm_disagg_head_req *h = &f->head;
            if (!h->n_layers || h->n_layers > TDM_DISAGG_HEAD_MAX_LAYERS || !h->n_heads ||
                !h->n_kv_heads || h->n_kv_heads > h->n_heads || !h->head_dim || !h->d_ff)
                abort();
            /* the context's feature: 1 .. TDM_DISAGG_HEAD_MAX_FEATURES whole d_model rows */
            if (!f->d_model || h->feature_width < f->d_model || h->feature_width % f->d_model ||
                h->feature_width / f->d_model > TDM_DISAGG_HEAD_MAX_FEATURES)
                abort();
        } else {
            static const struct tdm_disagg_head_req none;
            if (memcmp(&f->head, &none, sizeof none)) abort(); /* nothing read without HEAD */
        }
        if (f->sharded) { /* both schemes by the contract, and a plan of them */
            struct tdm_tp_kv_shard ds, ss;
            struct tdm_disagg_shard_plan plan;
            if (!f->dst_ranks || f->dst_ranks > TDM_DISAGG_MAX_RANKS || !f->src_ranks ||
                f->src_ranks > TDM_DISAGG_MAX_RANKS || f->kv_head_begin ||
                f->kv_head_end != f->n_kv_heads ||
                tdm_tp_kv_shard_of((int)f->n_kv_heads, (int)f->dst_ranks, 0, &ds) != TDM_OK ||
                tdm_tp_kv_shard_of((int)f->n_kv_heads, (int)f->src_ranks, 0, &ss) != TDM_OK ||
                (uint32_t)ds.n_replica_sets != f->dst_sets ||
                (uint32_t)ss.n_replica_sets != f->src_sets ||
                tdm_disagg_shard_plan((int)f->n_kv_heads, (int)f->src_ranks, (int)f->dst_ranks,
                                      f->shard_seed, &plan) != TDM_OK ||
                plan.n_slices < 1 || plan.n_slices > TDM_DISAGG_MAX_SLICES ||
                plan.writes > 2 * plan.n_slices)
                abort();
        } else if (f->dst_ranks != 1 || f->src_ranks != 1 || f->dst_sets != 1 || f->src_sets != 1) {
            abort();
        }
        if (f->ranks[0].dst_layer_stride != f->dst_layer_stride ||
            memcmp(&f->ranks[0].kv, &f->kv, sizeof f->kv))
            abort();
        if (tdm_disagg_prefill_msg_size(f->n_tokens, f->n_pages, f->want_head, f->cached_tokens > 0,
                                        f->sharded ? f->dst_ranks : 0) != size)
            abort();
    }
    if (m.type == TDM_DMSG_SCHEME &&
        (!m.scheme_ranks || m.scheme_ranks > TDM_DISAGG_MAX_RANKS || !m.scheme_kv_heads))
        abort();
    if (m.type == TDM_DMSG_NACK)
        for (const char *c = m.error; *c; c++)
            if ((unsigned char)*c < 0x20) abort();
    /* what decodes must encode back to the same bytes (NACK text was made printable) */
    uint8_t *again = malloc(size ? size : 1);
    if (!again) return 0;
    size_t n = tdm_disagg_msg_encode(&m, again, size);
    if (n != size) abort();
    if (m.type != TDM_DMSG_NACK && memcmp(again, data, size)) abort();
    free(again);
    return 0;
}
