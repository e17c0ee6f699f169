/*
 * Private declarations of the transfer engine: the pure pieces (run merging, fault-injection
 * decisions, address and wire encoding) that unit tests and fuzz targets exercise without a
 * fabric, and the internal message header.
 *
 * None of these hold locks or threads; the engine (fabric.c) and the CUDA IPC transport call them.
 */
#ifndef TANDEM_XFER_INT_H
#define TANDEM_XFER_INT_H

#include "tandem/xfer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- paged writes -> runs ---- */
struct tdm_xfer_run {
    uint64_t src_off, dst_off, bytes;
    uint32_t first_page, n_pages; /* which entries of the page list it covers */
};
/* Validates a page list against the two region sizes (no overflow, every page inside). */
tdm_status tdm_xfer_pages_check(const struct tdm_xfer_pages *p, uint64_t src_bytes,
                                uint64_t dst_bytes, uint32_t max_pages);
/* Merges consecutive pages contiguous on both sides into runs of at most max_run_bytes (a page
 * alone is always one run: callers refuse pages above their provider's cap). `runs` has room for
 * p->n_pages entries. Returns the number of runs. */
uint32_t tdm_xfer_pages_merge(const struct tdm_xfer_pages *p, uint64_t max_run_bytes,
                              struct tdm_xfer_run *runs);

/* A single contiguous write as a paged write of one page. */
struct tdm_xfer_pages tdm_xfer_pages_one(uint64_t src_offset, uint64_t dst_offset, uint64_t bytes);

/* How many counters are armed (read without the table's lock: a hint for the idle policy). */
uint32_t tdm_xfer_counters_n_armed(tdm_xfer_counters_t *c);

/* ---- fault injection ---- */
struct tdm_xfer_faults {
    double drop_imm;    /* probability an arriving immediate is never delivered */
    double dup_imm;     /* probability it is delivered twice */
    double reorder_imm; /* probability it is held back until the next one has been delivered */
    int delay_imm_ms;   /* every delivery is late by this much */
    double fail_write;  /* probability a fabric write fails locally (sender) */
    uint64_t seed;
    bool any;
};
/* Parses "drop_imm=0.1,delay_imm_ms=50,dup_imm=0.1,reorder_imm=0.5,fail_write=0.05,seed=7".
 * NULL or "" is no faults. Unknown keys and out-of-range values are TDM_EINVAL. */
tdm_status tdm_xfer_faults_parse(const char *spec, struct tdm_xfer_faults *out);

enum tdm_xfer_imm_fate {
    TDM_XFER_IMM_DELIVER = 0,
    TDM_XFER_IMM_DROP,
    TDM_XFER_IMM_DUP,
    TDM_XFER_IMM_REORDER,
};
/* The fate of the seq-th arriving immediate: a pure function of (seed, seq). */
enum tdm_xfer_imm_fate tdm_xfer_faults_imm(const struct tdm_xfer_faults *f, uint64_t seq);
/* Whether the seq-th write posted by this engine fails. */
bool tdm_xfer_faults_write(const struct tdm_xfer_faults *f, uint64_t seq);

/* ---- printable addresses ---- */
/* "x1:" + lowercase hex. Returns TDM_ERANGE when cap is too small. */
tdm_status tdm_xfer_addr_encode(const void *raw, size_t n, char *buf, size_t cap);
/* Decodes into raw (cap bytes); validates prefix, even length, hex digits, size. */
tdm_status tdm_xfer_addr_decode(const char *s, void *raw, size_t cap, size_t *n);

/* ---- the internal message header (every two-sided message) ----
 *   u32 magic 'TDXF' | u8 version | u8 type | u16 reserved | u64 sender nonce | u32 payload bytes
 * little-endian, 20 bytes, then the payload. */
