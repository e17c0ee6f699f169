/*
 * The EAGLE-2 drafter (`--spec eagle`): the mtp head's proposals as a dynamic token tree, built
 * depth by depth from the head's own distribution and verified in the target's one forward pass
 * of the step (engine.h, struct tdm_batch_tree; the scheduler's tree spans, sched.h).
 *
 * The head and its KV are mtp.c's: the same per-request state, fed with the target's features
 * after each commit, and the same catch-up, which re-runs the head over the accepted positions
 * on the target's features (so the head's KV of the accepted path ends up exactly as the chain
 * drafter's would: the tree's own head KV is scratch, overwritten there) and ends at the row of
 * position N - 2 (N committed tokens), the root of the tree.
 *
 * One step, for a request (committed tokens [0, N), budget B, top-k K, depth D):
 *
 *      root row (N - 2): the head's top K tokens --> depth-1 nodes, cum = log q
 *        |
 *      for depth j = 1 .. D - 1:                     (one head pass per depth, all requests)
 *        frontier = the K depth-j nodes of the best cum (EAGLE-2's expansion)
 *        each frontier node x runs as a head row at position N - 2 + j, fed with its token
 *        and its parent's head feature, attending to the head's prefix [0, N - 1) and its own
 *        expanded ancestors (the head's tree: a tree span over group 1, one node per
 *        expanded node, in the slots of positions N - 1, N, ... of the request's pages,
 *        which the scheduler reserves as kv_scratch)
 *        its top K tokens --> depth-(j+1) nodes, cum = cum(x) + log q
 *      rerank: every node by (cum desc, depth asc, creation asc), the best B kept. A child's
 *        cum is at most its parent's and ties go to the shallower, so the kept nodes are a
 *        tree: every kept node's parent is kept. Output in (depth, rank) order: parents first.
 *
 * State diagram of one request's step (each arrow one pass of the head, batched over the
 * requests still drafting):
 *
 *   FED --catch-up--> ROOT --expand--> DEPTH 1 --expand--> ... DEPTH D-1 --rerank--> PROPOSED
 *    |                  |                                     (or: no node left to expand)
 *    +--(not ready)-----+--(a pass failed)--------------------------------------> NONE (n = 0)
 *
 *   transition   function                        when
 *   FED->ROOT    tdm_spec_mtp_catch_up (mtp.c)   the pending rows end at N - 2
 *   ROOT->D1     root_take                       the root row's top K came back
 *   Dj->Dj+1     expand                          j < min(D, B, k fixed) and a frontier
 *   ->PROPOSED   rerank                          after the last depth
 *
 * Draft probabilities are the head's raw softmax (the rows' top log-probabilities, computed
 * where the logits are: on the GPU with CUDA, so only K ids and values come back a row), not
 * the request's sampling settings: the tree ranks guesses; acceptance is what makes the output
 * lossless, whatever the guesses (sched.h: exact match in exact mode, multi-draft rejection
 * over each node's children otherwise).
 *
 * Ownership: owns the mtp machinery it drives and its scratch (sized at creation for every
 * request a step may hold); borrows the head model and the target. Scheduler thread.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

struct node {
    int32_t token;
    int16_t parent; /* index in the request's nodes; -1: the root (the last committed token) */
    int16_t depth;  /* 1 .. D */
    float cum;      /* the head's log-probability of the path */
    int16_t head;   /* its node in the head's tree once expanded; -1 */
    int16_t frow;   /* its row in its depth's frontier (where its head feature is) */
    int16_t out;    /* its index in the proposal once kept; -1 */
    int32_t gst;    /* structured output: the grammar's state after its path (unused without) */
};

struct ereq {           /* one request's step */
    struct node *nodes; /* [cap_nodes] */
    int n_nodes;
    int front[TDM_SAMPLE_MAX_CAND], n_front; /* this depth's expanded nodes */
    int depth_cap;
    int n_head;                             /* the head tree's nodes */
    int32_t head_slot[TDM_TREE_MAX_NODES];  /* their KV slots (group 1) */
    uint64_t head_mask[TDM_TREE_MAX_NODES]; /* their ancestors and themselves */
    float *feat[2]; /* [K][d] the head features of a depth's frontier rows: depth j's in
                     * feat[j & 1] (the next depth reads them as its parents') */
    float *g_root;  /* [d] the root row's */
    bool live;
};

