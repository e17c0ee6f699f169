/*
 * Model loader: turns a GGUF file or a HF checkpoint folder (config.json + safetensors) into a
 * struct tdm_model, the read-only weight set the engine runs.
 *
 * Weights stay in the memory-mapped file whenever the CPU kernels can run their dtype directly
 * (F32, BF16, Q8_0, Q4_0, Q4_1, and with tdm_load_opts.keep_k_blocks Q4_K and Q6_K, which the
 * CUDA kernels and the CPU's quantised-activation tiles run): loading a quantised model then
 * costs page-table setup, not a copy. Anything else (F16, Q5_*, the other K-quants, and Q4_K and
 * Q6_K without keep_k_blocks) is dequantised to F32 once, at load, into 64-byte aligned buffers
 * recorded in m->owned; so are vectors (norms, biases) not stored as F32, and the rare tensor
 * whose file offset is not aligned for its element type. Two sources differ only in tensor
 * names, which the name table below maps onto one set of fields.
 *
 * Every tensor is checked against the config before its pointer is kept: presence, shape
 * (messages name the tensor and give expected and actual [rows, cols]), dtype, and that a
 * matrix row is whole blocks. Checkpoint features we would silently mis-run (an attention
 * output bias, biases the config does not announce) are refused.
 *
 * Experts: one tensor per expert (HF), transformers' fused experts.gate_up_proj and
 * experts.down_proj (3-D: each expert's matrices are row blocks of them), or GGUF's stacked
 * ffn_*_exps; a row block of any dtype is the same bytes, so none is copied. MLA (load_mla):
 * kv_a's rows split into the latent's and the rope key's weights, and kv_b (whole, or GGUF's
 * k_b/v_b) rearranged at load into the absorbed form's F32 matrices (model.h).
 *
 * RoPE: GGUF llama3 files carry the scaling as rope_freqs.weight, per-frequency divisors of
 * the rotation angle; m->rope_freqs points at it (cfg.rope_scaling is then NONE). HF
 * checkpoints describe the scaling in cfg instead.
 *
 * Threading: loading is single-threaded; the resulting model is read-only and shareable.
 */
#include "model/model_int.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#ifndef TDM_DEFAULT_MODEL_FILE
#define TDM_DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"
#endif

struct loader {
    struct tdm_model *m;
    char name[256]; /* the tensor being prepared, for messages */
    const char
        *hf_layer; /* HF layer names: this prefix (one %d: the layer); NULL: model.layers.%d. */
    bool attn_norm_optional; /* a head's layer may lack its input norm (EAGLE) */
    int64_t qkv_cols;        /* the q/k/v projections' input width; 0: d_model (EAGLE-3: 2d) */
    bool keep_k_blocks;      /* tdm_load_opts: Q4_K and Q6_K matrices stay in their blocks */
};

static const struct tdm_tensor_info *find_tensor(struct loader *L, const char *name)
{
    if (L->m->gguf) return tdm_gguf_find_tensor(L->m->gguf, name);
    return tdm_st_find_tensor(L->m->st, name);
}

/* Formats a tensor name into L->name from the GGUF or the HF pattern (one %d: the layer). */
static const char *tname(struct loader *L, const char *gguf_fmt, const char *hf_fmt, int layer)
{
    snprintf(L->name, sizeof(L->name), L->m->is_gguf ? gguf_fmt : hf_fmt, layer);
    return L->name;
}

/* A layer tensor's name: GGUF's pattern, or the HF prefix and this suffix. */
static const char *lname(struct loader *L, const char *gguf_fmt, const char *hf_suffix, int layer)
{
    if (L->m->is_gguf) return tname(L, gguf_fmt, NULL, layer);
    int n =
        snprintf(L->name, sizeof L->name, L->hf_layer ? L->hf_layer : "model.layers.%d.", layer);
    if (n >= 0 && (size_t)n < sizeof L->name)
        snprintf(L->name + n, sizeof L->name - n, "%s", hf_suffix);
    return L->name;
}

tdm_status tdm_model_alloc_owned(struct tdm_model *m, size_t bytes, void **out)
{
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **o = realloc(m->owned, sizeof(*o) * (size_t)cap);
        if (!o) return tdm_err_set(TDM_ENOMEM, "model: out of memory");
        m->owned = o;
        m->cap_owned = cap;
    }
    void *p = tdm_alloc_aligned(bytes ? bytes : 1);
    if (!p) return tdm_err_set(TDM_ENOMEM, "model: out of memory for %zu bytes", bytes);
    m->owned[m->n_owned++] = p;
    *out = p;
    return TDM_OK;
}

/* Formats ne[] as [rows, cols] (slowest dimension first) for messages. */
static void shape_str(const struct tdm_tensor_info *t, char *buf, size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "[");
    int dims = t->n_dims < 1 ? 1 : TDM_MIN(t->n_dims, 4);
    for (int i = dims - 1; i >= 0 && n < cap; i--)
        n += (size_t)snprintf(buf + n, cap - n, "%lld%s", (long long)t->ne[i], i ? ", " : "]");
}

static tdm_status check_dtype(struct loader *L, const struct tdm_tensor_info *t)
{
    if (L->m->st && t->dtype == TDM_DTYPE_ST_UNSUPPORTED)
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: dtype %s is not supported (F32, F16, BF16)",
                           t->name, tdm_st_dtype_str(L->m->st, t));
    if (!tdm_dtype_known((int)t->dtype) || tdm_dtype_block_elems(t->dtype) <= 0)
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: tensor type %d is not supported", t->name,
                           (int)t->dtype);
    return TDM_OK;
}

/* Looks up a tensor of `rows` x `cols` (a vector when rows == 1 and vector is set). */
static tdm_status find_shaped(struct loader *L, const char *name, int64_t rows, int64_t cols,
                              bool vector, const struct tdm_tensor_info **out)
{
    const struct tdm_tensor_info *t = find_tensor(L, name);
    if (!t) return tdm_err_set(TDM_ENOTFOUND, "%s: tensor missing from %s", name, L->m->path);
    bool ok = t->ne[0] == cols && t->ne[2] == 1 && t->ne[3] == 1 &&
              (vector ? t->ne[1] == 1 && t->n_dims == 1 : t->ne[1] == rows && t->n_dims == 2);
    if (!ok) {
        char got[128];
        shape_str(t, got, sizeof(got));
        if (vector)
            return tdm_err_set(TDM_EFORMAT, "%s: expected [%lld], got %s", name, (long long)cols,
                               got);
        return tdm_err_set(TDM_EFORMAT, "%s: expected [%lld, %lld], got %s", name, (long long)rows,
                           (long long)cols, got);
    }
    tdm_status rc = check_dtype(L, t);
    if (rc) return rc;
    size_t row_bytes = tdm_dtype_row_bytes(t->dtype, cols);
    if (row_bytes == 0)
        return tdm_err_set(
            TDM_EFORMAT, "%s: %lld columns are not a multiple of the %s block (%lld)", name,
            (long long)cols, tdm_dtype_name(t->dtype), (long long)tdm_dtype_block_elems(t->dtype));
    if (t->nbytes != row_bytes * (size_t)rows || !t->data)
        return tdm_err_set(TDM_EFORMAT, "%s: %zu bytes stored, %zu expected", name, t->nbytes,
                           row_bytes * (size_t)rows);
    *out = t;
    return TDM_OK;
}

static bool runs_directly(const struct loader *L, enum tdm_dtype d)
{
    return d == TDM_DTYPE_F32 || d == TDM_DTYPE_BF16 || d == TDM_DTYPE_Q8_0 ||
           d == TDM_DTYPE_Q4_0 || d == TDM_DTYPE_Q4_1 ||
           (L->keep_k_blocks && (d == TDM_DTYPE_Q4_K || d == TDM_DTYPE_Q6_K));
}

/* Rows [row0, row0 + n) of a checked tensor t (cols wide), as F32 into dst. */
static tdm_status rows_f32(const struct tdm_tensor_info *t, int64_t row0, int64_t n, int64_t cols,
                           float *dst)
{
    size_t rb = tdm_dtype_row_bytes(t->dtype, cols);
    for (int64_t r = 0; r < n; r++) {
        tdm_status rc = tdm_dequantize(t->dtype, (const uint8_t *)t->data + (size_t)(row0 + r) * rb,
                                       dst + (size_t)r * (size_t)cols, cols);
        if (rc)
            return tdm_err_set(rc, "%s: cannot convert %s to f32: %s", t->name,
                               tdm_dtype_name(t->dtype), tdm_err_msg());
    }
    return TDM_OK;
}

