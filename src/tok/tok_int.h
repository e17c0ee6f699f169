/*
 * Private declarations of the tok module: the tokenizer object, its builder (used by the GGUF
 * and tokenizer.json loaders), the pre-tokenizer stages, the BPE merge engine and the UTF-8
 * helpers.
 *
 * One representation serves every supported family. A tokenizer is:
 *   - a token table (text as stored in the vocabulary, decoded bytes, type, flags);
 *   - a text -> id hash;
 *   - a pair table (left id, right id) -> (rank, merged id). Byte-level BPE and tokenizer.json
 *     SPM fill it from the merge list (rank = merge index); GGUF SPM fills it from the scores
 *     (rank = dense rank of the merged token's score, best first), so the one merge loop in
 *     bpe.c, which always applies the lowest (rank, position) first, reproduces both HF BPE and
 *     SentencePiece/llama.cpp score-ordered merging;
 *   - the text pipeline applied to each run of text between added tokens: normaliser ops
 *     (prepend / replace), an optional Metaspace step, then pre-tokenizer stages that cut the
 *     text into pieces, then the model on each piece.
 *
 * Invariants once tdm_tok_finalize() has succeeded: every entry's text and piece lie in strs;
 * by_text maps each non-empty token text to its lowest id; every pair value names ids below
 * n_vocab; split_ids lists the added tokens with non-empty valid UTF-8 text, grouped by first
 * byte and longest first within a group. The object is then read-only.
 */
#ifndef TDM_TOK_INT_H
#define TDM_TOK_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tandem/tok.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Hard caps on what a tokenizer file may describe. */
#define TOK_MAX_VOCAB       (1 << 22)
#define TOK_MAX_TOKEN_BYTES (1 << 16)
#define TOK_MAX_MERGES      (1 << 23)
#define TOK_MAX_STAGES      8
#define TOK_MAX_NORM_OPS    8
#define TOK_MAX_JSON_BYTES  ((size_t)512 << 20)

/* Token types, as GGUF's tokenizer.ggml.token_type stores them. */
enum tok_type {
    TOK_T_NORMAL = 1,
    TOK_T_UNKNOWN = 2,
    TOK_T_CONTROL = 3,
    TOK_T_USER = 4, /* user-defined: a non-special added token */
    TOK_T_UNUSED = 5,
    TOK_T_BYTE = 6, /* SPM byte-fallback token <0xXX> */
};

enum tok_flag {
    TOK_F_SPECIAL = 1 << 0, /* split from text only under TDM_TOK_PARSE_SPECIAL; skip_special */
    TOK_F_ADDED = 1 << 1,   /* matched in the raw text before pre-tokenisation */
    TOK_F_LSTRIP = 1 << 2,  /* swallows whitespace on its left when matched */
    TOK_F_RSTRIP = 1 << 3,  /* swallows whitespace on its right when matched */
};

struct tok_entry {
    uint32_t text_off, text_len;   /* the token as the vocabulary spells it, in strs */
    uint32_t piece_off, piece_len; /* the bytes it decodes to, in strs */
    uint8_t type;                  /* enum tok_type */
    uint8_t flags;                 /* enum tok_flag */
};

struct tok_strbuf {
    char *p;
    size_t len, cap;
};

enum tok_stage_kind {
    TOK_STAGE_REGEX,     /* matches and the gaps between them both become pieces */
    TOK_STAGE_METASPACE, /* a new piece starts at every replacement character */
};

struct tok_stage {
    enum tok_stage_kind kind;
    pcre2_code *re; /* TOK_STAGE_REGEX */
};

struct tok_norm_op {
    bool prepend; /* true: prepend `to` to a non-empty run; false: replace `from` by `to` */
    char *from, *to;
    size_t from_len, to_len;
};

enum tok_prepend { TOK_PREPEND_NEVER = 0, TOK_PREPEND_ALWAYS, TOK_PREPEND_FIRST };

struct tdm_tok {
    enum tdm_tok_kind kind;
    int n_vocab;
    struct tok_entry *entries; /* [n_vocab] */
    struct tok_strbuf strs;    /* token texts and pieces, back to back */

    uint32_t *text_slots; /* [text_mask + 1] id + 1, 0 = empty: open addressing on text */
    size_t text_mask;

    uint64_t *pair_keys; /* [pair_mask + 1] left << 32 | right; UINT64_MAX = empty */
    uint64_t *pair_vals; /* [pair_mask + 1] rank << 32 | merged id */
    size_t pair_mask, n_pairs;

    /* model */
    int32_t byte_sym[256]; /* BPE_BYTES: id of the byte-level character of each byte, or -1 */
    int32_t byte_tok[256]; /* SPM: id of <0xXX>, or -1 */
    uint16_t byte_cp[256]; /* the GPT-2 byte -> code point map */
    bool byte_fallback;    /* SPM: unknown characters become <0xXX> tokens */
    bool fuse_unk;         /* consecutive unknown symbols become one <unk> */
    bool ignore_merges;    /* a piece that is itself a token is emitted as is */

