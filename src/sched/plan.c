/*
 * The plan: which spans the next step runs (include/tandem/sched.h has the policy and the
 * request lifecycle). Everything here runs on the scheduler thread; s->mu is taken only to
 * touch the waiting list and the counts that other threads read.
 *
 * A plan is plain data in buffers the scheduler reserved at creation (s->pseqs, s->slots,
 * s->want, s->srows): building one allocates nothing but KV pages. KV slots are written out
 * per token, not left to be derived from positions, so that a drafter that verifies a tree
 * can later give siblings at one depth slots of their own.
 */
#include <stdlib.h>
#include <string.h>

#include "sched/sched_int.h"

_Static_assert(TDM_SPEC_MAX_K <= TDM_SAMPLE_MAX_UNDO && TDM_TREE_MAX_NODES <= TDM_SAMPLE_MAX_UNDO,
               "a verified row's undo list holds its span's drafts");

void tdm_sched_set_state(struct tdm_req *r, enum tdm_req_state st)
{
    atomic_store(&r->state, (int)st);
}

void tdm_sched_running_remove(struct tdm_sched *s, int i)
{
    memmove(&s->running[i], &s->running[i + 1],
            (size_t)(s->n_running - i - 1) * sizeof *s->running);
    pthread_mutex_lock(&s->mu);
    s->n_running--;
    if (!s->n_running && !s->n_waiting) pthread_cond_broadcast(&s->cv_idle);
    pthread_mutex_unlock(&s->mu);
}

static void running_insert(struct tdm_sched *s, struct tdm_req *r)
{
    int i = s->n_running;
    while (i > 0 && s->running[i - 1]->id > r->id) {
        s->running[i] = s->running[i - 1];
        i--;
    }
    s->running[i] = r;
    tdm_sched_set_state(r, TDM_REQ_RUNNING);
    pthread_mutex_lock(&s->mu);
    s->n_running++;
    pthread_mutex_unlock(&s->mu);
}

int tdm_sched_running_index(struct tdm_sched *s, const struct tdm_req *r)
{
    for (int i = 0; i < s->n_running; i++)
        if (s->running[i] == r) return i;
    return -1;
}

/* r speculates with a drafter that keeps KV of its own in r's pages (and says how far it is
 * final): what the prefix cache must cover too. */
static bool has_drafter_kv(const struct tdm_sched *s, const struct tdm_req *r)
{
    return s->drafter && s->drafter->kv_len && r->dstate && r->spec_k >= 0;
}

void tdm_sched_offer_prefix(struct tdm_sched *s, struct tdm_req *r)
{
    if (!s->prefix || atomic_load(&r->hung)) return;
    int done = r->n_cached;
    /* a drafter's own KV in the same pages must be final too (what a hit's cursor trusts); a
     * request that does not speculate never made it, so its pages are not offered */
    if (s->drafter && s->drafter->kv_len)
        done =
            TDM_MIN(done, has_drafter_kv(s, r) ? s->drafter->kv_len(s->drafter_ctx, r->dstate) : 0);
    int full = TDM_MIN(done / s->page_size, r->kv.n_pages);
    if (full <= r->prefix_pages) return;
    tdm_prefix_cache_insert(s->prefix, r->tokens, &r->kv, full);
    r->prefix_pages = full;
}

void tdm_sched_requeue(struct tdm_sched *s, int i, bool preempted)
{
    struct tdm_req *r = s->running[i];
    if (r->pending) { /* a launched step's token: that step's commit drops it (gen) */
        r->n_tokens--;
        r->pending = false;
    }
    r->gen++;
    tdm_sched_offer_prefix(s, r); /* its computed prefix waits for it in the cache */
    tdm_sched_release_kv(s, r);
    r->prefix_pages = 0;
    r->n_cached = 0;
    r->draft_stats.cursor = 0; /* a drafter's own KV went with the pages */
    if (r->dstate) memset(r->dstate, 0, s->drafter->state_bytes);
    r->batch_slot = -1;
    tdm_sched_running_remove(s, i);
    pthread_mutex_lock(&s->mu);
    struct tdm_req **pp = &s->wait_head;
    while (*pp && (*pp)->id < r->id)
        pp = &(*pp)->next;
    r->next = *pp;
    *pp = r;
    s->n_waiting++;
    tdm_sched_set_state(r, TDM_REQ_WAITING);
    pthread_mutex_unlock(&s->mu);
    if (!preempted) return;
    pthread_mutex_lock(&r->mu);
    r->n_preempted++;
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->mmu);
    s->m.preemptions++;
    pthread_mutex_unlock(&s->mmu);
}

