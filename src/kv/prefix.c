/*
 * The prefix cache (include/tandem/kv.h): full KV pages by content, shared by reference count.
 *
 * A full page is named by a hash chain: key(page i) = H(key(page i - 1), its page_size tokens),
 * key(-1) = the cache's salt (the model and the KV element type), so a page's key says what the
 * whole prefix through it holds. An entry keeps its key, its parent's key and its tokens, and a
 * lookup compares all three: a hit is the same prefix token for token, whatever the hash. The
 * table is open addressing on the key (linear probing, backward-shift deletion), sized to twice
 * the pool's pages.
 *
 * The cache holds one owner reference on each page it names, and flags the page in the pool
 * (tdm_kv_pool_set_cached), which counts the evictable ones (the cache's reference alone) in
 * O(1). Recency: every lookup and insert touches its chain from the deepest page to the
 * root, so a parent is never less recent than its children, and eviction from the least
 * recent end frees leaves before the prefixes they continue. An entry whose page others still
 * hold is passed over.
 *
 * Ownership and threading: one thread uses a cache (the scheduler's); it calls the pool, which
 * locks. The pool's reclaim hook (tdm_kv_pool_set_reclaim) runs on the allocating thread, so
 * it must be that same thread.
 */
#include <stdlib.h>
#include <string.h>

#include "tandem/kv.h"

struct entry {
    uint64_t key, parent; /* key 0: an empty slot (keys are never 0) */
    int32_t page;
    int32_t prev, next; /* recency list: entry indices, -1 at the ends */
};

struct tdm_prefix_cache {
    tdm_kv_pool_t *pool;
    int ps;
    uint64_t salt;
    struct entry *e; /* [cap] */
    int32_t *toks;   /* [cap][ps] each entry's tokens */
    int64_t cap, n;
    int32_t lru, mru; /* least and most recent entries, -1 when empty */
    struct tdm_prefix_stats st;
    struct tdm_prefix_listener ls; /* zeroed: none */
};

void tdm_prefix_cache_set_listener(tdm_prefix_cache_t *c, const struct tdm_prefix_listener *l)
{
    c->ls = l ? *l : (struct tdm_prefix_listener){0};
}

static uint64_t page_key(uint64_t parent, const int32_t *tokens, int ps)
{
    uint64_t h = tdm_hash_mix(parent, (uint64_t)ps);
    for (int i = 0; i < ps; i++)
        h = tdm_hash_mix(h, (uint64_t)(uint32_t)tokens[i]);
    return h ? h : 1;
}

tdm_status tdm_prefix_cache_create(tdm_kv_pool_t *pool, uint64_t salt, tdm_prefix_cache_t **out)
{
    const struct tdm_kv_config *cfg = tdm_kv_pool_config(pool);
    struct tdm_prefix_cache *c = calloc(1, sizeof *c);
    if (!c) return tdm_err_set(TDM_ENOMEM, "prefix cache: out of memory");
    c->pool = pool;
    c->ps = cfg->page_size;
    c->salt = tdm_hash_mix(salt, 0x7072656669780a01ull);
    c->cap = 16;
    while (c->cap < 2 * cfg->n_pages)
        c->cap *= 2;
    c->e = calloc((size_t)c->cap, sizeof *c->e);
    c->toks = malloc((size_t)c->cap * (size_t)c->ps * sizeof *c->toks);
    if (!c->e || !c->toks) {
        long long cap = (long long)c->cap;
        free(c->e);
        free(c->toks);
        free(c);
        return tdm_err_set(TDM_ENOMEM, "prefix cache: out of memory for %lld entries", cap);
    }
    c->lru = c->mru = -1;
    *out = c;
    return TDM_OK;
}

void tdm_prefix_cache_destroy(tdm_prefix_cache_t *c)
{
    if (!c) return;
    tdm_prefix_cache_flush(c);
    free(c->e);
    free(c->toks);
    free(c);
}

