/* The row rules of jfcore/decoding/rules/python.py in C: its layout, greedy choice and acceptance rules.

   python.py is the reference and says what each rule does (docs/DESIGN.md, sections 1 and 7); this file is the
   fast path for every step ((NativeRules in native.py calls it)). Right after a forward the host's caches
   are cold, and there Python's per-row rules, the building of the step's inputs from lists and a dozen small
   tensor operations around the greedy choice were about two thirds of a 64-row multiblock step's host time
   (docs/DESIGN.md, "Rows in C"). The rows stay the Python `Row` objects the rest of the decoder reads and writes:
   this file changes them exactly as PythonRules.layout and .commit do, with the rows' pool and prompt
   lookup in C (_ngram.c, _lookup.c), calling back the rules object's public `filler` for a fresh block's seeded guesses and
   `close_block` to record a trajectory (CALLBACKS); the Row fields it reads and writes by name are ROW_FIELDS; the step's arrays are bytearrays that torch reads in place. */

#include "_native.h"
#include <math.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static PyObject *s_blocks, *s_sizes, *s_out, *s_done, *s_block_start, *s_verified, *s_forwards, *s_recycled,
    *s_finished, *s_pool, *s_lookup, *s_prompt, *s_max_new_tokens, *s_states;

/* -- small helpers over a row's attributes ------------------------------------------------------------------- */

static int get_int(PyObject *row, PyObject *name, Py_ssize_t *value) {
    PyObject *v = PyObject_GetAttr(row, name);
    if (v == NULL) return -1;
    *value = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_int(PyObject *row, PyObject *name, Py_ssize_t value) {
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL) return -1;
    int r = PyObject_SetAttr(row, name, v);
    Py_DECREF(v);
    return r;
}

static PyObject *get_list(PyObject *row, PyObject *name) { /* a new reference to a list attribute */
    PyObject *v = PyObject_GetAttr(row, name);
    if (v != NULL && !PyList_Check(v)) {
        PyErr_Format(PyExc_TypeError, "Row.%U must be a list", name);
        Py_CLEAR(v);
    }
    return v;
}

static int list_length(PyObject *row, PyObject *name, Py_ssize_t *length) { /* len(row.<name>) of a list */
    PyObject *list = get_list(row, name);
    if (list == NULL) return -1;
    *length = PyList_GET_SIZE(list);
    Py_DECREF(list);
    return 0;
}

static PyObject *int_list(const int64_t *tokens, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLongLong(tokens[i]);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static int extend(PyObject *list, const int64_t *tokens, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyLong_FromLongLong(tokens[i]);
        if (t == NULL) return -1;
        int r = PyList_Append(list, t);
        Py_DECREF(t);
        if (r < 0) return -1;
    }
    return 0;
}

