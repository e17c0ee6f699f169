/*
 * Tensor parallelism's per-rank model views (engine_int.h): what one rank of a sharded engine
 * holds of a model, as a struct tdm_model the engine prepares like any other.
 *
 * Why a model view: a rank runs the engine's own layer loop unchanged over fewer heads and
 * fewer MLP columns, so its attention and MLP are the whole model's ops on a smaller shape. Its
 * partial output projections are then summed over the ranks (tp.h's all-reduce), which is the
 * only thing the layer loop adds for TP.
 *
 *   wq, bq:      rows   [q_head0 * hd, (q_head0 + n_q_heads) * hd)   (a pointer into m)
 *   wk, wv, bk, bv: rows [kv_head0 * hd, ...)                         (a pointer into m)
 *   wo:          columns of the same query heads                      (a copy)
 *   gate, up:    rows   [ff0, ff0 + n_ff)                             (a pointer into m)
 *   down:        columns [ff0, ff0 + n_ff)                            (a copy)
 *   output:      rows   [vocab0, vocab0 + n_vocab) (the LM head)     (a pointer into m)
 *
 * A speculation head (m->head) is viewed the same way: its one layer as above, its LM head by
 * rows (a reduced draft vocabulary's rows: the caller's s splits n_draft), and its input stage
 * (fc_e, fc_h, the norms, d2t) m's, whole: every rank runs it (engine.c says why). An EAGLE-3
 * head's q/k/v read [embedding ; feature] as two products (engine.c, eagle3_qkv): the layer's
 * wq, wk, wv hold the embedding's columns and the head's wq_h, wk_h, wv_h the feature's, each
 * [rows][d_model]; both are split by the same rows, so the view has a head of its own (a copy
 * of m's with those three sliced; its fc, norms and maps still m's).
 *
 *   wq_h:        rows   [q_head0 * hd, ...)       wk_h, wv_h: rows [kv_head0 * hd, ...)
 *
 * A weight's rows are whole rows of its blocks, so a row slice is a pointer; a column slice is
 * a copy, of whole blocks where it starts and ends on a block, else dequantised to F32 (the
 * products then see the same values; only the summation order of the kernels may differ).
 *
 * Ownership: the view owns its layer array and its copies (in view->owned); everything else is
 * m's. Built on the loading thread, read-only afterwards.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_int.h"

/* Rows [r0, r0 + n) of w (a matrix, or a vector's elements when w has one row). */
static struct tdm_weight slice_rows(const struct tdm_weight *w, int64_t r0, int64_t n)
{
    if (!w->data) return *w;
    struct tdm_weight s = *w;
    if (w->rows == 1 && w->dtype == TDM_DTYPE_F32) { /* a vector [cols] */
        s.data = (const float *)w->data + r0;
        s.cols = n;
        s.row_bytes = (size_t)n * sizeof(float);
        return s;
    }
    s.data = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
    s.rows = n;
    return s;
}

/* Columns [c0, c0 + n) of matrix w, a copy the view owns. */
static tdm_status slice_cols(struct tdm_model *v, const struct tdm_weight *w, int64_t c0, int64_t n,
                             struct tdm_weight *out)
{
    if (!w->data) {
        *out = *w;
        return TDM_OK;
    }
    const int64_t be = tdm_dtype_block_elems(w->dtype);
    const size_t bb = tdm_dtype_block_bytes(w->dtype);
    if (be <= 0 || bb == 0)
        return tdm_err_set(TDM_EUNSUPPORTED, "tp: no block geometry for %s weights",
                           tdm_dtype_name(w->dtype));
    void *buf;
    tdm_status st;
    if (c0 % be == 0 && n % be == 0) { /* whole blocks */
        const size_t rb = (size_t)(n / be) * bb, off = (size_t)(c0 / be) * bb;
        if ((st = tdm_model_alloc_owned(v, rb * (size_t)w->rows, &buf)) != TDM_OK) return st;
        for (int64_t r = 0; r < w->rows; r++)
            memcpy((uint8_t *)buf + (size_t)r * rb,
                   (const uint8_t *)w->data + (size_t)r * w->row_bytes + off, rb);
        *out = (struct tdm_weight){w->dtype, w->rows, n, rb, buf};
        return TDM_OK;
    }
    float *row = malloc((size_t)w->cols * sizeof(float));
    if (!row) return tdm_err_set(TDM_ENOMEM, "tp: out of memory");
    if ((st = tdm_model_alloc_owned(v, (size_t)n * (size_t)w->rows * sizeof(float), &buf)) !=
        TDM_OK)
        goto out;
    for (int64_t r = 0; r < w->rows; r++) {
        if ((st = tdm_dequantize(w->dtype, (const uint8_t *)w->data + (size_t)r * w->row_bytes, row,
                                 w->cols)) != TDM_OK)
            goto out;
        memcpy((float *)buf + (size_t)r * n, row + c0, (size_t)n * sizeof(float));
    }
    *out = (struct tdm_weight){TDM_DTYPE_F32, w->rows, n, (size_t)n * sizeof(float), buf};
out:
    free(row);
    return st;
}

