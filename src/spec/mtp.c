/*
 * The MTP head drafter: a one-layer head (model.h, struct tdm_head) fed with the target's
 * hidden states, run as a chain on an engine of its own whose one layer is layer group 1 of
 * the target's pool (one page table per request, as for a draft model).
 *
 * The shift (seed 004, MTP). The head's row at position p reads the token t(p+1) and the
 * target's feature h(p) (the final-normed state whose logits chose t(p+1)) and proposes
 * t(p+2). So a request with committed tokens [0, N) drafts from the row at p = N - 2, and each
 * draft j + 1 from the row at N - 2 + j fed with draft j and the head's own feature of the row
 * before (the head feeds on itself further out).
 *
 * Features. The scheduler downloads the target's feature of every token of a speculating
 * request's spans and feeds, after each commit, those of the positions it kept
 * (tdm_sched_feed): the prompt's, then per decode step the last committed token's and the
 * accepted drafts'. Per request (the scheduler's state_bytes, struct mtp_req):
 *
 *   head KV from the target's features      pending features        (draft-fed KV, stale)
 *   [0 .............. head_len)   [head_len ... head_len + n_pend)   [... N + k - 2)
 *
 * Feeding appends to the pending rows; when they would overflow (a long prompt, or a request
 * that has not drafted for many steps), the head runs at once over all but the last (eager
 * catch-up, no logits), except while the gate keeps drafting off (--spec-k auto, spec.c): a
 * decoding request's head state is then dropped rather than run (dead, as for a gap), so a
 * head the gate shut costs a decode step nothing. Proposing first runs the
 * pending rows, which must end at N - 2: this rewrites the head's KV past head_len with the
 * target's features, replacing what the previous step's drafts wrote there ("when its KV is
 * refilled, the head runs again over the accepted span on the target's hidden states"), and
 * its last row draws draft 1; then one pass per depth.
 *
 * A prompt whose KV came from another node (disagg.h) leaves a gap in the features: the
 * scheduler feeds nothing for positions [0, N - 1). When the prefill node ran this same head
 * over them (tdm_spec_head_kv, below), the head's KV of [0, N - 2) landed with the pages and
 * the context brought h(N - 2): the scheduler then sets stats->cursor to N - 2 and feeds that
 * one feature at N - 2, so head_len = N - 2, pend = [h(N - 2)] and the request drafts at its
 * first step (prompt[-1], whose row verifies draft 1 = the first output token). Any other gap
 * leaves the request without drafts until its pages go back (dead). A prefix from the prefix
 * cache is such a gap too, covered the same way: the scheduler offers a page only once head_len
 * covers it (tdm_spec_mtp_kv_len), and sets the cursor of a request that reuses it to the
 * prefix's end, so the head's KV of the cached pages becomes its own.
 *
 * Draws are the chain's: the request's keyed draw (exact) or PROPOSE rows with q (rejection).
 *
 * An EAGLE-3 head (model.h) reads a wider target feature (fw = 3 d: the residual entering its
 * three target layers, which the target engine copies when tdm_spec_engine_opts asked for
 * them): pending rows and the catch-up's inputs are fw wide, while the head's own feature (g,
 * its state before the final norm) stays d wide; the deeper drafts' and the trees' passes
 * mark their hidden states own_hidden, so its engine skips fc there. Beside a sharded target
 * it is sharded like the others (below). Across disaggregation the prefill node's target gives
 * the same fused features (its engine made by tdm_spec_engine_opts), tdm_spec_head_kv runs the
 * head over them exactly as the catch-up here, and the context brings the fused feature of
 * N - 2 (disagg.h: the request says its width), which the scheduler feeds like any other.
 *
 * The same head on a prefill node (tdm_spec_head_kv, spec.h): an engine of its own beside the
 * prefill node's target that runs the head's rows over what that node prefilled, from the
 * target's features there, so that the head's KV streams to the decoder as one more layer
 * (disagg.h). It is the same engine call as the catch-up here, so the KV is the same bit for
 * bit on a batch-invariant backend. tdm_spec_head_fingerprint tells two nodes' heads apart.
 *
 * Tensor parallelism: beside a sharded target (--tp N) the head's engine is sharded like it
 * (engine.h, tdm_engine_opts.shard_like): group 1 of each rank's pool holds that rank's share
 * of the head's KV heads, and the head's passes run on the target's rank threads. Nothing here
 * changes: the head's engine is still one engine, its leader returning whole outputs.
 *
 * Ownership: owns the head's engine and its scratch; borrows the head model, the target's
 * pool and backend (a sharded target's: every rank's). Scheduler thread.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"
#include "tandem/tp.h"

/* A request's pending rows: at least a verified span (the last token and k drafts); up to
 * PEND_MAX while a request's rows fit PEND_BYTES (the scheduler allocates the state of every
 * request it holds, queued ones too), so that a request not drafting (the gate shut, or k 0)
 * runs the head over many steps' rows at once, or, when it drops them, never (mtp_feed). */
#define PEND_MIN   (TDM_SPEC_MAX_K + 1)
#define PEND_MAX   64
#define PEND_BYTES ((size_t)256 << 10)

struct mtp_req {
    int32_t head_len; /* the head's KV holds [0, head_len), made from the target's features */
    int32_t n_pend;   /* the target's features of [head_len, head_len + n_pend) wait in pend */
    int32_t dead;     /* a gap in the features: no drafts */
    /* --spec-overlap: launched in pass gen (0: never) at span [lpos0, lpos0 + lrows), its rows
     * from lrow0 in the pass's outputs; carry: the row whose logits draw draft 1 (-1: none) */
    int32_t carry;
    uint32_t gen;
    int32_t lpos0, lrow0, lrows;
    float pend[]; /* [pend_cap][fw] */
};

