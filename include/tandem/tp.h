/*
 * tandem tp: tensor parallelism inside one process (DESIGN.md §5, the sharding contract).
 *
 * Two things live here: the shard geometry (which KV heads, query heads, MLP columns a rank
 * holds: one statement of the contract, for the engine now and for sharded KV transfers
 * later), and the rank group (the barrier and the shared-memory all-reduce the rank threads of
 * one engine meet at).
 *
 * Shards. Prefill TP = p, decode TP = d, KV heads = H; with TP = N ranks, S = min(N, H) ranks
 * make one replica set (a whole copy of the KV heads) and there are N / S sets. Rank r is
 * member r % S of set r / S and holds KV heads [k0, k1) of member r % S: H / S each where S
 * divides H (the contract), else split as evenly as whole heads allow (the first H % S members
 * hold one more: the default model has 3 KV heads, and TP = 2 holds 2 + 1). With replica sets
 * (N > H) every member of a set holds one KV head and the query heads of that head are split
 * over the N / H ranks that hold it, so no query head is computed twice. The MLP's
 * intermediate columns are split over all N ranks in whole quantisation blocks, so that each
 * rank's attention and MLP weights together are as even as blocks allow (evenly where the heads
 * split evenly; the default model at TP = 2: 672 + 864 of 1536 columns, the rank with 2 KV heads
 * taking fewer), and the LM head's rows (the vocabulary) over all N ranks as evenly as they go.
 *
 *   N = 4, H = 2:  rank 0: kv 0, q [0, g/2)    rank 1: kv 1, q [g, g + g/2)      (set 0)
 *                  rank 2: kv 0, q [g/2, g)    rank 3: kv 1, q [g + g/2, 2g)     (set 1)
 *
 * The group. A rank group holds N rank threads of one engine: rank 0 is the caller of the
 * engine (the scheduler's thread), ranks 1 .. N-1 are threads the engine starts. They meet at
 * tdm_tp_barrier (a barrier counting generations: it spins briefly, then sleeps) and sum partial
 * products with tdm_tp_allreduce: every rank copies its buffer into the group's staging, one
 * barrier, then every rank adds up all the ranks' values in rank order (rank 0's value plus
 * rank 1's plus ...) into its own buffer. The order of a sum never depends on which thread ran
 * it, so every rank holds the same bits and a sharded step is deterministic run to run (though
 * not bit-identical to TP = 1, whose dot products run in one piece).
 *
 * Threading: each rank calls the group from its own thread only; every call of a kind is made
 * by all N ranks in the same order (a rank that skipped one would deadlock the others).
 */
#ifndef TANDEM_TP_H
#define TANDEM_TP_H

#include <stddef.h>

#include "tandem/core.h"
#include "tandem/model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_TP_MAX_RANKS 64

/* What rank `rank` of n_ranks holds (all ranges half-open). */
struct tdm_tp_shard {
    int rank, n_ranks;
    int replica_set, n_replica_sets; /* ranks [set * S, (set + 1) * S) hold one whole copy */
    int kv_head0, n_kv_heads;        /* its KV heads (its KV pool holds these) */
    int q_head0, n_q_heads;          /* its query heads (rows of wq, columns of wo) */
    int64_t ff0, n_ff;               /* its MLP intermediate columns (gate/up rows, down columns) */
    int64_t vocab0, n_vocab;         /* its LM-head rows (vocabulary ids) */
};

/* Where rank `rank` of n_ranks keeps its KV heads, for H KV heads: the part of the contract
 * both sides of a sharded KV transfer compute (disagg.h), so it needs no model. */
struct tdm_tp_kv_shard {
    int replica_set, n_replica_sets; /* ranks [set * S, (set + 1) * S) hold one whole copy */
    int set_size;                    /* S = min(n_ranks, H) */
    int kv_head0, n_kv_heads;        /* its KV heads [kv_head0, kv_head0 + n_kv_heads) */
};
/* TDM_EINVAL for n_ranks outside 1 .. TDM_TP_MAX_RANKS, rank outside [0, n_ranks) or H < 1;
 * TDM_EUNSUPPORTED with a message when n_ranks exceeds H and is no multiple of it. Values may
 * come from a peer: nothing is asserted. */
tdm_status tdm_tp_kv_shard_of(int n_kv_heads, int n_ranks, int rank, struct tdm_tp_kv_shard *out);

/* The shard of `rank` for a dense attention model of config c over n_ranks ranks, the MLP split
 * in whole blocks of ff_align columns (a quantised down projection's block; 1 for F32).
 * TDM_EUNSUPPORTED with a message naming the shape when the model does not split so: more
 * ranks than KV heads that the heads do not divide (n_ranks % H), a KV head's query heads that
 * its replicas do not divide, or fewer MLP blocks than ranks. n_ranks 1 is the whole model. */
tdm_status tdm_tp_shard_of(const struct tdm_model_config *c, int n_ranks, int rank,
                           int64_t ff_align, struct tdm_tp_shard *out);

typedef struct tdm_tp_group tdm_tp_group_t;

/* A group of n_ranks (1 .. TDM_TP_MAX_RANKS) ranks whose all-reduces take at most max_floats
 * values (the group stages 2 x n_ranks x max_floats floats). */
tdm_status tdm_tp_group_create(int n_ranks, size_t max_floats, tdm_tp_group_t **out);
void tdm_tp_group_destroy(tdm_tp_group_t *g); /* no rank may be inside a call; NULL: no-op */
int tdm_tp_group_size(const tdm_tp_group_t *g);
/* Returns when every rank has called it; what each rank wrote before is visible to every rank
 * after. A waiting rank spins for a short while, then sleeps (idle ranks between steps). */
void tdm_tp_barrier(tdm_tp_group_t *g);
/* Sums x[0, n) over the ranks (each rank passes its own buffer of n <= max_floats floats, host
 * memory, the same n) and leaves the sum in every rank's buffer, each element summed in rank
 * order: the same bits in every rank. One barrier; x is the caller's again on return. */
void tdm_tp_allreduce(tdm_tp_group_t *g, int rank, float *x, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_TP_H */
