/*
 * KV cache events (`tandem serve --kv-events ENDPOINT`): what the prefix cache stores and
 * drops, published as vLLM publishes them, so that KV-aware routers (llm-d's KV cache manager,
 * Dynamo's router) can follow this node's cache.
 *
 * Wire: a ZMQ PUB socket bound at the endpoint. Each message is three frames: the topic (bytes,
 * "" by default), a sequence number (8 bytes, big-endian, from 0, one per batch), and a msgpack
 * payload, vLLM's KVEventBatch in msgspec's array form:
 *     [ts (float, Unix seconds), [event, ...]]
 * with each event a tagged array:
 *     ["BlockStored", [block_hash], parent_block_hash or nil, [token_id, ...], block_size,
 *      lora_id (nil), medium]
 *     ["BlockRemoved", [block_hash], medium]
 *     ["AllBlocksCleared"]
 * Block hashes are the cache's page keys (64-bit, a chain over the prompt's tokens: a key names
 * its whole prefix), so a router that hashes the same way matches prompts against them; one
 * event per page (vLLM may list several hashes in one event: consumers take lists). medium is
 * "GPU" or "CPU", where the node's KV cache lives.
 *
 * Threading: the listener calls come on the scheduler's thread and only append the event, in
 * msgpack, to a pending buffer under a mutex (bounded: past TDM_KV_EVENTS_MAX_PENDING bytes an
 * event is dropped and counted, never waited for); the publisher thread takes the buffer every
 * 10 ms (or on stop) and sends it as one batch. The ZMQ socket is the publisher thread's alone.
 * A slow subscriber loses messages at ZMQ's high-water mark, as with vLLM.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "tandem/server.h"

#define TDM_KV_EVENTS_MAX_PENDING (8u << 20)

/* ---- a msgpack writer (the few types the events use) ---- */

struct mp {
    uint8_t *p;
    size_t n, cap;
    bool oom;
};

static void mp_raw(struct mp *m, const void *d, size_t n)
{
    if (m->oom) return;
    if (m->n + n > m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 4096;
        while (cap < m->n + n)
            cap *= 2;
        uint8_t *p = realloc(m->p, cap);
        if (!p) {
            m->oom = true;
            return;
        }
        m->p = p;
        m->cap = cap;
    }
    memcpy(m->p + m->n, d, n);
    m->n += n;
}

static void mp_be(struct mp *m, uint8_t tag, uint64_t v, int bytes)
{
    uint8_t b[9] = {tag};
    for (int i = 0; i < bytes; i++)
        b[1 + i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));
    mp_raw(m, b, (size_t)bytes + 1);
}

static void mp_uint(struct mp *m, uint64_t v)
{
    if (v < 128) {
        uint8_t b = (uint8_t)v;
        mp_raw(m, &b, 1);
    } else if (v <= UINT8_MAX) {
        mp_be(m, 0xcc, v, 1);
    } else if (v <= UINT16_MAX) {
        mp_be(m, 0xcd, v, 2);
    } else if (v <= UINT32_MAX) {
        mp_be(m, 0xce, v, 4);
    } else {
        mp_be(m, 0xcf, v, 8);
    }
}

static void mp_array(struct mp *m, uint32_t n)
{
    if (n < 16) {
        uint8_t b = (uint8_t)(0x90 | n);
        mp_raw(m, &b, 1);
    } else if (n <= UINT16_MAX) {
        mp_be(m, 0xdc, n, 2);
    } else {
        mp_be(m, 0xdd, n, 4);
    }
}

static void mp_str(struct mp *m, const char *s)
{
    size_t n = strlen(s); /* short names only */
    uint8_t b = (uint8_t)(0xa0 | (n & 31));
    mp_raw(m, &b, 1);
    mp_raw(m, s, n);
}

static void mp_nil(struct mp *m)
{
    uint8_t b = 0xc0;
    mp_raw(m, &b, 1);
}

static void mp_f64(struct mp *m, double d)
{
    uint64_t v;
    memcpy(&v, &d, 8);
    mp_be(m, 0xcb, v, 8);
}

/* ---- the publisher ---- */

