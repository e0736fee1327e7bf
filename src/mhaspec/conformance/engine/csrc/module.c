/* The extension module mhaspec.conformance.engine._loops: an empty Python module whose library holds the
 * compiled chunk loops (attention.c, local.c, stage.c and their per-level builds), which engine/native.py
 * calls through ctypes, and the few entry points below that native.py and the tests use to check the library. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"

/* The model's constants as compiled here, in this order: native.py refuses a library whose constants
 * are not the Python model's (a stale build). */
MH_EXPORT int64_t mh_constants(double *out, int64_t n) {
    const double values[] = {MH_LAMBDA, MH_U64, MH_SECOND_ORDER_CLOSED_FORM, MH_EXP_PRODUCT};
    int64_t m = (int64_t)(sizeof values / sizeof values[0]);
    for (int64_t i = 0; i < n && i < m; i++) out[i] = values[i];
    return m;
}

/* The x86-64 level whose builds of attention.c, local.c and stage.c this processor runs (common.h,
 * MH_LEVEL): 4 (x86-64-v4, AVX-512), 3 (x86-64-v3, AVX2) or 0 (the baseline; every other processor). */
MH_EXPORT int64_t mh_cpu_level(void) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
#endif
    return 0;
}

/* mh_others_sum of a[0 … S-1]: out[0] the sum, out[1] the top term. */
MH_EXPORT void mh_others_sum_row(const double *a, int64_t S, double *out) {
    out[0] = mh_others_sum(a, S, &out[1]);
}

static struct PyModuleDef loops_module = {
    PyModuleDef_HEAD_INIT, "_loops",
    "mhaspec's compiled chunk loops: a library that mhaspec.conformance.engine.native calls through ctypes.",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__loops(void) { return PyModule_Create(&loops_module); }
