/*
 * Causal GQA attention over the paged KV cache.
 *
 * For token t of sequence s at position p, query head h reads KV head g = h / (n_heads /
 * n_kv_heads) at positions 0..p, found through the sequence's page table: position j lives on
 * page page_ids[seq_page_start[s] + j / page_size] at offset j % page_size, K at
 * base[page][0][g][off][:], V at base[page][1][g][off][:] (HND, kv.h).
 *
 * Softmax: one pass with a running maximum (the "online" softmax). Positions are taken in
 * chunks of TDM_CPU_ATTN_CHUNK (one call of the ISA's attn_step); per chunk the scores are computed, the running max m is raised to the chunk
 * max (the accumulators and the running sum are rescaled by expf(m_old - m_new) when it moves),
 * the chunk's weights expf(score - m) are summed in position order and their V rows are
 * accumulated in position order. The output is acc / sum. Chunks are cut at fixed absolute
 * positions, so the operation sequence for a (token, head) depends only on p, the query and
 * the sequence's KV: never on the page size, the other sequences, or the thread count.
 *
 * Portable step: a score is (q . k) * scale with the dot product over 8 lanes (lane l sums
 * elements 8i + l in order; lanes fold ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)); tail elements
 * after); weights use libm's expf. The AVX2 step (attention_avx2.c) vectorises the same scheme.
 *
 * Threading: work items are (token, KV head) pairs, dealt round-robin to the pool's threads
 * (later tokens of a prefill attend to more positions, so a contiguous split would be
 * lopsided). One item handles all query heads of its group (up to TDM_CPU_ATTN_GROUP at a time), so
 * each K and V row is read once per group. Scratch lives on the worker's stack.
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>

struct att_job {
    const struct tdm_cpu_kernels *k;
    const float *q;
    int n_heads;
    const struct tdm_step *st;
    const struct tdm_kv_layer *kv;
    float scale;
    float *out;
};

static inline float dot(const float *a, const float *b, int n)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) l[k] += a[i + k] * b[i + k];
    const float x0 = l[0] + l[4], x1 = l[1] + l[5], x2 = l[2] + l[6], x3 = l[3] + l[7];
    float s = (x0 + x2) + (x1 + x3);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void tdm_cpu_attn_step_portable(const struct tdm_cpu_attn_step *s)
{
    float w[TDM_CPU_ATTN_GROUP][TDM_CPU_ATTN_CHUNK];
    const int hd = s->hd, cn = s->cn;
    for (int h = 0; h < s->gs; h++) {
        const float *q = s->q + (size_t)h * hd;
        float *acc = s->acc + (size_t)h * TDM_CPU_MAX_HEAD_DIM;
        float cmax = s->m[h];
        for (int j = 0; j < cn; j++) {
            w[h][j] = dot(q, s->k[j], hd) * s->scale;
            if (w[h][j] > cmax) cmax = w[h][j];
        }
        if (cmax > s->m[h]) {
            const float alpha = expf(s->m[h] - cmax); /* 0 on the first step */
            s->sum[h] *= alpha;
            for (int d = 0; d < hd; d++) acc[d] *= alpha;
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
            for (int d = 0; d < hd; d++) acc[d] += e * v[d];
        }
    }
}

static void attend(const struct att_job *job, int t, int g)
{
    const struct tdm_step *st = job->st;
    const struct tdm_kv_layer *kv = job->kv;
    const int hd = kv->head_dim, nkv = kv->n_kv_heads, ps = kv->page_size;
    const int group = job->n_heads / nkv;
    const int s = st->token_seq[t];
    const int n_pos = st->positions[t] + 1;
    const int32_t *pages = st->page_ids + st->seq_page_start[s];
    const int n_seq_pages = st->seq_page_start[s + 1] - st->seq_page_start[s];
    TDM_ASSERT(n_pos <= st->seq_kv_len[s] && (n_pos + ps - 1) / ps <= n_seq_pages);
    const size_t head_stride = (size_t)ps * hd; /* one head of one page, K or V */
    const size_t page_stride = 2 * (size_t)nkv * head_stride;

    float acc[TDM_CPU_ATTN_GROUP][TDM_CPU_MAX_HEAD_DIM];
    float m[TDM_CPU_ATTN_GROUP], sum[TDM_CPU_ATTN_GROUP];
    const float *kr[TDM_CPU_ATTN_CHUNK], *vr[TDM_CPU_ATTN_CHUNK];

    for (int h0 = 0; h0 < group; h0 += TDM_CPU_ATTN_GROUP) {
        const int gs = TDM_MIN(TDM_CPU_ATTN_GROUP, group - h0);
        const size_t qoff = ((size_t)t * job->n_heads + (size_t)g * group + h0) * hd;
        for (int hh = 0; hh < gs; hh++) {
            m[hh] = -INFINITY;
            sum[hh] = 0.0f;
            for (int d = 0; d < hd; d++) acc[hh][d] = 0.0f;
        }
        struct tdm_cpu_attn_step step = {
            .q = job->q + qoff,
            .gs = gs,
            .hd = hd,
            .k = kr,
            .v = vr,
            .scale = job->scale,
            .m = m,
            .sum = sum,
            .acc = &acc[0][0],
        };
        for (int j0 = 0; j0 < n_pos; j0 += TDM_CPU_ATTN_CHUNK) {
            step.cn = TDM_MIN(TDM_CPU_ATTN_CHUNK, n_pos - j0);
            for (int jj = 0; jj < step.cn; jj++) {
                const int pos = j0 + jj;
                const int32_t page = pages[pos / ps];
                TDM_ASSERT(page >= 0 && page < kv->n_pages);
                const float *kp = kv->base + (size_t)page * page_stride + (size_t)g * head_stride +
                                  (size_t)(pos % ps) * hd;
                kr[jj] = kp;
                vr[jj] = kp + (size_t)nkv * head_stride;
            }
            job->k->attn_step(&step);
        }
        float *o = job->out + qoff;
        for (int hh = 0; hh < gs; hh++)
            for (int d = 0; d < hd; d++) o[(size_t)hh * hd + d] = acc[hh][d] / sum[hh];
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

void tdm_cpu_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                       const struct tdm_kv_layer *kv, float scale, float *out)
{
    TDM_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    TDM_ASSERT(kv->head_dim > 0 && kv->head_dim <= TDM_CPU_MAX_HEAD_DIM);
    TDM_ASSERT(st->page_size == kv->page_size && kv->page_size > 0);
    if (st->n_tokens <= 0) return;
    int64_t work = 0;
    for (int t = 0; t < st->n_tokens; t++)
        work += (int64_t)st->positions[t] + 1;
    work *= (int64_t)n_heads * kv->head_dim * 2;
    struct att_job job = {
        .k = tdm_cpu_of(b)->k,
        .q = q, .n_heads = n_heads, .st = st, .kv = kv, .scale = scale, .out = out};
    tdm_cpu_run(tdm_cpu_of(b), work, attention_worker, &job);
}
