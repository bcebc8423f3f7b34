/* y = x W^T + b over a few float32 rows, reading W once (docs/DESIGN.md, "Linear layers on a CPU").
 *
 * A decode forward multiplies its q positions (1 to about 128) by every weight; the weights come from memory, so a
 * good kernel costs about the same at q = 8 as at q = 1. The matrix library's kernels do not get there on every
 * host (a forward over 8 positions costing 1.7 times one over a single position on 2 EPYC cores), so this one
 * streams each block of 4 weight rows through the first level cache once and multiplies it with every input row
 * there, a few at a time, in accumulators that stay in registers: with AVX-512 (32 registers of 16 lanes) 4 input
 * rows at a time, 16 accumulators; elsewhere (AVX2 and others: 16 registers of 8 lanes) 2 at a time, 8
 * accumulators. The wide kernel on an AVX2 host would need 32 of its 16 registers: spilled to memory, it ran 5
 * times slower than torch at 8 rows. The partial sums are folded into one sum per output at the end.
 *
 * Each output is one weight row's dot product with one input row, summed in the same order whatever the number of
 * rows or threads: a position's outputs do not depend on how many positions a forward carries. (The two kernels
 * sum in different orders, but a host always runs the same one.) Threads share torch's OpenMP pool (this module
 * links libgomp.so.1, which torch has loaded by the time jfcore/decoding/runner/linear.py imports it) and split the
 * weight rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) /* the wide kernel where AVX-512 is; the narrow one built for AVX2 and for plain x86-64 */
#define WIDE_TARGET __attribute__((target("arch=x86-64-v4")))
#define NARROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define WIDE_TARGET
#define NARROW_CLONES
#endif

typedef float v16 __attribute__((vector_size(64)));
typedef int i16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef int i8 __attribute__((vector_size(32)));

#define WROWS 4 /* weight rows a block, wide kernel */
#define XROWS 4 /* input rows multiplied with a block at once, wide kernel */
#define WROWS8 3 /* the same, narrow kernel */
#define XROWS8 4
#define LANES 16
#define LANES8 8

static inline __attribute__((always_inline)) v16 load(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Four accumulators folded into one vector whose lanes 0, 4, 8 and 12 hold the sums of a, c, b and d. */
static inline __attribute__((always_inline)) v16 fold4(v16 a, v16 b, v16 c, v16 d) {
    const i16 lo16 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const i16 hi16 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16 ab = __builtin_shuffle(a, b, lo16) + __builtin_shuffle(a, b, hi16); /* a's 8 partials, then b's */
    v16 cd = __builtin_shuffle(c, d, lo16) + __builtin_shuffle(c, d, hi16);
    const i16 lo8 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const i16 hi8 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    v16 e = __builtin_shuffle(ab, cd, lo8) + __builtin_shuffle(ab, cd, hi8); /* groups of 4: a, c, b, d */
    const i16 swap2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    e += __builtin_shuffle(e, swap2);
    const i16 swap1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    return e + __builtin_shuffle(e, swap1);
}

/* `xrows` (1..4) input rows against the 4 weight rows at w: out[m * ldy + j] = x_m . w_j. `next` (or 0): the next
 * block's weight rows, fetched into cache meanwhile, so that memory keeps streaming while a block's later passes (rows
 * 5-8, 9-12, ...) compute from cache; without it a forward over 8 positions cost 1.54 times one over a single
 * position, with it 1.13 (docs/PERFORMANCE.md). */
static inline __attribute__((always_inline)) void block(const float *w, const float *x, int64_t k, int xrows,
                                                        float *out, int64_t ldy, const float *next) {
    v16 acc[WROWS][XROWS];
    for (int j = 0; j < WROWS; j++)
        for (int m = 0; m < XROWS; m++) acc[j][m] = (v16){0};
    int64_t whole = k - k % LANES;
    for (int64_t i = 0; i < whole; i += LANES) {
        v16 wv[WROWS];
        for (int j = 0; j < WROWS; j++) wv[j] = load(w + j * k + i);
        if (next) /* one 64-byte line a row, what a step reads of the current block */
            for (int j = 0; j < WROWS; j++) __builtin_prefetch(next + j * k + i);
        for (int m = 0; m < xrows; m++) {
            v16 xv = load(x + m * k + i);
            for (int j = 0; j < WROWS; j++) acc[j][m] += wv[j] * xv;
        }
    }
    for (int j = 0; j < WROWS; j++) {
        v16 sums = fold4(acc[j][0], acc[j][2], acc[j][1], acc[j][3]);
        for (int m = 0; m < xrows; m++) {
            float s = sums[4 * m];
            for (int64_t i = whole; i < k; i++) s += w[j * k + i] * x[m * k + i];
            out[m * ldy + j] = s;
        }
    }
}

static inline __attribute__((always_inline)) v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Four accumulators folded into one vector whose lanes 0, 2, 4 and 6 hold the sums of a, c, b and d. */
static inline __attribute__((always_inline)) v8 fold4_8(v8 a, v8 b, v8 c, v8 d) {
    const i8 lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 ab = __builtin_shuffle(a, b, lo4) + __builtin_shuffle(a, b, hi4); /* a's 4 partials, then b's */
    v8 cd = __builtin_shuffle(c, d, lo4) + __builtin_shuffle(c, d, hi4);
    const i8 lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    v8 e = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2); /* pairs: a, c, b, d */
    const i8 swap1 = {1, 0, 3, 2, 5, 4, 7, 6};
    return e + __builtin_shuffle(e, swap1);
}

