/*
 * The CUDA backend: its vtable, creation, device memory, weight conversion, step metadata,
 * CUDA graphs of decode steps, the layer-completion counter, the memory plan and the
 * rooflines that `tandem bench model --backend cuda` prints.
 *
 * Contract choices (backend.h has the user-facing summary):
 *   - Activations stay fp32 in device memory, as the vtable says; a matmul rounds its input to
 *     bf16 (one conversion pass, skipped when the producing op already wrote a bf16 "shadow"
 *     of that buffer: the norms, SiLU*mul and attention do) and cuBLASLt multiplies it by the
 *     bf16 weight with fp32 accumulation into an fp32 output.
 *   - Weights: matrices become bf16 on the device (GGUF blocks dequantised on the host first),
 *     vectors stay fp32. A weight whose data is already device memory (random benchmark
 *     weights) is passed through.
 *   - Index arrays the ops take (tokens, rows, the tdm_step) are host memory, as for the CPU.
 *     step_begin uploads the step once per forward pass into fixed device buffers, laid out
 *     by capacity so their addresses never move; an op given any other step or index array
 *     (the op test calls ops directly) uploads it on the spot.
 *
 * CUDA graphs: a step whose sequences all add one token (a decode step) is padded up to a
 * bucket (1, 2, 4, 8, 16, 32, 48, 64, then steps of 32 to 256, then of 64) and the layer loop
 * of the engine is recorded once per (engine, bucket) and replayed afterwards. Everything a
 * replay depends on lives at fixed device addresses: the metadata buffers, the workspace,
 * the engine's scratch and KV pool, the weights. Padding tokens get their own empty sequence
 * (KV length 0, no slot): they write no KV, attend to nothing and touch only their own rows.
 * Split-KV attention in a graph uses a split count fixed by the bucket (attention.cu).
 *
 * Layer counter: layer_done launches a one-thread kernel that stores layer + 1 into a device
 * alias of mapped pinned host memory, so it also runs inside graphs. The counter is either the
 * backend's own (tdm_backend_cuda_counter) or the caller's, whose page is registered as mapped
 * memory by step_begin (outside any capture).
 *
 * Memory plan (reserve): the KV pool gets fraction * total device memory minus everything in
 * use once the weights, the engine's scratch and the worst-case workspace are allocated; the
 * plan is logged at INFO.
 *
 * Errors: a CUDA error inside an op is fatal (tdm_cu_fatal: message, then abort), since ops
 * return nothing; creation and weight preparation return TDM_E* with a message.
 *
 * Threading: one thread drives an instance; all work is on one non-blocking stream.
 */
#include "backend/cuda/cuda_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define LT_WORKSPACE_BYTES ((size_t)32 << 20)
#define STAGING_BYTES      ((size_t)32 << 20)
#define PART_FLOATS        ((size_t)16 << 20) /* 64 MiB of split-KV states */
#define MAX_SPLITS         32
#define INV_FREQ_MAX       (TDM_MAX_HEAD_DIM / 2)

_Noreturn void tdm_cu_fatal(const char *what, const char *why, const char *file, int line)
{
    TDM_ERROR("cuda backend: %s failed: %s (%s:%d)", what, why, file, line);
    abort();
}

/* ---- memory ---- */

/* Makes the instance's device current on the calling thread (the engine may be driven from a
 * thread other than the one that created it; the runtime's current device is per thread). */
static void bind(struct tdm_cuda *cu)
{
    if (cu->device != 0) cudaSetDevice(cu->device);
}

static void *cu_buf_alloc(tdm_backend_t *b, size_t bytes)
{
    bind(tdm_cu_of(b));
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cu_buf_free(tdm_backend_t *b, void *p)
{
    if (p) cudaFree(p);
}

static void cu_upload(tdm_backend_t *b, void *dst, const void *src, size_t bytes)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (!bytes) return;
    TDM_CU_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cu->stream));
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
}

static void cu_download(tdm_backend_t *b, void *dst, const void *src, size_t bytes)
{
    cu_upload(b, dst, src, bytes);
}

/* Grows a workspace buffer to `need` bytes. Only outside a capture: graphs recorded with the
 * old buffer are dropped. */
static void drop_graphs(struct tdm_cuda *cu);
static void grow(struct tdm_cuda *cu, void **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return;
    if (cu->capturing)
        tdm_cu_fatal("workspace growth", "inside a CUDA-graph capture (reserve too small)",
                     __FILE__, __LINE__);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    drop_graphs(cu);
    if (*buf) cudaFree(*buf);
    *buf = NULL;
    *cap = 0;
    TDM_CU_CHECK(cudaMalloc(buf, need));
    *cap = need;
}

/* ---- weights ---- */

static bool is_device_ptr(const void *p)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

static tdm_status own(struct tdm_cuda *cu, void *dev, const struct tdm_weight *w)
{
    if (cu->n_owned == cu->cap_owned) {
        int cap = cu->cap_owned ? 2 * cu->cap_owned : 64;
        struct tdm_cu_owned *n = realloc(cu->owned, (size_t)cap * sizeof *n);
        if (!n) return tdm_err_set(TDM_ENOMEM, "cuda backend: out of memory");
        cu->owned = n;
        cu->cap_owned = cap;
    }
    cu->owned[cu->n_owned++] = (struct tdm_cu_owned){.dev = dev, .w = *w};
    return TDM_OK;
}

