/*
 * The libfabric transport: one RDM endpoint, its completion queue and address vector, and the
 * progress thread that drives them. Private to src/xfer/fabric/, laid out along its objects
 * (libfabric's own prov/<name>/src/ is the model):
 *   endpoint.c  the fabric, domain, endpoint, CQ and AV; create and destroy; memory regions;
 *   peer.c      peers: hello, liveness, death, heartbeats;
 *   rma.c       jobs and submission (paged writes, single writes, sends) and posting them;
 *   cq.c        completions, received messages and immediates (through the fault layer);
 *   progress.c  the progress thread and its timers;
 *   libfabric.c the library itself, opened with the first engine (not linked).
 *
 * Shape (issue 24). A write is posted by the thread that submits it: tdm_xfer_write_pages /
 * _write validate, take a job from a fixed pool, merge the pages into runs held in a
 * preallocated ring (no allocation per write), append the job to the active list and post its
 * runs right there, under tx_mu, when the domain is FI_THREAD_SAFE (every provider we open:
 * the hints ask for it; $TANDEM_XFER_POST=thread forces the hand-off). What the caller could
 * not post (the provider or the op pool pushed back, an earlier job still waits, the immediate
 * waits for its drain, an injected failure) stays on the active list and the progress thread
 * posts or fails it. Sends go through the same list; the progress thread posts them, since it
 * owns the message buffers. The progress thread reads the CQ without holding tx_mu, takes it
 * once per batch of transmit completions, and fires every done callback itself, outside the
 * lock: callbacks never run on a submitting thread, and they may submit. The bounded pools
 * (jobs, runs, ops) answer TDM_EAGAIN when full (counted in writes_refused); a provider's
 * -FI_EAGAIN is counted in eagain_retries and retried after progress.
 *
 * Locks. x->mu guards the peer table's slow state (hello, proof, death) and the cv that
 * tdm_xfer_peer_wait sleeps on. tx_mu guards the transmit side: jobs, the active list, the run
 * ring, the op pool, the fault layer's write sequence. They are never held together. Hot paths
 * take neither: a message from a proven peer finds it by `live_nonce` and refreshes its
 * `last_seen_ns` with atomics; an RMA immediate goes straight to the counters (whose table has
 * its own short mutex). Transmit completions take tx_mu once per batch read from the CQ.
 *
 * Idle policy: the progress thread yields after a poll that found nothing (the posting threads
 * and, on shared cores, the peer then run). Once nothing is in flight it blocks on the CQ's
 * descriptor and a wake eventfd where the provider gives one (tcp;ofi_rxm), and otherwise
 * keeps polling while traffic is recent or a counter is armed, then sleeps between polls
 * (progress.c); or it spins without ever yielding or sleeping (busy_poll, for latency-critical
 * deployments).
 *
 * A job's life (transitions under tx_mu; ACTIVE -> DONE by the poster, the completions, the
 * deadlines or a peer's death; the done callback fires on the progress thread):
 *
 *            submit (posts what it can)   all runs completed
 *   FREE ---------------------> ACTIVE --------------------> FREE   done(OK)
 *                                 |  deadline / peer death / completion error /
 *                                 |  injected failure / post error
 *                                 v
 *                               DONE (done(err) queued; fabric ops may still be in flight)
 *                                 |  callback fired and last in-flight op completes (or destroy)
 *                                 +----> FREE
 *
 * Ordering: an immediate never overtakes the data it vouches for. A write job posts its runs
 * concurrently; the run carrying the immediate goes last. We ask the provider for
 * FI_ORDER_WAW: when it grants it without a size limit (tcp;ofi_rxm, and shm once asked), the
 * immediate is posted right behind the other runs. Else, with FI_FENCE, the immediate run is
 * posted at once as a fenced write (the provider defers it until the earlier writes to that
 * peer completed). Else the runs are delivery-complete writes (when offered) and the immediate
 * run waits until they have completed (a drain per paged write; $TANDEM_XFER_ORDER=drain or
 * =fence forces a weaker mode, for tests). Either way an immediate means "all bytes of this
 * write landed" (DESIGN.md §4: the decoder counts immediates, never completion messages).
 *
 * Rails (src/xfer/rails.c). An engine may be one rail of a rail set: rail 0 is created with a
 * hook (tdm_xfer_create_hooked) that hears its peers come and go and their RAILS messages,
 * called on the progress thread before the configured on_peer; rails 1 .. n-1 are created with
 * rail 0's counter table (cfg.counters, borrowed): their RMA immediates land there, and they
 * neither fail those counters by their own peer indices (the set maps a rail's death to the
 * control peer) nor take IMM messages, nor destroy the table.
 *
 * Op contexts: every posted operation's context is an entry of `ops` (fixed pool, sized for the
 * configured window of paged writes and at least the provider's tx_attr->size, plus one per
 * preposted receive); an op outlives a timed-out job until the provider reports it, so a late
 * completion never touches freed memory.
 *
 * Peers: a peer entry is made by tdm_xfer_peer_add (we send hello) or by a hello from an unknown
 * sender (we insert its address and hello back). Every message carries the sender's random nonce,
 * which maps it to its entry; a message from a known peer refreshes last_seen (what we sent
 * completing proves nothing: a stopped process's kernel still takes its TCP bytes). A dead
 * entry comes back in place when its address is added again or says hello again: a fresh
 * handshake, the same index.
 *
 * With a fabric key, a peer's life:
 *
 *   add / its hello --> HELLOED --(its AUTH proves the key)--> KNOWN --> ... --> DEAD
 *                         |  (our hello, with its challenge, is resent every heartbeat;
 *                         |   every hello from it is answered with our AUTH)
 *                         +--(bad proof: counted, ignored; silence: DEAD after peer_timeout)
 *
 *   from     to      where                      when
 *   -        HELLOED peer_add / handle_message  we add it, or its hello arrives (nonce bound)
 *   HELLOED  KNOWN   handle_message (AUTH)      HMAC(key, label|our challenge|its nonce|ours)
 *   HELLOED  DEAD    progress timers            nothing proven for peer_timeout_ms
 * Messages other than HELLO and AUTH, and immediates, from a peer that is not KNOWN are
 * dropped before they are read. Without a key a hello makes it KNOWN at once.
 */
