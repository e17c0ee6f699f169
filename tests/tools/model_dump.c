/*
 * model_dump: a helper for tests/model/test_loader.py, which checks the loader against
 * checkpoints written by the Python gguf and safetensors packages.
 *
 *   model_dump [--keep-k-blocks] MODEL [WEIGHT OUT.f32]...
 *       Loads MODEL (a .gguf file or a HF folder) with tdm_model_load_opts (keep_k_blocks when
 *       asked) and prints its config,
 *       counts and the chosen weights' geometry as one JSON object on stdout. Each WEIGHT
 *       (tok_embd, output, output_norm, rope_freqs, layers.N.<field> with <field> a member of
 *       struct tdm_layer_weights) is written to OUT.f32 as float32 [rows][cols], dequantised
 *       row by row with tdm_dequantize when held quantised.
 *   model_dump --st PATH [TENSOR OUT.bin]...
 *       Opens PATH with tdm_st_open, prints every tensor (name, dtype, ne) as JSON, and writes
 *       the raw bytes of each named TENSOR.
 *
 * On failure prints "error: <status>: <message>" on stderr and exits 1.
 */
#include "tandem/model.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(tdm_status st)
{
    fprintf(stderr, "error: %s: %s\n", tdm_status_str(st), tdm_err_msg());
    return 1;
}

static int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = n ? fwrite(data, 1, n, f) : 0;
    int rc = fclose(f);
    return (w == n && rc == 0) ? 0 : -1;
}

static const struct tdm_weight *weight_by_name(const struct tdm_model *m, const char *name,
                                               struct tdm_weight *tmp)
{
    if (!strcmp(name, "tok_embd")) return &m->tok_embd;
    if (!strcmp(name, "output")) return &m->output;
    if (!strcmp(name, "output_norm")) return &m->output_norm;
    if (!strcmp(name, "rope_freqs")) {
        if (!m->rope_freqs) return NULL;
        int64_t n = m->cfg.head_dim / 2;
        *tmp = (struct tdm_weight){TDM_DTYPE_F32, 1, n, (size_t)n * 4, m->rope_freqs};
        return tmp;
    }
    int layer;
    char field[32];
    if (sscanf(name, "layers.%d.%31s", &layer, field) != 2 || layer < 0 || layer >= m->cfg.n_layers)
        return NULL;
    const struct tdm_layer_weights *l = &m->layers[layer];
    static const struct {
        const char *name;
        size_t off;
    } fields[] = {
#define F(x) {#x, offsetof(struct tdm_layer_weights, x)}
        F(attn_norm), F(wq),     F(wk), F(wv),       F(bq),     F(bk),   F(bv),
        F(q_norm),    F(k_norm), F(wo), F(ffn_norm), F(w_gate), F(w_up), F(w_down),
#undef F
    };
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++)
        if (!strcmp(field, fields[i].name))
            return (const struct tdm_weight *)((const char *)l + fields[i].off);
    return NULL;
}

static json_t *num_or_null(double v)
{
    return isnan(v) ? json_null() : json_real(v);
}

static void on_progress(void *ctx, double f)
{
    json_array_append_new((json_t *)ctx, json_real(f));
}

