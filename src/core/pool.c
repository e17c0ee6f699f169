/*
 * A fixed thread pool for data-parallel kernels.
 *
 * The calling thread is worker 0; n-1 pthreads are the others. A job is published by bumping
 * `generation`; workers spin on it for a short while (decode issues hundreds of jobs per token,
 * and a futex wake per job would cost more than the work), then sleep on a condition variable.
 * The caller runs its own share (ith 0), then every share no worker has claimed yet, then waits
 * for `pending` to reach zero.
 *
 * Shares are claimed: share i of job g runs once, on whichever thread first moves claimed[i]
 * from g - 1 to g (a compare-and-swap; every share of every job is claimed, so g - 1 is what
 * the slot holds while g is open). A worker claims its own share when it sees the job; the
 * caller, done with share 0, claims the rest. So a worker that is asleep, still waking, or
 * preempted by another process when the job comes no longer leaves the caller spinning for it:
 * the caller runs that share itself, which ends no later than the worker would have (a share
 * still unclaimed after the caller's own share means the worker was already a share late), and
 * the late worker finds nothing to do. On dedicated cores a spinning worker claims its share
 * within nanoseconds and nothing changes. A share's arithmetic does not depend on the thread
 * that runs it (ith is the share, not the thread), so results stay bit-identical.
 *
 * Invariant: at most one tdm_pool_run is in progress per pool (the engine's compute thread
 * owns the pool). All atomics are sequentially consistent, which the sleep/wake handshake
 * relies on: a worker increments `sleepers` and then re-reads `generation` under the mutex,
 * the publisher bumps `generation` and then reads `sleepers`.
 */
#include "tandem/core.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How long an idle worker spins before it sleeps: 300 us, or $TANDEM_POOL_SPIN_US (tdm_spin_ns),
 * read once per pool. */
#define SPIN_NS_DEFAULT 300000ull

struct tdm_pool;
struct worker_arg {
    struct tdm_pool *pool;
    int ith;
};

/* claimed[i]: the last job whose share i was claimed; a line each, as workers and the caller
 * swap them concurrently */
struct claim {
    _Atomic uint64_t gen;
    char pad[64 - sizeof(uint64_t)];
};

struct tdm_pool {
    int n_threads;
    struct claim *claimed; /* [n_threads]; [0] unused (the caller's share is never claimed) */
    pthread_t *threads;
    struct worker_arg *args;
    _Atomic uint64_t generation;
    _Atomic int pending;
    _Atomic int sleepers;
    _Atomic bool stop;
    uint64_t spin_ns;
    tdm_pool_fn fn;
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

int tdm_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static bool claim(struct tdm_pool *pool, int ith, uint64_t gen)
{
    uint64_t open = gen - 1;
    return atomic_compare_exchange_strong(&pool->claimed[ith].gen, &open, gen);
}

static void *worker_main(void *p)
{
    struct worker_arg *arg = p;
    struct tdm_pool *pool = arg->pool;
    uint64_t seen = 0;
    for (;;) {
        uint64_t t0 = tdm_now_ns();
        unsigned spins = 0;
        while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop)) {
            cpu_relax();
            if (pool->spin_ns == 0 ||
                ((++spins & 1023) == 0 && tdm_now_ns() - t0 >= pool->spin_ns)) {
                pthread_mutex_lock(&pool->mu);
                atomic_fetch_add(&pool->sleepers, 1);
                while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                    pthread_cond_wait(&pool->cv, &pool->mu);
                atomic_fetch_sub(&pool->sleepers, 1);
                pthread_mutex_unlock(&pool->mu);
            }
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = atomic_load(&pool->generation);
        /* the job's fn and ctx are read only once the share is ours: job `seen` is then still
         * open (its share was not done), so they are its own */
        if (claim(pool, arg->ith, seen)) {
            pool->fn(pool->ctx, arg->ith, pool->n_threads);
            atomic_fetch_sub(&pool->pending, 1);
        }
    }
}

tdm_status tdm_pool_create(int n_threads, tdm_pool_t **out)
{
    if (n_threads <= 0) n_threads = tdm_cpu_count();
    if (n_threads > 1024) return tdm_err_set(TDM_ERANGE, "thread count %d over 1024", n_threads);
    struct tdm_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return tdm_err_set(TDM_ENOMEM, "thread pool: out of memory");
    pool->n_threads = n_threads;
    if (tdm_spin_ns(SPIN_NS_DEFAULT, &pool->spin_ns) != TDM_OK) {
        free(pool);
        return TDM_EINVAL;
    }
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof *pool->threads);
    pool->args = calloc((size_t)n_threads, sizeof *pool->args);
    pool->claimed = tdm_alloc_aligned((size_t)n_threads * sizeof *pool->claimed);
    if (!pool->threads || !pool->args || !pool->claimed) goto out_free;
    memset(pool->claimed, 0, (size_t)n_threads * sizeof *pool->claimed);
    for (int i = 1; i < n_threads; i++) {
        pool->args[i] = (struct worker_arg){pool, i};
        if (pthread_create(&pool->threads[i], NULL, worker_main, &pool->args[i]) != 0) {
            pool->n_threads = i; /* destroy joins the ones that started */
            tdm_pool_destroy(pool);
            return tdm_err_set(TDM_ENOMEM, "thread pool: cannot start thread %d", i);
        }
    }
    *out = pool;
    return TDM_OK;
out_free:
    free(pool->threads);
    free(pool->args);
    tdm_free_aligned(pool->claimed);
    free(pool);
    return tdm_err_set(TDM_ENOMEM, "thread pool: out of memory");
}

void tdm_pool_destroy(tdm_pool_t *pool)
{
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 1; i < pool->n_threads; i++)
        pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
    free(pool->threads);
    free(pool->args);
    tdm_free_aligned(pool->claimed);
    free(pool);
}

int tdm_pool_size(const tdm_pool_t *pool)
{
    return pool ? pool->n_threads : 1;
}

void tdm_pool_run(tdm_pool_t *pool, tdm_pool_fn fn, void *ctx)
{
    if (!pool || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store(&pool->pending, pool->n_threads - 1);
    uint64_t gen = atomic_fetch_add(&pool->generation, 1) + 1;
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    fn(ctx, 0, pool->n_threads);
    for (int i = 1; i < pool->n_threads; i++) /* the shares no worker has started */
        if (claim(pool, i, gen)) {
            fn(ctx, i, pool->n_threads);
            atomic_fetch_sub(&pool->pending, 1);
        }
    unsigned spins = 0;
    while (atomic_load(&pool->pending) > 0) {
        cpu_relax();
        if ((++spins & 4095) == 0) sched_yield();
    }
}

void tdm_split_range(int64_t n, int ith, int nth, int64_t align, int64_t *begin, int64_t *end)
{
    if (align < 1) align = 1;
    int64_t chunks = (n + align - 1) / align;
    int64_t per = chunks / nth, extra = chunks % nth;
    int64_t c0 = ith * per + TDM_MIN((int64_t)ith, extra);
    int64_t c1 = c0 + per + (ith < extra ? 1 : 0);
    *begin = TDM_MIN(c0 * align, n);
    *end = TDM_MIN(c1 * align, n);
}
