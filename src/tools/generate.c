/*
 * `tandem generate` and `tandem chat`: one sequence through the engine, streaming to stdout.
 *
 * generate: a text prompt (completion, or --chat to wrap it in the model's chat template) or
 *   raw token ids (--prompt-tokens). With --print-token-ids stdout holds only the generated ids,
 *   space-separated on one line: the contract external checks rely on. Token-id mode stops only
 *   at --max-tokens unless --stop-at-eos.
 * chat: multi-turn. Each turn renders the whole conversation through the template and reuses
 *   the KV of the longest common token prefix, so only the new turn is prefilled.
 *
 * Threading: single-threaded driver; the engine fans out over its CPU thread pool.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tools/tools_int.h"

#define MAX_STOPS        TDM_MAX_STOP_STRINGS
#define MAX_PROMPT_BYTES (16u << 20)

struct gen_opts {
    const char *model;
    const char *prompt;
    const char *prompt_tokens;
    const char *system;
    const char *dump_logits;
    const char *stops[MAX_STOPS];
    int n_stops;
    int64_t max_tokens;
    int64_t threads;
    int backend_kind;
    double gpu_frac;
    int64_t page_size;
    int64_t ctx;
    int64_t max_batch_tokens;
    bool chat;
    bool print_ids;
    bool stop_at_eos;
    bool ignore_eos;
    bool batch_invariant;
    bool stats;
    struct tdm_sampling_params sp;
};

/* A running sequence: its tokens so far and the KV pages that hold them. */
struct gen {
    tdm_engine_t *engine;
    const struct tdm_model *model;
    tdm_tok_t *tok;
    struct tdm_kv_seq kv;
    int32_t *tokens; /* [cap] tokens whose KV is in the cache, then the pending one */
    int n_cached;    /* tokens with KV in the cache */
    int cap;
    float *logits; /* [vocab] */
    struct tdm_sample_scratch scratch;
    double prefill_s, decode_s;
    int n_prefilled, n_decoded;
};

static void usage(FILE *f, bool chat)
{
    fprintf(
        f,
        "usage: tandem %s [options]\n"
        "  --model PATH            .gguf file or HF checkpoint folder (default: the default "
        "model)\n"
        "  --prompt TEXT           the prompt (chat: the user message; read from stdin if absent)\n"
        "  --prompt-tokens IDS     comma-separated token ids instead of text (generate only)\n"
        "  --chat                  wrap --prompt in the model's chat template (generate)\n"
        "  --system TEXT           system message for the chat template\n"
        "  --max-tokens N          tokens to generate (default 256)\n"
        "  --temperature T         0 is greedy (default 0)\n"
        "  --top-k K --top-p P --min-p P\n"
        "  --repetition-penalty R --presence-penalty P --frequency-penalty F\n"
        "  --seed S                sampling seed (default 0)\n"
        "  --stop STR              stop string (repeatable, up to %d)\n"
        "  --stop-at-eos           with --prompt-tokens: also stop at an end-of-sequence token\n"
        "  --ignore-eos            with text: do not stop at end-of-sequence tokens\n"
        "  --print-token-ids       print only the generated token ids on one line\n"
        "  --dump-logits FILE      write the last prompt position's logits (float32 LE)\n"
        "  --threads N             CPU threads (default: all cores)\n"
        "  --backend cpu|cuda      where the model runs (default: cpu)\n"
        "  --gpu-memory-fraction F CUDA: share of GPU memory to use (default: 0.9)\n"
        "  --batch-invariant       never use OpenBLAS (bit-identical across batch shapes)\n"
        "  --page-size N           KV page size in tokens (default 16)\n"
        "  --ctx N                 context length (default: the model's)\n"
        "  --max-batch-tokens N    prefill chunk size (default 512)\n"
        "  --stats                 print timing to stderr\n",
        chat ? "chat" : "generate", MAX_STOPS);
}

