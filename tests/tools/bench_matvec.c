/*
 * bench_matvec: times the CPU backend's n = 1 matmul (the decode matrix-vector product) for
 * each weight dtype and reports the weight bytes streamed per second, next to two memory
 * rooflines measured in the same run: memcpy (one thread, bytes copied per second) and a
 * parallel read (4 streams per thread, like a 4-row tile) over the backend's thread count.
 *
 * So that weights come from DRAM as in decode (where ~100 MB of weights cycle through a 32 MB
 * L3), each shape is replicated into enough copies to exceed 256 MB and the copies are used in
 * turn. Each line prints a checksum of the outputs so that a fast wrong kernel shows, and the
 * rate by process CPU time beside the wall-clock one (on a shared machine the wall clock also
 * counts the time other processes held the core; CPU time divided over the threads does not).
 *
 * Usage: bench_matvec [n_threads (default: all cores)] [seconds per case (default 0.5)] [quant]
 * Honours TANDEM_CPU_ISA and TANDEM_CPU_VNNI like the backend. "quant": Q8_0/Q4_0/Q4_1/Q4_K/
 * Q6_K on int8 activations (the backend's quant_activations; the activation row's quantisation
 * is in the time); without it the K-quants run the portable fp32 tile, so they are left out.
 * Shapes: SmolLM2-135M's MLP (1536 x 576, 576 x 1536), its LM head (49152 x 576), and 4096 x
 * 4096; the K-quants only where the columns are whole super-blocks of 256.
 */
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"
#include "tandem/backend.h"
#include "tandem/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MIN_BYTES (256u << 20)

static uint64_t rng = 88172645463325252ull;
static uint8_t rnd_byte(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint8_t)(rng >> 32);
}

/* Random weight bytes with sane (small, finite) scales. */
static void fill_weight(enum tdm_dtype dt, uint8_t *p, int64_t rows, int64_t cols)
{
    const size_t rb = tdm_dtype_row_bytes(dt, cols);
    for (size_t i = 0; i < rb * (size_t)rows; i++)
        p[i] = rnd_byte();
    const uint16_t scale = tdm_f32_to_f16(0.01f);
    const uint16_t bf = tdm_f32_to_bf16(0.01f);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *row = p + (size_t)r * rb;
        for (int64_t b = 0; b < cols / 32; b++) {
            switch (dt) {
            case TDM_DTYPE_Q8_0:
                memcpy(row + b * 34, &scale, 2);
                break;
            case TDM_DTYPE_Q4_0:
                memcpy(row + b * 18, &scale, 2);
                break;
            case TDM_DTYPE_Q4_1:
                memcpy(row + b * 20, &scale, 2);
                memcpy(row + b * 20 + 2, &scale, 2);
                break;
            default:
                break;
            }
        }
        for (int64_t b = 0; b < cols / 256; b++) {
            if (dt == TDM_DTYPE_Q4_K) {
                memcpy(row + b * sizeof(struct block_q4_K), &scale, 2);
                memcpy(row + b * sizeof(struct block_q4_K) + 2, &scale, 2);
            }
            if (dt == TDM_DTYPE_Q6_K)
                memcpy(row + b * sizeof(struct block_q6_K) + offsetof(struct block_q6_K, d), &scale,
                       2);
        }
        if (dt == TDM_DTYPE_F32)
            for (int64_t c = 0; c < cols; c++) {
                const float f = (float)((int)rnd_byte() - 128) / 128.0f;
                memcpy(row + 4 * c, &f, 4);
            }
        if (dt == TDM_DTYPE_BF16)
            for (int64_t c = 0; c < cols; c++)
                memcpy(row + 2 * c, &bf, 2);
    }
}

struct read_job {
    const uint64_t *p;
    int64_t n;
    uint64_t sums[64];
};

/* Sums this thread's share of the buffer as 4 interleaved streams (one per quarter), the
 * access pattern of a 4-row matvec tile, so that the roofline gets the same prefetcher help. */
static void read_worker(void *ctx, int ith, int nth)
{
    struct read_job *job = ctx;
    int64_t i0, i1;
    tdm_split_range(job->n, ith, nth, 64, &i0, &i1);
    const int64_t quarter = (i1 - i0) / 4 / 8 * 8;
    const uint64_t *p[4];
    for (int s = 0; s < 4; s++)
        p[s] = job->p + i0 + s * quarter;
    uint64_t acc[8] = {0};
    for (int64_t i = 0; i < quarter; i += 8)
        for (int s = 0; s < 4; s++)
            for (int k = 0; k < 8; k++)
                acc[k] += p[s][i + k];
    uint64_t sum = 0;
    for (int k = 0; k < 8; k++)
        sum += acc[k];
    job->sums[ith % 64] = sum;
}

