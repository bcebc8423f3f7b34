/* The prompt lookup of jfcore/decoding/candidates/lookup.py (`PromptLookup`) in C: the same index and the same candidates.

   That module is the reference and says how prompt lookup works (docs/DESIGN.md, section 7); this file is what
   rows use where it was built, so that the C step (_step.c) proposes, adapts and extends without Python. The
   index maps every n-gram of 1..max_ngram tokens of the row's text to the place right after its latest
   occurrence: an open-addressing table of (n, hash, place) entries, an entry's n-gram read back from the text
   itself (the place's n tokens before it) to tell collisions apart. */

#include "_native.h"
#include <string.h>

#define FREE (-1) /* an unused table entry's place */

static uint64_t gram_hash(const int64_t *tokens, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15u ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (uint64_t)tokens[i];
        h *= 0xBF58476D1CE4E5B9u;
        h ^= h >> 31;
    }
    return h;
}

/* The entry of the n-gram `tokens` (n of them): its own, or the free one where it would go. */
static Py_ssize_t find(const Lookup *l, const int64_t *tokens, Py_ssize_t n, uint64_t hash) {
    Py_ssize_t i = (Py_ssize_t)(hash & (uint64_t)l->mask);
    while (l->places[i] != FREE) {
        if (l->hashes[i] == hash && l->sizes[i] == n &&
            memcmp(l->text + l->places[i] - n, tokens, (size_t)n * sizeof(int64_t)) == 0)
            return i;
        i = (i + 1) & l->mask;
    }
    return i;
}

static int table_new(Lookup *l, Py_ssize_t slots) {
    l->hashes = PyMem_New(uint64_t, slots);
    l->sizes = PyMem_New(int32_t, slots);
    l->places = PyMem_New(int64_t, slots);
    if (l->hashes == NULL || l->sizes == NULL || l->places == NULL) {
        PyMem_Free(l->hashes), PyMem_Free(l->sizes), PyMem_Free(l->places);
        l->hashes = NULL, l->sizes = NULL, l->places = NULL;
        return -1;
    }
    for (Py_ssize_t i = 0; i < slots; i++) l->places[i] = FREE;
    l->mask = slots - 1;
    return 0;
}

static int table_grow(Lookup *l) {
    uint64_t *hashes = l->hashes;
    int32_t *sizes = l->sizes;
    int64_t *places = l->places;
    Py_ssize_t old_slots = l->mask + 1;
    if (table_new(l, 2 * old_slots) < 0) {
        l->hashes = hashes, l->sizes = sizes, l->places = places, l->mask = old_slots - 1;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_slots; i++) {
        if (places[i] == FREE) continue;
        Py_ssize_t j = (Py_ssize_t)(hashes[i] & (uint64_t)l->mask);
        while (l->places[j] != FREE) j = (j + 1) & l->mask;
        l->hashes[j] = hashes[i], l->sizes[j] = sizes[i], l->places[j] = places[i];
    }
    PyMem_Free(hashes), PyMem_Free(sizes), PyMem_Free(places);
    return 0;
}

