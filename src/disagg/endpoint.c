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
#include <stdlib.h>

#include "disagg/disagg_int.h"
#include "tandem/spec.h"

/* The head's KV group in the pool, and its identity. */
static tdm_status head_open(struct disagg_head *h, tdm_kv_pool_t *kv, const struct tdm_model *m)
{
    struct tdm_kv_group g;
    const struct tdm_kv_config *kc = tdm_kv_pool_config(kv);
    if (!tdm_kv_pool_group(kv, 1, &g) || g.n_layers != m->cfg.n_layers ||
        g.n_kv_heads != m->cfg.n_kv_heads || g.head_dim != m->cfg.head_dim ||
        g.latent_v_dim != m->cfg.kv_lora_rank)
        return tdm_err_set(TDM_EINVAL, "disagg: the KV pool has no layer group for the "
                                       "speculation head (load it before the engine)");
    h->page_bytes = tdm_kv_group_page_bytes(kc, &g);
    h->layer_bytes = h->page_bytes * (size_t)kc->n_pages;
    h->bytes = h->layer_bytes * (size_t)g.n_layers;
    h->base = tdm_kv_pool_group_layer(kv, 1, 0).base;
    h->id = (struct tdm_disagg_head_req){
        .fingerprint = tdm_spec_head_fingerprint(m),
        .n_layers = (uint32_t)m->cfg.n_layers,
        .n_heads = (uint32_t)m->cfg.n_heads,
        .n_kv_heads = (uint32_t)m->cfg.n_kv_heads,
        .head_dim = (uint32_t)m->cfg.head_dim,
        .d_ff = (uint32_t)m->cfg.d_ff,
        .feature_width =
            (uint32_t)(m->head->feature_width > 0 ? m->head->feature_width : m->cfg.d_model)};
    h->on = true;
    return TDM_OK;
}

void tdm_disagg_head_describe(const struct tdm_disagg_head_req *h, char *buf, size_t cap)
{
    snprintf(buf, cap, "%016llx (%u layer%s, %u heads, %u kv heads of %u, d_ff %u)",
             (unsigned long long)h->fingerprint, h->n_layers, h->n_layers == 1 ? "" : "s",
             h->n_heads, h->n_kv_heads, h->head_dim, h->d_ff);
}

/* ---- host staging ---- */

static tdm_status landing_open(struct disagg_endpoint *ep, const struct disagg_endpoint_opts *o)
{
    struct disagg_landing *l = &ep->land;
    size_t n_layers = ep->kv.bytes / ep->kv.layer_bytes;
    size_t head_layers = ep->head.on ? ep->head.id.n_layers : 0;
    size_t per_page = n_layers * ep->kv.page_bytes + head_layers * ep->head.page_bytes;
    size_t pool_pages = ep->kv.layer_bytes / ep->kv.page_bytes;
    size_t ctx_pages = ((size_t)o->max_ctx + (size_t)o->page_size - 1) / (size_t)o->page_size;
    size_t n = o->xfer->staging_bytes ? o->xfer->staging_bytes / per_page : 4 * ctx_pages;
    if (n > pool_pages) n = pool_pages;
    if (n < 1 || n > INT32_MAX)
        return tdm_err_set(TDM_ERANGE,
                           "disagg: %zu bytes of host staging hold no landing page (a page of "
                           "every layer is %zu bytes)",
                           o->xfer->staging_bytes, per_page);
    if (n < ctx_pages)
        TDM_WARN("disagg: the host landing pages hold %zu tokens, less than a context of %d: "
                 "longer prompts staged from other hosts are prefilled here",
                 n * (size_t)o->page_size, o->max_ctx);
    l->n_pages = (int)n;
    l->layer_bytes = n * ep->kv.page_bytes;
    l->head_at = n_layers * l->layer_bytes;
    l->head_layer_bytes = n * ep->head.page_bytes;
    l->bytes = l->head_at + head_layers * l->head_layer_bytes;
    l->free_ids = malloc(n * sizeof *l->free_ids);
    l->base = ep->copier.iface->host_alloc(ep->copier.c, l->bytes);
    if (!l->free_ids || !l->base) {
        free(l->free_ids);
        if (l->base) ep->copier.iface->host_free(ep->copier.c, l->base, l->bytes);
        *l = (struct disagg_landing){0};
        return tdm_err_set(TDM_ENOMEM, "disagg: cannot allocate %zu MiB of host landing pages",
                           (size_t)(per_page * n) >> 20);
    }
    tdm_status st = ep->tp.iface->mr_reg(ep->tp.t, l->base, l->bytes, TDM_XFER_MEM_HOST, &l->reg);
    if (st != TDM_OK) {
        free(l->free_ids);
        ep->copier.iface->host_free(ep->copier.c, l->base, l->bytes);
        *l = (struct disagg_landing){0};
        return st;
    }
    for (int i = 0; i < l->n_pages; i++) /* popped from the top: page 0 first */
        l->free_ids[i] = l->n_pages - 1 - i;
    l->n_free = l->n_pages;
    ep->tp.iface->mr_remote(ep->tp.t, &l->reg, &l->rmem);
    l->head_rmem = l->rmem;
    l->rmem.bytes = l->head_at; /* the target's layers; the head's follow */
    l->head_rmem.addr += l->head_at;
    l->head_rmem.bytes -= l->head_at;
    l->on = true;
    TDM_INFO("disagg: %d host landing pages (%zu MiB, pinned, copied into the pool by %s) for "
             "prefill peers that cannot write the pool itself",
             l->n_pages, l->bytes >> 20, ep->copier.iface->name);
    return TDM_OK;
}

