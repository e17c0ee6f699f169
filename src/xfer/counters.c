/*
 * Immediate counters: "when N distinct immediates for (slot, epoch) have landed, call back".
 *
 * A slot's life:
 *
 *            arm(slot, epoch, N)        deliver: N-th distinct index
 *   IDLE ------------------------> ARMED ----------------------------> IDLE  fn(TDM_OK)
 *     ^                              |  expire / fail_peer / cancel / destroy
 *     +------------------------------+  fn(TDM_ETIMEDOUT | TDM_EPEER | TDM_ECANCELED)
 *
 *   | transition            | function                         |
 *   |-----------------------|----------------------------------|
 *   | IDLE -> ARMED         | tdm_xfer_counters_arm            |
 *   | ARMED -> IDLE (ok)    | tdm_xfer_counters_deliver        |
 *   | ARMED -> IDLE (error) | _expire, _fail_peer, _cancel, _destroy |
 *
 * Every transition out of ARMED happens under the table's mutex, so the callback runs exactly
 * once; it is called after the mutex is released (a callback may arm or cancel). Immediates are
 * idempotent: each armed slot keeps a bitmap of the indices already counted, so a duplicate does
 * not advance the count. An immediate for an IDLE slot, or for another epoch, is stale (a late
 * write of an abandoned transfer) and ignored; one from another peer than the counter's (when
 * the sender is known) is counted as wrong_peer and ignored. Memory: the bitmap is allocated at
 * arm, sized by `expected`, which is capped by max_expected.
 */
#include <stdlib.h>
#include <string.h>

#include "xfer/xfer_int.h"

struct counter {
    bool armed;
    uint32_t epoch;
    uint32_t expected;
    uint32_t count;
    uint32_t peer;
    uint64_t deadline_ns;
    uint64_t *seen; /* [ceil(expected / 64)] bitmap of counted indices */
    tdm_xfer_counter_fn fn;
    void *ctx;
};

struct tdm_xfer_counters {
    pthread_mutex_t mu;
    uint32_t n_slots;
    uint32_t max_expected;
    uint32_t n_armed;
    struct counter *slots; /* [n_slots] */
    struct tdm_xfer_counter_stats stats;
};

struct firing {
    tdm_xfer_counter_fn fn;
    void *ctx;
    uint32_t slot, epoch;
    tdm_status st;
};

