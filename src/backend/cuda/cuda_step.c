/*
 * Step metadata, CUDA graphs and the memory plan of the CUDA backend: a step's arrays are
 * uploaded once into fixed device buffers, decode steps are padded to a bucket and recorded or
 * replayed as graphs, and reserve() sizes the workspace and the KV pool (cuda_backend.c has the
 * design). One thread drives an instance.
 */
#include "backend/cuda/cuda_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- step metadata ---- */

/* The token trees' arrays come last, after the page tables, and travel only with a step that
 * has a tree (the common step's upload stays as small as it was). */
enum {
    M_TOKENS,
    M_POS,
    M_SLOTS,
    M_TSEQ,
    M_TILES,
    M_STS,
    M_KVLEN,
    M_SPS,
    M_ROWS,
    M_PAGES,
    M_TMASK, /* [T] uint64 as 2 int32 each */
    M_TPRE,
    M_TNS,
    M_TSLOTS,
    M_N
};

/* Offsets (int32 elements) of each array in the metadata buffers, from the capacities. */
static void meta_offsets(const struct tdm_cuda *cu, size_t off[M_N + 1])
{
    const size_t T = (size_t)cu->cap_t, S = (size_t)cu->cap_s;
    const size_t len[M_N] = {T,
                             T,
                             T,
                             T,
                             3 * T,
                             S + 1,
                             S,
                             S + 1,
                             (size_t)cu->cap_r,
                             (size_t)cu->cap_p,
                             2 * T,
                             S,
                             S + 1,
                             S * TDM_TREE_MAX_NODES};
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
    tdm_cuda_drop_graphs(cu);
    for (int i = 0; i < 2 && !cu->meta_ev[i]; i++)
        TDM_CU_CHECK(cudaEventCreateWithFlags(&cu->meta_ev[i], cudaEventDisableTiming));
    cu->cap_t = TDM_MAX(cu->cap_t, t);
    cu->cap_s = TDM_MAX(cu->cap_s, s);
    cu->cap_p = TDM_MAX(cu->cap_p, p);
    cu->cap_r = TDM_MAX(cu->cap_r, r);
    size_t off[M_N + 1];
    meta_offsets(cu, off);
    for (int i = 0; i < 2; i++) {
        if (cu->h_meta_buf[i]) cudaFreeHost(cu->h_meta_buf[i]);
        cu->h_meta_buf[i] = NULL;
        TDM_CU_CHECK(cudaMallocHost((void **)&cu->h_meta_buf[i], off[M_N] * sizeof(int32_t)));
    }
    if (cu->d_meta) cudaFree(cu->d_meta);
    cu->d_meta = NULL;
    TDM_CU_CHECK(cudaMalloc((void **)&cu->d_meta, off[M_N] * sizeof(int32_t)));
    cu->meta_cap = off[M_N];
}

/* Tokens per attention tile for a GQA group of gs heads (0: unknown, one token per tile). A
 * batch-invariant instance gives every token a tile of its own: its row then goes through the
 * same kernel, with the same split of its KV, whatever else the step holds. */
static int tile_tokens_for(const struct tdm_cuda *cu, int gs, int hd)
{
    if (cu->batch_invariant) return 1;
    return gs > 0 ? TDM_MAX(1, tdm_cu_attention_rows_cap(hd) / gs) : 1;
}

/* Copies a host step (and its logit rows) into the device buffers, padded to `pad` tokens when
 * pad > n_tokens (each padding token its tdm_cuda_own empty sequence), and fills cu->dstep. A graph
 * step has one token per attention tile, so the attention grid depends only on the bucket. */
