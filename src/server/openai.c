/*
 * The OpenAI wire format: request validation and response rendering (server_int.h).
 *
 * Validation is strict where a silent mismatch would change the output: fields we do not
 * implement (tools, response_format other than text, suffix on a model without
 * fill-in-the-middle tokens) and unknown fields are refused with 400 and the field
 * named in "param", so a typo like "max_token" is reported instead of ignored. Fields that do not
 * change the output
 * ("user", "metadata", "store", ...) are accepted and ignored.
 *
 * Several choices: a completions list of prompts (up to TDM_API_MAX_PROMPTS), n per prompt and
 * best_of candidates per prompt (each prompt's candidates one scheduler group, sharing its KV),
 * at most TDM_API_MAX_CANDIDATES requests a body. Choice index = prompt * n + rank.
 *
 * Defaults follow OpenAI: completions generate 16 tokens unless max_tokens (or
 * max_completion_tokens) says otherwise; chat completions run to the end of the context.
 * Errors carry OpenAI's error.code where OpenAI has one for the case.
 *
 * Also here: vLLM's /tokenize and /detokenize bodies (tdm_api_tokenize, tdm_api_detokenize),
 * which share the prompt and chat-template paths of the completions, so a /tokenize count is
 * the prompt_tokens of the same prompt sent for completion.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

#define CONTEXT_EXCEEDED "context_length_exceeded" /* OpenAI's error.code */

void tdm_api_err_set(struct api_err *e, int status, const char *param, const char *fmt, ...)
{
    e->status = status;
    e->type = status == 401   ? "authentication_error"
              : status == 404 ? "not_found_error"
              : status == 429 ? "rate_limit_error"
              : status >= 500 ? "server_error"
                              : "invalid_request_error";
    /* the codes OpenAI gives for these statuses; call sites set the others */
    e->code = status == 401 ? "invalid_api_key" : status == 429 ? "rate_limit_exceeded" : NULL;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

char *tdm_utf8_sanitize(const char *s, size_t n, size_t *out_len)
{
    char *o = malloc(n * 3 + 1);
    if (!o) return NULL;
    size_t j = 0;
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = u[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len && i + len <= n;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (size_t k = 1; ok && k < len; k++) {
            if ((u[i + k] & 0xc0) != 0x80) ok = false;
            cp = (cp << 6) | (u[i + k] & 0x3f);
        }
        if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
                   (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
                   (cp >= 0xd800 && cp <= 0xdfff) || (len == 1 && c == 0)))
            ok = false;
        if (ok) {
            memcpy(o + j, s + i, len);
            j += len;
            i += len;
        } else {
            memcpy(o + j, "\xef\xbf\xbd", 3);
            j += 3;
            i++;
        }
    }
    o[j] = '\0';
    if (out_len) *out_len = j;
    return o;
}

static json_t *jstr(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    if (j) return j;
    size_t m;
    char *c = tdm_utf8_sanitize(s, n, &m);
    if (!c) return NULL;
    j = json_stringn(c, m);
    free(c);
    return j;
}

char *tdm_api_error_json(const struct api_err *e)
{
    json_t *root = json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", e->message, "type",
                             e->type, "param", e->param[0] ? json_string(e->param) : json_null(),
                             "code", e->code ? json_string(e->code) : json_null());
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

void tdm_api_req_free(struct api_req *r)
{
    for (int i = 0; r->more && i < r->n_prompts - 1; i++) {
        free(r->more[i].ids);
        free(r->more[i].echo_text);
    }
    free(r->more);
    free(r->prompt);
    free(r->echo_text);
    free(r->bias_ids);
    free(r->bias_vals);
    tdm_grammar_unref(r->grammar);
    for (int i = 0; i < r->n_tools; i++) {
        free(r->tool_json[i]);
        free(r->tool_names[i]);
    }
    free(r->tool_json);
    free(r->tool_names);
    for (int i = 0; i < TDM_MAX_STOP_STRINGS; i++)
        free(r->stops[i]);
    memset(r, 0, sizeof *r);
}

/* ---- field helpers: each returns false after filling err ---- */

static bool get_int(json_t *v, const char *name, int64_t lo, int64_t hi, int64_t *out,
                    struct api_err *err)
{
    if (!json_is_integer(v)) {
        tdm_api_err_set(err, 400, name, "'%s' must be an integer", name);
        return false;
    }
    int64_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        tdm_api_err_set(err, 400, name, "'%s' must be between %lld and %lld (got %lld)", name,
                        (long long)lo, (long long)hi, (long long)x);
        return false;
    }
    *out = x;
    return true;
}

static bool get_num(json_t *v, const char *name, double lo, double hi, double *out,
                    struct api_err *err)
{
    if (!json_is_number(v)) {
        tdm_api_err_set(err, 400, name, "'%s' must be a number", name);
        return false;
    }
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) {
        tdm_api_err_set(err, 400, name, "'%s' must be between %g and %g (got %g)", name, lo, hi, x);
        return false;
    }
    *out = x;
    return true;
}

static bool get_bool(json_t *v, const char *name, bool *out, struct api_err *err)
{
    if (!json_is_boolean(v)) {
        tdm_api_err_set(err, 400, name, "'%s' must be a boolean", name);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

/* Tokenizes text into r->prompt (appending). */
static bool encode_text(const struct api_ctx *c, const char *text, size_t len, int flags,
                        struct api_req *r, const char *param, struct api_err *err)
{
    if (c->max_piece && len / c->max_piece > (size_t)c->max_ctx) {
        /* refused before the tokenizer runs: its time grows with the bytes, the context not */
        tdm_api_err_set(err, 400, param,
                        "the prompt has at least %zu tokens (%zu bytes); this model's context "
                        "is %d tokens",
                        len / c->max_piece, len, c->max_ctx);
        err->code = CONTEXT_EXCEEDED;
        return false;
    }
    /* the tokenizer stops once the prompt cannot fit (the context check that follows refuses
     * a prompt of max_ctx tokens, with its count) */
    size_t cap = TDM_MIN(len + 8, (size_t)c->max_ctx), n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    tdm_status st = tdm_tok_encode(c->tok, text, len, flags | TDM_TOK_STOP_AT_CAP, ids, cap, &n);
    if (st == TDM_ERANGE && n > cap) {
        free(ids);
        tdm_api_err_set(err, 400, param,
                        "the prompt has more than %zu tokens; this model's context is %d tokens",
                        cap, c->max_ctx);
        err->code = CONTEXT_EXCEEDED;
        return false;
    }
    if (st != TDM_OK) {
        free(ids);
        tdm_api_err_set(err, 400, param, "%s", tdm_err_msg());
        return false;
    }
    r->prompt = ids;
    r->n_prompt = (int)n;
    return true;
}

/* bos: a text prompt starts with BOS where the model adds one (not before a FIM prefix, which
 * apply_suffix places itself). */
static bool parse_prompt(const struct api_ctx *c, json_t *v, bool bos, struct api_req *r,
                         struct api_err *err)
{
    /* a list of one prompt is the same as that prompt */
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0);
    if (json_is_string(v)) {
        size_t len = json_string_length(v);
        if (!len) {
            tdm_api_err_set(err, 400, "prompt", "the prompt is empty");
            return false;
        }
        int flags = TDM_TOK_PARSE_SPECIAL | (bos && c->add_bos ? TDM_TOK_ADD_BOS : 0);
        return encode_text(c, json_string_value(v), len, flags, r, "prompt", err);
    }
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if (!n) {
            tdm_api_err_set(err, 400, "prompt", "the prompt is empty");
            return false;
        }
        if (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))) {
            tdm_api_err_set(err, 400, "prompt",
                            "a prompt of a list must be a string or a list of token ids");
            return false;
        }
        if (n > (size_t)c->max_ctx) {
            tdm_api_err_set(err, 400, "prompt",
                            "the prompt has %zu tokens; this model's context is %d tokens", n,
                            c->max_ctx);
            err->code = CONTEXT_EXCEEDED;
            return false;
        }
        r->prompt = malloc(n * sizeof *r->prompt);
        if (!r->prompt) {
            tdm_api_err_set(err, 500, NULL, "out of memory");
            return false;
        }
        for (size_t i = 0; i < n; i++) {
            json_t *t = json_array_get(v, i);
            if (!json_is_integer(t) || json_integer_value(t) < 0 ||
                json_integer_value(t) >= c->vocab) {
                tdm_api_err_set(err, 400, "prompt",
                                "prompt token at index %zu is not a token id in [0, %d)", i,
                                c->vocab);
                return false;
            }
            r->prompt[i] = (int32_t)json_integer_value(t);
        }
        r->n_prompt = (int)n;
        return true;
    }
    tdm_api_err_set(err, 400, "prompt",
                    "'prompt' must be a string, a list of token ids, or a list of one of those");
    return false;
}

/* echo's text (api_req.echo_text): a text prompt as sent (a list of one is that prompt), with
 * the BOS the server added before it skipped; a token prompt's pieces, special tokens
 * included. */
static bool echo_text(const struct api_ctx *c, json_t *v, struct api_req *r, struct api_err *err)
{
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
        v = json_array_get(v, 0);
    size_t n = 0;
    if (json_is_string(v)) {
        n = json_string_length(v);
        r->echo_skip = c->add_bos && r->n_prompt && r->prompt[0] == tdm_tok_bos(c->tok) &&
                       tdm_tok_is_special(c->tok, r->prompt[0]);
        r->echo_text = malloc(n + 1);
        if (r->echo_text) memcpy(r->echo_text, json_string_value(v), n + 1);
    } else {
        for (int i = 0; i < r->n_prompt; i++) {
            size_t len = 0;
            tdm_tok_piece(c->tok, r->prompt[i], &len);
            n += len;
        }
        if ((r->echo_text = malloc(n + 1))) {
            size_t at = 0;
            for (int i = 0; i < r->n_prompt; i++) {
                size_t len = 0;
                const char *p = tdm_tok_piece(c->tok, r->prompt[i], &len);
                memcpy(r->echo_text + at, p, len);
                at += len;
            }
            r->echo_text[n] = '\0';
        }
    }
    if (!r->echo_text) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    r->echo_len = n;
    return true;
}