static int dump_model(int argc, char **argv, const struct tdm_load_opts *lo)
{
    json_t *progress = json_array();
    struct tdm_model *m = NULL;
    tdm_status st = tdm_model_load_opts(argv[1], lo, on_progress, progress, &m);
    if (st) return fail(st);
    const struct tdm_model_config *c = &m->cfg;
    static const char *scaling[] = {"none", "linear", "llama3"};
    json_t *eos = json_array();
    for (int i = 0; i < c->n_eos; i++)
        json_array_append_new(eos, json_integer(c->eos_ids[i]));
    json_t *o = json_object();
    json_object_set_new(o, "arch", json_string(tdm_arch_name(c->arch)));
    json_object_set_new(o, "n_layers", json_integer(c->n_layers));
    json_object_set_new(o, "d_model", json_integer(c->d_model));
    json_object_set_new(o, "n_heads", json_integer(c->n_heads));
    json_object_set_new(o, "n_kv_heads", json_integer(c->n_kv_heads));
    json_object_set_new(o, "head_dim", json_integer(c->head_dim));
    json_object_set_new(o, "d_ff", json_integer(c->d_ff));
    json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(o, "max_ctx", json_integer(c->max_ctx));
    json_object_set_new(o, "rms_eps", json_real(c->rms_eps));
    json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
    json_object_set_new(o, "rope_neox", json_boolean(c->rope_neox));
    json_object_set_new(o, "rope_scaling", json_string(scaling[c->rope_scaling]));
    json_object_set_new(o, "rope_factor", json_real(c->rope_factor));
    json_object_set_new(o, "rope_low_freq_factor", json_real(c->rope_low_freq_factor));
    json_object_set_new(o, "rope_high_freq_factor", json_real(c->rope_high_freq_factor));
    json_object_set_new(o, "rope_original_max_ctx", json_integer(c->rope_original_max_ctx));
    json_object_set_new(o, "tied_embeddings", json_boolean(c->tied_embeddings));
    json_object_set_new(o, "qkv_bias", json_boolean(c->qkv_bias));
    json_object_set_new(o, "qk_norm", json_boolean(c->qk_norm));
    json_object_set_new(o, "bos_id", json_integer(c->bos_id));
    json_object_set_new(o, "eos_ids", eos);
    json_object_set_new(o, "gen_temperature", num_or_null(c->gen_temperature));
    json_object_set_new(o, "gen_top_p", num_or_null(c->gen_top_p));
    json_object_set_new(o, "gen_top_k", json_integer(c->gen_top_k));
    json_object_set_new(o, "is_gguf", json_boolean(m->is_gguf));
    json_object_set_new(o, "n_params", json_integer((json_int_t)m->n_params));
    json_object_set_new(o, "weight_bytes", json_integer((json_int_t)m->weight_bytes));
    json_object_set_new(o, "chat_template",
                        m->chat_template ? json_string(m->chat_template) : json_null());
    json_object_set_new(o, "has_rope_freqs", json_boolean(m->rope_freqs != NULL));
    json_object_set_new(o, "output_is_tok_embd", json_boolean(m->output.data == m->tok_embd.data));
    json_object_set_new(o, "progress", progress);

    json_t *weights = json_object();
    int rc = 0;
    for (int a = 2; a + 1 < argc && !rc; a += 2) {
        struct tdm_weight tmp;
        const struct tdm_weight *w = weight_by_name(m, argv[a], &tmp);
        if (!w || !w->data) {
            fprintf(stderr, "error: no weight %s\n", argv[a]);
            rc = 1;
            break;
        }
        float *buf = malloc(sizeof(float) * (size_t)(w->rows * w->cols) + 1);
        for (int64_t r = 0; r < w->rows && buf; r++) {
            st = tdm_dequantize(w->dtype, (const char *)w->data + (size_t)r * w->row_bytes,
                                buf + r * w->cols, w->cols);
            if (st) {
                rc = fail(st);
                break;
            }
        }
        if (!buf ||
            (!rc && write_file(argv[a + 1], buf, sizeof(float) * (size_t)(w->rows * w->cols)))) {
            fprintf(stderr, "error: cannot write %s\n", argv[a + 1]);
            rc = 1;
        }
        free(buf);
        json_t *wj = json_object();
        json_object_set_new(wj, "dtype", json_string(tdm_dtype_name(w->dtype)));
        json_object_set_new(wj, "rows", json_integer(w->rows));
        json_object_set_new(wj, "cols", json_integer(w->cols));
        json_object_set_new(wj, "row_bytes", json_integer((json_int_t)w->row_bytes));
        json_object_set_new(wj, "aligned",
                            json_boolean((uintptr_t)w->data % 4 == 0 || w->dtype != TDM_DTYPE_F32));
        json_object_set_new(weights, argv[a], wj);
    }
    json_object_set_new(o, "weights", weights);
    if (!rc) {
        char *s = json_dumps(o, JSON_INDENT(1) | JSON_REAL_PRECISION(9));
        puts(s);
        free(s);
    }
    json_decref(o);
    tdm_model_free(m);
    return rc;
}

static int dump_st(int argc, char **argv)
{
    tdm_st_t *st = NULL;
    tdm_status s = tdm_st_open(argv[2], &st);
    if (s) return fail(s);
    json_t *list = json_array();
    for (int64_t i = 0; i < tdm_st_n_tensors(st); i++) {
        const struct tdm_tensor_info *t = tdm_st_tensor(st, i);
        json_t *ne = json_array();
        for (int d = 0; d < t->n_dims; d++)
            json_array_append_new(ne, json_integer(t->ne[d]));
        json_t *tj = json_object();
        json_object_set_new(tj, "name", json_string(t->name));
        json_object_set_new(
            tj, "dtype",
            json_string(tdm_dtype_known((int)t->dtype) ? tdm_dtype_name(t->dtype) : "unsupported"));
        json_object_set_new(tj, "ne", ne);
        json_object_set_new(tj, "nbytes", json_integer((json_int_t)t->nbytes));
        json_array_append_new(list, tj);
    }
    int rc = 0;
    for (int a = 3; a + 1 < argc && !rc; a += 2) {
        const struct tdm_tensor_info *t = tdm_st_find_tensor(st, argv[a]);
        if (!t || write_file(argv[a + 1], t->data, t->nbytes)) {
            fprintf(stderr, "error: cannot dump %s\n", argv[a]);
            rc = 1;
        }
    }
    if (!rc) {
        char *out = json_dumps(list, JSON_INDENT(1));
        puts(out);
        free(out);
    }
    json_decref(list);
    tdm_st_close(st);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc >= 3 && !strcmp(argv[1], "--st")) return dump_st(argc, argv);
    struct tdm_load_opts lo = {0};
    if (argc >= 2 && !strcmp(argv[1], "--keep-k-blocks")) {
        lo.keep_k_blocks = true;
        argc--, argv++;
    }
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: model_dump [--keep-k-blocks] MODEL [WEIGHT OUT.f32]...\n"
                        "       model_dump --st PATH [TENSOR OUT.bin]...\n");
        return 2;
    }
    return dump_model(argc, argv, &lo);
}
