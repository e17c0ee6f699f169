/*
 * Unit tests of the tok module's pieces on tiny hand-made vocabularies, where every expected
 * id follows from the merge list by hand:
 *   - UTF-8 validation (offsets of the first bad byte) and code point coding;
 *   - the GPT-2 byte -> code point map (space is U+0120 "Ġ", newline U+010A "Ċ", ...);
 *   - byte-level BPE merge order (rank first, then leftmost), added-token splitting (longest
 *     match, special vs not, lstrip/rstrip), decoding;
 *   - SentencePiece-style BPE from tokenizer.json and from GGUF (scores), byte fallback,
 *     <unk> fusing, BOS, the decoder's leading-space strip;
 *   - error paths: invalid UTF-8, small output buffers, bad ids, malformed and unsupported
 *     tokenizer.json / GGUF contents;
 *   - chat template detection and rendering.
 * The comparison against HF tokenizers on a large corpus is tests/tok/test_tokenizer.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "tandem/tok.h"
#include "tok/tok_int.h"

/* ---- helpers ---- */

/* The GPT-2 byte alphabet, written out independently of the code under test. */
static uint32_t ref_byte_cp(int b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return (uint32_t)b;
    uint32_t k = 0;
    for (int c = 0; c < b; c++)
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF)))
            k++;
    return 0x100 + k;
}

static void utf8_put(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 63)), out[2] = 0;
    } else {
        out[0] = (char)(0xE0 | cp >> 12), out[1] = (char)(0x80 | (cp >> 6 & 63));
        out[2] = (char)(0x80 | (cp & 63)), out[3] = 0;
    }
}

static size_t encode(const tdm_tok_t *tok, const char *text, int flags, int32_t *ids, size_t cap)
{
    size_t n = 0;
    tdm_status st = tdm_tok_encode(tok, text, strlen(text), flags, ids, cap, &n);
    if (st) fprintf(stderr, "encode failed: %s\n", tdm_err_msg());
    assert_int_equal(st, TDM_OK);
    return n;
}

static void assert_ids(const tdm_tok_t *tok, const char *text, int flags, const int32_t *want,
                       size_t n_want)
{
    int32_t ids[256];
    size_t n = encode(tok, text, flags, ids, 256);
    if (n != n_want || (n && memcmp(ids, want, n * sizeof *ids))) {
        fprintf(stderr, "text %s: got", text);
        for (size_t i = 0; i < n; i++)
            fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n");
    }
    assert_int_equal(n, n_want);
    if (n) assert_memory_equal(ids, want, n * sizeof *ids);
}

#define IDS(...) (const int32_t[]){__VA_ARGS__}, sizeof((const int32_t[]){__VA_ARGS__}) / 4

static void assert_decode(const tdm_tok_t *tok, const int32_t *ids, size_t n, bool skip,
                          const char *want)
{
    char buf[256];
    size_t len;
    assert_int_equal(tdm_tok_decode(tok, ids, n, skip, buf, sizeof buf, &len), TDM_OK);
    assert_int_equal(len, strlen(want));
    assert_string_equal(buf, want);
}

static tdm_tok_t *load_json(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    assert_non_null(s);
    tdm_tok_t *tok = NULL;
    tdm_status st = tdm_tok_from_hf_memory(s, strlen(s), &tok);
    if (st) fprintf(stderr, "load failed: %s\n", tdm_err_msg());
    assert_int_equal(st, TDM_OK);
    free(s);
    json_decref(j);
    return tok;
}

static tdm_status load_json_status(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    tdm_tok_t *tok = NULL;
    tdm_status st = tdm_tok_from_hf_memory(s, strlen(s), &tok);
    tdm_tok_free(tok);
    free(s);
    json_decref(j);
    return st;
}

/* ---- UTF-8 and the byte map ---- */

