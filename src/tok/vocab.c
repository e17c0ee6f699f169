/*
 * The token table: creation, the text -> id hash, the merge-pair table, the pipeline
 * configuration that the loaders fill in, and the finishing pass that derives everything the
 * encoder and decoder read (decoded pieces, the byte -> symbol tables, the added-token index).
 *
 * Why shaped this way: both loaders (GGUF and tokenizer.json) only describe tokens, merges and
 * pipeline steps through these calls, so there is one place that owns memory and one set of
 * invariants (listed in tok_int.h). Hash tables are open addressing over flat arrays sized to
 * a power of two at least twice the entry count, so lookups are a few probes and building
 * never rehashes.
 *
 * Threading: building is single-threaded; after tdm_tok_finalize the object is read-only and the
 * accessors here may be called from any thread.
 */
#include "tok/tok_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2 / ByteLevel(use_regex) pattern, as HF's ByteLevel pre-tokenizer spells it. */
const char TDM_TOK_RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* Llama 3 (tiktoken cl100k-style): up to three digits per piece. */
const char TDM_TOK_RE_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen2 / Qwen2.5 / Qwen3: like Llama 3 but one digit per piece. */
const char TDM_TOK_RE_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, s, n);
    h = (h ^ v) * 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 29;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 32;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return x;
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

static tdm_status strbuf_append(struct tok_strbuf *b, const char *s, size_t n, uint32_t *off)
{
    if (n > UINT32_MAX - b->len)
        return tdm_err_set(TDM_ERANGE, "tokenizer: token text exceeds 4 GiB in total");
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for token text");
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, s, n);
    *off = (uint32_t)b->len;
    b->len += n;
    return TDM_OK;
}

tdm_status tdm_tok_create(enum tdm_tok_kind kind, int n_vocab, struct tdm_tok **out)
{
    if (n_vocab <= 0 || n_vocab > TOK_MAX_VOCAB)
        return tdm_err_set(TDM_ERANGE, "tokenizer: vocabulary size %d outside [1, %d]", n_vocab,
                           TOK_MAX_VOCAB);
    struct tdm_tok *tok = calloc(1, sizeof *tok);
    if (!tok) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    tok->entries = calloc((size_t)n_vocab, sizeof *tok->entries);
    if (!tok->entries) {
        free(tok);
        return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for %d tokens", n_vocab);
    }
    for (int i = 0; i < n_vocab; i++)
        tok->entries[i].type = TOK_T_UNUSED;
    tok->kind = kind;
    tok->n_vocab = n_vocab;
    tok->bos = tok->eos = tok->unk = tok->pad = -1;
    tok->metaspace_prepend = TOK_PREPEND_NEVER;
    tdm_tok_bytes_to_unicode(tok->byte_cp);
    for (int b = 0; b < 256; b++)
        tok->byte_sym[b] = tok->byte_tok[b] = -1;
    *out = tok;
    return TDM_OK;
}

void tdm_tok_free(tdm_tok_t *tok)
{
    if (!tok) return;
    for (int i = 0; i < tok->n_stages; i++)
        pcre2_code_free(tok->stages[i].re);
    for (int i = 0; i < tok->n_norm; i++) {
        free(tok->norm[i].from);
        free(tok->norm[i].to);
    }
    free(tok->entries);
    free(tok->strs.p);
    free(tok->text_slots);
    free(tok->pair_keys);
    free(tok->pair_vals);
    free(tok->split_ids);
    free(tok);
}

tdm_status tdm_tok_set_token(struct tdm_tok *tok, int id, const char *text, size_t len,
                             enum tok_type type, unsigned flags)
{
    TDM_ASSERT(id >= 0 && id < tok->n_vocab);
    if (len > TOK_MAX_TOKEN_BYTES)
        return tdm_err_set(TDM_ERANGE, "tokenizer: token %d is %zu bytes (cap %d)", id, len,
                           TOK_MAX_TOKEN_BYTES);
    struct tok_entry *e = &tok->entries[id];
    tdm_status st = strbuf_append(&tok->strs, text, len, &e->text_off);
    if (st) return st;
    e->text_len = (uint32_t)len;
    e->type = (uint8_t)type;
    e->flags = (uint8_t)flags;
    return TDM_OK;
}

