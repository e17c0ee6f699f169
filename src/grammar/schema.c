/*
 * JSON Schema to AST, and the other JSON grammars: any JSON value (OpenAI's json_object) and a
 * list of choices. docs/structured-output.md lists what is supported; in short:
 *
 *   type (a name or a list), enum, const, anyOf, oneOf (as anyOf), allOf of one schema,
 *   $ref to "#", "#/$defs/...", "#/definitions/..." or any JSON pointer in the document
 *   (recursion unrolled TDM_GRAMMAR_MAX_DEPTH deep), properties (in the schema's order),
 *   required, additionalProperties, items, prefixItems, minItems, maxItems, minLength,
 *   maxLength, pattern, format (date, time, date-time, email, uuid, ipv4, uri), minimum,
 *   maximum, exclusiveMinimum, exclusiveMaximum (integers; integral bounds on numbers).
 *
 * Every other validation keyword is refused with TDM_EUNSUPPORTED naming it, because what the
 * grammar generates must validate against the schema, always; annotations (title,
 * description, default, examples, ...) are ignored. The output is compact JSON: at most one
 * space around ':' and ','. Objects list their properties in the schema's order, optional ones
 * may be left out; properties the schema does not name are never generated (valid whatever
 * additionalProperties says). Unbounded integers and numbers take at most
 * TDM_GRAMMAR_MAX_DIGITS digits per part. Single-threaded.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "grammar/grammar_int.h"

#define MAX_REFS 64 /* active $ref expansions on the path (recursion unrolls within) */

struct sc {
    struct ast *t;
    json_t *root;
    int32_t ws, sep, colon;
    const json_t *refs[MAX_REFS]; /* the $ref targets being expanded, outermost first */
    int n_refs;
    int depth; /* nesting of objects and arrays, for "any value" */
};

static int32_t value_of(struct sc *c, json_t *s);

static int32_t rx(struct sc *c, const char *re, bool in_string)
{
    return tdm_regex_to_ast(c->t, re, strlen(re), in_string);
}

/* one character of a JSON string: unescaped (no '"', '\\' or control), or an escape */
static int32_t string_char(struct sc *c)
{
    struct cpset s = {0};
    if (!tdm_cpset_add(&s, 0x20, 0x10FFFF)) return tdm_ast_fail(c->t, TDM_ENOMEM, "out of memory");
    struct byteset ex = {{0}};
    byteset_add(&ex, '"', '"');
    byteset_add(&ex, '\\', '\\');
    int32_t plain = tdm_ast_cpset(c->t, &s, &ex);
    tdm_cpset_free(&s);
    /* \uXXXX off the surrogates (a lone one is not a character) */
    return tdm_ast_alt(c->t, plain,
                       rx(c, "\\\\([\"\\\\/bfnrt]|u[0-9a-cA-Ce-fE-F][0-9a-fA-F]{3})", false));
}

static int32_t quoted(struct sc *c, int32_t body)
{
    int32_t q = tdm_ast_lit(c->t, "\"", 1);
    return tdm_ast_cat(c->t, q, tdm_ast_cat(c->t, body, q));
}

static int32_t any_string(struct sc *c, int min, int max)
{
    return quoted(c, tdm_ast_rep(c->t, string_char(c), min, max));
}

/* a JSON text, exactly (enum and const values) */
static int32_t literal_json(struct sc *c, const json_t *v)
{
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) return tdm_ast_fail(c->t, TDM_ENOMEM, "out of memory");
    int32_t n = tdm_ast_lit(c->t, s, strlen(s));
    free(s);
    return n;
}

/* ---- integers and numbers ---- */
static const int64_t CAP = 999999999999999; /* TDM_GRAMMAR_MAX_DIGITS nines */

