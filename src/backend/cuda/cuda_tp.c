/*
 * Tensor parallelism over CUDA backends: the ranks' all-reduce and the LM head's rows gathered
 * on rank 0 (backend.h says what each call does; engine.c drives them, DESIGN.md §5).
 *
 * Two collectives behind the backend's allreduce hook:
 *
 *   NCCL (a device a rank). libnccl.so.2 is opened on first use, as cuBLASLt is (cuda_lt.c says
 *   why), and the communicators come from ncclCommInitAll, one process holding every rank.
 *   Each rank's call is ncclAllReduce in place on its own stream: no host work, so CUDA graphs
 *   record it and a decode step stays one graph launch a rank. NVLink multicast (NVLS) is left
 *   off unless the environment sets NCCL_NVLS_ENABLE (the device tool's machines need it off),
 *   and NCCL connects every peer at creation (NCCL_RUNTIME_CONNECT=0, plus one warm-up
 *   all-reduce), never inside a capture. Graphs that recorded an all-reduce hold the
 *   communicator: destroy drops every rank's graphs before ncclCommDestroy.
 *
 *   peer (ranks sharing a device, or no NCCL). Staging [rank][2 halves][max_floats] on each
 *   rank's own device, one event per (rank, half). Call k of rank r, half h = k & 1:
 *
 *     rank r's stream:  copy x -> stage[r][h] | record ev[r][h]
 *     host:             barrier (every rank has recorded its ev[.][h] of call k)
 *     rank r's stream:  wait ev[q][h] for every q != r | x = stage[0][h] + ... + stage[N-1][h]
 *
 *   The sum runs in rank order on every rank: the same bits everywhere. Halves alternate so that
 *   no staging is overwritten while another rank may still read it: rank q writes stage[q][h]
 *   again at call k + 2, after its stream passed call k + 1's waits on every rank's ev[.][!h],
 *   each recorded after that rank's call-k sum. An event is re-recorded only after the next
 *   barrier, by which time every wait on its previous record has been queued. The host
 *   barrier cannot be recorded in a graph, so peer ranks run without graphs.
 *
 * The LM head (engine.c, lm_head) is split by vocabulary: rank r's [n_rows][nv] logits go to
 * columns [v0, v0 + nv) of rank 0's logits, a pitched peer copy on rank r's stream. It may
 * start only once rank 0's previous sampling has read those logits (lm_open records that point
 * on rank 0's stream before the ranks are released), and rank 0 samples only after every copy
 * (lm_close: rank 0's stream waits on each rank's lm_done, after the ranks' barrier).
 *
 * Ownership: the group owns its communicators, staging and events; the backends stay the
 * caller's and must outlive it. Threading: create and destroy on one thread while no rank
 * runs; rank r's allreduce and lm_put from the thread driving rank r's backend; lm_open and
 * lm_close from rank 0's.
 */
#include "backend/cuda/cuda_int.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/core.h"
#include "tandem/tp.h"

#if defined(__has_include)
#if __has_include(<nccl.h>)
#include <nccl.h>
#define TDM_HAVE_NCCL_H 1
#endif
#endif

_Static_assert(TDM_TP_MAX_RANKS <= TDM_CU_TP_MAX, "the peer sum's sources hold every rank");

#ifndef TDM_NCCL_SONAME
#define TDM_NCCL_SONAME "libnccl.so.2"
#endif

struct tdm_cuda_tp {
    int n;
    enum tdm_cuda_tp_mode mode;
    struct tdm_cuda *cu[TDM_TP_MAX_RANKS];
    tdm_tp_group_t *group;
#ifdef TDM_HAVE_NCCL_H
    ncclComm_t comm[TDM_TP_MAX_RANKS];
#endif
    /* peer: staging and events by rank and half, and each rank's call count (its own entry) */
    float *stage[TDM_TP_MAX_RANKS][2];
    cudaEvent_t ev[TDM_TP_MAX_RANKS][2];
    uint64_t calls[TDM_TP_MAX_RANKS];
    size_t max_floats;
    bool broken; /* an NCCL call failed: abort the communicators, wait on no stream */
    /* the LM head: rank 0's "its logits may be written" point, each rank's copy done */
    cudaEvent_t lm_free;
    cudaEvent_t lm_done[TDM_TP_MAX_RANKS];
};

/* ---- NCCL, opened on first use ---- */

