"""The numpy distributed adapters (adapters/numpy_ranks.py) against each rank's exact golden
(reference/ranks.py) in float64, on every catalog case their layout shards, at world 2 and 4, through
the threads launcher."""

from __future__ import annotations

import numpy as np
import pytest

from mhaspec.adapters import load_adapter
from mhaspec.protocol.transports.threads_ranks import ThreadsLauncher
from mhaspec.spec import CATALOG
from mhaspec.spec.ranks import Layout

from tests.rank_oracle import golden_ranks, relative_error, shardable

ADAPTERS = ("numpy-tp", "numpy-ring", "numpy-ring-zigzag", "numpy-ulysses", "numpy-allgather")
#: float64: the sharded computation is the numpy adapter's, cut; a few float64 units apart from the golden
TIGHT = 1e-12


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ADAPTERS)
def test_every_shardable_catalog_case_matches_each_ranks_golden(name, world):
    launcher = ThreadsLauncher()
    try:
        info = launcher.start(name, world)
        layout = Layout(**info["layout"])
        assert layout.world == world
        cases = shardable(layout)
        assert cases, f"{name} shards no catalog case at world {world}"
        for spec in cases:
            replies = launcher.run(spec.case("float64"), timeout=120)
            expected = golden_ranks(spec.id, layout)
            for reply, want in zip(replies, expected):
                where = f"{name} world {world} case {spec.id} rank {reply.rank}"
                assert reply.error is None, f"{where}: {reply.error}"
                assert set(reply.stages) == set(want), f"{where}: returned {sorted(reply.stages)}, owns {sorted(want)}"
                for stage, value in want.items():
                    err = relative_error(reply.stages[stage], value)
                    assert err <= TIGHT, f"{where} stage {stage}: relative error {err:.3g}"
                assert reply.issued == dict(load_adapter(name).collectives(world)), where
    finally:
        launcher.close()


def test_layouts_and_declared_collectives():
    assert load_adapter("numpy-tp").layout(4) == Layout(tp=4)
    assert load_adapter("numpy-ring").layout(4) == Layout(cp=4, strategy="ring", partition="contiguous")
    assert load_adapter("numpy-ring-zigzag").layout(2) == Layout(cp=2, strategy="ring", partition="zigzag")
    assert load_adapter("numpy-ulysses").layout(2) == Layout(cp=2, strategy="ulysses")
    assert load_adapter("numpy-allgather").layout(2) == Layout(cp=2, strategy="allgather")
    assert load_adapter("numpy-ring").collectives(4) == {"send_recv": 3}


def test_decode_schedules_are_declared_unsupported():
    spec = next(s for s in CATALOG if s.schedule is not None)
    answer = load_adapter("numpy-ring").supports(spec.case("float64"))
    assert isinstance(answer, str) and "decode schedules are not sharded" in answer


def test_a_case_the_layout_cannot_shard_is_a_clear_error():
    launcher = ThreadsLauncher()
    try:
        launcher.start("numpy-ring", 2)
        spec = CATALOG["causal_square"]  # T = S = 9: not two equal chunks
        replies = launcher.run(spec.case("float64"), timeout=60)
        assert all("T = 9 does not cut into 2 equal contiguous chunks" in r.error for r in replies)
    finally:
        launcher.close()


def test_gqa_with_fewer_kv_heads_than_ranks_is_replicated():
    """gqa (H = 8, H_kv = 2) on tp 4: ranks 0, 1 hold key/value head 0, ranks 2, 3 head 1."""
    spec = CATALOG["gqa"]
    launcher = ThreadsLauncher()
    try:
        launcher.start("numpy-tp", 4)
        replies = launcher.run(spec.case("float64"), timeout=60)
    finally:
        launcher.close()
    D_k = spec.config.D_k
    for r in replies:
        np.testing.assert_array_equal(r.stages["k_proj"], replies[r.rank - r.rank % 2].stages["k_proj"])
        assert r.stages["k_proj"].shape == (spec.batch, spec.src_len, D_k)
    assert not np.array_equal(replies[0].stages["k_proj"], replies[2].stages["k_proj"])
