/*
 * tandem xfer: the transfer engine under disaggregated prefill/decode (DESIGN.md §1.1, §4).
 *
 * What it moves. A decoder registers its KV pool and context buffers (tdm_xfer_mr_reg) and hands
 * their remote descriptors (struct tdm_xfer_rmem, packed into a control message) to a prefiller.
 * The prefiller posts paged writes into them, one per layer and chunk, each naming a request slot
 * and epoch in its immediate data. The decoder never receives a completion message: it arms an
 * immediate counter "when N immediates for slot S, epoch E have landed, call back", and the
 * request is ready when the callback fires.
 *
 * Transports.
 *   - libfabric RDM endpoints (FI_MSG | FI_RMA, FI_REMOTE_CQ_DATA), provider chosen by a
 *     configuration string: "tcp;ofi_rxm" and "shm" here, "verbs;ofi_rxm" and "efa" on clusters.
 *     FI_MR_LOCAL / VIRT_ADDR / PROV_KEY / ALLOCATED / ENDPOINT are honoured, so the same code runs
 *     on every provider.
 *   - CUDA IPC inside a node (tdm_xfer_cuda_*, and as a transport: tdm_xfer_ipc_*): device
 *     memory exported with an IPC handle, opened by the peer, and one gather/scatter kernel per
 *     paged write. Its immediates reach the same counters (over the control engine).
 *   - host staging (tdm_xfer_staged_*): GPU pages between hosts go through a registered pinned
 *     host ring (a copier's gather kernel, then an RMA write from the ring), because Debian's
 *     libfabric has no FI_HMEM. A region has a kind (host | cuda) and tdm_xfer_caps says whether
 *     the provider takes cuda regions directly (hmem_cuda), so a GPUDirect provider drops the
 *     staging without an API change.
 *   - rails (tdm_xfer_rails_*): several NICs per node, one engine per NIC, rail 0 the control
 *     engine whose counters the others feed; writes spread round-robin over the rails.
 *
 * Immediate data and the "one paged write = one immediate" rule. A paged write is merged into as
 * few fabric writes as possible (contiguous runs); only the LAST of them carries the immediate.
 * On a provider that orders write data (FI_ORDER_WAW, unbounded, asked for: tcp;ofi_rxm, shm) it
 * is posted right behind the others; on one with FI_FENCE it is a fenced write; elsewhere the
 * others are delivery-complete writes and the immediate is posted once they have completed. Either
 * way an immediate means "every byte of this paged write is in place", on every provider. The
 * receiver therefore expects one immediate per paged write (or single write), whatever the merging
 * did. An immediate names (slot, epoch, index): index is the write's number inside the request
 * (0..N-1). Counters keep a bitmap of indices, so a duplicated immediate is counted once
 * (immediates are idempotent), an immediate whose epoch does not match the armed one is ignored and
 * counted as stale, and an index
 * >= N is counted as invalid. Layout: 32-bit cq data = slot:12 epoch:8 index:12; 64-bit (when the
 * provider carries 8 bytes) = slot:24 epoch:16 index:24.
 *
 * Threading. Each engine owns one progress thread, the only reader of the CQ (manual progress
 * for tcp;ofi_rxm is kept moving on both sides by it). Public functions are thread-safe. A
 * write is posted by the thread that submits it where the provider's domain is thread-safe
 * (FI_THREAD_SAFE), without an allocation and without waking anyone; what the provider pushes
 * back, sends, and everything on other domains, the progress thread posts. The pools are
 * bounded (TDM_EAGAIN when full, counted in writes_refused). Callbacks (done, counter, message,
 * peer) run on the progress thread, or on the caller's thread for tdm_xfer_counters_cancel;
 * never inside the submitting call. They must not block, but may post, arm and cancel.
 *
 * Failure semantics (nothing hangs). Every operation has a deadline (timeout_ms, or the engine's
 * op_timeout_ms). A posted operation's done callback fires exactly once: TDM_OK, TDM_ETIMEDOUT,
 * TDM_EPEER (the peer died or a completion error reported it), TDM_EIO (injected write failure)
 * or TDM_ECANCELED (engine destroyed). Provider completion errors are logged with
 * fi_cq_strerror's text and kept as the thread's error message for the callback. A peer is dead
 * when an operation to it fails with a completion error or when nothing (heartbeats included) has
 * come from it for peer_timeout_ms; its queued and pending operations and the counters armed for
 * it then complete with TDM_EPEER. -FI_EAGAIN from the provider is retried after progress; the
 * engine's queues are bounded (max_jobs, max_ops).
 *
 * Authentication (fabric_key set): a peer is known only once it has answered our hello's random
 * challenge with HMAC-SHA256(key, label | challenge | both nonces); until then its messages and
 * immediates are dropped (unauth_dropped), and it never reaches on_peer. Counters armed for a
 * peer take immediate messages (tdm_xfer_send_imm) from that peer only; an RMA write's
 * immediate names no writer, and is fenced by the region's key instead: keys are random where
 * the provider lets us choose them, and only proven peers are given descriptors.
 *
 * Fault injection ("drop_imm=0.1,delay_imm_ms=50,dup_imm=0.1,reorder_imm=0.5,fail_write=0.05,
 * seed=7", or $TANDEM_XFER_FAULTS) acts on the receiver's delivery of immediates and on the
 * sender's writes; see docs/xfer.md for the counter semantics under each.
 */
