/*
 * tandem model: file formats (GGUF, safetensors), dequantisation, model configuration and the
 * weight set that the engine runs.
 *
 * Ownership: a tdm_gguf_t or tdm_st_t owns its memory maps; every pointer it hands out
 * (tensor data, strings, arrays) lives until it is closed. A tdm_model owns its source file
 * handle and any buffers created at load (dequantised or converted weights); weight data
 * pointers live until tdm_model_free.
 *
 * Validation: every byte read from a file is checked (offsets, sizes, counts, string lengths,
 * overflow in shape products) before use. Bad bytes give TDM_EFORMAT and a message through
 * tdm_err_set(), never a crash.
 *
 * Threading: loading is single-threaded; a loaded tdm_model and tdm_gguf_t are read-only and
 * may be shared between threads.
 */
#ifndef TANDEM_MODEL_H
#define TANDEM_MODEL_H

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types: values are GGML's type ids, as stored in GGUF ---- */
enum tdm_dtype {
    TDM_DTYPE_F32 = 0,
    TDM_DTYPE_F16 = 1,
    TDM_DTYPE_Q4_0 = 2,
    TDM_DTYPE_Q4_1 = 3,
    TDM_DTYPE_Q5_0 = 6,
    TDM_DTYPE_Q5_1 = 7,
    TDM_DTYPE_Q8_0 = 8,
    TDM_DTYPE_Q8_1 = 9,
    TDM_DTYPE_Q2_K = 10,
    TDM_DTYPE_Q3_K = 11,
    TDM_DTYPE_Q4_K = 12,
    TDM_DTYPE_Q5_K = 13,
    TDM_DTYPE_Q6_K = 14,
    TDM_DTYPE_Q8_K = 15,
    TDM_DTYPE_BF16 = 30,
    TDM_DTYPE_COUNT = 40,
};

/* Block geometry: elements per block and bytes per block. 0 for an unknown type. */
int64_t tdm_dtype_block_elems(enum tdm_dtype t);
size_t tdm_dtype_block_bytes(enum tdm_dtype t);
const char *tdm_dtype_name(enum tdm_dtype t); /* "q4_1", ... or "unknown" */
bool tdm_dtype_known(int t);
/* Bytes of a row of n elements; 0 when n is not a multiple of the block size. */
size_t tdm_dtype_row_bytes(enum tdm_dtype t, int64_t n);
/* Dequantises n elements (a multiple of the block size) to f32. TDM_EUNSUPPORTED for types
 * without a dequantiser. Supported: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K. */
tdm_status tdm_dequantize(enum tdm_dtype t, const void *src, float *dst, int64_t n);

/* A tensor as stored in a file. ne[0] is the fastest-moving (contiguous) dimension, as in GGUF;
 * for a matrix of `rows` outputs and `cols` inputs, ne[0] = cols and ne[1] = rows. Tensors
 * from safetensors are reported the same way (their shape reversed). */
struct tdm_tensor_info {
    const char *name;
    enum tdm_dtype dtype;
    int n_dims;
    int64_t ne[4]; /* unused dims are 1 */
    const void *data;
    size_t nbytes;
};

/* ---- GGUF (v2 and v3), memory-mapped ---- */
typedef struct tdm_gguf tdm_gguf_t;

enum tdm_gguf_type {
    TDM_GGUF_U8 = 0,
    TDM_GGUF_I8 = 1,
    TDM_GGUF_U16 = 2,
    TDM_GGUF_I16 = 3,
    TDM_GGUF_U32 = 4,
    TDM_GGUF_I32 = 5,
    TDM_GGUF_F32 = 6,
    TDM_GGUF_BOOL = 7,
    TDM_GGUF_STRING = 8,
    TDM_GGUF_ARRAY = 9,
    TDM_GGUF_U64 = 10,
    TDM_GGUF_I64 = 11,
    TDM_GGUF_F64 = 12,
};

/* A string inside the mapped file: NOT NUL-terminated. */
struct tdm_str {
    const char *ptr;
    size_t len;
};

tdm_status tdm_gguf_open(const char *path, tdm_gguf_t **out);
/* Parses an in-memory image (the fuzz target uses this). `data` must outlive the handle. */
tdm_status tdm_gguf_open_memory(const void *data, size_t size, tdm_gguf_t **out);
void tdm_gguf_close(tdm_gguf_t *g);
uint32_t tdm_gguf_version(const tdm_gguf_t *g);

