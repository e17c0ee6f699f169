/*
 * The CUDA backend: its vtable, creation and destruction, and the rooflines that `tandem bench
 * model --backend cuda` prints. The rest is laid out by section:
 *   cuda_mem.c      device memory and weight conversion;
 *   cuda_step.c     step metadata, CUDA graphs of decode steps, the memory plan;
 *   cuda_ops.c      the vtable's ops, the layer-completion counter, sync;
 *   cuda_profile.c  the op-by-op profile ($TANDEM_CUDA_PROFILE);
 *   cuda_gemm.c, cuda_sample.c and the .cu files: cuBLASLt, sampling and the kernels.
 *
 * Contract choices (backend.h has the user-facing summary):
 *   - Activations stay fp32 in device memory, as the vtable says; a matmul rounds its input to
 *     bf16 (one conversion pass, skipped when the producing op already wrote a bf16 "shadow"
 *     of that buffer: the norms, SiLU*mul and attention do) and cuBLASLt multiplies it by the
 *     bf16 weight with fp32 accumulation into an fp32 output.
 *   - Weights: matrices become bf16 on the device (GGUF blocks dequantised on the host first),
 *     vectors stay fp32. A weight whose data is already device memory (random benchmark
 *     weights) is passed through.
 *   - Index arrays the ops take (tokens, rows, the tdm_step) are host memory, as for the CPU.
 *     step_begin uploads the step once per forward pass into fixed device buffers, laid out
 *     by capacity so their addresses never move; an op given any other step or index array
 *     (the op test calls ops directly) uploads it on the spot.
 *
 * CUDA graphs: a step whose sequences all add one token (a decode step) is padded up to a
 * bucket (1, 2, 4, 8, 16, 32, 48, 64, then steps of 32 to 256, then of 64) and the layer loop
 * of the engine is recorded once per (engine, bucket) and replayed afterwards. Everything a
 * replay depends on lives at fixed device addresses: the metadata buffers, the workspace,
 * the engine's scratch and KV pool, the weights. Padding tokens get their tdm_cuda_own empty
 * sequence (KV length 0, no slot): they write no KV, attend to nothing and touch only their
 * tdm_cuda_own rows. Split-KV attention in a graph uses a split count fixed by the bucket
 * (attention.cu).
 *
 * Layer counter: layer_done launches a one-thread kernel that stores layer + 1 into a device
 * alias of mapped pinned host memory, so it also runs inside graphs. The counter is either the
 * backend's tdm_cuda_own (tdm_backend_cuda_counter) or the caller's, whose page is registered as
 * mapped memory by step_begin (outside any capture).
 *
 * Memory plan (reserve): the KV pool gets fraction * total device memory minus everything in
 * use once the weights, the engine's scratch and the worst-case workspace are allocated; the
 * plan is logged at INFO.
 *
 * Errors: a CUDA error inside an op is fatal (tdm_cu_fatal: message, then abort), since ops
 * return nothing; creation and weight preparation return TDM_E* with a message.
 *
 * Threading: one thread drives an instance; all work is on one non-blocking stream.
 */
#include "backend/cuda/cuda_int.h"
#include "backend/cuda/qweight.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Noreturn void tdm_cu_fatal(const char *what, const char *why, const char *file, int line)
{
    TDM_ERROR("cuda backend: %s failed: %s (%s:%d)", what, why, file, line);
    abort();
}

/* ---- lifetime ---- */

