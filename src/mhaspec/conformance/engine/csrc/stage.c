/* mhaspec's compiled chunk loops: see common.h.
 *
 * This file: a stage's comparison where nothing in it is out of the ordinary (kernels.ordinary_stage,
 * conformance/compare.py's compiled sweep), and the second opinion's sums of squares
 * (conformance/second_opinion.py): sweeps of whole stages, so each reads its arrays once, with any
 * strides (a block of query rows, a broadcast visibility or reference error), a row at a time in
 * segments that stay in the L1 cache.
 *
 * Neither loop takes a liberty that changes a maximum or an index: the maxima of a set of numbers are
 * the same in any order (no NaN reaches them: a NaN anywhere makes the stage out of the ordinary).  Their
 * sums are in a fixed order, the same on every processor and in every level's build (common.h, MH_LEVEL): each row's
 * terms in MH_LANES lanes (lane k sums the terms j ≡ k mod MH_LANES in order), the lanes added
 * pairwise, then the rows in order; and every product is rounded before it is added (fp-contract off
 * below: a fused multiply-add exists in the AVX2 and AVX-512 builds only, so a contracted sum would
 * differ between processors).
 */
#include <float.h>

#include "common.h"

#pragma GCC optimize("fp-contract=off")

/* Elements of a segment of a row (a multiple of MH_LANES): its packed copies and its terms stay in L1. */
#define MH_SEGMENT 512
/* The lanes of a fixed-order sum (mh_add_lanes). */
#define MH_LANES 8

/* Whether the float64 x is a float32 value (numba: np.float64(np.float32(x)) == x).  A C cast of a finite
 * value beyond float32's range is undefined, so those are told by magnitude (no float32 holds them; numba's
 * cast gives inf, which differs from them too); ±inf is a float32 value, NaN never equals itself. */
static inline int64_t mh_fits_float32(double x) { return fabs(x) > FLT_MAX ? isinf(x) : (double)(float)x == x; }

/* Adds x[0 … n-1] to the lanes: acc[k] += x[j] for j ≡ k (mod MH_LANES), in order (n: a segment's length,
 * every segment but a row's last a multiple of MH_LANES, so that a row's lanes are the same however cut). */
static inline void mh_add_lanes(double acc[MH_LANES], const double *x, int64_t n) {
    int64_t j = 0;
    for (; j + MH_LANES <= n; j += MH_LANES)
        for (int k = 0; k < MH_LANES; k++) acc[k] += x[j + k];
    for (int k = 0; j + k < n; k++) acc[k] += x[j + k];
}

/* The lanes' total, added pairwise. */
static inline double mh_lanes_total(const double acc[MH_LANES]) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* a[0], a[s], … a[(n-1)s] as contiguous float64s: a itself where s is 1, else copied into buf. */
static inline const double *mh_pack_f8(const double *a, int64_t s, int64_t n, double *buf) {
    if (s == 1) return a;
    for (int64_t j = 0; j < n; j++) buf[j] = a[j * s];
    return buf;
}

/* The float32 a[0], a[s], … a[(n-1)s] as contiguous float64s (exact) in buf. */
static inline const double *mh_pack_f4(const float *a, int64_t s, int64_t n, double *buf) {
    for (int64_t j = 0; j < n; j++) buf[j] = (double)a[j * s];
    return buf;
}

/* Whether each of the bytes a[0], a[s], … a[(n-1)s] is nonzero, as contiguous int64s (0 or 1) in buf: a mask
 * that the loops below read beside float64s (read as bytes there, gcc does not vectorise them for AVX-512). */
static inline const int64_t *mh_pack_mask(const uint8_t *a, int64_t s, int64_t n, int64_t *buf) {
    for (int64_t j = 0; j < n; j++) buf[j] = a[j * s] != 0;
    return buf;
}

/* ---- a stage's comparison ------------------------------------------------------------------------- */

