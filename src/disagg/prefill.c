/*
 * The prefill side of the KV messenger (include/tandem/disagg.h has the protocol).
 *
 * A job is one decoder request: received on the transfer engine's progress thread (validated,
 * queued), submitted to the scheduler by the messenger thread as a prefill-only, fixed-chunk
 * request, streamed layer by layer, and freed once the request has finished and every write
 * it posted has completed.
 *
 * Layer streaming. step_begin (scheduler thread) publishes the step's spans and zeroes the
 * engine's layer counter; while the forward runs, the messenger thread polls the counter and
 * posts, for every layer that has finished its output projection, one paged write per span
 * (immediate index chunk * S + layer, S the layers the job streams: the target's, plus the
 * head's when asked). step_end posts whatever layers the messenger has not reached yet, then
 * for jobs that asked for the head's KV runs the head over the step's spans and posts its
 * layer (index chunk * S + n_layers + head layer), then the context write (hidden state,
 * feature with a head, logits when asked) of spans that end a prompt. Source pages are held
 * (IN_FLIGHT) from posting until the write completes, so the scheduler can finish the request
 * while its writes are still on the wire.
 *
 * The head (speculation across disaggregation). A prefill of P tokens runs the head's rows
 * [0, P - 1) (row p reads t(p+1), the last needs prompt[-1] which stays with the decoder) from
 * the target's features of each span, which the scheduler downloads for a job that asks (its
 * request is submitted with spec_k 0: it speculates, on the decoder). Every chunk posts the head
 * layer's pages, rows or not, so the count is fixed in advance; a page's positions past
 * P - 2 hold nothing the decoder reads before its first step rewrites them. A request for a
 * head this node does not have (none, or another fingerprint or geometry) is refused with
 * TDM_EUNSUPPORTED and a message naming both heads.
 *
 * Locking: p->mu guards jobs, the inbox and the step state. Posting calls into the transfer
 * engine only enqueue, so they are made under p->mu. Write completions run on the progress
 * thread and take p->mu.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "disagg/disagg_int.h"
#include "tandem/spec.h"

/* A job's life (p->mu held for every transition):
 *
 *              submitted                     finished (connector)      retired (no write
 *   RECEIVED ---------------> SCHEDULED ---------------------------> DRAINING  in flight) -> freed
 *      |                                                                           ^
 *      +--(cancelled or failed before submit, or refused by the scheduler)--> DROPPED
 *
 *   transition             function                      thread
 *   -> RECEIVED            on_msg                        xfer progress
 *   RECEIVED -> SCHEDULED  service_jobs_locked           messenger
 *   RECEIVED -> DROPPED    service_jobs_locked           messenger
 *   SCHEDULED -> DRAINING  finished                      scheduler
 *   DRAINING/DROPPED ->    service_jobs_locked, once     messenger (answers CANCEL_ACK after a
 *     freed                outstanding == 0                cancel, a NACK after a failure)
 *
 * A cancel from the decoder marks every job not DROPPED: its writes stop being posted, and the
 * CANCEL_ACK goes out only when the job is freed, after its last write completed. */
enum job_state { JOB_RECEIVED, JOB_SCHEDULED, JOB_DRAINING, JOB_DROPPED };
enum { PERR_REFUSED, PERR_WRITE, PERR_PEER, PERR_CANCELLED, PERR_OTHER, N_PERR };
static const char *const perr_names[N_PERR] = {"refused", "write", "peer", "cancelled", "other"};

struct job {
    struct job *next; /* p->jobs list */
    enum job_state state;
    uint32_t xpeer;
    struct tdm_disagg_prefill_msg m;   /* tokens/pages point at the copies below */
    struct disagg_route route;         /* how its pages reach the decoder's memory */
    struct tdm_disagg_shard_plan plan; /* which rank sends which head slice to which */
    int32_t *tokens;
    uint32_t *dst_pages;
    tdm_req_t *req;
    int ctx_slot;
    int outstanding; /* writes posted and not completed */
    enum tdm_finish why;
    bool failed, cancel, ctx_posted;
    bool cached_posted; /* the chunks inside this node's cached prefix went (at the first span) */
    int reused_chunks;  /* decoder chunks sent from this node's prefix cache, not computed */
    char error[TDM_DMSG_MAX_ERROR + 1];
    uint64_t bytes, pages_written, writes;
    int64_t t_recv, t_first_done, t_last_done;
};

struct wctx { /* one posted write */
    struct tdm_disagg_prefill *p;
    struct job *job;
    uint64_t step_seq; /* the step that posted it */
    int64_t t_layer;   /* when its layer was seen complete */
    uint64_t bytes;
    int n;
    int src_rank;    /* the rank whose pool it reads (a KV slice), or -1 */
    int32_t pages[]; /* source pages held */
};

struct step_span {
    struct job *job;
    int pos0, n_tokens;
    const int32_t *pages;
    int n_pages;
    const float *features; /* [n_tokens][the head's feature width], filled by the run; NULL
                            * without a head */
};

enum wkind { W_KV, W_HEAD, W_CTX }; /* a target layer's pages, the head layer's, the context */

struct tdm_disagg_prefill {
    struct tdm_disagg_prefill_opts o;
    tdm_engine_t *engine;
    tdm_sched_t *sched;
    tdm_kv_pool_t *kv;
    _Atomic int32_t *layer_counter;
    struct disagg_endpoint ep;
    size_t layer_bytes, page_bytes, ctx_bytes; /* from the pool's geometry */
    uint8_t told[256]; /* decoder peers told in the log how their pages move (xfer's thread) */
    float *ctx_mem;
    int n_layers, n_kv_heads, head_dim, page_size, d_model, vocab, max_ctx, max_chunk;
    int n_ranks; /* the engine's TP ranks: this node's sharding (p) */

    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    struct job *jobs;
    int n_jobs;
    uint8_t *ctx_used; /* [max_jobs] */
    /* the step in progress */
    bool step_active;
    uint64_t step_seq;
    int step_posted; /* layers posted for this step */
    struct step_span *spans;
    int n_spans;
    uint32_t *src_tmp, *dst_tmp;
    /* the head (opts.head): its engine, and the step's head rows (scheduler thread) */
    tdm_spec_head_kv_t *head_kv;
    int head_layers;
    struct tdm_spec_head_rows *hrows; /* [max_seqs] */
    int *hspan;                       /* [max_seqs] the span each row set came from */
    /* metrics */
    struct tdm_hist transfer_s, layer_lag_s, bytes_h;
    uint64_t errors[N_PERR], jobs_ok, writes_total, bytes_total, landed_during_forward;
    uint64_t head_jobs_ok, head_rows;
    uint64_t decoder_cached_jobs, reused_chunks;
    uint64_t rank_writes[TDM_DISAGG_MAX_RANKS]; /* KV slice writes completed, by source rank */
};

/* The writes a job's chunk takes: each target layer's slices (its plan), and the head's
 * layers when it asked (disagg.h: the immediates of a chunk). */
static int stream_layers(const struct tdm_disagg_prefill *p, const struct job *j)
{
    return (int)tdm_disagg_chunk_writes(&j->plan, (uint32_t)p->n_layers,
                                        j->m.want_head ? (uint32_t)p->head_layers : 0);
}

