/* mhaspec's compiled chunk loops: see common.h.  The local checks' loops (kernels.local_weights_chunk,
 * local_scores_chunk, local_outputs_operands), term by term, and the local lse check's per-row sums
 * folded into the weights loop (mh_local_weights_lse_chunk: no numba counterpart; model.variants.lse's
 * operands, finished in Python by its own formulas, tolerance.local_references). */
#include "common.h"

/* The weights loop's constants (kernels.local_weights_chunk's arguments) and its work rows. */
typedef struct {
    double u2, ua, w_s, s_s, floor_, stored;
    double *ts2, *tau, *ptau, *ell, *eel, *ups, *dns, *spare;
} mh_weights_work;

/* One row of kernels.local_weights_chunk (term by term; see its docstring): the softmax of the visible
 * scores `sr` into `pr`, its bound into `sgr`, `wr`, over the S_seen keys the chunk's rows see (later ones
 * 0); `vr[j * vs]`: key j's visibility (vs, any stride: inlined with vs = 1, the usual layout, the loops
 * read it as a vector; a gather of bytes otherwise).  Where `lr` is not NULL, the row's local lse
 * operands: lr[0] peak, lr[1] Σ e^{s_j − peak} (lse = peak + log of it, in Python), lr[2] Σ p τ
 * (lse_move's first order), lr[3], lr[4] lse_move's exact sums (mh_lse_move_sums), lr[5] Σ p²·T² (pk),
 * lr[6] max |s| over the visible keys.  Returns the row's finite check: a sum of every visible score
 * and every value written. */
MH_INLINE double local_weights_row(const mh_weights_work *w, const double *sr, const uint8_t *vr, int64_t vs,
                                   double *pr, double *sgr, double *wr, double *lr, int64_t S_seen, int64_t S) {
    double *ts2 = w->ts2, *tau = w->tau, *ptau = w->ptau, *ell = w->ell;
    const double u2 = w->u2, ua = w->ua, w_s = w->w_s, s_s = w->s_s, floor_ = w->floor_, stored = w->stored;
    for (int64_t j = S_seen; j < S; j++) { /* the keys no row sees */
        pr[j] = 0.0;
        sgr[j] = 0.0;
        wr[j] = 0.0;
    }
    /* the visible peak; a NaN score makes the check NaN (the caller's NumPy path), whatever the peak */
    double peak = -INFINITY, chk = 0.0;
#pragma omp simd reduction(max : peak) reduction(+ : chk)
    for (int64_t j = 0; j < S_seen; j++) {
        int v = vr[j * vs] != 0;
        double x = sr[j];
        peak = v & (x > peak) ? x : peak; /* (no && : a branch keeps the loop scalar) */
        chk += v ? x : 0.0;
    }
    if (!isfinite(peak)) peak = 0.0;
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < S_seen; j++) {
        double e = mh_exp(mh_min(sr[j] - peak, 0.0)); /* formed for a masked key too (then dropped): no branch */
        e = vr[j * vs] ? e : 0.0;
        pr[j] = e;
        total += e;
    }
#pragma omp simd
    for (int64_t j = 0; j < S_seen; j++) pr[j] = total > 0 ? pr[j] / total : 0.0;
    double pk = 0.0, row = 0.0;
    int64_t top = 0;
#pragma omp simd reduction(+ : pk, row) reduction(max : top)
    for (int64_t j = 0; j < S_seen; j++) { /* the scores' storage rounding t², τ = LAMBDA·t */
        int v = vr[j * vs] != 0;
        double sj = v ? sr[j] : 0.0, pj = pr[j];
        double t2 = (sj * sj) * stored;
        ts2[j] = t2;
        pk += (pj * pj) * t2;
        int64_t b = mh_bits(fabs(sj)); /* the row's largest visible |s| (mh_largest) */
        top = b > top ? b : top;
        double ta = sqrt(t2) * MH_LAMBDA * (v ? 1.0 : 0.0);
        tau[j] = ta;
        double pt = pj * ta;
        ptau[j] = pt;
        row += pt;
    }
    double rmax = mh_as_double(top);
    if (lr) {
        lr[0] = peak;
        lr[1] = total;
        lr[2] = row;
        mh_lse_move_sums(pr, tau, S_seen, &lr[3], &lr[4]);
        lr[5] = pk;
        lr[6] = rmax;
    }
