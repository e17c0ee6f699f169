/*
 * Private parts of the spec module: the drafter implementations' interface, the cost models
 * and the controller (adapt.c), and the tdm_spec object (spec.c).
 *
 * Everything here runs on the scheduler thread, except the statistics, which spec.c keeps
 * under sp->mu for readers on other threads.
 */
#ifndef TANDEM_SPEC_INT_H
#define TANDEM_SPEC_INT_H

#include <pthread.h>

#include "tandem/spec.h"

struct tdm_spec;

/* A drafter implementation: proposes d[i].k tokens (each k > 0, already chosen) for a batch.
 * It sets d[i].n (it may stop early: an error truncates) and reports each forward pass it ran
 * through tdm_spec_note_pass. */
struct tdm_spec_drafter {
    const char *name;
    void *ctx;
    void (*propose)(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n);
    /* optional: a request's decode step kept n_accepted of n_draft drafts */
    void (*accepted)(void *ctx, struct tdm_draft_stats *st, int n_draft, int n_accepted);
    void (*destroy)(void *ctx);
    /* optional, for a drafter fed with the target's features (tdm_sched_drafter_i's) */
    int feature_dim;
    size_t state_bytes;
    void (*feed)(void *ctx, struct tdm_spec *sp, const struct tdm_sched_feed *f, int n);
    /* optional: the single-token MTP schedule (tdm_sched_drafter_i's launch and join) */
    void (*launch)(void *ctx, struct tdm_spec *sp, const struct tdm_sched_feed *f, int n);
    void (*join)(void *ctx, struct tdm_spec *sp);
    /* optional: positions of its own KV that are final, given a request's state
     * (tdm_sched_drafter_i's kv_len) */
    int (*kv_len)(void *ctx, const void *state);
    /* optional: whether a request's state still reads features (tdm_sched_drafter_i's) */
    bool (*reads_features)(void *ctx, const void *state);
    /* a tree drafter (tdm_sched_drafter_i's tree and kv_scratch): k is its trees' node
     * budget, and the controller's per-position choice does not apply (the gate does) */
    bool tree;
    int kv_scratch;
};

/* The sampling row of a draft proposed at `pos` for request x: the request's own keyed draw
 * (exact), or a PROPOSE row leaving the draft's distribution in dist (rejection). */
static inline void tdm_spec_draft_row(struct tdm_sample_row *row, struct tdm_sched_draft *x,
                                      uint32_t pos, float *dist, bool one_hot)
{
    *row = (struct tdm_sample_row){.smp = x->smp, .position = pos, .n_top = -1, .token = -1};
    if (dist) {
        row->mode = TDM_SAMPLE_PROPOSE;
        row->one_hot = one_hot;
        row->dist = dist;
    }
}

/* A drafter's draws: its pass rows, and for rejection the drafts' distributions q
 * ([max_seqs][TDM_SPEC_MAX_K][vocab] in the backend's memory). */
struct tdm_spec_draws {
    struct tdm_sample_row *rows;
    float *q;
    int vocab;
    bool rejection, one_hot;
};
/* Pass entry p's row: request x (index i) choosing position pos, draft depth j. Under a
 * grammar the row is masked as the target's row for it will be: at the state after drafts
 * 0..j-1 (a mask lost to memory leaves the draft free; the target's row still checks it). */
static inline void tdm_spec_set_row(const struct tdm_spec_draws *w, struct tdm_sched_draft *x,
                                    int i, int j, int p, uint32_t pos)
{
    float *dist = w->rejection ? w->q + ((size_t)i * TDM_SPEC_MAX_K + (size_t)j) * w->vocab : NULL;
    tdm_spec_draft_row(&w->rows[p], x, pos, dist, w->one_hot);
    if (!x->grammar) return;
    int32_t st = x->gstate;
    for (int d = 0; d < j && st >= 0; d++)
        st = tdm_grammar_next(x->grammar, st, x->out[d]);
    if (st >= 0) w->rows[p].allow = tdm_grammar_mask(x->grammar, st);
}
/* Request i's draft from its row (pass entry p): the row's token, drawn by its sampling
 * (exact: the request's draw; rejection: PROPOSE, which also left q in place). */
static inline int32_t tdm_spec_take(const struct tdm_spec_draws *w, struct tdm_sched_draft *x,
                                    int i, int p)
{
    if (w->rejection) x->q = w->q + (size_t)i * TDM_SPEC_MAX_K * w->vocab;
    return w->rows[p].token;
}
/* The options of an engine that runs beside the target's (a draft model's, a head's): on its
 * backend, its pool's layer group 1, one logit row per sequence. */
void tdm_spec_beside_opts(tdm_engine_t *target, struct tdm_engine_opts *eo);

/* A rejection drafter's q for engine e ([min(max_seqs, max_logit_rows) of sized_by]
 * [TDM_SPEC_MAX_K][vocab] where e samples; TDM_EUNSUPPORTED where that is not possible). */
