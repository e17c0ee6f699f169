/*
 * The controller: how many tokens each request drafts this step (include/tandem/spec.h has the
 * policy in words).
 *
 * Model. For request i, c[i][m] is the chance that its draft at position m is kept given that
 * every draft before it was: (kept + A * prior) / (reached + A), from its decayed record and
 * the batch-wide prior (A = 4 pseudo-observations). Drafting k tokens is then expected to add
 * P[i][1] + ... + P[i][k] tokens to the step, P[i][j] = c[i][1] * ... * c[i][j]. The step
 * costs verify(T) = a + b T for its T tokens, plus one draft pass per depth j, each
 * draft_a + draft_b * (requests drafting at depth j).
 *
 * Choice. At the step's current throughput R (tokens per ns, first without drafts), depth j
 * is added for the requests still drafting whose P[i][j] > R * b (each draft token's verify
 * cost), if together they pay for the depth: sum P[i][j] > R * (draft pass + b * count).
 * The first depth that does not pay ends the step's drafting. R is then re-evaluated with the
 * chosen drafts and the choice repeated (a higher R is stricter); the best is kept, and only
 * if it beats the step without drafts. Costs are measured, so a CPU, whose verify cost grows
 * with every token, drafts less than a GPU, whose verify is nearly flat in T. The first three
 * drafting steps draft one token each, to measure; a request that drafted nothing for 32, 64,
 * 128, ... steps probes with one, unless even a certain token could not pay for a draft.
 *
 * Everything here runs on the scheduler thread.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"

enum { PRIOR_WEIGHT = 4, WARMUP_STEPS = 3, WARMUP_K = 1, PROBE_FIRST = 32 };
#define COST_DECAY   0.98
#define RECORD_DECAY 0.97f
#define PRIOR_RATE   0.02f

void tdm_spec_cost_observe(struct tdm_spec_cost *c, double x, double y)
{
    c->w = c->w * COST_DECAY + 1;
    c->sx = c->sx * COST_DECAY + x;
    c->sy = c->sy * COST_DECAY + y;
    c->sxx = c->sxx * COST_DECAY + x * x;
    c->sxy = c->sxy * COST_DECAY + x * y;
    c->n++;
}

bool tdm_spec_cost_fit(const struct tdm_spec_cost *c, double *a, double *b)
{
    if (!c->n || c->w <= 0) return false;
    double mx = c->sx / c->w, my = c->sy / c->w;
    double vx = c->sxx / c->w - mx * mx, cxy = c->sxy / c->w - mx * my;
    if (vx > 1e-6 * (mx * mx + 1)) {
        *b = cxy / vx;
        if (*b < 0) *b = 0; /* more work never costs less: noise */
        *a = my - *b * mx;
        if (*a < 0) { /* keep the line through the mean, never below zero at x = 0 */
            *a = 0;
            *b = mx > 0 ? my / mx : 0;
        }
    } else { /* one x so far: pessimistic, cost in proportion */
        *a = 0;
        *b = mx > 0 ? my / mx : my;
    }
    return true;
}

tdm_status tdm_spec_ctl_init(struct tdm_spec_ctl *c, int max_seqs)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < TDM_SPEC_MAX_K; i++)
        c->prior[i] = 0.5f;
    c->warmup = WARMUP_STEPS;
    c->cap = max_seqs;
    c->p = malloc((size_t)max_seqs * TDM_SPEC_MAX_K * sizeof *c->p);
    c->best = malloc((size_t)max_seqs * sizeof *c->best);
    c->cur = malloc((size_t)max_seqs * sizeof *c->cur);
    if (c->p && c->best && c->cur) return TDM_OK;
    tdm_spec_ctl_free(c);
    return tdm_err_set(TDM_ENOMEM, "spec: out of memory for the controller");
}

void tdm_spec_ctl_free(struct tdm_spec_ctl *c)
{
    free(c->p);
    free(c->best);
    free(c->cur);
    c->p = NULL;
    c->best = c->cur = NULL;
}

/* A request that has drafted nothing for 32, 64, 128, ... steps drafts one token, so that
 * its estimate can recover when the text becomes predictable; the probes thin out. */
static bool probe_due(const struct tdm_draft_stats *st)
{
    uint32_t n = st->idle_steps;
    return n >= PROBE_FIRST && (n & (n - 1)) == 0;
}