/* the decimal spellings (no leading zeros) of lo..hi, 0 <= lo <= hi */
static int32_t nonneg_range(struct sc *c, int64_t lo, int64_t hi)
{
    int32_t r = 0;
    int64_t p = 1; /* 10^(len-1) */
    for (int len = 1; len <= 19 && lo <= hi; len++) {
        int64_t top = len == 19 ? INT64_MAX : p * 10 - 1;
        if (lo <= top) {
            int64_t b = hi < top ? hi : top;
            char as[24], bs[24];
            snprintf(as, sizeof as, "%lld", (long long)lo);
            snprintf(bs, sizeof bs, "%lld", (long long)b);
            r = tdm_ast_alt(
                c->t, r,
                tdm_ast_span(c->t, (const uint8_t *)as, (const uint8_t *)bs, len, '0', '9'));
            if (b == hi) break;
            lo = b + 1;
        }
        if (len < 19) p *= 10;
    }
    return r;
}

static int32_t int_range(struct sc *c, int64_t lo, int64_t hi)
{
    if (lo > hi) return 0;
    int32_t minus = tdm_ast_lit(c->t, "-", 1);
    if (lo >= 0) return nonneg_range(c, lo, hi);
    if (hi < 0) return tdm_ast_cat(c->t, minus, nonneg_range(c, -hi, -lo));
    return tdm_ast_alt(c->t, tdm_ast_cat(c->t, minus, nonneg_range(c, 1, -lo)),
                       nonneg_range(c, 0, hi));
}

/* numbers y with 0 <= a <= y <= b (integral a, b): an integer part in a..b-1 and any
 * fraction, or b with a fraction of zeros */
static int32_t nonneg_number(struct sc *c, int64_t a, int64_t b)
{
    struct ast *t = c->t;
    int32_t frac = rx(c, "(\\.[0-9]{1,15})?", false);
    int32_t r = tdm_ast_cat(t, nonneg_range(c, b, b), rx(c, "(\\.0{1,15})?", false));
    if (a < b) r = tdm_ast_alt(t, tdm_ast_cat(t, nonneg_range(c, a, b - 1), frac), r);
    return r;
}

static bool get_bound(struct sc *c, json_t *s, const char *key, double *v, bool *has)
{
    json_t *x = json_object_get(s, key);
    *has = false;
    if (!x) return true;
    if (!json_is_number(x)) {
        tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: '%s' must be a number", key);
        return false;
    }
    *v = json_number_value(x);
    if (!isfinite(*v) || fabs(*v) > (double)CAP) {
        tdm_ast_fail(c->t, TDM_EUNSUPPORTED, "JSON Schema: '%s' beyond %lld is not supported", key,
                     (long long)CAP);
        return false;
    }
    *has = true;
    return true;
}

static int32_t number_of(struct sc *c, json_t *s, bool integer)
{
    double mn = 0, mx = 0, xmn = 0, xmx = 0;
    bool has_mn, has_mx, has_xmn, has_xmx;
    if (!get_bound(c, s, "minimum", &mn, &has_mn) || !get_bound(c, s, "maximum", &mx, &has_mx) ||
        !get_bound(c, s, "exclusiveMinimum", &xmn, &has_xmn) ||
        !get_bound(c, s, "exclusiveMaximum", &xmx, &has_xmx))
        return 0;
    bool bounded = has_mn || has_mx || has_xmn || has_xmx;
    if (integer) {
        int64_t lo = -CAP, hi = CAP;
        if (has_mn && ceil(mn) > lo) lo = (int64_t)ceil(mn);
        if (has_xmn && floor(xmn) + 1 > lo) lo = (int64_t)floor(xmn) + 1;
        if (has_mx && floor(mx) < hi) hi = (int64_t)floor(mx);
        if (has_xmx && ceil(xmx) - 1 < hi) hi = (int64_t)ceil(xmx) - 1;
        if (lo > hi)
            return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: the integer bounds are empty");
        return int_range(c, lo, hi);
    }
    if (!bounded)
        return rx(c, "-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,15})?([eE][+-]?[0-9]{1,2})?", false);
    if (has_xmn || has_xmx)
        return tdm_ast_fail(c->t, TDM_EUNSUPPORTED,
                            "JSON Schema: exclusiveMinimum/exclusiveMaximum on a number is not "
                            "supported (on an integer it is)");
    if ((has_mn && mn != floor(mn)) || (has_mx && mx != floor(mx)))
        return tdm_ast_fail(
            c->t, TDM_EUNSUPPORTED,
            "JSON Schema: a number's minimum/maximum must be integral (non-integral "
            "bounds are not supported)");
    int64_t lo = has_mn ? (int64_t)mn : -CAP, hi = has_mx ? (int64_t)mx : CAP;
    if (lo > hi) return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: the number bounds are empty");
    int32_t minus = tdm_ast_lit(c->t, "-", 1);
    if (lo >= 0) return nonneg_number(c, lo, hi);
    if (hi <= 0) return tdm_ast_cat(c->t, minus, nonneg_number(c, -hi, -lo));
    return tdm_ast_alt(c->t, tdm_ast_cat(c->t, minus, nonneg_number(c, 0, -lo)),
                       nonneg_number(c, 0, hi));
}

