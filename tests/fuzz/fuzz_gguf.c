/*
 * libFuzzer target for the GGUF reader: parses the input with tdm_gguf_open_memory and, when
 * it is accepted, touches everything a loader could: every key and its typed getters, every
 * array (numeric bytes and each string element), every tensor's data range, and the
 * dequantisation of the first block of each tensor of a supported type. The reader promises
 * that an accepted image is entirely in bounds, so ASan turns any broken promise into a crash.
 *
 * Seed corpus: tests/fuzz/corpus/gguf/ (tiny valid files of several types and versions).
 */
#include "tandem/model.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Sums bytes so the compiler cannot drop the reads. */
static volatile uint64_t sink;

static void touch(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++)
        s += b[i];
    sink += s;
}

static void walk_kv(const tdm_gguf_t *g, int64_t i)
{
    struct tdm_str key = tdm_gguf_kv_key(g, i);
    touch(key.ptr, key.len);
    /* getters take C strings: keys holding NUL are rejected at open, so this round-trips */
    char *name = malloc(key.len + 1);
    if (!name) return;
    memcpy(name, key.ptr, key.len);
    name[key.len] = '\0';
    if (tdm_gguf_find(g, name) != i) abort();

    int64_t iv;
    float fv;
    bool bv;
    struct tdm_str sv;
    (void)tdm_gguf_get_i64(g, name, &iv);
    (void)tdm_gguf_get_f32(g, name, &fv);
    (void)tdm_gguf_get_bool(g, name, &bv);
    if (tdm_gguf_get_str(g, name, &sv) == TDM_OK) touch(sv.ptr, sv.len);

    enum tdm_gguf_type et;
    int64_t n;
    const void *data;
    if (tdm_gguf_kv_type(g, i) == TDM_GGUF_ARRAY) {
        if (tdm_gguf_get_arr(g, name, &et, &n, &data) != TDM_OK) abort();
        if (et == TDM_GGUF_STRING) {
            for (int64_t j = 0; j < n; j++) {
                if (tdm_gguf_get_arr_str(g, name, j, &sv) != TDM_OK) abort();
                touch(sv.ptr, sv.len);
            }
            if (tdm_gguf_get_arr_str(g, name, n, &sv) == TDM_OK) abort();
        } else {
            size_t esize = et == TDM_GGUF_U8 || et == TDM_GGUF_I8 || et == TDM_GGUF_BOOL    ? 1
                           : et == TDM_GGUF_U16 || et == TDM_GGUF_I16                       ? 2
                           : et == TDM_GGUF_U64 || et == TDM_GGUF_I64 || et == TDM_GGUF_F64 ? 8
                                                                                            : 4;
            touch(data, (size_t)n * esize);
        }
    }
    free(name);
}

static void walk_tensor(const tdm_gguf_t *g, int64_t i)
{
    const struct tdm_tensor_info *t = tdm_gguf_tensor(g, i);
    if (tdm_gguf_find_tensor(g, t->name) != t) abort();
    if (t->nbytes > 0) {
        touch(t->data, 1);
        touch((const uint8_t *)t->data + t->nbytes - 1, 1);
    }
    int64_t blk = tdm_dtype_block_elems(t->dtype);
    if (blk <= 0 || blk > 256 || t->nbytes < tdm_dtype_block_bytes(t->dtype)) abort();
    float out[256];
    tdm_status st = tdm_dequantize(t->dtype, t->data, out, blk);
    if (st != TDM_OK && st != TDM_EUNSUPPORTED) abort();
    if (st == TDM_OK) touch(out, (size_t)blk * sizeof(float));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tdm_gguf_t *g = NULL;
    if (tdm_gguf_open_memory(data, size, &g) != TDM_OK) return 0;
    (void)tdm_gguf_version(g);
    for (int64_t i = 0; i < tdm_gguf_n_kv(g); i++)
        walk_kv(g, i);
    for (int64_t i = 0; i < tdm_gguf_n_tensors(g); i++)
        walk_tensor(g, i);
    tdm_gguf_close(g);
    return 0;
}
