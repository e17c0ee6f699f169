/*
 * Causal GQA attention over the paged HND KV cache on the GPU: prefill, chunked
 * prefill over an existing prefix and decode.
 *
 * Work: a block takes one tile (up to tile_tokens consecutive tokens of one sequence) and one
 * KV head g, so all the query heads of that KV head (the GQA group) share each K and V row
 * read: the tile's rows are (token, head) pairs, at most 64 (32 when head_dim > 256), four
 * warps of RPW rows each. KV positions are taken 32 at a time (FlashAttention-2 style): the
 * chunk's K and V rows are gathered through the sequence's page table into shared memory,
 * lane j of a warp scores position j against each of its rows, the running max and sum are
 * updated (online softmax) and the weighted V rows are accumulated in registers, lane l
 * holding dimensions l, l + 32, ... A row at position p sees KV positions [0, p]; a tile reads
 * [0, last position of the tile], bounded by the sequence's KV length.
 *
 * Split-KV (decode): when the step has too few (tile, KV head) blocks to fill the GPU, the KV
 * range of each is cut into n_splits equal parts (a multiple of 32 positions) run by separate
 * blocks, each writing its unnormalised state (acc, max, sum) to scratch; a second kernel
 * merges the states. The split count depends only on the launch shape, never on KV lengths,
 * so it can be fixed when a decode step is captured as a CUDA graph; splits past the KV end
 * write empty states.
 *
 * Padding: a tile whose sequence has KV length 0 (a CUDA-graph padding slot) writes zeros.
 *
 * Token trees (backend.h's attention contract): a tile of a tree sequence reads positions
 * [0, P) through the page table, exactly as a chain tile does, then the tree's nodes as columns
 * P .. P + n_nodes - 1 (node j's K and V from its slot). A chain row masks columns past its
 * position, as always; a tree row takes every prefix column and, of the node columns, those
 * its 64-bit mask names. The mask touches the node columns only, so the prefix part is the
 * causal kernel's, and a tree of T tokens costs what a chain of T tokens costs.
 *
 * Three kernels share this work split and these rules:
 *   attn_kernel   the SIMT kernel above (any head_dim up to 512, tiles of up to 64 rows);
 *   dec_kernel    decode-shaped steps (tiles of at most 16 rows, head_dim 64/128/256): KV
 *                 chunks copied by cp.async several chunks ahead, a chunk's positions split over
 *                 the warps, the warps' softmax states merged at the end (dec_takes);
 *   attn_mma_kernel  prefill-shaped steps on the tensor cores (head_dim 64/128).
 *
 * Numerics: fp32 throughout; q is pre-multiplied by the softmax scale; expf is the precise one.
 * KV elements of a 2-byte type (bf16, f16) are widened exactly as they are gathered
 * (kv_elem.cuh), so the arithmetic after the gather is the fp32 path's.
 */
#include "backend/cuda/cuda_kernels.h"
#include "backend/cuda/kv_elem.cuh"
#include "backend/cuda/mma.cuh"
#include "backend/cuda/pdl.cuh"

#include <cuda_bf16.h>
#include <climits>
#include <math.h>
#include <stdlib.h>

namespace
{

constexpr int WARPS = 4;
constexpr int CHUNK = 32;

struct attn_args {
    const float *q;
    float *out;
    uint16_t *out_bf16;
    float *part;
    const void *kv_base;
    int kv_t; /* enum tdm_cu_kv */
    int n_heads, nkv, hd, gs, page_size, n_splits, n_tokens;
    float scale;
    const int32_t *positions, *seq_kv_len, *seq_page_start, *page_ids, *tiles;
    const unsigned long long *tree_mask; /* NULL: no tree in the step */
    const int32_t *seq_prefix, *tree_node_start, *tree_slots;
};

/* A tile's sequence as the attention sees it: a tree's prefix tp and nodes, or (a chain) tp =
 * INT_MAX, so that no position is a node. */
struct seq_kv {
    int tp, n_nodes;
    const int32_t *nodes;
};

__device__ __forceinline__ seq_kv seq_kv_of(const attn_args &a, int seq)
{
    seq_kv t = {INT_MAX, 0, nullptr};
    if (a.tree_mask) {
        const int n0 = a.tree_node_start[seq], n1 = a.tree_node_start[seq + 1];
        if (n1 > n0) {
            t.tp = a.seq_prefix[seq];
            t.n_nodes = n1 - n0;
            t.nodes = a.tree_slots + n0;
        }
    }
    return t;
}

/* Where KV head g's K row of column p is, in elements from kv_base (V is v_off elements
 * further): a position through the page table, or a tree's node through its slot. */
__device__ __forceinline__ size_t kv_row(const attn_args &a, const int32_t *pages, const seq_kv &sk,
                                         int p, int g, size_t page_floats, int hd)
{
    const int ps = a.page_size;
    int page, off;
    if (p < sk.tp) {
        page = pages[p / ps];
        off = p % ps;
    } else {
        const int slot = sk.nodes[p - sk.tp];
        page = slot / ps;
        off = slot % ps;
    }
    return (size_t)page * page_floats + ((size_t)g * ps + off) * hd;
}

/* Whether a row sees column p: a chain row up to its position (lim), a tree row (lim = tp - 1)
 * the prefix and the nodes of its mask. */
__device__ __forceinline__ bool sees(int p, int lim, unsigned long long mask, int tp)
{
    return p <= lim || (p >= tp && ((mask >> (p - tp)) & 1ull));
}

/* A tile: its sequence, first token, token count, rows (tokens x the GQA group) and KV end
 * (a chain: the last token's position + 1, within the sequence's KV length; a tree: the
 * prefix, then the nodes as columns). */
struct tile_of {
    int seq, tok0, ntok, R, kv_end;
    int lo, hi; /* the split's KV range: n_splits equal parts, multiples of `chunk` positions */
    seq_kv sk;
};

__device__ __forceinline__ tile_of tile_at(const attn_args &a, int tile, int split, int chunk)
{
    tile_of t;
    t.seq = a.tiles[3 * tile], t.tok0 = a.tiles[3 * tile + 1], t.ntok = a.tiles[3 * tile + 2];
    t.R = t.ntok * a.gs;
    t.sk = seq_kv_of(a, t.seq);
    t.kv_end = t.sk.nodes ? t.sk.tp + t.sk.n_nodes
                          : min(a.positions[t.tok0 + t.ntok - 1] + 1, a.seq_kv_len[t.seq]);
    const int per = ((t.kv_end + a.n_splits - 1) / a.n_splits + chunk - 1) / chunk * chunk;
    t.lo = split * per, t.hi = min(t.kv_end, t.lo + per);
    return t;
}

/* The tile's query rows (token-major, the GQA group's heads), pre-multiplied by the scale, into
 * Qs [n_rows][width]: zeros past its R rows and past head_dim. */
__device__ __forceinline__ void load_q(const attn_args &a, float *Qs, int n_rows, int width,
                                       int tok0, int g, int R)
{
    for (int idx = threadIdx.x; idx < n_rows * width; idx += blockDim.x) {
        const int r = idx / width, d = idx % width;
        float v = 0.0f;
        if (r < R && d < a.hd) {
            const int t = tok0 + r / a.gs, h = g * a.gs + r % a.gs;
            v = a.q[((size_t)t * a.n_heads + h) * a.hd + d] * a.scale;
        }
        Qs[idx] = v;
    }
}

/* Tile row r's last visible position (a tree row: its prefix's, with its node mask in msk);
 * -1 past the tile's R rows. */
__device__ __forceinline__ int row_pos(const attn_args &a, const seq_kv &sk, int r, int R, int tok0,
                                       unsigned long long &msk)
{
    const int t = tok0 + r / a.gs;
    msk = r < R && a.tree_mask ? a.tree_mask[t] : 0ull;
    return r < R ? (msk ? sk.tp - 1 : a.positions[t]) : -1;
}

/* Empty online-softmax states: no maximum, no sum, no weighted V. */
template <int N, int NJ>
__device__ __forceinline__ void state_init(float (&m)[N], float (&l)[N], float (&acc)[N][NJ])
{
#pragma unroll
    for (int i = 0; i < N; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; j++)
            acc[i][j] = 0.0f;
    }
}

