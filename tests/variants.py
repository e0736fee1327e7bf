"""MHA implementations for the two-sided proof of the tolerance model.

One small numpy implementation, written independently of the reference and
of the numpy adapter, whose steps can each be switched to a *correct
alternative* (einsum vs per-head loop, pre-scaled query, fused QKV, fp16
accumulation, finfo.min fill) or to a *realistic bug*.  Each bug is named by
the stage where it must first be caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import ml_dtypes
import numpy as np

from mhaspec.spec import Case
from mhaspec.spec.variants import VARIANTS, alibi_slope_values

DT = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to TF32's 10 explicit mantissa bits, to nearest even (as float32)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    half = np.uint32(0x0FFF) + ((bits >> np.uint32(13)) & np.uint32(1))  # 2^12 - 1, +1 when the kept bit is odd
    rounded = np.where(np.isfinite(x), (bits + half) & np.uint32(0xFFFFE000), bits)
    return rounded.astype(np.uint32).view(np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (to nearest even), as float32."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def uses_variants(case: Case) -> bool:
    """Whether ``case`` uses an attention variant (docs/spec.md §2a): only then is ``lse`` returned
    (a spec-1.1 fixture has no golden of it)."""
    return case.config.has_variants or case.inputs.bias is not None


def reduced_product(op, a: np.ndarray, b: np.ndarray, how: str) -> np.ndarray:
    """``op(a, b)`` (a matmul or an einsum over two float32 operands) as a reduced-precision float32
    matmul unit computes it: ``"tf32"``, both operands rounded to TF32, float32 accumulation;
    ``"bf16x3"``, each operand split a = hi + lo (hi = bf16(a), lo = bf16(a - hi)) and
    hi·hi + hi·lo + lo·hi summed in float32 (the lo·lo term left out)."""
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    if how == "tf32":
        return op(tf32(a), tf32(b))
    if how == "bf16x3":
        a_hi, b_hi = bf16(a), bf16(b)
        a_lo, b_lo = bf16(a - a_hi), bf16(b - b_hi)
        return op(a_hi, b_hi) + op(a_hi, b_lo) + op(a_lo, b_hi)
    raise ValueError(f"unknown reduced-precision matmul {how!r}")


@dataclass(frozen=True)
class Variant:
    """An adapter; every field off = a correct, straightforward implementation."""

    variants: ClassVar[frozenset[str]] = frozenset(VARIANTS)  # it computes every attention variant
    name: str = "variant"
    # correct alternatives
    per_head_loop: bool = False  # explicit loop over heads instead of einsum
    prescale_query: bool = False  # (scale · Q) Kᵀ instead of scale · (Q Kᵀ)
    fused_qkv: bool = False  # one matmul with [w_q | w_k | w_v] for self-attention
    native_accumulation: bool = False  # every partial sum rounded to the dtype under test
    finfo_fill: bool = False  # masked scores filled with finfo.min, fully masked rows zeroed afterwards
    tiled_online_softmax: bool = False  # FlashAttention-style: blocks of 16 keys, float32 running max/sum/acc
    block: int = 16  # the key block of tiled_online_softmax
    weights_from_lse: bool = False  # tiled_online_softmax also returns its scores and P = exp(s - LSE), as
    #                                 FlashAttention's backward recomputes it; head_outputs stay the accumulator's
    log_sum_exp: bool = False  # p = exp(s - logsumexp(s)) instead of e / Σe
    fused_float32: bool = False  # nothing stored in the dtype until the end: every stage kept in the accumulator
    scale_float32: bool = False  # a known deviation, not a bug: the scale taken in float32 whatever the dtype
    # bugs
    no_scale: bool = False
    scale_by_d_model: bool = False
    softmax_axis_t: bool = False
    split_heads_wrong: bool = False
    merge_without_transpose: bool = False
    w_o_transposed: bool = False
    causal_off_by_one: bool = False
    causal_wrong_alignment: bool = False
    mask_inverted: bool = False
    gqa_modulo: bool = False
    no_max_subtraction: bool = False
    compute_dtype: str | None = None  # compute in this dtype whatever was asked
    drop_output_bias: bool = False
    uniform_masked_rows: bool = False
    nan_masked_rows: bool = False
    mask_after_softmax: bool = False  # softmax over every key, then masked weights zeroed (not renormalised)
    unnormalised_pv: bool = False  # head outputs from exp(s - max) @ V, never divided by the sum
    stale_accumulator: bool = False  # online softmax: the P·V accumulator not rescaled when the running max grows
    dropout_left_on: bool = False  # 10 % of the weights dropped, the rest scaled by 1/0.9
    output_only: bool = False  # return only "output", as fused kernels do
    # subtle bugs (SUBTLE_BUGS)
    scale_factor: float = 1.0  # the scale multiplied by this (1 + 1e-3: a constant typed with too few digits)
    scale_bfloat16: bool = False  # the scale rounded to bfloat16 whatever the dtype
    drop_last_key: bool = False  # the last visible key of every query row masked out (an off-by-one in a kernel's loop)
    matmul: str = ""  # float32 runs: every matmul "tf32" or "bf16x3" (reduced_product)
    # -- the attention variants (docs/spec.md §2a).  By default as HF's eager attention computes them:
    #    RoPE by rotate_half / rotate_every_two with cos and sin from float32 angles, softcap as
    #    (s / c) → tanh → · c, bias and ALiBi as one additive (H, T, S) tensor, each step rounded to
    #    the dtype; sinks as an extra logit column (gpt-oss) dropped after the softmax.
    # correct alternatives
    rope_complex: bool = False  # RoPE as Meta's view_as_complex: pairs as complex numbers × e^(iθ), in float32
    alibi_score_mod: bool = False  # bias and ALiBi added element by element from (b, h, q_idx, kv_idx) (FlexAttention)
    softcap_reciprocal: bool = False  # tanh(s · (1/c)) · c instead of (s / c) → tanh → · c
    # bugs of the variants (KILL_LIST)
    window_left_off_by_one: bool = False  # the left window counts the diagonal: one key fewer on the left
    window_right_off_by_one: bool = False  # one key more on the right
    window_top_left: bool = False  # the window aligned top-left whatever causal_alignment says
    softcap_missing: bool = False
    softcap_after_mask: bool = False  # masked scores set to −inf, then capped: −c, not −inf
    softcap_before_scale: bool = False  # c · tanh(QKᵀ / c) · scale
    alibi_wrong_sign: bool = False  # + slope · |i + off − j|
    alibi_column_anchor: bool = False  # + slope · j (HF BLOOM's form) instead of − slope · |i + off − j|
    sink_missing: bool = False  # no sink in the denominator
    sink_with_value: bool = False  # the sink a key with a value (the first key's): its share adds to P·V
    rope_style_swapped: bool = False  # "half" computed as "interleaved" and the other way round
    rope_no_offset: bool = False  # positions from 0: query_offset and key_offset ignored
    rope_full_dim: bool = False  # rotary_dim ignored: every feature of D_k turns
    lse_base2: bool = False  # the LSE returned in base 2 (the Triton tutorial's, FlashInfer's)
    expose_lse: bool = True  # return lse in a variant case (spec1_only: not, for the spec-1.1 bugs)

    def run(self, case: Case) -> dict[str, np.ndarray]:
        cfg = case.config
        dt = DT[self.compute_dtype or case.dtype]
        low = dt in (np.float16, ml_dtypes.bfloat16)
        acc = dt if (self.native_accumulation or not low) else np.float32
        out_dt = DT[case.dtype]

        def product(op, a, b):  # every matmul of the run; a reduced-precision unit only in float32
            return reduced_product(op, a, b, self.matmul) if self.matmul and dt == np.float32 else op(a, b)

        def r(x):
            if self.fused_float32:
                return np.asarray(x).astype(acc)
            return np.asarray(x).astype(dt)

        def mm(a, b):
            if self.native_accumulation:  # every partial sum rounded to the dtype: the worst correct order
                a, b = r(a), r(b)
                total = r(np.zeros(np.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1]))))
                for i in range(a.shape[-1]):
                    term = r(a[..., :, i : i + 1].astype(np.float64) * b[..., i : i + 1, :].astype(np.float64))
                    total = r(total.astype(np.float64) + term.astype(np.float64))
                return total
            return r(product(np.matmul, r(a).astype(acc), r(b).astype(acc)))

        w = case.weights
        B, T, S, H, G = case.batch, case.tgt_len, case.src_len, cfg.H, cfg.H_kv
        Dk, Dv = cfg.D_k, cfg.D_v

        def bias(x, b):
            return x if b is None else r(x.astype(acc) + r(b).astype(acc))

        if self.fused_qkv and case.self_attention:
            w_qkv = np.concatenate([w.w_q, w.w_k, w.w_v], axis=1)
            qkv = mm(case.inputs.query, w_qkv)
            q, k, v = np.split(qkv, [H * Dk, H * Dk + G * Dk], axis=-1)
            q, k, v = bias(q, w.b_q), bias(k, w.b_k), bias(v, w.b_v)
        else:
            q = bias(mm(case.inputs.query, w.w_q), w.b_q)
            k = bias(mm(case.inputs.key, w.w_k), w.b_k)
            v = bias(mm(case.inputs.value, w.w_v), w.b_v)
        q_proj, k_proj = q, k

        def heads(x, n, d):
            if self.split_heads_wrong:  # (B, L, D, n) instead of (B, L, n, D)
                return x.reshape(B, -1, d, n).transpose(0, 3, 1, 2)
            return x.reshape(B, -1, n, d).transpose(0, 2, 1, 3)  # (B, n, L, d)

        rotated = {}
        if cfg.rope is not None:
            q_pos, k_pos = self._positions(cfg, T, S)
            q = rotated["q_rot"] = self._rope(q, H, q_pos, cfg, r, dt)
            k = rotated["k_rot"] = self._rope(k, G, k_pos, cfg, r, dt)
        Q, K, V = heads(q, H, Dk), heads(k, G, Dk), heads(v, G, Dv)
        kv_of = [(h % G) if self.gqa_modulo else h // (H // G) for h in range(H)]
        K, V = K[:, kv_of], V[:, kv_of]

        scale = cfg.scale
        if self.scale_float32:  # as Keras and the ONNX exporters do in float64 (declared there)
            scale = float(np.float32(scale))
        if self.no_scale:
            scale = 1.0
        if self.scale_by_d_model:
            scale = 1.0 / np.sqrt(cfg.d_model)
        scale = scale * self.scale_factor
        if self.scale_bfloat16:
            scale = float(bf16(np.float32(scale)))
        if self.prescale_query:
            s = mm(r(Q.astype(acc) * r(scale).astype(acc)), np.swapaxes(K, -1, -2))
        elif self.per_head_loop:
            s = np.stack([mm(Q[:, h], np.swapaxes(K[:, h], -1, -2)) for h in range(H)], axis=1)
            s = r(s.astype(acc) * r(scale).astype(acc))
        elif self.native_accumulation:
            s = r(mm(Q, np.swapaxes(K, -1, -2)).astype(acc) * r(scale).astype(acc))
        else:
            s = r(product(lambda a, b: np.einsum("bhtd,bhsd->bhts", a, b), Q.astype(acc), K.astype(acc)))
            s = r(s.astype(acc) * r(scale).astype(acc))
        s = self._score_mods(s, case, scale, r, acc)

        allowed = np.ones((B, H, T, S), dtype=bool)
        if cfg.causal:
            shift = 0 if cfg.causal_alignment == "top_left" else S - T
            if self.causal_wrong_alignment:
                shift = S - T if shift == 0 else 0
            i, j = np.arange(T)[:, None], np.arange(S)[None, :]
            allowed &= (j < i + shift) if self.causal_off_by_one else (j <= i + shift)
        window = self._window(cfg, T, S)
        if window is not None:
            allowed &= window
        if case.inputs.mask is not None:
            m = np.broadcast_to(case.inputs.mask, allowed.shape)
            allowed &= ~m if self.mask_inverted else m
        if self.drop_last_key:
            last = S - 1 - np.argmax(allowed[..., ::-1], axis=-1)  # (B, H, T): each row's last visible key
            allowed &= ~((np.arange(S) == last[..., None]) & allowed.any(axis=-1, keepdims=True))

        sinks = None
        if cfg.sinks and not self.sink_missing:
            sinks = r(case.weights.sink_logits).astype(acc)[None, :, None, None]  # (1, H, 1, 1)
        if self.tiled_online_softmax:
            s, p, o, lse = self._tiled(Q, K, V, allowed, scale, r, acc, lambda sb, j0, j1: self._block_mods(
                sb, case, scale, acc, j0, j1), sinks)
        else:
            capped_after_mask = self.softcap_after_mask and cfg.softcap is not None
            if capped_after_mask:  # the bug: masked scores −inf, then capped (to −c); no mask after
                s = self._softcap(np.where(allowed, s.astype(acc), -np.inf), cfg.softcap, r, acc)
            p, o, lse = self._softmax_pv(s, V, allowed, acc, r, mm, S, product, sinks, premasked=capped_after_mask)
        if self.merge_without_transpose:
            c = o.reshape(B, T, H * Dv)
        else:
            c = o.transpose(0, 2, 1, 3).reshape(B, T, H * Dv)
        w_o = w.w_o.T if self.w_o_transposed else w.w_o
        y = mm(c, w_o)
        if not self.drop_output_bias:
            y = bias(y, w.b_o)
        stages = {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v, **rotated, "scores": s, "attn_weights": p,
                  "head_outputs": o, "concat": c, "output": y}
        if self.expose_lse and uses_variants(case) and lse is not None:  # spec-1.1 cases: no lse, as before
            stages["lse"] = r(lse / np.log(2) if self.lse_base2 else lse)
        if self.output_only:
            stages = {"output": y}
        return {name: np.asarray(val).astype(out_dt) for name, val in stages.items() if val is not None}

    # -- the attention variants -----------------------------------------------------------------

    def _positions(self, cfg, T: int, S: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE positions (T,), (S,): query_offset + i, key_offset + j (from 0 with rope_no_offset)."""
        q0, k0 = (0, 0) if self.rope_no_offset else (cfg.rope.query_offset, cfg.rope.key_offset)
        return q0 + np.arange(T), k0 + np.arange(S)

    def _rope(self, x, n: int, positions, cfg, r, dt):
        """x (B, L, n·D) turned by RoPE at ``positions`` (L,), as HF's ``apply_rotary_pos_emb``
        (rotate_half; rotate_every_two for "interleaved"), each product and sum rounded to the dtype;
        or, with rope_complex, as Meta's ``apply_rotary_emb`` (the pairs as complex numbers × e^(iθ),
        in complex64, rounded once).  The angles in float32 (float64 in a float64 run)."""
        spec = cfg.rope
        B, L, F = x.shape
        D = F // n
        rd = D if self.rope_full_dim else spec.rotary_dim
        style = spec.style
        if self.rope_style_swapped:
            style = "interleaved" if style == "half" else "half"
        angle_dt = np.float64 if dt == np.float64 else np.float32
        exponents = np.arange(0, rd, 2).astype(angle_dt) / angle_dt(rd)  # (rd/2,): HF's arange(0, dim, 2) / dim
        inv_freq = (1.0 / (angle_dt(spec.theta) ** exponents)).astype(angle_dt)
        freqs = positions.astype(angle_dt)[:, None] * inv_freq[None, :]  # (L, rd/2)
        h = np.asarray(x).reshape(B, L, n, D)
        xr, rest = h[..., :rd], h[..., rd:]
        if self.rope_complex:
            pairs = (xr[..., : rd // 2], xr[..., rd // 2 :]) if style == "half" else (xr[..., 0::2], xr[..., 1::2])
            cis = (np.cos(freqs) + 1j * np.sin(freqs)).astype(np.complex128 if angle_dt == np.float64 else np.complex64)
            z = (pairs[0].astype(angle_dt) + 1j * pairs[1].astype(angle_dt)).astype(cis.dtype) * cis[None, :, None, :]
            if style == "half":
                turned = np.concatenate([z.real, z.imag], axis=-1)
            else:
                turned = np.stack([z.real, z.imag], axis=-1).reshape(xr.shape)
            turned = r(turned)
        else:
            if style == "half":
                emb = np.concatenate([freqs, freqs], axis=-1)  # (L, rd)
                rotated = np.concatenate([-xr[..., rd // 2 :], xr[..., : rd // 2]], axis=-1)  # rotate_half
            else:
                emb = np.repeat(freqs, 2, axis=-1)  # (L, rd): repeat_interleave
                rotated = np.stack([-xr[..., 1::2], xr[..., 0::2]], axis=-1).reshape(xr.shape)  # rotate_every_two
            cos, sin = r(np.cos(emb))[None, :, None, :], r(np.sin(emb))[None, :, None, :]
            turned = r(r(xr * cos) + r(rotated * sin))
        return np.concatenate([turned, r(rest)], axis=-1).reshape(B, L, F)

    def _softcap(self, s, cap: float, r, acc):
        """cap · tanh(s / cap): (s / c) → tanh → · c, each rounded to the dtype (HF's Gemma 2 eager),
        or tanh(s · (1/c)) · c rounded once (softcap_reciprocal)."""
        c = acc(cap)
        if self.softcap_reciprocal:
            return r(np.tanh(s.astype(acc) * acc(1.0 / cap)) * c)
        return r(r(np.tanh(r(s.astype(acc) / c).astype(acc))).astype(acc) * c)

    def _additive(self, case, acc, r, j0: int = 0, j1: int | None = None):
        """(B|1, H|1, T, j1 − j0) in the accumulator: the bias input (stored in the dtype) and the ALiBi
        term of keys j0 … j1 − 1, or None without either."""
        cfg, T, S = case.config, case.tgt_len, case.src_len
        j1 = S if j1 is None else j1
        total = None
        if case.inputs.bias is not None:
            total = r(case.inputs.bias[..., j0:j1]).astype(acc)
        slopes = alibi_slope_values(cfg)
        if slopes is not None:
            off = 0 if cfg.causal_alignment == "top_left" else S - T
            i, j = np.arange(T)[:, None], np.arange(j0, j1)[None, :]
            slope = slopes.astype(acc)[:, None, None]  # (H, 1, 1)
            if self.alibi_column_anchor:
                term = slope * j.astype(acc)[None]
            else:
                term = (1 if self.alibi_wrong_sign else -1) * slope * np.abs(i + off - j).astype(acc)[None]
            total = term[None] if total is None else total + term[None]
        return total

    def _score_mods(self, s, case, scale, r, acc):
        """The scores s (B, H, T, S), scaled, with softcap, bias and ALiBi (docs/spec.md order)."""
        cfg = case.config
        if self.alibi_score_mod:
            return self._score_mod(s, case, r, acc)
        if cfg.softcap is not None and not (self.softcap_missing or self.softcap_after_mask):
            if self.softcap_before_scale:
                unscaled = r(s.astype(acc) / acc(scale))
                s = r(self._softcap(unscaled, cfg.softcap, r, acc).astype(acc) * acc(scale))
            else:
                s = self._softcap(s, cfg.softcap, r, acc)
        add = self._additive(case, acc, r)
        return s if add is None else r(s.astype(acc) + r(add).astype(acc))

    def _score_mod(self, s, case, r, acc):
        """FlexAttention's way: one ``score_mod(score, b, h, q_idx, kv_idx)`` on every element, in the
        accumulator, rounded once: softcap, then bias[b, h, q, kv], then − slope[h]·|q + off − kv|."""
        cfg = case.config
        B, H, T, S = s.shape
        b, h, q_idx, kv_idx = np.ogrid[:B, :H, :T, :S]
        bias = None if case.inputs.bias is None else r(case.inputs.bias).astype(acc)
        slopes = alibi_slope_values(cfg)
        off = 0 if cfg.causal_alignment == "top_left" else S - T

        def score_mod(score, b, h, q_idx, kv_idx):
            if cfg.softcap is not None:
                score = acc(cfg.softcap) * np.tanh(score / acc(cfg.softcap))
            if bias is not None:
                score = score + bias[b % bias.shape[0], h % bias.shape[1], q_idx, kv_idx]
            if slopes is not None:
                score = score - slopes.astype(acc)[h] * np.abs(q_idx + off - kv_idx).astype(acc)
            return score

        return r(score_mod(s.astype(acc), b, h, q_idx, kv_idx))

    def _block_mods(self, sb, case, scale, acc, j0: int, j1: int):
        """A block of keys j0 … j1 − 1 of the online softmax: its scores sb (B, H, T, j1 − j0), kept in
        the accumulator, with softcap, bias and ALiBi (FlashAttention's score modifications)."""
        cfg = case.config
        if cfg.softcap is not None:
            sb = acc(cfg.softcap) * np.tanh(sb / acc(cfg.softcap))
        add = self._additive(case, acc, lambda x: np.asarray(x).astype(DT[case.dtype]), j0, j1)
        return sb if add is None else sb + add

    def _window(self, cfg, T: int, S: int):
        """(T, S) bool of the sliding window, or None: i + off − left ≤ j ≤ i + off + right."""
        left, right = cfg.window_left, cfg.window_right
        if left is None and right is None:
            return None
        off = 0 if (cfg.causal_alignment == "top_left" or self.window_top_left) else S - T
        d = np.arange(S)[None, :] - (np.arange(T)[:, None] + off)
        seen = np.ones((T, S), dtype=bool)
        if left is not None:
            seen &= (d > -left) if self.window_left_off_by_one else (d >= -left)
        if right is not None:
            seen &= (d <= right + 1) if self.window_right_off_by_one else (d <= right)
        return seen

    def _tiled(self, Q, K, V, allowed, scale, r, acc, mod=None, sinks=None):
        """FlashAttention-2's forward: blocks of ``block`` keys, running max m, sum l and accumulator
        in the accumulator type; each block's unnormalised weights rounded to the dtype before P·V
        (as FlashAttention does); one division at the end.  ``mod(sb, j0, j1)`` applies the softcap,
        bias and ALiBi to a block's scores; the sink logits (1, H, 1, 1) start the running max and
        sum (m = sink, l = 1: FlashAttention 4's sinks).  Returns (scores, weights, head outputs, lse);
        the scores and weights only with ``weights_from_lse``: then the blocks' scores, and the
        weights recomputed from the final log-sum-exp, P = exp(s − LSE), as FlashAttention's
        backward does: not the weights that made the head outputs."""
        B, H, T, _ = Q.shape
        S, E = K.shape[2], V.shape[-1]
        if sinks is None:
            m = np.full((B, H, T, 1), -np.inf, dtype=acc)
            l = np.zeros((B, H, T, 1), dtype=acc)
        else:
            m = np.broadcast_to(sinks, (B, H, T, 1)).astype(acc)
            l = np.ones((B, H, T, 1), dtype=acc)
        o = np.zeros((B, H, T, E), dtype=acc)
        blocks = []
        for j0 in range(0, S, self.block):
            j1 = min(j0 + self.block, S)
            kb, vb = K[:, :, j0:j1].astype(acc), V[:, :, j0:j1].astype(acc)
            sb = (Q.astype(acc) @ np.swapaxes(kb, -1, -2)) * acc(scale)
            if mod is not None:
                sb = mod(sb, j0, j1).astype(acc)
            blocks.append(sb)
            seen = allowed[..., j0:j1]
            sb = np.where(seen, sb, -np.inf)
            m_new = np.maximum(m, np.max(sb, axis=-1, keepdims=True))
            m_safe = np.where(np.isfinite(m_new), m_new, 0).astype(acc)
            alpha = np.where(np.isfinite(m), np.exp(m - m_safe), 0).astype(acc)
            pb = np.where(seen, np.exp(sb - m_safe), 0).astype(acc)
            l = alpha * l + np.sum(pb, axis=-1, keepdims=True)
            o = (o if self.stale_accumulator else alpha * o) + r(pb).astype(acc) @ vb
            m = m_new
        o = np.where(l > 0, o / np.where(l > 0, l, 1), 0).astype(acc)
        any_key = allowed.any(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            lse = np.where(any_key & (l > 0), m + np.log(np.where(l > 0, l, 1)), -np.inf).astype(acc)  # (B, H, T, 1)
        if not self.weights_from_lse:
            return None, None, r(o), lse[..., 0]
        s = np.concatenate(blocks, axis=-1)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            p = np.where(allowed, np.exp(s - np.where(any_key, lse, np.inf)), 0).astype(acc)
        return r(s), r(p), r(o), lse[..., 0]

    def _softmax_pv(self, s, V, allowed, acc, r, mm, S, product=lambda op, a, b: op(a, b), sinks=None,
                    premasked=False):
        """(weights, head outputs, lse (B, H, T) or None) of the scores s; the sink logits (1, H, 1, 1)
        as one more logit column (gpt-oss's reference), whose weight is dropped after the softmax.
        ``premasked``: s had its mask applied already (softcap_after_mask): nothing masked again."""
        x = s.astype(acc)
        if self.mask_after_softmax:
            pass  # the bug: every key enters the softmax; masked weights are zeroed afterwards
        elif self.finfo_fill:
            x = np.where(allowed, x, np.finfo(np.float32 if acc != np.float64 else np.float64).min)
        elif not premasked:
            x = np.where(allowed, x, -np.inf)
        axis = -2 if self.softmax_axis_t else -1
        keep = allowed if not self.mask_after_softmax else np.ones_like(allowed)
        x = np.where(keep | self.finfo_fill, x, -np.inf) if self.mask_after_softmax else x
        if sinks is not None:
            column = np.broadcast_to(sinks, x.shape[:-1] + (1,)).astype(acc)
            x = np.concatenate([x, column], axis=-1)  # (B, H, T, S + 1)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            peak = np.zeros_like(x[..., :1])
            if self.no_max_subtraction:
                e = np.exp(x.astype(acc))
            else:
                peak = np.max(x, axis=axis, keepdims=True)
                peak = np.where(np.isfinite(peak), peak, 0)
                e = np.exp(x - peak)
            total = np.sum(e, axis=axis, keepdims=True)
            if self.log_sum_exp:
                p = np.exp(x - (peak + np.log(total)).astype(acc))
            else:
                p = e / total
            lse = None if axis != -1 else (peak + np.log(total))[..., 0]
        p_sink = None
        if sinks is not None:
            p, p_sink, e = p[..., :S], p[..., S:], e[..., :S]
        none_visible = ~allowed.any(axis=-1, keepdims=True)
        if lse is not None:
            lse = np.where(none_visible[..., 0], -np.inf, lse).astype(acc)
        if self.uniform_masked_rows:
            p = np.where(none_visible, 1.0 / S, p)
        elif self.nan_masked_rows:
            p = np.where(none_visible, np.nan, p)
        elif not premasked:
            p = np.where(none_visible | ~allowed, 0.0, p)
        if self.dropout_left_on:
            keep_bits = np.random.default_rng(0).random(p.shape) >= 0.1
            p = np.where(keep_bits, p / 0.9, 0.0)
        p = r(p)
        weights = p
        if self.unnormalised_pv:
            weights = r(np.where(none_visible | ~allowed, 0.0, e))

        if self.per_head_loop or self.native_accumulation:
            o = np.stack([mm(weights[:, h], V[:, h]) for h in range(V.shape[1])], axis=1)
        else:
            o = r(product(lambda a, b: np.einsum("bhts,bhse->bhte", a, b), weights.astype(acc), V.astype(acc)))
        if self.sink_with_value and p_sink is not None:  # the sink's share times the first key's value
            o = r(o.astype(acc) + r(p_sink).astype(acc) * V[:, :, :1].astype(acc))
        return p, o, lse


def output_only(v: Variant) -> Variant:
    """The same implementation, returning only "output" (a fused kernel's view)."""
    from dataclasses import replace

    return replace(v, name=v.name + "+output_only", output_only=True)


def spec1_only(zoo: dict) -> dict:
    """``zoo`` (name -> adapter, or (adapter, stage)) with each adapter returning no ``lse``: the spec-1.1
    bugs are named by the spec-1.1 stage where they are first caught, and a masking bug would be caught
    first at the lse (which comes before attn_weights) of a variant case of the catalog."""
    from dataclasses import replace

    def without(v):
        return replace(v, expose_lse=False) if isinstance(v, Variant) else v

    return {k: (without(v[0]), *v[1:]) if isinstance(v, tuple) else without(v) for k, v in zoo.items()}


CORRECT = {
    "einsum": Variant(name="einsum"),
    "per_head_loop": Variant(name="per_head_loop", per_head_loop=True),
    "prescaled_query": Variant(name="prescaled_query", prescale_query=True),
    "fused_qkv": Variant(name="fused_qkv", fused_qkv=True),
    "finfo_min_fill": Variant(name="finfo_fill", finfo_fill=True),
    "tiled_online_softmax": Variant(name="tiled_online_softmax", tiled_online_softmax=True),
    "log_sum_exp": Variant(name="log_sum_exp", log_sum_exp=True),
    # FlashAttention-style kernels exposing P recomputed from the LSE (not the P of their P·V)
    **{f"online_softmax_{b}_lse_weights": Variant(name=f"online{b}_lse_p", tiled_online_softmax=True, block=b,
                                                  weights_from_lse=True) for b in (8, 16, 64)},
    "fused_float32": Variant(name="fused_float32", fused_float32=True),
}

#: Correct in the dtype, outside the standard precision contract: every partial sum rounded to
#: the dtype (the worst correct order).  Fails as "imprecise" by default; passes --precision worst-case.
NATIVE = spec1_only({
    "native_low_precision_accumulation": Variant(name="native_acc", native_accumulation=True),
})

#: bug name -> (adapter, the stage where it must first be caught)
BUGS = {
    "missing_scale": (Variant(name="no_scale", no_scale=True), "scores"),
    "scale_by_d_model": (Variant(name="scale_d_model", scale_by_d_model=True), "scores"),
    "softmax_over_queries": (Variant(name="softmax_t", softmax_axis_t=True), "attn_weights"),
    "heads_split_in_wrong_order": (Variant(name="split_wrong", split_heads_wrong=True), "scores"),
    "heads_merged_without_transpose": (Variant(name="merge_wrong", merge_without_transpose=True), "concat"),
    "w_o_transposed": (Variant(name="w_o_T", w_o_transposed=True), "output"),
    "causal_off_by_one": (Variant(name="causal_obo", causal_off_by_one=True), "attn_weights"),
    "causal_wrong_alignment": (Variant(name="causal_align", causal_wrong_alignment=True), "attn_weights"),
    "mask_polarity_inverted": (Variant(name="mask_inv", mask_inverted=True), "attn_weights"),
    "mask_applied_after_softmax": (Variant(name="mask_after", mask_after_softmax=True), "attn_weights"),
    "gqa_heads_by_modulo": (Variant(name="gqa_mod", gqa_modulo=True), "scores"),
    "softmax_without_max_subtraction": (Variant(name="no_max", no_max_subtraction=True), "attn_weights"),
    "unnormalised_pv": (Variant(name="unnormalised_pv", unnormalised_pv=True), "head_outputs"),
    # a FlashAttention-style kernel whose weights (recomputed from the LSE) are right and whose P·V is not
    "online_softmax_stale_accumulator": (Variant(name="stale_acc", tiled_online_softmax=True, block=8, weights_from_lse=True,
                                                 stale_accumulator=True), "head_outputs"),
    "dropout_left_on": (Variant(name="dropout", dropout_left_on=True), "attn_weights"),
    "float16_when_float32_asked": (Variant(name="fp16_for_fp32", compute_dtype="float16"), "q_proj"),
    "bfloat16_when_float16_asked": (Variant(name="bf16_for_fp16", compute_dtype="bfloat16"), "q_proj"),
    "output_bias_dropped": (Variant(name="no_b_o", drop_output_bias=True), "output"),
    "uniform_weights_on_fully_masked_rows": (Variant(name="uniform_rows", uniform_masked_rows=True), "attn_weights"),
    "nan_on_fully_masked_rows": (Variant(name="nan_rows", nan_masked_rows=True), "attn_weights"),
}
BUGS = spec1_only(BUGS)

#: The same bugs in a kernel that exposes only "output" (where fused kernels hide them).
OUTPUT_ONLY_BUGS = {f"{name}+output_only": (output_only(v), "output") for name, (v, _) in BUGS.items()}


# -- the attention variants (docs/spec.md §2a, issue 31) ------------------------------------------
#    Every implementation above computes them (HF's eager way by default); these are the correct
#    alternatives and the kill list.  Not in CORRECT and BUGS: those are proved on the spec-1.1
#    catalog (tests/test_tolerance_model.py), these on the variant cases (tests/test_variant_proofs.py).

#: Correct implementations of the variants, written differently.
VARIANT_CORRECT = {
    "hf_eager": Variant(name="hf_eager"),  # every variant step rounded to the dtype
    # FlashAttention-style: online softmax over blocks of 4 keys, sinks starting the running max and
    # sum, the window and score modifications per block, P recomputed from the LSE
    "online_softmax_sinks_window_lse_weights": Variant(name="online4_lse_p", tiled_online_softmax=True, block=4,
                                                       weights_from_lse=True),
    "rope_complex": Variant(name="rope_complex", rope_complex=True),  # Meta's view_as_complex
    "score_mod": Variant(name="score_mod", alibi_score_mod=True),  # FlexAttention: bias, ALiBi per element
    "softcap_reciprocal": Variant(name="softcap_recip", softcap_reciprocal=True),
    "fused_float32": Variant(name="fused_float32_variants", fused_float32=True, rope_complex=True),
}

#: The kill list of issue 31: bug name -> (adapter, the stages where it may first be caught, in pipeline
#: order).  A bug must first be caught at the first of them that it changes in float64 among those the
#: adapter returns (tests/test_variant_proofs.py): a window bug shows first in the LSE (which comes
#: before the weights in the pipeline); a RoPE bug in q_rot, or in k_rot where the queries do not turn
#: (one query at position 0) or the query offset that is ignored is 0.
KILL_LIST = {
    "window_left_off_by_one": (Variant(name="window_left_obo", window_left_off_by_one=True), ("lse", "attn_weights")),
    "window_right_off_by_one": (Variant(name="window_right_obo", window_right_off_by_one=True),
                                ("lse", "attn_weights")),
    "window_aligned_top_left": (Variant(name="window_top_left", window_top_left=True), ("lse", "attn_weights")),
    "softcap_missing": (Variant(name="no_softcap", softcap_missing=True), ("scores",)),
    # masked keys get e^(−c − max) of the weight, fully masked rows 1/S each: the LSE and the weights see
    # it; the visible scores only where a bias or ALiBi, added before the mask, is capped too
    "softcap_after_mask": (Variant(name="softcap_after_mask", softcap_after_mask=True),
                           ("scores", "lse", "attn_weights")),
    "softcap_before_scale": (Variant(name="softcap_before_scale", softcap_before_scale=True), ("scores",)),
    "alibi_wrong_sign": (Variant(name="alibi_sign", alibi_wrong_sign=True), ("scores",)),
    # + slope·j: in a causal row only a constant off (scores and lse see it; the weights do not)
    "alibi_wrong_anchor": (Variant(name="alibi_anchor", alibi_column_anchor=True), ("scores",)),
    "sink_missing_from_denominator": (Variant(name="no_sink", sink_missing=True), ("lse", "attn_weights")),
    "sink_with_a_value": (Variant(name="sink_value", sink_with_value=True), ("head_outputs",)),
    "rope_styles_swapped": (Variant(name="rope_swapped", rope_style_swapped=True), ("q_rot", "k_rot")),
    "rope_offset_ignored": (Variant(name="rope_no_offset", rope_no_offset=True), ("q_rot", "k_rot")),
    "rope_rotary_dim_ignored": (Variant(name="rope_full_dim", rope_full_dim=True), ("q_rot", "k_rot")),
    "lse_in_base_2": (Variant(name="lse_base2", lse_base2=True), ("lse",)),
}

#: The kill list in a kernel that returns only "output"; the LSE in base 2 leaves the output right.
OUTPUT_ONLY_KILL_LIST = {f"{name}+output_only": (output_only(v), ("output",))
                         for name, (v, _) in KILL_LIST.items() if name != "lse_in_base_2"}


# -- look-alikes and more bugs for the diagnosis (src/mhaspec/conformance/diagnose.py,
#    benchmarks/diagnosis_confusion.py): none of them is in BUGS, so the detection figures are unchanged.

def _seed(case: Case, salt: str) -> int:
    import zlib

    return zlib.crc32(f"{salt}/{case.id}/{case.dtype}".encode())


@dataclass(frozen=True)
class Zeros:
    """Not an implementation: every stage returned, all zeros (the right shapes and dtype)."""

    name: str = "zeros"

    def run(self, case: Case) -> dict[str, np.ndarray]:
        return {k: np.zeros_like(v) for k, v in Variant().run(case).items()}


@dataclass(frozen=True)
class Noise:
    """Not an implementation: every stage returned as Gaussian noise with the right shape, dtype and
    root-mean-square (of the correct result), seeded by the case: what a garbled kernel returns."""

    name: str = "noise"

    def run(self, case: Case) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(_seed(case, self.name))
        out = {}
        for k, v in Variant().run(case).items():
            rms = float(np.sqrt(np.mean(np.square(v.astype(np.float64))))) or 1.0
            out[k] = (rms * rng.standard_normal(v.shape)).astype(v.dtype)
        return out


@dataclass(frozen=True)
class ImpreciseQProj:
    """Correct but imprecise: ``q_proj`` = x @ W^Q + b^Q plus an error of ``relative[dtype]`` × (the
    dtype's unit roundoff) × sqrt(d_model) × its root-mean-square, element-wise Gaussian (a sloppy
    but right projection: a few to a hundred times the tolerance off, not a different function;
    the float64 and float32 tolerances are wider in unit roundoffs than the 16-bit types', whose
    sums are float32); every other stage as computed from the right projection."""

    name: str = "imprecise_q_proj"
    relative: tuple[tuple[str, float], ...] = (("float64", 16.0), ("float32", 16.0), ("float16", 1.0),
                                               ("bfloat16", 1.0))

    def run(self, case: Case) -> dict[str, np.ndarray]:
        out = Variant().run(case)
        q = out["q_proj"].astype(np.float64)
        unit = float(np.finfo(DT[case.dtype]).eps) / 2
        rms = float(np.sqrt(np.mean(np.square(q)))) or 1.0
        noise = np.random.default_rng(_seed(case, self.name)).standard_normal(q.shape)
        error = dict(self.relative)[case.dtype] * unit * np.sqrt(case.config.d_model) * rms * noise
        out["q_proj"] = (q + error).astype(out["q_proj"].dtype)
        return out


@dataclass(frozen=True)
class WeightTransposed:
    """A bug: the projection ``weight`` (w_q, w_k, w_v or w_o) used transposed, as (out, in).  Only
    possible where that weight is square; elsewhere it would not run, and the variant is correct."""

    weight: str = "w_q"
    name: str = ""
    compute_dtype: str | None = None

    def run(self, case: Case) -> dict[str, np.ndarray]:
        w = getattr(case.weights, self.weight)
        if w.shape[0] == w.shape[1]:
            case = case.model_copy(update={"weights": case.weights.model_copy(update={self.weight: w.T})})
        return Variant().run(case)


@dataclass(frozen=True)
class SoftmaxFloat32(Variant):
    """A float64 run whose softmax is computed in float32 (as JAX with x64 off for one op, or MLX's
    float32-accurate ``exp``): the scores are float64, the weights float32-accurate, then float64
    again.  In the other dtypes the softmax is in float32 already: correct there."""

    name: str = "softmax_float32"

    def _softmax_pv(self, s, V, allowed, acc, r, mm, S, product=lambda op, a, b: op(a, b), sinks=None,
                    premasked=False):
        if acc != np.float64:
            return super()._softmax_pv(s, V, allowed, acc, r, mm, S, product, sinks, premasked)
        p, _, lse = super()._softmax_pv(s.astype(np.float32), V, allowed, np.float32,
                                        lambda x: np.asarray(x).astype(np.float32), mm, S, sinks=sinks,
                                        premasked=premasked)
        p = p.astype(np.float64)
        return p, np.einsum("bhts,bhse->bhte", p, V.astype(np.float64)), lse


@dataclass(frozen=True)
class Float32Exp(Variant):
    """A float64 run whose ``exp`` is float32-accurate (as MLX's float64): e = exp(x − max) evaluated in
    float32, everything else (the sum, the division, P·V) in float64; the weights and what follows are
    float32-accurate without being float32 numbers.  Correct in the other dtypes (their softmax is
    in float32 already)."""

    name: str = "float32_exp"

    def _softmax_pv(self, s, V, allowed, acc, r, mm, S, product=lambda op, a, b: op(a, b), sinks=None,
                    premasked=False):
        if acc != np.float64 or sinks is not None:
            return super()._softmax_pv(s, V, allowed, acc, r, mm, S, product, sinks, premasked)
        x = np.where(allowed, s, -np.inf)
        peak = np.max(x, axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp((x - peak).astype(np.float32)).astype(np.float64)
        total = np.sum(e, axis=-1, keepdims=True)
        p = np.where(allowed & (total > 0), e / np.where(total > 0, total, 1.0), 0.0)
        return p, np.einsum("bhts,bhse->bhte", p, V.astype(np.float64)), None


#: Not implementations, or correct ones: they must get no diagnosis.
LOOKALIKES = {
    "zeros": Zeros(),
    "random_noise": Noise(),
    "imprecise_q_proj": ImpreciseQProj(),
}

#: More bugs with a diagnosis of their own (not in BUGS: the detection figures stay those of BUGS).
#: name -> (adapter, the stage where it must first be caught)
DIAGNOSED_BUGS = {
    "w_q_transposed": (WeightTransposed("w_q", name="w_q_T"), "q_proj"),
    "w_k_transposed": (WeightTransposed("w_k", name="w_k_T"), "k_proj"),
    "w_v_transposed": (WeightTransposed("w_v", name="w_v_T"), "v_proj"),
    "float32_when_float64_asked": (Variant(name="fp32_for_fp64", compute_dtype="float32"), "q_proj"),
    "softmax_in_float32_when_float64_asked": (SoftmaxFloat32(), "attn_weights"),
    "float32_exp_when_float64_asked": (Float32Exp(), "attn_weights"),
}
DIAGNOSED_BUGS = spec1_only(DIAGNOSED_BUGS)


# -- subtle bugs (issue 36): small enough to hide in a loose tolerance, each a real kernel's mistake.
#    Not in BUGS (the detection figures of BUGS are unchanged); benchmarks/large_figures.py and
#    tests/test_large_sizes.py judge them at catalog sizes and at T = S = 1024, 4096.

#: bug name -> (adapter, the stage where it must first be caught)
SUBTLE_BUGS = {
    "scale_off_by_1e-3": (Variant(name="scale_1e-3", scale_factor=1 + 1e-3), "scores"),
    "scale_off_by_1e-4": (Variant(name="scale_1e-4", scale_factor=1 + 1e-4), "scores"),
    "scale_rounded_to_bfloat16": (Variant(name="scale_bf16", scale_bfloat16=True), "scores"),
    "last_visible_key_dropped": (Variant(name="drop_last_key", drop_last_key=True), "attn_weights"),
    "tf32_matmuls": (Variant(name="tf32", matmul="tf32"), "scores"),  # x, W exact in TF32: q_proj is right
    "bfloat16x3_matmuls": (Variant(name="bf16x3", matmul="bf16x3"), "scores"),
}
SUBTLE_BUGS = spec1_only(SUBTLE_BUGS)

#: The same subtle bugs in a kernel that exposes only "output".
OUTPUT_ONLY_SUBTLE = {f"{name}+output_only": (output_only(v), "output") for name, (v, _) in SUBTLE_BUGS.items()}

#: The dtypes asked for in which each subtle bug is a bug at all: a reduced-precision float32 matmul
#: only where float32 is asked (in float16 and bfloat16 every operand is already a 16-bit number,
#: which TF32 and bfloat16x3 hold exactly; float64 has no such unit); a bfloat16-rounded scale
#: wherever bfloat16 is not asked (a bfloat16 run rounds its scale to bfloat16 itself).  A scale
#: bug is also no bug where the dtype rounds the wrong scale to the right one: subtle_applies.
SUBTLE_DTYPES = {
    "scale_off_by_1e-3": ("float64", "float32", "float16", "bfloat16"),
    "scale_off_by_1e-4": ("float64", "float32", "float16", "bfloat16"),
    "scale_rounded_to_bfloat16": ("float64", "float32", "float16"),
    "last_visible_key_dropped": ("float64", "float32", "float16", "bfloat16"),
    "tf32_matmuls": ("float32",),
    "bfloat16x3_matmuls": ("float32",),
}


def _scale_used(v: Variant, scale: float, dtype: str) -> float:
    """The scale ``v`` multiplies in, as the dtype stores it."""
    s = scale * v.scale_factor
    if v.scale_bfloat16:
        s = float(bf16(np.float32(s)))
    return float(np.asarray(s).astype(DT[dtype]).astype(np.float64))


def subtle_applies(name: str, config, dtype: str) -> bool:
    """Whether subtle bug ``name`` (a key of SUBTLE_BUGS, with or without "+output_only") changes
    a run of ``config`` (an MHAConfig) in ``dtype``: its dtypes, and a scale bug only where the
    scale the dtype stores differs from the right one (1/8 is exact in bfloat16: rounding it is no
    bug; 1 + 1e-4 vanishes in float16's rounding of a power of two)."""
    base = name.removesuffix("+output_only")
    if dtype not in SUBTLE_DTYPES[base]:
        return False
    v = SUBTLE_BUGS[base][0]
    if v.scale_factor != 1.0 or v.scale_bfloat16:
        scale = float(config.scale)
        return _scale_used(v, scale, dtype) != _scale_used(Variant(), scale, dtype)
    return True
