/*
 * Chat templates: recognise a model's Jinja chat template and render conversations exactly as
 * that template would, without a Jinja interpreter.
 *
 * Why no interpreter: the families we serve use two fixed shapes, and rendering them directly
 * is small, fast and has no failure modes on user content. Detection looks for each shape's
 * markers; anything else is TDM_EUNSUPPORTED so the caller can choose what to do.
 *
 *   ChatML (SmolLM2, Qwen2/2.5/3):
 *     [<|im_start|>system\n{default}<|im_end|>\n]   when the first message is not a system one
 *     <|im_start|>{role}\n{content}<|im_end|>\n      per message, content verbatim
 *     <|im_start|>assistant\n                        with add_generation_prompt
 *   Llama 3:
 *     <|begin_of_text|>                              before the first message (bos_token)
 *     <|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>
 *     <|start_header_id|>assistant<|end_header_id|>\n\n   with add_generation_prompt
 *
 * With tools (tdm_chat_render_tools), as Qwen2.5's template (ChatML) and Llama 3.1's with custom
 * tools render them:
 *   ChatML: <|im_start|>system\n{system or default}\n\n# Tools ... <tools>\n{tool}...\n</tools>
 *           ... <|im_end|>\n; an assistant's calls <|im_start|>assistant[\n{content}]
 *           (\n<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>)*<|im_end|>\n;
 *           consecutive "tool" results one user turn of \n<tool_response>\n{content}\n
 *           </tool_response> blocks.
 *   Llama 3: the tools (indent 4) after a fixed instruction at the head of the first user
 *           message; calls {"name": "f", "parameters": {...}}; results an "ipython" turn.
 *
 * The ChatML default system prompt is read from the template itself: a string literal that
 * continues "<|im_start|>system" + newline with literal text up to "<|im_end|>" (Jinja string
 * escapes undone). `trim` strips what Python's str.strip() strips.
 *
 * Threading: pure functions; a template struct is read-only while rendering.
 */
#include "tok/tok_int.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define CHAT_MAX_BYTES ((size_t)256 << 20)

static const char IM_SYS[] = "<|im_start|>system";
static const char IM_END[] = "<|im_end|>";

/* Reads the rest of a Jinja string literal delimited by `quote` from p up to "<|im_end|>",
 * undoing string escapes. NULL when the literal ends before the marker. */
static char *literal_until_im_end(const char *p, char quote)
{
    const char *end = strstr(p, IM_END);
    if (!end || end == p) return NULL;
    char *out = malloc((size_t)(end - p) + 1);
    if (!out) return NULL;
    size_t n = 0;
    for (const char *q = p; q < end; q++) {
        if (*q == quote) {
            free(out);
            return NULL;
        }
        if (*q == '\\' && q + 1 < end) {
            q++;
            switch (*q) {
            case 'n':
                out[n++] = '\n';
                break;
            case 't':
                out[n++] = '\t';
                break;
            case 'r':
                out[n++] = '\r';
                break;
            default:
                out[n++] = *q;
                break; /* \\ \' \" */
            }
            continue;
        }
        out[n++] = *q;
    }
    out[n] = 0;
    return out;
}

static char *find_default_system(const char *jinja)
{
    for (const char *p = strstr(jinja, IM_SYS); p; p = strstr(p + 1, IM_SYS)) {
        /* the literal's opening quote: the nearest quote character before the marker */
        const char *o = p;
        while (o > jinja && o[-1] != '\'' && o[-1] != '"')
            o--;
        if (o == jinja) continue;
        char quote = o[-1];
        const char *q = p + strlen(IM_SYS);
        if (*q == '\n')
            q += 1;
        else if (q[0] == '\\' && q[1] == 'n')
            q += 2;
        else
            continue;
        char *s = literal_until_im_end(q, quote);
        if (s) return s;
    }
    return NULL;
}

