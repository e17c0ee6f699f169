/*
 * Sampling on the GPU: one 1,024-thread block per logit row, choosing the token that the host
 * sampler (src/sample/sampler.c) chooses for the same logits.
 *
 * What must match the host, and how:
 *   - the draw: the same Philox4x32-10 counter RNG keyed on (seed, request id, position);
 *   - the order of candidates: (probability descending, id ascending) when top-k or top-p cut
 *     by rank, id order otherwise;
 *   - the arithmetic of each value: penalties, (logit - max) * (1 / T), the exponential and the
 *     normalisation are the same float operations (no contraction into FMAs; the exponential
 *     is computed in double and rounded, within an ulp of glibc's expf).
 * The host sorts candidates; here nothing is sorted. Every cut (the k-th candidate, the first
 * whose cumulative mass reaches top_p, the one where the cumulative mass passes the uniform
 * draw) is "the smallest key K whose prefix weight reaches a target", found by an MSD radix
 * select on a 50-bit key (32 bits of the value, order-preserving, then 18 bits of id): seven
 * passes of 8-bit digits, each a histogram of the candidates that share the digits found so
 * far. Masses are fixed point (2^-62 units) so that the histograms' atomic sums do not depend
 * on the order the atomics land: the block gives the same answer every time. Before the
 * selects, a threshold (the host's trick: lowered until the candidates above it hold top_k of
 * them and top_p of the mass) keeps only the candidates that can
 * matter (p_max / 8, lowered 8x at a time), and their keys are gathered into scratch memory,
 * so that a select's pass is one histogram of those few keys; lanes of a warp that fall in one
 * bin add up before one atomic. The top log-probabilities use the same select on the raw
 * logits' keys (candidates within 0.25, 0.5, 1, ... of the largest logit).
 *
 * Differences from the host are in the last bits of sums (parallel order, fixed point): a token
 * differs only when the draw lands within ~1e-7 of a boundary between two candidates.
 *
 * Modes (sample.h's enum tdm_sample_mode): a draw; a rejection drafter's proposal (the row's
 * distribution written to device memory, then a draw from it in id order, stream 3); a draft's
 * verification (exact: the draw, kept when it equals the draft; rejection: the draft kept with
 * probability min(1, p/q), stream 1, else a draw in id order from max(0, p - q), stream 2); a
 * token tree's node in rejection acceptance (its candidates tested as point masses, stream
 * 4 + i each, then a draw from what is left, stream 2); a prompt position's score (the token
 * given, nothing drawn: steps 3 to 6 are skipped).
 * A verified row's penalties leave out the later drafts of its span (its undo list), so every
 * row of a span is sampled at once and each sees the state the host would have at its turn.
 *
 * Threading: one block per row, rows independent; enqueued on the caller's stream.
 */
#include <cfloat>
#include <cstdint>

#include "backend/cuda/cuda_kernels.h"

