/*
 * tandem grammar: constrained decoding (structured output). A request may carry a grammar: a
 * regular expression, a JSON Schema, "any JSON object", or a list of choices. Its output must
 * then be a string of the grammar's language, token by token.
 *
 * Shape. Every grammar compiles to one byte-level automaton:
 *
 *   source --parse--> AST (set, concatenation, alternation, bounded repetition, separated lists)
 *          --Thompson--> NFA over bytes (UTF-8 spelled out as byte sequences)
 *          --subsets, lazily--> DFA; each DFA state met at a token boundary gets its mask:
 *                               the tokens whose bytes the DFA can read from it
 *
 * The language is regular. What is recursive in a JSON Schema ($ref cycles) or unbounded in
 * nesting ("any JSON value") is unrolled to a fixed depth (TDM_GRAMMAR_MAX_DEPTH); numbers and
 * integers without bounds take at most TDM_GRAMMAR_MAX_DIGITS digits, so a model cannot loop
 * on digits forever. A regular language is what makes the masks precomputable: a DFA state's
 * allowed-token set depends on the state alone, so it is computed once, by walking the
 * vocabulary's byte trie from the state (the subtrees the DFA dies in are skipped), and every
 * later step that reaches the state reads it back (outlines-core's index, built lazily rather
 * than for every state up front, because a JSON grammar's states are many and few are met).
 * A step's mask costs a lookup; the first visit of a state costs one trie walk.
 *
 * The end of the output: the model's end-of-sequence tokens are allowed where the DFA accepts,
 * and a state that accepts and can read no further byte allows them alone (the scheduler
 * finishes the request there without asking the model).
 *
 * Speculation: a grammar's state is a function of the output tokens, so a draft's mask is the
 * state after the drafts before it (tdm_grammar_next along the drafts, nothing mutated), and a
 * rejected draft costs nothing to undo: the committed state never saw it.
 *
 * Ownership and threading: a tdm_gvocab (one per served model: its token bytes, trie and end
 * tokens) owns a cache of compiled grammars keyed by a hash of (kind, source), so a schema
 * that many requests send compiles once. A tdm_grammar is reference-counted; requests hold
 * references. Every function may be called from any thread: a grammar's lazily built part
 * (DFA states, masks) is guarded by the grammar's mutex, and a mask, once returned, is
 * immutable for the grammar's lifetime.
 */
#ifndef TANDEM_GRAMMAR_H
#define TANDEM_GRAMMAR_H

#include "tandem/core.h"
#include "tandem/tok.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_gvocab tdm_gvocab_t;
typedef struct tdm_grammar tdm_grammar_t;

enum tdm_grammar_kind {
    TDM_GRAMMAR_REGEX = 0,   /* an ECMA-262-style regular expression, matched whole */
    TDM_GRAMMAR_JSON_SCHEMA, /* a JSON Schema (text), see docs/structured-output.md */
    TDM_GRAMMAR_JSON_OBJECT, /* any JSON object (OpenAI's json_object); source ignored */
    TDM_GRAMMAR_CHOICE,      /* a JSON array of strings: the output is one of them */
    TDM_GRAMMAR_GBNF,        /* a GBNF grammar (llama.cpp's), root rule "root" */
    /* Tool calls in a chat format: {"format": "hermes" | "llama3", "parallel": bool, "tools":
     * [{"name": ..., "parameters": schema}, ...]}. hermes: <tool_call>\n{"name": "f",
     * "arguments": {...}}\n</tool_call>, one or (parallel) more separated by a newline;
     * llama3: {"name": "f", "parameters": {...}}. The arguments follow the tool's schema. */
    TDM_GRAMMAR_TOOL_CALLS,
};