const char *tdm_tok_text(const struct tdm_tok *tok, int id, size_t *len)
{
    const struct tok_entry *e = &tok->entries[id];
    *len = e->text_len;
    return tok->strs.p ? tok->strs.p + e->text_off : "";
}

tdm_status tdm_tok_build_index(struct tdm_tok *tok)
{
    size_t cap = pow2_at_least((size_t)tok->n_vocab * 2);
    free(tok->text_slots);
    tok->text_slots = calloc(cap, sizeof *tok->text_slots);
    if (!tok->text_slots) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for index");
    tok->text_mask = cap - 1;
    for (int id = 0; id < tok->n_vocab; id++) {
        size_t len;
        const char *t = tdm_tok_text(tok, id, &len);
        if (!len) continue;
        size_t h = (size_t)hash_bytes(t, len) & tok->text_mask;
        for (;;) {
            uint32_t s = tok->text_slots[h];
            if (!s) {
                tok->text_slots[h] = (uint32_t)id + 1;
                break;
            }
            size_t l2;
            const char *t2 = tdm_tok_text(tok, (int)s - 1, &l2);
            if (l2 == len && !memcmp(t, t2, len)) break; /* duplicate text: lowest id wins */
            h = (h + 1) & tok->text_mask;
        }
    }
    return TDM_OK;
}

int tdm_tok_lookup(const struct tdm_tok *tok, const char *text, size_t len)
{
    if (!tok->text_slots || !len) return -1;
    size_t h = (size_t)hash_bytes(text, len) & tok->text_mask;
    for (;;) {
        uint32_t s = tok->text_slots[h];
        if (!s) return -1;
        size_t l2;
        const char *t2 = tdm_tok_text(tok, (int)s - 1, &l2);
        if (l2 == len && !memcmp(text, t2, len)) return (int)s - 1;
        h = (h + 1) & tok->text_mask;
    }
}

tdm_status tdm_tok_reserve_pairs(struct tdm_tok *tok, size_t n)
{
    TDM_ASSERT(!tok->pair_keys);
    if (n > TOK_MAX_MERGES * (size_t)4)
        return tdm_err_set(TDM_ERANGE, "tokenizer: %zu merge pairs (cap %d)", n,
                           TOK_MAX_MERGES * 4);
    size_t cap = pow2_at_least(n * 2 + 1);
    tok->pair_keys = malloc(cap * sizeof *tok->pair_keys);
    tok->pair_vals = malloc(cap * sizeof *tok->pair_vals);
    if (!tok->pair_keys || !tok->pair_vals)
        return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for %zu merges", n);
    memset(tok->pair_keys, 0xFF, cap * sizeof *tok->pair_keys);
    tok->pair_mask = cap - 1;
    tok->n_pairs = 0;
    return TDM_OK;
}

tdm_status tdm_tok_add_pair(struct tdm_tok *tok, int left, int right, uint32_t rank, int merged)
{
    TDM_ASSERT(tok->pair_keys);
    TDM_ASSERT(left >= 0 && right >= 0 && merged >= 0);
    if (tok->n_pairs * 2 + 2 > tok->pair_mask + 1)
        return tdm_err_set(TDM_EINTERNAL, "tokenizer: pair table reserved too small");
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t h = (size_t)hash_u64(key) & tok->pair_mask;
    while (tok->pair_keys[h] != UINT64_MAX) {
        if (tok->pair_keys[h] == key) return TDM_OK; /* first (best) rank wins */
        h = (h + 1) & tok->pair_mask;
    }
    tok->pair_keys[h] = key;
    tok->pair_vals[h] = (uint64_t)rank << 32 | (uint32_t)merged;
    tok->n_pairs++;
    return TDM_OK;
}

bool tdm_tok_find_pair(const struct tdm_tok *tok, int left, int right, uint32_t *rank, int *merged)
{
    if (!tok->pair_keys) return false;
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    size_t h = (size_t)hash_u64(key) & tok->pair_mask;
    for (;;) {
        uint64_t k = tok->pair_keys[h];
        if (k == key) {
            *rank = (uint32_t)(tok->pair_vals[h] >> 32);
            *merged = (int)(uint32_t)tok->pair_vals[h];
            return true;
        }
        if (k == UINT64_MAX) return false;
        h = (h + 1) & tok->pair_mask;
    }
}

