/*
 * The libfabric transport's setup and teardown: provider discovery and the fabric, domain,
 * endpoint, CQ and AV (open_fabric), the engine's create and destroy, its address, caps and
 * stats, and memory regions. Called from user threads; create starts the progress thread and
 * destroy joins it.
 */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "xfer/fabric/fabric_int.h"

void tdm_xfer_config_default(struct tdm_xfer_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->provider = "tcp;ofi_rxm";
    cfg->op_timeout_ms = 10000;
    cfg->heartbeat_ms = 200;
    cfg->peer_timeout_ms = 2000;
    cfg->max_jobs = 1024;
    cfg->max_ops = 256;
    cfg->window_writes = 16;
    cfg->window_pages = 64;
    cfg->ctrl_bytes = 8192;
    cfg->ctrl_rx_depth = 64;
    cfg->max_peers = 64;
    cfg->max_slots = 4096;
    cfg->max_pages_per_write = 65536;
}

static tdm_status open_fabric(tdm_xfer_t *x)
{
    const struct tdm_fi_api *fi = tdm_fi_api();
    if (!fi) return TDM_EUNSUPPORTED;          /* tdm_fi_api said why */
    struct fi_info *hints = fi->dupinfo(NULL); /* fi_allocinfo */
    if (!hints) return tdm_err_set(TDM_ENOMEM, "xfer: fi_allocinfo failed");
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->fabric_attr->prov_name = strdup(x->provider_name);
    const char *node = x->node[0] ? x->node : NULL;
    uint64_t flags = node ? FI_SOURCE : 0;
    int rc = -FI_ENODATA;
    /* GPU memory registration (FI_HMEM: GPUDirect RDMA) is asked for first from the RDMA
     * providers (verbs, efa), so device pages need no staging where the provider can; one
     * without it answers the plain request. Not from shm and tcp: Debian's build of them claims
     * FI_HMEM with no CUDA behind it, and their host data path is what we measured. A claim is
     * only a claim: a registration of GPU memory that fails is TDM_EUNSUPPORTED, and the caller
     * moves device pages another way. $TANDEM_XFER_HMEM=1 asks any provider, =0 none. */
    const char *hm = getenv("TANDEM_XFER_HMEM");
    const bool rdma = strstr(x->provider_name, "verbs") || strstr(x->provider_name, "efa");
    const bool ask = hm && *hm ? !strcmp(hm, "1") : rdma;
    for (int hmem = ask; hmem >= 0 && rc; hmem--) {
        hints->caps = FI_MSG | FI_RMA | (hmem ? FI_HMEM : 0);
        hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                      FI_MR_PROV_KEY | FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
        /* Writes must be visible before the immediate that follows them. First we ask for
         * write-after-write ordering (FI_ORDER_WAW; shm grants it only when asked): granted
         * without a size limit, the immediate is posted right behind its data. Else we ask for
         * fenced writes (FI_FENCE: the provider defers the immediate until the earlier writes
         * completed). Else delivery-complete writes, and the immediate write is posted after
         * the others complete (a drain per paged write), falling back to the provider's
         * default. $TANDEM_XFER_ORDER=fence or =drain skips the stronger modes (tests). */
        const char *om = getenv("TANDEM_XFER_ORDER");
        int first = om && !strcmp(om, "drain")   ? ORDER_DRAIN
                    : om && !strcmp(om, "fence") ? ORDER_FENCE
                                                 : ORDER_WAW;
        uint64_t base_caps = hints->caps;
        rc = -FI_ENODATA;
        for (int mode = first; mode <= ORDER_DRAIN && rc; mode++) {
            if (x->info) fi->freeinfo(x->info);
            x->info = NULL;
            hints->caps = base_caps | (mode == ORDER_FENCE ? FI_FENCE : 0);
            hints->tx_attr->msg_order = mode == ORDER_WAW ? FI_ORDER_WAW : 0;
            hints->tx_attr->op_flags = mode == ORDER_DRAIN ? FI_DELIVERY_COMPLETE : 0;
            rc = fi->getinfo(FI_VERSION(1, 17), node, NULL, flags, hints, &x->info);
            if (rc == 0 && mode == ORDER_WAW &&
                (!(x->info->tx_attr->msg_order & FI_ORDER_WAW) ||
                 x->info->ep_attr->max_order_waw_size < (1ull << 30)))
                rc = -FI_ENODATA;            /* ordered only up to a size: not enough */
            if (rc && mode == ORDER_DRAIN) { /* no delivery-complete: the default */
                hints->tx_attr->op_flags = 0;
                rc = fi->getinfo(FI_VERSION(1, 17), node, NULL, flags, hints, &x->info);
            }
            x->order = (enum order_mode)mode;
        }
        x->ordered_writes = rc == 0 && x->order == ORDER_WAW;
    }
    fi->freeinfo(hints);
    if (rc)
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer: no provider '%s'%s%s: %s", x->provider_name,
                           node ? " on " : "", node ? node : "", fi_msg(rc));
    if (x->domain_name[0]) { /* one NIC of several (a rail): the first domain named after it */
        struct fi_info *hit = NULL;
        for (struct fi_info *i = x->info; i && !hit; i = i->next)
            if (i->domain_attr && i->domain_attr->name &&
                !strncmp(i->domain_attr->name, x->domain_name, strlen(x->domain_name)))
                hit = i;
        if (!hit)
            return tdm_err_set(TDM_EUNSUPPORTED, "xfer: provider '%s' offers no domain '%s'",
                               x->provider_name, x->domain_name);
        struct fi_info *one = fi->dupinfo(hit);
        if (!one) return tdm_err_set(TDM_ENOMEM, "xfer: fi_dupinfo failed");
        fi->freeinfo(x->info);
        x->info = one;
    }
    struct fi_info *info = x->info;
    x->caps.delivery_complete = (info->tx_attr->op_flags & FI_DELIVERY_COMPLETE) != 0;
    x->caps.ordered_writes = x->ordered_writes;
    x->caps.mr_mode = (uint64_t)info->domain_attr->mr_mode;
    x->caps.imm_bits = info->domain_attr->cq_data_size >= 8 ? 64 : 32;
    x->caps.hmem_cuda = (info->caps & FI_HMEM) != 0;
    x->caps.max_write_bytes = info->ep_attr->max_msg_size;
    if (x->caps.max_write_bytes == 0 || x->caps.max_write_bytes > (1ull << 30))
        x->caps.max_write_bytes = 1ull << 30;
    if (info->domain_attr->cq_data_size < 4) {
        return tdm_err_set(TDM_EUNSUPPORTED, "xfer: provider %s carries %zu bytes of cq data",
                           info->fabric_attr->prov_name, info->domain_attr->cq_data_size);
    }
    snprintf(x->caps.provider, sizeof(x->caps.provider), "%s", info->fabric_attr->prov_name);
    x->caps.max_slot = x->caps.imm_bits == 64 ? (1u << 24) - 1 : (1u << 12) - 1;
    x->caps.max_epoch = x->caps.imm_bits == 64 ? (1u << 16) - 1 : (1u << 8) - 1;
    x->caps.max_index = x->caps.max_slot;

    /* the op pool: the configured window of paged writes really in flight together, and at
     * least what the provider queues (tx_attr->size); plus the reserve for heartbeats and the
     * message buffers' sends */
    int64_t want = (int64_t)x->cfg.window_writes * x->cfg.window_pages + OPS_RESERVED + N_TX_BUFS;
    want = TDM_MAX(want, (int64_t)x->cfg.max_ops);
    want = TDM_MAX(want, (int64_t)TDM_MIN(info->tx_attr->size, (size_t)1 << 16));
    x->n_tx_ops = (int)TDM_MIN(want, (int64_t)(1 << 20));
    x->n_ops = x->n_tx_ops + x->cfg.ctrl_rx_depth;

    if ((rc = fi->fabric(info->fabric_attr, &x->fabric, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_fabric: %s", fi_msg(rc));
    if ((rc = fi_domain(x->fabric, info, &x->domain, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_domain: %s", fi_msg(rc));
    struct fi_av_attr av_attr = {.type = FI_AV_UNSPEC, .count = (size_t)x->cfg.max_peers};
    if ((rc = fi_av_open(x->domain, &av_attr, &x->av, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_av_open: %s", fi_msg(rc));
    /* a CQ with a file descriptor to sleep on (progress.c), where the provider has one and the
     * thread may sleep at all (a wake eventfd, no busy_poll); else one that is only polled
     * ($TANDEM_XFER_WAIT=poll forces it) */
    const char *wm = getenv("TANDEM_XFER_WAIT");
    bool want_fd = x->wake_fd >= 0 && !x->cfg.busy_poll && !(wm && !strcmp(wm, "poll"));
    struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA,
                                 .size = (size_t)(x->n_ops + 64),
                                 .wait_obj = want_fd ? FI_WAIT_FD : FI_WAIT_NONE};
    if (want_fd && fi_cq_open(x->domain, &cq_attr, &x->cq, NULL) != 0)
        cq_attr.wait_obj = FI_WAIT_NONE; /* the provider has no such wait object */
    if (cq_attr.wait_obj == FI_WAIT_NONE && (rc = fi_cq_open(x->domain, &cq_attr, &x->cq, NULL)))
        return tdm_err_set(TDM_EIO, "xfer: fi_cq_open: %s", fi_msg(rc));
    int fd = -1;
    if (cq_attr.wait_obj == FI_WAIT_FD && fi_control(&x->cq->fid, FI_GETWAIT, &fd) == 0 &&
        fd >= 0) {
        x->wait_fd = fd;
        x->caps.cq_wait = true;
    } else if (want_fd) {
        TDM_DEBUG("xfer: %s gives no CQ file descriptor: the progress thread polls",
                  info->fabric_attr->prov_name);
    }
    /* shm names an endpoint's region after the process and a per-process endpoint count, and a
     * name still held (a region another endpoint has not yet released) makes fi_enable answer
     * EBUSY: a new endpoint takes the next name, so try a few */
    for (int attempt = 0;; attempt++) {
        if ((rc = fi_endpoint(x->domain, info, &x->ep, NULL)))
            return tdm_err_set(TDM_EIO, "xfer: fi_endpoint: %s", fi_msg(rc));
        if ((rc = fi_ep_bind(x->ep, &x->av->fid, 0)) ||
            (rc = fi_ep_bind(x->ep, &x->cq->fid, FI_TRANSMIT | FI_RECV)))
            return tdm_err_set(TDM_EIO, "xfer: fi_ep_bind: %s", fi_msg(rc));
        if (!(rc = fi_enable(x->ep))) break;
        if (rc != -FI_EBUSY || attempt == 4)
            return tdm_err_set(TDM_EIO, "xfer: fi_enable: %s", fi_msg(rc));
        fi_close(&x->ep->fid);
        x->ep = NULL;
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
    }
    size_t len = sizeof(x->my_addr);
    if ((rc = fi_getname(&x->ep->fid, x->my_addr, &len)))
        return tdm_err_set(TDM_EIO, "xfer: fi_getname: %s", fi_msg(rc));
    x->my_addr_bytes = len;
    return TDM_OK;
}

/* Registers [base, base + bytes): host memory, or GPU memory (kind CUDA, on a provider with
 * FI_HMEM) through fi_mr_regattr naming the CUDA interface and the device that holds it. */
static tdm_status reg_raw(tdm_xfer_t *x, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                          struct fid_mr **mr, uint64_t *key, void **desc)
{
    int device = 0;
    if (kind == TDM_XFER_MEM_CUDA) {
        if (tdm_xfer_cuda_device_of(base, &device) != TDM_OK)
            return tdm_err_set(TDM_EUNSUPPORTED, "xfer: GPU memory registration: %s",
                               tdm_err_msg());
    }
    uint64_t access = FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
    /* a key we choose is random (a guessed key is a way in; the provider's own keys, under
     * FI_MR_PROV_KEY, are the provider's business), within the provider's key size; a
     * collision with a key in use is retried */
    size_t key_size = x->info->domain_attr->mr_key_size;
    uint64_t mask = key_size >= 8 ? ~0ull : key_size ? (1ull << (8 * key_size)) - 1 : 0xffffull;
    int rc = -FI_ENOKEY;
    for (int tries = 0; tries < 8 && rc == -FI_ENOKEY; tries++) {
        uint64_t requested;
        if (!tdm_xfer_random(&requested, sizeof requested)) {
            pthread_mutex_lock(&x->mu);
            requested = x->next_key++;
            pthread_mutex_unlock(&x->mu);
        }
        requested &= mask;
        if (kind == TDM_XFER_MEM_CUDA) {
            struct iovec iov = {.iov_base = base, .iov_len = bytes};
            struct fi_mr_attr attr = {.mr_iov = &iov,
                                      .iov_count = 1,
                                      .access = access,
                                      .requested_key = requested,
                                      .iface = FI_HMEM_CUDA};
            attr.device.cuda = device;
            rc = fi_mr_regattr(x->domain, &attr, 0, mr);
            if (rc && rc != -FI_ENOKEY)
                return tdm_err_set(TDM_EUNSUPPORTED,
                                   "xfer: provider %s claims FI_HMEM but cannot register GPU "
                                   "memory: %s",
                                   x->caps.provider, fi_msg(rc));
        } else {
            rc = fi_mr_reg(x->domain, base, bytes, access, 0, requested, 0, mr, NULL);
        }
    }
    if (rc) return tdm_err_set(TDM_EIO, "xfer: fi_mr_reg of %zu bytes: %s", bytes, fi_msg(rc));
    if (x->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        if ((rc = fi_mr_bind(*mr, &x->ep->fid, 0)) || (rc = fi_mr_enable(*mr))) {
            fi_close(&(*mr)->fid);
            return tdm_err_set(TDM_EIO, "xfer: binding a region to the endpoint: %s", fi_msg(rc));
        }
    }
    *key = fi_mr_key(*mr);
    *desc = fi_mr_desc(*mr);
    return TDM_OK;
}

/* shm inside one process. libfabric's shm maps a peer endpoint of the same process by pointer
 * (its own region), so an engine whose peer is another engine of this process reads and writes
 * that peer's region: a heartbeat, a hello, a queued message's progress. Closing the peer's
 * endpoint while this engine lives left it touching unmapped memory (seen: a progress thread's
 * fi_cq_read faulting on the closed peer's lock, under load, when `tandem bench xfer` or a test
 * destroyed the first of its two engines). So the libfabric objects of an shm engine, and the
 * buffers and contexts its posted receives hold, outlive it while other shm engines of the process
 * live, and are closed with the last one; what is parked is never progressed again (its peers
 * see it fall silent and declare it dead). A process with one engine per node closes at once. */
struct shm_parked {
    struct fid_ep *ep;
    struct fid_mr *bufs_mr;
    struct fid_av *av;
    struct fid_cq *cq;
    struct fid_domain *domain;
    struct fid_fabric *fabric;
    struct fi_info *info;
    void *bufs;
    void *ops; /* the posted receives' contexts (FI_CONTEXT: the provider's to use) */
    struct shm_parked *next;
};
static pthread_mutex_t shm_mu = PTHREAD_MUTEX_INITIALIZER;
static int shm_live;                  /* shm engines of this process not yet destroyed */
static struct shm_parked *shm_parked; /* destroyed ones' objects, closed with the last */

static bool is_shm(const tdm_xfer_t *x)
{
    return x->info && x->info->fabric_attr && x->info->fabric_attr->prov_name &&
           !strcmp(x->info->fabric_attr->prov_name, "shm");
}

/* Closes what the provider holds of an engine, and frees the memory it points into. */
static void provider_close(struct shm_parked *o)
{
    if (o->ep) fi_close(&o->ep->fid);
    if (o->bufs_mr) fi_close(&o->bufs_mr->fid);
    if (o->av) fi_close(&o->av->fid);
    if (o->cq) fi_close(&o->cq->fid);
    if (o->domain) fi_close(&o->domain->fid);
    if (o->fabric) fi_close(&o->fabric->fid);
    if (o->info) tdm_fi_api()->freeinfo(o->info); /* opened: it made o->info */
    tdm_free_aligned(o->bufs);
    free(o->ops);
}

/* Closes x's libfabric objects and frees its bufs and ops, or parks them all (above). */
static void close_or_park(tdm_xfer_t *x)
{
    struct shm_parked own = {x->ep,     x->bufs_mr, x->av,   x->cq,  x->domain,
                             x->fabric, x->info,    x->bufs, x->ops, NULL};
    x->bufs = NULL;
    x->ops = NULL;
    struct shm_parked *go = NULL;
    if (x->shm_counted) {
        pthread_mutex_lock(&shm_mu);
        struct shm_parked *p = --shm_live > 0 ? malloc(sizeof *p) : NULL;
        if (p) { /* others live: park (out of memory: close, as before) */
            *p = own;
            p->next = shm_parked;
            shm_parked = p;
            pthread_mutex_unlock(&shm_mu);
            return;
        }
        if (!shm_live) { /* the last: the parked go too */
            go = shm_parked;
            shm_parked = NULL;
        }
        pthread_mutex_unlock(&shm_mu);
    }
    provider_close(&own);
    while (go) {
        struct shm_parked *next = go->next;
        provider_close(go);
        free(go);
        go = next;
    }
}

tdm_status tdm_xfer_create(const struct tdm_xfer_config *cfg_in, tdm_xfer_t **out)
{
    return tdm_xfer_create_hooked(cfg_in, NULL, out);
}

tdm_status tdm_xfer_create_hooked(const struct tdm_xfer_config *cfg_in,
                                  const struct tdm_xfer_rail_hook *hook, tdm_xfer_t **out)
{
    struct tdm_xfer_config cfg;
    tdm_xfer_config_default(&cfg);
    if (cfg_in) cfg = *cfg_in;
    if (!cfg.provider || strlen(cfg.provider) >= 64 || (cfg.node && strlen(cfg.node) >= 64) ||
        (cfg.domain && strlen(cfg.domain) >= 64))
        return tdm_err_set(TDM_EINVAL, "xfer: bad provider, node or domain");
    if (cfg.op_timeout_ms <= 0 || cfg.heartbeat_ms < 0 || cfg.peer_timeout_ms < 0 ||
        cfg.max_jobs <= 0 || cfg.max_jobs > (1 << 20) || cfg.max_ops <= OPS_RESERVED ||
        cfg.max_ops > (1 << 16) || cfg.ctrl_bytes <= 0 || cfg.ctrl_bytes > (1 << 20) ||
        cfg.ctrl_rx_depth <= 0 || cfg.ctrl_rx_depth > 4096 || cfg.max_peers <= 0 ||
        cfg.max_peers > 4096 || cfg.max_slots <= 0 || cfg.max_pages_per_write <= 0 ||
        cfg.max_pages_per_write > (1 << 24) || cfg.window_writes < 0 || cfg.window_writes > 4096 ||
        cfg.window_pages < 0 || cfg.window_pages > 65536)
        return tdm_err_set(TDM_EINVAL, "xfer: configuration value out of range");
    if (cfg.heartbeat_ms && cfg.peer_timeout_ms && cfg.peer_timeout_ms <= 2 * cfg.heartbeat_ms)
        return tdm_err_set(TDM_EINVAL, "xfer: peer_timeout_ms must exceed 2 x heartbeat_ms");
    const char *fspec = cfg.faults ? cfg.faults : getenv("TANDEM_XFER_FAULTS");
    struct tdm_xfer_faults faults;
    tdm_status st = tdm_xfer_faults_parse(fspec, &faults);
    if (st != TDM_OK) return st;

    tdm_xfer_t *x = calloc(1, sizeof(*x));
    if (!x) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
    x->wait_fd = -1;
    x->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    x->cfg = cfg;
    x->faults = faults;
    snprintf(x->provider_name, sizeof(x->provider_name), "%s", cfg.provider);
    snprintf(x->node, sizeof(x->node), "%s", cfg.node ? cfg.node : "");
    x->cfg.provider = x->provider_name;
    x->cfg.node = x->node[0] ? x->node : NULL;
    snprintf(x->domain_name, sizeof(x->domain_name), "%s", cfg.domain ? cfg.domain : "");
    x->cfg.domain = x->domain_name[0] ? x->domain_name : NULL;
    x->cfg.faults = NULL;
    if (hook) x->hook = *hook;
    pthread_mutex_init(&x->mu, NULL);
    pthread_mutex_init(&x->tx_mu, NULL);
    tdm_cond_init_monotonic(&x->cv);
    x->active_head = x->active_tail = -1;
    x->next_key = 1;
    if (!tdm_xfer_random(&x->nonce, sizeof x->nonce)) {
        st = tdm_err_set(TDM_EIO, "xfer: no random bytes for the engine's nonce");
        pthread_mutex_destroy(&x->tx_mu);
        pthread_mutex_destroy(&x->mu);
        pthread_cond_destroy(&x->cv);
        free(x);
        return st;
    }
    x->nonce |= 1;
    if (cfg.fabric_key) {
        if (cfg.fabric_key_bytes < 16 || cfg.fabric_key_bytes > sizeof x->key) {
            st = tdm_err_set(TDM_EINVAL, "xfer: a fabric key of %zu bytes (16 to %zu)",
                             cfg.fabric_key_bytes, sizeof x->key);
            pthread_mutex_destroy(&x->tx_mu);
            pthread_mutex_destroy(&x->mu);
            pthread_cond_destroy(&x->cv);
            free(x);
            return st;
        }
        memcpy(x->key, cfg.fabric_key, cfg.fabric_key_bytes);
        x->key_bytes = cfg.fabric_key_bytes;
    }
    x->cfg.fabric_key = NULL; /* the copy is x->key */

    int n_rx = cfg.ctrl_rx_depth;
    /* the run ring: the largest paged write, plus four windows' worth */
    x->run_cap = (uint64_t)cfg.max_pages_per_write +
                 4ull * (uint64_t)cfg.window_writes * (uint64_t)cfg.window_pages;
    x->n_segs = 4u * (uint32_t)cfg.max_jobs;
    x->jobs = calloc((size_t)cfg.max_jobs, sizeof(*x->jobs));
    x->fireq = calloc((size_t)cfg.max_jobs, sizeof(*x->fireq));
    x->firing_now = calloc((size_t)cfg.max_jobs, sizeof(*x->firing_now));
    x->runs = calloc((size_t)x->run_cap, sizeof(*x->runs));
    x->run_segs = calloc(x->n_segs, sizeof(*x->run_segs));
    x->repost = calloc((size_t)n_rx, sizeof(int));
    x->peers = calloc((size_t)cfg.max_peers, sizeof(*x->peers));
    x->buf_bytes = ((size_t)TDM_XFER_WIRE_HDR + (size_t)cfg.ctrl_bytes + 63) & ~(size_t)63;
    x->bufs = tdm_alloc_aligned(x->buf_bytes * (size_t)(N_TX_BUFS + n_rx));
    if (faults.delay_imm_ms > 0) x->delay_ring = calloc(DELAY_RING, sizeof(*x->delay_ring));
    if (!x->jobs || !x->fireq || !x->firing_now || !x->runs || !x->run_segs || !x->repost ||
        !x->peers || !x->bufs || (faults.delay_imm_ms > 0 && !x->delay_ring)) {
        st = tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
        goto out_destroy;
    }
    for (int i = 0; i < cfg.max_jobs; i++)
        x->jobs[i].next = i + 1 < cfg.max_jobs ? i + 1 : -1;
    x->job_free = 0;
    for (int i = 0; i < N_TX_BUFS; i++)
        x->tx_free[x->n_tx_free++] = i;

    if ((st = open_fabric(x)) != TDM_OK) goto out_destroy; /* sizes the op pool */
    x->ops = calloc((size_t)x->n_ops, sizeof(*x->ops));
    x->op_free = calloc((size_t)x->n_tx_ops, sizeof(int));
    if (!x->ops || !x->op_free) {
        st = tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
        goto out_destroy;
    }
    for (int i = 0; i < x->n_tx_ops; i++)
        x->op_free[x->n_op_free++] = x->n_tx_ops - 1 - i;
    /* writes are posted by the threads that submit them where the domain is thread-safe */
    const char *pm = getenv("TANDEM_XFER_POST");
    x->caller_posts =
        x->info->domain_attr->threading == FI_THREAD_SAFE && !(pm && !strcmp(pm, "thread"));
    uint32_t slots = TDM_MIN((uint32_t)cfg.max_slots, x->caps.max_slot + 1);
    if (cfg.counters) {
        x->counters = cfg.counters;
        x->counters_borrowed = true;
    } else if ((st = tdm_xfer_counters_create(slots, x->caps.max_index + 1, &x->counters)) !=
               TDM_OK) {
        goto out_destroy;
    }
    uint64_t key_unused;
    if ((st = reg_raw(x, x->bufs, x->buf_bytes * (size_t)(N_TX_BUFS + n_rx), TDM_XFER_MEM_HOST,
                      &x->bufs_mr, &key_unused, &x->bufs_desc)) != TDM_OK)
        goto out_destroy;
    for (int i = 0; i < n_rx; i++) {
        int o = x->n_tx_ops + i;
        x->ops[o] =
            (struct op){.kind = OP_RECV, .job = -1, .peer = UINT32_MAX, .buf = N_TX_BUFS + i};
        if ((st = tdm_fab_post_recv(x, o)) != TDM_OK) goto out_destroy;
    }
    if (pthread_create(&x->thread, NULL, tdm_fab_progress_main, x) != 0) {
        st = tdm_err_set(TDM_EINTERNAL, "xfer: cannot start the progress thread");
        goto out_destroy;
    }
    x->thread_started = true;
    if (is_shm(x)) {
        pthread_mutex_lock(&shm_mu);
        shm_live++;
        x->shm_counted = true;
        pthread_mutex_unlock(&shm_mu);
    }
    TDM_DEBUG("xfer: %s endpoint up (%d-bit immediates, mr_mode 0x%llx, delivery complete %d, "
              "idle progress %s, "
              "ordering %s, %d transmit ops, posting from %s)",
              x->caps.provider, x->caps.imm_bits, (unsigned long long)x->caps.mr_mode,
              x->caps.delivery_complete,
              x->cfg.busy_poll  ? "spins"
              : x->wait_fd >= 0 ? "sleeps on the CQ"
                                : "polls",
              x->order == ORDER_WAW     ? "waw"
              : x->order == ORDER_FENCE ? "fence"
                                        : "drain",
              x->n_tx_ops, x->caller_posts ? "callers" : "the progress thread");
    *out = x;
    return TDM_OK;

out_destroy : {
    char msg[512];
    snprintf(msg, sizeof(msg), "%s", tdm_err_msg());
    tdm_xfer_destroy(x);
    return tdm_err_set(st, "%s", msg);
}
}

void tdm_xfer_destroy(tdm_xfer_t *x)
{
    if (!x) return;
    if (x->thread_started) {
        x->stop = 1;
        tdm_fab_wake(x);
        pthread_join(x->thread, NULL);
    }
    if (x->wake_fd >= 0) close(x->wake_fd);
    /* everything not finished ends as cancelled, on this thread */
    if (x->jobs) {
        pthread_mutex_lock(&x->tx_mu);
        for (int j = x->active_head; j >= 0; j = x->jobs[j].next)
            if (x->jobs[j].state == JOB_ACTIVE) {
                tdm_err_set(TDM_ECANCELED, "xfer: engine destroyed");
                tdm_fab_job_finish(x, j, TDM_ECANCELED);
            }
        pthread_mutex_unlock(&x->tx_mu);
        tdm_fab_fire_queued(x);
    }
    close_or_park(x); /* and its bufs and ops */
    if (!x->counters_borrowed) tdm_xfer_counters_destroy(x->counters);
    if (x->jobs)
        for (int j = 0; j < x->cfg.max_jobs; j++)
            free(x->jobs[j].msg);
    free(x->delay_ring);
    free(x->peers);
    free(x->jobs);
    free(x->fireq);
    free(x->firing_now);
    free(x->runs);
    free(x->run_segs);
    free(x->repost);
    free(x->op_free);
    pthread_mutex_destroy(&x->tx_mu);
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    explicit_bzero(x->key, sizeof x->key);
    free(x);
}

tdm_status tdm_xfer_addr(const tdm_xfer_t *x, char *buf, size_t cap)
{
    return tdm_xfer_addr_encode(x->my_addr, x->my_addr_bytes, buf, cap);
}

size_t tdm_xfer_addr_raw(const tdm_xfer_t *x, uint8_t *out, size_t cap)
{
    if (cap < x->my_addr_bytes) return 0;
    memcpy(out, x->my_addr, x->my_addr_bytes);
    return x->my_addr_bytes;
}

void tdm_xfer_get_caps(const tdm_xfer_t *x, struct tdm_xfer_caps *out)
{
    *out = x->caps;
}

void tdm_xfer_get_stats(tdm_xfer_t *x, struct tdm_xfer_stats *out)
{
    const uint64_t *src = (const uint64_t *)&x->stats;
    uint64_t *dst = (uint64_t *)out;
    for (size_t i = 0; i < sizeof(*out) / sizeof(uint64_t); i++)
        dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
}

tdm_xfer_counters_t *tdm_xfer_get_counters(tdm_xfer_t *x)
{
    return x->counters;
}

tdm_status tdm_xfer_mr_reg(tdm_xfer_t *x, void *base, size_t bytes, enum tdm_xfer_mem_kind kind,
                           tdm_xfer_mr_t **out)
{
    if (!x || !base || !bytes) return tdm_err_set(TDM_EINVAL, "xfer: empty region");
    if (kind != TDM_XFER_MEM_HOST) {
        if (kind != TDM_XFER_MEM_CUDA) return tdm_err_set(TDM_EINVAL, "xfer: memory kind %d", kind);
        if (!x->caps.hmem_cuda)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "xfer: provider %s cannot register cuda memory; stage through a "
                               "registered host buffer",
                               x->caps.provider);
    }
    tdm_xfer_mr_t *mr = calloc(1, sizeof(*mr));
    if (!mr) return tdm_err_set(TDM_ENOMEM, "xfer: out of memory");
    tdm_status st = reg_raw(x, base, bytes, kind, &mr->mr, &mr->key, &mr->desc);
    if (st != TDM_OK) {
        free(mr);
        return st;
    }
    mr->x = x;
    mr->base = base;
    mr->bytes = bytes;
    mr->kind = kind;
    *out = mr;
    return TDM_OK;
}

void tdm_xfer_mr_dereg(tdm_xfer_mr_t *mr)
{
    if (!mr) return;
    fi_close(&mr->mr->fid);
    free(mr);
}

void tdm_xfer_mr_remote(const tdm_xfer_mr_t *mr, struct tdm_xfer_rmem *out)
{
    memset(out, 0, sizeof(*out));
    out->addr =
        (mr->x->info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)mr->base : 0;
    out->key = mr->key;
    out->bytes = mr->bytes;
    out->kind = (uint32_t)mr->kind;
}