bool tdm_disagg_landing_take(struct disagg_landing *l, int n, int32_t *ids)
{
    if (!l->on || n > l->n_free) return false;
    for (int i = 0; i < n; i++)
        ids[i] = l->free_ids[--l->n_free];
    return true;
}

void tdm_disagg_landing_give(struct disagg_landing *l, int n, const int32_t *ids)
{
    for (int i = 0; i < n && l->n_free < l->n_pages; i++)
        l->free_ids[l->n_free++] = ids[i];
}

/* Everything host staging opened; safe on a partly opened or closed endpoint. */
static void staging_close(struct disagg_endpoint *ep)
{
    tdm_xfer_staged_destroy(ep->staged);
    ep->staged = NULL;
    ep->kv_sreg = ep->head_sreg = (struct tdm_xfer_region){0};
    if (ep->copier.iface) ep->copier.iface->drain(ep->copier.c); /* copies out of landing pages */
    if (ep->land.on) {
        ep->tp.iface->mr_dereg(ep->tp.t, &ep->land.reg);
        ep->copier.iface->host_free(ep->copier.c, ep->land.base, ep->land.bytes);
        free(ep->land.free_ids);
    }
    ep->land = (struct disagg_landing){0};
    tdm_xfer_copier_destroy(&ep->copier);
}

static tdm_status staging_open(struct disagg_endpoint *ep, const struct disagg_endpoint_opts *o,
                               bool dev)
{
    tdm_status st = dev ? tdm_xfer_copier_cuda(ep->kv.place.device, &ep->copier)
                        : tdm_xfer_copier_host(&ep->copier);
    if (st != TDM_OK) return st;
    if (o->landing) {
        st = landing_open(ep, o);
    } else {
        struct tdm_xfer_staged_config sc = {
            .fabric = ep->tp, .copier = ep->copier, .ring_bytes = o->xfer->staging_bytes};
        enum tdm_xfer_mem_kind kind = dev ? TDM_XFER_MEM_CUDA : TDM_XFER_MEM_HOST;
        if ((st = tdm_xfer_staged_create(&sc, &ep->staged)) == TDM_OK) {
            ep->stage_tp = tdm_xfer_staged_transport(ep->staged);
            st = ep->stage_tp.iface->mr_reg(ep->stage_tp.t, ep->kv.base, ep->kv.bytes, kind,
                                            &ep->kv_sreg);
            if (st == TDM_OK && ep->head.on)
                st = ep->stage_tp.iface->mr_reg(ep->stage_tp.t, ep->head.base, ep->head.bytes, kind,
                                                &ep->head_sreg);
        }
        if (st == TDM_OK) {
            struct tdm_xfer_staged_stats ss;
            tdm_xfer_staged_get_stats(ep->staged, &ss);
            TDM_INFO("disagg: KV pages to decoders that lend host landing pages go through a "
                     "%llu KiB pinned staging ring (copies by %s, writes by %s)",
                     (unsigned long long)(ss.ring_bytes >> 10), ep->copier.iface->name,
                     ep->caps.provider);
        }
    }
    if (st != TDM_OK) staging_close(ep);
    return st;
}

