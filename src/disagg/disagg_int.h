/*
 * Private parts of the disaggregation module shared by decode.c and prefill.c.
 */
#ifndef TANDEM_DISAGG_INT_H
#define TANDEM_DISAGG_INT_H

#include <pthread.h>

#include "tandem/disagg.h"
#include "tandem/kv.h"
#include "tandem/sched.h"
#include "tandem/server.h"

struct tdm_disagg_decode;

/* ---- the messenger endpoint both sides open (endpoint.c) ---- */
/* A speculation head's KV: layer group 1 of the pool (one region of its own, its layers one
 * after another, pages laid out like group 0's), and the head's identity for the wire. */
struct disagg_head {
    bool on;
    struct tdm_disagg_head_req id; /* fingerprint and geometry (kv and stride: not set) */
    void *base;                    /* [n_layers][n_pages][2][n_kv_heads][page_size][head_dim] */
    size_t bytes, layer_bytes, page_bytes;
};
/* Host landing pages (decode side, host staging): pinned host memory registered with the
 * fabric, laid out like the pool with fewer pages ([n_layers][n_pages][page_bytes], then the
 * head's layers), into which a prefiller on another host writes a request's pages; once they
 * have all landed the copier scatters them into the pool's pages. A staged request lends one
 * landing page per pool page, from a free stack (under the decoder's mutex). */
struct disagg_landing {
    bool on;
    uint8_t *base;
    size_t bytes, layer_bytes, head_at, head_layer_bytes;
    int n_pages, n_free;
    int32_t *free_ids; /* [n_pages] stack of free landing pages */
    struct tdm_xfer_region reg;
    struct tdm_xfer_rmem rmem, head_rmem;
};
struct disagg_endpoint {
    tdm_xfer_t *x;                /* the control channel: peers, messages, counters */
    tdm_xfer_rails_t *rails;      /* several NICs: x is its rail 0, tp its transport; NULL: one */
    struct tdm_xfer_transport tp; /* the data plane: sends and the context's writes */
    /* The KV pages' data plane (the pool's and the head's): tp for a host pool, or a device
     * pool on a provider that registers GPU memory (FI_HMEM); CUDA IPC for a device pool
     * otherwise (ipc: that transport, owned), which reaches the decoders of this host. */
    struct tdm_xfer_transport kv_tp;
    tdm_xfer_ipc_t *ipc;
    struct tdm_xfer_region kv_reg, ctx_reg, head_reg; /* head_reg: with a head only */
    bool kv_direct; /* kv_reg is registered: pages cross without staging (some peers) */
    /* Host staging (tdm_disagg_xfer_opts.staging): the copier (the pool's GPU, or memcpy for a
     * host pool), and on a prefill node the staged writer, with the pool's (and head's) memory
     * as its source regions; on a decode node the landing pages. */
    enum tdm_disagg_staging staging;
    struct tdm_xfer_copier copier;
    tdm_xfer_staged_t *staged;
    struct tdm_xfer_transport stage_tp;
    struct tdm_xfer_region kv_sreg, head_sreg;
    struct disagg_landing land;
    struct tdm_xfer_caps caps;
    struct tdm_kv_geometry kv; /* the pool's place, element type and strides */
    struct disagg_head head;
    /* Tensor parallelism (sharded transfers, disagg.h): the engine's ranks, and each rank's
     * pool (rank_kv[0] is kv) registered with kv_tp (rank_reg[0] unused: kv_reg is rank 0's). */
    int n_ranks;
    struct tdm_kv_geometry rank_kv[TDM_DISAGG_MAX_RANKS];
    struct tdm_xfer_region rank_reg[TDM_DISAGG_MAX_RANKS];
};
/* Rank r's registered pool (r 0: kv_reg). */
static inline const struct tdm_xfer_region *tdm_disagg_rank_region(const struct disagg_endpoint *ep,
                                                                   int r)
{
    return r ? &ep->rank_reg[r] : &ep->kv_reg;
}
struct disagg_endpoint_opts {
    const struct tdm_disagg_xfer_opts *xfer;
    int max_ctx, page_size; /* control messages fit a PREFILL of max_ctx tokens */
    int min_jobs;           /* transfer operations to allow at once (0: the default) */
    tdm_kv_pool_t *kv;
    /* a sharded engine's pools, rank_kv[0] being kv (n_ranks 0 or 1: kv alone): every one is
     * registered; host pools without --kv-staging always only (TDM_EUNSUPPORTED) */
    tdm_kv_pool_t *const *rank_kv;
    int n_ranks;
    void *ctx_mem; /* host context buffers, registered too */
    size_t ctx_bytes;
    const struct tdm_model *head; /* a speculation head: its KV group is registered too */
    bool landing;                 /* a decode node: host staging lends landing pages */
    tdm_xfer_msg_fn on_msg;
    tdm_xfer_peer_fn on_peer;
    void *ctx; /* for both callbacks */
};
/* Creates the transfer engine and registers the KV pool (where the pool says it lives), the
 * context buffers and, with a head, the head's KV group (TDM_EINVAL when the pool lacks it).
 * On failure nothing is left open. */
