/*
 * The head trainer's data: what the target computes on its own continuations of a prompt set
 * (self-distillation), made by tandem's inference path and cached to disk.
 *
 * Making it (tdm_train_data_generate). The prompts run through the scheduler on the target's
 * engine, `batch` at a time, each once per temperature, stopping at EOS or max_new_tokens. A
 * recording drafter (one that proposes nothing) takes the target's feature of every position
 * through the scheduler's feed, the same path `--spec mtp` reads them by: the prompt's from
 * its prefill chunks, then one per decode step. A finished request's sequence keeps the
 * positions whose features came back: tokens t(0 .. n-1) and features h(0 .. n-1). Then the
 * teacher pass gives each position the target's next-token distribution, its top-k from the
 * logits of the target's own LM head (the backend's matmul over the features, the op the
 * forward pass ends with).
 *
 * The file (little-endian; every section starts at a multiple of 64 bytes):
 *   header   "TDMTRAIN", u32 version 1, u32 d_model, u32 top_k, u32 vocab, u64 n_seqs,
 *            u64 n_pos, u64 fingerprint (of the target and the settings that made it)
 *   off      u64 [n_seqs + 1]   sequence i is positions [off[i], off[i+1]); off[0] = 0
 *   meta     i32 [n_seqs][2]    the prompt's length, the prompt's index in the prompt set
 *   tokens   i32 [n_pos]
 *   top_ids  i32 [n_pos][top_k] (-1 pads)
 *   top_p    f32 [n_pos][top_k] descending
 *   feats    f32 [n_pos][d_model]
 * A file is untrusted bytes: tdm_train_data_parse checks every count, offset, id, probability
 * and feature before anything is believed (tests/fuzz/fuzz_train_data.c).
 *
 * Ownership: a tdm_train_data_t owns its arrays, or the file's memory map they point into.
 * Threading: generation runs on the caller's thread (it drives the scheduler step by step).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

#define MAGIC       "TDMTRAIN"
#define VERSION     1
#define HEADER_SIZE 64

struct tdm_train_data {
    int d_model, top_k, vocab, n_seqs;
    int64_t n_pos;
    uint64_t fingerprint;
    const uint64_t *off;   /* [n_seqs + 1] */
    const int32_t *meta;   /* [n_seqs][2] */
    const int32_t *tokens; /* [n_pos] */
    const int32_t *top_ids;
    const float *top_p;
    const float *feats;
    struct tdm_mmap map; /* loaded from a file: the arrays point into it */
    void *own[6];        /* made here */
};

void tdm_train_data_free(tdm_train_data_t *d)
{
    if (!d) return;
    tdm_mmap_close(&d->map);
    for (size_t i = 0; i < TDM_ARRAY_LEN(d->own); i++)
        free(d->own[i]);
    free(d);
}

int tdm_train_data_n_seqs(const tdm_train_data_t *d)
{
    return d->n_seqs;
}
int64_t tdm_train_data_positions(const tdm_train_data_t *d)
{
    return d->n_pos;
}
int tdm_train_data_top_k(const tdm_train_data_t *d)
{
    return d->top_k;
}
int tdm_train_data_prompt(const tdm_train_data_t *d, int i)
{
    return d->meta[2 * i + 1];
}
void tdm_train_data_seq(const tdm_train_data_t *d, int i, struct tdm_train_seq *out)
{
    int64_t o = (int64_t)d->off[i];
    int len = (int)(d->off[i + 1] - d->off[i]);
    /* scored from the row that predicts the first output: p + 1 = n_prompt - 1 */
    *out = (struct tdm_train_seq){.tokens = d->tokens + o,
                                  .feats = d->feats + (size_t)o * d->d_model,
                                  .top_ids = d->top_ids + (size_t)o * d->top_k,
                                  .top_p = d->top_p + (size_t)o * d->top_k,
                                  .len = len,
                                  .first = TDM_MAX(0, d->meta[2 * i] - 2)};
}

