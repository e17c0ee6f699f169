/*
 * grammar_walk: random outputs of a grammar over a model's real vocabulary, the way a sampler
 * would make them, for tests that validate them with an independent checker (jsonschema, re).
 *
 *   grammar_walk MODEL.gguf KIND SOURCE_FILE N SEED
 *     KIND: regex | json_schema | json_object | choice | gbnf
 *
 * Each walk takes a random number of tokens uniformly among those the mask allows (the end
 * token aside), then finishes along a shortest byte path to acceptance (found breadth-first
 * over the DFA), spelled with single-byte tokens, each checked against the mask, and ends with
 * the end token, which the mask must allow. One JSON line per walk: {"text": ..., "tokens": n}.
 * Exit 1 on any inconsistency (a mask that refuses the path, a dead state, a missing end).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/grammar.h"
#include "tandem/model.h"
#include "tandem/tok.h"

static uint64_t rng_state;
static uint64_t next_rand(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool allowed(const uint32_t *m, int t)
{
    return m[t >> 5] >> (t & 31) & 1;
}

/* The shortest byte string from st to an accepting state, into path (its length), or -1. */
static int shortest(tdm_grammar_t *g, int32_t st, uint8_t *path, int cap)
{
    int32_t *prev = malloc(TDM_GRAMMAR_MAX_DFA * sizeof *prev);
    uint8_t *by = malloc(TDM_GRAMMAR_MAX_DFA);
    int32_t *queue = malloc(TDM_GRAMMAR_MAX_DFA * sizeof *queue);
    for (int i = 0; i < TDM_GRAMMAR_MAX_DFA; i++)
        prev[i] = -2;
    int head = 0, tail = 0, found = -1;
    prev[st] = -1;
    queue[tail++] = st;
    while (head < tail && found < 0) {
        int32_t s = queue[head++];
        if (tdm_grammar_accepting(g, s)) {
            found = s;
            break;
        }
        for (int b = 0; b < 256; b++) {
            uint8_t c = (uint8_t)b;
            int32_t t = tdm_grammar_feed(g, s, (const char *)&c, 1);
            if (t < 0 || prev[t] != -2) continue;
            prev[t] = s;
            by[t] = c;
            queue[tail++] = t;
        }
    }
    int n = -1;
    if (found >= 0) {
        n = 0;
        for (int32_t s = found; prev[s] != -1; s = prev[s])
            n++;
        if (n > cap) {
            n = -1;
        } else {
            int k = n;
            for (int32_t s = found; prev[s] != -1; s = prev[s])
                path[--k] = by[s];
        }
    }
    free(prev);
    free(by);
    free(queue);
    return n;
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: grammar_walk MODEL.gguf KIND SOURCE_FILE N SEED\n");
        return 2;
    }
    static const char *const KINDS[] = {"regex", "json_schema", "json_object", "choice", "gbnf"};
    static const enum tdm_grammar_kind KIND_OF[] = {TDM_GRAMMAR_REGEX, TDM_GRAMMAR_JSON_SCHEMA,
                                                    TDM_GRAMMAR_JSON_OBJECT, TDM_GRAMMAR_CHOICE,
                                                    TDM_GRAMMAR_GBNF};
    int kind = -1;
    for (int i = 0; i < 5; i++)
        if (!strcmp(argv[2], KINDS[i])) kind = i;
    if (kind < 0) {
        fprintf(stderr, "grammar_walk: unknown kind %s\n", argv[2]);
        return 2;
    }
    FILE *f = fopen(argv[3], "rb");
    if (!f) {
        perror(argv[3]);
        return 2;
    }
    static char src[TDM_GRAMMAR_MAX_SOURCE];
    size_t len = fread(src, 1, sizeof src, f);
    fclose(f);
    int n = atoi(argv[4]);
    rng_state = strtoull(argv[5], NULL, 10);

    tdm_gguf_t *gg;
    tdm_tok_t *tok;
    if (tdm_gguf_open(argv[1], &gg) != TDM_OK || tdm_tok_from_gguf(gg, &tok) != TDM_OK) {
        fprintf(stderr, "grammar_walk: %s\n", tdm_err_msg());
        return 2;
    }
    int vocab = tdm_tok_vocab_size(tok), eos = tdm_tok_eos(tok);
    int byte_tok[256];
    for (int b = 0; b < 256; b++)
        byte_tok[b] = -1;
    for (int t = 0; t < vocab; t++) {
        size_t pl;
        const char *p = tdm_tok_piece(tok, t, &pl);
        if (p && pl == 1 && !tdm_tok_is_special(tok, t) && byte_tok[(uint8_t)p[0]] < 0)
            byte_tok[(uint8_t)p[0]] = t;
    }
    tdm_gvocab_t *v;
    tdm_grammar_t *g;
    if (tdm_gvocab_create(tok, vocab, &eos, 1, &v) != TDM_OK ||
        tdm_grammar_get(v, KIND_OF[kind], src, len, &g) != TDM_OK) {
        printf("{\"error\": ");
        json_t *m = json_string(tdm_err_msg());
        json_dumpf(m, stdout, JSON_ENCODE_ANY);
        json_decref(m);
        printf("}\n");
        return 0;
    }
    int *cand = malloc((size_t)vocab * sizeof *cand);
    static char out[1 << 16];
    static uint8_t path[1 << 14];
    int rc = 0;
    for (int w = 0; w < n && !rc; w++) {
        size_t olen = 0;
        int n_tok = 0;
        int32_t st = tdm_grammar_start(g);
        int random_steps = (int)(next_rand() % 48);
        for (int k = 0; k < random_steps && !tdm_grammar_complete(g, st); k++) {
            const uint32_t *m = tdm_grammar_mask(g, st);
            int nc = 0;
            for (int t = 0; t < vocab; t++)
                if (allowed(m, t) && t != eos) cand[nc++] = t;
            if (!nc) break;
            int t = cand[next_rand() % (uint64_t)nc];
            size_t pl;
            const char *p = tdm_tok_piece(tok, t, &pl);
            if (olen + pl >= sizeof out) break;
            memcpy(out + olen, p, pl);
            olen += pl;
            n_tok++;
            st = tdm_grammar_next(g, st, t);
            if (st < 0) {
                fprintf(stderr, "walk %d: the mask allowed token %d into a dead state\n", w, t);
                rc = 1;
            }
        }
        int pn = rc ? -1 : shortest(g, st, path, (int)sizeof path);
        if (pn < 0 && !rc) {
            fprintf(stderr, "walk %d: no way to acceptance from a live state\n", w);
            rc = 1;
        }
        for (int k = 0; k < pn && !rc; k++) {
            int t = byte_tok[path[k]];
            const uint32_t *m = tdm_grammar_mask(g, st);
            if (t < 0 || !allowed(m, t)) {
                fprintf(stderr, "walk %d: the mask refuses byte %d on a path to acceptance\n", w,
                        path[k]);
                rc = 1;
                break;
            }
            out[olen++] = (char)path[k];
            n_tok++;
            st = tdm_grammar_next(g, st, t);
        }
        if (!rc && !allowed(tdm_grammar_mask(g, st), eos)) {
            fprintf(stderr, "walk %d: accepting, and the end token is refused\n", w);
            rc = 1;
        }
        json_t *line = json_pack("{s:s%, s:i}", "text", out, olen, "tokens", n_tok);
        if (!line) line = json_pack("{s:s, s:i}", "text", "", "invalid_utf8", 1);
        json_dumpf(line, stdout, JSON_COMPACT);
        printf("\n");
        json_decref(line);
    }
    free(cand);
    tdm_grammar_unref(g);
    tdm_gvocab_free(v);
    tdm_tok_free(tok);
    tdm_gguf_close(gg);
    return rc;
}
