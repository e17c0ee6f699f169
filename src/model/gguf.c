/*
 * GGUF reader (versions 2 and 3): parses the header, the metadata key/value pairs and the
 * tensor table of a memory-mapped (or caller-held) image, and hands out pointers into it.
 *
 * File layout (all little-endian):
 *   "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv   x { str key | u32 type | value }            value: scalar, str, or
 *                                                      u32 elem_type | u64 n | n elements
 *   n_tensors x { str name | u32 n_dims | u64 ne[n_dims] | u32 dtype | u64 offset }
 *   padding to general.alignment (default 32) | tensor data (offsets relative to here)
 *   where str = u64 length | bytes (no NUL).
 *
 * Why shaped this way: the whole image is parsed and validated once at open, so every later
 * accessor is a lookup that cannot fail on bad bytes. Bytes are read with memcpy through a
 * bounds-checked cursor (never an unaligned pointer cast), every count is checked against
 * the bytes left before anything is allocated for it, so the memory we allocate is bounded
 * by a small multiple of the file size whatever the header claims. Keys and tensor names go
 * into open-addressing hash tables, which both reject duplicates and make lookups O(1).
 *
 * Invariants after a successful open: every kv's value lies inside the image; string-array
 * element offsets are precomputed and in range; every tensor has 1..4 dims, all > 0, a known
 * dtype, ne[0] a multiple of the block size, an aligned offset, and data inside the image;
 * tensor names are NUL-terminated copies with no embedded NUL.
 *
 * Threading: open/close are single-threaded; an open handle is read-only and may be shared.
 */
#include "tandem/model.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGUF_MAGIC_BYTES    "GGUF"
#define GGUF_HEADER_BYTES   24
#define GGUF_DEFAULT_ALIGN  32
#define GGUF_MAX_KV         (1 << 20)
#define GGUF_MAX_TENSORS    (1 << 20)
#define GGUF_MAX_DIMS       4
#define GGUF_MAX_NAME_BYTES 256
/* Smallest possible encodings, used to bound counts by the bytes left:
 * kv = key length + 1-byte key + type + 1-byte value; tensor = name length + 1-byte name +
 * n_dims + one dim + dtype + offset. */
#define GGUF_MIN_KV_BYTES     (8 + 1 + 4 + 1)
#define GGUF_MIN_TENSOR_BYTES (8 + 1 + 4 + 8 + 4 + 8)

struct gguf_kv {
    struct tdm_str key;
    enum tdm_gguf_type type;
    const uint8_t *val;           /* scalar value, or first array element; in the image */
    struct tdm_str str;           /* TDM_GGUF_STRING */
    enum tdm_gguf_type elem_type; /* TDM_GGUF_ARRAY */
    int64_t n;                    /* TDM_GGUF_ARRAY: element count */
    uint64_t *str_offs;           /* string arrays: [n] offset from val of element i */
};

struct gguf_tensor {
    struct tdm_tensor_info info; /* info.name points into tdm_gguf.names */
    struct tdm_str raw_name;     /* the name in the image */
    uint64_t offset;             /* from the start of the data section */
};

struct tdm_gguf {
    struct tdm_mmap map; /* zeroed for tdm_gguf_open_memory images */
    const uint8_t *data;
    size_t size;
    uint32_t version;
    uint64_t alignment;
    int64_t n_kv;
    struct gguf_kv *kvs; /* [n_kv] */
    int64_t n_tensors;
    struct gguf_tensor *tensors; /* [n_tensors] */
    char *names;                 /* tensor names back to back, each NUL-terminated */
    uint32_t *kv_slots;          /* [kv_cap] index + 1 into kvs, 0 = empty */
    size_t kv_cap;
    uint32_t *tensor_slots; /* [tensor_cap] index + 1 into tensors, 0 = empty */
    size_t tensor_cap;
};

/* ---- bounds-checked little-endian cursor ---- */
struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos;
};

static size_t cur_left(const struct cursor *c)
{
    return c->size - c->pos;
}