/* ---- the file ---- */
static size_t up64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}
struct layout {
    size_t off, meta, tokens, top_ids, top_p, feats, end;
};
static bool layout_of(uint64_t n_seqs, uint64_t n_pos, uint64_t k, uint64_t d, struct layout *l)
{
    /* every product and sum overflow-checked: the counts come from a file */
    uint64_t a, b, c, e, f;
    if (__builtin_mul_overflow(n_seqs + 1, 8, &a) || __builtin_mul_overflow(n_seqs, 8, &b) ||
        __builtin_mul_overflow(n_pos, 4, &c) || __builtin_mul_overflow(c, k, &e) ||
        __builtin_mul_overflow(c, d, &f) || a > (1ull << 48) || e > (1ull << 48) ||
        f > (1ull << 50))
        return false;
    l->off = HEADER_SIZE;
    l->meta = up64(l->off + a);
    l->tokens = up64(l->meta + b);
    l->top_ids = up64(l->tokens + c);
    l->top_p = up64(l->top_ids + e);
    l->feats = up64(l->top_p + e);
    l->end = l->feats + f;
    return true;
}
static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p)
{
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

static tdm_status parse(const void *buf, size_t size, uint64_t fingerprint, int d_model, int vocab,
                        tdm_train_data_t *out)
{
    const uint8_t *b = buf;
    if (size < HEADER_SIZE || memcmp(b, MAGIC, 8))
        return tdm_err_set(TDM_EFORMAT, "not tandem training data (no TDMTRAIN header)");
    uint32_t ver = rd32(b + 8), d = rd32(b + 12), k = rd32(b + 16), v = rd32(b + 20);
    uint64_t n_seqs = rd64(b + 24), n_pos = rd64(b + 32), fp = rd64(b + 40);
    if (ver != VERSION)
        return tdm_err_set(TDM_EFORMAT, "training data version %u (this build reads %d)", ver,
                           VERSION);
    if (fp != fingerprint)
        return tdm_err_set(TDM_EINVAL,
                           "the training data was made from another target or "
                           "with other settings (fingerprint %016llx, want %016llx)",
                           (unsigned long long)fp, (unsigned long long)fingerprint);
    if ((int)d != d_model || (int)v != vocab || k == 0 || k > TDM_TRAIN_MAX_TOPK ||
        n_seqs > (uint64_t)INT32_MAX)
        return tdm_err_set(TDM_EFORMAT,
                           "training data for width %u, vocabulary %u, top-k %u, %llu sequences "
                           "(the target: width %d, vocabulary %d)",
                           d, v, k, (unsigned long long)n_seqs, d_model, vocab);
    struct layout l;
    if (!layout_of(n_seqs, n_pos, k, d, &l) || l.end != size)
        return tdm_err_set(TDM_EFORMAT, "training data of %zu bytes, its header says otherwise",
                           size);
    /* sections are 64-byte aligned in a page-aligned map (or the caller's aligned buffer) */
    const uint64_t *off = (const uint64_t *)(b + l.off);
    const int32_t *meta = (const int32_t *)(b + l.meta), *tok = (const int32_t *)(b + l.tokens);
    const int32_t *ids = (const int32_t *)(b + l.top_ids);
    const float *tp = (const float *)(b + l.top_p), *ft = (const float *)(b + l.feats);
    if (off[0] != 0 || off[n_seqs] != n_pos)
        return tdm_err_set(TDM_EFORMAT, "training data: the sequence offsets do not cover it");
    for (uint64_t i = 0; i < n_seqs; i++) {
        uint64_t len = off[i + 1] - off[i];
        if (off[i + 1] < off[i] || len < 2 || len > TDM_TRAIN_MAX_LEN || meta[2 * i] < 1 ||
            meta[2 * i + 1] < 0)
            return tdm_err_set(TDM_EFORMAT, "training data: sequence %llu is malformed",
                               (unsigned long long)i);
    }
    for (uint64_t i = 0; i < n_pos; i++) {
        if (tok[i] < 0 || (uint32_t)tok[i] >= v)
            return tdm_err_set(TDM_EFORMAT, "training data: token %d at %llu", tok[i],
                               (unsigned long long)i);
        for (uint32_t j = 0; j < k; j++) {
            int32_t id = ids[i * k + j];
            float p = tp[i * k + j];
            if (id < -1 || (id >= 0 && (uint32_t)id >= v) || !(p >= 0.0f && p <= 1.0f) ||
                (id < 0 && p != 0.0f) || (j > 0 && p > tp[i * k + j - 1]))
                return tdm_err_set(TDM_EFORMAT,
                                   "training data: a bad distribution at position %llu",
                                   (unsigned long long)i);
        }
    }
    for (uint64_t i = 0; i < n_pos * d; i++)
        if (!isfinite(ft[i]))
            return tdm_err_set(TDM_EFORMAT, "training data: a feature is not finite");
    *out = (struct tdm_train_data){.d_model = (int)d,
                                   .top_k = (int)k,
                                   .vocab = (int)v,
                                   .n_seqs = (int)n_seqs,
                                   .n_pos = (int64_t)n_pos,
                                   .fingerprint = fp,
                                   .off = off,
                                   .meta = meta,
                                   .tokens = tok,
                                   .top_ids = ids,
                                   .top_p = tp,
                                   .feats = ft};
    return TDM_OK;
}

tdm_status tdm_train_data_parse(const void *buf, size_t size, uint64_t fingerprint, int d_model,
                                int vocab, tdm_train_data_t **out)
{
    struct tdm_train_data *d = calloc(1, sizeof *d);
    if (!d) return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    tdm_status st = parse(buf, size, fingerprint, d_model, vocab, d);
    if (st != TDM_OK) {
        free(d);
        return st;
    }
    *out = d;
    return TDM_OK;
}

tdm_status tdm_train_data_load(const char *path, uint64_t fingerprint, int d_model, int vocab,
                               tdm_train_data_t **out)
{
    struct tdm_train_data *d = calloc(1, sizeof *d);
    if (!d) return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    struct tdm_mmap map;
    tdm_status st = tdm_mmap_open(path, &map);
    if (st != TDM_OK) {
        free(d);
        return st;
    }
    if ((st = parse(map.data, map.size, fingerprint, d_model, vocab, d)) != TDM_OK) {
        char msg[512]; /* the message is the error buffer tdm_err_set writes */
        snprintf(msg, sizeof msg, "%s", tdm_err_msg());
        tdm_err_set(st, "%s: %s", path, msg);
        tdm_mmap_close(&map);
        free(d);
        return st;
    }
    d->map = map;
    *out = d;
    return TDM_OK;
}

static bool put(FILE *f, const void *p, size_t n, size_t *at)
{
    *at += n;
    return n == 0 || fwrite(p, 1, n, f) == n;
}
static bool pad_to(FILE *f, size_t to, size_t *at)
{
    static const uint8_t zero[64];
    return *at <= to && put(f, zero, to - *at, at);
}

tdm_status tdm_train_data_save(const tdm_train_data_t *d, const char *path)
{
    char tmp[4096];
    int w = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = w > 0 && (size_t)w < sizeof tmp ? fopen(tmp, "wb") : NULL;
    if (!f) return tdm_err_set(TDM_EIO, "%s: cannot write", path);
    struct layout l;
    layout_of((uint64_t)d->n_seqs, (uint64_t)d->n_pos, (uint64_t)d->top_k, (uint64_t)d->d_model,
              &l);
    uint8_t h[HEADER_SIZE] = {0};
    memcpy(h, MAGIC, 8);
    uint32_t u32[4] = {VERSION, (uint32_t)d->d_model, (uint32_t)d->top_k, (uint32_t)d->vocab};
    uint64_t u64[3] = {(uint64_t)d->n_seqs, (uint64_t)d->n_pos, d->fingerprint};
    memcpy(h + 8, u32, sizeof u32); /* little-endian hosts only (x86-64, aarch64) */
    memcpy(h + 24, u64, sizeof u64);
    size_t at = 0, n = (size_t)d->n_pos, k = (size_t)d->top_k;
    bool ok = put(f, h, sizeof h, &at) && put(f, d->off, ((size_t)d->n_seqs + 1) * 8, &at) &&
              pad_to(f, l.meta, &at) && put(f, d->meta, (size_t)d->n_seqs * 8, &at) &&
              pad_to(f, l.tokens, &at) && put(f, d->tokens, n * 4, &at) &&
              pad_to(f, l.top_ids, &at) && put(f, d->top_ids, n * k * 4, &at) &&
              pad_to(f, l.top_p, &at) && put(f, d->top_p, n * k * 4, &at) &&
              pad_to(f, l.feats, &at) && put(f, d->feats, n * d->d_model * 4, &at);
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return tdm_err_set(TDM_EIO, "%s: cannot write", path);
    }
    return TDM_OK;
}

