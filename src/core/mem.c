/*
 * Aligned allocation, the bump arena, read-only file maps and whole-file reads.
 * None of this is thread-safe by itself; an arena belongs to one thread.
 */
#include "tandem/core.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void *tdm_alloc_aligned(size_t bytes)
{
    void *p = NULL;
    if (bytes == 0) bytes = 64;
    if (posix_memalign(&p, 64, (bytes + 63) & ~(size_t)63) != 0) return NULL;
    return p;
}

void tdm_free_aligned(void *p)
{
    free(p);
}

tdm_status tdm_arena_init(struct tdm_arena *a, size_t cap_bytes)
{
    memset(a, 0, sizeof *a);
    a->base = tdm_alloc_aligned(cap_bytes);
    if (!a->base) return tdm_err_set(TDM_ENOMEM, "arena: cannot reserve %zu bytes", cap_bytes);
    a->cap_bytes = cap_bytes;
    return TDM_OK;
}

void tdm_arena_free(struct tdm_arena *a)
{
    if (!a) return;
    tdm_free_aligned(a->base);
    memset(a, 0, sizeof *a);
}

void *tdm_arena_alloc(struct tdm_arena *a, size_t bytes)
{
    size_t start = (a->used_bytes + 63) & ~(size_t)63;
    if (start > a->cap_bytes || bytes > a->cap_bytes - start) {
        tdm_err_set(TDM_ENOMEM, "arena: %zu bytes requested, %zu of %zu used", bytes, a->used_bytes,
                    a->cap_bytes);
        return NULL;
    }
    a->used_bytes = start + bytes;
    if (a->used_bytes > a->high_water_bytes) a->high_water_bytes = a->used_bytes;
    return a->base + start;
}

void tdm_arena_reset(struct tdm_arena *a)
{
    a->used_bytes = 0;
}

tdm_status tdm_mmap_open(const char *path, struct tdm_mmap *out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return tdm_err_set(TDM_EIO, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return tdm_err_set(TDM_EIO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return tdm_err_set(TDM_EIO, "%s: not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return tdm_err_set(TDM_EFORMAT, "%s: empty file", path);
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return tdm_err_set(TDM_EIO, "%s: mmap: %s", path, strerror(e));
    out->data = p;
    out->size = (size_t)st.st_size;
    return TDM_OK;
}

void tdm_mmap_close(struct tdm_mmap *m)
{
    if (!m || !m->data) return;
    munmap((void *)m->data, m->size);
    m->data = NULL;
    m->size = 0;
}

tdm_status tdm_file_read(const char *path, size_t max_bytes, char **out, size_t *out_len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return tdm_err_set(TDM_EIO, "%s: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    tdm_status st = TDM_OK;
    if (!buf) {
        st = tdm_err_set(TDM_ENOMEM, "%s: out of memory", path);
        goto out_close;
    }
    for (;;) {
        if (len == cap) {
            if (cap >= max_bytes) {
                st = tdm_err_set(TDM_ERANGE, "%s: larger than %zu bytes", path, max_bytes);
                goto out_free;
            }
            size_t ncap = TDM_MIN(cap * 2, max_bytes);
            char *nb = realloc(buf, ncap + 1);
            if (!nb) {
                st = tdm_err_set(TDM_ENOMEM, "%s: out of memory", path);
                goto out_free;
            }
            buf = nb;
            cap = ncap;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) break;
    }
    if (ferror(f)) {
        st = tdm_err_set(TDM_EIO, "%s: read error", path);
        goto out_free;
    }
    buf[len] = '\0';
    fclose(f);
    *out = buf;
    if (out_len) *out_len = len;
    return TDM_OK;
out_free:
    free(buf);
out_close:
    fclose(f);
    return st;
}
