/*
 * tok_tool: test helper that drives tandem's tokenizer and chat templates in batch, one JSON
 * document per line, so one process handles thousands of strings.
 *
 *   tok_tool encode SRC [--special] [--bos]   in:  "text"  or  {"b64": "..."} (raw bytes)
 *                                             out: {"ids": [...], "dec": B64, "dec_skip": B64}
 *                                                  dec/dec_skip: decode(ids) with special
 *                                                  tokens kept / skipped, base64
 *   tok_tool decode SRC [--skip-special]      in:  [id, ...]       out: {"b64": B64}
 *   tok_tool pieces SRC                       out: one line per id: {"b64": piece, "special": b}
 *   tok_tool info SRC                         out: {"kind", "vocab_size", "bos", "eos",
 *                                                   "adds_bos"}
 *   tok_tool chat TEMPLATE                    in:  {"messages": [{"role", "content"}...],
 *                                                   "add_generation_prompt": bool}
 *                                             out: {"text": ...}
 *
 * SRC is a .gguf file (tokenizer from its metadata) or a tokenizer.json. TEMPLATE is a .gguf
 * (tokenizer.chat_template) or a file holding the Jinja text. A line that fails gives
 * {"error": message, "status": name} and the run continues.
 *
 * Exit status: 0 when every line succeeded, 2 when some lines failed, 1 on a fatal error
 * (bad arguments, unreadable model, malformed input line).
 */
#include "tandem/tok.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *b64_encode(const unsigned char *p, size_t n)
{
    char *out = malloc((n + 2) / 3 * 4 + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16;
        if (i + 1 < n) v |= (uint32_t)p[i + 1] << 8;
        if (i + 2 < n) v |= p[i + 2];
        out[o++] = B64[v >> 18 & 63];
        out[o++] = B64[v >> 12 & 63];
        out[o++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        out[o++] = i + 2 < n ? B64[v & 63] : '=';
    }
    out[o] = 0;
    return out;
}

static int b64_val(char c)
{
    const char *p = c ? strchr(B64, c) : NULL;
    return p ? (int)(p - B64) : -1;
}

static unsigned char *b64_decode(const char *s, size_t *n_out)
{
    size_t len = strlen(s);
    if (len % 4) return NULL;
    unsigned char *out = malloc(len / 4 * 3 + 1);
    if (!out) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4];
        for (int k = 0; k < 4; k++)
            v[k] = s[i + k] == '=' ? 0 : b64_val(s[i + k]);
        if (v[0] < 0 || v[1] < 0 || v[2] < 0 || v[3] < 0) {
            free(out);
            return NULL;
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (s[i + 2] != '=') out[o++] = (unsigned char)(w >> 8);
        if (s[i + 3] != '=') out[o++] = (unsigned char)w;
    }
    *n_out = o;
    return out;
}

static bool ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

static int load_tok(const char *src, tdm_tok_t **tok)
{
    tdm_status st;
    if (ends_with(src, ".gguf")) {
        tdm_gguf_t *g;
        st = tdm_gguf_open(src, &g);
        if (!st) {
            st = tdm_tok_from_gguf(g, tok);
            tdm_gguf_close(g);
        }
    } else {
        st = tdm_tok_from_hf(src, tok);
    }
    if (st) {
        fprintf(stderr, "tok_tool: %s: %s (%s)\n", src, tdm_err_msg(), tdm_status_str(st));
        return 1;
    }
    return 0;
}

static void print_json(json_t *j)
{
    char *s = json_dumps(j, JSON_COMPACT);
    if (s) {
        fputs(s, stdout);
        fputc('\n', stdout);
        free(s);
    }
    json_decref(j);
}

static void print_error(tdm_status st)
{
    print_json(json_pack("{s:s, s:s}", "error", tdm_err_msg(), "status", tdm_status_str(st)));
}

static json_t *b64_json(const char *p, size_t n)
{
    char *b = b64_encode((const unsigned char *)p, n);
    json_t *j = json_string(b ? b : "");
    free(b);
    return j;
}

