/*
 * The lazy DFA, the vocabulary trie, token masks and the grammar cache.
 *
 * A DFA state is a set of NFA states (the byte-reading and MATCH ones, epsilon-closed, sorted),
 * found again by hashing. Its 256 transitions are filled on demand; -2 in `next` means not yet
 * computed, TDM_GRAMMAR_DEAD that no string continues. A state's mask is computed the first
 * time a request stands in it: a depth-first walk of the vocabulary trie, each trie edge one
 * DFA step, a subtree skipped where the DFA dies, every token at a live node allowed. The
 * walk's cost is the trie nodes the grammar lets through (a JSON string's state lets through
 * most of them, a number's a few hundred); the mask is then kept with the state.
 *
 * Threading: a grammar's mutex guards its DFA and masks; states are never freed before the
 * grammar, and masks never change once written, so a mask pointer handed out stays valid and
 * may be read without the lock. The vocabulary is immutable after creation; its cache has a
 * mutex of its own, never held while compiling.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_int.h"

#define NEXT_UNKNOWN (-2)

struct tnode {
    int32_t child, sibling; /* first child, next sibling; -1 none */
    int32_t token;          /* a token whose bytes end here, -1 none (more: dup_next) */
    uint8_t byte;
};

struct cache_entry {
    uint64_t hash;
    enum tdm_grammar_kind kind;
    char *src;
    size_t len;
    tdm_grammar_t *g;
    uint64_t used; /* the cache's clock at the last hit */
};

struct tdm_gvocab {
    _Atomic int refs; /* the owner's and each grammar's */
    const tdm_tok_t *tok;
    int vocab, words;
    int eos[8];
    int n_eos;
    struct tnode *trie; /* [n_nodes], root 0 */
    int32_t n_nodes;
    int32_t *dup_next; /* [vocab] another token of the same bytes, -1 */
    uint8_t *in_trie;  /* [vocab] */
    int max_len;

    pthread_mutex_t mu; /* the cache */
    struct cache_entry cache[TDM_GRAMMAR_CACHE_ENTRIES];
    int n_cache;
    uint64_t clock, hits, misses;
};

struct dstate {
    int32_t *set;
    int32_t n;
    uint32_t hash;
    bool accept, has_out;
    int32_t *next;  /* [256], or NULL before the first step */
    uint32_t *mask; /* [words], or NULL before the first request here */
};

struct tdm_grammar {
    _Atomic int refs;
    tdm_gvocab_t *v;
    struct nfa nfa;
    pthread_mutex_t mu;
    struct dstate **st; /* [n_st] */
    int32_t n_st, cap_st;
    int32_t *table; /* open addressing over state ids, -1 empty */
    int32_t table_cap;
    /* scratch for closures and walks */
    int32_t *mark, *stack, *buf;
    int32_t gen;
    int32_t *walk_nodes, *walk_states;
    int n_masks;
};

/* ---- the vocabulary ---- */
static const tdm_tok_t *sort_tok;

