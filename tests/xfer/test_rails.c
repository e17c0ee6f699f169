/* Rails: several NICs per node (src/xfer/rails.c), over tcp;ofi_rxm on the loopback (two
 * endpoints on 127.0.0.1 stand for two NICs; CI has no others):
 *   - the wire: a rail set's host descriptor packs the rails' keys where an IPC handle would
 *     be, a region of one rail packs as before, and the RAILS message's parser refuses every
 *     malformed length;
 *   - two rail sets (with a fabric key): writes spread round-robin (per-rail counts equal), the
 *     owner's one counter completes with immediates from both rails, and every byte landed;
 *   - a writer made of two plain engines (rail 0 and rail 1, paired by a RAILS message the test
 *     sends): a counter fed by both rails; rail 1's peer dying fences the request (the counter
 *     bound to the peer fails with TDM_EPEER while rail 0's peer stays up), and a rail that
 *     comes back (a new rail 1, named by a new RAILS message) is paired and counted again. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fire_log.h"
#include "tandem/xfer.h"
#include "xfer/xfer_int.h"

enum { PAGE = 4096, NP = 16, SLOT = 5 };
static const char KEY[] = "rails test cluster key, 32 bytes";

static void base_config(struct tdm_xfer_config *c, bool keyed)
{
    tdm_xfer_config_default(c);
    c->provider = "tcp;ofi_rxm";
    c->node = "127.0.0.1";
    c->faults = "";
    if (keyed) {
        c->fabric_key = KEY;
        c->fabric_key_bytes = 32;
    }
}

static tdm_xfer_rails_t *open_set(int n, bool keyed)
{
    struct tdm_xfer_rails_config rc = {.n_rails = n};
    base_config(&rc.base, keyed);
    for (int r = 0; r < n; r++)
        rc.nics[r] = "127.0.0.1";
    tdm_xfer_rails_t *s = NULL;
    tdm_status st = tdm_xfer_rails_create(&rc, &s);
    if (st != TDM_OK) fprintf(stderr, "rails: %s\n", tdm_err_msg());
    return s;
}

static tdm_xfer_t *open_engine(void)
{
    struct tdm_xfer_config c;
    base_config(&c, false);
    tdm_xfer_t *x = NULL;
    return tdm_xfer_create(&c, &x) == TDM_OK ? x : NULL;
}

static bool wait_rails(tdm_xfer_rails_t *s, uint32_t peer, int want, int ms)
{
    for (int i = 0; i < ms / 10; i++) {
        if (tdm_xfer_rails_peer_rails(s, peer) == want) return true;
        usleep(10000);
    }
    return false;
}

static uint8_t src_byte(size_t i)
{
    return (uint8_t)(i * 29 + 3);
}

/* ---- the wire ---- */

