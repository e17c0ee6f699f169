/*
 * The KV page pool: page ids, owner references, in-flight holds and per-state accounting.
 * See include/tandem/kv.h for the state diagram. The free list is a stack of ids (LIFO keeps
 * recently used pages warm in cache); all bookkeeping is under one mutex.
 *
 * Transitions and the functions that make them:
 *   FREE -> USED              tdm_kv_pool_alloc
 *   USED -> USED (refs+1)     tdm_kv_pool_retain
 *   USED -> FREE              tdm_kv_pool_free (last owner reference, no holds)
 *   USED -> IN_FLIGHT         tdm_kv_pool_hold (first hold)
 *   IN_FLIGHT -> USED         tdm_kv_pool_unhold (last hold, owner references left)
 *   IN_FLIGHT -> FREE         tdm_kv_pool_unhold (last hold, no owner references)
 *
 * A page a prefix cache names carries a flag (tdm_kv_pool_set_cached): the pool counts those
 * pages, and of them the evictable ones (the cache's reference alone, no hold), updating the
 * count wherever a reference or a hold changes, so that both are read in O(1).
 */
#include "tandem/kv.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

struct tdm_kv_pool {
    struct tdm_kv_config cfg;
    tdm_backend_t *backend;
    /* [n_layers][n_pages][2][n_kv_heads][page_size][head_dim]: a typed buffer of the backend
     * (buf), and the view the layers index (mem) */
    struct tdm_buf buf;
    uint8_t *mem;
    size_t layer_bytes;                           /* bytes per layer region */
    struct tdm_buf gbuf[TDM_KV_MAX_EXTRA_GROUPS]; /* the extra groups' regions, laid out alike */
    uint8_t *gmem[TDM_KV_MAX_EXTRA_GROUPS];
    size_t g_layer_bytes[TDM_KV_MAX_EXTRA_GROUPS];
    pthread_mutex_t mu;
    int32_t *free_ids; /* [n_pages] stack */
    int64_t n_free;
    uint16_t *owner_refs; /* [n_pages] */
    uint16_t *holds;      /* [n_pages] */
    int64_t n_in_flight;
    int (*reclaim)(void *ctx, int want); /* tdm_kv_pool_set_reclaim; called unlocked */
    void *reclaim_ctx;
    uint8_t *cached;               /* [n_pages] named by a prefix cache */
    int64_t n_cached, n_evictable; /* of them, held by the cache alone (one reference, no hold) */
    tdm_kv_pool_t *shards[TDM_KV_MAX_SHARDS]; /* other ranks' pools (tdm_kv_pool_add_shard) */
    int n_shards;
};

/* Mutex held: page id is one a cache could evict now. */
static bool evictable(const struct tdm_kv_pool *p, int32_t id)
{
    return p->cached[id] && p->owner_refs[id] == 1 && p->holds[id] == 0;
}

size_t tdm_kv_page_bytes(const struct tdm_kv_config *cfg)
{
    return (size_t)(cfg->latent_v_dim > 0 ? 1 : 2) * cfg->n_kv_heads * cfg->page_size *
           cfg->head_dim * tdm_kv_elem_bytes(cfg->dtype);
}

size_t tdm_kv_group_page_bytes(const struct tdm_kv_config *cfg, const struct tdm_kv_group *g)
{
    return (size_t)(g->latent_v_dim > 0 ? 1 : 2) * g->n_kv_heads * cfg->page_size * g->head_dim *
           tdm_kv_elem_bytes(cfg->dtype);
}

size_t tdm_kv_page_bytes_all(const struct tdm_kv_config *cfg)
{
    size_t per_page = tdm_kv_page_bytes(cfg) * (size_t)cfg->n_layers;
    for (int g = 0; g < cfg->n_extra && g < TDM_KV_MAX_EXTRA_GROUPS; g++)
        per_page += tdm_kv_group_page_bytes(cfg, &cfg->extra[g]) * (size_t)cfg->extra[g].n_layers;
    return per_page;
}

int64_t tdm_kv_pages_for_bytes(const struct tdm_kv_config *cfg, size_t bytes)
{
    size_t per_page = tdm_kv_page_bytes_all(cfg);
    return per_page ? (int64_t)(bytes / per_page) : 0;
}