static bool cur_take(struct cursor *c, uint64_t n, const uint8_t **out)
{
    if (n > cur_left(c)) return false;
    *out = c->base + c->pos;
    c->pos += (size_t)n;
    return true;
}

static bool cur_u32(struct cursor *c, uint32_t *v)
{
    const uint8_t *p;
    if (!cur_take(c, 4, &p)) return false;
    memcpy(v, p, 4);
    return true;
}

static bool cur_u64(struct cursor *c, uint64_t *v)
{
    const uint8_t *p;
    if (!cur_take(c, 8, &p)) return false;
    memcpy(v, p, 8);
    return true;
}

static bool cur_str(struct cursor *c, struct tdm_str *s)
{
    uint64_t len;
    const uint8_t *p;
    if (!cur_u64(c, &len) || !cur_take(c, len, &p)) return false;
    s->ptr = (const char *)p;
    s->len = (size_t)len;
    return true;
}

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "tandem reads GGUF on little-endian hosts");

/* ---- value types ---- */

/* Bytes of a fixed-size value type; 0 for string, array and unknown ids. */
static size_t scalar_bytes(uint32_t t)
{
    switch (t) {
    case TDM_GGUF_U8:
    case TDM_GGUF_I8:
    case TDM_GGUF_BOOL:
        return 1;
    case TDM_GGUF_U16:
    case TDM_GGUF_I16:
        return 2;
    case TDM_GGUF_U32:
    case TDM_GGUF_I32:
    case TDM_GGUF_F32:
        return 4;
    case TDM_GGUF_U64:
    case TDM_GGUF_I64:
    case TDM_GGUF_F64:
        return 8;
    default:
        return 0;
    }
}

static const char *type_name(uint32_t t)
{
    static const char *const names[] = {"u8",   "i8",  "u16",   "i16", "u32", "i32", "f32",
                                        "bool", "str", "array", "u64", "i64", "f64"};
    return t < TDM_ARRAY_LEN(names) ? names[t] : "unknown";
}

/* ---- hash tables of names: FNV-1a, linear probing ---- */

static uint64_t hash_bytes(const char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static size_t table_cap(int64_t n)
{
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    return cap;
}

static bool str_eq(struct tdm_str a, const char *b, size_t b_len)
{
    return a.len == b_len && memcmp(a.ptr, b, b_len) == 0;
}

static int64_t kv_lookup(const tdm_gguf_t *g, const char *key, size_t len)
{
    if (!g->kv_slots) return -1;
    size_t mask = g->kv_cap - 1;
    for (size_t s = hash_bytes(key, len) & mask;; s = (s + 1) & mask) {
        uint32_t slot = g->kv_slots[s];
        if (slot == 0) return -1;
        if (str_eq(g->kvs[slot - 1].key, key, len)) return (int64_t)slot - 1;
    }
}

static int64_t tensor_lookup(const tdm_gguf_t *g, const char *name, size_t len)
{
    if (!g->tensor_slots) return -1;
    size_t mask = g->tensor_cap - 1;
    for (size_t s = hash_bytes(name, len) & mask;; s = (s + 1) & mask) {
        uint32_t slot = g->tensor_slots[s];
        if (slot == 0) return -1;
        if (str_eq(g->tensors[slot - 1].raw_name, name, len)) return (int64_t)slot - 1;
    }
}

/* Prints at most 64 bytes of a name from the file, for messages. */
#define NAME_FMT    "'%.*s%s'"
#define NAME_ARG(s) (int)TDM_MIN((s).len, 64), (s).ptr, ((s).len > 64 ? "..." : "")

static tdm_status build_kv_table(tdm_gguf_t *g)
{
    g->kv_cap = table_cap(g->n_kv);
    g->kv_slots = calloc(g->kv_cap, sizeof *g->kv_slots);
    if (!g->kv_slots) return tdm_err_set(TDM_ENOMEM, "gguf: out of memory for the key table");
    size_t mask = g->kv_cap - 1;
    for (int64_t i = 0; i < g->n_kv; i++) {
        struct tdm_str k = g->kvs[i].key;
        size_t s = hash_bytes(k.ptr, k.len) & mask;
        for (; g->kv_slots[s]; s = (s + 1) & mask) {
            if (str_eq(g->kvs[g->kv_slots[s] - 1].key, k.ptr, k.len))
                return tdm_err_set(TDM_EFORMAT, "gguf: duplicate key " NAME_FMT, NAME_ARG(k));
        }
        g->kv_slots[s] = (uint32_t)(i + 1);
    }
    return TDM_OK;
}

static tdm_status build_tensor_table(tdm_gguf_t *g)
{
    g->tensor_cap = table_cap(g->n_tensors);
    g->tensor_slots = calloc(g->tensor_cap, sizeof *g->tensor_slots);
    if (!g->tensor_slots)
        return tdm_err_set(TDM_ENOMEM, "gguf: out of memory for the tensor table");
    size_t mask = g->tensor_cap - 1;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct tdm_str k = g->tensors[i].raw_name;
        size_t s = hash_bytes(k.ptr, k.len) & mask;
        for (; g->tensor_slots[s]; s = (s + 1) & mask) {
            if (str_eq(g->tensors[g->tensor_slots[s] - 1].raw_name, k.ptr, k.len))
                return tdm_err_set(TDM_EFORMAT, "gguf: duplicate tensor name " NAME_FMT,
                                   NAME_ARG(k));
        }
        g->tensor_slots[s] = (uint32_t)(i + 1);
    }
    return TDM_OK;
}