static void send_msg(struct tdm_disagg_prefill *p, uint32_t xpeer, const struct tdm_disagg_msg *m)
{
    uint8_t buf[512];
    size_t n = tdm_disagg_msg_encode(m, buf, sizeof buf);
    if (!n || p->ep.tp.iface->send(p->ep.tp.t, xpeer, buf, n, 0, NULL, NULL) != TDM_OK)
        TDM_WARN("disagg: cannot answer decoder peer %u: %s", xpeer, tdm_err_msg());
}

static void nack(struct tdm_disagg_prefill *p, uint32_t xpeer, uint32_t slot, uint32_t epoch,
                 tdm_status st, const char *why)
{
    struct tdm_disagg_msg m = {.type = TDM_DMSG_NACK, .slot = slot, .epoch = epoch, .status = st};
    snprintf(m.error, sizeof m.error, "%s", why);
    send_msg(p, xpeer, &m);
}

static void job_fail_locked(struct job *j, const char *fmt, const char *arg)
{
    if (j->failed) return;
    j->failed = true;
    snprintf(j->error, sizeof j->error, fmt, arg);
    if (j->req) tdm_req_cancel(j->req);
}

/* ---- writes ---- */

static void on_write_done(void *ctx, tdm_status st)
{
    struct wctx *w = ctx;
    struct tdm_disagg_prefill *p = w->p;
    tdm_kv_pool_unhold(p->kv, w->n, w->pages);
    int64_t now = (int64_t)tdm_now_ns();
    pthread_mutex_lock(&p->mu);
    struct job *j = w->job;
    j->outstanding--;
    if (st == TDM_OK) {
        if (!j->t_first_done) j->t_first_done = now;
        j->t_last_done = now;
        j->bytes += w->bytes;
        j->pages_written += (uint64_t)w->n;
        j->writes++;
        p->writes_total++;
        p->bytes_total += w->bytes;
        if (w->t_layer) tdm_hist_observe(&p->layer_lag_s, (double)(now - w->t_layer) * 1e-9);
        if (w->src_rank >= 0) p->rank_writes[w->src_rank]++;
        if (p->step_active && p->step_seq == w->step_seq) p->landed_during_forward++;
    } else {
        p->errors[st == TDM_EPEER ? PERR_PEER : PERR_WRITE]++;
        job_fail_locked(j, "a KV write failed: %s", tdm_status_str(st));
    }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    free(w);
}

/* Where one paged write's runs lie: the source rank's region and the destination rank's, the
 * bytes of a run in each page, the page strides, and the run's offsets (the layer's base plus
 * the slice's place in a page). */
struct wtarget {
    int src_rank;
    const struct tdm_xfer_region *src;
    const struct tdm_xfer_rmem *dst;
    uint64_t page_bytes, src_stride, dst_stride, src_offset, dst_offset;
};

/* Posts one write: pages [p0, p0 + n) of a layer as wt says (W_KV: a slice of the target's;
 * W_HEAD: the head's), or the context (W_CTX, wt NULL). Called with p->mu held. */
static void post_locked(struct tdm_disagg_prefill *p, struct job *j, enum wkind kind,
                        const int32_t *src_pages, int p0, int n, const struct wtarget *wt,
                        uint32_t index, int64_t t_layer)
{
    if (j->failed || j->cancel) return;
    struct wctx *w = malloc(sizeof *w + (size_t)n * sizeof(int32_t));
    if (!w) {
        job_fail_locked(j, "%s", "out of memory");
        return;
    }
    *w = (struct wctx){
        .p = p, .job = j, .step_seq = p->step_seq, .t_layer = t_layer, .n = n, .src_rank = -1};
    if (kind == W_KV) w->src_rank = wt->src_rank;
    struct tdm_xfer_imm imm = {.slot = j->m.slot, .epoch = j->m.epoch, .index = index};
    tdm_status st;
    int64_t deadline = (int64_t)tdm_now_ns() + 10 * 1000000000LL;
    /* the source pages are held from here to the write's end (or its refusal): a retry below
     * drops p->mu, and the scheduler may finish the request meanwhile */
    if (kind != W_CTX) {
        for (int i = 0; i < n; i++)
            w->pages[i] = src_pages[p0 + i];
        tdm_kv_pool_hold(p->kv, n, w->pages);
    }
    for (;;) {
        if (kind != W_CTX) {
            /* the decoder named its pages from its cached prefix on */
            const int d0 = p0 - (int)(j->m.cached_tokens / (uint32_t)p->page_size);
            for (int i = 0; i < n; i++) {
                p->src_tmp[i] = (uint32_t)w->pages[i];
                p->dst_tmp[i] = j->dst_pages[d0 + i];
            }
            w->bytes = (uint64_t)n * wt->page_bytes;
            struct tdm_xfer_pages pg = {.src_pages = p->src_tmp,
                                        .dst_pages = p->dst_tmp,
                                        .n_pages = (uint32_t)n,
                                        .page_bytes = wt->page_bytes,
                                        .src_stride = wt->src_stride,
                                        .dst_stride = wt->dst_stride,
                                        .src_offset = wt->src_offset,
                                        .dst_offset = wt->dst_offset};
            st = j->route.tp.iface->write_pages(j->route.tp.t, j->xpeer, wt->src, wt->dst, &pg,
                                                &imm, 0, on_write_done, w);
        } else {
            size_t bytes =
                tdm_disagg_ctx_layout(j->m.d_model, j->m.want_head ? j->m.head.feature_width : 0,
                                      j->m.vocab, j->m.want_logits, NULL, NULL) *
                sizeof(float);
            w->bytes = bytes;
            st = p->ep.tp.iface->write(p->ep.tp.t, j->xpeer, &p->ep.ctx_reg,
                                       (uint64_t)j->ctx_slot * p->ctx_bytes, &j->m.ctx,
                                       j->m.ctx_offset, bytes, &imm, 0, on_write_done, w);
        }
        if (st != TDM_EAGAIN || (int64_t)tdm_now_ns() > deadline) break;
        /* backpressure: let the progress thread drain (it takes p->mu in completions) */
        pthread_mutex_unlock(&p->mu);
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&p->mu);
        if (j->failed || j->cancel) {
            if (kind != W_CTX) tdm_kv_pool_unhold(p->kv, n, w->pages);
            free(w);
            return;
        }
    }
    if (st != TDM_OK) {
        if (kind != W_CTX) tdm_kv_pool_unhold(p->kv, n, w->pages);
        free(w);
        p->errors[st == TDM_EPEER ? PERR_PEER : PERR_WRITE]++;
        job_fail_locked(j, "cannot post a KV write: %s", tdm_err_msg());
        return;
    }
    j->outstanding++;
}

/* Posts pages [p0, p0 + n) of layer `layer` of chunk chunk_idx (W_KV: the target's, one write
 * per run of each slice of the job's plan; W_HEAD: the head's, whole, leader to leader). p->mu
 * held. */
