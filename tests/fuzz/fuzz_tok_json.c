/*
 * libFuzzer target for the tokenizer.json loader: the input is handed to
 * tdm_tok_from_hf_memory as the file's bytes. When it is accepted, the tokenizer must be able
 * to encode a fixed text full of edge cases (with and without special parsing and BOS), every
 * id it returns must be inside the vocabulary, decoding those ids must succeed, and every
 * token's piece must be readable. Anything else must be an error, never a crash or a leak.
 *
 * Seed corpus: tests/fuzz/corpus/tok_json/ (small byte-level, SentencePiece-style and
 * Metaspace tokenizers).
 */
#include "tandem/tok.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static volatile uint64_t sink;

static void touch(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += b[i];
    sink += s;
}

static const char TEXT[] = "Hello, world! 123 4567 it's IT'S <s></s><unk> <|im_start|>user\n"
                           "  \t\r\n caf\xc3\xa9 e\xcc\x81 \xe2\x96\x81x \xf0\x9f\x98\x80\xe2\x80"
                           "\x8d\xf0\x9f\x91\xa9 \xe4\xbd\xa0\xe5\xa5\xbd <0x41> a\0b   ";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tdm_tok_t *tok = NULL;
    if (tdm_tok_from_hf_memory(data, size, &tok) != TDM_OK) return 0;
    int n_vocab = tdm_tok_vocab_size(tok);
    int32_t ids[1024];
    char buf[8192];
    const int flag_sets[] = {0, TDM_TOK_PARSE_SPECIAL | TDM_TOK_ADD_BOS};
    for (size_t f = 0; f < sizeof flag_sets / sizeof flag_sets[0]; f++) {
        size_t n = 0;
        tdm_status st = tdm_tok_encode(tok, TEXT, sizeof TEXT - 1, flag_sets[f], ids, 1024, &n);
        if (st != TDM_OK && st != TDM_ERANGE && st != TDM_EINTERNAL) abort();
        if (st == TDM_EINTERNAL) continue; /* a fuzzed regex hit PCRE2's match limit */
        if (n > 1024) n = 1024;
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= n_vocab) abort();
        size_t len;
        st = tdm_tok_decode(tok, ids, n, f == 1, buf, sizeof buf, &len);
        if (st != TDM_OK && st != TDM_ERANGE) abort();
        touch(buf, len < sizeof buf ? len : sizeof buf);
    }
    for (int id = 0; id < n_vocab && id < 4096; id++) {
        size_t len;
        const char *p = tdm_tok_piece(tok, id, &len);
        if (!p) abort();
        touch(p, len);
        (void)tdm_tok_is_special(tok, id);
    }
    (void)tdm_tok_find(tok, "<s>");
    tdm_tok_free(tok);
    return 0;
}
