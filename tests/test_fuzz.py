"""``mhaspec fuzz``: a correct adapter passes, buggy ones are found, shrunk, and reproduced by ``run --catalog``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.fuzz import fuzz
from mhaspec.reference.onthefly import OnTheFlyGolden

from .variants import BUGS, Variant

pytestmark = pytest.mark.proofs  # tox's proofs env (the two-sided proofs, per dtype)

pytest.importorskip("hypothesis")


def test_fuzz_numpy_200_examples_passes(capsys):
    assert main(["fuzz", "numpy", "--examples", "200"]) == 0
    assert "no non-conformance found (200 case(s) judged" in capsys.readouterr().out


@pytest.mark.parametrize("bug", ["gqa_heads_by_modulo", "causal_wrong_alignment", "mask_polarity_inverted",
                                 "heads_merged_without_transpose", "softmax_over_queries"])
def test_bugs_are_found_shrunk_and_reproduced(bug, tmp_path):
    adapter, stage = BUGS[bug]
    outcome = fuzz(adapter, examples=100, seed=0, dtypes=["float32"])
    assert outcome.found and outcome.examples <= 100, bug
    spec = outcome.spec
    assert outcome.results[0].first_failing_stage == stage
    # shrunk: one batch entry, short sequences, and only the feature the bug needs
    assert spec.batch == 1 and spec.tgt_len <= 2 and spec.src_len <= 2 and spec.config.d_model <= 4, spec
    if bug == "gqa_heads_by_modulo":
        assert 1 < spec.config.H_kv < spec.config.H
    if bug == "causal_wrong_alignment":
        assert spec.config.causal and spec.tgt_len != spec.src_len
    if bug == "mask_polarity_inverted":
        assert spec.mask is not None
    # the printed catalog entry reproduces it through `run --catalog`'s path
    path = tmp_path / "case.json"
    path.write_text(outcome.catalog_json())
    report = mhaspec.check(adapter, dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None)
    assert [r.first_failing_stage for r in report.results] == [stage]


def test_fuzz_is_deterministic_per_seed():
    adapter, _ = BUGS["causal_off_by_one"]
    first = fuzz(adapter, examples=50, seed=3, dtypes=["float32"])
    again = fuzz(adapter, examples=50, seed=3, dtypes=["float32"])
    assert first.found and first.catalog_json() == again.catalog_json()


class NoGQA(Variant):
    def supports(self, case):
        return True if case.config.H_kv == case.config.H else "no grouped-query attention"


def test_fuzz_honours_supports():
    judged = []
    adapter = NoGQA(name="gqa_mod_without_gqa", gqa_modulo=True)  # the bug needs GQA, which it refuses
    outcome = fuzz(adapter, examples=60, seed=0, dtypes=["float32"], progress=lambda spec, _: judged.append(spec))
    assert not outcome.found and outcome.rejected > 0
    assert judged and all(spec.config.H_kv == spec.config.H for spec in judged)


def test_cli_prints_the_minimal_case_and_exits_1(tmp_path, capsys):
    repo = Path(__file__).resolve().parent.parent
    module = tmp_path / "buggy.py"
    module.write_text(f"import sys\nsys.path.insert(0, {str(repo)!r})\nfrom tests.variants import Variant\n"
                      "BUGGY = Variant(name='no_b_o', drop_output_bias=True)\n")
    assert main(["fuzz", f"{module}:BUGGY", "--examples", "50", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "NON-CONFORMANCE found and shrunk" in out and "output" in out
    case_json = out[out.index("["):]
    (tmp_path / "case.json").write_text(case_json)
    assert json.loads(case_json)[0]["id"] == "fuzz"
    assert main(["run", f"{module}:BUGGY", "--catalog", str(tmp_path / "case.json"), "--dtype", "float32"]) == 1
    assert main(["fuzz", "numpy", "--examples", "0"]) == 2


@pytest.mark.parametrize("bug, variant", [("softcap_missing", "softcap"), ("rope_styles_swapped", "rope"),
                                          ("window_left_off_by_one", "window"),
                                          ("sink_missing_from_denominator", "sinks"), ("alibi_wrong_sign", "alibi")])
def test_variant_bugs_are_found_and_shrunk_to_the_variant_they_need(bug, variant, monkeypatch, tmp_path):
    from mhaspec.spec import variants

    from .variants import KILL_LIST

    monkeypatch.setattr(variants, "NOT_JUDGED_YET", frozenset())  # a no-op once they are judged on main
    adapter, stages = KILL_LIST[bug]
    outcome = fuzz(adapter, examples=150, seed=0, dtypes=["float32"])
    assert outcome.found, bug
    spec = outcome.spec
    assert variants.variants_used(spec) == [variant], (bug, spec)  # the other variants shrunk away
    assert outcome.results[0].first_failing_stage in stages, outcome.results[0]
    assert spec.batch == 1 and spec.config.d_model <= 4, spec
    path = tmp_path / "case.json"
    path.write_text(outcome.catalog_json())
    report = mhaspec.check(adapter, dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None)
    assert [r.first_failing_stage for r in report.results] == [outcome.results[0].first_failing_stage]


def test_fuzz_serving_draws_schedules_packings_and_pages_and_numpy_passes():
    judged = []
    outcome = fuzz("numpy", examples=60, seed=0, dtypes=["float32"], serving=True,
                   progress=lambda spec, _: judged.append(spec))
    assert not outcome.found and outcome.examples == 60
    scheduled = [spec for spec in judged if spec.schedule is not None]
    assert all(sum(spec.schedule) == spec.tgt_len for spec in scheduled)
    assert all(spec.schedule is not None or spec.seq_lens is not None for spec in judged)
    assert any(len(spec.schedule) > 2 for spec in scheduled) and any(1 in spec.schedule[1:] for spec in scheduled)
    assert any(spec.page_size is not None for spec in scheduled) and any(spec.seq_lens for spec in judged)


@pytest.mark.parametrize("bug, stage", [("offset_ignored", None), ("appended_twice", "k_proj"),
                                        ("rope_restart", "q_rot"), ("window_from_call_start", None)])
def test_decode_bugs_are_found_and_shrunk_to_a_short_schedule(bug, stage, tmp_path):
    from .decode_zoo import KILL_LIST

    adapter = KILL_LIST[bug]
    outcome = fuzz(adapter, examples=150, seed=0, dtypes=["float32"], serving=True)
    assert outcome.found, bug
    spec, result = outcome.spec, outcome.results[0]
    assert spec.schedule is not None and spec.batch == 1 and spec.tgt_len <= 2 and len(spec.schedule) <= 2, spec
    assert result.message.startswith(f"call {len(spec.schedule) if bug != 'offset_ignored' else 1} of"), result.message
    if stage is not None:
        assert result.first_failing_stage == stage, result
    path = tmp_path / "case.json"
    path.write_text(outcome.catalog_json())
    assert json.loads(path.read_text())[0]["schedule"] == list(spec.schedule)
    report = mhaspec.check(adapter, dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None)
    assert [r.first_failing_stage for r in report.results] == [result.first_failing_stage]


def _serving_only(impl, layout: str):
    """``impl`` (a zoo implementation of one serving path) refusing every other case: packed ones only (and no
    explicit mask: the zoo's packed kernels do not handle a row the mask hides entirely, which the built-in
    packed paths do) or paged ones only."""
    class Only(type(impl)):
        def supports(self, case):
            if layout == "packed":
                return True if case.seq_lens is not None and case.inputs.mask is None else "packed cases only"
            return True if case.page_size is not None else "paged cases only"

    return Only(**{f: getattr(impl, f) for f in impl.__dataclass_fields__})


def test_fuzz_serving_draws_packings_and_page_tables_and_the_correct_paths_pass():
    from .packed_zoo import CORRECT
    from .paged_zoo import CORRECT_PAGED

    for impl, layout in ((CORRECT["packed"], "packed"), (next(iter(CORRECT_PAGED.values())), "paged")):
        judged = []
        outcome = fuzz(_serving_only(impl, layout), examples=30, seed=0, dtypes=["float32"], serving=True,
                       progress=lambda spec, _: judged.append(spec))
        assert not outcome.found, (layout, outcome.catalog_json() if outcome.found else "")
        assert judged and all((s.seq_lens if layout == "packed" else s.block_table) is not None for s in judged)
        if layout == "paged":
            assert {s.page_size for s in judged} != {1} and all(len(t) == -(-s.src_len // s.page_size)
                                                                for s in judged for t in s.block_table)


@pytest.mark.parametrize("bug, layout, unit", [("cu_seqlens_off_by_one", "packed", "sequence"),
                                               ("rope_continues", "packed", "sequence"),
                                               ("page_off_by_one", "paged", "call"),
                                               ("stale_page", "paged", "call")])
def test_packed_and_paged_bugs_are_found_and_shrunk(bug, layout, unit, tmp_path):
    from .packed_zoo import KILL_LIST
    from .paged_zoo import PAGED_KILL_LIST

    adapter = _serving_only((KILL_LIST if layout == "packed" else PAGED_KILL_LIST)[bug], layout)
    outcome = fuzz(adapter, examples=150, seed=0, dtypes=["float32"], serving=True)
    assert outcome.found, bug
    spec, result = outcome.spec, outcome.results[0]
    assert result.message.startswith(f"{unit} "), result.message
    assert spec.tgt_len <= 4 and spec.batch <= 2, spec
    path = tmp_path / "case.json"
    path.write_text(outcome.catalog_json())
    drawn = json.loads(path.read_text())[0]
    assert ("seq_lens" if layout == "packed" else "block_table") in drawn, drawn
    report = mhaspec.check(adapter, dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None)
    assert [r.first_failing_stage for r in report.results] == [result.first_failing_stage]