/* ---- strings ---- */
static bool get_count(struct sc *c, json_t *s, const char *key, int *v)
{
    json_t *x = json_object_get(s, key);
    if (!x) return true;
    if (!json_is_integer(x) || json_integer_value(x) < 0) {
        tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: '%s' must be a non-negative integer", key);
        return false;
    }
    json_int_t n = json_integer_value(x);
    *v = n > 100000 ? 100000 : (int)n;
    return true;
}

static const struct {
    const char *name, *re;
} FORMATS[] = {
    {"date", "[1-9][0-9]{3}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|"
             "(0[13578]|1[02])-31)"},
    {"time", "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):"
             "[0-5][0-9])"},
    {"date-time",
     "[1-9][0-9]{3}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1["
     "02])-"
     "31)T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5]"
     "[0-9])"},
    {"email", "[a-zA-Z0-9]([a-zA-Z0-9._+-]{0,30}[a-zA-Z0-9])?@[a-zA-Z0-9]([a-zA-Z0-9-]{0,20}"
              "[a-zA-Z0-9])?(\\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,20}[a-zA-Z0-9])?){0,3}\\.[a-zA-Z]{2,6}"},
    {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    {"ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-"
             "9]|[1-9]?[0-9])"},
    {"uri", "https?://[a-zA-Z0-9]([a-zA-Z0-9-]{0,20}[a-zA-Z0-9])?(\\.[a-zA-Z0-9]([a-zA-Z0-9-]{0,"
            "20}[a-zA-Z0-9])?){0,3}(/[a-zA-Z0-9._~%-]{0,30}){0,8}"},
};

static int32_t string_of(struct sc *c, json_t *s)
{
    int mn = 0, mx = -1;
    if (!get_count(c, s, "minLength", &mn) || !get_count(c, s, "maxLength", &mx)) return 0;
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    bool lengths = json_object_get(s, "minLength") || json_object_get(s, "maxLength");
    if ((pat || fmt) && lengths)
        return tdm_ast_fail(c->t, TDM_EUNSUPPORTED,
                            "JSON Schema: minLength/maxLength together with %s is not supported",
                            pat ? "pattern" : "format");
    if (pat && fmt)
        return tdm_ast_fail(c->t, TDM_EUNSUPPORTED,
                            "JSON Schema: pattern together with format is not supported");
    if (pat) {
        if (!json_is_string(pat))
            return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: 'pattern' must be a string");
        return quoted(
            c, tdm_regex_to_ast(c->t, json_string_value(pat), json_string_length(pat), true));
    }
    if (fmt) {
        if (!json_is_string(fmt))
            return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: 'format' must be a string");
        for (size_t i = 0; i < sizeof FORMATS / sizeof *FORMATS; i++)
            if (!strcmp(json_string_value(fmt), FORMATS[i].name))
                return quoted(c, rx(c, FORMATS[i].re, true));
        return tdm_ast_fail(c->t, TDM_EUNSUPPORTED,
                            "JSON Schema: string format '%.60s' is not supported",
                            json_string_value(fmt));
    }
    if (mx >= 0 && mx < mn)
        return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: maxLength is below minLength");
    return any_string(c, mn, mx);
}

/* ---- arrays and objects ---- */
static int32_t open_close(struct sc *c, const char *open, int32_t body, const char *close)
{
    struct ast *t = c->t;
    return tdm_ast_cat(
        t, tdm_ast_lit(t, open, 1),
        tdm_ast_cat(t, c->ws,
                    tdm_ast_cat(t, body, tdm_ast_cat(t, c->ws, tdm_ast_lit(t, close, 1)))));
}

static int32_t array_of(struct sc *c, json_t *s)
{
    struct ast *t = c->t;
    int mn = 0, mx = -1;
    if (!get_count(c, s, "minItems", &mn) || !get_count(c, s, "maxItems", &mx)) return 0;
    if (mx >= 0 && mx < mn)
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: maxItems is below minItems");
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    if (prefix && !json_is_array(prefix))
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'prefixItems' must be an array");
    if (items && json_is_array(items))
        return tdm_ast_fail(
            t, TDM_EUNSUPPORTED,
            "JSON Schema: 'items' as an array (draft 4 tuples) is not supported; use "
            "prefixItems");
    c->depth++;
    /* the tuple part: prefix item i is present when i < the array's length */
    int np = prefix ? (int)json_array_size(prefix) : 0;
    bool rest_allowed = !(items && json_is_false(items));
    int32_t rest = rest_allowed ? value_of(c, items ? items : NULL) : 0;
    int32_t r;
    if (np == 0) {
        /* min..max items of `rest` */
        int32_t body;
        if (mx < 0)
            body = tdm_ast_list(t, rest, c->sep, mn);
        else if (mx == 0)
            body = tdm_ast_empty(t);
        else {
            int32_t more =
                tdm_ast_rep(t, tdm_ast_cat(t, c->sep, rest), mn > 0 ? mn - 1 : 0, mx - 1);
            body = tdm_ast_cat(t, rest, more);
            if (mn == 0) body = tdm_ast_opt(t, body);
        }
        r = open_close(c, "[", body, "]");
    } else {
        /* build from the back: tail(i) = what may follow prefix item i-1 (i items so far) */
        int32_t tail = 0;
        int total_max = mx < 0 ? -1 : mx;
        if (!rest_allowed || total_max == np) {
            tail = tdm_ast_empty(t);
        } else {
            int lo = mn > np ? mn - np : 0;
            int hi = total_max < 0 ? -1 : total_max - np;
            tail =
                hi == 0 ? tdm_ast_empty(t) : tdm_ast_rep(t, tdm_ast_cat(t, c->sep, rest), lo, hi);
        }
        for (int i = np - 1; i >= 0 && ast_ok(t); i--) {
            int32_t item = value_of(c, json_array_get(prefix, (size_t)i));
            int32_t here =
                tdm_ast_cat(t, i ? c->sep : tdm_ast_empty(t), tdm_ast_cat(t, item, tail));
            /* the array may end before item i when i items meet minItems */
            tail = (i >= mn && (mx < 0 || i <= mx)) ? tdm_ast_opt(t, here) : here;
            if (mx >= 0 && i >= mx) tail = tdm_ast_empty(t);
        }
        r = open_close(c, "[", tail, "]");
    }
    c->depth--;
    return r;
}

static int32_t key_of(struct sc *c, const char *name)
{
    json_t *k = json_string(name);
    if (!k)
        return tdm_ast_fail(c->t, TDM_EINVAL, "JSON Schema: a property name is not valid UTF-8");
    int32_t n = literal_json(c, k);
    json_decref(k);
    return n;
}

static bool in_required(json_t *req, const char *name)
{
    size_t i;
    json_t *v;
    json_array_foreach(req, i,
                       v) if (json_is_string(v) && !strcmp(json_string_value(v), name)) return true;
    return false;
}

static int32_t object_of(struct sc *c, json_t *s)
{
    struct ast *t = c->t;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'properties' must be an object");
    if (req && !json_is_array(req))
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'required' must be an array");
    c->depth++;
    /* the members in order: the schema's properties, then required names it does not define */
    enum { MAX_PROPS = 256 };
    int32_t member[MAX_PROPS];
    bool need[MAX_PROPS];
    int n = 0;
    const char *name;
    json_t *ps;
    json_object_foreach(props, name, ps)
    {
        if (n == MAX_PROPS) {
            c->depth--;
            return tdm_ast_fail(t, TDM_ERANGE, "JSON Schema: more than %d properties", MAX_PROPS);
        }
        member[n] = tdm_ast_cat(t, key_of(c, name), tdm_ast_cat(t, c->colon, value_of(c, ps)));
        need[n++] = req && in_required(req, name);
    }
    size_t i;
    json_t *rv;
    json_array_foreach(req, i, rv)
    {
        if (!json_is_string(rv)) {
            c->depth--;
            return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'required' must list strings");
        }
        if (props && json_object_get(props, json_string_value(rv))) continue;
        if (n == MAX_PROPS) {
            c->depth--;
            return tdm_ast_fail(t, TDM_ERANGE, "JSON Schema: more than %d properties", MAX_PROPS);
        }
        json_t *sub = addl && json_is_object(addl) ? addl : NULL;
        if (addl && json_is_false(addl)) {
            c->depth--;
            return tdm_ast_fail(t, TDM_EINVAL,
                                "JSON Schema: '%.60s' is required, not a property, and "
                                "additionalProperties is false",
                                json_string_value(rv));
        }
        member[n] = tdm_ast_cat(t, key_of(c, json_string_value(rv)),
                                tdm_ast_cat(t, c->colon, value_of(c, sub)));
        need[n++] = true;
    }
    int32_t body;
    if (n == 0) {
        /* no named members: any members of additionalProperties' schema, or none */
        if (addl && json_is_false(addl))
            body = tdm_ast_empty(t);
        else {
            int32_t kv = tdm_ast_cat(
                t, any_string(c, 0, -1),
                tdm_ast_cat(t, c->colon, value_of(c, json_is_object(addl) ? addl : NULL)));
            body = tdm_ast_list(t, kv, c->sep, 0);
        }
    } else {
        /* the first required member r anchors the commas: those before it are optional and
         * followed by a comma, those after it are preceded by one. Without any required
         * member, the first present member is each one in turn. */
        int first_req = -1;
        for (int k = 0; k < n && first_req < 0; k++)
            if (need[k]) first_req = k;
        if (first_req >= 0) {
            body = tdm_ast_empty(t);
            for (int k = n - 1; k > first_req; k--) {
                int32_t m = tdm_ast_cat(t, c->sep, member[k]);
                body = tdm_ast_cat(t, need[k] ? m : tdm_ast_opt(t, m), body);
            }
            body = tdm_ast_cat(t, member[first_req], body);
            for (int k = first_req - 1; k >= 0; k--)
                body = tdm_ast_cat(t, tdm_ast_opt(t, tdm_ast_cat(t, member[k], c->sep)), body);
        } else {
            body = tdm_ast_empty(t);          /* no member at all */
            int32_t after = tdm_ast_empty(t); /* optional ", member" for members after k */
            for (int k = n - 1; k >= 0; k--) {
                body = tdm_ast_alt(t, body, tdm_ast_cat(t, member[k], after));
                after = tdm_ast_cat(t, tdm_ast_opt(t, tdm_ast_cat(t, c->sep, member[k])), after);
            }
        }
    }
    c->depth--;
    return open_close(c, "{", body, "}");
}

/* ---- $ref ---- */
static json_t *resolve_ref(struct sc *c, const char *ref)
{
    if (ref[0] != '#') return NULL;
    json_t *cur = c->root;
    const char *p = ref + 1;
    while (*p == '/' && cur) {
        p++;
        char tok[256];
        size_t n = 0;
        for (; *p && *p != '/'; p++) {
            char ch = *p;
            if (ch == '~' && (p[1] == '0' || p[1] == '1')) ch = *++p == '0' ? '~' : '/';
            if (n + 1 >= sizeof tok) return NULL;
            tok[n++] = ch;
        }
        tok[n] = 0;
        if (json_is_object(cur)) {
            cur = json_object_get(cur, tok);
        } else if (json_is_array(cur)) {
            char *e;
            long k = strtol(tok, &e, 10);
            cur = *e || k < 0 ? NULL : json_array_get(cur, (size_t)k);
        } else {
            cur = NULL;
        }
    }
    return *p ? NULL : cur;
}

/* ---- any schema ---- */
static const char *const IGNORED[] = {
    "title",   "description",      "default",         "examples", "$schema",
    "$id",     "$comment",         "deprecated",      "readOnly", "writeOnly",
    "$defs",   "definitions",      "nullable",        "strict",   "name",
    "$anchor", "contentMediaType", "contentEncoding",
};
static const char *const HANDLED[] = {
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "unevaluatedProperties",
};

static bool listed(const char *const *l, size_t n, const char *k)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(l[i], k)) return true;
    return false;
}