int64_t tdm_gguf_n_kv(const tdm_gguf_t *g);
struct tdm_str tdm_gguf_kv_key(const tdm_gguf_t *g, int64_t i);
enum tdm_gguf_type tdm_gguf_kv_type(const tdm_gguf_t *g, int64_t i);
/* Index of a key, or -1. */
int64_t tdm_gguf_find(const tdm_gguf_t *g, const char *key);
/* Typed scalar getters. TDM_ENOTFOUND if absent; TDM_EFORMAT if the stored type does not
 * convert losslessly (any integer type converts to another if the value fits; f32/f64 to
 * float). */
tdm_status tdm_gguf_get_i64(const tdm_gguf_t *g, const char *key, int64_t *out);
tdm_status tdm_gguf_get_f32(const tdm_gguf_t *g, const char *key, float *out);
tdm_status tdm_gguf_get_bool(const tdm_gguf_t *g, const char *key, bool *out);
tdm_status tdm_gguf_get_str(const tdm_gguf_t *g, const char *key, struct tdm_str *out);
/* Arrays: element type and count. For numeric arrays `data` points at the packed little-endian
 * elements in the map; for string arrays use tdm_gguf_get_arr_str. */
tdm_status tdm_gguf_get_arr(const tdm_gguf_t *g, const char *key, enum tdm_gguf_type *elem_type,
                            int64_t *n, const void **data);
tdm_status tdm_gguf_get_arr_str(const tdm_gguf_t *g, const char *key, int64_t i,
                                struct tdm_str *out);

int64_t tdm_gguf_n_tensors(const tdm_gguf_t *g);
const struct tdm_tensor_info *tdm_gguf_tensor(const tdm_gguf_t *g, int64_t i);
const struct tdm_tensor_info *tdm_gguf_find_tensor(const tdm_gguf_t *g, const char *name);

/* ---- safetensors: one file, or a folder with model.safetensors(.index.json) ---- */
typedef struct tdm_st tdm_st_t;
/* `path` is a .safetensors file or a folder holding model.safetensors or a sharded
 * model.safetensors.index.json. Supported dtypes: F32, F16, BF16 (others: TDM_EUNSUPPORTED
 * when that tensor is looked up, so a checkpoint can carry extra tensors we never read). */
tdm_status tdm_st_open(const char *path, tdm_st_t **out);
tdm_status tdm_st_open_memory(const void *data, size_t size, tdm_st_t **out); /* one file */
void tdm_st_close(tdm_st_t *st);
int64_t tdm_st_n_tensors(const tdm_st_t *st);
const struct tdm_tensor_info *tdm_st_tensor(const tdm_st_t *st, int64_t i);
const struct tdm_tensor_info *tdm_st_find_tensor(const tdm_st_t *st, const char *name);
/* A string of the first file's "__metadata__", or NULL; valid while st is open. */
const char *tdm_st_metadata(const tdm_st_t *st, const char *key);
/* One tensor for tdm_st_write: shape as the file lists it (outermost first). */
struct tdm_st_out {
    const char *name;
    const char *dtype; /* the format's spelling: "F32", "BF16", "F16", "I64", "I32", ... */
    int n_dims;
    int64_t shape[4];
    const void *data;
    size_t nbytes; /* must equal the shape's product times the dtype's width */
};
/* Writes a safetensors file: the tensors in order, and meta (n_meta key/value pairs, flat:
 * key0, value0, key1, ...) as "__metadata__". Through a temporary file and a rename, so a
 * reader never sees half a file. TDM_EINVAL for a bad tensor, TDM_EIO with the reason. */
tdm_status tdm_st_write(const char *path, const struct tdm_st_out *t, int n,
                        const char *const *meta, int n_meta);

/* ---- model configuration ---- */
enum tdm_arch { TDM_ARCH_LLAMA = 0, TDM_ARCH_QWEN2, TDM_ARCH_QWEN3, TDM_ARCH_DEEPSEEK2 };
enum tdm_rope_scaling {
    TDM_ROPE_SCALING_NONE = 0,
    TDM_ROPE_SCALING_LINEAR,
    TDM_ROPE_SCALING_LLAMA3,
    TDM_ROPE_SCALING_YARN /* DeepSeek's: rope_factor, rope_original_max_ctx, beta_fast/slow */
};
/* How a router turns its logits into expert scores. */
enum tdm_moe_scoring { TDM_MOE_SOFTMAX = 0, TDM_MOE_SIGMOID };

