/*
 * What the transfer tests share: a counter callback that logs its firings, and a wait for the
 * first that then gives a second one time to show (a counter fires exactly once).
 */
#ifndef TANDEM_TESTS_XFER_FIRE_LOG_H
#define TANDEM_TESTS_XFER_FIRE_LOG_H

#include <stdint.h>
#include <unistd.h>

#include "tandem/xfer.h"

struct fire_log {
    int n;
    tdm_status last;
};
static inline void on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    (void)slot, (void)epoch;
    struct fire_log *l = ctx;
    __atomic_store_n(&l->last, st, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&l->n, 1, __ATOMIC_SEQ_CST);
}
static inline int wait_fired(struct fire_log *l, int ms)
{
    for (int i = 0; i < ms / 2 && !__atomic_load_n(&l->n, __ATOMIC_SEQ_CST); i++)
        usleep(2000);
    usleep(20000); /* a second firing would be a bug: give it time to show */
    return __atomic_load_n(&l->n, __ATOMIC_SEQ_CST);
}

#endif