int main(int argc, char **argv)
{
    const int n_threads = argc > 1 ? atoi(argv[1]) : 0;
    const double secs = argc > 2 ? atof(argv[2]) : 0.5;
    struct tdm_backend_cpu_opts opts = {.n_threads = n_threads,
                                        .quant_activations = argc > 3 && !strcmp(argv[3], "quant")};
    tdm_backend_t *b = NULL;
    if (tdm_backend_cpu_create(&opts, &b) != TDM_OK) {
        fprintf(stderr, "backend: %s\n", tdm_err_msg());
        return 1;
    }
    struct tdm_cpu *cpu = tdm_cpu_of(b);
    printf("bench_matvec: isa %s, %d threads\n", cpu->k->name, cpu->n_threads);

    /* rooflines */
    const size_t rbytes = MIN_BYTES;
    uint8_t *src = tdm_alloc_aligned(rbytes), *dst = tdm_alloc_aligned(rbytes);
    if (!src || !dst) return 1;
    memset(src, 1, rbytes);
    memset(dst, 2, rbytes);
    double best_cp = 0, best_rd = 0;
    struct read_job rj = {.p = (const uint64_t *)src, .n = (int64_t)(rbytes / 8)};
    for (int rep = 0; rep < 5; rep++) {
        double t0 = tdm_now_s();
        memcpy(dst, src, rbytes);
        double t = tdm_now_s() - t0;
        if (rbytes / t > best_cp) best_cp = rbytes / t;
        t0 = tdm_now_s();
        tdm_pool_run(cpu->pool, read_worker, &rj);
        t = tdm_now_s() - t0;
        if (rbytes / t > best_rd) best_rd = rbytes / t;
    }
    uint64_t rsum = 0;
    for (int i = 0; i < 64; i++)
        rsum += rj.sums[i];
    printf("memcpy (1 thread):       %6.2f GB/s copied\n", best_cp / 1e9);
    printf("read (%d threads):        %6.2f GB/s  [checksum %llx]\n", cpu->n_threads, best_rd / 1e9,
           (unsigned long long)rsum);
    tdm_free_aligned(dst);
    tdm_free_aligned(src);

    const struct {
        int64_t rows, cols;
    } shapes[] = {{1536, 576}, {576, 1536}, {49152, 576}, {4096, 4096}};
    const enum tdm_dtype dts[] = {TDM_DTYPE_F32,  TDM_DTYPE_BF16, TDM_DTYPE_Q8_0, TDM_DTYPE_Q4_0,
                                  TDM_DTYPE_Q4_1, TDM_DTYPE_Q4_K, TDM_DTYPE_Q6_K};
    printf("%-6s %11s %9s %9s %9s %9s  %s\n", "dtype", "rows x cols", "MB/mat", "us/call", "GB/s",
           "cpu GB/s", "checksum");
    for (size_t s = 0; s < TDM_ARRAY_LEN(shapes); s++) {
        for (size_t d = 0; d < TDM_ARRAY_LEN(dts); d++) {
            const int64_t rows = shapes[s].rows, cols = shapes[s].cols;
            const bool kq = dts[d] == TDM_DTYPE_Q4_K || dts[d] == TDM_DTYPE_Q6_K;
            if (kq && (cols % 256 || !opts.quant_activations)) continue;
            const size_t rb = tdm_dtype_row_bytes(dts[d], cols);
            const size_t mat = rb * (size_t)rows;
            const int copies = (int)((MIN_BYTES + mat - 1) / mat);
            uint8_t *w = tdm_alloc_aligned(mat * (size_t)copies);
            float *x = tdm_alloc_aligned((size_t)cols * sizeof(float));
            float *out = tdm_alloc_aligned((size_t)rows * sizeof(float));
            if (!w || !x || !out) return 1;
            for (int c = 0; c < copies; c++)
                fill_weight(dts[d], w + (size_t)c * mat, rows, cols);
            for (int64_t c = 0; c < cols; c++)
                x[c] = (float)((c % 17) - 8) / 8.0f;
            struct tdm_weight wt = {
                .dtype = dts[d], .rows = rows, .cols = cols, .row_bytes = rb, .data = w};
            /* warm-up pass over all copies */
            for (int c = 0; c < copies; c++) {
                wt.data = w + (size_t)c * mat;
                b->iface->matmul(b, &wt, x, 1, NULL, out);
            }
            int64_t calls = 0;
            const clock_t c0 = clock();
            const double t0 = tdm_now_s();
            double t = 0;
            do {
                for (int c = 0; c < copies; c++, calls++) {
                    wt.data = w + (size_t)c * mat;
                    b->iface->matmul(b, &wt, x, 1, NULL, out);
                }
                t = tdm_now_s() - t0;
            } while (t < secs);
            /* checksum: the last copy's output (copies differ, so the pass order shows too) */
            double checksum = 0;
            for (int64_t r = 0; r < rows; r++)
                checksum += out[r];
            const double cpu_s = (double)(clock() - c0) / CLOCKS_PER_SEC;
            printf("%-6s %5lld x %-5lld %9.2f %9.1f %9.2f %9.2f  %.6g\n", tdm_dtype_name(dts[d]),
                   (long long)rows, (long long)cols, mat / 1e6, t / calls * 1e6,
                   (double)mat * calls / t / 1e9, (double)mat * calls / cpu_s / 1e9, checksum);
            tdm_free_aligned(out);
            tdm_free_aligned(x);
            tdm_free_aligned(w);
        }
    }
    tdm_backend_destroy(b);
    return 0;
}