#define TDM_MAX_EOS 8

struct tdm_model_config {
    enum tdm_arch arch;
    int n_layers;
    int d_model;
    int n_heads;
    int n_kv_heads;
    int head_dim; /* explicit (qwen3) or d_model / n_heads */
    int d_ff;
    int vocab_size;
    int max_ctx; /* context length the model was trained for */
    float rms_eps;
    float rope_theta;
    /* true: rotate pairs (i, i + head_dim/2) (HF rotate_half, "NEOX"); false: rotate adjacent
     * pairs (2i, 2i+1), as llama.cpp's GGUF llama files expect after their Q/K permutation. */
    bool rope_neox;
    enum tdm_rope_scaling rope_scaling;
    float rope_factor;           /* linear and llama3 */
    float rope_low_freq_factor;  /* llama3 */
    float rope_high_freq_factor; /* llama3 */
    int rope_original_max_ctx;   /* llama3 */
    bool tied_embeddings;        /* lm_head is the token embedding */
    bool qkv_bias;               /* qwen2 */
    bool qk_norm;                /* qwen3 per-head RMSNorm on q and k */
    int bos_id;                  /* -1 if none */
    int eos_ids[TDM_MAX_EOS];
    int n_eos;
    /* generation_config.json defaults (NaN / -1 when absent) */
    float gen_temperature, gen_top_p;
    int gen_top_k;
    /* Mixture of experts (qwen3_moe, mixtral; GGUF qwen3moe and llama with experts): 0 experts
     * for a dense model. A sparse layer's FFN is a router (softmax over the experts' logits,
     * the top n_experts_used kept, renormalised to sum 1 when moe_norm_topk) and that many
     * SwiGLU experts of width d_ff_expert, their outputs summed with the router's weights. A
     * layer is sparse unless moe_dense_layers has its bit (Qwen's decoder_sparse_step and
     * mlp_only_layers); dense layers are the plain FFN of width d_ff. */
    int n_experts, n_experts_used, d_ff_expert;
    bool moe_norm_topk;
    /* a shared expert every token takes (qwen2_moe, deepseek2): a SwiGLU FFN of width
     * d_ff_shared added to the routed sum, scaled by sigmoid(h . shared gate) where the layer
     * has one (qwen2_moe); 0: none */
    int d_ff_shared;
    uint64_t moe_dense_layers[16]; /* bit l: layer l is dense (n_layers <= 1024) */
    /* DeepSeek's routers (deepseek_v2, deepseek_v3): scores by softmax or sigmoid; experts
     * chosen by score plus the layer's correction bias (router_bias, V3) within the
     * moe_topk_group best of moe_n_group groups (a group's worth: its best score, or with
     * moe_group_top2 the sum of its two best (V3)); the chosen scores (without the bias)
     * renormalised when moe_norm_topk, then multiplied by moe_routed_scale. Shared experts
     * (d_ff_shared wide, n_shared_experts of them fused) have no gate. */
    enum tdm_moe_scoring moe_scoring;
    int moe_n_group, moe_topk_group; /* 0: no groups */
    bool moe_group_top2;
    float moe_routed_scale; /* 1 unless said */
    /* Multi-head latent attention (deepseek2; kv_lora_rank > 0): q = h Wq or, with a q LoRA,
     * q_b(rmsnorm(h q_a)); each head's q is qk_nope + qk_rope wide. The KV cache holds one row
     * per token, the compressed latent (kv_lora_rank) then the rope key (qk_rope), which is
     * head_dim = kv_lora_rank + qk_rope_dim with n_kv_heads = 1; values are v_head_dim wide per
     * head after the up-projection. */
    int q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim;
    /* YaRN: rope_factor, rope_original_max_ctx, and these; cos and sin are multiplied by
     * rope_mscale (1 unless the config's mscale and mscale_all_dim differ) */
    float rope_beta_fast, rope_beta_slow, rope_mscale;
    /* the softmax scale: attn_scale / sqrt(qk head dim) (1: none; YaRN's mscale_all_dim^2) */
    float attn_scale;
    /* DeepSeek-V3's multi-token prediction layers, stored after the model's own in its files
     * (num_nextn_predict_layers): the first is a speculation head (tdm_head_load of the
     * model's own folder) */
    int n_mtp_layers;
};

