/*
 * One table-driven parser for the subcommands' options, the table of the options that every
 * HTTP-serving command shares (`tandem serve` and `tandem router`), and their shutdown-signal
 * set-up. A command lists its options
 * as data (name, kind, where the value goes, its range); the parser builds getopt_long's table
 * from them, checks each value, and reports errors in one format:
 *   "tandem CMD: unknown or incomplete option 'X'" (then the usage on stderr), or the value
 *   checker's "--name: ..." line. Main thread only.
 */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/server.h"
#include "tools/tools_int.h"

#define MAX_OPTS 96

void tdm_tool_http_table(struct tdm_tool_http *h, struct tdm_opt out[TDM_TOOL_HTTP_OPTS])
{
    struct tdm_opt t[TDM_TOOL_HTTP_OPTS] = {
        TDM_OPT_S("host", &h->host),
        TDM_OPT_I("port", &h->port, 0, 65535),
        TDM_OPT_S("port-file", &h->port_file),
        TDM_OPT_S("api-key", &h->api_key),
        TDM_OPT_I("max-body", &h->max_body, 1024, 1 << 30),
        TDM_OPT_I("drain-timeout", &h->drain_s, 0, 3600),
        TDM_OPT_I("max-connections", &h->max_connections, 1, 1 << 20),
        TDM_OPT_I("idle-timeout", &h->idle_timeout_s, 1, 86400),
        TDM_OPT_I("header-timeout-ms", &h->header_timeout_ms, 10, 3600000),
        TDM_OPT_I("body-timeout-ms", &h->body_timeout_ms, 10, 3600000),
        TDM_OPT_S("tls-cert", &h->tls_cert),
        TDM_OPT_S("tls-key", &h->tls_key),
        TDM_OPT_S("allowed-origins", &h->allowed_origins),
        TDM_OPT_END,
    };
    memcpy(out, t, sizeof t);
}

/* A whole PEM file, NUL-terminated, at most 1 MiB. */
static char *read_pem(const char *cmd, const char *opt, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "tandem %s: --%s %s: %s\n", cmd, opt, path, strerror(errno));
        return NULL;
    }
    size_t cap = (1u << 20) + 1, n = 0;
    char *buf = malloc(cap);
    if (buf) n = fread(buf, 1, cap - 1, f);
    bool err = ferror(f), more = buf && n == cap - 1 && fgetc(f) != EOF;
    fclose(f);
    if (!buf || err || more || n == 0 || memchr(buf, '\0', n) ||
        !memmem(buf, n, "-----BEGIN ", 11)) {
        fprintf(stderr, "tandem %s: --%s %s: %s\n", cmd, opt, path,
                !buf   ? "out of memory"
                : err  ? "cannot be read"
                : more ? "over 1 MiB"
                       : "not a PEM file (no -----BEGIN line)");
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    return buf;
}

bool tdm_tool_http_tls(const char *cmd, const struct tdm_tool_http *h, char **cert, char **key)
{
    *cert = *key = NULL;
    if (!h->tls_cert && !h->tls_key) return true;
    if (!h->tls_cert || !h->tls_key) {
        fprintf(stderr, "tandem %s: --tls-cert and --tls-key go together\n", cmd);
        return false;
    }
    struct stat sb;
    if (stat(h->tls_key, &sb) == 0 && (sb.st_mode & (S_IRWXG | S_IRWXO)))
        fprintf(stderr,
                "tandem %s: warning: --tls-key %s can be read by other users (chmod 600 it)\n", cmd,
                h->tls_key);
    if (!(*cert = read_pem(cmd, "tls-cert", h->tls_cert))) return false;
    if (!(*key = read_pem(cmd, "tls-key", h->tls_key))) {
        free(*cert);
        *cert = NULL;
        return false;
    }
    return true;
}

void tdm_tool_http_tls_free(char *cert, char *key)
{
    free(cert);
    if (key) {
        explicit_bzero(key, strlen(key));
        free(key);
    }
}

