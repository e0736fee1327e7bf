"""Recognisable signatures of common MHA bugs, read off a failing case.

The verdict never depends on this module: it only adds a hint to a case that
already fails, naming the bug when the returned values fit one of these
patterns (checked on the failing forward stages, first failing stage first).

A signature is named only on evidence, in the dtype's own terms.  The
*tolerance* of an element is the standard precision contract's
(``LAMBDA·sigma + worst`` with the golden's own error: the verdict's, under the
default ``--precision``).  A signature's *alternative* is the golden as the bug
computes it, with a tolerance of its own; it *explains* the returned values
(:func:`explains`) when all of these hold, on the compared entries:

- **fit**: every returned value is within :data:`FIT` = 2 tolerances of the
  alternative (a correct implementation stays within 1 of the golden);
- **nearer**: the worst error/tolerance against the golden is at least
  :data:`CLOSER` = 10 times the worst against the alternative;
- **apart**: the alternative is more than :data:`APART` = 4 tolerances from the
  golden on at least :data:`MIN_APART` = 8 entries (the entries that carry the
  evidence, not one or two).

A returned stage with fewer than :data:`MIN_VALUES` = 8 finite values, or whose
finite values are all equal (all zeros, a constant), gets no signature, nor do
non-finite values except as below.  Zeros and noise fit no alternative, and a
result that is right but imprecise is nearer the golden than any alternative:
they get none.

The signatures and their tests:

- *a wrong scale* (``scores``): the alternative is the golden × c, c the median
  of returned/golden over the scores above 1e-3 of the largest; its tolerance is
  |c| × the golden's (each term of the scores' bound scales with the scale);
- *heads in the wrong order* (stages with one slice per query head): each
  returned head h is within FIT tolerances of exactly one golden head perm[h]
  (that head's tolerance), perm is a permutation other than the identity, and
  the permuted golden explains the stage;
- *rows that see no key*: every row that sees some key is finite and within its
  tolerance (only the rows that see none fail), and those rows are NaN/inf —
  or uniform: weights within :data:`UNIFORM_ULPS` = 2 unit roundoffs of 1/S;
  head outputs, concat, output: the mean of the values, explained with the
  largest tolerance of the other rows as its tolerance (a uniform row is an
  ordinary attention output: its rounding is theirs);
- *a weight transposed* (``q_proj``, ``k_proj``, ``v_proj``, ``output``; square
  weights): the alternative is x @ Wᵀ + b (x: the golden's input of the
  stage); its tolerance is the golden's, scaled element-wise where the
  transposed product's magnitudes (|x|·|Wᵀ| + |b|) exceed the golden's
  (|x|·|W| + |b|, what the accumulation terms are made of), plus one unit
  roundoff of its value (the rounding of a different result);
- *computed in a narrower dtype* (float64 asked: float32, float16, bfloat16;
  float32 asked: float16, bfloat16): no other signature, and every failing
  stage passes the narrower dtype's standard judgement (each element within its
  tolerance, and the systematic-error test), that dtype's tolerance being
  sharp enough to tell (at most :data:`SHARP` × the stage's largest value: 64
  unit roundoffs of a 16-bit type, 4096 of float32, whose tolerance holds
  float32 sums — a case like large_logits, where it is wider, could hide a
  small bug), with at least :data:`NARROW_MIN_VALUES` = 32 compared entries in
  all, and a worst error at least :data:`BEYOND` = 64 times the asked dtype's
  tolerance.  The widest such dtype is named (float16 yields to bfloat16 when
  nearly every value is a bfloat16 number and the golden's are not), with the
  stages: "every stage", "attn_weights onward", or their list.  A 16-bit dtype
  is named only when every value is one of its numbers (:data:`SIXTEEN_BIT`): a
  float64 output off by a wrong scale of 1 + 1e-4 is float16-accurate too.  float16 asked
  has none: bfloat16's rounding is only 8 times float16's, too close to tell
  from imprecision (compare.py's representability fingerprint names it in the
  verdict's message);
- *float32 matmuls in reduced precision* (float32 asked; TF32: every product's
  operands rounded to 10 mantissa bits, or bfloat16x3 splits; checked before the
  narrower dtype, which it pre-empts): with the stages around the products
  exposed, at least two product stages (of scores, head_outputs, output) fail
  float32's local check, each passing float16's (a 10-bit rounding
  of its inputs is float16's storage term), a failing projection passes
  float16's judgement, and the softmax's and the concat's local checks hold (a
  run computed in float16 fails those: its weights are float16 numbers; a wrong
  scale fails only the scores' local check, and is named a wrong scale first),
  on weights that are not all equal, and not every value of the failing stages
  is a float16 (or bfloat16) number;
  output only: the output's error is that of a run whose every product is TF32
  (or bfloat16x3), everything else exact (:func:`reduced_output`): correlation
  at least :data:`REDUCED_CORRELATION` = 0.9, sizes within
  :data:`REDUCED_SIZE` = 1.25×, that run's error beyond APART tolerances on
  MIN_APART entries.

The attention variants' bugs (a window off by one, RoPE style swapped, softcap missing, …) are named
by :mod:`.diagnose_variants`, under the same rule of evidence, before these.

Large cases (above blocks.MAX_BLOCK_ELEMENTS) are diagnosed on their first block
of query rows.  benchmarks/diagnosis_confusion.py runs the zoo of
tests/variants.py through it: no variant is given a wrong signature, in any dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..fixtures import GoldenCase
from ..spec import REGISTRY, STAGE, STAGES, compared_entries, downstream
from . import judging
from .blocks import MAX_BLOCK_ELEMENTS, _slice_stage, block_case, stage_shape
from .compare import (FAIL, NOT_EXPOSED, PASS, StageResult, as_float_array, compare_stage, representable,
                      round_to_bfloat16)
from .tolerance import (KAPPA, KAPPA_MIN_ELEMENTS, LAMBDA, LOCAL_INPUTS, backward_bounds, heads, judging_bounds,
                        local_references)
from . import diagnose_variants  # the attention variants: their bugs, their float64 steps
from .diagnose_variants import uses_variants, variant_hints

#: unit roundoff of each dtype
EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: forward stages whose second axis is the query head: (B, H, T, ·)
HEAD_AXIS_STAGES = tuple(name for name in STAGES if REGISTRY[name].head_axis_first)
#: forward stages of the attention proper that hold one slice per query head (heads on an axis of
#: their own, or packed with the features): where heads can come back in the wrong order
PER_HEAD_STAGES = tuple(name for name in STAGES if REGISTRY[name].attends and REGISTRY[name].heads is not None)
#: the stages from the softmax on: those a query row that sees no key can make fail
AFTER_SOFTMAX = downstream(STAGE.attn_weights)
#: the narrower dtypes a run in each dtype is tested for, widest first
NARROWER = {"float64": ("float32", "float16", "bfloat16"), "float32": ("float16", "bfloat16"),
            "float16": (), "bfloat16": ()}

#: the alternative fits: every compared returned value within FIT of its tolerances
FIT = 2.0
#: the alternative differs from the golden by more than APART tolerances ...
APART = 4.0
#: ... on at least MIN_APART entries
MIN_APART = 8
#: the returned values are at least CLOSER times nearer the alternative than the golden (worst
#: error / tolerance against each)
CLOSER = 10.0
#: fewest finite entries a signature is read from
MIN_VALUES = 8
#: a narrower dtype: the worst error of a failing stage at least BEYOND times the asked dtype's tolerance
BEYOND = 64.0
#: a narrower dtype's tolerance sharp enough to tell: at most SHARP[dtype] × the stage's largest value
#: (64 unit roundoffs of a 16-bit type; float32's, whose tolerance holds float32 sums, 4096): where
#: it is wider (large logits) a small bug hides in it
SHARP = {"float32": 2.0**-12, "float16": 2.0**-5, "bfloat16": 2.0**-2}
#: fewest compared entries (all the failing stages together) a narrower dtype is read from
NARROW_MIN_VALUES = 32
#: a float16 fit whose values nearly all fit bfloat16 (and the golden's do not) is bfloat16's
NARROW_FRACTION = 0.9
#: a run read as computed in one of these needs every value to be one of its numbers (a float32 or
#: float64 result that is merely 16-bit-accurate is as likely a small bug: a scale off by 1e-4)
SIXTEEN_BIT = ("float16", "bfloat16")
#: uniform weights: within this many unit roundoffs of 1/S
UNIFORM_ULPS = 2.0
#: the stages that are one matrix product each (plus a bias, a scale): those a reduced-precision
#: float32 matmul unit computes
MATMUL_STAGES = (STAGE.q_proj, STAGE.k_proj, STAGE.v_proj, STAGE.scores, STAGE.head_outputs, STAGE.output)
#: the reduced-precision float32 matmul units the output-only test tries, as their operands are rounded
REDUCED_MATMULS = ("tf32", "bf16x3")
#: a reduced-precision matmul's local evidence is read against this dtype's local tolerance (TF32
#: keeps float16's 10 mantissa bits; bfloat16x3's error is smaller still)
REDUCED_LOCAL = "float16"
#: output only: the error of the returned output (against the golden) and that of a reduced-precision
#: run correlate at least this much, and their sizes (root of the sum of squares) are within this
#: factor (a wrong scale's error, a dropped key's, correlate with a TF32 run's near 0; a TF32 run's,
#: 0.999 at T = S = 1024)
REDUCED_CORRELATION = 0.9
REDUCED_SIZE = 1.25
#: a reduced-precision matmul fails the local check of at least this many products (a wrong scale
#: fails the scores' alone)
MIN_REDUCED_STAGES = 2


def _ratio(err: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """err / tol element-wise; inf where tol = 0 < err, 0 where both are 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tol > 0, err / np.where(tol > 0, tol, 1.0), np.where(err > 0, np.inf, 0.0))


