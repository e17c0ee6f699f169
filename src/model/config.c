/*
 * Model configuration: the architecture hyper-parameters the engine needs, read from GGUF
 * metadata (<arch>.* keys) or from a HF checkpoint's config.json and generation_config.json.
 *
 * Both readers fill a local struct, then run one shared validation (config_check) so a GGUF
 * file and a HF folder are held to the same limits: positive sizes under sane caps, heads
 * divisible by kv heads, an even head_dim, finite positive epsilons and rope bases, and token
 * ids inside the vocabulary. The caller's struct is written only on success. Features we do
 * not run (partial rotary outside MLA, attention output bias, rope scalings other than linear,
 * llama3 and DeepSeek's yarn, non-SiLU activations) are refused with TDM_EUNSUPPORTED rather
 * than silently mis-run. Mixture of experts (qwen3_moe, qwen2_moe, mixtral, deepseek_v2/v3;
 * GGUF qwen3moe, qwen2moe, deepseek2 and llama with experts) is read into the n_experts and
 * moe_* fields; DeepSeek's multi-head latent attention into the MLA fields, with head_dim the
 * width of a cached latent row and one KV head.
 *
 * Conventions: GGUF llama files come from llama.cpp's converter, which permutes the Q/K rows
 * so that rope rotates adjacent pairs (rope_neox = false); qwen2/qwen3 GGUF files and every HF
 * checkpoint rotate halves (rope_neox = true). llama3 rope scaling has no GGUF keys: the
 * converter bakes it into a rope_freqs.weight tensor, which the loader hands to the engine.
 *
 * Threading: pure functions of their inputs; safe to call concurrently.
 */
#include "model/model_int.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* Caps well above any released dense model, low enough that sizes derived from them cannot
 * overflow int arithmetic in the engine (d_model * n_layers, n_heads * head_dim, ...). */
#define CFG_MAX_LAYERS   1024
#define CFG_MAX_D_MODEL  65536
#define CFG_MAX_HEADS    1024
#define CFG_MAX_HEAD_DIM 1024
#define CFG_MAX_D_FF     (1 << 20)
#define CFG_MAX_VOCAB    (1 << 22)
#define CFG_MAX_CTX      (1 << 28)
#define CFG_MAX_EXPERTS  1024

const char *tdm_arch_name(enum tdm_arch a)
{
    switch (a) {
    case TDM_ARCH_LLAMA:
        return "llama";
    case TDM_ARCH_QWEN2:
        return "qwen2";
    case TDM_ARCH_QWEN3:
        return "qwen3";
    case TDM_ARCH_DEEPSEEK2:
        return "deepseek2";
    }
    return "unknown";
}

void tdm_config_defaults(struct tdm_model_config *c)
{
    memset(c, 0, sizeof(*c));
    c->rope_theta = 10000.0f;
    c->rope_factor = 1.0f;
    c->rope_mscale = 1.0f;
    c->attn_scale = 1.0f;
    c->moe_routed_scale = 1.0f;
    c->bos_id = -1;
    c->gen_temperature = NAN;
    c->gen_top_p = NAN;
    c->gen_top_k = -1;
}

static void add_eos(struct tdm_model_config *c, int id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] == id) return;
    if (c->n_eos == TDM_MAX_EOS) {
        TDM_WARN("model config: more than %d end-of-sequence ids; ignoring %d", TDM_MAX_EOS, id);
        return;
    }
    c->eos_ids[c->n_eos++] = id;
}

static tdm_status check_int(const char *src, const char *what, int v, int lo, int hi)
{
    if (v < lo || v > hi)
        return tdm_err_set(TDM_ERANGE, "%s: %s = %d outside [%d, %d]", src, what, v, lo, hi);
    return TDM_OK;
}

