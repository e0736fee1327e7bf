/* mhaspec's compiled chunk loops: attention.c (the golden bounds' attention chunk) for x86-64-v3 (AVX2 and FMA),
 * a translation unit compiled for it as a whole (common.h, MH_LEVEL: why not target_clones).  native.py
 * binds these mh_<name>_v3 only where the processor has that level (mh_cpu_level). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v3")
#define MH_LEVEL v3
#include "attention.c"
#endif
