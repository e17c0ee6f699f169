/*
 * The GGUF block types the CUDA backend keeps quantised on the device, and where a packed
 * matrix's bytes lie (qweight.h describes the layout), as one small header that the C packer
 * and the kernels both include, so that both compute every address with the same functions.
 * Pure functions, no state.
 */
#ifndef TANDEM_BACKEND_CUDA_QKIND_H
#define TANDEM_BACKEND_CUDA_QKIND_H

#include <stddef.h>
#include <stdint.h>

/* 0: none (the matrix is held as bf16) */
enum tdm_cu_qkind {
    TDM_CU_Q_NONE = 0,
    TDM_CU_Q8_0,
    TDM_CU_Q4_0,
    TDM_CU_Q4_1,
    TDM_CU_Q4_K,
    TDM_CU_Q6_K
};

#if defined(__CUDACC__)
#define TDM_QT_FN __host__ __device__ __forceinline__
#else
#define TDM_QT_FN static inline
#endif

/* Bytes of one row's share of one 64-column chunk: in q, in qh (Q6_K), in s; and of one
 * 256-column super-block in dd (the K-quants). Macros, so that they are constants where a
 * compile-time kind is given (the kernels' shared-memory geometry), and functions. */
#define TDM_QT_QB(kind) ((kind) == TDM_CU_Q8_0 ? 64 : 32)
#define TDM_QT_HB(kind) ((kind) == TDM_CU_Q6_K ? 16 : 0)
#define TDM_QT_SB(kind) ((kind) == TDM_CU_Q4_1 ? 8 : 4)
#define TDM_QT_DB(kind) ((kind) == TDM_CU_Q4_K ? 4 : (kind) == TDM_CU_Q6_K ? 2 : 0)
TDM_QT_FN int tdm_qt_qb(int kind)
{
    return TDM_QT_QB(kind);
}
TDM_QT_FN int tdm_qt_hb(int kind)
{
    return TDM_QT_HB(kind);
}
TDM_QT_FN int tdm_qt_sb(int kind)
{
    return TDM_QT_SB(kind);
}
TDM_QT_FN int tdm_qt_db(int kind)
{
    return TDM_QT_DB(kind);
}

/* Tile (rb, s) of an array of e bytes a row a chunk, nc chunks a row: 16 rows x 16 chunks
 * (fewer in a row's last, partial span), the spans of row block 0 first. For dd, e is bytes a
 * super-block and n the super-blocks a row (4 a span). */
TDM_QT_FN size_t tdm_qt_tile(int e, int nc, int64_t rb, int s)
{
    return ((size_t)rb * (size_t)nc + 16u * (size_t)s) * 16u * (size_t)e;
}
TDM_QT_FN size_t tdm_qt_dd_tile(int db, int ns, int64_t rb, int s)
{
    return ((size_t)rb * (size_t)ns + 4u * (size_t)s) * 16u * (size_t)db;
}
/* whether span s of a row of nc chunks has all 16 */
TDM_QT_FN int tdm_qt_full(int nc, int s)
{
    return 16 * (s + 1) <= nc;
}

/* In a tile: the piece of lane t (a quarter of the row's e bytes of chunk cc of the tile) of
 * row r (0..15). In a full span, chunks cc and cc + 8 are one warp's pair: 4-bit q and qh
 * (paired) put a lane's two pieces side by side, and the 8 rows of a quad's request side by
 * side (row r's pieces of warp w's pair at w 32e + r 2e); Q8_0 (split) keeps the two chunks
 * apart and the rows side by side in each (w 32e + u 16e + r e). A partial span holds its
 * chunks one after another, 16 rows each. */
TDM_QT_FN size_t tdm_qt_piece(int split, int e, int full, int cc, int r, int t)
{
    if (!full) return (size_t)(cc * 16 * e + r * e + t * (e / 4));
    const int w = cc % 8, u = cc / 8;
    return split ? (size_t)(w * 32 * e + u * 16 * e + r * e + t * (e / 4))
                 : (size_t)(w * 32 * e + r * 2 * e + t * (e / 2) + u * (e / 4));
}
/* In a tile of s: row r's e bytes of chunk cc. In a full span a lane of quad g reads rows g and
 * g + 8 of its warp's pair in one 4e-byte piece (row g: chunk cc, cc + 8; then row g + 8). */
