/*
 * Programmatic dependent launch (Hopper) for the CUDA backend's kernels: a kernel launched with
 * tdm_pdl_launch is launched while the kernel before it on the stream is still completing, so
 * the launch latency and the new kernel's prologue (for a matrix-vector product: its first
 * weight loads, which depend on nothing before it) overlap the previous kernel's drain. Decode
 * steps are chains of short kernels, so this is time a batch-1 step would otherwise spend idle.
 *
 * The contract every kernel launched this way keeps: it calls tdm_pdl_wait() before it reads
 * anything an earlier kernel wrote (or writes anything an earlier kernel reads); the wait
 * returns once the previous grid has completed and its writes are visible, and since that grid
 * waited for its own predecessor, the whole stream before it has completed too. Without the
 * launch attribute the wait is a no-op, so a kernel keeps working when launched plainly.
 * Stream capture turns the attribute into programmatic edges of the CUDA graph.
 *
 * No kernel triggers its dependents early (griddepcontrol.launch_dependents): the next grid
 * then launches as this one completes. Measured on an H200 (bench/RESULTS.md, 2026-11-30), an
 * early trigger at the top of every kernel let waiting blocks of the next kernel take SM room
 * from the running one (8B shape, batch 8: 1,152 -> 642 tok/s), while launching at completion
 * gained 1-1.5% (batch 1: 206 -> 209 tok/s).
 *
 * $TANDEM_CUDA_PDL=0 launches everything plainly (for comparisons).
 */
#ifndef TANDEM_BACKEND_CUDA_PDL_CUH
#define TANDEM_BACKEND_CUDA_PDL_CUH

#include <cstdlib>
#include <cuda_runtime.h>
#include <utility>

__device__ __forceinline__ void tdm_pdl_wait()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

static inline bool tdm_pdl_enabled()
{
    static int on = -1; /* the backend is driven by one thread per process in practice */
    if (on < 0) {
        const char *e = getenv("TANDEM_CUDA_PDL");
        on = !(e && *e == '0');
    }
    return on == 1;
}

/* Launches kernel k as <<<grid, block, smem, s>>>(args...), with the programmatic-serialization
 * attribute unless disabled. Errors surface through cudaGetLastError as for <<<>>>. */
template <typename... P, typename... A>
static inline void tdm_pdl_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                                  cudaStream_t s, A &&...args)
{
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = tdm_pdl_enabled() ? 1 : 0;
    (void)cudaLaunchKernelEx(&cfg, k, std::forward<A>(args)...);
}

#endif /* TANDEM_BACKEND_CUDA_PDL_CUH */
