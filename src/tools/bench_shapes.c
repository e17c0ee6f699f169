/*
 * Random-weight models of real shapes for `tandem bench model --shape` on the CPU: a
 * mixture-of-experts model's step reads its active experts, not all of them, so its speed
 * can be measured at the real widths with fewer layers and experts than the real model (which
 * would not fit a small machine). What is built is a struct tdm_model in memory, as the loader
 * would make it from the real checkpoint: the real config (as config.c reads it), with
 * n_layers and n_experts reduced when asked, and BF16 matrices (which the CPU kernels run
 * directly), F32 norms equal to 1, and MLA's absorbed matrices as F32 (as the loader makes
 * them).
 *
 * Shapes:
 *   qwen3-30b-a3b     Qwen3-30B-A3B: 48 layers of GQA (32 query, 4 KV heads of 128, q/k
 *                     norms) and 128 experts of 768, 8 a token, renormalised; 151,936 tokens.
 *   deepseek-v2-lite  DeepSeek-V2-Lite: 27 layers of MLA (16 heads, kv_lora 512, nope 128,
 *                     rope 64, v 128, no q LoRA), the first dense (10,944), then 64 experts of
 *                     1,408 (6 a token, softmax, not renormalised) and 2 shared; YaRN 40x.
 * Values: uniform in [-a, a] with a = sqrt(3) * 0.02 (HF's initializer_range), from a
 * splitmix64 stream per matrix, filled over the thread pool. The model owns every buffer
 * (tdm_model_free).
 *
 * Threading: single caller; the fill fans out over a pool of its own.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tools/tools_int.h"

struct shape_fill {
    uint16_t *dst; /* bf16 values, or (f32) NULL */
    float *f32;
    int64_t n;
    uint64_t seed;
};

static void fill_worker(void *ctx, int ith, int nth)
{
    const struct shape_fill *f = ctx;
    int64_t b, e;
    tdm_split_range(f->n, ith, nth, 4096, &b, &e);
    const float a = 0.0346410162f; /* sqrt(3) * 0.02 */
    for (int64_t i = b; i < e; i++) {
        uint64_t s = f->seed ^ (uint64_t)i * 0x2545f4914f6cdd1dull;
        float u = (float)(tdm_tool_splitmix64(&s) >> 40) / (float)(1 << 24); /* [0, 1) */
        float v = (2.0f * u - 1.0f) * a;
        uint32_t bits;
        memcpy(&bits, &v, 4);
        if (f->f32)
            f->f32[i] = v;
        else
            f->dst[i] = (uint16_t)(bits >> 16); /* the top half: a bf16 value */
    }
}

struct builder {
    struct tdm_model *m;
    tdm_pool_t *pool;
    uint64_t seed;
    bool failed;
};

static void *owned(struct builder *B, size_t bytes)
{
    void *p = NULL;
    if (!B->failed && tdm_model_alloc_owned(B->m, bytes, &p) != TDM_OK) B->failed = true;
    return p;
}

/* A random BF16 matrix of rows x cols. */
static struct tdm_weight mat(struct builder *B, int64_t rows, int64_t cols)
{
    size_t bytes = (size_t)rows * (size_t)cols * 2;
    uint16_t *p = owned(B, bytes);
    if (!p) return (struct tdm_weight){0};
    struct shape_fill f = {p, NULL, rows * cols, B->seed++ * 0x9e3779b97f4a7c15ull};
    tdm_pool_run(B->pool, fill_worker, &f);
    B->m->n_params += (uint64_t)(rows * cols);
    B->m->weight_bytes += bytes;
    return (struct tdm_weight){TDM_DTYPE_BF16, rows, cols, (size_t)cols * 2, p};
}

/* An F32 matrix (ones when `ones`, else random values). */
static struct tdm_weight f32(struct builder *B, int64_t rows, int64_t cols, bool ones)
{
    size_t n = (size_t)rows * (size_t)cols;
    float *p = owned(B, n * sizeof(float));
    if (!p) return (struct tdm_weight){0};
    if (ones) {
        for (size_t i = 0; i < n; i++)
            p[i] = 1.0f;
    } else {
        struct shape_fill f = {NULL, p, (int64_t)n, B->seed++ * 0x9e3779b97f4a7c15ull};
        tdm_pool_run(B->pool, fill_worker, &f);
    }
    B->m->weight_bytes += n * sizeof(float);
    return (struct tdm_weight){TDM_DTYPE_F32, rows, cols, (size_t)cols * sizeof(float), p};
}