/* The checks shared by both sources. */
static tdm_status config_check(const struct tdm_model_config *c, const char *src)
{
    tdm_status rc;
    if (tdm_config_mla(c)) {
        if ((rc = check_int(src, "kv_lora_rank", c->kv_lora_rank, 1, CFG_MAX_HEAD_DIM)) ||
            (rc = check_int(src, "q_lora_rank", c->q_lora_rank, 0, CFG_MAX_D_MODEL)) ||
            (rc = check_int(src, "qk_rope_head_dim", c->qk_rope_dim, 2, CFG_MAX_HEAD_DIM)) ||
            (rc = check_int(src, "qk_nope_head_dim", c->qk_nope_dim, 1, CFG_MAX_HEAD_DIM)) ||
            (rc = check_int(src, "v_head_dim", c->v_head_dim, 1, CFG_MAX_HEAD_DIM)))
            return rc;
        if (c->qk_rope_dim % 2)
            return tdm_err_set(TDM_EFORMAT, "%s: qk_rope_head_dim %d is odd (rope needs pairs)",
                               src, c->qk_rope_dim);
        if (c->kv_lora_rank + c->qk_rope_dim > CFG_MAX_HEAD_DIM)
            return tdm_err_set(TDM_ERANGE,
                               "%s: kv_lora_rank %d + qk_rope_head_dim %d (a cached row) is over "
                               "%d",
                               src, c->kv_lora_rank, c->qk_rope_dim, CFG_MAX_HEAD_DIM);
    }
    if ((rc = check_int(src, "n_layers", c->n_layers, 1, CFG_MAX_LAYERS)) ||
        (rc = check_int(src, "d_model", c->d_model, 1, CFG_MAX_D_MODEL)) ||
        (rc = check_int(src, "n_heads", c->n_heads, 1, CFG_MAX_HEADS)) ||
        (rc = check_int(src, "n_kv_heads", c->n_kv_heads, 1, CFG_MAX_HEADS)) ||
        (rc = check_int(src, "head_dim", c->head_dim, 2, CFG_MAX_HEAD_DIM)) ||
        (rc = check_int(src, "d_ff", c->d_ff, 1, CFG_MAX_D_FF)) ||
        (rc = check_int(src, "vocab_size", c->vocab_size, 1, CFG_MAX_VOCAB)) ||
        (rc = check_int(src, "max_ctx", c->max_ctx, 1, CFG_MAX_CTX)))
        return rc;
    if (c->n_heads % c->n_kv_heads)
        return tdm_err_set(TDM_EFORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d", src,
                           c->n_heads, c->n_kv_heads);
    if (c->head_dim % 2 && !tdm_config_mla(c)) /* MLA's rows: the rope part must be even */
        return tdm_err_set(TDM_EFORMAT, "%s: head_dim %d is odd (rope needs pairs)", src,
                           c->head_dim);
    if (!(c->rms_eps > 0.0f && c->rms_eps < 1.0f))
        return tdm_err_set(TDM_ERANGE, "%s: rms_norm_eps %g outside (0, 1)", src,
                           (double)c->rms_eps);
    if (!(c->rope_theta > 0.0f && isfinite(c->rope_theta)))
        return tdm_err_set(TDM_ERANGE, "%s: rope theta %g is not a positive number", src,
                           (double)c->rope_theta);
    if (c->rope_scaling != TDM_ROPE_SCALING_NONE &&
        !(c->rope_factor > 0.0f && isfinite(c->rope_factor)))
        return tdm_err_set(TDM_ERANGE, "%s: rope scaling factor %g is not a positive number", src,
                           (double)c->rope_factor);
    if (c->rope_scaling == TDM_ROPE_SCALING_LLAMA3) {
        if (!(c->rope_low_freq_factor > 0.0f &&
              c->rope_high_freq_factor > c->rope_low_freq_factor &&
              isfinite(c->rope_high_freq_factor)))
            return tdm_err_set(TDM_ERANGE,
                               "%s: llama3 rope needs 0 < low_freq_factor (%g) < high_freq_factor "
                               "(%g)",
                               src, (double)c->rope_low_freq_factor,
                               (double)c->rope_high_freq_factor);
        if ((rc = check_int(src, "original_max_position_embeddings", c->rope_original_max_ctx, 1,
                            CFG_MAX_CTX)))
            return rc;
    }
    if (c->rope_scaling == TDM_ROPE_SCALING_YARN) {
        if (!(c->rope_beta_fast > 0.0f && c->rope_beta_slow > 0.0f && isfinite(c->rope_beta_fast) &&
              isfinite(c->rope_beta_slow)))
            return tdm_err_set(TDM_ERANGE, "%s: yarn beta_fast %g / beta_slow %g must be > 0", src,
                               (double)c->rope_beta_fast, (double)c->rope_beta_slow);
        if ((rc = check_int(src, "original_max_position_embeddings", c->rope_original_max_ctx, 1,
                            CFG_MAX_CTX)))
            return rc;
    }
    if (!(c->rope_mscale > 0.0f && isfinite(c->rope_mscale) && c->attn_scale > 0.0f &&
          isfinite(c->attn_scale)))
        return tdm_err_set(TDM_ERANGE, "%s: yarn mscale %g / attention scale %g must be > 0", src,
                           (double)c->rope_mscale, (double)c->attn_scale);
    if (c->n_experts) {
        if ((rc = check_int(src, "number of experts", c->n_experts, 1, CFG_MAX_EXPERTS)) ||
            (rc = check_int(src, "experts per token", c->n_experts_used, 1, c->n_experts)) ||
            (rc = check_int(src, "expert FFN width", c->d_ff_expert, 1, CFG_MAX_D_FF)) ||
            (rc = check_int(src, "shared expert FFN width", c->d_ff_shared, 0, CFG_MAX_D_FF)))
            return rc;
        if (!(c->moe_routed_scale > 0.0f && isfinite(c->moe_routed_scale)))
            return tdm_err_set(TDM_ERANGE, "%s: routed_scaling_factor %g must be > 0", src,
                               (double)c->moe_routed_scale);
        if (c->moe_n_group) {
            if ((rc = check_int(src, "expert groups", c->moe_n_group, 1, c->n_experts)) ||
                (rc = check_int(src, "expert groups a token takes", c->moe_topk_group, 1,
                                c->moe_n_group)))
                return rc;
            if (c->n_experts % c->moe_n_group)
                return tdm_err_set(TDM_EFORMAT, "%s: %d experts do not split into %d groups", src,
                                   c->n_experts, c->moe_n_group);
            int in_groups = c->n_experts / c->moe_n_group * c->moe_topk_group;
            if (c->n_experts_used > in_groups)
                return tdm_err_set(TDM_ERANGE,
                                   "%s: %d experts a token, but its %d groups hold only %d", src,
                                   c->n_experts_used, c->moe_topk_group, in_groups);
            if (c->moe_group_top2 && c->n_experts / c->moe_n_group < 2)
                return tdm_err_set(TDM_EFORMAT,
                                   "%s: groups of one expert cannot be scored by their best two",
                                   src);
        }
    }
    if (c->bos_id < -1 || c->bos_id >= c->vocab_size)
        return tdm_err_set(TDM_ERANGE, "%s: bos token id %d outside the vocabulary (%d)", src,
                           c->bos_id, c->vocab_size);
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= c->vocab_size)
            return tdm_err_set(TDM_ERANGE, "%s: eos token id %d outside the vocabulary (%d)", src,
                               c->eos_ids[i], c->vocab_size);
    if (!isnan(c->gen_temperature) && !(c->gen_temperature >= 0.0f && isfinite(c->gen_temperature)))
        return tdm_err_set(TDM_ERANGE, "%s: temperature %g is not >= 0", src,
                           (double)c->gen_temperature);
    if (!isnan(c->gen_top_p) && !(c->gen_top_p > 0.0f && c->gen_top_p <= 1.0f))
        return tdm_err_set(TDM_ERANGE, "%s: top_p %g outside (0, 1]", src, (double)c->gen_top_p);
    if (c->gen_top_k < -1)
        return tdm_err_set(TDM_ERANGE, "%s: top_k %d is negative", src, c->gen_top_k);
    return TDM_OK;
}

/* ================================ GGUF ================================ */

static bool str_eq(struct tdm_str s, const char *lit)
{
    return s.len == strlen(lit) && !memcmp(s.ptr, lit, s.len);
}

/* Reads <arch>.<suffix> as an int in [INT_MIN, INT_MAX]. Absent: `def` if !required. */
static tdm_status g_int(const tdm_gguf_t *g, const char *arch, const char *suffix, bool required,
                        int def, int *out)
{
    char key[128];
    if (arch)
        snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    else
        snprintf(key, sizeof(key), "%s", suffix);
    int64_t v;
    tdm_status rc = tdm_gguf_get_i64(g, key, &v);
    if (rc == TDM_ENOTFOUND && !required) {
        *out = def;
        return TDM_OK;
    }
    if (rc == TDM_ENOTFOUND) return tdm_err_set(rc, "gguf: required key %s is missing", key);
    if (rc) return rc;
    if (v < INT_MIN || v > INT_MAX)
        return tdm_err_set(TDM_ERANGE, "gguf: %s = %lld is out of range", key, (long long)v);
    *out = (int)v;
    return TDM_OK;
}

static tdm_status g_f32(const tdm_gguf_t *g, const char *arch, const char *suffix, bool required,
                        float def, float *out)
{
    char key[128];
    if (arch)
        snprintf(key, sizeof(key), "%s.%s", arch, suffix);
    else
        snprintf(key, sizeof(key), "%s", suffix);
    tdm_status rc = tdm_gguf_get_f32(g, key, out);
    if (rc == TDM_ENOTFOUND && !required) {
        *out = def;
        return TDM_OK;
    }
    if (rc == TDM_ENOTFOUND) return tdm_err_set(rc, "gguf: required key %s is missing", key);
    return rc;
}

/* Adds the ids of well-known end-of-turn tokens present in the vocabulary as extra EOS, so a
 * chat model stops at the end of its turn even when the file names only the base EOS. */
