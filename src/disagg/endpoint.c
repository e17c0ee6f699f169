/*
 * The messenger endpoint that both sides open: a transfer engine whose control messages fit a
 * PREFILL of a full context, the KV pool registered where it lives (its place and strides come
 * from the pool, never from constants), and the host context buffers.
 *
 * Called once at a side's creation, on the creating thread; the endpoint then belongs to that
 * side.
 */
#include <stdio.h>

#include "disagg/disagg_int.h"

tdm_status tdm_disagg_endpoint_open(struct disagg_endpoint *ep,
                                    const struct disagg_endpoint_opts *o)
{
    *ep = (struct disagg_endpoint){.kv = tdm_kv_pool_geometry(o->kv)};
    struct tdm_xfer_config xc;
    tdm_xfer_config_default(&xc);
    if (o->xfer->provider) xc.provider = o->xfer->provider;
    xc.node = o->xfer->node;
    if (o->xfer->peer_timeout_ms > 0) xc.peer_timeout_ms = o->xfer->peer_timeout_ms;
    xc.fabric_key = o->xfer->fabric_key;
    xc.fabric_key_bytes = o->xfer->fabric_key_bytes;
    int max_pages = (o->max_ctx + o->page_size - 1) / o->page_size;
    size_t msg = tdm_disagg_prefill_msg_size((uint32_t)o->max_ctx, (uint32_t)max_pages);
    if ((size_t)xc.ctrl_bytes < msg) xc.ctrl_bytes = (int)msg;
    if (xc.max_jobs < o->min_jobs) xc.max_jobs = o->min_jobs;
    xc.on_msg = o->on_msg;
    xc.on_msg_ctx = o->ctx;
    xc.on_peer = o->on_peer;
    xc.on_peer_ctx = o->ctx;
    tdm_status st = tdm_xfer_create(&xc, &ep->x);
    if (st != TDM_OK) return st;
    /* host pages travel by the fabric's RMA; device pages will take CUDA IPC or host staging
     * through the same table (the issue of GPU disaggregation) */
    ep->tp = tdm_xfer_fabric_transport(ep->x);
    const struct tdm_xfer_transport_i *tp = ep->tp.iface;
    tp->get_caps(ep->tp.t, &ep->caps);
    enum tdm_xfer_mem_kind kind =
        ep->kv.place.kind == TDM_MEM_DEVICE ? TDM_XFER_MEM_CUDA : TDM_XFER_MEM_HOST;
    if ((st = tp->mr_reg(ep->tp.t, ep->kv.base, ep->kv.bytes, kind, &ep->kv_reg)) != TDM_OK)
        goto out_xfer;
    if ((st = tp->mr_reg(ep->tp.t, o->ctx_mem, o->ctx_bytes, TDM_XFER_MEM_HOST, &ep->ctx_reg)) !=
        TDM_OK)
        goto out_kv;
    return TDM_OK;

out_kv:
    tp->mr_dereg(ep->tp.t, &ep->kv_reg);
out_xfer:
    tdm_xfer_destroy(ep->x);
    *ep = (struct disagg_endpoint){0};
    return st;
}

void tdm_disagg_endpoint_release(struct disagg_endpoint *ep)
{
    if (!ep->tp.iface) return;
    ep->tp.iface->mr_dereg(ep->tp.t, &ep->ctx_reg);
    ep->tp.iface->mr_dereg(ep->tp.t, &ep->kv_reg);
}

void tdm_disagg_endpoint_metrics(struct disagg_endpoint *ep, struct tdm_sbuf *b)
{
    struct tdm_xfer_stats xs;
    struct tdm_xfer_counter_stats cs;
    tdm_xfer_get_stats(ep->x, &xs);
    tdm_xfer_counters_get_stats(tdm_xfer_get_counters(ep->x), &cs);
    tdm_prom_family(b, "tandem_fabric_auth_total", "counter",
                    "Fabric peers' proofs of the cluster key, by result.");
    tdm_prom_sample(b, "tandem_fabric_auth_total", "result=\"ok\"", (double)xs.auth_ok);
    tdm_prom_sample(b, "tandem_fabric_auth_total", "result=\"failed\"", (double)xs.auth_failed);
    tdm_prom_scalar(b, "tandem_fabric_unauthenticated_dropped_total", "counter",
                    "Messages and immediates dropped because their sender was not proven.", NULL,
                    (double)xs.unauth_dropped);
    tdm_prom_family(b, "tandem_fabric_immediates_total", "counter",
                    "Immediates handed to the counters, by what became of them.");
    static const char *const kinds[] = {"counted", "stale", "duplicate", "invalid", "wrong_peer"};
    const uint64_t v[] = {cs.counted, cs.stale, cs.duplicate, cs.invalid, cs.wrong_peer};
    for (int i = 0; i < 5; i++) {
        char lab[48];
        snprintf(lab, sizeof lab, "kind=\"%s\"", kinds[i]);
        tdm_prom_sample(b, "tandem_fabric_immediates_total", lab, (double)v[i]);
    }
}
