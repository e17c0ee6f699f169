/*
 * Tests of the HF config reader (tdm_config_from_hf in src/model/config.c).
 *
 * Each case writes a config.json (and sometimes a generation_config.json) into a temp folder,
 * parses it, and checks the fields against values read off the JSON by hand: rope_theta at
 * top level vs in rope_parameters, llama3 and linear scaling under both spellings of the type
 * key, explicit vs derived head_dim, tied embeddings, eos as an int or a list merged with
 * generation_config.json, and per-arch flags. A table of bad configs (wrong JSON types,
 * missing keys, zero / negative / absurd sizes, heads not divisible, odd head_dim, unsupported
 * arch or rope type) must each be refused without touching the output struct. GGUF configs
 * are covered by tests/model/test_loader.py with files from the gguf package.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <jansson.h>

#include "tandem/model.h"

static char tmpdir[64];

static void write_named(const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
    if (!text) {
        unlink(path);
        return;
    }
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* SmolLM2-135M's config.json, abridged. */
#define SMOL_BASE                                                                                  \
    "\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 1536,"                \
    " \"num_hidden_layers\": 30, \"num_attention_heads\": 9, \"num_key_value_heads\": 3,"          \
    " \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 8192, \"vocab_size\": 49152,"          \
    " \"hidden_act\": \"silu\", \"bos_token_id\": 1, \"eos_token_id\": 2"

/* A config.json text: `spec` itself, or, when it starts with '+', the SmolLM2 config with the
 * keys of the JSON object after the '+' replaced or added. Caller frees. */
static char *cfg_text(const char *spec)
{
    if (spec[0] != '+') return strdup(spec);
    json_error_t err;
    json_t *base = json_loads("{" SMOL_BASE "}", 0, &err);
    json_t *over = json_loads(spec + 1, 0, &err);
    assert_non_null(base);
    assert_non_null(over);
    assert_int_equal(json_object_update(base, over), 0);
    char *text = json_dumps(base, 0);
    json_decref(base);
    json_decref(over);
    return text;
}

static tdm_status parse(const char *config, const char *generation, struct tdm_model_config *c)
{
    char *text = cfg_text(config);
    write_named("config.json", text);
    free(text);
    write_named("generation_config.json", generation);
    return tdm_config_from_hf(tmpdir, c);
}

static int setup_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/tdm_cfg_test_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown_dir(void **state)
{
    (void)state;
    write_named("config.json", NULL);
    write_named("generation_config.json", NULL);
    return rmdir(tmpdir);
}

static void test_llama_basic(void **state)
{
    (void)state;
    struct tdm_model_config c;
    assert_int_equal(parse("{" SMOL_BASE ", \"rope_theta\": 100000, \"tie_word_embeddings\": true,"
                           " \"rope_scaling\": null, \"torch_dtype\": \"bfloat16\"}",
                           NULL, &c),
                     TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_LLAMA);
    assert_int_equal(c.n_layers, 30);
    assert_int_equal(c.d_model, 576);
    assert_int_equal(c.n_heads, 9);
    assert_int_equal(c.n_kv_heads, 3);
    assert_int_equal(c.head_dim, 64);
    assert_int_equal(c.d_ff, 1536);
    assert_int_equal(c.vocab_size, 49152);
    assert_int_equal(c.max_ctx, 8192);
    assert_true(c.rms_eps == 1e-5f);
    assert_true(c.rope_theta == 100000.0f);
    assert_true(c.rope_neox);
    assert_int_equal(c.rope_scaling, TDM_ROPE_SCALING_NONE);
    assert_true(c.tied_embeddings);
    assert_false(c.qkv_bias);
    assert_false(c.qk_norm);
    assert_int_equal(c.bos_id, 1);
    assert_int_equal(c.n_eos, 1);
    assert_int_equal(c.eos_ids[0], 2);
    assert_true(isnan(c.gen_temperature));
    assert_true(isnan(c.gen_top_p));
    assert_int_equal(c.gen_top_k, -1);
    assert_string_equal(tdm_arch_name(c.arch), "llama");
}