/* Decodes ids into a JSON base64 string, or NULL (error printed by the caller). */
static json_t *decode_json(const tdm_tok_t *tok, const int32_t *ids, size_t n, bool skip,
                           tdm_status *st)
{
    size_t cap = 256, len;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            *st = TDM_ENOMEM;
            return NULL;
        }
        *st = tdm_tok_decode(tok, ids, n, skip, buf, cap, &len);
        if (*st != TDM_ERANGE) break;
        cap = len + 1;
        free(buf);
        buf = malloc(cap);
    }
    json_t *j = *st ? NULL : b64_json(buf, len);
    free(buf);
    return j;
}

static int cmd_encode(const tdm_tok_t *tok, int flags)
{
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    int rc = 0;
    size_t ids_cap = 1024;
    int32_t *ids = malloc(ids_cap * sizeof *ids);
    while ((got = getline(&line, &line_cap, stdin)) > 0) {
        json_error_t err;
        json_t *in = json_loadb(line, (size_t)got, JSON_DECODE_ANY | JSON_ALLOW_NUL, &err);
        char *text = NULL;
        size_t len = 0;
        bool owned = false;
        if (json_is_string(in)) {
            text = (char *)json_string_value(in);
            len = json_string_length(in);
        } else if (json_is_object(in) && json_is_string(json_object_get(in, "b64"))) {
            text = (char *)b64_decode(json_string_value(json_object_get(in, "b64")), &len);
            owned = true;
        }
        if (!text) {
            fprintf(stderr, "tok_tool: bad input line: %.80s\n", line);
            json_decref(in);
            rc = 1;
            break;
        }
        size_t n;
        tdm_status st;
        for (;;) {
            st = tdm_tok_encode(tok, text, len, flags, ids, ids_cap, &n);
            if (st != TDM_ERANGE || n <= ids_cap) break;
            ids_cap = n;
            ids = realloc(ids, ids_cap * sizeof *ids);
        }
        if (st) {
            print_error(st);
            rc = 2;
        } else {
            json_t *arr = json_array();
            for (size_t i = 0; i < n; i++)
                json_array_append_new(arr, json_integer(ids[i]));
            json_t *dec = decode_json(tok, ids, n, false, &st);
            json_t *dec_skip = st ? NULL : decode_json(tok, ids, n, true, &st);
            if (st) {
                json_decref(arr);
                json_decref(dec);
                print_error(st);
                rc = 2;
            } else {
                print_json(
                    json_pack("{s:o, s:o, s:o}", "ids", arr, "dec", dec, "dec_skip", dec_skip));
            }
        }
        if (owned) free(text);
        json_decref(in);
    }
    free(ids);
    free(line);
    return rc;
}

static int cmd_decode(const tdm_tok_t *tok, bool skip)
{
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    int rc = 0;
    while ((got = getline(&line, &line_cap, stdin)) > 0) {
        json_error_t err;
        json_t *in = json_loadb(line, (size_t)got, JSON_DECODE_ANY, &err);
        if (!json_is_array(in)) {
            fprintf(stderr, "tok_tool: bad input line: %.80s\n", line);
            json_decref(in);
            rc = 1;
            break;
        }
        size_t n = json_array_size(in);
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        for (size_t i = 0; i < n; i++)
            ids[i] = (int32_t)json_integer_value(json_array_get(in, i));
        tdm_status st;
        json_t *dec = decode_json(tok, ids, n, skip, &st);
        if (st) {
            print_error(st);
            rc = 2;
        } else {
            print_json(json_pack("{s:o}", "b64", dec));
        }
        free(ids);
        json_decref(in);
    }
    free(line);
    return rc;
}

static int cmd_pieces(const tdm_tok_t *tok)
{
    for (int id = 0; id < tdm_tok_vocab_size(tok); id++) {
        size_t len;
        const char *p = tdm_tok_piece(tok, id, &len);
        print_json(json_pack("{s:o, s:b}", "b64", b64_json(p, len), "special",
                             tdm_tok_is_special(tok, id)));
    }
    return 0;
}