struct mtp_drafter {
    tdm_engine_t *e; /* the head's */
    int d, vocab, max_seqs, max_tokens;
    int fw;       /* the target feature's width: d, or an EAGLE-3 head's fused 3 d */
    int pend_cap; /* rows of struct mtp_req's pend */
    bool rejection, one_hot;
    struct tdm_batch_seq *seqs;     /* [max_seqs] */
    struct tdm_sample_row *rows;    /* [max_seqs] */
    uint8_t *want;                  /* [max_seqs] */
    int *idx, *n_acc, *done, *todo; /* [max_seqs] */
    size_t *foff;                   /* [max_seqs] where a request's last head feature lands */
    int32_t *tok;                   /* [max_seqs] */
    float *hid;                     /* [max_tokens][fw] a pass's hidden inputs */
    float *fout;                    /* [max_tokens][d] a pass's head features */
    float *g;                       /* [max_seqs][d] each drafting request's last head feature */
    struct tdm_buf qbuf; /* rejection: [max_seqs][TDM_SPEC_MAX_K][vocab], the backend's */
    float *q;
    struct tdm_spec_draws dw;
    struct overlap *ov; /* --spec-overlap's pass on a thread of its own; NULL without */
};

/* --spec-overlap (below) */
struct overlap {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool started, stop, busy; /* busy: a pass queued or running (under mu) */
    uint32_t gen;             /* the latest launch's (0: none yet) */
    int cap, m, rows;         /* rows a pass takes; the queued pass's sequences and rows */
    tdm_status st;            /* the latest pass's result, and its time */
    uint64_t ns;
    bool noted, ok;             /* its time given to the cost model; it ran */
    struct tdm_batch_seq *seqs; /* [max_seqs] */
    int32_t *tok;               /* [cap] the rows' input tokens */
    float *hid;                 /* [cap][fw] the target's features */
    float *fout;                /* [cap][d] the head's features */
    float *logits;              /* [cap][vocab] */
    uint8_t *want;              /* [cap] */
    int32_t *pages;             /* the launched page tables, copied */
    size_t n_page_cap;
    struct tdm_sample_row row;
    struct tdm_sample_scratch scratch;
};
static void ov_join(struct mtp_drafter *md, struct tdm_spec *sp);

/* Row r of a request's pending rows followed by n fed rows. */
static const float *vrow(const struct mtp_drafter *md, const struct mtp_req *st, const float *fed,
                         int r)
{
    return r < st->n_pend ? st->pend + (size_t)r * md->fw : fed + (size_t)(r - st->n_pend) * md->fw;
}

static bool run_pass(struct mtp_drafter *md, struct tdm_spec *sp, int m, int rows)
{
    struct tdm_batch b = {.seqs = md->seqs, .n_seqs = m};
    for (int r = 0; r < rows; r++)
        md->want[r] = TDM_ROW_SAMPLE;
    struct tdm_engine_out out = {.want = rows ? md->want : NULL, .samples = rows ? md->rows : NULL};
    uint64_t t0 = tdm_now_ns();
    tdm_status st = tdm_engine_run(md->e, &b, &out);
    tdm_spec_note_pass(sp, m, tdm_now_ns() - t0);
    if (st != TDM_OK) TDM_WARN("spec mtp: a head pass failed: %s", tdm_err_msg());
    return st == TDM_OK;
}

static void mtp_feed(void *ctx, struct tdm_spec *sp, const struct tdm_sched_feed *f, int n)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->fw * sizeof(float);
    n = TDM_MIN(n, md->max_seqs);
    bool eager = false;
    for (int i = 0; i < n; i++) {
        struct mtp_req *st = f[i].state;
        md->todo[i] = -1;
        if (!st || st->dead) continue;
        int p0 = f[i].pos0, m = f[i].n;
        if (p0 < st->head_len) { /* new features from p0 on supersede the head's KV there */
            st->head_len = p0;
            st->n_pend = 0;
        } else if (p0 > st->head_len + st->n_pend) {
            /* a gap: positions before p0 ran elsewhere (a remote prefill). The head's KV of
             * them came with the pages when the prefill node ran this head (the scheduler
             * says so in stats->cursor); otherwise no drafts until the pages go back */
            if (!f[i].stats || f[i].stats->cursor < p0) {
                st->dead = 1;
                continue;
            }
            st->head_len = p0;
            st->n_pend = 0;
        } else {
            st->n_pend = p0 - st->head_len;
        }
        st->carry = -1; /* a launched span, kept [p0, p0 + m): its last kept row draws */
        if (md->ov && st->gen == md->ov->gen && st->lpos0 == p0 && !st->n_pend && m <= st->lrows)
            st->carry = st->lrow0 + m - 1;
        if (st->n_pend + m <= md->pend_cap) {
            memcpy(st->pend + (size_t)st->n_pend * md->fw, f[i].features, (size_t)m * row);
            st->n_pend += m;
            continue;
        }
        if (sp->gate.losing && f[i].stats && f[i].stats->steps > 0) {
            /* drafting is off (--spec-k auto measured it losing here): running the head over
             * these rows would cost every decode step a head layer for drafts that may never
             * come, so the request's head state goes instead (it drafts no more, like a gap);
             * prompts are still run, so that the gate's explorations have requests to draft */
            tdm_spec_note_head_dropped(sp, st->n_pend + m);
            st->dead = 1;
            st->n_pend = 0;
            continue;
        }
        md->todo[i] = st->n_pend + m - 1; /* all but the last row, now */
        md->done[i] = 0;
        eager = true;
    }
    bool ok = true;
    if (eager) ov_join(md, sp); /* the head's engine may be running a launched pass */
    while (eager && ok) {
        int m = 0, budget = md->max_tokens;
        size_t off = 0;
        for (int i = 0; i < n && m < md->max_seqs && budget > 0; i++) {
            if (md->todo[i] < 0 || md->done[i] >= md->todo[i]) continue;
            const struct mtp_req *st = f[i].state;
            int span = TDM_MIN(md->todo[i] - md->done[i], budget);
            for (int r = 0; r < span; r++)
                memcpy(md->hid + off + (size_t)r * md->fw,
                       vrow(md, st, f[i].features, md->done[i] + r), row);
            int p = st->head_len + md->done[i];
            md->seqs[m++] = (struct tdm_batch_seq){.tokens = f[i].tokens + p + 1,
                                                   .n_tokens = span,
                                                   .pos0 = p,
                                                   .pages = f[i].pages,
                                                   .n_pages = f[i].n_pages,
                                                   .hidden = md->hid + off};
            off += (size_t)span * md->fw;
            md->done[i] += span;
            budget -= span;
        }
        if (!m) break;
        ok = run_pass(md, sp, m, 0);
    }
    for (int i = 0; i < n; i++) {
        struct mtp_req *st = f[i].state;
        if (md->todo[i] < 0) continue;
        if (!ok) { /* the head's KV is unknown past head_len: start over there next time */
            st->dead = 1;
            continue;
        }
        st->head_len += md->todo[i];
        memcpy(st->pend, f[i].features + (size_t)(f[i].n - 1) * md->fw, row);
        st->n_pend = 1;
    }
}

