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
 * Feeding appends to the pending rows; when they would overflow (a prefill chunk), the head
 * runs at once over all but the last (eager catch-up, no logits). Proposing first runs the
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
 * The same head on a prefill node (tdm_spec_head_kv, spec.h): an engine of its own beside the
 * prefill node's target that runs the head's rows over what that node prefilled, from the
 * target's features there, so that the head's KV streams to the decoder as one more layer
 * (disagg.h). It is the same engine call as the catch-up here, so the KV is the same bit for
 * bit on a batch-invariant backend. tdm_spec_head_fingerprint tells two nodes' heads apart.
 *
 * Ownership: owns the head's engine and its scratch; borrows the head model, the target's
 * pool and backend. Scheduler thread.
 */
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

#define PEND_CAP (TDM_SPEC_MAX_K + 1) /* a verified span: the last token and k drafts */

struct mtp_req {
    int32_t head_len; /* the head's KV holds [0, head_len), made from the target's features */
    int32_t n_pend;   /* the target's features of [head_len, head_len + n_pend) wait in pend */
    int32_t dead;     /* a gap in the features: no drafts */
    int32_t pad;
    float pend[]; /* [PEND_CAP][d] */
};

struct mtp_drafter {
    tdm_engine_t *e; /* the head's */
    int d, vocab, max_seqs, max_tokens;
    bool rejection, one_hot;
    struct tdm_batch_seq *seqs;     /* [max_seqs] */
    struct tdm_sample_row *rows;    /* [max_seqs] */
    uint8_t *want;                  /* [max_seqs] */
    int *idx, *n_acc, *done, *todo; /* [max_seqs] */
    size_t *foff;                   /* [max_seqs] where a request's last head feature lands */
    int32_t *tok;                   /* [max_seqs] */
    float *hid;                     /* [max_tokens][d] a pass's hidden inputs */
    float *fout;                    /* [max_tokens][d] a pass's head features */
    float *g;                       /* [max_seqs][d] each drafting request's last head feature */
    struct tdm_buf qbuf; /* rejection: [max_seqs][TDM_SPEC_MAX_K][vocab], the backend's */
    float *q;
    struct tdm_spec_draws dw;
};

/* Row r of a request's pending rows followed by n fed rows. */
static const float *vrow(const struct mtp_drafter *md, const struct mtp_req *st, const float *fed,
                         int r)
{
    return r < st->n_pend ? st->pend + (size_t)r * md->d : fed + (size_t)(r - st->n_pend) * md->d;
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
    const size_t row = (size_t)md->d * sizeof(float);
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
        if (st->n_pend + m <= PEND_CAP) {
            memcpy(st->pend + (size_t)st->n_pend * md->d, f[i].features, (size_t)m * row);
            st->n_pend += m;
            continue;
        }
        md->todo[i] = st->n_pend + m - 1; /* all but the last row, now */
        md->done[i] = 0;
        eager = true;
    }
    bool ok = true;
    while (eager && ok) {
        int m = 0, budget = md->max_tokens;
        size_t off = 0;
        for (int i = 0; i < n && m < md->max_seqs && budget > 0; i++) {
            if (md->todo[i] < 0 || md->done[i] >= md->todo[i]) continue;
            const struct mtp_req *st = f[i].state;
            int span = TDM_MIN(md->todo[i] - md->done[i], budget);
            for (int r = 0; r < span; r++)
                memcpy(md->hid + off + (size_t)r * md->d,
                       vrow(md, st, f[i].features, md->done[i] + r), row);
            int p = st->head_len + md->done[i];
            md->seqs[m++] = (struct tdm_batch_seq){.tokens = f[i].tokens + p + 1,
                                                   .n_tokens = span,
                                                   .pos0 = p,
                                                   .pages = f[i].pages,
                                                   .n_pages = f[i].n_pages,
                                                   .hidden = md->hid + off};
            off += (size_t)span * md->d;
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
        memcpy(st->pend, f[i].features + (size_t)(f[i].n - 1) * md->d, row);
        st->n_pend = 1;
    }
}