static int cmd_info(const tdm_tok_t *tok)
{
    print_json(json_pack("{s:s, s:i, s:i, s:i, s:b}", "kind",
                         tdm_tok_kind(tok) == TDM_TOK_SPM ? "spm" : "bpe_bytes", "vocab_size",
                         tdm_tok_vocab_size(tok), "bos", tdm_tok_bos(tok), "eos", tdm_tok_eos(tok),
                         "adds_bos", tdm_tok_adds_bos(tok)));
    return 0;
}

static char *read_template(const char *src)
{
    if (ends_with(src, ".gguf")) {
        tdm_gguf_t *g;
        if (tdm_gguf_open(src, &g)) return NULL;
        struct tdm_str s;
        char *out = NULL;
        if (!tdm_gguf_get_str(g, "tokenizer.chat_template", &s)) {
            out = malloc(s.len + 1);
            if (out) {
                memcpy(out, s.ptr, s.len);
                out[s.len] = 0;
            }
        }
        tdm_gguf_close(g);
        return out;
    }
    char *data;
    size_t len;
    if (tdm_file_read(src, 16u << 20, &data, &len)) return NULL;
    return data;
}

static int cmd_chat(const char *src)
{
    char *jinja = read_template(src);
    if (!jinja) {
        fprintf(stderr, "tok_tool: %s: no chat template (%s)\n", src, tdm_err_msg());
        return 1;
    }
    struct tdm_chat_template t;
    tdm_status st = tdm_chat_template_detect(jinja, &t);
    free(jinja);
    if (st) {
        fprintf(stderr, "tok_tool: %s: %s\n", src, tdm_err_msg());
        return 1;
    }
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    int rc = 0;
    while ((got = getline(&line, &line_cap, stdin)) > 0) {
        json_error_t err;
        json_t *in = json_loadb(line, (size_t)got, 0, &err);
        json_t *msgs = json_object_get(in, "messages");
        if (!json_is_array(msgs)) {
            fprintf(stderr, "tok_tool: bad input line: %.80s\n", line);
            json_decref(in);
            rc = 1;
            break;
        }
        size_t n = json_array_size(msgs);
        struct tdm_chat_msg *m = calloc(n ? n : 1, sizeof *m);
        for (size_t i = 0; i < n; i++) {
            m[i].role = json_string_value(json_object_get(json_array_get(msgs, i), "role"));
            m[i].content = json_string_value(json_object_get(json_array_get(msgs, i), "content"));
        }
        bool gen = json_is_true(json_object_get(in, "add_generation_prompt"));
        char *text;
        st = tdm_chat_render(&t, m, n, gen, &text);
        if (st) {
            print_error(st);
            rc = 2;
        } else {
            print_json(json_pack("{s:s, s:s?}", "text", text, "default_system", t.default_system));
            free(text);
        }
        free(m);
        json_decref(in);
    }
    free(line);
    tdm_chat_template_clear(&t);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: tok_tool encode|decode|pieces|info|chat SRC [options]\n");
        return 1;
    }
    const char *cmd = argv[1], *src = argv[2];
    int flags = 0;
    bool skip = false;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--special"))
            flags |= TDM_TOK_PARSE_SPECIAL;
        else if (!strcmp(argv[i], "--bos"))
            flags |= TDM_TOK_ADD_BOS;
        else if (!strcmp(argv[i], "--skip-special"))
            skip = true;
        else {
            fprintf(stderr, "tok_tool: unknown option %s\n", argv[i]);
            return 1;
        }
    }
    if (!strcmp(cmd, "chat")) return cmd_chat(src);
    tdm_tok_t *tok;
    if (load_tok(src, &tok)) return 1;
    int rc;
    if (!strcmp(cmd, "encode"))
        rc = cmd_encode(tok, flags);
    else if (!strcmp(cmd, "decode"))
        rc = cmd_decode(tok, skip);
    else if (!strcmp(cmd, "pieces"))
        rc = cmd_pieces(tok);
    else if (!strcmp(cmd, "info"))
        rc = cmd_info(tok);
    else {
        fprintf(stderr, "tok_tool: unknown command %s\n", cmd);
        rc = 1;
    }
    tdm_tok_free(tok);
    fflush(stdout);
    return rc;
}
