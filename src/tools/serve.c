/*
 * `tandem serve`: the OpenAI-compatible server. Loads the model, builds the engine, starts the
 * scheduler thread and the HTTP server, then waits for SIGTERM or SIGINT in the main thread.
 *
 * Shutdown: /health turns to 503 and new requests are refused; requests in flight get up to
 * --drain-timeout seconds to finish; what is left is cancelled; then the HTTP threads stop.
 * The signals are blocked in every thread and taken with sigwait, so no handler runs inside
 * a library call.
 */
#include <signal.h>
#include <sys/stat.h>
#include <errno.h>
#include <jansson.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/disagg.h"
#include "tandem/sched.h"
#include "tandem/server.h"
#include "server/httpc.h"
#include "tools/tools_int.h"

static void usage(FILE *f)
{
    fprintf(
        f,
        "usage: tandem serve [options]\n"
        "\n"
        "  --model PATH            .gguf file or HF checkpoint folder (default model if absent)\n"
        "  --host ADDR             numeric address to bind (default 127.0.0.1)\n"
        "  --port N                TCP port (default 8000; 0 picks a free one)\n"
        "  --port-file FILE        write the bound port to FILE once listening\n"
        "  --api-key KEY           require Authorization: Bearer KEY (or $TANDEM_API_KEY)\n"
        "  --served-model-name S   model id in /v1/models and responses (default: file name)\n"
        "  --max-batch-tokens N    tokens per forward step (default 512)\n"
        "  --max-seqs N            running sequences (default 64)\n"
        "  --prefill-chunk N       tokens per prefill chunk of one sequence (default: budget)\n"
        "  --max-waiting N         waiting-queue capacity; beyond it requests get 503 (1024)\n"
        "  --watchdog-ms N         a step running longer stalls the server: its requests fail,\n"
        "                          /health answers 503 until it comes back (60000; 0: off)\n"
        "  --overlap auto|on|off   plan step N+1 while step N runs (auto: where the backend\n"
        "                          runs steps asynchronously, CUDA; on: also the CPU, where it\n"
        "                          changes only the order of the work)\n"
        "  --page-size N           tokens per KV page (default 16)\n" TDM_TOOL_KV_DTYPE_USAGE
        "  --kv-pages N            KV pool size in pages, or\n"
        "  --kv-memory SIZE        KV pool size in bytes (suffixes K, M, G, KiB, MiB, GiB)\n"
        "  --max-ctx N             context length (default: the model's)\n"
        "  --threads N             CPU threads (default: one per core)\n" TDM_TOOL_TP_USAGE
        "                          (not with --role prefill|decode yet)\n"
        "  --backend cpu|cuda      compute backend (default cpu)\n"
        "  --gpu-memory-fraction F CUDA: share of GPU memory for weights, workspace and KV "
        "(0.9)\n" TDM_TOOL_GPU_WEIGHTS_USAGE TDM_TOOL_EXACT_ACTIVATIONS_USAGE
        "  --batch-invariant       never use OpenBLAS (see docs/DESIGN.md)\n"
        "  --kv-events ENDPOINT    with --prefix-caching: publish the cache's stored and\n"
        "                          evicted pages on a ZMQ PUB socket bound here (e.g.\n"
        "                          tcp://0.0.0.0:5557), as vLLM's KV events (KV-aware routers)\n"
        "  --kv-events-topic T     the topic frame of each message (default empty)\n"
        "  --prefix-caching        reuse the KV of prompts' cached prefixes (whole pages), kept\n"
        "                          until memory is needed; POST /reset_prefix_cache drops them;\n"
        "                          a decode node asks its prefill node for the rest only, and a\n"
        "                          prefill node reuses its own\n"
        "  --max-body BYTES        request body limit (default 4194304)\n"
        "  --drain-timeout S       seconds to let requests finish on SIGTERM (default "
        "30)\n" TDM_TOOL_HTTP_USAGE
        "  --http-threads N        threads of the HTTP event loop (default 4)\n"
        "\n"
        "disaggregated prefill and decode (docs/DESIGN.md section 4):\n"
        "  --role both|prefill|decode  both (default): colocated. prefill: takes prefill\n"
        "                          requests from decode nodes over the fabric (no public API\n"
        "                          besides /health and /metrics). decode: the public API,\n"
        "                          prefilling on --prefill-peers\n"
        "  --prefill-peers LIST    comma-separated prefill nodes: each a fabric address, @FILE\n"
        "                          holding one, or http://HOST:PORT of the node (asked for its\n"
        "                          address at GET /disagg/address, and again if it moves)\n"
        "  --xfer-provider P       libfabric provider: tcp;ofi_rxm (default), shm, verbs;ofi_rxm, "
        "efa\n"
        "  --xfer-node ADDR        local address the fabric endpoint binds to\n"
        "  --xfer-nics LIST        prefill, decode: several NICs, comma-separated (each an\n"
        "                          address, an interface or an RDMA device; auto: the leader\n"
        "                          rank's nearest NICs when placement finds two or more): one\n"
        "                          fabric endpoint (rail) per NIC, KV writes spread round-robin\n"
        "                          over them\n"
        "  --xfer-busy-poll        prefill, decode: the fabric's progress thread spins instead\n"
        "                          of sleeping when idle (lowest latency; a core of its own)\n"
        "  --transfer-cpus LIST    prefill, decode: pin the transfer threads to these cores\n"
        "                          (default: the cores of the leader rank's NUMA node, found\n"
        "                          with hwloc beside its GPU and nearest NICs: `tandem topo`)\n"
        "  --xfer-addr-file FILE   prefill, decode: write this node's fabric address to FILE\n"
        "  --fabric-key FILE       the cluster secret (16 to 256 bytes; trailing whitespace is\n"
        "                          dropped): peers must prove they hold it (docs/SECURITY.md)\n"
        "  --remote-chunk N        decode: prefill chunk asked of peers (default 256 tokens)\n"
        "  --remote-timeout-ms N   decode: one remote prefill's deadline (default 30000)\n"
        "  --remote-attempts N     decode: peers tried per request before prefilling here (2)\n"
        "  --add-named-prefill-peers  decode: a request's x-prefiller-host-port (llm-d) may\n"
        "                          name a prefill node not in --prefill-peers: it is added\n"
        "                          (without this, the header only picks among them)\n"
        "  --peer-timeout-ms N     a silent fabric peer is declared dead after this (2000)\n"
        "  --kv-staging auto|always|off  KV pages through pinned host memory, for GPU pools\n"
        "                          between hosts whose fabric cannot register GPU memory.\n"
        "                          auto (default): when needed (a decoder tries CUDA IPC\n"
        "                          first); always: every page, host pools too; off: never\n"
        "  --staging-memory SIZE   prefill: the staging ring (default 64M); decode: the host\n"
        "                          landing pages (default: four contexts, at most the pool)\n"
        "  --spec mtp [--spec-draft HEAD]  on a decode node: prefill nodes also send the head's\n"
        "                          KV, and requests draft from their first step; on a prefill\n"
        "                          node: the head it runs for its decoders (the same file)\n");
    tdm_tool_spec_usage(f);
}

