/*
 * Private declarations shared by the `tandem` subcommands (src/tools/).
 *
 * Each subcommand is `int tdm_cmd_<name>(int argc, char **argv)` returning a process exit code:
 * 0 on success, 1 on a runtime failure, 2 on a usage error. Messages go to stderr; stdout is
 * reserved for the command's output (generated text, token ids, JSON).
 */
#ifndef TANDEM_TOOLS_INT_H
#define TANDEM_TOOLS_INT_H

#include <signal.h>
#include <stdio.h>

#include "tandem/engine.h"
#include "tandem/model.h"
#include "tandem/sample.h"
#include "tandem/sched.h"
#include "tandem/spec.h"
#include "tandem/tok.h"
#include "tandem/topo.h"
#include "tandem/tp.h"

int tdm_cmd_generate(int argc, char **argv);
int tdm_cmd_chat(int argc, char **argv);
int tdm_cmd_info(int argc, char **argv);
int tdm_cmd_bench(int argc, char **argv);
int tdm_cmd_bench_spec(int argc, char **argv);       /* bench_spec.c */
int tdm_cmd_bench_model_cuda(int argc, char **argv); /* bench_gpu.c: --backend cuda */
int tdm_cmd_bench_xfer(int argc, char **argv);       /* bench_xfer.c: transfer-engine bandwidth */
int tdm_cmd_bench_serve(int argc, char **argv);      /* bench_serve.c: HTTP load generator */
int tdm_cmd_bench_grammar(int argc, char **argv);    /* bench_grammar.c: structured output */
int tdm_cmd_serve(int argc, char **argv);            /* serve.c: the OpenAI-compatible server */
int tdm_cmd_router(int argc, char **argv);           /* router.c: one endpoint over serve nodes */
int tdm_cmd_checkpoint(int argc, char **argv); /* checkpoint.c: random-weight HF checkpoints */
int tdm_cmd_train_mtp(int argc, char **argv);  /* train_mtp.c: train a speculation head */
int tdm_cmd_topo(int argc, char **argv);       /* topo.c: where ranks would run */
/* topo.c: places n_ranks ranks on this machine (xml NULL) or an hwloc XML file; gpus: each
 * rank's GPU bus id or NULL. Prints the error and returns 1 on failure. */
int tdm_tool_place(const char *xml, int n_ranks, const char *const *gpus, struct tdm_placement *out,
                   bool *this_system);
/* topo.c, for serve: places n_ranks ranks (rank r on CUDA device cuda_device + r when cuda),
 * logs each, and gives the cores its transfer threads are pinned to in pin: `cpus` when given
 * (--transfer-cpus), else the leader's NUMA node's ("" when the topology is not this
 * machine's). Returns 1 (a warning printed, pin "") when the topology cannot be read. */
int tdm_tool_serve_placement(int n_ranks, bool cuda, int cuda_device, const char *cpus,
                             struct tdm_placement *out, char *pin, size_t pin_cap);
/* tandem_rank_placement_info, Prometheus text (malloc'd). */
char *tdm_tool_placement_metrics(const struct tdm_placement *p, int n_ranks);

/* Loads --model (or the default model), drawing a progress bar on stderr when it is a terminal.
 * On failure prints the reason and returns NULL. */
struct tdm_model *tdm_tool_load_model(const char *path);
struct tdm_model *tdm_tool_load_model_opts(const char *path, const struct tdm_load_opts *opts);
/* The load options for a model that runs on backend_kind: the K-quants (Q4_K, Q6_K) stay in
 * their blocks on CUDA (unless every matrix is to be dequantised to bf16) and on the CPU with
 * its default quantised activations (its integer tiles run them; with --exact-activations they
 * become F32, which the fp32 kernels stream). */
static inline struct tdm_load_opts tdm_tool_load_opts(int backend_kind, bool gpu_bf16,
                                                      bool exact_activations)
{
    return (struct tdm_load_opts){
        .keep_k_blocks = backend_kind == TDM_BACKEND_CUDA ? !gpu_bf16 : !exact_activations};
}
/* Bytes of every expert's weights (routed experts of the sparse layers, as held in memory);
 * *sparse: the sparse layers; *one: one expert's three matrices (0 without experts). */