tdm_status tdm_spec_q_alloc(tdm_engine_t *e, const struct tdm_engine_opts *sized_by,
                            const char *name, struct tdm_buf *out);

/* The chain machinery (chain.c): engine e run pass by pass, n_layers per pass (0: all);
 * own_kv: the model's KV is its own and is caught up by cursor (else it is the target's). Takes
 * e over when owns_engine (destroyed with the drafter, or on failure). */
tdm_status tdm_spec_chain_create(tdm_engine_t *e, bool owns_engine, int n_layers, bool own_kv,
                                 const char *name, enum tdm_spec_accept accept, bool one_hot,
                                 struct tdm_spec_drafter *out);
int tdm_spec_chain_layers(const struct tdm_spec_drafter *d); /* its n_layers (self: N) */
/* The two drafters on it: self.c and draft.c. */
tdm_status tdm_spec_self_create(tdm_engine_t *target, int n_layers, enum tdm_spec_accept accept,
                                bool one_hot, struct tdm_spec_drafter *out);
tdm_status tdm_spec_draft_create(tdm_engine_t *target, const struct tdm_model *draft,
                                 enum tdm_spec_accept accept, bool one_hot,
                                 struct tdm_spec_drafter *out);
/* The MTP head drafter (mtp.c): head is a tdm_head_load model for the target. rows_per_seq:
 * the logit rows a request may take in one of the head engine's passes (1 for mtp's chains;
 * the eagle drafter's top-k), capped by the target's. */
tdm_status tdm_spec_mtp_create(tdm_engine_t *target, const struct tdm_model *head,
                               enum tdm_spec_accept accept, bool one_hot, int rows_per_seq,
                               struct tdm_spec_drafter *out);
/* Turns an mtp drafter (created with rows_per_seq 2 or more) to the seed's single-token MTP
 * schedule (--spec-overlap): its head runs over every verified row on a thread of its own
 * while the scheduler commits (mtp.c says how). TDM_EUNSUPPORTED for rejection acceptance on a
 * backend whose memory is not the host's. */
tdm_status tdm_spec_mtp_overlap(struct tdm_spec_drafter *dr);
/* The overlap's statistics: rows a launched pass ran, first drafts drawn from such rows. */
void tdm_spec_note_overlap(struct tdm_spec *sp, int rows, int drafts);
/* ---- mtp.c's machinery that the eagle drafter (eagle.c) drives ----
 * mtp (the drafter's ctx) keeps each request's head state, fed with the target's features
 * (its feed); tdm_spec_mtp_catch_up runs, for each request of d[0, n) with k > 0 whose
 * pending rows end at N - 2 (n_tokens N), the head over them (its KV from the target's
 * features, up to position N - 2), and hands the last row to `last`: set fills its sampling
 * row (rows[r], a row of mtp's passes), take sees the sampled row and the head's feature
 * g(N - 2) ([d_model] floats, valid during the call). Requests not ready are skipped (take is
 * not called). false: a pass failed (what was taken stays taken). */
struct tdm_spec_mtp_last {
    void (*set)(void *ctx, struct tdm_sched_draft *x, int i, struct tdm_sample_row *rows, int r);
    void (*take)(void *ctx, struct tdm_sched_draft *x, int i, const struct tdm_sample_row *row,
                 const float *g);
    void *ctx;
};
/* The mtp drafter's kv_len (eagle's too, whose per-request state is mtp's): positions of the
 * head's KV made from the target's features, 0 for a request with a gap (dead). */
int tdm_spec_mtp_kv_len(void *ctx, const void *state);
/* Their reads_features: false once a request's head state is dead (a gap, or dropped). */
bool tdm_spec_mtp_reads_features(void *ctx, const void *state);
bool tdm_spec_mtp_catch_up(void *mtp, struct tdm_spec *sp, struct tdm_sched_draft *d, int n,
                           const struct tdm_spec_mtp_last *last);
tdm_engine_t *tdm_spec_mtp_engine(void *mtp); /* the head's engine (group 1 of the pool) */
/* The EAGLE-2 drafter (eagle.c): the same head's proposals as dynamic token trees. */
tdm_status tdm_spec_eagle_create(tdm_engine_t *target, const struct tdm_model *head,
                                 const struct tdm_spec_opts *o, struct tdm_spec_drafter *out);

/* ---- cost models (adapt.c): y = a + b x, exponentially weighted least squares ---- */
struct tdm_spec_cost {
    double w, sx, sy, sxx, sxy; /* decayed sums */
    uint64_t n;                 /* observations */
};
void tdm_spec_cost_observe(struct tdm_spec_cost *c, double x, double y);
/* The fitted line; with no spread in x yet, the pessimistic one through the origin (cost
 * proportional to x). false when nothing was observed. */
bool tdm_spec_cost_fit(const struct tdm_spec_cost *c, double *a, double *b);

