/* The CPU form of elastic_refit.transport.buffers.digest, in one pass at memory speed.
 *
 * Same definition as the numpy and torch forms (digest_reference is the spec): the bytes,
 * zero-padded to whole 8-byte words, are read as little-endian words x_0 .. x_{m-1};
 * sum(data) returns sum_p (2p + 1) x_p mod 2^64 (Python xors in the byte count).
 *
 * Why C: numpy needs a row-sum and a column-sum pass over each cached chunk (6-7 GB/s on
 * one core, against ~13 GB/s for a bare reduction), and the source checks read every
 * source byte twice per refit. Here every word costs two adds: L lanes each take every
 * L-th word y_0 .. y_{r-1} and keep its running sum A and the sum T of those running
 * sums; then sum_i i y_i = r A - T (the prefix-sum identity), so
 *     sum_p p x_p = sum_l (L (r A_l - T_l) + l A_l).
 * The lanes are independent, so gcc -O3 keeps them in vector registers. All arithmetic
 * is mod 2^64 (unsigned wrap-around), as the definition says.
 *
 * sum_runs digests a strided view (a replica region inside a fused buffer) in place: its
 * contiguous runs feed one stream, so the region costs one read instead of a copy and
 * a read of the copy.
 *
 * Built as an optional extension (setup.py): without a compiler the numpy form runs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define LANES 8 /* 64 bytes per step: two SSE2 registers per accumulator row, no spills */

static inline uint64_t load_word(const unsigned char *p) {
    uint64_t x;
    memcpy(&x, p, 8); /* any alignment: the data may start at any byte */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    return x;
}

/* Position-weighted sums of the whole words of data[0 : 8 * words]: *s0 = sum x_p and
 * *s1 = sum p x_p (p counted from this call's first word), mod 2^64. */
static void word_sums(const unsigned char *data, size_t words, uint64_t *s0_out, uint64_t *s1_out) {
    const size_t blocks = words / LANES;
    uint64_t a[LANES] = {0}, t[LANES] = {0};
    for (size_t i = 0; i < blocks; i++) {
        const unsigned char *p = data + i * 8 * LANES;
        for (int l = 0; l < LANES; l++) {
            a[l] += load_word(p + 8 * l);
            t[l] += a[l];
        }
    }
    uint64_t s0 = 0, s1 = 0;
    for (int l = 0; l < LANES; l++) {
        s0 += a[l];
        s1 += (uint64_t)LANES * ((uint64_t)blocks * a[l] - t[l]) + (uint64_t)l * a[l];
    }
    for (uint64_t p = (uint64_t)blocks * LANES; p < words; p++) { /* the words after the last block */
        uint64_t x = load_word(data + 8 * p);
        s0 += x;
        s1 += p * x;
    }
    *s0_out = s0;
    *s1_out = s1;
}

/* The digest's sums over a byte stream fed in pieces of any length (a strided view's
 * contiguous runs): bytes that do not fill a word yet wait in `pending`. */
typedef struct {
    uint64_t s0, s1, words; /* words: how many whole words were summed so far */
    unsigned char pending[8];
    size_t num_pending;
} stream_t;

static void stream_word(stream_t *st, uint64_t x) {
    st->s0 += x;
    st->s1 += st->words * x;
    st->words++;
}

static void stream_feed(stream_t *st, const unsigned char *data, size_t n) {
    if (st->num_pending) {
        size_t k = 8 - st->num_pending < n ? 8 - st->num_pending : n;
        memcpy(st->pending + st->num_pending, data, k);
        st->num_pending += k;
        data += k;
        n -= k;
        if (st->num_pending < 8)
            return;
        stream_word(st, load_word(st->pending));
        st->num_pending = 0;
    }
    size_t words = n / 8;
    if (words) {
        uint64_t s0, s1;
        word_sums(data, words, &s0, &s1);
        st->s1 += st->words * s0 + s1; /* this run's words sit after the stream's */
        st->s0 += s0;
        st->words += words;
    }
    st->num_pending = n - 8 * words;
    memcpy(st->pending, data + 8 * words, st->num_pending);
}

/* sum_p (2p + 1) x_p mod 2^64 of everything fed, the last word zero-padded */
static uint64_t stream_finish(stream_t *st) {
    if (st->num_pending) {
        memset(st->pending + st->num_pending, 0, 8 - st->num_pending);
        stream_word(st, load_word(st->pending));
        st->num_pending = 0;
    }
    return 2 * st->s1 + st->s0;
}

static PyObject *digest_sum(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    /* PyBUF_SIMPLE: one contiguous run of bytes, or an error */
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS /* ranks' other threads (watches, the executor) keep running */
    stream_t st = {0};
    stream_feed(&st, (const unsigned char *)view.buf, (size_t)view.len);
    h = stream_finish(&st);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyObject *digest_sum_runs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data_obj, *offsets_obj;
    Py_ssize_t run_bytes;
    if (!PyArg_ParseTuple(args, "OOn:sum_runs", &data_obj, &offsets_obj, &run_bytes))
        return NULL;
    if (run_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "run_bytes must be >= 0, got %zd", run_bytes);
        return NULL;
    }
    Py_buffer data, offsets;
    if (PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(offsets_obj, &offsets, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *format = offsets.format ? offsets.format : "B";
    if (offsets.itemsize != 8 || (strcmp(format, "q") && strcmp(format, "l") && strcmp(format, "<q") &&
                                  strcmp(format, "<l") && strcmp(format, "=q") && strcmp(format, "=l"))) {
        PyErr_Format(PyExc_ValueError, "offsets must be int64, got format %s", format);
        goto fail;
    }
    const int64_t *off = (const int64_t *)offsets.buf;
    const Py_ssize_t num_runs = offsets.len / 8;
    for (Py_ssize_t i = 0; i < num_runs; i++) { /* every run inside the buffer, or nothing is read */
        if (off[i] < 0 || off[i] > data.len - run_bytes) {
            PyErr_Format(PyExc_ValueError, "run %zd at byte %lld of %zd bytes is outside the %zd-byte buffer", i,
                         (long long)off[i], run_bytes, data.len);
            goto fail;
        }
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    stream_t st = {0};
    for (Py_ssize_t i = 0; i < num_runs; i++)
        stream_feed(&st, (const unsigned char *)data.buf + off[i], (size_t)run_bytes);
    h = stream_finish(&st);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
fail:
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"sum", digest_sum, METH_O,
     "sum(buffer) -> sum_p (2p + 1) x_p mod 2**64 over the buffer's little-endian 8-byte words, "
     "zero-padded (the digest before the byte count is xored in)."},
    {"sum_runs", digest_sum_runs, METH_VARARGS,
     "sum_runs(buffer, offsets, run_bytes) -> sum(...) of the bytes buffer[o : o + run_bytes] for each "
     "int64 o of offsets, in order, as one stream (a strided view's bytes, read in place)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_digest",
                                    "The buffer digest's weighted word sum in C.", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__digest(void) { return PyModule_Create(&module); }
