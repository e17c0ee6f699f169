/*
 * `tandem bench model`: prompt and decode throughput of the engine on one model, each printed
 * next to the roofline measured in the same run.
 *
 * Roofline: decode at batch B reads every weight once per step plus the KV of B sequences
 * (DESIGN.md §6). The memory bandwidth comes from a STREAM-style copy over the same thread
 * count, so the bound is   rate <= B * bandwidth / (weight_bytes + B * kv_bytes_per_seq).
 * Mixture of experts: weight_bytes counts the dense weights (attention, routers, shared
 * experts) and, of the experts, only those the steps really ran (the engine counts expert
 * passes), so the roofline follows the routing instead of assuming every expert is read.
 * A checksum of the greedy tokens is printed so a fast wrong answer is visible.
 *
 * Model: --model PATH, or --shape NAME (bench_shapes.c: Qwen3-30B-A3B or DeepSeek-V2-Lite at
 * their real widths with random bf16 weights, --layers and --experts fewer than the real
 * model's so that it fits; a decode token reads its k experts whatever their count). MLA's KV
 * per position is its latent row (the pool's page bytes), not 2 x heads x head_dim.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tools/tools_int.h"

struct copy_job {
    float *dst;
    const float *src;
    int64_t n;
};

static void copy_worker(void *ctx, int ith, int nth)
{
    struct copy_job *j = ctx;
    int64_t b, e;
    tdm_split_range(j->n, ith, nth, 4096, &b, &e);
    if (e > b) memcpy(j->dst + b, j->src + b, (size_t)(e - b) * sizeof(float));
}

/* STREAM "copy" bandwidth in bytes/s (bytes read + bytes written), best of several runs. */
static double measure_copy_bandwidth(int n_threads)
{
    const int64_t n = (int64_t)64 << 20; /* 256 MiB per array */
    float *a = tdm_alloc_aligned((size_t)n * sizeof(float));
    float *b = tdm_alloc_aligned((size_t)n * sizeof(float));
    tdm_pool_t *pool = NULL;
    double best = 0.0;
    if (!a || !b || tdm_pool_create(n_threads, &pool) != TDM_OK) goto out;
    struct copy_job init = {a, b, n};
    for (int64_t i = 0; i < n; i++)
        b[i] = (float)(i & 1023);
    tdm_pool_run(pool, copy_worker, &init); /* first touch of a */
    for (int rep = 0; rep < 6; rep++) {
        struct copy_job j = {rep & 1 ? b : a, rep & 1 ? a : b, n};
        double t0 = tdm_now_s();
        tdm_pool_run(pool, copy_worker, &j);
        double dt = tdm_now_s() - t0;
        double bw = 2.0 * (double)n * sizeof(float) / dt;
        if (bw > best) best = bw;
    }
out:
    tdm_pool_destroy(pool);
    tdm_free_aligned(a);
    tdm_free_aligned(b);
    return best;
}

static size_t weight_bytes(const struct tdm_weight *w)
{
    return w->data ? w->row_bytes * (size_t)w->rows : 0;
}

/* Bytes one decode step reads from the weights: every matrix and vector once, and one row of
 * the embedding table. */
static double weight_bytes_per_step(const struct tdm_model *m)
{
    double total = (double)weight_bytes(&m->output) + (double)weight_bytes(&m->output_norm) +
                   (double)m->tok_embd.row_bytes;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct tdm_weight *ws[32];
        const int n = tdm_tool_layer_weights(&m->layers[l], ws);
        for (int i = 0; i < n; i++)
            total += (double)weight_bytes(ws[i]);
    }
    return total;
}

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

struct bench_seq {
    struct tdm_kv_seq kv;
    int32_t *tokens;
    int n;
};

static void bench_model_usage(FILE *f)
{
    fprintf(f,
            "usage: tandem bench model [--model PATH | --shape qwen3-30b-a3b|deepseek-v2-lite "
            "[--layers N] [--experts N]] [--threads N] [--prompt-len N] [--gen N] "
            "[--context N] [--batch-invariant] [--exact-activations] [--kv-dtype f32|bf16|f16] "
            "[--tp N] [--compare-llama-cpp PATH [--rounds N]]\n"
            "       (--tp N: N tensor-parallel ranks, measured after --tp 1 in the same run)\n"
            "       (--compare-llama-cpp PATH: llama.cpp's llama-bench binary at PATH run on the "
            "same GGUF,\n"
            "        interleaved with tandem for --rounds rounds (3), and the ratios of the "
            "medians)\n"
            "       tandem bench model --backend cuda --help   (the GPU benchmark)\n");
}

