"""The words every rule of the tolerance model is written in, forward and backward.

* :class:`Bound` — an allowed error ``LAMBDA·sigma + worst`` (docs/tolerances.md "The bound");
* :class:`Error` — an error as it propagates from stage to stage (noise, accumulation, what is
  carried worst-case), and its :class:`Bound` (:meth:`Error.bound`, the one conversion);
* :func:`product` — the error of a matrix product of operands that carry errors;
* :data:`LINEAR` — the layer's four linear maps by letter, with their stages;
* :class:`Rounding` — the rounding facts of one dtype under one precision contract: u, u_acc,
  γ_acc(n + k) (:func:`gamma`, worst-case), σ_acc(n + k) = sqrt(n + k)·u_acc (probabilistic), which of
  the two counts a sum (:class:`Acc`), the floor;
* :func:`stored` — the variance of storing an intermediate result in the dtype;
* :func:`upper32` — an upper bound of a product of non-negative operands, formed in float32;
* :func:`heads`, :func:`merge`, :func:`grouped` — the relabellings between (B, L, H·D) and
  (B, H, L, D), and a GQA group's query heads stacked.

Shapes (axis legend B, T, S, H, G = H_kv, D = D_k, E = D_v):
q (B,T,H·D), k (B,S,G·D), v (B,S,G·E), scores/attn (B,H,T,S),
heads (B,H,T,E), concat (B,T,H·E), output (B,T,d_out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ...spec import REGISTRY, STAGE
from ...spec.tolerance import ToleranceTable

PRECISIONS = ("standard", "worst-case")

#: Per-element allowance in units of sigma.  Under the model each element's error is a sum of
#: independent zero-mean roundings with |term_i| <= b_i and sigma² = Σ b_i², so by Hoeffding's
#: inequality P(|error| > LAMBDA·sigma) <= 2·exp(-LAMBDA²/2) = 2.5e-14 for LAMBDA = 8
#: (docs/tolerances.md).
LAMBDA = 8.0

#: Limit on the mean of (error/sigma)² over a stage (standard contract).  A rounding error
#: uniform in [-b, b] has mean square b²/3, so correct code averages <= 1/3; KAPPA = 1 leaves 3x.
KAPPA = 1.0

#: The mean-square test needs this many compared elements (fewer: element-wise test only).
KAPPA_MIN_ELEMENTS = 16

#: Unit roundoff of the golden itself (float64): its own rounding enters every bound.
U64 = 2.0**-53

#: Unit roundoff of float32, in which the bounds' own non-negative sums are formed (:func:`upper32`).
U32 = 2.0**-24


class Bound(NamedTuple):
    """Allowed error of every element: ``LAMBDA·sigma + worst`` (the floor is in ``worst``)."""

    sigma: np.ndarray  # rounding noise, root-sum-square (a standard-deviation bound)
    worst: np.ndarray  # worst-case part (accumulation, second order, floor)

    def tolerance(self, lam: float) -> np.ndarray:
        out = np.multiply(self.sigma, lam)
        if np.shape(out) == np.broadcast_shapes(np.shape(out), np.shape(self.worst)):
            out += self.worst  # one new array, not two (``lam * sigma + worst``): the same numbers
            return out
        return out + self.worst

    @classmethod
    def worst_case(cls, tolerance: np.ndarray) -> "Bound":
        """A tolerance taken whole as the worst-case part, no noise part (the worst-case contract)."""
        return cls(np.zeros_like(tolerance), tolerance)


class Error(NamedTuple):
    """An element's error as it propagates from stage to stage, forward and backward (docs/tolerances.md
    "The bound", docs/backward.md).  Each part is an array or a scalar (0.0: none):

    * ``var`` — rounding noise: the variance bound of the storage roundings that reached the element,
      propagated linearised (independent terms add);
    * ``acc`` — the stage's own accumulation error where it is counted worst-case (γ·Σ|ab|: short
      sums, and the worst-case contract; a long sum's is a standard deviation, in ``var``:
      :meth:`accumulated`); a later stage takes it as one more independent term of its variance
      (:attr:`total_var`);
    * ``lin`` — what is carried worst-case all the way: in the backward, the forward softmax's second
      order and P·V accumulation (0 in the forward rules).

    Its allowed error is :meth:`bound`: ``LAMBDA·sqrt(var) + lin + acc + floor``."""

    var: Any
    acc: Any = 0.0
    lin: Any = 0.0

    @property
    def total_var(self) -> Any:
        """The variance a later stage sees: the noise and this stage's accumulation."""
        return self.var + np.square(self.acc)

    def map(self, fn: Any) -> "Error":
        """``fn`` (a relabelling: heads, merge, group, transpose, reshape) on every array part."""
        return Error(*(fn(v) if np.ndim(v) else v for v in self))

    def accumulated(self, a: "Acc", zero_scalar: bool = False) -> "Error":
        """This error, whose ``acc`` holds Σ|a_i b_i| (+ |bias|) of the stage's sums, with their
        accumulation counted as ``a`` says: ``a.sigma``·Σ|ab| as a standard deviation, in ``var``, and
        ``a.worst``·Σ|ab| worst-case, in ``acc`` (one of the two is 0: :meth:`Rounding.accumulation`).
        ``zero_scalar``: a worst-case part of 0 stays the scalar 0, not an all-zero array as large as
        the stage (for a consumer that broadcasts it, e.g. :meth:`bound`)."""
        acc = 0.0 if zero_scalar and not a.worst else a.worst * self.acc
        return Error(self.var + np.square(a.sigma * self.acc), acc, self.lin)

    def scaled(self, f: float) -> "Error":
        """The error of ``f·x`` (an exact scaling)."""
        return Error(self.var * f * f, self.acc * f, self.lin * f)

    def bound(self, floor: float, shape: tuple[int, ...] | None = None) -> Bound:
        """The :class:`Bound` of this error (broadcast to ``shape``, if given): sigma = sqrt(var),
        worst = lin + acc + floor, each NaN made +inf (a bound that cannot be formed allows anything)."""
        var, worst = self.var, self.acc if not np.ndim(self.lin) and self.lin == 0 else self.lin + self.acc
        if shape is not None:
            var, worst = np.broadcast_to(var, shape), np.broadcast_to(worst, shape)
        sigma = inf_for_nan(np.sqrt(np.maximum(var, 0.0)))
        if np.ndim(worst) or not np.ndim(sigma):
            return Bound(sigma, inf_for_nan(worst + floor))
        return Bound(sigma, np.broadcast_to(inf_for_nan(np.asarray(worst + floor)), sigma.shape))


