/*
 * The scheduler's private state, shared by its files:
 *   sched.c  creation, submission, the request API (any thread), metrics, the thread;
 *   plan.c   the plan: admission, chunking, preemption, drafts (scheduler thread);
 *   commit.c the commit: acceptance, rewind, publishing, finishing (scheduler thread);
 *   exec.c   the engine as an executor of plans;
 *   reader.c the reader side of the output: text and stop strings (a reader's thread).
 *
 * Locks, in the order they may nest: s->mu (waiting queue, running count, flags) is never held
 * while the scheduler takes a request's r->mu; s->mmu guards the metrics, and is held around a
 * prefix cache flush (so the pool's locks and a kv-events listener's nest inside it). Everything
 * marked "scheduler thread only" is touched by the thread that runs steps alone (the scheduler
 * thread, or the caller of tdm_sched_step before the thread starts), so a step runs without
 * locks.
 *
 * Invariants: a request is in exactly one of {waiting list, running array, neither
 * (finished)}; a waiting request holds no KV page; a finished request has released all of its
 * pages before its finish reason is published, so a reader that sees it finished sees the
 * pool without it (with overlap, the pages a launched step may still write are kept in use
 * until that step is collected). Drafted tokens exist only between a step's plan and its commit.
 */
#ifndef TANDEM_SCHED_INT_H
#define TANDEM_SCHED_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "tandem/sched.h"

/* tdm_req_remote_done's mailbox: written by any thread, read by the scheduler's land_remote */
enum { REMOTE_NONE, REMOTE_OK, REMOTE_FAILED };

struct tdm_req {
    _Atomic int refs;
    uint64_t id;
    atomic_bool cancel;
    atomic_bool stop; /* the cancel is a stop (tdm_req_stop): its reader matched a stop string */
    atomic_bool hung; /* failed by the watchdog: its client has its error, the scheduler drops it */

    /* immutable after submit */
    int n_prompt, max_tokens, min_tokens, top_k_lp; /* top_k_lp: -1 = no logprobs */
    bool ignore_eos, prefill_only, penalties;
    bool score;   /* prompt_logprobs: its prompt spans score every position */
    uint8_t want; /* tdm_row_want bits of its output rows */
    int32_t stop_ids[TDM_MAX_STOP_IDS];
    int n_stop_ids;
    int fixed_chunk, chunk_phase;
    int spec_k; /* as submitted: 0 the scheduler's cap, > 0 a lower cap, < 0 none */
    void *user;
    char kv_peer[TDM_REQ_KV_PEER_MAX]; /* params.kv_peer, "" for none */
    struct tdm_sched *sched;
    _Atomic int remote; /* REMOTE_* */
    /* tdm_req_remote_done_feed's mailbox, written before `remote` turns REMOTE_OK (so after
     * land_remote reads REMOTE_OK it is complete): the target's feature of the last prefilled
     * position ([d_model], reserved at submit with a feature drafter and a connector) and the
     * positions of the drafter's KV that landed. remote_fed says they were given. */
    float *remote_feature;
    int remote_drafter_kv;
    bool remote_fed;
    _Atomic int state; /* enum tdm_req_state; written by the scheduler thread only */

