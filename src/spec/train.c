/*
 * The head trainer's math: a one-layer speculation head (model.h, struct tdm_head; docs/HEADS.md)
 * trained on the target's own features, its forward and backward passes written out by hand
 * over single-threaded OpenBLAS GEMMs split across the trainer's pool, and AdamW.
 *
 * What a row is. A training sequence holds, at each position p, the token t(p), the target's
 * feature h(p) (the final-normed state its LM head reads) and the target's next-token
 * distribution there (its top-k, from the logits L(p) of h(p)). The head's row at p reads
 * t(p+1) and h(p), and learns what the target predicts at p+1 (seed 004's shift: t(p+1) comes
 * from L(p)):
 *
 *   e  = embed(t(p+1))                               the target's, frozen
 *   x0 = fc_e enorm(e) + fc_h hnorm(h(p))
 *   x1 = x0 + Wo attention(rope(q), rope(k), v)      q, k, v = W{q,k,v} attn_norm(x0) (+ b)
 *   x2 = x1 + Wdown (silu(Wgate m) * Wup m)          m = ffn_norm(x1)
 *   g  = norm(x2)                                    the head's feature
 *   z  = LM g                                        the target's LM head, draft-vocabulary rows
 *   loss = CE(softmax(z), P(p+1)) + reg_weight * smoothL1(g, h(p+1))
 *
 * Rows before a sequence's `first` (its prompt) are context: computed and attended to, not
 * scored. P(p+1) is the target's top-k at p+1, restricted to the draft vocabulary and renormalised.
 * The regression (smooth L1, beta 1, mean over the d elements) pulls the head's feature toward the
 * target's next one, which is what the head is fed in place of h when it drafts further out.
 *
 * Passes (training-time test). At inference the head drafts token j + 1 from the row after the
 * one that drafted token j, fed its own feature g of that row instead of the target's h, and
 * attending to keys that the earlier drafts' rows wrote. Pass j (0-based) trains exactly that:
 * its row p (p >= j) reads t(p+1) and g_{j-1}(p-1), pass j-1's feature of the row before, and
 * its query attends to the key at position q from pass c(q) = max(0, j - (p - q)): pass 0's
 * keys up to p - j, then one key of each later pass on the diagonal, its own at q = p. What
 * comes from earlier passes (their g, keys and values) is a constant to pass j: its gradient
 * flows only into its own rows. Pass 0 is teacher forcing with causal attention, every key its
 * own. Pass j's mean loss over its scored rows is weighted by unroll_decay^j.
 *
 * Memory. Parameters, gradients and AdamW's two moments are one float array each, the tensors
 * at offsets (enum param). One pass's activations live in scratch sized for max_rows rows; the
 * keys, values and features of every pass of a batch are kept for the passes after it. The
 * frozen embedding table and the draft vocabulary's LM head rows are f32 copies.
 *
 * Threading. One thread calls a trainer at a time. Every op splits over the trainer's pool by a
 * fixed rule (token rows, or weight rows for a weight gradient), each part a single-threaded
 * sgemm or loop, so a run is deterministic for a given thread count: a resumed run continues
 * bit for bit.
 */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

/* ---- parameters ---- */
enum param {
    P_ENORM,
    P_HNORM,
    P_FC_E,
    P_FC_H,
    P_ATTN_NORM,
    P_WQ,
    P_WK,
    P_WV,
    P_BQ,
    P_BK,
    P_BV,
    P_QNORM,
    P_KNORM,
    P_WO,
    P_FFN_NORM,
    P_WGATE,
    P_WUP,
    P_WDOWN,
    P_NORM,
    P_COUNT
};
/* Their names in tandem's layout; fc_e and fc_h are the two column halves of fc.weight. */
static const char *const PARAM_NAMES[P_COUNT] = {
    "enorm.weight",
    "hnorm.weight",
    "fc.weight",
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.q_proj.bias",
    "layers.0.self_attn.k_proj.bias",
    "layers.0.self_attn.v_proj.bias",
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
};

struct ptensor {
    size_t off;         /* in floats */
    int64_t rows, cols; /* rows 0: absent */
    bool matrix;        /* weight decay applies */
};

/* One pass's rows: sequence s has rows p = first .. len_s - 2 at row0[s] + p - first. */
struct pass_rows {
    int first;
    int n;
    int *row0; /* [max_seqs + 1] */
};

struct tdm_head_trainer {
    struct tdm_train_geom g;
    struct tdm_train_opts o;
    int d, qd, kvd, ff, nh, nkv, hd, vd;
    struct ptensor pt[P_COUNT];
    size_t n_params;
    float *params, *grad, *adam_m, *adam_v; /* [n_params] */
    int64_t step;                           /* optimizer steps taken */
    float *embed;                           /* [vocab][d] the target's, f32 */
    float *lm;                              /* [vd][d] LM head rows of the draft vocabulary */
    int32_t *d2t;                           /* [vd] draft id -> target id, ascending */
    int32_t *t2d;                           /* [vocab] target id -> draft id, or -1 */
    float *rope_cos, *rope_sin;             /* [max_len][hd / 2] */
    tdm_pool_t *pool;
    int nth;
    int max_rows, max_seqs, max_len;
    /* one pass's activations, [max_rows][...] */
    float *E, *En, *H, *Hn, *X0, *A, *Qr, *Qn, *Q, *Kr, *Kn, *ATT, *X1, *M, *GA, *U, *S, *X2;
    float *rE, *rH, *rA, *rM, *rG; /* [max_rows] 1 / rms */
    float *rQ, *rK;                /* [max_rows][nh], [max_rows][nkv] */
    int32_t *pos, *tok;            /* [max_rows] */
    int *rseq;                     /* [max_rows] the row's sequence */
    /* backward scratch */
    float *dX, *dA, *dFF, *dGA, *dU, *dATT, *dQ, *dK, *dV, *dwpart;
    float *Z;          /* [chunk][vd] */
    float *Gl;         /* [chunk][d] the scored rows' features, then their gradient */
    int chunk;         /* rows of the LM head's logits at a time */
    tdm_status gpu_st; /* the first failed GPU GEMM of a pass (o.gpu) */
    int32_t *lrow;     /* [max_rows] the current pass's scored rows */
    /* kept across the passes of a batch: [unroll][max_rows][...] */
    float *Kp, *Vp, *Gp;
    struct pass_rows pr[TDM_TRAIN_MAX_UNROLL];
    /* attention probabilities of the current pass: sequence s, head h is a [rows_s][len_s - 1]
     * block at P + p_off[s] + h * rows_s * (len_s - 1) */
    float *P;
    size_t p_cap;
    size_t *p_off; /* [max_seqs] */
    /* the batch being worked on */
    const struct tdm_train_seq *seqs;
    int n_seqs, top_k;
    double loss_part[64][4]; /* per thread: ce, reg, top-1 agreement, rows with a target */
};

#define PT(t, i)  ((t)->params + (t)->pt[i].off)
#define GR(t, i)  ((t)->grad + (t)->pt[i].off)
#define HAS(t, i) ((t)->pt[i].rows > 0)
/* The logits of the loss go chunk by chunk: about 2^25 floats at a time, 256 .. 1024 rows. */
enum { LOSS_CHUNK_MIN = 256, LOSS_CHUNK_MAX = 1024, LOSS_CHUNK_FLOATS = 1 << 25 };

/* ---- GEMMs split over the pool (row-major; weights are [out][in] as models store them) ---- */
enum gemm_kind {
    G_XWT,   /* C[T][N] = beta C + A[T][K] B[N][K]^T   (split over T) */
    G_XWT_N, /* the same, split over N: few rows against a wide B, which each thread then reads
                only a slice of (the LM head) */
    G_XW,    /* C[T][N] = beta C + A[T][K] B[K][N]     (split over T) */
    G_GW,    /* C[N][K] += A[T][N]^T B[T][K]           (split over N: a weight gradient) */
};
struct gemm_job {
    enum gemm_kind kind;
    int T, N, K;
    const float *a, *b;
    float *c;
    float beta;
};
static void gemm_worker(void *ctx, int ith, int nth)
{
    const struct gemm_job *j = ctx;
    int64_t b, e;
    switch (j->kind) {
    case G_XWT:
        tdm_split_range(j->T, ith, nth, 1, &b, &e);
        if (e > b)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(e - b), j->N, j->K, 1.0f,
                        j->a + b * j->K, j->K, j->b, j->K, j->beta, j->c + b * j->N, j->N);
        break;
    case G_XWT_N:
        tdm_split_range(j->N, ith, nth, 16, &b, &e);
        if (e > b)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->T, (int)(e - b), j->K, 1.0f,
                        j->a, j->K, j->b + b * j->K, j->K, j->beta, j->c + b, j->N);
        break;
    case G_XW:
        tdm_split_range(j->T, ith, nth, 1, &b, &e);
        if (e > b)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(e - b), j->N, j->K, 1.0f,
                        j->a + b * j->K, j->K, j->b, j->N, j->beta, j->c + b * j->N, j->N);
        break;
    case G_GW:
        tdm_split_range(j->N, ith, nth, 1, &b, &e);
        if (e > b)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)(e - b), j->K, j->T, 1.0f,
                        j->a + b, j->N, j->b, j->K, 1.0f, j->c + b * j->K, j->K);
        break;
    }
}
static void gemm(struct tdm_head_trainer *t, enum gemm_kind kind, int T, int N, int K,
                 const float *a, const float *b, float *c, float beta)
{
    if (T <= 0 || N <= 0 || K <= 0) return;
    if (t->o.gpu) { /* the same products on the GPU; the frozen LM head stays there */
        if (t->gpu_st != TDM_OK) return;
        bool lm = b == t->lm;
        switch (kind) {
        case G_XWT:
        case G_XWT_N:
            t->gpu_st =
                tdm_cuda_gemm_run(t->o.gpu, false, true, T, N, K, a, K, b, K, lm, beta, c, N);
            break;
        case G_XW:
            t->gpu_st =
                tdm_cuda_gemm_run(t->o.gpu, false, false, T, N, K, a, K, b, N, lm, beta, c, N);
            break;
        case G_GW: /* C[N][K] += A[T][N]^T B[T][K] */
            t->gpu_st =
                tdm_cuda_gemm_run(t->o.gpu, true, false, N, K, T, a, N, b, K, false, 1.0f, c, K);
            break;
        }
        return;
    }
    struct gemm_job j = {kind, T, N, K, a, b, c, beta};
    tdm_pool_run(t->pool, gemm_worker, &j);
}
/* Y[T][N] = X[T][K] W[N][K]^T */
static void mm(struct tdm_head_trainer *t, int T, const float *X, const float *W, int N, int K,
               float *Y)
{
    gemm(t, G_XWT, T, N, K, X, W, Y, 0.0f);
}
/* dX[T][K] = beta dX + dY[T][N] W[N][K] */
static void mm_dx(struct tdm_head_trainer *t, int T, const float *dY, const float *W, int N, int K,
                  float *dX, float beta)
{
    gemm(t, G_XW, T, K, N, dY, W, dX, beta);
}
/* dW[N][K] += dY[T][N]^T X[T][K] */
static void mm_dw(struct tdm_head_trainer *t, int T, const float *dY, const float *X, int N, int K,
                  float *dW)
{
    gemm(t, G_GW, T, N, K, dY, X, dW, 1.0f);
}