static inline bool tdm_config_mla(const struct tdm_model_config *c)
{
    return c->kv_lora_rank > 0;
}
/* The dimensions each head rotates: all of head_dim, or MLA's rope part. */
static inline int tdm_config_rope_dim(const struct tdm_model_config *c)
{
    return tdm_config_mla(c) ? c->qk_rope_dim : c->head_dim;
}
/* Whether layer l of a model with this config has experts. */
static inline bool tdm_config_layer_sparse(const struct tdm_model_config *c, int l)
{
    return c->n_experts > 0 && l >= 0 && l < 1024 && !(c->moe_dense_layers[l / 64] >> (l % 64) & 1);
}

/* A config's defaults before any source is read: every field 0 but the neutral factors (rope,
 * attention and routing scales 1), rope theta 10000, no BOS, and no generation defaults. */
void tdm_config_defaults(struct tdm_model_config *c);
/* Reads the config of a GGUF model (general.architecture and <arch>.* keys). */
tdm_status tdm_config_from_gguf(const tdm_gguf_t *g, struct tdm_model_config *cfg);
/* Reads config.json (and generation_config.json if present) of a HF checkpoint folder.
 * Accepts rope_theta at top level or in rope_parameters; llama3 and linear rope scaling. */
tdm_status tdm_config_from_hf(const char *dir, struct tdm_model_config *cfg);
/* The same from the files' text: `gen` (generation_config.json) may be NULL; `where` names the
 * folder in error messages. */
tdm_status tdm_config_from_hf_text(const char *config, size_t config_len, const char *gen,
                                   size_t gen_len, const char *where, struct tdm_model_config *cfg);
const char *tdm_arch_name(enum tdm_arch a);

/* ---- weights ----
 * A matrix of `rows` outputs by `cols` inputs, row-major: row r is tdm_dtype_row_bytes(dtype,
 * cols) bytes at data + r * row_bytes. dtype is one the CPU kernels run directly (F32, BF16,
 * Q8_0, Q4_0, Q4_1); anything else was dequantised to F32 at load. Vectors (norms, biases)
 * are always F32 with rows = 1. */
struct tdm_weight {
    enum tdm_dtype dtype;
    int64_t rows;
    int64_t cols;
    size_t row_bytes;
    const void *data;
};

struct tdm_layer_weights {
    struct tdm_weight attn_norm;      /* [d_model] */
    struct tdm_weight wq;             /* [n_heads*head_dim][d_model] */
    struct tdm_weight wk;             /* [n_kv_heads*head_dim][d_model] */
    struct tdm_weight wv;             /* [n_kv_heads*head_dim][d_model] */
    struct tdm_weight bq, bk, bv;     /* qwen2 biases, data NULL otherwise */
    struct tdm_weight q_norm, k_norm; /* qwen3 [head_dim], data NULL otherwise */
    struct tdm_weight wo;             /* [d_model][n_heads*head_dim] */
    struct tdm_weight ffn_norm;       /* [d_model] */
    struct tdm_weight w_gate;         /* [d_ff][d_model] (dense layers) */
    struct tdm_weight w_up;           /* [d_ff][d_model] */
    struct tdm_weight w_down;         /* [d_model][d_ff] */
    /* a sparse layer (tdm_config_layer_sparse): the router and its experts, in place of the
     * three matrices above (data NULL then) */
    int n_experts;              /* 0: dense */
    struct tdm_weight router;   /* [n_experts][d_model] */
    struct tdm_weight *experts; /* [n_experts][3]: gate [d_ff_expert][d_model], up (same),
                                 * down [d_model][d_ff_expert] */
    /* the shared expert (cfg.d_ff_shared): gate, up, down like an expert's at its width, and
     * its gate [1][d_model]; data NULL without */
    struct tdm_weight sh_gate, sh_up, sh_down, sh_score;
    struct tdm_weight router_bias; /* [n_experts] F32: DeepSeek-V3's e_score_correction_bias */
    /* MLA (cfg.kv_lora_rank > 0; wq, wk, wv and the biases unused, wq data NULL with a q
     * LoRA): wq_a [q_lora][d_model], q_a_norm [q_lora], wq_b [n_heads * (nope + rope)][q_lora];
     * kv_a's two row blocks: wkv_c [kv_lora][d_model] (the latent), wkv_r [rope][d_model] (the
     * rope key); kv_a_norm [kv_lora]; and from kv_b, made at load (F32): absorb [n_heads *
     * (kv_lora + rope)][nope + rope], per head the transpose of kv_b's key rows (q_nope to the
     * latent space) beside the identity over the rope part, and uv [n_heads * v][kv_lora], per
     * head kv_b's value rows. wo is [d_model][n_heads * v]. */
    struct tdm_weight wq_a, q_a_norm, wq_b, wkv_c, wkv_r, kv_a_norm, mla_absorb, mla_uv;
};

