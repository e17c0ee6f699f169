/*
 * Private declarations of the CUDA backend (C side): the instance, the cuBLASLt GEMM plan
 * cache and the helpers the op files share.
 *
 * Files: cuda_backend.c (vtable, creation, memory, weights, step metadata, CUDA graphs, layer
 * counter, memory plan, rooflines), cuda_gemm.c (cuBLASLt), cuda_lt.c (the cuBLASLt library,
 * opened on first use), cuda_sample.c (device sampling's staging), kernels.cu, gemv.cu,
 * attention.cu and sample.cu (the kernels, behind cuda_kernels.h).
 *
 * Ownership: the instance owns every device buffer it allocates (weights it converted,
 * workspace, graphs, the pinned staging and counter); buffers handed out by buf_alloc belong
 * to the caller until buf_free.
 *
 * Threading: one thread drives an instance (the engine's compute thread); all work goes to one
 * stream. The mapped counter may be read by any thread.
 */
#ifndef TANDEM_BACKEND_CUDA_INT_H
#define TANDEM_BACKEND_CUDA_INT_H

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "backend/cuda/cuda_kernels.h"
#include "tandem/backend.h"

/* Aborts with a message on a CUDA runtime error (ops cannot return one; see backend.h). */
#define TDM_CU_CHECK(call)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) tdm_cu_fatal(#call, cudaGetErrorString(e_), __FILE__, __LINE__);    \
    } while (0)
_Noreturn void tdm_cu_fatal(const char *what, const char *why, const char *file, int line);

/* The cuBLASLt entry points tandem calls, from the library opened on first use (cuda_lt.c
 * says why it is not linked). Types from cublasLt.h. */