/* ---- parsing ---- */

static tdm_status parse_array(struct cursor *c, struct gguf_kv *kv)
{
    uint32_t elem;
    uint64_t n;
    if (!cur_u32(c, &elem) || !cur_u64(c, &n))
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": truncated array header",
                           NAME_ARG(kv->key));
    if (elem == TDM_GGUF_ARRAY)
        return tdm_err_set(TDM_EUNSUPPORTED, "gguf: key " NAME_FMT ": nested arrays",
                           NAME_ARG(kv->key));
    kv->elem_type = (enum tdm_gguf_type)elem;
    kv->val = c->base + c->pos;
    if (elem == TDM_GGUF_STRING) {
        /* each element takes at least its 8-byte length */
        if (n > cur_left(c) / 8)
            return tdm_err_set(TDM_EFORMAT,
                               "gguf: key " NAME_FMT ": %llu strings do not fit in the file",
                               NAME_ARG(kv->key), (unsigned long long)n);
        kv->n = (int64_t)n;
        if (n == 0) return TDM_OK;
        kv->str_offs = malloc((size_t)n * sizeof *kv->str_offs);
        if (!kv->str_offs)
            return tdm_err_set(TDM_ENOMEM, "gguf: key " NAME_FMT ": out of memory",
                               NAME_ARG(kv->key));
        for (uint64_t i = 0; i < n; i++) {
            kv->str_offs[i] = (uint64_t)(c->base + c->pos - kv->val);
            struct tdm_str s;
            if (!cur_str(c, &s))
                return tdm_err_set(TDM_EFORMAT,
                                   "gguf: key " NAME_FMT ": string %llu runs past the end",
                                   NAME_ARG(kv->key), (unsigned long long)i);
        }
        return TDM_OK;
    }
    size_t esize = scalar_bytes(elem);
    if (esize == 0)
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": unknown array element type %u",
                           NAME_ARG(kv->key), elem);
    const uint8_t *p;
    if (n > cur_left(c) / esize || !cur_take(c, n * esize, &p))
        return tdm_err_set(TDM_EFORMAT,
                           "gguf: key " NAME_FMT ": array of %llu %s runs past the end",
                           NAME_ARG(kv->key), (unsigned long long)n, type_name(elem));
    if (elem == TDM_GGUF_BOOL) {
        for (uint64_t i = 0; i < n; i++)
            if (p[i] > 1)
                return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": bool value %u",
                                   NAME_ARG(kv->key), p[i]);
    }
    kv->n = (int64_t)n;
    return TDM_OK;
}