namespace
{

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kHists = 16; /* histograms per block: each shared by two warps */
constexpr int kIdBits = 18;
constexpr int kTopShift = 48; /* the top digit of a 50-bit key */
constexpr uint64_t kNone = ~0ull;
constexpr double kFix = 4611686018427387904.0; /* 2^62: probability 1 in fixed point */

struct Smem {
    unsigned long long hist[kHists][256];
    unsigned long long col[256];
    double dred[kWarps];
    float fred[kWarps];
    int ired[kWarps];
    unsigned long long ured[kWarps];
    int sel_found, sel_digit;
    unsigned long long sel_below;
    int n_top, n_c;
    unsigned long long top_keys[TDM_CU_SAMPLE_MAX_TOP];
    int chosen;
    float raw_chosen;
};

__device__ __forceinline__ uint32_t ord_f32(float f)
{
    uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
/* ascending key = descending value, then ascending id */
__device__ __forceinline__ uint64_t key_desc(float v, int id)
{
    return ((uint64_t)(~ord_f32(v)) << kIdBits) | (uint64_t)id;
}
__device__ __forceinline__ float key_value(uint64_t k)
{
    uint32_t o = ~(uint32_t)(k >> kIdBits);
    uint32_t b = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
    return __uint_as_float(b);
}
__device__ __forceinline__ int key_id(uint64_t k)
{
    return (int)(k & ((1u << kIdBits) - 1));
}
__device__ __forceinline__ unsigned long long fix(float p)
{
    return (unsigned long long)((double)p * kFix);
}

/* Philox4x32-10 and the uniform double of tdm_rng_uniform (src/core/util.c). */
__device__ double rng_uniform(uint64_t seed, uint64_t rid, uint32_t pos, uint32_t draw)
{
    const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    uint32_t c0 = pos, c1 = draw, c2 = (uint32_t)rid, c3 = (uint32_t)(rid >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)M0 * c0, p1 = (uint64_t)M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1, n3 = (uint32_t)p0;
        c0 = n0, c1 = n1, c2 = n2, c3 = n3;
        k0 += W0, k1 += W1;
    }
    uint64_t bits = ((uint64_t)c0 << 32 | c1) >> 11;
    return (double)bits * (1.0 / 9007199254740992.0);
}

/* ---- block reductions in a fixed order (the same result every run) ---- */
/* The block's sum of v; red: kWarps slots of shared memory. */
template <class T> __device__ T block_sum(T v, T *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_down_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) red[w] = v;
    __syncthreads();
    T t = 0;
    for (int i = 0; i < kWarps; i++)
        t += red[i];
    return t;
}
__device__ double block_sum_d(double v, Smem &sm)
{
    return block_sum(v, sm.dred);
}
__device__ unsigned long long block_sum_u(unsigned long long v, Smem &sm)
{
    return block_sum(v, sm.ured);
}
/* The row's largest value and its lowest id (ties: lowest id), as tdm_argmax. */
__device__ void row_argmax(const float *lg, int vocab, Smem &sm, float *out_v, int *out_id)
{
    float v = -INFINITY;
    int id = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += kThreads)
        if (lg[i] > v || (lg[i] == v && i < id)) v = lg[i], id = i;
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_down_sync(0xffffffffu, v, o);
        int i2 = __shfl_down_sync(0xffffffffu, id, o);
        if (v2 > v || (v2 == v && i2 < id)) v = v2, id = i2;
    }
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sm.fred[w] = v, sm.ired[w] = id;
    __syncthreads();
    float bv = sm.fred[0];
    int bi = sm.ired[0];
    for (int i = 1; i < kWarps; i++)
        if (sm.fred[i] > bv || (sm.fred[i] == bv && sm.ired[i] < bi))
            bv = sm.fred[i], bi = sm.ired[i];
    *out_v = bv;
    *out_id = bi == 0x7fffffff ? 0 : bi; /* no candidate at all: token 0, as the host */
}

/* A log-probability from a logit and the row's log-sum-exp, never NaN (the host's
 * logprob_from): a +inf logit against a +inf sum is 0, anything else not finite is -inf. */
__device__ float logprob_from(float logit, double lse)
{
    if (isnan(logit)) return -INFINITY;
    if (isinf(lse) && lse > 0) return isinf(logit) && logit > 0 ? 0.0f : -INFINITY;
    const double lp = (double)logit - lse;
    return isnan(lp) ? -INFINITY : (float)lp;
}

/*
 * The smallest key K among the candidates such that the weights of the candidates with key <= K
 * sum to at least `target`; kNone when all of them sum to less. cand(i, &key, &w), i < n, says
 * whether entry i is a candidate and gives its key (< 2^56) and weight (< 2^63).
 */