/* `block` for the narrow kernel: `xrows` (1..4) input rows against the 3 weight rows at w, in 12 accumulators of 8
 * lanes: with the 3 weight vectors and an input vector, the 16 registers AVX2 has. */
static inline __attribute__((always_inline)) void block8(const float *w, const float *x, int64_t k, int xrows,
                                                         float *out, int64_t ldy, const float *next) {
    v8 acc[WROWS8][XROWS8];
    for (int j = 0; j < WROWS8; j++)
        for (int m = 0; m < XROWS8; m++) acc[j][m] = (v8){0};
    int64_t whole = k - k % LANES8;
    for (int64_t i = 0; i < whole; i += LANES8) {
        v8 wv[WROWS8];
        for (int j = 0; j < WROWS8; j++) wv[j] = load8(w + j * k + i);
        if (next && i % LANES == 0) /* one 64-byte line a row every other step */
            for (int j = 0; j < WROWS8; j++) __builtin_prefetch(next + j * k + i);
        for (int m = 0; m < xrows; m++) {
            v8 xv = load8(x + m * k + i);
            for (int j = 0; j < WROWS8; j++) acc[j][m] += wv[j] * xv;
        }
    }
    for (int j = 0; j < WROWS8; j++) {
        v8 sums = fold4_8(acc[j][0], acc[j][2], acc[j][1], acc[j][3]);
        for (int m = 0; m < xrows; m++) {
            float s = sums[2 * m];
            for (int64_t i = whole; i < k; i++) s += w[j * k + i] * x[m * k + i];
            out[m * ldy + j] = s;
        }
    }
}

/* Weight rows [first, last) of a product whose first row is a multiple of the kernel's block, with the wide kernel
 * (`wide`) or the narrow one; the remainder row by row. */
static inline __attribute__((always_inline)) void rows_range(int wide, const float *x, const float *w, const float *b,
                                                             float *y, int64_t rows, int64_t n, int64_t k,
                                                             int64_t first, int64_t last) {
    const int wrows = wide ? WROWS : WROWS8, xrows_max = wide ? XROWS : XROWS8;
    int64_t j = first;
    for (; j + wrows <= last; j += wrows) {
        for (int64_t m = 0; m < rows; m += xrows_max) {
            int64_t xrows = rows - m < xrows_max ? rows - m : xrows_max;
            const float *xm = x + m * k;
            float *ym = y + m * n + j;
            const float *next = j + 2 * wrows <= last ? w + (j + wrows) * k : 0;
            switch (xrows + (wide ? 0 : 4)) { /* constant row counts, so the accumulators stay in registers */
            case 4: block(w + j * k, xm, k, 4, ym, n, next); break;
            case 3: block(w + j * k, xm, k, 3, ym, n, next); break;
            case 2: block(w + j * k, xm, k, 2, ym, n, next); break;
            case 1: block(w + j * k, xm, k, 1, ym, n, next); break;
            case 8: block8(w + j * k, xm, k, 4, ym, n, next); break;
            case 7: block8(w + j * k, xm, k, 3, ym, n, next); break;
            case 6: block8(w + j * k, xm, k, 2, ym, n, next); break;
            default: block8(w + j * k, xm, k, 1, ym, n, next); break;
            }
        }
    }
    for (; j < last; j++)
        for (int64_t m = 0; m < rows; m++) {
            float s = 0;
            for (int64_t i = 0; i < k; i++) s += w[j * k + i] * x[m * k + i];
            y[m * n + j] = s;
        }
    if (b)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t c = first; c < last; c++) y[m * n + c] += b[c];
}