static void test_wire(void **state)
{
    (void)state;
    struct tdm_xfer_rmem r = {.addr = 4096, .key = 11, .bytes = 1 << 20, .kind = TDM_XFER_MEM_HOST};
    uint8_t one[TDM_XFER_RMEM_WIRE], two[TDM_XFER_RMEM_WIRE];
    tdm_xfer_rmem_pack(&r, one); /* one rail: as before (no extra rails, a zero handle) */
    for (int i = 28; i < TDM_XFER_RMEM_WIRE; i++)
        assert_int_equal(one[i], 0);
    r.rails = 3;
    r.rail_key[0] = 11, r.rail_key[1] = 22, r.rail_key[2] = 0x0102030405060708ull;
    tdm_xfer_rmem_pack(&r, two);
    assert_int_equal(tdm_get_u32(two + 28), 2);
    struct tdm_xfer_rmem back;
    assert_int_equal(tdm_xfer_rmem_unpack(two, sizeof two, &back), TDM_OK);
    assert_int_equal(back.rails, 3);
    assert_true(back.rail_key[0] == 11 && back.rail_key[1] == 22 &&
                back.rail_key[2] == 0x0102030405060708ull);
    two[32 + 16] = 1; /* a byte after the last key */
    assert_int_not_equal(tdm_xfer_rmem_unpack(two, sizeof two, &back), TDM_OK);
    tdm_put_u32(two + 28, TDM_XFER_MAX_RAILS); /* more rails than a set has */
    assert_int_not_equal(tdm_xfer_rmem_unpack(two, sizeof two, &back), TDM_OK);
    r.kind = TDM_XFER_MEM_CUDA; /* a GPU region keeps its handle: rail keys never go there */
    tdm_xfer_rmem_pack(&r, two);
    assert_int_equal(tdm_get_u32(two + 28), 0);
    tdm_put_u32(two + 28, 1);
    assert_int_not_equal(tdm_xfer_rmem_unpack(two, sizeof two, &back), TDM_OK);

    /* RAILS: n_rails, then u16 length | address for rails 1 .. n-1 */
    uint8_t a1[16], a2[5], buf[64];
    memset(a1, 7, sizeof a1), memset(a2, 9, sizeof a2);
    const uint8_t *addr[3] = {NULL, a1, a2};
    size_t bytes[3] = {0, sizeof a1, sizeof a2};
    size_t n = tdm_xfer_wire_rails_put(buf, sizeof buf, 3, addr, bytes);
    assert_int_equal(n, 1 + 2 + 16 + 2 + 5);
    struct tdm_xfer_rails_msg m;
    assert_int_equal(tdm_xfer_wire_rails_parse(buf, n, &m), TDM_OK);
    assert_int_equal(m.n_rails, 3);
    assert_int_equal(m.addr_bytes[1], 16);
    assert_ptr_equal(m.addr[2], buf + 1 + 2 + 16 + 2);
    for (size_t k = 0; k < n; k++) /* every truncation, and a byte too many */
        assert_int_not_equal(tdm_xfer_wire_rails_parse(buf, k, &m), TDM_OK);
    assert_int_not_equal(tdm_xfer_wire_rails_parse(buf, n + 1, &m), TDM_OK);
    buf[0] = 1; /* one rail says nothing */
    assert_int_not_equal(tdm_xfer_wire_rails_parse(buf, n, &m), TDM_OK);
    buf[0] = TDM_XFER_MAX_RAILS + 1;
    assert_int_not_equal(tdm_xfer_wire_rails_parse(buf, n, &m), TDM_OK);
    buf[0] = 3;
    tdm_put_u16(buf + 1, 0); /* an empty address */
    assert_int_not_equal(tdm_xfer_wire_rails_parse(buf, n, &m), TDM_OK);
    assert_int_equal(tdm_xfer_wire_rails_put(buf, sizeof buf, 1, addr, bytes), 0);
    assert_int_equal(tdm_xfer_wire_rails_put(buf, 10, 3, addr, bytes), 0);
    /* a message type a node without rails reads as a known one */
    uint8_t hdr[TDM_XFER_WIRE_HDR + 8];
    tdm_xfer_wire_put_hdr(hdr, TDM_XFER_MSG_RAILS, 1, 8);
    struct tdm_xfer_wire_hdr h;
    const uint8_t *payload;
    assert_int_equal(tdm_xfer_wire_parse(hdr, sizeof hdr, &h, &payload), TDM_OK);
    assert_int_equal(h.type, TDM_XFER_MSG_RAILS);
}

/* ---- two rail sets: round robin, one counter, every byte ---- */