uint64_t tdm_tool_expert_bytes(const struct tdm_model *m, int *sparse, uint64_t *one);
/* A layer's weights that every token reads: norms, attention (MLA's included), the dense MLP,
 * and a sparse layer's router and shared expert, not its routed experts. Pointers into w (those
 * a model lacks have no data); returns how many, at most 32. */
int tdm_tool_layer_weights(const struct tdm_layer_weights *w, const struct tdm_weight **out);
/* Loads the model's tokenizer: GGUF metadata, or tokenizer.json in the checkpoint folder.
 * Returns NULL (after printing why, unless quiet) when there is none. */
tdm_tok_t *tdm_tool_load_tokenizer(const struct tdm_model *m, bool quiet);
/* Parses "5,17,3" into a malloc'd array; false (after printing why) on junk or an empty list. */
bool tdm_tool_parse_ids(const char *s, int32_t **ids, int *n);
/* Prompt sets: one JSON string a line, blank lines skipped. Returns the number read into a
 * malloc'd array (free with tdm_tool_free_prompts), or -1 after printing why under `who`.
 * limit > 0: only the first `limit`. parse: from text in memory, `label` naming it. */
int tdm_tool_read_prompts(const char *who, const char *path, int limit, char ***out);
int tdm_tool_parse_prompts(const char *who, const char *label, const char *text, size_t len,
                           int limit, char ***out);
void tdm_tool_free_prompts(char **texts, int n);
/* Each prompt as a user message through the model's chat template (raw: as it is), encoded;
 * one malloc'd id array per prompt (free each, then both arrays). Prints why and returns
 * false when there is no template, or a prompt does not encode or is over max_len tokens. */
bool tdm_tool_encode_prompts(const char *who, const struct tdm_model *m, const tdm_tok_t *tok,
                             char *const *texts, int n, bool raw, int64_t max_len, int32_t ***ids,
                             int **n_ids);
/* Strict numeric option parsing: prints "--name: ..." and returns false on junk. */
bool tdm_tool_int(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out);
bool tdm_tool_float(const char *name, const char *s, double lo, double hi, double *out);
void tdm_tool_fail(const char *what);

/* ---- options as data (opts.c) ---- */
enum tdm_opt_kind {
    TDM_OPT_STR,   /* dst: const char ** */
    TDM_OPT_INT,   /* dst: int64_t *, checked against [lo, hi] */
    TDM_OPT_FLOAT, /* dst: double *, checked against [lo, hi] */
    TDM_OPT_FLAG,  /* dst: bool *, set; takes no value */
    TDM_OPT_FN,    /* fn(arg, dst) parses; it prints why when it returns false */
};
struct tdm_opt {
    const char *name; /* without the dashes; NULL ends a table */
    enum tdm_opt_kind kind;
    void *dst;
    double lo, hi;
    bool (*fn)(const char *arg, void *dst);
};
#define TDM_OPT_S(n, d)                                                                            \
    {                                                                                              \
        .name = (n), .kind = TDM_OPT_STR, .dst = (d)                                               \
    }
#define TDM_OPT_I(n, d, lo_, hi_)                                                                  \
    {                                                                                              \
        .name = (n), .kind = TDM_OPT_INT, .dst = (d), .lo = (lo_), .hi = (hi_)                     \
    }
#define TDM_OPT_F(n, d, lo_, hi_)                                                                  \
    {                                                                                              \
        .name = (n), .kind = TDM_OPT_FLOAT, .dst = (d), .lo = (lo_), .hi = (hi_)                   \
    }
#define TDM_OPT_B(n, d)                                                                            \
    {                                                                                              \
        .name = (n), .kind = TDM_OPT_FLAG, .dst = (d)                                              \
    }
#define TDM_OPT_P(n, f, d)                                                                         \
    {                                                                                              \
        .name = (n), .kind = TDM_OPT_FN, .dst = (d), .fn = (f)                                     \
    }
