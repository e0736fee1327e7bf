/* mhaspec's compiled chunk loops: the golden bounds' attention chunk (kernels.attention_chunk and
 * kernels._emit, term by term; see common.h), included by attention.c (once per x86-64 level: common.h,
 * MH_LEVEL), which defines MH_ATTENTION_NAME, the name of the function it gets, MH_ATTENTION_LSE_NAME, that
 * of the one that also forms the golden lse's row operands, and MH_ATTENTION_TARGET, their attributes. */

/* The parameters of mh_attention_chunk (kernels.SIGNATURES["attention_chunk"]'s order), and its arguments
 * passed on as they came. */
#define MH_ATTENTION_PARAMS \
    ARR3(const double, s), ARR3(const double, p), ARR3(const uint8_t, vis), ARR3(const float, m1), \
    ARR3(const float, m2), double c1, double c2, double w_d, double s_d, double u2, double ua, double w_s, \
    double s_s, double floor_, double cap, int64_t want_bounds, ARR3(double, sig_s), ARR3(double, wor_s), \
    ARR3(double, sig_p), ARR3(double, wor_p), int64_t want_tol, int64_t ext_arrays, ARR3(const double, ext_s), \
    double ext_s_val, ARR3(const double, ext_p), double ext_p_val, ARR3(double, tol_s), ARR3(double, tol_p), \
    ARR3(double, lhs), ARR3(double, q), ARR3(float, pp32), ARR3(float, lhs32), ARR2(double, pk_out), \
    ARR2(double, work), int64_t S_seen
#define MH_ATTENTION_ARGS \
    ARG3(s), ARG3(p), ARG3(vis), ARG3(m1), ARG3(m2), c1, c2, w_d, s_d, u2, ua, w_s, s_s, floor_, cap, want_bounds, \
        ARG3(sig_s), ARG3(wor_s), ARG3(sig_p), ARG3(wor_p), want_tol, ext_arrays, ARG3(ext_s), ext_s_val, ARG3(ext_p), \
        ext_p_val, ARG3(tol_s), ARG3(tol_p), ARG3(lhs), ARG3(q), ARG3(pp32), ARG3(lhs32), ARG2(pk_out), ARG2(work), S_seen

/* One row's sigma and worst into the bounds, and/or its tolerances LAMBDA·sigma + (worst + ext)
 * (kernels._emit): over the whole row, the keys past S_seen holding the 0 the caller left there. */
MH_INLINE void mh_emit(int64_t h, int64_t i, int64_t S, const double *sig, const double *wor, int64_t want_bounds,
                       ARR3(double, sig_out), ARR3(double, wor_out), int64_t want_tol, int64_t ext_arrays,
                       ARR3(const double, ext), double ext_val, ARR3(double, tol_out)) {
    if (want_bounds) {
        double *so = ROW3(sig_out, h, i), *wo = ROW3(wor_out, h, i);
#pragma omp simd
        for (int64_t j = 0; j < S; j++) {
            so[j] = sig[j];
            wo[j] = wor[j];
        }
    }
    if (want_tol) {
        double *to = ROW3(tol_out, h, i);
        if (ext_arrays) {
            /* any strides: a reference error broadcast over the heads or rows */
            const double *er = ROW3(ext, h, i);
#pragma omp simd
            for (int64_t j = 0; j < S; j++) to[j] = sig[j] * MH_LAMBDA + (wor[j] + er[j * ext_s2]);
        } else {
#pragma omp simd
            for (int64_t j = 0; j < S; j++) to[j] = sig[j] * MH_LAMBDA + (wor[j] + ext_val);
        }
    }
}

