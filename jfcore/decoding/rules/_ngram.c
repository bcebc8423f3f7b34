/* The rejection-recycling pool of jfcore/decoding/candidates/ngram_pool.py in C: the same records and the same reads.

   That module is the reference and says how the pool works; this file is its fast path (docs/DESIGN.md,
   "The n-gram pools"). A multiblock step adds a rejected tail to every row's pool and reads one first
   token's continuations, right after a forward that has evicted the host's caches: in Python each pool
   access there is a dictionary lookup or a list of boxed integers, about a fifth of a 64-row step's host
   time. Here a pool is two flat int32 arrays and an open-addressing table.

   Records, as in the Python pool: `tokens` holds every tail added, each closed by END; `older[place]` is the
   previous place of the same first token (NONE: none, or the place starts no n-gram); `newest` maps a first
   token to its newest place. Token ids must be in [0, 2**31 - 1].

   The row rules in _step.c add and read through `pool_add` and `pool_read` directly (_native.h). */

#include "_native.h"
#include <string.h>

#define END (-1)  /* closes each tail in `tokens` */
#define NONE (-1) /* no place */
#define EMPTY (-1) /* a free key in the table */

static Py_ssize_t table_slot(const Pool *p, int32_t key) {
    Py_ssize_t i = (Py_ssize_t)(((uint32_t)key * 2654435761u) & (uint32_t)p->mask);
    while (p->keys[i] != EMPTY && p->keys[i] != key) i = (i + 1) & p->mask;
    return i;
}

static int table_new(Pool *p, Py_ssize_t slots) {
    p->keys = PyMem_New(int32_t, slots);
    p->places = PyMem_New(int32_t, slots);
    if (p->keys == NULL || p->places == NULL) return -1;
    for (Py_ssize_t i = 0; i < slots; i++) p->keys[i] = EMPTY;
    p->mask = slots - 1;
    return 0;
}

static int table_grow(Pool *p) {
    int32_t *keys = p->keys, *places = p->places;
    Py_ssize_t old_slots = p->mask + 1;
    if (table_new(p, 2 * old_slots) < 0) {
        PyMem_Free(p->keys);
        PyMem_Free(p->places);
        p->keys = keys, p->places = places, p->mask = old_slots - 1;
        return -1;
    }
    for (Py_ssize_t i = 0; i < old_slots; i++) {
        if (keys[i] == EMPTY) continue;
        Py_ssize_t slot = table_slot(p, keys[i]);
        p->keys[slot] = keys[i];
        p->places[slot] = places[i];
    }
    PyMem_Free(keys);
    PyMem_Free(places);
    return 0;
}