#ifndef TANDEM_XFER_FABRIC_INT_H
#define TANDEM_XFER_FABRIC_INT_H

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include "xfer/xfer_int.h"

#define ADDR_RAW_MAX    256
#define N_TX_BUFS       64
#define REORDER_HOLD_NS (20ull * 1000000ull) /* a held immediate is released after 20 ms */
#define DELAY_RING      65536
#define HELD_MAX        64
#define HELLO_GAP_NS    (100ull * 1000000ull) /* answers to hellos are this far apart */

enum job_state { JOB_FREE = 0, JOB_ACTIVE, JOB_DONE };
enum order_mode { ORDER_WAW = 0, ORDER_FENCE, ORDER_DRAIN };
enum job_kind { JOB_WRITE = 0, JOB_SEND };
enum op_kind { OP_FREE = 0, OP_WRITE, OP_SEND, OP_HEARTBEAT, OP_RECV };

struct job {
    enum job_state state;
    enum job_kind kind;
    uint32_t peer;
    uint64_t deadline_ns;
    tdm_xfer_done_fn done;
    void *ctx;
    int next; /* free list or active list link; -1 ends */
    /* write */
    tdm_xfer_mr_t *src;
    struct tdm_xfer_rmem dst;
    struct tdm_xfer_run *runs; /* [n_runs] inside x->runs (the ring); NULL once released */
    uint32_t ring_entry;       /* its entry in x->run_segs */
    uint32_t n_runs, next_run, ops_in_flight;
    bool has_imm;
    bool firing;  /* its callback is queued in x->fireq: not released before it fired */
    int post_err; /* a post by the submitting thread failed (-FI_*): the progress thread fails it */
    uint64_t imm_data;
    /* send: the whole message, header included */
    uint8_t *msg;
    size_t msg_bytes;
};

struct op {
    struct fi_context2 fctx; /* first: the provider hands &fctx back */
    enum op_kind kind;
    int job;
    uint32_t peer;
    int buf; /* tx or rx buffer index */
};

struct peer {
    bool used, dead, known; /* known: its hello arrived (nonce bound) and, with a key, its proof */
    bool hello_sent;
    bool nonce_set;         /* its hello arrived: `nonce` is its own */
    uint64_t last_hello_ns; /* when we last answered its hello */
    bool gone;              /* dead by a completion error or its goodbye (see tdm_xfer_peer_gone) */
    bool auth_warned;       /* a bad proof was logged once */
    uint8_t my_chal[TDM_XFER_CHALLENGE];    /* the challenge our hellos to it carry */
    uint8_t their_chal[TDM_XFER_CHALLENGE]; /* the one its hello carried */
    fi_addr_t fi;
    uint8_t addr[ADDR_RAW_MAX];
    size_t addr_bytes;
    uint64_t nonce;
    uint64_t last_seen_ns; /* atomic: refreshed without x->mu by handle_message */
    uint64_t last_hb_ns;
    uint64_t live_nonce; /* atomic: its nonce while known and alive, else 0 (set under x->mu) */
};

