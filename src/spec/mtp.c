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
 * its last row draws draft 1; then one pass per depth. A gap in the features (a prompt whose
 * KV came from another node) leaves the request without drafts until its pages go back.
 *
 * Draws are the chain's: the request's keyed draw (exact) or PROPOSE rows with q (rejection).
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
            st->dead = 1;
            continue;
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

static void mtp_propose(void *ctx, struct tdm_spec *sp, struct tdm_sched_draft *d, int n)
{
    struct mtp_drafter *md = ctx;
    const size_t row = (size_t)md->d * sizeof(float);
    n = TDM_MIN(n, md->max_seqs);
    int kmax = 0;
    for (int i = 0; i < n; i++) {
        const struct mtp_req *st = d[i].state;
        d[i].n = 0;
        md->n_acc[i] = 0;
        bool ready =
            st && !st->dead && st->n_pend >= 1 && st->head_len + st->n_pend == d[i].n_tokens - 1;
        md->todo[i] = ready ? st->n_pend : -1;
        md->done[i] = 0;
        if (ready) kmax = TDM_MAX(kmax, d[i].k);
    }
    /* 1. the pending rows, ending at N - 2, whose row draws draft 1 */
    bool ok = kmax > 0;
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
                tdm_spec_set_row(&md->dw, &d[i], i, 0, rows, (uint32_t)d[i].n_tokens);
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
            d[i].out[0] = tdm_spec_take(&md->dw, &d[i], i, r);
            d[i].n = 1;
            memcpy(md->g + (size_t)i * md->d, md->fout + md->foff[i], row);
            st->head_len = d[i].n_tokens - 1; /* from the target's features, all of it */
            st->n_pend = 0;
        }
    }
    if (!ok) {
        for (int i = 0; i < n; i++)
            d[i].n = 0;
        return;
    }
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

tdm_status tdm_spec_mtp_create(tdm_engine_t *target, const struct tdm_model *head,
                               enum tdm_spec_accept accept, bool one_hot,
                               struct tdm_spec_drafter *out)
{
    if (!head || !head->head)
        return tdm_err_set(TDM_EINVAL, "spec mtp: no head (give --spec-draft HEAD.safetensors)");
    const struct tdm_model_config *tc = &tdm_engine_model(target)->cfg, *hc = &head->cfg;
    if (hc->d_model != tc->d_model || hc->vocab_size != tc->vocab_size ||
        hc->head_dim != tc->head_dim)
        return tdm_err_set(TDM_EINVAL, "spec mtp: the head was loaded for another target");
    tdm_kv_pool_t *kv = tdm_engine_kv(target);
    struct tdm_kv_group want, have;
    tdm_spec_kv_group(head, &want);
    if (!tdm_kv_pool_group(kv, 1, &have) || have.n_layers != want.n_layers ||
        have.n_kv_heads != want.n_kv_heads || have.head_dim != want.head_dim)
        return tdm_err_set(TDM_EINVAL, "spec mtp: the target's KV pool has no layer group for "
                                       "the head (create the target engine with "
                                       "tdm_spec_engine_opts)");
    const struct tdm_engine_opts *to = tdm_engine_opts(target);
    struct tdm_engine_opts eo;
    tdm_spec_beside_opts(target, &eo);
    int n = eo.max_seqs;
    struct mtp_drafter *md = calloc(1, sizeof *md);
    if (!md) return tdm_err_set(TDM_ENOMEM, "spec mtp: out of memory");
    tdm_status st = tdm_engine_create(head, &eo, &md->e);
    if (st != TDM_OK) {
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
                                     .feed = mtp_feed};
    return TDM_OK;
}