static tdm_status gguf_extra_eos(const tdm_gguf_t *g, struct tdm_model_config *c)
{
    static const char *const names[] = {"<|im_end|>", "<|eot_id|>", "<|endoftext|>"};
    enum tdm_gguf_type et;
    int64_t n;
    if (tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, NULL) || et != TDM_GGUF_STRING)
        return TDM_OK;
    n = TDM_MIN(n, (int64_t)c->vocab_size);
    for (int64_t i = 0; i < n; i++) {
        struct tdm_str s;
        tdm_status rc = tdm_gguf_get_arr_str(g, "tokenizer.ggml.tokens", i, &s);
        if (rc) return rc;
        if (s.len < 9 || s.len > 13 || s.ptr[0] != '<') continue;
        for (size_t k = 0; k < TDM_ARRAY_LEN(names); k++)
            if (str_eq(s, names[k])) add_eos(c, (int)i);
    }
    return TDM_OK;
}

/* GGUF rope scaling of type yarn: factor, original context, betas, and the attention scale
 * from yarn_log_multiplier (llama.cpp: kq_scale = (1 + log_mul ln factor)^2 / sqrt(head);
 * the rotation itself is not scaled). */
static tdm_status gguf_yarn(const tdm_gguf_t *g, const char *arch, struct tdm_model_config *c)
{
    float log_mul = 0.0f;
    tdm_status rc;
    c->rope_scaling = TDM_ROPE_SCALING_YARN;
    if ((rc = g_f32(g, arch, "rope.scaling.factor", true, 1.0f, &c->rope_factor)) ||
        (rc = g_int(g, arch, "rope.scaling.original_context_length", true, 0,
                    &c->rope_original_max_ctx)) ||
        (rc = g_f32(g, arch, "rope.scaling.yarn_beta_fast", false, 32.0f, &c->rope_beta_fast)) ||
        (rc = g_f32(g, arch, "rope.scaling.yarn_beta_slow", false, 1.0f, &c->rope_beta_slow)) ||
        (rc = g_f32(g, arch, "rope.scaling.yarn_log_multiplier", false, 0.0f, &log_mul)))
        return rc;
    if (!(c->rope_factor > 0.0f && isfinite(log_mul)))
        return tdm_err_set(TDM_ERANGE, "gguf: yarn factor %g / log multiplier %g",
                           (double)c->rope_factor, (double)log_mul);
    if (c->rope_factor > 1.0f) {
        double m = 1.0 + log_mul * log((double)c->rope_factor);
        c->attn_scale = (float)(m * m);
    }
    return TDM_OK;
}

/* llama.cpp's deepseek2: MLA (attention.q_lora_rank, kv_lora_rank; key_length and
 * value_length are the per-head q/k and v widths, or with the k_b/v_b split the latent's and
 * key_length_mla / value_length_mla the heads'), rope.dimension_count the rope part, and
 * DeepSeek's experts (expert_gating_func 1 softmax, 2 sigmoid; expert_group_count and
 * expert_group_used_count, a group scored by its two best as llama.cpp does;
 * expert_weights_scale, expert_weights_norm; leading_dense_block_count dense layers;
 * expert_shared_count shared experts of expert_feed_forward_length each). */
static tdm_status gguf_deepseek2(const tdm_gguf_t *g, struct tdm_model_config *c)
{
    const char *a = "deepseek2";
    int qk = 0, v = 0, qk_mla = 0, v_mla = 0, shared = 0, dense = 0, gating = 1;
    tdm_status rc;
    if ((rc = g_int(g, a, "attention.q_lora_rank", false, 0, &c->q_lora_rank)) ||
        (rc = g_int(g, a, "attention.kv_lora_rank", true, 0, &c->kv_lora_rank)) ||
        (rc = g_int(g, a, "attention.key_length", true, 0, &qk)) ||
        (rc = g_int(g, a, "attention.value_length", true, 0, &v)) ||
        (rc = g_int(g, a, "attention.key_length_mla", false, 0, &qk_mla)) ||
        (rc = g_int(g, a, "attention.value_length_mla", false, 0, &v_mla)) ||
        (rc = g_int(g, a, "rope.dimension_count", true, 0, &c->qk_rope_dim)) ||
        (rc = g_int(g, a, "feed_forward_length", true, 0, &c->d_ff)) ||
        (rc = g_int(g, a, "expert_count", false, 0, &c->n_experts)) ||
        (rc = g_int(g, a, "leading_dense_block_count", false, 0, &dense)))
        return rc;
    if (c->kv_lora_rank <= 0)
        return tdm_err_set(TDM_ERANGE, "gguf: deepseek2.attention.kv_lora_rank = %d",
                           c->kv_lora_rank);
    if (qk_mla) { /* the k_b / v_b layout */
        qk = qk_mla;
        v = v_mla;
    }
    c->qk_nope_dim = qk - c->qk_rope_dim;
    c->v_head_dim = v;
    c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
    c->n_kv_heads = 1;
    c->rope_neox = false;
    if (c->n_experts) {
        if ((rc = g_int(g, a, "expert_used_count", true, 0, &c->n_experts_used)) ||
            (rc = g_int(g, a, "expert_feed_forward_length", true, 0, &c->d_ff_expert)) ||
            (rc = g_int(g, a, "expert_shared_count", false, 0, &shared)) ||
            (rc = g_int(g, a, "expert_gating_func", false, 1, &gating)) ||
            (rc = g_int(g, a, "expert_group_count", false, 0, &c->moe_n_group)) ||
            (rc = g_int(g, a, "expert_group_used_count", false, 0, &c->moe_topk_group)) ||
            (rc = g_f32(g, a, "expert_weights_scale", false, 1.0f, &c->moe_routed_scale)))
            return rc;
        rc = tdm_gguf_get_bool(g, "deepseek2.expert_weights_norm", &c->moe_norm_topk);
        if (rc != TDM_OK && rc != TDM_ENOTFOUND) return rc;
        if (gating != 1 && gating != 2)
            return tdm_err_set(TDM_EUNSUPPORTED, "gguf: deepseek2.expert_gating_func %d (1, 2)",
                               gating);
        c->moe_scoring = gating == 2 ? TDM_MOE_SIGMOID : TDM_MOE_SOFTMAX;
        if (c->moe_n_group == 1) c->moe_n_group = c->moe_topk_group = 0; /* one group: none */
        c->moe_group_top2 = c->moe_n_group > 0;
        if (shared < 0 || shared > 64)
            return tdm_err_set(TDM_ERANGE, "gguf: deepseek2.expert_shared_count = %d", shared);
        c->d_ff_shared = shared * c->d_ff_expert;
        if (dense < 0 || dense > c->n_layers)
            return tdm_err_set(TDM_ERANGE, "gguf: deepseek2.leading_dense_block_count = %d", dense);
        for (int l = 0; l < dense && l < 1024; l++)
            c->moe_dense_layers[l / 64] |= 1ull << (l % 64);
    }
    struct tdm_str stype;
    rc = tdm_gguf_get_str(g, "deepseek2.rope.scaling.type", &stype);
    if (rc && rc != TDM_ENOTFOUND) return rc;
    if (!rc && str_eq(stype, "yarn")) return gguf_yarn(g, a, c);
    if (!rc && !str_eq(stype, "none"))
        return tdm_err_set(TDM_EUNSUPPORTED, "gguf: rope scaling \"%.*s\" is not supported (yarn)",
                           (int)TDM_MIN(stype.len, 64), stype.ptr);
    return TDM_OK;
}