struct tdm_cu_lt {
    __typeof__(&cublasLtCreate) create;
    __typeof__(&cublasLtDestroy) destroy;
    __typeof__(&cublasLtMatmulDescCreate) desc_create;
    __typeof__(&cublasLtMatmulDescDestroy) desc_destroy;
    __typeof__(&cublasLtMatmulDescSetAttribute) desc_set;
    __typeof__(&cublasLtMatrixLayoutCreate) layout_create;
    __typeof__(&cublasLtMatrixLayoutDestroy) layout_destroy;
    __typeof__(&cublasLtMatmulPreferenceCreate) pref_create;
    __typeof__(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    __typeof__(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    __typeof__(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    __typeof__(&cublasLtMatmul) matmul;
};
/* The table, loading the library on the first call; NULL (tdm_err set, naming the library and
 * why) where it cannot be opened. Any thread. */
const struct tdm_cu_lt *tdm_cu_lt(void);
/* tdm_dl_load for a library of the CUDA toolkit (cuBLASLt, NCCL): the normal search, then the
 * toolkit's library folder of the build (cuda_lt.c). Any thread. */
struct tdm_dl_sym;
bool tdm_cu_dl_load(const char *soname, const struct tdm_dl_sym *syms, int n, char *why,
                    size_t why_len);

#define TDM_CU_GEMM_PLANS   96
#define TDM_CU_MAX_GRAPHS   48
#define TDM_CU_IDLE_SLOTS   8  /* steps whose timing events may be alive at once */
#define TDM_CU_IDLE_LONG_MS 20 /* a longer gap between steps is the device without work */
#define TDM_CU_MAX_COUNTERS 8

struct tdm_cu_gemm_plan {
    int m, n, k, ldd;
    bool d_bf16;   /* the output's type: bf16, or fp32 */
    uint64_t used; /* last use, for eviction */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
};

struct tdm_cu_graph {
    const void *owner;
    int bucket;
    int n_layers; /* an early-exit (draft) pass records a loop of its own */
    cudaGraphExec_t exec;
};

struct tdm_cu_owned {
    void *dev;
    struct tdm_weight w;
};

enum {
    P_EMBED,
    P_NORM,
    P_MATMUL,
    P_MULTI,
    P_SWIGLU,
    P_HEADNORM,
    P_ROPE,
    P_ATTN,
    P_GATHER,
    P_OTHER,
    TDM_CU_PROF_N
};
#define TDM_CU_PROF_EVENTS 4096

struct tdm_cuda {
    struct tdm_backend base;
    int device;
    char name[256];
    int n_sms;
    int attn_fill; /* blocks an SM a decode attention grid aims at before its KV is split */
    size_t total_mem;
    double mem_fraction;
    bool graphs_enabled;
    cudaStream_t stream;
    const struct tdm_cu_lt *ltf; /* cuBLASLt's entry points (tdm_cu_lt) */
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_bytes;
    struct tdm_cu_gemm_plan plans[TDM_CU_GEMM_PLANS];
    int n_plans;
    uint64_t plan_clock;

    /* weights made by weight_prepare / random_weight */
    struct tdm_cu_owned *owned;
    int n_owned, cap_owned;
    size_t weight_bytes;
    bool bf16_weights;    /* GGUF blocks dequantised to bf16 at load, not kept (qweight.h) */
    bool batch_invariant; /* kernels chosen by shape alone, never by the batch (cuda_ops.c) */
    /* bf16 rows of a quantised matrix for cuBLASLt (batches past TDM_CU_QGEMV_MAX_N): sized by
     * weight_prepare for the widest quantised matrix, a chunk of rows at a time */
    uint16_t *deq;
    size_t deq_cap;
    int64_t max_cols; /* widest matrix seen (sizes the bf16 input buffer) */

    /* workspace (grown on demand before reserve; fixed after it) */
    uint16_t *xb; /* bf16 copy of a matmul input */
    size_t xb_cap;
    /* bf16 shadow of the last producer's fp32 output: two buffers used in turn, so an op
     * reading one shadow (its input) may write the next (its output) */
    uint16_t *shb[2];
    size_t shb_cap[2];
    int sh_cur;
    const float *sh_ptr; /* the fp32 buffer the shadow mirrors, or NULL */
    size_t sh_elems;
    float *up; /* fp32 up-projection of matmul_swiglu */
    size_t up_cap;
    float *part; /* split-KV attention states */
    size_t part_cap;
    float *d_inv_freq; /* [256] */
    float *h_inv_freq; /* pinned copy of what d_inv_freq holds */
    int inv_n;
    int32_t *d_rows; /* gather_rows indices of calls that are not the current step's */
    int32_t *h_rows;
    size_t rows_cap;
    void *d_moe; /* rows_scale_add: [n] row indices, then [n] weights */
    size_t moe_cap;
    bool reserved;
    size_t workspace_bytes;

    /* step metadata: two pinned stagings used in turn (a step may be uploaded while the one
     * before it still runs: an upload waits only for the copy out of the staging it reuses,
     * meta_ev[i]), and their device copy, laid out by capacity */
    int32_t *h_meta_buf[2], *d_meta;
    cudaEvent_t meta_ev[2];
    int meta_i;
    size_t meta_cap; /* int32 elements */
    int cap_t, cap_s, cap_p, cap_r;
    const struct tdm_step *cur_st; /* the step of the current forward pass, or NULL */
    const int32_t *cur_rows;
    int cur_n_rows;
    int gs_hint, hd_hint; /* the engine's GQA group size and head_dim (reserve) */
    struct tdm_cu_step dstep;
    const int32_t *d_step_rows;
    int dstep_tiling; /* the tile size dstep was cut with (its tile_tokens is the largest tile) */
    bool dstep_graph; /* dstep was padded for a graph: KV lengths vary between replays */
    int dstep_max_kv;

    /* CUDA graphs of decode steps, one per (owner, bucket) */
    struct tdm_cu_graph graphs[TDM_CU_MAX_GRAPHS];
    int n_graphs;
    bool capturing;
    const void *cap_owner;
    int cap_bucket, cap_layers;

    /* layer counters: our own, and callers' registered as mapped memory */
    int32_t *h_counter, *d_counter;
    struct {
        void *host_page;
        _Atomic int32_t *host;
        int32_t *dev;
    } counters[TDM_CU_MAX_COUNTERS];
    int n_counters;

    /* device sampling (cuda_sample.c): row parameters and penalty lists staged in pinned
     * memory and copied in one transfer; results copied back in one */
    void *h_samp, *d_samp;
    size_t samp_cap;
    void *h_sout, *d_sout;
    size_t sout_cap;
    /* launched sampling (sample_launch): per ticket its pinned staging of parameters and
     * results, the event after its results' copy, and whether it is still to be waited */
    void *ah_samp[2], *ah_sout[2];
    size_t asamp_cap[2], asout_cap[2];
    cudaEvent_t samp_ev[2];
    bool samp_out[2];
    int samp_next;
    /* the last sampling's results in d_sout: rows and vocabulary (a later step's
     * TDM_TOKEN_PREV tokens read them) */
    int sout_rows, sout_vocab;
    void *d_sscratch; /* the kernel's exponentials and candidate keys */
    size_t sscratch_cap;

    /* $TANDEM_CUDA_IDLE=1: the device's idle time between steps (cuda_sample.c). Each step
     * takes a slot of timing events: one where its upload begins, one after its sampling. A
     * step's gap is from the end of the last sampled step before it to its start; gaps over
     * TDM_CU_IDLE_LONG_MS (no work at all) are counted apart. */
    bool idle_on;
    cudaEvent_t idle_ev[TDM_CU_IDLE_SLOTS][2];
    bool idle_end[TDM_CU_IDLE_SLOTS]; /* the slot's step sampled (its end event exists) */
    int idle_slot, idle_last;         /* the current step's slot; the last accounted one, -1 */
    int samp_slot[2];                 /* a launched sampling's step slot */
    double idle_ms, busy_ms, idle_max_ms;
    uint64_t idle_steps, idle_long;

    /* tensor parallelism: the group this instance is rank tp_rank of (cuda_tp.c), or NULL */
    struct tdm_cuda_tp *tp;
    int tp_rank;

    /* $TANDEM_CUDA_PROFILE=1: per-op event timing (cuda_backend.c) */
    bool prof, prof_on;
    int prof_max_tokens;
    int prof_n;
    int prof_cat[TDM_CU_PROF_EVENTS];
    cudaEvent_t prof_ev[2 * TDM_CU_PROF_EVENTS];
    double prof_ms[TDM_CU_PROF_N];
    int64_t prof_calls[TDM_CU_PROF_N];
};

static inline struct tdm_cuda *tdm_cu_of(tdm_backend_t *b)
{
    return (struct tdm_cuda *)b->impl;
}

/* d[n][m] (fp32, row-major) = x[n][k] (bf16) . W[m][k]^T (bf16), fp32 accumulation. */
void tdm_cu_gemm(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x, int n,
                 float *d);
/* The same with the output rows ldd floats apart (d: the first of m columns of a wider output). */
void tdm_cu_gemm_ld(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x, int n,
                    float *d, int ldd);
/* The same with a bf16 output (rounded to nearest even from the fp32 accumulation), rows ldd
 * elements apart. */
void tdm_cu_gemm_bf16_ld(struct tdm_cuda *cu, const uint16_t *w, int m, int k, const uint16_t *x,
                         int n, uint16_t *d, int ldd);
/* A quantised device matrix (weight_prepare's, dtype a GGUF block type kept in blocks) as the
 * kernels take it; false for a weight held as bf16 or f32. */
bool tdm_cuda_qpart(const struct tdm_weight *w, struct tdm_cu_qgemv_part *p, int *kind);
/* Rows a chunk of the bf16 dequantisation buffer holds for a matrix of k columns. */
int64_t tdm_cuda_deq_rows(int64_t rows, int64_t k);
/* Grows the dequantisation buffer for a quantised matrix of rows x cols (outside any capture:
 * called as weights are made, never during a step). */
tdm_status tdm_cuda_deq_reserve(struct tdm_cuda *cu, int64_t rows, int64_t cols);
/* Takes dev, a device matrix of layout L (qweight.h) in blocks of dtype, as an owned weight:
 * *out, the instance's weight bytes and widest matrix, and room to dequantise it. On failure
 * dev stays the caller's. */
struct tdm_cu_qlayout;
tdm_status tdm_cuda_own_blocks(struct tdm_cuda *cu, void *dev, const struct tdm_cu_qlayout *L,
                               enum tdm_dtype dtype, struct tdm_weight *out);
void tdm_cu_gemm_destroy(struct tdm_cuda *cu);
/* The backend's `sample` hook (cuda_sample.c) and the buffers it owns. */
tdm_status tdm_cu_sample_rows(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                              struct tdm_sample_row *rows);
/* $TANDEM_CUDA_IDLE: a step begins (step_begin), a step's sampling was queued (its end), and
 * a step's sampling is done (the gap before it and its time are added up). cuda_sample.c. */
void tdm_cu_idle_begin(struct tdm_cuda *cu);
void tdm_cu_idle_end(struct tdm_cuda *cu);
void tdm_cu_idle_account(struct tdm_cuda *cu, int slot);
/* The `sample_launch` and `sample_wait` hooks (cuda_sample.c). */
tdm_status tdm_cu_sample_launch(tdm_backend_t *b, float *logits, int n_rows, int vocab,
                                const struct tdm_sample_row *rows, int *ticket);
tdm_status tdm_cu_sample_wait(tdm_backend_t *b, int ticket, struct tdm_sample_row *rows,
                              int n_rows);
/* Stages room for max_rows rows (and 64 penalty entries a row) of a vocabulary up front
 * (reserve). */
tdm_status tdm_cu_sample_reserve(struct tdm_cuda *cu, int max_rows, int vocab);
void tdm_cu_sample_free(struct tdm_cuda *cu);
int tdm_cu_attention_rows_cap(int hd);

/* ---- shared by the backend's files (cuda_backend.c, cuda_mem.c, cuda_step.c, cuda_ops.c,
 * cuda_profile.c) ---- */
#define LT_WORKSPACE_BYTES ((size_t)32 << 20)
#define STAGING_BYTES      ((size_t)32 << 20)
#define PART_FLOATS        ((size_t)16 << 20) /* 64 MiB of split-KV states */
#define MAX_SPLITS         32
#define BI_SPLITS          16 /* split-KV parts of every token when batch-invariant */
#define INV_FREQ_MAX       (TDM_MAX_HEAD_DIM / 2)

void tdm_cuda_bind(struct tdm_cuda *cu);
void *tdm_cuda_buf_alloc(tdm_backend_t *b, size_t bytes);
void tdm_cuda_buf_free(tdm_backend_t *b, void *p);
void tdm_cuda_upload(tdm_backend_t *b, void *dst, const void *src, size_t bytes);
void tdm_cuda_download(tdm_backend_t *b, void *dst, const void *src, size_t bytes);
void tdm_cuda_grow(struct tdm_cuda *cu, void **buf, size_t *cap, size_t need);
tdm_status tdm_cuda_own(struct tdm_cuda *cu, void *dev, const struct tdm_weight *w);
size_t tdm_cuda_weight_bytes(tdm_backend_t *b, const struct tdm_weight *host);
tdm_status tdm_cuda_weight_prepare(tdm_backend_t *b, const struct tdm_weight *host,
                                   struct tdm_weight *out);
const struct tdm_cu_step *tdm_cuda_dev_step(struct tdm_cuda *cu, const struct tdm_step *st, int gs,
                                            int hd);
void tdm_cuda_drop_graphs(struct tdm_cuda *cu);
void tdm_cuda_step_forget(tdm_backend_t *b, const void *owner);
tdm_status tdm_cuda_step_begin(tdm_backend_t *b, struct tdm_step *st, const int32_t *rows,
                               int n_rows, const void *owner, _Atomic int32_t *counter,
                               bool *replayed);
tdm_status tdm_cuda_step_end(tdm_backend_t *b);
tdm_status tdm_cuda_reserve(tdm_backend_t *b, const struct tdm_backend_limits *lim,
                            size_t *kv_bytes);
void tdm_cuda_prof_begin(struct tdm_cuda *cu, int cat);
void tdm_cuda_prof_end(struct tdm_cuda *cu);
void tdm_cuda_prof_collect(struct tdm_cuda *cu);
void tdm_cuda_prof_report(struct tdm_cuda *cu);
void tdm_cuda_silu_mul(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                       float *out);
void tdm_cuda_add(tdm_backend_t *b, float *x, const float *y, size_t n);
void tdm_cuda_embed(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                    float *out);
void tdm_cuda_rmsnorm(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                      float *out);
void tdm_cuda_add_rmsnorm(tdm_backend_t *b, float *residual, const float *x, const float *w,
                          float eps, int n, int dim, float *out);
void tdm_cuda_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                     const float *bias, float *out);
void tdm_cuda_matmul_multi(tdm_backend_t *b, const float *x, int n,
                           const struct tdm_matmul_part *parts, int n_parts);
void tdm_cuda_matmul_swiglu(tdm_backend_t *b, const struct tdm_weight *w_gate,
                            const struct tdm_weight *w_up, const float *x, int n, float *out);
void tdm_cuda_head_rmsnorm(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                           int head_dim);
void tdm_cuda_rope_kv_append(tdm_backend_t *b, float *q, const float *k, const float *v,
                             int n_heads, const struct tdm_step *st, const struct tdm_rope *rope,
                             const struct tdm_kv_layer *kv);
void tdm_cuda_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                        const struct tdm_kv_layer *kv, float scale, float *out);
void tdm_cuda_scatter_cols(tdm_backend_t *b, const float *x, const int32_t *cols, int n, int n_cols,
                           int width, float *out);
void tdm_cuda_zero(tdm_backend_t *b, float *x, size_t n);
void tdm_cuda_rows_scale_add(tdm_backend_t *b, const float *x, const int32_t *rows,
                             const float *weights, int n, int dim, float *out);
void tdm_cuda_gather_rows(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                          float *out);
void tdm_cuda_head_matmul(tdm_backend_t *b, const struct tdm_weight *w, int n_heads, const float *x,
                          int n, size_t x_stride, size_t x_hstride, float *out, size_t out_stride,
                          size_t out_hstride);
void tdm_cuda_kv_copy(tdm_backend_t *b, const struct tdm_kv_layer *kv, int n_layers,
                      size_t layer_bytes, const int32_t *src, const int32_t *dst, int n);
/* A KV pool's element type as the kernels name it (enum tdm_cu_kv); aborts on another. */
static inline int tdm_cuda_kv_type(enum tdm_dtype t)
{
    TDM_ASSERT(tdm_kv_elem_bytes(t));
    return t == TDM_DTYPE_BF16  ? TDM_CU_KV_BF16
           : t == TDM_DTYPE_F16 ? TDM_CU_KV_F16
                                : TDM_CU_KV_F32;
}
int32_t *tdm_cuda_counter_dev(struct tdm_cuda *cu, _Atomic int32_t *counter);
void tdm_cuda_layer_done(tdm_backend_t *b, int layer, _Atomic int32_t *counter);
void tdm_cuda_sync(tdm_backend_t *b);
/* The allreduce hook (cuda_tp.c). */
void tdm_cuda_allreduce(tdm_backend_t *b, float *x, size_t n);
/* The host's end of a step without waiting for it: the step's arrays and the bf16 shadow are
 * forgotten (tdm_cuda_sync does this after its wait). */
void tdm_cuda_step_detach(struct tdm_cuda *cu);

#endif /* TANDEM_BACKEND_CUDA_INT_H */
