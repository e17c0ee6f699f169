/*
 * safetensors reader: one file, or a folder holding model.safetensors or a sharded checkpoint
 * (model.safetensors.index.json naming the shard of every tensor).
 *
 * A file is an 8-byte little-endian header length N, N bytes of JSON, then the data buffer.
 * The JSON maps tensor names to {dtype, shape, data_offsets: [begin, end]} (offsets relative to
 * the data buffer), plus an optional "__metadata__" entry that we ignore. Files are memory
 * mapped and tensor data is handed out as pointers into the maps, so opening costs only the
 * header parse and a 70B checkpoint is not read until its pages are touched.
 *
 * Everything in a header is checked before it is believed: the header length against the file
 * size and TDM_ST_MAX_HEADER_BYTES, the JSON shape of every entry, rank <= 4, shape products
 * (overflow-checked) against the byte ranges, ranges inside the data buffer and not
 * overlapping, and names unique across all shards. Shard names from an index may not contain
 * '/' nor be "." or "..", so an index cannot reach outside its folder.
 *
 * Shapes are reported reversed into ne[] (ne[0] is the contiguous dimension), matching GGUF,
 * so the loader sees one convention. Tensors of dtypes other than F32/F16/BF16 are listed with
 * TDM_DTYPE_ST_UNSUPPORTED; tdm_st_dtype_str() gives their header spelling for messages.
 *
 * Threading: opening is single-threaded; an open handle is read-only and may be shared.
 */
#include "model/model_int.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct st_shard {
    char *label;         /* file path (or "<memory>") for messages */
    struct tdm_mmap map; /* zeroed for tdm_st_open_memory */
};

struct tdm_st {
    struct st_shard *shards;
    int n_shards;
    struct tdm_tensor_info *tensors; /* [n_tensors]; names are malloc'd */
    const char **raw_dtypes;         /* [n_tensors] static strings from st_dtypes */
    int *shard_of;                   /* [n_tensors] */
    int64_t n_tensors, cap_tensors;
    int64_t *slots; /* open-addressing hash of tensor indexes, -1 empty; [n_slots] */
    uint64_t n_slots;
    json_t *meta; /* the first file's "__metadata__" string entries, or NULL */
};