    /* text pipeline */
    struct tok_norm_op norm[TOK_MAX_NORM_OPS];
    int n_norm;
    bool metaspace;         /* Metaspace pre-tokenizer: ' ' -> replacement, then prepend */
    char metaspace_repl[8]; /* UTF-8 of the replacement character */
    size_t metaspace_repl_len;
    enum tok_prepend metaspace_prepend;
    struct tok_stage stages[TOK_MAX_STAGES];
    int n_stages;

    /* decoding */
    bool strip_leading_space; /* SPM: drop one leading space of the decoded text */

    int bos, eos, unk, pad; /* -1 when absent */
    bool add_bos;

    /* added tokens, for splitting them out of the text */
    int32_t *split_ids; /* [n_split] grouped by first byte, longest first */
    int n_split;
    uint32_t split_first[257]; /* split_ids[split_first[b] .. split_first[b+1]) start with b */
};

/* ---- UTF-8 and byte-level helpers (text.c; tdm_tok_utf8_valid is in tok.h) ---- */
/* Length of the UTF-8 sequence at s (which must be valid), 1..4. */
int tdm_tok_utf8_len(unsigned char lead);
/* Decodes one code point from valid UTF-8 at s; returns its byte length. */
int tdm_tok_utf8_decode(const char *s, uint32_t *cp);
/* Writes cp as UTF-8 into buf (>= 4 bytes); returns the byte count. */
int tdm_tok_utf8_encode(uint32_t cp, char *buf);
/* The GPT-2 byte-level map: printable bytes map to themselves, the rest to U+0100... */
void tdm_tok_bytes_to_unicode(uint16_t map[256]);
/* Python str.isspace() (what Jinja's trim strips). */
bool tdm_tok_is_py_space(uint32_t cp);

/* ---- builder and table (vocab.c) ---- */
tdm_status tdm_tok_create(enum tdm_tok_kind kind, int n_vocab, struct tdm_tok **out);
/* Sets the text and type of token `id` (not yet indexed). */
tdm_status tdm_tok_set_token(struct tdm_tok *tok, int id, const char *text, size_t len,
                             enum tok_type type, unsigned flags);
/* Builds the text -> id index; call once every token is set. */
tdm_status tdm_tok_build_index(struct tdm_tok *tok);
/* Id of the token spelled exactly text[0..len), or -1. */
int tdm_tok_lookup(const struct tdm_tok *tok, const char *text, size_t len);
const char *tdm_tok_text(const struct tdm_tok *tok, int id, size_t *len);
/* Records that (left, right) merges into `merged` with priority `rank` (lower first). A pair
 * already present keeps its first rank. Sized by tdm_tok_reserve_pairs beforehand. */
tdm_status tdm_tok_reserve_pairs(struct tdm_tok *tok, size_t n);
tdm_status tdm_tok_add_pair(struct tdm_tok *tok, int left, int right, uint32_t rank, int merged);
/* Looks up a pair; false when the two do not merge. */
bool tdm_tok_find_pair(const struct tdm_tok *tok, int left, int right, uint32_t *rank, int *merged);
/* Adds a normaliser op (copies the strings). */
tdm_status tdm_tok_add_norm(struct tdm_tok *tok, bool prepend, const char *from, size_t from_len,
                            const char *to, size_t to_len);
/* Adds a pre-tokenizer stage (PCRE2 pattern, UTF + UCP; `literal` quotes it). */
tdm_status tdm_tok_add_regex_stage(struct tdm_tok *tok, const char *pattern, size_t len,
                                   bool literal);
tdm_status tdm_tok_add_metaspace_stage(struct tdm_tok *tok);
/* Computes pieces, byte tables and the added-token index. */
tdm_status tdm_tok_finalize(struct tdm_tok *tok);

/* Built-in pre-tokenizer regexes. */
extern const char TDM_TOK_RE_GPT2[];
extern const char TDM_TOK_RE_LLAMA3[];
extern const char TDM_TOK_RE_QWEN2[];

/* ---- BPE merge engine (bpe.c) ---- */
struct tok_sym {
    int32_t id;         /* -1 once merged into its left neighbour */
    int32_t prev, next; /* neighbours, -1 at the ends */
};

struct tok_cand {
    uint32_t rank;
    uint32_t pos; /* index of the left symbol */
    int32_t merged;
};

struct tok_bpe_work {
    struct tok_sym *syms;
    size_t cap_syms;
    struct tok_cand *heap;
    size_t cap_heap, n_heap;
};

/* Ensures room for n symbols (and their candidates). */
tdm_status tdm_tok_bpe_reserve(struct tok_bpe_work *w, size_t n);
void tdm_tok_bpe_work_free(struct tok_bpe_work *w);
/* Merges syms[0..n) (linked in order) in place: always the candidate pair with the lowest
 * (rank, left position) first, as HF's BPE and llama.cpp's SPM do. */
void tdm_tok_bpe_merge(const struct tdm_tok *tok, struct tok_bpe_work *w, size_t n);

#endif /* TDM_TOK_INT_H */
