/*
 * tandem core: status codes, error messages, logging, arenas, a thread pool, time and the
 * counter-based RNG. Every other module depends on this one and on nothing else of ours.
 *
 * Errors: functions return `tdm_status` (TDM_OK = 0, negative on error). The function that
 * detects an error also records a human-readable message with tdm_err_set(); the caller reads it
 * with tdm_err_msg(). The message lives in thread-local storage, so it is valid on the thread
 * that saw the error until that thread's next tdm_err_set().
 *
 * Threading: logging and tdm_err_* are thread-safe. A tdm_pool is driven by one thread at a time
 * (the thread that calls tdm_pool_run); its workers spin briefly between jobs, then sleep.
 * Arenas are single-threaded.
 */
#ifndef TANDEM_CORE_H
#define TANDEM_CORE_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status ---- */
typedef enum tdm_status {
    TDM_OK = 0,
    TDM_EINVAL = -1,    /* bad argument or malformed input */
    TDM_ENOMEM = -2,    /* allocation failed or a pool is exhausted */
    TDM_EIO = -3,       /* file or socket I/O failed */
    TDM_ENOTFOUND = -4, /* a key, tensor, file or token does not exist */
    TDM_EFORMAT = -5,   /* bytes from a file or peer do not follow the format */
    TDM_EUNSUPPORTED = -6,
    TDM_ERANGE = -7, /* a value or size past a documented cap */
    TDM_EAGAIN = -8, /* backpressure: try again later */
    TDM_ETIMEDOUT = -9,
    TDM_ECANCELED = -10,
    TDM_EPEER = -11, /* the remote side failed or went away */
    TDM_EINTERNAL = -12,
    TDM_EUNREACHABLE = -13, /* a peer's memory cannot be reached from here (another host) */
} tdm_status;

const char *tdm_status_str(tdm_status st);

/* Records a formatted message for the calling thread and returns `st`, so that
 * `return tdm_err_set(TDM_EFORMAT, "bad magic %x", m);` reads naturally. */
