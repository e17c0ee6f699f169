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
    /* the arrays hold whole 16-row blocks (the rows past the last are zeros) */
    const size_t R = (size_t)(rows + 15) / 16 * 16, nc = (size_t)cols / 64;
    size_t at = 0;
    out->q_off = at;
    out->q_bytes = R * nc * (size_t)tdm_qt_qb(kind);
    at = align256(at + out->q_bytes);
    if (kind == TDM_CU_Q6_K) {
        out->qh_off = at;
        out->qh_bytes = R * nc * (size_t)tdm_qt_hb(kind);
        at = align256(at + out->qh_bytes);
    }
    out->s_off = at;
    out->s_bytes = R * nc * (size_t)tdm_qt_sb(kind);
    at = align256(at + out->s_bytes);
    if (kq) {
        out->dd_off = at;
        out->dd_bytes = R * (nc / 4) * (size_t)tdm_qt_db(kind);
        at = align256(at + out->dd_bytes);
    }
    out->bytes = at;
    return true;
}

/* ---- element positions (qweight.h, qkind.h) ---- */

static inline uint8_t *q_byte(const struct tdm_cu_qlayout *L, uint8_t *base, int64_t row,
                              int64_t col, bool *high)
{
    int c, t, gi, h, b;
    tdm_qt_where(L->kind, col, &c, &t, &gi, &h, &b);
    const int nc = (int)(L->cols / 64);
    uint8_t *piece = base + L->q_off + tdm_qt_q_at(L->kind, nc, row, c, t);
    *high = L->kind != TDM_CU_Q8_0 && h == 1;
    return piece + (L->kind == TDM_CU_Q8_0 ? 8 * gi + 4 * h + b : 4 * gi + b);
}

/* Q6_K: the byte and bit of element col's two high bits */
static inline uint8_t *qh_byte(const struct tdm_cu_qlayout *L, uint8_t *base, int64_t row,
                               int64_t col, int *shift)
{
    int c, t, gi, h, b;
    tdm_qt_where(L->kind, col, &c, &t, &gi, &h, &b);
    const int bit = 8 * b + 2 * (2 * gi + h);
    *shift = bit % 8;
    return base + L->qh_off + tdm_qt_qh_at((int)(L->cols / 64), row, c, t) + (size_t)(bit / 8);
}

static uint16_t get16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Writes the chunks of columns [c0, c0 + n) of a row from their stored integers u[n] (Q8_0: the
 * int8 bits; 4-bit kinds: 0..15; Q6_K: 0..63), each lane's piece where qkind.h puts it. */
static void put_cols(const struct tdm_cu_qlayout *L, uint8_t *dst, int64_t row, const uint8_t *u,
                     int64_t c0, int64_t n)
{
    const int kind = L->kind, nc = (int)(L->cols / 64);
    for (int c = (int)(c0 / 64); c < (int)((c0 + n) / 64); c++)
        for (int t = 0; t < 4; t++) {
            uint8_t *q = dst + L->q_off + tdm_qt_q_at(kind, nc, row, c, t);
            uint32_t hbits = 0;
            for (int gi = 0; gi < 2; gi++)
                for (int b = 0; b < 4; b++) {
                    const uint8_t lo = u[tdm_qt_col(kind, c, t, gi, 0, b) - c0];
                    const uint8_t hi = u[tdm_qt_col(kind, c, t, gi, 1, b) - c0];
                    if (kind == TDM_CU_Q8_0) {
                        q[8 * gi + b] = lo;
                        q[8 * gi + 4 + b] = hi;
                        continue;
                    }
                    q[4 * gi + b] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
                    hbits |= (uint32_t)(lo >> 4 & 3) << (8 * b + 2 * (2 * gi));
                    hbits |= (uint32_t)(hi >> 4 & 3) << (8 * b + 2 * (2 * gi + 1));
                }
            if (kind == TDM_CU_Q6_K) {
                const uint8_t hb[4] = {(uint8_t)hbits, (uint8_t)(hbits >> 8),
                                       (uint8_t)(hbits >> 16), (uint8_t)(hbits >> 24)};
                memcpy(dst + L->qh_off + tdm_qt_qh_at(nc, row, c, t), hb, 4);
            }
        }
}

