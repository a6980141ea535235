/* Decode attention over the paged KV cache on the CPU, built as engine._cpu_attention (cpu_attention.py
   says why).

   decode(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, head_dim,
          block_size, max_blocks, window, scale, first, last) attends sequences first..last-1, each with
   one query (its last position), over the keys its block table names, in place: no gathered copy of
   the keys. The G = num_heads / num_kv_heads query heads that share a KV head are attended together,
   so each key and value row is read once per sequence. The softmax is the online one (running max
   and sum), rescaled once per tile of keys, so one pass over the keys suffices.

   The (sequence, KV head) pairs are shared out over OpenMP threads. The extension is linked against
   libgomp.so.1 and imported after torch, whose wheel ships that library: the loader then resolves it
   to torch's copy, so these are torch's own intra-op threads, not a second pool fighting them for
   the cores.

   Every size is checked against the buffers, and every block id against the cache, before the loop
   runs (with the GIL released): a bad table raises ValueError, never an out-of-bounds read. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "cpu_buffers.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 32      /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define TILE 64           /* keys scored before the running max is updated */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *tables, *lens;
    float *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
} job_t;

/* e^x for x <= 0 (a score minus the running max), to about 2 ulp, in plain arithmetic so the compiler
   vectorizes the loops that call it (libm's expf is a call per element): x = n ln2 + r with |r| <= ln2/2,
   e^r by its degree-6 Taylor polynomial, 2^n put into the exponent bits. Below -87 the result is 0. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* One sequence's query heads that share KV head h; D is the head size, a constant where the caller
   inlines it for a common size (the vector loops over it are then unrolled, with no remainder). */