static int as_token(PyObject *item, int64_t *token) {
    *token = PyLong_AsLongLong(item);
    return (*token == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* A growable int64 scratch array. */
typedef struct {
    int64_t *data;
    Py_ssize_t length, capacity;
} Buffer;

static int buffer_push(Buffer *b, int64_t value) {
    if (b->length == b->capacity) {
        Py_ssize_t capacity = b->capacity ? 2 * b->capacity : 1024;
        int64_t *data = PyMem_Realloc(b->data, (size_t)capacity * sizeof(int64_t));
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data, b->capacity = capacity;
    }
    b->data[b->length++] = value;
    return 0;
}

/* a * b for a buffer's size, or -1 with an exception where either is negative or the product too large. */
static Py_ssize_t product(Py_ssize_t a, Py_ssize_t b, const char *what) {
    if (a < 0 || b < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative size (%zd x %zd)", what, a, b);
        return -1;
    }
    if (b && a > PY_SSIZE_T_MAX / 16 / b) {
        PyErr_Format(PyExc_ValueError, "%s: %zd x %zd items is too large", what, a, b);
        return -1;
    }
    return a * b;
}

/* A contiguous buffer of `items` items of `kind` ('f' float32, 'q' int64, 'b' bool), given typed (a NumPy array)
   or as raw bytes (a bytearray); anything else is an error, never read. */
static int read_buffer(PyObject *object, Py_buffer *view, char kind, Py_ssize_t items, const char *what) {
    Py_ssize_t itemsize = kind == 'f' ? 4 : kind == 'q' ? 8 : 1;
    if (items < 0) return -1; /* `product` said why */
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *format = view->format == NULL ? "B" : view->format;
    if (*format == '<' || *format == '=' || *format == '@') format++;
    int typed = kind == 'f' ? strcmp(format, "f") == 0
                : kind == 'q' ? (strcmp(format, "q") == 0 || (strcmp(format, "l") == 0 && sizeof(long) == 8))
                              : strcmp(format, "?") == 0;
    if (!typed && strcmp(format, "B") != 0 && strcmp(format, "b") != 0 && strcmp(format, "c") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected %s items (or raw bytes), got format '%s'", what,
                     kind == 'f' ? "float32" : kind == 'q' ? "int64" : "bool", view->format);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len != itemsize * items) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", what, itemsize * items, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* -- layout: the step's inputs --------------------------------------------------------------------------------- */

static Lookup *row_lookup(PyObject *row) { /* a new reference, None, or NULL with an exception */
    PyObject *lookup = PyObject_GetAttr(row, s_lookup);
    if (lookup != NULL && lookup != Py_None &&
        (!PyObject_TypeCheck(lookup, &LookupType) || ((Lookup *)lookup)->places == NULL)) {
        PyErr_SetString(PyExc_TypeError, "rows in C need their prompt lookup in C (lookup.RowLookup)");
        Py_CLEAR(lookup);
    }
    return (Lookup *)lookup;
}

static int push_candidate(Buffer *inputs, Buffer *offsets, Py_ssize_t start, int64_t *row_info,
                          Py_ssize_t max_candidates, const int32_t *tokens32, const int64_t *tokens, Py_ssize_t n) {
    if (row_info[1] == max_candidates) {
        PyErr_SetString(PyExc_ValueError, "a row has more candidates than max_candidates");
        return -1;
    }
    row_info[2 + 2 * row_info[1]] = inputs->length - start;
    row_info[3 + 2 * row_info[1]++] = n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (buffer_push(inputs, tokens32 ? tokens32[i] : tokens[i]) < 0 || buffer_push(offsets, i + 1) < 0) return -1;
    return 0;
}

/* `_layout` past the draft (in `inputs` from `start`): the prompt-lookup copy within the draft (its blocks
   refilled), the pool's candidates, then the prompt-lookup candidate, each a (first slot, length) in row_info. */
static int candidates(PyObject *row, Buffer *inputs, Buffer *offsets, Py_ssize_t start, int64_t *row_info,
                      Py_ssize_t max_candidates, int within) {
    Py_ssize_t draft = row_info[0];
    row_info[1] = 0;
    Lookup *lookup = row_lookup(row);
    PyObject *pool = lookup == NULL ? NULL : PyObject_GetAttr(row, s_pool);
    int r = -1;
    if (pool == NULL) goto done;
    if ((PyObject *)lookup != Py_None && within) { /* `_copy_into_draft` */
        Py_ssize_t n = lookup_propose(lookup, inputs->data[start], draft - 1);
        if (n) {
            memcpy(inputs->data + start + 1, lookup->proposal, (size_t)n * sizeof(int64_t));
            PyObject *blocks = get_list(row, s_blocks);
            if (blocks == NULL) goto done;
            for (Py_ssize_t j = 0, at = start; j < PyList_GET_SIZE(blocks); j++) {
                Py_ssize_t size = PyList_GET_SIZE(PyList_GET_ITEM(blocks, j));
                PyObject *block = int_list(inputs->data + at, size);
                if (block == NULL || PyList_SetItem(blocks, j, block) < 0) {
                    Py_DECREF(blocks);
                    goto done;
                }
                at += size;
            }
            Py_DECREF(blocks);
        }
    }
    if (pool != Py_None && draft > 1) {
        if (!PyObject_TypeCheck(pool, &PoolType) || ((Pool *)pool)->keys == NULL) {
            PyErr_SetString(PyExc_TypeError, "rows in C need their pool in C (ngram_pool.CNgramPool)");
            goto done;
        }
        Pool *p = (Pool *)pool;
        Py_ssize_t given = pool_read(p, inputs->data[start], draft - 1);
        for (Py_ssize_t j = 0; j < given; j++)
            if (push_candidate(inputs, offsets, start, row_info, max_candidates, p->tokens + p->kept[j] + 1, NULL,
                               p->cut[j]) < 0)
                goto done;
    }
    if ((PyObject *)lookup != Py_None && !within) {
        Py_ssize_t max_new_tokens, out;
        if (list_length(row, s_out, &out) < 0 || get_int(row, s_max_new_tokens, &max_new_tokens) < 0) goto done;
        Py_ssize_t n = lookup_propose(lookup, inputs->data[start], max_new_tokens - out - 1), c = 0;
        for (; n && c < row_info[1]; c++) /* not when a pooled candidate says the same */
            if (row_info[3 + 2 * c] == n &&
                memcmp(inputs->data + start + row_info[2 + 2 * c], lookup->proposal, (size_t)n * sizeof(int64_t)) == 0)
                break;
        if (n && c == row_info[1] &&
            push_candidate(inputs, offsets, start, row_info, max_candidates, NULL, lookup->proposal, n) < 0)
            goto done;
    }
    r = 0;
done:
    Py_XDECREF(pool);
    Py_XDECREF((PyObject *)lookup);
    return r;
}

/* `_layout`'s record of block 0's state: the block's committed tokens, then the draft. (Recording has no prompt
   lookup, so the draft is the one laid out.) */
static int record_state(PyObject *row, const int64_t *draft, Py_ssize_t n) {
    Py_ssize_t block_start;
    PyObject *out = get_list(row, s_out), *states = get_list(row, s_states), *state = NULL;
    int r = -1;
    if (out == NULL || states == NULL || get_int(row, s_block_start, &block_start) < 0) goto done;
    state = PyList_GetSlice(out, block_start, PyList_GET_SIZE(out));
    if (state == NULL || extend(state, draft, n) < 0) goto done;
    r = PyList_Append(states, state);
done:
    Py_XDECREF(out);
    Py_XDECREF(states);
    Py_XDECREF(state);
    return r;
}

/* layout(rows, pad, max_candidates, within, record) -> (tokens, positions, offsets, valid, meta, width, tree)

   PythonRules.layout for every row and the step's input arrays, row-major [B, width]: tokens (int64,
   padded with `pad`), positions (int64), offsets from the draft's first token (int64, padding 0), valid (bool).
   meta, int64 [B, 2 + 2 * max_candidates]: each row's draft length, its number of candidates, then each
   candidate's first slot and length. tree: whether some row needs the candidate tree mask. */
static PyObject *layout(PyObject *self, PyObject *args) {
    PyObject *rows;
    long long pad;
    Py_ssize_t max_candidates;
    int within, record; /* `lookup_within`; recording trajectories */
    if (!PyArg_ParseTuple(args, "O!Lnpp", &PyList_Type, &rows, &pad, &max_candidates, &within, &record)) return NULL;
    if (max_candidates < 0 || max_candidates > 1 << 16)
        return PyErr_Format(PyExc_ValueError, "layout: max_candidates must be in [0, 65536], got %zd", max_candidates);
    rows = PyList_AsTuple(rows); /* held: attribute reads cannot take a row away mid-step */
    if (rows == NULL) return NULL;
    Py_ssize_t n_rows = PyTuple_GET_SIZE(rows), stride = 2 + 2 * max_candidates, width = 0;
    int tree = 0;
    Buffer inputs = {0}, offsets = {0};
    Py_ssize_t *starts = PyMem_New(Py_ssize_t, n_rows + 1);
    int64_t *committed = PyMem_New(int64_t, n_rows + 1);
    PyObject *meta = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * n_rows * stride);
    PyObject *result = NULL, *tokens_out = NULL, *positions_out = NULL, *offsets_out = NULL, *valid_out = NULL;
    if (starts == NULL || committed == NULL || meta == NULL) goto done;
    int64_t *info = (int64_t *)PyByteArray_AS_STRING(meta);
    memset(info, 0, sizeof(int64_t) * n_rows * stride);
    for (Py_ssize_t b = 0; b < n_rows; b++) {
        PyObject *row = PyTuple_GET_ITEM(rows, b);
        starts[b] = inputs.length;
        PyObject *blocks = get_list(row, s_blocks);
        if (blocks == NULL) goto done;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(blocks); j++) {
            PyObject *block = PyList_GET_ITEM(blocks, j);
            if (!PyList_Check(block)) {
                PyErr_SetString(PyExc_TypeError, "Row.blocks must be a list of lists");
                Py_DECREF(blocks);
                goto done;
            }
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(block); i++) {
                int64_t token;
                if (as_token(PyList_GET_ITEM(block, i), &token) < 0 || buffer_push(&inputs, token) < 0 ||
                    buffer_push(&offsets, inputs.length - 1 - starts[b]) < 0) {
                    Py_DECREF(blocks);
                    goto done;
                }
            }
        }
        Py_DECREF(blocks);
        Py_ssize_t draft = inputs.length - starts[b];
        if (draft == 0) {
            PyErr_SetString(PyExc_ValueError, "every row in a step needs a draft in flight (a finished row left?)");
            goto done;
        }
        int64_t *row_info = info + b * stride;
        row_info[0] = draft;
        if (record && record_state(row, inputs.data + starts[b], draft) < 0) goto done;
        if (candidates(row, &inputs, &offsets, starts[b], row_info, max_candidates, within) < 0) goto done;
        Py_ssize_t length = inputs.length - starts[b];
        /* As `_step`: a draft of one token with one candidate is a plain causal chain. */
        if (row_info[1] && (length - row_info[3] > 1 || row_info[1] > 1)) tree = 1;
        width = Py_MAX(width, length);
        Py_ssize_t prompt, verified;
        if (list_length(row, s_prompt, &prompt) < 0 || get_int(row, s_verified, &verified) < 0) goto done;
        committed[b] = prompt + verified;
    }
    starts[n_rows] = inputs.length;
    Py_ssize_t cells = n_rows * width;
    tokens_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * cells);
    positions_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * cells);
    offsets_out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * cells);
    valid_out = PyByteArray_FromStringAndSize(NULL, cells);
    if (tokens_out == NULL || positions_out == NULL || offsets_out == NULL || valid_out == NULL) goto done;
    int64_t *tokens = (int64_t *)PyByteArray_AS_STRING(tokens_out);
    int64_t *positions = (int64_t *)PyByteArray_AS_STRING(positions_out);
    int64_t *offset = (int64_t *)PyByteArray_AS_STRING(offsets_out);
    char *valid = PyByteArray_AS_STRING(valid_out);
    for (Py_ssize_t b = 0; b < n_rows; b++) {
        Py_ssize_t length = starts[b + 1] - starts[b];
        for (Py_ssize_t q = 0; q < width; q++) {
            Py_ssize_t at = b * width + q;
            int real = q < length;
            tokens[at] = real ? inputs.data[starts[b] + q] : pad;
            offset[at] = real ? offsets.data[starts[b] + q] : 0;
            positions[at] = offset[at] + committed[b];
            valid[at] = (char)real;
        }
    }
    result = Py_BuildValue("(OOOOOnO)", tokens_out, positions_out, offsets_out, valid_out, meta, width,
                           tree ? Py_True : Py_False);