static void test_utf8_validation(void **state)
{
    (void)state;
    struct {
        const char *s;
        size_t len;
        long bad; /* -1: valid */
    } cases[] = {
        {"", 0, -1},
        {"plain ascii", 11, -1},
        {"caf\xc3\xa9", 5, -1},
        {"\xe2\x82\xac", 3, -1},
        {"\xf0\x9f\x98\x80", 4, -1},
        {"\xf4\x8f\xbf\xbf", 4, -1}, /* U+10FFFF */
        {"a\0b", 3, -1},             /* NUL is valid UTF-8 */
        {"\xff", 1, 0},
        {"ab\x80", 3, 2},
        {"\xc0\xaf", 2, 0},          /* overlong */
        {"\xc1\xbf", 2, 0},          /* overlong */
        {"\xe0\x9f\xbf", 3, 0},      /* overlong 3-byte */
        {"\xed\xa0\x80", 3, 0},      /* surrogate */
        {"x\xf4\x90\x80\x80", 5, 1}, /* > U+10FFFF */
        {"\xf5\x80\x80\x80", 4, 0},
        {"\xe2\x82", 2, 0}, /* truncated */
        {"ok\xf0\x9f\x98", 5, 2},
        {"\xc3\x28", 2, 0},
        {"\xe2\x28\xa1", 3, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t off = 12345;
        bool ok = tdm_tok_utf8_valid(cases[i].s, cases[i].len, &off);
        assert_int_equal(ok, cases[i].bad < 0);
        if (!ok) assert_int_equal(off, (size_t)cases[i].bad);
    }
}

static void test_utf8_coding(void **state)
{
    (void)state;
    uint32_t cps[] = {0,     0x41,   0x7F,   0x80,    0xE9,    0x7FF,
                      0x800, 0x2581, 0xFFFD, 0x10000, 0x1F600, 0x10FFFF};
    for (size_t i = 0; i < sizeof cps / sizeof cps[0]; i++) {
        char buf[4];
        int n = tdm_tok_utf8_encode(cps[i], buf);
        int want = cps[i] < 0x80 ? 1 : cps[i] < 0x800 ? 2 : cps[i] < 0x10000 ? 3 : 4;
        assert_int_equal(n, want);
        size_t bad;
        assert_true(tdm_tok_utf8_valid(buf, (size_t)n, &bad));
        uint32_t back;
        assert_int_equal(tdm_tok_utf8_decode(buf, &back), n);
        assert_int_equal(back, cps[i]);
    }
    char b[4];
    tdm_tok_utf8_encode(0x2581, b);
    assert_memory_equal(b, "\xe2\x96\x81", 3);
}

static void test_byte_map(void **state)
{
    (void)state;
    uint16_t map[256];
    tdm_tok_bytes_to_unicode(map);
    assert_int_equal(map[' '], 0x120);  /* "Ġ" */
    assert_int_equal(map['\n'], 0x10A); /* "Ċ" */
    assert_int_equal(map['\t'], 0x109); /* "ĉ" */
    assert_int_equal(map[0x00], 0x100);
    assert_int_equal(map[0x7F], 0x121);
    assert_int_equal(map[0xA0], 0x142);
    assert_int_equal(map[0xAD], 0x143);
    assert_int_equal(map['A'], 'A');
    assert_int_equal(map[0xE9], 0xE9);
    bool seen[324] = {0};
    for (int b = 0; b < 256; b++) {
        assert_int_equal(map[b], ref_byte_cp(b));
        assert_true(map[b] < 324);
        assert_false(seen[map[b]]); /* a bijection */
        seen[map[b]] = true;
    }
}

static void test_py_space(void **state)
{
    (void)state;
    uint32_t yes[] = {' ',  '\t',   '\n',   '\v',   '\f',   '\r',   0x1C,   0x1F,   0x85,
                      0xA0, 0x1680, 0x2000, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
    uint32_t no[] = {'a', 0, 0x1B, 0x200B, 0x180E, 0xFEFF, 0x2581};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        assert_true(tdm_tok_is_py_space(yes[i]));
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        assert_false(tdm_tok_is_py_space(no[i]));
}

/* \s means Unicode White_Space, as in Oniguruma (HF): U+180E is not a space, U+0085 is */
static void test_regex_white_space(void **state)
{
    (void)state;
    struct tdm_tok *tok;
    assert_int_equal(tdm_tok_create(TDM_TOK_BPE_BYTES, 1, &tok), TDM_OK);
    assert_int_equal(tdm_tok_add_regex_stage(tok, TDM_TOK_RE_GPT2, strlen(TDM_TOK_RE_GPT2), false),
                     TDM_OK);
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    struct {
        const char *s;
        size_t start, end;
    } cases[] = {
        {"x \xe1\xa0\x8ey", 1, 5}, /* " \u180e": one punctuation-like piece */
        {"x \xc2\x85y", 1, 2},     /* U+0085 is a space: " " alone (space before \S) */
        {"x  y", 1, 2},
        {"x\t\ty", 1, 2}, /* the second tab stays before "y" */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = pcre2_match(tok->stages[0].re, (PCRE2_SPTR)cases[i].s, strlen(cases[i].s), 1, 0,
                             md, NULL);
        assert_true(rc > 0);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        assert_int_equal(ov[0], cases[i].start);
        assert_int_equal(ov[1], cases[i].end);
    }
    pcre2_match_data_free(md);
    /* \S inside a class cannot be spelled out */
    assert_int_equal(tdm_tok_add_regex_stage(tok, "[\\S]", 4, false), TDM_EUNSUPPORTED);
    tdm_tok_free(tok);
}

/* ---- a tiny byte-level BPE ----
 * ids 0..255: the byte-level character of byte id; then the merges below in order. */
static const char *const BL_MERGES[][2] = {
    {"h", "e"},    /* 256 he */
    {"l", "l"},    /* 257 ll */
    {"he", "ll"},  /* 258 hell */
    {"hell", "o"}, /* 259 hello */
    {"Ġ", "w"},    /* 260 Ġw */
    {"a", "a"},    /* 261 aa */
    {"aa", "aa"},  /* 262 aaaa */
    {"b", "c"},    /* 263 bc */
    {"a", "b"},    /* 264 ab */
};
enum { BL_HE = 256, BL_HELLO = 259, BL_GW, BL_AA, BL_AAAA, BL_BC, BL_AB, BL_X, BL_XY, BL_T, BL_R };

static json_t *added(int id, const char *content, bool special, bool lstrip, bool rstrip)
{
    return json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content, "special",
                     special, "lstrip", lstrip, "rstrip", rstrip, "normalized", 0, "single_word",
                     0);
}

static json_t *byte_level_json(bool as_pairs)
{
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char key[4];
        utf8_put(ref_byte_cp(b), key);
        json_object_set_new(vocab, key, json_integer(b));
    }
    json_t *merges = json_array();
    for (size_t i = 0; i < sizeof BL_MERGES / sizeof BL_MERGES[0]; i++) {
        char key[64];
        snprintf(key, sizeof key, "%s%s", BL_MERGES[i][0], BL_MERGES[i][1]);
        json_object_set_new(vocab, key, json_integer(256 + (int)i));
        if (as_pairs) {
            json_array_append_new(merges, json_pack("[s, s]", BL_MERGES[i][0], BL_MERGES[i][1]));
        } else {
            snprintf(key, sizeof key, "%s %s", BL_MERGES[i][0], BL_MERGES[i][1]);
            json_array_append_new(merges, json_string(key));
        }
    }
    json_t *add = json_array();
    json_array_append_new(add, added(BL_X, "<|x|>", true, false, false));
    json_array_append_new(add, added(BL_XY, "<|x|>y", true, false, false));
    json_array_append_new(add, added(BL_T, "<t>", false, false, false));
    json_array_append_new(add, added(BL_R, "<r>", true, true, true));
    return json_pack("{s:s, s:o, s:n, s:{s:s, s:b, s:b, s:b}, s:{s:s, s:b}, s:n, s:{s:s, s:o, "
                     "s:o}}",
                     "version", "1.0", "added_tokens", add, "normalizer", "pre_tokenizer", "type",
                     "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 1,
                     "decoder", "type", "ByteLevel", "add_prefix_space", 1, "post_processor",
                     "model", "type", "BPE", "vocab", vocab, "merges", merges);
}

