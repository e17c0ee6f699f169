/*
 * Causal GQA attention over the paged KV cache.
 *
 * For token t of sequence s at position p, query head h reads KV head g = h / (n_heads /
 * n_kv_heads) at positions 0..p, found through the sequence's page table: position j lives on
 * page page_ids[seq_page_start[s] + j / page_size] at offset j % page_size, K at
 * base[page][0][g][off][:], V at base[page][1][g][off][:] (HND, kv.h).
 *
 * Softmax: one pass with a running maximum (the "online" softmax). Positions are taken in
 * chunks of TDM_CPU_ATTN_CHUNK, one call of the ISA's attn_step each: the chunk's scores are
 * computed, the running max m is raised to the chunk max (the accumulators and the running
 * sum are rescaled by expf(m_old - m_new) when it moves), the chunk's weights exp(score - m)
 * are summed in position order and their V rows accumulated in position order. The output is
 * acc / sum.
 *
 * Segments: positions are also grouped in segments of SEGMENT. Each segment's state is
 * computed from scratch (m = -inf, sum = 0, acc = 0) and the segments' states are folded in
 * order into one (merge_head). Chunks and segments are cut at fixed absolute positions, so the
 * operation sequence for a (token, head) depends only on p, the query and the sequence's KV:
 * never on the page size, the other sequences or the thread count.
 *
 * Why segments: a decode step of one sequence has only n_kv_heads work items, too few to keep
 * the threads busy. In split mode (few tokens, several segments) each (token, group, segment)
 * is its own item, states go to scratch, and a second pass merges them; otherwise one item
 * computes all segments of its (token, group) and merges as it goes. Both run the same
 * arithmetic, so the choice, made from the shape of the whole step, never changes a value.
 *
 * Portable step: a score is (q . k) * scale with the dot product over 8 lanes (lane l sums
 * elements 8i + l in order; lanes fold ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)); tail elements
 * after); weights use libm's expf. The AVX2 step (attention_avx2.c) vectorises the same scheme.
 *
 * Token trees (backend.h, the attention contract): a tree token at position p reads positions
 * [0, P) through the page table and positions P .. p from its visible nodes' slots, in the
 * same chunks and segments as a chain token at p. Only where a position's K and V rows are
 * found changes, so the values are bit for bit those of the chain token that sees the same
 * KV (what makes tree verification exact), and the prefix part costs what it always did.
 *
 * KV element types: the pool's K and V rows are fp32, bf16 or f16. A chunk of 2-byte rows is
 * widened to fp32 first (exactly, by the ISA's kv_widen) into the item's stack scratch, and
 * the step runs on those rows as on fp32 ones: the arithmetic is the fp32 path's on the
 * rounded values.
 *
 * Threading: work items are (token, KV head) pairs, dealt round-robin to the pool's threads
 * (later tokens of a prefill attend to more positions, so a contiguous split would be
 * lopsided). One item handles all query heads of its group (TDM_CPU_ATTN_GROUP at a time), so
 * each K and V row is read once per group. Per-item scratch lives on the worker's stack;
 * split mode's states live in the instance's attn_scratch (grown on demand, capped; without it
 * the step simply runs whole items).
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>
#include <string.h>

#define SEGMENT          128         /* positions per segment; a multiple of the step chunk */
#define SPLIT_MAX_TOKENS 64          /* split mode is for decode-sized steps */
#define SPLIT_MAX_FLOATS (16u << 20) /* 64 MiB of split-mode scratch at most */
#define SPLIT_MIN_WORK   65536

struct att_job {
    const struct tdm_cpu_kernels *k;
    const float *q;
    int n_heads;
    const struct tdm_step *st;
    const struct tdm_kv_layer *kv;
    float scale;
    float *out;
};

