/*
 * Tokenizer from GGUF metadata (tokenizer.ggml.*), as llama.cpp's converters write it.
 *
 *   model "gpt2"  -> byte-level BPE: tokens, token_type, merges ("left right"), and the
 *                    pre-tokenizer regexes chosen by tokenizer.ggml.pre;
 *   model "llama" -> SentencePiece-style BPE: tokens, scores, token_type (6 = <0xXX> byte
 *                    tokens), add_space_prefix. Merges are implied by the scores: a pair of
 *                    adjacent symbols merges when their concatenation is a token (of any
 *                    type, as in llama.cpp), the best-scoring such pair first, leftmost on
 *                    ties. That is turned into the shared pair table here: every split of
 *                    every token into two tokens becomes a pair whose rank is the dense rank
 *                    of the token's score.
 *
 * Token types: control (3) and unknown (2) tokens are special (split from text only under
 * TDM_TOK_PARSE_SPECIAL, dropped by skip_special); user-defined (4) tokens are always split
 * from text first, as llama.cpp does.
 *
 * Validation: counts, array types and id ranges are checked; a missing optional key takes
 * llama.cpp's default. Threading: single-threaded while loading.
 */
#include "tok/tok_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct pre_family {
    const char *name;
    const char *const *regexes; /* NULL-terminated */
    bool ignore_merges;
};

static const char RE_DIGIT[] = "\\p{N}";
static const char *const PRE_GPT2[] = {TDM_TOK_RE_GPT2, NULL};
static const char *const PRE_DIGITS_GPT2[] = {RE_DIGIT, TDM_TOK_RE_GPT2, NULL};
static const char *const PRE_LLAMA3[] = {TDM_TOK_RE_LLAMA3, NULL};
static const char *const PRE_QWEN2[] = {TDM_TOK_RE_QWEN2, NULL};

/* tokenizer.ggml.pre values and their splits, after llama.cpp's table. A missing value or
 * "default" takes the GPT-2 split, which is what a "gpt2" tokenizer without one means. */
static const struct pre_family PRE_FAMILIES[] = {
    {"default", PRE_GPT2, false},
    {"gpt-2", PRE_GPT2, false},
    {"gpt2", PRE_GPT2, false},
    {"mpt", PRE_GPT2, false},
    {"olmo", PRE_GPT2, false},
    {"jais", PRE_GPT2, false},
    {"smollm", PRE_DIGITS_GPT2, false},
    {"starcoder", PRE_DIGITS_GPT2, false},
    {"refact", PRE_DIGITS_GPT2, false},
    {"command-r", PRE_DIGITS_GPT2, false},
    {"codeshell", PRE_DIGITS_GPT2, false},
    {"exaone", PRE_DIGITS_GPT2, false},
    {"minerva-7b", PRE_DIGITS_GPT2, false},
    {"llama-bpe", PRE_LLAMA3, true},
    {"llama3", PRE_LLAMA3, true},
    {"llama-v3", PRE_LLAMA3, true},
    {"dbrx", PRE_LLAMA3, false},
    {"smaug-bpe", PRE_LLAMA3, false},
    {"qwen2", PRE_QWEN2, false},
    {"stablelm2", PRE_QWEN2, false},
    {"deepseek-r1-qwen", PRE_QWEN2, false},
};

static tdm_status get_opt_id(const tdm_gguf_t *g, const char *key, int n_vocab, int *out)
{
    int64_t v;
    tdm_status st = tdm_gguf_get_i64(g, key, &v);
    if (st == TDM_ENOTFOUND) return TDM_OK;
    if (st) return st;
    if (v < 0 || v >= n_vocab) return TDM_OK; /* llama.cpp ignores out-of-range ids too */
    *out = (int)v;
    return TDM_OK;
}

static tdm_status get_opt_bool(const tdm_gguf_t *g, const char *key, bool *out)
{
    tdm_status st = tdm_gguf_get_bool(g, key, out);
    return st == TDM_ENOTFOUND ? TDM_OK : st;
}

static bool str_is(struct tdm_str s, const char *lit)
{
    return s.len == strlen(lit) && !memcmp(s.ptr, lit, s.len);
}

