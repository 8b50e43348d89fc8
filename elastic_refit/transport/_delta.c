/* The CPU form of a box's delta (elastic_refit.transport.delta_boxes), one pass over the box.
 *
 * A box of a contiguous buffer is a set of runs of ``run`` elements (``starts``: each run's
 * first element in the buffer, ascending). ``encode`` compares the box's elements in the
 * current and base buffers (``itemsize`` bytes each, bit for bit) and writes its segment
 * into ``out``: the gap entries (kernels.delta: an entry e < 255 marks the element e past
 * the pointer and moves the pointer past it; 255 skips 255 elements) then the changed
 * elements' values; it returns (entries, changed elements, digest move), or entries = -1
 * when the segment would not fit ``out`` (the box then goes in full). ``apply`` walks a
 * segment over a buffer holding the base: the digest move it makes (reading the old
 * elements), and with ``write`` the new elements written.
 *
 * The digest move: transport.buffers.digest is sum_p (2p + 1) x_p mod 2^64 over the box's
 * little-endian words; an element at byte b of the box that goes from o to n moves it by
 * (2 (b / 8) + 1) ((n - o) << 8 (b % 8)), mod 2^64 (unsigned wrap-around).
 *
 * Why C: numpy and torch spend ~100 ns per changed element across the gathers, scatters
 * and index arithmetic of a box; here it is a compare per element and a few stores per
 * changed one. Built as an optional extension (setup.py): without it numpy runs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SKIP 255

static inline uint64_t load_le(const unsigned char *p, Py_ssize_t n) {
    uint64_t x = 0;
    for (Py_ssize_t i = 0; i < n; i++) x |= (uint64_t)p[i] << (8 * i);
    return x;
}

static inline uint64_t move_of(const unsigned char *old, const unsigned char *new, Py_ssize_t itemsize,
                               uint64_t local) {
    uint64_t b = local * (uint64_t)itemsize;
    uint64_t diff = load_le(new, itemsize) - load_le(old, itemsize);
    return (2 * (b / 8) + 1) * (diff << (8 * (b % 8)));
}

static int get_buffers(PyObject **objs, Py_buffer *views, int n, const int *writable) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(objs[i], &views[i], writable[i] ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                                                               : PyBUF_C_CONTIGUOUS) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    return 0;
}

static void release(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* encode(current, base, starts, run, itemsize, out, scratch) -> (entries, changed, move) */
static PyObject *delta_encode(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_ssize_t run, itemsize;
    PyObject *scratch_obj;
    if (!PyArg_ParseTuple(args, "OOOnnOO:encode", &objs[0], &objs[1], &objs[2], &run, &itemsize, &objs[3],
                          &scratch_obj))
        return NULL;
    objs[4] = scratch_obj;
    Py_buffer v[5];
    const int writable[5] = {0, 0, 0, 1, 1};
    if (get_buffers(objs, v, 5, writable) < 0) return NULL;
    const unsigned char *cur = v[0].buf, *base = v[1].buf;
    const int64_t *starts = v[2].buf;
    Py_ssize_t nruns = v[2].len / 8, cap = v[3].len, vcap = v[4].len;
    unsigned char *out = v[3].buf, *vals = v[4].buf;
    Py_ssize_t e = 0, k = 0, nv = 0;
    uint64_t pointer = 0, move = 0;
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Whole 8-byte words are compared first (most are equal); elements only inside a word
     * that differs. */
    const Py_ssize_t per_word = (itemsize <= 8 && 8 % itemsize == 0) ? 8 / itemsize : 0;
    for (Py_ssize_t r = 0; r < nruns && !full; r++) {
        const unsigned char *c = cur + starts[r] * itemsize, *o = base + starts[r] * itemsize;
        uint64_t first = (uint64_t)r * (uint64_t)run;
        for (Py_ssize_t j = 0; j < run; j++) {
            if (per_word && j % per_word == 0 && j + per_word <= run) {
                uint64_t x, y;
                memcpy(&x, c + j * itemsize, 8);
                memcpy(&y, o + j * itemsize, 8);
                if (x == y) { j += per_word - 1; continue; }
            }
            if (memcmp(c + j * itemsize, o + j * itemsize, (size_t)itemsize) == 0) continue;
            uint64_t pos = first + (uint64_t)j, gap = pos - pointer;
            Py_ssize_t need = (Py_ssize_t)(gap / SKIP) + 1;
            if (e + need > cap || nv + itemsize > vcap) { full = 1; break; }
            for (uint64_t s = 0; s < gap / SKIP; s++) out[e++] = SKIP;
            out[e++] = (unsigned char)(gap % SKIP);
            memcpy(vals + nv, c + j * itemsize, (size_t)itemsize);
            nv += itemsize;
            move += move_of(o + j * itemsize, c + j * itemsize, itemsize, pos);
            pointer = pos + 1;
            k++;
        }
    }
    if (!full && e + nv <= cap) memcpy(out + e, vals, (size_t)nv); else full = 1;
    Py_END_ALLOW_THREADS
    release(v, 5);
    if (full) return Py_BuildValue("nnK", (Py_ssize_t)-1, (Py_ssize_t)0, (unsigned long long)0);
    return Py_BuildValue("nnK", e, k, (unsigned long long)move);
}

/* apply(buffer, starts, run, itemsize, segment, entries, write) -> move */
static PyObject *delta_apply(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_ssize_t run, itemsize, entries;
    int write;
    if (!PyArg_ParseTuple(args, "OOnnOnp:apply", &objs[0], &objs[1], &run, &itemsize, &objs[2], &entries, &write))
        return NULL;
    Py_buffer v[3];
    const int writable[3] = {1, 0, 0};
    if (get_buffers(objs, v, 3, writable) < 0) return NULL;
    unsigned char *buf = v[0].buf;
    const int64_t *starts = v[1].buf;
    const unsigned char *seg = v[2].buf;
    Py_ssize_t nruns = v[1].len / 8, nbuf = v[0].len;
    uint64_t pointer = 0, move = 0, total = (uint64_t)nruns * (uint64_t)run;
    const unsigned char *vals = seg + entries;
    Py_ssize_t bad = 0;
    if (entries > v[2].len) bad = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < entries && !bad; i++) {
        unsigned char en = seg[i];
        if (en == SKIP) { pointer += SKIP; continue; }
        uint64_t pos = pointer + en;
        if (pos >= total || (vals - seg) + itemsize > v[2].len) { bad = 1; break; }
        int64_t at = starts[pos / (uint64_t)run] + (int64_t)(pos % (uint64_t)run);
        if (at < 0 || (at + 1) * itemsize > nbuf) { bad = 1; break; }
        unsigned char *dst = buf + at * itemsize;
        move += move_of(dst, vals, itemsize, pos);
        if (write) memcpy(dst, vals, (size_t)itemsize);
        vals += itemsize;
        pointer = pos + 1;
    }
    Py_END_ALLOW_THREADS
    release(v, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "a delta segment that does not fit its box");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(move);
}

static PyMethodDef methods[] = {
    {"encode", delta_encode, METH_VARARGS, "A box's delta segment: (entries, changed, digest move)."},
    {"apply", delta_apply, METH_VARARGS, "A box's delta segment over its base: the digest move (written with write)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_delta",
                                    "The CPU form of a box's delta (see delta_boxes).", -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
