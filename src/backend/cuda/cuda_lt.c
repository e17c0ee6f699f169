/*
 * cuBLASLt, opened when the first GEMM instance needs it rather than linked.
 *
 * Why: libcublasLt is a 540 MB library whose load (relocations, its constructors, the page
 * faults of mapping it) cost every process that linked it about 0.1 s of CPU and 0.15 s of wall
 * time at start, on a machine with a GPU or without one: `tandem --version`, each CLI call, each
 * CPU server. The CUDA runtime (a small library) stays linked; cuBLASLt is dlopen'ed by its
 * soname (the toolkit's major version, as the build saw it), first through the normal search
 * (LD_LIBRARY_PATH, the binary's RUNPATH, ld.so.cache), then in the toolkit's library folder of
 * the build. The twelve entry points tandem calls are looked up once; their types come from
 * cublasLt.h (__typeof__), so a signature can never drift from the header.
 *
 * Ownership: the table is process-wide and never closed. Threading: tdm_cu_lt() may be called
 * from any thread (pthread_once).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "backend/cuda/cuda_int.h"
#include "tandem/core.h"

#ifndef TDM_CUBLASLT_SONAME
#define TDM_CUBLASLT_SONAME "libcublasLt.so"
#endif

static struct tdm_cu_lt lt_table;
static bool lt_ok;
static char lt_why[512];
static pthread_once_t lt_once = PTHREAD_ONCE_INIT;

static void *lt_open(void)
{
    void *h = dlopen(TDM_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    const char *first = dlerror();
    snprintf(lt_why, sizeof lt_why, "%s", first ? first : "not found");
#ifdef TDM_CUDA_LIB_DIR
    h = dlopen(TDM_CUDA_LIB_DIR "/" TDM_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
#endif
    return h;
}

static void lt_load(void)
{
    void *h = lt_open();
    if (!h) return;
        /* dlsym's object pointer into each function pointer by its bytes (ISO C has no cast
         * between the two; POSIX guarantees the representation) */
#define LT_SYM(field, name)                                                                        \
    do {                                                                                           \
        void *p_ = dlsym(h, name);                                                                 \
        if (!p_) {                                                                                 \
            snprintf(lt_why, sizeof lt_why, "%s has no %s", TDM_CUBLASLT_SONAME, name);            \
            return;                                                                                \
        }                                                                                          \
        memcpy(&lt_table.field, &p_, sizeof p_);                                                   \
    } while (0)
    LT_SYM(create, "cublasLtCreate");
    LT_SYM(destroy, "cublasLtDestroy");
    LT_SYM(desc_create, "cublasLtMatmulDescCreate");
    LT_SYM(desc_destroy, "cublasLtMatmulDescDestroy");
    LT_SYM(desc_set, "cublasLtMatmulDescSetAttribute");
    LT_SYM(layout_create, "cublasLtMatrixLayoutCreate");
    LT_SYM(layout_destroy, "cublasLtMatrixLayoutDestroy");
    LT_SYM(pref_create, "cublasLtMatmulPreferenceCreate");
    LT_SYM(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    LT_SYM(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    LT_SYM(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    LT_SYM(matmul, "cublasLtMatmul");
#undef LT_SYM
    lt_ok = true;
}

const struct tdm_cu_lt *tdm_cu_lt(void)
{
    pthread_once(&lt_once, lt_load);
    if (lt_ok) return &lt_table;
    tdm_err_set(TDM_EUNSUPPORTED, "cuBLASLt could not be loaded: %s", lt_why);
    return NULL;
}
