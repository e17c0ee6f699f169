/*
 * libFuzzer target for the router's prompt keys (server/affinity.c): any request body, parsed
 * as JSON and cut into chained block keys, then inserted for a backend and matched back. Keys
 * are never 0 (an empty entry), a body's keys match themselves in full for the backend they
 * were inserted for and not at all for another, and nothing crashes or leaks.
 *
 * Seed corpus: tests/fuzz/corpus/affinity/ (chat, completion and token-list bodies).
 */
#include <stdint.h>
#include <stdlib.h>

#include "server/server_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t keys[64];
    int n = tdm_affinity_keys((const char *)data, size, keys, 64);
    if (n < 0 || n > 64) abort();
    for (int i = 0; i < n; i++)
        if (!keys[i]) abort();
    struct tdm_affinity *a = NULL;
    if (tdm_affinity_new(1024, &a) != TDM_OK) return 0;
    tdm_affinity_insert(a, 1, keys, n);
    int matched[3];
    tdm_affinity_match(a, keys, n, 3, matched);
    if (matched[1] != n || matched[0] || matched[2]) abort();
    tdm_affinity_forget(a, 1);
    tdm_affinity_match(a, keys, n, 3, matched);
    if (matched[1]) abort();
    tdm_affinity_free(a);
    return 0;
}
