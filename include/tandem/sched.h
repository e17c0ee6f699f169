/*
 * tandem sched: continuous batching over one executor (the engine), on a thread of its own.
 *
 * Requests come in through tdm_sched_submit from any thread (the HTTP threads), into a bounded
 * waiting queue. The scheduler thread runs steps, and each step has three parts:
 *   plan    (plan.c) decides, as plain data (struct tdm_sched_plan): per sequence its span,
 *           pos0, page table, KV slots, and what each output row wants (a sampled token,
 *           logits, a hidden state). Its policy (DESIGN.md §6):
 *             1. decodes first: every running sequence whose prompt is fully in the KV
 *                contributes its next token, plus up to k drafts when a drafter is set;
 *             2. then prefill chunks of running sequences, up to the step's token budget
 *                (max_batch_tokens) and the chunk cap;
 *             3. then new requests, FCFS, while the budget, max_seqs and free KV pages allow
 *                (a request is admitted only when the pages for its whole prompt are free);
 *   run     the executor runs the plan (tdm_engine_run: one forward pass);
 *   commit  (commit.c) applies what came back: the sampled token, or for a drafted span the
 *           accepted prefix (a token tree's: the accepted path, its KV moved into place) plus
 *           the target's token; rejected positions are rewound (token list, penalty state, KV
 *           pages past the kept end), and outputs are published.
 * A KV connector (disaggregation) is called at fixed points: admission, around each run, and
 * finish. Nothing else changes the scheduler's behaviour.
 *
 * A request preempted by recompute (pages taken back when the pool runs dry, newest request
 * first) goes back to the waiting queue with KV length 0 and resumes where it stood: the
 * sampler is keyed by absolute position, so its output is unchanged.
 *
 * Request lifecycle (enum tdm_req_state):
 *
 *                       admit (connector takes it)
 *   submit --> WAITING ------------------------------> WAITING_REMOTE_KV
 *               |  ^  ^                                   |         |
 *         admit |  |  +---- remote failed ---------------+         | remote ok
 *               v  | preempt                                        v
 *              RUNNING <-----------------------------------------------+
 *               |
 *               +--> FINISHED <-- (cancel from any state; stop, length, error from RUNNING)
 *
 *   from               to                  function (file)              when
 *   WAITING            RUNNING             admit (plan.c)               pages free, budget left
 *   WAITING            WAITING_REMOTE_KV   admit (plan.c)               connector admit() true
 *   WAITING_REMOTE_KV  RUNNING             land_remote (plan.c)         remote done, TDM_OK
 *   WAITING_REMOTE_KV  WAITING             land_remote -> tdm_sched_requeue remote done, failed
 *   RUNNING            WAITING             preempt -> tdm_sched_requeue     the pool ran dry
 *   any                FINISHED            tdm_sched_finish (commit.c)      cancel, stop, length,
 *                                                                       error
 *
 * Finishing is one function, in one order: the connector's finished() (it may hold pages
 * that its transfers still touch), then the pages go back, then the reason is published. So a
 * request cancelled while WAITING_REMOTE_KV is fenced before its pages can be reused, and a
 * reader that sees a request finished sees the pool without it.
 *
 * Output: the scheduler never waits for a reader. Each request has room, reserved at submit,
 * for all of its max_tokens outputs (token, log-probabilities, released text), so a slow client
 * cannot stall a step; readers block in tdm_req_wait for news.
 *
 * Ownership: a tdm_req_t is reference counted; the submitter owns one reference (drop it with
 * tdm_req_release, which also cancels the request if it is still running), the scheduler
 * another until the request is finished and its KV pages are back in the pool.
 *
 * Watchdog (opts.watchdog_ms > 0): a thread of its own watches the step in flight. When one
 * step (plan, run and commit) has run longer than the limit, the scheduler is stalled:
 *   - every request it holds (running, and waiting) is failed at once with TDM_ETIMEDOUT, so
 *     each client gets an error instead of waiting forever; the requests stay with the
 *     scheduler, which drops them if the step ever comes back (a running request's pages are
 *     released then, not before: the stuck step may still write into them, so the pool shows
 *     them used while stalled);
 *   - submissions are refused (TDM_EAGAIN), tdm_sched_stall_ms() is positive (the server's
 *     /health answers 503), and the stall is counted;
 *   - tdm_sched_stop gives up on a stalled thread at its drain deadline and returns false: the
 *     caller exits without cleaning up (the stuck step may still touch everything).
 * A step that comes back ends the stall: the scheduler goes on with the requests it has left.
 *
 * Overlap (opts.overlap; an executor with launch, sample and wait: the engine's
 * tdm_engine_launch, _launch_sample and _wait, asynchronous on CUDA): the CPU work of
 * step N+1 runs while the device runs step N. Each call of tdm_sched_step plans N+1 (reaping,
 * admission, pages; no drafts), launches its forward pass behind N, waits for N and commits
 * it, then queues N+1's sampling, whose rows are read only then:
 *
 *   host:   plan N+1 | fwd N+1 | wait N | commit N | sample N+1 | plan N+2 | fwd N+2 | wait N+1 ..
 *   device: .. sample N | forward N+1 .......................| sample N+1 | forward N+2 ....
 *
 * A request whose token is still being sampled by N gets it as TDM_TOKEN_PREV of its N row
 * (the device reads it where N's sampler left it), one placeholder at the end of its token
 * list until N's commit puts the token there. Its N+1 row is sampled after that commit, with
 * the grammar mask and penalty state of every token before it, so the output is the same as
 * without overlap. What N's commit learns arrives a step late for N+1's forward pass: a request
 * that N finishes (a stop token) has run one more position in N+1, whose row is dropped. Its
 * page table is kept, pages in use, until N+1 is collected: a later owner's own steps would
 * run after N+1 on the device anyway, but a remote fill (RDMA, a copier thread) is not
 * ordered with them. The same holds for a request cancelled or preempted while a launched
 * step holds it; such a request is never a preemption victim (it would free nothing), and when
 * the pool cannot give every running request a page, the launched step is committed before
 * the plan. A step with a span of several tokens (a prefill chunk, whose launch keeps
 * the host for milliseconds) is launched after N's commit, so that N's tokens are not late. A
 * request whose rows return logits or hidden states is not planned ahead: while one is in a
 * launched step, the scheduler commits that step before it plans (the step is then as without
 * overlap). Overlap is off with a drafter or a connector that runs around steps (the prefill side's
 * layer streaming).
 *
 * Fault injection for tests (never needed in production): TANDEM_SCHED_FAULTS=stall:N:MS makes
 * the N-th step (counted from 1) sleep MS milliseconds before it runs (MS < 0: forever).
 *
 * Threading: tdm_sched_submit, tdm_req_* and tdm_sched_metrics are thread-safe. The executor,
 * the connector and the drafter are called only by the scheduler thread (or by the caller of
 * tdm_sched_step, for a scheduler whose thread is not started).
 */
