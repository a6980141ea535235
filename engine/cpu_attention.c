/* Decode attention over the paged KV cache on the CPU, built as engine._cpu_attention (cpu_attention.py
   says why).

   decode(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, head_dim,
          block_size, max_blocks, window, scale, first, last, num_threads, sinks, softcap) attends sequences
   first..last-1, each with one query (its last position), over the keys its block table names, in place:
   no gathered copy of the keys. The G = num_heads / num_kv_heads query heads that share a KV head are attended together,
   so each key and value row is read once per sequence, and a sequence's KV heads are taken a run at a
   time (up to MAX_GROUP query heads), so a cache row's heads are read as one contiguous stretch with
   the next tile's rows prefetched. The softmax is the online one (running max and sum), rescaled once
   per tile of keys, so one pass over the keys suffices. With sinks (gpt-oss: one learned logit per query
   head, a term of the softmax's denominator that weighs no value) a head's running max and sum start at
   its sink and 1 instead of -inf and 0: the sink is a key scored before the others, with a zero value.
   With a softcap (Gemma 2; 0: none) each tile's scaled scores become softcap * tanh(score / softcap) before
   its softmax: one test per tile where there is none. A window > 0 attends only the last `window` keys; one < 0 only
   those of the query's own chunk of -window keys (chunked attention); 0 all.

   The items (a sequence's run of KV heads) are shared out over OpenMP threads. The extension is linked against
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
    const float *sinks;   /* [num_heads], or NULL */
    float *out;
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
    float scale;
    float softcap;        /* > 0: scores soft-capped by it; 0: not */
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

/* Gemma 2's soft-capping of n scores in place, cap * tanh(score / cap), to a few ulp, in plain arithmetic that
   vectorizes as exp_nonpositive does: tanh(a) = -expm1(-2a) / (2 + expm1(-2a)) for a = |score| / cap, the sign put
   back after. expm1(x) is 2^n (e^r - 1) + 2^n - 1, with e^r - 1 by its Taylor polynomial without the 1, so that a
   small score (where tanh is nearly linear) keeps its relative accuracy; for n = 0 that is e^r - 1 alone, chosen
   outright because -fassociative-math may regroup the sum into one that cancels. Below -20 tanh is 1 in float. */
static inline __attribute__((always_inline)) void softcap_tile(float *sc, int n, float cap) {
    const float inverse = 1.f / cap;
    for (int t = 0; t < n; t++) {
        float x = -2.f * fabsf(sc[t]) * inverse;
        x = x < -20.f ? -20.f : x;
        const float k = __builtin_roundf(x * 1.44269504088896341f);
        const float r = (x - k * 0.693359375f) + k * 2.12194440e-4f;
        float p = 1.f / 5040.f;
        p = p * r + 1.f / 720.f;
        p = p * r + 1.f / 120.f;
        p = p * r + 1.f / 24.f;
        p = p * r + 1.f / 6.f;
        p = p * r + 0.5f;
        p = p * r + 1.f;
        p = p * r;
        union { float f; int32_t i; } scale = {.i = ((int32_t)k + 127) << 23};
        const float expm1 = k == 0.f ? p : p * scale.f + (scale.f - 1.f);
        const float capped = cap * (-expm1 / (2.f + expm1));
        sc[t] = sc[t] < 0.f ? -capped : capped;
    }
}

/* One query head's online softmax over a tile of n scores: turns them into weights in place (relative
   to the running max), folds them into the running max and sum, and returns the factor by which the
   head's weighted sum of values so far must be scaled to stay relative to the new max. */
static inline __attribute__((always_inline)) float softmax_tile(float *sc, int n, float *run_max, float *run_sum) {
    float tile_max = *run_max;
    for (int t = 0; t < n; t++) tile_max = sc[t] > tile_max ? sc[t] : tile_max;
    const float rescale = *run_max == -INFINITY ? 0.f : exp_nonpositive(*run_max - tile_max);
    float sum = 0.f;
    for (int t = 0; t < n; t++) {
        sc[t] = exp_nonpositive(sc[t] - tile_max);
        sum += sc[t];
    }
    *run_sum = *run_sum * rescale + sum;
    *run_max = tile_max;
    return rescale;
}