struct eagle_drafter {
    struct tdm_spec_drafter mtp; /* the head's machinery (mtp.c) */
    tdm_engine_t *e;             /* the head's engine (mtp's) */
    int d, vocab, n, topk, depth, fixed_k, cap_nodes;
    int max_seqs, max_tokens, max_rows; /* the head engine's per pass */
    bool rejection;
    struct tdm_sampler greedy; /* the rows' sampler: the top log-probabilities only matter */
    struct ereq *req;          /* [n] */
    struct node *nodes;        /* [n][cap_nodes] */
    float *feats;              /* [n][2][K][d] */
    float *groot;              /* [n][d] */
    /* one head pass */
    struct tdm_batch_seq *seqs;   /* [max_seqs] */
    struct tdm_batch_tree *trees; /* [max_seqs] */
    int32_t *tok, *pos, *slots;   /* [max_tokens] */
    uint64_t *mask;               /* [max_tokens] */
    float *hid, *fout;            /* [max_tokens][d] */
    struct tdm_sample_row *rows;  /* [max_rows] */
    uint8_t *want;                /* [max_rows] */
    int *row_req;                 /* [max_rows] the request of each row */
    int *order;                   /* [TDM_TREE_MAX_NODES] the rerank's */
};

/* The slot of position p in a request's page table. */
static int32_t slot_of(const struct tdm_sched_draft *x, int p, int ps)
{
    return x->pages[p / ps] * ps + p % ps;
}

static void top_row(struct eagle_drafter *ed, struct tdm_sample_row *row)
{
    *row = (struct tdm_sample_row){
        .smp = &ed->greedy, .n_top = ed->topk, .mode = TDM_SAMPLE_DRAW, .token = -1};
}

/* The children of node `parent` (-1: the root) from a row's top tokens; under a grammar, only
 * those it allows after the parent's path (the target would refuse the others). */
static void add_children(struct eagle_drafter *ed, struct ereq *q, int parent,
                         const struct tdm_sample_row *row, const struct tdm_sched_draft *x)
{
    const float base = parent < 0 ? 0.0f : q->nodes[parent].cum;
    const int depth = parent < 0 ? 1 : q->nodes[parent].depth + 1;
    const int32_t pst = parent < 0 ? x->gstate : q->nodes[parent].gst;
    for (int c = 0; c < ed->topk && q->n_nodes < ed->cap_nodes; c++) {
        const float lp = row->top_lps[c];
        const int32_t t = row->top_ids[c];
        if (!isfinite(lp) || t < 0 || t >= ed->vocab) continue; /* outside a reduced vocab */
        const int32_t gst = x->grammar ? tdm_grammar_next(x->grammar, pst, t) : 0;
        if (gst < 0) continue;
        q->nodes[q->n_nodes++] = (struct node){.token = t,
                                               .parent = (int16_t)parent,
                                               .depth = (int16_t)depth,
                                               .cum = base + lp,
                                               .head = -1,
                                               .frow = -1,
                                               .out = -1,
                                               .gst = gst};
    }
}

/* Whether node a ranks before node b: the higher cumulative probability, then the shallower,
 * then the older (a parent before its children in every tie). */
static bool ranks_before(const struct node *nd, int a, int b)
{
    if (nd[a].cum != nd[b].cum) return nd[a].cum > nd[b].cum;
    if (nd[a].depth != nd[b].depth) return nd[a].depth < nd[b].depth;
    return a < b;
}

/* The `width` best nodes of q of depth `depth` (0: of any), in rank order, into out: an
 * insertion into a short sorted list (a step's trees hold a few hundred nodes at most).
 * Returns how many. */
static int best_nodes(const struct ereq *q, int depth, int width, int *out)
{
    int n = 0;
    for (int i = 0; i < q->n_nodes; i++) {
        if (depth && q->nodes[i].depth != depth) continue;
        int at = n;
        if (at == width) {
            if (!width || !ranks_before(q->nodes, i, out[width - 1])) continue;
            at = width - 1;
        } else {
            n++;
        }
        while (at > 0 && ranks_before(q->nodes, i, out[at - 1])) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = i;
    }
    return n;
}

/* The `width` best nodes of depth `depth` become the frontier (EAGLE-2's expansion). */
static void pick_frontier(struct ereq *q, int depth, int width)
{
    q->n_front = best_nodes(q, depth, width, q->front);
    for (int f = 0; f < q->n_front; f++)
        q->nodes[q->front[f]].frow = (int16_t)f;
}

static void root_set(void *ctx, struct tdm_sched_draft *x, int i, struct tdm_sample_row *rows,
                     int r)
{
    (void)x;
    (void)i;
    top_row(ctx, &rows[r]);
}