tdm_status tdm_config_from_gguf(const tdm_gguf_t *g, struct tdm_model_config *cfg)
{
    if (!g || !cfg) return tdm_err_set(TDM_EINVAL, "tdm_config_from_gguf: bad args");
    struct tdm_model_config c;
    tdm_config_defaults(&c);
    struct tdm_str as;
    tdm_status rc = tdm_gguf_get_str(g, "general.architecture", &as);
    if (rc == TDM_ENOTFOUND) return tdm_err_set(rc, "gguf: no general.architecture");
    if (rc) return rc;
    const char *arch;
    if (str_eq(as, "llama")) {
        c.arch = TDM_ARCH_LLAMA, arch = "llama";
    } else if (str_eq(as, "qwen2")) {
        c.arch = TDM_ARCH_QWEN2, arch = "qwen2";
    } else if (str_eq(as, "qwen3")) {
        c.arch = TDM_ARCH_QWEN3, arch = "qwen3";
    } else if (str_eq(as, "qwen3moe")) {
        c.arch = TDM_ARCH_QWEN3, arch = "qwen3moe";
    } else if (str_eq(as, "qwen2moe")) {
        c.arch = TDM_ARCH_QWEN2, arch = "qwen2moe";
    } else if (str_eq(as, "deepseek2")) {
        c.arch = TDM_ARCH_DEEPSEEK2, arch = "deepseek2";
    } else {
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "gguf: architecture \"%.*s\" is not supported (llama, qwen2, qwen3, "
                           "qwen2moe, qwen3moe, deepseek2)",
                           (int)TDM_MIN(as.len, 64), as.ptr);
    }

    int experts = 0, shared = 0, rope_dims = 0, value_len = 0;
    if ((rc = g_int(g, arch, "block_count", true, 0, &c.n_layers)) ||
        (rc = g_int(g, arch, "embedding_length", true, 0, &c.d_model)) ||
        (rc = g_int(g, arch, "attention.head_count", true, 0, &c.n_heads)) ||
        (rc = g_int(g, arch, "attention.head_count_kv", false, c.n_heads, &c.n_kv_heads)) ||
        (rc = g_int(g, arch, "context_length", true, 0, &c.max_ctx)) ||
        (rc = g_f32(g, arch, "attention.layer_norm_rms_epsilon", true, 0, &c.rms_eps)) ||
        (rc = g_f32(g, arch, "rope.freq_base", false, 10000.0f, &c.rope_theta)))
        return rc;
    char key[128];
    if (c.arch == TDM_ARCH_DEEPSEEK2) {
        if ((rc = gguf_deepseek2(g, &c))) return rc;
        goto vocab;
    }
    if ((rc = g_int(g, arch, "expert_count", false, 0, &experts)) ||
        (rc = g_int(g, arch, "expert_shared_count", false, 0, &shared)) ||
        (rc = g_int(g, arch, "expert_shared_feed_forward_length", false, 0, &c.d_ff_shared)))
        return rc;
    /* qwen2moe's one shared expert is named by its width; several (DeepSeek's) are not run */
    if (shared > 1 || (shared == 1 && !c.d_ff_shared))
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "gguf: shared experts (%s.expert_shared_count = %d) other than "
                           "qwen2moe's are not supported",
                           arch, shared);
    if (experts < 0) return tdm_err_set(TDM_ERANGE, "gguf: %s.expert_count = %d", arch, experts);
    if (experts > 0) {
        /* llama.cpp's softmax top-k experts: renormalised for Mixtral (as llama) and
         * qwen3moe, not for qwen2moe (as its HF configs' norm_topk_prob), unless the file
         * says (expert_weights_norm) */
        c.n_experts = experts;
        c.moe_norm_topk = strcmp(arch, "qwen2moe") != 0;
        snprintf(key, sizeof key, "%s.expert_weights_norm", arch);
        rc = tdm_gguf_get_bool(g, key, &c.moe_norm_topk);
        if (rc != TDM_OK && rc != TDM_ENOTFOUND) return rc;
        if ((rc = g_int(g, arch, "expert_used_count", true, 0, &c.n_experts_used)) ||
            (rc = g_int(g, arch, "expert_feed_forward_length", strcmp(arch, "llama") != 0, 0,
                        &c.d_ff_expert)) ||
            (rc = g_int(g, arch, "feed_forward_length", !c.d_ff_expert, c.d_ff_expert, &c.d_ff)))
            return rc;
        if (!c.d_ff_expert) c.d_ff_expert = c.d_ff;
        /* qwen2moe's shared expert is as wide as feed_forward_length unless said (llama.cpp) */
        if (!strcmp(arch, "qwen2moe") && !c.d_ff_shared) c.d_ff_shared = c.d_ff;
    } else if ((rc = g_int(g, arch, "feed_forward_length", true, 0, &c.d_ff))) {
        return rc;
    }
    if (c.n_heads <= 0 || c.d_model <= 0)
        return tdm_err_set(TDM_ERANGE, "gguf: head_count %d / embedding_length %d must be > 0",
                           c.n_heads, c.d_model);
    snprintf(key, sizeof(key), "%s.attention.key_length", arch);
    if (tdm_gguf_find(g, key) < 0 && c.d_model % c.n_heads)
        return tdm_err_set(TDM_EFORMAT,
                           "gguf: embedding_length %d is not a multiple of head_count %d",
                           c.d_model, c.n_heads);
    if ((rc = g_int(g, arch, "attention.key_length", false, c.d_model / c.n_heads, &c.head_dim)) ||
        (rc = g_int(g, arch, "attention.value_length", false, c.head_dim, &value_len)) ||
        (rc = g_int(g, arch, "rope.dimension_count", false, c.head_dim, &rope_dims)))
        return rc;
    if (value_len != c.head_dim)
        return tdm_err_set(TDM_EUNSUPPORTED, "gguf: value_length %d != key_length %d", value_len,
                           c.head_dim);
    if (rope_dims != c.head_dim)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "gguf: partial rotary embeddings (rope.dimension_count %d, head_dim "
                           "%d) are not supported",
                           rope_dims, c.head_dim);

    /* rope scaling: rope.scaling.type (newer files) or rope.scale_linear (older) */
    snprintf(key, sizeof(key), "%s.rope.scaling.type", arch);
    struct tdm_str stype;
    rc = tdm_gguf_get_str(g, key, &stype);
    if (rc && rc != TDM_ENOTFOUND) return rc;
    if (!rc && !str_eq(stype, "none")) {
        if (!str_eq(stype, "linear"))
            return tdm_err_set(TDM_EUNSUPPORTED, "gguf: rope scaling \"%.*s\" is not supported",
                               (int)TDM_MIN(stype.len, 64), stype.ptr);
        c.rope_scaling = TDM_ROPE_SCALING_LINEAR;
        if ((rc = g_f32(g, arch, "rope.scaling.factor", true, 1.0f, &c.rope_factor))) return rc;
    } else if (rc == TDM_ENOTFOUND) {
        float lin;
        if ((rc = g_f32(g, arch, "rope.scale_linear", false, 0.0f, &lin))) return rc;
        if (lin != 0.0f && lin != 1.0f) {
            c.rope_scaling = TDM_ROPE_SCALING_LINEAR;
            c.rope_factor = lin;
        }
    }

