/*
 * Tensor parallelism's shard geometry and rank group (include/tandem/tp.h says what each does).
 *
 * The barrier counts arrivals in `arrived`; the last rank to arrive resets the count and bumps
 * `generation`, which releases the others. A waiting rank spins on the generation for SPIN_NS
 * (a layer's all-reduces come microseconds apart while a step runs), yielding the core now and
 * then (ranks may outnumber the cores), then sleeps on a condition variable (ranks idle between
 * steps). As in core's thread pool, all atomics are sequentially consistent, which the
 * sleep/wake handshake relies on: a sleeper increments `sleepers` and then re-reads `generation`
 * under the mutex; the releaser bumps `generation` and then reads `sleepers`.
 *
 * The all-reduce, one barrier a call: each rank copies its partial sums into its row of a
 * staging half, the barrier, then each rank adds up every row of that half itself, in rank order
 * (rank 0's value, plus rank 1's, ...), into its own buffer, so every rank holds the same bits.
 * Halves alternate by the call's parity: a rank writes half h at call k only after the barrier
 * of call k - 1, which every rank reached after reading half h at call k - 2, so no row is
 * overwritten while another rank still reads it. The sum is made N times (once a rank) instead
 * of once: a step's n floats are small against its products, and a barrier saved is worth more
 * than the adds when ranks share cores.
 */
#include "tandem/tp.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_NS 200000ull /* how long a waiting rank spins before it sleeps (tdm_spin_ns) */

struct tdm_tp_group {
    int n_ranks;
    uint64_t spin_ns; /* SPIN_NS or $TANDEM_POOL_SPIN_US */
    _Atomic int arrived;
    _Atomic uint64_t generation;
    _Atomic int sleepers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the all-reduce's staging: [2][n_ranks][max_floats] host memory, a rank's partial sums in
     * its row of the half its call count's parity names */
    float *staging;
    size_t max_floats;
    uint64_t calls[TDM_TP_MAX_RANKS]; /* all-reduces each rank has made (its own entry only) */
    _Atomic size_t n[2];              /* each half's length (rank 0's), checked by the others */
};

/* [begin, end) of n items split over parts, the first n % parts one longer. */
static void split_even(int64_t n, int part, int parts, int64_t *begin, int64_t *end)
{
    int64_t per = n / parts, extra = n % parts;
    *begin = part * per + TDM_MIN((int64_t)part, extra);
    *end = *begin + per + (part < extra ? 1 : 0);
}

tdm_status tdm_tp_kv_shard_of(int n_kv_heads, int n_ranks, int rank, struct tdm_tp_kv_shard *out)
{
    const int H = n_kv_heads;
    if (n_ranks < 1 || n_ranks > TDM_TP_MAX_RANKS || rank < 0 || rank >= n_ranks)
        return tdm_err_set(TDM_EINVAL, "tp: rank %d of %d (1 .. %d ranks)", rank, n_ranks,
                           TDM_TP_MAX_RANKS);
    if (H < 1) return tdm_err_set(TDM_EINVAL, "tp: %d KV heads", H);
    if (n_ranks > H && n_ranks % H)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "tp: --tp %d over %d KV heads: more ranks than KV heads must be a "
                           "multiple of them (replica sets of %d)",
                           n_ranks, H, H);
    const int S = TDM_MIN(n_ranks, H);
    int64_t k0, k1;
    split_even(H, rank % S, S, &k0, &k1);
    *out = (struct tdm_tp_kv_shard){.replica_set = rank / S,
                                    .n_replica_sets = n_ranks / S,
                                    .set_size = S,
                                    .kv_head0 = (int)k0,
                                    .n_kv_heads = (int)(k1 - k0)};
    return TDM_OK;
}