static tdm_status parse_kv(struct cursor *c, int64_t index, struct gguf_kv *kv)
{
    uint32_t type;
    if (!cur_str(c, &kv->key))
        return tdm_err_set(TDM_EFORMAT, "gguf: key %lld runs past the end", (long long)index);
    if (kv->key.len == 0 || memchr(kv->key.ptr, 0, kv->key.len))
        return tdm_err_set(TDM_EFORMAT, "gguf: key %lld is empty or holds a NUL byte",
                           (long long)index);
    if (!cur_u32(c, &type))
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": truncated", NAME_ARG(kv->key));
    kv->type = (enum tdm_gguf_type)type;
    if (type == TDM_GGUF_STRING) {
        if (!cur_str(c, &kv->str))
            return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": string runs past the end",
                               NAME_ARG(kv->key));
        kv->val = (const uint8_t *)kv->str.ptr;
        return TDM_OK;
    }
    if (type == TDM_GGUF_ARRAY) return parse_array(c, kv);
    size_t size = scalar_bytes(type);
    if (size == 0)
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": unknown value type %u",
                           NAME_ARG(kv->key), type);
    if (!cur_take(c, size, &kv->val))
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": value runs past the end",
                           NAME_ARG(kv->key));
    if (type == TDM_GGUF_BOOL && kv->val[0] > 1)
        return tdm_err_set(TDM_EFORMAT, "gguf: key " NAME_FMT ": bool value %u", NAME_ARG(kv->key),
                           kv->val[0]);
    return TDM_OK;
}

/* general.alignment, if present, must be a u32 power of two. */
static tdm_status read_alignment(tdm_gguf_t *g)
{
    g->alignment = GGUF_DEFAULT_ALIGN;
    int64_t i = tdm_gguf_find(g, "general.alignment");
    if (i < 0) return TDM_OK;
    const struct gguf_kv *kv = &g->kvs[i];
    if (kv->type != TDM_GGUF_U32)
        return tdm_err_set(TDM_EFORMAT, "gguf: general.alignment is %s, not u32",
                           type_name(kv->type));
    uint32_t a;
    memcpy(&a, kv->val, 4);
    if (a == 0 || (a & (a - 1)) != 0)
        return tdm_err_set(TDM_EFORMAT, "gguf: general.alignment %u is not a power of two", a);
    g->alignment = a;
    return TDM_OK;
}