static void check_byte_level(const tdm_tok_t *tok, int n_vocab)
{
    assert_int_equal(tdm_tok_kind(tok), TDM_TOK_BPE_BYTES);
    assert_int_equal(tdm_tok_vocab_size(tok), n_vocab);
    /* "hello" merges all the way; " world": Ġ+w first, the rest are single bytes */
    assert_ids(tok, "hello world", 0, IDS(BL_HELLO, BL_GW, 'o', 'r', 'l', 'd'));
    /* equal ranks: leftmost first */
    assert_ids(tok, "aaa", 0, IDS(BL_AA, 'a'));
    assert_ids(tok, "aaaa", 0, IDS(BL_AAAA));
    assert_ids(tok, "aaaaa", 0, IDS(BL_AAAA, 'a'));
    /* the lower rank wins whatever the position: b+c (rank 7) before a+b (rank 8) */
    assert_ids(tok, "abc", 0, IDS('a', BL_BC));
    assert_ids(tok, "ab", 0, IDS(BL_AB));
    /* regex split: digits, punctuation and spaces become their own pieces */
    assert_ids(tok, "he 42!", 0, IDS(BL_HE, ' ', '4', '2', '!'));
    assert_ids(tok, "", 0, NULL, 0);
    /* bytes of multi-byte characters */
    assert_ids(tok, "\xc3\xa9", 0, IDS(0xC3, 0xA9));
}

static void test_byte_level_merges(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(byte_level_json(false));
    check_byte_level(tok, BL_R + 1);
    tdm_tok_free(tok);
    tok = load_json(byte_level_json(true)); /* merges as [a, b] pairs */
    check_byte_level(tok, BL_R + 1);
    tdm_tok_free(tok);
}

static void test_added_tokens(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(byte_level_json(false));
    /* longest match among special tokens */
    assert_ids(tok, "hello<|x|>y", TDM_TOK_PARSE_SPECIAL, IDS(BL_HELLO, BL_XY));
    assert_ids(tok, "<|x|><|x|>z", TDM_TOK_PARSE_SPECIAL, IDS(BL_X, BL_X, 'z'));
    /* without special parsing they are plain text: "<|", "x", "|>", "y" */
    assert_ids(tok, "hello<|x|>y", 0, IDS(BL_HELLO, '<', '|', 'x', '|', '>', 'y'));
    /* a non-special added token is always split out */
    assert_ids(tok, "a<t>b", 0, IDS('a', BL_T, 'b'));
    assert_ids(tok, "a<t>b", TDM_TOK_PARSE_SPECIAL, IDS('a', BL_T, 'b'));
    /* lstrip/rstrip swallow the whitespace around the token */
    assert_ids(tok, "a <r>\t b", TDM_TOK_PARSE_SPECIAL, IDS('a', BL_R, 'b'));
    assert_ids(tok, "a <r> b", 0, IDS('a', ' ', '<', 'r', '>', ' ', 'b'));
    assert_true(tdm_tok_is_special(tok, BL_X));
    assert_false(tdm_tok_is_special(tok, BL_T));
    assert_false(tdm_tok_is_special(tok, 'a'));
    assert_false(tdm_tok_is_special(tok, -1));
    assert_false(tdm_tok_is_special(tok, 100000));
    assert_int_equal(tdm_tok_find(tok, "<|x|>"), BL_X);
    assert_int_equal(tdm_tok_find(tok, "Ġw"), BL_GW);
    assert_int_equal(tdm_tok_find(tok, "nope"), -1);
    /* no BOS anywhere: the flag is a no-op */
    assert_int_equal(tdm_tok_bos(tok), -1);
    assert_false(tdm_tok_adds_bos(tok));
    assert_ids(tok, "ab", TDM_TOK_ADD_BOS, IDS(BL_AB));
    tdm_tok_free(tok);
}

/* Split with a String pattern (a literal) and Digits, then ByteLevel without its regex */
static void test_split_string_and_digits(void **state)
{
    (void)state;
    json_t *j = byte_level_json(false);
    json_object_set_new(
        j, "pre_tokenizer",
        json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b}, {s:s, s:b, s:b}]}", "type",
                  "Sequence", "pretokenizers", "type", "Split", "pattern", "String", "l.",
                  "behavior", "Isolated", "invert", 0, "type", "Digits", "individual_digits", 0,
                  "type", "ByteLevel", "add_prefix_space", 0, "use_regex", 0));
    tdm_tok_t *tok = load_json(j);
    /* "hel.lo" splits around the literal "l." (the dot is no wildcard): "he" "l." "lo" */
    assert_ids(tok, "hel.lo", 0, IDS(BL_HE, 'l', '.', 'l', 'o'));
    /* without the split, hell would merge */
    assert_ids(tok, "hello", 0, IDS(BL_HELLO));
    assert_ids(tok, "hexlo", 0, IDS(BL_HE, 'x', 'l', 'o'));
    /* contiguous digits form one piece, so the space before them stays with "a" */
    assert_ids(tok, "aa 12", 0, IDS(BL_AA, ' ', '1', '2'));
    tdm_tok_free(tok);
}

