/* A matmul of a few rows on the CPU, built as engine._cpu_matmul (cpu_matmul.py says why).

   matmul(x, w, out, bias, rows, n, k, num_threads): out[rows, n] = x[rows, k] @ w[n, k]^T (+ bias[n] where bias is
   not None) in float32, for the few rows of a decode step (rows <= 16) against a large weight. The bias joins each
   sum after its lanes are totalled, the one float32 addition torch's `out + bias` would make after the matmul.
   Each weight row is read once, from memory, with the next rows prefetched while these are multiplied; up to 8
   input rows are kept in registers' reach per pass (16 rows: two passes over each weight row while it is still in
   L1). The weight's rows are shared out over OpenMP threads in contiguous slabs; the extension is linked against
   libgomp.so.1 and imported after torch, whose wheel ships that library, so these are torch's own threads
   (engine/cpu_attention.c does the same).

   Sizes are checked against the buffers before the loop runs (with the GIL released). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cpu_buffers.h"
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#define MAX_ROWS 16
#define BLOCK 8           /* input rows multiplied per pass over a pair of weight rows */
#define LANES 16          /* floats per vector */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float total(vec v) {
    float sum = 0.f;
    for (int i = 0; i < LANES; i++) sum += v[i];
    return sum;
}

/* Weight rows first..last-1 (a multiple of 2 apart, except at the end). k is a multiple of LANES. */
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void slab(const float *x, const float *w, const float *bias, float *out, int64_t rows, int64_t n, int64_t k,
                 int64_t first, int64_t last) {
    for (int64_t j = first; j < last; j += 2) {
        const float *w0 = w + j * k;
        const int two = j + 1 < last;
        const float *w1 = two ? w0 + k : w0;
        for (int64_t m0 = 0; m0 < rows; m0 += BLOCK) {
            const int64_t block = rows - m0 < BLOCK ? rows - m0 : BLOCK;
            vec acc0[BLOCK], acc1[BLOCK];
            for (int i = 0; i < BLOCK; i++) acc0[i] = acc1[i] = (vec){0};
            for (int64_t d = 0; d < k; d += LANES) {
                if (m0 == 0) {  /* the pair after next: in flight while this one is multiplied */
                    __builtin_prefetch(w0 + d + 2 * k);
                    __builtin_prefetch(w1 + d + 2 * k);
                }
                const vec a = load(w0 + d), b = load(w1 + d);
                for (int i = 0; i < BLOCK; i++) {
                    if (i < block) {
                        const vec v = load(x + (m0 + i) * k + d);
                        acc0[i] += v * a;
                        acc1[i] += v * b;
                    }
                }
            }
            for (int64_t i = 0; i < block; i++) {
                float sum0 = total(acc0[i]), sum1 = total(acc1[i]);
                if (bias) {
                    sum0 += bias[j];
                    sum1 += bias[two ? j + 1 : j];
                }
                out[(m0 + i) * n + j] = sum0;
                if (two) out[(m0 + i) * n + j + 1] = sum1;
            }
        }
    }
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    static const char *const names[] = {"x", "w", "out", "bias"};
    PyObject *objects[4];
    long long rows, n, k;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOLLLi", &objects[0], &objects[1], &objects[2], &objects[3], &rows, &n, &k,
                          &num_threads))
        return NULL;
    const int count = objects[3] == Py_None ? 3 : 4;
    Py_buffer views[4];
    const int got = get_buffers(objects, views, count, 2, names);
    PyObject *result = NULL;
    if (got == count) {
        if (rows < 1 || rows > MAX_ROWS || n < 1 || k < LANES || k % LANES) {
            PyErr_Format(PyExc_ValueError, "unsupported shape: %lld rows (1-%d), k %lld (a multiple of %d)", rows,
                         MAX_ROWS, k, LANES);
        } else if (views[0].len != rows * k * 4 || views[1].len != n * k * 4 || views[2].len != rows * n * 4 ||
                   (count == 4 && views[3].len != n * 4)) {
            PyErr_SetString(PyExc_ValueError, "x, w, out and bias disagree with rows, n and k");
        } else {
            const float *x = views[0].buf, *w = views[1].buf, *bias = count == 4 ? views[3].buf : NULL;
            float *out = views[2].buf;
            const int64_t pairs = (n + 1) / 2;
            if (num_threads < 1) num_threads = 1;
            Py_BEGIN_ALLOW_THREADS
            #pragma omp parallel num_threads(num_threads) if (num_threads > 1)
            {
#if defined(_OPENMP)
                const int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
#else
                const int64_t part = 0, parts = 1;
#endif
                const int64_t first = 2 * (pairs * part / parts), last = 2 * (pairs * (part + 1) / parts);
                slab(x, w, bias, out, rows, n, k, first, last < n ? last : n);
            }
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    release_buffers(views, got);
    return result;
}

static PyMethodDef methods[] = {
    {"matmul", matmul, METH_VARARGS,
     "matmul(x, w, out, bias, rows, n, k, num_threads): out[rows, n] = x[rows, k] @ w[n, k]^T + bias[n] (bias None: "
     "none; float32, rows <= 16, k a multiple of 16) on num_threads OpenMP threads. Raises ValueError on sizes that "
     "disagree."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_matmul", .m_doc = "A matmul of a few rows against a large weight on the CPU.",
    .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_matmul(void) { return PyModule_Create(&module); }
