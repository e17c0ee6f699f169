/*
 * /metrics: the Prometheus text exposition format (version 0.0.4) of a scheduler snapshot.
 * Names follow Prometheus conventions: base units (seconds), _total for counters, histograms
 * with cumulative _bucket{le=...}, _sum and _count.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_int.h"

struct sbuf {
    char *s;
    size_t len, cap;
    bool oom;
};

static void put(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct sbuf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = true;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n;
        char *s = realloc(b->s, cap);
        if (!s) {
            b->oom = true;
            return;
        }
        b->s = s;
        b->cap = cap;
    }
}

static void hist(struct sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                 const char *labels)
{
    put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        put(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, labels, h->bounds[i],
            (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    put(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, labels, (unsigned long long)cum);
    put(b, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, labels, h->sum, name, labels,
        (unsigned long long)h->n);
}

static void scalar(struct sbuf *b, const char *name, const char *type, const char *help,
                   const char *labels, double v)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %.17g\n", name, help, name, type, name, labels, v);
}

char *metrics_render(const struct tdm_sched_metrics_snapshot *m, const uint64_t *http_by_class,
                     const char *model_name)
{
    struct sbuf b = {.cap = 16384};
    if (!(b.s = malloc(b.cap))) return NULL;
    b.s[0] = '\0';
    char lab[300];
    /* the model name is ours (from the command line), but escape it anyway */
    size_t j = (size_t)snprintf(lab, sizeof lab, "model=\"");
    for (const char *p = model_name; *p && j + 4 < sizeof lab; p++) {
        if (*p == '"' || *p == '\\') lab[j++] = '\\';
        lab[j++] = *p == '\n' ? ' ' : *p;
    }
    lab[j++] = '"';
    lab[j] = '\0';

    hist(&b, "tandem_time_to_first_token_seconds", "Time from arrival to the first token.",
         &m->ttft_s, lab);
    hist(&b, "tandem_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
         &m->itl_s, lab);
    hist(&b, "tandem_e2e_request_latency_seconds", "Time from arrival to the last token.",
         &m->e2e_s, lab);
    hist(&b, "tandem_batch_tokens", "Tokens per forward step (prefill and decode).",
         &m->batch_tokens, lab);
    hist(&b, "tandem_batch_sequences", "Sequences per forward step.", &m->batch_seqs, lab);
    scalar(&b, "tandem_requests_running", "gauge", "Requests in the running batch.", lab,
           m->running);
    scalar(&b, "tandem_requests_waiting", "gauge", "Requests waiting for admission.", lab,
           m->waiting);
    scalar(&b, "tandem_kv_pages_total", "gauge", "KV cache pages in the pool.", lab,
           (double)m->kv.total);
    scalar(&b, "tandem_kv_pages_used", "gauge", "KV cache pages owned by requests.", lab,
           (double)m->kv.used);
    scalar(&b, "tandem_kv_pages_in_flight", "gauge", "KV cache pages held by transfers.", lab,
           (double)m->kv.in_flight);
    scalar(&b, "tandem_kv_pages_free", "gauge", "KV cache pages free.", lab, (double)m->kv.free);
    scalar(&b, "tandem_prompt_tokens_total", "counter", "Prompt tokens admitted.", lab,
           (double)m->prompt_tokens);
    scalar(&b, "tandem_generation_tokens_total", "counter", "Tokens generated.", lab,
           (double)m->generated_tokens);
    scalar(&b, "tandem_preemptions_total", "counter", "Requests preempted (recomputed later).", lab,
           (double)m->preemptions);
    scalar(&b, "tandem_steps_total", "counter", "Forward steps run.", lab, (double)m->steps);
    scalar(&b, "tandem_requests_rejected_total", "counter",
           "Requests refused at submission (queue full or draining).", lab, (double)m->rejected);
    put(&b, "# HELP tandem_requests_finished_total Requests finished, by reason.\n"
            "# TYPE tandem_requests_finished_total counter\n");
    static const char *const reasons[] = {"none", "stop", "length", "cancelled", "error"};
    for (int i = 1; i < 5; i++)
        put(&b, "tandem_requests_finished_total{%s,reason=\"%s\"} %llu\n", lab, reasons[i],
            (unsigned long long)m->finished[i]);
    put(&b, "# HELP tandem_http_responses_total HTTP responses, by status class.\n"
            "# TYPE tandem_http_responses_total counter\n");
    for (int i = 1; i <= 5; i++)
        put(&b, "tandem_http_responses_total{%s,code=\"%dxx\"} %llu\n", lab, i,
            (unsigned long long)http_by_class[i]);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