static void test_byte_level_decode(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(byte_level_json(false));
    assert_decode(tok, IDS(BL_HELLO, BL_GW, 'o'), false, "hello wo");
    assert_decode(tok, IDS('a', BL_X, 'b'), false, "a<|x|>b");
    assert_decode(tok, IDS('a', BL_X, 'b'), true, "ab");
    assert_decode(tok, IDS(BL_T), true, "<t>"); /* not special: kept */
    size_t len;
    const char *p = tdm_tok_piece(tok, ' ', &len);
    assert_int_equal(len, 1);
    assert_int_equal(p[0], ' ');
    p = tdm_tok_piece(tok, 0xC3, &len);
    assert_int_equal(len, 1);
    assert_int_equal((unsigned char)p[0], 0xC3);
    assert_null(tdm_tok_piece(tok, -1, &len));
    assert_null(tdm_tok_piece(tok, BL_R + 1, &len));

    /* round trip of every byte value through encode and decode */
    char all[512];
    size_t n = 0;
    for (int c = 1; c < 0x80; c++)
        all[n++] = (char)c;
    memcpy(all + n, "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 9);
    n += 9;
    int32_t ids[512];
    size_t n_ids;
    assert_int_equal(tdm_tok_encode(tok, all, n, 0, ids, 512, &n_ids), TDM_OK);
    char back[600];
    size_t blen;
    assert_int_equal(tdm_tok_decode(tok, ids, n_ids, false, back, sizeof back, &blen), TDM_OK);
    assert_int_equal(blen, n);
    assert_memory_equal(back, all, n);
    tdm_tok_free(tok);
}

static void test_encode_errors(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(byte_level_json(false));
    int32_t ids[8];
    size_t n = 99;
    assert_int_equal(tdm_tok_encode(tok, "ok \xe2\x82", 5, 0, ids, 8, &n), TDM_EINVAL);
    assert_string_equal(tdm_err_msg(), "tokenizer: invalid UTF-8 at byte offset 3");
    assert_int_equal(tdm_tok_encode(tok, "\xed\xa0\x80", 3, 0, ids, 8, &n), TDM_EINVAL);
    assert_string_equal(tdm_err_msg(), "tokenizer: invalid UTF-8 at byte offset 0");
    /* too small: the full count comes back with TDM_ERANGE and the first ids are written */
    assert_int_equal(tdm_tok_encode(tok, "hello world", 11, 0, ids, 2, &n), TDM_ERANGE);
    assert_int_equal(n, 6);
    assert_int_equal(ids[0], BL_HELLO);
    assert_int_equal(ids[1], BL_GW);
    assert_int_equal(tdm_tok_encode(tok, "hello", 5, 0, NULL, 0, &n), TDM_ERANGE);
    assert_int_equal(n, 1);
    assert_int_equal(tdm_tok_encode(NULL, "x", 1, 0, ids, 8, &n), TDM_EINVAL);
    assert_int_equal(tdm_tok_encode(tok, NULL, 1, 0, ids, 8, &n), TDM_EINVAL);
    assert_int_equal(tdm_tok_encode(tok, NULL, 0, 0, ids, 8, &n), TDM_OK);
    assert_int_equal(n, 0);

    char buf[4];
    size_t len;
    assert_int_equal(tdm_tok_decode(tok, IDS(BL_HELLO), false, buf, sizeof buf, &len), TDM_ERANGE);
    assert_int_equal(len, 5);
    assert_memory_equal(buf, "hell", 4);
    assert_int_equal(tdm_tok_decode(tok, IDS(-1), false, buf, sizeof buf, &len), TDM_EINVAL);
    assert_int_equal(tdm_tok_decode(tok, IDS(BL_R + 1), false, buf, sizeof buf, &len), TDM_EINVAL);
    tdm_tok_free(tok);
    tdm_tok_free(NULL);
}

/* a long run of one letter: must stay fast (heap-based merging) and merge pairwise */
static void test_long_word(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(byte_level_json(false));
    size_t n = 200001;
    char *s = malloc(n);
    memset(s, 'a', n);
    int32_t *ids = malloc(n * sizeof *ids);
    size_t n_ids;
    double t0 = tdm_now_s();
    assert_int_equal(tdm_tok_encode(tok, s, n, 0, ids, n, &n_ids), TDM_OK);
    double dt = tdm_now_s() - t0;
    assert_int_equal(n_ids, n / 4 + 1);
    for (size_t i = 0; i + 1 < n_ids; i++)
        assert_int_equal(ids[i], BL_AAAA);
    assert_int_equal(ids[n_ids - 1], 'a');
    assert_true(dt < 5.0); /* generous: sanitizer builds on a small box */
    free(ids);
    free(s);
    tdm_tok_free(tok);
}

/* ---- SentencePiece-style BPE from tokenizer.json ----
 * ids: <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258, then: */
enum { SP_SPACE = 259, SP_A, SP_B, SP_SA, SP_AB, SP_SAB, SP_C };
#define SP_BYTE(b) (3 + (b))
static const char SPACE[] = "\xe2\x96\x81";

static json_t *spm_json(bool byte_tokens, bool strip)
{
    json_t *vocab = json_object();
    json_object_set_new(vocab, "<unk>", json_integer(0));
    json_object_set_new(vocab, "<s>", json_integer(1));
    json_object_set_new(vocab, "</s>", json_integer(2));
    for (int b = 0; b < 256 && byte_tokens; b++) {
        char key[8];
        snprintf(key, sizeof key, "<0x%02X>", b);
        json_object_set_new(vocab, key, json_integer(SP_BYTE(b)));
    }
    char k[16];
    json_object_set_new(vocab, SPACE, json_integer(SP_SPACE));
    json_object_set_new(vocab, "a", json_integer(SP_A));
    json_object_set_new(vocab, "b", json_integer(SP_B));
    snprintf(k, sizeof k, "%sa", SPACE);
    json_object_set_new(vocab, k, json_integer(SP_SA));
    json_object_set_new(vocab, "ab", json_integer(SP_AB));
    snprintf(k, sizeof k, "%sab", SPACE);
    json_object_set_new(vocab, k, json_integer(SP_SAB));
    json_object_set_new(vocab, "c", json_integer(SP_C));
    json_t *merges = json_array();
    snprintf(k, sizeof k, "%s a", SPACE);
    json_array_append_new(merges, json_string(k));
    json_array_append_new(merges, json_string("a b"));
    snprintf(k, sizeof k, "%sa b", SPACE);
    json_array_append_new(merges, json_string(k));
    json_t *add = json_array();
    json_array_append_new(add, added(0, "<unk>", true, false, false));
    json_array_append_new(add, added(1, "<s>", true, false, false));
    json_array_append_new(add, added(2, "</s>", true, false, false));
    json_t *norm = json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}]}", "type", "Sequence",
                             "normalizers", "type", "Prepend", "prepend", SPACE, "type", "Replace",
                             "pattern", "String", " ", "content", SPACE);
    json_t *dec = json_pack("{s:s, s:[{s:s}, {s:s}]}", "type", "Sequence", "decoders", "type",
                            "ByteFallback", "type", "Fuse");
    if (strip)
        json_array_append_new(json_object_get(dec, "decoders"),
                              json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ",
                                        "start", 1, "stop", 0));
    json_t *post = json_pack("{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{s:{s:s, s:[i], s:[s]}}}",
                             "type", "TemplateProcessing", "single", "SpecialToken", "id", "<s>",
                             "type_id", 0, "Sequence", "id", "A", "type_id", 0, "special_tokens",
                             "<s>", "id", "<s>", "ids", 1, "tokens", "<s>");
    return json_pack("{s:o, s:o, s:n, s:o, s:o, s:{s:s, s:o, s:o, s:s, s:b, s:b}}", "added_tokens",
                     add, "normalizer", norm, "pre_tokenizer", "decoder", dec, "post_processor",
                     post, "model", "type", "BPE", "vocab", vocab, "merges", merges, "unk_token",
                     "<unk>", "fuse_unk", 1, "byte_fallback", byte_tokens);
}