static void post_layer_pages_locked(struct tdm_disagg_prefill *p, struct job *j, enum wkind kind,
                                    const int32_t *src_pages, int p0, int n, int layer,
                                    uint32_t chunk_idx, int64_t t_layer)
{
    const uint32_t base = chunk_idx * (uint32_t)stream_layers(p, j);
    if (kind == W_HEAD) {
        const uint64_t pb = p->ep.head.page_bytes;
        struct wtarget wt = {.src = j->route.head,
                             .dst = &j->m.head.kv,
                             .page_bytes = pb,
                             .src_stride = pb,
                             .dst_stride = pb,
                             .src_offset = (uint64_t)layer * p->ep.head.layer_bytes,
                             .dst_offset = (uint64_t)layer * j->m.head.dst_layer_stride};
        post_locked(p, j, W_HEAD, src_pages, p0, n, &wt,
                    base + (uint32_t)(p->n_layers * j->plan.writes + layer), t_layer);
        return;
    }
    const uint64_t head_bytes = p->ep.kv.head_bytes;
    for (int i = 0; i < j->plan.n_slices; i++) {
        const struct tdm_disagg_slice *sl = &j->plan.slices[i];
        const struct tdm_kv_geometry *src = &p->ep.rank_kv[sl->src_rank];
        const struct tdm_disagg_rank_dst *dst = &j->m.ranks[sl->dst_rank];
        /* a whole slice is the page (whatever its layout: a latent pool's has no V half) */
        const uint64_t dst_page = sl->whole ? src->page_bytes : 2 * sl->dst_heads * head_bytes;
        struct tdm_disagg_run runs[2];
        int n_runs = tdm_disagg_slice_runs(sl, head_bytes, runs);
        if (sl->whole) runs[0].bytes = src->page_bytes;
        for (int k = 0; k < n_runs; k++) {
            struct wtarget wt = {
                .src_rank = sl->src_rank,
                .src = sl->src_rank ? tdm_disagg_rank_region(&p->ep, sl->src_rank) : j->route.kv,
                .dst = &dst->kv,
                .page_bytes = runs[k].bytes,
                .src_stride = src->page_bytes,
                .dst_stride = dst_page,
                .src_offset = (uint64_t)layer * src->layer_bytes + runs[k].src_offset,
                .dst_offset = (uint64_t)layer * dst->dst_layer_stride + runs[k].dst_offset};
            post_locked(p, j, W_KV, src_pages, p0, n, &wt,
                        base + (uint32_t)(layer * j->plan.writes + sl->write0 + k), t_layer);
        }
    }
}

/* Posts layer `layer` of a span (W_KV: the target's; W_HEAD: the head's): the pages of its
 * chunk from the chunk's start (which a span that began past this node's own cached prefix
 * does not reach) to its end. Nothing for a span wholly inside the decoder's cached prefix.
 * p->mu held. */
static void post_span_layer_locked(struct tdm_disagg_prefill *p, const struct step_span *sp,
                                   enum wkind kind, int layer, int64_t t_layer)
{
    struct job *j = sp->job;
    const int c = (int)j->m.cached_tokens, C = (int)j->m.chunk;
    if (sp->pos0 < c) return; /* spans end on the decoder's grid: this one ends by c */
    uint32_t chunk_idx = (uint32_t)((sp->pos0 - c) / C);
    int p0 = (c + (int)chunk_idx * C) / p->page_size;
    int p1 = (sp->pos0 + sp->n_tokens + p->page_size - 1) / p->page_size;
    post_layer_pages_locked(p, j, kind, sp->pages, p0, p1 - p0, layer, chunk_idx, t_layer);
}

/* A job's first span may start past the decoder's cached prefix c, inside this node's own
 * (the scheduler reused its cache): the decoder's chunks wholly before the span are made
 * already, and go now, every layer (a job with the head never reuses this node's cache).
 * p->mu held. */
static void post_cached_chunks_locked(struct tdm_disagg_prefill *p, const struct step_span *sp)
{
    struct job *j = sp->job;
    if (j->cached_posted) return;
    j->cached_posted = true;
    const int c = (int)j->m.cached_tokens, C = (int)j->m.chunk;
    if (sp->pos0 < c + C) return;
    if (j->m.want_head) {
        job_fail_locked(j, "%s", "a job with the head's KV started past its first chunk");
        return;
    }
    const int64_t now = (int64_t)tdm_now_ns();
    for (int k = 0; c + (k + 1) * C <= sp->pos0; k++) {
        int p0 = (c + k * C) / p->page_size, p1 = (c + (k + 1) * C) / p->page_size;
        for (int l = 0; l < p->n_layers; l++)
            post_layer_pages_locked(p, j, W_KV, sp->pages, p0, p1 - p0, l, (uint32_t)k, now);
        j->reused_chunks++;
    }
}

/* Posts layer `layer` of every span of the current step. p->mu held. */
static void post_layer_locked(struct tdm_disagg_prefill *p, int layer, int64_t t_layer)
{
    for (int s = 0; s < p->n_spans; s++)
        post_span_layer_locked(p, &p->spans[s], W_KV, layer, t_layer);
}

/* The head over this step's spans of jobs that asked for it, then its layer's writes (every
 * such span posts them, rows or not). p->mu held; dropped around the head's pass (the
 * messenger has nothing left to post for this step, and no job of it can be freed before the
 * scheduler, which is this thread, finishes its request). */
static void run_head_locked(struct tdm_disagg_prefill *p)
{
    int n = 0;
    for (int s = 0; s < p->n_spans; s++) {
        const struct step_span *sp = &p->spans[s];
        struct job *j = sp->job;
        if (!j->m.want_head || j->failed || j->cancel) continue;
        int rows = TDM_MAX(TDM_MIN(sp->pos0 + sp->n_tokens, (int)j->m.n_tokens - 1) - sp->pos0, 0);
        if (rows && !sp->features) {
            job_fail_locked(j, "%s", "the scheduler kept no features for the head");
            continue;
        }
        p->hrows[n] = (struct tdm_spec_head_rows){.tokens = j->tokens,
                                                  .pos0 = sp->pos0,
                                                  .n = rows,
                                                  .features = sp->features,
                                                  .pages = sp->pages,
                                                  .n_pages = sp->n_pages};
        p->hspan[n++] = s;
    }
    if (!n) return;
    pthread_mutex_unlock(&p->mu);
    tdm_status st = tdm_spec_head_kv_run(p->head_kv, p->hrows, n);
    char err[TDM_DMSG_MAX_ERROR];
    if (st != TDM_OK) snprintf(err, sizeof err, "the head's pass failed: %s", tdm_err_msg());
    pthread_mutex_lock(&p->mu);
    int64_t now = (int64_t)tdm_now_ns();
    for (int k = 0; k < n; k++) {
        const struct step_span *sp = &p->spans[p->hspan[k]];
        if (st != TDM_OK) {
            job_fail_locked(sp->job, "%s", err);
            continue;
        }
        p->head_rows += (uint64_t)p->hrows[k].n;
        for (int l = 0; l < p->head_layers; l++)
            post_span_layer_locked(p, sp, W_HEAD, l, now);
    }
}

/* ---- the KV connector (scheduler thread) ---- */