int tdm_spec_mtp_kv_len(void *ctx, const void *state)
{
    (void)ctx;
    const struct mtp_req *st = state;
    return st->dead ? 0 : st->head_len;
}

bool tdm_spec_mtp_catch_up(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n,
                           const struct tdm_spec_mtp_last *last_row)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->d * sizeof(float);
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
        size_t off = 0;
        for (int i = 0; i < n && m < md->max_seqs && budget > 0; i++) {
            if (md->todo[i] < 0 || md->done[i] >= md->todo[i]) continue;
            const struct mtp_req *st = d[i].state;
            int span = TDM_MIN(md->todo[i] - md->done[i], budget);
            bool last = md->done[i] + span == md->todo[i];
            memcpy(md->hid + off, st->pend + (size_t)md->done[i] * md->d, (size_t)span * row);
            int p = st->head_len + md->done[i];
            md->seqs[m++] = (struct tdm_batch_seq){.tokens = d[i].tokens + p + 1,
                                                   .n_tokens = span,
                                                   .pos0 = p,
                                                   .pages = d[i].pages,
                                                   .n_pages = d[i].n_pages,
                                                   .n_logits = last ? 1 : 0,
                                                   .hidden = md->hid + off,
                                                   .features = last ? md->fout + off : NULL};
            if (last) {
                md->foff[i] = off + (size_t)(span - 1) * md->d;
                last_row->set(last_row->ctx, &d[i], i, md->rows, rows);
                md->idx[rows++] = i;
            }
            off += (size_t)span * md->d;
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

static void mtp_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->d * sizeof(float);
    n = TDM_MIN(n, md->max_seqs);
    for (int i = 0; i < n; i++) {
        d[i].n = 0;
        md->n_acc[i] = 0;
    }
    /* 1. the pending rows, ending at N - 2, whose row draws draft 1 */
    const struct tdm_spec_mtp_last last = {mtp_last_set, mtp_last_take, md};
    bool ok = tdm_spec_mtp_catch_up(md, sp, d, n, &last);
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
    struct tdm_kv_group want, have;
    tdm_spec_kv_group(head, &want);
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
    md->vocab = tc->vocab_size;
    md->max_seqs = n;
    md->max_tokens = tdm_engine_opts(md->e)->max_batch_tokens;
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
    md->hid = malloc((size_t)md->max_tokens * dd * sizeof(float));
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
                                     .feature_dim = md->d,
                                     .state_bytes = sizeof(struct mtp_req) +
                                                    (size_t)PEND_CAP * dd * sizeof(float),
                                     .feed = mtp_feed,
                                     .kv_len = tdm_spec_mtp_kv_len};
    return TDM_OK;
}

/* ---- the head's KV for a decoder elsewhere (spec.h) ---- */

struct tdm_spec_head_kv {
    tdm_engine_t *e; /* the head's, beside the target's (group 1 of its pool) */
    int max_seqs, max_tokens;
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
    if ((st = tdm_engine_create(head, &eo, &h->e)) != TDM_OK) {
        free(h);
        return st;
    }
    const struct tdm_engine_opts *ho = tdm_engine_opts(h->e);
    h->max_seqs = ho->max_seqs;
    h->max_tokens = ho->max_batch_tokens;
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
    const int d = tdm_engine_model(h->e)->cfg.d_model;
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
                                                      .hidden = r->features + (size_t)done * d};
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
        const struct tdm_weight *hw[] = {&hd->enorm, &hd->hnorm, &hd->fc_e, &hd->fc_h,
                                         &hd->fc_bias};
        for (size_t i = 0; i < TDM_ARRAY_LEN(hw); i++)
            fp_weight(&f, hw[i]);
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
    uint64_t h = 0;
    for (int l = 0; l < 4; l++)
        h = (h ^ f.lane[l]) * 0x9e3779b97f4a7c15ull + (h >> 29);
    return h;
}