#ifndef TANDEM_XFER_H
#define TANDEM_XFER_H

#include <pthread.h>

#include "tandem/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_xfer tdm_xfer_t;
typedef struct tdm_xfer_mr tdm_xfer_mr_t;
typedef struct tdm_xfer_counters tdm_xfer_counters_t;

#define TDM_XFER_ADDR_MAX  1024       /* printable address, NUL included */
#define TDM_XFER_ANY_PEER  UINT32_MAX /* a counter not bound to one peer */
#define TDM_XFER_RMEM_WIRE 96         /* bytes of a packed struct tdm_xfer_rmem */
#define TDM_XFER_MAX_RAILS 8          /* fabric endpoints (NICs) of one rail set */

enum tdm_xfer_mem_kind { TDM_XFER_MEM_HOST = 0, TDM_XFER_MEM_CUDA = 1 };

/* An operation's end: called exactly once per operation that was accepted (TDM_OK returned). */
typedef void (*tdm_xfer_done_fn)(void *ctx, tdm_status st);
/* A control message from `peer`; `data` is valid only during the call. */
typedef void (*tdm_xfer_msg_fn)(void *ctx, uint32_t peer, const void *data, size_t bytes);
/* A peer became known (up = true, after its hello) or was declared dead (up = false). */
typedef void (*tdm_xfer_peer_fn)(void *ctx, uint32_t peer, bool up);
/* An immediate counter ended: TDM_OK when N distinct immediates landed, else the error. */
typedef void (*tdm_xfer_counter_fn)(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st);

struct tdm_xfer_config {
    const char *provider;    /* "tcp;ofi_rxm" (default), "shm", "verbs;ofi_rxm", "efa" */
    const char *node;        /* local address to bind, e.g. "127.0.0.1"; NULL: provider default */
    int op_timeout_ms;       /* deadline of an operation given timeout_ms = 0; default 10000 */
    int heartbeat_ms;        /* liveness ping period per peer; default 200; 0 disables */
    int peer_timeout_ms;     /* a silent peer is dead after this; default 2000 */
    int max_jobs;            /* operations queued or in flight; default 1024 */
    int max_ops;             /* fabric operations in flight, at least; default 256 (raised to
                                fit the window and the provider's tx queue) */
    int window_writes;       /* paged writes meant to be in flight together; default 16 */
    int window_pages;        /* pages in each of them; default 64 (the op pool and the run ring
                                are sized for window_writes x window_pages) */
    bool busy_poll;          /* the progress thread spins, never sleeps (latency-critical
                                deployments; a core per engine); default false */
    int ctrl_bytes;          /* largest control message payload; default 8192 */
    int ctrl_rx_depth;       /* preposted receive buffers; default 64 */
    int max_peers;           /* default 64 */
    int max_slots;           /* counter slots, capped by the immediate layout; default 4096 */
    int max_pages_per_write; /* default 65536 */
    const char *faults;      /* fault-injection spec; NULL: $TANDEM_XFER_FAULTS; "" none */
    /* The cluster secret (16 to 256 bytes, copied): peers prove they hold it before any of
     * their messages or immediates is taken (docs/SECURITY.md). NULL: no authentication. */
    const void *fabric_key;
    size_t fabric_key_bytes;
    tdm_xfer_msg_fn on_msg;
    void *on_msg_ctx;
    tdm_xfer_peer_fn on_peer;
    void *on_peer_ctx;
    /* Where immediates land: another engine's table (borrowed, outlives this engine; a rail of
     * a rail set, below), or NULL: the engine's own. An engine with borrowed counters never
     * fails them by its own peer indices (their owner maps a death to its peers), never
     * destroys them, and takes immediates by RMA only (an IMM message to it is dropped). */
    tdm_xfer_counters_t *counters;
    /* The provider's domain to open (a prefix of fi_info's domain name: "eth0", "mlx5_0"), or
     * NULL: the first the provider offers for `node`. */
    const char *domain;
};
void tdm_xfer_config_default(struct tdm_xfer_config *cfg);

struct tdm_xfer_caps {
    char provider[64];                       /* the provider actually opened */
    int imm_bits;                            /* 32 or 64 */
    uint32_t max_slot, max_epoch, max_index; /* largest values the immediate layout carries */
    bool hmem_cuda;         /* cuda regions can be registered directly (no staging) */
    bool delivery_complete; /* writes complete only once visible at the target */
    bool ordered_writes;    /* write data lands in posting order: no wait before the immediate */
    uint64_t mr_mode;       /* FI_MR_* bits in force */
    size_t max_write_bytes; /* a merged run never exceeds this */
    bool cq_wait; /* an idle progress thread sleeps on the CQ's descriptor (FI_WAIT_FD) and an
                     eventfd, rather than polling: tcp;ofi_rxm; not busy_poll */
};