struct tdm_kv_events {
    void *zctx, *pub;
    char *topic;
    int block_size;
    const char *medium;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct mp pending; /* encoded events, under mu */
    uint32_t n_pending;
    bool stop;
    pthread_t thread;
    bool running;
    _Atomic uint64_t stored, removed, cleared, dropped, batches, send_errors;
};

/* Appends one encoded event (built in e) to the pending batch, or drops it; counts it in
 * *published when it is in the batch. */
static void enqueue(struct tdm_kv_events *ev, struct mp *e, _Atomic uint64_t *published)
{
    pthread_mutex_lock(&ev->mu);
    if (e->oom || ev->pending.n + e->n > TDM_KV_EVENTS_MAX_PENDING) {
        atomic_fetch_add(&ev->dropped, 1);
    } else {
        mp_raw(&ev->pending, e->p, e->n);
        if (ev->pending.oom) { /* the buffer could not grow: start over, the batch lost */
            free(ev->pending.p);
            ev->pending = (struct mp){0};
            atomic_fetch_add(&ev->dropped, ev->n_pending + 1);
            ev->n_pending = 0;
        } else {
            ev->n_pending++;
            atomic_fetch_add(published, 1);
        }
    }
    pthread_mutex_unlock(&ev->mu);
    free(e->p);
}

static void on_stored(void *ctx, uint64_t key, uint64_t parent, const int32_t *tokens, int n)
{
    struct tdm_kv_events *ev = ctx;
    struct mp e = {0};
    mp_array(&e, 7);
    mp_str(&e, "BlockStored");
    mp_array(&e, 1);
    mp_uint(&e, key);
    if (parent)
        mp_uint(&e, parent);
    else
        mp_nil(&e);
    mp_array(&e, (uint32_t)n);
    for (int i = 0; i < n; i++)
        mp_uint(&e, (uint32_t)tokens[i]);
    mp_uint(&e, (uint64_t)ev->block_size);
    mp_nil(&e);
    mp_str(&e, ev->medium);
    enqueue(ev, &e, &ev->stored);
}

static void on_removed(void *ctx, uint64_t key)
{
    struct tdm_kv_events *ev = ctx;
    struct mp e = {0};
    mp_array(&e, 3);
    mp_str(&e, "BlockRemoved");
    mp_array(&e, 1);
    mp_uint(&e, key);
    mp_str(&e, ev->medium);
    enqueue(ev, &e, &ev->removed);
}

static void on_cleared(void *ctx)
{
    struct tdm_kv_events *ev = ctx;
    struct mp e = {0};
    mp_array(&e, 1);
    mp_str(&e, "AllBlocksCleared");
    enqueue(ev, &e, &ev->cleared);
}

/* Sends one batch: topic, sequence, [ts, [events]]. */
static void send_batch(struct tdm_kv_events *ev, const struct mp *events, uint32_t n, uint64_t seq)
{
    struct mp m = {0};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    mp_array(&m, 2);
    mp_f64(&m, (double)ts.tv_sec + ts.tv_nsec / 1e9);
    mp_array(&m, n);
    mp_raw(&m, events->p, events->n);
    uint8_t sq[8];
    for (int i = 0; i < 8; i++)
        sq[i] = (uint8_t)(seq >> (56 - 8 * i));
    if (m.oom || zmq_send(ev->pub, ev->topic, strlen(ev->topic), ZMQ_SNDMORE) < 0 ||
        zmq_send(ev->pub, sq, sizeof sq, ZMQ_SNDMORE) < 0 || zmq_send(ev->pub, m.p, m.n, 0) < 0)
        atomic_fetch_add(&ev->send_errors, 1);
    else
        atomic_fetch_add(&ev->batches, 1);
    free(m.p);
}

static void *publisher_main(void *arg)
{
    struct tdm_kv_events *ev = arg;
    uint64_t seq = 0;
    pthread_mutex_lock(&ev->mu);
    for (;;) {
        if (!ev->n_pending && !ev->stop) {
            struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, 10);
            pthread_cond_timedwait(&ev->cv, &ev->mu, &dl);
        }
        if (ev->n_pending) {
            struct mp batch = ev->pending;
            uint32_t n = ev->n_pending;
            ev->pending = (struct mp){0};
            ev->n_pending = 0;
            pthread_mutex_unlock(&ev->mu);
            send_batch(ev, &batch, n, seq++);
            free(batch.p);
            pthread_mutex_lock(&ev->mu);
            continue;
        }
        if (ev->stop) break;
    }
    pthread_mutex_unlock(&ev->mu);
    return NULL;
}