static tdm_status cu_weight_prepare(tdm_backend_t *b, const struct tdm_weight *host,
                                    struct tdm_weight *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    bind(cu);
    if (!host->data) {
        *out = *host;
        return TDM_OK;
    }
    if (host->rows < 1 || host->cols < 1 || host->rows > INT32_MAX || host->cols > INT32_MAX)
        return tdm_err_set(TDM_EINVAL, "cuda backend: weight of %lld x %lld", (long long)host->rows,
                           (long long)host->cols);
    const bool vec = host->rows == 1;
    if (is_device_ptr(host->data)) {
        if (host->dtype != (vec ? TDM_DTYPE_F32 : TDM_DTYPE_BF16))
            return tdm_err_set(TDM_EUNSUPPORTED, "cuda backend: a device weight must be %s, not %s",
                               vec ? "f32" : "bf16", tdm_dtype_name(host->dtype));
        *out = *host;
        if (!vec) cu->max_cols = TDM_MAX(cu->max_cols, host->cols);
        return TDM_OK;
    }
    const size_t rb = tdm_dtype_row_bytes(host->dtype, host->cols);
    if (rb == 0 || host->row_bytes != rb)
        return tdm_err_set(TDM_EINVAL,
                           "cuda backend: %s weight with %lld columns has row_bytes %zu",
                           tdm_dtype_name(host->dtype), (long long)host->cols, host->row_bytes);
    /* a vector is held as fp32 followed by a bf16 copy (used if it is ever a 1-row matrix) */
    const size_t esz = vec ? sizeof(float) : sizeof(uint16_t);
    const size_t row_out = (size_t)host->cols * esz;
    const size_t bytes = row_out * (size_t)host->rows + (vec ? (size_t)host->cols * 2 : 0);
    void *dev = NULL;
    if (cudaMalloc(&dev, bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes for a weight",
                           bytes);
    }
    tdm_status st = TDM_OK;
    float *row = malloc((size_t)host->cols * sizeof(float));
    uint8_t *staging = NULL;
    if (!row || cudaMallocHost((void **)&staging, STAGING_BYTES) != cudaSuccess) {
        (void)cudaGetLastError();
        st = tdm_err_set(TDM_ENOMEM, "cuda backend: out of host memory");
        goto out_free;
    }
    const int64_t rows_per_chunk = TDM_MAX(1, (int64_t)(STAGING_BYTES / row_out));
    for (int64_t r0 = 0; r0 < host->rows; r0 += rows_per_chunk) {
        const int64_t nr = TDM_MIN(rows_per_chunk, host->rows - r0);
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *src = (const uint8_t *)host->data + (size_t)(r0 + r) * host->row_bytes;
            uint8_t *dst = staging + (size_t)r * row_out;
            if (!vec && host->dtype == TDM_DTYPE_BF16) {
                memcpy(dst, src, row_out);
                continue;
            }
            if ((st = tdm_dequantize(host->dtype, src, row, host->cols)) != TDM_OK) goto out_free;
            if (vec) {
                memcpy(dst, row, row_out);
                uint16_t *d16 = (uint16_t *)(dst + row_out);
                for (int64_t c = 0; c < host->cols; c++)
                    d16[c] = tdm_f32_to_bf16(row[c]);
            } else {
                uint16_t *d16 = (uint16_t *)dst;
                for (int64_t c = 0; c < host->cols; c++)
                    d16[c] = tdm_f32_to_bf16(row[c]);
            }
        }
        if (cudaMemcpy((uint8_t *)dev + (size_t)r0 * row_out, staging,
                       (size_t)nr * row_out + (vec ? (size_t)host->cols * 2 : 0),
                       cudaMemcpyHostToDevice) != cudaSuccess) {
            (void)cudaGetLastError();
            st = tdm_err_set(TDM_EIO, "cuda backend: weight upload failed");
            goto out_free;
        }
    }
    *out = (struct tdm_weight){.dtype = vec ? TDM_DTYPE_F32 : TDM_DTYPE_BF16,
                               .rows = host->rows,
                               .cols = host->cols,
                               .row_bytes = row_out,
                               .data = dev};
    if ((st = own(cu, dev, out)) != TDM_OK) goto out_free;
    cu->weight_bytes += bytes;
    if (!vec) cu->max_cols = TDM_MAX(cu->max_cols, host->cols);
    cudaFreeHost(staging);
    free(row);
    return TDM_OK;
out_free:
    if (staging) cudaFreeHost(staging);
    free(row);
    cudaFree(dev);
    return st;
}

/* ---- step metadata ---- */

enum { M_TOKENS, M_POS, M_SLOTS, M_TSEQ, M_TILES, M_STS, M_KVLEN, M_SPS, M_ROWS, M_PAGES, M_N };

/* Offsets (int32 elements) of each array in the metadata buffers, from the capacities. */
static void meta_offsets(const struct tdm_cuda *cu, size_t off[M_N + 1])
{
    const size_t T = (size_t)cu->cap_t, S = (size_t)cu->cap_s;
    const size_t len[M_N] = {
        T, T, T, T, 3 * T, S + 1, S, S + 1, (size_t)cu->cap_r, (size_t)cu->cap_p};
    off[0] = 0;
    for (int i = 0; i < M_N; i++)
        off[i + 1] = off[i] + ((len[i] + 31) & ~(size_t)31);
}

/* Makes the metadata buffers hold at least these capacities (outside a capture). */
static void meta_reserve(struct tdm_cuda *cu, int t, int s, int p, int r)
{
    if (t <= cu->cap_t && s <= cu->cap_s && p <= cu->cap_p && r <= cu->cap_r) return;
    if (cu->capturing)
        tdm_cu_fatal("metadata growth", "inside a CUDA-graph capture", __FILE__, __LINE__);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    drop_graphs(cu);
    cu->cap_t = TDM_MAX(cu->cap_t, t);
    cu->cap_s = TDM_MAX(cu->cap_s, s);
    cu->cap_p = TDM_MAX(cu->cap_p, p);
    cu->cap_r = TDM_MAX(cu->cap_r, r);
    size_t off[M_N + 1];
    meta_offsets(cu, off);
    if (cu->h_meta) cudaFreeHost(cu->h_meta);
    if (cu->d_meta) cudaFree(cu->d_meta);
    cu->h_meta = NULL;
    cu->d_meta = NULL;
    TDM_CU_CHECK(cudaMallocHost((void **)&cu->h_meta, off[M_N] * sizeof(int32_t)));
    TDM_CU_CHECK(cudaMalloc((void **)&cu->d_meta, off[M_N] * sizeof(int32_t)));
    cu->meta_cap = off[M_N];
}

/* Tokens per attention tile for a GQA group of gs heads (0: unknown, one token per tile). */
static int tile_tokens_for(int gs, int hd)
{
    return gs > 0 ? TDM_MAX(1, tdm_cu_attention_rows_cap(hd) / gs) : 1;
}

/* Copies a host step (and its logit rows) into the device buffers, padded to `pad` tokens when
 * pad > n_tokens (each padding token its own empty sequence), and fills cu->dstep. A graph
 * step has one token per attention tile, so the attention grid depends only on the bucket. */