void tdm_cpu_attn_step_portable(const struct tdm_cpu_attn_step *s)
{
    float w[TDM_CPU_ATTN_GROUP][TDM_CPU_ATTN_CHUNK];
    const int hd = s->hd, vd = s->vd, cn = s->cn;
    for (int h = 0; h < s->gs; h++) {
        const float *q = s->q + (size_t)h * hd;
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        float cmax = s->m[h];
        for (int j = 0; j < cn; j++) {
            w[h][j] = tdm_cpu_dot8(q, s->k[j], hd) * s->scale;
            if (w[h][j] > cmax) cmax = w[h][j];
        }
        if (cmax > s->m[h]) {
            const float alpha = expf(s->m[h] - cmax); /* 0 on the first step */
            s->sum[h] *= alpha;
            for (int d = 0; d < vd; d++)
                acc[d] *= alpha;
            s->m[h] = cmax;
        }
        for (int j = 0; j < cn; j++) {
            w[h][j] = expf(w[h][j] - s->m[h]);
            s->sum[h] += w[h][j];
        }
    }
    for (int j = 0; j < cn; j++) {
        const float *v = s->v[j];
        for (int h = 0; h < s->gs; h++) {
            const float e = w[h][j];
            float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
            for (int d = 0; d < vd; d++)
                acc[d] += e * v[d];
        }
    }
}

/* The width of a head's output: V's (a latent layer's v_dim, else head_dim). */
static inline int out_dim(const struct tdm_kv_layer *kv)
{
    return kv->v_dim > 0 ? kv->v_dim : kv->head_dim;
}

/* What one token needs to find its KV. */
struct att_tok {
    int n_pos;                        /* positions 0 .. n_pos - 1 */
    int n_paged;                      /* of them, [0, n_paged) through the page table */
    const int32_t *pages;             /* the sequence's page table */
    int32_t path[TDM_TREE_MAX_NODES]; /* a tree token: the slots of positions n_paged .. */
};

static struct att_tok att_tok(const struct att_job *job, int t)
{
    const struct tdm_step *st = job->st;
    const int s = st->token_seq[t];
    struct att_tok tk = {
        .n_pos = st->positions[t] + 1,
        .n_paged = st->positions[t] + 1,
        .pages = st->page_ids + st->seq_page_start[s],
    };
    const uint64_t mask = st->tree_mask ? st->tree_mask[t] : 0;
    if (mask) { /* its visible nodes, lowest first: one per position from the prefix on */
        const int32_t *nodes = st->tree_slots + st->tree_node_start[s];
        tk.n_paged = st->seq_prefix[s];
        int n = 0;
        for (uint64_t m = mask; m; m &= m - 1)
            tk.path[n++] = nodes[__builtin_ctzll(m)];
        TDM_ASSERT(tk.n_paged + n == tk.n_pos);
    }
    const int n_seq_pages = st->seq_page_start[s + 1] - st->seq_page_start[s];
    TDM_ASSERT(tk.n_pos <= st->seq_kv_len[s] &&
               (tk.n_paged + job->kv->page_size - 1) / job->kv->page_size <= n_seq_pages);
    return tk;
}

static int n_segments(int n_pos)
{
    return (n_pos + SEGMENT - 1) / SEGMENT;
}

/* Softmax state of heads h0 .. h0 + gs - 1 of KV group g over positions [p0, p1), from
 * m = -inf, sum = 0, acc = 0, one attn_step per chunk. acc: [gs][TDM_CPU_MAX_HEAD_DIM]. */
