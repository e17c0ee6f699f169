/*
 * tandem disagg: disaggregated prefill and decode, the KV messenger on both sides (DESIGN.md
 * §1.1 and §4).
 *
 * Decode node (tdm_disagg_decode_*). It is the scheduler's KV connector: when a request with two
 * or more prompt tokens is admitted, its pages for the whole prompt are already reserved; the
 * messenger picks the live prefill peer with the fewest outstanding prefill tokens, takes a request
 * slot (slot, epoch), arms an immediate counter for the number of writes it expects, and sends the
 * prefill request. The request stays out of decode batches until the counter fires; there is
 * no completion message. Then the scheduler runs prompt[-1] as the first decode step: the
 * prefill node never samples.
 *
 * The request, in the scheduler's states (sched.h), and the decoder slot that carries its
 * attempt (enum slot_state in decode.c, whose table gives the function of each transition):
 *
 *   request:  WAITING --admit: pages reserved, PREFILL sent--> WAITING_REMOTE_KV
 *             WAITING_REMOTE_KV --all writes landed--> RUNNING (prompt[-1] first) --> FINISHED
 *             WAITING_REMOTE_KV --timeout | peer dead | NACK | send error--> WAITING: retried
 *                                  on another prefill peer, or prefilled locally
 *             WAITING_REMOTE_KV --NACK of the head (TDM_EUNSUPPORTED)--> WAITING: retried on
 *                                  the same peer without the head (not counted as an attempt)
 *   slot:     FREE --admit--> PENDING --landed--> FREE
 *                             PENDING --failed, or the request finished--> FENCED
 *                             FENCED --CANCEL_ACK | NACK | its process gone--> FREE
 *
 * Expected writes: the decoder fixes the prefill chunk C (a multiple of the page size) in the
 * request, so prompt[:-1] of n tokens runs as ceil(n / C) chunks; the prefiller writes each
 * layer's pages of each chunk as one paged write (immediate index chunk * S + layer, S the
 * layers streamed per chunk), then the context of the last prefilled position (index
 * n_chunks * S). Expected = n_chunks * S + 1. Chunks are page aligned, so no page is written
 * twice. Sharding (either side --tp, below: "sharded KV transfers"): the request carries both
 * schemes, and a chunk's layer takes the plan's writes (one per head slice, two where K and V
 * lie apart) instead of one, so expected = n_chunks * (n_layers * writes + head layers) + 1.
 * The decoder learns a peer's TP from its first request (the peer answers TDM_DMSG_SCHEME
 * when the request counted on another: asked again, not counted as an attempt).
 *
 * Prefix caching on both sides (--prefix-caching). A decoder whose request reuses a cached
 * prefix of c tokens (whole pages) asks only for the rest: the request says c, names the pages
 * of positions [c, n) only, and the chunks are counted from c (chunk k covers
 * [c + k C, c + (k + 1) C)), so expected = ceil((n - c) / C) * S + 1. The prefill node
 * reuses its own cache too: its request's spans end on the decoder's grid (chunk_phase =
 * c mod C), a span wholly before c is computed but not sent, and a chunk wholly inside its own
 * cached prefix (past c) is sent from the cached pages when the job first runs, all its layers
 * at once. A request that asks for the head's KV does not reuse the prefill node's cache (the
 * head needs the target's features of every position); the decoder's cached pages hold the
 * head's KV of their positions (the scheduler offers a page once the drafter's KV covers it).
 *
 * Speculation across disaggregation. A decoder that drafts with an mtp head (opts.head) asks
 * for the head's KV too (want_head, struct tdm_disagg_head_req: the head's fingerprint and
 * geometry, its KV region). The prefill node, holding the same head (its opts.head; another
 * one, or none, is refused with TDM_EUNSUPPORTED and a message naming both), runs it over
 * each chunk from the target's features and streams its layer as one more: S = n_layers + 1
 * (head layer h of a chunk at index chunk * S + n_layers + h), else S = n_layers. Of P
 * prefilled tokens the head's rows [0, P - 1) are made there (row p reads t(p+1)); the
 * context carries the feature of P - 1 (tdm_disagg_ctx_layout: hidden state, feature,
 * logits), which the decoder hands to the scheduler with the request
 * (tdm_req_remote_done_feed), so the request drafts at its first step. The feature is the one
 * the head reads (feature_width floats, in the request): the target's final-normed state, or
 * for an EAGLE-3 head the residual streams entering its target layers, fused (3 d_model),
 * from which the prefill node also made the head's KV. A refusing peer is
 * asked without the head from then on (until it has been down): those requests decode
 * without drafts, and prefill stays disaggregated.
 *
 * How pages cross (struct disagg_route in disagg_int.h). Host pools: libfabric RMA. GPU pools:
 * RMA straight from GPU memory where the provider registers it (FI_HMEM), else CUDA IPC to
 * nodes of the same host, else host staging: the prefill node copies a finished layer's pages
 * into a pinned, registered staging ring (a bounded ring: a full one pushes back on the
 * messenger) and writes them from there into host landing pages that the decoder lends in the
 * request; when every immediate has landed, the decoder copies them into its pool, and the
 * request runs. A decoder whose GPU pool the prefill node cannot open (another host) is told so
 * with a NACK of TDM_EUNREACHABLE, and asks that peer with landing pages from then on. The
 * immediates, counters, fencing and NACKs are the same whatever the route (--kv-staging).
 * A node with several NICs (--xfer-nics) opens a rail set (xfer.h: one endpoint per NIC, rail
 * 0 the control channel) and its transport spreads the KV writes round-robin over the rails;
 * the decoder's counter counts every rail's immediates, and a rail whose peer dies fences the
 * requests bound to that peer like the peer's death.
 *
 * Fencing: immediates name (slot, epoch); a slot's epoch changes every use (a random value),
 * so a late write of an abandoned attempt is never counted. The pages of an abandoned attempt are
 * held (IN_FLIGHT in the pool) until the prefiller acknowledges the cancel, or its connection
 * failed or its process is found gone (a peer dead by silence alone may be stopped, not dead: its
 * queued writes would land later); only then can they be reused.
 *
 * Peers (decode side). A prefill peer is up once its handshake is done (with --fabric-key, once
 * it proved the key), and down when the transfer engine declares it dead: nothing heard from it
 * (heartbeats included) for peer_timeout_ms, a completion error, or its goodbye. A down peer
 * gets no request; a thread of the decoder retries it with backoff (revive_ms, doubling to
 * 10 s): its @FILE is read again (a restarted node may listen elsewhere), then a fresh
 * handshake. A stalled peer that resumes, or a restarted one, is used again without
 * restarting the decoder:
 *
 *   up --(dead)--> down --(backoff passed: file re-read, hello)--> trying --(handshake)--> up
 *                   ^                                                 |
 *                   +-----------(no answer within peer_timeout_ms)----+
 *
 * Prefill node (tdm_disagg_prefill_*). A job (enum job_state in prefill.c, with its table):
 *   RECEIVED --submitted--> SCHEDULED (writes posted per layer and chunk, then the context)
 *            --its request finished--> DRAINING --last write completed--> freed
 *   RECEIVED --cancelled, failed, or refused by the scheduler--> DROPPED --> freed
 * Requests arrive as control messages and go through the normal scheduler as prefill-only,
 * fixed-chunk requests. A messenger thread watches the engine's layer counter (bumped after each
 * layer's attention output projection) during each step and posts that layer's page writes for
 * the step's chunks at once, while later layers still compute. Source pages are held until
 * their writes complete, then freed. A failure on the prefill side is reported with a NACK.
 *
 * Threading: connector calls run on the scheduler thread; xfer callbacks on the transfer engine's
 * progress thread; the prefill messenger has its own thread. Shared state is under one mutex per
 * side.
 */
