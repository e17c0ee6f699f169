/*
 * libFuzzer target for the safetensors reader: parses the input with tdm_st_open_memory and,
 * when it is accepted, walks every tensor: its name round-trips through tdm_st_find_tensor,
 * its shape product matches its byte count for the dtypes we compute with, and every byte of
 * its data range is read. The reader promises that an accepted image is entirely in bounds,
 * so ASan turns any broken promise into a crash.
 *
 * Seed corpus: tests/fuzz/corpus/safetensors/ (small valid files of several dtypes).
 */
#include "model/model_int.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static volatile uint64_t sink;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an exact-size copy, so a read one past the end is caught */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    tdm_st_t *st = NULL;
    if (tdm_st_open_memory(copy, size, &st) == TDM_OK) {
        for (int64_t i = 0; i < tdm_st_n_tensors(st); i++) {
            const struct tdm_tensor_info *t = tdm_st_tensor(st, i);
            if (tdm_st_find_tensor(st, t->name) != t) abort();
            if (t->n_dims < 0 || t->n_dims > 4) abort();
            if (t->dtype != TDM_DTYPE_ST_UNSUPPORTED) {
                uint64_t n = 1;
                for (int d = 0; d < 4; d++)
                    n *= (uint64_t)t->ne[d];
                if (n * (t->dtype == TDM_DTYPE_F32 ? 4 : 2) != t->nbytes) abort();
            }
            const uint8_t *p = t->data;
            uint64_t s = 0;
            for (size_t k = 0; k < t->nbytes; k++)
                s += p[k];
            sink += s + strlen(tdm_st_dtype_str(st, t));
        }
        tdm_st_close(st);
    }
    free(copy);
    return 0;
}