template <class F> __device__ uint64_t radix_select(int n, F cand, uint64_t target, Smem &sm)
{
    uint64_t prefix = 0, below = 0;
    unsigned long long *h = sm.hist[(threadIdx.x >> 5) % kHists];
    for (int shift = kTopShift; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < kHists * 256; i += kThreads)
            (&sm.hist[0][0])[i] = 0;
        __syncthreads();
        const int hi = shift + 8, lane = threadIdx.x & 31;
        /* Lanes of a warp that fall in one bin add their weights together and one of them does
         * the atomic: in the early passes most candidates share a few bins (probabilities of
         * a few binades), and one atomic each on one address would serialise the block. The
         * group sum runs in three 21-bit pieces, each of which 32 lanes cannot overflow. */
        for (int base = threadIdx.x - lane; base < n; base += kThreads) {
            const int i = base + lane;
            uint64_t k = 0;
            unsigned long long w = 0;
            int bin = -1;
            if (i < n && cand(i, k, w) && (k >> hi) == (prefix >> hi))
                bin = (int)((k >> shift) & 255);
            const unsigned peers = __match_any_sync(0xffffffffu, bin);
            if (bin >= 0) {
                unsigned c0 = __reduce_add_sync(peers, (unsigned)(w & 0x1fffff));
                unsigned c1 = __reduce_add_sync(peers, (unsigned)((w >> 21) & 0x1fffff));
                unsigned c2 = __reduce_add_sync(peers, (unsigned)(w >> 42));
                if (lane == __ffs(peers) - 1)
                    atomicAdd(&h[bin], (unsigned long long)c0 + ((unsigned long long)c1 << 21) +
                                           ((unsigned long long)c2 << 42));
            }
        }
        __syncthreads();
        if (threadIdx.x < 256) {
            unsigned long long s = 0;
            for (int j = 0; j < kHists; j++)
                s += sm.hist[j][threadIdx.x];
            sm.col[threadIdx.x] = s;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int l = threadIdx.x;
            unsigned long long v[8], s = 0;
            for (int j = 0; j < 8; j++)
                s += (v[j] = sm.col[8 * l + j]);
            unsigned long long inc = s;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
                if (l >= o) inc += t;
            }
            unsigned m = __ballot_sync(0xffffffffu, below + inc >= target);
            if (m == 0) {
                if (l == 0) sm.sel_found = 0;
            } else if (l == __ffs(m) - 1) {
                unsigned long long c = below + inc - s;
                int d = 7;
                for (int j = 0; j < 8; j++) {
                    if (c + v[j] >= target) {
                        d = j;
                        break;
                    }
                    c += v[j];
                }
                sm.sel_found = 1;
                sm.sel_digit = 8 * l + d;
                sm.sel_below = c;
            }
        }
        __syncthreads();
        if (!sm.sel_found) return kNone;
        prefix |= (uint64_t)sm.sel_digit << shift;
        below = sm.sel_below;
        __syncthreads();
    }
    return prefix;
}

/*
 * Gathers the keys of the candidates (key_of(i, &k) true) into keys[] and returns their number;
 * a warp reserves room for its candidates with one atomic. Order does not matter: every later
 * use is an integer sum or a min.
 */
template <class F> __device__ int compact(int vocab, F key_of, unsigned long long *keys, Smem &sm)
{
    __syncthreads();
    if (threadIdx.x == 0) sm.n_c = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int base = threadIdx.x - lane; base < vocab; base += kThreads) {
        const int i = base + lane;
        uint64_t k = 0;
        const bool ok = i < vocab && key_of(i, k);
        const unsigned b = __ballot_sync(0xffffffffu, ok);
        int at = 0;
        if (lane == 0 && b) at = atomicAdd(&sm.n_c, __popc(b));
        at = __shfl_sync(0xffffffffu, at, 0);
        if (ok) keys[at + __popc(b & ((1u << lane) - 1))] = k;
    }
    __syncthreads();
    return sm.n_c;
}

/*
 * A draw in id order from non-negative weights w(i), i < n: the first id whose cumulative
 * weight passes u * total, in 2^-62 fixed point (each weight at most 1). Each thread owns a run
 * of ids; an exclusive scan of the runs' masses finds the run where the draw lands. -1 when
 * every weight is 0. Every thread gets the answer.
 */
