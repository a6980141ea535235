/* The native CPU decoder of FORMAT.md v1, built as engine.compression._native (native_decoder.py
   says why it exists and what it measured).

   decode() turns chunks first .. last-1 of one compressed tensor into bf16 bit patterns, written
   straight into the caller's output memory with the GIL released, so threads decode disjoint
   chunk ranges at once. It builds a pair table from the palette and code lengths (a 16-bit window
   of the stream gives the next two codes' exponents, already in bf16 place, and their total
   length), walks each chunk two codes a step, ORs in the sign/mantissa bytes and patches the
   escape groups.

   LANES chunks are walked side by side: one chunk's steps form a dependency chain (the next window
   needs this step's length), which alone leaves the core waiting on loads; independent chains keep
   it busy. The sign/mantissa merge runs per segment of steps while the segment's output is still
   in L1, as a loop the compiler vectorizes.

   Everything taken from the file is checked here, whatever the Python side checked before: the
   sizes of every part, the palette and code lengths, the chunk offsets (ordered, inside the stream,
   at most chunk_size / 2 words a chunk) and the escape group indices. No window reads outside the
   stream, and a chunk whose codes run past its own words is an error. A corrupt tensor raises
   ValueError (the Python side names the tensor); it never reads or writes out of bounds. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GROUP_SIZE 64
#define MIN_CHUNK 64
#define MAX_CHUNK (1 << 18)
#define MAX_PALETTE 16
#define MAX_CODE_LENGTH 8
#define TABLE_ENTRIES 65536
#define LENGTH_BITS 0x1Fu          /* a pair entry's total code length */
#define EXPONENT_BITS 0x7F80u      /* an exponent in bf16 place */
#define LANES 8                    /* chunks decoded side by side (4: 1.5 GB/s, 8: 2.3, 16 spills registers: 1.6) */
#define SEGMENT_STEPS 256          /* pair steps per lane between merges: 8 lanes x 1 KiB of output stays in L1 */

typedef struct {
    const uint16_t *stream;
    int64_t stream_words;
    const int64_t *offsets;
    const uint32_t *table;
    const uint8_t *sign_mantissa;
    const int64_t *escape_groups;
    int64_t num_escapes;
    const uint8_t *escape_exponents;
    uint16_t *out;                 /* out[i - origin] holds element i */
    int64_t out_len;
    int64_t numel, chunk_size, first, last, origin;
} job_t;

__attribute__((format(printf, 3, 4)))
static int fail(char *error, size_t size, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error, size, format, args);
    va_end(args);
    return -1;
}

/* ---- the code: canonical codes from the lengths, and the pair table (FORMAT.md, "Code") ---- */

static int check_code(const uint8_t *palette, const uint8_t *lengths, int64_t count, char *error, size_t size) {
    if (count < 1 || count > MAX_PALETTE)
        return fail(error, size, "the palette has %lld entries, the format allows 1 to %d", (long long)count, MAX_PALETTE);
    uint32_t kraft = 0;   /* in units of 2^-8 */
    for (int64_t s = 0; s < count; s++) {
        if (lengths[s] < 1 || lengths[s] > MAX_CODE_LENGTH)
            return fail(error, size, "symbol %lld has code length %d, the format allows 1 to %d", (long long)s,
                        lengths[s], MAX_CODE_LENGTH);
        kraft += 1u << (MAX_CODE_LENGTH - lengths[s]);
        for (int64_t r = 0; r < s; r++)
            if (palette[r] == palette[s])
                return fail(error, size, "the palette repeats exponent %d", palette[s]);
    }
    if (kraft > 1u << MAX_CODE_LENGTH)
        return fail(error, size, "the code lengths are not a prefix code (Kraft sum %u/256)", kraft);
    return 0;
}

/* exponent << 7 | length of the code each 8-bit window starts with; windows no code starts (an
   incomplete code's unused space) give symbol 0 and length 8, as tables.py does */
static void single_table(const uint8_t *palette, const uint8_t *lengths, int count, uint16_t single[256]) {
    for (int w = 0; w < 256; w++) single[w] = (uint16_t)((palette[0] << 7) | MAX_CODE_LENGTH);
    uint32_t code = 0;
    int previous = 0, placed = 0;
    for (int length = 1; length <= MAX_CODE_LENGTH; length++) {
        for (int s = 0; s < count; s++) {   /* canonical order: by length, then symbol index */
            if (lengths[s] != length) continue;
            if (placed++) code = (code + 1) << (length - previous);
            else code <<= length;   /* the first code is all zeros */
            previous = length;
            uint32_t first = code << (MAX_CODE_LENGTH - length), span = 1u << (MAX_CODE_LENGTH - length);
            for (uint32_t w = first; w < first + span; w++) single[w] = (uint16_t)((palette[s] << 7) | length);
        }
    }
}

