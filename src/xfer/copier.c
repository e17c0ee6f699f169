/*
 * Copiers (include/tandem/xfer.h, "host staging"): what moves pages between memory the fabric
 * cannot register and the pinned host memory it can.
 *
 *   host: memcpy, page by page, on a thread of its own (host memory standing in for device
 *         memory, so CI runs every staging path without a GPU);
 *   cuda: the CUDA writer of cuda_ipc.cu (one gather/scatter kernel per copy, 16-byte accesses,
 *         on its own stream) between device memory and cudaHostAlloc'd memory, which kernels
 *         reach through unified addressing; events polled by the copier's thread.
 *
 * Ownership and threading. A copier owns its queue, its thread and (cuda) its writer. Copies
 * are accepted on any thread (copy_pages copies the page lists) and never refused for load:
 * the callers bound what they submit (the staging ring, the landing pages). The thread starts
 * them in order and completes them in order; done runs on it with no lock held. drain and
 * destroy wait for every accepted copy, running its done.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "xfer/xfer_int.h"

enum { COPY_POLL_US = 10, WRITER_SLOTS = 64 };

struct copy_job {
    struct copy_job *next;
    struct copier *c;
    const uint8_t *src;
    uint8_t *dst;
    size_t src_bytes, dst_bytes;
    struct tdm_xfer_pages pages; /* its arrays point at ids below */
    tdm_xfer_done_fn done;
    void *ctx;
    tdm_status st;
    uint32_t ids[]; /* src pages, then dst pages */
};

struct copier {
    bool cuda;
    tdm_xfer_cuda_t *w;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool stopping;
    struct copy_job *q_head, *q_tail;       /* accepted, not started */
    struct copy_job *done_head, *done_tail; /* finished, done not yet run (cuda) */
    int in_writer;                          /* cuda: submitted, event not yet seen */
    int pending;                            /* accepted, done not yet run */
    pthread_cond_t idle;                    /* pending reached 0 */
};

static void push(struct copy_job **head, struct copy_job **tail, struct copy_job *j)
{
    j->next = NULL;
    if (*tail)
        (*tail)->next = j;
    else
        *head = j;
    *tail = j;
}

static void memcpy_pages(struct copy_job *j)
{
    const struct tdm_xfer_pages *p = &j->pages;
    for (uint32_t i = 0; i < p->n_pages; i++)
        memcpy(j->dst + p->dst_offset + (uint64_t)p->dst_pages[i] * p->dst_stride,
               j->src + p->src_offset + (uint64_t)p->src_pages[i] * p->src_stride, p->page_bytes);
    j->st = TDM_OK;
}

/* The writer's done (from tdm_xfer_cuda_poll, c->mu held). */
static void on_kernel(void *ctx, tdm_status st)
{
    struct copy_job *j = ctx;
    j->st = st;
    j->c->in_writer--;
    push(&j->c->done_head, &j->c->done_tail, j);
}

/* No lock held: the callbacks, then the count (c->mu taken). */
static void run_done(struct copier *c, struct copy_job *list)
{
    int n = 0;
    while (list) {
        struct copy_job *next = list->next;
        if (list->done) list->done(list->ctx, list->st);
        free(list);
        list = next;
        n++;
    }
    pthread_mutex_lock(&c->mu);
    c->pending -= n;
    if (!c->pending) pthread_cond_broadcast(&c->idle);
    pthread_mutex_unlock(&c->mu);
}

