/*
 * `tandem bench model --backend cuda`: decode and prefill throughput of the engine on the CUDA
 * backend, each printed next to its roofline measured in the same run.
 *
 * Model: --model PATH loads a checkpoint; otherwise --shape (llama-3.1-8b, the default, or
 * llama-3.2-1b) builds that architecture with random bf16 weights made directly on the device
 * (no host copy, no download; the values do not change the timings). The mixture-of-experts and
 * latent-attention shapes (qwen3-30b-a3b, deepseek-v2-lite; --layers, --experts to shrink them)
 * are built in host memory by bench_shapes.c, bf16, and uploaded by the engine like a loaded
 * model. A sparse layer's routed experts count in a step's bytes as the engine ran them (its
 * expert passes), so the roofline follows the routing.
 *
 * Rooflines:
 *   decode at batch B:  B * copy_bw / (weight bytes read per step + B * KV bytes per sequence),
 *     copy_bw from cudaMemcpy device-to-device (bytes read + written per second), the weights
 *     counted once per step (every matrix and vector, one embedding row per token), the KV at
 *     the step's context (K and V, or MLA's latent rows, of every layer, as the pool stores them);
 *   prefill of T tokens: T * gemm_peak / FLOPs, gemm_peak from a cuBLASLt bf16 8192^3 GEMM and
 *     FLOPs = 2 * (matrix parameters per token, k routed experts) * T + (one query-key pair's
 *     attention FLOPs) * n_layers * T (T + 1) / 2 (causal scores and weighted sum), LM head for
 *     one row.
 * --verify K (issue 23, item 5): after each batch's decode steps, as many verification steps of
 * the same sequences, each a chain of K + 1 tokens with a logit row per token (what speculation
 * verifies), timed the same way; printed as its time against the one-token step's.
 * Decode steps run at context `--context` (1,024): the KV pages of positions [0, context) are
 * zero-filled rather than prefilled (timings do not depend on KV values; prefilling 256 x 1,024
 * tokens would cost minutes of device time). A step's time is its tdm_engine_forward call: the
 * GPU work and the copy of the logits to pinned host memory; the benchmark's own greedy argmax
 * on the host (the next tokens) is outside it.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/tools_int.h"

struct shape {
    const char *name;
    int n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab;
    float rope_theta, rope_factor;
    int rope_orig_ctx;
    bool tied;
};

static const struct shape SHAPES[] = {
    {"llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, 500000.0f, 8.0f, 8192, false},
    {"llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 500000.0f, 32.0f, 8192, true},
};

/* A model of `sh` with random device weights owned by the backend: matrices of type mt (bf16,
 * or GGUF blocks the device keeps), vectors f32. */
static tdm_status random_model(tdm_backend_t *b, const struct shape *sh, enum tdm_dtype mt,
                               struct tdm_model *m)
{
    memset(m, 0, sizeof *m);
    m->cfg = (struct tdm_model_config){.arch = TDM_ARCH_LLAMA,
                                       .n_layers = sh->n_layers,
                                       .d_model = sh->d_model,
                                       .n_heads = sh->n_heads,
                                       .n_kv_heads = sh->n_kv_heads,
                                       .head_dim = sh->head_dim,
                                       .d_ff = sh->d_ff,
                                       .vocab_size = sh->vocab,
                                       .max_ctx = 131072,
                                       .rms_eps = 1e-5f,
                                       .rope_theta = sh->rope_theta,
                                       .rope_neox = true,
                                       .rope_scaling = TDM_ROPE_SCALING_LLAMA3,
                                       .rope_factor = sh->rope_factor,
                                       .rope_low_freq_factor = 1.0f,
                                       .rope_high_freq_factor = 4.0f,
                                       .rope_original_max_ctx = sh->rope_orig_ctx,
                                       .tied_embeddings = sh->tied,
                                       .bos_id = -1};
    m->layers = calloc((size_t)sh->n_layers, sizeof *m->layers);
    if (!m->layers) return tdm_err_set(TDM_ENOMEM, "out of memory");
    uint64_t seed = 1;
    tdm_status st;
#define RW(dst, dt, r, c, lo, hi)                                                                  \
    if ((st = tdm_backend_cuda_random_weight(b, dt, r, c, seed++, lo, hi, &(dst))) != TDM_OK)      \
        return st;
    const int D = sh->d_model, qd = sh->n_heads * sh->head_dim, kvd = sh->n_kv_heads * sh->head_dim;
    const float a = 1.0f / sqrtf((float)D), af = 1.0f / sqrtf((float)sh->d_ff);
    RW(m->tok_embd, mt, sh->vocab, D, -1.0f, 1.0f);
    RW(m->output_norm, TDM_DTYPE_F32, 1, D, 0.9f, 1.1f);
    if (sh->tied) {
        m->output = m->tok_embd;
    } else {
        RW(m->output, mt, sh->vocab, D, -a, a);
    }
    for (int l = 0; l < sh->n_layers; l++) {
        struct tdm_layer_weights *w = &m->layers[l];
        RW(w->attn_norm, TDM_DTYPE_F32, 1, D, 0.9f, 1.1f);
        RW(w->ffn_norm, TDM_DTYPE_F32, 1, D, 0.9f, 1.1f);
        RW(w->wq, mt, qd, D, -a, a);
        RW(w->wk, mt, kvd, D, -a, a);
        RW(w->wv, mt, kvd, D, -a, a);
        RW(w->wo, mt, D, qd, -a, a);
        RW(w->w_gate, mt, sh->d_ff, D, -a, a);
        RW(w->w_up, mt, sh->d_ff, D, -a, a);
        RW(w->w_down, mt, D, sh->d_ff, -af, af);
    }
#undef RW
    m->path = strdup(sh->name);
    return TDM_OK;
}

