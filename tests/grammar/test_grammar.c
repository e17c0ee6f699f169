/*
 * The grammar engine against independent references:
 *   - regular expressions against PCRE2 (full-match, UTF mode) on random and chosen strings;
 *   - each mask against a brute force (every token's bytes fed from the state);
 *   - integer ranges against arithmetic, JSON strings against jansson's parser;
 *   - random walks through masks on the real vocabulary end complete and parse as JSON.
 * The schema suite's validation (jsonschema) is tests/grammar/test_schema_suite.py.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lib/test_rng.h"
#include "tandem/grammar.h"
#include "tandem/model.h"
#include "tandem/tok.h"
#include "tok/tok_int.h"

/* ---- a tiny vocabulary: the 256 bytes, some multi-byte pieces, an end token ---- */
static const char *const PIECES[] = {"{\"", "\":", "\"}", "true", "false", "null", "12",
                                     "345", " \"", "\",", "ab",   "abc",   "é",    "\\n",
                                     "]}",  "[1",  ",\"", "00",   "a\"",   "\"a"};
enum { N_PIECES = sizeof PIECES / sizeof *PIECES };

static uint32_t byte_cp(int b) /* GPT-2's byte-to-unicode map */
{
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return (uint32_t)b;
    int n = 0;
    for (int x = 0; x < b; x++)
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) n++;
    return 256u + (uint32_t)n;
}

static void put_cp(uint32_t cp, char **p)
{
    char b[4];
    int n = tdm_tok_utf8_encode(cp, b);
    memcpy(*p, b, (size_t)n);
    *p += n;
}

static tdm_tok_t *tiny_tok(void)
{
    json_t *vocab = json_object();
    for (int b = 0; b < 256; b++) {
        char key[8], *p = key;
        put_cp(byte_cp(b), &p);
        *p = 0;
        json_object_set_new(vocab, key, json_integer(b));
    }
    for (int i = 0; i < N_PIECES; i++) {
        char key[64], *p = key;
        for (const char *s = PIECES[i]; *s; s++)
            put_cp(byte_cp((uint8_t)*s), &p);
        *p = 0;
        json_object_set_new(vocab, key, json_integer(256 + i));
    }
    json_t *add = json_array();
    json_array_append_new(add,
                          json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", 256 + N_PIECES,
                                    "content", "<|end|>", "special", 1, "lstrip", 0, "rstrip", 0,
                                    "normalized", 0, "single_word", 0));
    json_t *j = json_pack("{s:s, s:o, s:n, s:{s:s, s:b, s:b, s:b}, s:{s:s, s:b}, s:n, s:{s:s, "
                          "s:o, s:[]}}",
                          "version", "1.0", "added_tokens", add, "normalizer", "pre_tokenizer",
                          "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                          "use_regex", 1, "decoder", "type", "ByteLevel", "add_prefix_space", 1,
                          "post_processor", "model", "type", "BPE", "vocab", vocab, "merges");
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    tdm_tok_t *tok = NULL;
    tdm_status st = tdm_tok_from_hf_memory(s, strlen(s), &tok);
    if (st) fprintf(stderr, "tiny tokenizer: %s\n", tdm_err_msg());
    assert_int_equal(st, TDM_OK);
    free(s);
    return tok;
}

struct fix {
    tdm_tok_t *tok;
    tdm_gvocab_t *v;
    int vocab, eos;
};

static int setup_tiny(void **state)
{
    struct fix *f = calloc(1, sizeof *f);
    f->tok = tiny_tok();
    f->eos = 256 + N_PIECES;
    f->vocab = f->eos + 3; /* the model's rows may exceed the tokenizer's vocabulary */
    assert_int_equal(tdm_gvocab_create(f->tok, f->vocab, &f->eos, 1, &f->v), TDM_OK);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fix *f = *state;
    tdm_gvocab_free(f->v);
    tdm_tok_free(f->tok);
    free(f);
    return 0;
}

static tdm_grammar_t *get(struct fix *f, enum tdm_grammar_kind k, const char *src)
{
    tdm_grammar_t *g = NULL;
    tdm_status st = tdm_grammar_get(f->v, k, src, strlen(src), &g);
    if (st) fprintf(stderr, "compile '%s': %s\n", src, tdm_err_msg());
    assert_int_equal(st, TDM_OK);
    return g;
}