static int32_t of_type(struct sc *c, json_t *s, const char *type)
{
    struct ast *t = c->t;
    if (!strcmp(type, "string")) return string_of(c, s);
    if (!strcmp(type, "integer")) return number_of(c, s, true);
    if (!strcmp(type, "number")) return number_of(c, s, false);
    if (!strcmp(type, "boolean"))
        return tdm_ast_alt(t, tdm_ast_lit(t, "true", 4), tdm_ast_lit(t, "false", 5));
    if (!strcmp(type, "null")) return tdm_ast_lit(t, "null", 4);
    if (!strcmp(type, "array")) return array_of(c, s);
    if (!strcmp(type, "object")) return object_of(c, s);
    return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: unknown type '%.40s'", type);
}

/* any JSON value; at the depth limit, only scalars */
static int32_t any_value(struct sc *c)
{
    struct ast *t = c->t;
    int32_t r = any_string(c, 0, -1);
    r = tdm_ast_alt(t, r, number_of(c, NULL, false));
    r = tdm_ast_alt(t, r, tdm_ast_alt(t, tdm_ast_lit(t, "true", 4), tdm_ast_lit(t, "false", 5)));
    r = tdm_ast_alt(t, r, tdm_ast_lit(t, "null", 4));
    if (c->depth < TDM_GRAMMAR_MAX_DEPTH) {
        c->depth++;
        int32_t v = any_value(c);
        int32_t kv = tdm_ast_cat(t, any_string(c, 0, -1), tdm_ast_cat(t, c->colon, v));
        r = tdm_ast_alt(t, r, open_close(c, "{", tdm_ast_list(t, kv, c->sep, 0), "}"));
        r = tdm_ast_alt(t, r, open_close(c, "[", tdm_ast_list(t, v, c->sep, 0), "]"));
        c->depth--;
    }
    return r;
}

