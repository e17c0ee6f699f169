/*
 * The CPU backend: its vtable, creation, instruction-set dispatch, memory, and the small ops
 * that need no kernel of their own (layer_done, sync).
 *
 * Memory is host memory: buf_alloc is a 64-byte aligned allocation, upload and download are
 * memcpy, and weight_prepare hands back the same pointer (the kernels read GGUF blocks in
 * place). Every op runs to completion before it returns, so sync has nothing to wait for and
 * layer_done can publish its counter at once.
 *
 * ISA dispatch: at create time the instance picks the best kernel table the CPU supports
 * (__builtin_cpu_supports), lowered by $TANDEM_CPU_ISA=portable|avx2|avx512 when set. A
 * request above what the machine supports falls back to the best supported level with a
 * warning. The quantised-activation tiles (qdot*.c) are 256-bit at both vector levels (the
 * avx512 level's 512-bit form measured slower); each level has a VNNI variant (AVX-VNNI for
 * avx2, AVX512-VNNI's EVEX form for avx512), taken where the CPU has the instruction unless
 * $TANDEM_CPU_VNNI=0; it changes no result, only how the integer sums are computed. No kernel
 * uses AVX512_BF16: its dot product takes bf16 activations, so "avx512bf16" is never reported.
 * On the avx512 level with VNNI, a CPU and OS that run the AMX int8 tiles (qdot_amx.c) take them
 * for the quantised products of several activation rows, unless $TANDEM_CPU_AMX=0; like VNNI
 * it changes no result.
 *
 * OpenBLAS: F32 weights times several rows go to cblas_sgemm, split over our own pool by
 * weight rows; OpenBLAS's own threads are therefore turned off (openblas_set_num_threads(1),
 * a process-wide setting) so the two pools do not fight over the cores, and stopped, as soon
 * as the process is loaded (blas_quiet, a constructor, which runs after OpenBLAS's own):
 * OpenBLAS starts one thread per other core when it is loaded, and each spins on sched_yield
 * for about 2^28 cycles before it sleeps, whether BLAS is ever called or not: on two cores a
 * one-token `tandem generate` took 184 ms of CPU, 99 ms once they were stopped (bench/RESULTS.md),
 * and a larger host pays that spin once per other core. blas_thread_shutdown_ is OpenBLAS's own
 * (its fork handler calls it), bound weakly: another BLAS simply lacks it.
 *
 * Threading: one thread drives an instance; ops fan out over the instance's tdm_pool.
 */
#include "backend/cpu/cpu_int.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cblas.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Below this many element-operations an op runs on the calling thread alone. */
#define SMALL_WORK 16384

/* Tile shapes: decode streams 4 weight rows per tile (four independent FMA chains); prefill
 * uses 3 weight rows x 4 activation rows (12 accumulators of the 16 AVX2 registers), or 2 x 4
 * for 4-bit weights, whose dequantisation needs more registers (measured on Zen 3), 1 for the
 * K-quants (their fp32 tiles are the portable ones: see matmul.c). The
 * AVX-512 level reuses the AVX2 attention step: attention is bound by reading K and V, not by
 * vector width. */
#define PREFILL_R_VEC                                                                              \
    {                                                                                              \
        [TDM_CPU_W_F32] = 3, [TDM_CPU_W_BF16] = 3, [TDM_CPU_W_Q8_0] = 3, [TDM_CPU_W_Q4_0] = 2,     \
        [TDM_CPU_W_Q4_1] = 2, [TDM_CPU_W_Q4_K] = 1, [TDM_CPU_W_Q6_K] = 1                           \
    }
/* The kernels of one level; the quantised tiles (qdot*.c) given apart, since each vector level
 * has a VNNI variant. */
#define LEVEL_PORTABLE(QT)                                                                         \
    {                                                                                              \
        .isa = TDM_CPU_ISA_PORTABLE, .name = "portable", .tile = tdm_cpu_tiles_portable,           \
        .decode_r = 2, .prefill_r = {1, 1, 1, 1, 1, 1, 1}, .prefill_c = 4,                         \
        .attn_step = tdm_cpu_attn_step_portable, .kv_widen = tdm_cpu_kv_widen_portable,            \
        .kv_narrow = tdm_cpu_kv_narrow_portable, .qtile = QT,                                      \
        .quantise = tdm_cpu_quantise_portable, .vnni = false                                       \
    }
