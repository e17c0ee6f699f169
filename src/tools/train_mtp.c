/*
 * `tandem train-mtp`: trains a speculation head for a model on the model's own continuations
 * (self-distillation), with tandem's own inference path making the data and measuring the
 * result.
 *
 *   1. Data. The prompt set (--prompts FILE, or the built-in data/mtp_prompts.jsonl), and with
 *      --self-prompts N also N requests the target writes itself, is continued by the target
 *      once per --gen-temperature; the target's feature and top-k next-token distribution at
 *      every position are cached in --data FILE (src/spec/train_data.c). A cache made with the
 *      same target and settings is reused; one made otherwise is refused by its fingerprint,
 *      never silently mixed in.
 *   2. Training (src/spec/train.c): batches of whole sequences, the prompts held out for
 *      validation excluded; AdamW with warm-up and cosine decay; a progress line with tokens/s
 *      and the loss; OUT.csv gets one row per step and the held-out loss at checkpoints;
 *      OUT.ckpt every --checkpoint-every steps and on SIGINT/SIGTERM, which --resume picks up
 *      (the run continues bit for bit: batches are a function of the step).
 *   3. Output: the head at OUT (tandem's layout, docs/HEADS.md; its d2t map when the draft
 *      vocabulary is reduced), the loss curve OUT.svg beside OUT.csv, and tau at each
 *      --val-k measured on the held-out prompts through the same code as `tandem serve --spec
 *      mtp` (the head loaded from the file written, the scheduler, exact acceptance), not
 *      through the trainer's forward. OUT.json and stdout get one JSON summary.
 *
 * Threading: the main thread does everything; the trainer and the engine fan out over pools
 * of their own (they never run at the same time).
 */
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/tools_int.h"

/* the built-in prompt set (data/mtp_prompts.jsonl), carried by the binary */
__asm__(".section .rodata\n"
        ".balign 16\n"
        ".global tdm_mtp_prompts_start\n"
        "tdm_mtp_prompts_start:\n"
        ".incbin \"" TDM_MTP_PROMPTS_FILE "\"\n"
        ".global tdm_mtp_prompts_end\n"
        "tdm_mtp_prompts_end:\n"
        ".byte 0\n"
        ".previous\n");
extern const char tdm_mtp_prompts_start[], tdm_mtp_prompts_end[];

enum { MAX_TEMPS = 8, MAX_VAL_K = 8 };

struct train_cli {
    const char *model, *out, *prompts, *data, *dtype;
    int64_t gen_tokens, gen_batch, top_k, max_len, threads, limit;
    int64_t draft_vocab, steps, batch_rows, warmup, unroll, seed, ckpt_every, n_val, val_tokens;
    int64_t d_ff, self_prompts;
    double self_temp;
    double epochs, lr, min_lr, wd, clip, reg, decay, noise, minutes;
    float temps[MAX_TEMPS];
    int n_temps;
    int val_k[MAX_VAL_K], n_val_k;
    bool resume, no_val;
    int backend_kind, train_kind;
};

static volatile sig_atomic_t g_stop;
static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tandem train-mtp --out HEAD.safetensors [options]\n"
            "Trains a speculation head (--spec mtp/eagle) on the model's own continuations.\n"
            "  --model PATH            the target (default: the default model)\n"
            "  --out PATH              the head; OUT.csv, OUT.svg, OUT.json, OUT.ckpt beside it\n"
            "data:\n"
            "  --prompts FILE          one JSON string a line (default: the built-in set)\n"
            "  --limit N               only the first N prompts\n"
            "  --self-prompts N        also N user requests written by the target itself, from\n"
            "                          its chat template's user-turn opening (default 0)\n"
            "  --self-prompt-temperature T   their sampling temperature (1.0; top-p 0.95)\n"
            "  --data FILE             the cache of the target's features (default OUT.data)\n"
            "  --gen-tokens N          tokens per continuation, at most (default 256)\n"
            "  --gen-temperature LIST  one continuation per prompt and temperature (0,0.7)\n"
            "  --gen-batch N           continuations in flight (default 32)\n"
            "  --top-k-targets K       target probabilities kept per position (default 32)\n"
            "  --max-len N             positions per sequence, at most (default 1024)\n"
            "  --backend cpu|cuda      where the target runs (default cpu)\n"
            "  --train-backend cpu|cuda  where the head's GEMMs run (default: --backend's;\n"
            "                          cuda: cuBLASLt fp32, the rest on the CPU's cores)\n"
            "training:\n"
            "  --epochs F              passes over the data (default 4), or --steps N\n"
            "  --minutes M             end training so that the run (data and training, not the\n"
            "                          validation) takes at most M minutes; the cosine schedule\n"
            "                          is planned from the measured step time\n"
            "  --batch-rows N          rows (positions) per step (default 4096)\n"
            "  --lr F --min-lr-frac F  peak learning rate (2e-3), cosine floor (0.05)\n"
            "  --warmup N              warm-up steps (default 30)\n"
            "  --weight-decay F --clip F   AdamW decay (0.01), gradient norm clip (1.0)\n"
            "  --reg-weight F          feature regression beside the cross-entropy (0.5)\n"
            "  --unroll N              draft depths trained on the head's own features (3)\n"
            "  --unroll-decay F        weight of depth j: F^(j-1) (0.7)\n"
            "  --feature-noise F       U(-F, F) times the row's RMS added to the target's\n"
            "                          features (EAGLE's augmentation; default 0)\n"
            "  --draft-vocab N         the head's LM head keeps the N most used tokens (8192;\n"
            "                          0: the whole vocabulary)\n"
            "  --d-ff N                the head's MLP width (default: the target's)\n"
            "  --seed S                weights and batch order (default 1)\n"
            "  --threads N             CPU threads (default: all)\n"
            "  --checkpoint-every N    steps between checkpoints (default 50)\n"
            "  --resume                continue from OUT.ckpt\n"
            "  --dtype F32|BF16|F16    the head file's tensors (default BF16)\n"
            "validation:\n"
            "  --val-prompts N         prompts held out of training (default 24)\n"
            "  --val-tokens N          tokens per validation request (default 96)\n"
            "  --val-k LIST            tau measured at these k (default 1,2,3,4,5)\n"
            "  --no-val                skip the tau measurement\n");
}

static struct train_cli *g_cli; /* for the list parsers (main thread only) */
/* A comma-separated list of at most max numbers in [lo, hi] (integers when `integer`). */
static bool parse_list(const char *name, const char *arg, double lo, double hi, bool integer,
                       double *out, int max, int *n)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", arg);
    *n = 0;
    for (char *sv = NULL, *t = strtok_r(buf, ",", &sv); t; t = strtok_r(NULL, ",", &sv)) {
        double v;
        if (*n == max || !tdm_parse_f64(t, &v) || v < lo || v > hi || (integer && v != floor(v))) {
            fprintf(stderr, "--%s: at most %d %s in [%g, %g] (not '%s')\n", name, max,
                    integer ? "integers" : "values", lo, hi, t);
            return false;
        }
        out[(*n)++] = v;
    }
    return *n > 0;
}
static bool opt_temps(const char *arg, void *dst)
{
    double v[MAX_TEMPS];
    if (!parse_list("gen-temperature", arg, 0, 2, false, v, MAX_TEMPS, &g_cli->n_temps))
        return false;
    for (int i = 0; i < g_cli->n_temps; i++)
        g_cli->temps[i] = (float)v[i];
    return true;
}
static bool opt_val_k(const char *arg, void *dst)
{
    double v[MAX_VAL_K];
    if (!parse_list("val-k", arg, 1, TDM_SPEC_MAX_K, true, v, MAX_VAL_K, &g_cli->n_val_k))
        return false;
    for (int i = 0; i < g_cli->n_val_k; i++)
        g_cli->val_k[i] = (int)v[i];
    return true;
}