static int cmp_piece(const void *a, const void *b)
{
    int x = *(const int32_t *)a, y = *(const int32_t *)b;
    size_t lx, ly;
    const char *px = tdm_tok_piece(sort_tok, x, &lx), *py = tdm_tok_piece(sort_tok, y, &ly);
    size_t m = lx < ly ? lx : ly;
    int c = memcmp(px, py, m);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

tdm_status tdm_gvocab_create(const tdm_tok_t *tok, int vocab, const int *eos, int n_eos,
                             tdm_gvocab_t **out)
{
    if (!tok || vocab <= 0 || n_eos < 0 || n_eos > 8)
        return tdm_err_set(TDM_EINVAL, "grammar: bad vocabulary arguments");
    tdm_gvocab_t *v = calloc(1, sizeof *v);
    if (!v) return tdm_err_set(TDM_ENOMEM, "grammar: out of memory");
    atomic_init(&v->refs, 1);
    v->tok = tok;
    v->vocab = vocab;
    v->words = tdm_grammar_mask_words(vocab);
    for (int i = 0; i < n_eos; i++)
        if (eos[i] >= 0 && eos[i] < vocab) v->eos[v->n_eos++] = eos[i];
    pthread_mutex_init(&v->mu, NULL);
    int tv = tdm_tok_vocab_size(tok);
    int n = tv < vocab ? tv : vocab;
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *ids);
    v->dup_next = malloc((size_t)vocab * sizeof *v->dup_next);
    v->in_trie = calloc((size_t)vocab, 1);
    size_t total = 1;
    int m = 0;
    if (!ids || !v->dup_next || !v->in_trie) goto oom;
    for (int i = 0; i < vocab; i++)
        v->dup_next[i] = -1;
    for (int id = 0; id < n; id++) {
        size_t len;
        const char *p = tdm_tok_piece(tok, id, &len);
        if (!p || len == 0 || tdm_tok_is_special(tok, id)) continue;
        bool is_eos = false;
        for (int k = 0; k < v->n_eos; k++)
            is_eos |= v->eos[k] == id;
        if (is_eos) continue;
        ids[m++] = id;
        total += len;
        if ((int)len > v->max_len) v->max_len = (int)len;
    }
    pthread_mutex_lock(&sort_mu);
    sort_tok = tok;
    qsort(ids, (size_t)m, sizeof *ids, cmp_piece);
    pthread_mutex_unlock(&sort_mu);
    v->trie = malloc(total * sizeof *v->trie);
    int32_t *path = malloc((size_t)(v->max_len + 1) * sizeof *path);
    int32_t *last_child = malloc((size_t)(v->max_len + 1) * sizeof *last_child);
    if (!v->trie || !path || !last_child) {
        free(path);
        free(last_child);
        goto oom;
    }
    v->trie[0] = (struct tnode){.child = -1, .sibling = -1, .token = -1};
    v->n_nodes = 1;
    path[0] = 0;
    last_child[0] = -1;
    const char *prev = NULL;
    size_t prev_len = 0;
    for (int k = 0; k < m; k++) {
        size_t len;
        const char *p = tdm_tok_piece(tok, ids[k], &len);
        size_t lcp = 0;
        while (prev && lcp < len && lcp < prev_len && p[lcp] == prev[lcp])
            lcp++;
        /* path[d] is the node of the previous token's first d bytes; keep the shared part */
        if (prev && lcp == len && len == prev_len) { /* the same bytes: another token there */
            int32_t node = path[len], *at = &v->trie[node].token;
            while (*at >= 0)
                at = &v->dup_next[*at];
            *at = ids[k];
            v->in_trie[ids[k]] = 1;
            continue;
        }
        for (size_t d = lcp; d < len; d++) {
            int32_t node = v->n_nodes++;
            v->trie[node] =
                (struct tnode){.child = -1, .sibling = -1, .token = -1, .byte = (uint8_t)p[d]};
            int32_t parent = path[d]; /* its children come in byte order: append */
            if (v->trie[parent].child < 0)
                v->trie[parent].child = node;
            else
                v->trie[last_child[d]].sibling = node;
            last_child[d] = node;
            path[d + 1] = node;
            last_child[d + 1] = -1;
        }
        v->trie[path[len]].token = ids[k];
        v->in_trie[ids[k]] = 1;
        prev = p;
        prev_len = len;
    }
    free(path);
    free(last_child);
    free(ids);
    *out = v;
    return TDM_OK;
oom:
    free(ids);
    tdm_gvocab_free(v);
    return tdm_err_set(TDM_ENOMEM, "grammar: out of memory indexing the vocabulary");
}

static void gvocab_unref(tdm_gvocab_t *v)
{
    if (atomic_fetch_sub(&v->refs, 1) != 1) return;
    pthread_mutex_destroy(&v->mu);
    free(v->trie);
    free(v->dup_next);
    free(v->in_trie);
    free(v);
}

void tdm_gvocab_free(tdm_gvocab_t *v)
{
    if (!v) return;
    /* the cache's grammars go; grammars still held elsewhere keep the vocabulary alive */
    pthread_mutex_lock(&v->mu);
    int n = v->n_cache;
    struct cache_entry held[TDM_GRAMMAR_CACHE_ENTRIES];
    memcpy(held, v->cache, (size_t)n * sizeof *held);
    v->n_cache = 0;
    pthread_mutex_unlock(&v->mu);
    for (int i = 0; i < n; i++) {
        tdm_grammar_unref(held[i].g);
        free(held[i].src);
    }
    gvocab_unref(v);
}