static void root_take(void *ctx, struct tdm_sched_draft *x, int i, const struct tdm_sample_row *row,
                      const float *g)
{
    struct eagle_drafter *ed = ctx;
    struct ereq *q = &ed->req[i];
    q->live = true;
    add_children(ed, q, -1, row, x);
    memcpy(q->g_root, g, (size_t)ed->d * sizeof(float));
}

static bool run(struct eagle_drafter *ed, struct tdm_spec *sp, int m, int rows)
{
    for (int r = 0; r < rows; r++)
        ed->want[r] = TDM_ROW_SAMPLE;
    struct tdm_batch b = {.seqs = ed->seqs, .n_seqs = m};
    struct tdm_engine_out out = {.want = ed->want, .samples = ed->rows};
    uint64_t t0 = tdm_now_ns();
    tdm_status st = tdm_engine_run(ed->e, &b, &out);
    tdm_spec_note_pass(sp, m, tdm_now_ns() - t0);
    if (st != TDM_OK) TDM_WARN("spec eagle: a head pass failed: %s", tdm_err_msg());
    return st == TDM_OK;
}

/* One depth for every request whose frontier is at depth j: its nodes run as head rows at
 * position N - 2 + j (in as many passes as the head's limits need), fed with their parents'
 * head features, and their children join the request's nodes. false: a pass failed. */
static bool expand(struct eagle_drafter *ed, struct tdm_spec *sp, struct tdm_sched_draft *d, int n,
                   int j)
{
    const int ps = tdm_kv_pool_config(tdm_engine_kv(ed->e))->page_size;
    const size_t row_bytes = (size_t)ed->d * sizeof(float);
    int next = 0;
    while (next < n) {
        int m = 0, t = 0;
        for (; next < n; next++) {
            struct ereq *q = &ed->req[next];
            if (!q->live || q->n_front == 0 || q->depth_cap <= j) continue;
            if (m == ed->max_seqs || t + q->n_front > ed->max_tokens ||
                t + q->n_front > ed->max_rows)
                break;
            const struct tdm_sched_draft *x = &d[next];
            const int N = x->n_tokens;
            if (N - 1 + q->n_head + q->n_front > x->n_pages * ps) { /* no scratch left */
                q->depth_cap = j;
                continue;
            }
            for (int f = 0; f < q->n_front; f++) {
                struct node *nd = &q->nodes[q->front[f]];
                const struct node *par = nd->parent < 0 ? NULL : &q->nodes[nd->parent];
                const int e = q->n_head++;
                nd->head = (int16_t)e;
                q->head_slot[e] = slot_of(x, N - 1 + e, ps);
                q->head_mask[e] = (par ? q->head_mask[par->head] : 0) | (uint64_t)1 << e;
                ed->tok[t + f] = nd->token;
                ed->pos[t + f] = N - 2 + j;
                ed->mask[t + f] = q->head_mask[e];
                ed->slots[t + f] = q->head_slot[e];
                const float *g = par ? q->feat[(j - 1) & 1] + (size_t)par->frow * ed->d : q->g_root;
                memcpy(ed->hid + (size_t)(t + f) * ed->d, g, row_bytes);
                top_row(ed, &ed->rows[t + f]);
                ed->row_req[t + f] = next;
            }
            ed->trees[m] = (struct tdm_batch_tree){.positions = ed->pos + t,
                                                   .mask = ed->mask + t,
                                                   .node_slots = q->head_slot,
                                                   .n_nodes = q->n_head};
            ed->seqs[m] = (struct tdm_batch_seq){.tokens = ed->tok + t,
                                                 .n_tokens = q->n_front,
                                                 .pos0 = N - 1,
                                                 .pages = x->pages,
                                                 .n_pages = x->n_pages,
                                                 .slots = ed->slots + t,
                                                 .n_logits = q->n_front,
                                                 .hidden = ed->hid + (size_t)t * ed->d,
                                                 .own_hidden = true,
                                                 .features = ed->fout + (size_t)t * ed->d,
                                                 .tree = &ed->trees[m]};
            m++;
            t += q->n_front;
        }
        if (!m) break;
        if (!run(ed, sp, m, t)) return false;
        /* the rows' features (the next depth's inputs) and children */
        for (int r = 0; r < t;) {
            struct ereq *q = &ed->req[ed->row_req[r]];
            memcpy(q->feat[j & 1], ed->fout + (size_t)r * ed->d, (size_t)q->n_front * row_bytes);
            const struct tdm_sched_draft *x = &d[ed->row_req[r]];
            for (int f = 0; f < q->n_front; f++, r++)
                add_children(ed, q, q->front[f], &ed->rows[r], x);
        }
    }
    return true;
}