tdm_status tdm_kv_pool_create(const struct tdm_kv_config *cfg, tdm_backend_t *backend,
                              tdm_kv_pool_t **out)
{
    if (cfg->n_layers <= 0 || cfg->n_kv_heads <= 0 || cfg->head_dim <= 0 || cfg->page_size <= 0 ||
        cfg->n_pages <= 0)
        return tdm_err_set(TDM_EINVAL, "kv pool: every dimension must be positive");
    if (!tdm_kv_elem_bytes(cfg->dtype))
        return tdm_err_set(TDM_EUNSUPPORTED, "kv pool: element type %s (f32, bf16 or f16)",
                           tdm_dtype_name(cfg->dtype));
    if (cfg->page_size > TDM_KV_MAX_PAGE_SIZE)
        return tdm_err_set(TDM_ERANGE, "kv pool: page size %d over %d", cfg->page_size,
                           TDM_KV_MAX_PAGE_SIZE);
    if (cfg->n_pages > INT32_MAX / cfg->page_size)
        return tdm_err_set(TDM_ERANGE, "kv pool: %lld pages is too many", (long long)cfg->n_pages);
    size_t page_bytes = tdm_kv_page_bytes(cfg);
    size_t layer_bytes = page_bytes * (size_t)cfg->n_pages;
    size_t total_bytes = layer_bytes * (size_t)cfg->n_layers;
    if (layer_bytes / (size_t)cfg->n_pages != page_bytes ||
        total_bytes / (size_t)cfg->n_layers != layer_bytes)
        return tdm_err_set(TDM_ERANGE, "kv pool: size overflows");
    if (cfg->n_extra < 0 || cfg->n_extra > TDM_KV_MAX_EXTRA_GROUPS)
        return tdm_err_set(TDM_EINVAL, "kv pool: %d extra layer groups (at most %d)", cfg->n_extra,
                           TDM_KV_MAX_EXTRA_GROUPS);
    if (cfg->latent_v_dim < 0 || cfg->latent_v_dim > cfg->head_dim ||
        (cfg->latent_v_dim > 0 && cfg->n_kv_heads != 1))
        return tdm_err_set(TDM_EINVAL, "kv pool: a latent V of %d in rows of %d (%d kv heads)",
                           cfg->latent_v_dim, cfg->head_dim, cfg->n_kv_heads);
    for (int g = 0; g < cfg->n_extra; g++) {
        const struct tdm_kv_group *x = &cfg->extra[g];
        if (x->n_layers <= 0 || x->n_kv_heads <= 0 || x->head_dim <= 0 || x->n_layers > 4096 ||
            x->n_kv_heads > 4096 || x->head_dim > 4096 || x->latent_v_dim < 0 ||
            x->latent_v_dim > x->head_dim || (x->latent_v_dim > 0 && x->n_kv_heads != 1))
            return tdm_err_set(TDM_EINVAL, "kv pool: layer group %d has a bad geometry", g + 1);
    }

    struct tdm_kv_pool *p = calloc(1, sizeof *p);
    if (!p) return tdm_err_set(TDM_ENOMEM, "kv pool: out of memory");
    p->cfg = *cfg;
    p->backend = backend;
    p->layer_bytes = layer_bytes;
    p->free_ids = malloc((size_t)cfg->n_pages * sizeof *p->free_ids);
    p->owner_refs = calloc((size_t)cfg->n_pages, sizeof *p->owner_refs);
    p->holds = calloc((size_t)cfg->n_pages, sizeof *p->holds);
    p->cached = calloc((size_t)cfg->n_pages, sizeof *p->cached);
    if (!p->free_ids || !p->owner_refs || !p->holds || !p->cached) goto out_free;
    if (tdm_backend_buf_new(backend, total_bytes, "the KV pool", &p->buf) != TDM_OK)
        goto out_free_nomsg;
    p->mem = p->buf.ptr;
    for (int g = 0; g < cfg->n_extra; g++) {
        const struct tdm_kv_group *x = &cfg->extra[g];
        p->g_layer_bytes[g] = tdm_kv_group_page_bytes(cfg, x) * (size_t)cfg->n_pages;
        size_t bytes = p->g_layer_bytes[g] * (size_t)x->n_layers;
        if (tdm_backend_buf_new(backend, bytes, "a KV layer group", &p->gbuf[g]) != TDM_OK) {
            for (int h = 0; h < g; h++)
                tdm_backend_buf_release(backend, &p->gbuf[h]);
            tdm_backend_buf_release(backend, &p->buf);
            goto out_free_nomsg;
        }
        p->gmem[g] = p->gbuf[g].ptr;
    }
    for (int64_t i = 0; i < cfg->n_pages; i++)
        p->free_ids[i] = (int32_t)(cfg->n_pages - 1 - i); /* page 0 is handed out first */
    p->n_free = cfg->n_pages;
    pthread_mutex_init(&p->mu, NULL);
    *out = p;
    return TDM_OK;
out_free:
    tdm_err_set(TDM_ENOMEM, "kv pool: out of memory");
out_free_nomsg:
    free(p->free_ids);
    free(p->owner_refs);
    free(p->holds);
    free(p->cached);
    free(p);
    return TDM_ENOMEM;
}