static void test_spm_json(void **state)
{
    (void)state;
    tdm_tok_t *tok = load_json(spm_json(true, true));
    assert_int_equal(tdm_tok_kind(tok), TDM_TOK_SPM);
    assert_int_equal(tdm_tok_bos(tok), 1);
    assert_true(tdm_tok_adds_bos(tok));
    /* "ab" -> "▁ab": ▁+a (rank 0), then ▁a+b (rank 2) */
    assert_ids(tok, "ab", 0, IDS(SP_SAB));
    assert_ids(tok, "ab", TDM_TOK_ADD_BOS, IDS(1, SP_SAB));
    /* "b ab": ▁b ▁ab: (a,b) would be rank 1 but ▁+a (rank 0) goes first */
    assert_ids(tok, "b ab", 0, IDS(SP_SPACE, SP_B, SP_SAB));
    /* byte fallback for a character outside the vocabulary */
    assert_ids(tok, "a \xc3\xa9", 0, IDS(SP_SA, SP_SPACE, SP_BYTE(0xC3), SP_BYTE(0xA9)));
    /* special tokens: split under PARSE_SPECIAL; each following run gets its own ▁ */
    assert_ids(tok, "<s>ab", TDM_TOK_PARSE_SPECIAL, IDS(1, SP_SAB));
    assert_ids(tok, "", TDM_TOK_ADD_BOS, IDS(1));
    /* decoding: ▁ -> space, bytes fused, the leading space stripped once */
    assert_decode(tok, IDS(SP_SA, SP_SPACE, SP_BYTE(0xC3), SP_BYTE(0xA9)), false, "a \xc3\xa9");
    assert_decode(tok, IDS(1, SP_SAB), false, "<s> ab");
    assert_decode(tok, IDS(1, SP_SAB), true, "ab");
    assert_decode(tok, IDS(SP_SPACE, SP_SPACE, SP_C), false, " c");
    tdm_tok_free(tok);

    /* no byte tokens: unknown characters become one fused <unk> */
    tok = load_json(spm_json(false, false));
    assert_ids(tok, "a xyz", 0, IDS(SP_SA, SP_SPACE, 0));
    assert_ids(tok, "xaz", 0, IDS(SP_SPACE, 0, SP_A, 0));
    assert_decode(tok, IDS(SP_SA), false, " a"); /* this decoder does not strip */
    tdm_tok_free(tok);
}

/* ---- GGUF ---- */

struct wbuf {
    uint8_t *p;
    size_t len, cap;
};