/* ---- RMSNorm over rows of dim: y = x r w, r = 1 / sqrt(mean(x^2) + eps) ---- */
struct norm_job {
    int n, dim;
    float eps;
    const float *x, *w, *r, *dy;
    float *y, *rout, *dx, *dwpart; /* dwpart: [nth][dim] */
};
static void norm_fwd_worker(void *ctx, int ith, int nth)
{
    const struct norm_job *j = ctx;
    int64_t b, e;
    tdm_split_range(j->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++) {
        const float *x = j->x + i * j->dim;
        float *y = j->y + i * j->dim;
        double ss = 0;
        for (int c = 0; c < j->dim; c++)
            ss += (double)x[c] * x[c];
        float r = (float)(1.0 / sqrt(ss / j->dim + j->eps));
        j->rout[i] = r;
        for (int c = 0; c < j->dim; c++)
            y[c] = x[c] * r * j->w[c];
    }
}
static void norm_fwd(struct tdm_head_trainer *t, const float *x, const float *w, int n, int dim,
                     float *y, float *r)
{
    struct norm_job j = {
        .n = n, .dim = dim, .eps = t->g.rms_eps, .x = x, .w = w, .y = y, .rout = r};
    tdm_pool_run(t->pool, norm_fwd_worker, &j);
}
static void norm_bwd_worker(void *ctx, int ith, int nth)
{
    const struct norm_job *j = ctx;
    int64_t b, e;
    tdm_split_range(j->n, ith, nth, 1, &b, &e);
    float *dw = j->dwpart + (size_t)ith * j->dim;
    for (int64_t i = b; i < e; i++) {
        const float *x = j->x + i * j->dim, *dy = j->dy + i * j->dim;
        float r = j->r[i];
        double dot = 0;
        for (int c = 0; c < j->dim; c++) {
            dot += (double)dy[c] * j->w[c] * x[c];
            dw[c] += dy[c] * x[c] * r;
        }
        if (!j->dx) continue;
        float k = (float)(dot * r * r * r / j->dim);
        float *dx = j->dx + i * j->dim;
        for (int c = 0; c < j->dim; c++)
            dx[c] += r * dy[c] * j->w[c] - x[c] * k;
    }
}
/* dx += the input's gradient (dx NULL: none); dw += the weight's. */
static void norm_bwd(struct tdm_head_trainer *t, const float *x, const float *w, const float *r,
                     const float *dy, int n, int dim, float *dx, float *dw)
{
    memset(t->dwpart, 0, (size_t)t->nth * dim * sizeof(float));
    struct norm_job j = {
        .n = n, .dim = dim, .x = x, .w = w, .r = r, .dy = dy, .dx = dx, .dwpart = t->dwpart};
    tdm_pool_run(t->pool, norm_bwd_worker, &j);
    for (int k = 0; k < t->nth; k++) /* a fixed order: deterministic */
        for (int c = 0; c < dim; c++)
            dw[c] += t->dwpart[(size_t)k * dim + c];
}

/* ---- RoPE: pairs (i, i + hd/2) (neox) or (2i, 2i+1) rotated by pos * inv_freq[i]; sign -1
 * rotates back, which is the backward. x: [n][heads][hd], row i at position pos[i]. ---- */
struct rope_job {
    const struct tdm_head_trainer *t;
    float *x;
    int n, heads;
    float sign;
};
static void rope_worker(void *ctx, int ith, int nth)
{
    const struct rope_job *j = ctx;
    const struct tdm_head_trainer *t = j->t;
    int hd = t->hd, half = hd / 2;
    int64_t b, e;
    tdm_split_range(j->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++) {
        const float *cs = t->rope_cos + (size_t)t->pos[i] * half;
        const float *sn = t->rope_sin + (size_t)t->pos[i] * half;
        for (int h = 0; h < j->heads; h++) {
            float *v = j->x + ((size_t)i * j->heads + h) * hd;
            for (int k = 0; k < half; k++) {
                int ia = t->g.rope_neox ? k : 2 * k, ib = t->g.rope_neox ? k + half : 2 * k + 1;
                float c = cs[k], s = j->sign * sn[k], a = v[ia], bb = v[ib];
                v[ia] = a * c - bb * s;
                v[ib] = a * s + bb * c;
            }
        }
    }
}
static void rope(struct tdm_head_trainer *t, float *x, int n, int heads, float sign)
{
    struct rope_job j = {t, x, n, heads, sign};
    tdm_pool_run(t->pool, rope_worker, &j);
}

/* ---- attention of pass j: query row p of sequence s attends to positions q <= p, the key at
 * q coming from pass c(q) = max(0, j - (p - q)). Work items are (sequence, KV head). ---- */
struct attn_job {
    struct tdm_head_trainer *t;
    int j;
};
/* Work item `it` of pass j's attention: its sequence and KV head, the pass's rows of that
 * sequence and its positions (len - 1), and pass 0's keys and values of that KV head there. */
struct attn_item {
    int s, kh, rows, L;
    const float *K0, *V0;
};
static bool attn_item(const struct tdm_head_trainer *t, int j, int64_t it, struct attn_item *a)
{
    const struct pass_rows *pr = &t->pr[j];
    a->s = (int)(it / t->nkv);
    a->kh = (int)(it % t->nkv);
    a->rows = pr->row0[a->s + 1] - pr->row0[a->s];
    a->L = t->seqs[a->s].len - 1;
    size_t base = (size_t)t->pr[0].row0[a->s] * t->kvd + (size_t)a->kh * t->hd;
    a->K0 = t->Kp + base;
    a->V0 = t->Vp + base;
    return a->rows > 0;
}
static inline int key_row(const struct tdm_head_trainer *t, int s, int j, int p, int q, int *pass)
{
    int c = j - (p - q);
    if (c < 0) c = 0;
    *pass = c;
    return t->pr[c].row0[s] + q - t->pr[c].first;
}
/* Per (sequence, head): S = Q K0^T over pass 0's keys by one sgemm (row i is position
 * p = first + i, column q position q), then the j entries of each row that come from later
 * passes (q > p - j, the diagonal keys) fixed up one by one, the causal mask, a softmax; the
 * output is P V0 over pass 0's values plus the diagonal terms. */