    /* scheduler thread only */
    int32_t *tokens; /* [tokens_cap]: prompt, outputs, then this step's drafts */
    int tokens_cap;  /* n_prompt + max_tokens, and a tree's worth more for a tree drafter */
    int n_tokens;    /* prompt + outputs (+ drafts) */
    int n_draft;     /* drafted tokens at the end of tokens (0 outside a step) */
    struct tdm_draft_stats draft_stats;
    void *dstate;         /* the drafter's state_bytes for it, or NULL */
    const float *draft_q; /* the drafter's q for this step's drafts (rejection), or NULL */
    /* this step's drafts are a token tree (a tree drafter's): draft j continues draft
     * tree_parent[j] (-1: the last committed token); tree_rejection: verified as point masses */
    bool tree, tree_rejection;
    int32_t tree_parent[TDM_TREE_MAX_NODES];
    int n_cached; /* tokens whose KV is in kv */
    struct tdm_kv_seq kv;
    struct tdm_sampler smp;
    /* structured output: its grammar (a reference) and the state after its committed
     * outputs; drafts never enter it (plan.c walks them from it for their rows' masks) */
    tdm_grammar_t *grammar;
    int32_t gstate;
    int batch_slot; /* index in this step's plan, or -1 */
    /* overlap (sched.h): its last token is TDM_TOKEN_PREV of the launched step (a placeholder
     * until that step's commit); gen counts its requeues, so that a launched step's commit
     * knows a span it planned from one whose pages and KV are gone */
    bool pending;
    uint32_t gen;
    int launches; /* launched plans that hold it and are not collected yet */
    bool counted; /* its prompt is in the prompt-token counter */
    int64_t t_last_ns;
    struct tdm_req *next; /* waiting list */
    /* a group's follower (tdm_sched_submit_group): its leader, referenced until this request
     * is freed. While the leader has not prefilled the prompt the follower is passed over at
     * admission; when it has, the follower takes the prompt's KV from it (plan.c) */
    struct tdm_req *leader;
    bool has_followers; /* a group's leader with followers (immutable after submit) */
    int prefix_pages;   /* its first pages offered to the prefix cache so far */

    /* output, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_out;
    float *logprobs;
    int32_t *top_ids;
    float *top_lps;
    /* prompt_logprobs: [n_prompt] and [n_prompt][p_top]; positions 1..n_scored are final */
    float *p_lps;
    int32_t *p_top_ids;
    float *p_top_lps;
    int p_top, n_scored;
    int stop_at;               /* the output that is an EOS or a stop id, or -1 */
    int cached_tokens;         /* prompt tokens its first admission found in the prefix cache */
    void (*notify)(void *ctx); /* cleared by tdm_req_release */
    void *notify_ctx;
    enum tdm_finish finish;
    tdm_status error;
    char error_msg[256];
    int64_t t_submit_ns, t_first_ns, t_end_ns;
    int n_preempted;
};

struct tdm_sched {
    struct tdm_sched_exec x; /* what runs plans, and its limits */
    const tdm_tok_t *tok;
    tdm_kv_pool_t *kv;
    struct tdm_sched_opts o;
    int vocab, max_ctx, page_size, max_rows;
    int64_t total_pages;
    int eos[TDM_MAX_EOS + 1];
    int n_eos;
    struct tdm_engine_exec *engine_exec; /* tdm_sched_create's executor, owned */

    pthread_mutex_t mu; /* everything below up to the scheduler-only part */
    pthread_cond_t cv_work, cv_idle;
    struct tdm_req *wait_head; /* FCFS by id */
    int n_waiting, n_running;
    bool accepting, stop, started;
    uint64_t next_id;
    pthread_t thread;

