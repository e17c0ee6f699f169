/*
 * Private declarations shared by the model module's safetensors reader, config reader and
 * loader (not by the GGUF reader or the dequantisers, which have quant_int.h).
 */
#ifndef TANDEM_MODEL_MODEL_INT_H
#define TANDEM_MODEL_MODEL_INT_H

#include "tandem/model.h"

/* Caps on bytes read from checkpoint files, so a hostile file cannot make us allocate without
 * bound. Real files sit far below them (a 70B index.json is ~50 KB, tokenizer_config.json of
 * large-vocab models a few MB). */
#define TDM_ST_MAX_HEADER_BYTES    (100u << 20) /* one safetensors JSON header */
#define TDM_ST_MAX_INDEX_BYTES     (64u << 20)  /* model.safetensors.index.json */
#define TDM_ST_MAX_SHARDS          4096
#define TDM_HF_MAX_CONFIG_BYTES    (4u << 20)  /* config.json, generation_config.json */
#define TDM_HF_MAX_TOKCONFIG_BYTES (64u << 20) /* tokenizer_config.json, chat_template.jinja */

/* Tensors whose safetensors dtype we cannot compute with (I8, F64, F8_*, ...) are listed with
 * this dtype so a checkpoint may carry them; the loader refuses them by name. */
#define TDM_DTYPE_ST_UNSUPPORTED TDM_DTYPE_COUNT

/* The dtype as the safetensors header spells it ("BF16", "I8", ...) for a tensor of `st`. */
const char *tdm_st_dtype_str(const tdm_st_t *st, const struct tdm_tensor_info *t);

#endif /* TANDEM_MODEL_MODEL_INT_H */
