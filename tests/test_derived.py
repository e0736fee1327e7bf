"""The tolerance bounds of a fixture are computed once per process (``judging.derived``,
``mhaspec.conformance.judging.DERIVED``): every later runner that judges the same file in the same dtype
and precision gets the same numbers without computing them, a changed file or a case computed
on the fly never gets another's, what is kept is read-only and within its budget, and a forked
worker finds none of it."""

from __future__ import annotations

import numpy as np
import pytest

import mhaspec
from mhaspec.adapters.numpy_mha import NumpyMHA
from mhaspec.conformance import judging
from mhaspec.conformance import runner as runner_module
from mhaspec.conformance import tolerance as tol
from mhaspec.conformance.judging import DerivedMemo
from mhaspec.fixtures import GoldenSet
from mhaspec.reference.generate import generate
from mhaspec.reference.onthefly import golden_case
from mhaspec.spec import CATALOG, Catalog


@pytest.fixture
def counted(monkeypatch):
    """How often the runner computes each kind of bound (an empty memo to start with)."""
    monkeypatch.setattr(judging, "DERIVED", DerivedMemo(judging.DERIVED_BUDGET))
    calls: dict[str, int] = {"judging": 0, "backward": 0, "worst-case": 0}

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(runner_module, "judging_bounds", counting("judging", tol.judging_bounds))
    monkeypatch.setattr(runner_module, "backward_bounds", counting("backward", tol.backward_bounds))
    monkeypatch.setattr(runner_module, "worst_case_tolerances", counting("worst-case", tol.worst_case_tolerances))
    return calls


def _figures(report):
    return [(r.case, r.dtype, r.verdict, [(s.stage, s.verdict, s.worst_ratio, s.max_abs_err) for s in r.stages])
            for r in report.results]


def test_a_second_runner_gets_the_bounds_without_computing_them(counted):
    first = mhaspec.check(NumpyMHA(), ["float32", "bfloat16"], ["gqa", "causal_and_mask"], isolate=False,
                          timeout=None, backward=True)
    assert counted == {"judging": 4, "backward": 4, "worst-case": 0}
    second = mhaspec.check(NumpyMHA(), ["float32", "bfloat16"], ["gqa", "causal_and_mask"], isolate=False,
                           timeout=None, backward=True)
    assert counted == {"judging": 4, "backward": 4, "worst-case": 0}  # nothing computed again
    assert first.ok and _figures(second) == _figures(first)
    worst = mhaspec.check(NumpyMHA(), ["float32"], ["gqa"], isolate=False, timeout=None, precision="worst-case")
    assert worst.ok and counted["judging"] == 5  # another precision: its own bounds


def test_the_bounds_kept_are_read_only_and_those_computed_anew(counted):
    golden_set = GoldenSet()
    mhaspec.check(NumpyMHA(), ["float16"], ["gqa", "self_basic", "long_sequence"], isolate=False, timeout=None,
                  backward=True)  # other cases judged after gqa: nothing kept may share their memory
    golden = golden_set.load("gqa")
    raw, tolerances = judging.derived(golden, ("judging", "float16", "standard"), lambda: pytest.fail("not kept"))
    fresh_raw, fresh_tolerances = tol.judging_bounds(golden, "float16")
    assert raw.keys() == fresh_raw.keys() and tolerances.keys() == fresh_tolerances.keys()
    for stage in raw:
        for kept, new in ((raw[stage].sigma, fresh_raw[stage].sigma), (raw[stage].worst, fresh_raw[stage].worst),
                          (tolerances[stage], fresh_tolerances[stage])):
            assert not kept.flags.writeable
            np.testing.assert_array_equal(kept, new, err_msg=stage)
            with pytest.raises(ValueError, match="read-only"):
                kept[...] = 0


def _rewrite_output(folder, case_id: str, factor: float) -> None:
    """The fixture's golden output scaled by ``factor``, its manifest's SHA-256 updated: the same
    spec, other bytes."""
    import hashlib
    import json
    import struct

    path = folder / f"{case_id}.safetensors"
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8 : 8 + length])["stage.output"]["data_offsets"]
    output = np.frombuffer(data, dtype="<f8", count=(end - begin) // 8, offset=8 + length + begin)
    data[8 + length + begin : 8 + length + end] = (output * factor).astype("<f8").tobytes()
    path.write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    entry = next(e for e in manifest["cases"] if e["spec"]["id"] == case_id)
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_changed_file_or_a_case_computed_on_the_fly_is_never_served_anothers_bounds(counted, tmp_path):
    folder = tmp_path / "golden"
    generate(folder, Catalog([CATALOG["self_basic"]]))
    before = mhaspec.check(NumpyMHA(), ["float32"], golden=folder, isolate=False, timeout=None)
    _rewrite_output(folder, "self_basic", 1 + 2**-20)  # within float32's tolerance: still a pass
    after = mhaspec.check(NumpyMHA(), ["float32"], golden=folder, isolate=False, timeout=None)
    assert counted["judging"] == 2 and before.ok and after.ok
    assert _figures(after) != _figures(before)
    _rewrite_output(folder, "self_basic", 1 + 2**-20)  # other bytes again
    assert mhaspec.check(NumpyMHA(), ["float32"], golden=folder, isolate=False, timeout=None).ok
    assert counted["judging"] == 3

    on_the_fly = golden_case(CATALOG["self_basic"])
    assert on_the_fly.sha256 is None
    computed = []
    for _ in range(2):
        judging.derived(on_the_fly, ("judging", "float32", "standard"), lambda: computed.append(1))
    assert computed == [1, 1]


def test_the_memo_keeps_at_most_its_budget_least_recently_used_first_out():
    memo = DerivedMemo(budget=3 * 800)
    arrays = {k: np.zeros(100) for k in "abcde"}  # 800 bytes each
    for k in "abc":
        memo.get(k, lambda k=k: arrays[k])
    memo.get("a", lambda: pytest.fail("kept"))  # a: used last
    memo.get("d", lambda: arrays["d"])  # b goes
    assert memo.nbytes == 3 * 800
    for k in "acd":
        memo.get(k, lambda: pytest.fail(f"{k} kept"))
    again = []
    memo.get("b", lambda: again.append(1) or arrays["b"])
    assert again == [1]
    memo.get("big", lambda: np.zeros(1000))  # larger than the budget: returned, not kept
    assert memo.nbytes <= memo.budget and "big" not in memo._items


class _LooksForKeptBounds:
    """Fails unless its (forked) worker holds none of the bounds its runner kept."""

    name = "looks-for-kept-bounds"

    def run(self, case):
        if judging.DERIVED.nbytes or judging.DERIVED._items:
            raise AssertionError("the runner's kept bounds reached the worker")
        return NumpyMHA().run(case)


def test_a_forked_worker_finds_none_of_the_kept_bounds(counted):
    mhaspec.check(NumpyMHA(), ["float32"], ["gqa"], isolate=False, timeout=None)
    assert judging.DERIVED.nbytes > 0
    report = mhaspec.check(_LooksForKeptBounds(), ["float32"], ["gqa"])  # forked: it inherits this process
    assert report.ok, [r.message for r in report.results]
