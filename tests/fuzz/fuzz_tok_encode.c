/*
 * libFuzzer target for tokenizer input: arbitrary bytes (NUL, invalid UTF-8, special-token
 * text, long runs) encoded by a byte-level tokenizer, with every combination of flags and a cap
 * from the input. Invalid UTF-8 must be refused (TDM_EINVAL) and nothing else; a text that fits
 * must decode back to exactly its bytes (byte-level BPE loses nothing without special parsing
 * and BOS, except around the tokenizer's one added token with lstrip/rstrip, "<tool>", whose
 * surrounding spaces are stripped as HF does); with TDM_TOK_STOP_AT_CAP an oversized text stops
 * with TDM_ERANGE and a count past the cap. Ids stay inside the vocabulary.
 *
 * Layout: u8 flags (bits 0-2: TDM_TOK_ADD_BOS, PARSE_SPECIAL, STOP_AT_CAP), u8 cap (0: 4096),
 * then the text.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_lib.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    tdm_tok_t *tok = fuzz_tokenizer();
    int flags = data[0] & 7;
    size_t cap = data[1] ? data[1] : 4096;
    const char *text = (const char *)data + 2;
    size_t len = size - 2;
    static int32_t ids[4096];
    size_t n = 0;
    tdm_status st = tdm_tok_encode(tok, text, len, flags, ids, cap, &n);
    if (st == TDM_EINVAL) return 0; /* invalid UTF-8 */
    if (st == TDM_ERANGE) {
        if (n <= cap) abort(); /* over the cap, the count says so */
        return 0;
    }
    if (st != TDM_OK || n > cap) abort();
    int vocab = tdm_tok_vocab_size(tok);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) abort();
    if (!(flags & (TDM_TOK_ADD_BOS | TDM_TOK_PARSE_SPECIAL)) && !memmem(text, len, "<tool>", 6)) {
        static char back[1 << 16];
        size_t blen = 0;
        if (tdm_tok_decode(tok, ids, n, false, back, sizeof back, &blen) != TDM_OK) abort();
        if (blen != len || memcmp(back, text, len)) abort(); /* lossless */
    }
    return 0;
}
