/*
 * `tandem checkpoint`: writes a random-weight Hugging Face checkpoint (config.json plus
 * safetensors) for a named shape or a given config.json, so that benchmarks need no downloads.
 *
 * What is written: the real shape's config.json (hyperparameters of Llama-3.2-1B, Llama-3.1-8B
 * or SmolLM2-135M, or the user's file with torch_dtype set to the chosen dtype), and every tensor
 * under its HF name (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, ...,
 * lm_head.weight unless the embeddings are tied), in one model.safetensors, or in shards
 * model-0000K-of-0000M.safetensors of at most --max-shard-bytes (default 5e9, HF's "5GB") with a
 * model.safetensors.index.json. Architectures: llama and mistral (q/k/v/o and mlp biases when
 * attention_bias / mlp_bias say so), qwen2 (q/k/v biases), qwen3 (q_norm, k_norm).
 *
 * Values follow HF's initialisation, so forward passes stay numerically sane: matrices and
 * embeddings ~ N(0, std^2) with std = --std, else the config's initializer_range, else 0.02;
 * norm weights 1; biases 0. "Normal" is Irwin-Hall of four 16-bit uniforms, rescaled to unit
 * variance (bounded by +-3.46 std): cheap, smooth, and plenty for random weights.
 *
 * Why this shape: the 8B checkpoint is 16 GB, so nothing is held whole. Each shard is streamed
 * to disk in 16 MiB chunks through two buffers: the thread pool fills one while a writer thread
 * writes the other, so generation and disk I/O overlap. Values are
 * keyed by (seed, tensor index, 4096-element block), never by chunk or thread, so the bytes
 * depend on the seed and shape alone (the same for any --threads).
 *
 * Ownership and errors: the command owns every buffer; a failed write removes the shard it was
 * writing and reports the reason. An existing checkpoint in --out is not overwritten without
 * --force. The space needed is checked against the free space first.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "tools/tools_int.h"

#define CK_BLOCK         4096 /* elements per RNG block */
#define CK_CHUNK_BYTES   (16u << 20)
#define CK_MAX_TENSORS   65536
#define CK_MAX_CONFIG    (1u << 20)
#define CK_NAME_BYTES    96
#define CK_DEFAULT_SHARD 5000000000ll

enum ck_dtype { CK_BF16, CK_F16, CK_F32 };
enum ck_init { CK_NORMAL, CK_ONES, CK_ZEROS };

static const struct {
    const char *name, *torch, *st;
    int bytes;
} DTYPES[] = {[CK_BF16] = {"bf16", "bfloat16", "BF16", 2},
              [CK_F16] = {"f16", "float16", "F16", 2},
              [CK_F32] = {"f32", "float32", "F32", 4}};

struct ck_tensor {
    char name[CK_NAME_BYTES];
    int64_t shape[2];
    int ndim;
    enum ck_init init;
    int shard;
    uint64_t offset; /* within its shard's data section */
    uint64_t n_elems;
};

/* ---- named shapes (HF config.json of the real models) ---- */

static json_t *llama3_config(int hidden, int layers, int inter, double rope_factor, bool tied)
{
    return json_pack("{s:[s],s:b,s:f,s:i,s:i,s:i,s:s,s:i,s:f,s:i,s:i,s:b,s:s,s:i,s:i,s:i,s:i,s:f,"
                     "s:{s:f,s:f,s:f,s:i,s:s},s:f,s:b,s:s,s:b,s:i}",
                     "architectures", "LlamaForCausalLM", "attention_bias", 0, "attention_dropout",
                     0.0, "bos_token_id", 128000, "eos_token_id", 128001, "head_dim", hidden / 32,
                     "hidden_act", "silu", "hidden_size", hidden, "initializer_range", 0.02,
                     "intermediate_size", inter, "max_position_embeddings", 131072, "mlp_bias", 0,
                     "model_type", "llama", "num_attention_heads", 32, "num_hidden_layers", layers,
                     "num_key_value_heads", 8, "pretraining_tp", 1, "rms_norm_eps", 1e-5,
                     "rope_scaling", "factor", rope_factor, "high_freq_factor", 4.0,
                     "low_freq_factor", 1.0, "original_max_position_embeddings", 8192, "rope_type",
                     "llama3", "rope_theta", 500000.0, "tie_word_embeddings", tied, "torch_dtype",
                     "bfloat16", "use_cache", 1, "vocab_size", 128256);
}

