"""The attention variants' backward, for the two-sided proof of their backward tolerances (issue 31).

:class:`VariantBackward` extends the spec-1.1 backward zoo (tests/backward_variants.py) to every
attention variant (docs/spec.md §2a, docs/backward.md): forward and backward in the dtype under test
(float32 accumulation for float16 and bfloat16, like the standard contract), written independently of
the reference and of the adapters.  Its forward steps of the variants (RoPE, softcap, bias and ALiBi,
the window) are the forward zoo's (tests/variants.py: :class:`Variant`, HF's eager way); its backward
is its own:

    dP ─P ⊙ (dP − δ)─► d_scores dS ─Σ over the bias's broadcast axes─► d_bias
                            │  ─(1 − tanh²(raw / c))─► d_raw ─scale·d_raw K_rot─► d_q_rot ─Rᵀ─► d_q_proj
                            │                                  ─scale·Σ_group d_rawᵀ Q_rot─► d_k_rot ─Rᵀ─► d_k_proj
    δ, p_sink ─ −Σ_{b,i} p_sink · δ ─► d_sink_logits

Each switch is a *correct alternative* (FlashAttention-style recompute with sinks and a window, native
accumulation, softcap′ from the stored softcapped score, RoPE turned back by the conjugate, d_bias summed
from float32 d_scores) or a *realistic bug* of the kill list (:data:`KILL_LIST`), named by the backward
stages where it may first be caught.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from mhaspec.spec import Case
from mhaspec.spec.stages import REGISTRY, STAGE
from mhaspec.spec.variants import VARIANTS

from .backward_variants import BackwardVariant
from .variants import Variant, uses_variants

#: The gradients ``loss.backward()`` leaves on the leaves: the inputs', the weights' (``sink_logits``
#: among them) and the additive bias input's.
LEAF_GRADIENTS = frozenset(n for n, st in REGISTRY.items() if st.direction == "backward" and (
    st.gradient_of is not None or n.startswith(("d_w_", "d_b_")) or n in (STAGE.d_sink_logits, STAGE.d_bias)))


@dataclass
class VariantBackward(BackwardVariant):
    """Every variant forward and backward; every switch off = a plain, correct implementation (δ = Σ P ⊙ dP
    from the forward's P, softcap′ = 1 − tanh²(raw / c) recomputed, RoPE turned back as HF's autograd does)."""

    variants: ClassVar[frozenset[str]] = frozenset(VARIANTS)
    name: str = "variant-backward"
    leaf_only: bool = False  # forward: output only; backward: only LEAF_GRADIENTS (what loss.backward() gives)
    # correct alternatives (``flash`` and ``native_accumulation``: BackwardVariant's; flash recomputes P
    # per key block from Q_rot, K_rot, the score modifications and the saved lse, sinks included)
    softcap_from_capped: bool = False  # softcap′ = 1 − (capped / c)² from the stored softcapped score
    rope_conjugate: bool = False  # RoPE turned back as complex pairs × e^(−iθ), the conjugate (complex64)
    d_bias_float32: bool = False  # d_bias summed from the float32 (unrounded) d_scores, rounded once
    # bugs of the variants' backward (KILL_LIST)
    softcap_prime_missing: bool = False  # d_raw = d_scores
    softcap_prime_from_scores: bool = False  # 1 − (scores / c)² from the post-bias, post-ALiBi scores
    d_bias_first_batch: bool = False  # a bias shared by the batch gets batch 0's d_scores, not their sum
    d_bias_every_axis: bool = False  # summed over the batch and the heads whatever the bias broadcasts
    d_sink_sign_flipped: bool = False  # + Σ p_sink · δ
    sink_missing_in_recompute: bool = False  # P = exp(s − lse) with an lse that leaves the sink out
    rope_back_plus_angle: bool = False  # turned back by R (+θ), not Rᵀ
    rope_back_no_offset: bool = False  # turned back at positions 0, 1, … whatever the offsets
    window_ignored_in_recompute: bool = False
    alibi_anchor_in_recompute: bool = False  # the recompute adds + slope · j (HF BLOOM's form)
    rope_not_turned_back: bool = False  # d_q_proj = d_q_rot, d_k_proj = d_k_rot

    def _zoo(self, **fields) -> Variant:
        """The forward zoo's implementation of the variants' steps (RoPE, softcap, bias and ALiBi, window)."""
        return Variant(**fields)

    def _softmax_dtype(self):
        return np.float64 if self.acc == np.float64 else np.float32

    def _recomputes(self) -> bool:
        return (self.flash or self.sink_missing_in_recompute or self.window_ignored_in_recompute
                or self.alibi_anchor_in_recompute)

    def visible(self, case: Case, causal: bool = True, mask: bool = True, window: bool = True) -> np.ndarray:
        allowed = super().visible(case, causal=causal, mask=mask)
        seen = self._zoo()._window(case.config, case.tgt_len, case.src_len) if window else None
        return allowed if seen is None else allowed & seen

    # -- forward --------------------------------------------------------------------------------
    def _forward(self, case: Case) -> dict[str, np.ndarray]:
        self._setup(case)
        cfg, w, r, acc = case.config, case.weights, self.r, self.acc
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        q, k, v = (self.lin(case.inputs.query, w.w_q, w.b_q), self.lin(case.inputs.key, w.w_k, w.b_k),
                   self.lin(case.inputs.value, w.w_v, w.b_v))
        out = {"q_proj": q, "k_proj": k, "v_proj": v}
        zoo = self._zoo()
        if cfg.rope is not None:
            q_pos, k_pos = zoo._positions(cfg, T, S)
            q = out["q_rot"] = zoo._rope(q, H, q_pos, cfg, r, self.dt)  # (B, T, H·D)
            k = out["k_rot"] = zoo._rope(k, G, k_pos, cfg, r, self.dt)  # (B, S, H_kv·D)
        Q = q.reshape(B, T, H, -1).transpose(0, 2, 1, 3)  # (B, H, T, D)
        K = np.repeat(k.reshape(B, S, G, -1).transpose(0, 2, 1, 3), H // G, axis=1)  # (B, H, S, D)
        V = np.repeat(v.reshape(B, S, G, -1).transpose(0, 2, 1, 3), H // G, axis=1)  # (B, H, S, E)
        if self._recomputes():  # FlashAttention: the scores never stored, kept in float32 forward and backward
            raw, capped, s = self._block_scores(case, Q, K, 0, S, zoo)
        else:  # HF's eager way: each step stored in the dtype
            raw = r(self.mm(Q, np.swapaxes(K, -1, -2)).astype(acc) * r(self._scale(case)).astype(acc))  # (B, H, T, S)
            capped = raw if cfg.softcap is None else zoo._softcap(raw, cfg.softcap, r, acc)
            add = zoo._additive(case, acc, r)  # (B|1, H|1, T, S) or None
            s = capped if add is None else r(capped.astype(acc) + r(add).astype(acc))
        p, p_sink, lse, lse_keys = self._softmax(case, s, self.visible(case))
        s = r(s)
        o = self.mm(p, V)  # (B, H, T, E)
        c = o.transpose(0, 2, 1, 3).reshape(B, T, -1)
        out.update(scores=s, attn_weights=p, head_outputs=o, concat=c, output=self.lin(c, w.w_o, w.b_o))
        if uses_variants(case):
            out["lse"] = r(lse[..., 0])
        return {**out, "_Q": Q, "_K": K, "_V": V, "_raw": raw, "_capped": capped, "_lse": lse,
                "_lse_keys": lse_keys, "_p_sink": p_sink}

    def _softmax(self, case: Case, s, allowed) -> tuple[np.ndarray, ...]:
        """(P (B, H, T, S) in the dtype, the sink's share, lse, lse without the sink (B, H, T, 1) in float32
        (float64 in a float64 run)) of the scores s over the visible keys, the sink logit in the
        denominator.  A row that sees no key: P = 0, share 0, lse −inf."""
        sm = self._softmax_dtype()
        x = np.where(allowed, s.astype(sm), -np.inf)
        seen = allowed.any(axis=-1, keepdims=True)  # (B, H, T, 1)
        peak = np.max(x, axis=-1, keepdims=True)
        sink = None
        if case.config.sinks:
            sink = self.r(case.weights.sink_logits).astype(sm)[None, :, None, None]  # (1, H, 1, 1)
            peak = np.maximum(peak, sink)
        peak = np.where(seen, peak, 0).astype(sm)
        e = np.where(allowed, np.exp(x - peak), 0).astype(sm)
        keys = e.sum(axis=-1, keepdims=True)
        e_sink = np.zeros_like(keys) if sink is None else np.where(seen, np.exp(sink - peak), 0).astype(sm)
        total = np.where(seen, keys + e_sink, 1)
        with np.errstate(divide="ignore"):
            lse = np.where(seen, peak + np.log(total), -np.inf).astype(sm)
            lse_keys = np.where(seen, peak + np.log(np.where(seen, keys, 1)), -np.inf).astype(sm)
        return self.r(e / total), e_sink / total, lse, lse_keys

    def run(self, case: Case) -> dict[str, np.ndarray]:
        out = super().run(case)
        return {"output": out["output"]} if self.leaf_only else out

    # -- backward -------------------------------------------------------------------------------
    def _backward(self, case: Case) -> dict[str, np.ndarray]:
        f = self._forward(case)
        cfg, r, acc = case.config, self.r, self.acc
        V = f["_V"]
        dy, dc, dO, dP = self._through_output(case, V)
        if self._recomputes():  # FlashAttention: P from the saved lse, δ = rowsum(dO ⊙ O)
            P, lse = self._recompute(case, f)
            delta = np.sum(dO.astype(acc) * f["head_outputs"].astype(acc), axis=-1, keepdims=True)
            p_sink = None
            if cfg.sinks:
                sink = r(case.weights.sink_logits).astype(lse.dtype)[None, :, None, None]
                p_sink = np.where(np.isfinite(lse), np.exp(sink - np.where(np.isfinite(lse), lse, 0)), 0)
        else:
            P, p_sink = f["attn_weights"], f["_p_sink"]
            delta = np.sum(P.astype(acc) * dP.astype(acc), axis=-1, keepdims=True)  # (B, H, T, 1)
        dS_acc = P.astype(acc) * (dP.astype(acc) - delta)  # (B, H, T, S), not yet rounded
        dS = r(dS_acc)
        out = {"d_concat": dc, "d_head_outputs": dO, "d_attn_weights": dP, "d_scores": dS}
        if cfg.sinks:
            out["d_sink_logits"] = self._d_sink_logits(p_sink, delta)
        if case.inputs.bias is not None:
            out["d_bias"] = self._d_bias(case.inputs.bias.shape, dS_acc if self.d_bias_float32 else dS)
        d_raw = self._through_softcap(case, f, dS)
        dq, dk, dv = self._qkv_grads(case, d_raw, P, dO, f["_Q"], f["_K"])
        if cfg.rope is not None:
            out["d_q_rot"], out["d_k_rot"] = dq, dk
            dq, dk = self._turn_back(case, dq, dk)
        out.update(d_q_proj=dq, d_k_proj=dk, d_v_proj=dv)
        out = self._through_projections(case, f["concat"], dy, out)
        return {k: v for k, v in out.items() if k in LEAF_GRADIENTS} if self.leaf_only else out

    def _block_scores(self, case: Case, Q, K, j0: int, j1: int, zoo: Variant) -> tuple[np.ndarray, ...]:
        """(raw, capped, scores) (B, H, T, j1 − j0) of keys j0 … j1 − 1 in float32 (float64 in a float64 run),
        never rounded to the dtype: scale·Q_rot K_rotᵀ, softcap, bias and ALiBi (``zoo._additive``)."""
        sm, cap = self._softmax_dtype(), case.config.softcap
        raw = (Q.astype(sm) @ np.swapaxes(K[:, :, j0:j1].astype(sm), -1, -2)) * sm(self.r(self._scale(case)))
        capped = raw if cap is None else sm(cap) * np.tanh(raw / sm(cap))
        add = zoo._additive(case, sm, self.r, j0, j1)
        return raw, capped, capped if add is None else capped + add

    def _recompute(self, case: Case, f) -> tuple[np.ndarray, np.ndarray]:
        """(P (B, H, T, S) in the dtype, the lse (B, H, T, 1) it used): per block of 4 keys, the scores
        recomputed from Q_rot, K_rot as the forward took them (:meth:`_block_scores`), then P = exp(s − lse)
        at the visible keys, the forward's lse (the sink in it) saved in float32."""
        S = case.src_len
        zoo = self._zoo(alibi_column_anchor=self.alibi_anchor_in_recompute)
        allowed = self.visible(case, window=not self.window_ignored_in_recompute)
        lse = f["_lse_keys"] if self.sink_missing_in_recompute else f["_lse"]  # (B, H, T, 1)
        seen = np.isfinite(lse)
        P = np.zeros(allowed.shape, dtype=lse.dtype)
        for j0 in range(0, S, 4):
            j1 = min(S, j0 + 4)
            sb = self._block_scores(case, f["_Q"], f["_K"], j0, j1, zoo)[2]
            with np.errstate(over="ignore"):
                P[..., j0:j1] = np.where(allowed[..., j0:j1] & seen, np.exp(sb - np.where(seen, lse, 0)), 0)
        return self.r(P), lse

    def _d_sink_logits(self, p_sink, delta) -> np.ndarray:
        """−Σ_{b,i} p_sink · δ per head.   p_sink, delta (B, H, T, 1) -> (H,)."""
        sign = 1 if self.d_sink_sign_flipped else -1
        return self.r(sign * np.sum(p_sink.astype(self.acc) * delta.astype(self.acc), axis=(0, 2, 3)))

    def _d_bias(self, shape: tuple[int, ...], dS) -> np.ndarray:
        """dS (B, H, T, S) summed over the axes the bias (B|1, H|1, T, S) broadcasts, in the accumulator."""
        wide = self.d_bias_float32 and self.acc not in (np.float32, np.float64)  # native: the sum in float32
        d = dS.astype(np.float32 if wide else self.acc)
        if self.d_bias_every_axis:
            return self.r(np.broadcast_to(d.sum(axis=(0, 1), keepdims=True), shape))
        if shape[0] == 1 and self.d_bias_first_batch:
            d = d[:1]
        axes = tuple(a for a in (0, 1) if shape[a] == 1)
        return self.r(d.sum(axis=axes, keepdims=True))

    def _through_softcap(self, case: Case, f, dS) -> np.ndarray:
        """d_raw = dS ⊙ (1 − tanh²(raw / c)) (B, H, T, S); dS without softcap."""
        cap = case.config.softcap
        if cap is None or self.softcap_prime_missing:
            return dS
        acc = self.acc
        if self.softcap_from_capped:  # tanh(raw / c) = capped / c, as kernels that keep the capped score
            t = f["_capped"].astype(acc) / acc(cap)
        elif self.softcap_prime_from_scores:
            t = f["scores"].astype(acc) / acc(cap)
        else:
            t = np.tanh(f["_raw"].astype(acc) / acc(cap))
        return self.r(dS.astype(acc) * (1 - t * t))

    def _turn_back(self, case: Case, d_q_rot, d_k_rot) -> tuple[np.ndarray, np.ndarray]:
        """(d_q_proj, d_k_proj) = Rᵀ d_q_rot, Rᵀ d_k_rot: each pair turned by −θ (the angle of its
        position) with the forward's RoPE at the negated positions."""
        if self.rope_not_turned_back:
            return d_q_rot, d_k_rot
        cfg, T, S = case.config, case.tgt_len, case.src_len
        zoo = self._zoo(rope_complex=self.rope_conjugate)
        q_pos, k_pos = zoo._positions(cfg, T, S)
        if self.rope_back_no_offset:
            q_pos, k_pos = np.arange(T), np.arange(S)
        sign = 1 if self.rope_back_plus_angle else -1
        return (zoo._rope(d_q_rot, cfg.H, sign * q_pos, cfg, self.r, self.dt),
                zoo._rope(d_k_rot, cfg.H_kv, sign * k_pos, cfg, self.r, self.dt))