/* Rows r0 .. r0 + N - 1 of the tile: their last visible positions and masks. */
template <int N>
__device__ __forceinline__ void rows_pos(const attn_args &a, const tile_of &tl, int r0,
                                         int (&pos)[N], unsigned long long (&msk)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        pos[i] = row_pos(a, tl.sk, r0 + i, tl.R, tl.tok0, msk[i]);
}

__device__ __forceinline__ uint16_t to_bf16(float f)
{
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&b);
}

template <int NJ, int RPW> __global__ void __launch_bounds__(WARPS * 32) attn_kernel(attn_args a)
{
    tdm_pdl_wait();
    constexpr int HDP = 32 * NJ;
    constexpr int ROWS = WARPS * RPW;
    extern __shared__ float sm[];
    float *Qs = sm;                     /* [ROWS][HDP] */
    float *Ks = Qs + ROWS * HDP;        /* [CHUNK][HDP + 1] */
    float *Vs = Ks + CHUNK * (HDP + 1); /* [CHUNK][HDP] */
    __shared__ size_t krow[CHUNK];      /* element offsets; SIZE_MAX past the range */

    const int g = blockIdx.y, split = blockIdx.z, hd = a.hd;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const tile_of tl = tile_at(a, blockIdx.x, split, CHUNK);
    const int seq = tl.seq, tok0 = tl.tok0, R = tl.R, lo = tl.lo, hi = tl.hi;
    const seq_kv sk = tl.sk;
    load_q(a, Qs, ROWS, HDP, tok0, g, R);
    int pos[RPW];
    unsigned long long msk[RPW];
    rows_pos(a, tl, warp * RPW, pos, msk);

    float m[RPW], l[RPW], acc[RPW][NJ];
    state_init(m, l, acc);
    const int ps = a.page_size;
    const int32_t *pages = a.page_ids + a.seq_page_start[seq];
    const size_t page_floats = (size_t)2 * a.nkv * ps * hd, v_off = (size_t)a.nkv * ps * hd;

    for (int c0 = lo; c0 < hi; c0 += CHUNK) {
        __syncthreads();
        if (threadIdx.x < CHUNK) {
            const int p = c0 + threadIdx.x;
            krow[threadIdx.x] = p < hi ? kv_row(a, pages, sk, p, g, page_floats, hd) : SIZE_MAX;
        }
        __syncthreads();
        if (a.kv_t != TDM_CU_KV_F32 && hd % 8 == 0) { /* 16-byte loads of 8 elements */
            constexpr int HD8 = HDP / 8;
            for (int idx = threadIdx.x; idx < CHUNK * HD8; idx += blockDim.x) {
                const int i = idx / HD8, d = (idx % HD8) * 8;
                const size_t kr = krow[i];
                uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = kw; /* 0 is 0.0 in both types */
                if (kr != SIZE_MAX && d < hd) {
                    kw = tdm_kv_ld8_raw(a.kv_base, kr + d);
                    vw = tdm_kv_ld8_raw(a.kv_base, kr + v_off + d);
                }
                const uint32_t kk[4] = {kw.x, kw.y, kw.z, kw.w}, vv[4] = {vw.x, vw.y, vw.z, vw.w};
                float *ks = Ks + i * (HDP + 1) + d;
                float *vs = Vs + i * HDP + d;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 k2 = tdm_kv_widen2(kk[j], a.kv_t),
                                 v2 = tdm_kv_widen2(vv[j], a.kv_t);
                    ks[2 * j] = k2.x;
                    ks[2 * j + 1] = k2.y;
                    *reinterpret_cast<float2 *>(vs + 2 * j) = v2;
                }
            }
        } else if (hd % 4 == 0) { /* 16-byte loads */
            constexpr int HD4 = HDP / 4;
            for (int idx = threadIdx.x; idx < CHUNK * HD4; idx += blockDim.x) {
                const int i = idx / HD4, d = (idx % HD4) * 4;
                const size_t kr = krow[i];
                float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
                if (kr != SIZE_MAX && d < hd) {
                    kv = tdm_kv_ld4(a.kv_base, kr + d, a.kv_t);
                    vv = tdm_kv_ld4(a.kv_base, kr + v_off + d, a.kv_t);
                }
                float *ks = Ks + i * (HDP + 1) + d;
                ks[0] = kv.x;
                ks[1] = kv.y;
                ks[2] = kv.z;
                ks[3] = kv.w;
                *reinterpret_cast<float4 *>(Vs + i * HDP + d) = vv;
            }
        } else {
            for (int idx = threadIdx.x; idx < CHUNK * HDP; idx += blockDim.x) {
                const int i = idx / HDP, d = idx % HDP;
                const size_t kr = krow[i];
                float kv = 0.0f, vv = 0.0f;
                if (kr != SIZE_MAX && d < hd) {
                    kv = tdm_kv_ld(a.kv_base, kr + d, a.kv_t);
                    vv = tdm_kv_ld(a.kv_base, kr + v_off + d, a.kv_t);
                }
                Ks[i * (HDP + 1) + d] = kv;
                Vs[i * HDP + d] = vv;
            }
        }
        __syncthreads();

        float s[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++)
            s[i] = 0.0f;
        const float *kl = Ks + lane * (HDP + 1);
        for (int d = 0; d < hd; d++) {
            const float kd = kl[d];
#pragma unroll
            for (int i = 0; i < RPW; i++)
                s[i] += Qs[(warp * RPW + i) * HDP + d] * kd;
        }
        const int p = c0 + lane;
        float pw[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const bool ok = p < hi && sees(p, pos[i], msk[i], sk.tp);
            float sc = ok ? s[i] : -INFINITY;
            float mx = sc;
            for (int o = 16; o > 0; o >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[i], mx);
            if (m_new == -INFINITY) {
                pw[i] = 0.0f;
                continue;
            }
            const float alpha = m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new);
            const float e = ok ? expf(sc - m_new) : 0.0f;
            float sum = e;
            for (int o = 16; o > 0; o >>= 1)
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
#pragma unroll
            for (int j = 0; j < NJ; j++)
                acc[i][j] *= alpha;
            pw[i] = e;
        }
        for (int pp = 0; pp < CHUNK; pp++) {
            float v[NJ];
#pragma unroll
            for (int j = 0; j < NJ; j++)
                v[j] = Vs[pp * HDP + lane + 32 * j];
#pragma unroll
            for (int i = 0; i < RPW; i++) {
                const float w = __shfl_sync(0xffffffffu, pw[i], pp);
#pragma unroll
                for (int j = 0; j < NJ; j++)
                    acc[i][j] += w * v[j];
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RPW; i++) {
        const int r = warp * RPW + i;
        if (r >= R) continue;
        const int t = tok0 + r / a.gs, h = g * a.gs + r % a.gs;
        if (a.n_splits == 1) {
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            float *o = a.out + ((size_t)t * a.n_heads + h) * hd;
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                if (d < hd) {
                    const float y = acc[i][j] * inv;
                    o[d] = y;
                    if (a.out_bf16) a.out_bf16[((size_t)t * a.n_heads + h) * hd + d] = to_bf16(y);
                }
            }
        } else {
            float *st = a.part + (((size_t)split * a.n_tokens + t) * a.n_heads + h) * (hd + 2);
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                const int d = lane + 32 * j;
                if (d < hd) st[d] = acc[i][j];
            }
            if (lane == 0) {
                st[hd] = m[i];
                st[hd + 1] = l[i];
            }
        }
    }
}