static void cu_destroy(tdm_backend_t *b)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    cudaStreamSynchronize(cu->stream);
    if (cu->idle_steps)
        TDM_INFO("cuda backend: %llu sampled steps: the device ran %.1f us a step and waited "
                 "%.1f us before each (%.1f%% idle; longest %.1f us; %llu gaps over %d ms, the "
                 "server without work, left out)",
                 (unsigned long long)cu->idle_steps, 1e3 * cu->busy_ms / (double)cu->idle_steps,
                 1e3 * cu->idle_ms / (double)cu->idle_steps,
                 100.0 * cu->idle_ms / (cu->idle_ms + cu->busy_ms), 1e3 * cu->idle_max_ms,
                 (unsigned long long)cu->idle_long, TDM_CU_IDLE_LONG_MS);
    for (int i = 0; i < TDM_CU_IDLE_SLOTS; i++)
        for (int j = 0; j < 2; j++)
            if (cu->idle_ev[i][j]) cudaEventDestroy(cu->idle_ev[i][j]);
    if (cu->prof) {
        tdm_cuda_prof_collect(cu);
        tdm_cuda_prof_report(cu);
        for (int i = 0; i < 2 * TDM_CU_PROF_EVENTS && cu->prof_ev[i]; i++)
            cudaEventDestroy(cu->prof_ev[i]);
    }
    tdm_cuda_drop_graphs(cu);
    for (int i = 0; i < cu->n_owned; i++)
        cudaFree(cu->owned[i].dev);
    free(cu->owned);
    for (int i = 0; i < cu->n_counters; i++)
        if (cu->counters[i].host_page) cudaHostUnregister(cu->counters[i].host_page);
    void *dev[] = {cu->xb,     cu->shb[0], cu->shb[1], cu->up,    cu->part, cu->d_inv_freq,
                   cu->d_rows, cu->d_meta, cu->lt_ws,  cu->d_moe, cu->deq};
    for (size_t i = 0; i < TDM_ARRAY_LEN(dev); i++)
        if (dev[i]) cudaFree(dev[i]);
    for (int i = 0; i < 2; i++) {
        if (cu->h_meta_buf[i]) cudaFreeHost(cu->h_meta_buf[i]);
        if (cu->meta_ev[i]) cudaEventDestroy(cu->meta_ev[i]);
    }
    if (cu->h_inv_freq) cudaFreeHost(cu->h_inv_freq);
    if (cu->h_counter) cudaFreeHost(cu->h_counter);
    tdm_cu_sample_free(cu);
    tdm_cu_gemm_destroy(cu);
    if (cu->lt) cu->ltf->destroy(cu->lt);
    if (cu->stream) cudaStreamDestroy(cu->stream);
    free(cu);
}

static struct tdm_mem_place cu_buf_place(tdm_backend_t *b)
{
    return (struct tdm_mem_place){.kind = TDM_MEM_DEVICE, .device = tdm_cu_of(b)->device};
}

static const struct tdm_backend_i CUDA_IFACE = {
    .name = "cuda",
    .destroy = cu_destroy,
    .buf_alloc = tdm_cuda_buf_alloc,
    .buf_place = cu_buf_place,
    .buf_free = tdm_cuda_buf_free,
    .upload = tdm_cuda_upload,
    .download = tdm_cuda_download,
    .weight_prepare = tdm_cuda_weight_prepare,
    .weight_bytes = tdm_cuda_weight_bytes,
    .embed = tdm_cuda_embed,
    .rmsnorm = tdm_cuda_rmsnorm,
    .add_rmsnorm = tdm_cuda_add_rmsnorm,
    .matmul = tdm_cuda_matmul,
    .matmul_multi = tdm_cuda_matmul_multi,
    .matmul_swiglu = tdm_cuda_matmul_swiglu,
    .head_rmsnorm = tdm_cuda_head_rmsnorm,
    .rope_kv_append = tdm_cuda_rope_kv_append,
    .attention = tdm_cuda_attention,
    .silu_mul = tdm_cuda_silu_mul,
    .add = tdm_cuda_add,
    .gather_rows = tdm_cuda_gather_rows,
    .zero = tdm_cuda_zero,
    .rows_scale_add = tdm_cuda_rows_scale_add,
    .head_matmul = tdm_cuda_head_matmul,
    .scatter_cols = tdm_cuda_scatter_cols,
    .kv_copy = tdm_cuda_kv_copy,
    .layer_done = tdm_cuda_layer_done,
    .sync = tdm_cuda_sync,
    .reserve = tdm_cuda_reserve,
    .step_begin = tdm_cuda_step_begin,
    .step_end = tdm_cuda_step_end,
    .step_forget = tdm_cuda_step_forget,
    .sample = tdm_cu_sample_rows,
    .sample_launch = tdm_cu_sample_launch,
    .sample_wait = tdm_cu_sample_wait,
    .allreduce = tdm_cuda_allreduce,
};