int tdm_spec_mtp_kv_len(void *ctx, const void *state)
{
    (void)ctx;
    const struct mtp_req *st = state;
    return st->dead ? 0 : st->head_len;
}

bool tdm_spec_mtp_reads_features(void *ctx, const void *state)
{
    (void)ctx;
    return !((const struct mtp_req *)state)->dead;
}

bool tdm_spec_mtp_catch_up(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n,
                           const struct tdm_spec_mtp_last *last_row)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->fw * sizeof(float);
    n = TDM_MIN(n, md->max_seqs);
    bool ok = false;
    for (int i = 0; i < n; i++) {
        const struct mtp_req *st = d[i].state;
        bool ready = d[i].k > 0 && st && !st->dead && st->n_pend >= 1 &&
                     st->head_len + st->n_pend == d[i].n_tokens - 1;
        md->todo[i] = ready ? st->n_pend : -1;
        md->done[i] = 0;
        ok |= ready;
    }
    /* the pending rows, ending at N - 2, whose row the caller samples */
    while (ok) {
        int m = 0, rows = 0, budget = md->max_tokens;
        size_t off = 0, goff = 0; /* in hid (fw a row) and in fout (d a row) */
        for (int i = 0; i < n && m < md->max_seqs && budget > 0; i++) {
            if (md->todo[i] < 0 || md->done[i] >= md->todo[i]) continue;
            const struct mtp_req *st = d[i].state;
            int span = TDM_MIN(md->todo[i] - md->done[i], budget);
            bool last = md->done[i] + span == md->todo[i];
            memcpy(md->hid + off, st->pend + (size_t)md->done[i] * md->fw, (size_t)span * row);
            int p = st->head_len + md->done[i];
            md->seqs[m++] = (struct tdm_batch_seq){.tokens = d[i].tokens + p + 1,
                                                   .n_tokens = span,
                                                   .pos0 = p,
                                                   .pages = d[i].pages,
                                                   .n_pages = d[i].n_pages,
                                                   .n_logits = last ? 1 : 0,
                                                   .hidden = md->hid + off,
                                                   .features = last ? md->fout + goff : NULL};
            if (last) {
                md->foff[i] = goff + (size_t)(span - 1) * md->d;
                last_row->set(last_row->ctx, &d[i], i, md->rows, rows);
                md->idx[rows++] = i;
            }
            off += (size_t)span * md->fw;
            goff += (size_t)span * md->d;
            md->done[i] += span;
            budget -= span;
        }
        if (!m) break;
        if (!(ok = run_pass(md, sp, m, rows))) break;
        for (int r = 0; r < rows; r++) {
            int i = md->idx[r];
            struct mtp_req *st = d[i].state;
            last_row->take(last_row->ctx, &d[i], i, &md->rows[r], md->fout + md->foff[i]);
            st->head_len = d[i].n_tokens - 1; /* from the target's features, all of it */
            st->n_pend = 0;
        }
    }
    return ok;
}

tdm_engine_t *tdm_spec_mtp_engine(void *ctx)
{
    return ((struct mtp_drafter *)ctx)->e;
}

/* mtp's last catch-up row: draft 1, drawn like every chain draft, and the head's feature */
static void mtp_last_set(void *ctx, struct tdm_sched_draft *x, int i, struct tdm_sample_row *rows,
                         int r)
{
    struct mtp_drafter *md = ctx;
    (void)rows;
    tdm_spec_set_row(&md->dw, x, i, 0, r, (uint32_t)x->n_tokens);
}
static void mtp_last_take(void *ctx, struct tdm_sched_draft *x, int i,
                          const struct tdm_sample_row *row, const float *g)
{
    struct mtp_drafter *md = ctx;
    x->out[0] = tdm_spec_take(&md->dw, x, i, (int)(row - md->rows));
    x->n = 1;
    memcpy(md->g + (size_t)i * md->d, g, (size_t)md->d * sizeof(float));
}

