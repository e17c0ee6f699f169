/*
 * The engine: validates a batch, flattens it into a tdm_step (tokens, positions, KV slots, page
 * tables), and runs the architecture's op sequence on the backend.
 *
 * One layer (llama, qwen2, qwen3; qwen2 adds q/k/v biases, qwen3 a per-head RMSNorm of q and k):
 *
 *   h = rmsnorm(x, attn_norm)                      (fused into the previous layer's last add)
 *   q, k, v = h Wq (+bq), h Wk (+bk), h Wv (+bv)     (one matmul_multi)
 *   q, k = head_rmsnorm(q), head_rmsnorm(k)        (qwen3)
 *   rope(q, k); append k, v to the paged KV cache at each token's slot
 *   a = attention(q, KV) ; o = a Wo               -> layer counter = layer + 1
 *   x += o ; h = rmsnorm(x, ffn_norm)
 *   x += (silu(h Wgate) * (h Wup)) Wdown ; h = rmsnorm(x, next layer's attn_norm or output_norm)
 *                                                  (the bracket is one matmul_swiglu)
 *
 * A sparse layer (mixture of experts, model.h) replaces the bracket: the router's logits h Wr
 * come to the host, each row keeps its top n_experts_used experts by softmax probability
 * (renormalised when the config says so), and then, expert by expert in id order, the rows
 * routed to it are gathered, run through its SwiGLU FFN, and added into the layer's output
 * scaled by their weights. So one pass over each active expert's weights per step, and a row's
 * sum is made in the same order whatever else shares the batch. A shared expert (qwen2_moe)
 * then runs on every row, scaled by sigmoid(h . its gate) (DeepSeek's: unscaled). DeepSeek's
 * routers (sigmoid scores, a correction bias, expert groups, a scaling factor) choose the same
 * way on the host (moe_route).
 *
 * Multi-head latent attention (DeepSeek; mla_attention) replaces q/k/v, rope, attention and
 * the output projection:
 *   q = h Wq, or rmsnorm(h Wq_a) Wq_b      [T][H][nope + rope]
 *   c = rmsnorm(h Wkv_c) ; kr = h Wkv_r     (one matmul_multi)
 *   qa = head_matmul(absorb, q)             [T][H][kv_lora + rope]: q_nope in the latent space
 *   rope(qa's rope part, kr); append the row [c ; kr] (a latent layer: K rows only)
 *   a = attention(qa, rows; values = each row's c)   [T][H][kv_lora]
 *   o = head_matmul(uv, a) Wo               -> layer counter = layer + 1
 *
 * Logits are computed only for the rows that asked for them (gathered after the final norm).
 *
 * A speculation head (model.h, struct tdm_head) replaces the embedding with its input stage:
 *   x = enorm(embed(tokens)) fc_e + hnorm(hidden) fc_h (+ fc_bias)   (hidden: the batch's)
 * then runs its one layer like any other; a missing input norm on that layer (EAGLE) feeds x
 * to the q/k/v projections as it is, a missing final norm gives the LM head x itself.
 *
 * A head with a reduced draft vocabulary (its d2t map) has an LM head of those rows only: its
 * logits are placed in the vocabulary's columns, -inf elsewhere (scatter_cols), so the
 * samplers see a whole-vocabulary row whatever the head.
 *
 * Features: a sequence with a features buffer gets every token's final-normed hidden state
 * (downloaded after the layer loop), which is what a head reads as h. An engine with
 * feature_layers (an EAGLE-3 head's target) copies the residual stream entering each of those
 * layers in the layer loop (aux: zero, then add: the same bits) and gives their concatenation
 * instead, interleaved per token on the host.
 *
 * An EAGLE-3 head (model.h) has an input stage of its own (eagle3_input): the fused target
 * feature through fc (3d -> d), or, on a step whose hidden states are its own (own_hidden),
 * those states as they are, uploaded straight into the residual x; then its layer's q/k/v read
 * [enorm(embed) ; hnorm(x)] as two products, one per half of their columns, summed (no
 * concatenated buffer), and the residual is x. Its features are x before the final norm. The
 * two kinds of step record different graphs on CUDA (owner e and e + 1).
 *
 * Memory: activation scratch is reserved at creation for max_batch_tokens rows in backend
 * memory; per-step metadata comes from a host arena reset every call. Nothing is allocated on
 * the forward path. A backend with a `reserve` hook (CUDA) reserves its own workspace after the
 * scratch and sizes the KV pool from its memory plan when kv_pages and kv_bytes are 0.
 *
 * Backend step hooks (optional, backend.h): step_begin sees every step before its ops (the CUDA
 * backend uploads the metadata once, and for a decode step pads it to a graph bucket and either
 * replays the recorded layer loop or starts recording it); step_end closes a recording. The
 * logits part (gather, LM head, download) always runs op by op.
 *
 * Tensor parallelism (opts.tp = N > 1; tp.h, DESIGN.md §5): the engine the caller holds is
 * rank 0's, the leader, and it owns N - 1 more rank engines, each created like any engine over
 * its rank's view of the model (shard.c: its query and KV heads, its MLP columns) with its own
 * backend (CPU, or CUDA on GPU r modulo the GPUs present) and its own KV pool of the same page
 * count (on CUDA without a size: each rank's memory plan, then the smallest; same_page_count).
 * Every rank runs the same layer loop (run_layers) on its shapes; after the output projection and
 * after the down projection the ranks sum their partial products (tdm_tp_allreduce), so every rank
 * holds the whole residual stream. A step goes like this:
 *
 *   leader (caller's thread)               rank r > 0 (its own thread)
 *   build_step (validates; arena)          waits at the start barrier
 *   step header into tp->step, barrier -->  copies it (arrays: the leader's arena)
 *   run_layers  <- all-reduce x 2 a layer -> run_layers
 *   lm_head: its vocabulary rows      <--> lm_head: its vocabulary rows, into the leader's
 *   (barrier: every rank's rows are in)    logits; barrier; back to the start barrier
 *   sampling, downloads
 *
 * CUDA ranks (backend.h, tdm_cuda_tp_create) differ in three places: each rank runs its own
 * backend's step hooks on its copy of the step (its metadata upload, its graph: recorded or
 * replayed by every rank alike, since they see the same steps), so the step is handed over
 * before the leader's step_begin pads its own; the all-reduce is the backend's hook (NCCL in
 * the graphs, or the peer sum between host barriers without graphs); and the LM head's rows
 * reach the leader's device logits by peer copies ordered by events (lm_open, lm_put,
 * lm_close), not by stores into host memory. A step hook failing once the ranks run the step
 * is fatal (tp_fatal): the others wait on its collectives.
 *
 * Every step ends at a barrier (lm_head's, or one of its own when no row wants logits): the
 * step's arrays are read by the ranks only before it, and after it no rank touches its
 * backend until the next step, so the caller may use them (tdm_kv_pool_copy_slots). The page
 * accounting is the leader's pool's; the other pools hold their heads at the same page ids
 * (tdm_kv_pool_add_shard: slot copies reach them). The embedding stays whole: every rank embeds
 * (row lookups in the shared table). The LM head is sharded by vocabulary: no sum, so each logit is
 * the one a whole LM head computes from the same final-normed row; only the leader samples.
 *
 * A speculation head beside a sharded target (tdm_engine_opts.shard_like; an MTP chain's or
 * EAGLE's head) is sharded like it: each rank a view of the head's layer (its query and KV
 * heads, its MLP columns, the same two all-reduces) over its share of the head's KV heads,
 * which the target made layer group 1 of that rank's pool (replica sets when the ranks
 * outnumber the head's KV heads, by the target's rules: tdm_tp_shard_of on the head's own
 * config). Rank r of the head borrows rank r of the target's backend and pool, and the
 * target's rank threads run its steps: the leader names whose step it hands over (job) before
 * the start barrier, so the two engines share one barrier, one all-reduce staging and one
 * thread a rank, and never run at once (one caller thread drives both). The input stage
 *   x = enorm(embed) fc_e + hnorm(hidden) fc_h
 * is replicated, not sharded: its output is the residual stream, which every rank holds whole
 * anyway, so each rank computes it from its own copy of the hidden states (no barrier, and x
 * the bits of TP = 1's); it is a d x 2d product against the layer's attention and MLP, and the
 * CPU's weights are the model's own (no copy). Its norms are per row, whole. The head's LM head
 * is split by rows like the target's; a reduced draft vocabulary (d2t) splits its draft rows,
 * each rank writing its columns of the leader's draft logits, which the leader places in the
 * vocabulary (scatter_cols) after the barrier. A draft model is no head: it runs whole on the
 * leader's backend, its KV group whole in the leader's pool.
 *
 * An EAGLE-3 head shards the same way. Its input stage x = fc(feature) (3d -> d, or its own
 * state on a deeper draft) and the norms of its two q/k/v inputs are replicated like the
 * others': every rank gets a copy of the fused features (eagle3_upload), which the leader's
 * target engine copied from its residual stream, whole on every rank after the all-reduces
 * (the target's other ranks copy none). Its q/k/v are two products, of the embedding's
 * columns and of the feature's (eagle3_qkv), both split by the rank's rows (shard.c), so
 * each rank projects its own heads from whole inputs, with no sum. Its features (x before the
 * final norm) are the leader's whole x.
 *
 * Threading: one thread calls tdm_engine_forward at a time (a sharded engine's rank 0).
 */
#include "tandem/engine.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_int.h"
#include "tandem/tp.h"

#define DEFAULT_PAGE_SIZE        16
#define DEFAULT_MAX_BATCH_TOKENS 512
#define DEFAULT_MAX_SEQS         64
#define DEFAULT_KV_CAP_BYTES     ((size_t)4 << 30)

struct tdm_engine {
    const struct tdm_model *model;
    struct tdm_engine_opts opts;
    tdm_backend_t *backend;
    bool owns_backend;
    tdm_kv_pool_t *kv;
    bool owns_kv;
    int kv_group; /* the pool's layer group that holds this model's layers */
    struct tdm_model_config cfg;
    /* weights as the backend holds them */
    struct tdm_weight tok_embd, output_norm, output;
    struct tdm_layer_weights *layers; /* [n_layers] */
    struct tdm_head head;             /* a head model's input stage */
    bool is_head;
    float *inv_freq; /* [head_dim/2], host */
    /* activation scratch: typed buffers of the backend (act), and the views the ops take */
    struct tdm_buf act[32];
    int n_act;
    float *x;       /* [max_tokens][d_model] residual stream */
    float *h;       /* [max_tokens][d_model] normed input of the next matmul */
    float *q;       /* [max_tokens][n_heads*head_dim] */
    float *k;       /* [max_tokens][n_kv_heads*head_dim] */
    float *v;       /* [max_tokens][n_kv_heads*head_dim] */
    float *att;     /* [max_tokens][n_heads*head_dim] */
    float *o;       /* [max_tokens][d_model] */
    float *gate;    /* [max_tokens][d_ff] silu(gate) * up */
    float *rows;    /* [max_logit_rows][d_model] gathered final-normed rows */
    float *logits;  /* [max_logit_rows][vocab] */
    float *hin;     /* a head: [max_tokens][d_model] the hidden states it was given */
    float *hin2;    /* a head: [max_tokens][d_model] scratch of its input stage */
    float *k2, *v2; /* an EAGLE-3 head: [max_tokens][n_kv_heads*head_dim], the k/v products of
                     * the hidden half of its columns (q's go to att); hin is then
                     * [max_tokens][feature_width] */
    bool own_step;  /* an EAGLE-3 head: this step's hidden states are its own (no fc) */
    /* opts.feature_layers: [n][max_tokens][d_model] the residual entering each such layer,
     * and a host block [max_tokens][d_model] to interleave them per token */
    float *aux[TDM_HEAD_MAX_AUX];
    float *aux_host;
    /* experts: the router's logits [max_tokens][n_experts], an expert's gathered input rows
     * and output rows [max_tokens][d_model]; host: the logits, each row's choices, and the
     * rows by expert (counting sort) */
    float *moe_logits, *moe_in, *moe_out;
    float *moe_host_logits, *moe_selw, *moe_wts;
    float *moe_score, *moe_gscore; /* host [n_experts]: one row's scores and group scores */
    int32_t *moe_sel, *moe_rows, *moe_off;
    /* MLA: the absorbed queries [max_tokens][n_heads][head_dim], the normed latent
     * [max_tokens][kv_lora], the q LoRA's output and its norm [max_tokens][q_lora], the
     * heads' values [max_tokens][n_heads * v_head_dim] */
    float *mla_q, *mla_c, *mla_qa, *mla_qn, *mla_v;
    uint8_t *moe_taken;              /* [n_experts] one row's chosen experts, while routing */
    _Atomic uint64_t *expert_tokens; /* [n_experts] assignments run, all layers */
    _Atomic uint64_t expert_passes;  /* active experts run, all layers and steps */
    /* a head with a reduced draft vocabulary: its logits [max_logit_rows][n_draft], placed in
     * the vocabulary's columns (draft_cols: [n_draft] target ids, backend memory) */
    float *draft_logits;
    struct tdm_buf draft_cols;
    int n_draft;
    struct tdm_arena arena; /* per-step metadata, host */
    bool device_sampling;   /* the backend's sample hook takes this vocabulary */
    /* forward_sample without device sampling: the host sampler's scratch, and a host copy of
     * the logits when they live in device memory (a hook that refused the vocabulary) */
    struct tdm_sample_scratch sample_scratch;
    float *host_logits;
    /* device sampling of a step whose rows do not all sample: those rows are drawn greedily
     * (cheap) from a copy of the row list, and their results dropped */
    struct tdm_sampler greedy;
    struct tdm_sample_row *dev_rows; /* [max_logit_rows] */
    /* launched steps not waited yet (tdm_engine_launch), oldest first: their rows, and the
     * backend's ticket (queued) or the status of a step that ran whole */
    struct engine_pend {
        struct tdm_sample_row *samples;
        const uint8_t *want;
        int n_rows, ticket;
        uint8_t every;
        bool queue;   /* its sampling may be queued on the backend (queueable) */
        bool sampled; /* its sampling is queued or done (tdm_engine_launch_sample) */
        bool queued;  /* ... queued: the wait collects it by its ticket */
        tdm_status st;
    } pend[2];
    int n_pend;
    /* the step of the forward pass in progress (a launched one's stays until its sampling:
     * the backend may still hold it) */
    struct tdm_step step;
    /* the last step whose every row sampled, for TDM_TOKEN_PREV: its row count (0: none), and
     * its tokens by row when they are on the host (prev_tok; else on the backend) */
    int prev_rows;
    bool prev_on_host;
    int32_t *prev_tok;           /* [max_logit_rows] */
    _Atomic int32_t own_counter; /* the layer counter where the backend has none */
    _Atomic int32_t *counter;    /* count_layers: own_counter or the backend's */
    /* tensor parallelism: this engine is rank `rank` of the group tp (NULL: not sharded);
     * tpx is shared by the ranks and owned by the leader (rank 0) */
    tdm_tp_group_t *tp;
    int rank;
    struct engine_tp *tpx;
};

/* A sharded engine's ranks (the leader's; see the top of this file). A head's engine beside a
 * sharded target has one of its own (its views and rank engines) whose group and threads are
 * the target's (host). */
