/* mhaspec's compiled chunk loops (the extension mhaspec.conformance.engine._loops): what every loop shares.
 *
 * A C port of engine/kernels.py (numba), term by term: the same formulas, the same exponential
 * (mh_exp: Cody-Waite reduction and a Taylor polynomial, within two ulps of the correctly rounded
 * value), the same order of the roundings that matter.  The loops' sums are vectorised by
 * `#pragma omp simd reduction` (-fopenmp-simd: no threads, no OpenMP runtime), never by
 * -ffast-math or -fassociative-math, which would also rewrite mh_exp's range reduction.
 *
 * Arrays come from engine/native.py as a pointer and one stride per axis, in elements
 * (ARR3/ARR2); a loop that sweeps rows takes the row's pointer, and the loader checks that those
 * arrays have a unit stride on their last axis.  The model's constants are defined here and checked
 * against the Python model's when the library is loaded (mh_constants, native.py).
 */
#ifndef MHASPEC_LOOPS_COMMON_H
#define MHASPEC_LOOPS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define MH_LAMBDA 8.0                              /* model.vocabulary.LAMBDA */
#define MH_U64 (1.0 / 9007199254740992.0)          /* model.vocabulary.U64 = 2^-53 */
#define MH_U64_2 (MH_U64 * MH_U64)
#define MH_SECOND_ORDER_CLOSED_FORM (1.0 / 1024.0) /* model.softmax.SECOND_ORDER_CLOSED_FORM = 2^-10 */
/* exp(a)·exp(b)·MH_EXP_PRODUCT >= exp(a + b): two exponentials within two ulps each, their product rounded */
#define MH_EXP_PRODUCT (1.0 + 1.0 / 562949953421312.0) /* 1 + 2^-49 */

/* A 3-D array argument: pointer, then its three lengths, then the strides of its three axes in elements
 * (native.py passes every array so: a loop takes its extents from its arrays, as the numba loop from
 * their .shape). */
#define ARR3(T, a) T *a, int64_t a##_n0, int64_t a##_n1, int64_t a##_n2, int64_t a##_s0, int64_t a##_s1, int64_t a##_s2
/* A 2-D array argument (work rows, one value per row): pointer, its two lengths, its two strides in elements. */
#define ARR2(T, a) T *a, int64_t a##_n0, int64_t a##_n1, int64_t a##_s0, int64_t a##_s1
/* A 3-D (2-D) argument passed on to a function that takes it as ARR3 (ARR2). */
#define ARG3(a) a, a##_n0, a##_n1, a##_n2, a##_s0, a##_s1, a##_s2
#define ARG2(a) a, a##_n0, a##_n1, a##_s0, a##_s1
/* Element (h, i, j) of a 3-D argument; ROW3: the pointer to its row (h, i) (unit last stride). */
#define AT3(a, h, i, j) a[(h) * a##_s0 + (i) * a##_s1 + (j) * a##_s2]
#define AT2(a, h, i) a[(h) * a##_s0 + (i) * a##_s1]
#define ROW3(a, h, i) (a + (h) * a##_s0 + (i) * a##_s1)
#define ROW2(a, r) (a + (r) * a##_s0)

#define MH_EXPORT __attribute__((visibility("default")))

/* Each loop's file (attention.c, local.c, stage.c) is compiled once per x86-64 level, each build a
 * translation unit compiled for that level as a whole (attention_v3.c, local_v4.c, …: `#pragma GCC target`,
 * then MH_LEVEL, then the file itself),
 * because gcc lowers each `omp simd` loop before target_clones clones it, so a clone keeps the baseline's
 * vector length (results/2026-12-07-s5-attn.md).  Each exported loop is mh_<name>_<level>; native.py binds
 * the processor's level once per process (mh_cpu_level, module.c; MHASPEC_LOOPS_LEVEL lowers it). */
#ifndef MH_LEVEL
#define MH_LEVEL base
#endif
#define MH_JOIN_(a, b) a##_##b
#define MH_JOIN(a, b) MH_JOIN_(a, b)
#define MH_LEVELED(name) MH_JOIN(name, MH_LEVEL)
#define MH_INLINE static inline __attribute__((always_inline))

/* The float64 whose bit pattern is `bits`, and the reverse (bit casts, vectorisable). */
MH_INLINE double mh_as_double(int64_t bits) { double x; memcpy(&x, &bits, 8); return x; }
MH_INLINE int64_t mh_bits(double x) { int64_t b; memcpy(&b, &x, 8); return b; }
/* numba's (Python's) min(a, b) and max(a, b): b where it compares below (above) a, else a, so a NaN in a
 * is returned and a NaN in b is not, as in the numba loops (C's a < b ? a : b would do the reverse). */
MH_INLINE double mh_min(double a, double b) { return b < a ? b : a; }
MH_INLINE double mh_max(double a, double b) { return b > a ? b : a; }