static void attn_fwd_worker(void *ctx, int ith, int nth)
{
    const struct attn_job *aj = ctx;
    struct tdm_head_trainer *t = aj->t;
    const int j = aj->j, hd = t->hd, grp = t->nh / t->nkv, kvd = t->kvd, qd = t->qd;
    const float scale = 1.0f / sqrtf((float)hd);
    const struct pass_rows *pr = &t->pr[j];
    int64_t b, e;
    tdm_split_range((int64_t)t->n_seqs * t->nkv, ith, nth, 1, &b, &e);
    for (int64_t it = b; it < e; it++) {
        struct attn_item a;
        if (!attn_item(t, j, it, &a)) continue;
        const int s = a.s, kh = a.kh, rows = a.rows, L = a.L;
        const float *K0 = a.K0, *V0 = a.V0;
        for (int hh = 0; hh < grp; hh++) {
            int h = kh * grp + hh;
            float *Pb = t->P + t->p_off[s] + (size_t)h * rows * L;
            const float *Q = t->Q + (size_t)pr->row0[s] * qd + h * hd;
            float *O = t->ATT + (size_t)pr->row0[s] * qd + h * hd;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, L, hd, scale, Q, qd, K0, kvd,
                        0.0f, Pb, L);
            for (int i = 0; i < rows; i++) {
                int p = pr->first + i;
                float *pp = Pb + (size_t)i * L, mx = -INFINITY;
                const float *q = Q + (size_t)i * qd;
                for (int qq = TDM_MAX(0, p - j + 1); qq <= p && j > 0; qq++) {
                    int c, kr = key_row(t, s, j, p, qq, &c);
                    const float *k = t->Kp + ((size_t)c * t->max_rows + kr) * kvd + kh * hd;
                    float dot = 0;
                    for (int x = 0; x < hd; x++)
                        dot += q[x] * k[x];
                    pp[qq] = dot * scale;
                }
                for (int qq = 0; qq <= p; qq++)
                    mx = fmaxf(mx, pp[qq]);
                float sum = 0;
                for (int qq = 0; qq <= p; qq++) {
                    pp[qq] = expf(pp[qq] - mx);
                    sum += pp[qq];
                }
                float inv = 1.0f / sum;
                for (int qq = 0; qq < L; qq++)
                    pp[qq] = qq <= p ? pp[qq] * inv : 0.0f;
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, L, 1.0f, Pb, L, V0,
                        kvd, 0.0f, O, qd);
            if (j == 0) continue;
            /* later passes: the diagonal entries took pass 0's values; swap in their own */
            for (int i = 0; i < rows; i++) {
                int p = pr->first + i;
                float *o = O + (size_t)i * qd, *pp = Pb + (size_t)i * L;
                for (int qq = TDM_MAX(0, p - j + 1); qq <= p; qq++) {
                    int c, kr = key_row(t, s, j, p, qq, &c);
                    const float *v = t->Vp + ((size_t)c * t->max_rows + kr) * kvd + kh * hd;
                    const float *v0 = V0 + (size_t)qq * kvd;
                    for (int x = 0; x < hd; x++)
                        o[x] += pp[qq] * (v[x] - v0[x]);
                }
            }
        }
    }
}

/* The backward of the above: dP = dO V^T (one sgemm over pass 0's values, the diagonal
 * entries fixed up), dS = P (dP - rowsum(P dP)) scaled, dQ = dS K; pass 0 owns every key
 * (dK0 += dS^T Q, dV0 += P^T dO by sgemm), a later pass only its own diagonal one. dS is kept
 * in the probabilities' place. */
static void attn_bwd_worker(void *ctx, int ith, int nth)
{
    const struct attn_job *aj = ctx;
    struct tdm_head_trainer *t = aj->t;
    const int j = aj->j, hd = t->hd, grp = t->nh / t->nkv, kvd = t->kvd, qd = t->qd;
    const float scale = 1.0f / sqrtf((float)hd);
    const struct pass_rows *pr = &t->pr[j];
    float dp[TDM_TRAIN_MAX_LEN];
    int64_t b, e;
    tdm_split_range((int64_t)t->n_seqs * t->nkv, ith, nth, 1, &b, &e);
    for (int64_t it = b; it < e; it++) {
        struct attn_item a;
        if (!attn_item(t, j, it, &a)) continue;
        const int s = a.s, kh = a.kh, rows = a.rows, L = a.L;
        const float *K0 = a.K0, *V0 = a.V0;
        for (int hh = 0; hh < grp; hh++) {
            int h = kh * grp + hh;
            float *Pb = t->P + t->p_off[s] + (size_t)h * rows * L;
            const float *Q = t->Q + (size_t)pr->row0[s] * qd + h * hd;
            const float *dO = t->dATT + (size_t)pr->row0[s] * qd + h * hd;
            float *dQ = t->dQ + (size_t)pr->row0[s] * qd + h * hd;
            for (int i = 0; i < rows; i++) {
                int p = pr->first + i;
                float *pp = Pb + (size_t)i * L;
                const float *dout = dO + (size_t)i * qd;
                /* dP over every key of the row */
                cblas_sgemv(CblasRowMajor, CblasNoTrans, TDM_MAX(0, p - j + 1), hd, 1.0f, V0, kvd,
                            dout, 1, 0.0f, dp, 1);
                for (int qq = TDM_MAX(0, p - j + 1); qq <= p; qq++) {
                    int c, kr = key_row(t, s, j, p, qq, &c);
                    const float *v = t->Vp + ((size_t)c * t->max_rows + kr) * kvd + kh * hd;
                    float dot = 0;
                    for (int x = 0; x < hd; x++)
                        dot += dout[x] * v[x];
                    dp[qq] = dot;
                }
                float sum = 0;
                for (int qq = 0; qq <= p; qq++)
                    sum += pp[qq] * dp[qq];
                if (j == 0) { /* dV0 += P^T dO needs P: do it before P becomes dS */
                    cblas_sger(CblasRowMajor, p + 1, hd, 1.0f, pp, 1, dout, 1,
                               t->dV + (size_t)t->pr[0].row0[s] * kvd + kh * hd, kvd);
                } else { /* the own diagonal value */
                    float *dv = t->dV + (size_t)(pr->row0[s] + i) * kvd + kh * hd;
                    for (int x = 0; x < hd; x++)
                        dv[x] += pp[p] * dout[x];
                }
                for (int qq = 0; qq <= p; qq++)
                    pp[qq] = pp[qq] * (dp[qq] - sum) * scale; /* now dS */
            }
            /* dQ = dS K: pass 0's keys by sgemm (the diagonal entries of later passes added) */
            if (j == 0) {
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, L, 1.0f, Pb, L, K0,
                            kvd, 0.0f, dQ, qd);
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, L, hd, rows, 1.0f, Pb, L, Q,
                            qd, 1.0f, t->dK + (size_t)t->pr[0].row0[s] * kvd + kh * hd, kvd);
                continue;
            }
            for (int i = 0; i < rows; i++) {
                int p = pr->first + i;
                const float *ds = Pb + (size_t)i * L, *q = Q + (size_t)i * qd;
                float *dq = dQ + (size_t)i * qd;
                cblas_sgemv(CblasRowMajor, CblasTrans, TDM_MAX(0, p - j + 1), hd, 1.0f, K0, kvd, ds,
                            1, 0.0f, dq, 1);
                for (int qq = TDM_MAX(0, p - j + 1); qq <= p; qq++) {
                    int c, kr = key_row(t, s, j, p, qq, &c);
                    const float *k = t->Kp + ((size_t)c * t->max_rows + kr) * kvd + kh * hd;
                    for (int x = 0; x < hd; x++)
                        dq[x] += ds[qq] * k[x];
                }
                float *dk = t->dK + (size_t)(pr->row0[s] + i) * kvd + kh * hd;
                for (int x = 0; x < hd; x++)
                    dk[x] += ds[p] * q[x];
            }
        }
    }
}

/* ---- the loss over a chunk of rows: CE against the target's top-k, the regression ---- */
struct loss_job {
    struct tdm_head_trainer *t;
    int j, c0, n;      /* scored rows lrow[c0 .. c0 + n) */
    float w_ce, w_reg; /* scale of each row's gradients (pass weight / rows) */
    bool backward;
};
static void loss_worker(void *ctx, int ith, int nth)
{
    const struct loss_job *lj = ctx;
    struct tdm_head_trainer *t = lj->t;
    const int vd = t->vd, d = t->d, K = t->top_k;
    const struct pass_rows *pr = &t->pr[lj->j];
    double ce = 0, reg = 0, agree = 0, counted = 0;
    int64_t b, e;
    tdm_split_range(lj->n, ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; i++) {
        int r = t->lrow[lj->c0 + i], s = t->rseq[r];
        int p = pr->first + (r - pr->row0[s]);
        const struct tdm_train_seq *sq = &t->seqs[s];
        float *z = t->Z + (size_t)i * vd;
        /* the target's distribution at p + 1, in the draft vocabulary */
        const int32_t *ids = sq->top_ids + (size_t)(p + 1) * K;
        const float *pr_t = sq->top_p + (size_t)(p + 1) * K;
        double mass = 0;
        for (int k = 0; k < K; k++)
            if (ids[k] >= 0 && t->t2d[ids[k]] >= 0) mass += pr_t[k];
        float mx = -INFINITY;
        int am = 0;
        for (int c = 0; c < vd; c++)
            if (z[c] > mx) {
                mx = z[c];
                am = c;
            }
        float zk[TDM_TRAIN_MAX_TOPK]; /* the targets' logits, before z becomes exp(z - mx) */
        for (int k = 0; k < K; k++)
            zk[k] = ids[k] >= 0 && t->t2d[ids[k]] >= 0 ? z[t->t2d[ids[k]]] : 0.0f;
        double sum = 0;
        for (int c = 0; c < vd; c++) {
            z[c] = expf(z[c] - mx);
            sum += z[c];
        }
        double lse = mx + log(sum);
        if (mass > 0) {
            counted++;
            double row_ce = 0;
            for (int k = 0; k < K; k++)
                if (ids[k] >= 0 && t->t2d[ids[k]] >= 0) row_ce -= pr_t[k] / mass * (zk[k] - lse);
            ce += row_ce;
            if (ids[0] >= 0 && t->t2d[ids[0]] == am) agree++;
        }
        if (lj->backward) { /* dz = (softmax - P') w_ce */
            float f = mass > 0 ? (float)(lj->w_ce / sum) : 0.0f;
            for (int c = 0; c < vd; c++)
                z[c] *= f;
            for (int k = 0; mass > 0 && k < K; k++) {
                int dk = ids[k] >= 0 ? t->t2d[ids[k]] : -1;
                if (dk >= 0) z[dk] -= (float)(pr_t[k] / mass * lj->w_ce);
            }
        }
        /* the regression toward h(p + 1) */
        const float *g = t->Gl + (size_t)i * d;
        const float *h1 = sq->feats + (size_t)(p + 1) * d;
        float *dg = t->dX + (size_t)r * d; /* the regression's gradient; the CE's is added */
        double rr = 0;
        for (int c = 0; c < d; c++) {
            float df = g[c] - h1[c], a = fabsf(df);
            rr += a < 1.0f ? 0.5 * df * df : a - 0.5;
            if (lj->backward) dg[c] = (a < 1.0f ? df : (df > 0 ? 1.0f : -1.0f)) * lj->w_reg / d;
        }
        reg += rr / d;
    }
    t->loss_part[ith][0] += ce;
    t->loss_part[ith][1] += reg;
    t->loss_part[ith][2] += agree;
    t->loss_part[ith][3] += counted;
}