/* A completions prompt that is a list of prompts (strings or token lists) has that many;
 * anything else (a string, token ids, a list of one) is one. */
static size_t prompt_list_size(json_t *v)
{
    if (!json_is_array(v) || json_array_size(v) < 2) return 1;
    json_t *e = json_array_get(v, 0);
    return json_is_string(e) || json_is_array(e) ? json_array_size(v) : 1;
}

/* A list of prompts: each a string or token ids, into r's first prompt and r->more. */
static bool parse_prompt_list(const struct api_ctx *c, json_t *v, bool fim, struct api_req *r,
                              struct api_err *err)
{
    size_t n = json_array_size(v);
    if (fim) {
        tdm_api_err_set(err, 400, "suffix", "'suffix' takes one prompt, not a list of %zu", n);
        return false;
    }
    if (n > TDM_API_MAX_PROMPTS) {
        tdm_api_err_set(err, 400, "prompt", "%zu prompts in the list; at most %d", n,
                        TDM_API_MAX_PROMPTS);
        return false;
    }
    if (!(r->more = calloc(n - 1, sizeof *r->more))) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    r->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        struct api_req t = {0}, *into = i ? &t : r;
        /* each is one prompt: a string, or token ids (a nested list of lists is not) */
        json_t *e0 = json_is_array(e) ? json_array_get(e, 0) : NULL;
        if ((!json_is_string(e) && !json_is_array(e)) || (e0 && !json_is_integer(e0))) {
            tdm_api_err_set(err, 400, "prompt",
                            "prompt[%zu] must be a string or a list of token ids", i);
            return false;
        }
        bool ok = parse_prompt(c, e, true, into, err) && (!r->echo || echo_text(c, e, into, err));
        if (i) {
            r->more[i - 1] = (struct api_prompt){.ids = t.prompt,
                                                 .n = t.n_prompt,
                                                 .echo_text = t.echo_text,
                                                 .echo_len = t.echo_len,
                                                 .echo_skip = t.echo_skip};
        }
        if (!ok) return false;
    }
    return true;
}

struct api_prompt tdm_api_prompt(const struct api_req *r, int i)
{
    if (i > 0 && i < r->n_prompts) return r->more[i - 1];
    return (struct api_prompt){.ids = r->prompt,
                               .n = r->n_prompt,
                               .echo_text = r->echo_text,
                               .echo_len = r->echo_len,
                               .echo_skip = r->echo_skip};
}

void tdm_api_candidate(const struct api_req *r, int i, int j, struct tdm_req_params *out)
{
    const struct api_prompt ap = tdm_api_prompt(r, i);
    *out = r->p;
    out->prompt = ap.ids;
    out->n_prompt = ap.n;
    if (j) { /* splitmix64 of (seed, j): the candidates' draws apart */
        uint64_t z = r->p.sampling.seed + 0x9e3779b97f4a7c15ull * (uint64_t)j;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        out->sampling.seed = z ^ (z >> 31);
    }
}

/* n (completions and chat) and best_of (completions): the candidates a prompt, and how many
 * of them come back. best_of > n ranks candidates by cumulative log-probability, which needs
 * logprobs (computed then, and shown only if asked); it cannot be streamed (the best is known
 * at the end). */
static bool parse_choices(json_t *root, struct api_req *r, struct api_err *err)
{
    int64_t x;
    json_t *v;
    r->n = 1;
    if ((v = json_object_get(root, "n")) && !json_is_null(v)) {
        if (!get_int(v, "n", 1, TDM_SCHED_MAX_GROUP, &x, err)) return false;
        r->n = (int)x;
    }
    r->best_of = r->n;
    if ((v = json_object_get(root, "best_of")) && !json_is_null(v)) {
        if (r->chat) {
            tdm_api_err_set(err, 400, "best_of", "'best_of' is a completions field");
            return false;
        }
        if (!get_int(v, "best_of", 1, TDM_SCHED_MAX_GROUP, &x, err)) return false;
        if (x < r->n) {
            tdm_api_err_set(err, 400, "best_of", "'best_of' (%lld) must be at least 'n' (%d)",
                            (long long)x, r->n);
            return false;
        }
        r->best_of = (int)x;
    }
    if (r->best_of > r->n && r->stream) {
        tdm_api_err_set(err, 400, "best_of", "'best_of' greater than 'n' cannot be streamed");
        return false;
    }
    if ((int64_t)r->n_prompts * r->best_of > TDM_API_MAX_CANDIDATES) {
        tdm_api_err_set(err, 400, r->best_of > r->n ? "best_of" : "n",
                        "%d prompts with %d candidates each is more than %d", r->n_prompts,
                        r->best_of, TDM_API_MAX_CANDIDATES);
        return false;
    }
    if (r->best_of > r->n && r->p.top_logprobs < 0) {
        r->p.top_logprobs = 0;
        r->hide_logprobs = true;
    }
    return true;
}

/* Message content: a string, or a list of {"type": "text", "text": ...} parts (joined). */
static char *message_content(json_t *v, size_t idx, struct api_err *err)
{
    if (json_is_string(v)) return strdup(json_string_value(v));
    if (json_is_null(v)) return strdup("");
    if (!json_is_array(v)) {
        tdm_api_err_set(err, 400, "messages",
                        "messages[%zu].content must be a string or a list of "
                        "text parts",
                        idx);
        return NULL;
    }
    size_t total = 1;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *p = json_array_get(v, i);
        json_t *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
        if (!json_is_object(p) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") ||
            !json_is_string(tx)) {
            tdm_api_err_set(err, 400, "messages",
                            "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} "
                            "parts are supported",
                            idx, i);
            return NULL;
        }
        total += json_string_length(tx);
    }
    char *s = malloc(total);
    if (!s) return NULL;
    size_t off = 0;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *tx = json_object_get(json_array_get(v, i), "text");
        memcpy(s + off, json_string_value(tx), json_string_length(tx));
        off += json_string_length(tx);
    }
    s[off] = '\0';
    return s;
}

/* The chat template over `messages`, tokenized into r->prompt. gen_prompt: the assistant's
 * turn is opened at the end; specials: a BOS token where the model adds one. */
static bool parse_messages(const struct api_ctx *c, json_t *v, bool gen_prompt, bool specials,
                           struct api_req *r, struct api_err *err)
{
    if (!c->chat) {
        tdm_api_err_set(err, 400, NULL, "this model has no chat template; use /v1/completions");
        return false;
    }
    if (!json_is_array(v) || !json_array_size(v)) {
        tdm_api_err_set(err, 400, "messages", "'messages' must be a non-empty list");
        return false;
    }
    size_t n = json_array_size(v);
    if (n > 4096) {
        tdm_api_err_set(err, 400, "messages", "at most 4096 messages");
        return false;
    }
    struct tdm_chat_msg *msgs = calloc(n, sizeof *msgs);
    char **contents = calloc(n, sizeof *contents);
    struct tdm_chat_call *calls = NULL;
    size_t n_calls_all = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *tc = json_object_get(json_array_get(v, i), "tool_calls");
        if (json_is_array(tc)) n_calls_all += json_array_size(tc);
    }
    if (n_calls_all > 4096) {
        tdm_api_err_set(err, 400, "messages", "at most 4096 tool calls in the conversation");
        free(msgs);
        free(contents);
        return false;
    }
    calls = calloc(n_calls_all + 1, sizeof *calls);
    size_t call_at = 0;
    bool ok = false;
    char *rendered = NULL;
    if (!msgs || !contents || !calls) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m)) {
            tdm_api_err_set(err, 400, "messages", "messages[%zu] must be an object", i);
            goto out;
        }
        const char *key;
        json_t *val;
        json_object_foreach(m, key, val)
        {
            if (strcmp(key, "role") && strcmp(key, "content") && strcmp(key, "name") &&
                strcmp(key, "tool_calls") && strcmp(key, "tool_call_id")) {
                tdm_api_err_set(err, 400, "messages", "messages[%zu]: unsupported field '%s'", i,
                                key);
                goto out;
            }
        }
        json_t *role = json_object_get(m, "role");
        if (!json_is_string(role)) {
            tdm_api_err_set(err, 400, "messages", "messages[%zu].role must be a string", i);
            goto out;
        }
        const char *rs = json_string_value(role);
        if (!strcmp(rs, "developer")) rs = "system";
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") &&
            strcmp(rs, "tool")) {
            tdm_api_err_set(err, 400, "messages",
                            "messages[%zu].role must be system, developer, user, assistant or "
                            "tool",
                            i);
            goto out;
        }
        json_t *content = json_object_get(m, "content"), *tc = json_object_get(m, "tool_calls");
        if (tc && !json_is_null(tc)) {
            if (strcmp(rs, "assistant") || !json_is_array(tc)) {
                tdm_api_err_set(err, 400, "messages",
                                "messages[%zu].tool_calls must be a list, on an assistant "
                                "message",
                                i);
                goto out;
            }
            msgs[i].calls = calls + call_at;
            for (size_t k = 0; k < json_array_size(tc); k++) {
                json_t *call = json_array_get(tc, k), *fn = json_object_get(call, "function");
                json_t *fname = json_object_get(fn, "name"),
                       *fargs = json_object_get(fn, "arguments");
                if (!json_is_string(fname) || !json_is_string(fargs)) {
                    tdm_api_err_set(err, 400, "messages",
                                    "messages[%zu].tool_calls[%zu] needs function.name and "
                                    "function.arguments (a string)",
                                    i, k);
                    goto out;
                }
                calls[call_at++] = (struct tdm_chat_call){.name = json_string_value(fname),
                                                          .arguments = json_string_value(fargs)};
                msgs[i].n_calls++;
            }
        }
        if (!content || (json_is_null(content) && msgs[i].n_calls)) {
            if (!msgs[i].n_calls) {
                tdm_api_err_set(err, 400, "messages", "messages[%zu] has no content", i);
                goto out;
            }
            contents[i] = strdup("");
        } else if (!(contents[i] = message_content(content, i, err))) {
            if (!err->status) tdm_api_err_set(err, 500, NULL, "out of memory");
            goto out;
        }
        if (!contents[i]) {
            tdm_api_err_set(err, 500, NULL, "out of memory");
            goto out;
        }
        msgs[i].role = rs;
        msgs[i].content = contents[i];
    }
    if (tdm_chat_render_tools(c->chat, msgs, n, (const char *const *)r->tool_json, r->n_tools,
                              gen_prompt, &rendered) != TDM_OK) {
        tdm_api_err_set(err, 400, "messages", "%s", tdm_err_msg());
        goto out;
    }
    bool bos = specials && c->add_bos && !c->chat->add_bos_text;
    ok = encode_text(c, rendered, strlen(rendered),
                     TDM_TOK_PARSE_SPECIAL | (bos ? TDM_TOK_ADD_BOS : 0), r, "messages", err);