#: No error: an exact operand (the inputs, the weights, the given output gradient).
EXACT = Error(0.0)


def product(a: np.ndarray, ea: Error, b: np.ndarray, eb: Error, g: float, u: float,
            stored_as: tuple[np.ndarray, ...] | None = None, bias: np.ndarray | None = None) -> Error:
    """The error of ``a @ b (+ bias)`` when ``a`` and ``b`` carry ``ea`` and ``eb`` (the bias is exact):

    var = T²_a @ b² + a² @ T²_b (+ the storage roundings of ``stored_as``, :func:`stored`),
    lin = lin_a @ |b| + |a| @ lin_b, acc = g·(|a|@|b| + |bias|) (``g`` = γ_acc(n + k) of its length-n
    sums; 1: Σ|ab| itself, for :meth:`Error.accumulated`).  ``stored_as``: the values stored in the dtype (None: the caller stores the result)."""
    A = np.abs
    var: Any = 0.0 if stored_as is None else stored(u, *stored_as)
    lin: Any = 0.0
    if np.any(np.asarray(ea.total_var)):
        var = var + np.broadcast_to(ea.total_var, a.shape) @ (b * b)
    if np.any(np.asarray(eb.total_var)):
        var = var + (a * a) @ np.broadcast_to(eb.total_var, b.shape)
    if np.any(np.asarray(ea.lin)):
        lin = lin + np.broadcast_to(ea.lin, a.shape) @ A(b)
    if np.any(np.asarray(eb.lin)):
        lin = lin + A(a) @ np.broadcast_to(eb.lin, b.shape)
    mag = A(a) @ A(b)
    return Error(var, g * (mag if bias is None else mag + A(bias)), lin)


class Linear(NamedTuple):
    """One of the layer's four linear maps ``y = x W + b``, named by its letter (``q``, ``k``, ``v``, ``o``:
    the letters of :data:`~mhaspec.spec.backward.INPUT_GRADIENTS`), with the stages it makes."""

    x: str  # its input: an input tensor (query, key, value) or, for ``o``, the concat stage
    weight: str
    bias: str
    y: str  # the stage it computes
    d_y: str | None  # that stage's gradient (None for ``o``: d_output is given)
    d_weight: str
    d_bias: str

    def input_of(self, golden: Any) -> np.ndarray:
        """The input ``x`` of this map in ``golden`` (an input tensor, or the concat stage)."""
        return golden.stages[self.x] if self.x in REGISTRY else golden.inputs[self.x]


