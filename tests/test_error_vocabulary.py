"""The tolerance model's vocabulary of a propagated error (model/vocabulary.py): ``Error``, its
``Bound``, the matrix-product rule both directions use, and the linear maps' stages."""

from __future__ import annotations

import numpy as np

from mhaspec.conformance.model.vocabulary import EXACT, LINEAR, Bound, Error, product, stored
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import BACKWARD_STAGES, INPUT_GRADIENTS, REGISTRY, STAGE
from mhaspec.spec.stages import BACKWARD_VARIANT_STAGES


def test_an_error_s_bound_is_sqrt_of_its_noise_and_its_worst_case_parts_plus_the_floor():
    e = Error(np.array([4.0, np.nan, -1e-30, np.inf]), np.array([1.0, 2.0, np.nan, 0.0]))
    b = e.bound(0.5)
    np.testing.assert_array_equal(b.sigma, [2.0, np.inf, 0.0, np.inf])  # NaN -> +inf, a negative rounding -> 0
    np.testing.assert_array_equal(b.worst, [1.5, 2.5, np.inf, 0.5])
    assert isinstance(b, Bound)
    # lin adds to acc; scalar parts broadcast to the stage's shape
    b = Error(0.0, np.array([1.0, 2.0]), np.array([0.25, np.nan])).bound(0.5, (3, 2))
    np.testing.assert_array_equal(b.sigma, np.zeros((3, 2)))
    np.testing.assert_array_equal(b.worst, np.broadcast_to([1.75, np.inf], (3, 2)))


def test_a_later_stage_sees_the_noise_and_the_accumulation_as_variance():
    e = Error(np.array([1.0, 2.0]), np.array([3.0, 0.5]), np.array([7.0, 7.0]))
    np.testing.assert_array_equal(e.total_var, [10.0, 2.25])  # lin is carried, not turned into variance
    s = e.scaled(2.0)
    np.testing.assert_array_equal(s.var, [4.0, 8.0])
    np.testing.assert_array_equal(s.acc, [6.0, 1.0])
    np.testing.assert_array_equal(s.lin, [14.0, 14.0])
    assert EXACT.total_var == 0.0 and EXACT.lin == 0.0


def test_the_product_rule_propagates_each_part_through_its_own_operand():
    rng = np.random.default_rng(3)
    a, b, bias = rng.normal(size=(2, 3, 4)), rng.normal(size=(4, 5)), rng.normal(size=5)
    ea = Error(rng.random((2, 3, 4)), rng.random((2, 3, 4)), rng.random((2, 3, 4)))
    eb = Error(rng.random((4, 5)), 0.0, rng.random((4, 5)))
    y = a @ b + bias
    e = product(a, ea, b, eb, 0.125, 2.0**-8, stored_as=(a @ b, y), bias=bias)
    A = np.abs
    np.testing.assert_allclose(e.var, (ea.var + ea.acc**2) @ b**2 + a**2 @ eb.var + 2.0**-16 * ((a @ b)**2 + y**2)
                               + 2.0**-106 * y**2, rtol=1e-14)
    np.testing.assert_allclose(e.lin, ea.lin @ A(b) + A(a) @ eb.lin, rtol=1e-14)
    np.testing.assert_allclose(e.acc, 0.125 * (A(a) @ A(b) + A(bias)), rtol=1e-14)
    # exact operands: only the storage roundings, nothing carried
    e = product(a, EXACT, b, EXACT, 0.125, 2.0**-8, stored_as=(y,))
    np.testing.assert_array_equal(e.var, stored(2.0**-8, y))
    assert e.lin == 0.0


def test_the_linear_maps_name_the_registry_s_stages():
    golden = next(iter(GoldenSet()))
    for letter, m in LINEAR.items():
        assert REGISTRY[m.y].direction == "forward"
        assert REGISTRY[m.d_weight].axes[-1] == REGISTRY[m.y].axes[-1], letter  # W: (d_in, features of y)
        if m.x in REGISTRY:
            assert REGISTRY[m.d_weight].axes[0] == REGISTRY[m.x].axes[-1], letter
        assert REGISTRY[m.d_bias].only_with == m.bias
        x = m.input_of(golden)
        assert x.shape[-1] == golden.weights[m.weight].shape[0], letter
        if m.d_y is not None:
            assert REGISTRY[m.d_y].axes == REGISTRY[m.y].axes
    assert LINEAR["o"].x == STAGE.concat and LINEAR["o"].d_y is None  # d_output is given
    # every backward stage is a linear map's, an input gradient, one of the attention's four or a variant's
    named = {n for m in LINEAR.values() for n in (m.d_y, m.d_weight, m.d_bias) if n is not None}
    inputs = {n for kinds in INPUT_GRADIENTS.values() for n in kinds}
    attention = {STAGE.d_concat, STAGE.d_head_outputs, STAGE.d_attn_weights, STAGE.d_scores}
    variants = set(BACKWARD_VARIANT_STAGES)
    assert named | inputs | attention | variants == set(BACKWARD_STAGES)
    assert not named & (inputs | attention | variants) and not variants & (inputs | attention)
