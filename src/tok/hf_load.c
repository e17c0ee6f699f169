/*
 * Tokenizer from a Hugging Face tokenizer.json (and, for the path entry point, the
 * tokenizer_config.json next to it, for bos/eos names and add_bos_token).
 *
 * Supported, because the families we serve use exactly these:
 *   model          BPE: vocab, merges ("a b" strings or [a, b] pairs), unk_token, fuse_unk,
 *                  byte_fallback, ignore_merges (no subword prefix/suffix, no dropout);
 *   normalizer     null, NFC (accepted, not applied: input is assumed to be NFC already),
 *                  Prepend, Replace with a String pattern, Sequence of these;
 *   pre_tokenizer  ByteLevel (add_prefix_space false; use_regex adds the GPT-2 split) as the
 *                  last step, Split (Regex or String pattern, Isolated, not inverted),
 *                  Digits, Metaspace (as the first step), Sequence of these;
 *   decoder        ByteLevel, Metaspace, Sequence of Replace/ByteFallback/Fuse/Strip;
 *   post_processor null, ByteLevel, TemplateProcessing with special tokens only before $A
 *                  (that is BOS), Sequence of these;
 *   added_tokens   special or not, lstrip/rstrip (single_word is refused).
 * Anything else is TDM_EUNSUPPORTED naming the construct; malformed JSON or inconsistent
 * contents (an id out of range, a merge naming a missing token) are TDM_EFORMAT.
 *
 * Kind: a ByteLevel pre-tokenizer makes it byte-level BPE; otherwise byte_fallback, a
 * Metaspace step or a normaliser producing U+2581 makes it SentencePiece-style.
 *
 * Threading: single-threaded while loading.
 */
#include "tok/tok_int.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static const char SPM_SPACE[] = "\xE2\x96\x81"; /* U+2581 */

struct hf_flags {
    bool pre_byte_level; /* a ByteLevel pre-tokenizer step was seen */
    bool spm_norm;       /* a normaliser or Metaspace writes U+2581 */
    bool dec_byte_level; /* ByteLevel decoder */
    bool dec_strip;      /* the decoder drops one leading space */
    int bos;             /* from TemplateProcessing, -1 if none */
};

static const char *jstr(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    return json_is_string(v) ? json_string_value(v) : NULL;
}

static bool jbool(const json_t *obj, const char *key, bool dflt)
{
    const json_t *v = json_object_get(obj, key);
    return json_is_boolean(v) ? json_is_true(v) : dflt;
}

static const char *type_of(const json_t *obj)
{
    const char *t = jstr(obj, "type");
    return t ? t : "";
}

/* ---- normalizer ---- */