#ifndef TANDEM_DISAGG_H
#define TANDEM_DISAGG_H

#include "tandem/core.h"
#include "tandem/engine.h"
#include "tandem/sched.h"
#include "tandem/tp.h"
#include "tandem/xfer.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_DISAGG_MAX_PEERS 16

/* Host staging (--kv-staging): how KV pages cross when the fabric cannot register the memory
 * they live in (a GPU pool between hosts, on a provider without FI_HMEM). AUTO: staged only
 * then; a decoder's GPU pool tries CUDA IPC first, and a prefill peer on another host answers
 * TDM_EUNREACHABLE, after which its pages come through this node's host landing pages. ALWAYS:
 * every page is staged, host pools included (host memory then stands in for device memory: how
 * CI runs the staged path, and a way to measure it). OFF: never; a peer that cannot be reached
 * otherwise is refused. */
enum tdm_disagg_staging {
    TDM_DISAGG_STAGING_AUTO = 0,
    TDM_DISAGG_STAGING_ALWAYS,
    TDM_DISAGG_STAGING_OFF,
};

struct tdm_disagg_xfer_opts {
    const char *provider; /* "tcp;ofi_rxm" (default), "shm", ... */
    enum tdm_disagg_staging staging;
    /* prefill node: its staging ring (0: 64 MiB); decode node: its landing pages (0: four full
     * contexts, at most the pool) */
    size_t staging_bytes;
    const char *node;       /* local address to bind; NULL: provider default */
    int peer_timeout_ms;    /* a silent peer is dead after this; 0: 2000 */
    const void *fabric_key; /* the cluster secret (16 to 256 bytes); NULL: none (SECURITY.md) */
    size_t fabric_key_bytes;
    bool busy_poll; /* the transfer engine's progress thread spins, never sleeps (a core each;
                     * latency-critical deployments) */
    /* Several NICs (--xfer-nics): with two or more, the node opens a rail set
     * (tdm_xfer_rails_*: one endpoint per NIC, each an address, an interface or a provider
     * domain; node is then unused) and spreads its KV writes round-robin over them. 0 or 1:
     * one endpoint on node, as before. */
    const char *nics[TDM_XFER_MAX_RAILS];
    int n_nics;
};

