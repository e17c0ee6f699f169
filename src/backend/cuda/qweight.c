/*
 * The device layout of GGUF-quantised matrices (qweight.h has it): packing from the file's
 * blocks, and a host decoder of the packed form for tests. Pure functions; no CUDA.
 */
#include "backend/cuda/qweight.h"

#include <string.h>

#include "model/quant_int.h"

int tdm_cu_qkind_of(enum tdm_dtype t)
{
    switch (t) {
    case TDM_DTYPE_Q8_0:
        return TDM_CU_Q8_0;
    case TDM_DTYPE_Q4_0:
        return TDM_CU_Q4_0;
    case TDM_DTYPE_Q4_1:
        return TDM_CU_Q4_1;
    case TDM_DTYPE_Q4_K:
        return TDM_CU_Q4_K;
    case TDM_DTYPE_Q6_K:
        return TDM_CU_Q6_K;
    default:
        return TDM_CU_Q_NONE;
    }
}

static size_t align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

bool tdm_cu_qlayout(enum tdm_dtype t, int64_t rows, int64_t cols, struct tdm_cu_qlayout *out)
{
    const int kind = tdm_cu_qkind_of(t);
    const bool kq = kind == TDM_CU_Q4_K || kind == TDM_CU_Q6_K;
    if (kind == TDM_CU_Q_NONE || rows < 1 || cols < 64 || cols % (kq ? 256 : 64) != 0 ||
        rows > ((int64_t)1 << 31) || cols > ((int64_t)1 << 24))
        return false;
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->rows = rows;
    out->cols = cols;
    const size_t R = (size_t)rows, C = (size_t)cols;
    size_t at = 0;
    out->q_off = at;
    at = align256(at + R * (kind == TDM_CU_Q8_0 ? C : C / 2));
    if (kind == TDM_CU_Q6_K) {
        out->qh_off = at;
        at = align256(at + R * C / 4);
    }
    out->s_off = at;
    switch (kind) {
    case TDM_CU_Q8_0:
    case TDM_CU_Q4_0:
    case TDM_CU_Q4_K:
        at += R * (C / 32) * 2;
        break;
    case TDM_CU_Q4_1:
        at += R * (C / 32) * 4;
        break;
    case TDM_CU_Q6_K:
        at += R * (C / 16);
        break;
    }
    at = align256(at);
    if (kq) {
        out->dd_off = at;
        at = align256(at + R * (C / 256) * (kind == TDM_CU_Q4_K ? 4 : 2));
    }
    out->bytes = at;
    return true;
}

/* ---- element positions (qweight.h) ---- */

/* the quad lane and element index of column col: col = 64 c + 32 gi + 16 h + 4 t + b */
static inline void where(int64_t col, int64_t *c, int *t, int *gi, int *h, int *b)
{
    *c = col / 64;
    const int r = (int)(col % 64);
    *gi = r / 32;
    *h = (r / 16) % 2;
    *t = (r / 4) % 4;
    *b = r % 4;
}

static inline uint8_t *q_byte(const struct tdm_cu_qlayout *L, uint8_t *base, int64_t row,
                              int64_t col, bool *high)
{
    int64_t c;
    int t, gi, h, b;
    where(col, &c, &t, &gi, &h, &b);
    if (L->kind == TDM_CU_Q8_0) {
        *high = false;
        return base + L->q_off + (size_t)row * (size_t)L->cols +
               (size_t)(64 * c + 16 * t + 8 * gi + 4 * h + b);
    }
    *high = h == 1;
    return base + L->q_off + (size_t)row * (size_t)(L->cols / 2) +
           (size_t)(32 * c + 8 * t + 4 * gi + b);
}

/* Q6_K: the byte and bit of element col's two high bits */
static inline uint8_t *qh_byte(const struct tdm_cu_qlayout *L, uint8_t *base, int64_t row,
                               int64_t col, int *shift)
{
    int64_t c;
    int t, gi, h, b;
    where(col, &c, &t, &gi, &h, &b);
    const int bit = 8 * b + 2 * (2 * gi + h);
    *shift = bit % 8;
    return base + L->qh_off + (size_t)row * (size_t)(L->cols / 4) + (size_t)(16 * c + 4 * t) +
           (size_t)(bit / 8);
}

static uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Writes nc columns of a row from their stored integers u[nc] (Q8_0: the int8 bits; 4-bit
 * kinds: 0..15; Q6_K: 0..63) in the chunked element order: q, the row's first byte of those
 * columns in the q array, qh its first in the qh array (Q6_K; NULL otherwise). */
