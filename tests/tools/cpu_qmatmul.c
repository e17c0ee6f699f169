/*
 * cpu_qmatmul: CPU time of the CPU backend's quantised matmul (int8 activations) at several batch
 * sizes, with the AMX int8 tiles off and on (src/backend/cpu/qdot_amx.c), for the matrix shapes
 * of the default model (SmolLM2-135M: 1536 x 576 gate/up, 576 x 1536 down, 576 x 576 q/o, a
 * sixth of the 49152 x 576 Q8_0 LM head). One thread, random weights with small finite scales,
 * each case repeated for 0.3 s of process CPU time (CLOCK_PROCESS_CPUTIME_ID: other processes on
 * a shared machine do not count). Each line prints a checksum of the outputs, which must not
 * change with the AMX setting (the tiles give the same bits).
 *
 * Built with the test tools (build/tests/tools/cpu_qmatmul).
 * Usage: cpu_qmatmul 0|1   (AMX off or on; on needs an AVX-512 CPU with AMX-INT8 and VNNI)
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* clock_gettime, as the project builds (-D_GNU_SOURCE) */
#endif
#include "backend/cpu/cpu_int.h"
#include "model/quant_int.h"
#include "tandem/backend.h"
#include "tandem/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double cpu_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    const bool amx = argc > 1 && atoi(argv[1]) != 0;
    const struct {
        int64_t rows, cols;
        enum tdm_dtype dt;
    } shapes[] = {{1536, 576, TDM_DTYPE_Q4_1},
                  {576, 1536, TDM_DTYPE_Q4_1},
                  {576, 576, TDM_DTYPE_Q4_1},
                  {8192, 576, TDM_DTYPE_Q8_0},
                  {1536, 576, TDM_DTYPE_Q4_0}};
    const int ns[] = {1, 4, 8, 16, 64, 512};
    const struct tdm_backend_cpu_opts o = {
        .n_threads = 1, .batch_invariant = true, .quant_activations = true};
    tdm_backend_t *b = NULL;
    if (tdm_backend_cpu_create_variant(&o, TDM_CPU_ISA_AVX512, true, &b) != TDM_OK ||
        tdm_cpu_amx_set(b, amx) != TDM_OK) {
        fprintf(stderr, "cpu_qmatmul: %s\n", tdm_err_msg());
        return 1;
    }
    srand(1);
    const uint16_t scale = tdm_f32_to_f16(0.01f);
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        struct tdm_weight w = {
            .dtype = shapes[s].dt, .rows = shapes[s].rows, .cols = shapes[s].cols};
        w.row_bytes = tdm_dtype_row_bytes(w.dtype, w.cols);
        const int64_t nb = w.cols / 32;
        const size_t bsz = w.row_bytes / (size_t)nb;
        uint8_t *data = tdm_alloc_aligned(w.row_bytes * (size_t)w.rows);
        for (size_t i = 0; i < w.row_bytes * (size_t)w.rows; i++)
            data[i] = (uint8_t)rand();
        for (int64_t r = 0; r < w.rows; r++)
            for (int64_t k = 0; k < nb; k++) {
                uint8_t *blk = data + (size_t)r * w.row_bytes + (size_t)k * bsz;
                memcpy(blk, &scale, 2);
                if (w.dtype == TDM_DTYPE_Q4_1) memcpy(blk + 2, &scale, 2);
            }
        w.data = data;
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const int n = ns[k];
            float *x = malloc(sizeof(float) * (size_t)n * (size_t)w.cols);
            float *out = malloc(sizeof(float) * (size_t)n * (size_t)w.rows);
            for (int64_t i = 0; i < n * w.cols; i++)
                x[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
            const double t0 = cpu_seconds();
            double spent = 0;
            int reps = 0;
            while ((spent = cpu_seconds() - t0) < 0.3) {
                b->iface->matmul(b, &w, x, n, NULL, out);
                reps++;
            }
            double sum = 0;
            for (int64_t i = 0; i < n * w.rows; i++)
                sum += out[i];
            printf("%s %5lld x %-5lld n=%3d amx=%d: %9.1f us/op %7.1f GOP/s  checksum %.9g\n",
                   tdm_dtype_name(w.dtype), (long long)w.rows, (long long)w.cols, n, (int)amx,
                   spent / reps * 1e6, 2.0 * (double)(w.rows * w.cols * n) * reps / spent * 1e-9,
                   sum);
            free(x);
            free(out);
        }
        tdm_free_aligned(data);
    }
    tdm_backend_destroy(b);
    return 0;
}