void tdm_engine_shard_model_free(struct tdm_model *view)
{
    if (!view) return;
    for (int i = 0; i < view->n_owned; i++)
        tdm_free_aligned(view->owned[i]);
    free(view->owned);
    free(view->layers);
    free(view);
}

tdm_status tdm_engine_shard_model(const struct tdm_model *m, const struct tdm_tp_shard *s,
                                  struct tdm_model **out)
{
    const struct tdm_model_config *c = &m->cfg;
    TDM_ASSERT(!c->n_experts && !tdm_config_mla(c));
    struct tdm_model *v = calloc(1, sizeof *v);
    if (!v) return tdm_err_set(TDM_ENOMEM, "tp: out of memory");
    *v = *m; /* borrows everything but what is replaced below */
    v->owned = NULL;
    v->n_owned = v->cap_owned = 0;
    v->gguf = NULL;
    v->st = NULL;
    v->layers = calloc((size_t)c->n_layers, sizeof *v->layers);
    if (!v->layers) {
        free(v);
        return tdm_err_set(TDM_ENOMEM, "tp: out of memory");
    }
    v->cfg.n_heads = s->n_q_heads;
    v->cfg.n_kv_heads = s->n_kv_heads;
    v->cfg.d_ff = (int)s->n_ff;
    v->output = slice_rows(&m->output, s->vocab0, s->n_vocab);
    const int64_t hd = c->head_dim;
    const int64_t q0 = s->q_head0 * hd, nq = s->n_q_heads * hd;
    const int64_t k0 = s->kv_head0 * hd, nk = s->n_kv_heads * hd;
    tdm_status st = TDM_OK;
    for (int l = 0; l < c->n_layers && st == TDM_OK; l++) {
        const struct tdm_layer_weights *w = &m->layers[l];
        struct tdm_layer_weights *d = &v->layers[l];
        *d = *w;
        d->wq = slice_rows(&w->wq, q0, nq);
        d->bq = slice_rows(&w->bq, q0, nq);
        d->wk = slice_rows(&w->wk, k0, nk);
        d->bk = slice_rows(&w->bk, k0, nk);
        d->wv = slice_rows(&w->wv, k0, nk);
        d->bv = slice_rows(&w->bv, k0, nk);
        d->w_gate = slice_rows(&w->w_gate, s->ff0, s->n_ff);
        d->w_up = slice_rows(&w->w_up, s->ff0, s->n_ff);
        if ((st = slice_cols(v, &w->wo, q0, nq, &d->wo)) == TDM_OK)
            st = slice_cols(v, &w->w_down, s->ff0, s->n_ff, &d->w_down);
    }
    if (st == TDM_OK && m->head && m->head->layout == TDM_HEAD_EAGLE3) {
        void *buf;
        if ((st = tdm_model_alloc_owned(v, sizeof *m->head, &buf)) == TDM_OK) {
            struct tdm_head *h = buf;
            *h = *m->head;
            h->wq_h = slice_rows(&m->head->wq_h, q0, nq);
            h->wk_h = slice_rows(&m->head->wk_h, k0, nk);
            h->wv_h = slice_rows(&m->head->wv_h, k0, nk);
            v->head = h;
        }
    }
    if (st != TDM_OK) {
        tdm_engine_shard_model_free(v);
        return st;
    }
    *out = v;
    return TDM_OK;
}