/* A cancelled request ends as cancelled, or as stopped when its reader matched a stop string. */
static void finish_cancelled(struct tdm_sched *s, struct tdm_req *r)
{
    if (atomic_load(&r->stop))
        tdm_sched_finish(s, r, TDM_FINISH_STOP, TDM_OK, NULL);
    else
        tdm_sched_finish(s, r, TDM_FINISH_CANCELLED, TDM_ECANCELED, "cancelled");
}

void tdm_sched_reap_cancelled(struct tdm_sched *s, bool cancel_all)
{
    struct tdm_req *dead = NULL;
    pthread_mutex_lock(&s->mu);
    struct tdm_req **pp = &s->wait_head;
    while (*pp) {
        struct tdm_req *r = *pp;
        if (cancel_all || atomic_load(&r->cancel)) {
            *pp = r->next;
            s->n_waiting--;
            r->next = dead;
            dead = r;
        } else {
            pp = &r->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
    while (dead) {
        struct tdm_req *r = dead;
        dead = r->next;
        finish_cancelled(s, r);
    }
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct tdm_req *r = s->running[i];
        if (cancel_all || atomic_load(&r->cancel)) {
            tdm_sched_running_remove(s, i);
            finish_cancelled(s, r);
        }
    }
    pthread_mutex_lock(&s->mu);
    if (!s->n_running && !s->n_waiting) pthread_cond_broadcast(&s->cv_idle);
    pthread_mutex_unlock(&s->mu);
}

/* r runs a decode span next: its prompt is in the KV, one token is left to run, and (overlap)
 * a pending token does not end it: that token is its last (max_tokens, the context), which
 * the launched step's commit publishes. */
static bool decodes_next(const struct tdm_sched *s, const struct tdm_req *r)
{
    if (r->n_tokens - r->n_cached != 1 || tdm_req_state(r) != TDM_REQ_RUNNING) return false;
    return !r->pending || (r->n_tokens - r->n_prompt < r->max_tokens && r->n_tokens < s->max_ctx);
}

/* Makes r's page table cover n tokens, preempting the newest RUNNING requests that are newer
 * than r and not in this step's plan. When nothing is left to preempt: with may_self, r itself
 * goes back to the waiting list (it left the running array); false either way. */
static bool reserve_or_preempt(struct tdm_sched *s, struct tdm_req *r, int64_t n, bool may_self)
{
    for (;;) {
        if (tdm_kv_seq_reserve(s->kv, &r->kv, n) == TDM_OK) return true;
        int victim = -1;
        for (int i = s->n_running - 1; i >= 0; i--) {
            struct tdm_req *v = s->running[i];
            /* (not one a launched step holds: its pages stay in use until that step is
             * collected, so preempting it frees nothing now; sched.c collects first when the
             * pool runs dry) */
            if (v != r && v->batch_slot == -1 && v->id > r->id &&
                tdm_req_state(v) == TDM_REQ_RUNNING && !v->launches) {
                victim = i;
                break;
            }
        }
        if (victim < 0) {
            if (may_self) tdm_sched_requeue(s, tdm_sched_running_index(s, r), true);
            return false;
        }
        tdm_sched_requeue(s, victim, true);
    }
}

/* r's prompt spans score every position (prompt_logprobs): until its prompt is in the KV, so
 * a request preempted after its first output recomputes without scoring again. */
static bool scoring(const struct tdm_req *r)
{
    return r->score && r->n_tokens == r->n_prompt;
}

/* The span a request runs next: all that is left, capped by the budget and the chunk size (and
 * a scoring request's by the output rows the plan has left, one a token). A fixed-chunk
 * request takes exactly the rest of its chunk (the chunks end on positions congruent to its
 * chunk_phase; a request starting past a cached prefix may start inside one), or what is
 * left, or nothing. 0: it waits. */
static int next_span(struct tdm_sched *s, struct tdm_req *r, int budget)
{
    int left = r->n_tokens - r->n_cached;
    if (r->fixed_chunk > 0) {
        int c = r->fixed_chunk, into = ((r->n_cached - r->chunk_phase) % c + c) % c;
        int span = TDM_MIN(left, c - into);
        return span <= budget ? span : 0;
    }
    int span = TDM_MIN(TDM_MIN(left, budget), s->o.prefill_chunk);
    if (scoring(r)) span = TDM_MIN(span, s->max_rows - s->plan.n_rows);
    return TDM_MAX(span, 0);
}

/* What a remote fill brought the drafter (tdm_req_remote_done_feed): its own KV of
 * [0, drafter_kv) as stats->cursor, and the target's feature of the last prefilled position. */
static void feed_remote(struct tdm_sched *s, struct tdm_req *r)
{
    r->remote_fed = false;
    int p = r->n_tokens - 2;
    if (!s->drafter || !s->drafter->feed || !r->dstate || r->spec_k < 0 || p < 0) return;
    r->draft_stats.cursor = TDM_MIN(TDM_MAX(r->remote_drafter_kv, 0), p);
    struct tdm_sched_feed f = tdm_sched_feed_of(r, p, 1, r->remote_feature);
    s->drafter->feed(s->drafter_ctx, &f, 1);
}

/* WAITING_REMOTE_KV requests whose fill ended: OK -> RUNNING with prompt[:-1] in the KV (and
 * the drafter fed what came with it), a failure -> WAITING with its pages released (the
 * connector fenced them). */
static void land_remote(struct tdm_sched *s)
{
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct tdm_req *r = s->running[i];
        if (tdm_req_state(r) != TDM_REQ_WAITING_REMOTE_KV) continue;
        int st = atomic_exchange(&r->remote, REMOTE_NONE);
        if (st == REMOTE_OK) {
            r->n_cached = r->n_tokens - 1;
            tdm_sched_set_state(r, TDM_REQ_RUNNING);
            if (r->remote_fed) feed_remote(s, r);
        } else if (st == REMOTE_FAILED) {
            tdm_sched_requeue(s, i, false);
        }
    }
}

