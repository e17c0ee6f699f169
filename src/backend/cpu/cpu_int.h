/*
 * Private declarations of the CPU backend: the instance struct, the instruction-set levels and
 * the per-ISA kernel tables that the op files dispatch through.
 *
 * Shape: every op is a plain C function in its op-family file (norm.c, rope.c, attention.c,
 * matmul.c, elementwise.c, rows.c). Only the inner loops of matmul and attention differ per
 * ISA: the portable ones live in matmul.c and attention.c, the others in *_avx2.c and
 * *_avx512.c, which the build compiles with the matching -m flags. Which table an instance
 * uses is fixed at create time, so one process may hold a portable and an AVX2 backend side by
 * side (the tests do).
 *
 * Matmul tiles: a tile computes R consecutive weight rows against C activation rows
 * (1 <= R, C <= TDM_CPU_TILE_MAX). Within one ISA, every tile shape performs, for each
 * (weight row, activation row) pair, the very same sequence of floating-point operations; the
 * shape only changes how many pairs share one pass over the weight bytes. That is what makes
 * out[i][r] independent of the batch size and of how rows are split over threads.
 *
 * The AMX int8 tiles (qdot_amx.c) are outside the tables: not a level but a flag of the
 * instance (amx), on the avx512 level where the CPU and OS run them, taken by matmul.c for the
 * Q8_0/Q4_0/Q4_1 products of several activation rows in 16 x 16 tiles with the same bits.
 *
 * Threading: an instance is driven by one thread; ops fan out over `pool`. Kernel tables are
 * immutable.
 */
#ifndef TANDEM_BACKEND_CPU_INT_H
#define TANDEM_BACKEND_CPU_INT_H

#include "tandem/backend.h"

#include <assert.h>
#include <math.h>

/* Largest head_dim the attention and RoPE kernels accept (stack scratch is sized by it). */
/* A K row's width at most: a head's (TDM_MAX_HEAD_DIM), or an MLA layer's latent row */
#define TDM_CPU_MAX_HEAD_DIM 1024
/* Largest tile side of the matmul kernels. */
#define TDM_CPU_TILE_MAX 4

enum tdm_cpu_isa {
    TDM_CPU_ISA_PORTABLE = 0,
    TDM_CPU_ISA_AVX2,   /* AVX2 + FMA + F16C */
    TDM_CPU_ISA_AVX512, /* AVX-512 F/BW/VL/DQ + the AVX2 set */
    TDM_CPU_ISA_COUNT,
};

/* Weight dtypes the kernels run directly, as a dense index. */
enum tdm_cpu_wtype {
    TDM_CPU_W_F32 = 0,
    TDM_CPU_W_BF16,
    TDM_CPU_W_Q8_0,
    TDM_CPU_W_Q4_0,
    TDM_CPU_W_Q4_1,
    TDM_CPU_W_Q4_K, /* super-blocks of 256: fp32 tiles are the portable ones at every level */
    TDM_CPU_W_Q6_K,
    TDM_CPU_W_COUNT,
};

/* One tile: out[c * ldo + i] = sum_k x[c * ldx + k] * W[i][k] (+ bias[i]) for i < R, c < C.
 * w points at the tile's first weight row, out at out[first act][first row], bias at
 * bias[first row] or NULL. */
struct tdm_cpu_tile {
    const uint8_t *w;
    size_t row_bytes;
    int64_t cols;
    const float *x;
    int64_t ldx;
    float *out;
    int64_t ldo;
    const float *bias;
};
typedef void (*tdm_cpu_tile_fn)(const struct tdm_cpu_tile *t);

typedef tdm_cpu_tile_fn tdm_cpu_tile_table[TDM_CPU_W_COUNT][TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX];
/* [wtype][R - 1][C - 1], one per ISA file */
extern const tdm_cpu_tile_table tdm_cpu_tiles_portable;
extern const tdm_cpu_tile_table tdm_cpu_tiles_avx2;
extern const tdm_cpu_tile_table tdm_cpu_tiles_avx512;

/* ---- quantised activations (qdot.c explains the scheme) ---- */

/* One block of 32 activations quantised to two int8 planes (qdot.c): x[j] ~ d * v[j] with
 * v[j] = 256 * hi[j] + lo[j], lo the rounding left by hi; v itself is stored too, for the tiles
 * that multiply 16-bit integers (VPMADDWD) rather than bytes. */