/* A speculation head (spec.h: mtp, eagle): a one-layer draft fed with the target's hidden
 * states. Its input for the token t(i+1) and the target's hidden state h(i) (the final-normed
 * state the target's LM head reads, at position i) is
 *     x = fc([enorm(embed(t(i+1))), hnorm(h(i))]) (+ fc_bias)
 * (fc: [d_model][2 d_model], held as its two column halves), then one decoder layer of the
 * target's architecture at position i, then the head's final norm and the target's LM head:
 * its logits propose t(i+2). A head model is a struct tdm_model with n_layers 1 whose head
 * points here; its tok_embd and output are the target's (borrowed: the target must outlive
 * it). Norms a layout lacks have data NULL: EAGLE's heads normalise neither input, and have
 * no input norm on their layer and no final norm.
 *
 * EAGLE-3 (TDM_HEAD_EAGLE3) differs: its target feature is the residual stream entering three
 * target layers (aux_layers: low, middle, high), concatenated ([3 d_model]), and its input is
 *     h    = fc_h(feature) (+ fc_bias)        fc_h: [d_model][3 d_model]; on deeper drafts h is
 *                                             the head's own pre-norm state of the row before
 *     a    = [enorm(embed(t(i+1))), hnorm(h)]  [2 d_model]: the layer's q/k/v read a (their
 *                                             columns for the embedding in the layer's wq, wk,
 *                                             wv; for hnorm(h) in wq_h, wk_h, wv_h)
 *     x    = h + o_proj(attention(a)) ; x += mlp(ffn_norm(x))
 * with the residual h, not a; its final norm and its own LM head (`output`, over its draft
 * vocabulary) give the logits, and x before the final norm is what it feeds itself. */
enum tdm_head_layout {
    TDM_HEAD_TANDEM = 0,   /* ours (docs/HEADS.md) */
    TDM_HEAD_EAGLE,        /* EAGLE(-2): fc (with a bias), one layer without its input norm */
    TDM_HEAD_DEEPSEEK_MTP, /* DeepSeek-V3's MTP layer names: enorm, hnorm, eh_proj, shared_head */
    TDM_HEAD_EAGLE3,       /* EAGLE-3: fused low/middle/high features, midlayer.*, its LM head */
};
#define TDM_HEAD_MAX_AUX 3 /* the target layers an EAGLE-3 head's feature fuses */
struct tdm_head {
    enum tdm_head_layout layout;
    struct tdm_weight enorm, hnorm; /* [d_model]; data NULL: that input is not normalised */
    struct tdm_weight fc_e, fc_h;   /* [d_model][d_model]: fc's columns for each input (EAGLE-3:
                                     * fc_e none, fc_h [d_model][feature_width] the whole fc) */
    struct tdm_weight fc_bias;      /* [d_model]; data NULL: none */
    /* A reduced draft vocabulary (its d2t map): the head's LM head (the model's `output`) has
     * n_draft rows, draft token i being target token d2t[i] (ascending); its logits are placed
     * in the target's vocabulary, -inf elsewhere. NULL / 0: the whole vocabulary. */
    const int32_t *d2t;
    int n_draft;
    /* The target feature's width: d_model, or n_aux * d_model (EAGLE-3). aux_layers: EAGLE-3's
     * target layers whose input (the residual stream entering them) makes the feature, in
     * order; n_aux 0 for the other layouts (the final-normed state). */
    int feature_width;
    int aux_layers[TDM_HEAD_MAX_AUX];
    int n_aux;
    /* EAGLE-3: the q/k/v projections' columns that read hnorm(h) ([rows][d_model] each) */
    struct tdm_weight wq_h, wk_h, wv_h;
};
const char *tdm_head_layout_name(enum tdm_head_layout l); /* "tandem", "eagle", "deepseek-mtp",
                                                           * "eagle3" */