/* ---- the seed's single-token MTP schedule (--spec-overlap) ----
 *
 * The synchronous chain learns what the commit kept, then runs the head over the kept rows
 * (the catch-up) and draws draft 1 from the last. With the overlap, the scheduler launches the
 * head right after the target's run, before the commit: every verified row of a request whose
 * head KV is final up to its span (head_len == pos0, nothing pending) becomes a head row at
 * its position, fed the target's feature there and the token the target chose from it
 * (tdm_sched_feed.next: the shift, done from the run's samples, accepted or not), all rows
 * with logits. The pass runs on the overlap's thread while the scheduler commits; the rows past
 * what is kept are wasted work, their KV stale until the next verify's rows rewrite it, as a
 * draft's is. feed then keeps its usual state (the kept rows pending) and notes the row the
 * kept span ends on (carry); the next propose, after the scheduler has joined the pass, draws
 * draft 1 from that row's logits and takes its head feature, and marks the kept rows done
 * instead of running them again. A request the pass did not take, or that does not draft next
 * step, catches up as before: on a batch-invariant backend a row's KV and logits are the same
 * bits either way, so the drafts, hence the acceptance, are those of the synchronous chain.
 *
 *   step n: run (verify) -> launch (head over every row) -> commit -> feed (carry)
 *                             \__ overlap thread: the head's pass __/
 *   step n + 1: join -> reap, plan -> propose (draft 1 from carry; deeper drafts as before)
 *
 * Ownership: the overlap owns its thread and buffers; launch copies what the pass reads (the
 * rows' tokens, features and page tables), so the pass touches neither the requests nor the
 * scheduler, only the head's engine and the KV of the launched pages, which the scheduler
 * hands to nobody until it has joined. Rejection drafts write their distributions from the
 * host, so that mode needs host memory (the CPU backend).
 */

static void *ov_main(void *arg)
{
    struct mtp_drafter *md = arg;
    struct overlap *ov = md->ov;
    pthread_mutex_lock(&ov->mu);
    for (;;) {
        while (!ov->stop && !ov->busy)
            pthread_cond_wait(&ov->cv, &ov->mu);
        if (ov->stop) break;
        pthread_mutex_unlock(&ov->mu);
        struct tdm_batch b = {.seqs = ov->seqs, .n_seqs = ov->m};
        struct tdm_engine_out out = {.want = ov->want, .logits = ov->logits};
        uint64_t t0 = tdm_now_ns();
        tdm_status st = tdm_engine_run(md->e, &b, &out);
        if (st != TDM_OK) TDM_WARN("spec mtp: a launched head pass failed: %s", tdm_err_msg());
        pthread_mutex_lock(&ov->mu);
        ov->st = st;
        ov->ns = tdm_now_ns() - t0;
        ov->busy = false;
        pthread_cond_broadcast(&ov->cv);
    }
    pthread_mutex_unlock(&ov->mu);
    return NULL;
}

static void ov_join(struct mtp_drafter *md, struct tdm_spec *sp)
{
    struct overlap *ov = md->ov;
    if (!ov) return;
    pthread_mutex_lock(&ov->mu);
    while (ov->busy)
        pthread_cond_wait(&ov->cv, &ov->mu);
    pthread_mutex_unlock(&ov->mu);
    if (!ov->noted) {
        ov->noted = true;
        ov->ok = ov->st == TDM_OK;
        if (sp) {
            tdm_spec_note_pass(sp, ov->m, ov->ns);
            tdm_spec_note_overlap(sp, ov->rows, 0);
        }
    }
}

/* A launched span: a request whose head KV is final up to it. */
static bool ov_takes(const struct tdm_sched_feed *f)
{
    const struct mtp_req *st = f->state;
    return st && !st->dead && !st->n_pend && st->head_len == f->pos0 && f->n >= 1 && f->next;
}

static void mtp_launch(void *ctx, struct tdm_spec *sp, const struct tdm_sched_feed *f, int n)
{
    struct mtp_drafter *md = ctx;
    struct overlap *ov = md->ov;
    ov_join(md, sp);
    n = TDM_MIN(n, md->max_seqs);
    if (++ov->gen == 0) ov->gen = 1;
    size_t pages = 0;
    int rows = 0;
    for (int i = 0; i < n; i++)
        if (ov_takes(&f[i]) && rows + f[i].n <= ov->cap) {
            rows += f[i].n;
            pages += (size_t)f[i].n_pages;
        }
    if (!rows) return;
    if (pages > ov->n_page_cap) {
        int32_t *p = realloc(ov->pages, pages * sizeof *p);
        if (!p) return; /* nothing launched: the synchronous path serves */
        ov->pages = p;
        ov->n_page_cap = pages;
    }
    const size_t fw = (size_t)md->fw, d = (size_t)md->d;
    int m = 0;
    rows = 0;
    pages = 0;
    for (int i = 0; i < n; i++) {
        if (!ov_takes(&f[i]) || rows + f[i].n > ov->cap) continue;
        struct mtp_req *st = f[i].state;
        const int k = f[i].n;
        memcpy(ov->tok + rows, f[i].next, (size_t)k * sizeof *ov->tok);
        memcpy(ov->hid + (size_t)rows * fw, f[i].features, (size_t)k * fw * sizeof(float));
        memcpy(ov->pages + pages, f[i].pages, (size_t)f[i].n_pages * sizeof *ov->pages);
        memset(ov->want + rows, TDM_ROW_LOGITS, (size_t)k);
        ov->seqs[m++] = (struct tdm_batch_seq){.tokens = ov->tok + rows,
                                               .n_tokens = k,
                                               .pos0 = f[i].pos0,
                                               .pages = ov->pages + pages,
                                               .n_pages = f[i].n_pages,
                                               .n_logits = k,
                                               .hidden = ov->hid + (size_t)rows * fw,
                                               .features = ov->fout + (size_t)rows * d};
        st->gen = ov->gen;
        st->lpos0 = f[i].pos0;
        st->lrow0 = rows;
        st->lrows = k;
        rows += k;
        pages += (size_t)f[i].n_pages;
    }
    pthread_mutex_lock(&ov->mu);
    ov->m = m;
    ov->rows = rows;
    ov->noted = ov->ok = false;
    ov->busy = true;
    pthread_cond_broadcast(&ov->cv);
    pthread_mutex_unlock(&ov->mu);
}