static char *dup_bytes(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

tdm_status tdm_tok_add_norm(struct tdm_tok *tok, bool prepend, const char *from, size_t from_len,
                            const char *to, size_t to_len)
{
    if (tok->n_norm >= TOK_MAX_NORM_OPS)
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: more than %d normaliser steps",
                           TOK_MAX_NORM_OPS);
    if (!prepend && !from_len)
        return tdm_err_set(TDM_EFORMAT, "tokenizer: Replace normaliser with an empty pattern");
    size_t bad;
    if (!tdm_tok_utf8_valid(from, from_len, &bad) || !tdm_tok_utf8_valid(to, to_len, &bad))
        return tdm_err_set(TDM_EFORMAT, "tokenizer: normaliser string is not valid UTF-8");
    if (to_len > 1024 || from_len > 1024)
        return tdm_err_set(TDM_ERANGE, "tokenizer: normaliser string over 1024 bytes");
    struct tok_norm_op *op = &tok->norm[tok->n_norm];
    op->prepend = prepend;
    op->from = dup_bytes(from, from_len);
    op->to = dup_bytes(to, to_len);
    if (!op->from || !op->to) {
        free(op->from);
        free(op->to);
        return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    }
    op->from_len = from_len;
    op->to_len = to_len;
    tok->n_norm++;
    return TDM_OK;
}

/* Unicode White_Space, which is what Oniguruma (HF tokenizers) means by \s. PCRE2's \s adds
 * U+180E (via \h), so \s and \S are spelled out before compiling. */
#define WS_MEMBERS                                                                                 \
    "\\t-\\r "                                                                                     \
    "\\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"

/* Rewrites \s / \S of `pattern` into explicit classes; *out is malloc'd. */
static tdm_status rewrite_space_classes(const char *pattern, size_t len, char **out,
                                        size_t *out_len)
{
    static const char members[] = WS_MEMBERS;
    size_t ml = sizeof members - 1, n_escapes = 0;
    for (size_t i = 0; i + 1 < len; i++) {
        if (pattern[i] != '\\') continue;
        if (pattern[i + 1] == 's' || pattern[i + 1] == 'S') n_escapes++;
        i++;
    }
    char *o = malloc(len + n_escapes * (ml + 3) + 1);
    if (!o) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    size_t n = 0;
    bool in_class = false;
    for (size_t i = 0; i < len; i++) {
        char c = pattern[i];
        if (c == '\\' && i + 1 < len) {
            char d = pattern[i + 1];
            i++;
            if (d == 's' || d == 'S') {
                if (in_class && d == 'S') {
                    free(o);
                    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: \\S inside a character class");
                }
                if (!in_class) o[n++] = '[';
                if (!in_class && d == 'S') o[n++] = '^';
                memcpy(o + n, members, ml);
                n += ml;
                if (!in_class) o[n++] = ']';
            } else {
                o[n++] = c;
                o[n++] = d;
            }
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            o[n++] = c;
            /* a ']' right after '[' or '[^' is a literal member */
            if (i + 1 < len && pattern[i + 1] == '^') o[n++] = pattern[++i];
            if (i + 1 < len && pattern[i + 1] == ']') o[n++] = pattern[++i];
            continue;
        }
        if (in_class && c == ']') in_class = false;
        o[n++] = c;
    }
    o[n] = 0;
    *out = o;
    *out_len = n;
    return TDM_OK;
}