struct tdm_cpu_xblock {
    int16_t v[32]; /* 256 hi[j] + lo[j]: the 16-bit value of both planes (VPMADDWD tiles) */
    int8_t hi[32]; /* rint(x[j] / (256 d)), in [-127, 127] */
    int8_t lo[32]; /* rint((x[j] - 256 d hi[j]) / d), in [-127, 127] */
    float d;       /* max |x[j]| / 127 / 256; 0 for a block of zeros (or of |x| < 2^-93) */
    float ds;      /* d * s: what a Q4_1 (Q4_K) block's minimum multiplies */
    int32_t s;     /* sum of v[j]: what folds Q4_0's offset of 8 into the integer sum */
    int32_t s16;   /* sum of v[j] for j < 16: Q6_K's offset of 32, per half (16 scales) */
};
static_assert(sizeof(struct tdm_cpu_xblock) == 144, "an xblock is 144 bytes");

/* A block whose step (max |x| / 127) is below this quantises to zeros (qdot.c). */
#define TDM_CPU_XQ_MIN_STEP 0x1p-100f

/* The weight dtypes the quantised path takes, as a dense index (TDM_CPU_W_* - TDM_CPU_W_Q8_0):
 * Q8_0, Q4_0, Q4_1, Q4_K, Q6_K. */
#define TDM_CPU_QW_COUNT 5

/* One quantised tile: out[c * ldo + i * ldr] = dot(W row i, x row c) (+ bias[i * ldr]) for
 * i < R, c < C, where W row i is the nb blocks at w + i * row_stride and x row c the nb blocks
 * at x + c * ldx. The tile's rows are the weight's adjacent rows (row_stride its row_bytes, ldr
 * 1), or, in the decode walk, rows a quarter of the thread's share apart (matmul.c says why).
 * `next` is how far the walk's next tile lies from this one's rows, in bytes: the tiles prefetch
 * from there on. */
struct tdm_cpu_qtile {
    const uint8_t *w;
    size_t row_stride;
    size_t next;
    int64_t nb; /* blocks of 32 per row (a multiple of 8 for the K-quants) */
    const struct tdm_cpu_xblock *x;
    int64_t ldx; /* blocks */
    float *out;
    int64_t ldo;
    int64_t ldr;
    const float *bias;
};
typedef void (*tdm_cpu_qtile_fn)(const struct tdm_cpu_qtile *t);
typedef tdm_cpu_qtile_fn tdm_cpu_qtile_table[TDM_CPU_QW_COUNT][TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX];
/* [wtype - Q8_0][R - 1][C - 1]; every table gives the portable one's bits (qdot.c) */
extern const tdm_cpu_qtile_table tdm_cpu_qtiles_portable;
extern const tdm_cpu_qtile_table tdm_cpu_qtiles_avx2;
extern const tdm_cpu_qtile_table tdm_cpu_qtiles_avx2_vnni;   /* AVX-VNNI CPUs only */
extern const tdm_cpu_qtile_table tdm_cpu_qtiles_avx512_vnni; /* AVX512-VNNI CPUs only */

/* ---- AMX int8 tiles (qdot_amx.c explains them) ---- */

/* Largest weight rows (and activation rows) of one AMX tile. */
#define TDM_CPU_AMX_TILE 16

/* One activation block of 16 activation rows (a column group), laid out for the AMX tiles:
 * plane[k][4c + j] is element 4k + j of activation row c's block (the VNNI order of a tile's
 * second source: 8 rows of 16 dwords), and the block's scalars as 16 lanes. Rows past the
 * group's end are zeros. A narrow group (8 rows or fewer) keeps lo in hi[k][32 + 4c + j] and
 * leaves lo[][] zero: one tile product then serves both planes (qdot_amx.c). */
struct tdm_cpu_xtile {
    int8_t hi[8][64];
    int8_t lo[8][64];
    float d[16];
    float ds[16];
    int32_t s[16];
    int32_t pad[16];
};
static_assert(sizeof(struct tdm_cpu_xtile) == 1280, "an xtile is 20 cache lines");

/* One AMX product: out[c * ldo + i] = dot(W row i, x row c) (+ bias[i]) for i < R, c < C
 * (1 <= R, C <= TDM_CPU_AMX_TILE), x the nb xtiles of one column group of exactly C rows (C
 * tells a narrow group). */