struct tdm_xfer_stats {
    uint64_t writes_posted, write_bytes, sends_posted, msgs_received, imm_received;
    uint64_t eagain_retries, ops_timed_out, cq_errors, injected_failures, heartbeats_sent;
    uint64_t peers_recycled; /* dead entries reused for new addresses (a full peer table) */
    uint64_t imm_dropped, imm_delayed, imm_duplicated, imm_reordered; /* fault injection */
    uint64_t auth_ok, auth_failed; /* peers that proved the fabric key, and bad proofs */
    uint64_t unauth_dropped;       /* messages and immediates from peers not (yet) proven */
    uint64_t writes_refused;       /* writes answered TDM_EAGAIN (jobs or run ring full) */
    uint64_t caller_posts;         /* writes posted (at least in part) by their submitting thread */
    uint64_t progress_sleeps; /* times the idle progress thread blocked on the CQ (caps.cq_wait) */
    uint64_t progress_wakes;  /* of those, ended early by a submission's eventfd write */
};

/* ---- engine ---- */
/* Opens the endpoint and starts the progress thread. `cfg` strings are copied. */
tdm_status tdm_xfer_create(const struct tdm_xfer_config *cfg, tdm_xfer_t **out);
/* Stops the thread, completes every pending operation with TDM_ECANCELED, fires every armed
 * counter with TDM_ECANCELED, closes the endpoint. Registered regions must be deregistered
 * first. NULL is a no-op. */
void tdm_xfer_destroy(tdm_xfer_t *x);
/* This engine's printable address ("x1:" + hex of fi_getname), for out-of-band exchange. */
tdm_status tdm_xfer_addr(const tdm_xfer_t *x, char *buf, size_t cap);
void tdm_xfer_get_caps(const tdm_xfer_t *x, struct tdm_xfer_caps *out);
void tdm_xfer_get_stats(tdm_xfer_t *x, struct tdm_xfer_stats *out);
/* The engine's immediate counters (owned by the engine). */
tdm_xfer_counters_t *tdm_xfer_get_counters(tdm_xfer_t *x);

/* ---- peers ---- */
/* Inserts the peer's address into the address vector and sends it a hello carrying ours, so it
 * learns us too. *peer is this engine's index for it. Adding the same address twice returns the
 * same index. */
tdm_status tdm_xfer_peer_add(tdm_xfer_t *x, const char *addr, uint32_t *peer);
bool tdm_xfer_peer_alive(tdm_xfer_t *x, uint32_t peer);
/* The peer is dead and its connection is known to be gone (a completion error, or its goodbye),
 * so nothing it posted earlier can still land. A peer dead by silence alone (a stopped process,
 * whose kernel still holds the connection) is not gone: its queued writes land when it runs
 * again. */
bool tdm_xfer_peer_gone(tdm_xfer_t *x, uint32_t peer);
/* For a dead peer that is not known to be gone: asks its host whether anything still listens at
 * its address (a TCP connect, within timeout_ms, for socket-addressed providers such as
 * tcp;ofi_rxm, which report nothing when a peer's process dies). Refused: the process is gone
 * (tdm_xfer_peer_gone becomes true) and TDM_OK; something answers, or no answer: TDM_EAGAIN;
 * an address that is not a socket address: TDM_EUNSUPPORTED. Blocks up to timeout_ms. */
tdm_status tdm_xfer_peer_probe(tdm_xfer_t *x, uint32_t peer, int timeout_ms);
/* Waits up to timeout_ms for the peer's hello or heartbeat (a round trip has happened). */
tdm_status tdm_xfer_peer_wait(tdm_xfer_t *x, uint32_t peer, int timeout_ms);

/* ---- memory ---- */
/* Registers [base, base + bytes) for local use and remote writes. The caller keeps owning the
 * memory and must keep it alive until tdm_xfer_mr_dereg. TDM_EUNSUPPORTED for kind CUDA when the
 * provider lacks FI_HMEM (caps.hmem_cuda false): stage through a host region instead. */
tdm_status tdm_xfer_mr_reg(tdm_xfer_t *x, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                           tdm_xfer_mr_t **out);
void tdm_xfer_mr_dereg(tdm_xfer_mr_t *mr); /* NULL is a no-op */

/* What a peer needs to write into a region: offsets are added to `addr`. */
struct tdm_xfer_rmem {
    uint64_t addr;          /* remote base: the virtual address under FI_MR_VIRT_ADDR, else 0 */
    uint64_t key;           /* the provider's or our requested key */
    uint64_t bytes;         /* region length */
    uint32_t kind;          /* enum tdm_xfer_mem_kind */
    uint8_t ipc_handle[64]; /* cudaIpcMemHandle_t for CUDA IPC regions; zero otherwise */
    /* A host region registered on a rail set (tdm_xfer_rails_*): rails > 1 endpoints, rail r's
     * key in rail_key[r] ([0] = key); the same addr on every rail. 0 or 1: one endpoint. On the
     * wire the keys of rails 1 .. rails-1 take the (then unused) IPC handle's room and the
     * reserved word says how many, so a region of one rail packs as before. */
    uint32_t rails;
    uint64_t rail_key[TDM_XFER_MAX_RAILS];
};
void tdm_xfer_mr_remote(const tdm_xfer_mr_t *mr, struct tdm_xfer_rmem *out);
/* Fixed little-endian wire form for control messages; unpack validates. */
void tdm_xfer_rmem_pack(const struct tdm_xfer_rmem *r, uint8_t out[TDM_XFER_RMEM_WIRE]);
tdm_status tdm_xfer_rmem_unpack(const uint8_t *in, size_t bytes, struct tdm_xfer_rmem *out);

