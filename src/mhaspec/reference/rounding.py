"""Correctly rounded elementary functions for the exact reference: tanh (in softcap) and its derivative
1 − tanh² (softcap′, in the backward), cos and sin (in RoPE) and the log-sum-exp, each rounded once to
float64.

numpy's and libm's ``tanh``, ``sin``, ``cos`` and ``log`` may differ in the last bit between platforms;
the fixtures must not.  Each function here evaluates its value in :mod:`decimal` (whose ``+ − × ÷``,
``exp`` and ``ln`` are correctly rounded at the context's precision) together with a bound on the
error of that evaluation, and rounds to float64 by **Ziv's test**: when both ends of the interval
[value − bound, value + bound] round to the same float64, that float64 is the correctly rounded
result (float(Decimal) rounds correctly and rounding is monotone, so every real in the interval, the
exact one among them, rounds to it).  Otherwise the precision doubles and it tries again.  The bounds
are derived in each function's comment, with a factor of at least 100 to spare.
"""

from __future__ import annotations

import math
from decimal import Context, Decimal
from fractions import Fraction
from functools import lru_cache

#: Decimal digits of the first try; Ziv's loop doubles them up to MAX_DIGITS.
DIGITS = 40
MAX_DIGITS = 640


def _ziv(evaluate, what: str) -> float:
    """Run ``evaluate(digits) -> (value, bound)`` at rising precision until Ziv's test decides."""
    digits = DIGITS
    while digits <= MAX_DIGITS:
        value, bound = evaluate(digits)
        lo, hi = float(value - bound), float(value + bound)
        if lo == hi:
            return lo
        digits *= 2
    raise ArithmeticError(f"{what}: not decided at {MAX_DIGITS} digits")  # pragma: no cover


def _ulps(digits: int) -> Decimal:
    """10^-digits: one unit of relative error at ``digits`` significant digits."""
    return Decimal(10) ** -digits


@lru_cache(maxsize=None)
def _pi(digits: int) -> Decimal:
    """π to ``digits + 2`` significant digits, error below 10^-digits (the series of the decimal
    module's documentation, summed at 10 guard digits: each of its ~digits terms rounds once)."""
    ctx = Context(prec=digits + 12)
    lasts, t, s, n, na, d, da = Decimal(0), Decimal(3), Decimal(3), 1, 0, 0, 24
    while s != lasts:
        lasts = s
        n, na = n + na, na + 8
        d, da = d + da, da + 32
        t = ctx.divide(ctx.multiply(t, n), d)
        s = ctx.add(s, t)
    return s


def _tanh(x: Decimal, ctx: Context) -> Decimal:
    """tanh(x) at the precision of ``ctx``, with a relative error below 10^(2 − prec):
    for |x| <= 1 as sinh/cosh from their Taylor series (positive terms for cosh, terms of one sign
    for sinh: no cancellation; ~prec terms of relative rounding 10^-prec each), otherwise as
    (1 − e^(−2|x|)) / (1 + e^(−2|x|)) with e^(−2|x|) <= e^-2 (no cancellation either)."""
    a = abs(x)
    if a == 0:
        return x
    if a <= 1:
        x2 = ctx.multiply(a, a)
        term, sinh, cterm, cosh, n = a, a, Decimal(1), Decimal(1), 1  # x^(2n-1)/(2n-1)!, x^(2n-2)/(2n-2)!
        eps = _ulps(ctx.prec + 2)
        while True:
            cterm = ctx.divide(ctx.multiply(cterm, x2), (2 * n - 1) * (2 * n))
            term = ctx.divide(ctx.multiply(term, x2), (2 * n) * (2 * n + 1))
            cosh, sinh = ctx.add(cosh, cterm), ctx.add(sinh, term)
            if cterm < eps and term < ctx.multiply(eps, sinh):
                break
            n += 1
        t = ctx.divide(sinh, cosh)
    else:
        e = ctx.exp(ctx.multiply(Decimal(-2), a))
        t = ctx.divide(ctx.subtract(1, e), ctx.add(1, e))
    return t if x > 0 else -t


def softcap(score: float, cap: float) -> float:
    """cap · tanh(score / cap), correctly rounded to float64 (one rounding of the exact real).

    Error at ``prec`` digits: score / cap rounds once (relative 10^-prec; tanh's condition number
    |x·tanh'(x)/tanh(x)| <= 1 passes it on at most once), tanh contributes below 10^(2 − prec) and the
    product with cap rounds once more: relative error below 10^(3 − prec), bounded by 10^(5 − prec)."""
    if score == 0.0:
        return score  # ±0: tanh is odd and cap > 0

    def evaluate(digits: int) -> tuple[Decimal, Decimal]:
        ctx = Context(prec=digits)
        value = ctx.multiply(Decimal(cap), _tanh(ctx.divide(Decimal(score), Decimal(cap)), ctx))
        return value, abs(value) * _ulps(digits - 5)

    return _ziv(evaluate, f"softcap({score!r}, {cap!r})")


