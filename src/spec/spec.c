/*
 * The speculation object: options, the scheduler's drafter callbacks, and the statistics.
 *
 * Per step (scheduler thread): the scheduler hands over its decoding requests with their caps
 * (propose); the controller lowers each cap to the k it chose (or, with a fixed k, to that);
 * the drafter proposes for those with k > 0. After the commit, each request's decode step
 * reports what was kept (accepted): the statistics and the controller learn. After each run,
 * its time feeds the verify cost model (step_done).
 *
 * Ownership: borrows the target engine; owns the drafter and the scratch. The statistics are
 * under sp->mu (tdm_spec_get_stats from any thread).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "spec/spec_int.h"
#include "tandem/server.h"

static const char *const METHOD_NAMES[] = {"none", "draft", "self", "mtp", "eagle"};
static const char *const ACCEPT_NAMES[] = {"exact", "rejection"};

tdm_status tdm_spec_method_parse(const char *s, enum tdm_spec_method *out)
{
    for (size_t i = 0; s && i < TDM_ARRAY_LEN(METHOD_NAMES); i++)
        if (!strcmp(s, METHOD_NAMES[i])) {
            *out = (enum tdm_spec_method)i;
            return TDM_OK;
        }
    return tdm_err_set(TDM_EINVAL, "--spec takes none, draft, self, mtp or eagle (not '%s')",
                       s ? s : "");
}

const char *tdm_spec_method_name(enum tdm_spec_method m)
{
    return (unsigned)m < TDM_ARRAY_LEN(METHOD_NAMES) ? METHOD_NAMES[m] : "?";
}

tdm_status tdm_spec_accept_parse(const char *s, enum tdm_spec_accept *out)
{
    for (size_t i = 0; s && i < TDM_ARRAY_LEN(ACCEPT_NAMES); i++)
        if (!strcmp(s, ACCEPT_NAMES[i])) {
            *out = (enum tdm_spec_accept)i;
            return TDM_OK;
        }
    return tdm_err_set(TDM_EINVAL, "--spec-accept takes exact or rejection (not '%s')", s ? s : "");
}

const char *tdm_spec_accept_name(enum tdm_spec_accept a)
{
    return (unsigned)a < TDM_ARRAY_LEN(ACCEPT_NAMES) ? ACCEPT_NAMES[a] : "?";
}

tdm_status tdm_spec_k_parse(const char *s, int *k, bool *off)
{
    *off = false;
    if (s && !strcmp(s, "auto")) {
        *k = 0;
        return TDM_OK;
    }
    char *end = NULL;
    long v = s && *s ? strtol(s, &end, 10) : -1;
    if (!s || !*s || *end || v < 0 || v > TDM_SPEC_MAX_K)
        return tdm_err_set(TDM_EINVAL, "--spec-k takes auto or 0 .. %d (not '%s')", TDM_SPEC_MAX_K,
                           s ? s : "");
    *k = (int)v;
    *off = v == 0;
    return TDM_OK;
}

/* ---- the scheduler's drafter ---- */
static void on_propose(void *ctx, struct tdm_sched_draft *d, int n, int base_tokens)
{
    struct tdm_spec *sp = ctx;
    if (sp->dr.tree) {
        /* a tree's size is its budget (the scheduler's cap); k fixed drafts every step (and
         * caps the depth, eagle.c); auto: the gate alone (the per-position model is a
         * chain's) */
        if (sp->o.k == 0 && !tdm_spec_gate_begin(&sp->gate, base_tokens))
            for (int i = 0; i < n; i++)
                d[i].k = 0;
    } else if (sp->o.k > 0) {
        for (int i = 0; i < n; i++)
            d[i].k = TDM_MIN(d[i].k, sp->o.k);
    } else if (tdm_spec_gate_begin(&sp->gate, base_tokens)) {
        tdm_spec_ctl_choose(&sp->ctl, d, n, base_tokens);
    } else {
        for (int i = 0; i < n; i++)
            d[i].k = 0;
    }
    int m = 0;
    tdm_spec_gate_planned(&sp->gate, false, base_tokens);
    pthread_mutex_lock(&sp->mu);
    for (int i = 0; i < n; i++) {
        sp->st.k_hist[TDM_MIN(TDM_MAX(d[i].k, 0), TDM_SPEC_MAX_K)]++;
        if (d[i].k > 0 && m < sp->max_seqs) sp->batch[m++] = d[i];
    }
    pthread_mutex_unlock(&sp->mu);
    if (!m) return;
    sp->dr.propose(sp->dr.ctx, sp, sp->batch, m);
    /* back into the scheduler's array, by request */
    int drafted = 0;
    for (int i = 0, q = 0; i < n && q < m; i++)
        if (d[i].req == sp->batch[q].req) {
            d[i].n = sp->batch[q].n;
            d[i].q = sp->batch[q].q;
            d[i].tree_rejection = sp->batch[q].tree_rejection;
            drafted += d[i].n;
            q++;
        }
    tdm_spec_gate_planned(&sp->gate, drafted > 0, base_tokens + drafted);
}