#define TDM_XFER_WIRE_MAGIC   0x46584454u /* "TDXF" */
#define TDM_XFER_WIRE_VERSION 2
#define TDM_XFER_WIRE_HDR     20
enum tdm_xfer_msg_type {
    TDM_XFER_MSG_HELLO = 1,     /* payload: u8 imm_bits | u16 addr bytes | addr | u8 flags |
                                 * 32-byte challenge (flags: TDM_XFER_HELLO_*) */
    TDM_XFER_MSG_HEARTBEAT = 2, /* no payload */
    TDM_XFER_MSG_USER = 3,      /* the user's control message */
    TDM_XFER_MSG_IMM = 4,       /* payload: u64 encoded immediate (CUDA IPC completions) */
    TDM_XFER_MSG_BYE = 5,       /* the sender is shutting down cleanly */
    TDM_XFER_MSG_AUTH = 6,      /* payload: the 32-byte proof (HMAC-SHA256, see peer.c) */
    TDM_XFER_MSG_RAILS = 7,     /* payload: u8 n_rails (2 .. TDM_XFER_MAX_RAILS), then for
                                 * rails 1 .. n-1: u16 addr bytes (1 .. 256) | raw address
                                 * (a rail set's other endpoints, rails.c; only a node with
                                 * several rails sends it) */
};
#define TDM_XFER_MSG_LAST     TDM_XFER_MSG_RAILS
#define TDM_XFER_HELLO_KEYED  1u /* the sender has a fabric key and wants a proof */
#define TDM_XFER_HELLO_ANSWER 2u /* the sender does not know us (yet, or any more): hello back */
#define TDM_XFER_HELLO_FLAGS  (TDM_XFER_HELLO_KEYED | TDM_XFER_HELLO_ANSWER)
#define TDM_XFER_CHALLENGE    32
#define TDM_XFER_PROOF        32
struct tdm_xfer_wire_hdr {
    uint8_t type;
    uint64_t nonce;
    uint32_t payload_bytes;
};
void tdm_xfer_wire_put_hdr(uint8_t *buf, uint8_t type, uint64_t nonce, uint32_t payload_bytes);
/* Parses a received buffer of n bytes: magic, version, known type, payload length == n - header.
 * *payload points into buf. */
tdm_status tdm_xfer_wire_parse(const uint8_t *buf, size_t n, struct tdm_xfer_wire_hdr *hdr,
                               const uint8_t **payload);
/* HELLO payload. */
struct tdm_xfer_hello {
    int imm_bits;
    const uint8_t *addr; /* into the payload */
    size_t addr_bytes;
    uint8_t flags;
    const uint8_t *challenge; /* TDM_XFER_CHALLENGE bytes, into the payload */
};
size_t tdm_xfer_wire_hello_put(uint8_t *buf, size_t cap, int imm_bits, const void *addr,
                               size_t addr_bytes, uint8_t flags,
                               const uint8_t challenge[TDM_XFER_CHALLENGE]);
tdm_status tdm_xfer_wire_hello_parse(const uint8_t *p, size_t n, struct tdm_xfer_hello *out);
/* RAILS payload: the raw addresses of rails 1 .. n_rails-1 (pointers into the payload). */
#define TDM_XFER_RAIL_ADDR_MAX 256
struct tdm_xfer_rails_msg {
    int n_rails;
    const uint8_t *addr[TDM_XFER_MAX_RAILS]; /* [1 .. n_rails-1] */
    size_t addr_bytes[TDM_XFER_MAX_RAILS];
};
/* Returns the payload's size, 0 when it does not fit or a field is out of range. */
size_t tdm_xfer_wire_rails_put(uint8_t *buf, size_t cap, int n_rails, const uint8_t *const *addr,
                               const size_t *addr_bytes);
tdm_status tdm_xfer_wire_rails_parse(const uint8_t *p, size_t n, struct tdm_xfer_rails_msg *out);

/* ---- what a rail set (rails.c) needs of the control engine ----
 * The hook runs on the engine's progress thread: on_peer when a peer becomes known or dies
 * (before the configured on_peer), on_rails for a RAILS message from a known peer. */
struct tdm_xfer_rail_hook {
    void (*on_peer)(void *ctx, uint32_t peer, bool up);
    void (*on_rails)(void *ctx, uint32_t peer, const uint8_t *payload, size_t bytes);
    void *ctx;
};
/* tdm_xfer_create with the hook in place before the progress thread starts. */
tdm_status tdm_xfer_create_hooked(const struct tdm_xfer_config *cfg,
                                  const struct tdm_xfer_rail_hook *hook, tdm_xfer_t **out);
/* Sends a RAILS message (payload from tdm_xfer_wire_rails_put) to a known peer. */
tdm_status tdm_xfer_send_rails(tdm_xfer_t *x, uint32_t peer, const void *payload, size_t bytes);
/* This engine's raw address (fi_getname), its bytes, or 0 when cap is too small. */
size_t tdm_xfer_addr_raw(const tdm_xfer_t *x, uint8_t *out, size_t cap);

#ifdef __cplusplus
}
#endif

static inline void tdm_put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void tdm_put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void tdm_put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t tdm_get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t tdm_get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static inline uint64_t tdm_get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

#endif /* TANDEM_XFER_INT_H */
