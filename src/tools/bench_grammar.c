/*
 * `tandem bench grammar`: what structured output costs a decoding step on the CPU.
 *
 * For each grammar (--schema FILE, repeatable; --schemas DIR: every *.json in it; always "any
 * JSON object"), on the model's own vocabulary: the compile time, then --walks random walks of
 * up to --steps tokens each, drawn among the tokens the mask allows (the sampler's place), and
 * per step the grammar's whole share of it, timed: the state's mask (computed on the state's
 * first visit, read back after), the mask applied to a logit row as the host sampler does,
 * and the state advanced by the token. Reported: the mean, p50, p99 and max per step over
 * every step (first visits included: a server's first request with a new schema), the same
 * again with every state already met (the walks replayed: the steady state of a schema that
 * requests repeat), and the first visits alone.
 *
 * The reference, timed in the same run: one pass over a logit row (a copy: every float read
 * and written), the least any sampler does to a row; each figure's ratio to it is printed. The
 * target is issue 20's: at most 50 us a step at a 49k vocabulary. --json prints one object.
 */
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/grammar.h"
#include "tandem/sample.h"
#include "tools/tools_int.h"

enum { MAX_GRAMMARS = 64 };

struct work {
    char name[128];
    enum tdm_grammar_kind kind;
    char *src;
    size_t len;
};

struct stats {
    double mean, p50, p99, max;
    int n;
};

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static struct stats summarize(double *v, int n)
{
    struct stats s = {.n = n};
    if (!n) return s;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    s.mean = sum / n;
    s.p50 = v[n / 2];
    s.p99 = v[(int)((n - 1) * 0.99)];
    s.max = v[n - 1];
    return s;
}

static uint64_t rng;
static uint64_t rnd(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static bool read_file(const char *path, char **out, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n < 0 || n > TDM_GRAMMAR_MAX_SOURCE) {
        fclose(f);
        return false;
    }
    *out = malloc((size_t)n + 1);
    *len = *out ? fread(*out, 1, (size_t)n, f) : 0;
    fclose(f);
    return *out != NULL;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: tandem bench grammar [--model PATH] [--schema FILE]... [--schemas DIR]\n"
               "                            [--walks N] [--steps N] [--seed N] [--json]\n");
}