static bool accepts(tdm_grammar_t *g, const char *s, size_t n)
{
    int32_t st = tdm_grammar_feed(g, tdm_grammar_start(g), s, n);
    return st >= 0 && tdm_grammar_accepting(g, st);
}

/* ---- regex against PCRE2 ---- */
static pcre2_code *pcre(const char *re)
{
    int err;
    PCRE2_SIZE off;
    pcre2_code *c = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED,
                                  PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED |
                                      PCRE2_DOLLAR_ENDONLY | PCRE2_ALT_BSUX,
                                  &err, &off, NULL);
    assert_non_null(c);
    return c;
}

static bool pcre_full(pcre2_code *c, const char *s, size_t n)
{
    if (!tdm_tok_utf8_valid(s, n, NULL)) return false; /* our automaton reads valid UTF-8 only */
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(c, NULL);
    int rc = pcre2_match(c, (PCRE2_SPTR)s, n, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    return rc >= 0;
}

static void test_regex_against_pcre2(void **state)
{
    struct fix *f = *state;
    static const char *const RES[] = {
        "abc",
        "a|b|cd",
        "(ab)*c?",
        "[a-c]{2,4}",
        "x[^a-z]y",
        "\\d+\\.\\d{1,2}",
        "(?:ab|a)(bc|c)",
        ".é.",
        "[à-ÿ]+",
        "a{3}",
        "a{2,}b",
        "\\w\\s\\W",
        "[\\d\\-]+",
        "(a|b)*abb",
        "\\u00e9|\\x41",
        "^[a-z]+$",
        "[^\\n]{0,3}",
        "a.c",
        "(|a)b",
        "[]a]",
    };
    /* the strings to try: every string of up to 4 symbols over an alphabet that touches each
     * pattern's classes, plus random bytes */
    static const char *const ALPHA[] = {"a", "b",  "c", "d", "x", "y", "1", "9", ".",    "-",
                                        " ", "\n", "é", "à", "ÿ", "A", "]", "_", "\xff", "\xc3"};
    const int na = sizeof ALPHA / sizeof *ALPHA;
    uint64_t rng = 7;
    for (size_t i = 0; i < sizeof RES / sizeof *RES; i++) {
        tdm_grammar_t *g = get(f, TDM_GRAMMAR_REGEX, RES[i]);
        pcre2_code *c = pcre(RES[i]);
        int checked = 0, matched = 0;
        for (int trial = 0; trial < 4000; trial++) {
            char s[32];
            size_t n = 0;
            int len = (int)(tdm_test_splitmix64(&rng) % 6);
            for (int k = 0; k < len; k++) {
                const char *a = ALPHA[tdm_test_splitmix64(&rng) % (uint64_t)na];
                memcpy(s + n, a, strlen(a));
                n += strlen(a);
            }
            bool want = pcre_full(c, s, n), got = accepts(g, s, n);
            if (want != got)
                fail_msg("regex '%s' on '%.*s': pcre2 %d, grammar %d", RES[i], (int)n, s, want,
                         got);
            checked++;
            matched += want;
        }
        assert_true(checked == 4000);
        (void)matched;
        pcre2_code_free(c);
        tdm_grammar_unref(g);
    }
}

static void test_regex_refusals(void **state)
{
    struct fix *f = *state;
    static const struct {
        const char *re;
        tdm_status st;
        const char *says;
    } BAD[] = {
        {"(a)\\1", TDM_EUNSUPPORTED, "backreference"},
        {"a(?=b)", TDM_EUNSUPPORTED, "lookaround"},
        {"\\bword", TDM_EUNSUPPORTED, "word boundary"},
        {"a++", TDM_EUNSUPPORTED, "possessive"},
        {"a^b", TDM_EUNSUPPORTED, "anchor"},
        {"(ab", TDM_EINVAL, "')'"},
        {"ab)", TDM_EINVAL, "unbalanced"},
        {"[ab", TDM_EINVAL, "']'"},
        {"*a", TDM_EINVAL, "nothing to repeat"},
        {"a{3,1}", TDM_EINVAL, "order"},
        {"[z-a]", TDM_EINVAL, "range"},
        {"\\q", TDM_EINVAL, "escape"},
        {"a{100000}{100000}", TDM_ERANGE, "too large"},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof *BAD; i++) {
        tdm_grammar_t *g = NULL;
        tdm_status st = tdm_grammar_get(f->v, TDM_GRAMMAR_REGEX, BAD[i].re, strlen(BAD[i].re), &g);
        if (st != BAD[i].st || !strstr(tdm_err_msg(), BAD[i].says))
            fail_msg("'%s': status %d '%s'", BAD[i].re, st, tdm_err_msg());
        assert_null(g);
    }
}

/* ---- masks against brute force ---- */
static void check_mask(struct fix *f, tdm_grammar_t *g, int32_t st)
{
    const uint32_t *m = tdm_grammar_mask(g, st);
    assert_non_null(m);
    for (int t = 0; t < f->vocab; t++) {
        bool bit = m[t >> 5] >> (t & 31) & 1;
        bool want;
        if (t == f->eos) {
            want = tdm_grammar_accepting(g, st);
        } else if (t >= tdm_tok_vocab_size(f->tok)) {
            want = false;
        } else {
            size_t len;
            const char *p = tdm_tok_piece(f->tok, t, &len);
            want = len > 0 && !tdm_tok_is_special(f->tok, t) &&
                   tdm_grammar_feed(g, st, p, len) != TDM_GRAMMAR_DEAD;
        }
        if (bit != want) fail_msg("state %d token %d: mask %d, brute force %d", st, t, bit, want);
        assert_int_equal(tdm_grammar_next(g, st, t) != TDM_GRAMMAR_DEAD, want);
    }
}

static void test_masks_brute_force(void **state)
{
    struct fix *f = *state;
    static const char *const SCHEMAS[] = {
        "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
        "\"boolean\"}},\"required\":[\"a\"]}",
        "{\"type\":\"array\",\"items\":{\"enum\":[\"ab\",\"abc\",null]},\"maxItems\":3}",
        "{\"type\":\"string\",\"maxLength\":4}",
    };
    uint64_t rng = 11;
    for (size_t i = 0; i < sizeof SCHEMAS / sizeof *SCHEMAS; i++) {
        tdm_grammar_t *g = get(f, TDM_GRAMMAR_JSON_SCHEMA, SCHEMAS[i]);
        /* random walks over allowed tokens, the mask checked at every state met */
        for (int walk = 0; walk < 30; walk++) {
            int32_t st = tdm_grammar_start(g);
            for (int step = 0; step < 40 && !tdm_grammar_complete(g, st); step++) {
                check_mask(f, g, st);
                const uint32_t *m = tdm_grammar_mask(g, st);
                int allowed[512], n = 0;
                for (int t = 0; t < f->vocab; t++)
                    if (m[t >> 5] >> (t & 31) & 1) allowed[n++] = t;
                assert_true(n > 0); /* a live state always has a way on */
                int t = allowed[tdm_test_splitmix64(&rng) % (uint64_t)n];
                if (t == f->eos) break;
                st = tdm_grammar_next(g, st, t);
                assert_true(st >= 0);
            }
        }
        tdm_grammar_unref(g);
    }
}

/* ---- integers against arithmetic ---- */
static void test_integer_ranges(void **state)
{
    struct fix *f = *state;
    static const long long BOUNDS[][2] = {{0, 0},    {-5, 5}, {7, 1234}, {-1000, -37},
                                          {99, 100}, {-9, 0}, {10, 99},  {123, 45678}};
    for (size_t i = 0; i < sizeof BOUNDS / sizeof *BOUNDS; i++) {
        char schema[128];
        snprintf(schema, sizeof schema, "{\"type\":\"integer\",\"minimum\":%lld,\"maximum\":%lld}",
                 BOUNDS[i][0], BOUNDS[i][1]);
        tdm_grammar_t *g = get(f, TDM_GRAMMAR_JSON_SCHEMA, schema);
        for (long long x = -50000; x <= 50000; x++) {
            char s[32];
            int n = snprintf(s, sizeof s, "%lld", x);
            bool want = x >= BOUNDS[i][0] && x <= BOUNDS[i][1];
            if (accepts(g, s, (size_t)n) != want) fail_msg("%s on %s: want %d", schema, s, want);
        }
        assert_false(accepts(g, "-0", 2));
        assert_false(accepts(g, "007", 3));
        tdm_grammar_unref(g);
    }
    /* exclusive bounds and numbers with integral bounds */
    tdm_grammar_t *g = get(f, TDM_GRAMMAR_JSON_SCHEMA,
                           "{\"type\":\"integer\",\"exclusiveMinimum\":3,\"exclusiveMaximum\":6}");
    assert_false(accepts(g, "3", 1));
    assert_true(accepts(g, "4", 1));
    assert_true(accepts(g, "5", 1));
    assert_false(accepts(g, "6", 1));
    tdm_grammar_unref(g);
    g = get(f, TDM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"number\",\"minimum\":-2,\"maximum\":3}");
    static const struct {
        const char *s;
        bool ok;
    } NUM[] = {{"-2", 1},  {"-2.0", 1}, {"-2.5", 0}, {"-1.75", 1}, {"0", 1},  {"2.999", 1},
               {"3", 1},   {"3.00", 1}, {"3.01", 0}, {"4", 0},     {"-3", 0}, {"1e2", 0},
               {"0.5", 1}, {"-0.5", 1}, {"12", 0},   {"03", 0}};
    for (size_t i = 0; i < sizeof NUM / sizeof *NUM; i++)
        if (accepts(g, NUM[i].s, strlen(NUM[i].s)) != NUM[i].ok)
            fail_msg("number in [-2, 3]: '%s' want %d", NUM[i].s, NUM[i].ok);
    tdm_grammar_unref(g);
}

/* ---- JSON strings against jansson ---- */
static void test_strings_against_jansson(void **state)
{
    struct fix *f = *state;
    tdm_grammar_t *g = get(f, TDM_GRAMMAR_JSON_SCHEMA, "{\"type\":\"string\"}");
    static const char *const ALPHA[] = {"a", "\"",   "\\", "n",  "u",    "0",    "e", "9",
                                        "é", "\x01", "/",  "\t", "\xc3", "\xff", "D", "8"};
    const int na = sizeof ALPHA / sizeof *ALPHA;
    uint64_t rng = 3;
    for (int trial = 0; trial < 20000; trial++) {
        char s[64] = "\"";
        size_t n = 1;
        int len = (int)(tdm_test_splitmix64(&rng) % 8);
        for (int k = 0; k < len; k++) {
            const char *a = ALPHA[tdm_test_splitmix64(&rng) % (uint64_t)na];
            memcpy(s + n, a, strlen(a));
            n += strlen(a);
        }
        s[n++] = '"';
        json_error_t je;
        json_t *j = json_loadb(s, n, JSON_DECODE_ANY, &je);
        bool ours = accepts(g, s, n);
        /* ours is a subset: no lone surrogate escapes; otherwise the same */
        if (ours && !j) fail_msg("grammar accepts '%.*s', jansson does not", (int)n, s);
        if (!ours && j && !strstr(s, "\\uD") && !strstr(s, "\\ud"))
            fail_msg("jansson accepts '%.*s', grammar does not", (int)n, s);
        json_decref(j);
    }
    tdm_grammar_unref(g);
}

static void test_schema_refusals(void **state)
{
    struct fix *f = *state;
    static const struct {
        const char *schema, *says;
    } BAD[] = {
        {"{\"type\":\"string\",\"uniqueItems\":true}", "'uniqueItems'"},
        {"{\"type\":\"number\",\"multipleOf\":3}", "'multipleOf'"},
        {"{\"patternProperties\":{}}", "'patternProperties'"},
        {"{\"type\":\"string\",\"format\":\"hostname\"}", "format 'hostname'"},
        {"{\"allOf\":[{},{}]}", "allOf"},
        {"{\"$ref\":\"#/nowhere\"}", "does not resolve"},
        {"{\"type\":\"number\",\"minimum\":0.5}", "integral"},
        {"{\"type\":\"strin\"}", "unknown type"},
        {"{\"type\":\"string\"", "not valid JSON"},
        {"{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "maxItems"},
        {"{\"type\":\"string\",\"pattern\":\"(a\"}", "')'"},
        {"{\"type\":\"string\",\"pattern\":\"\\\"\"}", "no value"},
        {"{\"$defs\":{\"n\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/"
         "n\"},\"minItems\":1}},"
         "\"$ref\":\"#/$defs/n\"}",
         "no value"},
    };
    for (size_t i = 0; i < sizeof BAD / sizeof *BAD; i++) {
        tdm_grammar_t *g = NULL;
        tdm_status st = tdm_grammar_get(f->v, TDM_GRAMMAR_JSON_SCHEMA, BAD[i].schema,
                                        strlen(BAD[i].schema), &g);
        if (st == TDM_OK || !strstr(tdm_err_msg(), BAD[i].says))
            fail_msg("'%s': status %d '%s'", BAD[i].schema, st, tdm_err_msg());
        assert_null(g);
    }
}

static void test_schema_languages(void **state)
{
    struct fix *f = *state;
    static const struct {
        const char *schema, *s;
        bool ok;
    } CASES[] = {
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
         "\"null\"}}}",
         "{}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
         "\"null\"}}}",
         "{\"b\": null}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
         "\"null\"}}}",
         "{\"a\":1,\"b\":null}", 1},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
         "\"null\"}}}",
         "{,\"b\":null}", 0},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
         "\"null\"}}}",
         "{\"a\":1,}", 0},
        {"{\"properties\":{\"a\":{},\"b\":{}},\"required\":[\"b\"]}", "{\"a\":[1,{}],\"b\":2}", 1},
        {"{\"properties\":{\"a\":{},\"b\":{}},\"required\":[\"b\"]}", "{\"a\":1}", 0},
        {"{\"type\":\"array\",\"prefixItems\":[{\"const\":1},{\"const\":\"x\"}],\"items\":false}",
         "[1, \"x\"]", 1},
        {"{\"type\":\"array\",\"prefixItems\":[{\"const\":1},{\"const\":\"x\"}],\"items\":false}",
         "[1]", 1},
        {"{\"type\":\"array\",\"prefixItems\":[{\"const\":1},{\"const\":\"x\"}],\"items\":false}",
         "[1,\"x\",2]", 0},
        {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":3}",
         "[true]", 0},
        {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":3}",
         "[true,false, true]", 1},
        {"{\"type\":\"array\",\"items\":{\"type\":\"boolean\"},\"minItems\":2,\"maxItems\":3}",
         "[true,false,true,true]", 0},
        {"{\"type\":[\"string\",\"null\"],\"maxLength\":2}", "\"\\u00e9x\"", 1},
        {"{\"type\":[\"string\",\"null\"],\"maxLength\":2}", "\"abc\"", 0},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-02-28\"", 1},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-02-30\"", 0},
        {"{\"type\":\"string\",\"format\":\"date\"}", "\"2024-04-31\"", 0},
        {"{\"type\":\"string\",\"format\":\"uuid\"}", "\"123e4567-e89b-12d3-a456-426614174000\"",
         1},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"enum\":[\"a\",[1,2]]}]}", "[1,2]", 1},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"enum\":[\"a\",[1,2]]}]}", "[1, 2]", 0},
        {"{\"$defs\":{\"t\":{\"type\":\"object\",\"properties\":{\"k\":{\"type\":\"array\","
         "\"items\":{\"$ref\":\"#/$defs/t\"}}},\"required\":[\"k\"]}},\"$ref\":\"#/$defs/t\"}",
         "{\"k\":[{\"k\":[]},{\"k\":[{\"k\":[]}]}]}", 1},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        tdm_grammar_t *g = get(f, TDM_GRAMMAR_JSON_SCHEMA, CASES[i].schema);
        if (accepts(g, CASES[i].s, strlen(CASES[i].s)) != CASES[i].ok)
            fail_msg("%s on %s: want %d", CASES[i].schema, CASES[i].s, CASES[i].ok);
        tdm_grammar_unref(g);
    }
}