enum {
    OPT_MODEL = 256,
    OPT_PROMPT,
    OPT_PROMPT_TOKENS,
    OPT_CHAT,
    OPT_SYSTEM,
    OPT_MAX_TOKENS,
    OPT_TEMPERATURE,
    OPT_TOP_K,
    OPT_TOP_P,
    OPT_MIN_P,
    OPT_REP,
    OPT_PRES,
    OPT_FREQ,
    OPT_SEED,
    OPT_STOP,
    OPT_STOP_EOS,
    OPT_IGNORE_EOS,
    OPT_PRINT_IDS,
    OPT_DUMP_LOGITS,
    OPT_THREADS,
    OPT_BATCH_INV,
    OPT_PAGE_SIZE,
    OPT_CTX,
    OPT_MBT,
    OPT_STATS,
    OPT_BACKEND,
    OPT_GPU_FRAC,
    OPT_HELP
};

static const struct option long_opts[] = {
    {"model", required_argument, 0, OPT_MODEL},
    {"prompt", required_argument, 0, OPT_PROMPT},
    {"prompt-tokens", required_argument, 0, OPT_PROMPT_TOKENS},
    {"chat", no_argument, 0, OPT_CHAT},
    {"system", required_argument, 0, OPT_SYSTEM},
    {"max-tokens", required_argument, 0, OPT_MAX_TOKENS},
    {"temperature", required_argument, 0, OPT_TEMPERATURE},
    {"top-k", required_argument, 0, OPT_TOP_K},
    {"top-p", required_argument, 0, OPT_TOP_P},
    {"min-p", required_argument, 0, OPT_MIN_P},
    {"repetition-penalty", required_argument, 0, OPT_REP},
    {"presence-penalty", required_argument, 0, OPT_PRES},
    {"frequency-penalty", required_argument, 0, OPT_FREQ},
    {"seed", required_argument, 0, OPT_SEED},
    {"stop", required_argument, 0, OPT_STOP},
    {"stop-at-eos", no_argument, 0, OPT_STOP_EOS},
    {"ignore-eos", no_argument, 0, OPT_IGNORE_EOS},
    {"print-token-ids", no_argument, 0, OPT_PRINT_IDS},
    {"dump-logits", required_argument, 0, OPT_DUMP_LOGITS},
    {"threads", required_argument, 0, OPT_THREADS},
    {"batch-invariant", no_argument, 0, OPT_BATCH_INV},
    {"page-size", required_argument, 0, OPT_PAGE_SIZE},
    {"ctx", required_argument, 0, OPT_CTX},
    {"max-batch-tokens", required_argument, 0, OPT_MBT},
    {"stats", no_argument, 0, OPT_STATS},
    {"backend", required_argument, 0, OPT_BACKEND},
    {"gpu-memory-fraction", required_argument, 0, OPT_GPU_FRAC},
    {"help", no_argument, 0, OPT_HELP},
    {0, 0, 0, 0},
};

