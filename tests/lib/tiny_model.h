/*
 * The C tests' helper library: random data from a seed and tiny random-weight models built in
 * memory, one copy for every test program (each C file of tests/lib is linked into each).
 *
 * A tiny model has the layout of a real one (llama, qwen2 with q/k/v biases, qwen3 with q/k
 * norms) and matrices of F32, BF16 or Q8_0, so the engine, the backends and the scheduler run
 * their real code on it in milliseconds. Values come from splitmix64 (lib/test_rng.h): a test's
 * data depends only on its own seed.
 *
 * Ownership: tdm_test_model_make allocates every weight; tdm_test_model_free releases them.
 * Single-threaded, like the tests.
 */
#ifndef TANDEM_TEST_TINY_MODEL_H
#define TANDEM_TEST_TINY_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/model.h"

/* Uniform in [lo, hi). */
float tdm_test_uniform(uint64_t *state, float lo, float hi);
/* n uniform values in [lo, hi), malloc'd with a few bytes of slack past the end. */
float *tdm_test_rand_vec(uint64_t *state, size_t n, float lo, float hi);

/* A random weight of any dtype the backends take (F32, BF16, Q8_0, Q4_0, Q4_1; quantised cols
 * a multiple of 32), its data 4 bytes past an aligned address (GGUF data need not be aligned to
 * a vector), with deq: its values by tdm_dequantize, [rows][cols], a reference's input. */
struct tdm_test_weight {
    struct tdm_weight w;
    uint8_t *alloc;
    float *deq;
};
void tdm_test_weight_make(uint64_t *state, enum tdm_dtype dt, int64_t rows, int64_t cols,
                          struct tdm_test_weight *tw);
void tdm_test_weight_free(struct tdm_test_weight *tw);

struct tdm_test_model_opts {
    enum tdm_arch arch;
    enum tdm_dtype dtype; /* of the matrices: F32, BF16 or Q8_0 (cols a multiple of 32) */
    int n_layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab, max_ctx;
    bool rope_neox;
    /* Matrices scaled by 1/sqrt(fan-in), which keeps deeper and wider models well conditioned;
     * otherwise by fixed factors (0.2 to 0.5), as small shapes like. */
    bool fan_in_scale;
    uint64_t seed;
};
struct tdm_test_model {
    struct tdm_model m;
    struct tdm_layer_weights *layers; /* [n_layers], m.layers points here */
    void **owned;
    int n_owned, cap_owned;
};
void tdm_test_model_make(struct tdm_test_model *tm, const struct tdm_test_model_opts *o);
void tdm_test_model_free(struct tdm_test_model *tm);

#endif /* TANDEM_TEST_TINY_MODEL_H */
