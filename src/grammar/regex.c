/*
 * Regular expressions to AST: the ECMA-262 subset that JSON Schema's "pattern" and the
 * `regex` request field use, matched against the whole output (a leading ^ and a trailing $
 * are accepted and change nothing).
 *
 *   alternation a|b, groups (...) and (?:...), quantifiers * + ? {n} {n,} {n,m} (a lazy ?
 *   after them is accepted: the language is the same), ., classes [...] and [^...] with
 *   ranges, escapes \d \D \w \W \s \S \n \r \t \f \v \0 \xHH \uHHHH \u{H...} and escaped
 *   punctuation.
 *
 * Refused with TDM_EUNSUPPORTED, named: backreferences, lookaround, named groups with
 * backreferences, word boundaries, possessive quantifiers, anchors in the middle. Characters
 * are codepoints, spelled out as UTF-8. Single-threaded.
 */
#include <string.h>

#include "grammar/grammar_int.h"

#define MAX_NESTING 128

struct rx {
    struct ast *t;
    const char *s;
    size_t n, i;
    int depth;
    struct byteset exclude; /* bytes no set may hold (in a JSON string) */
    bool has_exclude;
};

static int32_t parse_alt(struct rx *r);

static bool at_end(const struct rx *r)
{
    return r->i >= r->n;
}

