/*
 * The CUDA IPC transport: GPU-to-GPU page writes inside one node.
 *
 * Why a kernel. On an H200 pair joined by NVLink, one cudaMemcpy per 64 KiB page reaches ~5 GB/s
 * because per-call overhead dominates, against ~390 GB/s for large copies. So a paged write is ONE
 * gather/scatter kernel: block b copies chunk (b mod chunks_per_page) of page (b / chunks_per_page)
 * from the source region to the peer-mapped destination, with 16-byte vector loads when every
 * offset allows it. The page list (pairs of byte offsets) is staged through a pinned host slot
 * and copied to the device on the same stream, so the host never waits.
 *
 * Memory. The destination's owner exports an allocation with cudaIpcGetMemHandle (the pointer
 * must be the base of a cudaMalloc allocation); the writer opens it with
 * cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess) and writes through the mapping. The
 * handle travels inside a struct tdm_xfer_rmem of kind CUDA, packed like any other descriptor.
 *
 * Completion. Each write records an event after its kernel. tdm_xfer_cuda_poll completes writes
 * in submission order; for each it hands the immediate to the counter table (the same table type
 * the fabric engine uses) and calls done. Between processes, a caller that is not the owner of the
 * counters forwards the immediate in a control message.
 *
 * Threading: a tdm_xfer_cuda_t belongs to one thread (the messenger's thread for that GPU). It
 * holds max_pending slots, each with a pinned host and a device array of page pairs; a slot is
 * reused only after its event has completed, so the staging memory is never overwritten early.
 * This file does not depend on libfabric: the GPU check program builds it with plain nvcc.
 */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/xfer_int.h"

namespace
{

constexpr uint32_t kMaxPagesPerWrite = 16384;
constexpr uint64_t kChunkBytes = 64 * 1024;

struct page_pair {
    unsigned long long src, dst;
};

struct slot {
    page_pair *host;   /* [kMaxPagesPerWrite] pinned */
    page_pair *device; /* [kMaxPagesPerWrite] */
    cudaEvent_t done_event;
    bool busy;
    bool has_imm;
    tdm_xfer_imm imm;
    tdm_xfer_counters_t *counters;
    tdm_xfer_done_fn done;
    void *ctx;
};

template <bool kVec>
__global__ void gather_scatter(const uint8_t *__restrict__ src, uint8_t *__restrict__ dst,
                               const page_pair *__restrict__ pairs, uint64_t page_bytes,
                               uint32_t chunks_per_page)
{
    uint32_t page = blockIdx.x / chunks_per_page;
    uint64_t begin = (uint64_t)(blockIdx.x % chunks_per_page) * kChunkBytes;
    uint64_t end = begin + kChunkBytes < page_bytes ? begin + kChunkBytes : page_bytes;
    const uint8_t *s = src + pairs[page].src + begin;
    uint8_t *d = dst + pairs[page].dst + begin;
    uint64_t n = end - begin;
    if (kVec) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(s);
        uint4 *d4 = reinterpret_cast<uint4 *>(d);
        uint64_t n4 = n / 16;
        uint64_t i = threadIdx.x;
        /* four independent 16-byte loads in flight per thread before the stores */
        for (; i + 3 * blockDim.x < n4; i += 4 * blockDim.x) {
            uint4 a = s4[i], b = s4[i + blockDim.x], c = s4[i + 2 * blockDim.x],
                  e = s4[i + 3 * blockDim.x];
            d4[i] = a;
            d4[i + blockDim.x] = b;
            d4[i + 2 * blockDim.x] = c;
            d4[i + 3 * blockDim.x] = e;
        }
        for (; i < n4; i += blockDim.x)
            d4[i] = s4[i];
    } else {
        for (uint64_t i = threadIdx.x; i < n; i += blockDim.x)
            d[i] = s[i];
    }
}

/* cuMemGetAddressRange through the runtime's entry-point query, so that nothing links libcuda
 * (a machine with the toolkit and no driver still loads the library) */
typedef CUresult (*get_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
CUresult get_range(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    static get_range_fn cached;
    get_range_fn fn = __atomic_load_n(&cached, __ATOMIC_ACQUIRE);
    if (!fn) {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess || !f)
            return CUDA_ERROR_NOT_FOUND;
        fn = (get_range_fn)f;
        __atomic_store_n(&cached, fn, __ATOMIC_RELEASE);
    }
    return fn(base, size, p);
}

tdm_status cuda_fail(cudaError_t e, const char *what)
{
    return tdm_err_set(TDM_EIO, "xfer cuda: %s: %s", what, cudaGetErrorString(e));
}

} // namespace

struct tdm_xfer_cuda {
    int device;
    cudaStream_t stream;
    int n_slots;
    slot *slots;
    int head, count; /* ring of busy slots, in submission order */
};