out:
    for (size_t i = 0; contents && i < n; i++)
        free(contents[i]);
    free(contents);
    free(msgs);
    free(calls);
    free(rendered);
    return ok;
}

static bool parse_stop(json_t *v, struct api_req *r, struct api_err *err)
{
    if (json_is_null(v)) return true;
    json_t *one[1] = {v};
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > TDM_MAX_STOP_STRINGS) {
            tdm_api_err_set(err, 400, "stop", "at most %d stop strings", TDM_MAX_STOP_STRINGS);
            return false;
        }
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_array(v) ? json_array_get(v, i) : one[0];
        if (!json_is_string(s)) {
            tdm_api_err_set(err, 400, "stop", "'stop' must be a string or a list of strings");
            return false;
        }
        size_t len = json_string_length(s);
        if (!len || len > TDM_MAX_STOP_BYTES) {
            tdm_api_err_set(err, 400, "stop", "each stop string must be 1 to %d bytes",
                            TDM_MAX_STOP_BYTES);
            return false;
        }
        if (!(r->stops[r->n_stops] = strdup(json_string_value(s)))) {
            tdm_api_err_set(err, 500, NULL, "out of memory");
            return false;
        }
        r->n_stops++;
    }
    return true;
}

void tdm_api_find_fim(struct api_ctx *c)
{
    static const char *const sets[][3] = {{"<fim_prefix>", "<fim_suffix>", "<fim_middle>"},
                                          {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"}};
    c->fim[0] = c->fim[1] = c->fim[2] = -1;
    for (size_t s = 0; s < sizeof sets / sizeof *sets; s++) {
        int32_t ids[3];
        bool all = true;
        for (int i = 0; i < 3 && all; i++)
            all = (ids[i] = c->tok ? tdm_tok_find(c->tok, sets[s][i]) : -1) >= 0;
        if (all) {
            memcpy(c->fim, ids, sizeof ids);
            return;
        }
    }
}

/* suffix: fill-in-the-middle, in the prefix-suffix-middle order the FIM models are trained
 * on: [BOS] <fim_prefix> prompt <fim_suffix> suffix <fim_middle>, the model then writing the
 * middle. r->prompt holds the prompt's tokens, without a BOS. */
static bool apply_suffix(const struct api_ctx *c, json_t *v, struct api_req *r, struct api_err *err)
{
    if (!json_is_string(v)) {
        tdm_api_err_set(err, 400, "suffix", "'suffix' must be a string");
        return false;
    }
    if (c->fim[0] < 0) {
        tdm_api_err_set(err, 400, "suffix",
                        "'suffix' asks for fill-in-the-middle, and this model's vocabulary has no "
                        "fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, <fim_middle>)");
        return false;
    }
    struct api_req s = {0};
    if (json_string_length(v) && !encode_text(c, json_string_value(v), json_string_length(v),
                                              TDM_TOK_PARSE_SPECIAL, &s, "suffix", err))
        return false;
    bool bos = c->add_bos;
    int32_t bos_id = bos ? tdm_tok_bos(c->tok) : -1;
    int n = (bos_id >= 0) + 3 + r->n_prompt + s.n_prompt;
    if (n > c->max_ctx) {
        free(s.prompt);
        tdm_api_err_set(err, 400, "suffix",
                        "the prompt and suffix have %d tokens; this model's context is %d tokens",
                        n, c->max_ctx);
        err->code = CONTEXT_EXCEEDED;
        return false;
    }
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) {
        free(s.prompt);
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    int k = 0;
    if (bos_id >= 0) ids[k++] = bos_id;
    ids[k++] = c->fim[0];
    if (r->n_prompt) memcpy(ids + k, r->prompt, (size_t)r->n_prompt * sizeof *ids);
    k += r->n_prompt;
    ids[k++] = c->fim[1];
    if (s.n_prompt) memcpy(ids + k, s.prompt, (size_t)s.n_prompt * sizeof *ids);
    k += s.n_prompt;
    ids[k++] = c->fim[2];
    free(s.prompt);
    free(r->prompt);
    r->prompt = ids;
    r->n_prompt = k;
    return true;
}

/* logit_bias: {"token id": bias in [-100, 100]}, the ids as decimal strings (OpenAI's form). */
static bool parse_logit_bias(const struct api_ctx *c, json_t *v, struct api_req *r,
                             struct api_err *err)
{
    if (json_is_null(v)) return true;
    if (!json_is_object(v)) {
        tdm_api_err_set(err, 400, "logit_bias",
                        "'logit_bias' must be an object of token ids to biases");
        return false;
    }
    size_t n = json_object_size(v);
    if (n > TDM_MAX_LOGIT_BIAS) {
        tdm_api_err_set(err, 400, "logit_bias", "'logit_bias' has %zu entries; at most %d", n,
                        TDM_MAX_LOGIT_BIAS);
        return false;
    }
    if (!n) return true;
    r->bias_ids = malloc(n * sizeof *r->bias_ids);
    r->bias_vals = malloc(n * sizeof *r->bias_vals);
    if (!r->bias_ids || !r->bias_vals) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    const char *key;
    json_t *b;
    json_object_foreach(v, key, b)
    {
        char *end = NULL;
        errno = 0;
        long id = strtol(key, &end, 10);
        if (!*key || *end || errno || id < 0 || id >= c->vocab || (key[0] == '0' && key[1]) ||
            !(key[0] >= '0' && key[0] <= '9')) {
            tdm_api_err_set(err, 400, "logit_bias",
                            "'logit_bias' key '%.40s' is not a token id in [0, %d)", key, c->vocab);
            return false;
        }
        if (!json_is_number(b) || !(json_number_value(b) >= -100 && json_number_value(b) <= 100)) {
            tdm_api_err_set(err, 400, "logit_bias",
                            "'logit_bias' of token %ld must be a number in [-100, 100]", id);
            return false;
        }
        r->bias_ids[r->n_bias] = (int32_t)id;
        r->bias_vals[r->n_bias++] = (float)json_number_value(b);
    }
    return true;
}

/* The request fields that carry a constraint (parse_structured reads them) */
static const char *const STRUCTURED_FIELDS[] = {
    "response_format",    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs", "regex",       "json_schema",  "grammar"};

/* ---- structured output ----
 * A request carries at most one constraint, in any of the spellings clients use:
 *   response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
 *     "schema", "strict", "description"}} (OpenAI; "text" is no constraint);
 *   guided_json (a schema), guided_regex, guided_choice, guided_grammar (vLLM's older fields);
 *   structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"} (vLLM's);
 *   json_schema (llama-server's), regex, grammar (a GBNF grammar, llama-server's).
 * The grammar compiles here, so a bad schema is this request's 400 naming what is wrong. */
static bool set_grammar(const struct api_ctx *c, const char *param, enum tdm_grammar_kind kind,
                        const char *src, size_t len, struct api_req *r, struct api_err *err)
{
    if (r->grammar) {
        tdm_api_err_set(err, 400, param,
                        "only one of response_format, guided_json, guided_regex, guided_choice, "
                        "guided_grammar, structured_outputs, json_schema, regex and grammar may "
                        "be given");
        return false;
    }
    if (!c->gvocab) {
        tdm_api_err_set(err, 400, param, "structured output is not available on this server");
        return false;
    }
    tdm_grammar_t *g = NULL;
    tdm_status st = tdm_grammar_get(c->gvocab, kind, src, len, &g);
    if (st != TDM_OK) {
        tdm_api_err_set(err, st == TDM_ENOMEM ? 500 : 400, param, "'%s': %s", param, tdm_err_msg());
        return false;
    }
    r->grammar = g;
    return true;
}

static bool schema_grammar(const struct api_ctx *c, const char *param, json_t *schema,
                           struct api_req *r, struct api_err *err)
{
    if (json_is_string(schema))
        return set_grammar(c, param, TDM_GRAMMAR_JSON_SCHEMA, json_string_value(schema),
                           json_string_length(schema), r, err);
    if (!json_is_object(schema) && !json_is_boolean(schema)) {
        tdm_api_err_set(err, 400, param, "'%s' must be a JSON Schema (an object)", param);
        return false;
    }
    char *s = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) {
        tdm_api_err_set(err, 500, param, "out of memory");
        return false;
    }
    bool ok = set_grammar(c, param, TDM_GRAMMAR_JSON_SCHEMA, s, strlen(s), r, err);
    free(s);
    return ok;
}

static bool text_grammar(const struct api_ctx *c, const char *param, enum tdm_grammar_kind kind,
                         json_t *v, struct api_req *r, struct api_err *err)
{
    if (!json_is_string(v)) {
        tdm_api_err_set(err, 400, param, "'%s' must be a string", param);
        return false;
    }
    return set_grammar(c, param, kind, json_string_value(v), json_string_length(v), r, err);
}

static bool choice_grammar(const struct api_ctx *c, const char *param, json_t *v, struct api_req *r,
                           struct api_err *err)
{
    if (!json_is_array(v) || !json_array_size(v)) {
        tdm_api_err_set(err, 400, param, "'%s' must be a non-empty list of strings", param);
        return false;
    }
    char *s = json_dumps(v, JSON_COMPACT);
    if (!s) {
        tdm_api_err_set(err, 500, param, "out of memory");
        return false;
    }
    bool ok = set_grammar(c, param, TDM_GRAMMAR_CHOICE, s, strlen(s), r, err);
    free(s);
    return ok;
}

static bool parse_response_format(const struct api_ctx *c, json_t *v, struct api_req *r,
                                  struct api_err *err)
{
    const char *P = "response_format";
    json_t *t = json_object_get(v, "type");
    if (!json_is_object(v) || !json_is_string(t)) {
        tdm_api_err_set(err, 400, P, "'response_format' must be an object with a 'type'");
        return false;
    }
    const char *type = json_string_value(t);
    const char *key;
    json_t *x;
    json_object_foreach(v, key, x)
    {
        if (strcmp(key, "type") && strcmp(key, "json_schema") && strcmp(key, "schema")) {
            tdm_api_err_set(err, 400, P, "unknown field 'response_format.%s'", key);
            return false;
        }
    }
    if (!strcmp(type, "text")) return true;
    if (!strcmp(type, "json_object")) {
        /* llama-server's form carries a schema here too */
        json_t *sc = json_object_get(v, "schema");
        if (sc) return schema_grammar(c, "response_format.schema", sc, r, err);
        return set_grammar(c, P, TDM_GRAMMAR_JSON_OBJECT, NULL, 0, r, err);
    }
    if (strcmp(type, "json_schema")) {
        tdm_api_err_set(err, 400, P,
                        "response_format type '%.40s' is not one of text, json_object, "
                        "json_schema",
                        type);
        return false;
    }
    json_t *js = json_object_get(v, "json_schema");
    if (!json_is_object(js)) {
        tdm_api_err_set(err, 400, P, "response_format json_schema needs a 'json_schema' object");
        return false;
    }
    json_object_foreach(js, key, x)
    {
        if (strcmp(key, "name") && strcmp(key, "schema") && strcmp(key, "strict") &&
            strcmp(key, "description")) {
            tdm_api_err_set(err, 400, P, "unknown field 'response_format.json_schema.%s'", key);
            return false;
        }
    }
    json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    if (name && !json_is_string(name)) {
        tdm_api_err_set(err, 400, P, "response_format.json_schema.name must be a string");
        return false;
    }
    if (strict && !json_is_boolean(strict) && !json_is_null(strict)) {
        tdm_api_err_set(err, 400, P, "response_format.json_schema.strict must be a boolean");
        return false;
    }
    json_t *sc = json_object_get(js, "schema");
    if (!sc) /* OpenAI: no schema is any JSON object */
        return set_grammar(c, P, TDM_GRAMMAR_JSON_OBJECT, NULL, 0, r, err);
    return schema_grammar(c, "response_format.json_schema.schema", sc, r, err);
}

static bool parse_structured(const struct api_ctx *c, json_t *root, struct api_req *r,
                             struct api_err *err)
{
    json_t *v;
    if ((v = json_object_get(root, "response_format")) && !json_is_null(v) &&
        !parse_response_format(c, v, r, err))
        return false;
    static const struct {
        const char *field;
        int how; /* 0 a schema, 1 a regex, 2 choices, 3 GBNF */
    } FIELDS[] = {{"guided_json", 0},   {"json_schema", 0},    {"guided_regex", 1}, {"regex", 1},
                  {"guided_choice", 2}, {"guided_grammar", 3}, {"grammar", 3}};
    for (size_t i = 0; i < sizeof FIELDS / sizeof *FIELDS; i++) {
        const char *f = FIELDS[i].field;
        if (!(v = json_object_get(root, f)) || json_is_null(v)) continue;
        bool ok =
            FIELDS[i].how == 0 ? schema_grammar(c, f, v, r, err)
            : FIELDS[i].how == 2
                ? choice_grammar(c, f, v, r, err)
                : text_grammar(c, f, FIELDS[i].how == 1 ? TDM_GRAMMAR_REGEX : TDM_GRAMMAR_GBNF, v,
                               r, err);
        if (!ok) return false;
    }
    if ((v = json_object_get(root, "structured_outputs")) && !json_is_null(v)) {
        if (!json_is_object(v)) {
            tdm_api_err_set(err, 400, "structured_outputs",
                            "'structured_outputs' must be an object");
            return false;
        }
        const char *key;
        json_t *x;
        json_object_foreach(v, key, x)
        {
            bool ok;
            if (json_is_null(x) || !strcmp(key, "disable_fallback") ||
                !strcmp(key, "disable_any_whitespace") ||
                !strcmp(key, "disable_additional_properties") || !strcmp(key, "whitespace_pattern"))
                continue;
            if (!strcmp(key, "json"))
                ok = schema_grammar(c, "structured_outputs.json", x, r, err);
            else if (!strcmp(key, "regex"))
                ok = text_grammar(c, "structured_outputs.regex", TDM_GRAMMAR_REGEX, x, r, err);
            else if (!strcmp(key, "choice"))
                ok = choice_grammar(c, "structured_outputs.choice", x, r, err);
            else if (!strcmp(key, "grammar"))
                ok = text_grammar(c, "structured_outputs.grammar", TDM_GRAMMAR_GBNF, x, r, err);
            else if (!strcmp(key, "json_object"))
                ok = !json_is_true(x) || set_grammar(c, "structured_outputs.json_object",
                                                     TDM_GRAMMAR_JSON_OBJECT, NULL, 0, r, err);
            else {
                tdm_api_err_set(err, 400, "structured_outputs",
                                "unknown field 'structured_outputs.%s'", key);
                return false;
            }
            if (!ok) return false;
        }
    }
    return true;
}

/* ---- tools (chat) ----
 * tools: up to TDM_API_MAX_TOOLS {"type": "function", "function": {"name", "description",
 * "parameters", "strict"}}; tool_choice "none" | "auto" (the default with tools) | "required" |
 * {"type": "function", "function": {"name"}}; parallel_tool_calls. The template renders the
 * tools (tdm_chat_render_tools); with "auto" the output is scanned for calls (tools.c); with
 * "required" or a named function a grammar makes the output calls whose arguments follow the
 * tools' parameter schemas. */
static bool tool_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (!n || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '_' || ch == '-'))
            return false;
    }
    return true;
}