/* The figures of a segment's compared elements (kernels.ordinary_stage's loop body, its results). */
typedef struct {
    int64_t odd;      /* some compared element is out of the ordinary */
    int64_t compared; /* elements compared (visible) */
    int64_t n_z;      /* of them with sigma > 0 */
    int64_t above;    /* some compared |golden| exceeds its tolerance */
    double max_err, rel_max;
    double worst;     /* the largest error/tolerance; -1 where nothing is compared */
} mh_stage_figures;

/* One contiguous segment of a row (kernels.ordinary_stage's loop over j): its figures into f, each
 * compared element's z² (0 elsewhere) into zz.  The body is numba's, each condition that returns False
 * there an `odd` flag here, each running maximum a max reduction (the same maximum in any order); without a
 * branch, so that it vectorises: `vis` is all ones where every element is compared, `sg` and `wr` are read
 * (another array's elements) where z is not wanted.  Where C differs from numba:
 *  - the quotients numba takes only where the divisor is positive are computed in every vector lane and
 *    the others' discarded by the select (no trap: -fno-trapping-math), so an element's values are numba's;
 *  - max(e - wor, 0.0) is common.h's mh_max, numba's max (a NaN first argument stays NaN, as there);
 *  - the max reductions combine lanes in an unspecified order and with unspecified NaN handling: only the
 *    figures of a segment without an odd element are used, whose values are all numbers, so the maxima are
 *    numba's exactly (e, q, r >= +0: no signed zero either);
 *  - the counts are int64 sums, written out as float64s (exact below 2^53 elements). */
static inline void mh_stage_segment(const double *v, const double *g, const double *t, const double *sg,
                                    const double *wr, const int64_t *vis, int64_t n, int64_t want_z,
                                    int64_t check_float32, double *zz, mh_stage_figures *f) {
    int64_t odd = 0, compared = 0, n_z = 0, above = 0;
    double max_err = 0.0, rel_max = 0.0, worst = -1.0;
#pragma omp simd reduction(| : odd, above) reduction(+ : compared, n_z) reduction(max : max_err, rel_max, worst)
    for (int64_t j = 0; j < n; j++) {
        int64_t on = vis[j];
        double x = v[j], gv = g[j], tj = t[j], s = sg[j];
        double e = fabs(x - gv);
        int64_t bad = check_float32 & !mh_fits_float32(x);
        bad |= !(isfinite(e) && tj >= 0.0);  /* a value or error not finite; a negative or NaN tolerance */
        double r = tj > 0.0 ? e / tj : 0.0;
        bad |= tj > 0.0 ? r > 1.0 : e > 0.0; /* above the tolerance; inexact where it is 0 */
        double a = fabs(gv);
        double q = a > 0.0 ? e / a : (e > 0.0 ? INFINITY : 0.0);
        int64_t positive = want_z & (s > 0.0);
        bad |= want_z & !(s > 0.0) & !(s == 0.0); /* a negative or NaN sigma */
        double z = positive ? mh_max(e - wr[j], 0.0) / s : 0.0;
        zz[j] = on & positive ? z * z : 0.0;
        odd |= on & bad;
        compared += on;
        n_z += on & positive;
        above |= on & (a > tj);
        max_err = mh_max(max_err, on ? e : 0.0);
        rel_max = mh_max(rel_max, on ? q : 0.0);
        worst = mh_max(worst, on ? r : -1.0);
    }
    *f = (mh_stage_figures){odd, compared, n_z, above, max_err, rel_max, worst};
}

/* The first j of a segment whose compared element's error/tolerance is `worst` (mh_stage_segment's r). */
static inline int64_t mh_first_ratio(const double *v, const double *g, const double *t, const int64_t *vis,
                                     int64_t n, double worst) {
    for (int64_t j = 0; j < n; j++) {
        if (vis[j] == 0) continue;
        double e = fabs(v[j] - g[j]);
        if ((t[j] > 0.0 ? e / t[j] : 0.0) == worst) return j;
    }
    return 0; /* not reached: `worst` is one of the segment's ratios */
}