/* ---- the fingerprint of what makes the data: FNV-1a over the target and the settings ---- */
static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}
static uint64_t data_fingerprint(const struct tdm_model *m, const struct train_cli *c,
                                 char *const *texts, int n)
{
    uint64_t h = fnv(0xcbf29ce484222325ull, "tandem train-mtp data 1", 23);
    const struct tdm_model_config *cfg = &m->cfg;
    int32_t shape[] = {cfg->n_layers,   cfg->d_model, cfg->n_heads,
                       cfg->n_kv_heads, cfg->d_ff,    cfg->vocab_size};
    h = fnv(h, shape, sizeof shape);
    /* the LM head's bytes stand for the weights: its first and last MiB, and its size */
    size_t bytes = (size_t)m->output.rows * m->output.row_bytes, part = TDM_MIN(bytes, 1u << 20);
    h = fnv(h, &bytes, sizeof bytes);
    h = fnv(h, m->output.data, part);
    h = fnv(h, (const uint8_t *)m->output.data + bytes - part, part);
    for (int i = 0; i < n; i++)
        h = fnv(h, texts[i], strlen(texts[i]) + 1);
    int64_t ints[] = {c->gen_tokens, c->top_k, c->max_len, c->seed};
    h = fnv(h, ints, sizeof ints);
    if (c->self_prompts > 0) { /* what the self-prompts are made with */
        double self_temp = c->self_temp;
        h = fnv(h, &c->self_prompts, sizeof c->self_prompts);
        h = fnv(h, &self_temp, sizeof self_temp);
    }
    h = fnv(h, c->temps, sizeof(float) * (size_t)c->n_temps);
    return h;
}

static void gen_progress(void *ctx, const char *phase, double frac, int64_t positions)
{
    double *t = ctx; /* [start, last printed] */
    double now = tdm_now_s(), el = now - t[0];
    bool tty = isatty(STDERR_FILENO);
    if (frac < 1.0 && now - t[1] < (tty ? 0.2 : 10.0)) return;
    t[1] = now;
    fprintf(stderr, "\rtrain-mtp: %-8s %5.1f%%  %lld positions  %.0f s%s", phase, 100 * frac,
            (long long)positions, el, tty ? "   " : "\n");
    fflush(stderr);
}

/* ---- self-prompts (Magpie): the target writes user messages ----
 * The chat template's opening of a user turn (everything before the user's text) is continued
 * by the target, which writes what a user of it would ask, up to its end of turn. Kept: turns
 * that ended (EOS), of 3 to 80 words, printable, valid UTF-8 (a turn may end inside a
 * character's bytes), not seen before. They add prompts in the
 * model's own distribution of requests, with no download; they are never held out. */
static bool keep_self_prompt(char *a, char **kept, int n)
{
    char *z = a + strlen(a); /* a: past any leading white space; the end is trimmed here */
    while (z > a && strchr(" \t\r\n", z[-1]))
        z--;
    *z = 0;
    int words = 0;
    bool good = true;
    for (char *q = a; *q; q++) {
        good &= (unsigned char)*q >= 0x20 || *q == '\n';
        words += !strchr(" \t\n", *q) && (q == a || strchr(" \t\n", q[-1]));
    }
    good &= words >= 3 && words <= 80 && !strstr(a, "<|") && tdm_tok_utf8_valid(a, strlen(a), NULL);
    for (int k = 0; good && k < n; k++)
        good = strcmp(kept[k], a) != 0;
    return good;
}

static int self_prompts(const char *who, const struct tdm_model *m, const tdm_tok_t *tok,
                        const struct train_cli *c, char ***out)
{
    struct tdm_chat_template tmpl = {0};
    char *text = NULL;
    const char sentinel[] = "\x01";
    struct tdm_chat_msg msg = {.role = "user", .content = sentinel};
    if (tdm_chat_template_detect(m->chat_template, &tmpl) != TDM_OK ||
        tdm_chat_render(&tmpl, &msg, 1, false, &text) != TDM_OK || !strstr(text, sentinel)) {
        fprintf(stderr, "%s: --self-prompts needs a chat template tandem understands\n", who);
        tdm_chat_template_clear(&tmpl);
        free(text);
        return -1;
    }
    *strstr(text, sentinel) = 0; /* the opening of a user turn */
    int32_t ids[1024];
    size_t n_ids = 0;
    int flags =
        TDM_TOK_PARSE_SPECIAL | (tdm_tok_adds_bos(tok) && !tmpl.add_bos_text ? TDM_TOK_ADD_BOS : 0);
    tdm_status st = tdm_tok_encode(tok, text, strlen(text), flags, ids, 1024, &n_ids);
    free(text);
    tdm_chat_template_clear(&tmpl);
    if (st != TDM_OK || !n_ids) {
        tdm_tool_fail("self-prompts: the template's opening");
        return -1;
    }
    const int want = (int)c->self_prompts, batch = (int)TDM_MIN(c->gen_batch, want), gen = 64;
    const int tries = 3 * want;
    int ps = 16, ctx = (int)n_ids + gen + TDM_SPEC_MAX_K + 2;
    struct tdm_engine_opts eo = {.n_threads = (int)c->threads,
                                 .batch_invariant = true,
                                 .page_size = ps,
                                 .max_ctx = ctx,
                                 .max_seqs = batch,
                                 .kv_pages = (int64_t)batch * ((ctx + ps - 1) / ps + 1),
                                 .backend_kind = c->backend_kind};
    tdm_engine_t *e = NULL;
    tdm_sched_t *s = NULL;
    struct tdm_sched_opts so = {.max_seqs = batch, .watermark_pages = -1};
    char **v = calloc((size_t)want, sizeof *v), buf[4096];
    tdm_req_t **live = calloc((size_t)batch, sizeof *live);
    int n = 0, next = 0, done = 0;
    bool ok = v && live && tdm_engine_create(m, &eo, &e) == TDM_OK &&
              tdm_sched_create(e, tok, &so, &s) == TDM_OK;
    if (!ok) tdm_tool_fail("self-prompts");
    double t0 = tdm_now_s(), last = t0;
    while (ok && n < want && done < tries) {
        for (int i = 0; i < batch && next < tries; i++) {
            if (live[i]) continue;
            struct tdm_req_params p = {.prompt = ids,
                                       .n_prompt = (int)n_ids,
                                       .max_tokens = gen,
                                       .sampling = tdm_sampling_defaults(),
                                       .top_logprobs = -1};
            p.sampling.temperature = (float)c->self_temp;
            p.sampling.top_p = 0.95f;
            p.sampling.seed = (uint64_t)c->seed * 1000003u + 77 + (uint64_t)next++;
            if (tdm_sched_submit(s, &p, &live[i]) != TDM_OK) ok = false;
        }
        tdm_sched_step(s);
        for (int i = 0; ok && i < batch; i++) {
            if (!live[i]) continue;
            struct tdm_req_view rv;
            tdm_req_lock(live[i], &rv);
            enum tdm_finish fin = rv.finish;
            size_t len = 0;
            /* a turn that ended: its last output is the end of turn */
            bool ended = fin == TDM_FINISH_STOP && rv.n_out > 1 &&
                         tdm_tok_decode(tok, rv.tokens, (size_t)rv.n_out - 1, true, buf, sizeof buf,
                                        &len) == TDM_OK &&
                         len < sizeof buf;
            tdm_req_unlock(live[i]);
            if (fin == TDM_FINISH_NONE) continue;
            if (fin == TDM_FINISH_ERROR) ok = false;
            tdm_req_release(live[i]);
            live[i] = NULL;
            done++;
            char *a = buf;
            while (ended && *a && strchr(" \t\r\n", *a))
                a++;
            if (ended && n < want && keep_self_prompt(a, v, n) && !(v[n++] = strdup(a))) ok = false;
        }
        if (tdm_now_s() - last > (isatty(STDERR_FILENO) ? 0.2 : 10)) {
            last = tdm_now_s();
            fprintf(stderr, "\rtrain-mtp: self-prompts %d of %d  %.0f s%s", n, want, last - t0,
                    isatty(STDERR_FILENO) ? "   " : "\n");
        }
    }
    for (int i = 0; live && i < batch; i++)
        if (live[i]) tdm_req_release(live[i]);
    free(live);
    tdm_sched_destroy(s);
    tdm_engine_destroy(e);
    if (!ok) {
        tdm_tool_free_prompts(v, n);
        return -1;
    }
    fprintf(stderr, "\r%s: %d self-prompts written by the target (%d tried) in %.0f s\n", who, n,
            done, tdm_now_s() - t0);
    *out = v;
    return n;
}

