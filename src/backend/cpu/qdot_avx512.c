/*
 * Quantised tiles for AVX-512 CPUs with AVX512-VNNI: qdot_x86.h's 256-bit tile with the EVEX
 * form of VPDPBUSD on ymm registers (AVX512-VNNI + AVX512VL; functions with a target attribute,
 * run only on CPUs that have it; a CPU with AVX-512 but no VNNI runs the AVX2 tiles).
 * qdot.c gives the arithmetic every variant reproduces bit for bit.
 *
 * Why not 512 bits: a form that put two weight rows in the halves of one zmm register (one
 * VPDPBUSD for two rows, the halves split again for the reduction) measured slower than the
 * 256-bit tile on this project's 2-core Xeon VM at every shape of `tandem bench model`
 * (prefill 141 against 193 tokens/s, batch-8 decode 101 against 142, bench/RESULTS.md): the
 * inserts and extracts cost more than the multiply-adds they saved, and the products are not
 * where a quantised tile's time goes (the per-block reduction and scales are).
 */
#include "backend/cpu/qdot_x86.h"

#define VNNI __attribute__((target("avx512vnni")))

/* the high plane's sums, times 256, accumulate the low plane's */
QAI VNNI __m256i dot1_avx512_vnni(__m256i u, __m256i h, __m256i l)
{
    return _mm256_dpbusd_epi32(
        _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, h), 8), u, l);
}

#define QDOT_KERNEL  qtile_avx512_vnni
#define QDOT_DOT1    dot1_avx512_vnni
#define QDOT_Q8_BIAS 1
#define QDOT_FN_ATTR VNNI
#include "backend/cpu/qdot_x86.h"

TDM_CPU_DEF_QTILE_TABLE(tdm_cpu_qtiles_avx512_vnni, qv, VNNI, qtile_avx512_vnni)