/* Nesting unrolled for recursion and for "any JSON value" */
#define TDM_GRAMMAR_MAX_DEPTH 5
/* Digits of an integer part, a fraction or an unbounded string repetition's cap */
#define TDM_GRAMMAR_MAX_DIGITS 15
/* Caps on what a grammar may grow to; past them compilation fails with TDM_ERANGE */
#define TDM_GRAMMAR_MAX_NFA       (1 << 20)
#define TDM_GRAMMAR_MAX_DFA       (1 << 16)
#define TDM_GRAMMAR_MAX_SOURCE    (256 * 1024)
#define TDM_GRAMMAR_CACHE_ENTRIES 64
/* Dead state: tdm_grammar_next's answer for a token the grammar does not allow */
#define TDM_GRAMMAR_DEAD (-1)

/* The vocabulary as bytes: tok's piece for every id below `vocab` (the model's logit rows,
 * which may exceed the tokenizer's size; those ids are never allowed), special tokens left
 * out, and eos[0, n_eos) allowed where a grammar accepts. tok must outlive the result. */
tdm_status tdm_gvocab_create(const tdm_tok_t *tok, int vocab, const int *eos, int n_eos,
                             tdm_gvocab_t **out);
/* Releases the owner's hold (and the cache's grammars); grammars still held elsewhere keep the
 * vocabulary alive until they are released. tok must outlive them all. */
void tdm_gvocab_free(tdm_gvocab_t *v);
int tdm_gvocab_size(const tdm_gvocab_t *v);
/* Words of a mask: bit t of word t / 32 is token t */
static inline int tdm_grammar_mask_words(int vocab)
{
    return (vocab + 31) / 32;
}

/* Compiles (or finds in v's cache) the grammar of `kind` from src[0, len). On failure the
 * status is TDM_EINVAL (malformed), TDM_EUNSUPPORTED (a feature not implemented: the message
 * names it) or TDM_ERANGE (too large), with tdm_err_msg() saying what. The caller owns one
 * reference on success. */
tdm_status tdm_grammar_get(tdm_gvocab_t *v, enum tdm_grammar_kind kind, const char *src, size_t len,
                           tdm_grammar_t **out);
tdm_grammar_t *tdm_grammar_ref(tdm_grammar_t *g);
int tdm_grammar_vocab_size(const tdm_grammar_t *g); /* its vocabulary's rows */
void tdm_grammar_unref(tdm_grammar_t *g);           /* NULL: nothing */
/* Compiled grammars v's cache holds, and its lookups that found one (tests, metrics) */
void tdm_gvocab_cache_stats(tdm_gvocab_t *v, int *entries, uint64_t *hits, uint64_t *misses);

/* ---- matching: a state is an int; requests keep their own ---- */
int32_t tdm_grammar_start(tdm_grammar_t *g);
/* The state after `token` from `state`, or TDM_GRAMMAR_DEAD when the token is not allowed
 * there (an end token is allowed where the grammar accepts, and leaves the state as it is).
 * TDM_GRAMMAR_DEAD in, TDM_GRAMMAR_DEAD out. */
int32_t tdm_grammar_next(tdm_grammar_t *g, int32_t state, int32_t token);
/* The allowed tokens at `state`: [tdm_grammar_mask_words(vocab)] words, valid for g's
 * lifetime. NULL only when memory ran out or the state is dead. */
const uint32_t *tdm_grammar_mask(tdm_grammar_t *g, int32_t state);
bool tdm_grammar_accepting(tdm_grammar_t *g, int32_t state);
/* Accepting, and no byte may follow: the output is complete. */
bool tdm_grammar_complete(tdm_grammar_t *g, int32_t state);
/* Whether bytes s[0, len) read from `state` stay in the language (tests, tools). */
int32_t tdm_grammar_feed(tdm_grammar_t *g, int32_t state, const char *s, size_t len);
/* States and masks built so far (tests, the benchmark) */
void tdm_grammar_stats(tdm_grammar_t *g, int *nfa_states, int *dfa_states, int *masks);

#ifdef __cplusplus
}
#endif
#endif /* TANDEM_GRAMMAR_H */