/* The best `budget` nodes, in (depth, rank) order, as the request's proposal. */
static void rerank(struct eagle_drafter *ed, struct ereq *q, struct tdm_sched_draft *x)
{
    int *order = ed->order;
    const int keep = best_nodes(q, 0, TDM_MIN(x->k, TDM_TREE_MAX_NODES), order);
    int out = 0, deepest = 0;
    for (int r = 0; r < keep; r++)
        deepest = TDM_MAX(deepest, q->nodes[order[r]].depth);
    for (int depth = 1; depth <= deepest; depth++)
        for (int r = 0; r < keep; r++) {
            struct node *nd = &q->nodes[order[r]];
            if (nd->depth != depth) continue;
            /* kept nodes form a tree: a parent ranks before its children, so it is kept */
            TDM_ASSERT(nd->parent < 0 || q->nodes[nd->parent].out >= 0);
            nd->out = (int16_t)out;
            x->out[out] = nd->token;
            x->parent[out] = nd->parent < 0 ? -1 : q->nodes[nd->parent].out;
            out++;
        }
    x->n = out;
}

static void eagle_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct eagle_drafter *ed = ctx;
    n = TDM_MIN(n, ed->n);
    for (int i = 0; i < n; i++) {
        struct ereq *q = &ed->req[i];
        d[i].n = 0;
        d[i].tree_rejection = ed->rejection;
        q->live = false;
        q->n_nodes = q->n_head = q->n_front = 0;
        /* a tree of B nodes is at most B deep; k fixed caps the depth like a chain's k */
        q->depth_cap = TDM_MIN(TDM_MIN(ed->depth, d[i].k), d[i].depth_cap);
        if (ed->fixed_k > 0) q->depth_cap = TDM_MIN(q->depth_cap, ed->fixed_k);
        if (!d[i].parent) d[i].k = 0; /* the scheduler did not take trees */
    }
    /* the root: the head caught up to N - 2 on the target's features; its top K */
    const struct tdm_spec_mtp_last root = {root_set, root_take, ed};
    if (!tdm_spec_mtp_catch_up(ed->mtp.ctx, sp, d, n, &root)) return;
    /* EAGLE-2's expansion: the best K of each depth run, their top K are the next depth */
    for (int j = 1; j < ed->depth; j++) {
        bool any = false;
        for (int i = 0; i < n; i++) {
            struct ereq *q = &ed->req[i];
            if (!q->live || q->depth_cap <= j) continue;
            pick_frontier(q, j, TDM_MIN(ed->topk, TDM_MIN(ed->max_rows, ed->max_tokens)));
            any |= q->n_front > 0;
        }
        if (!any) break;
        if (!expand(ed, sp, d, n, j)) return; /* nothing proposed: d[i].n is 0 */
    }
    for (int i = 0; i < n; i++)
        if (ed->req[i].live) rerank(ed, &ed->req[i], &d[i]);
}

static void eagle_feed(void *ctx, struct tdm_spec *sp, const struct tdm_sched_feed *f, int n)
{
    struct eagle_drafter *ed = ctx;
    ed->mtp.feed(ed->mtp.ctx, sp, f, n);
}

static void eagle_destroy(void *ctx)
{
    struct eagle_drafter *ed = ctx;
    if (!ed) return;
    if (ed->mtp.destroy) ed->mtp.destroy(ed->mtp.ctx);
    tdm_sampler_free(&ed->greedy);
    free(ed->req);
    free(ed->nodes);
    free(ed->feats);
    free(ed->groot);
    free(ed->seqs);
    free(ed->trees);
    free(ed->tok);
    free(ed->pos);
    free(ed->slots);
    free(ed->mask);
    free(ed->hid);
    free(ed->fout);
    free(ed->rows);
    free(ed->want);
    free(ed->row_req);
    free(ed->order);
    free(ed);
}