done:
    Py_XDECREF(tokens_out);
    Py_XDECREF(positions_out);
    Py_XDECREF(offsets_out);
    Py_XDECREF(valid_out);
    Py_XDECREF(meta);
    Py_DECREF(rows);
    PyMem_Free(starts);
    PyMem_Free(committed);
    PyMem_Free(inputs.data);
    PyMem_Free(offsets.data);
    return result;
}

/* -- greedy: the first index of each query's largest logit --------------------------------------------------- */

/* torch's `max(-1).indices` on a CPU: the first largest value, or the first NaN if there is one. The largest value
   is found with running maxima in vector registers (`x > m ? x : m`, which skips NaNs; they are looked for
   alongside), then its first index by a second pass over the row, which is in the cache by then. */
static int64_t first_max(const float *x, Py_ssize_t n) {
    float best = -INFINITY;
    int any_nan = 0;
    Py_ssize_t i = 0;
#ifdef __SSE2__
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0, nan = _mm_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m128 a = _mm_loadu_ps(x + i), b = _mm_loadu_ps(x + i + 4), c = _mm_loadu_ps(x + i + 8),
               d = _mm_loadu_ps(x + i + 12);
        m0 = _mm_max_ps(a, m0), m1 = _mm_max_ps(b, m1), m2 = _mm_max_ps(c, m2), m3 = _mm_max_ps(d, m3);
        nan = _mm_or_ps(nan, _mm_or_ps(_mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)),
                                       _mm_or_ps(_mm_cmpunord_ps(c, c), _mm_cmpunord_ps(d, d))));
    }
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    for (int k = 0; k < 4; k++) best = lanes[k] > best ? lanes[k] : best;
    any_nan = _mm_movemask_ps(nan) != 0;
