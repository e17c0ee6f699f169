/*
 * head_dump: a helper for tests/spec/test_mtp.py, which checks a speculation head's forward
 * pass against the numpy reference (tests/lib/reference.py, head_forward).
 *
 *   head_dump MODEL HEAD OUT TOKEN...
 *       Loads MODEL and the head HEAD (tdm_head_load), runs the target over the P tokens with
 *       every token's feature out, then the head over rows p = 0 .. P-2 (token p + 1, the
 *       target's feature p, at position p) in two runs, so the second reads the first's KV.
 *       Then one more row as a chain's deeper draft runs it: position P-1, token TOKEN[1], fed
 *       the head's own feature of row P-2 (own_hidden).
 *       Writes OUT.feat (the target's features [P][feature_width]: the final-normed states, or
 *       an EAGLE-3 head's fused residuals of its target layers), OUT.logits (the head's logits
 *       [P-1][vocab]), OUT.hfeat (the head's features [P-1][d_model]), OUT.own_logits and
 *       OUT.own_hfeat (the own-fed row's, [vocab] and [d_model]), float32, and prints
 *       {"layout": ..., "n_heads": ..., "n_kv_heads": ..., "d_ff": ..., "feature_width": ...,
 *       "aux_layers": [...], "n_draft": ...} on stdout.
 *
 * On failure prints "error: <status>: <message>" on stderr and exits 1.
 */
#include <stdio.h>
#include <stdlib.h>

#include "tandem/engine.h"
#include "tandem/spec.h"

static int fail(tdm_status st)
{
    fprintf(stderr, "error: %s: %s\n", tdm_status_str(st), tdm_err_msg());
    return 1;
}

static int write_f32(const char *prefix, const char *ext, const float *x, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, ext);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(x, sizeof *x, n, f) != n) {
        fprintf(stderr, "error: cannot write %s\n", path);
        if (f) fclose(f);
        return 1;
    }
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: head_dump MODEL HEAD OUT TOKEN TOKEN...\n");
        return 2;
    }
    int P = argc - 4;
    int32_t *tok = calloc((size_t)P, sizeof *tok);
    for (int i = 0; i < P; i++)
        tok[i] = (int32_t)atoi(argv[4 + i]);
    struct tdm_model *m = NULL, *h = NULL;
    tdm_status st;
    if ((st = tdm_model_load(argv[1], NULL, NULL, &m)) != TDM_OK) return fail(st);
    if ((st = tdm_head_load(argv[2], m, &h)) != TDM_OK) return fail(st);
    struct tdm_kv_group g;
    tdm_spec_kv_group(h, &g);
    struct tdm_engine_opts to = {.n_threads = 2,
                                 .max_ctx = 256,
                                 .max_seqs = 4,
                                 .kv_pages = 64,
                                 .kv_extra = &g,
                                 .n_kv_extra = 1};
    for (int i = 0; i < h->head->n_aux; i++) /* an EAGLE-3 head's fused target layers */
        to.feature_layers[i] = h->head->aux_layers[i];
    to.n_feature_layers = h->head->n_aux;
    tdm_engine_t *te = NULL, *he = NULL;
    if ((st = tdm_engine_create(m, &to, &te)) != TDM_OK) return fail(st);
    struct tdm_engine_opts ho = {.max_ctx = 256,
                                 .max_seqs = 4,
                                 .kv_shared = tdm_engine_kv(te),
                                 .kv_group = 1,
                                 .backend = tdm_engine_backend(te)};
    if ((st = tdm_engine_create(h, &ho, &he)) != TDM_OK) return fail(st);
    int d = m->cfg.d_model, V = m->cfg.vocab_size, fw = h->head->feature_width;
    struct tdm_kv_seq seq = {0};
    if ((st = tdm_kv_seq_reserve(tdm_engine_kv(te), &seq, P)) != TDM_OK) return fail(st);
    float *feat = calloc((size_t)P * fw, sizeof *feat);
    float *logits = calloc((size_t)P * V, sizeof *logits);
    float *hfeat = calloc((size_t)P * d, sizeof *hfeat);
    struct tdm_batch_seq s = {
        .tokens = tok, .n_tokens = P, .pages = seq.pages, .n_pages = seq.n_pages, .features = feat};
    if ((st = tdm_engine_run(te, &(struct tdm_batch){&s, 1}, &(struct tdm_engine_out){0})) !=
        TDM_OK)
        return fail(st);
    int rows = P - 1, first = rows / 2 > 0 ? rows / 2 : rows;
    for (int p0 = 0; p0 < rows;) {
        int n = p0 == 0 ? first : rows - p0;
        struct tdm_batch_seq hs = {.tokens = tok + p0 + 1,
                                   .n_tokens = n,
                                   .pos0 = p0,
                                   .pages = seq.pages,
                                   .n_pages = seq.n_pages,
                                   .n_logits = n,
                                   .hidden = feat + (size_t)p0 * fw,
                                   .features = hfeat + (size_t)p0 * d};
        struct tdm_engine_out out = {.logits = logits + (size_t)p0 * V};
        if ((st = tdm_engine_run(he, &(struct tdm_batch){&hs, 1}, &out)) != TDM_OK) return fail(st);
        p0 += n;
    }
    /* a deeper draft's row: the head's own feature of the row before */
    struct tdm_batch_seq os = {.tokens = tok + 1,
                               .n_tokens = 1,
                               .pos0 = P - 1,
                               .pages = seq.pages,
                               .n_pages = seq.n_pages,
                               .n_logits = 1,
                               .hidden = hfeat + (size_t)(rows - 1) * d,
                               .own_hidden = true,
                               .features = hfeat + (size_t)rows * d};
    if ((st = tdm_engine_run(he, &(struct tdm_batch){&os, 1},
                             &(struct tdm_engine_out){.logits = logits + (size_t)rows * V})) !=
        TDM_OK)
        return fail(st);
    int rc = write_f32(argv[3], "feat", feat, (size_t)P * fw) ||
             write_f32(argv[3], "logits", logits, (size_t)rows * V) ||
             write_f32(argv[3], "hfeat", hfeat, (size_t)rows * d) ||
             write_f32(argv[3], "own_logits", logits + (size_t)rows * V, (size_t)V) ||
             write_f32(argv[3], "own_hfeat", hfeat + (size_t)rows * d, (size_t)d);
    printf("{\"layout\": \"%s\", \"n_heads\": %d, \"n_kv_heads\": %d, \"d_ff\": %d, "
           "\"feature_width\": %d, \"aux_layers\": [",
           tdm_head_layout_name(h->head->layout), h->cfg.n_heads, h->cfg.n_kv_heads, h->cfg.d_ff,
           fw);
    for (int i = 0; i < h->head->n_aux; i++)
        printf("%s%d", i ? ", " : "", h->head->aux_layers[i]);
    printf("], \"n_draft\": %d}\n", h->head->n_draft);
    tdm_kv_seq_release(tdm_engine_kv(te), &seq);
    tdm_engine_destroy(he);
    tdm_engine_destroy(te);
    tdm_model_free(h);
    tdm_model_free(m);
    free(tok);
    free(feat);
    free(logits);
    free(hfeat);
    return rc;
}