int tdm_gvocab_size(const tdm_gvocab_t *v)
{
    return v->vocab;
}

/* ---- DFA states ---- */
static uint32_t hash_set(const int32_t *s, int32_t n)
{
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < n; i++) {
        h ^= (uint32_t)s[i];
        h *= 16777619u;
    }
    return h ? h : 1;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

/* Adds the epsilon closure of NFA state s to buf (byte and MATCH states, each once per gen). */
static void closure(tdm_grammar_t *g, int32_t s, int32_t *n_buf)
{
    const struct nfa_state *ns = g->nfa.s;
    int32_t sp = 0;
    if (g->mark[s] == g->gen) return;
    g->mark[s] = g->gen;
    g->stack[sp++] = s;
    while (sp > 0) {
        int32_t x = g->stack[--sp];
        if (ns[x].kind != NFA_EPS) {
            g->buf[(*n_buf)++] = x;
            continue;
        }
        int32_t o[2] = {ns[x].out, ns[x].out2};
        for (int k = 1; k >= 0; k--)
            if (o[k] >= 0 && g->mark[o[k]] != g->gen) {
                g->mark[o[k]] = g->gen;
                g->stack[sp++] = o[k];
            }
    }
}

static bool table_grow(tdm_grammar_t *g)
{
    int32_t cap = g->table_cap ? g->table_cap * 2 : 1024;
    int32_t *t = malloc((size_t)cap * sizeof *t);
    if (!t) return false;
    for (int32_t i = 0; i < cap; i++)
        t[i] = -1;
    for (int32_t id = 0; id < g->n_st; id++) {
        uint32_t h = g->st[id]->hash & (uint32_t)(cap - 1);
        while (t[h] >= 0)
            h = (h + 1) & (uint32_t)(cap - 1);
        t[h] = id;
    }
    free(g->table);
    g->table = t;
    g->table_cap = cap;
    return true;
}

/* The state of the set buf[0, n) (sorted here), made if new; DEAD if empty or over the cap. */
static int32_t intern(tdm_grammar_t *g, int32_t n)
{
    if (n == 0) return TDM_GRAMMAR_DEAD;
    qsort(g->buf, (size_t)n, sizeof *g->buf, cmp_i32);
    uint32_t h = hash_set(g->buf, n);
    if (g->table_cap) {
        uint32_t i = h & (uint32_t)(g->table_cap - 1);
        for (; g->table[i] >= 0; i = (i + 1) & (uint32_t)(g->table_cap - 1)) {
            const struct dstate *d = g->st[g->table[i]];
            if (d->hash == h && d->n == n && !memcmp(d->set, g->buf, (size_t)n * sizeof *g->buf))
                return g->table[i];
        }
    }
    if (g->n_st >= TDM_GRAMMAR_MAX_DFA) return TDM_GRAMMAR_DEAD;
    if ((g->n_st + 1) * 2 > g->table_cap && !table_grow(g)) return TDM_GRAMMAR_DEAD;
    if (g->n_st == g->cap_st) {
        int32_t cap = g->cap_st ? g->cap_st * 2 : 64;
        struct dstate **p = realloc(g->st, (size_t)cap * sizeof *p);
        if (!p) return TDM_GRAMMAR_DEAD;
        g->st = p;
        g->cap_st = cap;
    }
    struct dstate *d = calloc(1, sizeof *d);
    int32_t *set = malloc((size_t)n * sizeof *set);
    if (!d || !set) {
        free(d);
        free(set);
        return TDM_GRAMMAR_DEAD;
    }
    memcpy(set, g->buf, (size_t)n * sizeof *set);
    *d = (struct dstate){.set = set, .n = n, .hash = h};
    for (int32_t i = 0; i < n; i++) {
        d->accept |= g->nfa.s[set[i]].kind == NFA_MATCH;
        d->has_out |= g->nfa.s[set[i]].kind == NFA_SET;
    }
    int32_t id = g->n_st++;
    g->st[id] = d;
    uint32_t i = h & (uint32_t)(g->table_cap - 1);
    while (g->table[i] >= 0)
        i = (i + 1) & (uint32_t)(g->table_cap - 1);
    g->table[i] = id;
    return id;
}