static void test_cache(void **state)
{
    struct fix *f = *state;
    int entries;
    uint64_t hits0, misses0, hits, misses;
    tdm_gvocab_cache_stats(f->v, &entries, &hits0, &misses0);
    tdm_grammar_t *a = get(f, TDM_GRAMMAR_REGEX, "cache(me)?");
    tdm_grammar_t *b = get(f, TDM_GRAMMAR_REGEX, "cache(me)?");
    tdm_grammar_t *c = get(f, TDM_GRAMMAR_CHOICE, "[\"cache(me)?\"]");
    assert_ptr_equal(a, b);
    assert_ptr_not_equal(a, c);
    tdm_gvocab_cache_stats(f->v, &entries, &hits, &misses);
    assert_int_equal(hits - hits0, 1);
    assert_int_equal(misses - misses0, 2);
    assert_true(accepts(c, "cache(me)?", 10));
    assert_false(accepts(c, "cacheme", 7));
    assert_true(accepts(a, "cacheme", 7));
    tdm_grammar_unref(a);
    tdm_grammar_unref(b);
    tdm_grammar_unref(c);
    /* more grammars than the cache holds: the oldest go, those held stay usable */
    tdm_grammar_t *held = get(f, TDM_GRAMMAR_REGEX, "held");
    for (int i = 0; i < TDM_GRAMMAR_CACHE_ENTRIES + 5; i++) {
        char re[32];
        snprintf(re, sizeof re, "r%d", i);
        tdm_grammar_unref(get(f, TDM_GRAMMAR_REGEX, re));
    }
    tdm_gvocab_cache_stats(f->v, &entries, NULL, NULL);
    assert_int_equal(entries, TDM_GRAMMAR_CACHE_ENTRIES);
    assert_true(accepts(held, "held", 4));
    tdm_grammar_unref(held);
}