tdm_status tdm_tok_add_regex_stage(struct tdm_tok *tok, const char *pattern, size_t len,
                                   bool literal)
{
    if (tok->n_stages >= TOK_MAX_STAGES)
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: more than %d pre-tokenizer steps",
                           TOK_MAX_STAGES);
    if (!len) return tdm_err_set(TDM_EFORMAT, "tokenizer: empty pre-tokenizer pattern");
    if (len > 65536)
        return tdm_err_set(TDM_ERANGE, "tokenizer: pre-tokenizer pattern of %zu bytes", len);
    char *rewritten = NULL;
    if (!literal) {
        tdm_status st = rewrite_space_classes(pattern, len, &rewritten, &len);
        if (st) return st;
        pattern = rewritten;
    }
    int err;
    PCRE2_SIZE err_off;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP); /* LITERAL refuses UCP */
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &err, &err_off, NULL);
    free(rewritten);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(err, msg, sizeof msg);
        return tdm_err_set(TDM_EFORMAT, "tokenizer: pre-tokenizer regex at offset %zu: %s",
                           (size_t)err_off, (const char *)msg);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
    tok->stages[tok->n_stages].kind = TOK_STAGE_REGEX;
    tok->stages[tok->n_stages].re = re;
    tok->n_stages++;
    return TDM_OK;
}

tdm_status tdm_tok_add_metaspace_stage(struct tdm_tok *tok)
{
    if (tok->n_stages >= TOK_MAX_STAGES)
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer: more than %d pre-tokenizer steps",
                           TOK_MAX_STAGES);
    tok->stages[tok->n_stages].kind = TOK_STAGE_METASPACE;
    tok->stages[tok->n_stages].re = NULL;
    tok->n_stages++;
    return TDM_OK;
}

/* ---- finishing ---- */

/* Decodes a byte-level token back to bytes; false when a character is outside the alphabet
 * (such a token then decodes to its raw text). out has room for len bytes. */
static bool byte_level_decode(const int16_t inv[324], const char *t, size_t len, char *out,
                              size_t *out_len)
{
    size_t bad;
    if (!tdm_tok_utf8_valid(t, len, &bad)) return false;
    size_t i = 0, n = 0;
    while (i < len) {
        uint32_t cp;
        i += (size_t)tdm_tok_utf8_decode(t + i, &cp);
        if (cp >= 324 || inv[cp] < 0) return false;
        out[n++] = (char)inv[cp];
    }
    *out_len = n;
    return true;
}

static bool parse_byte_token(const char *t, size_t len, int *byte)
{
    if (len != 6 || memcmp(t, "<0x", 3) || t[5] != '>') return false;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = t[k];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v * 16 + d;
    }
    *byte = v;
    return true;
}

static const char SPM_SPACE[] = "\xE2\x96\x81"; /* U+2581 */

static tdm_status make_piece(struct tdm_tok *tok, int id, const int16_t inv[324], char *scratch)
{
    struct tok_entry *e = &tok->entries[id];
    size_t len;
    const char *t = tdm_tok_text(tok, id, &len);
    const char *piece = t;
    size_t plen = len;
    if (tok->kind == TDM_TOK_BPE_BYTES && e->type == TOK_T_NORMAL) {
        size_t n;
        if (byte_level_decode(inv, t, len, scratch, &n)) piece = scratch, plen = n;
    } else if (tok->kind == TDM_TOK_SPM && e->type == TOK_T_BYTE) {
        int b;
        if (parse_byte_token(t, len, &b)) {
            scratch[0] = (char)b;
            piece = scratch, plen = 1;
        }
    } else if (tok->kind == TDM_TOK_SPM && e->type == TOK_T_NORMAL) {
        size_t n = 0;
        for (size_t i = 0; i < len;) {
            if (len - i >= 3 && !memcmp(t + i, SPM_SPACE, 3)) {
                scratch[n++] = ' ';
                i += 3;
            } else {
                scratch[n++] = t[i++];
            }
        }
        piece = scratch, plen = n;
    }
    /* texts live in the same buffer, which may move: copy through the scratch first */
    if (piece == t) {
        memcpy(scratch, t, len);
        piece = scratch;
    }
    tdm_status st = strbuf_append(&tok->strs, piece, plen, &e->piece_off);
    if (st) return st;
    e->piece_len = (uint32_t)plen;
    return TDM_OK;
}

static int cmp_split(const void *a, const void *b, void *ctx)
{
    const struct tdm_tok *sort_tok = ctx;
    int ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    const struct tok_entry *ea = &sort_tok->entries[ia], *eb = &sort_tok->entries[ib];
    unsigned char fa = (unsigned char)sort_tok->strs.p[ea->text_off];
    unsigned char fb = (unsigned char)sort_tok->strs.p[eb->text_off];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (ea->text_len != eb->text_len) return ea->text_len > eb->text_len ? -1 : 1;
    return ia < ib ? -1 : ia > ib;
}

