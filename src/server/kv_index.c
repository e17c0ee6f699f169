/*
 * The router's index of its backends' prefix caches (`tandem router --route kv`), built from
 * the KV cache events they publish (vLLM's KVEventBatch in msgpack: server/kv_events.c writes
 * them, and so do vLLM and the engines that follow its convention).
 *
 * Keys. A backend names its blocks by hashes of its own (tandem's are salted page keys, vLLM's
 * 64-bit ints or byte strings), which a router cannot compute from a prompt. So the index keys
 * blocks by a chain of its own over the token ids that BlockStored carries: key(block i) =
 * H(key(block i - 1), its block_size tokens), key(-1) = H(block_size), and remembers, per
 * backend, which of its hashes is which key (the parent hash of a stored chain names its
 * parent's key, BlockRemoved names the blocks by hash). A prompt's whole blocks then key the
 * same way (tdm_kv_index_keys), and a backend's match is how many leading keys it holds.
 *
 * Tables (open addressing, linear probing, backward-shift deletion, at most 3/4 full):
 *   blocks:  key -> the backends holding it (a bit each, at most 64 backends);
 *   hashes:  (backend, its hash) -> key;
 *   pending: (backend, key) -> requests in flight there whose prompt has that block (the
 *            router's own picks, tdm_kv_index_pend): a backend computing a block will hold it,
 *            so a match counts it, as Dynamo's router counts a worker's active blocks; this
 *            is what sends concurrent requests of one new prefix to one backend before any
 *            event about it can have come back. When its last request ends, an entry *lands*:
 *            it still counts for TDM_KV_LANDING_MS, or until the backend's BlockStored for
 *            it comes in (then the blocks table holds it), whichever is first. Without that,
 *            a prefix whose events lag (a loaded backend, a slow subscriber) would look
 *            half-held right after its request ended, and its next request could go by load
 *            to a backend that must compute it again. A FIFO of landing entries (their
 *            deadlines ascend) expires them; a full FIFO expires its oldest early.
 * A full table refuses inserts (counted), and an event whose parent the index does not know
 * (a message lost at the subscriber's high-water mark, or sent before the router subscribed)
 * stores nothing (counted as an orphan): the index under-reports, never invents.
 *
 * Untrusted bytes: a payload comes from a socket. The reader checks every length against the
 * bytes left before reading, nests at most 16 deep, and an event is applied only once it has
 * been read whole; an unknown event tag is skipped, extra fields ignored (fuzz_kv_index).
 *
 * Threading: none of its own; the router calls it under its index mutex.
 */
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

#define MAX_DEPTH    16
#define MAX_BLOCK    65536 /* tokens a block: a sanity bound on a peer's value */
#define MAX_BACKENDS 64

/* ---- a msgpack reader (what the events use, and a skip for anything else) ---- */

struct rd {
    const uint8_t *p, *end;
};

static bool take(struct rd *r, size_t n, const uint8_t **at)
{
    if ((size_t)(r->end - r->p) < n) return false;
    *at = r->p;
    r->p += n;
    return true;
}

static bool be(struct rd *r, int bytes, uint64_t *v)
{
    const uint8_t *b;
    if (!take(r, (size_t)bytes, &b)) return false;
    *v = 0;
    for (int i = 0; i < bytes; i++)
        *v = *v << 8 | b[i];
    return true;
}

static bool tag(struct rd *r, uint8_t *t)
{
    const uint8_t *b;
    if (!take(r, 1, &b)) return false;
    *t = *b;
    return true;
}

/* An array header: its element count, which the bytes left must be able to hold. */
static bool rd_array(struct rd *r, uint32_t *n)
{
    uint8_t t;
    uint64_t v;
    if (!tag(r, &t)) return false;
    if ((t & 0xf0) == 0x90)
        v = t & 0x0f;
    else if (t == 0xdc || t == 0xdd) {
        if (!be(r, t == 0xdc ? 2 : 4, &v)) return false;
    } else
        return false;
    if (v > (uint64_t)(r->end - r->p)) return false;
    *n = (uint32_t)v;
    return true;
}