extern "C" tdm_status tdm_xfer_cuda_create(int device, int max_pending, tdm_xfer_cuda_t **out)
{
    if (max_pending <= 0 || max_pending > 1024)
        return tdm_err_set(TDM_EINVAL, "xfer cuda: max_pending %d", max_pending);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return cuda_fail(e, "cudaSetDevice");
    tdm_xfer_cuda_t *c = (tdm_xfer_cuda_t *)calloc(1, sizeof(*c));
    if (!c) return tdm_err_set(TDM_ENOMEM, "xfer cuda: out of memory");
    c->device = device;
    c->n_slots = max_pending;
    c->slots = (slot *)calloc((size_t)max_pending, sizeof(slot));
    tdm_status st = TDM_OK;
    if (!c->slots) {
        st = tdm_err_set(TDM_ENOMEM, "xfer cuda: out of memory");
        goto out_free;
    }
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        st = cuda_fail(e, "cudaStreamCreate");
        goto out_free;
    }
    for (int i = 0; i < max_pending; i++) {
        slot *s = &c->slots[i];
        if ((e = cudaMallocHost(&s->host, sizeof(page_pair) * kMaxPagesPerWrite)) != cudaSuccess ||
            (e = cudaMalloc(&s->device, sizeof(page_pair) * kMaxPagesPerWrite)) != cudaSuccess ||
            (e = cudaEventCreateWithFlags(&s->done_event, cudaEventDisableTiming)) != cudaSuccess) {
            st = cuda_fail(e, "allocating staging slots");
            goto out_free;
        }
    }
    *out = c;
    return TDM_OK;
out_free:
    tdm_xfer_cuda_destroy(c);
    return st;
}

extern "C" void tdm_xfer_cuda_destroy(tdm_xfer_cuda_t *c)
{
    if (!c) return;
    cudaSetDevice(c->device);
    if (c->stream) cudaStreamSynchronize(c->stream);
    tdm_xfer_cuda_poll(c);
    if (c->slots)
        for (int i = 0; i < c->n_slots; i++) {
            slot *s = &c->slots[i];
            if (s->host) cudaFreeHost(s->host);
            if (s->device) cudaFree(s->device);
            if (s->done_event) cudaEventDestroy(s->done_event);
        }
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c->slots);
    free(c);
}

extern "C" tdm_status tdm_xfer_cuda_export(void *dptr, size_t bytes, struct tdm_xfer_rmem *out)
{
    static_assert(sizeof(cudaIpcMemHandle_t) == 64, "IPC handle size");
    if (!dptr || !bytes) return tdm_err_set(TDM_EINVAL, "xfer cuda: empty region");
    /* the handle names the whole allocation: the region is an offset (addr) and a length in it */
    CUdeviceptr base = 0;
    size_t alloc = 0;
    CUresult r = get_range(&base, &alloc, (CUdeviceptr)(uintptr_t)dptr);
    if (r != CUDA_SUCCESS)
        return tdm_err_set(TDM_EINVAL,
                           "xfer cuda: %p is not device memory (cuMemGetAddressRange %d)", dptr,
                           (int)r);
    uint64_t off = (uint64_t)(uintptr_t)dptr - (uint64_t)base;
    if (bytes > alloc - off)
        return tdm_err_set(TDM_ERANGE, "xfer cuda: region of %zu bytes runs past its allocation",
                           bytes);
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, (void *)(uintptr_t)base);
    if (e != cudaSuccess) return cuda_fail(e, "cudaIpcGetMemHandle");
    memset(out, 0, sizeof(*out));
    out->kind = TDM_XFER_MEM_CUDA;
    out->addr = off;
    out->bytes = bytes;
    memcpy(out->ipc_handle, &h, sizeof(h));
    return TDM_OK;
}

extern "C" tdm_status tdm_xfer_cuda_alloc_size(const void *dptr, size_t *bytes)
{
    CUdeviceptr base = 0;
    size_t alloc = 0;
    CUresult r = get_range(&base, &alloc, (CUdeviceptr)(uintptr_t)dptr);
    if (r != CUDA_SUCCESS)
        return tdm_err_set(TDM_EINVAL, "xfer cuda: %p is not device memory", dptr);
    *bytes = alloc - (size_t)((uintptr_t)dptr - (uintptr_t)base);
    return TDM_OK;
}

extern "C" tdm_status tdm_xfer_cuda_device_of(const void *dptr, int *device)
{
    cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, dptr);
    if (e != cudaSuccess) return cuda_fail(e, "cudaPointerGetAttributes");
    if (a.type != cudaMemoryTypeDevice)
        return tdm_err_set(TDM_EINVAL, "xfer cuda: %p is not device memory", dptr);
    *device = a.device;
    return TDM_OK;
}

extern "C" tdm_status tdm_xfer_cuda_open(const struct tdm_xfer_rmem *r, void **dptr)
{
    if (r->kind != TDM_XFER_MEM_CUDA)
        return tdm_err_set(TDM_EINVAL, "xfer cuda: descriptor is not a cuda region");
    cudaIpcMemHandle_t h;
    memcpy(&h, r->ipc_handle, sizeof(h));
    void *p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) return cuda_fail(e, "cudaIpcOpenMemHandle");
    *dptr = p;
    return TDM_OK;
}