def softcap_slope(score: float, cap: float) -> float:
    """1 − tanh²(score / cap), the derivative of cap · tanh(score / cap) (softcap′, in the backward),
    correctly rounded to float64 from the exact real at the float64 ``score``.

    Evaluated as 4y / (1 + y)² with y = e^(−2a), a = |score / cap| (= sech²: positive terms only, no
    cancellation).  Error at ``prec`` digits: score / cap and the product −2a round once each (absolute
    error below 4a·10^-prec in the argument of exp, which exp makes relative, plus exp's own 10^-prec);
    the value's relative sensitivity to y is (1 − y) / (1 + y) <= 1; 1 + y (twice, in the square), the
    square, 4y and the quotient round once each: relative error below (4a + 7)·10^-prec, claimed
    (4a + 8)·10^(2 − prec)."""
    if score == 0.0:
        return 1.0

    def evaluate(digits: int) -> tuple[Decimal, Decimal]:
        ctx = Context(prec=digits)
        a = abs(ctx.divide(Decimal(score), Decimal(cap)))
        y = ctx.exp(ctx.multiply(Decimal(-2), a))
        value = ctx.divide(ctx.multiply(Decimal(4), y), ctx.multiply(ctx.add(1, y), ctx.add(1, y)))
        return value, value * (4 * a + 8) * _ulps(digits - 2)

    return _ziv(evaluate, f"softcap_slope({score!r}, {cap!r})")


def rope_angle(position: int, pair: int, rotary_dim: int, theta: float, ctx: Context) -> Decimal:
    """position · theta^(−2·pair / rotary_dim), at the precision of ``ctx``: ln theta, the quotient,
    exp and the product round once each; exp turns the absolute error of its argument (below
    |ln theta|·10^-prec) into a relative one, so the angle's relative error is below
    (4 + |ln theta|)·10^-prec."""
    exponent = ctx.divide(ctx.multiply(Decimal(-2 * pair), ctx.ln(Decimal(theta))), Decimal(rotary_dim))
    return ctx.multiply(Decimal(position), ctx.exp(exponent))


def _sin_cos_reduced(r: Decimal, ctx: Context) -> tuple[Decimal, Decimal]:
    """(sin r, cos r) for |r| <= π by their Taylor series; each of the < 4·prec terms is at most
    e^π < 24 and rounds once: absolute error below 100·prec·10^-prec."""
    sin, cos, term, n = Decimal(0), Decimal(0), Decimal(1), 0  # term = r^n / n!
    eps = _ulps(ctx.prec + 2)
    while True:
        if n % 4 == 0:
            cos = ctx.add(cos, term)
        elif n % 4 == 1:
            sin = ctx.add(sin, term)
        elif n % 4 == 2:
            cos = ctx.subtract(cos, term)
        else:
            sin = ctx.subtract(sin, term)
        n += 1
        term = ctx.divide(ctx.multiply(term, r), n)
        if n > 8 and abs(term) < eps:
            return sin, cos


def rope_cos_sin(position: int, pair: int, rotary_dim: int, theta: float) -> tuple[float, float]:
    """(cos, sin) of the rotary angle position · theta^(−2·pair / rotary_dim) (the exact real angle,
    not a float64 rounding of it), each correctly rounded to float64.

    Error at ``prec`` digits (working precision prec + 10, claimed bound 10^-prec·(1 + |a|)):
    the angle a has relative error below (4 + |ln theta|)·10^(−prec−10); reducing by n·2π with
    |n| <= |a| and π within 10^(−prec−10) adds below |a|·10^(−prec−9); the series adds below
    10^(−prec−6) for prec + 10 < 10^4; sin and cos are 1-Lipschitz."""

    def evaluate(digits: int) -> tuple[tuple[Decimal, Decimal], Decimal]:
        ctx = Context(prec=digits + 10)
        a = rope_angle(position, pair, rotary_dim, theta, ctx)
        two_pi = ctx.multiply(2, _pi(digits + 10))
        turns = ctx.divide(a, two_pi).to_integral_value()
        r = ctx.subtract(a, ctx.multiply(turns, two_pi))
        sin, cos = _sin_cos_reduced(r, ctx)
        return (cos, sin), _ulps(digits) * (1 + abs(a))

    found: list[float] = []
    for index in (0, 1):
        def one(digits: int, index: int = index) -> tuple[Decimal, Decimal]:
            pair_values, bound = evaluate(digits)
            return pair_values[index], bound

        found.append(_ziv(one, f"rope {'cos' if index == 0 else 'sin'}(position={position}, pair={pair})"))
    return found[0], found[1]


def log_sum_exp(values: list[float]) -> float:
    """ln Σ_j e^(v_j), correctly rounded to float64; −inf for no values.

    Error at ``prec`` digits (working precision prec + 10): with m = max v_j, each d_j = v_j − m rounds
    once (absolute error |d_j|·10^(−prec−9), which exp makes relative), each exp once, the sum of n
    positive terms adds n·10^(−prec−9) relative; ln of the sum D ∈ [1, n] has absolute error the
    relative error of D plus |ln D|·10^(−prec−9); adding m rounds once (|result|·10^(−prec−9)).
    Claimed: (n + 2 + max|d_j| + |m| + |result|)·10^(1 − prec)."""
    if not values:
        return -math.inf
    m = max(values)

    def evaluate(digits: int) -> tuple[Decimal, Decimal]:
        ctx = Context(prec=digits + 10)
        dm = Decimal(m)
        diffs = [ctx.subtract(Decimal(v), dm) for v in values]
        total = Decimal(0)
        for d in diffs:
            total = ctx.add(total, ctx.exp(d))
        result = ctx.add(dm, ctx.ln(total))
        spread = max(abs(d) for d in diffs)
        return result, (len(values) + 2 + spread + abs(dm) + abs(result)) * _ulps(digits - 1)

    return _ziv(evaluate, "log-sum-exp")


def exact_sum(terms: list[float | Fraction]) -> float:
    """Σ terms (floats, or exact rationals such as slope·distance), correctly rounded to float64
    (Fraction arithmetic is exact; its conversion to float rounds correctly)."""
    return float(sum((Fraction(t) for t in terms), Fraction(0)))