static bool set_value(const struct tdm_opt *o, const char *arg)
{
    const char *name = o->name;
    switch (o->kind) {
    case TDM_OPT_STR:
        *(const char **)o->dst = arg;
        return true;
    case TDM_OPT_INT:
        return tdm_tool_int(name, arg, (int64_t)o->lo, (int64_t)o->hi, (int64_t *)o->dst);
    case TDM_OPT_FLOAT:
        return tdm_tool_float(name, arg, o->lo, o->hi, (double *)o->dst);
    case TDM_OPT_FLAG:
        *(bool *)o->dst = true;
        return true;
    case TDM_OPT_FN:
        return o->fn(arg, o->dst);
    }
    return false;
}

int tdm_tool_parse(const char *cmd, int argc, char **argv, const struct tdm_opt *const *tables,
                   void (*usage)(FILE *))
{
    const struct tdm_opt *flat[MAX_OPTS];
    struct option lo[MAX_OPTS + 2];
    int n = 0;
    for (int t = 0; tables[t]; t++)
        for (const struct tdm_opt *o = tables[t]; o->name; o++) {
            if (n == MAX_OPTS) {
                fprintf(stderr, "tandem %s: too many options for the parser\n", cmd);
                return 2;
            }
            flat[n] = o;
            lo[n] = (struct option){
                o->name, o->kind == TDM_OPT_FLAG ? no_argument : required_argument, NULL, 256 + n};
            n++;
        }
    lo[n++] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n] = (struct option){0, 0, 0, 0};
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'h') {
            usage(stdout);
            return 1;
        }
        if (c < 256 || c >= 256 + n) {
            fprintf(stderr, "tandem %s: unknown or incomplete option '%s'\n", cmd,
                    argv[optind - 1]);
            usage(stderr);
            return 2;
        }
        if (!set_value(flat[c - 256], optarg)) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tandem %s: unexpected argument '%s'\n", cmd, argv[optind]);
        return 2;
    }
    return 0;
}

sigset_t tdm_tool_block_shutdown_signals(void)
{
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    return sigs;
}

bool tdm_tool_opt_backend(const char *arg, void *dst)
{
    if (!strcmp(arg, "cuda") || !strcmp(arg, "cpu")) {
        *(int *)dst = !strcmp(arg, "cuda") ? TDM_BACKEND_CUDA : TDM_BACKEND_CPU;
        return true;
    }
    fprintf(stderr, "--backend: '%s' is not cpu or cuda\n", arg);
    return false;
}

bool tdm_tool_opt_gpu_weights(const char *arg, void *dst)
{
    if (!strcmp(arg, "native") || !strcmp(arg, "bf16")) {
        *(bool *)dst = !strcmp(arg, "bf16");
        return true;
    }
    fprintf(stderr, "--gpu-weights: '%s' is not native or bf16\n", arg);
    return false;
}

bool tdm_tool_opt_kv_dtype(const char *arg, void *dst)
{
    enum tdm_kv_dtype t;
    if (tdm_kv_dtype_parse(arg, &t) && t != TDM_KV_DTYPE_AUTO) {
        *(int *)dst = (int)t;
        return true;
    }
    fprintf(stderr, "--kv-dtype: '%s' is not f32, bf16 or f16\n", arg);
    return false;
}