static bool parse_size(const char *s, size_t *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0)) return false;
    double mul = 1;
    if (!strcmp(end, "") || !strcmp(end, "B"))
        mul = 1;
    else if (!strcmp(end, "K") || !strcmp(end, "KiB"))
        mul = 1024.0;
    else if (!strcmp(end, "M") || !strcmp(end, "MiB"))
        mul = 1024.0 * 1024;
    else if (!strcmp(end, "G") || !strcmp(end, "GiB"))
        mul = 1024.0 * 1024 * 1024;
    else if (!strcmp(end, "KB"))
        mul = 1e3;
    else if (!strcmp(end, "MB"))
        mul = 1e6;
    else if (!strcmp(end, "GB"))
        mul = 1e9;
    else
        return false;
    if (v * mul > 1e15) return false;
    *out = (size_t)(v * mul);
    return true;
}

static bool is_url(const char *s)
{
    return !strncmp(s, "http://", 7) || !strncmp(s, "https://", 8);
}

struct addr_body {
    char buf[4096];
    size_t n;
    int status;
};
static bool addr_head(void *ctx, int status, const char *content_type)
{
    (void)content_type;
    ((struct addr_body *)ctx)->status = status;
    return status == 200;
}
static bool addr_chunk(void *ctx, const char *data, size_t n)
{
    struct addr_body *b = ctx;
    if (n > sizeof b->buf - 1 - b->n) return false; /* an address is short */
    memcpy(b->buf + b->n, data, n);
    b->n += n;
    return true;
}

/* A prefill peer's address from its source: GET URL/disagg/address (within 2 s; the node must
 * say it is a prefill node), or the first line of a file. */
static bool read_peer(void *ctx, const char *source, char *out, size_t cap)
{
    (void)ctx;
    if (!is_url(source)) return tdm_disagg_read_addr_file(source, out, cap);
    struct tdm_bh_target t;
    if (tdm_bh_target_init(source, NULL, &t) != TDM_OK) {
        TDM_WARN("--prefill-peers %s: %s", source, tdm_err_msg());
        return false;
    }
    struct addr_body b = {.n = 0};
    struct tdm_bh_request rq = {.method = "GET",
                                .path = "/disagg/address",
                                .deadline_ns = tdm_now_ns() + 2000000000ull,
                                .connect_timeout_ms = 2000};
    struct tdm_bh_handler h = {.on_head = addr_head, .on_body = addr_chunk, .ctx = &b};
    enum tdm_bh_fail f = tdm_bh_request(&t, &rq, &h);
    tdm_bh_target_free(&t);
    if (f != TDM_BH_OK) {
        TDM_DEBUG("--prefill-peers %s: %s (HTTP %d)", source, tdm_bh_fail_str(f), b.status);
        return false;
    }
    b.buf[b.n] = 0;
    json_t *o = json_loads(b.buf, 0, NULL);
    const char *role = json_string_value(json_object_get(o, "role"));
    const char *addr = json_string_value(json_object_get(o, "fabric_address"));
    bool ok = role && !strcmp(role, "prefill") && addr && strlen(addr) < cap && addr[0];
    if (ok)
        snprintf(out, cap, "%s", addr);
    else
        TDM_WARN("--prefill-peers %s: not a prefill node's answer", source);
    json_decref(o);
    return ok;
}

static void free_peers(char **bufs)
{
    for (int i = 0; i < 2 * TDM_DISAGG_MAX_PEERS; i++)
        free(bufs[i]);
}

/* --xfer-nics: the rails' NICs into out (pointing into buf), from the list or, for "auto",
 * from the leader rank's placement (its nearest NICs, when there are two or more). Returns
 * how many (0 or 1: one endpoint, as without the flag), -1 on a bad list. */
static int parse_nics(const char *arg, const struct tdm_placement *pl, int n_placed, char *buf,
                      size_t cap, const char **out)
{
    if (!arg) return 0;
    if (!strcmp(arg, "auto")) {
        int n = n_placed && pl[0].n_nics >= 2 ? TDM_MIN(pl[0].n_nics, TDM_XFER_MAX_RAILS) : 0;
        for (int i = 0; i < n; i++)
            out[i] = pl[0].nics[i].name;
        if (!n)
            fprintf(stderr, "tandem serve: --xfer-nics auto: placement found fewer than two "
                            "NICs near rank 0; one fabric endpoint\n");
        return n;
    }
    if (snprintf(buf, cap, "%s", arg) >= (int)cap) return -1;
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == TDM_XFER_MAX_RAILS || !*t) return -1;
        out[n++] = t;
    }
    return n;
}

