/*
 * train_grad: a helper for tests/spec/test_train.py, which checks the head trainer's loss and
 * gradient (src/spec/train.c) against an independent numpy implementation of the same
 * objective, differentiated by central differences in float64 (tests/lib/train_ref.py).
 *
 *   train_grad MODEL OUT [--unroll N] [--reg W] [--draft-vocab N] [--seed S] [--top-k K]
 *              [--seqs N] [--max-len L] [--heads H --kv-heads H2 --d-ff F] [--fd N]
 *              [--gpu 1] [--compare OTHER.grad]
 *
 * Makes a head for MODEL with random weights (the norms too, so their gradients are not taken
 * at 1), a batch of random sequences (tokens, features, top-k distributions with some mass left
 * out, and ids outside the draft vocabulary), computes the loss and its gradient, and writes:
 *   OUT.safetensors   the head (F32, tandem's layout, d2t when the vocabulary is reduced)
 *   OUT.grad          float32: each tensor's gradient in the order printed
 *   OUT.data          the batch: int32 lengths, int32 first scored rows, then per sequence int32
 * tokens [len], float32 features [len][d], int32 top ids [len][k], float32 top p [len][k] and
 * prints {"loss": ..., "decay": d, "tensors": [[name, rows, cols, fc_half], ...], "top_k": k,
 * "draft_vocab":
 * [...], "fd": [[tensor, index, analytic, numeric], ...]} on stdout. --fd N also checks N
 * coordinates (the largest gradients of each tensor, in turn) by float32 central differences of the
 * trainer's own loss. --gpu 1 runs the trainer's GEMMs on the GPU (tdm_cuda_gemm); without one it
 * prints "SKIP: ..." and exits 77. --compare OTHER.grad adds "compare": [max |a - b|, max |b|]
 * against another run's gradient (the same options otherwise: the GPU's against the CPU's).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/spec.h"

static int fail(tdm_status st)
{
    fprintf(stderr, "error: %s: %s\n", tdm_status_str(st), tdm_err_msg());
    return 1;
}

static uint64_t rng_state = 88172645463325252ull;
static double urand(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static float nrand(void)
{
    double u1 = urand() + 1e-12, u2 = urand();
    return (float)(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2));
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: train_grad MODEL OUT [options]\n");
        return 2;
    }
    int unroll = 1, n_draft = 0, top_k = 5, n_seqs = 3, max_len = 12, heads = 0, kv_heads = 0;
    int d_ff = 0, n_fd = 0, gpu = 0;
    const char *compare = NULL;
    double reg = 0.5;
    uint64_t seed = 1;
    for (int i = 3; i + 1 < argc; i += 2) {
        const char *k = argv[i], *v = argv[i + 1];
        if (!strcmp(k, "--unroll"))
            unroll = atoi(v);
        else if (!strcmp(k, "--reg"))
            reg = atof(v);
        else if (!strcmp(k, "--draft-vocab"))
            n_draft = atoi(v);
        else if (!strcmp(k, "--seed"))
            seed = strtoull(v, NULL, 10);
        else if (!strcmp(k, "--top-k"))
            top_k = atoi(v);
        else if (!strcmp(k, "--seqs"))
            n_seqs = atoi(v);
        else if (!strcmp(k, "--max-len"))
            max_len = atoi(v);
        else if (!strcmp(k, "--heads"))
            heads = atoi(v);
        else if (!strcmp(k, "--kv-heads"))
            kv_heads = atoi(v);
        else if (!strcmp(k, "--d-ff"))
            d_ff = atoi(v);
        else if (!strcmp(k, "--fd"))
            n_fd = atoi(v);
        else if (!strcmp(k, "--gpu"))
            gpu = atoi(v);
        else if (!strcmp(k, "--compare"))
            compare = v;
        else {
            fprintf(stderr, "train_grad: unknown option %s\n", k);
            return 2;
        }
    }
    rng_state ^= seed * 0x9E3779B97F4A7C15ull;
    struct tdm_model *m = NULL;
    tdm_status st = tdm_model_load(argv[1], NULL, NULL, &m);
    if (st != TDM_OK) return fail(st);
    const int d = m->cfg.d_model, V = m->cfg.vocab_size;
    struct tdm_train_geom g;
    tdm_train_geom_of(m, &g);
    if (heads) g.n_heads = heads;
    if (kv_heads) g.n_kv_heads = kv_heads;
    if (d_ff) g.d_ff = d_ff;
    struct tdm_train_opts o;
    tdm_train_opts_default(&o);
    o.unroll = unroll;
    o.reg_weight = (float)reg;
    o.seed = seed;
    o.n_threads = 2;
    o.max_rows = 512;
    o.max_seqs = 16;
    o.max_len = 256;
    tdm_cuda_gemm_t *cg = NULL;
    if (gpu) {
        if (tdm_cuda_gemm_create(0, &cg) != TDM_OK) {
            printf("SKIP: train_grad --gpu: %s\n", tdm_err_msg());
            tdm_model_free(m);
            return 77;
        }
        o.gpu = cg;
    }
    /* a draft vocabulary: every other id from 1, as many as asked */
    int32_t *dv = NULL;
    if (n_draft > 0) {
        dv = malloc((size_t)n_draft * sizeof *dv);
        for (int i = 0; i < n_draft; i++)
            dv[i] = TDM_MIN(1 + 2 * i, V - n_draft + i);
    }
    tdm_head_trainer_t *t = NULL;
    if ((st = tdm_head_trainer_create(m, &g, &o, dv, n_draft, &t)) != TDM_OK) return fail(st);
    struct tdm_train_tensor tens[TDM_TRAIN_MAX_TENSORS];
    int nt = tdm_head_trainer_tensors(t, tens);
    for (int i = 0; i < nt; i++) /* every weight off its initial value, norms included */
        for (int64_t k = 0; k < tens[i].rows * tens[i].cols; k++)
            tens[i].data[k] += (tens[i].rows == 1 ? 0.3f : 0.05f) * nrand();
    /* the batch */
    struct tdm_train_seq *seqs = calloc((size_t)n_seqs, sizeof *seqs);
    char path[4096];
    snprintf(path, sizeof path, "%s.data", argv[2]);
    FILE *fdat = fopen(path, "wb");
    int32_t *lens = calloc((size_t)n_seqs, sizeof *lens);
    int32_t *firsts = calloc((size_t)n_seqs, sizeof *firsts);
    for (int s = 0; s < n_seqs; s++) {
        lens[s] = 2 + (int)(urand() * (max_len - 1));
        firsts[s] = s == 0 ? 0 : (int)(urand() * lens[s] / 2); /* a prompt of context rows */
    }
    fwrite(lens, sizeof *lens, (size_t)n_seqs, fdat);
    fwrite(firsts, sizeof *firsts, (size_t)n_seqs, fdat);
    for (int s = 0; s < n_seqs; s++) {
        int L = lens[s];
        int32_t *tok = malloc((size_t)L * sizeof *tok), *ids = malloc((size_t)L * top_k * 4);
        float *feat = malloc((size_t)L * d * 4), *pr = malloc((size_t)L * top_k * 4);
        for (int p = 0; p < L; p++) {
            tok[p] = (int32_t)(urand() * V);
            for (int c = 0; c < d; c++)
                feat[(size_t)p * d + c] = 1.5f * nrand(); /* some beyond the smooth L1's knee */
            double left = 1.0;
            for (int k = 0; k < top_k; k++) {
                int32_t id;
                bool dup;
                do { /* distinct ids */
                    id = (int32_t)(urand() * V);
                    dup = false;
                    for (int q = 0; q < k; q++)
                        dup |= ids[(size_t)p * top_k + q] == id;
                } while (dup);
                ids[(size_t)p * top_k + k] = k == top_k - 1 && p % 3 == 0 ? -1 : id; /* a pad */
                double share = left * (0.3 + 0.4 * urand());
                pr[(size_t)p * top_k + k] = k == top_k - 1 && p % 3 == 0 ? 0.0f : (float)share;
                left -= share;
            }
        }
        fwrite(tok, 4, (size_t)L, fdat);
        fwrite(feat, 4, (size_t)L * d, fdat);
        fwrite(ids, 4, (size_t)L * top_k, fdat);
        fwrite(pr, 4, (size_t)L * top_k, fdat);
        seqs[s] = (struct tdm_train_seq){tok, feat, ids, pr, L, firsts[s]};
    }
    fclose(fdat);
    struct tdm_train_loss loss;
    if ((st = tdm_head_trainer_grad(t, seqs, n_seqs, top_k, &loss)) != TDM_OK) return fail(st);
    snprintf(path, sizeof path, "%s.safetensors", argv[2]);
    if ((st = tdm_head_trainer_save(t, path, "F32", NULL, 0)) != TDM_OK) return fail(st);
    snprintf(path, sizeof path, "%s.grad", argv[2]);
    FILE *fg = fopen(path, "wb");
    float *grads = NULL;
    size_t n_all = 0;
    for (int i = 0; i < nt; i++)
        n_all += (size_t)(tens[i].rows * tens[i].cols);
    grads = malloc(n_all * sizeof *grads);
    size_t off = 0;
    for (int i = 0; i < nt; i++) { /* copied: the FD evaluations below leave grads alone, but */
        size_t n = (size_t)(tens[i].rows * tens[i].cols); /* keep the analytic ones apart */
        memcpy(grads + off, tens[i].grad, n * 4);
        fwrite(tens[i].grad, 4, n, fg);
        off += n;
    }
    fclose(fg);
    printf("{\"loss\": %.17g, \"top_k\": %d, \"decay\": %.9g, \"tensors\": [", loss.loss, top_k,
           (double)o.unroll_decay);
    for (int i = 0; i < nt; i++)
        printf("%s[\"%s\", %lld, %lld, %d]", i ? ", " : "", tens[i].name, (long long)tens[i].rows,
               (long long)tens[i].cols, tens[i].fc_half);
    int nv = 0;
    const int32_t *d2t = tdm_head_trainer_draft_vocab(t, &nv);
    printf("], \"draft_vocab\": [");
    for (int i = 0; i < nv; i++)
        printf("%s%d", i ? ", " : "", d2t[i]);
    printf("]");
    if (compare) { /* the other run's gradient, element by element */
        FILE *fc = fopen(compare, "rb");
        double worst = 0, scale = 0;
        size_t k = 0;
        float b;
        while (fc && k < n_all && fread(&b, 4, 1, fc) == 1) {
            worst = fmax(worst, fabs((double)grads[k] - b));
            scale = fmax(scale, fabs((double)b));
            k++;
        }
        if (fc) fclose(fc);
        if (k != n_all) {
            fprintf(stderr, "train_grad: %s holds %zu of %zu gradients\n", compare, k, n_all);
            return 1;
        }
        printf(", \"compare\": [%.9g, %.9g]", worst, scale);
    }
    printf(", \"fd\": [");
    /* float32 central differences of the trainer's own loss at the largest gradients */
    off = 0;
    int done = 0;
    for (int i = 0; i < nt && done < n_fd; i++) {
        size_t n = (size_t)(tens[i].rows * tens[i].cols), best = 0;
        for (size_t k = 1; k < n; k++)
            if (fabsf(grads[off + k]) > fabsf(grads[off + best])) best = k;
        float *w = &tens[i].data[best], keep = *w, eps = 1e-2f * fmaxf(fabsf(keep), 0.1f);
        struct tdm_train_loss lp, lm;
        *w = keep + eps;
        tdm_head_trainer_eval(t, seqs, n_seqs, top_k, &lp);
        *w = keep - eps;
        tdm_head_trainer_eval(t, seqs, n_seqs, top_k, &lm);
        *w = keep;
        printf("%s[%d, %zu, %.9g, %.9g]", done ? ", " : "", i, best, grads[off + best],
               (lp.loss - lm.loss) / (2.0 * eps));
        done++;
        off += n;
    }
    printf("]}\n");
    for (int s = 0; s < n_seqs; s++) {
        free((void *)seqs[s].tokens);
        free((void *)seqs[s].feats);
        free((void *)seqs[s].top_ids);
        free((void *)seqs[s].top_p);
    }
    free(seqs);
    free(lens);
    free(firsts);
    free(grads);
    free(dv);
    tdm_head_trainer_destroy(t);
    tdm_cuda_gemm_destroy(cg);
    tdm_model_free(m);
    return 0;
}
