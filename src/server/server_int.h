/*
 * Private parts of the server module: the OpenAI request parser and response renderers
 * (openai.c), and the Prometheus renderer (metrics.c), which http.c drives.
 *
 * Everything here is pure: no sockets, no threads. The parser turns untrusted JSON into a
 * validated request or an (HTTP status, message, param) triple; the renderers turn a request's
 * output view into JSON text.
 */
#ifndef TANDEM_SERVER_INT_H
#define TANDEM_SERVER_INT_H

#include <jansson.h>

#include "tandem/sched.h"
#include "tandem/server.h"
#include "tandem/tok.h"

struct api_err {
    int status; /* HTTP status */
    const char *type;
    const char *code; /* OpenAI's error.code ("context_length_exceeded", ...) or NULL */
    char message[512];
    char param[64]; /* "" for none */
};

struct api_ctx {
    const tdm_tok_t *tok;
    const struct tdm_chat_template *chat;
    bool add_bos;
    const char *model_name;
    int max_ctx;
    int vocab;
    int32_t fim[3];       /* fill-in-the-middle tokens: prefix, suffix, middle; -1 when the
                           * vocabulary lacks them (then 'suffix' is refused) */
    bool prefix_caching;  /* usage carries prompt_tokens_details.cached_tokens */
    tdm_gvocab_t *gvocab; /* the vocabulary as bytes, for structured output; NULL: refused */
    size_t max_piece;     /* bytes of the vocabulary's longest token: text of B bytes has at least
                           * B / max_piece tokens, so a prompt far over the context is refused
                           * before it is tokenized; 0: unknown */
};

/* One prompt of a request: its tokens, and echo's text of it (api_req.echo_text). */
struct api_prompt {
    int32_t *ids;
    int n;
    char *echo_text;
    size_t echo_len;
    int echo_skip;
};

/* ---- tools (tools.c): the chat formats of tool calls, read back from the output ---- */
enum { TDM_TOOLS_HERMES = 0, TDM_TOOLS_LLAMA3 };
enum {
    TDM_TOOL_CHOICE_NONE = 0,
    TDM_TOOL_CHOICE_AUTO,
    TDM_TOOL_CHOICE_REQUIRED,
    TDM_TOOL_CHOICE_NAMED
};
#define TDM_API_MAX_TOOLS 128

/* Bytes appended to (oom: an append failed and was dropped) */
struct api_text {
    char *p;
    size_t n;
    bool oom;
};
/* One choice's scanner: where it stands in the released text */
struct api_tool_scan {
    size_t pos;             /* consumed up to here */
    size_t call_start;      /* in a block (or llama3's JSON): where the call's JSON starts */
    size_t ws_from, ws_len; /* whitespace held back */
    bool in_call;
    int mode; /* llama3: 0 undecided, 1 content, 2 a call */
    int n_calls;
};
/* Consumes text[pos, len) (the text released so far; final: all of it): appends the content
 * that can no longer become a call to *content and each call that closed, {"name", "arguments"
 * (JSON text)}, to calls. */
void tdm_api_tools_scan(struct api_tool_scan *ts, int format, const char *text, size_t len,
                        bool final, struct api_text *content, json_t *calls);

#define TDM_API_MAX_PROMPTS    64  /* a completions list of prompts */
#define TDM_API_MAX_CANDIDATES 256 /* prompts x best_of: the requests one body may start */