static bool parse_tools(const struct api_ctx *c, json_t *root, struct api_req *r,
                        struct api_err *err)
{
    json_t *tools = json_object_get(root, "tools"), *choice = json_object_get(root, "tool_choice");
    json_t *par = json_object_get(root, "parallel_tool_calls");
    r->parallel_tools = true;
    if (par && !json_is_null(par) && !get_bool(par, "parallel_tool_calls", &r->parallel_tools, err))
        return false;
    if (!tools || json_is_null(tools)) {
        if (choice && !json_is_null(choice) &&
            !(json_is_string(choice) && !strcmp(json_string_value(choice), "none"))) {
            tdm_api_err_set(err, 400, "tool_choice", "'tool_choice' needs 'tools'");
            return false;
        }
        return true;
    }
    size_t n = json_is_array(tools) ? json_array_size(tools) : 0;
    if (!n || n > TDM_API_MAX_TOOLS) {
        tdm_api_err_set(err, 400, "tools", "'tools' must be a list of 1 to %d tools",
                        TDM_API_MAX_TOOLS);
        return false;
    }
    r->tool_json = calloc(n, sizeof *r->tool_json);
    r->tool_names = calloc(n, sizeof *r->tool_names);
    if (!r->tool_json || !r->tool_names) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(tools, i), *type = json_object_get(t, "type");
        json_t *fn = json_object_get(t, "function"), *name = json_object_get(fn, "name");
        json_t *params = json_object_get(fn, "parameters");
        if (!json_is_object(t) || !json_is_string(type) ||
            strcmp(json_string_value(type), "function") || !json_is_object(fn)) {
            tdm_api_err_set(err, 400, "tools",
                            "tools[%zu] must be {\"type\": \"function\", \"function\": {...}}", i);
            return false;
        }
        const char *k;
        json_t *x;
        json_object_foreach(fn, k, x)
        {
            if (strcmp(k, "name") && strcmp(k, "description") && strcmp(k, "parameters") &&
                strcmp(k, "strict")) {
                tdm_api_err_set(err, 400, "tools", "tools[%zu].function: unknown field '%s'", i, k);
                return false;
            }
        }
        if (!json_is_string(name) || !tool_name_ok(json_string_value(name))) {
            tdm_api_err_set(err, 400, "tools",
                            "tools[%zu].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                            i);
            return false;
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(r->tool_names[j], json_string_value(name))) {
                tdm_api_err_set(err, 400, "tools", "two tools are named '%s'", r->tool_names[j]);
                return false;
            }
        if (params && !json_is_object(params)) {
            tdm_api_err_set(err, 400, "tools",
                            "tools[%zu].function.parameters must be a JSON Schema object", i);
            return false;
        }
        r->tool_names[i] = strdup(json_string_value(name));
        r->tool_json[i] = json_dumps(t, JSON_COMPACT);
        r->n_tools = (int)i + 1;
        if (!r->tool_names[i] || !r->tool_json[i]) {
            tdm_api_err_set(err, 500, NULL, "out of memory");
            return false;
        }
    }
    r->tool_format =
        c->chat && c->chat->format == TDM_CHAT_LLAMA3 ? TDM_TOOLS_LLAMA3 : TDM_TOOLS_HERMES;
    r->tool_choice = TDM_TOOL_CHOICE_AUTO;
    if (choice && !json_is_null(choice)) {
        const char *cs = json_is_string(choice) ? json_string_value(choice) : NULL;
        json_t *fn = json_object_get(choice, "function"), *name = json_object_get(fn, "name");
        if (cs && !strcmp(cs, "none")) {
            r->tool_choice = TDM_TOOL_CHOICE_NONE;
        } else if (cs && !strcmp(cs, "auto")) {
            r->tool_choice = TDM_TOOL_CHOICE_AUTO;
        } else if (cs && !strcmp(cs, "required")) {
            r->tool_choice = TDM_TOOL_CHOICE_REQUIRED;
        } else if (json_is_object(choice) && json_is_string(name)) {
            int found = -1;
            for (int i = 0; i < r->n_tools && found < 0; i++)
                if (!strcmp(r->tool_names[i], json_string_value(name))) found = i;
            if (found < 0) {
                tdm_api_err_set(err, 400, "tool_choice",
                                "tool_choice names '%.64s', which is not among the tools",
                                json_string_value(name));
                return false;
            }
            r->tool_choice = TDM_TOOL_CHOICE_NAMED;
            r->named_tool = found;
        } else {
            tdm_api_err_set(err, 400, "tool_choice",
                            "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}");
            return false;
        }
    }
    r->tools_parse = r->tool_choice != TDM_TOOL_CHOICE_NONE;
    return true;
}