static void test_round_robin(void **state)
{
    (void)state;
    tdm_xfer_rails_t *a = open_set(2, true), *b = open_set(2, true);
    assert_non_null(a);
    assert_non_null(b);
    tdm_xfer_t *ac = tdm_xfer_rails_control(a), *bc = tdm_xfer_rails_control(b);
    struct tdm_xfer_transport ta = tdm_xfer_rails_transport(a), tb = tdm_xfer_rails_transport(b);
    char addr[TDM_XFER_ADDR_MAX];
    uint32_t peer, a_on_b;
    assert_int_equal(tdm_xfer_addr(bc, addr, sizeof addr), TDM_OK);
    assert_int_equal(tdm_xfer_peer_add(ac, addr, &peer), TDM_OK);
    assert_int_equal(tdm_xfer_peer_wait(ac, peer, 5000), TDM_OK);
    assert_int_equal(tdm_xfer_addr(ac, addr, sizeof addr), TDM_OK);
    assert_int_equal(tdm_xfer_peer_add(bc, addr, &a_on_b), TDM_OK); /* the same entry */
    assert_int_equal(tdm_xfer_peer_wait(bc, a_on_b, 5000), TDM_OK);
    assert_true(wait_rails(a, peer, 2, 10000));
    assert_true(wait_rails(b, a_on_b, 2, 10000));

    uint8_t *src = malloc(NP * PAGE), *dst = calloc(NP, PAGE);
    for (size_t i = 0; i < NP * PAGE; i++)
        src[i] = src_byte(i);
    struct tdm_xfer_region rs, rd;
    assert_int_equal(ta.iface->mr_reg(ta.t, src, NP * PAGE, TDM_XFER_MEM_HOST, &rs), TDM_OK);
    assert_int_equal(tb.iface->mr_reg(tb.t, dst, NP * PAGE, TDM_XFER_MEM_HOST, &rd), TDM_OK);
    struct tdm_xfer_rmem rmem;
    tb.iface->mr_remote(tb.t, &rd, &rmem);
    assert_int_equal(rmem.rails, 2);
    uint8_t wire[TDM_XFER_RMEM_WIRE]; /* what a decoder sends, as the prefiller reads it */
    tdm_xfer_rmem_pack(&rmem, wire);
    assert_int_equal(tdm_xfer_rmem_unpack(wire, sizeof wire, &rmem), TDM_OK);

    struct fire_log fl = {0};
    assert_int_equal(
        tdm_xfer_counters_arm(tdm_xfer_get_counters(bc), SLOT, 3, 8, a_on_b, 10000, on_fire, &fl),
        TDM_OK);
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    for (uint32_t i = 0; i < 8; i++) { /* page i to page 15 - i, index i */
        uint32_t sp = i, dp = NP - 1 - i;
        struct tdm_xfer_pages p = {&sp, &dp, 1, PAGE, PAGE, PAGE, 0, 0};
        struct tdm_xfer_imm imm = {SLOT, 3, i};
        tdm_xfer_sync_add(&s, 1);
        assert_int_equal(
            ta.iface->write_pages(ta.t, peer, &rs, &rmem, &p, &imm, 0, tdm_xfer_sync_done, &s),
            TDM_OK);
    }
    assert_int_equal(tdm_xfer_sync_wait(&s, 10000), TDM_OK);
    tdm_xfer_sync_destroy(&s);
    assert_int_equal(wait_fired(&fl, 10000), 1);
    assert_int_equal(fl.last, TDM_OK);
    for (uint32_t i = 0; i < 8; i++)
        for (int k = 0; k < PAGE; k++)
            assert_int_equal(dst[(NP - 1 - i) * PAGE + k], src_byte(i * PAGE + (size_t)k));
    struct tdm_xfer_rail_stats st0, st1, sb0, sb1;
    tdm_xfer_rails_get_stats(a, 0, &st0);
    tdm_xfer_rails_get_stats(a, 1, &st1);
    tdm_xfer_rails_get_stats(b, 0, &sb0);
    tdm_xfer_rails_get_stats(b, 1, &sb1);
    assert_int_equal(st0.writes, 4); /* round robin, paged-write granularity */
    assert_int_equal(st1.writes, 4);
    assert_int_equal(st0.bytes, 4 * PAGE);
    assert_int_equal(st1.bytes, 4 * PAGE);
    assert_int_equal(sb0.imm_received, 4); /* the owner heard from both rails */
    assert_int_equal(sb1.imm_received, 4);
    assert_int_equal(st1.peers_up, 1);
    struct tdm_xfer_counter_stats cs;
    tdm_xfer_counters_get_stats(tdm_xfer_get_counters(bc), &cs);
    assert_int_equal(cs.counted, 8);

    /* a destination of one rail (an older or single-NIC decoder) gets rail 0 only */
    rmem.rails = 0;
    uint32_t sp = 0, dp = 0;
    struct tdm_xfer_pages p = {&sp, &dp, 1, PAGE, PAGE, PAGE, 0, 0};
    tdm_xfer_sync_init(&s);
    for (int i = 0; i < 3; i++) {
        tdm_xfer_sync_add(&s, 1);
        assert_int_equal(
            ta.iface->write_pages(ta.t, peer, &rs, &rmem, &p, NULL, 0, tdm_xfer_sync_done, &s),
            TDM_OK);
    }
    assert_int_equal(tdm_xfer_sync_wait(&s, 10000), TDM_OK);
    tdm_xfer_sync_destroy(&s);
    tdm_xfer_rails_get_stats(a, 0, &st0);
    tdm_xfer_rails_get_stats(a, 1, &st1);
    assert_int_equal(st0.writes, 7);
    assert_int_equal(st1.writes, 4);

    ta.iface->mr_dereg(ta.t, &rs);
    tb.iface->mr_dereg(tb.t, &rd);
    tdm_xfer_rails_destroy(a);
    tdm_xfer_rails_destroy(b);
    free(src);
    free(dst);
}