struct engine_tp {
    int n_ranks;
    tdm_tp_group_t *group;  /* the host's, for a head beside it */
    struct engine_tp *host; /* the target's, whose rank threads run this one; NULL: its own */
    struct engine_tp *job;  /* threads' owner only: whose step the ranks run next (it or a
                             * head beside it), set by that leader before the start barrier */
    struct tdm_model *views[TDM_TP_MAX_RANKS]; /* each rank's model view (shard.c) */
    tdm_engine_t *ranks[TDM_TP_MAX_RANKS];     /* [0]: the leader itself */
    pthread_t threads[TDM_TP_MAX_RANKS];       /* [r]: rank r's, r >= 1, if started */
    bool started[TDM_TP_MAX_RANKS];
    /* CUDA ranks (one backend a rank, on its device; backend.h, tdm_cuda_tp_create): each rank
     * runs its backend's step hooks itself (metadata, graphs), the all-reduce is the backend's
     * hook, and the LM head's rows travel by peer copies; ctp is the threads' owner's */
    bool cuda;
    tdm_cuda_tp_t *ctp;
    /* the step handed over at the start barrier (the leader writes, the ranks read after it),
     * a copy taken before the leader's step_begin may pad its own */
    struct tdm_step step;
    int n_layers;
    const int32_t *rows; /* the step's logit rows (token indices), and whether any is wanted */
    int n_rows;
    bool lm_head;
    bool stop; /* the ranks leave at the next start barrier */
    /* the LM head by vocabulary: rank r's rows start at vocab0[r] (a head with a reduced
     * draft vocabulary: its draft rows, placed by the leader); the leader's part of a step of
     * several rows goes through lm_part ([max_logit_rows][its rows], its backend's) */
    int64_t vocab0[TDM_TP_MAX_RANKS];
    struct tdm_buf lm_part;
    /* a rank thread waits here until every rank has started (launched) or creation failed
     * (stop), so that a failed start never leaves a rank at a barrier short of ranks */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool launched;
};

/* One activation buffer of the backend, kept typed in e->act; NULL once *st is an error. */
static float *balloc(tdm_engine_t *e, size_t bytes, tdm_status *st)
{
    if (*st != TDM_OK) return NULL;
    TDM_ASSERT(e->n_act < (int)TDM_ARRAY_LEN(e->act));
    struct tdm_buf *b = &e->act[e->n_act];
    if ((*st = tdm_backend_buf_new(e->backend, bytes, "engine scratch", b)) != TDM_OK) return NULL;
    e->n_act++;
    return b->ptr;
}

/* Releases the activation scratch (what a failed creation made of it too). */
static void free_scratch(tdm_engine_t *e)
{
    for (int i = 0; i < e->n_act; i++)
        tdm_backend_buf_release(e->backend, &e->act[i]);
    e->n_act = 0;
    free(e->moe_host_logits);
    free(e->moe_selw);
    free(e->moe_wts);
    free(e->moe_sel);
    free(e->moe_rows);
    free(e->moe_off);
    free(e->moe_taken);
    free(e->moe_score);
    free(e->moe_gscore);
    e->moe_score = e->moe_gscore = NULL;
    e->moe_taken = NULL;
    free((void *)e->expert_tokens);
    e->expert_tokens = NULL;
    e->moe_host_logits = e->moe_selw = e->moe_wts = NULL;
    e->moe_sel = e->moe_rows = e->moe_off = NULL;
    tdm_backend_buf_release(e->backend, &e->draft_cols);
    free(e->aux_host);
    e->aux_host = NULL;
}

/* The engine's layer array and its experts' arrays (safe on a partly built one). */
static void free_layers(tdm_engine_t *e)
{
    for (int l = 0; e->layers && l < e->cfg.n_layers; l++)
        free(e->layers[l].experts);
    free(e->layers);
    e->layers = NULL;
}

/* The best of n values not yet taken (ties to the lower index; a NaN never beats a number). */
static int best_untaken(const float *v, int n, const uint8_t *taken)
{
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (taken[i]) continue;
        if (best < 0 || v[i] > v[best] || (v[best] != v[best] && v[i] == v[i])) best = i;
    }
    return best;
}

/* A sparse layer's routing, on the host, for each of T rows of E router logits (model.h):
 *   scores: softmax over the row (in double; a NaN logit scores 0), or sigmoid per expert;
 *   choice: the top k by score + bias (bias: the layer's correction, or NULL), among the
 *           moe_topk_group best groups when the config has groups (a group's worth: its best
 *           value, or the sum of its best two); ties to the lower id, a NaN never wins;
 *   weights: the chosen scores, renormalised to sum 1 when moe_norm_topk, times
 *            moe_routed_scale.
 * sel, selw: [T][k]. taken: [E], score, gscore: [E] scratch. */
static void moe_route(const struct tdm_model_config *c, const float *logits, const float *bias,
                      int T, int E, int32_t *sel, float *selw, uint8_t *taken, float *score,
                      float *gscore)
{
    const int k = c->n_experts_used, ng = c->moe_n_group;
    const bool sigmoid = c->moe_scoring == TDM_MOE_SIGMOID;
    if (E <= 0 || k <= 0 || k > E) return; /* the config checks rule these out */
    for (int t = 0; t < T; t++) {
        const float *z = logits + (size_t)t * E;
        float mx = -INFINITY;
        double sum = 0;
        if (!sigmoid) {
            for (int i = 0; i < E; i++)
                if (z[i] > mx) mx = z[i];
            for (int i = 0; i < E; i++)
                sum += z[i] == z[i] && isfinite(mx) ? exp((double)z[i] - mx) : 0.0;
        }
        /* what the choice compares: the logits themselves where that is the same order
         * (softmax, no bias, no group summing its best two), else score + bias */
        const float *v = z;
        if (sigmoid || bias || (ng > 0 && c->moe_group_top2)) {
            for (int i = 0; i < E; i++) {
                double p = sigmoid                   ? 1.0 / (1.0 + exp(-(double)z[i]))
                           : sum > 0 && z[i] == z[i] ? exp((double)z[i] - mx) / sum
                                                     : 0.0;
                score[i] = z[i] == z[i] ? (float)p + (bias ? bias[i] : 0.0f) : NAN;
            }
            v = score;
        }
        memset(taken, 0, (size_t)E);
        if (ng > 0) { /* keep the best groups: the others' experts count as taken */
            const int gs = E / ng;
            for (int g = 0; g < ng; g++) {
                const float *gv = v + (size_t)g * gs;
                int b1 = best_untaken(gv, gs, taken + (size_t)g * gs);
                float worth = gv[b1];
                if (c->moe_group_top2) {
                    taken[g * gs + b1] = 1;
                    worth += gv[best_untaken(gv, gs, taken + (size_t)g * gs)];
                    taken[g * gs + b1] = 0;
                }
                gscore[g] = worth;
            }
            uint8_t *gtaken = taken + E - ng; /* borrowed: reset below */
            uint8_t keep[1024];
            memset(keep, 0, (size_t)ng);
            memset(gtaken, 0, (size_t)ng);
            for (int j = 0; j < c->moe_topk_group; j++) {
                int g = best_untaken(gscore, ng, gtaken);
                gtaken[g] = 1;
                keep[g] = 1;
            }
            for (int i = 0; i < E; i++)
                taken[i] = !keep[i / gs];
        }
        int32_t *s = sel + (size_t)t * k;
        float *w = selw + (size_t)t * k;
        double kept = 0;
        for (int j = 0; j < k; j++) { /* k passes over E: k is small (at most 8 or so) */
            int best = best_untaken(v, E, taken);
            taken[best] = 1;
            s[j] = best;
            double p = sigmoid                         ? 1.0 / (1.0 + exp(-(double)z[best]))
                       : sum > 0 && z[best] == z[best] ? exp((double)z[best] - mx) / sum
                                                       : 0.0;
            if (p != p) p = 0.0;
            w[j] = (float)p;
            kept += (float)p;
        }
        if (c->moe_norm_topk && kept > 0)
            for (int j = 0; j < k; j++)
                w[j] = (float)(w[j] / kept);
        if (c->moe_routed_scale != 1.0f)
            for (int j = 0; j < k; j++)
                w[j] *= c->moe_routed_scale;
    }
}

/* A sparse layer's FFN: h [T][d] (normed) -> o [T][d]. */
static void moe_ffn(tdm_engine_t *e, int l, int T)
{
    const struct tdm_layer_weights *w = &e->layers[l];
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_model_config *c = &e->cfg;
    int E = w->n_experts, k = c->n_experts_used, d = c->d_model;
    ops->matmul(b, &w->router, e->h, T, NULL, e->moe_logits);
    ops->download(b, e->moe_host_logits, e->moe_logits, (size_t)T * E * sizeof(float));
    const float *bias = e->model->layers[l].router_bias.data; /* host memory: the model's */
    moe_route(c, e->moe_host_logits, bias, T, E, e->moe_sel, e->moe_selw, e->moe_taken,
              e->moe_score, e->moe_gscore);
    /* rows by expert, in row order (a counting sort) */
    int32_t *off = e->moe_off;
    memset(off, 0, sizeof(int32_t) * (size_t)(E + 1));
    for (int i = 0; i < T * k; i++)
        off[e->moe_sel[i] + 1]++;
    for (int x = 0; x < E; x++)
        off[x + 1] += off[x];
    for (int i = 0; i < T * k; i++) { /* one pass: off[x] advances; restored below */
        int x = e->moe_sel[i];
        e->moe_rows[off[x]] = i / k;
        e->moe_wts[off[x]++] = e->moe_selw[i];
    }
    for (int x = E; x > 0; x--) /* off[x - 1] now ends expert x - 1: shift back */
        off[x] = off[x - 1];
    off[0] = 0;
    ops->zero(b, e->o, (size_t)T * d);
    for (int x = 0; x < E; x++) {
        int n = off[x + 1] - off[x];
        if (!n) continue;
        atomic_fetch_add_explicit(&e->expert_tokens[x], (uint64_t)n, memory_order_relaxed);
        atomic_fetch_add_explicit(&e->expert_passes, 1, memory_order_relaxed);
        const struct tdm_weight *ew = &w->experts[3 * x];
        ops->gather_rows(b, e->h, e->moe_rows + off[x], n, d, e->moe_in);
        ops->matmul_swiglu(b, &ew[0], &ew[1], e->moe_in, n, e->gate);
        ops->matmul(b, &ew[2], e->gate, n, NULL, e->moe_out);
        ops->rows_scale_add(b, e->moe_out, e->moe_rows + off[x], e->moe_wts + off[x], n, d, e->o);
    }
    if (!w->sh_gate.data) return;
    /* the shared expert, every row, after the routed sum: scaled by sigmoid(h . its gate)
     * where it has one (qwen2_moe), else as it is (DeepSeek) */
    ops->matmul_swiglu(b, &w->sh_gate, &w->sh_up, e->h, T, e->gate);
    ops->matmul(b, &w->sh_down, e->gate, T, NULL, e->moe_out);
    if (!w->sh_score.data) {
        ops->add(b, e->o, e->moe_out, (size_t)T * d);
        return;
    }
    ops->matmul(b, &w->sh_score, e->h, T, NULL, e->moe_logits);
    ops->download(b, e->moe_host_logits, e->moe_logits, (size_t)T * sizeof(float));
    for (int t = 0; t < T; t++) {
        e->moe_rows[t] = t;
        e->moe_wts[t] = (float)(1.0 / (1.0 + exp(-(double)e->moe_host_logits[t])));
    }
    ops->rows_scale_add(b, e->moe_out, e->moe_rows, e->moe_wts, T, d, e->o);
}

/* YaRN's correction dimension for a number of rotations (DeepSeek's yarn_find_correction_dim). */
static double yarn_dim(double rotations, int dim, double base, int max_pos)
{
    return dim * log(max_pos / (rotations * 2.0 * M_PI)) / (2.0 * log(base));
}

/* MLA's attention (model.h), absorbed: the queries taken to the latent space per head, the
 * latent and the rope key appended as one cached row, attention over those rows (values: the
 * latents), the heads' values by their up-projection, then the output projection into e->o. */
static void mla_attention(tdm_engine_t *e, const struct tdm_layer_weights *w, const float *in,
                          const struct tdm_step *st, const struct tdm_rope *rope,
                          const struct tdm_kv_layer *kv, float scale, int T, int qh)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_model_config *c = &e->cfg;
    const size_t H = (size_t)c->n_heads, dk = (size_t)c->head_dim, lora = (size_t)c->kv_lora_rank;
    const size_t v = (size_t)c->v_head_dim;
    struct tdm_matmul_part parts[3] = {{&w->wkv_c, NULL, e->k}, {&w->wkv_r, NULL, e->v}};
    int n_parts = 2;
    if (w->wq_a.data) { /* q through its LoRA */
        ops->matmul(b, &w->wq_a, in, T, NULL, e->mla_qa);
        ops->rmsnorm(b, e->mla_qa, w->q_a_norm.data, c->rms_eps, T, c->q_lora_rank, e->mla_qn);
        ops->matmul(b, &w->wq_b, e->mla_qn, T, NULL, e->q);
    } else {
        parts[n_parts++] = (struct tdm_matmul_part){&w->wq, NULL, e->q};
    }
    ops->matmul_multi(b, in, T, parts, n_parts);
    ops->rmsnorm(b, e->k, w->kv_a_norm.data, c->rms_eps, T, (int)lora, e->mla_c);
    ops->head_matmul(b, &w->mla_absorb, (int)H, e->q, T, H * (size_t)qh, (size_t)qh, e->mla_q,
                     H * dk, dk);
    ops->rope_kv_append(b, e->mla_q, e->mla_c, e->v, (int)H, st, rope, kv);
    ops->attention(b, e->mla_q, (int)H, st, kv, scale, e->att);
    ops->head_matmul(b, &w->mla_uv, (int)H, e->att, T, H * lora, lora, e->mla_v, H * v, v);
    ops->matmul(b, &w->wo, e->mla_v, T, NULL, e->o);
}

void tdm_rope_inv_freq(const struct tdm_model_config *cfg, const float *rope_freqs, float *out)
{
    const int dim = tdm_config_rope_dim(cfg), half = dim / 2;
    /* YaRN: frequencies between the correction dimensions low and high blend the
     * interpolated (f / factor) and the original ones along a linear ramp */
    double lo = 0, hi = 0;
    if (cfg->rope_scaling == TDM_ROPE_SCALING_YARN) {
        lo = floor(yarn_dim(cfg->rope_beta_fast, dim, cfg->rope_theta, cfg->rope_original_max_ctx));
        hi = ceil(yarn_dim(cfg->rope_beta_slow, dim, cfg->rope_theta, cfg->rope_original_max_ctx));
        lo = TDM_MAX(lo, 0.0);
        hi = TDM_MIN(hi, dim - 1.0);
        if (lo == hi) hi += 0.001;
    }
    for (int i = 0; i < half; i++) {
        double f = 1.0 / pow((double)cfg->rope_theta, (double)(2 * i) / dim);
        if (cfg->rope_scaling == TDM_ROPE_SCALING_YARN) {
            double ramp = TDM_MIN(TDM_MAX((i - lo) / (hi - lo), 0.0), 1.0);
            double extra = 1.0 - ramp; /* 1: keep the original frequency */
            f = f / cfg->rope_factor * (1.0 - extra) + f * extra;
        } else if (rope_freqs) {
            f /= rope_freqs[i];
        } else if (cfg->rope_scaling == TDM_ROPE_SCALING_LINEAR) {
            f /= cfg->rope_factor;
        } else if (cfg->rope_scaling == TDM_ROPE_SCALING_LLAMA3) {
            /* Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
             * between interpolated smoothly. */
            double old_ctx = cfg->rope_original_max_ctx;
            double lo = cfg->rope_low_freq_factor, hi = cfg->rope_high_freq_factor;
            double wavelen = 2.0 * M_PI / f;
            if (wavelen > old_ctx / lo) {
                f /= cfg->rope_factor;
            } else if (wavelen >= old_ctx / hi) {
                double smooth = (old_ctx / wavelen - lo) / (hi - lo);
                f = (1.0 - smooth) * f / cfg->rope_factor + smooth * f;
            }
        }
        out[i] = (float)f;
    }
}

