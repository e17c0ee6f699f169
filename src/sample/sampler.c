/*
 * Logits processing and the draw. See include/tandem/sample.h for the order of operations.
 *
 * Cost: a full sort of a 50k-150k vocabulary per token would cost milliseconds. The nucleus is
 * found exactly without one: the candidates with probability >= t form a prefix of the sorted
 * order, so if their mass already reaches top_p, the nucleus lies inside them and only they
 * need sorting. t starts at p_max / 1024 and falls by 1024x until that holds.
 */
#include "tandem/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct tdm_sampling_params tdm_sampling_defaults(void)
{
    return (struct tdm_sampling_params){
        .temperature = 0.0f,
        .top_k = 0,
        .top_p = 1.0f,
        .min_p = 0.0f,
        .repetition_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .seed = 0,
    };
}

tdm_status tdm_sampling_validate(const struct tdm_sampling_params *p)
{
    if (!(p->temperature >= 0.0f && p->temperature <= 100.0f))
        return tdm_err_set(TDM_EINVAL, "temperature must be in [0, 100]");
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return tdm_err_set(TDM_EINVAL, "top_p must be in (0, 1]");
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return tdm_err_set(TDM_EINVAL, "min_p must be in [0, 1]");
    if (p->top_k < 0) return tdm_err_set(TDM_EINVAL, "top_k must be >= 0");
    if (!(p->repetition_penalty > 0.0f && p->repetition_penalty <= 100.0f))
        return tdm_err_set(TDM_EINVAL, "repetition_penalty must be in (0, 100]");
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return tdm_err_set(TDM_EINVAL, "presence_penalty must be in [-2, 2]");
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return tdm_err_set(TDM_EINVAL, "frequency_penalty must be in [-2, 2]");
    return TDM_OK;
}

tdm_status tdm_sample_scratch_init(struct tdm_sample_scratch *s, int vocab)
{
    memset(s, 0, sizeof *s);
    s->probs = malloc((size_t)vocab * sizeof *s->probs);
    s->ids = malloc((size_t)vocab * sizeof *s->ids);
    s->raw = malloc((size_t)vocab * sizeof *s->raw);
    s->p = malloc((size_t)vocab * sizeof *s->p);
    if (!s->probs || !s->ids || !s->raw || !s->p) {
        tdm_sample_scratch_free(s);
        return tdm_err_set(TDM_ENOMEM, "sampler scratch: out of memory");
    }
    s->vocab = vocab;
    return TDM_OK;
}

void tdm_sample_scratch_free(struct tdm_sample_scratch *s)
{
    if (!s) return;
    free(s->probs);
    free(s->ids);
    free(s->raw);
    free(s->p);
    memset(s, 0, sizeof *s);
}

static bool has_penalties(const struct tdm_sampling_params *p)
{
    return p->repetition_penalty != 1.0f || p->presence_penalty != 0.0f ||
           p->frequency_penalty != 0.0f;
}

tdm_status tdm_sampler_init(struct tdm_sampler *s, const struct tdm_sampling_params *p,
                            uint64_t request_id, int vocab)
{
    memset(s, 0, sizeof *s);
    tdm_status st = tdm_sampling_validate(p);
    if (st != TDM_OK) return st;
    s->params = *p;
    if (s->params.temperature < TDM_SAMPLE_TEMPERATURE_FLOOR) s->params.temperature = 0.0f;
    s->request_id = request_id;
    s->vocab = vocab;
    if (has_penalties(p)) {
        s->prompt_seen = calloc((size_t)vocab, sizeof *s->prompt_seen);
        s->out_count = calloc((size_t)vocab, sizeof *s->out_count);
        s->seen = malloc((size_t)vocab * sizeof *s->seen);
        if (!s->prompt_seen || !s->out_count || !s->seen) {
            tdm_sampler_free(s);
            return tdm_err_set(TDM_ENOMEM, "sampler: out of memory");
        }
    }
    return TDM_OK;
}

