"""Every stage's allowed error, forward and backward: the tolerance model's entry points.

The model — what a correct implementation may get wrong, stage by stage, one rule per stage —
is :mod:`mhaspec.conformance.model` (docs/tolerances.md).  This module composes its rules over
a case and chooses, for each chunk of heads × query rows of the (B, H, T, S) stages, what
computes it: the compiled loop (:mod:`.engine.compiled`: a large case, numba installed) → the
in-place NumPy path (:mod:`.engine.inplace`) → the model's general rule (a chunk with a value
that is not finite, and the worst-case contract's local checks).  A case with an attention variant that
changes values (RoPE, softcap, bias, ALiBi, sinks) takes the model's general rule whole
(:mod:`.model.variants`): the engines compute the spec-1.1 formulas only.  Chunks: :mod:`.engine.chunks`.

* :func:`golden_bounds` — every golden stage's :class:`Bound`;
* :func:`judging_bounds` — those and the runner's tolerances (with the golden's reference error);
* :func:`stage_tolerances` — the tolerances alone;
* :func:`local_references` — the local checks' float64 recomputations and bounds;
* :func:`backward_bounds`, :func:`backward_tolerances`, :func:`local_checks` — the backward's.

Shapes (axis legend B, T, S, H, G = H_kv, D = D_k, E = D_v):
q (B,T,H·D), k (B,S,G·D), v (B,S,G·E), scores/attn (B,H,T,S),
heads (B,H,T,E), concat (B,T,H·E), output (B,T,d_out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from ..fixtures import GoldenCase
from ..spec import STAGE, variant_ops
from ..spec.masks import seen_keys
from ..spec.stages import forward_stages, local_inputs
from ..spec.tolerance import DEFAULT_TOLERANCES, ToleranceTable
from . import judging
from .compare import Scratch
from .engine import chunks, compiled, inplace
from .engine.compiled import NUMBA_ENV
from .model import backward as backward_rules, forward as forward_rules, local as local_rules
from .model import variants as variant_rules
from .model.backward_local import local_checks
from .model.local import LOCAL_INPUTS
from .model.vocabulary import (KAPPA, KAPPA_MIN_ELEMENTS, LAMBDA, PRECISIONS, Bound, Error, Pair, gamma, heads,
                               merge, nonnegative_product, rounding, swap)

__all__ = [
    "KAPPA", "KAPPA_MIN_ELEMENTS", "LAMBDA", "LOCAL_INPUTS", "NUMBA_ENV", "PRECISIONS", "Bound", "backward_bounds",
    "backward_tolerances", "gamma", "golden_bounds", "heads", "judging_bounds", "local_checks", "local_references",
    "merge", "stage_tolerances", "worst_case_tolerances",
]


def golden_bounds(golden: GoldenCase, dtype: str, precision: str = "standard",
                  table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, Bound]:
    """The allowed error of every element of every stage of ``golden`` in ``dtype``."""
    if _worst_case(precision):
        return _worst_case_bounds(golden, dtype, table)
    return _standard(golden, dtype, table, keep_bounds=True, tolerances=None)[0]


def judging_bounds(golden: GoldenCase, dtype: str, precision: str = "standard",
                   table: ToleranceTable = DEFAULT_TOLERANCES, *,
                   key_stages: bool = True) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """(:func:`golden_bounds`, the tolerance of every stage of the golden with its own error).

    The tolerances are those of ``judging.with_reference_error(golden, bounds)`` (``LAMBDA·sigma +
    (worst + reference error)``, the same numbers); those of the (B, H, T, S) stages are
    formed chunk by chunk with their bounds, while they are in the processor's cache.
    ``key_stages=False``: without the key and value projections' (a block of query rows whose batch
    entry's projections another block judges: :func:`.judging.judges_key_stages`)."""
    if _worst_case(precision):
        bounds = _worst_case_bounds(golden, dtype, table)
        out = bounds, _tolerances(judging.with_reference_error(golden, bounds))
    else:
        out = _standard(golden, dtype, table, keep_bounds=True, tolerances="with reference error",
                        key_stages=key_stages)
    if key_stages:
        return out
    return tuple({k: v for k, v in d.items() if k not in KEY_STAGES} for d in out)  # type: ignore[return-value]