/* A layer's weights, in one order (prepare_weights pairs them with the engine's copies). */
enum { LAYER_WEIGHTS = 22 };
static void layer_weights(const struct tdm_layer_weights *w, const struct tdm_weight **out)
{
    const struct tdm_weight *l[LAYER_WEIGHTS] = {
        &w->attn_norm, &w->wq,        &w->wk,         &w->wv,       &w->bq,       &w->bk,
        &w->bv,        &w->q_norm,    &w->k_norm,     &w->wo,       &w->ffn_norm, &w->w_gate,
        &w->w_up,      &w->w_down,    &w->wq_a,       &w->q_a_norm, &w->wq_b,     &w->wkv_c,
        &w->wkv_r,     &w->kv_a_norm, &w->mla_absorb, &w->mla_uv};
    memcpy(out, l, sizeof l);
}

static tdm_status prep(tdm_engine_t *e, const struct tdm_weight *w, struct tdm_weight *out)
{
    if (!w->data) {
        memset(out, 0, sizeof *out);
        return TDM_OK;
    }
    return e->backend->iface->weight_prepare(e->backend, w, out);
}

/* A sparse layer's router and experts, as the backend holds them (dst->experts: the engine's
 * own array, freed at destroy). */
static tdm_status prepare_experts(tdm_engine_t *e, const struct tdm_layer_weights *src,
                                  struct tdm_layer_weights *dst)
{
    if (!src->n_experts) return TDM_OK;
    if (!(dst->experts = calloc((size_t)src->n_experts * 3, sizeof *dst->experts)))
        return tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    dst->n_experts = src->n_experts;
    tdm_status st = prep(e, &src->router, &dst->router);
    for (int i = 0; i < 3 * src->n_experts && st == TDM_OK; i++)
        st = prep(e, &src->experts[i], &dst->experts[i]);
    const struct tdm_weight *s[] = {&src->sh_gate, &src->sh_up, &src->sh_down, &src->sh_score};
    struct tdm_weight *d[] = {&dst->sh_gate, &dst->sh_up, &dst->sh_down, &dst->sh_score};
    for (int i = 0; i < 4 && st == TDM_OK; i++)
        st = prep(e, s[i], d[i]);
    return st;
}

static tdm_status prepare_weights(tdm_engine_t *e)
{
    const struct tdm_model *m = e->model;
    tdm_status st;
    if ((st = prep(e, &m->tok_embd, &e->tok_embd)) != TDM_OK) return st;
    if ((st = prep(e, &m->output_norm, &e->output_norm)) != TDM_OK) return st;
    /* tied embeddings: one backend copy serves both (the CUDA backend would otherwise hold
     * the table twice) */
    if (m->output.data == m->tok_embd.data && m->output.dtype == m->tok_embd.dtype &&
        m->output.rows == m->tok_embd.rows && m->output.cols == m->tok_embd.cols)
        e->output = e->tok_embd;
    else if ((st = prep(e, &m->output, &e->output)) != TDM_OK)
        return st;
    if (m->head) {
        const struct tdm_head *h = m->head;
        e->head.layout = h->layout;
        e->head.feature_width = h->feature_width;
        if ((st = prep(e, &h->enorm, &e->head.enorm)) != TDM_OK ||
            (st = prep(e, &h->hnorm, &e->head.hnorm)) != TDM_OK ||
            (st = prep(e, &h->fc_e, &e->head.fc_e)) != TDM_OK ||
            (st = prep(e, &h->fc_h, &e->head.fc_h)) != TDM_OK ||
            (st = prep(e, &h->fc_bias, &e->head.fc_bias)) != TDM_OK ||
            (st = prep(e, &h->wq_h, &e->head.wq_h)) != TDM_OK ||
            (st = prep(e, &h->wk_h, &e->head.wk_h)) != TDM_OK ||
            (st = prep(e, &h->wv_h, &e->head.wv_h)) != TDM_OK)
            return st;
    }
    for (int l = 0; l < e->cfg.n_layers; l++) {
        struct tdm_layer_weights *dst = &e->layers[l];
        const struct tdm_weight *s[LAYER_WEIGHTS];
        layer_weights(&m->layers[l], s);
        struct tdm_weight *d[] = {&dst->attn_norm,  &dst->wq,     &dst->wk,       &dst->wv,
                                  &dst->bq,         &dst->bk,     &dst->bv,       &dst->q_norm,
                                  &dst->k_norm,     &dst->wo,     &dst->ffn_norm, &dst->w_gate,
                                  &dst->w_up,       &dst->w_down, &dst->wq_a,     &dst->q_a_norm,
                                  &dst->wq_b,       &dst->wkv_c,  &dst->wkv_r,    &dst->kv_a_norm,
                                  &dst->mla_absorb, &dst->mla_uv};
        _Static_assert(sizeof d / sizeof d[0] == LAYER_WEIGHTS, "one list");
        for (size_t i = 0; i < TDM_ARRAY_LEN(s); i++)
            if ((st = prep(e, s[i], d[i])) != TDM_OK) return st;
        if ((st = prepare_experts(e, &m->layers[l], dst)) != TDM_OK) return st;
    }
    return TDM_OK;
}

/* MLA's own scratch at T tokens, in floats (mla_q, mla_c, mla_qa, mla_qn, mla_v). */
static size_t mla_scratch_floats(const struct tdm_model_config *c, size_t T)
{
    if (!tdm_config_mla(c)) return 0;
    return T * ((size_t)c->n_heads * c->head_dim + (size_t)c->kv_lora_rank +
                2 * (size_t)c->q_lora_rank + (size_t)c->n_heads * c->v_head_dim);
}

/* The engine scratch for a model at T batch tokens and R logit rows (the balloc calls of
 * tdm_engine_create, in bytes). */
static size_t scratch_bytes(const struct tdm_model *m, size_t T, size_t R)
{
    const struct tdm_model_config *c = &m->cfg;
    size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    size_t draft = m->head && m->head->d2t ? R * (size_t)m->head->n_draft + m->head->n_draft : 0;
    size_t moe = c->n_experts ? T * ((size_t)c->n_experts + 2 * (size_t)c->d_model) : 0;
    moe += mla_scratch_floats(c, T);
    qd = TDM_MAX(qd, (size_t)c->n_heads * (size_t)(c->qk_nope_dim + c->qk_rope_dim));
    if (m->head && m->head->layout == TDM_HEAD_EAGLE3) /* its wider hin, k2 and v2 */
        moe += T * ((size_t)(m->head->feature_width - c->d_model) + 2 * kvd);
    return sizeof(float) * (T * (size_t)c->d_model * (m->head ? 5 : 3) + T * qd * 2 + T * kvd * 2 +
                            T * (size_t)TDM_MAX(c->d_ff, TDM_MAX(c->d_ff_expert, c->d_ff_shared)) +
                            R * (size_t)c->d_model + R * (size_t)c->vocab_size + draft + moe);
}

/* What a co-model (a draft) will take of backend b: its weights as b stores them (tied
 * embeddings once), and an engine's scratch at T tokens and R rows. */
static size_t co_model_bytes(tdm_backend_t *b, const struct tdm_model *m, size_t T, size_t R)
{
    size_t bytes = scratch_bytes(m, T, R);
    size_t (*wb)(tdm_backend_t *, const struct tdm_weight *) = b->iface->weight_bytes;
    if (!wb) return bytes;
    bytes += wb(b, &m->tok_embd) + wb(b, &m->output_norm);
    if (m->output.data != m->tok_embd.data) bytes += wb(b, &m->output);
    if (m->head) {
        const struct tdm_head *h = m->head;
        bytes += wb(b, &h->enorm) + wb(b, &h->hnorm) + wb(b, &h->fc_e) + wb(b, &h->fc_h) +
                 wb(b, &h->fc_bias) + wb(b, &h->wq_h) + wb(b, &h->wk_h) + wb(b, &h->wv_h);
    }
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const struct tdm_weight *w[LAYER_WEIGHTS];
        layer_weights(&m->layers[l], w);
        for (int i = 0; i < LAYER_WEIGHTS; i++)
            bytes += wb(b, w[i]);
        const struct tdm_layer_weights *lw = &m->layers[l];
        if (lw->n_experts)
            bytes += wb(b, &lw->router) + wb(b, &lw->sh_gate) + wb(b, &lw->sh_up) +
                     wb(b, &lw->sh_down) + wb(b, &lw->sh_score);
        for (int i = 0; i < 3 * m->layers[l].n_experts; i++)
            bytes += wb(b, &m->layers[l].experts[i]);
    }
    return bytes;
}

bool tdm_kv_dtype_parse(const char *s, enum tdm_kv_dtype *out)
{
    static const char *const names[] = {"auto", "f32", "bf16", "f16"};
    for (int i = 0; i < 4; i++)
        if (s && !strcmp(s, names[i])) {
            *out = (enum tdm_kv_dtype)i;
            return true;
        }
    return false;
}

/* The pool's element type for these options on this backend. */
static enum tdm_dtype kv_elem_type(int kv_dtype, const tdm_backend_t *b)
{
    switch (kv_dtype) {
    case TDM_KV_DTYPE_F32:
        return TDM_DTYPE_F32;
    case TDM_KV_DTYPE_BF16:
        return TDM_DTYPE_BF16;
    case TDM_KV_DTYPE_F16:
        return TDM_DTYPE_F16;
    default:
        return tdm_backend_is_cuda(b) ? TDM_DTYPE_BF16 : TDM_DTYPE_F32;
    }
}

/* The KV memory an engine takes when no size is given: room for max_seqs whole contexts,
 * capped. */
static size_t kv_bytes_default(const struct tdm_kv_config *kc, const struct tdm_engine_opts *o)
{
    size_t full = tdm_kv_page_bytes_all(kc) *
                  (size_t)((o->max_ctx + o->page_size - 1) / o->page_size) * (size_t)o->max_seqs;
    return TDM_MIN(full, DEFAULT_KV_CAP_BYTES);
}

void tdm_engine_fill_defaults(const struct tdm_model_config *cfg, struct tdm_engine_opts *o)
{
    if (o->page_size <= 0) o->page_size = DEFAULT_PAGE_SIZE;
    if (o->max_ctx <= 0) o->max_ctx = cfg->max_ctx > 0 ? cfg->max_ctx : 4096;
    if (o->max_batch_tokens <= 0) o->max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS;
    if (o->max_seqs <= 0) o->max_seqs = DEFAULT_MAX_SEQS;
    if (o->max_logit_rows <= 0) o->max_logit_rows = TDM_MAX(o->max_seqs, 64);
}

static tdm_status create_sharded(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                                 tdm_engine_t **out);
static tdm_status create_beside(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                                tdm_engine_t **out);
static void *rank_main(void *arg);

