/*
 * Tool calls in a model's output: the chat formats tandem renders tools in (tok/chat.c), read
 * back into OpenAI's tool_calls, as text arrives.
 *
 *   hermes (ChatML models: Qwen2.5, Hermes, SmolLM2): <tool_call>\n{"name": "f", "arguments":
 *     {...}}\n</tool_call> blocks, anywhere in the text; what is outside them is content.
 *   llama3 (Llama 3.1 with custom tools): the whole output is one {"name": "f", "parameters":
 *     {...}} object (an optional <|python_tag|> before it); otherwise it is content.
 *
 * The scanner is incremental: each call consumes the text released so far (the reader's, which
 * only grows) from where the last one stopped, and hands out the content that can no longer turn
 * into a call, and the calls that closed. Held back: a tail that may be the start of
 * "<tool_call>", an open block, whitespace (shown once something else follows it, dropped at the
 * end when calls were made), and for llama3 everything once the output starts with '{'. At the
 * end (final) what is held is content, so nothing the model wrote is lost: a block that never
 * closes, or whose JSON is not a call, comes back as text.
 *
 * Pure functions on the caller's state; one scanner per choice, on the thread that renders it.
 */
#include <string.h>

#include "server/server_int.h"

static const char OPEN[] = "<tool_call>", CLOSE[] = "</tool_call>", PY_TAG[] = "<|python_tag|>";

static bool all_space(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\t' && s[i] != '\r') return false;
    return true;
}

/* A call from JSON text: {"name": string, "arguments" | "parameters": object or string}. */
static json_t *call_of(const char *s, size_t n)
{
    json_error_t je;
    json_t *j = json_loadb(s, n, 0, &je);
    json_t *name = json_object_get(j, "name"), *args = json_object_get(j, "arguments");
    if (!args) args = json_object_get(j, "parameters");
    json_t *out = NULL;
    if (json_is_string(name) && json_string_length(name) &&
        (json_is_object(args) || json_is_string(args))) {
        char *a = json_is_string(args) ? strdup(json_string_value(args))
                                       : json_dumps(args, JSON_COMPACT | JSON_ENSURE_ASCII);
        if (a) out = json_pack("{s:O, s:s}", "name", name, "arguments", a);
        free(a);
    }
    json_decref(j);
    return out;
}

static void append(struct api_text *out, const char *s, size_t n)
{
    char *p = realloc(out->p, out->n + n + 1);
    if (!p) {
        out->oom = true;
        return;
    }
    memcpy(p + out->n, s, n);
    out->p = p;
    out->n += n;
    out->p[out->n] = 0;
}

/* Content t[from, to) joins the output; whitespace waits for what follows it. */
static void emit(struct api_tool_scan *ts, const char *t, size_t from, size_t to,
                 struct api_text *content)
{
    if (to <= from) return;
    size_t last = to; /* the end of what is not trailing whitespace */
    while (last > from && all_space(t + last - 1, 1))
        last--;
    if (last > from) { /* held whitespace, then this up to its own trailing whitespace */
        size_t start = ts->ws_len ? ts->ws_from : from;
        append(content, t + start, last - start);
        ts->ws_len = 0;
    }
    if (last < to) { /* trailing whitespace waits (it joins any held before it) */
        if (!ts->ws_len) ts->ws_from = last;
        ts->ws_len = to - ts->ws_from;
    }
}

static void add_call(struct api_tool_scan *ts, json_t *calls, json_t *call)
{
    json_array_append_new(calls, call);
    ts->n_calls++;
    ts->ws_len = 0; /* whitespace before a call is layout */
}

static void scan_hermes(struct api_tool_scan *ts, const char *t, size_t len, bool final,
                        struct api_text *content, json_t *calls)
{
    const size_t lo = sizeof OPEN - 1, lc = sizeof CLOSE - 1;
    while (ts->pos < len) {
        if (!ts->in_call) {
            const char *k = memmem(t + ts->pos, len - ts->pos, OPEN, lo);
            if (k) {
                emit(ts, t, ts->pos, (size_t)(k - t), content);
                ts->pos = (size_t)(k - t) + lo;
                ts->call_start = ts->pos;
                ts->in_call = true;
                continue;
            }
            size_t safe = len;
            if (!final) /* a tail that may still become "<tool_call>" waits */
                for (size_t keep = lo - 1; keep > 0; keep--)
                    if (len - ts->pos >= keep && !memcmp(t + len - keep, OPEN, keep)) {
                        safe = len - keep;
                        break;
                    }
            emit(ts, t, ts->pos, safe, content);
            ts->pos = safe;
            return;
        }
        const char *k = memmem(t + ts->call_start, len - ts->call_start, CLOSE, lc);
        if (!k) {
            if (final) { /* never closed: what the model wrote is content */
                emit(ts, t, ts->call_start - lo, len, content);
                ts->pos = len;
                ts->in_call = false;
            }
            return;
        }
        json_t *call = call_of(t + ts->call_start, (size_t)(k - t) - ts->call_start);
        if (call)
            add_call(ts, calls, call);
        else
            emit(ts, t, ts->call_start - lo, (size_t)(k - t) + lc, content);
        ts->pos = (size_t)(k - t) + lc;
        ts->in_call = false;
    }
}

static void scan_llama3(struct api_tool_scan *ts, const char *t, size_t len, bool final,
                        struct api_text *content, json_t *calls)
{
    if (ts->mode == 0) { /* undecided: the first non-blank byte says */
        size_t i = 0;
        while (i < len && all_space(t + i, 1))
            i++;
        const size_t lp = sizeof PY_TAG - 1;
        bool tag_prefix = len - i < lp && !memcmp(t + i, PY_TAG, len - i);
        if (i == len || (tag_prefix && !final)) {
            if (!final) return;
        } else {
            ts->mode = (t[i] == '{' || (len - i >= lp && !memcmp(t + i, PY_TAG, lp))) ? 2 : 1;
            ts->call_start = t[i] == '{' ? i : i + lp;
        }
    }
    if (ts->mode == 2) {
        if (!final) return;
        json_t *call = call_of(t + ts->call_start, len - ts->call_start);
        if (call)
            add_call(ts, calls, call);
        else
            emit(ts, t, 0, len, content);
        ts->pos = len;
        return;
    }
    emit(ts, t, ts->pos, len, content);
    ts->pos = len;
}

void tdm_api_tools_scan(struct api_tool_scan *ts, int format, const char *text, size_t len,
                        bool final, struct api_text *content, json_t *calls)
{
    if (format == TDM_TOOLS_LLAMA3)
        scan_llama3(ts, text, len, final, content, calls);
    else
        scan_hermes(ts, text, len, final, content, calls);
    if (final && ts->ws_len && !ts->n_calls) /* trailing blanks of plain content stay */
        append(content, text + ts->ws_from, ts->ws_len);
    if (final) ts->ws_len = 0;
}