struct api_req {
    bool chat, stream, include_usage;
    bool continuous_usage; /* stream_options.continuous_usage_stats: usage in every chunk */
    bool chat_logprobs;    /* chat: logprobs true (top_logprobs may be 0) */
    /* completions' echo: the prompt's text comes before the completion's, and with logprobs
     * its tokens' log-probabilities before the completion's (the scheduler's
     * prompt_logprobs). echo_text: a text prompt as sent, a token prompt's pieces; echo_skip:
     * the leading tokens the text does not hold (a BOS the server added). */
    bool echo;
    char *echo_text;
    size_t echo_len;
    int echo_skip;
    /* the fields above (prompt, n_prompt, echo_*) are the first prompt; a completions list of
     * prompts has n_prompts > 1, the later ones in more[n_prompts - 1] (tdm_api_prompt) */
    int n_prompts;
    struct api_prompt *more;
    /* n choices a prompt, from best_of candidates (best_of >= n; the n with the highest
     * cumulative log-probability are returned); hide_logprobs: logprobs were computed for that
     * ranking alone */
    int n, best_of;
    bool hide_logprobs;
    int32_t *prompt; /* malloc'd */
    int n_prompt;
    /* structured output (response_format, guided_*, regex, structured_outputs): a reference,
     * also in p.grammar; NULL: none */
    tdm_grammar_t *grammar;
    /* chat tools: as sent (JSON text each, for the template), their names; tool_choice; the
     * output is scanned for calls (tools_parse: tools given and tool_choice not none) in the
     * template's format */
    int n_tools;
    char **tool_json, **tool_names;
    int tool_choice, tool_format;
    int named_tool; /* tool_choice names this one */
    bool parallel_tools, tools_parse;
    int32_t *bias_ids; /* logit_bias, malloc'd (NULL: none) */
    float *bias_vals;
    int n_bias;
    struct tdm_req_params p;
    char *stops[TDM_MAX_STOP_STRINGS]; /* owned copies, for the request's reader */
    int n_stops;
};

/* Fills c->fim from c->tok: StarCoder's <fim_prefix>, <fim_suffix>, <fim_middle>, or Qwen's
 * <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>; -1 each when the set is incomplete. */
void tdm_api_find_fim(struct api_ctx *c);
/* `name` is the model this server serves; else false with err (404, model_not_found). */
bool tdm_api_model_known(const struct api_ctx *c, const char *name, struct api_err *err);
/* Parses a request body. On failure fills err (status 4xx) and returns false. On success the
 * caller frees with tdm_api_req_free. */
bool tdm_api_parse(const struct api_ctx *c, bool chat, const char *body, size_t len,
                   struct api_req *out, struct api_err *err);
void tdm_api_req_free(struct api_req *r);
/* Prompt i (0 .. n_prompts - 1) of a parsed request (a view: r owns it). */
struct api_prompt tdm_api_prompt(const struct api_req *r, int i);
/* The scheduler's parameters of candidate j (0 .. best_of - 1) of prompt i: r->p with that
 * prompt, and for j > 0 a seed of its own derived from r's (candidate 0 has r's seed, so one
 * choice is what the same request without n gives). */
void tdm_api_candidate(const struct api_req *r, int i, int j, struct tdm_req_params *out);

/* {"error": {...}} as a malloc'd string. */
char *tdm_api_error_json(const struct api_err *e);
void tdm_api_err_set(struct api_err *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* One choice of a response: its index, its prompt (tdm_api_prompt), its request's view, and
 * the view holding its prompt's log-probabilities (echo: the prompt's first candidate, the
 * one that scored it). */
struct api_choice {
    int index, prompt;
    const struct tdm_req_view *v, *pv;
};
struct api_usage {
    int prompt_tokens, completion_tokens;
    int cached_tokens; /* of the prompt tokens, found in the prefix cache */
};

/* Rendering. `id` is "cmpl-..." or "chatcmpl-...". All return malloc'd strings (NULL on OOM). */
char *tdm_api_render_full(const struct api_ctx *c, const struct api_req *r, const char *id,
                          long created, const struct api_choice *ch, int n_ch, struct api_usage u);
/* One SSE event ("data: {...}\n\n") for outputs [from, to) of one choice. `first` adds the
 * chat role delta (and echo's prompt); finish adds finish_reason. */
char *tdm_api_render_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                           long created, const struct api_choice *ch, int from, int to,
                           size_t text_from, bool first, bool finish);
/* A chat chunk of a request whose output is scanned for tool calls: the content released since
 * the last one and the calls that closed, from ts (this choice's scanner). */