static json_t *named_config(const char *shape)
{
    if (!strcmp(shape, "llama-3.2-1b")) return llama3_config(2048, 16, 8192, 32.0, true);
    if (!strcmp(shape, "llama-3.1-8b")) return llama3_config(4096, 32, 14336, 8.0, false);
    if (!strcmp(shape, "smollm2-135m"))
        return json_pack("{s:[s],s:b,s:i,s:i,s:i,s:s,s:i,s:f,s:i,s:i,s:b,s:s,s:i,s:i,s:i,s:f,s:n,"
                         "s:f,s:b,s:s,s:b,s:i}",
                         "architectures", "LlamaForCausalLM", "attention_bias", 0, "bos_token_id",
                         1, "eos_token_id", 2, "head_dim", 64, "hidden_act", "silu", "hidden_size",
                         576, "initializer_range", 0.02, "intermediate_size", 1536,
                         "max_position_embeddings", 8192, "mlp_bias", 0, "model_type", "llama",
                         "num_attention_heads", 9, "num_hidden_layers", 30, "num_key_value_heads",
                         3, "rms_norm_eps", 1e-5, "rope_scaling", "rope_theta", 100000.0,
                         "tie_word_embeddings", 1, "torch_dtype", "bfloat16", "use_cache", 1,
                         "vocab_size", 49152);
    return NULL;
}

/* ---- the tensor list ---- */

struct ck_shape {
    int64_t hidden, layers, heads, kv_heads, head_dim, inter, vocab;
    bool tied, qkv_bias, o_bias, mlp_bias, qk_norm;
    double std;
};

static bool cfg_int(json_t *cfg, const char *key, bool required, int64_t dflt, int64_t hi,
                    int64_t *out)
{
    json_t *v = json_object_get(cfg, key);
    if (!v || json_is_null(v)) {
        if (required) {
            fprintf(stderr, "tandem: checkpoint: config.json has no \"%s\"\n", key);
            return false;
        }
        *out = dflt;
        return true;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > hi) {
        fprintf(stderr, "tandem: checkpoint: config \"%s\" must be an integer in [1, %lld]\n", key,
                (long long)hi);
        return false;
    }
    *out = json_integer_value(v);
    return true;
}