def degenerate(got: np.ndarray) -> bool:
    """Too few finite values to read a signature from, or they are all equal (all zeros, a constant)."""
    finite = got[np.isfinite(got)]
    return finite.size < MIN_VALUES or bool(np.all(finite == finite.flat[0]))


def explains(got: np.ndarray, alt: np.ndarray, golden: np.ndarray, tol_alt: np.ndarray, tol: np.ndarray) -> bool:
    """The alternative ``alt`` explains ``got`` and the golden does not: the module's fit, nearer and
    apart tests, on the entries given (every argument of one shape, or broadcastable to it)."""
    got, alt = np.broadcast_arrays(got, alt)
    if got.size < MIN_VALUES or not np.all(np.isfinite(got)) or not np.all(np.isfinite(alt)):
        return False
    tol_alt, tol = np.broadcast_to(tol_alt, got.shape), np.broadcast_to(tol, got.shape)
    fit = float(np.max(_ratio(np.abs(got - alt), tol_alt)))
    if fit > FIT:
        return False
    with np.errstate(invalid="ignore"):
        if float(np.max(_ratio(np.abs(got - golden), tol))) < CLOSER * fit:
            return False
        apart = _ratio(np.abs(alt - golden), tol) > APART
    return int(np.count_nonzero(apart)) >= MIN_APART