/* ---- making it ---- */
struct rslot {
    tdm_req_t *r;
    int job;      /* index into the jobs (prompt, temperature) */
    int have;     /* features of positions [0, have) recorded */
    float *feats; /* [max_ctx][d] */
};
struct recorder {
    int d, n_slots;
    struct rslot *slots;
};

static void rec_propose(void *ctx, struct tdm_sched_draft *d, int n, int base_tokens)
{
    for (int i = 0; i < n; i++)
        d[i].n = 0;
}
static void rec_accepted(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                         int n_accepted, int n_published)
{
}
static void rec_step_done(void *ctx, const struct tdm_sched_plan *plan, uint64_t run_ns) {}
static void rec_feed(void *ctx, const struct tdm_sched_feed *f, int n)
{
    struct recorder *rc = ctx;
    for (int i = 0; i < n; i++)
        for (int s = 0; s < rc->n_slots; s++) {
            struct rslot *sl = &rc->slots[s];
            if (sl->r != f[i].req) continue;
            if (f[i].pos0 <= sl->have) { /* a gap never happens: spans come in order */
                memcpy(sl->feats + (size_t)f[i].pos0 * rc->d, f[i].features,
                       (size_t)f[i].n * rc->d * sizeof(float));
                sl->have = TDM_MAX(sl->have, f[i].pos0 + f[i].n);
            }
            break;
        }
}