#pragma omp simd reduction(+ : chk)
    for (int64_t j = 0; j < S_seen; j++) { /* sigma; ℓ of the second-order term */
        double pj = pr[j], t2 = ts2[j];
        double d = mh_max(pk - (pj * pj) * t2, 0.0);
        double sg = pj * sqrt((1.0 - pj) * (1.0 - pj) * t2 + d + (u2 + MH_U64_2 + s_s * s_s));
        sgr[j] = sg;
        chk += sg;
        ell[j] = tau[j] + row - 2 * ptau[j];
    }
    mh_second_order_row(pr, tau, ell, ptau, w->eel, w->ups, w->dns, w->spare, S_seen);
#pragma omp simd reduction(+ : chk)
    for (int64_t j = 0; j < S_seen; j++) { /* the worst part: the softmax's rounding, the second order */
        int v = vr[j * vs] != 0;
        double sj = v ? sr[j] : 0.0;
        double x = (pr[j] * (w_s + ua * (fabs(sj) + rmax)) + ptau[j] + floor_) * (v ? 1.0 : 0.0);
        wr[j] = x;
        chk += x;
    }
    return chk;
}

/* kernels.local_weights_chunk over a (heads, rows, S) chunk, each row's lse operands into `lse` where it is
 * not NULL (local_weights_row).  Returns nonzero where every visible score and value written is finite. */
MH_INLINE int64_t local_weights_rows(ARR3(const double, s), ARR3(const uint8_t, vis), double u2, double ua, double w_s,
                                     double s_s, double floor_, ARR3(double, ref), ARR3(double, sig),
                                     ARR3(double, wor), ARR2(double, work), int64_t S_seen, ARR3(double, lse)) {
    const int64_t n_heads = s_n0, R = s_n1, S = s_n2;
    const mh_weights_work w = {u2, ua, w_s, s_s, floor_, MH_U64_2 + u2,
                               ROW2(work, 0), ROW2(work, 1), ROW2(work, 2), ROW2(work, 3),
                               ROW2(work, 4), ROW2(work, 5), ROW2(work, 6), ROW2(work, 7)};
    double chk = 0.0;
    for (int64_t h = 0; h < n_heads; h++) {
        for (int64_t i = 0; i < R; i++) {
            const double *sr = ROW3(s, h, i);
            const uint8_t *vr = ROW3(vis, h, i);
            double *pr = ROW3(ref, h, i), *sgr = ROW3(sig, h, i), *wr = ROW3(wor, h, i);
            double *lr = lse ? ROW3(lse, h, i) : NULL;
            chk += vis_s2 == 1 ? local_weights_row(&w, sr, vr, 1, pr, sgr, wr, lr, S_seen, S)
                               : local_weights_row(&w, sr, vr, vis_s2, pr, sgr, wr, lr, S_seen, S);
        }
    }
    return isfinite(chk);
}

/* kernels.local_weights_chunk: the local attention-weights check of a (heads, rows, S) chunk. */
MH_EXPORT int64_t MH_LEVELED(mh_local_weights_chunk)(ARR3(const double, s), ARR3(const uint8_t, vis), double u2,
                                                     double ua, double w_s, double s_s, double floor_,
                                                     ARR3(double, ref), ARR3(double, sig), ARR3(double, wor),
                                                     ARR2(double, work), int64_t S_seen) {
    return local_weights_rows(ARG3(s), ARG3(vis), u2, ua, w_s, s_s, floor_, ARG3(ref), ARG3(sig), ARG3(wor),
                              ARG2(work), S_seen, NULL, 0, 0, 0, 0, 0, 0);
}

