/*
 * Text -> token ids.
 *
 * The pipeline, in HF tokenizers' order:
 *   1. validate UTF-8 (TDM_EINVAL with the offset of the first bad byte);
 *   2. cut added tokens out of the text, leftmost-longest (special ones only under
 *      TDM_TOK_PARSE_SPECIAL; non-special added tokens always, as HF and llama.cpp do);
 *   3. for each run of text between them: normaliser ops (Prepend / Replace), the Metaspace
 *      step (spaces -> U+2581, prefix), then the pre-tokenizer stages, each cutting every
 *      piece of the previous stage into smaller pieces;
 *   4. the model on each final piece: byte-level BPE maps bytes to the GPT-2 alphabet, SPM
 *      maps characters to tokens (or <0xXX> byte tokens, or <unk>), then bpe.c merges.
 *
 * Why shaped this way: the stages run depth-first (a piece goes through every later stage
 * and the model before the next piece is cut), so no piece list is ever materialised and the
 * scratch is a few buffers proportional to the longest piece, not to the input.
 * PCRE2 runs with PCRE2_NO_UTF_CHECK since step 1 validated the whole input; without that,
 * every match would rescan the rest of the subject and long inputs would go quadratic.
 *
 * Threading: all scratch lives in a struct enc on the caller's stack and the heap; the
 * tokenizer is only read, so any number of threads may encode with one tokenizer.
 */
#include "tok/tok_int.h"

#include <stdlib.h>
#include <string.h>

#define TOK_MAX_INPUT_BYTES ((size_t)64 << 20)

struct enc {
    const struct tdm_tok *tok;
    int32_t *ids;
    size_t cap, n;
    bool stop_at_cap; /* TDM_TOK_STOP_AT_CAP */
    struct tok_bpe_work bpe;
    char *norm[2]; /* normaliser ping-pong buffers */
    size_t norm_cap[2];
    char *bytes; /* byte-level spelling of a piece (ignore_merges) */
    size_t bytes_cap;
    pcre2_match_data *md;
};

static void emit(struct enc *e, int32_t id)
{
    if (e->n < e->cap) e->ids[e->n] = id;
    e->n++;
}

static tdm_status grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return TDM_OK;
    if (need > 4 * TOK_MAX_INPUT_BYTES) /* normalisers may expand text, but not without bound */
        return tdm_err_set(TDM_ERANGE, "tokenizer: normalised text of %zu bytes is too long", need);
    size_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    char *p = realloc(*buf, c);
    if (!p) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory (%zu bytes)", need);
    *buf = p;
    *cap = c;
    return TDM_OK;
}

/* ---- the model on one piece ---- */

static void push_sym(struct enc *e, size_t *n, int32_t id)
{
    struct tok_sym *s = &e->bpe.syms[*n];
    s->id = id;
    s->prev = (int32_t)*n - 1;
    s->next = -1;
    if (*n) e->bpe.syms[*n - 1].next = (int32_t)*n;
    (*n)++;
}

/* An unknown symbol: <unk> (fused with a preceding <unk> when the model says so) or nothing
 * when the model has no <unk>, as HF's BPE does. */
static void push_unk(struct enc *e, size_t *n, bool *prev_unk)
{
    const struct tdm_tok *tok = e->tok;
    if (tok->unk < 0) return;
    if (tok->fuse_unk && *prev_unk) return;
    push_sym(e, n, tok->unk);
    *prev_unk = true;
}

static tdm_status model_piece(struct enc *e, const char *s, size_t len)
{
    const struct tdm_tok *tok = e->tok;
    tdm_status st;
    if (!len) return TDM_OK;

    if (tok->ignore_merges) {
        int id = -1;
        if (tok->kind == TDM_TOK_BPE_BYTES) {
            st = grow(&e->bytes, &e->bytes_cap, len * 2);
            if (st) return st;
            size_t m = 0;
            for (size_t i = 0; i < len; i++)
                m += (size_t)tdm_tok_utf8_encode(tok->byte_cp[(unsigned char)s[i]], e->bytes + m);
            id = tdm_tok_lookup(tok, e->bytes, m);
        } else {
            id = tdm_tok_lookup(tok, s, len);
        }
        if (id >= 0) {
            emit(e, id);
            return TDM_OK;
        }
    }

    /* at most one symbol per byte */
    st = tdm_tok_bpe_reserve(&e->bpe, len);
    if (st) return st;
    size_t n = 0;
    bool prev_unk = false;
    if (tok->kind == TDM_TOK_BPE_BYTES) {
        for (size_t i = 0; i < len; i++) {
            int32_t id = tok->byte_sym[(unsigned char)s[i]];
            if (id >= 0) {
                push_sym(e, &n, id);
                prev_unk = false;
            } else {
                push_unk(e, &n, &prev_unk);
            }
        }
    } else {
        for (size_t i = 0; i < len;) {
            size_t cl = (size_t)tdm_tok_utf8_len((unsigned char)s[i]);
            int id = tdm_tok_lookup(tok, s + i, cl);
            if (id >= 0) {
                push_sym(e, &n, id);
                prev_unk = false;
            } else {
                bool all = tok->byte_fallback;
                for (size_t k = 0; all && k < cl; k++)
                    all = tok->byte_tok[(unsigned char)s[i + k]] >= 0;
                if (all) {
                    for (size_t k = 0; k < cl; k++)
                        push_sym(e, &n, tok->byte_tok[(unsigned char)s[i + k]]);
                    prev_unk = false;
                } else {
                    push_unk(e, &n, &prev_unk);
                }
            }
            i += cl;
        }
    }
    if (!n) return TDM_OK;
    tdm_tok_bpe_merge(tok, &e->bpe, n);
    for (int32_t i = 0; i >= 0; i = e->bpe.syms[i].next)
        emit(e, e->bpe.syms[i].id);
    return TDM_OK;
}