tdm_status tdm_spec_eagle_create(tdm_engine_t *target, const struct tdm_model *head,
                                 const struct tdm_spec_opts *o, struct tdm_spec_drafter *out)
{
    const int budget = o->tree_budget ? o->tree_budget : TDM_SPEC_TREE_BUDGET;
    const int topk = o->tree_topk ? o->tree_topk : TDM_SPEC_TREE_TOPK;
    const int depth = o->tree_depth ? o->tree_depth : TDM_SPEC_TREE_DEPTH;
    if (budget < 1 || budget > TDM_TREE_MAX_NODES || topk < 1 || topk > TDM_SAMPLE_MAX_CAND ||
        depth < 1 || depth > TDM_SPEC_MAX_K)
        return tdm_err_set(TDM_EINVAL,
                           "spec eagle: tree budget %d (1 .. %d), top-k %d (1 .. %d), depth %d "
                           "(1 .. %d)",
                           budget, TDM_TREE_MAX_NODES, topk, TDM_SAMPLE_MAX_CAND, depth,
                           TDM_SPEC_MAX_K);
    if (topk * (depth - 1) > TDM_TREE_MAX_NODES)
        return tdm_err_set(TDM_EINVAL,
                           "spec eagle: top-k %d at depth %d expands %d nodes of the head's "
                           "own tree, at most %d (lower --spec-tree-topk or --spec-tree-depth)",
                           topk, depth, topk * (depth - 1), TDM_TREE_MAX_NODES);
    struct eagle_drafter *ed = calloc(1, sizeof *ed);
    if (!ed) return tdm_err_set(TDM_ENOMEM, "spec eagle: out of memory");
    tdm_status st = tdm_spec_mtp_create(target, head, TDM_SPEC_ACCEPT_EXACT, false, topk, &ed->mtp);
    if (st != TDM_OK) {
        free(ed);
        return st;
    }
    ed->e = tdm_spec_mtp_engine(ed->mtp.ctx);
    const struct tdm_engine_opts *ho = tdm_engine_opts(ed->e);
    const struct tdm_model_config *tc = &tdm_engine_model(target)->cfg;
    ed->d = tc->d_model;
    ed->vocab = tc->vocab_size;
    ed->n = ho->max_seqs;
    ed->topk = topk;
    ed->depth = depth;
    ed->fixed_k = o->k;
    ed->cap_nodes = topk + (depth - 1) * topk * topk;
    ed->max_seqs = ho->max_seqs;
    ed->max_tokens = ho->max_batch_tokens;
    ed->max_rows = ho->max_logit_rows;
    ed->rejection = o->accept == TDM_SPEC_ACCEPT_REJECTION;
    const size_t n = (size_t)ed->n, dd = (size_t)ed->d, K = (size_t)topk;
    const size_t T = (size_t)ed->max_tokens, R = (size_t)ed->max_rows;
    struct tdm_sampling_params g = tdm_sampling_defaults();
    st = tdm_sampler_init(&ed->greedy, &g, 0, ed->vocab);
    ed->req = calloc(n, sizeof *ed->req);
    ed->nodes = malloc(n * (size_t)ed->cap_nodes * sizeof *ed->nodes);
    ed->feats = malloc(n * 2 * K * dd * sizeof(float));
    ed->groot = malloc(n * dd * sizeof(float));
    ed->seqs = calloc((size_t)ed->max_seqs, sizeof *ed->seqs);
    ed->trees = calloc((size_t)ed->max_seqs, sizeof *ed->trees);
    ed->tok = malloc(T * sizeof *ed->tok);
    ed->pos = malloc(T * sizeof *ed->pos);
    ed->slots = malloc(T * sizeof *ed->slots);
    ed->mask = malloc(T * sizeof *ed->mask);
    ed->hid = malloc(T * dd * sizeof(float));
    ed->fout = malloc(T * dd * sizeof(float));
    ed->rows = calloc(R, sizeof *ed->rows);
    ed->want = malloc(R);
    ed->row_req = malloc(R * sizeof *ed->row_req);
    ed->order = malloc(TDM_TREE_MAX_NODES * sizeof *ed->order);
    if (st != TDM_OK || !ed->req || !ed->nodes || !ed->feats || !ed->groot || !ed->seqs ||
        !ed->trees || !ed->tok || !ed->pos || !ed->slots || !ed->mask || !ed->hid || !ed->fout ||
        !ed->rows || !ed->want || !ed->row_req || !ed->order) {
        eagle_destroy(ed);
        return st != TDM_OK ? st : tdm_err_set(TDM_ENOMEM, "spec eagle: out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        ed->req[i].nodes = ed->nodes + i * (size_t)ed->cap_nodes;
        ed->req[i].feat[0] = ed->feats + i * 2 * K * dd;
        ed->req[i].feat[1] = ed->req[i].feat[0] + K * dd;
        ed->req[i].g_root = ed->groot + i * dd;
    }
    *out = (struct tdm_spec_drafter){.name = "eagle",
                                     .ctx = ed,
                                     .propose = eagle_propose,
                                     .destroy = eagle_destroy,
                                     .feature_dim = ed->mtp.feature_dim,
                                     .state_bytes = ed->mtp.state_bytes,
                                     .feed = eagle_feed,
                                     .kv_len = tdm_spec_mtp_kv_len,
                                     .reads_features = tdm_spec_mtp_reads_features,
                                     .tree = true,
                                     .kv_scratch = topk * (depth - 1)};
    return TDM_OK;
}