/* Every dtype of the safetensors format, with its width in bits. */
static const struct {
    const char *name;
    unsigned bits;
    enum tdm_dtype dtype;
} st_dtypes[] = {
    {"F32", 32, TDM_DTYPE_F32},
    {"F16", 16, TDM_DTYPE_F16},
    {"BF16", 16, TDM_DTYPE_BF16},
    {"F64", 64, TDM_DTYPE_ST_UNSUPPORTED},
    {"I64", 64, TDM_DTYPE_ST_UNSUPPORTED},
    {"U64", 64, TDM_DTYPE_ST_UNSUPPORTED},
    {"C64", 64, TDM_DTYPE_ST_UNSUPPORTED},
    {"I32", 32, TDM_DTYPE_ST_UNSUPPORTED},
    {"U32", 32, TDM_DTYPE_ST_UNSUPPORTED},
    {"I16", 16, TDM_DTYPE_ST_UNSUPPORTED},
    {"U16", 16, TDM_DTYPE_ST_UNSUPPORTED},
    {"I8", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"U8", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"BOOL", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F8_E4M3", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F8_E5M2", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F8_E8M0", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F8_E4M3FNUZ", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F8_E5M2FNUZ", 8, TDM_DTYPE_ST_UNSUPPORTED},
    {"F6_E2M3", 6, TDM_DTYPE_ST_UNSUPPORTED},
    {"F6_E3M2", 6, TDM_DTYPE_ST_UNSUPPORTED},
    {"F4", 4, TDM_DTYPE_ST_UNSUPPORTED},
};

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

void tdm_st_close(tdm_st_t *st)
{
    if (!st) return;
    for (int64_t i = 0; i < st->n_tensors; i++)
        free((char *)st->tensors[i].name);
    for (int i = 0; i < st->n_shards; i++) {
        tdm_mmap_close(&st->shards[i].map);
        free(st->shards[i].label);
    }
    free(st->shards);
    free(st->tensors);
    free(st->raw_dtypes);
    free(st->shard_of);
    json_decref(st->meta);
    free(st->slots);
    free(st);
}

static tdm_status st_add_shard(tdm_st_t *st, const char *label, int *idx)
{
    struct st_shard *ns = realloc(st->shards, sizeof(*ns) * (size_t)(st->n_shards + 1));
    if (!ns) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    st->shards = ns;
    struct st_shard *s = &st->shards[st->n_shards];
    memset(s, 0, sizeof(*s));
    s->label = strdup(label);
    if (!s->label) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    *idx = st->n_shards++;
    return TDM_OK;
}

static tdm_status st_reserve(tdm_st_t *st, int64_t extra)
{
    if (st->n_tensors + extra <= st->cap_tensors) return TDM_OK;
    int64_t cap = TDM_MAX(st->cap_tensors * 2, st->n_tensors + extra);
    struct tdm_tensor_info *t = realloc(st->tensors, sizeof(*t) * (size_t)cap);
    if (t) st->tensors = t;
    const char **d = realloc(st->raw_dtypes, sizeof(*d) * (size_t)cap);
    if (d) st->raw_dtypes = d;
    int *s = realloc(st->shard_of, sizeof(*s) * (size_t)cap);
    if (s) st->shard_of = s;
    if (!t || !d || !s) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    st->cap_tensors = cap;
    return TDM_OK;
}

struct st_range {
    uint64_t begin, end;
    int64_t tensor;
};

static int range_cmp(const void *a, const void *b)
{
    const struct st_range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Reads a JSON integer in [0, INT64_MAX]. */
static bool json_u63(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* Parses one tensor entry of a header; appends it to st. */
static tdm_status st_parse_entry(tdm_st_t *st, int shard, const char *label, const char *name,
                                 json_t *entry, const uint8_t *base, uint64_t data_len,
                                 struct st_range *range)
{
    if (!json_is_object(entry))
        return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": entry is not a JSON object", label,
                           name);
    json_t *jdtype = json_object_get(entry, "dtype");
    json_t *jshape = json_object_get(entry, "shape");
    json_t *joffs = json_object_get(entry, "data_offsets");
    if (!json_is_string(jdtype))
        return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": dtype missing or not a string", label,
                           name);
    if (!json_is_array(jshape))
        return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": shape missing or not an array", label,
                           name);
    if (!json_is_array(joffs) || json_array_size(joffs) != 2)
        return tdm_err_set(TDM_EFORMAT,
                           "%s: tensor \"%s\": data_offsets is not an array of two integers", label,
                           name);

    const char *dname = json_string_value(jdtype);
    int di = -1;
    for (size_t i = 0; i < TDM_ARRAY_LEN(st_dtypes); i++)
        if (!strcmp(dname, st_dtypes[i].name)) di = (int)i;
    if (di < 0)
        return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": unknown dtype \"%.32s\"", label, name,
                           dname);

    size_t rank = json_array_size(jshape);
    if (rank > 4)
        return tdm_err_set(TDM_EUNSUPPORTED, "%s: tensor \"%s\": rank %zu (at most 4 supported)",
                           label, name, rank);
    uint64_t shape[4], count = 1;
    for (size_t i = 0; i < rank; i++) {
        if (!json_u63(json_array_get(jshape, i), &shape[i]))
            return tdm_err_set(TDM_EFORMAT,
                               "%s: tensor \"%s\": shape[%zu] is not a non-negative integer", label,
                               name, i);
        if (__builtin_mul_overflow(count, shape[i], &count) || count > (uint64_t)INT64_MAX)
            return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": shape product overflows", label,
                               name);
    }
    uint64_t bits;
    if (__builtin_mul_overflow(count, (uint64_t)st_dtypes[di].bits, &bits))
        return tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\": size overflows", label, name);
    uint64_t want_bytes = bits / 8 + (bits % 8 != 0);

    uint64_t begin, end;
    if (!json_u63(json_array_get(joffs, 0), &begin) || !json_u63(json_array_get(joffs, 1), &end))
        return tdm_err_set(TDM_EFORMAT,
                           "%s: tensor \"%s\": data_offsets are not non-negative integers", label,
                           name);
    if (begin > end || end > data_len)
        return tdm_err_set(TDM_EFORMAT,
                           "%s: tensor \"%s\": data_offsets [%llu, %llu] outside the %llu-byte "
                           "data buffer",
                           label, name, (unsigned long long)begin, (unsigned long long)end,
                           (unsigned long long)data_len);
    if (end - begin != want_bytes)
        return tdm_err_set(
            TDM_EFORMAT, "%s: tensor \"%s\": %llu bytes stored, but %s shape needs %llu", label,
            name, (unsigned long long)(end - begin), dname, (unsigned long long)want_bytes);

    tdm_status rc = st_reserve(st, 1);
    if (rc) return rc;
    char *copy = strdup(name);
    if (!copy) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    int64_t idx = st->n_tensors++;
    struct tdm_tensor_info *t = &st->tensors[idx];
    memset(t, 0, sizeof(*t));
    t->name = copy;
    t->dtype = st_dtypes[di].dtype;
    t->n_dims = (int)rank;
    for (int i = 0; i < 4; i++)
        t->ne[i] = 1;
    for (size_t i = 0; i < rank; i++)
        t->ne[i] = (int64_t)shape[rank - 1 - i];
    t->data = base + begin;
    t->nbytes = (size_t)(end - begin);
    st->raw_dtypes[idx] = st_dtypes[di].name;
    st->shard_of[idx] = shard;
    *range = (struct st_range){begin, end, idx};
    return TDM_OK;
}