/* ---- the controller (adapt.c) ---- */
struct tdm_spec_ctl {
    struct tdm_spec_cost verify; /* ns per target run, against the run's tokens */
    struct tdm_spec_cost draft;  /* ns per draft pass, against its sequences */
    float prior[TDM_SPEC_MAX_K]; /* batch-wide acceptance at each position given reached */
    int warmup;                  /* drafting steps left at a fixed small k, to measure */
    int cap;                     /* requests per step the scratch below holds */
    float *p;                    /* [cap][TDM_SPEC_MAX_K] */
    int *best, *cur;             /* [cap] */
};
tdm_status tdm_spec_ctl_init(struct tdm_spec_ctl *c, int max_seqs);
/* ---- the gate: what speculation really gained, measured (adapt.c) ----
 * The cost models are lines; real costs are not (a decode step replays a CUDA graph, a step
 * with drafts does not). So the controller's choices are also judged by their results: per
 * batch-size bucket (1, 2-3, 4-7, ...), the throughput (tokens published per second of draft
 * and verify time) of decode-only steps that drafted and of those that did not, each an
 * exponentially weighted mean. Where drafting measures slower, it is off, with a one-step
 * exploration every 32, 64, ... 256 steps, or more where a drafting step costs many (so that
 * exploring costs at most 1% of the time); where it is faster, one step in 32 runs without, to
 * keep the baseline current. The first steps of a bucket run without, to measure it; a bucket
 * larger than one where drafting measured slower starts off (drafting gets relatively dearer
 * as the batch grows) and only explores. */
enum { TDM_SPEC_GATE_BUCKETS = 8 };
struct tdm_spec_arm {
    double rate; /* tokens per ns */
    uint32_t n;
};
struct tdm_spec_gate {
    struct tdm_spec_arm arm[TDM_SPEC_GATE_BUCKETS][2]; /* [bucket][drafted] */
    uint32_t since[TDM_SPEC_GATE_BUCKETS], every[TDM_SPEC_GATE_BUCKETS];
    /* the step in progress; losing: drafting measured slower at this batch size (or at a
     * smaller one), so this step is off or one of the rare explorations; not while the
     * baseline is measured. A head fed meanwhile parks its rows rather than running over them,
     * and drops a request whose rows overflow (mtp.c). An exploring step counts as losing: its
     * drafts are made by the time the head is fed, and the next is many steps away, so a
     * request's rows are dropped whatever the phase of the explorations against the parking
     * (they once both ran every 64 steps, and the head ran over every row) */
    bool open, fresh, drafted, mixed, losing;
    int bucket, expect_tokens, tokens;
    double ns;
};
/* Closes the previous step's books and says whether this step (n decoding requests) may draft. */
bool tdm_spec_gate_begin(struct tdm_spec_gate *g, int n);
/* This step's drafting: drafted or not, and the tokens the plan should hold if decode-only. */
void tdm_spec_gate_planned(struct tdm_spec_gate *g, bool drafted, int expect_tokens);
void tdm_spec_gate_time(struct tdm_spec_gate *g, double ns);      /* a draft pass or the run */
void tdm_spec_gate_ran(struct tdm_spec_gate *g, int plan_tokens); /* after the run */
void tdm_spec_gate_tokens(struct tdm_spec_gate *g, int n);        /* a request's published */
void tdm_spec_ctl_free(struct tdm_spec_ctl *c);
/* Lowers each d[i].k to the chosen k (0 included). base_tokens: the step's decode tokens. */
void tdm_spec_ctl_choose(struct tdm_spec_ctl *c, struct tdm_sched_draft *d, int n, int base_tokens);
/* A decode step of one request ended: its decayed record and the batch-wide prior learn. */
void tdm_spec_ctl_learn(struct tdm_spec_ctl *c, struct tdm_draft_stats *st, int n_draft,
                        int n_accepted);

struct tdm_spec {
    struct tdm_spec_opts o;
    struct tdm_spec_gate gate;
    tdm_engine_t *target;
    int n_layers;     /* the target's */
    int draft_layers; /* a draft model's */
    struct tdm_spec_drafter dr;
    struct tdm_sched_drafter_i iface; /* what the scheduler calls */
    struct tdm_spec_ctl ctl;
    struct tdm_sched_draft *batch; /* [max_seqs] the drafts with k > 0 */
    int max_seqs;
    pthread_mutex_t mu; /* st */
    struct tdm_spec_stats st;
};

/* A drafter ran one forward pass over n_seqs sequences in ns. */
void tdm_spec_note_pass(struct tdm_spec *sp, int n_seqs, uint64_t ns);
/* A head drafter dropped a request's head state while the gate was shut (rows: the target's
 * feature rows it had parked, never run). */
void tdm_spec_note_head_dropped(struct tdm_spec *sp, int rows);

#endif /* TANDEM_SPEC_INT_H */