static void test_defaults(void **state)
{
    (void)state;
    struct tdm_model_config c;
    /* no kv heads (= heads), no rope_theta (10000), no tie (false), no eps, no ids */
    assert_int_equal(parse("{\"model_type\": \"mistral\", \"hidden_size\": 256,"
                           " \"intermediate_size\": 512, \"num_hidden_layers\": 2,"
                           " \"num_attention_heads\": 4, \"vocab_size\": 100, \"head_dim\": null,"
                           " \"num_key_value_heads\": null, \"sliding_window\": 4096}",
                           NULL, &c),
                     TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_LLAMA);
    assert_int_equal(c.n_kv_heads, 4);
    assert_int_equal(c.head_dim, 64);
    assert_true(c.rope_theta == 10000.0f);
    assert_false(c.tied_embeddings);
    assert_true(c.rms_eps == 1e-6f);
    assert_int_equal(c.bos_id, -1);
    assert_int_equal(c.n_eos, 0);
    assert_true(c.max_ctx > 0);
}

static void test_rope_parameters_llama3(void **state)
{
    (void)state;
    struct tdm_model_config c;
    assert_int_equal(
        parse("{" SMOL_BASE ", \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\":"
              " \"llama3\", \"factor\": 32.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
              " \"original_max_position_embeddings\": 8192}}",
              NULL, &c),
        TDM_OK);
    assert_true(c.rope_theta == 500000.0f);
    assert_int_equal(c.rope_scaling, TDM_ROPE_SCALING_LLAMA3);
    assert_true(c.rope_factor == 32.0f);
    assert_true(c.rope_low_freq_factor == 1.0f);
    assert_true(c.rope_high_freq_factor == 4.0f);
    assert_int_equal(c.rope_original_max_ctx, 8192);

    /* rope_parameters of type default: just the theta */
    assert_int_equal(parse("{" SMOL_BASE ", \"rope_parameters\": {\"rope_theta\": 1000000,"
                           " \"rope_type\": \"default\"}}",
                           NULL, &c),
                     TDM_OK);
    assert_true(c.rope_theta == 1000000.0f);
    assert_int_equal(c.rope_scaling, TDM_ROPE_SCALING_NONE);
}

static void test_rope_scaling_spellings(void **state)
{
    (void)state;
    struct tdm_model_config c;
    /* Llama 3.1: rope_theta at top level, rope_scaling with rope_type */
    assert_int_equal(parse("{" SMOL_BASE ", \"rope_theta\": 500000.0, \"rope_scaling\": {"
                           "\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                           " \"original_max_position_embeddings\": 8192,"
                           " \"rope_type\": \"llama3\"}}",
                           NULL, &c),
                     TDM_OK);
    assert_true(c.rope_theta == 500000.0f);
    assert_int_equal(c.rope_scaling, TDM_ROPE_SCALING_LLAMA3);
    assert_true(c.rope_factor == 8.0f);
    /* older configs: "type" */
    assert_int_equal(parse("{" SMOL_BASE ", \"rope_scaling\": {\"type\": \"linear\","
                           " \"factor\": 2.5}}",
                           NULL, &c),
                     TDM_OK);
    assert_int_equal(c.rope_scaling, TDM_ROPE_SCALING_LINEAR);
    assert_true(c.rope_factor == 2.5f);
    assert_true(c.rope_theta == 10000.0f);
}

