/*
 * libFuzzer target for the HF config reader: the input is split at the first "\n--\n" into a
 * config.json and (if the separator is present) a generation_config.json, parsed with
 * tdm_config_from_hf_text. One input in 32 is also written to a private temp folder and read
 * with tdm_config_from_hf, which must give the same answer. Accepted configs must satisfy the
 * documented invariants (positive sizes, heads divisible by kv heads, an even head_dim or, for
 * MLA, an even rope part of a latent row, token ids inside the vocabulary); anything else must
 * be an error, never a crash or a leak.
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

static void check(const struct tdm_model_config *c)
{
    if (c->n_layers <= 0 || c->d_model <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 ||
        c->d_ff <= 0 || c->vocab_size <= 0 || c->head_dim <= 0 || c->n_heads % c->n_kv_heads ||
        c->bos_id >= c->vocab_size || c->n_eos > TDM_MAX_EOS)
        abort();
    /* rope turns pairs: the whole head, or MLA's rope part of a cached latent row (one KV
     * head, the latent then the rope key) */
    if (tdm_config_mla(c) ? c->qk_rope_dim <= 0 || c->qk_rope_dim % 2 || c->n_kv_heads != 1 ||
                                c->head_dim != c->kv_lora_rank + c->qk_rope_dim
                          : c->head_dim % 2)
        abort();
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= c->vocab_size) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *sep = size >= 4 ? memmem(data, size, "\n--\n", 4) : NULL;
    size_t config_len = sep ? (size_t)(sep - data) : size;
    const char *gen = sep ? (const char *)sep + 4 : NULL;
    size_t gen_len = sep ? size - config_len - 4 : 0;
    struct tdm_model_config c, f;
    memset(&c, 0, sizeof c);
    memset(&f, 0, sizeof f);
    tdm_status st = tdm_config_from_hf_text((const char *)data, config_len, gen, gen_len, dir, &c);
    if (st == TDM_OK) check(&c);
    /* one input in 32 also goes through the files, which must agree (most go through the
     * text only: writing files made the target a tenth as fast) */
    if (size % 32 == 0) {
        write_file(config_path, data, config_len);
        if (gen)
            write_file(gen_path, (const uint8_t *)gen, gen_len);
        else
            unlink(gen_path);
        tdm_status fst = tdm_config_from_hf(dir, &f);
        if ((fst == TDM_OK) != (st == TDM_OK)) abort();
        if (fst == TDM_OK && memcmp(&f, &c, sizeof c)) abort();
    }
    return 0;
}
