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
 * library's default ones (tdm_dl_load). The soname is the one the build saw (TDM_FABRIC_SONAME).
 *
 * Ownership: the table is process-wide and never closed. Threading: any thread (pthread_once).
 */
#include <pthread.h>

#include "xfer/fabric/fabric_int.h"

#ifndef TDM_FABRIC_SONAME
#define TDM_FABRIC_SONAME "libfabric.so.1"
#endif

static struct tdm_fi_api api;
static bool api_ok;
static char api_why[512];
static pthread_once_t api_once = PTHREAD_ONCE_INIT;

static void api_load(void)
{
#ifndef TDM_FI_VERSION_GETINFO
#define TDM_FI_VERSION_GETINFO  ""
#define TDM_FI_VERSION_FREEINFO ""
#define TDM_FI_VERSION_DUPINFO  ""
#define TDM_FI_VERSION_FABRIC   ""
#define TDM_FI_VERSION_STRERROR ""
#endif
    const struct tdm_dl_sym syms[] = {
        {"fi_getinfo", TDM_FI_VERSION_GETINFO, &api.getinfo},
        {"fi_freeinfo", TDM_FI_VERSION_FREEINFO, &api.freeinfo},
        {"fi_dupinfo", TDM_FI_VERSION_DUPINFO, &api.dupinfo},
        {"fi_fabric", TDM_FI_VERSION_FABRIC, &api.fabric},
        {"fi_strerror", TDM_FI_VERSION_STRERROR, &api.strerror},
    };
    if (tdm_dl_load(TDM_FABRIC_SONAME, NULL, syms, (int)TDM_ARRAY_LEN(syms), api_why,
                    sizeof api_why))
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