static void upload_step(struct tdm_cuda *cu, const struct tdm_step *st, const int32_t *rows,
                        int n_rows, int pad, bool graph, int tile_tokens)
{
    const int T = st->n_tokens, S = st->n_seqs, P = st->seq_page_start[S];
    const int Tp = TDM_MAX(T, pad), Sp = S + (Tp - T);
    meta_reserve(cu, Tp, Sp, P, n_rows);
    /* the other staging: the step before may still run, and its copy came out of this one's
     * turn before it (the device buffers are stream-ordered) */
    const int mi = cu->meta_i ^ 1;
    cu->meta_i = mi;
    TDM_CU_CHECK(cudaEventSynchronize(cu->meta_ev[mi]));
    size_t off[M_N + 1];
    meta_offsets(cu, off);
    int32_t *h = cu->h_meta_buf[mi];
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
    if (st->n_prev_rows > 0) { /* tokens the step before samples (TDM_TOKEN_PREV) */
        tdm_cu_resolve_tokens(cu->stream, cu->d_meta + off[M_TOKENS], T, cu->d_sout,
                              TDM_MIN(st->n_prev_rows, cu->sout_rows), cu->sout_vocab);
        TDM_CU_CHECK(cudaGetLastError());
    }
    const bool trees = st->tree_mask != NULL;
    if (trees) { /* never padded: a step with a tree is not a graph's */
        TDM_ASSERT(Tp == T);
        const int n_nodes = st->tree_node_start[S];
        TDM_ASSERT(n_nodes <= cu->cap_s * TDM_TREE_MAX_NODES);
        memcpy(h + off[M_TMASK], st->tree_mask, (size_t)T * sizeof(uint64_t));
        memcpy(h + off[M_TPRE], st->seq_prefix, (size_t)S * 4);
        memcpy(h + off[M_TNS], st->tree_node_start, (size_t)(S + 1) * 4);
        memcpy(h + off[M_TSLOTS], st->tree_slots, (size_t)n_nodes * 4);
        TDM_CU_CHECK(
            cudaMemcpyAsync(cu->d_meta + off[M_TMASK], h + off[M_TMASK],
                            (off[M_TSLOTS] - off[M_TMASK] + (size_t)n_nodes) * sizeof(int32_t),
                            cudaMemcpyHostToDevice, cu->stream));
    }
    TDM_CU_CHECK(cudaEventRecord(cu->meta_ev[mi], cu->stream)); /* the staging's last copy */
    const int32_t *d = cu->d_meta;
    cu->dstep = (struct tdm_cu_step){
        .n_tokens = Tp,
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
        .tree_mask = trees ? (const unsigned long long *)(d + off[M_TMASK]) : NULL,
        .seq_prefix = trees ? d + off[M_TPRE] : NULL,
        .tree_node_start = trees ? d + off[M_TNS] : NULL,
        .tree_slots = trees ? d + off[M_TSLOTS] : NULL,
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
const struct tdm_cu_step *tdm_cuda_dev_step(struct tdm_cuda *cu, const struct tdm_step *st, int gs,
                                            int hd)
{
    if (st == cu->cur_st) {
        if (gs <= 0 || cu->dstep_graph || cu->dstep_tiling == tile_tokens_for(cu, gs, hd))
            return &cu->dstep;
        upload_step(cu, st, cu->cur_rows, cu->cur_n_rows, 0, false, tile_tokens_for(cu, gs, hd));
        return &cu->dstep;
    }
    cu->cur_st = NULL;
    cu->cur_rows = NULL;
    upload_step(cu, st, NULL, 0, 0, false, tile_tokens_for(cu, gs, hd));
    return &cu->dstep;
}

/* ---- graphs ---- */

void tdm_cuda_drop_graphs(struct tdm_cuda *cu)
{
    for (int i = 0; i < cu->n_graphs; i++)
        cudaGraphExecDestroy(cu->graphs[i].exec);
    cu->n_graphs = 0;
}

#define GRAPH_SPAN 17 /* tokens of one sequence a graph step may hold: 1 + 16 drafts */
/* the most tokens of a graph step with spans of several tokens: past it, one-token attention
 * tiles cost more than the launches a graph saves (H200, 8B shape, 64 sequences verifying 5
 * tokens each: 46 ms a step as a graph, 28 ms op by op; bench/RESULTS.md, 2026-12-05) */
#define GRAPH_SPAN_TOKENS 64

static int bucket_for(int t)
{
    static const int small[] = {1, 2, 4, 8, 16, 32, 48, 64};
    for (size_t i = 0; i < TDM_ARRAY_LEN(small); i++)
        if (t <= small[i]) return small[i];
    if (t <= 256) return (t + 31) / 32 * 32;
    return (t + 63) / 64 * 64;
}

tdm_status tdm_cuda_step_begin(tdm_backend_t *b, struct tdm_step *st, const int32_t *rows,
                               int n_rows, const void *owner, _Atomic int32_t *counter,
                               bool *replayed)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_bind(cu);
    *replayed = false;
    tdm_cu_idle_begin(cu);
    /* decode steps, and verification steps (chains of up to GRAPH_SPAN tokens a sequence), run
     * as graphs: a graph step gives every token an attention tile of its own, so what it records
     * depends on the padded token count alone. A step with a token tree runs op by op (a graph
     * records one step's shape, not masks), and so do prefill-sized spans, whose attention takes
     * the tensor cores in tiles of many tokens. */
    bool decode = cu->graphs_enabled && cu->reserved && !st->tree_mask;
    if (decode && st->n_tokens > st->n_seqs) { /* spans of several tokens */
        decode = st->n_tokens <= GRAPH_SPAN_TOKENS;
        for (int s = 0; decode && s < st->n_seqs; s++)
            decode = st->seq_token_start[s + 1] - st->seq_token_start[s] <= GRAPH_SPAN;
    }
    int bucket = 0;
    if (decode) {
        bucket = bucket_for(st->n_tokens);
        if (bucket > cu->cap_t || st->n_seqs + (bucket - st->n_tokens) > cu->cap_s) decode = false;
    }
    if (counter && !tdm_cuda_counter_dev(cu, counter)) decode = false; /* would need a host store */
    cu->cur_st = st;
    cu->cur_rows = rows;
    cu->cur_n_rows = n_rows;
    if (!decode) {
        upload_step(cu, st, rows, n_rows, 0, false, tile_tokens_for(cu, cu->gs_hint, cu->hd_hint));
        return TDM_OK;
    }
    upload_step(cu, st, rows, n_rows, bucket, true, 1);
    st->n_tokens = bucket;
    for (int i = 0; i < cu->n_graphs; i++) {
        if (cu->graphs[i].owner == owner && cu->graphs[i].bucket == bucket &&
            cu->graphs[i].n_layers == st->n_layers) {
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
    cu->cap_layers = st->n_layers;
    return TDM_OK;
}

void tdm_cuda_step_forget(tdm_backend_t *b, const void *owner)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_bind(cu);
    int n = 0;
    for (int i = 0; i < cu->n_graphs; i++) {
        if (cu->graphs[i].owner == owner) {
            if (!n) TDM_CU_CHECK(cudaStreamSynchronize(cu->stream)); /* not replaying now */
            n++;
            cudaGraphExecDestroy(cu->graphs[i].exec);
        } else {
            cu->graphs[i - n] = cu->graphs[i];
        }
    }
    cu->n_graphs -= n;
}

tdm_status tdm_cuda_step_end(tdm_backend_t *b)
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
    cu->graphs[cu->n_graphs++] = (struct tdm_cu_graph){
        .owner = cu->cap_owner, .bucket = cu->cap_bucket, .n_layers = cu->cap_layers, .exec = exec};
    if (cudaGraphLaunch(exec, cu->stream) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: graph launch failed: %s",
                           cudaGetErrorString(cudaGetLastError()));
    return TDM_OK;
}

/* ---- memory plan ---- */

tdm_status tdm_cuda_reserve(tdm_backend_t *b, const struct tdm_backend_limits *lim,
                            size_t *kv_bytes)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    tdm_cuda_bind(cu);
    *kv_bytes = 0;
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    tdm_cuda_drop_graphs(cu);
    const size_t T = (size_t)lim->max_tokens;
    const size_t wide = (size_t)TDM_MAX(TDM_MAX(cu->max_cols, lim->d_model),
                                        TDM_MAX(lim->d_ff, lim->n_heads * lim->head_dim));
    tdm_cuda_grow(cu, (void **)&cu->xb, &cu->xb_cap, T * wide * sizeof(uint16_t));
    tdm_cuda_grow(cu, (void **)&cu->shb[0], &cu->shb_cap[0], T * wide * sizeof(uint16_t));
    tdm_cuda_grow(cu, (void **)&cu->shb[1], &cu->shb_cap[1], T * wide * sizeof(uint16_t));
    /* up: fp32 up rows, or bf16 gate and up rows, the second from a 16-byte boundary (cuda_ops.c)
     */
    tdm_cuda_grow(cu, (void **)&cu->up, &cu->up_cap, (T * (size_t)lim->d_ff + 8) * sizeof(float));
    const size_t per_tok = (size_t)lim->n_heads * (lim->head_dim + 2);
    size_t part = TDM_MIN(PART_FLOATS, per_tok * (T * MAX_SPLITS));
    if (cu->batch_invariant) part = TDM_MAX(part, per_tok * T * BI_SPLITS);
    tdm_cuda_grow(cu, (void **)&cu->part, &cu->part_cap, TDM_MAX(part, per_tok) * sizeof(float));
    tdm_cuda_grow(cu, (void **)&cu->d_rows, &cu->rows_cap,
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
                          cu->sout_cap + cu->sscratch_cap + cu->deq_cap;

    size_t free_b = 0, total_b = 0;
    TDM_CU_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double target = cu->mem_fraction * (double)total_b;
    const double used = (double)(total_b - free_b);
    const double left = target - used - (double)lim->reserve_bytes;
    *kv_bytes = left > 0 ? (size_t)left : 0;
    TDM_INFO("cuda memory plan on %s: %.2f GiB total, fraction %.2f -> %.2f GiB; in use now "
             "%.2f GiB (weights %.2f GiB, backend workspace %.2f GiB, engine scratch and the "
             "rest %.2f GiB); held back for speculation %.2f GiB; KV pool gets %.2f GiB",
             cu->name, total_b / 1073741824.0, cu->mem_fraction, target / 1073741824.0,
             used / 1073741824.0, cu->weight_bytes / 1073741824.0,
             cu->workspace_bytes / 1073741824.0,
             (used - (double)cu->weight_bytes - (double)cu->workspace_bytes) / 1073741824.0,
             lim->reserve_bytes / 1073741824.0, (left > 0 ? left : 0) / 1073741824.0);
    if (left <= 0)
        return tdm_err_set(TDM_ENOMEM,
                           "cuda backend: no device memory left for the KV pool (fraction %.2f of "
                           "%.1f GiB, %.1f GiB in use)",
                           cu->mem_fraction, total_b / 1073741824.0, used / 1073741824.0);
    return TDM_OK;
}