#define LEVEL_VEC(ISA, NAME, TILES, QT, VNNI)                                                      \
    {                                                                                              \
        .isa = ISA, .name = NAME, .tile = TILES, .decode_r = 4, .prefill_r = PREFILL_R_VEC,        \
        .prefill_c = 4, .attn_step = tdm_cpu_attn_step_avx2, .kv_widen = tdm_cpu_kv_widen_avx2,    \
        .kv_narrow = tdm_cpu_kv_narrow_avx2, .qtile = QT, .quantise = tdm_cpu_quantise_avx2,       \
        .vnni = VNNI                                                                               \
    }
/* [level][vnni]; the portable level has no VNNI variant (both entries are the same) */
static const struct tdm_cpu_kernels KERNELS[TDM_CPU_ISA_COUNT][2] = {
    [TDM_CPU_ISA_PORTABLE] = {LEVEL_PORTABLE(tdm_cpu_qtiles_portable),
                              LEVEL_PORTABLE(tdm_cpu_qtiles_portable)},
    [TDM_CPU_ISA_AVX2] = {LEVEL_VEC(TDM_CPU_ISA_AVX2, "avx2", tdm_cpu_tiles_avx2,
                                    tdm_cpu_qtiles_avx2, false),
                          LEVEL_VEC(TDM_CPU_ISA_AVX2, "avx2+vnni", tdm_cpu_tiles_avx2,
                                    tdm_cpu_qtiles_avx2_vnni, true)},
    [TDM_CPU_ISA_AVX512] = {LEVEL_VEC(TDM_CPU_ISA_AVX512, "avx512", tdm_cpu_tiles_avx512,
                                      tdm_cpu_qtiles_avx2, false),
                            LEVEL_VEC(TDM_CPU_ISA_AVX512, "avx512+vnni", tdm_cpu_tiles_avx512,
                                      tdm_cpu_qtiles_avx512_vnni, true)},
};

enum tdm_cpu_isa tdm_cpu_isa_detect(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    /* clang's __builtin_cpu_supports does not know "f16c": read CPUID leaf 1, ECX bit 29. */
    unsigned eax, ebx, ecx = 0, edx;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512dq");
    if (avx512) return TDM_CPU_ISA_AVX512;
    if (avx2) return TDM_CPU_ISA_AVX2;
#endif
    return TDM_CPU_ISA_PORTABLE;
}

bool tdm_cpu_isa_vnni(enum tdm_cpu_isa isa)
{
#if defined(__x86_64__)
    if (isa > tdm_cpu_isa_detect()) return false;
    /* CPUID leaf 7: AVX-VNNI is subleaf 1's EAX bit 4, AVX512-VNNI subleaf 0's ECX bit 11 (read
     * directly: clang 14's __builtin_cpu_supports does not know "avxvnni") */
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (isa == TDM_CPU_ISA_AVX2) return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
    if (isa == TDM_CPU_ISA_AVX512) return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 11 & 1);
#endif
    return false;
}

const char *tdm_cpu_isa_name(enum tdm_cpu_isa isa)
{
    switch (isa) {
    case TDM_CPU_ISA_PORTABLE:
        return "portable";
    case TDM_CPU_ISA_AVX2:
        return "avx2";
    case TDM_CPU_ISA_AVX512:
        return "avx512";
    default:
        return "unknown";
    }
}

/* The detected level lowered by $TANDEM_CPU_ISA. */
static enum tdm_cpu_isa isa_from_env(bool warn)
{
    const enum tdm_cpu_isa best = tdm_cpu_isa_detect();
    const char *env = getenv("TANDEM_CPU_ISA");
    if (!env || !*env) return best;
    for (int i = 0; i < TDM_CPU_ISA_COUNT; i++) {
        if (strcasecmp(env, tdm_cpu_isa_name((enum tdm_cpu_isa)i)) != 0) continue;
        if (i > (int)best) {
            if (warn)
                TDM_WARN("TANDEM_CPU_ISA=%s is not supported by this CPU; using %s", env,
                         tdm_cpu_isa_name(best));
            return best;
        }
        return (enum tdm_cpu_isa)i;
    }
    if (warn)
        TDM_WARN("TANDEM_CPU_ISA=%s is not one of portable, avx2, avx512; using %s", env,
                 tdm_cpu_isa_name(best));
    return best;
}

const char *tdm_backend_cpu_isa(void)
{
    return tdm_cpu_isa_name(isa_from_env(false));
}