/* One engine's prefill and decode figures (the body of bench model): eo's engine over m, the
 * rooflines from bw, the figures also into *fig. Returns the exit code. */
static int bench_engine(struct tdm_model *m, const struct tdm_engine_opts *eo_in, double bw,
                        int64_t prompt_len, int64_t gen, int64_t context, int64_t ctx_needed,
                        struct tdm_bench_figures *fig)
{
    const struct tdm_model_config *cf = &m->cfg;
    enum { MAX_B = 8 };
    int rc = 1;
    struct tdm_engine_opts eo = *eo_in;
    tdm_engine_t *e = NULL;
    float *logits = malloc((size_t)MAX_B * cf->vocab_size * sizeof(float));
    struct bench_seq seqs[MAX_B];
    memset(seqs, 0, sizeof seqs);
    if (!logits || tdm_engine_create(m, &eo, &e) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out;
    }
    tdm_kv_pool_t *kv = tdm_engine_kv(e);
    for (int s = 0; s < MAX_B; s++) {
        seqs[s].tokens = malloc((size_t)ctx_needed * sizeof(int32_t));
        if (!seqs[s].tokens) goto out;
    }

    double wbytes = weight_bytes_per_step(m);
    const struct tdm_kv_geometry kg = tdm_kv_pool_geometry(kv);
    /* the whole model's KV a position (a sharded engine's leader pool holds its heads only) */
    double kv_per_pos = (double)kg.page_bytes / tdm_engine_opts(e)->page_size * cf->n_layers *
                        cf->n_kv_heads / tdm_kv_pool_config(kv)->n_kv_heads;
    printf("  KV cache: %s, %.0f KiB a position\n", tdm_dtype_name(kg.dtype), kv_per_pos / 1024);
    printf("  activations of Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices: %s\n",
           eo.exact_activations ? "fp32 (--exact-activations)" : "quantised (16-bit)");
    int n_sparse = 0;
    uint64_t one_expert = 0;
    tdm_tool_expert_bytes(m, &n_sparse, &one_expert);
    const double ebytes = (double)one_expert;
    if (ebytes > 0)
        printf("  weight bytes read per decode step: %.2f MB, and %.2f MB per expert pass "
               "(%d of %d experts a token, %d sparse layers)\n",
               wbytes / 1e6, ebytes / 1e6, cf->n_experts_used, cf->n_experts, n_sparse);
    else
        printf("  weight bytes read per decode step: %.2f MB\n", wbytes / 1e6);

    /* prefill: one prompt of prompt_len random tokens */
    uint64_t rng = 12345;
    for (int64_t i = 0; i < prompt_len; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        seqs[0].tokens[i] = (int32_t)((rng >> 33) % (uint64_t)cf->vocab_size);
    }
    if (tdm_kv_seq_reserve(kv, &seqs[0].kv, prompt_len) != TDM_OK) {
        tdm_tool_fail("kv");
        goto out;
    }
    double t0 = tdm_now_s();
    for (int64_t done = 0; done < prompt_len;) {
        int chunk = (int)TDM_MIN(prompt_len - done, 512);
        struct tdm_batch_seq bs = {.tokens = seqs[0].tokens + done,
                                   .n_tokens = chunk,
                                   .pos0 = (int)done,
                                   .pages = seqs[0].kv.pages,
                                   .n_pages = seqs[0].kv.n_pages,
                                   .n_logits = done + chunk == prompt_len};
        struct tdm_batch b = {&bs, 1};
        if (tdm_engine_forward(e, &b, logits, NULL) != TDM_OK) {
            tdm_tool_fail("prefill");
            goto out;
        }
        done += chunk;
    }
    double prefill_s = tdm_now_s() - t0;
    uint64_t checksum = (uint64_t)tdm_argmax(logits, cf->vocab_size);
    tdm_kv_seq_release(kv, &seqs[0].kv);
    printf("  prefill: %lld tokens in %.3f s = %.1f tokens/s\n", (long long)prompt_len, prefill_s,
           prompt_len / prefill_s);
    fig->prefill = prompt_len / prefill_s;

