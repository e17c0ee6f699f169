/*
 * Helpers shared by the subcommands: model and tokenizer loading with a progress bar, strict
 * option parsing, prompt sets.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tools/tools_int.h"

void tdm_tool_fail(const char *what)
{
    fprintf(stderr, "tandem: %s: %s\n", what, tdm_err_msg()[0] ? tdm_err_msg() : "failed");
}

static void progress_bar(void *ctx, double fraction)
{
    int *last = ctx;
    int pct = (int)(fraction * 100.0 + 0.5);
    if (pct == *last) return;
    *last = pct;
    int width = 40, fill = pct * width / 100;
    fprintf(stderr, "\rloading [");
    for (int i = 0; i < width; i++)
        fputc(i < fill ? '#' : ' ', stderr);
    fprintf(stderr, "] %3d%%", pct);
    if (pct >= 100) fputc('\n', stderr);
    fflush(stderr);
}

uint64_t tdm_tool_expert_bytes(const struct tdm_model *m, int *sparse, uint64_t *one)
{
    uint64_t all = 0;
    *sparse = 0;
    *one = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct tdm_layer_weights *lw = &m->layers[l];
        if (!lw->n_experts) continue;
        uint64_t first = 0;
        for (int i = 0; i < 3 * lw->n_experts; i++) {
            uint64_t b = (uint64_t)lw->experts[i].row_bytes * (uint64_t)lw->experts[i].rows;
            all += b;
            if (i < 3) first += b;
        }
        if (!*sparse) *one = first; /* every expert of a model has the same */
        ++*sparse;
    }
    return all;
}

int tdm_tool_layer_weights(const struct tdm_layer_weights *w, const struct tdm_weight **out)
{
    const struct tdm_weight *all[] = {
        &w->attn_norm, &w->wq,        &w->wk,         &w->wv,       &w->bq,       &w->bk,
        &w->bv,        &w->q_norm,    &w->k_norm,     &w->wo,       &w->ffn_norm, &w->w_gate,
        &w->w_up,      &w->w_down,    &w->wq_a,       &w->q_a_norm, &w->wq_b,     &w->wkv_c,
        &w->wkv_r,     &w->kv_a_norm, &w->mla_absorb, &w->mla_uv};
    const struct tdm_weight *moe[] = {&w->router, &w->sh_gate, &w->sh_up, &w->sh_down,
                                      &w->sh_score};
    int n = 0;
    for (size_t i = 0; i < TDM_ARRAY_LEN(all); i++)
        out[n++] = all[i];
    for (size_t i = 0; w->n_experts && i < TDM_ARRAY_LEN(moe); i++)
        out[n++] = moe[i];
    return n;
}

struct tdm_model *tdm_tool_load_model(const char *path)
{
    return tdm_tool_load_model_opts(path, NULL);
}

struct tdm_model *tdm_tool_load_model_opts(const char *path, const struct tdm_load_opts *opts)
{
    char def[4096];
    if (!path) {
        if (!tdm_default_model_path(def, sizeof def)) {
            fprintf(stderr, "tandem: cannot form the default model path (is $HOME set?)\n");
            return NULL;
        }
        path = def;
        if (access(path, R_OK) != 0) {
            fprintf(stderr,
                    "tandem: the default model is not at %s\n"
                    "        fetch it with scripts/fetch_model.sh, or pass --model PATH\n",
                    path);
            return NULL;
        }
    }
    int last = -1;
    bool tty = isatty(STDERR_FILENO);
    struct tdm_model *m = NULL;
    tdm_status st = tdm_model_load_opts(path, opts, tty ? progress_bar : NULL, &last, &m);
    if (tty && last >= 0 && last < 100) fputc('\n', stderr);
    if (st != TDM_OK) {
        fprintf(stderr, "tandem: cannot load model %s: %s\n", path, tdm_err_msg());
        return NULL;
    }
    return m;
}

tdm_tok_t *tdm_tool_load_tokenizer(const struct tdm_model *m, bool quiet)
{
    tdm_tok_t *tok = NULL;
    tdm_status st;
    if (m->gguf) {
        st = tdm_tok_from_gguf(m->gguf, &tok);
    } else {
        char path[4096];
        struct stat sb;
        if (snprintf(path, sizeof path, "%s/tokenizer.json", m->path) >= (int)sizeof path ||
            stat(path, &sb) != 0) {
            if (!quiet) fprintf(stderr, "tandem: %s has no tokenizer.json\n", m->path);
            return NULL;
        }
        st = tdm_tok_from_hf(path, &tok);
    }
    if (st != TDM_OK) {
        if (!quiet) tdm_tool_fail("tokenizer");
        return NULL;
    }
    return tok;
}

bool tdm_tool_int(const char *name, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    while (*name == '-') /* "--port" or "port": the message adds the dashes */
        name++;
    if (!tdm_parse_i64(s, lo, hi, out)) {
        fprintf(stderr, "tandem: --%s: expected an integer in [%lld, %lld], got '%s'\n", name,
                (long long)lo, (long long)hi, s);
        return false;
    }
    return true;
}

bool tdm_tool_float(const char *name, const char *s, double lo, double hi, double *out)
{
    while (*name == '-')
        name++;
    if (!tdm_parse_f64(s, out) || *out < lo || *out > hi) {
        fprintf(stderr, "tandem: --%s: expected a number in [%g, %g], got '%s'\n", name, lo, hi, s);
        return false;
    }
    return true;
}