    /* scheduler thread only */
    struct tdm_req **running; /* [max_seqs], ascending id */
    struct tdm_sched_plan plan;
    struct tdm_plan_seq *pseqs;   /* [max_seqs] */
    int32_t *slots;               /* [max_batch_tokens] the plan's KV slots */
    uint8_t *want;                /* [max_rows] */
    struct tdm_sample_row *srows; /* [max_rows] */
    uint32_t *deny_all;           /* [mask words] zeros: a grammar row whose mask is lost */
    float *logits;                /* [max_rows][vocab], with row outputs */
    float *hidden;                /* [max_rows][d_model], with row outputs */
    bool row_outputs;             /* logits and hidden exist */
    const struct tdm_kv_connector_i *conn;
    void *conn_ctx;
    tdm_prefix_cache_t *prefix; /* tdm_sched_enable_prefix_cache, or NULL */
    atomic_bool flush_prefix;   /* tdm_sched_flush_prefix_cache asked (any thread) */
    const struct tdm_sched_drafter_i *drafter;
    void *drafter_ctx;
    int draft_k;
    struct tdm_sched_draft *drafts; /* [max_seqs] this step's drafting batch */
    struct tdm_req **decodes;       /* [max_seqs] this step's decoding requests */
    float *features;                /* [max_batch_tokens][feat_dim] with a feature drafter */
    int feat_dim;                   /* a token's features: the executor's width (x.feature_dim) */
    /* a tree drafter's plan scratch (tdm_sched_set_drafter): per plan sequence its tree, its
     * tokens' positions and masks ([max_seqs][1 + TDM_TREE_MAX_NODES]); per row its undo list
     * ([max_rows][TDM_TREE_MAX_NODES]) and candidates ([max_rows][TDM_SAMPLE_MAX_CAND]) */
    struct tdm_batch_tree *trees;
    int32_t *tree_pos, *tree_undo, *tree_cand;
    uint64_t *tree_mask;
    struct tdm_sched_feed *feeds; /* [max_seqs] */
    /* a drafter with launch (tdm_sched_drafter_i): the verified spans handed to it after a
     * run ([max_seqs]), their rows' tokens ([max_batch_tokens]), and whether its work may be
     * in flight (join before the pool's pages change hands) */
    struct tdm_sched_feed *launches;
    int32_t *launch_next;
    bool launched;
    uint64_t n_steps;
    /* overlap (sched.c): whether it is on, and the launched plan that is not committed yet
     * (fl, in the second set of plan buffers: pseqs2.. ; the plan is built in the first, and
     * the sets swap at each launch), its requests' gens when planned, and how many of its
     * requests' next tokens it cannot name (sched.h: those wait for its commit) */
    bool overlap, inflight;
    bool overlap_spans; /* TANDEM_SCHED_OVERLAP_SPANS=1: steps with spans of several tokens are
                         * launched ahead too (sched.c, step_overlap) */
    struct tdm_sched_plan fl;
    struct tdm_plan_seq *pseqs2;
    int32_t *slots2;
    uint8_t *want2;
    struct tdm_sample_row *srows2;
    uint32_t *pgen, *pgen2; /* [max_seqs] */
    int n_blocked;
    /* the page tables of requests that ended (or were requeued) while a launched plan holds
     * them, which it may still read and write: kept, pages in use, until the plan launched
     * last then is collected (kept_step, by entry; non-decreasing), so that no remote fill
     * lands in a page it writes. [kept_cap] */
    struct tdm_kv_seq *kept;
    uint64_t *kept_step;
    int n_kept, kept_cap;
    uint64_t launched_step; /* the step of the plan launched last */

    /* the watchdog (sched.c). wmu guards step_t0_ns, held and the stall flags; it nests
     * inside nothing and nothing nests inside it except a request's r->mu. */
    pthread_mutex_t wmu;
    pthread_cond_t wcv; /* the watchdog's sleep; signalled on stop */
    pthread_t wthread;
    bool wstarted, wstop;
    bool abandoned;        /* tdm_sched_stop gave up on a stalled thread */
    uint64_t step_t0_ns;   /* when the step in flight began; 0 between steps */
    struct tdm_req **held; /* [max_seqs] the running requests at the step's start (a ref each) */
    int n_held;
    bool step_failed;                /* the watchdog has failed this step's requests */
    _Atomic uint64_t stall_since_ns; /* step_t0_ns while stalled, else 0 */
    struct tdm_req **wsnap;          /* [max_waiting] the watchdog's copy of the waiting list */
    uint64_t fault_step;             /* TANDEM_SCHED_FAULTS: this step sleeps fault_ms first */
    int64_t fault_ms;

    pthread_mutex_t mmu;
    struct tdm_sched_metrics_snapshot m;
};