static void on_accepted(void *ctx, tdm_req_t *r, struct tdm_draft_stats *st, int n_draft,
                        int n_accepted, int n_published)
{
    struct tdm_spec *sp = ctx;
    (void)r;
    /* a tree's record is by depth: n_pos positions were drafted along every path */
    const int n_pos = st->tree_depth > 0 ? st->tree_depth : n_draft;
    tdm_spec_ctl_learn(&sp->ctl, st, n_pos, n_accepted);
    if (sp->dr.accepted) sp->dr.accepted(sp->dr.ctx, st, n_draft, n_accepted);
    tdm_spec_gate_tokens(&sp->gate, n_published);
    pthread_mutex_lock(&sp->mu);
    sp->st.drafted += (uint64_t)n_draft;
    sp->st.accepted += (uint64_t)n_accepted;
    sp->st.target_steps++;
    sp->st.tokens += (uint64_t)n_published;
    if (st->tree_depth > 0) {
        sp->st.tree_steps++;
        sp->st.accepted_other_branch += (uint64_t)st->tree_off_first;
    }
    for (int j = 0; j < n_pos && j < TDM_SPEC_MAX_K; j++) {
        sp->st.drafted_at[j]++;
        sp->st.accepted_at[j] += j < n_accepted;
    }
    sp->st.tau_hist[TDM_MIN(TDM_MAX(n_published, 1), TDM_SPEC_TAU_BUCKETS) - 1]++;
    pthread_mutex_unlock(&sp->mu);
}

static void on_step_done(void *ctx, const struct tdm_sched_plan *plan, uint64_t run_ns)
{
    struct tdm_spec *sp = ctx;
    tdm_spec_cost_observe(&sp->ctl.verify, plan->n_tokens, (double)run_ns);
    double a = 0, b = 0;
    tdm_spec_cost_fit(&sp->ctl.verify, &a, &b);
    pthread_mutex_lock(&sp->mu); /* readers of the statistics see the fit, not the sums */
    sp->st.verify_a_ns = a;
    sp->st.verify_b_ns = b;
    pthread_mutex_unlock(&sp->mu);
    tdm_spec_gate_time(&sp->gate, (double)run_ns);
    tdm_spec_gate_ran(&sp->gate, plan->n_tokens);
}

static void on_feed(void *ctx, const struct tdm_sched_feed *f, int n)
{
    struct tdm_spec *sp = ctx;
    sp->dr.feed(sp->dr.ctx, sp, f, n);
}

static void on_launch(void *ctx, const struct tdm_sched_feed *f, int n)
{
    struct tdm_spec *sp = ctx;
    sp->dr.launch(sp->dr.ctx, sp, f, n);
}

static void on_join(void *ctx)
{
    struct tdm_spec *sp = ctx;
    sp->dr.join(sp->dr.ctx, sp);
}

static int on_kv_len(void *ctx, const void *state)
{
    struct tdm_spec *sp = ctx;
    return sp->dr.kv_len(sp->dr.ctx, state);
}