/* "addr,@file,http://host:port,..." into o->peers and o->peer_files (strings kept in bufs:
 * [0, MAX) the addresses, [MAX, 2 MAX) the sources). A URL's node is asked for its address
 * (read_peer); one that does not answer yet is asked again later. */
static bool parse_peers(const char *arg, struct tdm_disagg_decode_opts *o, char **bufs)
{
    const char *p = arg;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (o->n_peers == TDM_DISAGG_MAX_PEERS) {
            fprintf(stderr, "--prefill-peers: at most %d peers\n", TDM_DISAGG_MAX_PEERS);
            return false;
        }
        char *item = strndup(p, n);
        if (!item) return false;
        if (is_url(item)) {
            char line[TDM_XFER_ADDR_MAX] = "";
            if (!read_peer(NULL, item, line, sizeof line))
                fprintf(stderr,
                        "tandem serve: --prefill-peers %s does not answer yet; it is asked again "
                        "until it does\n",
                        item);
            o->peer_files[o->n_peers] = item;
            bufs[TDM_DISAGG_MAX_PEERS + o->n_peers] = item;
            if (!(item = strdup(line))) return false;
            bufs[o->n_peers] = item;
            o->peers[o->n_peers++] = item;
            p += n;
            if (*p == ',') p++;
            continue;
        }
        if (item[0] == '@') {
            char line[TDM_XFER_ADDR_MAX];
            if (!tdm_disagg_read_addr_file(item + 1, line, sizeof line)) {
                fprintf(stderr, "--prefill-peers: cannot read an address from %s\n", item + 1);
                free(item);
                return false;
            }
            o->peer_files[o->n_peers] = item + 1; /* kept: re-read when the peer is down */
            bufs[TDM_DISAGG_MAX_PEERS + o->n_peers] = item;
            if (!(item = strdup(line))) return false;
        }
        if (!item[0]) {
            fprintf(stderr, "--prefill-peers: empty address in '%s'\n", arg);
            free(item);
            return false;
        }
        bufs[o->n_peers] = item;
        o->peers[o->n_peers++] = item;
        p += n;
        if (*p == ',') p++;
    }
    if (!o->n_peers) {
        fprintf(stderr, "--prefill-peers: no address given\n");
        return false;
    }
    return true;
}

static bool opt_kv_memory(const char *arg, void *dst)
{
    if (parse_size(arg, dst)) return true;
    fprintf(stderr, "--kv-memory: '%s' is not a size like 2GiB or 512M\n", arg);
    return false;
}

static bool opt_staging_memory(const char *arg, void *dst)
{
    if (parse_size(arg, dst)) return true;
    fprintf(stderr, "--staging-memory: '%s' is not a size like 256M or 1GiB\n", arg);
    return false;
}

static bool opt_staging(const char *arg, void *dst)
{
    static const char *const names[] = {"auto", "always", "off"};
    static const enum tdm_disagg_staging vals[] = {
        TDM_DISAGG_STAGING_AUTO, TDM_DISAGG_STAGING_ALWAYS, TDM_DISAGG_STAGING_OFF};
    for (int i = 0; i < 3; i++)
        if (!strcmp(arg, names[i])) {
            *(enum tdm_disagg_staging *)dst = vals[i];
            return true;
        }
    fprintf(stderr, "--kv-staging: '%s' is not auto, always or off\n", arg);
    return false;
}

static bool opt_overlap(const char *arg, void *dst)
{
    static const char *const names[] = {"off", "auto", "on"};
    for (int i = 0; i < 3; i++)
        if (!strcmp(arg, names[i])) {
            *(int *)dst = i - 1;
            return true;
        }
    fprintf(stderr, "--overlap: '%s' is not auto, on or off\n", arg);
    return false;
}

static bool opt_role(const char *arg, void *dst)
{
    if (!strcmp(arg, "both") || !strcmp(arg, "prefill") || !strcmp(arg, "decode")) {
        *(const char **)dst = arg;
        return true;
    }
    fprintf(stderr, "--role: '%s' is not both, prefill or decode\n", arg);
    return false;
}

/* /metrics blocks beyond the scheduler's: the disaggregation side's and speculation's. */
struct extra_metrics_ctx {
    tdm_kv_events_t *events;
    tdm_disagg_prefill_t *pre;
    tdm_disagg_decode_t *dec;
    tdm_spec_t *spec;
    tdm_engine_t *engine;
    const struct tdm_placement *placement; /* prefill, decode: each rank's, or NULL */
    int n_placed;
};
static char *extra_metrics(void *ctx)
{
    struct extra_metrics_ctx *x = ctx;
    char *parts[4] = {x->pre   ? tdm_disagg_prefill_metrics(x->pre)
                      : x->dec ? tdm_disagg_decode_metrics(x->dec)
                               : NULL,
                      x->spec ? tdm_spec_metrics(x->spec) : NULL,
                      x->events ? tdm_kv_events_metrics(x->events) : NULL,
                      x->n_placed ? tdm_tool_placement_metrics(x->placement, x->n_placed) : NULL};
    struct tdm_sbuf b = {0};
    for (int i = 0; i < 4; i++) {
        if (parts[i]) tdm_sbuf_printf(&b, "%s", parts[i]);
        free(parts[i]);
    }
    uint64_t tokens[1024];
    int n = tdm_engine_expert_tokens(x->engine, tokens, 1024);
    if (n) {
        tdm_prom_family(&b, "tandem_moe_expert_tokens_total", "counter",
                        "Tokens each expert ran, summed over the sparse layers (imbalance shows "
                        "as uneven counts).");
        for (int i = 0; i < n && i < 1024; i++) {
            char lab[32];
            snprintf(lab, sizeof lab, "expert=\"%d\"", i);
            tdm_prom_sample(&b, "tandem_moe_expert_tokens_total", lab, (double)tokens[i]);
        }
    }
    char *out = tdm_sbuf_take(&b);
    return out ? out : calloc(1, 1);
}

