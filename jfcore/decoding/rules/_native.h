/* What the C files of jfcore.decoding.rules._native share: the n-gram pool (_ngram.c) and the prompt lookup
   (_lookup.c), which the row rules (_step.c) use without going through Python. */

#ifndef JF_NATIVE_H
#define JF_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_ssize_t size;  /* continuations kept per first token */
    Py_ssize_t span;  /* tokens after the first one: ngram_size - 1 */
    int32_t *tokens, *older;
    Py_ssize_t length, capacity;
    int32_t *keys, *places; /* newest: first token -> its newest place, linear probing */
    Py_ssize_t mask, filled;
    int32_t *kept; /* a read's result: the newest place of each continuation given, `size` at most */
    Py_ssize_t *lengths, *cut;
} Pool;

extern PyTypeObject PoolType;

/* Record a tail of `n` token ids (each checked to be in [0, 2**31 - 1]); -1 with an exception set, and nothing
   recorded, on failure. */
int pool_add(Pool *p, const int64_t *tokens, Py_ssize_t n);

/* Read `first`'s continuations, cut to `max_len` tokens (the Python pool's `candidates`): returns how many; the
   j-th is p->tokens[p->kept[j] + 1 ...], p->cut[j] tokens long. */
Py_ssize_t pool_read(Pool *p, int64_t first, Py_ssize_t max_len);

typedef struct {
    PyObject_HEAD
    Py_ssize_t max_ngram, max_tokens;
    Py_ssize_t candidate_length; /* lookup.py's `length`: this row's current candidate length */
    int64_t *text;
    Py_ssize_t length, capacity;
    uint64_t *hashes; /* the index: an n-gram's hash, size and the place after its latest occurrence */
    int32_t *sizes;
    int64_t *places;
    Py_ssize_t mask, filled;
    int64_t *proposal; /* the last proposal, `proposed` tokens (max_tokens of room) */
    Py_ssize_t proposed;
    int64_t *key; /* a proposal's scratch: the n-gram looked up */
} Lookup;

extern PyTypeObject LookupType;

/* lookup.py's PromptLookup.extend, .propose (the copy in l->proposal, l->proposed tokens) and .update. */
int lookup_extend(Lookup *l, const int64_t *tokens, Py_ssize_t n);
Py_ssize_t lookup_propose(Lookup *l, int64_t next_token, Py_ssize_t limit);
void lookup_update(Lookup *l, Py_ssize_t proposed, Py_ssize_t accepted);

#endif
