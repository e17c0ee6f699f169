/*
 * Private parts of the disaggregation module shared by decode.c and prefill.c.
 */
#ifndef TANDEM_DISAGG_INT_H
#define TANDEM_DISAGG_INT_H

#include <pthread.h>

#include "tandem/disagg.h"
#include "tandem/kv.h"
#include "tandem/sched.h"

struct tdm_disagg_decode;

/* What a control-message send's completion needs to undo. */
struct send_ctx {
    struct tdm_disagg_decode *d;
    uint32_t slot, epoch;
};

#endif