/* ---- elementwise helpers over the pool ---- */
struct ew_job {
    int kind;
    size_t n;
    const float *a, *b;
    float *x, *y, *z;
};
static inline float sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}
static void ew_worker(void *ctx, int ith, int nth)
{
    const struct ew_job *j = ctx;
    int64_t b, e;
    tdm_split_range((int64_t)j->n, ith, nth, 1024, &b, &e);
    for (int64_t i = b; i < e; i++) {
        switch (j->kind) {
        case 0: { /* S = silu(GA) * U */
            float ga = j->a[i];
            j->x[i] = ga * sigmoid(ga) * j->b[i];
            break;
        }
        case 1: { /* dGA, dU from dS (in x) */
            float ga = j->a[i], sg = sigmoid(ga), ds = j->x[i];
            j->y[i] = ds * j->b[i] * sg * (1.0f + ga * (1.0f - sg));
            j->z[i] = ds * ga * sg;
            break;
        }
        case 2: /* x += a */
            j->x[i] += j->a[i];
            break;
        }
    }
}
static void ew(struct tdm_head_trainer *t, int kind, size_t n, const float *a, const float *b,
               float *x, float *y, float *z)
{
    struct ew_job j = {kind, n, a, b, x, y, z};
    tdm_pool_run(t->pool, ew_worker, &j);
}
static void add_bias(float *x, const float *bias, int n, int dim)
{
    for (int i = 0; i < n; i++)
        for (int c = 0; c < dim; c++)
            x[(size_t)i * dim + c] += bias[c];
}
static void bias_grad(const float *dy, int n, int dim, float *db)
{
    for (int i = 0; i < n; i++)
        for (int c = 0; c < dim; c++)
            db[c] += dy[(size_t)i * dim + c];
}

/* ---- one pass: forward, loss, and (backward) its gradients ---- */
static void pass_layout(struct tdm_head_trainer *t, int j)
{
    struct pass_rows *pr = &t->pr[j];
    pr->first = j;
    int n = 0;
    for (int s = 0; s < t->n_seqs; s++) {
        pr->row0[s] = n;
        n += TDM_MAX(0, t->seqs[s].len - 1 - j);
    }
    pr->row0[t->n_seqs] = n;
    pr->n = n;
}

static tdm_status reserve_probs(struct tdm_head_trainer *t, int j)
{
    size_t need = 0;
    for (int s = 0; s < t->n_seqs; s++) {
        t->p_off[s] = need;
        size_t rows = (size_t)(t->pr[j].row0[s + 1] - t->pr[j].row0[s]);
        need += (size_t)t->nh * rows * (size_t)TDM_MAX(0, t->seqs[s].len - 1);
    }
    if (need <= t->p_cap) return TDM_OK;
    float *p = realloc(t->P, TDM_MAX(need, 1) * sizeof(float));
    if (!p)
        return tdm_err_set(TDM_ENOMEM, "train: out of memory for attention (%zu MB)",
                           need * sizeof(float) >> 20);
    t->P = p;
    t->p_cap = need;
    return TDM_OK;
}

/* EAGLE's augmentation: the features pass 0 reads, each element plus U(-f, f) times the row's
 * RMS, keyed on (seed, step, row, element) so a resumed run draws the same noise. */
