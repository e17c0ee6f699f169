/*
 * The CUDA backend's op-by-op profile ($TANDEM_CUDA_PROFILE=1): each op is bracketed by events,
 * collected at sync and reported when the backend is destroyed. One thread drives an instance.
 */
#include "backend/cuda/cuda_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- profiling ($TANDEM_CUDA_PROFILE=1: op-by-op, each op timed with events;
 * $TANDEM_CUDA_PROFILE_MAX_TOKENS=N: only ops of steps of at most N tokens) ---- */

static const char *const PROF_NAMES[TDM_CU_PROF_N] = {
    "embed",         "rmsnorm",      "matmul",  "matmul_multi (qkv)",
    "matmul_swiglu", "head_rmsnorm", "rope_kv", "attention",
    "gather",        "other"};

void tdm_cuda_prof_begin(struct tdm_cuda *cu, int cat)
{
    if (!cu->prof || cu->prof_n >= TDM_CU_PROF_EVENTS) return;
    cu->prof_on = !cu->cur_st || cu->cur_st->n_tokens <= cu->prof_max_tokens;
    if (!cu->prof_on) return;
    if (!cu->prof_ev[0]) {
        for (int i = 0; i < 2 * TDM_CU_PROF_EVENTS; i++)
            TDM_CU_CHECK(cudaEventCreate(&cu->prof_ev[i]));
    }
    cu->prof_cat[cu->prof_n] = cat;
    TDM_CU_CHECK(cudaEventRecord(cu->prof_ev[2 * cu->prof_n], cu->stream));
}

void tdm_cuda_prof_end(struct tdm_cuda *cu)
{
    if (!cu->prof || !cu->prof_on || cu->prof_n >= TDM_CU_PROF_EVENTS) return;
    TDM_CU_CHECK(cudaEventRecord(cu->prof_ev[2 * cu->prof_n + 1], cu->stream));
    cu->prof_n++;
}

void tdm_cuda_prof_collect(struct tdm_cuda *cu)
{
    for (int i = 0; i < cu->prof_n; i++) {
        float ms = 0;
        TDM_CU_CHECK(cudaEventElapsedTime(&ms, cu->prof_ev[2 * i], cu->prof_ev[2 * i + 1]));
        cu->prof_ms[cu->prof_cat[i]] += ms;
        cu->prof_calls[cu->prof_cat[i]]++;
    }
    cu->prof_n = 0;
}

void tdm_cuda_prof_report(struct tdm_cuda *cu)
{
    if (!cu->prof) return;
    double total = 0;
    for (int i = 0; i < TDM_CU_PROF_N; i++)
        total += cu->prof_ms[i];
    TDM_INFO("cuda profile (device time per op kind, op by op, no graphs): %.1f ms total", total);
    for (int i = 0; i < TDM_CU_PROF_N; i++)
        if (cu->prof_calls[i])
            TDM_INFO("  %-20s %10.2f ms %5.1f%% %8lld calls %9.1f us/call", PROF_NAMES[i],
                     cu->prof_ms[i], 100.0 * cu->prof_ms[i] / (total > 0 ? total : 1),
                     (long long)cu->prof_calls[i], 1e3 * cu->prof_ms[i] / cu->prof_calls[i]);
}
