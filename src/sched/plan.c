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

_Static_assert(TDM_SPEC_MAX_K <= TDM_SAMPLE_MAX_UNDO,
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

void tdm_sched_requeue(struct tdm_sched *s, int i, bool preempted)
{
    struct tdm_req *r = s->running[i];
    tdm_kv_seq_release(s->kv, &r->kv);
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
            if (v != r && v->batch_slot == -1 && v->id > r->id &&
                tdm_req_state(v) == TDM_REQ_RUNNING) {
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

/* The span a request runs next: all that is left, capped by the budget and the chunk size. A
 * fixed-chunk request takes exactly its chunk (or what is left) or nothing. 0: it waits. */
static int next_span(struct tdm_sched *s, struct tdm_req *r, int budget)
{
    int left = r->n_tokens - r->n_cached;
    if (r->fixed_chunk > 0) {
        int span = TDM_MIN(left, r->fixed_chunk);
        return span <= budget ? span : 0;
    }
    return TDM_MIN(TDM_MIN(left, budget), s->o.prefill_chunk);
}

/* WAITING_REMOTE_KV requests whose fill ended: OK -> RUNNING with prompt[:-1] in the KV, a
 * failure -> WAITING with its pages released (the connector fenced them). */
static void land_remote(struct tdm_sched *s)
{
    for (int i = s->n_running - 1; i >= 0; i--) {
        struct tdm_req *r = s->running[i];
        if (tdm_req_state(r) != TDM_REQ_WAITING_REMOTE_KV) continue;
        int st = atomic_exchange(&r->remote, REMOTE_NONE);
        if (st == REMOTE_OK) {
            r->n_cached = r->n_tokens - 1;
            tdm_sched_set_state(r, TDM_REQ_RUNNING);
        } else if (st == REMOTE_FAILED) {
            tdm_sched_requeue(s, i, false);
        }
    }
}

/* Appends r's next `span` tokens to the plan. The span's last tokens, when it reaches the end
 * of the token list, are its output rows: one, plus one per draft. */
static void add_to_plan(struct tdm_sched *s, struct tdm_req *r, int span)
{
    struct tdm_sched_plan *p = &s->plan;
    struct tdm_plan_seq *q = &s->pseqs[p->n_seqs];
    int ps = s->page_size, pos0 = r->n_cached;
    bool last = pos0 + span == r->n_tokens;
    uint8_t want = r->want;
    int n_rows = last && want ? 1 + r->n_draft : 0;
    int32_t *slots = s->slots + p->n_tokens;
    for (int i = 0; i < span; i++) {
        int pos = pos0 + i;
        slots[i] = r->kv.pages[pos / ps] * ps + pos % ps;
    }
    *q = (struct tdm_plan_seq){.req = r,
                               .user = r->user,
                               .tokens = r->tokens + pos0,
                               .pos0 = pos0,
                               .n_tokens = span,
                               .pages = r->kv.pages,
                               .n_pages = r->kv.n_pages,
                               .slots = slots,
                               .row0 = p->n_rows,
                               .n_rows = n_rows,
                               .want = want,
                               .n_draft = r->n_draft,
                               .last = last,
                               .features = s->features && !r->prefill_only && r->spec_k >= 0
                                               ? s->features + (size_t)p->n_tokens * s->x.d_model
                                               : NULL};
    for (int i = 0; i < n_rows; i++) {
        int row = p->n_rows + i;
        s->want[row] = want;
        /* the row of the token at position x chooses the token at x + 1 */
        s->srows[row] =
            (struct tdm_sample_row){.smp = &r->smp,
                                    .position = (uint32_t)(pos0 + span - n_rows + i + 1),
                                    .n_top = r->top_k_lp};
        if (i < r->n_draft) {
            /* a verified row: its draft, the draft's distribution (rejection), and the drafts
             * after it, which the penalty state holds but this row must not see */
            int at = r->n_tokens - r->n_draft + i;
            struct tdm_sample_row *sr = &s->srows[row];
            sr->mode = TDM_SAMPLE_VERIFY;
            sr->draft = r->tokens[at];
            sr->q = r->draft_q ? r->draft_q + (size_t)i * s->vocab : NULL;
            sr->undo = r->tokens + at;
            sr->n_undo = r->n_draft - i;
        }
    }
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
    k = TDM_MIN(k, r->max_tokens - n_out - 1);    /* drafts + the target's token fit */
    k = TDM_MIN(k, s->max_ctx - r->n_tokens - 1); /* and their positions the context */
    k = TDM_MIN(k, s->max_rows - rows - 1 - rows_after);
    return TDM_MAX(k, 0);
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
        for (int j = 0; j < m; j++)
            tdm_sampler_accept(&r->smp, d->out[j], false);
        r->n_tokens += m;
        r->n_draft = m;
        r->draft_q = m ? d->q : NULL;
        unused += d->cap - m;
    }
    return unused;
}

/* Admits waiting requests FCFS while the budget, the sequence and row caps and the free pages
 * allow; stops at the first that does not fit. Returns the budget left. */
static int admit(struct tdm_sched *s, int budget)
{
    struct tdm_sched_plan *p = &s->plan;
    while (budget > 0 && s->n_running < s->o.max_seqs && p->n_rows < s->max_rows) {
        pthread_mutex_lock(&s->mu);
        struct tdm_req *r = s->wait_head;
        pthread_mutex_unlock(&s->mu);
        if (!r) break;
        int64_t need = (r->n_tokens + 1 + s->page_size - 1) / s->page_size;
        int64_t free_pages = tdm_kv_pool_stats(s->kv).free;
        if (need + (s->n_running ? s->o.watermark_pages : 0) > free_pages) break;
        bool remote = s->conn && s->conn->admit && !r->prefill_only && r->n_tokens >= 2;
        int span = remote ? r->n_tokens : next_span(s, r, budget);
        if (!span || tdm_kv_seq_reserve(s->kv, &r->kv, span) != TDM_OK) break;
        pthread_mutex_lock(&s->mu);
        s->wait_head = r->next;
        r->next = NULL;
        s->n_waiting--;
        pthread_mutex_unlock(&s->mu);
        running_insert(s, r);
        if (!r->counted) {
            r->counted = true;
            pthread_mutex_lock(&s->mmu);
            s->m.prompt_tokens += (uint64_t)r->n_prompt;
            pthread_mutex_unlock(&s->mmu);
        }
        if (remote) {
            tdm_sched_set_state(r, TDM_REQ_WAITING_REMOTE_KV);
            if (s->conn->admit(s->conn_ctx, r, r->user, r->tokens, r->n_tokens - 1, r->kv.pages,
                               r->kv.n_pages))
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
        n_decodes += tdm_req_state(r) == TDM_REQ_RUNNING && r->n_tokens - r->n_cached == 1;
    }
    int n_drafting = 0, base = 0, rows = 0;
    for (int i = 0; i < s->n_running && budget > 0; i++) {
        struct tdm_req *r = s->running[i];
        if (r->n_tokens - r->n_cached != 1 || tdm_req_state(r) != TDM_REQ_RUNNING) continue;
        n_decodes--;
        if (!reserve_or_preempt(s, r, r->n_tokens, true)) {
            i--; /* r left the array */
            continue;
        }
        /* the drafts' positions need pages before the drafter runs (it may write their KV) */
        int k = draft_cap(s, r, budget, rows, n_decodes);
        if (k && tdm_kv_seq_reserve(s->kv, &r->kv, r->n_tokens + k) != TDM_OK) k = 0;
        r->batch_slot = -2; /* decoding this step: never a preemption victim */
        s->decodes[base++] = r;
        if (k)
            s->drafts[n_drafting++] = (struct tdm_sched_draft){.req = r,
                                                               .tokens = r->tokens,
                                                               .n_tokens = r->n_tokens,
                                                               .pages = r->kv.pages,
                                                               .n_pages = r->kv.n_pages,
                                                               .smp = &r->smp,
                                                               .stats = &r->draft_stats,
                                                               .state = r->dstate,
                                                               .k = k,
                                                               .out = r->tokens + r->n_tokens};
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
        if (r->batch_slot >= 0 || tdm_req_state(r) != TDM_REQ_RUNNING) continue;
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
    for (int i = 0; i < s->n_running; i++)
        if (tdm_req_state(s->running[i]) == TDM_REQ_RUNNING) {
            stuck++;
            newest = i;
        }
    if (stuck > 1) {
        tdm_sched_requeue(s, newest, true);
        return true;
    }
    return false;
}