vocab:
    /* vocabulary: <arch>.vocab_size, else the token list, else the embedding's rows */
    snprintf(key, sizeof(key), "%s.vocab_size", arch);
    enum tdm_gguf_type et;
    int64_t n_tokens = 0;
    const struct tdm_tensor_info *embd = tdm_gguf_find_tensor(g, "token_embd.weight");
    if (tdm_gguf_find(g, key) >= 0) {
        if ((rc = g_int(g, arch, "vocab_size", true, 0, &c.vocab_size))) return rc;
    } else if (!tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n_tokens, NULL)) {
        c.vocab_size = n_tokens > INT_MAX ? INT_MAX : (int)n_tokens;
    } else if (embd && embd->n_dims == 2) {
        c.vocab_size = embd->ne[1] > INT_MAX ? INT_MAX : (int)embd->ne[1];
    } else {
        return tdm_err_set(TDM_EFORMAT, "gguf: cannot tell the vocabulary size");
    }

    c.tied_embeddings = tdm_gguf_find_tensor(g, "output.weight") == NULL;
    c.qkv_bias = c.arch == TDM_ARCH_QWEN2 || tdm_gguf_find_tensor(g, "blk.0.attn_q.bias");
    c.qk_norm = c.arch == TDM_ARCH_QWEN3 || tdm_gguf_find_tensor(g, "blk.0.attn_q_norm.weight");
    c.rope_neox = c.arch != TDM_ARCH_LLAMA && c.arch != TDM_ARCH_DEEPSEEK2;

    int eos = -1, eot = -1;
    if ((rc = g_int(g, NULL, "tokenizer.ggml.bos_token_id", false, -1, &c.bos_id)) ||
        (rc = g_int(g, NULL, "tokenizer.ggml.eos_token_id", false, -1, &eos)) ||
        (rc = g_int(g, NULL, "tokenizer.ggml.eot_token_id", false, -1, &eot)))
        return rc;
    if (eos >= 0) add_eos(&c, eos);
    if (eot >= 0) add_eos(&c, eot);
    if (c.vocab_size > 0 && c.vocab_size <= CFG_MAX_VOCAB && (rc = gguf_extra_eos(g, &c)))
        return rc;

    if ((rc = g_f32(g, NULL, "general.sampling.temp", false, NAN, &c.gen_temperature)) ||
        (rc = g_f32(g, NULL, "general.sampling.top_p", false, NAN, &c.gen_top_p)) ||
        (rc = g_int(g, NULL, "general.sampling.top_k", false, -1, &c.gen_top_k)))
        return rc;

    if ((rc = config_check(&c, "gguf"))) return rc;
    *cfg = c;
    return TDM_OK;
}

/* ============================== HF config.json ============================== */

/* JSON accessors: a missing key or null is "absent"; any other wrong type is an error naming
 * the file and key. */
static tdm_status j_int(const json_t *o, const char *file, const char *k, bool required, int def,
                        int *out)
{
    const json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        if (required) return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is missing", file, k);
        *out = def;
        return TDM_OK;
    }
    if (!json_is_integer(v))
        return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is not an integer", file, k);
    json_int_t x = json_integer_value(v);
    if (x < INT_MIN || x > INT_MAX)
        return tdm_err_set(TDM_ERANGE, "%s: \"%s\" = %lld is out of range", file, k, (long long)x);
    *out = (int)x;
    return TDM_OK;
}

static tdm_status j_num(const json_t *o, const char *file, const char *k, bool required, float def,
                        float *out)
{
    const json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        if (required) return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is missing", file, k);
        *out = def;
        return TDM_OK;
    }
    if (!json_is_number(v)) return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is not a number", file, k);
    double d = json_number_value(v);
    if (!isfinite(d) || fabs(d) > 3.0e38)
        return tdm_err_set(TDM_ERANGE, "%s: \"%s\" = %g is out of range", file, k, d);
    *out = (float)d;
    return TDM_OK;
}

static tdm_status j_bool(const json_t *o, const char *file, const char *k, bool def, bool *out)
{
    const json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        *out = def;
        return TDM_OK;
    }
    if (!json_is_boolean(v))
        return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is not a boolean", file, k);
    *out = json_is_true(v);
    return TDM_OK;
}

static tdm_status j_str(const json_t *o, const char *file, const char *k, const char **out)
{
    const json_t *v = json_object_get(o, k);
    if (!v || json_is_null(v)) {
        *out = NULL;
        return TDM_OK;
    }
    if (!json_is_string(v)) return tdm_err_set(TDM_EFORMAT, "%s: \"%s\" is not a string", file, k);
    *out = json_string_value(v);
    return TDM_OK;
}

/* eos_token_id: an integer, a list of integers, or null. */
static tdm_status j_eos(const json_t *o, const char *file, struct tdm_model_config *c)
{
    const json_t *v = json_object_get(o, "eos_token_id");
    if (!v || json_is_null(v)) return TDM_OK;
    if (json_is_integer(v)) {
        json_int_t x = json_integer_value(v);
        if (x < 0 || x > INT_MAX)
            return tdm_err_set(TDM_ERANGE, "%s: eos_token_id %lld is out of range", file,
                               (long long)x);
        add_eos(c, (int)x);
        return TDM_OK;
    }
    if (!json_is_array(v))
        return tdm_err_set(TDM_EFORMAT, "%s: \"eos_token_id\" is not an integer or a list", file);
    size_t i;
    const json_t *e;
    json_array_foreach(v, i, e)
    {
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT_MAX)
            return tdm_err_set(TDM_EFORMAT, "%s: eos_token_id[%zu] is not a token id", file, i);
        add_eos(c, (int)json_integer_value(e));
    }
    return TDM_OK;
}

/* Parses one JSON object; `file` names it in errors. */
static tdm_status parse_json(const char *text, size_t len, const char *file, json_t **out)
{
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return tdm_err_set(TDM_EFORMAT, "%s: JSON error at line %d: %s", file, jerr.line,
                           jerr.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return tdm_err_set(TDM_EFORMAT, "%s: not a JSON object", file);
    }
    *out = root;
    return TDM_OK;
}