def stage_tolerances(golden: GoldenCase, dtype: str, table: ToleranceTable = DEFAULT_TOLERANCES,
                     precision: str = "standard", reference_error: bool = False) -> dict[str, np.ndarray]:
    """The element-wise tolerance of every golden stage (``LAMBDA·sigma + worst``); those of the
    (B, H, T, S) stages are formed chunk by chunk, and their bounds are not kept.  With
    ``reference_error``, the golden's own error is in them: the numbers of
    ``judging.with_reference_error(golden, stage_tolerances(golden, dtype))``, formed in the chunks."""
    if _worst_case(precision):
        bounds = _worst_case_bounds(golden, dtype, table)
        return _tolerances(judging.with_reference_error(golden, bounds) if reference_error else bounds)
    return _standard(golden, dtype, table, keep_bounds=False,
                     tolerances="with reference error" if reference_error else "plain")[1]


def _worst_case(precision: str) -> bool:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision == "worst-case"


def _worst_case_bounds(golden: GoldenCase, dtype: str, table: ToleranceTable) -> dict[str, Bound]:
    """:func:`worst_case_tolerances` as bounds: all worst-case, no noise part."""
    return {k: Bound.worst_case(v) for k, v in worst_case_tolerances(golden, dtype, table).items()}


def worst_case_tolerances(golden: GoldenCase, dtype: str,
                          table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, np.ndarray]:
    """The worst-case contract's tolerances of every forward stage of ``golden``: those of
    :func:`~.model.forward.worst_case_tolerances`, or of :func:`~.model.variants.worst_case_tolerances` for
    a case with a variant (and for ``lse``, which only that rule bounds)."""
    if variant_rules.variant_case(golden):
        return _ordered(golden, variant_rules.worst_case_tolerances(golden, dtype, table))
    out = forward_rules.worst_case_tolerances(golden, dtype, table)
    if STAGE.lse in golden.stages:  # from the scores' worst-case error (their tolerance less the floor)
        out[STAGE.lse] = variant_rules.spec11_lse_worst(golden, out[STAGE.scores], dtype, table)
    return _ordered(golden, out)