static void step_begin(void *ctx, const struct tdm_sched_plan *plan)
{
    struct tdm_disagg_prefill *p = ctx;
    pthread_mutex_lock(&p->mu);
    p->n_spans = 0;
    for (int i = 0; i < plan->n_seqs; i++) {
        const struct tdm_plan_seq *q = &plan->seqs[i];
        if (!q->user) continue;
        struct step_span *sp = &p->spans[p->n_spans++];
        *sp = (struct step_span){.job = q->user,
                                 .pos0 = q->pos0,
                                 .n_tokens = q->n_tokens,
                                 .pages = q->pages,
                                 .n_pages = q->n_pages,
                                 .features = q->features};
        post_cached_chunks_locked(p, sp);
    }
    atomic_store(p->layer_counter, 0);
    p->step_seq++;
    p->step_posted = 0;
    p->step_active = p->n_spans > 0;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void step_end(void *ctx, const struct tdm_sched_plan *plan, tdm_status st)
{
    struct tdm_disagg_prefill *p = ctx;
    pthread_mutex_lock(&p->mu);
    if (p->step_active && st == TDM_OK) {
        int64_t now = (int64_t)tdm_now_ns();
        for (; p->step_posted < p->n_layers; p->step_posted++)
            post_layer_locked(p, p->step_posted, now);
        if (p->head_kv) run_head_locked(p);
        for (int i = 0; i < plan->n_seqs; i++) {
            const struct tdm_plan_seq *q = &plan->seqs[i];
            struct job *j = q->user;
            if (!j || !q->last || !(q->want & TDM_ROW_HIDDEN) || !q->n_rows) continue;
            if (j->m.want_head && !q->features) {
                job_fail_locked(j, "%s", "the scheduler kept no features for the head");
                continue;
            }
            /* the job's request asked for the hidden state (and logits) of its last row; a
             * head reads the feature of its last token */
            int row = q->row0 + q->n_rows - 1;
            size_t feature_at, logits_at;
            const uint32_t fw = j->m.want_head ? j->m.head.feature_width : 0; /* validated */
            tdm_disagg_ctx_layout(j->m.d_model, fw, j->m.vocab, j->m.want_logits, &feature_at,
                                  &logits_at);
            float *dst = p->ctx_mem + (size_t)j->ctx_slot * (p->ctx_bytes / sizeof(float));
            memcpy(dst, plan->hidden + (size_t)row * p->d_model,
                   (size_t)p->d_model * sizeof(float));
            if (j->m.want_head)
                memcpy(dst + feature_at, q->features + (size_t)(q->n_tokens - 1) * fw,
                       (size_t)fw * sizeof(float));
            if (j->m.want_logits)
                memcpy(dst + logits_at, plan->logits + (size_t)row * p->vocab,
                       (size_t)p->vocab * sizeof(float));
            uint32_t n_chunks = (j->m.n_tokens - j->m.cached_tokens + j->m.chunk - 1) / j->m.chunk;
            post_locked(p, j, W_CTX, NULL, 0, 0, NULL, n_chunks * (uint32_t)stream_layers(p, j), 0);
            j->ctx_posted = true;
        }
    }
    p->step_active = false;
    p->n_spans = 0;
    pthread_mutex_unlock(&p->mu);
}

static void finished(void *ctx, tdm_req_t *r, void *user, enum tdm_finish why)
{
    struct tdm_disagg_prefill *p = ctx;
    struct job *j = user;
    if (!j) return;
    pthread_mutex_lock(&p->mu);
    j->state = JOB_DRAINING;
    j->why = why;
    if (why != TDM_FINISH_STOP && !j->failed && !j->cancel) {
        j->failed = true;
        snprintf(j->error, sizeof j->error, "the prefill %s",
                 why == TDM_FINISH_CANCELLED ? "was cancelled" : "failed");
    }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* ---- messages (progress thread) ---- */

/* Whether n_layers layers `stride` bytes apart, each written up to page max_page of page_bytes,
 * lie inside a region of `bytes` (all but page_bytes from a peer: no product may overflow). */
static bool region_fits(uint64_t n_layers, uint64_t stride, uint64_t page_bytes, uint64_t max_page,
                        uint64_t bytes)
{
    uint64_t last = (max_page + 1) * page_bytes; /* max_page < 2^32, page_bytes is ours */
    if (last > bytes) return false;
    if (n_layers <= 1) return true;
    return stride >= page_bytes && stride <= (bytes - last) / (n_layers - 1);
}

/* A request for the head's KV: this node's head must be the decoder's. TDM_EUNSUPPORTED (the
 * decoder then asks this node without the head) with both heads named. */
static tdm_status validate_head(struct tdm_disagg_prefill *p, const struct tdm_disagg_head_req *h,
                                char *why, size_t cap)
{
    char theirs[96], ours[96];
    tdm_disagg_head_describe(h, theirs, sizeof theirs);
    if (!p->ep.head.on) {
        snprintf(why, cap,
                 "no speculation head on this prefill node (the decoder's: %.70s); start it "
                 "with --spec mtp --spec-draft HEAD",
                 theirs);
        return TDM_EUNSUPPORTED;
    }
    const struct tdm_disagg_head_req *me = &p->ep.head.id;
    if (h->fingerprint != me->fingerprint || h->n_layers != me->n_layers ||
        h->n_heads != me->n_heads || h->n_kv_heads != me->n_kv_heads ||
        h->head_dim != me->head_dim || h->d_ff != me->d_ff ||
        h->feature_width != me->feature_width) {
        tdm_disagg_head_describe(me, ours, sizeof ours);
        snprintf(why, cap, "speculation heads differ: decoder %.70s, prefill node %.70s", theirs,
                 ours); /* the NACK's room: each head's description fits in 70 */
        return TDM_EUNSUPPORTED;
    }
    return TDM_OK;
}

/* A prefill request this node can serve: TDM_OK, else the status for the NACK and why. */
static tdm_status validate(struct tdm_disagg_prefill *p, uint32_t xpeer,
                           const struct tdm_disagg_prefill_msg *m, struct disagg_route *route,
                           struct tdm_disagg_shard_plan *plan, char *why, size_t cap)
{
    if (m->n_layers != (uint32_t)p->n_layers || m->n_kv_heads != (uint32_t)p->n_kv_heads ||
        m->head_dim != (uint32_t)p->head_dim || m->page_size != (uint32_t)p->page_size ||
        m->d_model != (uint32_t)p->d_model || m->vocab != (uint32_t)p->vocab) {
        snprintf(why, cap,
                 "model or KV geometry differs (decoder: %u layers, %u kv heads, head_dim %u, "
                 "page %u; here: %d, %d, %d, %d)",
                 m->n_layers, m->n_kv_heads, m->head_dim, m->page_size, p->n_layers, p->n_kv_heads,
                 p->head_dim, p->page_size);
        return TDM_EINVAL;
    }
    if (m->kv_dtype != (uint32_t)p->ep.kv.dtype || m->elem_bytes != p->ep.kv.elem_bytes) {
        snprintf(why, cap,
                 "KV element types differ (decoder: %s, %u bytes; here: %s, %zu bytes; give "
                 "both nodes the same --kv-dtype)",
                 tdm_dtype_known((int)m->kv_dtype) ? tdm_dtype_name((enum tdm_dtype)m->kv_dtype)
                                                   : "unknown",
                 m->elem_bytes, tdm_dtype_name(p->ep.kv.dtype), p->ep.kv.elem_bytes);
        return TDM_EINVAL;
    }
    /* TDM_EUNREACHABLE: a decoder that can lend host landing pages asks again with them */
    if (!tdm_disagg_endpoint_kv_route(&p->ep, m->kv.kind, route) ||
        (m->want_head && m->head.kv.kind != m->kv.kind)) {
        snprintf(why, cap,
                 "KV pages: the decoder's in %s memory, ours in %s memory; no transport pairs "
                 "them (CUDA IPC: GPU pools of one host; host staging: host landing pages%s)",
                 m->kv.kind == TDM_XFER_MEM_CUDA ? "GPU" : "host",
                 p->ep.kv.place.kind == TDM_MEM_DEVICE ? "GPU" : "host",
                 p->ep.staging == TDM_DISAGG_STAGING_OFF ? ", off here" : "");
        return TDM_EUNREACHABLE;
    }
    if (route->tp.iface == p->ep.kv_tp.iface && p->ep.ipc) {
        tdm_status st = tdm_xfer_ipc_reach(p->ep.ipc, &m->kv, xpeer);
        if (st == TDM_OK && m->want_head) st = tdm_xfer_ipc_reach(p->ep.ipc, &m->head.kv, xpeer);
        if (st != TDM_OK) {
            snprintf(why, cap,
                     "KV pages: the decoder's GPU memory cannot be opened here (%s): not a node "
                     "of this host?",
                     tdm_err_msg());
            return TDM_EUNREACHABLE;
        }
    }
    if (m->kv_head_begin != 0 || m->kv_head_end != m->n_kv_heads) {
        snprintf(why, cap, "a decoder holding kv heads %u..%u of %u: a decode node holds them all",
                 m->kv_head_begin, m->kv_head_end, m->n_kv_heads);
        return TDM_EINVAL;
    }
    if (!m->sharded && p->n_ranks > 1) {
        snprintf(why, cap,
                 "this prefill node is sharded (--tp %d) and the decoder does not know sharded "
                 "KV transfers (an older tandem): run this node with --tp 1",
                 p->n_ranks);
        return TDM_EINVAL; /* not EUNSUPPORTED: an older decoder reads that as "no head" */
    }
    tdm_status pst = tdm_disagg_shard_plan((int)m->n_kv_heads, (int)m->src_ranks, (int)m->dst_ranks,
                                           m->shard_seed, plan);
    if (pst != TDM_OK) {
        snprintf(why, cap, "%s", tdm_err_msg());
        return TDM_EINVAL; /* EUNSUPPORTED would read as "no head" */
    }
    if (m->src_ranks > 1 || m->dst_ranks > 1) { /* every rank's pool by the fabric */
        bool host = route->tp.iface == p->ep.tp.iface && route->kv == &p->ep.kv_reg;
        for (uint32_t r = 0; r < m->dst_ranks; r++)
            host = host && m->ranks[r].kv.kind == TDM_XFER_MEM_HOST;
        if (!host) {
            snprintf(why, cap,
                     "sharded KV transfers (--tp %u here, %u there) move host pools by the fabric "
                     "only (no GPU pools, no host staging)",
                     m->src_ranks, m->dst_ranks);
            return TDM_EINVAL; /* not EUNSUPPORTED: a decoder reads that as "no head" */
        }
    }
    if (m->chunk > (uint32_t)p->max_chunk) {
        snprintf(why, cap, "chunk of %u tokens is more than this node's step of %d", m->chunk,
                 p->max_chunk);
        return TDM_EINVAL;
    }
    if (m->n_tokens + 1 > (uint32_t)p->max_ctx) {
        snprintf(why, cap, "%u tokens do not fit this node's context of %d", m->n_tokens,
                 p->max_ctx);
        return TDM_EINVAL;
    }
    tdm_status st;
    if (m->want_head && (st = validate_head(p, &m->head, why, cap)) != TDM_OK) return st;
    uint32_t n_chunks = (m->n_tokens - m->cached_tokens + m->chunk - 1) / m->chunk;
    uint64_t layers = (uint64_t)p->n_layers * (uint64_t)plan->writes +
                      (m->want_head ? (uint64_t)p->head_layers : 0);
    if ((uint64_t)n_chunks * layers > p->ep.caps.max_index) {
        snprintf(why, cap, "too many writes for the immediate layout");
        return TDM_EINVAL;
    }
    uint64_t max_page = 0;
    for (uint32_t i = 0; i < m->n_pages; i++)
        if (m->pages[i] > max_page) max_page = m->pages[i];
    size_t ctx_need = tdm_disagg_ctx_layout(m->d_model, m->want_head ? m->head.feature_width : 0,
                                            m->vocab, m->want_logits, NULL, NULL) *
                      sizeof(float);
    bool fits = true;
    for (uint32_t r = 0; r < m->dst_ranks; r++) { /* each destination rank's pool */
        struct tdm_tp_kv_shard ds;
        (void)tdm_tp_kv_shard_of((int)m->n_kv_heads, (int)m->dst_ranks, (int)r, &ds); /* planned */
        /* unsharded: the pool's own page (a latent pool's has no V half) */
        uint64_t page = m->dst_ranks == 1 && p->n_ranks == 1
                            ? p->page_bytes
                            : 2 * (uint64_t)ds.n_kv_heads * p->ep.kv.head_bytes;
        fits = fits && region_fits((uint64_t)p->n_layers, m->ranks[r].dst_layer_stride, page,
                                   max_page, m->ranks[r].kv.bytes);
    }
    if (!fits ||
        (m->want_head && !region_fits((uint64_t)p->head_layers, m->head.dst_layer_stride,
                                      p->ep.head.page_bytes, max_page, m->head.kv.bytes)) ||
        m->ctx_offset > m->ctx.bytes || ctx_need > m->ctx.bytes - m->ctx_offset) {
        snprintf(why, cap, "destination pages or context lie outside the decoder's regions");
        return TDM_EINVAL;
    }
    return TDM_OK;
}

static void on_msg(void *ctx, uint32_t xpeer, const void *data, size_t bytes)
{
    struct tdm_disagg_prefill *p = ctx;
    uint32_t max_pages = (uint32_t)((p->max_ctx + p->page_size - 1) / p->page_size);
    int32_t *tokens = malloc((size_t)p->max_ctx * sizeof *tokens);
    uint32_t *pages = malloc((size_t)max_pages * sizeof *pages);
    struct tdm_disagg_msg m;
    if (!tokens || !pages) goto out;
    tdm_status st =
        tdm_disagg_msg_decode(data, bytes, &m, tokens, (uint32_t)p->max_ctx, pages, max_pages);
    if (st != TDM_OK) {
        TDM_WARN("disagg: bad control message from peer %u: %s", xpeer, tdm_err_msg());
        pthread_mutex_lock(&p->mu);
        p->errors[PERR_REFUSED]++;
        pthread_mutex_unlock(&p->mu);
        if (m.type == TDM_DMSG_PREFILL && bytes >= 24) {
            /* answer so the decoder does not wait for its timeout */
            const uint8_t *b = data;
            uint32_t slot = b[16] | b[17] << 8 | b[18] << 16 | (uint32_t)b[19] << 24;
            uint32_t epoch = b[20] | b[21] << 8 | b[22] << 16 | (uint32_t)b[23] << 24;
            nack(p, xpeer, slot, epoch, st, tdm_err_msg());
        }
        goto out;
    }
    if (m.type == TDM_DMSG_CANCEL) {
        bool found = false;
        pthread_mutex_lock(&p->mu);
        for (struct job *j = p->jobs; j; j = j->next)
            if (j->xpeer == xpeer && j->m.slot == m.slot && j->m.epoch == m.epoch &&
                j->state != JOB_DROPPED) {
                found = true;
                j->cancel = true;
                if (j->req) tdm_req_cancel(j->req);
            }
        pthread_cond_signal(&p->cv);
        pthread_mutex_unlock(&p->mu);
        if (!found) {
            struct tdm_disagg_msg a = {
                .type = TDM_DMSG_CANCEL_ACK, .slot = m.slot, .epoch = m.epoch};
            send_msg(p, xpeer, &a);
        }
        goto out;
    }
    if (m.type != TDM_DMSG_PREFILL) goto out;
    if (m.prefill.sharded && m.prefill.src_ranks != (uint32_t)p->n_ranks) {
        /* the decoder counts on another sharding of this node: it learns ours, asks again */
        pthread_mutex_lock(&p->mu);
        p->errors[PERR_REFUSED]++;
        pthread_mutex_unlock(&p->mu);
        TDM_INFO("disagg: decoder peer %u took this node for --tp %u; told it --tp %d", xpeer,
                 m.prefill.src_ranks, p->n_ranks);
        struct tdm_disagg_msg a = {.type = TDM_DMSG_SCHEME,
                                   .slot = m.prefill.slot,
                                   .epoch = m.prefill.epoch,
                                   .scheme_ranks = (uint32_t)p->n_ranks,
                                   .scheme_kv_heads = (uint32_t)p->n_kv_heads};
        send_msg(p, xpeer, &a);
        goto out;
    }
    char why[TDM_DMSG_MAX_ERROR];
    struct disagg_route route;
    struct tdm_disagg_shard_plan plan;
    tdm_status vst = validate(p, xpeer, &m.prefill, &route, &plan, why, sizeof why);
    if (vst != TDM_OK) {
        pthread_mutex_lock(&p->mu);
        p->errors[PERR_REFUSED]++;
        pthread_mutex_unlock(&p->mu);
        TDM_WARN("disagg: refused a prefill request of decoder peer %u: %s", xpeer, why);
        nack(p, xpeer, m.prefill.slot, m.prefill.epoch, vst, why);
        goto out;
    }
    if (xpeer < sizeof p->told && !p->told[xpeer]) { /* once per peer: the transport it gets */
        p->told[xpeer] = 1;
        TDM_INFO("disagg: decoder peer %u: KV pages by %s, from %s memory here to %s memory there",
                 xpeer, route.how, p->ep.kv.place.kind == TDM_MEM_DEVICE ? "GPU" : "host",
                 m.prefill.kv.kind == TDM_XFER_MEM_CUDA ? "GPU" : "host");
    }
    struct job *j = calloc(1, sizeof *j);
    if (!j) {
        nack(p, xpeer, m.prefill.slot, m.prefill.epoch, TDM_ENOMEM, "out of memory");
        goto out;
    }
    j->xpeer = xpeer;
    j->m = m.prefill;
    j->route = route;
    j->plan = plan;
    j->tokens = tokens;
    j->dst_pages = pages;
    j->m.tokens = tokens;
    j->m.pages = pages;
    j->t_recv = (int64_t)tdm_now_ns();
    j->state = JOB_RECEIVED;
    tokens = NULL;
    pages = NULL;
    pthread_mutex_lock(&p->mu);
    int slot = -1;
    for (int i = 0; i < p->o.max_jobs; i++)
        if (!p->ctx_used[i]) {
            slot = i;
            break;
        }
    if (slot < 0 || p->stop) {
        p->errors[PERR_REFUSED]++;
        pthread_mutex_unlock(&p->mu);
        nack(p, xpeer, j->m.slot, j->m.epoch, TDM_EAGAIN, "the prefill node is full");
        free(j->tokens);
        free(j->dst_pages);
        free(j);
        goto out;
    }
    p->ctx_used[slot] = 1;
    j->ctx_slot = slot;
    j->next = p->jobs;
    p->jobs = j;
    p->n_jobs++;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
out:
    free(tokens);
    free(pages);
}

static void on_peer(void *ctx, uint32_t xpeer, bool up)
{
    struct tdm_disagg_prefill *p = ctx;
    if (up) return;
    /* its GPU pool, opened by CUDA IPC, is closed here, or it could never be freed */
    tdm_xfer_ipc_forget_peer(p->ep.ipc, xpeer);
    if (xpeer < sizeof p->told) p->told[xpeer] = 0; /* a new process may take its index */
    pthread_mutex_lock(&p->mu);
    for (struct job *j = p->jobs; j; j = j->next)
        if (j->xpeer == xpeer && j->state != JOB_DROPPED) {
            p->errors[PERR_PEER]++;
            job_fail_locked(j, "%s", "the decoder went away");
            j->cancel = true; /* nothing to answer */
        }
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* ---- the messenger thread ---- */

/* Submits queued jobs and retires finished ones. p->mu held; drops it around calls out. */
static void service_jobs_locked(struct tdm_disagg_prefill *p)
{
    for (struct job **jp = &p->jobs; *jp;) {
        struct job *j = *jp;
        if (j->state == JOB_RECEIVED) {
            if (j->cancel || j->failed) {
                j->state = JOB_DROPPED;
            } else {
                struct tdm_req_params rp = {.prompt = j->tokens,
                                            .n_prompt = (int)j->m.n_tokens,
                                            .max_tokens = 1,
                                            .sampling = tdm_sampling_defaults(),
                                            .top_logprobs = -1,
                                            .prefill_only = true,
                                            .fixed_chunk = (int)j->m.chunk,
                                            .chunk_phase = (int)(j->m.cached_tokens % j->m.chunk),
                                            .want_hidden = true,
                                            .want_logits = j->m.want_logits != 0,
                                            /* with a head it speculates, on the decoder: the
                                             * scheduler keeps its spans' features */
                                            .spec_k = j->m.want_head ? 0 : -1,
                                            .user = j};
                tdm_req_t *r = NULL;
                j->state = JOB_SCHEDULED;
                pthread_mutex_unlock(&p->mu);
                tdm_status st = tdm_sched_submit(p->sched, &rp, &r);
                pthread_mutex_lock(&p->mu);
                if (st != TDM_OK) {
                    p->errors[PERR_REFUSED]++;
                    j->failed = true;
                    snprintf(j->error, sizeof j->error, "%s", tdm_err_msg());
                    j->state = JOB_DROPPED;
                } else {
                    j->req = r;
                    if (j->cancel || j->failed) tdm_req_cancel(r);
                }
            }
        }
        if ((j->state == JOB_DRAINING || j->state == JOB_DROPPED) && j->outstanding == 0) {
            *jp = j->next;
            p->n_jobs--;
            p->ctx_used[j->ctx_slot] = 0;
            bool ok = !j->failed && !j->cancel && j->why == TDM_FINISH_STOP && j->ctx_posted;
            if (ok) {
                p->jobs_ok++;
                if (j->m.want_head) p->head_jobs_ok++;
                if (j->m.cached_tokens) p->decoder_cached_jobs++;
                p->reused_chunks += (uint64_t)j->reused_chunks;
                tdm_hist_observe(&p->transfer_s, (double)(j->t_last_done - j->t_first_done) * 1e-9);
                tdm_hist_observe(&p->bytes_h, (double)j->bytes);
                TDM_DEBUG("disagg: prefill %llu for peer %u: %u tokens, %llu writes, %llu pages, "
                          "%llu bytes; first write landed %.3f ms after receipt, last %.3f ms",
                          (unsigned long long)j->m.req_id, j->xpeer, j->m.n_tokens,
                          (unsigned long long)j->writes, (unsigned long long)j->pages_written,
                          (unsigned long long)j->bytes,
                          (double)(j->t_first_done - j->t_recv) * 1e-6,
                          (double)(j->t_last_done - j->t_recv) * 1e-6);
            } else if (j->cancel) {
                p->errors[PERR_CANCELLED]++;
            }
            uint32_t xpeer = j->xpeer, slot = j->m.slot, epoch = j->m.epoch;
            bool cancel = j->cancel, failed = !ok;
            char err[sizeof j->error];
            memcpy(err, j->error, sizeof err);
            tdm_req_t *r = j->req;
            free(j->tokens);
            free(j->dst_pages);
            free(j);
            pthread_mutex_unlock(&p->mu);
            tdm_req_release(r);
            if (cancel) {
                struct tdm_disagg_msg a = {
                    .type = TDM_DMSG_CANCEL_ACK, .slot = slot, .epoch = epoch};
                if (tdm_xfer_peer_alive(p->ep.x, xpeer)) send_msg(p, xpeer, &a);
            } else if (failed && tdm_xfer_peer_alive(p->ep.x, xpeer)) {
                nack(p, xpeer, slot, epoch, TDM_EIO, err[0] ? err : "the prefill failed");
            }
            pthread_mutex_lock(&p->mu);
            jp = &p->jobs; /* the list may have changed while unlocked */
            continue;
        }
        jp = &j->next;
    }
}

static void *messenger_main(void *arg)
{
    struct tdm_disagg_prefill *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        service_jobs_locked(p);
        if (p->step_active) {
            int c = atomic_load(p->layer_counter);
            if (c > p->n_layers) c = p->n_layers;
            int64_t now = (int64_t)tdm_now_ns();
            for (; p->step_posted < c; p->step_posted++)
                post_layer_locked(p, p->step_posted, now);
            pthread_mutex_unlock(&p->mu);
            struct timespec ts = {0, 50000}; /* 50 us: a layer takes far longer */
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&p->mu);
        } else {
            struct timespec dl = tdm_deadline_ms(CLOCK_REALTIME, 20);
            pthread_cond_timedwait(&p->cv, &p->mu, &dl);
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ---- lifecycle ---- */

tdm_status tdm_disagg_prefill_create(const struct tdm_disagg_prefill_opts *o, tdm_engine_t *e,
                                     tdm_sched_t *s, tdm_disagg_prefill_t **out)
{
    const struct tdm_model_config *c = &tdm_engine_model(e)->cfg;
    const struct tdm_engine_opts *eo = tdm_engine_opts(e);
    if (o->head && tdm_engine_tp_ranks(e) > 1) return tdm_disagg_refuse_tp_head(e);
    _Atomic int32_t *layer_counter = tdm_engine_layer_counter(e);
    if (!layer_counter)
        return tdm_err_set(TDM_EINVAL,
                           "disagg: the prefill side streams layers as they finish: create the "
                           "engine with count_layers");
    struct tdm_disagg_prefill *p = calloc(1, sizeof *p);
    if (!p) return tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
    p->o = *o;
    if (p->o.max_jobs <= 0) p->o.max_jobs = 256;
    p->engine = e;
    p->sched = s;
    p->kv = tdm_engine_kv(e);
    p->layer_counter = layer_counter;
    p->n_layers = c->n_layers;
    p->n_kv_heads = c->n_kv_heads;
    p->head_dim = c->head_dim;
    p->d_model = c->d_model;
    p->vocab = c->vocab_size;
    p->page_size = eo->page_size;
    p->max_ctx = eo->max_ctx;
    p->max_chunk = eo->max_batch_tokens;
    p->n_ranks = tdm_engine_tp_ranks(e);
    struct tdm_kv_geometry g = tdm_kv_pool_geometry(p->kv);
    p->page_bytes = g.page_bytes;
    p->layer_bytes = g.layer_bytes;
    /* room for the largest context: hidden state, feature (the head's: d_model, or an EAGLE-3
     * head's fused one), logits */
    const int fw = o->head && o->head->head && o->head->head->feature_width > 0
                       ? o->head->head->feature_width
                       : p->d_model;
    p->ctx_bytes = (tdm_disagg_ctx_layout((uint32_t)p->d_model, (uint32_t)fw, (uint32_t)p->vocab,
                                          true, NULL, NULL) *
                        sizeof(float) +
                    63) /
                   64 * 64;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    static const double lat[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06,
                                 0.08,   0.1,   0.15,   0.2,   0.3,  0.4,  0.5,  0.75,
                                 1,      1.5,   2,      3,     5,    7.5,  10,   20};
    static const double sz[] = {4096,     16384,    65536,     262144,     1048576,     4194304,
                                16777216, 67108864, 268435456, 1073741824, 4294967296.0};
    p->transfer_s.n_buckets = p->layer_lag_s.n_buckets = 24;
    memcpy(p->transfer_s.bounds, lat, sizeof lat);
    memcpy(p->layer_lag_s.bounds, lat, sizeof lat);
    p->bytes_h.n_buckets = 11;
    memcpy(p->bytes_h.bounds, sz, sizeof sz);

    int max_pages = (p->max_ctx + p->page_size - 1) / p->page_size;
    p->spans = calloc((size_t)eo->max_seqs, sizeof *p->spans);
    p->src_tmp = malloc((size_t)max_pages * sizeof *p->src_tmp);
    p->dst_tmp = malloc((size_t)max_pages * sizeof *p->dst_tmp);
    p->ctx_used = calloc((size_t)p->o.max_jobs, 1);
    p->ctx_mem = aligned_alloc(64, p->ctx_bytes * (size_t)p->o.max_jobs);
    tdm_status st;
    if (!p->spans || !p->src_tmp || !p->dst_tmp || !p->ctx_used || !p->ctx_mem) {
        st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
        goto out_free;
    }
    if (o->head) { /* the decoders' head: its engine, its rows, and the spans' features */
        p->head_layers = o->head->cfg.n_layers;
        p->hrows = calloc((size_t)eo->max_seqs, sizeof *p->hrows);
        p->hspan = calloc((size_t)eo->max_seqs, sizeof *p->hspan);
        if (!p->hrows || !p->hspan) {
            st = tdm_err_set(TDM_ENOMEM, "disagg: out of memory");
            goto out_free;
        }
        if ((st = tdm_spec_head_kv_create(e, o->head, &p->head_kv)) != TDM_OK ||
            (st = tdm_sched_reserve_features(s)) != TDM_OK)
            goto out_free;
    }
    tdm_kv_pool_t *rank_kv[TDM_DISAGG_MAX_RANKS] = {0};
    for (int r = 0; r < p->n_ranks && r < TDM_DISAGG_MAX_RANKS; r++)
        rank_kv[r] = tdm_engine_rank_kv(e, r);
    struct disagg_endpoint_opts eopts = {
        .xfer = &o->xfer,
        .max_ctx = p->max_ctx,
        .rank_kv = rank_kv,
        .n_ranks = p->n_ranks,
        .page_size = p->page_size,
        /* a step's writes per span, twice */
        .min_jobs =
            (p->n_layers * (p->n_ranks > 1 ? 4 : 1) + p->head_layers + 1) * eo->max_seqs * 2,
        .kv = p->kv,
        .ctx_mem = p->ctx_mem,
        .ctx_bytes = p->ctx_bytes * (size_t)p->o.max_jobs,
        .head = o->head,
        .on_msg = on_msg,
        .on_peer = on_peer,
        .ctx = p};
    /* jobs' requests want the hidden state (and logits) of their last row */
    if ((st = tdm_sched_reserve_rows(s)) != TDM_OK) goto out_free;
    if ((st = tdm_disagg_endpoint_open(&p->ep, &eopts)) != TDM_OK) goto out_free;
    static const struct tdm_kv_connector_i conn = {
        .step_begin = step_begin, .step_end = step_end, .finished = finished};
    tdm_sched_set_connector(s, &conn, p);
    if (pthread_create(&p->thread, NULL, messenger_main, p)) {
        st = tdm_err_set(TDM_EINTERNAL, "disagg: cannot start the messenger thread");
        goto out_mr;
    }
    *out = p;
    return TDM_OK;

out_mr:
    tdm_disagg_endpoint_stop(&p->ep);
    tdm_disagg_endpoint_release(&p->ep);
out_free:
    tdm_spec_head_kv_destroy(p->head_kv);
    free(p->hrows);
    free(p->hspan);
    free(p->spans);
    free(p->src_tmp);
    free(p->dst_tmp);
    free(p->ctx_used);
    free(p->ctx_mem);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
    return st;
}

void tdm_disagg_prefill_destroy(tdm_disagg_prefill_t *p)
{
    if (!p) return;
    /* the scheduler is stopped (every job's request has finished) */
    tdm_disagg_endpoint_stop(&p->ep); /* completes pending writes with TDM_ECANCELED */
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(p->thread, NULL);
    for (struct job *j = p->jobs, *n; j; j = n) {
        n = j->next;
        tdm_req_release(j->req);
        free(j->tokens);
        free(j->dst_pages);
        free(j);
    }
    tdm_disagg_endpoint_release(&p->ep);
    tdm_spec_head_kv_destroy(p->head_kv);
    free(p->hrows);
    free(p->hspan);
    free(p->spans);
    free(p->src_tmp);
    free(p->dst_tmp);
    free(p->ctx_used);
    free(p->ctx_mem);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p);
}

tdm_status tdm_disagg_prefill_addr(const tdm_disagg_prefill_t *p, char *buf, size_t cap)
{
    return tdm_xfer_addr(p->ep.x, buf, cap);
}

char *tdm_disagg_prefill_metrics(void *ctx)
{
    struct tdm_disagg_prefill *p = ctx;
    struct tdm_sbuf b = {0};
    pthread_mutex_lock(&p->mu);
    tdm_hist_prom(&b, "tandem_disagg_transfer_seconds",
                  "Per request: from the first KV write landing to the last.", &p->transfer_s,
                  NULL);
    tdm_hist_prom(&b, "tandem_disagg_layer_lag_seconds",
                  "Per write: from its layer finishing to the write landing.", &p->layer_lag_s,
                  NULL);
    tdm_hist_prom(&b, "tandem_disagg_transfer_bytes", "Per request: KV and context bytes sent.",
                  &p->bytes_h, NULL);
    tdm_prom_scalar(&b, "tandem_disagg_prefill_queue_depth", "gauge",
                    "Prefill requests accepted and not finished.", NULL, p->n_jobs);
    tdm_prom_scalar(&b, "tandem_disagg_prefills_total", "counter",
                    "Prefill requests whose writes all landed.", NULL, (double)p->jobs_ok);
    tdm_prom_scalar(&b, "tandem_disagg_writes_total", "counter", "KV and context writes completed.",
                    NULL, (double)p->writes_total);
    tdm_prom_scalar(&b, "tandem_disagg_write_bytes_total", "counter", "Bytes written to decoders.",
                    NULL, (double)p->bytes_total);
    tdm_prom_scalar(&b, "tandem_disagg_head_kv_prefills_total", "counter",
                    "Prefill requests that also streamed the speculation head's KV.", NULL,
                    (double)p->head_jobs_ok);
    tdm_prom_scalar(&b, "tandem_disagg_head_rows_total", "counter",
                    "Rows the speculation head ran for decoders.", NULL, (double)p->head_rows);
    tdm_prom_scalar(&b, "tandem_disagg_decoder_cached_prefills_total", "counter",
                    "Prefill requests for the part past a prefix the decoder had cached.", NULL,
                    (double)p->decoder_cached_jobs);
    tdm_prom_scalar(&b, "tandem_disagg_reused_chunks_total", "counter",
                    "Decoder chunks sent from this node's prefix cache without computing them.",
                    NULL, (double)p->reused_chunks);
    tdm_prom_scalar(&b, "tandem_disagg_writes_landed_during_forward_total", "counter",
                    "Writes that landed while the forward pass that produced them was still "
                    "running (layer streaming).",
                    NULL, (double)p->landed_during_forward);
    tdm_prom_family(&b, "tandem_disagg_transfer_errors_total", "counter",
                    "Failed prefill requests, by kind.");
    for (int i = 0; i < N_PERR; i++) {
        char lab[64];
        snprintf(lab, sizeof lab, "kind=\"%s\"", perr_names[i]);
        tdm_prom_sample(&b, "tandem_disagg_transfer_errors_total", lab, (double)p->errors[i]);
    }
    tdm_prom_family(&b, "tandem_disagg_rank_writes_total", "counter",
                    "KV slice writes completed, by the rank (--tp) whose pool they read.");
    for (int r = 0; r < p->n_ranks && r < TDM_DISAGG_MAX_RANKS; r++) {
        char lab[32];
        snprintf(lab, sizeof lab, "rank=\"%d\"", r);
        tdm_prom_sample(&b, "tandem_disagg_rank_writes_total", lab, (double)p->rank_writes[r]);
    }
    pthread_mutex_unlock(&p->mu);
    tdm_disagg_endpoint_metrics(&p->ep, &b);
    return tdm_sbuf_take(&b);
}