int tdm_cmd_bench_grammar(int argc, char **argv)
{
    char model[4096] = "";
    int walks = 20, steps = 64;
    bool json = false;
    rng = 1;
    static struct work w[MAX_GRAMMARS];
    int n = 0;
    snprintf(w[n].name, sizeof w[n].name, "json_object");
    w[n++].kind = TDM_GRAMMAR_JSON_OBJECT;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (v && !strcmp(a, "--model")) {
            snprintf(model, sizeof model, "%s", v), i++;
        } else if (v && !strcmp(a, "--walks")) {
            walks = atoi(v), i++;
        } else if (v && !strcmp(a, "--steps")) {
            steps = atoi(v), i++;
        } else if (v && !strcmp(a, "--seed")) {
            rng = strtoull(v, NULL, 10), i++;
        } else if (v && (!strcmp(a, "--schema") || !strcmp(a, "--schemas"))) {
            i++;
            DIR *d = !strcmp(a, "--schemas") ? opendir(v) : NULL;
            if (!strcmp(a, "--schemas") && !d) {
                fprintf(stderr, "tandem bench grammar: cannot open %s\n", v);
                return 2;
            }
            struct dirent *e;
            const char *one = v;
            for (;;) {
                char path[4096];
                if (d) {
                    if (!(e = readdir(d))) break;
                    size_t l = strlen(e->d_name);
                    if (l < 6 || strcmp(e->d_name + l - 5, ".json")) continue;
                    snprintf(path, sizeof path, "%s/%s", v, e->d_name);
                } else {
                    if (!one) break;
                    snprintf(path, sizeof path, "%s", one);
                    one = NULL;
                }
                if (n == MAX_GRAMMARS) break;
                if (!read_file(path, &w[n].src, &w[n].len)) {
                    fprintf(stderr, "tandem bench grammar: cannot read %s\n", path);
                    return 2;
                }
                const char *base = strrchr(path, '/');
                snprintf(w[n].name, sizeof w[n].name, "%.100s", base ? base + 1 : path);
                w[n++].kind = TDM_GRAMMAR_JSON_SCHEMA;
            }
            if (d) closedir(d);
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (walks < 1 || steps < 1) {
        usage(stderr);
        return 2;
    }
    if (!*model && !tdm_default_model_path(model, sizeof model)) {
        fprintf(stderr, "tandem bench grammar: no --model and no default model path\n");
        return 2;
    }
    tdm_gguf_t *gg;
    tdm_tok_t *tok;
    if (tdm_gguf_open(model, &gg) != TDM_OK || tdm_tok_from_gguf(gg, &tok) != TDM_OK) {
        fprintf(stderr, "tandem bench grammar: %s\n", tdm_err_msg());
        return 1;
    }
    const int vocab = tdm_tok_vocab_size(tok), eos = tdm_tok_eos(tok);
    uint64_t t0 = tdm_now_ns();
    tdm_gvocab_t *v;
    if (tdm_gvocab_create(tok, vocab, &eos, 1, &v) != TDM_OK) {
        fprintf(stderr, "tandem bench grammar: %s\n", tdm_err_msg());
        return 1;
    }
    const double vocab_ms = (double)(tdm_now_ns() - t0) * 1e-6;

    float *row = malloc((size_t)vocab * sizeof *row), *base = malloc((size_t)vocab * sizeof *row);
    int *cand = malloc((size_t)vocab * sizeof *cand);
    const int max_steps = walks * steps;
    double *all = malloc((size_t)max_steps * sizeof *all),
           *warm = malloc((size_t)max_steps * sizeof *warm),
           *cold = malloc((size_t)max_steps * sizeof *cold);
    /* the walks' tokens, each walk ended by -1, replayed */
    int32_t *trace = malloc((size_t)(max_steps + walks) * sizeof *trace);
    for (int i = 0; i < vocab; i++)
        base[i] = (float)(rnd() % 2000) * 0.01f - 10.0f;

    /* the reference: one pass over a row (a copy: every float read and written), best of many */
    double ref_us = 1e30;
    for (int rep = 0; rep < 200; rep++) {
        uint64_t a = tdm_now_ns();
        memcpy(row, base, (size_t)vocab * sizeof *row);
        double us = (double)(tdm_now_ns() - a) * 1e-3;
        if (us < ref_us) ref_us = us;
    }

    json_t *jout = json_pack("{s:i, s:f, s:f, s:[]}", "vocab", vocab, "vocab_index_ms", vocab_ms,
                             "row_pass_us", ref_us, "grammars");
    if (!json)
        printf("vocabulary %d tokens (byte trie built in %.1f ms); reference: one pass over a "
               "logit row %.2f us\n\n%-28s %9s %8s %8s %8s %8s %8s %8s %7s %8s %7s\n",
               vocab, vocab_ms, ref_us, "grammar", "compile", "steps", "mean", "p50", "p99", "warm",
               "warm p99", "x row", "first", "states");
    int rc = 0;
    for (int k = 0; k < n; k++) {
        tdm_grammar_t *g;
        uint64_t c0 = tdm_now_ns();
        if (tdm_grammar_get(v, w[k].kind, w[k].src, w[k].len, &g) != TDM_OK) {
            fprintf(stderr, "tandem bench grammar: %s: %s\n", w[k].name, tdm_err_msg());
            rc = 1;
            continue;
        }
        const double compile_ms = (double)(tdm_now_ns() - c0) * 1e-6;
        int n_all = 0, n_cold = 0, n_trace = 0;
        for (int wk = 0; wk < walks; wk++) {
            int32_t st = tdm_grammar_start(g);
            for (int s = 0; s < steps && !tdm_grammar_complete(g, st); s++) {
                int masks_before;
                tdm_grammar_stats(g, NULL, NULL, &masks_before);
                memcpy(row, base, (size_t)vocab * sizeof *row);
                uint64_t a = tdm_now_ns();
                const uint32_t *m = tdm_grammar_mask(g, st);
                tdm_sample_apply_allow(row, vocab, m);
                double part = (double)(tdm_now_ns() - a) * 1e-3;
                /* the sampler's draw (not timed): uniform among the allowed */
                int nc = 0;
                for (int t = 0; t < vocab; t++)
                    if (m[t >> 5] >> (t & 31) & 1 && t != eos) cand[nc++] = t;
                if (!nc) break;
                int32_t tok_id = cand[rnd() % (uint64_t)nc];
                a = tdm_now_ns();
                st = tdm_grammar_next(g, st, tok_id);
                part += (double)(tdm_now_ns() - a) * 1e-3;
                int masks_after;
                tdm_grammar_stats(g, NULL, NULL, &masks_after);
                all[n_all++] = part;
                if (masks_after > masks_before) cold[n_cold++] = part;
                trace[n_trace++] = tok_id;
                if (st < 0) break;
            }
            trace[n_trace++] = -1; /* a walk's end */
            if (n_trace >= max_steps) break;
        }
        /* the replay: the same tokens, every state met before */
        int n_warm = 0;
        int32_t st = tdm_grammar_start(g);
        for (int i = 0; i < n_trace && n_warm < max_steps; i++) {
            if (trace[i] < 0) {
                st = tdm_grammar_start(g);
                continue;
            }
            memcpy(row, base, (size_t)vocab * sizeof *row);
            uint64_t a = tdm_now_ns();
            tdm_sample_apply_allow(row, vocab, tdm_grammar_mask(g, st));
            st = tdm_grammar_next(g, st, trace[i]);
            warm[n_warm++] = (double)(tdm_now_ns() - a) * 1e-3;
        }
        int dfa, masks;
        tdm_grammar_stats(g, NULL, &dfa, &masks);
        struct stats sa = summarize(all, n_all), sw = summarize(warm, n_warm),
                     sc = summarize(cold, n_cold);
        if (!json)
            printf("%-28.28s %7.2fms %8d %6.1fus %6.1fus %6.1fus %6.1fus %6.1fus %7.2f %6.0fus "
                   "%7d\n",
                   w[k].name, compile_ms, sa.n, sa.mean, sa.p50, sa.p99, sw.mean, sw.p99,
                   sw.mean / ref_us, sc.mean, masks);
        json_array_append_new(
            json_object_get(jout, "grammars"),
            json_pack("{s:s, s:f, s:i, s:f, s:f, s:f, s:f, s:f, s:f, s:f, s:i, s:f, s:i, s:i}",
                      "name", w[k].name, "compile_ms", compile_ms, "steps", sa.n, "mean_us",
                      sa.mean, "p50_us", sa.p50, "p99_us", sa.p99, "max_us", sa.max, "warm_mean_us",
                      sw.mean, "warm_p99_us", sw.p99, "first_visit_mean_us", sc.mean,
                      "first_visits", sc.n, "warm_over_row_pass", sw.mean / ref_us, "dfa_states",
                      dfa, "masks", masks));
        tdm_grammar_unref(g);
    }
    if (json) {
        json_dumpf(jout, stdout, JSON_INDENT(1));
        printf("\n");
    } else {
        printf("\nper step: the mask (computed on a state's first visit), applied to a logit row, "
               "and the state advanced; warm: every state met before; first: first visits "
               "alone; target: <= 50 us a step (issue 20)\n");
    }
    json_decref(jout);
    for (int k = 0; k < n; k++)
        free(w[k].src);
    free(row);
    free(base);
    free(cand);
    free(all);
    free(warm);
    free(cold);
    free(trace);
    tdm_gvocab_free(v);
    tdm_tok_free(tok);
    tdm_gguf_close(gg);
    return rc;
}