/* An integer, signed or not, as its 64 bits. */
static bool rd_int(struct rd *r, uint64_t *v, bool *neg)
{
    uint8_t t;
    if (!tag(r, &t)) return false;
    *neg = false;
    if (t <= 0x7f) {
        *v = t;
        return true;
    }
    if (t >= 0xe0) {
        *v = (uint64_t)(int64_t)(int8_t)t;
        *neg = true;
        return true;
    }
    if (t >= 0xcc && t <= 0xcf) return be(r, 1 << (t - 0xcc), v);
    if (t >= 0xd0 && t <= 0xd3) {
        int bytes = 1 << (t - 0xd0);
        if (!be(r, bytes, v)) return false;
        if (bytes < 8 && (*v >> (8 * bytes - 1) & 1)) *v |= ~(uint64_t)0 << (8 * bytes);
        *neg = (int64_t)*v < 0;
        return true;
    }
    return false;
}

/* A string or binary value (a pointer into the payload). */
static bool rd_bytes(struct rd *r, const uint8_t **s, size_t *len)
{
    uint8_t t;
    uint64_t v;
    if (!tag(r, &t)) return false;
    if ((t & 0xe0) == 0xa0)
        v = t & 0x1f;
    else if (t == 0xd9 || t == 0xc4)
        return be(r, 1, &v) && (*len = (size_t)v, take(r, *len, s));
    else if (t == 0xda || t == 0xc5)
        return be(r, 2, &v) && (*len = (size_t)v, take(r, *len, s));
    else if (t == 0xdb || t == 0xc6)
        return be(r, 4, &v) && (*len = (size_t)v, take(r, *len, s));
    else
        return false;
    *len = (size_t)v;
    return take(r, *len, s);
}

static bool rd_nil(struct rd *r)
{
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return true;
    }
    return false;
}

/* Skips one value of any type. */
static bool skip(struct rd *r, int depth)
{
    if (depth > MAX_DEPTH) return false;
    uint8_t t;
    if (r->p >= r->end) return false;
    t = *r->p;
    uint64_t v;
    const uint8_t *b;
    size_t len;
    bool neg;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) return rd_int(r, &v, &neg);
    if ((t & 0xe0) == 0xa0 || t == 0xd9 || t == 0xda || t == 0xdb || t == 0xc4 || t == 0xc5 ||
        t == 0xc6)
        return rd_bytes(r, &b, &len);
    if ((t & 0xf0) == 0x90 || t == 0xdc || t == 0xdd) {
        uint32_t n;
        if (!rd_array(r, &n)) return false;
        for (uint32_t i = 0; i < n; i++)
            if (!skip(r, depth + 1)) return false;
        return true;
    }
    r->p++;
    if ((t & 0xf0) == 0x80 || t == 0xde || t == 0xdf) { /* maps: 2 values an entry */
        if ((t & 0xf0) == 0x80)
            v = t & 0x0f;
        else if (!be(r, t == 0xde ? 2 : 4, &v))
            return false;
        if (v > (uint64_t)(r->end - r->p) / 2) return false;
        for (uint64_t i = 0; i < 2 * v; i++)
            if (!skip(r, depth + 1)) return false;
        return true;
    }
    switch (t) {
    case 0xc0: /* nil, false, true */
    case 0xc2:
    case 0xc3:
        return true;
    case 0xca:
        return take(r, 4, &b);
    case 0xcb:
        return take(r, 8, &b);
    case 0xd4: /* fixext 1..16: a type byte and the data */
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:
        return take(r, 1 + ((size_t)1 << (t - 0xd4)), &b);
    case 0xc7: /* ext 8/16/32 */
    case 0xc8:
    case 0xc9:
        return be(r, 1 << (t - 0xc7), &v) && take(r, 1, &b) && take(r, (size_t)v, &b);
    default:
        return false;
    }
}

/* ---- keys ---- */

static uint64_t chain(uint64_t parent, const int32_t *tokens, int bs)
{
    uint64_t h = tdm_hash_mix(parent, 0x6b76696e64657801ull);
    for (int i = 0; i < bs; i++)
        h = tdm_hash_mix(h, (uint64_t)(uint32_t)tokens[i]);
    return h ? h : 1;
}

static uint64_t root_key(int bs)
{
    return tdm_hash_mix(0x726f757465726b76ull, (uint64_t)bs);
}

/* A backend's block hash: an integer as its bits, bytes folded into 64 (never 0). */
static bool rd_hash(struct rd *r, uint64_t *h)
{
    if (r->p >= r->end) return false;
    uint8_t t = *r->p;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xcc && t <= 0xd3)) {
        bool neg;
        if (!rd_int(r, h, &neg)) return false;
    } else {
        const uint8_t *s;
        size_t len;
        if (!rd_bytes(r, &s, &len)) return false;
        *h = 0xcbf29ce484222325ull;
        for (size_t i = 0; i < len; i++)
            *h = (*h ^ s[i]) * 0x100000001b3ull;
        *h = tdm_hash_mix(*h, len);
    }
    *h = *h ? *h : 1;
    return true;
}