static bool cfg_bool(json_t *cfg, const char *key, bool dflt, bool *out)
{
    json_t *v = json_object_get(cfg, key);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return true;
    }
    if (!json_is_boolean(v)) {
        fprintf(stderr, "tandem: checkpoint: config \"%s\" must be true or false\n", key);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

static bool shape_from_config(json_t *cfg, struct ck_shape *s)
{
    json_t *mt = json_object_get(cfg, "model_type");
    const char *type = json_is_string(mt) ? json_string_value(mt) : "";
    bool llama = !strcmp(type, "llama") || !strcmp(type, "mistral");
    bool qwen2 = !strcmp(type, "qwen2"), qwen3 = !strcmp(type, "qwen3");
    if (!llama && !qwen2 && !qwen3) {
        fprintf(stderr,
                "tandem: checkpoint: model_type \"%.64s\" is not supported (llama, mistral, "
                "qwen2, qwen3)\n",
                type);
        return false;
    }
    memset(s, 0, sizeof *s);
    if (!cfg_int(cfg, "hidden_size", true, 0, 1 << 17, &s->hidden) ||
        !cfg_int(cfg, "num_hidden_layers", true, 0, 4096, &s->layers) ||
        !cfg_int(cfg, "num_attention_heads", true, 0, 4096, &s->heads) ||
        !cfg_int(cfg, "num_key_value_heads", false, s->heads, 4096, &s->kv_heads) ||
        !cfg_int(cfg, "intermediate_size", true, 0, 1 << 20, &s->inter) ||
        !cfg_int(cfg, "vocab_size", true, 0, 1 << 24, &s->vocab))
        return false;
    if (s->hidden % s->heads && !json_object_get(cfg, "head_dim")) {
        fprintf(stderr, "tandem: checkpoint: hidden_size is not a multiple of the heads\n");
        return false;
    }
    if (!cfg_int(cfg, "head_dim", false, s->hidden / s->heads, 4096, &s->head_dim)) return false;
    if (s->heads % s->kv_heads) {
        fprintf(stderr, "tandem: checkpoint: num_attention_heads is not a multiple of "
                        "num_key_value_heads\n");
        return false;
    }
    bool attn_bias, mlp_bias;
    if (!cfg_bool(cfg, "tie_word_embeddings", false, &s->tied) ||
        !cfg_bool(cfg, "attention_bias", false, &attn_bias) ||
        !cfg_bool(cfg, "mlp_bias", false, &mlp_bias))
        return false;
    s->qkv_bias = qwen2 || (llama && attn_bias) || (qwen3 && attn_bias);
    s->o_bias = llama && attn_bias;
    s->mlp_bias = llama && mlp_bias;
    s->qk_norm = qwen3;
    json_t *ir = json_object_get(cfg, "initializer_range");
    s->std = json_is_number(ir) && json_number_value(ir) > 0 && json_number_value(ir) < 10
                 ? json_number_value(ir)
                 : 0.02;
    return true;
}

static void add(struct ck_tensor *t, int *n, enum ck_init init, int64_t d0, int64_t d1,
                const char *fmt, int layer)
{
    struct ck_tensor *x = &t[(*n)++];
    snprintf(x->name, sizeof x->name, fmt, layer);
    x->shape[0] = d0;
    x->shape[1] = d1;
    x->ndim = d1 ? 2 : 1;
    x->init = init;
    x->n_elems = (uint64_t)d0 * (uint64_t)(d1 ? d1 : 1);
}

/* HF module order: embeddings, each layer, final norm, lm_head. Returns the count. */
static int list_tensors(const struct ck_shape *s, struct ck_tensor *t)
{
    int n = 0;
    int64_t q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    add(t, &n, CK_NORMAL, s->vocab, s->hidden, "model.embed_tokens.weight", 0);
    for (int l = 0; l < s->layers; l++) {
        add(t, &n, CK_ONES, s->hidden, 0, "model.layers.%d.input_layernorm.weight", l);
        add(t, &n, CK_NORMAL, q, s->hidden, "model.layers.%d.self_attn.q_proj.weight", l);
        add(t, &n, CK_NORMAL, kv, s->hidden, "model.layers.%d.self_attn.k_proj.weight", l);
        add(t, &n, CK_NORMAL, kv, s->hidden, "model.layers.%d.self_attn.v_proj.weight", l);
        add(t, &n, CK_NORMAL, s->hidden, q, "model.layers.%d.self_attn.o_proj.weight", l);
        if (s->qkv_bias) {
            add(t, &n, CK_ZEROS, q, 0, "model.layers.%d.self_attn.q_proj.bias", l);
            add(t, &n, CK_ZEROS, kv, 0, "model.layers.%d.self_attn.k_proj.bias", l);
            add(t, &n, CK_ZEROS, kv, 0, "model.layers.%d.self_attn.v_proj.bias", l);
        }
        if (s->o_bias)
            add(t, &n, CK_ZEROS, s->hidden, 0, "model.layers.%d.self_attn.o_proj.bias", l);
        if (s->qk_norm) {
            add(t, &n, CK_ONES, s->head_dim, 0, "model.layers.%d.self_attn.q_norm.weight", l);
            add(t, &n, CK_ONES, s->head_dim, 0, "model.layers.%d.self_attn.k_norm.weight", l);
        }
        add(t, &n, CK_ONES, s->hidden, 0, "model.layers.%d.post_attention_layernorm.weight", l);
        add(t, &n, CK_NORMAL, s->inter, s->hidden, "model.layers.%d.mlp.gate_proj.weight", l);
        add(t, &n, CK_NORMAL, s->inter, s->hidden, "model.layers.%d.mlp.up_proj.weight", l);
        add(t, &n, CK_NORMAL, s->hidden, s->inter, "model.layers.%d.mlp.down_proj.weight", l);
        if (s->mlp_bias) {
            add(t, &n, CK_ZEROS, s->inter, 0, "model.layers.%d.mlp.gate_proj.bias", l);
            add(t, &n, CK_ZEROS, s->inter, 0, "model.layers.%d.mlp.up_proj.bias", l);
            add(t, &n, CK_ZEROS, s->hidden, 0, "model.layers.%d.mlp.down_proj.bias", l);
        }
    }
    add(t, &n, CK_ONES, s->hidden, 0, "model.norm.weight", 0);
    if (!s->tied) add(t, &n, CK_NORMAL, s->vocab, s->hidden, "lm_head.weight", 0);
    return n;
}

/* ---- values ---- */

struct ck_gen_job {
    const struct ck_tensor *t;
    int tensor_index;
    uint64_t seed;
    uint64_t first; /* first element, a multiple of CK_BLOCK */
    uint64_t count;
    enum ck_dtype dtype;
    float std;
    uint8_t *out;
};

/* Round to nearest even; the values here are finite, so no NaN case. */
static inline uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Elements [b, e) of the job (block-aligned b), converted to the dtype into j->out. */
static void gen_range(const struct ck_gen_job *j, int64_t b, int64_t e)
{
    float v[CK_BLOCK];
    /* Irwin-Hall(4): the sum of four U[0,1) has mean 2 and variance 1/3. */
    const float scale = j->std * 1.7320508f / 65536.0f, center = 2.0f * 65536.0f;
    for (int64_t blk = b; blk < e; blk += CK_BLOCK) {
        int n = (int)TDM_MIN((int64_t)CK_BLOCK, e - blk);
        if (j->t->init == CK_NORMAL) {
            /* Each block has its own stream, keyed by (seed, tensor, block). */
            uint64_t g = (j->first + (uint64_t)blk) / CK_BLOCK;
            uint64_t k = j->seed ^ ((uint64_t)j->tensor_index << 40) ^ g;
            uint64_t state =
                tdm_tool_splitmix64(&k) ^ (0xD1B54A32D192ED03ull * (uint64_t)(j->tensor_index + 1));
            for (int i = 0; i < n; i++) {
                uint64_t r = tdm_tool_splitmix64(&state);
                float sum = (float)(r & 0xffff) + (float)((r >> 16) & 0xffff) +
                            (float)((r >> 32) & 0xffff) + (float)(r >> 48);
                v[i] = (sum - center) * scale;
            }
        } else {
            float c = j->t->init == CK_ONES ? 1.0f : 0.0f;
            for (int i = 0; i < n; i++)
                v[i] = c;
        }
        if (j->dtype == CK_F32) {
            memcpy(j->out + (size_t)blk * 4, v, (size_t)n * 4);
        } else if (j->dtype == CK_BF16) {
            uint16_t *o = (uint16_t *)(void *)(j->out + (size_t)blk * 2);
            for (int i = 0; i < n; i++)
                o[i] = to_bf16(v[i]);
        } else {
            uint16_t *o = (uint16_t *)(void *)(j->out + (size_t)blk * 2);
            for (int i = 0; i < n; i++)
                o[i] = tdm_f32_to_f16(v[i]);
        }
    }
}

static void gen_worker(void *ctx, int ith, int nth)
{
    const struct ck_gen_job *j = ctx;
    int64_t b, e;
    tdm_split_range((int64_t)j->count, ith, nth, CK_BLOCK, &b, &e);
    if (e > b) gen_range(j, b, e);
}

/* ---- writing ---- */

static bool write_all(int fd, const void *p, size_t n, const char *path)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            fprintf(stderr, "tandem: checkpoint: writing %s: %s\n", path,
                    w < 0 ? strerror(errno) : "short write");
            return false;
        }
        b += w;
        n -= (size_t)w;
    }
    return true;
}