/* kernels.ordinary_stage: compare.compare_stage's figures for a passing stage in one sweep of (N, R, C)
 * arrays of any strides, written into result[0 … 8]: (ok, compared, max |error|, max relative error,
 * worst error/tolerance, its flat index in C order, Σ z², elements with sigma > 0, whether some compared
 * |golden| exceeds its tolerance); all 0 but where ok.  Returns ok: 0 as soon as a segment holds an element
 * out of the ordinary (the caller then judges the stage by NumPy, with every message).  The maxima and the
 * first index of the largest ratio are numba's and NumPy's exactly (a ratio's first index: the first
 * segment whose largest ratio exceeds every earlier one's, strictly, and its first element holding it);
 * Σ z² is summed in this file's fixed order (numba's: one running sum). */
MH_EXPORT int64_t MH_LEVELED(mh_ordinary_stage)(ARR3(const double, v), ARR3(const double, g), ARR3(const double, tol),
                                                ARR3(const double, sig), ARR3(const double, wor),
                                                ARR3(const uint8_t, vis), int64_t use_vis, int64_t want_z,
                                                int64_t check_float32, double *result) {
    double bv[MH_SEGMENT], bg[MH_SEGMENT], bt[MH_SEGMENT], bs[MH_SEGMENT], bw[MH_SEGMENT], zz[MH_SEGMENT];
    int64_t bvis[MH_SEGMENT], every[MH_SEGMENT];
    for (int64_t j = 0; j < MH_SEGMENT; j++) every[j] = 1;
    int64_t compared = 0, n_z = 0, above = 0, at = 0;
    double max_err = 0.0, rel_max = 0.0, worst = -1.0, z2 = 0.0;
    for (int64_t k = 0; k < 9; k++) result[k] = 0.0;
    for (int64_t h = 0; h < v_n0; h++)
        for (int64_t i = 0; i < v_n1; i++) {
            double lanes[MH_LANES] = {0.0};
            for (int64_t j0 = 0; j0 < v_n2; j0 += MH_SEGMENT) {
                int64_t n = v_n2 - j0 < MH_SEGMENT ? v_n2 - j0 : MH_SEGMENT;
                const double *pv = mh_pack_f8(&AT3(v, h, i, j0), v_s2, n, bv);
                const double *pg = mh_pack_f8(&AT3(g, h, i, j0), g_s2, n, bg);
                const double *pt = mh_pack_f8(&AT3(tol, h, i, j0), tol_s2, n, bt);
                const double *ps = want_z ? mh_pack_f8(&AT3(sig, h, i, j0), sig_s2, n, bs) : pt;
                const double *pw = want_z ? mh_pack_f8(&AT3(wor, h, i, j0), wor_s2, n, bw) : pt;
                const int64_t *pvis = use_vis ? mh_pack_mask(&AT3(vis, h, i, j0), vis_s2, n, bvis) : every;
                mh_stage_figures f;
                mh_stage_segment(pv, pg, pt, ps, pw, pvis, n, want_z, check_float32, zz, &f);
                if (f.odd) return 0;
                if (f.worst > worst) {
                    worst = f.worst;
                    at = (h * v_n1 + i) * v_n2 + j0 + mh_first_ratio(pv, pg, pt, pvis, n, worst);
                }
                compared += f.compared;
                n_z += f.n_z;
                above |= f.above;
                max_err = mh_max(max_err, f.max_err);
                rel_max = mh_max(rel_max, f.rel_max);
                if (want_z) mh_add_lanes(lanes, zz, n);
            }
            z2 += mh_lanes_total(lanes);
        }
    const double figures[9] = {1.0, (double)compared, max_err, rel_max, worst, (double)at, z2, (double)n_z,
                               (double)above};
    for (int64_t k = 0; k < 9; k++) result[k] = figures[k];
    return 1;
}

