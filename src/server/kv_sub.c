/*
 * The router's subscriber to its backends' KV cache events (`tandem router --route kv
 * --kv-events ENDPOINTS`): one ZMQ SUB socket a backend, connected to the PUB endpoint its
 * `tandem serve --kv-events` (or any engine publishing vLLM's KVEventBatch) binds, all topics.
 * Each message is topic, an 8-byte big-endian sequence number, and the msgpack batch; the
 * batch goes into the index (server/kv_index.c), which routing reads.
 *
 * Sequence numbers: a number that does not follow the last one is a gap (messages lost at the
 * high-water mark, or the subscriber joined late): counted, the index goes on (it drops what it
 * cannot place, never invents). A number not above the last one is a publisher that started
 * again (a restarted backend, whose cache is empty): its blocks are forgotten first. ZMQ
 * reconnects by itself, so a backend that comes back is followed again.
 *
 * Bounds: a message is at most 16 MiB (ZMQ_MAXMSGSIZE: a larger one drops the connection) and
 * must have three frames; anything else is counted and dropped.
 *
 * Threading: one thread polls the sockets (100 ms at a time, so a stop is seen) and applies
 * batches under mu; tdm_kv_sub_match takes mu from the router's event-loop threads.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "server/server_int.h"

#define MAX_MSG  (16 << 20)
#define MAX_SUBS 64

enum { KE_FRAMES, KE_BAD, KE_GAP, KE_RESTART, KE_N };
static const char *const ke_names[KE_N] = {"frames", "malformed", "gap", "restart"};

struct tdm_kv_sub {
    void *zctx;
    void *sock[MAX_SUBS]; /* NULL: that backend publishes nothing */
    int n;
    pthread_t thread;
    bool running;
    atomic_bool stop;
    pthread_mutex_t mu; /* the index, seq */
    struct tdm_kv_index *x;
    uint64_t seq[MAX_SUBS];
    bool seen[MAX_SUBS];
    uint64_t batches[MAX_SUBS], errors[KE_N];
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One message from backend b: its frames read (all of them, whatever their number). */
static void take_message(struct tdm_kv_sub *s, int b)
{
    zmq_msg_t f[3], extra;
    int nf = 0, more = 1;
    bool over = false;
    while (more) {
        zmq_msg_t *m = nf < 3 ? &f[nf] : &extra;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, s->sock[b], ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(m);
            break;
        }
        more = zmq_msg_more(m);
        if (m == &extra) {
            zmq_msg_close(m);
            over = true;
        } else {
            nf++;
        }
    }
    pthread_mutex_lock(&s->mu);
    if (over || nf != 3 || zmq_msg_size(&f[1]) != 8) {
        s->errors[KE_FRAMES]++;
    } else {
        const uint8_t *q = zmq_msg_data(&f[1]);
        uint64_t seq = 0;
        for (int i = 0; i < 8; i++)
            seq = seq << 8 | q[i];
        if (s->seen[b] && seq <= s->seq[b]) { /* the publisher began again: an empty cache */
            s->errors[KE_RESTART]++;
            tdm_kv_index_forget(s->x, b);
        } else if (s->seen[b] && seq != s->seq[b] + 1) {
            s->errors[KE_GAP]++;
        }
        s->seen[b] = true;
        s->seq[b] = seq;
        if (tdm_kv_index_apply(s->x, b, zmq_msg_data(&f[2]), zmq_msg_size(&f[2])) != TDM_OK)
            s->errors[KE_BAD]++;
        s->batches[b]++;
    }
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < nf; i++)
        zmq_msg_close(&f[i]);
}

static void *sub_main(void *arg)
{
    struct tdm_kv_sub *s = arg;
    zmq_pollitem_t items[MAX_SUBS];
    int idx[MAX_SUBS], n = 0;
    for (int b = 0; b < s->n; b++)
        if (s->sock[b]) {
            items[n] = (zmq_pollitem_t){.socket = s->sock[b], .events = ZMQ_POLLIN};
            idx[n++] = b;
        }
    while (!atomic_load(&s->stop)) {
        int rc = zmq_poll(items, n, 100);
        if (rc <= 0) continue;
        for (int i = 0; i < n; i++)
            if (items[i].revents & ZMQ_POLLIN) take_message(s, idx[i]);
    }
    return NULL;
}