static inline __attribute__((always_inline)) void attend_heads(const job_t *job, int64_t s, int64_t h,
                                                               const int64_t D) {
    const int64_t H = job->num_heads, HKV = job->num_kv_heads, BS = job->block_size;
    const int64_t G = H / HKV, row = HKV * D;
    float acc[MAX_GROUP * MAX_HEAD_DIM], qs[MAX_GROUP * MAX_HEAD_DIM], scores[MAX_GROUP * TILE];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    const float *keys[TILE], *values[TILE];
    const int64_t len = job->lens[s];
    const int64_t start = job->window > 0 && len > job->window ? len - job->window : 0;
    const int64_t *table = job->tables + s * job->max_blocks;
    const float *qh = job->q + (s * H + h * G) * D;
    for (int64_t i = 0; i < G * D; i++) qs[i] = qh[i] * job->scale;
    for (int64_t g = 0; g < G; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    int64_t block = start / BS, offset = start % BS;   /* where the next key is */
    for (int64_t t0 = start; t0 < len; t0 += TILE) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        for (int t = 0; t < n; t++) {
            const int64_t slot = table[block] * BS + offset;
            keys[t] = job->k_cache + slot * row + h * D;
            values[t] = job->v_cache + slot * row + h * D;
            if (++offset == BS) {
                offset = 0;
                block++;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qs + g * D;
            float *sc = scores + g * TILE;
            float tile_max = run_max[g];
            for (int t = 0; t < n; t++) {
                const float *k = keys[t];
                float dot = 0.f;
                for (int64_t d = 0; d < D; d++) dot += qg[d] * k[d];
                sc[t] = dot;
                tile_max = dot > tile_max ? dot : tile_max;
            }
            const float rescale = run_max[g] == -INFINITY ? 0.f : exp_nonpositive(run_max[g] - tile_max);
            float sum = 0.f;
            for (int t = 0; t < n; t++) {
                sc[t] = exp_nonpositive(sc[t] - tile_max);
                sum += sc[t];
            }
            run_sum[g] = run_sum[g] * rescale + sum;
            run_max[g] = tile_max;
            float *a = acc + g * D;
            for (int64_t d = 0; d < D; d++) a[d] *= rescale;
            for (int t = 0; t < n; t++) {
                const float *v = values[t];
                const float p = sc[t];
                for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *o = job->out + (s * H + h * G + g) * D;
        const float inverse = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        for (int64_t d = 0; d < D; d++) o[d] = acc[g * D + d] * inverse;
    }
}

/* Built for the machine it is installed on (pip install -e .): one copy per vector width, the widest the
   CPU has chosen at load time; -mtune=native (pyproject.toml) schedules them for this CPU (generic
   tuning measured 1.6x slower here). */
#if defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
static void attend(const job_t *job, int64_t s, int64_t h) {
    switch (job->head_dim) {
    case 64: attend_heads(job, s, h, 64); break;
    case 128: attend_heads(job, s, h, 128); break;
    default: attend_heads(job, s, h, job->head_dim);
    }
}

static int check(job_t *job, const Py_buffer *views, int64_t first, int64_t last) {
    enum { Q, K, V, TABLES, LENS, OUT };
    const int64_t H = job->num_heads, HKV = job->num_kv_heads, D = job->head_dim, BS = job->block_size;
    if (HKV <= 0 || H <= 0 || H % HKV || H / HKV > MAX_GROUP || D <= 0 || D > MAX_HEAD_DIM || BS <= 0
        || job->max_blocks <= 0 || job->window < 0) {
        PyErr_Format(PyExc_ValueError, "unsupported shape: %lld heads, %lld kv heads, head_dim %lld, block size %lld",
                     (long long)H, (long long)HKV, (long long)D, (long long)BS);
        return -1;
    }
    const int64_t num_seqs = views[LENS].len / 8;
    const int64_t block_bytes = BS * HKV * D * 4, num_blocks = views[K].len / block_bytes;
    if (views[Q].len != num_seqs * H * D * 4 || views[OUT].len != views[Q].len
        || views[TABLES].len != num_seqs * job->max_blocks * 8 || views[K].len != views[V].len
        || views[K].len % block_bytes || first < 0 || last > num_seqs || first > last) {
        PyErr_SetString(PyExc_ValueError, "q, out, the caches, block_tables and context_lens disagree on their sizes");
        return -1;
    }
    for (int64_t s = first; s < last; s++) {
        const int64_t len = job->lens[s];
        if (len <= 0 || len > job->max_blocks * BS) {
            PyErr_Format(PyExc_ValueError, "sequence %lld: context length %lld does not fit its %lld blocks",
                         (long long)s, (long long)len, (long long)job->max_blocks);
            return -1;
        }
        for (int64_t b = 0; b < (len + BS - 1) / BS; b++) {
            const int64_t block = job->tables[s * job->max_blocks + b];
            if (block < 0 || block >= num_blocks) {
                PyErr_Format(PyExc_ValueError, "sequence %lld: block id %lld outside the cache's %lld blocks",
                             (long long)s, (long long)block, (long long)num_blocks);
                return -1;
            }
        }
    }
    return 0;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    static const char *const names[] = {"q", "k_cache", "v_cache", "block_tables", "context_lens", "out"};
    PyObject *objects[6];
    long long H, HKV, D, BS, max_blocks, window, first, last;
    float scale;
    int num_threads;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLLLfLLi", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &objects[5], &H, &HKV, &D, &BS, &max_blocks, &window, &scale, &first, &last, &num_threads))
        return NULL;
    Py_buffer views[6];
    const int got = get_buffers(objects, views, 6, 5, names);
    PyObject *result = NULL;
    if (got == 6) {
        job_t job = {.q = views[0].buf, .k_cache = views[1].buf, .v_cache = views[2].buf, .tables = views[3].buf,
                     .lens = views[4].buf, .out = views[5].buf, .num_heads = H, .num_kv_heads = HKV, .head_dim = D,
                     .block_size = BS, .max_blocks = max_blocks, .window = window, .scale = scale};
        if (check(&job, views, first, last) == 0) {
            const int64_t items = (last - first) * HKV;
            Py_BEGIN_ALLOW_THREADS
            #pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) if (num_threads > 1)
            for (int64_t i = 0; i < items; i++) attend(&job, first + i / HKV, i % HKV);
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    release_buffers(views, got);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, head_dim, block_size, "
     "max_blocks, window, scale, first, last, num_threads): one-query attention of sequences first..last-1 over "
     "their paged keys (float32), written to out, on num_threads OpenMP threads. Raises ValueError on "
     "inconsistent sizes or block ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_attention", .m_doc = "Decode attention over the paged KV cache on the CPU.",
    .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_attention(void) { return PyModule_Create(&module); }