#define TDM_OPT_END                                                                                \
    {                                                                                              \
        .name = NULL                                                                               \
    }
/* Parses argv (argv[0] is the subcommand) against NULL-terminated list of tables, each ended
 * by an entry with a NULL name; --help prints usage to stdout. Returns 0 to go on, 1 after
 * --help (exit 0), 2 after a usage error was printed (exit 2). */
int tdm_tool_parse(const char *cmd, int argc, char **argv, const struct tdm_opt *const *tables,
                   void (*usage)(FILE *));
/* The options every HTTP-serving command shares (serve, router): --host, --port, --port-file,
 * --api-key, --max-body, --drain-timeout, and the connection limits. The caller sets the
 * defaults in h first. */
struct tdm_tool_http {
    const char *host, *port_file, *api_key;
    int64_t port, max_body, drain_s;
    int64_t max_connections, idle_timeout_s, header_timeout_ms, body_timeout_ms; /* 0: default */
    const char *tls_cert, *tls_key; /* PEM files (HTTPS) */
    const char *allowed_origins;    /* CORS */
};
#define TDM_TOOL_HTTP_OPTS 14 /* entries of the table, its end included */
/* The usage lines of those options. */
#define TDM_TOOL_HTTP_USAGE                                                                        \
    "  --max-connections N     open client connections at most (serve 10000, router 1024)\n"       \
    "  --idle-timeout S        an idle connection is closed after S s (serve 30, router 600)\n"    \
    "  --header-timeout-ms N   a request's headers must arrive within N ms (10000)\n"              \
    "  --body-timeout-ms N     and its body within N ms after them (30000)\n"                      \
    "  --tls-cert FILE         serve HTTPS with this PEM certificate (chain)...\n"                 \
    "  --tls-key FILE          ...and its PEM private key\n"                                       \
    "  --allowed-origins LIST  CORS: browsers on these origins (comma-separated, or *) may\n"      \
    "                          call the API; preflights are answered (default: none)\n"
void tdm_tool_http_table(struct tdm_tool_http *h, struct tdm_opt out[TDM_TOOL_HTTP_OPTS]);
/* --tls-cert/--tls-key: both or neither; reads the PEM text into *cert and *key (NULL, NULL for
 * plain HTTP). Prints why and returns false on a missing, unreadable or non-PEM file. */
bool tdm_tool_http_tls(const char *cmd, const struct tdm_tool_http *h, char **cert, char **key);
void tdm_tool_http_tls_free(char *cert, char *key); /* wipes the key */
/* --backend cpu|cuda into an int (enum tdm_backend_kind). */
bool tdm_tool_opt_backend(const char *arg, void *dst);
/* --tp N (tensor-parallel ranks in this process, tdm_engine_opts.tp): the usage line, and the
 * check of what this build refuses before the model is loaded (another backend than the CPU);
 * prints why under `who` and returns false. */
#define TDM_TOOL_TP_USAGE                                                                          \
    "  --tp N                  tensor parallelism: N ranks in this process, each with its\n"       \
    "                          shard of the heads and MLP (cpu: a thread group each; cuda:\n"      \
    "                          a GPU each over NCCL, or ranks sharing GPUs; default 1)\n"
bool tdm_tool_tp_check(const char *who, int64_t tp, int backend_kind);
/* --kv-dtype f32|bf16|f16 into an int (enum tdm_kv_dtype; left at AUTO when not given). */
bool tdm_tool_opt_kv_dtype(const char *arg, void *dst);
/* --gpu-weights native|bf16 into a bool (true: bf16) */
bool tdm_tool_opt_gpu_weights(const char *arg, void *dst);
#define TDM_TOOL_GPU_WEIGHTS_USAGE                                                                 \
    "  --gpu-weights native|bf16 CUDA: keep Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices in their blocks\n"   \
    "                          (native, the default) or dequantise them to bf16 at load\n"
#define TDM_TOOL_EXACT_ACTIVATIONS_USAGE                                                           \
    "  --exact-activations     cpu: Q8_0/Q4_0/Q4_1 matrices take fp32 activations (within 1e-4\n"  \
    "                          of an fp32 reference) instead of 16-bit integers (the default)\n"
