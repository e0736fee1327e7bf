"""Helpers shared by the framework test modules."""

from __future__ import annotations

from typing import Any

import numpy as np

import mhaspec
from mhaspec.conformance import Report
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import Case, MHAConfig

GOLDEN = GoldenSet()


def golden_case(case_id: str, dtype: str = "float64") -> Case:
    return GOLDEN.load(case_id).case(dtype)


def check_here(adapter: str, **options: Any) -> Report:
    """``mhaspec.check`` of a built-in adapter in this process (``isolate=False``): the verdicts of
    a few cases, without a spawned worker that imports the framework again (1.5–4 s of CPU a
    check).  The worker path of every built-in adapter is its whole-catalog run through the CLI
    (test_catalog_runs.py), and a worker's report equals this process's (tests/test_isolation.py).
    A user's adapter file (the examples) is checked as users run it, in its worker."""
    return mhaspec.check(adapter, isolate=False, **options)


def arange_weights(cfg: MHAConfig) -> dict[str, np.ndarray]:
    """Hand-checkable weights: each tensor is 0, 1, 2, … plus an offset naming it."""
    offsets = {"w_q": 0, "w_k": 100, "w_v": 200, "w_o": 300, "b_q": 400, "b_k": 500, "b_v": 600, "b_o": 700}
    return {
        name: (offsets[name] + np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape)
        for name, shape in cfg.weight_shapes().items()
    }


def assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