static char *shard_header(const struct ck_tensor *t, int n, int shard, enum ck_dtype dt,
                          size_t *len)
{
    json_t *h = json_pack("{s:{s:s}}", "__metadata__", "format", "pt");
    char *out = NULL;
    for (int i = 0; h && i < n; i++) {
        if (t[i].shard != shard) continue;
        uint64_t bytes = t[i].n_elems * (uint64_t)DTYPES[dt].bytes;
        json_t *shape = t[i].ndim == 2 ? json_pack("[I,I]", (json_int_t)t[i].shape[0],
                                                   (json_int_t)t[i].shape[1])
                                       : json_pack("[I]", (json_int_t)t[i].shape[0]);
        json_t *o =
            json_pack("{s:s,s:o,s:[I,I]}", "dtype", DTYPES[dt].st, "shape", shape, "data_offsets",
                      (json_int_t)t[i].offset, (json_int_t)(t[i].offset + bytes));
        if (!o || json_object_set_new(h, t[i].name, o)) goto out;
    }
    char *js = json_dumps(h, JSON_COMPACT);
    if (!js) goto out;
    size_t n_js = strlen(js), padded = (n_js + 7) & ~(size_t)7;
    out = malloc(8 + padded);
    if (out) {
        uint64_t le = padded; /* little-endian host (x86-64, aarch64) */
        memcpy(out, &le, 8);
        memcpy(out + 8, js, n_js);
        memset(out + 8 + n_js, ' ', padded - n_js);
        *len = 8 + padded;
    }
    free(js);
out:
    json_decref(h);
    return out;
}

