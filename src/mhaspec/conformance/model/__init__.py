"""The tolerance model: what a correct implementation may get wrong, stage by stage, in float64
(docs/tolerances.md derives every formula and constant; docs/backward.md the backward's).

Each stage's allowed error has two parts:

* ``sigma`` — the **rounding noise**: every intermediate result may be stored in the dtype
  under test (one or two roundings of relative size ≤ u each), and those roundings propagate,
  linearised, through the later stages.  Independent roundings add in quadrature
  (root-sum-square), as in Higham & Mary's probabilistic rounding-error analysis, so the
  allowance is ``LAMBDA · sigma`` with ``sigma² = Σ (bound of each rounding)²``;
* ``worst`` — the **accumulation error**, bounded worst-case: a length-n sum in the accumulator
  (float32 for float16/bfloat16 runs — the precision contract; the dtype itself for
  float32/float64) is off by at most ``γ_acc(n)·Σ|aᵢbᵢ|`` in any order (Higham, *Accuracy and
  Stability*, §3.1), plus the second-order terms of the softmax.

``tolerance = LAMBDA · sigma + worst + floor``.  On top of the element-wise test,
:mod:`mhaspec.conformance.compare` checks the *mean square* of ``error / sigma`` (``KAPPA``).
Two precision contracts: ``"standard"`` (the above) and ``"worst-case"`` (any correct algorithm
accumulating in the dtype: :func:`.forward.worst_case_tolerances`).

Modules, each readable as the math, one rule per stage:

* :mod:`.vocabulary` — ``Bound``; ``Error``, an error as it propagates (noise, accumulation, what
  is carried worst-case), forward and backward, and ``Error.bound``, the one conversion to a
  ``Bound``; ``product``, the error of a matrix product; ``Rounding`` (u, u_acc, γ, the floor),
  the storage rounding, the float32 upper-bound products, the head relabellings, ``LINEAR``;
* :mod:`.softmax` — how errors move through the softmax (linearised, exact, second order);
* :mod:`.forward` — the golden bounds of the forward stages;
* :mod:`.local` — the forward stages' local checks (from the adapter's own previous stages);
* :mod:`.variants` — the attention variants' rules (RoPE, softcap, bias and ALiBi, sinks, lse), golden
  and local, and the bounds of a case that uses one (the general rule: no engine computes them);
* :mod:`.backward`, :mod:`.backward_local` — the same for the backward stages; :mod:`.backward_variants` —
  the variants' gradients (d_bias, d_sink_logits, softcap′, d_q_rot/d_k_rot, RoPE turned back), both checks.

The model never imports :mod:`mhaspec.conformance.engine` (tests/test_architecture.py): the
engines compute the same rules faster, and :mod:`mhaspec.conformance.tolerance` chooses
between them, chunk by chunk.
"""
