/*
 * Text streaming with stop strings. Generated tokens arrive as byte pieces; the client may only
 * see bytes that can no longer turn out to be the start of a stop string, and (for a readable
 * stream) only whole UTF-8 sequences. The held tail is therefore at most the longest stop
 * string minus one, plus three bytes of an unfinished UTF-8 sequence.
 *
 * Threading: a stream belongs to one request.
 */
#include "tandem/sample.h"

#include <string.h>

tdm_status tdm_text_stream_init(struct tdm_text_stream *ts, const char *const *stops, int n)
{
    memset(ts, 0, sizeof *ts);
    if (n < 0 || n > TDM_MAX_STOP_STRINGS)
        return tdm_err_set(TDM_ERANGE, "at most %d stop strings", TDM_MAX_STOP_STRINGS);
    for (int i = 0; i < n; i++) {
        size_t len = strlen(stops[i]);
        if (len == 0) return tdm_err_set(TDM_EINVAL, "stop strings must not be empty");
        if (len > TDM_MAX_STOP_BYTES)
            return tdm_err_set(TDM_ERANGE, "stop string longer than %d bytes", TDM_MAX_STOP_BYTES);
        memcpy(ts->stops[i], stops[i], len + 1);
        ts->stop_len[i] = len;
    }
    ts->n_stops = n;
    return TDM_OK;
}

/* Length of the UTF-8 sequence a lead byte announces; 0 for a continuation or invalid byte. */
static int utf8_len(unsigned char c)
{
    if (c < 0x80) return 1;
    if ((c & 0xe0) == 0xc0) return 2;
    if ((c & 0xf0) == 0xe0) return 3;
    if ((c & 0xf8) == 0xf0) return 4;
    return 0;
}

/* Where an unfinished UTF-8 sequence at the end of buf[0..n) starts, or n if there is none. */
static size_t utf8_cut(const char *buf, size_t n)
{
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = (unsigned char)buf[n - back];
        if ((c & 0xc0) == 0x80) continue; /* continuation: keep looking for the lead */
        int want = utf8_len(c);
        return (want > (int)back) ? n - back : n;
    }
    return n;
}

/* Longest suffix of buf[0..n) that is a proper prefix of some stop string. */
static size_t stop_prefix_tail(const struct tdm_text_stream *ts, const char *buf, size_t n)
{
    size_t best = 0;
    for (int i = 0; i < ts->n_stops; i++) {
        size_t max = TDM_MIN(ts->stop_len[i] - 1, n);
        for (size_t k = max; k > best; k--)
            if (memcmp(buf + n - k, ts->stops[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

bool tdm_text_stream_push(struct tdm_text_stream *ts, const char *bytes, size_t len, char *out,
                          size_t *n_out)
{
    *n_out = 0;
    if (ts->stopped) return true;
    while (len > 0) {
        size_t take = TDM_MIN(len, sizeof ts->held - ts->n_held);
        memcpy(ts->held + ts->n_held, bytes, take);
        ts->n_held += take;
        bytes += take;
        len -= take;

        size_t match = ts->n_held;
        for (int i = 0; i < ts->n_stops; i++) {
            const char *m = memmem(ts->held, ts->n_held, ts->stops[i], ts->stop_len[i]);
            if (m && (size_t)(m - ts->held) < match) match = (size_t)(m - ts->held);
        }
        if (match < ts->n_held) {
            memcpy(out + *n_out, ts->held, match);
            *n_out += match;
            ts->n_held = 0;
            ts->stopped = true;
            return true;
        }
        size_t emit = ts->n_held - stop_prefix_tail(ts, ts->held, ts->n_held);
        emit = utf8_cut(ts->held, emit);
        memcpy(out + *n_out, ts->held, emit);
        *n_out += emit;
        memmove(ts->held, ts->held + emit, ts->n_held - emit);
        ts->n_held -= emit;
    }
    return false;
}

void tdm_text_stream_flush(struct tdm_text_stream *ts, char *out, size_t *n_out)
{
    size_t whole = utf8_cut(ts->held, ts->n_held);
    memcpy(out, ts->held, whole);
    *n_out = whole;
    if (whole < ts->n_held) {
        memcpy(out + whole, "\xef\xbf\xbd", 3); /* U+FFFD for the unfinished sequence */
        *n_out += 3;
    }
    ts->n_held = 0;
}
