/*
 * libFuzzer target for the router's KV event index (server/kv_index.c): any bytes as a KV
 * event batch from backend 0 or 1 (the first byte picks), then the rest of the input as a
 * prompt's token ids matched against the index. A malformed batch is an error, never a crash
 * or a leak; a prompt's keys are never 0 and no more than its whole blocks; a backend matches
 * no more blocks than the prompt has, and all of them while a request with them is in flight
 * there; after forgetting both backends nothing matches and neither holds a block.
 *
 * Seed corpus: tests/fuzz/corpus/kv_index/ (batches of BlockStored, BlockRemoved and
 * AllBlocksCleared as tandem and vLLM write them).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!size) return 0;
    struct tdm_kv_index *x = NULL;
    if (tdm_kv_index_new(4096, &x) != TDM_OK) return 0;
    int b = data[0] & 1;
    (void)tdm_kv_index_apply(x, b, data + 1, size - 1);
    (void)tdm_kv_index_apply(x, 1 - b, data + 1, size - 1); /* the same blocks on both */
    int32_t ids[256];
    int n = 0;
    for (size_t i = 1; i + 1 < size && n < 256; i += 2)
        ids[n++] = (int32_t)(data[i] | data[i + 1] << 8);
    uint64_t keys[256];
    int k = tdm_kv_index_keys(x, ids, n, keys, 256);
    int bs = tdm_kv_index_block_size(x);
    if (k < 0 || (bs > 0 && k != n / bs) || (bs == 0 && k)) abort();
    for (int i = 0; i < k; i++)
        if (!keys[i]) abort();
    int matched[2];
    tdm_kv_index_match(x, keys, k, 2, matched, 0);
    if (matched[0] < 0 || matched[0] > k || matched[1] < 0 || matched[1] > k) abort();
    const int held0 = matched[0];
    if (tdm_kv_index_held(x, 0) < 0 || tdm_kv_index_held(x, 1) < 0) abort();
    /* a request in flight to backend 0 with these blocks: 0 holds them all while it lasts */
    tdm_kv_index_pend(x, 0, keys, k, +1, 0);
    tdm_kv_index_match(x, keys, k, 2, matched, 0);
    if (matched[0] != k) abort();
    /* it ended: its blocks land, held a while yet, then only what the events say */
    tdm_kv_index_pend(x, 0, keys, k, -1, 0);
    tdm_kv_index_match(x, keys, k, 2, matched, TDM_KV_LANDING_MS - 1);
    if (matched[0] != k) abort();
    tdm_kv_index_expire(x, TDM_KV_LANDING_MS);
    tdm_kv_index_match(x, keys, k, 2, matched, TDM_KV_LANDING_MS);
    if (matched[0] != held0) abort();
    tdm_kv_index_pend(x, 0, keys, k, +1, 0);
    tdm_kv_index_pend(x, 0, keys, k, -1, 0);
    tdm_kv_index_forget(x, 0);
    tdm_kv_index_forget(x, 1);
    tdm_kv_index_match(x, keys, k, 2, matched, 0);
    if (matched[0] || matched[1] || tdm_kv_index_held(x, 0) || tdm_kv_index_held(x, 1)) abort();
    tdm_kv_index_free(x);
    return 0;
}