/* where the scale bytes of 32-column group g of a row go (Q6_K: of 16-column group g), and
 * those of super-block sb */
static uint8_t *s_dst(const struct tdm_cu_qlayout *L, uint8_t *dst, int64_t row, int64_t g)
{
    const int nc = (int)(L->cols / 64);
    const int per_chunk = L->kind == TDM_CU_Q6_K ? 4 : 2, e = tdm_qt_sb(L->kind);
    return dst + L->s_off + tdm_qt_s_at(L->kind, nc, row, (int)(g / per_chunk)) +
           (size_t)(g % per_chunk) * (size_t)(e / per_chunk);
}
static uint8_t *dd_dst(const struct tdm_cu_qlayout *L, uint8_t *dst, int64_t row, int64_t sb)
{
    return dst + L->dd_off + tdm_qt_dd_at(L->kind, (int)(L->cols / 64), row, (int)sb);
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
        /* a row goes through u[] 4,096 columns at a time (a multiple of every block) */
        for (int64_t c0 = 0; c0 < C; c0 += (int64_t)sizeof u) {
            const int64_t nc = C - c0 < (int64_t)sizeof u ? C - c0 : (int64_t)sizeof u;
            switch (L->kind) {
            case TDM_CU_Q8_0:
                for (int64_t g = c0 / 32; g < (c0 + nc) / 32; g++) {
                    const uint8_t *blk = s + (size_t)g * sizeof(struct block_q8_0);
                    memcpy(s_dst(L, dst, row, g), blk + offsetof(struct block_q8_0, d), 2);
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
                    memcpy(s_dst(L, dst, row, g), blk, one ? 4 : 2); /* d (and m) */
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
                    memcpy(dd_dst(L, dst, row, sb), blk, 4);
                    for (int j = 0; j < 8; j++) {
                        uint8_t scv, mnv;
                        tdm_k_scale_min(blk + offsetof(struct block_q4_K, scales), j, &scv, &mnv);
                        uint8_t *p = s_dst(L, dst, row, 8 * sb + j);
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
                    memcpy(dd_dst(L, dst, row, sb), blk + offsetof(struct block_q6_K, d), 2);
                    for (int j = 0; j < 16; j++)
                        *s_dst(L, dst, row, 16 * sb + j) =
                            blk[offsetof(struct block_q6_K, scales) + (size_t)j];
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
            put_cols(L, dst, row, u, c0, nc);
        }
    }
}

float tdm_cu_qget(const struct tdm_cu_qlayout *L, const void *packed, int64_t row, int64_t col)
{
    uint8_t *base = (uint8_t *)packed;
    bool high;
    const uint8_t *p = q_byte(L, base, row, col, &high);
    const int64_t g32 = col / 32, sb = col / 256;
    const unsigned q = L->kind == TDM_CU_Q8_0 ? *p : high ? *p >> 4 : *p & 0x0F;
    switch (L->kind) {
    case TDM_CU_Q8_0:
        return tdm_f16_to_f32(get16(s_dst(L, base, row, g32))) * (float)(int8_t)q;
    case TDM_CU_Q4_0:
        return tdm_f16_to_f32(get16(s_dst(L, base, row, g32))) * (float)((int)q - 8);
    case TDM_CU_Q4_1: {
        const uint8_t *dm = s_dst(L, base, row, g32);
        return tdm_f16_to_f32(get16(dm)) * (float)q + tdm_f16_to_f32(get16(dm + 2));
    }
    case TDM_CU_Q4_K: {
        const uint8_t *dd = dd_dst(L, base, row, sb), *sm = s_dst(L, base, row, g32);
        const float d = tdm_f16_to_f32(get16(dd)), dmin = tdm_f16_to_f32(get16(dd + 2));
        return d * (float)sm[0] * (float)q - dmin * (float)sm[1];
    }
    case TDM_CU_Q6_K: {
        int sh;
        const uint8_t *ph = qh_byte(L, base, row, col, &sh);
        const int u = (int)(q | ((*ph >> sh) & 3u) << 4);
        const float d = tdm_f16_to_f32(get16(dd_dst(L, base, row, sb)));
        const int8_t s = (int8_t)*s_dst(L, base, row, col / 16);
        return d * (float)s * (float)(u - 32);
    }
    }
    return 0.0f;
}