tdm_status tdm_tok_finalize(struct tdm_tok *tok)
{
    tdm_status st;
    char *scratch = malloc(TOK_MAX_TOKEN_BYTES + 1);
    if (!scratch) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    int16_t inv[324]; /* byte-level code point -> byte, -1 outside the alphabet */
    for (int i = 0; i < 324; i++)
        inv[i] = -1;
    for (int b = 0; b < 256; b++)
        inv[tok->byte_cp[b]] = (int16_t)b;
    for (int id = 0; id < tok->n_vocab; id++) {
        st = make_piece(tok, id, inv, scratch);
        if (st) goto out_free_scratch;
    }

    for (int b = 0; b < 256; b++) {
        char buf[8];
        if (tok->kind == TDM_TOK_BPE_BYTES) {
            int n = tdm_tok_utf8_encode(tok->byte_cp[b], buf);
            tok->byte_sym[b] = tdm_tok_lookup(tok, buf, (size_t)n);
        } else {
            snprintf(buf, sizeof buf, "<0x%02X>", b);
            tok->byte_tok[b] = tdm_tok_lookup(tok, buf, 6);
        }
    }

    int n_split = 0;
    for (int id = 0; id < tok->n_vocab; id++) {
        const struct tok_entry *e = &tok->entries[id];
        size_t bad;
        if ((e->flags & TOK_F_ADDED) && e->text_len &&
            tdm_tok_utf8_valid(tok->strs.p + e->text_off, e->text_len, &bad))
            n_split++;
    }
    tok->split_ids = malloc((size_t)(n_split ? n_split : 1) * sizeof *tok->split_ids);
    if (!tok->split_ids) {
        st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
        goto out_free_scratch;
    }
    n_split = 0;
    for (int id = 0; id < tok->n_vocab; id++) {
        const struct tok_entry *e = &tok->entries[id];
        size_t bad;
        if ((e->flags & TOK_F_ADDED) && e->text_len &&
            tdm_tok_utf8_valid(tok->strs.p + e->text_off, e->text_len, &bad))
            tok->split_ids[n_split++] = id;
    }
    tok->n_split = n_split;
    qsort_r(tok->split_ids, (size_t)n_split, sizeof *tok->split_ids, cmp_split, tok);
    memset(tok->split_first, 0, sizeof tok->split_first);
    for (int i = 0; i < n_split; i++) {
        unsigned char f = (unsigned char)tok->strs.p[tok->entries[tok->split_ids[i]].text_off];
        tok->split_first[f + 1]++;
    }
    for (int b = 0; b < 256; b++)
        tok->split_first[b + 1] += tok->split_first[b];
    st = TDM_OK;
out_free_scratch:
    free(scratch);
    return st;
}

/* ---- public accessors ---- */

enum tdm_tok_kind tdm_tok_kind(const tdm_tok_t *tok)
{
    return tok->kind;
}

int tdm_tok_vocab_size(const tdm_tok_t *tok)
{
    return tok->n_vocab;
}

int tdm_tok_bos(const tdm_tok_t *tok)
{
    return tok->bos;
}

int tdm_tok_eos(const tdm_tok_t *tok)
{
    return tok->eos;
}

bool tdm_tok_adds_bos(const tdm_tok_t *tok)
{
    return tok->add_bos && tok->bos >= 0;
}

int tdm_tok_find(const tdm_tok_t *tok, const char *text)
{
    if (!tok || !text) return -1;
    return tdm_tok_lookup(tok, text, strlen(text));
}

bool tdm_tok_is_special(const tdm_tok_t *tok, int id)
{
    if (!tok || id < 0 || id >= tok->n_vocab) return false;
    return (tok->entries[id].flags & TOK_F_SPECIAL) != 0;
}

const char *tdm_tok_piece(const tdm_tok_t *tok, int id, size_t *len)
{
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    const struct tok_entry *e = &tok->entries[id];
    if (len) *len = e->piece_len;
    return tok->strs.p ? tok->strs.p + e->piece_off : "";
}
