/* mhaspec's compiled chunk loops: the golden bounds' attention chunk (attention_rows.h), built once per
 * x86-64 level like local.c and stage.c (common.h, MH_LEVEL: this file is the baseline's build;
 * attention_v3.c and attention_v4.c include it for AVX2 and AVX-512), each exported as mh_<name>_<level>. */
#include "common.h"

/* Steps 2 and 3 of the golden bounds, and the operands of step 4, for a (heads, rows, S) chunk
 * (kernels.attention_chunk: the arguments, their meaning and the formulas are its own; attention_rows.h),
 * and mh_attention_lse_chunk: the same and each row's golden lse operands into the (heads, rows, 5) `lse`
 * (no numba counterpart: compiled.golden_lse).  Both return nonzero where every value written is finite
 * (the numba loop's math.isfinite(chk)). */
#define MH_ATTENTION_NAME MH_LEVELED(mh_attention_chunk)
#define MH_ATTENTION_LSE_NAME MH_LEVELED(mh_attention_lse_chunk)
#define MH_ATTENTION_TARGET MH_EXPORT
#include "attention_rows.h"
