/*
 * Small device helpers the CUDA backend's kernels share (gemv.cu, qgemv.cu, kernels.cu): the
 * bf16 mma.sync m16n8k16 with fp32 accumulation, rounding to bf16, and SiLU(gate) * up.
 */
#ifndef TANDEM_BACKEND_CUDA_MMA_CUH
#define TANDEM_BACKEND_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* c += A (16 x 16, row-major fragments a0..a3) * B (16 x 8, col-major fragments b0, b1).
 * Not volatile: it only reads and writes registers, so the compiler may put independent
 * products back to back instead of each waiting for the one before it in program order (a
 * product's own accumulator chain keeps its order, so the bits are the same). */
static __device__ __forceinline__ void tdm_mma16816(float (&c)[4], uint32_t a0, uint32_t a1,
                                                    uint32_t a2, uint32_t a3, uint32_t b0,
                                                    uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* f rounded to bf16 (nearest even), as its 16 bits */
static __device__ __forceinline__ uint16_t tdm_to_bf16(float f)
{
    __nv_bfloat16 b = __float2bfloat16_rn(f);
    return *reinterpret_cast<uint16_t *>(&b);
}

/* silu(g) * u: the one expression of every SwiGLU kernel, fused (gemv.cu, qgemv.cu) or not
 * (kernels.cu), which is what keeps matmul_swiglu's bits those of matmul, matmul, silu_mul */
static __device__ __forceinline__ float tdm_silu_mul(float g, float u)
{
    return (g / (1.0f + expf(-g))) * u;
}

#endif /* TANDEM_BACKEND_CUDA_MMA_CUH */