tdm_status tdm_chat_template_detect(const char *jinja, struct tdm_chat_template *out)
{
    if (!out) return tdm_err_set(TDM_EINVAL, "tdm_chat_template_detect: NULL argument");
    memset(out, 0, sizeof *out);
    if (!jinja) return tdm_err_set(TDM_EUNSUPPORTED, "chat template: none given");
    if (strstr(jinja, "<|start_header_id|>") && strstr(jinja, "<|end_header_id|>") &&
        strstr(jinja, "<|eot_id|>")) {
        out->format = TDM_CHAT_LLAMA3;
        out->add_bos_text = strstr(jinja, "bos_token") || strstr(jinja, "<|begin_of_text|>");
        return TDM_OK;
    }
    if (strstr(jinja, "<|im_start|>") && strstr(jinja, IM_END)) {
        out->format = TDM_CHAT_CHATML;
        out->default_system = find_default_system(jinja);
        return TDM_OK;
    }
    return tdm_err_set(TDM_EUNSUPPORTED, "chat template: not ChatML or Llama 3");
}

void tdm_chat_template_clear(struct tdm_chat_template *t)
{
    if (!t) return;
    free(t->default_system);
    memset(t, 0, sizeof *t);
}

/* [*b, *e): content with Python-whitespace trimmed from both ends (valid UTF-8). */
static void py_trim(const char *s, size_t len, size_t *b, size_t *e)
{
    size_t i = 0;
    while (i < len) {
        uint32_t cp;
        int cl = tdm_tok_utf8_decode(s + i, &cp);
        if (!tdm_tok_is_py_space(cp)) break;
        i += (size_t)cl;
    }
    size_t j = len;
    while (j > i) {
        size_t k = j - 1;
        while (k > i && ((unsigned char)s[k] & 0xC0) == 0x80)
            k--;
        uint32_t cp;
        tdm_tok_utf8_decode(s + k, &cp);
        if (!tdm_tok_is_py_space(cp)) break;
        j = k;
    }
    *b = i;
    *e = j;
}

struct out_buf {
    char *p;
    size_t n; /* bytes written (or, in the sizing pass, counted) */
};

static void put(struct out_buf *o, const char *s, size_t len)
{
    if (o->p) memcpy(o->p + o->n, s, len);
    o->n += len;
}

static void puts_(struct out_buf *o, const char *s)
{
    put(o, s, strlen(s));
}

/* What rendering with tools needs besides the messages: the tools and every call's arguments
 * as the template prints them (Jinja's tojson: ", " and ": " separators; Llama 3's tools with
 * an indent of 4). */
struct tool_text {
    char **tools; /* [n_tools] */
    int n_tools;
    char **args; /* [sum of n_calls], message-major */
};

