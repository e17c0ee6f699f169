/*
 * tandem server: the OpenAI-compatible HTTP API over a scheduler (libmicrohttpd).
 *
 * Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
 * GET /v1/models, GET /health (200 when ready, 503 while starting or draining), GET /metrics
 * (Prometheus text). With an API key, /v1/ routes need `Authorization: Bearer <key>`.
 *
 * Every bad request gets an OpenAI-style error body {"error": {"message", "type", "param",
 * "code"}} with a 4xx status: malformed JSON, wrong types, unknown or unsupported fields, an
 * empty prompt, a prompt past the context, max_tokens <= 0 or past the context, invalid UTF-8,
 * a body over max_body bytes (413), unknown routes (404) and methods (405). The server goes on
 * serving.
 *
 * Threading: libmicrohttpd's event loop over http_threads threads (src/server/front.h). A
 * handler parses and tokenizes its request, submits it to the scheduler and never blocks: with
 * nothing new to write it suspends its connection, and the request's notify hook resumes it
 * when the scheduler publishes (http.c has the waiter's states). A sweeper thread closes
 * connections past their header or body deadline, and finds clients that hung up while
 * suspended (within about 100 ms), which cancels their requests and returns their KV pages.
 * The scheduler never waits for a connection.
 *
 * Ownership: the server borrows the scheduler, tokenizer and chat template; they must outlive
 * it. tdm_server_stop resumes every suspended connection, then stops the daemon.
 */
#ifndef TANDEM_SERVER_H
#define TANDEM_SERVER_H

#include "tandem/core.h"
#include "tandem/kv.h"
#include "tandem/sched.h"
#include "tandem/tok.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_server tdm_server_t;

#define TDM_SERVER_DEFAULT_MAX_BODY (4u << 20) /* bytes of request body */

struct tdm_server_opts {
    const char *host;       /* address to bind; NULL: 127.0.0.1 */
    int port;               /* 0: any free port (see tdm_server_port) */
    const char *api_key;    /* NULL: no authentication */
    const char *model_name; /* the id /v1/models lists and responses carry */
    size_t max_body;        /* 0: TDM_SERVER_DEFAULT_MAX_BODY */
    int max_connections;    /* 0: 10000 */
    int idle_timeout_s;     /* an idle connection is closed after this; 0: 30 */
    int header_timeout_ms;  /* a request's headers must arrive within this; 0: 10000 */
    int body_timeout_ms;    /* and its body within this after them; 0: 30000 */
    int http_threads;       /* threads of the event loop; 0: 4 */
    /* HTTPS: the certificate chain and its private key as PEM text, both or neither (copied);
     * NULL: plain HTTP. */
    const char *tls_cert_pem, *tls_key_pem;
    const char *allowed_origins; /* CORS: "*" or origins separated by commas; NULL: none */
    /* A prefill node: generation routes answer 404 saying so; /health and /metrics stay. */
    bool no_generate;
    /* More Prometheus text appended to /metrics (malloc'd by the callback; NULL: none). */
    char *(*extra_metrics)(void *ctx);
    void *extra_metrics_ctx;
    /* A prefill or decode node: its fabric address (copied), which GET /disagg/address
     * answers, so decoders can find a prefill node from its HTTP address alone
     * (--prefill-peers http://HOST:PORT); NULL: that route answers 404. */
    const char *fabric_address;
    const char *disagg_role; /* "prefill" or "decode", for the same answer */
};

struct tdm_server_model {
    const tdm_tok_t *tok;                 /* required */
    const struct tdm_chat_template *chat; /* NULL: /v1/chat/completions answers 400 */
    bool add_bos;                         /* prepend BOS to completion prompts */
};

tdm_status tdm_server_start(const struct tdm_server_opts *o, tdm_sched_t *sched,
                            const struct tdm_server_model *m, tdm_server_t **out);
int tdm_server_port(const tdm_server_t *s);
/* Marks the server ready (/health answers 200). */
void tdm_server_set_ready(tdm_server_t *s, bool ready);
/* Draining: /health answers 503 and new generation requests get 503; running ones go on. */
void tdm_server_drain(tdm_server_t *s);
/* Waits until every generation response has been written out (or timeout_ms passes; false). */
bool tdm_server_wait_idle(tdm_server_t *s, int timeout_ms);
/* Stops listening, closes connections, waits for their threads, frees. NULL is a no-op. */
void tdm_server_stop(tdm_server_t *s);

/*
 * ---- router (src/server/router.c) ----
 * `tandem router`: the public entry point over several `tandem serve` nodes. Same routes and
 * errors as the server; POST /v1/completions and /v1/chat/completions (and GET /v1/models) go to
 * the healthy backend with the fewest requests in flight from this router (ties round robin),
 * and the backend's status, Content-Type and body come back unchanged, SSE events as they
 * arrive. /health is 200 while at least one backend is healthy, /metrics the router's own
 * counters. A connection error before the backend's response head marks the backend down and
 * retries the request once on another one; a client that goes away closes the backend
 * connection (the backend then cancels the request). A background thread GETs each backend's
 * /health every health_interval_ms. Router errors: 503 (no healthy backend), 502 (no backend
 * could answer), 504 (the backend was silent past timeout_s), 413, 404, 405, 401.
 *
 * Ownership: the router copies what it is given. tdm_router_stop waits for every thread.
 */
typedef struct tdm_router tdm_router_t;

#define TDM_ROUTER_MAX_BACKENDS 64

