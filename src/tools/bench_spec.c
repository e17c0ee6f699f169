/*
 * `tandem bench spec`: speculative decoding against none, in the same run, on the same engine.
 *
 * For each batch size (--batch, default 1,4,16) the prompts run with B requests in flight
 * (closed loop: a finished request's place goes to the next prompt), once without speculation
 * and once for each --spec-k value (default auto). Reported per configuration: tau (tokens per
 * target step) and acceptance by draft position, inter-token latency p50 and p99 (the gaps
 * between a request's arrivals of tokens, as a streaming client sees them: the tokens one step
 * publishes arrive together, as vLLM's benchmark counts them), time per output token (a
 * request's decode time over its tokens after the first), decode throughput, the
 * speedup over no speculation at that batch size, and whether every request's tokens equal
 * those without speculation (exact acceptance must say yes). --json prints one object.
 *
 * The scheduler runs on this thread, one step at a time, so a token's arrival time is the end
 * of the step that published it. Prompts: a file of one JSON string per line, each a user
 * message rendered through the model's chat template (--raw: used as it is).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/tools_int.h"

enum { MAX_BATCHES = 8, MAX_KS = 8 };

struct bench_opts {
    const char *model, *prompts;
    int64_t max_tokens, threads, limit, ctx;
    double temp, top_p;
    int64_t top_k, seed;
    int backend_kind;
    double gpu_frac;
    bool raw, json, one_hot;
    int batches[MAX_BATCHES], n_batches;
    int ks[MAX_KS], n_ks; /* 0: auto */
    struct tdm_tool_spec spec_cli;
};

struct result {
    int batch;
    int k; /* -1: no speculation; 0: auto */
    double tau, itl_p50_ms, itl_p99_ms, tpot_ms, tok_s, speedup;
    int64_t tokens;
    bool identical;
    struct tdm_spec_stats st;
};

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tandem bench spec --prompts FILE [options]\n"
            "  --model PATH            the target (default: the default model)\n"
            "  --prompts FILE          one JSON string a line: user messages\n"
            "  --max-tokens N          tokens per request (default 64)\n"
            "  --batch LIST            requests in flight, e.g. 1,4,16 (the default)\n"
            "  --limit N               only the first N prompts\n"
            "  --temperature T --top-p P --top-k K --seed S   sampling (default greedy)\n"
            "  --raw                   prompts as they are, without the chat template\n"
            "  --threads N --backend cpu|cuda --gpu-memory-fraction F --ctx N\n"
            "  --json                  one JSON object on stdout instead of the table\n"
            "  --q-one-hot             rejection with q the proposal alone (vLLM's default), to\n"
            "                          measure what the draft's full distribution gains\n"
            "  --spec-k LIST           configurations to run beside none: auto and/or fixed\n"
            "                          lengths, e.g. auto,1,2,4 (default auto)\n");
    tdm_tool_spec_usage(f);
}

static bool parse_int_list(const char *arg, int *out, int *n, int max, bool allow_auto,
                           const char *name)
{
    *n = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (*n == max) {
            fprintf(stderr, "--%s: at most %d values\n", name, max);
            return false;
        }
        if (allow_auto && !strcmp(t, "auto")) {
            out[(*n)++] = 0;
            continue;
        }
        char *end = NULL;
        long v = strtol(t, &end, 10);
        int lo = 1, hi = allow_auto ? TDM_SPEC_MAX_K : 4096;
        if (!*t || *end || v < lo || v > hi) {
            fprintf(stderr, "--%s: '%s' is not %s %d .. %d\n", name, t,
                    allow_auto ? "auto or" : "a number in", lo, hi);
            return false;
        }
        out[(*n)++] = (int)v;
    }
    if (!*n) fprintf(stderr, "--%s: empty list\n", name);
    return *n > 0;
}

