/*
 * The grammar AST and its NFA. Nodes live in one growing array and are named by index; a node
 * may be shared by several parents (the NFA instantiates it once per use). Each node knows the
 * number of NFA states it instantiates to, so a repetition that would blow up (a maxLength of
 * a million) is refused when it is built, not when memory runs out. Constructors simplify as
 * they go: NONE absorbs concatenations and vanishes from alternations, so an unsatisfiable
 * branch (a recursion cut at the depth limit) leaves no dead states behind.
 *
 * The NFA is Thompson's: one state per byte set, epsilon states for alternation and
 * repetition, one MATCH. A LIST (item (sep item)*) instantiates its item once and loops back
 * through the separator, which keeps "any JSON value" at two copies of a level per level
 * instead of four. Single-threaded: one compilation owns its AST and NFA.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_int.h"

void tdm_ast_init(struct ast *t)
{
    memset(t, 0, sizeof *t);
    tdm_ast_none(t); /* index 0 */
}

void tdm_ast_free(struct ast *t)
{
    free(t->n);
    free(t->sets);
    memset(t, 0, sizeof *t);
}

int32_t tdm_ast_fail(struct ast *t, tdm_status st, const char *fmt, ...)
{
    if (t->err == TDM_OK) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->msg, sizeof t->msg, fmt, ap);
        va_end(ap);
        t->err = st;
    }
    return 0;
}

static int32_t add(struct ast *t, struct ast_node n)
{
    if (t->n_nodes == t->cap) {
        int32_t cap = t->cap ? t->cap * 2 : 256;
        if (cap > TDM_GRAMMAR_MAX_NFA * 2)
            return tdm_ast_fail(t, TDM_ERANGE, "the grammar is too large (over %d nodes)",
                                TDM_GRAMMAR_MAX_NFA * 2);
        struct ast_node *p = realloc(t->n, (size_t)cap * sizeof *p);
        if (!p) return tdm_ast_fail(t, TDM_ENOMEM, "out of memory compiling a grammar");
        t->n = p;
        t->cap = cap;
    }
    if (n.size > TDM_GRAMMAR_MAX_NFA)
        return tdm_ast_fail(t, TDM_ERANGE,
                            "the grammar is too large: it would need over %d automaton states "
                            "(a repetition or length bound too high?)",
                            TDM_GRAMMAR_MAX_NFA);
    t->n[t->n_nodes] = n;
    return t->n_nodes++;
}

int32_t tdm_ast_none(struct ast *t)
{
    if (t->n_nodes > 0) return 0;
    return add(t, (struct ast_node){.kind = AST_NONE, .a = -1, .b = -1});
}

int32_t tdm_ast_empty(struct ast *t)
{
    return add(t, (struct ast_node){.kind = AST_EMPTY, .a = -1, .b = -1, .size = 1});
}

int32_t tdm_ast_set(struct ast *t, const struct byteset *s)
{
    bool any = false;
    for (int i = 0; i < 8; i++)
        any |= s->w[i] != 0;
    if (!any || !ast_ok(t)) return 0;
    if (t->n_sets == t->sets_cap) {
        int32_t cap = t->sets_cap ? t->sets_cap * 2 : 64;
        struct byteset *p = realloc(t->sets, (size_t)cap * sizeof *p);
        if (!p) return tdm_ast_fail(t, TDM_ENOMEM, "out of memory compiling a grammar");
        t->sets = p;
        t->sets_cap = cap;
    }
    t->sets[t->n_sets] = *s;
    return add(t,
               (struct ast_node){.kind = AST_SET, .a = -1, .b = -1, .set = t->n_sets++, .size = 2});
}

int32_t tdm_ast_byte_range(struct ast *t, int lo, int hi)
{
    struct byteset s = {{0}};
    byteset_add(&s, lo, hi);
    return tdm_ast_set(t, &s);
}

int32_t tdm_ast_cat(struct ast *t, int32_t a, int32_t b)
{
    if (!ast_ok(t) || t->n[a].kind == AST_NONE || t->n[b].kind == AST_NONE) return 0;
    if (t->n[a].kind == AST_EMPTY) return b;
    if (t->n[b].kind == AST_EMPTY) return a;
    return add(
        t, (struct ast_node){.kind = AST_CAT, .a = a, .b = b, .size = t->n[a].size + t->n[b].size});
}