/* The mask of r's grammar at state st; a mask lost to memory denies everything, and the
 * commit then finishes the request with an error. */
static const uint32_t *grammar_mask(struct tdm_sched *s, struct tdm_req *r, int32_t st)
{
    const uint32_t *m = tdm_grammar_mask(r->grammar, st);
    return m ? m : s->deny_all;
}

void tdm_sched_refresh_rows(struct tdm_sched *s, struct tdm_sched_plan *p)
{
    for (int j = 0; j < p->n_seqs; j++) {
        const struct tdm_plan_seq *q = &p->seqs[j];
        struct tdm_req *r = q->req;
        /* a span's sampling row (no drafts with overlap): the grammar's state now */
        if (!r->grammar || q->n_rows <= q->n_score || tdm_req_state(r) == TDM_REQ_FINISHED)
            continue;
        TDM_ASSERT(!q->n_draft && !q->tree);
        p->samples[q->row0 + q->n_score].allow = grammar_mask(s, r, r->gstate);
    }
}

/* The tree of r's drafts as plan sequence q sees it (tdm_plan_seq.tree): span token i + 1 is
 * draft i at position pos0 + its depth, seeing its ancestors and itself; and each row's
 * sampling: the position after its token's, penalties less every draft off its path, and (in
 * rejection acceptance) its children as candidates. */