char *tdm_api_render_tool_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                                long created, const struct api_choice *ch, int from, int to,
                                struct api_tool_scan *ts, bool first, bool finish);
char *tdm_api_render_usage_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                                 long created, struct api_usage u);
char *tdm_api_render_models(const struct api_ctx *c, long created);
/* GET /v1/models/{id}: the model object alone. */
char *tdm_api_render_model(const struct api_ctx *c, long created);
/* vLLM's POST /tokenize ({"prompt": text} or {"messages": [...]}, add_special_tokens,
 * add_generation_prompt, return_token_strs) and POST /detokenize ({"tokens": [...]}): the
 * answer's JSON, or NULL with err filled. */
char *tdm_api_tokenize(const struct api_ctx *c, const char *body, size_t len, struct api_err *err);
/* The prompt a generation request's body would run (its first, for a list of prompts), as
 * token ids (malloc'd), the way tdm_api_parse makes it: a chat's messages and tools through
 * the template, a completion's text with BOS where the model adds one. Nothing else of the body
 * is checked. false (nothing allocated) for a body it cannot make a prompt of, or a
 * fill-in-the-middle one. For the router's KV-aware routing. */
bool tdm_api_prompt_ids(const struct api_ctx *c, bool chat, const char *body, size_t len,
                        int32_t **ids, int *n);
char *tdm_api_detokenize(const struct api_ctx *c, const char *body, size_t len,
                         struct api_err *err);

/* Valid UTF-8 copy of bytes, invalid sequences replaced by U+FFFD. */
char *tdm_utf8_sanitize(const char *s, size_t n, size_t *out_len);

/* Prometheus text exposition of a metrics snapshot, plus HTTP status counters. */
/* The structured-output grammar cache's counters (tdm_gvocab_cache_stats); on: it exists */
struct api_grammar_metrics {
    bool on;
    int entries;
    uint64_t hits, misses;
};
char *tdm_metrics_render(const struct tdm_sched_metrics_snapshot *m,
                         const struct api_grammar_metrics *gm, const uint64_t *http_by_class,
                         const char *model_name);

/* ---- the KV index (kv_index.c): the router's view of its backends' prefix caches, from their
 * KV cache events (--route kv) ---- */
struct tdm_kv_index;
struct tdm_kv_index_stats {
    uint64_t stored, removed, cleared; /* blocks stored and removed, caches cleared */
    uint64_t orphans; /* blocks stored under a parent the index does not know: not indexed */
    uint64_t refused; /* blocks of another block size than the first seen: not indexed */
    uint64_t full;    /* blocks not indexed: the tables were full */
    uint64_t bad;     /* malformed batches (events read whole before one went wrong stay) */
};
/* An index for about `capacity` blocks over all backends. */
tdm_status tdm_kv_index_new(size_t capacity, struct tdm_kv_index **out);
void tdm_kv_index_free(struct tdm_kv_index *x);
/* Applies one KV event batch (the msgpack payload frame) that backend b (< 64) published.
 * TDM_EFORMAT on bytes that are not one; the events before the bad one are applied. */
tdm_status tdm_kv_index_apply(struct tdm_kv_index *x, int b, const void *payload, size_t len);
/* The block size of the stored blocks (the first one seen; 0 before any). */
int tdm_kv_index_block_size(const struct tdm_kv_index *x);
/* The chained keys of the whole blocks of a prompt's token ids (at most max; 0 before the
 * block size is known). */
int tdm_kv_index_keys(const struct tdm_kv_index *x, const int32_t *ids, int n, uint64_t *keys,
                      int max);
/* How long the blocks of a request that ended still count as held by its backend while its
 * BlockStored events are not in (ms). */
#define TDM_KV_LANDING_MS 5000
/* Requests routed to backend b with these prompt keys: delta +1 when one is sent, -1 when it
 * ends. A backend holds the blocks of its requests in flight, for matching, and for
 * TDM_KV_LANDING_MS after the last ends unless its events confirm them first. now_ms: a
 * monotonic clock (it expires what landed before). */
