"""MHA written with numpy, computing in the dtype under test; returns every stage,
forward (``run``) and backward (``backward``, written by hand).

Written independently of :mod:`mhaspec.reference` (plain ``einsum`` and
BLAS, not exact summation).  float64 and float32 compute natively; float16 and
bfloat16 store every stage in that dtype and accumulate each product sum in
float32, as mixed-precision hardware does.  bfloat16 needs ``ml_dtypes``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..spec import Case
from .backends import numpy as backend


class NumpyMHA:
    """The numpy adapter (built-in name ``numpy``)."""

    name = "numpy"
    framework = "numpy"

    def supports(self, case: Case) -> bool | str:
        if case.dtype == "bfloat16":
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                return "bfloat16 needs ml_dtypes (pip install mhaspec[bf16])"
        return True

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return self._forward(case)[0]

    def _forward(self, case: Case) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(every stage, what the backward pass reuses)."""
        cfg = case.config
        dt = backend.dtype(case.dtype)
        acc = np.float32 if case.dtype in ("float16", "bfloat16") else dt

        def rnd(x: np.ndarray) -> np.ndarray:  # store a stage in the dtype under test
            return x.astype(dt)

        def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
            y = x.astype(acc) @ rnd(w).astype(acc)
            if b is not None:
                y = y + rnd(b).astype(acc)
            return rnd(y)

        w = case.weights
        q = linear(rnd(case.inputs.query), w.w_q, w.b_q)  # (B, T, H·D)
        k = linear(rnd(case.inputs.key), w.w_k, w.b_k)  # (B, S, G·D)
        v = linear(rnd(case.inputs.value), w.w_v, w.b_v)  # (B, S, G·E)

        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        Q = q.reshape(B, T, H, cfg.D_k)  # BTHD
        K = k.reshape(B, S, G, cfg.D_k)  # BSGD
        V = v.reshape(B, S, G, cfg.D_v)  # BSGE
        group = H // G
        K = np.repeat(K, group, axis=2)  # BSHD: head h reads h // group
        V = np.repeat(V, group, axis=2)  # BSHE

        s = np.einsum("BTHD,BSHD->BHTS", Q.astype(acc), K.astype(acc))
        s = rnd(s.astype(acc) * np.asarray(cfg.scale, dtype=dt).astype(acc))

        allowed = backend.keep_mask(case)  # (B, H, T, S): causal AND mask

        logits = np.where(allowed, s.astype(acc), -np.inf)
        peak = logits.max(axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0)  # rows that see no key
        e = np.exp(logits - peak)
        denom = e.sum(axis=-1, keepdims=True)
        p = rnd(np.divide(e, denom, out=np.zeros_like(e), where=denom > 0))

        o = rnd(np.einsum("BHTS,BSHE->BHTE", p.astype(acc), V.astype(acc)))
        concat = o.transpose(0, 2, 1, 3).reshape(B, T, H * cfg.D_v)
        y = linear(concat, w.w_o, w.b_o)
        stages = {
            "q_proj": q, "k_proj": k, "v_proj": v, "scores": s, "attn_weights": p,
            "head_outputs": o, "concat": concat, "output": y,
        }
        return stages, {"Q": Q, "K": K, "V": V, "allowed": allowed, "dt": dt, "acc": acc}

    def backward(self, case: Case) -> dict[str, np.ndarray]:
        """Every backward stage, by hand: the gradients of Σ case.d_output ⊙ output.

        Same precision policy as the forward (stored in the dtype, summed in
        float32 for float16/bfloat16).  A GQA key/value head's gradient sums
        its group's query heads; a tensor passed as several inputs gets one
        gradient, the sum (self-attention: ``d_query``; shared key/value: ``d_key``).
        """
        assert case.d_output is not None, "case.d_output is missing"
        st, f = self._forward(case)
        cfg, w = case.config, case.weights
        dt, acc = f["dt"], f["acc"]
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        group = H // G

        def rnd(x: np.ndarray) -> np.ndarray:
            return x.astype(dt)

        def a(x: np.ndarray) -> np.ndarray:  # an operand, in the accumulator
            return np.asarray(x).astype(dt).astype(acc)

        dy = rnd(case.d_output)  # (B, T, d_out)
        dc = rnd(a(dy) @ a(w.w_o).T)  # (B, T, H·E)
        dO = dc.reshape(B, T, H, cfg.D_v).transpose(0, 2, 1, 3)  # BHTE
        p = st["attn_weights"]
        dP = rnd(np.einsum("BHTE,BSHE->BHTS", a(dO), a(f["V"])))
        delta = np.sum(a(p) * a(dP), axis=-1, keepdims=True)  # (B, H, T, 1)
        dS = rnd(np.where(f["allowed"], a(p) * (a(dP) - delta), 0))
        scale = np.asarray(cfg.scale, dtype=dt).astype(acc)
        dq = rnd(np.einsum("BHTS,BSHD->BTHD", a(dS), a(f["K"])) * scale).reshape(B, T, H * cfg.D_k)
        dK = np.einsum("BHTS,BTHD->BSHD", a(dS), a(f["Q"]))  # per query head
        dk = rnd(dK.reshape(B, S, G, group, cfg.D_k).sum(axis=3) * scale).reshape(B, S, G * cfg.D_k)
        dV = np.einsum("BHTS,BHTE->BSHE", a(p), a(dO))
        dv = rnd(dV.reshape(B, S, G, group, cfg.D_v).sum(axis=3)).reshape(B, S, G * cfg.D_v)

        out = {
            "d_concat": dc, "d_head_outputs": dO, "d_attn_weights": dP, "d_scores": dS,
            "d_q_proj": dq, "d_k_proj": dk, "d_v_proj": dv,
        }
        if case.self_attention:  # one input tensor: the sum of the three input gradients
            out["d_query"] = rnd(a(dq) @ a(w.w_q).T + a(dk) @ a(w.w_k).T + a(dv) @ a(w.w_v).T)
        else:
            out["d_query"] = rnd(a(dq) @ a(w.w_q).T)
            if case.key_is_value:  # one memory tensor: the sum of the key and value gradients
                out["d_key"] = rnd(a(dk) @ a(w.w_k).T + a(dv) @ a(w.w_v).T)
            else:
                out["d_key"] = rnd(a(dk) @ a(w.w_k).T)
                out["d_value"] = rnd(a(dv) @ a(w.w_v).T)
        x = {"q": case.inputs.query, "k": case.inputs.key, "v": case.inputs.value, "o": st["concat"]}
        d = {"q": dq, "k": dk, "v": dv, "o": dy}
        for n in "qkvo":
            rows_x, rows_d = a(x[n]).reshape(-1, x[n].shape[-1]), a(d[n]).reshape(-1, d[n].shape[-1])
            out[f"d_w_{n}"] = rnd(rows_x.T @ rows_d)  # (in, out)
            if cfg.bias:
                out[f"d_b_{n}"] = rnd(rows_d.sum(axis=0))
        return out