/* ---- immediates ---- */
struct tdm_xfer_imm {
    uint32_t slot;  /* the receiver's counter slot (request slot) */
    uint32_t epoch; /* the slot's incarnation: late writes of an abandoned transfer mismatch */
    uint32_t index; /* this write's number within the request, 0..expected-1 */
};
/* Packs for `imm_bits` (32 or 64); TDM_ERANGE when a field does not fit. */
tdm_status tdm_xfer_imm_encode(int imm_bits, const struct tdm_xfer_imm *imm, uint64_t *out);
void tdm_xfer_imm_decode(int imm_bits, uint64_t data, struct tdm_xfer_imm *out);

/* ---- writes ----
 * Page i of the write copies page_bytes from src_offset + src_pages[i] * src_stride of the local
 * region to dst_offset + dst_pages[i] * dst_stride of the remote region. Pages contiguous on both
 * sides are merged into one fabric write. The arrays are read before the call returns. */
struct tdm_xfer_pages {
    const uint32_t *src_pages;
    const uint32_t *dst_pages;
    uint32_t n_pages;
    uint64_t page_bytes;
    uint64_t src_stride, dst_stride; /* bytes between consecutive page ids */
    uint64_t src_offset, dst_offset; /* e.g. a layer's base and a head slice's offset */
};
/* Posts a paged write to `peer`. `imm` NULL: no immediate. timeout_ms 0: the engine default.
 * Returns an error (and never calls done) on bad arguments or out-of-bounds pages, TDM_EAGAIN
 * when the queue is full, TDM_EPEER when the peer is dead; otherwise done fires exactly once. */
tdm_status tdm_xfer_write_pages(tdm_xfer_t *x, uint32_t peer, tdm_xfer_mr_t *src,
                                const struct tdm_xfer_rmem *dst, const struct tdm_xfer_pages *pages,
                                const struct tdm_xfer_imm *imm, int timeout_ms,
                                tdm_xfer_done_fn done, void *ctx);
/* One contiguous write; same rules. */
tdm_status tdm_xfer_write(tdm_xfer_t *x, uint32_t peer, tdm_xfer_mr_t *src, uint64_t src_offset,
                          const struct tdm_xfer_rmem *dst, uint64_t dst_offset, uint64_t bytes,
                          const struct tdm_xfer_imm *imm, int timeout_ms, tdm_xfer_done_fn done,
                          void *ctx);
/* Sends a control message (copied; at most ctrl_bytes). Same completion rules. */
tdm_status tdm_xfer_send(tdm_xfer_t *x, uint32_t peer, const void *msg, size_t bytes,
                         int timeout_ms, tdm_xfer_done_fn done, void *ctx);

/* Sends one immediate to `peer` as a small message; the peer counts it exactly like the
 * immediate of a fabric write (fault injection included). This is how a CUDA IPC writer tells
 * the destination's owner that a paged write has landed. Same completion rules as a send. */
tdm_status tdm_xfer_send_imm(tdm_xfer_t *x, uint32_t peer, const struct tdm_xfer_imm *imm,
                             int timeout_ms, tdm_xfer_done_fn done, void *ctx);

/* ---- transports: the data plane behind one ops table ----
 * What moves KV (register memory, paged write, single write, send, immediate, poll,
 * capabilities) is a transport. The libfabric engine is one (tdm_xfer_fabric_transport); CUDA
 * IPC inside a node and host staging (GPU pages bounced through registered pinned buffers) plug
 * in beside it, and a caller that moves pages through the table (disagg) needs no change for
 * them. Whatever the transport, its immediates end in the receiver's counter table (an RMA
 * write's immediate data, or an IMM message on the control channel: tdm_xfer_send_imm), so the
 * decoder counts them one way. Peers, control-channel liveness and the counters stay with the
 * engine (tdm_xfer_t). A region belongs to the transport that registered it. */