/* ---- speculation ---- */
void tdm_tool_spec_usage(FILE *f)
{
    fprintf(f,
            "speculative decoding:\n"
            "  --spec none|draft|self|mtp|eagle  the drafter (default none)\n"
            "  --spec-draft PATH       the draft checkpoint (draft) or head (mtp, eagle;\n"
            "                          default: the model's own MTP layer (DeepSeek-V3), else\n"
            "                          the target's head beside it, MODEL.mtp.safetensors)\n"
            "  --spec-self-layers N    self: the target's first N layers draft (default: a "
            "quarter;\n"
            "                          all of them is the model drafting for itself)\n"
            "  --spec-k auto|K         drafts per step: auto (adaptive, at most %d) or exactly "
            "K; 0 is off\n"
            "  --spec-accept exact|rejection  exact keeps the output bit-identical (default);\n"
            "                          rejection: speculative sampling (eagle: multi-draft)\n"
            "  --spec-tree-budget N    eagle: drafted tokens a tree keeps (1 .. %d, default %d)\n"
            "  --spec-tree-topk K      eagle: children per node, nodes expanded per depth\n"
            "                          (1 .. %d, default %d)\n"
            "  --spec-tree-depth D     eagle: the deepest drafts (1 .. %d, default %d; with\n"
            "                          --spec-k K fixed, at most K, and drafting every step)\n"
            "  --spec-overlap          mtp: the seed's single-token schedule: the head runs\n"
            "                          over every verified row while the step commits, and\n"
            "                          the next step drafts from the row acceptance ended on\n",
            TDM_SPEC_AUTO_K, TDM_TREE_MAX_NODES, TDM_SPEC_TREE_BUDGET, TDM_SAMPLE_MAX_CAND,
            TDM_SPEC_TREE_TOPK, TDM_SPEC_MAX_K, TDM_SPEC_TREE_DEPTH);
}
void tdm_tool_spec_table(struct tdm_tool_spec *c, struct tdm_opt out[TDM_TOOL_SPEC_OPTS])
{
    struct tdm_opt t[TDM_TOOL_SPEC_OPTS] = {
        TDM_OPT_S("spec", &c->method),
        TDM_OPT_S("spec-draft", &c->draft),
        TDM_OPT_I("spec-self-layers", &c->self_layers, 1, 1 << 16),
        TDM_OPT_S("spec-k", &c->k),
        TDM_OPT_S("spec-accept", &c->accept),
        TDM_OPT_I("spec-tree-budget", &c->tree_budget, 1, TDM_TREE_MAX_NODES),
        TDM_OPT_I("spec-tree-topk", &c->tree_topk, 1, TDM_SAMPLE_MAX_CAND),
        TDM_OPT_I("spec-tree-depth", &c->tree_depth, 1, TDM_SPEC_MAX_K),
        TDM_OPT_B("spec-overlap", &c->overlap),
        TDM_OPT_END,
    };
    memcpy(out, t, sizeof t);
}

bool tdm_tool_spec_opts(const struct tdm_tool_spec *c, struct tdm_spec_opts *o, bool *on)
{
    *o = (struct tdm_spec_opts){.method = TDM_SPEC_NONE};
    *on = false;
    bool off = false;
    if ((c->method && tdm_spec_method_parse(c->method, &o->method) != TDM_OK) ||
        (c->accept && tdm_spec_accept_parse(c->accept, &o->accept) != TDM_OK) ||
        (c->k && tdm_spec_k_parse(c->k, &o->k, &off) != TDM_OK)) {
        fprintf(stderr, "%s\n", tdm_err_msg());
        return false;
    }
    const bool tree_given = c->tree_budget || c->tree_topk || c->tree_depth;
    bool given = c->draft || c->self_layers || c->k || c->accept || tree_given || c->overlap;
    if (o->method == TDM_SPEC_NONE) {
        if (given && c->method) {
            fprintf(stderr, "--spec none takes no other --spec-* option\n");
            return false;
        }
        if (given) {
            fprintf(stderr, "the --spec-* options need --spec (draft, self, mtp or eagle)\n");
            return false;
        }
        return true;
    }
    if (c->self_layers && o->method != TDM_SPEC_SELF) {
        fprintf(stderr, "--spec-self-layers is for --spec self\n");
        return false;
    }
    bool needs_path = o->method == TDM_SPEC_DRAFT;
    if (needs_path && !c->draft) {
        fprintf(stderr, "--spec %s needs --spec-draft PATH\n", tdm_spec_method_name(o->method));
        return false;
    }
    if (o->method == TDM_SPEC_SELF && c->draft) {
        fprintf(stderr, "--spec-draft is for --spec draft, mtp or eagle\n");
        return false;
    }
    if (c->overlap && o->method != TDM_SPEC_MTP) {
        fprintf(stderr, "--spec-overlap is for --spec mtp\n");
        return false;
    }
    if (tree_given && o->method != TDM_SPEC_EAGLE) {
        fprintf(stderr, "--spec-tree-budget, -topk and -depth are for --spec eagle\n");
        return false;
    }
    o->draft_path = c->draft;
    o->self_layers = (int)c->self_layers;
    o->tree_budget = (int)c->tree_budget;
    o->tree_topk = (int)c->tree_topk;
    o->tree_depth = (int)c->tree_depth;
    o->overlap = c->overlap;
    *on = !off;
    return true;
}