#: The layer's linear maps by letter (q, k, v: the projections; o: the output projection).
LINEAR: dict[str, Linear] = {
    "q": Linear("query", "w_q", "b_q", STAGE.q_proj, STAGE.d_q_proj, STAGE.d_w_q, STAGE.d_b_q),
    "k": Linear("key", "w_k", "b_k", STAGE.k_proj, STAGE.d_k_proj, STAGE.d_w_k, STAGE.d_b_k),
    "v": Linear("value", "w_v", "b_v", STAGE.v_proj, STAGE.d_v_proj, STAGE.d_w_v, STAGE.d_b_v),
    "o": Linear(STAGE.concat, "w_o", "b_o", STAGE.output, None, STAGE.d_w_o, STAGE.d_b_o),
}


def gamma(n: int | np.ndarray, u: float) -> np.ndarray:
    """γ(n) = n·u / (1 - n·u): the relative bound of a length-n sum (inf once n·u >= 1)."""
    if isinstance(n, (int, np.integer)):  # one length (most calls): the same value, without arrays
        nu = float(n) * u
        return np.float64(nu / (1 - nu) if nu < 1 else np.inf)  # type: ignore[return-value]
    nu = np.asarray(n, dtype=np.float64) * u
    with np.errstate(divide="ignore"):
        return np.where(nu < 1, nu / np.maximum(1 - nu, 0), np.inf)


class Acc(NamedTuple):
    """How a length-n sum's accumulation error is counted, as coefficients of Σ|a_i b_i|
    (:meth:`Rounding.accumulation`): ``worst`` (γ_acc(n + k), added to the bound) or ``sigma``
    (σ_acc(n + k), a standard deviation, LAMBDA times it in the bound); the other is 0."""

    worst: float
    sigma: float


class Rounding(NamedTuple):
    """The rounding facts of one dtype under one precision contract (:func:`rounding`)."""

    u: float  # the dtype's unit roundoff: one rounding of a stored result
    acc: float  # the accumulator's: float32 for 16-bit dtypes under the standard contract, else u
    store: float  # storage roundings a backward sum counts on top of its accumulation (3 standard, 0 worst-case)
    k: int  # extra roundings inside a sum (bias add, scale, storing, the golden's own)
    floor: float  # the dtype's absolute floor: its smallest normal number (flushed subnormals)
    probabilistic: bool = False  # long sums' accumulation counted as noise (the standard contract's forward)

    def gamma(self, n: int) -> float:
        """γ_acc(n + k): the relative bound of a length-n sum in the accumulator."""
        return float(gamma(n + self.k, self.acc))

    def sigma(self, n: int) -> float:
        """σ_acc(n + k) = sqrt(n + k)·u_acc: the standard-deviation bound, relative to Σ|a_i b_i|, of a
        length-n sum's accumulation (Higham & Mary's probabilistic bound): each of its n + k roundings
        is an independent zero-mean term at most u_acc·Σ|a_i b_i| (every partial sum is at most that),
        so their variance is at most (n + k)·u_acc²·(Σ|a_i b_i|)², whatever the summation order
        (docs/tolerances.md "The bound", "This stage's own accumulation error")."""
        return float(np.sqrt(n + self.k) * self.acc)

    def accumulation(self, n: int) -> Acc:
        """How a length-n sum's accumulation is counted: under the standard contract, as a standard
        deviation σ_acc(n + k) wherever LAMBDA·σ_acc(n + k) < γ_acc(n + k) (n + k > LAMBDA² = 64: the
        probabilistic bound is the smaller one), else worst-case, γ_acc(n + k); under the worst-case
        contract always worst-case."""
        g = self.gamma(n)
        if self.probabilistic and LAMBDA * self.sigma(n) < g:
            return Acc(0.0, self.sigma(n))
        return Acc(g, 0.0)

    def rel(self, n: int | np.ndarray) -> np.ndarray:
        """ρ(n) = γ_acc(n + k) + store·u: a length-n sum of products with its storage, worst-case
        (the backward's bounds, docs/backward.md)."""
        return gamma(np.asarray(n) + self.k, self.acc) + self.store * self.u


def rounding(dtype: str, precision: str, table: ToleranceTable) -> Rounding:
    """:class:`Rounding` of ``dtype``: ``"standard"`` accumulates in float32 or wider (the dtype's own
    for float64), ``"worst-case"`` in the dtype itself (docs/tolerances.md "The precision contract")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    rule = table.dtypes[dtype]
    u = rule.unit_roundoff
    if precision == "worst-case":
        return Rounding(u, u, 0.0, table.extra_ops, rule.floor)
    return Rounding(u, min(u, table.dtypes["float32"].unit_roundoff), 3.0, table.extra_ops, rule.floor, True)


def stored(u: float, *values: np.ndarray) -> np.ndarray:
    """Variance bound of storing each of ``values`` in the dtype (one rounding each) plus the
    golden's own float64 rounding of the last: ``U64²·values[-1]² + Σ u²·v²``."""
    out = U64**2 * values[-1] ** 2
    for v in values:
        out = out + u**2 * v**2
    return out


