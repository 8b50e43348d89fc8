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
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define SKIP 255
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "_delta.c reads elements as little-endian words"
#endif

/* The helpers below take the element size as a parameter and are always inlined: the
 * entry points call them with the constants 1, 2, 4 and 8 (every dtype's element size), so
 * the compiler builds one loop per size with its loads, copies and masks fixed (a memcpy of
 * a run-time size, a byte loop per element, cost ~10 ns per changed element), and once
 * more with the size as a variable for anything else. */
#define INLINE static inline __attribute__((always_inline))

INLINE uint64_t load_le(const unsigned char *p, Py_ssize_t n) {
    uint64_t x = 0;
    if (n == 8 || n == 4 || n == 2 || n == 1) { /* a little-endian host: one load */
        memcpy(&x, p, (size_t)n);
        return x;
    }
    for (Py_ssize_t i = 0; i < n; i++) x |= (uint64_t)p[i] << (8 * i);
    return x;
}

INLINE uint64_t move_of(const unsigned char *old, const unsigned char *new, Py_ssize_t itemsize,
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

/* The state of one box's encoding: the entries written, the values kept aside, the move. */
typedef struct {
    unsigned char *out, *vals;
    Py_ssize_t cap, vcap, e, nv, k, itemsize;
    uint64_t pointer, move;
} coder;

/* Element ``pos`` of the box changed (``c`` its new bytes, ``o`` its old): its entries and
 * value. Returns 0 when the segment would not fit. */
INLINE int changed(coder *s, uint64_t pos, const unsigned char *c, const unsigned char *o, const Py_ssize_t u) {
    uint64_t gap = pos - s->pointer;
    Py_ssize_t need = (Py_ssize_t)(gap / SKIP) + 1;
    if (s->e + need > s->cap || s->nv + u > s->vcap) return 0;
    for (; gap >= SKIP; gap -= SKIP) s->out[s->e++] = SKIP;
    s->out[s->e++] = (unsigned char)gap;
    memcpy(s->vals + s->nv, c, (size_t)u);
    s->nv += u;
    s->move += move_of(o, c, u, pos);
    s->pointer = pos + 1;
    s->k++;
    return 1;
}

/* One run: 16 bytes at a time (SSE2: a byte compare and a mask; the set bits are the bytes
 * that differ, whole elements since 16 is a multiple of the element size), the rest
 * element by element. Returns 0 when the segment would not fit. */
INLINE int encode_run(coder *s, const unsigned char *c, const unsigned char *o, Py_ssize_t run, uint64_t first,
                      const Py_ssize_t u) {
    const Py_ssize_t nbytes = run * u;
    Py_ssize_t off = 0;
#if defined(__SSE2__)
    if (u <= 16 && 16 % u == 0) {
        for (; off + 16 <= nbytes; off += 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)(c + off)), y = _mm_loadu_si128((const __m128i *)(o + off));
            unsigned diff = ~(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) & 0xFFFFu;
            while (diff) {
                Py_ssize_t at = (off + __builtin_ctz(diff)) / u * u; /* the element's first byte */
                if (!changed(s, first + (uint64_t)(at / u), c + at, o + at, u)) return 0;
                diff &= ~(((1u << u) - 1u) << (at - off));
            }
        }
    }
#endif
    for (Py_ssize_t at = off; at < nbytes; at += u)
        if (memcmp(c + at, o + at, (size_t)u) != 0 && !changed(s, first + (uint64_t)(at / u), c + at, o + at, u))
            return 0;
    return 1;
}

/* Every run of a box; 0 when the segment would not fit. */
INLINE int encode_runs(coder *s, const unsigned char *cur, const unsigned char *base, const int64_t *starts,
                       Py_ssize_t nruns, Py_ssize_t run, const Py_ssize_t u) {
    for (Py_ssize_t r = 0; r < nruns; r++)
        if (!encode_run(s, cur + starts[r] * u, base + starts[r] * u, run, (uint64_t)r * (uint64_t)run, u)) return 0;
    return 1;
}

static int encode_any(coder *s, const unsigned char *cur, const unsigned char *base, const int64_t *starts,
                      Py_ssize_t nruns, Py_ssize_t run) {
    switch (s->itemsize) {
    case 1: return encode_runs(s, cur, base, starts, nruns, run, 1);
    case 2: return encode_runs(s, cur, base, starts, nruns, run, 2);
    case 4: return encode_runs(s, cur, base, starts, nruns, run, 4);
    case 8: return encode_runs(s, cur, base, starts, nruns, run, 8);
    default: return encode_runs(s, cur, base, starts, nruns, run, s->itemsize);
    }
}