static void plan_tree(struct tdm_sched *s, struct tdm_req *r, struct tdm_plan_seq *q, int row0)
{
    const int n = r->n_draft, T = 1 + n, seq = (int)(q - s->pseqs);
    int32_t *pos = s->tree_pos + (size_t)seq * (1 + TDM_TREE_MAX_NODES);
    uint64_t *mask = s->tree_mask + (size_t)seq * (1 + TDM_TREE_MAX_NODES);
    pos[0] = q->pos0;
    mask[0] = 0; /* the last committed token: a chain token */
    for (int i = 1; i < T; i++) {
        const int par = r->tree_parent[i - 1] + 1; /* span index; 0 is the root */
        pos[i] = pos[par] + 1;
        mask[i] = mask[par] | (uint64_t)1 << (i - 1);
    }
    /* a grammar's state at each node: its parent's after its token (dead past a token the
     * grammar refuses: such a node's row is never reached, it takes its parent's mask) */
    int32_t gst[1 + TDM_TREE_MAX_NODES];
    if (r->grammar) {
        gst[0] = r->gstate;
        for (int i = 1; i < T; i++) {
            const int par = r->tree_parent[i - 1] + 1;
            int32_t g = tdm_grammar_next(r->grammar, gst[par], q->tokens[i]);
            gst[i] = g >= 0 ? g : gst[par];
        }
    }
    struct tdm_batch_tree *tr = &s->trees[seq];
    *tr = (struct tdm_batch_tree){
        .positions = pos, .mask = mask, .node_slots = q->slots + 1, .n_nodes = n};
    q->tree = tr;
    for (int i = 0; i < q->n_rows; i++) {
        const int row = row0 + i;
        struct tdm_sample_row *sr = &s->srows[row];
        sr->position = (uint32_t)pos[i] + 1;
        int32_t *undo = s->tree_undo + (size_t)row * TDM_TREE_MAX_NODES;
        int n_undo = 0;
        for (int j = 1; j < T; j++)
            if (!(mask[i] >> (j - 1) & 1)) undo[n_undo++] = q->tokens[j];
        sr->undo = n_undo ? undo : NULL;
        sr->n_undo = n_undo;
        sr->mode = TDM_SAMPLE_DRAW; /* exact: the target's keyed draw; the commit follows it */
        if (r->grammar) sr->allow = grammar_mask(s, r, gst[i]);
        if (!r->tree_rejection) continue;
        int32_t *cand = s->tree_cand + (size_t)row * TDM_SAMPLE_MAX_CAND;
        int n_cand = 0;
        for (int j = i; j < n; j++) /* children come after their parent */
            if (r->tree_parent[j] == i - 1) cand[n_cand++] = q->tokens[j + 1];
        if (n_cand) {
            sr->mode = TDM_SAMPLE_TREE;
            sr->cand = cand;
            sr->n_cand = n_cand;
        }
    }
}

/* Whether a span of r carries the target's features: a request that may speculate, here or
 * (prefill-only) on the node that decodes it, unless the drafter gave it up. */
static bool wants_features(const struct tdm_sched *s, const struct tdm_req *r)
{
    if (!s->features || r->spec_k < 0) return false;
    if (r->prefill_only || !r->dstate || !s->drafter || !s->drafter->reads_features) return true;
    return s->drafter->reads_features(s->drafter_ctx, r->dstate);
}

/* Appends r's next `span` tokens to the plan. The span's last tokens, when it reaches the end
 * of the token list, are its output rows: one, plus one per draft. A scoring span's every
 * token has a row: those that score the prompt's next token, then (at the prompt's end) the
 * one that samples. */