#endif
    for (; i < n; i++) {
        best = x[i] > best ? x[i] : best;
        any_nan |= x[i] != x[i];
    }
    i = 0;
    if (any_nan)
        while (x[i] == x[i]) i++;
    else
        while (x[i] != best) i++;
    return i;
}

/* greedy(logits, valid, rows, width) -> choices

   logits: float32, [N, V] for the N real queries that valid (bool [rows, width]) marks, in row-major order, or
   [rows * width, V] when valid is None. Returns int64 [rows, width], padding queries 0 (`sampling.choose`). */
static PyObject *greedy(PyObject *self, PyObject *args) {
    PyObject *logits_object, *valid_object;
    Py_ssize_t n_rows, width, vocab;
    if (!PyArg_ParseTuple(args, "OOnnn", &logits_object, &valid_object, &n_rows, &width, &vocab)) return NULL;
    if (vocab < 1) return PyErr_Format(PyExc_ValueError, "an empty vocabulary");
    Py_buffer valid_view = {0}, logits_view = {0};
    const char *valid = NULL;
    Py_ssize_t cells = product(n_rows, width, "greedy: rows x width"), queries = cells;
    if (cells < 0) return NULL;
    if (valid_object != Py_None) {
        if (read_buffer(valid_object, &valid_view, 'b', cells, "valid") < 0) return NULL;
        valid = valid_view.buf;
        queries = 0;
        for (Py_ssize_t i = 0; i < cells; i++) queries += valid[i] != 0;
    }
    PyObject *out = NULL;
    if (read_buffer(logits_object, &logits_view, 'f', product(queries, vocab, "logits"), "logits") < 0) goto done;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * cells);
    if (out == NULL) goto done;
    int64_t *choices = (int64_t *)PyByteArray_AS_STRING(out);
    const float *row = logits_view.buf;
    for (Py_ssize_t i = 0; i < cells; i++) {
        if (valid != NULL && !valid[i]) {
            choices[i] = 0;
            continue;
        }
        choices[i] = first_max(row, vocab);
        row += vocab;
    }
done:
    if (logits_view.obj != NULL) PyBuffer_Release(&logits_view);
    if (valid_view.obj != NULL) PyBuffer_Release(&valid_view);
    return out;
}

/* -- verify: acceptance and the draft's update --------------------------------------------------------------- */

typedef struct {
    int64_t *eos;           /* EOS ids */
    Py_ssize_t n_eos;
    Py_ssize_t block_size;  /* the decoder's block size (1 for AR) */
    Py_ssize_t in_flight;   /* blocks in flight at most */
    double spawn_ratio;
    int rolling;            /* the block never closes: topped up to block_size after each update */
    int record;             /* recording trajectories */
    PyObject *callbacks;    /* its `filler(row, count)` draws a fresh block's guesses, `close_block(row, end)` records */
} Rules;

/* The row's own state for the length of its update; written back at the end. */
typedef struct {
    PyObject *row, *out, *blocks, *sizes;
    Py_ssize_t done, block_start, max_new_tokens;
} State;

