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
 * With --spec eagle, --spec-tree-budget takes a list too: each k runs once per tree budget,
 * and rows say which (and how many tree steps kept drafts off the head's first guess).
 *
 * The scheduler runs on this thread, one step at a time, so a token's arrival time is the end
 * of the step that published it. Prompts: a file of one JSON string per line, each a user
 * message rendered through the model's chat template (--raw: used as it is).
 *
 * --attention: a micro-benchmark of the CPU backend's attention op alone (no model): a token
 * tree of T tokens (the last committed token and T - 1 nodes of a 4-ary tree, EAGLE-like)
 * against a chain of T tokens (its reference, timed in the same run), over the same prefix of
 * P positions of random KV, for each P of --attention-prefix and T of --attention-tokens; the
 * default model's attention shape (9 heads, 3 KV heads, head size 64; page size 16). Each is
 * timed as the best of nine batches of calls, the chain's and the tree's taken in turn; each
 * prints its outputs' checksum, and every tree token's output is checked against a
 * double-precision softmax over its path.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/tools_int.h"

enum { MAX_BATCHES = 8, MAX_KS = 8, MAX_BUDGETS = 8, MAX_ATT = 8 };

struct bench_opts {
    const char *model, *prompts;
    int64_t max_tokens, threads, limit, ctx;
    double temp, top_p;
    int64_t top_k, seed;
    int backend_kind;
    double gpu_frac;
    bool raw, json, one_hot, attention;
    int batches[MAX_BATCHES], n_batches;
    int ks[MAX_KS], n_ks;                  /* 0: auto */
    int budgets[MAX_BUDGETS], n_budgets;   /* eagle's tree budgets; none: the default */
    int att_prefix[MAX_ATT], n_att_prefix; /* --attention: prefix lengths */
    int att_tokens[MAX_ATT], n_att_tokens; /* --attention: span tokens */
    struct tdm_tool_spec spec_cli;
};

struct result {
    int batch;
    int budget; /* eagle: the tree budget; 0: not a tree */
    int k;      /* -1: no speculation; 0: auto */
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
            "                          lengths, e.g. auto,1,2,4 (default auto)\n"
            "  --spec-tree-budget LIST eagle: tree budgets to run for each k, e.g. 8,16,32\n"
            "  --attention             instead: the CPU attention op, a token tree of T\n"
            "                          tokens against a chain of T tokens (no model)\n"
            "  --attention-prefix LIST prefix lengths (default 128,512,2048,8192)\n"
            "  --attention-tokens LIST tokens T (at most %d; default 8,16,32,64)\n",
            TDM_TREE_MAX_NODES);
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
static bool in_range(const int *v, int n, int hi, const char *name)
{
    for (int i = 0; i < n; i++)
        if (v[i] > hi) {
            fprintf(stderr, "--%s: %d is over %d\n", name, v[i], hi);
            return false;
        }
    return true;
}
static bool opt_budgets(const char *arg, void *dst)
{
    (void)dst;
    return parse_int_list(arg, g_o->budgets, &g_o->n_budgets, MAX_BUDGETS, false,
                          "spec-tree-budget") &&
           in_range(g_o->budgets, g_o->n_budgets, TDM_TREE_MAX_NODES, "spec-tree-budget");
}
static bool opt_att_prefix(const char *arg, void *dst)
{
    (void)dst;
    return parse_int_list(arg, g_o->att_prefix, &g_o->n_att_prefix, MAX_ATT, false,
                          "attention-prefix");
}
static bool opt_att_tokens(const char *arg, void *dst)
{
    (void)dst;
    return parse_int_list(arg, g_o->att_tokens, &g_o->n_att_tokens, MAX_ATT, false,
                          "attention-tokens") &&
           in_range(g_o->att_tokens, g_o->n_att_tokens, TDM_TREE_MAX_NODES, "attention-tokens");
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

/* Runs every prompt at `batch` in flight; k < 0: no speculation; budget > 0: eagle's tree
 * budget. Outputs go to outs[prompt]. */
static bool run_config(tdm_engine_t *e, const tdm_tok_t *tok, const struct bench_opts *o,
                       const struct tdm_spec_opts *so, int batch, int k, int budget, int32_t **ids,
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
        if (budget > 0) so2.tree_budget = budget;
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
                           .budget = k >= 0 ? budget : 0,
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
    printf("%-6s %-6s %-6s %6s %-30s %9s %9s %9s %9s %8s %5s\n", "batch", "k", "tree", "tau",
           "accept by position", "itl p50", "itl p99", "tpot ms", "tok/s", "speedup", "same");
    for (int i = 0; i < n; i++) {
        const struct result *r = &rs[i];
        char k[16], acc[64] = "-", tree[16] = "-";
        k_name(r->k, k, sizeof k);
        if (r->budget > 0) snprintf(tree, sizeof tree, "%d", r->budget);
        size_t m = 0;
        for (int j = 0; j < TDM_SPEC_MAX_K && r->st.drafted_at[j] && m + 8 < sizeof acc; j++)
            m += (size_t)snprintf(acc + m, sizeof acc - m, "%s%.2f", j ? " " : "",
                                  (double)r->st.accepted_at[j] / (double)r->st.drafted_at[j]);
        printf("%-6d %-6s %-6s %6.3f %-30s %9.2f %9.2f %9.2f %9.1f %8.3f %5s\n", r->batch, k, tree,
               r->tau, acc, r->itl_p50_ms, r->itl_p99_ms, r->tpot_ms, r->tok_s, r->speedup,
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
        if (r->budget > 0) {
            json_object_set_new(x, "budget", json_integer(r->budget));
            json_object_set_new(x, "tree_steps", json_integer((json_int_t)r->st.tree_steps));
            json_object_set_new(x, "accepted_other_branch",
                                json_integer((json_int_t)r->st.accepted_other_branch));
        }
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

/* ---- --attention: a tree of T tokens against a chain of T tokens on the CPU ---- */

enum { ATT_HEADS = 9, ATT_KV_HEADS = 3, ATT_HEAD_DIM = 64, ATT_PAGE = 16, ATT_ARITY = 4 };

struct att_case {
    int prefix, tokens, depth;
    double chain_us, tree_us, chain_sum, tree_sum, max_err;
};

/* One step's metadata: a chain of T tokens at positions [P, P + T), or the last committed token
 * at P and T - 1 nodes of a 4-ary tree (node i's parent: (i - 1) / 4) at P + their depth, each
 * in the slot of position P + its index (a verified tree's layout, sched.h). Pages are the
 * identity, so a slot is its position. */
struct att_step {
    struct tdm_step st;
    int32_t tok[TDM_TREE_MAX_NODES], pos[TDM_TREE_MAX_NODES], slot[TDM_TREE_MAX_NODES];
    int32_t tseq[TDM_TREE_MAX_NODES], sts[2], kvl[1], sps[2], prefix[1], tns[2];
    uint64_t mask[TDM_TREE_MAX_NODES];
    int32_t *pages;
};

static void att_step_make(struct att_step *a, int P, int T, bool tree, int32_t *pages, int n_pages)
{
    memset(a, 0, sizeof *a);
    int end = P + 1;
    for (int i = 0; i < T; i++) {
        const int par = (i - 1) / ATT_ARITY;
        a->slot[i] = P + i;
        a->pos[i] = !tree || i == 0 ? P + i : a->pos[par] + 1;
        a->mask[i] = !tree || i == 0 ? 0 : a->mask[par] | (uint64_t)1 << (i - 1);
        end = TDM_MAX(end, a->pos[i] + 1);
    }
    a->sts[1] = T;
    a->kvl[0] = end;
    a->sps[1] = n_pages;
    a->prefix[0] = P + 1;
    a->tns[1] = T - 1;
    a->st = (struct tdm_step){.n_tokens = T,
                              .n_seqs = 1,
                              .tokens = a->tok,
                              .positions = a->pos,
                              .slots = a->slot,
                              .token_seq = a->tseq,
                              .seq_token_start = a->sts,
                              .seq_kv_len = a->kvl,
                              .seq_page_start = a->sps,
                              .page_ids = pages,
                              .page_size = ATT_PAGE,
                              .n_layers = 1};
    if (tree && T > 1) {
        a->st.tree_mask = a->mask;
        a->st.seq_prefix = a->prefix;
        a->st.tree_node_start = a->tns;
        a->st.tree_slots = a->slot + 1;
    }
}

/* The best time of one call (microseconds) of the chain's step and of the tree's, over batches
 * of calls (~50 ms each) taken in turn, so that both see the same machine. */
static void att_time(tdm_backend_t *b, const float *q, const struct tdm_step *chain,
                     const struct tdm_step *tree, const struct tdm_kv_layer *kv, float *out,
                     double *chain_us, double *tree_us)
{
    const float scale = 1.0f / sqrtf((float)ATT_HEAD_DIM);
    int reps = 1;
    for (;;) { /* calls per batch: enough for ~50 ms of the chain */
        double t0 = tdm_now_s();
        for (int r = 0; r < reps; r++)
            b->iface->attention(b, q, ATT_HEADS, chain, kv, scale, out);
        double dt = tdm_now_s() - t0;
        if (dt > 0.05 || reps >= (1 << 20)) break;
        reps *= dt > 0.005 ? 2 : 8;
    }
    double best[2] = {1e30, 1e30};
    for (int batch = 0; batch < 9; batch++)
        for (int w = 0; w < 2; w++) {
            const struct tdm_step *st = w ? tree : chain;
            double t0 = tdm_now_s();
            for (int r = 0; r < reps; r++)
                b->iface->attention(b, q, ATT_HEADS, st, kv, scale, out);
            best[w] = TDM_MIN(best[w], (tdm_now_s() - t0) / reps);
        }
    *chain_us = best[0] * 1e6;
    *tree_us = best[1] * 1e6;
}

/* The largest error of token t's output (out: the step's) against a double-precision softmax
 * over what it sees: positions [0, P') (P' its prefix, or its own position + 1 for a chain
 * token) through the identity page table, then its mask's nodes. */
static double att_check(const float *q, const float *kvb, const struct att_step *a, int t,
                        const float *out)
{
    const struct tdm_step *st = &a->st;
    const size_t head = (size_t)ATT_PAGE * ATT_HEAD_DIM, page = 2 * ATT_KV_HEADS * head;
    const uint64_t m = st->tree_mask ? st->tree_mask[t] : 0;
    const int paged = m ? st->seq_prefix[0] : st->positions[t] + 1;
    const int n = paged + __builtin_popcountll(m);
    int32_t *seen = malloc((size_t)n * sizeof *seen);
    double *w = malloc((size_t)n * sizeof *w);
    if (!seen || !w) {
        free(seen);
        free(w);
        return 1e30;
    }
    int k = 0;
    for (int p = 0; p < paged; p++)
        seen[k++] = p; /* identity pages: a position's slot is itself */
    for (uint64_t x = m; x; x &= x - 1)
        seen[k++] = st->tree_slots[__builtin_ctzll(x)];
    double worst = 0;
    for (int h = 0; h < ATT_HEADS; h++) {
        const int g = h / (ATT_HEADS / ATT_KV_HEADS);
        const float *qh = q + ((size_t)t * ATT_HEADS + h) * ATT_HEAD_DIM;
        double mx = -1e300, sum = 0;
        for (int j = 0; j < n; j++) {
            const float *kr = kvb + (size_t)(seen[j] / ATT_PAGE) * page + (size_t)g * head +
                              (size_t)(seen[j] % ATT_PAGE) * ATT_HEAD_DIM;
            double dot = 0;
            for (int i = 0; i < ATT_HEAD_DIM; i++)
                dot += (double)qh[i] * kr[i];
            w[j] = dot * (double)(1.0f / sqrtf((float)ATT_HEAD_DIM));
            mx = TDM_MAX(mx, w[j]);
        }
        for (int j = 0; j < n; j++)
            sum += (w[j] = exp(w[j] - mx));
        for (int i = 0; i < ATT_HEAD_DIM; i++) {
            double o = 0;
            for (int j = 0; j < n; j++)
                o += w[j] *
                     kvb[(size_t)(seen[j] / ATT_PAGE) * page + (size_t)(ATT_KV_HEADS + g) * head +
                         (size_t)(seen[j] % ATT_PAGE) * ATT_HEAD_DIM + i];
            const double got = out[((size_t)t * ATT_HEADS + h) * ATT_HEAD_DIM + i];
            worst = TDM_MAX(worst, fabs(got - o / sum));
        }
    }
    free(seen);
    free(w);
    return worst;
}

static bool bench_attention(const struct bench_opts *o)
{
    static const int def_prefix[] = {128, 512, 2048, 8192}, def_tokens[] = {8, 16, 32, 64};
    const int *prefix = o->n_att_prefix ? o->att_prefix : def_prefix;
    const int *tokens = o->n_att_tokens ? o->att_tokens : def_tokens;
    const int n_p = o->n_att_prefix ? o->n_att_prefix : 4,
              n_t = o->n_att_tokens ? o->n_att_tokens : 4;
    struct tdm_backend_cpu_opts bo = {.n_threads = (int)o->threads};
    tdm_backend_t *b = NULL;
    if (tdm_backend_cpu_create(&bo, &b) != TDM_OK) {
        tdm_tool_fail("cpu backend");
        return false;
    }
    struct att_case *cases = calloc((size_t)n_p * n_t, sizeof *cases);
    struct att_step *ch = malloc(sizeof *ch), *tr = malloc(sizeof *tr);
    bool ok = cases && ch && tr;
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int n_cases = 0;
    for (int pi = 0; ok && pi < n_p; pi++)
        for (int ti = 0; ok && ti < n_t; ti++) {
            const int P = prefix[pi], T = tokens[ti];
            const int n_pages = (P + T + ATT_PAGE - 1) / ATT_PAGE + 1;
            const size_t kv_floats = (size_t)n_pages * 2 * ATT_KV_HEADS * ATT_PAGE * ATT_HEAD_DIM;
            const size_t q_floats = (size_t)T * ATT_HEADS * ATT_HEAD_DIM;
            float *kv = b->iface->buf_alloc(b, kv_floats * sizeof(float));
            float *q = b->iface->buf_alloc(b, q_floats * sizeof(float));
            float *out = b->iface->buf_alloc(b, q_floats * sizeof(float));
            int32_t *pages = malloc((size_t)n_pages * sizeof *pages);
            if (!kv || !q || !out || !pages) {
                fprintf(stderr, "tandem bench spec: out of memory\n");
                ok = false;
            }
            for (size_t i = 0; ok && i < kv_floats; i++)
                kv[i] =
                    (float)((double)(tdm_tool_splitmix64(&rng) >> 11) / 9007199254740992.0 * 2 - 1);
            for (size_t i = 0; ok && i < q_floats; i++)
                q[i] =
                    (float)((double)(tdm_tool_splitmix64(&rng) >> 11) / 9007199254740992.0 * 4 - 2);
            for (int i = 0; ok && i < n_pages; i++)
                pages[i] = i;
            if (ok) {
                struct att_case *c = &cases[n_cases++];
                struct tdm_kv_layer L = {.base = kv,
                                         .n_kv_heads = ATT_KV_HEADS,
                                         .head_dim = ATT_HEAD_DIM,
                                         .page_size = ATT_PAGE,
                                         .n_pages = n_pages};
                att_step_make(ch, P, T, false, pages, n_pages);
                att_step_make(tr, P, T, true, pages, n_pages);
                c->prefix = P;
                c->tokens = T;
                c->depth = tr->pos[T - 1] - P;
                att_time(b, q, &ch->st, &tr->st, &L, out, &c->chain_us, &c->tree_us);
                const float scale = 1.0f / sqrtf((float)ATT_HEAD_DIM);
                b->iface->attention(b, q, ATT_HEADS, &ch->st, &L, scale, out);
                for (size_t i = 0; i < q_floats; i++)
                    c->chain_sum += out[i];
                b->iface->attention(b, q, ATT_HEADS, &tr->st, &L, scale, out);
                for (size_t i = 0; i < q_floats; i++)
                    c->tree_sum += out[i];
                for (int t = 0; t < T; t++)
                    c->max_err = TDM_MAX(c->max_err, att_check(q, kv, tr, t, out));
            }
            free(pages);
            if (kv) b->iface->buf_free(b, kv);
            if (q) b->iface->buf_free(b, q);
            if (out) b->iface->buf_free(b, out);
        }
    const double tol = 1e-4;
    if (ok && o->json) {
        json_t *root = json_object(), *arr = json_array();
        char be[64];
        snprintf(be, sizeof be, "cpu %s", tdm_backend_cpu_isa());
        json_object_set_new(root, "backend", json_string(be));
        json_object_set_new(root, "heads", json_integer(ATT_HEADS));
        json_object_set_new(root, "kv_heads", json_integer(ATT_KV_HEADS));
        json_object_set_new(root, "head_dim", json_integer(ATT_HEAD_DIM));
        for (int i = 0; i < n_cases; i++) {
            const struct att_case *c = &cases[i];
            json_t *x = json_object();
            json_object_set_new(x, "prefix", json_integer(c->prefix));
            json_object_set_new(x, "tokens", json_integer(c->tokens));
            json_object_set_new(x, "tree_depth", json_integer(c->depth));
            json_object_set_new(x, "chain_us", json_real(c->chain_us));
            json_object_set_new(x, "tree_us", json_real(c->tree_us));
            json_object_set_new(x, "ratio", json_real(c->tree_us / c->chain_us));
            json_object_set_new(x, "chain_checksum", json_real(c->chain_sum));
            json_object_set_new(x, "tree_checksum", json_real(c->tree_sum));
            json_object_set_new(x, "tree_max_error", json_real(c->max_err));
            json_object_set_new(x, "tree_matches_reference", json_boolean(c->max_err <= tol));
            json_array_append_new(arr, x);
        }
        json_object_set_new(root, "cases", arr);
        char *js = json_dumps(root, JSON_COMPACT);
        if (js) printf("%s\n", js);
        free(js);
        json_decref(root);
    } else if (ok) {
        printf("attention on the CPU (%s): %d heads, %d KV heads, head size %d, page size %d; a "
               "tree of T tokens (4-ary) against a chain of T tokens over the same prefix\n",
               tdm_backend_cpu_isa(), ATT_HEADS, ATT_KV_HEADS, ATT_HEAD_DIM, ATT_PAGE);
        printf("%8s %6s %6s %10s %10s %8s %14s %14s %10s\n", "prefix", "tokens", "depth",
               "chain us", "tree us", "ratio", "chain sum", "tree sum", "tree err");
        for (int i = 0; i < n_cases; i++) {
            const struct att_case *c = &cases[i];
            printf("%8d %6d %6d %10.1f %10.1f %8.3f %14.6f %14.6f %10.2e%s\n", c->prefix, c->tokens,
                   c->depth, c->chain_us, c->tree_us, c->tree_us / c->chain_us, c->chain_sum,
                   c->tree_sum, c->max_err, c->max_err <= tol ? "" : " WRONG");
        }
    }
    for (int i = 0; ok && i < n_cases; i++)
        ok = cases[i].max_err <= tol;
    free(cases);
    free(ch);
    free(tr);
    tdm_backend_destroy(b);
    return ok;
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
        TDM_OPT_B("attention", &o.attention),
        TDM_OPT_P("attention-prefix", opt_att_prefix, NULL),
        TDM_OPT_P("attention-tokens", opt_att_tokens, NULL),
        TDM_OPT_END,
    };
    struct tdm_opt spec_t[TDM_TOOL_SPEC_OPTS];
    tdm_tool_spec_table(&o.spec_cli, spec_t);
    for (struct tdm_opt *t = spec_t; t->name; t++) { /* --spec-k, -tree-budget: lists here */
        if (!strcmp(t->name, "spec-k")) *t = (struct tdm_opt)TDM_OPT_P("spec-k", opt_ks, NULL);
        if (!strcmp(t->name, "spec-tree-budget"))
            *t = (struct tdm_opt)TDM_OPT_P("spec-tree-budget", opt_budgets, NULL);
    }
    const struct tdm_opt *const tables[] = {own, spec_t, NULL};
    int prc = tdm_tool_parse("bench spec", argc, argv, tables, usage);
    if (prc) return prc == 1 ? 0 : 2;
    if (o.attention) return bench_attention(&o) ? 0 : 1;
    if (!o.prompts) {
        fprintf(stderr, "tandem bench spec: --prompts FILE is required\n");
        return 2;
    }
    char **texts = NULL;
    int n_prompts = tdm_tool_read_prompts("tandem bench spec", o.prompts, (int)o.limit, &texts);
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
    if (ok && o.n_budgets && so.method != TDM_SPEC_EAGLE) {
        fprintf(stderr, "tandem bench spec: --spec-tree-budget is for --spec eagle\n");
        ok = false;
    }
    /* the engine's rows: the largest tree's */
    for (int i = 0; i < o.n_budgets; i++)
        so.tree_budget = TDM_MAX(so.tree_budget, o.budgets[i]);
    const int n_trees = so.method == TDM_SPEC_EAGLE && o.n_budgets ? o.n_budgets : 1;
    if (!ok) {
        tdm_tool_free_prompts(texts, n_prompts);
        return 2;
    }
    int rc = 1, max_b = 0;
    for (int i = 0; i < o.n_batches; i++)
        max_b = TDM_MAX(max_b, o.batches[i]);
    struct tdm_model *m = tdm_tool_load_model(o.model);
    tdm_tok_t *tok = NULL;
    tdm_engine_t *e = NULL;
    struct tdm_model *draft = NULL;
    int32_t **ids = NULL, **outs[2] = {0};
    int *n_ids = NULL, *n_outs[2] = {0};
    struct result *rs = calloc((size_t)o.n_batches * (size_t)(1 + o.n_ks * n_trees), sizeof *rs);
    int n_rs = 0;
    if (!m || !rs) goto out;
    if (!(tok = tdm_tool_load_tokenizer(m, false))) goto out;
    if (!tdm_tool_encode_prompts("tandem bench spec", m, tok, texts, n_prompts, o.raw,
                                 o.ctx - o.max_tokens - TDM_TREE_MAX_NODES, &ids, &n_ids))
        goto out;
    int ps = 16;
    struct tdm_engine_opts eo = {
        .n_threads = (int)o.threads,
        .batch_invariant = true, /* "same" compares tokens across batch shapes */
        .page_size = ps,
        .max_ctx = (int)o.ctx,
        .max_seqs = max_b,
        .max_batch_tokens = 512,
        .max_logit_rows = TDM_MIN(512, max_b * (1 + TDM_SPEC_MAX_K)),
        /* (a tree drafter's scratch past the drafts: at most TDM_TREE_MAX_NODES positions) */
        .kv_pages = (int64_t)max_b * ((o.ctx + TDM_TREE_MAX_NODES + ps - 1) / ps + 1),
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
        if (!run_config(e, tok, &o, &so, 1, -1, 0, ids, n_ids, 1, outs[0], n_outs[0], &warm))
            goto out;
    }
    for (int b = 0; b < o.n_batches; b++) {
        struct result *base = &rs[n_rs];
        if (!run_config(e, tok, &o, &so, o.batches[b], -1, 0, ids, n_ids, n_prompts, outs[0],
                        n_outs[0], &rs[n_rs]))
            goto out;
        base->speedup = 1.0;
        n_rs++;
        for (int k = 0; k < o.n_ks; k++)
            for (int t = 0; t < n_trees; t++) {
                struct result *r = &rs[n_rs];
                int budget = so.method != TDM_SPEC_EAGLE ? 0
                             : o.n_budgets               ? o.budgets[t]
                                                         : TDM_SPEC_TREE_BUDGET;
                if (!run_config(e, tok, &o, &so, o.batches[b], o.ks[k], budget, ids, n_ids,
                                n_prompts, outs[1], n_outs[1], r))
                    goto out;
                r->speedup = base->tok_s > 0 ? r->tok_s / base->tok_s : 0;
                r->identical = true;
                for (int i = 0; i < n_prompts; i++)
                    r->identical = r->identical && n_outs[0][i] == n_outs[1][i] &&
                                   !memcmp(outs[0][i], outs[1][i], (size_t)n_outs[0][i] * 4);
                n_rs++;
                char tree[32] = "";
                if (budget) snprintf(tree, sizeof tree, ", tree budget %d", budget);
                if (!o.json)
                    fprintf(stderr,
                            "tandem bench spec: batch %d, %s%s: tau %.3f, %.1f tok/s "
                            "(%.3fx)\n",
                            r->batch, o.ks[k] ? "fixed k" : "auto", tree, r->tau, r->tok_s,
                            r->speedup);
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
    for (int i = 0; ids && i < n_prompts; i++)
        free(ids[i]);
    tdm_tool_free_prompts(texts, n_prompts);
    free(ids);
    free(n_ids);
    free(rs);
    tdm_engine_destroy(e);
    tdm_model_free(draft);
    tdm_tok_free(tok);
    tdm_model_free(m);
    return rc;
}