tdm_status tdm_engine_create(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                             tdm_engine_t **out)
{
    if (opts && opts->shard_like && tdm_engine_tp_ranks(opts->shard_like) > 1)
        return create_beside(model, opts, out);
    if (opts && opts->tp > 1) return create_sharded(model, opts, out);
    tdm_status st = TDM_OK;
    struct tdm_engine *e = calloc(1, sizeof *e);
    if (!e) return tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    e->model = model;
    e->cfg = model->cfg;
    e->opts = opts ? *opts : (struct tdm_engine_opts){0};
    tdm_engine_fill_defaults(&e->cfg, &e->opts);
    const struct tdm_model_config *c = &e->cfg;
    struct tdm_engine_opts *o = &e->opts;
    if (tdm_config_mla(c) ? c->head_dim > 1024
                          : c->head_dim <= 0 || c->head_dim % 2 || c->head_dim > TDM_MAX_HEAD_DIM) {
        st = tdm_err_set(TDM_EUNSUPPORTED,
                         "engine: head_dim %d (must be even, at most %d; an MLA "
                         "latent row at most 1024)",
                         c->head_dim, TDM_MAX_HEAD_DIM);
        goto out_free;
    }
    if (o->kv_dtype < TDM_KV_DTYPE_AUTO || o->kv_dtype > TDM_KV_DTYPE_F16) {
        st = tdm_err_set(TDM_EINVAL, "engine: unknown KV element type %d", o->kv_dtype);
        goto out_free;
    }
    if (o->page_size > 1024 || o->max_batch_tokens > (1 << 20) || o->max_seqs > (1 << 16) ||
        o->max_logit_rows > (1 << 20)) {
        st = tdm_err_set(TDM_ERANGE,
                         "engine: page size, batch tokens, seqs or logit rows too large");
        goto out_free;
    }

    if (o->backend) {
        e->backend = o->backend;
    } else if (o->backend_kind == TDM_BACKEND_CUDA) {
        /* expert layers route on the host between ops: no graph can hold them */
        struct tdm_backend_cuda_opts bo = {.gpu_memory_fraction = o->gpu_memory_fraction,
                                           .no_graphs = c->n_experts > 0 || o->gpu_no_graphs,
                                           .bf16_weights = o->gpu_bf16_weights,
                                           .batch_invariant = o->batch_invariant};
        if ((st = tdm_backend_cuda_create(&bo, &e->backend)) != TDM_OK) goto out_free;
        e->owns_backend = true;
    } else if (o->backend_kind == TDM_BACKEND_CPU) {
        struct tdm_backend_cpu_opts bo = {.n_threads = o->n_threads,
                                          .batch_invariant = o->batch_invariant,
                                          .quant_activations = !o->exact_activations};
        if ((st = tdm_backend_cpu_create(&bo, &e->backend)) != TDM_OK) goto out_free;
        e->owns_backend = true;
    } else {
        st = tdm_err_set(TDM_EINVAL, "engine: unknown backend kind %d", o->backend_kind);
        goto out_free;
    }

    if (c->n_experts && o->backend && tdm_backend_is_cuda(o->backend)) {
        st = tdm_err_set(TDM_EUNSUPPORTED, "engine: a mixture-of-experts model on a shared CUDA "
                                           "backend (its decode graphs cannot route experts)");
        goto out_free;
    }
    if (tdm_config_mla(c) && !e->backend->iface->head_matmul) {
        st = tdm_err_set(TDM_EUNSUPPORTED,
                         "engine: this model uses multi-head latent attention (kv_lora_rank %d), "
                         "which the %s backend does not run yet (--backend cpu does)",
                         c->kv_lora_rank, e->backend->iface->name);
        goto out_backend;
    }
    if (c->n_experts && (!e->backend->iface->rows_scale_add || !e->backend->iface->zero)) {
        st = tdm_err_set(TDM_EUNSUPPORTED,
                         "engine: this model has mixture-of-experts layers (%d experts, %d a "
                         "token), which the %s backend does not run yet (--backend cpu does)",
                         c->n_experts, c->n_experts_used, e->backend->iface->name);
        goto out_backend;
    }
    e->layers = calloc((size_t)c->n_layers, sizeof *e->layers);
    e->inv_freq = malloc((size_t)(tdm_config_rope_dim(c) / 2 + 1) * sizeof(float));
    if (!e->layers || !e->inv_freq) {
        st = tdm_err_set(TDM_ENOMEM, "engine: out of memory");
        goto out_backend;
    }
    tdm_rope_inv_freq(c, model->rope_freqs, e->inv_freq);
    if ((st = prepare_weights(e)) != TDM_OK) goto out_backend;

    size_t T = (size_t)o->max_batch_tokens, R = (size_t)o->max_logit_rows, f = sizeof(float);
    size_t qd = (size_t)c->n_heads * c->head_dim, kvd = (size_t)c->n_kv_heads * c->head_dim;
    qd = TDM_MAX(qd, (size_t)c->n_heads * (size_t)(c->qk_nope_dim + c->qk_rope_dim));
    e->x = balloc(e, T * c->d_model * f, &st);
    e->h = balloc(e, T * c->d_model * f, &st);
    e->q = balloc(e, T * qd * f, &st);
    e->k = balloc(e, T * kvd * f, &st);
    e->v = balloc(e, T * kvd * f, &st);
    e->att = balloc(e, T * qd * f, &st);
    e->o = balloc(e, T * c->d_model * f, &st);
    e->gate =
        balloc(e, T * (size_t)TDM_MAX(c->d_ff, TDM_MAX(c->d_ff_expert, c->d_ff_shared)) * f, &st);
    if (c->n_experts) {
        size_t E = (size_t)c->n_experts, K = (size_t)c->n_experts_used;
        e->moe_logits = balloc(e, T * E * f, &st);
        e->moe_in = balloc(e, T * c->d_model * f, &st);
        e->moe_out = balloc(e, T * c->d_model * f, &st);
        e->moe_host_logits = malloc(T * E * f);
        e->moe_selw = malloc(T * K * f);
        e->moe_wts = malloc(T * K * f);
        e->moe_sel = malloc(T * K * sizeof(int32_t));
        e->moe_rows = malloc(T * K * sizeof(int32_t));
        e->moe_off = malloc((E + 1) * sizeof(int32_t));
        e->expert_tokens = calloc(E, sizeof *e->expert_tokens);
        e->moe_taken = malloc(E);
        e->moe_score = malloc(E * f);
        e->moe_gscore = malloc(E * f);
        if (st == TDM_OK &&
            (!e->moe_host_logits || !e->moe_selw || !e->moe_wts || !e->moe_sel || !e->moe_rows ||
             !e->moe_off || !e->expert_tokens || !e->moe_taken || !e->moe_score || !e->moe_gscore))
            st = tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    }
    if (tdm_config_mla(c)) {
        e->mla_q = balloc(e, T * c->n_heads * c->head_dim * f, &st);
        e->mla_c = balloc(e, T * c->kv_lora_rank * f, &st);
        if (c->q_lora_rank) {
            e->mla_qa = balloc(e, T * c->q_lora_rank * f, &st);
            e->mla_qn = balloc(e, T * c->q_lora_rank * f, &st);
        }
        e->mla_v = balloc(e, T * c->n_heads * c->v_head_dim * f, &st);
    }
    e->rows = balloc(e, R * c->d_model * f, &st);
    e->logits = balloc(e, R * c->vocab_size * f, &st);
    if (model->head) {
        e->is_head = true;
        e->hin = balloc(e, T * (size_t)TDM_MAX(model->head->feature_width, c->d_model) * f, &st);
        e->hin2 = balloc(e, T * c->d_model * f, &st);
        if (model->head->layout == TDM_HEAD_EAGLE3) {
            e->k2 = balloc(e, T * kvd * f, &st);
            e->v2 = balloc(e, T * kvd * f, &st);
        }
        if (model->head->d2t && st == TDM_OK) {
            e->n_draft = model->head->n_draft;
            e->draft_logits = balloc(e, R * (size_t)e->n_draft * f, &st);
            if (st == TDM_OK &&
                (st = tdm_backend_buf_new(e->backend, (size_t)e->n_draft * sizeof(int32_t),
                                          "draft vocabulary", &e->draft_cols)) == TDM_OK)
                e->backend->iface->upload(e->backend, e->draft_cols.ptr, model->head->d2t,
                                          (size_t)e->n_draft * sizeof(int32_t));
        }
    }
    for (int i = 0; i < o->n_feature_layers && st == TDM_OK; i++) { /* an EAGLE-3 head's */
        if (o->n_feature_layers > TDM_HEAD_MAX_AUX || o->feature_layers[i] < 0 ||
            o->feature_layers[i] >= c->n_layers || !e->backend->iface->zero) {
            st = tdm_err_set(TDM_EINVAL,
                             "engine: feature layer %d of %d: the model has %d layers (at most "
                             "%d feature layers, on a backend with a zero op)",
                             o->feature_layers[i], o->n_feature_layers, c->n_layers,
                             TDM_HEAD_MAX_AUX);
            break;
        }
        e->aux[i] = balloc(e, T * c->d_model * f, &st);
        if (st == TDM_OK && !e->aux_host && !(e->aux_host = malloc(T * c->d_model * f)))
            st = tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    }
    if (st != TDM_OK) goto out_scratch;
    /* a borrowed pool: its page size and page count; its layer group must be this model's */
    if (o->kv_shared) {
        const struct tdm_kv_config *pc = tdm_kv_pool_config(o->kv_shared);
        struct tdm_kv_group g;
        if (!tdm_kv_pool_group(o->kv_shared, o->kv_group, &g) || g.n_layers != c->n_layers ||
            g.n_kv_heads != c->n_kv_heads || g.head_dim != c->head_dim ||
            g.latent_v_dim != c->kv_lora_rank) {
            st = tdm_err_set(TDM_EINVAL,
                             "engine: KV layer group %d of the shared pool does not fit this "
                             "model (%d layers, %d kv heads of %d)",
                             o->kv_group, c->n_layers, c->n_kv_heads, c->head_dim);
            goto out_scratch;
        }
        o->page_size = pc->page_size;
        o->kv_pages = pc->n_pages;
    }
    /* the backend's worst-case workspace, and what its memory plan leaves for the KV pool (a
     * borrowed backend with a borrowed pool keeps its owner's plan) */
    size_t backend_kv_bytes = 0;
    if (e->backend->iface->reserve && !(o->kv_shared && o->backend)) {
        const int max_pages_seq = (o->max_ctx + o->page_size - 1) / o->page_size;
        struct tdm_backend_limits lim = {
            .max_tokens = o->max_batch_tokens,
            .max_seqs = o->max_seqs,
            .max_rows = o->max_logit_rows,
            .max_pages = (int)TDM_MIN((int64_t)o->max_seqs * max_pages_seq, INT32_MAX / 2),
            .n_heads = c->n_heads,
            .n_kv_heads = c->n_kv_heads,
            .head_dim = c->head_dim,
            .d_model = c->d_model,
            .d_ff = c->d_ff,
            .vocab = c->vocab_size,
            .reserve_bytes = o->reserve_bytes};
        const struct tdm_model *co = o->co_model;
        if (co) { /* a draft beside this model: its shapes, its weights and its scratch */
            const struct tdm_model_config *cc = &co->cfg;
            lim.n_heads = TDM_MAX(lim.n_heads, cc->n_heads);
            lim.n_kv_heads = TDM_MAX(lim.n_kv_heads, cc->n_kv_heads);
            lim.head_dim = TDM_MAX(lim.head_dim, cc->head_dim);
            lim.d_model = TDM_MAX(lim.d_model, cc->d_model);
            lim.d_ff = TDM_MAX(lim.d_ff, cc->d_ff);
            lim.vocab = TDM_MAX(lim.vocab, cc->vocab_size);
            lim.reserve_bytes += co_model_bytes(e->backend, co, (size_t)o->max_batch_tokens,
                                                (size_t)o->max_logit_rows);
        }
        if ((st = e->backend->iface->reserve(e->backend, &lim, &backend_kv_bytes)) != TDM_OK &&
            !(o->kv_pages > 0 || o->kv_bytes > 0))
            goto out_scratch;
        st = TDM_OK;
    }
    /* device sampling: a probe of zero rows says whether the hook takes this vocabulary */
    e->device_sampling =
        e->backend->iface->sample &&
        e->backend->iface->sample(e->backend, e->logits, 0, c->vocab_size, NULL) == TDM_OK;
    if (!e->device_sampling) {
        if ((st = tdm_sample_scratch_init(&e->sample_scratch, c->vocab_size)) != TDM_OK)
            goto out_scratch;
        /* a backend without a sample hook computes in host memory (the CPU backend) */
        if (e->backend->iface->sample && !(e->host_logits = malloc(R * c->vocab_size * f))) {
            st = tdm_err_set(TDM_ENOMEM, "engine: out of memory for host logits");
            goto out_scratch;
        }
    }
    struct tdm_sampling_params greedy = tdm_sampling_defaults();
    if ((st = tdm_sampler_init(&e->greedy, &greedy, 0, c->vocab_size)) != TDM_OK) goto out_scratch;
    if (!(e->prev_tok = calloc(R, sizeof *e->prev_tok))) {
        st = tdm_err_set(TDM_ENOMEM, "engine: out of memory for the last step's tokens");
        goto out_scratch;
    }
    if (e->device_sampling && !(e->dev_rows = calloc(R, sizeof *e->dev_rows))) {
        st = tdm_err_set(TDM_ENOMEM, "engine: out of memory for sample rows");
        goto out_scratch;
    }
    if (o->count_layers)
        e->counter = tdm_backend_is_cuda(e->backend) ? tdm_backend_cuda_counter(e->backend)
                                                     : &e->own_counter;
    struct tdm_kv_config kc = {.n_layers = c->n_layers,
                               .n_kv_heads = c->n_kv_heads,
                               .head_dim = c->head_dim,
                               .page_size = o->page_size,
                               .n_pages = o->kv_pages,
                               .n_extra = o->n_kv_extra,
                               .dtype = kv_elem_type(o->kv_dtype, e->backend),
                               .latent_v_dim = c->kv_lora_rank};
    if (o->n_kv_extra < 0 || o->n_kv_extra > TDM_KV_MAX_EXTRA_GROUPS) {
        st = tdm_err_set(TDM_EINVAL, "engine: %d extra KV layer groups", o->n_kv_extra);
        goto out_scratch;
    }
    for (int g = 0; g < o->n_kv_extra; g++)
        kc.extra[g] = o->kv_extra[g];
    if (o->kv_shared) {
        e->kv = o->kv_shared;
        e->kv_group = o->kv_group;
    } else if (kc.n_pages <= 0) {
        size_t bytes = o->kv_bytes;
        if (!bytes && backend_kv_bytes) {
            bytes = backend_kv_bytes; /* the backend's memory plan (CUDA) */
        } else if (!bytes) {
            bytes = kv_bytes_default(&kc, o);
        }
        kc.n_pages = tdm_kv_pages_for_bytes(&kc, bytes);
        if (kc.n_pages <= 0) {
            st = tdm_err_set(TDM_EINVAL, "engine: %zu bytes of KV memory hold no page", bytes);
            goto out_scratch;
        }
    }
    if (!o->kv_shared) {
        o->kv_pages = kc.n_pages;
        if ((st = tdm_kv_pool_create(&kc, e->backend, &e->kv)) != TDM_OK) goto out_scratch;
        e->owns_kv = true;
    }

    size_t meta = (T * 4 + (size_t)o->max_seqs * 4 + 8 + R) * sizeof(int32_t) +
                  (size_t)o->max_seqs * (size_t)((o->max_ctx + o->page_size - 1) / o->page_size) *
                      sizeof(int32_t) +
                  64 * 16 + R;
    /* token trees: a mask per token, a prefix and node offsets per sequence, their nodes */
    meta += T * sizeof(uint64_t) +
            ((size_t)o->max_seqs * (2 + TDM_TREE_MAX_NODES) + 1) * sizeof(int32_t) + 64 * 4;
    if ((st = tdm_arena_init(&e->arena, meta)) != TDM_OK) goto out_scratch;
    *out = e;
    return TDM_OK;

out_scratch:
    if (e->owns_kv) tdm_kv_pool_destroy(e->kv);
    free_scratch(e);
    tdm_sample_scratch_free(&e->sample_scratch);
    free(e->host_logits);
    free(e->dev_rows);
    free(e->prev_tok);
    tdm_sampler_free(&e->greedy);
out_backend:
    if (e->owns_backend) tdm_backend_destroy(e->backend);
    free_layers(e);
    free(e->inv_freq);
out_free:
    free(e);
    return st;
}

/* Stops the ranks of a sharded engine and frees them, their views and the group (the
 * leader's own engine is left to the caller). Safe on a partly built one. */
static void destroy_ranks(struct engine_tp *x)
{
    if (!x) return;
    if (!x->host) { /* the threads are this engine's (a head beside a target has none) */
        pthread_mutex_lock(&x->mu);
        x->stop = true;
        pthread_cond_broadcast(&x->cv);
        const bool launched = x->launched;
        pthread_mutex_unlock(&x->mu);
        if (launched) tdm_tp_barrier(x->group); /* every rank waits at the start barrier */
        for (int r = 1; r < x->n_ranks; r++)
            if (x->started[r]) pthread_join(x->threads[r], NULL);
    }
    pthread_mutex_destroy(&x->mu);
    pthread_cond_destroy(&x->cv);
    if (!x->host) tdm_cuda_tp_destroy(x->ctp); /* the ranks are stopped; backends still here */
    if (x->ranks[0]) tdm_backend_buf_release(x->ranks[0]->backend, &x->lm_part);
    for (int r = 1; r < x->n_ranks; r++)
        tdm_engine_destroy(x->ranks[r]);
    for (int r = 0; r < x->n_ranks; r++)
        tdm_engine_shard_model_free(x->views[r]);
    if (!x->host) tdm_tp_group_destroy(x->group);
    free(x);
}

void tdm_engine_destroy(tdm_engine_t *e)
{
    if (!e) return;
    if (e->tpx && e->rank == 0) {
        struct engine_tp *x = e->tpx;
        e->tpx = NULL;
        destroy_ranks(x);
    }
    while (e->n_pend) { /* launched and never waited: finished, its results dropped */
        e->pend[0].samples = NULL;
        e->pend[0].queue = false;
        (void)tdm_engine_wait(e);
    }
    const struct tdm_backend_i *ops = e->backend ? e->backend->iface : NULL;
    if (ops && !e->owns_backend && ops->step_forget) {
        ops->step_forget(e->backend, e);
        if (e->k2) ops->step_forget(e->backend, (const char *)e + 1); /* EAGLE-3's own steps */
    }
    if (e->owns_kv) tdm_kv_pool_destroy(e->kv);
    free_scratch(e);
    tdm_sample_scratch_free(&e->sample_scratch);
    free(e->host_logits);
    free(e->dev_rows);
    free(e->prev_tok);
    tdm_sampler_free(&e->greedy);
    if (e->owns_backend) tdm_backend_destroy(e->backend);
    tdm_arena_free(&e->arena);
    free_layers(e);
    free(e->inv_freq);
    free(e);
}

/* st, with `prefix` put before the message of the error just set. */
static tdm_status err_prefix(tdm_status st, const char *prefix)
{
    char why[512];
    snprintf(why, sizeof why, "%s", tdm_err_msg());
    return tdm_err_set(st, "%s%s", prefix, why);
}