void tdm_sampler_free(struct tdm_sampler *s)
{
    if (!s) return;
    free(s->prompt_seen);
    free(s->out_count);
    free(s->seen);
    free(s->bias);
    free(s->bias_ids);
    s->prompt_seen = NULL;
    s->out_count = NULL;
    s->seen = NULL;
    s->n_seen = 0;
    s->bias = NULL;
    s->bias_ids = NULL;
    s->n_bias = 0;
}

tdm_status tdm_sampler_set_bias(struct tdm_sampler *s, const int32_t *ids, const float *vals, int n)
{
    if (n < 0 || n > TDM_MAX_LOGIT_BIAS)
        return tdm_err_set(TDM_EINVAL, "logit bias: %d entries; at most %d", n, TDM_MAX_LOGIT_BIAS);
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= s->vocab)
            return tdm_err_set(TDM_EINVAL, "logit bias: token %d is not in [0, %d)", ids[i],
                               s->vocab);
        if (!(vals[i] >= -100.0f && vals[i] <= 100.0f))
            return tdm_err_set(TDM_EINVAL, "logit bias: %g for token %d is not in [-100, 100]",
                               (double)vals[i], ids[i]);
    }
    free(s->bias);
    free(s->bias_ids);
    s->bias = NULL;
    s->bias_ids = NULL;
    s->n_bias = 0;
    if (n == 0) return TDM_OK;
    s->bias = calloc((size_t)s->vocab, sizeof *s->bias);
    s->bias_ids = malloc((size_t)n * sizeof *s->bias_ids);
    if (!s->bias || !s->bias_ids) {
        free(s->bias);
        free(s->bias_ids);
        s->bias = NULL;
        s->bias_ids = NULL;
        return tdm_err_set(TDM_ENOMEM, "sampler: out of memory");
    }
    for (int i = 0; i < n; i++)
        s->bias[ids[i]] = vals[i];
    for (int t = 0; t < s->vocab && s->n_bias < n; t++) /* ascending, each once */
        if (s->bias[t] != 0.0f) s->bias_ids[s->n_bias++] = t;
    if (s->n_bias == 0) { /* every value was 0: nothing to do */
        free(s->bias);
        free(s->bias_ids);
        s->bias = NULL;
        s->bias_ids = NULL;
    }
    return TDM_OK;
}

void tdm_sampler_accept(struct tdm_sampler *s, int32_t token, bool is_prompt)
{
    if (!s->out_count || token < 0 || token >= s->vocab) return;
    if (!s->prompt_seen[token] && !s->out_count[token]) s->seen[s->n_seen++] = token;
    if (is_prompt)
        s->prompt_seen[token] = 1;
    else if (s->out_count[token] < UINT32_MAX)
        s->out_count[token]++;
}

void tdm_sampler_unaccept(struct tdm_sampler *s, int32_t token)
{
    if (!s->out_count || token < 0 || token >= s->vocab || !s->out_count[token]) return;
    if (--s->out_count[token] || s->prompt_seen[token]) return;
    /* its first sight is being undone: newest-first undos make it the last one seen */
    for (int i = s->n_seen - 1; i >= 0; i--)
        if (s->seen[i] == token) {
            memmove(s->seen + i, s->seen + i + 1, (size_t)(s->n_seen - i - 1) * sizeof *s->seen);
            s->n_seen--;
            break;
        }
}

/* Whether every one of x[0, n) is finite (no infinity, no NaN): the exponent bits of each, in
 * blocks of 8 that the compiler turns into vector compares. */
static bool all_finite(const float *x, int n)
{
    uint32_t bad = 0;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) {
            uint32_t u;
            memcpy(&u, &x[i + k], 4);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
    for (; i < n; i++)
        bad |= !isfinite(x[i]);
    return !bad;
}

