/*
 * Backend-independent entry points of the compute interface (backend.h). Each backend
 * implements struct tdm_backend_i; this file only holds what is common to all of them.
 */
#include "tandem/backend.h"

void tdm_backend_destroy(tdm_backend_t *b)
{
    if (!b) return;
    b->iface->destroy(b);
}