#: The switches of :class:`VariantBackward` that are bugs of the variants' backward (KILL_LIST).
BUG_SWITCHES = ("softcap_prime_missing", "softcap_prime_from_scores", "d_bias_first_batch", "d_bias_every_axis",
                "d_sink_sign_flipped", "sink_missing_in_recompute", "rope_back_plus_angle", "rope_back_no_offset",
                "window_ignored_in_recompute", "alibi_anchor_in_recompute", "rope_not_turned_back")


def correct_twin(v: VariantBackward) -> VariantBackward:
    """``v`` with its bugs switched off: the same arithmetic, correct (a FlashAttention-style bug keeps its
    recompute: its twin is CORRECT's flash_sinks_window)."""
    return replace(v, name=v.name + "+fixed", flash=v.flash or v._recomputes(), **{f: False for f in BUG_SWITCHES})


def leaf_only(v: VariantBackward) -> VariantBackward:
    """The same implementation seen as ``loss.backward()`` shows it: output and the leaves' gradients."""
    return replace(v, name=v.name + "+leaf_only", leaf_only=True)


#: name -> (adapter, the precision contract it keeps: docs/tolerances.md)
CORRECT = {
    "plain": (VariantBackward(name="variant_plain"), "standard"),
    # FlashAttention-2/4 with sinks and a window: P per key block from the saved lse, δ = rowsum(dO ⊙ O)
    "flash_sinks_window": (VariantBackward(name="variant_flash", flash=True), "standard"),
    "softcap_from_capped": (VariantBackward(name="variant_softcap_capped", softcap_from_capped=True), "standard"),
    "rope_conjugate": (VariantBackward(name="variant_rope_conj", rope_conjugate=True), "standard"),
    "d_bias_float32": (VariantBackward(name="variant_d_bias_f32", d_bias_float32=True), "standard"),
    "flash_kernel": (VariantBackward(name="variant_flash_kernel", flash=True, softcap_from_capped=True,
                                     rope_conjugate=True, d_bias_float32=True), "standard"),
    # every partial sum rounded to float16/bfloat16: correct, under the worst-case contract (as spec 1.1's)
    "native_accumulation": (VariantBackward(name="variant_native", native_accumulation=True), "worst-case"),
    "flash_native": (VariantBackward(name="variant_flash_native", flash=True, native_accumulation=True),
                     "worst-case"),
}