static tdm_status parse_tensor_info(struct cursor *c, const tdm_gguf_t *g, int64_t index,
                                    struct gguf_tensor *t)
{
    struct tdm_str name;
    uint32_t n_dims, dtype;
    if (!cur_str(c, &name))
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor %lld: name runs past the end",
                           (long long)index);
    if (name.len == 0 || name.len > GGUF_MAX_NAME_BYTES || memchr(name.ptr, 0, name.len))
        return tdm_err_set(TDM_EFORMAT,
                           "gguf: tensor %lld: name is empty, longer than %d bytes or holds "
                           "a NUL byte",
                           (long long)index, GGUF_MAX_NAME_BYTES);
    t->raw_name = name;
    if (!cur_u32(c, &n_dims))
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": truncated", NAME_ARG(name));
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": %u dims (want 1..%d)",
                           NAME_ARG(name), n_dims, GGUF_MAX_DIMS);
    t->info.n_dims = (int)n_dims;
    int64_t n_elems = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->info.ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne;
        if (!cur_u64(c, &ne))
            return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": truncated", NAME_ARG(name));
        if (ne == 0 || ne > (uint64_t)INT64_MAX ||
            __builtin_mul_overflow(n_elems, (int64_t)ne, &n_elems))
            return tdm_err_set(TDM_EFORMAT,
                               "gguf: tensor " NAME_FMT ": dim %u is %llu (zero or overflowing)",
                               NAME_ARG(name), d, (unsigned long long)ne);
        t->info.ne[d] = (int64_t)ne;
    }
    if (!cur_u32(c, &dtype) || !cur_u64(c, &t->offset))
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": truncated", NAME_ARG(name));
    if (!tdm_dtype_known((int)dtype))
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": unknown type id %u",
                           NAME_ARG(name), dtype);
    t->info.dtype = (enum tdm_dtype)dtype;
    if (t->info.ne[0] % tdm_dtype_block_elems(t->info.dtype) != 0)
        return tdm_err_set(TDM_EFORMAT,
                           "gguf: tensor " NAME_FMT ": row of %lld is not a whole number of "
                           "%s blocks",
                           NAME_ARG(name), (long long)t->info.ne[0], tdm_dtype_name(t->info.dtype));
    size_t row_bytes = tdm_dtype_row_bytes(t->info.dtype, t->info.ne[0]);
    if (row_bytes == 0)
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": size overflows",
                           NAME_ARG(name));
    uint64_t n_rows = (uint64_t)(n_elems / t->info.ne[0]);
    uint64_t nbytes;
    if (__builtin_mul_overflow((uint64_t)row_bytes, n_rows, &nbytes) || nbytes > SIZE_MAX)
        return tdm_err_set(TDM_EFORMAT, "gguf: tensor " NAME_FMT ": size overflows",
                           NAME_ARG(name));
    t->info.nbytes = (size_t)nbytes;
    if (t->offset % g->alignment != 0)
        return tdm_err_set(
            TDM_EFORMAT, "gguf: tensor " NAME_FMT ": offset %llu is not a multiple of %llu",
            NAME_ARG(name), (unsigned long long)t->offset, (unsigned long long)g->alignment);
    return TDM_OK;
}

/* Copies the tensor names into one buffer of NUL-terminated strings. */
static tdm_status copy_names(tdm_gguf_t *g)
{
    size_t total = 0;
    for (int64_t i = 0; i < g->n_tensors; i++)
        total += g->tensors[i].raw_name.len + 1;
    g->names = malloc(total ? total : 1);
    if (!g->names) return tdm_err_set(TDM_ENOMEM, "gguf: out of memory for tensor names");
    char *p = g->names;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct tdm_str s = g->tensors[i].raw_name;
        memcpy(p, s.ptr, s.len);
        p[s.len] = '\0';
        g->tensors[i].info.name = p;
        p += s.len + 1;
    }
    return TDM_OK;
}

/* Places each tensor's data after the padded tensor table, inside the image. */
static tdm_status place_data(tdm_gguf_t *g, size_t table_end)
{
    if (g->n_tensors == 0) return TDM_OK;
    uint64_t data_start = ((uint64_t)table_end + g->alignment - 1) / g->alignment * g->alignment;
    if (data_start > g->size)
        return tdm_err_set(TDM_EFORMAT, "gguf: data section starts at %llu, past the end (%zu)",
                           (unsigned long long)data_start, g->size);
    uint64_t data_bytes = g->size - data_start;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        if (t->offset > data_bytes || t->info.nbytes > data_bytes - t->offset)
            return tdm_err_set(TDM_EFORMAT,
                               "gguf: tensor '%s': data [%llu, +%zu) lies outside the %llu data "
                               "bytes",
                               t->info.name, (unsigned long long)t->offset, t->info.nbytes,
                               (unsigned long long)data_bytes);
        t->info.data = g->data + data_start + t->offset;
    }
    return TDM_OK;
}

