/* mhaspec's compiled chunk loops: the golden bounds' attention chunk (attention_rows.h), for the baseline
 * and AVX2 (gcc's clones), and mh_attention_chunk, which calls the AVX-512 build (attention_v4.c) where the
 * processor has it. */
#include "common.h"

#define MH_ATTENTION_NAME mh_attention_chunk_any
#define MH_ATTENTION_LSE_NAME mh_attention_lse_chunk_any
#define MH_ATTENTION_TARGET MH_CLONES
#include "attention_rows.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
int64_t mh_attention_chunk_v4(MH_ATTENTION_PARAMS);
int64_t mh_attention_lse_chunk_v4(MH_ATTENTION_PARAMS, ARR3(double, lse));

/* Whether the processor runs x86-64-v4 code (the AVX-512 subsets that -march=x86-64-v4 assumes). */
static int mh_has_v4(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl");
}
#endif

/* Steps 2 and 3 of the golden bounds, and the operands of step 4, for a (heads, rows, S) chunk
 * (kernels.attention_chunk: the arguments, their meaning and the formulas are its own; attention_rows.h).
 * Returns nonzero where every value written is finite (the numba loop's math.isfinite(chk)). */
MH_EXPORT int64_t mh_attention_chunk(MH_ATTENTION_PARAMS) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (mh_has_v4()) return mh_attention_chunk_v4(MH_ATTENTION_ARGS);
#endif
    return mh_attention_chunk_any(MH_ATTENTION_ARGS);
}

/* mh_attention_chunk and each row's golden lse operands into the (heads, rows, 5) `lse` (no numba
 * counterpart: attention_rows.h, compiled.golden_lse). */
MH_EXPORT int64_t mh_attention_lse_chunk(MH_ATTENTION_PARAMS, ARR3(double, lse)) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (mh_has_v4()) return mh_attention_lse_chunk_v4(MH_ATTENTION_ARGS, ARG3(lse));
#endif
    return mh_attention_lse_chunk_any(MH_ATTENTION_ARGS, ARG3(lse));
}