static void mtp_join(void *ctx, struct tdm_spec *sp)
{
    ov_join(ctx, sp);
}

/* Draft 1 of each request whose kept span the launched pass carried over; true if any. */
static bool ov_draw(struct mtp_drafter *md, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct overlap *ov = md->ov;
    ov_join(md, sp);
    bool any = false;
    int drawn = 0;
    for (int i = 0; i < n; i++) {
        struct mtp_req *st = d[i].state;
        if (!st || st->dead || d[i].k <= 0 || !ov->ok || st->gen != ov->gen || st->carry < 0)
            continue;
        const int kept = st->carry - st->lrow0 + 1;
        if (st->head_len != st->lpos0 || st->n_pend != kept ||
            st->head_len + st->n_pend != d[i].n_tokens - 1) {
            st->carry = -1;
            continue;
        }
        struct tdm_spec_draws w = md->dw;
        w.rows = &ov->row;
        tdm_spec_set_row(&w, &d[i], i, 0, 0, (uint32_t)d[i].n_tokens);
        tdm_sample_row_host(&ov->row, ov->logits + (size_t)st->carry * md->vocab, &ov->scratch);
        d[i].out[0] = tdm_spec_take(&w, &d[i], i, 0);
        d[i].n = 1;
        memcpy(md->g + (size_t)i * md->d, ov->fout + (size_t)st->carry * md->d,
               (size_t)md->d * sizeof(float));
        st->head_len = d[i].n_tokens - 1; /* the kept rows ran in the launched pass */
        st->n_pend = 0;
        st->carry = -1;
        any = true;
        drawn++;
    }
    if (drawn) tdm_spec_note_overlap(sp, 0, drawn);
    return any;
}

static void ov_free(struct mtp_drafter *md)
{
    struct overlap *ov = md->ov;
    if (!ov) return;
    if (ov->started) {
        pthread_mutex_lock(&ov->mu);
        while (ov->busy)
            pthread_cond_wait(&ov->cv, &ov->mu);
        ov->stop = true;
        pthread_cond_broadcast(&ov->cv);
        pthread_mutex_unlock(&ov->mu);
        pthread_join(ov->thread, NULL);
    }
    pthread_mutex_destroy(&ov->mu);
    pthread_cond_destroy(&ov->cv);
    free(ov->seqs);
    free(ov->tok);
    free(ov->hid);
    free(ov->fout);
    free(ov->logits);
    free(ov->want);
    free(ov->pages);
    tdm_sample_scratch_free(&ov->scratch);
    free(ov);
    md->ov = NULL;
}

tdm_status tdm_spec_mtp_overlap(struct tdm_spec_drafter *dr)
{
    struct mtp_drafter *md = dr->ctx;
    tdm_backend_t *b = tdm_engine_backend(md->e);
    if (md->rejection && b->iface->buf_place)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "spec mtp: --spec-overlap with --spec-accept rejection draws the "
                           "drafts' distributions on the host, and this backend keeps them in "
                           "its own memory: use exact acceptance, or no overlap");
    struct overlap *ov = calloc(1, sizeof *ov);
    if (!ov) return tdm_err_set(TDM_ENOMEM, "spec mtp: out of memory");
    md->ov = ov;
    pthread_mutex_init(&ov->mu, NULL);
    pthread_cond_init(&ov->cv, NULL);
    ov->cap = TDM_MIN(tdm_engine_opts(md->e)->max_logit_rows, md->max_tokens);
    const size_t cap = (size_t)TDM_MAX(ov->cap, 1);
    ov->seqs = calloc((size_t)md->max_seqs, sizeof *ov->seqs);
    ov->tok = calloc(cap, sizeof *ov->tok);
    ov->hid = malloc(cap * (size_t)md->fw * sizeof(float));
    ov->fout = malloc(cap * (size_t)md->d * sizeof(float));
    ov->logits = malloc(cap * (size_t)md->vocab * sizeof(float));
    ov->want = calloc(cap, 1);
    tdm_status st = TDM_OK;
    if (!ov->seqs || !ov->tok || !ov->hid || !ov->fout || !ov->logits || !ov->want)
        st = tdm_err_set(TDM_ENOMEM, "spec mtp: out of memory for the overlap's %d rows", ov->cap);
    if (st == TDM_OK) st = tdm_sample_scratch_init(&ov->scratch, md->vocab);
    if (st == TDM_OK && pthread_create(&ov->thread, NULL, ov_main, md))
        st = tdm_err_set(TDM_EINTERNAL, "spec mtp: cannot start the overlap's thread");
    if (st != TDM_OK) {
        ov_free(md);
        return st;
    }
    ov->started = true;
    ov->noted = true; /* no pass yet */
    dr->launch = mtp_launch;
    dr->join = mtp_join;
    dr->name = "mtp (overlap)";
    return TDM_OK;
}