tdm_status tdm_kv_sub_start(const char *const *endpoints, int n, struct tdm_kv_sub **out)
{
    if (n <= 0 || n > MAX_SUBS)
        return tdm_err_set(TDM_ERANGE, "router: KV events of %d backends (1 to %d)", n, MAX_SUBS);
    struct tdm_kv_sub *s = calloc(1, sizeof *s);
    if (!s) return tdm_err_set(TDM_ENOMEM, "router: out of memory");
    pthread_mutex_init(&s->mu, NULL);
    s->n = n;
    tdm_status st = tdm_kv_index_new((size_t)1 << 20, &s->x);
    if (st != TDM_OK) goto fail;
    if (!(s->zctx = zmq_ctx_new())) {
        st = tdm_err_set(TDM_ENOMEM, "router: no ZMQ context: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    for (int b = 0; b < n; b++) {
        if (!endpoints[b] || !*endpoints[b]) continue;
        const int64_t max = MAX_MSG;
        const int linger = 0, hwm = 100000;
        if (!(s->sock[b] = zmq_socket(s->zctx, ZMQ_SUB)) ||
            zmq_setsockopt(s->sock[b], ZMQ_MAXMSGSIZE, &max, sizeof max) ||
            zmq_setsockopt(s->sock[b], ZMQ_LINGER, &linger, sizeof linger) ||
            zmq_setsockopt(s->sock[b], ZMQ_RCVHWM, &hwm, sizeof hwm) ||
            zmq_setsockopt(s->sock[b], ZMQ_SUBSCRIBE, "", 0) ||
            zmq_connect(s->sock[b], endpoints[b])) {
            st = tdm_err_set(TDM_EINVAL, "router: KV events of backend %d at '%s': %s", b + 1,
                             endpoints[b], zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    if (pthread_create(&s->thread, NULL, sub_main, s) != 0) {
        st = tdm_err_set(TDM_EIO, "router: cannot start the KV events thread");
        goto fail;
    }
    s->running = true;
    *out = s;
    return TDM_OK;
fail:
    tdm_kv_sub_stop(s);
    return st;
}

void tdm_kv_sub_stop(struct tdm_kv_sub *s)
{
    if (!s) return;
    atomic_store(&s->stop, true);
    if (s->running) pthread_join(s->thread, NULL);
    for (int b = 0; b < s->n; b++)
        if (s->sock[b]) zmq_close(s->sock[b]);
    if (s->zctx) zmq_ctx_term(s->zctx);
    tdm_kv_index_free(s->x);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int tdm_kv_sub_keys(struct tdm_kv_sub *s, const int32_t *ids, int n_ids, uint64_t *keys, int max)
{
    pthread_mutex_lock(&s->mu);
    int n = tdm_kv_index_keys(s->x, ids, n_ids, keys, max);
    pthread_mutex_unlock(&s->mu);
    return n;
}

void tdm_kv_sub_match(struct tdm_kv_sub *s, const uint64_t *keys, int n, int n_backends,
                      int *matched, double *share)
{
    const int64_t now = now_ms();
    pthread_mutex_lock(&s->mu);
    tdm_kv_index_expire(s->x, now);
    tdm_kv_index_match(s->x, keys, n, n_backends, matched, now);
    for (int b = 0; b < n_backends; b++)
        share[b] = tdm_kv_index_share(s->x, b, n_backends);
    pthread_mutex_unlock(&s->mu);
}

void tdm_kv_sub_pend(struct tdm_kv_sub *s, int b, const uint64_t *keys, int n, int delta)
{
    const int64_t now = now_ms();
    pthread_mutex_lock(&s->mu);
    tdm_kv_index_pend(s->x, b, keys, n, delta, now);
    pthread_mutex_unlock(&s->mu);
}

void tdm_kv_sub_metrics(struct tdm_kv_sub *s, struct tdm_sbuf *b, const char *const *labels)
{
    char lab[600];
    pthread_mutex_lock(&s->mu);
    struct tdm_kv_index_stats st = tdm_kv_index_stats(s->x);
    tdm_prom_family(b, "tandem_router_kv_event_batches_total", "counter",
                    "KV event batches received from each backend (--route kv).");
    for (int i = 0; i < s->n; i++) {
        snprintf(lab, sizeof lab, "backend=\"%s\"", labels[i]);
        tdm_prom_sample(b, "tandem_router_kv_event_batches_total", lab, (double)s->batches[i]);
    }
    tdm_prom_family(b, "tandem_router_kv_blocks", "gauge",
                    "Blocks each backend's prefix cache holds, as its KV events tell.");
    for (int i = 0; i < s->n; i++) {
        snprintf(lab, sizeof lab, "backend=\"%s\"", labels[i]);
        tdm_prom_sample(b, "tandem_router_kv_blocks", lab, (double)tdm_kv_index_held(s->x, i));
    }
    tdm_prom_family(b, "tandem_router_kv_event_errors_total", "counter",
                    "KV event messages dropped (frames, malformed), sequence gaps, publishers "
                    "that began again (restart), and blocks not indexed (orphan: an unknown "
                    "parent; block_size: not the first block size seen; full).");
    for (int k = 0; k < KE_N; k++) {
        snprintf(lab, sizeof lab, "kind=\"%s\"", ke_names[k]);
        tdm_prom_sample(b, "tandem_router_kv_event_errors_total", lab, (double)s->errors[k]);
    }
    tdm_prom_sample(b, "tandem_router_kv_event_errors_total", "kind=\"orphan\"",
                    (double)st.orphans);
    tdm_prom_sample(b, "tandem_router_kv_event_errors_total", "kind=\"block_size\"",
                    (double)st.refused);
    tdm_prom_sample(b, "tandem_router_kv_event_errors_total", "kind=\"full\"", (double)st.full);
    pthread_mutex_unlock(&s->mu);
}
