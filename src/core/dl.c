/*
 * Shared libraries opened on first use rather than linked (tdm_dl_load): cuBLASLt (a 540 MB
 * library whose load cost every process 0.1 s) and libfabric (whose PSM providers' constructors
 * sleep 0.2 s), each looked up once by its module (src/backend/cuda/cuda_lt.c,
 * src/xfer/fabric/libfabric.c say why).
 *
 * Ownership: a library opened here is never closed; its symbols' addresses are the caller's.
 * Threading: the caller calls it once (pthread_once); dlerror's state is per thread.
 */
#include "tandem/core.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

bool tdm_dl_load(const char *soname, const char *dir, const struct tdm_dl_sym *syms, int n,
                 char *why, size_t why_len)
{
    void *h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *first = dlerror(); /* the normal search's reason, the one worth reading */
        snprintf(why, why_len, "%s", first ? first : "not found");
        if (dir && *dir) {
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", dir, soname);
            h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        }
        if (!h) return false;
    }
    for (int i = 0; i < n; i++) {
        const char *ver = syms[i].version;
        void *p = ver && *ver ? dlvsym(h, syms[i].name, ver) : dlsym(h, syms[i].name);
        if (!p) {
            snprintf(why, why_len, "%s has no %s%s%s", soname, syms[i].name,
                     ver && *ver ? " at version " : "", ver && *ver ? ver : "");
            return false;
        }
        /* dlsym's object pointer into a function pointer by its bytes (ISO C has no cast
         * between the two; POSIX guarantees the representation) */
        memcpy(syms[i].dst, &p, sizeof p);
    }
    return true;
}