/* ---- the real vocabulary: JSON object walks end complete and parse ---- */
static void test_real_vocab_walks(void **state)
{
    (void)state;
    char path[4096];
    tdm_gguf_t *gg = NULL;
    if (!tdm_default_model_path(path, sizeof path) || tdm_gguf_open(path, &gg) != TDM_OK) {
        printf("SKIP: no default model at %s (scripts/fetch_model.sh)\n", path);
        skip();
    }
    tdm_tok_t *tok = NULL;
    assert_int_equal(tdm_tok_from_gguf(gg, &tok), TDM_OK);
    int eos = tdm_tok_eos(tok), vocab = tdm_tok_vocab_size(tok);
    tdm_gvocab_t *v = NULL;
    assert_int_equal(tdm_gvocab_create(tok, vocab, &eos, 1, &v), TDM_OK);
    tdm_grammar_t *g = NULL;
    assert_int_equal(tdm_grammar_get(v, TDM_GRAMMAR_JSON_OBJECT, NULL, 0, &g), TDM_OK);
    uint64_t rng = 5;
    int32_t *allowed = malloc((size_t)vocab * sizeof *allowed);
    int complete = 0;
    for (int walk = 0; walk < 20; walk++) {
        char out[8192];
        size_t n = 0;
        int32_t st = tdm_grammar_start(g);
        bool ended = false;
        for (int step = 0; step < 400 && !ended; step++) {
            const uint32_t *m = tdm_grammar_mask(g, st);
            assert_non_null(m);
            int k = 0;
            for (int t = 0; t < vocab; t++)
                if (m[t >> 5] >> (t & 31) & 1) allowed[k++] = t;
            assert_true(k > 0);
            /* lean towards closing: end tokens and short pieces, so walks finish */
            int t = allowed[tdm_test_splitmix64(&rng) % (uint64_t)k];
            if (step > 40)
                for (int j = 0; j < k; j++)
                    if (allowed[j] == eos) t = eos;
            if (t == eos) {
                assert_true(tdm_grammar_accepting(g, st));
                ended = true;
                break;
            }
            size_t len;
            const char *p = tdm_tok_piece(tok, t, &len);
            if (n + len >= sizeof out) break;
            memcpy(out + n, p, len);
            n += len;
            st = tdm_grammar_next(g, st, t);
            assert_true(st >= 0);
            if (tdm_grammar_complete(g, st)) ended = true;
        }
        if (!ended) continue;
        json_error_t je;
        json_t *j = json_loadb(out, n, 0, &je);
        if (!j || !json_is_object(j))
            fail_msg("walk %d made '%.*s': %s", walk, (int)n, out, je.text);
        json_decref(j);
        complete++;
    }
    assert_true(complete > 0);
    free(allowed);
    tdm_grammar_unref(g);
    tdm_gvocab_free(v);
    tdm_tok_free(tok);
    tdm_gguf_close(gg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regex_against_pcre2),     cmocka_unit_test(test_regex_refusals),
        cmocka_unit_test(test_masks_brute_force),       cmocka_unit_test(test_integer_ranges),
        cmocka_unit_test(test_strings_against_jansson), cmocka_unit_test(test_schema_refusals),
        cmocka_unit_test(test_schema_languages),        cmocka_unit_test(test_cache),
    };
    int r = cmocka_run_group_tests(tests, setup_tiny, teardown);
    const struct CMUnitTest real[] = {cmocka_unit_test(test_real_vocab_walks)};
    return r | cmocka_run_group_tests(real, NULL, NULL);
}