/* Parses one file image and appends its tensors. */
static tdm_status st_parse(tdm_st_t *st, int shard, const uint8_t *data, size_t size)
{
    const char *label = st->shards[shard].label;
    if (size < 8)
        return tdm_err_set(TDM_EFORMAT, "%s: %zu bytes, too short for a safetensors header", label,
                           size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | data[i];
    if (hlen > TDM_ST_MAX_HEADER_BYTES)
        return tdm_err_set(TDM_ERANGE, "%s: header length %llu over the %u-byte cap", label,
                           (unsigned long long)hlen, TDM_ST_MAX_HEADER_BYTES);
    if (hlen > size - 8)
        return tdm_err_set(TDM_EFORMAT, "%s: header length %llu runs past the end of the file",
                           label, (unsigned long long)hlen);
    const uint8_t *base = data + 8 + hlen;
    uint64_t data_len = size - 8 - hlen;

    json_error_t jerr;
    json_t *root = json_loadb((const char *)data + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return tdm_err_set(TDM_EFORMAT, "%s: header JSON: %s (offset %d)", label, jerr.text,
                           jerr.position);
    tdm_status rc = TDM_OK;
    struct st_range *ranges = NULL;
    if (!json_is_object(root)) {
        rc = tdm_err_set(TDM_EFORMAT, "%s: header is not a JSON object", label);
        goto out_root;
    }
    ranges = malloc(sizeof(*ranges) * (json_object_size(root) + 1));
    if (!ranges) {
        rc = tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
        goto out_root;
    }
    size_t n_ranges = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val)
    {
        if (!strcmp(key, "__metadata__")) {
            /* string -> string (the format's rule); other values are not kept */
            if (shard == 0 && json_is_object(val) && !st->meta && (st->meta = json_object())) {
                const char *mk;
                json_t *mv;
                json_object_foreach(val, mk, mv)
                {
                    if (json_is_string(mv)) json_object_set(st->meta, mk, mv);
                }
            }
            continue;
        }
        rc = st_parse_entry(st, shard, label, key, val, base, data_len, &ranges[n_ranges]);
        if (rc) goto out_ranges;
        n_ranges++;
    }
    qsort(ranges, n_ranges, sizeof(*ranges), range_cmp);
    for (size_t i = 1; i < n_ranges; i++) {
        if (ranges[i].begin < ranges[i - 1].end) {
            rc = tdm_err_set(TDM_EFORMAT, "%s: tensors \"%s\" and \"%s\" overlap", label,
                             st->tensors[ranges[i - 1].tensor].name,
                             st->tensors[ranges[i].tensor].name);
            goto out_ranges;
        }
    }
out_ranges:
    free(ranges);
out_root:
    json_decref(root);
    return rc;
}

/* Builds the name index; rejects duplicate names (possible across shards). */
static tdm_status st_index(tdm_st_t *st)
{
    uint64_t n = 16;
    while (n < (uint64_t)st->n_tensors * 2)
        n *= 2;
    st->slots = malloc(sizeof(*st->slots) * n);
    if (!st->slots) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    st->n_slots = n;
    for (uint64_t i = 0; i < n; i++)
        st->slots[i] = -1;
    for (int64_t i = 0; i < st->n_tensors; i++) {
        const char *name = st->tensors[i].name;
        uint64_t h = name_hash(name) & (n - 1);
        while (st->slots[h] >= 0) {
            int64_t j = st->slots[h];
            if (!strcmp(st->tensors[j].name, name))
                return tdm_err_set(TDM_EFORMAT, "tensor \"%s\" appears in both %s and %s", name,
                                   st->shards[st->shard_of[j]].label,
                                   st->shards[st->shard_of[i]].label);
            h = (h + 1) & (n - 1);
        }
        st->slots[h] = i;
    }
    return TDM_OK;
}

static int64_t st_lookup(const tdm_st_t *st, const char *name)
{
    if (!st || !name || !st->slots) return -1;
    uint64_t h = name_hash(name) & (st->n_slots - 1);
    while (st->slots[h] >= 0) {
        int64_t j = st->slots[h];
        if (!strcmp(st->tensors[j].name, name)) return j;
        h = (h + 1) & (st->n_slots - 1);
    }
    return -1;
}

tdm_status tdm_st_open_memory(const void *data, size_t size, tdm_st_t **out)
{
    if (!out || (!data && size)) return tdm_err_set(TDM_EINVAL, "tdm_st_open_memory: bad args");
    tdm_st_t *st = calloc(1, sizeof(*st));
    if (!st) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    int shard;
    tdm_status rc = st_add_shard(st, "<memory>", &shard);
    if (!rc) rc = st_parse(st, shard, data, size);
    if (!rc) rc = st_index(st);
    if (rc) {
        tdm_st_close(st);
        return rc;
    }
    *out = st;
    return TDM_OK;
}

static tdm_status st_open_file(tdm_st_t *st, const char *path, int *shard_out)
{
    int shard;
    tdm_status rc = st_add_shard(st, path, &shard);
    if (rc) return rc;
    rc = tdm_mmap_open(path, &st->shards[shard].map);
    if (rc) return rc;
    rc = st_parse(st, shard, st->shards[shard].map.data, st->shards[shard].map.size);
    if (rc) return rc;
    if (shard_out) *shard_out = shard;
    return TDM_OK;
}

static char *path_join(const char *dir, const char *name)
{
    char *p = NULL;
    if (asprintf(&p, "%s/%s", dir, name) < 0) return NULL;
    return p;
}

static bool is_regular(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* A sharded checkpoint: open each shard named in the index once, then check that every
 * tensor the index names lives in the shard it names. */
static tdm_status st_open_index(tdm_st_t *st, const char *dir, const char *index_path)
{
    char *text = NULL;
    size_t len = 0;
    tdm_status rc = tdm_file_read(index_path, TDM_ST_MAX_INDEX_BYTES, &text, &len);
    if (rc) return rc;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root)
        return tdm_err_set(TDM_EFORMAT, "%s: JSON: %s (line %d)", index_path, jerr.text, jerr.line);
    const char **files = NULL; /* distinct shard names, pointing into root */
    int n_files = 0;
    int *file_shard = NULL;
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(root) || !json_is_object(map)) {
        rc = tdm_err_set(TDM_EFORMAT, "%s: no \"weight_map\" object", index_path);
        goto out_root;
    }
    files = malloc(sizeof(*files) * TDM_ST_MAX_SHARDS);
    file_shard = malloc(sizeof(*file_shard) * TDM_ST_MAX_SHARDS);
    if (!files || !file_shard) {
        rc = tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
        goto out_files;
    }
    const char *key;
    json_t *val;
    json_object_foreach(map, key, val)
    {
        if (!json_is_string(val)) {
            rc =
                tdm_err_set(TDM_EFORMAT, "%s: weight_map[\"%s\"] is not a string", index_path, key);
            goto out_files;
        }
        const char *f = json_string_value(val);
        if (!*f || strchr(f, '/') || strchr(f, '\\') || !strcmp(f, ".") || !strcmp(f, "..")) {
            rc = tdm_err_set(TDM_EFORMAT,
                             "%s: shard name \"%.200s\" is not a plain file name in the folder",
                             index_path, f);
            goto out_files;
        }
        int k = 0;
        while (k < n_files && strcmp(files[k], f))
            k++;
        if (k == n_files) {
            if (n_files == TDM_ST_MAX_SHARDS) {
                rc = tdm_err_set(TDM_ERANGE, "%s: more than %d shards", index_path,
                                 TDM_ST_MAX_SHARDS);
                goto out_files;
            }
            files[n_files++] = f;
        }
    }
    if (n_files == 0) {
        rc = tdm_err_set(TDM_EFORMAT, "%s: weight_map is empty", index_path);
        goto out_files;
    }
    for (int k = 0; k < n_files; k++) {
        char *p = path_join(dir, files[k]);
        if (!p) {
            rc = tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
            goto out_files;
        }
        rc = st_open_file(st, p, &file_shard[k]);
        free(p);
        if (rc) goto out_files;
    }
    rc = st_index(st);
    if (rc) goto out_files;
    json_object_foreach(map, key, val)
    {
        const char *f = json_string_value(val);
        int k = 0;
        while (strcmp(files[k], f))
            k++;
        int64_t ti = st_lookup(st, key);
        if (ti < 0 || st->shard_of[ti] != file_shard[k]) {
            rc = tdm_err_set(TDM_EFORMAT, "%s: tensor \"%s\" is not in shard %s", index_path, key,
                             f);
            goto out_files;
        }
    }
out_files:
    free(files);
    free(file_shard);
out_root:
    json_decref(root);
    return rc;
}