void tdm_kv_pool_destroy(tdm_kv_pool_t *pool)
{
    if (!pool) return;
    tdm_backend_buf_release(pool->backend, &pool->buf);
    for (int g = 0; g < pool->cfg.n_extra; g++)
        tdm_backend_buf_release(pool->backend, &pool->gbuf[g]);
    pthread_mutex_destroy(&pool->mu);
    free(pool->free_ids);
    free(pool->owner_refs);
    free(pool->holds);
    free(pool->cached);
    free(pool);
}

const struct tdm_kv_config *tdm_kv_pool_config(const tdm_kv_pool_t *pool)
{
    return &pool->cfg;
}

struct tdm_kv_geometry tdm_kv_pool_geometry(const tdm_kv_pool_t *pool)
{
    const struct tdm_kv_config *c = &pool->cfg;
    size_t eb = tdm_kv_elem_bytes(c->dtype), head = (size_t)c->page_size * c->head_dim * eb;
    size_t page = tdm_kv_page_bytes(c), layer = page * (size_t)c->n_pages;
    return (struct tdm_kv_geometry){.dtype = c->dtype,
                                    .elem_bytes = eb,
                                    .place = pool->buf.place,
                                    .base = pool->mem,
                                    .bytes = layer * (size_t)c->n_layers,
                                    .layer_bytes = layer,
                                    .page_bytes = page,
                                    /* a latent page has no V half: "V" is K's rows */
                                    .v_offset = c->latent_v_dim ? 0 : head * (size_t)c->n_kv_heads,
                                    .head_bytes = head};
}

struct tdm_kv_layer tdm_kv_pool_layer(const tdm_kv_pool_t *pool, int layer)
{
    TDM_ASSERT(layer >= 0 && layer < pool->cfg.n_layers);
    return (struct tdm_kv_layer){
        .base = pool->mem + (size_t)layer * pool->layer_bytes,
        .dtype = pool->cfg.dtype,
        .n_kv_heads = pool->cfg.n_kv_heads,
        .head_dim = pool->cfg.head_dim,
        .page_size = pool->cfg.page_size,
        .n_pages = pool->cfg.n_pages,
        .v_dim = pool->cfg.latent_v_dim,
    };
}

struct tdm_kv_layer tdm_kv_pool_group_layer(const tdm_kv_pool_t *pool, int group, int layer)
{
    if (group == 0) return tdm_kv_pool_layer(pool, layer);
    TDM_ASSERT(group > 0 && group <= pool->cfg.n_extra);
    const struct tdm_kv_group *x = &pool->cfg.extra[group - 1];
    TDM_ASSERT(layer >= 0 && layer < x->n_layers);
    return (struct tdm_kv_layer){
        .base = pool->gmem[group - 1] + (size_t)layer * pool->g_layer_bytes[group - 1],
        .dtype = pool->cfg.dtype,
        .n_kv_heads = x->n_kv_heads,
        .head_dim = x->head_dim,
        .page_size = pool->cfg.page_size,
        .n_pages = pool->cfg.n_pages,
        .v_dim = x->latent_v_dim,
    };
}