/* Returns 0 to go on, or an exit code (0 for --help handled, 2 for usage errors) + 100. */
static int parse_opts(int argc, char **argv, bool chat, struct gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_tokens = 256;
    o->sp = tdm_sampling_defaults();
    int c;
    int64_t iv;
    double fv;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", long_opts, NULL)) != -1) {
        switch (c) {
        case OPT_MODEL:
            o->model = optarg;
            break;
        case OPT_PROMPT:
            o->prompt = optarg;
            break;
        case OPT_PROMPT_TOKENS:
            o->prompt_tokens = optarg;
            break;
        case OPT_CHAT:
            o->chat = true;
            break;
        case OPT_SYSTEM:
            o->system = optarg;
            break;
        case OPT_MAX_TOKENS:
            if (!tdm_tool_int("max-tokens", optarg, 1, 1 << 24, &o->max_tokens)) return 102;
            break;
        case OPT_TEMPERATURE:
            if (!tdm_tool_float("temperature", optarg, 0, 100, &fv)) return 102;
            o->sp.temperature = (float)fv;
            break;
        case OPT_TOP_K:
            if (!tdm_tool_int("top-k", optarg, 0, 1 << 24, &iv)) return 102;
            o->sp.top_k = (int)iv;
            break;
        case OPT_TOP_P:
            if (!tdm_tool_float("top-p", optarg, 1e-9, 1, &fv)) return 102;
            o->sp.top_p = (float)fv;
            break;
        case OPT_MIN_P:
            if (!tdm_tool_float("min-p", optarg, 0, 1, &fv)) return 102;
            o->sp.min_p = (float)fv;
            break;
        case OPT_REP:
            if (!tdm_tool_float("repetition-penalty", optarg, 1e-6, 100, &fv)) return 102;
            o->sp.repetition_penalty = (float)fv;
            break;
        case OPT_PRES:
            if (!tdm_tool_float("presence-penalty", optarg, -2, 2, &fv)) return 102;
            o->sp.presence_penalty = (float)fv;
            break;
        case OPT_FREQ:
            if (!tdm_tool_float("frequency-penalty", optarg, -2, 2, &fv)) return 102;
            o->sp.frequency_penalty = (float)fv;
            break;
        case OPT_SEED:
            if (!tdm_tool_int("seed", optarg, 0, INT64_MAX, &iv)) return 102;
            o->sp.seed = (uint64_t)iv;
            break;
        case OPT_STOP:
            if (o->n_stops == MAX_STOPS) {
                fprintf(stderr, "tandem: at most %d --stop strings\n", MAX_STOPS);
                return 102;
            }
            o->stops[o->n_stops++] = optarg;
            break;
        case OPT_STOP_EOS:
            o->stop_at_eos = true;
            break;
        case OPT_IGNORE_EOS:
            o->ignore_eos = true;
            break;
        case OPT_PRINT_IDS:
            o->print_ids = true;
            break;
        case OPT_DUMP_LOGITS:
            o->dump_logits = optarg;
            break;
        case OPT_THREADS:
            if (!tdm_tool_int("threads", optarg, 1, 1024, &o->threads)) return 102;
            break;
        case OPT_BATCH_INV:
            o->batch_invariant = true;
            break;
        case OPT_PAGE_SIZE:
            if (!tdm_tool_int("page-size", optarg, 1, 1024, &o->page_size)) return 102;
            break;
        case OPT_CTX:
            if (!tdm_tool_int("ctx", optarg, 1, 1 << 24, &o->ctx)) return 102;
            break;
        case OPT_MBT:
            if (!tdm_tool_int("max-batch-tokens", optarg, 1, 1 << 16, &o->max_batch_tokens))
                return 102;
            break;
        case OPT_BACKEND:
            if (strcmp(optarg, "cpu") && strcmp(optarg, "cuda")) {
                fprintf(stderr, "tandem: --backend is cpu or cuda\n");
                return 102;
            }
            o->backend_kind = strcmp(optarg, "cuda") ? TDM_BACKEND_CPU : TDM_BACKEND_CUDA;
            break;
        case OPT_GPU_FRAC:
            if (!tdm_tool_float("gpu-memory-fraction", optarg, 0.05, 1.0, &o->gpu_frac)) return 102;
            break;
        case OPT_STATS:
            o->stats = true;
            break;
        case OPT_HELP:
            usage(stdout, chat);
            return 100;
        default:
            fprintf(stderr, "tandem: unknown or incomplete option '%s'\n", argv[optind - 1]);
            usage(stderr, chat);
            return 102;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tandem: unexpected argument '%s'\n", argv[optind]);
        return 102;
    }
    if (o->prompt && o->prompt_tokens) {
        fprintf(stderr, "tandem: give --prompt or --prompt-tokens, not both\n");
        return 102;
    }
    if (chat && o->prompt_tokens) {
        fprintf(stderr, "tandem: chat takes text, not --prompt-tokens\n");
        return 102;
    }
    return 0;
}