tdm_status tdm_kv_events_start(const struct tdm_kv_events_opts *o, tdm_kv_events_t **out)
{
    if (!o || !o->endpoint || !*o->endpoint || o->block_size <= 0)
        return tdm_err_set(TDM_EINVAL, "kv events: an endpoint and a block size are needed");
    struct tdm_kv_events *ev = calloc(1, sizeof *ev);
    if (!ev || !(ev->topic = strdup(o->topic ? o->topic : ""))) {
        free(ev);
        return tdm_err_set(TDM_ENOMEM, "kv events: out of memory");
    }
    ev->block_size = o->block_size;
    ev->medium = o->on_gpu ? "GPU" : "CPU";
    pthread_mutex_init(&ev->mu, NULL);
    pthread_cond_init(&ev->cv, NULL);
    tdm_status st = TDM_OK;
    int hwm = 100000, linger = 0;
    if (!(ev->zctx = zmq_ctx_new()) || !(ev->pub = zmq_socket(ev->zctx, ZMQ_PUB))) {
        st = tdm_err_set(TDM_ENOMEM, "kv events: no ZMQ socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    zmq_setsockopt(ev->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(ev->pub, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(ev->pub, o->endpoint) != 0) {
        st = tdm_err_set(TDM_EINVAL, "kv events: cannot bind %s: %s", o->endpoint,
                         zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (pthread_create(&ev->thread, NULL, publisher_main, ev)) {
        st = tdm_err_set(TDM_ENOMEM, "kv events: no publisher thread");
        goto fail;
    }
    ev->running = true;
    *out = ev;
    return TDM_OK;
fail:
    tdm_kv_events_stop(ev);
    return st;
}

void tdm_kv_events_stop(tdm_kv_events_t *ev)
{
    if (!ev) return;
    if (ev->running) { /* what is pending goes out first */
        pthread_mutex_lock(&ev->mu);
        ev->stop = true;
        pthread_cond_signal(&ev->cv);
        pthread_mutex_unlock(&ev->mu);
        pthread_join(ev->thread, NULL);
    }
    if (ev->pub) zmq_close(ev->pub);
    if (ev->zctx) zmq_ctx_term(ev->zctx);
    pthread_mutex_destroy(&ev->mu);
    pthread_cond_destroy(&ev->cv);
    free(ev->pending.p);
    free(ev->topic);
    free(ev);
}

struct tdm_prefix_listener tdm_kv_events_listener(tdm_kv_events_t *ev)
{
    return (struct tdm_prefix_listener){
        .stored = on_stored, .removed = on_removed, .cleared = on_cleared, .ctx = ev};
}

char *tdm_kv_events_metrics(tdm_kv_events_t *ev)
{
    struct tdm_sbuf b = {0};
    tdm_prom_family(&b, "tandem_kv_events_total", "counter",
                    "KV cache events put in a batch to publish (--kv-events), by kind.");
    const char *kinds[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
    const uint64_t n[] = {atomic_load(&ev->stored), atomic_load(&ev->removed),
                          atomic_load(&ev->cleared)};
    for (int i = 0; i < 3; i++) {
        char lab[48];
        snprintf(lab, sizeof lab, "kind=\"%s\"", kinds[i]);
        tdm_prom_sample(&b, "tandem_kv_events_total", lab, (double)n[i]);
    }
    tdm_prom_scalar(&b, "tandem_kv_events_dropped_total", "counter",
                    "KV cache events dropped: the pending batch was full, or no memory.", NULL,
                    (double)atomic_load(&ev->dropped));
    tdm_prom_scalar(&b, "tandem_kv_events_batches_total", "counter",
                    "Batches of KV cache events sent.", NULL, (double)atomic_load(&ev->batches));
    tdm_prom_scalar(&b, "tandem_kv_events_send_errors_total", "counter",
                    "Batches the ZMQ socket refused.", NULL, (double)atomic_load(&ev->send_errors));
    return tdm_sbuf_take(&b);
}
