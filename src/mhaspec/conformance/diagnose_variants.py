"""Recognisable signatures of the attention variants' common bugs (docs/spec.md §2a; issue 31's kill
list), read off a failing case like :mod:`.diagnose`'s and under the same rule of evidence.

Each hypothesis is the first failing stage the bug reaches, recomputed in float64 from the golden as
the bug computes it (the *alternative*), and tested by :func:`.diagnose.explains`: every returned
value within FIT tolerances of the alternative, at least CLOSER times nearer to it than to the golden,
the alternative more than APART tolerances from the golden on at least MIN_APART entries.  The
alternative's tolerance is the golden's, scaled where its values are larger (|alt| / |golden|), plus
one unit roundoff of its value; an entry the golden masks and the alternative sees takes the largest
tolerance of its row.

The signatures, each at the stage where the bug is first seen (the first failing stage):

- *window off by one* (``lse``, ``attn_weights``): the softmax of the golden scores over the
  visibility with ``window_left`` or ``window_right`` one more or one less; *window aligned top-left*:
  with ``causal_alignment`` flipped for the window;
- *RoPE style swapped* (``q_rot``, ``k_rot``): the golden projection turned in the other style;
  *RoPE positions without their offset*: turned from position 0; *rotary_dim ignored*: every
  feature turned;
- *softcap missing* (``scores``): scale·Q_rot K_rotᵀ (+ bias, ALiBi) uncapped; *softcap before the
  scale*: scale·c·tanh(Q_rot K_rotᵀ / c);
- *a wrong scale* (``scores``, in a case with softcap, bias or ALiBi, where the scores are no constant
  multiple of the golden's): the scores recomputed with the scale × k, k the median of the returned
  scores' scale·QKᵀ (bias and ALiBi taken off, the softcap undone where not saturated) over the golden's;
- *ALiBi sign* (``scores``): + slope·|i + off − j|; *ALiBi anchored at column 0*: + slope·j (HF
  BLOOM's form, which only the scores and the lse see in a causal row);
- *LSE in base 2* (``lse``): lse / ln 2;
- *sink missing* (``lse``, ``attn_weights``): the softmax without the sink in its denominator;
- the backward's (:func:`backward_hypotheses`, from the golden gradients; the runner passes the returned
  backward stages too): *d_bias from batch 0 only*, *d_bias summed over the batch and the heads*
  (``d_bias``); *RoPE not turned back*, *turned back by +θ*, *turned back from position 0* (``d_q_proj``,
  ``d_k_proj``); *softcap′ missing*, *softcap′ from the post-bias scores* (``d_q_rot``, or ``d_q_proj``
  without RoPE).  A bug of the backward's recomputed P (FlashAttention's) is not named.

Only a case that uses a variant, and is small enough to be judged in one block
(:data:`.blocks.MAX_BLOCK_ELEMENTS`), is diagnosed here.  tests/test_diagnose_variants.py checks that
each named bug of the zoo (tests/variants.py) gets its name and no other, in every dtype, and that
the correct implementations get none; tests/test_diagnose_variant_backward.py the same of the backward's
(tests/backward_variant_zoo.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import STAGE, variant_ops
from ..spec.masks import visibility
from ..spec.variants import alibi_slope_values, features
from .blocks import MAX_BLOCK_ELEMENTS
from .compare import FAIL, StageResult, as_float_array
from .model.softmax import softmax_visible

# -- float64 recomputations from the golden -------------------------------------------------------

def with_sink(golden: GoldenCase, s: np.ndarray, visible: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(s, visible) (B, H, T, S) with the sink logit as one more key (S + 1) of every row that sees a key."""
    z = np.asarray(golden.weights["sink_logits"], dtype=np.float64)  # (H,)
    column = np.broadcast_to(z[None, :, None, None], s.shape[:-1] + (1,))
    return (np.concatenate([s, column], axis=-1),
            np.concatenate([visible, visible.any(axis=-1, keepdims=True)], axis=-1))