/* mh_local_weights_chunk and, into the (heads, rows, 7) `lse`, each row's local lse operands (no numba
 * counterpart: see local_weights_rows). */
MH_EXPORT int64_t MH_LEVELED(mh_local_weights_lse_chunk)(ARR3(const double, s), ARR3(const uint8_t, vis), double u2,
                                                         double ua, double w_s, double s_s, double floor_,
                                                         ARR3(double, ref), ARR3(double, sig), ARR3(double, wor),
                                                         ARR2(double, work), int64_t S_seen, ARR3(double, lse)) {
    return local_weights_rows(ARG3(s), ARG3(vis), u2, ua, w_s, s_s, floor_, ARG3(ref), ARG3(sig), ARG3(wor),
                              ARG2(work), S_seen, ARG3(lse));
}

/* kernels.local_scores_chunk: the local scores check of a (heads, rows, S) chunk once its products are
 * formed; `ref` (q·Kᵀ) scaled in place, sig and wor from the float32 products m_sig, m_wor, over the
 * S_seen keys the rows see (later keys 0).  Nonzero where every value is finite. */
MH_EXPORT int64_t MH_LEVELED(mh_local_scores_chunk)(ARR3(double, ref), ARR3(const float, m_sig),
                                                    ARR3(const float, m_wor),
                                                    double scale, double c_sig, double stored, double c_wor,
                                                    double c_acc, double floor_, ARR3(double, sig), ARR3(double, wor),
                                                    int64_t S_seen) {
    const int64_t n_heads = ref_n0, R = ref_n1, S = ref_n2;
    double chk = 0.0;
    for (int64_t h = 0; h < n_heads; h++) {
        for (int64_t i = 0; i < R; i++) {
            double *rr = ROW3(ref, h, i), *so = ROW3(sig, h, i), *wo = ROW3(wor, h, i);
            const float *ms = ROW3(m_sig, h, i), *mw = ROW3(m_wor, h, i);
            for (int64_t j = S_seen; j < S; j++) { /* the keys no row sees */
                rr[j] = 0.0;
                so[j] = 0.0;
                wo[j] = 0.0;
            }
#pragma omp simd reduction(+ : chk)
            for (int64_t j = 0; j < S_seen; j++) {
                double x = rr[j] * scale;
                rr[j] = x;
                double a = c_acc * (double)mw[j];
                double sg = sqrt(c_sig * (double)ms[j] + stored * (x * x) + a * a);
                double wr = c_wor * (double)mw[j] + floor_;
                so[j] = sg;
                wo[j] = wr;
                chk += x + sg + wr;
            }
        }
    }
    return isfinite(chk);
}

/* kernels.local_outputs_operands: the float32 operands p² and |p| of the local head-outputs check's
 * bound products, from the adapter's own weights `pc`.  Nonzero where every weight is finite. */
MH_EXPORT int64_t MH_LEVELED(mh_local_outputs_operands)(ARR3(const double, pc), ARR3(float, pp32), ARR3(float, apc32)) {
    const int64_t n_heads = pc_n0, R = pc_n1, S = pc_n2;
    double chk = 0.0;
    for (int64_t h = 0; h < n_heads; h++) {
        for (int64_t i = 0; i < R; i++) {
            const double *pr = ROW3(pc, h, i);
            float *pp = ROW3(pp32, h, i), *ap = ROW3(apc32, h, i);
#pragma omp simd reduction(+ : chk)
            for (int64_t j = 0; j < S; j++) {
                double x = pr[j];
                pp[j] = (float)(x * x);
                ap[j] = (float)fabs(x);
                chk += x;
            }
        }
    }
    return isfinite(chk);
}

/* mh_exp of each of x[0 … n-1] into out, at this build's level (the tests measure its ulps and hold every
 * level's to the baseline's). */
MH_EXPORT void MH_LEVELED(mh_exp_array)(const double *x, double *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = mh_exp(x[i]);
}
