/*
 * libFuzzer target for the trainer's data cache (src/spec/train_data.c): parses the input with
 * tdm_train_data_parse, taking the fingerprint, width and vocabulary the parser must expect from
 * the input's own header (so the fuzzer gets past them), and when it is accepted reads every
 * sequence through the accessors the trainer uses: its tokens, features and top-k must all be
 * in bounds (ASan) and within the promised ranges (abort otherwise).
 *
 * Seed corpus: tests/fuzz/corpus/train_data/ (small valid files).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/spec.h"

static volatile double sink;

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    void *copy = NULL; /* 64-byte aligned, exactly `size` bytes: an overread is caught */
    if (posix_memalign(&copy, 64, size ? size : 1)) return 0;
    if (size) memcpy(copy, data, size);
    uint64_t fp = size >= 48 ? le(data + 40, 8) : 0;
    int d = size >= 16 ? (int)(le(data + 12, 4) & 0xffff) : 1;
    int v = size >= 24 ? (int)(le(data + 20, 4) & 0xffffff) : 1;
    tdm_train_data_t *td = NULL;
    if (tdm_train_data_parse(copy, size, fp, d, v, &td) == TDM_OK) {
        int k = tdm_train_data_top_k(td);
        double s = 0;
        for (int i = 0; i < tdm_train_data_n_seqs(td); i++) {
            struct tdm_train_seq q;
            tdm_train_data_seq(td, i, &q);
            if (q.len < 2 || q.first < 0 || tdm_train_data_prompt(td, i) < 0) abort();
            for (int p = 0; p < q.len; p++) {
                if (q.tokens[p] < 0 || q.tokens[p] >= v) abort();
                for (int c = 0; c < d; c++)
                    if (!isfinite(q.feats[(size_t)p * d + c])) abort();
                for (int j = 0; j < k; j++) {
                    int32_t id = q.top_ids[(size_t)p * k + j];
                    float pr = q.top_p[(size_t)p * k + j];
                    if (id < -1 || id >= v || !(pr >= 0 && pr <= 1)) abort();
                    s += pr;
                }
            }
        }
        sink += s;
        tdm_train_data_free(td);
    }
    free(copy);
    return 0;
}