#ifndef TANDEM_SCHED_H
#define TANDEM_SCHED_H

#include "tandem/core.h"
#include "tandem/grammar.h"
#include "tandem/engine.h"
#include "tandem/sample.h"
#include "tandem/tok.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_sched tdm_sched_t;
typedef struct tdm_req tdm_req_t;

struct tdm_sched_opts {
    int max_batch_tokens; /* tokens per step; 0: the engine's max_batch_tokens */
    int max_seqs;         /* running sequences; 0: the engine's max_seqs */
    int prefill_chunk;    /* tokens per prefill span of one sequence; 0: the step budget */
    int max_waiting;      /* waiting-queue capacity; 0: 1024. A full queue refuses submits */
    int watermark_pages;  /* pages kept free at admission for running decodes; <0: 0, 0: 1% */
    bool row_outputs;     /* reserve [max_rows] logit and hidden rows for requests that want
                           * them (or later: tdm_sched_reserve_rows) */
    int watchdog_ms;      /* a step longer than this stalls the scheduler (see above); <= 0: off */
    /* Overlap (see above): 0 where the executor launches asynchronously (tdm_sched_exec.async),
     * 1 wherever it can launch at all (tests), -1 never. */
    int overlap;
};

#define TDM_MAX_TOP_LOGPROBS TDM_TOP_LOGPROBS_MAX
#define TDM_REQ_KV_PEER_MAX  128
#define TDM_MAX_STOP_IDS     16

struct tdm_req_params {
    const int32_t *prompt; /* copied at submit */
    int n_prompt;          /* >= 1 */
    int max_tokens;        /* >= 1; prompt + max_tokens must fit in the context */
    int min_tokens;        /* EOS and stop ids are ignored before this many outputs */
    bool ignore_eos;
    struct tdm_sampling_params sampling;
    /* logit_bias: bias_vals[i] added to the logit of bias_ids[i] (tdm_sampler_set_bias; copied
     * at submit); n_bias 0: none */
    const int32_t *bias_ids;
    const float *bias_vals;
    int n_bias;
    /* Structured output: every output token follows this grammar (a reference is taken at
     * submit; its vocabulary must be the model's rows). Each sampled row is masked to the
     * tokens the grammar allows after the outputs before it (drafts included); the request
     * finishes (TDM_FINISH_STOP) once the grammar is complete. NULL: unconstrained. */
    tdm_grammar_t *grammar;
    int32_t stop_ids[TDM_MAX_STOP_IDS]; /* extra stop token ids */
    int n_stop_ids;
    int top_logprobs; /* 0..TDM_MAX_TOP_LOGPROBS alternatives per output; -1: no logprobs */
    /* The prompt's log-probabilities (OpenAI's echo with logprobs): each prompt token's given
     * those before it, with max(top_logprobs, 0) alternatives, from the raw logits (the first
     * token has none). Its prefill spans then bring back a row per token (TDM_SAMPLE_SCORE),
     * so they are cut to the rows a step has left; it is never filled by a connector. With it
     * max_tokens may be 0: the request ends (TDM_FINISH_LENGTH) once the prompt is scored.
     * Not with prefill_only, want_logits or want_hidden. */
    bool prompt_logprobs;
    /* Disaggregation (DESIGN.md §4). prefill_only: a prefill node's request: the prompt is fed
     * and nothing is sampled (max_tokens is ignored); it finishes (TDM_FINISH_STOP, no outputs)
     * after its last span. fixed_chunk > 0: prefill spans are exactly this many tokens (the
     * last may be shorter) and are never cut by the step budget, so the decoder can tell in
     * advance how many spans, and so how many layer writes, there will be. chunk_phase: the
     * spans' ends fall on positions congruent to it modulo fixed_chunk (0: multiples of the
     * chunk), so a span that starts past a cached prefix still ends on the decoder's grid. A
     * prefill-only request reuses the prefix cache like any other unless it speculates
     * (spec_k >= 0: a head runs over its spans' features, which a cached prefix lacks), and
     * offers its pages when it ends. */
    bool prefill_only;
    int fixed_chunk, chunk_phase;
    /* The output rows of its last span also bring back their logits / hidden state (a
     * connector's step_end reads them); needs row outputs (tdm_sched_reserve_rows or
     * tdm_sched_opts.row_outputs). */
    bool want_logits, want_hidden;
    /* Speculation: 0 the scheduler's drafter and cap; > 0 a lower cap on drafts per step;
     * < 0 none for this request. */
    int spec_k;
    void *user; /* opaque; handed back to the connector */
    /* The KV connector's peer for this request, or NULL: its own choice. A decoder takes it as
     * a prefill node's HTTP host:port (llm-d's x-prefiller-host-port). Copied at submit; at
     * most TDM_REQ_KV_PEER_MAX - 1 bytes. */
    const char *kv_peer;
    /* Called when the request has news (an output, its finish), by the scheduler's thread (or
     * its watchdog) with the request's lock held: it must only wake someone up (no call into
     * the scheduler). Never called after tdm_req_release returns. NULL: readers poll with
     * tdm_req_wait. */
    void (*notify)(void *ctx);
    void *notify_ctx;
};