struct tdm_xfer_region {
    void *base;
    size_t bytes;
    enum tdm_xfer_mem_kind kind;
    void *impl; /* the transport's own (libfabric: a tdm_xfer_mr_t) */
};
struct tdm_xfer_transport_i {
    const char *name;
    tdm_status (*mr_reg)(void *t, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                         struct tdm_xfer_region *out);
    void (*mr_dereg)(void *t, struct tdm_xfer_region *r); /* a zeroed region is a no-op */
    void (*mr_remote)(void *t, const struct tdm_xfer_region *r, struct tdm_xfer_rmem *out);
    /* as tdm_xfer_write_pages, tdm_xfer_write, tdm_xfer_send and tdm_xfer_send_imm */
    tdm_status (*write_pages)(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                              const struct tdm_xfer_rmem *dst, const struct tdm_xfer_pages *pages,
                              const struct tdm_xfer_imm *imm, int timeout_ms, tdm_xfer_done_fn done,
                              void *ctx);
    tdm_status (*write)(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                        uint64_t src_offset, const struct tdm_xfer_rmem *dst, uint64_t dst_offset,
                        uint64_t bytes, const struct tdm_xfer_imm *imm, int timeout_ms,
                        tdm_xfer_done_fn done, void *ctx);
    tdm_status (*send)(void *t, uint32_t peer, const void *msg, size_t bytes, int timeout_ms,
                       tdm_xfer_done_fn done, void *ctx);
    tdm_status (*send_imm)(void *t, uint32_t peer, const struct tdm_xfer_imm *imm, int timeout_ms,
                           tdm_xfer_done_fn done, void *ctx);
    /* Completes what has finished and returns how many; a transport with a progress thread of
     * its own (libfabric) returns 0. Called by the thread that posts. */
    int (*poll)(void *t);
    void (*get_caps)(void *t, struct tdm_xfer_caps *out);
};
struct tdm_xfer_transport {
    const struct tdm_xfer_transport_i *iface;
    void *t;
};
/* The engine's own libfabric data plane, as a transport (valid while x lives). */
struct tdm_xfer_transport tdm_xfer_fabric_transport(tdm_xfer_t *x);

/* The CUDA IPC writer as a transport (src/xfer/ipc_transport.c): device regions exported with
 * IPC handles, one gather/scatter kernel per paged write, the immediate sent over `control`
 * (tdm_xfer_send_imm) once the kernel has completed, so it lands in the destination owner's
 * counters like an RMA immediate. Destinations registered in this same process are written
 * through their own pointers. Sends and liveness are the control engine's. A progress thread
 * of its own runs the completions (poll has nothing to do). TDM_EUNSUPPORTED or TDM_EIO from
 * create where there is no CUDA or no GPU. */
struct tdm_xfer_ipc_config {
    int device;                 /* the GPU this side's writes run on */
    int max_pending;            /* paged writes whose kernels may be in flight; 0: 64 */
    tdm_xfer_t *control;        /* carries sends and immediates (borrowed); NULL: none */
    tdm_xfer_counters_t *local; /* with no control engine: where immediates land (borrowed) */
};
typedef struct tdm_xfer_ipc tdm_xfer_ipc_t;
tdm_status tdm_xfer_ipc_create(const struct tdm_xfer_ipc_config *cfg, tdm_xfer_ipc_t **out);
/* Waits for the writes in flight and runs their callbacks, then frees. Regions registered
 * through it must be deregistered first. NULL is a no-op. */
void tdm_xfer_ipc_destroy(tdm_xfer_ipc_t *t);
struct tdm_xfer_transport tdm_xfer_ipc_transport(tdm_xfer_ipc_t *t);
/* Whether `dst`, a peer's CUDA region, can be written from here: its handle opens in this
 * process (the mapping is kept for the writes, and closed with the peer). TDM_OK, or why not:
 * a handle exported on another host, or by a GPU this one cannot map, does not open. */
tdm_status tdm_xfer_ipc_reach(tdm_xfer_ipc_t *t, const struct tdm_xfer_rmem *dst, uint32_t peer);
/* `peer` is gone (dead, or restarted elsewhere): the destinations last written for it are
 * closed (at once, or when their writes in flight complete). An exporter's device memory is
 * freed only once every process that opened it has closed it, so a writer that kept a dead
 * decoder's pool open would hold that memory for as long as it runs. NULL is a no-op. */
void tdm_xfer_ipc_forget_peer(tdm_xfer_ipc_t *t, uint32_t peer);

/* ---- host staging: GPU pages through registered pinned host memory (src/xfer/staged.c) ----
 * Between hosts whose fabric cannot register GPU memory (Debian's libfabric: no FI_HMEM), a
 * page travels device -> pinned host staging (a copy on the sender's GPU) -> RDMA write with
 * immediate into the decoder's pinned host landing pages -> device (a copy on the decoder's
 * GPU once every write of the request has landed).
 *
 * A copier moves pages between memory the fabric cannot register and host memory it can: one
 * gather/scatter kernel per copy on a stream of its own (CUDA), or memcpy on a thread of its own
 * (host memory standing in for device memory: CI, and host pools with --kv-staging always).
 * Copies are accepted whatever the load (callers bound what they submit: the staging ring, the
 * landing pages) and complete in order; done runs on the copier's thread, with no lock of the
 * copier held, and may submit again. */