tdm_status tdm_disagg_endpoint_open(struct disagg_endpoint *ep,
                                    const struct disagg_endpoint_opts *o)
{
    *ep = (struct disagg_endpoint){.kv = tdm_kv_pool_geometry(o->kv), .staging = o->xfer->staging};
    struct tdm_xfer_config xc;
    tdm_xfer_config_default(&xc);
    if (o->xfer->provider) xc.provider = o->xfer->provider;
    xc.node = o->xfer->node;
    if (o->xfer->peer_timeout_ms > 0) xc.peer_timeout_ms = o->xfer->peer_timeout_ms;
    xc.fabric_key = o->xfer->fabric_key;
    xc.fabric_key_bytes = o->xfer->fabric_key_bytes;
    xc.busy_poll = o->xfer->busy_poll;
    tdm_status st;
    ep->n_ranks = o->n_ranks > 1 ? o->n_ranks : 1;
    ep->rank_kv[0] = ep->kv;
    if (ep->n_ranks > 1) {
        if (ep->n_ranks > TDM_DISAGG_MAX_RANKS)
            return tdm_err_set(TDM_ERANGE,
                               "disagg: --tp %d: sharded transfers take at most %d ranks",
                               ep->n_ranks, TDM_DISAGG_MAX_RANKS);
        if (ep->kv.place.kind == TDM_MEM_DEVICE || ep->staging == TDM_DISAGG_STAGING_ALWAYS)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "disagg: --tp %d: sharded KV transfers move host pools by the "
                               "fabric (GPU pools and --kv-staging always are not supported "
                               "sharded yet)",
                               ep->n_ranks);
        for (int r = 1; r < ep->n_ranks; r++)
            ep->rank_kv[r] = tdm_kv_pool_geometry(o->rank_kv[r]);
    }
    if (o->head && (st = head_open(&ep->head, o->kv, o->head)) != TDM_OK) return st;
    int max_pages = (o->max_ctx + o->page_size - 1) / o->page_size;
    size_t msg = tdm_disagg_prefill_msg_size((uint32_t)o->max_ctx, (uint32_t)max_pages, true, true,
                                             TDM_DISAGG_MAX_RANKS);
    if ((size_t)xc.ctrl_bytes < msg) xc.ctrl_bytes = (int)msg;
    if (xc.max_jobs < o->min_jobs) xc.max_jobs = o->min_jobs;
    xc.on_msg = o->on_msg;
    xc.on_msg_ctx = o->ctx;
    xc.on_peer = o->on_peer;
    xc.on_peer_ctx = o->ctx;
    if (o->xfer->n_nics > 1) { /* a rail set: one endpoint per NIC, writes spread over them */
        struct tdm_xfer_rails_config rc = {.base = xc, .n_rails = o->xfer->n_nics};
        for (int r = 0; r < o->xfer->n_nics && r < TDM_XFER_MAX_RAILS; r++)
            rc.nics[r] = o->xfer->nics[r];
        if ((st = tdm_xfer_rails_create(&rc, &ep->rails)) != TDM_OK) return st;
        ep->x = tdm_xfer_rails_control(ep->rails);
        ep->tp = tdm_xfer_rails_transport(ep->rails);
        for (int r = 0; r < o->xfer->n_nics; r++) {
            struct tdm_xfer_rail_stats rs;
            tdm_xfer_rails_get_stats(ep->rails, r, &rs);
            TDM_INFO("disagg: rail %d on NIC %s (%s)", r, rs.nic[0] ? rs.nic : "default", rs.addr);
        }
    } else {
        char node[64], domain[64];
        if (o->xfer->n_nics == 1) { /* one NIC named: the endpoint's node (or domain) */
            tdm_xfer_nic_resolve(o->xfer->nics[0], node, sizeof node, domain, sizeof domain);
            if (node[0] || domain[0]) {
                xc.node = node[0] ? node : NULL;
                xc.domain = domain[0] ? domain : NULL;
            }
        }
        if ((st = tdm_xfer_create(&xc, &ep->x)) != TDM_OK) return st;
        ep->tp = tdm_xfer_fabric_transport(ep->x);
    }
    /* context buffers (host) travel by the fabric's RMA; KV pages by the fabric too when they
     * are in host memory (or the provider registers GPU memory), else by CUDA IPC to nodes of
     * this host and through host staging to others */
    const struct tdm_xfer_transport_i *tp = ep->tp.iface;
    tp->get_caps(ep->tp.t, &ep->caps);
    const bool dev = ep->kv.place.kind == TDM_MEM_DEVICE;
    const bool stage_ok = ep->staging != TDM_DISAGG_STAGING_OFF;
    enum tdm_xfer_mem_kind kind = dev ? TDM_XFER_MEM_CUDA : TDM_XFER_MEM_HOST;
    ep->kv_tp = ep->tp;
    /* device pages: by the fabric where it registers GPU memory (GPUDirect RDMA), else CUDA IPC */
    st = !dev || ep->caps.hmem_cuda
             ? tp->mr_reg(ep->tp.t, ep->kv.base, ep->kv.bytes, kind, &ep->kv_reg)
             : TDM_EUNSUPPORTED;
    if (dev && st == TDM_OK)
        TDM_INFO("disagg: KV pages on GPU %d move by %s RMA straight from GPU memory",
                 ep->kv.place.device, ep->caps.provider);
    if (!dev && st != TDM_OK) goto out_xfer;
    if (dev && st != TDM_OK) {
        if (ep->caps.hmem_cuda) TDM_WARN("disagg: %s; KV pages take CUDA IPC", tdm_err_msg());
        struct tdm_xfer_ipc_config ic = {.device = ep->kv.place.device, .control = ep->x};
        if ((st = tdm_xfer_ipc_create(&ic, &ep->ipc)) == TDM_OK) {
            ep->kv_tp = tdm_xfer_ipc_transport(ep->ipc);
            TDM_INFO("disagg: KV pages on GPU %d move by CUDA IPC to nodes of this host (%s "
                     "cannot register GPU memory)%s",
                     ep->kv.place.device, ep->caps.provider,
                     stage_ok ? ", and through pinned host staging to other hosts" : "");
            st = ep->kv_tp.iface->mr_reg(ep->kv_tp.t, ep->kv.base, ep->kv.bytes, kind, &ep->kv_reg);
        }
        if (st != TDM_OK && !stage_ok) {
            tdm_err_set(st,
                        "disagg: the KV pool is on GPU %d and the fabric (%s) cannot register "
                        "GPU memory, so pages move by CUDA IPC, which failed: %s (and "
                        "--kv-staging off forbids host staging)",
                        ep->kv.place.device, ep->caps.provider, tdm_err_msg());
            goto out_ipc;
        }
        if (st != TDM_OK) {
            TDM_WARN("disagg: CUDA IPC is not available (%s); KV pages cross through host "
                     "staging only",
                     tdm_err_msg());
            tdm_xfer_ipc_destroy(ep->ipc);
            ep->ipc = NULL;
            ep->kv_tp = ep->tp;
        }
    }
    ep->kv_direct = st == TDM_OK;
    const struct tdm_xfer_transport_i *ktp = ep->kv_tp.iface;
    /* host staging: forced, or for a GPU pool the fabric cannot register */
    bool want_staging = ep->staging == TDM_DISAGG_STAGING_ALWAYS ||
                        (stage_ok && dev && (ep->ipc || !ep->kv_direct));
    if (want_staging && (st = staging_open(ep, o, dev)) != TDM_OK) {
        if (ep->staging == TDM_DISAGG_STAGING_ALWAYS || !ep->kv_direct) {
            tdm_err_set(st, "disagg: host staging: %s", tdm_err_msg());
            goto out_kv;
        }
        TDM_WARN("disagg: no host staging (%s): only nodes of this host can exchange KV pages "
                 "with this one",
                 tdm_err_msg());
    }
    for (int r = 1; r < ep->n_ranks; r++) /* host pools (checked above): by the fabric */
        if ((st = ktp->mr_reg(ep->kv_tp.t, ep->rank_kv[r].base, ep->rank_kv[r].bytes,
                              TDM_XFER_MEM_HOST, &ep->rank_reg[r])) != TDM_OK)
            goto out_ranks;
    if ((st = tp->mr_reg(ep->tp.t, o->ctx_mem, o->ctx_bytes, TDM_XFER_MEM_HOST, &ep->ctx_reg)) !=
        TDM_OK)
        goto out_ranks;
    if (ep->head.on && ep->kv_direct &&
        (st = ktp->mr_reg(ep->kv_tp.t, ep->head.base, ep->head.bytes, kind, &ep->head_reg)) !=
            TDM_OK)
        goto out_ctx;
    return TDM_OK;