tdm_status tdm_err_set(tdm_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's last message ("" if none). */
const char *tdm_err_msg(void);

/* ---- a growing string, for text renderers (metrics, logs); OOM is sticky ---- */
struct tdm_sbuf {
    char *s;
    size_t len, cap;
    bool oom;
};
void tdm_sbuf_printf(struct tdm_sbuf *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The string (malloc'd, caller frees), or NULL after an allocation failure; resets b. */
char *tdm_sbuf_take(struct tdm_sbuf *b);

/* ---- logging: level from $TANDEM_LOG (error, warn, info, debug); default info. To stderr. ---- */
enum tdm_log_level { TDM_LOG_ERROR = 0, TDM_LOG_WARN, TDM_LOG_INFO, TDM_LOG_DEBUG };
void tdm_log(enum tdm_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool tdm_log_enabled(enum tdm_log_level lvl);
void tdm_log_set_level(enum tdm_log_level lvl);
#define TDM_ERROR(...) tdm_log(TDM_LOG_ERROR, __VA_ARGS__)
#define TDM_WARN(...)  tdm_log(TDM_LOG_WARN, __VA_ARGS__)
#define TDM_INFO(...)  tdm_log(TDM_LOG_INFO, __VA_ARGS__)
#define TDM_DEBUG(...) tdm_log(TDM_LOG_DEBUG, __VA_ARGS__)

/* Always on. For programmer errors only: never for bytes from a file, socket or peer. */
#define TDM_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) tdm_assert_fail(#cond, __FILE__, __LINE__);                                   \
    } while (0)
#ifdef __cplusplus
[[noreturn]] void tdm_assert_fail(const char *expr, const char *file, int line);
#else
_Noreturn void tdm_assert_fail(const char *expr, const char *file, int line);
#endif

#define TDM_MIN(a, b)    ((a) < (b) ? (a) : (b))
#define TDM_MAX(a, b)    ((a) > (b) ? (a) : (b))
#define TDM_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- memory ---- */
/* 64-byte aligned allocation; NULL on failure. Release with tdm_free_aligned (NULL is a no-op). */
void *tdm_alloc_aligned(size_t bytes);
void tdm_free_aligned(void *p);

/* Bump allocator over one buffer reserved up front. Per-step scratch: reset every step. */
struct tdm_arena {
    uint8_t *base;
    size_t cap_bytes;
    size_t used_bytes;
    size_t high_water_bytes;
};
tdm_status tdm_arena_init(struct tdm_arena *a, size_t cap_bytes);
void tdm_arena_free(struct tdm_arena *a); /* safe on a zeroed arena */
/* 64-byte aligned; NULL (and an error message) when the arena is full. */
void *tdm_arena_alloc(struct tdm_arena *a, size_t bytes);
void tdm_arena_reset(struct tdm_arena *a);

/* ---- files ---- */
/* Read-only memory map of a whole file. */
struct tdm_mmap {
    const uint8_t *data;
    size_t size;
};
tdm_status tdm_mmap_open(const char *path, struct tdm_mmap *out);
void tdm_mmap_close(struct tdm_mmap *m);
/* Reads a whole file into a malloc'd NUL-terminated buffer, refusing files over max_bytes. */
tdm_status tdm_file_read(const char *path, size_t max_bytes, char **out, size_t *out_len);

/* ---- time ---- */
uint64_t tdm_now_ns(void); /* CLOCK_MONOTONIC */
/* The absolute time `ms` milliseconds from now on `clock`, for pthread_cond_timedwait:
 * CLOCK_REALTIME for a default condition variable, CLOCK_MONOTONIC for one whose attribute
 * says so. ms < 0 counts as 0. */
struct timespec tdm_deadline_ms(clockid_t clock, int64_t ms);
double tdm_now_s(void);
/* Initialises a condition variable whose timed waits take CLOCK_MONOTONIC deadlines. */
void tdm_cond_init_monotonic(pthread_cond_t *cv);

/* ---- thread pool ----
 * tdm_pool_run(pool, fn, ctx) calls fn(ctx, ith, nth) on nth threads (the caller is thread 0)
 * and returns when all have finished. Work split by index is deterministic: a given ith always
 * covers the same part of the work, whatever the timing. */
typedef struct tdm_pool tdm_pool_t;
typedef void (*tdm_pool_fn)(void *ctx, int ith, int nth);
/* n_threads <= 0 means one per online core. */
tdm_status tdm_pool_create(int n_threads, tdm_pool_t **out);
void tdm_pool_destroy(tdm_pool_t *pool);
int tdm_pool_size(const tdm_pool_t *pool);
void tdm_pool_run(tdm_pool_t *pool, tdm_pool_fn fn, void *ctx);
/* The [begin, end) share of thread ith out of nth for n items, in chunks aligned to `align`. */
void tdm_split_range(int64_t n, int ith, int nth, int64_t align, int64_t *begin, int64_t *end);
int tdm_cpu_count(void);

/* ---- hashing: one 64-bit value folded into a running hash (boost's combine, then a
 * splitmix-style finaliser), for chained keys of token blocks (the prefix cache's page keys,
 * the router's KV index) ---- */
static inline uint64_t tdm_hash_mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return h;
}

/* ---- counter-based RNG (Philox4x32-10) ----
 * A draw depends only on (seed, request id, absolute position, draw index), never on batch
 * composition or call order, so the same seed gives the same tokens with or without
 * speculation, batching or disaggregation (DESIGN.md §7). */
void tdm_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
/* Uniform double in [0, 1) with 53 random bits. */
double tdm_rng_uniform(uint64_t seed, uint64_t request_id, uint32_t position, uint32_t draw);

/* ---- where memory lives (ggml's buffer types play this part) ----
 * Every buffer that crosses a module boundary (a backend's buffers, the KV pool, a transfer
 * engine's registrations) says where it is, so nothing has to assume host memory. */
enum tdm_mem_kind {
    TDM_MEM_HOST = 0,        /* pageable host memory */
    TDM_MEM_HOST_PINNED = 1, /* page-locked host memory a device can reach */
    TDM_MEM_DEVICE = 2,      /* device memory of accelerator `device` */
};
struct tdm_mem_place {
    enum tdm_mem_kind kind;
    int device; /* TDM_MEM_DEVICE: the device ordinal; otherwise 0 */
};
const char *tdm_mem_kind_name(enum tdm_mem_kind k); /* "host", "pinned", "device" */
/* A buffer that knows where it lives: what a backend hands out (tdm_backend_buf_new) for
 * activations, the KV pool and speculation's distributions. ptr may only be dereferenced on
 * the host when place.kind is not TDM_MEM_DEVICE. */
struct tdm_buf {
    void *ptr;
    size_t bytes;
    struct tdm_mem_place place;
};

/* ---- small helpers ---- */
/* Parses a decimal integer in [lo, hi]; false on junk, overflow or out of range. */
bool tdm_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
bool tdm_parse_f64(const char *s, double *out);
/* How long a thread waiting for its next job or a barrier spins before it sleeps: dflt_ns, or
 * $TANDEM_POOL_SPIN_US microseconds (0 to 100000) when set. TDM_EINVAL, with a message, when
 * the variable is set but malformed. Spinning pays when each thread has a core of its own; where
 * processes share fewer cores than they have threads, spinners take the cores the working
 * threads need. */
tdm_status tdm_spin_ns(uint64_t dflt_ns, uint64_t *out);
/* One symbol for tdm_dl_load: its name, the version to bind it at (NULL or "": the library's
 * default), and the function pointer its address is written into. */
struct tdm_dl_sym {
    const char *name;
    const char *version;
    void *dst;
};
/* Opens the shared library soname (the normal search: LD_LIBRARY_PATH, RUNPATH, ld.so.cache;
 * then dir/soname where dir is not NULL) and looks up the n symbols; the library stays open.
 * False, with why filled (the search's reason, or the missing symbol), when either fails. */
bool tdm_dl_load(const char *soname, const char *dir, const struct tdm_dl_sym *syms, int n,
                 char *why, size_t why_len);

/* bf16 / fp16 conversions (round to nearest even for the narrowing ones). */
float tdm_bf16_to_f32(uint16_t h);
uint16_t tdm_f32_to_bf16(float f);
float tdm_f16_to_f32(uint16_t h);
uint16_t tdm_f32_to_f16(float f);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_CORE_H */