/* The slot of key (parent, tokens), or -1 when absent. */
static int64_t find(const struct tdm_prefix_cache *c, uint64_t key, uint64_t parent,
                    const int32_t *tokens)
{
    for (int64_t i = (int64_t)(key & (uint64_t)(c->cap - 1));; i = (i + 1) & (c->cap - 1)) {
        const struct entry *e = &c->e[i];
        if (!e->key) return -1;
        if (e->key == key && e->parent == parent &&
            !memcmp(c->toks + (size_t)i * c->ps, tokens, (size_t)c->ps * sizeof *tokens))
            return i;
    }
}

static void lru_unlink(struct tdm_prefix_cache *c, int32_t i)
{
    struct entry *e = &c->e[i];
    if (e->prev >= 0)
        c->e[e->prev].next = e->next;
    else
        c->lru = e->next;
    if (e->next >= 0)
        c->e[e->next].prev = e->prev;
    else
        c->mru = e->prev;
}

static void lru_push(struct tdm_prefix_cache *c, int32_t i)
{
    struct entry *e = &c->e[i];
    e->prev = c->mru;
    e->next = -1;
    if (c->mru >= 0)
        c->e[c->mru].next = i;
    else
        c->lru = i;
    c->mru = i;
}

static void touch(struct tdm_prefix_cache *c, int32_t i)
{
    lru_unlink(c, i);
    lru_push(c, i);
}

/* Removes slot i (its page reference is the caller's to drop): backward-shift deletion keeps
 * every probe chain unbroken, fixing the recency links of the entries it moves. */
static void remove_at(struct tdm_prefix_cache *c, int64_t i)
{
    lru_unlink(c, (int32_t)i);
    c->n--;
    const int64_t mask = c->cap - 1;
    for (int64_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        struct entry *e = &c->e[j];
        if (!e->key) break;
        int64_t home = (int64_t)(e->key & (uint64_t)mask);
        /* j may move to i when i lies cyclically in [home, j) */
        bool movable = i <= j ? (home <= i || home > j) : (home <= i && home > j);
        if (!movable) continue;
        c->e[i] = *e;
        memcpy(c->toks + (size_t)i * c->ps, c->toks + (size_t)j * c->ps,
               (size_t)c->ps * sizeof *c->toks);
        if (e->prev >= 0)
            c->e[e->prev].next = (int32_t)i;
        else
            c->lru = (int32_t)i;
        if (e->next >= 0)
            c->e[e->next].prev = (int32_t)i;
        else
            c->mru = (int32_t)i;
        i = j;
    }
    c->e[i].key = 0;
}

int tdm_prefix_cache_match(tdm_prefix_cache_t *c, const int32_t *tokens, int n_tokens,
                           int max_pages, struct tdm_kv_seq *seq)
{
    TDM_ASSERT(seq->n_pages == 0);
    int most = TDM_MIN(n_tokens / c->ps, max_pages);
    c->st.queried_tokens += (uint64_t)TDM_MAX(most, 0) * (uint64_t)c->ps;
    if (most <= 0) return 0;
    int32_t hit[64], n_hit = 0; /* slots, touched deepest first afterwards */
    int32_t *slots = most <= 64 ? hit : malloc((size_t)most * sizeof *slots);
    if (!slots) return 0;
    uint64_t parent = c->salt;
    for (int p = 0; p < most; p++) {
        const int32_t *t = tokens + (size_t)p * c->ps;
        int64_t i = find(c, page_key(parent, t, c->ps), parent, t);
        if (i < 0) break;
        slots[n_hit++] = (int32_t)i;
        parent = c->e[i].key;
    }
    int got = 0;
    if (n_hit) {
        int32_t *pages = malloc((size_t)n_hit * sizeof *pages);
        if (pages) {
            for (int k = 0; k < n_hit; k++)
                pages[k] = c->e[slots[k]].page;
            if (tdm_kv_seq_adopt(c->pool, seq, pages, n_hit) == TDM_OK) got = n_hit;
            free(pages);
        }
    }
    for (int k = got - 1; k >= 0; k--)
        touch(c, slots[k]);
    if (slots != hit) free(slots);
    c->st.hit_tokens += (uint64_t)got * (uint64_t)c->ps;
    return got;
}