/* ---- the tables ---- */

struct blk {
    uint64_t key; /* 0: empty */
    uint64_t bits;
};
struct hsh {
    uint64_t id;  /* tdm_hash_mix(backend, hash); 0: empty */
    uint64_t key; /* the block's router key */
    int32_t backend;
    uint32_t n; /* unused (0) */
};
struct pnd {
    uint64_t id;   /* pend_id(backend, key); 0: empty */
    uint64_t key;  /* the block's router key */
    int64_t until; /* n == 0: landed, counts until this time (ms) */
    int32_t backend;
    uint32_t n; /* requests in flight there with the block */
};
#define LANDING_FIFO 8192
struct landing {
    uint64_t id;
    int64_t until;
};

struct tdm_kv_index {
    struct blk *blk;
    struct hsh *hsh;
    struct pnd *pnd; /* (backend, key) -> requests in flight there with that block (n) */
    size_t mask, n_blk, n_hsh, n_pnd;
    struct landing *fifo; /* landed pending entries, oldest first (a ring) */
    size_t fifo_head, fifo_n;
    int block_size; /* 0 until the first stored block */
    int64_t held[MAX_BACKENDS];
    struct tdm_kv_index_stats st;
};

static size_t slot(uint64_t k, size_t mask)
{
    return (size_t)tdm_hash_mix(k, 0x736c6f74ull) & mask;
}

static struct blk *blk_find(const struct tdm_kv_index *x, uint64_t key)
{
    for (size_t i = slot(key, x->mask);; i = (i + 1) & x->mask) {
        if (!x->blk[i].key) return NULL;
        if (x->blk[i].key == key) return &x->blk[i];
    }
}

static struct hsh *hsh_find_in(struct hsh *t, size_t mask, uint64_t id)
{
    for (size_t i = slot(id, mask);; i = (i + 1) & mask) {
        if (!t[i].id) return NULL;
        if (t[i].id == id) return &t[i];
    }
}

static struct hsh *hsh_find(const struct tdm_kv_index *x, uint64_t id)
{
    return hsh_find_in(x->hsh, x->mask, id);
}

static struct pnd *pnd_find(const struct tdm_kv_index *x, uint64_t id)
{
    for (size_t i = slot(id, x->mask);; i = (i + 1) & x->mask) {
        if (!x->pnd[i].id) return NULL;
        if (x->pnd[i].id == id) return &x->pnd[i];
    }
}

/* Backward-shift deletion of entry i of table tab, whose entries are keyed by field keyf. */
#define DELETE_AT(tab, i, keyf)                                                                    \
    do {                                                                                           \
        size_t hole_ = (i);                                                                        \
        for (size_t j_ = (hole_ + 1) & x->mask; (tab)[j_].keyf; j_ = (j_ + 1) & x->mask) {         \
            size_t home_ = slot((tab)[j_].keyf, x->mask);                                          \
            /* entry j_ may move into the hole when its home is not in (hole_, j_] */              \
            if (((j_ - home_) & x->mask) >= ((j_ - hole_) & x->mask)) {                            \
                (tab)[hole_] = (tab)[j_];                                                          \
                hole_ = j_;                                                                        \
            }                                                                                      \
        }                                                                                          \
        memset(&(tab)[hole_], 0, sizeof(tab)[hole_]);                                              \
    } while (0)

static bool room(const struct tdm_kv_index *x, size_t n)
{
    return n + 1 <= (x->mask + 1) / 4 * 3;
}

static uint64_t hash_id(int backend, uint64_t h)
{
    uint64_t id = tdm_hash_mix(h, 0x6261636b656e6400ull + (uint64_t)backend);
    return id ? id : 1;
}

static uint64_t pend_id(int backend, uint64_t key)
{
    uint64_t id = tdm_hash_mix(key, 0x70656e64696e6700ull + (uint64_t)backend);
    return id ? id : 1;
}

static void pnd_delete(struct tdm_kv_index *x, struct pnd *e)
{
    size_t j = (size_t)(e - x->pnd);
    DELETE_AT(x->pnd, j, id);
    x->n_pnd--;
}

/* The oldest landing entry leaves the FIFO; its pending entry goes unless a request took it
 * again (n > 0) or it landed again later (a later deadline, with its own FIFO entry). */
