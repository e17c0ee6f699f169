/*
 * tandem kv: the paged KV cache pool (DESIGN.md §3).
 *
 * Memory: one backend buffer per pool holding every layer's region,
 *   [n_layers][n_pages][2][n_kv_heads][page_size][head_dim] of the pool's element type (f32,
 *   bf16 or f16: --kv-dtype), HND, K then V, where the backend keeps its buffers
 *   (tdm_kv_pool_geometry says where, and gives the strides). The backends compute in fp32:
 *   rope_kv_append rounds K and V to the element type as it stores them (round to nearest
 *   even), and attention widens them back as it reads them, exactly.
 * A page id names the same page in every layer, so a sequence has one page table for all layers
 * (and every layer group: a draft model's layers have a region of their own geometry, and the
 * same page ids, so speculation shares the allocator and the page tables).
 * For a kv_head range, K and V of one page are each one contiguous run (a head slice is at most
 * two transfers; a whole page of one layer is one).
 *
 * Page states and accounting:
 *
 *          alloc            retain_in_flight          release_in_flight (last hold)
 *   FREE ---------> USED ------------------> IN_FLIGHT ---------------------------> USED
 *    ^               |                          |
 *    |  free (refs 0)|          free            | (owner freed while a transfer holds it:
 *    +---------------+  <-----------------------+  freed when the last hold is released)
 *
 * A page carries an owner reference count (requests sharing it) and an in-flight hold count
 * (transfers reading or writing it). It is FREE when both are zero, IN_FLIGHT when any transfer
 * holds it, USED otherwise. tdm_kv_stats counts pages per state; tests check that the pool
 * returns to its baseline after every request, whether it ended, was cancelled or failed.
 *
 * Threading: all pool functions take the pool's mutex; the scheduler and messenger threads may
 * call them concurrently. Layer base pointers are fixed for the pool's lifetime.
 */
#ifndef TANDEM_KV_H
#define TANDEM_KV_H

#include "tandem/backend.h"
#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_kv_pool tdm_kv_pool_t;

/* A layer group: layers of their own geometry beside the pool's own (a draft model's). */
#define TDM_KV_MAX_EXTRA_GROUPS 1
struct tdm_kv_group {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int latent_v_dim; /* > 0: latent layers (MLA; tdm_kv_config.latent_v_dim) */
};

#define TDM_KV_MAX_PAGE_SIZE 1024 /* tokens a page */

struct tdm_kv_config {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    int page_size; /* tokens per page */
    int64_t n_pages;
    /* Extra layer groups (group 1 ..): the same page ids name pages in them too, so one page
     * table per sequence covers every group. Each has a region of its own memory, laid out like
     * group 0's; tdm_kv_pool_geometry describes group 0. */
    int n_extra;
    struct tdm_kv_group extra[TDM_KV_MAX_EXTRA_GROUPS];
    enum tdm_dtype dtype; /* element type: TDM_DTYPE_F32 (0), TDM_DTYPE_BF16 or TDM_DTYPE_F16
                           * (tdm_kv_elem_bytes); another is refused at creation */
    /* > 0: group 0's layers are latent (MLA): one KV head whose pages hold K rows only, the
     * values being each row's first latent_v_dim elements (backend.h, tdm_kv_layer.v_dim);
     * a page is then [1][page_size][head_dim] and v_offset is 0. */
    int latent_v_dim;
};

/* The pool's memory as transfers see it: where it is, its element type, and the HND strides.
 * Layer l's pages start at base + l * layer_bytes, page p of a layer at p * page_bytes; in a
 * page, K is [n_kv_heads][page_size][head_dim] and V follows at v_offset, so kv_head h's K is
 * the run [h * head_bytes, (h + 1) * head_bytes) and its V that run plus v_offset. */
struct tdm_kv_geometry {
    enum tdm_dtype dtype;
    size_t elem_bytes;
    struct tdm_mem_place place; /* the backend's buffers' place */
    void *base;
    size_t bytes;       /* every layer's region */
    size_t layer_bytes; /* n_pages * page_bytes */
    size_t page_bytes;  /* one page of one layer, K and V */
    size_t v_offset;    /* V's offset in a page: n_kv_heads * head_bytes */
    size_t head_bytes;  /* one kv_head's K (or V) in a page: page_size * head_dim elements */
};

struct tdm_kv_stats {
    int64_t total;
    int64_t free;
    int64_t used;
    int64_t in_flight;
    int64_t cached;    /* of used and in flight: pages a prefix cache names */
    int64_t evictable; /* of them: held by the cache alone (its reference, no hold) */
};

/* Allocates the pool's memory through `backend` (which must outlive the pool). */
tdm_status tdm_kv_pool_create(const struct tdm_kv_config *cfg, tdm_backend_t *backend,
                              tdm_kv_pool_t **out);
void tdm_kv_pool_destroy(tdm_kv_pool_t *pool);