def _ordered(golden: GoldenCase, d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` in pipeline order, limited to the forward stages ``golden``'s case has."""
    return {name: d[name] for name in forward_stages(golden.spec.config) if name in d}


def _tolerances(bounds: Mapping[str, Bound]) -> dict[str, np.ndarray]:
    return {name: b.tolerance(LAMBDA) for name, b in bounds.items()}


#: The stages without query rows: the key and value projections.
KEY_STAGES = (STAGE.k_proj, STAGE.v_proj)


def _standard(golden: GoldenCase, dtype: str, table: ToleranceTable, *, keep_bounds: bool,
              tolerances: Literal["plain", "with reference error"] | None, key_stages: bool = True,
              ) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """(bounds, tolerances) of the golden stages under the standard contract (the model's rules,
    :mod:`.model.forward`, steps 1–5).  ``keep_bounds``: the bounds of every stage (else {}: those
    of the (B, H, T, S) stages go to work arrays only); ``tolerances``: None (not formed, {}),
    ``"plain"`` (``LAMBDA·sigma + worst``) or ``"with reference error"`` (the golden's own error
    in ``worst``, :func:`.judging.with_reference_error`); ``key_stages=False``: neither the bounds nor
    the tolerances of :data:`KEY_STAGES` (the same numbers for the other stages)."""
    r = rounding(dtype, "standard", table)
    if variant_rules.variant_case(golden):  # the model's general rule: no engine computes the variants
        return _variants_standard(golden, r, keep_bounds=keep_bounds, tolerances=tolerances)
    cfg, g, w = golden.spec.config, golden.stages, golden.weights
    H = cfg.H
    lse_in = STAGE.lse in g  # the log-sum-exp: from the scores' bounds, a chunk of rows at a time
    # 1. projections (k_proj, v_proj with the operands of steps 2–4 made of them, shared by the
    #    blocks of query rows of one batch entry: judging.memoised)
    e_q = forward_rules.projection(golden, "q", r)
    keys = judging.memoised(golden, ("golden key side", dtype, r.u, r.acc, r.k),
                            lambda: forward_rules.key_side(golden, r))

    # 2.–4. the (B, H, T, S) stages, one chunk of heads × query rows at a time; every formula is
    #    element-wise or per row, so chunking changes nothing but the order of float64 roundings
    #    in the bounds themselves.
    s, p, o = g[STAGE.scores], g[STAGE.attn_weights], g[STAGE.head_outputs]
    B, _, T, S = s.shape
    E = o.shape[-1]
    N = B * H
    Q = heads(g[STAGE.q_proj], H).reshape(N, T, -1)
    tQ2 = heads(e_q.total_var, H).reshape(N, T, -1)
    sN, pN, oN, visN = (x.reshape(N, T, -1) for x in (s, p, o, golden.visible))
    # None: the chunks' bounds go to work arrays only
    sig_s, wor_s, sig_p, wor_p = [np.empty((N, T, S)) if keep_bounds else None for _ in range(4)]
    o2, wo = np.empty((N, T, E)), np.empty((N, T, E))
    tol_s, tol_p = (np.empty((N, T, S)), np.empty((N, T, S))) if tolerances else (None, None)
    error = golden.reference_error if tolerances == "with reference error" else None
    extra_s, extra_p = ((0.0, 0.0) if error is None else
                        (np.broadcast_to(e, (B, H, T, S)).reshape(N, T, S) if isinstance(e, np.ndarray) else e
                         for e in (error.get(STAGE.scores, 0.0), error.get(STAGE.attn_weights, 0.0))))  # absent: exact
    cst = forward_rules.AttentionConstants.of(golden, r)
    kernels = compiled.kernels_for(golden)
    # a block of query rows of a larger case: each chunk over the keys its rows see (the NumPy loops; the
    # compiled ones always, which only such cases take)
    seen_only = judging.whole_shape(golden) != golden.visible.shape
    if lse_in:  # (N, T, 1): the lse's error, each chunk's rows from that chunk's score bounds
        lse_g, a_s = g[STAGE.lse].reshape(N, T, 1), r.accumulation(S)
        lse_var, lse_acc = np.empty((N, T, 1)), np.empty((N, T, 1))
    # the library's attention loop forms the lse's row operands from its own work (no pass of NumPy's)
    fold_lse = lse_in and kernels is not None and compiled.folds_golden_lse(kernels)

    def chunk(n: slice, rows: slice, buf: Scratch) -> None:
        args = (cst, Q[n, rows], tQ2[n, rows], keys.KK[n], keys.aK[n], keys.V[n], keys.V2[n], keys.aV[n],
                keys.tV2[n], sN[n, rows], pN[n, rows], oN[n, rows], visN[n, rows])
        e_o = Error(o2[n, rows], wo[n, rows])
        shape = sN[n, rows].shape
        # the bounds: into the whole stage's arrays where kept, else into work arrays (the lse reads the scores')
        b = [buf(f"g_out{i}", shape) if a is None else a[n, rows] for i, a in enumerate((sig_s, wor_s, sig_p, wor_p))]
        out = forward_rules.ChunkOut(Bound(b[0], b[1]), Bound(b[2], b[3]), e_o)
        lse_rows = buf("g_lse", (*shape[:-1], compiled.GOLDEN_LSE_PARTS)) if fold_lse else None
        ok = kernels is not None and compiled.attention_chunk(
                kernels, *args, bounds=(out.scores, out.attn_weights) if keep_bounds or (lse_in and not fold_lse) else None,
                tolerances=None if tol_s is None else (tol_s[n, rows], tol_p[n, rows]),
                extras=tuple(e if isinstance(e, float) else e[n, rows] for e in (extra_s, extra_p)),
                out=e_o, buf=buf, lse_rows=lse_rows)
        if not ok:
            if not inplace.attention_chunk(*args, out=out, buf=buf, seen_only=seen_only):
                forward_rules.attention_chunk(*args, out=out)
            if tol_s is not None and tol_p is not None:
                for bound, e, dst in ((out.scores, extra_s, tol_s[n, rows]),
                                      (out.attn_weights, extra_p, tol_p[n, rows])):
                    inplace.tolerance_into(bound.sigma, bound.worst, e if isinstance(e, float) else e[n, rows], dst,
                                           buf)
        if ok and lse_rows is not None:  # the library's loop formed the rows' operands (compiled.lse_of_rows)
            e_l = compiled.lse_of_rows(lse_rows, lse_g[n, rows], a_s, r)
            lse_var[n, rows], lse_acc[n, rows] = e_l.var, e_l.acc
        elif lse_in:  # over the keys the chunk's rows see where later ones are masked (no term; a_s keeps S)
            k = seen_keys(visN[n, rows]) if seen_only else S
            e_l = variant_rules.scores_lse(b[0][..., :k], b[1][..., :k], sN[n, rows, :k], pN[n, rows, :k],
                                           visN[n, rows, :k], lse_g[n, rows], a_s, r)
            lse_var[n, rows], lse_acc[n, rows] = e_l.var, e_l.acc

    # the general path's arithmetic on an adapter's own NaN and inf (a deviation bound, a local
    # check) is deliberate: no RuntimeWarning, as in local_references (the chunks' threads inherit it)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        elements = chunks.CHUNK_ELEMENTS if kernels is None else compiled.COMPILED_CHUNK_ELEMENTS
        chunks.each_chunk(N, T, S, chunk, elements)

    # 5. concat and output
    e_o = Error(o2.reshape(B, H, T, E), wo.reshape(B, H, T, E))
    errors = {STAGE.q_proj: e_q, STAGE.k_proj: keys.k, STAGE.v_proj: keys.v, STAGE.head_outputs: e_o,
              **forward_rules.output(golden, e_o, r)}
    if lse_in:  # the log-sum-exp, from the scores' bounds (docs/tolerances.md "lse"; variants.spec11_lse by chunks)
        errors[STAGE.lse] = Error(lse_var.reshape(B, H, T), lse_acc.reshape(B, H, T))
    # key_stages=False: a block whose batch entry's key and value projections another block judges
    out = {name: e.bound(r.floor) for name, e in errors.items() if key_stages or name not in KEY_STAGES}
    tols: dict[str, np.ndarray] = {}
    if tolerances:
        tols = _tolerances(judging.with_reference_error(golden, out) if error is not None else out)
        assert tol_s is not None and tol_p is not None
        tols[STAGE.scores], tols[STAGE.attn_weights] = tol_s.reshape(B, H, T, S), tol_p.reshape(B, H, T, S)
        tols = _ordered(golden, tols)
    if not keep_bounds:
        return {}, tols
    # masked attention weights must be exactly 0: no allowance at all (the chunks saw to it)
    assert sig_s is not None and wor_s is not None and sig_p is not None and wor_p is not None
    out[STAGE.scores] = Bound(sig_s.reshape(B, H, T, S), wor_s.reshape(B, H, T, S))
    out[STAGE.attn_weights] = Bound(sig_p.reshape(B, H, T, S), wor_p.reshape(B, H, T, S))
    return _ordered(golden, out), tols


def _variants_standard(golden: GoldenCase, r: Any, *, keep_bounds: bool,
                       tolerances: Literal["plain", "with reference error"] | None,
                       ) -> tuple[dict[str, Bound], dict[str, np.ndarray]]:
    """:func:`_standard` of a case with a variant: the model's general rule on the whole case
    (:func:`.model.variants.golden_errors`), the bounds formed as :func:`_standard` forms them."""
    errors = variant_rules.golden_errors(golden, r)
    out = _ordered(golden, {name: e if isinstance(e, Bound) else e.bound(r.floor) for name, e in errors.items()})
    tols: dict[str, np.ndarray] = {}
    if tolerances:
        with_error = tolerances == "with reference error" and golden.reference_error is not None
        tols = _tolerances(judging.with_reference_error(golden, out) if with_error else out)
    return (out if keep_bounds else {}), tols


def local_references(golden: GoldenCase, own: Mapping[str, np.ndarray], dtype: str,
                     precision: str = "standard",
                     table: ToleranceTable = DEFAULT_TOLERANCES) -> dict[str, tuple[np.ndarray, Bound]]:
    """{stage: (float64 recomputation from the adapter's own inputs, its bound)} (:mod:`.model.local`).

    ``own`` holds the adapter's stages as float64 arrays of the canonical
    shapes (those it did not return, or returned malformed, are absent).  A
    stage is recomputed only when every stage it depends on is in ``own``.
    The bound is that stage's own rounding plus the storage rounding of its
    inputs as returned (the adapter may have used them unrounded); nothing
    propagated from earlier stages.
    """
    worst_case = precision == "worst-case"
    r = rounding(dtype, "worst-case" if worst_case else "standard", table)
    u, ua, floor = r.u, r.acc, r.floor
    cfg, w = golden.spec.config, golden.weights
    H, G, group = cfg.H, cfg.H_kv, cfg.group_size
    scale = float(cfg.scale)  # type: ignore[arg-type]
    out: dict[str, tuple[np.ndarray, Bound]] = {}

    def has(*names: str) -> bool:
        return all(n in own for n in names)

    B, _, T, S = golden.visible.shape
    N = B * H
    visN = golden.visible.reshape(N, T, S)
    seen_only = judging.whole_shape(golden) != golden.visible.shape  # as in _standard

    # the in-place path (standard contract, no variant), the general one where it cannot
    variant = variant_rules.variant_case(golden)
    fast = not worst_case and not variant
    kernels = compiled.kernels_for(golden) if fast else None
    sinks = variant_rules.sink_logits(golden, N)  # (N, 1, 1) or None

    def each(fn: Any) -> None:  # fn(n, rows, scratch) on every chunk of (N, T, ·) rows
        chunks.each_chunk(N, T, S, fn)

    def finish(ref: np.ndarray, sig: np.ndarray, wor: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, Bound]:
        return ref.reshape(shape), Bound(sig.reshape(shape), wor.reshape(shape))

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if cfg.rope is not None:  # q_rot, k_rot from the adapter's own q_proj, k_proj
            q_pos, k_pos = variant_ops.rope_positions(cfg, T, S, golden.row_offset)
            for rot, proj, n_heads, pos in ((STAGE.q_rot, STAGE.q_proj, H, q_pos), (STAGE.k_rot, STAGE.k_proj, G, k_pos)):
                if has(proj):
                    out[rot] = variant_rules.local_rope(own[proj], n_heads, pos, cfg, r, worst_case)
        score_inputs = local_inputs(STAGE.scores, cfg, own)
        if variant and has(*score_inputs):  # the model's general rule, the variants in float64
            out[STAGE.scores] = variant_rules.local_scores(golden, own[score_inputs[0]], own[score_inputs[1]],
                                                           cfg.rope is not None and STAGE.q_rot not in score_inputs,
                                                           r, worst_case)
        elif has(*score_inputs):
            def key_operands() -> tuple[np.ndarray, Pair, Pair]:  # shared by the blocks of a batch entry
                K = heads(own[STAGE.k_proj], G, group).reshape(N, S, -1)
                return K, Pair.lazy(lambda: swap(K * K)), Pair.lazy(lambda: swap(np.abs(K)))

            Q = heads(own[STAGE.q_proj], H).reshape(N, T, -1)
            K, K2, aK = judging.memoised(golden, ("local keys",), key_operands)
            ref, sig, wor = np.empty((N, T, S)), np.empty((N, T, S)), np.empty((N, T, S))
            a_d = r.accumulation(cfg.D_k)

            def scores(n: slice, rows: slice, buf: Scratch) -> None:
                q, dst = Q[n, rows], (ref[n, rows], sig[n, rows], wor[n, rows])
                if kernels is not None and compiled.local_scores(kernels, q, K[n], K2[n], aK[n], scale, u, a_d,
                                                                 floor, dst, buf, visN[n, rows]):
                    return
                if fast and inplace.local_scores(q, K[n], K2[n], aK[n], scale, u, a_d, floor, dst, buf,
                                                 visN[n, rows] if seen_only else None):
                    return
                x, b = local_rules.scores(q, K[n], K2[n], aK[n], scale, a_d, r, worst_case)
                ref[n, rows], sig[n, rows], wor[n, rows] = x, b.sigma, b.worst

            each(scores)
            out[STAGE.scores] = finish(ref, sig, wor, (B, H, T, S))
        a_s = r.accumulation(S)

        lse_in = has(*local_inputs(STAGE.lse)) and STAGE.lse in golden.stages
        if lse_in:
            sL = own[STAGE.scores].reshape(N, T, S)
            ref_l, sig_l, wor_l = np.empty((N, T, 1)), np.empty((N, T, 1)), np.empty((N, T, 1))

            def lses(n: slice, rows: slice, buf: Scratch) -> None:  # per row: chunked, the same numbers
                # a block's chunk over the keys its rows see (later ones are masked: no term; the sum's
                # coefficient keeps the whole row's S)
                k = seen_keys(visN[n, rows]) if seen_only else S
                ref_c, b_c = variant_rules.local_lse(sL[n, rows, :k], visN[n, rows, :k],
                                                     None if sinks is None else sinks[n], r, worst_case, length=S)
                ref_l[n, rows], sig_l[n, rows], wor_l[n, rows] = ref_c, b_c.sigma, b_c.worst

            def lse_shared(n: slice, rows: slice) -> Any:
                """The lse check of a chunk from the operands the weights check formed (inplace.local_weights):
                :func:`.model.variants.local_lse`'s formulas on the same numbers."""
                def into(p_: np.ndarray, ts2: np.ndarray, abs_s: np.ndarray, vis: np.ndarray,
                         ref_c: np.ndarray, shared: variant_rules.LseShared) -> None:
                    b_c = local_rules.local_bound(variant_rules.lse(p_, ts2, abs_s, vis, ref_c, a_s, r, shared),
                                                  r, False)
                    ref_l[n, rows], sig_l[n, rows], wor_l[n, rows] = ref_c, b_c.sigma, b_c.worst
                return into

            # the compiled weights loop forms each row's lse operands from its own work (no sinks here: a
            # variant case takes neither compiled nor in-place loop)
            folded = kernels is not None and sinks is None and compiled.folds_lse(kernels)

            def lse_folded(n: slice, rows: slice, dst: tuple[np.ndarray, np.ndarray, np.ndarray],
                           buf: Scratch) -> bool:
                """The weights check of a chunk into ``dst`` by the compiled loop, and its lse check from the
                operands that loop formed per row (compiled.local_lse); False where it found a value not finite."""
                s_ = sL[n, rows]
                parts = buf("k_lse", (*s_.shape[:-1], compiled.LSE_PARTS))
                if not compiled.local_weights(kernels, s_, visN[n, rows], u, ua, a_s, floor, dst, buf, parts):
                    return False
                ref_c, e_c = compiled.local_lse(parts, a_s, r)
                b_c = local_rules.local_bound(e_c, r, False)
                ref_l[n, rows], sig_l[n, rows], wor_l[n, rows] = ref_c, b_c.sigma, b_c.worst
                return True

            def lse_alone(n: slice, rows: slice, buf: Scratch) -> None:
                """The lse check of a chunk where the weights stage is not checked: by the compiled weights loop
                where it folds it (its weights into scratch), else :func:`lses`."""
                shape = sL[n, rows].shape
                if folded and lse_folded(n, rows, tuple(buf(f"k_lse_{x}", shape) for x in ("ref", "sig", "wor")), buf):
                    return
                lses(n, rows, buf)

        def softmax_pass(scores_: np.ndarray, with_lse: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """The softmax of ``scores_`` (B, H, T, S) and its own rounding bound (sigma, worst); ``with_lse``
            (the adapter's own scores): the local lse check too, from the same work where the in-place path or
            the C library's compiled loop takes the chunk."""
            sO = scores_.reshape(N, T, S)
            ref, sig, wor = np.empty((N, T, S)), np.empty((N, T, S)), np.empty((N, T, S))

            def weights(n: slice, rows: slice, buf: Scratch) -> None:
                s_, vis, dst = sO[n, rows], visN[n, rows], (ref[n, rows], sig[n, rows], wor[n, rows])
                by_lse_loop = with_lse and folded  # (a chunk it finds not finite: not swept again by the plain one)
                if by_lse_loop and lse_folded(n, rows, dst, buf):
                    return
                if not by_lse_loop and kernels is not None and compiled.local_weights(kernels, s_, vis, u, ua, a_s,
                                                                                      floor, dst, buf):
                    pass
                elif fast and inplace.local_weights(s_, vis, u, ua, a_s, floor, dst, buf, seen_only,
                                                    lse=lse_shared(n, rows) if with_lse else None):
                    return
                else:
                    ref[n, rows], sig[n, rows], wor[n, rows] = variant_rules.local_weights(
                        s_, vis, None if sinks is None else sinks[n], r, worst_case)
                if with_lse:
                    lses(n, rows, buf)

            each(weights)
            return ref, sig, wor

        weights_local = None
        if has(*LOCAL_INPUTS[STAGE.attn_weights]):  # with the lse check where it is asked (the same scores)
            weights_local = softmax_pass(own[STAGE.scores], with_lse=lse_in)
        elif lse_in:
            each(lse_alone)
        if lse_in:
            out[STAGE.lse] = ref_l.reshape(B, H, T), Bound(sig_l.reshape(B, H, T), wor_l.reshape(B, H, T))
        if weights_local is not None:
            out[STAGE.attn_weights] = finish(*weights_local, (B, H, T, S))
        if has(*LOCAL_INPUTS[STAGE.head_outputs]):
            def value_operands() -> tuple[np.ndarray, Pair, Pair]:  # shared by the blocks of a batch entry
                V = heads(own[STAGE.v_proj], G, group).reshape(N, S, -1)
                return V, Pair.lazy(lambda: V * V), Pair.of(np.abs(V))  # |V| in float64 too: the route's product

            P = own[STAGE.attn_weights].reshape(N, T, S)
            V, V2, aV = judging.memoised(golden, ("local values",), value_operands)
            # a block's chunks: the products over the keys up to the last nonzero weight (0 · a finite value
            # adds nothing; the adapter's values all finite, or the whole rows)
            nonzero_only = seen_only and judging.memoised(golden, ("local values finite",),
                                                          lambda: bool(np.isfinite(V).all()))
            E = V.shape[-1]
            ref, sig, wor = np.empty((N, T, E)), np.empty((N, T, E)), np.empty((N, T, E))
            # the weights' route allowance (local_rules.weights_route): from the adapter's own softmax, else
            # from the golden's, formed here before the chunks share it
            softmax = weights_local if weights_local is not None else softmax_pass(golden.stages[STAGE.scores])

            def outputs(n: slice, rows: slice, buf: Scratch) -> None:
                pc, dst = P[n, rows], (ref[n, rows], sig[n, rows], wor[n, rows])
                if not (kernels is not None and compiled.local_outputs(kernels, pc, V[n], V2[n], aV[n], u, a_s,
                                                                       floor, dst, buf, nonzero_only)
                        or fast and inplace.local_outputs(pc, V[n], V2[n], aV[n], u, a_s, floor, dst, buf,
                                                          nonzero_only=nonzero_only)):
                    x, b = local_rules.head_outputs(pc, V[n], V2[n], aV[n], a_s, r, worst_case)
                    ref[n, rows], sig[n, rows], wor[n, rows] = x, b.sigma, b.worst
                wor[n, rows] += route_product(pc, tuple(x[n, rows] for x in softmax), aV.f64[n], buf)

            def route_product(pc: np.ndarray, softmax_c: tuple[np.ndarray, ...], aV_c: np.ndarray,
                              buf: Scratch) -> np.ndarray:
                """The chunk's route allowance through |V| (the whole stage's numbers, a chunk at a time, while its
                weights are in the cache); a block's over the keys up to the last nonzero route (0 · a finite
                value adds nothing), the sum's coefficient of the whole row's S."""
                if weights_local is not None and fast:
                    route = inplace.route_into(pc, softmax_c, buf("lr_route", pc.shape), buf)
                else:
                    route = local_rules.weights_route(pc, softmax_c if weights_local is not None else None,
                                                      lambda: softmax_c)
                k = seen_keys(route != 0) if nonzero_only else S
                return nonnegative_product(route[..., :k], aV_c[:, :k], length=S)

            each(outputs)
            out[STAGE.head_outputs] = finish(ref, sig, wor, (B, H, T, E))
        if has(*LOCAL_INPUTS[STAGE.concat]):
            out[STAGE.concat] = local_rules.concat(own[STAGE.head_outputs], r, worst_case)
        if has(*LOCAL_INPUTS[STAGE.output]):
            out[STAGE.output] = local_rules.output(own[STAGE.concat], w["w_o"], w.get("b_o"), r, worst_case)
    return out


def backward_bounds(golden: GoldenCase, dtype: str, forward: Mapping[str, Bound] | None = None,
                    table: ToleranceTable = DEFAULT_TOLERANCES, precision: str = "standard") -> dict[str, Bound]:
    """The allowed error of every backward stage (:func:`.model.backward.backward_bounds`); ``forward``:
    the forward stages' bounds under the same contract (default: :func:`golden_bounds`)."""
    if forward is None and precision == "standard":
        forward = golden_bounds(golden, dtype, precision, table)
    return backward_rules.backward_bounds(golden, dtype, forward, table, precision)


def backward_tolerances(golden: GoldenCase, dtype: str, forward: Mapping[str, np.ndarray] | None = None,
                        table: ToleranceTable = DEFAULT_TOLERANCES,
                        precision: str = "standard") -> dict[str, np.ndarray]:
    """Every backward error at its full size (:func:`.model.backward.backward_tolerances`); ``forward``:
    the forward stages' tolerances under the same contract (default: computed here)."""
    if forward is None:
        forward = (worst_case_tolerances(golden, dtype, table) if precision == "worst-case"
                   else stage_tolerances(golden, dtype, table, precision))
    return backward_rules.backward_tolerances(golden, dtype, forward, table, precision)