static void test_qwen(void **state)
{
    (void)state;
    struct tdm_model_config c;
    /* Qwen3-0.6B: explicit head_dim (128) != hidden / heads (64) */
    assert_int_equal(
        parse("{\"model_type\": \"qwen3\", \"hidden_size\": 1024, \"intermediate_size\": 3072,"
              " \"num_hidden_layers\": 28, \"num_attention_heads\": 16,"
              " \"num_key_value_heads\": 8, \"head_dim\": 128, \"rms_norm_eps\": 1e-06,"
              " \"rope_theta\": 1000000, \"vocab_size\": 151936, \"tie_word_embeddings\": true,"
              " \"attention_bias\": false, \"max_position_embeddings\": 40960,"
              " \"bos_token_id\": 151643, \"eos_token_id\": 151645}",
              "{\"bos_token_id\": 151643, \"do_sample\": true, \"eos_token_id\": [151645, 151643],"
              " \"temperature\": 0.6, \"top_k\": 20, \"top_p\": 0.95}",
              &c),
        TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_QWEN3);
    assert_int_equal(c.head_dim, 128);
    assert_true(c.qk_norm);
    assert_false(c.qkv_bias);
    assert_true(c.rope_neox);
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.eos_ids[0], 151645);
    assert_int_equal(c.eos_ids[1], 151643);
    assert_true(c.gen_temperature == 0.6f);
    assert_true(c.gen_top_p == 0.95f);
    assert_int_equal(c.gen_top_k, 20);

    /* Qwen2.5-0.5B: q/k/v biases whatever attention_bias says; eos from the list */
    assert_int_equal(
        parse("{\"model_type\": \"qwen2\", \"hidden_size\": 896, \"intermediate_size\": 4864,"
              " \"num_hidden_layers\": 24, \"num_attention_heads\": 14,"
              " \"num_key_value_heads\": 2, \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0,"
              " \"vocab_size\": 151936, \"tie_word_embeddings\": true,"
              " \"max_position_embeddings\": 32768, \"sliding_window\": 32768,"
              " \"use_sliding_window\": false, \"bos_token_id\": 151643,"
              " \"eos_token_id\": [151645, 151643, 151645]}",
              NULL, &c),
        TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_QWEN2);
    assert_int_equal(c.head_dim, 64);
    assert_true(c.qkv_bias);
    assert_false(c.qk_norm);
    assert_true(c.tied_embeddings);
    assert_int_equal(c.n_eos, 2); /* duplicates folded */
}

static void test_generation_merge(void **state)
{
    (void)state;
    struct tdm_model_config c;
    assert_int_equal(parse("+{\"bos_token_id\": null}",
                           "{\"bos_token_id\": 1, \"eos_token_id\": 7, \"temperature\": 0}", &c),
                     TDM_OK);
    assert_int_equal(c.bos_id, 1); /* from generation_config.json */
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.eos_ids[0], 2);
    assert_int_equal(c.eos_ids[1], 7);
    assert_true(c.gen_temperature == 0.0f);
}

struct bad_config {
    const char *what;
    const char *config;
    const char *generation;
    tdm_status want; /* 0: any error */
    const char *in_msg;
};