/* rope scaling from a rope_scaling / rope_parameters object (either spelling of the type). */
static tdm_status hf_rope_scaling(const json_t *rs, const char *file, struct tdm_model_config *c)
{
    const char *type = NULL;
    tdm_status rc = j_str(rs, file, "rope_type", &type);
    if (rc) return rc;
    if (!type && (rc = j_str(rs, file, "type", &type))) return rc;
    if (!type || !strcmp(type, "default")) return TDM_OK;
    if (!strcmp(type, "linear")) {
        c->rope_scaling = TDM_ROPE_SCALING_LINEAR;
        return j_num(rs, file, "factor", true, 1.0f, &c->rope_factor);
    }
    if (!strcmp(type, "yarn")) {
        /* DeepSeek's YaRN (its modeling files): the rotation's magnitude is
         * mscale(factor, mscale) / mscale(factor, mscale_all_dim), the softmax scale is
         * multiplied by mscale(factor, mscale_all_dim)^2, mscale(f, m) = 0.1 m ln f + 1 */
        float ms = 1.0f, ms_all = 0.0f;
        if (c->arch != TDM_ARCH_DEEPSEEK2)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "%s: yarn rope scaling is supported for deepseek_v2/v3 only", file);
        c->rope_scaling = TDM_ROPE_SCALING_YARN;
        if ((rc = j_num(rs, file, "factor", true, 1.0f, &c->rope_factor)) ||
            (rc = j_int(rs, file, "original_max_position_embeddings", true, 0,
                        &c->rope_original_max_ctx)) ||
            (rc = j_num(rs, file, "beta_fast", false, 32.0f, &c->rope_beta_fast)) ||
            (rc = j_num(rs, file, "beta_slow", false, 1.0f, &c->rope_beta_slow)) ||
            (rc = j_num(rs, file, "mscale", false, 1.0f, &ms)) ||
            (rc = j_num(rs, file, "mscale_all_dim", false, 0.0f, &ms_all)))
            return rc;
        double f = c->rope_factor;
        double m = f <= 1.0 ? 1.0 : 0.1 * ms * log(f) + 1.0;
        double m_all = f <= 1.0 ? 1.0 : 0.1 * ms_all * log(f) + 1.0;
        c->rope_mscale = (float)(m / m_all);
        if (ms_all != 0.0f) c->attn_scale = (float)(m_all * m_all);
        return TDM_OK;
    }
    if (!strcmp(type, "llama3")) {
        c->rope_scaling = TDM_ROPE_SCALING_LLAMA3;
        if ((rc = j_num(rs, file, "factor", true, 1.0f, &c->rope_factor)) ||
            (rc = j_num(rs, file, "low_freq_factor", true, 0, &c->rope_low_freq_factor)) ||
            (rc = j_num(rs, file, "high_freq_factor", true, 0, &c->rope_high_freq_factor)) ||
            (rc = j_int(rs, file, "original_max_position_embeddings", true, 0,
                        &c->rope_original_max_ctx)))
            return rc;
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED,
                       "%s: rope scaling type \"%.64s\" is not supported "
                       "(linear, llama3, yarn)",
                       file, type);
}

/* Experts: mixtral (num_local_experts, every layer sparse, renormalised top-k), qwen3_moe
 * (num_experts, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers)
 * and qwen2_moe (the same, and a gated shared expert of shared_expert_intermediate_size). */
static tdm_status hf_parse_moe(const json_t *root, const char *file, const char *mt,
                               struct tdm_model_config *c)
{
    tdm_status rc;
    if (!strcmp(mt, "mixtral")) {
        c->moe_norm_topk = true;
        if ((rc = j_int(root, file, "num_local_experts", true, 0, &c->n_experts)) ||
            (rc = j_int(root, file, "num_experts_per_tok", true, 0, &c->n_experts_used)) ||
            (rc = j_int(root, file, "intermediate_size", true, 0, &c->d_ff_expert)))
            return rc;
        if (c->n_experts < 1)
            return tdm_err_set(TDM_ERANGE, "%s: num_local_experts %d must be >= 1", file,
                               c->n_experts);
        return TDM_OK;
    }
    if (strcmp(mt, "qwen3_moe") && strcmp(mt, "qwen2_moe")) return TDM_OK;
    int step = 1;
    if (!strcmp(mt, "qwen2_moe") &&
        (rc = j_int(root, file, "shared_expert_intermediate_size", true, 0, &c->d_ff_shared)))
        return rc;
    if ((rc = j_int(root, file, "num_experts", true, 0, &c->n_experts)) ||
        (rc = j_int(root, file, "num_experts_per_tok", true, 0, &c->n_experts_used)) ||
        (rc = j_int(root, file, "moe_intermediate_size", true, 0, &c->d_ff_expert)) ||
        (rc = j_bool(root, file, "norm_topk_prob", false, &c->moe_norm_topk)) ||
        (rc = j_int(root, file, "decoder_sparse_step", false, 1, &step)))
        return rc;
    if (c->n_experts < 1)
        return tdm_err_set(TDM_ERANGE, "%s: num_experts %d must be >= 1", file, c->n_experts);
    if (step < 1)
        return tdm_err_set(TDM_ERANGE, "%s: decoder_sparse_step %d must be >= 1", file, step);
    int n_layers = 0;
    if ((rc = j_int(root, file, "num_hidden_layers", true, 0, &n_layers))) return rc;
    for (int l = 0; l < n_layers && l < 1024; l++) /* transformers: sparse when (l+1) % step == 0 */
        if ((l + 1) % step) c->moe_dense_layers[l / 64] |= 1ull << (l % 64);
    const json_t *only = json_object_get(root, "mlp_only_layers");
    if (only && !json_is_null(only)) {
        if (!json_is_array(only))
            return tdm_err_set(TDM_EFORMAT, "%s: \"mlp_only_layers\" is not a list", file);
        size_t i;
        const json_t *e;
        json_array_foreach(only, i, e)
        {
            json_int_t l = json_is_integer(e) ? json_integer_value(e) : -1;
            if (l < 0 || l >= n_layers || l >= 1024)
                return tdm_err_set(TDM_EFORMAT,
                                   "%s: mlp_only_layers[%zu] is not a layer index below %d", file,
                                   i, n_layers);
            c->moe_dense_layers[l / 64] |= 1ull << (l % 64);
        }
    }
    return TDM_OK;
}

/* DeepSeek-V2/V3 (deepseek_v2, deepseek_v3): MLA's ranks and head widths, and the experts:
 * n_routed_experts (null: dense), a layer sparse from first_k_dense_replace on where
 * l % moe_layer_freq == 0; scoring_func softmax (V2) or sigmoid (V3); topk_method greedy (no
 * groups), group_limited_greedy (V2: a group's best score) or noaux_tc (V3: its two best, with
 * e_score_correction_bias); routed_scaling_factor, which V2's modeling applies only to weights
 * it does not renormalise; n_shared_experts of moe_intermediate_size fused into one. */