tdm_status tdm_tp_shard_of(const struct tdm_model_config *c, int n_ranks, int rank,
                           int64_t ff_align, struct tdm_tp_shard *out)
{
    const int H = c->n_kv_heads, Q = c->n_heads;
    if (n_ranks < 1 || n_ranks > TDM_TP_MAX_RANKS || rank < 0 || rank >= n_ranks)
        return tdm_err_set(TDM_EINVAL, "tp: rank %d of %d (1 .. %d ranks)", rank, n_ranks,
                           TDM_TP_MAX_RANKS);
    if (H < 1 || Q < H || Q % H)
        return tdm_err_set(TDM_EINVAL, "tp: %d query heads over %d KV heads", Q, H);
    struct tdm_tp_kv_shard ks;
    tdm_status kst = tdm_tp_kv_shard_of(H, n_ranks, 0, &ks); /* the same refusals */
    if (kst != TDM_OK) return kst;
    const int g = Q / H, S = ks.set_size, R = ks.n_replica_sets;
    if (g % R)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "tp: --tp %d: each KV head's %d query heads do not split over its %d "
                           "replicas",
                           n_ranks, g, R);
    if (c->vocab_size < n_ranks)
        return tdm_err_set(TDM_EUNSUPPORTED, "tp: --tp %d over a vocabulary of %d", n_ranks,
                           c->vocab_size);
    if (ff_align < 1) ff_align = 1;
    const int64_t blocks = c->d_ff / ff_align;
    if (c->d_ff % ff_align || blocks < n_ranks)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "tp: --tp %d: the MLP's %d intermediate columns (blocks of %lld) do "
                           "not split over %d ranks",
                           n_ranks, c->d_ff, (long long)ff_align, n_ranks);
    struct tdm_tp_shard s = {0};
    /* each rank's attention weights, in units of head_dim x d_model (wq and wo: its query
     * heads'; wk and wv: its KV heads') */
    int64_t attn[TDM_TP_MAX_RANKS], attn_all = 0;
    for (int r = 0; r < n_ranks; r++) {
        struct tdm_tp_shard h = {
            .rank = r, .n_ranks = n_ranks, .replica_set = r / S, .n_replica_sets = R};
        (void)tdm_tp_kv_shard_of(H, n_ranks, r, &ks); /* valid: checked above */
        h.kv_head0 = ks.kv_head0;
        h.n_kv_heads = ks.n_kv_heads;
        if (R == 1) { /* whole KV heads: their query heads with them */
            h.q_head0 = h.kv_head0 * g;
            h.n_q_heads = h.n_kv_heads * g;
        } else { /* one KV head, a 1/R share of its query heads */
            h.q_head0 = h.kv_head0 * g + h.replica_set * (g / R);
            h.n_q_heads = g / R;
        }
        attn[r] = 2 * (int64_t)(h.n_q_heads + h.n_kv_heads);
        attn_all += attn[r];
        if (r == rank) s = h;
    }
    /* The MLP's blocks (3 x ff_align weights of d_model each: gate, up, down): so many a rank
     * that its attention and MLP weights together come as close to 1/N of the layer's as whole
     * blocks allow, at least one block each. An even head split gives an even MLP split; where
     * a rank holds more heads (3 KV heads over 2 ranks) it takes fewer columns. Cumulative
     * ends, rounded, so the shares add up to every block. */
    const double block = 3.0 * (double)ff_align / (double)TDM_MAX(c->head_dim, 1);
    const double per_rank = ((double)attn_all + block * (double)blocks) / n_ranks;
    int64_t f0 = 0, f1 = 0, prev_end = 0, attn_upto = 0;
    for (int r = 0; r < n_ranks; r++) {
        attn_upto += attn[r];
        int64_t end = blocks;
        if (r < n_ranks - 1) {
            end = llround((per_rank * (r + 1) - (double)attn_upto) / block);
            end = TDM_MAX(end, prev_end + 1);
            end = TDM_MIN(end, blocks - (n_ranks - 1 - r));
        }
        if (r == rank) {
            f0 = prev_end;
            f1 = end;
        }
        prev_end = end;
    }
    s.ff0 = f0 * ff_align;
    s.n_ff = (f1 - f0) * ff_align;
    split_even(c->vocab_size, rank, n_ranks, &f0, &f1);
    s.vocab0 = f0;
    s.n_vocab = f1 - f0;
    *out = s;
    return TDM_OK;
}