static bool shape_config(const char *name, struct tdm_model_config *c)
{
    tdm_config_defaults(c);
    c->rms_eps = 1e-6f;
    c->d_model = 2048;
    if (!strcmp(name, "qwen3-30b-a3b")) {
        c->arch = TDM_ARCH_QWEN3;
        c->n_layers = 48;
        c->n_heads = 32;
        c->n_kv_heads = 4;
        c->head_dim = 128;
        c->d_ff = 6144;
        c->vocab_size = 151936;
        c->max_ctx = 40960;
        c->rope_theta = 1e6f;
        c->rope_neox = true;
        c->qk_norm = true;
        c->n_experts = 128;
        c->n_experts_used = 8;
        c->d_ff_expert = 768;
        c->moe_norm_topk = true;
        return true;
    }
    if (!strcmp(name, "deepseek-v2-lite")) {
        c->arch = TDM_ARCH_DEEPSEEK2;
        c->n_layers = 27;
        c->n_heads = 16;
        c->n_kv_heads = 1;
        c->kv_lora_rank = 512;
        c->qk_nope_dim = 128;
        c->qk_rope_dim = 64;
        c->v_head_dim = 128;
        c->head_dim = 512 + 64;
        c->d_ff = 10944;
        c->vocab_size = 102400;
        c->max_ctx = 163840;
        c->rope_theta = 10000.0f;
        c->rope_scaling = TDM_ROPE_SCALING_YARN;
        c->rope_factor = 40.0f;
        c->rope_original_max_ctx = 4096;
        c->rope_beta_fast = 32.0f;
        c->rope_beta_slow = 1.0f;
        double m = 0.1 * 0.707 * log(40.0) + 1.0;
        c->attn_scale = (float)(m * m);
        c->n_experts = 64;
        c->n_experts_used = 6;
        c->d_ff_expert = 1408;
        c->d_ff_shared = 2 * 1408;
        c->moe_dense_layers[0] = 1; /* first_k_dense_replace 1 */
        return true;
    }
    return false;
}

struct tdm_model *tdm_bench_shape_model(const char *name, int n_layers, int n_experts,
                                        int n_threads)
{
    struct tdm_model_config c;
    if (!shape_config(name, &c)) {
        fprintf(stderr, "tandem: unknown --shape '%s' (qwen3-30b-a3b, deepseek-v2-lite)\n", name);
        return NULL;
    }
    char label[160];
    snprintf(label, sizeof label, "random %s shape (%d of %d layers, %d of %d experts)", name,
             n_layers > 0 ? TDM_MIN(n_layers, c.n_layers) : c.n_layers, c.n_layers,
             n_experts > 0 ? TDM_MIN(n_experts, c.n_experts) : c.n_experts, c.n_experts);
    if (n_layers > 0) c.n_layers = TDM_MIN(n_layers, c.n_layers);
    if (n_experts > 0) c.n_experts = TDM_MIN(TDM_MAX(n_experts, c.n_experts_used), c.n_experts);
    struct tdm_model *m = calloc(1, sizeof *m);
    struct builder B = {.m = m, .seed = 1};
    if (!m || !(m->path = strdup(label)) ||
        !(m->layers = calloc((size_t)c.n_layers, sizeof *m->layers)) ||
        tdm_pool_create(n_threads, &B.pool) != TDM_OK) {
        fprintf(stderr, "tandem: out of memory for the %s shape\n", name);
        tdm_model_free(m);
        return NULL;
    }
    m->cfg = c;
    const int64_t d = c.d_model, H = c.n_heads;
    m->tok_embd = mat(&B, c.vocab_size, d);
    m->output = mat(&B, c.vocab_size, d);
    m->output_norm = f32(&B, 1, d, true);
    for (int l = 0; l < c.n_layers && !B.failed; l++) {
        struct tdm_layer_weights *w = &m->layers[l];
        w->attn_norm = f32(&B, 1, d, true);
        w->ffn_norm = f32(&B, 1, d, true);
        if (tdm_config_mla(&c)) {
            const int64_t lora = c.kv_lora_rank, rope = c.qk_rope_dim, qh = c.qk_nope_dim + rope;
            w->wq = mat(&B, H * qh, d);
            w->wkv_c = mat(&B, lora, d);
            w->wkv_r = mat(&B, rope, d);
            w->kv_a_norm = f32(&B, 1, lora, true);
            w->mla_absorb = f32(&B, H * (lora + rope), qh, false);
            w->mla_uv = f32(&B, H * c.v_head_dim, lora, false);
            w->wo = mat(&B, d, H * c.v_head_dim);
        } else {
            w->wq = mat(&B, H * c.head_dim, d);
            w->wk = mat(&B, (int64_t)c.n_kv_heads * c.head_dim, d);
            w->wv = mat(&B, (int64_t)c.n_kv_heads * c.head_dim, d);
            w->q_norm = f32(&B, 1, c.head_dim, true);
            w->k_norm = f32(&B, 1, c.head_dim, true);
            w->wo = mat(&B, d, H * c.head_dim);
        }
        if (!tdm_config_layer_sparse(&c, l)) {
            w->w_gate = mat(&B, c.d_ff, d);
            w->w_up = mat(&B, c.d_ff, d);
            w->w_down = mat(&B, d, c.d_ff);
            continue;
        }
        w->n_experts = c.n_experts;
        w->router = mat(&B, c.n_experts, d);
        w->experts = owned(&B, sizeof *w->experts * 3 * (size_t)c.n_experts);
        for (int e = 0; e < c.n_experts && w->experts; e++) {
            w->experts[3 * e] = mat(&B, c.d_ff_expert, d);
            w->experts[3 * e + 1] = mat(&B, c.d_ff_expert, d);
            w->experts[3 * e + 2] = mat(&B, d, c.d_ff_expert);
        }
        if (c.d_ff_shared) {
            w->sh_gate = mat(&B, c.d_ff_shared, d);
            w->sh_up = mat(&B, c.d_ff_shared, d);
            w->sh_down = mat(&B, d, c.d_ff_shared);
        }
    }
    tdm_pool_destroy(B.pool);
    if (B.failed) {
        fprintf(stderr, "tandem: out of memory for the %s shape\n", name);
        tdm_model_free(m);
        return NULL;
    }
    return m;
}