static void wb_put(struct wbuf *b, const void *src, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->len + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        assert_non_null(b->p);
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void wb_u32(struct wbuf *b, uint32_t v)
{
    wb_put(b, &v, 4); /* the test hosts are little-endian, like GGUF */
}

static void wb_u64(struct wbuf *b, uint64_t v)
{
    wb_put(b, &v, 8);
}

static void wb_str(struct wbuf *b, const char *s)
{
    wb_u64(b, strlen(s));
    wb_put(b, s, strlen(s));
}

static void kv_str(struct wbuf *b, const char *key, const char *v)
{
    wb_str(b, key);
    wb_u32(b, 8);
    wb_str(b, v);
}

static void kv_u32(struct wbuf *b, const char *key, uint32_t v)
{
    wb_str(b, key);
    wb_u32(b, 4);
    wb_u32(b, v);
}

static void kv_bool(struct wbuf *b, const char *key, bool v)
{
    wb_str(b, key);
    wb_u32(b, 7);
    uint8_t x = v;
    wb_put(b, &x, 1);
}

static void kv_strs(struct wbuf *b, const char *key, char **v, size_t n)
{
    wb_str(b, key);
    wb_u32(b, 9);
    wb_u32(b, 8);
    wb_u64(b, n);
    for (size_t i = 0; i < n; i++)
        wb_str(b, v[i]);
}

static void kv_arr(struct wbuf *b, const char *key, uint32_t type, const void *v, size_t n)
{
    wb_str(b, key);
    wb_u32(b, 9);
    wb_u32(b, type);
    wb_u64(b, n);
    wb_put(b, v, n * 4);
}

static tdm_status tok_from_gguf_image(struct wbuf *kvs, uint64_t n_kv, tdm_tok_t **tok)
{
    struct wbuf img = {0};
    wb_put(&img, "GGUF", 4);
    wb_u32(&img, 3);
    wb_u64(&img, 0);
    wb_u64(&img, n_kv);
    wb_put(&img, kvs->p, kvs->len);
    tdm_gguf_t *g = NULL;
    tdm_status st = tdm_gguf_open_memory(img.p, img.len, &g);
    assert_int_equal(st, TDM_OK);
    *tok = NULL;
    st = tdm_tok_from_gguf(g, tok);
    tdm_gguf_close(g); /* the tokenizer must not keep pointers into the image */
    free(img.p);
    free(kvs->p);
    return st;
}

/* byte-level GGUF with the BL_MERGES vocabulary; `model` and `pre` may be NULL (omitted) */
static tdm_status byte_level_gguf(const char *model, const char *pre, bool with_merges,
                                  tdm_tok_t **tok)
{
    enum { N = 256 + 9 + 1 };
    char *tokens[N];
    int32_t types[N];
    for (int b = 0; b < 256; b++) {
        tokens[b] = malloc(4);
        utf8_put(ref_byte_cp(b), tokens[b]);
        types[b] = 1;
    }
    char *merges[9];
    for (int i = 0; i < 9; i++) {
        tokens[256 + i] = malloc(64);
        snprintf(tokens[256 + i], 64, "%s%s", BL_MERGES[i][0], BL_MERGES[i][1]);
        merges[i] = malloc(64);
        snprintf(merges[i], 64, "%s %s", BL_MERGES[i][0], BL_MERGES[i][1]);
        types[256 + i] = 1;
    }
    tokens[N - 1] = strdup("<|eot|>");
    types[N - 1] = 3;
    struct wbuf kv = {0};
    uint64_t n_kv = 0;
    if (model) kv_str(&kv, "tokenizer.ggml.model", model), n_kv++;
    if (pre) kv_str(&kv, "tokenizer.ggml.pre", pre), n_kv++;
    kv_strs(&kv, "tokenizer.ggml.tokens", tokens, N), n_kv++;
    kv_arr(&kv, "tokenizer.ggml.token_type", 5, types, N), n_kv++;
    if (with_merges) kv_strs(&kv, "tokenizer.ggml.merges", merges, 9), n_kv++;
    kv_u32(&kv, "tokenizer.ggml.eos_token_id", N - 1), n_kv++;
    kv_u32(&kv, "tokenizer.ggml.bos_token_id", 999999), n_kv++; /* out of range: ignored */
    for (int i = 0; i < N; i++)
        free(tokens[i]);
    for (int i = 0; i < 9; i++)
        free(merges[i]);
    return tok_from_gguf_image(&kv, n_kv, tok);
}

static void test_gguf_byte_level(void **state)
{
    (void)state;
    tdm_tok_t *tok;
    assert_int_equal(byte_level_gguf("gpt2", "gpt-2", true, &tok), TDM_OK);
    check_byte_level(tok, 266);
    assert_int_equal(tdm_tok_eos(tok), 265);
    assert_int_equal(tdm_tok_bos(tok), -1);
    assert_true(tdm_tok_is_special(tok, 265));
    assert_ids(tok, "a<|eot|>", TDM_TOK_PARSE_SPECIAL, IDS('a', 265));
    /* "smollm" adds a one-digit split before the GPT-2 regex */
    assert_ids(tok, "x 123", 0, IDS('x', ' ', '1', '2', '3'));
    tdm_tok_free(tok);
    assert_int_equal(byte_level_gguf("gpt2", "smollm", true, &tok), TDM_OK);
    assert_ids(tok, "x 123", 0, IDS('x', ' ', '1', '2', '3'));
    assert_ids(tok, "hello world", 0, IDS(BL_HELLO, BL_GW, 'o', 'r', 'l', 'd'));
    tdm_tok_free(tok);
    /* "llama-bpe": the Llama 3 regex keeps up to three digits together */
    assert_int_equal(byte_level_gguf("gpt2", "llama-bpe", true, &tok), TDM_OK);
    assert_ids(tok, "12345", 0, IDS('1', '2', '3', '4', '5')); /* no digit merges here */
    tdm_tok_free(tok);
    assert_int_equal(byte_level_gguf("gpt2", NULL, true, &tok), TDM_OK); /* default: GPT-2 */
    tdm_tok_free(tok);

    assert_int_equal(byte_level_gguf("gpt2", "no-such-pre", true, &tok), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "no-such-pre"));
    assert_int_equal(byte_level_gguf("bert", "gpt-2", true, &tok), TDM_EUNSUPPORTED);
    assert_int_equal(byte_level_gguf(NULL, "gpt-2", true, &tok), TDM_ENOTFOUND);
    assert_int_equal(byte_level_gguf("gpt2", "gpt-2", false, &tok), TDM_EFORMAT);
    assert_null(tok);
}