void tdm_spec_ctl_choose(struct tdm_spec_ctl *c, struct tdm_sched_draft *d, int n, int base_tokens)
{
    double va, vb, da, db;
    bool have_v = tdm_spec_cost_fit(&c->verify, &va, &vb);
    bool have_d = tdm_spec_cost_fit(&c->draft, &da, &db);
    if (c->warmup > 0 || !have_v || !have_d) { /* measure first: a small fixed k */
        if (c->warmup > 0) c->warmup--;
        for (int i = 0; i < n; i++)
            d[i].k = TDM_MIN(d[i].k, WARMUP_K);
        return;
    }
    /* P[i][j]: the chance that request i's first j + 1 drafts are all kept */
    for (int i = c->cap; i < n; i++) /* never: a step has at most max_seqs requests */
        d[i].k = 0;
    n = TDM_MIN(n, c->cap);
    float(*P)[TDM_SPEC_MAX_K] = (float(*)[TDM_SPEC_MAX_K])c->p;
    int *best = c->best, *cur = c->cur;
    for (int i = 0; i < n; i++) {
        float p = 1;
        for (int j = 0; j < d[i].k; j++) {
            const struct tdm_draft_stats *st = d[i].stats;
            float ci = (st->kept[j] + PRIOR_WEIGHT * c->prior[j]) / (st->reached[j] + PRIOR_WEIGHT);
            p *= TDM_MIN(TDM_MAX(ci, 0.0f), 1.0f);
            P[i][j] = p;
        }
    }
    const double base_time = va + vb * base_tokens;
    const double rate0 = base_tokens / TDM_MAX(base_time, 1.0);
    double best_rate = rate0;
    bool any_best = false;
    double rate = rate0;
    for (int round = 0; round < 3; round++) {
        double gain = 0, extra_tokens = 0, draft_time = 0;
        for (int i = 0; i < n; i++)
            cur[i] = 0;
        for (int j = 0; j < TDM_SPEC_MAX_K; j++) {
            double g = 0;
            int cnt = 0;
            for (int i = 0; i < n; i++)
                if (cur[i] == j && d[i].k > j && P[i][j] > rate * vb) {
                    g += P[i][j];
                    cnt++;
                }
            if (!cnt) break;
            double cost = da + db * cnt + vb * cnt;
            if (g <= rate * cost) break;
            for (int i = 0; i < n; i++)
                if (cur[i] == j && d[i].k > j && P[i][j] > rate * vb) cur[i] = j + 1;
            gain += g;
            extra_tokens += cnt;
            draft_time += da + db * cnt;
        }
        double t = va + vb * (base_tokens + extra_tokens) + draft_time;
        double r = (base_tokens + gain) / TDM_MAX(t, 1.0);
        if (r > best_rate * (1 + 1e-3)) {
            best_rate = r;
            any_best = true;
            memcpy(best, cur, (size_t)n * sizeof *best);
        }
        if (r <= rate) break;
        rate = r;
    }
    /* probes only where a draft could pay at all: one certain token against one draft pass
     * and its verify token (a drafter as dear as the target never can) */
    bool could_pay = 1.0 > rate0 * (da + db + vb);
    for (int i = 0; i < n; i++) {
        int k = any_best ? best[i] : 0;
        if (!k && could_pay && probe_due(d[i].stats)) k = 1;
        d[i].k = TDM_MIN(d[i].k, k);
    }
}

void tdm_spec_ctl_learn(struct tdm_spec_ctl *c, struct tdm_draft_stats *st, int n_draft,
                        int n_accepted)
{
    for (int j = 0; j < n_draft && j <= n_accepted && j < TDM_SPEC_MAX_K; j++) {
        float kept = j < n_accepted ? 1.0f : 0.0f;
        c->prior[j] += PRIOR_RATE * (kept - c->prior[j]);
    }
    if (!n_draft) return;
    for (int j = 0; j < TDM_SPEC_MAX_K; j++) { /* the record follows the text */
        st->reached[j] *= RECORD_DECAY;
        st->kept[j] *= RECORD_DECAY;
    }
}