/* Produces a weight from a checked tensor: zero-copy when `keep` allows its dtype, else F32. */
static tdm_status prepare(struct loader *L, const struct tdm_tensor_info *t, int64_t rows,
                          int64_t cols, bool keep, struct tdm_weight *w)
{
    struct tdm_model *m = L->m;
    size_t align = t->dtype == TDM_DTYPE_F32 ? 4 : 2;
    size_t row_bytes = tdm_dtype_row_bytes(t->dtype, cols);
    tdm_status rc;
    if (keep && runs_directly(L, t->dtype)) {
        const void *data = t->data;
        if ((uintptr_t)data % align) { /* the kernels read whole elements: realign */
            void *copy;
            if ((rc = tdm_model_alloc_owned(m, t->nbytes, &copy))) return rc;
            memcpy(copy, t->data, t->nbytes);
            data = copy;
        }
        *w = (struct tdm_weight){t->dtype, rows, cols, row_bytes, data};
    } else {
        void *buf;
        if ((rc = tdm_model_alloc_owned(m, (size_t)rows * (size_t)cols * sizeof(float), &buf)))
            return rc;
        const uint8_t *src = t->data;
        void *tmp = NULL;
        if ((uintptr_t)src % align) {
            if ((rc = tdm_model_alloc_owned(m, t->nbytes, &tmp))) return rc;
            memcpy(tmp, src, t->nbytes);
            src = tmp;
        }
        struct tdm_tensor_info aligned = *t;
        aligned.data = src;
        if ((rc = rows_f32(&aligned, 0, rows, cols, buf))) return rc;
        if (tmp) { /* the realigned copy is no longer needed */
            tdm_free_aligned(tmp);
            m->owned[--m->n_owned] = NULL;
        }
        *w = (struct tdm_weight){TDM_DTYPE_F32, rows, cols, cols * sizeof(float), buf};
    }
    m->n_params += (uint64_t)(rows * cols);
    m->weight_bytes += (uint64_t)(w->row_bytes * (size_t)rows);
    return TDM_OK;
}

static tdm_status load_matrix(struct loader *L, const char *name, int64_t rows, int64_t cols,
                              struct tdm_weight *w)
{
    const struct tdm_tensor_info *t;
    tdm_status rc = find_shaped(L, name, rows, cols, false, &t);
    if (rc) return rc;
    return prepare(L, t, rows, cols, true, w);
}

static tdm_status load_vector(struct loader *L, const char *name, int64_t n, struct tdm_weight *w)
{
    const struct tdm_tensor_info *t;
    tdm_status rc = find_shaped(L, name, 1, n, true, &t);
    if (rc) return rc;
    return prepare(L, t, 1, n, t->dtype == TDM_DTYPE_F32, w);
}

/* A 3-D GGUF tensor of n matrices of rows x cols (ne = [cols, rows, n]), checked. */
static tdm_status find_stacked(struct loader *L, const char *name, int64_t n, int64_t rows,
                               int64_t cols, const struct tdm_tensor_info **out)
{
    const struct tdm_tensor_info *t = find_tensor(L, name);
    if (!t) return tdm_err_set(TDM_ENOTFOUND, "%s: tensor missing from %s", name, L->m->path);
    if (t->n_dims != 3 || t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != n || t->ne[3] != 1) {
        char got[128];
        shape_str(t, got, sizeof(got));
        return tdm_err_set(TDM_EFORMAT, "%s: expected [%lld, %lld, %lld], got %s", name,
                           (long long)n, (long long)rows, (long long)cols, got);
    }
    tdm_status rc = check_dtype(L, t);
    if (rc) return rc;
    size_t row_bytes = tdm_dtype_row_bytes(t->dtype, cols);
    if (row_bytes == 0 || t->nbytes != row_bytes * (size_t)rows * (size_t)n || !t->data)
        return tdm_err_set(TDM_EFORMAT, "%s: %zu bytes stored for %lld x %lld x %lld %s", name,
                           t->nbytes, (long long)n, (long long)rows, (long long)cols,
                           tdm_dtype_name(t->dtype));
    *out = t;
    return TDM_OK;
}

/* An F32 weight of rows x cols in memory the model owns (zeroed). */
static tdm_status owned_f32(struct loader *L, int64_t rows, int64_t cols, struct tdm_weight *w)
{
    void *buf;
    size_t bytes = (size_t)rows * (size_t)cols * sizeof(float);
    tdm_status rc = tdm_model_alloc_owned(L->m, bytes, &buf);
    if (rc) return rc;
    memset(buf, 0, bytes);
    *w = (struct tdm_weight){TDM_DTYPE_F32, rows, cols, (size_t)cols * sizeof(float), buf};
    L->m->weight_bytes += bytes;
    return TDM_OK;
}

/* Rows [row0, row0 + rows) of a checked matrix t as a weight of their own (t's rows are
 * whole blocks, so a row range of any type is the same bytes). */
static tdm_status row_block(struct loader *L, const struct tdm_tensor_info *t, int64_t row0,
                            int64_t rows, int64_t cols, struct tdm_weight *w)
{
    struct tdm_tensor_info part = *t;
    size_t rb = tdm_dtype_row_bytes(t->dtype, cols);
    part.ne[1] = rows;
    part.data = (const uint8_t *)t->data + (size_t)row0 * rb;
    part.nbytes = rb * (size_t)rows;
    return prepare(L, &part, rows, cols, true, w);
}

/* A sparse layer's router and experts: HF per-expert tensors (qwen3_moe's mlp.experts.N.
 * {gate,up,down}_proj, mixtral's block_sparse_moe.experts.N.w1/w3/w2), or GGUF's stacked
 * ffn_{gate,up,down}_exps (one matrix per expert, sliced out of the 3-D tensor). */
