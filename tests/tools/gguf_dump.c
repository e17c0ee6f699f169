/*
 * gguf_dump: test helper that opens a GGUF file with tandem's reader and writes one tensor,
 * dequantised by tdm_dequantize, as raw little-endian float32 (ne[0] fastest), so Python tests
 * can compare it with gguf-py's dequantiser.
 *
 *   gguf_dump FILE TENSOR_NAME OUT.f32   dequantise one tensor
 *   gguf_dump FILE                       list tensors: name dtype ne0 ne1 ne2 ne3 nbytes
 *
 * Exit status 0 on success, 1 with a message on stderr on any error.
 */
#include "tandem/model.h"

#include <stdio.h>
#include <stdlib.h>

static int fail(const char *what, tdm_status st)
{
    fprintf(stderr, "gguf_dump: %s: %s (%s)\n", what, tdm_err_msg(), tdm_status_str(st));
    return 1;
}

static int list_tensors(const tdm_gguf_t *g)
{
    for (int64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const struct tdm_tensor_info *t = tdm_gguf_tensor(g, i);
        printf("%s %s %lld %lld %lld %lld %zu\n", t->name, tdm_dtype_name(t->dtype),
               (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
               t->nbytes);
    }
    return 0;
}

static int dump_tensor(const tdm_gguf_t *g, const char *name, const char *out_path)
{
    const struct tdm_tensor_info *t = tdm_gguf_find_tensor(g, name);
    if (!t) {
        fprintf(stderr, "gguf_dump: no tensor '%s'\n", name);
        return 1;
    }
    int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    float *buf = malloc((size_t)n * sizeof *buf);
    if (!buf) {
        fprintf(stderr, "gguf_dump: out of memory for %lld floats\n", (long long)n);
        return 1;
    }
    int rc = 1;
    tdm_status st = tdm_dequantize(t->dtype, t->data, buf, n);
    if (st) {
        rc = fail(name, st);
        goto out_free_buf;
    }
    FILE *f = fopen(out_path, "wb");
    if (!f) {
        perror(out_path);
        goto out_free_buf;
    }
    size_t written = fwrite(buf, sizeof *buf, (size_t)n, f);
    if (fclose(f) != 0 || written != (size_t)n) {
        fprintf(stderr, "gguf_dump: %s: write failed\n", out_path);
        goto out_free_buf;
    }
    rc = 0;
out_free_buf:
    free(buf);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: gguf_dump FILE [TENSOR_NAME OUT.f32]\n");
        return 2;
    }
    tdm_gguf_t *g = NULL;
    tdm_status st = tdm_gguf_open(argv[1], &g);
    if (st) return fail(argv[1], st);
    int rc = argc == 2 ? list_tensors(g) : dump_tensor(g, argv[2], argv[3]);
    tdm_gguf_close(g);
    return rc;
}