#define CREATE_CHECK(call, what)                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            st = tdm_err_set(TDM_EIO, "cuda backend: %s: %s", what, cudaGetErrorString(e_));       \
            goto out_destroy;                                                                      \
        }                                                                                          \
    } while (0)

tdm_status tdm_backend_cuda_create(const struct tdm_backend_cuda_opts *opts, tdm_backend_t **out)
{
    const struct tdm_backend_cuda_opts o = opts ? *opts : (struct tdm_backend_cuda_opts){0};
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || n_dev == 0) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_EUNSUPPORTED, "cuda backend: no CUDA GPU available (%s)",
                           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    }
    if (o.device < 0 || o.device >= n_dev)
        return tdm_err_set(TDM_EINVAL, "cuda backend: device %d does not exist (%d present)",
                           o.device, n_dev);
    if (o.gpu_memory_fraction > 1.0)
        return tdm_err_set(TDM_EINVAL, "cuda backend: gpu memory fraction %.3f is above 1",
                           o.gpu_memory_fraction);
    struct tdm_cuda *cu = calloc(1, sizeof *cu);
    if (!cu) return tdm_err_set(TDM_ENOMEM, "cuda backend: out of memory");
    tdm_status st = TDM_OK;
    cu->base.iface = &CUDA_IFACE;
    cu->base.impl = cu;
    cu->device = o.device;
    cu->mem_fraction =
        o.gpu_memory_fraction > 0 ? o.gpu_memory_fraction : TDM_GPU_MEMORY_FRACTION_DEFAULT;
    cu->bf16_weights = o.bf16_weights;
    cu->batch_invariant = o.batch_invariant;
    cu->prof = getenv("TANDEM_CUDA_PROFILE") && *getenv("TANDEM_CUDA_PROFILE") == '1';
    /* $TANDEM_CUDA_PROFILE_MAX_TOKENS=N: only steps of at most N tokens (decode alone) */
    const char *pmt = getenv("TANDEM_CUDA_PROFILE_MAX_TOKENS");
    cu->prof_max_tokens = pmt && atoi(pmt) > 0 ? atoi(pmt) : INT32_MAX;
    cu->graphs_enabled = !o.no_graphs && !getenv("TANDEM_CUDA_NO_GRAPHS") && !cu->prof;
    /* $TANDEM_CUDA_ATTN_FILL=N (1-64, for tuning; default 2): cu_attention_impl's split policy */
    const char *fill = getenv("TANDEM_CUDA_ATTN_FILL");
    cu->attn_fill = fill && atoi(fill) > 0 && atoi(fill) <= 64 ? atoi(fill) : 2;
    /* $TANDEM_CUDA_IDLE=1: the device's time between steps, reported at destroy */
    cu->idle_on = getenv("TANDEM_CUDA_IDLE") && *getenv("TANDEM_CUDA_IDLE") == '1';
    cu->idle_last = -1;
    CREATE_CHECK(cudaSetDevice(o.device), "set device");
    struct cudaDeviceProp prop;
    CREATE_CHECK(cudaGetDeviceProperties(&prop, o.device), "device properties");
    if (prop.major < 9) {
        st = tdm_err_set(TDM_EUNSUPPORTED,
                         "cuda backend: %s is compute capability %d.%d; this build targets "
                         "sm_90a (Hopper)",
                         prop.name, prop.major, prop.minor);
        goto out_destroy;
    }
    snprintf(cu->name, sizeof cu->name, "%s", prop.name);
    cu->n_sms = prop.multiProcessorCount;
    cu->total_mem = prop.totalGlobalMem;
    CREATE_CHECK(cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking), "stream");
    if (!(cu->ltf = tdm_cu_lt())) {
        st = TDM_EUNSUPPORTED; /* tdm_cu_lt said why */
        goto out_destroy;
    }
    if (cu->ltf->create(&cu->lt) != CUBLAS_STATUS_SUCCESS) {
        st = tdm_err_set(TDM_EIO, "cuda backend: cublasLtCreate failed");
        goto out_destroy;
    }
    cu->lt_ws_bytes = LT_WORKSPACE_BYTES;
    CREATE_CHECK(cudaMalloc(&cu->lt_ws, cu->lt_ws_bytes), "cuBLASLt workspace");
    CREATE_CHECK(cudaMalloc((void **)&cu->d_inv_freq, INV_FREQ_MAX * sizeof(float)), "inv_freq");
    CREATE_CHECK(cudaMallocHost((void **)&cu->h_inv_freq, INV_FREQ_MAX * sizeof(float)),
                 "inv_freq");
    CREATE_CHECK(cudaHostAlloc((void **)&cu->h_counter, 64, cudaHostAllocMapped), "counter");
    *cu->h_counter = 0;
    CREATE_CHECK(cudaHostGetDevicePointer((void **)&cu->d_counter, cu->h_counter, 0), "counter");
    TDM_DEBUG("cuda backend: %s, %d SMs, %.1f GiB", cu->name, cu->n_sms,
              cu->total_mem / 1073741824.0);
    *out = &cu->base;
    return TDM_OK;