/* 16-byte asynchronous copies into shared memory (zero-filled when !full), their groups */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool full)
{
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(gmem),
                 "r"(full ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* ---- prefill on the tensor cores (head_dim 64 or 128) ----
 * The same work split as attn_kernel (a tile of up to 64 (token, head) rows of one KV head;
 * here 8 warps and up to 128 rows; warp w owns rows 16w..16w+15), but S = Q K^T and O += P V run as
 * bf16 mma.sync m16n8k16 with fp32 accumulation, FlashAttention-2 style: Q stays in registers as A
 * fragments, each chunk of 64 KV positions is gathered through the page table, rounded to bf16 and
 * stored in shared memory by position (rows padded by 8 elements so fragment loads hit 32 distinct
 * banks; K's B fragments come through ldmatrix.x4, two k-steps a load, V's through
 * ldmatrix.x4.trans, two column tiles a load), the score fragments are masked (causal, KV
 * length; only on the chunks a warp's rows do not all see whole), the online softmax runs in
 * base 2 (log2(e) folded into the Q scale) with each row's max and sum reduced over the 4
 * threads of a quad, and the probabilities are re-packed from the S accumulator layout straight
 * into A fragments for P V. On an H100 (bench/RESULTS.md, 2026-12-06) the S products' order
 * (k-steps outermost, so the 8 accumulators' products are independent back to back), the
 * skipped masks and a shift for the page table took a 4k prefill's attention from 1.76 to
 * about 1.0 ms a layer. */
/* mma.cuh's product, A's fragments as one array */
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    tdm_mma16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

/* 2^x by the special-function unit alone, results below 2^-126 flushed to zero (exp2f adds a
 * scaling around it for them: three more instructions a score, for probabilities that round
 * away in bf16 anyway) */
__device__ __forceinline__ float ex2_ftz(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

constexpr int MWARPS = 8; /* warps (16 rows each) of the tensor-core kernel */

__device__ __forceinline__ void ldsm_x4_trans(uint32_t &r0, uint32_t &r1, uint32_t &r2,
                                              uint32_t &r3, const void *p)
{
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void ldsm_x4(uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3,
                                        const void *p)
{
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

/* KT: the KV element type (enum tdm_cu_kv), fixed at compile time here: fp32 rows are loaded
 * as float4s and rounded to bf16 for the tensor cores, 2-byte rows as 16-byte words (8
 * elements), bf16 ones stored as they are, f16 ones converted through fp32. */
template <int D, int KT> __global__ void __launch_bounds__(MWARPS * 32) attn_mma_kernel(attn_args a)
{
    tdm_pdl_wait();
    constexpr int BN = 64, KS = D + 8;
    __shared__ __align__(16) uint16_t Ks[BN * KS];
    __shared__ __align__(16) uint16_t Vs[BN * KS];
    /* tiles run last first: the longest causal spans start early, the short ones fill the tail */
    const int tile = gridDim.x - 1 - blockIdx.x, g = blockIdx.y;
    const int seq = a.tiles[3 * tile], tok0 = a.tiles[3 * tile + 1], ntok = a.tiles[3 * tile + 2];
    const int R = ntok * a.gs;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, qr = lane / 4, qc = lane % 4;
    const int r0 = warp * 16 + qr, r1 = r0 + 8;
    const seq_kv sk = seq_kv_of(a, seq);
    const unsigned long long mk0 = r0 < R && a.tree_mask ? a.tree_mask[tok0 + r0 / a.gs] : 0ull;
    const unsigned long long mk1 = r1 < R && a.tree_mask ? a.tree_mask[tok0 + r1 / a.gs] : 0ull;
    const int pos0 = r0 < R ? (mk0 ? sk.tp - 1 : a.positions[tok0 + r0 / a.gs]) : -1;
    const int pos1 = r1 < R ? (mk1 ? sk.tp - 1 : a.positions[tok0 + r1 / a.gs]) : -1;
    /* the last column every row of the warp sees (rows past R are never written: no limit) */
    const int warp_lim =
        __reduce_min_sync(0xffffffffu, min(r0 < R ? pos0 : INT_MAX, r1 < R ? pos1 : INT_MAX));
    const float qs = a.scale * 1.4426950408889634f;
    const float *q0 =
        r0 < R ? a.q + ((size_t)(tok0 + r0 / a.gs) * a.n_heads + g * a.gs + r0 % a.gs) * D
               : nullptr;
    const float *q1 =
        r1 < R ? a.q + ((size_t)(tok0 + r1 / a.gs) * a.n_heads + g * a.gs + r1 % a.gs) * D
               : nullptr;
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
        const int k0 = ks * 16 + qc * 2;
        float2 x00 = q0 ? *reinterpret_cast<const float2 *>(q0 + k0) : make_float2(0.f, 0.f);
        float2 x10 = q1 ? *reinterpret_cast<const float2 *>(q1 + k0) : make_float2(0.f, 0.f);
        float2 x01 = q0 ? *reinterpret_cast<const float2 *>(q0 + k0 + 8) : make_float2(0.f, 0.f);
        float2 x11 = q1 ? *reinterpret_cast<const float2 *>(q1 + k0 + 8) : make_float2(0.f, 0.f);
        qf[ks][0] = pack_bf16(x00.x * qs, x00.y * qs);
        qf[ks][1] = pack_bf16(x10.x * qs, x10.y * qs);
        qf[ks][2] = pack_bf16(x01.x * qs, x01.y * qs);
        qf[ks][3] = pack_bf16(x11.x * qs, x11.y * qs);
    }
    float o[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; nt++)
        o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int kv_end =
        sk.nodes ? sk.tp + sk.n_nodes : min(a.positions[tok0 + ntok - 1] + 1, a.seq_kv_len[seq]);
    const int ps = a.page_size;
    const int32_t *pages = a.page_ids + a.seq_page_start[seq];
    const size_t page_floats = (size_t)2 * a.nkv * ps * D, v_off = (size_t)a.nkv * ps * D;

    /* each thread moves LD 16-byte words of K and of V per chunk (float4s of fp32, or 8 2-byte
     * elements); the next chunk's loads are issued before the current chunk's math, so their
     * latency hides behind it */
    constexpr int EPW = KT == TDM_CU_KV_F32 ? 4 : 8; /* elements per word */
    constexpr int LD = BN * D / EPW / (MWARPS * 32);
    uint4 pk[LD], pv[LD];
    /* a page size that is a power of two (the usual case) turns the page table's division
     * into a shift: the address math was a quarter of the loop's instructions */
    const int lg = (ps & (ps - 1)) == 0 ? __ffs(ps) - 1 : -1;
    const size_t g_off = (size_t)g * ps * D;
    auto fetch = [&](int c0) {
#pragma unroll
        for (int u = 0; u < LD; u++) {
            const int idx = threadIdx.x + u * MWARPS * 32;
            const int i = idx / (D / EPW), d = (idx % (D / EPW)) * EPW, p = c0 + i;
            pk[u] = pv[u] = make_uint4(0u, 0u, 0u, 0u);
            if (p < kv_end) {
                const size_t kr =
                    (lg >= 0 && p < sk.tp
                         ? (size_t)pages[p >> lg] * page_floats + g_off + (size_t)(p & (ps - 1)) * D
                         : kv_row(a, pages, sk, p, g, page_floats, D)) +
                    d;
                if (KT == TDM_CU_KV_F32) {
                    const float *kb = static_cast<const float *>(a.kv_base);
                    pk[u] = *reinterpret_cast<const uint4 *>(kb + kr);
                    pv[u] = *reinterpret_cast<const uint4 *>(kb + kr + v_off);
                } else {
                    pk[u] = tdm_kv_ld8_raw(a.kv_base, kr);
                    pv[u] = tdm_kv_ld8_raw(a.kv_base, kr + v_off);
                }
            }
        }
    };
    /* a fetched word as bf16 pairs for shared memory */
    auto to_smem = [&](const uint4 w, uint16_t *dst) {
        if (KT == TDM_CU_KV_F32) {
            *reinterpret_cast<uint2 *>(dst) =
                make_uint2(pack_bf16(__uint_as_float(w.x), __uint_as_float(w.y)),
                           pack_bf16(__uint_as_float(w.z), __uint_as_float(w.w)));
        } else if (KT == TDM_CU_KV_BF16) {
            *reinterpret_cast<uint4 *>(dst) = w;
        } else {
            const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
            uint32_t o[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = tdm_kv_widen2(ws[j], TDM_CU_KV_F16);
                o[j] = pack_bf16(f.x, f.y);
            }
            *reinterpret_cast<uint4 *>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
        }
    };
    fetch(0);
    for (int c0 = 0; c0 < kv_end; c0 += BN) {
        __syncthreads(); /* the previous chunk's math is done with Ks, Vs */
#pragma unroll
        for (int u = 0; u < LD; u++) {
            const int idx = threadIdx.x + u * MWARPS * 32;
            const int i = idx / (D / EPW), d = (idx % (D / EPW)) * EPW;
            to_smem(pk[u], Ks + i * KS + d);
            to_smem(pv[u], Vs + i * KS + d);
        }
        __syncthreads();
        if (c0 + BN < kv_end) fetch(c0 + BN);

        /* S = Q K^T: the k-steps outermost, so the BN / 8 accumulators' products are
         * independent back to back (each accumulator still sums its k-steps in order); K's B
         * fragments of two k-steps come in one ldmatrix.x4 (rows are positions, 8 dimensions a
         * matrix: exactly the "col" layout of K^T) */
        float sc[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++)
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks += 2) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                uint32_t b[4];
                ldsm_x4(b[0], b[1], b[2], b[3],
                        Ks + (nt * 8 + (lane & 7)) * KS + ks * 16 + (lane >> 3) * 8);
                mma16816(sc[nt], qf[ks], b[0], b[1]);
                mma16816(sc[nt], qf[ks + 1], b[2], b[3]);
            }
        }
        /* the mask, only on a chunk that some row of this warp does not see whole (past the
         * KV end, past a row's position, or a tree's nodes): elsewhere it keeps every score */
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (c0 + BN > kv_end || c0 + BN - 1 > warp_lim) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = c0 + nt * 8 + qc * 2 + (e & 1);
                    const int pos = e < 2 ? pos0 : pos1;
                    const unsigned long long mk = e < 2 ? mk0 : mk1;
                    if (!(col < kv_end && sees(col, pos, mk, sk.tp))) sc[nt][e] = -INFINITY;
                }
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++) {
            mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
        }
        for (int off = 1; off < 4; off <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float al0 = mn0 == -INFINITY || m0 == -INFINITY ? 0.0f : ex2_ftz(m0 - mn0);
        const float al1 = mn1 == -INFINITY || m1 == -INFINITY ? 0.0f : ex2_ftz(m1 - mn1);
        float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt++) {
            sc[nt][0] = mn0 == -INFINITY ? 0.0f : ex2_ftz(sc[nt][0] - mn0);
            sc[nt][1] = mn0 == -INFINITY ? 0.0f : ex2_ftz(sc[nt][1] - mn0);
            sc[nt][2] = mn1 == -INFINITY ? 0.0f : ex2_ftz(sc[nt][2] - mn1);
            sc[nt][3] = mn1 == -INFINITY ? 0.0f : ex2_ftz(sc[nt][3] - mn1);
            sum0 += sc[nt][0] + sc[nt][1];
            sum1 += sc[nt][2] + sc[nt][3];
        }
        for (int off = 1; off < 4; off <<= 1) {
            sum0 += __shfl_xor_sync(0xffffffffu, sum0, off);
            sum1 += __shfl_xor_sync(0xffffffffu, sum1, off);
        }
        l0 = l0 * al0 + sum0;
        l1 = l1 * al1 + sum1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            o[nt][0] *= al0;
            o[nt][1] *= al0;
            o[nt][2] *= al1;
            o[nt][3] *= al1;
        }
#pragma unroll
        for (int j = 0; j < BN / 16; j++) {
            const uint32_t pa[4] = {pack_bf16(sc[2 * j][0], sc[2 * j][1]),
                                    pack_bf16(sc[2 * j][2], sc[2 * j][3]),
                                    pack_bf16(sc[2 * j + 1][0], sc[2 * j + 1][1]),
                                    pack_bf16(sc[2 * j + 1][2], sc[2 * j + 1][3])};
#pragma unroll
            for (int nt = 0; nt < D / 8; nt += 2) {
                /* V rows are positions: the transposing load makes them "col"; two 8-column
                 * tiles a load */
                uint32_t b[4];
                ldsm_x4_trans(b[0], b[1], b[2], b[3],
                              Vs + (j * 16 + (lane & 15)) * KS + (nt + (lane >> 4)) * 8);
                mma16816(o[nt], pa, b[0], b[1]);
                mma16816(o[nt + 1], pa, b[2], b[3]);
            }
        }
    }
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = half ? r1 : r0;
        if (r >= R) continue;
        const float inv = half ? inv1 : inv0;
        const size_t row = (size_t)(tok0 + r / a.gs) * a.n_heads + g * a.gs + r % a.gs;
        float *out = a.out + row * D;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            const int col = nt * 8 + qc * 2;
            const float y0 = o[nt][half * 2] * inv, y1 = o[nt][half * 2 + 1] * inv;
            *reinterpret_cast<float2 *>(out + col) = make_float2(y0, y1);
            if (a.out_bf16)
                *reinterpret_cast<uint32_t *>(a.out_bf16 + row * D + col) = pack_bf16(y0, y1);
        }
    }
}