static void put_cols(int kind, const uint8_t *u, int64_t nc, uint8_t *q, uint8_t *qh)
{
    if (kind == TDM_CU_Q8_0) {
        for (int64_t c = 0; c < nc / 64; c++)
            for (int t = 0; t < 4; t++)
                for (int gi = 0; gi < 2; gi++)
                    for (int h = 0; h < 2; h++)
                        memcpy(q + 64 * c + 16 * t + 8 * gi + 4 * h,
                               u + 64 * c + 32 * gi + 16 * h + 4 * t, 4);
        return;
    }
    for (int64_t c = 0; c < nc / 64; c++)
        for (int t = 0; t < 4; t++) {
            uint32_t hbits = 0;
            for (int gi = 0; gi < 2; gi++)
                for (int b = 0; b < 4; b++) {
                    const uint8_t lo = u[64 * c + 32 * gi + 4 * t + b];
                    const uint8_t hi = u[64 * c + 32 * gi + 16 + 4 * t + b];
                    q[32 * c + 8 * t + 4 * gi + b] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
                    hbits |= (uint32_t)(lo >> 4 & 3) << (8 * b + 2 * (2 * gi));
                    hbits |= (uint32_t)(hi >> 4 & 3) << (8 * b + 2 * (2 * gi + 1));
                }
            if (qh) {
                const uint8_t hb[4] = {(uint8_t)hbits, (uint8_t)(hbits >> 8),
                                       (uint8_t)(hbits >> 16), (uint8_t)(hbits >> 24)};
                memcpy(qh + 16 * c + 4 * t, hb, 4);
            }
        }
}