def weights_and_lse(golden: GoldenCase, visible: np.ndarray, sinks: bool,
                    s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(attn_weights (B, H, T, S), lse (B, H, T)) of the scores ``s`` (default: the golden's) over
    ``visible``, with the case's sink in the denominator where ``sinks``; lse −inf where a row sees no key."""
    s = golden.stages[STAGE.scores] if s is None else s
    S = s.shape[-1]
    if sinks:
        s, visible = with_sink(golden, s, visible)
    p = softmax_visible(s, visible)
    x = np.where(visible, s, -np.inf)
    peak = np.max(x, axis=-1)
    seen = np.isfinite(peak)
    peak = np.where(seen, peak, 0.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        total = np.sum(np.where(visible, np.exp(np.minimum(x - peak[..., None], 0.0)), 0.0), axis=-1)
        lse = np.where(seen, peak + np.log(total), -np.inf)
    return p[..., :S], lse


def visibility_with(golden: GoldenCase, **config: Any) -> np.ndarray:
    """(B, H, T, S) the case's visibility with its config's fields changed to ``config``."""
    cfg = golden.spec.config.model_copy(update=config)
    B, _, T, S = golden.visible.shape
    return visibility(cfg, golden.inputs.get("mask"), B, T, S)


def rope_with(golden: GoldenCase, stage: str, **rope: Any) -> np.ndarray:
    """``stage`` (q_rot or k_rot) recomputed in float64 from the golden projection with the rope spec's
    fields changed to ``rope``."""
    cfg = golden.spec.config
    spec = cfg.rope.model_copy(update=rope)  # type: ignore[union-attr]
    changed = cfg.model_copy(update={"rope": spec})
    _, _, T, S = golden.visible.shape
    q_pos, k_pos = variant_ops.rope_positions(changed, T, S)
    if stage == STAGE.q_rot:
        return variant_ops.rope(golden.stages[STAGE.q_proj], cfg.H, q_pos, changed)
    return variant_ops.rope(golden.stages[STAGE.k_proj], cfg.H_kv, k_pos, changed)


def turned(golden: GoldenCase, q: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, k) (B, T, H·D_k), (B, S, H_kv·D_k) turned by the case's RoPE in float64 (as they are without)."""
    cfg = golden.spec.config
    if cfg.rope is None:
        return q, k
    q_pos, k_pos = variant_ops.rope_positions(cfg, q.shape[1], k.shape[1], golden.row_offset)
    return variant_ops.rope(q, cfg.H, q_pos, cfg), variant_ops.rope(k, cfg.H_kv, k_pos, cfg)


def modified(golden: GoldenCase, s: np.ndarray) -> np.ndarray:
    """scale·QKᵀ (B, H, T, S) with the case's softcap, bias and ALiBi, in float64."""
    cfg = golden.spec.config
    return (s if cfg.softcap is None else variant_ops.softcap(s, cfg.softcap)) + bias_and_alibi(golden)


def weights(golden: GoldenCase, s: np.ndarray) -> np.ndarray:
    """The softmax (B, H, T, S) of the scores ``s`` over the golden's visible keys, with the case's sink."""
    return weights_and_lse(golden, golden.visible, golden.spec.config.sinks, s)[0]


def raw_scores(golden: GoldenCase) -> np.ndarray:
    """(B, H, T, S) scale·Q_rot K_rotᵀ in float64 from the golden (turned) projections, before the softcap."""
    cfg = golden.spec.config
    q = golden.stages.get(STAGE.q_rot, golden.stages[STAGE.q_proj])
    k = golden.stages.get(STAGE.k_rot, golden.stages[STAGE.k_proj])
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    Q = q.reshape(B, T, cfg.H, cfg.D_k)
    K = np.repeat(k.reshape(B, S, cfg.H_kv, cfg.D_k), cfg.group_size, axis=2)
    return np.einsum("BTHD,BSHD->BHTS", Q, K) * float(cfg.scale)  # type: ignore[arg-type]


def bias_and_alibi(golden: GoldenCase) -> np.ndarray:
    """The terms added after the softcap: bias + (−slope·|i + off − j|), broadcast (…, T, S); 0 without
    (a block of query rows: its rows of the whole case's)."""
    _, _, T, S = golden.visible.shape
    alibi = variant_ops.alibi(golden.spec.config, T, S, golden.whole_tgt_len, golden.row_offset)
    total: Any = 0.0 if golden.inputs.get("bias") is None else golden.inputs["bias"]
    return total + (0.0 if alibi is None else alibi[None])


def alibi_replaced(golden: GoldenCase, sign: float, column: bool) -> np.ndarray | None:
    """The golden scores with ALiBi's −slope·|i + off − j| replaced by sign·slope·|i + off − j|, or by
    slope·j where ``column``; None without ALiBi."""
    cfg = golden.spec.config
    slopes = alibi_slope_values(cfg)
    if slopes is None:
        return None
    _, _, T, S = golden.visible.shape
    distance = variant_ops.alibi_distance(cfg, T, S, T).astype(np.float64)  # (T, S)
    moved = np.broadcast_to(np.arange(S, dtype=np.float64), (T, S)) if column else sign * distance
    return golden.stages[STAGE.scores] + slopes[None, :, None, None] * (distance + moved)[None, None]


def wrong_scale(golden: GoldenCase, got: np.ndarray, sel: np.ndarray) -> tuple[float, np.ndarray] | None:
    """(k, the golden scores recomputed with the scale × k) where the returned scores, with the bias and
    ALiBi taken off and the softcap undone (where it is not saturated), are the golden's scale·QKᵀ × one
    constant k; None in a case without softcap, bias or ALiBi (diagnose.constant_factor reads it there)
    or without the evidence."""
    from .diagnose import MIN_VALUES

    cfg = golden.spec.config
    if cfg.softcap is None and golden.inputs.get("bias") is None and cfg.alibi_slopes is None:
        return None
    raw, added = raw_scores(golden), bias_and_alibi(golden)
    x = got - added
    if cfg.softcap is not None:
        c = cfg.softcap
        x = np.where(np.abs(x) < c * (1 - 2.0**-10), c * np.arctanh(np.clip(x / c, -1.0, 1.0)), np.nan)
    big = sel & np.isfinite(x) & (np.abs(raw) > 1e-3 * float(np.max(np.abs(raw[sel]), initial=0.0)))
    if np.count_nonzero(big) < MIN_VALUES:
        return None
    k = float(np.median(x[big] / raw[big]))
    if not np.isfinite(k) or k <= 0 or k == 1.0:
        return None
    scaled = k * raw
    return k, (scaled if cfg.softcap is None else variant_ops.softcap(scaled, cfg.softcap)) + added


# -- the hypotheses: (name, the alternative of a stage) -------------------------------------------

def window_visibilities(golden: GoldenCase) -> list[tuple[str, np.ndarray]]:
    """(name, the visibility (B, H, T, S) the bug attends with) of each window bug that applies."""
    cfg = golden.spec.config
    if cfg.window_left is None and cfg.window_right is None:
        return []
    out = []
    for side in ("window_left", "window_right"):
        size = getattr(cfg, side)
        for step in (1, -1):
            if size is None or size + step < 0:
                continue
            more = "one key more" if step > 0 else "one key fewer"
            out.append((f"window off by one ({side} {size + step} instead of {size}: {more} on the "
                        f"{side.removeprefix('window_')}; mhaspec counts as FlashAttention does: a row sees "
                        f"window_left + 1 + window_right keys, HF's sliding_window=W is window_left = W − 1)",
                        visibility_with(golden, **{side: size + step})))
    other = "top_left" if cfg.causal_alignment == "bottom_right" else "bottom_right"
    _, _, T, S = golden.visible.shape
    if T != S:  # the window anchored at the other diagonal; the causal band keeps the case's own
        moved = visibility_with(golden, causal_alignment=other, causal=False)
        if cfg.causal:
            moved = moved & visibility_with(golden, window_left=None, window_right=None)
        out.append((f"window aligned {other.replace('_', '-')} instead of {cfg.causal_alignment.replace('_', '-')} "
                    f"(its diagonal is key i + {'S − T' if other == 'bottom_right' else '0'} for query row i)",
                    moved))
    return out


def hypotheses(golden: GoldenCase, stage: str, got: np.ndarray, sel: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(name, the alternative (the golden's shape)) of every bug of the variants seen first at ``stage``
    that applies to ``golden``'s case (``got``, ``sel``: the returned stage and its compared entries,
    from which a wrong scale's factor is read)."""
    cfg = golden.spec.config
    out: list[tuple[str, np.ndarray]] = []
    if stage in (STAGE.lse, STAGE.attn_weights):
        for name, visible in window_visibilities(golden):
            p, lse = weights_and_lse(golden, visible, cfg.sinks)
            out.append((name, lse if stage == STAGE.lse else p))
        if cfg.sinks:
            p, lse = weights_and_lse(golden, golden.visible, False)
            out.append(("sink missing from the softmax's denominator (the rows' weights sum to 1; spec: "
                        "e^sink takes a share of each row)", lse if stage == STAGE.lse else p))
    if stage == STAGE.lse:
        out.append(("LSE in base 2 (natural log expected: lse = lse₂·ln 2)", golden.stages[STAGE.lse] / math.log(2)))
    if stage in (STAGE.q_rot, STAGE.k_rot) and cfg.rope is not None:
        rope = cfg.rope
        other = "interleaved" if rope.style == "half" else "half"
        out.append((f"RoPE style swapped ({other} computed, {rope.style} asked: {rope.style} pairs "
                    f"{'k with k + r/2' if rope.style == 'half' else '2k with 2k + 1'})",
                    rope_with(golden, stage, style=other)))
        offset = rope.query_offset if stage == STAGE.q_rot else rope.key_offset
        if offset:
            out.append((f"RoPE positions without their offset (from 0, not {offset})",
                        rope_with(golden, stage, query_offset=0, key_offset=0)))
        if rope.rotary_dim != cfg.D_k:
            out.append((f"rotary_dim ignored (all {cfg.D_k} features turned, rotary_dim={rope.rotary_dim} asked)",
                        rope_with(golden, stage, rotary_dim=cfg.D_k)))
    if stage == STAGE.scores:
        scaled = wrong_scale(golden, got, sel)
        if scaled is not None:
            k, alt = scaled
            inverse = f" (1/{1 / k:.4g})" if k < 1 else ""
            out.append((f"a wrong scale: the scores are those of the scale × {k:.4g}{inverse}, softcap, bias and "
                        f"ALiBi applied after it (the spec's scale is multiplied in once, before them; "
                        f"1/sqrt(D_k) unless the config sets it)", alt))
        if cfg.softcap is not None:
            c, raw = cfg.softcap, raw_scores(golden)
            out.append(("softcap missing (the scores uncapped; spec: s ← c·tanh(s/c) after the scale)",
                        raw + bias_and_alibi(golden)))
            out.append(("softcap applied before the scale (c·tanh(QKᵀ/c)·scale; spec: c·tanh(scale·QKᵀ/c))",
                        float(cfg.scale) * variant_ops.softcap(raw / float(cfg.scale), c)  # type: ignore[arg-type]
                        + bias_and_alibi(golden)))
        flipped = alibi_replaced(golden, 1.0, column=False)
        if flipped is not None:
            out.append(("ALiBi with the wrong sign (+slope·|i + off − j|; spec: −slope·|i + off − j|)",
                        flipped))
            out.append(("ALiBi anchored at column 0 (+slope·j, HF BLOOM's form; spec: −slope·|i + off − j|, "
                        "which differs by a constant per row where j ≤ i + off)",
                        alibi_replaced(golden, 1.0, column=True)))  # type: ignore[arg-type]
    return out + backward_hypotheses(golden, stage)


def backward_hypotheses(golden: GoldenCase, stage: str) -> list[tuple[str, np.ndarray]]:
    """(name, the alternative (the golden's shape)) of every bug of the variants' backward seen first at
    backward ``stage`` that applies to ``golden``'s case, each from the golden's own gradients.  (Not
    d_sink_logits' sign: its H entries are fewer than the MIN_APART a signature is read from.)"""
    cfg, g = golden.spec.config, golden.stages
    out: list[tuple[str, np.ndarray]] = []
    if stage == STAGE.d_bias:
        out += bias_grad_hypotheses(g[STAGE.d_scores], g[STAGE.d_bias].shape)
    if stage in (STAGE.d_q_proj, STAGE.d_k_proj) and cfg.rope is not None:
        out += rope_back_hypotheses(golden, stage)
    if cfg.softcap is not None and stage == (STAGE.d_q_rot if cfg.rope is not None else STAGE.d_q_proj):
        out += softcap_back_hypotheses(golden)
    return out


def bias_grad_hypotheses(dS: np.ndarray, shape: tuple[int, ...]) -> list[tuple[str, np.ndarray]]:
    """d_bias (``shape``: (B|1, H|1, T, S)) from d_scores dS (B, H, T, S) as two bugs sum it: batch 0's
    only where the bias is shared by the batch; over the batch and the heads whatever it broadcasts."""
    out = []
    heads = (1,) if shape[1] == 1 else ()
    if shape[0] == 1 and dS.shape[0] > 1:
        out.append(("d_bias from batch 0 only (a bias shared by the batch: the sum of every batch's d_scores)",
                    dS[:1].sum(axis=heads, keepdims=True)))
    if shape[:2] != (1, 1):
        out.append((f"d_bias summed over the batch and the heads (a bias of shape {tuple(shape)}: d_scores summed "
                    f"over the axes it broadcasts only)", np.broadcast_to(dS.sum(axis=(0, 1), keepdims=True), shape)))
    return out


def rope_back_hypotheses(golden: GoldenCase, stage: str) -> list[tuple[str, np.ndarray]]:
    """d_q_proj or d_k_proj (``stage``) from the golden d_q_rot or d_k_rot as three bugs turn it back: not at
    all, by +θ (R, not Rᵀ), from position 0 (the offset ignored; where there is one)."""
    cfg = golden.spec.config
    query = stage == STAGE.d_q_proj
    rot, n = (STAGE.d_q_rot, cfg.H) if query else (STAGE.d_k_rot, cfg.H_kv)
    _, _, T, S = golden.visible.shape
    positions = variant_ops.rope_positions(cfg, T, S)[0 if query else 1]
    offset = cfg.rope.query_offset if query else cfg.rope.key_offset  # type: ignore[union-attr]
    d = golden.stages[rot]
    out = [(f"RoPE not turned back in the backward ({stage} = {rot}; spec: Rᵀ {rot}, each pair turned by −θ)", d),
           (f"RoPE turned back by +θ ({stage} = R {rot}; spec: Rᵀ {rot})", variant_ops.rope(d, n, positions, cfg))]
    if offset:
        out.append((f"RoPE turned back from position 0 (the offset {offset} ignored: Rᵀ at positions 0, 1, …)",
                    variant_ops.rope(d, n, -(positions - offset), cfg)))
    return out


def softcap_back_hypotheses(golden: GoldenCase) -> list[tuple[str, np.ndarray]]:
    """d_q_rot (d_q_proj without RoPE) as two softcap bugs form it: scale·d_raw K_rot with d_raw = d_scores
    (softcap′ missing), or d_scores ⊙ (1 − (scores / c)²) from the post-bias scores (with a bias or ALiBi)."""
    cfg, g = golden.spec.config, golden.stages
    k = g.get(STAGE.k_rot, g[STAGE.k_proj])
    B, S = k.shape[0], k.shape[1]
    K = np.repeat(k.reshape(B, S, cfg.H_kv, cfg.D_k), cfg.group_size, axis=2)  # (B, S, H, D)
    dS = g[STAGE.d_scores]  # (B, H, T, S)

    def d_q(d_raw: np.ndarray) -> np.ndarray:  # scale · d_raw K, heads merged: (B, T, H·D)
        return float(cfg.scale) * np.einsum("BHTS,BSHD->BTHD", d_raw, K).reshape(B, dS.shape[2], -1)  # type: ignore[arg-type]

    out = [("softcap′ missing in the backward (d_raw = d_scores; spec: d_scores ⊙ (1 − tanh²(raw/c)))", d_q(dS))]
    if golden.inputs.get("bias") is not None or cfg.alibi_slopes is not None:
        t = np.where(golden.visible, g[STAGE.scores], 0.0) / cfg.softcap  # type: ignore[operator]
        out.append(("softcap′ from the post-bias scores (1 − (scores/c)²; spec: 1 − tanh²(raw/c), the logit before "
                    "bias and ALiBi)", d_q(dS * (1 - t * t))))
    return out


# -- the evidence ----------------------------------------------------------------------------------

def alternative_tolerance(alt: np.ndarray, golden: np.ndarray, tol: np.ndarray, eps: float) -> np.ndarray:
    """The alternative's tolerance: the golden's, scaled where |alt| > |golden|, plus eps·|alt|; where the
    golden's is 0 (an entry it masks), the largest of its row."""
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(np.abs(golden) > 0, np.maximum(1.0, np.abs(alt) / np.abs(golden)), 1.0)
    row = np.max(tol, axis=-1, keepdims=True) if tol.ndim > 1 else tol
    return np.where(tol > 0, tol * scale, row) + eps * np.abs(alt)


def uses_variants(golden: GoldenCase) -> bool:
    return bool(features(golden.spec))


def variant_hints(golden: GoldenCase, returned: Mapping[str, Any], dtype: str,
                  stages: Sequence[StageResult]) -> list[str]:
    """The variant bug that explains a case using a variant, as one hint ("STAGE: name [evidence]"), or []
    when none does, two do (the evidence cannot tell them apart), or the case is beyond one block.

    The failing stages are read in pipeline order: a bug is named at the first of them where it alone
    explains the returned values, provided it also fits (within FIT tolerances) every failing stage
    before it where it applies (a window off by one that the bfloat16 lse cannot resolve is read off
    the weights that follow, but only if its lse fits the lse returned)."""
    from .diagnose import EPS, FIT, _evidence, _Evidence, _ratio, degenerate, explains

    B, H, T, S = golden.visible.shape
    if not uses_variants(golden) or B * H * T * S > MAX_BLOCK_ELEMENTS:
        return []
    arrays = {}
    for st in stages:
        if st.verdict == FAIL and st.stage in returned and st.stage in golden.stages:
            got, _ = as_float_array(returned[st.stage])
            if got is not None and got.shape == golden.stages[st.stage].shape:
                arrays[st.stage] = got
    ev = _Evidence(golden, arrays, dtype)
    fitted: dict[str, bool] = {}  # hypothesis name -> whether it fits every earlier failing stage it applies at
    with np.errstate(all="ignore"):
        for stage, got in arrays.items():
            gold, tol = golden.stages[stage], np.asarray(ev.tol(stage))
            sel = ev.selected(stage) & np.isfinite(gold) & np.isfinite(got)
            found = []
            for name, alt in hypotheses(golden, stage, got, sel):
                keep = sel & np.isfinite(alt)
                tol_alt = alternative_tolerance(alt, gold, tol, EPS[dtype])
                fits = bool(np.all(_ratio(np.abs(got[keep] - alt[keep]), tol_alt[keep]) <= FIT))
                if (fitted.get(name, True) and not degenerate(got)
                        and explains(got[keep], alt[keep], gold[keep], tol_alt[keep], tol[keep])):
                    found.append(f"{stage}: {name} [{_evidence('that computation')}]")
                fitted[name] = fitted.get(name, True) and fits
            if found:
                return found if len(found) == 1 else []
    return []