/* ---- decode: a pipeline of KV chunks, the chunk's positions split over the warps ----
 * For tiles of at most 16 (token, head) rows (a decode step's tiles: one token, its GQA group)
 * and head_dim 64, 128 or 256. attn_kernel has every warp read every position of a chunk, and
 * gathers a chunk only after the last one is used, so nothing is in flight while it computes.
 * Here:
 *   - K and V rows are copied as they are stored (bf16, f16 or fp32) straight into shared
 *     memory with cp.async, NST chunks of DCH positions ahead of the one being used: while a
 *     block computes, NST - 1 chunks of its KV are on their way;
 *   - the page id of each chunk's row is loaded one chunk before its copy is issued, so the
 *     page-table lookup is not on the copy's path;
 *   - warp w takes positions 8w .. 8w + 7 of each chunk for all the tile's rows, lane
 *     (position lane % 8, quarter lane / 8) scoring its position over a quarter of the 16-byte
 *     words of the K row (rows padded by 16 bytes, so the 8 positions' words fall in distinct
 *     banks), the quarters summed by shuffles; each warp keeps its own online-softmax state
 *     (max, sum, and V accumulated in registers, lane l holding dimensions NJ l .. NJ l + NJ - 1);
 *   - at the end the four warps' states are merged in shared memory, in warp order, and the
 *     tile's rows written (n_splits == 1) or its split state for combine_kernel.
 * Every order of summation is fixed by the tile's rows and KV range, never by the rest of the
 * step, so batch invariance holds as it does for attn_kernel (the split count aside, which the
 * caller fixes). Numerics as attn_kernel's: elements widened exactly, fp32 arithmetic, precise
 * expf, q pre-multiplied by the scale. */