bool tdm_tool_parse_ids(const char *s, int32_t **ids, int *n)
{
    int cap = 16, len = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    if (!v) return false;
    const char *p = s;
    while (*p) {
        char buf[32];
        size_t k = strcspn(p, ",");
        if (k == 0 || k >= sizeof buf) goto bad;
        memcpy(buf, p, k);
        buf[k] = '\0';
        int64_t id;
        if (!tdm_parse_i64(buf, 0, INT32_MAX, &id)) goto bad;
        if (len == cap) {
            if (cap >= (1 << 24)) goto bad;
            int32_t *nv = realloc(v, (size_t)cap * 2 * sizeof *nv);
            if (!nv) goto bad;
            v = nv;
            cap *= 2;
        }
        v[len++] = (int32_t)id;
        p += k;
        if (*p == ',') {
            p++;
            if (!*p) goto bad;
        }
    }
    if (len == 0) goto bad;
    *ids = v;
    *n = len;
    return true;
bad:
    fprintf(stderr, "tandem: --prompt-tokens: expected comma-separated token ids, got '%s'\n", s);
    free(v);
    return false;
}

bool tdm_tool_write_file_atomic(const char *path, const char *text)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s\n", text) < 0 || fclose(f) || rename(tmp, path)) {
        fprintf(stderr, "tandem: cannot write %s\n", path);
        return false;
    }
    return true;
}

/* ---- prompt sets: one JSON string a line ---- */
int tdm_tool_parse_prompts(const char *who, const char *label, const char *text, size_t len,
                           int limit, char ***out)
{
    int n = 0, room = 0, lineno = 0;
    char **v = NULL;
    const char *p = text, *end = text + len;
    while (p < end && (limit <= 0 || n < limit)) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t ll = nl ? (size_t)(nl - p) : (size_t)(end - p);
        const char *line = p;
        p = nl ? nl + 1 : end;
        lineno++;
        size_t blank = 0;
        while (blank < ll && strchr(" \t\r", line[blank]))
            blank++;
        if (blank == ll) continue;
        json_error_t err;
        json_t *j = json_loadb(line, ll, JSON_DECODE_ANY, &err);
        if (!j || !json_is_string(j) || !json_string_length(j)) {
            fprintf(stderr, "%s: %s:%d: not a non-empty JSON string\n", who, label, lineno);
            json_decref(j);
            goto fail;
        }
        if (n == room) {
            room = room ? room * 2 : 64;
            char **nv = realloc(v, (size_t)room * sizeof *nv);
            if (!nv) {
                json_decref(j);
                goto fail;
            }
            v = nv;
        }
        v[n] = strdup(json_string_value(j));
        json_decref(j);
        if (!v[n++]) goto fail;
    }
    if (n == 0) {
        fprintf(stderr, "%s: %s has no prompts\n", who, label);
        free(v);
        return -1;
    }
    *out = v;
    return n;
fail:
    tdm_tool_free_prompts(v, n);
    return -1;
}

int tdm_tool_read_prompts(const char *who, const char *path, int limit, char ***out)
{
    char *text = NULL;
    size_t len = 0;
    if (tdm_file_read(path, (size_t)1 << 30, &text, &len) != TDM_OK) {
        fprintf(stderr, "%s: cannot open %s: %s\n", who, path, tdm_err_msg());
        return -1;
    }
    int n = tdm_tool_parse_prompts(who, path, text, len, limit, out);
    free(text);
    return n;
}

void tdm_tool_free_prompts(char **texts, int n)
{
    for (int i = 0; texts && i < n; i++)
        free(texts[i]);
    free(texts);
}

bool tdm_tool_encode_prompts(const char *who, const struct tdm_model *m, const tdm_tok_t *tok,
                             char *const *texts, int n, bool raw, int64_t max_len, int32_t ***ids,
                             int **n_ids)
{
    struct tdm_chat_template tmpl = {0};
    if (!raw && tdm_chat_template_detect(m->chat_template, &tmpl) != TDM_OK) {
        fprintf(stderr, "%s: no chat template tandem understands; use --raw\n", who);
        return false;
    }
    int32_t **v = calloc((size_t)n, sizeof *v);
    int *nv = calloc((size_t)n, sizeof *nv);
    bool ok = v && nv;
    for (int i = 0; ok && i < n; i++) {
        char *rendered = NULL;
        const char *text = texts[i];
        bool add_bos = tdm_tok_adds_bos(tok);
        if (!raw) {
            struct tdm_chat_msg msg = {.role = "user", .content = texts[i]};
            if (tdm_chat_render(&tmpl, &msg, 1, true, &rendered) != TDM_OK) {
                tdm_tool_fail("chat template");
                ok = false;
                break;
            }
            text = rendered;
            if (tmpl.add_bos_text) add_bos = false;
        }
        size_t len = strlen(text), n_out = 0;
        v[i] = malloc((len + 8) * sizeof(int32_t));
        int flags = (raw ? 0 : TDM_TOK_PARSE_SPECIAL) | (add_bos ? TDM_TOK_ADD_BOS : 0);
        tdm_status st =
            v[i] ? tdm_tok_encode(tok, text, len, flags, v[i], len + 8, &n_out) : TDM_ENOMEM;
        free(rendered);
        if (st != TDM_OK || !n_out || (int64_t)n_out > max_len) {
            fprintf(stderr, "%s: prompt %d does not encode or is longer than %lld tokens\n", who,
                    i + 1, (long long)max_len);
            ok = false;
            break;
        }
        nv[i] = (int)n_out;
    }
    tdm_chat_template_clear(&tmpl);
    if (!ok) {
        for (int i = 0; v && i < n; i++)
            free(v[i]);
        free(v);
        free(nv);
        return false;
    }
    *ids = v;
    *n_ids = nv;
    return true;
}
