/* The C tests' helper library (tiny_model.h). */
#include "lib/tiny_model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lib/test_rng.h"
#include "model/quant_int.h"

float tdm_test_uniform(uint64_t *state, float lo, float hi)
{
    return lo +
           (hi - lo) * (float)((double)(tdm_test_splitmix64(state) >> 11) / 9007199254740992.0);
}

float *tdm_test_rand_vec(uint64_t *state, size_t n, float lo, float hi)
{
    float *v = malloc(n * sizeof *v + 4);
    if (!v) abort();
    for (size_t i = 0; i < n; i++)
        v[i] = tdm_test_uniform(state, lo, hi);
    return v;
}

static void own(struct tdm_test_model *tm, void *p)
{
    if (tm->n_owned == tm->cap_owned) {
        tm->cap_owned = tm->cap_owned ? 2 * tm->cap_owned : 64;
        tm->owned = realloc(tm->owned, (size_t)tm->cap_owned * sizeof *tm->owned);
        if (!tm->owned) abort();
    }
    tm->owned[tm->n_owned++] = p;
}

/* A rows x cols weight of dtype dt, values bias + scale * U(-1, 1). */
static struct tdm_weight mat(struct tdm_test_model *tm, uint64_t *rng, enum tdm_dtype dt, int rows,
                             int cols, float scale, float bias)
{
    struct tdm_weight w = {.dtype = dt, .rows = rows, .cols = cols};
    w.row_bytes = tdm_dtype_row_bytes(dt, cols);
    uint8_t *p = malloc(w.row_bytes * (size_t)rows);
    float *row = malloc((size_t)cols * sizeof(float));
    if (!p || !row) abort();
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++)
            row[c] = bias + scale * tdm_test_uniform(rng, -1, 1);
        uint8_t *dst = p + (size_t)r * w.row_bytes;
        if (dt == TDM_DTYPE_F32) {
            memcpy(dst, row, (size_t)cols * 4);
        } else if (dt == TDM_DTYPE_BF16) {
            for (int c = 0; c < cols; c++) {
                uint16_t h = tdm_f32_to_bf16(row[c]);
                memcpy(dst + 2 * c, &h, 2);
            }
        } else { /* Q8_0: per block of 32, d = max|x| / 127 */
            for (int b = 0; b < cols / 32; b++) {
                struct block_q8_0 *blk = (struct block_q8_0 *)dst + b;
                float amax = 0;
                for (int j = 0; j < 32; j++)
                    amax = fmaxf(amax, fabsf(row[b * 32 + j]));
                const float d = amax / 127.0f;
                uint16_t h = tdm_f32_to_f16(d);
                memcpy(&blk->d, &h, 2);
                for (int j = 0; j < 32; j++)
                    blk->qs[j] = (int8_t)lrintf(d > 0 ? row[b * 32 + j] / d : 0);
            }
        }
    }
    free(row);
    w.data = p;
    own(tm, p);
    return w;
}