/* ---- decode side ---- */

struct tdm_disagg_decode_opts {
    struct tdm_disagg_xfer_opts xfer;
    const char *peers[TDM_DISAGG_MAX_PEERS]; /* prefill nodes' printable addresses */
    /* where peers[i] was read from (--prefill-peers @FILE), or NULL: a peer that is down is
     * retried with backoff, and its file read again first, so a prefill node restarted at a
     * new address is picked up without restarting this one */
    const char *peer_files[TDM_DISAGG_MAX_PEERS];
    int n_peers;
    /* Reads a peer's address from its source (peer_files[i]: a file, or whatever this reads,
     * e.g. a prefill node's HTTP address); false when it cannot now. NULL: sources are files
     * (tdm_disagg_read_addr_file). A peer whose address is "" could not be read at start: it
     * is read again, with backoff, until it can. Called on the reviver's thread. */
    bool (*read_peer)(void *ctx, const char *source, char *out, size_t cap);
    void *read_peer_ctx;
    int revive_ms;    /* first retry of a dead peer after this, doubling to 10 s; 0: 500 */
    int chunk;        /* prefill chunk in tokens (rounded up to pages); 0: 256 */
    int timeout_ms;   /* one attempt's deadline, send to KV landed; 0: 30000 */
    int max_attempts; /* remote attempts per request (each on another peer), then the
                       * request is prefilled on this node; 0: 2; -1: never remote */
    bool want_logits; /* ask for the last position's logits in the context */
    /* The mtp head this node drafts with (tdm_head_load; borrowed, outlives the decoder), or
     * NULL. With one, each prefill asks for the head's KV and the last prefilled position's
     * feature too, and the request drafts from its first step. A peer that refuses (no head,
     * or another one: it says which) is asked without the head from then on, until it comes
     * back from being down; those requests decode without drafts. */
    const struct tdm_model *head;
    /* A request naming its prefill node (tdm_req_kv_peer: HOST:PORT, its HTTP address, as
     * llm-d's P/D sidecar does in x-prefiller-host-port) is sent there when that peer is one of
     * this decoder's (its source http://HOST:PORT) and up; otherwise the usual choice. With
     * add_named_peers, a name that is no peer yet becomes one (asked for its fabric address
     * and connected in the background, while this request goes the usual way), up to
     * TDM_DISAGG_MAX_PEERS in all (kept until the decoder stops: for a trusted sidecar, not
     * for headers from the open internet); without, the name is only a preference among the
     * configured peers (a header may not make this node connect anywhere). Names compare
     * without case. */
    bool add_named_peers;
};
typedef struct tdm_disagg_decode tdm_disagg_decode_t;
/* Creates the transfer engine, registers the KV pool and the context buffers, connects the
 * peers and installs the decode side's KV connector on the scheduler (call before
 * tdm_sched_start). */
tdm_status tdm_disagg_decode_create(const struct tdm_disagg_decode_opts *o, tdm_engine_t *e,
                                    tdm_sched_t *s, tdm_disagg_decode_t **out);
