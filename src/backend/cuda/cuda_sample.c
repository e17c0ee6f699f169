/*
 * The CUDA backend's `sample` hook: packs each row's parameters and penalty list (the
 * sampler's distinct seen tokens, with their output counts) into pinned memory, copies them
 * in one transfer, runs the sampling kernel (sample.cu) over the logits where the LM head left
 * them, and copies back only tokens, log-probabilities and (verified rows) whether the draft
 * was kept: 172 bytes a row instead of the vocabulary's 4 bytes a token. A rejection drafter's
 * distributions (q) stay on the device: PROPOSE rows write them there, and the target's VERIFY
 * rows read them there.
 *
 * Ownership: the staging buffers belong to the instance; they grow (outside any capture:
 * sampling is never recorded in a graph) when a step brings more rows or penalty entries than
 * they hold, and are freed with it. Threading: the instance's driving thread.
 */
#include <string.h>

#include "backend/cuda/cuda_int.h"

_Static_assert(TDM_CU_SAMPLE_MAX_TOP == TDM_TOP_LOGPROBS_MAX, "top log-probabilities: one limit");
_Static_assert(TDM_CU_SAMPLE_MAX_UNDO == TDM_SAMPLE_MAX_UNDO, "undo lists: one limit");
_Static_assert(TDM_CU_SAMPLE_MAX_CAND == TDM_SAMPLE_MAX_CAND, "tree candidates: one limit");
_Static_assert(TDM_SAMPLE_DRAW == 0 && TDM_SAMPLE_PROPOSE == 1 && TDM_SAMPLE_VERIFY == 2 &&
                   TDM_SAMPLE_TREE == 3 && TDM_SAMPLE_SCORE == 4 && TDM_SAMPLE_STREAM_TREE == 4,
               "sample.cu numbers the modes and streams so");

/* Makes the device-only scratch hold `need` bytes. */
static tdm_status scratch_grow(struct tdm_cuda *cu, size_t need)
{
    if (need <= cu->sscratch_cap) return TDM_OK;
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    if (cu->d_sscratch) cudaFree(cu->d_sscratch);
    cu->d_sscratch = NULL;
    cu->sscratch_cap = 0;
    if (cudaMalloc((void **)&cu->d_sscratch, need) != cudaSuccess) {
        (void)cudaGetLastError();
        cu->d_sscratch = NULL;
        return tdm_err_set(TDM_ENOMEM, "cuda backend: no %zu bytes of sampling scratch", need);
    }
    cu->sscratch_cap = need;
    return TDM_OK;
}

/* Makes the staging pair (pinned host, and device unless d is NULL) hold `need` bytes. A copy
 * out of the old buffers may be in flight: the stream is drained before they are freed. */
static tdm_status stage_grow(struct tdm_cuda *cu, void **h, void **d, size_t *cap, size_t need)
{
    if (need <= *cap) return TDM_OK;
    need = TDM_MAX(need, *cap * 2);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    if (*h) cudaFreeHost(*h);
    *h = NULL;
    if (d) {
        if (*d) cudaFree(*d);
        *d = NULL;
    }
    *cap = 0;
    if (cudaMallocHost(h, need) != cudaSuccess || (d && cudaMalloc(d, need) != cudaSuccess)) {
        (void)cudaGetLastError();
        if (*h) cudaFreeHost(*h);
        *h = NULL;
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot stage %zu bytes for sampling", need);
    }
    *cap = need;
    return TDM_OK;
}

/* Packs the rows into pinned staging (*hs, grown as needed; the device copy too) and queues the
 * copy in, the sampling kernel and the copy of the results out into hout (pinned, n_rows
 * results). */
