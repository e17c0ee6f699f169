/*
 * The commit: applies what a run of the plan brought back (scheduler thread). For each span
 * that reached the end of its token list, the rows' tokens are published in order; a drafted
 * span keeps its drafts while their rows accepted them (the rows were sampled in
 * TDM_SAMPLE_VERIFY mode, by the engine, where the logits are: the device on CUDA), then the
 * row's token at the first rejection (or after the last draft). What was rejected is
 * rewound: the drafts leave the token list and the penalty state (newest first), the KV keeps
 * only the positions that hold kept tokens, and pages past them go back to the pool.
 *
 * Publishing puts tokens and log-probabilities into the request's output under its r->mu; no
 * text is made here (reader.c renders it on the reader's thread), and nothing allocates.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched_int.h"

void tdm_sched_finish(struct tdm_sched *s, struct tdm_req *r, enum tdm_finish why, tdm_status err,
                      const char *msg)
{
    /* the connector first, while r still owns its pages (it may hold them for its transfers) */
    if (s->conn && s->conn->finished) s->conn->finished(s->conn_ctx, r, r->user, why);
    int64_t now = (int64_t)tdm_now_ns();
    /* the metrics and the pages before the client can see the end: whoever reads /metrics
     * or the pool after a response finds this request counted and its pages back */
    /* failed by the watchdog: it is an error, whatever ended it here, and its client has
     * seen that already */
    bool hung = atomic_load(&r->hung);
    if (hung) why = TDM_FINISH_ERROR;
    pthread_mutex_lock(&s->mmu);
    s->m.finished[why]++;
    if (why == TDM_FINISH_STOP || why == TDM_FINISH_LENGTH)
        tdm_hist_observe(&s->m.e2e_s, (double)(now - r->t_submit_ns) * 1e-9);
    pthread_mutex_unlock(&s->mmu);
    if (why != TDM_FINISH_ERROR) tdm_sched_offer_prefix(s, r); /* before its pages go back */
    tdm_sched_release_kv(s, r);
    r->n_cached = 0;
    tdm_sched_set_state(r, TDM_REQ_FINISHED);
    pthread_mutex_lock(&r->mu);
    if (!hung) {
        r->finish = why;
        r->error = err;
        if (msg) snprintf(r->error_msg, sizeof r->error_msg, "%s", msg);
        r->t_end_ns = now;
    }
    tdm_sched_req_news(r);
    pthread_mutex_unlock(&r->mu);
    tdm_sched_req_unref(r);
}

static bool is_stop_token(struct tdm_sched *s, struct tdm_req *r, int32_t t)
{
    int n_out = r->n_tokens - r->n_prompt; /* outputs including t */
    if (n_out <= r->min_tokens) return false;
    if (!r->ignore_eos)
        for (int i = 0; i < s->n_eos; i++)
            if (s->eos[i] == t) return true;
    for (int i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == t) return true;
    return false;
}

/* Publishes r's next token, sampled into sr: the token and its log-probabilities only (the
 * reader renders text). Returns the finish reason (NONE to go on). */