class Pair:
    """A right-hand operand of :func:`upper32` in float64 and, cast once, in float32.

    The products read the float32 copy; the float64 one only the fallback of a product beyond
    float32's range (an adapter's own wild values) and a caller's float64 product.  A pair made
    :meth:`lazy` holds the float32 copy alone and makes the float64 one, the same numbers, when it
    is first read: the key side of a block of a large case is half the memory."""

    __slots__ = ("f32", "_f64", "_make")

    def __init__(self, f64: np.ndarray | None, f32: np.ndarray, make: Callable[[], np.ndarray] | None = None):
        self.f32, self._f64, self._make = f32, f64, make

    @classmethod
    def of(cls, x: np.ndarray) -> "Pair":
        return cls(x, x.astype(np.float32))

    @classmethod
    def lazy(cls, make: Callable[[], np.ndarray]) -> "Pair":
        """The pair of ``make()`` (a pure function: it makes the same array every time), holding its float32 cast."""
        return cls(None, make().astype(np.float32), make)

    @property
    def f64(self) -> np.ndarray:
        if self._f64 is None:
            assert self._make is not None
            self._f64 = self._make()
        return self._f64

    def __getitem__(self, index: Any) -> "Pair":
        if self._f64 is not None:
            return Pair(self._f64[index], self.f32[index])
        return Pair(None, self.f32[index], lambda: self.f64[index])


def upper32(a: np.ndarray, b: Pair, length: int | None = None) -> np.ndarray:
    """``a @ b`` for non-negative ``a`` and ``b``, formed in float32 and rounded up.

    A sum of n non-negative terms in float32 is below the exact one by at most γ₃₂(n + 2)
    relative (two more roundings: the inputs'); multiplying by 1 + 2γ₃₂ keeps it an upper
    bound, at half the cost of a float64 product.  Callers scale ``a`` and ``b`` to O(1)
    magnitudes so that nothing that matters underflows.  ``length``: the n to count (at least
    ``a``'s last axis; a row's whole length where the caller left out its zero terms)."""
    n = (a.shape[-1] if length is None else length) + 2
    with np.errstate(over="ignore", invalid="ignore"):
        out = (a.astype(np.float32) @ b.f32).astype(np.float64)
    if not np.isfinite(out).all():  # beyond float32's range (an adapter's own wild values)
        return a @ b.f64
    return out * (1 + 2 * gamma(n, U32))


def nonnegative_product(a: np.ndarray, b: np.ndarray, length: int | None = None) -> np.ndarray:
    """An upper bound of ``a @ b`` for non-negative ``a`` (N, T, S) and ``b`` (N, S, E), in float64:
    the computed sum is below the exact one by at most γ₆₄(S) relative.  ``length``: the S to count
    (a row's whole length where the caller left out its zero terms)."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = a @ b
    out *= 1 + gamma(a.shape[-1] if length is None else length, U64)
    return inf_for_nan(out)


def inf_for_nan(x: np.ndarray) -> np.ndarray:
    """``x`` with every NaN made +inf, in place: a bound that cannot be formed allows anything."""
    np.copyto(x, np.inf, where=np.isnan(x))
    return x


def heads(x: np.ndarray, n_heads: int, group: int = 1) -> np.ndarray:
    """(B, L, n_heads·D) -> (B, n_heads·group, L, D), repeating each head ``group`` times (GQA)."""
    B, L, F = x.shape
    return np.repeat(x.reshape(B, L, n_heads, F // n_heads).transpose(0, 2, 1, 3), group, axis=1)


def merge(x: np.ndarray) -> np.ndarray:
    """(B, H, T, E) -> (B, T, H·E): heads concatenated in head order."""
    B, H, T, E = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * E)


def swap(x: np.ndarray) -> np.ndarray:
    """The last two axes exchanged: ``K`` (…, S, D) -> ``Kᵀ`` (…, D, S)."""
    return np.swapaxes(x, -1, -2)


def grouped(x: np.ndarray, kv_heads: int) -> np.ndarray:
    """(B, H, T, F) -> (B, G, group·T, F): a GQA group's query heads stacked along T."""
    B, H, T, F = x.shape
    return x.reshape(B, kv_heads, (H // kv_heads) * T, F)


def grouped_t(x: np.ndarray, kv_heads: int) -> np.ndarray:
    """(B, H, T, F) -> (B, G, F, group·T): :func:`grouped`, transposed (the summed axis last)."""
    return swap(grouped(x, kv_heads))