/* Growable arrays of the data being made. */
struct grow {
    uint64_t *off;
    int32_t *meta, *tokens;
    float *feats;
    int64_t cap_seqs, cap_pos;
};
static bool grow_to(struct grow *g, struct tdm_train_data *d, int64_t seqs, int64_t pos)
{
    if (seqs + 1 > g->cap_seqs) {
        int64_t c = TDM_MAX(seqs + 1, 2 * g->cap_seqs);
        uint64_t *o = realloc(g->off, (size_t)c * sizeof *o);
        if (o) g->off = o;
        int32_t *m = realloc(g->meta, (size_t)c * 2 * sizeof *m);
        if (m) g->meta = m;
        if (!o || !m) return false;
        g->cap_seqs = c;
    }
    if (pos > g->cap_pos) {
        int64_t c = TDM_MAX(pos, 2 * g->cap_pos);
        int32_t *t = realloc(g->tokens, (size_t)c * sizeof *t);
        if (t) g->tokens = t;
        float *f = realloc(g->feats, (size_t)c * d->d_model * sizeof *f);
        if (f) g->feats = f;
        if (!t || !f) return false;
        g->cap_pos = c;
    }
    return true;
}

/* One row's top-k under softmax(logits): ids descending, their probabilities. NaN counts as
 * -inf; ties keep the lower id first. */