static enum tdm_finish publish(struct tdm_sched *s, struct tdm_req *r,
                               const struct tdm_sample_row *sr)
{
    int k = r->top_k_lp;
    float lp = sr->logprob;
    int32_t t = sr->token;
    bool complete = false;
    if (r->grammar) {
        /* the row was masked, so the token is allowed unless no allowed token had a logit the
         * sampler could take (all -inf or NaN), or the mask was lost */
        int32_t g = tdm_grammar_next(r->grammar, r->gstate, t);
        if (g < 0) return TDM_FINISH_ERROR;
        r->gstate = g;
        complete = tdm_grammar_complete(r->grammar, g);
    }
    tdm_sampler_accept(&r->smp, t, false);
    r->tokens[r->n_tokens++] = t;
    int64_t now = (int64_t)tdm_now_ns();

    bool stop = is_stop_token(s, r, t);
    pthread_mutex_lock(&r->mu);
    int i = r->n_out;
    if (r->logprobs) r->logprobs[i] = lp;
    if (k > 0) {
        memcpy(r->top_ids + (size_t)i * k, sr->top_ids, (size_t)k * sizeof(int32_t));
        memcpy(r->top_lps + (size_t)i * k, sr->top_lps, (size_t)k * sizeof(float));
    }
    if (stop) r->stop_at = i;
    r->n_out = i + 1;
    bool first = i == 0;
    if (first) r->t_first_ns = now;
    tdm_sched_req_news(r);
    pthread_mutex_unlock(&r->mu);

    pthread_mutex_lock(&s->mmu);
    s->m.generated_tokens++;
    if (first)
        tdm_hist_observe(&s->m.ttft_s, (double)(now - r->t_submit_ns) * 1e-9);
    else
        tdm_hist_observe(&s->m.itl_s, (double)(now - r->t_last_ns) * 1e-9);
    pthread_mutex_unlock(&s->mmu);
    r->t_last_ns = now;

    if (stop || complete) return TDM_FINISH_STOP;
    if (r->n_tokens - r->n_prompt >= r->max_tokens || r->n_tokens >= s->max_ctx)
        return TDM_FINISH_LENGTH;
    return TDM_FINISH_NONE;
}

/* Drops r's drafts from its token list and its penalty state (newest first). */
static void drop_drafts(struct tdm_req *r)
{
    for (; r->n_draft > 0; r->n_draft--)
        tdm_sampler_unaccept(&r->smp, r->tokens[--r->n_tokens]);
}

/* A verified token tree (tdm_plan_seq.tree): from the root (span token 0), each row's token is
 * published, and the walk goes on to the child whose draft is that token (exact: the target's
 * keyed draw; rejection: the candidate its TREE row kept, or a residual draw, which is no
 * child's), up to a row with no such child or the request's end. The path's KV moves from the
 * slots it was verified in (those of positions pos0 + its span indices) to its positions
 * (pos0 + 1 .. pos0 + accepted), in order: a node's span index is at least its depth, so each
 * move reads a slot no earlier move wrote. Its features move likewise, so the feed sees a
 * chain. Returns the finish reason; *accepted: the path's drafts. */
static enum tdm_finish commit_tree(struct tdm_sched *s, struct tdm_sched_plan *p, struct tdm_req *r,
                                   const struct tdm_plan_seq *q, int *accepted)
{
    const int n_draft = r->n_draft, committed = r->n_tokens - n_draft;
    int32_t drafts[TDM_TREE_MAX_NODES], path[TDM_TREE_MAX_NODES];
    memcpy(drafts, r->tokens + committed, (size_t)n_draft * sizeof *drafts);
    drop_drafts(r);
    enum tdm_finish f = TDM_FINISH_NONE;
    int node = 0, n = 0, off_first = 0, depth = 0;
    for (int j = 0; j < n_draft; j++)
        depth = TDM_MAX(depth, q->tree->positions[j + 1] - q->pos0);
    for (;;) {
        const struct tdm_sample_row *sr = &p->samples[q->row0 + q->n_score + node];
        f = publish(s, r, sr);
        if (f != TDM_FINISH_NONE) break;
        int child = -1, rank = 0;
        for (int j = node; j < n_draft && child < 0; j++) /* children come after their parent */
            if (r->tree_parent[j] == node - 1) {
                if (drafts[j] == sr->token)
                    child = j + 1;
                else
                    rank++;
            }
        if (child < 0) break;
        off_first += rank > 0;
        path[n++] = child;
        node = child;
    }
    int32_t src[TDM_TREE_MAX_NODES], dst[TDM_TREE_MAX_NODES];
    int moves = 0;
    for (int d = 1; d <= n; d++) {
        if (path[d - 1] == d) continue;
        src[moves] = q->slots[path[d - 1]];
        dst[moves++] = q->slots[d];
        if (q->features)
            memcpy(q->features + (size_t)d * s->feat_dim,
                   q->features + (size_t)path[d - 1] * s->feat_dim,
                   (size_t)s->feat_dim * sizeof(float));
    }
    if (moves) tdm_kv_pool_copy_slots(s->kv, src, dst, moves);
    r->draft_stats.tree_depth = depth;
    r->draft_stats.tree_off_first = off_first;
    *accepted = n;
    return f;
}