static void *copier_main(void *arg)
{
    struct copier *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (!c->cuda) {
            struct copy_job *j = c->q_head;
            if (j) {
                c->q_head = j->next;
                if (!c->q_head) c->q_tail = NULL;
                pthread_mutex_unlock(&c->mu);
                memcpy_pages(j);
                j->next = NULL;
                run_done(c, j);
                pthread_mutex_lock(&c->mu);
                continue;
            }
        } else {
            /* start what the writer has room for, then see what finished */
            while (c->q_head) {
                struct copy_job *j = c->q_head;
                tdm_status st =
                    tdm_xfer_cuda_write_pages(c->w, j->src, j->src_bytes, j->dst, j->dst_bytes,
                                              &j->pages, NULL, NULL, on_kernel, j);
                if (st == TDM_EAGAIN) break;
                c->q_head = j->next;
                if (!c->q_head) c->q_tail = NULL;
                if (st == TDM_OK) {
                    c->in_writer++;
                } else { /* a launch failure: the copy ends with it */
                    j->st = st;
                    push(&c->done_head, &c->done_tail, j);
                }
            }
            if (c->in_writer) tdm_xfer_cuda_poll(c->w);
            struct copy_job *list = c->done_head;
            c->done_head = c->done_tail = NULL;
            if (list) {
                pthread_mutex_unlock(&c->mu);
                run_done(c, list);
                pthread_mutex_lock(&c->mu);
                continue;
            }
            if (c->in_writer) {
                pthread_mutex_unlock(&c->mu);
                nanosleep(&(struct timespec){0, COPY_POLL_US * 1000}, NULL);
                pthread_mutex_lock(&c->mu);
                continue;
            }
        }
        if (c->stopping && !c->q_head) break;
        pthread_cond_wait(&c->cv, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static tdm_status copier_copy(void *cp, const void *src, size_t src_bytes, void *dst,
                              size_t dst_bytes, const struct tdm_xfer_pages *pages,
                              tdm_xfer_done_fn done, void *ctx)
{
    struct copier *c = cp;
    if (!src || !dst) return tdm_err_set(TDM_EINVAL, "xfer copier: missing buffer");
    tdm_status st = tdm_xfer_pages_check(pages, src_bytes, dst_bytes, TDM_XFER_COPY_MAX_PAGES);
    if (st != TDM_OK) return st;
    struct copy_job *j = malloc(sizeof *j + 2 * sizeof(uint32_t) * pages->n_pages);
    if (!j) return tdm_err_set(TDM_ENOMEM, "xfer copier: out of memory");
    *j = (struct copy_job){.c = c,
                           .src = src,
                           .dst = dst,
                           .src_bytes = src_bytes,
                           .dst_bytes = dst_bytes,
                           .pages = *pages,
                           .done = done,
                           .ctx = ctx};
    memcpy(j->ids, pages->src_pages, sizeof(uint32_t) * pages->n_pages);
    memcpy(j->ids + pages->n_pages, pages->dst_pages, sizeof(uint32_t) * pages->n_pages);
    j->pages.src_pages = j->ids;
    j->pages.dst_pages = j->ids + pages->n_pages;
    pthread_mutex_lock(&c->mu);
    push(&c->q_head, &c->q_tail, j);
    c->pending++;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return TDM_OK;
}

static void *host_alloc(void *cp, size_t bytes)
{
    struct copier *c = cp;
    if (c->cuda) return tdm_xfer_cuda_host_alloc(bytes);
    void *p = NULL;
    size_t rounded = (bytes + 4095) & ~(size_t)4095;
    return posix_memalign(&p, 4096, rounded ? rounded : 4096) == 0 ? p : NULL;
}

static void host_free(void *cp, void *p, size_t bytes)
{
    struct copier *c = cp;
    (void)bytes;
    if (c->cuda)
        tdm_xfer_cuda_host_free(p);
    else
        free(p);
}

static void copier_drain(void *cp)
{
    struct copier *c = cp;
    pthread_mutex_lock(&c->mu);
    while (c->pending)
        pthread_cond_wait(&c->idle, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void copier_destroy(void *cp)
{
    struct copier *c = cp;
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    c->stopping = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    tdm_xfer_cuda_destroy(c->w);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->idle);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const struct tdm_xfer_copier_i HOST_COPIER = {
    .name = "memcpy",
    .host_alloc = host_alloc,
    .host_free = host_free,
    .copy_pages = copier_copy,
    .drain = copier_drain,
    .destroy = copier_destroy,
};
static const struct tdm_xfer_copier_i CUDA_COPIER = {
    .name = "cuda",
    .host_alloc = host_alloc,
    .host_free = host_free,
    .copy_pages = copier_copy,
    .drain = copier_drain,
    .destroy = copier_destroy,
};

static tdm_status copier_open(bool cuda, int device, struct tdm_xfer_copier *out)
{
    *out = (struct tdm_xfer_copier){0};
    struct copier *c = calloc(1, sizeof *c);
    if (!c) return tdm_err_set(TDM_ENOMEM, "xfer copier: out of memory");
    c->cuda = cuda;
    tdm_status st;
    if (cuda && (st = tdm_xfer_cuda_create(device, WRITER_SLOTS, &c->w)) != TDM_OK) {
        free(c);
        return st;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->idle, NULL);
    if (pthread_create(&c->thread, NULL, copier_main, c) != 0) {
        tdm_xfer_cuda_destroy(c->w);
        pthread_cond_destroy(&c->cv);
        pthread_cond_destroy(&c->idle);
        pthread_mutex_destroy(&c->mu);
        free(c);
        return tdm_err_set(TDM_ENOMEM, "xfer copier: cannot start its thread");
    }
    *out = (struct tdm_xfer_copier){.iface = cuda ? &CUDA_COPIER : &HOST_COPIER, .c = c};
    return TDM_OK;
}

tdm_status tdm_xfer_copier_host(struct tdm_xfer_copier *out)
{
    return copier_open(false, 0, out);
}

tdm_status tdm_xfer_copier_cuda(int device, struct tdm_xfer_copier *out)
{
    return copier_open(true, device, out);
}

void tdm_xfer_copier_destroy(struct tdm_xfer_copier *c)
{
    if (c && c->iface) c->iface->destroy(c->c);
    if (c) *c = (struct tdm_xfer_copier){0};
}