tdm_status tdm_xfer_counters_create(uint32_t n_slots, uint32_t max_expected,
                                    tdm_xfer_counters_t **out)
{
    if (n_slots == 0 || n_slots > (1u << 24) || max_expected == 0 || max_expected > (1u << 24))
        return tdm_err_set(TDM_EINVAL, "xfer counters: %u slots, %u expected", n_slots,
                           max_expected);
    tdm_xfer_counters_t *c = calloc(1, sizeof(*c));
    if (!c) return tdm_err_set(TDM_ENOMEM, "xfer counters: out of memory");
    c->slots = calloc(n_slots, sizeof(*c->slots));
    if (!c->slots) {
        free(c);
        return tdm_err_set(TDM_ENOMEM, "xfer counters: out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    c->n_slots = n_slots;
    c->max_expected = max_expected;
    *out = c;
    return TDM_OK;
}

/* Disarms slot s (under the mutex) and records its callback in *f. */
static void disarm(tdm_xfer_counters_t *c, uint32_t s, tdm_status st, struct firing *f)
{
    struct counter *k = &c->slots[s];
    *f = (struct firing){k->fn, k->ctx, s, k->epoch, st};
    free(k->seen);
    memset(k, 0, sizeof(*k));
    c->n_armed--;
    if (st == TDM_OK)
        c->stats.fired_ok++;
    else
        c->stats.fired_error++;
}

static void fire(const struct firing *f, int n)
{
    for (int i = 0; i < n; i++) {
        if (f[i].st == TDM_ETIMEDOUT)
            tdm_err_set(f[i].st, "xfer: counter for slot %u epoch %u timed out", f[i].slot,
                        f[i].epoch);
        else if (f[i].st == TDM_EPEER)
            tdm_err_set(f[i].st, "xfer: peer of slot %u epoch %u died", f[i].slot, f[i].epoch);
        else if (f[i].st == TDM_ECANCELED)
            tdm_err_set(f[i].st, "xfer: counter for slot %u epoch %u cancelled", f[i].slot,
                        f[i].epoch);
        if (f[i].fn) f[i].fn(f[i].ctx, f[i].slot, f[i].epoch, f[i].st);
    }
}

/* Disarms every armed slot matching pred, firing in batches outside the mutex. */
/* What an expiring counter was still waiting for, and the table's ignored immediates so far:
 * enough to tell a write that never came from one that came for another epoch or slot. c->mu
 * held. */
static void expired_note(const tdm_xfer_counters_t *c, uint32_t s)
{
    const struct counter *k = &c->slots[s];
    uint32_t first = k->expected, n_missing = 0;
    for (uint32_t i = 0; i < k->expected; i++)
        if (!(k->seen[i / 64] >> (i % 64) & 1)) {
            if (first == k->expected) first = i;
            n_missing++;
        }
    TDM_WARN("xfer counters: slot %u epoch %u expired with %u of %u immediates (%u missing, the "
             "first index %u); ignored so far: %llu stale, %llu duplicate, %llu from another "
             "peer, %llu invalid",
             s, k->epoch, k->count, k->expected, n_missing, first,
             (unsigned long long)c->stats.stale, (unsigned long long)c->stats.duplicate,
             (unsigned long long)c->stats.wrong_peer, (unsigned long long)c->stats.invalid);
}

static int disarm_where(tdm_xfer_counters_t *c, bool (*pred)(const struct counter *, uint64_t),
                        uint64_t arg, tdm_status st)
{
    int total = 0;
    uint32_t s = 0;
    for (;;) {
        struct firing batch[32];
        int n = 0;
        pthread_mutex_lock(&c->mu);
        for (; s < c->n_slots && n < (int)TDM_ARRAY_LEN(batch) && c->n_armed > 0; s++)
            if (c->slots[s].armed && pred(&c->slots[s], arg)) {
                if (st == TDM_ETIMEDOUT) expired_note(c, s);
                disarm(c, s, st, &batch[n++]);
            }
        bool more = s < c->n_slots && c->n_armed > 0;
        pthread_mutex_unlock(&c->mu);
        fire(batch, n);
        total += n;
        if (!more) return total;
    }
}

static bool pred_all(const struct counter *k, uint64_t arg)
{
    return true;
}

void tdm_xfer_counters_destroy(tdm_xfer_counters_t *c)
{
    if (!c) return;
    disarm_where(c, pred_all, 0, TDM_ECANCELED);
    pthread_mutex_destroy(&c->mu);
    free(c->slots);
    free(c);
}

tdm_status tdm_xfer_counters_arm(tdm_xfer_counters_t *c, uint32_t slot, uint32_t epoch,
                                 uint32_t expected, uint32_t peer, int timeout_ms,
                                 tdm_xfer_counter_fn fn, void *ctx)
{
    if (slot >= c->n_slots)
        return tdm_err_set(TDM_ERANGE, "xfer counters: slot %u >= %u", slot, c->n_slots);
    if (expected == 0 || expected > c->max_expected)
        return tdm_err_set(TDM_ERANGE, "xfer counters: expected %u (cap %u)", expected,
                           c->max_expected);
    if (timeout_ms <= 0) /* nothing may wait forever */
        return tdm_err_set(TDM_EINVAL, "xfer counters: a counter needs a timeout (got %d ms)",
                           timeout_ms);
    uint64_t *seen = calloc((expected + 63) / 64, sizeof(uint64_t));
    if (!seen) return tdm_err_set(TDM_ENOMEM, "xfer counters: out of memory");
    pthread_mutex_lock(&c->mu);
    struct counter *k = &c->slots[slot];
    if (k->armed) {
        pthread_mutex_unlock(&c->mu);
        free(seen);
        return tdm_err_set(TDM_EINVAL, "xfer counters: slot %u is already armed", slot);
    }
    *k = (struct counter){.armed = true,
                          .epoch = epoch,
                          .expected = expected,
                          .peer = peer,
                          .deadline_ns =
                              timeout_ms ? tdm_now_ns() + (uint64_t)timeout_ms * 1000000u : 0,
                          .seen = seen,
                          .fn = fn,
                          .ctx = ctx};
    c->n_armed++;
    pthread_mutex_unlock(&c->mu);
    return TDM_OK;
}

tdm_status tdm_xfer_counters_cancel(tdm_xfer_counters_t *c, uint32_t slot, uint32_t epoch)
{
    struct firing f;
    pthread_mutex_lock(&c->mu);
    bool hit = slot < c->n_slots && c->slots[slot].armed && c->slots[slot].epoch == epoch;
    if (hit) disarm(c, slot, TDM_ECANCELED, &f);
    pthread_mutex_unlock(&c->mu);
    if (!hit)
        return tdm_err_set(TDM_ENOTFOUND, "xfer counters: slot %u epoch %u is not armed", slot,
                           epoch);
    fire(&f, 1);
    return TDM_OK;
}

void tdm_xfer_counters_deliver(tdm_xfer_counters_t *c, const struct tdm_xfer_imm *imm)
{
    tdm_xfer_counters_deliver_from(c, imm, TDM_XFER_ANY_PEER);
}

void tdm_xfer_counters_deliver_from(tdm_xfer_counters_t *c, const struct tdm_xfer_imm *imm,
                                    uint32_t peer)
{
    struct firing f;
    bool done = false;
    pthread_mutex_lock(&c->mu);
    c->stats.delivered++;
    if (imm->slot >= c->n_slots) {
        c->stats.invalid++;
    } else {
        struct counter *k = &c->slots[imm->slot];
        if (!k->armed || k->epoch != imm->epoch) {
            c->stats.stale++;
        } else if (k->peer != TDM_XFER_ANY_PEER && peer != TDM_XFER_ANY_PEER && peer != k->peer) {
            c->stats.wrong_peer++;
        } else if (imm->index >= k->expected) {
            c->stats.invalid++;
        } else if (k->seen[imm->index / 64] >> (imm->index % 64) & 1) {
            c->stats.duplicate++;
        } else {
            k->seen[imm->index / 64] |= 1ull << (imm->index % 64);
            c->stats.counted++;
            if (++k->count == k->expected) {
                disarm(c, imm->slot, TDM_OK, &f);
                done = true;
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (done) fire(&f, 1);
}

static bool pred_expired(const struct counter *k, uint64_t now)
{
    return k->deadline_ns <= now;
}

int tdm_xfer_counters_expire(tdm_xfer_counters_t *c, uint64_t now_ns)
{
    return disarm_where(c, pred_expired, now_ns, TDM_ETIMEDOUT);
}

static bool pred_peer(const struct counter *k, uint64_t peer)
{
    return k->peer == (uint32_t)peer;
}

int tdm_xfer_counters_fail_peer(tdm_xfer_counters_t *c, uint32_t peer, tdm_status st)
{
    if (peer == TDM_XFER_ANY_PEER) return 0;
    return disarm_where(c, pred_peer, peer, st);
}

uint32_t tdm_xfer_counters_n_armed(tdm_xfer_counters_t *c)
{
    return __atomic_load_n(&c->n_armed, __ATOMIC_RELAXED);
}

void tdm_xfer_counters_get_stats(tdm_xfer_counters_t *c, struct tdm_xfer_counter_stats *out)
{
    pthread_mutex_lock(&c->mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->mu);
}
