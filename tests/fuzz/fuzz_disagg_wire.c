/*
 * libFuzzer target for the disaggregation control messages (src/disagg/wire.c): bytes from a
 * peer process. Accepted messages must satisfy what the messengers rely on (counts within the
 * caps, pages consistent with tokens and page size, chunk a multiple of the page size, a
 * head block within its bounds when the HEAD flag is set and nothing of it read otherwise, a
 * printable NACK text), and must encode back to the same bytes; anything else must be an
 * error, never a crash or an out-of-bounds read.
 *
 * Seed corpus: tests/fuzz/corpus/disagg_wire/ (one message of each type, and a PREFILL with
 * a head block: prefill_head).
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
        } else {
            static const struct tdm_disagg_head_req none;
            if (memcmp(&f->head, &none, sizeof none)) abort(); /* nothing read without HEAD */
        }
        if (tdm_disagg_prefill_msg_size(f->n_tokens, f->n_pages, f->want_head,
                                        f->cached_tokens > 0) != size)
            abort();
    }
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
