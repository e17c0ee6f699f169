/*
 * rope_kv_append: rotary position embedding of q (in place) and k, fused with writing k and v
 * into the paged KV cache.
 *
 * Angles: theta_i = (float)position * inv_freq[i], a single fp32 multiplication, then cosf and
 * sinf of that fp32 angle. This is what an fp32 reference computes (numpy float32 positions
 * times float32 inv_freq); taking the product in double would be more exact but would differ
 * from such references by up to an ulp of the angle, which at position 10^4 is ~1e-3 radians.
 * A pair (a, b) becomes (a cos - b sin, a sin + b cos), each product rounded separately.
 * Pairs: neox (i, i + hd/2); otherwise (2i, 2i + 1); pair i uses inv_freq[i]. Only a row's
 * last rot_dim elements turn (hd counts those), and cos and sin are multiplied by mscale when
 * it is not 1 (YaRN).
 *
 * A latent layer (MLA, kv->v_dim > 0): the cached row is the latent k (stored as it is) then
 * the rope key v, rotated; nothing goes to a V half, which such pages do not have.
 *
 * KV layout (HND, kv.h): layer base [n_pages][2][n_kv_heads][page_size][head_dim] of the
 * layer's element type, K then V; token t goes to page slots[t] / page_size, offset
 * slots[t] % page_size. A 2-byte type gets the rotated k and v rounded to nearest even (the
 * ISA's kv_narrow); the rotation itself is fp32 whatever the type.
 *
 * Threading: tokens are split over the pool; a token's q rows and its KV slot are written only
 * by the thread that owns the token (the engine gives each token its own slot).
 */
#include "backend/cpu/cpu_int.h"

#include <math.h>
#include <string.h>

struct rope_job {
    const struct tdm_cpu_kernels *k_isa;
    float *q;
    const float *k;
    const float *v;
    int n_heads;
    const struct tdm_step *st;
    const struct tdm_rope *rope;
    const struct tdm_kv_layer *kv;
};

static void rotate(float *x, const float *cs, const float *sn, int hd, bool neox)
{
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
        const float a = x[ia], b = x[ib];
        x[ia] = a * cs[i] - b * sn[i];
        x[ib] = a * sn[i] + b * cs[i];
    }
}

static void rope_worker(void *ctx, int ith, int nth)
{
    const struct rope_job *job = ctx;
    const struct tdm_step *st = job->st;
    const struct tdm_kv_layer *kv = job->kv;
    const int hd = job->rope->head_dim, nkv = kv->n_kv_heads;
    const int rd = job->rope->rot_dim > 0 ? job->rope->rot_dim : hd, half = rd / 2;
    const float ms = job->rope->mscale;
    const bool scaled = ms != 0.0f && ms != 1.0f, latent = kv->v_dim > 0;
    const size_t head_bytes = (size_t)hd * sizeof(float);
    const size_t eb = tdm_kv_elem_bytes(kv->dtype);
    const bool f32 = eb == sizeof(float);
    float cs[TDM_CPU_MAX_HEAD_DIM / 2], sn[TDM_CPU_MAX_HEAD_DIM / 2];
    float krot[TDM_CPU_MAX_HEAD_DIM];
    int64_t t0, t1;
    tdm_split_range(st->n_tokens, ith, nth, 1, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        const float pos = (float)st->positions[t];
        for (int i = 0; i < half; i++) {
            const float ang = pos * job->rope->inv_freq[i];
            cs[i] = cosf(ang);
            sn[i] = sinf(ang);
            if (scaled) {
                cs[i] *= ms;
                sn[i] *= ms;
            }
        }
        float *q = job->q + (size_t)t * job->n_heads * hd;
        for (int h = 0; h < job->n_heads; h++)
            rotate(q + (size_t)h * hd + (hd - rd), cs, sn, rd, job->rope->neox);

        const int32_t slot = st->slots[t];
        TDM_ASSERT(slot >= 0);
        const int64_t page = slot / kv->page_size, off = slot % kv->page_size;
        TDM_ASSERT(page < kv->n_pages);
        const size_t half_page = (size_t)nkv * kv->page_size * hd * eb; /* K (or V) of a page */
        uint8_t *kpage = (uint8_t *)kv->base + (size_t)page * (latent ? 1 : 2) * half_page;
        uint8_t *vpage = kpage + half_page;
        if (latent) { /* one row: the latent, then the rotated rope key */
            const size_t dst = (size_t)off * hd * eb;
            memcpy(krot, job->k + (size_t)t * (hd - rd), (size_t)(hd - rd) * sizeof(float));
            memcpy(krot + (hd - rd), job->v + (size_t)t * rd, (size_t)rd * sizeof(float));
            rotate(krot + (hd - rd), cs, sn, rd, job->rope->neox);
            if (f32)
                memcpy(kpage + dst, krot, head_bytes);
            else
                job->k_isa->kv_narrow(kv->dtype, krot, (uint16_t *)(kpage + dst), hd);
            continue;
        }
        const float *k = job->k + (size_t)t * nkv * hd;
        const float *v = job->v + (size_t)t * nkv * hd;
        for (int g = 0; g < nkv; g++) {
            const size_t dst = ((size_t)g * kv->page_size + (size_t)off) * hd * eb;
            memcpy(krot, k + (size_t)g * hd, head_bytes);
            rotate(krot + (hd - rd), cs, sn, rd, job->rope->neox);
            if (f32) {
                memcpy(kpage + dst, krot, head_bytes);
                memcpy(vpage + dst, v + (size_t)g * hd, head_bytes);
            } else {
                job->k_isa->kv_narrow(kv->dtype, krot, (uint16_t *)(kpage + dst), hd);
                job->k_isa->kv_narrow(kv->dtype, v + (size_t)g * hd, (uint16_t *)(vpage + dst), hd);
            }
        }
    }
}

void tdm_cpu_rope_kv_append(tdm_backend_t *b, float *q, const float *k, const float *v, int n_heads,
                            const struct tdm_step *st, const struct tdm_rope *rope,
                            const struct tdm_kv_layer *kv)
{
    TDM_ASSERT(rope->head_dim == kv->head_dim && rope->head_dim > 0 &&
               rope->head_dim <= TDM_CPU_MAX_HEAD_DIM && rope->rot_dim >= 0 &&
               rope->rot_dim <= rope->head_dim && rope->rot_dim % 2 == 0 &&
               (rope->rot_dim || rope->head_dim % 2 == 0));
    TDM_ASSERT(kv->v_dim == 0 || (kv->n_kv_heads == 1 && rope->rot_dim > 0));
    TDM_ASSERT(st->page_size == kv->page_size && kv->page_size > 0);
    if (st->n_tokens <= 0) return;
    TDM_ASSERT(tdm_kv_elem_bytes(kv->dtype));
    struct rope_job job = {.k_isa = tdm_cpu_of(b)->k,
                           .q = q,
                           .k = k,
                           .v = v,
                           .n_heads = n_heads,
                           .st = st,
                           .rope = rope,
                           .kv = kv};
    const int64_t work = (int64_t)st->n_tokens * (n_heads + 2 * kv->n_kv_heads) * rope->head_dim;
    tdm_cpu_run(tdm_cpu_of(b), work, rope_worker, &job);
}