struct tdm_cpu_amx_tile {
    const uint8_t *w;
    size_t row_bytes;
    int64_t nb;
    const struct tdm_cpu_xtile *x;
    float *out;
    int64_t ldo;
    const float *bias;
};

/* Whether this CPU and OS run the AMX int8 tiles (CPUID AMX-TILE and AMX-INT8 on the AVX-512
 * level, XTILECFG and XTILEDATA enabled in XCR0, and Linux granting this process XTILEDATA
 * through arch_prctl). Asked once; the answer is cached. */
bool tdm_cpu_amx_available(void);
/* Whether a weight type runs on the AMX tiles (Q8_0, Q4_0, Q4_1). */
bool tdm_cpu_amx_wtype(int wtype);
/* The AMX tile of wtype (tdm_cpu_amx_wtype); only where tdm_cpu_amx_available(). */
void tdm_cpu_amx_qtile(const struct tdm_cpu_amx_tile *t, int wtype, int R, int C);
/* Lays out activation rows [0, n_rows) (n_rows <= 16, each nb blocks at xq + row * ldx) as the
 * nb xtiles of one column group (narrow for n_rows <= 8). */
void tdm_cpu_xtile_pack(const struct tdm_cpu_xblock *xq, int64_t ldx, int n_rows, int64_t nb,
                        struct tdm_cpu_xtile *out);
/* Turns an instance's AMX tiles on or off (TDM_EUNSUPPORTED: on where they are not available,
 * or on a level below avx512). For tests that compare kernels in one process. */
tdm_status tdm_cpu_amx_set(tdm_backend_t *b, bool on);

/* Quantises nb blocks of x (nb * 32 floats) into out; every ISA gives the same bits. */
typedef void (*tdm_cpu_quantise_fn)(const float *x, int64_t nb, struct tdm_cpu_xblock *out);
void tdm_cpu_quantise_portable(const float *x, int64_t nb, struct tdm_cpu_xblock *out);
void tdm_cpu_quantise_avx2(const float *x, int64_t nb, struct tdm_cpu_xblock *out);

/* Attention: one online-softmax step of `gs` query heads of one KV group over `cn` consecutive
 * KV positions (attention.c explains the scheme). The step raises the running max m to the
 * chunk's max (rescaling sum and acc by exp(m_old - m_new) when it moves), then adds the
 * chunk's weights exp(score - m) to sum and weight * V to acc, positions in order. */
#define TDM_CPU_ATTN_CHUNK 32 /* positions per step */
#define TDM_CPU_ATTN_GROUP 8  /* query heads per step */
/* The portable dot product: lane l sums elements 8i + l in order, the lanes fold
 * ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), tail elements after. Its order depends on n alone. */