static void shard_name(char *buf, size_t cap, int shard, int n_shards)
{
    if (n_shards == 1)
        snprintf(buf, cap, "model.safetensors");
    else
        snprintf(buf, cap, "model-%05d-of-%05d.safetensors", shard + 1, n_shards);
}

/* Double buffering: the pool fills one buffer while this thread writes the other.
 *
 *   slot: FREE --(producer fills)--> FULL --(writer writes)--> FREE
 *
 * The producer takes slots in turn (0, 1, 0, ...) and the writer drains them in the same order,
 * so the file receives chunks in generation order. A failed write sets `failed`; the producer
 * sees it at its next slot and stops. */
struct ck_writer {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int fd;
    const char *path;
    uint8_t *buf[2];
    size_t len[2];
    bool full[2], done, failed;
};

static void *writer_main(void *arg)
{
    struct ck_writer *w = arg;
    int slot = 0;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->full[slot] && !w->done)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->full[slot]) break; /* done, and nothing left */
        pthread_mutex_unlock(&w->mu);
        bool ok = write_all(w->fd, w->buf[slot], w->len[slot], w->path);
        pthread_mutex_lock(&w->mu);
        w->full[slot] = false;
        if (!ok) w->failed = true;
        pthread_cond_broadcast(&w->cv);
        if (!ok) break;
        slot ^= 1;
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Waits for `slot` to be free; false when the writer has failed. */
static bool writer_acquire(struct ck_writer *w, int slot)
{
    pthread_mutex_lock(&w->mu);
    while (w->full[slot] && !w->failed)
        pthread_cond_wait(&w->cv, &w->mu);
    bool ok = !w->failed;
    pthread_mutex_unlock(&w->mu);
    return ok;
}

static void writer_submit(struct ck_writer *w, int slot, size_t len)
{
    pthread_mutex_lock(&w->mu);
    w->len[slot] = len;
    w->full[slot] = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static bool write_shard(const char *dir, const struct ck_tensor *t, int n, int shard, int n_shards,
                        enum ck_dtype dt, uint64_t seed, float std, tdm_pool_t *pool,
                        uint8_t *bufs[2], uint64_t *written)
{
    char name[64], path[4096];
    shard_name(name, sizeof name, shard, n_shards);
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) {
        fprintf(stderr, "tandem: checkpoint: --out path too long\n");
        return false;
    }
    size_t hlen = 0;
    char *header = shard_header(t, n, shard, dt, &hlen);
    if (!header) {
        fprintf(stderr, "tandem: checkpoint: out of memory\n");
        return false;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "tandem: checkpoint: cannot create %s: %s\n", path, strerror(errno));
        free(header);
        return false;
    }
    bool ok = write_all(fd, header, hlen, path);
    *written += hlen;
    struct ck_writer w = {.fd = fd, .path = path, .buf = {bufs[0], bufs[1]}};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    bool started = ok && pthread_create(&w.thread, NULL, writer_main, &w) == 0;
    if (ok && !started) {
        fprintf(stderr, "tandem: checkpoint: cannot start the writer thread\n");
        ok = false;
    }
    const uint64_t per_chunk = CK_CHUNK_BYTES / (uint64_t)DTYPES[dt].bytes; /* whole blocks */
    int slot = 0;
    for (int i = 0; ok && i < n; i++) {
        if (t[i].shard != shard) continue;
        for (uint64_t first = 0; ok && first < t[i].n_elems; first += per_chunk) {
            if (!writer_acquire(&w, slot)) {
                ok = false;
                break;
            }
            struct ck_gen_job j = {.t = &t[i],
                                   .tensor_index = i,
                                   .seed = seed,
                                   .first = first,
                                   .count = TDM_MIN(per_chunk, t[i].n_elems - first),
                                   .dtype = dt,
                                   .std = std,
                                   .out = bufs[slot]};
            tdm_pool_run(pool, gen_worker, &j);
            size_t bytes = (size_t)j.count * (size_t)DTYPES[dt].bytes;
            writer_submit(&w, slot, bytes);
            *written += bytes;
            slot ^= 1;
        }
    }
    if (started) {
        pthread_mutex_lock(&w.mu);
        w.done = true;
        pthread_cond_broadcast(&w.cv);
        pthread_mutex_unlock(&w.mu);
        pthread_join(w.thread, NULL);
        if (w.failed) ok = false;
    }
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    if (close(fd) != 0 && ok) {
        fprintf(stderr, "tandem: checkpoint: closing %s: %s\n", path, strerror(errno));
        ok = false;
    }
    if (!ok) unlink(path);
    free(header);
    return ok;
}

