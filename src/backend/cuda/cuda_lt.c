/*
 * cuBLASLt, opened when the first GEMM instance needs it rather than linked.
 *
 * Why: libcublasLt is a 540 MB library whose load (relocations, its constructors, the page
 * faults of mapping it) cost every process that linked it about 0.1 s of CPU and 0.15 s of wall
 * time at start, on a machine with a GPU or without one: `tandem --version`, each CLI call, each
 * CPU server. The CUDA runtime (a small library) stays linked; cuBLASLt is dlopen'ed by its
 * soname (the toolkit's major version, as the build saw it), first through the normal search
 * (LD_LIBRARY_PATH, the binary's RUNPATH, ld.so.cache), then in the toolkit's library folder of
 * the build (tdm_dl_load). The twelve entry points tandem calls are looked up once; their types
 * come from cublasLt.h (__typeof__), so a signature can never drift from the header.
 *
 * Ownership: the table is process-wide and never closed. Threading: tdm_cu_lt() may be called
 * from any thread (pthread_once).
 */
#include <pthread.h>

#include "backend/cuda/cuda_int.h"
#include "tandem/core.h"

#ifndef TDM_CUBLASLT_SONAME
#define TDM_CUBLASLT_SONAME "libcublasLt.so"
#endif

static struct tdm_cu_lt lt_table;
static bool lt_ok;
static char lt_why[512];
static pthread_once_t lt_once = PTHREAD_ONCE_INIT;

bool tdm_cu_dl_load(const char *soname, const struct tdm_dl_sym *syms, int n, char *why,
                    size_t why_len)
{
#ifdef TDM_CUDA_LIB_DIR
    const char *dir = TDM_CUDA_LIB_DIR;
#else
    const char *dir = NULL;
#endif
    return tdm_dl_load(soname, dir, syms, n, why, why_len);
}

static void lt_load(void)
{
    const struct tdm_dl_sym syms[] = {
        {"cublasLtCreate", NULL, &lt_table.create},
        {"cublasLtDestroy", NULL, &lt_table.destroy},
        {"cublasLtMatmulDescCreate", NULL, &lt_table.desc_create},
        {"cublasLtMatmulDescDestroy", NULL, &lt_table.desc_destroy},
        {"cublasLtMatmulDescSetAttribute", NULL, &lt_table.desc_set},
        {"cublasLtMatrixLayoutCreate", NULL, &lt_table.layout_create},
        {"cublasLtMatrixLayoutDestroy", NULL, &lt_table.layout_destroy},
        {"cublasLtMatmulPreferenceCreate", NULL, &lt_table.pref_create},
        {"cublasLtMatmulPreferenceDestroy", NULL, &lt_table.pref_destroy},
        {"cublasLtMatmulPreferenceSetAttribute", NULL, &lt_table.pref_set},
        {"cublasLtMatmulAlgoGetHeuristic", NULL, &lt_table.heuristic},
        {"cublasLtMatmul", NULL, &lt_table.matmul},
    };
    lt_ok =
        tdm_cu_dl_load(TDM_CUBLASLT_SONAME, syms, (int)TDM_ARRAY_LEN(syms), lt_why, sizeof lt_why);
}

const struct tdm_cu_lt *tdm_cu_lt(void)
{
    pthread_once(&lt_once, lt_load);
    if (lt_ok) return &lt_table;
    tdm_err_set(TDM_EUNSUPPORTED, "cuBLASLt could not be loaded: %s", lt_why);
    return NULL;
}