enum tdm_finish {
    TDM_FINISH_NONE = 0, /* still running */
    TDM_FINISH_STOP,     /* EOS, a stop id or a stop string */
    TDM_FINISH_LENGTH,   /* max_tokens or the context */
    TDM_FINISH_CANCELLED,
    TDM_FINISH_ERROR,
};
const char *tdm_finish_name(enum tdm_finish f); /* "stop", "length", "cancelled", "error" */

/* What a reader sees of a request: outputs [0, n_out) are final. From tdm_req_lock: the
 * scheduler's outputs, with no text (text is NULL). From tdm_req_reader_update: the reader's
 * outputs, up to a stop string's match, with their text: text_end[i] is the length of released
 * text after output i (text released so far: text[0, text_len)). */
struct tdm_req_view {
    int n_out;
    const int32_t *tokens;
    const float *logprobs;  /* [n_out] or NULL when logprobs are off */
    const int32_t *top_ids; /* [n_out][top_logprobs] or NULL */
    const float *top_lps;   /* [n_out][top_logprobs] or NULL */
    int stop_at;            /* the output that is an EOS or stop id (no text of its own); -1 */
    const size_t *text_end; /* [n_out] */
    const char *text;       /* released text */
    size_t text_len;
    enum tdm_finish finish;
    tdm_status error; /* for TDM_FINISH_ERROR */
    char error_msg[256];
    int n_prompt;
    /* prompt_logprobs: [n_prompt] and [n_prompt][top] (index 0, the first token, has none),
     * final once the prompt is scored: NULL before, and without prompt_logprobs. From
     * tdm_req_lock, n_scored says how far the scheduler has come (positions 1..n_scored). */
    const float *prompt_lps;
    const int32_t *prompt_top_ids;
    const float *prompt_top_lps;
    int prompt_top, n_scored;
    int cached_tokens; /* prompt tokens found in the prefix cache at its first admission */
    int64_t t_submit_ns, t_first_ns, t_end_ns;
    int n_preempted;
};

struct tdm_sched_metrics_snapshot;

/* ---- request states (one enum; the diagram and table are in the module comment) ---- */
enum tdm_req_state {
    TDM_REQ_WAITING,           /* queued; holds no KV page */
    TDM_REQ_WAITING_REMOTE_KV, /* admitted, pages reserved; a KV connector is filling them */
    TDM_REQ_RUNNING,           /* in step plans: prefill spans, then decode steps */
    TDM_REQ_FINISHED,          /* pages released, finish reason published */
};
const char *tdm_req_state_name(enum tdm_req_state st);
/* The request's state now (read from any thread; it may change right after). */
enum tdm_req_state tdm_req_state(const tdm_req_t *r);

/* ---- the step plan: plain data, built by the scheduler, run by an executor (the engine),
 * applied by the commit. Everything in it is valid from the plan until the commit. ---- */
struct tdm_plan_seq {
    tdm_req_t *req;
    void *user;            /* the request's params.user */
    const int32_t *tokens; /* [n_tokens] the span */
    int pos0, n_tokens;    /* positions [pos0, pos0 + n_tokens) */
    const int32_t *pages;  /* the request's page table (covers the span) */
    int n_pages;
    const int32_t *slots; /* [n_tokens] the KV slot each token is written to */
    int row0, n_rows;     /* output rows [row0, row0 + n_rows): the span's last n_rows tokens */
    int n_score;          /* the first n_score rows score the prompt (TDM_SAMPLE_SCORE: the
                           * row of position x gives prompt token x + 1's log-probability);
                           * the rest sample */
    uint8_t want;         /* tdm_row_want bits of each of its rows */
    int n_draft;          /* drafted tokens at the end of the span, verified by this step */
    bool last;            /* the span reaches the end of the request's token list */
    float *features;      /* [n_tokens][feature_dim] host: every token's feature (the
                           * final-normed state; an EAGLE-3 head's target: its fused layers,
                           * tdm_batch_seq.features), for a drafter that reads them; or NULL */
    /* A verified token tree (a tree drafter's, below), or NULL: the span is then the last
     * committed token (a chain token at pos0) and the tree's nodes, node j being span token
     * j + 1 at position pos0 + its depth, in slot slots[j + 1]: the slot of position pos0 +
     * j + 1 (siblings get slots of their own; the commit moves the accepted path's KV down to
     * its positions). Row i samples the position after span token i's. */
    const struct tdm_batch_tree *tree;
};
struct tdm_sched_plan {
    uint64_t step; /* 1, 2, ... */
    int n_seqs, n_tokens, n_rows;
    const struct tdm_plan_seq *seqs; /* [n_seqs] batch order */
    const uint8_t *want;             /* [n_rows] tdm_row_want bits of each row */
    struct tdm_sample_row *samples;  /* [n_rows] in: parameters; out: SAMPLE rows' tokens */
    float *logits;                   /* [n_rows][vocab]: LOGITS rows, after the run */
    float *hidden;                   /* [n_rows][d_model]: HIDDEN rows, after the run */
};

