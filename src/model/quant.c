/*
 * Element types: block geometry of every GGML type id below TDM_DTYPE_COUNT, and the scalar
 * dequantisers of the types tandem reads (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K
 * Q6_K).
 *
 * Why a table of all GGML types, not just the supported ones: a GGUF file may hold tensors
 * of types we never dequantise (an IQ type for a tensor the loader skips). Knowing their block
 * size lets the GGUF reader validate and list them; the loader decides what it needs.
 *
 * Exactness: the output must be bit-identical to GGML and to gguf-py's numpy dequantisers,
 * which are the references in tests. Each formula keeps their float32 structure (q4_1 is
 * d * q + m; the K-quants form d * scale and dmin * min first, then d' * q - m'). Every
 * product of an fp16 scale and a small integer is exact in float32, so each output carries
 * one rounding, the same as theirs; contraction into FMA is off all the same (clang pragma
 * below; GCC contracts only in GNU modes and the build is ISO C11).
 *
 * Source bytes may sit at any address, so every multi-byte field is read with memcpy at the
 * offsets of the block structs in quant_int.h, the one description of the layouts.
 *
 * Threading: pure functions, thread-safe.
 */
#include "model/quant_int.h"
#include "tandem/model.h"

#include <stddef.h>
#include <string.h>

#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif

struct dtype_traits {
    const char *name;
    int64_t block_elems;
    size_t block_bytes;
};

/* GGML's type ids and block sizes; a zero entry is an unassigned id. */
static const struct dtype_traits DTYPES[TDM_DTYPE_COUNT] = {
    [0] = {"f32", 1, 4},         [1] = {"f16", 1, 2},         [2] = {"q4_0", 32, 18},
    [3] = {"q4_1", 32, 20},      [6] = {"q5_0", 32, 22},      [7] = {"q5_1", 32, 24},
    [8] = {"q8_0", 32, 34},      [9] = {"q8_1", 32, 36},      [10] = {"q2_K", 256, 84},
    [11] = {"q3_K", 256, 110},   [12] = {"q4_K", 256, 144},   [13] = {"q5_K", 256, 176},
    [14] = {"q6_K", 256, 210},   [15] = {"q8_K", 256, 292},   [16] = {"iq2_xxs", 256, 66},
    [17] = {"iq2_xs", 256, 74},  [18] = {"iq3_xxs", 256, 98}, [19] = {"iq1_s", 256, 50},
    [20] = {"iq4_nl", 32, 18},   [21] = {"iq3_s", 256, 110},  [22] = {"iq2_s", 256, 82},
    [23] = {"iq4_xs", 256, 136}, [24] = {"i8", 1, 1},         [25] = {"i16", 1, 2},
    [26] = {"i32", 1, 4},        [27] = {"i64", 1, 8},        [28] = {"f64", 1, 8},
    [29] = {"iq1_m", 256, 56},   [30] = {"bf16", 1, 2},       [34] = {"tq1_0", 256, 54},
    [35] = {"tq2_0", 256, 66},   [39] = {"mxfp4", 32, 17},
};

static const struct dtype_traits *traits(int t)
{
    if (t < 0 || t >= TDM_DTYPE_COUNT || DTYPES[t].block_elems == 0) return NULL;
    return &DTYPES[t];
}

bool tdm_dtype_known(int t)
{
    return traits(t) != NULL;
}

int64_t tdm_dtype_block_elems(enum tdm_dtype t)
{
    const struct dtype_traits *tr = traits((int)t);
    return tr ? tr->block_elems : 0;
}

size_t tdm_dtype_block_bytes(enum tdm_dtype t)
{
    const struct dtype_traits *tr = traits((int)t);
    return tr ? tr->block_bytes : 0;
}

const char *tdm_dtype_name(enum tdm_dtype t)
{
    const struct dtype_traits *tr = traits((int)t);
    return tr ? tr->name : "unknown";
}

size_t tdm_dtype_row_bytes(enum tdm_dtype t, int64_t n)
{
    const struct dtype_traits *tr = traits((int)t);
    if (!tr || n <= 0 || n % tr->block_elems != 0) return 0;
    size_t bytes;
    if (__builtin_mul_overflow((size_t)(n / tr->block_elems), tr->block_bytes, &bytes)) return 0;
    return bytes;
}