static tdm_status load_experts(struct loader *L, int i, struct tdm_layer_weights *lw)
{
    const struct tdm_model_config *c = &L->m->cfg;
    int64_t d = c->d_model, ff = c->d_ff_expert, n = c->n_experts;
    bool mixtral =
        !L->m->is_gguf && find_tensor(L, lname(L, NULL, "block_sparse_moe.gate.weight", i));
    tdm_status rc;
    void *mem;
    if ((rc = tdm_model_alloc_owned(L->m, sizeof(struct tdm_weight) * 3 * (size_t)n, &mem)))
        return rc;
    lw->experts = mem;
    lw->n_experts = (int)n;
    const bool deepseek = c->arch == TDM_ARCH_DEEPSEEK2;
    if (c->d_ff_shared) {
        /* qwen2_moe's shared expert and its gate (a [d] vector in GGUF); DeepSeek's shared
         * experts (one fused matrix each, no gate) */
        int64_t fs = c->d_ff_shared;
        const char *score =
            lname(L, "blk.%d.ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight", i);
        if (!deepseek && (rc = L->m->is_gguf ? load_vector(L, score, d, &lw->sh_score)
                                             : load_matrix(L, score, 1, d, &lw->sh_score)))
            return rc;
        /* clang-format off */
        if ((rc = load_matrix(L, lname(L, "blk.%d.ffn_gate_shexp.weight", deepseek ? "mlp.shared_experts.gate_proj.weight" : "mlp.shared_expert.gate_proj.weight", i), fs, d, &lw->sh_gate)) ||
            (rc = load_matrix(L, lname(L, "blk.%d.ffn_up_shexp.weight", deepseek ? "mlp.shared_experts.up_proj.weight" : "mlp.shared_expert.up_proj.weight", i), fs, d, &lw->sh_up)) ||
            (rc = load_matrix(L, lname(L, "blk.%d.ffn_down_shexp.weight", deepseek ? "mlp.shared_experts.down_proj.weight" : "mlp.shared_expert.down_proj.weight", i), d, fs, &lw->sh_down)))
            return rc;
        /* clang-format on */
    }
    /* DeepSeek-V3's selection bias (llama.cpp: exp_probs_b), read where the file has it */
    const char *bias = lname(L, "blk.%d.exp_probs_b.bias", "mlp.gate.e_score_correction_bias", i);
    if (deepseek && find_tensor(L, bias)) {
        const struct tdm_tensor_info *t;
        if ((rc = find_shaped(L, bias, 1, n, true, &t)) ||
            (rc = prepare(L, t, 1, n, false, &lw->router_bias)))
            return rc;
    }
    if ((rc = load_matrix(L,
                          lname(L, "blk.%d.ffn_gate_inp.weight",
                                mixtral ? "block_sparse_moe.gate.weight" : "mlp.gate.weight", i),
                          n, d, &lw->router)))
        return rc;
    if (L->m->is_gguf) {
        static const char *const names[3] = {"blk.%d.ffn_gate_exps.weight",
                                             "blk.%d.ffn_up_exps.weight",
                                             "blk.%d.ffn_down_exps.weight"};
        for (int k = 0; k < 3; k++) {
            int64_t rows = k == 2 ? d : ff, cols = k == 2 ? ff : d;
            const struct tdm_tensor_info *t = NULL;
            if ((rc = find_stacked(L, tname(L, names[k], NULL, i), n, rows, cols, &t))) return rc;
            size_t one = tdm_dtype_row_bytes(t->dtype, cols) * (size_t)rows;
            for (int64_t e = 0; e < n; e++) {
                struct tdm_tensor_info slice = *t; /* expert e's matrix */
                slice.n_dims = 2;
                slice.ne[2] = 1;
                slice.data = (const uint8_t *)t->data + (size_t)e * one;
                slice.nbytes = one;
                if ((rc = prepare(L, &slice, rows, cols, true, &lw->experts[3 * e + k]))) return rc;
            }
        }
        return TDM_OK;
    }
    /* transformers' fused 3-D layout: experts.gate_up_proj [n][2 ff][d] (gate rows, then up
     * rows) and experts.down_proj [n][d][ff] */
    const char *fused = lname(
        L, NULL, mixtral ? "block_sparse_moe.experts.gate_up_proj" : "mlp.experts.gate_up_proj", i);
    if (find_tensor(L, fused)) {
        const struct tdm_tensor_info *gu = NULL, *dn = NULL;
        if ((rc = find_stacked(L, fused, n, 2 * ff, d, &gu))) return rc;
        if ((rc = find_stacked(
                 L,
                 lname(L, NULL,
                       mixtral ? "block_sparse_moe.experts.down_proj" : "mlp.experts.down_proj", i),
                 n, d, ff, &dn)))
            return rc;
        for (int64_t e = 0; e < n && !rc; e++) {
            if ((rc = row_block(L, gu, e * 2 * ff, ff, d, &lw->experts[3 * e])) ||
                (rc = row_block(L, gu, e * 2 * ff + ff, ff, d, &lw->experts[3 * e + 1])))
                break;
            rc = row_block(L, dn, e * d, d, ff, &lw->experts[3 * e + 2]);
        }
        return rc;
    }
    for (int64_t e = 0; e < n; e++) {
        char gate[96], up[96], down[96];
        snprintf(gate, sizeof gate,
                 mixtral ? "block_sparse_moe.experts.%lld.w1.weight"
                         : "mlp.experts.%lld.gate_proj.weight",
                 (long long)e);
        snprintf(up, sizeof up,
                 mixtral ? "block_sparse_moe.experts.%lld.w3.weight"
                         : "mlp.experts.%lld.up_proj.weight",
                 (long long)e);
        snprintf(down, sizeof down,
                 mixtral ? "block_sparse_moe.experts.%lld.w2.weight"
                         : "mlp.experts.%lld.down_proj.weight",
                 (long long)e);
        if ((rc = load_matrix(L, lname(L, NULL, gate, i), ff, d, &lw->experts[3 * e])) ||
            (rc = load_matrix(L, lname(L, NULL, up, i), ff, d, &lw->experts[3 * e + 1])) ||
            (rc = load_matrix(L, lname(L, NULL, down, i), d, ff, &lw->experts[3 * e + 2])))
            return rc;
    }
    return TDM_OK;
}

/* MLA's attention weights (model.h): q (direct or through its LoRA), kv_a split into the
 * latent's and the rope key's rows, the norms, the output, and kv_b's key and value rows
 * rearranged into the absorbed form: HF and older GGUF files hold kv_b [H (nope + v)][kv_lora];
 * newer GGUF files hold it split, k_b [H][kv_lora][nope] (already transposed) and v_b
 * [H][v][kv_lora]. */
static tdm_status load_mla(struct loader *L, int i, struct tdm_layer_weights *lw)
{
    const struct tdm_model_config *c = &L->m->cfg;
    const int64_t d = c->d_model, H = c->n_heads, lora = c->kv_lora_rank, rope = c->qk_rope_dim;
    const int64_t nope = c->qk_nope_dim, v = c->v_head_dim, qh = nope + rope, dk = lora + rope;
    const struct tdm_tensor_info *t;
    tdm_status rc;
    /* clang-format off */
    if (c->q_lora_rank) {
        if ((rc = load_matrix(L, lname(L, "blk.%d.attn_q_a.weight", "self_attn.q_a_proj.weight", i), c->q_lora_rank, d, &lw->wq_a)) ||
            (rc = load_vector(L, lname(L, "blk.%d.attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight", i), c->q_lora_rank, &lw->q_a_norm)) ||
            (rc = load_matrix(L, lname(L, "blk.%d.attn_q_b.weight", "self_attn.q_b_proj.weight", i), H * qh, c->q_lora_rank, &lw->wq_b)))
            return rc;
    } else if ((rc = load_matrix(L, lname(L, "blk.%d.attn_q.weight", "self_attn.q_proj.weight", i), H * qh, d, &lw->wq))) {
        return rc;
    }
    if ((rc = find_shaped(L, lname(L, "blk.%d.attn_kv_a_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight", i), dk, d, false, &t)) ||
        (rc = row_block(L, t, 0, lora, d, &lw->wkv_c)) ||
        (rc = row_block(L, t, lora, rope, d, &lw->wkv_r)) ||
        (rc = load_vector(L, lname(L, "blk.%d.attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight", i), lora, &lw->kv_a_norm)) ||
        (rc = load_matrix(L, lname(L, "blk.%d.attn_output.weight", "self_attn.o_proj.weight", i), d, H * v, &lw->wo)))
        return rc;
    /* clang-format on */
    if ((rc = owned_f32(L, H * dk, qh, &lw->mla_absorb)) ||
        (rc = owned_f32(L, H * v, lora, &lw->mla_uv)))
        return rc;
    float *ab = (float *)lw->mla_absorb.data, *uv = (float *)lw->mla_uv.data;
    for (int64_t h = 0; h < H; h++) /* the rope part passes through */
        for (int64_t r = 0; r < rope; r++)
            ab[(size_t)(h * dk + lora + r) * (size_t)qh + (size_t)(nope + r)] = 1.0f;
    const char *kvb = lname(L, "blk.%d.attn_kv_b.weight", "self_attn.kv_b_proj.weight", i);
    float *row = malloc((size_t)TDM_MAX(lora, nope) * sizeof(float));
    if (!row) return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    rc = TDM_OK;
    if (!L->m->is_gguf || find_tensor(L, kvb)) {
        if ((rc = find_shaped(L, kvb, H * (nope + v), lora, false, &t))) goto out;
        for (int64_t h = 0; h < H && !rc; h++) {
            for (int64_t j = 0; j < nope && !rc; j++) { /* key row j: column j of the absorb */
                if ((rc = rows_f32(t, h * (nope + v) + j, 1, lora, row))) break;
                for (int64_t r = 0; r < lora; r++)
                    ab[(size_t)(h * dk + r) * (size_t)qh + (size_t)j] = row[r];
            }
            if (!rc) rc = rows_f32(t, h * (nope + v) + nope, v, lora, uv + (size_t)(h * v * lora));
        }
        if (!rc) L->m->n_params += (uint64_t)(H * (nope + v) * lora);
        goto out;
    }
    const struct tdm_tensor_info *kb = NULL, *vb = NULL;
    if ((rc = find_stacked(L, tname(L, "blk.%d.attn_k_b.weight", NULL, i), H, lora, nope, &kb)) ||
        (rc = find_stacked(L, tname(L, "blk.%d.attn_v_b.weight", NULL, i), H, v, lora, &vb)))
        goto out;
    for (int64_t h = 0; h < H && !rc; h++) {
        for (int64_t r = 0; r < lora && !rc; r++)
            rc = rows_f32(kb, h * lora + r, 1, nope, ab + (size_t)(h * dk + r) * (size_t)qh);
        if (!rc) rc = rows_f32(vb, h * v, v, lora, uv + (size_t)(h * v * lora));
    }
    if (!rc) L->m->n_params += (uint64_t)(H * (nope + v) * lora);
out:
    free(row);
    return rc;
}