#define MH_LOG2E 1.4426950408889634
/* ln 2 in two parts (fdlibm's): MH_LN2_HI has 21 trailing zero bits, so n·MH_LN2_HI is exact for |n| < 2^21 */
#define MH_LN2_HI 6.93147180369123816490e-01
#define MH_LN2_LO 1.90821492927058770002e-10

/* (e^r − 1 − r)/r² by its Taylor series to r^11, Horner's order (kernels._exp's polynomial but for its two
 * last steps): the part of mh_exp's polynomial that mh_expm1 (below) shares (|r| <= ln2/2: the
 * series' remainder is below 2^-57 of e^r and of (e^r − 1)/r). */
MH_INLINE double mh_exp_tail(double r) {
    double p = 1.0 / 6227020800.0;
    p = 1.0 / 479001600.0 + r * p;
    p = 1.0 / 39916800.0 + r * p;
    p = 1.0 / 3628800.0 + r * p;
    p = 1.0 / 362880.0 + r * p;
    p = 1.0 / 40320.0 + r * p;
    p = 1.0 / 5040.0 + r * p;
    p = 1.0 / 720.0 + r * p;
    p = 1.0 / 120.0 + r * p;
    p = 1.0 / 24.0 + r * p;
    p = 1.0 / 6.0 + r * p;
    return 0.5 + r * p;
}

/* 2^k for an integer k, |k| <= 1022, held in a double, with no conversion to an integer: k + 1023 lands
 * in the low bits of k + (2^52 + 1023) (exact: an integer below 2^53), and a left shift moves them into
 * the exponent (the 0x433 exponent bits above fall out).  mh_exp's 2^k1·2^(k−k1) as it was formed by
 * (int64_t)n and k >> 1, bit for bit, but vectorisable in AVX2, which has neither a double↔int64
 * conversion nor a 64-bit arithmetic shift (AVX-512 has both); floor(k/2) is k >> 1. */
MH_INLINE double mh_scale(double k) {
    uint64_t b = (uint64_t)mh_bits(k + (0x1p52 + 1023.0));
    return mh_as_double((int64_t)(b << 52));
}

/* exp(x), vectorisable (kernels._exp, term by term): within one ulp of libm's and two of the correctly
 * rounded value, subnormal results included; NaN for NaN, inf above 709.79, 0 below -745.2. */
MH_INLINE double mh_exp(double x) {
    x = x != x ? x : mh_min(mh_max(x, -746.0), 710.0);
    double n = floor(x * MH_LOG2E + 0.5);
    double r = (x - n * MH_LN2_HI) - n * MH_LN2_LO;
    double p = mh_exp_tail(r);
    p = 1.0 + r * p;
    p = 1.0 + r * p;
    double k = x != x ? 0.0 : n;
    double k1 = floor(k * 0.5);
    return p * mh_scale(k1) * mh_scale(k - k1);
}

/* max(0, a_0 … a_{S-1}) of non-negative terms as an integer reduction (kernels._largest). */
MH_INLINE double mh_largest(const double *a, int64_t S) {
    int64_t top = 0;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < S; j++) {
        int64_t b = mh_bits(a[j]);
        top = b > top ? b : top;
    }
    return mh_as_double(top);
}

/* (Σ_{k≠j} a_k where a_j is the row's largest term, that term) (kernels._others_sum). */
MH_INLINE double mh_others_sum(const double *a, int64_t S, double *top_out) {
    double top = mh_largest(a, S), rest = 0.0, ties = 0.0;
#pragma omp simd reduction(+ : rest, ties)
    for (int64_t j = 0; j < S; j++) {
        double x = a[j];
        rest += x < top ? x : 0.0;
        ties += x >= top ? 1.0 : 0.0;
    }
    *top_out = top;
    return rest + mh_max(ties - 1.0, 0.0) * top;
}

/* model.softmax.second_order of one row into `out` (kernels._second_order_row): the closed form, or the
 * exact pairwise bound less its first-order part.  `ell` holds ℓ (>= 0); eel, ups, dns, spare: work rows. */