static void upload_step(struct tdm_cuda *cu, const struct tdm_step *st, const int32_t *rows,
                        int n_rows, int pad, bool graph, int tile_tokens)
{
    const int T = st->n_tokens, S = st->n_seqs, P = st->seq_page_start[S];
    const int Tp = TDM_MAX(T, pad), Sp = S + (Tp - T);
    meta_reserve(cu, Tp, Sp, P, n_rows);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream)); /* the staging may still be in a copy */
    size_t off[M_N + 1];
    meta_offsets(cu, off);
    int32_t *h = cu->h_meta;
    memcpy(h + off[M_TOKENS], st->tokens, (size_t)T * 4);
    memcpy(h + off[M_POS], st->positions, (size_t)T * 4);
    memcpy(h + off[M_SLOTS], st->slots, (size_t)T * 4);
    memcpy(h + off[M_TSEQ], st->token_seq, (size_t)T * 4);
    memcpy(h + off[M_STS], st->seq_token_start, (size_t)(S + 1) * 4);
    memcpy(h + off[M_KVLEN], st->seq_kv_len, (size_t)S * 4);
    memcpy(h + off[M_SPS], st->seq_page_start, (size_t)(S + 1) * 4);
    memcpy(h + off[M_PAGES], st->page_ids, (size_t)P * 4);
    if (n_rows > 0 && rows) memcpy(h + off[M_ROWS], rows, (size_t)n_rows * 4);
    for (int t = T; t < Tp; t++) {
        const int s = S + (t - T);
        h[off[M_TOKENS] + t] = 0;
        h[off[M_POS] + t] = 0;
        h[off[M_SLOTS] + t] = -1;
        h[off[M_TSEQ] + t] = s;
        h[off[M_STS] + s + 1] = t + 1;
        h[off[M_KVLEN] + s] = 0;
        h[off[M_SPS] + s + 1] = P;
    }
    if (graph) tile_tokens = 1;
    int n_tiles = 0, max_kv = 0, max_tile = 1;
    int32_t *tiles = h + off[M_TILES];
    for (int s = 0; s < Sp; s++) {
        const int t0 = h[off[M_STS] + s], t1 = h[off[M_STS] + s + 1];
        max_kv = TDM_MAX(max_kv, h[off[M_KVLEN] + s]);
        for (int t = t0; t < t1; t += tile_tokens) {
            tiles[3 * n_tiles] = s;
            tiles[3 * n_tiles + 1] = t;
            tiles[3 * n_tiles + 2] = TDM_MIN(tile_tokens, t1 - t);
            max_tile = TDM_MAX(max_tile, tiles[3 * n_tiles + 2]);
            n_tiles++;
        }
    }
    TDM_ASSERT(n_tiles <= cu->cap_t);
    TDM_CU_CHECK(cudaMemcpyAsync(cu->d_meta, h, (off[M_PAGES] + (size_t)P) * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, cu->stream));
    const int32_t *d = cu->d_meta;
    cu->dstep = (struct tdm_cu_step){.n_tokens = Tp,
                                     .n_seqs = Sp,
                                     .page_size = st->page_size,
                                     .tokens = d + off[M_TOKENS],
                                     .positions = d + off[M_POS],
                                     .slots = d + off[M_SLOTS],
                                     .token_seq = d + off[M_TSEQ],
                                     .seq_token_start = d + off[M_STS],
                                     .seq_kv_len = d + off[M_KVLEN],
                                     .seq_page_start = d + off[M_SPS],
                                     .page_ids = d + off[M_PAGES],
                                     .tiles = d + off[M_TILES],
                                     .n_tiles = n_tiles,
                                     .tile_tokens = max_tile};
    cu->dstep_tiling = tile_tokens;
    cu->d_step_rows = d + off[M_ROWS];
    cu->dstep_graph = graph;
    cu->dstep_max_kv = max_kv;
}

/* The device form of `st`: the current step's, or a fresh upload (direct op calls). gs > 0:
 * the caller is attention, which needs tiles for its group size; a step tiled for another
 * (possible only outside graphs) is re-tiled. */
static const struct tdm_cu_step *dev_step(struct tdm_cuda *cu, const struct tdm_step *st, int gs,
                                          int hd)
{
    if (st == cu->cur_st) {
        if (gs <= 0 || cu->dstep_graph || cu->dstep_tiling == tile_tokens_for(gs, hd))
            return &cu->dstep;
        upload_step(cu, st, cu->cur_rows, cu->cur_n_rows, 0, false, tile_tokens_for(gs, hd));
        return &cu->dstep;
    }
    cu->cur_st = NULL;
    cu->cur_rows = NULL;
    upload_step(cu, st, NULL, 0, 0, false, tile_tokens_for(gs, hd));
    return &cu->dstep;
}

/* ---- profiling ($TANDEM_CUDA_PROFILE=1: op-by-op, each op timed with events;
 * $TANDEM_CUDA_PROFILE_MAX_TOKENS=N: only ops of steps of at most N tokens) ---- */

static const char *const PROF_NAMES[TDM_CU_PROF_N] = {
    "embed",         "rmsnorm",      "matmul",  "matmul_multi (qkv)",
    "matmul_swiglu", "head_rmsnorm", "rope_kv", "attention",
    "gather",        "other"};

static void prof_begin(struct tdm_cuda *cu, int cat)
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

static void prof_end(struct tdm_cuda *cu)
{
    if (!cu->prof || !cu->prof_on || cu->prof_n >= TDM_CU_PROF_EVENTS) return;
    TDM_CU_CHECK(cudaEventRecord(cu->prof_ev[2 * cu->prof_n + 1], cu->stream));
    cu->prof_n++;
}

static void prof_collect(struct tdm_cuda *cu)
{
    for (int i = 0; i < cu->prof_n; i++) {
        float ms = 0;
        TDM_CU_CHECK(cudaEventElapsedTime(&ms, cu->prof_ev[2 * i], cu->prof_ev[2 * i + 1]));
        cu->prof_ms[cu->prof_cat[i]] += ms;
        cu->prof_calls[cu->prof_cat[i]]++;
    }
    cu->prof_n = 0;
}

static void prof_report(struct tdm_cuda *cu)
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

/* ---- ops ---- */

static inline void check_launch(void)
{
    TDM_CU_CHECK(cudaGetLastError());
}

static void shadow_clear(struct tdm_cuda *cu)
{
    cu->sh_ptr = NULL;
}

/* A bf16 buffer a producer may write next to its fp32 output of n elements: the shadow buffer
 * not holding the current shadow (which may be the producer's own input). NULL inside a
 * capture when it is too small (the producer then writes fp32 only). */
static uint16_t *shadow_for(struct tdm_cuda *cu, const float *out, size_t n)
{
    const int i = cu->sh_cur ^ 1;
    if (n > cu->shb_cap[i] / sizeof(uint16_t)) {
        if (cu->capturing) {
            shadow_clear(cu);
            return NULL;
        }
        grow(cu, (void **)&cu->shb[i], &cu->shb_cap[i], n * sizeof(uint16_t));
    }
    cu->sh_cur = i;
    cu->sh_ptr = out;
    cu->sh_elems = n;
    return cu->shb[i];
}

/* The bf16 form of a matmul input x [n][cols]: the shadow if it mirrors x, else a conversion. */
static const uint16_t *bf16_input(struct tdm_cuda *cu, const float *x, int n, int64_t cols)
{
    const size_t elems = (size_t)n * (size_t)cols;
    if (cu->sh_ptr == x && cu->sh_elems == elems) return cu->shb[cu->sh_cur];
    grow(cu, (void **)&cu->xb, &cu->xb_cap, elems * sizeof(uint16_t));
    tdm_cu_f32_to_bf16(cu->stream, x, elems, cu->xb);
    check_launch();
    return cu->xb;
}