/* SPM from GGUF: the same vocabulary as spm_json, merges implied by scores */
static void test_gguf_spm(void **state)
{
    (void)state;
    enum { N = SP_C + 1 };
    char *tokens[N];
    int32_t types[N];
    float scores[N];
    tokens[0] = strdup("<unk>"), types[0] = 2;
    tokens[1] = strdup("<s>"), types[1] = 3;
    tokens[2] = strdup("</s>"), types[2] = 3;
    for (int b = 0; b < 256; b++) {
        tokens[SP_BYTE(b)] = malloc(8);
        snprintf(tokens[SP_BYTE(b)], 8, "<0x%02X>", b);
        types[SP_BYTE(b)] = 6;
    }
    const char *rest[] = {"\xe2\x96\x81",
                          "a",
                          "b",
                          "\xe2\x96\x81"
                          "a",
                          "ab",
                          "\xe2\x96\x81"
                          "ab",
                          "c"};
    for (int i = SP_SPACE; i < N; i++)
        tokens[i] = strdup(rest[i - SP_SPACE]), types[i] = 1;
    for (int i = 0; i < N; i++)
        scores[i] = 0;
    scores[SP_SA] = -1, scores[SP_AB] = -2, scores[SP_SAB] = -3;
    struct wbuf kv = {0};
    kv_str(&kv, "tokenizer.ggml.model", "llama");
    kv_strs(&kv, "tokenizer.ggml.tokens", tokens, N);
    kv_arr(&kv, "tokenizer.ggml.token_type", 5, types, N);
    kv_arr(&kv, "tokenizer.ggml.scores", 6, scores, N);
    kv_u32(&kv, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(&kv, "tokenizer.ggml.unknown_token_id", 0);
    kv_bool(&kv, "tokenizer.ggml.add_space_prefix", true);
    for (int i = 0; i < N; i++)
        free(tokens[i]);
    tdm_tok_t *tok;
    assert_int_equal(tok_from_gguf_image(&kv, 7, &tok), TDM_OK);
    assert_int_equal(tdm_tok_kind(tok), TDM_TOK_SPM);
    assert_true(tdm_tok_adds_bos(tok)); /* the SPM default */
    assert_ids(tok, "ab", TDM_TOK_ADD_BOS, IDS(1, SP_SAB));
    assert_ids(tok, "b ab", 0, IDS(SP_SPACE, SP_B, SP_SAB));
    assert_ids(tok, "a \xc3\xa9", 0, IDS(SP_SA, SP_SPACE, SP_BYTE(0xC3), SP_BYTE(0xA9)));
    assert_ids(tok, "<s>ab", TDM_TOK_PARSE_SPECIAL, IDS(1, SP_SAB));
    assert_decode(tok, IDS(SP_SA, SP_SPACE, SP_BYTE(0xC3), SP_BYTE(0xA9)), false, "a \xc3\xa9");
    assert_decode(tok, IDS(1, SP_SAB), true, "ab");
    tdm_tok_free(tok);
}

/* ---- malformed / unsupported tokenizer.json ---- */

static void test_json_errors(void **state)
{
    (void)state;
    tdm_tok_t *tok = NULL;
    assert_int_equal(tdm_tok_from_hf_memory("{", 1, &tok), TDM_EFORMAT);
    assert_int_equal(tdm_tok_from_hf_memory("[]", 2, &tok), TDM_EFORMAT);
    assert_int_equal(tdm_tok_from_hf_memory("{}", 2, &tok), TDM_EFORMAT);
    assert_int_equal(tdm_tok_from_hf("/nonexistent/tokenizer.json", &tok), TDM_EIO);
    assert_null(tok);

    json_t *j = byte_level_json(false);
    json_object_set_new(json_object_get(j, "model"), "type", json_string("WordPiece"));
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "WordPiece"));

    j = byte_level_json(false);
    json_object_set_new(j, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED);
    assert_non_null(strstr(tdm_err_msg(), "Whitespace"));

    j = byte_level_json(false);
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "NFKC"));
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED);

    j = byte_level_json(false); /* NFC is accepted (documented no-op) */
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "NFC"));
    assert_int_equal(load_json_status(j), TDM_OK);

    j = byte_level_json(false);
    json_array_append_new(json_object_get(json_object_get(j, "model"), "merges"),
                          json_string("q zz"));
    assert_int_equal(load_json_status(j), TDM_EFORMAT);

    j = byte_level_json(false);
    json_object_set_new(json_object_get(json_object_get(j, "model"), "vocab"), "dup",
                        json_integer(5));
    assert_int_equal(load_json_status(j), TDM_EFORMAT);

    j = byte_level_json(false);
    json_object_set_new(json_object_get(json_object_get(j, "model"), "vocab"), "neg",
                        json_integer(-3));
    assert_int_equal(load_json_status(j), TDM_ERANGE);

    j = byte_level_json(false);
    json_object_set_new(j, "pre_tokenizer",
                        json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern", "Regex",
                                  "(unclosed", "behavior", "Isolated", "invert", 0));
    assert_int_equal(load_json_status(j), TDM_EFORMAT);

    j = byte_level_json(false);
    json_object_set_new(json_object_get(j, "pre_tokenizer"), "add_prefix_space", json_true());
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED);

    j = byte_level_json(false); /* a step after ByteLevel would see byte-level text */
    json_object_set_new(j, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s, s:b, s:b}, {s:s, s:b}]}", "type", "Sequence",
                                  "pretokenizers", "type", "ByteLevel", "add_prefix_space", 0,
                                  "use_regex", 1, "type", "Digits", "individual_digits", 1));
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED);

    j = spm_json(true, true);
    json_object_set_new(j, "post_processor",
                        json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s, s:i}}]}", "type",
                                  "TemplateProcessing", "single", "Sequence", "id", "A",
                                  "SpecialToken", "id", "</s>", "type_id", 0));
    assert_int_equal(load_json_status(j), TDM_EUNSUPPORTED); /* appends EOS */
}

/* ---- chat templates ---- */

static void render(const struct tdm_chat_template *t, const struct tdm_chat_msg *m, size_t n,
                   bool gen, const char *want)
{
    char *out = NULL;
    assert_int_equal(tdm_chat_render(t, m, n, gen, &out), TDM_OK);
    assert_string_equal(out, want);
    free(out);
}