static bool on_reads_features(void *ctx, const void *state)
{
    struct tdm_spec *sp = ctx;
    return sp->dr.reads_features(sp->dr.ctx, state);
}

void tdm_spec_note_pass(struct tdm_spec *sp, int n_seqs, uint64_t ns)
{
    tdm_spec_cost_observe(&sp->ctl.draft, n_seqs, (double)ns);
    double a = 0, b = 0;
    tdm_spec_cost_fit(&sp->ctl.draft, &a, &b);
    tdm_spec_gate_time(&sp->gate, (double)ns);
    pthread_mutex_lock(&sp->mu);
    sp->st.draft_passes++;
    sp->st.draft_s += (double)ns * 1e-9;
    sp->st.draft_a_ns = a;
    sp->st.draft_b_ns = b;
    pthread_mutex_unlock(&sp->mu);
}

void tdm_spec_note_head_dropped(struct tdm_spec *sp, int rows)
{
    pthread_mutex_lock(&sp->mu);
    sp->st.head_dropped++;
    sp->st.head_rows_skipped += (uint64_t)TDM_MAX(rows, 0);
    pthread_mutex_unlock(&sp->mu);
}

void tdm_spec_note_overlap(struct tdm_spec *sp, int rows, int drafts)
{
    pthread_mutex_lock(&sp->mu);
    sp->st.overlap_rows += (uint64_t)TDM_MAX(rows, 0);
    sp->st.overlap_drafts += (uint64_t)TDM_MAX(drafts, 0);
    pthread_mutex_unlock(&sp->mu);
}

/* ---- the object ---- */
tdm_status tdm_spec_create(tdm_engine_t *target, const struct tdm_spec_opts *o, tdm_spec_t **out)
{
    *out = NULL;
    if (o->k < 0 || o->k > TDM_SPEC_MAX_K)
        return tdm_err_set(TDM_EINVAL, "spec: k must be between 0 (auto) and %d", TDM_SPEC_MAX_K);
    if (o->overlap && o->method != TDM_SPEC_MTP)
        return tdm_err_set(TDM_EINVAL, "spec: the overlapped schedule (--spec-overlap) is for "
                                       "--spec mtp (a chain of the head)");
    switch (o->method) {
    case TDM_SPEC_SELF:
        break;
    case TDM_SPEC_NONE:
        return tdm_err_set(TDM_EINVAL, "spec: no method given");
    case TDM_SPEC_DRAFT:
        break;
    case TDM_SPEC_MTP:
        break;
    case TDM_SPEC_EAGLE:
        break;
    default:
        return tdm_err_set(TDM_EINVAL, "spec: unknown method %d", (int)o->method);
    }
    if (o->accept != TDM_SPEC_ACCEPT_EXACT && o->accept != TDM_SPEC_ACCEPT_REJECTION)
        return tdm_err_set(TDM_EINVAL, "spec: unknown acceptance mode %d", (int)o->accept);
    struct tdm_spec *sp = calloc(1, sizeof *sp);
    if (!sp) return tdm_err_set(TDM_ENOMEM, "spec: out of memory");
    sp->o = *o;
    sp->o.draft_path = NULL; /* not kept: the caller's string */
    sp->target = target;
    sp->n_layers = tdm_engine_model(target)->cfg.n_layers;
    sp->draft_layers = o->draft_model ? o->draft_model->cfg.n_layers : 0;
    sp->max_seqs = tdm_engine_opts(target)->max_seqs;
    pthread_mutex_init(&sp->mu, NULL);
    tdm_status st = tdm_spec_ctl_init(&sp->ctl, sp->max_seqs);
    if (st == TDM_OK && !(sp->batch = calloc((size_t)sp->max_seqs, sizeof *sp->batch)))
        st = tdm_err_set(TDM_ENOMEM, "spec: out of memory");
    if (st == TDM_OK) {
        if (o->method == TDM_SPEC_DRAFT)
            st = tdm_spec_draft_create(target, o->draft_model, o->accept, o->q_one_hot, &sp->dr);
        else if (o->method == TDM_SPEC_MTP)
            /* overlapped, a launched pass takes a verified span's every row: k + 1 */
            st = tdm_spec_mtp_create(target, o->draft_model, o->accept, o->q_one_hot,
                                     o->overlap ? (o->k > 0 ? o->k : TDM_SPEC_AUTO_K) + 1 : 1,
                                     &sp->dr);
        else if (o->method == TDM_SPEC_EAGLE)
            st = tdm_spec_eagle_create(target, o->draft_model, o, &sp->dr);
        else
            st = tdm_spec_self_create(target, o->self_layers, o->accept, o->q_one_hot, &sp->dr);
    }
    sp->iface = (struct tdm_sched_drafter_i){.propose = on_propose,
                                             .accepted = on_accepted,
                                             .step_done = on_step_done,
                                             .feature_dim = sp->dr.feature_dim,
                                             .feed = sp->dr.feed ? on_feed : NULL,
                                             .state_bytes = sp->dr.state_bytes,
                                             .tree = sp->dr.tree,
                                             .kv_scratch = sp->dr.kv_scratch,
                                             .kv_len = sp->dr.kv_len ? on_kv_len : NULL,
                                             .reads_features =
                                                 sp->dr.reads_features ? on_reads_features : NULL};
    if (st == TDM_OK && o->overlap) {
        st = tdm_spec_mtp_overlap(&sp->dr);
        sp->iface.launch = on_launch;
        sp->iface.join = on_join;
    }
    if (st != TDM_OK) {
        tdm_spec_destroy(sp);
        return st;
    }
    *out = sp;
    return TDM_OK;
}