out_ctx:
    tp->mr_dereg(ep->tp.t, &ep->ctx_reg);
out_ranks:
    for (int r = 1; r < ep->n_ranks; r++)
        ktp->mr_dereg(ep->kv_tp.t, &ep->rank_reg[r]); /* a zeroed region is a no-op */
    staging_close(ep);
out_kv:
    ktp->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
out_ipc:
    tdm_xfer_ipc_destroy(ep->ipc);
out_xfer:
    if (ep->rails)
        tdm_xfer_rails_destroy(ep->rails);
    else
        tdm_xfer_destroy(ep->x);
    *ep = (struct disagg_endpoint){0};
    return st;
}

bool tdm_disagg_endpoint_kv_route(const struct disagg_endpoint *ep, uint32_t kind,
                                  struct disagg_route *out)
{
    const bool dev = ep->kv.place.kind == TDM_MEM_DEVICE;
    if (kind == TDM_XFER_MEM_CUDA) { /* CUDA IPC, or a fabric that registers GPU memory */
        if (!dev || !ep->kv_direct) return false;
        *out = (struct disagg_route){ep->kv_tp, &ep->kv_reg, &ep->head_reg, ep->kv_tp.iface->name};
        return true;
    }
    if (kind != TDM_XFER_MEM_HOST) return false;
    /* the fabric reaches host destinations from a host pool, or a GPU pool it registered */
    bool direct = ep->kv_direct && !ep->ipc;
    if (ep->staged && (!direct || ep->staging == TDM_DISAGG_STAGING_ALWAYS)) {
        *out = (struct disagg_route){ep->stage_tp, &ep->kv_sreg, &ep->head_sreg,
                                     "pinned host staging"};
        return true;
    }
    if (!direct) return false;
    *out = (struct disagg_route){ep->kv_tp, &ep->kv_reg, &ep->head_reg, ep->kv_tp.iface->name};
    return true;
}