/* --fabric-key FILE: 16 to 256 bytes, trailing whitespace dropped; a file others can read is
 * warned about (the key is the fabric's only authentication). */
static bool read_fabric_key(const char *path, uint8_t out[256], size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "tandem serve: --fabric-key %s: %s\n", path, strerror(errno));
        return false;
    }
    uint8_t buf[258];
    size_t got = fread(buf, 1, sizeof buf, f);
    struct stat sb;
    bool shared = fstat(fileno(f), &sb) == 0 && (sb.st_mode & (S_IRWXG | S_IRWXO));
    fclose(f);
    while (got && (buf[got - 1] == '\n' || buf[got - 1] == '\r' || buf[got - 1] == ' ' ||
                   buf[got - 1] == '\t'))
        got--;
    if (got < 16 || got > 256) {
        fprintf(stderr, "tandem serve: --fabric-key %s: %zu bytes; a key is 16 to 256 bytes\n",
                path, got);
        explicit_bzero(buf, sizeof buf);
        return false;
    }
    if (shared)
        fprintf(stderr,
                "tandem serve: warning: --fabric-key %s can be read by other users "
                "(chmod 600 it)\n",
                path);
    memcpy(out, buf, got);
    *n = got;
    explicit_bzero(buf, sizeof buf);
    return true;
}

