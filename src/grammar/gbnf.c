/*
 * GBNF (llama.cpp's grammar format) to AST.
 *
 *   root  ::= "a" rule2* ("x" | [0-9]{2,3})   # a comment
 *   rule2 ::= [^"\\] | "\\" .
 *
 * Rules `name ::= body`; the body is an alternation of sequences of string literals ("..."
 * with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH escapes), character classes ([...], [^...] with
 * ranges and the same escapes), '.', groups, rule names, and the repetitions * + ? {m} {m,}
 * {m,n} {,n}. The start rule is "root". Token references (<...>) are refused by name.
 *
 * A rule reference expands the rule in place: the body's text is parsed again where it is
 * used, so the grammar is an AST like any other. Recursion (a rule that reaches itself) is
 * unrolled TDM_GRAMMAR_MAX_DEPTH deep: past that a recursive branch is empty (NONE), which is
 * what keeps the language regular, and the AST size cap refuses a grammar whose unrolling
 * would not fit. Single-threaded.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_int.h"

#define MAX_RULES   512
#define MAX_NESTING 128

struct rule {
    const char *name;
    size_t name_len;
    size_t body, end; /* the body's offsets in the source */
    int active;       /* expansions of it on the current path */
};

struct gb {
    struct ast *t;
    const char *s;
    size_t n;
    struct rule rules[MAX_RULES];
    int n_rules;
    int nesting;
};

struct cur {
    size_t i, end;
};

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
}

/* skips spaces, newlines and comments */
static void skip_ws(const struct gb *g, struct cur *c)
{
    while (c->i < c->end) {
        char ch = g->s[c->i];
        if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') {
            c->i++;
        } else if (ch == '#') {
            while (c->i < c->end && g->s[c->i] != '\n')
                c->i++;
        } else {
            break;
        }
    }
}

/* At c->i: does a rule definition start here (name, spaces, "::=")? Its name's length. */
static size_t rule_start(const struct gb *g, size_t i)
{
    size_t k = i;
    while (k < g->n && name_char(g->s[k]))
        k++;
    size_t len = k - i;
    if (!len) return 0;
    while (k < g->n && (g->s[k] == ' ' || g->s[k] == '\t'))
        k++;
    return k + 3 <= g->n && !memcmp(g->s + k, "::=", 3) ? len : 0;
}

/* Finds the rules: a definition starts at a name followed by ::=, outside strings, classes
 * and comments; its body runs to the next definition. */
static bool index_rules(struct gb *g)
{
    size_t i = 0;
    bool line_start = true;
    while (i < g->n) {
        char ch = g->s[i];
        if (ch == '#') {
            while (i < g->n && g->s[i] != '\n')
                i++;
            continue;
        }
        if (ch == '"' || ch == '[') { /* skip a literal or a class */
            char close = ch == '"' ? '"' : ']';
            i++;
            while (i < g->n && g->s[i] != close) {
                if (g->s[i] == '\\') i++;
                i++;
            }
            i++;
            line_start = false;
            continue;
        }
        size_t len = name_char(ch) && (line_start || i == 0 || !name_char(g->s[i - 1]))
                         ? rule_start(g, i)
                         : 0;
        if (len) {
            if (g->n_rules == MAX_RULES) {
                tdm_ast_fail(g->t, TDM_ERANGE, "grammar: more than %d rules", MAX_RULES);
                return false;
            }
            for (int r = 0; r < g->n_rules; r++)
                if (g->rules[r].name_len == len && !memcmp(g->rules[r].name, g->s + i, len)) {
                    tdm_ast_fail(g->t, TDM_EINVAL, "grammar: rule '%.*s' is defined twice",
                                 (int)len, g->s + i);
                    return false;
                }
            if (g->n_rules) g->rules[g->n_rules - 1].end = i;
            struct rule *r = &g->rules[g->n_rules++];
            r->name = g->s + i;
            r->name_len = len;
            i += len;
            while (g->s[i] != ':')
                i++;
            i += 3;
            r->body = i;
            r->end = g->n;
            line_start = false;
            continue;
        }
        line_start = ch == '\n';
        i++;
    }
    return true;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One character of a literal or class at c->i (escapes decoded); -1 on error (recorded). */
static int32_t read_char(struct gb *g, struct cur *c)
{
    const uint8_t *p = (const uint8_t *)g->s;
    if (c->i >= c->end) return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: unterminated literal"), -1;
    uint32_t ch = p[c->i];
    if (ch == '\\') {
        c->i++;
        if (c->i >= c->end) return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: lone backslash"), -1;
        char e = (char)p[c->i++];
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits) {
            uint32_t v = 0;
            for (int k = 0; k < digits; k++) {
                int h = c->i < c->end ? hexval((char)p[c->i]) : -1;
                if (h < 0) return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: bad \\%c escape", e), -1;
                v = v << 4 | (uint32_t)h;
                c->i++;
            }
            if (v > 0x10FFFF)
                return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: escape beyond U+10FFFF"), -1;
            return (int32_t)v;
        }
        switch (e) {
        case 'n':
            return '\n';
        case 'r':
            return '\r';
        case 't':
            return '\t';
        case '\\':
        case '"':
        case ']':
        case '[':
        case '-':
        case '^':
            return e;
        default:
            return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: unknown escape \\%c", e), -1;
        }
    }
    int len = tdm_grammar_utf8_decode(p + c->i, c->end - c->i, &ch);
    if (!len) return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: not valid UTF-8"), -1;
    c->i += (size_t)len;
    return (int32_t)ch;
}