out_destroy:
    cu_destroy(&cu->base);
    return st;
}

bool tdm_backend_is_cuda(const tdm_backend_t *b)
{
    return b && b->iface == &CUDA_IFACE;
}

tdm_status tdm_backend_cuda_info(tdm_backend_t *b, char *name, size_t cap, size_t *total_bytes)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    if (name && cap) snprintf(name, cap, "%s", cu->name);
    if (total_bytes) *total_bytes = cu->total_mem;
    return TDM_OK;
}

tdm_status tdm_cuda_device_pci(int device, char *busid, size_t cap)
{
    char id[32];
    const cudaError_t e = cudaDeviceGetPCIBusId(id, (int)sizeof id, device);
    if (e != cudaSuccess)
        return tdm_err_set(TDM_EUNSUPPORTED, "CUDA device %d: no PCI bus id (%s)", device,
                           cudaGetErrorString(e));
    /* CUDA writes "0000:18:00.0" in upper case and may give an 8-digit domain; hwloc's form is
     * a 4-digit domain, lower case */
    const char *p = strlen(id) > 12 ? id + strlen(id) - 12 : id;
    size_t i = 0;
    for (; p[i] && i + 1 < cap; i++)
        busid[i] = (char)((p[i] >= 'A' && p[i] <= 'F') ? p[i] - 'A' + 'a' : p[i]);
    if (cap) busid[i] = '\0';
    return TDM_OK;
}

void *tdm_backend_cuda_host_alloc(tdm_backend_t *b, size_t bytes)
{
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        tdm_err_set(TDM_ENOMEM, "cuda backend: cannot pin %zu bytes of host memory: %s", bytes,
                    cudaGetErrorString(cudaGetLastError()));
        return NULL;
    }
    return p;
}

void tdm_backend_cuda_host_free(tdm_backend_t *b, void *p)
{
    if (p) cudaFreeHost(p);
}

tdm_status tdm_backend_cuda_memset(tdm_backend_t *b, void *dev, int value, size_t bytes)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    struct cudaPointerAttributes pa;
    if (cudaPointerGetAttributes(&pa, dev) == cudaSuccess && pa.type == cudaMemoryTypeDevice &&
        pa.device != cu->device) { /* another GPU's memory (a tensor-parallel rank's pool) */
        int cur = 0;
        cudaGetDevice(&cur);
        cudaError_t e = cudaSetDevice(pa.device);
        if (e == cudaSuccess) e = cudaMemset(dev, value, bytes);
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
        cudaSetDevice(cur);
        if (e != cudaSuccess)
            return tdm_err_set(TDM_EIO, "cuda backend: memset on GPU %d failed: %s", pa.device,
                               cudaGetErrorString(e));
        return TDM_OK;
    }
    (void)cudaGetLastError();
    tdm_cuda_bind(cu);
    if (cudaMemsetAsync(dev, value, bytes, cu->stream) != cudaSuccess ||
        cudaStreamSynchronize(cu->stream) != cudaSuccess)
        return tdm_err_set(TDM_EIO, "cuda backend: memset failed: %s",
                           cudaGetErrorString(cudaGetLastError()));
    return TDM_OK;
}