#define TDM_XFER_COPY_MAX_PAGES 16384 /* pages in one copy (the CUDA writer's page list) */
struct tdm_xfer_copier_i {
    const char *name;
    /* host memory the copier reaches (pinned, device-visible for CUDA), page aligned, or NULL */
    void *(*host_alloc)(void *c, size_t bytes);
    void (*host_free)(void *c, void *p, size_t bytes);
    /* copies pages (offsets as in tdm_xfer_write_pages) from src to dst; TDM_EINVAL or
     * TDM_ERANGE (never calls done) when a page lies outside either */
    tdm_status (*copy_pages)(void *c, const void *src, size_t src_bytes, void *dst,
                             size_t dst_bytes, const struct tdm_xfer_pages *pages,
                             tdm_xfer_done_fn done, void *ctx);
    /* waits until every copy accepted so far has completed (its done has run) */
    void (*drain)(void *c);
    /* drains, then frees; a zeroed copier is a no-op */
    void (*destroy)(void *c);
};
struct tdm_xfer_copier {
    const struct tdm_xfer_copier_i *iface;
    void *c;
};
/* memcpy on a thread of its own; host memory from the heap */
tdm_status tdm_xfer_copier_host(struct tdm_xfer_copier *out);
/* one kernel per copy on a stream of `device`; host memory from cudaHostAlloc (pinned, mapped);
 * TDM_EUNSUPPORTED without CUDA */
tdm_status tdm_xfer_copier_cuda(int device, struct tdm_xfer_copier *out);
void tdm_xfer_copier_destroy(struct tdm_xfer_copier *c); /* a zeroed copier is a no-op */

/* The staged writer as a transport. A source region is any memory the copier reads (it is not
 * registered with the fabric); destinations are host regions of the fabric (a decoder's
 * landing pages). A paged write takes space in the staging ring (pinned host memory of
 * ring_bytes, registered with the fabric once), the copier gathers its pages there, and one
 * fabric paged write carries them from the ring to the destination pages with the immediate;
 * its space is returned when that write completes. The ring is the back-pressure: a write that
 * finds no room for its first piece is refused with TDM_EAGAIN (the caller retries, as it does
 * when the fabric's queue is full). A write larger than a quarter of the ring travels in
 * pieces, in order, and only the last carries the immediate, posted once the others have
 * completed, so an immediate still means "every byte of this paged write is in place".
 * Sends, immediates and liveness are the fabric's. A worker thread of its own advances pieces;
 * done callbacks run on it with no lock held. */
struct tdm_xfer_staged_config {
    struct tdm_xfer_transport fabric; /* moves host memory; borrowed, outlives the transport */
    struct tdm_xfer_copier copier;    /* borrowed, outlives the transport */
    size_t ring_bytes;                /* 0: 64 MiB */
};
struct tdm_xfer_staged_stats {
    uint64_t writes, bytes, pieces; /* paged writes completed OK, their bytes, fabric pieces */
    uint64_t failed;                /* paged writes that ended with an error */
    uint64_t ring_full;             /* writes refused with TDM_EAGAIN: no room in the ring */
    uint64_t ring_bytes, ring_used, ring_high; /* size, in use now, most ever in use */
    uint64_t copy_ns; /* time spent in copies (submitted to done), summed */
};
typedef struct tdm_xfer_staged tdm_xfer_staged_t;
tdm_status tdm_xfer_staged_create(const struct tdm_xfer_staged_config *cfg,
                                  tdm_xfer_staged_t **out);
/* Completes every write (pieces on the wire finish; writes with pieces not yet posted end with
 * TDM_ECANCELED once their copies are done), then frees the ring. Regions registered through it
 * must be deregistered first. NULL is a no-op. */
void tdm_xfer_staged_destroy(tdm_xfer_staged_t *s);
struct tdm_xfer_transport tdm_xfer_staged_transport(tdm_xfer_staged_t *s);
void tdm_xfer_staged_get_stats(tdm_xfer_staged_t *s, struct tdm_xfer_staged_stats *out);

/* ---- rails: several NICs per node (src/xfer/rails.c) ----
 * A rail set is n fabric engines ("rails"), one per NIC, of one provider. Rail 0 is the control
 * engine: peers, control messages, liveness and the immediate counters are its own, and its
 * peer indices are the set's. Rails 1 .. n-1 deliver their immediates into rail 0's counters
 * (tdm_xfer_config.counters), so a decoder's counter counts a request's immediates whatever
 * rail they came by. Once a control peer is up, each side sends it its rails' addresses (an
 * xfer RAILS message); rail r pairs with the peer's rail r, for r below both sides' counts, and
 * its own handshake (with the fabric key, its own proof) makes it usable. The transport
 * (tdm_xfer_rails_transport) registers every region on every rail (a host region's descriptor
 * then carries each rail's key) and spreads paged and single writes round-robin over the rails
 * usable to that peer and that destination, each write wholly on one rail, so the ordering of
 * one rail ("an immediate never overtakes its data") holds for every write; sends and IMM
 * messages take rail 0. A rail whose peer dies (silence, a completion error) fails every counter
 * bound to that peer with TDM_EPEER (writes on it may be lost: the request is fenced like a
 * dead peer's), is left out of the round robin, and is tried again with backoff (500 ms,
 * doubling to 10 s) while the control peer lives: a rail that comes back is used again. A peer
 * with one rail, or a destination registered on one, gets everything on rail 0: exactly a
 * single engine's behaviour and wire. */