/* One UTF-8 codepoint at r->i; -1 on malformed input. */
static int32_t next_cp(struct rx *r)
{
    uint32_t c;
    int len = tdm_grammar_utf8_decode((const uint8_t *)r->s + r->i, r->n - r->i, &c);
    if (!len) return -1;
    r->i += (size_t)len;
    return (int32_t)c;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* n hex digits at r->i (n 0: \u{...}) */
static int32_t read_hex(struct rx *r, int n)
{
    uint32_t v = 0;
    if (n == 0) {
        if (at_end(r) || r->s[r->i] != '{') return -1;
        r->i++;
        int k = 0;
        while (!at_end(r) && r->s[r->i] != '}' && k < 7) {
            int h = hexval(r->s[r->i++]);
            if (h < 0) return -1;
            v = v << 4 | (uint32_t)h;
            k++;
        }
        if (at_end(r) || r->s[r->i] != '}' || k == 0) return -1;
        r->i++;
        return v > 0x10FFFF ? -1 : (int32_t)v;
    }
    for (int k = 0; k < n; k++) {
        if (at_end(r)) return -1;
        int h = hexval(r->s[r->i++]);
        if (h < 0) return -1;
        v = v << 4 | (uint32_t)h;
    }
    return (int32_t)v;
}

static bool add_class(struct cpset *s, char cls)
{
    bool ok = true;
    switch (cls) {
    case 'd':
        return tdm_cpset_add(s, '0', '9');
    case 'w':
        ok = tdm_cpset_add(s, '0', '9') && tdm_cpset_add(s, 'A', 'Z') &&
             tdm_cpset_add(s, 'a', 'z') && tdm_cpset_add(s, '_', '_');
        return ok;
    case 's':
        /* ECMA's white space and line terminators */
        ok = tdm_cpset_add(s, '\t', '\r') && tdm_cpset_add(s, ' ', ' ') &&
             tdm_cpset_add(s, 0xA0, 0xA0) && tdm_cpset_add(s, 0x1680, 0x1680) &&
             tdm_cpset_add(s, 0x2000, 0x200A) && tdm_cpset_add(s, 0x2028, 0x2029) &&
             tdm_cpset_add(s, 0x202F, 0x202F) && tdm_cpset_add(s, 0x205F, 0x205F) &&
             tdm_cpset_add(s, 0x3000, 0x3000) && tdm_cpset_add(s, 0xFEFF, 0xFEFF);
        return ok;
    }
    return false;
}

/* An escape after '\': a class (added to *set, returns -2) or one codepoint (returned); -1 on
 * error (recorded). in_class: inside [...] ('b' is then a backspace). */
static int32_t parse_escape(struct rx *r, struct cpset *set, bool in_class)
{
    if (at_end(r)) {
        tdm_ast_fail(r->t, TDM_EINVAL, "regex ends with a lone backslash");
        return -1;
    }
    char c = r->s[r->i++];
    switch (c) {
    case 'd':
    case 'w':
    case 's':
    case 'D':
    case 'W':
    case 'S': {
        char lower = (char)(c | 0x20);
        if (c == lower) {
            if (!add_class(set, lower)) goto oom;
            return -2;
        }
        struct cpset neg = {0};
        bool ok = add_class(&neg, lower) && tdm_cpset_negate(&neg);
        for (int k = 0; ok && k < neg.n; k++)
            ok = tdm_cpset_add(set, neg.r[k][0], neg.r[k][1]);
        tdm_cpset_free(&neg);
        if (!ok) goto oom;
        return -2;
    }
    case 'n':
        return '\n';
    case 'r':
        return '\r';
    case 't':
        return '\t';
    case 'f':
        return '\f';
    case 'v':
        return '\v';
    case '0':
        return 0;
    case 'x': {
        int32_t v = read_hex(r, 2);
        if (v < 0) tdm_ast_fail(r->t, TDM_EINVAL, "regex: \\x needs two hex digits");
        return v;
    }
    case 'u': {
        bool brace = !at_end(r) && r->s[r->i] == '{';
        int32_t v = read_hex(r, brace ? 0 : 4);
        if (v < 0) tdm_ast_fail(r->t, TDM_EINVAL, "regex: \\u needs four hex digits or {hex}");
        return v;
    }
    case 'b':
        if (in_class) return '\b';
        tdm_ast_fail(r->t, TDM_EUNSUPPORTED, "regex feature not supported: word boundary \\b");
        return -1;
    case 'B':
        tdm_ast_fail(r->t, TDM_EUNSUPPORTED, "regex feature not supported: \\B");
        return -1;
    case 'k':
        tdm_ast_fail(r->t, TDM_EUNSUPPORTED,
                     "regex feature not supported: named backreference \\k");
        return -1;
    case 'p':
    case 'P':
        tdm_ast_fail(r->t, TDM_EUNSUPPORTED,
                     "regex feature not supported: Unicode property escapes \\p and \\P");
        return -1;
    default:
        if (c >= '1' && c <= '9') {
            tdm_ast_fail(r->t, TDM_EUNSUPPORTED, "regex feature not supported: backreference \\%c",
                         c);
            return -1;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            tdm_ast_fail(r->t, TDM_EINVAL, "regex: unknown escape \\%c", c);
            return -1;
        }
        r->i--; /* an escaped punctuation or any other character stands for itself */
        int32_t cp = next_cp(r);
        if (cp < 0) tdm_ast_fail(r->t, TDM_EINVAL, "regex is not valid UTF-8");
        return cp;
    }
oom:
    tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
    return -1;
}

static int32_t set_node(struct rx *r, struct cpset *s)
{
    tdm_cpset_normalize(s);
    return tdm_ast_cpset(r->t, s, r->has_exclude ? &r->exclude : NULL);
}

static int32_t parse_class(struct rx *r)
{
    struct cpset s = {0};
    bool neg = !at_end(r) && r->s[r->i] == '^';
    if (neg) r->i++;
    bool first = true;
    for (;;) {
        if (at_end(r)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(r->t, TDM_EINVAL, "regex: '[' without its ']'");
        }
        if (r->s[r->i] == ']' && !first) {
            r->i++;
            break;
        }
        first = false;
        int32_t lo;
        if (r->s[r->i] == '\\') {
            r->i++;
            lo = parse_escape(r, &s, true);
            if (lo == -2) continue;
        } else {
            lo = next_cp(r);
            if (lo < 0) tdm_ast_fail(r->t, TDM_EINVAL, "regex is not valid UTF-8");
        }
        if (lo < 0) {
            tdm_cpset_free(&s);
            return 0;
        }
        int32_t hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\') {
                r->i++;
                hi = parse_escape(r, &s, true);
                if (hi == -2) {
                    tdm_cpset_free(&s);
                    return tdm_ast_fail(r->t, TDM_EINVAL, "regex: a range cannot end in a class");
                }
            } else {
                hi = next_cp(r);
            }
            if (hi < 0 || hi < lo) {
                tdm_cpset_free(&s);
                return tdm_ast_fail(r->t, TDM_EINVAL, "regex: bad range in a character class");
            }
        }
        if (!tdm_cpset_add(&s, (uint32_t)lo, (uint32_t)hi)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
        }
    }
    if (neg && !tdm_cpset_negate(&s)) {
        tdm_cpset_free(&s);
        return tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
    }
    int32_t node = set_node(r, &s);
    tdm_cpset_free(&s);
    return node;
}