constexpr int DCH = 32; /* positions per chunk: 8 per warp */

/* The shared-memory layout of dec_kernel<NJ, RM, EB> (EB: bytes per KV element). */
template <int NJ, int RM, int EB> struct dec_geom {
    static constexpr int HD = 32 * NJ;      /* head_dim */
    static constexpr int EPW = 16 / EB;     /* elements per 16-byte word */
    static constexpr int WPR = HD / EPW;    /* words per K (or V) row */
    static constexpr int RB = HD * EB + 16; /* a row in shared memory, padded */
    static constexpr int SB = 2 * DCH * RB; /* a chunk: its K rows, then its V rows */
    static constexpr int NST = SB * 6 <= 61440 ? 6 : SB * 2 >= 61440 ? 2 : 61440 / SB;
    static constexpr int MB = WARPS * RM * (HD + 2) * 4; /* the warps' states at the end */
    static constexpr size_t SMEM = (size_t)RM * HD * 4 + (NST * SB > MB ? NST * SB : MB);
};

template <int NJ, int RM, int EB>
__global__ void __launch_bounds__(WARPS * 32) dec_kernel(attn_args a)
{
    using G = dec_geom<NJ, RM, EB>;
    constexpr int HD = G::HD, EPW = G::EPW, WPR = G::WPR, RB = G::RB, SB = G::SB, NST = G::NST;
    tdm_pdl_wait();
    extern __shared__ __align__(16) unsigned char dsm[];
    float *Qs = reinterpret_cast<float *>(dsm); /* [RM][HD] */
    unsigned char *stages = dsm + (size_t)RM * HD * 4;

    const int g = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const tile_of tl = tile_at(a, blockIdx.x, split, DCH);
    const int seq = tl.seq, tok0 = tl.tok0, R = tl.R, lo = tl.lo, hi = tl.hi;
    const seq_kv sk = tl.sk;
    load_q(a, Qs, RM, HD, tok0, g, R);
    int pos[RM];
    unsigned long long msk[RM];
    rows_pos(a, tl, 0, pos, msk);
    const int n_chunks = hi > lo ? (hi - lo + DCH - 1) / DCH : 0;

    /* the copy: thread t moves words (t % 4) + 4u of chunk row t / 4, of K and of V */
    const int ps = a.page_size;
    const int32_t *pages = a.page_ids + a.seq_page_start[seq];
    const size_t page_elems = (size_t)2 * a.nkv * ps * HD, v_off = (size_t)a.nkv * ps * HD;
    const int crow = threadIdx.x / 4, cw = threadIdx.x % 4;
    const unsigned char *kvb = static_cast<const unsigned char *>(a.kv_base);
    auto page_of = [&](int c) -> int { /* the raw page id (or node slot) of this thread's row */
                                       const int p = lo + c * DCH + crow;
                                       if (c >= n_chunks || p >= hi) return -1;
                                       return p < sk.tp ? pages[p / ps] : sk.nodes[p - sk.tp];
    };
    auto issue = [&](int c, int raw) {
        if (c < n_chunks) {
            const int p = lo + c * DCH + crow;
            size_t e = 0;
            if (raw >= 0) {
                const int page = p < sk.tp ? raw : raw / ps, off = p < sk.tp ? p % ps : raw % ps;
                e = (size_t)page * page_elems + ((size_t)g * ps + off) * HD;
            }
            unsigned char *ks = stages + (size_t)(c % NST) * SB + (size_t)crow * RB;
            unsigned char *vs = ks + DCH * RB;
#pragma unroll
            for (int u = 0; u < WPR / 4; u++) {
                const int w = cw + 4 * u;
                cp_async16(ks + w * 16, kvb + (e + (size_t)w * EPW) * EB, raw >= 0);
                cp_async16(vs + w * 16, kvb + (e + v_off + (size_t)w * EPW) * EB, raw >= 0);
            }
        }
        cp_async_commit(); /* empty past the end: the wait below counts groups */
    };
#pragma unroll
    for (int c = 0; c < NST - 1; c++)
        issue(c, page_of(c));
    int next_raw = page_of(NST - 1);

    float m[RM], l[RM], acc[RM][NJ];
    state_init(m, l, acc);
    const int pl = lane % 8, q4 = lane / 8;
    for (int c = 0; c < n_chunks; c++) {
        cp_async_wait<NST - 2>(); /* this thread's copies of chunk c have landed */
        __syncthreads();          /* everyone's have, and chunk c - 1 is used by all */
        const int raw = next_raw;
        next_raw = page_of(c + NST);
        issue(c + NST - 1, raw);

        const unsigned char *ks = stages + (size_t)(c % NST) * SB;
        const unsigned char *vs = ks + DCH * RB;
        const int row = warp * 8 + pl, p = lo + c * DCH + row;
        float s[RM];
#pragma unroll
        for (int r = 0; r < RM; r++)
            s[r] = 0.0f;
#pragma unroll
        for (int u = 0; u < NJ; u++) { /* 8-element groups q4, q4 + 4, ... of the row */
            const int g8 = q4 + 4 * u;
            float kf[8];
            if constexpr (EB == 4) {
                const uint4 k0 = *reinterpret_cast<const uint4 *>(ks + row * RB + g8 * 32);
                const uint4 k1 = *reinterpret_cast<const uint4 *>(ks + row * RB + g8 * 32 + 16);
                kf[0] = __uint_as_float(k0.x), kf[1] = __uint_as_float(k0.y);
                kf[2] = __uint_as_float(k0.z), kf[3] = __uint_as_float(k0.w);
                kf[4] = __uint_as_float(k1.x), kf[5] = __uint_as_float(k1.y);
                kf[6] = __uint_as_float(k1.z), kf[7] = __uint_as_float(k1.w);
            } else {
                const uint4 kw = *reinterpret_cast<const uint4 *>(ks + row * RB + g8 * 16);
                const uint32_t ws[4] = {kw.x, kw.y, kw.z, kw.w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = tdm_kv_widen2(ws[j], a.kv_t);
                    kf[2 * j] = f.x, kf[2 * j + 1] = f.y;
                }
            }
#pragma unroll
            for (int r = 0; r < RM; r++) {
                const float *qr = Qs + r * HD + g8 * 8;
                const float4 qa = *reinterpret_cast<const float4 *>(qr);
                const float4 qb = *reinterpret_cast<const float4 *>(qr + 4);
                s[r] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3];
                s[r] += qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
            }
        }
        float e[RM];
#pragma unroll
        for (int r = 0; r < RM; r++) {
            s[r] += __shfl_xor_sync(0xffffffffu, s[r], 8);
            s[r] += __shfl_xor_sync(0xffffffffu, s[r], 16);
            const bool ok = p < hi && sees(p, pos[r], msk[r], sk.tp);
            const float sc = ok ? s[r] : -INFINITY;
            float mx = sc;
            for (int o = 4; o > 0; o >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[r], mx);
            e[r] = 0.0f;
            if (m_new == -INFINITY) continue; /* uniform over the warp */
            const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
            e[r] = ok ? expf(sc - m_new) : 0.0f;
            float sum = e[r];
            for (int o = 4; o > 0; o >>= 1)
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
#pragma unroll
            for (int j = 0; j < NJ; j++)
                acc[r][j] *= alpha;
        }
#pragma unroll
        for (int pp = 0; pp < 8; pp++) {
            const unsigned char *vr = vs + (warp * 8 + pp) * RB + lane * NJ * EB;
            float v[NJ];
            if constexpr (EB == 4) {
#pragma unroll
                for (int j = 0; j < NJ; j += 2) {
                    const float2 x = *reinterpret_cast<const float2 *>(vr + j * 4);
                    v[j] = x.x, v[j + 1] = x.y;
                }
            } else {
#pragma unroll
                for (int j = 0; j < NJ; j += 2) {
                    const float2 x =
                        tdm_kv_widen2(*reinterpret_cast<const uint32_t *>(vr + j * 2), a.kv_t);
                    v[j] = x.x, v[j + 1] = x.y;
                }
            }
#pragma unroll
            for (int r = 0; r < RM; r++) {
                const float w = __shfl_sync(0xffffffffu, e[r], pp);
#pragma unroll
                for (int j = 0; j < NJ; j++)
                    acc[r][j] += w * v[j];
            }
        }
    }

    /* the warps' states, merged in warp order */
    cp_async_wait<0>();
    __syncthreads();
    float *ws_m = reinterpret_cast<float *>(stages); /* [WARPS][RM] */
    float *ws_l = ws_m + WARPS * RM;                 /* [WARPS][RM] */
    float *ws_a = ws_l + WARPS * RM;                 /* [WARPS][RM][HD] */