    printf("  %-8s %12s %14s %10s\n", "decode", "tokens/s", "roofline tok/s", "ratio");
    int batches[] = {1, MAX_B};
    for (size_t bi = 0; bi < TDM_ARRAY_LEN(batches); bi++) {
        int B = batches[bi];
        struct tdm_batch_seq bs[MAX_B];
        /* each sequence: `context` prompt tokens, then `gen` greedy steps */
        for (int s = 0; s < B; s++) {
            for (int64_t i = 0; i < context; i++)
                seqs[s].tokens[i] = (int32_t)((s * 977 + i * 31) % cf->vocab_size);
            seqs[s].n = (int)context;
            if (tdm_kv_seq_reserve(kv, &seqs[s].kv, context + gen) != TDM_OK) {
                tdm_tool_fail("kv");
                goto out;
            }
            /* the context in chunks of at most 512 tokens (the engine's batch), the last one
             * giving this sequence's logits row */
            for (int64_t done = 0; done < context;) {
                const int chunk = (int)TDM_MIN(context - done, 512);
                struct tdm_batch_seq one = {.tokens = seqs[s].tokens + done,
                                            .n_tokens = chunk,
                                            .pos0 = (int)done,
                                            .pages = seqs[s].kv.pages,
                                            .n_pages = seqs[s].kv.n_pages,
                                            .n_logits = done + chunk == context};
                struct tdm_batch b1 = {&one, 1};
                if (tdm_engine_forward(e, &b1, logits + (size_t)s * cf->vocab_size, NULL) !=
                    TDM_OK) {
                    tdm_tool_fail("decode prompt");
                    goto out;
                }
                done += chunk;
            }
            bs[s] = (struct tdm_batch_seq){
                .pages = seqs[s].kv.pages, .n_pages = seqs[s].kv.n_pages, .n_logits = 1};
        }
        struct tdm_batch b = {bs, B};
        double kv_read = 0.0;
        const uint64_t passes0 = tdm_engine_expert_passes(e);
        t0 = tdm_now_s();
        for (int64_t step = 0; step < gen; step++) {
            for (int s = 0; s < B; s++) {
                int32_t id = tdm_argmax(logits + (size_t)s * cf->vocab_size, cf->vocab_size);
                checksum = mix(checksum, (uint64_t)id);
                seqs[s].tokens[seqs[s].n] = id;
                bs[s].tokens = seqs[s].tokens + seqs[s].n;
                bs[s].n_tokens = 1;
                bs[s].pos0 = seqs[s].n;
                seqs[s].n++;
                kv_read += kv_per_pos * seqs[s].n;
            }
            if (tdm_engine_forward(e, &b, logits, NULL) != TDM_OK) {
                tdm_tool_fail("decode");
                goto out;
            }
        }
        double dt = tdm_now_s() - t0;
        double rate = (double)B * gen / dt;
        *(B == 1 ? &fig->decode1 : &fig->decode8) = rate;
        const double passes = (double)(tdm_engine_expert_passes(e) - passes0) / (double)gen;
        double bytes_per_step = wbytes + passes * ebytes + kv_read / gen;
        double roof = (double)B * bw / bytes_per_step;
        printf("  batch %-2d %12.1f %14.1f %9.0f%%", B, rate, roof, 100.0 * rate / roof);
        if (ebytes > 0)
            printf("   (%.1f expert passes a step: %.2f MB read a step)", passes,
                   bytes_per_step / 1e6);
        printf("\n");
        for (int s = 0; s < B; s++)
            tdm_kv_seq_release(kv, &seqs[s].kv);
    }
    struct tdm_kv_stats ks = tdm_kv_pool_stats(kv);
    printf("  kv pages after the run: %lld used of %lld\n", (long long)ks.used,
           (long long)ks.total);
    printf("  checksum of greedy tokens: %016llx\n", (unsigned long long)checksum);
    rc = 0;
out:
    for (int s = 0; s < MAX_B; s++) {
        if (e) tdm_kv_seq_release(tdm_engine_kv(e), &seqs[s].kv);
        free(seqs[s].tokens);
    }
    tdm_engine_destroy(e);
    free(logits);
    return rc;
}