static int32_t step_slow(tdm_grammar_t *g, int32_t s, int c)
{
    struct dstate *d = g->st[s];
    if (!d->next) {
        d->next = malloc(256 * sizeof *d->next);
        if (!d->next) return TDM_GRAMMAR_DEAD;
        for (int i = 0; i < 256; i++)
            d->next[i] = NEXT_UNKNOWN;
    }
    if (d->next[c] != NEXT_UNKNOWN) return d->next[c];
    g->gen++;
    int32_t n = 0;
    for (int32_t i = 0; i < d->n; i++) {
        const struct nfa_state *ns = &g->nfa.s[d->set[i]];
        if (ns->kind == NFA_SET && byteset_has(&g->nfa.sets[ns->set], c)) closure(g, ns->out, &n);
    }
    int32_t r = intern(g, n);
    g->st[s]->next[c] = r;
    return r;
}

static inline int32_t step(tdm_grammar_t *g, int32_t s, int c)
{
    const int32_t *nx = g->st[s]->next;
    if (nx && nx[c] != NEXT_UNKNOWN) return nx[c];
    return step_slow(g, s, c);
}

/* ---- compiling ---- */
static tdm_status grammar_new(tdm_gvocab_t *v, enum tdm_grammar_kind kind, const char *src,
                              size_t len, tdm_grammar_t **out)
{
    struct ast t;
    tdm_ast_init(&t);
    int32_t root = 0;
    switch (kind) {
    case TDM_GRAMMAR_REGEX:
        root = tdm_regex_to_ast(&t, src, len, false);
        break;
    case TDM_GRAMMAR_JSON_SCHEMA:
        root = tdm_schema_to_ast(&t, src, len);
        break;
    case TDM_GRAMMAR_JSON_OBJECT:
        root = tdm_json_object_ast(&t);
        break;
    case TDM_GRAMMAR_CHOICE:
        root = tdm_choice_to_ast(&t, src, len);
        break;
    case TDM_GRAMMAR_GBNF:
        root = tdm_gbnf_to_ast(&t, src, len);
        break;
    case TDM_GRAMMAR_TOOL_CALLS:
        root = tdm_tool_calls_to_ast(&t, src, len);
        break;
    default:
        tdm_ast_fail(&t, TDM_EINVAL, "grammar: unknown kind %d", (int)kind);
    }
    tdm_grammar_t *g = calloc(1, sizeof *g);
    if (!g) {
        tdm_ast_free(&t);
        return tdm_err_set(TDM_ENOMEM, "grammar: out of memory");
    }
    tdm_status st = tdm_nfa_build(&t, root, &g->nfa);
    tdm_ast_free(&t);
    if (st != TDM_OK) {
        free(g);
        return st;
    }
    atomic_init(&g->refs, 1);
    g->v = v;
    atomic_fetch_add(&v->refs, 1);
    pthread_mutex_init(&g->mu, NULL);
    g->mark = calloc((size_t)g->nfa.n, sizeof *g->mark);
    g->stack = malloc((size_t)g->nfa.n * sizeof *g->stack);
    g->buf = malloc((size_t)g->nfa.n * sizeof *g->buf);
    g->walk_nodes = malloc((size_t)(v->max_len + 2) * sizeof *g->walk_nodes);
    g->walk_states = malloc((size_t)(v->max_len + 2) * sizeof *g->walk_states);
    int32_t n = 0;
    if (g->mark && g->stack && g->buf && g->walk_nodes && g->walk_states) {
        g->gen = 1;
        closure(g, g->nfa.start, &n);
        if (intern(g, n) == 0) {
            *out = g;
            return TDM_OK;
        }
    }
    tdm_grammar_unref(g);
    return tdm_err_set(TDM_ENOMEM, "grammar: out of memory");
}