static void mtp_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->d * sizeof(float);
    n = TDM_MIN(n, md->max_seqs);
    for (int i = 0; i < n; i++) {
        d[i].n = 0;
        md->n_acc[i] = 0;
    }
    /* 0. --spec-overlap: draft 1 from the rows the launched pass carried over */
    const bool carried = md->ov && ov_draw(md, sp, d, n);
    /* 1. the pending rows, ending at N - 2, whose row draws draft 1 */
    const struct tdm_spec_mtp_last last = {mtp_last_set, mtp_last_take, md};
    bool ok = tdm_spec_mtp_catch_up(md, sp, d, n, &last) || carried;
    if (!ok) {
        for (int i = 0; i < n; i++)
            d[i].n = 0;
        return;
    }
    int kmax = 0;
    for (int i = 0; i < n; i++)
        if (d[i].n) kmax = TDM_MAX(kmax, d[i].k);
    /* 2. the deeper drafts: draft j and the head's own feature at N - 2 + j */
    for (int j = 1; j < kmax && ok; j++) {
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (d[i].k <= j || d[i].n < j) continue;
            tdm_sampler_accept(d[i].smp, d[i].out[j - 1], false);
            md->n_acc[i]++;
            md->tok[m] = d[i].out[j - 1];
            md->seqs[m] = (struct tdm_batch_seq){.tokens = &md->tok[m],
                                                 .n_tokens = 1,
                                                 .pos0 = d[i].n_tokens - 2 + j,
                                                 .pages = d[i].pages,
                                                 .n_pages = d[i].n_pages,
                                                 .n_logits = 1,
                                                 .hidden = md->g + (size_t)i * md->d,
                                                 .own_hidden = true,
                                                 .features = md->fout + (size_t)m * md->d};
            tdm_spec_set_row(&md->dw, &d[i], i, j, m, (uint32_t)(d[i].n_tokens + j));
            md->idx[m++] = i;
        }
        if (!m || !(ok = run_pass(md, sp, m, m))) break;
        for (int q = 0; q < m; q++) {
            int i = md->idx[q];
            d[i].out[j] = tdm_spec_take(&md->dw, &d[i], i, q);
            d[i].n = j + 1;
            memcpy(md->g + (size_t)i * md->d, md->fout + (size_t)q * md->d, row);
        }
    }
    for (int i = 0; i < n; i++)
        for (int a = md->n_acc[i]; a > 0; a--) /* the scheduler accepts the drafts itself */
            tdm_sampler_unaccept(d[i].smp, d[i].out[a - 1]);
}

static void mtp_destroy(void *ctx)
{
    struct mtp_drafter *md = ctx;
    if (!md) return;
    ov_free(md);
    free(md->seqs);
    free(md->rows);
    free(md->want);
    free(md->idx);
    free(md->n_acc);
    free(md->done);
    free(md->todo);
    free(md->foff);
    free(md->tok);
    free(md->hid);
    free(md->fout);
    free(md->g);
    if (md->e) tdm_backend_buf_release(tdm_engine_backend(md->e), &md->qbuf);
    tdm_engine_destroy(md->e);
    free(md);
}

/* The head fits the target, whose pool has the head's layer group (both users of a head). */
static tdm_status head_fits(tdm_engine_t *target, const struct tdm_model *head, const char *who)
{
    if (!head || !head->head)
        return tdm_err_set(TDM_EINVAL, "%s: no head (give --spec-draft HEAD.safetensors)", who);
    const struct tdm_model_config *tc = &tdm_engine_model(target)->cfg, *hc = &head->cfg;
    if (hc->d_model != tc->d_model || hc->vocab_size != tc->vocab_size ||
        hc->head_dim != tc->head_dim)
        return tdm_err_set(TDM_EINVAL,
                           "%s: the head (%d wide, head size %d, vocabulary %d) was loaded for "
                           "another target (%d wide, head size %d, vocabulary %d)",
                           who, hc->d_model, hc->head_dim, hc->vocab_size, tc->d_model,
                           tc->head_dim, tc->vocab_size);
    const struct tdm_head *hh = head->head;
    if (hh->n_aux > 0) { /* EAGLE-3: the target gives the residual of the head's layers */
        const struct tdm_engine_opts *to = tdm_engine_opts(target);
        if (to->n_feature_layers != hh->n_aux ||
            memcmp(to->feature_layers, hh->aux_layers, sizeof hh->aux_layers))
            return tdm_err_set(TDM_EINVAL,
                               "%s: the EAGLE-3 head reads the hidden states entering target "
                               "layers %d, %d and %d, and the target engine was not created "
                               "to give them (tdm_spec_engine_opts sets its feature_layers)",
                               who, hh->aux_layers[0], hh->aux_layers[1], hh->aux_layers[2]);
    }
    struct tdm_kv_group want, have;
    tdm_spec_kv_group(head, &want);
    struct tdm_tp_kv_shard ks; /* a sharded target's pool: the leader's share of the heads */
    const int n_ranks = tdm_engine_tp_ranks(target);
    if (n_ranks > 1 && tdm_tp_kv_shard_of(want.n_kv_heads, n_ranks, 0, &ks) == TDM_OK)
        want.n_kv_heads = ks.n_kv_heads;
    if (!tdm_kv_pool_group(tdm_engine_kv(target), 1, &have) || memcmp(&have, &want, sizeof have))
        return tdm_err_set(TDM_EINVAL,
                           "%s: the target's KV pool has no layer group for the head "
                           "(create the target engine with tdm_spec_engine_opts)",
                           who);
    return TDM_OK;
}

