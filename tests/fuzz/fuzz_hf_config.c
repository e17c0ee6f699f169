/*
 * libFuzzer target for the HF config reader: the input is split at the first "\n--\n" into a
 * config.json and (if the separator is present) a generation_config.json, both written to a
 * private temp folder, then parsed with tdm_config_from_hf. Accepted configs must satisfy the
 * documented invariants (positive sizes, heads divisible by kv heads, an even head_dim, token
 * ids inside the vocabulary); anything else must be an error, never a crash or a leak.
 *
 * Seed corpus: tests/fuzz/corpus/hf_config/ (real-world config.json shapes).
 */
#include "tandem/model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[64];
static char config_path[128], gen_path[128];

static void cleanup(void)
{
    unlink(config_path);
    unlink(gen_path);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    snprintf(dir, sizeof(dir), "/tmp/tdm_fuzz_hf_XXXXXX");
    if (!mkdtemp(dir)) abort();
    snprintf(config_path, sizeof(config_path), "%s/config.json", dir);
    snprintf(gen_path, sizeof(gen_path), "%s/generation_config.json", dir);
    atexit(cleanup);
    return 0;
}

static void write_file(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *sep = size >= 4 ? memmem(data, size, "\n--\n", 4) : NULL;
    if (sep) {
        write_file(config_path, data, (size_t)(sep - data));
        write_file(gen_path, sep + 4, size - (size_t)(sep - data) - 4);
    } else {
        write_file(config_path, data, size);
        unlink(gen_path);
    }
    struct tdm_model_config c;
    if (tdm_config_from_hf(dir, &c) == TDM_OK) {
        if (c.n_layers <= 0 || c.d_model <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
            c.d_ff <= 0 || c.vocab_size <= 0 || c.head_dim <= 0 || c.head_dim % 2 ||
            c.n_heads % c.n_kv_heads || c.bos_id >= c.vocab_size || c.n_eos > TDM_MAX_EOS)
            abort();
        for (int i = 0; i < c.n_eos; i++)
            if (c.eos_ids[i] < 0 || c.eos_ids[i] >= c.vocab_size) abort();
    }
    return 0;
}
