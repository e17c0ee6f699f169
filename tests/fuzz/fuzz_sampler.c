/*
 * libFuzzer target for the host sampler (src/sample/sampler.c) over arbitrary floats: the
 * sampling parameters and the logits come from the input bytes, NaN, infinities, denormals and
 * huge values included, as any float can reach a sampler (from a request, or from the model).
 * A parameter set that tdm_sampling_validate refuses is skipped, as the server would refuse it.
 * Every accepted set must sample a token inside the vocabulary, with log-probabilities that are
 * never NaN, in bounded time (libFuzzer's -timeout catches a loop).
 *
 * Layout: u8 vocab (1..64), u8 n_top, u8 flags (bit 0: a prompt token seen, bit 1: an output
 * token seen), f32 temperature, top_p, min_p, repetition, presence, frequency, u32 top_k,
 * u32 position, then the logits, then a q of as many floats (missing ones are 0). Flags bits 2-3
 * pick the row's mode (draw, propose, verify, tree), bit 4 one-hot, bit 5 a q for verification;
 * with bit 1 the output token is also the row's undo list. A tree row's candidates are the
 * distinct tokens among the next (flags >> 6) + 1 bytes, modulo the vocabulary; a kept token
 * must be one of them. Then, while bytes remain (up to 4 entries), a logit bias: u8 token
 * (modulo the vocabulary), f32 value; a set that tdm_sampler_set_bias refuses is dropped.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/sample.h"

#define MAX_VOCAB 64

static float f32_at(const uint8_t *data, size_t size, size_t *off)
{
    float f = 0.0f;
    if (*off + 4 <= size) memcpy(&f, data + *off, 4);
    *off += 4;
    return f;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct tdm_sample_scratch scratch;
    if (!scratch.probs && tdm_sample_scratch_init(&scratch, MAX_VOCAB) != TDM_OK) abort();
    if (size < 3) return 0;
    int vocab = 1 + data[0] % MAX_VOCAB;
    int n_top = (int)(data[1] % (TDM_TOP_LOGPROBS_MAX + 2)) - 1; /* -1 .. 20 */
    uint8_t flags = data[2];
    size_t off = 3;
    struct tdm_sampling_params p = tdm_sampling_defaults();
    p.temperature = f32_at(data, size, &off);
    p.top_p = f32_at(data, size, &off);
    p.min_p = f32_at(data, size, &off);
    p.repetition_penalty = f32_at(data, size, &off);
    p.presence_penalty = f32_at(data, size, &off);
    p.frequency_penalty = f32_at(data, size, &off);
    uint32_t top_k = 0, position = 0;
    if (off + 4 <= size) memcpy(&top_k, data + off, 4);
    off += 4;
    if (off + 4 <= size) memcpy(&position, data + off, 4);
    off += 4;
    p.top_k = (int)(top_k % 1000);
    p.seed = position;
    if (tdm_sampling_validate(&p) != TDM_OK) return 0;
    struct tdm_sampler smp;
    if (tdm_sampler_init(&smp, &p, 11, vocab) != TDM_OK) abort();
    if (flags & 1) tdm_sampler_accept(&smp, (int32_t)(position % (uint32_t)vocab), true);
    if (flags & 2) tdm_sampler_accept(&smp, (int32_t)(top_k % (uint32_t)vocab), false);
    float logits[MAX_VOCAB];
    for (int i = 0; i < vocab; i++)
        logits[i] = f32_at(data, size, &off);
    /* the row's mode (speculation's propose and verify too), with the output token as its
     * undo list and a q made of the next floats, whatever they are */
    float q[MAX_VOCAB], dist[MAX_VOCAB];
    for (int i = 0; i < vocab; i++)
        q[i] = f32_at(data, size, &off);
    int32_t undo = (int32_t)(top_k % (uint32_t)vocab);
    int32_t cand[4];
    int n_cand = 0;
    for (int i = 0; i <= flags >> 6; i++) {
        int32_t c = off < size ? (int32_t)(data[off] % vocab) : i % vocab;
        off++;
        bool dup = false;
        for (int j = 0; j < n_cand; j++)
            dup |= cand[j] == c;
        if (!dup) cand[n_cand++] = c;
    }
    int32_t bias_ids[4];
    float bias_vals[4];
    int n_bias = 0;
    while (n_bias < 4 && off + 5 <= size) {
        bias_ids[n_bias] = (int32_t)(data[off++] % vocab);
        bias_vals[n_bias++] = f32_at(data, size, &off);
    }
    if (n_bias && tdm_sampler_set_bias(&smp, bias_ids, bias_vals, n_bias) != TDM_OK && smp.bias)
        abort(); /* a refused set leaves the sampler as it was (no bias here) */
    struct tdm_sample_row row = {.smp = &smp,
                                 .position = position,
                                 .n_top = n_top,
                                 .mode = (uint8_t)((flags >> 2) & 3),
                                 .one_hot = (flags & 16) != 0,
                                 .draft = (int32_t)(position % (uint32_t)vocab),
                                 .q = (flags & 32) ? q : NULL,
                                 .dist = dist,
                                 .undo = (flags & 2) ? &undo : NULL,
                                 .n_undo = (flags & 2) ? 1 : 0,
                                 .cand = cand,
                                 .n_cand = n_cand};
    tdm_sample_row_host(&row, logits, &scratch);
    if (row.token < 0 || row.token >= vocab) abort();
    if (row.mode == TDM_SAMPLE_TREE && row.kept) {
        bool found = false;
        for (int j = 0; j < n_cand; j++)
            found |= cand[j] == row.token;
        if (!found) abort(); /* kept means one of the candidates */
    }
    if (row.mode == TDM_SAMPLE_PROPOSE)
        for (int i = 0; i < vocab; i++)
            if (!(dist[i] >= 0.0f && dist[i] <= 1.0f)) abort(); /* a distribution, never NaN */
    if (n_top >= 0 && isnan(row.logprob)) abort();
    for (int k = 0; k < n_top && k < vocab; k++)
        if (isnan(row.top_lps[k]) || row.top_ids[k] < 0 || row.top_ids[k] >= vocab) abort();
    tdm_sampler_free(&smp);
    return 0;
}