void tdm_prefix_cache_insert(tdm_prefix_cache_t *c, const int32_t *tokens,
                             const struct tdm_kv_seq *seq, int n_pages)
{
    n_pages = TDM_MIN(n_pages, seq->n_pages);
    if (n_pages <= 0) return;
    int32_t *chain = malloc((size_t)n_pages * sizeof *chain);
    if (!chain) return; /* nothing cached: the pages stay the request's */
    uint64_t parent = c->salt;
    int n_chain = 0;
    for (int p = 0; p < n_pages; p++) {
        const int32_t *t = tokens + (size_t)p * c->ps;
        const uint64_t key = page_key(parent, t, c->ps);
        int64_t i = find(c, key, parent, t);
        if (i < 0) {
            if (c->n + 1 > c->cap / 2) break; /* full (never: the pool has cap / 2 pages) */
            for (i = (int64_t)(key & (uint64_t)(c->cap - 1)); c->e[i].key;
                 i = (i + 1) & (c->cap - 1))
                ;
            c->e[i] = (struct entry){.key = key, .parent = parent, .page = seq->pages[p]};
            memcpy(c->toks + (size_t)i * c->ps, t, (size_t)c->ps * sizeof *t);
            tdm_kv_pool_retain(c->pool, 1, &seq->pages[p]);
            tdm_kv_pool_set_cached(c->pool, seq->pages[p], true);
            lru_push(c, (int32_t)i);
            c->n++;
            c->st.stored_pages++;
            if (c->ls.stored)
                c->ls.stored(c->ls.ctx, key, parent == c->salt ? 0 : parent, t, c->ps);
        }
        chain[n_chain++] = (int32_t)i;
        parent = key;
    }
    for (int k = n_chain - 1; k >= 0; k--) /* deepest first: the root ends most recent */
        touch(c, chain[k]);
    free(chain);
}

/* The slot now holding the entry of (key, page) (a deletion may have moved it). */
static int64_t slot_of(const struct tdm_prefix_cache *c, uint64_t key, int32_t page)
{
    for (int64_t i = (int64_t)(key & (uint64_t)(c->cap - 1));; i = (i + 1) & (c->cap - 1)) {
        TDM_ASSERT(c->e[i].key);
        if (c->e[i].key == key && c->e[i].page == page) return i;
    }
}

/* Drops slot i's entry and the cache's reference on its page. */
static void drop(struct tdm_prefix_cache *c, int64_t i)
{
    const int32_t page = c->e[i].page;
    remove_at(c, i);
    tdm_kv_pool_set_cached(c->pool, page, false);
    tdm_kv_pool_free(c->pool, 1, &page);
}

int tdm_prefix_cache_evict(tdm_prefix_cache_t *c, int want)
{
    int freed = 0;
    for (int32_t i = c->lru; i >= 0 && freed < want;) {
        const int32_t next = c->e[i].next;
        if (!tdm_kv_pool_evictable(c->pool, c->e[i].page)) { /* a request's too, or held */
            i = next;
            continue;
        }
        /* the deletion may move the next entry to another slot: find it again by its key */
        const uint64_t nkey = next >= 0 ? c->e[next].key : 0;
        const int32_t npage = next >= 0 ? c->e[next].page : -1;
        if (c->ls.removed) c->ls.removed(c->ls.ctx, c->e[i].key);
        drop(c, i);
        c->st.evicted_pages++;
        freed++;
        i = next >= 0 ? (int32_t)slot_of(c, nkey, npage) : -1;
    }
    return freed;
}

int64_t tdm_prefix_cache_evictable(tdm_prefix_cache_t *c)
{
    return tdm_kv_pool_stats(c->pool).evictable;
}

int tdm_prefix_cache_flush(tdm_prefix_cache_t *c)
{
    int n = 0;
    while (c->lru >= 0) {
        drop(c, c->lru);
        n++;
    }
    if (n && c->ls.cleared) c->ls.cleared(c->ls.ctx);
    return n;
}

struct tdm_prefix_stats tdm_prefix_cache_stats(const tdm_prefix_cache_t *c)
{
    struct tdm_prefix_stats s = c->st;
    s.pages = c->n;
    return s;
}

int tdm_prefix_cache_reclaim(void *ctx, int want)
{
    return tdm_prefix_cache_evict(ctx, want);
}
