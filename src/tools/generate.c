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
    int64_t tp;
    int backend_kind;
    int kv_dtype; /* enum tdm_kv_dtype */
    double gpu_frac;
    bool gpu_bf16;
    int64_t page_size;
    int64_t ctx;
    int64_t max_batch_tokens;
    bool chat;
    bool print_ids;
    bool stop_at_eos;
    bool ignore_eos;
    bool batch_invariant;
    bool exact_activations;
    bool stats;
    bool spec_stats;
    struct tdm_sampling_params sp;
    struct tdm_tool_spec spec_cli;
    struct tdm_spec_opts spec;
    bool spec_on;
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
    struct tdm_model *draft; /* --spec draft */
    struct tdm_kv_group draft_group;
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
        "  --threads N             CPU threads (default: all cores)\n" TDM_TOOL_TP_USAGE
        "  --backend cpu|cuda      where the model runs (default: cpu)\n"
        "  --gpu-memory-fraction F CUDA: share of GPU memory to use (default: "
        "0.9)\n" TDM_TOOL_GPU_WEIGHTS_USAGE TDM_TOOL_EXACT_ACTIVATIONS_USAGE
        "  --batch-invariant       never use OpenBLAS (bit-identical across batch shapes)\n"
        "  --page-size N           KV page size in tokens (default 16)\n" TDM_TOOL_KV_DTYPE_USAGE
        "  --ctx N                 context length (default: the model's)\n"
        "  --max-batch-tokens N    prefill chunk size (default 512)\n"
        "  --stats                 print timing to stderr\n",
        chat ? "chat" : "generate", MAX_STOPS);
    if (chat) return;
    tdm_tool_spec_usage(f);
    fprintf(f, "  --spec-stats            at the end, one JSON line on stderr: drafted, accepted,\n"
               "                          target_steps, tokens, tau, accept_by_position\n");
}

static bool chat_usage;
static void usage_cb(FILE *f)
{
    usage(f, chat_usage);
}

struct stop_list {
    const char **v;
    int *n;
};
static bool opt_stop(const char *arg, void *dst)
{
    struct stop_list *l = dst;
    if (*l->n == MAX_STOPS) {
        fprintf(stderr, "--stop: at most %d stop strings\n", MAX_STOPS);
        return false;
    }
    l->v[(*l->n)++] = arg;
    return true;
}