static bool is_regular_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* bench_engine's arguments, for the comparison's rounds. */
struct bench_args {
    struct tdm_model *m;
    const struct tdm_engine_opts *eo;
    double bw;
    int64_t prompt_len, gen, context, ctx_needed;
};

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of n figures; NaN when any is NaN (a figure one side does not have). */
static double median(const double *v, int n)
{
    double s[100];
    for (int i = 0; i < n; i++) {
        if (isnan(v[i])) return NAN;
        s[i] = v[i];
    }
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

/* --compare-llama-cpp: `rounds` rounds of tandem and llama.cpp in turn (tandem first in odd
 * rounds, llama.cpp first in even ones, so that neither always runs on a machine the other
 * has just warmed or loaded), then the medians and their ratios. */
static int compare_llama(const struct bench_args *a, const char *llama, int threads, int rounds)
{
    struct tdm_bench_figures ours[100], theirs[100];
    printf("  compared with llama.cpp: %d rounds, each running both (tandem first in odd "
           "rounds)\n",
           rounds);
    tdm_llama_bench_commands(llama, a->m->path, threads, a->prompt_len, a->gen, a->context);
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < 2; k++) {
            if ((k == 0) == (r % 2 == 0)) {
                printf("  round %d, tandem:\n", r + 1);
                const int rc = bench_engine(a->m, a->eo, a->bw, a->prompt_len, a->gen, a->context,
                                            a->ctx_needed, &ours[r]);
                if (rc) return rc;
            } else {
                if (tdm_llama_bench_run(llama, a->m->path, threads, a->prompt_len, a->gen,
                                        a->context, &theirs[r]))
                    return 1;
                printf("  round %d, llama.cpp %s: prefill %.1f tokens/s, decode batch 1 %.1f, "
                       "batch 8 %.1f\n",
                       r + 1, theirs[r].build, theirs[r].prefill, theirs[r].decode1,
                       theirs[r].decode8);
            }
        }
    printf("  %-24s %10s %10s %20s\n", "median tokens/s", "tandem", "llama.cpp",
           "tandem / llama.cpp");
    char what[3][32];
    snprintf(what[0], sizeof what[0], "prefill, %lld tokens", (long long)a->prompt_len);
    snprintf(what[1], sizeof what[1], "decode, batch 1");
    snprintf(what[2], sizeof what[2], "decode, batch 8");
    for (int f = 0; f < 3; f++) {
        double o[100], t[100];
        for (int r = 0; r < rounds; r++) {
            o[r] = f == 0 ? ours[r].prefill : f == 1 ? ours[r].decode1 : ours[r].decode8;
            t[r] = f == 0 ? theirs[r].prefill : f == 1 ? theirs[r].decode1 : theirs[r].decode8;
        }
        const double mo = median(o, rounds), mt = median(t, rounds);
        if (isnan(mt))
            printf("  %-24s %10.1f %10s %20s\n", what[f], mo, "n/a", "n/a");
        else
            printf("  %-24s %10.1f %10.1f %19.2fx\n", what[f], mo, mt, mo / mt);
    }
    printf("  llama.cpp build: %s\n", theirs[0].build);
    return 0;
}