tdm_status tdm_st_open(const char *path, tdm_st_t **out)
{
    if (!path || !out) return tdm_err_set(TDM_EINVAL, "tdm_st_open: bad args");
    struct stat sb;
    if (stat(path, &sb) != 0) return tdm_err_set(TDM_ENOTFOUND, "%s: %s", path, strerror(errno));
    tdm_st_t *st = calloc(1, sizeof(*st));
    if (!st) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    tdm_status rc;
    if (S_ISDIR(sb.st_mode)) {
        char *index = path_join(path, "model.safetensors.index.json");
        char *single = path_join(path, "model.safetensors");
        if (!index || !single)
            rc = tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
        else if (is_regular(index))
            rc = st_open_index(st, path, index);
        else if (is_regular(single))
            rc = st_open_file(st, single, NULL);
        else
            rc = tdm_err_set(TDM_ENOTFOUND,
                             "%s: no model.safetensors or model.safetensors.index.json", path);
        free(index);
        free(single);
    } else {
        rc = st_open_file(st, path, NULL);
    }
    if (!rc && !st->slots) rc = st_index(st);
    if (rc) {
        tdm_st_close(st);
        return rc;
    }
    *out = st;
    return TDM_OK;
}

int64_t tdm_st_n_tensors(const tdm_st_t *st)
{
    return st ? st->n_tensors : 0;
}