static tdm_status hf_parse_deepseek(const json_t *root, const char *file, const char *mt,
                                    struct tdm_model_config *c)
{
    tdm_status rc;
    bool v3 = !strcmp(mt, "deepseek_v3");
    int n_layers = 0, shared = 0, first_dense = 0, freq = 1;
    const char *scoring = NULL, *method = NULL;
    if ((rc = j_int(root, file, "q_lora_rank", false, 0, &c->q_lora_rank)) ||
        (rc = j_int(root, file, "kv_lora_rank", true, 0, &c->kv_lora_rank)) ||
        (rc = j_int(root, file, "qk_nope_head_dim", true, 0, &c->qk_nope_dim)) ||
        (rc = j_int(root, file, "qk_rope_head_dim", true, 0, &c->qk_rope_dim)) ||
        (rc = j_int(root, file, "v_head_dim", true, 0, &c->v_head_dim)) ||
        (rc = j_int(root, file, "num_hidden_layers", true, 0, &n_layers)) ||
        (rc = j_int(root, file, "n_routed_experts", false, -1, &c->n_experts)) ||
        (rc = j_int(root, file, "num_nextn_predict_layers", false, 0, &c->n_mtp_layers)))
        return rc;
    if (c->n_mtp_layers < 0 || c->n_mtp_layers > 16)
        return tdm_err_set(TDM_ERANGE, "%s: num_nextn_predict_layers %d outside [0, 16]", file,
                           c->n_mtp_layers);
    if (c->kv_lora_rank <= 0)
        return tdm_err_set(TDM_ERANGE, "%s: kv_lora_rank %d must be >= 1", file, c->kv_lora_rank);
    if (c->n_experts == -1) { /* null or absent: a dense model */
        c->n_experts = 0;
        return TDM_OK;
    }
    if ((rc = j_int(root, file, "num_experts_per_tok", true, 0, &c->n_experts_used)) ||
        (rc = j_int(root, file, "moe_intermediate_size", true, 0, &c->d_ff_expert)) ||
        (rc = j_int(root, file, "n_shared_experts", false, 0, &shared)) ||
        (rc = j_int(root, file, "first_k_dense_replace", false, 0, &first_dense)) ||
        (rc = j_int(root, file, "moe_layer_freq", false, 1, &freq)) ||
        (rc = j_bool(root, file, "norm_topk_prob", false, &c->moe_norm_topk)) ||
        (rc = j_num(root, file, "routed_scaling_factor", false, 1.0f, &c->moe_routed_scale)) ||
        (rc = j_str(root, file, "scoring_func", &scoring)) ||
        (rc = j_str(root, file, "topk_method", &method)) ||
        (rc = j_int(root, file, "n_group", false, 0, &c->moe_n_group)) ||
        (rc = j_int(root, file, "topk_group", false, 0, &c->moe_topk_group)))
        return rc;
    if (c->n_experts < 1)
        return tdm_err_set(TDM_ERANGE, "%s: n_routed_experts %d must be >= 1", file, c->n_experts);
    if (!scoring) scoring = v3 ? "sigmoid" : "softmax";
    if (!method) method = v3 ? "noaux_tc" : "greedy";
    if (!strcmp(scoring, "sigmoid"))
        c->moe_scoring = TDM_MOE_SIGMOID;
    else if (strcmp(scoring, "softmax"))
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: scoring_func \"%.64s\" (softmax, sigmoid)", file,
                           scoring);
    if (!strcmp(method, "greedy")) {
        c->moe_n_group = c->moe_topk_group = 0;
    } else if (!strcmp(method, "group_limited_greedy") || !strcmp(method, "noaux_tc")) {
        c->moe_group_top2 = !strcmp(method, "noaux_tc");
        if (c->moe_n_group < 1)
            return tdm_err_set(TDM_ERANGE, "%s: topk_method %s needs n_group >= 1 (got %d)", file,
                               method, c->moe_n_group);
        if (c->moe_n_group == 1 && c->moe_topk_group >= 1) /* one group: every expert */
            c->moe_n_group = c->moe_topk_group = 0;
    } else {
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "%s: topk_method \"%.64s\" (greedy, group_limited_greedy, noaux_tc)",
                           file, method);
    }
    if (!v3 && c->moe_norm_topk) c->moe_routed_scale = 1.0f; /* V2 scales unnormalised only */
    if (shared < 0 || shared > 64)
        return tdm_err_set(TDM_ERANGE, "%s: n_shared_experts %d outside [0, 64]", file, shared);
    c->d_ff_shared = shared * c->d_ff_expert;
    if (freq < 1) return tdm_err_set(TDM_ERANGE, "%s: moe_layer_freq %d must be >= 1", file, freq);
    if (first_dense < 0)
        return tdm_err_set(TDM_ERANGE, "%s: first_k_dense_replace %d is negative", file,
                           first_dense);
    for (int l = 0; l < n_layers && l < 1024; l++)
        if (l < first_dense || l % freq) c->moe_dense_layers[l / 64] |= 1ull << (l % 64);
    return TDM_OK;
}