/* What runs plans: the engine (tdm_sched_create), or a fake in tests. */
struct tdm_sched_exec_i {
    /* Runs the plan: appends each span's KV at its slots and fills each row with what it
     * wants. An error fails every request of the step. Scheduler thread. */
    tdm_status (*run)(void *ctx, struct tdm_sched_plan *plan);
    /* Optional, all three or none: run in parts (the overlap, above). launch queues the
     * plan's forward pass (an error: nothing to wait for, the step failed); sample then queues
     * its rows' sampling, reading the rows' parameters at that moment (the scheduler sets
     * grammar masks and penalty state after the commit before it); wait returns the run's
     * status once the rows are filled (a sampling error included). Plans are waited in launch
     * order, at most two outstanding, and each is sampled before the next is launched. A
     * launched plan's tokens may be TDM_TOKEN_PREV(j) (engine.h): the token row j of the plan
     * launched just before it samples. */
    tdm_status (*launch)(void *ctx, struct tdm_sched_plan *plan);
    tdm_status (*sample)(void *ctx, struct tdm_sched_plan *plan);
    tdm_status (*wait)(void *ctx, struct tdm_sched_plan *plan);
};
struct tdm_sched_exec {
    const struct tdm_sched_exec_i *iface;
    void *ctx;
    tdm_kv_pool_t *kv; /* the pool spans' pages come from */
    int vocab, d_model, max_ctx;
    int max_batch_tokens, max_seqs, max_rows; /* per run */
    int feature_dim; /* the width of a token's features (tdm_batch_seq.features); 0: d_model */
    const int *eos;  /* [n_eos] end-of-sequence ids */
    int n_eos;
    bool async; /* launch returns before the run ends (overlap 0 turns on) */
};

/* ---- the KV connector: how disaggregation (src/disagg: the decode side and the prefill
 * side) plugs into the scheduler. All calls are on the scheduler thread and must not block. */
struct tdm_kv_connector_i {
    /* Admission of a request with at least two prompt tokens past its cached prefix, its
     * pages reserved for the whole prompt. n_cached: the tokens [0, n_cached) whose KV it
     * already holds from the prefix cache (whole pages; 0 without a cache), which stay here.
     * Return true to fill the KV of tokens [n_cached, n_tokens) of prompt[:-1]
     * (tokens[0, n_tokens)) elsewhere: the request is then WAITING_REMOTE_KV (out of plans,
     * never preempted) until tdm_req_remote_done. */
    bool (*admit)(void *ctx, tdm_req_t *r, void *user, const int32_t *tokens, int n_tokens,
                  int n_cached, const int32_t *pages, int n_pages);
    /* Around each run of a plan; step_end sees the rows' logits and hidden states. */
    void (*step_begin)(void *ctx, const struct tdm_sched_plan *plan);
    void (*step_end)(void *ctx, const struct tdm_sched_plan *plan, tdm_status st);
    /* A request finished (any reason, any state), while it still owns its pages: a connector
     * whose transfers may still touch them holds them here (tdm_kv_pool_hold); the scheduler
     * drops its references right after. */
    void (*finished)(void *ctx, tdm_req_t *r, void *user, enum tdm_finish why);
};
/* Set before tdm_sched_start. */
void tdm_sched_set_connector(tdm_sched_t *s, const struct tdm_kv_connector_i *c, void *ctx);
/* Reserves the [max_rows] logit and hidden-state rows that requests with want_logits or
 * want_hidden need (a connector that reads them calls this; the memory is [max_rows][vocab]
 * floats, so nothing reserves it unasked). Before tdm_sched_start. TDM_ENOMEM with a message. */
tdm_status tdm_sched_reserve_rows(tdm_sched_t *s);

/* A remote KV fill ended (any thread). TDM_OK: the KV of prompt[:-1] is in the request's
 * pages and it becomes RUNNING, its first step being prompt[-1]. Otherwise its pages are
 * released (the connector fenced them first with tdm_kv_pool_hold if late writes may still
 * land) and it returns to the front of the waiting queue; on re-admission the connector is
 * asked again (it may return false to prefill locally). */
void tdm_req_remote_done(tdm_req_t *r, tdm_status st);