tdm_status tdm_tp_group_create(int n_ranks, size_t max_floats, tdm_tp_group_t **out)
{
    if (n_ranks < 1 || n_ranks > TDM_TP_MAX_RANKS)
        return tdm_err_set(TDM_EINVAL, "tp: %d ranks (1 .. %d)", n_ranks, TDM_TP_MAX_RANKS);
    struct tdm_tp_group *g = calloc(1, sizeof *g);
    if (!g) return tdm_err_set(TDM_ENOMEM, "tp: out of memory");
    g->n_ranks = n_ranks;
    g->max_floats = max_floats;
    if (tdm_spin_ns(SPIN_NS, &g->spin_ns) != TDM_OK) {
        free(g);
        return TDM_EINVAL;
    }
    if (n_ranks > 1 && max_floats) {
        g->staging = tdm_alloc_aligned(2 * (size_t)n_ranks * max_floats * sizeof(float));
        if (!g->staging) {
            free(g);
            return tdm_err_set(TDM_ENOMEM, "tp: out of memory for the all-reduce's staging");
        }
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    *out = g;
    return TDM_OK;
}

void tdm_tp_group_destroy(tdm_tp_group_t *g)
{
    if (!g) return;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    tdm_free_aligned(g->staging);
    free(g);
}

int tdm_tp_group_size(const tdm_tp_group_t *g)
{
    return g ? g->n_ranks : 1;
}

void tdm_tp_barrier(tdm_tp_group_t *g)
{
    if (g->n_ranks == 1) return;
    const uint64_t gen = atomic_load(&g->generation);
    if (atomic_fetch_add(&g->arrived, 1) == g->n_ranks - 1) {
        atomic_store(&g->arrived, 0);
        atomic_fetch_add(&g->generation, 1);
        if (atomic_load(&g->sleepers) > 0) {
            pthread_mutex_lock(&g->mu);
            pthread_cond_broadcast(&g->cv);
            pthread_mutex_unlock(&g->mu);
        }
        return;
    }
    const uint64_t t0 = tdm_now_ns();
    unsigned spins = 0;
    while (atomic_load(&g->generation) == gen) {
        cpu_relax();
        if ((++spins & 1023) != 0) continue;
        sched_yield(); /* more runnable threads than cores: let the one we wait for run */
        if (tdm_now_ns() - t0 >= g->spin_ns) {
            pthread_mutex_lock(&g->mu);
            atomic_fetch_add(&g->sleepers, 1);
            while (atomic_load(&g->generation) == gen)
                pthread_cond_wait(&g->cv, &g->mu);
            atomic_fetch_sub(&g->sleepers, 1);
            pthread_mutex_unlock(&g->mu);
        }
    }
}

void tdm_tp_allreduce(tdm_tp_group_t *g, int rank, float *x, size_t n)
{
    const int N = g->n_ranks;
    if (N == 1) return;
    TDM_ASSERT(rank >= 0 && rank < N && n <= g->max_floats);
    const int half = (int)(g->calls[rank]++ & 1);
    float *stage = g->staging + (size_t)half * N * g->max_floats;
    memcpy(stage + (size_t)rank * g->max_floats, x, n * sizeof(float));
    if (rank == 0) atomic_store(&g->n[half], n);
    tdm_tp_barrier(g);
    TDM_ASSERT(atomic_load(&g->n[half]) == n); /* every rank passed the same length */
    /* rank 0's, then the others' added in rank order */
    memcpy(x, stage, n * sizeof(float));
    for (int r = 1; r < N; r++) {
        const float *p = stage + (size_t)r * g->max_floats;
        for (size_t i = 0; i < n; i++)
            x[i] += p[i];
    }
}
