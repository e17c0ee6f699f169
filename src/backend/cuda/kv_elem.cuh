/*
 * KV cache elements on the device (enum tdm_cu_kv): fp32, bf16 or f16 in memory, fp32 in the
 * kernels. A load widens exactly; a store rounds to nearest even (as the CPU backend's
 * kv_narrow does, so the two backends store the same bits for the same fp32 values, NaN
 * payloads aside). The type is a launch argument, uniform over a kernel, so its branch costs
 * nothing next to the load.
 */
#ifndef TANDEM_BACKEND_CUDA_KV_ELEM_CUH
#define TANDEM_BACKEND_CUDA_KV_ELEM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "backend/cuda/cuda_kernels.h"

__device__ __forceinline__ float tdm_kv_widen(uint16_t h, int t)
{
    return t == TDM_CU_KV_BF16 ? __uint_as_float((uint32_t)h << 16)
                               : __half2float(__ushort_as_half(h));
}

/* Element i of a KV region. */
__device__ __forceinline__ float tdm_kv_ld(const void *base, size_t i, int t)
{
    if (t == TDM_CU_KV_F32) return static_cast<const float *>(base)[i];
    return tdm_kv_widen(static_cast<const uint16_t *>(base)[i], t);
}

/* Elements i .. i + 3 (i a multiple of 4, the region 16-byte aligned). */
__device__ __forceinline__ float4 tdm_kv_ld4(const void *base, size_t i, int t)
{
    if (t == TDM_CU_KV_F32)
        return *reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i);
    const uint2 u = *reinterpret_cast<const uint2 *>(static_cast<const uint16_t *>(base) + i);
    return make_float4(
        tdm_kv_widen((uint16_t)(u.x & 0xffffu), t), tdm_kv_widen((uint16_t)(u.x >> 16), t),
        tdm_kv_widen((uint16_t)(u.y & 0xffffu), t), tdm_kv_widen((uint16_t)(u.y >> 16), t));
}

/* Elements i .. i + 7 of a 2-byte region (i a multiple of 8, the region 16-byte aligned) as
 * their 16 bytes: one load where fp32 takes two. */
__device__ __forceinline__ uint4 tdm_kv_ld8_raw(const void *base, size_t i)
{
    return *reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(base) + i);
}

/* Two 2-byte elements (a 32-bit word, low half first) widened. */
__device__ __forceinline__ float2 tdm_kv_widen2(uint32_t w, int t)
{
    return make_float2(tdm_kv_widen((uint16_t)(w & 0xffffu), t),
                       tdm_kv_widen((uint16_t)(w >> 16), t));
}

__device__ __forceinline__ void tdm_kv_st(void *base, size_t i, int t, float x)
{
    if (t == TDM_CU_KV_F32) {
        static_cast<float *>(base)[i] = x;
    } else if (t == TDM_CU_KV_BF16) {
        const __nv_bfloat16 b = __float2bfloat16_rn(x);
        static_cast<uint16_t *>(base)[i] = *reinterpret_cast<const uint16_t *>(&b);
    } else {
        static_cast<uint16_t *>(base)[i] = __half_as_ushort(__float2half_rn(x));
    }
}

#endif /* TANDEM_BACKEND_CUDA_KV_ELEM_CUH */