/* bytes one decode step of B tokens reads from the weights (as the backend holds them), not
 * counting a sparse layer's routed experts (the caller adds the expert passes it ran) */
static double step_weight_bytes(tdm_backend_t *b, const struct tdm_model *m, int B)
{
    double t = tdm_backend_cuda_held_bytes(b, &m->tok_embd) / (double)m->tok_embd.rows * B;
    t += (double)tdm_backend_cuda_held_bytes(b, &m->output) + m->cfg.d_model * 4.0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct tdm_weight *ws[32];
        const int n = tdm_tool_layer_weights(&m->layers[l], ws);
        for (int i = 0; i < n; i++)
            if (ws[i]->data) t += (double)tdm_backend_cuda_held_bytes(b, ws[i]);
    }
    return t;
}

static bool opt_weights(const char *arg, void *dst)
{
    const struct {
        const char *name;
        enum tdm_dtype t;
    } k[] = {{"bf16", TDM_DTYPE_BF16}, {"q8_0", TDM_DTYPE_Q8_0}, {"q4_0", TDM_DTYPE_Q4_0},
             {"q4_1", TDM_DTYPE_Q4_1}, {"q4_k", TDM_DTYPE_Q4_K}, {"q6_k", TDM_DTYPE_Q6_K}};
    for (size_t i = 0; i < TDM_ARRAY_LEN(k); i++)
        if (!strcmp(arg, k[i].name)) {
            *(enum tdm_dtype *)dst = k[i].t;
            return true;
        }
    fprintf(stderr, "--weights: '%s' is not bf16, q8_0, q4_0, q4_1, q4_k or q6_k\n", arg);
    return false;
}

/* matrix parameters one token multiplies by (all layers, its routed experts included; not the
 * embedding or the LM head) */
static double layer_matrix_params(const struct tdm_model *m)
{
    const struct tdm_model_config *c = &m->cfg;
    double p = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const struct tdm_weight *ws[32];
        const int n = tdm_tool_layer_weights(&m->layers[l], ws);
        for (int i = 0; i < n; i++)
            if (ws[i]->data && ws[i]->rows > 1) p += (double)ws[i]->rows * (double)ws[i]->cols;
        if (m->layers[l].n_experts)
            p += 3.0 * c->n_experts_used * (double)c->d_ff_expert * c->d_model;
    }
    return p;
}

/* attention FLOPs of one query against one key, all heads of a layer: scores and weighted sum
 * (MLA in its absorbed form: scores over the latent and rope rows, values over the latent) */
static double attn_flops_per_pair(const struct tdm_model_config *c)
{
    if (tdm_config_mla(c))
        return 2.0 * c->n_heads * ((double)c->kv_lora_rank + c->qk_rope_dim + c->kv_lora_rank);
    return 4.0 * c->n_heads * c->head_dim;
}

static int cmp_d(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static struct {
    int v[8], n;
} g_batches = {{1, 8, 64, 256}, 4};

static bool opt_batches(const char *arg, void *dst)
{
    (void)dst;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    g_batches.n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t && g_batches.n < 8;
         t = strtok_r(NULL, ",", &save)) {
        int64_t v;
        if (!tdm_tool_int("batches", t, 1, 4096, &v)) return false;
        g_batches.v[g_batches.n++] = (int)v;
    }
    if (!g_batches.n) fprintf(stderr, "--batches: empty list\n");
    return g_batches.n > 0;
}