static int32_t parse_alt(struct gb *g, struct cur *c);

static int32_t parse_class(struct gb *g, struct cur *c)
{
    struct cpset s = {0};
    bool neg = c->i < c->end && g->s[c->i] == '^';
    if (neg) c->i++;
    for (;;) {
        if (c->i >= c->end) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: '[' without its ']'");
        }
        if (g->s[c->i] == ']') {
            c->i++;
            break;
        }
        int32_t lo = read_char(g, c), hi = lo;
        if (lo >= 0 && c->i + 1 < c->end && g->s[c->i] == '-' && g->s[c->i + 1] != ']') {
            c->i++;
            hi = read_char(g, c);
        }
        if (lo < 0 || hi < 0 || hi < lo || !tdm_cpset_add(&s, (uint32_t)lo, (uint32_t)hi)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: bad character class");
        }
    }
    if (neg && !tdm_cpset_negate(&s)) {
        tdm_cpset_free(&s);
        return tdm_ast_fail(g->t, TDM_ENOMEM, "out of memory");
    }
    tdm_cpset_normalize(&s);
    int32_t r = tdm_ast_cpset(g->t, &s, NULL);
    tdm_cpset_free(&s);
    return r;
}

static int32_t rule_ref(struct gb *g, const char *name, size_t len)
{
    for (int i = 0; i < g->n_rules; i++) {
        struct rule *r = &g->rules[i];
        if (r->name_len != len || memcmp(r->name, name, len)) continue;
        if (r->active >= TDM_GRAMMAR_MAX_DEPTH) return 0; /* recursion unrolled: cut */
        if (++g->nesting > MAX_NESTING * 4)
            return tdm_ast_fail(g->t, TDM_ERANGE, "grammar: rules nest deeper than %d",
                                MAX_NESTING * 4);
        r->active++;
        struct cur sub = {r->body, r->end};
        int32_t body = parse_alt(g, &sub);
        skip_ws(g, &sub);
        if (ast_ok(g->t) && sub.i < sub.end)
            tdm_ast_fail(g->t, TDM_EINVAL, "grammar: unexpected '%c' in rule '%.*s'", g->s[sub.i],
                         (int)len, name);
        r->active--;
        g->nesting--;
        return body;
    }
    return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: rule '%.*s' is not defined", (int)len, name);
}