static tdm_status gen_init(struct gen *g, const struct tdm_model *m, const struct gen_opts *o)
{
    memset(g, 0, sizeof *g);
    g->model = m;
    struct tdm_engine_opts eo = {
        .n_threads = (int)o->threads,
        .batch_invariant = o->batch_invariant,
        .page_size = (int)o->page_size,
        .max_ctx = (int)o->ctx,
        .max_batch_tokens = (int)o->max_batch_tokens,
        .max_seqs = 1,
        .max_logit_rows = 1,
        .backend_kind = o->backend_kind,
        .gpu_memory_fraction = o->gpu_frac,
    };
    if (!eo.max_ctx && m->cfg.max_ctx > 0) eo.max_ctx = m->cfg.max_ctx;
    int ps = eo.page_size ? eo.page_size : 16;
    eo.kv_pages = ((eo.max_ctx ? eo.max_ctx : 4096) + ps - 1) / ps;
    tdm_status st = tdm_engine_create(m, &eo, &g->engine);
    if (st != TDM_OK) return st;
    g->cap = tdm_engine_opts(g->engine)->max_ctx;
    g->tokens = malloc((size_t)g->cap * sizeof *g->tokens);
    g->logits = malloc((size_t)m->cfg.vocab_size * sizeof *g->logits);
    if (!g->tokens || !g->logits) return tdm_err_set(TDM_ENOMEM, "out of memory");
    return tdm_sample_scratch_init(&g->scratch, m->cfg.vocab_size);
}

static void gen_free(struct gen *g)
{
    if (g->engine) tdm_kv_seq_release(tdm_engine_kv(g->engine), &g->kv);
    tdm_engine_destroy(g->engine);
    tdm_sample_scratch_free(&g->scratch);
    free(g->tokens);
    free(g->logits);
}

/* Runs tokens[n_cached .. n) through the model in chunks; logits of the last one land in
 * g->logits. */
static tdm_status gen_feed(struct gen *g, const int32_t *tokens, int n)
{
    const struct tdm_engine_opts *eo = tdm_engine_opts(g->engine);
    if (g->n_cached + n > g->cap)
        return tdm_err_set(TDM_ERANGE, "%d tokens do not fit the context of %d", g->n_cached + n,
                           g->cap);
    tdm_status st = tdm_kv_seq_reserve(tdm_engine_kv(g->engine), &g->kv, g->n_cached + n);
    if (st != TDM_OK) return st;
    memcpy(g->tokens + g->n_cached, tokens, (size_t)n * sizeof *tokens);
    int done = 0;
    while (done < n) {
        int chunk = TDM_MIN(n - done, eo->max_batch_tokens);
        struct tdm_batch_seq bs = {
            .tokens = g->tokens + g->n_cached,
            .n_tokens = chunk,
            .pos0 = g->n_cached,
            .pages = g->kv.pages,
            .n_pages = g->kv.n_pages,
            .n_logits = done + chunk == n ? 1 : 0,
        };
        struct tdm_batch b = {.seqs = &bs, .n_seqs = 1};
        st = tdm_engine_forward(g->engine, &b, g->logits, NULL);
        if (st != TDM_OK) return st;
        g->n_cached += chunk;
        done += chunk;
    }
    return TDM_OK;
}

static bool is_eos(const struct tdm_model *m, const tdm_tok_t *tok, int32_t id)
{
    for (int i = 0; i < m->cfg.n_eos; i++)
        if (m->cfg.eos_ids[i] == id) return true;
    return tok && tdm_tok_eos(tok) == id;
}

/* Writes released text to stdout and appends it to the reply being collected (if any). */
static tdm_status emit(const char *buf, size_t n, char **reply, size_t *reply_len)
{
    if (!n) return TDM_OK;
    fwrite(buf, 1, n, stdout);
    fflush(stdout);
    if (!reply) return TDM_OK;
    char *nr = realloc(*reply, *reply_len + n + 1);
    if (!nr) return tdm_err_set(TDM_ENOMEM, "out of memory");
    memcpy(nr + *reply_len, buf, n);
    *reply_len += n;
    nr[*reply_len] = '\0';
    *reply = nr;
    return TDM_OK;
}

/* Generates up to max_tokens after the prompt already fed; appends the reply text to *reply
 * (if not NULL). Returns TDM_OK or an error. */
