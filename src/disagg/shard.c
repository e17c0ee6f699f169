/*
 * Sharded KV transfers' arithmetic (include/tandem/disagg.h, "sharded KV transfers"): which
 * source rank sends which head slice to which destination rank, and where the slice lies in
 * each rank's HND page.
 *
 * Both sides compute the same plan from the request: the decoder to know how many immediates
 * to expect (which the draw never changes: every source set splits the heads alike), the
 * prefill node to post them. A plan is plain data, built on the caller's thread from values
 * that may come from a peer, so every count is checked before it is used.
 *
 * Why slices of whole heads: a page of one layer is [2][heads][page_size][head_dim], so the K
 * of a run of heads is contiguous in a page, and so is their V, v_offset further. Two ranks'
 * head ranges intersect in one run of heads (both ranges are contiguous), hence one or two
 * runs a page; a paged write takes one run across every page of a chunk.
 */
#include <string.h>

#include "tandem/disagg.h"

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

tdm_status tdm_disagg_shard_plan(int n_kv_heads, int src_ranks, int dst_ranks, uint64_t seed,
                                 struct tdm_disagg_shard_plan *out)
{
    struct tdm_tp_kv_shard s0, d0;
    tdm_status st;
    if (n_kv_heads < 1 || n_kv_heads > UINT16_MAX)
        return tdm_err_set(TDM_EINVAL, "disagg: %d KV heads", n_kv_heads);
    if ((st = tdm_tp_kv_shard_of(n_kv_heads, src_ranks, 0, &s0)) != TDM_OK)
        return tdm_err_set(st, "disagg: the prefill node's sharding (--tp %d over %d KV heads): %s",
                           src_ranks, n_kv_heads, tdm_err_msg());
    if ((st = tdm_tp_kv_shard_of(n_kv_heads, dst_ranks, 0, &d0)) != TDM_OK)
        return tdm_err_set(st, "disagg: the decode node's sharding (--tp %d over %d KV heads): %s",
                           dst_ranks, n_kv_heads, tdm_err_msg());
    struct tdm_disagg_shard_plan p = {.n_kv_heads = n_kv_heads,
                                      .src_ranks = src_ranks,
                                      .dst_ranks = dst_ranks,
                                      .src_sets = s0.n_replica_sets,
                                      .dst_sets = d0.n_replica_sets};
    for (int set = 0; set < p.dst_sets; set++)
        p.src_set_of[set] =
            (int)(splitmix64(seed ^ splitmix64((uint64_t)set + 1)) % (uint64_t)p.src_sets);
    for (int dr = 0; dr < dst_ranks; dr++) {
        struct tdm_tp_kv_shard dsh, ssh;
        (void)tdm_tp_kv_shard_of(n_kv_heads, dst_ranks, dr, &dsh); /* valid: checked above */
        const int set = p.src_set_of[dsh.replica_set];
        for (int m = 0; m < s0.set_size; m++) {
            const int sr = set * s0.set_size + m;
            (void)tdm_tp_kv_shard_of(n_kv_heads, src_ranks, sr, &ssh);
            int h0 = TDM_MAX(dsh.kv_head0, ssh.kv_head0);
            int h1 = TDM_MIN(dsh.kv_head0 + dsh.n_kv_heads, ssh.kv_head0 + ssh.n_kv_heads);
            if (h0 >= h1) continue;
            TDM_ASSERT(p.n_slices < TDM_DISAGG_MAX_SLICES); /* at most d + min(p, H) slices */
            bool whole = h1 - h0 == dsh.n_kv_heads && h1 - h0 == ssh.n_kv_heads;
            p.slices[p.n_slices++] =
                (struct tdm_disagg_slice){.src_rank = (uint16_t)sr,
                                          .dst_rank = (uint16_t)dr,
                                          .head0 = (uint16_t)h0,
                                          .n_heads = (uint16_t)(h1 - h0),
                                          .src_at = (uint16_t)(h0 - ssh.kv_head0),
                                          .dst_at = (uint16_t)(h0 - dsh.kv_head0),
                                          .src_heads = (uint16_t)ssh.n_kv_heads,
                                          .dst_heads = (uint16_t)dsh.n_kv_heads,
                                          .write0 = (uint16_t)p.writes,
                                          .whole = whole};
            p.writes += whole ? 1 : 2;
        }
    }
    *out = p;
    return TDM_OK;
}

int tdm_disagg_slice_runs(const struct tdm_disagg_slice *s, uint64_t head_bytes,
                          struct tdm_disagg_run out[2])
{
    const uint64_t k_bytes = (uint64_t)s->n_heads * head_bytes;
    out[0] = (struct tdm_disagg_run){.src_offset = (uint64_t)s->src_at * head_bytes,
                                     .dst_offset = (uint64_t)s->dst_at * head_bytes,
                                     .bytes = s->whole ? 2 * k_bytes : k_bytes};
    if (s->whole) return 1;
    out[1] = (struct tdm_disagg_run){
        .src_offset = out[0].src_offset + (uint64_t)s->src_heads * head_bytes,
        .dst_offset = out[0].dst_offset + (uint64_t)s->dst_heads * head_bytes,
        .bytes = k_bytes};
    return 2;
}

uint32_t tdm_disagg_chunk_writes(const struct tdm_disagg_shard_plan *plan, uint32_t n_layers,
                                 uint32_t head_layers)
{
    return n_layers * (uint32_t)plan->writes + head_layers;
}