static void test_bad_configs(void **state)
{
    (void)state;
    const struct bad_config cases[] = {
        {"not JSON", "{\"model_type\": ", NULL, TDM_EFORMAT, NULL},
        {"not an object", "[1, 2]", NULL, TDM_EFORMAT, NULL},
        {"no model_type", "{\"hidden_size\": 576}", NULL, TDM_EFORMAT, "model_type"},
        {"model_type not a string", "{\"model_type\": 5}", NULL, TDM_EFORMAT, "model_type"},
        {"unsupported arch", "+{\"model_type\": \"gemma\"}", NULL, 0, NULL},
        {"gemma", "{\"model_type\": \"gemma\"}", NULL, TDM_EUNSUPPORTED, "gemma"},
        {"string size", "+{\"hidden_size\": \"576\"}", NULL, 0, NULL},
        {"hidden_size as string",
         "{\"model_type\": \"llama\", \"hidden_size\": \"576\", \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 9, \"vocab_size\": 49152}",
         NULL, TDM_EFORMAT, "hidden_size"},
        {"float size",
         "{\"model_type\": \"llama\", \"hidden_size\": 576.5, \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 9, \"vocab_size\": 49152}",
         NULL, TDM_EFORMAT, "hidden_size"},
        {"missing layers",
         "{\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 1536,"
         " \"num_attention_heads\": 9, \"vocab_size\": 49152}",
         NULL, TDM_EFORMAT, "num_hidden_layers"},
        {"zero layers",
         "{\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 0, \"num_attention_heads\": 9, \"vocab_size\": 49152}",
         NULL, TDM_ERANGE, "n_layers"},
        {"negative vocab",
         "{\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 9, \"vocab_size\": -5}",
         NULL, TDM_ERANGE, "vocab_size"},
        {"zero heads",
         "{\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 0, \"vocab_size\": 49152}",
         NULL, TDM_ERANGE, NULL},
        {"absurd d_model",
         "{\"model_type\": \"llama\", \"hidden_size\": 1048576, \"intermediate_size\": 1536,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 8, \"vocab_size\": 49152}",
         NULL, TDM_ERANGE, "d_model"},
        {"huge int",
         "{\"model_type\": \"llama\", \"hidden_size\": 576, \"intermediate_size\": 99999999999,"
         " \"num_hidden_layers\": 30, \"num_attention_heads\": 9, \"vocab_size\": 49152}",
         NULL, TDM_ERANGE, "intermediate_size"},
        {"heads not divisible", "+{\"num_key_value_heads\": 2}", NULL, TDM_EFORMAT, "n_kv_heads"},
        {"more kv heads than heads", "+{\"num_key_value_heads\": 18}", NULL, 0, NULL},
        {"hidden not divisible by heads", "+{\"num_attention_heads\": 7}", NULL, TDM_EFORMAT,
         "num_attention_heads"},
        {"odd head_dim", "{" SMOL_BASE ", \"head_dim\": 63}", NULL, TDM_EFORMAT, "head_dim"},
        {"tie not bool", "{" SMOL_BASE ", \"tie_word_embeddings\": \"yes\"}", NULL, TDM_EFORMAT,
         "tie_word_embeddings"},
        {"eos list with a string", "+{\"eos_token_id\": [2, \"3\"]}", NULL, TDM_EFORMAT,
         "eos_token_id"},
        {"eos object", "+{\"eos_token_id\": {}}", NULL, TDM_EFORMAT, NULL},
        {"eos outside vocab", "+{\"eos_token_id\": 49152}", NULL, TDM_ERANGE, NULL},
        {"bos outside vocab", "+{\"bos_token_id\": 60000}", NULL, TDM_ERANGE, NULL},
        {"rope theta zero", "{" SMOL_BASE ", \"rope_theta\": 0}", NULL, TDM_ERANGE, NULL},
        {"rope theta string", "{" SMOL_BASE ", \"rope_theta\": \"1e4\"}", NULL, TDM_EFORMAT,
         "rope_theta"},
        {"eps negative", "+{\"rms_norm_eps\": -1e-5}", NULL, TDM_ERANGE, NULL},
        {"eps huge", "+{\"rms_norm_eps\": 1e300}", NULL, TDM_ERANGE, NULL},
        {"rope yarn", "{" SMOL_BASE ", \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 4}}",
         NULL, TDM_EUNSUPPORTED, "yarn"},
        {"rope scaling not object", "{" SMOL_BASE ", \"rope_scaling\": 4}", NULL, TDM_EFORMAT,
         NULL},
        {"llama3 missing field",
         "{" SMOL_BASE ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8}}", NULL,
         TDM_EFORMAT, "low_freq_factor"},
        {"llama3 low >= high",
         "{" SMOL_BASE ", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8,"
         " \"low_freq_factor\": 4, \"high_freq_factor\": 4,"
         " \"original_max_position_embeddings\": 8192}}",
         NULL, TDM_ERANGE, NULL},
        {"linear without factor", "{" SMOL_BASE ", \"rope_scaling\": {\"type\": \"linear\"}}", NULL,
         TDM_EFORMAT, "factor"},
        {"linear factor zero",
         "{" SMOL_BASE ", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 0}}", NULL,
         TDM_ERANGE, NULL},
        {"gelu", "+{\"hidden_act\": \"gelu\"}", NULL, TDM_EUNSUPPORTED, "gelu"},
        {"llama attention bias", "{" SMOL_BASE ", \"attention_bias\": true}", NULL,
         TDM_EUNSUPPORTED, "attention_bias"},
        {"mlp bias", "{" SMOL_BASE ", \"mlp_bias\": true}", NULL, TDM_EUNSUPPORTED, NULL},
        {"partial rotary", "{" SMOL_BASE ", \"partial_rotary_factor\": 0.5}", NULL,
         TDM_EUNSUPPORTED, NULL},
        {"duplicate key", "{" SMOL_BASE ", \"hidden_size\": 576}", NULL, TDM_EFORMAT, NULL},
        {"generation not JSON", "{" SMOL_BASE "}", "{", TDM_EFORMAT, "generation_config"},
        {"generation top_p", "{" SMOL_BASE "}", "{\"top_p\": 1.5}", TDM_ERANGE, "top_p"},
        {"generation temperature", "{" SMOL_BASE "}", "{\"temperature\": -1}", TDM_ERANGE, NULL},
        {"generation top_k type", "{" SMOL_BASE "}", "{\"top_k\": \"20\"}", TDM_EFORMAT, "top_k"},
        {"generation eos outside", "{" SMOL_BASE "}", "{\"eos_token_id\": [2, 99999]}", TDM_ERANGE,
         NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const struct bad_config *bc = &cases[i];
        struct tdm_model_config c;
        memset(&c, 0x5a, sizeof(c));
        tdm_status rc = parse(bc->config, bc->generation, &c);
        if (rc == TDM_OK) fail_msg("case \"%s\" was accepted", bc->what);
        if (bc->want && rc != bc->want)
            fail_msg("case \"%s\": status %s, want %s (%s)", bc->what, tdm_status_str(rc),
                     tdm_status_str(bc->want), tdm_err_msg());
        if (bc->in_msg && !strstr(tdm_err_msg(), bc->in_msg))
            fail_msg("case \"%s\": message \"%s\" lacks \"%s\"", bc->what, tdm_err_msg(),
                     bc->in_msg);
        const unsigned char *p = (const unsigned char *)&c;
        for (size_t k = 0; k < sizeof(c); k++)
            if (p[k] != 0x5a) fail_msg("case \"%s\" wrote the output", bc->what);
    }
}