static tdm_status queue_sampling(struct tdm_cuda *cu, float *logits, int n_rows, int vocab,
                                 const struct tdm_sample_row *rows, void **hs, size_t *hs_cap,
                                 void **hout_p, size_t *hout_cap)
{

    size_t n_pen = 0;
    for (int i = 0; i < n_rows; i++) /* a score row draws nothing: no penalty list */
        if (rows[i].mode != TDM_SAMPLE_SCORE)
            n_pen +=
                (size_t)(rows[i].smp->seen ? rows[i].smp->n_seen : 0) + (size_t)rows[i].smp->n_bias;
    /* the grammar masks: each distinct one once (a request's rows often share one) */
    const size_t words = (size_t)(vocab + 31) / 32;
    size_t n_masks = 0;
    for (int i = 0; i < n_rows; i++) {
        if (!rows[i].allow || rows[i].mode == TDM_SAMPLE_SCORE) continue;
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = rows[j].allow == rows[i].allow && rows[j].mode != TDM_SAMPLE_SCORE;
        n_masks += !seen;
    }
    const size_t rows_bytes = (size_t)n_rows * sizeof(struct tdm_cu_sample_row);
    const size_t pen_at = (rows_bytes + 63) & ~(size_t)63;
    const size_t mask_at = (pen_at + n_pen * sizeof(struct tdm_cu_sample_pen) + 63) & ~(size_t)63;
    const size_t staged = mask_at + n_masks * words * sizeof(uint32_t);
    const size_t out_bytes = (size_t)n_rows * sizeof(struct tdm_cu_sample_out);
    tdm_status st;
    if ((st = stage_grow(cu, &cu->h_samp, &cu->d_samp, &cu->samp_cap, staged)) != TDM_OK ||
        (st = stage_grow(cu, &cu->h_sout, &cu->d_sout, &cu->sout_cap, out_bytes)) != TDM_OK ||
        (st = scratch_grow(cu, tdm_cu_sample_scratch_bytes(n_rows, vocab))) != TDM_OK ||
        (hs != &cu->h_samp && (st = stage_grow(cu, hs, NULL, hs_cap, staged)) != TDM_OK) ||
        (hout_p != &cu->h_sout &&
         (st = stage_grow(cu, hout_p, NULL, hout_cap, out_bytes)) != TDM_OK))
        return st;

    struct tdm_cu_sample_row *hr = *hs;
    struct tdm_cu_sample_pen *hp = (struct tdm_cu_sample_pen *)((char *)*hs + pen_at);
    uint32_t *hm = (uint32_t *)((char *)*hs + mask_at);
    size_t off = 0, mask_words = 0;
    for (int i = 0; i < n_rows; i++) {
        const struct tdm_sampler *smp = rows[i].smp;
        const struct tdm_sampling_params *p = &smp->params;
        TDM_ASSERT(smp->vocab == vocab);
        hr[i] = (struct tdm_cu_sample_row){
            .temperature = p->temperature,
            .top_p = p->top_p,
            .min_p = p->min_p,
            .repetition = p->repetition_penalty,
            .presence = p->presence_penalty,
            .frequency = p->frequency_penalty,
            .top_k = p->top_k,
            .n_top = TDM_MIN(rows[i].n_top, TDM_CU_SAMPLE_MAX_TOP),
            .pen_off = (int32_t)off,
            .position = rows[i].position,
            .seed = p->seed,
            .request_id = smp->request_id,
            .mode = rows[i].mode,
            .draft = rows[i].draft,
            .one_hot = rows[i].one_hot,
            .n_undo = smp->seen ? TDM_MIN(rows[i].n_undo, TDM_CU_SAMPLE_MAX_UNDO) : 0,
            .q = rows[i].mode == TDM_SAMPLE_VERIFY ? rows[i].q : NULL,
            .dist = rows[i].mode == TDM_SAMPLE_PROPOSE ? rows[i].dist : NULL,
            .allow_off = -1,
        };
        if (rows[i].allow && rows[i].mode != TDM_SAMPLE_SCORE) {
            for (int j = 0; j < i && hr[i].allow_off < 0; j++)
                if (rows[j].allow == rows[i].allow && hr[j].allow_off >= 0)
                    hr[i].allow_off = hr[j].allow_off;
            if (hr[i].allow_off < 0) {
                hr[i].allow_off = (int32_t)mask_words;
                memcpy(hm + mask_words, rows[i].allow, words * sizeof(uint32_t));
                mask_words += words;
            }
        }
        for (int j = 0; j < hr[i].n_undo; j++)
            hr[i].undo[j] = rows[i].undo[j];
        if (rows[i].mode == TDM_SAMPLE_TREE) {
            hr[i].n_cand = TDM_MIN(TDM_MAX(rows[i].n_cand, 0), TDM_CU_SAMPLE_MAX_CAND);
            for (int j = 0; j < hr[i].n_cand; j++)
                hr[i].cand[j] = rows[i].cand[j];
        }
        /* the penalty list: the seen tokens, each with its bias, then the biased tokens not
         * seen (count 0: their penalties are nothing) */
        const bool draws = rows[i].mode != TDM_SAMPLE_SCORE;
        for (int j = 0; draws && smp->seen && j < smp->n_seen; j++) {
            int32_t t = smp->seen[j];
            hp[off++] = (struct tdm_cu_sample_pen){.id = t,
                                                   .count = smp->out_count[t],
                                                   .in_prompt = smp->prompt_seen[t] != 0,
                                                   .bias = smp->bias ? smp->bias[t] : 0.0f};
        }
        for (int j = 0; draws && j < smp->n_bias; j++) {
            int32_t t = smp->bias_ids[j];
            if (smp->seen && (smp->prompt_seen[t] || smp->out_count[t])) continue; /* listed */
            hp[off++] = (struct tdm_cu_sample_pen){.id = t, .bias = smp->bias[t]};
        }
        hr[i].pen_n = (int32_t)(off - (size_t)hr[i].pen_off);
    }
    TDM_CU_CHECK(cudaMemcpyAsync(cu->d_samp, *hs, staged, cudaMemcpyHostToDevice, cu->stream));
    struct tdm_cu_sample_out *dout = cu->d_sout;
    tdm_cu_sample(cu->stream, logits, n_rows, vocab, cu->d_samp,
                  (struct tdm_cu_sample_pen *)((char *)cu->d_samp + pen_at),
                  (const uint32_t *)((char *)cu->d_samp + mask_at), dout, cu->d_sscratch);
    TDM_CU_CHECK(cudaGetLastError());
    TDM_CU_CHECK(cudaMemcpyAsync(*hout_p, dout, out_bytes, cudaMemcpyDeviceToHost, cu->stream));
    cu->sout_rows = n_rows;
    cu->sout_vocab = vocab;
    tdm_cu_idle_end(cu);
    return TDM_OK;
}