void tdm_test_model_make(struct tdm_test_model *tm, const struct tdm_test_model_opts *o)
{
    memset(tm, 0, sizeof *tm);
    uint64_t rng = o->seed;
    struct tdm_model *m = &tm->m;
    int D = o->d_model, NH = o->n_heads, NKV = o->n_kv_heads, HD = o->head_dim, FF = o->d_ff;
    enum tdm_dtype dt = o->dtype;
    m->cfg = (struct tdm_model_config){.arch = o->arch,
                                       .n_layers = o->n_layers,
                                       .d_model = D,
                                       .n_heads = NH,
                                       .n_kv_heads = NKV,
                                       .head_dim = HD,
                                       .d_ff = FF,
                                       .vocab_size = o->vocab,
                                       .max_ctx = o->max_ctx,
                                       .rms_eps = 1e-5f,
                                       .rope_theta = 10000.0f,
                                       .rope_neox = o->rope_neox,
                                       .qkv_bias = o->arch == TDM_ARCH_QWEN2,
                                       .qk_norm = o->arch == TDM_ARCH_QWEN3,
                                       .bos_id = -1};
    /* per-matrix scales: 1/sqrt(fan-in), or the fixed ones small shapes like */
    float s = o->fan_in_scale ? 1.0f / sqrtf((float)D) : 0.2f;
    float sf = o->fan_in_scale ? 1.0f / sqrtf((float)FF) : 0.15f;
    float sqk = o->fan_in_scale ? 2.0f * s : 0.2f, so = o->fan_in_scale ? s : 0.15f;
    float sout = o->fan_in_scale ? 2.0f * s : 0.25f, semb = o->fan_in_scale ? 1.0f : 0.5f;
    m->tok_embd = mat(tm, &rng, dt, o->vocab, D, semb, 0.0f);
    m->output = mat(tm, &rng, dt, o->vocab, D, sout, 0.0f);
    m->output_norm = mat(tm, &rng, TDM_DTYPE_F32, 1, D, 0.1f, 1.0f);
    tm->layers = calloc((size_t)o->n_layers, sizeof *tm->layers);
    if (!tm->layers) abort();
    for (int l = 0; l < o->n_layers; l++) {
        struct tdm_layer_weights *w = &tm->layers[l];
        w->attn_norm = mat(tm, &rng, TDM_DTYPE_F32, 1, D, 0.1f, 1.0f);
        w->ffn_norm = mat(tm, &rng, TDM_DTYPE_F32, 1, D, 0.1f, 1.0f);
        w->wq = mat(tm, &rng, dt, NH * HD, D, sqk, 0.0f);
        w->wk = mat(tm, &rng, dt, NKV * HD, D, sqk, 0.0f);
        w->wv = mat(tm, &rng, dt, NKV * HD, D, o->fan_in_scale ? s : sqk, 0.0f);
        w->wo = mat(tm, &rng, dt, D, NH * HD, so, 0.0f);
        w->w_gate = mat(tm, &rng, dt, FF, D, o->fan_in_scale ? s : sqk, 0.0f);
        w->w_up = mat(tm, &rng, dt, FF, D, o->fan_in_scale ? s : sqk, 0.0f);
        w->w_down = mat(tm, &rng, dt, D, FF, sf, 0.0f);
        if (o->arch == TDM_ARCH_QWEN2) {
            w->bq = mat(tm, &rng, TDM_DTYPE_F32, 1, NH * HD, 0.05f, 0.0f);
            w->bk = mat(tm, &rng, TDM_DTYPE_F32, 1, NKV * HD, 0.05f, 0.0f);
            w->bv = mat(tm, &rng, TDM_DTYPE_F32, 1, NKV * HD, 0.05f, 0.0f);
        }
        if (o->arch == TDM_ARCH_QWEN3) {
            w->q_norm = mat(tm, &rng, TDM_DTYPE_F32, 1, HD, 0.1f, 1.0f);
            w->k_norm = mat(tm, &rng, TDM_DTYPE_F32, 1, HD, 0.1f, 1.0f);
        }
    }
    m->layers = tm->layers;
}

void tdm_test_model_free(struct tdm_test_model *tm)
{
    for (int i = 0; i < tm->n_owned; i++)
        free(tm->owned[i]);
    free(tm->owned);
    free(tm->layers);
    memset(tm, 0, sizeof *tm);
}

static void put_f16(uint8_t *p, float f)
{
    const uint16_t h = tdm_f32_to_f16(f);
    memcpy(p, &h, 2);
}