#define TDM_TOOL_KV_DTYPE_USAGE                                                                    \
    "  --kv-dtype T            KV cache element type: f32, bf16 or f16 (default: bf16 on\n"        \
    "                          cuda, f32 on the cpu)\n"
/* The speculation options that generate, serve and bench share: --spec, --spec-draft,
 * --spec-self-layers, --spec-k, --spec-accept, and eagle's --spec-tree-budget, -topk, -depth. */
struct tdm_tool_spec {
    const char *method, *draft, *k, *accept;
    int64_t self_layers;
    int64_t tree_budget, tree_topk, tree_depth;
    bool overlap;
};
#define TDM_TOOL_SPEC_OPTS 10 /* entries of the table, its end included */
void tdm_tool_spec_table(struct tdm_tool_spec *c, struct tdm_opt out[TDM_TOOL_SPEC_OPTS]);
void tdm_tool_spec_usage(FILE *f); /* their usage lines */
/* Turns the parsed strings into options. *on is false for --spec none or --spec-k 0. Prints
 * why and returns false on a bad value or a combination that makes no sense. */
bool tdm_tool_spec_opts(const struct tdm_tool_spec *c, struct tdm_spec_opts *o, bool *on);
/* --spec draft: loads the draft checkpoint (o->draft_path), checks its vocabulary against the
 * target's, and gives the target's engine options its KV layer group (stored in *g); sets
 * o->draft_model and *draft (free it after the engines). A no-op for other methods. Prints why
 * and returns false on failure. */
bool tdm_tool_spec_load_draft(const char *who, struct tdm_spec_opts *o,
                              const struct tdm_model *target, struct tdm_engine_opts *eo,
                              struct tdm_kv_group *g, struct tdm_model **draft);
/* Creates the drafter for an engine and installs it on the scheduler; prints what it is under
 * `who` ("tandem serve"). NULL after printing why. */
tdm_spec_t *tdm_tool_spec_attach(const char *who, const struct tdm_spec_opts *o, tdm_engine_t *e,
                                 tdm_sched_t *s);
/* Blocks SIGTERM and SIGINT in the calling thread (call before any thread starts, so that all
 * inherit the mask; the main thread then takes them with sigwait) and ignores SIGPIPE. Returns
 * the set to wait on. */
sigset_t tdm_tool_block_shutdown_signals(void);
/* Writes `text` and a newline to path through a temporary file and a rename, so a reader (a
 * script waiting for a --port-file) never sees a partial file; prints why and returns false on
 * failure. */
bool tdm_tool_write_file_atomic(const char *path,
                                const char *text); /* prints "tandem: what: <tdm_err_msg()>" */

/* splitmix64: the next value of the stream *state (random weights of checkpoint and shapes). */
static inline uint64_t tdm_tool_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A random-weight model of a named real shape (bench_shapes.c), n_layers and n_experts
 * reduced when > 0; NULL (with a message) for an unknown name or no memory. */
struct tdm_model *tdm_bench_shape_model(const char *name, int n_layers, int n_experts,
                                        int n_threads);

/* One run's figures of `tandem bench model` (tokens/s; NaN where there is none), and for
 * llama.cpp the build its llama-bench reported. */
struct tdm_bench_figures {
    double prefill, decode1, decode8;
    char build[96];
};
/* bench_llama.c: llama.cpp's side of --compare-llama-cpp. check: whether path is an executable
 * file (false after printing why); commands: prints the commands run gives; run: llama-bench
 * (prefill, batch 1) and llama-batched-bench when it lies beside it (batch 8) on model, returns
 * 0, or 1 after printing why. */
bool tdm_llama_bench_check(const char *path);
void tdm_llama_bench_commands(const char *bench, const char *model, int threads, int64_t prompt_len,
                              int64_t gen, int64_t context);
int tdm_llama_bench_run(const char *bench, const char *model, int threads, int64_t prompt_len,
                        int64_t gen, int64_t context, struct tdm_bench_figures *out);

#endif