int tdm_cpu_wtype_of(enum tdm_dtype t)
{
    switch (t) {
    case TDM_DTYPE_F32:
        return TDM_CPU_W_F32;
    case TDM_DTYPE_BF16:
        return TDM_CPU_W_BF16;
    case TDM_DTYPE_Q8_0:
        return TDM_CPU_W_Q8_0;
    case TDM_DTYPE_Q4_0:
        return TDM_CPU_W_Q4_0;
    case TDM_DTYPE_Q4_1:
        return TDM_CPU_W_Q4_1;
    case TDM_DTYPE_Q4_K:
        return TDM_CPU_W_Q4_K;
    case TDM_DTYPE_Q6_K:
        return TDM_CPU_W_Q6_K;
    default:
        return -1;
    }
}

void tdm_cpu_run(struct tdm_cpu *cpu, int64_t work, tdm_pool_fn fn, void *ctx)
{
    if (work < SMALL_WORK || cpu->n_threads == 1)
        fn(ctx, 0, 1);
    else
        tdm_pool_run(cpu->pool, fn, ctx);
}

/* ---- memory ---- */

static void *cpu_buf_alloc(tdm_backend_t *b, size_t bytes)
{
    return tdm_alloc_aligned(bytes);
}

static void cpu_buf_free(tdm_backend_t *b, void *p)
{
    tdm_free_aligned(p);
}

static void cpu_copy(tdm_backend_t *b, void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
}

static tdm_status cpu_weight_prepare(tdm_backend_t *b, const struct tdm_weight *host,
                                     struct tdm_weight *out)
{
    if (!host->data) { /* an absent optional weight (a bias the model does not have) */
        *out = *host;
        return TDM_OK;
    }
    if (tdm_cpu_wtype_of(host->dtype) < 0)
        return tdm_err_set(TDM_EUNSUPPORTED, "cpu backend: no kernels for weight type %s",
                           tdm_dtype_name(host->dtype));
    if (host->rows < 1 || host->cols < 1)
        return tdm_err_set(TDM_EINVAL, "cpu backend: empty weight (%lld x %lld)",
                           (long long)host->rows, (long long)host->cols);
    if (host->cols > INT32_MAX || host->rows > INT32_MAX)
        return tdm_err_set(TDM_ERANGE, "cpu backend: weight %lld x %lld too large",
                           (long long)host->rows, (long long)host->cols);
    const size_t rb = tdm_dtype_row_bytes(host->dtype, host->cols);
    if (rb == 0 || host->row_bytes != rb)
        return tdm_err_set(TDM_EINVAL, "cpu backend: %s weight with %lld columns has row_bytes %zu",
                           tdm_dtype_name(host->dtype), (long long)host->cols, host->row_bytes);
    *out = *host;
    return TDM_OK;
}

/* ---- ordering ops ---- */

static void cpu_layer_done(tdm_backend_t *b, int layer, _Atomic int32_t *counter)
{
    /* Every op has joined its pool workers before returning (their last act is a seq_cst
     * decrement that the caller observed), so a release store orders all of their writes
     * before the counter for any acquiring reader. */
    atomic_store_explicit(counter, layer + 1, memory_order_release);
}

static void cpu_sync(tdm_backend_t *b) {}

static void cpu_destroy(tdm_backend_t *b)
{
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    tdm_pool_destroy(cpu->pool);
    tdm_free_aligned(cpu->attn_scratch);
    tdm_free_aligned(cpu->xq);
    tdm_free_aligned(cpu->xt);
    free(cpu);
}

static const struct tdm_backend_i CPU_IFACE = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .weight_prepare = cpu_weight_prepare,
    .embed = tdm_cpu_embed,
    .rmsnorm = tdm_cpu_rmsnorm,
    .add_rmsnorm = tdm_cpu_add_rmsnorm,
    .matmul = tdm_cpu_matmul,
    .matmul_multi = tdm_cpu_matmul_multi,
    .matmul_swiglu = tdm_cpu_matmul_swiglu,
    .head_rmsnorm = tdm_cpu_head_rmsnorm,
    .rope_kv_append = tdm_cpu_rope_kv_append,
    .attention = tdm_cpu_attention,
    .silu_mul = tdm_cpu_silu_mul,
    .add = tdm_cpu_add,
    .gather_rows = tdm_cpu_gather_rows,
    .zero = tdm_cpu_zero,
    .rows_scale_add = tdm_cpu_rows_scale_add,
    .head_matmul = tdm_cpu_head_matmul,
    .scatter_cols = tdm_cpu_scatter_cols,
    .kv_copy = tdm_cpu_kv_copy,
    .layer_done = cpu_layer_done,
    .sync = cpu_sync,
};

