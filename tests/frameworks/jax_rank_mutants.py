"""Broken JAX sharded adapters for tests/frameworks/test_jax_ranks.py, loaded by the jax launcher's worker as
``tests/frameworks/jax_rank_mutants.py:NAME``: each is a built-in one with one known bug of issue 33
injected at its mechanism (not at its result), or a rank that crashes or hangs."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from mhaspec.adapters import jax_ranks
from mhaspec.adapters.jax_ranks import JaxRingAdapter, JaxTensorParallelAdapter

#: The case at which the crashing and hanging mutants misbehave (the others run normally).
TRIGGER = "causal_square"


class BiasOnEveryRank(JaxTensorParallelAdapter):
    """jax-tp with b_o in every rank's row-parallel W^O product, before the all-reduce (and none after):
    the output is off by (tp − 1)·b_o (text-generation-inference #1036, nano-vllm #99)."""

    name = "jax-tp-bias-on-every-rank"

    def _program(self, layout: Any, case: Any) -> tuple[Any, tuple, tuple]:
        body, args, specs = super()._program(layout, case)
        weights, b_o = args[6], args[7]
        every = {**weights, "b_o": np.stack([b_o] * layout.world)}
        return body, (*args[:6], every, None), specs


class LocalCausalOffsets(JaxRingAdapter):
    """jax-ring whose causal band compares each block's rows and keys by their local positions (both counted
    from 0) instead of their global ones: every step but a rank's own chunk is masked wrong
    (ring-flash-attention #54).  Only the band: the scores, RoPE's angles and ALiBi keep global positions."""

    name = "jax-ring-local-offsets"

    def _compute(self, ctx: Any, case: Any) -> Any:
        correct = jax_ranks.allowed_keys

        def local_band(rows: Any, keys: Any, mask: Any, causal_shift: Any) -> Any:
            return correct(rows - rows.min(), keys - keys.min(), mask, causal_shift)

        jax_ranks.allowed_keys = local_band  # this worker process runs only this adapter
        try:
            return super()._compute(ctx, case)
        finally:
            jax_ranks.allowed_keys = correct


class ExitsAtRankOne(JaxTensorParallelAdapter):
    """jax-tp whose rank 1 kills its process (``os._exit``) on :data:`TRIGGER`."""

    name = "jax-tp-exits"

    def run_rank(self, ctx: Any, case: Any) -> Any:
        if ctx.rank == 1 and case.id == TRIGGER:
            os._exit(3)
        return super().run_rank(ctx, case)


class HangsAtRankZero(JaxTensorParallelAdapter):
    """jax-tp whose rank 0 hangs on :data:`TRIGGER`."""

    name = "jax-tp-hangs"

    def run_rank(self, ctx: Any, case: Any) -> Any:
        if ctx.rank == 0 and case.id == TRIGGER:
            time.sleep(3600)
        return super().run_rank(ctx, case)