/* plan.c */
/* Builds the next step's plan in s->plan. With n_seqs 0 nothing can run now; the result is
 * then true when a preemption made room (plan again at once), false when only pages coming
 * back or new requests can help. */
bool tdm_sched_plan_build(struct tdm_sched *s);
/* Releases r's pages (tdm_kv_seq_release); with overlap, the page table of a request in a
 * launched plan is kept until that plan is collected (sched.c). r->kv is empty after. */
void tdm_sched_release_kv(struct tdm_sched *s, struct tdm_req *r);
/* Overlap: a launched plan's rows as the commit before its sampling left their requests (a
 * grammar's mask after the token that commit put in place). */
void tdm_sched_refresh_rows(struct tdm_sched *s, struct tdm_sched_plan *p);
/* Takes running[i] back to the waiting list with its pages released (preempted: counted). */
void tdm_sched_requeue(struct tdm_sched *s, int i, bool preempted);
void tdm_sched_running_remove(struct tdm_sched *s, int i);
int tdm_sched_running_index(struct tdm_sched *s, const struct tdm_req *r);
/* Drops cancelled requests (all of them with cancel_all). */
void tdm_sched_reap_cancelled(struct tdm_sched *s, bool cancel_all);
/* The commit of leader's last prompt span (its KV holds the prompt): its waiting followers
 * take the prompt's KV, while running slots and pages last (tdm_sched_submit_group). */
void tdm_sched_fork_followers(struct tdm_sched *s, struct tdm_req *leader);

/* Offers r's full pages whose KV is final ([0, n_cached)) to the prefix cache, if any. */
void tdm_sched_offer_prefix(struct tdm_sched *s, struct tdm_req *r);

/* commit.c */
/* Applies a run plan's results (st: the run's status) and publishes what came out. gens: the
 * requests' gens when planned (overlap: a span whose request was requeued or finished since is
 * skipped), or NULL. */
void tdm_sched_commit(struct tdm_sched *s, struct tdm_sched_plan *p, const uint32_t *gens,
                      tdm_status st);
/* Ends a request: the connector sees it while it still owns its pages, then they go back, then
 * the reason is published; drops the scheduler's reference. The caller has removed it from
 * the running array or the waiting list. */
void tdm_sched_finish(struct tdm_sched *s, struct tdm_req *r, enum tdm_finish why, tdm_status err,
                      const char *msg);
void tdm_sched_set_state(struct tdm_req *r, enum tdm_req_state st);

/* sched.c */
void tdm_sched_req_unref(struct tdm_req *r);
/* Wakes r's readers: its cv, and its notify hook. r->mu held. */
static inline void tdm_sched_req_news(struct tdm_req *r)
{
    pthread_cond_broadcast(&r->cv);
    if (r->notify) r->notify(r->notify_ctx);
}
/* Reserves the logit and hidden rows; false when out of memory. */
bool tdm_sched_row_outputs(struct tdm_sched *s);

/* exec.c */
struct tdm_engine_exec;
tdm_status tdm_sched_engine_exec_create(tdm_engine_t *e, int max_seqs, struct tdm_sched_exec *out,
                                        struct tdm_engine_exec **owned);
void tdm_sched_engine_exec_destroy(struct tdm_engine_exec *x);

/* What a drafter that reads features is handed of request r: positions [pos0, pos0 + n), their
 * features (feed's and launch's entries; launch adds next). */
static inline struct tdm_sched_feed tdm_sched_feed_of(struct tdm_req *r, int pos0, int n,
                                                      const float *features)
{
    return (struct tdm_sched_feed){.req = r,
                                   .tokens = r->tokens,
                                   .n_tokens = r->n_tokens,
                                   .pages = r->kv.pages,
                                   .n_pages = r->kv.n_pages,
                                   .stats = &r->draft_stats,
                                   .state = r->dstate,
                                   .pos0 = pos0,
                                   .n = n,
                                   .features = features};
}

#endif /* TANDEM_SCHED_INT_H */
