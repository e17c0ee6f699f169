/*
 * The messenger endpoint that both sides open: a transfer engine whose control messages fit a
 * PREFILL of a full context, the KV pool registered where it lives (its place and strides come
 * from the pool, never from constants), the host context buffers, and with a speculation head
 * the head's KV layer group (a region of its own in the pool) and the head's identity.
 *
 * Called once at a side's creation, on the creating thread; the endpoint then belongs to that
 * side.
 */
#include <stdio.h>

#include "disagg/disagg_int.h"
#include "tandem/spec.h"

/* The head's KV group in the pool, and its identity. */
static tdm_status head_open(struct disagg_head *h, tdm_kv_pool_t *kv, const struct tdm_model *m,
                            size_t elem_bytes)
{
    struct tdm_kv_group g;
    const struct tdm_kv_config *kc = tdm_kv_pool_config(kv);
    if (!tdm_kv_pool_group(kv, 1, &g) || g.n_layers != m->cfg.n_layers ||
        g.n_kv_heads != m->cfg.n_kv_heads || g.head_dim != m->cfg.head_dim)
        return tdm_err_set(TDM_EINVAL, "disagg: the KV pool has no layer group for the "
                                       "speculation head (load it before the engine)");
    h->page_bytes = (size_t)2 * g.n_kv_heads * kc->page_size * g.head_dim * elem_bytes;
    h->layer_bytes = h->page_bytes * (size_t)kc->n_pages;
    h->bytes = h->layer_bytes * (size_t)g.n_layers;
    h->base = tdm_kv_pool_group_layer(kv, 1, 0).base;
    h->id = (struct tdm_disagg_head_req){.fingerprint = tdm_spec_head_fingerprint(m),
                                         .n_layers = (uint32_t)m->cfg.n_layers,
                                         .n_heads = (uint32_t)m->cfg.n_heads,
                                         .n_kv_heads = (uint32_t)m->cfg.n_kv_heads,
                                         .head_dim = (uint32_t)m->cfg.head_dim,
                                         .d_ff = (uint32_t)m->cfg.d_ff};
    h->on = true;
    return TDM_OK;
}