static void test_missing_files(void **state)
{
    (void)state;
    struct tdm_model_config c;
    write_named("config.json", NULL);
    write_named("generation_config.json", NULL);
    assert_int_not_equal(tdm_config_from_hf(tmpdir, &c), TDM_OK);
    assert_int_not_equal(tdm_config_from_hf("/nonexistent/dir", &c), TDM_OK);
    assert_int_equal(tdm_config_from_hf(NULL, &c), TDM_EINVAL);
}

/* tdm_default_model_path (lives in loader.c; tested here with the other path-level helpers) */
static void test_default_model_path(void **state)
{
    (void)state;
    char buf[512];
    setenv("TANDEM_MODEL", "/m/x.gguf", 1);
    assert_true(tdm_default_model_path(buf, sizeof(buf)));
    assert_string_equal(buf, "/m/x.gguf");
    assert_false(tdm_default_model_path(buf, 5)); /* does not fit */
    unsetenv("TANDEM_MODEL");
    setenv("XDG_CACHE_HOME", "/xdg", 1);
    assert_true(tdm_default_model_path(buf, sizeof(buf)));
    assert_string_equal(buf, "/xdg/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    setenv("XDG_CACHE_HOME", "", 1);
    setenv("HOME", "/home/u", 1);
    assert_true(tdm_default_model_path(buf, sizeof(buf)));
    assert_string_equal(buf, "/home/u/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    unsetenv("XDG_CACHE_HOME");
    unsetenv("HOME");
    assert_false(tdm_default_model_path(buf, sizeof(buf)));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_basic),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_rope_parameters_llama3),
        cmocka_unit_test(test_rope_scaling_spellings),
        cmocka_unit_test(test_qwen),
        cmocka_unit_test(test_generation_merge),
        cmocka_unit_test(test_bad_configs),
        cmocka_unit_test(test_missing_files),
        cmocka_unit_test(test_default_model_path),
    };
    return cmocka_run_group_tests(tests, setup_dir, teardown_dir);
}
