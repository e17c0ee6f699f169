/*
 * `tandem router`: the public OpenAI endpoint over several `tandem serve` nodes (the router
 * itself is src/server/router.c). Parses the options, starts the router, then waits for SIGTERM
 * or SIGINT in the main thread.
 *
 * Shutdown: /health turns to 503 and new requests are refused; responses being relayed get up to
 * --drain-timeout seconds to finish; then the router stops, cutting what is left. The signals are
 * blocked in every thread and taken with sigwait, so no handler runs inside a library call.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/server.h"
#include "tools/tools_int.h"

static bool opt_route(const char *arg, void *dst)
{
    static const struct {
        const char *name;
        enum tdm_route route;
    } routes[] = {{"least-loaded", TDM_ROUTE_LEAST_LOADED},
                  {"prefix", TDM_ROUTE_PREFIX},
                  {"kv", TDM_ROUTE_KV}};
    for (size_t i = 0; i < sizeof routes / sizeof *routes; i++)
        if (!strcmp(arg, routes[i].name)) {
            *(enum tdm_route *)dst = routes[i].route;
            return true;
        }
    fprintf(stderr, "--route: '%s' is not least-loaded, prefix or kv\n", arg);
    return false;
}

static void usage(FILE *f)
{
    fprintf(
        f, "usage: tandem router --backends URL[,URL...] [options]\n"
           "\n"
           "  --backends URLS         `tandem serve` nodes, comma-separated: http://host:port\n"
           "  --host ADDR             numeric address to bind (default 127.0.0.1)\n"
           "  --port N                TCP port (default 8080; 0 picks a free one)\n"
           "  --port-file FILE        write the bound port to FILE once listening\n"
           "  --api-key KEY           require Authorization: Bearer KEY (or $TANDEM_API_KEY)\n"
           "  --backend-api-key KEY   send Authorization: Bearer KEY to the backends\n"
           "  --backend-ca FILE       PEM CA certificates that https:// backends are verified\n"
           "                          against (default: the system's trust store)\n"
           "  --health-interval-ms N  how often each backend's /health is checked (1000)\n"
           "  --health-timeout-ms N   limit of one health check (1000)\n"
           "  --connect-timeout-ms N  limit of one connect to a backend (2000)\n"
           "  --timeout S             longest wait for a backend's answer, and between two\n"
           "                          pieces of it, in seconds (600)\n"
           "  --http-threads N        threads of the HTTP event loop (default 4); relayed streams\n"
           "                          wait in one more thread, not one each\n"
           "  --max-body BYTES        request body limit (default 4194304)\n" TDM_TOOL_HTTP_USAGE
           "  --drain-timeout S       seconds to let responses finish on SIGTERM (default 30)\n"
           "  --route least-loaded|prefix|kv  least-loaded (default): the fewest requests in\n"
           "                          flight; prefix: a prompt goes where its prefix went\n"
           "                          before (the backend has probably cached it), unless that\n"
           "                          backend is busier by more than --prefix-weight requests;\n"
           "                          kv: the same, matching the prompt's tokens against what\n"
           "                          each backend's cache holds by its KV events\n"
           "  --prefix-weight W       prefix, kv: what a whole-prompt match is worth, in\n"
           "                          requests in flight (default 2)\n"
           "  --kv-events ENDPOINTS   kv: each backend's KV events endpoint (its `tandem serve\n"
           "                          --kv-events`, e.g. tcp://10.0.0.5:5557), comma-separated,\n"
           "                          in the order of --backends\n"
           "  --model PATH            kv: the model whose tokenizer and chat template the\n"
           "                          backends use (default: the default model; weights are not\n"
           "                          loaded)\n");
}

/* Splits "a,b,c" into a malloc'd array of malloc'd strings; false on an empty item. */
static bool split_backends(const char *s, char ***out, int *n_out)
{
    char **v = NULL;
    int n = 0;
    for (const char *p = s;;) {
        size_t len = strcspn(p, ",");
        if (len == 0 || n >= TDM_ROUTER_MAX_BACKENDS) goto out_free;
        char **nv = realloc(v, (size_t)(n + 1) * sizeof *v);
        if (!nv) goto out_free;
        v = nv;
        if (!(v[n] = strndup(p, len))) goto out_free;
        n++;
        if (!p[len]) break;
        p += len + 1;
    }
    *out = v;
    *n_out = n;
    return true;
out_free:
    for (int i = 0; i < n; i++)
        free(v[i]);
    free(v);
    return false;
}