/* What of a speculation head the ranks cannot shard, by name (TDM_EUNSUPPORTED); else TDM_OK. */
static tdm_status head_shardable(const struct tdm_model *head, int N)
{
    const struct tdm_model_config *c = &head->cfg;
    if (tdm_config_mla(c) || c->n_experts)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "engine: --tp %d: a speculation head with %s is not sharded yet", N,
                           c->n_experts ? "mixture-of-experts layers" : "latent attention");
    return TDM_OK;
}

/* The MLP's split unit: whole blocks of every layer's down projection. */
static int64_t ff_block(const struct tdm_model *m)
{
    int64_t ff_align = 1;
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (m->layers[l].w_down.data)
            ff_align = TDM_MAX(ff_align, tdm_dtype_block_elems(m->layers[l].w_down.dtype));
    return ff_align;
}

/* Rank r of x, just created on its shard sh, joins the group: its vocabulary offset, and for
 * the leader the buffer of its part of a step's LM-head rows (`what` names it). */
static tdm_status rank_joins(struct engine_tp *x, int r, const struct tdm_tp_shard *sh,
                             int max_logit_rows, const char *what)
{
    tdm_engine_t *re = x->ranks[r];
    tdm_status st = TDM_OK;
    x->vocab0[r] = sh->vocab0;
    if (r == 0)
        st = tdm_backend_buf_new(re->backend,
                                 (size_t)max_logit_rows * (size_t)sh->n_vocab * sizeof(float), what,
                                 &x->lm_part);
    re->tp = x->group;
    re->rank = r;
    re->tpx = x;
    return st;
}

/* Rank r's CUDA backend, on devices[r]. Ranks that share a GPU share its memory: the k ranks
 * on one device are made in order, and the i-th of them plans with i + 1 k-ths of the memory
 * fraction, of which the ones before it already hold theirs (the memory plan counts what is
 * in use), so each KV pool gets about a k-th. Peer ranks run without graphs (backend.h). */
#define NCCL_HOLD_BYTES ((size_t)1 << 30) /* held back from each NCCL rank's KV pool */

static tdm_status cuda_rank_backend(const struct tdm_engine_opts *o, const int *devices, int N,
                                    int r, enum tdm_cuda_tp_mode mode, tdm_backend_t **out)
{
    int before = 0, sharing = 0;
    for (int q = 0; q < N; q++)
        if (devices[q] == devices[r]) {
            sharing++;
            before += q < r;
        }
    const double f =
        o->gpu_memory_fraction > 0 ? o->gpu_memory_fraction : TDM_GPU_MEMORY_FRACTION_DEFAULT;
    struct tdm_backend_cuda_opts bo = {.device = devices[r],
                                       .gpu_memory_fraction = f * (before + 1) / sharing,
                                       .no_graphs = mode == TDM_CUDA_TP_PEER || o->gpu_no_graphs,
                                       .bf16_weights = o->gpu_bf16_weights,
                                       .batch_invariant = o->batch_invariant};
    tdm_status st = tdm_backend_cuda_create(&bo, out);
    return st == TDM_OK ? st : err_prefix(st, "engine: a CUDA rank: ");
}

/* The ranks' pools, each sized by its own backend's memory plan, made the smallest one's size:
 * one page id names a page in every rank's pool. A larger pool is made again, before any page
 * is handed out. */
static tdm_status same_page_count(struct engine_tp *x)
{
    int64_t P = x->ranks[0]->opts.kv_pages;
    for (int r = 1; r < x->n_ranks; r++)
        P = TDM_MIN(P, x->ranks[r]->opts.kv_pages);
    for (int r = 0; r < x->n_ranks; r++) {
        tdm_engine_t *re = x->ranks[r];
        if (re->opts.kv_pages == P) continue;
        struct tdm_kv_config kc = *tdm_kv_pool_config(re->kv);
        kc.n_pages = P;
        tdm_kv_pool_destroy(re->kv); /* its memory first: the new pool takes it */
        re->kv = NULL;
        re->owns_kv = false;
        tdm_status st = tdm_kv_pool_create(&kc, re->backend, &re->kv);
        if (st != TDM_OK) return err_prefix(st, "engine: a rank's KV pool made smaller: ");
        re->owns_kv = true;
        re->opts.kv_pages = P;
    }
    return TDM_OK;
}

/* Tensor parallelism (tdm_engine_opts.tp; the top of this file): checks what a sharded engine
 * can run, builds each rank's model view and engine (CPU ranks, or CUDA ranks a GPU each),
 * attaches the ranks' pools to the leader's, and starts ranks 1 .. N-1. */

static tdm_status create_sharded(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                                 tdm_engine_t **out)
{
    const struct tdm_model_config *c = &model->cfg;
    const int N = opts->tp;
    if (N > TDM_TP_MAX_RANKS)
        return tdm_err_set(TDM_ERANGE, "engine: --tp %d (at most %d)", N, TDM_TP_MAX_RANKS);
    if (opts->backend_kind != TDM_BACKEND_CPU && opts->backend_kind != TDM_BACKEND_CUDA)
        return tdm_err_set(TDM_EINVAL, "engine: unknown backend kind %d", opts->backend_kind);
    const bool cuda = opts->backend_kind == TDM_BACKEND_CUDA;
    if (opts->backend || opts->kv_shared)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "engine: --tp %d makes each rank's backend and pool; a borrowed "
                           "backend or pool cannot be sharded",
                           N);
    if (model->head) /* sharded beside its target: create_beside */
        return tdm_err_set(TDM_EINVAL,
                           "engine: --tp %d: a speculation head is sharded like its sharded "
                           "target (tdm_engine_opts.shard_like), not on ranks of its own",
                           N);
    if (tdm_config_mla(c))
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "engine: --tp %d with multi-head latent attention (kv_lora_rank %d) "
                           "is not supported yet",
                           N, c->kv_lora_rank);
    if (c->n_experts)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "engine: --tp %d with a mixture-of-experts model (%d experts) is not "
                           "supported yet",
                           N, c->n_experts);
    struct tdm_engine_opts o = *opts;
    tdm_engine_fill_defaults(c, &o);
    /* CUDA: where the ranks go and what joins them */
    int devices[TDM_TP_MAX_RANKS] = {0};
    enum tdm_cuda_tp_mode mode = TDM_CUDA_TP_PEER;
    char how[160] = "";
    tdm_status pst = cuda ? tdm_cuda_tp_plan(N, devices, &mode, how, sizeof how) : TDM_OK;
    if (pst != TDM_OK) return pst; /* its message names --tp or TANDEM_TP_COMM */
    /* the page count TP = 1 would have, whole heads counted; on CUDA without a size, each
     * rank's memory plan, and then the smallest of them (below) */
    if (o.kv_pages <= 0 && (!cuda || o.kv_bytes > 0)) {
        struct tdm_kv_config kc = {.n_layers = c->n_layers,
                                   .n_kv_heads = c->n_kv_heads,
                                   .head_dim = c->head_dim,
                                   .page_size = o.page_size,
                                   .n_extra = TDM_MAX(o.n_kv_extra, 0),
                                   .dtype = o.kv_dtype != TDM_KV_DTYPE_AUTO
                                                ? kv_elem_type(o.kv_dtype, NULL)
                                            : cuda ? TDM_DTYPE_BF16 /* each backend's own */
                                                   : TDM_DTYPE_F32};
        for (int g = 0; g < o.n_kv_extra && g < TDM_KV_MAX_EXTRA_GROUPS; g++)
            kc.extra[g] = o.kv_extra[g];
        size_t bytes = o.kv_bytes ? o.kv_bytes : kv_bytes_default(&kc, &o);
        if ((o.kv_pages = tdm_kv_pages_for_bytes(&kc, bytes)) <= 0)
            return tdm_err_set(TDM_EINVAL, "engine: %zu bytes of KV memory hold no page", bytes);
    }
    const int threads = o.n_threads > 0 ? o.n_threads : tdm_cpu_count();
    const int64_t ff_align = ff_block(model);
    /* a head's KV group (co_model a head): sharded by the head's KV heads like the head
     * (create_beside); a draft model's: whole, in the leader's pool */
    const bool head_kv = o.co_model && o.co_model->head && o.n_kv_extra > 0;
    const int head_kv_heads = head_kv ? o.kv_extra[0].n_kv_heads : 0;
    if (head_kv) {
        struct tdm_tp_kv_shard ks;
        if (o.n_kv_extra != 1 || head_kv_heads != o.co_model->cfg.n_kv_heads)
            return tdm_err_set(TDM_EINVAL,
                               "engine: --tp %d: the head's KV group is not the head's "
                               "(tdm_spec_engine_opts makes it)",
                               N);
        if (tdm_tp_kv_shard_of(head_kv_heads, N, 0, &ks) != TDM_OK)
            return err_prefix(TDM_EUNSUPPORTED, "engine: the speculation head's KV: ");
    }
    struct engine_tp *x = calloc(1, sizeof *x);
    if (!x) return tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    x->n_ranks = N;
    x->cuda = cuda;
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, NULL);
    const size_t ar_floats = (size_t)o.max_batch_tokens * c->d_model; /* an all-reduce's most */
    tdm_status st = tdm_tp_group_create(N, cuda ? 0 : ar_floats, &x->group);
    for (int r = 0; r < N && st == TDM_OK; r++) {
        struct tdm_tp_shard sh;
        if ((st = tdm_tp_shard_of(c, N, r, ff_align, &sh)) != TDM_OK ||
            (st = tdm_engine_shard_model(model, &sh, &x->views[r])) != TDM_OK)
            break;
        struct tdm_engine_opts ro = o;
        ro.tp = 0;
        ro.n_threads = TDM_MAX(1, threads / N);
        struct tdm_kv_group head_group;
        if (head_kv) { /* the rank's share of the head's KV heads */
            struct tdm_tp_kv_shard ks;
            (void)tdm_tp_kv_shard_of(head_kv_heads, N, r, &ks); /* valid: checked above */
            head_group = o.kv_extra[0];
            head_group.n_kv_heads = ks.n_kv_heads;
            ro.kv_extra = &head_group;
        }
        if (r > 0) { /* the layer counter, a draft model's KV, an EAGLE-3 head's features
                      * (every rank holds the whole residual they copy): the leader's alone */
            ro.count_layers = false;
            ro.n_feature_layers = 0;
            if (!head_kv) { /* a draft model runs on the leader alone: nothing held back */
                ro.kv_extra = NULL;
                ro.n_kv_extra = 0;
                ro.co_model = NULL;
                ro.reserve_bytes = 0;
            }
        }
        /* NCCL's channel buffers and its graphs' memory come after the pools are sized */
        if (cuda && mode == TDM_CUDA_TP_NCCL) ro.reserve_bytes += NCCL_HOLD_BYTES;
        tdm_backend_t *rb = NULL;
        if (cuda && (st = cuda_rank_backend(&o, devices, N, r, mode, &rb)) != TDM_OK) break;
        ro.backend = rb; /* NULL: a CPU backend of ro.n_threads */
        if ((st = tdm_engine_create(x->views[r], &ro, &x->ranks[r])) != TDM_OK) {
            tdm_backend_destroy(rb);
            break;
        }
        x->ranks[r]->owns_backend = true;
        st = rank_joins(x, r, &sh, ro.max_logit_rows, "the leader's LM-head rows");
    }
    if (st == TDM_OK && cuda && o.kv_pages <= 0) st = same_page_count(x);
    for (int r = 1; r < N && st == TDM_OK; r++)
        st = tdm_kv_pool_add_shard(x->ranks[0]->kv, x->ranks[r]->kv);
    if (st == TDM_OK && cuda) {
        tdm_backend_t *bs[TDM_TP_MAX_RANKS];
        for (int r = 0; r < N; r++)
            bs[r] = x->ranks[r]->backend;
        st = tdm_cuda_tp_create(bs, N, mode, x->group, ar_floats, &x->ctp);
        tdm_backend_cuda_bind_thread(bs[0]); /* the caller's thread drives the leader */
    }
    for (int r = 1; r < N && st == TDM_OK; r++) {
        if (pthread_create(&x->threads[r], NULL, rank_main, x->ranks[r]) != 0) {
            st = tdm_err_set(TDM_ENOMEM, "engine: cannot start the thread of rank %d", r);
            break;
        }
        x->started[r] = true;
    }
    if (st == TDM_OK) {
        pthread_mutex_lock(&x->mu);
        x->launched = true;
        pthread_cond_broadcast(&x->cv);
        pthread_mutex_unlock(&x->mu);
        tdm_engine_t *e = x->ranks[0];
        e->model = model; /* what callers see: the whole model; the weights are the view's */
        e->opts.tp = N;
        e->opts.n_threads = threads;
        if (cuda) {
            char devs[TDM_TP_MAX_RANKS * 4] = "";
            for (int r = 0; r < N; r++)
                snprintf(devs + strlen(devs), sizeof devs - strlen(devs), "%s%d", r ? "," : "",
                         devices[r]);
            TDM_INFO("engine: --tp %d on CUDA: ranks on GPUs %s, %s, %lld KV pages a rank", N, devs,
                     how, (long long)e->opts.kv_pages);
        } else {
            TDM_INFO("engine: --tp %d: %d ranks of %d thread(s) (%s)", N, N,
                     TDM_MAX(1, threads / N), tdm_backend_cpu_isa());
        }
        *out = e;
        return TDM_OK;
    }
    tdm_engine_t *leader = x->ranks[0];
    if (leader) leader->tpx = NULL;
    destroy_ranks(x);
    tdm_engine_destroy(leader);
    return st;
}

/* A speculation head beside a sharded target (tdm_engine_opts.shard_like; the top of this
 * file): each rank's view of the head on that target rank's backend and pool, no threads of its
 * own (the target's run its steps). */