void tdm_disagg_decode_destroy(tdm_disagg_decode_t *d);
/* The address in an address file (--xfer-addr-file, a decoder's --prefill-peers @FILE): its
 * first line up to the first blank; false when it cannot be read or is empty. The decoder
 * reads its peers' files again when a peer is down, so a node restarted elsewhere is found. */
bool tdm_disagg_read_addr_file(const char *path, char *out, size_t cap);
/* This node's printable fabric address (its prefill peers reach it here). */
tdm_status tdm_disagg_decode_addr(const tdm_disagg_decode_t *d, char *buf, size_t cap);
/* Prometheus text for the decode side (appended to /metrics); malloc'd. */
char *tdm_disagg_decode_metrics(void *d);

/* ---- prefill side ---- */
struct tdm_disagg_prefill_opts {
    struct tdm_disagg_xfer_opts xfer;
    int max_jobs; /* prefill requests accepted at once; 0: 256 */
    /* The mtp head its decoders draft with (tdm_head_load; borrowed, outlives the prefill
     * side; the engine's pool has its layer group), or NULL: requests for a head's KV are
     * refused. With one, it runs the head over each prefilled span of a request that asks,
     * and streams the head's KV layer like the target's. */
    const struct tdm_model *head;
};
typedef struct tdm_disagg_prefill tdm_disagg_prefill_t;
/* The engine must count layers (tdm_engine_opts.count_layers): the messenger watches its
 * counter. Installs the prefill side's KV connector on the scheduler. */
tdm_status tdm_disagg_prefill_create(const struct tdm_disagg_prefill_opts *o, tdm_engine_t *e,
                                     tdm_sched_t *s, tdm_disagg_prefill_t **out);
void tdm_disagg_prefill_destroy(tdm_disagg_prefill_t *p);
/* This node's printable fabric address, for decoders' --prefill-peers. */
tdm_status tdm_disagg_prefill_addr(const tdm_disagg_prefill_t *p, char *buf, size_t cap);
char *tdm_disagg_prefill_metrics(void *p);

/* ---- control messages (wire.c; exposed for the fuzz target and tests) ---- */
enum tdm_disagg_msg_type {
    TDM_DMSG_PREFILL = 1,    /* decoder -> prefiller */
    TDM_DMSG_NACK = 2,       /* prefiller -> decoder: refused or failed; nothing more lands */
    TDM_DMSG_CANCEL = 3,     /* decoder -> prefiller: abandon (slot, epoch) */
    TDM_DMSG_CANCEL_ACK = 4, /* prefiller -> decoder: nothing more lands for (slot, epoch) */
    /* prefiller -> decoder: the request named another prefill sharding than this node's; it
     * says its own (ranks, KV heads) and nothing lands: ask again. Sent only to decoders whose
     * request carried the SHARDED block (older ones get a NACK). */
    TDM_DMSG_SCHEME = 5,
};
#define TDM_DMSG_MAX_ERROR 200

/* A prefill request's speculation head (want_head): the decoder drafts with an mtp head and
 * asks for its KV of the prefilled span as one more layer (group 1 of its pool, the same page
 * ids). fingerprint and geometry name the decoder's head (tdm_spec_head_fingerprint); the
 * prefill node refuses a request for another head, or when it has none (NACK with
 * TDM_EUNSUPPORTED, the message naming both sides). */
struct tdm_disagg_head_req {
    uint64_t fingerprint;
    uint32_t n_layers, n_heads, n_kv_heads, head_dim, d_ff; /* the head's layers and geometry */
    /* floats of the target feature the head reads, which the context carries: d_model (the
     * final-normed state), or an EAGLE-3 head's fused n * d_model (1 <= n <=
     * TDM_DISAGG_HEAD_MAX_FEATURES; the wire writes 0 for d_model) */
    uint32_t feature_width;
    uint64_t dst_layer_stride; /* bytes between its KV layers */
    struct tdm_xfer_rmem kv;   /* the decoder's head KV region */
};
#define TDM_DISAGG_HEAD_MAX_LAYERS   16 /* a head has one layer; a bound for peers' values */
#define TDM_DISAGG_HEAD_MAX_FEATURES TDM_HEAD_MAX_AUX /* target layers a fused feature holds */

