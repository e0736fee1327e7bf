"""The variants' backward rule for softcap′ against XLA's tanh (tests/test_variant_backward_tolerances.py proves
the rest without a framework): its float32 tanh on CPU is a fast approximation, several ulps off, and 1 − t²
of it must stay within the rule's rounding of sech² (model/variants.py: TANH_ULPS)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import require

from mhaspec.conformance.model.backward_variants import sech2_rounding, softcap_slope
from mhaspec.conformance.model.vocabulary import rounding
from mhaspec.spec.tolerance import DEFAULT_TOLERANCES

jax = require("jax")

pytestmark = pytest.mark.jax


def test_the_softcap_slope_rounding_covers_xlas_tanh() -> None:
    """1 − t² with t = tanh as XLA computes it in float32 on CPU is within :func:`sech2_rounding`'s terms at full
    size (worst-case contract) of sech², on a grid of logits (at 2 ulps instead of TANH_ULPS it is not: 1.25x)."""
    x = np.linspace(-12, 12, 400001).astype(np.float32)
    t = np.asarray(jax.jit(jax.numpy.tanh)(x)).astype(np.float32)
    s0 = x.astype(np.float64)
    sech2, _, h = softcap_slope(s0, 0.0 * s0, 1.0)
    noise, systematic = sech2_rounding(s0, sech2, h, rounding("float32", "worst-case", DEFAULT_TOLERANCES))
    got = (1 - t * t).astype(np.float64)  # in float32, as jax's tanh JVP forms it
    assert (np.abs(got - sech2) <= sum(noise) + systematic).all()