void tdm_spec_destroy(tdm_spec_t *sp)
{
    if (!sp) return;
    if (sp->dr.destroy) sp->dr.destroy(sp->dr.ctx);
    tdm_spec_ctl_free(&sp->ctl);
    free(sp->batch);
    pthread_mutex_destroy(&sp->mu);
    free(sp);
}

/* A tree drafter's node budget (eagle). */
static int tree_budget(const struct tdm_spec_opts *o)
{
    return o->tree_budget > 0 ? o->tree_budget : TDM_SPEC_TREE_BUDGET;
}

tdm_status tdm_spec_attach(tdm_spec_t *sp, tdm_sched_t *s)
{
    if (sp->dr.tree) return tdm_sched_set_drafter(s, &sp->iface, sp, tree_budget(&sp->o));
    return tdm_sched_set_drafter(s, &sp->iface, sp, sp->o.k > 0 ? sp->o.k : TDM_SPEC_AUTO_K);
}

void tdm_spec_describe(const tdm_spec_t *sp, char *buf, size_t cap)
{
    char k[48];
    if (sp->o.k > 0)
        snprintf(k, sizeof k, "k %d (fixed)", sp->o.k);
    else
        snprintf(k, sizeof k, "k auto (at most %d)", TDM_SPEC_AUTO_K);
    if (sp->o.method == TDM_SPEC_DRAFT)
        snprintf(buf, cap, "draft model (%d layers; the target has %d), %s, %s", sp->draft_layers,
                 sp->n_layers, k, tdm_spec_accept_name(sp->o.accept));
    else if (sp->o.method == TDM_SPEC_EAGLE)
        snprintf(buf, cap,
                 "eagle trees of the mtp head (%s layout): budget %d, top-k %d, depth %d%s, %s, "
                 "%s",
                 sp->o.draft_model && sp->o.draft_model->head
                     ? tdm_head_layout_name(sp->o.draft_model->head->layout)
                     : "?",
                 tree_budget(&sp->o), sp->o.tree_topk ? sp->o.tree_topk : TDM_SPEC_TREE_TOPK,
                 sp->o.tree_depth ? sp->o.tree_depth : TDM_SPEC_TREE_DEPTH,
                 sp->o.k > 0 ? " (at most k)" : "", sp->o.k > 0 ? "every step" : "gated",
                 sp->o.accept == TDM_SPEC_ACCEPT_REJECTION ? "multi-draft rejection" : "exact");
    else if (sp->o.method == TDM_SPEC_MTP)
        snprintf(buf, cap, "mtp head (%s layout), chain%s, %s, %s",
                 sp->o.draft_model && sp->o.draft_model->head
                     ? tdm_head_layout_name(sp->o.draft_model->head->layout)
                     : "?",
                 sp->o.overlap ? " launched before each commit (overlap)" : "", k,
                 tdm_spec_accept_name(sp->o.accept));
    else
        snprintf(buf, cap, "%s (%d layers of %d), %s, %s", sp->dr.name,
                 tdm_spec_chain_layers(&sp->dr), sp->n_layers, k,
                 tdm_spec_accept_name(sp->o.accept));
}

