/*
 * Private block layouts of GGML's quantised types, shared by the dequantisers (quant.c) and
 * the CPU kernels (src/backend/cpu/).
 *
 * Each struct mirrors the bytes of one block exactly as GGUF stores them: little-endian, no
 * padding, fp16 scales held as raw uint16_t bits (convert with tdm_f16_to_f32). The static
 * asserts pin the sizes to GGML's, so a struct can be laid over file bytes. File data may sit
 * at any address (tdm_gguf_open_memory takes any buffer), so code that cannot prove 2-byte
 * alignment reads fields through memcpy at offsetof(...) rather than through a struct pointer.
 *
 * Element order inside a block (what "element i" means):
 *   q4_0/q4_1:  qs[j] low nibble is element j, high nibble is element j + 16 (j < 16).
 *   q5_0/q5_1:  as q4_*, plus bit i of the little-endian uint32 qh is bit 4 of element i.
 *   q8_0:       qs[i] is element i.
 *   q4_K:       8 sub-blocks of 32 with a 6-bit scale and 6-bit min each (packed in scales[12]);
 *               qs[32c + l] low nibble is element 64c + l, high nibble element 64c + 32 + l.
 *   q5_K:       as q4_K, plus bit s of qh[l] is bit 4 of element 32s + l.
 *   q6_K:       16 sub-blocks of 16 with an int8 scale each; per half h (128 elements) the
 *               low 4 bits come from ql[64h ...] and the high 2 bits from qh[32h ...].
 */
#ifndef TANDEM_MODEL_QUANT_INT_H
#define TANDEM_MODEL_QUANT_INT_H

#include <assert.h>
#include <stdint.h>

#define TDM_QK4_0         32
#define TDM_QK4_1         32
#define TDM_QK5_0         32
#define TDM_QK5_1         32
#define TDM_QK8_0         32
#define TDM_QK_K          256 /* super-block of the K-quants */
#define TDM_K_SCALE_BYTES 12

struct block_q4_0 {
    uint16_t d;                /* fp16 scale */
    uint8_t qs[TDM_QK4_0 / 2]; /* 4-bit quants, value q - 8 */
};

struct block_q4_1 {
    uint16_t d; /* fp16 scale */
    uint16_t m; /* fp16 minimum: x = d * q + m */
    uint8_t qs[TDM_QK4_1 / 2];
};

struct block_q5_0 {
    uint16_t d;
    uint8_t qh[4];             /* bit 4 of each of the 32 quants, little-endian uint32 */
    uint8_t qs[TDM_QK5_0 / 2]; /* low 4 bits; value q - 16 */
};

struct block_q5_1 {
    uint16_t d;
    uint16_t m;
    uint8_t qh[4];
    uint8_t qs[TDM_QK5_1 / 2];
};

struct block_q8_0 {
    uint16_t d; /* fp16 scale: x = d * q */
    int8_t qs[TDM_QK8_0];
};

struct block_q4_K {
    uint16_t d;                        /* fp16 super-scale of the sub-block scales */
    uint16_t dmin;                     /* fp16 super-scale of the sub-block mins */
    uint8_t scales[TDM_K_SCALE_BYTES]; /* 8 scales + 8 mins, 6 bits each */
    uint8_t qs[TDM_QK_K / 2];
};

struct block_q5_K {
    uint16_t d;
    uint16_t dmin;
    uint8_t scales[TDM_K_SCALE_BYTES];
    uint8_t qh[TDM_QK_K / 8];
    uint8_t qs[TDM_QK_K / 2];
};

struct block_q6_K {
    uint8_t ql[TDM_QK_K / 2];     /* low 4 bits */
    uint8_t qh[TDM_QK_K / 4];     /* high 2 bits */
    int8_t scales[TDM_QK_K / 16]; /* sub-block scales */
    uint16_t d;                   /* fp16 super-scale; value q - 32 */
};

static_assert(sizeof(struct block_q4_0) == 18, "block_q4_0 size");
static_assert(sizeof(struct block_q4_1) == 20, "block_q4_1 size");
static_assert(sizeof(struct block_q5_0) == 22, "block_q5_0 size");
static_assert(sizeof(struct block_q5_1) == 24, "block_q5_1 size");
static_assert(sizeof(struct block_q8_0) == 34, "block_q8_0 size");
static_assert(sizeof(struct block_q4_K) == 144, "block_q4_K size");
static_assert(sizeof(struct block_q5_K) == 176, "block_q5_K size");
static_assert(sizeof(struct block_q6_K) == 210, "block_q6_K size");

/* Unpacks the j-th (0..7) 6-bit scale and min of a q4_K / q5_K block's scales[12]:
 * bytes 0..3 hold scales 0..3 (low 6 bits), bytes 4..7 mins 0..3 (low 6 bits); for j >= 4 the
 * low 4 bits come from byte 8 + j - 4 (scale: low nibble, min: high nibble) and the high 2 bits
 * from the top bits of bytes j - 4 (scale) and j (min). */
static inline void tdm_k_scale_min(const uint8_t *scales, int j, uint8_t *sc, uint8_t *mn)
{
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t)((scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4));
        *mn = (uint8_t)((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

#endif /* TANDEM_MODEL_QUANT_INT_H */