/* ---- speculation across disaggregation: features for a drafter, through the connector ----
 * Features (struct tdm_plan_seq.features: the executor's feature_dim floats a token, the
 * target's final-normed states, or an EAGLE-3 head's fused target layers)
 * are downloaded for every span of a request that may speculate (spec_k >= 0) whenever the
 * scheduler keeps a features buffer: for its feature drafter (tdm_sched_set_drafter), or for
 * its connector
 * (tdm_sched_reserve_features). A prefill-only request with spec_k >= 0 is one that speculates
 * on the node that decodes it: its spans get features too, which the connector's step_end
 * reads (a prefill node runs the decoder's head over them, spec.h tdm_spec_head_kv); they are
 * never fed to a drafter here.
 *
 * The decode side hands the drafter what came with the KV (tdm_req_remote_done_feed): the
 * target's feature of the last prefilled position p = n_tokens - 2 (its state after prompt[-2]),
 * and the number of positions [0, drafter_kv) of the drafter's own KV (its layer group) that
 * landed with the pages, made from the target's features. When the request becomes RUNNING,
 * the scheduler sets its tdm_draft_stats.cursor to drafter_kv and feeds the drafter that one
 * feature at p (a tdm_sched_feed of n = 1), before the first step is planned: a drafter that
 * finds a gap before p covered by cursor takes it as its own KV, and drafts at the first step. */
/* Turns on automatic prefix caching (kv.h's prefix cache) over the scheduler's pool, salted
 * with `salt` (the model and the KV element type): a request admitted with no KV reuses the
 * longest cached prefix of its token list in whole pages, leaving at least its last token to
 * run (not a request that scores its prompt, nor a group's follower, which takes its leader's);
 * the full pages of every request whose KV is final are offered to the cache after each
 * commit, and when it is preempted or ends; the pool's allocations evict pages only the cache
 * holds, least recently used first, before anything is preempted. Rejected drafts never enter
 * (their positions are past the committed end). With a connector (disaggregation), a decode
 * node's request asks for the KV past its cached prefix only (the connector's admit gets
 * n_cached), and a prefill node's requests reuse and fill that node's own cache. With a
 * drafter that has KV of its own (kv_len), a page is offered once that KV covers it, and a
 * hit sets the request's draft cursor to the prefix's end: the drafter's KV of a cached page
 * is the one its first owner made (its last row, which reads the next page's first token, as
 * that owner had it: the drafts' quality, never the output). After tdm_sched_set_drafter and
 * tdm_sched_set_connector, before tdm_sched_start: TDM_EUNSUPPORTED with a drafter that reads
 * the target's features and says nothing of its KV (no kv_len). TDM_ENOMEM. */
tdm_status tdm_sched_enable_prefix_cache(tdm_sched_t *s, uint64_t salt);
/* Tells l what the prefix cache stores and drops (kv.h: tdm_prefix_listener; its calls come on
 * the scheduler's thread). Before tdm_sched_start, after tdm_sched_enable_prefix_cache;
 * TDM_EINVAL otherwise. */
tdm_status tdm_sched_set_prefix_listener(tdm_sched_t *s, const struct tdm_prefix_listener *l);
/* Drops every cache entry, on the scheduler thread at its next turn (pages requests hold stay
 * theirs). Any thread; returns at once. */
void tdm_sched_flush_prefix_cache(tdm_sched_t *s);

/* Reserves the [max_batch_tokens][feature_dim] features buffer (the executor's width) for a
 * connector that reads the features of its requests' spans in step_end. Before
 * tdm_sched_start. TDM_ENOMEM. */
tdm_status tdm_sched_reserve_features(tdm_sched_t *s);
/* tdm_req_remote_done(r, TDM_OK), also handing over feature ([feature_dim] floats, the
 * executor's width, copied before it returns) and drafter_kv (0 .. n_tokens - 2) as described
 * above. Without a feature drafter the extras are dropped. Any thread. */
void tdm_req_remote_done_feed(tdm_req_t *r, const float *feature, int drafter_kv);

/* ---- speculation: a drafter proposes tokens, the step verifies them ----
 * Each step, every decoding request that may speculate is handed to the drafter at once, as a
 * batch of struct tdm_sched_draft: the drafter chooses how many tokens to propose for each
 * (at most k; 0 is fine) and writes them. The scheduler then verifies each drafted span in the
 * same run as the rest of the step (its rows sample the target's token at every position),
 * keeps drafts while they equal the target's token, then the target's token at the first
 * mismatch; the RNG is keyed on the position, so the output is the same as without drafts
 * (exact acceptance). A drafter that hands over its distributions (q) gets rejection
 * acceptance instead: draft d at a position is kept with probability min(1, p(d) / q(d)), p
 * being the target's distribution there (tdm_sampler_dist), with the uniform of RNG stream 1;
 * the first one refused is replaced by a draw from max(0, p - q) normalised (stream 2). The
 * target's own draws use stream 0, so a drafter draws its proposals from stream 3. Both
 * acceptances run in the verified rows' sampling (TDM_SAMPLE_VERIFY, sample.h), where the
 * logits are.
 * Rejected positions are rewound: the token list, the penalty state and the KV past the kept
 * end. */
#define TDM_SPEC_MAX_K 16
/* A request's record of its drafts, kept by the scheduler, for the drafter's controller: at
 * each draft position, how often verification reached it (every draft before it accepted)
 * and how often it was accepted, both decayed by the drafter as it likes. Zero at submit. */