void tdm_disagg_endpoint_stop(struct disagg_endpoint *ep)
{
    if (ep->ipc) { /* its regions first (its contract), then its writes in flight */
        ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->head_reg);
        ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
        tdm_xfer_ipc_destroy(ep->ipc);
        ep->ipc = NULL;
    }
    /* the staged writer's pieces complete on the engine's thread: before the engine goes */
    tdm_xfer_staged_destroy(ep->staged);
    ep->staged = NULL;
    if (ep->copier.iface) ep->copier.iface->drain(ep->copier.c); /* landing copies */
    /* the landing pages' registration goes while the domain is open (release frees them) */
    if (ep->land.on) ep->tp.iface->mr_dereg(ep->tp.t, &ep->land.reg);
    if (ep->rails) { /* as one engine: its regions go in release (they outlive the set) */
        tdm_xfer_rails_destroy(ep->rails);
        ep->rails = NULL;
    } else {
        tdm_xfer_destroy(ep->x);
    }
}

void tdm_disagg_endpoint_release(struct disagg_endpoint *ep)
{
    if (!ep->tp.iface) return;
    /* zeroed regions (no head, or deregistered by stop) are no-ops */
    ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->head_reg);
    ep->tp.iface->mr_dereg(ep->tp.t, &ep->ctx_reg);
    ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->kv_reg);
    for (int r = 1; r < ep->n_ranks; r++)
        ep->kv_tp.iface->mr_dereg(ep->kv_tp.t, &ep->rank_reg[r]);
    staging_close(ep);
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
    tdm_prom_family(b, "tandem_fabric_backpressure_total", "counter",
                    "Transfer back-pressure: posts the provider refused (-FI_EAGAIN, retried "
                    "after progress) and writes refused with TDM_EAGAIN (pools full).");
    tdm_prom_sample(b, "tandem_fabric_backpressure_total", "kind=\"provider_eagain\"",
                    (double)xs.eagain_retries);
    tdm_prom_sample(b, "tandem_fabric_backpressure_total", "kind=\"refused\"",
                    (double)xs.writes_refused);
    if (ep->rails) {
        static const struct {
            const char *name, *type, *help;
        } fam[] = {
            {"tandem_xfer_rail_writes_total", "counter",
             "KV writes (paged and single) posted on each rail (NIC), spread round-robin."},
            {"tandem_xfer_rail_bytes_total", "counter", "Bytes of the KV writes on each rail."},
            {"tandem_xfer_rail_immediates_total", "counter",
             "Immediates that arrived by each rail (all counted in one table)."},
            {"tandem_xfer_rail_fallbacks_total", "counter",
             "Writes a rail refused as its peer had died, sent on rail 0 instead."},
            {"tandem_xfer_rail_peers_up", "gauge", "Peers each rail is paired with and alive."},
        };
        const int n = tdm_xfer_rails_count(ep->rails);
        struct tdm_xfer_rail_stats rs[TDM_XFER_MAX_RAILS];
        for (int r = 0; r < n; r++)
            tdm_xfer_rails_get_stats(ep->rails, r, &rs[r]);
        for (size_t f = 0; f < TDM_ARRAY_LEN(fam); f++) {
            tdm_prom_family(b, fam[f].name, fam[f].type, fam[f].help);
            for (int r = 0; r < n; r++) {
                char lab[128], nic[64];
                snprintf(nic, sizeof nic, "%.63s", rs[r].nic[0] ? rs[r].nic : "default");
                for (char *c = nic; *c; c++) /* a label value: no quote, backslash or newline */
                    if (*c == '"' || *c == '\\' || *c == '\n') *c = '_';
                snprintf(lab, sizeof lab, "rail=\"%d\",nic=\"%s\"", r, nic);
                const double v[] = {(double)rs[r].writes, (double)rs[r].bytes,
                                    (double)rs[r].imm_received, (double)rs[r].fallbacks,
                                    (double)rs[r].peers_up};
                tdm_prom_sample(b, fam[f].name, lab, v[f]);
            }
        }
    }
    if (!ep->staged) return;
    struct tdm_xfer_staged_stats ss;
    tdm_xfer_staged_get_stats(ep->staged, &ss);
    tdm_prom_scalar(b, "tandem_disagg_staging_ring_bytes", "gauge",
                    "Size of the pinned host staging ring (KV pages to other hosts).", NULL,
                    (double)ss.ring_bytes);
    tdm_prom_scalar(b, "tandem_disagg_staging_ring_used_bytes", "gauge",
                    "Staging ring bytes held by writes being copied or on the wire.", NULL,
                    (double)ss.ring_used);
    tdm_prom_scalar(b, "tandem_disagg_staging_ring_high_bytes", "gauge",
                    "The most staging ring bytes ever held at once.", NULL, (double)ss.ring_high);
    tdm_prom_scalar(b, "tandem_disagg_staging_ring_full_total", "counter",
                    "Staged writes refused for want of ring space (back-pressure; retried).", NULL,
                    (double)ss.ring_full);
    tdm_prom_family(b, "tandem_disagg_staged_writes_total", "counter",
                    "Paged writes through host staging, by result.");
    tdm_prom_sample(b, "tandem_disagg_staged_writes_total", "result=\"ok\"", (double)ss.writes);
    tdm_prom_sample(b, "tandem_disagg_staged_writes_total", "result=\"failed\"", (double)ss.failed);
    tdm_prom_scalar(b, "tandem_disagg_staged_pieces_total", "counter",
                    "Fabric writes out of the staging ring (a paged write larger than a quarter "
                    "of the ring takes several).",
                    NULL, (double)ss.pieces);
    tdm_prom_scalar(b, "tandem_disagg_staged_bytes_total", "counter",
                    "Bytes of paged writes completed through host staging.", NULL,
                    (double)ss.bytes);
    tdm_prom_scalar(b, "tandem_disagg_staging_copy_seconds_total", "counter",
                    "Time copies into the staging ring took, summed.", NULL,
                    (double)ss.copy_ns * 1e-9);
}