def _evidence(alternative: str) -> str:
    """The test :func:`explains` passed, in a few words."""
    return f"within {FIT:g} tolerances of {alternative}, {CLOSER:g}× nearer than to the golden"


class _Evidence:
    """One failing case: the golden, the returned stages as float64, tolerances by dtype (lazily)."""

    def __init__(self, golden: GoldenCase, returned: Mapping[str, np.ndarray], dtype: str):
        self.golden, self.returned, self.dtype = golden, returned, dtype
        self._judging: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}
        self._backward: dict[str, dict[str, np.ndarray]] = {}  # dtype -> the backward stages' tolerances

    def _bounds(self, dtype: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        if dtype not in self._judging:
            raw, tols = judging.derived(self.golden, ("judging", dtype, "standard"),
                                        lambda: judging_bounds(self.golden, dtype, "standard"))
            self._judging[dtype] = (judging.with_reference_error(self.golden, raw), tols)
        return self._judging[dtype]

    def _backward_tols(self, dtype: str) -> dict[str, np.ndarray]:
        """The standard tolerance of every backward stage in ``dtype`` (the runner's bounds, from the forward's)."""
        if dtype not in self._backward:
            raw = judging.derived(self.golden, ("judging", dtype, "standard"),
                                  lambda: judging_bounds(self.golden, dtype, "standard"))[0]
            bounds = judging.derived(self.golden, ("backward", dtype, "standard"),
                                     lambda: backward_bounds(self.golden, dtype, raw, precision="standard"))
            self._backward[dtype] = {k: b.tolerance(LAMBDA) for k, b in bounds.items()}
        return self._backward[dtype]

    def tol(self, stage: str, dtype: str | None = None) -> np.ndarray:
        """The standard tolerance of every element of ``stage`` in ``dtype`` (default: the one asked)."""
        dtype = dtype or self.dtype
        tols = self._backward_tols(dtype) if REGISTRY[stage].direction == "backward" else self._bounds(dtype)[1]
        return np.broadcast_to(tols[stage], self.golden.stages[stage].shape)

    def selected(self, stage: str) -> np.ndarray:
        """Which entries of ``stage`` are compared (bool, the stage's shape)."""
        sel = compared_entries(stage, self.golden.visible)
        shape = self.golden.stages[stage].shape
        return np.ones(shape, bool) if sel is None else np.broadcast_to(sel, shape)

    def passes(self, stage: str, dtype: str) -> bool:
        """``stage`` passes the standard judgement in ``dtype`` against the golden (values aside)."""
        bounds, tols = self._bounds(dtype)
        res = compare_stage(stage, self.returned[stage], self.golden.stages[stage], tols[stage], dtype,
                            compared_entries(stage, self.golden.visible), noise=bounds[stage],
                            rms_limit=KAPPA**0.5, rms_min_elements=KAPPA_MIN_ELEMENTS, value_checks=False)
        return res.verdict == PASS


def constant_factor(ev: _Evidence, stage: str = STAGE.scores) -> str:
    """'the golden × c' when every compared score is the golden times one constant c != 1."""
    got, gold, tol, sel = ev.returned[stage], ev.golden.stages[stage], ev.tol(stage), ev.selected(stage)
    g, v = gold[sel], got[sel]
    if g.size < MIN_VALUES or not np.all(np.isfinite(v)):
        return ""
    big = np.abs(g) > 1e-3 * np.max(np.abs(g))
    if np.count_nonzero(big) < MIN_VALUES:
        return ""
    c = float(np.median(v[big] / g[big]))
    if not np.isfinite(c) or c == 0 or not explains(v, c * g, g, abs(c) * tol[sel], tol[sel]):
        return ""
    inverse = f" (1/{1 / c:.4g})" if abs(c) < 1 else ""
    return (f"the returned scores are the golden × {c:.4g}{inverse} everywhere: a wrong scale "
            f"(the spec's scale is multiplied in once; 1/sqrt(D_k) unless the config sets it) "
            f"[{_evidence('the golden × c')}]")


def _heads_first(x: np.ndarray, stage: str, heads: int) -> np.ndarray:
    """``x`` (a stage's shape) with the query head as the first axis."""
    if stage in HEAD_AXIS_STAGES:
        return np.moveaxis(x, 1, 0)
    split = x.reshape(*x.shape[:-1], heads, -1)  # (B, T, H·D): split the last axis into heads
    return np.moveaxis(split, split.ndim - 2, 0)


def head_permutation(ev: _Evidence, stage: str) -> str:
    """'heads in the wrong order' when returned head h equals golden head perm[h] for a permutation != identity."""
    heads = ev.golden.spec.config.H
    if heads < 2:
        return ""
    got, gold = ev.returned[stage], ev.golden.stages[stage]
    v, g = _heads_first(got, stage, heads), _heads_first(gold, stage, heads)
    tol, sel = _heads_first(np.array(ev.tol(stage)), stage, heads), _heads_first(ev.selected(stage), stage, heads)
    perm = []
    for h in range(heads):
        match = [j for j in range(heads) if sel[j].any()
                 and float(np.max(_ratio(np.abs(v[h][sel[j]] - g[j][sel[j]]), tol[j][sel[j]]))) <= FIT]
        if len(match) != 1:
            return ""
        perm.append(match[0])
    if sorted(perm) != list(range(heads)) or perm == list(range(heads)):
        return ""
    both = sel[perm] & sel
    if not explains(v[both], g[perm][both], g[both], tol[perm][both], tol[both]):
        return ""
    return (f"heads in the wrong order: returned head h is golden head perm[h], perm = {perm} "
            f"(a head axis split or merged in the wrong order) [each head within {FIT:g} tolerances of one "
            f"golden head only; {_evidence('the permuted golden')}]")


def _blind(ev: _Evidence, stage: str) -> np.ndarray:
    """The stage's entries in the query rows that see no key (bool, the stage's shape)."""
    blind = ~ev.golden.visible.any(axis=-1)  # (B, H, T)
    shape = ev.golden.stages[stage].shape
    if REGISTRY[stage].head_axis_first:  # (B, H, T, ·)
        return np.broadcast_to(blind[..., None], shape)
    return np.broadcast_to(blind.any(axis=1)[..., None], shape)  # (B, T, ·)


def blind_rows(ev: _Evidence, stage: str) -> str:
    """NaN or uniform attention on the query rows that see no key, when only those rows fail."""
    golden = ev.golden
    if stage not in AFTER_SOFTMAX or golden.visible.any(axis=-1).all():
        return ""
    got, gold, tol = ev.returned[stage], golden.stages[stage], ev.tol(stage)
    rows, sel = _blind(ev, stage), ev.selected(stage)
    others = ~rows & sel
    if not others.any():
        return ""
    v_out = got[others]
    if not np.all(np.isfinite(v_out)) or float(np.max(_ratio(np.abs(v_out - gold[others]), tol[others]))) > 1.0:
        return ""  # the other rows fail too: not (only) the rows that see no key
    per_head = REGISTRY[stage].head_axis_first
    blind = ~golden.visible.any(axis=-1)
    n = int(blind.sum()) if per_head else int(blind.any(axis=1).sum())
    where = f"the {n} query row(s) that see no key"
    if not np.all(np.isfinite(got[rows])):
        return (f"NaN in {where} (a softmax over only -inf; spec: zero weights, zero head outputs, output = b_o) "
                f"[every other row within its tolerance]")
    if stage == STAGE.attn_weights:
        S = got.shape[-1]
        alt = np.full(int(np.count_nonzero(rows)), 1.0 / S)
        if explains(got[rows], alt, gold[rows], UNIFORM_ULPS * EPS[ev.dtype] / S, tol[rows]):
            return (f"{where} attend uniformly (weight 1/S = {1 / S:.4g} on every key: masked logits filled "
                    f"with a finite number instead of -inf); spec: zero weights [within {UNIFORM_ULPS:g} unit "
                    f"roundoffs of 1/S, every other row within its tolerance]")
        return ""
    v = golden.stages[STAGE.v_proj]  # (B, S, G·E): uniform attention averages the values over S
    H, G = golden.spec.config.H, golden.spec.config.H_kv
    mean = v.reshape(v.shape[0], v.shape[1], G, -1).mean(axis=1)  # (B, G, E)
    heads = np.repeat(mean, H // G, axis=1)  # (B, H, E)
    uniform_heads = np.broadcast_to(heads[:, :, None, :], golden.stages[STAGE.head_outputs].shape)  # (B, H, T, E)
    if stage == STAGE.head_outputs:
        alt = uniform_heads
    else:
        concat = uniform_heads.transpose(0, 2, 1, 3).reshape(golden.stages[STAGE.concat].shape)
        if stage == STAGE.concat:
            alt = concat
        else:
            w = golden.weights
            alt = concat @ w["w_o"] + (w["b_o"] if "b_o" in w else 0)
    # a uniform row is an ordinary attention output (weights 1/S): its rounding is the other rows' size
    tol_alt = float(np.max(tol[others]))
    if explains(got[rows], alt[rows], gold[rows], tol_alt, tol[rows]):
        return (f"{where} attend uniformly (the mean of the values: masked logits filled with a finite "
                f"number instead of -inf); spec: zero head outputs, output = b_o [those rows "
                f"{_evidence('uniform attention')}; every other row within its tolerance]")
    return ""


def transposed_weight(ev: _Evidence, stage: str) -> str:
    """The stage equals the golden computed with its (square) weight matrix transposed."""
    golden = ev.golden
    w = golden.weights
    sources = {STAGE.q_proj: ("w_q", "b_q", golden.inputs["query"]), STAGE.k_proj: ("w_k", "b_k", golden.inputs["key"]),
               STAGE.v_proj: ("w_v", "b_v", golden.inputs["value"]),
               STAGE.output: ("w_o", "b_o", golden.stages[STAGE.concat])}
    if stage not in sources:
        return ""
    name, bias, x = sources[stage]
    if w[name].shape[0] != w[name].shape[1]:
        return ""
    b = w[bias] if bias in w else 0.0
    alt = x @ w[name].T + b
    # the bound's accumulation terms are made of |x|·|W| (+ |b|): scaled to the transposed product's,
    # element by element, where they grow; plus the rounding of the alternative's own value
    ours, theirs = np.abs(x) @ np.abs(w[name]) + np.abs(b), np.abs(x) @ np.abs(w[name].T) + np.abs(b)
    scale = np.maximum(np.where(ours > 0, theirs / np.where(ours > 0, ours, 1.0), 1.0), 1.0)
    tol = ev.tol(stage)
    if explains(ev.returned[stage], alt, golden.stages[stage], tol * scale + EPS[ev.dtype] * np.abs(alt), tol):
        label = "W^O" if name == "w_o" else f"W^{name[-1].upper()}"
        return (f"{stage} equals the golden computed with {label} ({name}) transposed: the weight is used as "
                f"(out, in); the canonical layout is (in, out), y = x @ W + b [{_evidence(f'x @ {label}ᵀ + b')}]")
    return ""


def _fits(v: np.ndarray, g: np.ndarray, asked: str, narrow: str) -> tuple[float, float]:
    """(the share of the nonzero values ``v`` that are ``narrow`` numbers, that of the golden's
    rounded to the asked dtype); (0, 1) when there are too few."""
    nonzero = v != 0
    if np.count_nonzero(nonzero) < MIN_VALUES:
        return 0.0, 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = g[nonzero].astype(np.float32 if asked == "float32" else np.float64).astype(np.float64)
    return float(np.mean(representable(v[nonzero], narrow))), float(np.mean(representable(rounded, narrow)))


def _all_fit(picked: Mapping[str, tuple[np.ndarray, ...]], asked: str, narrow: str, fraction: float) -> bool:
    """At least ``fraction`` of every stage's nonzero values are ``narrow`` numbers, and under half of
    the golden's (rounded to the asked dtype) are in one stage at least: the fit tells."""
    shares = [_fits(v, g, asked, narrow) for v, g, *_ in picked.values()]
    return all(ours >= fraction for ours, _ in shares) and any(theirs < 0.5 for _, theirs in shares)


def narrower_dtype(ev: _Evidence, stages: list[str]) -> tuple[str, float, float, bool] | None:
    """(narrower dtype, relative error, largest worst error / the asked dtype's tolerance, every value
    fits it) when every one of ``stages`` (the failing ones) passes the narrower dtype's standard
    judgement, with a tolerance sharp enough to tell, and one is far beyond the asked one's; else None."""
    picked = {}
    for stage in stages:
        got, gold, sel = ev.returned[stage], ev.golden.stages[stage], ev.selected(stage)
        v, g = got[sel], gold[sel]
        if degenerate(v) or not np.all(np.isfinite(v)):
            return None
        err = np.abs(v - g)
        picked[stage] = (v, g, err, float(np.max(_ratio(err, ev.tol(stage)[sel]))))
    if sum(v.size for v, *_ in picked.values()) < NARROW_MIN_VALUES or max(b for *_, b in picked.values()) < BEYOND:
        return None

    def fit(narrow: str) -> bool:
        return all(float(np.max(ev.tol(stage, narrow)[ev.selected(stage)])) <= SHARP[narrow] * float(np.max(np.abs(g)))
                   and ev.passes(stage, narrow) for stage, (v, g, _, _) in picked.items())

    narrow = next((n for n in NARROWER[ev.dtype] if fit(n)), None)
    if narrow is None:
        return None
    if narrow == "float16" and _all_fit(picked, ev.dtype, "bfloat16", NARROW_FRACTION) and fit("bfloat16"):
        narrow = "bfloat16"  # float16 numbers of bfloat16's 8 significant bits: bfloat16's
    rel = max(float(np.max(err) / max(float(np.max(np.abs(g))), np.finfo(np.float64).tiny))
              for v, g, err, _ in picked.values())
    fits = _all_fit(picked, ev.dtype, narrow, 0.99)
    if narrow in SIXTEEN_BIT and not fits:
        return None  # 16-bit-accurate values that are no 16-bit numbers: a small bug (a scale off by 1e-4) as likely
    return narrow, rel, max(b for *_, b in picked.values()), fits


def _tf32(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to float32, then to TF32's 10 explicit mantissa bits (ties to even), as float64."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x0FFF + ((bits >> 13) & 1)) >> 13) << 13
    out = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(f), out, f.astype(np.float64))


def reduced_matmul(a: np.ndarray, b: np.ndarray, unit: str, subscripts: str = "...ij,...jk->...ik") -> np.ndarray:
    """``a @ b`` (an einsum) in float64 from float32 operands as a reduced-precision unit rounds them:
    ``"tf32"``, both rounded to TF32; ``"bf16x3"``, each split a = hi + lo (hi = bfloat16(a),
    lo = bfloat16(a - hi)), hi·hi + hi·lo + lo·hi."""
    a32, b32 = np.asarray(a, np.float32).astype(np.float64), np.asarray(b, np.float32).astype(np.float64)
    if unit == "tf32":
        return np.einsum(subscripts, _tf32(a32), _tf32(b32), optimize=True)
    a_hi, b_hi = round_to_bfloat16(a32), round_to_bfloat16(b32)
    a_lo, b_lo = round_to_bfloat16(a32 - a_hi), round_to_bfloat16(b32 - b_hi)
    return sum(np.einsum(subscripts, x, y, optimize=True) for x, y in ((a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)))


def reduced_output(golden: GoldenCase, unit: str) -> np.ndarray:
    """The output as a float32 run computes it whose every matmul is ``unit`` (:func:`reduced_matmul`),
    everything else exact: the projections, Q Kᵀ, P V and concat W^O from operands rounded to
    float32 and then as the unit rounds them."""
    cfg, w, x = golden.spec.config, golden.weights, golden.inputs
    H, G = cfg.H, cfg.H_kv

    def project(inp: np.ndarray, name: str, bias: str) -> np.ndarray:
        return reduced_matmul(inp, w[name], unit) + (w[bias] if bias in w else 0.0)

    q, k, v = project(x["query"], "w_q", "b_q"), project(x["key"], "w_k", "b_k"), project(x["value"], "w_v", "b_v")
    q, k = diagnose_variants.turned(golden, q, k)  # the attention variants (RoPE; softcap, bias, ALiBi; sinks) exact
    Q, K, V = heads(q, H), heads(k, G, H // G), heads(v, G, H // G)  # (B, H, ·, D)
    s = reduced_matmul(Q, K, unit, "bhtd,bhsd->bhts") * float(cfg.scale)  # type: ignore[arg-type]
    p = diagnose_variants.weights(golden, diagnose_variants.modified(golden, s))
    o = reduced_matmul(p, V, unit, "bhts,bhse->bhte")
    concat = o.transpose(0, 2, 1, 3).reshape(o.shape[0], o.shape[2], -1)
    return reduced_matmul(concat, w["w_o"], unit) + (w["b_o"] if "b_o" in w else 0.0)


_REDUCED_TEXT = ("float32 matmuls computed in reduced precision (TF32-like: the operands of every product "
                 "rounded to 10 mantissa bits, or bfloat16x3 splits), accumulated in float32; the standard "
                 "contract multiplies float32 operands as they are (torch.backends.cuda.matmul.allow_tf32, "
                 "torch.set_float32_matmul_precision('high'), NVIDIA_TF32_OVERRIDE, XLA's default precision "
                 "on GPU/TPU)")


def reduced_precision_matmuls(ev: _Evidence, stages: Sequence[StageResult], failing: list[str],
                              exposed: list[str]) -> str:
    """A float32 run whose matmuls are TF32-like, named from the evidence (float32 asked only).

    With the stages around each product exposed: at least :data:`MIN_REDUCED_STAGES` matmul stages
    fail float32's local check, and each passes float16's (:data:`REDUCED_LOCAL`: the operands' 10-bit
    rounding is within its inputs' storage term), a failing projection passes float16's judgement,
    and the softmax's and the concat's local checks hold (a run in float16 fails those: its weights
    are float16 numbers).  With only the output exposed (no local check): its error is that of a run
    whose every product is TF32 or bfloat16x3 (:func:`reduced_output`): correlated at least
    :data:`REDUCED_CORRELATION`, of a size within :data:`REDUCED_SIZE`, that run's error more than
    APART tolerances on MIN_APART entries (not element-wise: the unit's rounding of the operands the
    run computes itself, P and concat, flips where they differ from the reduced run's by a float32
    rounding)."""
    if ev.dtype != "float32":
        return ""
    by_stage = {st.stage: st for st in stages}
    local = [st for st in MATMUL_STAGES if st in ev.returned and st in LOCAL_INPUTS
             and all(i in ev.returned for i in LOCAL_INPUTS[st])]
    if not local:  # only the output (or no product with its inputs): the output's error, against a reduced run
        if failing != [STAGE.output] or STAGE.output not in ev.returned:
            return ""
        got, gold, sel = ev.returned[STAGE.output], ev.golden.stages[STAGE.output], ev.selected(STAGE.output)
        tol = ev.tol(STAGE.output)[sel]
        v, g = got[sel], gold[sel]
        if not np.all(np.isfinite(v)):
            return ""
        mine = (v - g).ravel()
        for unit in REDUCED_MATMULS:
            theirs = (reduced_output(ev.golden, unit)[sel] - g).ravel()
            if np.count_nonzero(np.abs(theirs) > APART * tol.ravel()) < MIN_APART:
                continue  # that unit's error is too small to tell here
            size = float(np.sqrt((mine @ mine) / (theirs @ theirs)))
            corr = float(mine @ theirs) / float(np.sqrt((mine @ mine) * (theirs @ theirs)))
            if corr >= REDUCED_CORRELATION and 1 / REDUCED_SIZE <= size <= REDUCED_SIZE:
                name = "TF32" if unit == "tf32" else "bfloat16x3"
                return (f"{STAGE.output}: {_REDUCED_TEXT} [the output's error is a run's whose every product is "
                        f"{name}: correlation {corr:.3f}, size {size:.2f}×]")
        return ""
    for stage in failing:  # every failing stage: a product, or a stage that only carries the products' error
        if stage not in MATMUL_STAGES and stage not in (STAGE.attn_weights, STAGE.concat):
            return ""
    for stage in (STAGE.attn_weights, STAGE.concat):  # the softmax and the merge: right from their inputs
        st = by_stage.get(stage)
        if stage in ev.returned and (st is None or st.local_worst_ratio is None or "local" in st.failed_check):
            return ""
    weights = ev.returned.get(STAGE.attn_weights)
    if weights is None or degenerate(weights[ev.selected(STAGE.attn_weights)]):
        return ""  # no softmax to tell float32's from a 16-bit one (one key: every weight 1)
    picked = {st: (ev.returned[st][ev.selected(st)], ev.golden.stages[st][ev.selected(st)]) for st in failing}
    if any(_all_fit(picked, ev.dtype, narrow, 0.99) for narrow in SIXTEEN_BIT):
        return ""  # every value a 16-bit number: a run in that dtype, not float32 matmuls
    beyond = [stage for stage in local if stage in by_stage and "local" in by_stage[stage].failed_check]
    if len(beyond) < MIN_REDUCED_STAGES:
        return ""
    refs = local_references(ev.golden, dict(ev.returned), REDUCED_LOCAL)
    for stage in beyond:
        if stage not in refs:
            return ""
        ref, bound = refs[stage]
        sel = compared_entries(stage, ev.golden.visible)
        res = compare_stage(stage, ev.returned[stage], ref, bound.tolerance(LAMBDA), REDUCED_LOCAL, sel,
                            noise=bound, rms_limit=KAPPA**0.5, rms_min_elements=KAPPA_MIN_ELEMENTS,
                            value_checks=False)
        if res.verdict != PASS:
            return ""
    for stage in (STAGE.q_proj, STAGE.k_proj, STAGE.v_proj):
        if stage in failing and not ev.passes(stage, REDUCED_LOCAL):
            return ""
    return (f"{_where(failing, exposed)}: {_REDUCED_TEXT} [{', '.join(beyond)}: beyond float32's local tolerance, "
            f"within {REDUCED_LOCAL}'s; the softmax's local check holds]")


def _where(named: list[str], exposed: list[str]) -> str:
    """'every stage', 'attn_weights onward' or the stages, for the stages ``named`` of those ``exposed``."""
    if len(named) == 1:
        return named[0]
    if named == exposed:
        return "every stage"
    if named == exposed[exposed.index(named[0]):]:
        return f"{named[0]} onward"
    return ", ".join(named)


def diagnose(golden: GoldenCase, returned: Mapping[str, Any], dtype: str, stages: Sequence[StageResult]) -> list[str]:
    """Hints about the failing stages of one case (first failing stage first); [] when nothing is recognised."""
    named = variant_hints(golden, returned, dtype, stages)
    if named:
        return named
    # the forward stages (the backward ones have no signature here)
    failing = [st.stage for st in stages if st.verdict == FAIL and st.stage in returned and st.stage in STAGES]
    if not failing:
        return []
    exposed = [st.stage for st in stages if st.verdict != NOT_EXPOSED and st.stage in STAGES]
    arrays: dict[str, np.ndarray] = {}
    for stage in dict.fromkeys(failing + [s for s in exposed if s in returned]):
        got, _ = as_float_array(returned[stage])
        if got is not None and got.shape == stage_shape(golden, stage):  # (a large case's golden: not computed whole)
            arrays[stage] = got
    B, H, T, S = golden.visible.shape
    if B * H * T * S > MAX_BLOCK_ELEMENTS:  # a large case: its first block of query rows
        t1 = min(T, max(1, MAX_BLOCK_ELEMENTS // (H * S)))
        block = block_case(golden, 0, 0, t1)
        arrays = {k: _slice_stage(k, a, 0, 0, t1) for k, a in arrays.items()}
        with judging.judging_block(block, golden, {}):
            return _diagnose(_Evidence(block, arrays, dtype), failing, exposed, stages)
    return _diagnose(_Evidence(golden, arrays, dtype), failing, exposed, stages)


def _diagnose(ev: _Evidence, failing: list[str], exposed: list[str], stages: Sequence[StageResult]) -> list[str]:
    hints: list[str] = []
    present = [stage for stage in failing if stage in ev.returned]  # (not: a stage of the wrong shape)
    signed = len(present) < len(failing)  # then no narrower dtype either: not every failing stage fits it
    with np.errstate(all="ignore"):
        for stage in present:
            found = "" if degenerate(ev.returned[stage]) else (
                (constant_factor(ev) if stage == STAGE.scores else "")
                or (head_permutation(ev, stage) if stage in PER_HEAD_STAGES else "")
                or blind_rows(ev, stage)
                or transposed_weight(ev, stage)
            )
            signed = signed or bool(found)
            if found and not any(found in h for h in hints):
                hints.append(f"{stage}: {found}")
        reduced = "" if signed else reduced_precision_matmuls(ev, stages, failing, exposed)
        if reduced:
            hints.append(reduced)
        # output only, in a variant case: a softcap's saturation or a dominant sink can shrink a small bug's
        # effect on the output to a float32 rounding's size (a scale off by 1e-4 read as float32): not read
        blind = exposed == [STAGE.output] and uses_variants(ev.golden)
        fit = None if signed or reduced or blind else narrower_dtype(ev, failing)
    if fit is not None:
        narrow, rel, beyond, fits = fit
        hints.append(f"{_where(failing, exposed)}: {narrow}-accurate (errors ≈ {rel:.0e} relative, {ev.dtype} "
                     f"asked: within {narrow}'s tolerance, up to {beyond:.2g}× {ev.dtype}'s)"
                     f"{f'; every value fits {narrow}' if fits else ''}: computed in {narrow} and widened to "
                     f"{ev.dtype} (a cast, autocast, default dtype or library function narrower than the one "
                     f"asked for)")
    return hints