struct tdm_draft_stats {
    float reached[TDM_SPEC_MAX_K];
    float kept[TDM_SPEC_MAX_K];
    uint32_t steps;      /* decode steps so far */
    uint32_t idle_steps; /* consecutive steps with nothing drafted */
    /* for a drafter with KV of its own (a draft model's layer group): the positions of that
     * KV that hold the request's tokens, [0, cursor), and the token count its last proposal
     * started from. The scheduler zeroes cursor when the request's pages go back. */
    int32_t cursor, base;
    /* a tree drafter's last verified step: the tree's depth (reached and kept above count by
     * depth, not by draft index), and how many accepted drafts were not their parent's first
     * child (a branch other than the drafter's best guess); 0 for a chain */
    int32_t tree_depth, tree_off_first;
};
struct tdm_sched_draft {
    tdm_req_t *req;
    const int32_t *tokens; /* committed tokens [0, n_tokens); the KV holds [0, n_tokens - 1) */
    int n_tokens;
    const int32_t *pages; /* its page table: pages exist for positions < n_tokens + k */
    int n_pages;
    struct tdm_sampler *smp; /* its sampler: draws keyed like the target's (a drafter that
                              * accepts into it must unaccept before returning) */
    /* structured output: the request's grammar and its state after the committed tokens (NULL:
     * none). A chain drafter's row at depth j takes the mask of the state after its drafts
     * 0..j-1 (tdm_spec_set_row), and a tree drafter keeps only the children the grammar allows
     * after their parent's path, so drafts are only what the target may accept. */
    tdm_grammar_t *grammar;
    int32_t gstate;
    struct tdm_draft_stats *stats;
    void *state;  /* the drafter's own state for this request (state_bytes), or NULL */
    int k;        /* in: the most it may propose (its cap, the budget, the context); the drafter
                   * may lower it to what it chose */
    int cap;      /* k as the scheduler set it (read-only) */
    int32_t *out; /* [k]: proposals */
    /* out, for rejection acceptance: [k][vocab] the draft's distribution at each proposal
     * (drafter's storage in the target engine's backend memory, where the verify rows are
     * sampled: device memory on CUDA; valid until the commit); NULL: exact acceptance */
    const float *q;
    int n; /* out: how many were proposed (0..k) */
    /* A tree drafter's (tdm_sched_drafter_i.tree): parent[j] is the proposal that out[j]
     * continues, -1 for the last committed token, always < j (so a parent comes first): a
     * token tree of n nodes, at most TDM_SAMPLE_MAX_CAND children a node and TDM_SPEC_MAX_K
     * deep (the plan cuts a proposal at its first node past either). NULL for a chain
     * drafter. Out: tree_rejection verifies each node's children as point-mass proposals
     * (TDM_SAMPLE_TREE: multi-draft rejection sampling, lossless in distribution) instead of
     * by exact match with the target's keyed draw (lossless token for token). */
    int32_t *parent;
    bool tree_rejection;
    /* a tree drafter's: the deepest draft worth proposing (past it nothing could be published:
     * max_tokens, the context); deeper nodes are cut. A chain's: k. */
    int depth_cap;
};
/* What a drafter that reads the target's features (feature_dim > 0) is fed after each commit:
 * for a request still running, the features of the positions of this step's span whose KV was
 * kept, [pos0, pos0 + n): every prefill position, and of a verified span the last committed
 * token's and the accepted drafts'. Each such position p has its next token committed
 * (tokens[p + 1], p + 1 < n_tokens). features: [n][feature_dim], valid during the call. */