/* tool_choice required or named: the output is calls, their arguments by the tools' schemas */
static bool tool_grammar(const struct api_ctx *c, struct api_req *r, struct api_err *err)
{
    if (r->tool_choice != TDM_TOOL_CHOICE_REQUIRED && r->tool_choice != TDM_TOOL_CHOICE_NAMED)
        return true;
    if (r->grammar) {
        tdm_api_err_set(err, 400, "tool_choice",
                        "tool_choice required or a named function cannot be combined with "
                        "response_format or another constraint");
        return false;
    }
    json_t *spec = json_pack(
        "{s:s, s:b, s:[]}", "format", r->tool_format == TDM_TOOLS_LLAMA3 ? "llama3" : "hermes",
        "parallel", r->parallel_tools && r->tool_choice == TDM_TOOL_CHOICE_REQUIRED, "tools");
    for (int i = 0; spec && i < r->n_tools; i++) {
        if (r->tool_choice == TDM_TOOL_CHOICE_NAMED && i != r->named_tool) continue;
        json_t *t = json_loads(r->tool_json[i], 0, NULL);
        json_t *params = json_object_get(json_object_get(t, "function"), "parameters");
        json_t *one = json_pack("{s:s}", "name", r->tool_names[i]);
        if (params && one) json_object_set(one, "parameters", params);
        json_array_append_new(json_object_get(spec, "tools"), one);
        json_decref(t);
    }
    char *src = spec ? json_dumps(spec, JSON_COMPACT) : NULL;
    json_decref(spec);
    if (!src) {
        tdm_api_err_set(err, 500, NULL, "out of memory");
        return false;
    }
    bool ok = set_grammar(c, "tools", TDM_GRAMMAR_TOOL_CALLS, src, strlen(src), r, err);
    free(src);
    return ok;
}

/* Fields that would change the output and that we do not implement. */

static bool unsupported(const char *key, json_t *v, struct api_err *err)
{
    static const char *const never[] = {"functions", "function_call", "prediction", "audio"};
    for (size_t i = 0; i < sizeof never / sizeof *never; i++)
        if (!strcmp(key, never[i]) && !json_is_null(v)) {
            tdm_api_err_set(err, 400, key, "'%s' is not supported", key);
            return true;
        }
    return false;
}

/* A request body as a JSON object, or NULL with err (400): not JSON, not UTF-8, not an object. */
static json_t *load_body(const char *body, size_t len, struct api_err *err)
{
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        if (json_error_code(&je) == json_error_invalid_utf8)
            tdm_api_err_set(err, 400, NULL, "the request body is not valid UTF-8 (near byte %d)",
                            je.position);
        else
            tdm_api_err_set(err, 400, NULL, "invalid JSON body: %s (line %d, column %d)", je.text,
                            je.line, je.column);
        return NULL;
    }
    if (!json_is_object(root)) {
        tdm_api_err_set(err, 400, NULL, "the request body must be a JSON object");
        json_decref(root);
        return NULL;
    }
    return root;
}

bool tdm_api_model_known(const struct api_ctx *c, const char *name, struct api_err *err)
{
    if (!strcmp(name, c->model_name)) return true;
    tdm_api_err_set(err, 404, "model", "the model '%.200s' does not exist; this server serves '%s'",
                    name, c->model_name);
    err->code = "model_not_found";
    return false;
}

/* "model", when given, must name the model this server serves. */
static bool check_model(const struct api_ctx *c, json_t *root, struct api_err *err)
{
    json_t *v = json_object_get(root, "model");
    if (!v || json_is_null(v)) return true;
    if (!json_is_string(v)) {
        tdm_api_err_set(err, 400, "model", "'model' must be a string");
        return false;
    }
    return tdm_api_model_known(c, json_string_value(v), err);
}