static struct bench_opts *g_o; /* for the list parsers below (main thread only) */
static bool opt_batches(const char *arg, void *dst)
{
    (void)dst;
    return parse_int_list(arg, g_o->batches, &g_o->n_batches, MAX_BATCHES, false, "batch");
}
static bool opt_ks(const char *arg, void *dst)
{
    (void)dst;
    return parse_int_list(arg, g_o->ks, &g_o->n_ks, MAX_KS, true, "spec-k");
}

/* Reads one JSON string a line; returns the number read (or -1 after printing why). */
static int read_prompts(const char *path, char ***out, int limit)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "tandem bench spec: cannot open %s\n", path);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    int n = 0, lineno = 0, room = 0;
    char **v = NULL;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0 && (limit <= 0 || n < limit)) {
        lineno++;
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        json_error_t err;
        json_t *j = json_loads(line, JSON_DECODE_ANY, &err);
        if (!j || !json_is_string(j) || !json_string_length(j)) {
            fprintf(stderr, "tandem bench spec: %s:%d: not a non-empty JSON string\n", path,
                    lineno);
            json_decref(j);
            n = -1;
            break;
        }
        if (n == room) {
            room = room ? room * 2 : 64;
            char **nv = realloc(v, (size_t)room * sizeof *nv);
            if (!nv) {
                json_decref(j);
                n = -1;
                break;
            }
            v = nv;
        }
        v[n++] = strdup(json_string_value(j));
        json_decref(j);
    }
    free(line);
    fclose(f);
    if (n == 0) fprintf(stderr, "tandem bench spec: %s has no prompts\n", path);
    if (n <= 0) {
        free(v);
        return -1;
    }
    *out = v;
    return n;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, size_t n, double q)
{
    if (!n) return 0;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

struct slot {
    tdm_req_t *r;
    int prompt, seen;
    double t_last;
};

/* Runs every prompt at `batch` in flight; k < 0: no speculation. Outputs go to outs[prompt]. */
static bool run_config(tdm_engine_t *e, const tdm_tok_t *tok, const struct bench_opts *o,
                       const struct tdm_spec_opts *so, int batch, int k, int32_t **ids,
                       const int *n_ids, int n_prompts, int32_t **outs, int *n_outs,
                       struct result *res)
{
    struct tdm_sched_opts sopt = {.max_seqs = batch, .watermark_pages = -1};
    tdm_sched_t *s = NULL;
    tdm_spec_t *sp = NULL;
    if (tdm_sched_create(e, tok, &sopt, &s) != TDM_OK) {
        tdm_tool_fail("scheduler");
        return false;
    }
    if (k >= 0) {
        struct tdm_spec_opts so2 = *so;
        so2.k = k;
        if (tdm_spec_create(e, &so2, &sp) != TDM_OK || tdm_spec_attach(sp, s) != TDM_OK) {
            tdm_tool_fail("speculation");
            tdm_spec_destroy(sp);
            tdm_sched_destroy(s);
            return false;
        }
    }
    size_t cap_gaps = (size_t)n_prompts * (size_t)o->max_tokens + 1, n_gaps = 0;
    double *gaps = malloc(cap_gaps * sizeof *gaps), tpot_sum = 0;
    struct slot *sl = calloc((size_t)batch, sizeof *sl);
    int next = 0, done = 0, n_tpot = 0;
    int64_t tokens = 0;
    bool ok = gaps && sl;
    double t0 = tdm_now_s();
    while (ok && done < n_prompts) {
        for (int i = 0; i < batch && next < n_prompts; i++) {
            if (sl[i].r) continue;
            struct tdm_req_params p = {.prompt = ids[next],
                                       .n_prompt = n_ids[next],
                                       .max_tokens = (int)o->max_tokens,
                                       .ignore_eos = true,
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = (float)o->temp;
            p.sampling.top_p = (float)o->top_p;
            p.sampling.top_k = (int)o->top_k;
            p.sampling.seed = (uint64_t)o->seed + (uint64_t)next;
            if (tdm_sched_submit(s, &p, &sl[i].r) != TDM_OK) {
                tdm_tool_fail("request");
                ok = false;
                break;
            }
            sl[i].prompt = next++;
            sl[i].seen = 0;
            sl[i].t_last = 0;
        }
        if (!ok) break;
        tdm_sched_step(s);
        double now = tdm_now_s();
        for (int i = 0; i < batch; i++) {
            if (!sl[i].r) continue;
            struct tdm_req_view v;
            tdm_req_lock(sl[i].r, &v);
            /* one gap per arrival, as a streaming client sees it (several tokens of one step
             * arrive together); the first token's wait is TTFT, not ITL */
            if (v.n_out > sl[i].seen && sl[i].seen > 0 && n_gaps < cap_gaps)
                gaps[n_gaps++] = now - sl[i].t_last;
            if (v.n_out > sl[i].seen) sl[i].t_last = now;
            sl[i].seen = v.n_out;
            enum tdm_finish fin = v.finish;
            if (fin != TDM_FINISH_NONE) {
                int pi = sl[i].prompt;
                n_outs[pi] = v.n_out;
                memcpy(outs[pi], v.tokens, (size_t)v.n_out * sizeof(int32_t));
                if (v.n_out > 1) {
                    tpot_sum += (double)(v.t_end_ns - v.t_first_ns) * 1e-9 / (v.n_out - 1);
                    n_tpot++;
                }
                tokens += v.n_out;
                if (fin == TDM_FINISH_ERROR) {
                    fprintf(stderr, "tandem bench spec: a request failed: %s\n", v.error_msg);
                    ok = false;
                }
            }
            tdm_req_unlock(sl[i].r);
            if (fin != TDM_FINISH_NONE) {
                tdm_req_release(sl[i].r);
                sl[i].r = NULL;
                done++;
            }
        }
    }
    double wall = tdm_now_s() - t0;
    for (int i = 0; sl && i < batch; i++)
        if (sl[i].r) tdm_req_release(sl[i].r);
    *res = (struct result){.batch = batch,
                           .k = k,
                           .tokens = tokens,
                           .tok_s = wall > 0 ? (double)tokens / wall : 0,
                           .tpot_ms = n_tpot ? tpot_sum / n_tpot * 1e3 : 0,
                           .tau = 1.0};
    if (ok) {
        res->itl_p50_ms = pct(gaps, n_gaps, 0.50) * 1e3;
        res->itl_p99_ms = pct(gaps, n_gaps, 0.99) * 1e3;
    }
    if (sp) {
        tdm_spec_get_stats(sp, &res->st);
        res->tau = res->st.tau;
    }
    free(gaps);
    free(sl);
    tdm_sched_destroy(s);
    tdm_spec_destroy(sp);
    return ok;
}

static void k_name(int k, char *buf, size_t cap)
{
    if (k < 0)
        snprintf(buf, cap, "none");
    else if (k == 0)
        snprintf(buf, cap, "auto");
    else
        snprintf(buf, cap, "k=%d", k);
}

static void print_table(const struct result *rs, int n)
{
    printf("%-6s %-6s %6s %-30s %9s %9s %9s %9s %8s %5s\n", "batch", "k", "tau",
           "accept by position", "itl p50", "itl p99", "tpot ms", "tok/s", "speedup", "same");
    for (int i = 0; i < n; i++) {
        const struct result *r = &rs[i];
        char k[16], acc[64] = "-";
        k_name(r->k, k, sizeof k);
        size_t m = 0;
        for (int j = 0; j < TDM_SPEC_MAX_K && r->st.drafted_at[j] && m + 8 < sizeof acc; j++)
            m += (size_t)snprintf(acc + m, sizeof acc - m, "%s%.2f", j ? " " : "",
                                  (double)r->st.accepted_at[j] / (double)r->st.drafted_at[j]);
        printf("%-6d %-6s %6.3f %-30s %9.2f %9.2f %9.2f %9.1f %8.3f %5s\n", r->batch, k, r->tau,
               acc, r->itl_p50_ms, r->itl_p99_ms, r->tpot_ms, r->tok_s, r->speedup,
               r->k < 0       ? "-"
               : r->identical ? "yes"
                              : "no");
    }
}

static void print_json(const struct bench_opts *o, const char *desc, int n_prompts,
                       const struct result *rs, int n)
{
    json_t *root = json_object(), *arr = json_array();
    json_object_set_new(root, "model", json_string(o->model ? o->model : TDM_DEFAULT_MODEL_FILE));
    json_object_set_new(root, "spec", json_string(desc));
    json_object_set_new(root, "prompts", json_integer(n_prompts));
    json_object_set_new(root, "max_tokens", json_integer(o->max_tokens));
    json_object_set_new(root, "temperature", json_real(o->temp));
    for (int i = 0; i < n; i++) {
        const struct result *r = &rs[i];
        char k[16];
        k_name(r->k, k, sizeof k);
        json_t *x = json_object(), *acc = json_array();
        for (int j = 0; j < TDM_SPEC_MAX_K && r->st.drafted_at[j]; j++)
            json_array_append_new(
                acc, json_real((double)r->st.accepted_at[j] / (double)r->st.drafted_at[j]));
        json_object_set_new(x, "batch", json_integer(r->batch));
        json_object_set_new(x, "k", json_string(k));
        json_object_set_new(x, "tau", json_real(r->tau));
        json_object_set_new(x, "accept_by_position", acc);
        json_object_set_new(x, "drafted", json_integer((json_int_t)r->st.drafted));
        json_object_set_new(x, "accepted", json_integer((json_int_t)r->st.accepted));
        json_object_set_new(x, "itl_p50_ms", json_real(r->itl_p50_ms));
        json_object_set_new(x, "itl_p99_ms", json_real(r->itl_p99_ms));
        json_object_set_new(x, "tpot_ms", json_real(r->tpot_ms));
        json_object_set_new(x, "tokens_per_s", json_real(r->tok_s));
        json_object_set_new(x, "speedup", json_real(r->speedup));
        if (r->k >= 0) json_object_set_new(x, "identical", json_boolean(r->identical));
        json_array_append_new(arr, x);
    }
    json_object_set_new(root, "results", arr);
    char *s = json_dumps(root, JSON_COMPACT);
    if (s) printf("%s\n", s);
    free(s);
    json_decref(root);
}

int tdm_cmd_bench_spec(int argc, char **argv)
{
    struct bench_opts o = {.max_tokens = 64,
                           .top_p = 1.0,
                           .batches = {1, 4, 16},
                           .n_batches = 3,
                           .ks = {0},
                           .n_ks = 1,
                           .ctx = 2048};
    g_o = &o;
    const struct tdm_opt own[] = {
        TDM_OPT_S("model", &o.model),
        TDM_OPT_S("prompts", &o.prompts),
        TDM_OPT_I("max-tokens", &o.max_tokens, 1, 1 << 16),
        TDM_OPT_P("batch", opt_batches, NULL),
        TDM_OPT_I("limit", &o.limit, 1, 1 << 20),
        TDM_OPT_F("temperature", &o.temp, 0, 100),
        TDM_OPT_F("top-p", &o.top_p, 1e-9, 1),
        TDM_OPT_I("top-k", &o.top_k, 0, 1 << 24),
        TDM_OPT_I("seed", &o.seed, 0, 9007199254740992.0),
        TDM_OPT_B("raw", &o.raw),
        TDM_OPT_I("threads", &o.threads, 1, 1024),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &o.backend_kind),
        TDM_OPT_F("gpu-memory-fraction", &o.gpu_frac, 0.05, 1.0),
        TDM_OPT_I("ctx", &o.ctx, 16, 1 << 20),
        TDM_OPT_B("json", &o.json),
        TDM_OPT_B("q-one-hot", &o.one_hot),
        TDM_OPT_END,
    };
    struct tdm_opt spec_t[TDM_TOOL_SPEC_OPTS];
    tdm_tool_spec_table(&o.spec_cli, spec_t);
    for (struct tdm_opt *t = spec_t; t->name; t++) /* --spec-k takes a list here */
        if (!strcmp(t->name, "spec-k")) *t = (struct tdm_opt)TDM_OPT_P("spec-k", opt_ks, NULL);
    const struct tdm_opt *const tables[] = {own, spec_t, NULL};
    int prc = tdm_tool_parse("bench spec", argc, argv, tables, usage);
    if (prc) return prc == 1 ? 0 : 2;
    if (!o.prompts) {
        fprintf(stderr, "tandem bench spec: --prompts FILE is required\n");
        return 2;
    }
    char **texts = NULL;
    int n_prompts = read_prompts(o.prompts, &texts, (int)o.limit);
    if (n_prompts < 0) return 2;
    struct tdm_spec_opts so;
    bool on = false, ok = tdm_tool_spec_opts(&o.spec_cli, &so, &on);
    if (ok && so.method == TDM_SPEC_NONE) {
        fprintf(stderr,
                "tandem bench spec: give the drafter: --spec self (or draft, mtp, eagle)\n");
        ok = false;
    }
    if (ok && o.one_hot && so.accept != TDM_SPEC_ACCEPT_REJECTION) {
        fprintf(stderr, "tandem bench spec: --q-one-hot is for --spec-accept rejection\n");
        ok = false;
    }
    so.q_one_hot = o.one_hot;
    if (!ok) {
        for (int i = 0; i < n_prompts; i++)
            free(texts[i]);
        free(texts);
        return 2;
    }
    int rc = 1, max_b = 0;
    for (int i = 0; i < o.n_batches; i++)
        max_b = TDM_MAX(max_b, o.batches[i]);
    struct tdm_model *m = tdm_tool_load_model(o.model);
    tdm_tok_t *tok = NULL;
    tdm_engine_t *e = NULL;
    struct tdm_model *draft = NULL;
    struct tdm_chat_template tmpl = {0};
    int32_t **ids = calloc((size_t)n_prompts, sizeof *ids), **outs[2] = {0};
    int *n_ids = calloc((size_t)n_prompts, sizeof *n_ids), *n_outs[2] = {0};
    struct result *rs = calloc((size_t)o.n_batches * (size_t)(1 + o.n_ks), sizeof *rs);
    int n_rs = 0;
    if (!m || !ids || !n_ids || !rs) goto out;
    if (!(tok = tdm_tool_load_tokenizer(m, false))) goto out;
    if (!o.raw && tdm_chat_template_detect(m->chat_template, &tmpl) != TDM_OK) {
        fprintf(stderr, "tandem bench spec: no chat template tandem understands; use --raw\n");
        goto out;
    }
    for (int i = 0; i < n_prompts; i++) {
        char *rendered = NULL;
        const char *text = texts[i];
        bool add_bos = tdm_tok_adds_bos(tok);
        if (!o.raw) {
            struct tdm_chat_msg msg = {"user", texts[i]};
            if (tdm_chat_render(&tmpl, &msg, 1, true, &rendered) != TDM_OK) {
                tdm_tool_fail("chat template");
                goto out;
            }
            text = rendered;
            if (tmpl.add_bos_text) add_bos = false;
        }
        size_t len = strlen(text), n_out = 0;
        ids[i] = malloc((len + 8) * sizeof(int32_t));
        int flags = (o.raw ? 0 : TDM_TOK_PARSE_SPECIAL) | (add_bos ? TDM_TOK_ADD_BOS : 0);
        tdm_status st =
            ids[i] ? tdm_tok_encode(tok, text, len, flags, ids[i], len + 8, &n_out) : TDM_ENOMEM;
        free(rendered);
        if (st != TDM_OK || !n_out ||
            n_out + (size_t)o.max_tokens + TDM_SPEC_MAX_K > (size_t)o.ctx) {
            fprintf(stderr, "tandem bench spec: prompt %d does not encode or does not fit --ctx\n",
                    i + 1);
            goto out;
        }
        n_ids[i] = (int)n_out;
    }
    int ps = 16;
    struct tdm_engine_opts eo = {
        .n_threads = (int)o.threads,
        .batch_invariant = true, /* "same" compares tokens across batch shapes */
        .page_size = ps,
        .max_ctx = (int)o.ctx,
        .max_seqs = max_b,
        .max_batch_tokens = 512,
        .max_logit_rows = TDM_MIN(512, max_b * (1 + TDM_SPEC_MAX_K)),
        .kv_pages = (int64_t)max_b * ((o.ctx + TDM_SPEC_MAX_K + ps - 1) / ps + 1),
        .backend_kind = o.backend_kind,
        .gpu_memory_fraction = o.gpu_frac,
    };
    struct tdm_kv_group draft_group;
    if (!tdm_tool_spec_load_draft("tandem bench spec", &so, m, &eo, &draft_group, &draft)) {
        rc = 2;
        goto out;
    }
    if (tdm_engine_create(m, &eo, &e) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out;
    }
    for (int w = 0; w < 2; w++) {
        outs[w] = calloc((size_t)n_prompts, sizeof *outs[w]);
        n_outs[w] = calloc((size_t)n_prompts, sizeof *n_outs[w]);
        if (!outs[w] || !n_outs[w]) goto out;
        for (int i = 0; i < n_prompts; i++)
            if (!(outs[w][i] = malloc((size_t)o.max_tokens * sizeof(int32_t)))) goto out;
    }
    char desc[160] = "";
    { /* warm-up, not measured: the weights and the KV pool paged in */
        struct result warm;
        if (!run_config(e, tok, &o, &so, 1, -1, ids, n_ids, 1, outs[0], n_outs[0], &warm)) goto out;
    }
    for (int b = 0; b < o.n_batches; b++) {
        struct result *base = &rs[n_rs];
        if (!run_config(e, tok, &o, &so, o.batches[b], -1, ids, n_ids, n_prompts, outs[0],
                        n_outs[0], &rs[n_rs]))
            goto out;
        base->speedup = 1.0;
        n_rs++;
        for (int k = 0; k < o.n_ks; k++) {
            struct result *r = &rs[n_rs];
            if (!run_config(e, tok, &o, &so, o.batches[b], o.ks[k], ids, n_ids, n_prompts, outs[1],
                            n_outs[1], r))
                goto out;
            r->speedup = base->tok_s > 0 ? r->tok_s / base->tok_s : 0;
            r->identical = true;
            for (int i = 0; i < n_prompts; i++)
                r->identical = r->identical && n_outs[0][i] == n_outs[1][i] &&
                               !memcmp(outs[0][i], outs[1][i], (size_t)n_outs[0][i] * 4);
            n_rs++;
            if (!o.json)
                fprintf(stderr, "tandem bench spec: batch %d, %s: tau %.3f, %.1f tok/s (%.3fx)\n",
                        r->batch, o.ks[k] ? "fixed k" : "auto", r->tau, r->tok_s, r->speedup);
        }
    }
    {
        tdm_spec_t *sp = NULL;
        if (tdm_spec_create(e, &so, &sp) == TDM_OK) tdm_spec_describe(sp, desc, sizeof desc);
        tdm_spec_destroy(sp);
    }
    if (o.json) {
        print_json(&o, desc, n_prompts, rs, n_rs);
    } else {
        printf("speculation: %s; %d prompts, %lld tokens each, temperature %g\n", desc, n_prompts,
               (long long)o.max_tokens, o.temp);
        print_table(rs, n_rs);
    }
    rc = 0;
out:
    for (int w = 0; w < 2; w++) {
        for (int i = 0; outs[w] && i < n_prompts; i++)
            free(outs[w][i]);
        free(outs[w]);
        free(n_outs[w]);
    }
    for (int i = 0; i < n_prompts; i++) {
        if (ids) free(ids[i]);
        free(texts[i]);
    }
    free(texts);
    free(ids);
    free(n_ids);
    free(rs);
    tdm_engine_destroy(e);
    tdm_model_free(draft);
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
    tdm_model_free(m);
    return rc;
}