/* mh_attention_chunk's loops (kernels.attention_chunk: the arguments, their meaning and the formulas are its
 * own).  Where `lse` is not NULL (mh_attention_lse_chunk: no numba counterpart), each row's golden lse
 * operands too, from the work the scores' sweep has done (model.variants.scores_lse's: its T_s² = sigma² +
 * (worst − floor)² is this loop's t² up to roundings): lse[0] Σ p τ (lse_move's first order), lse[1],
 * lse[2] lse_move's exact sums (mh_lse_move_sums), lse[3] Σ p²·t² (pk), lse[4] max |s| over the visible
 * keys; lse itself is the golden's, and Python finishes the error (compiled.golden_lse).  Each row is
 * swept three times in the L1 cache: the scores' bounds and the weights' score variance t², then the
 * weights' sigma and ℓ, then (after the second-order term) the weights' worst part and the head outputs'
 * operands.  Returns nonzero where every value written is finite (the numba loop's math.isfinite(chk)).
 * vs: the visibility's stride along the keys (vis_s2), a constant 1 where the caller knows it is. */
MH_INLINE int64_t mh_attention_rows(
    ARR3(const double, s), ARR3(const double, p), ARR3(const uint8_t, vis), ARR3(const float, m1),
    ARR3(const float, m2), double c1, double c2, double w_d, double s_d, double u2, double ua, double w_s,
    double s_s, double floor_, double cap, int64_t want_bounds, ARR3(double, sig_s), ARR3(double, wor_s),
    ARR3(double, sig_p), ARR3(double, wor_p), int64_t want_tol, int64_t ext_arrays, ARR3(const double, ext_s),
    double ext_s_val, ARR3(const double, ext_p), double ext_p_val, ARR3(double, tol_s), ARR3(double, tol_p),
    ARR3(double, lhs), ARR3(double, q), ARR3(float, pp32), ARR3(float, lhs32), ARR2(double, pk_out),
    ARR2(double, work), int64_t S_seen, int64_t vs, ARR3(double, lse)) {
    const int64_t n_heads = s_n0, R = s_n1, S = s_n2;
    double *ts2 = ROW2(work, 0), *tau = ROW2(work, 1), *ptau = ROW2(work, 2), *ell = ROW2(work, 3);
    double *eel = ROW2(work, 4), *sigp = ROW2(work, 5), *ups = ROW2(work, 6), *dns = ROW2(work, 7);
    double *sgs = ROW2(work, 8), *wrs = ROW2(work, 9);
    const double stored = 2 * u2 + MH_U64_2;
    double chk = 0.0;
    for (int64_t j = S_seen; j < S; j++) { /* the keys no row sees: bounds 0 (the loops below never write there) */
        sgs[j] = 0.0;
        wrs[j] = 0.0;
        sigp[j] = 0.0;
    }
    for (int64_t h = 0; h < n_heads; h++) {
        for (int64_t i = 0; i < R; i++) {
            const double *sr = ROW3(s, h, i), *pr_ = ROW3(p, h, i);
            const float *mr1 = ROW3(m1, h, i), *mr2 = ROW3(m2, h, i);
            const uint8_t *vr = ROW3(vis, h, i);
            double *qr = ROW3(q, h, i), *lr = ROW3(lhs, h, i);
            float *ppr = ROW3(pp32, h, i), *l32 = ROW3(lhs32, h, i);
            double pk = 0.0, row = 0.0;
            int64_t top = 0;
#pragma omp simd reduction(+ : pk, row, chk) reduction(max : top)
            for (int64_t j = 0; j < S_seen; j++) { /* 2. scores; the weights' score variance t², τ = LAMBDA·t */
                double sj = sr[j], pj = pr_[j];
                double v = vr[j * vs] ? 1.0 : 0.0;
                double m = c2 * (double)mr2[j];
                double sa = s_d * m;
                double s2 = c1 * (double)mr1[j] + stored * (sj * sj) + sa * sa;
                double ws = w_d * m;
                double t2 = ws * ws + s2;
                ts2[j] = t2;
                double qq = (pj * pj) * t2;
                qr[j] = qq;
                pk += qq;
                int64_t b = mh_bits(fabs(sj) * v); /* the row's largest visible |s| (mh_largest) */
                top = b > top ? b : top;
                double ta = sqrt(t2) * MH_LAMBDA * v;
                tau[j] = ta;
                double pt = pj * ta;
                ptau[j] = pt;
                row += pt;
                double sg = sqrt(s2), wr = ws + floor_;
                sgs[j] = sg;
                wrs[j] = wr;
                chk += sg + wr;
            }
            mh_emit(h, i, S, sgs, wrs, want_bounds, ARG3(sig_s), ARG3(wor_s), want_tol, ext_arrays,
                    ARG3(ext_s), ext_s_val, ARG3(tol_s));
            const double rmax = mh_as_double(top);
            AT2(pk_out, h, i) = pk;
            if (lse) { /* before the second-order term: ptau is still p·τ there, tau is read only */
                double *lr = ROW3(lse, h, i);
                lr[0] = row;
                mh_lse_move_sums(pr_, tau, S_seen, &lr[1], &lr[2]);
                lr[3] = pk;
                lr[4] = rmax;
            }
#pragma omp simd
            for (int64_t j = 0; j < S_seen; j++) { /* 3. the weights' sigma; ℓ of the second-order term */
                double pj = pr_[j];
                double d = mh_max(pk - qr[j], 0.0);
                sigp[j] = pj * sqrt((1.0 - pj) * (1.0 - pj) * ts2[j] + d + (u2 + MH_U64_2 + s_s * s_s));
                ell[j] = tau[j] + row - 2 * ptau[j];
            }
            mh_second_order_row(pr_, tau, ell, ptau, eel, ups, dns, sgs, S_seen);
#pragma omp simd reduction(+ : chk)
            for (int64_t j = 0; j < S_seen; j++) { /* the weights' worst part; the head outputs' operands */
                double pj = pr_[j];
                double v = vr[j * vs] ? 1.0 : 0.0;
                double sec = ptau[j];
                double pr = pj * (w_s + ua * (fabs(sr[j]) + rmax));
                double w = mh_min(pr + sec, cap);
                double wr = (w + floor_) * v;
                wrs[j] = wr;
                double pp = pj * pj;
                double p_all = pr + s_s * pj; /* all of the softmax's own rounding */
                double lh = qr[j] + (u2 + MH_U64_2) * pp + p_all * p_all + (s_s * s_s) * pj;
                lr[j] = lh;
                ppr[j] = (float)pp;
                l32[j] = (float)(sec + w_s * pj);
                chk += wr + sigp[j] + lh;
            }
            mh_emit(h, i, S, sigp, wrs, want_bounds, ARG3(sig_p), ARG3(wor_p), want_tol, ext_arrays,
                    ARG3(ext_p), ext_p_val, ARG3(tol_p));
        }
    }
    return isfinite(chk) ? 1 : 0;
}

