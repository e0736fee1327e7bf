/* mhaspec's compiled chunk loops: the golden bounds' attention chunk (attention_rows.h) for x86-64-v4
 * (AVX-512), a translation unit compiled for it as a whole.  gcc lowers each `omp simd` loop before it
 * makes target_clones' clones, so the clones' reductions keep the baseline's vector length: the x86-64-v4
 * clone of this loop took ~1.4 times numba's time, this build ~1.0 (results/2026-12-07-s5-attn.md).
 * mh_attention_chunk (attention.c) calls it only where the processor has AVX-512. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4")
#include "common.h"

#define MH_ATTENTION_NAME mh_attention_chunk_v4
#define MH_ATTENTION_LSE_NAME mh_attention_lse_chunk_v4
#define MH_ATTENTION_TARGET
#include "attention_rows.h"
#endif