void tdm_kv_index_pend(struct tdm_kv_index *x, int b, const uint64_t *keys, int n, int delta,
                       int64_t now_ms);
/* Forgets the landed entries whose time is up at now_ms. */
void tdm_kv_index_expire(struct tdm_kv_index *x, int64_t now_ms);
/* matched[b] (b < n_backends): how many leading keys backend b holds (or has in flight, or
 * landing at now_ms). */
void tdm_kv_index_match(const struct tdm_kv_index *x, const uint64_t *keys, int n, int n_backends,
                        int *matched, int64_t now_ms);
/* Backend b's share of the blocks the index holds (0 when empty), and its count. */
double tdm_kv_index_share(const struct tdm_kv_index *x, int b, int n_backends);
int64_t tdm_kv_index_held(const struct tdm_kv_index *x, int b);
/* Everything backend b held is gone (its cache was cleared, or it restarted). */
void tdm_kv_index_forget(struct tdm_kv_index *x, int b);
struct tdm_kv_index_stats tdm_kv_index_stats(const struct tdm_kv_index *x);

/* ---- the subscriber (kv_sub.c): a thread that feeds the index from the backends' KV event
 * sockets ---- */
#define TDM_KV_SUB_MAX_KEYS 4096 /* prompt blocks a KV pick looks at */
struct tdm_kv_sub;
/* Subscribes to endpoints[b] for backend b (NULL or "": none), and starts the thread. */
tdm_status tdm_kv_sub_start(const char *const *endpoints, int n, struct tdm_kv_sub **out);
void tdm_kv_sub_stop(struct tdm_kv_sub *s); /* NULL is a no-op */
/* A prompt's token ids as index keys (at most max; 0 before any block size is known). */
int tdm_kv_sub_keys(struct tdm_kv_sub *s, const int32_t *ids, int n_ids, uint64_t *keys, int max);
/* For a prompt's keys: matched[b], the leading blocks backend b holds or has in flight, and
 * share[b], its share of all indexed blocks (b < n_backends). */
void tdm_kv_sub_match(struct tdm_kv_sub *s, const uint64_t *keys, int n, int n_backends,
                      int *matched, double *share);
/* tdm_kv_index_pend under the subscriber's lock. */
void tdm_kv_sub_pend(struct tdm_kv_sub *s, int b, const uint64_t *keys, int n, int delta);
/* Prometheus text: batches and blocks per backend (labels[b]), errors by kind. */
void tdm_kv_sub_metrics(struct tdm_kv_sub *s, struct tdm_sbuf *b, const char *const *labels);

/* ---- prefix affinity (affinity.c): the router's guess of which backend has a prompt's prefix
 * cached, from where it sent earlier prompts ---- */
#define TDM_AFFINITY_BLOCK 128 /* bytes of prompt text a key covers */
struct tdm_affinity;
tdm_status tdm_affinity_new(size_t capacity, struct tdm_affinity **out);
void tdm_affinity_free(struct tdm_affinity *a);
/* The chained keys of a request body's whole prompt blocks (at most max); 0 for a body that
 * is not a generation request's JSON. */
int tdm_affinity_keys(const char *body, size_t len, uint64_t *keys, int max);
/* matched[b] (b < n_backends <= 32): how many leading keys backend b was sent. */
void tdm_affinity_match(struct tdm_affinity *a, const uint64_t *keys, int n, int n_backends,
                        int *matched);
/* Backend b was sent these keys (now its most recent). */
void tdm_affinity_insert(struct tdm_affinity *a, int backend, const uint64_t *keys, int n);
/* Of what the index says the backends hold, backend b's fraction (0 when nothing is held). */
double tdm_affinity_share(const struct tdm_affinity *a, int backend, int n_backends);
/* Backend b holds nothing any more (it went down). */
void tdm_affinity_forget(struct tdm_affinity *a, int backend);

#endif
