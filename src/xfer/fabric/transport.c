/*
 * The libfabric engine as a transport of the ops table (include/tandem/xfer.h): each entry is
 * the engine's own call, with regions wrapping the engine's memory registrations. Any thread
 * (the engine's calls are thread-safe); the engine's progress thread completes the operations,
 * so poll has nothing to do.
 */
#include <stdlib.h>

#include "xfer/fabric/fabric_int.h"

static tdm_status fab_mr_reg(void *t, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                             struct tdm_xfer_region *out)
{
    tdm_xfer_mr_t *mr = NULL;
    tdm_status st = tdm_xfer_mr_reg(t, base, bytes, kind, &mr);
    if (st != TDM_OK) return st;
    *out = (struct tdm_xfer_region){.base = base, .bytes = bytes, .kind = kind, .impl = mr};
    return TDM_OK;
}

static void fab_mr_dereg(void *t, struct tdm_xfer_region *r)
{
    (void)t;
    tdm_xfer_mr_dereg(r->impl);
    *r = (struct tdm_xfer_region){0};
}

static void fab_mr_remote(void *t, const struct tdm_xfer_region *r, struct tdm_xfer_rmem *out)
{
    (void)t;
    tdm_xfer_mr_remote(r->impl, out);
}

static tdm_status fab_write_pages(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                                  const struct tdm_xfer_rmem *dst,
                                  const struct tdm_xfer_pages *pages,
                                  const struct tdm_xfer_imm *imm, int timeout_ms,
                                  tdm_xfer_done_fn done, void *ctx)
{
    return tdm_xfer_write_pages(t, peer, src->impl, dst, pages, imm, timeout_ms, done, ctx);
}

static tdm_status fab_write(void *t, uint32_t peer, const struct tdm_xfer_region *src,
                            uint64_t src_offset, const struct tdm_xfer_rmem *dst,
                            uint64_t dst_offset, uint64_t bytes, const struct tdm_xfer_imm *imm,
                            int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    return tdm_xfer_write(t, peer, src->impl, src_offset, dst, dst_offset, bytes, imm, timeout_ms,
                          done, ctx);
}

static tdm_status fab_send(void *t, uint32_t peer, const void *msg, size_t bytes, int timeout_ms,
                           tdm_xfer_done_fn done, void *ctx)
{
    return tdm_xfer_send(t, peer, msg, bytes, timeout_ms, done, ctx);
}

static tdm_status fab_send_imm(void *t, uint32_t peer, const struct tdm_xfer_imm *imm,
                               int timeout_ms, tdm_xfer_done_fn done, void *ctx)
{
    return tdm_xfer_send_imm(t, peer, imm, timeout_ms, done, ctx);
}

static int fab_poll(void *t)
{
    (void)t;
    return 0;
}

static void fab_get_caps(void *t, struct tdm_xfer_caps *out)
{
    tdm_xfer_get_caps(t, out);
}

static const struct tdm_xfer_transport_i FABRIC_TRANSPORT = {
    .name = "libfabric",
    .mr_reg = fab_mr_reg,
    .mr_dereg = fab_mr_dereg,
    .mr_remote = fab_mr_remote,
    .write_pages = fab_write_pages,
    .write = fab_write,
    .send = fab_send,
    .send_imm = fab_send_imm,
    .poll = fab_poll,
    .get_caps = fab_get_caps,
};

struct tdm_xfer_transport tdm_xfer_fabric_transport(tdm_xfer_t *x)
{
    return (struct tdm_xfer_transport){.iface = &FABRIC_TRANSPORT, .t = x};
}