void tdm_cu_qpack_rows(const struct tdm_cu_qlayout *L, const void *src, size_t src_row_bytes,
                       int64_t r0, int64_t n, void *dst_)
{
    uint8_t *dst = dst_;
    const int64_t C = L->cols;
    uint8_t u[4096];
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = r0 + i;
        const uint8_t *s = (const uint8_t *)src + (size_t)i * src_row_bytes;
        uint8_t *sc = dst + L->s_off;
        uint8_t *dd = dst + L->dd_off;
        /* a row goes through u[] 4,096 columns at a time (a multiple of every block) */
        for (int64_t c0 = 0; c0 < C; c0 += (int64_t)sizeof u) {
            const int64_t nc = C - c0 < (int64_t)sizeof u ? C - c0 : (int64_t)sizeof u;
            switch (L->kind) {
            case TDM_CU_Q8_0:
                for (int64_t g = c0 / 32; g < (c0 + nc) / 32; g++) {
                    const uint8_t *blk = s + (size_t)g * sizeof(struct block_q8_0);
                    memcpy(sc + ((size_t)row * (size_t)(C / 32) + (size_t)g) * 2,
                           blk + offsetof(struct block_q8_0, d), 2);
                    memcpy(u + 32 * g - c0, blk + offsetof(struct block_q8_0, qs), 32);
                }
                break;
            case TDM_CU_Q4_0:
            case TDM_CU_Q4_1: {
                const bool one = L->kind == TDM_CU_Q4_1;
                const size_t bb = one ? sizeof(struct block_q4_1) : sizeof(struct block_q4_0);
                const size_t qs =
                    one ? offsetof(struct block_q4_1, qs) : offsetof(struct block_q4_0, qs);
                for (int64_t g = c0 / 32; g < (c0 + nc) / 32; g++) {
                    const uint8_t *blk = s + (size_t)g * bb;
                    memcpy(sc + ((size_t)row * (size_t)(C / 32) + (size_t)g) * (one ? 4 : 2), blk,
                           one ? 4 : 2); /* d (and m) */
                    for (int j = 0; j < 16; j++) {
                        u[32 * g - c0 + j] = blk[qs + j] & 0x0F;
                        u[32 * g - c0 + j + 16] = blk[qs + j] >> 4;
                    }
                }
                break;
            }
            case TDM_CU_Q4_K:
                for (int64_t sb = c0 / 256; sb < (c0 + nc) / 256; sb++) {
                    const uint8_t *blk = s + (size_t)sb * sizeof(struct block_q4_K);
                    memcpy(dd + ((size_t)row * (size_t)(C / 256) + (size_t)sb) * 4, blk, 4);
                    for (int j = 0; j < 8; j++) {
                        uint8_t scv, mnv;
                        tdm_k_scale_min(blk + offsetof(struct block_q4_K, scales), j, &scv, &mnv);
                        uint8_t *p =
                            sc + ((size_t)row * (size_t)(C / 32) + (size_t)(8 * sb + j)) * 2;
                        p[0] = scv, p[1] = mnv;
                    }
                    const uint8_t *qsb = blk + offsetof(struct block_q4_K, qs);
                    uint8_t *y = u + 256 * sb - c0;
                    for (int ch = 0; ch < 4; ch++)
                        for (int l = 0; l < 32; l++) {
                            y[64 * ch + l] = qsb[32 * ch + l] & 0x0F;
                            y[64 * ch + 32 + l] = qsb[32 * ch + l] >> 4;
                        }
                }
                break;
            case TDM_CU_Q6_K:
                for (int64_t sb = c0 / 256; sb < (c0 + nc) / 256; sb++) {
                    const uint8_t *blk = s + (size_t)sb * sizeof(struct block_q6_K);
                    memcpy(dd + ((size_t)row * (size_t)(C / 256) + (size_t)sb) * 2,
                           blk + offsetof(struct block_q6_K, d), 2);
                    memcpy(sc + (size_t)row * (size_t)(C / 16) + (size_t)(16 * sb),
                           blk + offsetof(struct block_q6_K, scales), 16);
                    const uint8_t *ql = blk + offsetof(struct block_q6_K, ql);
                    const uint8_t *qh = blk + offsetof(struct block_q6_K, qh);
                    uint8_t *y = u + 256 * sb - c0;
                    for (int hf = 0; hf < 2; hf++)
                        for (int g = 0; g < 4; g++)
                            for (int l = 0; l < 32; l++) {
                                const unsigned lo =
                                    (ql[64 * hf + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 0x0F;
                                const unsigned hi = (qh[32 * hf + l] >> (2 * g)) & 3;
                                y[128 * hf + 32 * g + l] = (uint8_t)(lo | hi << 4);
                            }
                }
                break;
            }
            /* the columns [c0, c0 + nc) of this row */
            const bool q8 = L->kind == TDM_CU_Q8_0;
            put_cols(L->kind, u, nc,
                     dst + L->q_off + (size_t)row * (size_t)(q8 ? C : C / 2) +
                         (size_t)(q8 ? c0 : c0 / 2),
                     L->qh_off ? dst + L->qh_off + (size_t)row * (size_t)(C / 4) + (size_t)(c0 / 4)
                               : NULL);
        }
    }
}

float tdm_cu_qget(const struct tdm_cu_qlayout *L, const void *packed, int64_t row, int64_t col)
{
    uint8_t *base = (uint8_t *)packed;
    bool high;
    const uint8_t *p = q_byte(L, base, row, col, &high);
    const uint8_t *sc = base + L->s_off, *dd = base + L->dd_off;
    const int64_t C = L->cols;
    const size_t g32 = (size_t)row * (size_t)(C / 32) + (size_t)(col / 32);
    const size_t g256 = (size_t)row * (size_t)(C / 256) + (size_t)(col / 256);
    const unsigned q = L->kind == TDM_CU_Q8_0 ? *p : high ? *p >> 4 : *p & 0x0F;
    switch (L->kind) {
    case TDM_CU_Q8_0:
        return tdm_f16_to_f32(get16(sc + g32 * 2)) * (float)(int8_t)q;
    case TDM_CU_Q4_0:
        return tdm_f16_to_f32(get16(sc + g32 * 2)) * (float)((int)q - 8);
    case TDM_CU_Q4_1:
        return tdm_f16_to_f32(get16(sc + g32 * 4)) * (float)q +
               tdm_f16_to_f32(get16(sc + g32 * 4 + 2));
    case TDM_CU_Q4_K: {
        const float d = tdm_f16_to_f32(get16(dd + g256 * 4)),
                    dmin = tdm_f16_to_f32(get16(dd + g256 * 4 + 2));
        return d * (float)sc[g32 * 2] * (float)q - dmin * (float)sc[g32 * 2 + 1];
    }
    case TDM_CU_Q6_K: {
        int sh;
        const uint8_t *ph = qh_byte(L, base, row, col, &sh);
        const int u = (int)(q | ((*ph >> sh) & 3u) << 4);
        const float d = tdm_f16_to_f32(get16(dd + g256 * 2));
        const int8_t s = (int8_t)sc[(size_t)row * (size_t)(C / 16) + (size_t)(col / 16)];
        return d * (float)s * (float)(u - 32);
    }
    }
    return 0.0f;
}