void tdm_disagg_head_describe(const struct tdm_disagg_head_req *h, char *buf, size_t cap)
{
    snprintf(buf, cap, "%016llx (%u layer%s, %u heads, %u kv heads of %u, d_ff %u)",
             (unsigned long long)h->fingerprint, h->n_layers, h->n_layers == 1 ? "" : "s",
             h->n_heads, h->n_kv_heads, h->head_dim, h->d_ff);
}

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
    tdm_status st;
    if (o->head && (st = head_open(&ep->head, o->kv, o->head, ep->kv.elem_bytes)) != TDM_OK)
        return st;
    int max_pages = (o->max_ctx + o->page_size - 1) / o->page_size;
    size_t msg = tdm_disagg_prefill_msg_size((uint32_t)o->max_ctx, (uint32_t)max_pages, true);
    if ((size_t)xc.ctrl_bytes < msg) xc.ctrl_bytes = (int)msg;
    if (xc.max_jobs < o->min_jobs) xc.max_jobs = o->min_jobs;
    xc.on_msg = o->on_msg;
    xc.on_msg_ctx = o->ctx;
    xc.on_peer = o->on_peer;
    xc.on_peer_ctx = o->ctx;
    if ((st = tdm_xfer_create(&xc, &ep->x)) != TDM_OK) return st;
    /* context buffers (host) travel by the fabric's RMA; KV pages by the fabric too when they
     * are in host memory (or the provider registers GPU memory), else by CUDA IPC */
    ep->tp = tdm_xfer_fabric_transport(ep->x);
    const struct tdm_xfer_transport_i *tp = ep->tp.iface;
    tp->get_caps(ep->tp.t, &ep->caps);
    const bool dev = ep->kv.place.kind == TDM_MEM_DEVICE;
    enum tdm_xfer_mem_kind kind = dev ? TDM_XFER_MEM_CUDA : TDM_XFER_MEM_HOST;
    ep->kv_tp = ep->tp;
    /* device pages: by the fabric where it registers GPU memory (GPUDirect RDMA), else CUDA IPC */
    st = !dev || ep->caps.hmem_cuda
             ? tp->mr_reg(ep->tp.t, ep->kv.base, ep->kv.bytes, kind, &ep->kv_reg)
             : TDM_EUNSUPPORTED;
    if (dev && st == TDM_OK)
        TDM_INFO("disagg: KV pages on GPU %d move by %s RMA straight from GPU memory",
                 ep->kv.place.device, ep->caps.provider);
    if (dev && st != TDM_OK) {
        if (ep->caps.hmem_cuda) TDM_WARN("disagg: %s; KV pages take CUDA IPC", tdm_err_msg());
        struct tdm_xfer_ipc_config ic = {.device = ep->kv.place.device, .control = ep->x};
        if ((st = tdm_xfer_ipc_create(&ic, &ep->ipc)) != TDM_OK) {
            tdm_err_set(st,
                        "disagg: the KV pool is on GPU %d and the fabric (%s) cannot "
                        "register GPU memory, so pages move by CUDA IPC, which failed: %s",
                        ep->kv.place.device, ep->caps.provider, tdm_err_msg());
            goto out_xfer;
        }
        ep->kv_tp = tdm_xfer_ipc_transport(ep->ipc);
        TDM_INFO("disagg: KV pages on GPU %d move by CUDA IPC (nodes of this host; %s cannot "
                 "register GPU memory)",
                 ep->kv.place.device, ep->caps.provider);
        st = ep->kv_tp.iface->mr_reg(ep->kv_tp.t, ep->kv.base, ep->kv.bytes, kind, &ep->kv_reg);
    }
    const struct tdm_xfer_transport_i *ktp = ep->kv_tp.iface;
    if (st != TDM_OK) goto out_ipc;
    if ((st = tp->mr_reg(ep->tp.t, o->ctx_mem, o->ctx_bytes, TDM_XFER_MEM_HOST, &ep->ctx_reg)) !=
        TDM_OK)
        goto out_kv;
    if (ep->head.on && (st = ktp->mr_reg(ep->kv_tp.t, ep->head.base, ep->head.bytes, kind,
                                         &ep->head_reg)) != TDM_OK)
        goto out_ctx;
    return TDM_OK;

out_ctx:
    tp->mr_dereg(ep->tp.t, &ep->ctx_reg);
out_kv:
    ktp->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
out_ipc:
    tdm_xfer_ipc_destroy(ep->ipc);
out_xfer:
    tdm_xfer_destroy(ep->x);
    *ep = (struct disagg_endpoint){0};
    return st;
}

bool tdm_disagg_endpoint_kv_pairs(const struct disagg_endpoint *ep, uint32_t kind)
{
    if (ep->kv.place.kind != TDM_MEM_DEVICE) return kind == TDM_XFER_MEM_HOST;
    return ep->ipc ? kind == TDM_XFER_MEM_CUDA
                   : kind == TDM_XFER_MEM_CUDA || kind == TDM_XFER_MEM_HOST;
}

void tdm_disagg_endpoint_stop(struct disagg_endpoint *ep)
{
    if (ep->ipc) { /* its regions first (its contract), then its writes in flight */
        ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->head_reg);
        ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
        tdm_xfer_ipc_destroy(ep->ipc);
        ep->ipc = NULL;
    }
    tdm_xfer_destroy(ep->x);
}

void tdm_disagg_endpoint_release(struct disagg_endpoint *ep)
{
    if (!ep->tp.iface) return;
    /* zeroed regions (no head, or deregistered by stop) are no-ops */
    ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->head_reg);
    ep->tp.iface->mr_dereg(ep->tp.t, &ep->ctx_reg);
    ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
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