/* Reads element i of a numeric GGUF array as i64 / f32 (the data may be unaligned). */
static int64_t arr_i64(enum tdm_gguf_type t, const void *data, int64_t i)
{
    const uint8_t *p = data;
    switch (t) {
    case TDM_GGUF_I32: {
        int32_t v;
        memcpy(&v, p + i * 4, 4);
        return v;
    }
    case TDM_GGUF_U32: {
        uint32_t v;
        memcpy(&v, p + i * 4, 4);
        return v;
    }
    case TDM_GGUF_I8:
        return (int8_t)p[i];
    case TDM_GGUF_U8:
        return p[i];
    default:
        return 0;
    }
}

static int cmp_score_desc(const void *a, const void *b, void *ctx)
{
    const float *scores = ctx;
    int ia = *(const int *)a, ib = *(const int *)b;
    if (scores[ia] != scores[ib]) return scores[ia] > scores[ib] ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

/* SPM: pair table from scores (see the file comment). */
static tdm_status spm_pairs_from_scores(struct tdm_tok *tok, const float *scores)
{
    int n = tok->n_vocab;
    tdm_status st;
    int *order = malloc((size_t)n * sizeof *order);
    uint32_t *rank = malloc((size_t)n * sizeof *rank);
    if (!order || !rank) {
        st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
        goto out_free;
    }
    for (int i = 0; i < n; i++)
        order[i] = i;
    qsort_r(order, (size_t)n, sizeof *order, cmp_score_desc, (void *)scores);
    uint32_t r = 0;
    for (int k = 0; k < n; k++) {
        if (k && scores[order[k]] != scores[order[k - 1]]) r++;
        rank[order[k]] = r;
    }
    /* count the candidate splits to size the table */
    size_t n_splits = 0;
    for (int id = 0; id < n; id++) {
        size_t len;
        const char *t = tdm_tok_text(tok, id, &len);
        size_t bad;
        if (len < 2 || !tdm_tok_utf8_valid(t, len, &bad)) continue;
        for (size_t i = (size_t)tdm_tok_utf8_len((unsigned char)t[0]); i < len;
             i += (size_t)tdm_tok_utf8_len((unsigned char)t[i]))
            n_splits++;
    }
    st = tdm_tok_reserve_pairs(tok, n_splits);
    if (st) goto out_free;
    for (int id = 0; id < n; id++) {
        size_t len;
        const char *t = tdm_tok_text(tok, id, &len);
        size_t bad;
        if (len < 2 || !tdm_tok_utf8_valid(t, len, &bad)) continue;
        for (size_t i = (size_t)tdm_tok_utf8_len((unsigned char)t[0]); i < len;
             i += (size_t)tdm_tok_utf8_len((unsigned char)t[i])) {
            int l = tdm_tok_lookup(tok, t, i), rr = tdm_tok_lookup(tok, t + i, len - i);
            if (l < 0 || rr < 0) continue;
            st = tdm_tok_add_pair(tok, l, rr, rank[id], id);
            if (st) goto out_free;
        }
    }
    st = TDM_OK;
out_free:
    free(order);
    free(rank);
    return st;
}

static tdm_status bpe_pairs_from_merges(struct tdm_tok *tok, const tdm_gguf_t *g)
{
    enum tdm_gguf_type et;
    int64_t n;
    const void *data;
    tdm_status st = tdm_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n, &data);
    if (st == TDM_ENOTFOUND)
        return tdm_err_set(TDM_EFORMAT, "tokenizer: gpt2 GGUF without tokenizer.ggml.merges");
    if (st) return st;
    if (et != TDM_GGUF_STRING)
        return tdm_err_set(TDM_EFORMAT, "tokenizer: tokenizer.ggml.merges is not strings");
    if (n > TOK_MAX_MERGES)
        return tdm_err_set(TDM_ERANGE, "tokenizer: %lld merges (cap %d)", (long long)n,
                           TOK_MAX_MERGES);
    st = tdm_tok_reserve_pairs(tok, (size_t)n);
    if (st) return st;
    char *cat = malloc(2 * TOK_MAX_TOKEN_BYTES);
    if (!cat) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    for (int64_t i = 0; i < n; i++) {
        struct tdm_str m;
        st = tdm_gguf_get_arr_str(g, "tokenizer.ggml.merges", i, &m);
        if (st) goto out_free;
        /* split at the first space after the first byte, as llama.cpp does */
        const char *sp = m.len > 1 ? memchr(m.ptr + 1, ' ', m.len - 1) : NULL;
        if (!sp) {
            st = tdm_err_set(TDM_EFORMAT, "tokenizer: merge %lld has no space", (long long)i);
            goto out_free;
        }
        size_t ll = (size_t)(sp - m.ptr), rl = m.len - ll - 1;
        if (ll > TOK_MAX_TOKEN_BYTES || rl > TOK_MAX_TOKEN_BYTES) continue;
        int l = tdm_tok_lookup(tok, m.ptr, ll), r = tdm_tok_lookup(tok, sp + 1, rl);
        memcpy(cat, m.ptr, ll);
        memcpy(cat + ll, sp + 1, rl);
        int merged = tdm_tok_lookup(tok, cat, ll + rl);
        if (l < 0 || r < 0 || merged < 0) continue; /* names a token we do not have */
        st = tdm_tok_add_pair(tok, l, r, (uint32_t)i, merged);
        if (st) goto out_free;
    }
    st = TDM_OK;
out_free:
    free(cat);
    return st;
}