static tdm_status create_beside(const struct tdm_model *model, const struct tdm_engine_opts *opts,
                                tdm_engine_t **out)
{
    tdm_engine_t *t = opts->shard_like;
    struct engine_tp *tx = t->tpx;
    const struct tdm_model_config *c = &model->cfg;
    const int N = tx->n_ranks;
    if (!model->head)
        return tdm_err_set(TDM_EINVAL,
                           "engine: --tp %d: only a speculation head is sharded beside its target "
                           "(a draft model runs whole on the leader rank)",
                           N);
    tdm_status st = head_shardable(model, N);
    if (st != TDM_OK) return st;
    if (c->d_model != t->cfg.d_model)
        return tdm_err_set(TDM_EINVAL, "engine: --tp %d: the head is %d wide, its target %d", N,
                           c->d_model, t->cfg.d_model);
    struct tdm_engine_opts o = *opts;
    tdm_engine_fill_defaults(c, &o);
    /* the all-reduce's staging is the target's */
    if (o.max_batch_tokens > t->opts.max_batch_tokens)
        return tdm_err_set(TDM_ERANGE,
                           "engine: --tp %d: the head's %d batch tokens exceed its target's %d", N,
                           o.max_batch_tokens, t->opts.max_batch_tokens);
    /* a reduced draft vocabulary splits its own rows (placed by the leader: lm_head) */
    struct tdm_model_config split = *c;
    if (model->head->d2t) split.vocab_size = model->head->n_draft;
    const int64_t ff_align = ff_block(model);
    struct engine_tp *x = calloc(1, sizeof *x);
    if (!x) return tdm_err_set(TDM_ENOMEM, "engine: out of memory");
    x->n_ranks = N;
    x->group = tx->group;
    x->host = tx;
    x->cuda = tx->cuda; /* the target's rank backends, and its collective (ctp) */
    pthread_mutex_init(&x->mu, NULL);
    pthread_cond_init(&x->cv, NULL);
    for (int r = 0; r < N && st == TDM_OK; r++) {
        struct tdm_tp_shard sh;
        if ((st = tdm_tp_shard_of(&split, N, r, ff_align, &sh)) != TDM_OK) {
            st = err_prefix(st, "engine: the speculation head: ");
            break;
        }
        if ((st = tdm_engine_shard_model(model, &sh, &x->views[r])) != TDM_OK) break;
        tdm_engine_t *te = tx->ranks[r];
        struct tdm_engine_opts ro = o;
        ro.tp = 0;
        ro.shard_like = NULL;
        ro.backend = te->backend;
        ro.kv_shared = te->kv; /* its layer group: the rank's share of the head's KV heads */
        ro.n_threads = te->opts.n_threads;
        ro.count_layers = r == 0 && o.count_layers;
        if ((st = tdm_engine_create(x->views[r], &ro, &x->ranks[r])) != TDM_OK) break;
        st = rank_joins(x, r, &sh, ro.max_logit_rows, "the head leader's LM-head rows");
    }
    tdm_engine_t *leader = x->ranks[0];
    if (st == TDM_OK) {
        leader->model = model; /* what callers see: the whole head; the weights are the view's */
        leader->opts.tp = N;
        TDM_INFO("engine: --tp %d: the speculation head sharded like its target (%d KV heads%s)", N,
                 c->n_kv_heads, N > c->n_kv_heads ? ", in replica sets" : "");
        *out = leader;
        return TDM_OK;
    }
    if (leader) leader->tpx = NULL;
    destroy_ranks(x);
    tdm_engine_destroy(leader);
    return st;
}

int tdm_engine_expert_tokens(const tdm_engine_t *e, uint64_t *out, int cap)
{
    int n = e->expert_tokens ? e->cfg.n_experts : 0;
    for (int i = 0; i < n && i < cap; i++)
        out[i] = atomic_load_explicit(&e->expert_tokens[i], memory_order_relaxed);
    return n;
}

uint64_t tdm_engine_expert_passes(const tdm_engine_t *e)
{
    return atomic_load_explicit(&e->expert_passes, memory_order_relaxed);
}

const struct tdm_model *tdm_engine_model(const tdm_engine_t *e)
{
    return e->model;
}

tdm_kv_pool_t *tdm_engine_kv(tdm_engine_t *e)
{
    return e->kv;
}

int tdm_engine_tp_ranks(const tdm_engine_t *e)
{
    return e->tpx ? e->tpx->n_ranks : 1;
}

tdm_kv_pool_t *tdm_engine_rank_kv(tdm_engine_t *e, int rank)
{
    if (rank < 0 || rank >= tdm_engine_tp_ranks(e)) return NULL;
    return e->tpx ? e->tpx->ranks[rank]->kv : e->kv;
}

const struct tdm_engine_opts *tdm_engine_opts(const tdm_engine_t *e)
{
    return &e->opts;
}

tdm_backend_t *tdm_engine_backend(tdm_engine_t *e)
{
    return e->backend;
}

_Atomic int32_t *tdm_engine_layer_counter(tdm_engine_t *e)
{
    return e->counter;
}

/* A tree span's checks (engine.h, struct tdm_batch_tree): its leading chain tokens, then
 * tree tokens whose masks name one node per position from the prefix on, the last their own.
 * *prefix: the positions its tree tokens read through the page table; *end: one past its
 * deepest position. */
static tdm_status check_tree(const tdm_engine_t *e, int s, const struct tdm_batch_seq *q,
                             int *prefix, int64_t *end)
{
    const struct tdm_batch_tree *tr = q->tree;
    const int64_t n_slots = e->opts.kv_pages * e->opts.page_size;
    if (!q->slots || !tr->positions || !tr->mask || !tr->node_slots || tr->n_nodes < 1 ||
        tr->n_nodes > TDM_TREE_MAX_NODES)
        return tdm_err_set(TDM_EINVAL,
                           "batch: sequence %d: a tree needs slots, positions, masks and 1 .. %d "
                           "nodes (%d)",
                           s, TDM_TREE_MAX_NODES, tr->n_nodes);
    for (int j = 0; j < tr->n_nodes; j++)
        if (tr->node_slots[j] < 0 || tr->node_slots[j] >= n_slots)
            return tdm_err_set(TDM_EINVAL,
                               "batch: sequence %d: tree node %d has KV slot %d, outside the pool",
                               s, j, tr->node_slots[j]);
    const uint64_t nodes = tr->n_nodes == 64 ? ~(uint64_t)0 : ((uint64_t)1 << tr->n_nodes) - 1;
    int c = 0;
    for (; c < q->n_tokens && tr->mask[c] == 0; c++)
        if (tr->positions[c] != q->pos0 + c)
            return tdm_err_set(TDM_EINVAL,
                               "batch: sequence %d: chain token %d of a tree is at position %d, "
                               "not %d",
                               s, c, tr->positions[c], q->pos0 + c);
    const int64_t p0 = (int64_t)q->pos0 + c;
    int64_t last = p0;
    for (int i = c; i < q->n_tokens; i++) {
        const uint64_t m = tr->mask[i];
        if (!m || (m & ~nodes))
            return tdm_err_set(TDM_EINVAL,
                               "batch: sequence %d: tree token %d has mask %#llx (%d nodes; chain "
                               "tokens come first)",
                               s, i, (unsigned long long)m, tr->n_nodes);
        if ((int64_t)tr->positions[i] != p0 + __builtin_popcountll(m) - 1)
            return tdm_err_set(TDM_EINVAL,
                               "batch: sequence %d: tree token %d at position %d sees %d nodes "
                               "after position %lld",
                               s, i, tr->positions[i], __builtin_popcountll(m), (long long)p0);
        if (tr->node_slots[63 - __builtin_clzll(m)] != q->slots[i])
            return tdm_err_set(TDM_EINVAL,
                               "batch: sequence %d: tree token %d's slot is not its last node's", s,
                               i);
        last = TDM_MAX(last, (int64_t)tr->positions[i] + 1);
    }
    *prefix = (int)p0;
    *end = last;
    return TDM_OK;
}

/* Validates the batch and flattens it into a step; fills out_rows with the token indices that
 * want logits. Writes nothing to the KV cache. */
/* prev: the rows a TDM_TOKEN_PREV token may name (0: none may appear). */
static tdm_status build_step(tdm_engine_t *e, const struct tdm_batch *b, int prev,
                             struct tdm_step *st, int32_t **out_rows, int *n_out)
{
    const struct tdm_engine_opts *o = &e->opts;
    int ps = o->page_size;
    int64_t n_tokens = 0, n_rows = 0, n_pages = 0, n_nodes = 0;
    bool trees = false;
    if (b->n_seqs <= 0) return tdm_err_set(TDM_EINVAL, "batch: no sequences");
    if (b->n_seqs > o->max_seqs)
        return tdm_err_set(TDM_ERANGE, "batch: %d sequences, at most %d", b->n_seqs, o->max_seqs);
    for (int s = 0; s < b->n_seqs; s++) {
        const struct tdm_batch_seq *q = &b->seqs[s];
        if (q->n_tokens <= 0 || q->pos0 < 0 || q->n_logits < 0 || q->n_logits > q->n_tokens)
            return tdm_err_set(TDM_EINVAL, "batch: sequence %d has an empty span or bad counts", s);
        int64_t end = (int64_t)q->pos0 + q->n_tokens;
        if (q->tree) {
            int prefix;
            tdm_status tst = check_tree(e, s, q, &prefix, &end);
            if (tst != TDM_OK) return tst;
            trees = true;
            n_nodes += q->tree->n_nodes;
        }
        if (end > o->max_ctx)
            return tdm_err_set(TDM_ERANGE,
                               "batch: sequence %d reaches position %lld, context is %d", s,
                               (long long)end, o->max_ctx);
        int64_t need = (end + ps - 1) / ps;
        if (q->n_pages < need)
            return tdm_err_set(TDM_EINVAL, "batch: sequence %d has %d pages, needs %lld", s,
                               q->n_pages, (long long)need);
        for (int64_t j = 0; j < need; j++)
            if (q->pages[j] < 0 || q->pages[j] >= o->kv_pages)
                return tdm_err_set(TDM_EINVAL,
                                   "batch: sequence %d page %lld is %d, outside the pool", s,
                                   (long long)j, q->pages[j]);
        for (int i = 0; q->slots && i < q->n_tokens; i++)
            if (q->slots[i] < 0 || q->slots[i] >= o->kv_pages * ps)
                return tdm_err_set(TDM_EINVAL,
                                   "batch: sequence %d token %d has KV slot %d, outside the pool",
                                   s, i, q->slots[i]);
        if (e->is_head && !q->hidden)
            return tdm_err_set(TDM_EINVAL, "batch: sequence %d has no hidden states for the head",
                               s);
        for (int i = 0; i < q->n_tokens; i++) {
            const int32_t tk = q->tokens[i];
            if (tk < 0 && tk >= TDM_TOKEN_PREV(prev - 1) && prev > 0) continue;
            if (tk < 0 || tk >= e->cfg.vocab_size)
                return tdm_err_set(TDM_EINVAL, "batch: token id %d outside the vocabulary (0..%d)",
                                   tk, e->cfg.vocab_size - 1);
        }
        n_tokens += q->n_tokens;
        n_rows += q->n_logits;
        n_pages += need;
    }
    if (n_tokens > o->max_batch_tokens)
        return tdm_err_set(TDM_ERANGE, "batch: %lld tokens, at most %d", (long long)n_tokens,
                           o->max_batch_tokens);
    if (n_rows > o->max_logit_rows)
        return tdm_err_set(TDM_ERANGE, "batch: %lld logit rows, at most %d", (long long)n_rows,
                           o->max_logit_rows);

    struct tdm_arena *a = &e->arena;
    tdm_arena_reset(a);
    int32_t *tokens = tdm_arena_alloc(a, n_tokens * sizeof(int32_t));
    int32_t *positions = tdm_arena_alloc(a, n_tokens * sizeof(int32_t));
    int32_t *slots = tdm_arena_alloc(a, n_tokens * sizeof(int32_t));
    int32_t *token_seq = tdm_arena_alloc(a, n_tokens * sizeof(int32_t));
    int32_t *seq_token_start = tdm_arena_alloc(a, (b->n_seqs + 1) * sizeof(int32_t));
    int32_t *seq_kv_len = tdm_arena_alloc(a, b->n_seqs * sizeof(int32_t));
    int32_t *seq_page_start = tdm_arena_alloc(a, (b->n_seqs + 1) * sizeof(int32_t));
    int32_t *page_ids = tdm_arena_alloc(a, (n_pages ? n_pages : 1) * sizeof(int32_t));
    int32_t *rows = tdm_arena_alloc(a, (n_rows ? n_rows : 1) * sizeof(int32_t));
    if (!tokens || !positions || !slots || !token_seq || !seq_token_start || !seq_kv_len ||
        !seq_page_start || !page_ids || !rows)
        return tdm_err_set(TDM_ERANGE, "batch: metadata exceeds the reserved scratch (%s)",
                           tdm_err_msg());
    /* token trees: only a step with one has the arrays (backends branch on them once) */
    uint64_t *tree_mask = NULL;
    int32_t *seq_prefix = NULL, *tree_node_start = NULL, *tree_slots = NULL;
    if (trees) {
        tree_mask = tdm_arena_alloc(a, n_tokens * sizeof(uint64_t));
        seq_prefix = tdm_arena_alloc(a, b->n_seqs * sizeof(int32_t));
        tree_node_start = tdm_arena_alloc(a, (b->n_seqs + 1) * sizeof(int32_t));
        tree_slots = tdm_arena_alloc(a, n_nodes * sizeof(int32_t));
        if (!tree_mask || !seq_prefix || !tree_node_start || !tree_slots)
            return tdm_err_set(TDM_ERANGE, "batch: tree metadata exceeds the reserved scratch");
    }

    int t = 0, r = 0, pg = 0, nd = 0, n_prev = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const struct tdm_batch_seq *q = &b->seqs[s];
        const struct tdm_batch_tree *tr = q->tree;
        int64_t end64 = (int64_t)q->pos0 + q->n_tokens;
        int prefix = (int)end64;
        if (tr) check_tree(e, s, q, &prefix, &end64); /* checked above: the same values */
        int end = (int)end64;
        int need = (end + ps - 1) / ps;
        seq_token_start[s] = t;
        seq_page_start[s] = pg;
        seq_kv_len[s] = end;
        memcpy(page_ids + pg, q->pages, (size_t)need * sizeof(int32_t));
        pg += need;
        if (trees) {
            seq_prefix[s] = prefix;
            tree_node_start[s] = nd;
            if (tr) {
                memcpy(tree_slots + nd, tr->node_slots, (size_t)tr->n_nodes * sizeof(int32_t));
                nd += tr->n_nodes;
            }
        }
        for (int i = 0; i < q->n_tokens; i++, t++) {
            int pos = tr ? tr->positions[i] : q->pos0 + i;
            tokens[t] = q->tokens[i];
            if (tokens[t] < 0) { /* TDM_TOKEN_PREV: the host's copy, or the backend's */
                if (e->prev_on_host)
                    tokens[t] = e->prev_tok[-1 - tokens[t]];
                else
                    n_prev++;
            }
            positions[t] = pos;
            slots[t] = q->slots ? q->slots[i] : q->pages[pos / ps] * ps + pos % ps;
            token_seq[t] = s;
            if (trees) tree_mask[t] = tr ? tr->mask[i] : 0;
            if (i >= q->n_tokens - q->n_logits) rows[r++] = t;
        }
    }
    seq_token_start[b->n_seqs] = t;
    seq_page_start[b->n_seqs] = pg;
    if (trees) tree_node_start[b->n_seqs] = nd;
    *st = (struct tdm_step){
        .n_tokens = (int)n_tokens,
        .n_seqs = b->n_seqs,
        .tokens = tokens,
        .positions = positions,
        .slots = slots,
        .token_seq = token_seq,
        .seq_token_start = seq_token_start,
        .seq_kv_len = seq_kv_len,
        .seq_page_start = seq_page_start,
        .page_ids = page_ids,
        .page_size = ps,
        .tree_mask = tree_mask,
        .seq_prefix = seq_prefix,
        .tree_node_start = tree_node_start,
        .tree_slots = tree_slots,
        .n_prev_rows = n_prev ? prev : 0,
    };
    *out_rows = rows;
    *n_out = (int)n_rows;
    return TDM_OK;
}

/* Downloads the rows of `src` ([n_rows][width] backend memory) whose want has `bit`, merging
 * runs of consecutive rows into one copy each. */
static void download_rows(tdm_engine_t *e, float *dst, const float *src, const uint8_t *want,
                          int n_rows, int width, uint8_t bit)
{
    const struct tdm_backend_i *ops = e->backend->iface;
    for (int i = 0; i < n_rows;) {
        if (!(want[i] & bit)) {
            i++;
            continue;
        }
        int j = i + 1;
        while (j < n_rows && (want[j] & bit))
            j++;
        size_t off = (size_t)i * width;
        ops->download(e->backend, dst + off, src + off, (size_t)(j - i) * width * sizeof(float));
        i = j;
    }
}