/* Sixteen floats, loaded from and stored to any float address. The loops below are written on these
   vectors so that each key and value row is read contiguously, a vector at a time: left to itself the
   compiler vectorizes the plain loops across keys instead, with a gather per element, which on CPUs
   whose gathers are microcoded (AMD's) made this loop run at a tenth of the memory's speed. The
   compiler lowers the type to whatever vectors the target has (one AVX-512 register, two AVX ones). */
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));
#define LANES 16

static inline __attribute__((always_inline)) float sum16(vec16 v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* The addresses of the next n keys' and values' rows from KV head h on, from (block, offset) on, which
   it advances; `bytes` of each row (its item's heads) are prefetched. */
static inline __attribute__((always_inline)) void locate(const job_t *job, const int64_t *table,
                                                         const float *rows[2][TILE], int64_t *block, int64_t *offset,
                                                         int64_t h, int64_t row, int64_t D, int64_t bytes, int n) {
    for (int t = 0; t < n; t++) {
        const int64_t slot = table[*block] * job->block_size + *offset;
        rows[0][t] = job->k_cache + slot * row + h * D;
        rows[1][t] = job->v_cache + slot * row + h * D;
        for (int64_t byte = 0; byte < bytes; byte += 64) {
            __builtin_prefetch((const char *)rows[0][t] + byte, 0, 2);
            __builtin_prefetch((const char *)rows[1][t] + byte, 0, 2);
        }
        if (++*offset == job->block_size) {
            *offset = 0;
            ++*block;
        }
    }
}

/* The first key a sequence's query (at position len - 1) sees: of the last `window` keys (window > 0), of its own
   chunk of -window keys (window < 0: Llama 4's chunked attention), or of all (0). */
static inline int64_t first_key(int64_t window, int64_t len) {
    if (window > 0) return len > window ? len - window : 0;
    if (window < 0) return (len - 1) / -window * -window;
    return 0;
}

/* One sequence's query heads of KV heads h0..h1-1 (at most MAX_GROUP query heads in all), for a head size
   that is a multiple of 16; D is a constant where the caller inlines it for a common size (the loops
   over it are then unrolled). An item's KV heads sit side by side in each cache row, so its keys and
   values are read as one contiguous run per row rather than a head's slice every row's length. */
static inline __attribute__((always_inline)) void attend_vectors(const job_t *job, int64_t s, int64_t h0, int64_t h1,
                                                                 const int64_t D) {
    const int64_t H = job->num_heads, HKV = job->num_kv_heads;
    const int64_t G = H / HKV, row = HKV * D, V = D / LANES, NH = (h1 - h0) * G;
    vec16 acc[MAX_GROUP * MAX_HEAD_DIM / LANES], qs[MAX_GROUP * MAX_HEAD_DIM / LANES];
    float scores[MAX_GROUP * TILE], run_max[MAX_GROUP], run_sum[MAX_GROUP];
    const float *rows[2][2][TILE];   /* [tile parity][keys, values][key]: this tile's rows and the next's */
    const int64_t len = job->lens[s];
    const int64_t start = first_key(job->window, len);
    const int64_t *table = job->tables + s * job->max_blocks;
    const float *qh = job->q + (s * H + h0 * G) * D;
    const int64_t bytes = (h1 - h0) * D * 4;
    for (int64_t i = 0; i < NH * V; i++) {
        qs[i] = *(const vec16 *)(qh + i * LANES) * job->scale;
        acc[i] = (vec16){0};
    }
    for (int64_t i = 0; i < NH; i++) {
        run_max[i] = job->sinks ? job->sinks[h0 * G + i] : -INFINITY;
        run_sum[i] = job->sinks ? 1.f : 0.f;
    }
    int64_t block = start / job->block_size, offset = start % job->block_size;   /* the next tile's first key */
    locate(job, table, rows[0], &block, &offset, h0, row, D, bytes, len - start < TILE ? (int)(len - start) : TILE);
    for (int64_t t0 = start, parity = 0; t0 < len; t0 += TILE, parity ^= 1) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        const float *const *keys = rows[parity][0], *const *values = rows[parity][1];
        /* the next tile's rows are asked for now, so they arrive while this one is computed */
        const int64_t next = len - t0 - n < TILE ? len - t0 - n : TILE;
        if (next > 0) locate(job, table, rows[parity ^ 1], &block, &offset, h0, row, D, bytes, (int)next);
        /* scores: each key row is loaded once and dotted with every query head of its group */
        for (int t = 0; t < n; t++) {
            for (int64_t kh = 0; kh < h1 - h0; kh++) {
                const vec16 *k = (const vec16 *)(keys[t] + kh * D);
                for (int64_t g = 0; g < G; g++) {
                    const vec16 *qg = qs + (kh * G + g) * V;
                    vec16 dot = qg[0] * k[0];
                    for (int64_t j = 1; j < V; j++) dot += qg[j] * k[j];
                    scores[(kh * G + g) * TILE + t] = sum16(dot);
                }
            }
        }
        if (job->softcap > 0.f)
            for (int64_t i = 0; i < NH; i++) softcap_tile(scores + i * TILE, n, job->softcap);
        for (int64_t i = 0; i < NH; i++) {
            const float rescale = softmax_tile(scores + i * TILE, n, &run_max[i], &run_sum[i]);
            for (int64_t j = 0; j < V; j++) acc[i * V + j] *= rescale;
        }
        /* values: each row loaded once and added, weighted, into its group's query heads */
        for (int t = 0; t < n; t++) {
            for (int64_t kh = 0; kh < h1 - h0; kh++) {
                const vec16 *v = (const vec16 *)(values[t] + kh * D);
                for (int64_t g = 0; g < G; g++) {
                    const float p = scores[(kh * G + g) * TILE + t];
                    vec16 *a = acc + (kh * G + g) * V;
                    for (int64_t j = 0; j < V; j++) a[j] += p * v[j];
                }
            }
        }
    }
    for (int64_t i = 0; i < NH; i++) {
        vec16 *o = (vec16 *)(job->out + (s * H + h0 * G + i) * D);
        const float inverse = run_sum[i] > 0.f ? 1.f / run_sum[i] : 0.f;
        for (int64_t j = 0; j < V; j++) o[j] = acc[i * V + j] * inverse;
    }
}

/* The same for any other head size, in plain loops over the head's elements. */
static inline __attribute__((always_inline)) void attend_scalars(const job_t *job, int64_t s, int64_t h) {
    const int64_t H = job->num_heads, HKV = job->num_kv_heads, BS = job->block_size, D = job->head_dim;
    const int64_t G = H / HKV, row = HKV * D;
    float acc[MAX_GROUP * MAX_HEAD_DIM], qs[MAX_GROUP * MAX_HEAD_DIM], scores[MAX_GROUP * TILE];
    float run_max[MAX_GROUP], run_sum[MAX_GROUP];
    const int64_t len = job->lens[s];
    const int64_t start = first_key(job->window, len);
    const int64_t *table = job->tables + s * job->max_blocks;
    const float *qh = job->q + (s * H + h * G) * D;
    for (int64_t i = 0; i < G * D; i++) qs[i] = qh[i] * job->scale;
    for (int64_t g = 0; g < G; g++) {
        run_max[g] = job->sinks ? job->sinks[h * G + g] : -INFINITY;
        run_sum[g] = job->sinks ? 1.f : 0.f;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t t0 = start; t0 < len; t0 += TILE) {
        const int n = (int)(len - t0 < TILE ? len - t0 : TILE);
        for (int t = 0; t < n; t++) {
            const float *k = job->k_cache + (table[(t0 + t) / BS] * BS + (t0 + t) % BS) * row + h * D;
            for (int64_t g = 0; g < G; g++) {
                float dot = 0.f;
                for (int64_t d = 0; d < D; d++) dot += qs[g * D + d] * k[d];
                scores[g * TILE + t] = dot;
            }
        }
        if (job->softcap > 0.f)
            for (int64_t g = 0; g < G; g++) softcap_tile(scores + g * TILE, n, job->softcap);
        for (int64_t g = 0; g < G; g++) {
            const float rescale = softmax_tile(scores + g * TILE, n, &run_max[g], &run_sum[g]);
            for (int64_t d = 0; d < D; d++) acc[g * D + d] *= rescale;
        }
        for (int t = 0; t < n; t++) {
            const float *v = job->v_cache + (table[(t0 + t) / BS] * BS + (t0 + t) % BS) * row + h * D;
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += scores[g * TILE + t] * v[d];
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
static void attend(const job_t *job, int64_t s, int64_t h0, int64_t h1) {
    switch (job->head_dim) {
    case 32: attend_vectors(job, s, h0, h1, 32); break;
    case 64: attend_vectors(job, s, h0, h1, 64); break;
    case 128: attend_vectors(job, s, h0, h1, 128); break;
    default:
        if (job->head_dim % LANES == 0) attend_vectors(job, s, h0, h1, job->head_dim);
        else
            for (int64_t h = h0; h < h1; h++) attend_scalars(job, s, h);
    }
}

static int check(job_t *job, const Py_buffer *views, int64_t first, int64_t last) {
    enum { Q, K, V, TABLES, LENS, OUT };
    const int64_t H = job->num_heads, HKV = job->num_kv_heads, D = job->head_dim, BS = job->block_size;
    if (HKV <= 0 || H <= 0 || H % HKV || H / HKV > MAX_GROUP || D <= 0 || D > MAX_HEAD_DIM || BS <= 0
        || job->max_blocks <= 0) {
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
    static const char *const names[] = {"q", "k_cache", "v_cache", "block_tables", "context_lens", "out", "sinks"};
    PyObject *objects[7];
    long long H, HKV, D, BS, max_blocks, window, first, last;
    float scale, softcap = 0.f;
    int num_threads;
    PyObject *sinks = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLLLfLLi|Of", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &objects[5], &H, &HKV, &D, &BS, &max_blocks, &window, &scale, &first, &last, &num_threads,
                          &sinks, &softcap))
        return NULL;
    if (!(softcap >= 0.f && softcap < INFINITY)) {
        PyErr_Format(PyExc_ValueError, "softcap must be a positive number, or 0 for none; got %g", (double)softcap);
        return NULL;
    }
    const int num_views = sinks == Py_None ? 6 : 7;
    objects[6] = sinks;
    Py_buffer views[7];
    const int got = get_buffers(objects, views, num_views, 5, names);
    PyObject *result = NULL;
    if (got == num_views) {
        job_t job = {.q = views[0].buf, .k_cache = views[1].buf, .v_cache = views[2].buf, .tables = views[3].buf,
                     .lens = views[4].buf, .out = views[5].buf, .num_heads = H, .num_kv_heads = HKV, .head_dim = D,
                     .block_size = BS, .max_blocks = max_blocks, .window = window, .scale = scale,
                     .softcap = softcap, .sinks = num_views == 7 ? views[6].buf : NULL};
        if (num_views == 7 && views[6].len != H * 4) {
            PyErr_Format(PyExc_ValueError, "sinks hold %lld bytes, not one float32 for each of the %lld heads",
                         (long long)views[6].len, (long long)H);
        } else if (check(&job, views, first, last) == 0) {
            /* an item: one sequence's run of KV heads, as many as MAX_GROUP query heads hold, fewer where
               that leaves the threads too few items */
            int64_t per_item = MAX_GROUP / (H / HKV);
            while (num_threads > 1 && per_item > 1
                   && (last - first) * ((HKV + per_item - 1) / per_item) < 2 * num_threads)
                per_item /= 2;
            const int64_t runs = (HKV + per_item - 1) / per_item, items = (last - first) * runs;
            Py_BEGIN_ALLOW_THREADS
            #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
            for (int64_t i = 0; i < items; i++) {
                const int64_t h0 = i % runs * per_item, h1 = h0 + per_item < HKV ? h0 + per_item : HKV;
                attend(&job, first + i / runs, h0, h1);
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
    {"decode", decode, METH_VARARGS,
     "decode(q, k_cache, v_cache, block_tables, context_lens, out, num_heads, num_kv_heads, head_dim, block_size, "
     "max_blocks, window, scale, first, last, num_threads, sinks=None, softcap=0): one-query attention of sequences "
     "first..last-1 over their paged keys (float32; sinks: one float32 logit per head; softcap > 0: scores "
     "become softcap * tanh(score / softcap)), written to out, on "
     "num_threads OpenMP threads. Raises ValueError on "
     "inconsistent sizes or block ids."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_cpu_attention", .m_doc = "Decode attention over the paged KV cache on the CPU.",
    .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu_attention(void) { return PyModule_Create(&module); }