static inline float tdm_cpu_dot8(const float *a, const float *b, int n)
{
    float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            l[k] += a[i + k] * b[i + k];
    const float x0 = l[0] + l[4], x1 = l[1] + l[5], x2 = l[2] + l[6], x3 = l[3] + l[7];
    float s = (x0 + x2) + (x1 + x3);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

struct tdm_cpu_attn_step {
    const float *q; /* [gs][hd] */
    int gs, hd, cn;
    int vd;                /* V's width (hd, or a latent layer's v_dim) */
    const float *const *k; /* [cn] K rows of hd floats */
    const float *const *v; /* [cn] V rows of vd floats */
    float scale;
    float *m;   /* [gs] running max (-inf before the first step) */
    float *sum; /* [gs] running sum of weights */
    float *acc; /* [gs][TDM_CPU_MAX_HEAD_DIM] running weighted sum of V (vd used) */
};
typedef void (*tdm_cpu_attn_fn)(const struct tdm_cpu_attn_step *s);
void tdm_cpu_attn_step_portable(const struct tdm_cpu_attn_step *s);
void tdm_cpu_attn_step_avx2(const struct tdm_cpu_attn_step *s); /* AVX2 + FMA CPUs only */

/* KV rows of 2-byte element types (kv.h) to fp32 (exact) and from it (round to nearest even,
 * NaN kept a NaN, overflow to infinity for f16): n elements. Every ISA gives the same bits. */
typedef void (*tdm_cpu_kv_widen_fn)(enum tdm_dtype dt, const uint16_t *src, float *dst, int n);
typedef void (*tdm_cpu_kv_narrow_fn)(enum tdm_dtype dt, const float *src, uint16_t *dst, int n);
void tdm_cpu_kv_widen_portable(enum tdm_dtype dt, const uint16_t *src, float *dst, int n);
void tdm_cpu_kv_narrow_portable(enum tdm_dtype dt, const float *src, uint16_t *dst, int n);
void tdm_cpu_kv_widen_avx2(enum tdm_dtype dt, const uint16_t *src, float *dst, int n);
void tdm_cpu_kv_narrow_avx2(enum tdm_dtype dt, const float *src, uint16_t *dst, int n);

struct tdm_cpu_kernels {
    enum tdm_cpu_isa isa;
    const char *name;
    const tdm_cpu_tile_fn (*tile)[TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX]; /* a tdm_cpu_tiles_* */
    int decode_r;                   /* weight rows per tile when n == 1 */
    int prefill_r[TDM_CPU_W_COUNT]; /* tile shape when n > 1 */
    int prefill_c;
    tdm_cpu_attn_fn attn_step;
    tdm_cpu_kv_widen_fn kv_widen;
    tdm_cpu_kv_narrow_fn kv_narrow;
    const tdm_cpu_qtile_fn (*qtile)[TDM_CPU_TILE_MAX][TDM_CPU_TILE_MAX]; /* a tdm_cpu_qtiles_* */
    tdm_cpu_quantise_fn quantise;
    bool vnni; /* qtile uses VPDPBUSD */
};

struct tdm_cpu {
    struct tdm_backend base; /* base.impl points back here */
    tdm_pool_t *pool;
    int n_threads;
    bool batch_invariant;
    bool quant_activations; /* Q8_0/Q4_0/Q4_1/Q4_K/Q6_K products on int8 activations (qdot.c) */
    const struct tdm_cpu_kernels *k;
    float *attn_scratch; /* attention split-mode states (attention.c); grown on demand */
    size_t attn_scratch_floats;
    struct tdm_cpu_xblock *xq; /* [n][cols / 32] a matmul's quantised input; grown on demand */
    size_t xq_blocks;
    bool amx; /* Q8_0/Q4_0/Q4_1 products of several activation rows on the AMX tiles */
    struct tdm_cpu_xtile *xt; /* [ceil(n / 16)][cols / 32] xq as AMX tiles; grown on demand */
    size_t xt_tiles;
};

static inline struct tdm_cpu *tdm_cpu_of(tdm_backend_t *b)
{
    return (struct tdm_cpu *)b->impl;
}

/* Best level this machine supports (ignores $TANDEM_CPU_ISA). */
enum tdm_cpu_isa tdm_cpu_isa_detect(void);
const char *tdm_cpu_isa_name(enum tdm_cpu_isa isa);
/* Creates a backend on an explicit level (with VNNI where the CPU has it for that level);
 * TDM_EUNSUPPORTED if this machine lacks it. For tests that run every level in one process. */
tdm_status tdm_backend_cpu_create_isa(const struct tdm_backend_cpu_opts *opts, enum tdm_cpu_isa isa,
                                      tdm_backend_t **out);
/* Whether this CPU has the VNNI dot product of a level (avx2: AVX-VNNI; avx512: AVX512-VNNI). */
bool tdm_cpu_isa_vnni(enum tdm_cpu_isa isa);
/* As create_isa, with the VNNI kernels of the level on or off (TDM_EUNSUPPORTED: vnni on a CPU
 * without it). */
tdm_status tdm_backend_cpu_create_variant(const struct tdm_backend_cpu_opts *opts,
                                          enum tdm_cpu_isa isa, bool vnni, tdm_backend_t **out);
/* The wtype index of a dtype, or -1 if the kernels do not run it. */
int tdm_cpu_wtype_of(enum tdm_dtype t);

/* Runs fn over the pool unless the job is small (`work` in rough element-operations), in
 * which case the calling thread does all of it as ith 0 of 1. Results never depend on the
 * choice: every op splits by output element. */
void tdm_cpu_run(struct tdm_cpu *cpu, int64_t work, tdm_pool_fn fn, void *ctx);

/* ---- ops (one file per family) ---- */
void tdm_cpu_embed(tdm_backend_t *b, const struct tdm_weight *emb, const int32_t *tokens, int n,
                   float *out);
void tdm_cpu_rmsnorm(tdm_backend_t *b, const float *x, const float *w, float eps, int n, int dim,
                     float *out);
void tdm_cpu_add_rmsnorm(tdm_backend_t *b, float *residual, const float *x, const float *w,
                         float eps, int n, int dim, float *out);
void tdm_cpu_head_rmsnorm(tdm_backend_t *b, float *x, const float *w, float eps, int n_rows,
                          int head_dim);
void tdm_cpu_matmul(tdm_backend_t *b, const struct tdm_weight *w, const float *x, int n,
                    const float *bias, float *out);
void tdm_cpu_matmul_multi(tdm_backend_t *b, const float *x, int n,
                          const struct tdm_matmul_part *parts, int n_parts);
void tdm_cpu_matmul_swiglu(tdm_backend_t *b, const struct tdm_weight *w_gate,
                           const struct tdm_weight *w_up, const float *x, int n, float *out);
void tdm_cpu_rope_kv_append(tdm_backend_t *b, float *q, const float *k, const float *v, int n_heads,
                            const struct tdm_step *st, const struct tdm_rope *rope,
                            const struct tdm_kv_layer *kv);
void tdm_cpu_attention(tdm_backend_t *b, const float *q, int n_heads, const struct tdm_step *st,
                       const struct tdm_kv_layer *kv, float scale, float *out);
void tdm_cpu_silu_mul(tdm_backend_t *b, const float *gate, const float *up, int n, int dim,
                      float *out);
void tdm_cpu_add(tdm_backend_t *b, float *x, const float *y, size_t n);
void tdm_cpu_kv_copy(tdm_backend_t *b, const struct tdm_kv_layer *kv, int n_layers,
                     size_t layer_bytes, const int32_t *src, const int32_t *dst, int n);
void tdm_cpu_scatter_cols(tdm_backend_t *b, const float *x, const int32_t *cols, int n, int n_cols,
                          int width, float *out);
void tdm_cpu_zero(tdm_backend_t *b, float *x, size_t n);
void tdm_cpu_head_matmul(tdm_backend_t *b, const struct tdm_weight *w, int n_heads, const float *x,
                         int n, size_t x_stride, size_t x_hstride, float *out, size_t out_stride,
                         size_t out_hstride);
void tdm_cpu_rows_scale_add(tdm_backend_t *b, const float *x, const int32_t *rows,
                            const float *weights, int n, int dim, float *out);
void tdm_cpu_gather_rows(tdm_backend_t *b, const float *x, const int32_t *rows, int n, int dim,
                         float *out);

/* Tile tables: each ISA file defines `static void tile_<W>_<R>_<C>(const struct tdm_cpu_tile *)`
 * for every wtype W and 1 <= R, C <= 4 with TDM_CPU_DEF_TILES(W, body) (body is a call of an
 * always-inline kernel taking the compile-time R and C), then fills its table with
 * TDM_CPU_TILE_TABLE(W). */
#define TDM_CPU_DEF_TILE_(W, R, C, KERNEL)                                                         \
    static void tile_##W##_##R##_##C(const struct tdm_cpu_tile *t)                                 \
    {                                                                                              \
        KERNEL(t, TDM_CPU_W_##W, R, C);                                                            \
    }
#define TDM_CPU_DEF_TILE_ROW_(W, R, KERNEL)                                                        \
    TDM_CPU_DEF_TILE_(W, R, 1, KERNEL)                                                             \
    TDM_CPU_DEF_TILE_(W, R, 2, KERNEL)                                                             \
    TDM_CPU_DEF_TILE_(W, R, 3, KERNEL)                                                             \
    TDM_CPU_DEF_TILE_(W, R, 4, KERNEL)
#define TDM_CPU_DEF_TILES(W, KERNEL)                                                               \
    TDM_CPU_DEF_TILE_ROW_(W, 1, KERNEL)                                                            \
    TDM_CPU_DEF_TILE_ROW_(W, 2, KERNEL)                                                            \
    TDM_CPU_DEF_TILE_ROW_(W, 3, KERNEL)                                                            \
    TDM_CPU_DEF_TILE_ROW_(W, 4, KERNEL)
#define TDM_CPU_TILE_ROW_(W, R)                                                                    \
    {                                                                                              \
        tile_##W##_##R##_1, tile_##W##_##R##_2, tile_##W##_##R##_3, tile_##W##_##R##_4             \
    }
#define TDM_CPU_TILE_TABLE(W)                                                                      \
    [TDM_CPU_W_##W] = {TDM_CPU_TILE_ROW_(W, 1), TDM_CPU_TILE_ROW_(W, 2), TDM_CPU_TILE_ROW_(W, 3),  \
                       TDM_CPU_TILE_ROW_(W, 4)}

/* Quantised tile tables (qdot*.c): TDM_CPU_DEF_QTILES(P, ATTR, W, KERNEL) defines
 * `static ATTR void P_<W>_<R>_<C>(const struct tdm_cpu_qtile *)` for 1 <= R, C <= 4 (ATTR may
 * be empty or a target attribute), TDM_CPU_QTILE_TABLE(P, W) fills a table's row of W. */
#define TDM_CPU_DEF_QTILE_(P, ATTR, W, R, C, KERNEL)                                               \
    static ATTR void P##_##W##_##R##_##C(const struct tdm_cpu_qtile *t)                            \
    {                                                                                              \
        KERNEL(t, TDM_CPU_W_##W, R, C);                                                            \
    }
#define TDM_CPU_DEF_QTILE_ROW_(P, ATTR, W, R, KERNEL)                                              \
    TDM_CPU_DEF_QTILE_(P, ATTR, W, R, 1, KERNEL)                                                   \
    TDM_CPU_DEF_QTILE_(P, ATTR, W, R, 2, KERNEL)                                                   \
    TDM_CPU_DEF_QTILE_(P, ATTR, W, R, 3, KERNEL)                                                   \
    TDM_CPU_DEF_QTILE_(P, ATTR, W, R, 4, KERNEL)
#define TDM_CPU_DEF_QTILES(P, ATTR, W, KERNEL)                                                     \
    TDM_CPU_DEF_QTILE_ROW_(P, ATTR, W, 1, KERNEL)                                                  \
    TDM_CPU_DEF_QTILE_ROW_(P, ATTR, W, 2, KERNEL)                                                  \
    TDM_CPU_DEF_QTILE_ROW_(P, ATTR, W, 3, KERNEL)                                                  \
    TDM_CPU_DEF_QTILE_ROW_(P, ATTR, W, 4, KERNEL)
#define TDM_CPU_QTILE_ROW_(P, W, R)                                                                \
    {                                                                                              \
        P##_##W##_##R##_1, P##_##W##_##R##_2, P##_##W##_##R##_3, P##_##W##_##R##_4                 \
    }
#define TDM_CPU_QTILE_TABLE(P, W)                                                                  \
    [TDM_CPU_W_##W - TDM_CPU_W_Q8_0] = {TDM_CPU_QTILE_ROW_(P, W, 1), TDM_CPU_QTILE_ROW_(P, W, 2),  \
                                        TDM_CPU_QTILE_ROW_(P, W, 3), TDM_CPU_QTILE_ROW_(P, W, 4)}
/* A whole table NAME of one KERNEL: its tiles for the five quantised kinds (functions named
 * P_<kind>_R_C, with attribute ATTR), and the table of them. */
#define TDM_CPU_DEF_QTILE_TABLE(NAME, P, ATTR, KERNEL)                                             \
    TDM_CPU_DEF_QTILES(P, ATTR, Q8_0, KERNEL)                                                      \
    TDM_CPU_DEF_QTILES(P, ATTR, Q4_0, KERNEL)                                                      \
    TDM_CPU_DEF_QTILES(P, ATTR, Q4_1, KERNEL)                                                      \
    TDM_CPU_DEF_QTILES(P, ATTR, Q4_K, KERNEL)                                                      \
    TDM_CPU_DEF_QTILES(P, ATTR, Q6_K, KERNEL)                                                      \
    const tdm_cpu_qtile_table NAME = {TDM_CPU_QTILE_TABLE(P, Q8_0), TDM_CPU_QTILE_TABLE(P, Q4_0),  \
                                      TDM_CPU_QTILE_TABLE(P, Q4_1), TDM_CPU_QTILE_TABLE(P, Q4_K),  \
                                      TDM_CPU_QTILE_TABLE(P, Q6_K)};

/* silu(g) * u, the one definition that silu_mul and matmul_swiglu share (libm's expf; see
 * elementwise.c), so that the fused op matches the separate ones bit for bit. */
static inline float tdm_cpu_silu_mul1(float g, float u)
{
    return (g / (1.0f + expf(-g))) * u;
}

/* Dequantises row `row` of a weight into dst[cols] (the dtypes of tdm_cpu_wtype_of). */
void tdm_cpu_weight_row(const struct tdm_weight *w, int64_t row, float *dst);

#endif /* TANDEM_BACKEND_CPU_INT_H */