/* entry[w] = e1 << 7 | (e2 << 7) << 16 | (n1 + n2) for the two codes the 16-bit window w starts with */
static void pair_table(const uint16_t single[256], uint32_t *table) {
    for (uint32_t first = 0; first < 256; first++) {
        uint32_t head = single[first], n1 = head & 0xF;
        /* the second code's 8-bit window: first's remaining bits, then the high n1 bits of the low byte */
        for (uint32_t high = 0; high < (1u << n1); high++) {
            uint32_t tail = single[((first << n1) & 0xFF) | high];
            uint32_t entry = (head & EXPONENT_BITS) | ((tail & EXPONENT_BITS) << 16) | (n1 + (tail & 0xF));
            uint32_t *run = table + (first << 8) + (high << (8 - n1));
            for (uint32_t i = 0; i < 1u << (8 - n1); i++) run[i] = entry;
        }
    }
}

/* ---- the stream ---- */

static void put32(uint16_t *at, uint32_t value) { memcpy(at, &value, 4); }

/* 16 bits from bit position `bit` of words whose bit 0 is bit 15 of words[0] */
static uint32_t read_window(const uint16_t *words, uint64_t bit) {
    uint64_t i = bit >> 4;
    uint32_t pair = ((uint32_t)words[i] << 16) | words[i + 1];
    return (pair << (bit & 15)) >> 16;
}

/* the same, with words at or past num_words read as zero */
static uint32_t read_window_checked(const uint16_t *words, int64_t num_words, uint64_t bit) {
    uint64_t i = bit >> 4;
    uint32_t high = i < (uint64_t)num_words ? words[i] : 0;
    uint32_t low = i + 1 < (uint64_t)num_words ? words[i + 1] : 0;
    return ((((high << 16) | low) << (bit & 15)) >> 16) & 0xFFFF;
}

/* out = exponent bits of out | the bytes' sign and mantissa: bf16 = s7 << 15 | e << 7 | s0..6 */
static void merge(uint16_t *out, const uint8_t *sign_mantissa, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        uint16_t s = sign_mantissa[j];
        out[j] = (uint16_t)((out[j] & EXPONENT_BITS) | ((s & 0x80) << 8) | (s & 0x7F));
    }
}

/* LANES whole chunks from chunk k, none of whose windows can reach the stream's end */
static void decode_lanes(const job_t *job, int64_t k, uint64_t bits[LANES]) {
    const int64_t cs = job->chunk_size, steps = cs / 2;
    const uint16_t *words[LANES];
    uint16_t *out[LANES];
    for (int l = 0; l < LANES; l++) {
        words[l] = job->stream + job->offsets[k + l];
        out[l] = job->out + ((k + l) * cs - job->origin);
        bits[l] = 0;
    }
    for (int64_t begin = 0; begin < steps; begin += SEGMENT_STEPS) {
        int64_t end = begin + SEGMENT_STEPS < steps ? begin + SEGMENT_STEPS : steps;
        for (int64_t step = begin; step < end; step++) {
#pragma GCC unroll 8
            for (int l = 0; l < LANES; l++) {
                uint32_t entry = job->table[read_window(words[l], bits[l])];
                put32(out[l] + 2 * step, entry);
                bits[l] += entry & LENGTH_BITS;
            }
        }
        for (int l = 0; l < LANES; l++)
            merge(out[l] + 2 * begin, job->sign_mantissa + (k + l) * cs + 2 * begin, 2 * (end - begin));
    }
}

/* chunk k, whole or short, every read checked: the chunks near the stream's end */
static uint64_t decode_one(const job_t *job, int64_t k) {
    const int64_t cs = job->chunk_size, start = k * cs;
    const int64_t count = job->numel - start < cs ? job->numel - start : cs;
    const uint16_t *words = job->stream + job->offsets[k];
    const int64_t readable = job->stream_words - job->offsets[k];
    uint16_t *out = job->out + (start - job->origin);
    uint64_t bit = 0;
    int64_t j = 0;
    for (; j + 1 < count; j += 2) {
        uint32_t entry = job->table[read_window_checked(words, readable, bit)];
        put32(out + j, entry);
        bit += entry & LENGTH_BITS;
    }
    if (j < count) {   /* an odd last element: the pair's first code (the entry's length is the pair's) */
        out[j] = (uint16_t)job->table[read_window_checked(words, readable, bit)];
        bit += 1;   /* that code took one bit at least: all the overrun check needs */
    }
    merge(out, job->sign_mantissa + start, count);
    return bit;
}