/* ---- batches: a function of (seed, step) ---- */
struct schedule {
    int *order; /* [n_epochs][n_train] sequence indexes, shuffled per epoch */
    int *start; /* [n_batches + 1] into order */
    int n_batches;
};
static bool make_schedule(const tdm_train_data_t *d, const bool *is_val, uint64_t seed,
                          int64_t want_steps, double epochs, int batch_rows, int max_seqs,
                          struct schedule *s)
{
    int n = tdm_train_data_n_seqs(d), n_train = 0;
    int *train = malloc((size_t)n * sizeof *train);
    if (!train) return false;
    for (int i = 0; i < n; i++)
        if (!is_val[tdm_train_data_prompt(d, i)]) train[n_train++] = i;
    if (!n_train) {
        free(train);
        fprintf(stderr, "tandem train-mtp: no training sequences (all held out?)\n");
        return false;
    }
    int n_epochs = want_steps > 0 ? 1 : (int)ceil(epochs);
    for (;;) { /* enough epochs for the steps wanted */
        free(s->order);
        free(s->start);
        s->order = malloc((size_t)n_epochs * n_train * sizeof *s->order);
        s->start = malloc(((size_t)n_epochs * n_train + 1) * sizeof *s->start);
        if (!s->order || !s->start) {
            free(train);
            return false;
        }
        int nb = 0, at = 0;
        for (int ep = 0; ep < n_epochs; ep++) {
            int *o = s->order + (size_t)ep * n_train;
            memcpy(o, train, (size_t)n_train * sizeof *o);
            for (int i = n_train - 1; i > 0; i--) { /* Fisher-Yates, keyed on (seed, epoch) */
                int j = (int)(tdm_rng_uniform(seed, 7000 + (uint64_t)ep, (uint32_t)i, 0) * (i + 1));
                int t = o[i];
                o[i] = o[j];
                o[j] = t;
            }
            int end = at + n_train;
            /* a fractional last epoch stops early */
            if (want_steps <= 0 && ep == n_epochs - 1 && epochs < n_epochs)
                end = at + (int)((epochs - (n_epochs - 1)) * n_train);
            while (at < end) {
                s->start[nb++] = at;
                int rows = 0, cnt = 0;
                while (at < end && cnt < max_seqs) {
                    struct tdm_train_seq q;
                    tdm_train_data_seq(d, s->order[at], &q);
                    if (cnt && rows + q.len - 1 > batch_rows) break;
                    rows += q.len - 1;
                    cnt++;
                    at++;
                }
            }
            at = (ep + 1) * n_train;
        }
        s->start[nb] = at;
        s->n_batches = nb;
        if (want_steps <= 0 || nb >= want_steps) break;
        n_epochs = (int)(n_epochs * ((double)want_steps / nb) + 1);
    }
    if (want_steps > 0) s->n_batches = (int)want_steps;
    free(train);
    return true;
}
/* Batch b's sequences: order[start[b] .. ) up to the next batch's start. */
static int batch_seqs(const struct schedule *s, const tdm_train_data_t *d, int b,
                      struct tdm_train_seq *out, int max_seqs, int batch_rows)
{
    int n = 0, rows = 0;
    for (int at = s->start[b]; n < max_seqs; at++) {
        if (b + 1 <= s->n_batches && at >= s->start[b + 1]) break;
        struct tdm_train_seq q;
        tdm_train_data_seq(d, s->order[at], &q);
        if (n && rows + q.len - 1 > batch_rows) break;
        out[n++] = q;
        rows += q.len - 1;
    }
    return n;
}

/* ---- the loss curve: OUT.svg from the rows of OUT.csv ---- */
static bool write_svg(const char *path, const double *step, const double *loss, int n,
                      const double *vstep, const double *vloss, int nv, const char *title)
{
    FILE *f = fopen(path, "w");
    if (!f) return false;
    const double W = 720, H = 420, L = 70, R = 20, T = 40, B = 50;
    double x1 = 1, y0 = INFINITY, y1 = -INFINITY;
    for (int i = 0; i < n; i++) {
        x1 = fmax(x1, step[i]);
        y0 = fmin(y0, loss[i]);
        y1 = fmax(y1, loss[i]);
    }
    for (int i = 0; i < nv; i++) {
        y0 = fmin(y0, vloss[i]);
        y1 = fmax(y1, vloss[i]);
    }
    if (!(y1 > y0)) {
        y0 = isfinite(y0) ? y0 - 1 : 0;
        y1 = y0 + 2;
    }
    double pad = 0.05 * (y1 - y0);
    y0 -= pad;
    y1 += pad;
#define PX(x) (L + (x) / x1 * (W - L - R))
#define PY(y) (T + (y1 - (y)) / (y1 - y0) * (H - T - B))
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n"
            "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
            "<text x=\"%g\" y=\"22\" font-size=\"15\">%s</text>\n"
            "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n"
            "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n",
            W, H, L, title, L, H - B, W - R, H - B, L, T, L, H - B);
    for (int i = 0; i <= 5; i++) {
        double y = y0 + (y1 - y0) * i / 5, x = x1 * i / 5;
        fprintf(f,
                "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.3g</text>"
                "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#ddd\"/>\n"
                "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%.0f</text>\n",
                L - 6, PY(y) + 4, y, L, PY(y), W - R, PY(y), PX(x), H - B + 18, x);
    }
    fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2,
            H - 12);
    fprintf(f, "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.2\" points=\"");
    for (int i = 0; i < n; i++)
        fprintf(f, "%.1f,%.1f ", PX(step[i]), PY(loss[i]));
    fprintf(f, "\"/>\n");
    if (nv) {
        fprintf(f, "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"2\" points=\"");
        for (int i = 0; i < nv; i++)
            fprintf(f, "%.1f,%.1f ", PX(vstep[i]), PY(vloss[i]));
        fprintf(f, "\"/>\n");
    }
    fprintf(f,
            "<text x=\"%g\" y=\"%g\" fill=\"#1f77b4\">training loss</text>\n"
            "<text x=\"%g\" y=\"%g\" fill=\"#d62728\">held-out loss</text>\n</svg>\n",
            W - R - 200, T + 14, W - R - 200, T + 30);