bool tdm_kv_pool_group(const tdm_kv_pool_t *pool, int group, struct tdm_kv_group *out)
{
    if (group == 0) {
        *out = (struct tdm_kv_group){.n_layers = pool->cfg.n_layers,
                                     .n_kv_heads = pool->cfg.n_kv_heads,
                                     .head_dim = pool->cfg.head_dim,
                                     .latent_v_dim = pool->cfg.latent_v_dim};
        return true;
    }
    if (group < 0 || group > pool->cfg.n_extra) return false;
    *out = pool->cfg.extra[group - 1];
    return true;
}

void tdm_kv_pool_copy_slots(tdm_kv_pool_t *pool, const int32_t *src, const int32_t *dst, int n)
{
    if (n <= 0) return;
    const int64_t n_slots = pool->cfg.n_pages * pool->cfg.page_size;
    for (int i = 0; i < n; i++)
        TDM_ASSERT(src[i] >= 0 && src[i] < n_slots && dst[i] >= 0 && dst[i] < n_slots);
    const struct tdm_backend_i *ops = pool->backend->iface;
    TDM_ASSERT(ops->kv_copy);
    for (int g = 0; g <= pool->cfg.n_extra; g++) {
        struct tdm_kv_layer l0 = tdm_kv_pool_group_layer(pool, g, 0);
        int n_layers = g ? pool->cfg.extra[g - 1].n_layers : pool->cfg.n_layers;
        size_t layer_bytes = g ? pool->g_layer_bytes[g - 1] : pool->layer_bytes;
        ops->kv_copy(pool->backend, &l0, n_layers, layer_bytes, src, dst, n);
    }
    for (int i = 0; i < pool->n_shards; i++)
        tdm_kv_pool_copy_slots(pool->shards[i], src, dst, n);
}

tdm_status tdm_kv_pool_add_shard(tdm_kv_pool_t *pool, tdm_kv_pool_t *shard)
{
    if (shard == pool || shard->cfg.n_pages != pool->cfg.n_pages ||
        shard->cfg.page_size != pool->cfg.page_size)
        return tdm_err_set(TDM_EINVAL, "kv: a shard pool needs the pool's page count and size");
    if (pool->n_shards == TDM_KV_MAX_SHARDS)
        return tdm_err_set(TDM_ERANGE, "kv: more than %d shard pools", TDM_KV_MAX_SHARDS);
    pool->shards[pool->n_shards++] = shard;
    return TDM_OK;
}

static void check_id(const tdm_kv_pool_t *pool, int32_t id)
{
    TDM_ASSERT(id >= 0 && id < pool->cfg.n_pages);
}

tdm_status tdm_kv_pool_alloc(tdm_kv_pool_t *pool, int n, int32_t *ids)
{
    TDM_ASSERT(n >= 0);
    pthread_mutex_lock(&pool->mu);
    if (n > pool->n_free && pool->reclaim) { /* a cache gives pages back, then try again */
        int short_by = (int)(n - pool->n_free);
        pthread_mutex_unlock(&pool->mu);
        pool->reclaim(pool->reclaim_ctx, short_by);
        pthread_mutex_lock(&pool->mu);
    }
    if (n > pool->n_free) {
        int64_t n_free = pool->n_free;
        pthread_mutex_unlock(&pool->mu);
        return tdm_err_set(TDM_ENOMEM, "kv pool: %d pages wanted, %lld free", n, (long long)n_free);
    }
    for (int i = 0; i < n; i++) {
        int32_t id = pool->free_ids[--pool->n_free];
        TDM_ASSERT(pool->owner_refs[id] == 0 && pool->holds[id] == 0);
        pool->owner_refs[id] = 1;
        ids[i] = id;
    }
    pthread_mutex_unlock(&pool->mu);
    return TDM_OK;
}

/* Called with the mutex held. */
static void maybe_release(tdm_kv_pool_t *pool, int32_t id)
{
    if (pool->owner_refs[id] == 0 && pool->holds[id] == 0) {
        TDM_ASSERT(!pool->cached[id]); /* a cache drops its flag before its reference */
        pool->free_ids[pool->n_free++] = id;
    }
}