/* ---- the second opinion's sums of squares --------------------------------------------------------- */

/* Σ (v_j − g_j)² (Σ v_j² without `use_g`) over a contiguous segment's elements where m_j is nonzero (every
 * element without `use_m`), added to the lanes; an element left out adds an exact 0, whatever it holds. */
static inline void mh_squares_segment(double lanes[MH_LANES], const double *v, const double *g, const int64_t *m,
                                      int64_t n, int64_t use_g, int64_t use_m, double *dd) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        double d = use_g ? v[j] - g[j] : v[j];
        dd[j] = use_m && !m[j] ? 0.0 : d * d;
    }
    mh_add_lanes(lanes, dd, n);
}

/* The sum of squares of (N, R, C) values of either float dtype (v8 or v4, the other NULL) into result[0]
 * (mh_sum_squares, mh_sum_squares_f4). */
MH_INLINE int64_t mh_sum_squares_of(const double *v8, const float *v4, int64_t N, int64_t R, int64_t C,
                                 int64_t v_s0, int64_t v_s1, int64_t v_s2, ARR3(const double, g), ARR3(const uint8_t, m),
                                 int64_t use_g, int64_t use_m, double *result) {
    double bv[MH_SEGMENT], bg[MH_SEGMENT], dd[MH_SEGMENT];
    int64_t bm[MH_SEGMENT];
    double total = 0.0;
    for (int64_t h = 0; h < N; h++)
        for (int64_t i = 0; i < R; i++) {
            double lanes[MH_LANES] = {0.0};
            for (int64_t j0 = 0; j0 < C; j0 += MH_SEGMENT) {
                int64_t n = C - j0 < MH_SEGMENT ? C - j0 : MH_SEGMENT, at = h * v_s0 + i * v_s1 + j0 * v_s2;
                const double *pv = v8 ? mh_pack_f8(v8 + at, v_s2, n, bv) : mh_pack_f4(v4 + at, v_s2, n, bv);
                const double *pg = use_g ? mh_pack_f8(&AT3(g, h, i, j0), g_s2, n, bg) : bg;
                const int64_t *pm = use_m ? mh_pack_mask(&AT3(m, h, i, j0), m_s2, n, bm) : bm;
                mh_squares_segment(lanes, pv, pg, pm, n, use_g, use_m, dd);
            }
            total += mh_lanes_total(lanes);
        }
    result[0] = total;
    return isfinite(total);
}

/* The second opinion's Σ (v − g)² (Σ v² without `use_g`) over the elements of (N, R, C) float64 arrays of
 * any strides (broadcast ones too) where the mask m is nonzero (every element without `use_m`), in float64,
 * in this file's fixed order, into result[0] (second_opinion._sum_squares sums the gathered elements in
 * steps instead: the same terms, added in another order).  A NaN or infinity selected propagates (the
 * caller narrows the selection to the finite elements then).  Returns whether the sum is finite. */
MH_EXPORT int64_t MH_LEVELED(mh_sum_squares)(ARR3(const double, v), ARR3(const double, g), ARR3(const uint8_t, m),
                                             int64_t use_g, int64_t use_m, double *result) {
    return mh_sum_squares_of(v, NULL, v_n0, v_n1, v_n2, v_s0, v_s1, v_s2, ARG3(g), ARG3(m), use_g, use_m, result);
}

/* mh_sum_squares of float32 values (a plain implementation's stage in float32), each converted exactly. */
MH_EXPORT int64_t MH_LEVELED(mh_sum_squares_f4)(ARR3(const float, v), ARR3(const double, g), ARR3(const uint8_t, m),
                                                int64_t use_g, int64_t use_m, double *result) {
    return mh_sum_squares_of(NULL, v, v_n0, v_n1, v_n2, v_s0, v_s1, v_s2, ARG3(g), ARG3(m), use_g, use_m, result);
}
