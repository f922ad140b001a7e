/* float32 / bfloat16 -> float16 in one pass, counting NaN/inf and overflow (store/dtypes.py calls it).
 *
 * The writer thread casts every activation the model hands over to the stored float16. numpy's
 * float32 -> float16 cast runs one value at a time (~550 MiB/s of float32 on this project's
 * machine), then the writer scans the result for NaN/inf: at a real model's rates that thread, not
 * the model, would set the pace. Here each value is read once, converted with integer and float32
 * arithmetic the compiler vectorises, and counted in the same pass.
 *
 * The bits are numpy's (tests/store/test_halfcast.py checks every float32 rounding boundary and
 * both paths):
 *  - |x| >= 2**-14: the float16 exponent is the float32 one rebased, and the 13 dropped mantissa
 *    bits round to nearest, ties to even (adding 0xFFF plus the kept mantissa's lowest bit carries
 *    exactly when the rest is above half, or half with an odd kept bit). A carry out of the
 *    mantissa moves the exponent up, into inf past 65504: numpy's overflow.
 *  - |x| < 2**-14 (float16 subnormal or zero): adding 0.5f leaves the wanted 10 bits at the bottom
 *    of a float32 whose exponent is fixed, rounded by the FPU's own round-to-nearest-even; minus
 *    0.5f's bits they are the result. Built with the interpreter's flags: never -ffast-math, which
 *    could drop the add.
 *  - NaN: 0x7C00 plus the top 10 payload bits, 0x7C01 if those are all zero (it stays a NaN);
 *    inf stays inf. Signs carry over.
 * bfloat16 is the top half of a float32, so its values take the float32 path.
 */
#include "_clones.h"

#define F32_INF 0x7F800000u
#define F16_INF 0x7C00u
#define F16_MAX 0x7BFFu          /* 65504 */
#define F32_F16_OVERFLOW 0x47800000u  /* 65536.0f: from here the rounded value is inf */
#define F32_F16_NORMAL 0x38800000u    /* 2**-14: the smallest normal float16 */
#define HALF_BITS 0x3F000000u         /* 0.5f */

typedef struct {
    Py_ssize_t nonfinite;  /* source values that are NaN or inf */
    Py_ssize_t overflow;   /* finite source values that became inf (or were clipped) */
} Counts;

/* all ones where cond is 1, else 0: the selects below stay branch-free, so the loops vectorise */
static inline uint32_t mask(uint32_t cond) { return 0u - cond; }

static inline uint32_t pick(uint32_t m, uint32_t yes, uint32_t no) { return (yes & m) | (no & ~m); }

/* float16 bits of the float32 bits u; adds 1 to *nonfinite (NaN/inf) or *overflow (finite, became inf) */
static inline uint16_t half_bits(uint32_t u, uint32_t clip, uint32_t *nonfinite, uint32_t *overflow) {
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t normal = (a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13;  /* rebias by -112 << 23, round */
    float f;
    memcpy(&f, &a, sizeof f);
    f += 0.5f;
    uint32_t fb;
    memcpy(&fb, &f, sizeof fb);
    uint32_t payload = (a & 0x007FFFFFu) >> 13;
    uint32_t h = pick(mask(a < F32_F16_NORMAL), fb - HALF_BITS, normal);
    h = pick(mask(a >= F32_F16_OVERFLOW), F16_INF, h);
    h = pick(mask(a > F32_INF), F16_INF | payload | (payload == 0), h);
    uint32_t is_nonfinite = a >= F32_INF;
    uint32_t is_over = (h == F16_INF) & (is_nonfinite ^ 1u);
    *nonfinite += is_nonfinite;
    *overflow += is_over;
    return (uint16_t)(pick(mask(is_over & clip), F16_MAX, h) | sign);
}

/* Counted in uint32 lanes (they vectorise), so at most this many values per call. */
#define BLOCK ((Py_ssize_t)1 << 30)

CLONES static void from_float32(const uint32_t *x, uint16_t *out, Py_ssize_t n, uint32_t clip, Counts *c) {
    uint32_t nonfinite = 0, overflow = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = half_bits(x[i], clip, &nonfinite, &overflow);
    c->nonfinite += nonfinite;
    c->overflow += overflow;
}

CLONES static void from_bfloat16(const uint16_t *x, uint16_t *out, Py_ssize_t n, uint32_t clip, Counts *c) {
    uint32_t nonfinite = 0, overflow = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = half_bits((uint32_t)x[i] << 16, clip, &nonfinite, &overflow);
    c->nonfinite += nonfinite;
    c->overflow += overflow;
}

PyDoc_STRVAR(to_half_doc,
"to_half(src, kind, out, clip)\n--\n\n"
"Cast float32 (kind 0: src holds the float32 values) or bfloat16 (kind 1: src holds the uint16 bits)\n"
"to float16 bits in out (uint16, one per value, C order); numpy's float16 cast to the bit. With\n"
"clip, a finite value past 65504 becomes +-65504 instead of +-inf. Returns (source NaN/inf count,\n"
"finite values that overflowed).");

static PyObject *halfcast_to_half(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    int kind, clip;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iw*p", &src, &kind, &out, &clip))
        return NULL;
    const char *problem = NULL;
    Py_ssize_t width = kind == 0 ? 4 : 2;
    Py_ssize_t n = out.len / 2;
    if (kind != 0 && kind != 1)
        problem = "kind is 0 (float32) or 1 (bfloat16 bits)";
    else if (out.len % 2 || src.len != n * width)
        problem = "out must hold one uint16 per value of src (float32: 4 bytes, bfloat16: 2 bytes)";
    else if ((uintptr_t)src.buf % width || (uintptr_t)out.buf % 2)
        problem = "src and out must be aligned to their item sizes";
    Counts c = {0, 0};
    if (problem == NULL) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i += BLOCK) {
            Py_ssize_t m = n - i < BLOCK ? n - i : BLOCK;
            if (kind == 0)
                from_float32((const uint32_t *)src.buf + i, (uint16_t *)out.buf + i, m, (uint32_t)clip, &c);
            else
                from_bfloat16((const uint16_t *)src.buf + i, (uint16_t *)out.buf + i, m, (uint32_t)clip, &c);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (problem != NULL) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    return Py_BuildValue("nn", c.nonfinite, c.overflow);
}

static PyMethodDef methods[] = {
    {"to_half", halfcast_to_half, METH_VARARGS, to_half_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "store._halfcast",
    "float32 / bfloat16 -> float16 in one pass with NaN/inf and overflow counts, numpy's bits.", -1, methods,
};

PyMODINIT_FUNC PyInit__halfcast(void) { return PyModule_Create(&module); }