template <class F> __device__ int draw_id_order(int n, F w, double u, Smem &sm)
{
    const int tid = threadIdx.x;
    const int per = (n + kThreads - 1) / kThreads;
    const int i0 = min(n, tid * per), i1 = min(n, i0 + per);
    unsigned long long mine = 0;
    for (int i = i0; i < i1; i++)
        mine += fix(w(i));
    unsigned long long inc = mine;
    const int l = tid & 31, wp = tid >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
        if (l >= o) inc += t;
    }
    __syncthreads();
    if (l == 31) sm.ured[wp] = inc;
    if (tid == 0) sm.chosen = -1;
    __syncthreads();
    unsigned long long base = 0, total = 0;
    for (int i = 0; i < kWarps; i++) {
        if (i < wp) base += sm.ured[i];
        total += sm.ured[i];
    }
    const unsigned long long exc = base + inc - mine;
    unsigned long long target = (unsigned long long)(u * (double)total);
    if (total > 0 && target >= total) target = total - 1;
    if (total > 0 && mine > 0 && exc <= target && target < exc + mine) {
        unsigned long long c = exc;
        for (int i = i0; i < i1; i++) {
            const unsigned long long f = fix(w(i));
            if (f == 0) continue;
            c += f;
            if (c > target) {
                sm.chosen = i;
                break;
            }
        }
    }
    __syncthreads();
    const int r = sm.chosen;
    __syncthreads();
    return r;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(float *logits, int vocab, const tdm_cu_sample_row *rows, tdm_cu_sample_pen *pens,
                  const uint32_t *masks, tdm_cu_sample_out *outs, float *escratch,
                  unsigned long long *kscratch)
{
    __shared__ Smem sm;
    unsigned long long *ckeys = kscratch + (size_t)blockIdx.x * vocab;
    const tdm_cu_sample_row p = rows[blockIdx.x];
    float *lg = logits + (size_t)blockIdx.x * vocab;
    tdm_cu_sample_out *out = outs + blockIdx.x;
    const int tid = threadIdx.x;

    /* 0. non-finite logits, from any source (the model included), as the host: NaN is never
     * chosen (it becomes -inf here, in place: each thread owns the ids that row_argmax reads
     * next, and row_argmax synchronises before anyone reads another's), a +inf wins outright
     * (the lowest id among them), and a row with nothing finite gives token 0. */
    for (int i = tid; i < vocab; i += kThreads)
        if (isnan(lg[i])) lg[i] = -INFINITY;

    /* 1. the raw log-sum-exp (log-probabilities are reported under the raw logits) */
    float mx;
    int amx;
    row_argmax(lg, vocab, sm, &mx, &amx);
    double raw_lse = mx; /* +inf or -inf when the largest is not finite */
    if (p.n_top >= 0 && isfinite(mx)) {
        double s = 0.0;
        for (int i = tid; i < vocab; i += kThreads)
            s += exp((double)lg[i] - (double)mx);
        raw_lse = (double)mx + log(block_sum_d(s, sm));
    }

    /* 2. the top log-probabilities: the n_top smallest keys of (raw logit desc, id asc) */
    const int n_top = min(p.n_top, min(vocab, TDM_CU_SAMPLE_MAX_TOP));
    if (n_top > 0) {
        /* candidates: logits within d of the max, d doubling until there are n_top of them */
        float lo = -INFINITY;
        for (float d = 0.25f; d < 1e4f; d *= 2.0f) {
            float t = mx - d;
            unsigned long long c = 0;
            for (int i = tid; i < vocab; i += kThreads)
                c += lg[i] >= t;
            if (block_sum_u(c, sm) >= (unsigned long long)n_top) {
                lo = t;
                break;
            }
        }
        auto key_of = [&](int i, uint64_t &k) {
            float v = lg[i];
            if (!(v >= lo)) return false;
            k = key_desc(v, i);
            return true;
        };
        const int n_c = compact(vocab, key_of, ckeys, sm);
        const uint64_t kth = radix_select(
            n_c,
            [&](int j, uint64_t &k, unsigned long long &w) {
                k = ckeys[j];
                w = 1;
                return true;
            },
            (uint64_t)n_top, sm);
        if (tid == 0) sm.n_top = 0;
        __syncthreads();
        for (int j = tid; j < n_c; j += kThreads) {
            const uint64_t k = ckeys[j];
            if (k <= kth) {
                int slot = atomicAdd(&sm.n_top, 1);
                if (slot < TDM_CU_SAMPLE_MAX_TOP) sm.top_keys[slot] = k;
            }
        }
        __syncthreads();
        if (tid == 0) {
            int n = min(sm.n_top, n_top);
            for (int a = 1; a < n; a++) /* insertion sort of at most 20 keys */
                for (int b = a; b > 0 && sm.top_keys[b] < sm.top_keys[b - 1]; b--) {
                    unsigned long long t = sm.top_keys[b];
                    sm.top_keys[b] = sm.top_keys[b - 1];
                    sm.top_keys[b - 1] = t;
                }
            for (int a = 0; a < n; a++) {
                out->top_ids[a] = key_id(sm.top_keys[a]);
                out->top_lps[a] = logprob_from(key_value(sm.top_keys[a]), raw_lse);
            }
            /* fewer candidates than asked for (NaN rows, now -inf, fall outside every
             * threshold): the rest are the lowest ids not listed, certain never to be drawn */
            for (int id = 0; n < n_top && id < vocab; id++) {
                bool listed = false;
                for (int a = 0; a < n && !listed; a++)
                    listed = out->top_ids[a] == id;
                if (!listed) out->top_ids[n] = id, out->top_lps[n++] = -INFINITY;
            }
        }
        __syncthreads();
    }

    /* a score row: the given token's log-probability, nothing drawn (p is the block's own, so
     * every thread takes the same branch) */
    if (p.mode == 4) {
        if (tid == 0) {
            const int d = p.draft;
            out->token = d;
            out->kept = 0;
            out->logprob = p.n_top >= 0 ? logprob_from(lg[d], raw_lse) : 0.0f;
        }
        return;
    }

    /* 3. penalties, then the logit bias, in place; each listed token's raw logit is kept for its
     * logprob */
    const bool penalised = p.pen_n > 0;
    if (penalised) {
        const int n_undo = min(max(p.n_undo, 0), TDM_CU_SAMPLE_MAX_UNDO);
        for (int j = tid; j < p.pen_n; j += kThreads) {
            tdm_cu_sample_pen &e = pens[p.pen_off + j];
            /* the count this row sees: less the later drafts of its span (its undo list) */
            uint32_t count = e.count;
            for (int a = 0; a < n_undo; a++)
                if (p.undo[a] == e.id && count > 0) count--;
            float l = lg[e.id];
            e.raw = l;
            if (p.repetition != 1.0f && (count || e.in_prompt))
                l = l > 0 ? __fdiv_rn(l, p.repetition) : __fmul_rn(l, p.repetition);
            if (count)
                l = __fsub_rn(l, __fadd_rn(p.presence, __fmul_rn(p.frequency, (float)count)));
            if (e.bias != 0.0f) l = __fadd_rn(l, e.bias);
            lg[e.id] = l;
        }
        __syncthreads();
        row_argmax(lg, vocab, sm, &mx, &amx);
    }
    /* 3b. the grammar's mask (structured output): the tokens it refuses are out of the draw */
    if (p.allow_off >= 0) {
        const uint32_t *al = masks + p.allow_off;
        for (int i = tid; i < vocab; i += kThreads)
            if (!(al[i >> 5] >> (i & 31) & 1u)) lg[i] = -INFINITY;
        __syncthreads();
        row_argmax(lg, vocab, sm, &mx, &amx);
    }

    int chosen = amx; /* greedy: the lowest id among the largest; forced when it is not finite */
    const bool forced = p.temperature == 0.0f || p.top_k == 1 || !isfinite(mx);
    float *ebuf = escratch + (size_t)blockIdx.x * vocab;
    /* the kept set, for the modes that need the distribution: prob(i) >= kept_lo (and > 0),
     * and with a cut by rank key_desc(prob(i), i) <= kept_cut; kept_mass its fixed-point sum */
    float kept_lo = 0.0f, inv_sum_k = 0.0f;
    uint64_t kept_cut = kNone;
    bool rank_cut = false;
    unsigned long long kept_mass = 0;
    if (!forced) {
        /* 4. softmax at the temperature, as the host: e = exp((l - max) * (1 / T)) */
        const float inv_t = __fdiv_rn(1.0f, p.temperature);
        const float m = mx;
        /* each exponential once (in double: the costly part), kept for every later pass */
        double s = 0.0;
        for (int i = tid; i < vocab; i += kThreads) {
            float e = (float)exp((double)__fmul_rn(__fsub_rn(lg[i], m), inv_t));
            ebuf[i] = e;
            s += e;
        }
        const float inv_sum = (float)(1.0 / block_sum_d(s, sm));
        inv_sum_k = inv_sum;
        auto prob = [&](int i) { return __fmul_rn(ebuf[i], inv_sum); };
        const float pmax = inv_sum; /* exp(0) * inv_sum: the largest probability */
        const float floor_p = __fmul_rn(p.min_p, pmax);
        const double u = rng_uniform(p.seed, p.request_id, p.position, 0);

        if (p.top_k == 0 && p.top_p >= 1.0f) {
            /* 5a. no cut by rank: candidates in id order, p >= min_p * p_max and p > 0 */
            kept_lo = floor_p;
            auto w = [&](int i) {
                const float q = prob(i);
                return q >= floor_p && q > 0.0f ? q : 0.0f;
            };
            if (p.mode == 1 || (p.mode == 2 && p.q) || p.mode == 3) { /* they need p's mass */
                unsigned long long mass = 0;
                for (int i = tid; i < vocab; i += kThreads)
                    mass += fix(w(i));
                kept_mass = block_sum_u(mass, sm);
            }
            const int c = draw_id_order(vocab, w, u, sm);
            if (c >= 0) chosen = c;
        } else {
            /* 5b. cut by rank. A threshold whose candidates provably hold the top_k and the
             * nucleus (the host's loop), then the cuts as radix selects over those. */
            float t = pmax / 8.0f;
            const unsigned long long P =
                p.top_p < 1.0f ? (unsigned long long)ceil((double)p.top_p * kFix) : 0;
            for (;; t /= 8.0f) {
                unsigned long long n = 0, mass = 0;
                for (int i = tid; i < vocab; i += kThreads) {
                    float q = prob(i);
                    if (q >= t) n++, mass += fix(q);
                }
                n = block_sum_u(n, sm);
                mass = block_sum_u(mass, sm);
                bool k_ok = p.top_k == 0 || n >= (unsigned long long)p.top_k;
                bool p_ok = p.top_p >= 1.0f || mass >= P;
                if ((k_ok && p_ok) || n == (unsigned long long)vocab || t == 0.0f) break;
            }
            const float lo = fmaxf(t, floor_p);
            uint64_t cut = kNone;
            /* the candidates' keys, gathered (the threshold keeps them to the head of the
             * distribution; a key holds its probability, so weights need no lookup) */
            auto key_of = [&](int i, uint64_t &k) {
                float q = prob(i);
                if (!(q >= lo)) return false;
                k = key_desc(q, i);
                return true;
            };
            const int n = compact(vocab, key_of, ckeys, sm);
            auto cand_n = [&](int j, uint64_t &k, unsigned long long &w) {
                k = ckeys[j];
                w = 1;
                return k <= cut;
            };
            auto cand_w = [&](int j, uint64_t &k, unsigned long long &w) {
                k = ckeys[j];
                w = fix(key_value(k));
                return k <= cut;
            };
            if (p.top_k > 0) cut = radix_select(n, cand_n, (uint64_t)p.top_k, sm);
            if (p.top_p < 1.0f) {
                uint64_t kp = radix_select(n, cand_w, P, sm);
                if (kp != kNone) cut = kp;
            }
            unsigned long long total = 0;
            for (int i = tid; i < n; i += kThreads) {
                uint64_t k;
                unsigned long long w;
                if (cand_w(i, k, w)) total += w;
            }
            total = block_sum_u(total, sm);
            kept_lo = lo;
            kept_cut = cut;
            rank_cut = true;
            kept_mass = total;
            if (total > 0) {
                unsigned long long target = (unsigned long long)(u * (double)total);
                if (target >= total) target = total - 1;
                uint64_t kd = radix_select(n, cand_w, target + 1, sm);
                if (kd != kNone) chosen = key_id(kd);
            }
        }
    }

    /* 6. the modes that need the row's distribution p (the host's tdm_sampler_dist): a
     * drafter's proposal writes it out and draws from it (stream 3); rejection verification
     * tests the draft against it (stream 1) and draws from the residual (stream 2) */
    const bool rejection = p.mode == 2 && p.q != nullptr;
    int kept = p.mode == 2 && chosen == p.draft;
    if (p.mode == 1 || rejection || p.mode == 3) {
        float *pd = p.mode == 1 ? p.dist : ebuf;
        const double total = (double)kept_mass / kFix;
        __syncthreads(); /* every earlier read of ebuf is done */
        for (int i = tid; i < vocab; i += kThreads) {
            float v;
            if (forced || !(total > 0.0)) {
                v = i == chosen ? 1.0f : 0.0f;
            } else {
                const float q = __fmul_rn(ebuf[i], inv_sum_k);
                const bool in = q >= kept_lo && (rank_cut ? key_desc(q, i) <= kept_cut : q > 0.0f);
                v = in ? (float)((double)q / total) : 0.0f;
            }
            pd[i] = v;
        }
        __syncthreads();
        auto wp = [&](int i) { return pd[i]; };
        if (p.mode == 3) {
            /* a tree's node: its candidates as point-mass proposals, one after another (the
             * host's verify_tree: candidate i kept with probability r(d), stream 4 + i; refused,
             * it leaves r without d), then a draw in id order from what is left (stream 2) */
            if (tid == 0) {
                const int n = min(max(p.n_cand, 0), TDM_CU_SAMPLE_MAX_CAND);
                double left = 1.0;
                sm.chosen = -1;
                for (int i = 0; i < n && sm.chosen < 0; i++) {
                    const int d = p.cand[i];
                    const double pdd = pd[d];
                    const double u = rng_uniform(p.seed, p.request_id, p.position, 4 + i);
                    if (pdd > 0.0 && u * left < pdd) {
                        sm.chosen = d;
                    } else {
                        left -= pdd;
                        pd[d] = 0.0f;
                    }
                }
            }
            __syncthreads();
            if (sm.chosen >= 0) {
                chosen = sm.chosen;
                kept = 1;
            } else {
                const double u2 = rng_uniform(p.seed, p.request_id, p.position, 2);
                const int t = draw_id_order(vocab, wp, u2, sm);
                const int n = min(max(p.n_cand, 0), TDM_CU_SAMPLE_MAX_CAND);
                chosen = t >= 0 ? t : (n ? p.cand[n - 1] : 0);
                kept = 0;
            }
        } else if (p.mode == 1) {
            const int t =
                draw_id_order(vocab, wp, rng_uniform(p.seed, p.request_id, p.position, 3), sm);
            chosen = t >= 0 ? t : 0;
            if (p.one_hot)
                for (int i = tid; i < vocab; i += kThreads)
                    pd[i] = i == chosen ? 1.0f : 0.0f;
        } else {
            const int d = p.draft;
            const float qd = p.q[d], pdd = pd[d];
            const double u1 = rng_uniform(p.seed, p.request_id, p.position, 1);
            kept = qd > 0.0f && u1 * (double)qd < (double)pdd;
            if (kept) {
                chosen = d;
            } else {
                const float *q = p.q;
                auto wr = [&](int i) { return pd[i] > q[i] ? __fsub_rn(pd[i], q[i]) : 0.0f; };
                const double u2 = rng_uniform(p.seed, p.request_id, p.position, 2);
                int t = draw_id_order(vocab, wr, u2, sm);
                if (t < 0) t = draw_id_order(vocab, wp, u2, sm); /* p == q: p itself */
                chosen = t >= 0 ? t : d;
            }
        }
        __syncthreads();
    }

    /* 7. the chosen token's log-probability under the raw logits */
    if (tid == 0) {
        out->token = chosen;
        out->kept = kept;
        sm.raw_chosen = lg[chosen];
    }
    __syncthreads();
    if (penalised)
        for (int j = tid; j < p.pen_n; j += kThreads)
            if (pens[p.pen_off + j].id == chosen) sm.raw_chosen = pens[p.pen_off + j].raw;
    __syncthreads();
    if (tid == 0) out->logprob = p.n_top >= 0 ? logprob_from(sm.raw_chosen, raw_lse) : 0.0f;
}

} // namespace