static void row_topk(const float *x, int V, int K, int32_t *ids, float *probs)
{
    float mx = -INFINITY;
    for (int v = 0; v < V; v++)
        mx = fmaxf(mx, x[v]); /* fmaxf skips NaN */
    double sum = 0;
    for (int v0 = 0; v0 < V; v0 += 256) { /* float partial sums, a double total */
        float part = 0;
        for (int v = v0; v < V && v < v0 + 256; v++)
            part += x[v] == x[v] ? expf(x[v] - mx) : 0.0f;
        sum += part;
    }
    int n = 0;
    for (int v = 0; v < V; v++) {
        float xv = x[v] == x[v] ? x[v] : -INFINITY;
        if (n == K && !(xv > x[ids[K - 1]])) continue;
        int j = n < K ? n++ : K - 1;
        while (j > 0 && xv > x[ids[j - 1]]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = v;
    }
    for (int k = 0; k < K; k++) {
        float p = k < n && isfinite(mx) && sum > 0 ? (float)(expf(x[ids[k]] - mx) / sum) : 0.0f;
        probs[k] = p == p ? p : 0.0f;
        if (k >= n) ids[k] = -1;
    }
}

struct topk_job {
    const float *host;
    int n, V, K;
    int32_t *ids;
    float *probs;
};
static void topk_worker(void *ctx, int ith, int nth)
{
    const struct topk_job *j = ctx;
    int64_t b, e;
    tdm_split_range(j->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++)
        row_topk(j->host + (size_t)i * j->V, j->V, j->K, j->ids + (size_t)i * j->K,
                 j->probs + (size_t)i * j->K);
}

/* The teacher pass: each position's top-k under the target's LM head, chunk by chunk on the
 * engine's backend (its matmul: the op the forward pass ends with), the top-k on the host over
 * a pool of its own. */
static tdm_status teacher(tdm_engine_t *e, struct tdm_train_data *d, int32_t *ids, float *probs,
                          const struct tdm_train_gen_opts *o)
{
    const struct tdm_model *m = tdm_engine_model(e);
    tdm_backend_t *b = tdm_engine_backend(e);
    const struct tdm_backend_i *ops = b->iface;
    const int dm = d->d_model, V = d->vocab, K = d->top_k;
    enum { CHUNK = 512 };
    struct tdm_weight w;
    tdm_status st = ops->weight_prepare(b, &m->output, &w);
    if (st != TDM_OK) return st;
    struct tdm_buf xin = {0}, lg = {0};
    tdm_pool_t *pool = NULL;
    float *host = malloc((size_t)CHUNK * V * sizeof(float));
    if (!host) {
        st = tdm_err_set(TDM_ENOMEM, "train: out of memory");
        goto out;
    }
    if ((st = tdm_pool_create(o->n_threads, &pool)) != TDM_OK ||
        (st = tdm_backend_buf_new(b, (size_t)CHUNK * dm * sizeof(float), "teacher rows", &xin)) !=
            TDM_OK ||
        (st = tdm_backend_buf_new(b, (size_t)CHUNK * V * sizeof(float), "teacher logits", &lg)) !=
            TDM_OK)
        goto out;
    for (int64_t p0 = 0; p0 < d->n_pos; p0 += CHUNK) {
        int n = (int)TDM_MIN(CHUNK, d->n_pos - p0);
        ops->upload(b, xin.ptr, d->feats + (size_t)p0 * dm, (size_t)n * dm * sizeof(float));
        ops->matmul(b, &w, xin.ptr, n, NULL, lg.ptr);
        ops->download(b, host, lg.ptr, (size_t)n * V * sizeof(float));
        ops->sync(b);
        struct topk_job j = {host, n, V, K, ids + (size_t)p0 * K, probs + (size_t)p0 * K};
        tdm_pool_run(pool, topk_worker, &j);
        if (o->progress && (p0 / CHUNK) % 32 == 0)
            o->progress(o->progress_ctx, "teacher", (double)(p0 + n) / (double)d->n_pos, p0 + n);
    }
out:
    tdm_backend_buf_release(b, &xin);
    tdm_backend_buf_release(b, &lg);
    tdm_pool_destroy(pool);
    free(host);
    return st;
}

tdm_status tdm_train_data_generate(tdm_engine_t *target, const tdm_tok_t *tok,
                                   int32_t *const *prompts, const int *n_prompt, int n,
                                   const struct tdm_train_gen_opts *o, tdm_train_data_t **out)
{
    const struct tdm_model *m = tdm_engine_model(target);
    const int dm = m->cfg.d_model, V = m->cfg.vocab_size;
    const int max_ctx = tdm_engine_opts(target)->max_ctx;
    const int n_temps = TDM_MAX(1, o->n_temperatures), jobs = n * n_temps;
    if (n <= 0 || o->batch <= 0 || o->max_new_tokens <= 0 || o->top_k <= 0 ||
        o->top_k > TDM_TRAIN_MAX_TOPK)
        return tdm_err_set(TDM_EINVAL,
                           "train: data generation options (prompts %d, batch %d, "
                           "tokens %d, top-k %d)",
                           n, o->batch, o->max_new_tokens, o->top_k);
    struct tdm_train_data *d = calloc(1, sizeof *d);
    struct recorder rc = {.d = dm, .n_slots = o->batch};
    rc.slots = calloc((size_t)o->batch, sizeof *rc.slots);
    struct grow g = {0};
    tdm_sched_t *s = NULL;
    tdm_status st = TDM_OK;
    if (!d || !rc.slots) {
        st = tdm_err_set(TDM_ENOMEM, "train: out of memory");
        goto fail;
    }
    *d = (struct tdm_train_data){
        .d_model = dm, .top_k = o->top_k, .vocab = V, .fingerprint = o->fingerprint};
    for (int i = 0; i < o->batch; i++)
        if (!(rc.slots[i].feats = malloc((size_t)max_ctx * dm * sizeof(float)))) {
            st = tdm_err_set(TDM_ENOMEM, "train: out of memory for features");
            goto fail;
        }
    struct tdm_sched_opts so = {.max_seqs = o->batch, .watermark_pages = -1};
    if ((st = tdm_sched_create(target, tok, &so, &s)) != TDM_OK) goto fail;
    static const struct tdm_sched_drafter_i rec_iface = {.propose = rec_propose,
                                                         .accepted = rec_accepted,
                                                         .step_done = rec_step_done,
                                                         .feed = rec_feed};
    struct tdm_sched_drafter_i iface = rec_iface;
    iface.feature_dim = dm;
    if ((st = tdm_sched_set_drafter(s, &iface, &rc, 1)) != TDM_OK) goto fail;
    int next = 0, done = 0;
    int64_t pos = 0, seqs = 0;
    while (done < jobs) {
        for (int i = 0; i < o->batch && next < jobs; i++) {
            struct rslot *sl = &rc.slots[i];
            if (sl->r) continue;
            int pi = next / n_temps, ti = next % n_temps;
            int room = max_ctx - n_prompt[pi] - TDM_SPEC_MAX_K - 1;
            if (room < 1) { /* a prompt that leaves no room: skipped */
                next++;
                done++;
                continue;
            }
            struct tdm_req_params p = {.prompt = prompts[pi],
                                       .n_prompt = n_prompt[pi],
                                       .max_tokens = TDM_MIN(o->max_new_tokens, room),
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = o->n_temperatures ? o->temperatures[ti] : 0.0f;
            p.sampling.seed = o->seed + (uint64_t)next;
            if ((st = tdm_sched_submit(s, &p, &sl->r)) != TDM_OK) goto fail;
            sl->job = next++;
            sl->have = 0;
        }
        tdm_sched_step(s);
        for (int i = 0; i < o->batch; i++) {
            struct rslot *sl = &rc.slots[i];
            if (!sl->r) continue;
            struct tdm_req_view v;
            tdm_req_lock(sl->r, &v);
            enum tdm_finish fin = v.finish;
            if (fin == TDM_FINISH_ERROR) {
                st = tdm_err_set(v.error ? v.error : TDM_EIO, "train: a generation failed: %s",
                                 v.error_msg);
                tdm_req_unlock(sl->r);
                goto fail;
            }
            if (fin != TDM_FINISH_NONE) {
                int pi = sl->job / n_temps, np = n_prompt[pi];
                int len = TDM_MIN(sl->have, np + v.n_out);
                len = TDM_MIN(len, TDM_TRAIN_MAX_LEN);
                if (len >= 2) {
                    if (!grow_to(&g, d, seqs + 1, pos + len)) {
                        tdm_req_unlock(sl->r);
                        st = tdm_err_set(TDM_ENOMEM, "train: out of memory for the data");
                        goto fail;
                    }
                    g.off[seqs] = (uint64_t)pos;
                    g.meta[2 * seqs] = np;
                    g.meta[2 * seqs + 1] = pi;
                    for (int q = 0; q < len; q++)
                        g.tokens[pos + q] = q < np ? prompts[pi][q] : v.tokens[q - np];
                    memcpy(g.feats + (size_t)pos * dm, sl->feats, (size_t)len * dm * 4);
                    pos += len;
                    seqs++;
                    g.off[seqs] = (uint64_t)pos;
                }
            }
            tdm_req_unlock(sl->r);
            if (fin != TDM_FINISH_NONE) {
                tdm_req_release(sl->r);
                sl->r = NULL;
                done++;
                if (o->progress) o->progress(o->progress_ctx, "generate", (double)done / jobs, pos);
            }
        }
    }
    tdm_sched_destroy(s);
    s = NULL;
    if (!seqs) {
        st = tdm_err_set(TDM_EINVAL, "train: the prompts gave no sequence to train on");
        goto fail;
    }
    d->n_seqs = (int)seqs;
    d->n_pos = pos;
    int32_t *ids = malloc((size_t)pos * o->top_k * sizeof *ids);
    float *probs = malloc((size_t)pos * o->top_k * sizeof *probs);
    d->own[0] = g.off;
    d->own[1] = g.meta;
    d->own[2] = g.tokens;
    d->own[3] = g.feats;
    d->own[4] = ids;
    d->own[5] = probs;
    g = (struct grow){0};
    d->off = d->own[0];
    d->meta = d->own[1];
    d->tokens = d->own[2];
    d->feats = d->own[3];
    d->top_ids = ids;
    d->top_p = probs;
    if (!ids || !probs) {
        st = tdm_err_set(TDM_ENOMEM, "train: out of memory for the distributions");
        goto fail;
    }
    if ((st = teacher(target, d, ids, probs, o)) != TDM_OK) goto fail;
    for (int i = 0; i < o->batch; i++)
        free(rc.slots[i].feats);
    free(rc.slots);
    *out = d;
    return TDM_OK;
fail:
    for (int i = 0; rc.slots && i < o->batch; i++) {
        if (rc.slots[i].r) tdm_req_release(rc.slots[i].r);
        free(rc.slots[i].feats);
    }
    tdm_sched_destroy(s);
    free(rc.slots);
    free(g.off);
    free(g.meta);
    free(g.tokens);
    free(g.feats);
    tdm_train_data_free(d);
    return st;
}

/* ---- the draft vocabulary ---- */
struct count {
    double mass;
    int32_t id;
};
static int by_mass(const void *a, const void *b)
{
    const struct count *x = a, *y = b;
    if (x->mass != y->mass) return x->mass < y->mass ? 1 : -1;
    return x->id - y->id;
}
static int by_id(const void *a, const void *b)
{
    return *(const int32_t *)a - *(const int32_t *)b;
}

tdm_status tdm_train_data_draft_vocab(const tdm_train_data_t *d, int n, int32_t *ids,
                                      double *coverage)
{
    if (n <= 0 || n > d->vocab)
        return tdm_err_set(TDM_EINVAL, "train: a draft vocabulary of %d tokens (1 .. %d)", n,
                           d->vocab);
    struct count *c = calloc((size_t)d->vocab, sizeof *c);
    if (!c) return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    for (int v = 0; v < d->vocab; v++)
        c[v].id = v;
    double total = 0;
    /* what the head is scored on: the target's distributions at the scored positions */
    for (int s = 0; s < d->n_seqs; s++) {
        struct tdm_train_seq q;
        tdm_train_data_seq(d, s, &q);
        for (int p = q.first + 1; p < q.len; p++)
            for (int k = 0; k < d->top_k; k++) {
                int32_t id = q.top_ids[(size_t)p * d->top_k + k];
                if (id < 0) continue;
                c[id].mass += q.top_p[(size_t)p * d->top_k + k];
                total += q.top_p[(size_t)p * d->top_k + k];
            }
    }
    qsort(c, (size_t)d->vocab, sizeof *c, by_mass);
    double kept = 0;
    for (int i = 0; i < n; i++) {
        ids[i] = c[i].id;
        kept += c[i].mass;
    }
    qsort(ids, (size_t)n, sizeof *ids, by_id);
    if (coverage) *coverage = total > 0 ? kept / total : 0;
    free(c);
    return TDM_OK;
}