void tdm_kv_pool_free(tdm_kv_pool_t *pool, int n, const int32_t *ids)
{
    pthread_mutex_lock(&pool->mu);
    for (int i = 0; i < n; i++) {
        const int32_t id = ids[i];
        check_id(pool, id);
        TDM_ASSERT(pool->owner_refs[id] > 0);
        const bool was = evictable(pool, id);
        pool->owner_refs[id]--;
        pool->n_evictable += (int64_t)evictable(pool, id) - was;
        maybe_release(pool, id);
    }
    pthread_mutex_unlock(&pool->mu);
}

void tdm_kv_pool_retain(tdm_kv_pool_t *pool, int n, const int32_t *ids)
{
    pthread_mutex_lock(&pool->mu);
    for (int i = 0; i < n; i++) {
        const int32_t id = ids[i];
        check_id(pool, id);
        TDM_ASSERT(pool->owner_refs[id] > 0 && pool->owner_refs[id] < UINT16_MAX);
        const bool was = evictable(pool, id);
        pool->owner_refs[id]++;
        pool->n_evictable += (int64_t)evictable(pool, id) - was;
    }
    pthread_mutex_unlock(&pool->mu);
}

void tdm_kv_pool_hold(tdm_kv_pool_t *pool, int n, const int32_t *ids)
{
    pthread_mutex_lock(&pool->mu);
    for (int i = 0; i < n; i++) {
        const int32_t id = ids[i];
        check_id(pool, id);
        TDM_ASSERT(pool->owner_refs[id] > 0 && pool->holds[id] < UINT16_MAX);
        const bool was = evictable(pool, id);
        if (pool->holds[id]++ == 0) pool->n_in_flight++;
        pool->n_evictable += (int64_t)evictable(pool, id) - was;
    }
    pthread_mutex_unlock(&pool->mu);
}

void tdm_kv_pool_unhold(tdm_kv_pool_t *pool, int n, const int32_t *ids)
{
    pthread_mutex_lock(&pool->mu);
    for (int i = 0; i < n; i++) {
        const int32_t id = ids[i];
        check_id(pool, id);
        TDM_ASSERT(pool->holds[id] > 0);
        const bool was = evictable(pool, id);
        if (--pool->holds[id] == 0) pool->n_in_flight--;
        pool->n_evictable += (int64_t)evictable(pool, id) - was;
        if (!pool->holds[id]) maybe_release(pool, id);
    }
    pthread_mutex_unlock(&pool->mu);
}

bool tdm_kv_pool_evictable(tdm_kv_pool_t *pool, int32_t id)
{
    pthread_mutex_lock(&pool->mu);
    check_id(pool, id);
    bool ok = evictable(pool, id);
    pthread_mutex_unlock(&pool->mu);
    return ok;
}

void tdm_kv_pool_set_cached(tdm_kv_pool_t *pool, int32_t id, bool cached)
{
    pthread_mutex_lock(&pool->mu);
    check_id(pool, id);
    TDM_ASSERT(pool->owner_refs[id] > 0 && pool->cached[id] != cached);
    const bool was = evictable(pool, id);
    pool->cached[id] = cached;
    pool->n_cached += cached ? 1 : -1;
    pool->n_evictable += (int64_t)evictable(pool, id) - was;
    pthread_mutex_unlock(&pool->mu);
}

struct tdm_kv_stats tdm_kv_pool_stats(tdm_kv_pool_t *pool)
{
    pthread_mutex_lock(&pool->mu);
    struct tdm_kv_stats s = {
        .total = pool->cfg.n_pages,
        .free = pool->n_free,
        .in_flight = pool->n_in_flight,
        .used = pool->cfg.n_pages - pool->n_free - pool->n_in_flight,
        .cached = pool->n_cached,
        .evictable = pool->n_evictable,
    };
    pthread_mutex_unlock(&pool->mu);
    return s;
}

/* Makes seq's table hold at least `want` page ids (doubling from 8). */
static tdm_status seq_cap(struct tdm_kv_seq *seq, int64_t want)
{
    if (want <= seq->cap_pages) return TDM_OK;
    int cap = seq->cap_pages ? seq->cap_pages : 8;
    while (cap < want)
        cap *= 2;
    int32_t *np = realloc(seq->pages, (size_t)cap * sizeof *np);
    if (!np) return tdm_err_set(TDM_ENOMEM, "kv: page table out of memory");
    seq->pages = np;
    seq->cap_pages = cap;
    return TDM_OK;
}