/* ---- a rail's peer dies, and comes back ---- */

struct writer {
    tdm_xfer_t *x0, *x1; /* rails 0 and 1 of the writer, plain engines */
    uint32_t p0, p1;     /* their index for the owner's rail 0 and rail 1 */
    tdm_xfer_mr_t *m0, *m1;
};

/* Rail 1 of the writer: a new engine, paired with the owner's rail 1 by a RAILS message. */
static void writer_rail1(struct writer *w, tdm_xfer_rails_t *b, uint32_t w_on_b, uint8_t *src)
{
    w->x1 = open_engine();
    assert_non_null(w->x1);
    assert_int_equal(tdm_xfer_mr_reg(w->x1, src, NP * PAGE, TDM_XFER_MEM_HOST, &w->m1), TDM_OK);
    struct tdm_xfer_rail_stats b1;
    tdm_xfer_rails_get_stats(b, 1, &b1);
    assert_int_equal(tdm_xfer_peer_add(w->x1, b1.addr, &w->p1), TDM_OK);
    uint8_t raw[256], msg[300];
    size_t raw_bytes = tdm_xfer_addr_raw(w->x1, raw, sizeof raw);
    assert_true(raw_bytes > 0);
    const uint8_t *addr[2] = {NULL, raw};
    size_t bytes[2] = {0, raw_bytes};
    size_t n = tdm_xfer_wire_rails_put(msg, sizeof msg, 2, addr, bytes);
    assert_true(n > 0);
    assert_int_equal(tdm_xfer_send_rails(w->x0, w->p0, msg, n), TDM_OK);
    assert_true(wait_rails(b, w_on_b, 2, 10000));
    assert_int_equal(tdm_xfer_peer_wait(w->x1, w->p1, 5000), TDM_OK);
}

static void write_one(tdm_xfer_t *x, uint32_t peer, tdm_xfer_mr_t *m, const struct tdm_xfer_rmem *d,
                      uint64_t key, uint32_t epoch, uint32_t index, uint32_t page)
{
    struct tdm_xfer_rmem dk = *d;
    dk.key = key;
    struct tdm_xfer_imm imm = {SLOT, epoch, index};
    struct tdm_xfer_sync s;
    tdm_xfer_sync_init(&s);
    tdm_xfer_sync_add(&s, 1);
    assert_int_equal(tdm_xfer_write(x, peer, m, (uint64_t)page * PAGE, &dk, (uint64_t)page * PAGE,
                                    PAGE, &imm, 0, tdm_xfer_sync_done, &s),
                     TDM_OK);
    assert_int_equal(tdm_xfer_sync_wait(&s, 10000), TDM_OK);
    tdm_xfer_sync_destroy(&s);
}