#ifdef TDM_HAVE_NCCL_H
static struct {
    __typeof__(&ncclGetVersion) version;
    __typeof__(&ncclCommInitAll) init_all;
    __typeof__(&ncclCommDestroy) destroy;
    __typeof__(&ncclCommAbort) abort;
    __typeof__(&ncclAllReduce) all_reduce;
    __typeof__(&ncclGetErrorString) error_string;
    __typeof__(&ncclGroupStart) group_start;
    __typeof__(&ncclGroupEnd) group_end;
} nccl;
#endif
static bool nccl_ok;
static char nccl_why[512];
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void)
{
#ifdef TDM_HAVE_NCCL_H
    const struct tdm_dl_sym syms[] = {
        {"ncclGetVersion", NULL, &nccl.version},
        {"ncclCommInitAll", NULL, &nccl.init_all},
        {"ncclCommDestroy", NULL, &nccl.destroy},
        {"ncclCommAbort", NULL, &nccl.abort},
        {"ncclAllReduce", NULL, &nccl.all_reduce},
        {"ncclGetErrorString", NULL, &nccl.error_string},
        {"ncclGroupStart", NULL, &nccl.group_start},
        {"ncclGroupEnd", NULL, &nccl.group_end},
    };
    nccl_ok =
        tdm_cu_dl_load(TDM_NCCL_SONAME, syms, (int)TDM_ARRAY_LEN(syms), nccl_why, sizeof nccl_why);
#else
    snprintf(nccl_why, sizeof nccl_why, "this build saw no nccl.h");
#endif
}

/* Whether NCCL can be used; *version its version code (e.g. 22703) when it can. */
static bool nccl_available(int *version)
{
    pthread_once(&nccl_once, nccl_load);
    *version = 0;
#ifdef TDM_HAVE_NCCL_H
    if (nccl_ok && nccl.version(version) != ncclSuccess) *version = 0;
#endif
    return nccl_ok;
}

int tdm_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

tdm_status tdm_cuda_tp_plan(int n_ranks, int *devices, enum tdm_cuda_tp_mode *mode, char *why,
                            size_t why_cap)
{
    const int n_dev = tdm_cuda_device_count();
    if (n_dev < 1) return tdm_err_set(TDM_EUNSUPPORTED, "--tp %d on CUDA: no GPU", n_ranks);
    if (n_ranks < 1 || n_ranks > TDM_TP_MAX_RANKS)
        return tdm_err_set(TDM_EINVAL, "--tp %d on CUDA (1 .. %d ranks)", n_ranks,
                           TDM_TP_MAX_RANKS);
    for (int r = 0; r < n_ranks; r++)
        devices[r] = r % n_dev;
    const char *force = getenv("TANDEM_TP_COMM");
    if (force && *force && strcmp(force, "nccl") && strcmp(force, "peer"))
        return tdm_err_set(TDM_EINVAL, "TANDEM_TP_COMM=%s: nccl or peer", force);
    const bool want_peer = force && !strcmp(force, "peer");
    const bool want_nccl = force && !strcmp(force, "nccl");
    int version = 0;
    const bool have = !want_peer && nccl_available(&version);
    if (want_nccl && !have)
        return tdm_err_set(TDM_EUNSUPPORTED, "TANDEM_TP_COMM=nccl: %s could not be loaded: %s",
                           TDM_NCCL_SONAME, nccl_why);
    if (want_nccl && n_dev < n_ranks)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "TANDEM_TP_COMM=nccl: %d ranks over %d GPU(s); NCCL needs a GPU a rank",
                           n_ranks, n_dev);
    if (have && n_dev >= n_ranks) {
        *mode = TDM_CUDA_TP_NCCL;
        snprintf(why, why_cap, "NCCL %d.%d.%d, a GPU a rank, CUDA graphs", version / 10000,
                 version / 100 % 100, version % 100);
    } else {
        *mode = TDM_CUDA_TP_PEER;
        snprintf(why, why_cap, "peer all-reduce without CUDA graphs (%s)",
                 want_peer         ? "TANDEM_TP_COMM=peer"
                 : n_dev < n_ranks ? "ranks share GPUs"
                                   : "no NCCL");
    }
    return TDM_OK;
}

#ifdef TDM_HAVE_NCCL_H
/* One small all-reduce over every rank, from this thread (a group call), outside any capture:
 * NCCL connects its peers on a communicator's first collective, which must not be the one a
 * decode step's graph records. */