_Atomic int32_t *tdm_backend_cuda_counter(tdm_backend_t *b)
{
    if (!tdm_backend_is_cuda(b)) return NULL;
    return (_Atomic int32_t *)tdm_cu_of(b)->h_counter;
}

/* A matrix kept in GGUF blocks (qweight.h) with random integers and scales that keep its values
 * within about [-a, a], a = max(|lo|, |hi|). */
static tdm_status random_blocks(struct tdm_cuda *cu, const struct tdm_cu_qlayout *L,
                                enum tdm_dtype dtype, uint64_t seed, float lo, float hi,
                                struct tdm_weight *out)
{
    void *dev = NULL;
    if (cudaMalloc(&dev, L->bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes", L->bytes);
    }
    uint8_t *base = dev;
    const float a = fmaxf(fabsf(lo), fabsf(hi));
    /* every array whole, the padding rows included (qweight.h) */
    tdm_cu_fill_bytes(cu->stream, base + L->q_off, L->q_bytes, seed);
    if (L->qh_off) tdm_cu_fill_bytes(cu->stream, base + L->qh_off, L->qh_bytes, seed + 1);
    switch (L->kind) {
    case TDM_CU_Q8_0:
    case TDM_CU_Q4_0:
        tdm_cu_fill_uniform_f16(cu->stream, (uint16_t *)(base + L->s_off), L->s_bytes / 2, seed + 2,
                                0.0f, a / (L->kind == TDM_CU_Q8_0 ? 64.0f : 4.0f));
        break;
    case TDM_CU_Q4_1: /* d and m */
        tdm_cu_fill_uniform_f16(cu->stream, (uint16_t *)(base + L->s_off), L->s_bytes / 2, seed + 2,
                                0.0f, a / 8.0f);
        break;
    case TDM_CU_Q4_K: /* 8-bit scales and mins, then d and dmin */
        tdm_cu_fill_bytes(cu->stream, base + L->s_off, L->s_bytes, seed + 2);
        tdm_cu_fill_uniform_f16(cu->stream, (uint16_t *)(base + L->dd_off), L->dd_bytes / 2,
                                seed + 3, 0.0f, a / (128.0f * 15.0f));
        break;
    case TDM_CU_Q6_K:
        tdm_cu_fill_bytes(cu->stream, base + L->s_off, L->s_bytes, seed + 2);
        tdm_cu_fill_uniform_f16(cu->stream, (uint16_t *)(base + L->dd_off), L->dd_bytes / 2,
                                seed + 3, 0.0f, a / (64.0f * 32.0f));
        break;
    }
    TDM_CU_CHECK(cudaGetLastError());
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    tdm_status st = tdm_cuda_own_blocks(cu, dev, L, dtype, out);
    if (st != TDM_OK) cudaFree(dev);
    return st;
}

tdm_status tdm_backend_cuda_random_weight(tdm_backend_t *b, enum tdm_dtype dtype, int64_t rows,
                                          int64_t cols, uint64_t seed, float lo, float hi,
                                          struct tdm_weight *out)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    struct tdm_cu_qlayout L;
    if (rows > 1 && !cu->bf16_weights && tdm_cu_qlayout(dtype, rows, cols, &L))
        return random_blocks(cu, &L, dtype, seed, lo, hi, out);
    if (rows < 1 || cols < 1 || (dtype != TDM_DTYPE_BF16 && dtype != TDM_DTYPE_F32))
        return tdm_err_set(TDM_EINVAL, "cuda backend: random weight %lld x %lld of %s",
                           (long long)rows, (long long)cols, tdm_dtype_name(dtype));
    const size_t esz = dtype == TDM_DTYPE_BF16 ? 2 : 4, n = (size_t)rows * (size_t)cols;
    const size_t extra = dtype == TDM_DTYPE_F32 && rows == 1 ? (size_t)cols * 2 : 0;
    void *dev = NULL;
    if (cudaMalloc(&dev, n * esz + extra) != cudaSuccess) {
        (void)cudaGetLastError();
        return tdm_err_set(TDM_ENOMEM, "cuda backend: cannot allocate %zu bytes", n * esz);
    }
    if (dtype == TDM_DTYPE_BF16)
        tdm_cu_fill_uniform_bf16(cu->stream, dev, n, seed, lo, hi);
    else
        tdm_cu_fill_uniform_f32(cu->stream, dev, n, seed, lo, hi);
    if (extra) /* the bf16 copy a 1-row fp32 weight carries (tdm_cuda_weight_prepare) */
        tdm_cu_f32_to_bf16(cu->stream, dev, (size_t)cols, (uint16_t *)((float *)dev + cols));
    TDM_CU_CHECK(cudaGetLastError());
    TDM_CU_CHECK(cudaStreamSynchronize(cu->stream));
    *out = (struct tdm_weight){
        .dtype = dtype, .rows = rows, .cols = cols, .row_bytes = (size_t)cols * esz, .data = dev};
    tdm_status st = tdm_cuda_own(cu, dev, out);
    if (st != TDM_OK) {
        cudaFree(dev);
        return st;
    }
    cu->weight_bytes += n * esz;
    return TDM_OK;
}

