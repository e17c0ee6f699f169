/*
 * Prefix affinity for the router (`tandem router --route prefix`): which backend has probably
 * cached a request's prompt prefix, from the prompts the router itself sent where.
 *
 * The router sees request bodies, not tokens, so a prompt is cut into blocks of
 * TDM_AFFINITY_BLOCK bytes of its text (chat: each message's role and content, with
 * separators; completions: the prompt string, or a token list's decimal ids), and block i's key
 * hashes block i and the key before it (a chain: a key names its whole prefix, as the backends'
 * page hashes do). A trailing partial block has no key (a backend caches whole pages only).
 * This is the approximate scorer of llm-d's endpoint picker; the exact one reads the backends'
 * KV events.
 *
 * The index: an open-addressing table of keys, each with a bit per backend (the backends it was
 * sent to) and a stamp (its last use). Inserting into a full probe window replaces the oldest
 * entry there, so the index forgets what the backends have most probably evicted too. A
 * backend's match for a request: how many of its leading keys carry its bit; its share: the
 * fraction of the index's (entry, backend) pairs that are its own, how much of the prompts'
 * text it probably holds, so that new prefixes can go where less is held.
 *
 * Threading: the router's pick holds its mutex around match and insert; this module has no
 * locking of its own.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

#define PROBES 16

struct aff_entry {
    uint64_t key;   /* 0: empty */
    uint64_t stamp; /* last use */
    uint32_t backends;
};

struct tdm_affinity {
    struct aff_entry *t;
    size_t mask; /* capacity - 1 */
    uint64_t clock;
    uint64_t held[32]; /* entries with each backend's bit */
};

/* Clears an entry's bits from the per-backend counts. */
static void unheld(struct tdm_affinity *a, uint32_t backends)
{
    for (int b = 0; b < 32; b++)
        if (backends >> b & 1) a->held[b]--;
}

tdm_status tdm_affinity_new(size_t capacity, struct tdm_affinity **out)
{
    size_t cap = 1024;
    while (cap < capacity && cap < ((size_t)1 << 28))
        cap <<= 1;
    struct tdm_affinity *a = calloc(1, sizeof *a);
    if (!a || !(a->t = calloc(cap, sizeof *a->t))) {
        free(a);
        return tdm_err_set(TDM_ENOMEM, "router: out of memory for the prefix index");
    }
    a->mask = cap - 1;
    *out = a;
    return TDM_OK;
}

void tdm_affinity_free(struct tdm_affinity *a)
{
    if (!a) return;
    free(a->t);
    free(a);
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* Appends n bytes of s to the prompt's text (a NUL inside a JSON string ends the part: the
 * text only feeds hashes). */
static void put(struct tdm_sbuf *t, const char *s, size_t n)
{
    tdm_sbuf_printf(t, "%.*s", (int)(n < INT32_MAX ? n : INT32_MAX), s);
}

/* A message's content: a string, or an array of parts whose "text" strings count. */
static void put_content(struct tdm_sbuf *t, const json_t *c)
{
    if (json_is_string(c)) {
        put(t, json_string_value(c), json_string_length(c));
        return;
    }
    size_t i;
    const json_t *part;
    json_array_foreach(c, i, part)
    {
        const json_t *x = json_object_get(part, "text");
        if (json_is_string(x)) put(t, json_string_value(x), json_string_length(x));
    }
}

