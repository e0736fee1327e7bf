/* mhaspec's compiled chunk loops: attention.c (the golden bounds' attention chunk) for x86-64-v4 (AVX-512),
 * a translation unit compiled for it as a whole (common.h, MH_LEVEL: why not target_clones).  native.py
 * binds these mh_<name>_v4 only where the processor has that level (mh_cpu_level). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("arch=x86-64-v4")
#define MH_LEVEL v4
#include "attention.c"
#endif
