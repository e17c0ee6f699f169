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
#include "tandem/server.h"

void tdm_prom_family(struct tdm_sbuf *b, const char *name, const char *type, const char *help)
{
    tdm_sbuf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void tdm_prom_sample(struct tdm_sbuf *b, const char *name, const char *labels, double value)
{
    if (labels && *labels)
        tdm_sbuf_printf(b, "%s{%s} %.17g\n", name, labels, value);
    else
        tdm_sbuf_printf(b, "%s %.17g\n", name, value);
}

void tdm_prom_scalar(struct tdm_sbuf *b, const char *name, const char *type, const char *help,
                     const char *labels, double value)
{
    tdm_prom_family(b, name, type, help);
    tdm_prom_sample(b, name, labels, value);
}

void tdm_hist_prom(struct tdm_sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                   const char *labels)
{
    const char *l = labels && *labels ? labels : "", *sep = *l ? "," : "";
    tdm_sbuf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        tdm_sbuf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, l, sep, h->bounds[i],
                        (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    tdm_sbuf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, l, sep, (unsigned long long)cum);
    if (*l)
        tdm_sbuf_printf(b, "%s_sum{%s} %.9g\n%s_count{%s} %llu\n", name, l, h->sum, name, l,
                        (unsigned long long)h->n);
    else
        tdm_sbuf_printf(b, "%s_sum %.9g\n%s_count %llu\n", name, h->sum, name,
                        (unsigned long long)h->n);
}

static void hist(struct tdm_sbuf *b, const char *name, const char *help, const struct tdm_hist *h,
                 const char *labels)
{
    tdm_hist_prom(b, name, help, h, labels);
}

static void scalar(struct tdm_sbuf *b, const char *name, const char *type, const char *help,
                   const char *labels, double v)
{
    tdm_prom_scalar(b, name, type, help, labels, v);
}

char *tdm_metrics_render(const struct tdm_sched_metrics_snapshot *m,
                         const struct api_grammar_metrics *gm, const uint64_t *http_by_class,
                         const char *model_name)
{
    struct tdm_sbuf b = {0};
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
    scalar(&b, "tandem_sched_overlapped_steps_total", "counter",
           "Steps planned and launched while the step before them still ran (--overlap).", lab,
           (double)m->overlapped_steps);
    scalar(&b, "tandem_requests_rejected_total", "counter",
           "Requests refused at submission (queue full or draining).", lab, (double)m->rejected);
    scalar(&b, "tandem_sched_stalls_total", "counter", "Steps that ran past the watchdog's limit.",
           lab, (double)m->stalls);
    scalar(&b, "tandem_sched_watchdog_failed_total", "counter",
           "Requests failed because the scheduler was stalled.", lab, (double)m->watchdog_failed);
    scalar(&b, "tandem_sched_stalled_seconds", "gauge",
           "How long the stalled step has run (0 when not stalled).", lab,
           (double)m->stalled_ms / 1000.0);
    /* the names the Gateway API Inference Extension's endpoint picker reads by default (its
     * model server protocol: queue depth and KV cache utilisation, vLLM's names), as aliases */
    scalar(&b, "vllm:num_requests_waiting", "gauge", "Alias of tandem_requests_waiting.", lab,
           m->waiting);
    scalar(&b, "vllm:num_requests_running", "gauge", "Alias of tandem_requests_running.", lab,
           m->running);
    const double kv_use =
        m->kv.total ? (double)(m->kv.used + m->kv.in_flight - m->kv.evictable) / (double)m->kv.total
                    : 0.0;
    scalar(&b, "vllm:kv_cache_usage_perc", "gauge",
           "KV cache pages in use, 0 to 1 (pages only the prefix cache holds count as free).", lab,
           kv_use);
    scalar(&b, "vllm:gpu_cache_usage_perc", "gauge", "Alias of vllm:kv_cache_usage_perc.", lab,
           kv_use);
    if (m->prefix_on) {
        scalar(&b, "tandem_prefix_cache_pages", "gauge",
               "KV pages the prefix cache names (some may be requests' too).", lab,
               (double)m->prefix.pages);
        scalar(&b, "tandem_prefix_cache_evictable_pages", "gauge",
               "Of them, pages only the cache holds: evicted first when memory is needed.", lab,
               (double)m->kv.evictable);
        scalar(&b, "tandem_prefix_cache_queried_tokens_total", "counter",
               "Prompt tokens looked up in the prefix cache (whole pages).", lab,
               (double)m->prefix.queried_tokens);
        scalar(&b, "tandem_prefix_cache_hit_tokens_total", "counter",
               "Of them, found: their KV was reused, not computed.", lab,
               (double)m->prefix.hit_tokens);
        scalar(&b, "tandem_prefix_cache_stored_pages_total", "counter",
               "Full pages added to the prefix cache.", lab, (double)m->prefix.stored_pages);
        scalar(&b, "tandem_prefix_cache_evicted_pages_total", "counter",
               "Pages evicted from the prefix cache to make room.", lab,
               (double)m->prefix.evicted_pages);
    }
    if (gm && gm->on) {
        scalar(&b, "tandem_grammar_cache_entries", "gauge",
               "Compiled structured-output grammars kept (schemas, regexes, ...).", lab,
               (double)gm->entries);
        scalar(&b, "tandem_grammar_cache_hits_total", "counter",
               "Requests whose grammar was found compiled.", lab, (double)gm->hits);
        scalar(&b, "tandem_grammar_cache_misses_total", "counter",
               "Requests whose grammar was compiled for them.", lab, (double)gm->misses);
    }
    tdm_sbuf_printf(&b, "# HELP tandem_requests_finished_total Requests finished, by reason.\n"
                        "# TYPE tandem_requests_finished_total counter\n");
    static const char *const reasons[] = {"none", "stop", "length", "cancelled", "error"};
    for (int i = 1; i < 5; i++)
        tdm_sbuf_printf(&b, "tandem_requests_finished_total{%s,reason=\"%s\"} %llu\n", lab,
                        reasons[i], (unsigned long long)m->finished[i]);
    tdm_sbuf_printf(&b, "# HELP tandem_http_responses_total HTTP responses, by status class.\n"
                        "# TYPE tandem_http_responses_total counter\n");
    for (int i = 1; i <= 5; i++)
        tdm_sbuf_printf(&b, "tandem_http_responses_total{%s,code=\"%dxx\"} %llu\n", lab, i,
                        (unsigned long long)http_by_class[i]);
    return tdm_sbuf_take(&b);
}