#undef PX
#undef PY
    return fclose(f) == 0;
}

/* ---- tau through the inference path: the head file, the scheduler, exact acceptance ---- */
static bool measure_tau(const char *head_path, const struct tdm_model *m, const tdm_tok_t *tok,
                        const struct train_cli *c, int32_t **ids, const int *n_ids, int n,
                        double *tau, double *acc_by_pos)
{
    struct tdm_model *h = NULL;
    if (tdm_head_load(head_path, m, &h) != TDM_OK) {
        tdm_tool_fail("the trained head");
        return false;
    }
    int ctx = 0;
    for (int i = 0; i < n; i++)
        ctx = TDM_MAX(ctx, n_ids[i]);
    ctx += (int)c->val_tokens + TDM_SPEC_MAX_K + 16;
    int batch = TDM_MIN(n, 16), ps = 16;
    struct tdm_spec_opts so = {
        .method = TDM_SPEC_MTP, .accept = TDM_SPEC_ACCEPT_EXACT, .draft_model = h};
    struct tdm_engine_opts eo = {.n_threads = (int)c->threads,
                                 .batch_invariant = true,
                                 .page_size = ps,
                                 .max_ctx = ctx,
                                 .max_seqs = batch,
                                 .max_logit_rows = batch * (1 + TDM_SPEC_MAX_K),
                                 .kv_pages = (int64_t)batch * ((ctx + ps - 1) / ps + 1),
                                 .backend_kind = c->backend_kind};
    struct tdm_kv_group grp;
    tdm_spec_engine_opts(&so, m, &grp, &eo);
    tdm_engine_t *e = NULL;
    bool ok = tdm_engine_create(m, &eo, &e) == TDM_OK;
    if (!ok) tdm_tool_fail("validation engine");
    for (int ki = 0; ok && ki < c->n_val_k; ki++) {
        so.k = c->val_k[ki];
        struct tdm_sched_opts sopt = {.max_seqs = batch, .watermark_pages = -1};
        tdm_sched_t *s = NULL;
        tdm_spec_t *sp = NULL;
        ok = tdm_sched_create(e, tok, &sopt, &s) == TDM_OK &&
             tdm_spec_create(e, &so, &sp) == TDM_OK && tdm_spec_attach(sp, s) == TDM_OK;
        if (!ok) tdm_tool_fail("validation speculation");
        tdm_req_t **live = calloc((size_t)batch, sizeof *live);
        int next = 0, done = 0;
        while (ok && live && done < n) {
            for (int i = 0; i < batch && next < n; i++) {
                if (live[i]) continue;
                struct tdm_req_params p = {.prompt = ids[next],
                                           .n_prompt = n_ids[next],
                                           .max_tokens = (int)c->val_tokens,
                                           .sampling = tdm_sampling_defaults(),
                                           .top_logprobs = -1};
                if (tdm_sched_submit(s, &p, &live[i]) != TDM_OK) ok = false;
                next++;
            }
            tdm_sched_step(s);
            for (int i = 0; i < batch; i++) {
                if (!live[i]) continue;
                struct tdm_req_view v;
                tdm_req_lock(live[i], &v);
                enum tdm_finish fin = v.finish;
                tdm_req_unlock(live[i]);
                if (fin == TDM_FINISH_NONE) continue;
                if (fin == TDM_FINISH_ERROR) ok = false;
                tdm_req_release(live[i]);
                live[i] = NULL;
                done++;
            }
        }
        for (int i = 0; live && i < batch; i++)
            if (live[i]) tdm_req_release(live[i]);
        free(live);
        if (ok) {
            struct tdm_spec_stats st;
            tdm_spec_get_stats(sp, &st);
            tau[ki] = st.tau;
            for (int j = 0; j < TDM_SPEC_MAX_K; j++)
                acc_by_pos[ki * TDM_SPEC_MAX_K + j] =
                    st.drafted_at[j] ? (double)st.accepted_at[j] / st.drafted_at[j] : 0;
        }
        tdm_sched_destroy(s);
        tdm_spec_destroy(sp);
    }
    tdm_engine_destroy(e);
    tdm_model_free(h);
    return ok;
}

/* Field i of a CSV line (no quoting: ours has none), as a number; NAN when empty. */
static double csv_field(const char *line, int i)
{
    for (; i > 0 && line; i--)
        if ((line = strchr(line, ','))) line++;
    if (!line || *line == ',' || *line == '\n' || !*line) return NAN;
    return strtod(line, NULL);
}
#define CSV_HEADER "step,rows,loss,ce1,top1_1,reg1,lr,grad_norm,val_loss\n"
/* Opens OUT.csv for writing from step0 on: the rows up to step0 of an earlier run are kept
 * (their step, loss and held-out loss also go to the curve's arrays). */
static FILE *open_csv(const char *path, int64_t step0, double *cs, double *cl, int *n_cl,
                      double *vs, double *vl, int *n_vl)
{
    char **keep = NULL;
    int n_keep = 0;
    FILE *f = step0 > 0 ? fopen(path, "r") : NULL;
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        double st = csv_field(line, 0), lo = csv_field(line, 2), vlo = csv_field(line, 8);
        if (!(st >= 1 && st <= step0) || !isfinite(lo)) continue;
        char **k = realloc(keep, (size_t)(n_keep + 1) * sizeof *k);
        if (!k) break;
        keep = k;
        if (!(keep[n_keep] = strdup(line))) break;
        n_keep++;
        cs[*n_cl] = st;
        cl[(*n_cl)++] = lo;
        if (isfinite(vlo)) {
            vs[*n_vl] = st;
            vl[(*n_vl)++] = vlo;
        }
    }
    if (f) fclose(f);
    FILE *out = fopen(path, "w");
    if (out) fputs(CSV_HEADER, out);
    for (int i = 0; i < n_keep; i++) {
        if (out) fputs(keep[i], out);
        free(keep[i]);
    }
    free(keep);
    return out;
}

static void path_with(char *buf, size_t cap, const char *out, const char *ext)
{
    size_t n = strlen(out);
    const char *suf = ".safetensors";
    if (n > strlen(suf) && !strcmp(out + n - strlen(suf), suf)) n -= strlen(suf);
    snprintf(buf, cap, "%.*s%s", (int)n, out, ext);
}

