/*
 * What the transfer tests share: a counter callback that logs its firings, a wait for the
 * first that then gives a second one time to show (a counter fires exactly once), and the
 * connection of two engines. Include after cmocka.h.
 */
#ifndef TANDEM_TESTS_XFER_FIRE_LOG_H
#define TANDEM_TESTS_XFER_FIRE_LOG_H

#include <stdint.h>
#include <unistd.h>

#include "tandem/xfer.h"

struct fire_log {
    int n;
    tdm_status last;
    uint32_t slot, epoch; /* the last firing's */
};
static inline void on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct fire_log *l = ctx;
    __atomic_store_n(&l->slot, slot, __ATOMIC_SEQ_CST);
    __atomic_store_n(&l->epoch, epoch, __ATOMIC_SEQ_CST);
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

/* a's index for b, once a round trip has happened */
static inline uint32_t connect_engines(tdm_xfer_t *a, tdm_xfer_t *b)
{
    char addr[TDM_XFER_ADDR_MAX];
    assert_int_equal(tdm_xfer_addr(b, addr, sizeof(addr)), TDM_OK);
    uint32_t peer;
    assert_int_equal(tdm_xfer_peer_add(a, addr, &peer), TDM_OK);
    assert_int_equal(tdm_xfer_peer_wait(a, peer, 5000), TDM_OK);
    return peer;
}

#endif