/* Layer i's weights into layers[slot] (a head's one layer is slot 0 whatever its name). */
static tdm_status load_layer_at(struct loader *L, int i, int slot)
{
    const struct tdm_model_config *c = &L->m->cfg;
    struct tdm_layer_weights *lw = &L->m->layers[slot];
    int64_t d = c->d_model, q = (int64_t)c->n_heads * c->head_dim;
    int64_t kv = (int64_t)c->n_kv_heads * c->head_dim, ff = c->d_ff;
    const int64_t qin = L->qkv_cols ? L->qkv_cols : d;
    tdm_status rc;
    /* clang-format off */
    const char *an = lname(L, "blk.%d.attn_norm.weight", "input_layernorm.weight", i);
    if ((!L->attn_norm_optional || find_tensor(L, an)) && (rc = load_vector(L, an, d, &lw->attn_norm)))
        return rc;
    if (tdm_config_mla(c)) {
        if ((rc = load_mla(L, i, lw)) ||
            (rc = load_vector(L, lname(L, "blk.%d.ffn_norm.weight", "post_attention_layernorm.weight", i), d, &lw->ffn_norm)))
            return rc;
    } else if ((rc = load_matrix(L, lname(L, "blk.%d.attn_q.weight", "self_attn.q_proj.weight", i), q, qin, &lw->wq)) ||
        (rc = load_matrix(L, lname(L, "blk.%d.attn_k.weight", "self_attn.k_proj.weight", i), kv, qin, &lw->wk)) ||
        (rc = load_matrix(L, lname(L, "blk.%d.attn_v.weight", "self_attn.v_proj.weight", i), kv, qin, &lw->wv)) ||
        (rc = load_matrix(L, lname(L, "blk.%d.attn_output.weight", "self_attn.o_proj.weight", i), d, q, &lw->wo)) ||
        (rc = load_vector(L, lname(L, "blk.%d.ffn_norm.weight", "post_attention_layernorm.weight", i), d, &lw->ffn_norm))) {
        return rc;
    }
    if (tdm_config_layer_sparse(c, slot)) { /* a head's: its config says (load_head) */
        if ((rc = load_experts(L, i, lw))) return rc;
    } else if ((rc = load_matrix(L, lname(L, "blk.%d.ffn_gate.weight", "mlp.gate_proj.weight", i), ff, d, &lw->w_gate)) ||
               (rc = load_matrix(L, lname(L, "blk.%d.ffn_up.weight", "mlp.up_proj.weight", i), ff, d, &lw->w_up)) ||
               (rc = load_matrix(L, lname(L, "blk.%d.ffn_down.weight", "mlp.down_proj.weight", i), d, ff, &lw->w_down))) {
        return rc;
    }
    /* clang-format on */
    const char *bq = lname(L, "blk.%d.attn_q.bias", "self_attn.q_proj.bias", i);
    if (c->qkv_bias) {
        /* clang-format off */
        if ((rc = load_vector(L, bq, q, &lw->bq)) ||
            (rc = load_vector(L, lname(L, "blk.%d.attn_k.bias", "self_attn.k_proj.bias", i), kv, &lw->bk)) ||
            (rc = load_vector(L, lname(L, "blk.%d.attn_v.bias", "self_attn.v_proj.bias", i), kv, &lw->bv)))
            return rc;
        /* clang-format on */
    } else if (find_tensor(L, bq)) {
        return tdm_err_set(TDM_EFORMAT, "%s: present, but the %s config has no q/k/v biases", bq,
                           tdm_arch_name(c->arch));
    }
    if (c->qk_norm) {
        /* clang-format off */
        if ((rc = load_vector(L, lname(L, "blk.%d.attn_q_norm.weight", "self_attn.q_norm.weight", i), c->head_dim, &lw->q_norm)) ||
            (rc = load_vector(L, lname(L, "blk.%d.attn_k_norm.weight", "self_attn.k_norm.weight", i), c->head_dim, &lw->k_norm)))
            return rc;
        /* clang-format on */
    }
    const char *bo = lname(L, "blk.%d.attn_output.bias", "self_attn.o_proj.bias", i);
    if (find_tensor(L, bo))
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: attention output biases are not supported", bo);
    return TDM_OK;
}

static tdm_status load_layer(struct loader *L, int i)
{
    return load_layer_at(L, i, i);
}

static tdm_status load_globals(struct loader *L)
{
    struct tdm_model *m = L->m;
    const struct tdm_model_config *c = &m->cfg;
    int64_t d = c->d_model, vocab = c->vocab_size;
    tdm_status rc;
    if ((rc = load_matrix(L, tname(L, "token_embd.weight", "model.embed_tokens.weight", 0), vocab,
                          d, &m->tok_embd)) ||
        (rc = load_vector(L, tname(L, "output_norm.weight", "model.norm.weight", 0), d,
                          &m->output_norm)))
        return rc;
    const char *out_name = tname(L, "output.weight", "lm_head.weight", 0);
    bool have_output = find_tensor(L, out_name) != NULL;
    if (m->is_gguf ? have_output : !c->tied_embeddings) {
        if ((rc = load_matrix(L, out_name, vocab, d, &m->output))) return rc;
        m->cfg.tied_embeddings = false;
    } else {
        m->output = m->tok_embd;
        m->cfg.tied_embeddings = true;
    }
    if (m->is_gguf && find_tensor(L, "rope_freqs.weight")) {
        const struct tdm_tensor_info *t;
        struct tdm_weight w;
        const int half = tdm_config_rope_dim(c) / 2;
        if ((rc = find_shaped(L, "rope_freqs.weight", 1, half, true, &t)) ||
            (rc = prepare(L, t, 1, half, false, &w)))
            return rc;
        m->n_params -= (uint64_t)half; /* a constant, not a parameter */
        m->rope_freqs = w.data;
    }
    return TDM_OK;
}

/* ---- chat template ---- */

static tdm_status copy_str(const char *s, size_t len, char **out)
{
    char *p = malloc(len + 1);
    if (!p) return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    memcpy(p, s, len);
    p[len] = 0;
    *out = p;
    return TDM_OK;
}

static bool is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* chat_template.jinja (newer transformers) wins over tokenizer_config.json's "chat_template",
 * which is a string or a list of {name, template} (we take "default"). */
static tdm_status hf_chat_template(const char *dir, char **out)
{
    char *path = NULL;
    size_t len;
    tdm_status rc = TDM_OK;
    if (asprintf(&path, "%s/chat_template.jinja", dir) < 0)
        return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    if (is_file(path)) {
        rc = tdm_file_read(path, TDM_HF_MAX_TOKCONFIG_BYTES, out, &len);
        free(path);
        return rc;
    }
    free(path);
    if (asprintf(&path, "%s/tokenizer_config.json", dir) < 0)
        return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    if (!is_file(path)) goto out_path;
    char *text = NULL;
    if ((rc = tdm_file_read(path, TDM_HF_MAX_TOKCONFIG_BYTES, &text, &len))) goto out_path;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    free(text);
    if (!root) {
        rc = tdm_err_set(TDM_EFORMAT, "%s: JSON error at line %d: %s", path, jerr.line, jerr.text);
        goto out_path;
    }
    json_t *ct = json_is_object(root) ? json_object_get(root, "chat_template") : NULL;
    if (json_is_array(ct)) {
        size_t i;
        json_t *e, *found = NULL;
        json_array_foreach(ct, i, e)
        {
            json_t *name = json_object_get(e, "name");
            if (json_is_string(name) && !strcmp(json_string_value(name), "default"))
                found = json_object_get(e, "template");
        }
        ct = found;
    }
    if (json_is_string(ct))
        rc = copy_str(json_string_value(ct), json_string_length(ct), out);
    else if (ct && !json_is_null(ct))
        rc = tdm_err_set(TDM_EFORMAT, "%s: chat_template is not a string", path);
    json_decref(root);
out_path:
    free(path);
    return rc;
}

/* ---- entry points ---- */