static tdm_status parse_header(struct cursor *c, tdm_gguf_t *g, uint64_t *n_tensors, uint64_t *n_kv)
{
    const uint8_t *magic;
    if (!cur_take(c, 4, &magic) || memcmp(magic, GGUF_MAGIC_BYTES, 4) != 0)
        return tdm_err_set(TDM_EFORMAT, "gguf: bad magic (not a GGUF file)");
    uint32_t v;
    if (!cur_u32(c, &v)) return tdm_err_set(TDM_EFORMAT, "gguf: truncated header");
    uint32_t swapped = __builtin_bswap32(v);
    if ((v == 0 || v > 0xffff) && swapped >= 1 && swapped <= 3)
        return tdm_err_set(TDM_EUNSUPPORTED,
                           "gguf: big-endian file (version %u byte-swapped); only little-endian "
                           "GGUF is supported",
                           swapped);
    if (v == 1)
        return tdm_err_set(TDM_EUNSUPPORTED, "gguf: version 1 is not supported (need 2 or 3)");
    if (v != 2 && v != 3)
        return tdm_err_set(TDM_EUNSUPPORTED, "gguf: unknown version %u (need 2 or 3)", v);
    g->version = v;
    if (!cur_u64(c, n_tensors) || !cur_u64(c, n_kv))
        return tdm_err_set(TDM_EFORMAT, "gguf: truncated header");
    if (*n_kv > GGUF_MAX_KV || *n_tensors > GGUF_MAX_TENSORS)
        return tdm_err_set(TDM_ERANGE, "gguf: %llu keys and %llu tensors (caps: %d and %d)",
                           (unsigned long long)*n_kv, (unsigned long long)*n_tensors, GGUF_MAX_KV,
                           GGUF_MAX_TENSORS);
    /* both counts are capped, so the products cannot overflow */
    if (*n_kv * GGUF_MIN_KV_BYTES + *n_tensors * GGUF_MIN_TENSOR_BYTES > cur_left(c))
        return tdm_err_set(TDM_EFORMAT, "gguf: %llu keys and %llu tensors cannot fit in %zu bytes",
                           (unsigned long long)*n_kv, (unsigned long long)*n_tensors, g->size);
    return TDM_OK;
}

static tdm_status parse(tdm_gguf_t *g)
{
    struct cursor c = {g->data, g->size, 0};
    uint64_t n_tensors = 0, n_kv = 0;
    tdm_status st = parse_header(&c, g, &n_tensors, &n_kv);
    if (st) return st;

    g->kvs = calloc(n_kv ? n_kv : 1, sizeof *g->kvs);
    if (!g->kvs)
        return tdm_err_set(TDM_ENOMEM, "gguf: out of memory for %llu keys",
                           (unsigned long long)n_kv);
    for (uint64_t i = 0; i < n_kv; i++) {
        /* count each kv as soon as it is touched, so close() frees its string offsets */
        g->n_kv = (int64_t)i + 1;
        if ((st = parse_kv(&c, (int64_t)i, &g->kvs[i]))) return st;
    }
    if ((st = build_kv_table(g))) return st;
    if ((st = read_alignment(g))) return st;

    g->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *g->tensors);
    if (!g->tensors)
        return tdm_err_set(TDM_ENOMEM, "gguf: out of memory for %llu tensors",
                           (unsigned long long)n_tensors);
    g->n_tensors = (int64_t)n_tensors;
    for (uint64_t i = 0; i < n_tensors; i++)
        if ((st = parse_tensor_info(&c, g, (int64_t)i, &g->tensors[i]))) return st;
    if ((st = build_tensor_table(g))) return st;
    if ((st = copy_names(g))) return st;
    return place_data(g, c.pos);
}

static void gguf_free(tdm_gguf_t *g)
{
    for (int64_t i = 0; i < g->n_kv; i++)
        free(g->kvs[i].str_offs);
    free(g->kvs);
    free(g->tensors);
    free(g->names);
    free(g->kv_slots);
    free(g->tensor_slots);
    tdm_mmap_close(&g->map);
    free(g);
}

static tdm_status open_image(const uint8_t *data, size_t size, struct tdm_mmap map,
                             tdm_gguf_t **out)
{
    tdm_gguf_t *g = calloc(1, sizeof *g);
    if (!g) {
        tdm_mmap_close(&map);
        return tdm_err_set(TDM_ENOMEM, "gguf: out of memory");
    }
    g->map = map;
    g->data = data;
    g->size = size;
    tdm_status st = parse(g);
    if (st) {
        gguf_free(g);
        return st;
    }
    *out = g;
    return TDM_OK;
}