/* ---- the gate ---- */
#define GATE_RATE        0.1
#define GATE_MARGIN      0.98
#define GATE_BASE_N      2
#define GATE_REFRESH     32
#define GATE_EXPLORE     32
#define GATE_EXPLORE_MAX 256     /* the doubling's cap for small losses */
#define GATE_EXPLORE_CAP 1000000 /* the interval's cap when a draft step costs many */

static int gate_bucket(int n)
{
    int b = 0;
    while (n > 1 && b < TDM_SPEC_GATE_BUCKETS - 1) {
        n >>= 1;
        b++;
    }
    return b;
}

/* The next exploration interval where drafting loses: doubled, and long enough that one
 * exploring step (which costs off/on - 1 steps' worth of time) is at most 1% of the steps in
 * between. */
static uint32_t explore_next(uint32_t every, double off_rate, double on_rate)
{
    double loss = on_rate > 0 ? off_rate / on_rate - 1 : 1e6;
    double need = 100.0 * loss;
    double next = TDM_MAX(TDM_MIN((double)every * 2, (double)GATE_EXPLORE_MAX), need);
    return (uint32_t)TDM_MIN(next, (double)GATE_EXPLORE_CAP);
}

static void arm_add(struct tdm_spec_arm *a, double x)
{
    a->rate = a->n ? a->rate + GATE_RATE * (x - a->rate) : x;
    a->n++;
}

bool tdm_spec_gate_begin(struct tdm_spec_gate *g, int n)
{
    if (g->open && !g->mixed && g->ns > 0 && g->tokens > 0)
        arm_add(&g->arm[g->bucket][g->drafted], g->tokens / g->ns);
    int b = gate_bucket(n);
    g->open = true;
    g->fresh = true;
    g->mixed = true; /* until tdm_spec_gate_ran says the plan was decode-only */
    g->drafted = false;
    g->bucket = b;
    g->tokens = 0;
    g->ns = 0;
    g->expect_tokens = -1;
    g->losing = false;
    if (!g->every[b]) g->every[b] = GATE_EXPLORE;
    const struct tdm_spec_arm *off = &g->arm[b][0], *on = &g->arm[b][1];
    g->since[b]++;
    if (off->n < GATE_BASE_N) return false; /* measure the baseline first */
    if (on->n < GATE_BASE_N) {
        /* drafting gets relatively dearer as the batch grows: where a smaller batch already
         * measured it losing, this one starts off too, and only explores */
        bool smaller_loses = false;
        for (int x = 0; x < b; x++)
            smaller_loses |= g->arm[x][1].n >= GATE_BASE_N && g->arm[x][0].n >= GATE_BASE_N &&
                             g->arm[x][1].rate < g->arm[x][0].rate * GATE_MARGIN;
        if (!smaller_loses) return true;
        g->losing = true;
        if (g->since[b] < g->every[b]) return false;
        g->since[b] = 0;
        g->every[b] = TDM_MIN(g->every[b] * 2, GATE_EXPLORE_MAX);
        return true;
    }
    if (on->rate < off->rate * GATE_MARGIN) { /* drafting loses here: off, exploring rarely */
        g->losing = true;
        if (g->since[b] < g->every[b]) return false;
        g->since[b] = 0;
        g->every[b] = explore_next(g->every[b], off->rate, on->rate);
        return true;
    }
    g->every[b] = GATE_EXPLORE; /* drafting wins: keep the baseline fresh now and then */
    if (g->since[b] >= GATE_REFRESH) {
        g->since[b] = 0;
        return false;
    }
    return true;
}

void tdm_spec_gate_planned(struct tdm_spec_gate *g, bool drafted, int expect_tokens)
{
    g->drafted = drafted;
    g->expect_tokens = expect_tokens;
}

void tdm_spec_gate_time(struct tdm_spec_gate *g, double ns)
{
    g->ns += ns;
}

void tdm_spec_gate_ran(struct tdm_spec_gate *g, int plan_tokens)
{
    /* a step with prefill chunks costs and yields differently: it is not counted; nor is a
     * step whose books mix with another's (a run that no propose opened) */
    g->mixed = !g->open || !g->fresh || plan_tokens != g->expect_tokens;
    g->fresh = false;
}

void tdm_spec_gate_tokens(struct tdm_spec_gate *g, int n)
{
    g->tokens += n;
}