/* A queued done callback (progress thread). */
struct firing {
    tdm_xfer_done_fn done;
    void *ctx;
    tdm_status st;
    char msg[200];
};

struct held_imm {
    uint64_t data;
    uint64_t since_ns;
    uint32_t peer; /* the sender, or TDM_XFER_ANY_PEER */
};

struct tdm_xfer {
    struct tdm_xfer_config cfg;
    char provider_name[64];
    char node[64];
    struct tdm_xfer_faults faults;
    struct tdm_xfer_caps caps;
    uint64_t nonce;
    uint8_t key[256]; /* the fabric key; key_bytes 0: none */
    size_t key_bytes;

    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_ep *ep;
    uint8_t my_addr[ADDR_RAW_MAX];
    size_t my_addr_bytes;

    /* message buffers: [n_tx + n_rx][buf_bytes], one registered region */
    uint8_t *bufs;
    size_t buf_bytes;
    struct fid_mr *bufs_mr;
    void *bufs_desc;
    int tx_free[N_TX_BUFS];
    int n_tx_free;

    struct op *ops; /* [n_ops]: n_tx_ops transmit ops then ctrl_rx_depth receive ops */
    int n_ops, n_tx_ops;
    int *op_free; /* stack of free transmit op indices (tx_mu) */
    int n_op_free;
    int *repost; /* receive ops whose fi_recv met -FI_EAGAIN */
    int n_repost;

    pthread_mutex_t mu; /* guards the peers' slow state (see the top of this file) */
    pthread_cond_t cv;  /* peer state changes */
    struct peer *peers; /* [max_peers] */
    uint32_t n_peers;   /* written under mu, read atomically */
    uint64_t next_key;

    /* the transmit side, under tx_mu */
    pthread_mutex_t tx_mu;
    struct job *jobs; /* [max_jobs] */
    int job_free;     /* free list head */
    int active_head, active_tail;
    /* runs of the jobs still posting: [run_cap] ring, allocated at run_head, freed in
     * allocation order through run_segs ([n_segs] ends of segments, oldest at seg_tail) */
    struct tdm_xfer_run *runs;
    uint64_t run_cap, run_head, run_tail;
    struct {
        uint64_t end;
        bool held;
    } * run_segs;
    uint32_t n_segs, seg_head, seg_tail;
    bool backlog;      /* a job has runs the progress thread must post first (FIFO) */
    bool caller_posts; /* FI_THREAD_SAFE: submitting threads post their own writes */
    bool work; /* atomic: a submission or an end since the last reap (the progress thread takes
                  tx_mu only when there is something to do) */
    struct firing *fireq; /* [max_jobs] callbacks to fire, outside tx_mu */
    int n_fireq;
    struct firing *firing_now; /* [max_jobs] the progress thread's copy while firing */

    tdm_xfer_counters_t *counters;
    bool counters_borrowed; /* cfg.counters: another engine's (a rail's), never failed by our
                               peer indices nor destroyed here */
    struct tdm_xfer_rail_hook hook; /* a rail set's, on its control engine; zeroed otherwise */
    char domain_name[64];           /* cfg.domain's copy */
    struct tdm_xfer_stats stats;    /* updated with atomics */

    /* fault injection state (progress thread only) */
    uint64_t imm_seq, write_seq;
    struct {
        uint64_t release_ns, data;
        uint32_t peer;
    } * delay_ring;
    uint32_t delay_head, delay_count;
    struct held_imm held[HELD_MAX];
    int n_held;

    bool ordered_writes;   /* the provider places write data in posting order */
    enum order_mode order; /* how an immediate is kept behind its data */
    bool traffic;          /* a completion other than a heartbeat's since the last poll */
    bool pushed_back;      /* the provider or the op pool refused a post: wait for completions
                              (tx_mu) */
    int pushed_back_polls; /* polls since, bounded so a push-back can never stall posting */

    /* the progress thread's sleep (progress.c): the CQ's wait object where the provider gives
     * one (FI_WAIT_FD), else -1; an eventfd that a submitter writes while `sleeping` says the
     * thread is, or is about to be, blocked in poll (atomics, sequentially consistent) */
    int wait_fd, wake_fd;
    int sleeping;