static tdm_status gen_run(struct gen *g, const struct gen_opts *o, bool text_mode,
                          uint64_t request_id, char **reply, size_t *reply_len)
{
    struct tdm_sampler smp;
    struct tdm_text_stream ts;
    tdm_status st = tdm_sampler_init(&smp, &o->sp, request_id, g->model->cfg.vocab_size);
    if (st != TDM_OK) return st;
    if ((st = tdm_text_stream_init(&ts, o->stops, o->n_stops)) != TDM_OK) goto out_sampler;
    for (int i = 0; i < g->n_cached; i++)
        tdm_sampler_accept(&smp, g->tokens[i], true);
    bool stop_eos = text_mode ? !o->ignore_eos : o->stop_at_eos;
    char out[TDM_STREAM_CAP + 256];
    double t0 = tdm_now_s();
    for (int64_t i = 0; i < o->max_tokens; i++) {
        int32_t id = tdm_sampler_sample(&smp, g->logits, (uint32_t)g->n_cached, &g->scratch, NULL);
        tdm_sampler_accept(&smp, id, false);
        g->n_decoded++;
        if (o->print_ids) {
            printf(i ? " %d" : "%d", id);
            fflush(stdout);
        }
        if (stop_eos && is_eos(g->model, g->tok, id)) break;
        if (text_mode && !o->print_ids) {
            size_t len = 0, n_out = 0;
            const char *piece =
                tdm_tok_is_special(g->tok, id) ? "" : tdm_tok_piece(g->tok, id, &len);
            bool stopped = false;
            /* at most 256 bytes per push, so `out` always has room */
            for (size_t off = 0; off < len && !stopped; off += 256) {
                stopped =
                    tdm_text_stream_push(&ts, piece + off, TDM_MIN(len - off, 256), out, &n_out);
                if ((st = emit(out, n_out, reply, reply_len)) != TDM_OK) goto out_sampler;
            }
            if (stopped) break;
        }
        if (i + 1 == o->max_tokens) break;
        if ((st = gen_feed(g, &id, 1)) != TDM_OK) goto out_sampler;
    }
    if (text_mode && !o->print_ids) {
        size_t n_out;
        tdm_text_stream_flush(&ts, out, &n_out);
        if ((st = emit(out, n_out, reply, reply_len)) != TDM_OK) goto out_sampler;
    }
    g->decode_s += tdm_now_s() - t0;
out_sampler:
    tdm_sampler_free(&smp);
    return st;
}