/* OpenBLAS's, not in its header: joins its server threads (it starts them again where a call
 * needs more than one thread, which openblas_set_num_threads(1) rules out). */
extern void blas_thread_shutdown_(void) __attribute__((weak));

__attribute__((constructor)) static void blas_quiet(void)
{
    openblas_set_num_threads(1);
    if (blas_thread_shutdown_) blas_thread_shutdown_();
}

tdm_status tdm_backend_cpu_create_variant(const struct tdm_backend_cpu_opts *opts,
                                          enum tdm_cpu_isa isa, bool vnni, tdm_backend_t **out)
{
    if ((int)isa < 0 || isa >= TDM_CPU_ISA_COUNT)
        return tdm_err_set(TDM_EINVAL, "cpu backend: bad ISA level %d", (int)isa);
    if (isa > tdm_cpu_isa_detect())
        return tdm_err_set(TDM_EUNSUPPORTED, "cpu backend: this CPU lacks %s",
                           tdm_cpu_isa_name(isa));
    if (vnni && !tdm_cpu_isa_vnni(isa))
        return tdm_err_set(TDM_EUNSUPPORTED, "cpu backend: this CPU lacks VNNI for %s",
                           tdm_cpu_isa_name(isa));
    struct tdm_cpu *cpu = calloc(1, sizeof *cpu);
    if (!cpu) return tdm_err_set(TDM_ENOMEM, "cpu backend: out of memory");
    tdm_status st = tdm_pool_create(opts ? opts->n_threads : 0, &cpu->pool);
    if (st != TDM_OK) goto out_free_cpu;
    cpu->n_threads = tdm_pool_size(cpu->pool);
    cpu->batch_invariant = opts ? opts->batch_invariant : false;
    cpu->quant_activations = opts ? opts->quant_activations : false;
    cpu->k = &KERNELS[isa][vnni];
    cpu->base.iface = &CPU_IFACE;
    cpu->base.impl = cpu;
    *out = &cpu->base;
    return TDM_OK;
out_free_cpu:
    free(cpu);
    return st;
}

tdm_status tdm_cpu_amx_set(tdm_backend_t *b, bool on)
{
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    if (on && !(cpu->k->isa == TDM_CPU_ISA_AVX512 && tdm_cpu_amx_available()))
        return tdm_err_set(TDM_EUNSUPPORTED, "cpu backend: no AMX int8 tiles on %s here",
                           cpu->k->name);
    cpu->amx = on;
    return TDM_OK;
}

tdm_status tdm_backend_cpu_create_isa(const struct tdm_backend_cpu_opts *opts, enum tdm_cpu_isa isa,
                                      tdm_backend_t **out)
{
    return tdm_backend_cpu_create_variant(opts, isa, tdm_cpu_isa_vnni(isa), out);
}

static bool env_off(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "0") == 0;
}

/* The AMX tiles run beside the AVX512-VNNI kernels of isa, where there are tiles. */
static bool amx_for(enum tdm_cpu_isa isa, bool vnni)
{
    return vnni && isa == TDM_CPU_ISA_AVX512 && tdm_cpu_amx_available() &&
           !env_off("TANDEM_CPU_AMX");
}

bool tdm_backend_cpu_amx(void)
{
    const enum tdm_cpu_isa isa = isa_from_env(false);
    return amx_for(isa, tdm_cpu_isa_vnni(isa) && !env_off("TANDEM_CPU_VNNI"));
}

tdm_status tdm_backend_cpu_create(const struct tdm_backend_cpu_opts *opts, tdm_backend_t **out)
{
    const enum tdm_cpu_isa isa = isa_from_env(true);
    const bool vnni = tdm_cpu_isa_vnni(isa) && !env_off("TANDEM_CPU_VNNI");
    tdm_status st = tdm_backend_cpu_create_variant(opts, isa, vnni, out);
    if (st != TDM_OK) return st;
    tdm_cpu_of(*out)->amx = amx_for(isa, vnni);
    TDM_DEBUG("cpu backend: %s%s kernels, %d threads, %s activations", tdm_cpu_of(*out)->k->name,
              tdm_cpu_of(*out)->amx ? "+amx" : "", tdm_cpu_of(*out)->n_threads,
              tdm_cpu_of(*out)->quant_activations ? "int8" : "fp32");
    return st;
}