static tdm_status parse_normalizer(struct tdm_tok *tok, const json_t *j, struct hf_flags *f)
{
    if (!j || json_is_null(j)) return TDM_OK;
    if (!json_is_object(j)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad normalizer");
    const char *t = type_of(j);
    if (!strcmp(t, "Sequence")) {
        const json_t *arr = json_object_get(j, "normalizers");
        if (!json_is_array(arr))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Sequence without normalizers");
        size_t i;
        const json_t *v;
        json_array_foreach(arr, i, v)
        {
            tdm_status st = parse_normalizer(tok, v, f);
            if (st) return st;
        }
        return TDM_OK;
    }
    if (!strcmp(t, "NFC")) return TDM_OK;
    if (!strcmp(t, "Prepend")) {
        const json_t *p = json_object_get(j, "prepend");
        if (!json_is_string(p))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Prepend without a string");
        const char *s = json_string_value(p);
        size_t n = json_string_length(p);
        if (n >= 3 && strstr(s, SPM_SPACE)) f->spm_norm = true;
        return tdm_tok_add_norm(tok, true, "", 0, s, n);
    }
    if (!strcmp(t, "Replace")) {
        const json_t *pat = json_object_get(j, "pattern");
        const json_t *from = json_object_get(pat, "String");
        const json_t *to = json_object_get(j, "content");
        if (!json_is_string(from) || !json_is_string(to))
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "tokenizer.json: Replace normaliser needs a String pattern");
        if (strstr(json_string_value(to), SPM_SPACE)) f->spm_norm = true;
        return tdm_tok_add_norm(tok, false, json_string_value(from), json_string_length(from),
                                json_string_value(to), json_string_length(to));
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: normalizer '%s' is not supported", t);
}

/* ---- pre-tokenizer ---- */

static tdm_status parse_pre(struct tdm_tok *tok, const json_t *j, struct hf_flags *f)
{
    if (!j || json_is_null(j)) return TDM_OK;
    if (!json_is_object(j)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad pre_tokenizer");
    const char *t = type_of(j);
    if (f->pre_byte_level)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "tokenizer.json: pre-tokenizer step '%s' after ByteLevel", t);
    if (!strcmp(t, "Sequence")) {
        const json_t *arr = json_object_get(j, "pretokenizers");
        if (!json_is_array(arr))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Sequence without pretokenizers");
        size_t i;
        const json_t *v;
        json_array_foreach(arr, i, v)
        {
            tdm_status st = parse_pre(tok, v, f);
            if (st) return st;
        }
        return TDM_OK;
    }
    if (!strcmp(t, "ByteLevel")) {
        if (jbool(j, "add_prefix_space", true))
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "tokenizer.json: ByteLevel with add_prefix_space is not supported");
        f->pre_byte_level = true;
        if (jbool(j, "use_regex", true))
            return tdm_tok_add_regex_stage(tok, TDM_TOK_RE_GPT2, strlen(TDM_TOK_RE_GPT2), false);
        return TDM_OK;
    }
    if (!strcmp(t, "Split")) {
        const char *behavior = jstr(j, "behavior");
        if (!behavior || strcmp(behavior, "Isolated") || jbool(j, "invert", false))
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "tokenizer.json: Split supports only Isolated, not inverted");
        const json_t *pat = json_object_get(j, "pattern");
        const json_t *re = json_object_get(pat, "Regex");
        const json_t *lit = json_object_get(pat, "String");
        if (json_is_string(re))
            return tdm_tok_add_regex_stage(tok, json_string_value(re), json_string_length(re),
                                           false);
        if (json_is_string(lit))
            return tdm_tok_add_regex_stage(tok, json_string_value(lit), json_string_length(lit),
                                           true);
        return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Split without a pattern");
    }
    if (!strcmp(t, "Digits")) {
        const char *re = jbool(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+";
        return tdm_tok_add_regex_stage(tok, re, strlen(re), false);
    }
    if (!strcmp(t, "Metaspace")) {
        if (tok->n_stages || tok->metaspace)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "tokenizer.json: Metaspace must be the first pre-tokenizer");
        const json_t *r = json_object_get(j, "replacement");
        if (!json_is_string(r)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad Metaspace");
        const char *rs = json_string_value(r);
        size_t rl = json_string_length(r);
        if (!rl || rl > 4 || (size_t)tdm_tok_utf8_len((unsigned char)rs[0]) != rl)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "tokenizer.json: Metaspace replacement must be one character");
        memcpy(tok->metaspace_repl, rs, rl);
        tok->metaspace_repl_len = rl;
        tok->metaspace = true;
        const char *scheme = jstr(j, "prepend_scheme");
        if (!scheme)
            tok->metaspace_prepend =
                jbool(j, "add_prefix_space", true) ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
        else if (!strcmp(scheme, "always"))
            tok->metaspace_prepend = TOK_PREPEND_ALWAYS;
        else if (!strcmp(scheme, "first"))
            tok->metaspace_prepend = TOK_PREPEND_FIRST;
        else if (!strcmp(scheme, "never"))
            tok->metaspace_prepend = TOK_PREPEND_NEVER;
        else
            return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: prepend_scheme '%s'", scheme);
        f->spm_norm = true;
        if (jbool(j, "split", true)) return tdm_tok_add_metaspace_stage(tok);
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: pre_tokenizer '%s' is not supported", t);
}

/* ---- decoder ---- */