static int32_t value_of(struct sc *c, json_t *s)
{
    struct ast *t = c->t;
    if (!ast_ok(t)) return 0;
    if (!s || json_is_true(s)) return any_value(c);
    if (json_is_false(s)) return 0;
    if (!json_is_object(s))
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: a schema must be an object or a boolean");
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v)
    {
        if (listed(HANDLED, sizeof HANDLED / sizeof *HANDLED, k) ||
            listed(IGNORED, sizeof IGNORED / sizeof *IGNORED, k))
            continue;
        return tdm_ast_fail(t, TDM_EUNSUPPORTED, "JSON Schema keyword '%.60s' is not supported", k);
    }
    json_t *u = json_object_get(s, "unevaluatedProperties");
    if (u && !json_is_false(u))
        return tdm_ast_fail(
            t, TDM_EUNSUPPORTED,
            "JSON Schema keyword 'unevaluatedProperties' is supported only as false");
    if ((v = json_object_get(s, "$ref"))) {
        if (!json_is_string(v))
            return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: '$ref' must be a string");
        json_t *target = resolve_ref(c, json_string_value(v));
        if (!target)
            return tdm_ast_fail(t, TDM_EUNSUPPORTED,
                                "JSON Schema: $ref '%.80s' does not resolve inside the schema",
                                json_string_value(v));
        int active = 0;
        for (int i = 0; i < c->n_refs; i++)
            active += c->refs[i] == target;
        if (active >= TDM_GRAMMAR_MAX_DEPTH) return 0; /* recursion cut: this branch ends */
        if (c->n_refs == MAX_REFS)
            return tdm_ast_fail(t, TDM_ERANGE, "JSON Schema: $ref nests deeper than %d", MAX_REFS);
        c->refs[c->n_refs++] = target;
        int32_t r = value_of(c, target);
        c->n_refs--;
        return r;
    }
    if ((v = json_object_get(s, "const"))) return literal_json(c, v);
    if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || !json_array_size(v))
            return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'enum' must be a non-empty array");
        int32_t r = 0;
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) r = tdm_ast_alt(t, r, literal_json(c, e));
        return r;
    }
    json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");
    if (any) {
        if (!json_is_array(any) || !json_array_size(any))
            return tdm_ast_fail(t, TDM_EINVAL,
                                "JSON Schema: anyOf/oneOf must be a non-empty array");
        int32_t r = 0;
        size_t i;
        json_t *e;
        json_array_foreach(any, i, e) r = tdm_ast_alt(t, r, value_of(c, e));
        return r;
    }
    if ((v = json_object_get(s, "allOf"))) {
        if (!json_is_array(v) || json_array_size(v) != 1)
            return tdm_ast_fail(t, TDM_EUNSUPPORTED,
                                "JSON Schema: 'allOf' is supported with exactly one schema");
        return value_of(c, json_array_get(v, 0));
    }
    json_t *type = json_object_get(s, "type");
    if (json_is_string(type)) return of_type(c, s, json_string_value(type));
    if (json_is_array(type)) {
        int32_t r = 0;
        size_t i;
        json_t *e;
        json_array_foreach(type, i, e)
        {
            if (!json_is_string(e))
                return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'type' lists strings");
            r = tdm_ast_alt(t, r, of_type(c, s, json_string_value(e)));
        }
        return r;
    }
    if (type)
        return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema: 'type' must be a string or an array");
    /* no type: what the keywords imply */
    if (json_object_get(s, "properties") || json_object_get(s, "required") ||
        json_object_get(s, "additionalProperties"))
        return object_of(c, s);
    if (json_object_get(s, "items") || json_object_get(s, "prefixItems")) return array_of(c, s);
    if (json_object_get(s, "pattern") || json_object_get(s, "format") ||
        json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
        return string_of(c, s);
    return any_value(c);
}