MH_INLINE void mh_second_order_row(const double *p, const double *tau, const double *ell, double *out,
                                   double *eel, double *ups, double *dns, double *spare, int64_t S) {
    double rho = 0.0;
#pragma omp simd reduction(+ : rho)
    for (int64_t j = 0; j < S; j++) {
        double el = ell[j];
        double ex = mh_exp(mh_min(el, 350.0));
        eel[j] = ex;
        rho += p[j] * el * el * ex;
        spare[j] = p[j] > 0 ? el : 0.0;
    }
    rho *= 0.5;
    if (mh_largest(spare, S) + rho <= MH_SECOND_ORDER_CLOSED_FORM) {
        double erho = mh_exp(mh_min(rho, 350.0)) * MH_EXP_PRODUCT;
#pragma omp simd
        for (int64_t j = 0; j < S; j++) {
            double x = ell[j] + rho;
            out[j] = p[j] * (rho + 0.5 * x * x * (eel[j] * erho));
        }
        return;
    }
#pragma omp simd
    for (int64_t j = 0; j < S; j++) {
        double tt = mh_min(tau[j], 350.0);
        double eu = mh_exp(tt), ed = mh_exp(-tt);
        eel[j] = eu;
        spare[j] = ed;
        ups[j] = p[j] * eu;
        dns[j] = p[j] * ed;
    }
    double top_u, top_d;
    double su = mh_others_sum(ups, S, &top_u);
    double sd = mh_others_sum(dns, S, &top_d);
#pragma omp simd
    for (int64_t j = 0; j < S; j++) {
        double pj = p[j], up = ups[j], dn = dns[j];
        double ou = up >= top_u ? su : mh_max((su - up) + top_u, 0.0);
        double od = dn >= top_d ? sd : mh_max((sd - dn) + top_d, 0.0);
        double lo = pj / (pj + eel[j] * ou);
        double hi = pj / (pj + spare[j] * od);
        double e = mh_max(hi - pj, pj - lo);
        e = e <= 1.0 ? e : 1.0; /* NaN (0/0, inf/inf) -> 1 */
        e = pj > 0 ? e : 0.0;
        out[j] = mh_max(e - pj * ell[j], 0.0);
    }
}

/* The lse check's exponentials (moved here from local.c, unchanged: the local and the golden lse share
 * them). */

/* Where the lse sums' keys all have |τ| <= MH_EXPM1_SMALL, mh_expm1_small's short polynomial serves. */
#define MH_EXPM1_SMALL (1.0 / 128.0)

/* expm1(x) for |x| <= MH_EXPM1_SMALL (no numba counterpart; model.variants.lse_move's np.expm1):
 * x + x²·q(x), q the Taylor series of (e^x − 1 − x)/x² to x^5 (truncation < 2^-64 relative).  The
 * correction x²·q is at most x/250 of the result, so its roundings move the result by < 0.01 ulp and
 * the final addition rounds once: within one ulp, as libm's expm1. */
MH_INLINE double mh_expm1_small(double x) {
    double q = 1.0 / 5040.0;
    q = 1.0 / 720.0 + x * q;
    q = 1.0 / 120.0 + x * q;
    q = 1.0 / 24.0 + x * q;
    q = 1.0 / 6.0 + x * q;
    q = 0.5 + x * q;
    return x + x * (x * q);
}

/* expm1(x) for any x in [-350, 350] (no numba counterpart; np.expm1's numbers within two ulps), vectorisable:
 * x = n·ln2 + r, |r| <= ln2/2 (mh_exp's Cody-Waite reduction: r = x exactly where n = 0), expm1(r) =
 * r + r²·q(r), q = mh_exp_tail (mh_exp's series to r^13: truncation below 2^-56 of the result; the
 * correction is at most 0.18·r, so its roundings add < 0.3 ulp to the final addition's half), then
 * expm1(x) = 2^n·expm1(r) + (2^n − 1): for n != 0 |expm1(x)| > 0.29, and both terms are exact or one
 * rounding each.  The callers clamp x to ±350 (2^n within 2^±505: no overflow, no subnormal). */
MH_INLINE double mh_expm1(double x) {
    double n = floor(x * MH_LOG2E + 0.5);
    double r = (x - n * MH_LN2_HI) - n * MH_LN2_LO;
    double q = mh_exp_tail(r);
    double em = r + r * (r * q);
    /* x is finite here (the loop's finite check has found a NaN score already; its sums are then unused) */
    double two_n = mh_as_double(((int64_t)(x == x ? n : 0.0) + 1023) << 52);
    return n == 0.0 ? em : two_n * em + (two_n - 1.0);
}

/* The lse check's sums of one row (model.variants.lse_move's): out[0] = Σ p_j (e^{τ_j} − 1),
 * out[1] = Σ p_j (e^{−τ_j} − 1), τ clamped to 350 as there.  τ >= 0 (0 where masked). */
MH_INLINE void mh_lse_move_sums(const double *p, const double *tau, int64_t S, double *up_out, double *dn_out) {
    double up = 0.0, dn = 0.0;
    if (mh_largest(tau, S) <= MH_EXPM1_SMALL) { /* the usual row (float32's τ < 2^-7 for |s| < 2^14) */
#pragma omp simd reduction(+ : up, dn)
        for (int64_t j = 0; j < S; j++) {
            double t = tau[j];
            up += p[j] * mh_expm1_small(t);
            dn += p[j] * mh_expm1_small(-t);
        }
    } else {
#pragma omp simd reduction(+ : up, dn)
        for (int64_t j = 0; j < S; j++) {
            double t = mh_min(tau[j], 350.0);
            up += p[j] * mh_expm1(t);
            dn += p[j] * mh_expm1(-t);
        }
    }
    *up_out = up;
    *dn_out = dn;
}

#endif