/* ---- field readers: little-endian host assumed (static_assert below) ---- */
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tandem reads GGUF on little-endian hosts");

static inline float rd_f16(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return tdm_f16_to_f32(h);
}

#define FIELD(blk, type, field) ((blk) + offsetof(struct type, field))

/* ---- per-type block loops; n_blocks blocks from src to dst ---- */

static void deq_f16(const uint8_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = rd_f16(src + 2 * i);
}

static void deq_bf16(const uint8_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        dst[i] = tdm_bf16_to_f32(h);
    }
}

static void deq_q8_0(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q8_0), dst += TDM_QK8_0) {
        const float d = rd_f16(FIELD(src, block_q8_0, d));
        const int8_t *qs = (const int8_t *)FIELD(src, block_q8_0, qs);
        for (int i = 0; i < TDM_QK8_0; i++)
            dst[i] = (float)qs[i] * d;
    }
}

static void deq_q4_0(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q4_0), dst += TDM_QK4_0) {
        const float d = rd_f16(FIELD(src, block_q4_0, d));
        const uint8_t *qs = FIELD(src, block_q4_0, qs);
        for (int j = 0; j < TDM_QK4_0 / 2; j++) {
            dst[j] = d * (float)((qs[j] & 0x0F) - 8);
            dst[j + TDM_QK4_0 / 2] = d * (float)((qs[j] >> 4) - 8);
        }
    }
}

static void deq_q4_1(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q4_1), dst += TDM_QK4_1) {
        const float d = rd_f16(FIELD(src, block_q4_1, d));
        const float m = rd_f16(FIELD(src, block_q4_1, m));
        const uint8_t *qs = FIELD(src, block_q4_1, qs);
        for (int j = 0; j < TDM_QK4_1 / 2; j++) {
            const float lo = d * (float)(qs[j] & 0x0F);
            const float hi = d * (float)(qs[j] >> 4);
            dst[j] = lo + m;
            dst[j + TDM_QK4_1 / 2] = hi + m;
        }
    }
}

static void deq_q5_0(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_0), dst += TDM_QK5_0) {
        const float d = rd_f16(FIELD(src, block_q5_0, d));
        uint32_t qh;
        memcpy(&qh, FIELD(src, block_q5_0, qh), 4);
        const uint8_t *qs = FIELD(src, block_q5_0, qs);
        for (int j = 0; j < TDM_QK5_0 / 2; j++) {
            const int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            dst[j] = d * (float)(lo - 16);
            dst[j + TDM_QK5_0 / 2] = d * (float)(hi - 16);
        }
    }
}

static void deq_q5_1(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_1), dst += TDM_QK5_1) {
        const float d = rd_f16(FIELD(src, block_q5_1, d));
        const float m = rd_f16(FIELD(src, block_q5_1, m));
        uint32_t qh;
        memcpy(&qh, FIELD(src, block_q5_1, qh), 4);
        const uint8_t *qs = FIELD(src, block_q5_1, qs);
        for (int j = 0; j < TDM_QK5_1 / 2; j++) {
            const int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            const float plo = d * (float)lo;
            const float phi = d * (float)hi;
            dst[j] = plo + m;
            dst[j + TDM_QK5_1 / 2] = phi + m;
        }
    }
}

/* One 256-element Q4_K or Q5_K super-block: chunk c of 32 bytes holds sub-blocks 2c (low
 * nibbles) and 2c + 1 (high nibbles); Q5_K adds a fifth bit per element from qh (NULL for Q4_K). */
static void deq_k_super(float d, float dmin, const uint8_t *scales, const uint8_t *qs,
                        const uint8_t *qh, float *dst)
{
    for (int c = 0; c < 4; c++) {
        uint8_t sc0, m0, sc1, m1;
        tdm_k_scale_min(scales, 2 * c, &sc0, &m0);
        tdm_k_scale_min(scales, 2 * c + 1, &sc1, &m1);
        const float d0 = d * (float)sc0, dm0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
        float *y = dst + 64 * c;
        for (int l = 0; l < 32; l++) {
            int q0 = qs[32 * c + l] & 0x0F, q1 = qs[32 * c + l] >> 4;
            if (qh) {
                q0 |= ((qh[l] >> (2 * c)) & 1) << 4;
                q1 |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
            }
            const float p0 = d0 * (float)q0;
            const float p1 = d1 * (float)q1;
            y[l] = p0 - dm0;
            y[l + 32] = p1 - dm1;
        }
    }
}