void tdm_test_weight_make(uint64_t *state, enum tdm_dtype dt, int64_t rows, int64_t cols,
                          struct tdm_test_weight *tw)
{
    const size_t rb = tdm_dtype_row_bytes(dt, cols);
    if (!rb) abort();
    tw->alloc = malloc(rb * (size_t)rows + 64);
    if (!tw->alloc) abort();
    uint8_t *data = tw->alloc + 4;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = data + (size_t)r * rb;
        for (int64_t c = 0; dt == TDM_DTYPE_F32 && c < cols; c++) {
            const float f = tdm_test_uniform(state, -1, 1);
            memcpy(row + 4 * c, &f, 4);
        }
        for (int64_t c = 0; dt == TDM_DTYPE_BF16 && c < cols; c++) {
            const uint16_t h = tdm_f32_to_bf16(tdm_test_uniform(state, -1, 1));
            memcpy(row + 2 * c, &h, 2);
        }
        for (int64_t b = 0; dt == TDM_DTYPE_Q8_0 && b < cols / 32; b++) {
            uint8_t *blk = row + b * sizeof(struct block_q8_0);
            put_f16(blk + offsetof(struct block_q8_0, d), tdm_test_uniform(state, 0.001f, 0.02f));
            for (int j = 0; j < 32; j++)
                blk[offsetof(struct block_q8_0, qs) + j] =
                    (uint8_t)(tdm_test_splitmix64(state) % 255 + 129);
        }
        for (int64_t b = 0; dt == TDM_DTYPE_Q4_0 && b < cols / 32; b++) {
            uint8_t *blk = row + b * sizeof(struct block_q4_0);
            put_f16(blk + offsetof(struct block_q4_0, d), tdm_test_uniform(state, -0.2f, 0.2f));
            for (int j = 0; j < 16; j++)
                blk[offsetof(struct block_q4_0, qs) + j] = (uint8_t)tdm_test_splitmix64(state);
        }
        for (int64_t b = 0; dt == TDM_DTYPE_Q4_K && b < cols / 256; b++) {
            uint8_t *blk = row + b * sizeof(struct block_q4_K);
            put_f16(blk + offsetof(struct block_q4_K, d), tdm_test_uniform(state, 0.0005f, 0.004f));
            put_f16(blk + offsetof(struct block_q4_K, dmin),
                    tdm_test_uniform(state, 0.0005f, 0.02f));
            for (size_t j = offsetof(struct block_q4_K, scales); j < sizeof(struct block_q4_K); j++)
                blk[j] = (uint8_t)tdm_test_splitmix64(state); /* 6-bit scales, mins; nibbles */
        }
        for (int64_t b = 0; dt == TDM_DTYPE_Q6_K && b < cols / 256; b++) {
            uint8_t *blk = row + b * sizeof(struct block_q6_K);
            for (size_t j = 0; j < offsetof(struct block_q6_K, d); j++)
                blk[j] = (uint8_t)tdm_test_splitmix64(state); /* ql, qh, int8 scales */
            put_f16(blk + offsetof(struct block_q6_K, d),
                    tdm_test_uniform(state, -0.0005f, 0.0005f));
        }
        for (int64_t b = 0; dt == TDM_DTYPE_Q4_1 && b < cols / 32; b++) {
            uint8_t *blk = row + b * sizeof(struct block_q4_1);
            put_f16(blk + offsetof(struct block_q4_1, d), tdm_test_uniform(state, 0.01f, 0.2f));
            put_f16(blk + offsetof(struct block_q4_1, m), tdm_test_uniform(state, -1.5f, 0.1f));
            for (int j = 0; j < 16; j++)
                blk[offsetof(struct block_q4_1, qs) + j] = (uint8_t)tdm_test_splitmix64(state);
        }
    }
    tw->w =
        (struct tdm_weight){.dtype = dt, .rows = rows, .cols = cols, .row_bytes = rb, .data = data};
    tw->deq = malloc((size_t)rows * (size_t)cols * sizeof(float));
    if (!tw->deq) abort();
    for (int64_t r = 0; r < rows; r++)
        if (tdm_dequantize(dt, data + (size_t)r * rb, tw->deq + r * cols, cols) != TDM_OK) abort();
}

void tdm_test_weight_free(struct tdm_test_weight *tw)
{
    free(tw->alloc);
    free(tw->deq);
}
