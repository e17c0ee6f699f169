/*
 * libFuzzer target for the transfer engine's parsers of peer bytes: the message header
 * (tdm_xfer_wire_parse), the hello payload, a rail set's RAILS payload, the packed
 * remote-memory descriptor (with a rail set's keys), printable addresses and the
 * fault-injection spec. Accepted input must satisfy what the engine relies on
 * (payload inside the buffer, lengths consistent, known kinds); anything else must be an error,
 * never a crash, a leak or an out-of-bounds read.
 *
 * Seed corpus: tests/fuzz/corpus/xfer_wire/ (a user message, a hello, a descriptor).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/xfer_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct tdm_xfer_wire_hdr h;
    const uint8_t *payload;
    if (tdm_xfer_wire_parse(data, size, &h, &payload) == TDM_OK) {
        if (payload < data || payload + h.payload_bytes != data + size) abort();
        if (h.type == TDM_XFER_MSG_HELLO) {
            struct tdm_xfer_hello hl;
            if (tdm_xfer_wire_hello_parse(payload, h.payload_bytes, &hl) == TDM_OK &&
                (hl.addr + hl.addr_bytes + 1 != hl.challenge ||
                 hl.challenge + TDM_XFER_CHALLENGE != payload + h.payload_bytes ||
                 (hl.imm_bits != 32 && hl.imm_bits != 64) || (hl.flags & ~TDM_XFER_HELLO_FLAGS)))
                abort();
        }
        if (h.type == TDM_XFER_MSG_RAILS) {
            struct tdm_xfer_rails_msg m;
            if (tdm_xfer_wire_rails_parse(payload, h.payload_bytes, &m) == TDM_OK) {
                /* every address inside the payload, and written back the same bytes */
                if (m.n_rails < 2 || m.n_rails > TDM_XFER_MAX_RAILS) abort();
                for (int r = 1; r < m.n_rails; r++)
                    if (m.addr_bytes[r] == 0 || m.addr_bytes[r] > TDM_XFER_RAIL_ADDR_MAX ||
                        m.addr[r] < payload ||
                        m.addr[r] + m.addr_bytes[r] > payload + h.payload_bytes)
                        abort();
                uint8_t *again = malloc(h.payload_bytes ? h.payload_bytes : 1);
                if (!again) return 0;
                size_t n = tdm_xfer_wire_rails_put(again, h.payload_bytes, m.n_rails, m.addr,
                                                   m.addr_bytes);
                if (n != h.payload_bytes || memcmp(again, payload, n) != 0) abort();
                free(again);
            }
        }
        if (h.type == TDM_XFER_MSG_IMM) {
            struct tdm_xfer_imm imm;
            tdm_xfer_imm_decode(64, tdm_get_u64(payload), &imm);
            uint64_t back;
            if (tdm_xfer_imm_encode(64, &imm, &back) != TDM_OK) abort();
        }
    }
    struct tdm_xfer_rmem r;
    if (tdm_xfer_rmem_unpack(data, size, &r) == TDM_OK) {
        uint8_t again[TDM_XFER_RMEM_WIRE];
        tdm_xfer_rmem_pack(&r, again);
        if (memcmp(again, data, TDM_XFER_RMEM_WIRE) != 0) abort();
        if (r.rails > TDM_XFER_MAX_RAILS ||
            (r.rails && (r.rails < 2 || r.kind != TDM_XFER_MEM_HOST || r.rail_key[0] != r.key)))
            abort();
    }
    /* the same bytes as a NUL-terminated address and fault spec */
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = '\0';
    uint8_t raw[256];
    size_t n;
    if (tdm_xfer_addr_decode(s, raw, sizeof(raw), &n) == TDM_OK) {
        char enc[3 + 2 * sizeof(raw) + 1];
        if (n > sizeof(raw) || tdm_xfer_addr_encode(raw, n, enc, sizeof(enc)) != TDM_OK) abort();
    }
    struct tdm_xfer_faults f;
    if (tdm_xfer_faults_parse(s, &f) == TDM_OK &&
        (f.drop_imm + f.dup_imm + f.reorder_imm > 1.0 || f.fail_write < 0 || f.fail_write > 1))
        abort();
    free(s);
    return 0;
}