static void fifo_pop(struct tdm_kv_index *x)
{
    const struct landing l = x->fifo[x->fifo_head];
    x->fifo_head = (x->fifo_head + 1) % LANDING_FIFO;
    x->fifo_n--;
    struct pnd *e = pnd_find(x, l.id);
    if (e && !e->n && e->until <= l.until) pnd_delete(x, e);
}

/* Removes hash entry e (backend b's) and b's bit on its key. */
static void release(struct tdm_kv_index *x, struct hsh *e)
{
    const int b = e->backend;
    const uint64_t key = e->key;
    size_t i = (size_t)(e - x->hsh);
    DELETE_AT(x->hsh, i, id);
    x->n_hsh--;
    x->held[b]--;
    struct blk *k = blk_find(x, key);
    if (k && (k->bits &= ~(1ull << b)) == 0) {
        size_t j = (size_t)(k - x->blk);
        DELETE_AT(x->blk, j, key);
        x->n_blk--;
    }
}

/* Backend b holds key under its hash h; false when the tables are full. */
static bool hold(struct tdm_kv_index *x, int b, uint64_t h, uint64_t key)
{
    const uint64_t id = hash_id(b, h);
    struct hsh *e = hsh_find(x, id);
    if (e && e->key == key) return true;
    if (e) release(x, e); /* stored again under the same hash: it names this key now */
    struct blk *k = blk_find(x, key);
    if (!room(x, x->n_hsh) || (!k && !room(x, x->n_blk))) return false;
    if (!k) {
        size_t i = slot(key, x->mask);
        while (x->blk[i].key)
            i = (i + 1) & x->mask;
        x->blk[i] = (struct blk){.key = key};
        k = &x->blk[i];
        x->n_blk++;
    }
    k->bits |= 1ull << b;
    struct pnd *p = x->n_pnd ? pnd_find(x, pend_id(b, key)) : NULL;
    if (p && !p->n) pnd_delete(x, p); /* landed, and now confirmed: the blocks table has it */
    size_t i = slot(id, x->mask);
    while (x->hsh[i].id)
        i = (i + 1) & x->mask;
    x->hsh[i] = (struct hsh){.id = id, .key = key, .backend = b};
    x->n_hsh++;
    x->held[b]++;
    return true;
}

static void drop(struct tdm_kv_index *x, int b, uint64_t h)
{
    struct hsh *e = hsh_find(x, hash_id(b, h));
    if (!e) return;
    release(x, e);
    x->st.removed++;
}

tdm_status tdm_kv_index_new(size_t capacity, struct tdm_kv_index **out)
{
    size_t cap = 1024;
    while (cap < capacity / 3 * 4 && cap < ((size_t)1 << 26))
        cap <<= 1;
    struct tdm_kv_index *x = calloc(1, sizeof *x);
    if (!x || !(x->blk = calloc(cap, sizeof *x->blk)) || !(x->hsh = calloc(cap, sizeof *x->hsh)) ||
        !(x->pnd = calloc(cap, sizeof *x->pnd)) ||
        !(x->fifo = calloc(LANDING_FIFO, sizeof *x->fifo))) {
        if (x) {
            free(x->blk);
            free(x->hsh);
            free(x->pnd);
        }
        free(x);
        return tdm_err_set(TDM_ENOMEM, "router: out of memory for the KV index");
    }
    x->mask = cap - 1;
    *out = x;
    return TDM_OK;
}

void tdm_kv_index_free(struct tdm_kv_index *x)
{
    if (!x) return;
    free(x->blk);
    free(x->hsh);
    free(x->pnd);
    free(x->fifo);
    free(x);
}

void tdm_kv_index_forget(struct tdm_kv_index *x, int b)
{
    if (b < 0 || b >= MAX_BACKENDS) return;
    /* what landed there is gone with the cache: the landed entries are the FIFO's (an entry
     * left behind there finds nothing when it is popped) */
    for (size_t i = 0; i < x->fifo_n; i++) {
        struct pnd *e = pnd_find(x, x->fifo[(x->fifo_head + i) % LANDING_FIFO].id);
        if (e && e->backend == b && !e->n) pnd_delete(x, e);
    }
    if (!x->held[b]) return;
    /* in place: after a deletion the slot holds what shifted into it, so it is looked at
     * again (an entry only ever shifts towards its home, into a slot already passed or this
     * one, and entries of b are gone wherever the scan has been) */
    for (size_t i = 0; i <= x->mask;) {
        if (x->hsh[i].id && x->hsh[i].backend == b) {
            DELETE_AT(x->hsh, i, id);
            x->n_hsh--;
        } else {
            i++;
        }
    }
    for (size_t i = 0; i <= x->mask;) {
        if (x->blk[i].key && (x->blk[i].bits &= ~(1ull << b)) == 0) {
            DELETE_AT(x->blk, i, key);
            x->n_blk--;
        } else {
            i++;
        }
    }
    x->held[b] = 0;
}

