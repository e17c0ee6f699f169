/*
 * xfer_cuda_check: checks and measures the CUDA IPC transport (src/xfer/cuda_ipc.cu) on two GPUs.
 *
 * Two processes, forked before CUDA starts: the child (the "decoder") allocates the destination
 * region on GPU 1 and exports its IPC handle through a pipe; the parent (the "prefiller") fills a
 * source region on GPU 0, opens the handle (a peer-mapped pointer) and posts paged writes of
 * random pages, one gather/scatter kernel each, with immediates counted by a tdm_xfer_counters
 * table. For each page size it first verifies one write byte for byte (destination zeroed, pages
 * read back through the mapping and compared with the source on the host), then times repeated
 * writes. References measured in the same run: one large cudaMemcpyAsync into the mapping (the
 * link's large-copy bandwidth), and one cudaMemcpyAsync per 64 KiB page (the naive way).
 *
 * It is not built by CMake (tests/tools/*.c only); build it with plain nvcc, no libfabric:
 *   nvcc -O2 -arch=sm_90a -std=c++17 -Iinclude -Isrc -DTDM_HAVE_CUDA=1 -Xcompiler -D_GNU_SOURCE \
 *        src/xfer/cuda_ipc.cu tests/tools/xfer_cuda_check.cu src/xfer/common.c \
 *        src/xfer/counters.c src/core/*.c -o xfer_cuda_check -lpthread -lm
 * Exit status 0 when every check passed. One GPU works too (both sides on it).
 */
#include <cuda_runtime.h>


#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tandem/xfer.h"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static const size_t kRegion = 512ull << 20;

__global__ void fill(uint64_t *p, size_t n, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        p[i] = z ^ (z >> 31);
    }
}

static int child(int rfd, int wfd)
{
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    int dev = n > 1 ? 1 : 0;
    CK(cudaSetDevice(dev));
    void *dst;
    CK(cudaMalloc(&dst, kRegion));
    CK(cudaMemset(dst, 0, kRegion));
    CK(cudaDeviceSynchronize());
    struct tdm_xfer_rmem r;
    if (tdm_xfer_cuda_export(dst, kRegion, &r) != TDM_OK) {
        fprintf(stderr, "export: %s\n", tdm_err_msg());
        return 1;
    }
    uint8_t wire[TDM_XFER_RMEM_WIRE];
    tdm_xfer_rmem_pack(&r, wire);
    if (write(wfd, wire, sizeof(wire)) != (ssize_t)sizeof(wire)) return 1;
    char b;
    if (read(rfd, &b, 1) != 1) return 1; /* parent is done with the mapping */
    CK(cudaFree(dst));
    return 0;
}

static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void)
{
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return rs;
}

static void shuffle(uint32_t *a, uint32_t n)
{
    for (uint32_t i = 0; i + 1 < n; i++) {
        uint32_t j = i + (uint32_t)(rnd() % (n - i));
        uint32_t t = a[i];
        a[i] = a[j], a[j] = t;
    }
}

struct fire {
    int n;
    tdm_status st;
};
static void on_fire(void *ctx, uint32_t slot, uint32_t epoch, tdm_status st)
{
    struct fire *f = (struct fire *)ctx;
    f->n++;
    f->st = st;
}