int tdm_cmd_router(int argc, char **argv)
{
    const char *backends = NULL, *backend_key = NULL, *backend_ca = NULL, *kv_events = NULL,
               *model_path = NULL;
    struct tdm_tool_http h = {.host = "127.0.0.1",
                              .api_key = getenv("TANDEM_API_KEY"),
                              .port = 8080,
                              .max_body = TDM_SERVER_DEFAULT_MAX_BODY,
                              .drain_s = 30,
                              .max_connections = 10000};
    int64_t interval = 1000, health_timeout = 1000, connect_timeout = 2000, timeout = 600,
            http_threads = 4;
    enum tdm_route route = TDM_ROUTE_LEAST_LOADED;
    double prefix_weight = 2.0;
    struct tdm_opt http[TDM_TOOL_HTTP_OPTS];
    tdm_tool_http_table(&h, http);
    const struct tdm_opt own[] = {
        TDM_OPT_S("backends", &backends),
        TDM_OPT_S("backend-api-key", &backend_key),
        TDM_OPT_S("backend-ca", &backend_ca),
        TDM_OPT_I("health-interval-ms", &interval, 10, 3600 * 1000),
        TDM_OPT_I("health-timeout-ms", &health_timeout, 10, 600 * 1000),
        TDM_OPT_I("connect-timeout-ms", &connect_timeout, 10, 600 * 1000),
        TDM_OPT_I("timeout", &timeout, 1, 24 * 3600),
        TDM_OPT_I("http-threads", &http_threads, 1, 256),
        TDM_OPT_P("route", opt_route, &route),
        TDM_OPT_F("prefix-weight", &prefix_weight, 0.001, 1e6),
        TDM_OPT_S("kv-events", &kv_events),
        TDM_OPT_S("model", &model_path),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {http, own, NULL};
    int prc = tdm_tool_parse("router", argc, argv, tables, usage);
    if (prc) return prc == 1 ? 0 : 2;
    const char *host = h.host, *port_file = h.port_file, *api_key = h.api_key;
    int64_t port = h.port, max_body = h.max_body, drain = h.drain_s;
    if (!backends) {
        fprintf(stderr, "tandem router: --backends is required\n");
        usage(stderr);
        return 2;
    }
    char **urls = NULL;
    int n_urls = 0;
    if (!split_backends(backends, &urls, &n_urls)) {
        fprintf(stderr,
                "tandem router: --backends: expected 1 to %d comma-separated URLs, with no empty "
                "item\n",
                TDM_ROUTER_MAX_BACKENDS);
        return 2;
    }

    int rc = 2;
    char *tls_cert = NULL, *tls_key = NULL;
    char **events = NULL;
    int n_events = 0;
    struct tdm_model *text = NULL;
    tdm_tok_t *tok = NULL;
    struct tdm_chat_template tmpl = {0};
    struct tdm_server_model sm = {0};
    if ((kv_events || model_path) && route != TDM_ROUTE_KV) {
        fprintf(stderr, "tandem router: --kv-events and --model go with --route kv\n");
        goto out_urls;
    }
    if (route == TDM_ROUTE_KV) {
        if (!kv_events || !split_backends(kv_events, &events, &n_events) || n_events != n_urls) {
            fprintf(stderr,
                    "tandem router: --route kv needs --kv-events with one endpoint for each of "
                    "the %d backends, comma-separated\n",
                    n_urls);
            goto out_urls;
        }
        char def[4096];
        if (!model_path && tdm_default_model_path(def, sizeof def)) model_path = def;
        if (!model_path || tdm_model_open_text(model_path, &text) != TDM_OK) {
            fprintf(stderr, "tandem router: --model %s: %s\n", model_path ? model_path : "(none)",
                    tdm_err_msg());
            goto out_urls;
        }
        if (!(tok = tdm_tool_load_tokenizer(text, false))) goto out_urls;
        sm = (struct tdm_server_model){.tok = tok, .add_bos = tdm_tok_adds_bos(tok)};
        if (text->chat_template && tdm_chat_template_detect(text->chat_template, &tmpl) == TDM_OK)
            sm.chat = &tmpl; /* without: chat requests go least loaded */
    }
    if (!tdm_tool_http_tls("router", &h, &tls_cert, &tls_key)) goto out_urls;
    sigset_t sigs = tdm_tool_block_shutdown_signals();

    rc = 1;
    struct tdm_router_opts ro = {.host = host,
                                 .port = (int)port,
                                 .backends = (const char *const *)urls,
                                 .n_backends = n_urls,
                                 .api_key = api_key,
                                 .backend_api_key = backend_key,
                                 .health_interval_ms = (int)interval,
                                 .health_timeout_ms = (int)health_timeout,
                                 .connect_timeout_ms = (int)connect_timeout,
                                 .timeout_s = (int)timeout,
                                 .max_body = (size_t)max_body,
                                 .max_connections = (int)h.max_connections,
                                 .route = route,
                                 .prefix_weight = prefix_weight,
                                 .http_threads = (int)http_threads,
                                 .idle_timeout_s = (int)h.idle_timeout_s,
                                 .header_timeout_ms = (int)h.header_timeout_ms,
                                 .body_timeout_ms = (int)h.body_timeout_ms,
                                 .tls_cert_pem = tls_cert,
                                 .tls_key_pem = tls_key,
                                 .allowed_origins = h.allowed_origins,
                                 .backend_ca_file = backend_ca,
                                 .kv_events = (const char *const *)events,
                                 .model = route == TDM_ROUTE_KV ? &sm : NULL};
    tdm_router_t *r = NULL;
    tdm_status st = tdm_router_start(&ro, &r);
    tdm_tool_http_tls_free(tls_cert, tls_key); /* the router holds its own copy */
    if (st != TDM_OK) {
        tdm_tool_fail("router");
        rc = st == TDM_EINVAL || st == TDM_ENOTFOUND || st == TDM_EUNSUPPORTED ? 2 : 1;
        goto out_urls;
    }
    fprintf(stderr, "tandem router: listening on %s://%s:%d over %d backend%s\n",
            h.tls_cert ? "https" : "http", host, tdm_router_port(r), n_urls,
            n_urls == 1 ? "" : "s");
    if (port_file) {
        char num[32];
        snprintf(num, sizeof num, "%d", tdm_router_port(r));
        if (!tdm_tool_write_file_atomic(port_file, num)) goto out_router;
    }

    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "tandem router: %s: draining (up to %lld s)\n",
            sig == SIGTERM ? "SIGTERM" : "SIGINT", (long long)drain);
    tdm_router_drain(r);
    uint64_t deadline = tdm_now_ns() + (uint64_t)drain * 1000000000ull;
    while (tdm_router_in_flight(r) > 0 && tdm_now_ns() < deadline)
        nanosleep(&(struct timespec){.tv_nsec = 20 * 1000000}, NULL);
    rc = 0;
    fprintf(stderr, "tandem router: stopped\n");
out_router:
    tdm_router_stop(r);
out_urls:
    for (int i = 0; i < n_urls; i++)
        free(urls[i]);
    free(urls);
    for (int i = 0; i < n_events; i++)
        free(events[i]);
    free(events);
    tdm_chat_template_clear(&tmpl);
    tdm_tok_free(tok);
    tdm_model_free(text);
    return rc;
}