/* ---- $TANDEM_CUDA_IDLE ---- */

void tdm_cu_idle_begin(struct tdm_cuda *cu)
{
    if (!cu->idle_on) return;
    const int prev = cu->idle_slot, k = (prev + 1) % TDM_CU_IDLE_SLOTS;
    if (!cu->idle_end[prev]) cu->idle_last = -1; /* a step that sampled nothing: no chain */
    for (int j = 0; j < 2; j++)
        if (!cu->idle_ev[k][j]) TDM_CU_CHECK(cudaEventCreate(&cu->idle_ev[k][j]));
    if (cu->idle_last == k) cu->idle_last = -1; /* about to be overwritten */
    TDM_CU_CHECK(cudaEventRecord(cu->idle_ev[k][0], cu->stream));
    cu->idle_end[k] = false;
    cu->idle_slot = k;
}

void tdm_cu_idle_end(struct tdm_cuda *cu)
{
    if (!cu->idle_on || !cu->idle_ev[cu->idle_slot][1]) return;
    TDM_CU_CHECK(cudaEventRecord(cu->idle_ev[cu->idle_slot][1], cu->stream));
    cu->idle_end[cu->idle_slot] = true;
}

void tdm_cu_idle_account(struct tdm_cuda *cu, int k)
{
    if (!cu->idle_on || !cu->idle_end[k]) return;
    float busy = 0, gap = -1;
    if (cudaEventElapsedTime(&busy, cu->idle_ev[k][0], cu->idle_ev[k][1]) != cudaSuccess) {
        (void)cudaGetLastError();
        return;
    }
    if (cu->idle_last >= 0 && cudaEventElapsedTime(&gap, cu->idle_ev[cu->idle_last][1],
                                                   cu->idle_ev[k][0]) != cudaSuccess) {
        (void)cudaGetLastError();
        gap = -1;
    }
    cu->idle_last = k;
    if (gap < 0) return; /* the first step, or one after a step that sampled nothing */
    if (gap > TDM_CU_IDLE_LONG_MS) {
        cu->idle_long++;
        return;
    }
    cu->idle_steps++;
    cu->busy_ms += busy;
    cu->idle_ms += gap;
    cu->idle_max_ms = TDM_MAX(cu->idle_max_ms, (double)gap);
}

/* Copies the results in hout to the rows. */
static void unpack(const struct tdm_cu_sample_out *hout, struct tdm_sample_row *rows, int n_rows)
{
    for (int i = 0; i < n_rows; i++) {
        rows[i].token = hout[i].token;
        rows[i].kept = hout[i].kept != 0;
        rows[i].logprob = hout[i].logprob;
        int k = TDM_MIN(rows[i].n_top, TDM_CU_SAMPLE_MAX_TOP);
        for (int j = 0; j < k; j++) {
            rows[i].top_ids[j] = hout[i].top_ids[j];
            rows[i].top_lps[j] = hout[i].top_lps[j];
        }
    }
}

static tdm_status check_vocab(int vocab)
{
    if (vocab <= 0 || vocab > TDM_CU_SAMPLE_MAX_VOCAB)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "cuda backend: device sampling takes vocabularies of up to %d tokens, "
                           "not %d",
                           TDM_CU_SAMPLE_MAX_VOCAB, vocab);
    return TDM_OK;
}