static uint64_t hash_src(enum tdm_grammar_kind kind, const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)kind;
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static struct cache_entry *cache_find(tdm_gvocab_t *v, uint64_t h, enum tdm_grammar_kind kind,
                                      const char *src, size_t len)
{
    for (int i = 0; i < v->n_cache; i++) {
        struct cache_entry *e = &v->cache[i];
        if (e->hash == h && e->kind == kind && e->len == len && !memcmp(e->src, src, len)) return e;
    }
    return NULL;
}

tdm_status tdm_grammar_get(tdm_gvocab_t *v, enum tdm_grammar_kind kind, const char *src, size_t len,
                           tdm_grammar_t **out)
{
    if (!v || (!src && len)) return tdm_err_set(TDM_EINVAL, "grammar: no source");
    if (len > TDM_GRAMMAR_MAX_SOURCE)
        return tdm_err_set(TDM_ERANGE, "grammar: the source is %zu bytes; at most %d", len,
                           TDM_GRAMMAR_MAX_SOURCE);
    if (kind == TDM_GRAMMAR_JSON_OBJECT) len = 0;
    if (!src) src = "";
    uint64_t h = hash_src(kind, src, len);
    pthread_mutex_lock(&v->mu);
    struct cache_entry *e = cache_find(v, h, kind, src, len);
    if (e) {
        e->used = ++v->clock;
        v->hits++;
        *out = tdm_grammar_ref(e->g);
        pthread_mutex_unlock(&v->mu);
        return TDM_OK;
    }
    v->misses++;
    pthread_mutex_unlock(&v->mu);

    tdm_grammar_t *g;
    tdm_status st = grammar_new(v, kind, src, len, &g);
    if (st != TDM_OK) return st;
    char *copy = malloc(len ? len : 1);
    if (copy) memcpy(copy, src, len);
    pthread_mutex_lock(&v->mu);
    e = cache_find(v, h, kind, src, len); /* another thread compiled it meanwhile */
    if (e || !copy) {
        if (e) {
            tdm_grammar_unref(g);
            g = tdm_grammar_ref(e->g);
        }
        free(copy);
        pthread_mutex_unlock(&v->mu);
        *out = g;
        return TDM_OK;
    }
    if (v->n_cache == TDM_GRAMMAR_CACHE_ENTRIES) { /* the least recently used leaves */
        int lru = 0;
        for (int i = 1; i < v->n_cache; i++)
            if (v->cache[i].used < v->cache[lru].used) lru = i;
        tdm_grammar_unref(v->cache[lru].g);
        free(v->cache[lru].src);
        v->cache[lru] = v->cache[--v->n_cache];
    }
    v->cache[v->n_cache++] = (struct cache_entry){.hash = h,
                                                  .kind = kind,
                                                  .src = copy,
                                                  .len = len,
                                                  .g = tdm_grammar_ref(g),
                                                  .used = ++v->clock};
    pthread_mutex_unlock(&v->mu);
    *out = g;
    return TDM_OK;
}

void tdm_gvocab_cache_stats(tdm_gvocab_t *v, int *entries, uint64_t *hits, uint64_t *misses)
{
    pthread_mutex_lock(&v->mu);
    if (entries) *entries = v->n_cache;
    if (hits) *hits = v->hits;
    if (misses) *misses = v->misses;
    pthread_mutex_unlock(&v->mu);
}

int tdm_grammar_vocab_size(const tdm_grammar_t *g)
{
    return g->v->vocab;
}

tdm_grammar_t *tdm_grammar_ref(tdm_grammar_t *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void tdm_grammar_unref(tdm_grammar_t *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (int32_t i = 0; i < g->n_st; i++) {
        free(g->st[i]->set);
        free(g->st[i]->next);
        free(g->st[i]->mask);
        free(g->st[i]);
    }
    free(g->st);
    free(g->table);
    free(g->mark);
    free(g->stack);
    free(g->buf);
    free(g->walk_nodes);
    free(g->walk_states);
    tdm_nfa_free(&g->nfa);
    pthread_mutex_destroy(&g->mu);
    tdm_gvocab_t *v = g->v;
    free(g);
    if (v) gvocab_unref(v);
}

/* ---- matching ---- */
int32_t tdm_grammar_start(tdm_grammar_t *g)
{
    (void)g;
    return 0;
}

static bool is_eos(const tdm_gvocab_t *v, int32_t token)
{
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == token) return true;
    return false;
}