static void test_rail_death_fences(void **state)
{
    (void)state;
    tdm_xfer_rails_t *b = open_set(2, false);
    assert_non_null(b);
    tdm_xfer_t *bc = tdm_xfer_rails_control(b);
    struct tdm_xfer_transport tb = tdm_xfer_rails_transport(b);
    struct writer w = {0};
    w.x0 = open_engine();
    assert_non_null(w.x0);
    char addr[TDM_XFER_ADDR_MAX];
    uint32_t w_on_b;
    assert_int_equal(tdm_xfer_addr(bc, addr, sizeof addr), TDM_OK);
    assert_int_equal(tdm_xfer_peer_add(w.x0, addr, &w.p0), TDM_OK);
    assert_int_equal(tdm_xfer_peer_wait(w.x0, w.p0, 5000), TDM_OK);
    assert_int_equal(tdm_xfer_addr(w.x0, addr, sizeof addr), TDM_OK);
    assert_int_equal(tdm_xfer_peer_add(bc, addr, &w_on_b), TDM_OK);
    assert_int_equal(tdm_xfer_peer_wait(bc, w_on_b, 5000), TDM_OK);

    uint8_t *src = malloc(NP * PAGE), *dst = calloc(NP, PAGE);
    for (size_t i = 0; i < NP * PAGE; i++)
        src[i] = src_byte(i);
    assert_int_equal(tdm_xfer_mr_reg(w.x0, src, NP * PAGE, TDM_XFER_MEM_HOST, &w.m0), TDM_OK);
    struct tdm_xfer_region rd;
    assert_int_equal(tb.iface->mr_reg(tb.t, dst, NP * PAGE, TDM_XFER_MEM_HOST, &rd), TDM_OK);
    struct tdm_xfer_rmem rmem;
    tb.iface->mr_remote(tb.t, &rd, &rmem);
    assert_int_equal(rmem.rails, 2);
    writer_rail1(&w, b, w_on_b, src);
    tdm_xfer_counters_t *ctr = tdm_xfer_get_counters(bc);

    /* one request, its immediates by both rails: one counter completes */
    struct fire_log ok = {0};
    assert_int_equal(tdm_xfer_counters_arm(ctr, SLOT, 1, 2, w_on_b, 10000, on_fire, &ok), TDM_OK);
    write_one(w.x0, w.p0, w.m0, &rmem, rmem.rail_key[0], 1, 0, 0);
    write_one(w.x1, w.p1, w.m1, &rmem, rmem.rail_key[1], 1, 1, 1);
    assert_int_equal(wait_fired(&ok, 10000), 1);
    assert_int_equal(ok.last, TDM_OK);
    assert_memory_equal(dst, src, 2 * PAGE);

    /* rail 1's peer dies mid-request: the request is fenced, rail 0's peer lives on */
    struct fire_log fenced = {0};
    assert_int_equal(tdm_xfer_counters_arm(ctr, SLOT, 2, 3, w_on_b, 20000, on_fire, &fenced),
                     TDM_OK);
    write_one(w.x0, w.p0, w.m0, &rmem, rmem.rail_key[0], 2, 0, 0);
    tdm_xfer_mr_dereg(w.m1);
    tdm_xfer_destroy(w.x1); /* its goodbye: rail 1's peer is gone */
    w.x1 = NULL;
    assert_int_equal(wait_fired(&fenced, 5000), 1);
    assert_int_equal(fenced.last, TDM_EPEER);
    assert_true(tdm_xfer_peer_alive(bc, w_on_b));
    assert_true(wait_rails(b, w_on_b, 1, 5000));
    struct tdm_xfer_rail_stats b1;
    tdm_xfer_rails_get_stats(b, 1, &b1);
    assert_int_equal(b1.peers_up, 0);

    /* a rail that comes back (a new engine behind the writer's rail 1) is used again */
    writer_rail1(&w, b, w_on_b, src);
    struct fire_log back = {0};
    assert_int_equal(tdm_xfer_counters_arm(ctr, SLOT, 3, 2, w_on_b, 10000, on_fire, &back), TDM_OK);
    write_one(w.x1, w.p1, w.m1, &rmem, rmem.rail_key[1], 3, 0, 2);
    write_one(w.x0, w.p0, w.m0, &rmem, rmem.rail_key[0], 3, 1, 3);
    assert_int_equal(wait_fired(&back, 10000), 1);
    assert_int_equal(back.last, TDM_OK);
    assert_memory_equal(dst, src, 4 * PAGE);
    tdm_xfer_rails_get_stats(b, 1, &b1);
    assert_int_equal(b1.peers_up, 1);
    assert_int_equal(b1.imm_received, 2); /* one from each incarnation of rail 1 */

    tdm_xfer_mr_dereg(w.m0);
    tdm_xfer_mr_dereg(w.m1);
    tdm_xfer_destroy(w.x0);
    tdm_xfer_destroy(w.x1);
    tb.iface->mr_dereg(tb.t, &rd);
    tdm_xfer_rails_destroy(b);
    free(src);
    free(dst);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wire),
        cmocka_unit_test(test_round_robin),
        cmocka_unit_test(test_rail_death_fences),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