static tdm_status open_source(struct tdm_model *m, const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) return tdm_err_set(TDM_ENOTFOUND, "%s: %s", path, strerror(errno));
    tdm_status rc;
    if (S_ISDIR(sb.st_mode)) {
        m->is_gguf = false;
        if ((rc = tdm_config_from_hf(path, &m->cfg)) || (rc = tdm_st_open(path, &m->st)) ||
            (rc = hf_chat_template(path, &m->chat_template)))
            return rc;
        return TDM_OK;
    }
    if (!S_ISREG(sb.st_mode)) return tdm_err_set(TDM_EINVAL, "%s: not a file or a folder", path);
    char magic[4] = {0};
    FILE *f = fopen(path, "rb");
    if (!f) return tdm_err_set(TDM_EIO, "%s: %s", path, strerror(errno));
    size_t got = fread(magic, 1, 4, f);
    fclose(f);
    size_t plen = strlen(path);
    bool gguf_name = plen >= 5 && !strcmp(path + plen - 5, ".gguf");
    if (!(got == 4 && !memcmp(magic, "GGUF", 4)) && !gguf_name)
        return tdm_err_set(TDM_EFORMAT,
                           "%s: not a GGUF file; give a .gguf file or a HF checkpoint folder "
                           "(config.json + safetensors)",
                           path);
    m->is_gguf = true;
    if ((rc = tdm_gguf_open(path, &m->gguf)) || (rc = tdm_config_from_gguf(m->gguf, &m->cfg)))
        return rc;
    struct tdm_str ct;
    rc = tdm_gguf_get_str(m->gguf, "tokenizer.chat_template", &ct);
    if (rc == TDM_ENOTFOUND) return TDM_OK;
    if (rc) return rc;
    return copy_str(ct.ptr, ct.len, &m->chat_template);
}

tdm_status tdm_model_load(const char *path, tdm_progress_fn progress, void *progress_ctx,
                          struct tdm_model **out)
{
    return tdm_model_load_opts(path, NULL, progress, progress_ctx, out);
}

tdm_status tdm_model_load_opts(const char *path, const struct tdm_load_opts *opts,
                               tdm_progress_fn progress, void *progress_ctx, struct tdm_model **out)
{
    if (!path || !out) return tdm_err_set(TDM_EINVAL, "tdm_model_load: bad args");
    struct tdm_model *m = calloc(1, sizeof(*m));
    if (!m) return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    tdm_status rc = TDM_OK;
    m->path = strdup(path);
    if (!m->path) {
        rc = tdm_err_set(TDM_ENOMEM, "model: out of memory");
        goto out_free;
    }
    if ((rc = open_source(m, path))) goto out_free;
    m->layers = calloc((size_t)m->cfg.n_layers, sizeof(*m->layers));
    if (!m->layers) {
        rc = tdm_err_set(TDM_ENOMEM, "model: out of memory");
        goto out_free;
    }
    struct loader L = {.m = m, .keep_k_blocks = opts && opts->keep_k_blocks};
    if ((rc = load_globals(&L))) goto out_free;
    if (progress) progress(progress_ctx, 0.0);
    for (int i = 0; i < m->cfg.n_layers; i++) {
        if ((rc = load_layer(&L, i))) goto out_free;
        if (progress) progress(progress_ctx, (double)(i + 1) / m->cfg.n_layers);
    }
    TDM_DEBUG("loaded %s: %s, %d layers, %.1fM params, %.1f MiB of weights", path,
              tdm_arch_name(m->cfg.arch), m->cfg.n_layers, (double)m->n_params / 1e6,
              (double)m->weight_bytes / (1 << 20));
    *out = m;
    return TDM_OK;
out_free:
    tdm_model_free(m);
    return rc;
}

tdm_status tdm_model_open_text(const char *path, struct tdm_model **out)
{
    if (!path || !out) return tdm_err_set(TDM_EINVAL, "tdm_model_open_text: bad args");
    struct tdm_model *m = calloc(1, sizeof(*m));
    if (!m) return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    tdm_status rc = TDM_OK;
    if (!(m->path = strdup(path)))
        rc = tdm_err_set(TDM_ENOMEM, "model: out of memory");
    else
        rc = open_source(m, path);
    if (rc) {
        tdm_model_free(m);
        return rc;
    }
    *out = m;
    return TDM_OK;
}

void tdm_model_free(struct tdm_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_owned; i++)
        tdm_free_aligned(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->head);
    free(m->chat_template);
    free(m->path);
    tdm_gguf_close(m->gguf);
    tdm_st_close(m->st);
    free(m);
}

bool tdm_default_model_path(char *buf, size_t cap)
{
    if (!buf || !cap) return false;
    const char *env = getenv("TANDEM_MODEL");
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    int n;
    if (env && *env)
        n = snprintf(buf, cap, "%s", env);
    else if (xdg && *xdg)
        n = snprintf(buf, cap, "%s/tandem/models/%s", xdg, TDM_DEFAULT_MODEL_FILE);
    else if (home && *home)
        n = snprintf(buf, cap, "%s/.cache/tandem/models/%s", home, TDM_DEFAULT_MODEL_FILE);
    else
        return false;
    return n >= 0 && (size_t)n < cap;
}

/* ---- speculation heads ----
 * One loader for four layouts, told apart by tensor names (docs/HEADS.md):
 *   tandem        enorm.weight, hnorm.weight, fc.weight [d, 2d], layers.0.* (HF names), norm.weight
 *   eagle         fc.weight (fc.bias), layers.0.* without input_layernorm, no norm
 *   deepseek-mtp  model.layers.N.{enorm,hnorm,eh_proj}.weight, model.layers.N.* (the layer),
 *                 model.layers.N.shared_head.norm.weight (shared_head.head.weight: the
 *                 target's LM head, checked and not kept)
 *   eagle3        fc.weight [d, 3d], midlayer.* (q/k/v [rows, 2d]; input_layernorm normalises
 *                 the embedding, hidden_norm the fused feature), norm.weight, its own
 *                 lm_head.weight [n, d] with d2t [n] and t2d [vocab] (load_eagle3); the
 *                 feature's target layers from a config.json beside it, or vLLM's default
 * The layer's geometry (heads, KV heads, d_ff, biases, q/k norms) comes from its tensors; its
 * width, head size and RoPE are the target's. */

const char *tdm_head_layout_name(enum tdm_head_layout l)
{
    switch (l) {
    case TDM_HEAD_TANDEM:
        return "tandem";
    case TDM_HEAD_EAGLE:
        return "eagle";
    case TDM_HEAD_DEEPSEEK_MTP:
        return "deepseek-mtp";
    case TDM_HEAD_EAGLE3:
        return "eagle3";
    }
    return "unknown";
}

/* The rows of a 2-D tensor named n, or -1 when it is absent or not 2-D. */
static int64_t tensor_rows(struct loader *L, const char *n)
{
    const struct tdm_tensor_info *t = find_tensor(L, n);
    return t && t->n_dims == 2 ? t->ne[1] : -1;
}

/* fc [d][2d] as its two column halves (F32, owned): fc_e multiplies the embedding, fc_h the
 * hidden state. */
static tdm_status load_fc(struct loader *L, const char *name, int64_t d, struct tdm_head *h)
{
    const struct tdm_tensor_info *t;
    tdm_status rc = find_shaped(L, name, d, 2 * d, false, &t);
    if (rc) return rc;
    size_t rb = tdm_dtype_row_bytes(t->dtype, 2 * d);
    void *e, *hh, *row, *raw;
    if ((rc = tdm_model_alloc_owned(L->m, (size_t)(d * d) * sizeof(float), &e)) ||
        (rc = tdm_model_alloc_owned(L->m, (size_t)(d * d) * sizeof(float), &hh)) ||
        (rc = tdm_model_alloc_owned(L->m, (size_t)(2 * d) * sizeof(float), &row)) ||
        (rc = tdm_model_alloc_owned(L->m, rb, &raw)))
        return rc;
    for (int64_t r = 0; r < d; r++) {
        memcpy(raw, (const uint8_t *)t->data + (size_t)r * rb, rb); /* aligned for the reader */
        if ((rc = tdm_dequantize(t->dtype, raw, row, 2 * d)))
            return tdm_err_set(rc, "%s: cannot convert %s to f32", name, tdm_dtype_name(t->dtype));
        memcpy((float *)e + r * d, row, (size_t)d * sizeof(float));
        memcpy((float *)hh + r * d, (float *)row + d, (size_t)d * sizeof(float));
    }
    size_t rbf = (size_t)d * sizeof(float);
    h->fc_e = (struct tdm_weight){TDM_DTYPE_F32, d, d, rbf, e};
    h->fc_h = (struct tdm_weight){TDM_DTYPE_F32, d, d, rbf, hh};
    L->m->n_params += (uint64_t)(2 * d * d);
    L->m->weight_bytes += (uint64_t)(2 * d * d) * sizeof(float);
    return TDM_OK;
}