/* Bytes of one page in one layer (of group 0). */
size_t tdm_kv_page_bytes(const struct tdm_kv_config *cfg);
/* Bytes of one page in one layer of group g (a latent group's have no V half). */
size_t tdm_kv_group_page_bytes(const struct tdm_kv_config *cfg, const struct tdm_kv_group *g);
/* Bytes of one page across every layer of every group. */
size_t tdm_kv_page_bytes_all(const struct tdm_kv_config *cfg);
/* Pages that fit in `bytes` of KV memory (every group counted). */
int64_t tdm_kv_pages_for_bytes(const struct tdm_kv_config *cfg, size_t bytes);
const struct tdm_kv_config *tdm_kv_pool_config(const tdm_kv_pool_t *pool);
/* The pool's memory, place, element type and strides (for registration with a transfer
 * engine, and for the page writes of disaggregation). Fixed for the pool's lifetime. */
struct tdm_kv_geometry tdm_kv_pool_geometry(const tdm_kv_pool_t *pool);
/* The layer view the backend ops take. */
struct tdm_kv_layer tdm_kv_pool_layer(const tdm_kv_pool_t *pool, int layer);
/* Layer `layer` of group `group` (0: the pool's own layers). */
struct tdm_kv_layer tdm_kv_pool_group_layer(const tdm_kv_pool_t *pool, int group, int layer);
/* Group `group`'s geometry (0: the pool's own). false when there is no such group. */
bool tdm_kv_pool_group(const tdm_kv_pool_t *pool, int group, struct tdm_kv_group *out);

/* Copies the KV of n slots (slot = page_id * page_size + offset) in every layer of every
 * group: slot dst[i] gets what slot src[i] holds, the pairs applied in order. Speculation's
 * token trees use it to move an accepted path's KV from the slots its nodes were verified in
 * to the positions they now hold (the rest is trimmed). The caller's thread drives the pool's
 * backend (the scheduler's); asynchronous on a device, ordered before later work there. */
void tdm_kv_pool_copy_slots(tdm_kv_pool_t *pool, const int32_t *src, const int32_t *dst, int n);
/* Tensor parallelism (tp.h): `shard` is another rank's pool, holding its KV heads at the same
 * page ids (as many pages of the same size), which `pool` allocates for both: from now on
 * tdm_kv_pool_copy_slots on pool copies those slots in shard too, through shard's backend
 * (its rank idle then, between steps). shard's own page accounting is never used. At most
 * TDM_KV_MAX_SHARDS; shard must outlive pool. TDM_EINVAL for a pool of another page count or
 * page size. */
#define TDM_KV_MAX_SHARDS 63
tdm_status tdm_kv_pool_add_shard(tdm_kv_pool_t *pool, tdm_kv_pool_t *shard);

/* Allocates n pages, all or nothing: TDM_ENOMEM (and no change) if fewer are free. Each page
 * starts with one owner reference. ids: [n], written only on success. */
tdm_status tdm_kv_pool_alloc(tdm_kv_pool_t *pool, int n, int32_t *ids);
/* Drops one owner reference from each page. */
void tdm_kv_pool_free(tdm_kv_pool_t *pool, int n, const int32_t *ids);
/* Adds one owner reference to each page (a shared prefix). */
void tdm_kv_pool_retain(tdm_kv_pool_t *pool, int n, const int32_t *ids);
/* Transfer holds: a page with holds is IN_FLIGHT and is not freed until they are released. */
void tdm_kv_pool_hold(tdm_kv_pool_t *pool, int n, const int32_t *ids);
void tdm_kv_pool_unhold(tdm_kv_pool_t *pool, int n, const int32_t *ids);
struct tdm_kv_stats tdm_kv_pool_stats(tdm_kv_pool_t *pool);
/* Owner references on page id now. */
int tdm_kv_pool_owners(tdm_kv_pool_t *pool, int32_t id);
/* A prefix cache names page id (it holds a reference on it) or stops naming it (before it drops
 * that reference): the pool then counts the page in tdm_kv_stats.cached, and in .evictable
 * while the cache's is its only reference and no transfer holds it. */
void tdm_kv_pool_set_cached(tdm_kv_pool_t *pool, int32_t id, bool cached);
/* Page id is a cached page that only its cache holds (no other reference, no hold) now. */
bool tdm_kv_pool_evictable(tdm_kv_pool_t *pool, int32_t id);
/* A hook an allocation that finds too few free pages calls, without the pool's lock, on the
 * allocating thread, before it gives up: it may free pages (a cache's) and returns how many
 * it freed. NULL: none. */
void tdm_kv_pool_set_reclaim(tdm_kv_pool_t *pool, int (*reclaim)(void *ctx, int want), void *ctx);

