/* The C kernels' shared preamble (store/_halfcast.c, probes/_halfpool.c): Python's headers, fixed-
 * width integers, and CLONES, which builds an AVX2 copy of a loop beside the baseline one, picked at
 * load time on x86-64 Linux (GCC / clang ifunc). */
#ifndef AGNOSIA_CLONES_H
#define AGNOSIA_CLONES_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 6))
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

#endif
