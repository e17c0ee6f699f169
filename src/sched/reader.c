/*
 * The reader side of a request's output (include/tandem/sched.h): detokenisation and stop
 * strings, on the reader's thread.
 *
 * The scheduler publishes tokens and log-probabilities only. A reader takes the new ones out
 * under the request's lock (a copy of a few numbers a token), lets go, and then renders their
 * text: each token's piece goes through the stop-string stream, which holds back bytes that
 * could still become a stop string or that end inside a UTF-8 sequence. So the scheduler never
 * waits on text, and no lock is held while text or JSON is made.
 *
 * A stop-string match ends the reader's output at the token that completed it. The reader then
 * stops the request (tdm_req_stop: a cancel that finishes as TDM_FINISH_STOP) and reports the
 * end only once the scheduler has finished the request, so a client that has its response
 * finds the request's pages back in the pool, as for every other end.
 *
 * Ownership: the reader owns copies of everything it reports; a view it fills stays valid until
 * the next update. One thread uses a reader.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched_int.h"

struct tdm_req_reader {
    const tdm_tok_t *tok;
    struct tdm_text_stream ts;
    int max_tokens, k; /* k: top log-probabilities per output; -1: no log-probabilities */
    int n_in;          /* scheduler outputs taken in */
    int n_out;         /* outputs the reader reports (up to a stop string's match) */
    bool matched;      /* a stop string matched; the request was told to stop */
    bool oom;          /* the text could not grow; the request was cancelled */
    enum tdm_finish reported;
    int32_t *tokens;  /* [max_tokens] */
    float *logprobs;  /* [max_tokens] when k >= 0 */
    int32_t *top_ids; /* [max_tokens][k] when k > 0 */
    float *top_lps;
    size_t *text_end; /* [max_tokens] */
    char *text;
    size_t text_len, text_cap;
    int stop_at; /* the scheduler's EOS / stop-id output, as the last lock saw it */
    char error_msg[256];
    /* the prompt's log-probabilities (prompt_logprobs), copied once final */
    float *p_lps;
    int32_t *p_top_ids;
    float *p_top_lps;
    int p_top;
};

tdm_status tdm_req_reader_create(const tdm_tok_t *tok, const char *const *stops, int n_stops,
                                 int max_tokens, int top_logprobs, tdm_req_reader_t **out)
{
    if (max_tokens < 0 || top_logprobs < -1 || top_logprobs > TDM_MAX_TOP_LOGPROBS)
        return tdm_err_set(TDM_EINVAL, "reader: max_tokens or top_logprobs out of range");
    struct tdm_req_reader *rd = calloc(1, sizeof *rd);
    if (!rd) return tdm_err_set(TDM_ENOMEM, "out of memory");
    tdm_status st = tdm_text_stream_init(&rd->ts, stops, n_stops);
    if (st != TDM_OK) {
        free(rd);
        return st;
    }
    size_t n = (size_t)TDM_MAX(max_tokens, 1); /* 0: a request that only scores its prompt */
    rd->tok = tok;
    rd->max_tokens = max_tokens;
    rd->k = top_logprobs;
    rd->tokens = malloc(n * sizeof *rd->tokens);
    rd->text_end = malloc(n * sizeof *rd->text_end);
    rd->text_cap = 256;
    rd->text = malloc(rd->text_cap);
    if (rd->k >= 0) rd->logprobs = malloc(n * sizeof *rd->logprobs);
    if (rd->k > 0) {
        rd->top_ids = malloc(n * (size_t)rd->k * sizeof *rd->top_ids);
        rd->top_lps = malloc(n * (size_t)rd->k * sizeof *rd->top_lps);
    }
    if (!rd->tokens || !rd->text_end || !rd->text || (rd->k >= 0 && !rd->logprobs) ||
        (rd->k > 0 && (!rd->top_ids || !rd->top_lps))) {
        tdm_req_reader_destroy(rd);
        return tdm_err_set(TDM_ENOMEM, "out of memory");
    }
    rd->text[0] = '\0';
    *out = rd;
    return TDM_OK;
}

void tdm_req_reader_destroy(tdm_req_reader_t *rd)
{
    if (!rd) return;
    free(rd->tokens);
    free(rd->logprobs);
    free(rd->top_ids);
    free(rd->top_lps);
    free(rd->text_end);
    free(rd->text);
    free(rd->p_lps);
    free(rd->p_top_ids);
    free(rd->p_top_lps);
    free(rd);
}

/* Copies r's prompt log-probabilities once the scheduler has scored the whole prompt (raw: its
 * view under the lock that saw so). They never change after that, and r outlives the reader's
 * reference, so they are read here with no lock held. False when out of memory. */
static bool take_prompt_scores(struct tdm_req_reader *rd, const struct tdm_req_view *raw)
{
    if (rd->p_lps || !raw->prompt_lps || raw->n_scored < raw->n_prompt - 1) return true;
    const size_t n = (size_t)raw->n_prompt, k = (size_t)raw->prompt_top;
    float *lps = malloc(n * sizeof *lps);
    int32_t *ids = k ? malloc(n * k * sizeof *ids) : NULL;
    float *tops = k ? malloc(n * k * sizeof *tops) : NULL;
    if (!lps || (k && (!ids || !tops))) {
        free(lps);
        free(ids);
        free(tops);
        return false;
    }
    memcpy(lps, raw->prompt_lps, n * sizeof *lps);
    if (k) {
        memcpy(ids, raw->prompt_top_ids, n * k * sizeof *ids);
        memcpy(tops, raw->prompt_top_lps, n * k * sizeof *tops);
    }
    rd->p_lps = lps;
    rd->p_top_ids = ids;
    rd->p_top_lps = tops;
    rd->p_top = (int)k;
    return true;
}