static void segment_state(const struct att_job *job, int t, const struct att_tok *tk, int g, int h0,
                          int gs, int p0, int p1, float *m, float *sum, float *acc)
{
    const struct tdm_kv_layer *kv = job->kv;
    const int hd = kv->head_dim, nkv = kv->n_kv_heads, ps = kv->page_size;
    const int group = job->n_heads / nkv, vd = out_dim(kv);
    const bool latent = kv->v_dim > 0;          /* V is K's first vd elements */
    const size_t head_stride = (size_t)ps * hd; /* one head of one page, K or V (elements) */
    const size_t page_stride = (latent ? 1 : 2) * (size_t)nkv * head_stride;
    const bool f32 = kv->dtype == TDM_DTYPE_F32;
    const float *kr[TDM_CPU_ATTN_CHUNK], *vr[TDM_CPU_ATTN_CHUNK];
    /* 2-byte rows widened (touched only for those types) */
    float kw[TDM_CPU_ATTN_CHUNK * TDM_CPU_MAX_HEAD_DIM],
        vw[TDM_CPU_ATTN_CHUNK * TDM_CPU_MAX_HEAD_DIM];
    for (int hh = 0; hh < gs; hh++) {
        m[hh] = -INFINITY;
        sum[hh] = 0.0f;
        for (int d = 0; d < vd; d++)
            acc[(size_t)hh * TDM_CPU_MAX_HEAD_DIM + d] = 0.0f;
    }
    struct tdm_cpu_attn_step step = {
        .q = job->q + ((size_t)t * job->n_heads + (size_t)g * group + h0) * hd,
        .gs = gs,
        .hd = hd,
        .vd = vd,
        .k = kr,
        .v = vr,
        .scale = job->scale,
        .m = m,
        .sum = sum,
        .acc = acc,
    };
    for (int j0 = p0; j0 < p1; j0 += TDM_CPU_ATTN_CHUNK) {
        step.cn = TDM_MIN(TDM_CPU_ATTN_CHUNK, p1 - j0);
        for (int jj = 0; jj < step.cn; jj++) {
            const int pos = j0 + jj;
            int32_t page, off;
            if (pos < tk->n_paged) {
                page = tk->pages[pos / ps];
                off = pos % ps;
            } else { /* a tree token's ancestor (or itself) */
                const int32_t slot = tk->path[pos - tk->n_paged];
                page = slot / ps;
                off = slot % ps;
            }
            TDM_ASSERT(page >= 0 && page < kv->n_pages);
            const size_t at =
                (size_t)page * page_stride + (size_t)g * head_stride + (size_t)off * hd;
            if (f32) {
                kr[jj] = (const float *)kv->base + at;
                vr[jj] = latent ? kr[jj] : kr[jj] + (size_t)nkv * head_stride;
            } else {
                const uint16_t *kp = (const uint16_t *)kv->base + at;
                float *kd = kw + (size_t)jj * hd, *vdst = vw + (size_t)jj * hd;
                job->k->kv_widen(kv->dtype, kp, kd, hd);
                if (!latent) job->k->kv_widen(kv->dtype, kp + (size_t)nkv * head_stride, vdst, hd);
                kr[jj] = kd;
                vr[jj] = latent ? kd : vdst;
            }
        }
        job->k->attn_step(&step);
    }
}

/* Folds a later segment's state (m2, s2, a2) into the running state (m, s, a) of one head. */
static void merge_head(float *m, float *s, float *a, float m2, float s2, const float *a2, int hd)
{
    const float mx = *m > m2 ? *m : m2;
    const float f1 = expf(*m - mx), f2 = expf(m2 - mx);
    *s = *s * f1 + s2 * f2;
    for (int d = 0; d < hd; d++)
        a[d] = a[d] * f1 + a2[d] * f2;
    *m = mx;
}

static void finish_head(const float *acc, float sum, int hd, float *out)
{
    for (int d = 0; d < hd; d++)
        out[d] = acc[d] / sum;
}

/* One (token, KV group) item computed whole: its segments in order, each folded into the
 * running state as soon as it is done. */
static void attend(const struct att_job *job, int t, int g)
{
    const int hd = out_dim(job->kv), group = job->n_heads / job->kv->n_kv_heads;
    const struct att_tok tk = att_tok(job, t);
    const int n_seg = n_segments(tk.n_pos);
    float acc[TDM_CPU_ATTN_GROUP][TDM_CPU_MAX_HEAD_DIM];
    float sacc[TDM_CPU_ATTN_GROUP][TDM_CPU_MAX_HEAD_DIM];
    float m[TDM_CPU_ATTN_GROUP], sum[TDM_CPU_ATTN_GROUP];
    float sm[TDM_CPU_ATTN_GROUP], ssum[TDM_CPU_ATTN_GROUP];
    for (int h0 = 0; h0 < group; h0 += TDM_CPU_ATTN_GROUP) {
        const int gs = TDM_MIN(TDM_CPU_ATTN_GROUP, group - h0);
        segment_state(job, t, &tk, g, h0, gs, 0, TDM_MIN(SEGMENT, tk.n_pos), m, sum, &acc[0][0]);
        for (int sg = 1; sg < n_seg; sg++) {
            segment_state(job, t, &tk, g, h0, gs, sg * SEGMENT,
                          TDM_MIN((sg + 1) * SEGMENT, tk.n_pos), sm, ssum, &sacc[0][0]);
            for (int hh = 0; hh < gs; hh++)
                merge_head(&m[hh], &sum[hh], acc[hh], sm[hh], ssum[hh], sacc[hh], hd);
        }
        float *o = job->out + ((size_t)t * job->n_heads + (size_t)g * group + h0) * hd;
        for (int hh = 0; hh < gs; hh++)
            finish_head(acc[hh], sum[hh], hd, o + (size_t)hh * hd);
    }
}