static int check_chunk_end(const job_t *job, int64_t k, uint64_t bit, char *error, size_t size) {
    int64_t words = job->offsets[k + 1] - job->offsets[k];
    if (bit > (uint64_t)words * 16)
        return fail(error, size, "the codes of chunk %lld run past its %lld stream words", (long long)k, (long long)words);
    return 0;
}

/* ---- escape groups (FORMAT.md, "Groups and escapes") ---- */

static int64_t first_escape_from(const job_t *job, int64_t group) {
    int64_t lo = 0, hi = job->num_escapes;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (job->escape_groups[mid] < group) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static void write_escapes(const job_t *job, int64_t begin, int64_t end) {
    const int64_t group_end = (end + GROUP_SIZE - 1) / GROUP_SIZE;
    for (int64_t r = first_escape_from(job, begin / GROUP_SIZE); r < job->num_escapes; r++) {
        int64_t g = job->escape_groups[r];   /* checked by check_job: ascending, inside the tensor */
        if (g >= group_end) break;
        int64_t stop = (g + 1) * GROUP_SIZE < job->numel ? (g + 1) * GROUP_SIZE : job->numel;
        const uint8_t *exponents = job->escape_exponents + r * GROUP_SIZE;
        for (int64_t i = g * GROUP_SIZE; i < stop; i++) {
            uint16_t *at = job->out + (i - job->origin);
            *at = (uint16_t)((*at & ~EXPONENT_BITS) | (exponents[i - g * GROUP_SIZE] << 7));
        }
    }
}

/* ---- one call ---- */

static int check_job(const job_t *job, int64_t sign_len, int64_t offsets_len, int64_t escape_bytes,
                     char *error, size_t size) {
    const int64_t cs = job->chunk_size;
    if (cs < MIN_CHUNK || cs > MAX_CHUNK || (cs & (cs - 1)))
        return fail(error, size, "chunk_size %lld is not a power of two from %d to %d", (long long)cs, MIN_CHUNK, MAX_CHUNK);
    if (job->numel < 0 || sign_len != job->numel)
        return fail(error, size, "sign_mantissa holds %lld bytes for %lld elements", (long long)sign_len,
                    (long long)job->numel);
    const int64_t num_chunks = (job->numel + cs - 1) / cs;
    if (offsets_len != num_chunks + 1)
        return fail(error, size, "chunk_offsets holds %lld entries for %lld chunks (needs chunks + 1)",
                    (long long)offsets_len, (long long)num_chunks);
    if (job->first < 0 || job->first > job->last || job->last > num_chunks)
        return fail(error, size, "chunks %lld..%lld are outside the tensor's %lld chunks", (long long)job->first,
                    (long long)job->last, (long long)num_chunks);
    if (escape_bytes != job->num_escapes * GROUP_SIZE)
        return fail(error, size, "escape_exponents holds %lld bytes for %lld escape groups", (long long)escape_bytes,
                    (long long)job->num_escapes);
    const int64_t begin = job->first * cs, end = job->last * cs < job->numel ? job->last * cs : job->numel;
    if (begin < end && (begin < job->origin || end - job->origin > job->out_len))
        return fail(error, size, "the output holds %lld elements from element %lld; elements %lld..%lld do not fit",
                    (long long)job->out_len, (long long)job->origin, (long long)begin, (long long)end);
    /* escapes are found by binary search: the list must be ascending group indices (a few per 1000 groups) */
    const int64_t num_groups = (job->numel + GROUP_SIZE - 1) / GROUP_SIZE;
    for (int64_t r = 0; r < job->num_escapes; r++) {
        int64_t g = job->escape_groups[r];
        if (g < 0 || g >= num_groups || (r && g <= job->escape_groups[r - 1]))
            return fail(error, size, "escape group %lld (entry %lld) is out of order or outside the tensor's %lld groups",
                        (long long)g, (long long)r, (long long)num_groups);
    }
    for (int64_t k = job->first; k < job->last; k++) {
        int64_t a = job->offsets[k], b = job->offsets[k + 1];
        if (a < 0 || b < a || b > job->stream_words || b - a > cs / 2)
            return fail(error, size, "chunk_offsets of chunk %lld (%lld..%lld) are out of order, outside the %lld-word "
                        "stream, or longer than 8 bits a symbol allows", (long long)k, (long long)a, (long long)b,
                        (long long)job->stream_words);
    }
    return 0;
}

static int run_job(const job_t *job, char *error, size_t size) {
    const int64_t cs = job->chunk_size;
    int64_t whole_end = job->last;   /* the lanes take whole chunks; the tensor's last chunk may be short */
    if (whole_end > job->first && whole_end * cs > job->numel) whole_end--;
    uint64_t bits[LANES];
    int64_t k = job->first;
    /* A lane's window reads at most word offset + 31 * steps / 16 + 1 < offset + chunk_size (the table's
       lengths are at most 16 a step): lanes that far from the stream's end read without checks. */
    while (k + LANES <= whole_end && job->offsets[k + LANES - 1] + cs + 2 <= job->stream_words) {
        decode_lanes(job, k, bits);
        for (int l = 0; l < LANES; l++)
            if (check_chunk_end(job, k + l, bits[l], error, size)) return -1;
        k += LANES;
    }
    for (; k < job->last; k++)
        if (check_chunk_end(job, k, decode_one(job, k), error, size)) return -1;
    write_escapes(job, job->first * cs, job->last * cs < job->numel ? job->last * cs : job->numel);
    return 0;
}

static int get_buffer(PyObject *object, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(object, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len % itemsize || (view->len && (uintptr_t)view->buf % itemsize)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes at an address that is not a whole number of aligned %zd-byte "
                     "items", name, view->len, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

enum { STREAM, OFFSETS, PALETTE, LENGTHS, SIGN_MANTISSA, ESCAPE_GROUPS, ESCAPE_EXPONENTS, OUT, NUM_BUFFERS };

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    static const char *names[NUM_BUFFERS] = {"exponent_stream", "chunk_offsets", "palette", "code_lengths",
                                             "sign_mantissa", "escape_groups", "escape_exponents", "output"};
    static const Py_ssize_t itemsizes[NUM_BUFFERS] = {2, 8, 1, 1, 1, 8, 1, 2};
    PyObject *objects[NUM_BUFFERS];
    long long numel, chunk_size, first, last, origin;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLLLLL", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4],
                          &objects[5], &objects[6], &objects[7], &numel, &chunk_size, &first, &last, &origin))
        return NULL;
    Py_buffer views[NUM_BUFFERS];
    int got = 0;
    for (; got < NUM_BUFFERS; got++)
        if (get_buffer(objects[got], &views[got], got == OUT, itemsizes[got], names[got]) < 0) break;
    PyObject *result = NULL;
    uint32_t *table = NULL;
    if (got == NUM_BUFFERS && !(table = malloc(TABLE_ENTRIES * sizeof *table))) PyErr_NoMemory();
    if (table) {
        job_t job = {
            .stream = views[STREAM].buf, .stream_words = views[STREAM].len / 2, .offsets = views[OFFSETS].buf,
            .table = table, .sign_mantissa = views[SIGN_MANTISSA].buf, .escape_groups = views[ESCAPE_GROUPS].buf,
            .num_escapes = views[ESCAPE_GROUPS].len / 8, .escape_exponents = views[ESCAPE_EXPONENTS].buf,
            .out = views[OUT].buf, .out_len = views[OUT].len / 2, .numel = numel, .chunk_size = chunk_size,
            .first = first, .last = last, .origin = origin,
        };
        char error[320] = "";
        int status = views[LENGTHS].len != views[PALETTE].len
            ? fail(error, sizeof error, "the palette has %lld entries and code_lengths %lld",
                   (long long)views[PALETTE].len, (long long)views[LENGTHS].len)
            : check_code(views[PALETTE].buf, views[LENGTHS].buf, views[PALETTE].len, error, sizeof error);
        if (status == 0)
            status = check_job(&job, views[SIGN_MANTISSA].len, views[OFFSETS].len / 8, views[ESCAPE_EXPONENTS].len,
                               error, sizeof error);
        if (status == 0) {
            Py_BEGIN_ALLOW_THREADS
            uint16_t single[256];
            single_table(views[PALETTE].buf, views[LENGTHS].buf, (int)views[PALETTE].len, single);
            pair_table(single, table);
            status = run_job(&job, error, sizeof error);
            Py_END_ALLOW_THREADS
        }
        if (status == 0) {
            result = Py_None;
            Py_INCREF(result);
        } else {
            PyErr_SetString(PyExc_ValueError, error);
        }
        free(table);
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(exponent_stream, chunk_offsets, palette, code_lengths, sign_mantissa, escape_groups, escape_exponents, "
     "out, numel, chunk_size, first, last, origin): decode chunks first..last-1 of a compressed tensor (FORMAT.md v1) "
     "into out, a writable int16 buffer whose element 0 is element `origin` of the tensor. Raises ValueError when "
     "the tensor is corrupt."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = "The native CPU decoder of FORMAT.md v1.", .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