struct tdm_xfer_rails_config {
    struct tdm_xfer_config base; /* rail 0's (callbacks, key, provider, timeouts); every rail's
                                    settings but node, domain and callbacks */
    /* rail r's NIC: an address (IPv4 or IPv6, the endpoint's node), a network interface (its
     * first IPv4 address), or a provider domain (an RDMA device such as mlx5_0); NULL or "":
     * base.node and base.domain */
    const char *nics[TDM_XFER_MAX_RAILS];
    int n_rails; /* 1 .. TDM_XFER_MAX_RAILS */
};
typedef struct tdm_xfer_rails tdm_xfer_rails_t;
/* Opens every rail (TDM_EINVAL when they disagree on the immediate layout) and starts the
 * keeper thread that retries dead rails. Strings are copied. */
tdm_status tdm_xfer_rails_create(const struct tdm_xfer_rails_config *cfg, tdm_xfer_rails_t **out);
/* Destroys rails n-1 .. 0 (their pending operations end with TDM_ECANCELED, rail 0's counters
 * last). Regions registered through the transport must be deregistered first. NULL: no-op. */
void tdm_xfer_rails_destroy(tdm_xfer_rails_t *r);
/* Rail 0, the control engine (owned by the set). */
tdm_xfer_t *tdm_xfer_rails_control(tdm_xfer_rails_t *r);
int tdm_xfer_rails_count(const tdm_xfer_rails_t *r);
struct tdm_xfer_transport tdm_xfer_rails_transport(tdm_xfer_rails_t *r);
struct tdm_xfer_rail_stats {
    char nic[64];                 /* as configured ("" for base.node) */
    char addr[TDM_XFER_ADDR_MAX]; /* its printable address */
    uint64_t writes, bytes;       /* paged and single writes accepted on it, their bytes */
    uint64_t fallbacks;           /* writes it refused as its peer had died, sent on rail 0 */
    uint64_t imm_received;        /* immediates that arrived by it */
    uint32_t peers_up;            /* peers whose rail r is paired and alive */
};
void tdm_xfer_rails_get_stats(tdm_xfer_rails_t *r, int rail, struct tdm_xfer_rail_stats *out);
/* A NIC as a provider wants it (the rule of tdm_xfer_rails_config.nics): an address is the
 * node; an interface, its first IPv4 address as the node; anything else, the domain. Empty
 * strings for what it is not. */
void tdm_xfer_nic_resolve(const char *nic, char *node, size_t node_cap, char *domain,
                          size_t domain_cap);
/* How many rails `peer` (a control index) can be written on now: 1 + its live paired rails. */
int tdm_xfer_rails_peer_rails(tdm_xfer_rails_t *r, uint32_t peer);

/* ---- immediate counters (also fed by the CUDA IPC transport) ---- */
struct tdm_xfer_counter_stats {
    uint64_t delivered;  /* immediates handed to the table */
    uint64_t counted;    /* ... that advanced an armed counter */
    uint64_t stale;      /* ... for an unarmed slot or another epoch */
    uint64_t duplicate;  /* ... whose index had already been counted */
    uint64_t invalid;    /* ... with index >= expected or slot out of range */
    uint64_t wrong_peer; /* ... from another peer than the one the counter was armed for */
    uint64_t fired_ok, fired_error;
};
/* n_slots counters, each expecting at most max_expected immediates. */
tdm_status tdm_xfer_counters_create(uint32_t n_slots, uint32_t max_expected,
                                    tdm_xfer_counters_t **out);
/* Fires every armed counter with TDM_ECANCELED. NULL is a no-op. */
void tdm_xfer_counters_destroy(tdm_xfer_counters_t *c);
/* Arms `slot` for `epoch`: fn fires exactly once, with TDM_OK when `expected` distinct indices
 * have landed, TDM_ETIMEDOUT after timeout_ms (required, > 0: nothing waits forever), TDM_EPEER
 * when `peer` dies (unless TDM_XFER_ANY_PEER), TDM_ECANCELED on cancel or destroy. TDM_EINVAL
 * when the slot is armed or timeout_ms <= 0. */
tdm_status tdm_xfer_counters_arm(tdm_xfer_counters_t *c, uint32_t slot, uint32_t epoch,
                                 uint32_t expected, uint32_t peer, int timeout_ms,
                                 tdm_xfer_counter_fn fn, void *ctx);
/* Fires the slot's counter with TDM_ECANCELED (on this thread) if it is armed for `epoch`;
 * TDM_ENOTFOUND otherwise. After it returns, the callback has run and will not run again. */
tdm_status tdm_xfer_counters_cancel(tdm_xfer_counters_t *c, uint32_t slot, uint32_t epoch);
/* Counts one immediate; fires the callback (on this thread) when it completes a counter. */
void tdm_xfer_counters_deliver(tdm_xfer_counters_t *c, const struct tdm_xfer_imm *imm);
/* The same, from a known sender: an immediate for a counter armed for another peer is counted
 * as wrong_peer and never advances it (TDM_XFER_ANY_PEER: the sender is not known). */
void tdm_xfer_counters_deliver_from(tdm_xfer_counters_t *c, const struct tdm_xfer_imm *imm,
                                    uint32_t peer);