static char *read_stdin(void)
{
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    for (;;) {
        if (len + 1 >= cap) {
            if (cap >= MAX_PROMPT_BYTES) {
                free(buf);
                fprintf(stderr, "tandem: prompt on stdin longer than %u bytes\n", MAX_PROMPT_BYTES);
                return NULL;
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t n = fread(buf + len, 1, cap - 1 - len, stdin);
        if (n == 0) break;
        len += n;
    }
    buf[len] = '\0';
    return buf;
}

/* Encodes text (special tokens parsed when it came from a template) into a malloc'd array. */
static tdm_status encode(const tdm_tok_t *tok, const char *text, bool from_template, bool add_bos,
                         int32_t **ids, int *n)
{
    size_t len = strlen(text), cap = len + 8, n_out = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return tdm_err_set(TDM_ENOMEM, "out of memory");
    int flags = (from_template ? TDM_TOK_PARSE_SPECIAL : 0) | (add_bos ? TDM_TOK_ADD_BOS : 0);
    tdm_status st = tdm_tok_encode(tok, text, len, flags, v, cap, &n_out);
    if (st != TDM_OK) {
        free(v);
        return st;
    }
    *ids = v;
    *n = (int)n_out;
    return TDM_OK;
}

static void print_stats(const struct gen *g)
{
    fprintf(stderr, "\n[prompt: %d tokens, %.1f tok/s | generated: %d tokens, %.1f tok/s]\n",
            g->n_prefilled, g->prefill_s > 0 ? g->n_prefilled / g->prefill_s : 0.0, g->n_decoded,
            g->decode_s > 0 ? g->n_decoded / g->decode_s : 0.0);
}

static int write_logits(const char *path, const float *logits, int vocab)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(logits, sizeof(float), (size_t)vocab, f) != (size_t)vocab) {
        fprintf(stderr, "tandem: cannot write %s\n", path);
        if (f) fclose(f);
        return 1;
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "tandem: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

/* Feeds a prompt (after any cached prefix that matches it) and times it. */
static tdm_status feed_prompt(struct gen *g, const int32_t *ids, int n)
{
    int common = 0;
    while (common < g->n_cached && common < n && g->tokens[common] == ids[common])
        common++;
    /* Keep at least one token to run, so the prompt's last logits are fresh. */
    if (common == n) common = n - 1;
    g->n_cached = common;
    double t0 = tdm_now_s();
    tdm_status st = gen_feed(g, ids + common, n - common);
    g->prefill_s += tdm_now_s() - t0;
    g->n_prefilled += n - common;
    return st;
}

static struct tdm_chat_template *load_template(const struct tdm_model *m,
                                               struct tdm_chat_template *t)
{
    if (tdm_chat_template_detect(m->chat_template, t) != TDM_OK) {
        fprintf(stderr, "tandem: this model has no chat template tandem understands (%s)\n",
                tdm_err_msg());
        return NULL;
    }
    return t;
}

int tdm_cmd_generate(int argc, char **argv)
{
    struct gen_opts o;
    int rc = parse_opts(argc, argv, false, &o);
    if (rc) return rc - 100;
    struct tdm_model *m = tdm_tool_load_model(o.model);
    if (!m) return 1;
    struct gen g;
    int32_t *ids = NULL;
    int n = 0;
    char *prompt_buf = NULL, *rendered = NULL;
    struct tdm_chat_template tmpl = {0};
    rc = 1;
    bool text_mode = !o.prompt_tokens;
    tdm_tok_t *tok = NULL;
    if (text_mode || o.stop_at_eos || !o.print_ids) tok = tdm_tool_load_tokenizer(m, !text_mode);
    if (text_mode && !tok) goto out_model;
    if (gen_init(&g, m, &o) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out_gen;
    }
    g.tok = tok;
    if (!text_mode) {
        if (!tdm_tool_parse_ids(o.prompt_tokens, &ids, &n)) {
            rc = 2;
            goto out_gen;
        }
        if (!tok && !o.print_ids) {
            fprintf(stderr, "tandem: no tokenizer to print text; add --print-token-ids\n");
            rc = 2;
            goto out_gen;
        }
    } else {
        const char *prompt = o.prompt;
        if (!prompt) {
            prompt = prompt_buf = read_stdin();
            if (!prompt) goto out_gen;
        }
        if (!*prompt) {
            fprintf(stderr, "tandem: the prompt is empty\n");
            rc = 2;
            goto out_gen;
        }
        bool add_bos = tdm_tok_adds_bos(tok);
        if (o.chat) {
            if (!load_template(m, &tmpl)) goto out_gen;
            struct tdm_chat_msg msgs[2];
            size_t nm = 0;
            if (o.system) msgs[nm++] = (struct tdm_chat_msg){"system", o.system};
            msgs[nm++] = (struct tdm_chat_msg){"user", prompt};
            if (tdm_chat_render(&tmpl, msgs, nm, true, &rendered) != TDM_OK) {
                tdm_tool_fail("chat template");
                goto out_gen;
            }
            prompt = rendered;
            if (tmpl.add_bos_text) add_bos = false;
        }
        if (encode(tok, prompt, o.chat, add_bos, &ids, &n) != TDM_OK) {
            tdm_tool_fail("prompt");
            rc = 2;
            goto out_gen;
        }
        if (n == 0) {
            fprintf(stderr, "tandem: the prompt encodes to no tokens\n");
            rc = 2;
            goto out_gen;
        }
    }
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.vocab_size) {
            fprintf(stderr, "tandem: token id %d is outside the vocabulary (0..%d)\n", ids[i],
                    m->cfg.vocab_size - 1);
            rc = 2;
            goto out_gen;
        }
    if (feed_prompt(&g, ids, n) != TDM_OK) {
        tdm_tool_fail("prompt");
        rc = tdm_err_msg()[0] && n > g.cap ? 2 : 1;
        goto out_gen;
    }
    if (o.dump_logits && write_logits(o.dump_logits, g.logits, m->cfg.vocab_size) != 0)
        goto out_gen;
    if (gen_run(&g, &o, text_mode, 0, NULL, NULL) != TDM_OK) {
        tdm_tool_fail("generation");
        goto out_gen;
    }
    printf("\n");
    if (o.stats) print_stats(&g);
    rc = 0;
out_gen:
    gen_free(&g);
    tdm_chat_template_clear(&tmpl);
    free(ids);
    free(prompt_buf);
    free(rendered);
    tdm_tok_free(tok);
out_model:
    tdm_model_free(m);
    return rc;
}

/* Chat: a conversation, one user turn per line on a terminal (or one --prompt / all of stdin). */
int tdm_cmd_chat(int argc, char **argv)
{
    struct gen_opts o;
    int rc = parse_opts(argc, argv, true, &o);
    if (rc) return rc - 100;
    struct tdm_model *m = tdm_tool_load_model(o.model);
    if (!m) return 1;
    struct tdm_chat_template tmpl = {0};
    struct gen g;
    memset(&g, 0, sizeof g);
    rc = 1;
    tdm_tok_t *tok = tdm_tool_load_tokenizer(m, false);
    if (!tok || !load_template(m, &tmpl)) goto out;
    if (gen_init(&g, m, &o) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out;
    }
    g.tok = tok;
    bool interactive = !o.prompt && isatty(STDIN_FILENO);
    enum { MAX_TURNS = 256 };
    struct tdm_chat_msg msgs[2 * MAX_TURNS + 1];
    char *owned[2 * MAX_TURNS + 1] = {0};
    size_t nm = 0;
    if (o.system) msgs[nm++] = (struct tdm_chat_msg){"system", o.system};
    for (int turn = 0; turn < MAX_TURNS; turn++) {
        char *user = NULL;
        if (o.prompt) {
            if (turn > 0) break;
            user = strdup(o.prompt);
        } else if (interactive) {
            fprintf(stderr, "> ");
            size_t cap = 0;
            ssize_t len = getline(&user, &cap, stdin);
            if (len <= 0) {
                free(user);
                break;
            }
            if (user[len - 1] == '\n') user[len - 1] = '\0';
            if (!*user) {
                free(user);
                continue;
            }
        } else {
            if (turn > 0) break;
            user = read_stdin();
        }
        if (!user || !*user) {
            fprintf(stderr, "tandem: the message is empty\n");
            free(user);
            rc = 2;
            goto out_msgs;
        }
        owned[nm] = user;
        msgs[nm++] = (struct tdm_chat_msg){"user", user};
        char *rendered = NULL;
        int32_t *ids = NULL;
        int n = 0;
        if (tdm_chat_render(&tmpl, msgs, nm, true, &rendered) != TDM_OK) {
            tdm_tool_fail("chat template");
            goto out_msgs;
        }
        tdm_status st =
            encode(tok, rendered, true, tdm_tok_adds_bos(tok) && !tmpl.add_bos_text, &ids, &n);
        free(rendered);
        if (st != TDM_OK) {
            tdm_tool_fail("message");
            rc = 2;
            goto out_msgs;
        }
        st = feed_prompt(&g, ids, n);
        free(ids);
        if (st != TDM_OK) {
            tdm_tool_fail("conversation");
            goto out_msgs;
        }
        char *reply = NULL;
        size_t reply_len = 0;
        st = gen_run(&g, &o, true, (uint64_t)turn, &reply, &reply_len);
        printf("\n");
        if (st != TDM_OK) {
            free(reply);
            tdm_tool_fail("generation");
            goto out_msgs;
        }
        owned[nm] = reply ? reply : strdup("");
        msgs[nm] = (struct tdm_chat_msg){"assistant", owned[nm]};
        nm++;
        if (o.stats) print_stats(&g);
    }
    rc = 0;
out_msgs:
    for (size_t i = 0; i < nm; i++)
        free(owned[i]);
out:
    gen_free(&g);
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
    tdm_model_free(m);
    return rc;
}