/* The HF index: {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}. */
static json_t *build_index(const struct ck_tensor *t, int n, int n_shards, uint64_t total)
{
    json_t *map = json_object();
    json_t *index =
        json_pack("{s:{s:I},s:o}", "metadata", "total_size", (json_int_t)total, "weight_map", map);
    for (int i = 0; index && i < n; i++) {
        char name[64];
        shard_name(name, sizeof name, t[i].shard, n_shards);
        if (json_object_set_new(map, t[i].name, json_string(name))) {
            json_decref(index);
            return NULL;
        }
    }
    return index;
}

static bool write_json(json_t *j, const char *dir, const char *file)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", dir, file) >= (int)sizeof path ||
        json_dump_file(j, path, JSON_INDENT(2)) != 0) {
        fprintf(stderr, "tandem: checkpoint: cannot write %s/%s\n", dir, file);
        return false;
    }
    return true;
}

static bool make_dir(const char *dir, bool force)
{
    char path[4096];
    if (strlen(dir) >= sizeof path) {
        fprintf(stderr, "tandem: checkpoint: --out path too long\n");
        return false;
    }
    strcpy(path, dir);
    for (char *p = path + 1; *p; p++) { /* mkdir -p */
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST) break;
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandem: checkpoint: cannot create %s: %s\n", dir, strerror(errno));
        return false;
    }
    const char *existing[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
    for (size_t i = 0; !force && i < TDM_ARRAY_LEN(existing); i++) {
        struct stat sb;
        if (snprintf(path, sizeof path, "%s/%s", dir, existing[i]) < (int)sizeof path &&
            stat(path, &sb) == 0) {
            fprintf(stderr, "tandem: checkpoint: %s already exists (pass --force to overwrite)\n",
                    path);
            return false;
        }
    }
    return true;
}

/* ---- command ---- */

static void usage(FILE *f)
{
    fprintf(f, "usage: tandem checkpoint (--shape NAME | --config FILE) --out DIR [options]\n"
               "\n"
               "Writes a random-weight Hugging Face checkpoint (config.json + safetensors).\n"
               "\n"
               "  --shape NAME            llama-3.2-1b, llama-3.1-8b or smollm2-135m\n"
               "  --config FILE           an HF config.json (llama, mistral, qwen2, qwen3)\n"
               "  --out DIR               output folder (created)\n"
               "  --dtype T               bf16 (default), f16 or f32\n"
               "  --seed N                weights seed (default 0)\n"
               "  --std F                 std of the matrices (default: initializer_range or "
               "0.02)\n"
               "  --max-shard-bytes N     shard above this size (default 5000000000)\n"
               "  --threads N             generator threads (default: all cores)\n"
               "  --force                 overwrite an existing checkpoint in DIR\n"
               "  --dry-run               print the plan (index, sizes, config) as JSON; write "
               "nothing\n");
}

