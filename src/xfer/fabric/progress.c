/*
 * The progress thread of the libfabric transport: the only reader of the CQ. Each turn reads
 * the CQ (completions, messages, immediates), posts what submitting threads left (sends, writes
 * the provider pushed back, drained immediates), fires done callbacks, and runs the timers
 * (deadlines, heartbeats, peer liveness, delayed immediates).
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

/* Idle policy: keep polling (yielding the core between polls) for IDLE_SPIN_NS after the last
 * traffic, and while an immediate counter is armed (incoming RMA makes no completion on the
 * target until its immediate, yet tcp;ofi_rxm and shm need the target's progress to move the
 * bytes: paged writes of 64 pages of 1 MiB leave 20 ms and more between immediates, and polls
 * 50 us apart capped the rate at about 1 GB/s), then poll every IDLE_SLEEP_NS, and
 * every IDLE_DEEP_SLEEP_NS once idle for IDLE_DEEP_NS (an idle server costs little CPU).
 * Heartbeats are not traffic, so an idle engine mostly sleeps. No fi_cq_sread: Debian's 1.17 shm
 * blocked in it past its timeout. With busy_poll the thread never yields nor sleeps: the lowest
 * latency, a core for each engine. */
#define IDLE_SPIN_NS       20000000ull
#define IDLE_SLEEP_NS      50000
#define IDLE_DEEP_NS       200000000ull
#define IDLE_DEEP_SLEEP_NS 500000

static void timers(tdm_xfer_t *x, uint64_t now)
{
    pthread_mutex_lock(&x->tx_mu);
    for (int j = x->active_head; j >= 0; j = x->jobs[j].next) {
        struct job *jb = &x->jobs[j];
        if (jb->state == JOB_ACTIVE && jb->deadline_ns <= now) {
            STAT_ADD(x, ops_timed_out, 1);
            tdm_err_set(TDM_ETIMEDOUT,
                        "xfer: operation to peer %u timed out (%u of %u runs "
                        "posted, %u in flight)",
                        jb->peer, jb->next_run, jb->n_runs, jb->ops_in_flight);
            tdm_fab_job_finish(x, j, TDM_ETIMEDOUT);
        }
    }
    pthread_mutex_unlock(&x->tx_mu);
    tdm_fab_fire_queued(x);
    tdm_xfer_counters_expire(x->counters, now);
    uint64_t hb_ns = (uint64_t)x->cfg.heartbeat_ms * 1000000ull;
    uint64_t dead_ns = (uint64_t)x->cfg.peer_timeout_ms * 1000000ull;
    for (uint32_t i = 0;; i++) {
        pthread_mutex_lock(&x->mu);
        if (i >= x->n_peers) {
            pthread_mutex_unlock(&x->mu);
            break;
        }
        struct peer p = x->peers[i];
        pthread_mutex_unlock(&x->mu);
        if (p.dead) continue;
        uint64_t seen = __atomic_load_n(&x->peers[i].last_seen_ns, __ATOMIC_RELAXED);
        if (dead_ns && now > seen && now - seen > dead_ns) {
            char why[96];
            snprintf(why, sizeof(why), "nothing heard for %d ms", x->cfg.peer_timeout_ms);
            tdm_fab_peer_declare_dead(x, i, why, false);
            continue;
        }
        if (hb_ns && p.known && now - p.last_hb_ns >= hb_ns && tdm_fab_send_heartbeat(x, i)) {
            pthread_mutex_lock(&x->mu);
            x->peers[i].last_hb_ns = now;
            pthread_mutex_unlock(&x->mu);
        }
        /* not known yet: our hello again, each heartbeat period (the first, its answer or the
         * proof it brought back may have been lost, or the peer is stopped and comes back) */
        if (!p.known && p.hello_sent && now - p.last_hb_ns >= (hb_ns ? hb_ns : 200000000ull)) {
            pthread_mutex_lock(&x->mu);
            x->peers[i].last_hb_ns = now;
            pthread_mutex_unlock(&x->mu);
            tdm_fab_send_hello(x, i);
        }
    }
    tdm_fab_fault_timers(x, now);
}

void *tdm_fab_progress_main(void *arg)
{
    tdm_xfer_t *x = arg;
    const bool busy_poll = x->cfg.busy_poll;
    uint64_t last_timer = 0, last_activity = tdm_now_ns();
    while (!x->stop) {
        if (x->n_repost) {
            int n = x->n_repost;
            x->n_repost = 0;
            for (int i = 0; i < n; i++)
                if (tdm_fab_post_recv(x, x->repost[i]) != TDM_OK)
                    TDM_ERROR("xfer: %s", tdm_err_msg());
        }
        struct fi_cq_data_entry e[32];
        bool busy = tdm_fab_handle_cq_result(x, e, fi_cq_read(x->cq, e, TDM_ARRAY_LEN(e)));
        tdm_fab_reap_and_post(x, busy);
        /* after a push-back (-FI_EAGAIN or no free op), posting resumes once something
         * completed; yield meanwhile so the peer's progress (often on the same cores) drains */
        if (__atomic_load_n(&x->pushed_back, __ATOMIC_RELAXED) && !busy && !busy_poll)
            sched_yield();
        uint64_t now = tdm_now_ns();
        if (now - last_timer >= 1000000ull) {
            timers(x, now);
            last_timer = now;
        }
        if (x->traffic || __atomic_load_n(&x->active_head, __ATOMIC_RELAXED) >= 0) {
            /* operations in flight but nothing completed: let the posting threads (and, on
             * shared cores, the peer) run rather than contend for the provider's lock */
            if (!busy && !x->traffic && !busy_poll) sched_yield();
            x->traffic = false;
            last_activity = now;
            continue;
        }
        if (busy_poll) continue;
        /* an armed counter waits for bytes that only our progress moves */
        if (now - last_activity < IDLE_SPIN_NS || tdm_xfer_counters_n_armed(x->counters)) {
            sched_yield(); /* spin, but let the kernel's network work and the peer run */
            continue;
        }
        struct timespec ts = {0, now - last_activity > IDLE_DEEP_NS ? IDLE_DEEP_SLEEP_NS
                                                                    : IDLE_SLEEP_NS};
        nanosleep(&ts, NULL);
    }
    /* tell live peers we are leaving, so they need not wait for the liveness timeout */
    uint8_t bye[TDM_XFER_WIRE_HDR];
    tdm_xfer_wire_put_hdr(bye, TDM_XFER_MSG_BYE, x->nonce, 0);
    struct fi_cq_data_entry drain[16];
    for (uint32_t i = 0; i < x->n_peers; i++)
        if (!x->peers[i].dead && x->peers[i].known)
            for (int tries = 0; tries < 100; tries++) {
                ssize_t rc = fi_inject(x->ep, bye, sizeof(bye), x->peers[i].fi);
                if (rc != -FI_EAGAIN) break;
                fi_cq_read(x->cq, drain, TDM_ARRAY_LEN(drain));
            }
    /* a few rounds of progress push the goodbyes out; completions now are discarded */
    uint64_t until = tdm_now_ns() + 20000000ull;
    while (tdm_now_ns() < until) {
        ssize_t n = fi_cq_read(x->cq, drain, TDM_ARRAY_LEN(drain));
        if (n == -FI_EAVAIL) {
            struct fi_cq_err_entry err;
            memset(&err, 0, sizeof(err));
            fi_cq_readerr(x->cq, &err, 0);
        }
        if (n <= 0) {
            struct timespec ts = {0, 500000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}