static void add_to_plan(struct tdm_sched *s, struct tdm_req *r, int span)
{
    struct tdm_sched_plan *p = &s->plan;
    struct tdm_plan_seq *q = &s->pseqs[p->n_seqs];
    int ps = s->page_size, pos0 = r->n_cached;
    bool last = pos0 + span == r->n_tokens;
    uint8_t want = r->want;
    int n_score = scoring(r) ? span - last : 0;
    int n_rows = n_score + (last && want ? 1 + r->n_draft : 0);
    int32_t *slots = s->slots + p->n_tokens;
    for (int i = 0; i < span; i++) {
        int pos = pos0 + i;
        slots[i] = r->kv.pages[pos / ps] * ps + pos % ps;
    }
    *q = (struct tdm_plan_seq){
        .req = r,
        .user = r->user,
        .tokens = r->tokens + pos0,
        .pos0 = pos0,
        .n_tokens = span,
        .pages = r->kv.pages,
        .n_pages = r->kv.n_pages,
        .slots = slots,
        .row0 = p->n_rows,
        .n_rows = n_rows,
        .n_score = n_score,
        .want = want,
        .n_draft = r->n_draft,
        .last = last,
        .features = wants_features(s, r) ? s->features + (size_t)p->n_tokens * s->feat_dim : NULL};
    int32_t gst = r->gstate; /* the grammar's state at the next sampling row */
    for (int i = 0; i < n_rows; i++) {
        int row = p->n_rows + i;
        s->want[row] = want;
        /* the row of the token at position x chooses the token at x + 1 */
        const int at_pos = pos0 + span - n_rows + i; /* the row's token's position */
        s->srows[row] = (struct tdm_sample_row){
            .smp = &r->smp, .position = (uint32_t)(at_pos + 1), .n_top = r->top_k_lp};
        if (i < n_score) { /* the prompt's next token, given: its log-probability */
            struct tdm_sample_row *sr = &s->srows[row];
            sr->mode = TDM_SAMPLE_SCORE;
            sr->draft = r->tokens[at_pos + 1];
            sr->n_top = r->p_top;
            continue;
        }
        const int d = i - n_score;    /* the sampling rows: the target's, then one per draft */
        if (r->grammar && !r->tree) { /* a tree's rows: plan_tree, by path */
            /* row d chooses after drafts 0..d-1; past a draft the grammar refuses, the rows
             * are never reached and keep the last live mask */
            s->srows[row].allow = grammar_mask(s, r, gst);
            if (d < r->n_draft) {
                int32_t g =
                    tdm_grammar_next(r->grammar, gst, r->tokens[r->n_tokens - r->n_draft + d]);
                if (g >= 0) gst = g;
            }
        }
        if (d < r->n_draft) {
            /* a verified row: its draft, the draft's distribution (rejection), and the drafts
             * after it, which the penalty state holds but this row must not see */
            int at = r->n_tokens - r->n_draft + d;
            struct tdm_sample_row *sr = &s->srows[row];
            sr->mode = TDM_SAMPLE_VERIFY;
            sr->draft = r->tokens[at];
            sr->q = r->draft_q ? r->draft_q + (size_t)d * s->vocab : NULL;
            sr->undo = r->tokens + at;
            sr->n_undo = r->n_draft - d;
        }
    }
    if (r->tree && r->n_draft && n_rows) plan_tree(s, r, q, p->n_rows);
    r->batch_slot = p->n_seqs++;
    p->n_tokens += span;
    p->n_rows += n_rows;
}

/* The most drafts r may get this step (0: none): its own and the drafter's cap, the budget,
 * max_tokens, the context and the output rows (rows: taken by the decodes before r;
 * rows_after: to keep for those after it). */
static int draft_cap(struct tdm_sched *s, struct tdm_req *r, int budget, int rows, int rows_after)
{
    if (!s->drafter || r->prefill_only || r->spec_k < 0) return 0;
    int n_out = r->n_tokens - r->n_prompt;
    int k = r->spec_k > 0 ? TDM_MIN(s->draft_k, r->spec_k) : s->draft_k;
    k = TDM_MIN(k, budget - 1);
    if (s->drafter->tree) { /* a tree's nodes fit the token list; its depth is what publishes */
        k = TDM_MIN(k, r->tokens_cap - r->n_tokens);
        if (r->max_tokens - n_out - 1 <= 0) k = 0;
    } else {
        k = TDM_MIN(k, r->max_tokens - n_out - 1); /* drafts + the target's token fit */
    }
    k = TDM_MIN(k, s->max_ctx - r->n_tokens - 1); /* and their positions (slots) the context */
    k = TDM_MIN(k, s->max_rows - rows - 1 - rows_after);
    return TDM_MAX(k, 0);
}

/* How many of a tree drafter's first m proposals form a tree the plan takes: each continues
 * the committed token or an earlier proposal, a node has at most TDM_SAMPLE_MAX_CAND children,
 * and the tree is at most TDM_SPEC_MAX_K deep (the statistics count by depth) and no deeper
 * than its depth_cap. The first proposal that breaks a rule ends it (a prefix of a tree in
 * parent-first order is a tree). */
