/* One-pass mean / max pooling of float16 tokens (probes/pooling.py calls it; see docs/probes.md).
 *
 * numpy pools float16 in ~10 passes per step (two NaN/inf checks, three integer passes that widen
 * the bits, the reduction): a worker of the probe farm then pools at about its read rate. Here each
 * token is read once, widened in registers and added (or maxed) into a row that stays in L1.
 *
 * The results are numpy's to the bit (tests/probes/test_pooled_read.py checks every float16 bit
 * pattern and both paths):
 *  - widening: the float32 with the token's sign at bit 31 and its 15 exponent-and-mantissa bits at
 *    bits 13-27 is v * 2**-112, exactly, subnormals included; times 2**112 it is v, exactly. This
 *    is numpy's float16 -> float32 cast for every finite value.
 *  - order: numpy reduces axis 1 of [n, T, d] token by token: acc = 0 + x[0], then acc = acc + x[t]
 *    (or acc = x[0], then maximum(acc, x[t]), which answers x[t] on a tie: the sign of a zero). So
 *    does this loop; each lane of the vectorised loop is one column, so vectorising never reorders
 *    a sum.
 *  - NaN / inf: a sample holding one is flagged in ``bad`` and its row left unspecified; the
 *    caller pools it with numpy's own cast, whose NaN payloads this code does not try to match.
 * Built with the interpreter's flags (-O3, never -ffast-math, which would reorder the sums).
 */
#include "../store/_clones.h"

static inline float half_value(uint16_t h) {
    uint32_t bits = ((uint32_t)(h & 0x8000u) << 16) | ((uint32_t)(h & 0x7FFFu) << 13);
    float scaled;
    memcpy(&scaled, &bits, sizeof scaled);
    return scaled * 0x1p112f;
}

/* 1 when h is a NaN or an inf: exponent bits all ones. */
static inline unsigned nonfinite(uint16_t h) { return (h & 0x7C00u) == 0x7C00u; }

CLONES static unsigned sum_tokens(const uint16_t *x, Py_ssize_t T, Py_ssize_t d, float *acc) {
    unsigned bad = 0;
    for (Py_ssize_t j = 0; j < d; j++) {
        acc[j] = 0.0f + half_value(x[j]);   /* numpy's sum starts at +0: a column of -0 sums to +0 */
        bad |= nonfinite(x[j]);
    }
    for (Py_ssize_t t = 1; t < T; t++) {
        const uint16_t *row = x + t * d;
        for (Py_ssize_t j = 0; j < d; j++) {
            acc[j] = acc[j] + half_value(row[j]);
            bad |= nonfinite(row[j]);
        }
    }
    return bad;
}

CLONES static unsigned max_tokens(const uint16_t *x, Py_ssize_t T, Py_ssize_t d, float *acc) {
    unsigned bad = 0;
    for (Py_ssize_t j = 0; j < d; j++) {
        acc[j] = half_value(x[j]);
        bad |= nonfinite(x[j]);
    }
    for (Py_ssize_t t = 1; t < T; t++) {
        const uint16_t *row = x + t * d;
        for (Py_ssize_t j = 0; j < d; j++) {
            float v = half_value(row[j]);
            acc[j] = acc[j] > v ? acc[j] : v;
            bad |= nonfinite(row[j]);
        }
    }
    return bad;
}

PyDoc_STRVAR(reduce_doc,
"reduce(bits, n, T, d, out, bad, how)\n--\n\n"
"Sum (how=0) or max (how=1) over axis 1 of float16 [n, T, d], given as its uint16 bits (C order),\n"
"into float32 out [n, d]; bad[i] (uint8 [n]) becomes 1 where sample i holds a NaN or an inf.");

static PyObject *halfpool_reduce(PyObject *self, PyObject *args) {
    Py_buffer src, out, bad;
    Py_ssize_t n, T, d;
    int how;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnw*w*i", &src, &n, &T, &d, &out, &bad, &how))
        return NULL;
    const char *problem = NULL;
    if (n < 0 || T < 1 || d < 1)
        problem = "expected n >= 0, T >= 1 and d >= 1";
    else if (how != 0 && how != 1)
        problem = "how is 0 (sum) or 1 (max)";
    else if (n > PY_SSIZE_T_MAX / 2 / T / d || src.len != n * T * d * 2)
        problem = "bits must hold n * T * d uint16 values";
    else if (out.len != n * d * (Py_ssize_t)sizeof(float) || bad.len != n)
        problem = "out must hold n * d float32 values and bad n uint8 values";
    else if ((uintptr_t)src.buf % 2 || (uintptr_t)out.buf % sizeof(float))
        problem = "bits and out must be aligned to their item sizes";
    if (problem == NULL) {
        const uint16_t *bits = (const uint16_t *)src.buf;
        float *acc = (float *)out.buf;
        uint8_t *flags = (uint8_t *)bad.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint16_t *x = bits + i * T * d;
            flags[i] = (uint8_t)(how == 0 ? sum_tokens(x, T, d, acc + i * d) : max_tokens(x, T, d, acc + i * d));
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    PyBuffer_Release(&bad);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"reduce", halfpool_reduce, METH_VARARGS, reduce_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "probes._halfpool",
    "One-pass mean / max pooling of float16 tokens, equal to numpy's float32 pooling to the bit.", -1, methods,
};

PyMODINIT_FUNC PyInit__halfpool(void) { return PyModule_Create(&module); }
