/*
 * tandem tok: tokenizers and chat templates.
 *
 * Two tokenizer models:
 *   - byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2/3). Text is pre-split with the model
 *     family's regex (PCRE2, UTF + UCP), each piece is mapped byte -> unicode char, then merged
 *     by BPE rank.
 *   - SentencePiece-style BPE (Llama 2, Mistral): spaces become U+2581, an optional leading
 *     space is added, pieces are merged by score (GGUF) or merge rank (tokenizer.json), and
 *     bytes without a token fall back to <0xXX> tokens.
 * Both load from GGUF metadata (tokenizer.ggml.*) or from a HF tokenizer.json.
 *
 * Special / added tokens: special ones (GGUF control/unknown tokens, tokenizer.json added
 * tokens with "special": true) are cut out of the input (leftmost, longest first) only when
 * TDM_TOK_PARSE_SPECIAL is given; otherwise their text is tokenized as ordinary text.
 * Non-special added tokens (GGUF user-defined, "special": false) are always cut out, as HF
 * tokenizers and llama.cpp do.
 *
 * Invalid UTF-8 input (overlong forms, surrogates, code points above U+10FFFF, truncated or
 * stray bytes): tdm_tok_encode returns TDM_EINVAL and the message (tdm_err_msg) reads
 * "tokenizer: invalid UTF-8 at byte offset N", N being the offset of the first bad byte.
 * Decoding: tdm_tok_decode produces the raw bytes of the tokens (which may end in the middle
 * of a UTF-8 sequence; streaming callers hold such tails back). Added/control tokens decode
 * to their text as written in the vocabulary.
 *
 * Normalisation: tokenizer.json NFC normalizers (Qwen2) are accepted but not applied; input
 * is assumed to be NFC already (true of nearly all text; llama.cpp does the same).
 *
 * Ownership and threading: a tdm_tok_t is immutable after creation and may be shared between
 * threads; encode/decode keep their scratch on the caller's stack or heap.
 */
#ifndef TANDEM_TOK_H
#define TANDEM_TOK_H

#include "tandem/core.h"
#include "tandem/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_tok tdm_tok_t;

enum tdm_tok_kind { TDM_TOK_BPE_BYTES = 0, TDM_TOK_SPM = 1 };

enum tdm_tok_flags {
    TDM_TOK_ADD_BOS = 1 << 0,       /* prepend BOS if the tokenizer has one */
    TDM_TOK_PARSE_SPECIAL = 1 << 1, /* recognise special/added tokens in the text */
    TDM_TOK_STOP_AT_CAP = 1 << 2,   /* stop once more than `cap` ids are out: TDM_ERANGE, and
                                     * *n_out is then only a lower bound (bounds the time an
                                     * oversized input costs) */
};

/* Reads tokenizer.ggml.* (model "gpt2" or "llama"). The tokenizer copies what it needs: `g`
 * may be closed afterwards. TDM_EUNSUPPORTED for other models or unknown
 * tokenizer.ggml.pre values. */
tdm_status tdm_tok_from_gguf(const tdm_gguf_t *g, tdm_tok_t **out);
/* `path` is a tokenizer.json file; a tokenizer_config.json in the same folder, if present,
 * supplies bos_token / eos_token / pad_token names and add_bos_token. Unsupported constructs
 * give TDM_EUNSUPPORTED naming them; malformed files TDM_EFORMAT. */
tdm_status tdm_tok_from_hf(const char *path, tdm_tok_t **out);
/* The same from the bytes of a tokenizer.json (no tokenizer_config.json); `data` is only read
 * during the call. */
tdm_status tdm_tok_from_hf_memory(const void *data, size_t len, tdm_tok_t **out);
void tdm_tok_free(tdm_tok_t *tok);

enum tdm_tok_kind tdm_tok_kind(const tdm_tok_t *tok);
int tdm_tok_vocab_size(const tdm_tok_t *tok);
int tdm_tok_bos(const tdm_tok_t *tok); /* -1 if none */
int tdm_tok_eos(const tdm_tok_t *tok); /* -1 if none */
/* Whether the model asks for BOS by default (tokenizer.ggml.add_bos_token / post-processor). */
bool tdm_tok_adds_bos(const tdm_tok_t *tok);
/* Id of a token given its exact text as the vocabulary spells it (e.g. "<|im_end|>", or
 * "Ġthe" in a byte-level vocabulary), or -1. */
int tdm_tok_find(const tdm_tok_t *tok, const char *text);
bool tdm_tok_is_special(const tdm_tok_t *tok, int id); /* control / added-special tokens */