/* encode(current, base, starts, run, itemsize, out, scratch) -> (entries, changed, move) */
static PyObject *delta_encode(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    Py_ssize_t run, itemsize;
    if (!PyArg_ParseTuple(args, "OOOnnOO:encode", &objs[0], &objs[1], &objs[2], &run, &itemsize, &objs[3], &objs[4]))
        return NULL;
    if (itemsize < 1 || run < 0) {
        PyErr_SetString(PyExc_ValueError, "encode needs itemsize >= 1 and run >= 0");
        return NULL;
    }
    Py_buffer v[5];
    const int writable[5] = {0, 0, 0, 1, 1};
    if (get_buffers(objs, v, 5, writable) < 0) return NULL;
    const unsigned char *cur = v[0].buf, *base = v[1].buf;
    const int64_t *starts = v[2].buf;
    Py_ssize_t nruns = v[2].len / 8;
    coder s = {v[3].buf, v[4].buf, v[3].len, v[4].len, 0, 0, 0, itemsize, 0, 0};
    int full = 0;
    Py_BEGIN_ALLOW_THREADS
    full = !encode_any(&s, cur, base, starts, nruns, run);
    if (!full && s.e + s.nv <= s.cap) memcpy(s.out + s.e, s.vals, (size_t)s.nv); else full = 1;
    Py_END_ALLOW_THREADS
    release(v, 5);
    if (full) return Py_BuildValue("nnK", (Py_ssize_t)-1, (Py_ssize_t)0, (unsigned long long)0);
    return Py_BuildValue("nnK", s.e, s.k, (unsigned long long)s.move);
}

/* A segment's walk over its box: ``seg`` holds ``entries`` entries then the values (``nseg``
 * bytes in all). Positions only grow, so the run an element lies in is tracked as it goes
 * (no division per element). Returns 0 for a segment that does not fit its box. */
typedef struct {
    unsigned char *buf, *old;
    const int64_t *starts;
    Py_ssize_t nruns, run, nbuf, nold;
    uint64_t move;
} applier;

INLINE int apply_segment(applier *a, const unsigned char *seg, Py_ssize_t nseg, Py_ssize_t entries, int write,
                         const Py_ssize_t u) {
    const unsigned char *vals = seg + entries, *end = seg + nseg;
    uint64_t pointer = 0, run_first = 0, run = (uint64_t)a->run;
    Py_ssize_t r = 0;
    for (Py_ssize_t i = 0; i < entries; i++) {
        unsigned char en = seg[i];
        if (en == SKIP) { pointer += SKIP; continue; }
        uint64_t pos = pointer + en;
        while (r < a->nruns && pos >= run_first + run) { r++; run_first += run; }
        if (r >= a->nruns || vals + u > end) return 0;
        int64_t at = a->starts[r] + (int64_t)(pos - run_first);
        if (at < 0 || (at + 1) * u > a->nbuf) return 0;
        unsigned char *dst = a->buf + at * u;
        a->move += move_of(dst, vals, u, pos);
        if (a->old) {
            if (a->nold < u) return 0;
            memcpy(a->old, dst, (size_t)u);
            a->old += u;
            a->nold -= u;
        }
        if (write) memcpy(dst, vals, (size_t)u);
        vals += u;
        pointer = pos + 1;
    }
    return 1;
}

static int apply_any(applier *a, const unsigned char *seg, Py_ssize_t nseg, Py_ssize_t entries, int write,
                     Py_ssize_t itemsize) {
    switch (itemsize) {
    case 1: return apply_segment(a, seg, nseg, entries, write, 1);
    case 2: return apply_segment(a, seg, nseg, entries, write, 2);
    case 4: return apply_segment(a, seg, nseg, entries, write, 4);
    case 8: return apply_segment(a, seg, nseg, entries, write, 8);
    default: return apply_segment(a, seg, nseg, entries, write, itemsize);
    }
}

/* apply(buffer, starts, run, itemsize, segment, entries, write, old) -> move; with ``old``
 * (a writable buffer, or None) the old elements are kept there as they are overwritten, so
 * one pass checks and writes and a failed check can put them back. */
static PyObject *delta_apply(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t run, itemsize, entries;
    int write;
    if (!PyArg_ParseTuple(args, "OOnnOnpO:apply", &objs[0], &objs[1], &run, &itemsize, &objs[2], &entries, &write,
                          &objs[3]))
        return NULL;
    if (itemsize < 1 || run < 1) {
        PyErr_SetString(PyExc_ValueError, "apply needs itemsize >= 1 and run >= 1");
        return NULL;
    }
    const int keep = objs[3] != Py_None;
    Py_buffer v[4];
    const int writable[4] = {1, 0, 0, 1};
    if (get_buffers(objs, v, keep ? 4 : 3, writable) < 0) return NULL;
    applier a = {v[0].buf, keep ? v[3].buf : NULL, v[1].buf, v[1].len / 8, run, v[0].len, keep ? v[3].len : 0, 0};
    int ok = entries >= 0 && entries <= v[2].len;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        ok = apply_any(&a, v[2].buf, v[2].len, entries, write, itemsize);
        Py_END_ALLOW_THREADS
    }
    release(v, keep ? 4 : 3);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "a delta segment that does not fit its box");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(a.move);
}

static PyMethodDef methods[] = {
    {"encode", delta_encode, METH_VARARGS, "A box's delta segment: (entries, changed, digest move)."},
    {"apply", delta_apply, METH_VARARGS, "A box's delta segment over its base: the digest move (written with write)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_delta",
                                    "The CPU form of a box's delta (see delta_boxes).", -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