tdm_spec_t *tdm_tool_spec_attach(const char *who, const struct tdm_spec_opts *o, tdm_engine_t *e,
                                 tdm_sched_t *s)
{
    tdm_spec_t *sp = NULL;
    if (tdm_spec_create(e, o, &sp) != TDM_OK) {
        fprintf(stderr, "%s: speculation: %s\n", who, tdm_err_msg());
        return NULL;
    }
    if (tdm_spec_attach(sp, s) != TDM_OK) {
        fprintf(stderr, "%s: speculation: %s\n", who, tdm_err_msg());
        tdm_spec_destroy(sp);
        return NULL;
    }
    char d[160];
    tdm_spec_describe(sp, d, sizeof d);
    fprintf(stderr, "%s: speculation: %s\n", who, d);
    return sp;
}

bool tdm_tool_spec_load_draft(const char *who, struct tdm_spec_opts *o,
                              const struct tdm_model *target, struct tdm_engine_opts *eo,
                              struct tdm_kv_group *g, struct tdm_model **draft)
{
    *draft = NULL;
    if (o->method == TDM_SPEC_MTP || o->method == TDM_SPEC_EAGLE) {
        char def[4096];
        const char *path = o->draft_path;
        if (!path && target->cfg.n_mtp_layers > 0 && !target->is_gguf) {
            path = target->path; /* DeepSeek-V3's own MTP layer, in the model's files */
        } else if (!path) {
            if (!tdm_default_head_path(target->path, def, sizeof def)) {
                fprintf(stderr, "%s: --spec %s: no head path for %s; give --spec-draft\n", who,
                        tdm_spec_method_name(o->method), target->path);
                return false;
            }
            path = def;
        }
        struct tdm_model *h = NULL;
        if (tdm_head_load(path, target, &h) != TDM_OK) {
            fprintf(stderr, "%s: --spec %s: %s%s\n", who, tdm_spec_method_name(o->method),
                    tdm_err_msg(),
                    o->draft_path || path == target->path
                        ? ""
                        : " (the target's default head; train one with tandem "
                          "train-mtp, or give --spec-draft)");
            return false;
        }
        o->draft_model = h;
        tdm_spec_engine_opts(o, target, g, eo);
        *draft = h;
        return true;
    }
    if (o->method != TDM_SPEC_DRAFT) {
        tdm_spec_engine_opts(o, target, g, eo); /* rejection's distributions */
        return true;
    }
    struct tdm_model *d = tdm_tool_load_model(o->draft_path);
    if (!d) return false;
    if (d->cfg.vocab_size != target->cfg.vocab_size) {
        fprintf(stderr,
                "%s: the draft %s has a vocabulary of %d tokens, the target %d: a draft must "
                "share the target's tokenizer\n",
                who, o->draft_path, d->cfg.vocab_size, target->cfg.vocab_size);
        tdm_model_free(d);
        return false;
    }
    o->draft_model = d;
    tdm_spec_engine_opts(o, target, g, eo);
    *draft = d;
    return true;
}

bool tdm_tool_tp_check(const char *who, int64_t tp, int backend_kind)
{
    if (tp <= 1 || backend_kind == TDM_BACKEND_CPU) return true;
    const int n_dev = tdm_cuda_device_count();
    if (n_dev >= 1) return true; /* a GPU a rank with NCCL, else ranks sharing GPUs (backend.h) */
    fprintf(stderr,
            "%s: --tp %lld --backend cuda: no GPU is visible (--backend cpu runs it on "
            "the CPU)\n",
            who, (long long)tp);
    return false;
}