static tdm_status nccl_warm(struct tdm_cuda_tp *t)
{
    float *buf[TDM_TP_MAX_RANKS] = {0};
    tdm_status st = TDM_OK;
    for (int r = 0; r < t->n && st == TDM_OK; r++) {
        cudaSetDevice(t->cu[r]->device);
        if (cudaMalloc((void **)&buf[r], 64 * sizeof(float)) != cudaSuccess ||
            cudaMemsetAsync(buf[r], 0, 64 * sizeof(float), t->cu[r]->stream) != cudaSuccess)
            st = tdm_err_set(TDM_EIO, "cuda tp: NCCL warm-up buffer: %s",
                             cudaGetErrorString(cudaGetLastError()));
    }
    ncclResult_t nr = ncclSuccess;
    if (st == TDM_OK) {
        nr = nccl.group_start();
        for (int r = 0; r < t->n && nr == ncclSuccess; r++)
            nr = nccl.all_reduce(buf[r], buf[r], 64, ncclFloat32, ncclSum, t->comm[r],
                                 t->cu[r]->stream);
        ncclResult_t ne = nccl.group_end();
        if (nr == ncclSuccess) nr = ne;
        if (nr != ncclSuccess)
            st =
                tdm_err_set(TDM_EIO, "cuda tp: NCCL's first all-reduce: %s", nccl.error_string(nr));
    }
    for (int r = 0; r < t->n; r++) {
        cudaSetDevice(t->cu[r]->device);
        if (st == TDM_OK && cudaStreamSynchronize(t->cu[r]->stream) != cudaSuccess)
            st = tdm_err_set(TDM_EIO, "cuda tp: NCCL's first all-reduce: %s",
                             cudaGetErrorString(cudaGetLastError()));
        if (buf[r]) cudaFree(buf[r]);
    }
    return st;
}
#endif

#define TP_CHECK(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            st = tdm_err_set(TDM_EIO, "cuda tp: %s: %s", what, cudaGetErrorString(e_));            \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