extern "C" bool tdm_cu_sample(cudaStream_t s, float *logits, int n_rows, int vocab,
                              const struct tdm_cu_sample_row *rows, struct tdm_cu_sample_pen *pens,
                              const uint32_t *masks, struct tdm_cu_sample_out *out, void *scratch)
{
    if (vocab <= 0 || vocab > TDM_CU_SAMPLE_MAX_VOCAB) return false;
    if (n_rows <= 0) return true;
    /* scratch: the exponentials [n_rows][vocab] floats, then the keys [n_rows][vocab] */
    float *e = (float *)scratch;
    unsigned long long *k =
        (unsigned long long *)((char *)scratch + tdm_cu_sample_scratch_keys_at(n_rows, vocab));
    sample_kernel<<<n_rows, kThreads, 0, s>>>(logits, vocab, rows, pens, masks, out, e, k);
    return true;
}

/* A step launched before the one it follows has sampled: each TDM_TOKEN_PREV(j) token becomes
 * that sampling's token of row j (a row past it, or a token outside the vocabulary, reads as
 * token 0: the engine checked j, so neither happens). */
static __global__ void resolve_tokens_kernel(int32_t *tokens, int n, const tdm_cu_sample_out *prev,
                                             int n_prev, int vocab)
{
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int32_t v = tokens[t];
    if (v >= 0) return;
    const int j = -1 - v;
    const int32_t tk = j < n_prev ? prev[j].token : 0;
    tokens[t] = tk >= 0 && tk < vocab ? tk : 0;
}

extern "C" void tdm_cu_resolve_tokens(cudaStream_t s, int32_t *d_tokens, int n,
                                      const tdm_cu_sample_out *prev, int n_prev, int vocab)
{
    if (n <= 0) return;
    resolve_tokens_kernel<<<(n + 127) / 128, 128, 0, s>>>(d_tokens, n, prev, n_prev, vocab);
}