static void attention_worker(void *ctx, int ith, int nth)
{
    const struct att_job *job = ctx;
    const int nkv = job->kv->n_kv_heads;
    const int64_t items = (int64_t)job->st->n_tokens * nkv;
    for (int64_t it = ith; it < items; it += nth)
        attend(job, (int)(it / nkv), (int)(it % nkv));
}

/* ---- split mode: the segments of a few tokens spread over the threads, then merged ----
 * Scratch holds one state per (token, group, segment), in that order; a state is, for each
 * head of the group, acc[hd] then m then sum. */
struct split_job {
    const struct att_job *job;
    int n_items;      /* (token, group, segment) states */
    const int *first; /* [n_tokens + 1] index of each token's first state */
    float *scratch;
};

static size_t state_floats(const struct att_job *job)
{
    const int group = job->n_heads / job->kv->n_kv_heads;
    return (size_t)group * ((size_t)out_dim(job->kv) + 2);
}

static void split_segments_worker(void *ctx, int ith, int nth)
{
    const struct split_job *sj = ctx;
    const struct att_job *job = sj->job;
    const int hd = out_dim(job->kv), nkv = job->kv->n_kv_heads, group = job->n_heads / nkv;
    float acc[TDM_CPU_ATTN_GROUP][TDM_CPU_MAX_HEAD_DIM];
    float m[TDM_CPU_ATTN_GROUP], sum[TDM_CPU_ATTN_GROUP];
    int t = 0;
    for (int it = ith; it < sj->n_items; it += nth) {
        while (it >= sj->first[t + 1])
            t++;
        const struct att_tok tk = att_tok(job, t);
        const int n_seg = n_segments(tk.n_pos);
        const int g = (it - sj->first[t]) / n_seg, sg = (it - sj->first[t]) % n_seg;
        float *state = sj->scratch + (size_t)it * state_floats(job);
        for (int h0 = 0; h0 < group; h0 += TDM_CPU_ATTN_GROUP) {
            const int gs = TDM_MIN(TDM_CPU_ATTN_GROUP, group - h0);
            segment_state(job, t, &tk, g, h0, gs, sg * SEGMENT,
                          TDM_MIN((sg + 1) * SEGMENT, tk.n_pos), m, sum, &acc[0][0]);
            for (int hh = 0; hh < gs; hh++) {
                float *hs = state + (size_t)(h0 + hh) * (hd + 2);
                memcpy(hs, acc[hh], (size_t)hd * sizeof(float));
                hs[hd] = m[hh];
                hs[hd + 1] = sum[hh];
            }
        }
    }
}

static void split_merge_worker(void *ctx, int ith, int nth)
{
    const struct split_job *sj = ctx;
    const struct att_job *job = sj->job;
    const int hd = out_dim(job->kv), nkv = job->kv->n_kv_heads, group = job->n_heads / nkv;
    const size_t sf = state_floats(job);
    float acc[TDM_CPU_MAX_HEAD_DIM];
    const int64_t items = (int64_t)job->st->n_tokens * nkv;
    for (int64_t it = ith; it < items; it += nth) {
        const int t = (int)(it / nkv), g = (int)(it % nkv);
        const int n_seg = n_segments(job->st->positions[t] + 1);
        const float *states = sj->scratch + ((size_t)sj->first[t] + (size_t)g * n_seg) * sf;
        for (int h = 0; h < group; h++) {
            const float *hs = states + (size_t)h * (hd + 2);
            float m = hs[hd], sum = hs[hd + 1];
            memcpy(acc, hs, (size_t)hd * sizeof(float));
            for (int sg = 1; sg < n_seg; sg++) {
                const float *h2 = hs + (size_t)sg * sf;
                merge_head(&m, &sum, acc, h2[hd], h2[hd + 1], h2, hd);
            }
            finish_head(acc, sum, hd,
                        job->out + ((size_t)t * job->n_heads + (size_t)g * group + h) * hd);
        }
    }
}

/* Split mode pays when a step has too few (token, group) items to keep every thread busy (a
 * decode of one or two sequences) and some token spans several segments. Returns false, and
 * the caller runs whole items, when it does not apply or no scratch can be had: the results
 * are the same bits either way. */