static double eval_loss(tdm_head_trainer_t *t, const tdm_train_data_t *d, const int *val, int n_val,
                        int max_seqs, int batch_rows, int k)
{
    struct tdm_train_seq *b = malloc((size_t)max_seqs * sizeof *b);
    double sum = 0;
    int n_batches = 0;
    for (int i = 0; b && i < n_val;) {
        int n = 0, rows = 0;
        while (i < n_val && n < max_seqs) {
            struct tdm_train_seq q;
            tdm_train_data_seq(d, val[i], &q);
            if (n && rows + q.len - 1 > batch_rows) break;
            b[n++] = q;
            rows += q.len - 1;
            i++;
        }
        struct tdm_train_loss l;
        if (tdm_head_trainer_eval(t, b, n, k, &l) == TDM_OK) {
            sum += l.loss;
            n_batches++;
        }
    }
    free(b);
    return n_batches ? sum / n_batches : NAN;
}

/* Appends the self-prompts (texts, and their ids) to the prompt set. */
static bool add_self_prompts(const char *who, const struct tdm_model *m, const tdm_tok_t *tok,
                             const struct train_cli *c, char ***texts, int32_t ***ids, int **n_ids,
                             int *n_prompts)
{
    char **sp = NULL;
    int32_t **sids = NULL;
    int *sn = NULL, ns = self_prompts(who, m, tok, c, &sp);
    if (ns < 0) return false;
    bool ok =
        ns == 0 || tdm_tool_encode_prompts(who, m, tok, sp, ns, false, c->max_len - 2, &sids, &sn);
    char **t2 = ok ? realloc(*texts, (size_t)(*n_prompts + ns) * sizeof *t2) : NULL;
    if (t2) *texts = t2;
    int32_t **i2 = t2 ? realloc(*ids, (size_t)(*n_prompts + ns) * sizeof *i2) : NULL;
    if (i2) *ids = i2;
    int *n2 = i2 ? realloc(*n_ids, (size_t)(*n_prompts + ns) * sizeof *n2) : NULL;
    if (n2) *n_ids = n2;
    if (!n2) {
        for (int i = 0; sids && i < ns; i++)
            free(sids[i]);
        tdm_tool_free_prompts(sp, ns);
        free(sids);
        free(sn);
        return false;
    }
    for (int i = 0; i < ns; i++) {
        (*texts)[*n_prompts + i] = sp[i];
        (*ids)[*n_prompts + i] = sids[i];
        (*n_ids)[*n_prompts + i] = sn[i];
    }
    *n_prompts += ns;
    free(sp);
    free(sids);
    free(sn);
    return true;
}