const struct tdm_tensor_info *tdm_st_tensor(const tdm_st_t *st, int64_t i)
{
    if (!st || i < 0 || i >= st->n_tensors) return NULL;
    return &st->tensors[i];
}

const struct tdm_tensor_info *tdm_st_find_tensor(const tdm_st_t *st, const char *name)
{
    int64_t i = st_lookup(st, name);
    return i < 0 ? NULL : &st->tensors[i];
}

const char *tdm_st_dtype_str(const tdm_st_t *st, const struct tdm_tensor_info *t)
{
    if (!st || !t || t < st->tensors || t >= st->tensors + st->n_tensors) return "?";
    return st->raw_dtypes[t - st->tensors];
}

const char *tdm_st_metadata(const tdm_st_t *st, const char *key)
{
    json_t *v = st && st->meta && key ? json_object_get(st->meta, key) : NULL;
    return v ? json_string_value(v) : NULL;
}

/* ---- the writer ---- */
static bool st_write_all(FILE *f, const void *p, size_t n)
{
    return n == 0 || fwrite(p, 1, n, f) == n;
}

tdm_status tdm_st_write(const char *path, const struct tdm_st_out *t, int n,
                        const char *const *meta, int n_meta)
{
    if (!path || (n && !t) || n < 0 || n_meta < 0 || (n_meta && !meta))
        return tdm_err_set(TDM_EINVAL, "tdm_st_write: bad args");
    json_t *root = json_object(), *md = n_meta ? json_object() : NULL;
    if (!root || (n_meta && !md)) {
        json_decref(root);
        json_decref(md);
        return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    }
    for (int i = 0; i < n_meta; i++)
        json_object_set_new(md, meta[2 * i], json_string(meta[2 * i + 1]));
    if (md) json_object_set_new(root, "__metadata__", md);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        unsigned bits = 0;
        for (size_t k = 0; k < TDM_ARRAY_LEN(st_dtypes); k++)
            if (!strcmp(st_dtypes[k].name, t[i].dtype)) bits = st_dtypes[k].bits;
        uint64_t count = 1;
        json_t *shape = json_array();
        for (int k = 0; k < t[i].n_dims; k++) {
            count *= (uint64_t)t[i].shape[k];
            json_array_append_new(shape, json_integer(t[i].shape[k]));
        }
        if (!bits || t[i].n_dims < 0 || t[i].n_dims > 4 || count * bits / 8 != t[i].nbytes ||
            json_object_get(root, t[i].name)) {
            json_decref(shape);
            json_decref(root);
            return tdm_err_set(TDM_EINVAL,
                               "safetensors: tensor \"%s\" (%s) has a bad shape, "
                               "size or name",
                               t[i].name, t[i].dtype);
        }
        json_t *e = json_object(), *offs = json_array();
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + t[i].nbytes)));
        json_object_set_new(e, "dtype", json_string(t[i].dtype));
        json_object_set_new(e, "shape", shape);
        json_object_set_new(e, "data_offsets", offs);
        json_object_set_new(root, t[i].name, e);
        off += t[i].nbytes;
    }
    char *hdr = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(root);
    if (!hdr) return tdm_err_set(TDM_ENOMEM, "safetensors: out of memory");
    size_t hl = strlen(hdr), padded = (hl + 7) & ~(size_t)7;
    char tmp[4096];
    int w = snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = w > 0 && (size_t)w < sizeof tmp ? fopen(tmp, "wb") : NULL;
    if (!f) {
        free(hdr);
        return tdm_err_set(TDM_EIO, "%s: cannot write: %s", path, strerror(errno));
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = st_write_all(f, len8, 8) && st_write_all(f, hdr, hl) &&
              st_write_all(f, "        ", padded - hl);
    free(hdr);
    for (int i = 0; ok && i < n; i++)
        ok = st_write_all(f, t[i].data, t[i].nbytes);
    ok = fflush(f) == 0 && fsync(fileno(f)) == 0 && ok;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return tdm_err_set(TDM_EIO, "%s: cannot write: %s", path, strerror(e));
    }
    return TDM_OK;
}