static void gpu_usage(FILE *f)
{
    fprintf(f, "usage: tandem bench model --backend cuda [--shape llama-3.1-8b|llama-3.2-1b | "
               "--shape qwen3-30b-a3b|deepseek-v2-lite [--layers N] [--experts N] |\n"
               "       --model PATH] [--prompt-len N] [--gen N] [--context N]\n"
               "       [--gpu-memory-fraction F] [--no-graphs] [--batches 1,8,64,256]\n"
               "       [--kv-dtype f32|bf16|f16] [--weights bf16|q8_0|q4_0|q4_1|q4_k|q6_k]\n"
               "       [--gpu-weights native|bf16] [--verify K] [--batch-invariant] [--tp N]\n"
               "  --weights T: the random shape's matrices (default bf16; the others stay in\n"
               "  their GGUF blocks on the device unless --gpu-weights bf16)\n"
               "  --tp N: N ranks, a GPU each over NCCL or sharing GPUs (with --model: the\n"
               "  ranks shard host weights); the decode roofline counts every GPU used\n");
}

int tdm_cmd_bench_model_cuda(int argc, char **argv)
{
    const char *model_path = NULL, *shape_name = "llama-3.1-8b";
    int64_t prompt_len = 4096, gen = 32, context = 1024;
    double frac = 0.9;
    bool no_graphs = false;
    int backend_kind = TDM_BACKEND_CUDA; /* why we are here */
    int kv_dtype = TDM_KV_DTYPE_AUTO;
    enum tdm_dtype wtype = TDM_DTYPE_BF16;
    int64_t verify_k = 0, layers = 0, experts = 0, tp = 1;
    bool gpu_bf16 = false, invariant = false, weights_set = false;
    g_batches.n = 4;
    const struct tdm_opt own[] = {
        TDM_OPT_S("model", &model_path),
        TDM_OPT_S("shape", &shape_name),
        TDM_OPT_I("prompt-len", &prompt_len, 1, 1 << 16),
        TDM_OPT_I("gen", &gen, 2, 4096),
        TDM_OPT_I("context", &context, 1, 1 << 17),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &backend_kind),
        TDM_OPT_F("gpu-memory-fraction", &frac, 0.05, 1.0),
        TDM_OPT_B("no-graphs", &no_graphs),
        TDM_OPT_P("batches", opt_batches, &g_batches),
        TDM_OPT_P("kv-dtype", tdm_tool_opt_kv_dtype, &kv_dtype),
        TDM_OPT_P("weights", opt_weights, &wtype),
        TDM_OPT_I("layers", &layers, 1, 1024),
        TDM_OPT_I("experts", &experts, 1, 1024),
        TDM_OPT_I("verify", &verify_k, 0, 16),
        TDM_OPT_B("batch-invariant", &invariant),
        TDM_OPT_P("gpu-weights", tdm_tool_opt_gpu_weights, &gpu_bf16),
        TDM_OPT_I("tp", &tp, 1, TDM_TP_MAX_RANKS),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("bench model --backend cuda", argc - 1, argv + 1, tables, gpu_usage);
    if (prc) return prc == 1 ? 0 : 2;
    int *batches = g_batches.v, n_batches = g_batches.n;
    const struct shape *sh = NULL;
    for (size_t i = 0; i < TDM_ARRAY_LEN(SHAPES); i++)
        if (!strcmp(shape_name, SHAPES[i].name)) sh = &SHAPES[i];
    weights_set = wtype != TDM_DTYPE_BF16;
    /* the MoE and MLA shapes (bench_shapes.c) are built in host memory, bf16, and uploaded */
    const bool host_shape = !model_path && !sh;
    if (host_shape && weights_set) {
        fprintf(stderr, "tandem: --weights goes with the llama shapes; --shape %s is bf16\n",
                shape_name);
        return 2;
    }
    if (tp > 1 && !model_path) {
        fprintf(stderr, "tandem: --tp with --backend cuda shards a loaded model: give --model "
                        "(random shapes live on one device)\n");
        return 2;
    }
    if ((layers || experts) && !host_shape) {
        fprintf(stderr, "tandem: --layers and --experts go with --shape qwen3-30b-a3b or "
                        "deepseek-v2-lite\n");
        return 2;
    }

    int rc = 1, max_b = 1;
    for (int i = 0; i < n_batches; i++)
        max_b = TDM_MAX(max_b, batches[i]);
    tdm_backend_t *b = NULL;
    struct tdm_model rm, *m = NULL;
    bool random = !model_path && sh;
    tdm_engine_t *e = NULL;
    float *logits = NULL;
    struct tdm_kv_seq *seqs = calloc((size_t)max_b, sizeof *seqs);
    const int vk = (int)verify_k + 1; /* tokens a sequence verifies at once */
    int32_t *toks = malloc((size_t)TDM_MAX(prompt_len, max_b * (vk + 1)) * sizeof(int32_t));
    struct tdm_batch_seq *bs = calloc((size_t)max_b, sizeof *bs);
    if (!seqs || !toks || !bs) goto out;

    struct tdm_backend_cuda_opts co = {.gpu_memory_fraction = frac,
                                       .no_graphs = no_graphs,
                                       .bf16_weights = gpu_bf16,
                                       .batch_invariant = invariant};
    if (tdm_backend_cuda_create(&co, &b) != TDM_OK) {
        tdm_tool_fail("bench");
        goto out;
    }
    char dev_name[256];
    size_t dev_mem = 0;
    tdm_backend_cuda_info(b, dev_name, sizeof dev_name, &dev_mem);
    if (host_shape) {
        m = tdm_bench_shape_model(shape_name, (int)layers, (int)experts, tdm_cpu_count());
        if (!m) goto out;
    } else if (random) {
        if (random_model(b, sh, wtype, &rm) != TDM_OK) {
            tdm_tool_fail("random weights");
            goto out;
        }
        m = &rm;
    } else {
        const struct tdm_load_opts lo = tdm_tool_load_opts(TDM_BACKEND_CUDA, gpu_bf16, false);
        m = tdm_tool_load_model_opts(model_path, &lo);
        if (!m) goto out;
    }
    const struct tdm_model_config *cf = &m->cfg;
    const int64_t ctx_needed = TDM_MAX(prompt_len, context + gen + vk + 8) + 1;
    struct tdm_engine_opts eo = {.max_ctx = (int)ctx_needed,
                                 .max_seqs = max_b,
                                 .max_logit_rows = max_b * vk,
                                 .max_batch_tokens = (int)TDM_MAX(prompt_len, max_b * vk),
                                 .kv_dtype = kv_dtype,
                                 .backend = b};
    int n_gpus = 1; /* the devices the ranks spread over: the roofline's bandwidth */
    if (tp > 1) {   /* the engine makes each rank's backend; b keeps the rooflines */
        eo.backend = NULL;
        eo.backend_kind = TDM_BACKEND_CUDA;
        eo.tp = (int)tp;
        eo.gpu_memory_fraction = frac;
        eo.gpu_bf16_weights = gpu_bf16;
        eo.gpu_no_graphs = no_graphs;
        eo.batch_invariant = invariant;
        n_gpus = (int)TDM_MIN(tp, (int64_t)tdm_cuda_device_count());
    }
    if (ctx_needed > cf->max_ctx && !random && !host_shape) {
        fprintf(stderr, "tandem: the benchmark needs %lld positions, the model has %d\n",
                (long long)ctx_needed, cf->max_ctx);
        goto out;
    }
    if (tdm_engine_create(m, &eo, &e) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out;
    }
    logits = tdm_backend_cuda_host_alloc(b, (size_t)max_b * vk * cf->vocab_size * sizeof(float));
    if (!logits) {
        tdm_tool_fail("pinned logits");
        goto out;
    }
    tdm_kv_pool_t *kv = tdm_engine_kv(e);

    double copy_bw = 0, gemm = 0;
    if (tdm_backend_cuda_measure(b, &copy_bw, &gemm) != TDM_OK) {
        tdm_tool_fail("roofline");
        goto out;
    }
    const struct tdm_kv_geometry kg = tdm_kv_pool_geometry(tdm_engine_kv(e));
    /* K and V (or MLA's latent rows) of every layer, one position, in every rank's pool (a
     * rank's KV heads; replica sets each read their own copy) */
    double kv_per_pos = 0;
    for (int r = 0; r < tdm_engine_tp_ranks(e); r++) {
        tdm_kv_pool_t *rkv = tdm_engine_rank_kv(e, r);
        kv_per_pos += (double)tdm_kv_pool_geometry(rkv).page_bytes /
                      tdm_kv_pool_config(rkv)->page_size * cf->n_layers;
    }
    int n_sparse = 0;
    uint64_t one_expert = 0;
    tdm_tool_expert_bytes(m, &n_sparse, &one_expert);
    printf("tandem bench model --backend cuda: %s%s%s%s\n", random ? sh->name : m->path,
           random ? " shape, random " : "", random ? tdm_dtype_name(wtype) : "",
           random ? " weights made on the device" : "");
    printf("  device: %s, %.1f GiB; graphs %s%s\n", dev_name, dev_mem / 1073741824.0,
           no_graphs ? "off"
           : tp > 1  ? "where the ranks' all-reduce allows (NCCL; the engine's log says)"
                     : "on",
           invariant ? "; batch-invariant" : "");
    if (tp > 1)
        printf("  --tp %lld over %d GPU(s): the decode roofline is %d GPU(s)' bandwidth\n",
               (long long)tp, n_gpus, n_gpus);
    printf("  copy bandwidth (cudaMemcpy D2D, read + written): %.0f GB/s\n", copy_bw / 1e9);
    printf("  bf16 GEMM peak (cuBLASLt, 8192^3, fp32 accumulate): %.0f TFLOP/s\n", gemm / 1e12);
    printf("  weights read per decode step: %.2f GB; KV (%s) %.0f KiB per position\n",
           step_weight_bytes(b, m, 1) / 1e9, tdm_dtype_name(kg.dtype), kv_per_pos / 1024);
    if (n_sparse)
        printf("  and %.2f MB per expert pass (%d of %d experts a token, %d sparse layers): "
               "a step's roofline counts the passes it ran\n",
               one_expert / 1e6, cf->n_experts_used, cf->n_experts, n_sparse);

    /* ---- prefill: one prompt of prompt_len tokens in one forward call ---- */
    uint64_t rng = 12345;
    for (int64_t i = 0; i < prompt_len; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        toks[i] = (int32_t)((rng >> 33) % (uint64_t)cf->vocab_size);
    }
    if (tdm_kv_seq_reserve(kv, &seqs[0], prompt_len) != TDM_OK) {
        tdm_tool_fail("kv");
        goto out;
    }
    double pt[4];
    for (int rep = 0; rep < 4; rep++) { /* rep 0 warms up */
        struct tdm_batch_seq s = {.tokens = toks,
                                  .n_tokens = (int)prompt_len,
                                  .pos0 = 0,
                                  .pages = seqs[0].pages,
                                  .n_pages = seqs[0].n_pages,
                                  .n_logits = 1};
        struct tdm_batch bt = {&s, 1};
        double t0 = tdm_now_s();
        if (tdm_engine_forward(e, &bt, logits, NULL) != TDM_OK) {
            tdm_tool_fail("prefill");
            goto out;
        }
        pt[rep] = tdm_now_s() - t0;
    }
    tdm_kv_seq_release(kv, &seqs[0]);
    qsort(pt + 1, 3, sizeof pt[0], cmp_d);
    const double T = (double)prompt_len;
    const double pf_flops = 2.0 * layer_matrix_params(m) * T + 2.0 * cf->d_model * cf->vocab_size +
                            attn_flops_per_pair(cf) * cf->n_layers * T * (T + 1) / 2;
    const double pf_rate = T / pt[2], pf_roof = T * gemm / pf_flops;
    const bool pf_finite = isfinite(logits[0]) && isfinite(logits[cf->vocab_size - 1]);

    /* ---- decode at each batch size ---- */
    printf("\n  %-9s %6s %8s %12s %15s %7s\n", "", "batch", "context", "tokens/s", "roofline tok/s",
           "ratio");
    printf("  %-9s %6d %8lld %12.0f %15.0f %6.1f%%  (%lld-token prompt; %.1f ms)\n", "prefill", 1,
           (long long)prompt_len, pf_rate, pf_roof, 100.0 * pf_rate / pf_roof,
           (long long)prompt_len, pt[2] * 1e3);
    bool all_finite = pf_finite;
    for (int bi = 0; bi < n_batches; bi++) {
        const int B = batches[bi];
        for (int s = 0; s < B; s++) {
            if (tdm_kv_seq_reserve(kv, &seqs[s], context + gen + vk + 4) != TDM_OK) {
                tdm_tool_fail("kv (lower the batch or raise --gpu-memory-fraction)");
                goto out;
            }
            toks[s] = (int32_t)((s * 977 + 13) % cf->vocab_size);
        }
        /* zero the context's KV: every page of every sequence, all layers, every rank's pool */
        for (int r = 0; r < tdm_engine_tp_ranks(e); r++) {
            tdm_kv_pool_t *rkv = tdm_engine_rank_kv(e, r);
            const struct tdm_kv_config *kc = tdm_kv_pool_config(rkv);
            if (tdm_backend_cuda_memset(b, tdm_kv_pool_layer(rkv, 0).base, 0,
                                        tdm_kv_page_bytes(kc) * (size_t)kc->n_pages *
                                            (size_t)kc->n_layers) != TDM_OK) {
                tdm_tool_fail("kv fill");
                goto out;
            }
        }
        double dt = 0, kv_bytes = 0;
        const int warm = 3;
        uint64_t passes0 = 0;
        for (int step = 0; step < warm + gen; step++) {
            for (int s = 0; s < B; s++)
                bs[s] = (struct tdm_batch_seq){.tokens = &toks[s],
                                               .n_tokens = 1,
                                               .pos0 = (int)context + step,
                                               .pages = seqs[s].pages,
                                               .n_pages = seqs[s].n_pages,
                                               .n_logits = 1};
            struct tdm_batch bt = {bs, B};
            const double t0 = tdm_now_s();
            if (tdm_engine_forward(e, &bt, logits, NULL) != TDM_OK) {
                tdm_tool_fail("decode");
                goto out;
            }
            if (step >= warm) dt += tdm_now_s() - t0;
            if (step >= warm) kv_bytes += kv_per_pos * (double)B * (double)(context + step + 1);
            if (step + 1 == warm) passes0 = tdm_engine_expert_passes(e);
            for (int s = 0; s < B; s++)
                toks[s] = tdm_argmax(logits + (size_t)s * cf->vocab_size, cf->vocab_size);
        }
        all_finite &= isfinite(logits[0]);
        const double rate = (double)B * gen / dt;
        const double passes = (double)(tdm_engine_expert_passes(e) - passes0) / (double)gen;
        const double bytes_per_step =
            step_weight_bytes(b, m, B) + kv_bytes / gen + passes * (double)one_expert;
        const double roof = (double)B * copy_bw * n_gpus / bytes_per_step;
        printf("  %-9s %6d %8lld %12.0f %15.0f %6.1f%%  (%.2f ms/step", "decode", B,
               (long long)context, rate, roof, 100.0 * rate / roof, 1e3 * dt / gen);
        if (n_sparse) printf("; %.1f expert passes a step", passes);
        printf(")\n");
        fflush(stdout);
        if (vk > 1) { /* verification steps: K + 1 chained tokens a sequence, every row's logits */
            double vt = 0;
            for (int step = 0; step < warm + gen; step++) {
                for (int s = 0; s < B; s++) {
                    for (int j = 0; j < vk; j++)
                        toks[B + s * vk + j] = (int32_t)((s * 131 + j * 7 + step) % cf->vocab_size);
                    bs[s] = (struct tdm_batch_seq){.tokens = &toks[B + s * vk],
                                                   .n_tokens = vk,
                                                   .pos0 = (int)context + gen,
                                                   .pages = seqs[s].pages,
                                                   .n_pages = seqs[s].n_pages,
                                                   .n_logits = vk};
                }
                struct tdm_batch bt = {bs, B};
                const double t0 = tdm_now_s();
                if (tdm_engine_forward(e, &bt, logits, NULL) != TDM_OK) {
                    tdm_tool_fail("verify");
                    goto out;
                }
                if (step >= warm) vt += tdm_now_s() - t0;
            }
            all_finite &= isfinite(logits[0]);
            printf("  %-9s %6d %8lld %12s %15s %7s  (%.2f ms/step, %.2fx the 1-token step)\n",
                   "verify", B, (long long)context, "", "", "", 1e3 * vt / gen, vt / dt);
            fflush(stdout);
        }
        for (int s = 0; s < B; s++)
            tdm_kv_seq_release(kv, &seqs[s]);
    }
    printf("\n  logits finite: %s\n", all_finite ? "yes" : "NO");
    rc = all_finite ? 0 : 1;
out:
    if (e && seqs)
        for (int s = 0; s < max_b; s++)
            tdm_kv_seq_release(tdm_engine_kv(e), &seqs[s]);
    tdm_engine_destroy(e);
    if (logits) tdm_backend_cuda_host_free(b, logits);
    if (random && m) {
        free(m->layers);
        free(m->path);
    } else if (m) { /* a loaded model or a host shape */
        tdm_model_free(m);
    }
    tdm_backend_destroy(b);
    free(seqs);
    free(toks);
    free(bs);
    return rc;
}