/* Checks the SAMPLE rows' parameters; *in_backend: a row reads or writes a distribution in
 * backend memory. */
static tdm_status check_sample_rows(const tdm_engine_t *e, const uint8_t *want, int n_rows,
                                    const struct tdm_sample_row *samples, bool *in_backend)
{
    const int vocab = e->cfg.vocab_size;
    *in_backend = false;
    for (int i = 0; i < n_rows; i++) {
        const struct tdm_sample_row *r = &samples[i];
        if (!(want[i] & TDM_ROW_SAMPLE)) continue;
        bool ok =
            r->mode <= TDM_SAMPLE_SCORE && r->n_undo >= 0 && r->n_undo <= TDM_SAMPLE_MAX_UNDO &&
            (r->n_undo == 0 || r->undo) && (r->mode != TDM_SAMPLE_PROPOSE || r->dist) &&
            ((r->mode != TDM_SAMPLE_VERIFY && r->mode != TDM_SAMPLE_SCORE) ||
             (r->draft >= 0 && r->draft < vocab)) &&
            (r->mode != TDM_SAMPLE_TREE ||
             (r->n_cand >= 0 && r->n_cand <= TDM_SAMPLE_MAX_CAND && (r->n_cand == 0 || r->cand)));
        for (int j = 0; ok && j < r->n_undo; j++)
            ok = r->undo[j] >= 0 && r->undo[j] < vocab;
        for (int j = 0; ok && r->mode == TDM_SAMPLE_TREE && j < r->n_cand; j++)
            ok = r->cand[j] >= 0 && r->cand[j] < vocab;
        if (!ok) return tdm_err_set(TDM_EINVAL, "batch: sample row %d is malformed", i);
        *in_backend |= r->mode == TDM_SAMPLE_PROPOSE || (r->mode == TDM_SAMPLE_VERIFY && r->q);
    }
    return TDM_OK;
}

/* Samples the SAMPLE rows of a step whose logits are in e->logits. */
static tdm_status sample_rows(tdm_engine_t *e, const uint8_t *want, int n_rows, bool all,
                              struct tdm_sample_row *samples)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    int vocab = e->cfg.vocab_size;
    bool in_backend;
    tdm_status cst = check_sample_rows(e, want, n_rows, samples, &in_backend);
    if (cst != TDM_OK) return cst;
    if (e->device_sampling) {
        if (all) return ops->sample(b, e->logits, n_rows, vocab, samples);
        /* the device samples every row: the others greedily, from a copy of the list */
        for (int i = 0; i < n_rows; i++) {
            e->dev_rows[i] = samples[i];
            if (!(want[i] & TDM_ROW_SAMPLE))
                e->dev_rows[i] = (struct tdm_sample_row){.smp = &e->greedy, .n_top = -1};
        }
        tdm_status st = ops->sample(b, e->logits, n_rows, vocab, e->dev_rows);
        for (int i = 0; i < n_rows; i++)
            if (want[i] & TDM_ROW_SAMPLE) samples[i] = e->dev_rows[i];
        return st;
    }
    float *lg = e->logits;
    if (e->host_logits) {
        if (in_backend)
            return tdm_err_set(TDM_EUNSUPPORTED,
                               "engine: rejection acceptance reads distributions in device "
                               "memory, and this vocabulary is sampled on the host");
        lg = e->host_logits;
        ops->download(b, lg, e->logits, (size_t)n_rows * vocab * sizeof(float));
    }
    ops->sync(b);
    for (int i = 0; i < n_rows; i++)
        if (want[i] & TDM_ROW_SAMPLE)
            tdm_sample_row_host(&samples[i], lg + (size_t)i * vocab, &e->sample_scratch);
    return TDM_OK;
}

/* An EAGLE-3 head's input stage (model.h): the residual x = fc(feature) (+ bias), or on an
 * own step the head's own states, which tdm_engine_run uploaded into x; then the two halves
 * its layer's q/k/v read: h = enorm(embed(tokens)) and hin2 = hnorm(x). */
static void eagle3_input(tdm_engine_t *e, const struct tdm_step *st)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_head *hw = &e->head;
    const int d = e->cfg.d_model, T = st->n_tokens;
    const float eps = e->cfg.rms_eps;
    if (!e->own_step) ops->matmul(b, &hw->fc_h, e->hin, T, hw->fc_bias.data, e->x);
    ops->embed(b, &e->tok_embd, st->tokens, T, e->o);
    ops->rmsnorm(b, e->o, hw->enorm.data, eps, T, d, e->h);
    ops->rmsnorm(b, e->x, hw->hnorm.data, eps, T, d, e->hin2);
}

/* An EAGLE-3 head's q, k, v of [h ; hin2]: the products of the embedding's columns (the
 * layer's weights, with its biases) plus those of the feature's (wq_h, wk_h, wv_h). */
static void eagle3_qkv(tdm_engine_t *e, const struct tdm_layer_weights *w, int T)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_head *hw = &e->head;
    const size_t qd = (size_t)e->cfg.n_heads * e->cfg.head_dim;
    const size_t kvd = (size_t)e->cfg.n_kv_heads * e->cfg.head_dim;
    const struct tdm_matmul_part pe[] = {
        {&w->wq, w->bq.data, e->q}, {&w->wk, w->bk.data, e->k}, {&w->wv, w->bv.data, e->v}};
    const struct tdm_matmul_part ph[] = {
        {&hw->wq_h, NULL, e->att}, {&hw->wk_h, NULL, e->k2}, {&hw->wv_h, NULL, e->v2}};
    ops->matmul_multi(b, e->h, T, pe, 3);
    ops->matmul_multi(b, e->hin2, T, ph, 3);
    ops->add(b, e->q, e->att, (size_t)T * qd);
    ops->add(b, e->k, e->k2, (size_t)T * kvd);
    ops->add(b, e->v, e->v2, (size_t)T * kvd);
}

/* A sharded engine's partial products summed over the ranks: the backend's all-reduce (CUDA
 * ranks), or the group's over host memory. */
static void tp_sum(tdm_engine_t *e, float *x, size_t n)
{
    if (e->backend->iface->allreduce)
        e->backend->iface->allreduce(e->backend, x, n);
    else
        tdm_tp_allreduce(e->tp, e->rank, x, n);
}

/* The layer loop for a step of T = st->n_tokens tokens (the embedding, or a head's input
 * stage, to the last layer's add_rmsnorm), n_layers of them. A rank of a sharded engine sums
 * its partial output projections with the other ranks' after attention and after the MLP, so
 * each rank leaves with the whole residual stream. */
static void run_layers(tdm_engine_t *e, const struct tdm_step *st, int n_layers)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_model_config *c = &e->cfg;
    const int d = c->d_model, hd = c->head_dim, T = st->n_tokens;
    const bool mla = tdm_config_mla(c);
    const int qh = c->qk_nope_dim + c->qk_rope_dim; /* MLA: a head's q before the absorb */
    const float scale = c->attn_scale / sqrtf((float)(mla ? qh : hd));
    const struct tdm_rope rope = {.head_dim = hd,
                                  .neox = c->rope_neox,
                                  .inv_freq = e->inv_freq,
                                  .rot_dim = mla ? c->qk_rope_dim : 0,
                                  .mscale = c->rope_mscale};
    _Atomic int32_t *counter = e->counter;
    const struct tdm_head *hw = &e->head;
    if (e->is_head && hw->layout == TDM_HEAD_EAGLE3) {
        eagle3_input(e, st);
    } else if (e->is_head) {
        /* x = enorm(embed) fc_e + hnorm(hidden) fc_h (+ bias) */
        ops->embed(b, &e->tok_embd, st->tokens, T, e->o);
        const float *ein = e->o;
        float *hin = e->hin, *hout = e->hin2;
        if (hw->enorm.data) {
            ops->rmsnorm(b, e->o, hw->enorm.data, c->rms_eps, T, d, e->h);
            ein = e->h;
        }
        if (hw->hnorm.data) {
            ops->rmsnorm(b, e->hin, hw->hnorm.data, c->rms_eps, T, d, e->hin2);
            hin = e->hin2;
            hout = e->hin;
        }
        ops->matmul(b, &hw->fc_e, ein, T, hw->fc_bias.data, e->x);
        ops->matmul(b, &hw->fc_h, hin, T, NULL, hout);
        ops->add(b, e->x, hout, (size_t)T * d);
    } else {
        ops->embed(b, &e->tok_embd, st->tokens, T, e->x);
    }
    if (e->layers[0].attn_norm.data)
        ops->rmsnorm(b, e->x, e->layers[0].attn_norm.data, c->rms_eps, T, d, e->h);
    for (int l = 0; l < n_layers; l++) {
        const struct tdm_layer_weights *w = &e->layers[l];
        struct tdm_kv_layer kv = tdm_kv_pool_group_layer(e->kv, e->kv_group, l);
        for (int i = 0; i < e->opts.n_feature_layers; i++) /* the residual entering layer l */
            if (e->aux[i] && e->opts.feature_layers[i] == l) {
                ops->zero(b, e->aux[i], (size_t)T * d);
                ops->add(b, e->aux[i], e->x, (size_t)T * d);
            }
        if (mla) { /* a head's layer without an input norm (EAGLE) projects x itself */
            mla_attention(e, w, l == 0 && !w->attn_norm.data ? e->x : e->h, st, &rope, &kv, scale,
                          T, qh);
            goto attended;
        }
        const struct tdm_matmul_part qkv[] = {
            {&w->wq, w->bq.data, e->q}, {&w->wk, w->bk.data, e->k}, {&w->wv, w->bv.data, e->v}};
        if (l == 0 && e->k2) /* an EAGLE-3 head's [embedding ; feature] */
            eagle3_qkv(e, w, T);
        else /* a head's layer without an input norm (EAGLE) projects x itself */
            ops->matmul_multi(b, l == 0 && !w->attn_norm.data ? e->x : e->h, T, qkv, 3);
        if (c->qk_norm) {
            ops->head_rmsnorm(b, e->q, w->q_norm.data, c->rms_eps, T * c->n_heads, hd);
            ops->head_rmsnorm(b, e->k, w->k_norm.data, c->rms_eps, T * c->n_kv_heads, hd);
        }
        ops->rope_kv_append(b, e->q, e->k, e->v, c->n_heads, st, &rope, &kv);
        ops->attention(b, e->q, c->n_heads, st, &kv, scale, e->att);
        ops->matmul(b, &w->wo, e->att, T, NULL, e->o);
        if (e->tp) tp_sum(e, e->o, (size_t)T * d);
    attended:
        if (counter) ops->layer_done(b, l, counter);
        ops->add_rmsnorm(b, e->x, e->o, w->ffn_norm.data, c->rms_eps, T, d, e->h);
        if (w->n_experts) {
            moe_ffn(e, l, T);
        } else {
            ops->matmul_swiglu(b, &w->w_gate, &w->w_up, e->h, T, e->gate);
            ops->matmul(b, &w->w_down, e->gate, T, NULL, e->o);
            if (e->tp) tp_sum(e, e->o, (size_t)T * d);
        }
        const float *next_norm =
            l + 1 < n_layers ? e->layers[l + 1].attn_norm.data : e->output_norm.data;
        if (next_norm)
            ops->add_rmsnorm(b, e->x, e->o, next_norm, c->rms_eps, T, d, e->h);
        else /* a head without a final norm */
            ops->add(b, e->x, e->o, (size_t)T * d);
    }
}

/* The logits of the n_rows rows of the step's tokens `rows` into e->logits ([n_rows][vocab]),
 * from the final norm's output (or the residual, for a head without one). A rank of a sharded
 * engine computes its vocabulary rows [vocab0, vocab0 + n_vocab) and writes them into the
 * leader's logits, then waits for the other ranks' (one barrier), so the leader samples
 * whole rows. */
static void lm_head(tdm_engine_t *e, const int32_t *rows, int n_rows)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const int d = e->cfg.d_model, vocab = e->cfg.vocab_size;
    ops->gather_rows(b, e->output_norm.data ? e->h : e->x, rows, n_rows, d, e->rows);
    if (!e->tp && e->n_draft) { /* a reduced draft vocabulary: its rows, then placed */
        ops->matmul(b, &e->output, e->rows, n_rows, NULL, e->draft_logits);
        ops->scatter_cols(b, e->draft_logits, e->draft_cols.ptr, n_rows, e->n_draft, vocab,
                          e->logits);
        return;
    }
    if (!e->tp) {
        ops->matmul(b, &e->output, e->rows, n_rows, NULL, e->logits);
        return;
    }
    /* the leader's rows, written in place (a reduced draft vocabulary: the leader's draft
     * logits, which it places after the barrier): host memory on the CPU, and on CUDA the
     * leader's device, which the other ranks reach by peer copies (cuda_tp.c) */
    struct engine_tp *x = e->tpx;
    tdm_engine_t *lead = x->ranks[0];
    const int64_t v0 = x->vocab0[e->rank], nv = e->output.rows;
    const int width = e->n_draft ? e->n_draft : vocab;
    float *dst = e->n_draft ? lead->draft_logits : lead->logits;
    if (x->cuda) {
        if (e->rank == 0 && n_rows == 1) {
            ops->matmul(b, &e->output, e->rows, 1, NULL, dst + v0);
        } else {
            float *part = e->rank ? e->logits : x->lm_part.ptr; /* [n_rows][nv] */
            ops->matmul(b, &e->output, e->rows, n_rows, NULL, part);
            tdm_cuda_tp_lm_put(b, part, n_rows, nv, dst, width, v0);
        }
    } else if (n_rows == 1) {
        ops->matmul(b, &e->output, e->rows, 1, NULL, dst + v0);
    } else {
        float *part = e->rank ? e->logits : x->lm_part.ptr; /* [n_rows][nv] */
        ops->matmul(b, &e->output, e->rows, n_rows, NULL, part);
        for (int i = 0; i < n_rows; i++)
            memcpy(dst + (size_t)i * width + v0, part + (size_t)i * nv, (size_t)nv * sizeof(float));
    }
    tdm_tp_barrier(e->tp);
    if (x->cuda && e->rank == 0) tdm_cuda_tp_lm_close(b); /* the other ranks' puts */
    if (e->n_draft && e->rank == 0)
        ops->scatter_cols(b, e->draft_logits, e->draft_cols.ptr, n_rows, e->n_draft, vocab,
                          e->logits);
}

/* A step hook of a sharded engine's rank failed once the ranks had the step: the others wait
 * on this one's collectives, and the error has no way back to them. Fatal, as a CUDA error
 * inside an op is (backend.h). */
static _Noreturn void tp_fatal(const tdm_engine_t *e)
{
    TDM_ERROR("engine: --tp rank %d: %s", e->rank, tdm_err_msg());
    abort();
}

/* A step's layer loop between the backend's step hooks (step_begin may pad st to a graph
 * bucket, or replay the whole loop; step_end closes a recording): the leader's and each rank's
 * (a CUDA rank records and replays its own graphs). The owner names the engine's graphs: an
 * EAGLE-3 head's steps of its own features are another one's. */
static tdm_status step_layers(tdm_engine_t *e, struct tdm_step *st, const int32_t *rows, int n_rows,
                              _Atomic int32_t *counter, int n_layers)
{
    const struct tdm_backend_i *ops = e->backend->iface;
    bool replayed = false;
    tdm_status hs = TDM_OK;
    if (ops->step_begin)
        hs = ops->step_begin(e->backend, st, rows, n_rows,
                             e->own_step ? (const char *)e + 1 : (void *)e, counter, &replayed);
    if (hs == TDM_OK && !replayed) {
        run_layers(e, st, n_layers);
        if (ops->step_end) hs = ops->step_end(e->backend);
    }
    return hs;
}