bool tdm_api_parse(const struct api_ctx *c, bool chat, const char *body, size_t len,
                   struct api_req *r, struct api_err *err)
{
    memset(r, 0, sizeof *r);
    memset(err, 0, sizeof *err);
    r->chat = chat;
    r->p.sampling = tdm_sampling_defaults();
    r->p.sampling.temperature = 1.0f; /* OpenAI's default */
    r->p.top_logprobs = -1;
    json_t *root = load_body(body, len, err);
    if (!root) return false;
    bool ok = false;
    static const char *const known_c[] = {"model",
                                          "prompt",
                                          "max_tokens",
                                          "max_completion_tokens",
                                          "temperature",
                                          "top_p",
                                          "top_k",
                                          "min_p",
                                          "seed",
                                          "stop",
                                          "logprobs",
                                          "stream",
                                          "stream_options",
                                          "presence_penalty",
                                          "frequency_penalty",
                                          "repetition_penalty",
                                          "ignore_eos",
                                          "min_tokens",
                                          "stop_token_ids",
                                          "user",
                                          "n",
                                          "best_of",
                                          "echo",
                                          "logit_bias",
                                          "suffix",
                                          "skip_special_tokens",
                                          "spec_k"};
    static const char *const known_chat[] = {"model",
                                             "messages",
                                             "max_tokens",
                                             "max_completion_tokens",
                                             "temperature",
                                             "top_p",
                                             "top_k",
                                             "min_p",
                                             "seed",
                                             "stop",
                                             "logprobs",
                                             "top_logprobs",
                                             "stream",
                                             "stream_options",
                                             "presence_penalty",
                                             "frequency_penalty",
                                             "repetition_penalty",
                                             "ignore_eos",
                                             "min_tokens",
                                             "stop_token_ids",
                                             "user",
                                             "n",
                                             "logit_bias",
                                             "tools",
                                             "tool_choice",
                                             "functions",
                                             "function_call",
                                             "parallel_tool_calls",
                                             "metadata",
                                             "store",
                                             "service_tier",
                                             "modalities",
                                             "audio",
                                             "prediction",
                                             "reasoning_effort",
                                             "skip_special_tokens",
                                             "spec_k"};
    const char *const *known = chat ? known_chat : known_c;
    size_t n_known =
        chat ? sizeof known_chat / sizeof *known_chat : sizeof known_c / sizeof *known_c;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        bool found = false;
        for (size_t i = 0; i < n_known && !found; i++)
            found = !strcmp(key, known[i]);
        for (size_t i = 0; i < sizeof STRUCTURED_FIELDS / sizeof *STRUCTURED_FIELDS && !found; i++)
            found = !strcmp(key, STRUCTURED_FIELDS[i]); /* both routes take these */
        if (!found) {
            tdm_api_err_set(err, 400, key, "unknown field '%s'", key);
            goto out;
        }
        if (unsupported(key, v, err)) goto out;
    }

    if (!check_model(c, root, err)) goto out;

    if (chat) {
        if (!json_object_get(root, "messages")) {
            tdm_api_err_set(err, 400, "messages", "'messages' is required");
            goto out;
        }
        if (!parse_tools(c, root, r, err)) goto out; /* the template renders them */
        if (!parse_messages(c, json_object_get(root, "messages"), true, true, r, err)) goto out;
    } else {
        if (!json_object_get(root, "prompt")) {
            tdm_api_err_set(err, 400, "prompt", "'prompt' is required");
            goto out;
        }
        json_t *prompt = json_object_get(root, "prompt"), *suffix = json_object_get(root, "suffix");
        bool fim = suffix && !json_is_null(suffix);
        if ((v = json_object_get(root, "echo")) && !json_is_null(v)) {
            if (!get_bool(v, "echo", &r->echo, err)) goto out;
            if (r->echo && fim) {
                tdm_api_err_set(err, 400, "echo", "'echo' cannot be combined with 'suffix'");
                goto out;
            }
        }
        if (prompt_list_size(prompt) > 1) {
            if (!parse_prompt_list(c, prompt, fim, r, err)) goto out;
        } else {
            /* fill-in-the-middle may have an empty prefix */
            if (!(fim && json_is_string(prompt) && !json_string_length(prompt)) &&
                !parse_prompt(c, prompt, !fim, r, err))
                goto out;
            if (fim && !apply_suffix(c, suffix, r, err)) goto out;
            if (r->echo && !echo_text(c, prompt, r, err)) goto out;
        }
    }
    if (!r->n_prompts) r->n_prompts = 1;
    int longest = 0;
    for (int i = 0; i < r->n_prompts; i++) {
        const struct api_prompt ap = tdm_api_prompt(r, i);
        if (ap.n < 1) {
            tdm_api_err_set(err, 400, chat ? "messages" : "prompt", "the prompt is empty");
            goto out;
        }
        if (ap.n >= c->max_ctx) {
            tdm_api_err_set(err, 400, chat ? "messages" : "prompt",
                            "the prompt has %d tokens; this model's context is %d tokens", ap.n,
                            c->max_ctx);
            err->code = CONTEXT_EXCEEDED;
            goto out;
        }
        longest = TDM_MAX(longest, ap.n);
    }
    int room = c->max_ctx - longest;

    int64_t x;
    double d;
    bool b;
    r->p.max_tokens = chat ? room : TDM_MIN(16, room);
    const char *mt_name = "max_tokens";
    v = json_object_get(root, "max_tokens");
    if (!v || json_is_null(v)) { /* the newer name; max_tokens wins when both are given */
        v = json_object_get(root, "max_completion_tokens");
        mt_name = "max_completion_tokens";
    }
    if (v && !json_is_null(v)) {
        /* 0 with echo: the prompt scored, nothing generated (lm-evaluation-harness's way) */
        if (!get_int(v, mt_name, r->echo ? 0 : 1, INT32_MAX, &x, err)) goto out;
        if (x > room) {
            tdm_api_err_set(
                err, 400, mt_name,
                "'%s' is %lld, but the prompt has %d tokens and this model's context is "
                "%d tokens, which leaves room for %d",
                mt_name, (long long)x, longest, c->max_ctx, room);
            err->code = CONTEXT_EXCEEDED;
            goto out;
        }
        r->p.max_tokens = (int)x;
    }
    if ((v = json_object_get(root, "temperature")) && !json_is_null(v)) {
        if (!get_num(v, "temperature", 0, 2, &d, err)) goto out;
        r->p.sampling.temperature = (float)d;
    }
    if ((v = json_object_get(root, "top_p")) && !json_is_null(v)) {
        if (!get_num(v, "top_p", 0, 1, &d, err)) goto out;
        if (d <= 0) {
            tdm_api_err_set(err, 400, "top_p", "'top_p' must be in (0, 1]");
            goto out;
        }
        r->p.sampling.top_p = (float)d;
    }
    if ((v = json_object_get(root, "top_k")) && !json_is_null(v)) {
        if (!get_int(v, "top_k", -1, 1 << 30, &x, err)) goto out;
        r->p.sampling.top_k = x < 0 ? 0 : (int)x;
    }
    if ((v = json_object_get(root, "min_p")) && !json_is_null(v)) {
        if (!get_num(v, "min_p", 0, 1, &d, err)) goto out;
        r->p.sampling.min_p = (float)d;
    }
    if ((v = json_object_get(root, "presence_penalty")) && !json_is_null(v)) {
        if (!get_num(v, "presence_penalty", -2, 2, &d, err)) goto out;
        r->p.sampling.presence_penalty = (float)d;
    }
    if ((v = json_object_get(root, "frequency_penalty")) && !json_is_null(v)) {
        if (!get_num(v, "frequency_penalty", -2, 2, &d, err)) goto out;
        r->p.sampling.frequency_penalty = (float)d;
    }
    if ((v = json_object_get(root, "repetition_penalty")) && !json_is_null(v)) {
        if (!get_num(v, "repetition_penalty", 0.01, 100, &d, err)) goto out;
        r->p.sampling.repetition_penalty = (float)d;
    }
    if ((v = json_object_get(root, "seed")) && !json_is_null(v)) {
        if (!json_is_integer(v)) {
            tdm_api_err_set(err, 400, "seed", "'seed' must be an integer");
            goto out;
        }
        r->p.sampling.seed = (uint64_t)json_integer_value(v);
    } else {
        /* no seed: a fresh one per request (the RNG key also takes the position) */
        static _Atomic uint64_t ctr;
        r->p.sampling.seed = tdm_now_ns() ^ (0x9e3779b97f4a7c15ull * ++ctr);
    }
    if ((v = json_object_get(root, "stop")) && !parse_stop(v, r, err)) goto out;
    if ((v = json_object_get(root, "logit_bias")) && !parse_logit_bias(c, v, r, err)) goto out;
    if ((v = json_object_get(root, "stop_token_ids")) && !json_is_null(v)) {
        if (!json_is_array(v) || json_array_size(v) > TDM_MAX_STOP_IDS) {
            tdm_api_err_set(err, 400, "stop_token_ids",
                            "'stop_token_ids' must be a list of at most "
                            "%d token ids",
                            TDM_MAX_STOP_IDS);
            goto out;
        }
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (!get_int(json_array_get(v, i), "stop_token_ids", 0, c->vocab - 1, &x, err))
                goto out;
            r->p.stop_ids[r->p.n_stop_ids++] = (int32_t)x;
        }
    }
    if ((v = json_object_get(root, "ignore_eos")) && !json_is_null(v)) {
        if (!get_bool(v, "ignore_eos", &b, err)) goto out;
        r->p.ignore_eos = b;
    }
    /* tandem's own: at most this many drafted tokens a step for this request (0: none) */
    if ((v = json_object_get(root, "spec_k")) && !json_is_null(v)) {
        if (!get_int(v, "spec_k", 0, TDM_SPEC_MAX_K, &x, err)) goto out;
        r->p.spec_k = x == 0 ? -1 : (int)x;
    }
    if ((v = json_object_get(root, "min_tokens")) && !json_is_null(v)) {
        if (!get_int(v, "min_tokens", 0, r->p.max_tokens, &x, err)) goto out;
        r->p.min_tokens = (int)x;
    }
    if ((v = json_object_get(root, "skip_special_tokens")) && !json_is_null(v)) {
        if (!get_bool(v, "skip_special_tokens", &b, err)) goto out;
        if (!b) {
            tdm_api_err_set(err, 400, "skip_special_tokens",
                            "only skip_special_tokens=true is "
                            "supported");
            goto out;
        }
    }
    if (chat) {
        if ((v = json_object_get(root, "logprobs")) && !json_is_null(v)) {
            if (!get_bool(v, "logprobs", &b, err)) goto out;
            r->chat_logprobs = b;
            if (b) r->p.top_logprobs = 0;
        }
        if ((v = json_object_get(root, "top_logprobs")) && !json_is_null(v)) {
            if (!get_int(v, "top_logprobs", 0, TDM_MAX_TOP_LOGPROBS, &x, err)) goto out;
            if (!r->chat_logprobs) {
                tdm_api_err_set(err, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
                goto out;
            }
            r->p.top_logprobs = (int)x;
        }
    } else if ((v = json_object_get(root, "logprobs")) && !json_is_null(v)) {
        if (!get_int(v, "logprobs", 0, TDM_MAX_TOP_LOGPROBS, &x, err)) goto out;
        r->p.top_logprobs = (int)x;
    }
    /* echo with logprobs scores the prompt; so does echo with nothing to generate (the
     * scheduler's max_tokens 0 is a scoring request's) */
    r->p.prompt_logprobs = r->echo && (r->p.top_logprobs >= 0 || r->p.max_tokens == 0);
    if ((v = json_object_get(root, "stream")) && !json_is_null(v)) {
        if (!get_bool(v, "stream", &b, err)) goto out;
        r->stream = b;
    }
    if ((v = json_object_get(root, "stream_options")) && !json_is_null(v)) {
        if (!json_is_object(v)) {
            tdm_api_err_set(err, 400, "stream_options", "'stream_options' must be an object");
            goto out;
        }
        json_t *opt; /* not v: json_object_foreach reads its object again at every step */
        json_object_foreach(v, key, opt)
        {
            if (strcmp(key, "include_usage") && strcmp(key, "continuous_usage_stats")) {
                tdm_api_err_set(err, 400, "stream_options", "unknown field 'stream_options.%s'",
                                key);
                goto out;
            }
            if (!strcmp(key, "include_usage")) {
                if (!get_bool(opt, "stream_options.include_usage", &b, err)) goto out;
                r->include_usage = b;
            } else {
                if (!get_bool(opt, "stream_options.continuous_usage_stats", &b, err)) goto out;
                r->continuous_usage = b;
            }
        }
        if (!r->stream) {
            tdm_api_err_set(err, 400, "stream_options", "'stream_options' needs 'stream': true");
            goto out;
        }
    }
    if (!parse_choices(root, r, err)) goto out; /* after logprobs and stream */
    if (!parse_structured(c, root, r, err)) goto out;
    if (!tool_grammar(c, r, err)) goto out; /* after the other constraints: one at most */
    r->p.grammar = r->grammar;
    r->p.prompt = r->prompt;
    r->p.n_prompt = r->n_prompt;
    r->p.bias_ids = r->bias_ids;
    r->p.bias_vals = r->bias_vals;
    r->p.n_bias = r->n_bias;
    ok = true;
out:
    json_decref(root);
    if (!ok) tdm_api_req_free(r);
    return ok;
}

/* ---- rendering ---- */

/* A token's text for logprobs: its bytes when they are valid UTF-8, else "bytes:\xNN..." as
 * vLLM writes partial characters. */
static json_t *token_str(const struct api_ctx *c, int32_t t)
{
    size_t len = 0;
    const char *p = tdm_tok_piece(c->tok, t, &len);
    if (!p) return json_string("");
    json_t *j = json_stringn(p, len);
    if (j) return j;
    char buf[6 + 4 * 64 + 1];
    size_t n = (size_t)snprintf(buf, sizeof buf, "bytes:");
    for (size_t i = 0; i < len && n + 4 < sizeof buf; i++)
        n += (size_t)snprintf(buf + n, sizeof buf - n, "\\x%02x", (unsigned char)p[i]);
    return json_string(buf);
}

static json_t *token_bytes(const struct api_ctx *c, int32_t t)
{
    size_t len = 0;
    const char *p = tdm_tok_piece(c->tok, t, &len);
    json_t *a = json_array();
    for (size_t i = 0; p && i < len; i++)
        json_array_append_new(a, json_integer((unsigned char)p[i]));
    return a;
}

static json_t *lp_value(float lp)
{
    /* JSON has no -Infinity: clamp to a very negative finite value as vLLM does */
    return json_real(lp < -9999.0f ? -9999.0 : (double)lp);
}

/* A completions top_logprobs entry, as OpenAI and vLLM give it: the k most likely, and the
 * token itself beside them when it is not one of them (so logprobs 0 gives it alone). */
static json_t *top_entry(const struct api_ctx *c, int k, const int32_t *ids, const float *lps,
                         int32_t token, float lp)
{
    json_t *o = json_object();
    bool in = false;
    for (int j = 0; j < k; j++) {
        json_t *s = token_str(c, ids[j]);
        json_object_set_new(o, json_string_value(s), lp_value(lps[j]));
        json_decref(s);
        in |= ids[j] == token;
    }
    if (!in) {
        json_t *s = token_str(c, token);
        json_object_set_new(o, json_string_value(s), lp_value(lp));
        json_decref(s);
    }
    return o;
}

/* Completions logprobs object for outputs [from, to) of a choice; with echo, its prompt's
 * tokens first (the first has no log-probability: null), and the outputs' offsets after the
 * echoed text. */