int lookup_extend(Lookup *l, const int64_t *tokens, Py_ssize_t n) {
    if (l->length + n > l->capacity) {
        Py_ssize_t capacity = l->capacity ? l->capacity : 256;
        while (capacity < l->length + n) capacity *= 2;
        int64_t *text = PyMem_Realloc(l->text, (size_t)capacity * sizeof(int64_t));
        if (text == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        l->text = text, l->capacity = capacity;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        l->text[l->length++] = tokens[k];
        /* The n-grams that end just before the new token now have it as their continuation. */
        Py_ssize_t end = l->length - 1;
        for (Py_ssize_t g = 1; g <= Py_MIN(l->max_ngram, end); g++) {
            while (2 * (l->filled + 1) > l->mask + 1)
                if (table_grow(l) < 0) {
                    PyErr_NoMemory();
                    return -1;
                }
            const int64_t *gram = l->text + end - g;
            uint64_t hash = gram_hash(gram, g);
            Py_ssize_t i = find(l, gram, g, hash);
            if (l->places[i] == FREE) {
                l->hashes[i] = hash, l->sizes[i] = (int32_t)g;
                l->filled++;
            }
            l->places[i] = end;
        }
    }
    return 0;
}

Py_ssize_t lookup_propose(Lookup *l, int64_t next_token, Py_ssize_t limit) {
    Py_ssize_t size = Py_MIN(limit, l->candidate_length), n = l->length;
    l->proposed = 0;
    if (size <= 0) return 0;
    int64_t *key = l->key;
    for (Py_ssize_t g = Py_MIN(l->max_ngram, n + 1); g >= 1; g--) {
        /* The text's last g - 1 tokens, then `next_token`. */
        memcpy(key, l->text + n - g + 1, (size_t)(g - 1) * sizeof(int64_t));
        key[g - 1] = next_token;
        Py_ssize_t i = find(l, key, g, gram_hash(key, g));
        if (l->places[i] == FREE) continue;
        /* Copy from text + [next_token] + the copy itself: a match close to the end runs on into the text being
           written, so a repeating pattern still gets a whole candidate. */
        int64_t start = l->places[i];
        for (Py_ssize_t c = 0; c < size; c++) {
            int64_t at = start + c;
            l->proposal[c] = at < n ? l->text[at] : at == n ? next_token : l->proposal[at - n - 1];
        }
        l->proposed = size;
        return size;
    }
    return 0;
}

void lookup_update(Lookup *l, Py_ssize_t proposed, Py_ssize_t accepted) {
    if (proposed == 0) return;
    l->candidate_length =
        accepted == proposed ? Py_MIN(l->candidate_length + 2, l->max_tokens) : Py_MAX(l->candidate_length - 1, 1);
}

/* -- the Python type: lookup.py's PromptLookup interface -------------------------------------------------------- */

static int tokens_of(PyObject *sequence, int64_t **tokens, Py_ssize_t *n) {
    PyObject *fast = PySequence_Fast(sequence, "PromptLookup takes a sequence of token ids");
    if (fast == NULL) return -1;
    *n = PySequence_Fast_GET_SIZE(fast);
    *tokens = PyMem_New(int64_t, *n + 1);
    int failed = *tokens == NULL;
    if (failed) PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < *n && !failed; i++) {
        (*tokens)[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        failed = (*tokens)[i] == -1 && PyErr_Occurred();
    }
    Py_DECREF(fast);
    if (failed) {
        PyMem_Free(*tokens);
        *tokens = NULL;
    }
    return failed ? -1 : 0;
}

static PyObject *Lookup_extend(Lookup *l, PyObject *sequence) {
    int64_t *tokens;
    Py_ssize_t n;
    if (l->places == NULL) return PyErr_Format(PyExc_RuntimeError, "PromptLookup.__init__ was not called");
    if (tokens_of(sequence, &tokens, &n) < 0) return NULL;
    int r = lookup_extend(l, tokens, n);
    PyMem_Free(tokens);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static int Lookup_init(Lookup *l, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"max_ngram", "max_tokens", "text", NULL};
    Py_ssize_t max_ngram, max_tokens;
    PyObject *text = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn|O", names, &max_ngram, &max_tokens, &text)) return -1;
    if (max_ngram < 1 || max_tokens < 0) {
        PyErr_SetString(PyExc_ValueError, "prompt lookup needs max_ngram >= 1 and max_tokens >= 0");
        return -1;
    }
    if (l->places != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a prompt lookup is initialised once");
        return -1;
    }
    l->max_ngram = max_ngram, l->max_tokens = max_tokens, l->candidate_length = max_tokens;
    l->proposal = PyMem_New(int64_t, max_tokens + 1);
    l->key = PyMem_New(int64_t, max_ngram);
    if (l->proposal == NULL || l->key == NULL || table_new(l, 256) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (text != NULL) {
        PyObject *done = Lookup_extend(l, text);
        if (done == NULL) return -1;
        Py_DECREF(done);
    }
    return 0;
}

static void Lookup_dealloc(Lookup *l) {
    PyMem_Free(l->text);
    PyMem_Free(l->hashes);
    PyMem_Free(l->sizes);
    PyMem_Free(l->places);
    PyMem_Free(l->proposal);
    PyMem_Free(l->key);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static PyObject *Lookup_propose(Lookup *l, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"next_token", "limit", NULL};
    long long next_token;
    Py_ssize_t limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ln", names, &next_token, &limit)) return NULL;
    if (l->places == NULL) return PyErr_Format(PyExc_RuntimeError, "PromptLookup.__init__ was not called");
    Py_ssize_t n = lookup_propose(l, next_token, limit);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *token = PyLong_FromLongLong(l->proposal[i]);
        if (token == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, token);
    }
    return out;
}

static PyObject *Lookup_update(Lookup *l, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"proposed", "accepted", NULL};
    Py_ssize_t proposed, accepted;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn", names, &proposed, &accepted)) return NULL;
    lookup_update(l, proposed, accepted);
    Py_RETURN_NONE;
}

static PyObject *Lookup_get_length(Lookup *l, void *closure) { return PyLong_FromSsize_t(l->candidate_length); }

static int Lookup_set_length(Lookup *l, PyObject *value, void *closure) {
    Py_ssize_t length = value == NULL ? -1 : PyLong_AsSsize_t(value);
    if (length == -1 && PyErr_Occurred()) return -1;
    if (length < 0 || length > l->max_tokens) {
        PyErr_Format(PyExc_ValueError, "a candidate length must be in [0, max_tokens = %zd]", l->max_tokens);
        return -1;
    }
    l->candidate_length = length;
    return 0;
}

static PyObject *Lookup_get_text(Lookup *l, void *closure) {
    PyObject *out = PyList_New(l->length);
    for (Py_ssize_t i = 0; out != NULL && i < l->length; i++) {
        PyObject *token = PyLong_FromLongLong(l->text[i]);
        if (token == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, token);
    }
    return out;
}

static PyMethodDef Lookup_methods[] = {
    {"extend", (PyCFunction)Lookup_extend, METH_O, "Append committed tokens and index the n-grams they close."},
    {"propose", (PyCFunction)(void (*)(void))Lookup_propose, METH_VARARGS | METH_KEYWORDS,
     "propose(next_token, limit): the copied continuation (at most min(limit, length) tokens), or []."},
    {"update", (PyCFunction)(void (*)(void))Lookup_update, METH_VARARGS | METH_KEYWORDS,
     "update(proposed, accepted): adapt the candidate length."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lookup_getset[] = {
    {"length", (getter)Lookup_get_length, (setter)Lookup_set_length, "this row's current candidate length", NULL},
    {"text", (getter)Lookup_get_text, NULL, "the text indexed so far, as a new list", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject LookupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "jfcore.decoding.rules._native.PromptLookup",
    .tp_doc = "PromptLookup(max_ngram, max_tokens, text=()): jfcore/decoding/candidates/lookup.py's prompt lookup, in C.",
    .tp_basicsize = sizeof(Lookup),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lookup_init,
    .tp_dealloc = (destructor)Lookup_dealloc,
    .tp_methods = Lookup_methods,
    .tp_getset = Lookup_getset,
};