#pragma unroll
    for (int r = 0; r < RM; r++) {
        if (lane == 0) ws_m[warp * RM + r] = m[r], ws_l[warp * RM + r] = l[r];
#pragma unroll
        for (int j = 0; j < NJ; j++)
            ws_a[(warp * RM + r) * HD + lane * NJ + j] = acc[r][j];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < R * HD; idx += blockDim.x) {
        const int r = idx / HD, d = idx % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++)
            M = fmaxf(M, ws_m[w * RM + r]);
        float y = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            const float mw = ws_m[w * RM + r];
            const float f = mw == -INFINITY ? 0.0f : expf(mw - M);
            y += ws_a[(w * RM + r) * HD + d] * f;
            L += ws_l[w * RM + r] * f;
        }
        const int t = tok0 + r / a.gs, h = g * a.gs + r % a.gs;
        if (a.n_splits == 1) {
            const float o = L > 0.0f ? y / L : 0.0f;
            a.out[((size_t)t * a.n_heads + h) * HD + d] = o;
            if (a.out_bf16) a.out_bf16[((size_t)t * a.n_heads + h) * HD + d] = to_bf16(o);
        } else {
            float *st = a.part + (((size_t)split * a.n_tokens + t) * a.n_heads + h) * (HD + 2);
            st[d] = y;
            if (d == 0) st[HD] = M, st[HD + 1] = L;
        }
    }
}