static int32_t parse_atom(struct rx *r)
{
    char c = r->s[r->i];
    struct cpset s = {0};
    int32_t node;
    switch (c) {
    case '(': {
        r->i++;
        if (++r->depth > MAX_NESTING)
            return tdm_ast_fail(r->t, TDM_ERANGE, "regex nests groups deeper than %d", MAX_NESTING);
        if (!at_end(r) && r->s[r->i] == '?') {
            if (r->i + 1 < r->n && r->s[r->i + 1] == ':') {
                r->i += 2;
            } else if (r->i + 1 < r->n && r->s[r->i + 1] == '<' && r->i + 2 < r->n &&
                       r->s[r->i + 2] != '=' && r->s[r->i + 2] != '!') {
                /* a named group: the name is skipped, the group is plain */
                const char *e = memchr(r->s + r->i, '>', r->n - r->i);
                if (!e) return tdm_ast_fail(r->t, TDM_EINVAL, "regex: unterminated group name");
                r->i = (size_t)(e - r->s) + 1;
            } else {
                return tdm_ast_fail(r->t, TDM_EUNSUPPORTED,
                                    "regex feature not supported: lookaround or group flags '(?'");
            }
        }
        node = parse_alt(r);
        if (at_end(r) || r->s[r->i] != ')')
            return tdm_ast_fail(r->t, TDM_EINVAL, "regex: '(' without its ')'");
        r->i++;
        r->depth--;
        return node;
    }
    case '[':
        r->i++;
        return parse_class(r);
    case '.':
        r->i++;
        if (!tdm_cpset_add(&s, '\n', '\n') || !tdm_cpset_add(&s, '\r', '\r') ||
            !tdm_cpset_add(&s, 0x2028, 0x2029) || !tdm_cpset_negate(&s)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
        }
        node = set_node(r, &s);
        tdm_cpset_free(&s);
        return node;
    case '\\': {
        r->i++;
        int32_t cp = parse_escape(r, &s, false);
        if (cp == -1) {
            tdm_cpset_free(&s);
            return 0;
        }
        if (cp >= 0 && !tdm_cpset_add(&s, (uint32_t)cp, (uint32_t)cp)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
        }
        node = set_node(r, &s);
        tdm_cpset_free(&s);
        return node;
    }
    case '*':
    case '+':
    case '?':
    case '{':
        return tdm_ast_fail(r->t, TDM_EINVAL, "regex: quantifier '%c' with nothing to repeat", c);
    default: {
        int32_t cp = next_cp(r);
        if (cp < 0) return tdm_ast_fail(r->t, TDM_EINVAL, "regex is not valid UTF-8");
        if (!tdm_cpset_add(&s, (uint32_t)cp, (uint32_t)cp)) {
            tdm_cpset_free(&s);
            return tdm_ast_fail(r->t, TDM_ENOMEM, "out of memory compiling a regex");
        }
        node = set_node(r, &s);
        tdm_cpset_free(&s);
        return node;
    }
    }
}