tdm_status tdm_disagg_endpoint_open(struct disagg_endpoint *ep,
                                    const struct disagg_endpoint_opts *o);
/* Ends the data plane: a CUDA IPC transport waits for its writes in flight and runs their
 * callbacks (which may send over the engine, so it goes first; no lock they take may be held),
 * the staged writer completes its writes, the copier its copies (their callbacks run), then
 * the engine is destroyed (tdm_xfer_destroy: pending operations end with TDM_ECANCELED). */
void tdm_disagg_endpoint_stop(struct disagg_endpoint *ep);
/* Deregisters the regions and frees the landing pages and the copier; call after
 * tdm_disagg_endpoint_stop. */
void tdm_disagg_endpoint_release(struct disagg_endpoint *ep);
/* How this (prefill) side's KV pages reach a decoder's region of `kind`: the transport and
 * the pool's and head's regions on it, and in words for the log. Host destinations: by the
 * fabric from a host pool (or a GPU pool it registers), else staged (and always staged with
 * --kv-staging always); GPU destinations: by CUDA IPC, or the fabric where it registers GPU
 * memory. false: no transport pairs them. */
struct disagg_route {
    struct tdm_xfer_transport tp;
    const struct tdm_xfer_region *kv, *head;
    const char *how;
};
bool tdm_disagg_endpoint_kv_route(const struct disagg_endpoint *ep, uint32_t kind,
                                  struct disagg_route *out);
/* A head's identity and geometry in words, for messages: "0123456789abcdef (1 layer, 9 heads,
 * 3 kv heads of 64, d_ff 1536)". */
void tdm_disagg_head_describe(const struct tdm_disagg_head_req *h, char *buf, size_t cap);
/* Landing pages (decode side; the caller holds its mutex): n from the free stack into ids, all
 * or nothing; and back. */
bool tdm_disagg_landing_take(struct disagg_landing *l, int n, int32_t *ids);
void tdm_disagg_landing_give(struct disagg_landing *l, int n, const int32_t *ids);
/* The fabric's authentication and immediate counters, and host staging's ring and landing
 * pages, as Prometheus text. */
void tdm_disagg_endpoint_metrics(struct disagg_endpoint *ep, struct tdm_sbuf *b);

/* What a control-message send's completion needs to undo. */
struct send_ctx {
    struct tdm_disagg_decode *d;
    uint32_t slot, epoch;
};

/* A speculation head beside a sharded node: its KV does not cross (TDM_EUNSUPPORTED). */
static inline tdm_status tdm_disagg_refuse_tp_head(tdm_engine_t *e)
{
    return tdm_err_set(TDM_EUNSUPPORTED,
                       "disagg: --tp %d with a speculation head: the head is sharded like the "
                       "target, its KV split over the ranks' pools by its own KV heads, and "
                       "sharded transfers carry the target's layers only (disaggregate without "
                       "the head, or run the head's nodes at --tp 1)",
                       tdm_engine_tp_ranks(e));
}

#endif