static bool text_append(struct tdm_req_reader *rd, const char *b, size_t n)
{
    if (!n) return true;
    if (rd->text_len + n + 1 > rd->text_cap) {
        size_t cap = rd->text_cap;
        while (rd->text_len + n + 1 > cap)
            cap *= 2;
        char *t = realloc(rd->text, cap);
        if (!t) return false;
        rd->text = t;
        rd->text_cap = cap;
    }
    memcpy(rd->text + rd->text_len, b, n);
    rd->text_len += n;
    rd->text[rd->text_len] = '\0';
    return true;
}

/* Renders output i's text; false when out of memory. */
static bool render(struct tdm_req_reader *rd, int i)
{
    int32_t t = rd->tokens[i];
    bool ok = true;
    if (i != rd->stop_at && rd->tok && !tdm_tok_is_special(rd->tok, t)) {
        size_t len = 0;
        const char *piece = tdm_tok_piece(rd->tok, t, &len);
        char out[TDM_STREAM_CAP + 256 + 8];
        for (size_t off = 0; piece && off < len && !rd->matched; off += 256) {
            size_t n_out = 0;
            rd->matched =
                tdm_text_stream_push(&rd->ts, piece + off, TDM_MIN(len - off, 256), out, &n_out);
            ok &= text_append(rd, out, n_out);
        }
    }
    rd->text_end[i] = rd->text_len;
    rd->n_out = i + 1;
    return ok;
}

bool tdm_req_reader_update(tdm_req_reader_t *rd, tdm_req_t *r, struct tdm_req_view *v)
{
    int before_out = rd->n_out;
    size_t before_text = rd->text_len;
    /* take in the new outputs: numbers only, under the lock */
    struct tdm_req_view raw;
    tdm_req_lock(r, &raw);
    int from = rd->n_in, to = TDM_MIN(raw.n_out, rd->max_tokens);
    for (int i = from; i < to && !rd->matched; i++) {
        rd->tokens[i] = raw.tokens[i];
        if (rd->logprobs) rd->logprobs[i] = raw.logprobs[i];
        if (rd->k > 0) {
            memcpy(rd->top_ids + (size_t)i * rd->k, raw.top_ids + (size_t)i * rd->k,
                   (size_t)rd->k * sizeof *rd->top_ids);
            memcpy(rd->top_lps + (size_t)i * rd->k, raw.top_lps + (size_t)i * rd->k,
                   (size_t)rd->k * sizeof *rd->top_lps);
        }
    }
    memcpy(rd->error_msg, raw.error_msg, sizeof rd->error_msg);
    tdm_req_unlock(r);
    rd->stop_at = raw.stop_at;
    rd->n_in = to;

    /* the prompt's scores and the text, with no lock held */
    rd->oom |= !take_prompt_scores(rd, &raw);
    for (int i = from; i < to && !rd->matched && !rd->oom; i++)
        rd->oom |= !render(rd, i);
    if ((rd->matched || rd->oom) && raw.finish == TDM_FINISH_NONE) {
        if (rd->matched)
            tdm_req_stop(r); /* idempotent */
        else
            tdm_req_cancel(r);
    }
    /* the end is reported once the scheduler is done (the request's pages are back) and every
     * output is in */
    enum tdm_finish finish = TDM_FINISH_NONE;
    if (raw.finish != TDM_FINISH_NONE && rd->n_in == raw.n_out) {
        if (rd->oom) {
            finish = TDM_FINISH_ERROR;
            snprintf(rd->error_msg, sizeof rd->error_msg, "out of memory for the output text");
        } else if (rd->matched) {
            finish = TDM_FINISH_STOP;
        } else {
            char out[TDM_STREAM_CAP + 8];
            size_t n_out = 0;
            tdm_text_stream_flush(&rd->ts, out, &n_out);
            if (text_append(rd, out, n_out)) {
                finish = raw.finish;
            } else {
                finish = TDM_FINISH_ERROR;
                snprintf(rd->error_msg, sizeof rd->error_msg, "out of memory for the output text");
            }
            if (rd->n_out) rd->text_end[rd->n_out - 1] = rd->text_len;
        }
    }
    *v = (struct tdm_req_view){.n_out = rd->n_out,
                               .tokens = rd->tokens,
                               .logprobs = rd->logprobs,
                               .top_ids = rd->top_ids,
                               .top_lps = rd->top_lps,
                               .stop_at = raw.stop_at < rd->n_out ? raw.stop_at : -1,
                               .text_end = rd->text_end,
                               .text = rd->text,
                               .text_len = rd->text_len,
                               .finish = finish,
                               .error =
                                   finish == TDM_FINISH_ERROR && rd->oom ? TDM_ENOMEM : raw.error,
                               .n_prompt = raw.n_prompt,
                               .prompt_lps = rd->p_lps,
                               .prompt_top_ids = rd->p_top_ids,
                               .prompt_top_lps = rd->p_top_lps,
                               .prompt_top = rd->p_top,
                               .n_scored = rd->p_lps ? raw.n_prompt - 1 : 0,
                               .cached_tokens = raw.cached_tokens,
                               .t_submit_ns = raw.t_submit_ns,
                               .t_first_ns = raw.t_first_ns,
                               .t_end_ns = raw.t_end_ns,
                               .n_preempted = raw.n_preempted};
    memcpy(v->error_msg, rd->error_msg, sizeof v->error_msg);
    bool news = rd->n_out != before_out || rd->text_len != before_text || finish != rd->reported;
    rd->reported = finish;
    return news;
}

bool tdm_req_reader_wait(tdm_req_reader_t *rd, tdm_req_t *r, int timeout_ms)
{
    return tdm_req_wait(r, rd->n_in, timeout_ms);
}