int tdm_cmd_train_mtp(int argc, char **argv)
{
    struct tdm_train_opts to; /* the trainer's defaults are the command's */
    tdm_train_opts_default(&to);
    struct train_cli c = {.gen_tokens = 256,
                          .gen_batch = 32,
                          .top_k = 32,
                          .max_len = to.max_len,
                          .draft_vocab = 8192,
                          .batch_rows = to.max_rows,
                          .warmup = to.warmup_steps,
                          .unroll = to.unroll,
                          .seed = (int64_t)to.seed,
                          .ckpt_every = 50,
                          .n_val = 24,
                          .val_tokens = 96,
                          .epochs = 4,
                          .lr = to.lr,
                          .min_lr = to.min_lr_frac,
                          .wd = to.weight_decay,
                          .clip = to.clip,
                          .reg = to.reg_weight,
                          .decay = to.unroll_decay,
                          .noise = to.feature_noise,
                          .self_temp = 1.0,
                          .temps = {0.0f, 0.7f},
                          .n_temps = 2,
                          .val_k = {1, 2, 3, 4, 5},
                          .n_val_k = 5,
                          .dtype = "BF16",
                          .train_kind = -1};
    g_cli = &c;
    const struct tdm_opt table[] = {
        TDM_OPT_S("model", &c.model),
        TDM_OPT_S("out", &c.out),
        TDM_OPT_S("prompts", &c.prompts),
        TDM_OPT_I("limit", &c.limit, 1, 1 << 24),
        TDM_OPT_I("self-prompts", &c.self_prompts, 0, 1 << 20),
        TDM_OPT_F("self-prompt-temperature", &c.self_temp, 0.05, 2),
        TDM_OPT_S("data", &c.data),
        TDM_OPT_I("gen-tokens", &c.gen_tokens, 1, 1 << 16),
        TDM_OPT_P("gen-temperature", opt_temps, NULL),
        TDM_OPT_I("gen-batch", &c.gen_batch, 1, 1024),
        TDM_OPT_I("top-k-targets", &c.top_k, 1, TDM_TRAIN_MAX_TOPK),
        TDM_OPT_I("max-len", &c.max_len, 8, TDM_TRAIN_MAX_LEN),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &c.backend_kind),
        TDM_OPT_P("train-backend", tdm_tool_opt_backend, &c.train_kind),
        TDM_OPT_F("epochs", &c.epochs, 0.01, 10000),
        TDM_OPT_I("steps", &c.steps, 1, 1 << 30),
        TDM_OPT_F("minutes", &c.minutes, 0.1, 1e6),
        TDM_OPT_I("batch-rows", &c.batch_rows, 16, 1 << 20),
        TDM_OPT_F("lr", &c.lr, 1e-7, 1),
        TDM_OPT_F("min-lr-frac", &c.min_lr, 0, 1),
        TDM_OPT_I("warmup", &c.warmup, 0, 1 << 30),
        TDM_OPT_F("weight-decay", &c.wd, 0, 10),
        TDM_OPT_F("clip", &c.clip, 0, 1e6),
        TDM_OPT_F("reg-weight", &c.reg, 0, 1e3),
        TDM_OPT_I("unroll", &c.unroll, 1, TDM_TRAIN_MAX_UNROLL),
        TDM_OPT_F("unroll-decay", &c.decay, 0, 10),
        TDM_OPT_F("feature-noise", &c.noise, 0, 10),
        TDM_OPT_I("draft-vocab", &c.draft_vocab, 0, 1 << 24),
        TDM_OPT_I("d-ff", &c.d_ff, 1, 1 << 20),
        TDM_OPT_I("seed", &c.seed, 0, 9007199254740992.0),
        TDM_OPT_I("threads", &c.threads, 1, 1024),
        TDM_OPT_I("checkpoint-every", &c.ckpt_every, 1, 1 << 30),
        TDM_OPT_B("resume", &c.resume),
        TDM_OPT_S("dtype", &c.dtype),
        TDM_OPT_I("val-prompts", &c.n_val, 0, 1 << 20),
        TDM_OPT_I("val-tokens", &c.val_tokens, 1, 1 << 16),
        TDM_OPT_P("val-k", opt_val_k, NULL),
        TDM_OPT_B("no-val", &c.no_val),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {table, NULL};
    int prc = tdm_tool_parse("train-mtp", argc, argv, tables, usage);
    if (prc) return prc == 1 ? 0 : 2;
    const char *who = "tandem train-mtp";
    if (!c.out) {
        fprintf(stderr, "%s: --out HEAD.safetensors is required\n", who);
        return 2;
    }
    if (strcmp(c.dtype, "F32") && strcmp(c.dtype, "BF16") && strcmp(c.dtype, "F16")) {
        fprintf(stderr, "%s: --dtype takes F32, BF16 or F16\n", who);
        return 2;
    }
    if (c.batch_rows < c.max_len) {
        fprintf(stderr, "%s: --batch-rows (%lld) must hold a whole sequence (--max-len %lld)\n",
                who, (long long)c.batch_rows, (long long)c.max_len);
        return 2;
    }
    char p_data[4096], p_ckpt[4096], p_csv[4096], p_svg[4096], p_json[4096];
    if (c.data)
        snprintf(p_data, sizeof p_data, "%s", c.data);
    else
        path_with(p_data, sizeof p_data, c.out, ".data");
    path_with(p_ckpt, sizeof p_ckpt, c.out, ".ckpt");
    path_with(p_csv, sizeof p_csv, c.out, ".csv");
    path_with(p_svg, sizeof p_svg, c.out, ".svg");
    path_with(p_json, sizeof p_json, c.out, ".json");

    /* the prompts */
    char **texts = NULL;
    int n_prompts =
        c.prompts ? tdm_tool_read_prompts(who, c.prompts, (int)c.limit, &texts)
                  : tdm_tool_parse_prompts(who, "the built-in prompt set", tdm_mtp_prompts_start,
                                           (size_t)(tdm_mtp_prompts_end - tdm_mtp_prompts_start),
                                           (int)c.limit, &texts);
    if (n_prompts < 0) return 2;
    if (c.n_val >= n_prompts) {
        fprintf(stderr, "%s: --val-prompts %lld leaves no prompt to train on (%d prompts)\n", who,
                (long long)c.n_val, n_prompts);
        tdm_tool_free_prompts(texts, n_prompts);
        return 2;
    }
    int rc = 1;
    double t_start = tdm_now_s();
    struct tdm_model *m = tdm_tool_load_model(c.model);
    tdm_tok_t *tok = NULL;
    int32_t **ids = NULL;
    int *n_ids = NULL;
    tdm_train_data_t *data = NULL;
    tdm_head_trainer_t *tr = NULL;
    tdm_cuda_gemm_t *gpu = NULL;
    bool *is_val = NULL;
    int *val_seqs = NULL, n_val_seqs = 0;
    int32_t *dvocab = NULL;
    struct schedule sch = {0};
    struct tdm_train_seq *bseqs = NULL;
    FILE *csv = NULL;
    double *cs = NULL, *cl = NULL, *vs = NULL, *vl = NULL;
    int n_cl = 0, n_vl = 0;
    if (!m || !(tok = tdm_tool_load_tokenizer(m, false))) goto out;
    /* the GPU of the training, before an hour of data is made for nothing */
    if ((c.train_kind < 0 ? c.backend_kind : c.train_kind) == TDM_BACKEND_CUDA &&
        tdm_cuda_gemm_create(0, &gpu) != TDM_OK) {
        fprintf(stderr, "%s: --train-backend cuda: %s\n", who, tdm_err_msg());
        rc = 2;
        goto out;
    }
    if (!tdm_tool_encode_prompts(who, m, tok, texts, n_prompts, false, c.max_len - 2, &ids, &n_ids))
        goto out;
    if (c.threads <= 0) c.threads = tdm_cpu_count();
    /* held-out prompts: evenly spread over the set (self-prompts come after it, never held out) */
    const int n_base = n_prompts;
    is_val = calloc((size_t)(n_prompts + c.self_prompts), sizeof *is_val);
    if (!is_val) goto out;
    for (int i = 0; i < c.n_val; i++)
        is_val[(int)((i + 0.5) * n_prompts / c.n_val)] = true;

    /* 1. the data: the cache, or made now */
    uint64_t fp = data_fingerprint(m, &c, texts, n_base);
    struct stat sb;
    if (stat(p_data, &sb) == 0) {
        if (tdm_train_data_load(p_data, fp, m->cfg.d_model, m->cfg.vocab_size, &data) != TDM_OK) {
            fprintf(stderr, "%s: %s\n  (delete it, or give another --data FILE)\n", who,
                    tdm_err_msg());
            rc = 2;
            goto out;
        }
        fprintf(stderr, "%s: data from %s: %d sequences, %lld positions\n", who, p_data,
                tdm_train_data_n_seqs(data), (long long)tdm_train_data_positions(data));
    } else {
        if (c.self_prompts > 0 &&
            !add_self_prompts(who, m, tok, &c, &texts, &ids, &n_ids, &n_prompts))
            goto out;
        int max_ctx = (int)TDM_MIN(c.max_len + TDM_SPEC_MAX_K + 2,
                                   m->cfg.max_ctx > 0 ? m->cfg.max_ctx : c.max_len + 32);
        int ps = 16, nb = (int)c.gen_batch;
        struct tdm_engine_opts eo = {.n_threads = (int)c.threads,
                                     .batch_invariant = true,
                                     .page_size = ps,
                                     .max_ctx = max_ctx,
                                     .max_seqs = nb,
                                     .max_batch_tokens = 512,
                                     .kv_pages = (int64_t)nb * ((max_ctx + ps - 1) / ps + 2),
                                     .backend_kind = c.backend_kind};
        tdm_engine_t *e = NULL;
        if (tdm_engine_create(m, &eo, &e) != TDM_OK) {
            tdm_tool_fail("engine");
            goto out;
        }
        double t0[2] = {tdm_now_s(), 0};
        struct tdm_train_gen_opts go = {.max_new_tokens = (int)TDM_MIN(c.gen_tokens, c.max_len),
                                        .batch = nb,
                                        .top_k = (int)c.top_k,
                                        .temperatures = c.temps,
                                        .n_temperatures = c.n_temps,
                                        .seed = (uint64_t)c.seed,
                                        .fingerprint = fp,
                                        .n_threads = (int)c.threads,
                                        .progress = gen_progress,
                                        .progress_ctx = t0};
        tdm_status st = tdm_train_data_generate(e, tok, ids, n_ids, n_prompts, &go, &data);
        tdm_engine_destroy(e);
        fputc('\n', stderr);
        if (st != TDM_OK) {
            tdm_tool_fail("training data");
            goto out;
        }
        if (tdm_train_data_save(data, p_data) != TDM_OK) {
            tdm_tool_fail("saving the training data");
            goto out;
        }
        fprintf(stderr, "%s: data: %d sequences, %lld positions in %.0f s -> %s\n", who,
                tdm_train_data_n_seqs(data), (long long)tdm_train_data_positions(data),
                tdm_now_s() - t0[0], p_data);
    }
    double t_data = tdm_now_s() - t_start;
    for (int i = 0; i < tdm_train_data_n_seqs(data); i++) /* a cache's prompts must be ours */
        if (tdm_train_data_prompt(data, i) >= n_base + c.self_prompts) {
            fprintf(stderr, "%s: %s refers to prompts this set does not have\n", who, p_data);
            rc = 2;
            goto out;
        }

    /* 2. the draft vocabulary, the trainer, the schedule */
    int n_draft = 0;
    double coverage = 1.0;
    if (c.draft_vocab > 0 && c.draft_vocab < m->cfg.vocab_size) {
        n_draft = (int)c.draft_vocab;
        if (!(dvocab = malloc((size_t)n_draft * sizeof *dvocab)) ||
            tdm_train_data_draft_vocab(data, n_draft, dvocab, &coverage) != TDM_OK) {
            tdm_tool_fail("draft vocabulary");
            goto out;
        }
        fprintf(stderr, "%s: draft vocabulary: %d tokens carry %.2f%% of the target's mass\n", who,
                n_draft, 100 * coverage);
    }
    struct tdm_train_geom g;
    tdm_train_geom_of(m, &g);
    if (c.d_ff) g.d_ff = (int)c.d_ff;
    to.unroll = (int)c.unroll;
    to.unroll_decay = (float)c.decay;
    to.reg_weight = (float)c.reg;
    to.lr = (float)c.lr;
    to.min_lr_frac = (float)c.min_lr;
    to.weight_decay = (float)c.wd;
    to.clip = (float)c.clip;
    to.feature_noise = (float)c.noise;
    to.warmup_steps = c.warmup;
    to.seed = (uint64_t)c.seed;
    to.n_threads = (int)c.threads;
    to.max_rows = (int)c.batch_rows;
    to.max_len = (int)c.max_len;
    if (!make_schedule(data, is_val, (uint64_t)c.seed, c.steps, c.epochs, (int)c.batch_rows,
                       to.max_seqs, &sch))
        goto out;
    to.total_steps = sch.n_batches;
    to.gpu = gpu;
    if (tdm_head_trainer_create(m, &g, &to, dvocab, n_draft, &tr) != TDM_OK) {
        tdm_tool_fail("trainer");
        goto out;
    }
    /* what a checkpoint must agree on to be resumed */
    char s_steps[32], s_seed[32], s_fp[32], s_lr[32], s_unroll[32], s_rows[32], s_reg[48];
    snprintf(s_steps, sizeof s_steps, "%d", sch.n_batches);
    snprintf(s_seed, sizeof s_seed, "%lld", (long long)c.seed);
    snprintf(s_fp, sizeof s_fp, "%016llx", (unsigned long long)fp);
    snprintf(s_lr, sizeof s_lr, "%g", c.lr);
    snprintf(s_unroll, sizeof s_unroll, "%lld/%g", (long long)c.unroll, c.decay);
    snprintf(s_rows, sizeof s_rows, "%lld", (long long)c.batch_rows);
    snprintf(s_reg, sizeof s_reg, "%g/%g", c.reg, c.noise);
    const char *ck_meta[] = {"total_steps", s_steps,  "seed",   s_seed, "data", s_fp,  "lr",
                             s_lr,          "unroll", s_unroll, "rows", s_rows, "reg", s_reg};
    const int n_ck = (int)TDM_ARRAY_LEN(ck_meta) / 2;
    int64_t step0 = 0;
    if (c.resume && stat(p_ckpt, &sb) == 0) {
        if (tdm_head_trainer_load_checkpoint(tr, p_ckpt, ck_meta, n_ck) != TDM_OK) {
            fprintf(stderr, "%s: --resume: %s\n", who, tdm_err_msg());
            rc = 2;
            goto out;
        }
        step0 = tdm_head_trainer_steps(tr);
        fprintf(stderr, "%s: resuming from %s at step %lld of %d\n", who, p_ckpt, (long long)step0,
                sch.n_batches);
    } else if (c.resume) {
        fprintf(stderr, "%s: --resume: no checkpoint at %s; starting afresh\n", who, p_ckpt);
    }
    for (int i = 0; i < tdm_train_data_n_seqs(data); i++)
        if (is_val[tdm_train_data_prompt(data, i)]) n_val_seqs++;
    val_seqs = malloc((size_t)TDM_MAX(n_val_seqs, 1) * sizeof *val_seqs);
    bseqs = malloc((size_t)to.max_seqs * sizeof *bseqs);
    cs = malloc((size_t)(sch.n_batches + 1) * sizeof *cs);
    cl = malloc((size_t)(sch.n_batches + 1) * sizeof *cl);
    vs = malloc((size_t)(sch.n_batches / c.ckpt_every + 3) * sizeof *vs);
    vl = malloc((size_t)(sch.n_batches / c.ckpt_every + 3) * sizeof *vl);
    if (!val_seqs || !bseqs || !cs || !cl || !vs || !vl) goto out;
    n_val_seqs = 0;
    for (int i = 0; i < tdm_train_data_n_seqs(data); i++)
        if (is_val[tdm_train_data_prompt(data, i)]) val_seqs[n_val_seqs++] = i;
    /* the CSV: a resumed run keeps the rows up to its checkpoint */
    if (!(csv = open_csv(p_csv, step0, cs, cl, &n_cl, vs, vl, &n_vl))) {
        fprintf(stderr, "%s: cannot write %s\n", who, p_csv);
        goto out;
    }

    /* 3. training */
    struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    fprintf(stderr,
            "%s: %d steps of up to %lld rows, head d_ff %d, unroll %lld, %d threads; "
            "%d held-out prompts (%d sequences)\n",
            who, sch.n_batches, (long long)c.batch_rows, g.d_ff, (long long)c.unroll,
            (int)c.threads, (int)c.n_val, n_val_seqs);
    double t_train0 = tdm_now_s(), rows_done = 0, last_print = 0;
    double deadline = c.minutes > 0 ? t_start + c.minutes * 60 : INFINITY;
    if (t_train0 >= deadline) {
        fprintf(stderr,
                "%s: the data took %.1f of the %g minutes of --minutes; none is left to train "
                "(the cache %s is kept: run again with more)\n",
                who, t_data / 60, c.minutes, p_data);
        rc = 1;
        goto out;
    }
    /* --minutes: after a few steps the step time is known, and the run plans its last step so
     * as to end by the deadline; the cosine schedule follows the plan */
    int64_t n_steps = sch.n_batches, plan_from = step0 + TDM_MAX(3, TDM_MIN(c.warmup, 20));
    struct tdm_train_loss l = {0};
    int64_t step = step0;
    bool tty = isatty(STDERR_FILENO);
    for (; step < n_steps && !g_stop; step++) {
        int nb = batch_seqs(&sch, data, (int)step, bseqs, to.max_seqs, (int)c.batch_rows);
        if (tdm_head_trainer_step(tr, bseqs, nb, tdm_train_data_top_k(data), &l) != TDM_OK) {
            tdm_tool_fail("training step");
            goto out;
        }
        for (int i = 0; i < nb; i++)
            rows_done += bseqs[i].len - 1;
        double now = tdm_now_s(), rate = rows_done / fmax(now - t_train0, 1e-9);
        if (isfinite(deadline) && step + 1 >= plan_from) {
            double per = (now - t_train0) / (double)(step + 1 - step0);
            int64_t fit = step + 1 + (int64_t)fmax(0, floor((deadline - now) / per));
            if (fit < n_steps) {
                n_steps = fit;
                tdm_head_trainer_set_total_steps(tr, n_steps);
            }
        }
        bool ck = (step + 1) % c.ckpt_every == 0 || step + 1 == n_steps;
        double vloss = NAN;
        if (ck && n_val_seqs)
            vloss = eval_loss(tr, data, val_seqs, n_val_seqs, to.max_seqs, (int)c.batch_rows,
                              tdm_train_data_top_k(data));
        fprintf(csv, "%lld,%d,%.6f,%.6f,%.4f,%.6f,%.6g,%.4f,", (long long)step + 1, l.pass[0].rows,
                l.loss, l.pass[0].ce, l.pass[0].top1, l.pass[0].reg, l.lr, l.grad_norm);
        if (isfinite(vloss)) fprintf(csv, "%.6f", vloss);
        fputc('\n', csv);
        fflush(csv);
        cs[n_cl] = (double)step + 1;
        cl[n_cl++] = l.loss;
        if (isfinite(vloss)) {
            vs[n_vl] = (double)step + 1;
            vl[n_vl++] = vloss;
        }
        if (tty || now - last_print > 10 || ck) {
            int width = 24, fill = (int)((step + 1) * width / n_steps);
            char bar[32];
            for (int i = 0; i < width; i++)
                bar[i] = i < fill ? '=' : ' ';
            bar[width] = 0;
            double eta = (n_steps - step - 1) * (now - t_train0) / (double)(step + 1 - step0);
            fprintf(stderr, "%s[%s] %lld/%d  %.0f tok/s  loss %.3f  ce %.3f  top1 %.3f",
                    tty ? "\r" : "", bar, (long long)step + 1, (int)n_steps, rate, l.loss,
                    l.pass[0].ce, l.pass[0].top1);
            if (c.unroll > 1)
                fprintf(stderr, " (d%lld %.3f)", (long long)c.unroll, l.pass[c.unroll - 1].top1);
            if (isfinite(vloss)) fprintf(stderr, "  held-out %.3f", vloss);
            fprintf(stderr, "  lr %.2e  eta %dm%02ds%s", l.lr, (int)eta / 60, (int)eta % 60,
                    tty && !ck ? "   " : "\n");
            last_print = now;
        }
        if (ck && step + 1 < n_steps &&
            tdm_head_trainer_save_checkpoint(tr, p_ckpt, ck_meta, n_ck) != TDM_OK)
            tdm_tool_fail("checkpoint");
    }
    double t_train = tdm_now_s() - t_train0;
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (g_stop) {
        if (tdm_head_trainer_save_checkpoint(tr, p_ckpt, ck_meta, n_ck) != TDM_OK) {
            tdm_tool_fail("checkpoint");
        } else {
            fprintf(stderr,
                    "\n%s: interrupted at step %lld of %d; checkpoint %s (run again with "
                    "--resume)\n",
                    who, (long long)step, sch.n_batches, p_ckpt);
        }
        rc = 130;
        goto out;
    }
    fclose(csv);
    csv = NULL;

    /* 4. the head, the curve, tau */
    snprintf(s_steps, sizeof s_steps, "%lld", (long long)n_steps);
    char s_cov[32], s_vocab[32];
    snprintf(s_cov, sizeof s_cov, "%.4f", coverage);
    snprintf(s_vocab, sizeof s_vocab, "%d", n_draft ? n_draft : m->cfg.vocab_size);
    const char *meta[] = {
        "format", "tandem-head", "trained_by", "tandem train-mtp",     "steps", s_steps, "seed",
        s_seed,   "draft_vocab", s_vocab,      "draft_vocab_coverage", s_cov};
    if (tdm_head_trainer_save(tr, c.out, c.dtype, meta, (int)TDM_ARRAY_LEN(meta) / 2) != TDM_OK) {
        tdm_tool_fail("saving the head");
        goto out;
    }
    char title[256];
    snprintf(title, sizeof title, "tandem train-mtp: %s", c.out);
    if (!write_svg(p_svg, cs, cl, n_cl, vs, vl, n_vl, title))
        fprintf(stderr, "%s: cannot write %s\n", who, p_svg);
    remove(p_ckpt); /* finished: nothing to resume */
    double tau[MAX_VAL_K] = {0}, acc[MAX_VAL_K * TDM_SPEC_MAX_K] = {0};
    bool have_tau = false;
    if (!c.no_val && c.n_val > 0) {
        int32_t **vids = malloc((size_t)c.n_val * sizeof *vids);
        int *vn = malloc((size_t)c.n_val * sizeof *vn), nv = 0;
        for (int i = 0; vids && vn && i < n_base; i++)
            if (is_val[i]) {
                vids[nv] = ids[i];
                vn[nv++] = n_ids[i];
            }
        double t0 = tdm_now_s();
        have_tau = vids && vn && measure_tau(c.out, m, tok, &c, vids, vn, nv, tau, acc);
        free(vids);
        free(vn);
        if (have_tau) {
            fprintf(stderr, "%s: tau on %d held-out prompts (greedy, %lld tokens, %.0f s):", who,
                    nv, (long long)c.val_tokens, tdm_now_s() - t0);
            for (int i = 0; i < c.n_val_k; i++)
                fprintf(stderr, "  k=%d %.3f", c.val_k[i], tau[i]);
            fputc('\n', stderr);
        }
    }
    json_t *j = json_object(), *jt = json_object();
    json_object_set_new(j, "head", json_string(c.out));
    json_object_set_new(j, "steps", json_integer(n_steps));
    json_object_set_new(j, "sequences", json_integer(tdm_train_data_n_seqs(data)));
    json_object_set_new(j, "positions", json_integer(tdm_train_data_positions(data)));
    json_object_set_new(j, "data_s", json_real(t_data));
    json_object_set_new(j, "train_s", json_real(t_train));
    json_object_set_new(j, "train_rows_per_s", json_real(rows_done / fmax(t_train, 1e-9)));
    json_object_set_new(j, "loss", json_real(l.loss));
    json_object_set_new(j, "ce", json_real(l.pass[0].ce));
    json_object_set_new(j, "top1", json_real(l.pass[0].top1));
    if (n_vl) json_object_set_new(j, "held_out_loss", json_real(vl[n_vl - 1]));
    json_object_set_new(j, "draft_vocab", json_integer(n_draft ? n_draft : m->cfg.vocab_size));
    json_object_set_new(j, "draft_vocab_coverage", json_real(coverage));
    for (int i = 0; have_tau && i < c.n_val_k; i++) {
        char key[8];
        snprintf(key, sizeof key, "%d", c.val_k[i]);
        json_object_set_new(jt, key, json_real(tau[i]));
    }
    json_object_set_new(j, "tau", jt);
    json_object_set_new(j, "minutes", json_real((tdm_now_s() - t_start) / 60));
    char *js = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (js) {
        printf("%s\n", js);
        if (!tdm_tool_write_file_atomic(p_json, js)) fprintf(stderr, "%s: %s\n", who, p_json);
    }
    free(js);
    fprintf(stderr, "%s: wrote %s (%s), %s, %s in %.1f min\n", who, c.out, c.dtype, p_csv, p_svg,
            (tdm_now_s() - t_start) / 60);
    rc = 0;
out:
    if (csv) fclose(csv);
    free(cs);
    free(cl);
    free(vs);
    free(vl);
    free(bseqs);
    free(sch.order);
    free(sch.start);
    free(val_seqs);
    free(is_val);
    free(dvocab);
    tdm_head_trainer_destroy(tr);
    tdm_cuda_gemm_destroy(gpu);
    tdm_train_data_free(data);
    for (int i = 0; ids && i < n_prompts; i++)
        free(ids[i]);
    free(ids);
    free(n_ids);
    tdm_tool_free_prompts(texts, n_prompts);
    tdm_tok_free(tok);
    tdm_model_free(m);
    return rc;
}