static const char QWEN_TOOLS_HEAD[] =
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char QWEN_TOOLS_TAIL[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
static const char LLAMA_TOOLS_HEAD[] =
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": "
    "function name, \"parameters\": dictionary of argument name and its value}.Do not use "
    "variables.\n\n";

static void render_chatml(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                          size_t n, const struct tool_text *tt, bool gen, struct out_buf *o)
{
    size_t first = 0;
    if (tt && tt->n_tools) { /* the system turn carries the tools */
        puts_(o, "<|im_start|>system\n");
        if (n && !strcmp(msgs[0].role, "system")) {
            puts_(o, msgs[0].content);
            first = 1;
        } else if (t->default_system) {
            puts_(o, t->default_system);
        }
        puts_(o, QWEN_TOOLS_HEAD);
        for (int k = 0; k < tt->n_tools; k++) {
            puts_(o, "\n");
            puts_(o, tt->tools[k]);
        }
        puts_(o, QWEN_TOOLS_TAIL);
    } else if (n && t->default_system && strcmp(msgs[0].role, "system")) {
        puts_(o, "<|im_start|>system\n");
        puts_(o, t->default_system);
        puts_(o, "<|im_end|>\n");
    }
    int arg = 0;
    for (size_t i = 0; i < first; i++)
        arg += msgs[i].n_calls;
    for (size_t i = first; i < n; i++) {
        const struct tdm_chat_msg *m = &msgs[i];
        if (!strcmp(m->role, "tool")) { /* consecutive results share one user turn */
            if (i == 0 || strcmp(msgs[i - 1].role, "tool")) puts_(o, "<|im_start|>user");
            puts_(o, "\n<tool_response>\n");
            puts_(o, m->content);
            puts_(o, "\n</tool_response>");
            if (i + 1 == n || strcmp(msgs[i + 1].role, "tool")) puts_(o, "<|im_end|>\n");
            continue;
        }
        if (m->n_calls) {
            puts_(o, "<|im_start|>");
            puts_(o, m->role);
            if (*m->content) {
                puts_(o, "\n");
                puts_(o, m->content);
            }
            for (int k = 0; k < m->n_calls; k++) {
                puts_(o, "\n<tool_call>\n{\"name\": \"");
                puts_(o, m->calls[k].name);
                puts_(o, "\", \"arguments\": ");
                puts_(o, tt->args[arg++]);
                puts_(o, "}\n</tool_call>");
            }
            puts_(o, "<|im_end|>\n");
            continue;
        }
        puts_(o, "<|im_start|>");
        puts_(o, m->role);
        puts_(o, "\n");
        puts_(o, m->content);
        puts_(o, "<|im_end|>\n");
    }
    if (gen) puts_(o, "<|im_start|>assistant\n");
}

static void render_llama3(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                          size_t n, const struct tool_text *tt, bool gen, struct out_buf *o)
{
    bool tools_due = tt && tt->n_tools; /* into the first user message */
    int arg = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_chat_msg *m = &msgs[i];
        if (i == 0 && t->add_bos_text) puts_(o, "<|begin_of_text|>");
        puts_(o, "<|start_header_id|>");
        puts_(o, !strcmp(m->role, "tool") ? "ipython" : m->role);
        puts_(o, "<|end_header_id|>\n\n");
        if (tools_due && !strcmp(m->role, "user")) {
            puts_(o, LLAMA_TOOLS_HEAD);
            for (int k = 0; k < tt->n_tools; k++) {
                puts_(o, tt->tools[k]);
                puts_(o, "\n\n");
            }
            tools_due = false;
        }
        if (m->n_calls) {
            for (int k = 0; k < m->n_calls; k++) {
                puts_(o, "{\"name\": \"");
                puts_(o, m->calls[k].name);
                puts_(o, "\", \"parameters\": ");
                puts_(o, tt->args[arg++]);
                puts_(o, "}");
            }
        } else {
            size_t b, e, len = strlen(m->content);
            py_trim(m->content, len, &b, &e);
            put(o, m->content + b, e - b);
        }
        puts_(o, "<|eot_id|>");
    }
    if (gen) puts_(o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs, size_t n,
                   const struct tool_text *tt, bool gen, struct out_buf *o)
{
    switch (t->format) {
    case TDM_CHAT_CHATML:
        render_chatml(t, msgs, n, tt, gen, o);
        break;
    case TDM_CHAT_LLAMA3:
        render_llama3(t, msgs, n, tt, gen, o);
        break;
    case TDM_CHAT_RAW:
        for (size_t i = 0; i < n; i++)
            puts_(o, msgs[i].content);
        break;
    }
}

/* JSON text re-printed with Jinja tojson's separators (indent > 0: that indent); a text that is
 * not JSON becomes a JSON string when as_string, else NULL. */
static char *tojson(const char *text, int indent, bool as_string)
{
    json_error_t je;
    json_t *j = json_loads(text, JSON_DECODE_ANY, &je);
    if (!j) {
        if (!as_string) return NULL;
        j = json_string(text);
        if (!j) return NULL;
    }
    char *s = json_dumps(j, JSON_ENCODE_ANY | (indent > 0 ? JSON_INDENT(indent) : 0));
    json_decref(j);
    return s;
}

static void tool_text_free(struct tool_text *tt, int n_args)
{
    for (int i = 0; tt->tools && i < tt->n_tools; i++)
        free(tt->tools[i]);
    for (int i = 0; tt->args && i < n_args; i++)
        free(tt->args[i]);
    free(tt->tools);
    free(tt->args);
}

static tdm_status check_msgs(const struct tdm_chat_msg *msgs, size_t n, int *n_args)
{
    size_t total = 0;
    *n_args = 0;
    for (size_t i = 0; i < n; i++) {
        if (!msgs[i].role || !msgs[i].content)
            return tdm_err_set(TDM_EINVAL, "chat message %zu has no role or content", i);
        size_t rl = strlen(msgs[i].role), cl = strlen(msgs[i].content), bad;
        if (!tdm_tok_utf8_valid(msgs[i].role, rl, &bad))
            return tdm_err_set(TDM_EINVAL, "chat message %zu: role is not UTF-8", i);
        if (!tdm_tok_utf8_valid(msgs[i].content, cl, &bad))
            return tdm_err_set(TDM_EINVAL,
                               "chat message %zu: invalid UTF-8 at byte offset %zu of content", i,
                               bad);
        if (msgs[i].n_calls < 0 || (msgs[i].n_calls && !msgs[i].calls))
            return tdm_err_set(TDM_EINVAL, "chat message %zu: bad tool calls", i);
        for (int k = 0; k < msgs[i].n_calls; k++) {
            const struct tdm_chat_call *c = &msgs[i].calls[k];
            if (!c->name || !c->arguments ||
                !tdm_tok_utf8_valid(c->name, strlen(c->name), &bad) ||
                !tdm_tok_utf8_valid(c->arguments, strlen(c->arguments), &bad))
                return tdm_err_set(TDM_EINVAL, "chat message %zu: tool call %d is not UTF-8 text",
                                   i, k);
            total += strlen(c->name) + strlen(c->arguments);
        }
        *n_args += msgs[i].n_calls;
        total += rl + cl;
        if (total > CHAT_MAX_BYTES)
            return tdm_err_set(TDM_ERANGE, "chat: conversation over %zu bytes", CHAT_MAX_BYTES);
    }
    return TDM_OK;
}

tdm_status tdm_chat_render_tools(const struct tdm_chat_template *t,
                                 const struct tdm_chat_msg *msgs, size_t n,
                                 const char *const *tools, int n_tools,
                                 bool add_generation_prompt, char **out)
{
    if (!t || (!msgs && n) || !out || n_tools < 0 || (n_tools && !tools))
        return tdm_err_set(TDM_EINVAL, "tdm_chat_render: NULL");
    if (t->format != TDM_CHAT_CHATML && t->format != TDM_CHAT_LLAMA3 && t->format != TDM_CHAT_RAW)
        return tdm_err_set(TDM_EINVAL, "chat template: unknown format %d", (int)t->format);
    int n_args;
    tdm_status st = check_msgs(msgs, n, &n_args);
    if (st != TDM_OK) return st;
    struct tool_text tt = {.n_tools = n_tools};
    tt.tools = calloc((size_t)n_tools + 1, sizeof *tt.tools);
    tt.args = calloc((size_t)n_args + 1, sizeof *tt.args);
    if (!tt.tools || !tt.args) {
        tool_text_free(&tt, n_args);
        return tdm_err_set(TDM_ENOMEM, "chat: out of memory");
    }
    const int indent = t->format == TDM_CHAT_LLAMA3 ? 4 : 0;
    for (int k = 0; k < n_tools; k++)
        if (!(tt.tools[k] = tojson(tools[k], indent, false))) {
            tool_text_free(&tt, n_args);
            return tdm_err_set(TDM_EINVAL, "chat: tool %d is not JSON", k);
        }
    for (size_t i = 0, a = 0; i < n; i++)
        for (int k = 0; k < msgs[i].n_calls; k++, a++)
            if (!(tt.args[a] = tojson(msgs[i].calls[k].arguments, 0, true))) {
                tool_text_free(&tt, n_args);
                return tdm_err_set(TDM_ENOMEM, "chat: out of memory");
            }
    struct out_buf o = {0};
    render(t, msgs, n, &tt, add_generation_prompt, &o); /* sizing pass */
    o.p = malloc(o.n + 1);
    if (!o.p) {
        tool_text_free(&tt, n_args);
        return tdm_err_set(TDM_ENOMEM, "chat: out of memory for %zu bytes", o.n);
    }
    o.n = 0;
    render(t, msgs, n, &tt, add_generation_prompt, &o);
    o.p[o.n] = 0;
    tool_text_free(&tt, n_args);
    *out = o.p;
    return TDM_OK;
}

tdm_status tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                           size_t n, bool add_generation_prompt, char **out)
{
    return tdm_chat_render_tools(t, msgs, n, NULL, 0, add_generation_prompt, out);
}
