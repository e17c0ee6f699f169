/*
 * Helpers shared by the subcommands: model and tokenizer loading with a progress bar, strict
 * option parsing.
 */
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

struct tdm_model *tdm_tool_load_model(const char *path)
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
    tdm_status st = tdm_model_load(path, tty ? progress_bar : NULL, &last, &m);
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
