/*
 * KV elements of 2-byte types (bf16, f16) to and from fp32, portable (cpu_int.h has the
 * contract). Widening is exact (an f16 NaN comes out quiet, as F16C makes it); narrowing rounds
 * to nearest even (tdm_f32_to_bf16 and tdm_f32_to_f16, whose bits kv_convert_avx2.c reproduces
 * lane for lane).
 *
 * Threading: pure functions.
 */
#include "backend/cpu/cpu_int.h"

#include <string.h>

void tdm_cpu_kv_widen_portable(enum tdm_dtype dt, const uint16_t *src, float *dst, int n)
{
    if (dt == TDM_DTYPE_BF16) {
        for (int i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)src[i] << 16;
            memcpy(&dst[i], &u, 4);
        }
    } else {
        for (int i = 0; i < n; i++) {
            dst[i] = tdm_f16_to_f32(src[i]);
            if ((src[i] & 0x7c00) == 0x7c00 && (src[i] & 0x3ff)) { /* a NaN comes out quiet */
                uint32_t u;
                memcpy(&u, &dst[i], 4);
                u |= 0x00400000u;
                memcpy(&dst[i], &u, 4);
            }
        }
    }
}

void tdm_cpu_kv_narrow_portable(enum tdm_dtype dt, const float *src, uint16_t *dst, int n)
{
    if (dt == TDM_DTYPE_BF16) {
        for (int i = 0; i < n; i++)
            dst[i] = tdm_f32_to_bf16(src[i]);
    } else {
        for (int i = 0; i < n; i++)
            dst[i] = tdm_f32_to_f16(src[i]);
    }
}
