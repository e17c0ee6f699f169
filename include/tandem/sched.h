/*
 * tandem sched: continuous batching over one engine, on a thread of its own.
 *
 * Requests come in through tdm_sched_submit from any thread (the HTTP threads), into a bounded
 * waiting queue. The scheduler thread runs steps; each step is one tdm_engine_forward call built
 * like this (DESIGN.md §6):
 *   1. decodes first: every running sequence whose prompt is fully in the KV contributes its one
 *      next token (FCFS order);
 *   2. then prefill chunks of running sequences that are still prefilling, up to the step's
 *      token budget (max_batch_tokens) and the chunk cap;
 *   3. then new requests are admitted FCFS while the budget, max_seqs and free KV pages allow
 *      (a request is admitted only when the pages for its whole prompt are free).
 * A sequence is a token list (prompt, then generated tokens) of which a prefix is in the KV.
 * Each step feeds it the next span; when the span reaches the end of the list, its logits are
 * sampled and a new token is appended. A prefill is a span longer than one token, so a request
 * preempted by recompute (pages taken back when the pool runs dry, newest request first) just
 * goes back to the front of the waiting queue with KV length 0 and resumes where it stood: the
 * sampler is keyed by absolute position, so its output is unchanged.
 *
 * Request lifecycle:
 *
 *     submit --> WAITING --admit--> RUNNING (prefill spans ... decode steps) --> FINISHED
 *                  ^                    |  |                                        ^
 *                  +----preempted-------+  +--cancel / error / stop / length--------+
 *   (cancel while WAITING also goes straight to FINISHED)
 *
 * Output: the scheduler never waits for a reader. Each request has room, reserved at submit,
 * for all of its max_tokens outputs (token, log-probabilities, released text), so a slow client
 * cannot stall a step; readers block in tdm_req_wait for news.
 *
 * Ownership: a tdm_req_t is reference counted; the submitter owns one reference (drop it with
 * tdm_req_release, which also cancels the request if it is still running), the scheduler
 * another until the request is finished and its KV pages are back in the pool.
 *
 * Threading: tdm_sched_submit, tdm_req_* and tdm_sched_metrics are thread-safe. The engine is
 * driven only by the scheduler thread once tdm_sched_start has returned.
 */
#ifndef TANDEM_SCHED_H
#define TANDEM_SCHED_H

#include "tandem/core.h"
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
};

#define TDM_MAX_TOP_LOGPROBS TDM_TOP_LOGPROBS_MAX
#define TDM_MAX_STOP_IDS     16

struct tdm_req_params {
    const int32_t *prompt; /* copied at submit */
    int n_prompt;          /* >= 1 */
    int max_tokens;        /* >= 1; prompt + max_tokens must fit in the context */
    int min_tokens;        /* EOS and stop ids are ignored before this many outputs */
    bool ignore_eos;
    struct tdm_sampling_params sampling;
    const char *const *stops; /* stop strings (see tdm_text_stream) */
    int n_stops;
    int32_t stop_ids[TDM_MAX_STOP_IDS]; /* extra stop token ids */
    int n_stop_ids;
    int top_logprobs; /* 0..TDM_MAX_TOP_LOGPROBS alternatives per output; -1: no logprobs */
    /* Disaggregation (DESIGN.md §4). prefill_only: a prefill node's request: the prompt is fed
     * and nothing is sampled (max_tokens is ignored); it finishes (TDM_FINISH_STOP, no outputs)
     * after its last span. fixed_chunk > 0: prefill spans are exactly this many tokens (the
     * last may be shorter) and are never cut by the step budget, so the decoder can tell in
     * advance how many spans, and so how many layer writes, there will be. */
    bool prefill_only;
    int fixed_chunk;
    void *user; /* opaque; handed back to the hooks */
};

enum tdm_finish {
    TDM_FINISH_NONE = 0, /* still running */
    TDM_FINISH_STOP,     /* EOS, a stop id or a stop string */
    TDM_FINISH_LENGTH,   /* max_tokens or the context */
    TDM_FINISH_CANCELLED,
    TDM_FINISH_ERROR,
};
const char *tdm_finish_name(enum tdm_finish f); /* "stop", "length", "cancelled", "error" */

/* What a reader sees of a request: outputs [0, n_out) are final. text_end[i] is the length of
 * released text after output i (text released so far: text[0, text_len)). */
struct tdm_req_view {
    int n_out;
    const int32_t *tokens;
    const float *logprobs;  /* [n_out] or NULL when logprobs are off */
    const int32_t *top_ids; /* [n_out][top_logprobs] or NULL */
    const float *top_lps;   /* [n_out][top_logprobs] or NULL */
    const size_t *text_end; /* [n_out] */
    const char *text;       /* released text */
    size_t text_len;
    enum tdm_finish finish;
    tdm_status error; /* for TDM_FINISH_ERROR */
    char error_msg[256];
    int n_prompt;
    int64_t t_submit_ns, t_first_ns, t_end_ns;
    int n_preempted;
};