static void cu_embed_impl(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens,
                          int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    if (n <= 0) return;
    TDM_ASSERT(emb->dtype == TDM_DTYPE_BF16);
    const int32_t *dt;
    if (cu->cur_st && tokens == cu->cur_st->tokens) {
        dt = cu->dstep.tokens;
    } else {
        grow(cu, (void **)&cu->d_rows, &cu->rows_cap, (size_t)n * sizeof(int32_t));
        TDM_CU_CHECK(
            cudaMemcpyAsync(cu->d_rows, tokens, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        dt = cu->d_rows;
    }
    tdm_cu_embed(cu->stream, emb->data, emb->cols, dt, n, out, NULL);
    check_launch();
}

static void cu_rmsnorm_impl(tdm_backend_t *b, const float *x, const float *w, float eps, int n,
                            int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    uint16_t *sh = shadow_for(cu, out, (size_t)n * dim);
    tdm_cu_rmsnorm(cu->stream, (float *)x, NULL, w, eps, n, dim, out, sh);
    check_launch();
}

static void cu_add_rmsnorm_impl(tdm_backend_t *b, float *residual, const float *x, const float *w,
                                float eps, int n, int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    uint16_t *sh = shadow_for(cu, out, (size_t)n * dim);
    tdm_cu_rmsnorm(cu->stream, residual, x, w, eps, n, dim, out, sh);
    check_launch();
}

/* The bf16 matrix of a prepared weight (a 1-row fp32 "vector" carries a bf16 copy after it). */
static const uint16_t *bf16_matrix(const struct tdm_weight *w)
{
    if (w->dtype == TDM_DTYPE_BF16) return w->data;
    TDM_ASSERT(w->dtype == TDM_DTYPE_F32 && w->rows == 1);
    return (const uint16_t *)((const float *)w->data + w->cols);
}

static void matmul_into(struct tdm_cuda *cu, const struct tdm_weight *w, const uint16_t *xb, int n,
                        const float *bias, float *out)
{
    if (out == cu->sh_ptr) shadow_clear(cu);
    const struct tdm_cu_gemv_part p = {bf16_matrix(w), bias, out, (int)w->rows};
    if (n <= TDM_CU_GEMV_MAX_N &&
        tdm_cu_gemv(cu->stream, &p, 1, (int)w->cols, xb, n, false, NULL)) {
        check_launch();
        return;
    }
    tdm_cu_gemm(cu, bf16_matrix(w), (int)w->rows, (int)w->cols, xb, n, out);
    if (bias) tdm_cu_add_bias(cu->stream, out, bias, n, (int)w->rows);
    check_launch();
}

static void cu_matmul_impl(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                           const float *bias, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0) return;
    const uint16_t *xb = bf16_input(cu, x, n, w->cols);
    matmul_into(cu, w, xb, n, bias, out);
}

static void cu_matmul_multi_impl(tdm_backend_t *b, const float *x, int n,
                                 const struct tdm_matmul_part *parts, int n_parts)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0 || n_parts <= 0) return;
    const uint16_t *xb = bf16_input(cu, x, n, parts[0].w->cols);
    if (n <= TDM_CU_GEMV_MAX_N && n_parts <= 4) { /* one launch for all parts */
        struct tdm_cu_gemv_part gp[4];
        for (int i = 0; i < n_parts; i++) {
            if (parts[i].out == cu->sh_ptr) shadow_clear(cu);
            gp[i] = (struct tdm_cu_gemv_part){bf16_matrix(parts[i].w), parts[i].bias, parts[i].out,
                                              (int)parts[i].w->rows};
        }
        if (tdm_cu_gemv(cu->stream, gp, n_parts, (int)parts[0].w->cols, xb, n, false, NULL)) {
            check_launch();
            return;
        }
    }
    for (int i = 0; i < n_parts; i++)
        matmul_into(cu, parts[i].w, xb, n, parts[i].bias, parts[i].out);
}

static void cu_matmul_swiglu_impl(tdm_backend_t *b, const struct tdm_weight *w_gate,
                                  const struct tdm_weight *w_up, const float *x, int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (n <= 0) return;
    const size_t elems = (size_t)n * (size_t)w_gate->rows;
    const uint16_t *xb = bf16_input(cu, x, n, w_gate->cols);
    if (n <= TDM_CU_GEMV_MAX_N) { /* gate, up and silu * mul in one launch */
        if (out == cu->sh_ptr) shadow_clear(cu);
        const struct tdm_cu_gemv_part gp[2] = {{bf16_matrix(w_gate), NULL, out, (int)w_gate->rows},
                                               {bf16_matrix(w_up), NULL, NULL, (int)w_up->rows}};
        uint16_t *sh = shadow_for(cu, out, elems);
        if (tdm_cu_gemv(cu->stream, gp, 2, (int)w_gate->cols, xb, n, true, sh)) {
            check_launch();
            return;
        }
        shadow_clear(cu);
    }
    grow(cu, (void **)&cu->up, &cu->up_cap, elems * sizeof(float));
    matmul_into(cu, w_gate, xb, n, NULL, out);
    matmul_into(cu, w_up, xb, n, NULL, cu->up);
    uint16_t *sh = shadow_for(cu, out, elems);
    tdm_cu_silu_mul(cu->stream, out, cu->up, elems, out, sh);
    check_launch();
}

static void cu_head_rmsnorm_impl(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                                 int head_dim)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_rmsnorm(cu->stream, x, NULL, w, eps, n_rows, head_dim, x, NULL);
    check_launch();
}

static const float *inv_freq_dev(struct tdm_cuda *cu, const struct tdm_rope *rope)
{
    const int half = rope->head_dim / 2;
    TDM_ASSERT(half > 0 && half <= INV_FREQ_MAX);
    if (cu->inv_n != half || memcmp(cu->h_inv_freq, rope->inv_freq, (size_t)half * 4) != 0) {
        /* inside a capture this copy becomes a graph node reading the pinned copy, which
         * keeps these values until the next change (which drops the graphs) */
        if (cu->inv_n != 0 && !cu->capturing) {
            TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
            drop_graphs(cu);
        }
        memcpy(cu->h_inv_freq, rope->inv_freq, (size_t)half * 4);
        cu->inv_n = half;
        TDM_CU_CHECK(cudaMemcpyAsync(cu->d_inv_freq, cu->h_inv_freq, (size_t)half * 4,
                                     cudaMemcpyHostToDevice, cu->stream));
    }
    return cu->d_inv_freq;
}

static void cu_rope_kv_append_impl(tdm_backend_t *b, float *q, const float *k, const float *v,
                                   int n_heads, const struct tdm_step *st,
                                   const struct tdm_rope *rope, const struct tdm_kv_layer *kv)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_ASSERT(rope->head_dim == kv->head_dim && st->page_size == kv->page_size);
    const struct tdm_cu_step *ds = dev_step(cu, st, 0, kv->head_dim);
    const float *inv = inv_freq_dev(cu, rope);
    tdm_cu_rope_kv_append(cu->stream, q, k, v, n_heads, kv->n_kv_heads, rope->head_dim, rope->neox,
                          inv, ds, kv->base);
    check_launch();
}

