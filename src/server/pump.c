/*
 * The router's pump (pump.h): a list of parks, and a thread that polls the suspended ones'
 * backend sockets and client sockets (POLLRDHUP) together with an eventfd that a new wait
 * kicks, waking at least every 100 ms for deadlines.
 */
#include "server/pump.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "server/front.h"

#define TICK_MS 100

struct tdm_park {
    struct tdm_pump *pump;
    struct MHD_Connection *conn;
    int client_fd;
    pthread_mutex_t mu; /* suspended, fd, deadline_ns */
    bool suspended;
    int fd;
    uint64_t deadline_ns;
    atomic_bool gone;
    atomic_int refs;
    struct tdm_park *prev, *next; /* the pump's list, under pump->mu */
};

struct tdm_pump {
    pthread_mutex_t mu; /* the list, closing, stop */
    struct tdm_park *head;
    bool closing, stop;
    int kick; /* eventfd: a park was suspended, or stop */
    pthread_t thread;
    /* the thread's scratch */
    struct pollfd *pfd;
    struct tdm_park **pk;
    size_t cap;
};

static void unref(struct tdm_park *k)
{
    if (atomic_fetch_sub(&k->refs, 1) != 1) return;
    pthread_mutex_destroy(&k->mu);
    free(k);
}

static void kick(struct tdm_pump *p)
{
    uint64_t one = 1;
    ssize_t n = write(p->kick, &one, sizeof one);
    (void)n; /* a full counter already wakes the thread */
}

/* Resumes k if it is suspended (under its lock). */
static void wake(struct tdm_park *k)
{
    pthread_mutex_lock(&k->mu);
    if (k->suspended) {
        k->suspended = false;
        k->fd = -1;
        MHD_resume_connection(k->conn);
    }
    pthread_mutex_unlock(&k->mu);
}

/* The parks to poll now: suspended ones, each referenced; *wait_ms until the nearest
 * deadline (at most TICK_MS). Returns how many, or -1 when stopping. */
static int snapshot(struct tdm_pump *p, int *wait_ms)
{
    pthread_mutex_lock(&p->mu);
    if (p->stop) {
        pthread_mutex_unlock(&p->mu);
        return -1;
    }
    int n = 0;
    uint64_t now = tdm_now_ns(), next = now + (uint64_t)TICK_MS * 1000000ull;
    for (struct tdm_park *k = p->head; k; k = k->next) {
        pthread_mutex_lock(&k->mu);
        if (k->suspended) {
            if ((size_t)n + 1 >= p->cap) {
                size_t cap = p->cap ? 2 * p->cap : 256;
                struct pollfd *pf = realloc(p->pfd, (2 * cap + 1) * sizeof *pf);
                if (pf) p->pfd = pf;
                struct tdm_park **pk = pf ? realloc(p->pk, cap * sizeof *pk) : NULL;
                if (pk) p->pk = pk;
                if (!pf || !pk) { /* out of memory: poll what fits; the rest next time */
                    pthread_mutex_unlock(&k->mu);
                    break;
                }
                p->cap = cap;
            }
            atomic_fetch_add(&k->refs, 1);
            p->pk[n] = k;
            p->pfd[2 * n] = (struct pollfd){.fd = k->fd, .events = POLLIN};
            p->pfd[2 * n + 1] = (struct pollfd){.fd = k->client_fd, .events = POLLRDHUP};
            if (k->deadline_ns < next) next = k->deadline_ns;
            n++;
        }
        pthread_mutex_unlock(&k->mu);
    }
    pthread_mutex_unlock(&p->mu);
    *wait_ms = next > now ? (int)((next - now + 999999) / 1000000) : 0;
    return n;
}

static void *pump_main(void *arg)
{
    struct tdm_pump *p = arg;
    for (;;) {
        int wait_ms = TICK_MS;
        int n = snapshot(p, &wait_ms);
        if (n < 0) break;
        struct pollfd kf = {.fd = p->kick, .events = POLLIN};
        struct pollfd *pf = n ? p->pfd : &kf;
        if (n) pf[2 * n] = kf;
        int rc = poll(pf, (nfds_t)(n ? 2 * n + 1 : 1), wait_ms);
        if (rc < 0 && errno != EINTR) usleep(1000);
        if (rc > 0 && (pf[n ? 2 * n : 0].revents & POLLIN)) {
            uint64_t v;
            ssize_t r = read(p->kick, &v, sizeof v);
            (void)r;
        }
        uint64_t now = tdm_now_ns();
        for (int i = 0; i < n; i++) {
            struct tdm_park *k = p->pk[i];
            short be = pf[2 * i].revents, cl = pf[2 * i + 1].revents;
            bool hup = (cl & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
            if (hup) atomic_store(&k->gone, true);
            if (be || hup || now >= k->deadline_ns) wake(k);
            unref(k);
        }
    }
    return NULL;
}

tdm_status tdm_pump_start(struct tdm_pump **out)
{
    struct tdm_pump *p = calloc(1, sizeof *p);
    if (!p) return tdm_err_set(TDM_ENOMEM, "router: out of memory");
    p->kick = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->kick < 0) {
        free(p);
        return tdm_err_set(TDM_EIO, "router: eventfd: %s", strerror(errno));
    }
    pthread_mutex_init(&p->mu, NULL);
    if (pthread_create(&p->thread, NULL, pump_main, p)) {
        close(p->kick);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return tdm_err_set(TDM_EIO, "router: cannot start the relay thread");
    }
    *out = p;
    return TDM_OK;
}

void tdm_pump_close(struct tdm_pump *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->closing = true;
    for (struct tdm_park *k = p->head; k; k = k->next) {
        atomic_store(&k->gone, true);
        wake(k);
    }
    pthread_mutex_unlock(&p->mu);
}

void tdm_pump_stop(struct tdm_pump *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_mutex_unlock(&p->mu);
    kick(p);
    pthread_join(p->thread, NULL);
    close(p->kick);
    pthread_mutex_destroy(&p->mu);
    free(p->pfd);
    free(p->pk);
    free(p);
}

struct tdm_park *tdm_park_new(struct tdm_pump *p, struct MHD_Connection *c)
{
    struct tdm_park *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    *k = (struct tdm_park){.pump = p, .conn = c, .client_fd = tdm_front_client_fd(c), .fd = -1};
    pthread_mutex_init(&k->mu, NULL);
    atomic_init(&k->refs, 1);
    pthread_mutex_lock(&p->mu);
    atomic_store(&k->gone, p->closing);
    k->next = p->head;
    if (p->head) p->head->prev = k;
    p->head = k;
    pthread_mutex_unlock(&p->mu);
    return k;
}

void tdm_park_free(struct tdm_park *k)
{
    if (!k) return;
    struct tdm_pump *p = k->pump;
    pthread_mutex_lock(&p->mu);
    if (k->prev)
        k->prev->next = k->next;
    else
        p->head = k->next;
    if (k->next) k->next->prev = k->prev;
    pthread_mutex_unlock(&p->mu);
    unref(k);
}

bool tdm_park_wait(struct tdm_park *k, int fd, uint64_t deadline_ns)
{
    pthread_mutex_lock(&k->mu);
    bool sus = !atomic_load(&k->gone) && fd >= 0;
    if (sus) {
        k->fd = fd;
        k->deadline_ns = deadline_ns;
        k->suspended = true;
        MHD_suspend_connection(k->conn);
    }
    pthread_mutex_unlock(&k->mu);
    if (sus) kick(k->pump);
    return sus;
}

bool tdm_park_gone(const struct tdm_park *k)
{
    return atomic_load(&k->gone);
}