/* The first index of the largest of x[0, n), every value finite: the maximum by 8 running
 * lanes (vector max instructions), then the first index that holds it. The scalar scan with
 * its dependent load was 2% of a batch-1 decode step over a 49k vocabulary. */
static int32_t argmax_finite(const float *x, int n)
{
    if (n < 16) {
        int32_t best = 0;
        for (int i = 1; i < n; i++)
            if (x[i] > x[best]) best = i;
        return best;
    }
    float m[8];
    for (int k = 0; k < 8; k++)
        m[k] = x[k];
    int i = 8;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            m[k] = x[i + k] > m[k] ? x[i + k] : m[k];
    float mx = m[0];
    for (int k = 1; k < 8; k++)
        mx = m[k] > mx ? m[k] : mx;
    for (; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    int32_t best = 0;
    while (x[best] != mx)
        best++;
    return best;
}

int32_t tdm_argmax(const float *logits, int vocab)
{
    if (all_finite(logits, vocab)) return argmax_finite(logits, vocab);
    int32_t best = 0;
    for (int i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* log(sum(exp(logits))) over the non-NaN logits: +inf when one is +inf, -inf when none is
 * finite. */
static double log_sum_exp(const float *logits, int vocab)
{
    float mx = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (logits[i] > mx) mx = logits[i]; /* NaN compares false */
    if (!isfinite(mx)) return mx;
    double sum = 0.0;
    for (int i = 0; i < vocab; i++)
        if (!isnan(logits[i])) sum += exp((double)logits[i] - mx);
    return mx + log(sum);
}

/* A log-probability from a logit and the row's log-sum-exp, never NaN: a +inf logit against a
 * +inf sum is 0 (certain), anything else not finite is -inf. */
static float logprob_from(float logit, double lse)
{
    if (isnan(logit)) return -INFINITY;
    if (isinf(lse) && lse > 0) return isinf(logit) && logit > 0 ? 0.0f : -INFINITY;
    double lp = (double)logit - lse;
    return isnan(lp) ? -INFINITY : (float)lp;
}

float tdm_logprob_of(const float *logits, int vocab, int32_t token)
{
    return logprob_from(logits[token], log_sum_exp(logits, vocab));
}

/* Sort context: only the scheduler thread samples, but keep it thread-local anyway. */
static _Thread_local const float *sort_probs;

/* Descending probability, then ascending id: a total order, so the result never depends on
 * qsort's stability. */
static int cmp_desc(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    float px = sort_probs[x], py = sort_probs[y];
    if (px > py) return -1;
    if (px < py) return 1;
    return (x > y) - (x < y);
}

static void sort_ids(int32_t *ids, int n, const float *probs)
{
    sort_probs = probs;
    qsort(ids, (size_t)n, sizeof *ids, cmp_desc);
}

void tdm_logprobs_top(const float *logits, int vocab, int k, int32_t *ids, float *logprobs)
{
    double lse = log_sum_exp(logits, vocab);
    /* Insertion into a small sorted list: k is at most 20 for OpenAI's top_logprobs. */
    int n = 0;
    for (int i = 0; i < vocab; i++) {
        if (n == k && !(logits[i] > logits[ids[k - 1]])) continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && logits[i] > logits[ids[j - 1]]) {
            ids[j] = ids[j - 1];
            j--;
        }
        ids[j] = i;
    }
    for (int i = 0; i < n; i++)
        logprobs[i] = logprob_from(logits[ids[i]], lse);
}

/* One token's penalties (the device sampler does the same float operations). */
static float penalise(const struct tdm_sampling_params *p, float l, uint32_t cnt, bool in_prompt)
{
    if (p->repetition_penalty != 1.0f && (cnt || in_prompt))
        l = l > 0 ? l / p->repetition_penalty : l * p->repetition_penalty;
    if (cnt) l -= p->presence_penalty + p->frequency_penalty * (float)cnt;
    return l;
}

/* The penalties proper, by the counts, less the undo list (apply_penalties). */
static void apply_counts(const struct tdm_sampler *s, float *logits, const int32_t *undo,
                         int n_undo)
{
    const struct tdm_sampling_params *p = &s->params;
    float raw[TDM_SAMPLE_MAX_UNDO];
    n_undo = TDM_MIN(TDM_MAX(n_undo, 0), TDM_SAMPLE_MAX_UNDO);
    for (int j = 0; j < n_undo; j++)
        raw[j] = logits[undo[j]];
    for (int i = 0; i < s->vocab; i++)
        logits[i] = penalise(p, logits[i], s->out_count[i], s->prompt_seen[i] != 0);
    for (int j = 0; j < n_undo; j++) {
        int32_t t = undo[j];
        bool first = true;
        uint32_t n = 0;
        for (int a = 0; a < n_undo; a++) {
            if (undo[a] == t && a < j) first = false;
            n += undo[a] == t;
        }
        if (!first) continue;
        uint32_t cnt = s->out_count[t] > n ? s->out_count[t] - n : 0;
        logits[t] = penalise(p, raw[j], cnt, s->prompt_seen[t] != 0);
    }
}

/* The penalties of the sampler's state, less the n_undo output tokens in undo: each of those
 * is penalised again from its raw logit with its count less its occurrences there. Then the
 * logit bias, added to the penalised logit (as the device sampler does). */
static void apply_penalties(const struct tdm_sampler *s, float *logits, const int32_t *undo,
                            int n_undo)
{
    if (s->out_count) apply_counts(s, logits, undo, n_undo);
    for (int j = 0; j < s->n_bias; j++)
        logits[s->bias_ids[j]] += s->bias[s->bias_ids[j]];
}

/* Gathers into ids a set of candidates that provably contains the top-k and the nucleus (see
 * the file comment), sorted by (probability desc, id asc); returns its size. */
static int nucleus_candidates(const struct tdm_sampling_params *p, const float *probs, int vocab,
                              int32_t *ids)
{
    float pmax = probs[tdm_argmax(probs, vocab)];
    int n = 0;
    for (float t = pmax / 1024.0f;; t /= 1024.0f) {
        double mass = 0.0;
        n = 0;
        for (int i = 0; i < vocab; i++)
            if (probs[i] >= t) {
                ids[n++] = i;
                mass += probs[i];
            }
        bool k_ok = p->top_k == 0 || n >= p->top_k;
        bool p_ok = p->top_p >= 1.0f || mass >= p->top_p;
        if ((k_ok && p_ok) || n == vocab || !(t > 0.0f)) break; /* NaN ends it too */
    }
    sort_ids(ids, n, probs);
    return n;
}

/* The kept set of a row: penalties, non-finite logits, greedy, temperature, top-k, top-p and
 * min-p. Returns the token when the row's choice is forced (a +inf logit, nothing finite,
 * greedy), else -1 with scratch->probs holding the softmax at the temperature and
 * scratch->ids[0, *n) the kept tokens (in a fixed order). logits is modified. */
static int32_t kept_set(const struct tdm_sampler *s, float *logits,
                        struct tdm_sample_scratch *scratch, int *n_out, const int32_t *undo,
                        int n_undo)
{
    const struct tdm_sampling_params *p = &s->params;
    int vocab = s->vocab;
    if (tdm_sampler_processes(s)) apply_penalties(s, logits, undo, n_undo);
    /* non-finite logits, from any source (the model included): NaN is never chosen, a +inf wins
     * outright, and a row with nothing finite gives token 0 */
    if (all_finite(logits, vocab)) { /* the usual case: one vector pass, nothing to fix */
        if (p->temperature == 0.0f || p->top_k == 1) return argmax_finite(logits, vocab);
    } else {
        int first_pinf = -1;
        bool any_finite = false;
        for (int i = 0; i < vocab; i++) {
            if (isnan(logits[i])) logits[i] = -INFINITY;
            if (isinf(logits[i])) {
                if (logits[i] > 0 && first_pinf < 0) first_pinf = i;
            } else {
                any_finite = true;
            }
        }
        if (first_pinf >= 0 || !any_finite) return first_pinf >= 0 ? first_pinf : 0;
        if (p->temperature == 0.0f || p->top_k == 1) return tdm_argmax(logits, vocab);
    }

    /* softmax at the temperature */
    float *probs = scratch->probs;
    int32_t *ids = scratch->ids;
    float inv_t = 1.0f / p->temperature;
    float mx = logits[tdm_argmax(logits, vocab)];
    double sum = 0.0;
    for (int i = 0; i < vocab; i++) {
        probs[i] = expf((logits[i] - mx) * inv_t);
        sum += probs[i];
    }
    float inv_sum = (float)(1.0 / sum);
    for (int i = 0; i < vocab; i++)
        probs[i] *= inv_sum;

    int n;
    if (p->top_k == 0 && p->top_p >= 1.0f) {
        /* No truncation by rank: any fixed order samples the same distribution; use id order
         * and skip the sort. */
        float floor_p = p->min_p * probs[tdm_argmax(probs, vocab)];
        n = 0;
        for (int i = 0; i < vocab; i++)
            if (probs[i] >= floor_p && probs[i] > 0.0f) ids[n++] = i;
    } else {
        n = nucleus_candidates(p, probs, vocab, ids);
        if (p->top_k > 0 && n > p->top_k) n = p->top_k;
        if (p->top_p < 1.0f) {
            double cum = 0.0;
            for (int i = 0; i < n; i++) {
                cum += probs[ids[i]];
                if (cum >= p->top_p) {
                    n = i + 1;
                    break;
                }
            }
        }
        if (p->min_p > 0.0f) {
            float floor_p = p->min_p * probs[ids[0]];
            int keep = 1;
            while (keep < n && probs[ids[keep]] >= floor_p)
                keep++;
            n = keep;
        }
    }
    /* cannot happen with a finite maximum (its probability is 1); never index -1 */
    if (n <= 0) return tdm_argmax(logits, vocab);
    *n_out = n;
    return -1;
}

/* The sampler's draw from the kept set (stream 0), with penalties less undo. */
static int32_t draw_kept(const struct tdm_sampler *s, float *logits, uint32_t position,
                         struct tdm_sample_scratch *scratch, const int32_t *undo, int n_undo)
{
    int n = 0;
    int32_t chosen = kept_set(s, logits, scratch, &n, undo, n_undo);
    if (chosen >= 0) return chosen;
    const float *probs = scratch->probs;
    const int32_t *ids = scratch->ids;
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += probs[ids[i]];
    double u = tdm_rng_uniform(s->params.seed, s->request_id, position, 0) * total;
    double cum = 0.0;
    chosen = ids[n - 1];
    for (int i = 0; i < n; i++) {
        cum += probs[ids[i]];
        if (u < cum) return ids[i];
    }
    return chosen;
}

/* The distribution of draw_kept into dist (penalties less undo); returns its support size. */
static int dist_kept(const struct tdm_sampler *s, float *logits, struct tdm_sample_scratch *scratch,
                     float *dist, const int32_t *undo, int n_undo)
{
    int vocab = s->vocab;
    int n = 0;
    int32_t forced = kept_set(s, logits, scratch, &n, undo, n_undo);
    memset(dist, 0, (size_t)vocab * sizeof *dist);
    if (forced >= 0) {
        dist[forced] = 1.0f;
        return 1;
    }
    double total = 0.0;
    for (int i = 0; i < n; i++)
        total += scratch->probs[scratch->ids[i]];
    for (int i = 0; i < n; i++)
        dist[scratch->ids[i]] = (float)(scratch->probs[scratch->ids[i]] / total);
    return n;
}

int32_t tdm_sampler_sample(const struct tdm_sampler *s, float *logits, uint32_t position,
                           struct tdm_sample_scratch *scratch, float *logprob)
{
    int vocab = s->vocab;
    TDM_ASSERT(scratch->vocab >= vocab);
    double raw_lse = 0.0;
    if (logprob) {
        raw_lse = log_sum_exp(logits, vocab);
        if (tdm_sampler_processes(s)) memcpy(scratch->raw, logits, (size_t)vocab * sizeof *logits);
    }
    const float *raw = tdm_sampler_processes(s) ? scratch->raw : logits;
    int32_t chosen = draw_kept(s, logits, position, scratch, NULL, 0);
    if (logprob) *logprob = logprob_from(raw[chosen], raw_lse);
    return chosen;
}

int tdm_sampler_dist(const struct tdm_sampler *s, float *logits, struct tdm_sample_scratch *scratch,
                     float *dist)
{
    TDM_ASSERT(scratch->vocab >= s->vocab);
    return dist_kept(s, logits, scratch, dist, NULL, 0);
}

int32_t tdm_dist_draw(const float *w, int vocab, double u)
{
    double total = 0.0;
    int32_t last = -1;
    for (int i = 0; i < vocab; i++)
        if (w[i] > 0.0f) {
            total += w[i];
            last = i;
        }
    if (last < 0) return -1;
    double x = u * total, cum = 0.0;
    for (int i = 0; i <= last; i++)
        if (w[i] > 0.0f) {
            cum += w[i];
            if (x < cum) return i;
        }
    return last;
}

/* Rejection acceptance of row's draft (see TDM_SAMPLE_VERIFY), penalties less undo: p into
 * scratch->p, the residual into scratch->probs. */
static int32_t verify_rejection(struct tdm_sample_row *row, float *logits,
                                struct tdm_sample_scratch *scratch, const int32_t *undo, int n_undo)
{
    const struct tdm_sampler *smp = row->smp;
    int vocab = smp->vocab;
    int32_t d = row->draft;
    const float *q = row->q;
    float *p = scratch->p;
    dist_kept(smp, logits, scratch, p, undo, n_undo);
    uint64_t seed = smp->params.seed, id = smp->request_id;
    double u = tdm_rng_uniform(seed, id, row->position, 1);
    row->kept = q[d] > 0.0f && u * q[d] < p[d];
    if (row->kept) return d;
    float *w = scratch->probs;
    for (int v = 0; v < vocab; v++) /* the residual: max(0, p - q) */
        w[v] = p[v] > q[v] ? p[v] - q[v] : 0.0f;
    double u2 = tdm_rng_uniform(seed, id, row->position, 2);
    int32_t t = tdm_dist_draw(w, vocab, u2);
    if (t < 0) t = tdm_dist_draw(p, vocab, u2); /* p == q to the last bit: p itself is right */
    return t < 0 ? d : t;
}

/* A tree row's recursive rejection over its point-mass candidates (TDM_SAMPLE_TREE), penalties
 * less undo: p into scratch->p, and what is left of it after the refused candidates. */
static int32_t verify_tree(struct tdm_sample_row *row, float *logits,
                           struct tdm_sample_scratch *scratch, const int32_t *undo, int n_undo)
{
    const struct tdm_sampler *smp = row->smp;
    float *p = scratch->p;
    dist_kept(smp, logits, scratch, p, undo, n_undo);
    const uint64_t seed = smp->params.seed, id = smp->request_id;
    const int n = TDM_MIN(TDM_MAX(row->n_cand, 0), TDM_SAMPLE_MAX_CAND);
    double left = 1.0; /* the mass of p not yet refused: r = p / left off the refused */
    for (int i = 0; i < n; i++) {
        const int32_t d = row->cand[i];
        const double pd = p[d];
        const double u = tdm_rng_uniform(seed, id, row->position, TDM_SAMPLE_STREAM_TREE + i);
        if (pd > 0 && u * left < pd) {
            row->kept = true;
            return d;
        }
        left -= pd;
        p[d] = 0.0f;
    }
    int32_t t = tdm_dist_draw(p, smp->vocab, tdm_rng_uniform(seed, id, row->position, 2));
    /* nothing left: only when the candidates held all of p and rounding refused them all */
    return t >= 0 ? t : (n ? row->cand[n - 1] : 0);
}

void tdm_sample_apply_allow(float *logits, int vocab, const uint32_t *allow)
{
    const int full = vocab / 32;
    for (int w = 0; w < full; w++) { /* a grammar's masks are mostly all-or-nothing words */
        const uint32_t x = allow[w];
        float *l = logits + (size_t)w * 32;
        if (x == UINT32_MAX) continue;
        if (x == 0) {
            for (int b = 0; b < 32; b++)
                l[b] = -INFINITY;
            continue;
        }
        for (uint32_t z = ~x; z; z &= z - 1)
            l[__builtin_ctz(z)] = -INFINITY;
    }
    for (int t = full * 32; t < vocab; t++)
        if (!(allow[t >> 5] >> (t & 31) & 1)) logits[t] = -INFINITY;
}

void tdm_sample_row_host(struct tdm_sample_row *row, float *logits,
                         struct tdm_sample_scratch *scratch)
{
    const struct tdm_sampler *smp = row->smp;
    int vocab = smp->vocab;
    TDM_ASSERT(scratch->vocab >= vocab);
    int k = TDM_MIN(row->n_top, TDM_TOP_LOGPROBS_MAX);
    if (k > 0) tdm_logprobs_top(logits, vocab, k, row->top_ids, row->top_lps);
    row->logprob = 0.0f;
    row->kept = false;
    /* as tdm_sampler_sample: only penalties change the logits the log-probability is read
     * from, so only then is the raw row kept (a bias too); and without penalties an undo list
     * is moot (apply_penalties ignores it) */
    const bool pen = tdm_sampler_processes(smp);
    const int32_t *undo = pen ? row->undo : NULL;
    const int n_undo = pen ? row->n_undo : 0;
    double raw_lse = 0.0;
    if (row->n_top >= 0) {
        raw_lse = log_sum_exp(logits, vocab);
        if (pen) memcpy(scratch->raw, logits, (size_t)vocab * sizeof *logits);
    }
    const float *raw = pen ? scratch->raw : logits;
    /* the grammar's mask: after the raw row is read, so the log-probabilities stay raw (the
     * token chosen is allowed, so its raw logit is untouched in place) */
    if (row->allow && row->mode != TDM_SAMPLE_SCORE)
        tdm_sample_apply_allow(logits, vocab, row->allow);
    int32_t t;
    if (row->mode == TDM_SAMPLE_SCORE) {
        t = row->draft; /* given: nothing is drawn, the penalties are moot */
    } else if (row->mode == TDM_SAMPLE_PROPOSE) {
        dist_kept(smp, logits, scratch, row->dist, undo, n_undo);
        t = tdm_dist_draw(row->dist, vocab,
                          tdm_rng_uniform(smp->params.seed, smp->request_id, row->position, 3));
        if (t < 0) t = 0;
        if (row->one_hot) {
            memset(row->dist, 0, (size_t)vocab * sizeof *row->dist);
            row->dist[t] = 1.0f;
        }
    } else if (row->mode == TDM_SAMPLE_VERIFY && row->q) {
        t = verify_rejection(row, logits, scratch, undo, n_undo);
    } else if (row->mode == TDM_SAMPLE_TREE) {
        t = verify_tree(row, logits, scratch, undo, n_undo);
    } else {
        t = draw_kept(smp, logits, row->position, scratch, undo, n_undo);
        row->kept = row->mode == TDM_SAMPLE_VERIFY && t == row->draft;
    }
    row->token = t;
    if (row->n_top >= 0) row->logprob = logprob_from(raw[t], raw_lse);
}