/* mh_attention_rows with the visibility's key stride a constant where it is 1 (the usual one, also where
 * the visibility is broadcast over the heads or rows): the loops then load it as a row of vectors instead
 * of gathering bytes (the C loop took ~1.4 times numba's time with the gather alone; results/2026-12-07-s5-attn.md). */
MH_ATTENTION_TARGET int64_t MH_ATTENTION_NAME(MH_ATTENTION_PARAMS) {
    if (vis_s2 == 1) return mh_attention_rows(MH_ATTENTION_ARGS, 1, NULL, 0, 0, 0, 0, 0, 0);
    return mh_attention_rows(MH_ATTENTION_ARGS, vis_s2, NULL, 0, 0, 0, 0, 0, 0);
}

/* The same loops, each row's golden lse operands into the (heads, rows, 5) `lse` too: a function of its own,
 * so that the plain one keeps its code (lse a constant NULL there). */
MH_ATTENTION_TARGET int64_t MH_ATTENTION_LSE_NAME(MH_ATTENTION_PARAMS, ARR3(double, lse)) {
    if (vis_s2 == 1) return mh_attention_rows(MH_ATTENTION_ARGS, 1, ARG3(lse));
    return mh_attention_rows(MH_ATTENTION_ARGS, vis_s2, ARG3(lse));
}