void tdm_spec_get_stats(tdm_spec_t *sp, struct tdm_spec_stats *out)
{
    pthread_mutex_lock(&sp->mu);
    *out = sp->st;
    pthread_mutex_unlock(&sp->mu);
    out->tau = out->target_steps ? (double)out->tokens / (double)out->target_steps : 0;
}

int tdm_spec_stats_json(const struct tdm_spec_stats *st, char *buf, size_t cap)
{
    int deepest = 0;
    for (int j = 0; j < TDM_SPEC_MAX_K; j++)
        if (st->drafted_at[j]) deepest = j + 1;
    char pos[TDM_SPEC_MAX_K * 12 + 4];
    size_t n = 0;
    pos[n++] = '[';
    for (int j = 0; j < deepest; j++)
        n += (size_t)snprintf(pos + n, sizeof pos - n, "%s%.4f", j ? "," : "",
                              (double)st->accepted_at[j] / (double)st->drafted_at[j]);
    snprintf(pos + n, sizeof pos - n, "]");
    double tau = st->target_steps ? (double)st->tokens / (double)st->target_steps : 0;
    char tree[320] = ""; /* trees: their steps and the drafts kept off the best guess */
    int t = 0;
    if (st->tree_steps)
        t = snprintf(tree, sizeof tree, ",\"tree_steps\":%llu,\"accepted_other_branch\":%llu",
                     (unsigned long long)st->tree_steps,
                     (unsigned long long)st->accepted_other_branch);
    if (st->overlap_rows) /* the overlap: its passes' rows and the drafts drawn from them */
        t += snprintf(tree + t, sizeof tree - (size_t)t,
                      ",\"overlap_rows\":%llu,\"overlap_drafts\":%llu",
                      (unsigned long long)st->overlap_rows, (unsigned long long)st->overlap_drafts);
    if (st->head_dropped) /* a head the gate kept off: requests dropped, head rows never run */
        snprintf(tree + t, sizeof tree - (size_t)t,
                 ",\"head_dropped\":%llu,\"head_rows_skipped\":%llu",
                 (unsigned long long)st->head_dropped, (unsigned long long)st->head_rows_skipped);
    return snprintf(buf, cap,
                    "{\"drafted\":%llu,\"accepted\":%llu,\"target_steps\":%llu,\"tokens\":%llu,"
                    "\"tau\":%.4f,\"accept_by_position\":%s%s}",
                    (unsigned long long)st->drafted, (unsigned long long)st->accepted,
                    (unsigned long long)st->target_steps, (unsigned long long)st->tokens, tau, pos,
                    tree);
}

/* A histogram of small counts (bounds 1, 2, ... or 0, 1, ...) from a table of counts. */
static void counts_hist(struct tdm_hist *h, const uint64_t *counts, int n, int first)
{
    *h = (struct tdm_hist){.n_buckets = TDM_MIN(n, TDM_HIST_MAX_BUCKETS)};
    for (int i = 0; i < h->n_buckets; i++) {
        h->bounds[i] = first + i;
        h->counts[i] = counts[i];
        h->n += counts[i];
        h->sum += (double)counts[i] * (first + i);
    }
}