int tdm_cmd_serve(int argc, char **argv)
{
    const char *model = NULL, *name = NULL, *events_ep = NULL, *events_topic = NULL;
    struct tdm_tool_http h = {.host = "127.0.0.1",
                              .api_key = getenv("TANDEM_API_KEY"),
                              .port = 8000,
                              .max_body = TDM_SERVER_DEFAULT_MAX_BODY,
                              .drain_s = 30};
    int64_t mbt = 512, seqs = 64, chunk = 0, waiting = 1024, page = 16, pages = 0;
    int64_t ctx = 0, threads = 0, tp = 1;
    size_t kv_bytes = 0, staging_bytes = 0;
    enum tdm_disagg_staging staging = TDM_DISAGG_STAGING_AUTO;
    bool inv = false, prefix_caching = false, add_named = false, busy_poll = false;
    bool exact_act = false;
    const char *role = "both", *peers_arg = NULL, *provider = NULL, *xnode = NULL, *xnics = NULL;
    const char *addr_file = NULL, *fabric_key_file = NULL, *transfer_cpus = NULL;
    int64_t rchunk = 256, rtimeout = 30000, rattempts = 2, peer_timeout = 2000;
    int64_t watchdog = 60000, http_threads = 4;
    int overlap = 0;
    int backend_kind = TDM_BACKEND_CPU, kv_dtype = TDM_KV_DTYPE_AUTO;
    double gpu_frac = 0.9;
    bool gpu_bf16 = false;
    struct tdm_opt http[TDM_TOOL_HTTP_OPTS];
    tdm_tool_http_table(&h, http);
    struct tdm_tool_spec spec_cli = {0};
    struct tdm_opt spec_t[TDM_TOOL_SPEC_OPTS];
    tdm_tool_spec_table(&spec_cli, spec_t);
    const struct tdm_opt own[] = {
        TDM_OPT_S("model", &model),
        TDM_OPT_S("served-model-name", &name),
        TDM_OPT_I("max-batch-tokens", &mbt, 1, 1 << 20),
        TDM_OPT_I("max-seqs", &seqs, 1, 4096),
        TDM_OPT_I("prefill-chunk", &chunk, 1, 1 << 20),
        TDM_OPT_I("max-waiting", &waiting, 1, 1 << 20),
        TDM_OPT_I("watchdog-ms", &watchdog, 0, 86400000),
        TDM_OPT_P("overlap", opt_overlap, &overlap),
        TDM_OPT_I("http-threads", &http_threads, 1, 256),
        TDM_OPT_I("page-size", &page, 1, 1024),
        TDM_OPT_P("kv-dtype", tdm_tool_opt_kv_dtype, &kv_dtype),
        TDM_OPT_I("kv-pages", &pages, 1, INT32_MAX),
        TDM_OPT_P("kv-memory", opt_kv_memory, &kv_bytes),
        TDM_OPT_I("max-ctx", &ctx, 2, 1 << 24),
        TDM_OPT_I("threads", &threads, 1, 1024),
        TDM_OPT_I("tp", &tp, 1, TDM_TP_MAX_RANKS),
        TDM_OPT_B("batch-invariant", &inv),
        TDM_OPT_B("exact-activations", &exact_act),
        TDM_OPT_B("prefix-caching", &prefix_caching),
        TDM_OPT_S("kv-events", &events_ep),
        TDM_OPT_S("kv-events-topic", &events_topic),
        TDM_OPT_P("backend", tdm_tool_opt_backend, &backend_kind),
        TDM_OPT_F("gpu-memory-fraction", &gpu_frac, 0.05, 1.0),
        TDM_OPT_P("gpu-weights", tdm_tool_opt_gpu_weights, &gpu_bf16),
        TDM_OPT_P("role", opt_role, &role),
        TDM_OPT_S("prefill-peers", &peers_arg),
        TDM_OPT_S("xfer-provider", &provider),
        TDM_OPT_S("xfer-node", &xnode),
        TDM_OPT_S("xfer-nics", &xnics),
        TDM_OPT_S("transfer-cpus", &transfer_cpus),
        TDM_OPT_B("xfer-busy-poll", &busy_poll),
        TDM_OPT_S("xfer-addr-file", &addr_file),
        TDM_OPT_S("fabric-key", &fabric_key_file),
        TDM_OPT_I("remote-chunk", &rchunk, 1, 1 << 20),
        TDM_OPT_I("remote-timeout-ms", &rtimeout, 100, 3600000),
        TDM_OPT_I("remote-attempts", &rattempts, 0, 16),
        TDM_OPT_B("add-named-prefill-peers", &add_named),
        TDM_OPT_I("peer-timeout-ms", &peer_timeout, 100, 600000),
        TDM_OPT_P("kv-staging", opt_staging, &staging),
        TDM_OPT_P("staging-memory", opt_staging_memory, &staging_bytes),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {http, own, spec_t, NULL};
    int prc = tdm_tool_parse("serve", argc, argv, tables, usage);
    if (prc) return prc == 1 ? 0 : 2;
    struct tdm_spec_opts spec_o;
    bool spec_on = false;
    if (!tdm_tool_spec_opts(&spec_cli, &spec_o, &spec_on)) return 2;
    const char *host = h.host, *port_file = h.port_file, *api_key = h.api_key;
    int64_t port = h.port, max_body = h.max_body, drain = h.drain_s;
    bool is_prefill = !strcmp(role, "prefill"), is_decode = !strcmp(role, "decode");
    if (is_decode && !peers_arg) {
        fprintf(stderr, "tandem serve: --role decode needs --prefill-peers\n");
        return 2;
    }
    if (!is_decode && add_named) {
        fprintf(stderr, "tandem serve: --add-named-prefill-peers is for --role decode\n");
        return 2;
    }
    if (!is_decode && peers_arg) {
        fprintf(stderr, "tandem serve: --prefill-peers is for --role decode\n");
        return 2;
    }
    if ((events_ep || events_topic) && !prefix_caching) {
        fprintf(stderr, "tandem serve: --kv-events publishes the prefix cache's events: it needs "
                        "--prefix-caching\n");
        return 2;
    }
    if (events_topic && !events_ep) {
        fprintf(stderr, "tandem serve: --kv-events-topic goes with --kv-events\n");
        return 2;
    }
    if (!tdm_tool_tp_check("tandem serve", tp, backend_kind)) return 2;
    /* a head's methods: a chain (mtp) or trees (eagle) of the same head */
    const bool head_method = spec_o.method == TDM_SPEC_MTP || spec_o.method == TDM_SPEC_EAGLE;
    if ((is_prefill || is_decode) && tp > 1 && spec_on && head_method) {
        fprintf(stderr,
                "tandem serve: --tp %lld with --role %s and --spec %s: the speculation head is "
                "sharded like the target (its KV split over the ranks by its own KV heads), and "
                "sharded KV transfers carry the target's layers only (run the head's nodes with "
                "--tp 1, or disaggregate without the head)\n",
                (long long)tp, role, tdm_spec_method_name(spec_o.method));
        return 2;
    }
    if ((is_prefill || is_decode) && tp > 1 && backend_kind == TDM_BACKEND_CUDA) {
        fprintf(stderr,
                "tandem serve: --tp %lld --backend cuda with --role %s: sharded KV transfers move "
                "host pools; GPU rank pools are not sharded across nodes yet (run the node with "
                "--tp 1 on the GPU, or --role both)\n",
                (long long)tp, role);
        return 2;
    }
    if ((is_prefill || is_decode) && tp > 1 && staging == TDM_DISAGG_STAGING_ALWAYS) {
        fprintf(stderr,
                "tandem serve: --tp %lld with --kv-staging always: sharded KV transfers move "
                "every rank's host pool by the fabric; staging is not sharded yet\n",
                (long long)tp);
        return 2;
    }
    if (is_prefill && spec_on && !head_method) {
        fprintf(stderr,
                "tandem serve: --spec is for the decoding side (--role both or decode; here: "
                "--spec %s): a prefill node samples no tokens; it takes --spec mtp or eagle "
                "[--spec-draft HEAD] only, to make the KV of its decoders' head\n",
                tdm_spec_method_name(spec_o.method));
        return 2;
    }
    if (is_prefill && spec_on) /* the head's KV only: nothing drafts or is accepted here */
        spec_o.accept = TDM_SPEC_ACCEPT_EXACT;
    if (!is_prefill && !is_decode && addr_file) {
        fprintf(stderr, "tandem serve: --xfer-addr-file is for --role prefill or decode\n");
        return 2;
    }
    if (!is_prefill && !is_decode && (staging != TDM_DISAGG_STAGING_AUTO || staging_bytes)) {
        fprintf(stderr, "tandem serve: --kv-staging and --staging-memory are for --role prefill "
                        "or decode\n");
        return 2;
    }
    if ((transfer_cpus || busy_poll) && !is_prefill && !is_decode) {
        fprintf(stderr, "tandem serve: --%s is for --role prefill or decode\n",
                transfer_cpus ? "transfer-cpus" : "xfer-busy-poll");
        return 2;
    }
    uint8_t fkey[256];
    size_t fkey_bytes = 0;
    if (fabric_key_file) {
        if (!is_prefill && !is_decode) {
            fprintf(stderr, "tandem serve: --fabric-key is for --role prefill or decode\n");
            return 2;
        }
        if (!read_fabric_key(fabric_key_file, fkey, &fkey_bytes)) return 2;
    }
    struct tdm_disagg_decode_opts dopt = {.read_peer = read_peer,
                                          .xfer = {.provider = provider,
                                                   .staging = staging,
                                                   .staging_bytes = staging_bytes,
                                                   .node = xnode,
                                                   .peer_timeout_ms = (int)peer_timeout,
                                                   .fabric_key = fkey_bytes ? fkey : NULL,
                                                   .fabric_key_bytes = fkey_bytes,
                                                   .busy_poll = busy_poll},
                                          .chunk = (int)rchunk,
                                          .timeout_ms = (int)rtimeout,
                                          .max_attempts = rattempts ? (int)rattempts : -1,
                                          .add_named_peers = add_named};
    char *peer_bufs[2 * TDM_DISAGG_MAX_PEERS] = {0}; /* addresses, then the @FILE items */
    if (is_decode && !parse_peers(peers_arg, &dopt, peer_bufs)) {
        free_peers(peer_bufs);
        return 2;
    }
    if (pages && kv_bytes) {
        fprintf(stderr, "tandem serve: give --kv-pages or --kv-memory, not both\n");
        free_peers(peer_bufs);
        return 2;
    }
    /* read before the model loads, so that a bad file is reported at once */
    char *tls_cert = NULL, *tls_key = NULL;
    if (!tdm_tool_http_tls("serve", &h, &tls_cert, &tls_key)) {
        free_peers(peer_bufs);
        return 2;
    }

    sigset_t sigs = tdm_tool_block_shutdown_signals();

    int rc = 1;
    tdm_disagg_prefill_t *pre = NULL;
    tdm_disagg_decode_t *dec = NULL;
    const struct tdm_load_opts lo = tdm_tool_load_opts(backend_kind, gpu_bf16, exact_act);
    struct tdm_model *m = tdm_tool_load_model_opts(model, &lo);
    if (!m) {
        free_peers(peer_bufs);
        tdm_tool_http_tls_free(tls_cert, tls_key);
        return 1;
    }
    tdm_tok_t *tok = tdm_tool_load_tokenizer(m, false);
    tdm_engine_t *e = NULL;
    tdm_sched_t *sched = NULL;
    tdm_spec_t *spec = NULL;
    struct tdm_model *draft = NULL;
    tdm_kv_events_t *kv_events = NULL;
    tdm_server_t *srv = NULL;
    struct tdm_chat_template tmpl = {0};
    bool have_chat = false;
    if (!tok) goto out_model;
    if (m->chat_template && tdm_chat_template_detect(m->chat_template, &tmpl) == TDM_OK)
        have_chat = true;
    else
        fprintf(stderr, "tandem serve: no chat template tandem understands; "
                        "/v1/chat/completions is off\n");
    if (ctx && ctx > m->cfg.max_ctx) {
        fprintf(stderr, "tandem serve: --max-ctx %lld is more than the model's %d\n",
                (long long)ctx, m->cfg.max_ctx);
        rc = 2;
        goto out_tok;
    }
    struct tdm_engine_opts eo = {
        .n_threads = (int)threads,
        .batch_invariant = inv,
        .exact_activations = exact_act,
        .page_size = (int)page,
        .kv_pages = pages,
        .kv_bytes = kv_bytes,
        .max_ctx = (int)ctx,
        .max_batch_tokens = (int)mbt,
        .max_seqs = (int)seqs,
        .kv_dtype = kv_dtype,
        /* a verified span has a row per draft, plus one */
        .max_logit_rows =
            spec_on && !is_prefill ? (int)TDM_MIN(mbt, seqs * (1 + TDM_SPEC_AUTO_K)) : (int)seqs,
        .count_layers = is_prefill,
        .backend_kind = backend_kind,
        .gpu_memory_fraction = gpu_frac,
        .gpu_bf16_weights = gpu_bf16,
        .tp = (int)tp};
    struct tdm_kv_group draft_group;
    if (spec_on &&
        !tdm_tool_spec_load_draft("tandem serve", &spec_o, m, &eo, &draft_group, &draft)) {
        rc = 2;
        goto out_tok;
    }
    if (tdm_engine_create(m, &eo, &e) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out_tok;
    }
    struct tdm_sched_opts so = {.max_batch_tokens = (int)mbt,
                                .max_seqs = (int)seqs,
                                .prefill_chunk = (int)chunk,
                                .max_waiting = (int)waiting,
                                .watchdog_ms = (int)watchdog,
                                .overlap = overlap};
    if (tdm_sched_create(e, tok, &so, &sched) != TDM_OK) {
        tdm_tool_fail("scheduler");
        goto out_engine;
    }
    if (spec_on && !is_prefill &&
        !(spec = tdm_tool_spec_attach("tandem serve", &spec_o, e, sched))) {
        rc = 2;
        goto out_sched;
    }
    /* placement: where each rank's transfers run; the threads the prefill or decode side starts
     * next inherit the leader's cores from this thread, which gets its own set back after */
    struct tdm_placement placement[TDM_TP_MAX_RANKS];
    int n_placed = 0;
    struct tdm_thread_mask own_mask;
    bool pinned = false;
    if (is_prefill || is_decode) {
        char pin[256] = "";
        if (!tdm_tool_serve_placement((int)tp, backend_kind == TDM_BACKEND_CUDA, 0, transfer_cpus,
                                      placement, pin, sizeof pin))
            n_placed = (int)tp;
        if (pin[0] && tdm_thread_mask_get(&own_mask) == TDM_OK) {
            if (tdm_thread_pin(pin) == TDM_OK) {
                pinned = true;
                fprintf(stderr, "tandem serve: transfer threads on cores %s\n", pin);
            } else if (transfer_cpus) {
                fprintf(stderr, "tandem serve: --transfer-cpus %s: %s\n", transfer_cpus,
                        tdm_err_msg());
                rc = 2;
                goto out_sched;
            } else {
                fprintf(stderr, "tandem serve: warning: transfer threads not pinned: %s\n",
                        tdm_err_msg());
            }
        }
    }
    char nics_buf[512];
    const char *nics[TDM_XFER_MAX_RAILS] = {0};
    int n_nics = parse_nics(xnics, placement, n_placed, nics_buf, sizeof nics_buf, nics);
    if (n_nics < 0 || (xnics && !is_prefill && !is_decode)) {
        fprintf(stderr, "tandem serve: --xfer-nics %s: %s\n", xnics,
                n_nics < 0 ? "a comma-separated list of at most 8 NICs"
                           : "is for --role prefill or decode");
        if (pinned) tdm_thread_mask_set(&own_mask);
        rc = 2;
        goto out_sched;
    }
    if (n_nics > 1) {
        char line[600] = "";
        for (int i = 0; i < n_nics; i++)
            snprintf(line + strlen(line), sizeof line - strlen(line), "%s%s", i ? ", " : "",
                     nics[i]);
        fprintf(stderr, "tandem serve: placement: rank 0's transfers use %d NICs (rails): %s\n",
                n_nics, line);
    }
    for (int i = 0; i < n_nics; i++)
        dopt.xfer.nics[i] = nics[i];
    dopt.xfer.n_nics = n_nics;
    if (is_prefill) {
        struct tdm_disagg_prefill_opts po = {.xfer = {.provider = provider,
                                                      .nics = {nics[0], nics[1], nics[2], nics[3],
                                                               nics[4], nics[5], nics[6], nics[7]},
                                                      .n_nics = n_nics,
                                                      .staging = staging,
                                                      .staging_bytes = staging_bytes,
                                                      .node = xnode,
                                                      .peer_timeout_ms = (int)peer_timeout,
                                                      .fabric_key = fkey_bytes ? fkey : NULL,
                                                      .fabric_key_bytes = fkey_bytes,
                                                      .busy_poll = busy_poll},
                                             .head = draft}; /* --spec mtp: the head */
        if (tdm_disagg_prefill_create(&po, e, sched, &pre) != TDM_OK) {
            tdm_tool_fail("prefill messenger");
            if (pinned) tdm_thread_mask_set(&own_mask);
            goto out_sched;
        }
    } else if (is_decode) {
        /* a head (mtp, eagle): prefill nodes make its KV, and requests draft from their first
         * step */
        dopt.head = spec && head_method ? draft : NULL;
        if (tdm_disagg_decode_create(&dopt, e, sched, &dec) != TDM_OK) {
            tdm_tool_fail("decode messenger");
            if (pinned) tdm_thread_mask_set(&own_mask);
            goto out_sched;
        }
    }
    if (pinned) tdm_thread_mask_set(&own_mask); /* the scheduler thread computes: not pinned */
    if (prefix_caching) { /* salted with the model and the pool's geometry and element type */
        uint64_t salt = 1469598103934665603ull ^ (uint64_t)page ^
                        ((uint64_t)tdm_kv_pool_config(tdm_engine_kv(e))->dtype << 32);
        for (const char *p = model ? model : TDM_DEFAULT_MODEL_FILE; *p; p++)
            salt = (salt ^ (unsigned char)*p) * 1099511628211ull;
        if (tdm_sched_enable_prefix_cache(sched, salt) != TDM_OK) {
            fprintf(stderr, "tandem serve: --prefix-caching: %s\n", tdm_err_msg());
            rc = 2;
            goto out_disagg;
        }
    }
    if (events_ep) { /* the cache's stores and evictions, for KV-aware routers */
        struct tdm_kv_events_opts ko = {.endpoint = events_ep,
                                        .topic = events_topic,
                                        .block_size = page,
                                        .on_gpu = backend_kind == TDM_BACKEND_CUDA};
        struct tdm_prefix_listener ls;
        if (tdm_kv_events_start(&ko, &kv_events) != TDM_OK ||
            (ls = tdm_kv_events_listener(kv_events),
             tdm_sched_set_prefix_listener(sched, &ls) != TDM_OK)) {
            fprintf(stderr, "tandem serve: --kv-events: %s\n", tdm_err_msg());
            rc = 2;
            goto out_disagg;
        }
        fprintf(stderr, "tandem serve: KV cache events on %s (topic \"%s\")\n", events_ep,
                events_topic ? events_topic : "");
    }
    if (tdm_sched_start(sched) != TDM_OK) {
        tdm_tool_fail("scheduler");
        goto out_disagg;
    }
    if (!name) {
        name = model ? model : TDM_DEFAULT_MODEL_FILE;
        const char *slash = strrchr(name, '/');
        if (slash && slash[1]) name = slash + 1;
    }
    struct extra_metrics_ctx xm = {.events = kv_events,
                                   .pre = pre,
                                   .dec = dec,
                                   .spec = spec,
                                   .engine = e,
                                   .placement = placement,
                                   .n_placed = n_placed};
    char fabric_addr[TDM_XFER_ADDR_MAX] = "";
    if ((is_prefill || is_decode) &&
        (is_prefill ? tdm_disagg_prefill_addr(pre, fabric_addr, sizeof fabric_addr)
                    : tdm_disagg_decode_addr(dec, fabric_addr, sizeof fabric_addr)) != TDM_OK) {
        tdm_tool_fail("fabric address");
        goto out_disagg;
    }
    struct tdm_server_opts sv = {.host = host,
                                 .port = (int)port,
                                 .api_key = api_key,
                                 .model_name = name,
                                 .max_body = (size_t)max_body,
                                 .max_connections = (int)h.max_connections,
                                 .idle_timeout_s = (int)h.idle_timeout_s,
                                 .header_timeout_ms = (int)h.header_timeout_ms,
                                 .body_timeout_ms = (int)h.body_timeout_ms,
                                 .http_threads = (int)http_threads,
                                 .tls_cert_pem = tls_cert,
                                 .tls_key_pem = tls_key,
                                 .allowed_origins = h.allowed_origins,
                                 .no_generate = is_prefill,
                                 .extra_metrics = extra_metrics,
                                 .extra_metrics_ctx = &xm,
                                 .fabric_address = fabric_addr[0] ? fabric_addr : NULL,
                                 .disagg_role = is_prefill  ? "prefill"
                                                : is_decode ? "decode"
                                                            : NULL};
    struct tdm_server_model smod = {
        .tok = tok, .chat = have_chat ? &tmpl : NULL, .add_bos = tdm_tok_adds_bos(tok)};
    tdm_status sst = tdm_server_start(&sv, sched, &smod, &srv);
    tdm_tool_http_tls_free(tls_cert, tls_key); /* the server holds its own copy */
    tls_cert = tls_key = NULL;
    if (sst != TDM_OK) {
        tdm_tool_fail("server");
        if (sst == TDM_EINVAL) rc = 2;
        goto out_disagg;
    }
    if (is_prefill || is_decode) {
        const char *addr = fabric_addr;
        fprintf(stderr, "tandem serve: %s node; fabric address %s\n",
                is_prefill ? "prefill" : "decode", addr);
        if (draft && head_method && (is_prefill || spec))
            fprintf(stderr,
                    "tandem serve: speculation head %016llx: %s (the head's KV crosses with "
                    "the prompt's; both nodes must load the same head)\n",
                    (unsigned long long)tdm_spec_head_fingerprint(draft),
                    is_prefill ? "this node runs it over what it prefills for decoders"
                               : "prefill nodes run it, requests draft from their first step");
        if (addr_file && !tdm_tool_write_file_atomic(addr_file, addr)) goto out_server;
    }
    const struct tdm_engine_opts *ef = tdm_engine_opts(e);
    struct tdm_kv_stats ks = tdm_kv_pool_stats(tdm_engine_kv(e));
    const struct tdm_kv_config *kvc = tdm_kv_pool_config(tdm_engine_kv(e));
    fprintf(stderr,
            "tandem serve: model %s; context %d; KV %lld pages of %d tokens, %s, %zu bytes a "
            "page and layer%s; batch %d tokens, %d seqs\n",
            name, ef->max_ctx, (long long)ks.total, ef->page_size, tdm_dtype_name(kvc->dtype),
            tdm_kv_page_bytes(kvc), kvc->latent_v_dim ? " (latent rows)" : "", ef->max_batch_tokens,
            ef->max_seqs);
    if (m->cfg.n_experts) { /* the experts in the memory plan: what is held, what is read */
        int sparse = 0;
        uint64_t one = 0, all = tdm_tool_expert_bytes(m, &sparse, &one);
        fprintf(stderr,
                "tandem serve: experts: %d in each of %d sparse layers, %d a token: %.1f MiB of "
                "the %.1f MiB of weights; a token reads %.1f MiB of them\n",
                m->cfg.n_experts, sparse, m->cfg.n_experts_used, all / 1048576.0,
                m->weight_bytes / 1048576.0,
                (double)one * sparse * m->cfg.n_experts_used / 1048576.0);
    }
    if (spec) { /* what speculation holds, reserved before the KV pool was sized */
        const struct tdm_kv_config *kc = tdm_kv_pool_config(tdm_engine_kv(e));
        double all = (double)tdm_kv_page_bytes_all(kc),
               own = (double)tdm_kv_page_bytes(kc) * kc->n_layers;
        char dkv[160] = "no draft weights or KV of its own";
        if (draft)
            snprintf(dkv, sizeof dkv,
                     "the draft's KV: %.1f MiB of the pool (%.0f%% of each page), its weights %s",
                     (all - own) * (double)kc->n_pages / 1048576.0, 100.0 * (all - own) / all,
                     eo.backend_kind == TDM_BACKEND_CUDA ? "held back by the memory plan"
                                                         : "mapped from its file");
        fprintf(stderr,
                "tandem serve: speculation: %d verify rows, verified where they are sampled; "
                "the drafts' distributions %.1f MiB; %s\n",
                ef->max_logit_rows, (double)ef->reserve_bytes / 1048576.0, dkv);
    }
    tdm_server_set_ready(srv, true);
    fprintf(stderr, "tandem serve: listening on %s://%s:%d\n", h.tls_cert ? "https" : "http", host,
            tdm_server_port(srv));
    if (port_file) {
        char num[32];
        snprintf(num, sizeof num, "%d", tdm_server_port(srv));
        if (!tdm_tool_write_file_atomic(port_file, num)) goto out_server;
    }

    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "tandem serve: %s: draining (up to %lld s)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT", (long long)drain);
    tdm_server_drain(srv);
    if (!tdm_sched_stop(sched, (int)drain * 1000)) {
        /* a step is stuck: nothing can be freed or joined safely; end the process now */
        fprintf(stderr, "tandem serve: the scheduler is stalled in a step; exiting without "
                        "cleanup\n");
        fflush(stderr);
        _exit(3);
    }
    /* the requests have ended; let their responses reach the clients before closing */
    if (!tdm_server_wait_idle(srv, 5000))
        fprintf(stderr, "tandem serve: some responses were still being written; closing\n");
    rc = 0;
    fprintf(stderr, "tandem serve: stopped\n");
out_server:
    tdm_server_stop(srv);
out_disagg:
    tdm_sched_stop(sched, 0);
    tdm_disagg_prefill_destroy(pre);
    tdm_disagg_decode_destroy(dec);
out_sched:
    tdm_sched_destroy(sched);
    tdm_kv_events_stop(kv_events); /* after the cache's last flush is told */
    tdm_spec_destroy(spec);
out_engine:
    tdm_engine_destroy(e);
out_tok:
    tdm_model_free(draft);
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
out_model:
    tdm_model_free(m);
    free_peers(peer_bufs);
    tdm_tool_http_tls_free(tls_cert, tls_key); /* exits before the server started */
    return rc;
}
