/*
 * GGUF-quantised matrices as the CUDA backend keeps them on the device: the same bits as the
 * file's blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), rearranged so that the matrix-vector kernel
 * (qgemv.cu) reads them with aligned, coalesced loads and turns them into tensor-core operands
 * in registers. Nothing is rounded: every stored integer and scale is the file's.
 *
 * Ownership: plain functions over caller-owned buffers. Threading: none (pure functions).
 * This file is C with no CUDA dependency, so the packer and its host decoder are tested on
 * machines without a GPU (tests/backend/test_qweight.c) against tdm_dequantize.
 *
 * Layout of a [rows][cols] matrix: separate arrays (q, qh, s, dd), each starting on a 256-byte
 * boundary, each in tiles (qkind.h has every address as a function, which the packer and the
 * kernels share).
 *   Element order. A row is cut into 64-column chunks. A quad's lane t (0..3) owns 16 elements
 *   e = 8 gi + 4 h + b of a chunk (gi, h in {0, 1}, b in 0..3): the k slots it holds of the
 *   mma.m16n8k16 products of 32-column group gi (tdm_qt_col: Q6_K, column 32 gi + 16 h + 4 t + b
 *   of the chunk; the other kinds, 32 gi + 8 t + 4 h + b, so that a lane's activations of a
 *   group are 16 adjacent bytes).
 *   A lane's piece of a chunk and row: 4-bit kinds (Q4_0, Q4_1, Q4_K, and Q6_K's low bits) 8
 *   bytes, byte 4 gi + b holding element (gi, h = 0, b) in its low nibble and (gi, h = 1, b) in
 *   its high nibble; Q8_0 16 bytes, byte 8 gi + 4 h + b holding element (gi, h, b) as int8;
 *   Q6_K's high two bits a uint32 (qh), element (gi, h, b)'s at bit 8 b + 2 (2 gi + h).
 *   Tiles. The rows are taken 16 at a time (a kernel block's rows; the arrays are padded to whole
 *   blocks) and each row's chunks 16 at a time (a span, 1,024 columns); a tile is one block's
 *   span, and a kernel warp w reads chunks w and w + 8 of it. In a full span a warp's two chunks
 *   of one row are side by side, and so are the 8 rows that one load of a warp touches: a lane's
 *   16-byte load of q brings both its pieces (Q8_0: one chunk's), and a warp's load is 512
 *   contiguous bytes, where a row-major layout touches 8 rows' lines a load. The scales of a
 *   lane's two rows (g, g + 8) and two chunks are one 16-byte piece (Q4_1: two). A row's last,
 *   partial span keeps its chunks one after another, 16 rows each.
 *   s      per 32-column group (Q6_K: per 16-column group), a chunk's groups side by side:
 *            Q8_0, Q4_0  fp16 d                  value = d * q  (Q4_0: d * (q - 8))
 *            Q4_1        fp16 d, fp16 m          value = d * q + m
 *            Q4_K        uint8 sc, uint8 mn      value = (d * sc) * q - (dmin * mn)
 *            Q6_K        int8 sc                 value = (d * sc) * (q - 32), q = lo | hi << 4
 *   dd     per 256-column super-block of the K-quants, a tile's 4 of 16 rows (rows g, g + 8 side
 *          by side): Q4_K fp16 d, fp16 dmin; Q6_K fp16 d.
 * Bits a weight, against the file's: Q8_0 8.5 (8.5), Q4_0 4.5 (4.5), Q4_1 5 (5), Q4_K 4.625
 * (4.5: the 6-bit scales and mins take a byte each), Q6_K 6.5625 (6.5625).
 */
#ifndef TANDEM_BACKEND_CUDA_QWEIGHT_H
#define TANDEM_BACKEND_CUDA_QWEIGHT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/cuda/qkind.h"
#include "tandem/model.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tdm_cu_qlayout {
    int kind; /* enum tdm_cu_qkind */
    int64_t rows, cols;
    size_t q_off, qh_off, s_off, dd_off; /* byte offsets of the arrays (qh, dd: 0 if none) */
    size_t q_bytes, qh_bytes, s_bytes, dd_bytes; /* their sizes, padding rows included */
    size_t bytes;                                /* the whole buffer */
};

/* The kind of a GGUF type, or TDM_CU_Q_NONE. */
int tdm_cu_qkind_of(enum tdm_dtype t);
/* The layout of a rows x cols matrix of type t; false when t has no kernel or cols is not a
 * multiple of 64 (256 for the K-quants). */
bool tdm_cu_qlayout(enum tdm_dtype t, int64_t rows, int64_t cols, struct tdm_cu_qlayout *out);
/* Rearranges rows [r0, r0 + n) of a matrix in GGUF blocks (src: row r0's first byte, rows of
 * src_row_bytes, any alignment) into dst, a host buffer of L->bytes laid out as above (the
 * padding between its arrays is left as it was). */
void tdm_cu_qpack_rows(const struct tdm_cu_qlayout *L, const void *src, size_t src_row_bytes,
                       int64_t r0, int64_t n, void *dst);
/* Element (row, col) of a packed matrix, computed as the kernels compute it (host reference). */
float tdm_cu_qget(const struct tdm_cu_qlayout *L, const void *packed, int64_t row, int64_t col);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_BACKEND_CUDA_QWEIGHT_H */