static void add_noise(struct tdm_head_trainer *t, int R)
{
    const int d = t->d;
    const float f = t->o.feature_noise;
    for (int r = 0; r < R; r++) {
        float *h = t->H + (size_t)r * d;
        double ss = 0;
        for (int c = 0; c < d; c++)
            ss += (double)h[c] * h[c];
        float rms = (float)sqrt(ss / d);
        uint64_t x = t->o.seed * 0x9E3779B97F4A7C15ull ^ (uint64_t)t->step << 32 ^ (uint64_t)r;
        for (int c = 0; c < d; c++) { /* splitmix64 */
            uint64_t z = (x += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            z ^= z >> 31;
            float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
            h[c] += (2.0f * u - 1.0f) * f * rms;
        }
    }
}

static tdm_status run_pass(struct tdm_head_trainer *t, int j, bool backward,
                           struct tdm_train_loss *loss)
{
    const int d = t->d, qd = t->qd, kvd = t->kvd, ff = t->ff, nh = t->nh, nkv = t->nkv;
    const int hd = t->hd;
    struct pass_rows *pr = &t->pr[j];
    const int R = pr->n;
    if (R <= 0) return TDM_OK;
    tdm_status st = reserve_probs(t, j);
    if (st != TDM_OK) return st;
    /* inputs: t(p+1), and h(p) (pass 0) or the previous pass's g(p-1) */
    for (int s = 0; s < t->n_seqs; s++) {
        const struct tdm_train_seq *sq = &t->seqs[s];
        for (int r = pr->row0[s]; r < pr->row0[s + 1]; r++) {
            int p = pr->first + (r - pr->row0[s]);
            t->rseq[r] = s;
            t->pos[r] = p;
            t->tok[r] = sq->tokens[p + 1];
            memcpy(t->E + (size_t)r * d, t->embed + (size_t)t->tok[r] * d, (size_t)d * 4);
            const float *hin = j == 0
                                   ? sq->feats + (size_t)p * d
                                   : t->Gp + ((size_t)(j - 1) * t->max_rows + t->pr[j - 1].row0[s] +
                                              (p - 1) - t->pr[j - 1].first) *
                                                 d;
            memcpy(t->H + (size_t)r * d, hin, (size_t)d * 4);
        }
    }
    if (j == 0 && t->o.feature_noise > 0) add_noise(t, R);
    float *Kj = t->Kp + (size_t)j * t->max_rows * kvd, *Vj = t->Vp + (size_t)j * t->max_rows * kvd;
    float *Gj = t->Gp + (size_t)j * t->max_rows * d;
    /* forward */
    norm_fwd(t, t->E, PT(t, P_ENORM), R, d, t->En, t->rE);
    norm_fwd(t, t->H, PT(t, P_HNORM), R, d, t->Hn, t->rH);
    mm(t, R, t->En, PT(t, P_FC_E), d, d, t->X0);
    gemm(t, G_XWT, R, d, d, t->Hn, PT(t, P_FC_H), t->X0, 1.0f);
    norm_fwd(t, t->X0, PT(t, P_ATTN_NORM), R, d, t->A, t->rA);
    mm(t, R, t->A, PT(t, P_WQ), qd, d, t->Qr);
    mm(t, R, t->A, PT(t, P_WK), kvd, d, t->Kr);
    mm(t, R, t->A, PT(t, P_WV), kvd, d, Vj);
    if (HAS(t, P_BQ)) {
        add_bias(t->Qr, PT(t, P_BQ), R, qd);
        add_bias(t->Kr, PT(t, P_BK), R, kvd);
        add_bias(Vj, PT(t, P_BV), R, kvd);
    }
    if (HAS(t, P_QNORM)) {
        norm_fwd(t, t->Qr, PT(t, P_QNORM), R * nh, hd, t->Qn, t->rQ);
        norm_fwd(t, t->Kr, PT(t, P_KNORM), R * nkv, hd, t->Kn, t->rK);
        memcpy(t->Q, t->Qn, (size_t)R * qd * 4);
        memcpy(Kj, t->Kn, (size_t)R * kvd * 4);
    } else {
        memcpy(t->Q, t->Qr, (size_t)R * qd * 4);
        memcpy(Kj, t->Kr, (size_t)R * kvd * 4);
    }
    rope(t, t->Q, R, nh, 1.0f);
    rope(t, Kj, R, nkv, 1.0f);
    struct attn_job aj = {t, j};
    tdm_pool_run(t->pool, attn_fwd_worker, &aj);
    memcpy(t->X1, t->X0, (size_t)R * d * 4);
    gemm(t, G_XWT, R, d, qd, t->ATT, PT(t, P_WO), t->X1, 1.0f);
    norm_fwd(t, t->X1, PT(t, P_FFN_NORM), R, d, t->M, t->rM);
    mm(t, R, t->M, PT(t, P_WGATE), ff, d, t->GA);
    mm(t, R, t->M, PT(t, P_WUP), ff, d, t->U);
    ew(t, 0, (size_t)R * ff, t->GA, t->U, t->S, NULL, NULL);
    memcpy(t->X2, t->X1, (size_t)R * d * 4);
    gemm(t, G_XWT, R, d, ff, t->S, PT(t, P_WDOWN), t->X2, 1.0f);
    norm_fwd(t, t->X2, PT(t, P_NORM), R, d, Gj, t->rG);

    /* the loss over the scored rows, chunk by chunk; dX gets dL/dg (0 on context rows) */
    int RL = 0;
    for (int r = 0; r < R; r++) {
        const struct tdm_train_seq *sq = &t->seqs[t->rseq[r]];
        if (t->pos[r] >= sq->first) t->lrow[RL++] = r;
    }
    float w = powf(t->o.unroll_decay, (float)j);
    memset(t->loss_part, 0, sizeof t->loss_part);
    if (backward) memset(t->dX, 0, (size_t)R * d * 4);
    for (int c0 = 0; c0 < RL; c0 += t->chunk) {
        int n = TDM_MIN(t->chunk, RL - c0);
        for (int i = 0; i < n; i++)
            memcpy(t->Gl + (size_t)i * d, Gj + (size_t)t->lrow[c0 + i] * d, (size_t)d * 4);
        gemm(t, G_XWT_N, n, t->vd, d, t->Gl, t->lm, t->Z, 0.0f);
        struct loss_job lj = {t, j, c0, n, w / RL, w * t->o.reg_weight / RL, backward};
        tdm_pool_run(t->pool, loss_worker, &lj);
        if (!backward) continue;
        mm_dx(t, n, t->Z, t->lm, t->vd, d, t->Gl, 0.0f); /* dg = dz LM */
        for (int i = 0; i < n; i++) {
            float *dx = t->dX + (size_t)t->lrow[c0 + i] * d, *dg = t->Gl + (size_t)i * d;
            for (int c = 0; c < d; c++)
                dx[c] += dg[c];
        }
    }
    double ce = 0, reg = 0, agree = 0, counted = 0;
    for (int k = 0; k < t->nth; k++) {
        ce += t->loss_part[k][0];
        reg += t->loss_part[k][1];
        agree += t->loss_part[k][2];
        counted += t->loss_part[k][3];
    }
    struct tdm_train_pass_loss *pl = &loss->pass[j];
    pl->rows = RL;
    pl->ce = counted > 0 ? ce / counted : 0;
    pl->reg = RL ? reg / RL : 0;
    pl->top1 = counted > 0 ? agree / counted : 0;
    pl->covered = RL ? counted / RL : 0;
    if (RL) loss->loss += w * (ce / RL + t->o.reg_weight * reg / RL);
    if (!backward || !RL) return TDM_OK;

    /* backward. dX holds dL/dg; turn it into dL/dx2 */
    memcpy(t->dA, t->dX, (size_t)R * d * 4);
    memset(t->dX, 0, (size_t)R * d * 4);
    norm_bwd(t, t->X2, PT(t, P_NORM), t->rG, t->dA, R, d, t->dX, GR(t, P_NORM));
    /* MLP: dS = dx2 Wdown; dWdown += dx2^T S */
    mm_dx(t, R, t->dX, PT(t, P_WDOWN), d, ff, t->dFF, 0.0f);
    mm_dw(t, R, t->dX, t->S, d, ff, GR(t, P_WDOWN));
    ew(t, 1, (size_t)R * ff, t->GA, t->U, t->dFF, t->dGA, t->dU);
    mm_dx(t, R, t->dGA, PT(t, P_WGATE), ff, d, t->dA, 0.0f);
    mm_dx(t, R, t->dU, PT(t, P_WUP), ff, d, t->dA, 1.0f);
    mm_dw(t, R, t->dGA, t->M, ff, d, GR(t, P_WGATE));
    mm_dw(t, R, t->dU, t->M, ff, d, GR(t, P_WUP));
    norm_bwd(t, t->X1, PT(t, P_FFN_NORM), t->rM, t->dA, R, d, t->dX, GR(t, P_FFN_NORM));
    /* attention: dATT = dx1 Wo; dWo += dx1^T ATT */
    mm_dx(t, R, t->dX, PT(t, P_WO), d, qd, t->dATT, 0.0f);
    mm_dw(t, R, t->dX, t->ATT, d, qd, GR(t, P_WO));
    memset(t->dK, 0, (size_t)R * kvd * 4);
    memset(t->dV, 0, (size_t)R * kvd * 4);
    tdm_pool_run(t->pool, attn_bwd_worker, &aj);
    rope(t, t->dQ, R, nh, -1.0f);
    rope(t, t->dK, R, nkv, -1.0f);
    float *dQr = t->dQ, *dKr = t->dK;
    if (HAS(t, P_QNORM)) { /* through the per-head norms, into dATT and dFF as scratch */
        memset(t->dATT, 0, (size_t)R * qd * 4);
        norm_bwd(t, t->Qr, PT(t, P_QNORM), t->rQ, t->dQ, R * nh, hd, t->dATT, GR(t, P_QNORM));
        memset(t->dFF, 0, (size_t)R * kvd * 4);
        norm_bwd(t, t->Kr, PT(t, P_KNORM), t->rK, t->dK, R * nkv, hd, t->dFF, GR(t, P_KNORM));
        dQr = t->dATT;
        dKr = t->dFF;
    }
    if (HAS(t, P_BQ)) {
        bias_grad(dQr, R, qd, GR(t, P_BQ));
        bias_grad(dKr, R, kvd, GR(t, P_BK));
        bias_grad(t->dV, R, kvd, GR(t, P_BV));
    }
    mm_dx(t, R, dQr, PT(t, P_WQ), qd, d, t->dA, 0.0f);
    mm_dx(t, R, dKr, PT(t, P_WK), kvd, d, t->dA, 1.0f);
    mm_dx(t, R, t->dV, PT(t, P_WV), kvd, d, t->dA, 1.0f);
    mm_dw(t, R, dQr, t->A, qd, d, GR(t, P_WQ));
    mm_dw(t, R, dKr, t->A, kvd, d, GR(t, P_WK));
    mm_dw(t, R, t->dV, t->A, kvd, d, GR(t, P_WV));
    norm_bwd(t, t->X0, PT(t, P_ATTN_NORM), t->rA, t->dA, R, d, t->dX, GR(t, P_ATTN_NORM));
    /* the input stage: dX is dL/dx0 */
    mm_dw(t, R, t->dX, t->En, d, d, GR(t, P_FC_E));
    mm_dw(t, R, t->dX, t->Hn, d, d, GR(t, P_FC_H));
    mm_dx(t, R, t->dX, PT(t, P_FC_E), d, d, t->dA, 0.0f);
    norm_bwd(t, t->E, PT(t, P_ENORM), t->rE, t->dA, R, d, NULL, GR(t, P_ENORM));
    mm_dx(t, R, t->dX, PT(t, P_FC_H), d, d, t->dA, 0.0f);
    norm_bwd(t, t->H, PT(t, P_HNORM), t->rH, t->dA, R, d, NULL, GR(t, P_HNORM));
    return TDM_OK;
}

static tdm_status check_batch(const struct tdm_head_trainer *t, const struct tdm_train_seq *seqs,
                              int n, int top_k)
{
    if (n <= 0 || n > t->max_seqs)
        return tdm_err_set(TDM_EINVAL, "train: %d sequences in a batch (1 .. %d)", n, t->max_seqs);
    if (top_k <= 0 || top_k > TDM_TRAIN_MAX_TOPK)
        return tdm_err_set(TDM_EINVAL, "train: top-k %d (1 .. %d)", top_k, TDM_TRAIN_MAX_TOPK);
    int64_t rows = 0;
    for (int s = 0; s < n; s++) {
        const struct tdm_train_seq *q = &seqs[s];
        if (q->len < 2 || q->len > t->max_len)
            return tdm_err_set(TDM_EINVAL, "train: a sequence of %d positions (2 .. %d)", q->len,
                               t->max_len);
        if (q->first < 0)
            return tdm_err_set(TDM_EINVAL, "train: a sequence scored from row %d", q->first);
        for (int p = 0; p < q->len; p++)
            if (q->tokens[p] < 0 || q->tokens[p] >= t->g.vocab)
                return tdm_err_set(TDM_EINVAL, "train: token %d outside the vocabulary",
                                   q->tokens[p]);
        rows += q->len - 1;
    }
    if (rows > t->max_rows)
        return tdm_err_set(TDM_ERANGE, "train: %lld rows in a batch, at most %d", (long long)rows,
                           t->max_rows);
    return TDM_OK;
}

static tdm_status forward_backward(struct tdm_head_trainer *t, const struct tdm_train_seq *seqs,
                                   int n, int top_k, bool backward, struct tdm_train_loss *loss)
{
    tdm_status st = check_batch(t, seqs, n, top_k);
    if (st != TDM_OK) return st;
    memset(loss, 0, sizeof *loss);
    t->seqs = seqs;
    t->n_seqs = n;
    t->top_k = top_k;
    if (backward) memset(t->grad, 0, t->n_params * sizeof(float));
    loss->n_passes = t->o.unroll;
    t->gpu_st = TDM_OK;
    for (int j = 0; j < t->o.unroll; j++) {
        pass_layout(t, j);
        if ((st = run_pass(t, j, backward, loss)) != TDM_OK) return st;
        if (t->gpu_st != TDM_OK) return t->gpu_st; /* its message is set */
    }
    t->seqs = NULL;
    return TDM_OK;
}

tdm_status tdm_head_trainer_grad(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss)
{
    return forward_backward(t, seqs, n, top_k, true, loss);
}

tdm_status tdm_head_trainer_eval(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss)
{
    return forward_backward(t, seqs, n, top_k, false, loss);
}

double tdm_head_trainer_lr(const tdm_head_trainer_t *t, int64_t step)
{
    const struct tdm_train_opts *o = &t->o;
    if (o->warmup_steps > 0 && step < o->warmup_steps)
        return o->lr * (double)(step + 1) / (double)o->warmup_steps;
    int64_t span = o->total_steps - o->warmup_steps;
    double x = span > 0 ? (double)(step - o->warmup_steps) / (double)span : 1.0;
    x = x < 0 ? 0 : x > 1 ? 1 : x;
    double lo = o->lr * o->min_lr_frac;
    return lo + 0.5 * (o->lr - lo) * (1.0 + cos(M_PI * x));
}

struct adam_job {
    struct tdm_head_trainer *t;
    float lr, scale, b1c, b2c;
};
static void adam_worker(void *ctx, int ith, int nth)
{
    const struct adam_job *aj = ctx;
    struct tdm_head_trainer *t = aj->t;
    const struct tdm_train_opts *o = &t->o;
    for (int i = 0; i < P_COUNT; i++) {
        const struct ptensor *pt = &t->pt[i];
        size_t n = (size_t)(pt->rows * pt->cols);
        int64_t b, e;
        tdm_split_range((int64_t)n, ith, nth, 256, &b, &e);
        float wd = pt->matrix ? o->weight_decay : 0.0f;
        float *p = t->params + pt->off, *g = t->grad + pt->off;
        float *m = t->adam_m + pt->off, *v = t->adam_v + pt->off;
        for (int64_t k = b; k < e; k++) {
            float gk = g[k] * aj->scale;
            m[k] = o->beta1 * m[k] + (1.0f - o->beta1) * gk;
            v[k] = o->beta2 * v[k] + (1.0f - o->beta2) * gk * gk;
            float mh = m[k] / aj->b1c, vh = v[k] / aj->b2c;
            p[k] -= aj->lr * (mh / (sqrtf(vh) + o->adam_eps) + wd * p[k]);
        }
    }
}

tdm_status tdm_head_trainer_step(tdm_head_trainer_t *t, const struct tdm_train_seq *seqs, int n,
                                 int top_k, struct tdm_train_loss *loss)
{
    tdm_status st = forward_backward(t, seqs, n, top_k, true, loss);
    if (st != TDM_OK) return st;
    double ss = 0;
    for (size_t i = 0; i < t->n_params; i++)
        ss += (double)t->grad[i] * t->grad[i];
    double norm = sqrt(ss);
    if (!isfinite(norm))
        return tdm_err_set(TDM_ERANGE, "train: the gradient is not finite at step %lld",
                           (long long)t->step);
    loss->grad_norm = norm;
    float scale = t->o.clip > 0 && norm > t->o.clip ? (float)(t->o.clip / norm) : 1.0f;
    double lr = tdm_head_trainer_lr(t, t->step);
    loss->lr = lr;
    t->step++;
    struct adam_job aj = {t, (float)lr, scale, 1.0f - powf(t->o.beta1, (float)t->step),
                          1.0f - powf(t->o.beta2, (float)t->step)};
    tdm_pool_run(t->pool, adam_worker, &aj);
    return TDM_OK;
}

/* ---- creation ---- */
static void layout_params(struct tdm_head_trainer *t)
{
    const int d = t->d, qd = t->qd, kvd = t->kvd, ff = t->ff, hd = t->hd;
    const bool bias = t->g.qkv_bias, qkn = t->g.qk_norm;
    const int64_t shapes[P_COUNT][2] = {
        {1, d},   {1, d},     {d, d},      {d, d},      {1, d},    {qd, d},   {kvd, d},
        {kvd, d}, {bias, qd}, {bias, kvd}, {bias, kvd}, {qkn, hd}, {qkn, hd}, {d, qd},
        {1, d},   {ff, d},    {ff, d},     {d, ff},     {1, d},
    };
    size_t off = 0;
    for (int i = 0; i < P_COUNT; i++) {
        t->pt[i] = (struct ptensor){off, shapes[i][0], shapes[i][1], shapes[i][0] > 1};
        off += (size_t)(shapes[i][0] * shapes[i][1]);
        off = (off + 15) & ~(size_t)15; /* 64-byte aligned tensors */
    }
    t->n_params = off;
}

/* A normal draw keyed on (seed, tensor, index): Box-Muller on two counter-based uniforms. */
static float randn(uint64_t seed, int tensor, size_t i)
{
    double u1 = tdm_rng_uniform(seed, (uint64_t)tensor + 1000, (uint32_t)i, 0);
    double u2 = tdm_rng_uniform(seed, (uint64_t)tensor + 1000, (uint32_t)i, 1);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

/* Dequantised rows of a weight into out ([n][w.cols]); rows: NULL for 0 .. n-1. */
static tdm_status weight_rows(const struct tdm_weight *w, const int32_t *rows, int64_t n,
                              float *out)
{
    void *raw = malloc(w->row_bytes + 64);
    if (!raw) return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    tdm_status st = TDM_OK;
    for (int64_t i = 0; i < n && st == TDM_OK; i++) {
        int64_t r = rows ? rows[i] : i;
        memcpy(raw, (const uint8_t *)w->data + (size_t)r * w->row_bytes, w->row_bytes);
        st = tdm_dequantize(w->dtype, raw, out + (size_t)i * w->cols, w->cols);
    }
    free(raw);
    if (st != TDM_OK)
        return tdm_err_set(st, "train: cannot read a %s weight as f32", tdm_dtype_name(w->dtype));
    return TDM_OK;
}

static void init_params(struct tdm_head_trainer *t, const struct tdm_model *target)
{
    const uint64_t seed = t->o.seed;
    for (int i = 0; i < P_COUNT; i++) {
        const struct ptensor *pt = &t->pt[i];
        float *p = t->params + pt->off;
        size_t n = (size_t)(pt->rows * pt->cols);
        bool norm = i == P_ENORM || i == P_HNORM || i == P_ATTN_NORM || i == P_FFN_NORM ||
                    i == P_NORM || i == P_QNORM || i == P_KNORM;
        if (norm) {
            for (size_t k = 0; k < n; k++)
                p[k] = 1.0f;
            continue;
        }
        if (i == P_BQ || i == P_BK || i == P_BV) {
            memset(p, 0, n * sizeof(float));
            continue;
        }
        /* fan-in scaled; the projections back into the residual stream start smaller */
        double std = 1.0 / sqrt((double)pt->cols);
        if (i == P_FC_E || i == P_FC_H) std = 1.0 / sqrt(2.0 * pt->cols);
        if (i == P_WO || i == P_WDOWN) std *= 0.5;
        for (size_t k = 0; k < n; k++)
            p[k] = (float)std * randn(seed, i, k);
    }
    (void)target;
}

void tdm_train_opts_default(struct tdm_train_opts *o)
{
    *o = (struct tdm_train_opts){.unroll = 3,
                                 .unroll_decay = 0.7f,
                                 .reg_weight = 0.5f,
                                 .lr = 2e-3f,
                                 .min_lr_frac = 0.05f,
                                 .weight_decay = 0.01f,
                                 .beta1 = 0.9f,
                                 .beta2 = 0.95f,
                                 .adam_eps = 1e-8f,
                                 .clip = 1.0f,
                                 .warmup_steps = 30,
                                 .total_steps = 1000,
                                 .seed = 1,
                                 .max_rows = 4096,
                                 .max_seqs = 512,
                                 .max_len = 1024};
}

void tdm_train_geom_of(const struct tdm_model *target, struct tdm_train_geom *g)
{
    const struct tdm_model_config *c = &target->cfg;
    *g = (struct tdm_train_geom){.d_model = c->d_model,
                                 .n_heads = c->n_heads,
                                 .n_kv_heads = c->n_kv_heads,
                                 .head_dim = c->head_dim,
                                 .d_ff = c->d_ff,
                                 .vocab = c->vocab_size,
                                 .qkv_bias = c->qkv_bias,
                                 .qk_norm = c->qk_norm,
                                 .rope_neox = c->rope_neox,
                                 .rms_eps = c->rms_eps};
}

void tdm_head_trainer_destroy(tdm_head_trainer_t *t)
{
    if (!t) return;
    tdm_pool_destroy(t->pool);
    float *bufs[] = {t->params,   t->grad, t->adam_m, t->adam_v, t->embed, t->lm,  t->rope_cos,
                     t->rope_sin, t->E,    t->En,     t->H,      t->Hn,    t->X0,  t->A,
                     t->Qr,       t->Qn,   t->Q,      t->Kr,     t->Kn,    t->ATT, t->X1,
                     t->M,        t->GA,   t->U,      t->S,      t->X2,    t->rE,  t->rH,
                     t->rA,       t->rM,   t->rG,     t->rQ,     t->rK,    t->dX,  t->dA,
                     t->dFF,      t->dGA,  t->dU,     t->dATT,   t->dQ,    t->dK,  t->dV,
                     t->dwpart,   t->Z,    t->Gl,     t->Kp,     t->Vp,    t->Gp,  t->P};
    for (size_t i = 0; i < TDM_ARRAY_LEN(bufs); i++)
        if (t->o.gpu && bufs[i] != t->P)
            tdm_cuda_gemm_host_free(t->o.gpu, bufs[i]);
        else
            tdm_free_aligned(bufs[i]);
    free(t->d2t);
    free(t->t2d);
    free(t->pos);
    free(t->tok);
    free(t->rseq);
    free(t->lrow);
    free(t->p_off);
    for (int j = 0; j < TDM_TRAIN_MAX_UNROLL; j++)
        free(t->pr[j].row0);
    free(t);
}

/* Zeroed floats; pinned when the GEMMs run on the GPU (its copies then run at full speed). */
static float *falloc(const struct tdm_head_trainer *t, size_t n, bool *ok)
{
    float *p = !n         ? NULL
               : t->o.gpu ? tdm_cuda_gemm_host_alloc(t->o.gpu, n * sizeof(float))
                          : tdm_alloc_aligned(n * sizeof(float));
    if (n && !p) *ok = false;
    if (p) memset(p, 0, n * sizeof(float));
    return p;
}

tdm_status tdm_head_trainer_create(const struct tdm_model *target, const struct tdm_train_geom *g,
                                   const struct tdm_train_opts *o, const int32_t *draft_vocab,
                                   int n_draft, tdm_head_trainer_t **out)
{
    if (!target || !g || !o || !out) return tdm_err_set(TDM_EINVAL, "train: bad arguments");
    const struct tdm_model_config *tc = &target->cfg;
    if (g->d_model != tc->d_model || g->head_dim != tc->head_dim || g->vocab != tc->vocab_size)
        return tdm_err_set(TDM_EINVAL, "train: the head's width, head size and vocabulary are "
                                       "the target's");
    if (g->n_heads <= 0 || g->n_kv_heads <= 0 || g->n_heads % g->n_kv_heads || g->d_ff <= 0 ||
        g->head_dim % 2 || g->head_dim > TDM_MAX_HEAD_DIM)
        return tdm_err_set(TDM_EINVAL, "train: a head of %d heads, %d KV heads, d_ff %d",
                           g->n_heads, g->n_kv_heads, g->d_ff);
    if (o->unroll < 1 || o->unroll > TDM_TRAIN_MAX_UNROLL)
        return tdm_err_set(TDM_EINVAL, "train: unroll %d (1 .. %d)", o->unroll,
                           TDM_TRAIN_MAX_UNROLL);
    if (o->max_rows <= 0 || o->max_seqs <= 0 || o->max_len < 2 || o->max_len > TDM_TRAIN_MAX_LEN)
        return tdm_err_set(TDM_EINVAL,
                           "train: batch limits (rows %d, sequences %d, length %d; "
                           "length at most %d)",
                           o->max_rows, o->max_seqs, o->max_len, TDM_TRAIN_MAX_LEN);
    if (draft_vocab && (n_draft <= 0 || n_draft > g->vocab))
        return tdm_err_set(TDM_EINVAL, "train: a draft vocabulary of %d tokens", n_draft);
    struct tdm_head_trainer *t = calloc(1, sizeof *t);
    if (!t) return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    t->g = *g;
    t->o = *o;
    t->d = g->d_model;
    t->hd = g->head_dim;
    t->nh = g->n_heads;
    t->nkv = g->n_kv_heads;
    t->qd = t->nh * t->hd;
    t->kvd = t->nkv * t->hd;
    t->ff = g->d_ff;
    t->vd = draft_vocab ? n_draft : g->vocab;
    t->max_rows = o->max_rows;
    t->max_seqs = o->max_seqs;
    t->max_len = o->max_len;
    tdm_status st = tdm_pool_create(o->n_threads, &t->pool);
    if (st != TDM_OK) {
        free(t);
        return st;
    }
    openblas_set_num_threads(1); /* each of our threads runs its own part of a product */
    t->nth = tdm_pool_size(t->pool);
    if (t->nth > (int)TDM_ARRAY_LEN(t->loss_part)) {
        tdm_head_trainer_destroy(t);
        return tdm_err_set(TDM_EINVAL, "train: at most %d threads",
                           (int)TDM_ARRAY_LEN(t->loss_part));
    }
    layout_params(t);
    bool ok = true;
    size_t R = (size_t)t->max_rows, d = (size_t)t->d, qd = (size_t)t->qd, kvd = (size_t)t->kvd;
    size_t ff = (size_t)t->ff, U = (size_t)o->unroll;
    t->params = falloc(t, t->n_params, &ok);
    t->grad = falloc(t, t->n_params, &ok);
    t->adam_m = falloc(t, t->n_params, &ok);
    t->adam_v = falloc(t, t->n_params, &ok);
    t->embed = falloc(t, (size_t)g->vocab * d, &ok);
    t->lm = falloc(t, (size_t)t->vd * d, &ok);
    t->rope_cos = falloc(t, (size_t)t->max_len * (t->hd / 2), &ok);
    t->rope_sin = falloc(t, (size_t)t->max_len * (t->hd / 2), &ok);
    float **rd[] = {&t->E,  &t->En, &t->H,  &t->Hn, &t->X0, &t->A,
                    &t->X1, &t->M,  &t->X2, &t->dX, &t->dA};
    for (size_t i = 0; i < TDM_ARRAY_LEN(rd); i++)
        *rd[i] = falloc(t, R * d, &ok);
    float **rq[] = {&t->Qr, &t->Q, &t->ATT, &t->dATT, &t->dQ};
    for (size_t i = 0; i < TDM_ARRAY_LEN(rq); i++)
        *rq[i] = falloc(t, R * qd, &ok);
    t->Qn = g->qk_norm ? falloc(t, R * qd, &ok) : NULL;
    t->Kn = g->qk_norm ? falloc(t, R * kvd, &ok) : NULL;
    t->Kr = falloc(t, R * kvd, &ok);
    t->dK = falloc(t, R * kvd, &ok);
    t->dV = falloc(t, R * kvd, &ok);
    float **rf[] = {&t->GA, &t->U, &t->S, &t->dFF, &t->dGA, &t->dU};
    for (size_t i = 0; i < TDM_ARRAY_LEN(rf); i++)
        *rf[i] = falloc(t, R * TDM_MAX(ff, kvd), &ok);
    float **rr[] = {&t->rE, &t->rH, &t->rA, &t->rM, &t->rG};
    for (size_t i = 0; i < TDM_ARRAY_LEN(rr); i++)
        *rr[i] = falloc(t, R, &ok);
    t->rQ = falloc(t, R * (size_t)t->nh, &ok);
    t->rK = falloc(t, R * (size_t)t->nkv, &ok);
    t->dwpart = falloc(t, (size_t)t->nth * d, &ok);
    t->chunk = TDM_MAX(LOSS_CHUNK_MIN, TDM_MIN(LOSS_CHUNK_MAX, LOSS_CHUNK_FLOATS / t->vd));
    t->Z = falloc(t, (size_t)t->chunk * t->vd, &ok);
    t->Gl = falloc(t, (size_t)t->chunk * d, &ok);
    t->Kp = falloc(t, U * R * kvd, &ok);
    t->Vp = falloc(t, U * R * kvd, &ok);
    t->Gp = falloc(t, U * R * d, &ok);
    t->pos = calloc(R, sizeof *t->pos);
    t->tok = calloc(R, sizeof *t->tok);
    t->rseq = calloc(R, sizeof *t->rseq);
    t->lrow = calloc(R, sizeof *t->lrow);
    t->p_off = calloc((size_t)t->max_seqs, sizeof *t->p_off);
    t->d2t = calloc((size_t)t->vd, sizeof *t->d2t);
    t->t2d = calloc((size_t)g->vocab, sizeof *t->t2d);
    for (int j = 0; j < TDM_TRAIN_MAX_UNROLL; j++)
        ok = ok && (t->pr[j].row0 = calloc((size_t)t->max_seqs + 1, sizeof(int)));
    if (!ok || !t->pos || !t->tok || !t->rseq || !t->lrow || !t->p_off || !t->d2t || !t->t2d) {
        tdm_head_trainer_destroy(t);
        return tdm_err_set(TDM_ENOMEM, "train: out of memory for a batch of %d rows", t->max_rows);
    }
    /* the draft vocabulary: ascending target ids, each once */
    for (int v = 0; v < g->vocab; v++)
        t->t2d[v] = -1;
    for (int i = 0; i < t->vd; i++) {
        int32_t id = draft_vocab ? draft_vocab[i] : i;
        if (id < 0 || id >= g->vocab || (i > 0 && id <= t->d2t[i - 1])) {
            tdm_head_trainer_destroy(t);
            return tdm_err_set(TDM_EINVAL, "train: the draft vocabulary must be ascending ids "
                                           "of the target's vocabulary");
        }
        t->d2t[i] = id;
        t->t2d[id] = i;
    }
    /* the frozen tables */
    if ((st = weight_rows(&target->tok_embd, NULL, g->vocab, t->embed)) != TDM_OK ||
        (st = weight_rows(&target->output, t->d2t, t->vd, t->lm)) != TDM_OK) {
        tdm_head_trainer_destroy(t);
        return st;
    }
    float *inv = malloc((size_t)(t->hd / 2) * sizeof(float));
    if (!inv) {
        tdm_head_trainer_destroy(t);
        return tdm_err_set(TDM_ENOMEM, "train: out of memory");
    }
    tdm_rope_inv_freq(tc, target->rope_freqs, inv);
    for (int p = 0; p < t->max_len; p++)
        for (int i = 0; i < t->hd / 2; i++) {
            float a = (float)p * inv[i]; /* as the engine's RoPE computes the angle */
            t->rope_cos[(size_t)p * (t->hd / 2) + i] = cosf(a);
            t->rope_sin[(size_t)p * (t->hd / 2) + i] = sinf(a);
        }
    free(inv);
    init_params(t, target);
    *out = t;
    return TDM_OK;
}

/* ---- access for saving, checkpoints and tests ---- */
float *tdm_head_trainer_params(tdm_head_trainer_t *t, size_t *n)
{
    *n = t->n_params;
    return t->params;
}
const float *tdm_head_trainer_grads(const tdm_head_trainer_t *t)
{
    return t->grad;
}
float *tdm_head_trainer_moments(tdm_head_trainer_t *t, float **v)
{
    *v = t->adam_v;
    return t->adam_m;
}
int64_t tdm_head_trainer_steps(const tdm_head_trainer_t *t)
{
    return t->step;
}
void tdm_head_trainer_set_steps(tdm_head_trainer_t *t, int64_t step)
{
    t->step = step;
}
void tdm_head_trainer_set_total_steps(tdm_head_trainer_t *t, int64_t total)
{
    t->o.total_steps = total > t->o.warmup_steps ? total : t->o.warmup_steps + 1;
}
const int32_t *tdm_head_trainer_draft_vocab(const tdm_head_trainer_t *t, int *n)
{
    *n = t->vd;
    return t->d2t;
}

int tdm_head_trainer_tensors(const tdm_head_trainer_t *t, struct tdm_train_tensor *out)
{
    int n = 0;
    for (int i = 0; i < P_COUNT; i++) {
        const struct ptensor *pt = &t->pt[i];
        if (pt->rows <= 0) continue;
        out[n++] = (struct tdm_train_tensor){.name = PARAM_NAMES[i],
                                             .data = t->params + pt->off,
                                             .grad = t->grad + pt->off,
                                             .rows = pt->rows,
                                             .cols = pt->cols,
                                             .fc_half = i == P_FC_E   ? 1
                                                        : i == P_FC_H ? 2
                                                                      : 0};
    }
    return n;
}

/* ---- files ---- */
static void *convert(const float *x, size_t n, const char *dtype, size_t *bytes)
{
    bool f32 = !strcmp(dtype, "F32");
    *bytes = n * (f32 ? 4 : 2);
    void *out = malloc(*bytes ? *bytes : 1);
    if (!out) return NULL;
    if (f32) {
        memcpy(out, x, n * 4);
    } else {
        uint16_t *h = out;
        bool bf = !strcmp(dtype, "BF16");
        for (size_t i = 0; i < n; i++)
            h[i] = bf ? tdm_f32_to_bf16(x[i]) : tdm_f32_to_f16(x[i]);
    }
    return out;
}

tdm_status tdm_head_trainer_save(const tdm_head_trainer_t *t, const char *path, const char *dtype,
                                 const char *const *meta, int n_meta)
{
    if (strcmp(dtype, "F32") && strcmp(dtype, "BF16") && strcmp(dtype, "F16"))
        return tdm_err_set(TDM_EINVAL, "train: a head is saved as F32, BF16 or F16 (not %s)",
                           dtype);
    const int d = t->d;
    struct tdm_st_out out[P_COUNT + 1];
    void *bufs[P_COUNT + 1] = {0};
    int n = 0;
    tdm_status st = TDM_OK;
    float *fc = malloc((size_t)d * 2 * d * sizeof(float));
    int64_t *d2t = t->vd < t->g.vocab ? malloc((size_t)t->vd * sizeof(int64_t)) : NULL;
    if (!fc || (t->vd < t->g.vocab && !d2t)) {
        st = tdm_err_set(TDM_ENOMEM, "train: out of memory");
        goto out;
    }
    for (int r = 0; r < d; r++) { /* fc = [fc_e | fc_h] */
        memcpy(fc + (size_t)r * 2 * d, PT(t, P_FC_E) + (size_t)r * d, (size_t)d * 4);
        memcpy(fc + (size_t)r * 2 * d + d, PT(t, P_FC_H) + (size_t)r * d, (size_t)d * 4);
    }
    for (int i = 0; i < P_COUNT; i++) {
        const struct ptensor *pt = &t->pt[i];
        if (pt->rows <= 0 || i == P_FC_H) continue;
        bool is_fc = i == P_FC_E, vec = pt->rows == 1 && !is_fc;
        size_t elems = is_fc ? (size_t)d * 2 * d : (size_t)(pt->rows * pt->cols), bytes;
        if (!(bufs[n] = convert(is_fc ? fc : t->params + pt->off, elems, dtype, &bytes))) {
            st = tdm_err_set(TDM_ENOMEM, "train: out of memory");
            goto out;
        }
        out[n] = (struct tdm_st_out){.name = PARAM_NAMES[i],
                                     .dtype = dtype,
                                     .n_dims = vec ? 1 : 2,
                                     .shape = {vec ? pt->cols : pt->rows, is_fc ? 2 * d : pt->cols},
                                     .data = bufs[n],
                                     .nbytes = bytes};
        n++;
    }
    if (d2t) { /* EAGLE-3's convention: draft token i is target token i + d2t[i] */
        for (int i = 0; i < t->vd; i++)
            d2t[i] = (int64_t)t->d2t[i] - i;
        out[n++] = (struct tdm_st_out){.name = "d2t",
                                       .dtype = "I64",
                                       .n_dims = 1,
                                       .shape = {t->vd},
                                       .data = d2t,
                                       .nbytes = (size_t)t->vd * sizeof(int64_t)};
    }
    st = tdm_st_write(path, out, n, meta, n_meta);
out:
    for (int i = 0; i < P_COUNT + 1; i++)
        free(bufs[i]);
    free(fc);
    free(d2t);
    return st;
}

tdm_status tdm_head_trainer_save_checkpoint(tdm_head_trainer_t *t, const char *path,
                                            const char *const *meta, int n_meta)
{
    enum { MAX_META = 32 };
    if (n_meta > MAX_META - 2) return tdm_err_set(TDM_EINVAL, "train: too much metadata");
    char step[32], np[32];
    snprintf(step, sizeof step, "%lld", (long long)t->step);
    snprintf(np, sizeof np, "%zu", t->n_params);
    const char *m[2 * MAX_META];
    for (int i = 0; i < 2 * n_meta; i++)
        m[i] = meta[i];
    m[2 * n_meta] = "step";
    m[2 * n_meta + 1] = step;
    m[2 * n_meta + 2] = "n_params";
    m[2 * n_meta + 3] = np;
    size_t nb = t->n_params * sizeof(float);
    int64_t n = (int64_t)t->n_params;
    struct tdm_st_out out[] = {
        {"params", "F32", 1, {n}, t->params, nb},
        {"adam_m", "F32", 1, {n}, t->adam_m, nb},
        {"adam_v", "F32", 1, {n}, t->adam_v, nb},
        {"draft_vocab", "I32", 1, {t->vd}, t->d2t, (size_t)t->vd * sizeof(int32_t)},
    };
    return tdm_st_write(path, out, (int)TDM_ARRAY_LEN(out), m, n_meta + 2);
}

tdm_status tdm_head_trainer_load_checkpoint(tdm_head_trainer_t *t, const char *path,
                                            const char *const *check, int n_check)
{
    tdm_st_t *st = NULL;
    tdm_status rc = tdm_st_open(path, &st);
    if (rc != TDM_OK) return rc;
    const char *np = tdm_st_metadata(st, "n_params"), *step = tdm_st_metadata(st, "step");
    int64_t n = 0, s = 0;
    if (!np || !step || !tdm_parse_i64(np, 0, INT64_MAX, &n) ||
        !tdm_parse_i64(step, 0, INT64_MAX, &s) || (size_t)n != t->n_params) {
        rc = tdm_err_set(TDM_EINVAL, "%s: not a checkpoint of a head of this shape", path);
        goto out;
    }
    for (int i = 0; i < n_check; i++) {
        const char *v = tdm_st_metadata(st, check[2 * i]);
        if (!v || strcmp(v, check[2 * i + 1])) {
            rc = tdm_err_set(TDM_EINVAL,
                             "%s: the checkpoint was made with %s %s, this run has %s; start "
                             "afresh or run with the checkpoint's settings",
                             path, check[2 * i], v ? v : "(none)", check[2 * i + 1]);
            goto out;
        }
    }
    const char *names[] = {"params", "adam_m", "adam_v"};
    float *dst[] = {t->params, t->adam_m, t->adam_v};
    for (int i = 0; i < 3; i++) {
        const struct tdm_tensor_info *ti = tdm_st_find_tensor(st, names[i]);
        if (!ti || ti->dtype != TDM_DTYPE_F32 || ti->nbytes != t->n_params * sizeof(float)) {
            rc = tdm_err_set(TDM_EFORMAT, "%s: %s is missing or the wrong size", path, names[i]);
            goto out;
        }
        memcpy(dst[i], ti->data, ti->nbytes);
    }
    const struct tdm_tensor_info *dv = tdm_st_find_tensor(st, "draft_vocab");
    if (!dv || dv->nbytes != (size_t)t->vd * sizeof(int32_t) ||
        memcmp(dv->data, t->d2t, dv->nbytes)) {
        rc = tdm_err_set(TDM_EINVAL, "%s: the checkpoint's draft vocabulary is not this run's",
                         path);
        goto out;
    }
    for (size_t i = 0; i < t->n_params; i++)
        if (!isfinite(t->params[i]) || !isfinite(t->adam_m[i]) || !(t->adam_v[i] >= 0)) {
            rc = tdm_err_set(TDM_EFORMAT, "%s: a value is not finite", path);
            goto out;
        }
    t->step = s;
out:
    tdm_st_close(st);
    return rc;
}
