/*
 * libfabric, opened when the first transfer engine is created rather than linked.
 *
 * Why: Debian's libfabric links the PSM providers' libraries, and libinfinipath's constructor
 * calibrates its cycle counter with some 700 sleeps of 125 us: 0.2 s of wall time at the start
 * of every process that loads it, whether it moves a byte or not (`tandem --version` took 0.21 s
 * of which 0.2 there; every CLI call and every colocated server paid it). A process now loads
 * it with its first engine (a prefill or decode node, the xfer tools), and others never.
 *
 * Only five libfabric functions are exported ones; everything else (fi_domain, fi_cq_read,
 * fi_writemsg, ...) is an inline of the rdma/fi_ headers calling through the objects' operation
 * tables, which need no lookup. Each of the five is looked up at the symbol version that the linker
 * would have bound at build time (the library's default version then, found by CMake in the
 * library tandem was built against: TDM_FI_VERSION_*), since the structs of the header we were
 * compiled with are that version's; a build that could not find the versions takes the
 * library's default ones. The soname is the one the build saw (TDM_FABRIC_SONAME).
 *
 * Ownership: the table is process-wide and never closed. Threading: any thread (pthread_once).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "xfer/fabric/fabric_int.h"

#ifndef TDM_FABRIC_SONAME
#define TDM_FABRIC_SONAME "libfabric.so.1"
#endif

static struct tdm_fi_api api;
static bool api_ok;
static char api_why[512];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

/* name at version ver (NULL or "": the default version) */
static void *sym(void *h, const char *name, const char *ver)
{
    if (ver && *ver) return dlvsym(h, name, ver);
    return dlsym(h, name);
}

static void api_load(void)
{
    void *h = dlopen(TDM_FABRIC_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(api_why, sizeof api_why, "%s", e ? e : "not found");
        return;
    }
#define FI_SYM(field, name, ver)                                                                   \
    do {                                                                                           \
        void *p_ = sym(h, name, ver);                                                              \
        if (!p_) {                                                                                 \
            snprintf(api_why, sizeof api_why, "%s has no %s%s%s", TDM_FABRIC_SONAME, name,         \
                     *(ver) ? " at version " : "", ver);                                           \
            return;                                                                                \
        }                                                                                          \
        memcpy(&api.field, &p_, sizeof p_); /* POSIX: an object pointer's bytes */                 \
    } while (0)
#ifndef TDM_FI_VERSION_GETINFO
#define TDM_FI_VERSION_GETINFO  ""
#define TDM_FI_VERSION_FREEINFO ""
#define TDM_FI_VERSION_DUPINFO  ""
#define TDM_FI_VERSION_FABRIC   ""
#define TDM_FI_VERSION_STRERROR ""
#endif
    FI_SYM(getinfo, "fi_getinfo", TDM_FI_VERSION_GETINFO);
    FI_SYM(freeinfo, "fi_freeinfo", TDM_FI_VERSION_FREEINFO);
    FI_SYM(dupinfo, "fi_dupinfo", TDM_FI_VERSION_DUPINFO);
    FI_SYM(fabric, "fi_fabric", TDM_FI_VERSION_FABRIC);
    FI_SYM(strerror, "fi_strerror", TDM_FI_VERSION_STRERROR);
#undef FI_SYM
    __atomic_store_n(&api_ok, true, __ATOMIC_RELEASE);
}

const struct tdm_fi_api *tdm_fi_api(void)
{
    pthread_once(&api_once, api_load);
    if (api_ok) return &api;
    tdm_err_set(TDM_EUNSUPPORTED, "xfer: libfabric could not be loaded: %s", api_why);
    return NULL;
}

const char *tdm_fi_strerror(int rc)
{
    if (!__atomic_load_n(&api_ok, __ATOMIC_ACQUIRE)) return "libfabric not loaded";
    return api.strerror(rc < 0 ? -rc : rc);
}