tdm_status tdm_kv_seq_reserve(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq, int64_t n_tokens)
{
    int64_t ps = pool->cfg.page_size;
    int64_t want = (n_tokens + ps - 1) / ps;
    if (want > pool->cfg.n_pages)
        return tdm_err_set(TDM_ENOMEM, "kv: %lld tokens need %lld pages, the pool has %lld",
                           (long long)n_tokens, (long long)want, (long long)pool->cfg.n_pages);
    if (want <= seq->n_pages) return TDM_OK;
    tdm_status st = seq_cap(seq, want);
    if (st != TDM_OK) return st;
    int add = (int)(want - seq->n_pages);
    st = tdm_kv_pool_alloc(pool, add, seq->pages + seq->n_pages);
    if (st != TDM_OK) return st;
    seq->n_pages += add;
    return TDM_OK;
}

int tdm_kv_pool_owners(tdm_kv_pool_t *pool, int32_t id)
{
    pthread_mutex_lock(&pool->mu);
    check_id(pool, id);
    int n = pool->owner_refs[id];
    pthread_mutex_unlock(&pool->mu);
    return n;
}

void tdm_kv_pool_set_reclaim(tdm_kv_pool_t *pool, int (*reclaim)(void *ctx, int want), void *ctx)
{
    pthread_mutex_lock(&pool->mu);
    pool->reclaim = reclaim;
    pool->reclaim_ctx = ctx;
    pthread_mutex_unlock(&pool->mu);
}

tdm_status tdm_kv_seq_adopt(tdm_kv_pool_t *pool, struct tdm_kv_seq *dst, const int32_t *pages,
                            int n)
{
    TDM_ASSERT(dst->n_pages == 0 && n >= 0);
    tdm_status st = seq_cap(dst, n);
    if (st != TDM_OK) return st;
    if (n) memcpy(dst->pages, pages, (size_t)n * sizeof *pages);
    tdm_kv_pool_retain(pool, n, pages);
    dst->n_pages = n;
    return TDM_OK;
}

tdm_status tdm_kv_seq_share(tdm_kv_pool_t *pool, struct tdm_kv_seq *dst,
                            const struct tdm_kv_seq *src, int64_t n_tokens)
{
    const int64_t ps = pool->cfg.page_size;
    const int full = (int)(n_tokens / ps), part = (int)(n_tokens % ps);
    const int want = full + (part > 0);
    TDM_ASSERT(dst->n_pages == 0 && n_tokens >= 0 && want <= src->n_pages);
    tdm_status st = seq_cap(dst, want);
    if (st != TDM_OK) return st;
    if (part) { /* the new page first: all or nothing */
        if ((st = tdm_kv_pool_alloc(pool, 1, dst->pages + full)) != TDM_OK) return st;
        int32_t from[TDM_KV_MAX_PAGE_SIZE], to[TDM_KV_MAX_PAGE_SIZE];
        for (int i = 0; i < part; i++) {
            from[i] = (int32_t)(src->pages[full] * ps + i);
            to[i] = (int32_t)(dst->pages[full] * ps + i);
        }
        tdm_kv_pool_copy_slots(pool, from, to, part);
    }
    tdm_kv_seq_adopt(pool, dst, src->pages, full); /* room is there: it cannot fail */
    dst->n_pages = want;
    return TDM_OK;
}

void tdm_kv_seq_release(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq)
{
    if (!seq) return;
    if (seq->n_pages) tdm_kv_pool_free(pool, seq->n_pages, seq->pages);
    free(seq->pages);
    memset(seq, 0, sizeof *seq);
}

void tdm_kv_seq_trim(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq, int64_t n_tokens)
{
    if (n_tokens < 0) n_tokens = 0;
    int64_t ps = pool->cfg.page_size;
    int64_t keep = (n_tokens + ps - 1) / ps;
    if (keep >= seq->n_pages) return;
    tdm_kv_pool_free(pool, seq->n_pages - (int)keep, seq->pages + keep);
    seq->n_pages = (int)keep;
}