tdm_status tdm_cuda_tp_create(tdm_backend_t *const *ranks, int n, enum tdm_cuda_tp_mode mode,
                              struct tdm_tp_group *group, size_t max_floats, tdm_cuda_tp_t **out)
{
    *out = NULL;
    if (n < 1 || n > TDM_TP_MAX_RANKS)
        return tdm_err_set(TDM_EINVAL, "cuda tp: %d ranks (1 .. %d)", n, TDM_TP_MAX_RANKS);
    for (int r = 0; r < n; r++)
        if (!tdm_backend_is_cuda(ranks[r]) || tdm_cu_of(ranks[r])->tp)
            return tdm_err_set(TDM_EINVAL, "cuda tp: rank %d is no free CUDA backend", r);
    struct tdm_cuda_tp *t = calloc(1, sizeof *t);
    if (!t) return tdm_err_set(TDM_ENOMEM, "cuda tp: out of memory");
    tdm_status st = TDM_OK;
    t->n = n;
    t->mode = mode;
    t->group = group;
    t->max_floats = max_floats;
    for (int r = 0; r < n; r++)
        t->cu[r] = tdm_cu_of(ranks[r]);
    if (mode == TDM_CUDA_TP_NCCL) {
#ifdef TDM_HAVE_NCCL_H
        int version, devs[TDM_TP_MAX_RANKS];
        if (!nccl_available(&version)) {
            st = tdm_err_set(TDM_EUNSUPPORTED, "cuda tp: %s could not be loaded: %s",
                             TDM_NCCL_SONAME, nccl_why);
            goto fail;
        }
        for (int r = 0; r < n; r++) {
            devs[r] = t->cu[r]->device;
            for (int q = 0; q < r; q++)
                if (devs[q] == devs[r]) {
                    st = tdm_err_set(TDM_EINVAL, "cuda tp: NCCL ranks %d and %d share GPU %d", q, r,
                                     devs[r]);
                    goto fail;
                }
        }
        /* the caller's settings win. No NVLink multicast; and every connection made by
         * ncclCommInitAll, not on an algorithm's first use (NCCL >= 2.22 connects lazily),
         * which could be inside a graph capture. Engine creation comes before a server's
         * threads, so setenv races no getenv. */
        setenv("NCCL_NVLS_ENABLE", "0", 0);
        setenv("NCCL_RUNTIME_CONNECT", "0", 0);
        ncclResult_t nr = nccl.init_all(t->comm, n, devs);
        if (nr != ncclSuccess) {
            memset(t->comm, 0, sizeof t->comm);
            st = tdm_err_set(TDM_EIO, "cuda tp: ncclCommInitAll over %d GPUs: %s", n,
                             nccl.error_string(nr));
            goto fail;
        }
        if ((st = nccl_warm(t)) != TDM_OK) {
            t->broken = true;
            goto fail;
        }
#else
        st = tdm_err_set(TDM_EUNSUPPORTED, "cuda tp: this build saw no nccl.h");
        goto fail;
#endif
    } else {
        if (max_floats < 1) {
            st = tdm_err_set(TDM_EINVAL, "cuda tp: peer staging of 0 floats");
            goto fail;
        }
        for (int r = 0; r < n; r++) {
            TP_CHECK(cudaSetDevice(t->cu[r]->device), "set device");
            for (int q = 0; q < n; q++) { /* every rank reads every other's staging */
                const int dq = t->cu[q]->device, dr = t->cu[r]->device;
                int can = 0;
                if (dq == dr) continue;
                TP_CHECK(cudaDeviceCanAccessPeer(&can, dr, dq), "peer query");
                if (!can) {
                    st = tdm_err_set(TDM_EUNSUPPORTED,
                                     "cuda tp: GPU %d cannot read GPU %d's memory (no peer "
                                     "access); the peer all-reduce needs it, NCCL does not",
                                     dr, dq);
                    goto fail;
                }
                cudaError_t pe = cudaDeviceEnablePeerAccess(dq, 0);
                if (pe == cudaErrorPeerAccessAlreadyEnabled)
                    (void)cudaGetLastError();
                else
                    TP_CHECK(pe, "enable peer access");
            }
            for (int h = 0; h < 2; h++) {
                TP_CHECK(cudaMalloc((void **)&t->stage[r][h], max_floats * sizeof(float)),
                         "peer staging");
                TP_CHECK(cudaEventCreateWithFlags(&t->ev[r][h], cudaEventDisableTiming), "event");
            }
        }
    }
    for (int r = 0; r < n; r++) {
        TP_CHECK(cudaSetDevice(t->cu[r]->device), "set device");
        TP_CHECK(cudaEventCreateWithFlags(&t->lm_done[r], cudaEventDisableTiming), "event");
    }
    TP_CHECK(cudaSetDevice(t->cu[0]->device), "set device");
    TP_CHECK(cudaEventCreateWithFlags(&t->lm_free, cudaEventDisableTiming), "event");
    for (int r = 0; r < n; r++) {
        t->cu[r]->tp = t;
        t->cu[r]->tp_rank = r;
    }
    *out = t;
    return TDM_OK;
fail:
    tdm_cuda_tp_destroy(t);
    cudaSetDevice(tdm_cu_of(ranks[0])->device);
    return st;
}

void tdm_cuda_tp_destroy(tdm_cuda_tp_t *t)
{
    if (!t) return;
    /* every rank idle and its graphs gone first: NCCL ties a graph that recorded one of its
     * collectives to the communicator, and ncclCommDestroy waits until that graph is
     * destroyed. A broken group (a failed NCCL call) may have kernels waiting on a peer that
     * never came: no stream is waited on, and its communicators are aborted. */
    for (int r = 0; r < t->n; r++) {
        struct tdm_cuda *cu = t->cu[r];
        cudaSetDevice(cu->device);
        if (!t->broken) cudaStreamSynchronize(cu->stream);
        if (!t->broken) tdm_cuda_drop_graphs(cu);
        if (cu->tp == t) cu->tp = NULL;
    }
#ifdef TDM_HAVE_NCCL_H
    for (int r = 0; r < t->n; r++)
        if (t->comm[r]) (t->broken ? nccl.abort : nccl.destroy)(t->comm[r]);
#endif
    for (int r = 0; r < t->n; r++) {
        cudaSetDevice(t->cu[r]->device);
        for (int h = 0; h < 2; h++) {
            if (t->stage[r][h]) cudaFree(t->stage[r][h]);
            if (t->ev[r][h]) cudaEventDestroy(t->ev[r][h]);
        }
        if (t->lm_done[r]) cudaEventDestroy(t->lm_done[r]);
    }
    if (t->n) cudaSetDevice(t->cu[0]->device);
    if (t->lm_free) cudaEventDestroy(t->lm_free);
    free(t);
}