/* One block per (token, head): merges the split states in split order. The splits' maxima and
 * sums are read by one thread each (independent loads), the weights exp(m_s - M) go to shared
 * memory, then each thread folds its dimensions over the splits. */
__global__ void combine_kernel(const float *part, int n_splits, int n_tokens, int n_heads, int hd,
                               float *out, uint16_t *out_bf16)
{
    tdm_pdl_wait();
    __shared__ float ws[64], inv_s;
    const int th = blockIdx.x; /* token * n_heads + head */
    const size_t stride = (size_t)n_tokens * n_heads * (hd + 2);
    const float *base = part + (size_t)th * (hd + 2);
    if (threadIdx.x < 32) {
        const int sp0 = threadIdx.x, sp1 = threadIdx.x + 32;
        const float m0 = sp0 < n_splits ? base[sp0 * stride + hd] : -INFINITY;
        const float m1 = sp1 < n_splits ? base[sp1 * stride + hd] : -INFINITY;
        const float l0 = sp0 < n_splits ? base[sp0 * stride + hd + 1] : 0.0f;
        const float l1 = sp1 < n_splits ? base[sp1 * stride + hd + 1] : 0.0f;
        float M = fmaxf(m0, m1);
        for (int o = 16; o > 0; o >>= 1)
            M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        const float w0 = m0 == -INFINITY ? 0.0f : expf(m0 - M);
        const float w1 = m1 == -INFINITY ? 0.0f : expf(m1 - M);
        float L = l0 * w0 + l1 * w1;
        for (int o = 16; o > 0; o >>= 1)
            L += __shfl_xor_sync(0xffffffffu, L, o);
        ws[sp0] = w0;
        ws[sp1] = w1;
        if (threadIdx.x == 0) inv_s = L > 0.0f ? 1.0f / L : 0.0f;
    }
    __syncthreads();
    const float inv = inv_s;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float y = 0.0f;
#pragma unroll 8
        for (int sp = 0; sp < n_splits; sp++)
            y += base[sp * stride + d] * ws[sp];
        y *= inv;
        out[(size_t)th * hd + d] = y;
        if (out_bf16) out_bf16[(size_t)th * hd + d] = to_bf16(y);
    }
}

/* Whether $name starts with `c` (read once into *cache, -1 until then). */
bool env_is(const char *name, char c, int *cache)
{
    if (*cache < 0) {
        const char *e = getenv(name);
        *cache = e && *e == c;
    }
    return *cache == 1;
}

/* $TANDEM_CUDA_SIMT_ATTENTION=1 keeps prefill on the fp32 kernel (for comparisons). */
bool getenv_simt()
{
    static int v = -1;
    return env_is("TANDEM_CUDA_SIMT_ATTENTION", '1', &v);
}

/* Launches k over grid with smem bytes of dynamic shared memory, raising k's limit on its first
 * launch (attr_set: per kernel; the backend is driven by one thread). */
bool launch_smem(void (*k)(attn_args), bool &attr_set, dim3 grid, int threads, size_t smem,
                 cudaStream_t s, const attn_args &a)
{
    if (smem > 227 * 1024) return false;
    if (!attr_set) {
        if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess)
            return false;
        attr_set = true;
    }
    tdm_pdl_launch(k, grid, threads, smem, s, a);
    return true;
}

template <int NJ, int RPW> bool launch(cudaStream_t s, const attn_args &a, int n_tiles)
{
    constexpr int HDP = 32 * NJ;
    const size_t smem =
        ((size_t)WARPS * RPW * HDP + (size_t)CHUNK * (HDP + 1) + (size_t)CHUNK * HDP) *
        sizeof(float);
    static bool attr_set = false;
    return launch_smem(attn_kernel<NJ, RPW>, attr_set, dim3(n_tiles, a.nkv, a.n_splits), WARPS * 32,
                       smem, s, a);
}

template <int NJ, int RM, int EB> bool dec_launch(cudaStream_t s, const attn_args &a, int n_tiles)
{
    static bool attr_set = false;
    return launch_smem(dec_kernel<NJ, RM, EB>, attr_set, dim3(n_tiles, a.nkv, a.n_splits),
                       WARPS * 32, dec_geom<NJ, RM, EB>::SMEM, s, a);
}

template <int NJ, int EB>
bool dec_launch_rm(cudaStream_t s, const attn_args &a, int n_tiles, int rows)
{
    if (rows <= 1) return dec_launch<NJ, 1, EB>(s, a, n_tiles);
    if (rows <= 4) return dec_launch<NJ, 4, EB>(s, a, n_tiles);
    if (rows <= 8) return dec_launch<NJ, 8, EB>(s, a, n_tiles);
    return dec_launch<NJ, 16, EB>(s, a, n_tiles);
}

/* Whether dec_kernel takes a SIMT step: tiles of at most 16 rows, head_dim 64, 128 or 256;
 * $TANDEM_CUDA_DEC_ATTENTION=0 keeps them on attn_kernel (for comparisons: bench/RESULTS.md,
 * 2026-12-06). */
bool dec_takes(int rows, int hd)
{
    static int v = -1;
    return !env_is("TANDEM_CUDA_DEC_ATTENTION", '0', &v) && rows <= 16 &&
           (hd == 64 || hd == 128 || hd == 256);
}

template <int NJ> bool launch_rpw(cudaStream_t s, const attn_args &a, int n_tiles, int rpw)
{
    switch (rpw) {
    case 1:
        return launch<NJ, 1>(s, a, n_tiles);
    case 2:
        return launch<NJ, 2>(s, a, n_tiles);
    case 4:
        return launch<NJ, 4>(s, a, n_tiles);
    case 8:
        return launch<NJ, 8>(s, a, n_tiles);
    case 16:
        if (NJ <= 8) return launch < NJ, NJ <= 8 ? 16 : 8 > (s, a, n_tiles);
        return false;
    default:
        return false;
    }
}

} // namespace