extern "C" void tdm_xfer_cuda_close(void *dptr)
{
    if (dptr) cudaIpcCloseMemHandle(dptr);
}

extern "C" tdm_status tdm_xfer_cuda_write_pages(tdm_xfer_cuda_t *c, const void *src,
                                                size_t src_bytes, void *dst, size_t dst_bytes,
                                                const struct tdm_xfer_pages *pages,
                                                const struct tdm_xfer_imm *imm,
                                                tdm_xfer_counters_t *counters,
                                                tdm_xfer_done_fn done, void *ctx)
{
    if (!c || !src || !dst) return tdm_err_set(TDM_EINVAL, "xfer cuda: missing argument");
    tdm_status st = tdm_xfer_pages_check(pages, src_bytes, dst_bytes, kMaxPagesPerWrite);
    if (st != TDM_OK) return st;
    if (imm && !counters) return tdm_err_set(TDM_EINVAL, "xfer cuda: immediate without counters");
    if (c->count == c->n_slots) {
        tdm_xfer_cuda_poll(c);
        if (c->count == c->n_slots)
            return tdm_err_set(TDM_EAGAIN, "xfer cuda: %d writes pending", c->n_slots);
    }
    int si = (c->head + c->count) % c->n_slots;
    slot *s = &c->slots[si];
    bool vec = pages->page_bytes % 16 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0;
    for (uint32_t i = 0; i < pages->n_pages; i++) {
        s->host[i].src = pages->src_offset + (uint64_t)pages->src_pages[i] * pages->src_stride;
        s->host[i].dst = pages->dst_offset + (uint64_t)pages->dst_pages[i] * pages->dst_stride;
        vec = vec && s->host[i].src % 16 == 0 && s->host[i].dst % 16 == 0;
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(s->device, s->host, sizeof(page_pair) * pages->n_pages,
                            cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) return cuda_fail(e, "staging the page list");
    uint32_t chunks = (uint32_t)((pages->page_bytes + kChunkBytes - 1) / kChunkBytes);
    uint64_t blocks = (uint64_t)chunks * pages->n_pages;
    if (blocks > 0x7fffffffull) return tdm_err_set(TDM_ERANGE, "xfer cuda: write too large");
    uint64_t per_block = pages->page_bytes < kChunkBytes ? pages->page_bytes : kChunkBytes;
    int threads = per_block >= 32768 ? 512 : per_block >= 4096 ? 256 : 128;
    if (vec)
        gather_scatter<true><<<(unsigned)blocks, threads, 0, c->stream>>>(
            (const uint8_t *)src, (uint8_t *)dst, s->device, pages->page_bytes, chunks);
    else
        gather_scatter<false><<<(unsigned)blocks, threads, 0, c->stream>>>(
            (const uint8_t *)src, (uint8_t *)dst, s->device, pages->page_bytes, chunks);
    if ((e = cudaGetLastError()) != cudaSuccess) return cuda_fail(e, "launching the copy kernel");
    if ((e = cudaEventRecord(s->done_event, c->stream)) != cudaSuccess)
        return cuda_fail(e, "cudaEventRecord");
    s->busy = true;
    s->has_imm = imm != nullptr;
    if (imm) s->imm = *imm;
    s->counters = counters;
    s->done = done;
    s->ctx = ctx;
    c->count++;
    return TDM_OK;
}

extern "C" int tdm_xfer_cuda_poll(tdm_xfer_cuda_t *c)
{
    int n = 0;
    if (c->count > 0) cudaSetDevice(c->device);
    while (c->count > 0) {
        slot *s = &c->slots[c->head];
        cudaError_t e = cudaEventQuery(s->done_event);
        if (e == cudaErrorNotReady) break;
        tdm_status st = TDM_OK;
        if (e != cudaSuccess) st = cuda_fail(e, "copy kernel");
        s->busy = false;
        c->head = (c->head + 1) % c->n_slots;
        c->count--;
        n++;
        if (st == TDM_OK && s->has_imm) tdm_xfer_counters_deliver(s->counters, &s->imm);
        if (s->done) s->done(s->ctx, st);
    }
    return n;
}

extern "C" tdm_status tdm_xfer_cuda_drain(tdm_xfer_cuda_t *c, int timeout_ms)
{
    uint64_t until = tdm_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    while (c->count > 0) {
        tdm_xfer_cuda_poll(c);
        if (c->count == 0) break;
        if (tdm_now_ns() > until)
            return tdm_err_set(TDM_ETIMEDOUT, "xfer cuda: %d writes still running after %d ms",
                               c->count, timeout_ms);
    }
    return TDM_OK;
}

extern "C" void *tdm_xfer_cuda_host_alloc(size_t bytes)
{
    void *p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped) != cudaSuccess) {
        cudaGetLastError(); /* not sticky: clear it */
        return nullptr;
    }
    return p;
}

extern "C" void tdm_xfer_cuda_host_free(void *p)
{
    if (p) cudaFreeHost(p);
}