/* The DeepSeek MTP layer's index: the lowest N with model.layers.N.eh_proj.weight; -1. */
static int deepseek_mtp_layer(const tdm_st_t *st)
{
    int best = -1;
    for (int64_t i = 0; i < tdm_st_n_tensors(st); i++) {
        const char *n = tdm_st_tensor(st, i)->name;
        int layer, end = 0;
        if (sscanf(n, "model.layers.%d.eh_proj.weight%n", &layer, &end) == 1 && end > 0 &&
            !n[end] && layer >= 0 && (best < 0 || layer < best))
            best = layer;
    }
    return best;
}

/* A reduced draft vocabulary's map d2t (I64 [n], EAGLE-3's convention: draft token i is
 * target token i + d2t[i]), checked: ascending target ids, within the vocabulary. The ids (owned
 * by the model) go to m->head (d2t, n_draft). */
static tdm_status parse_d2t(struct loader *L, const struct tdm_model *target)
{
    struct tdm_model *m = L->m;
    const struct tdm_tensor_info *t = find_tensor(L, "d2t");
    const int64_t V = target->cfg.vocab_size, n = t->n_dims == 1 ? t->ne[0] : -1;
    if (strcmp(tdm_st_dtype_str(m->st, t), "I64") || n < 1 || n > V ||
        t->nbytes != (size_t)n * sizeof(int64_t))
        return tdm_err_set(TDM_EFORMAT,
                           "%s: d2t must be a 1-D I64 tensor of at most %lld "
                           "entries (the target's vocabulary)",
                           m->path, (long long)V);
    int32_t *ids;
    void *p;
    tdm_status rc;
    if ((rc = tdm_model_alloc_owned(m, (size_t)n * sizeof *ids, &p))) return rc;
    ids = p;
    for (int64_t i = 0; i < n; i++) {
        int64_t off;
        memcpy(&off, (const uint8_t *)t->data + i * 8, 8);
        int64_t id = i + off;
        if (off < -V || off > V || id < 0 || id >= V || (i > 0 && id <= ids[i - 1]))
            return tdm_err_set(TDM_EFORMAT,
                               "%s: d2t maps draft token %lld to %lld: the ids must ascend "
                               "within the target's vocabulary of %lld",
                               m->path, (long long)i, (long long)id, (long long)V);
        ids[i] = (int32_t)id;
    }
    m->head->d2t = ids;
    m->head->n_draft = (int)n;
    return TDM_OK;
}

/* A reduced draft vocabulary for a head that shares the target's LM head (tandem's layout):
 * its LM head becomes a copy of the target's rows for d2t's ids (as the target stores them). */
static tdm_status load_d2t(struct loader *L, const struct tdm_model *target)
{
    struct tdm_model *m = L->m;
    tdm_status rc = parse_d2t(L, target);
    if (rc) return rc;
    const int64_t n = m->head->n_draft;
    const int32_t *ids = m->head->d2t;
    const struct tdm_weight *o = &target->output;
    void *rows;
    if ((rc = tdm_model_alloc_owned(m, (size_t)n * o->row_bytes, &rows))) return rc;
    for (int64_t i = 0; i < n; i++)
        memcpy((uint8_t *)rows + (size_t)i * o->row_bytes,
               (const uint8_t *)o->data + (size_t)ids[i] * o->row_bytes, o->row_bytes);
    m->output = (struct tdm_weight){o->dtype, n, o->cols, o->row_bytes, rows};
    m->weight_bytes += (uint64_t)n * o->row_bytes;
    return TDM_OK;
}

/* w's columns [0, at) and [at, cols) as two weights of their own (copies, w's dtype: one of
 * the element types a safetensors head loads as, F32 or BF16). */
static tdm_status split_cols(struct loader *L, const struct tdm_weight *w, int64_t at,
                             struct tdm_weight *left, struct tdm_weight *right)
{
    TDM_ASSERT(tdm_dtype_block_elems(w->dtype) == 1 && at > 0 && at < w->cols);
    const size_t es = tdm_dtype_row_bytes(w->dtype, 1);
    const size_t lb = es * (size_t)at, rb = es * (size_t)(w->cols - at);
    void *l, *r;
    tdm_status rc;
    if ((rc = tdm_model_alloc_owned(L->m, (size_t)w->rows * lb, &l)) ||
        (rc = tdm_model_alloc_owned(L->m, (size_t)w->rows * rb, &r)))
        return rc;
    for (int64_t i = 0; i < w->rows; i++) {
        const uint8_t *src = (const uint8_t *)w->data + (size_t)i * w->row_bytes;
        memcpy((uint8_t *)l + (size_t)i * lb, src, lb);
        memcpy((uint8_t *)r + (size_t)i * rb, src + lb, rb);
    }
    *left = (struct tdm_weight){w->dtype, w->rows, at, lb, l};
    *right = (struct tdm_weight){w->dtype, w->rows, w->cols - at, rb, r};
    return TDM_OK;
}

/* EAGLE-3's feature layers: eagle_aux_hidden_state_layer_ids of a config.json beside the head
 * (in its folder; at the top level or under eagle_config), else vLLM's default (2, L/2, L-3)
 * for a target of L layers: the feature is the residual stream entering those target layers
 * (the outputs of layers 1, L/2 - 1 and L - 4), concatenated in that order. */
static tdm_status eagle3_aux_layers(struct loader *L, const struct tdm_model *target)
{
    struct tdm_model *m = L->m;
    struct tdm_head *h = m->head;
    const int nl = target->cfg.n_layers;
    int ids[TDM_HEAD_MAX_AUX] = {2, nl / 2, nl - 3};
    const char *src = "vLLM's default (2, L/2, L-3)";
    struct stat sb;
    char cfg[4096];
    const char *slash = strrchr(m->path, '/');
    int n = stat(m->path, &sb) == 0 && S_ISDIR(sb.st_mode)
                ? snprintf(cfg, sizeof cfg, "%s/config.json", m->path)
            : slash ? snprintf(cfg, sizeof cfg, "%.*s/config.json", (int)(slash - m->path), m->path)
                    : snprintf(cfg, sizeof cfg, "config.json");
    if (n > 0 && (size_t)n < sizeof cfg && is_file(cfg)) {
        json_error_t jerr;
        json_t *root = json_load_file(cfg, 0, &jerr);
        if (!root)
            return tdm_err_set(TDM_EFORMAT, "%s (beside the EAGLE-3 head %s): %s (line %d)", cfg,
                               m->path, jerr.text, jerr.line);
        json_t *a = json_object_get(root, "eagle_aux_hidden_state_layer_ids");
        if (!a)
            a = json_object_get(json_object_get(root, "eagle_config"),
                                "eagle_aux_hidden_state_layer_ids");
        bool ok = !a || (json_is_array(a) && json_array_size(a) == TDM_HEAD_MAX_AUX);
        for (size_t i = 0; a && ok && i < TDM_HEAD_MAX_AUX; i++) {
            json_t *v = json_array_get(a, i);
            ok = json_is_integer(v) && json_integer_value(v) >= -1000000 &&
                 json_integer_value(v) <= 1000000;
            if (ok) ids[i] = (int)json_integer_value(v);
        }
        json_decref(root);
        if (!ok)
            return tdm_err_set(TDM_EFORMAT,
                               "%s: eagle_aux_hidden_state_layer_ids must be a list of %d layer "
                               "ids",
                               cfg, TDM_HEAD_MAX_AUX);
        if (a) src = cfg;
    }
    for (int i = 0; i < TDM_HEAD_MAX_AUX; i++)
        if (ids[i] < 0 || ids[i] >= nl)
            return tdm_err_set(TDM_EINVAL,
                               "%s: the EAGLE-3 head reads the hidden states entering target "
                               "layers %d, %d and %d (%s), and the target %s has %d layers",
                               m->path, ids[0], ids[1], ids[2], src, target->path, nl);
    memcpy(h->aux_layers, ids, sizeof ids);
    h->n_aux = TDM_HEAD_MAX_AUX;
    return TDM_OK;
}