/* The row's blocks are lists, one size each: what `consume`, `refill` and `carry_on` index without checks. */
static int check_blocks(const State *s) {
    Py_ssize_t blocks = PyList_GET_SIZE(s->blocks);
    if (PyList_GET_SIZE(s->sizes) != blocks) {
        PyErr_Format(PyExc_ValueError, "Row.sizes has %zd entries for %zd blocks: one full size per block in flight",
                     PyList_GET_SIZE(s->sizes), blocks);
        return -1;
    }
    for (Py_ssize_t j = 0; j < blocks; j++)
        if (!PyList_Check(PyList_GET_ITEM(s->blocks, j))) {
            PyErr_SetString(PyExc_TypeError, "Row.blocks must be a list of lists");
            return -1;
        }
    return 0;
}

static int is_eos(const Rules *rules, int64_t token) {
    for (Py_ssize_t i = 0; i < rules->n_eos; i++)
        if (rules->eos[i] == token) return 1;
    return 0;
}

static int set_empty_list(PyObject *row, PyObject *name) {
    PyObject *empty = PyList_New(0);
    if (empty == NULL) return -1;
    int r = PyObject_SetAttr(row, name, empty);
    Py_DECREF(empty);
    return r;
}

/* `close_block`, where trajectories are recorded: the rules object's own, with the row's block_start made current. */
static int close_block(const Rules *rules, State *s, Py_ssize_t end) {
    if (!rules->record) return 0;
    if (set_int(s->row, s_block_start, s->block_start) < 0) return -1;
    PyObject *r = PyObject_CallMethod(rules->callbacks, "close_block", "On", s->row, end);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int finish(const Rules *rules, State *s, const int64_t *last, Py_ssize_t n) { /* `_finish` */
    if (extend(s->out, last, n) < 0 || PyObject_SetAttr(s->row, s_finished, Py_True) < 0) return -1;
    if (set_empty_list(s->row, s_blocks) < 0 || set_empty_list(s->row, s_sizes) < 0) return -1;
    return close_block(rules, s, PyList_GET_SIZE(s->out));
}

/* `_emit`: 1 if the row finished, 0 if not, -1 on error. */
static int emit(const Rules *rules, State *s, const int64_t *accepted, Py_ssize_t n) {
    Py_ssize_t budget = s->max_new_tokens - PyList_GET_SIZE(s->out), cut = 0;
    for (Py_ssize_t i = 0; i < n && !cut; i++)
        if (i < budget && is_eos(rules, accepted[i])) cut = i + 1;
    if (n < budget && !cut) return extend(s->out, accepted, n) < 0 ? -1 : 0;
    return finish(rules, s, accepted, cut ? cut : Py_MAX(0, budget)) < 0 ? -1 : 1;
}

static Py_ssize_t in_flight_tokens(const State *s) {
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(s->blocks); j++) total += PyList_GET_SIZE(PyList_GET_ITEM(s->blocks, j));
    return total;
}

/* `_consume`: remove `count` committed tokens from the front of the blocks. */
static int consume(const Rules *rules, State *s, Py_ssize_t count) {
    while (count > 0 && PyList_GET_SIZE(s->blocks) > 0) {
        PyObject *first = PyList_GET_ITEM(s->blocks, 0);
        Py_ssize_t length = PyList_GET_SIZE(first), take = Py_MIN(count, length);
        count -= take;
        if (take < length) {
            PyObject *rest = PyList_GetSlice(first, take, length);
            if (rest == NULL || PyList_SetItem(s->blocks, 0, rest) < 0) return -1;
            s->done += take;
            continue;
        }
        if (PyList_GET_SIZE(s->sizes) == 0) return check_blocks(s); /* a callback changed the row: say how */
        Py_ssize_t size = PyLong_AsSsize_t(PyList_GET_ITEM(s->sizes, 0));
        if (size == -1 && PyErr_Occurred()) return -1;
        if (PyList_SetSlice(s->sizes, 0, 1, NULL) < 0 || PyList_SetSlice(s->blocks, 0, 1, NULL) < 0 ||
            close_block(rules, s, s->block_start + size) < 0)
            return -1;
        s->block_start += size;
        s->done = 0;
    }
    return 0;
}

/* `refill`: lay `tokens` over the blocks, keeping their sizes. */
static int refill(State *s, const int64_t *tokens, Py_ssize_t n) {
    Py_ssize_t at = 0;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(s->blocks); j++) {
        Py_ssize_t length = PyList_GET_SIZE(PyList_GET_ITEM(s->blocks, j));
        Py_ssize_t from = Py_MIN(at, n), to = Py_MIN(at + length, n);
        PyObject *block = int_list(tokens + from, to - from);
        if (block == NULL || PyList_SetItem(s->blocks, j, block) < 0) return -1;
        at += length;
    }
    return 0;
}