static bool read_int(struct rx *r, int *v)
{
    if (at_end(r) || r->s[r->i] < '0' || r->s[r->i] > '9') return false;
    long x = 0;
    while (!at_end(r) && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        x = x * 10 + (r->s[r->i++] - '0');
        if (x > 1000000) x = 1000000;
    }
    *v = (int)x;
    return true;
}

static int32_t parse_repeat(struct rx *r)
{
    int32_t node = parse_atom(r);
    while (!at_end(r) && ast_ok(r->t)) {
        char c = r->s[r->i];
        int lo, hi;
        if (c == '*') {
            lo = 0, hi = -1;
        } else if (c == '+') {
            lo = 1, hi = -1;
        } else if (c == '?') {
            lo = 0, hi = 1;
        } else if (c == '{') {
            size_t save = r->i;
            r->i++;
            if (!read_int(r, &lo)) { /* not a quantifier: a literal '{' (ECMA's Annex B) */
                r->i = save;
                break;
            }
            hi = lo;
            if (!at_end(r) && r->s[r->i] == ',') {
                r->i++;
                if (!read_int(r, &hi)) hi = -1;
            }
            if (at_end(r) || r->s[r->i] != '}') {
                r->i = save;
                break;
            }
            if (hi >= 0 && hi < lo)
                return tdm_ast_fail(r->t, TDM_EINVAL, "regex: {%d,%d} is out of order", lo, hi);
        } else {
            break;
        }
        r->i++;
        if (!at_end(r) && r->s[r->i] == '?') r->i++; /* lazy: the same language */
        if (!at_end(r) && r->s[r->i] == '+')
            return tdm_ast_fail(r->t, TDM_EUNSUPPORTED,
                                "regex feature not supported: possessive quantifiers");
        node = tdm_ast_rep(r->t, node, lo, hi);
    }
    return node;
}

static int32_t parse_cat(struct rx *r)
{
    int32_t node = tdm_ast_empty(r->t);
    while (!at_end(r) && ast_ok(r->t)) {
        char c = r->s[r->i];
        if (c == '|' || c == ')') break;
        if (c == '^' || c == '$') {
            /* anchors: the whole output is matched, so they are no-ops at the ends */
            bool ok = c == '^' ? r->i == 0 || r->s[r->i - 1] == '(' || r->s[r->i - 1] == '|'
                               : r->i + 1 == r->n || r->s[r->i + 1] == ')' || r->s[r->i + 1] == '|';
            if (!ok)
                return tdm_ast_fail(
                    r->t, TDM_EUNSUPPORTED,
                    "regex feature not supported: an anchor '%c' inside the pattern", c);
            r->i++;
            continue;
        }
        node = tdm_ast_cat(r->t, node, parse_repeat(r));
    }
    return node;
}

static int32_t parse_alt(struct rx *r)
{
    int32_t node = parse_cat(r);
    while (!at_end(r) && r->s[r->i] == '|' && ast_ok(r->t)) {
        r->i++;
        node = tdm_ast_alt(r->t, node, parse_cat(r));
    }
    return node;
}

int32_t tdm_regex_to_ast(struct ast *t, const char *src, size_t len, bool in_json_string)
{
    struct rx r = {.t = t, .s = src, .n = len};
    if (in_json_string) {
        r.has_exclude = true;
        byteset_add(&r.exclude, 0, 0x1F);
        byteset_add(&r.exclude, '"', '"');
        byteset_add(&r.exclude, '\\', '\\');
    }
    int32_t node = parse_alt(&r);
    if (ast_ok(t) && !at_end(&r))
        return tdm_ast_fail(t, TDM_EINVAL, "regex: unbalanced ')' at offset %zu", r.i);
    return node;
}