struct tdm_sched_metrics_snapshot;

/* ---- hooks for the disaggregation layer; all run on the scheduler thread, must not block ---- */
struct tdm_step_span {
    tdm_req_t *req;
    void *user;           /* the request's params.user */
    int pos0, n_tokens;   /* the span: positions [pos0, pos0 + n_tokens) */
    const int32_t *pages; /* the request's page table (covers the span) */
    int n_pages;
    bool last;           /* the span reaches the end of the request's token list */
    const float *logits; /* step_end, when last: the last position's logits [vocab] */
    const float *hidden; /* step_end, when last: its hidden state [d_model] */
};
struct tdm_sched_hooks {
    void *ctx;
    /* Decode node: called when a request with n_prompt >= 2 is admitted, its pages reserved
     * for the whole prompt. Return true to prefill prompt[:-1] remotely: the request is then
     * kept out of batches (and never preempted) until tdm_req_remote_done. */
    bool (*remote_prefill)(void *ctx, tdm_req_t *r, void *user, const int32_t *tokens, int n_tokens,
                           const int32_t *pages, int n_pages);
    /* Around each forward call: the spans it runs, in batch order. */
    void (*step_begin)(void *ctx, const struct tdm_step_span *spans, int n);
    void (*step_end)(void *ctx, const struct tdm_step_span *spans, int n, tdm_status st);
    /* A request finished (any reason), just before its pages go back to the pool. */
    void (*finished)(void *ctx, tdm_req_t *r, void *user, enum tdm_finish why);
};
/* Set before tdm_sched_start. With hooks set, forward calls also produce hidden states. */
void tdm_sched_set_hooks(tdm_sched_t *s, const struct tdm_sched_hooks *h);
/* The engine's layer counter is in tdm_engine_opts.layer_counter. */

/* A remote prefill ended (any thread). TDM_OK: the KV of prompt[:-1] is in the request's pages
 * and it joins the decode batches. Otherwise its pages are released (the caller fences them
 * first with tdm_kv_pool_hold if late writes may still land) and the request returns to the
 * front of the waiting queue; on re-admission remote_prefill is asked again (it may return
 * false to prefill locally). */
void tdm_req_remote_done(tdm_req_t *r, tdm_status st);

tdm_status tdm_sched_create(tdm_engine_t *engine, const tdm_tok_t *tok,
                            const struct tdm_sched_opts *opts, tdm_sched_t **out);
/* Starts the scheduler thread. */
tdm_status tdm_sched_start(tdm_sched_t *s);
/* Stops taking requests. With drain_ms > 0, waits up to that long for running and waiting
 * requests to finish; then cancels what is left, stops the thread and returns. */
void tdm_sched_stop(tdm_sched_t *s, int drain_ms);
void tdm_sched_destroy(tdm_sched_t *s); /* stops first if needed; NULL is a no-op */

/* Queues a request. TDM_EINVAL/TDM_ERANGE for bad params (message says why), TDM_EAGAIN when
 * the waiting queue is full, TDM_ECANCELED when the scheduler is stopping. */
tdm_status tdm_sched_submit(tdm_sched_t *s, const struct tdm_req_params *p, tdm_req_t **out);
uint64_t tdm_req_id(const tdm_req_t *r);
/* Cancels the request (idempotent; a finished request is unaffected). */
void tdm_req_cancel(tdm_req_t *r);
/* Drops the submitter's reference; cancels the request if it has not finished. */
void tdm_req_release(tdm_req_t *r);
/* Waits until the request has more than `seen_out` outputs, or text past `seen_text`, or is
 * finished, or timeout_ms passes. Returns true if there is news. */
bool tdm_req_wait(tdm_req_t *r, int seen_out, size_t seen_text, int timeout_ms);
/* Locks the request's output and fills *v; the arrays stay valid (and final up to n_out) until
 * tdm_req_unlock. Do not call back into the scheduler while holding it. */
void tdm_req_lock(tdm_req_t *r, struct tdm_req_view *v);
void tdm_req_unlock(tdm_req_t *r);

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
/* Appends a histogram in the Prometheus text format (# HELP, # TYPE, cumulative _bucket{le},
 * _sum, _count); labels ("k=\"v\"", or NULL) go on every sample. */
void tdm_hist_prom(struct tdm_sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                   const char *labels);

struct tdm_sched_metrics_snapshot {
    struct tdm_hist ttft_s, itl_s, e2e_s, batch_tokens, batch_seqs;
    uint64_t prompt_tokens, generated_tokens, preemptions, steps;
    uint64_t finished[5]; /* by enum tdm_finish */
    uint64_t rejected;    /* refused at submit (queue full or stopping) */
    int running, waiting;
    struct tdm_kv_stats kv;
    bool accepting;
};
void tdm_sched_metrics(tdm_sched_t *s, struct tdm_sched_metrics_snapshot *out);
/* The context length, vocabulary and EOS ids the scheduler checks requests against. */
int tdm_sched_max_ctx(const tdm_sched_t *s);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_SCHED_H */