static int cmp_f(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

tdm_status tdm_backend_cuda_measure(tdm_backend_t *b, double *copy_bytes_per_s,
                                    double *gemm_flops_per_s)
{
    if (!tdm_backend_is_cuda(b)) return tdm_err_set(TDM_EINVAL, "not a CUDA backend");
    struct tdm_cuda *cu = tdm_cu_of(b);
    enum { REPS = 11 };
    const size_t copy_bytes = (size_t)1 << 31; /* 2 GiB: far above the 60 MB L2 */
    const int G = 8192;
    void *a = NULL, *c = NULL;
    float ms[REPS];
    tdm_status st = TDM_OK;
    cudaEvent_t e0 = NULL, e1 = NULL;
    TDM_CU_CHECK(cudaEventCreate(&e0));
    TDM_CU_CHECK(cudaEventCreate(&e1));
    if (cudaMalloc(&a, copy_bytes) != cudaSuccess || cudaMalloc(&c, copy_bytes) != cudaSuccess) {
        (void)cudaGetLastError();
        st = tdm_err_set(TDM_ENOMEM, "cuda backend: no memory for the roofline measurement");
        goto out;
    }
    tdm_cu_fill_uniform_f32(cu->stream, a, copy_bytes / 4, 1, -1.0f, 1.0f);
    for (int r = -2; r < REPS; r++) {
        TDM_CU_CHECK(cudaEventRecord(e0, cu->stream));
        TDM_CU_CHECK(cudaMemcpyAsync(c, a, copy_bytes, cudaMemcpyDeviceToDevice, cu->stream));
        TDM_CU_CHECK(cudaEventRecord(e1, cu->stream));
        TDM_CU_CHECK(cudaEventSynchronize(e1));
        if (r >= 0) TDM_CU_CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
    }
    qsort(ms, REPS, sizeof ms[0], cmp_f);
    *copy_bytes_per_s = 2.0 * (double)copy_bytes / (ms[REPS / 2] * 1e-3);

    /* GEMM: W [G][G] bf16 times x [G][G] bf16 into d [G][G] fp32, random data */
    {
        uint16_t *w = a, *x = (uint16_t *)((uint8_t *)a + (size_t)G * G * 2);
        float *d = c;
        tdm_cu_fill_uniform_bf16(cu->stream, w, (size_t)G * G * 2, 7, -1.0f, 1.0f);
        for (int r = -3; r < REPS; r++) {
            TDM_CU_CHECK(cudaEventRecord(e0, cu->stream));
            tdm_cu_gemm(cu, w, G, G, x, G, d);
            TDM_CU_CHECK(cudaEventRecord(e1, cu->stream));
            TDM_CU_CHECK(cudaEventSynchronize(e1));
            if (r >= 0) TDM_CU_CHECK(cudaEventElapsedTime(&ms[r], e0, e1));
        }
        qsort(ms, REPS, sizeof ms[0], cmp_f);
        *gemm_flops_per_s = 2.0 * G * (double)G * G / (ms[REPS / 2] * 1e-3);
    }
out:
    if (a) cudaFree(a);
    if (c) cudaFree(c);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return st;
}