static int records_reserve(Pool *p, Py_ssize_t needed) {
    if (needed <= p->capacity) return 0;
    if (needed > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "an n-gram pool holds at most 2**31 - 1 tokens");
        return -1;
    }
    Py_ssize_t capacity = p->capacity ? p->capacity : 256;
    while (capacity < needed) capacity *= 2;
    /* PyMem_Realloc, not PyMem_Resize: on failure the records keep their old buffers. */
    int32_t *tokens = PyMem_Realloc(p->tokens, (size_t)capacity * sizeof(int32_t));
    if (tokens == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->tokens = tokens;
    int32_t *older = PyMem_Realloc(p->older, (size_t)capacity * sizeof(int32_t));
    if (older == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->older = older;
    p->capacity = capacity;
    return 0;
}

static int Pool_init(Pool *p, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"size", "ngram_size", NULL};
    Py_ssize_t size, ngram_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn", names, &size, &ngram_size)) return -1;
    if (size < 0 || ngram_size < 2) {
        PyErr_SetString(PyExc_ValueError, "an n-gram pool needs size >= 0 and ngram_size >= 2");
        return -1;
    }
    if (p->keys != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an n-gram pool is initialised once");
        return -1;
    }
    p->size = size;
    p->span = ngram_size - 1;
    p->kept = PyMem_New(int32_t, size + 1);
    p->lengths = PyMem_New(Py_ssize_t, size + 1);
    p->cut = PyMem_New(Py_ssize_t, size + 1);
    if (p->kept == NULL || p->lengths == NULL || p->cut == NULL || table_new(p, 64) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Pool_dealloc(Pool *p) {
    PyMem_Free(p->tokens);
    PyMem_Free(p->older);
    PyMem_Free(p->keys);
    PyMem_Free(p->places);
    PyMem_Free(p->kept);
    PyMem_Free(p->lengths);
    PyMem_Free(p->cut);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

int pool_add(Pool *p, const int64_t *tokens, Py_ssize_t n) {
    Py_ssize_t start = p->length;
    for (Py_ssize_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "token ids must be in [0, 2**31 - 1], got %lld", (long long)tokens[i]);
            return -1;
        }
    if (records_reserve(p, start + n + 1) < 0) return -1;
    while (2 * (p->filled + n) > p->mask + 1) /* room first: linking below cannot fail half-way */
        if (table_grow(p) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    for (Py_ssize_t i = 0; i < n; i++) p->tokens[start + i] = (int32_t)tokens[i];
    /* Every token but the tail's last is a first token: link it to its previous place, make it the newest. */
    for (Py_ssize_t place = start; place < start + n - 1; place++) {
        int32_t token = p->tokens[place];
        Py_ssize_t slot = table_slot(p, token);
        if (p->keys[slot] == EMPTY) {
            p->keys[slot] = token;
            p->older[place] = NONE;
            p->filled++;
        } else {
            p->older[place] = p->places[slot];
        }
        p->places[slot] = (int32_t)place;
    }
    for (Py_ssize_t place = start + (n > 0 ? n - 1 : 0); place <= start + n; place++) p->older[place] = NONE;
    p->tokens[start + n] = END;
    p->length = start + n + 1;
    return 0;
}

static PyObject *Pool_add(Pool *p, PyObject *sequence) {
    if (p->keys == NULL) return PyErr_Format(PyExc_RuntimeError, "NgramPool.__init__ was not called");
    PyObject *fast = PySequence_Fast(sequence, "NgramPool.add takes a sequence of token ids");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int64_t *tokens = PyMem_New(int64_t, n + 1);
    if (tokens == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    int failed = 0;
    for (Py_ssize_t i = 0; i < n && !failed; i++) {
        int overflow;
        tokens[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) PyErr_Format(PyExc_ValueError, "token ids must be in [0, 2**31 - 1], got %S", items[i]);
        failed = overflow || (tokens[i] == -1 && PyErr_Occurred());
    }
    failed = failed || pool_add(p, tokens, n) < 0;
    PyMem_Free(tokens);
    Py_DECREF(fast);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* The continuation after `place`: up to `span` tokens, stopping at its tail's END. */
static Py_ssize_t continuation_length(const Pool *p, Py_ssize_t place) {
    Py_ssize_t k = 0;
    while (k < p->span && p->tokens[place + 1 + k] != END) k++;
    return k;
}

static int same_tokens(const Pool *p, int32_t a, int32_t b, Py_ssize_t length) {
    return memcmp(p->tokens + a + 1, p->tokens + b + 1, (size_t)length * sizeof(int32_t)) == 0;
}

Py_ssize_t pool_read(Pool *p, int64_t first, Py_ssize_t max_len) {
    if (first < 0 || first > INT32_MAX || p->size == 0) return 0;
    Py_ssize_t slot = table_slot(p, (int32_t)first);
    if (p->keys[slot] == EMPTY) return 0;
    /* The newest `size` distinct continuations, newest first; the chain is relinked to them. */
    Py_ssize_t found = 0;
    for (int32_t place = p->places[slot]; place != NONE && found < p->size; place = p->older[place]) {
        Py_ssize_t length = continuation_length(p, place), j = 0;
        while (j < found && !(p->lengths[j] == length && same_tokens(p, p->kept[j], place, length))) j++;
        if (j == found) {
            p->kept[found] = place;
            p->lengths[found++] = length;
        }
    }
    p->places[slot] = p->kept[0];
    for (Py_ssize_t j = 0; j + 1 < found; j++) p->older[p->kept[j]] = p->kept[j + 1];
    p->older[p->kept[found - 1]] = NONE;
    /* Each cut to `max_len` tokens (Python's gram[:max_len]), empty and repeated cuts left out. */
    Py_ssize_t given = 0;
    for (Py_ssize_t j = 0; j < found; j++) {
        Py_ssize_t length = p->lengths[j];
        length = max_len >= 0 ? Py_MIN(length, max_len) : Py_MAX(0, length + max_len);
        Py_ssize_t k = 0;
        while (k < given && !(p->cut[k] == length && same_tokens(p, p->kept[k], p->kept[j], length))) k++;
        if (length == 0 || k < given) continue;
        p->kept[given] = p->kept[j]; /* j >= given: the places still to read are untouched */
        p->cut[given++] = length;
    }
    return given;
}

static PyObject *Pool_candidates(Pool *p, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"first", "max_len", NULL};
    long long first;
    Py_ssize_t max_len;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ln", names, &first, &max_len)) return NULL;
    if (p->keys == NULL) return PyErr_Format(PyExc_RuntimeError, "NgramPool.__init__ was not called");
    Py_ssize_t given = pool_read(p, first, max_len);
    PyObject *out = PyList_New(given);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < given; j++) {
        PyObject *gram = PyTuple_New(p->cut[j]);
        if (gram == NULL) goto fail;
        PyList_SET_ITEM(out, j, gram);
        for (Py_ssize_t i = 0; i < p->cut[j]; i++) {
            PyObject *token = PyLong_FromLong(p->tokens[p->kept[j] + 1 + i]);
            if (token == NULL) goto fail;
            PyTuple_SET_ITEM(gram, i, token);
        }
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef Pool_methods[] = {
    {"add", (PyCFunction)Pool_add, METH_O, "Record a tail: every token but its last starts an n-gram."},
    {"candidates", (PyCFunction)(void (*)(void))Pool_candidates, METH_VARARGS | METH_KEYWORDS,
     "candidates(first, max_len): distinct continuations of `first`, newest first, cut to max_len tokens."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "jfcore.decoding.rules._native.NgramPool",
    .tp_doc = "NgramPool(size, ngram_size): jfcore/decoding/candidates/ngram_pool.py's pool, in C.",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};