tdm_status tdm_gguf_open_memory(const void *data, size_t size, tdm_gguf_t **out)
{
    if (!out || (!data && size > 0)) return tdm_err_set(TDM_EINVAL, "gguf: NULL argument");
    struct tdm_mmap none = {0};
    return open_image(data, size, none, out);
}

tdm_status tdm_gguf_open(const char *path, tdm_gguf_t **out)
{
    if (!path || !out) return tdm_err_set(TDM_EINVAL, "gguf: NULL argument");
    struct tdm_mmap map;
    tdm_status st = tdm_mmap_open(path, &map);
    if (st) return st;
    st = open_image(map.data, map.size, map, out);
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", tdm_err_msg());
        tdm_err_set(st, "%s: %s", path, msg);
    }
    return st;
}

void tdm_gguf_close(tdm_gguf_t *g)
{
    if (g) gguf_free(g);
}

uint32_t tdm_gguf_version(const tdm_gguf_t *g)
{
    return g->version;
}

/* ---- metadata ---- */

int64_t tdm_gguf_n_kv(const tdm_gguf_t *g)
{
    return g->n_kv;
}

struct tdm_str tdm_gguf_kv_key(const tdm_gguf_t *g, int64_t i)
{
    TDM_ASSERT(i >= 0 && i < g->n_kv);
    return g->kvs[i].key;
}

enum tdm_gguf_type tdm_gguf_kv_type(const tdm_gguf_t *g, int64_t i)
{
    TDM_ASSERT(i >= 0 && i < g->n_kv);
    return g->kvs[i].type;
}

int64_t tdm_gguf_find(const tdm_gguf_t *g, const char *key)
{
    if (!g || !key) return -1;
    return kv_lookup(g, key, strlen(key));
}

static tdm_status find_kv(const tdm_gguf_t *g, const char *key, const struct gguf_kv **out)
{
    int64_t i = tdm_gguf_find(g, key);
    if (i < 0) return tdm_err_set(TDM_ENOTFOUND, "gguf: no key '%s'", key ? key : "(null)");
    *out = &g->kvs[i];
    return TDM_OK;
}

/* An integer value widened to sign + magnitude-friendly pair: fits_i64 tells if `i` holds it,
 * else it is a u64 above INT64_MAX held in `u`. */
static bool kv_integer(const struct gguf_kv *kv, int64_t *i, uint64_t *u, bool *fits_i64)
{
    const uint8_t *p = kv->val;
    *fits_i64 = true;
    switch (kv->type) {
    case TDM_GGUF_U8:
        *i = p[0];
        return true;
    case TDM_GGUF_I8:
        *i = (int8_t)p[0];
        return true;
    case TDM_GGUF_U16: {
        uint16_t v;
        memcpy(&v, p, 2);
        *i = v;
        return true;
    }
    case TDM_GGUF_I16: {
        int16_t v;
        memcpy(&v, p, 2);
        *i = v;
        return true;
    }
    case TDM_GGUF_U32: {
        uint32_t v;
        memcpy(&v, p, 4);
        *i = v;
        return true;
    }
    case TDM_GGUF_I32: {
        int32_t v;
        memcpy(&v, p, 4);
        *i = v;
        return true;
    }
    case TDM_GGUF_I64:
        memcpy(i, p, 8);
        return true;
    case TDM_GGUF_U64: {
        uint64_t v;
        memcpy(&v, p, 8);
        if (v > (uint64_t)INT64_MAX) {
            *fits_i64 = false;
            *u = v;
        } else {
            *i = (int64_t)v;
        }
        return true;
    }
    default:
        return false;
    }
}

tdm_status tdm_gguf_get_i64(const tdm_gguf_t *g, const char *key, int64_t *out)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    int64_t i;
    uint64_t u;
    bool fits;
    if (!kv_integer(kv, &i, &u, &fits))
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is %s, not an integer", key,
                           type_name(kv->type));
    if (!fits)
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' = %llu does not fit in i64", key,
                           (unsigned long long)u);
    *out = i;
    return TDM_OK;
}