/* `_open_block`: `first`, then the seeded filler (callbacks.filler). */
static int open_block(const Rules *rules, State *s, int64_t first) {
    Py_ssize_t size = Py_MIN(rules->block_size, s->max_new_tokens - PyList_GET_SIZE(s->out) - in_flight_tokens(s));
    if (size <= 0) return 0;
    PyObject *filler = PyObject_CallMethod(rules->callbacks, "filler", "On", s->row, size - 1);
    if (filler == NULL) return -1;
    PyObject *block = PyList_New(0), *head = PyLong_FromLongLong(first), *size_object = PyLong_FromSsize_t(size);
    int r = -1;
    if (block != NULL && head != NULL && size_object != NULL && PyList_Append(block, head) == 0 &&
        PyList_SetSlice(block, 1, 1, filler) == 0) /* [first, *filler] */
        r = PyList_Append(s->blocks, block) == 0 && PyList_Append(s->sizes, size_object) == 0 ? 0 : -1;
    Py_DECREF(filler);
    Py_XDECREF(block);
    Py_XDECREF(head);
    Py_XDECREF(size_object);
    return r;
}

/* `_top_up` (rolling): block 0 grows back to n (fewer near the budget): `guess`, then the seeded filler. */
static int top_up(const Rules *rules, State *s, int64_t guess) {
    PyObject *block = PyList_GET_ITEM(s->blocks, 0);
    Py_ssize_t room = Py_MIN(rules->block_size, s->max_new_tokens - PyList_GET_SIZE(s->out)) - PyList_GET_SIZE(block);
    if (room <= 0) return 0;
    PyObject *head = PyLong_FromLongLong(guess);
    if (head == NULL) return -1;
    int r = PyList_Append(block, head);
    Py_DECREF(head);
    if (r < 0 || room == 1) return r;
    PyObject *filler = PyObject_CallMethod(rules->callbacks, "filler", "On", s->row, room - 1);
    if (filler == NULL) return -1;
    Py_ssize_t end = PyList_GET_SIZE(block);
    r = PyList_SetSlice(block, end, end, filler);
    Py_DECREF(filler);
    return r;
}

/* `_carry_on`: finish with the known next token, or keep drafting from it. */
static int carry_on(const Rules *rules, State *s, int64_t next, int64_t guess, Py_ssize_t progress) {
    Py_ssize_t blocks = PyList_GET_SIZE(s->blocks);
    if (is_eos(rules, next) || PyList_GET_SIZE(s->out) + 1 >= s->max_new_tokens) {
        if (!blocks) s->block_start = PyList_GET_SIZE(s->out);
        return finish(rules, s, &next, 1);
    }
    if (!blocks) {
        s->block_start = PyList_GET_SIZE(s->out);
        return open_block(rules, s, next);
    }
    if (blocks < rules->in_flight) {
        if (check_blocks(s) < 0) return -1;
        Py_ssize_t last = PyLong_AsSsize_t(PyList_GET_ITEM(s->sizes, PyList_GET_SIZE(s->sizes) - 1));
        if (last == -1 && PyErr_Occurred()) return -1;
        if ((double)progress >= rules->spawn_ratio * (double)last) return open_block(rules, s, guess);
    }
    return 0;
}

/* `layout`'s meta for row b, checked against the step: every slot it names lies within the row's `width`. */
static int check_meta(const int64_t *info, Py_ssize_t stride, Py_ssize_t width, Py_ssize_t b) {
    if (info[0] < 1 || info[0] > width || info[1] < 0 || info[1] > (stride - 2) / 2) {
        PyErr_Format(PyExc_ValueError, "meta, row %zd: draft %lld and %lld candidates do not fit a step %zd wide", b,
                     (long long)info[0], (long long)info[1], width);
        return -1;
    }
    for (int64_t c = 0; c < info[1]; c++) {
        int64_t start = info[2 + 2 * c], length = info[3 + 2 * c];
        if (start < 1 || length < 0 || start > width || length > width - start) {
            PyErr_Format(PyExc_ValueError, "meta, row %zd: candidate %lld at slot %lld, %lld long, is outside %zd", b,
                         (long long)c, (long long)start, (long long)length, width);
            return -1;
        }
    }
    return 0;
}

/* `_verify` for row b: returns its number of kept slots (its first `kept` slots, or with a candidate's run its
   first slot and the candidate's: `moved` gets those), -1 on error. */
