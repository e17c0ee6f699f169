/*
 * Private declarations of the engine module: tensor parallelism's per-rank model views
 * (shard.c), which engine.c builds one of for each rank.
 */
#ifndef TANDEM_ENGINE_INT_H
#define TANDEM_ENGINE_INT_H

#include "tandem/model.h"
#include "tandem/tp.h"

/* A view of model m as rank s->rank holds it (tp.h): a tdm_model whose config has the rank's
 * query heads, KV heads and MLP columns, and whose layers are its slices of m's weights. Row
 * slices (wq, wk, wv and their biases, gate and up) point into m's weights; column slices
 * (wo, down) are copies the view owns: whole quantisation blocks where the slice is
 * block-aligned, else the slice dequantised to F32. The LM head's rows are the rank's share of
 * the vocabulary (output: a pointer into m; a head with a reduced draft vocabulary: its share
 * of the draft rows, which s then counts); norms, embeddings and a head's input stage are m's.
 * m must outlive the view. Dense attention models and heads only (the engine refuses the others).
 * Free with tdm_engine_shard_model_free (not tdm_model_free). */
tdm_status tdm_engine_shard_model(const struct tdm_model *m, const struct tdm_tp_shard *s,
                                  struct tdm_model **out);
void tdm_engine_shard_model_free(struct tdm_model *view); /* NULL: no-op */

#endif