TDM_QT_FN size_t tdm_qt_scales(int e, int full, int cc, int r)
{
    if (!full) return (size_t)(cc * 16 * e + ((r % 8) * 2 + r / 8) * e);
    const int w = cc % 8, u = cc / 8;
    return (size_t)(w * 32 * e + (r % 8) * 4 * e + (r / 8) * 2 * e + u * e);
}
/* In a tile of dd: row r's db bytes of the tile's super-block sbi (rows g and g + 8 side by
 * side). */
TDM_QT_FN size_t tdm_qt_dd(int db, int sbi, int r)
{
    return (size_t)(sbi * 16 * db + ((r % 8) * 2 + r / 8) * db);
}

/* Byte offsets in each array of (row, chunk c, lane t) for a row of nc chunks. */
TDM_QT_FN size_t tdm_qt_q_at(int kind, int nc, int64_t row, int c, int t)
{
    const int e = tdm_qt_qb(kind), s = c / 16;
    return tdm_qt_tile(e, nc, row / 16, s) +
           tdm_qt_piece(kind == TDM_CU_Q8_0, e, tdm_qt_full(nc, s), c % 16, (int)(row % 16), t);
}
TDM_QT_FN size_t tdm_qt_qh_at(int nc, int64_t row, int c, int t)
{
    const int e = TDM_QT_HB(TDM_CU_Q6_K), s = c / 16;
    return tdm_qt_tile(e, nc, row / 16, s) +
           tdm_qt_piece(0, e, tdm_qt_full(nc, s), c % 16, (int)(row % 16), t);
}
TDM_QT_FN size_t tdm_qt_s_at(int kind, int nc, int64_t row, int c)
{
    const int e = tdm_qt_sb(kind), s = c / 16;
    return tdm_qt_tile(e, nc, row / 16, s) +
           tdm_qt_scales(e, tdm_qt_full(nc, s), c % 16, (int)(row % 16));
}
/* super-block sb (256 columns) of the row */
TDM_QT_FN size_t tdm_qt_dd_at(int kind, int nc, int64_t row, int sb)
{
    const int db = tdm_qt_db(kind);
    return tdm_qt_dd_tile(db, nc / 4, row / 16, sb / 4) + tdm_qt_dd(db, sb % 4, (int)(row % 16));
}

/* The column of element (gi, h, b) of lane t in chunk c: the k slots of mma.m16n8k16 that lane
 * t holds in the product of group gi's half h (b = 0, 1: slots 2t, 2t + 1; b = 2, 3: 2t + 8,
 * 2t + 9). Q6_K, whose scales cover 16 columns, gives each product one 16-column half (h) and a
 * lane 4 columns of it; the others give a lane 8 adjacent columns of each 32-column group (4 a
 * product), so that its activations are one 16-byte load a group. */
TDM_QT_FN int tdm_qt_col(int kind, int c, int t, int gi, int h, int b)
{
    return kind == TDM_CU_Q6_K ? 64 * c + 32 * gi + 16 * h + 4 * t + b
                               : 64 * c + 32 * gi + 8 * t + 4 * h + b;
}
/* the inverse: the element that holds column col */
TDM_QT_FN void tdm_qt_where(int kind, int64_t col, int *c, int *t, int *gi, int *h, int *b)
{
    const int r = (int)(col % 64);
    *c = (int)(col / 64);
    *gi = r / 32;
    *b = r % 4;
    if (kind == TDM_CU_Q6_K) {
        *h = (r / 16) % 2;
        *t = (r / 4) % 4;
    } else {
        *t = (r % 32) / 8;
        *h = (r / 4) % 2;
    }
}

#endif /* TANDEM_BACKEND_CUDA_QKIND_H */