static int tree_prefix(const struct tdm_sched_draft *d, int m)
{
    int depth[TDM_TREE_MAX_NODES], children[1 + TDM_TREE_MAX_NODES] = {0};
    m = TDM_MIN(m, TDM_TREE_MAX_NODES);
    for (int j = 0; j < m; j++) {
        const int par = d->parent[j];
        if (par < -1 || par >= j) return j;
        depth[j] = par < 0 ? 1 : depth[par] + 1;
        if (depth[j] > TDM_MIN(TDM_SPEC_MAX_K, d->depth_cap) ||
            children[par + 1] == TDM_SAMPLE_MAX_CAND)
            return j;
        children[par + 1]++;
    }
    return m;
}

/* The deepest draft of r worth proposing: past it, nothing could be published (max_tokens, the
 * context). A chain's is its k. */
static int depth_cap(const struct tdm_sched *s, const struct tdm_req *r, int k)
{
    if (!s->drafter->tree) return k;
    int n_out = r->n_tokens - r->n_prompt;
    return TDM_MAX(TDM_MIN(r->max_tokens - n_out - 1, s->max_ctx - r->n_tokens - 1), 0);
}

/* Hands the drafting batch to the drafter and appends what it proposed to each token list
 * (the drafts enter the penalty state too, which mirrors the token list; the commit rewinds
 * what is rejected). Returns the budget the drafts did not use. */
static int draft_batch(struct tdm_sched *s, int n, int base_tokens)
{
    int unused = 0;
    for (int i = 0; i < n; i++) {
        s->drafts[i].n = 0;
        s->drafts[i].cap = s->drafts[i].k; /* the drafter may lower k; the budget counted this */
    }
    if (n) s->drafter->propose(s->drafter_ctx, s->drafts, n, base_tokens);
    for (int i = 0; i < n; i++) {
        struct tdm_sched_draft *d = &s->drafts[i];
        struct tdm_req *r = d->req;
        int m = TDM_MAX(TDM_MIN(d->n, TDM_MIN(d->k, d->cap)), 0);
        for (int j = 0; j < m; j++)
            if (d->out[j] < 0 || d->out[j] >= s->vocab) {
                m = j; /* a drafter's bad token ends its proposal */
                break;
            }
        if (d->parent) m = tree_prefix(d, m);
        for (int j = 0; j < m; j++)
            tdm_sampler_accept(&r->smp, d->out[j], false);
        r->n_tokens += m;
        r->n_draft = m;
        r->draft_q = m && !d->parent ? d->q : NULL;
        r->tree = m && d->parent;
        r->tree_rejection = r->tree && d->tree_rejection;
        unused += d->cap - m;
    }
    return unused;
}

/* Groups share their prompt's KV unless the drafter reads features: a follower that takes the
 * KV has none of its prompt's features, and a feature drafter does not draft over a gap. */
static bool shares(const struct tdm_sched *s)
{
    return !(s->drafter && s->drafter->feed);
}

/* f is a follower whose leader is still to prefill the prompt (it will take the KV from it
 * then): passed over at admission. s->mu held (the leader's fields read are the scheduler
 * thread's, which this is). */
static bool follows_pending(const struct tdm_sched *s, const struct tdm_req *f)
{
    const struct tdm_req *l = f->leader;
    /* (a pending token is not an output yet: its step's commit forks the followers) */
    return l && shares(s) && tdm_req_state(l) != TDM_REQ_FINISHED &&
           l->n_tokens - l->pending == l->n_prompt;
}

/* Takes r out of the waiting list (the scheduler thread's only removal; submitters append). */
static void waiting_unlink(struct tdm_sched *s, struct tdm_req *r)
{
    pthread_mutex_lock(&s->mu);
    struct tdm_req **pp = &s->wait_head;
    while (*pp != r)
        pp = &(*pp)->next;
    *pp = r->next;
    r->next = NULL;
    s->n_waiting--;
    pthread_mutex_unlock(&s->mu);
}

static void count_prompt(struct tdm_sched *s, struct tdm_req *r)
{
    if (r->counted) return;
    r->counted = true;
    pthread_mutex_lock(&s->mmu);
    s->m.prompt_tokens += (uint64_t)r->n_prompt;
    pthread_mutex_unlock(&s->mmu);
}