/* A rank r > 0 of a sharded engine: each step the leader hands over, until told to stop. */
static void *rank_main(void *arg)
{
    tdm_engine_t *e = arg;
    struct engine_tp *x = e->tpx;
    pthread_mutex_lock(&x->mu);
    while (!x->launched && !x->stop)
        pthread_cond_wait(&x->cv, &x->mu);
    bool go = x->launched;
    pthread_mutex_unlock(&x->mu);
    if (!go) return NULL;
    if (x->cuda) tdm_backend_cuda_bind_thread(e->backend);
    for (;;) {
        tdm_tp_barrier(x->group);
        if (x->stop) return NULL;
        const struct engine_tp *job = x->job; /* the target's step, or a head's beside it */
        tdm_engine_t *re = job->ranks[e->rank];
        struct tdm_step st = job->step;
        /* an error has no caller to reach, and the other ranks wait on this one */
        if (step_layers(re, &st, job->rows, job->n_rows, NULL, job->n_layers) != TDM_OK)
            tp_fatal(re);
        if (job->lm_head) /* ends with the step's last barrier */
            lm_head(re, job->rows, job->n_rows);
        else /* the step's end: no rank touches its backend until the next step */
            tdm_tp_barrier(x->group);
    }
}

/* An EAGLE-3 head's hidden states, in step order (before a graph may replay): a step of the
 * target's features ([n][feature_width] into hin) or of its own ([n][d_model] straight into
 * the residual x, which its input stage then starts from), never both. A sharded head's ranks
 * each take a copy (their input stages are replicated). */
static tdm_status eagle3_upload(tdm_engine_t *e, const struct tdm_batch *batch,
                                const struct tdm_step *step)
{
    const bool own = batch->seqs[0].own_hidden;
    const size_t w = own ? (size_t)e->cfg.d_model : (size_t)e->head.feature_width;
    for (int s = 0; s < batch->n_seqs; s++)
        if (batch->seqs[s].own_hidden != own)
            return tdm_err_set(TDM_EINVAL,
                               "batch: an EAGLE-3 head's step mixes the target's features "
                               "(sequence %d) and its own (sequence %d)",
                               own ? s : 0, own ? 0 : s);
    for (int r = 0; r < (e->tpx ? e->tpx->n_ranks : 1); r++) { /* each rank's input stage */
        tdm_engine_t *re = e->tpx ? e->tpx->ranks[r] : e;
        re->own_step = own;
        for (int s = 0; s < batch->n_seqs; s++)
            re->backend->iface->upload(
                re->backend, (own ? re->x : re->hin) + (size_t)step->seq_token_start[s] * w,
                batch->seqs[s].hidden, (size_t)batch->seqs[s].n_tokens * w * sizeof(float));
    }
    return TDM_OK;
}

/* The features of n tokens from t0 of an engine with feature_layers: token t's row of dst
 * ([n][n_feature_layers * d_model]) is the residual entering each of those layers, in order. */
static void download_aux(tdm_engine_t *e, float *dst, int t0, int n)
{
    const struct tdm_backend_i *ops = e->backend->iface;
    const size_t d = (size_t)e->cfg.d_model, na = (size_t)e->opts.n_feature_layers;
    for (size_t i = 0; i < na; i++) {
        ops->download(e->backend, e->aux_host, e->aux[i] + (size_t)t0 * d,
                      (size_t)n * d * sizeof(float));
        for (size_t t = 0; t < (size_t)n; t++)
            memcpy(dst + (t * na + i) * d, e->aux_host + t * d, d * sizeof(float));
    }
}

/* Whether a step may be queued whole (tdm_engine_launch): every row only samples, nothing
 * else comes back to the host, and the engine is one plain instance. */
static bool queueable(const tdm_engine_t *e, const struct tdm_batch *batch, uint8_t any,
                      uint8_t every, int n_rows)
{
    if (!tdm_engine_launches_async(e) || n_rows <= 0 || !(every & TDM_ROW_SAMPLE) ||
        (any & (TDM_ROW_LOGITS | TDM_ROW_HIDDEN)))
        return false;
    for (int s = 0; s < batch->n_seqs; s++)
        if (batch->seqs[s].features) return false;
    return true;
}

/* The sampling of a forward pass whose logits are in e->logits (p: its rows): queued on the
 * backend where p->queue allows, else done here, then the backend synced. */
static tdm_status sample_tail(tdm_engine_t *e, struct engine_pend *p)
{
    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    tdm_status st = TDM_OK;
    p->sampled = true;
    if (p->queue) {
        bool in_backend;
        st = check_sample_rows(e, p->want, p->n_rows, p->samples, &in_backend);
        if (st == TDM_OK)
            st = ops->sample_launch(b, e->logits, p->n_rows, e->cfg.vocab_size, p->samples,
                                    &p->ticket);
        if (st == TDM_OK) {
            p->queued = true;
            e->prev_rows = p->n_rows;
            e->prev_on_host = false;
            return TDM_OK;
        }
        if (st != TDM_EUNSUPPORTED) {
            ops->sync(b);
            e->prev_rows = 0;
            return p->st = st;
        }
        st = TDM_OK;
    }
    if (p->n_rows > 0 && p->samples)
        st = sample_rows(e, p->want, p->n_rows, p->every & TDM_ROW_SAMPLE, p->samples);
    ops->sync(b);
    /* the tokens a later launch's TDM_TOKEN_PREV names */
    e->prev_rows = st == TDM_OK && p->n_rows > 0 && (p->every & TDM_ROW_SAMPLE) ? p->n_rows : 0;
    e->prev_on_host = true;
    for (int i = 0; i < e->prev_rows; i++)
        e->prev_tok[i] = p->samples[i].token;
    return p->st = st;
}

enum step_mode { STEP_RUN, STEP_FORWARD };

/* One forward pass. STEP_RUN samples and waits; STEP_FORWARD leaves the sampling to
 * tdm_engine_launch_sample (tdm_engine_launch). *p: the pass's pending entry. */
static tdm_status engine_step(tdm_engine_t *e, const struct tdm_batch *batch,
                              const struct tdm_engine_out *out, enum step_mode mode,
                              struct engine_pend *p)
{
    struct tdm_step *stp = &e->step;
    int32_t *rows = NULL;
    int n_rows = 0;
    tdm_status st = build_step(e, batch, mode != STEP_RUN ? e->prev_rows : 0, stp, &rows, &n_rows);
    if (st != TDM_OK) return st;
    const int n_layers = out->n_layers > 0 ? out->n_layers : e->cfg.n_layers;
    if (n_layers > e->cfg.n_layers)
        return tdm_err_set(TDM_EINVAL, "batch: %d layers asked, the model has %d", n_layers,
                           e->cfg.n_layers);
    stp->n_layers = n_layers;
    for (int s = 0; s < batch->n_seqs && e->opts.n_feature_layers; s++)
        for (int i = 0; batch->seqs[s].features && i < e->opts.n_feature_layers; i++)
            if (e->opts.feature_layers[i] >= n_layers)
                return tdm_err_set(TDM_EINVAL,
                                   "batch: features of layer %d asked of a %d-layer pass",
                                   e->opts.feature_layers[i], n_layers);
    /* what each row wants: given, or whatever buffers were passed */
    const uint8_t *want = out->want;
    uint8_t all_bits = (out->samples ? TDM_ROW_SAMPLE : 0) | (out->logits ? TDM_ROW_LOGITS : 0) |
                       (out->hidden ? TDM_ROW_HIDDEN : 0);
    uint8_t any = 0, every = 0xff;
    if (n_rows > 0 && !want) {
        uint8_t *w = tdm_arena_alloc(&e->arena, (size_t)n_rows);
        if (!w) return tdm_err_set(TDM_ERANGE, "batch: no scratch for the row list");
        memset(w, all_bits, (size_t)n_rows);
        want = w;
    }
    for (int i = 0; i < n_rows; i++) {
        any |= want[i];
        every &= want[i];
    }
    if ((any & ~all_bits) & (TDM_ROW_SAMPLE | TDM_ROW_LOGITS | TDM_ROW_HIDDEN))
        return tdm_err_set(TDM_EINVAL, "batch: a row wants an output it has no buffer for");
    if (n_rows > 0 && !any)
        return tdm_err_set(TDM_EINVAL, "batch: logits requested but no output buffer");

    tdm_backend_t *b = e->backend;
    const struct tdm_backend_i *ops = b->iface;
    const struct tdm_model_config *c = &e->cfg;
    const int d = c->d_model;
    _Atomic int32_t *counter = e->counter;
    if (counter) atomic_store_explicit(counter, 0, memory_order_release);
    if (e->k2) { /* an EAGLE-3 head: target features to hin, or its own states straight to x */
        tdm_status hs = eagle3_upload(e, batch, stp);
        if (hs != TDM_OK) return hs;
    } else if (e->is_head) /* the hidden states, in step order (before a graph may replay); a
                            * sharded head's ranks each take a copy (their input stages are
                            * replicated) */
        for (int r = 0; r < (e->tpx ? e->tpx->n_ranks : 1); r++) {
            tdm_engine_t *re = e->tpx ? e->tpx->ranks[r] : e;
            for (int s = 0; s < batch->n_seqs; s++)
                re->backend->iface->upload(
                    re->backend, re->hin + (size_t)stp->seq_token_start[s] * d,
                    batch->seqs[s].hidden, (size_t)batch->seqs[s].n_tokens * d * sizeof(float));
        }
    const bool lm = any & (TDM_ROW_LOGITS | TDM_ROW_SAMPLE);
    if (e->tpx) { /* the step, built once, to every rank (on the threads' owner's), before the
                   * leader's step_begin may pad it: each rank's backend pads its own */
        struct engine_tp *x = e->tpx;
        (x->host ? x->host : x)->job = x;
        x->step = *stp;
        x->n_layers = n_layers;
        x->rows = rows;
        x->n_rows = n_rows;
        x->lm_head = lm;
        if (x->cuda && lm) tdm_cuda_tp_lm_open(b);
        tdm_tp_barrier(e->tp);
    }
    /* a backend may pad the step (a CUDA-graph bucket) or replay the whole layer loop */
    if ((st = step_layers(e, stp, rows, n_rows, counter, n_layers)) != TDM_OK) {
        if (e->tpx) tp_fatal(e); /* the ranks run this step already */
        ops->sync(b);
        return st;
    }
    /* the LM head's input: the final norm's output, or the residual itself (a head without) */
    const bool final_norm = e->output_norm.data != NULL;
    float *lm_in = final_norm ? e->h : e->x;
    /* a sharded step ends at a barrier (lm_head's, or this one): the caller may then use every
     * rank's backend and pool (tdm_kv_pool_copy_slots) while the ranks wait */
    if (e->tpx && !lm) tdm_tp_barrier(e->tp);
    if (any & TDM_ROW_HIDDEN) {
        ops->gather_rows(b, e->x, rows, n_rows, d, e->rows);
        download_rows(e, out->hidden, e->rows, want, n_rows, d, TDM_ROW_HIDDEN);
    }
    for (int s = 0; s < batch->n_seqs; s++) { /* a span's tokens are consecutive rows */
        const struct tdm_batch_seq *q = &batch->seqs[s];
        if (q->features && e->opts.n_feature_layers) /* an EAGLE-3 head's target */
            download_aux(e, q->features, stp->seq_token_start[s], q->n_tokens);
        else if (q->features) /* an EAGLE-3 head's own feature: before its final norm */
            ops->download(b, q->features,
                          (e->k2 ? e->x : lm_in) + (size_t)stp->seq_token_start[s] * d,
                          (size_t)q->n_tokens * d * sizeof(float));
    }
    if (any & (TDM_ROW_LOGITS | TDM_ROW_SAMPLE)) lm_head(e, rows, n_rows);
    /* logits before sampling, which may overwrite them */
    if (any & TDM_ROW_LOGITS)
        download_rows(e, out->logits, e->logits, want, n_rows, c->vocab_size, TDM_ROW_LOGITS);
    *p = (struct engine_pend){.samples = (any & TDM_ROW_SAMPLE) ? out->samples : NULL,
                              .want = want,
                              .n_rows = n_rows,
                              .every = every,
                              .queue = mode != STEP_RUN && queueable(e, batch, any, every, n_rows),
                              .ticket = -1};
    if (mode == STEP_FORWARD) return TDM_OK;
    return sample_tail(e, p);
}

tdm_status tdm_engine_run(tdm_engine_t *e, const struct tdm_batch *batch,
                          const struct tdm_engine_out *out)
{
    if (e->n_pend)
        return tdm_err_set(TDM_EINVAL, "engine: a run while %d launched steps are not waited",
                           e->n_pend);
    struct engine_pend p;
    return engine_step(e, batch, out, STEP_RUN, &p);
}

tdm_status tdm_engine_launch(tdm_engine_t *e, const struct tdm_batch *batch,
                             const struct tdm_engine_out *out)
{
    if (e->n_pend == 2 || (e->n_pend && !e->pend[e->n_pend - 1].sampled))
        return tdm_err_set(TDM_EINVAL, "engine: a launch before the last one was sampled, or "
                                       "with two launched steps not waited");
    struct engine_pend p;
    tdm_status st = engine_step(e, batch, out, STEP_FORWARD, &p);
    if (st != TDM_OK) { /* nothing to wait for */
        e->prev_rows = 0;
        return st;
    }
    e->pend[e->n_pend++] = p;
    return TDM_OK;
}

tdm_status tdm_engine_launch_sample(tdm_engine_t *e)
{
    if (!e->n_pend || e->pend[e->n_pend - 1].sampled)
        return tdm_err_set(TDM_EINVAL, "engine: no launched forward pass left to sample");
    return sample_tail(e, &e->pend[e->n_pend - 1]);
}

tdm_status tdm_engine_wait(tdm_engine_t *e)
{
    if (!e->n_pend) return tdm_err_set(TDM_EINVAL, "engine: no launched step to wait for");
    struct engine_pend p = e->pend[0];
    if (!p.sampled) (void)sample_tail(e, &p); /* a wait without its sampling: done here */
    e->pend[0] = e->pend[1];
    e->n_pend--;
    if (!p.queued) return p.st;
    tdm_status st = e->backend->iface->sample_wait(e->backend, p.ticket, p.samples, p.n_rows);
    if (st != TDM_OK) e->prev_rows = 0;
    return st;
}

bool tdm_engine_launches_async(const tdm_engine_t *e)
{
    return e->backend->iface->sample_launch && e->device_sampling && !e->tpx && !e->is_head &&
           !e->k2 && !e->counter;
}

tdm_status tdm_engine_forward(tdm_engine_t *e, const struct tdm_batch *batch, float *logits,
                              float *hidden)
{
    return tdm_engine_run(e, batch, &(struct tdm_engine_out){.logits = logits, .hidden = hidden});
}

tdm_status tdm_engine_forward_sample(tdm_engine_t *e, const struct tdm_batch *batch,
                                     struct tdm_sample_row *rows, float *hidden)
{
    return tdm_engine_run(e, batch, &(struct tdm_engine_out){.samples = rows, .hidden = hidden});
}

bool tdm_engine_samples_on_device(const tdm_engine_t *e)
{
    return e->device_sampling;
}