/* A destination rank's KV pool in a sharded request: where its layers are. */
struct tdm_disagg_rank_dst {
    uint64_t dst_layer_stride; /* bytes between layers in this rank's pool */
    struct tdm_xfer_rmem kv;   /* this rank's pool region (its KV heads only) */
};
#define TDM_DISAGG_MAX_RANKS TDM_TP_MAX_RANKS

struct tdm_disagg_prefill_msg {
    uint64_t req_id;
    uint32_t slot, epoch;
    uint32_t n_tokens, chunk;
    uint32_t n_layers, n_kv_heads, head_dim, page_size, elem_bytes;
    uint32_t kv_dtype; /* enum tdm_dtype: f32, bf16 or f16 (elem_bytes its size) */
    uint32_t kv_head_begin, kv_head_end; /* the decoder's head range */
    uint64_t dst_layer_stride;           /* bytes between layers in the decoder's pool */
    struct tdm_xfer_rmem kv, ctx;
    uint64_t ctx_offset; /* this slot's context buffer in ctx */
    uint32_t d_model, vocab;
    uint8_t want_logits;
    uint8_t want_head; /* 1: head below is set, the head's KV and feature are asked for */
    struct tdm_disagg_head_req head;
    /* the decoder holds the KV of tokens [0, cached_tokens) (a multiple of page_size, less
     * than n_tokens; 0: none): pages name the pages of positions from there on, and chunks
     * are counted from there */
    uint32_t cached_tokens;
    /* Sharding (DESIGN.md §5; the SHARDED block, sent by every decoder that knows sharded
     * transfers; sharded 0: an older decoder, both sides TP = 1). dst_ranks (d) and src_ranks
     * (p: the prefill node's TP as the decoder believes it; a node of another TP answers
     * TDM_DMSG_SCHEME) over n_kv_heads (H) KV heads, with their replica sets
     * (tdm_tp_kv_shard_of: checked); shard_seed draws each destination replica set's source
     * set (tdm_disagg_shard_plan). ranks[r] is destination rank r's pool, [0] being
     * dst_layer_stride and kv above (decode fills it in; encode reads ranks 1 .. d - 1). */
    uint8_t sharded;
    uint32_t dst_ranks, src_ranks, dst_sets, src_sets;
    uint64_t shard_seed;
    struct tdm_disagg_rank_dst ranks[TDM_DISAGG_MAX_RANKS];
    uint32_t n_pages;
    const int32_t *tokens; /* [n_tokens], pointing into the message (decode) */
    const uint32_t *pages; /* [n_pages] */
};
struct tdm_disagg_msg {
    enum tdm_disagg_msg_type type;
    struct tdm_disagg_prefill_msg prefill;  /* PREFILL */
    uint32_t slot, epoch;                   /* NACK, CANCEL, CANCEL_ACK, SCHEME */
    int32_t status;                         /* NACK */
    char error[TDM_DMSG_MAX_ERROR + 1];     /* NACK */
    uint32_t scheme_ranks, scheme_kv_heads; /* SCHEME: the prefill node's TP and KV heads */
};
/* Bytes a PREFILL message with these counts takes (with the head block when head, the cached
 * block when cached, the sharded block of dst_ranks destination ranks when dst_ranks > 0). */
size_t tdm_disagg_prefill_msg_size(uint32_t n_tokens, uint32_t n_pages, bool head, bool cached,
                                   uint32_t dst_ranks);
/* Encodes into buf (cap bytes); returns the size, 0 if it does not fit. */
size_t tdm_disagg_msg_encode(const struct tdm_disagg_msg *m, uint8_t *buf, size_t cap);
/* Decodes and validates; PREFILL's tokens and pages point into `buf` (aligned copies are the
 * caller's business: they are read with memcpy). TDM_EFORMAT with a message on bad bytes. */
tdm_status tdm_disagg_msg_decode(const uint8_t *buf, size_t len, struct tdm_disagg_msg *out,
                                 int32_t *tokens_out, uint32_t tokens_cap, uint32_t *pages_out,
                                 uint32_t pages_cap);
/* The number of immediates a decoder expects for n prefilled tokens of which the first
 * `cached` are its own: n_chunks * n_layers + 1, n_chunks = ceil((n_tokens - cached) / chunk),
 * where n_layers is the writes of one chunk (tdm_disagg_chunk_writes: the target's layers
 * times the sharding plan's writes per layer, plus the head's layers when the request asks for
 * the head's KV). */
