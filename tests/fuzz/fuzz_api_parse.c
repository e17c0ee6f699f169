/*
 * libFuzzer target for the HTTP request parser (tdm_api_parse, src/server/openai.c): arbitrary
 * bodies for /v1/completions and /v1/chat/completions (a ChatML template), with a byte-level
 * tokenizer and a small context, so that long prompts hit the context checks. An accepted
 * request must be one the scheduler can take: a prompt of 1 to max_ctx - 1 tokens inside the
 * vocabulary, max_tokens that fit the rest of the context, sampling parameters that validate,
 * at most the documented number of stop strings and top log-probabilities. A refused one must
 * carry a 4xx status and a message. Never a crash, a leak or a hang. Bit 1 of the first byte
 * sends the body to vLLM's /tokenize (bit 0 set) or /detokenize instead: an answer must be
 * JSON, a refusal a 4xx with a message. An accepted echo has its text, and max_tokens 0 only
 * with the prompt scored; a list of prompts and n / best_of stay within their caps.
 *
 * Layout: u8 (bit 0: chat or tokenize; bit 1: the tokenizer routes; bit 2: the model has
 * fill-in-the-middle tokens, so 'suffix' is taken), then the body.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_lib.h"
#include "server/server_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    static struct tdm_chat_template chat = {.format = TDM_CHAT_CHATML};
    tdm_tok_t *tok = fuzz_tokenizer();
    struct api_ctx c = {.tok = tok,
                        .chat = &chat,
                        .add_bos = false,
                        .model_name = "fuzz",
                        .max_ctx = 256,
                        .vocab = tdm_tok_vocab_size(tok),
                        .max_piece = 16};
    tdm_api_find_fim(&c); /* the byte-level tokenizer has none: suffix is refused... */
    if (data[0] & 4) {    /* ...unless bit 2 names three of its tokens as the FIM set */
        c.fim[0] = 1, c.fim[1] = 2, c.fim[2] = 3;
    }
    struct api_req r;
    struct api_err e;
    if (data[0] & 2) { /* vLLM's /tokenize or /detokenize */
        char *out = data[0] & 1 ? tdm_api_tokenize(&c, (const char *)data + 1, size - 1, &e)
                                : tdm_api_detokenize(&c, (const char *)data + 1, size - 1, &e);
        if (!out && (e.status < 400 || e.status > 499 || !e.message[0])) abort();
        if (out) {
            json_t *root = json_loads(out, JSON_ALLOW_NUL, NULL); /* text may hold U+0000 */
            if (!root) abort();                                   /* the answer must be JSON */
            json_decref(root);
            free(out);
        }
        return 0;
    }
    bool is_chat = data[0] & 1;
    if (!tdm_api_parse(&c, is_chat, (const char *)data + 1, size - 1, &r, &e)) {
        if (e.status < 400 || e.status > 499 || !e.message[0]) abort();
        return 0;
    }
    /* every prompt of a list, each candidate's parameters; max_tokens 0 only for a request
     * that scores its prompt (echo), which the scheduler takes; echo's text is there and
     * NUL-terminated */
    if (r.n_prompts < 1 || r.n_prompts > TDM_API_MAX_PROMPTS || r.n < 1 || r.best_of < r.n ||
        r.best_of > TDM_SCHED_MAX_GROUP || r.n_prompts * r.best_of > TDM_API_MAX_CANDIDATES ||
        (r.best_of > r.n && (r.stream || r.p.top_logprobs < 0)))
        abort();
    for (int k = 0; k < r.n_prompts; k++) {
        const struct api_prompt ap = tdm_api_prompt(&r, k);
        if (ap.n < 1 || ap.n >= c.max_ctx || !ap.ids) abort();
        for (int i = 0; i < ap.n; i++)
            if (ap.ids[i] < 0 || ap.ids[i] >= c.vocab) abort();
        if (r.p.max_tokens < (r.p.prompt_logprobs ? 0 : 1) || ap.n + r.p.max_tokens > c.max_ctx)
            abort();
        if (r.echo && (!ap.echo_text || ap.echo_text[ap.echo_len] || ap.echo_skip > ap.n)) abort();
        struct tdm_req_params cp;
        tdm_api_candidate(&r, k, r.best_of - 1, &cp);
        if (cp.prompt != ap.ids || cp.n_prompt != ap.n) abort();
    }
    if (r.p.prompt_logprobs && !r.echo) abort();
    if (tdm_sampling_validate(&r.p.sampling) != TDM_OK) abort();
    if (r.p.top_logprobs > TDM_MAX_TOP_LOGPROBS) abort();
    char *j = tdm_api_error_json(&(struct api_err){.status = 400, .message = "x"});
    free(j);
    tdm_api_req_free(&r);
    return 0;
}