static void cu_attention_impl(tdm_backend_t *b, const float *q, int n_heads,
                              const struct tdm_step *st, const struct tdm_kv_layer *kv, float scale,
                              float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    TDM_ASSERT(kv->n_kv_heads > 0 && n_heads % kv->n_kv_heads == 0);
    const int gs = n_heads / kv->n_kv_heads, hd = kv->head_dim;
    const struct tdm_cu_step *ds = dev_step(cu, st, gs, hd);
    /* split-KV when the (tile, KV head) blocks would not fill the GPU twice over */
    const int blocks = ds->n_tiles * kv->n_kv_heads;
    int splits = 1;
    if (blocks < 2 * cu->n_sms) {
        splits = TDM_MIN(MAX_SPLITS, (2 * cu->n_sms + blocks - 1) / blocks);
        if (!cu->dstep_graph) splits = TDM_MIN(splits, (cu->dstep_max_kv + 31) / 32);
        const size_t per = (size_t)ds->n_tokens * n_heads * (hd + 2);
        while (splits > 1 && (size_t)splits * per > cu->part_cap / sizeof(float)) {
            if (!cu->capturing && !cu->reserved) {
                grow(cu, (void **)&cu->part, &cu->part_cap,
                     TDM_MIN((size_t)splits * per, PART_FLOATS) * sizeof(float));
                if ((size_t)splits * per <= cu->part_cap / sizeof(float)) break;
            }
            splits--;
        }
        splits = TDM_MAX(splits, 1);
    }
    uint16_t *sh = shadow_for(cu, out, (size_t)st->n_tokens * n_heads * hd);
    if (!tdm_cu_attention(cu->stream, q, n_heads, kv->n_kv_heads, hd, ds, kv->base, scale, out, sh,
                          splits, cu->part))
        tdm_cu_fatal("attention", "unsupported shape (head_dim > 512 or > 64 heads per KV head)",
                     __FILE__, __LINE__);
    check_launch();
}

static void cu_silu_mul(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                        float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_silu_mul(cu->stream, gate, up, (size_t)n * dim, out, NULL);
    check_launch();
}

static void cu_add(tdm_backend_t *b, float *x, const float *y, size_t n)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    tdm_cu_add(cu->stream, x, y, n);
    check_launch();
}

static void cu_gather_rows_impl(tdm_backend_t *b, const float *x, const int32_t *rows, int n,
                                int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    shadow_clear(cu);
    if (n <= 0) return;
    const int32_t *dr;
    if (cu->cur_st && rows == cu->cur_rows) {
        dr = cu->d_step_rows;
    } else {
        grow(cu, (void **)&cu->d_rows, &cu->rows_cap, (size_t)n * sizeof(int32_t));
        TDM_CU_CHECK(
            cudaMemcpyAsync(cu->d_rows, rows, (size_t)n * 4, cudaMemcpyHostToDevice, cu->stream));
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        dr = cu->d_rows;
    }
    tdm_cu_gather_rows(cu->stream, x, dr, n, dim, out);
    check_launch();
}

static void cu_embed(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                     float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_EMBED);
    cu_embed_impl(b, emb, tokens, n, out);
    prof_end(cu);
}

static void cu_rmsnorm(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                       float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_NORM);
    cu_rmsnorm_impl(b, x, w, eps, n, dim, out);
    prof_end(cu);
}

static void cu_add_rmsnorm(tdm_backend_t *b, float *residual, const float *x, const float *w,
                           float eps, int n, int dim, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_NORM);
    cu_add_rmsnorm_impl(b, residual, x, w, eps, n, dim, out);
    prof_end(cu);
}

static void cu_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                      const float *bias, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_MATMUL);
    cu_matmul_impl(b, w, x, n, bias, out);
    prof_end(cu);
}

static void cu_matmul_multi(tdm_backend_t *b, const float *x, int n,
                            const struct tdm_matmul_part *parts, int n_parts)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_MULTI);
    cu_matmul_multi_impl(b, x, n, parts, n_parts);
    prof_end(cu);
}

static void cu_matmul_swiglu(tdm_backend_t *b, const struct tdm_weight *w_gate,
                             const struct tdm_weight *w_up, const float *x, int n, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_SWIGLU);
    cu_matmul_swiglu_impl(b, w_gate, w_up, x, n, out);
    prof_end(cu);
}

static void cu_head_rmsnorm(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                            int head_dim)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_HEADNORM);
    cu_head_rmsnorm_impl(b, x, w, eps, n_rows, head_dim);
    prof_end(cu);
}

static void cu_rope_kv_append(tdm_backend_t *b, float *q, const float *k, const float *v,
                              int n_heads, const struct tdm_step *st, const struct tdm_rope *rope,
                              const struct tdm_kv_layer *kv)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_ROPE);
    cu_rope_kv_append_impl(b, q, k, v, n_heads, st, rope, kv);
    prof_end(cu);
}

static void cu_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                         const struct tdm_kv_layer *kv, float scale, float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_ATTN);
    cu_attention_impl(b, q, n_heads, st, kv, scale, out);
    prof_end(cu);
}

static void cu_gather_rows(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                           float *out)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    prof_begin(cu, P_GATHER);
    cu_gather_rows_impl(b, x, rows, n, dim, out);
    prof_end(cu);
}

/* The device alias of a counter; registers a caller's counter page once (not while capturing). */
static int32_t *counter_dev(struct tdm_cuda *cu, _Atomic int32_t *counter)
{
    if ((void *)counter == (void *)cu->h_counter) return cu->d_counter;
    for (int i = 0; i < cu->n_counters; i++)
        if (cu->counters[i].host == counter) return cu->counters[i].dev;
    if (cu->capturing || cu->n_counters == TDM_CU_MAX_COUNTERS) return NULL;
    const long pg = sysconf(_SC_PAGESIZE);
    void *page = (void *)((uintptr_t)counter & ~(uintptr_t)(pg - 1));
    int32_t *dev = NULL;
    cudaError_t e = cudaHostRegister(page, (size_t)pg, cudaHostRegisterMapped);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
        (void)cudaGetLastError();
        page = NULL; /* someone else's registration: use it, do not unregister it */
    } else if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    if (cudaHostGetDevicePointer((void **)&dev, (void *)counter, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        if (page) cudaHostUnregister(page);
        return NULL;
    }
    cu->counters[cu->n_counters].host_page = page;
    cu->counters[cu->n_counters].host = counter;
    cu->counters[cu->n_counters].dev = dev;
    cu->n_counters++;
    return dev;
}

static void cu_layer_done(tdm_backend_t *b, int layer, _Atomic int32_t *counter)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    int32_t *d = counter_dev(cu, counter);
    if (!d) {
        /* not mappable: publish after the work completes (not possible inside a capture) */
        if (cu->capturing) tdm_cu_fatal("layer_done", "counter not registered", __FILE__, __LINE__);
        TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
        atomic_store_explicit(counter, layer + 1, memory_order_release);
        return;
    }
    tdm_cu_store_counter(cu->stream, d, layer + 1);
    check_launch();
}