static tdm_status parse_decoder(const json_t *j, struct hf_flags *f)
{
    if (!j || json_is_null(j)) return TDM_OK;
    if (!json_is_object(j)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad decoder");
    const char *t = type_of(j);
    if (!strcmp(t, "Sequence")) {
        const json_t *arr = json_object_get(j, "decoders");
        if (!json_is_array(arr))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Sequence without decoders");
        size_t i;
        const json_t *v;
        json_array_foreach(arr, i, v)
        {
            tdm_status st = parse_decoder(v, f);
            if (st) return st;
        }
        return TDM_OK;
    }
    if (!strcmp(t, "ByteLevel")) {
        f->dec_byte_level = true;
        return TDM_OK;
    }
    if (!strcmp(t, "Replace") || !strcmp(t, "ByteFallback") || !strcmp(t, "Fuse")) return TDM_OK;
    if (!strcmp(t, "Strip")) {
        const char *c = jstr(j, "content");
        const json_t *start = json_object_get(j, "start");
        if (c && !strcmp(c, " ") && json_is_integer(start) && json_integer_value(start) >= 1)
            f->dec_strip = true;
        return TDM_OK;
    }
    if (!strcmp(t, "Metaspace")) {
        const char *scheme = jstr(j, "prepend_scheme");
        f->dec_strip = scheme ? strcmp(scheme, "never") != 0 : jbool(j, "add_prefix_space", true);
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: decoder '%s' is not supported", t);
}

/* ---- post-processor ---- */

static tdm_status template_special_id(const struct tdm_tok *tok, const json_t *tp, const char *name,
                                      int *id)
{
    const json_t *sp = json_object_get(json_object_get(tp, "special_tokens"), name);
    const json_t *ids = json_object_get(sp, "ids");
    if (json_is_array(ids) && json_array_size(ids) == 1 &&
        json_is_integer(json_array_get(ids, 0))) {
        json_int_t v = json_integer_value(json_array_get(ids, 0));
        if (v < 0 || v >= tok->n_vocab)
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: template token id %lld", (long long)v);
        *id = (int)v;
        return TDM_OK;
    }
    *id = tdm_tok_lookup(tok, name, strlen(name));
    if (*id < 0)
        return tdm_err_set(TDM_EFORMAT, "tokenizer.json: template token '%s' not in vocab", name);
    return TDM_OK;
}

static tdm_status parse_post(const struct tdm_tok *tok, const json_t *j, struct hf_flags *f)
{
    if (!j || json_is_null(j)) return TDM_OK;
    if (!json_is_object(j)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad post_processor");
    const char *t = type_of(j);
    if (!strcmp(t, "ByteLevel")) return TDM_OK;
    if (!strcmp(t, "Sequence")) {
        const json_t *arr = json_object_get(j, "processors");
        if (!json_is_array(arr))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: Sequence without processors");
        size_t i;
        const json_t *v;
        json_array_foreach(arr, i, v)
        {
            tdm_status st = parse_post(tok, v, f);
            if (st) return st;
        }
        return TDM_OK;
    }
    if (!strcmp(t, "TemplateProcessing")) {
        const json_t *single = json_object_get(j, "single");
        if (!json_is_array(single))
            return tdm_err_set(TDM_EFORMAT, "tokenizer.json: TemplateProcessing without single");
        bool seen_seq = false;
        int n_before = 0;
        size_t i;
        const json_t *v;
        json_array_foreach(single, i, v)
        {
            const json_t *sp = json_object_get(v, "SpecialToken");
            if (json_object_get(v, "Sequence")) {
                seen_seq = true;
            } else if (sp) {
                if (seen_seq || ++n_before > 1)
                    return tdm_err_set(TDM_EUNSUPPORTED,
                                       "tokenizer.json: TemplateProcessing adds tokens other "
                                       "than one leading BOS");
                const char *name = jstr(sp, "id");
                if (!name) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad SpecialToken");
                tdm_status st = template_special_id(tok, j, name, &f->bos);
                if (st) return st;
            } else {
                return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad TemplateProcessing item");
            }
        }
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: post_processor '%s' is not supported", t);
}

/* ---- model ---- */

static tdm_status parse_id(const json_t *v, const char *what, int *out)
{
    if (!json_is_integer(v))
        return tdm_err_set(TDM_EFORMAT, "tokenizer.json: %s id is not an integer", what);
    json_int_t id = json_integer_value(v);
    if (id < 0 || id >= TOK_MAX_VOCAB)
        return tdm_err_set(TDM_ERANGE, "tokenizer.json: %s id %lld outside [0, %d)", what,
                           (long long)id, TOK_MAX_VOCAB);
    *out = (int)id;
    return TDM_OK;
}

static tdm_status add_merges(struct tdm_tok *tok, const json_t *merges)
{
    if (!merges || json_is_null(merges)) return TDM_OK;
    if (!json_is_array(merges)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: bad merges");
    size_t n = json_array_size(merges);
    if (n > TOK_MAX_MERGES)
        return tdm_err_set(TDM_ERANGE, "tokenizer.json: %zu merges (cap %d)", n, TOK_MAX_MERGES);
    tdm_status st = tdm_tok_reserve_pairs(tok, n);
    if (st) return st;
    char *cat = malloc(2 * (size_t)TOK_MAX_TOKEN_BYTES);
    if (!cat) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
    size_t i;
    const json_t *m;
    json_array_foreach(merges, i, m)
    {
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(m)) {
            a = json_string_value(m);
            const char *sp = strchr(a, ' ');
            if (!sp) {
                st = tdm_err_set(TDM_EFORMAT, "tokenizer.json: merge %zu has no space", i);
                goto out_free;
            }
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = json_string_length(m) - al - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 &&
                   json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
            a = json_string_value(json_array_get(m, 0));
            al = json_string_length(json_array_get(m, 0));
            b = json_string_value(json_array_get(m, 1));
            bl = json_string_length(json_array_get(m, 1));
        } else {
            st = tdm_err_set(TDM_EFORMAT, "tokenizer.json: merge %zu is malformed", i);
            goto out_free;
        }
        if (al > TOK_MAX_TOKEN_BYTES || bl > TOK_MAX_TOKEN_BYTES) {
            st = tdm_err_set(TDM_ERANGE, "tokenizer.json: merge %zu is too long", i);
            goto out_free;
        }
        memcpy(cat, a, al);
        memcpy(cat + al, b, bl);
        int l = tdm_tok_lookup(tok, a, al), r = tdm_tok_lookup(tok, b, bl);
        int merged = tdm_tok_lookup(tok, cat, al + bl);
        if (l < 0 || r < 0 || merged < 0) {
            st =
                tdm_err_set(TDM_EFORMAT, "tokenizer.json: merge %zu names a token not in vocab", i);
            goto out_free;
        }
        st = tdm_tok_add_pair(tok, l, r, (uint32_t)i, merged);
        if (st) goto out_free;
    }
    st = TDM_OK;
out_free:
    free(cat);
    return st;
}

static tdm_status check_model_options(const json_t *model)
{
    const char *t = jstr(model, "type");
    if (t && strcmp(t, "BPE"))
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: model '%s' is not supported", t);
    const char *pre = jstr(model, "continuing_subword_prefix");
    const char *suf = jstr(model, "end_of_word_suffix");
    if ((pre && *pre) || (suf && *suf))
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "tokenizer.json: BPE subword prefixes/suffixes are not supported");
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0)
        return tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: BPE dropout is not supported");
    if (!json_is_object(json_object_get(model, "vocab")))
        return tdm_err_set(TDM_EFORMAT, "tokenizer.json: model has no vocab object");
    return TDM_OK;
}

/* "<0xXX>" with two upper-case hex digits, as HF's byte_fallback spells byte tokens. */
static bool is_byte_token(const char *s, size_t len)
{
    if (len != 6 || strncmp(s, "<0x", 3) || s[5] != '>') return false;
    for (int k = 3; k < 5; k++)
        if (!((s[k] >= '0' && s[k] <= '9') || (s[k] >= 'A' && s[k] <= 'F'))) return false;
    return true;
}

/* Name of a token in tokenizer_config.json: a string or {"content": string}. */
static const char *config_token(const json_t *cfg, const char *key)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return jstr(v, "content");
    return NULL;
}

static tdm_status load(const json_t *root, const json_t *cfg, tdm_tok_t **out)
{
    if (!json_is_object(root)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: not an object");
    const json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: no model");
    tdm_status st = check_model_options(model);
    if (st) return st;
    const json_t *vocab = json_object_get(model, "vocab");
    const json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return tdm_err_set(TDM_EFORMAT, "tokenizer.json: added_tokens is not an array");

    /* the vocabulary spans the largest id of the model and of the added tokens */
    int n_vocab = 0, id;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v)
    {
        st = parse_id(v, "vocab", &id);
        if (st) return st;
        n_vocab = TDM_MAX(n_vocab, id + 1);
    }
    size_t i;
    json_array_foreach(added, i, v)
    {
        st = parse_id(json_object_get(v, "id"), "added token", &id);
        if (st) return st;
        n_vocab = TDM_MAX(n_vocab, id + 1);
    }
    if (!n_vocab) return tdm_err_set(TDM_EFORMAT, "tokenizer.json: empty vocabulary");

    bool byte_fallback = jbool(model, "byte_fallback", false);
    struct tdm_tok *tok;
    st = tdm_tok_create(TDM_TOK_BPE_BYTES, n_vocab, &tok);
    if (st) return st;
    uint8_t *seen = calloc((size_t)n_vocab, 1);
    if (!seen) {
        st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
        goto out_free_tok;
    }
    json_object_foreach((json_t *)vocab, key, v)
    {
        parse_id(v, "vocab", &id);
        if (seen[id]) {
            st = tdm_err_set(TDM_EFORMAT, "tokenizer.json: id %d appears twice in vocab", id);
            goto out_free_seen;
        }
        seen[id] = 1;
        size_t len = strlen(key);
        enum tok_type type = TOK_T_NORMAL;
        if (byte_fallback && is_byte_token(key, len)) type = TOK_T_BYTE;
        st = tdm_tok_set_token(tok, id, key, len, type, 0);
        if (st) goto out_free_seen;
    }
    json_array_foreach(added, i, v)
    {
        parse_id(json_object_get(v, "id"), "added token", &id);
        const json_t *content = json_object_get(v, "content");
        if (!json_is_string(content)) {
            st = tdm_err_set(TDM_EFORMAT, "tokenizer.json: added token %d has no content", id);
            goto out_free_seen;
        }
        if (jbool(v, "single_word", false)) {
            st = tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: single_word added tokens");
            goto out_free_seen;
        }
        bool special = jbool(v, "special", false);
        unsigned flags = TOK_F_ADDED | (special ? TOK_F_SPECIAL : 0) |
                         (jbool(v, "lstrip", false) ? TOK_F_LSTRIP : 0) |
                         (jbool(v, "rstrip", false) ? TOK_F_RSTRIP : 0);
        st = tdm_tok_set_token(tok, id, json_string_value(content), json_string_length(content),
                               special ? TOK_T_CONTROL : TOK_T_USER, flags);
        if (st) goto out_free_seen;
    }
    st = tdm_tok_build_index(tok);
    if (st) goto out_free_seen;
    st = add_merges(tok, json_object_get(model, "merges"));
    if (st) goto out_free_seen;

    struct hf_flags f = {.bos = -1};
    st = parse_normalizer(tok, json_object_get(root, "normalizer"), &f);
    if (!st) st = parse_pre(tok, json_object_get(root, "pre_tokenizer"), &f);
    if (!st) st = parse_decoder(json_object_get(root, "decoder"), &f);
    if (!st) st = parse_post(tok, json_object_get(root, "post_processor"), &f);
    if (st) goto out_free_seen;

    if (f.pre_byte_level) {
        tok->kind = TDM_TOK_BPE_BYTES;
        if (tok->n_norm || tok->metaspace) {
            st = tdm_err_set(TDM_EUNSUPPORTED,
                             "tokenizer.json: ByteLevel with Prepend/Replace/Metaspace");
            goto out_free_seen;
        }
    } else if (byte_fallback || f.spm_norm) {
        tok->kind = TDM_TOK_SPM;
        tok->strip_leading_space = f.dec_strip;
    } else {
        st = tdm_err_set(TDM_EUNSUPPORTED, "tokenizer.json: BPE that is neither byte-level "
                                           "nor SentencePiece-style");
        goto out_free_seen;
    }
    tok->byte_fallback = byte_fallback;
    tok->fuse_unk = jbool(model, "fuse_unk", false);
    tok->ignore_merges = jbool(model, "ignore_merges", false);
    const char *unk = jstr(model, "unk_token");
    if (unk) tok->unk = tdm_tok_lookup(tok, unk, strlen(unk));

    tok->bos = f.bos;
    tok->add_bos = f.bos >= 0;
    if (cfg) {
        const char *bos = config_token(cfg, "bos_token");
        const char *eos = config_token(cfg, "eos_token");
        const char *pad = config_token(cfg, "pad_token");
        if (bos && tok->bos < 0) tok->bos = tdm_tok_lookup(tok, bos, strlen(bos));
        if (eos) tok->eos = tdm_tok_lookup(tok, eos, strlen(eos));
        if (pad) tok->pad = tdm_tok_lookup(tok, pad, strlen(pad));
        const json_t *ab = json_object_get(cfg, "add_bos_token");
        if (json_is_boolean(ab)) tok->add_bos = json_is_true(ab);
    }
    if (tok->eos < 0) {
        static const char *const EOS_NAMES[] = {"</s>", "<|endoftext|>", "<|end_of_text|>"};
        for (size_t k = 0; k < TDM_ARRAY_LEN(EOS_NAMES) && tok->eos < 0; k++)
            tok->eos = tdm_tok_lookup(tok, EOS_NAMES[k], strlen(EOS_NAMES[k]));
    }

    st = tdm_tok_finalize(tok);
    if (st) goto out_free_seen;
    free(seen);
    *out = tok;
    return TDM_OK;

out_free_seen:
    free(seen);
out_free_tok:
    tdm_tok_free(tok);
    return st;
}

static tdm_status parse_json(const char *data, size_t len, const char *what, json_t **out)
{
    json_error_t err;
    json_t *j = json_loadb(data, len, JSON_REJECT_DUPLICATES, &err);
    if (!j)
        return tdm_err_set(TDM_EFORMAT, "%s: line %d column %d: %s", what, err.line, err.column,
                           err.text);
    *out = j;
    return TDM_OK;
}

tdm_status tdm_tok_from_hf_memory(const void *data, size_t len, tdm_tok_t **out)
{
    if ((!data && len) || !out) return tdm_err_set(TDM_EINVAL, "tdm_tok_from_hf_memory: NULL");
    if (len > TOK_MAX_JSON_BYTES)
        return tdm_err_set(TDM_ERANGE, "tokenizer.json: %zu bytes (cap %zu)", len,
                           TOK_MAX_JSON_BYTES);
    json_t *root;
    tdm_status st = parse_json(data, len, "tokenizer.json", &root);
    if (st) return st;
    st = load(root, NULL, out);
    json_decref(root);
    return st;
}

tdm_status tdm_tok_from_hf(const char *path, tdm_tok_t **out)
{
    if (!path || !out) return tdm_err_set(TDM_EINVAL, "tdm_tok_from_hf: NULL argument");
    char *data = NULL, *cfg_data = NULL;
    size_t len, cfg_len;
    json_t *root = NULL, *cfg = NULL;
    tdm_status st = tdm_file_read(path, TOK_MAX_JSON_BYTES, &data, &len);
    if (st) return st;
    st = parse_json(data, len, path, &root);
    if (st) goto out_free;

    /* tokenizer_config.json beside it, when there is one */
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path) + 1 : 0;
    static const char CFG[] = "tokenizer_config.json";
    char *cfg_path = malloc(dir_len + sizeof CFG);
    if (!cfg_path) {
        st = tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory");
        goto out_free;
    }
    memcpy(cfg_path, path, dir_len);
    memcpy(cfg_path + dir_len, CFG, sizeof CFG);
    tdm_status cst = tdm_file_read(cfg_path, 64u << 20, &cfg_data, &cfg_len);
    if (!cst) {
        st = parse_json(cfg_data, cfg_len, cfg_path, &cfg);
        if (st) {
            free(cfg_path);
            goto out_free;
        }
    }
    free(cfg_path);
    st = load(root, cfg, out);
out_free:
    json_decref(cfg);
    json_decref(root);
    free(cfg_data);
    free(data);
    return st;
}
