/*
 * Token ids -> bytes.
 *
 * Every token's decoded bytes (its "piece") were computed once at load (vocab.c), so decoding
 * is a bounds-checked concatenation: no allocation, usable on the per-token streaming path.
 * SPM tokenizers whose decoder strips the prefix space (HF's Strip / Metaspace decoders,
 * GGUF add_space_prefix) drop one leading space of the whole output, as HF does after fusing
 * the tokens.
 *
 * Threading: reads only the immutable tokenizer.
 */
#include "tok/tok_int.h"

#include <string.h>

tdm_status tdm_tok_decode(const tdm_tok_t *tok, const int32_t *ids, size_t n, bool skip_special,
                          char *buf, size_t cap, size_t *len_out)
{
    if (!tok || (!ids && n) || (!buf && cap) || !len_out)
        return tdm_err_set(TDM_EINVAL, "tdm_tok_decode: NULL argument");
    size_t total = 0;
    bool strip = tok->strip_leading_space;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab)
            return tdm_err_set(TDM_EINVAL, "tokenizer: token id %d at index %zu outside [0, %d)",
                               (int)id, i, tok->n_vocab);
        const struct tok_entry *e = &tok->entries[id];
        if (skip_special && (e->flags & TOK_F_SPECIAL)) continue;
        const char *p = tok->strs.p + e->piece_off;
        size_t len = e->piece_len;
        if (strip && len) {
            if (p[0] == ' ') p++, len--;
            strip = false;
        }
        if (total < cap) memcpy(buf + total, p, TDM_MIN(len, cap - total));
        total += len;
    }
    *len_out = total;
    if (total < cap) buf[total] = 0;
    if (total > cap)
        return tdm_err_set(TDM_ERANGE, "tokenizer: %zu decoded bytes do not fit in %zu", total,
                           cap);
    return TDM_OK;
}