int32_t tdm_ast_lit(struct ast *t, const char *s, size_t len)
{
    int32_t r = tdm_ast_empty(t);
    for (size_t i = len; i-- > 0 && ast_ok(t);) /* right-leaning: the NFA walks it iteratively */
        r = tdm_ast_cat(t, tdm_ast_byte_range(t, (uint8_t)s[i], (uint8_t)s[i]), r);
    return r;
}

int32_t tdm_ast_alt(struct ast *t, int32_t a, int32_t b)
{
    if (!ast_ok(t)) return 0;
    if (t->n[a].kind == AST_NONE) return b;
    if (t->n[b].kind == AST_NONE) return a;
    if (a == b) return a;
    return add(t, (struct ast_node){
                      .kind = AST_ALT, .a = a, .b = b, .size = t->n[a].size + t->n[b].size + 2});
}

int32_t tdm_ast_rep(struct ast *t, int32_t a, int min, int max)
{
    if (!ast_ok(t)) return 0;
    if (min < 0 || (max >= 0 && max < min))
        return tdm_ast_fail(t, TDM_EINVAL, "a repetition's bounds {%d,%d} are reversed", min, max);
    if (t->n[a].kind == AST_NONE) return min == 0 ? tdm_ast_empty(t) : 0;
    if (t->n[a].kind == AST_EMPTY || max == 0) return tdm_ast_empty(t);
    if (min == 1 && max == 1) return a;
    int64_t copies = max < 0 ? (min > 0 ? min : 1) : max;
    int64_t size = copies * (t->n[a].size + 2) + 2;
    if (copies > TDM_GRAMMAR_MAX_NFA || size > TDM_GRAMMAR_MAX_NFA)
        return tdm_ast_fail(t, TDM_ERANGE,
                            "the grammar is too large: a repetition of up to %d would need over %d "
                            "automaton states",
                            max < 0 ? min : max, TDM_GRAMMAR_MAX_NFA);
    return add(t, (struct ast_node){
                      .kind = AST_REP, .a = a, .b = -1, .min = min, .max = max, .size = size});
}

int32_t tdm_ast_opt(struct ast *t, int32_t a)
{
    return tdm_ast_rep(t, a, 0, 1);
}

int32_t tdm_ast_list(struct ast *t, int32_t item, int32_t sep, int min)
{
    if (!ast_ok(t)) return 0;
    if (t->n[item].kind == AST_NONE) return min == 0 ? tdm_ast_empty(t) : 0;
    if (t->n[sep].kind == AST_NONE) return min <= 1 ? (min ? item : tdm_ast_opt(t, item)) : 0;
    const int64_t copies = min > 1 ? min : 1;
    if (copies > TDM_GRAMMAR_MAX_NFA)
        return tdm_ast_fail(t, TDM_ERANGE, "the grammar is too large: a list of at least %d items",
                            min);
    int64_t size = (copies + 1) * (t->n[item].size + t->n[sep].size) + 8;
    return add(t,
               (struct ast_node){.kind = AST_LIST, .a = item, .b = sep, .min = min, .size = size});
}

/* ---- codepoint sets ---- */
void tdm_cpset_free(struct cpset *s)
{
    free(s->r);
    memset(s, 0, sizeof *s);
}

bool tdm_cpset_add(struct cpset *s, uint32_t lo, uint32_t hi)
{
    if (lo > hi) return true;
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 16;
        void *p = realloc(s->r, (size_t)cap * sizeof *s->r);
        if (!p) return false;
        s->r = p;
        s->cap = cap;
    }
    s->r[s->n][0] = lo;
    s->r[s->n][1] = hi;
    s->n++;
    return true;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

void tdm_cpset_normalize(struct cpset *s)
{
    if (s->n == 0) return;
    qsort(s->r, (size_t)s->n, sizeof *s->r, cmp_range);
    int w = 0;
    for (int i = 1; i < s->n; i++) {
        if (s->r[i][0] <= s->r[w][1] + 1) {
            if (s->r[i][1] > s->r[w][1]) s->r[w][1] = s->r[i][1];
        } else {
            w++;
            s->r[w][0] = s->r[i][0];
            s->r[w][1] = s->r[i][1];
        }
    }
    s->n = w + 1;
}