tdm_status tdm_spec_mtp_create(tdm_engine_t *target, const struct tdm_model *head,
                               enum tdm_spec_accept accept, bool one_hot, int rows_per_seq,
                               struct tdm_spec_drafter *out)
{
    tdm_status st = head_fits(target, head, "spec mtp");
    if (st != TDM_OK) return st;
    const struct tdm_model_config *tc = &tdm_engine_model(target)->cfg;
    const struct tdm_engine_opts *to = tdm_engine_opts(target);
    struct tdm_engine_opts eo;
    tdm_spec_beside_opts(target, &eo);
    eo.shard_like = target; /* a sharded target's head is sharded like it */
    int n = eo.max_seqs;
    /* a tree drafter's passes take several rows a request (within the target's own rows,
     * which the memory plan sized the head's scratch by) */
    if (rows_per_seq > 1)
        eo.max_logit_rows = (int)TDM_MIN((int64_t)n * rows_per_seq, (int64_t)to->max_logit_rows);
    struct mtp_drafter *md = calloc(1, sizeof *md);
    if (!md) return tdm_err_set(TDM_ENOMEM, "spec mtp: out of memory");
    if ((st = tdm_engine_create(head, &eo, &md->e)) != TDM_OK) {
        free(md);
        return st;
    }
    md->d = tc->d_model;
    md->fw = head->head->feature_width > 0 ? head->head->feature_width : md->d;
    md->vocab = tc->vocab_size;
    md->max_seqs = n;
    md->max_tokens = tdm_engine_opts(md->e)->max_batch_tokens;
    md->pend_cap = (int)TDM_MAX(
        (size_t)PEND_MIN, TDM_MIN((size_t)PEND_MAX, PEND_BYTES / ((size_t)md->fw * sizeof(float))));
    md->rejection = accept == TDM_SPEC_ACCEPT_REJECTION;
    md->one_hot = one_hot;
    size_t un = (size_t)n, dd = (size_t)md->d;
    md->seqs = calloc(un, sizeof *md->seqs);
    md->rows = calloc(un, sizeof *md->rows);
    md->want = calloc(un, sizeof *md->want);
    md->idx = calloc(un, sizeof *md->idx);
    md->n_acc = calloc(un, sizeof *md->n_acc);
    md->done = calloc(un, sizeof *md->done);
    md->todo = calloc(un, sizeof *md->todo);
    md->foff = calloc(un, sizeof *md->foff);
    md->tok = calloc(un, sizeof *md->tok);
    md->hid = malloc((size_t)md->max_tokens * (size_t)md->fw * sizeof(float));
    md->fout = malloc((size_t)TDM_MAX(md->max_tokens, n) * dd * sizeof(float));
    md->g = malloc(un * dd * sizeof(float));
    if (!md->seqs || !md->rows || !md->want || !md->idx || !md->n_acc || !md->done || !md->todo ||
        !md->foff || !md->tok || !md->hid || !md->fout || !md->g) {
        mtp_destroy(md);
        return tdm_err_set(TDM_ENOMEM, "spec mtp: out of memory");
    }
    if (md->rejection) {
        if ((st = tdm_spec_q_alloc(md->e, to, "mtp", &md->qbuf)) != TDM_OK) {
            mtp_destroy(md);
            return st;
        }
        md->q = md->qbuf.ptr;
    }
    md->dw = (struct tdm_spec_draws){md->rows, md->q, md->vocab, md->rejection, md->one_hot};
    *out = (struct tdm_spec_drafter){.name = "mtp",
                                     .ctx = md,
                                     .propose = mtp_propose,
                                     .destroy = mtp_destroy,
                                     .feature_dim = md->fw,
                                     .state_bytes = sizeof(struct mtp_req) + (size_t)md->pend_cap *
                                                                                 (size_t)md->fw *
                                                                                 sizeof(float),
                                     .feed = mtp_feed,
                                     .kv_len = tdm_spec_mtp_kv_len,
                                     .reads_features = tdm_spec_mtp_reads_features};
    return TDM_OK;
}

/* ---- the head's KV for a decoder elsewhere (spec.h) ---- */

struct tdm_spec_head_kv {
    tdm_engine_t *e; /* the head's, beside the target's (group 1 of its pool) */
    int max_seqs, max_tokens;
    int fw; /* the target feature's width: d_model, or an EAGLE-3 head's fused 3 d_model */
    struct tdm_batch_seq *seqs; /* [max_seqs] */
};

tdm_status tdm_spec_head_kv_create(tdm_engine_t *target, const struct tdm_model *head,
                                   tdm_spec_head_kv_t **out)
{
    tdm_status st = head_fits(target, head, "spec head KV");
    if (st != TDM_OK) return st;
    struct tdm_spec_head_kv *h = calloc(1, sizeof *h);
    if (!h) return tdm_err_set(TDM_ENOMEM, "spec head KV: out of memory");
    struct tdm_engine_opts eo;
    tdm_spec_beside_opts(target, &eo);
    eo.shard_like = target;
    if ((st = tdm_engine_create(head, &eo, &h->e)) != TDM_OK) {
        free(h);
        return st;
    }
    const struct tdm_engine_opts *ho = tdm_engine_opts(h->e);
    h->max_seqs = ho->max_seqs;
    h->max_tokens = ho->max_batch_tokens;
    h->fw = head->head->feature_width > 0 ? head->head->feature_width : head->cfg.d_model;
    if (!(h->seqs = calloc((size_t)h->max_seqs, sizeof *h->seqs))) {
        tdm_spec_head_kv_destroy(h);
        return tdm_err_set(TDM_ENOMEM, "spec head KV: out of memory");
    }
    *out = h;
    return TDM_OK;
}