struct tdm_model {
    struct tdm_model_config cfg;
    struct tdm_head *head;            /* a speculation head's input stage, else NULL */
    struct tdm_weight tok_embd;       /* [vocab][d_model] */
    struct tdm_weight output_norm;    /* [d_model] */
    struct tdm_weight output;         /* [vocab][d_model]; same data as tok_embd when tied */
    struct tdm_layer_weights *layers; /* [n_layers] */
    const float *rope_freqs;          /* GGUF rope_freqs.weight [rope dim/2] factors, or NULL */
    char *path;                       /* what was loaded */
    bool is_gguf;
    tdm_gguf_t *gguf;    /* the GGUF source, or NULL */
    tdm_st_t *st;        /* the safetensors source, or NULL */
    char *chat_template; /* from GGUF metadata or tokenizer_config.json; may be NULL */
    void **owned;        /* buffers made at load (dequantised weights) */
    int n_owned, cap_owned;
    uint64_t n_params;
    uint64_t weight_bytes; /* bytes of all weights as held in memory */
};

typedef void (*tdm_progress_fn)(void *ctx, double fraction);

/* Loads a .gguf file or a HF checkpoint folder. `progress` (may be NULL) is called as tensors
 * are prepared. On success the caller owns *out and frees it with tdm_model_free. */
tdm_status tdm_model_load(const char *path, tdm_progress_fn progress, void *progress_ctx,
                          struct tdm_model **out);
/* What a loader keeps as the file has it. By default GGUF matrices of the types the CPU kernels
 * run (F32, BF16, Q8_0, Q4_0, Q4_1) are used in place and every other type becomes F32. */
struct tdm_load_opts {
    bool keep_k_blocks; /* Q4_K and Q6_K matrices stay in their blocks too (for the CUDA backend,
                         * and the CPU backend's quantised activations, which run them there;
                         * its fp32 kernels take them only through a slow portable tile) */
};
tdm_status tdm_model_load_opts(const char *path, const struct tdm_load_opts *opts,
                               tdm_progress_fn progress, void *progress_ctx,
                               struct tdm_model **out);
/* Aligned memory that m owns from now on (freed by tdm_model_free): for whoever builds a model
 * or a view of one (the loader, a tensor-parallel shard, a benchmark's random model).
 * TDM_ENOMEM with a message. */
tdm_status tdm_model_alloc_owned(struct tdm_model *m, size_t bytes, void **out);
/* Opens a checkpoint for its text side only: its config, chat template, and what a tokenizer
 * reads (the GGUF file's metadata, the HF folder's path); no weights are loaded (layers is
 * NULL). For a process that tokenizes as a server would without running the model (the
 * router's KV-aware routing). Free with tdm_model_free. */
tdm_status tdm_model_open_text(const char *path, struct tdm_model **out);
void tdm_model_free(struct tdm_model *m);
/* Loads a speculation head for `target` from a safetensors file (or a folder holding
 * model.safetensors) in any tdm_head_layout, telling the layout by its tensor names. A head
 * that does not fit its target (d_model, head_dim, vocabulary of a shared head copy) or needs
 * what tandem does not run (MLA, experts) is refused with a message naming both sides. The
 * result borrows the target's embeddings and LM head: free it (tdm_model_free) first. */
tdm_status tdm_head_load(const char *path, const struct tdm_model *target, struct tdm_model **out);
/* The default head of a model file: beside it, its name's extension (.gguf, or none for a
 * folder) replaced by .mtp.safetensors. false when it does not fit. */
bool tdm_default_head_path(const char *model_path, char *buf, size_t cap);

/* Default model: $TANDEM_MODEL if set, else
 * ${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf.
 * Writes the path into buf; false if it does not fit. */
bool tdm_default_model_path(char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_MODEL_H */