/* ---- pre-tokenizer stages, depth first ---- */

static tdm_status run_stage(struct enc *e, int k, const char *s, size_t len);

static tdm_status regex_stage(struct enc *e, int k, const char *s, size_t len)
{
    const pcre2_code *re = e->tok->stages[k].re;
    size_t pos = 0, gap = 0;
    tdm_status st;
    while (pos < len) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, len, pos, PCRE2_NO_UTF_CHECK, e->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(re, (PCRE2_SPTR)s, len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, e->md,
                             NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return tdm_err_set(TDM_EINTERNAL, "tokenizer: pre-tokenizer regex failed: %s",
                               (const char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) { /* empty match: it cuts nothing; move on one character */
            pos = ms + (ms < len ? (size_t)tdm_tok_utf8_len((unsigned char)s[ms]) : 1);
            continue;
        }
        if (ms > gap) {
            st = run_stage(e, k + 1, s + gap, ms - gap);
            if (st) return st;
        }
        st = run_stage(e, k + 1, s + ms, me - ms);
        if (st) return st;
        pos = gap = me;
    }
    if (gap < len) return run_stage(e, k + 1, s + gap, len - gap);
    return TDM_OK;
}

/* Metaspace split: a piece begins at every replacement character (HF MergedWithNext). */
static tdm_status metaspace_stage(struct enc *e, int k, const char *s, size_t len)
{
    const char *r = e->tok->metaspace_repl;
    size_t rl = e->tok->metaspace_repl_len;
    size_t start = 0;
    for (size_t i = 1; i + rl <= len; i++) {
        if (!memcmp(s + i, r, rl)) {
            tdm_status st = run_stage(e, k + 1, s + start, i - start);
            if (st) return st;
            start = i;
        }
    }
    return run_stage(e, k + 1, s + start, len - start);
}

static tdm_status run_stage(struct enc *e, int k, const char *s, size_t len)
{
    if (!len) return TDM_OK;
    if (e->stop_at_cap && e->n > e->cap)
        return tdm_err_set(TDM_ERANGE, "tokenizer: more than %zu tokens", e->cap);
    if (k == e->tok->n_stages) return model_piece(e, s, len);
    if (e->tok->stages[k].kind == TOK_STAGE_METASPACE) return metaspace_stage(e, k, s, len);
    return regex_stage(e, k, s, len);
}

/* ---- normalisation of one run of text ---- */

/* Replaces every `from` in src by `to`, writing into e->norm[dst]. */
static tdm_status replace_all(struct enc *e, int dst, const char *src, size_t len, const char *from,
                              size_t from_len, const char *to, size_t to_len, size_t *out_len)
{
    size_t count = 0;
    for (size_t i = 0; i + from_len <= len;) {
        if (!memcmp(src + i, from, from_len)) {
            count++;
            i += from_len;
        } else {
            i++;
        }
    }
    tdm_status st = grow(&e->norm[dst], &e->norm_cap[dst], len + count * to_len + 1);
    if (st) return st;
    char *d = e->norm[dst];
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        if (i + from_len <= len && !memcmp(src + i, from, from_len)) {
            memcpy(d + n, to, to_len);
            n += to_len;
            i += from_len;
        } else {
            d[n++] = src[i++];
        }
    }
    *out_len = n;
    return TDM_OK;
}

/* Writes pre + src into e->norm[dst]. */
static tdm_status prepend(struct enc *e, int dst, const char *src, size_t len, const char *pre,
                          size_t pre_len, size_t *out_len)
{
    tdm_status st = grow(&e->norm[dst], &e->norm_cap[dst], len + pre_len + 1);
    if (st) return st;
    memcpy(e->norm[dst], pre, pre_len);
    memcpy(e->norm[dst] + pre_len, src, len);
    *out_len = len + pre_len;
    return TDM_OK;
}

/* `at_start`: the run begins at offset 0 of the input (Metaspace prepend_scheme "first").
 * Each rewriting step reads the current text and writes the other ping-pong buffer. */
