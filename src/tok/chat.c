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
 * The ChatML default system prompt is read from the template itself: a string literal that
 * continues "<|im_start|>system" + newline with literal text up to "<|im_end|>" (Jinja string
 * escapes undone). `trim` strips what Python's str.strip() strips.
 *
 * Threading: pure functions; a template struct is read-only while rendering.
 */
#include "tok/tok_int.h"

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

static void render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs, size_t n,
                   bool gen, struct out_buf *o)
{
    switch (t->format) {
    case TDM_CHAT_CHATML:
        if (n && t->default_system && strcmp(msgs[0].role, "system")) {
            puts_(o, "<|im_start|>system\n");
            puts_(o, t->default_system);
            puts_(o, "<|im_end|>\n");
        }
        for (size_t i = 0; i < n; i++) {
            puts_(o, "<|im_start|>");
            puts_(o, msgs[i].role);
            puts_(o, "\n");
            puts_(o, msgs[i].content);
            puts_(o, "<|im_end|>\n");
        }
        if (gen) puts_(o, "<|im_start|>assistant\n");
        break;
    case TDM_CHAT_LLAMA3:
        for (size_t i = 0; i < n; i++) {
            if (i == 0 && t->add_bos_text) puts_(o, "<|begin_of_text|>");
            puts_(o, "<|start_header_id|>");
            puts_(o, msgs[i].role);
            puts_(o, "<|end_header_id|>\n\n");
            size_t b, e, len = strlen(msgs[i].content);
            py_trim(msgs[i].content, len, &b, &e);
            put(o, msgs[i].content + b, e - b);
            puts_(o, "<|eot_id|>");
        }
        if (gen) puts_(o, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case TDM_CHAT_RAW:
        for (size_t i = 0; i < n; i++)
            puts_(o, msgs[i].content);
        break;
    }
}

tdm_status tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                           size_t n, bool add_generation_prompt, char **out)
{
    if (!t || (!msgs && n) || !out) return tdm_err_set(TDM_EINVAL, "tdm_chat_render: NULL");
    if (t->format != TDM_CHAT_CHATML && t->format != TDM_CHAT_LLAMA3 && t->format != TDM_CHAT_RAW)
        return tdm_err_set(TDM_EINVAL, "chat template: unknown format %d", (int)t->format);
    size_t total = 0;
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
        total += rl + cl;
        if (total > CHAT_MAX_BYTES)
            return tdm_err_set(TDM_ERANGE, "chat: conversation over %zu bytes", CHAT_MAX_BYTES);
    }
    struct out_buf o = {0};
    render(t, msgs, n, add_generation_prompt, &o); /* sizing pass */
    o.p = malloc(o.n + 1);
    if (!o.p) return tdm_err_set(TDM_ENOMEM, "chat: out of memory for %zu bytes", o.n);
    o.n = 0;
    render(t, msgs, n, add_generation_prompt, &o);
    o.p[o.n] = 0;
    *out = o.p;
    return TDM_OK;
}