void tdm_sched_fork_followers(struct tdm_sched *s, struct tdm_req *l)
{
    if (!shares(s)) return;
    const int keep = l->n_prompt - 1; /* each runs prompt[-1] itself, for its own first draw */
    while (s->n_running < s->o.max_seqs) {
        pthread_mutex_lock(&s->mu);
        struct tdm_req *f = s->wait_head;
        while (f && (f->leader != l || atomic_load(&f->cancel)))
            f = f->next;
        pthread_mutex_unlock(&s->mu);
        if (!f || tdm_kv_seq_share(s->kv, &f->kv, &l->kv, keep) != TDM_OK) return;
        waiting_unlink(s, f);
        f->n_cached = keep;
        running_insert(s, f);
        count_prompt(s, f);
    }
}

/* A request admit() matched in the prefix cache and then could not take: its pages back. */
static void unadmit(struct tdm_sched *s, struct tdm_req *r)
{
    tdm_kv_seq_release(s->kv, &r->kv);
    r->n_cached = 0;
    r->draft_stats.cursor = 0;
}

/* Admits waiting requests FCFS while the budget, the sequence and row caps and the free pages
 * allow; stops at the first that does not fit (followers waiting for their leader's prompt
 * are passed over). Returns the budget left. */
static int admit(struct tdm_sched *s, int budget)
{
    struct tdm_sched_plan *p = &s->plan;
    while (budget > 0 && s->n_running < s->o.max_seqs && p->n_rows < s->max_rows) {
        pthread_mutex_lock(&s->mu);
        struct tdm_req *r = s->wait_head;
        while (r && follows_pending(s, r))
            r = r->next;
        pthread_mutex_unlock(&s->mu);
        if (!r) break;
        /* the longest cached prefix, leaving its last token to run (not for a request that
         * scores every prompt position, nor a prefill node's request whose spans feed a head,
         * which needs the target's features of every position) */
        int hit = 0;
        if (s->prefix && !r->score && !r->kv.n_pages && !(r->prefill_only && r->spec_k >= 0))
            hit = tdm_prefix_cache_match(s->prefix, r->tokens, r->n_tokens,
                                         (r->n_tokens - 1) / s->page_size, &r->kv);
        r->n_cached = hit * s->page_size;
        /* a drafter with KV of its own finds it in the cached pages (offered only once it was
         * final there) */
        if (hit && has_drafter_kv(s, r)) r->draft_stats.cursor = r->n_cached;
        int64_t need = (r->n_tokens + 1 + s->page_size - 1) / s->page_size - hit;
        int64_t free_pages = tdm_kv_pool_stats(s->kv).free;
        int64_t mark = s->n_running ? s->o.watermark_pages : 0;
        if (s->prefix && need + mark > free_pages)
            free_pages += tdm_prefix_cache_evictable(s->prefix);
        if (need + mark > free_pages) {
            unadmit(s, r);
            break;
        }
        /* a scoring request prefills here: its prompt's rows are sampled where its KV is made */
        bool remote = s->conn && s->conn->admit && !r->prefill_only && !r->score &&
                      r->n_tokens - r->n_cached >= 2;
        int span = remote ? r->n_tokens - r->n_cached : next_span(s, r, budget);
        if (!span || tdm_kv_seq_reserve(s->kv, &r->kv, r->n_cached + span) != TDM_OK) {
            unadmit(s, r);
            break;
        }
        waiting_unlink(s, r);
        running_insert(s, r);
        if (!r->counted) {
            pthread_mutex_lock(&r->mu);
            r->cached_tokens = TDM_MIN(r->n_cached, r->n_prompt);
            pthread_mutex_unlock(&r->mu);
        }
        count_prompt(s, r);
        if (remote) {
            tdm_sched_set_state(r, TDM_REQ_WAITING_REMOTE_KV);
            if (s->conn->admit(s->conn_ctx, r, r->user, r->tokens, r->n_tokens - 1, r->n_cached,
                               r->kv.pages, r->kv.n_pages))
                continue;
            /* prefill here after all */
            tdm_sched_set_state(r, TDM_REQ_RUNNING);
            atomic_store(&r->remote, REMOTE_NONE);
            span = next_span(s, r, budget);
            if (!span) continue;
        }
        add_to_plan(s, r, span);
        budget -= span;
    }
    return budget;
}