WIDE_TARGET static void rows_wide(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t n,
                                  int64_t k, int64_t first, int64_t last) {
    rows_range(1, x, w, b, y, rows, n, k, first, last);
}

NARROW_CLONES static void rows_narrow(const float *x, const float *w, const float *b, float *y, int64_t rows,
                                      int64_t n, int64_t k, int64_t first, int64_t last) {
    rows_range(0, x, w, b, y, rows, n, k, first, last);
}

/* The wide kernel where the host has AVX-512 (what x86-64-v4 requires of it), else the narrow one. */
static int host_is_wide(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512cd");
#else
    return 0;
#endif
}

static int host_wide; /* set when the module loads */
static int wide;      /* the kernel in use: the host's, or the one a test chose */

static void *pointer(PyObject *address) { return PyLong_AsVoidPtr(address); }

/* linear(x, w, b, y, rows, n, k, threads): y[rows, n] = x[rows, k] w[n, k]^T (+ b[n]); contiguous float32 buffers
 * by address (b: 0 for none). */
static PyObject *linear(PyObject *self, PyObject *args) {
    PyObject *xa, *wa, *ba, *ya;
    Py_ssize_t rows, n, k, threads;
    if (!PyArg_ParseTuple(args, "OOOOnnnn", &xa, &wa, &ba, &ya, &rows, &n, &k, &threads)) return NULL;
    const float *x = pointer(xa), *w = pointer(wa), *b = pointer(ba);
    float *y = pointer(ya);
    if (PyErr_Occurred()) return NULL;
    if (rows <= 0 || n <= 0 || k <= 0 || threads <= 0 || !x || !w || !y) {
        PyErr_SetString(PyExc_ValueError, "linear: empty product or null buffer");
        return NULL;
    }
    const int64_t wrows = wide ? WROWS : WROWS8; /* threads split at block bounds: an output's sum is the same */
    int64_t blocks = (n + wrows - 1) / wrows;
    if (threads > blocks) threads = blocks;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel num_threads((int)threads)
    {
        int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        int64_t first = blocks * t / count * wrows, last = blocks * (t + 1) / count * wrows;
        if (last > n) last = n;
        if (first < last) (wide ? rows_wide : rows_narrow)(x, w, b, y, rows, n, k, first, last);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* use(name): run the "wide" or "narrow" kernel from now on (tests run both where the host has AVX-512); the name
 * of the one used before. */
static PyObject *use(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const char *before = wide ? "wide" : "narrow";
    if (strcmp(name, "narrow") == 0) wide = 0;
    else if (strcmp(name, "wide") == 0 && host_wide) wide = 1;
    else {
        PyErr_Format(PyExc_ValueError, "use: %s is not a kernel this host runs (%s)", name,
                     host_wide ? "wide, narrow" : "narrow: the wide one needs AVX-512");
        return NULL;
    }
    return PyUnicode_FromString(before);
}

static PyObject *kernels(PyObject *self, PyObject *args) {
    return host_wide ? Py_BuildValue("(ss)", "wide", "narrow") : Py_BuildValue("(s)", "narrow");
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS, "y = x w^T (+ b) over a few float32 rows, by buffer address."},
    {"use", use, METH_VARARGS, "Run the named kernel from now on; returns the one used before."},
    {"kernels", kernels, METH_NOARGS, "The kernels this host runs, its default first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", "Linear layers over a few rows, weight read once.",
                                    -1, methods};

/* VERSION names the kernel in kernel records (jfcore/decoding/runner/linear.py): a change that alters its speed raises
 * it, so records timed with the old one are measured again. 2: the next block's weights prefetched. 3: the narrow
 * kernel where the host has no AVX-512. */
PyMODINIT_FUNC PyInit__rows(void) {
    wide = host_wide = host_is_wide();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", 3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