static Py_ssize_t verify_row(const Rules *rules, PyObject *row, const int64_t *input, const int64_t *pred,
                             const int64_t *info, Py_ssize_t b, Buffer *moved) {
    Py_ssize_t draft = info[0], n_candidates = info[1], a = 1;
    while (a < draft && input[a] == pred[a - 1]) a++;
    Py_ssize_t kept = a, winner = -1, winner_run = 0; /* winner: the candidate whose run won, if any */
    for (Py_ssize_t c = 0; c < n_candidates; c++) {
        Py_ssize_t start = info[2 + 2 * c], length = info[3 + 2 * c], k = 0, parent = 0;
        while (k < length && input[start + k] == pred[parent]) parent = start + k++;
        if (1 + k > kept) kept = 1 + k, winner = start, winner_run = k;
    }
    /* accepted: the draft's first `a` tokens, or its first and the candidate's run */
    int64_t *accepted = PyMem_New(int64_t, kept + draft + 1), *rest = accepted + kept;
    if (accepted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (winner < 0) {
        memcpy(accepted, input, sizeof(int64_t) * a);
    } else {
        accepted[0] = input[0];
        memcpy(accepted + 1, input + winner, sizeof(int64_t) * winner_run);
    }
    int64_t correction = pred[winner < 0 ? a - 1 : winner + winner_run - 1], guess = pred[draft - 1];
    /* rest: the Jacobi update, the correction then the model's guesses after the accepted run */
    Py_ssize_t n_rest = 1;
    rest[0] = correction;
    for (Py_ssize_t i = kept; i < draft - 1; i++) rest[n_rest++] = pred[i];

    State s = {row, NULL, NULL, NULL, 0, 0, 0};
    Lookup *lookup = NULL;
    Py_ssize_t verified, forwards, recycled, result = -1;
    s.out = get_list(row, s_out);
    s.blocks = get_list(row, s_blocks);
    s.sizes = get_list(row, s_sizes);
    if (s.out == NULL || s.blocks == NULL || s.sizes == NULL || get_int(row, s_done, &s.done) < 0 ||
        get_int(row, s_block_start, &s.block_start) < 0 || get_int(row, s_max_new_tokens, &s.max_new_tokens) < 0 ||
        get_int(row, s_verified, &verified) < 0 || get_int(row, s_forwards, &forwards) < 0 ||
        get_int(row, s_recycled, &recycled) < 0 || check_blocks(&s) < 0)
        goto done;
    if (set_int(row, s_recycled, recycled + Py_MAX(0, kept - a)) < 0 || set_int(row, s_forwards, forwards + 1) < 0 ||
        set_int(row, s_verified, verified + kept) < 0)
        goto done;
    lookup = row_lookup(row);
    if (lookup == NULL) goto done;
    if ((PyObject *)lookup != Py_None) { /* the copied text's own verified run: it cannot outrun the committed one */
        Py_ssize_t held = 0;
        while (held < Py_MIN(lookup->proposed, kept - 1) && lookup->proposal[held] == accepted[1 + held]) held++;
        lookup_update(lookup, lookup->proposed, held);
    }
    PyObject *pool = PyObject_GetAttr(row, s_pool);
    if (pool == NULL) goto done;
    int added = 0;
    if (pool != Py_None && (!PyObject_TypeCheck(pool, &PoolType) || ((Pool *)pool)->keys == NULL)) {
        PyErr_SetString(PyExc_TypeError, "rows in C need their pool in C (ngram_pool.CNgramPool)");
        added = -1;
    } else if (pool != Py_None) {
        added = pool_add((Pool *)pool, input + a, draft - a); /* the rejected tail */
    }
    Py_DECREF(pool);
    if (added < 0) goto done;
    Py_ssize_t progress = 0;
    if (rules->in_flight > 1 && PyList_GET_SIZE(s.blocks) > 0) { /* `_newest_progress` */
        Py_ssize_t blocks = PyList_GET_SIZE(s.blocks);
        Py_ssize_t start = draft - PyList_GET_SIZE(PyList_GET_ITEM(s.blocks, blocks - 1)), i = Py_MAX(start, 1);
        while (i < draft && input[i] == pred[i - 1]) i++;
        progress = (blocks == 1 ? s.done : 0) + i - start;
    }
    int finished = emit(rules, &s, accepted, kept);
    if (finished < 0) goto done;
    if (!finished && (PyObject *)lookup != Py_None && lookup_extend(lookup, accepted, kept) < 0) goto done;
    if (!finished && (consume(rules, &s, kept) < 0 || refill(&s, rest, n_rest) < 0 ||
                      (rules->rolling && PyList_GET_SIZE(s.blocks) > 0 && top_up(rules, &s, guess) < 0) ||
                      carry_on(rules, &s, correction, guess, progress) < 0))
        goto done;
    if (set_int(row, s_done, s.done) < 0 || set_int(row, s_block_start, s.block_start) < 0) goto done;
    if (winner > 1)
        for (Py_ssize_t i = 1; i <= winner_run; i++)
            if (buffer_push(moved, b) < 0 || buffer_push(moved, winner + i - 1) < 0 || buffer_push(moved, i) < 0)
                goto done;
    result = kept;
done:
    Py_XDECREF(s.out);
    Py_XDECREF(s.blocks);
    Py_XDECREF(s.sizes);
    Py_XDECREF((PyObject *)lookup);
    PyMem_Free(accepted);
    return result;
}

/* verify(rows, tokens, choices, meta, width, eos, block_size, in_flight, spawn_ratio, rolling, record, callbacks)
       -> (kept, moved)

   PythonRules.commit for every row, from `layout`'s tokens and meta and the step's choices (int64 [B, width]).
   kept: int64 [B], each row's kept slots (its first ones, once `moved` is applied); moved: int64 triples (row,
   from slot, to slot) of candidate slots that move up to follow the row's first one (`SlotBatch.keep_first`). */
static PyObject *verify(PyObject *self, PyObject *args) {
    PyObject *rows, *tokens_object, *choices_object, *meta_object;
    Py_ssize_t width;
    PyObject *eos;
    Rules rules;
    if (!PyArg_ParseTuple(args, "O!OOOnOnndppO", &PyList_Type, &rows, &tokens_object, &choices_object, &meta_object,
                          &width, &eos, &rules.block_size, &rules.in_flight, &rules.spawn_ratio, &rules.rolling,
                          &rules.record, &rules.callbacks))
        return NULL;
    rows = PyList_AsTuple(rows); /* held: callbacks into Python cannot take a row away mid-step */
    if (rows == NULL) return NULL;
    Py_ssize_t n_rows = PyTuple_GET_SIZE(rows);
    Py_buffer tokens = {0}, choices = {0}, meta = {0};
    PyObject *kept = NULL, *result = NULL;
    Buffer moved = {0}, eos_ids = {0};
    PyObject *eos_fast = PySequence_Fast(eos, "verify: eos must be a sequence of token ids");
    if (eos_fast == NULL) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(eos_fast); i++) {
        int64_t token;
        if (as_token(PySequence_Fast_GET_ITEM(eos_fast, i), &token) < 0 || buffer_push(&eos_ids, token) < 0) {
            Py_DECREF(eos_fast);
            goto done;
        }
    }
    Py_DECREF(eos_fast);
    rules.eos = eos_ids.data, rules.n_eos = eos_ids.length;
    Py_ssize_t cells = product(n_rows, width, "verify: rows x width");
    if (cells < 0 || read_buffer(tokens_object, &tokens, 'q', cells, "tokens") < 0 ||
        read_buffer(choices_object, &choices, 'q', cells, "choices") < 0 ||
        PyObject_GetBuffer(meta_object, &meta, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t stride = n_rows ? meta.len / (Py_ssize_t)sizeof(int64_t) / n_rows : 2;
    if (meta.len != (Py_ssize_t)sizeof(int64_t) * n_rows * stride || stride < 2 || stride % 2) {
        PyErr_Format(PyExc_ValueError, "meta: expected %zd rows of 2 + 2 x candidates int64, got %zd bytes", n_rows,
                     meta.len);
        goto done;
    }
    for (Py_ssize_t b = 0; b < n_rows; b++)
        if (check_meta((const int64_t *)meta.buf + b * stride, stride, width, b) < 0) goto done;
    kept = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)sizeof(int64_t) * n_rows);
    if (kept == NULL) goto done;
    int64_t *counts = (int64_t *)PyByteArray_AS_STRING(kept);
    for (Py_ssize_t b = 0; b < n_rows; b++) {
        const int64_t *info = (const int64_t *)meta.buf + b * stride;
        Py_ssize_t n = verify_row(&rules, PyTuple_GET_ITEM(rows, b), (const int64_t *)tokens.buf + b * width,
                                  (const int64_t *)choices.buf + b * width, info, b, &moved);
        if (n < 0) goto done;
        counts[b] = n;
    }
    PyObject *moved_out = PyByteArray_FromStringAndSize((const char *)moved.data, (Py_ssize_t)sizeof(int64_t) * moved.length);
    if (moved_out == NULL) goto done;
    result = Py_BuildValue("(ON)", kept, moved_out);
done:
    if (tokens.obj != NULL) PyBuffer_Release(&tokens);
    if (choices.obj != NULL) PyBuffer_Release(&choices);
    if (meta.obj != NULL) PyBuffer_Release(&meta);
    Py_XDECREF(kept);
    Py_DECREF(rows);
    PyMem_Free(moved.data);
    PyMem_Free(eos_ids.data);
    return result;
}

