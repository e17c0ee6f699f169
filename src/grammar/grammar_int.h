/*
 * The grammar module's private parts, shared by its files:
 *   ast.c     the AST builder, UTF-8 ranges, and the Thompson NFA;
 *   regex.c   regular expressions to AST;
 *   schema.c  JSON Schema (and "any JSON value", choices) to AST;
 *   gbnf.c    GBNF grammars to AST;
 *   dfa.c     the lazy DFA, the vocabulary trie, masks, the grammar cache.
 * All of it single-threaded except dfa.c, which locks (see grammar.h).
 */
#ifndef TANDEM_GRAMMAR_INT_H
#define TANDEM_GRAMMAR_INT_H

#include <stdint.h>

#include "tandem/grammar.h"

/* ---- AST ---- */
enum ast_kind {
    AST_NONE = 0, /* no string at all (an unsatisfiable branch) */
    AST_EMPTY,    /* the empty string */
    AST_SET,      /* one byte of a set */
    AST_CAT,      /* a then b */
    AST_ALT,      /* a or b */
    AST_REP,      /* a, min to max times (max -1: unbounded) */
    AST_LIST,     /* a (b a)*, at least min items counting a (0: may be empty); unbounded */
};

struct ast_node {
    uint8_t kind;
    int32_t a, b;     /* children (CAT, ALT, REP a, LIST a item / b separator) */
    int32_t min, max; /* REP, LIST */
    int32_t set;      /* SET: index into ast.sets */
    int64_t size;     /* NFA states it instantiates to */
};

struct byteset {
    uint32_t w[8];
};

struct ast {
    struct ast_node *n;
    int32_t n_nodes, cap;
    struct byteset *sets;
    int32_t n_sets, sets_cap;
    tdm_status err; /* the first error; TDM_OK while none */
    char msg[256];  /* its message */
};

void tdm_ast_init(struct ast *t);
void tdm_ast_free(struct ast *t);
/* Records the first error (later ones are dropped); returns AST_NONE's index (0). */
int32_t tdm_ast_fail(struct ast *t, tdm_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline bool ast_ok(const struct ast *t)
{
    return t->err == TDM_OK;
}
int32_t tdm_ast_none(struct ast *t);
int32_t tdm_ast_empty(struct ast *t);
int32_t tdm_ast_set(struct ast *t, const struct byteset *s); /* an empty set is NONE */
int32_t tdm_ast_byte_range(struct ast *t, int lo, int hi);
int32_t tdm_ast_lit(struct ast *t, const char *s, size_t len);
int32_t tdm_ast_cat(struct ast *t, int32_t a, int32_t b);
int32_t tdm_ast_alt(struct ast *t, int32_t a, int32_t b);
int32_t tdm_ast_rep(struct ast *t, int32_t a, int min, int max);
int32_t tdm_ast_opt(struct ast *t, int32_t a);
int32_t tdm_ast_list(struct ast *t, int32_t item, int32_t sep, int min);

static inline void byteset_add(struct byteset *s, int lo, int hi)
{
    for (int c = lo; c <= hi; c++)
        s->w[c >> 5] |= 1u << (c & 31);
}
static inline bool byteset_has(const struct byteset *s, int c)
{
    return s->w[c >> 5] >> (c & 31) & 1;
}

/* Codepoint sets: sorted, disjoint, non-adjacent ranges over [0, 0x10FFFF] less the
 * surrogates. */
struct cpset {
    uint32_t (*r)[2];
    int n, cap;
};
void tdm_cpset_free(struct cpset *s);
bool tdm_cpset_add(struct cpset *s, uint32_t lo, uint32_t hi); /* false: out of memory */
void tdm_cpset_normalize(struct cpset *s);                     /* sort and merge */
bool tdm_cpset_negate(struct cpset *s); /* complement over valid codepoints */
/* The strings from a[0, n) to b[0, n) (n <= 32) in order, where every symbol after the first
 * ranges over lo..hi (decimal digits; UTF-8 continuation bytes) */
int32_t tdm_ast_span(struct ast *t, const uint8_t *a, const uint8_t *b, int n, int lo, int hi);
int32_t tdm_ast_cp(struct ast *t, uint32_t cp);       /* one codepoint, as UTF-8 */
int tdm_grammar_utf8_encode(uint32_t cp, uint8_t *b); /* bytes written (1..4) */
/* One codepoint from p[0, left): its length, or 0 when malformed or cut */
int tdm_grammar_utf8_decode(const uint8_t *p, size_t left, uint32_t *cp);
/* The UTF-8 encodings of a set's codepoints; excluded bytes (< 0x80) taken out. */
int32_t tdm_ast_cpset(struct ast *t, const struct cpset *s, const struct byteset *exclude);

/* ---- NFA: Thompson's construction ---- */
enum { NFA_EPS = 0, NFA_SET, NFA_MATCH };
struct nfa_state {
    uint8_t kind;
    int32_t out, out2; /* EPS: up to two; SET: out; -1 none */
    int32_t set;       /* SET: index into nfa.sets */
};
struct nfa {
    struct nfa_state *s;
    int32_t n, cap;
    struct byteset *sets; /* taken from the AST */
    int32_t n_sets;
    int32_t start;
};
/* Builds the NFA of AST node root (which consumes t's sets). */
tdm_status tdm_nfa_build(struct ast *t, int32_t root, struct nfa *out);
void tdm_nfa_free(struct nfa *n);

/* ---- front ends (each returns the root node, or records an error in t) ---- */
/* A regular expression; in_json_string: the bytes '"', '\\' and controls are taken out of
 * every set, so the language fits inside a JSON string unescaped. */
int32_t tdm_regex_to_ast(struct ast *t, const char *src, size_t len, bool in_json_string);
int32_t tdm_schema_to_ast(struct ast *t, const char *src, size_t len);
int32_t tdm_json_object_ast(struct ast *t); /* any JSON object, nesting unrolled */
int32_t tdm_choice_to_ast(struct ast *t, const char *src, size_t len);
int32_t tdm_gbnf_to_ast(struct ast *t, const char *src, size_t len);
int32_t tdm_tool_calls_to_ast(struct ast *t, const char *src, size_t len);

#endif /* TANDEM_GRAMMAR_INT_H */