int tdm_cmd_bench(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "xfer")) return tdm_cmd_bench_xfer(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "serve")) return tdm_cmd_bench_serve(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "spec")) return tdm_cmd_bench_spec(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "grammar")) return tdm_cmd_bench_grammar(argc - 1, argv + 1);
    if (argc < 2 || strcmp(argv[1], "model") != 0) {
        fprintf(stderr,
                "usage: tandem bench model [--model PATH] [--threads N] "
                "[--prompt-len N] [--gen N] [--context N]\n"
                "       tandem bench model --backend cuda [--shape llama-3.1-8b|llama-3.2-1b "
                "| --model PATH] [--gpu-memory-fraction F] [--batches 1,8,64,256]\n"
                "       tandem bench serve --help\n"
                "       tandem bench grammar --help\n"
                "       tandem bench xfer --help\n");
        return 2;
    }
    for (int i = 2; i + 1 < argc; i++) /* the GPU benchmark has its own table and rooflines */
        if (!strcmp(argv[i], "--backend") && !strcmp(argv[i + 1], "cuda")) {
            for (int j = 2; j + 1 < argc; j++)
                if (!strcmp(argv[j], "--tp") &&
                    !tdm_tool_tp_check("tandem bench model", atoll(argv[j + 1]), TDM_BACKEND_CUDA))
                    return 2;
            return tdm_cmd_bench_model_cuda(argc, argv);
        } else if (!strcmp(argv[i], "--backend") && strcmp(argv[i + 1], "cpu")) {
            fprintf(stderr, "tandem: --backend is cpu or cuda\n");
            return 2;
        }
    const char *model = NULL, *shape = NULL;
    int64_t threads = 0, prompt_len = 512, gen = 64, context = 32, layers = 0, experts = 0;
    int64_t tp = 1, rounds = 0;
    const char *llama = NULL;
    bool batch_inv = false, exact_act = false;
    int backend_kind = TDM_BACKEND_CPU, kv_dtype = TDM_KV_DTYPE_AUTO;
    const struct tdm_opt own[] = {
        TDM_OPT_S("model", &model),
        TDM_OPT_S("shape", &shape),
        TDM_OPT_I("layers", &layers, 1, 1024),
        TDM_OPT_I("experts", &experts, 1, 1024),
        TDM_OPT_I("threads", &threads, 1, 1024),
        TDM_OPT_I("tp", &tp, 1, TDM_TP_MAX_RANKS),
        TDM_OPT_I("prompt-len", &prompt_len, 1, 1 << 20),
        TDM_OPT_I("gen", &gen, 1, 1 << 20),
        TDM_OPT_I("context", &context, 1, 1 << 20),
        TDM_OPT_B("batch-invariant", &batch_inv),
        TDM_OPT_B("exact-activations", &exact_act),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &backend_kind), /* cpu here */
        TDM_OPT_P("kv-dtype", tdm_tool_opt_kv_dtype, &kv_dtype),
        TDM_OPT_S("compare-llama-cpp", &llama),
        TDM_OPT_I("rounds", &rounds, 1, 100),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("bench model", argc - 1, argv + 1, tables, bench_model_usage);
    if (prc) return prc == 1 ? 0 : 2;
    if (shape && model) {
        fprintf(stderr, "tandem: give --model or --shape, not both\n");
        return 2;
    }
    if (!shape && (layers || experts)) {
        fprintf(stderr, "tandem: --layers and --experts go with --shape\n");
        return 2;
    }
    if (rounds && !llama) {
        fprintf(stderr, "tandem: --rounds goes with --compare-llama-cpp\n");
        return 2;
    }
    if (llama && (shape || tp > 1)) {
        fprintf(stderr, "tandem: --compare-llama-cpp runs one engine on a GGUF file: not with %s\n",
                shape ? "--shape" : "--tp");
        return 2;
    }
    if (llama && !tdm_llama_bench_check(llama)) return 2;
    int n_threads = threads > 0 ? (int)threads : tdm_cpu_count();
    const struct tdm_load_opts lo = tdm_tool_load_opts(TDM_BACKEND_CPU, false, exact_act);
    struct tdm_model *m = shape ? tdm_bench_shape_model(shape, (int)layers, (int)experts, n_threads)
                                : tdm_tool_load_model_opts(model, &lo);
    if (!m) return shape ? 2 : 1;
    if (llama && !is_regular_file(m->path)) {
        fprintf(stderr,
                "tandem: --compare-llama-cpp needs a GGUF file; %s is a checkpoint folder\n",
                m->path);
        tdm_model_free(m);
        return 2;
    }
    const struct tdm_model_config *cf = &m->cfg;
    enum { MAX_B = 8 };
    int rc = 0;
    int64_t ctx_needed = TDM_MAX(prompt_len, context + gen) + 1;
    struct tdm_engine_opts eo = {.n_threads = n_threads,
                                 .batch_invariant = batch_inv,
                                 .exact_activations = exact_act,
                                 .max_ctx = (int)TDM_MIN(ctx_needed, (int64_t)cf->max_ctx),
                                 .max_seqs = MAX_B,
                                 .max_logit_rows = MAX_B,
                                 .max_batch_tokens = 512,
                                 .kv_dtype = kv_dtype};
    if (ctx_needed > cf->max_ctx) {
        fprintf(stderr, "tandem: the benchmark needs %lld positions, the model has %d\n",
                (long long)ctx_needed, cf->max_ctx);
        tdm_model_free(m);
        return 2;
    }
    eo.kv_pages = (int64_t)MAX_B * ((ctx_needed + 15) / 16) + 8;
    printf("tandem bench model: %s\n", m->path);
    printf("  %d threads, CPU kernels: %s%s\n", n_threads, tdm_backend_cpu_isa(),
           tdm_backend_cpu_amx() ? " (batched quantised products on the AMX int8 tiles)" : "");
    double bw = measure_copy_bandwidth(n_threads);
    printf("  memory bandwidth (STREAM copy, same run): %.2f GB/s\n", bw / 1e9);
    struct tdm_bench_figures fig;
    if (llama) {
        const struct bench_args a = {m, &eo, bw, prompt_len, gen, context, ctx_needed};
        rc = compare_llama(&a, llama, n_threads, rounds ? (int)rounds : 3);
        tdm_model_free(m);
        return rc;
    }
    if (tp > 1) { /* the reference: the same model unsharded, in the same run */
        printf("  --tp 1 (the reference):\n");
        rc = bench_engine(m, &eo, bw, prompt_len, gen, context, ctx_needed, &fig);
        eo.tp = (int)tp;
        if (rc == 0)
            printf("  --tp %lld (%lld ranks of %d thread(s)):\n", (long long)tp, (long long)tp,
                   TDM_MAX(1, n_threads / (int)tp));
    }
    if (rc == 0) rc = bench_engine(m, &eo, bw, prompt_len, gen, context, ctx_needed, &fig);
    tdm_model_free(m);
    return rc;
}
