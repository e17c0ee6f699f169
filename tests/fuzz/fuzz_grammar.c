/*
 * libFuzzer target for the grammar compilers (src/grammar/: regular expressions, JSON Schema,
 * choice lists, GBNF), whose sources are request fields, so untrusted. The first byte picks the
 * kind, the rest is the source. A grammar that compiles is then walked for a few steps over the
 * corpus tokenizer's vocabulary, the steps' choices taken from the input, checking what the
 * scheduler relies on: a mask exists for every live state, every token it allows leads to a
 * live state and every token it refuses to the dead one (checked on a sample), an end token is
 * allowed exactly where the state accepts, and a complete state accepts.
 *
 * Layout: u8 kind (mod 5: regex, JSON Schema, any JSON object, choices, GBNF), then the source.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_lib.h"
#include "tandem/grammar.h"

static bool has(const uint32_t *m, int t)
{
    return m[t >> 5] >> (t & 31) & 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    static tdm_gvocab_t *v;
    static int vocab, eos;
    if (!v) {
        tdm_tok_t *tok = fuzz_tokenizer();
        vocab = tdm_tok_vocab_size(tok) + 2; /* rows past the tokenizer's: never allowed */
        eos = vocab - 1;
        if (tdm_gvocab_create(tok, vocab, &eos, 1, &v) != TDM_OK) abort();
    }
    static const enum tdm_grammar_kind KINDS[] = {TDM_GRAMMAR_REGEX, TDM_GRAMMAR_JSON_SCHEMA,
                                                  TDM_GRAMMAR_JSON_OBJECT, TDM_GRAMMAR_CHOICE,
                                                  TDM_GRAMMAR_GBNF};
    enum tdm_grammar_kind kind = KINDS[data[0] % 5];
    tdm_grammar_t *g = NULL;
    tdm_status st = tdm_grammar_get(v, kind, (const char *)data + 1, size - 1, &g);
    if (st != TDM_OK) {
        if (g ||
            (st != TDM_EINVAL && st != TDM_EUNSUPPORTED && st != TDM_ERANGE && st != TDM_ENOMEM))
            abort();
        return 0;
    }
    int32_t s = tdm_grammar_start(g);
    size_t at = 1;
    for (int step = 0; step < 8 && s >= 0; step++) {
        const uint32_t *m = tdm_grammar_mask(g, s);
        if (!m) break; /* the DFA's state cap: the scheduler then fails the request */
        if (has(m, eos) != tdm_grammar_accepting(g, s)) abort();
        if (tdm_grammar_complete(g, s) && !tdm_grammar_accepting(g, s)) abort();
        if (has(m, vocab - 2)) abort(); /* past the tokenizer */
        int allowed = 0;
        for (int t = 0; t < vocab; t++)
            allowed += has(m, t);
        if (!allowed) abort();         /* a live state always has a way on */
        for (int k = 0; k < 16; k++) { /* a sample of the verdicts */
            int t = (int)((data[(at + (size_t)k) % size] * 131u + (unsigned)k * 977u) %
                          (unsigned)vocab);
            if ((tdm_grammar_next(g, s, t) >= 0) != has(m, t)) abort();
        }
        int pick = data[at++ % size] % allowed, t = 0;
        for (t = 0; t < vocab; t++)
            if (has(m, t) && pick-- == 0) break;
        if (t == eos) break;
        s = tdm_grammar_next(g, s, t);
        if (s < 0) abort();
    }
    tdm_grammar_unref(g);
    return 0;
}