struct tdm_sched_feed {
    tdm_req_t *req;
    const int32_t *tokens; /* committed tokens [0, n_tokens) */
    int n_tokens;
    const int32_t *pages; /* its page table (covers [0, n_tokens)) */
    int n_pages;
    struct tdm_draft_stats *stats;
    void *state; /* as in tdm_sched_draft */
    int pos0, n;
    const float *features;
    /* launch only: [n] the token the target's row chose at each span position (the row of
     * position p samples position p + 1), accepted or not; NULL in feed */
    const int32_t *next;
};
struct tdm_sched_drafter_i {
    /* Proposes for a batch of n requests about to decode. base_tokens: the step's tokens
     * before any draft (one per decoding request; prefill chunks may follow). Scheduler
     * thread; it may run the engine (tdm_engine_run) on those requests' pages, and write KV
     * at positions [n_tokens - 1, n_tokens - 1 + k) of them (the verify overwrites them). */
    void (*propose)(void *ctx, struct tdm_sched_draft *d, int n, int base_tokens);
    /* After the commit of each decode step of r: n_accepted of n_draft drafts were kept and
     * n_published tokens came out (fewer than n_accepted + 1 when the request ended). */
    void (*accepted)(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                     int n_accepted, int n_published);
    /* After each run: the plan that ran and how long the run took (a cost model's input). */
    void (*step_done)(void *ctx, const struct tdm_sched_plan *plan, uint64_t run_ns);
    /* Optional: > 0 asks for the target's features (feature_dim floats a token: the
     * executor's feature width, d_model or an EAGLE-3 head's fused 3 d_model) of every span of
     * the requests that may speculate, handed over by feed after each commit (in batch
     * order). Scheduler thread; feed may run the engine on those requests' pages at positions
     * below n_tokens. */
    int feature_dim;
    void (*feed)(void *ctx, const struct tdm_sched_feed *f, int n);
    /* Optional: bytes of per-request state the scheduler keeps for the drafter (zeroed at
     * submit, and whenever the request's pages go back), handed over as `state`. */
    size_t state_bytes;
    /* Optional: a tree drafter (EAGLE-2). Its proposals are token trees (tdm_sched_draft
     * .parent), verified in the step's one pass as a tree span (tdm_plan_seq.tree): every
     * node's row samples the target at the node's position, with penalties that see the
     * node's path only (its undo list names the other branches' drafts); the commit walks
     * from the root, following the child whose token is the row's, publishes the path and
     * the last row's token, moves the path's KV to its positions (tdm_kv_pool_copy_slots) and
     * its features to their rows (the feed sees a chain), and trims the rest. kv_scratch:
     * positions from n_tokens - 1 on where propose writes KV of its own layer group beyond
     * its k proposals' (its own tree's nodes), reserved with them. */
    bool tree;
    int kv_scratch;
    /* Optional, for a drafter with KV of its own in the request's pages: how many positions
     * [0, n) of it are final (made from the committed tokens and, for a feature drafter, the
     * target's features), given its state. With a prefix cache, a page is offered only once
     * this covers it (a request that does not speculate, spec_k < 0, makes none and offers
     * nothing), and a request that reuses a cached prefix starts with its cursor at the
     * prefix's end (a feature drafter then takes that KV as its own). Without it, a drafter
     * that reads features is refused with a prefix cache. */
    int (*kv_len)(void *ctx, const void *state);
    /* Optional, for a drafter that reads features: whether a request still reads them, given
     * its state (false: the drafter gave the request up, as a head does whose state it dropped;
     * the plan then asks none of its features, which on a GPU are a download a sequence and
     * step). Without it, every request that may speculate gets them. */
    bool (*reads_features)(void *ctx, const void *state);
    /* Optional: the seed's single-token MTP schedule, which needs no sync after acceptance.
     * launch is called right after a step's run and before its commit, with the decode spans
     * just verified of the requests that may speculate (as feed's, but n is the whole span,
     * accepted or not, and next says what the target chose at each position). It may start
     * work on a thread of its own (the head over every verified row, its input tokens the
     * target's choices shifted in), which must touch neither the requests nor anything of the
     * scheduler's: what it needs it copies in launch. The commit (then feed, with what was
     * kept) runs meanwhile. join waits for that work: the scheduler calls it before anything
     * that may hand the launched spans' pages to another request (the next step's reaping
     * and plan) and when it stops. Scheduler thread. */
    void (*launch)(void *ctx, const struct tdm_sched_feed *f, int n);
    void (*join)(void *ctx);
};
/* Sets the drafter (before tdm_sched_start); k_max caps every proposal (at most
 * TDM_SPEC_MAX_K; a tree drafter's, nodes: at most TDM_TREE_MAX_NODES). Verification needs no
 * row outputs: each verified row is sampled in TDM_SAMPLE_VERIFY (or, for a tree, DRAW or
 * TREE) mode where the logits are. */
tdm_status tdm_sched_set_drafter(tdm_sched_t *s, const struct tdm_sched_drafter_i *d, void *ctx,
                                 int k_max);

/* A scheduler over an engine (which must outlive it). */
tdm_status tdm_sched_create(tdm_engine_t *engine, const tdm_tok_t *tok,
                            const struct tdm_sched_opts *opts, tdm_sched_t **out);
/* A scheduler over any executor (the struct is copied; what it points to must outlive it). */
tdm_status tdm_sched_create_exec(const struct tdm_sched_exec *x, const tdm_tok_t *tok,
                                 const struct tdm_sched_opts *opts, tdm_sched_t **out);
/* Plans, runs and commits one step on the caller's thread, for a scheduler whose thread was
 * never started (tests drive it step by step). Returns false when nothing could run. */
bool tdm_sched_step(tdm_sched_t *s);
/* Starts the scheduler thread. */
tdm_status tdm_sched_start(tdm_sched_t *s);
/* Stops taking requests. With drain_ms > 0, waits up to that long for running and waiting
 * requests to finish; then cancels what is left, stops the thread and returns true. A thread
 * stalled in a step (see the watchdog) is given up at the drain deadline: false, and then the
 * scheduler must not be destroyed (the process should exit). */
bool tdm_sched_stop(tdm_sched_t *s, int drain_ms);
/* How long the step in flight has run when it is past the watchdog's limit, in ms; 0 when the
 * scheduler is not stalled (or has no watchdog). Any thread. */
int64_t tdm_sched_stall_ms(const tdm_sched_t *s);
void tdm_sched_destroy(tdm_sched_t *s); /* stops first if needed; NULL is a no-op */

/* Queues a request. TDM_EINVAL/TDM_ERANGE for bad params (message says why), TDM_EAGAIN when
 * the waiting queue is full, TDM_ECANCELED when the scheduler is stopping. */