/* Publishes the rows of r's last span; returns the finish reason (NONE to go on). */
static enum tdm_finish commit_rows(struct tdm_sched *s, struct tdm_sched_plan *p, struct tdm_req *r,
                                   const struct tdm_plan_seq *q)
{
    int n_draft = r->n_draft, committed = r->n_tokens - n_draft, accepted = 0;
    /* statistics by draft position; a tree's by depth */
    int n_positions = n_draft;
    enum tdm_finish f = TDM_FINISH_NONE;
    r->draft_stats.tree_depth = r->draft_stats.tree_off_first = 0;
    if (r->tree && n_draft && q->tree) {
        f = commit_tree(s, p, r, q, &accepted);
        n_positions = r->draft_stats.tree_depth;
    } else {
        drop_drafts(r); /* the rows below put back what is kept, in order */
        for (int i = 0; i <= n_draft; i++) {
            int row = q->row0 + q->n_score + i;
            struct tdm_sample_row *sr = &p->samples[row];
            /* the row verified its draft where it was sampled (TDM_SAMPLE_VERIFY) */
            bool kept = i < n_draft && sr->kept && sr->token == r->tokens[committed + i];
            f = publish(s, r, sr);
            if (f != TDM_FINISH_NONE || i == n_draft || !kept) break;
            accepted++;
        }
    }
    r->tree = false;
    if (n_draft) {
        /* the KV holds the kept tokens' positions: up to the last accepted draft */
        r->n_cached = TDM_MIN(r->n_cached, committed + accepted);
        r->draft_q = NULL;
        for (int i = 0; i < n_positions && i <= accepted && i < TDM_SPEC_MAX_K; i++) {
            r->draft_stats.reached[i] += 1;
            r->draft_stats.kept[i] += i < accepted;
        }
    }
    /* pages reserved for drafts that were not proposed or not kept go back too */
    if (s->drafter) tdm_kv_seq_trim(s->kv, &r->kv, r->n_cached);
    /* a decode step, not the prompt's end; or the first step of a request whose prompt was
     * prefilled elsewhere, which may have verified drafts too */
    if (s->drafter && (committed > r->n_prompt || n_draft)) {
        r->draft_stats.steps++;
        r->draft_stats.idle_steps = n_draft ? 0 : r->draft_stats.idle_steps + 1;
        if (s->drafter->accepted)
            s->drafter->accepted(s->drafter_ctx, r, &r->draft_stats, n_draft, accepted,
                                 r->n_tokens - committed);
    }
    return f;
}

/* Publishes the prompt scores of q's SCORE rows: the row of position x holds prompt token
 * x + 1's log-probability. A span recomputed after a preemption writes the same positions
 * again. */
static void commit_scores(const struct tdm_sched_plan *p, struct tdm_req *r,
                          const struct tdm_plan_seq *q)
{
    const int k = r->p_top;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < q->n_score; i++) {
        const struct tdm_sample_row *sr = &p->samples[q->row0 + i];
        const size_t at = (size_t)(q->pos0 + i + 1);
        r->p_lps[at] = sr->logprob;
        if (k) {
            memcpy(r->p_top_ids + at * k, sr->top_ids, (size_t)k * sizeof(int32_t));
            memcpy(r->p_top_lps + at * k, sr->top_lps, (size_t)k * sizeof(float));
        }
    }
    r->n_scored = TDM_MAX(r->n_scored, q->pos0 + q->n_score);
    tdm_sched_req_news(r);
    pthread_mutex_unlock(&r->mu);
}

