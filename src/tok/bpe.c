/*
 * The BPE merge loop shared by every tokenizer kind.
 *
 * A piece starts as a doubly linked list of symbols (token ids). Every adjacent pair that the
 * pair table knows is a candidate (rank, left position, merged id) in a binary min-heap. The
 * loop pops the best candidate, checks it is still current (both symbols alive, adjacent and
 * still the pair that produced the candidate), merges the right symbol into the left one and
 * pushes the two new pairs around the result. Stale candidates are skipped lazily instead of
 * being removed, which keeps each step O(log n): a piece of n symbols costs O(n log n), so
 * long runs of letters or digits stay fast where a rescan-per-merge loop would be O(n^2).
 *
 * Ordering is (rank, left position): HF's BPE ranks every merge uniquely and breaks ties by
 * position; SentencePiece/llama.cpp order by score then leftmost position, which the GGUF
 * loader encodes as a dense rank of the score. Either way the same loop gives the same result.
 *
 * Threading: works only on the caller's tok_bpe_work; the tokenizer is read-only.
 */
#include "tok/tok_int.h"

#include <stdlib.h>

tdm_status tdm_tok_bpe_reserve(struct tok_bpe_work *w, size_t n)
{
    if (n > w->cap_syms) {
        struct tok_sym *s = realloc(w->syms, n * sizeof *s);
        if (!s) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for %zu symbols", n);
        w->syms = s;
        w->cap_syms = n;
    }
    /* n - 1 initial pairs plus at most two new ones per merge */
    size_t heap = n * 3 + 1;
    if (heap > w->cap_heap) {
        struct tok_cand *h = realloc(w->heap, heap * sizeof *h);
        if (!h) return tdm_err_set(TDM_ENOMEM, "tokenizer: out of memory for merge queue");
        w->heap = h;
        w->cap_heap = heap;
    }
    return TDM_OK;
}

void tdm_tok_bpe_work_free(struct tok_bpe_work *w)
{
    free(w->syms);
    free(w->heap);
    w->syms = NULL;
    w->heap = NULL;
    w->cap_syms = w->cap_heap = w->n_heap = 0;
}

static bool cand_less(const struct tok_cand *a, const struct tok_cand *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct tok_bpe_work *w, struct tok_cand c)
{
    TDM_ASSERT(w->n_heap < w->cap_heap);
    size_t i = w->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!cand_less(&c, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = c;
}

static struct tok_cand heap_pop(struct tok_bpe_work *w)
{
    struct tok_cand top = w->heap[0];
    struct tok_cand last = w->heap[--w->n_heap];
    size_t n = w->n_heap, i = 0;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t best = l;
        if (l + 1 < n && cand_less(&w->heap[l + 1], &w->heap[l])) best = l + 1;
        if (!cand_less(&w->heap[best], &last)) break;
        w->heap[i] = w->heap[best];
        i = best;
    }
    if (n) w->heap[i] = last;
    return top;
}

static void try_push(const struct tdm_tok *tok, struct tok_bpe_work *w, int32_t left, int32_t right)
{
    uint32_t rank;
    int merged;
    if (tdm_tok_find_pair(tok, w->syms[left].id, w->syms[right].id, &rank, &merged))
        heap_push(w, (struct tok_cand){.rank = rank, .pos = (uint32_t)left, .merged = merged});
}

void tdm_tok_bpe_merge(const struct tdm_tok *tok, struct tok_bpe_work *w, size_t n)
{
    w->n_heap = 0;
    if (n < 2 || !tok->n_pairs) return;
    for (size_t i = 0; i + 1 < n; i++)
        try_push(tok, w, (int32_t)i, (int32_t)i + 1);
    while (w->n_heap) {
        struct tok_cand c = heap_pop(w);
        struct tok_sym *l = &w->syms[c.pos];
        if (l->id < 0 || l->next < 0) continue;
        struct tok_sym *r = &w->syms[l->next];
        uint32_t rank;
        int merged;
        if (!tdm_tok_find_pair(tok, l->id, r->id, &rank, &merged) || merged != c.merged ||
            rank != c.rank)
            continue; /* stale: one side changed since this candidate was queued */
        l->id = merged;
        l->next = r->next;
        if (r->next >= 0) w->syms[r->next].prev = (int32_t)c.pos;
        r->id = -1;
        if (l->prev >= 0) try_push(tok, w, l->prev, (int32_t)c.pos);
        if (l->next >= 0) try_push(tok, w, (int32_t)c.pos, l->next);
    }
}