/* Fires counters whose deadline passed (TDM_ETIMEDOUT); returns how many. */
int tdm_xfer_counters_expire(tdm_xfer_counters_t *c, uint64_t now_ns);
/* Fires the counters bound to `peer` with `st`; returns how many. */
int tdm_xfer_counters_fail_peer(tdm_xfer_counters_t *c, uint32_t peer, tdm_status st);
void tdm_xfer_counters_get_stats(tdm_xfer_counters_t *c, struct tdm_xfer_counter_stats *out);

/* n random bytes from the system's generator (GnuTLS's, for keys); false when it fails. */
bool tdm_xfer_random(void *buf, size_t n);

/* ---- a small waiter for synchronous callers: pass tdm_xfer_sync_done and the sync as ctx ---- */
struct tdm_xfer_sync {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pending;            /* operations added and not yet done */
    int waiters;            /* threads in tdm_xfer_sync_wait_below; done wakes only them */
    int wake_below;         /* and only once pending < wake_below */
    tdm_status first_error; /* first non-OK status seen */
    char first_error_msg[256];
};
void tdm_xfer_sync_init(struct tdm_xfer_sync *s);
void tdm_xfer_sync_destroy(struct tdm_xfer_sync *s);
void tdm_xfer_sync_add(struct tdm_xfer_sync *s, int n);
void tdm_xfer_sync_done(void *ctx, tdm_status st);
/* Waits until pending reaches 0 (returns first_error) or timeout_ms passes (TDM_ETIMEDOUT). */
tdm_status tdm_xfer_sync_wait(struct tdm_xfer_sync *s, int timeout_ms);
/* Waits until pending < n (a window with room): first_error, or TDM_ETIMEDOUT. */
tdm_status tdm_xfer_sync_wait_below(struct tdm_xfer_sync *s, int n, int timeout_ms);

/* ---- CUDA IPC transport (built with CUDA; TDM_EUNSUPPORTED otherwise) ----
 * Inside one node a region of device memory is exported as an IPC handle (in a tdm_xfer_rmem of
 * kind CUDA), opened by the peer process (a peer-mapped pointer), and written with ONE
 * gather/scatter kernel per paged write on the writer's stream. When the kernel's event has
 * completed, the immediate is handed to a counter table: the local one, or (from the done
 * callback) the destination owner's, through tdm_xfer_send_imm over the fabric engine. */
typedef struct tdm_xfer_cuda tdm_xfer_cuda_t;
/* A writer bound to `device`, with its own stream and at most max_pending paged writes whose
 * events have not been polled. */
tdm_status tdm_xfer_cuda_create(int device, int max_pending, tdm_xfer_cuda_t **out);
void tdm_xfer_cuda_destroy(tdm_xfer_cuda_t *c);
/* Fills out (kind CUDA, ipc_handle of the allocation holding dptr, addr = dptr's offset in it,
 * bytes) for [dptr, dptr + bytes), which must lie inside one cudaMalloc allocation. */
tdm_status tdm_xfer_cuda_export(void *dptr, size_t bytes, struct tdm_xfer_rmem *out);
/* Opens a peer's allocation in this process (*dptr is its base: add r->addr for the region);
 * valid until tdm_xfer_cuda_close. */
tdm_status tdm_xfer_cuda_open(const struct tdm_xfer_rmem *r, void **dptr);
/* Bytes of the device allocation holding dptr from dptr to its end (an opened handle's true
 * size, whatever a peer's descriptor claims). */
tdm_status tdm_xfer_cuda_alloc_size(const void *dptr, size_t *bytes);
void tdm_xfer_cuda_close(void *dptr);
/* The device ordinal of device memory at dptr (what a provider's GPU memory registration
 * names). */
tdm_status tdm_xfer_cuda_device_of(const void *dptr, int *device);
/* Launches one kernel copying every page of `pages` from src (device pointer, offsets as in
 * tdm_xfer_write_pages) to dst (a local or opened device pointer of dst_bytes). When it has
 * finished, tdm_xfer_cuda_poll hands `imm` (if any) to `counters` and calls done. */
tdm_status tdm_xfer_cuda_write_pages(tdm_xfer_cuda_t *c, const void *src, size_t src_bytes,
                                     void *dst, size_t dst_bytes,
                                     const struct tdm_xfer_pages *pages,
                                     const struct tdm_xfer_imm *imm, tdm_xfer_counters_t *counters,
                                     tdm_xfer_done_fn done, void *ctx);
/* Completes finished writes in order; returns how many completed. */
int tdm_xfer_cuda_poll(tdm_xfer_cuda_t *c);
/* Pinned host memory that kernels of every device read and write (cudaHostAlloc, portable and
 * mapped), or NULL; freed with tdm_xfer_cuda_host_free. */
void *tdm_xfer_cuda_host_alloc(size_t bytes);
void tdm_xfer_cuda_host_free(void *p);
/* Polls until every write completed or timeout_ms passed (TDM_ETIMEDOUT). */
tdm_status tdm_xfer_cuda_drain(tdm_xfer_cuda_t *c, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_XFER_H */