static int32_t parse_primary(struct gb *g, struct cur *c)
{
    char ch = g->s[c->i];
    if (ch == '"') {
        c->i++;
        int32_t r = tdm_ast_empty(g->t);
        while (c->i < c->end && g->s[c->i] != '"' && ast_ok(g->t)) {
            int32_t cp = read_char(g, c);
            if (cp < 0) return 0;
            r = tdm_ast_cat(g->t, r, tdm_ast_cp(g->t, (uint32_t)cp));
        }
        if (c->i >= c->end) return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: unterminated string");
        c->i++;
        return r;
    }
    if (ch == '[') {
        c->i++;
        return parse_class(g, c);
    }
    if (ch == '.') {
        c->i++;
        struct cpset s = {0};
        if (!tdm_cpset_add(&s, 0, 0x10FFFF)) return tdm_ast_fail(g->t, TDM_ENOMEM, "out of memory");
        int32_t r = tdm_ast_cpset(g->t, &s, NULL);
        tdm_cpset_free(&s);
        return r;
    }
    if (ch == '(') {
        c->i++;
        if (++g->nesting > MAX_NESTING)
            return tdm_ast_fail(g->t, TDM_ERANGE, "grammar: groups nest deeper than %d",
                                MAX_NESTING);
        int32_t r = parse_alt(g, c);
        skip_ws(g, c);
        if (c->i >= c->end || g->s[c->i] != ')')
            return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: '(' without its ')'");
        c->i++;
        g->nesting--;
        return r;
    }
    if (ch == '<' || ch == '!')
        return tdm_ast_fail(g->t, TDM_EUNSUPPORTED,
                            "grammar feature not supported: token references");
    if (name_char(ch)) {
        size_t start = c->i;
        while (c->i < c->end && name_char(g->s[c->i]))
            c->i++;
        return rule_ref(g, g->s + start, c->i - start);
    }
    return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: unexpected '%c'", ch);
}

static bool read_num(const struct gb *g, struct cur *c, int *v)
{
    if (c->i >= c->end || g->s[c->i] < '0' || g->s[c->i] > '9') return false;
    long x = 0;
    while (c->i < c->end && g->s[c->i] >= '0' && g->s[c->i] <= '9') {
        x = x * 10 + (g->s[c->i++] - '0');
        if (x > 1000000) x = 1000000;
    }
    *v = (int)x;
    return true;
}

static int32_t parse_item(struct gb *g, struct cur *c)
{
    int32_t r = parse_primary(g, c);
    while (c->i < c->end && ast_ok(g->t)) {
        char ch = g->s[c->i];
        int lo, hi;
        if (ch == '*')
            lo = 0, hi = -1;
        else if (ch == '+')
            lo = 1, hi = -1;
        else if (ch == '?')
            lo = 0, hi = 1;
        else if (ch == '{') {
            c->i++;
            skip_ws(g, c);
            if (!read_num(g, c, &lo)) lo = 0;
            hi = lo;
            skip_ws(g, c);
            if (c->i < c->end && g->s[c->i] == ',') {
                c->i++;
                skip_ws(g, c);
                if (!read_num(g, c, &hi)) hi = -1;
            }
            skip_ws(g, c);
            if (c->i >= c->end || g->s[c->i] != '}')
                return tdm_ast_fail(g->t, TDM_EINVAL, "grammar: bad repetition {...}");
        } else {
            break;
        }
        c->i++;
        r = tdm_ast_rep(g->t, r, lo, hi);
    }
    return r;
}

static int32_t parse_seq(struct gb *g, struct cur *c)
{
    int32_t r = tdm_ast_empty(g->t);
    for (;;) {
        skip_ws(g, c);
        if (c->i >= c->end || !ast_ok(g->t)) break;
        char ch = g->s[c->i];
        if (ch == '|' || ch == ')') break;
        r = tdm_ast_cat(g->t, r, parse_item(g, c));
    }
    return r;
}

static int32_t parse_alt(struct gb *g, struct cur *c)
{
    int32_t r = parse_seq(g, c);
    while (c->i < c->end && g->s[c->i] == '|' && ast_ok(g->t)) {
        c->i++;
        r = tdm_ast_alt(g->t, r, parse_seq(g, c));
    }
    return r;
}

int32_t tdm_gbnf_to_ast(struct ast *t, const char *src, size_t len)
{
    struct gb *g = calloc(1, sizeof *g);
    if (!g) return tdm_ast_fail(t, TDM_ENOMEM, "out of memory");
    *g = (struct gb){.t = t, .s = src, .n = len};
    int32_t r = 0;
    if (index_rules(g)) {
        bool has_root = false;
        for (int i = 0; i < g->n_rules; i++)
            has_root |= g->rules[i].name_len == 4 && !memcmp(g->rules[i].name, "root", 4);
        if (!has_root)
            tdm_ast_fail(t, TDM_EINVAL, "grammar: no rule named 'root'");
        else
            r = rule_ref(g, "root", 4);
        if (ast_ok(t) && t->n[r].kind == AST_NONE)
            tdm_ast_fail(t, TDM_EINVAL,
                         "grammar: 'root' matches no string (within a recursion depth of %d)",
                         TDM_GRAMMAR_MAX_DEPTH);
    }
    free(g);
    return r;
}
