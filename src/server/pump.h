/*
 * The router's pump: one thread that waits, with poll(), on the backend sockets of client
 * connections that are suspended because their backend has sent nothing new yet, and resumes
 * each connection when its backend socket is readable, its client hangs up, its deadline
 * passes, or the pump is closing. With it the router runs on the front's event loop
 * (front.h, threads > 0): a relayed stream costs two sockets and memory, not a thread.
 *
 * A park is one connection's place in the pump. Its states:
 *
 *   RUNNING --(nothing from the backend: tdm_park_wait)--> SUSPENDED
 *      ^                                                       |
 *      +--(pump: backend readable, client hung up, deadline, --+
 *          or closing: resumes the connection)
 *
 *   from       to         who                      when
 *   RUNNING    SUSPENDED  the handler or reader    tdm_park_wait, unless gone
 *   SUSPENDED  RUNNING    the pump thread          fd readable, POLLRDHUP on the client,
 *                                                  deadline_ns passed, or tdm_pump_close
 *   any        gone       the pump thread          the client hung up, or the pump closed
 *
 * Ownership: the caller owns a park (tdm_park_new .. tdm_park_free); the pump holds a
 * reference while it polls it, so a park freed meanwhile lives until the poll returns. A
 * connection is never freed while suspended (libmicrohttpd keeps it), and every parked
 * connection is resumed by tdm_pump_close before the daemon stops.
 *
 * Locks: the pump's list lock, then a park's (pump->mu -> k->mu). The caller never holds a
 * park's lock.
 */
#ifndef TANDEM_SERVER_PUMP_H
#define TANDEM_SERVER_PUMP_H

#include <microhttpd.h>
#include <stdbool.h>
#include <stdint.h>

#include "tandem/core.h"

struct tdm_pump;
struct tdm_park;

tdm_status tdm_pump_start(struct tdm_pump **out);
/* Resumes every parked connection and marks it gone; later waits refuse. */
void tdm_pump_close(struct tdm_pump *p);
/* Joins the thread and frees (after tdm_pump_close and every tdm_park_free). NULL: no-op. */
void tdm_pump_stop(struct tdm_pump *p);

/* A park for connection c (NULL on allocation failure). */
struct tdm_park *tdm_park_new(struct tdm_pump *p, struct MHD_Connection *c);
void tdm_park_free(struct tdm_park *k); /* NULL is a no-op */
/* Suspends the connection until fd is readable, its client goes, deadline_ns (tdm_now_ns's
 * clock) passes, or the pump closes: true when suspended (return, and be called again once
 * resumed); false when the client is gone or the pump closed (look at tdm_park_gone). */
bool tdm_park_wait(struct tdm_park *k, int fd, uint64_t deadline_ns);
/* The client hung up while parked, or the pump closed. */
bool tdm_park_gone(const struct tdm_park *k);

#endif /* TANDEM_SERVER_PUMP_H */