static void cu_sync(tdm_backend_t *b)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    if (cu->prof) prof_collect(cu);
    cu->cur_st = NULL;
    cu->cur_rows = NULL;
    shadow_clear(cu);
}

/* ---- graphs ---- */

static void drop_graphs(struct tdm_cuda *cu)
{
    for (int i = 0; i < cu->n_graphs; i++)
        cudaGraphExecDestroy(cu->graphs[i].exec);
    cu->n_graphs = 0;
}

static int bucket_for(int t)
{
    static const int small[] = {1, 2, 4, 8, 16, 32, 48, 64};
    for (size_t i = 0; i < TDM_ARRAY_LEN(small); i++)
        if (t <= small[i]) return small[i];
    if (t <= 256) return (t + 31) / 32 * 32;
    return (t + 63) / 64 * 64;
}

static tdm_status cu_step_begin(tdm_backend_t *b, struct tdm_step *st, const int32_t *rows,
                                int n_rows, const void *owner, _Atomic int32_t *counter,
                                bool *replayed)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    bind(cu);
    *replayed = false;
    bool decode = cu->graphs_enabled && cu->reserved && st->n_tokens == st->n_seqs;
    int bucket = 0;
    if (decode) {
        bucket = bucket_for(st->n_tokens);
        if (bucket > cu->cap_t || st->n_seqs + (bucket - st->n_tokens) > cu->cap_s) decode = false;
    }
    if (counter && !counter_dev(cu, counter)) decode = false; /* would need a host store */
    cu->cur_st = st;
    cu->cur_rows = rows;
    cu->cur_n_rows = n_rows;
    if (!decode) {
        upload_step(cu, st, rows, n_rows, 0, false, tile_tokens_for(cu->gs_hint, cu->hd_hint));
        return TDM_OK;
    }
    upload_step(cu, st, rows, n_rows, bucket, true, 1);
    st->n_tokens = bucket;
    for (int i = 0; i < cu->n_graphs; i++) {
        if (cu->graphs[i].owner == owner && cu->graphs[i].bucket == bucket) {
            if (cudaGraphLaunch(cu->graphs[i].exec, cu->stream) != cudaSuccess)
                return tdm_err_set(TDM_EIO, "cuda backend: graph launch failed: %s",
                                   cudaGetErrorString(cudaGetLastError()));
            *replayed = true;
            return TDM_OK;
        }
    }
    if (cudaStreamBeginCapture(cu->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: cannot begin a graph capture: %s",
                           cudaGetErrorString(cudaGetLastError()));
    cu->capturing = true;
    cu->cap_owner = owner;
    cu->cap_bucket = bucket;
    return TDM_OK;
}

static tdm_status cu_step_end(tdm_backend_t *b)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (!cu->capturing) return TDM_OK;
    cudaGraph_t g = NULL;
    cudaGraphExec_t exec = NULL;
    cu->capturing = false;
    if (cudaStreamEndCapture(cu->stream, &g) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: graph capture failed: %s",
                           cudaGetErrorString(cudaGetLastError()));
    cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: graph instantiation failed: %s",
                           cudaGetErrorString(e));
    if (cu->n_graphs == TDM_CU_MAX_GRAPHS) {
        cudaGraphExecDestroy(cu->graphs[0].exec);
        memmove(cu->graphs, cu->graphs + 1, (size_t)(cu->n_graphs - 1) * sizeof cu->graphs[0]);
        cu->n_graphs--;
    }
    cu->graphs[cu->n_graphs++] =
        (struct tdm_cu_graph){.owner = cu->cap_owner, .bucket = cu->cap_bucket, .exec = exec};
    if (cudaGraphLaunch(exec, cu->stream) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: graph launch failed: %s",
                           cudaGetErrorString(cudaGetLastError()));
    return TDM_OK;
}

/* ---- memory plan ---- */

static tdm_status cu_reserve(tdm_backend_t *b, const struct tdm_backend_limits *lim,
                             size_t *kv_bytes)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    bind(cu);
    *kv_bytes = 0;
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    drop_graphs(cu);
    const size_t T = (size_t)lim->max_tokens;
    const size_t wide = (size_t)TDM_MAX(TDM_MAX(cu->max_cols, lim->d_model),
                                        TDM_MAX(lim->d_ff, lim->n_heads * lim->head_dim));
    grow(cu, (void **)&cu->xb, &cu->xb_cap, T * wide * sizeof(uint16_t));
    grow(cu, (void **)&cu->shb[0], &cu->shb_cap[0], T * wide * sizeof(uint16_t));
    grow(cu, (void **)&cu->shb[1], &cu->shb_cap[1], T * wide * sizeof(uint16_t));
    grow(cu, (void **)&cu->up, &cu->up_cap, T * (size_t)lim->d_ff * sizeof(float));
    const size_t per_tok = (size_t)lim->n_heads * (lim->head_dim + 2);
    const size_t part = TDM_MIN(PART_FLOATS, per_tok * (T * MAX_SPLITS));
    grow(cu, (void **)&cu->part, &cu->part_cap, TDM_MAX(part, per_tok) * sizeof(float));
    grow(cu, (void **)&cu->d_rows, &cu->rows_cap,
         (size_t)TDM_MAX(lim->max_rows, lim->max_tokens) * sizeof(int32_t));
    const int graph_seqs = lim->max_tokens; /* padding adds one sequence per padding token */
    meta_reserve(cu, lim->max_tokens, TDM_MAX(lim->max_seqs, graph_seqs), lim->max_pages,
                 lim->max_rows);
    tdm_status sst = tdm_cu_sample_reserve(cu, lim->max_rows, lim->vocab);
    if (sst != TDM_OK) return sst;
    cu->reserved = true;
    cu->gs_hint = lim->n_kv_heads > 0 ? lim->n_heads / lim->n_kv_heads : 0;
    cu->hd_hint = lim->head_dim;
    cu->workspace_bytes = cu->xb_cap + cu->shb_cap[0] + cu->shb_cap[1] + cu->up_cap + cu->part_cap +
                          cu->rows_cap + cu->meta_cap * 4 + cu->lt_ws_bytes + cu->samp_cap +
                          cu->sout_cap + cu->sscratch_cap;

    size_t free_b = 0, total_b = 0;
    TDM_CU_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double target = cu->mem_fraction * (double)total_b;
    const double used = (double)(total_b - free_b);
    const double left = target - used;
    *kv_bytes = left > 0 ? (size_t)left : 0;
    TDM_INFO("cuda memory plan on %s: %.2f GiB total, fraction %.2f -> %.2f GiB; in use now "
             "%.2f GiB (weights %.2f GiB, backend workspace %.2f GiB, engine scratch and the "
             "rest %.2f GiB); KV pool gets %.2f GiB",
             cu->name, total_b / 1073741824.0, cu->mem_fraction, target / 1073741824.0,
             used / 1073741824.0, cu->weight_bytes / 1073741824.0,
             cu->workspace_bytes / 1073741824.0,
             (used - (double)cu->weight_bytes - (double)cu->workspace_bytes) / 1073741824.0,
             (left > 0 ? left : 0) / 1073741824.0);
    if (left <= 0)
        return tdm_err_set(TDM_ENOMEM,
                           "cuda backend: no device memory left for the KV pool (fraction %.2f of "
                           "%.1f GiB, %.1f GiB in use)",
                           cu->mem_fraction, total_b / 1073741824.0, used / 1073741824.0);
    return TDM_OK;
}