    pthread_t thread;
    bool thread_started;
    bool shm_counted; /* one of the process's live shm engines (endpoint.c: close_or_park) */
    volatile int stop;
};

struct tdm_xfer_mr {
    tdm_xfer_t *x;
    struct fid_mr *mr;
    void *base;
    size_t bytes;
    enum tdm_xfer_mem_kind kind;
    uint64_t key;
    void *desc;
};

#define STAT_ADD(x, field, n) __atomic_fetch_add(&(x)->stats.field, (n), __ATOMIC_RELAXED)

/* Writes and user sends leave OPS_RESERVED ops free, so heartbeats are never starved by a full
 * pipeline of writes (a starved heartbeat would make the peer declare us dead). */
#define OPS_RESERVED 4

/* The five exported libfabric functions tandem calls, from the library opened with the first
 * engine (libfabric.c says why it is not linked); their types are the header's. */
struct tdm_fi_api {
    __typeof__(&fi_getinfo) getinfo;
    __typeof__(&fi_freeinfo) freeinfo;
    __typeof__(&fi_dupinfo) dupinfo;
    __typeof__(&fi_fabric) fabric;
    __typeof__(&fi_strerror) strerror;
};
/* The table, opening the library on the first call; NULL (tdm_err set) where it cannot. */
const struct tdm_fi_api *tdm_fi_api(void);
/* fi_strerror of rc (either sign), or a fixed text before the library is open. */
const char *tdm_fi_strerror(int rc);

static inline const char *fi_msg(int rc)
{
    return tdm_fi_strerror(rc);
}

/* ---- shared between the files of the transport (progress thread unless marked) ---- */
/* Ends job j with st and the thread's current message (tx_mu held); its callback is queued
 * and fired by tdm_fab_fire_queued. */
void tdm_fab_job_finish(tdm_xfer_t *x, int j, tdm_status st);
/* Fires the queued done callbacks (progress thread or destroy; tx_mu not held). */
void tdm_fab_fire_queued(tdm_xfer_t *x);
/* Publishes a peer's live_nonce from its state (mu held). */
void tdm_fab_peer_publish(struct peer *p);
/* gone: the connection failed (a completion error, a goodbye), not just silence */
void tdm_fab_peer_declare_dead(tdm_xfer_t *x, uint32_t p, const char *why, bool gone);
tdm_status tdm_fab_peer_find_or_insert_locked(tdm_xfer_t *x, const uint8_t *raw, size_t n,
                                              uint32_t *out, bool *inserted);
tdm_status tdm_fab_send_typed(tdm_xfer_t *x, uint32_t peer, uint8_t type, const void *payload,
                              size_t bytes, int timeout_ms, tdm_xfer_done_fn done, void *ctx);
void tdm_fab_send_hello(tdm_xfer_t *x, uint32_t peer);
/* Our proof for `peer` (its challenge, both nonces); x->key set, mu held or the peer stable. */
void tdm_fab_proof(const tdm_xfer_t *x, const uint8_t chal[TDM_XFER_CHALLENGE], uint64_t from,
                   uint64_t to, uint8_t out[TDM_XFER_PROOF]);
void tdm_fab_send_auth(tdm_xfer_t *x, uint32_t peer);
void tdm_fab_fault_timers(tdm_xfer_t *x, uint64_t now);
int tdm_fab_op_get(tdm_xfer_t *x, int reserve); /* tx_mu held, as op_put */
void tdm_fab_op_put(tdm_xfer_t *x, int o);
tdm_status tdm_fab_post_recv(tdm_xfer_t *x, int o);
/* progressed: something completed since the last call (ends a push-back). */
void tdm_fab_reap_and_post(tdm_xfer_t *x, bool progressed);
/* Wakes the progress thread if it sleeps on the CQ's wait object: after a submission. Any
 * thread. */
void tdm_fab_wake(tdm_xfer_t *x);
/* A transmit op's completion (tx_mu held; a send's buffer already returned). */
void tdm_fab_tx_done(tdm_xfer_t *x, struct op *op);
bool tdm_fab_send_heartbeat(tdm_xfer_t *x, uint32_t peer);
bool tdm_fab_handle_cq_result(tdm_xfer_t *x, const struct fi_cq_data_entry *e, ssize_t n);
void *tdm_fab_progress_main(void *arg);

#endif /* TANDEM_XFER_FABRIC_INT_H */