static bool attention_split(struct tdm_cpu *cpu, const struct att_job *job)
{
    const struct tdm_step *st = job->st;
    const int nkv = job->kv->n_kv_heads;
    if (cpu->n_threads < 2 || st->n_tokens > SPLIT_MAX_TOKENS ||
        (int64_t)st->n_tokens * nkv >= 2 * (int64_t)cpu->n_threads)
        return false;
    int first[SPLIT_MAX_TOKENS + 1];
    first[0] = 0;
    bool multi = false;
    for (int t = 0; t < st->n_tokens; t++) {
        const int n_seg = n_segments(st->positions[t] + 1);
        multi |= n_seg > 1;
        first[t + 1] = first[t] + n_seg * nkv;
    }
    if (!multi) return false;
    const size_t need = (size_t)first[st->n_tokens] * state_floats(job);
    if (need > SPLIT_MAX_FLOATS) return false;
    if (need > cpu->attn_scratch_floats) {
        /* grows geometrically, so a decode that lengthens reallocates O(log n) times */
        float *p = tdm_alloc_aligned(2 * need * sizeof(float));
        if (!p) return false;
        tdm_free_aligned(cpu->attn_scratch);
        cpu->attn_scratch = p;
        cpu->attn_scratch_floats = 2 * need;
    }
    struct split_job sj = {
        .job = job, .n_items = first[st->n_tokens], .first = first, .scratch = cpu->attn_scratch};
    tdm_pool_run(cpu->pool, split_segments_worker, &sj);
    tdm_pool_run(cpu->pool, split_merge_worker, &sj);
    return true;
}

void tdm_cpu_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                       const struct tdm_kv_layer *kv, float scale, float *out)
{
    TDM_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    TDM_ASSERT(kv->head_dim > 0 && kv->head_dim <= TDM_CPU_MAX_HEAD_DIM);
    TDM_ASSERT(st->page_size == kv->page_size && kv->page_size > 0);
    TDM_ASSERT(tdm_kv_elem_bytes(kv->dtype));
    if (st->n_tokens <= 0) return;
    int64_t work = 0;
    for (int t = 0; t < st->n_tokens; t++)
        work += (int64_t)st->positions[t] + 1;
    work *= (int64_t)n_heads * kv->head_dim * 2;
    struct att_job job = {.k = tdm_cpu_of(b)->k,
                          .q = q,
                          .n_heads = n_heads,
                          .st = st,
                          .kv = kv,
                          .scale = scale,
                          .out = out};
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    if (work >= SPLIT_MIN_WORK && attention_split(cpu, &job)) return;
    tdm_cpu_run(cpu, work, attention_worker, &job);
}

void tdm_cpu_kv_copy(tdm_backend_t *b, const struct tdm_kv_layer *kv, int n_layers,
                     size_t layer_bytes, const int32_t *src, const int32_t *dst, int n)
{
    (void)b;
    const size_t eb = tdm_kv_elem_bytes(kv->dtype);
    TDM_ASSERT(eb);
    const int ps = kv->page_size, hd = kv->head_dim, nkv = kv->n_kv_heads;
    /* in bytes */
    const int n_runs = (kv->v_dim > 0 ? 1 : 2) * nkv; /* K heads, then V heads (none: latent) */
    const size_t head_stride = (size_t)ps * hd * eb, page_stride = (size_t)n_runs * head_stride;
    const size_t row_bytes = (size_t)hd * eb;
    for (int l = 0; l < n_layers; l++) {
        uint8_t *base = (uint8_t *)kv->base + (size_t)l * layer_bytes;
        for (int i = 0; i < n; i++) {
            TDM_ASSERT(src[i] >= 0 && dst[i] >= 0 && src[i] / ps < kv->n_pages &&
                       dst[i] / ps < kv->n_pages);
            const uint8_t *from =
                base + (size_t)(src[i] / ps) * page_stride + (size_t)(src[i] % ps) * row_bytes;
            uint8_t *to =
                base + (size_t)(dst[i] / ps) * page_stride + (size_t)(dst[i] % ps) * row_bytes;
            for (int kvh = 0; kvh < n_runs; kvh++)
                memcpy(to + (size_t)kvh * head_stride, from + (size_t)kvh * head_stride, row_bytes);
        }
    }
}