#: The kill list of the variants' backward: bug name -> (adapter, the backward stages where it may first be
#: caught, in judging order).  It must first be caught at the first of them that it changes in float64
#: (tests/test_variant_backward_proofs.py: expected_backward_stages).  The recompute bugs are
#: FlashAttention-style kernels (flash=True): P recomputed in the backward.
KILL_LIST = {
    "softcap_prime_missing": (VariantBackward(name="softcap_prime_missing", softcap_prime_missing=True),
                              (STAGE.d_q_rot, STAGE.d_q_proj)),
    "softcap_prime_from_post_bias_scores": (
        VariantBackward(name="softcap_prime_from_scores", softcap_prime_from_scores=True),
        (STAGE.d_q_rot, STAGE.d_q_proj)),
    "d_bias_first_batch_only": (VariantBackward(name="d_bias_batch0", d_bias_first_batch=True), (STAGE.d_bias,)),
    "d_bias_summed_over_every_axis": (VariantBackward(name="d_bias_every_axis", d_bias_every_axis=True),
                                      (STAGE.d_bias,)),
    "d_sink_logits_sign_flipped": (VariantBackward(name="d_sink_sign", d_sink_sign_flipped=True),
                                   (STAGE.d_sink_logits,)),
    "sink_missing_in_recompute": (VariantBackward(name="recompute_no_sink", flash=True,
                                                  sink_missing_in_recompute=True), (STAGE.d_scores,)),
    "rope_back_rotation_plus_angle": (VariantBackward(name="rope_back_plus", rope_back_plus_angle=True),
                                      (STAGE.d_q_proj, STAGE.d_k_proj)),
    "rope_back_rotation_offset_ignored": (VariantBackward(name="rope_back_no_offset", rope_back_no_offset=True),
                                          (STAGE.d_q_proj, STAGE.d_k_proj)),
    "rope_not_turned_back": (VariantBackward(name="rope_not_turned_back", rope_not_turned_back=True),
                             (STAGE.d_q_proj, STAGE.d_k_proj)),
    "window_ignored_in_recompute": (VariantBackward(name="recompute_no_window", flash=True,
                                                    window_ignored_in_recompute=True), (STAGE.d_scores,)),
    "alibi_anchor_wrong_in_recompute": (VariantBackward(name="recompute_alibi_anchor", flash=True,
                                                        alibi_anchor_in_recompute=True), (STAGE.d_scores,)),
}
