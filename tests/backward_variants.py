"""MHA backward implementations for the two-sided proof of the backward tolerances.

One small numpy implementation (forward and backward), written independently
of the reference and of the numpy adapter, whose backward can be switched to a
*correct alternative* (FlashAttention-style: P recomputed from the saved
log-sum-exp key block by key block, δ = rowsum(dO ⊙ O); every partial sum
rounded to the dtype) or to a *realistic bug*, each named by the backward
stage where it must first be caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mhaspec.spec import Case

DT = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@dataclass
class BackwardVariant:
    """An adapter with ``run`` and ``backward``; every field off = a plain, correct implementation."""

    name: str = "backward-variant"
    # correct alternatives
    flash: bool = False  # recompute P = exp(s − lse) per key block; δ = rowsum(dO ⊙ O)
    native_accumulation: bool = False  # every partial sum rounded to the dtype under test
    # bugs
    no_softmax_jacobian_term: bool = False  # dS = P ⊙ dP (the −δ term forgotten)
    dv_with_p_not_transposed: bool = False  # dV = P dO instead of Pᵀ dO (square cases)
    dq_without_scale: bool = False
    dk_without_scale: bool = False
    gqa_not_summed: bool = False  # a key/value head gets only its group's first query head
    mask_ignored_in_backward: bool = False  # P recomputed without the explicit mask
    causal_ignored_in_backward: bool = False  # P recomputed without the causal mask
    transposed_dw: bool = False  # d_w_o = (d_outputᵀ concat) reshaped, not concatᵀ d_output
    bias_grad_wrong_axis: bool = False  # d_b_v summed over a mis-viewed axis
    # a known deviation, not a bug: the scale taken in float32 whatever the dtype (Keras, ONNX exporters)
    scale_float32: bool = False

    def _scale(self, case: Case) -> float:
        return float(np.float32(case.config.scale)) if self.scale_float32 else case.config.scale

    # -- arithmetic in the dtype under test ---------------------------------------------------
    def _setup(self, case: Case) -> None:
        self.dt = DT[case.dtype]
        low = case.dtype in ("float16", "bfloat16")
        self.acc = self.dt if (self.native_accumulation or not low) else np.float32

    def r(self, x) -> np.ndarray:
        return np.asarray(x).astype(self.dt)

    def mm(self, a, b) -> np.ndarray:
        """a @ b (batched), stored in the dtype; native: every partial sum rounded to the dtype."""
        a, b = self.r(a), self.r(b)
        if not self.native_accumulation:
            return self.r(np.matmul(a.astype(self.acc), b.astype(self.acc)))
        total = self.r(np.zeros(np.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1]))))
        for i in range(a.shape[-1]):
            term = self.r(a[..., :, i : i + 1].astype(np.float64) * b[..., i : i + 1, :].astype(np.float64))
            total = self.r(total.astype(np.float64) + term.astype(np.float64))
        return total

    def lin(self, x, wt, b) -> np.ndarray:
        """x @ wt + b, stored in the dtype.   x (B, L, F), wt (F, N), b (N,) or None -> (B, L, N)."""
        y = self.mm(x, wt)
        return y if b is None else self.r(y.astype(self.acc) + self.r(b).astype(self.acc))

    def visible(self, case: Case, causal: bool = True, mask: bool = True) -> np.ndarray:
        cfg, B, T, S = case.config, case.batch, case.tgt_len, case.src_len
        allowed = np.ones((B, cfg.H, T, S), dtype=bool)
        if cfg.causal and causal:
            shift = 0 if cfg.causal_alignment == "top_left" else S - T
            allowed &= np.arange(S)[None, :] <= np.arange(T)[:, None] + shift
        if case.inputs.mask is not None and mask:
            allowed &= np.broadcast_to(case.inputs.mask, allowed.shape)
        return allowed

    # -- forward --------------------------------------------------------------------------------
    def _forward(self, case: Case) -> dict[str, np.ndarray]:
        self._setup(case)
        cfg, w = case.config, case.weights
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        R = H // G

        lin = self.lin
        q, k, v = lin(case.inputs.query, w.w_q, w.b_q), lin(case.inputs.key, w.w_k, w.b_k), lin(case.inputs.value, w.w_v, w.b_v)
        Q = q.reshape(B, T, H, -1).transpose(0, 2, 1, 3)  # (B, H, T, D)
        K = np.repeat(k.reshape(B, S, G, -1).transpose(0, 2, 1, 3), R, axis=1)  # (B, H, S, D)
        V = np.repeat(v.reshape(B, S, G, -1).transpose(0, 2, 1, 3), R, axis=1)  # (B, H, S, E)
        s = self.r(self.mm(Q, np.swapaxes(K, -1, -2)).astype(self.acc) * self.r(self._scale(case)).astype(self.acc))
        allowed = self.visible(case)
        x = np.where(allowed, s.astype(np.float32 if self.acc != np.float64 else np.float64), -np.inf)
        m = np.max(x, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        e = np.exp(x - m)
        l_ = e.sum(-1, keepdims=True)
        p = self.r(np.where(allowed, e / np.where(l_ > 0, l_, 1), 0))
        lse = np.where(l_ > 0, m + np.log(np.where(l_ > 0, l_, 1)), np.inf)  # +inf: a row that sees no key
        o = self.mm(p, V)
        c = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
        y = lin(c, w.w_o, w.b_o)
        return {"q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p, "head_outputs": o,
                "concat": c, "output": y, "_Q": Q, "_K": K, "_V": V, "_lse": lse}

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return {k: v for k, v in self._forward(case).items() if not k.startswith("_")}

    # -- backward -------------------------------------------------------------------------------
    def backward(self, case: Case) -> dict[str, np.ndarray]:
        # a bug's gradients can overflow a float16 kernel into inf and NaN: that is its result, judged;
        # NumPy's warnings about it are noise (tests/reports.py runs the variants in the test process)
        with np.errstate(over="ignore", invalid="ignore"):
            return self._backward(case)

    def _backward(self, case: Case) -> dict[str, np.ndarray]:
        f = self._forward(case)
        B, T, S, H = case.batch, case.tgt_len, case.src_len, case.config.H
        Q, K, V, p = f["_Q"], f["_K"], f["_V"], f["attn_weights"]
        acc = self.acc
        dy, dc, dO, dP = self._through_output(case, V)

        recompute = self.flash or self.mask_ignored_in_backward or self.causal_ignored_in_backward
        if recompute:  # P from the saved log-sum-exp, key block by key block (FlashAttention-2 style)
            allowed = self.visible(case, causal=not self.causal_ignored_in_backward,
                                   mask=not self.mask_ignored_in_backward)
            lse = f["_lse"]
            P = np.zeros((B, H, T, S), dtype=np.float64)
            for j0 in range(0, S, 4):
                blk = slice(j0, min(S, j0 + 4))
                with np.errstate(invalid="ignore"):
                    pb = np.exp(f["scores"][..., blk].astype(acc) - lse.astype(acc))
                P[..., blk] = np.where(allowed[..., blk] & np.isfinite(lse), pb, 0)
            P = self.r(P)
            delta = np.sum(dO.astype(acc) * f["head_outputs"].astype(acc), axis=-1, keepdims=True)
        else:
            P = p
            delta = np.sum(P.astype(acc) * dP.astype(acc), axis=-1, keepdims=True)
        if self.no_softmax_jacobian_term:
            dS = self.r(P.astype(acc) * dP.astype(acc))
        else:
            dS = self.r(P.astype(acc) * (dP.astype(acc) - delta))

        dq, dk, dv = self._qkv_grads(case, dS, P, dO, Q, K)
        out = {"d_concat": dc, "d_head_outputs": dO, "d_attn_weights": dP, "d_scores": dS,
               "d_q_proj": dq, "d_k_proj": dk, "d_v_proj": dv}
        return self._through_projections(case, f["concat"], dy, out)

    def _through_output(self, case: Case, V) -> tuple[np.ndarray, ...]:
        """(d_output, d_concat (B, T, H·E), d_head_outputs dO (B, H, T, E), d_attn_weights dO Vᵀ (B, H, T, S))
        in the dtype; V (B, H, S, E), repeated over each group."""
        B, T, H, E = case.batch, case.tgt_len, case.config.H, case.config.D_v
        dy = self.r(case.d_output)
        dc = self.mm(dy, np.ascontiguousarray(case.weights.w_o.T))
        dO = dc.reshape(B, T, H, E).transpose(0, 2, 1, 3)
        return dy, dc, dO, self.mm(dO, np.swapaxes(V, -1, -2))

    def _qkv_grads(self, case: Case, dS, P, dO, Q, K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(d of the scaled product's Q (B, T, H·D), its K (B, S, H_kv·D), d_v_proj (B, S, H_kv·E)) from
        dS (B, H, T, S) the gradient of scale·Q Kᵀ's product, P (B, H, T, S), dO (B, H, T, E) and the
        Q, K (B, H, ·, D) that product was taken of (K repeated over each group)."""
        cfg = case.config
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        R, D, E = H // G, cfg.D_k, cfg.D_v
        acc = self.acc
        scale = self.r(self._scale(case)).astype(acc)
        dQ = self.mm(dS, K)
        if not self.dq_without_scale:
            dQ = self.r(dQ.astype(acc) * scale)
        dK_h = self.mm(np.swapaxes(dS, -1, -2), Q)  # (B, H, S, D) per query head
        if self.dv_with_p_not_transposed and T == S:
            dV_h = self.mm(P, dO)
        else:
            dV_h = self.mm(np.swapaxes(P, -1, -2), dO)  # (B, H, S, E)
        if self.gqa_not_summed:
            dK_g, dV_g = dK_h[:, ::R], dV_h[:, ::R]
        else:
            dK_g = self.r(dK_h.reshape(B, G, R, S, D).astype(acc).sum(2))
            dV_g = self.r(dV_h.reshape(B, G, R, S, E).astype(acc).sum(2))
        if not self.dk_without_scale:
            dK_g = self.r(dK_g.astype(acc) * scale)
        dq = dQ.transpose(0, 2, 1, 3).reshape(B, T, H * D)
        dk = dK_g.transpose(0, 2, 1, 3).reshape(B, S, G * D)
        dv = dV_g.transpose(0, 2, 1, 3).reshape(B, S, G * E)
        return dq, dk, dv

    def _through_projections(self, case: Case, concat, dy, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``out`` (holding d_q_proj, d_k_proj, d_v_proj) with the input, weight and bias gradients added:
        concat (B, T, H·E) the forward's, dy (B, T, d_out) the upstream gradient in the dtype."""
        cfg, w = case.config, case.weights
        B = case.batch
        dq, dk, dv = out["d_q_proj"], out["d_k_proj"], out["d_v_proj"]
        if case.self_attention:
            out["d_query"] = self.mm(np.concatenate([dq, dk, dv], -1),
                                     np.concatenate([w.w_q, w.w_k, w.w_v], 1).T.copy())
        else:
            out["d_query"] = self.mm(dq, w.w_q.T.copy())
            if case.key_is_value:  # one memory tensor
                out["d_key"] = self.mm(np.concatenate([dk, dv], -1), np.concatenate([w.w_k, w.w_v], 1).T.copy())
            else:
                out["d_key"] = self.mm(dk, w.w_k.T.copy())
                out["d_value"] = self.mm(dv, w.w_v.T.copy())
        xs = {"q": case.inputs.query, "k": case.inputs.key, "v": case.inputs.value, "o": concat}
        ds = {"q": dq, "k": dk, "v": dv, "o": dy}
        for n in "qkvo":
            xf, df = xs[n].reshape(B * xs[n].shape[1], -1), ds[n].reshape(B * ds[n].shape[1], -1)
            dw = self.mm(xf.T.copy(), df)
            if self.transposed_dw and n == "o":
                dw = self.mm(df.T.copy(), xf).reshape(dw.shape)
            out[f"d_w_{n}"] = dw
            if cfg.bias:
                ones = np.ones((1, df.shape[0]))
                if self.bias_grad_wrong_axis and n == "v":  # (B·S, N) viewed as (N, B·S), summed over B·S
                    out[f"d_b_{n}"] = self.mm(df.reshape(df.shape[1], df.shape[0]), ones.T.copy())[:, 0]
                else:
                    out[f"d_b_{n}"] = self.mm(ones, df)[0]
        return out


#: name -> (adapter, the precision contract it keeps: docs/tolerances.md)
CORRECT = {
    "plain": (BackwardVariant(name="plain"), "standard"),
    "flash_recompute": (BackwardVariant(name="flash_recompute", flash=True), "standard"),
    # every partial sum rounded to float16/bfloat16: correct, but only under the worst-case contract
    "native_accumulation": (BackwardVariant(name="native_accumulation", native_accumulation=True), "worst-case"),
    "flash_native": (BackwardVariant(name="flash_native", flash=True, native_accumulation=True), "worst-case"),
}

#: bug -> (adapter, the backward stage where it must first be caught)
BUGS = {
    "no_softmax_jacobian_term": (BackwardVariant(name="no_jacobian", no_softmax_jacobian_term=True), "d_scores"),
    "dv_with_p_not_transposed": (BackwardVariant(name="dv_p", dv_with_p_not_transposed=True), "d_v_proj"),
    "dq_without_scale": (BackwardVariant(name="dq_noscale", dq_without_scale=True), "d_q_proj"),
    "dk_without_scale": (BackwardVariant(name="dk_noscale", dk_without_scale=True), "d_k_proj"),
    "gqa_not_summed": (BackwardVariant(name="gqa_first", gqa_not_summed=True), "d_k_proj"),
    "mask_ignored_in_backward": (BackwardVariant(name="leak", mask_ignored_in_backward=True), "d_scores"),
    "causal_ignored_in_backward": (BackwardVariant(name="causal_off", causal_ignored_in_backward=True), "d_scores"),
    "transposed_dw": (BackwardVariant(name="dw_t", transposed_dw=True), "d_w_o"),
    "bias_grad_wrong_axis": (BackwardVariant(name="db_axis", bias_grad_wrong_axis=True), "d_b_v"),
}