/* An EAGLE-3 head (the public EAGLE repository's, SpecForge's and vLLM's names; see the
 * layout list above and model.h). */
static tdm_status load_eagle3(struct loader *L, const struct tdm_model *target)
{
    struct tdm_model *m = L->m;
    const struct tdm_model_config *tc = &target->cfg;
    const int64_t d = tc->d_model, hd = tc->head_dim, V = tc->vocab_size;
    struct tdm_head *h = m->head;
    h->layout = TDM_HEAD_EAGLE3;
    if (tdm_config_mla(tc))
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "%s: an EAGLE-3 head beside a target with latent attention (%s) is "
                           "not supported",
                           m->path, target->path);
    const struct tdm_tensor_info *fc = find_tensor(L, "fc.weight");
    if (!fc || fc->n_dims != 2 || fc->ne[1] != d || fc->ne[0] != 3 * d) {
        char got[128] = "missing";
        if (fc) shape_str(fc, got, sizeof got);
        return tdm_err_set(TDM_EINVAL,
                           "%s: an EAGLE-3 head's fc.weight is %s; the target %s is %lld wide, "
                           "so it must be [%lld, %lld] (low, middle and high features to the "
                           "width): a head must be trained for its target",
                           m->path, got, target->path, (long long)d, (long long)d,
                           (long long)(3 * d));
    }
    const struct tdm_tensor_info *qt = find_tensor(L, "midlayer.self_attn.q_proj.weight");
    int64_t q_rows = tensor_rows(L, "midlayer.self_attn.q_proj.weight");
    int64_t k_rows = tensor_rows(L, "midlayer.self_attn.k_proj.weight");
    int64_t ff = tensor_rows(L, "midlayer.mlp.gate_proj.weight");
    if (q_rows <= 0 || k_rows <= 0 || ff <= 0 || q_rows % hd || k_rows % hd ||
        (q_rows / hd) % (k_rows / hd))
        return tdm_err_set(TDM_EFORMAT,
                           "%s: an EAGLE-3 head's layer (midlayer.self_attn.q_proj, k_proj, "
                           "mlp.gate_proj) is missing or does not split into the target's "
                           "%lld-wide heads",
                           m->path, (long long)hd);
    if (qt->ne[0] != 2 * d)
        return tdm_err_set(TDM_EINVAL,
                           "%s: midlayer.self_attn.q_proj.weight reads %lld columns; an EAGLE-3 "
                           "layer reads [embedding; feature], 2 x %lld (the target %s's width)",
                           m->path, (long long)qt->ne[0], (long long)d, target->path);
    m->cfg = *tc;
    m->cfg.n_layers = 1;
    m->cfg.n_mtp_layers = 0;
    memset(m->cfg.moe_dense_layers, 0, sizeof m->cfg.moe_dense_layers);
    m->cfg.n_experts = m->cfg.n_experts_used = m->cfg.d_ff_expert = 0;
    m->cfg.n_heads = (int)(q_rows / hd);
    m->cfg.n_kv_heads = (int)(k_rows / hd);
    m->cfg.d_ff = (int)ff;
    m->cfg.qkv_bias = find_tensor(L, "midlayer.self_attn.q_proj.bias") != NULL;
    m->cfg.qk_norm = find_tensor(L, "midlayer.self_attn.q_norm.weight") != NULL;
    if (!(m->layers = calloc(1, sizeof *m->layers)))
        return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    L->hf_layer = "midlayer.";
    L->qkv_cols = 2 * d;
    tdm_status rc = load_layer_at(L, 0, 0);
    L->qkv_cols = 0;
    if (rc) return rc;
    /* the layer's input norm is the embedding's; q/k/v's halves: [embedding | feature] */
    struct tdm_layer_weights *lw = &m->layers[0];
    h->enorm = lw->attn_norm;
    lw->attn_norm = (struct tdm_weight){0};
    struct tdm_weight wq = lw->wq, wk = lw->wk, wv = lw->wv;
    if ((rc = split_cols(L, &wq, d, &lw->wq, &h->wq_h)) ||
        (rc = split_cols(L, &wk, d, &lw->wk, &h->wk_h)) ||
        (rc = split_cols(L, &wv, d, &lw->wv, &h->wv_h)) ||
        (rc = load_vector(L, "midlayer.hidden_norm.weight", d, &h->hnorm)) ||
        (rc = load_matrix(L, "fc.weight", d, 3 * d, &h->fc_h)) ||
        (find_tensor(L, "fc.bias") && (rc = load_vector(L, "fc.bias", d, &h->fc_bias))) ||
        (rc = load_vector(L, "norm.weight", d, &m->output_norm)))
        return rc;
    /* its embeddings: its own copy when it has one (of the target's shape), else the target's */
    const char *emb = find_tensor(L, "embed_tokens.weight")         ? "embed_tokens.weight"
                      : find_tensor(L, "model.embed_tokens.weight") ? "model.embed_tokens.weight"
                                                                    : NULL;
    if (emb && (rc = load_matrix(L, emb, V, d, &m->tok_embd))) return rc;
    if (!emb) m->tok_embd = target->tok_embd;
    /* its own LM head, over the draft vocabulary d2t maps into the target's */
    int64_t n = tensor_rows(L, "lm_head.weight");
    if (n <= 0)
        return tdm_err_set(TDM_EFORMAT, "%s: an EAGLE-3 head without its lm_head.weight", m->path);
    if (find_tensor(L, "d2t")) {
        if ((rc = parse_d2t(L, target))) return rc;
        if (h->n_draft != n)
            return tdm_err_set(TDM_EINVAL,
                               "%s: d2t maps %d draft tokens and lm_head.weight has %lld rows: "
                               "they must agree",
                               m->path, h->n_draft, (long long)n);
    } else if (n != V) {
        return tdm_err_set(TDM_EINVAL,
                           "%s: lm_head.weight has %lld rows and there is no d2t: a head "
                           "without a draft vocabulary map needs the target's %lld",
                           m->path, (long long)n, (long long)V);
    }
    if ((rc = load_matrix(L, "lm_head.weight", n, d, &m->output))) return rc;
    /* t2d (bool [vocab]: which target tokens are drafted) must say what d2t says */
    const struct tdm_tensor_info *t2d = find_tensor(L, "t2d");
    if (t2d) {
        const char *dt = tdm_st_dtype_str(m->st, t2d);
        if ((strcmp(dt, "BOOL") && strcmp(dt, "U8")) || t2d->n_dims != 1 || t2d->ne[0] != V ||
            t2d->nbytes != (size_t)V)
            return tdm_err_set(TDM_EINVAL,
                               "%s: t2d must be a 1-D BOOL tensor of the target's %lld tokens",
                               m->path, (long long)V);
        const uint8_t *b = t2d->data;
        int64_t marked = 0;
        for (int64_t i = 0; i < V; i++)
            marked += b[i] != 0;
        bool agree = marked == n;
        for (int64_t i = 0; agree && h->d2t && i < n; i++)
            agree = b[h->d2t[i]] != 0;
        if (!agree)
            return tdm_err_set(TDM_EINVAL,
                               "%s: t2d marks %lld target tokens and the draft vocabulary is "
                               "%lld: t2d and d2t do not describe the same tokens",
                               m->path, (long long)marked, (long long)n);
    }
    if ((rc = eagle3_aux_layers(L, target))) return rc;
    h->feature_width = (int)(3 * d);
    m->rope_freqs = target->rope_freqs;
    return TDM_OK;
}