static int32_t feed_locked(tdm_grammar_t *g, int32_t s, const char *p, size_t len)
{
    for (size_t i = 0; i < len && s >= 0; i++)
        s = step(g, s, (uint8_t)p[i]);
    return s;
}

int32_t tdm_grammar_next(tdm_grammar_t *g, int32_t state, int32_t token)
{
    const tdm_gvocab_t *v = g->v;
    if (state < 0 || token < 0 || token >= v->vocab) return TDM_GRAMMAR_DEAD;
    pthread_mutex_lock(&g->mu);
    int32_t r = TDM_GRAMMAR_DEAD;
    if (state < g->n_st) {
        if (is_eos(v, token)) {
            r = g->st[state]->accept ? state : TDM_GRAMMAR_DEAD;
        } else if (v->in_trie[token]) {
            size_t len;
            const char *p = tdm_tok_piece(v->tok, token, &len);
            r = feed_locked(g, state, p, len);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return r;
}

int32_t tdm_grammar_feed(tdm_grammar_t *g, int32_t state, const char *s, size_t len)
{
    if (state < 0) return TDM_GRAMMAR_DEAD;
    pthread_mutex_lock(&g->mu);
    int32_t r = state < g->n_st ? feed_locked(g, state, s, len) : TDM_GRAMMAR_DEAD;
    pthread_mutex_unlock(&g->mu);
    return r;
}

static void walk(tdm_grammar_t *g, int32_t s, uint32_t *mask)
{
    const tdm_gvocab_t *v = g->v;
    const struct tnode *tr = v->trie;
    int32_t *nodes = g->walk_nodes, *states = g->walk_states;
    int sp = 0;
    nodes[0] = tr[0].child;
    states[0] = s;
    while (sp >= 0) {
        int32_t n = nodes[sp];
        if (n < 0) {
            sp--;
            continue;
        }
        nodes[sp] = tr[n].sibling;
        int32_t t = step(g, states[sp], tr[n].byte);
        if (t < 0) continue;
        for (int32_t tok = tr[n].token; tok >= 0; tok = v->dup_next[tok])
            mask[tok >> 5] |= 1u << (tok & 31);
        if (tr[n].child >= 0) {
            sp++;
            nodes[sp] = tr[n].child;
            states[sp] = t;
        }
    }
}

const uint32_t *tdm_grammar_mask(tdm_grammar_t *g, int32_t state)
{
    if (state < 0) return NULL;
    pthread_mutex_lock(&g->mu);
    uint32_t *m = NULL;
    if (state < g->n_st) {
        m = g->st[state]->mask;
        if (!m && (m = calloc((size_t)g->v->words, sizeof *m))) {
            walk(g, state, m);
            if (g->st[state]->accept)
                for (int i = 0; i < g->v->n_eos; i++)
                    m[g->v->eos[i] >> 5] |= 1u << (g->v->eos[i] & 31);
            g->st[state]->mask = m;
            g->n_masks++;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return m;
}

bool tdm_grammar_accepting(tdm_grammar_t *g, int32_t state)
{
    if (state < 0) return false;
    pthread_mutex_lock(&g->mu);
    bool r = state < g->n_st && g->st[state]->accept;
    pthread_mutex_unlock(&g->mu);
    return r;
}

bool tdm_grammar_complete(tdm_grammar_t *g, int32_t state)
{
    if (state < 0) return false;
    pthread_mutex_lock(&g->mu);
    bool r = state < g->n_st && g->st[state]->accept && !g->st[state]->has_out;
    pthread_mutex_unlock(&g->mu);
    return r;
}

void tdm_grammar_stats(tdm_grammar_t *g, int *nfa_states, int *dfa_states, int *masks)
{
    pthread_mutex_lock(&g->mu);
    if (nfa_states) *nfa_states = g->nfa.n;
    if (dfa_states) *dfa_states = g->n_st;
    if (masks) *masks = g->n_masks;
    pthread_mutex_unlock(&g->mu);
}