struct tdm_router_opts {
    const char *host;            /* address to bind; NULL: 127.0.0.1 */
    int port;                    /* 0: any free port (see tdm_router_port) */
    const char *const *backends; /* [n_backends] URLs: http://host:port */
    int n_backends;              /* 1..TDM_ROUTER_MAX_BACKENDS */
    const char *api_key;         /* required from clients; NULL: none */
    const char *backend_api_key; /* sent to backends; NULL: the client's own, if the router
                                    checks none itself */
    int health_interval_ms;      /* 0: 1000 */
    int health_timeout_ms;       /* one health check's limit; 0: 1000 */
    int connect_timeout_ms;      /* 0: 2000 */
    int timeout_s;               /* longest wait for a backend's response head, and between
                                    two pieces of its body; 0: 600 */
    size_t max_body;             /* 0: TDM_SERVER_DEFAULT_MAX_BODY */
    int max_connections;         /* 0: 10000 */
    int http_threads;            /* threads of the event loop; 0: 4 */
    int idle_timeout_s;          /* an idle client connection is closed after this; 0: 600 */
    int header_timeout_ms;       /* a request's headers must arrive within this; 0: 10000 */
    int body_timeout_ms;         /* and its body within this after them; 0: 30000 */
    /* HTTPS toward clients, as tdm_server_opts. */
    const char *tls_cert_pem, *tls_key_pem;
    const char *allowed_origins; /* CORS: "*" or origins separated by commas; NULL: none */
    /* https:// backends are verified against the CA certificates in this PEM file (and their
     * host name or IP address against the certificate); NULL: the system's trust store. */
    const char *backend_ca_file;
    /* Choosing a backend: LEAST_LOADED (default), the fewest requests in flight; PREFIX, the
     * least cost in_flight + prefix_weight * (the share of the prompt's blocks it has not been
     * sent before + half its share of every block sent): a prompt goes where its prefix was
     * sent, unless that backend is busier by about prefix_weight requests, and a new prefix
     * where less is held (server/affinity.c; at most 32 backends). */
    enum tdm_route { TDM_ROUTE_LEAST_LOADED = 0, TDM_ROUTE_PREFIX, TDM_ROUTE_KV } route;
    double prefix_weight; /* 0: 2 */
    /* KV: the same cost, with the prompt tokenized as the backends do (model: its tokenizer
     * and chat template, borrowed) and its whole blocks matched against what each backend's
     * prefix cache holds by the KV events it publishes (kv_events[b]: backend b's ZMQ PUB
     * endpoint, its `tandem serve --kv-events`; NULL or "": none), as Dynamo's KV router
     * weighs overlap against load (server/kv_index.c). */
    const char *const *kv_events;
    const struct tdm_server_model *model;
};

/* Checks every backend once, then listens. Fails on a malformed backend URL or a busy port. */
tdm_status tdm_router_start(const struct tdm_router_opts *o, tdm_router_t **out);
int tdm_router_port(const tdm_router_t *r);
/* Draining: /health answers 503 and new requests get 503; relayed ones go on. */
void tdm_router_drain(tdm_router_t *r);
/* Requests currently in flight to backends. */
int tdm_router_in_flight(tdm_router_t *r);
/* Stops listening, cuts relayed responses, waits for every thread, frees. NULL is a no-op. */
void tdm_router_stop(tdm_router_t *r);

/* ---- KV cache events (server/kv_events.c): the prefix cache's stores and evictions, published
 * on a ZMQ PUB socket in vLLM's KVEventBatch form (BlockStored, BlockRemoved,
 * AllBlocksCleared), for KV-aware routers ---- */
typedef struct tdm_kv_events tdm_kv_events_t;
struct tdm_kv_events_opts {
    const char *endpoint; /* ZMQ bind address, e.g. "tcp://0.0.0.0:5557" */
    const char *topic;    /* the first frame of each message; NULL: "" */
    int block_size;       /* tokens a block (the KV page size) */
    bool on_gpu;          /* medium "GPU", else "CPU" */
};
tdm_status tdm_kv_events_start(const struct tdm_kv_events_opts *o, tdm_kv_events_t **out);
/* Sends what is pending, then closes the socket. NULL is a no-op. */
void tdm_kv_events_stop(tdm_kv_events_t *ev);
/* The listener to give the prefix cache (tdm_sched_set_prefix_listener). */
struct tdm_prefix_listener tdm_kv_events_listener(tdm_kv_events_t *ev);
/* Prometheus text of what was published and dropped; malloc'd. */
char *tdm_kv_events_metrics(tdm_kv_events_t *ev);

/* ---- the Prometheus text format (0.0.4): one writer for every /metrics block (server/metrics.c;
 * the scheduler's, the disaggregation sides', the router's). Labels are "k=\"v\",..." with the
 * values already escaped, or NULL. ---- */
/* A family's # HELP and # TYPE lines (type: "counter", "gauge", "histogram"). */
void tdm_prom_family(struct tdm_sbuf *b, const char *name, const char *type, const char *help);
/* One sample of the family last opened. */
void tdm_prom_sample(struct tdm_sbuf *b, const char *name, const char *labels, double value);
/* A family of one sample. */
void tdm_prom_scalar(struct tdm_sbuf *b, const char *name, const char *type, const char *help,
                     const char *labels, double value);
/* A histogram: the family, cumulative _bucket{le}, _sum, _count; labels go on every sample. */
void tdm_hist_prom(struct tdm_sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                   const char *labels);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_SERVER_H */