uint32_t tdm_disagg_expected_writes(uint32_t n_tokens, uint32_t cached, uint32_t chunk,
                                    uint32_t n_layers);
/* ---- sharded KV transfers (shard.c; DESIGN.md §5) ----
 * A prefill node of p ranks and a decode node of d ranks over H KV heads, each side's ranks
 * holding KV heads as tdm_tp_kv_shard_of places them (replica sets of S = min(TP, H) ranks when
 * TP > H). Each destination replica set draws one source replica set (uniformly, from the
 * request's seed: every set of the prefill node takes its share of sending); then for every
 * destination rank and every rank of its source set whose head ranges intersect, the
 * intersection [head0, head0 + n_heads) is one slice: in a page (HND: K [heads][tokens][dim],
 * then V) it is one contiguous run of K and one of V, so one paged write when the slice is
 * every head of both ranks' pages (K and V adjacent on both sides), else two (K, then V). The
 * prefill side then rebuilds nothing: a destination page whose heads come from several source
 * ranks is assembled by their writes, and a source rank may feed several destinations. H = 1
 * (MLA, any fully replicated KV) is the case of sets of one rank: a random source rank per
 * destination rank and request. The number of writes does not depend on the draw, so a
 * decoder knows it from (H, p, d) alone.
 *
 * Immediates of a chunk (S' = n_layers * writes + head layers): target layer l's writes are
 * chunk * S' + l * writes + w, w the slice's first write (its V the next); head layer h's one
 * write is chunk * S' + n_layers * writes + h (the head's KV is whole on both leaders). */
#define TDM_DISAGG_MAX_SLICES (2 * TDM_DISAGG_MAX_RANKS)
struct tdm_disagg_slice {
    uint16_t src_rank, dst_rank;
    uint16_t head0, n_heads; /* KV heads [head0, head0 + n_heads) of the model */
    uint16_t src_at, dst_at; /* head0 less each rank's first KV head: the slice's place in it */
    uint16_t src_heads, dst_heads; /* the KV heads each rank's pages hold */
    uint16_t write0;               /* its first write's number within a layer */
    uint8_t whole;                 /* 1: every head of both pages, K and V in one write */
};
struct tdm_disagg_shard_plan {
    int n_kv_heads, src_ranks, dst_ranks, src_sets, dst_sets;
    int src_set_of[TDM_DISAGG_MAX_RANKS]; /* [dst_sets] the source set each destination set drew */
    int n_slices;
    struct tdm_disagg_slice slices[TDM_DISAGG_MAX_SLICES];
    int writes; /* paged writes a layer of a chunk takes (1 or 2 a slice) */
};
/* The plan for H KV heads from p source ranks to d destination ranks under seed. TDM_EINVAL or
 * TDM_EUNSUPPORTED (with a message naming the combination) when either side's TP does not
 * shard H (tdm_tp_kv_shard_of), or a count is out of range (values may come from a peer). */
tdm_status tdm_disagg_shard_plan(int n_kv_heads, int src_ranks, int dst_ranks, uint64_t seed,
                                 struct tdm_disagg_shard_plan *out);
/* A slice's runs in one page: K (and V) as (offset in the source rank's page, offset in the
 * destination rank's page, bytes), head_bytes being one KV head's K in a page (page_size *
 * head_dim elements). Returns 1 (whole: K and V together) or 2. */
struct tdm_disagg_run {
    uint64_t src_offset, dst_offset, bytes;
};
int tdm_disagg_slice_runs(const struct tdm_disagg_slice *s, uint64_t head_bytes,
                          struct tdm_disagg_run out[2]);
/* The writes of one chunk: n_layers * plan->writes + head_layers. */
uint32_t tdm_disagg_chunk_writes(const struct tdm_disagg_shard_plan *plan, uint32_t n_layers,
                                 uint32_t head_layers);

/* Where the context of a request lies in a context buffer, in floats: the hidden state
 * (d_model: the residual after the last layer), then with a head the feature (feature_width
 * floats, the head's: d_model for the final-normed state, an EAGLE-3 head's fused n d_model;
 * 0: no head, no feature), then with want_logits the logits (vocab). Returns the context's
 * floats. */
size_t tdm_disagg_ctx_layout(uint32_t d_model, uint32_t feature_width, uint32_t vocab,
                             bool want_logits, size_t *feature_at, size_t *logits_at);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_DISAGG_H */