int tdm_affinity_keys(const char *body, size_t len, uint64_t *keys, int max)
{
    json_t *root = body ? json_loadb(body, len, 0, NULL) : NULL;
    if (!json_is_object(root)) {
        json_decref(root);
        return 0;
    }
    struct tdm_sbuf t = {0};
    const json_t *msgs = json_object_get(root, "messages"),
                 *prompt = json_object_get(root, "prompt");
    if (json_is_array(msgs)) {
        size_t i;
        const json_t *m;
        json_array_foreach(msgs, i, m)
        {
            const json_t *role = json_object_get(m, "role");
            if (json_is_string(role)) put(&t, json_string_value(role), json_string_length(role));
            put(&t, "\x1f", 1);
            put_content(&t, json_object_get(m, "content"));
            put(&t, "\x1e", 1);
        }
    } else if (json_is_string(prompt)) {
        put(&t, json_string_value(prompt), json_string_length(prompt));
    } else if (json_is_string(json_array_get(prompt, 0))) { /* a list of prompts: the first */
        const json_t *first = json_array_get(prompt, 0);
        put(&t, json_string_value(first), json_string_length(first));
    } else if (json_is_array(prompt)) { /* token ids (a list of prompts: the first) */
        const json_t *first = json_array_get(prompt, 0);
        const json_t *ids = json_is_array(first) ? first : prompt;
        size_t i;
        const json_t *id;
        json_array_foreach(ids, i, id)
        {
            char num[24];
            int n = snprintf(num, sizeof num, "%lld,", (long long)json_integer_value(id));
            put(&t, num, (size_t)n);
        }
    }
    json_decref(root);
    int n = 0;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (size_t off = 0; !t.oom && off + TDM_AFFINITY_BLOCK <= t.len && n < max;
         off += TDM_AFFINITY_BLOCK) {
        for (size_t i = 0; i < TDM_AFFINITY_BLOCK; i += 8) {
            uint64_t w = 0;
            memcpy(&w, t.s + off + i, 8);
            h = mix64(h ^ w) + 0x632be59bd9b4e019ull;
        }
        keys[n++] = h ? h : 1; /* 0 marks an empty entry */
    }
    free(t.s);
    return n;
}

static struct aff_entry *find(struct tdm_affinity *a, uint64_t key)
{
    for (size_t i = 0; i < PROBES; i++) {
        struct aff_entry *e = &a->t[(key + i) & a->mask];
        if (e->key == key) return e;
        if (!e->key) return NULL;
    }
    return NULL;
}

void tdm_affinity_match(struct tdm_affinity *a, const uint64_t *keys, int n, int n_backends,
                        int *matched)
{
    uint32_t alive = n_backends >= 32 ? ~0u : (1u << n_backends) - 1;
    for (int b = 0; b < n_backends; b++)
        matched[b] = 0;
    for (int i = 0; i < n && alive; i++) {
        const struct aff_entry *e = find(a, keys[i]);
        uint32_t has = e ? e->backends & alive : 0;
        for (int b = 0; b < n_backends && b < 32; b++)
            if (has >> b & 1) matched[b]++;
        alive = has; /* a backend's match ends at its first missing block */
    }
}

void tdm_affinity_insert(struct tdm_affinity *a, int backend, const uint64_t *keys, int n)
{
    if (backend < 0 || backend >= 32) return;
    for (int i = 0; i < n; i++) {
        const uint64_t key = keys[i];
        struct aff_entry *slot = NULL, *oldest = NULL;
        for (size_t k = 0; k < PROBES && !slot; k++) {
            struct aff_entry *e = &a->t[(key + k) & a->mask];
            if (e->key == key || !e->key)
                slot = e;
            else if (!oldest || e->stamp < oldest->stamp)
                oldest = e;
        }
        if (!slot) { /* a full window: forget its oldest */
            slot = oldest;
            unheld(a, slot->backends);
            slot->key = 0;
        }
        if (slot->key != key) *slot = (struct aff_entry){.key = key};
        if (!(slot->backends >> backend & 1)) a->held[backend]++;
        slot->backends |= 1u << backend;
        slot->stamp = ++a->clock;
    }
}

void tdm_affinity_forget(struct tdm_affinity *a, int backend)
{
    if (backend < 0 || backend >= 32) return;
    for (size_t i = 0; i <= a->mask; i++)
        a->t[i].backends &= ~(1u << backend);
    a->held[backend] = 0;
}

double tdm_affinity_share(const struct tdm_affinity *a, int backend, int n_backends)
{
    uint64_t all = 0;
    for (int b = 0; b < n_backends && b < 32; b++)
        all += a->held[b];
    return backend >= 0 && backend < 32 && all ? (double)a->held[backend] / (double)all : 0.0;
}