static void deq_q4_K(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q4_K), dst += TDM_QK_K)
        deq_k_super(rd_f16(FIELD(src, block_q4_K, d)), rd_f16(FIELD(src, block_q4_K, dmin)),
                    FIELD(src, block_q4_K, scales), FIELD(src, block_q4_K, qs), NULL, dst);
}

static void deq_q5_K(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q5_K), dst += TDM_QK_K)
        deq_k_super(rd_f16(FIELD(src, block_q5_K, d)), rd_f16(FIELD(src, block_q5_K, dmin)),
                    FIELD(src, block_q5_K, scales), FIELD(src, block_q5_K, qs),
                    FIELD(src, block_q5_K, qh), dst);
}

static void deq_q6_K(const uint8_t *src, float *dst, int64_t n_blocks)
{
    for (int64_t b = 0; b < n_blocks; b++, src += sizeof(struct block_q6_K), dst += TDM_QK_K) {
        const float d = rd_f16(FIELD(src, block_q6_K, d));
        const uint8_t *ql = FIELD(src, block_q6_K, ql);
        const uint8_t *qh = FIELD(src, block_q6_K, qh);
        const int8_t *sc = (const int8_t *)FIELD(src, block_q6_K, scales);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l4 = ql + 64 * h;
            const uint8_t *h2 = qh + 32 * h;
            float *y = dst + 128 * h;
            /* group g of 32 in this half: low bits from l4[32 * (g & 1)] (nibble g >> 1),
             * high bits from h2 at shift 2g; sub-block scale index 8h + 2g + l / 16 */
            for (int g = 0; g < 4; g++) {
                for (int l = 0; l < 32; l++) {
                    const int lo = (l4[32 * (g & 1) + l] >> (4 * (g >> 1))) & 0x0F;
                    const int hi = (h2[l] >> (2 * g)) & 3;
                    const int q = (lo | (hi << 4)) - 32;
                    const float ds = d * (float)sc[8 * h + 2 * g + l / 16];
                    y[32 * g + l] = ds * (float)q;
                }
            }
        }
    }
}

tdm_status tdm_dequantize(enum tdm_dtype t, const void *src, float *dst, int64_t n)
{
    const struct dtype_traits *tr = traits((int)t);
    if (!tr) return tdm_err_set(TDM_EUNSUPPORTED, "dequantize: unknown type id %d", (int)t);
    if (n < 0 || n % tr->block_elems != 0)
        return tdm_err_set(TDM_EINVAL, "dequantize %s: %lld elements is not a multiple of %lld",
                           tr->name, (long long)n, (long long)tr->block_elems);
    if (n > 0 && (!src || !dst)) return tdm_err_set(TDM_EINVAL, "dequantize: NULL buffer");
    const uint8_t *s = src;
    const int64_t n_blocks = n / tr->block_elems;
    switch (t) {
    case TDM_DTYPE_F32:
        if (n > 0) memcpy(dst, s, (size_t)n * sizeof(float));
        return TDM_OK;
    case TDM_DTYPE_F16:
        deq_f16(s, dst, n);
        return TDM_OK;
    case TDM_DTYPE_BF16:
        deq_bf16(s, dst, n);
        return TDM_OK;
    case TDM_DTYPE_Q8_0:
        deq_q8_0(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q4_0:
        deq_q4_0(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q4_1:
        deq_q4_1(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q5_0:
        deq_q5_0(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q5_1:
        deq_q5_1(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q4_K:
        deq_q4_K(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q5_K:
        deq_q5_K(s, dst, n_blocks);
        return TDM_OK;
    case TDM_DTYPE_Q6_K:
        deq_q6_K(s, dst, n_blocks);
        return TDM_OK;
    default:
        return tdm_err_set(TDM_EUNSUPPORTED, "dequantize: no dequantiser for %s", tr->name);
    }
}