/* ---- events ---- */

/* ["BlockStored", [hash...], parent or nil, [token...], block_size, ...]: read whole, then
 * applied. */
static bool stored(struct tdm_kv_index *x, int b, struct rd *r, uint32_t fields)
{
    uint32_t n_h, n_t;
    if (fields < 5 || !rd_array(r, &n_h)) return false;
    struct rd hashes = *r;
    uint64_t h;
    for (uint32_t i = 0; i < n_h; i++)
        if (!rd_hash(r, &h)) return false;
    uint64_t parent = 0;
    bool has_parent = !rd_nil(r);
    if (has_parent && !rd_hash(r, &parent)) return false;
    if (!rd_array(r, &n_t)) return false;
    struct rd toks = *r;
    uint64_t v;
    bool neg;
    for (uint32_t i = 0; i < n_t; i++)
        if (!rd_int(r, &v, &neg) || neg || v > INT32_MAX) return false;
    uint64_t bs;
    if (!rd_int(r, &bs, &neg) || neg || !bs || bs > MAX_BLOCK) return false;
    for (uint32_t i = 5; i < fields; i++)
        if (!skip(r, 2)) return false;
    if ((uint64_t)n_h * bs != n_t) return false;
    /* applied: a block size other than the index's cannot be matched against prompts */
    if (!x->block_size) x->block_size = (int)bs;
    if ((int)bs != x->block_size) {
        x->st.refused++;
        return true;
    }
    uint64_t key;
    if (!has_parent) {
        key = root_key((int)bs);
    } else {
        const struct hsh *pe = hsh_find(x, hash_id(b, parent));
        if (!pe) {
            x->st.orphans += n_h;
            return true;
        }
        key = pe->key;
    }
    for (uint32_t i = 0; i < n_h; i++) {
        rd_hash(&hashes, &h);
        uint64_t kk = tdm_hash_mix(key, 0x6b76696e64657801ull); /* chain()'s, over the reader */
        for (uint64_t t = 0; t < bs; t++) {
            rd_int(&toks, &v, &neg);
            kk = tdm_hash_mix(kk, (uint64_t)(uint32_t)v);
        }
        key = kk ? kk : 1;
        if (!hold(x, b, h, key)) {
            x->st.full++;
            return true;
        }
        x->st.stored++;
    }
    return true;
}

tdm_status tdm_kv_index_apply(struct tdm_kv_index *x, int b, const void *payload, size_t len)
{
    if (b < 0 || b >= MAX_BACKENDS) return tdm_err_set(TDM_EINVAL, "kv index: backend %d", b);
    struct rd r = {payload, (const uint8_t *)payload + len};
    uint32_t top, n_ev;
    if (!rd_array(&r, &top) || top < 2 || !skip(&r, 1) || !rd_array(&r, &n_ev)) goto bad;
    for (uint32_t e = 0; e < n_ev; e++) {
        uint32_t fields;
        const uint8_t *t;
        size_t tl;
        if (!rd_array(&r, &fields) || !fields || !rd_bytes(&r, &t, &tl)) goto bad;
        if (tl == 11 && !memcmp(t, "BlockStored", 11)) {
            if (!stored(x, b, &r, fields)) goto bad;
        } else if (tl == 12 && !memcmp(t, "BlockRemoved", 12)) {
            uint32_t n_h;
            if (fields < 2 || !rd_array(&r, &n_h)) goto bad;
            struct rd hashes = r;
            uint64_t h;
            for (uint32_t i = 0; i < n_h; i++)
                if (!rd_hash(&r, &h)) goto bad;
            for (uint32_t i = 2; i < fields; i++)
                if (!skip(&r, 2)) goto bad;
            for (uint32_t i = 0; i < n_h; i++) {
                rd_hash(&hashes, &h);
                drop(x, b, h);
            }
        } else if (tl == 16 && !memcmp(t, "AllBlocksCleared", 16)) {
            for (uint32_t i = 1; i < fields; i++)
                if (!skip(&r, 2)) goto bad;
            tdm_kv_index_forget(x, b);
            x->st.cleared++;
        } else { /* an event this router does not know */
            for (uint32_t i = 1; i < fields; i++)
                if (!skip(&r, 2)) goto bad;
        }
    }
    for (uint32_t i = 2; i < top; i++) /* later fields (vLLM's data-parallel rank) */
        if (!skip(&r, 1)) goto bad;
    return TDM_OK;
bad:
    x->st.bad++;
    return tdm_err_set(TDM_EFORMAT, "kv index: a malformed KV event batch");
}