static tdm_status hf_parse_config(const json_t *root, const char *file, struct tdm_model_config *c)
{
    const char *mt = NULL, *act = NULL;
    tdm_status rc = j_str(root, file, "model_type", &mt);
    if (rc) return rc;
    if (!mt) return tdm_err_set(TDM_EFORMAT, "%s: \"model_type\" is missing", file);
    if (!strcmp(mt, "llama") || !strcmp(mt, "mistral") || !strcmp(mt, "mixtral"))
        c->arch = TDM_ARCH_LLAMA;
    else if (!strcmp(mt, "qwen2") || !strcmp(mt, "qwen2_moe"))
        c->arch = TDM_ARCH_QWEN2;
    else if (!strcmp(mt, "qwen3") || !strcmp(mt, "qwen3_moe"))
        c->arch = TDM_ARCH_QWEN3;
    else if (!strcmp(mt, "deepseek_v2") || !strcmp(mt, "deepseek_v3"))
        c->arch = TDM_ARCH_DEEPSEEK2;
    else
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "%s: model_type \"%.64s\" is not supported (llama, mistral, mixtral, "
                           "qwen2, qwen2_moe, qwen3, qwen3_moe, deepseek_v2, deepseek_v3)",
                           file, mt);
    const bool deepseek = c->arch == TDM_ARCH_DEEPSEEK2;
    if ((rc = deepseek ? hf_parse_deepseek(root, file, mt, c) : hf_parse_moe(root, file, mt, c)))
        return rc;

    if ((rc = j_int(root, file, "num_hidden_layers", true, 0, &c->n_layers)) ||
        (rc = j_int(root, file, "hidden_size", true, 0, &c->d_model)) ||
        (rc = j_int(root, file, "intermediate_size", true, 0, &c->d_ff)) ||
        (rc = j_int(root, file, "num_attention_heads", true, 0, &c->n_heads)) ||
        (rc = j_int(root, file, "num_key_value_heads", false, c->n_heads, &c->n_kv_heads)) ||
        (rc = j_int(root, file, "vocab_size", true, 0, &c->vocab_size)) ||
        (rc = j_int(root, file, "max_position_embeddings", false,
                    c->arch == TDM_ARCH_LLAMA ? 2048 : 32768, &c->max_ctx)) ||
        (rc = j_num(root, file, "rms_norm_eps", false, 1e-6f, &c->rms_eps)) ||
        (rc = j_bool(root, file, "tie_word_embeddings", false, &c->tied_embeddings)) ||
        (rc = j_int(root, file, "bos_token_id", false, -1, &c->bos_id)) ||
        (rc = j_eos(root, file, c)) || (rc = j_str(root, file, "hidden_act", &act)))
        return rc;
    if (c->n_heads <= 0)
        return tdm_err_set(TDM_ERANGE, "%s: num_attention_heads %d must be > 0", file, c->n_heads);
    const json_t *hd = json_object_get(root, "head_dim");
    if (deepseek) { /* the cached latent row, one "head" shared by every query head */
        c->head_dim = c->kv_lora_rank + c->qk_rope_dim;
        c->n_kv_heads = 1;
    } else if (hd && !json_is_null(hd)) {
        if ((rc = j_int(root, file, "head_dim", true, 0, &c->head_dim))) return rc;
    } else {
        if (c->d_model % c->n_heads)
            return tdm_err_set(TDM_EFORMAT,
                               "%s: hidden_size %d is not a multiple of num_attention_heads %d",
                               file, c->d_model, c->n_heads);
        c->head_dim = c->d_model / c->n_heads;
    }
    if (act && strcmp(act, "silu"))
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: hidden_act \"%.64s\" is not supported (silu)",
                           file, act);

    bool attn_bias = false, mlp_bias = false;
    float partial = 1.0f;
    if ((rc = j_bool(root, file, "attention_bias", false, &attn_bias)) ||
        (rc = j_bool(root, file, "mlp_bias", false, &mlp_bias)) ||
        (rc = j_num(root, file, "partial_rotary_factor", false, 1.0f, &partial)))
        return rc;
    if (c->arch == TDM_ARCH_QWEN2) {
        c->qkv_bias = true; /* qwen2 always has q/k/v biases and no output bias */
    } else if (attn_bias) {
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "%s: attention_bias (with an output projection bias) is not supported",
                           file);
    }
    if (mlp_bias) return tdm_err_set(TDM_EUNSUPPORTED, "%s: mlp_bias is not supported", file);
    if (partial != 1.0f)
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: partial_rotary_factor %g is not supported", file,
                           (double)partial);
    c->qk_norm = c->arch == TDM_ARCH_QWEN3;
    c->rope_neox = !deepseek; /* DeepSeek rotates interleaved pairs */

    /* rope: rope_parameters (transformers >= 5) or rope_theta + rope_scaling */
    const json_t *rp = json_object_get(root, "rope_parameters");
    const json_t *rs = json_object_get(root, "rope_scaling");
    if ((rc = j_num(root, file, "rope_theta", false, 10000.0f, &c->rope_theta))) return rc;
    if (rp && !json_is_null(rp)) {
        if (!json_is_object(rp))
            return tdm_err_set(TDM_EFORMAT, "%s: \"rope_parameters\" is not an object", file);
        if ((rc = j_num(rp, file, "rope_theta", false, c->rope_theta, &c->rope_theta)) ||
            (rc = hf_rope_scaling(rp, file, c)))
            return rc;
    } else if (rs && !json_is_null(rs)) {
        if (!json_is_object(rs))
            return tdm_err_set(TDM_EFORMAT, "%s: \"rope_scaling\" is not an object", file);
        if ((rc = hf_rope_scaling(rs, file, c))) return rc;
    }

    /* mistral's sliding window: we attend to the whole context */
    int window = 0;
    if ((rc = j_int(root, file, "sliding_window", false, 0, &window))) return rc;
    bool use_window = c->arch == TDM_ARCH_LLAMA;
    if (c->arch != TDM_ARCH_LLAMA &&
        (rc = j_bool(root, file, "use_sliding_window", false, &use_window)))
        return rc;
    if (use_window && window > 0 && window < c->max_ctx)
        TDM_WARN("%s: sliding_window %d is ignored (full attention is used)", file, window);
    return TDM_OK;
}

static tdm_status hf_parse_generation(const json_t *root, const char *file,
                                      struct tdm_model_config *c)
{
    tdm_status rc;
    int bos = -1;
    if ((rc = j_num(root, file, "temperature", false, NAN, &c->gen_temperature)) ||
        (rc = j_num(root, file, "top_p", false, NAN, &c->gen_top_p)) ||
        (rc = j_int(root, file, "top_k", false, -1, &c->gen_top_k)) ||
        (rc = j_int(root, file, "bos_token_id", false, -1, &bos)) || (rc = j_eos(root, file, c)))
        return rc;
    if (c->bos_id < 0) c->bos_id = bos;
    return TDM_OK;
}

static bool file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

tdm_status tdm_config_from_hf_text(const char *config, size_t config_len, const char *gen,
                                   size_t gen_len, const char *where, struct tdm_model_config *cfg)
{
    if (!config || !cfg || !where)
        return tdm_err_set(TDM_EINVAL, "tdm_config_from_hf_text: bad args");
    if (config_len > TDM_HF_MAX_CONFIG_BYTES || (gen && gen_len > TDM_HF_MAX_CONFIG_BYTES))
        return tdm_err_set(TDM_EFORMAT, "%s: a config over %u bytes", where,
                           TDM_HF_MAX_CONFIG_BYTES);
    struct tdm_model_config c;
    tdm_config_defaults(&c);
    char file[512];
    snprintf(file, sizeof file, "%s/config.json", where);
    json_t *root = NULL;
    tdm_status rc = parse_json(config, config_len, file, &root);
    if (rc) return rc;
    rc = hf_parse_config(root, file, &c);
    json_decref(root);
    if (rc) return rc;
    if (gen) {
        snprintf(file, sizeof file, "%s/generation_config.json", where);
        if ((rc = parse_json(gen, gen_len, file, &root))) return rc;
        rc = hf_parse_generation(root, file, &c);
        json_decref(root);
        if (rc) return rc;
    }
    if ((rc = config_check(&c, where))) return rc;
    *cfg = c;
    return TDM_OK;
}

tdm_status tdm_config_from_hf(const char *dir, struct tdm_model_config *cfg)
{
    if (!dir || !cfg) return tdm_err_set(TDM_EINVAL, "tdm_config_from_hf: bad args");
    char path[4096];
    char *config = NULL, *gen = NULL;
    size_t config_len = 0, gen_len = 0;
    snprintf(path, sizeof path, "%s/config.json", dir);
    tdm_status rc = tdm_file_read(path, TDM_HF_MAX_CONFIG_BYTES, &config, &config_len);
    if (rc) return rc;
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    if (file_exists(path) && (rc = tdm_file_read(path, TDM_HF_MAX_CONFIG_BYTES, &gen, &gen_len))) {
        free(config);
        return rc;
    }
    rc = tdm_config_from_hf_text(config, config_len, gen, gen_len, dir, cfg);
    free(config);
    free(gen);
    return rc;
}