extern "C" bool tdm_cu_attention(cudaStream_t s, const float *q, int n_heads, int n_kv_heads,
                                 int hd, const struct tdm_cu_step *st, const void *kv_base,
                                 int kv_type, float scale, float *out, uint16_t *out_bf16,
                                 int n_splits, float *part)
{
    if (st->n_tokens <= 0 || st->n_tiles <= 0) return true;
    if (hd <= 0 || hd > 512 || n_kv_heads <= 0 || n_heads % n_kv_heads) return false;
    const int gs = n_heads / n_kv_heads;
    const int rows = st->tile_tokens * gs;
    const bool mma = st->tile_tokens > 1 && (hd == 64 || hd == 128) && !getenv_simt();
    if (rows > (mma ? 16 * MWARPS : hd > 256 ? 32 : 64)) return false;
    int rpw = 1;
    while (rpw * WARPS < rows)
        rpw *= 2;
    const int nj = (hd + 31) / 32;
    if (n_splits < 1 || !part || mma) n_splits = 1; /* the tensor-core kernel does not split */
    attn_args a = {q,
                   out,
                   n_splits > 1 ? nullptr : out_bf16,
                   part,
                   kv_base,
                   kv_type,
                   n_heads,
                   n_kv_heads,
                   hd,
                   gs,
                   st->page_size,
                   n_splits,
                   st->n_tokens,
                   scale,
                   st->positions,
                   st->seq_kv_len,
                   st->seq_page_start,
                   st->page_ids,
                   st->tiles,
                   st->tree_mask,
                   st->seq_prefix,
                   st->tree_node_start,
                   st->tree_slots};
    bool ok;
    /* prefill-shaped steps (tiles of several tokens) on the tensor cores */
    if (mma && n_splits == 1) {
        dim3 grid(st->n_tiles, n_kv_heads);
#define TDM_MMA(D, KT) tdm_pdl_launch(attn_mma_kernel<D, KT>, grid, MWARPS * 32, 0, s, a)
        if (kv_type == TDM_CU_KV_BF16) {
            if (hd == 64)
                TDM_MMA(64, TDM_CU_KV_BF16);
            else
                TDM_MMA(128, TDM_CU_KV_BF16);
        } else if (kv_type == TDM_CU_KV_F16) {
            if (hd == 64)
                TDM_MMA(64, TDM_CU_KV_F16);
            else
                TDM_MMA(128, TDM_CU_KV_F16);
        } else {
            if (hd == 64)
                TDM_MMA(64, TDM_CU_KV_F32);
            else
                TDM_MMA(128, TDM_CU_KV_F32);
        }
#undef TDM_MMA
        return true;
    }
    if (dec_takes(rows, hd)) {
        const bool f32 = kv_type == TDM_CU_KV_F32;
        if (hd == 64)
            ok = f32 ? dec_launch_rm<2, 4>(s, a, st->n_tiles, rows)
                     : dec_launch_rm<2, 2>(s, a, st->n_tiles, rows);
        else if (hd == 128)
            ok = f32 ? dec_launch_rm<4, 4>(s, a, st->n_tiles, rows)
                     : dec_launch_rm<4, 2>(s, a, st->n_tiles, rows);
        else
            ok = f32 ? dec_launch_rm<8, 4>(s, a, st->n_tiles, rows)
                     : dec_launch_rm<8, 2>(s, a, st->n_tiles, rows);
    } else if (nj <= 1)
        ok = launch_rpw<1>(s, a, st->n_tiles, rpw);
    else if (nj <= 2)
        ok = launch_rpw<2>(s, a, st->n_tiles, rpw);
    else if (nj <= 4)
        ok = launch_rpw<4>(s, a, st->n_tiles, rpw);
    else if (nj <= 8)
        ok = launch_rpw<8>(s, a, st->n_tiles, rpw);
    else
        ok = launch_rpw<16>(s, a, st->n_tiles, rpw);
    if (!ok) return false;
    if (n_splits > 1)
        tdm_pdl_launch(combine_kernel, st->n_tokens * n_heads, 128, 0, s, part, n_splits,
                       st->n_tokens, n_heads, hd, out, out_bf16);
    return true;
}

namespace
{
struct kv_pairs {
    int32_t src[TDM_CU_KV_COPY_MAX], dst[TDM_CU_KV_COPY_MAX];
};

/* One block per layer and K or V head, the pairs in order: a thread handles the same elements
 * of every pair, so a pair that reads what an earlier one wrote (or overwrites what it read)
 * sees it in program order, without a barrier. */
/* Rows move as 16-bit units (a row of hd elements is hd * elem_bytes / 2 of them), whatever
 * the element type. */
__global__ void kv_copy_kernel(uint16_t *base, size_t layer_units, int row, int ps, int nkv, int n,
                               int halves, kv_pairs pr)
{
    tdm_pdl_wait();
    const size_t head = (size_t)ps * row, page = (size_t)halves * nkv * head;
    uint16_t *layer = base + (size_t)blockIdx.x * layer_units + (size_t)blockIdx.y * head;
    for (int i = 0; i < n; i++) {
        const uint16_t *from =
            layer + (size_t)(pr.src[i] / ps) * page + (size_t)(pr.src[i] % ps) * row;
        uint16_t *to = layer + (size_t)(pr.dst[i] / ps) * page + (size_t)(pr.dst[i] % ps) * row;
        for (int d = threadIdx.x; d < row; d += blockDim.x)
            to[d] = from[d];
    }
}
} // namespace

extern "C" void tdm_cu_kv_copy(cudaStream_t s, void *base, int kv_type, int n_layers,
                               size_t layer_bytes, int n_kv_heads, int hd, int page_size,
                               bool latent, const int32_t *src, const int32_t *dst, int n)
{
    if (n <= 0 || n_layers <= 0) return;
    kv_pairs pr = {};
    n = min(n, TDM_CU_KV_COPY_MAX);
    for (int i = 0; i < n; i++) {
        pr.src[i] = src[i];
        pr.dst[i] = dst[i];
    }
    const int halves = latent ? 1 : 2;                      /* a latent page: K rows only */
    dim3 grid(n_layers, halves * n_kv_heads);               /* (layer, K head then V head) */
    const int row = kv_type == TDM_CU_KV_F32 ? 2 * hd : hd; /* 16-bit units */
    tdm_pdl_launch(kv_copy_kernel, grid, 128, 0, s, static_cast<uint16_t *>(base),
                   layer_bytes / sizeof(uint16_t), row, page_size, n_kv_heads, n, halves, pr);
}

extern "C" int tdm_cu_attention_rows_cap(int hd)
{
    if ((hd == 64 || hd == 128) && !getenv_simt()) return 16 * MWARPS; /* tensor-core kernel */
    return hd > 256 ? 32 : 64;
}