static int parent(int rfd, int wfd, pid_t kid)
{
    int ndev = 0;
    CK(cudaGetDeviceCount(&ndev));
    int dst_dev = ndev > 1 ? 1 : 0, peer_ok = 0;
    if (ndev > 1) CK(cudaDeviceCanAccessPeer(&peer_ok, 0, 1));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("devices %d (%s), source GPU 0, destination GPU %d, peer access %d\n", ndev, prop.name,
           dst_dev, peer_ok);
    CK(cudaSetDevice(0));
    uint8_t *src;
    CK(cudaMalloc(&src, kRegion));
    fill<<<1024, 256>>>((uint64_t *)src, kRegion / 8, 12345);
    CK(cudaDeviceSynchronize());
    uint8_t wire[TDM_XFER_RMEM_WIRE];
    if (read(rfd, wire, sizeof(wire)) != (ssize_t)sizeof(wire)) return 1;
    struct tdm_xfer_rmem r;
    void *dstv;
    if (tdm_xfer_rmem_unpack(wire, sizeof(wire), &r) != TDM_OK ||
        tdm_xfer_cuda_open(&r, &dstv) != TDM_OK) {
        fprintf(stderr, "open: %s\n", tdm_err_msg());
        return 1;
    }
    uint8_t *dst = (uint8_t *)dstv;
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));

    /* reference: large copies into the mapping */
    const size_t big = 256ull << 20;
    float best_ms = 1e30f;
    for (int i = 0; i < 6; i++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(dst, src, big, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i && ms < best_ms) best_ms = ms;
    }
    double ref_gbs = big / (best_ms * 1e-3) / 1e9;
    printf("reference: one %zu MiB cudaMemcpyAsync: %.1f GB/s\n", big >> 20, ref_gbs);
    /* naive: one cudaMemcpyAsync per 64 KiB page */
    {
        const uint32_t np = 2048;
        const size_t pb = 65536;
        CK(cudaEventRecord(e0, s));
        for (uint32_t i = 0; i < np; i++)
            CK(cudaMemcpyAsync(dst + ((i * 7919u) % np) * pb, src + i * pb, pb,
                               cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("naive: one cudaMemcpyAsync per 64 KiB page: %.1f GB/s\n",
               np * (double)pb / (ms * 1e-3) / 1e9);
    }

    tdm_xfer_cuda_t *xc;
    tdm_xfer_counters_t *counters;
    if (tdm_xfer_cuda_create(0, 16, &xc) != TDM_OK ||
        tdm_xfer_counters_create(64, 1024, &counters) != TDM_OK) {
        fprintf(stderr, "create: %s\n", tdm_err_msg());
        return 1;
    }
    uint8_t *hs = (uint8_t *)malloc(kRegion), *hd = (uint8_t *)malloc(kRegion);
    CK(cudaMemcpy(hs, src, kRegion, cudaMemcpyDeviceToHost));
    int failures = 0;
    double ratio64 = 0;
    const size_t sizes[] = {4096, 16384, 65536, 262144, 1048576};
    printf("%-10s %8s %12s %12s %8s %s\n", "page", "pages", "GB/s", "ref GB/s", "ratio", "check");
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        size_t pb = sizes[si];
        uint32_t region_pages = (uint32_t)(kRegion / pb);
        uint32_t np = (uint32_t)((128ull << 20) / pb); /* 128 MiB per write */
        if (np > 16384) np = 16384;
        uint32_t *sp = (uint32_t *)malloc(4ull * region_pages),
                 *dp = (uint32_t *)malloc(4ull * region_pages);
        for (uint32_t i = 0; i < region_pages; i++)
            sp[i] = dp[i] = i;
        shuffle(sp, region_pages);
        shuffle(dp, region_pages);
        struct tdm_xfer_pages pages = {sp, dp, np, pb, pb, pb, 0, 0};
        /* correctness: zeroed destination, one write, compare on the host */
        CK(cudaMemset(dst, 0, kRegion));
        CK(cudaDeviceSynchronize());
        struct fire f = {0, TDM_OK};
        int reps = 10;
        tdm_xfer_counters_arm(counters, (uint32_t)si, 1, (uint32_t)reps + 1, TDM_XFER_ANY_PEER,
                              20000, on_fire, &f);
        struct tdm_xfer_imm imm = {(uint32_t)si, 1, 0};
        if (tdm_xfer_cuda_write_pages(xc, src, kRegion, dst, kRegion, &pages, &imm, counters, NULL,
                                      NULL) != TDM_OK ||
            tdm_xfer_cuda_drain(xc, 20000) != TDM_OK) {
            fprintf(stderr, "write: %s\n", tdm_err_msg());
            return 1;
        }
        CK(cudaMemcpy(hd, dst, kRegion, cudaMemcpyDeviceToHost));
        uint32_t bad = 0;
        for (uint32_t i = 0; i < np; i++)
            bad += memcmp(hd + (size_t)dp[i] * pb, hs + (size_t)sp[i] * pb, pb) != 0;
        /* pages not in the list stay zero */
        uint8_t *written = (uint8_t *)calloc(region_pages, 1);
        for (uint32_t i = 0; i < np; i++)
            written[dp[i]] = 1;
        for (uint32_t p = 0; p < region_pages; p++)
            if (!written[p])
                for (size_t b = 0; b < pb; b += 4096)
                    if (hd[(size_t)p * pb + b]) {
                        bad++;
                        break;
                    }
        free(written);
        /* timing: reps writes back to back */
        CK(cudaEventRecord(e0, s));
        CK(cudaStreamSynchronize(s));
        uint64_t t0 = tdm_now_ns();
        for (int rep = 0; rep < reps; rep++) {
            imm.index = (uint32_t)rep + 1;
            tdm_status st;
            while ((st = tdm_xfer_cuda_write_pages(xc, src, kRegion, dst, kRegion, &pages, &imm,
                                                   counters, NULL, NULL)) == TDM_EAGAIN)
                tdm_xfer_cuda_poll(xc);
            if (st != TDM_OK) {
                fprintf(stderr, "write: %s\n", tdm_err_msg());
                return 1;
            }
        }
        if (tdm_xfer_cuda_drain(xc, 20000) != TDM_OK) return 1;
        double sec = (tdm_now_ns() - t0) * 1e-9;
        double gbs = (double)reps * np * pb / sec / 1e9;
        bool ok = bad == 0 && f.n == 1 && f.st == TDM_OK;
        failures += !ok;
        if (pb == 65536) ratio64 = gbs / ref_gbs;
        printf("%-10zu %8u %12.1f %12.1f %7.0f%% %s (bad pages %u, counter fired %d x %s)\n", pb,
               np, gbs, ref_gbs, 100 * gbs / ref_gbs, ok ? "ok" : "FAIL", bad, f.n,
               tdm_status_str(f.st));
        free(sp);
        free(dp);
    }
    printf("64 KiB pages: %.0f%% of the large-copy bandwidth (goal 70%%)\n", 100 * ratio64);
    tdm_xfer_cuda_destroy(xc);
    tdm_xfer_counters_destroy(counters);
    tdm_xfer_cuda_close(dst);
    char b = 1;
    if (write(wfd, &b, 1) != 1) return 1;
    int status = 0;
    waitpid(kid, &status, 0);
    free(hs);
    free(hd);
    printf("%s\n", failures || !WIFEXITED(status) || WEXITSTATUS(status) ? "FAILED" : "PASSED");
    return failures ? 1 : 0;
}

int main(void)
{
    int p2c[2], c2p[2];
    if (pipe(p2c) || pipe(c2p)) return 1;
    pid_t kid = fork(); /* before any CUDA call */
    if (kid < 0) return 1;
    if (kid == 0) {
        close(p2c[1]);
        close(c2p[0]);
        _exit(child(p2c[0], c2p[1]));
    }
    close(p2c[0]);
    close(c2p[1]);
    int rc = parent(c2p[0], p2c[1], kid);
    if (rc) kill(kid, SIGKILL);
    return rc;
}