static json_t *logprobs_completion(const struct api_ctx *c, const struct api_req *r,
                                   const struct api_choice *ch, int from, int to, size_t text_base,
                                   bool echo)
{
    const struct tdm_req_view *v = ch->v, *pv = ch->pv ? ch->pv : ch->v;
    if (!v->logprobs || r->hide_logprobs) return json_null();
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    int k = r->p.top_logprobs;
    size_t shift = 0;
    if (echo) {
        const struct api_prompt ap = tdm_api_prompt(r, ch->prompt);
        const int pk = pv->prompt_top;
        for (int i = 0; i < ap.n; i++) {
            const int32_t t = ap.ids[i];
            const bool has = i > 0 && pv->prompt_lps;
            json_array_append_new(toks, token_str(c, t));
            json_array_append_new(lps, has ? lp_value(pv->prompt_lps[i]) : json_null());
            json_array_append_new(
                tops, has ? top_entry(c, TDM_MIN(k, pk), pv->prompt_top_ids + (size_t)i * pk,
                                      pv->prompt_top_lps + (size_t)i * pk, t, pv->prompt_lps[i])
                          : json_null());
            json_array_append_new(offs, json_integer((json_int_t)shift));
            if (i >= ap.echo_skip) {
                size_t len = 0;
                tdm_tok_piece(c->tok, t, &len);
                shift += len;
            }
        }
        shift = ap.echo_len; /* the outputs follow the echoed text */
    }
    for (int i = from; i < to; i++) {
        json_array_append_new(toks, token_str(c, v->tokens[i]));
        json_array_append_new(lps, lp_value(v->logprobs[i]));
        size_t off = i ? v->text_end[i - 1] : 0;
        json_array_append_new(offs,
                              json_integer((json_int_t)(shift + off - TDM_MIN(off, text_base))));
        json_array_append_new(tops,
                              top_entry(c, k, v->top_ids + (size_t)i * k,
                                        v->top_lps + (size_t)i * k, v->tokens[i], v->logprobs[i]));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs",
                     tops, "text_offset", offs);
}

/* A completion's text: with echo, its prompt's text before it. */
static json_t *completion_text(const struct api_req *r, int prompt, const char *text, size_t len,
                               bool echo)
{
    if (!echo) return jstr(text, len);
    const struct api_prompt ap = tdm_api_prompt(r, prompt);
    char *both = malloc(ap.echo_len + len + 1);
    if (!both) return NULL;
    memcpy(both, ap.echo_text, ap.echo_len);
    memcpy(both + ap.echo_len, text, len);
    json_t *j = jstr(both, ap.echo_len + len);
    free(both);
    return j;
}

static json_t *logprobs_chat(const struct api_ctx *c, const struct api_req *r,
                             const struct api_choice *ch, int from, int to)
{
    const struct tdm_req_view *v = ch->v;
    if (!v->logprobs || !r->chat_logprobs) return json_null();
    json_t *content = json_array();
    int k = r->p.top_logprobs;
    for (int i = from; i < to; i++) {
        json_t *tops = json_array();
        for (int j = 0; j < k; j++) {
            int32_t t = v->top_ids[(size_t)i * k + j];
            json_array_append_new(tops,
                                  json_pack("{s:o, s:o, s:o}", "token", token_str(c, t), "logprob",
                                            lp_value(v->top_lps[(size_t)i * k + j]), "bytes",
                                            token_bytes(c, t)));
        }
        json_array_append_new(content,
                              json_pack("{s:o, s:o, s:o, s:o}", "token", token_str(c, v->tokens[i]),
                                        "logprob", lp_value(v->logprobs[i]), "bytes",
                                        token_bytes(c, v->tokens[i]), "top_logprobs", tops));
    }
    return json_pack("{s:o}", "content", content);
}

static json_t *usage(const struct api_ctx *c, struct api_usage u)
{
    json_t *j =
        json_pack("{s:i, s:i, s:i}", "prompt_tokens", u.prompt_tokens, "completion_tokens",
                  u.completion_tokens, "total_tokens", u.prompt_tokens + u.completion_tokens);
    if (j && c->prefix_caching)
        json_object_set_new(j, "prompt_tokens_details",
                            json_pack("{s:i}", "cached_tokens", u.cached_tokens));
    return j;
}

static json_t *finish_value(const struct tdm_req_view *v)
{
    if (v->finish == TDM_FINISH_STOP) return json_string("stop");
    if (v->finish == TDM_FINISH_LENGTH) return json_string("length");
    return json_null();
}

static char *dump(json_t *root)
{
    if (!root) return NULL;
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return s;
}

/* A call's OpenAI object: {"id", "type": "function", "function": {"name", "arguments"}} (with
 * its index in a stream). The id is derived from the response's id, the choice's and the
 * call's place: unique within the response, and unlike any other response's. */
static json_t *tool_call_json(const char *id, int choice, int k, json_t *call, bool indexed)
{
    uint64_t h = 1469598103934665603ull;
    for (const char *p = id; *p; p++)
        h = (h ^ (uint8_t)*p) * 1099511628211ull;
    h ^= (uint64_t)choice * 0x9e3779b97f4a7c15ull + (uint64_t)k * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 31)) * 0x94d049bb133111ebull;
    char cid[32];
    snprintf(cid, sizeof cid, "call_%016llx", (unsigned long long)h);
    json_t *o =
        json_pack("{s:s, s:s, s:{s:O, s:O}}", "id", cid, "type", "function", "function", "name",
                  json_object_get(call, "name"), "arguments", json_object_get(call, "arguments"));
    if (o && indexed) json_object_set_new(o, "index", json_integer(k));
    return o;
}

/* finish_reason of a choice whose output made calls: "tool_calls" where it would be "stop" */
static json_t *finish_with_calls(const struct tdm_req_view *v, int n_calls)
{
    if (n_calls && v->finish == TDM_FINISH_STOP) return json_string("tool_calls");
    return finish_value(v);
}

/* A chat choice's message with its output scanned for tool calls. */
static json_t *message_with_tools(const struct api_req *r, const char *id, int choice,
                                  const struct tdm_req_view *v, int *n_calls)
{
    struct api_tool_scan ts = {0};
    struct api_text content = {0};
    json_t *calls = json_array();
    tdm_api_tools_scan(&ts, r->tool_format, v->text, v->text_len, true, &content, calls);
    json_t *msg = json_pack("{s:s, s:o}", "role", "assistant", "content",
                            content.n || !ts.n_calls ? jstr(content.p ? content.p : "", content.n)
                                                     : json_null());
    if (msg && ts.n_calls) {
        json_t *arr = json_array();
        for (int k = 0; k < ts.n_calls; k++)
            json_array_append_new(arr,
                                  tool_call_json(id, choice, k, json_array_get(calls, k), false));
        json_object_set_new(msg, "tool_calls", arr);
    }
    *n_calls = ts.n_calls;
    json_decref(calls);
    free(content.p);
    return msg;
}

char *tdm_api_render_full(const struct api_ctx *c, const struct api_req *r, const char *id,
                          long created, const struct api_choice *ch, int n_ch, struct api_usage u)
{
    json_t *choices = json_array();
    for (int i = 0; i < n_ch; i++) {
        const struct tdm_req_view *v = ch[i].v;
        json_t *choice;
        if (r->chat && r->tools_parse) {
            int n_calls = 0;
            json_t *msg = message_with_tools(r, id, ch[i].index, v, &n_calls);
            choice = json_pack("{s:i, s:o, s:o, s:o}", "index", ch[i].index, "message", msg,
                               "logprobs", logprobs_chat(c, r, &ch[i], 0, v->n_out),
                               "finish_reason", finish_with_calls(v, n_calls));
        } else if (r->chat)
            choice = json_pack("{s:i, s:{s:s, s:o}, s:o, s:o}", "index", ch[i].index, "message",
                               "role", "assistant", "content", jstr(v->text, v->text_len),
                               "logprobs", logprobs_chat(c, r, &ch[i], 0, v->n_out),
                               "finish_reason", finish_value(v));
        else
            choice =
                json_pack("{s:i, s:o, s:o, s:o}", "index", ch[i].index, "text",
                          completion_text(r, ch[i].prompt, v->text, v->text_len, r->echo),
                          "logprobs", logprobs_completion(c, r, &ch[i], 0, v->n_out, 0, r->echo),
                          "finish_reason", finish_value(v));
        json_array_append_new(choices, choice);
    }
    return dump(json_pack("{s:s, s:s, s:i, s:s, s:o, s:o}", "id", id, "object",
                          r->chat ? "chat.completion" : "text_completion", "created",
                          (json_int_t)created, "model", c->model_name, "choices", choices, "usage",
                          usage(c, u)));
}

static char *sse(json_t *root)
{
    char *j = dump(root);
    if (!j) return NULL;
    size_t n = strlen(j);
    char *s = malloc(n + 9);
    if (s) {
        memcpy(s, "data: ", 6);
        memcpy(s + 6, j, n);
        memcpy(s + 6 + n, "\n\n", 3);
    }
    free(j);
    return s;
}

/* A chunk event around one choice; with continuous usage, the choice's tokens through it
 * (n_out of them). */
static char *chunk_sse(const struct api_ctx *c, const struct api_req *r, const char *id,
                       long created, json_t *choice, const struct tdm_req_view *v, int n_out)
{
    json_t *chunk = json_pack("{s:s, s:s, s:i, s:s, s:[o]}", "id", id, "object",
                              r->chat ? "chat.completion.chunk" : "text_completion", "created",
                              (json_int_t)created, "model", c->model_name, "choices", choice);
    if (chunk && r->continuous_usage)
        json_object_set_new(chunk, "usage",
                            json_pack("{s:i, s:i, s:i}", "prompt_tokens", v->n_prompt,
                                      "completion_tokens", n_out, "total_tokens",
                                      v->n_prompt + n_out));
    return sse(chunk);
}