/* Encodes `len` bytes of `text` (any bytes, NUL included; at most 64 MiB). Writes at most
 * `cap` ids; *n_out is the full count, and TDM_ERANGE is returned if it exceeds cap.
 * TDM_EINVAL on invalid UTF-8 (see above). Thread-safe; allocates scratch per call. */
tdm_status tdm_tok_encode(const tdm_tok_t *tok, const char *text, size_t len, int flags,
                          int32_t *ids, size_t cap, size_t *n_out);

/* The raw bytes that token `id` decodes to (after byte-level or SPM decoding; a leading U+2581
 * becomes a space). Pointer valid for the tokenizer's lifetime. NULL for an out-of-range id. */
const char *tdm_tok_piece(const tdm_tok_t *tok, int id, size_t *len);

/* Decodes ids into buf. *len_out is the full byte length; TDM_ERANGE if it exceeds cap (buf
 * then holds the first cap bytes). A NUL is written after the bytes when len < cap.
 * Special tokens are written as their text unless skip_special. For SPM tokenizers that add
 * a prefix space, one leading space of the output is removed, as HF does. TDM_EINVAL for an
 * id outside the vocabulary. No allocation. */
tdm_status tdm_tok_decode(const tdm_tok_t *tok, const int32_t *ids, size_t n, bool skip_special,
                          char *buf, size_t cap, size_t *len_out);

/* ---- UTF-8 and byte-level helpers (text.c) ---- */
/* True when s[0..len) is valid UTF-8 (RFC 3629: no overlongs, surrogates or > U+10FFFF);
 * otherwise false with the offset of the first bad byte in *bad_off (bad_off may be NULL). */
bool tdm_tok_utf8_valid(const char *s, size_t len, size_t *bad_off);

/* ---- chat templates ---- */
/* RAW: message contents concatenated, no markup (for models without a template). */
enum tdm_chat_format { TDM_CHAT_CHATML = 0, TDM_CHAT_LLAMA3, TDM_CHAT_RAW };

/* One call an assistant message made (OpenAI's tool_calls): the function's name and its
 * arguments as JSON text (an object; anything else is rendered as a JSON string). */
struct tdm_chat_call {
    const char *name;
    const char *arguments;
};

struct tdm_chat_msg {
    const char *role; /* "system", "user", "assistant", "tool" (a call's result) */
    const char *content;
    const struct tdm_chat_call *calls; /* an assistant's tool calls, or NULL */
    int n_calls;
};

struct tdm_chat_template {
    enum tdm_chat_format format;
    /* System prompt the template inserts when the first message is not a system message
     * (SmolLM2 and Qwen templates do); NULL if none. Owned by the template. */
    char *default_system;
    bool add_bos_text; /* Llama-3: the template writes <|begin_of_text|> */
};

/* Detects the format from a Jinja chat template string (GGUF tokenizer.chat_template or
 * tokenizer_config.json): ChatML by its <|im_start|>/<|im_end|> markers (the default system
 * prompt is read from the template's "<|im_start|>system\n...<|im_end|>" literal), Llama 3
 * by <|start_header_id|>/<|end_header_id|>/<|eot_id|>. Exact for SmolLM2, Qwen2/2.5 and
 * Llama 3 templates; for Llama 3.1+ templates the dated system header they add is not
 * reproduced, nor Qwen3's <think> handling of past assistant turns. NULL or unrecognised
 * templates give TDM_EUNSUPPORTED (out is then zeroed; clearing it is still safe). */
tdm_status tdm_chat_template_detect(const char *jinja, struct tdm_chat_template *out);
void tdm_chat_template_clear(struct tdm_chat_template *t);
/* Renders messages exactly as the model's Jinja template would, with the generation prompt
 * for the assistant appended when add_generation_prompt. Roles are written as given; Llama 3
 * trims content (Python str.strip), ChatML does not. TDM_EINVAL for a NULL role/content or
 * invalid UTF-8. *out is malloc'd; caller frees. */
tdm_status tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                           size_t n, bool add_generation_prompt, char **out);
/* The same, with tools the model may call: tools[0, n_tools) are each one OpenAI tool object
 * as JSON text ({"type": "function", "function": {...}}). ChatML renders them as Qwen2.5 and
 * Hermes templates do (a "# Tools" section with <tools></tools> in the system turn, calls as
 * <tool_call> blocks, results as <tool_response> blocks in a user turn); Llama 3 as Llama
 * 3.1's template does with custom tools (in the first user message, JSON calls with
 * "parameters", results in an ipython turn). TDM_EINVAL for a tool that is not JSON. */
tdm_status tdm_chat_render_tools(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs,
                                 size_t n, const char *const *tools, int n_tools,
                                 bool add_generation_prompt, char **out);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_TOK_H */