static bool opt_dtype(const char *arg, void *dst)
{
    for (int d = 0; d < (int)TDM_ARRAY_LEN(DTYPES); d++)
        if (!strcmp(arg, DTYPES[d].name)) {
            *(int *)dst = d;
            return true;
        }
    fprintf(stderr, "tandem: --dtype: expected bf16, f16 or f32, got '%s'\n", arg);
    return false;
}

int tdm_cmd_checkpoint(int argc, char **argv)
{
    const char *shape_name = NULL, *config_path = NULL, *out = NULL;
    int dtype = -1, n_threads = 0, rc = 2, n_tensors = 0, n_shards = 1;
    uint64_t seed = 0;
    double std = 0;
    int64_t max_shard = CK_DEFAULT_SHARD;
    bool force = false, dry_run = false;
    json_t *cfg = NULL;
    struct ck_tensor *t = NULL;
    tdm_pool_t *pool = NULL;
    uint8_t *bufs[2] = {NULL, NULL};

    int64_t seed_v = 0, threads_v = 0;
    const struct tdm_opt own[] = {
        TDM_OPT_S("shape", &shape_name),
        TDM_OPT_S("config", &config_path),
        TDM_OPT_S("out", &out),
        TDM_OPT_P("dtype", opt_dtype, &dtype),
        TDM_OPT_I("seed", &seed_v, 0, 9.0e18),
        TDM_OPT_F("std", &std, 1e-6, 10),
        TDM_OPT_I("max-shard-bytes", &max_shard, 1, 4.0e18),
        TDM_OPT_I("threads", &threads_v, 1, 1024),
        TDM_OPT_B("force", &force),
        TDM_OPT_B("dry-run", &dry_run),
        TDM_OPT_END,
    };
    const struct tdm_opt *const tables[] = {own, NULL};
    int prc = tdm_tool_parse("checkpoint", argc, argv, tables, usage);
    if (prc) {
        rc = prc == 1 ? 0 : 2;
        goto out;
    }
    seed = (uint64_t)seed_v;
    n_threads = (int)threads_v;
    if ((!out && !dry_run) || (!shape_name == !config_path)) {
        fprintf(stderr, "tandem: checkpoint: needs --out and one of --shape or --config\n");
        usage(stderr);
        goto out;
    }
    if (shape_name) {
        cfg = named_config(shape_name);
        if (!cfg) {
            fprintf(stderr,
                    "tandem: --shape: expected llama-3.2-1b, llama-3.1-8b or smollm2-135m, got "
                    "'%s'\n",
                    shape_name);
            goto out;
        }
    } else {
        char *text = NULL;
        size_t len = 0;
        if (tdm_file_read(config_path, CK_MAX_CONFIG, &text, &len) != TDM_OK) {
            fprintf(stderr, "tandem: --config: %s\n", tdm_err_msg());
            goto out;
        }
        json_error_t jerr;
        cfg = json_loadb(text, len, 0, &jerr);
        free(text);
        if (!json_is_object(cfg)) {
            fprintf(stderr, "tandem: --config: %s: not a JSON object (%s)\n", config_path,
                    jerr.text);
            goto out;
        }
        if (dtype < 0) { /* keep the file's torch_dtype when it is one we write */
            json_t *td = json_object_get(cfg, "torch_dtype");
            for (int d = 0; json_is_string(td) && d < (int)TDM_ARRAY_LEN(DTYPES); d++)
                if (!strcmp(json_string_value(td), DTYPES[d].torch)) dtype = d;
        }
    }
    if (dtype < 0) dtype = CK_BF16;
    struct ck_shape s;
    if (!shape_from_config(cfg, &s)) goto out;
    if (std > 0) s.std = std;
    json_object_set_new(cfg, "torch_dtype", json_string(DTYPES[dtype].torch));

    int64_t per_layer = 9 + (s.qk_norm ? 2 : 0) + (s.qkv_bias ? 3 : 0) + s.o_bias + 3 * s.mlp_bias;
    if (s.layers * per_layer + 3 > CK_MAX_TENSORS) {
        fprintf(stderr, "tandem: checkpoint: too many tensors\n");
        goto out;
    }
    rc = 1;
    t = calloc((size_t)(s.layers * per_layer + 3), sizeof *t);
    if (!t) {
        fprintf(stderr, "tandem: checkpoint: out of memory\n");
        goto out;
    }
    n_tensors = list_tensors(&s, t);

    /* Shards: tensors in order, a new shard when the next tensor would pass the cap. */
    uint64_t shard_bytes = 0, total = 0, params = 0;
    int shard = 0;
    for (int i = 0; i < n_tensors; i++) {
        uint64_t bytes = t[i].n_elems * (uint64_t)DTYPES[dtype].bytes;
        if (shard_bytes > 0 && shard_bytes + bytes > (uint64_t)max_shard) {
            shard++;
            shard_bytes = 0;
        }
        t[i].shard = shard;
        t[i].offset = shard_bytes;
        shard_bytes += bytes;
        total += bytes;
        params += t[i].n_elems;
    }
    n_shards = shard + 1;
    if (n_shards > 99999) {
        fprintf(stderr, "tandem: checkpoint: over 99999 shards; raise --max-shard-bytes\n");
        goto out;
    }
    if (dry_run) { /* the plan only: index, sizes, config; nothing is written */
        json_t *plan = build_index(t, n_tensors, n_shards, total);
        if (!plan || json_object_set_new(plan, "n_params", json_integer((json_int_t)params)) ||
            json_object_set_new(plan, "n_tensors", json_integer(n_tensors)) ||
            json_object_set_new(plan, "n_shards", json_integer(n_shards)) ||
            json_object_set(plan, "config", cfg) || json_dumpf(plan, stdout, JSON_INDENT(1))) {
            fprintf(stderr, "tandem: checkpoint: out of memory\n");
            json_decref(plan);
            goto out;
        }
        fputc('\n', stdout);
        json_decref(plan);
        rc = 0;
        goto out;
    }
    if (!make_dir(out, force)) goto out;
    struct statvfs vfs;
    if (statvfs(out, &vfs) == 0 &&
        (uint64_t)vfs.f_bavail * vfs.f_frsize < total + ((uint64_t)n_shards << 20)) {
        fprintf(stderr, "tandem: checkpoint: %s has %.2f GB free, the checkpoint needs %.2f GB\n",
                out, (double)vfs.f_bavail * vfs.f_frsize / 1e9, (double)total / 1e9);
        goto out;
    }
    if (tdm_pool_create(n_threads, &pool) != TDM_OK || !(bufs[0] = malloc(CK_CHUNK_BYTES)) ||
        !(bufs[1] = malloc(CK_CHUNK_BYTES))) {
        fprintf(stderr, "tandem: checkpoint: cannot start the generator: %s\n", tdm_err_msg());
        goto out;
    }

    fprintf(stderr,
            "tandem: checkpoint: %d tensors, %llu params, %llu bytes (%.2f GB) %s in %d file%s\n",
            n_tensors, (unsigned long long)params, (unsigned long long)total, (double)total / 1e9,
            DTYPES[dtype].name, n_shards, n_shards > 1 ? "s" : "");
    double t0 = tdm_now_s();
    uint64_t written = 0;
    if (!write_json(cfg, out, "config.json")) goto out;
    for (int k = 0; k < n_shards; k++) {
        if (!write_shard(out, t, n_tensors, k, n_shards, (enum ck_dtype)dtype, seed, (float)s.std,
                         pool, bufs, &written))
            goto out;
        if (n_shards > 1 && isatty(STDERR_FILENO))
            fprintf(stderr, "\rtandem: checkpoint: shard %d/%d written", k + 1, n_shards);
    }
    if (n_shards > 1) {
        if (isatty(STDERR_FILENO)) fputc('\n', stderr);
        json_t *index = build_index(t, n_tensors, n_shards, total);
        bool ok = index && write_json(index, out, "model.safetensors.index.json");
        json_decref(index);
        if (!ok) goto out;
    }
    double dt = tdm_now_s() - t0;
    fprintf(stderr, "tandem: checkpoint: wrote %s in %.1f s (%.0f MB/s)\n", out, dt,
            (double)written / 1e6 / (dt > 0 ? dt : 1e-9));
    rc = 0;
out:
    free(bufs[0]);
    free(bufs[1]);
    tdm_pool_destroy(pool);
    free(t);
    json_decref(cfg);
    return rc;
}