/* Returns 0 to go on, or an exit code (0 for --help handled, 2 for usage errors) + 100. */
static int parse_opts(int argc, char **argv, bool chat, struct gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_tokens = 256;
    o->sp = tdm_sampling_defaults();
    double temp = o->sp.temperature, top_p = o->sp.top_p, min_p = o->sp.min_p;
    double rep = o->sp.repetition_penalty, pres = o->sp.presence_penalty,
           freq = o->sp.frequency_penalty;
    int64_t top_k = o->sp.top_k, seed = (int64_t)o->sp.seed;
    struct stop_list stops = {o->stops, &o->n_stops};
    const struct tdm_opt own[] = {
        TDM_OPT_S("model", &o->model),
        TDM_OPT_S("prompt", &o->prompt),
        TDM_OPT_S("prompt-tokens", &o->prompt_tokens),
        TDM_OPT_B("chat", &o->chat),
        TDM_OPT_S("system", &o->system),
        TDM_OPT_I("max-tokens", &o->max_tokens, 1, 1 << 24),
        TDM_OPT_F("temperature", &temp, 0, 100),
        TDM_OPT_I("top-k", &top_k, 0, 1 << 24),
        TDM_OPT_F("top-p", &top_p, 1e-9, 1),
        TDM_OPT_F("min-p", &min_p, 0, 1),
        TDM_OPT_F("repetition-penalty", &rep, 1e-6, 100),
        TDM_OPT_F("presence-penalty", &pres, -2, 2),
        TDM_OPT_F("frequency-penalty", &freq, -2, 2),
        TDM_OPT_I("seed", &seed, 0, 9007199254740992.0), /* 2^53: exact as a double */
        TDM_OPT_P("stop", opt_stop, &stops),
        TDM_OPT_B("stop-at-eos", &o->stop_at_eos),
        TDM_OPT_B("ignore-eos", &o->ignore_eos),
        TDM_OPT_B("print-token-ids", &o->print_ids),
        TDM_OPT_S("dump-logits", &o->dump_logits),
        TDM_OPT_I("threads", &o->threads, 1, 1024),
        TDM_OPT_I("tp", &o->tp, 1, TDM_TP_MAX_RANKS),
        TDM_OPT_B("batch-invariant", &o->batch_invariant),
        TDM_OPT_B("exact-activations", &o->exact_activations),
        TDM_OPT_I("page-size", &o->page_size, 1, 1024),
        TDM_OPT_P("kv-dtype", tdm_tool_opt_kv_dtype, &o->kv_dtype),
        TDM_OPT_I("ctx", &o->ctx, 1, 1 << 24),
        TDM_OPT_I("max-batch-tokens", &o->max_batch_tokens, 1, 1 << 16),
        TDM_OPT_B("stats", &o->stats),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &o->backend_kind),
        TDM_OPT_F("gpu-memory-fraction", &o->gpu_frac, 0.05, 1.0),
        TDM_OPT_P("gpu-weights", tdm_tool_opt_gpu_weights, &o->gpu_bf16),
        TDM_OPT_B("spec-stats", &o->spec_stats),
        TDM_OPT_END,
    };
    struct tdm_opt spec[TDM_TOOL_SPEC_OPTS];
    tdm_tool_spec_table(&o->spec_cli, spec);
    const struct tdm_opt *const tables[] = {own, chat ? NULL : spec, NULL};
    chat_usage = chat;
    int prc = tdm_tool_parse(chat ? "chat" : "generate", argc, argv, tables, usage_cb);
    if (prc) return prc == 1 ? 100 : 102;
    o->sp.temperature = (float)temp;
    o->sp.top_p = (float)top_p;
    o->sp.min_p = (float)min_p;
    o->sp.repetition_penalty = (float)rep;
    o->sp.presence_penalty = (float)pres;
    o->sp.frequency_penalty = (float)freq;
    o->sp.top_k = (int)top_k;
    o->sp.seed = (uint64_t)seed;
    if (!chat && !tdm_tool_spec_opts(&o->spec_cli, &o->spec, &o->spec_on)) return 102;
    if (!tdm_tool_tp_check(chat ? "tandem chat" : "tandem generate", o->tp, o->backend_kind))
        return 102;
    if (chat && o->spec_stats) {
        fprintf(stderr, "tandem: --spec-stats is for generate\n");
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

static tdm_status gen_init(struct gen *g, const struct tdm_model *m, struct gen_opts *o)
{
    memset(g, 0, sizeof *g);
    g->model = m;
    struct tdm_engine_opts eo = {
        .n_threads = (int)o->threads,
        .batch_invariant = o->batch_invariant,
        .exact_activations = o->exact_activations,
        .page_size = (int)o->page_size,
        .max_ctx = (int)o->ctx,
        .max_batch_tokens = (int)o->max_batch_tokens,
        .max_seqs = 1,
        .max_logit_rows = 1 + (o->spec_on ? TDM_SPEC_MAX_K : 0), /* a verified span's rows */
        .backend_kind = o->backend_kind,
        .kv_dtype = o->kv_dtype,
        .gpu_memory_fraction = o->gpu_frac,
        .gpu_bf16_weights = o->gpu_bf16,
        .tp = (int)o->tp,
    };
    if (!eo.max_ctx && m->cfg.max_ctx > 0) eo.max_ctx = m->cfg.max_ctx;
    if (o->spec_on &&
        !tdm_tool_spec_load_draft("tandem generate", &o->spec, m, &eo, &g->draft_group, &g->draft))
        return tdm_err_set(TDM_EINVAL, "the draft model could not be used");
    int ps = eo.page_size ? eo.page_size : 16;
    /* the context, plus room for a step's drafts past its end */
    eo.kv_pages = ((eo.max_ctx ? eo.max_ctx : 4096) + TDM_SPEC_MAX_K + ps - 1) / ps + 1;
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
    tdm_model_free(g->draft);
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

/* generate: the request through the scheduler, driven step by step on this thread (the
 * scheduler that serves HTTP, so speculation and everything else behave the same); tokens
 * or text are printed as they come. Returns the exit code. */
static int gen_sched(struct gen *g, const struct gen_opts *o, bool text_mode, const int32_t *ids,
                     int n)
{
    const struct tdm_engine_opts *eo = tdm_engine_opts(g->engine);
    int room = eo->max_ctx - n;
    if (room < 1) {
        fprintf(stderr, "tandem: the prompt (%d tokens) fills the context of %d\n", n, eo->max_ctx);
        return 2;
    }
    struct tdm_sched_opts so = {.max_batch_tokens = eo->max_batch_tokens, .max_seqs = 1};
    tdm_sched_t *s = NULL;
    tdm_spec_t *sp = NULL;
    tdm_req_t *r = NULL;
    tdm_req_reader_t *rd = NULL;
    int rc = 1;
    if (tdm_sched_create(g->engine, g->tok, &so, &s) != TDM_OK) {
        tdm_tool_fail("scheduler");
        return 1;
    }
    if (o->spec_on && !(sp = tdm_tool_spec_attach("tandem generate", &o->spec, g->engine, s))) {
        rc = 2;
        goto out;
    }
    bool text_out = !o->print_ids;
    struct tdm_req_params rp = {.prompt = ids,
                                .n_prompt = n,
                                .max_tokens = (int)TDM_MIN(o->max_tokens, room),
                                .ignore_eos = text_mode ? o->ignore_eos : !o->stop_at_eos,
                                .sampling = o->sp,
                                .top_logprobs = -1};
    if (tdm_sched_submit(s, &rp, &r) != TDM_OK) {
        tdm_tool_fail("request");
        rc = 2;
        goto out;
    }
    bool use_stops = text_mode && text_out;
    if (tdm_req_reader_create(text_out ? g->tok : NULL, o->stops, use_stops ? o->n_stops : 0,
                              rp.max_tokens, -1, &rd) != TDM_OK) {
        tdm_tool_fail("--stop");
        rc = 2;
        goto out;
    }
    struct tdm_req_view v = {0};
    int printed = 0;
    size_t shown = 0;
    for (;;) {
        bool ran = tdm_sched_step(s);
        tdm_req_reader_update(rd, r, &v);
        if (text_out) {
            fwrite(v.text + shown, 1, v.text_len - shown, stdout);
            shown = v.text_len;
        } else {
            for (; printed < v.n_out; printed++)
                printf(printed ? " %d" : "%d", v.tokens[printed]);
        }
        fflush(stdout);
        if (v.finish != TDM_FINISH_NONE) break;
        if (!ran && tdm_req_state(r) != TDM_REQ_FINISHED) {
            fprintf(stderr, "tandem: generation: the scheduler cannot run the request\n");
            goto out;
        }
    }
    printf("\n");
    if (v.finish == TDM_FINISH_ERROR) {
        fprintf(stderr, "tandem: generation: %s\n", v.error_msg);
        goto out;
    }
    g->n_prefilled = n;
    g->prefill_s = (double)(v.t_first_ns - v.t_submit_ns) * 1e-9;
    g->n_decoded = v.n_out;
    g->decode_s = (double)(v.t_end_ns - v.t_first_ns) * 1e-9;
    if (o->spec_stats) {
        struct tdm_spec_stats st = {0};
        if (sp) tdm_spec_get_stats(sp, &st);
        if (!sp) { /* no speculation: every decode step is one token */
            st.target_steps = st.tokens = (uint64_t)TDM_MAX(v.n_out - 1, 0);
        }
        char json[1024];
        tdm_spec_stats_json(&st, json, sizeof json);
        fprintf(stderr, "%s\n", json);
    }
    rc = 0;
out:
    tdm_req_reader_destroy(rd);
    if (r) tdm_req_release(r);
    tdm_sched_destroy(s);
    tdm_spec_destroy(sp);
    return rc;
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
    const struct tdm_load_opts lo =
        tdm_tool_load_opts(o.backend_kind, o.gpu_bf16, o.exact_activations);
    struct tdm_model *m = tdm_tool_load_model_opts(o.model, &lo);
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
            if (o.system) msgs[nm++] = (struct tdm_chat_msg){.role = "system", .content = o.system};
            msgs[nm++] = (struct tdm_chat_msg){.role = "user", .content = prompt};
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
    if (n >= g.cap) {
        fprintf(stderr, "tandem: prompt: %d tokens do not fit the context of %d\n", n, g.cap);
        rc = 2;
        goto out_gen;
    }
    if (o.dump_logits) { /* the prompt's last logits, from a pass of its own */
        if (feed_prompt(&g, ids, n) != TDM_OK) {
            tdm_tool_fail("prompt");
            goto out_gen;
        }
        if (write_logits(o.dump_logits, g.logits, m->cfg.vocab_size) != 0) goto out_gen;
        tdm_kv_seq_release(tdm_engine_kv(g.engine), &g.kv);
        g.n_cached = 0;
    }
    rc = gen_sched(&g, &o, text_mode, ids, n);
    if (rc) goto out_gen;
    if (o.stats) print_stats(&g);
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
    const struct tdm_load_opts lo =
        tdm_tool_load_opts(o.backend_kind, o.gpu_bf16, o.exact_activations);
    struct tdm_model *m = tdm_tool_load_model_opts(o.model, &lo);
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
    if (o.system) msgs[nm++] = (struct tdm_chat_msg){.role = "system", .content = o.system};
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
        msgs[nm++] = (struct tdm_chat_msg){.role = "user", .content = user};
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
        msgs[nm] = (struct tdm_chat_msg){.role = "assistant", .content = owned[nm]};
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