bool tdm_sched_plan_build(struct tdm_sched *s)
{
    land_remote(s);
    struct tdm_sched_plan *p = &s->plan;
    *p = (struct tdm_sched_plan){.step = s->n_steps + 1,
                                 .seqs = s->pseqs,
                                 .want = s->want,
                                 .samples = s->srows,
                                 .logits = s->logits,
                                 .hidden = s->hidden};
    int budget = s->o.max_batch_tokens;
    for (int i = 0; i < s->n_running; i++)
        s->running[i]->batch_slot = -1;

    /* 1. decodes, oldest first */
    int n_decodes = 0;
    for (int i = 0; i < s->n_running; i++) {
        struct tdm_req *r = s->running[i];
        n_decodes += decodes_next(s, r);
    }
    int n_drafting = 0, base = 0, rows = 0;
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct tdm_req *r = s->running[i];
        if (!decodes_next(s, r)) continue;
        n_decodes--;
        if (!reserve_or_preempt(s, r, r->n_tokens, true)) {
            i--; /* r left the array */
            continue;
        }
        /* the drafts' positions need pages before the drafter runs (it may write their KV,
         * and a tree drafter its scratch past them) */
        int k = draft_cap(s, r, budget, rows, n_decodes);
        int64_t kv_need = r->n_tokens + k;
        if (k && s->drafter->tree)
            kv_need =
                TDM_MIN(TDM_MAX(kv_need, r->n_tokens - 1 + s->drafter->kv_scratch), s->max_ctx);
        if (k && tdm_kv_seq_reserve(s->kv, &r->kv, kv_need) != TDM_OK) k = 0;
        r->batch_slot = -2; /* decoding this step: never a preemption victim */
        s->decodes[base++] = r;
        if (k)
            s->drafts[n_drafting++] =
                (struct tdm_sched_draft){.req = r,
                                         .tokens = r->tokens,
                                         .n_tokens = r->n_tokens,
                                         .pages = r->kv.pages,
                                         .n_pages = r->kv.n_pages,
                                         .smp = &r->smp,
                                         .grammar = r->grammar,
                                         .gstate = r->gstate,
                                         .stats = &r->draft_stats,
                                         .state = r->dstate,
                                         .k = k,
                                         .out = r->tokens + r->n_tokens,
                                         .parent = s->drafter->tree ? r->tree_parent : NULL,
                                         .depth_cap = depth_cap(s, r, k)};
        budget -= 1 + k;
        rows += 1 + k;
    }
    budget += draft_batch(s, n_drafting, base);
    for (int i = 0; i < base; i++) {
        struct tdm_req *r = s->decodes[i];
        add_to_plan(s, r, 1 + r->n_draft);
    }
    /* 2. prefill spans of running requests */
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct tdm_req *r = s->running[i];
        if (r->batch_slot >= 0 || r->pending || tdm_req_state(r) != TDM_REQ_RUNNING) continue;
        if (s->plan.n_rows >= s->max_rows) break;
        int span = next_span(s, r, budget);
        if (!span || !reserve_or_preempt(s, r, r->n_cached + span, false)) continue;
        add_to_plan(s, r, span);
        budget -= span;
    }
    /* 3. admissions */
    admit(s, budget);
    if (p->n_seqs) {
        s->n_steps++;
        return true;
    }
    /* Nothing could run. If two or more requests are prefilling here and the pool is dry, the
     * newest gives its pages back so the older ones can go on. */
    int stuck = 0, newest = -1;
    for (int i = 0; i < s->n_running; i++) /* (a pending one ends with its launched step) */
        if (tdm_req_state(s->running[i]) == TDM_REQ_RUNNING && !s->running[i]->pending) {
            stuck++;
            newest = i;
        }
    if (stuck > 1) {
        tdm_sched_requeue(s, newest, true);
        return true;
    }
    return false;
}