tdm_status tdm_cu_sample_rows(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                              struct tdm_sample_row *rows)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_status st = check_vocab(vocab);
    if (st != TDM_OK || n_rows <= 0) return st;
    tdm_cuda_bind(cu);
    st = queue_sampling(cu, logits, n_rows, vocab, rows, &cu->h_samp, &cu->samp_cap, &cu->h_sout,
                        &cu->sout_cap);
    if (st != TDM_OK) return st;
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    tdm_cu_idle_account(cu, cu->idle_slot);
    unpack(cu->h_sout, rows, n_rows);
    return TDM_OK;
}

tdm_status tdm_cu_sample_launch(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                                const struct tdm_sample_row *rows, int *ticket)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_status st = check_vocab(vocab);
    if (st != TDM_OK) return st;
    if (n_rows <= 0 || cu->prof) /* the profile times each step whole */
        return tdm_err_set(TDM_EUNSUPPORTED, "cuda backend: this sampling is not queued");
    const int t = cu->samp_next;
    if (cu->samp_out[t])
        return tdm_err_set(TDM_EINVAL, "cuda backend: two launched samplings are not waited");
    tdm_cuda_bind(cu);
    if (!cu->samp_ev[t])
        TDM_CU_CHECK(cudaEventCreateWithFlags(&cu->samp_ev[t], cudaEventDisableTiming));
    st = queue_sampling(cu, logits, n_rows, vocab, rows, &cu->ah_samp[t], &cu->asamp_cap[t],
                        &cu->ah_sout[t], &cu->asout_cap[t]);
    if (st != TDM_OK) return st;
    TDM_CU_CHECK(cudaEventRecord(cu->samp_ev[t], cu->stream));
    cu->samp_out[t] = true;
    cu->samp_slot[t] = cu->idle_slot;
    cu->samp_next = t ^ 1;
    *ticket = t;
    tdm_cuda_step_detach(cu); /* the step ends here for the host */
    return TDM_OK;
}

tdm_status tdm_cu_sample_wait(tdm_backend_t *b, int ticket, struct tdm_sample_row *rows, int n_rows)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (ticket < 0 || ticket > 1 || !cu->samp_out[ticket])
        return tdm_err_set(TDM_EINVAL, "cuda backend: no launched sampling %d to wait for", ticket);
    tdm_cuda_bind(cu);
    cu->samp_out[ticket] = false;
    cudaError_t e = cudaEventSynchronize(cu->samp_ev[ticket]);
    if (e != cudaSuccess)
        tdm_cu_fatal("cudaEventSynchronize", cudaGetErrorString(e), __FILE__, __LINE__);
    tdm_cu_idle_account(cu, cu->samp_slot[ticket]);
    if (rows) unpack(cu->ah_sout[ticket], rows, n_rows);
    return TDM_OK;
}

tdm_status tdm_cu_sample_reserve(struct tdm_cuda *cu, int max_rows, int vocab)
{
    if (vocab > 0 && vocab <= TDM_CU_SAMPLE_MAX_VOCAB) {
        tdm_status st = scratch_grow(cu, tdm_cu_sample_scratch_bytes(max_rows, vocab));
        if (st != TDM_OK) return st;
    }
    tdm_status st = stage_grow(cu, &cu->h_samp, &cu->d_samp, &cu->samp_cap,
                               (size_t)max_rows * (sizeof(struct tdm_cu_sample_row) +
                                                   64 * sizeof(struct tdm_cu_sample_pen)) +
                                   64);
    if (st != TDM_OK) return st;
    return stage_grow(cu, &cu->h_sout, &cu->d_sout, &cu->sout_cap,
                      (size_t)max_rows * sizeof(struct tdm_cu_sample_out));
}

void tdm_cu_sample_free(struct tdm_cuda *cu)
{
    for (int t = 0; t < 2; t++) {
        if (cu->ah_samp[t]) cudaFreeHost(cu->ah_samp[t]);
        if (cu->ah_sout[t]) cudaFreeHost(cu->ah_sout[t]);
        if (cu->samp_ev[t]) cudaEventDestroy(cu->samp_ev[t]);
    }
    if (cu->h_samp) cudaFreeHost(cu->h_samp);
    if (cu->d_samp) cudaFree(cu->d_samp);
    if (cu->h_sout) cudaFreeHost(cu->h_sout);
    if (cu->d_sout) cudaFree(cu->d_sout);
    if (cu->d_sscratch) cudaFree(cu->d_sscratch);
}