/* ---- lifetime ---- */

static void cu_destroy(tdm_backend_t *b)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    cudaStreamSynchronize(cu->stream);
    if (cu->prof) {
        prof_collect(cu);
        prof_report(cu);
        for (int i = 0; i < 2 * TDM_CU_PROF_EVENTS && cu->prof_ev[i]; i++)
            cudaEventDestroy(cu->prof_ev[i]);
    }
    drop_graphs(cu);
    for (int i = 0; i < cu->n_owned; i++)
        cudaFree(cu->owned[i].dev);
    free(cu->owned);
    for (int i = 0; i < cu->n_counters; i++)
        if (cu->counters[i].host_page) cudaHostUnregister(cu->counters[i].host_page);
    void *dev[] = {cu->xb,         cu->shb[0], cu->shb[1], cu->up,   cu->part,
                   cu->d_inv_freq, cu->d_rows, cu->d_meta, cu->lt_ws};
    for (size_t i = 0; i < TDM_ARRAY_LEN(dev); i++)
        if (dev[i]) cudaFree(dev[i]);
    if (cu->h_meta) cudaFreeHost(cu->h_meta);
    if (cu->h_inv_freq) cudaFreeHost(cu->h_inv_freq);
    if (cu->h_counter) cudaFreeHost(cu->h_counter);
    tdm_cu_sample_free(cu);
    tdm_cu_gemm_destroy(cu);
    if (cu->lt) cublasLtDestroy(cu->lt);
    if (cu->stream) cudaStreamDestroy(cu->stream);
    free(cu);
}

static struct tdm_mem_place cu_buf_place(tdm_backend_t *b)
{
    return (struct tdm_mem_place){.kind = TDM_MEM_DEVICE, .device = tdm_cu_of(b)->device};
}

static const struct tdm_backend_i CUDA_IFACE = {
    .name = "cuda",
    .destroy = cu_destroy,
    .buf_alloc = cu_buf_alloc,
    .buf_place = cu_buf_place,
    .buf_free = cu_buf_free,
    .upload = cu_upload,
    .download = cu_download,
    .weight_prepare = cu_weight_prepare,
    .embed = cu_embed,
    .rmsnorm = cu_rmsnorm,
    .add_rmsnorm = cu_add_rmsnorm,
    .matmul = cu_matmul,
    .matmul_multi = cu_matmul_multi,
    .matmul_swiglu = cu_matmul_swiglu,
    .head_rmsnorm = cu_head_rmsnorm,
    .rope_kv_append = cu_rope_kv_append,
    .attention = cu_attention,
    .silu_mul = cu_silu_mul,
    .add = cu_add,
    .gather_rows = cu_gather_rows,
    .layer_done = cu_layer_done,
    .sync = cu_sync,
    .reserve = cu_reserve,
    .step_begin = cu_step_begin,
    .step_end = cu_step_end,
    .sample = tdm_cu_sample_rows,
};

#define CREATE_CHECK(call, what)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            st = tdm_err_set(TDM_EIO, "cuda backend: %s: %s", what, cudaGetErrorString(e_));       \
            goto out_destroy;                                                                      \
        }                                                                                          \
    } while (0)

tdm_status tdm_backend_cuda_create(const struct tdm_backend_cuda_opts *opts, tdm_backend_t **out)
{
    const struct tdm_backend_cuda_opts o = opts ? *opts : (struct tdm_backend_cuda_opts){0};
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_EUNSUPPORTED, "cuda backend: no CUDA GPU available (%s)",
                           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    if (o.device < 0 || o.device >= n_dev)
        return tdm_err_set(TDM_EINVAL, "cuda backend: device %d does not exist (%d present)",
                           o.device, n_dev);
    if (o.gpu_memory_fraction > 1.0)
        return tdm_err_set(TDM_EINVAL, "cuda backend: gpu memory fraction %.3f is above 1",
                           o.gpu_memory_fraction);
    struct tdm_cuda *cu = calloc(1, sizeof *cu);
    if (!cu) return tdm_err_set(TDM_ENOMEM, "cuda backend: out of memory");
    tdm_status st = TDM_OK;
    cu->base.iface = &CUDA_IFACE;
    cu->base.impl = cu;
    cu->device = o.device;
    cu->mem_fraction = o.gpu_memory_fraction > 0 ? o.gpu_memory_fraction : 0.9;
    cu->prof = getenv("TANDEM_CUDA_PROFILE") && *getenv("TANDEM_CUDA_PROFILE") == '1';
    /* $TANDEM_CUDA_PROFILE_MAX_TOKENS=N: only steps of at most N tokens (decode alone) */
    const char *pmt = getenv("TANDEM_CUDA_PROFILE_MAX_TOKENS");
    cu->prof_max_tokens = pmt && atoi(pmt) > 0 ? atoi(pmt) : INT32_MAX;
    cu->graphs_enabled = !o.no_graphs && !getenv("TANDEM_CUDA_NO_GRAPHS") && !cu->prof;
    CREATE_CHECK(cudaSetDevice(o.device), "set device");
    struct cudaDeviceProp prop;
    CREATE_CHECK(cudaGetDeviceProperties(&prop, o.device), "device properties");
    if (prop.major < 9) {
        st = tdm_err_set(TDM_EUNSUPPORTED,
                         "cuda backend: %s is compute capability %d.%d; this build targets "
                         "sm_90a (Hopper)",
                         prop.name, prop.major, prop.minor);
        goto out_destroy;
    }
    snprintf(cu->name, sizeof cu->name, "%s", prop.name);
    cu->n_sms = prop.multiProcessorCount;
    cu->total_mem = prop.totalGlobalMem;
    CREATE_CHECK(cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking), "stream");
    if (cublasLtCreate(&cu->lt) != CUBLAS_STATUS_SUCCESS) {
        st = tdm_err_set(TDM_EIO, "cuda backend: cublasLtCreate failed");
        goto out_destroy;
    }
    cu->lt_ws_bytes = LT_WORKSPACE_BYTES;
    CREATE_CHECK(cudaMalloc(&cu->lt_ws, cu->lt_ws_bytes), "cuBLASLt workspace");
    CREATE_CHECK(cudaMalloc((void **)&cu->d_inv_freq, INV_FREQ_MAX * sizeof(float)), "inv_freq");
    CREATE_CHECK(cudaMallocHost((void **)&cu->h_inv_freq, INV_FREQ_MAX * sizeof(float)),
                 "inv_freq");
    CREATE_CHECK(cudaHostAlloc((void **)&cu->h_counter, 64, cudaHostAllocMapped), "counter");
    *cu->h_counter = 0;
    CREATE_CHECK(cudaHostGetDevicePointer((void **)&cu->d_counter, cu->h_counter, 0), "counter");
    TDM_DEBUG("cuda backend: %s, %d SMs, %.1f GiB", cu->name, cu->n_sms,
              cu->total_mem / 1073741824.0);
    *out = &cu->base;
    return TDM_OK;
