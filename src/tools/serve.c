/*
 * `tandem serve`: the OpenAI-compatible server. Loads the model, builds the engine, starts the
 * scheduler thread and the HTTP server, then waits for SIGTERM or SIGINT in the main thread.
 *
 * Shutdown: /health turns to 503 and new requests are refused; requests in flight get up to
 * --drain-timeout seconds to finish; what is left is cancelled; then the HTTP threads stop.
 * The signals are blocked in every thread and taken with sigwait, so no handler runs inside
 * a library call.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/disagg.h"
#include "tandem/sched.h"
#include "tandem/server.h"
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
        "  --page-size N           tokens per KV page (default 16)\n"
        "  --kv-pages N            KV pool size in pages, or\n"
        "  --kv-memory SIZE        KV pool size in bytes (suffixes K, M, G, KiB, MiB, GiB)\n"
        "  --max-ctx N             context length (default: the model's)\n"
        "  --threads N             CPU threads (default: one per core)\n"
        "  --backend cpu|cuda      compute backend (default cpu)\n"
        "  --gpu-memory-fraction F CUDA: share of GPU memory for weights, workspace and KV (0.9)\n"
        "  --batch-invariant       never use OpenBLAS (see docs/DESIGN.md)\n"
        "  --max-body BYTES        request body limit (default 4194304)\n"
        "  --drain-timeout S       seconds to let requests finish on SIGTERM (default 30)\n"
        "\n"
        "disaggregated prefill and decode (docs/DESIGN.md section 4):\n"
        "  --role both|prefill|decode  both (default): colocated. prefill: takes prefill\n"
        "                          requests from decode nodes over the fabric (no public API\n"
        "                          besides /health and /metrics). decode: the public API,\n"
        "                          prefilling on --prefill-peers\n"
        "  --prefill-peers LIST    comma-separated fabric addresses of prefill nodes, each\n"
        "                          as printed by the prefill node, or @FILE to read it\n"
        "  --xfer-provider P       libfabric provider: tcp;ofi_rxm (default), shm, verbs;ofi_rxm, "
        "efa\n"
        "  --xfer-node ADDR        local address the fabric endpoint binds to\n"
        "  --xfer-addr-file FILE   prefill: write this node's fabric address to FILE\n"
        "  --remote-chunk N        decode: prefill chunk asked of peers (default 256 tokens)\n"
        "  --remote-timeout-ms N   decode: one remote prefill's deadline (default 30000)\n"
        "  --remote-attempts N     decode: peers tried per request before prefilling here (2)\n"
        "  --peer-timeout-ms N     a silent fabric peer is declared dead after this (2000)\n");
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

static void free_peers(char **bufs)
{
    for (int i = 0; i < TDM_DISAGG_MAX_PEERS; i++)
        free(bufs[i]);
}

/* "addr,@file,..." into o->peers (strings kept in bufs). */
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
        if (item[0] == '@') {
            FILE *f = fopen(item + 1, "r");
            char line[TDM_XFER_ADDR_MAX];
            if (!f || !fgets(line, sizeof line, f)) {
                fprintf(stderr, "--prefill-peers: cannot read an address from %s\n", item + 1);
                if (f) fclose(f);
                free(item);
                return false;
            }
            fclose(f);
            line[strcspn(line, " \r\n\t")] = '\0';
            free(item);
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

int tdm_cmd_serve(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"host", required_argument, 0, 'H'},
                                         {"port", required_argument, 0, 'p'},
                                         {"port-file", required_argument, 0, 'P'},
                                         {"api-key", required_argument, 0, 'k'},
                                         {"served-model-name", required_argument, 0, 'n'},
                                         {"max-batch-tokens", required_argument, 0, 'b'},
                                         {"max-seqs", required_argument, 0, 's'},
                                         {"prefill-chunk", required_argument, 0, 'c'},
                                         {"max-waiting", required_argument, 0, 'w'},
                                         {"page-size", required_argument, 0, 'g'},
                                         {"kv-pages", required_argument, 0, 'K'},
                                         {"kv-memory", required_argument, 0, 'M'},
                                         {"max-ctx", required_argument, 0, 'x'},
                                         {"threads", required_argument, 0, 't'},
                                         {"batch-invariant", no_argument, 0, 'I'},
                                         {"max-body", required_argument, 0, 'B'},
                                         {"drain-timeout", required_argument, 0, 'D'},
                                         {"backend", required_argument, 0, 'X'},
                                         {"gpu-memory-fraction", required_argument, 0, 'G'},
                                         {"role", required_argument, 0, 'R'},
                                         {"prefill-peers", required_argument, 0, 'E'},
                                         {"xfer-provider", required_argument, 0, 'F'},
                                         {"xfer-node", required_argument, 0, 'N'},
                                         {"xfer-addr-file", required_argument, 0, 'A'},
                                         {"remote-chunk", required_argument, 0, 'C'},
                                         {"remote-timeout-ms", required_argument, 0, 'T'},
                                         {"remote-attempts", required_argument, 0, 'a'},
                                         {"peer-timeout-ms", required_argument, 0, 'o'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *host = "127.0.0.1", *port_file = NULL, *name = NULL;
    const char *api_key = getenv("TANDEM_API_KEY");
    int64_t port = 8000, mbt = 512, seqs = 64, chunk = 0, waiting = 1024, page = 16, pages = 0;
    int64_t ctx = 0, threads = 0, max_body = TDM_SERVER_DEFAULT_MAX_BODY, drain = 30;
    size_t kv_bytes = 0;
    bool inv = false;
    const char *role = "both", *peers_arg = NULL, *provider = NULL, *xnode = NULL;
    const char *addr_file = NULL;
    int64_t rchunk = 256, rtimeout = 30000, rattempts = 2, peer_timeout = 2000;
    int backend_kind = TDM_BACKEND_CPU;
    double gpu_frac = 0.9;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm':
            model = optarg;
            break;
        case 'H':
            host = optarg;
            break;
        case 'p':
            ok = tdm_tool_int("--port", optarg, 0, 65535, &port);
            break;
        case 'P':
            port_file = optarg;
            break;
        case 'k':
            api_key = optarg;
            break;
        case 'n':
            name = optarg;
            break;
        case 'b':
            ok = tdm_tool_int("--max-batch-tokens", optarg, 1, 1 << 20, &mbt);
            break;
        case 's':
            ok = tdm_tool_int("--max-seqs", optarg, 1, 4096, &seqs);
            break;
        case 'c':
            ok = tdm_tool_int("--prefill-chunk", optarg, 1, 1 << 20, &chunk);
            break;
        case 'w':
            ok = tdm_tool_int("--max-waiting", optarg, 1, 1 << 20, &waiting);
            break;
        case 'g':
            ok = tdm_tool_int("--page-size", optarg, 1, 1024, &page);
            break;
        case 'K':
            ok = tdm_tool_int("--kv-pages", optarg, 1, INT32_MAX, &pages);
            break;
        case 'M':
            if (!(ok = parse_size(optarg, &kv_bytes)))
                fprintf(stderr, "--kv-memory: '%s' is not a size like 2GiB or 512M\n", optarg);
            break;
        case 'x':
            ok = tdm_tool_int("--max-ctx", optarg, 2, 1 << 24, &ctx);
            break;
        case 't':
            ok = tdm_tool_int("--threads", optarg, 1, 1024, &threads);
            break;
        case 'I':
            inv = true;
            break;
        case 'B':
            ok = tdm_tool_int("--max-body", optarg, 1024, 1 << 30, &max_body);
            break;
        case 'D':
            ok = tdm_tool_int("--drain-timeout", optarg, 0, 3600, &drain);
            break;
        case 'X':
            if (!strcmp(optarg, "cuda")) {
                backend_kind = TDM_BACKEND_CUDA;
            } else if (strcmp(optarg, "cpu")) {
                fprintf(stderr, "--backend: '%s' is not cpu or cuda\n", optarg);
                ok = false;
            }
            break;
        case 'G':
            ok = tdm_tool_float("--gpu-memory-fraction", optarg, 0.05, 1.0, &gpu_frac);
            break;
        case 'R':
            role = optarg;
            if (strcmp(role, "both") && strcmp(role, "prefill") && strcmp(role, "decode")) {
                fprintf(stderr, "--role: '%s' is not both, prefill or decode\n", optarg);
                ok = false;
            }
            break;
        case 'E':
            peers_arg = optarg;
            break;
        case 'F':
            provider = optarg;
            break;
        case 'N':
            xnode = optarg;
            break;
        case 'A':
            addr_file = optarg;
            break;
        case 'C':
            ok = tdm_tool_int("--remote-chunk", optarg, 1, 1 << 20, &rchunk);
            break;
        case 'T':
            ok = tdm_tool_int("--remote-timeout-ms", optarg, 100, 3600000, &rtimeout);
            break;
        case 'a':
            ok = tdm_tool_int("--remote-attempts", optarg, 0, 16, &rattempts);
            break;
        case 'o':
            ok = tdm_tool_int("--peer-timeout-ms", optarg, 100, 600000, &peer_timeout);
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            fprintf(stderr, "tandem serve: unknown or incomplete option '%s'\n", argv[optind - 1]);
            usage(stderr);
            return 2;
        }
        if (!ok) return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tandem serve: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    bool is_prefill = !strcmp(role, "prefill"), is_decode = !strcmp(role, "decode");
    if (is_decode && !peers_arg) {
        fprintf(stderr, "tandem serve: --role decode needs --prefill-peers\n");
        return 2;
    }
    if (!is_decode && peers_arg) {
        fprintf(stderr, "tandem serve: --prefill-peers is for --role decode\n");
        return 2;
    }
    if ((is_prefill || is_decode) && backend_kind == TDM_BACKEND_CUDA) {
        fprintf(stderr,
                "tandem serve: --role %s with --backend cuda is not supported yet: the KV "
                "messenger moves host-memory pages (GPU pages need the CUDA IPC transport "
                "or host staging)\n",
                role);
        return 2;
    }
    if (!is_prefill && addr_file) {
        fprintf(stderr, "tandem serve: --xfer-addr-file is for --role prefill\n");
        return 2;
    }
    struct tdm_disagg_decode_opts dopt = {
        .xfer = {.provider = provider, .node = xnode, .peer_timeout_ms = (int)peer_timeout},
        .chunk = (int)rchunk,
        .timeout_ms = (int)rtimeout,
        .max_attempts = rattempts ? (int)rattempts : -1};
    char *peer_bufs[TDM_DISAGG_MAX_PEERS] = {0};
    if (is_decode && !parse_peers(peers_arg, &dopt, peer_bufs)) {
        free_peers(peer_bufs);
        return 2;
    }
    if (pages && kv_bytes) {
        fprintf(stderr, "tandem serve: give --kv-pages or --kv-memory, not both\n");
        return 2;
    }

    /* Block the shutdown signals before any thread starts, so all threads inherit the mask. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int rc = 1;
    tdm_disagg_prefill_t *pre = NULL;
    tdm_disagg_decode_t *dec = NULL;
    struct tdm_model *m = tdm_tool_load_model(model);
    if (!m) {
        free_peers(peer_bufs);
        return 1;
    }
    tdm_tok_t *tok = tdm_tool_load_tokenizer(m, false);
    tdm_engine_t *e = NULL;
    tdm_sched_t *sched = NULL;
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
    struct tdm_engine_opts eo = {.n_threads = (int)threads,
                                 .batch_invariant = inv,
                                 .page_size = (int)page,
                                 .kv_pages = pages,
                                 .kv_bytes = kv_bytes,
                                 .max_ctx = (int)ctx,
                                 .max_batch_tokens = (int)mbt,
                                 .max_seqs = (int)seqs,
                                 .max_logit_rows = (int)seqs,
                                 .count_layers = is_prefill,
                                 .backend_kind = backend_kind,
                                 .gpu_memory_fraction = gpu_frac};
    if (tdm_engine_create(m, &eo, &e) != TDM_OK) {
        tdm_tool_fail("engine");
        goto out_tok;
    }
    struct tdm_sched_opts so = {.max_batch_tokens = (int)mbt,
                                .max_seqs = (int)seqs,
                                .prefill_chunk = (int)chunk,
                                .max_waiting = (int)waiting};
    if (tdm_sched_create(e, tok, &so, &sched) != TDM_OK) {
        tdm_tool_fail("scheduler");
        goto out_engine;
    }
    if (is_prefill) {
        struct tdm_disagg_prefill_opts po = {
            .xfer = {.provider = provider, .node = xnode, .peer_timeout_ms = (int)peer_timeout}};
        if (tdm_disagg_prefill_create(&po, e, sched, &pre) != TDM_OK) {
            tdm_tool_fail("prefill messenger");
            goto out_sched;
        }
    } else if (is_decode) {
        if (tdm_disagg_decode_create(&dopt, e, sched, &dec) != TDM_OK) {
            tdm_tool_fail("decode messenger");
            goto out_sched;
        }
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
    struct tdm_server_opts sv = {.host = host,
                                 .port = (int)port,
                                 .api_key = api_key,
                                 .model_name = name,
                                 .max_body = (size_t)max_body,
                                 .no_generate = is_prefill,
                                 .extra_metrics = is_prefill  ? tdm_disagg_prefill_metrics
                                                  : is_decode ? tdm_disagg_decode_metrics
                                                              : NULL,
                                 .extra_metrics_ctx = is_prefill ? (void *)pre : (void *)dec};
    struct tdm_server_model smod = {
        .tok = tok, .chat = have_chat ? &tmpl : NULL, .add_bos = tdm_tok_adds_bos(tok)};
    if (tdm_server_start(&sv, sched, &smod, &srv) != TDM_OK) {
        tdm_tool_fail("server");
        goto out_disagg;
    }
    if (is_prefill) {
        char addr[TDM_XFER_ADDR_MAX];
        if (tdm_disagg_prefill_addr(pre, addr, sizeof addr) != TDM_OK) {
            tdm_tool_fail("fabric address");
            goto out_server;
        }
        fprintf(stderr, "tandem serve: prefill node; fabric address %s\n", addr);
        if (addr_file && !tdm_tool_write_file_atomic(addr_file, addr)) goto out_server;
    }
    const struct tdm_engine_opts *ef = tdm_engine_opts(e);
    struct tdm_kv_stats ks = tdm_kv_pool_stats(tdm_engine_kv(e));
    fprintf(stderr,
            "tandem serve: model %s; context %d; KV %lld pages of %d tokens; batch %d tokens, "
            "%d seqs\n",
            name, ef->max_ctx, (long long)ks.total, ef->page_size, ef->max_batch_tokens,
            ef->max_seqs);
    tdm_server_set_ready(srv, true);
    fprintf(stderr, "tandem serve: listening on http://%s:%d\n", host, tdm_server_port(srv));
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
    tdm_sched_stop(sched, (int)drain * 1000);
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
out_engine:
    tdm_engine_destroy(e);
out_tok:
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
out_model:
    tdm_model_free(m);
    free_peers(peer_bufs);
    return rc;
}