static tdm_status encode_run(struct enc *e, const char *s, size_t len, bool at_start)
{
    const struct tdm_tok *tok = e->tok;
    tdm_status st;
    if (!len) return TDM_OK;
    int cur = -1; /* which norm buffer holds s; -1: the caller's text */
    for (int i = 0; i < tok->n_norm; i++) {
        const struct tok_norm_op *op = &tok->norm[i];
        int dst = cur == 0 ? 1 : 0;
        if (op->prepend)
            st = prepend(e, dst, s, len, op->to, op->to_len, &len);
        else
            st = replace_all(e, dst, s, len, op->from, op->from_len, op->to, op->to_len, &len);
        if (st) return st;
        s = e->norm[dst];
        cur = dst;
    }
    if (tok->metaspace) {
        int dst = cur == 0 ? 1 : 0;
        st =
            replace_all(e, dst, s, len, " ", 1, tok->metaspace_repl, tok->metaspace_repl_len, &len);
        if (st) return st;
        s = e->norm[dst];
        cur = dst;
        bool has = len >= tok->metaspace_repl_len &&
                   !memcmp(s, tok->metaspace_repl, tok->metaspace_repl_len);
        bool want = tok->metaspace_prepend == TOK_PREPEND_ALWAYS ||
                    (tok->metaspace_prepend == TOK_PREPEND_FIRST && at_start);
        if (want && !has) {
            dst = cur == 0 ? 1 : 0;
            st = prepend(e, dst, s, len, tok->metaspace_repl, tok->metaspace_repl_len, &len);
            if (st) return st;
            s = e->norm[dst];
        }
    }
    return run_stage(e, 0, s, len);
}

/* ---- added tokens ---- */

/* Steps back over one whitespace character ending at `end`; false if there is none. */
static bool space_before(const char *s, size_t end, size_t *start)
{
    if (!end) return false;
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    uint32_t cp;
    tdm_tok_utf8_decode(s + i, &cp);
    if (!tdm_tok_is_py_space(cp)) return false;
    *start = i;
    return true;
}

/* The id of the added token at s[p..len), longest first, or -1. */
static int match_added(const struct tdm_tok *tok, const char *s, size_t p, size_t len,
                       bool parse_special)
{
    unsigned char f = (unsigned char)s[p];
    for (uint32_t k = tok->split_first[f]; k < tok->split_first[f + 1]; k++) {
        int id = tok->split_ids[k];
        const struct tok_entry *en = &tok->entries[id];
        if ((en->flags & TOK_F_SPECIAL) && !parse_special) continue;
        if (en->text_len <= len - p && !memcmp(s + p, tok->strs.p + en->text_off, en->text_len))
            return id;
    }
    return -1;
}

static void enc_free(struct enc *e)
{
    tdm_tok_bpe_work_free(&e->bpe);
    free(e->norm[0]);
    free(e->norm[1]);
    free(e->bytes);
    pcre2_match_data_free(e->md);
}

tdm_status tdm_tok_encode(const tdm_tok_t *tok, const char *text, size_t len, int flags,
                          int32_t *ids, size_t cap, size_t *n_out)
{
    if (!tok || (!text && len) || (!ids && cap) || !n_out)
        return tdm_err_set(TDM_EINVAL, "tdm_tok_encode: NULL argument");
    if (len > TOK_MAX_INPUT_BYTES)
        return tdm_err_set(TDM_ERANGE, "tokenizer: input of %zu bytes over the %zu-byte cap", len,
                           TOK_MAX_INPUT_BYTES);
    size_t bad;
    if (!tdm_tok_utf8_valid(text, len, &bad))
        return tdm_err_set(TDM_EINVAL, "tokenizer: invalid UTF-8 at byte offset %zu", bad);

    struct enc e = {
        .tok = tok, .ids = ids, .cap = cap, .stop_at_cap = (flags & TDM_TOK_STOP_AT_CAP) != 0};
    tdm_status st = TDM_OK;
    if (tok->n_stages) {
        e.md = pcre2_match_data_create(4, NULL);
        if (!e.md) {
            st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
            goto out_free;
        }
    }
    if ((flags & TDM_TOK_ADD_BOS) && tok->bos >= 0) emit(&e, tok->bos);

    bool parse_special = (flags & TDM_TOK_PARSE_SPECIAL) != 0;
    size_t run = 0, p = 0;
    while (p < len) {
        int id = tok->n_split ? match_added(tok, text, p, len, parse_special) : -1;
        if (id < 0) {
            p++;
            continue;
        }
        const struct tok_entry *en = &tok->entries[id];
        size_t run_end = p, ws;
        if (en->flags & TOK_F_LSTRIP)
            while (run_end > run && space_before(text, run_end, &ws))
                run_end = ws;
        st = encode_run(&e, text + run, run_end - run, run == 0);
        if (st) goto out_stopped;
        emit(&e, id);
        p += en->text_len;
        if (en->flags & TOK_F_RSTRIP) {
            while (p < len) {
                uint32_t cp;
                int cl = tdm_tok_utf8_decode(text + p, &cp);
                if (!tdm_tok_is_py_space(cp)) break;
                p += (size_t)cl;
            }
        }
        run = p;
    }
    st = encode_run(&e, text + run, len - run, run == 0);
out_stopped:
    *n_out = e.n;
    if (st) goto out_free;
    if (e.n > cap)
        st = tdm_err_set(TDM_ERANGE, "tokenizer: %zu tokens do not fit in %zu", e.n, cap);
out_free:
    enc_free(&e);
    return st;
}
