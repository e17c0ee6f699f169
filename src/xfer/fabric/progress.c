/*
 * The progress thread of the libfabric transport: the only reader of the CQ. Each turn reads
 * the CQ (completions, messages, immediates), posts what submitting threads left (sends, writes
 * the provider pushed back, drained immediates), fires done callbacks, and runs the timers
 * (deadlines, heartbeats, peer liveness, delayed immediates).
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

/* Idle policy. After a poll that found nothing while operations are in flight, the thread
 * yields (the posting threads and, on shared cores, the peer then run). Once nothing is in
 * flight:
 *   - where the CQ has a wait object (FI_WAIT_FD: tcp;ofi_rxm), the thread keeps polling for
 *     WAIT_SPIN_NS after the last traffic (a reply often follows at once), then sleeps in
 *     poll(2) on the CQ's descriptor and on an eventfd that submitters write (tdm_fab_wake),
 *     for at most one timer tick: WAIT_TICK_MS, or WAIT_DEEP_TICK_MS once idle for IDLE_DEEP_NS
 *     with nothing armed, delayed nor held (the fault layer's immediates). Bytes arriving for
 *     an armed counter wake it, so an incoming write needs no spinning target: the spin-waits
 *     of decoders whose counters waited on a prefill's compute were a third of the CPU time of
 *     the disaggregated tests (bench/RESULTS.md);
 *   - without one (shm in Debian's 1.17, or $TANDEM_XFER_WAIT=poll), it keeps polling
 *     (yielding the core between polls) for IDLE_SPIN_NS after the last traffic and while an
 *     immediate counter is armed (incoming RMA makes no completion on the target until its
 *     immediate, yet the provider needs the target's progress to move the bytes: paged writes
 *     of 64 pages of 1 MiB leave 20 ms and more between immediates, and polls 50 us apart
 *     capped the rate at about 1 GB/s), then polls every IDLE_SLEEP_NS, and every
 *     IDLE_DEEP_SLEEP_NS once idle for IDLE_DEEP_NS.
 * Heartbeats are not traffic, so an idle engine mostly sleeps. No fi_cq_sread: Debian's 1.17 shm
 * blocked in it past its timeout. With busy_poll the thread never yields nor sleeps (and the CQ
 * has no wait object): the lowest latency, a core for each engine. */
#define IDLE_SPIN_NS       20000000ull
#define IDLE_SLEEP_NS      50000
#define IDLE_DEEP_NS       200000000ull
#define IDLE_DEEP_SLEEP_NS 500000
#define WAIT_SPIN_NS       100000ull
#define WAIT_TICK_MS       1
#define WAIT_DEEP_TICK_MS  10

void tdm_fab_wake(tdm_xfer_t *x)
{
    /* pairs with the fence in wait_for_work: either that thread sees what was submitted
     * before it blocks, or this one sees it sleeping */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (x->wake_fd >= 0 && __atomic_load_n(&x->sleeping, __ATOMIC_SEQ_CST)) {
        uint64_t one = 1;
        if (write(x->wake_fd, &one, sizeof one) == sizeof one) STAT_ADD(x, progress_wakes, 1);
        /* else EAGAIN: the counter is already non-zero, a wake is pending */
    }
}

/* Sleeps until the CQ's descriptor or the wake eventfd is readable, or ms pass; returns at once
 * if a submission came in or the provider has something to progress (fi_trywait). */
static void wait_for_work(tdm_xfer_t *x, int ms)
{
    __atomic_store_n(&x->sleeping, 1, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    bool pending = x->stop || __atomic_load_n(&x->work, __ATOMIC_SEQ_CST) ||
                   __atomic_load_n(&x->active_head, __ATOMIC_SEQ_CST) >= 0 ||
                   __atomic_load_n(&x->backlog, __ATOMIC_SEQ_CST) || x->n_repost;
    struct fid *cq = &x->cq->fid;
    if (!pending && fi_trywait(x->fabric, &cq, 1) == FI_SUCCESS) {
        STAT_ADD(x, progress_sleeps, 1);
        struct pollfd p[2] = {{.fd = x->wait_fd, .events = POLLIN},
                              {.fd = x->wake_fd, .events = POLLIN}};
        if (poll(p, 2, ms) > 0 && (p[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(x->wake_fd, &v, sizeof v);
            (void)r;
        }
    }
    __atomic_store_n(&x->sleeping, 0, __ATOMIC_SEQ_CST);
}

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
        bool armed = tdm_xfer_counters_n_armed(x->counters) > 0;
        if (x->wait_fd >= 0) {
            if (now - last_activity < WAIT_SPIN_NS) {
                sched_yield();
                continue;
            }
            bool deep =
                now - last_activity > IDLE_DEEP_NS && !armed && !x->delay_count && !x->n_held;
            wait_for_work(x, deep ? WAIT_DEEP_TICK_MS : WAIT_TICK_MS);
            continue;
        }
        /* an armed counter waits for bytes that only our progress moves */
        if (now - last_activity < IDLE_SPIN_NS || armed) {
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