out_destroy:
    cu_destroy(&cu->base);
    return st;
}

bool tdm_backend_is_cuda(const tdm_backend_t *b)
{
    return b && b->iface == &CUDA_IFACE;
}

tdm_status tdm_backend_cuda_info(tdm_backend_t *b, char *name, size_t cap, size_t *total_bytes)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (name && cap) snprintf(name, cap, "%s", cu->name);
    if (total_bytes) *total_bytes = cu->total_mem;
    return TDM_OK;
}

void *tdm_backend_cuda_host_alloc(tdm_backend_t *b, size_t bytes)
{
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        tdm_err_set(TDM_ENOMEM, "cuda backend: cannot pin %zu bytes of host memory: %s", bytes,
                    cudaGetErrorString(cudaGetLastError()));
        return NULL;
    }
    return p;
}

void tdm_backend_cuda_host_free(tdm_backend_t *b, void *p)
{
    if (p) cudaFreeHost(p);
}

tdm_status tdm_backend_cuda_memset(tdm_backend_t *b, void *dev, int value, size_t bytes)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (cudaMemsetAsync(dev, value, bytes, cu->stream) != cudaSuccess ||
        cudaStreamSynchronize(cu->stream) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: memset failed: %s",
                           cudaGetErrorString(cudaGetLastError()));
    return TDM_OK;
}

_Atomic int32_t *tdm_backend_cuda_counter(tdm_backend_t *b)
{
    if (!tdm_backend_is_cuda(b)) return NULL;
    return (_Atomic int32_t *)tdm_cu_of(b)->h_counter;
}

tdm_status tdm_backend_cuda_random_weight(tdm_backend_t *b, enum tdm_dtype dtype, int64_t rows,
                                          int64_t cols, uint64_t seed, float lo, float hi,
                                          struct tdm_weight *out)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (rows < 1 || cols < 1 || (dtype != TDM_DTYPE_BF16 && dtype != TDM_DTYPE_F32))
        return tdm_err_set(TDM_EINVAL, "cuda backend: random weight %lld x %lld of %s",
                           (long long)rows, (long long)cols, tdm_dtype_name(dtype));
    const size_t esz = dtype == TDM_DTYPE_BF16 ? 2 : 4, n = (size_t)rows * (size_t)cols;
    const size_t extra = dtype == TDM_DTYPE_F32 && rows == 1 ? (size_t)cols * 2 : 0;
    void *dev = NULL;
    if (cudaMalloc(&dev, n * esz + extra) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes", n * esz);
    }
    if (dtype == TDM_DTYPE_BF16)
        tdm_cu_fill_uniform_bf16(cu->stream, dev, n, seed, lo, hi);
    else
        tdm_cu_fill_uniform_f32(cu->stream, dev, n, seed, lo, hi);
    if (extra) /* the bf16 copy a 1-row fp32 weight carries (cu_weight_prepare) */
        tdm_cu_f32_to_bf16(cu->stream, dev, (size_t)cols, (uint16_t *)((float *)dev + cols));
    TDM_CU_CHECK(cudaGetLastError());
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    *out = (struct tdm_weight){
        .dtype = dtype, .rows = rows, .cols = cols, .row_bytes = (size_t)cols * esz, .data = dev};
    tdm_status st = own(cu, dev, out);
    if (st != TDM_OK) {
        cudaFree(dev);
        return st;
    }
    cu->weight_bytes += n * esz;
    return TDM_OK;
}

static int cmp_f(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

tdm_status tdm_backend_cuda_measure(tdm_backend_t *b, double *copy_bytes_per_s,
                                    double *gemm_flops_per_s)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    enum { REPS = 11 };
    const size_t copy_bytes = (size_t)1 << 31; /* 2 GiB: far above the 60 MB L2 */
    const int G = 8192;
    void *a = NULL, *c = NULL;
    float ms[REPS];
    tdm_status st = TDM_OK;
    cudaEvent_t e0 = NULL, e1 = NULL;
    TDM_CU_CHECK(cudaEventCreate(&e0));
    TDM_CU_CHECK(cudaEventCreate(&e1));
    if (cudaMalloc(&a, copy_bytes) != cudaSuccess || cudaMalloc(&c, copy_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        st = tdm_err_set(TDM_ENOMEM, "cuda backend: no memory for the roofline measurement");
        goto out;
    }
    tdm_cu_fill_uniform_f32(cu->stream, a, copy_bytes / 4, 1, -1.0f, 1.0f);
    for (int r = -2; r < REPS; r++) {
        TDM_CU_CHECK(cudaEventRecord(e0, cu->stream));
        TDM_CU_CHECK(cudaMemcpyAsync(c, a, copy_bytes, cudaMemcpyDeviceToDevice, cu->stream));
        TDM_CU_CHECK(cudaEventRecord(e1, cu->stream));
        TDM_CU_CHECK(cudaEventSynchronize(e1));
        if (r >= 0) TDM_CU_CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    qsort(ms, REPS, sizeof ms[0], cmp_f);
    *copy_bytes_per_s = 2.0 * (double)copy_bytes / (ms[REPS / 2] * 1e-3);

    /* GEMM: W [G][G] bf16 times x [G][G] bf16 into d [G][G] fp32, random data */
    {
        uint16_t *w = a, *x = (uint16_t *)((uint8_t *)a + (size_t)G * G * 2);
        float *d = c;
        tdm_cu_fill_uniform_bf16(cu->stream, w, (size_t)G * G * 2, 7, -1.0f, 1.0f);
        for (int r = -3; r < REPS; r++) {
            TDM_CU_CHECK(cudaEventRecord(e0, cu->stream));
            tdm_cu_gemm(cu, w, G, G, x, G, d);
            TDM_CU_CHECK(cudaEventRecord(e1, cu->stream));
            TDM_CU_CHECK(cudaEventSynchronize(e1));
            if (r >= 0) TDM_CU_CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
        }
        qsort(ms, REPS, sizeof ms[0], cmp_f);
        *gemm_flops_per_s = 2.0 * G * (double)G * G / (ms[REPS / 2] * 1e-3);
    }
out:
    if (a) cudaFree(a);
    if (c) cudaFree(c);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return st;
}