char *tdm_spec_metrics(void *ctx)
{
    struct tdm_spec_stats st;
    tdm_spec_get_stats(ctx, &st);
    struct tdm_sbuf b = {0};
    char lab[48];
    tdm_prom_scalar(&b, "tandem_spec_drafted_tokens_total", "counter",
                    "Tokens proposed by the drafter.", NULL, (double)st.drafted);
    tdm_prom_scalar(&b, "tandem_spec_accepted_tokens_total", "counter",
                    "Drafted tokens the target kept.", NULL, (double)st.accepted);
    tdm_prom_family(&b, "tandem_spec_drafted_by_position_total", "counter",
                    "Drafted tokens by their position in the draft (0 is the first).");
    for (int j = 0; j < TDM_SPEC_MAX_K; j++) {
        snprintf(lab, sizeof lab, "position=\"%d\"", j);
        tdm_prom_sample(&b, "tandem_spec_drafted_by_position_total", lab, (double)st.drafted_at[j]);
    }
    tdm_prom_family(&b, "tandem_spec_accepted_by_position_total", "counter",
                    "Kept drafted tokens by their position in the draft.");
    for (int j = 0; j < TDM_SPEC_MAX_K; j++) {
        snprintf(lab, sizeof lab, "position=\"%d\"", j);
        tdm_prom_sample(&b, "tandem_spec_accepted_by_position_total", lab,
                        (double)st.accepted_at[j]);
    }
    struct tdm_hist h;
    counts_hist(&h, st.tau_hist, TDM_SPEC_TAU_BUCKETS, 1);
    tdm_hist_prom(&b, "tandem_spec_tokens_per_step",
                  "Tokens a request's decode step published (tau's distribution).", &h, NULL);
    counts_hist(&h, st.k_hist, TDM_SPEC_MAX_K + 1, 0);
    tdm_hist_prom(&b, "tandem_spec_k_chosen", "Drafts chosen for a request's decode step.", &h,
                  NULL);
    tdm_prom_scalar(&b, "tandem_spec_overlap_rows_total", "counter",
                    "Rows the head ran in passes launched before the commit (--spec-overlap).",
                    NULL, (double)st.overlap_rows);
    tdm_prom_scalar(&b, "tandem_spec_overlap_drafts_total", "counter",
                    "First drafts drawn from a launched pass's rows (--spec-overlap).", NULL,
                    (double)st.overlap_drafts);
    tdm_prom_scalar(&b, "tandem_spec_head_dropped_total", "counter",
                    "Requests whose head state was dropped while the gate kept drafting off "
                    "(--spec-k auto); they draft no more.",
                    NULL, (double)st.head_dropped);
    tdm_prom_scalar(&b, "tandem_spec_head_rows_skipped_total", "counter",
                    "Target feature rows a head parked and never ran (dropped requests).", NULL,
                    (double)st.head_rows_skipped);
    tdm_prom_scalar(&b, "tandem_spec_tree_steps_total", "counter",
                    "Decode steps that verified a token tree (eagle).", NULL,
                    (double)st.tree_steps);
    tdm_prom_scalar(&b, "tandem_spec_accepted_other_branch_total", "counter",
                    "Kept tree drafts that were not their parent's first child.", NULL,
                    (double)st.accepted_other_branch);
    tdm_prom_scalar(&b, "tandem_spec_draft_seconds_total", "counter",
                    "Time in draft forward passes.", NULL, st.draft_s);
    tdm_prom_family(
        &b, "tandem_spec_cost_seconds", "gauge",
        "The controller's cost models: seconds = a + b * x (part verify: x is the step's "
        "tokens; part draft: x is the drafting requests).");
    tdm_prom_sample(&b, "tandem_spec_cost_seconds", "part=\"verify\",term=\"a\"",
                    st.verify_a_ns * 1e-9);
    tdm_prom_sample(&b, "tandem_spec_cost_seconds", "part=\"verify\",term=\"b\"",
                    st.verify_b_ns * 1e-9);
    tdm_prom_sample(&b, "tandem_spec_cost_seconds", "part=\"draft\",term=\"a\"",
                    st.draft_a_ns * 1e-9);
    tdm_prom_sample(&b, "tandem_spec_cost_seconds", "part=\"draft\",term=\"b\"",
                    st.draft_b_ns * 1e-9);
    return tdm_sbuf_take(&b);
}