void tdm_cuda_allreduce(tdm_backend_t *b, float *x, size_t n)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    struct tdm_cuda_tp *t = cu->tp;
    if (!t) tdm_cu_fatal("allreduce", "the backend is no tensor-parallel rank", __FILE__, __LINE__);
    const int r = cu->tp_rank;
    if (cu->sh_ptr == x) cu->sh_ptr = NULL; /* its bf16 shadow no longer mirrors it */
    if (!n) return;
    if (t->mode == TDM_CUDA_TP_NCCL) {
#ifdef TDM_HAVE_NCCL_H
        ncclResult_t nr = nccl.all_reduce(x, x, n, ncclFloat32, ncclSum, t->comm[r], cu->stream);
        if (nr != ncclSuccess)
            tdm_cu_fatal("ncclAllReduce", nccl.error_string(nr), __FILE__, __LINE__);
#endif
        return;
    }
    if (n > t->max_floats)
        tdm_cu_fatal("allreduce", "more floats than the peer staging holds", __FILE__, __LINE__);
    const int h = (int)(t->calls[r]++ & 1);
    TDM_CU_CHECK(cudaMemcpyAsync(t->stage[r][h], x, n * sizeof(float), cudaMemcpyDeviceToDevice,
                                 cu->stream));
    TDM_CU_CHECK(cudaEventRecord(t->ev[r][h], cu->stream));
    tdm_tp_barrier(t->group);
    struct tdm_cu_tp_srcs src = {.n = t->n};
    for (int q = 0; q < t->n; q++) {
        src.p[q] = t->stage[q][h];
        if (q != r) TDM_CU_CHECK(cudaStreamWaitEvent(cu->stream, t->ev[q][h], 0));
    }
    tdm_cu_tp_sum(cu->stream, &src, x, n);
    TDM_CU_CHECK(cudaGetLastError());
}

void tdm_cuda_tp_lm_open(tdm_backend_t *leader)
{
    struct tdm_cuda *cu = tdm_cu_of(leader);
    tdm_cuda_bind(cu);
    TDM_CU_CHECK(cudaEventRecord(cu->tp->lm_free, cu->stream));
}

void tdm_cuda_tp_lm_put(tdm_backend_t *b, const float *part, int n_rows, int64_t nv, float *dst,
                        int64_t width, int64_t v0)
{
    struct tdm_cuda *cu = tdm_cu_of(b);
    struct tdm_cuda_tp *t = cu->tp;
    const int r = cu->tp_rank;
    if (n_rows <= 0 || nv <= 0) return;
    if (r) TDM_CU_CHECK(cudaStreamWaitEvent(cu->stream, t->lm_free, 0));
    struct cudaMemcpy3DPeerParms p;
    memset(&p, 0, sizeof p);
    p.srcPtr = (struct cudaPitchedPtr){.ptr = (void *)part,
                                       .pitch = (size_t)nv * sizeof(float),
                                       .xsize = (size_t)nv * sizeof(float),
                                       .ysize = (size_t)n_rows};
    p.srcDevice = cu->device;
    p.dstPtr = (struct cudaPitchedPtr){.ptr = dst + v0,
                                       .pitch = (size_t)width * sizeof(float),
                                       .xsize = (size_t)nv * sizeof(float),
                                       .ysize = (size_t)n_rows};
    p.dstDevice = t->cu[0]->device;
    p.extent = (struct cudaExtent){
        .width = (size_t)nv * sizeof(float), .height = (size_t)n_rows, .depth = 1};
    TDM_CU_CHECK(cudaMemcpy3DPeerAsync(&p, cu->stream));
    if (r) TDM_CU_CHECK(cudaEventRecord(t->lm_done[r], cu->stream));
}

void tdm_cuda_tp_lm_close(tdm_backend_t *leader)
{
    struct tdm_cuda *cu = tdm_cu_of(leader);
    tdm_cuda_bind(cu);
    for (int r = 1; r < cu->tp->n; r++)
        TDM_CU_CHECK(cudaStreamWaitEvent(cu->stream, cu->tp->lm_done[r], 0));
}

void tdm_backend_cuda_bind_thread(tdm_backend_t *b)
{
    tdm_cuda_bind(tdm_cu_of(b));
}