static void test_chat(void **state)
{
    (void)state;
    struct tdm_chat_template t;
    /* a real newline inside the literal (SmolLM2's GGUF template) */
    assert_int_equal(
        tdm_chat_template_detect("{% if x %}{{ '<|im_start|>system\nBe kind<|im_end|>\n' }}{% "
                                 "endif %}{{'<|im_start|>' + m['role'] + '<|im_end|>'}}",
                                 &t),
        TDM_OK);
    assert_int_equal(t.format, TDM_CHAT_CHATML);
    assert_string_equal(t.default_system, "Be kind");
    struct tdm_chat_msg user[] = {{.role = "user", .content = "hi"}};
    render(&t, user, 1, true,
           "<|im_start|>system\nBe kind<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
           "<|im_start|>assistant\n");
    struct tdm_chat_msg sys[] = {{.role = "system", .content = "S"},
                                 {.role = "user", .content = " x "}};
    render(&t, sys, 2, false, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n x <|im_end|>\n");
    render(&t, NULL, 0, true, "<|im_start|>assistant\n");
    tdm_chat_template_clear(&t);
    assert_null(t.default_system);

    /* escaped newline and an escaped quote (Qwen-style tokenizer_config.json text) */
    assert_int_equal(
        tdm_chat_template_detect("{{- '<|im_start|>system\\n' + messages[0]["
                                 "'content'] + '<|im_end|>\\n' }}{{- "
                                 "'<|im_start|>system\\nYou\\'re \"Q\"<|im_end|>\\n' }}",
                                 &t),
        TDM_OK);
    assert_string_equal(t.default_system, "You're \"Q\"");
    tdm_chat_template_clear(&t);

    /* no default system prompt */
    assert_int_equal(tdm_chat_template_detect("{{'<|im_start|>' + message['role'] + '\\n' + "
                                              "message['content'] + '<|im_end|>\\n'}}",
                                              &t),
                     TDM_OK);
    assert_null(t.default_system);
    render(&t, user, 1, false, "<|im_start|>user\nhi<|im_end|>\n");
    tdm_chat_template_clear(&t);

    /* Llama 3: BOS text before the first message, content trimmed like str.strip() */
    assert_int_equal(tdm_chat_template_detect("{{ bos_token }}<|start_header_id|>"
                                              "<|end_header_id|><|eot_id|>",
                                              &t),
                     TDM_OK);
    assert_int_equal(t.format, TDM_CHAT_LLAMA3);
    assert_true(t.add_bos_text);
    struct tdm_chat_msg l3[] = {{.role = "system", .content = "\xe3\x80\x80 S \n"},
                                {.role = "user", .content = "\xe2\x80\x8bu\t"}};
    render(&t, l3, 2, true,
           "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
           "<|start_header_id|>user<|end_header_id|>\n\n\xe2\x80\x8bu<|eot_id|>"
           "<|start_header_id|>assistant<|end_header_id|>\n\n");
    render(&t, NULL, 0, false, "");

    /* Llama 3.1's custom tools: in the first user message (indent 4), calls with "parameters",
     * results in an ipython turn */
    {
        const char *tools[] = {"{\"type\":\"function\",\"function\":{\"name\":\"f\"}}"};
        struct tdm_chat_call call = {.name = "f", .arguments = "{\"a\":1}"};
        struct tdm_chat_msg conv[] = {
            {.role = "user", .content = " q "},
            {.role = "assistant", .content = "", .calls = &call, .n_calls = 1},
            {.role = "tool", .content = "42"}};
        char *got = NULL;
        assert_int_equal(tdm_chat_render_tools(&t, conv, 3, tools, 1, true, &got), TDM_OK);
        assert_string_equal(
            got, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nGiven the following "
                 "functions, please respond with a JSON for a function call with its proper "
                 "arguments that best answers the given prompt.\n\nRespond in the format "
                 "{\"name\": function name, \"parameters\": dictionary of argument name and its "
                 "value}.Do not use variables.\n\n{\n    \"type\": \"function\",\n    "
                 "\"function\": {\n        \"name\": \"f\"\n    }\n}\n\nq<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"f\", "
                 "\"parameters\": {\"a\": 1}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>"
                 "\n\n42<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
        free(got);
        const char *bad_tool[] = {"not json"};
        assert_int_equal(tdm_chat_render_tools(&t, conv, 1, bad_tool, 1, true, &got), TDM_EINVAL);
    }

    char *out = NULL;
    struct tdm_chat_msg bad[] = {{.role = "user", .content = "\xff"}};
    assert_int_equal(tdm_chat_render(&t, bad, 1, false, &out), TDM_EINVAL);
    struct tdm_chat_msg null_content[] = {{.role = "user", .content = NULL}};
    assert_int_equal(tdm_chat_render(&t, null_content, 1, false, &out), TDM_EINVAL);
    assert_null(out);
    tdm_chat_template_clear(&t);

    struct tdm_chat_template raw = {.format = TDM_CHAT_RAW};
    render(&raw, sys, 2, true, "S x ");

    assert_int_equal(tdm_chat_template_detect("[INST] {{ m }} [/INST]", &t), TDM_EUNSUPPORTED);
    assert_int_equal(tdm_chat_template_detect(NULL, &t), TDM_EUNSUPPORTED);
    tdm_chat_template_clear(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_validation),
        cmocka_unit_test(test_utf8_coding),
        cmocka_unit_test(test_byte_map),
        cmocka_unit_test(test_py_space),
        cmocka_unit_test(test_regex_white_space),
        cmocka_unit_test(test_byte_level_merges),
        cmocka_unit_test(test_added_tokens),
        cmocka_unit_test(test_byte_level_decode),
        cmocka_unit_test(test_split_string_and_digits),
        cmocka_unit_test(test_encode_errors),
        cmocka_unit_test(test_long_word),
        cmocka_unit_test(test_spm_json),
        cmocka_unit_test(test_gguf_byte_level),
        cmocka_unit_test(test_gguf_spm),
        cmocka_unit_test(test_json_errors),
        cmocka_unit_test(test_chat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