static tdm_status setup_pre(struct tdm_tok *tok, const tdm_gguf_t *g)
{
    struct tdm_str pre = {"default", 7};
    tdm_status st = tdm_gguf_get_str(g, "tokenizer.ggml.pre", &pre);
    if (st && st != TDM_ENOTFOUND) return st;
    for (size_t i = 0; i < TDM_ARRAY_LEN(PRE_FAMILIES); i++) {
        const struct pre_family *f = &PRE_FAMILIES[i];
        if (!str_is(pre, f->name)) continue;
        for (const char *const *re = f->regexes; *re; re++) {
            st = tdm_tok_add_regex_stage(tok, *re, strlen(*re), false);
            if (st) return st;
        }
        tok->ignore_merges = f->ignore_merges;
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: pre-tokenizer '%.*s' is not supported",
                       (int)TDM_MIN(pre.len, 64), pre.ptr);
}

tdm_status tdm_tok_from_gguf(const tdm_gguf_t *g, tdm_tok_t **out)
{
    if (!g || !out) return tdm_err_set(TDM_EINVAL, "tdm_tok_from_gguf: NULL argument");
    struct tdm_str model;
    tdm_status st = tdm_gguf_get_str(g, "tokenizer.ggml.model", &model);
    if (st == TDM_ENOTFOUND)
        return tdm_err_set(TDM_ENOTFOUND, "tokenizer: GGUF has no tokenizer.ggml.model");
    if (st) return st;
    enum tdm_tok_kind kind;
    if (str_is(model, "gpt2")) {
        kind = TDM_TOK_BPE_BYTES;
    } else if (str_is(model, "llama")) {
        kind = TDM_TOK_SPM;
    } else {
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: GGUF tokenizer model '%.*s'",
                           (int)TDM_MIN(model.len, 64), model.ptr);
    }

    enum tdm_gguf_type et;
    int64_t n;
    const void *unused;
    st = tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, &unused);
    if (st == TDM_ENOTFOUND)
        return tdm_err_set(TDM_EFORMAT, "tokenizer: GGUF has no tokenizer.ggml.tokens");
    if (st) return st;
    if (et != TDM_GGUF_STRING)
        return tdm_err_set(TDM_EFORMAT, "tokenizer: tokenizer.ggml.tokens is not strings");
    if (n <= 0 || n > TOK_MAX_VOCAB)
        return tdm_err_set(TDM_ERANGE, "tokenizer: %lld tokens outside [1, %d]", (long long)n,
                           TOK_MAX_VOCAB);

    enum tdm_gguf_type tt_type = TDM_GGUF_I32;
    int64_t tt_n = 0;
    const void *tt = NULL;
    st = tdm_gguf_get_arr(g, "tokenizer.ggml.token_type", &tt_type, &tt_n, &tt);
    if (st && st != TDM_ENOTFOUND) return st;
    if (!st && (tt_n != n || !tt ||
                (tt_type != TDM_GGUF_I32 && tt_type != TDM_GGUF_U32 && tt_type != TDM_GGUF_I8 &&
                 tt_type != TDM_GGUF_U8)))
        return tdm_err_set(TDM_EFORMAT, "tokenizer: token_type must be %lld integers",
                           (long long)n);

    struct tdm_tok *tok;
    st = tdm_tok_create(kind, (int)n, &tok);
    if (st) return st;
    float *scores = NULL;
    for (int64_t i = 0; i < n; i++) {
        struct tdm_str s;
        st = tdm_gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &s);
        if (st) goto out_free_tok;
        int64_t type = tt ? arr_i64(tt_type, tt, i) : TOK_T_NORMAL;
        if (type < TOK_T_NORMAL || type > TOK_T_BYTE) type = TOK_T_NORMAL;
        unsigned flags = 0;
        if (type == TOK_T_CONTROL || type == TOK_T_UNKNOWN)
            flags = TOK_F_SPECIAL | TOK_F_ADDED;
        else if (type == TOK_T_USER)
            flags = TOK_F_ADDED;
        st = tdm_tok_set_token(tok, (int)i, s.ptr, s.len, (enum tok_type)type, flags);
        if (st) goto out_free_tok;
    }
    st = tdm_tok_build_index(tok);
    if (st) goto out_free_tok;

    if (kind == TDM_TOK_BPE_BYTES) {
        st = bpe_pairs_from_merges(tok, g);
        if (st) goto out_free_tok;
        st = setup_pre(tok, g);
        if (st) goto out_free_tok;
        tok->add_bos = false;
    } else {
        scores = calloc((size_t)n, sizeof *scores);
        if (!scores) {
            st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
            goto out_free_tok;
        }
        enum tdm_gguf_type sc_type;
        int64_t sc_n;
        const void *sc;
        st = tdm_gguf_get_arr(g, "tokenizer.ggml.scores", &sc_type, &sc_n, &sc);
        if (st && st != TDM_ENOTFOUND) goto out_free_tok;
        if (!st) {
            if (sc_type != TDM_GGUF_F32 || sc_n != n) {
                st = tdm_err_set(TDM_EFORMAT, "tokenizer: scores must be %lld f32", (long long)n);
                goto out_free_tok;
            }
            for (int64_t i = 0; i < n; i++) {
                memcpy(&scores[i], (const uint8_t *)sc + i * 4, 4);
                if (isnan(scores[i])) scores[i] = -INFINITY;
            }
        }
        st = spm_pairs_from_scores(tok, scores);
        if (st) goto out_free_tok;
        bool space_prefix = true;
        st = get_opt_bool(g, "tokenizer.ggml.add_space_prefix", &space_prefix);
        if (st) goto out_free_tok;
        if (space_prefix) {
            st = tdm_tok_add_norm(tok, true, "", 0, " ", 1);
            if (st) goto out_free_tok;
        }
        st = tdm_tok_add_norm(tok, false, " ", 1, "\xE2\x96\x81", 3);
        if (st) goto out_free_tok;
        tok->byte_fallback = true;
        tok->strip_leading_space = space_prefix;
        tok->add_bos = true;
    }

    st = get_opt_bool(g, "tokenizer.ggml.add_bos_token", &tok->add_bos);
    if (!st) st = get_opt_id(g, "tokenizer.ggml.bos_token_id", tok->n_vocab, &tok->bos);
    if (!st) st = get_opt_id(g, "tokenizer.ggml.eos_token_id", tok->n_vocab, &tok->eos);
    if (!st) st = get_opt_id(g, "tokenizer.ggml.unknown_token_id", tok->n_vocab, &tok->unk);
    if (!st) st = get_opt_id(g, "tokenizer.ggml.padding_token_id", tok->n_vocab, &tok->pad);
    if (st) goto out_free_tok;
    if (kind == TDM_TOK_BPE_BYTES) tok->unk = -1; /* byte-level: every byte has a symbol */

    st = tdm_tok_finalize(tok);
    if (st) goto out_free_tok;
    free(scores);
    *out = tok;
    return TDM_OK;

out_free_tok:
    free(scores);
    tdm_tok_free(tok);
    return st;
}