static void sc_init(struct sc *c, struct ast *t)
{
    *c = (struct sc){.t = t};
    c->ws = tdm_ast_opt(t, tdm_ast_lit(t, " ", 1));
    c->sep = tdm_ast_cat(t, tdm_ast_lit(t, ",", 1), c->ws);
    c->colon = tdm_ast_cat(t, tdm_ast_lit(t, ":", 1), c->ws);
}

int32_t tdm_schema_to_ast(struct ast *t, const char *src, size_t len)
{
    json_error_t je;
    json_t *root = json_loadb(src, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return tdm_ast_fail(t, TDM_EINVAL, "JSON Schema is not valid JSON: %s", je.text);
    struct sc c;
    sc_init(&c, t);
    c.root = root;
    int32_t r = value_of(&c, root);
    json_decref(root);
    if (ast_ok(t) && t->n[r].kind == AST_NONE)
        return tdm_ast_fail(t, TDM_EINVAL,
                            "JSON Schema: no value satisfies it (within a recursion depth of %d)",
                            TDM_GRAMMAR_MAX_DEPTH);
    return r;
}

int32_t tdm_json_object_ast(struct ast *t)
{
    struct sc c;
    sc_init(&c, t);
    c.depth = 1; /* the object's own level */
    int32_t v = any_value(&c);
    int32_t kv = tdm_ast_cat(t, any_string(&c, 0, -1), tdm_ast_cat(t, c.colon, v));
    return open_close(&c, "{", tdm_ast_list(t, kv, c.sep, 0), "}");
}

int32_t tdm_choice_to_ast(struct ast *t, const char *src, size_t len)
{
    json_error_t je;
    json_t *root = json_loadb(src, len, 0, &je);
    if (!root || !json_is_array(root) || !json_array_size(root)) {
        json_decref(root);
        return tdm_ast_fail(t, TDM_EINVAL, "choices must be a non-empty JSON array of strings");
    }
    int32_t r = 0;
    size_t i;
    json_t *e;
    json_array_foreach(root, i, e)
    {
        if (!json_is_string(e)) {
            json_decref(root);
            return tdm_ast_fail(t, TDM_EINVAL, "choices must be a non-empty JSON array of strings");
        }
        r = tdm_ast_alt(t, r, tdm_ast_lit(t, json_string_value(e), json_string_length(e)));
    }
    json_decref(root);
    return r;
}

int32_t tdm_tool_calls_to_ast(struct ast *t, const char *src, size_t len)
{
    json_error_t je;
    json_t *root = json_loadb(src, len, 0, &je);
    json_t *fmt = json_object_get(root, "format"), *tools = json_object_get(root, "tools");
    bool hermes = json_is_string(fmt) && !strcmp(json_string_value(fmt), "hermes");
    bool llama3 = json_is_string(fmt) && !strcmp(json_string_value(fmt), "llama3");
    if (!root || (!hermes && !llama3) || !json_is_array(tools) || !json_array_size(tools)) {
        json_decref(root);
        return tdm_ast_fail(t, TDM_EINVAL, "tool calls: a format and a non-empty list of tools");
    }
    struct sc c;
    sc_init(&c, t);
    int32_t any = 0;
    size_t i;
    json_t *tool;
    json_array_foreach(tools, i, tool)
    {
        json_t *name = json_object_get(tool, "name"), *params = json_object_get(tool, "parameters");
        if (!json_is_string(name)) {
            json_decref(root);
            return tdm_ast_fail(t, TDM_EINVAL, "tool calls: tool %zu has no name", i);
        }
        c.root = params;
        c.n_refs = c.depth = 0;
        /* no parameters: no arguments, {} (as OpenAI sends them) */
        int32_t args = params ? value_of(&c, params) : tdm_ast_lit(t, "{}", 2);
        const char *n = json_string_value(name);
        int32_t call =
            tdm_ast_cat(t,
                        tdm_ast_lit(t, hermes ? "<tool_call>\n{\"name\": \"" : "{\"name\": \"",
                                    hermes ? 22 : 10),
                        tdm_ast_lit(t, n, strlen(n)));
        call = tdm_ast_cat(t, call,
                           tdm_ast_lit(t, hermes ? "\", \"arguments\": " : "\", \"parameters\": ",
                                       hermes ? 16 : 17));
        call = tdm_ast_cat(t, call, args);
        call = tdm_ast_cat(t, call,
                           hermes ? tdm_ast_lit(t, "}\n</tool_call>", 14) : tdm_ast_lit(t, "}", 1));
        any = tdm_ast_alt(t, any, call);
        if (!ast_ok(t)) break;
    }
    bool parallel = json_is_true(json_object_get(root, "parallel"));
    json_decref(root);
    /* parallel: one call or more, separated by a newline (the item instantiated once) */
    if (hermes && parallel) any = tdm_ast_list(t, any, tdm_ast_lit(t, "\n", 1), 1);
    return any;
}