static PyMethodDef functions[] = {
    {"layout", layout, METH_VARARGS, "The step's inputs from every row's draft and candidates."},
    {"greedy", greedy, METH_VARARGS, "The first index of each real query's largest logit."},
    {"verify", verify, METH_VARARGS, "Accept, emit and update every row's draft from the step's choices."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The decoder's row rules and n-gram pool in C.",
                                    -1, functions};

/* PyModule_AddObjectRef for a new reference, which is released either way. */
static int add_owned(PyObject *m, const char *name, PyObject *value) {
    int r = value == NULL ? -1 : PyModule_AddObjectRef(m, name, value);
    Py_XDECREF(value);
    return r;
}

PyMODINIT_FUNC PyInit__native(void) {
    PyObject **names[] = {&s_blocks, &s_sizes, &s_out, &s_done, &s_block_start, &s_verified, &s_forwards,
                          &s_recycled, &s_finished, &s_pool, &s_lookup, &s_prompt, &s_max_new_tokens, &s_states};
    const char *texts[] = {"blocks", "sizes", "out", "done", "block_start", "verified", "forwards",
                           "recycled", "finished", "pool", "lookup", "prompt", "max_new_tokens", "states"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL) return NULL;
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&LookupType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* The contract with Python, for tests/unit/test_native_rules.py to hold against Row and the rules. */
    PyObject *fields = PyTuple_New(sizeof(texts) / sizeof(texts[0]));
    if (fields != NULL)
        for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) PyTuple_SET_ITEM(fields, i, Py_NewRef(*names[i]));
    if (add_owned(m, "ROW_FIELDS", fields) < 0 ||
        add_owned(m, "CALLBACKS", Py_BuildValue("(ss)", "close_block", "filler")) < 0 ||
        PyModule_AddObjectRef(m, "NgramPool", (PyObject *)&PoolType) < 0 ||
        PyModule_AddObjectRef(m, "PromptLookup", (PyObject *)&LookupType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
