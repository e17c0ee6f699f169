/*
 * `tandem info`: a model's configuration, tensor types, parameter and byte counts, tokenizer and
 * chat template, as text or (--json) one JSON object.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tools/tools_int.h"

static const char *scaling_name(enum tdm_rope_scaling s)
{
    switch (s) {
    case TDM_ROPE_SCALING_NONE:
        return "none";
    case TDM_ROPE_SCALING_LINEAR:
        return "linear";
    case TDM_ROPE_SCALING_LLAMA3:
        return "llama3";
    case TDM_ROPE_SCALING_YARN:
        return "yarn";
    }
    return "?";
}

static void info_usage(FILE *f)
{
    fprintf(f, "usage: tandem info [--model PATH] [--json]\n");
}

int tdm_cmd_info(int argc, char **argv)
{
    const char *model = NULL;
    bool json = false;
    const struct tdm_opt own[] = {TDM_OPT_S("model", &model), TDM_OPT_B("json", &json),
                                  TDM_OPT_END};
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("info", argc, argv, tables, info_usage);
    if (prc) return prc == 1 ? 0 : 2;
    struct tdm_model *m = tdm_tool_load_model(model);
    if (!m) return 1;
    const struct tdm_model_config *cf = &m->cfg;

    /* tensor types as stored in the file, and as held in memory */
    int64_t file_types[TDM_DTYPE_COUNT] = {0};
    int64_t n_tensors = m->gguf ? tdm_gguf_n_tensors(m->gguf) : tdm_st_n_tensors(m->st);
    for (int64_t i = 0; i < n_tensors; i++) {
        const struct tdm_tensor_info *ti =
            m->gguf ? tdm_gguf_tensor(m->gguf, i) : tdm_st_tensor(m->st, i);
        if (ti && (int)ti->dtype >= 0 && ti->dtype < TDM_DTYPE_COUNT) file_types[ti->dtype]++;
    }
    tdm_tok_t *tok = tdm_tool_load_tokenizer(m, true);
    struct tdm_chat_template tmpl = {0};
    const char *chat = "none";
    if (tdm_chat_template_detect(m->chat_template, &tmpl) == TDM_OK)
        chat = tmpl.format == TDM_CHAT_CHATML   ? "chatml"
               : tmpl.format == TDM_CHAT_LLAMA3 ? "llama3"
                                                : "raw";

    int rc = 0;
    /* experts: how many layers have them, and what their weights take */
    int sparse = 0;
    uint64_t one_expert = 0;
    const uint64_t expert_bytes = tdm_tool_expert_bytes(m, &sparse, &one_expert);
    if (json) {
        json_t *types = json_object();
        for (int t = 0; t < TDM_DTYPE_COUNT; t++)
            if (file_types[t])
                json_object_set_new(types, tdm_dtype_name(t), json_integer(file_types[t]));
        json_t *obj = json_pack(
            "{s:s, s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:b, s:s, s:b, s:b,"
            " s:b, s:I, s:I, s:I, s:s, s:s, s:o}",
            "path", m->path, "format", m->gguf ? "gguf" : "safetensors", "arch",
            tdm_arch_name(cf->arch), "n_layers", cf->n_layers, "d_model", cf->d_model, "n_heads",
            cf->n_heads, "n_kv_heads", cf->n_kv_heads, "head_dim", cf->head_dim, "d_ff", cf->d_ff,
            "vocab_size", cf->vocab_size, "max_ctx", cf->max_ctx, "rms_eps", (double)cf->rms_eps,
            "rope_theta", (double)cf->rope_theta, "rope_neox", cf->rope_neox, "rope_scaling",
            scaling_name(cf->rope_scaling), "tied_embeddings", cf->tied_embeddings, "qkv_bias",
            cf->qkv_bias, "qk_norm", cf->qk_norm, "n_params", (json_int_t)m->n_params,
            "weight_bytes", (json_int_t)m->weight_bytes, "n_tensors", (json_int_t)n_tensors,
            "chat_template", chat, "tokenizer",
            !tok                               ? "none"
            : tdm_tok_kind(tok) == TDM_TOK_SPM ? "spm"
                                               : "bpe",
            "tensor_types", types);
        if (obj && cf->n_experts) {
            json_object_set_new(obj, "n_experts", json_integer(cf->n_experts));
            json_object_set_new(obj, "n_experts_used", json_integer(cf->n_experts_used));
            json_object_set_new(obj, "d_ff_expert", json_integer(cf->d_ff_expert));
            json_object_set_new(obj, "moe_norm_topk", json_boolean(cf->moe_norm_topk));
            json_object_set_new(obj, "sparse_layers", json_integer(sparse));
            json_object_set_new(obj, "expert_weight_bytes", json_integer((json_int_t)expert_bytes));
            json_object_set_new(
                obj, "moe_scoring",
                json_string(cf->moe_scoring == TDM_MOE_SIGMOID ? "sigmoid" : "softmax"));
            json_object_set_new(obj, "moe_groups", json_integer(cf->moe_n_group));
            json_object_set_new(obj, "moe_groups_used", json_integer(cf->moe_topk_group));
            json_object_set_new(obj, "moe_routed_scale", json_real(cf->moe_routed_scale));
            json_object_set_new(obj, "d_ff_shared", json_integer(cf->d_ff_shared));
        }
        if (obj && tdm_config_mla(cf)) {
            json_t *mla =
                json_pack("{s:i, s:i, s:i, s:i, s:i}", "q_lora_rank", cf->q_lora_rank,
                          "kv_lora_rank", cf->kv_lora_rank, "qk_nope_head_dim", cf->qk_nope_dim,
                          "qk_rope_head_dim", cf->qk_rope_dim, "v_head_dim", cf->v_head_dim);
            json_object_set_new(obj, "mla", mla);
        }
        /* json_pack fails only on invalid UTF-8 (a path with such bytes) or out of memory */
        char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
        if (text)
            printf("%s\n", text);
        else
            fprintf(stderr, "tandem: cannot encode the model info as JSON\n");
        free(text);
        json_decref(obj);
        if (!text) rc = 1;
    } else {
        printf("model        %s (%s)\n", m->path, m->gguf ? "GGUF" : "safetensors");
        printf("arch         %s\n", tdm_arch_name(cf->arch));
        printf("layers       %d\n", cf->n_layers);
        printf("d_model      %d\n", cf->d_model);
        printf("heads        %d query, %d kv, head_dim %d\n", cf->n_heads, cf->n_kv_heads,
               cf->head_dim);
        if (tdm_config_mla(cf))
            printf("mla          q_lora %d, kv_lora %d, heads of %d + %d (rope), values %d; a "
                   "cached row of %d\n",
                   cf->q_lora_rank, cf->kv_lora_rank, cf->qk_nope_dim, cf->qk_rope_dim,
                   cf->v_head_dim, cf->head_dim);
        printf("d_ff         %d\n", cf->d_ff);
        if (cf->n_experts)
            printf("experts      %d, %d a token, width %d, %s; %d of %d layers; %.1f MiB of "
                   "expert weights\n",
                   cf->n_experts, cf->n_experts_used, cf->d_ff_expert,
                   cf->moe_norm_topk ? "renormalised" : "not renormalised", sparse, cf->n_layers,
                   expert_bytes / 1048576.0);
        printf("vocab        %d\n", cf->vocab_size);
        printf("context      %d\n", cf->max_ctx);
        printf("rms_eps      %g\n", cf->rms_eps);
        printf("rope         theta %g, %s pairs, scaling %s\n", cf->rope_theta,
               cf->rope_neox ? "half-split" : "adjacent", scaling_name(cf->rope_scaling));
        printf("embeddings   %s\n", cf->tied_embeddings ? "tied" : "untied");
        printf("extras       %s%s%s\n", cf->qkv_bias ? "qkv-bias " : "",
               cf->qk_norm ? "qk-norm " : "", !cf->qkv_bias && !cf->qk_norm ? "none" : "");
        printf("parameters   %llu (%.1f M)\n", (unsigned long long)m->n_params, m->n_params / 1e6);
        printf("weights      %llu bytes in memory (%.1f MiB)\n",
               (unsigned long long)m->weight_bytes, m->weight_bytes / 1048576.0);
        printf("tensors      %lld:", (long long)n_tensors);
        for (int t = 0; t < TDM_DTYPE_COUNT; t++)
            if (file_types[t]) printf(" %s x%lld", tdm_dtype_name(t), (long long)file_types[t]);
        printf("\n");
        printf("tokenizer    %s\n", !tok                               ? "none"
                                    : tdm_tok_kind(tok) == TDM_TOK_SPM ? "sentencepiece BPE"
                                                                       : "byte-level BPE");
        printf("chat         %s\n", chat);
    }
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
    tdm_model_free(m);
    return rc;
}