void tdm_spec_head_kv_destroy(tdm_spec_head_kv_t *h)
{
    if (!h) return;
    tdm_engine_destroy(h->e);
    free(h->seqs);
    free(h);
}

tdm_status tdm_spec_head_kv_run(tdm_spec_head_kv_t *h, const struct tdm_spec_head_rows *rows, int n)
{
    const size_t fw = (size_t)h->fw;
    int i = 0, done = 0; /* rows of span i already run */
    while (i < n) {
        int m = 0, budget = h->max_tokens;
        while (i < n && m < h->max_seqs && budget > 0) {
            const struct tdm_spec_head_rows *r = &rows[i];
            int span = TDM_MIN(r->n - done, budget);
            if (span > 0) {
                h->seqs[m++] = (struct tdm_batch_seq){.tokens = r->tokens + r->pos0 + done + 1,
                                                      .n_tokens = span,
                                                      .pos0 = r->pos0 + done,
                                                      .pages = r->pages,
                                                      .n_pages = r->n_pages,
                                                      .hidden = r->features + (size_t)done * fw};
                done += span;
                budget -= span;
            }
            if (done >= r->n) {
                i++;
                done = 0;
            }
        }
        if (!m) break;
        struct tdm_batch b = {.seqs = h->seqs, .n_seqs = m};
        struct tdm_engine_out o = {0};
        tdm_status st = tdm_engine_run(h->e, &b, &o);
        if (st != TDM_OK) return st;
    }
    return TDM_OK;
}

/* Four independent FNV-style lanes over 8-byte words (a mismatch check, not a MAC). */
struct fp {
    uint64_t lane[4];
};
static void fp_words(struct fp *f, const uint8_t *p, size_t bytes)
{
    const uint64_t prime = 0x100000001b3ull;
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32)
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * l, 8);
            f->lane[l] = (f->lane[l] ^ w) * prime;
        }
    for (; i < bytes; i++)
        f->lane[0] = (f->lane[0] ^ p[i]) * prime;
}
static void fp_u64(struct fp *f, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    fp_words(f, b, 8);
}
static void fp_weight(struct fp *f, const struct tdm_weight *w)
{
    fp_u64(f, w->data ? 1 + (uint64_t)w->dtype : 0);
    if (!w->data) return;
    fp_u64(f, (uint64_t)w->rows);
    fp_u64(f, (uint64_t)w->cols);
    fp_words(f, w->data, (size_t)w->rows * w->row_bytes);
}

uint64_t tdm_spec_head_fingerprint(const struct tdm_model *head)
{
    struct fp f = {{0xcbf29ce484222325ull, 0x84222325cbf29ce4ull, 0x9e3779b97f4a7c15ull,
                    0xc2b2ae3d27d4eb4full}};
    const struct tdm_model_config *c = &head->cfg;
    uint32_t eps, theta;
    memcpy(&eps, &c->rms_eps, 4);
    memcpy(&theta, &c->rope_theta, 4);
    const uint64_t cfg[] = {(uint64_t)c->arch,
                            (uint64_t)c->n_layers,
                            (uint64_t)c->d_model,
                            (uint64_t)c->n_heads,
                            (uint64_t)c->n_kv_heads,
                            (uint64_t)c->head_dim,
                            (uint64_t)c->d_ff,
                            (uint64_t)c->vocab_size,
                            eps,
                            theta,
                            (uint64_t)c->rope_neox,
                            (uint64_t)c->qkv_bias,
                            (uint64_t)c->qk_norm};
    for (size_t i = 0; i < TDM_ARRAY_LEN(cfg); i++)
        fp_u64(&f, cfg[i]);
    if (head->head) {
        const struct tdm_head *hd = head->head;
        fp_u64(&f, 1 + (uint64_t)hd->layout);
        const struct tdm_weight *hw[] = {&hd->enorm,   &hd->hnorm, &hd->fc_e, &hd->fc_h,
                                         &hd->fc_bias, &hd->wq_h,  &hd->wk_h, &hd->wv_h};
        for (size_t i = 0; i < TDM_ARRAY_LEN(hw); i++)
            fp_weight(&f, hw[i]);
        for (int i = 0; i < hd->n_aux; i++) /* EAGLE-3's target layers */
            fp_u64(&f, 1 + (uint64_t)hd->aux_layers[i]);
        fp_u64(&f, (uint64_t)hd->n_draft); /* a reduced draft vocabulary */
        for (int i = 0; i < hd->n_draft; i++)
            fp_u64(&f, (uint64_t)hd->d2t[i]);
    }
    for (int l = 0; l < c->n_layers && head->layers; l++) {
        const struct tdm_layer_weights *L = &head->layers[l];
        const struct tdm_weight *lw[] = {&L->attn_norm, &L->wq,     &L->wk,     &L->wv,     &L->bq,
                                         &L->bk,        &L->bv,     &L->q_norm, &L->k_norm, &L->wo,
                                         &L->ffn_norm,  &L->w_gate, &L->w_up,   &L->w_down};
        for (size_t i = 0; i < TDM_ARRAY_LEN(lw); i++)
            fp_weight(&f, lw[i]);
    }
    fp_weight(&f, &head->output_norm);
    if (head->head && head->head->layout == TDM_HEAD_EAGLE3) /* its own LM head */
        fp_weight(&f, &head->output);
    uint64_t h = 0;
    for (int l = 0; l < 4; l++)
        h = (h ^ f.lane[l]) * 0x9e3779b97f4a7c15ull + (h >> 29);
    return h;
}