/* A sequence's page table: the pages holding positions [0, n_tokens). Grows a page at a time. */
struct tdm_kv_seq {
    int32_t *pages; /* [cap_pages] */
    int n_pages;
    int cap_pages;
};
/* Makes the table cover `n_tokens` positions, allocating pages as needed (all or nothing). */
tdm_status tdm_kv_seq_reserve(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq, int64_t n_tokens);
/* Cuts the table back to cover `n_tokens` positions (rejected speculative tokens, a rewound
 * request): the pages past the new end lose this sequence's reference, and are free unless
 * another owner or a transfer still holds them. A no-op when the table is not longer. */
void tdm_kv_seq_trim(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq, int64_t n_tokens);
/* Makes the empty table dst hold src's KV of positions [0, n_tokens) (a prefix shared by
 * requests with one prompt): the pages wholly inside the range become dst's too (a reference
 * each: nothing may write those positions again while both hold them), and the page the range
 * ends inside is a new page of dst's own with those slots copied (tdm_kv_pool_copy_slots), so
 * that dst and src write their next positions apart. All or nothing: TDM_ENOMEM and no change
 * when no page is free. Page size at most TDM_KV_MAX_PAGE_SIZE. */
tdm_status tdm_kv_seq_share(tdm_kv_pool_t *pool, struct tdm_kv_seq *dst,
                            const struct tdm_kv_seq *src, int64_t n_tokens);
/* Makes the empty table dst hold the n pages given (a reference each): a cached prefix. */
tdm_status tdm_kv_seq_adopt(tdm_kv_pool_t *pool, struct tdm_kv_seq *dst, const int32_t *pages,
                            int n);
/* Returns every page to the pool and frees the table. Safe on a zeroed seq. */
void tdm_kv_seq_release(tdm_kv_pool_t *pool, struct tdm_kv_seq *seq);

/* ---- the prefix cache (prefix.c): full pages by content, shared by reference count ----
 * A full page is keyed by a hash chain over the tokens of every page through it, seeded with a
 * salt (the model and the KV element type), and a hit is checked token for token. The cache
 * holds a reference on each page it names; pages only it holds are evicted least recently used
 * first (leaves before the prefixes they continue), by tdm_prefix_cache_evict or the pool's
 * reclaim hook (tdm_prefix_cache_reclaim). One thread uses a cache. */
typedef struct tdm_prefix_cache tdm_prefix_cache_t;
struct tdm_prefix_stats {
    int64_t pages;           /* pages the cache names now */
    uint64_t queried_tokens; /* tokens looked up (whole pages of prompts) */
    uint64_t hit_tokens;     /* of them, found */
    uint64_t stored_pages, evicted_pages;
};
tdm_status tdm_prefix_cache_create(tdm_kv_pool_t *pool, uint64_t salt, tdm_prefix_cache_t **out);
void tdm_prefix_cache_destroy(tdm_prefix_cache_t *c); /* flushes first; NULL is a no-op */
/* The longest cached prefix of tokens[0, n_tokens) in whole pages, at most max_pages: the
 * empty table seq gets those pages (a reference each). Returns how many pages. */
int tdm_prefix_cache_match(tdm_prefix_cache_t *c, const int32_t *tokens, int n_tokens,
                           int max_pages, struct tdm_kv_seq *seq);
/* Offers seq's first n_pages pages, full and final, holding tokens[0, n_pages * page_size):
 * those not cached yet are added (the cache takes a reference on each). */
void tdm_prefix_cache_insert(tdm_prefix_cache_t *c, const int32_t *tokens,
                             const struct tdm_kv_seq *seq, int n_pages);
/* Frees up to `want` pages that only the cache holds, least recently used first. Returns how
 * many. */
int tdm_prefix_cache_evict(tdm_prefix_cache_t *c, int want);
int tdm_prefix_cache_reclaim(void *ctx, int want); /* the pool's reclaim hook, ctx the cache */
/* Pages only the cache holds (what evict could free now), as the pool counts them (O(1)). */
int64_t tdm_prefix_cache_evictable(tdm_prefix_cache_t *c);
/* Drops every entry (pages others hold stay theirs). Returns how many. */
int tdm_prefix_cache_flush(tdm_prefix_cache_t *c);
struct tdm_prefix_stats tdm_prefix_cache_stats(const tdm_prefix_cache_t *c);
/* What the cache does, told as it happens (KV cache events: serve --kv-events), on the cache's
 * thread, which the listener must not block: a full page entered the cache (its key, its
 * parent's key or 0 for a prompt's first page, its page_size tokens); a page left it (evicted);
 * every page left it (a flush). NULL (or a NULL member): not told. */
struct tdm_prefix_listener {
    void (*stored)(void *ctx, uint64_t key, uint64_t parent, const int32_t *tokens, int n);
    void (*removed)(void *ctx, uint64_t key);
    void (*cleared)(void *ctx);
    void *ctx;
};
void tdm_prefix_cache_set_listener(tdm_prefix_cache_t *c, const struct tdm_prefix_listener *l);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_KV_H */