char *tdm_api_render_tool_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                                long created, const struct api_choice *ch, int from, int to,
                                struct api_tool_scan *ts, bool first, bool finish)
{
    const struct tdm_req_view *v = ch->v;
    size_t upto = finish ? v->text_len : to > 0 ? v->text_end[to - 1] : 0;
    if (upto < ts->pos) upto = ts->pos;
    struct api_text content = {0};
    json_t *calls = json_array();
    const int before = ts->n_calls;
    tdm_api_tools_scan(ts, r->tool_format, v->text, upto, finish, &content, calls);
    json_t *delta = json_object();
    if (first) json_object_set_new(delta, "role", json_string("assistant"));
    if (content.n || (first && !ts->n_calls))
        json_object_set_new(delta, "content", jstr(content.p ? content.p : "", content.n));
    if (ts->n_calls > before) {
        json_t *arr = json_array();
        for (int k = before; k < ts->n_calls; k++)
            json_array_append_new(arr, tool_call_json(id, ch->index, k,
                                                      json_array_get(calls, (size_t)(k - before)),
                                                      true));
        json_object_set_new(delta, "tool_calls", arr);
    }
    json_decref(calls);
    free(content.p);
    json_t *choice = json_pack("{s:i, s:o, s:o, s:o}", "index", ch->index, "delta", delta,
                               "logprobs", logprobs_chat(c, r, ch, from, to), "finish_reason",
                               finish ? finish_with_calls(v, ts->n_calls) : json_null());
    return chunk_sse(c, r, id, created, choice, v, finish ? v->n_out : to);
}

char *tdm_api_render_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                           long created, const struct api_choice *ch, int from, int to,
                           size_t text_from, bool first, bool finish)
{
    const struct tdm_req_view *v = ch->v;
    size_t text_to = to > 0 ? v->text_end[to - 1] : 0;
    if (finish) text_to = v->text_len;
    if (text_to < text_from) text_to = text_from;
    /* echo: the prompt comes with the first chunk */
    json_t *text = r->chat ? jstr(v->text + text_from, text_to - text_from)
                           : completion_text(r, ch->prompt, v->text + text_from,
                                             text_to - text_from, r->echo && first);
    json_t *choice;
    if (r->chat) {
        json_t *delta = json_object();
        if (first) json_object_set_new(delta, "role", json_string("assistant"));
        if (text_to > text_from || first)
            json_object_set_new(delta, "content", text);
        else
            json_decref(text);
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", ch->index, "delta", delta, "logprobs",
                           logprobs_chat(c, r, ch, from, to), "finish_reason",
                           finish ? finish_value(v) : json_null());
    } else {
        choice = json_pack("{s:i, s:o, s:o, s:o}", "index", ch->index, "text", text, "logprobs",
                           logprobs_completion(c, r, ch, from, to, text_from, r->echo && first),
                           "finish_reason", finish ? finish_value(v) : json_null());
    }
    return chunk_sse(c, r, id, created, choice, v, finish ? v->n_out : to);
}

char *tdm_api_render_usage_chunk(const struct api_ctx *c, const struct api_req *r, const char *id,
                                 long created, struct api_usage u)
{
    return sse(json_pack("{s:s, s:s, s:i, s:s, s:[], s:o}", "id", id, "object",
                         r->chat ? "chat.completion.chunk" : "text_completion", "created",
                         (json_int_t)created, "model", c->model_name, "choices", "usage",
                         usage(c, u)));
}

static json_t *model_object(const struct api_ctx *c, long created)
{
    return json_pack("{s:s, s:s, s:i, s:s, s:i}", "id", c->model_name, "object", "model", "created",
                     (json_int_t)created, "owned_by", "tandem", "max_model_len", c->max_ctx);
}

char *tdm_api_render_models(const struct api_ctx *c, long created)
{
    return dump(json_pack("{s:s, s:[o]}", "object", "list", "data", model_object(c, created)));
}

char *tdm_api_render_model(const struct api_ctx *c, long created)
{
    return dump(model_object(c, created));
}

/* ---- /tokenize and /detokenize (vLLM's) ---- */

/* The body as an object whose keys are all in `known` (NULL-terminated), or NULL with err. */
static json_t *load_object(const char *body, size_t len, const char *const *known,
                           struct api_err *err)
{
    json_t *root = load_body(body, len, err);
    if (!root) return NULL;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        bool found = false;
        for (size_t i = 0; known[i] && !found; i++)
            found = !strcmp(key, known[i]);
        if (!found) {
            tdm_api_err_set(err, 400, key, "unknown field '%s'", key);
            json_decref(root);
            return NULL;
        }
    }
    return root;
}

/* An optional boolean field, `def` when absent or null. */
static bool opt_bool(json_t *root, const char *name, bool def, bool *out, struct api_err *err)
{
    json_t *v = json_object_get(root, name);
    *out = def;
    return !v || json_is_null(v) || get_bool(v, name, out, err);
}

char *tdm_api_tokenize(const struct api_ctx *c, const char *body, size_t len, struct api_err *err)
{
    static const char *const known[] = {"model",
                                        "prompt",
                                        "messages",
                                        "add_special_tokens",
                                        "add_generation_prompt",
                                        "return_token_strs",
                                        "tools",
                                        NULL};
    memset(err, 0, sizeof *err);
    json_t *root = load_object(body, len, known, err);
    if (!root) return NULL;
    char *out = NULL;
    struct api_req r = {0};
    bool specials, gen_prompt, strs;
    json_t *prompt = json_object_get(root, "prompt"), *msgs = json_object_get(root, "messages");
    if (!check_model(c, root, err) || !opt_bool(root, "add_special_tokens", true, &specials, err) ||
        !opt_bool(root, "add_generation_prompt", true, &gen_prompt, err) ||
        !opt_bool(root, "return_token_strs", false, &strs, err))
        goto out;
    if (!prompt == !msgs) {
        tdm_api_err_set(err, 400, NULL, "give either 'prompt' (a string) or 'messages'");
        goto out;
    }
    if (prompt) {
        if (!json_is_string(prompt)) {
            tdm_api_err_set(err, 400, "prompt", "'prompt' must be a string");
            goto out;
        }
        int flags = TDM_TOK_PARSE_SPECIAL | (specials && c->add_bos ? TDM_TOK_ADD_BOS : 0);
        if (!encode_text(c, json_string_value(prompt), json_string_length(prompt), flags, &r,
                         "prompt", err))
            goto out;
    } else if (!parse_tools(c, root, &r, err) ||
               !parse_messages(c, msgs, gen_prompt, specials, &r, err)) {
        goto out;
    }
    json_t *ids = json_array(), *pieces = strs ? json_array() : json_null();
    for (int i = 0; i < r.n_prompt; i++) {
        json_array_append_new(ids, json_integer(r.prompt[i]));
        if (strs) json_array_append_new(pieces, token_str(c, r.prompt[i]));
    }
    out = dump(json_pack("{s:i, s:i, s:o, s:o}", "count", r.n_prompt, "max_model_len", c->max_ctx,
                         "tokens", ids, "token_strs", pieces));
    if (!out) tdm_api_err_set(err, 500, NULL, "out of memory");
out:
    tdm_api_req_free(&r);
    json_decref(root);
    return out;
}

bool tdm_api_prompt_ids(const struct api_ctx *c, bool chat, const char *body, size_t len,
                        int32_t **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    struct api_err err = {0};
    json_t *root = load_body(body, len, &err);
    if (!root) return false;
    struct api_req r = {0};
    bool ok;
    if (chat) {
        json_t *msgs = json_object_get(root, "messages");
        ok =
            msgs && parse_tools(c, root, &r, &err) && parse_messages(c, msgs, true, true, &r, &err);
    } else {
        json_t *prompt = json_object_get(root, "prompt"), *suffix = json_object_get(root, "suffix");
        if (prompt && prompt_list_size(prompt) > 1) prompt = json_array_get(prompt, 0);
        /* a fill-in-the-middle prompt is rearranged around its suffix: not a prefix to route */
        ok = prompt && (!suffix || json_is_null(suffix)) && parse_prompt(c, prompt, true, &r, &err);
    }
    if (ok) {
        *ids = r.prompt;
        *n = r.n_prompt;
        r.prompt = NULL;
    }
    tdm_api_req_free(&r);
    json_decref(root);
    return ok;
}

char *tdm_api_detokenize(const struct api_ctx *c, const char *body, size_t len, struct api_err *err)
{
    static const char *const known[] = {"model", "tokens", NULL};
    memset(err, 0, sizeof *err);
    json_t *root = load_object(body, len, known, err);
    if (!root) return NULL;
    char *out = NULL, *text = NULL;
    int32_t *ids = NULL;
    json_t *v = json_object_get(root, "tokens");
    if (!check_model(c, root, err)) goto out;
    if (!json_is_array(v)) {
        tdm_api_err_set(err, 400, "tokens", "'tokens' must be a list of token ids");
        goto out;
    }
    size_t n = json_array_size(v);
    if (n > (size_t)c->max_ctx) {
        tdm_api_err_set(err, 400, "tokens", "%zu tokens; at most %d (this model's context)", n,
                        c->max_ctx);
        err->code = CONTEXT_EXCEEDED;
        goto out;
    }
    ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) goto oom;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= c->vocab) {
            tdm_api_err_set(err, 400, "tokens", "tokens[%zu] is not a token id in [0, %d)", i,
                            c->vocab);
            goto out;
        }
        ids[i] = (int32_t)json_integer_value(t);
    }
    size_t cap = n * (c->max_piece ? c->max_piece : 16) + 1, n_bytes = 0;
    if (!(text = malloc(cap))) goto oom;
    tdm_status st = tdm_tok_decode(c->tok, ids, n, false, text, cap, &n_bytes);
    if (st == TDM_ERANGE || (st == TDM_OK && n_bytes >= cap)) { /* longer than guessed */
        free(text);
        cap = n_bytes + 1;
        if (!(text = malloc(cap))) goto oom;
        st = tdm_tok_decode(c->tok, ids, n, false, text, cap, &n_bytes);
    }
    if (st != TDM_OK || n_bytes >= cap) {
        tdm_api_err_set(err, 500, NULL, "the tokens could not be decoded: %s", tdm_err_msg());
        goto out;
    }
    out = dump(json_pack("{s:o}", "prompt", jstr(text, n_bytes)));
    if (!out) goto oom;
    goto out;
oom:
    tdm_api_err_set(err, 500, NULL, "out of memory");
out:
    free(text);
    free(ids);
    json_decref(root);
    return out;
}