static tdm_status load_head(struct loader *L, const struct tdm_model *target)
{
    struct tdm_model *m = L->m;
    const struct tdm_model_config *tc = &target->cfg;
    const int64_t d = tc->d_model, hd = tc->head_dim;
    struct tdm_head *h = m->head;
    char prefix[64], name[160];
    int idx = 0;
    h->feature_width = (int)d;
    if (find_tensor(L, "midlayer.self_attn.q_proj.weight")) {
        return load_eagle3(L, target);
    } else if (find_tensor(L, "fc.weight")) {
        h->layout = find_tensor(L, "enorm.weight") ? TDM_HEAD_TANDEM : TDM_HEAD_EAGLE;
        snprintf(prefix, sizeof prefix, "layers.");
    } else if ((idx = deepseek_mtp_layer(m->st)) >= 0) {
        h->layout = TDM_HEAD_DEEPSEEK_MTP;
        snprintf(prefix, sizeof prefix, "model.layers.%d.", idx);
    } else {
        return tdm_err_set(TDM_EFORMAT,
                           "%s: not a speculation head: no fc.weight (tandem, EAGLE) and no "
                           "model.layers.N.eh_proj.weight (DeepSeek MTP)",
                           m->path);
    }
    const char *lp = h->layout == TDM_HEAD_DEEPSEEK_MTP ? prefix : "layers.0.";
#define HNAME(suffix) (snprintf(name, sizeof name, "%s%s", lp, suffix), name)
    /* the head's layer is of its target's architecture: MLA for an MLA target, experts where
     * the target has them (DeepSeek-V3's own MTP layer is both) */
    const bool mla = find_tensor(L, HNAME("self_attn.kv_a_proj_with_mqa.weight")) != NULL;
    const bool sparse = find_tensor(L, HNAME("mlp.gate.weight")) ||
                        find_tensor(L, HNAME("mlp.experts.0.gate_proj.weight")) ||
                        find_tensor(L, HNAME("mlp.experts.gate_up_proj"));
    if (mla != tdm_config_mla(tc))
        return tdm_err_set(TDM_EINVAL,
                           "%s: the head's layer %s MLA attention and its target %s %s: a head "
                           "must be trained for its target",
                           m->path, mla ? "uses" : "does not use", target->path,
                           tdm_config_mla(tc) ? "does" : "does not");
    if (sparse && !tc->n_experts)
        return tdm_err_set(TDM_EINVAL,
                           "%s: the head's layer is a mixture of experts and its target %s has "
                           "none: a head must be trained for its target",
                           m->path, target->path);
    /* the input projection decides the width: it must be the target's */
    const char *fc = h->layout == TDM_HEAD_DEEPSEEK_MTP ? HNAME("eh_proj.weight") : "fc.weight";
    char fc_name[160];
    snprintf(fc_name, sizeof fc_name, "%s", fc);
    int64_t fc_rows = tensor_rows(L, fc_name);
    if (fc_rows != d)
        return tdm_err_set(TDM_EINVAL,
                           "%s: the head is %lld wide (%s), the target %s is %lld wide: a head "
                           "must be trained for its target",
                           m->path, (long long)fc_rows, fc_name, target->path, (long long)d);
    m->cfg = *tc;
    m->cfg.n_layers = 1;
    m->cfg.n_mtp_layers = 0;
    memset(m->cfg.moe_dense_layers, 0, sizeof m->cfg.moe_dense_layers);
    if (!sparse) m->cfg.n_experts = m->cfg.n_experts_used = m->cfg.d_ff_expert = 0;
    if (!mla) { /* a GQA layer of its own geometry (the target's head size) */
        int64_t q_rows = tensor_rows(L, HNAME("self_attn.q_proj.weight"));
        int64_t k_rows = tensor_rows(L, HNAME("self_attn.k_proj.weight"));
        int64_t ff = sparse ? tc->d_ff : tensor_rows(L, HNAME("mlp.gate_proj.weight"));
        if (q_rows <= 0 || k_rows <= 0 || ff <= 0 || q_rows % hd || k_rows % hd ||
            (q_rows / hd) % (k_rows / hd))
            return tdm_err_set(TDM_EFORMAT,
                               "%s: the head's layer (%sself_attn.q_proj, k_proj, mlp.gate_proj) "
                               "is missing or does not split into the target's %lld-wide heads",
                               m->path, lp, (long long)hd);
        m->cfg.n_heads = (int)(q_rows / hd);
        m->cfg.n_kv_heads = (int)(k_rows / hd);
        m->cfg.d_ff = (int)ff;
        m->cfg.qkv_bias = find_tensor(L, HNAME("self_attn.q_proj.bias")) != NULL;
        m->cfg.qk_norm = find_tensor(L, HNAME("self_attn.q_norm.weight")) != NULL;
    } else if (!sparse) {
        int64_t ff = tensor_rows(L, HNAME("mlp.gate_proj.weight"));
        if (ff <= 0)
            return tdm_err_set(TDM_EFORMAT, "%s: the head's layer has no %smlp.gate_proj", m->path,
                               lp);
        m->cfg.d_ff = (int)ff;
    }
    if (!(m->layers = calloc(1, sizeof *m->layers)))
        return tdm_err_set(TDM_ENOMEM, "model: out of memory");
    L->hf_layer = h->layout == TDM_HEAD_DEEPSEEK_MTP ? "model.layers.%d." : "layers.%d.";
    L->attn_norm_optional = h->layout == TDM_HEAD_EAGLE;
    tdm_status rc = load_layer_at(L, idx, 0);
    if (rc) return rc;
    if ((rc = load_fc(L, fc_name, d, h))) return rc;
    const char *bias = h->layout == TDM_HEAD_DEEPSEEK_MTP ? HNAME("eh_proj.bias") : "fc.bias";
    snprintf(fc_name, sizeof fc_name, "%s", bias);
    if (find_tensor(L, fc_name) && (rc = load_vector(L, fc_name, d, &h->fc_bias))) return rc;
    const char *norm = "norm.weight";
    if (h->layout == TDM_HEAD_DEEPSEEK_MTP) {
        if ((rc = load_vector(L, HNAME("enorm.weight"), d, &h->enorm)) ||
            (rc = load_vector(L, HNAME("hnorm.weight"), d, &h->hnorm)))
            return rc;
        const char *sh = HNAME("shared_head.head.weight");
        int64_t sv = tensor_rows(L, sh);
        if (find_tensor(L, sh) && sv != tc->vocab_size)
            return tdm_err_set(TDM_EINVAL,
                               "%s: %s has %lld tokens, the target %s %d: the head was made for "
                               "another vocabulary",
                               m->path, sh, (long long)sv, target->path, tc->vocab_size);
        norm = HNAME("shared_head.norm.weight");
    } else if (h->layout == TDM_HEAD_TANDEM) {
        if ((rc = load_vector(L, "enorm.weight", d, &h->enorm)) ||
            (rc = load_vector(L, "hnorm.weight", d, &h->hnorm)))
            return rc;
    }
    snprintf(fc_name, sizeof fc_name, "%s", norm);
    if ((h->layout != TDM_HEAD_EAGLE || find_tensor(L, fc_name)) &&
        (rc = load_vector(L, fc_name, d, &m->output_norm)))
        return rc;
#undef HNAME
    m->tok_embd = target->tok_embd;
    m->output = target->output;
    m->rope_freqs = target->rope_freqs;
    if (h->layout == TDM_HEAD_TANDEM && find_tensor(L, "d2t")) return load_d2t(L, target);
    return TDM_OK;
}

tdm_status tdm_head_load(const char *path, const struct tdm_model *target, struct tdm_model **out)
{
    if (!path || !target || !out) return tdm_err_set(TDM_EINVAL, "tdm_head_load: bad args");
    struct tdm_model *m = calloc(1, sizeof *m);
    tdm_status rc;
    if (!m || !(m->head = calloc(1, sizeof *m->head)) || !(m->path = strdup(path))) {
        rc = tdm_err_set(TDM_ENOMEM, "model: out of memory");
        goto out_free;
    }
    if ((rc = tdm_st_open(path, &m->st))) goto out_free;
    struct loader L = {.m = m};
    if ((rc = load_head(&L, target))) goto out_free;
    TDM_DEBUG("loaded head %s (%s layout): %d heads, %d kv heads, d_ff %d, %.1fM params", path,
              tdm_head_layout_name(m->head->layout), m->cfg.n_heads, m->cfg.n_kv_heads, m->cfg.d_ff,
              (double)m->n_params / 1e6);
    *out = m;
    return TDM_OK;
out_free:
    tdm_model_free(m);
    return rc;
}

bool tdm_default_head_path(const char *model_path, char *buf, size_t cap)
{
    if (!model_path || !*model_path) return false;
    size_t n = strlen(model_path);
    while (n > 1 && model_path[n - 1] == '/') /* a folder given as dir/ */
        n--;
    if (n >= 5 && !strncmp(model_path + n - 5, ".gguf", 5)) n -= 5;
    int w = snprintf(buf, cap, "%.*s.mtp.safetensors", (int)n, model_path);
    return w > 0 && (size_t)w < cap;
}