bool tdm_cpset_negate(struct cpset *s)
{
    tdm_cpset_normalize(s);
    struct cpset c = {0};
    uint32_t next = 0;
    bool ok = true;
    for (int i = 0; i < s->n && ok; i++) {
        if (s->r[i][0] > next) ok = tdm_cpset_add(&c, next, s->r[i][0] - 1);
        next = s->r[i][1] + 1;
    }
    if (ok && next <= 0x10FFFF) ok = tdm_cpset_add(&c, next, 0x10FFFF);
    if (!ok) {
        tdm_cpset_free(&c);
        return false;
    }
    tdm_cpset_free(s);
    *s = c;
    return true;
}

/* ---- UTF-8 ---- */
int tdm_grammar_utf8_encode(uint32_t cp, uint8_t *b)
{
    if (cp < 0x80) {
        b[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        b[0] = (uint8_t)(0xC0 | cp >> 6);
        b[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        b[0] = (uint8_t)(0xE0 | cp >> 12);
        b[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        b[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    b[0] = (uint8_t)(0xF0 | cp >> 18);
    b[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    b[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    b[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

int32_t tdm_ast_span(struct ast *t, const uint8_t *a, const uint8_t *b, int n, int lo, int hi)
{
    if (n == 1) return tdm_ast_byte_range(t, a[0], b[0]);
    if (a[0] == b[0])
        return tdm_ast_cat(t, tdm_ast_byte_range(t, a[0], a[0]),
                           tdm_ast_span(t, a + 1, b + 1, n - 1, lo, hi));
    uint8_t min[32], max[32];
    memset(min, lo, sizeof min);
    memset(max, hi, sizeof max);
    /* a's first symbol with the rest of a up to all-max; the first symbols strictly between,
     * with anything after; b's first with all-min up to the rest of b. A side whose rest is
     * already all-min (all-max) folds into the middle. */
    bool a_min = !memcmp(a + 1, min, (size_t)(n - 1)), b_max = !memcmp(b + 1, max, (size_t)(n - 1));
    int mid_lo = a_min ? a[0] : a[0] + 1, mid_hi = b_max ? b[0] : b[0] - 1;
    int32_t r = 0;
    if (!a_min)
        r = tdm_ast_cat(t, tdm_ast_byte_range(t, a[0], a[0]),
                        tdm_ast_span(t, a + 1, max, n - 1, lo, hi));
    if (mid_lo <= mid_hi)
        r = tdm_ast_alt(t, r,
                        tdm_ast_cat(t, tdm_ast_byte_range(t, mid_lo, mid_hi),
                                    tdm_ast_rep(t, tdm_ast_byte_range(t, lo, hi), n - 1, n - 1)));
    if (!b_max)
        r = tdm_ast_alt(t, r,
                        tdm_ast_cat(t, tdm_ast_byte_range(t, b[0], b[0]),
                                    tdm_ast_span(t, min, b + 1, n - 1, lo, hi)));
    return r;
}

static int32_t utf8_range(struct ast *t, uint32_t lo, uint32_t hi)
{
    static const uint32_t edge[] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    int32_t r = 0;
    uint32_t from = lo;
    for (int k = 0; k < 4 && from <= hi; k++) {
        if (from > edge[k]) continue;
        uint32_t to = hi < edge[k] ? hi : edge[k];
        uint8_t a[4], b[4];
        int n = tdm_grammar_utf8_encode(from, a);
        tdm_grammar_utf8_encode(to, b);
        r = tdm_ast_alt(t, r, tdm_ast_span(t, a, b, n, 0x80, 0xBF)); /* continuations: 80..BF */
        from = to + 1;
    }
    return r;
}

int32_t tdm_ast_cpset(struct ast *t, const struct cpset *s, const struct byteset *exclude)
{
    struct byteset ascii = {{0}};
    int32_t r = 0;
    for (int i = 0; i < s->n && ast_ok(t); i++) {
        uint32_t lo = s->r[i][0], hi = s->r[i][1];
        if (lo < 0x80) {
            byteset_add(&ascii, (int)lo, (int)(hi < 0x7F ? hi : 0x7F));
            lo = 0x80;
        }
        if (lo > hi) continue;
        /* the surrogates are not characters: UTF-8 has no encoding of them */
        if (lo <= 0xDFFF && hi >= 0xD800) {
            if (lo < 0xD800) r = tdm_ast_alt(t, r, utf8_range(t, lo, 0xD7FF));
            if (hi > 0xDFFF) r = tdm_ast_alt(t, r, utf8_range(t, 0xE000, hi));
        } else {
            r = tdm_ast_alt(t, r, utf8_range(t, lo, hi));
        }
    }
    if (exclude)
        for (int i = 0; i < 4; i++)
            ascii.w[i] &= ~exclude->w[i];
    return tdm_ast_alt(t, tdm_ast_set(t, &ascii), r);
}

int tdm_grammar_utf8_decode(const uint8_t *p, size_t left, uint32_t *cp)
{
    if (!left) return 0;
    uint32_t c = p[0];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || (size_t)len > left) return 0;
    if (len > 1) {
        c &= 0x3F >> (len - 1);
        for (int k = 1; k < len; k++) {
            if ((p[k] & 0xC0) != 0x80) return 0;
            c = c << 6 | (p[k] & 0x3F);
        }
    }
    *cp = c;
    return len;
}

int32_t tdm_ast_cp(struct ast *t, uint32_t cp)
{
    uint8_t b[4];
    int n = tdm_grammar_utf8_encode(cp, b);
    return tdm_ast_lit(t, (const char *)b, (size_t)n);
}

/* ---- NFA ---- */
struct frag {
    int32_t start, end; /* end: an EPS state whose out is still -1 */
};

static int32_t nstate(struct nfa *n, uint8_t kind, int32_t set)
{
    if (n->n == n->cap) {
        int32_t cap = n->cap ? n->cap * 2 : 1024;
        struct nfa_state *p = realloc(n->s, (size_t)cap * sizeof *p);
        if (!p) return -1;
        n->s = p;
        n->cap = cap;
    }
    n->s[n->n] = (struct nfa_state){.kind = kind, .out = -1, .out2 = -1, .set = set};
    return n->n++;
}

static bool inst(const struct ast *t, int32_t node, struct nfa *n, struct frag *f);

/* item (sep item)* with at least min items; min 0: the whole list may be absent. The item is
 * instantiated once past the spelled-out required pairs: the separator loops back to it. */
static bool inst_list(const struct ast *t, const struct ast_node *x, struct nfa *n, struct frag *f)
{
    int32_t s = nstate(n, NFA_EPS, -1), e = nstate(n, NFA_EPS, -1);
    if (s < 0 || e < 0) return false;
    int32_t cur = s;
    for (int k = 1; k < x->min; k++) { /* the required (item sep) pairs before the loop */
        struct frag it, sp;
        if (!inst(t, x->a, n, &it) || !inst(t, x->b, n, &sp)) return false;
        n->s[cur].out = it.start;
        n->s[it.end].out = sp.start;
        cur = sp.end;
    }
    struct frag it, sep;
    int32_t loop = nstate(n, NFA_EPS, -1);
    if (loop < 0 || !inst(t, x->a, n, &it) || !inst(t, x->b, n, &sep)) return false;
    n->s[cur].out = it.start;
    if (x->min == 0) n->s[cur].out2 = e;
    n->s[it.end].out = loop;
    n->s[loop].out = e;
    n->s[loop].out2 = sep.start;
    n->s[sep.end].out = it.start;
    *f = (struct frag){s, e};
    return true;
}

static bool inst(const struct ast *t, int32_t node, struct nfa *n, struct frag *f)
{
    /* a right spine of concatenations is walked here, not recursed into */
    int32_t first = -1, last = -1;
    for (;;) {
        const struct ast_node *x = &t->n[node];
        struct frag g;
        if (x->kind == AST_CAT) {
            if (!inst(t, x->a, n, &g)) return false;
            if (last >= 0)
                n->s[last].out = g.start;
            else
                first = g.start;
            last = g.end;
            node = x->b;
            continue;
        }
        switch (x->kind) {
        case AST_EMPTY: {
            int32_t e = nstate(n, NFA_EPS, -1);
            if (e < 0) return false;
            g = (struct frag){e, e};
            break;
        }
        case AST_SET: {
            int32_t s = nstate(n, NFA_SET, x->set), e = nstate(n, NFA_EPS, -1);
            if (s < 0 || e < 0) return false;
            n->s[s].out = e;
            g = (struct frag){s, e};
            break;
        }
        case AST_ALT: {
            struct frag a, b;
            int32_t s = nstate(n, NFA_EPS, -1), e = nstate(n, NFA_EPS, -1);
            if (s < 0 || e < 0 || !inst(t, x->a, n, &a) || !inst(t, x->b, n, &b)) return false;
            n->s[s].out = a.start;
            n->s[s].out2 = b.start;
            n->s[a.end].out = e;
            n->s[b.end].out = e;
            g = (struct frag){s, e};
            break;
        }
        case AST_REP: {
            int32_t s = nstate(n, NFA_EPS, -1);
            if (s < 0) return false;
            int32_t cur = s;
            for (int k = 0; k < x->min; k++) {
                struct frag c;
                if (!inst(t, x->a, n, &c)) return false;
                n->s[cur].out = c.start;
                cur = c.end;
            }
            int32_t e = nstate(n, NFA_EPS, -1);
            if (e < 0) return false;
            if (x->max < 0) { /* a loop: cur -> (item -> cur) | e */
                struct frag c;
                int32_t loop = nstate(n, NFA_EPS, -1);
                if (loop < 0 || !inst(t, x->a, n, &c)) return false;
                n->s[cur].out = loop;
                n->s[loop].out = c.start;
                n->s[loop].out2 = e;
                n->s[c.end].out = loop;
            } else { /* nested optionals: each may stop the run */
                for (int k = x->min; k < x->max; k++) {
                    struct frag c;
                    int32_t split = nstate(n, NFA_EPS, -1);
                    if (split < 0 || !inst(t, x->a, n, &c)) return false;
                    n->s[cur].out = split;
                    n->s[split].out = c.start;
                    n->s[split].out2 = e;
                    cur = c.end;
                }
                n->s[cur].out = e;
            }
            g = (struct frag){s, e};
            break;
        }
        case AST_LIST:
            if (!inst_list(t, x, n, &g)) return false;
            break;
        default: /* NONE never reaches here: the constructors remove it */
            return false;
        }
        if (last >= 0)
            n->s[last].out = g.start;
        else
            first = g.start;
        *f = (struct frag){first, g.end};
        return true;
    }
}

tdm_status tdm_nfa_build(struct ast *t, int32_t root, struct nfa *out)
{
    memset(out, 0, sizeof *out);
    if (!ast_ok(t)) return tdm_err_set(t->err, "%s", t->msg);
    if (t->n[root].kind == AST_NONE)
        return tdm_err_set(TDM_EINVAL, "the grammar matches no string at all");
    if (t->n[root].size > TDM_GRAMMAR_MAX_NFA)
        return tdm_err_set(TDM_ERANGE, "the grammar is too large (over %d automaton states)",
                           TDM_GRAMMAR_MAX_NFA);
    struct frag f;
    if (!inst(t, root, out, &f)) {
        tdm_nfa_free(out);
        return tdm_err_set(TDM_ENOMEM, "out of memory building a grammar's automaton");
    }
    int32_t m = nstate(out, NFA_MATCH, -1);
    if (m < 0) {
        tdm_nfa_free(out);
        return tdm_err_set(TDM_ENOMEM, "out of memory building a grammar's automaton");
    }
    out->s[f.end].out = m;
    out->start = f.start;
    out->sets = t->sets;
    out->n_sets = t->n_sets;
    t->sets = NULL;
    t->n_sets = t->sets_cap = 0;
    return TDM_OK;
}

void tdm_nfa_free(struct nfa *n)
{
    free(n->s);
    free(n->sets);
    memset(n, 0, sizeof *n);
}