tdm_status tdm_sched_submit(tdm_sched_t *s, const struct tdm_req_params *p, tdm_req_t **out);
/* Queues n requests with one prompt (OpenAI's n and best_of: the same prompt, each its own
 * sampling, seed included), all or none, with consecutive ids; out[i] is ps[i]'s. They share
 * the prompt's KV: the first (the leader) prefills it, and the others (followers) are passed
 * over at admission until it has; then, at the commit of the leader's last prompt span, each
 * follower that finds a running slot takes the prompt's full pages (a reference each) and a
 * copy of its partial last page, holding positions [0, n_prompt - 1), and runs prompt[-1]
 * itself, its first output drawn with its own sampler. A follower that finds no room, or whose
 * leader ended or was preempted after its first output, prefills alone as any request does. A
 * scheduler whose drafter reads features shares nothing (the drafter would see a gap in a
 * follower's features and not draft for it): every member prefills. Each is released on its
 * own; none is prefill-only. */
#define TDM_SCHED_MAX_GROUP 64
tdm_status tdm_sched_submit_group(tdm_sched_t *s, const struct tdm_req_params *ps, int n,
                                  tdm_req_t **out);
uint64_t tdm_req_id(const tdm_req_t *r);
/* The request's params.kv_peer, or NULL. */
const char *tdm_req_kv_peer(const tdm_req_t *r);
/* Cancels the request (idempotent; a finished request is unaffected). */
void tdm_req_cancel(tdm_req_t *r);
/* Ends the request as stopped (TDM_FINISH_STOP), as a cancel does: its reader matched a stop
 * string. */
void tdm_req_stop(tdm_req_t *r);
/* Drops the submitter's reference; cancels the request if it has not finished. */
void tdm_req_release(tdm_req_t *r);
/* Waits until the request has more than `seen_out` outputs, or is finished, or timeout_ms
 * passes. Returns true if there is news. */
bool tdm_req_wait(tdm_req_t *r, int seen_out, int timeout_ms);
/* Locks the request's output and fills *v; the arrays stay valid (and final up to n_out) until
 * tdm_req_unlock. Do not call back into the scheduler while holding it. */
void tdm_req_lock(tdm_req_t *r, struct tdm_req_view *v);
void tdm_req_unlock(tdm_req_t *r);

/* ---- the reader side of the output: text ----
 * Detokenisation and stop strings run on the reader's thread (an HTTP connection's), never on
 * the scheduler's. A reader copies new tokens and log-probabilities out under the request's
 * lock, then renders their text with no lock held. When a stop string matches, the output ends
 * there: the reader stops the request (tdm_req_stop), waits for the scheduler to finish it (its
 * pages are back when the reader reports the end), and reports TDM_FINISH_STOP with the
 * outputs up to the one whose text completed the match. One reader per request, used by one
 * thread. */
typedef struct tdm_req_reader tdm_req_reader_t;
/* tok: for the text (NULL: no text). stops: the stop strings (see tdm_text_stream; copied).
 * max_tokens (0 only for a request that scores its prompt) and top_logprobs as submitted. The
 * view's prompt log-probabilities are the reader's copies, taken once they are final.
 * TDM_EINVAL for bad stop strings. */
tdm_status tdm_req_reader_create(const tdm_tok_t *tok, const char *const *stops, int n_stops,
                                 int max_tokens, int top_logprobs, tdm_req_reader_t **out);
void tdm_req_reader_destroy(tdm_req_reader_t *rd); /* NULL is a no-op */
/* Takes in what r published since the last call and fills *v with the reader's outputs (its
 * arrays stay valid until the next call). Returns true when *v changed. */
bool tdm_req_reader_update(tdm_req_reader_t *rd, tdm_req_t *r, struct tdm_req_view *v);
/* Waits until r has outputs the reader has not taken in, or is finished, or timeout_ms passes. */
bool tdm_req_reader_wait(tdm_req_reader_t *rd, tdm_req_t *r, int timeout_ms);

/* ---- metrics ---- */
#define TDM_HIST_MAX_BUCKETS 24
struct tdm_hist {
    int n_buckets;
    double bounds[TDM_HIST_MAX_BUCKETS]; /* upper bounds, ascending; +Inf is implicit */
    uint64_t counts[TDM_HIST_MAX_BUCKETS + 1];
    uint64_t n;
    double sum;
};
void tdm_hist_observe(struct tdm_hist *h, double v);

struct tdm_sched_metrics_snapshot {
    struct tdm_hist ttft_s, itl_s, e2e_s, batch_tokens, batch_seqs;
    uint64_t prompt_tokens, generated_tokens, preemptions, steps;
    uint64_t overlapped_steps; /* launched while the step before ran (overlap) */
    uint64_t finished[5];      /* by enum tdm_finish */
    uint64_t rejected;         /* refused at submit (queue full, stopping or stalled) */
    uint64_t stalls;           /* steps the watchdog found past its limit */
    uint64_t watchdog_failed;  /* requests it failed */
    int64_t stalled_ms;        /* tdm_sched_stall_ms at the snapshot */
    int running, waiting;
    struct tdm_kv_stats kv;
    bool accepting;
    bool prefix_on;                 /* prefix caching enabled */
    struct tdm_prefix_stats prefix; /* as of the last step */
};
void tdm_sched_metrics(tdm_sched_t *s, struct tdm_sched_metrics_snapshot *out);
/* The context length, vocabulary and EOS ids the scheduler checks requests against. */
int tdm_sched_max_ctx(const tdm_sched_t *s);
int tdm_sched_vocab(const tdm_sched_t *s);                /* the model's logit rows */
int tdm_sched_eos(const tdm_sched_t *s, const int **ids); /* count; *ids valid for s's life */

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_SCHED_H */
