"""Accelerators of the tolerance model (:mod:`mhaspec.conformance.model`): the same rules, faster.

* :mod:`.chunks` — a (B·H, T, S) stage in chunks of heads × query rows, shared among threads,
  BLAS on one thread inside them;
* :mod:`.inplace` — the model's (B, H, T, S) rules in place on reused work arrays, without
  ``np.where`` (a chunk with a value that is not finite is left to the model's rule);
* :mod:`.compiled` — which cases take the compiled loops (numba, the ``fast`` extra), and the
  calls into them; :mod:`.kernels` — the loops themselves (imported only then).

Each engine imports the model's vocabulary and implements the same rule; tests/test_tolerance_model.py
and tests/test_kernels.py prove them equal to it.  :mod:`mhaspec.conformance.tolerance` chooses,
per chunk: compiled → in place → the model's general rule.
"""