int tdm_kv_index_block_size(const struct tdm_kv_index *x)
{
    return x->block_size;
}

int tdm_kv_index_keys(const struct tdm_kv_index *x, const int32_t *ids, int n, uint64_t *keys,
                      int max)
{
    int bs = x->block_size, k = 0;
    if (bs <= 0) return 0;
    uint64_t key = root_key(bs);
    for (; k < max && (int64_t)(k + 1) * bs <= n; k++)
        keys[k] = key = chain(key, ids + (size_t)k * (size_t)bs, bs);
    return k;
}

void tdm_kv_index_pend(struct tdm_kv_index *x, int b, const uint64_t *keys, int n, int delta,
                       int64_t now_ms)
{
    if (b < 0 || b >= MAX_BACKENDS) return;
    tdm_kv_index_expire(x, now_ms);
    for (int i = 0; i < n; i++) {
        const uint64_t id = pend_id(b, keys[i]);
        struct pnd *e = pnd_find(x, id);
        if (delta > 0) {
            if (e) {
                e->n++;
            } else if (room(x, x->n_pnd)) {
                size_t j = slot(id, x->mask);
                while (x->pnd[j].id)
                    j = (j + 1) & x->mask;
                x->pnd[j] = (struct pnd){.id = id, .key = keys[i], .backend = b, .n = 1};
                x->n_pnd++;
            }
        } else if (e && e->n && --e->n == 0) { /* lands: counted a while yet */
            const struct blk *k = blk_find(x, keys[i]);
            if (k && (k->bits >> b & 1)) { /* its event is in already */
                pnd_delete(x, e);
                continue;
            }
            if (x->fifo_n == LANDING_FIFO) fifo_pop(x); /* the oldest goes early */
            e = pnd_find(x, id);                        /* the pop may have shifted it */
            e->until = now_ms + TDM_KV_LANDING_MS;
            x->fifo[(x->fifo_head + x->fifo_n) % LANDING_FIFO] =
                (struct landing){.id = id, .until = e->until};
            x->fifo_n++;
        }
    }
}

void tdm_kv_index_expire(struct tdm_kv_index *x, int64_t now_ms)
{
    while (x->fifo_n && x->fifo[x->fifo_head].until <= now_ms)
        fifo_pop(x);
}

void tdm_kv_index_match(const struct tdm_kv_index *x, const uint64_t *keys, int n, int n_backends,
                        int *matched, int64_t now_ms)
{
    n_backends = n_backends < MAX_BACKENDS ? n_backends : MAX_BACKENDS;
    uint64_t live = n_backends == 64 ? ~0ull : (1ull << n_backends) - 1;
    for (int b = 0; b < n_backends; b++)
        matched[b] = 0;
    for (int i = 0; i < n && live; i++) {
        const struct blk *e = blk_find(x, keys[i]);
        uint64_t has = e ? e->bits : 0;
        for (int b = 0; x->n_pnd && b < n_backends; b++) { /* in flight there, or landing */
            if (!(live >> b & 1) || (has >> b & 1)) continue;
            const struct pnd *p = pnd_find(x, pend_id(b, keys[i]));
            if (p && (p->n || p->until > now_ms)) has |= 1ull << b;
        }
        live &= has;
        for (int b = 0; b < n_backends; b++)
            matched[b] += (int)(live >> b & 1);
    }
}

double tdm_kv_index_share(const struct tdm_kv_index *x, int b, int n_backends)
{
    int64_t all = 0;
    for (int i = 0; i < n_backends && i < MAX_BACKENDS; i++)
        all += x->held[i];
    return all && b < MAX_BACKENDS ? (double)x->held[b] / (double)all : 0.0;
}

int64_t tdm_kv_index_held(const struct tdm_kv_index *x, int b)
{
    return b >= 0 && b < MAX_BACKENDS ? x->held[b] : 0;
}

struct tdm_kv_index_stats tdm_kv_index_stats(const struct tdm_kv_index *x)
{
    return x->st;
}