/* Whether span j of a launched plan still belongs to its request (not finished or requeued
 * since it was planned: then its pages and KV are gone and its rows are dropped). Its
 * TDM_TOKEN_PREV placeholder, if any, leaves the token list: the commit puts the token. */
static bool still_ours(struct tdm_req *r, const uint32_t *gens, int j)
{
    if (!gens) return true;
    if (tdm_req_state(r) == TDM_REQ_FINISHED || r->gen != gens[j]) return false;
    if (r->pending) {
        r->n_tokens--;
        r->pending = false;
    }
    return true;
}

void tdm_sched_commit(struct tdm_sched *s, struct tdm_sched_plan *p, const uint32_t *gens,
                      tdm_status st)
{
    if (st != TDM_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "forward pass failed: %s", tdm_err_msg());
        TDM_ERROR("sched: %s", msg);
        for (int j = 0; j < p->n_seqs; j++) {
            struct tdm_req *r = p->seqs[j].req;
            if (!still_ours(r, gens, j)) continue;
            r->batch_slot = -1;
            drop_drafts(r);
            tdm_sched_running_remove(s, tdm_sched_running_index(s, r));
            tdm_sched_finish(s, r, TDM_FINISH_ERROR, st, msg);
        }
        return;
    }
    int n_feeds = 0;
    for (int j = 0; j < p->n_seqs; j++) {
        const struct tdm_plan_seq *q = &p->seqs[j];
        struct tdm_req *r = q->req;
        if (!still_ours(r, gens, j)) continue;
        r->batch_slot = -1;
        r->n_cached = q->pos0 + q->n_tokens;
        if (atomic_load(&r->hung)) { /* the watchdog failed it while this step was stuck */
            drop_drafts(r);
            tdm_sched_running_remove(s, tdm_sched_running_index(s, r));
            tdm_sched_finish(s, r, TDM_FINISH_ERROR, TDM_ETIMEDOUT, NULL);
            continue;
        }
        if (q->n_score) commit_scores(p, r, q);
        /* the prompt is in the KV: a group's followers take it, before r may end here */
        if (q->last && r->has_followers && r->n_tokens - r->n_draft == r->n_prompt)
            tdm_sched_fork_followers(s, r);
        enum tdm_finish f = TDM_FINISH_NONE;
        /* a prefill-only request ends with its prompt; so does one that only scores it
         * (max_tokens 0: its sampled row is dropped) */
        if (q->last)
            f = r->prefill_only  ? TDM_FINISH_STOP
                : !r->max_tokens ? TDM_FINISH_LENGTH
                                 : commit_rows(s, p, r, q);
        if (f == TDM_FINISH_NONE) tdm_sched_offer_prefix(s, r);
        if (f == TDM_FINISH_ERROR) { /* only a grammar's refusal (publish) */
            tdm_sched_running_remove(s, tdm_sched_running_index(s, r));
            tdm_sched_finish(s, r, f, TDM_EINVAL,
                             "structured output: the grammar allows no token the model can take "
                             "here (every allowed logit is -inf or NaN)");
        } else if (f != TDM_FINISH_NONE) {
            tdm_sched_running_remove(s, tdm_sched_running_index(s, r));
            tdm_sched_finish(s, r, f, TDM_OK, NULL);
        } else if (q->features && s->feeds && !r->prefill_only && r->n_cached > q->pos0) {
            /* the kept positions' features, for a drafter that reads them (a prefill-only
             * request's are its connector's, read in step_end) */
            s->feeds[n_feeds++] = tdm_sched_feed_of(r, q->pos0, r->n_cached - q->pos0, q->features);
        }
    }
    if (n_feeds) s->drafter->feed(s->drafter_ctx, s->feeds, n_feeds);
}