tdm_status tdm_gguf_get_f32(const tdm_gguf_t *g, const char *key, float *out)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    if (kv->type == TDM_GGUF_F32) {
        memcpy(out, kv->val, 4);
        return TDM_OK;
    }
    if (kv->type == TDM_GGUF_F64) {
        double d;
        memcpy(&d, kv->val, 8);
        *out = (float)d;
        return TDM_OK;
    }
    /* an integer converts when float holds it exactly (e.g. rope_theta stored as u32) */
    int64_t i;
    uint64_t u;
    bool fits;
    if (kv_integer(kv, &i, &u, &fits)) {
        float f = fits ? (float)i : (float)u;
        bool exact =
            fits ? (f >= -9223372036854775808.0f && f < 9223372036854775808.0f && (int64_t)f == i)
                 : (f < 18446744073709551616.0f && (uint64_t)f == u);
        if (exact) {
            *out = f;
            return TDM_OK;
        }
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s': integer not exact as a float", key);
    }
    return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is %s, not a number", key, type_name(kv->type));
}

tdm_status tdm_gguf_get_bool(const tdm_gguf_t *g, const char *key, bool *out)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    if (kv->type != TDM_GGUF_BOOL)
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is %s, not bool", key, type_name(kv->type));
    *out = kv->val[0] != 0;
    return TDM_OK;
}

tdm_status tdm_gguf_get_str(const tdm_gguf_t *g, const char *key, struct tdm_str *out)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    if (kv->type != TDM_GGUF_STRING)
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is %s, not str", key, type_name(kv->type));
    *out = kv->str;
    return TDM_OK;
}

tdm_status tdm_gguf_get_arr(const tdm_gguf_t *g, const char *key, enum tdm_gguf_type *elem_type,
                            int64_t *n, const void **data)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    if (kv->type != TDM_GGUF_ARRAY)
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is %s, not an array", key,
                           type_name(kv->type));
    if (elem_type) *elem_type = kv->elem_type;
    if (n) *n = kv->n;
    /* string elements are length-prefixed, not packed: no raw pointer for them */
    if (data) *data = kv->elem_type == TDM_GGUF_STRING ? NULL : kv->val;
    return TDM_OK;
}

tdm_status tdm_gguf_get_arr_str(const tdm_gguf_t *g, const char *key, int64_t i,
                                struct tdm_str *out)
{
    const struct gguf_kv *kv = NULL;
    tdm_status st = find_kv(g, key, &kv);
    if (st) return st;
    if (kv->type != TDM_GGUF_ARRAY || kv->elem_type != TDM_GGUF_STRING)
        return tdm_err_set(TDM_EFORMAT, "gguf: key '%s' is not an array of strings", key);
    if (i < 0 || i >= kv->n)
        return tdm_err_set(TDM_ERANGE, "gguf: key '%s': index %lld outside [0, %lld)", key,
                           (long long)i, (long long)kv->n);
    const uint8_t *p = kv->val + kv->str_offs[i];
    uint64_t len;
    memcpy(&len, p, 8);
    out->ptr = (const char *)(p + 8);
    out->len = (size_t)len;
    return TDM_OK;
}

/* ---- tensors ---- */

int64_t tdm_gguf_n_tensors(const tdm_gguf_t *g)
{
    return g->n_tensors;
}

const struct tdm_tensor_info *tdm_gguf_tensor(const tdm_gguf_t *g, int64_t i)
{
    TDM_ASSERT(i >= 0 && i < g->n_tensors);
    return &g->tensors[i].info;
}

const struct tdm_tensor_info *tdm_gguf_find_tensor(const tdm_gguf_t *g, const char *name)
{
    if (!g || !name) return NULL;
    int64_t i = tensor_lookup(g, name, strlen(name));
    return i < 0 ? NULL : &g->tensors[i].info;
}
