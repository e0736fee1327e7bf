"""The schedule contract (docs/serving.md): ``CaseSpec.schedule`` and its validation, ``calls()``, and the
runner judging ``decode(case)`` call by call — contract errors named per call, an adapter without
``decode`` unsupported, a toy adapter made of the golden's own rows passing every call, and one whose
cache is not appended failing at call 2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

import mhaspec
from mhaspec.cli import main
from mhaspec.fixtures import GoldenSet
from mhaspec.spec import CATALOG, REGISTRY, Case, CaseSpec, schedule_calls
from mhaspec.spec.stages import forward_stages

SCHEDULED = [spec.id for spec in CATALOG if spec.schedule is not None]


def _spec(**update) -> dict:
    """decode_prefill_steps as JSON, with ``update`` applied (config keys under "config")."""
    raw = json.loads(CATALOG["decode_prefill_steps"].model_dump_json())
    raw["config"].update(update.pop("config", {}))
    raw.update(update)
    return raw


# -- the spec -------------------------------------------------------------------------------------


def test_calls_follow_the_cache_arithmetic():
    """P = S − T keys before call 0; call c covers rows [t0, t1) and leaves L_c = P + t1 keys."""
    calls = schedule_calls([2, 1, 3], tgt_len=6, src_len=10)
    assert [tuple(c) for c in calls] == [(0, 2, 6, "prefill"), (2, 3, 7, "decode"), (3, 6, 10, "chunk")]
    assert [c.rows for c in calls] == [2, 1, 3]
    spec = CATALOG["decode_with_past"]
    past = spec.src_len - spec.tgt_len
    assert spec.calls()[-1].cache == spec.src_len and spec.calls()[0].cache == past + spec.schedule[0]
    case = spec.case("float32")
    assert case.schedule == spec.schedule and case.calls() == spec.calls()


@pytest.mark.parametrize("update, words", [
    (dict(schedule=[5, 0, 6]), "schedule[1] = 0"),
    (dict(schedule=[5, 1]), "sum to 6, expected T = tgt_len = 11"),
    (dict(schedule=[]), "at least one call"),
    (dict(config=dict(causal=False)), "causal = false"),
    (dict(config=dict(causal_alignment="top_left")), "causal_alignment = 'top_left'"),
    (dict(inputs="distinct", tgt_len=11, src_len=9, schedule=[11]), "S >= T"),
])
def test_a_bad_schedule_is_refused_naming_schedule(update, words):
    with pytest.raises(ValidationError) as info:
        CaseSpec.model_validate(_spec(**update))
    assert "schedule" in str(info.value) and words in str(info.value), str(info.value)


def test_a_bad_schedule_in_a_catalog_file_exits_2_naming_the_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_spec(schedule=[5, 1])]))
    assert main(["run", "numpy", "--catalog", str(path), "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "cases.0: Value error, schedule: the calls' rows sum to 6" in err and "Traceback" not in err, err


def test_a_case_without_a_schedule_dumps_no_schedule():
    """Its JSON (and so the manifest and every fixture) is what it was before schedules existed."""
    assert all("schedule" not in json.loads(spec.model_dump_json()) for spec in CATALOG if spec.schedule is None)
    assert json.loads(CATALOG["decode_window"].model_dump_json())["schedule"] == [4, 1, 1, 1, 1, 1, 1]


def test_the_schedule_cases_golden_is_the_full_pass():
    """The schedule changes no golden value: the same spec without it has the same stages."""
    golden = GoldenSet().load("decode_gqa_rope")
    from mhaspec.reference.generate import case_tensors

    plain = case_tensors(golden.spec.model_copy(update={"schedule": None}))
    for stage in forward_stages(golden.spec.config):
        np.testing.assert_array_equal(golden.stages[stage], plain[f"stage.{stage}"], err_msg=stage)


# -- the runner -----------------------------------------------------------------------------------


class GoldenRows:
    """A toy serving adapter: call c's stages are the exact reference's (the golden's) rows [t0, t1), keys
    [0, L_c), in the dtype — what a correct KV cache gives.  ``bug`` makes one of the kill list's mistakes.
    (Computed from the case, as an adapter must: a worker finds no golden.)"""

    name = "golden-rows"
    dtypes = ("float64", "float32")
    variants = ("rope", "window")

    def __init__(self, bug: str = "") -> None:
        self.bug = bug

    def run(self, case: Case):
        raise AssertionError("run() is never called for a case with a schedule")

    def decode(self, case: Case):
        from mhaspec.reference.mha import forward

        inputs = {k: v for k, v in case.inputs.__dict__.items() if v is not None}
        stages = forward(case.config, inputs, case.weights.as_dict())
        out = []
        for c, (t0, t1, cache, kind) in enumerate(case.calls()):
            keys = cache - (t1 - t0) if self.bug == "not appended" and c > 0 else cache  # the previous cache
            mapping = {}
            for name in forward_stages(case.config):
                stage, x = REGISTRY[name], stages[name]
                index = [slice(None)] * x.ndim
                if stage.rows is not None:
                    index[stage.rows] = slice(t0, t1)
                if stage.keys is not None:
                    index[stage.keys] = slice(0, keys)
                mapping[name] = x[tuple(index)].astype(case.dtype)
            if self.bug == "stale output" and c == 3:
                mapping["output"] = out[2]["output"]  # a step that returns the previous step's row
            out.append(mapping)
        return out


class NoDecode:
    name = "no-decode"

    def run(self, case):
        raise AssertionError("run() is never called for a case with a schedule")


def test_the_golden_s_rows_pass_every_call_of_every_schedule_case():
    report = mhaspec.check(GoldenRows(), dtypes=["float64", "float32"], cases=SCHEDULED, isolate=False)
    for r in report.results:
        assert r.verdict == "pass", (r.case, r.dtype, r.message, [(c.call, c.message) for c in r.calls])
        spec = CATALOG[r.case]
        assert [(c.call, c.of, c.kind, c.rows, c.cache) for c in r.calls] == [
            (i + 1, len(spec.schedule), call.kind, (call.t0, call.t1), call.cache) for i, call in enumerate(spec.calls())]
        assert all(c.verdict == "pass" for c in r.calls)
    assert report.ok and len(report.results) == 2 * len(SCHEDULED)


def test_the_calls_travel_through_the_worker_and_into_the_json_report():
    report = mhaspec.check(GoldenRows(), dtypes=["float32"], cases=["decode_chunked_prefill"])
    r = report.to_json()["results"][0]
    assert r["verdict"] == "pass", r
    assert [(c["call"], c["of"], c["kind"], c["rows"], c["cache"], c["verdict"]) for c in r["calls"]] == [
        (1, 3, "prefill", [0, 4], 4, "pass"), (2, 3, "chunk", [4, 8], 8, "pass"), (3, 3, "chunk", [8, 11], 11, "pass")]
    assert "calls" not in mhaspec.check(GoldenRows(), dtypes=["float32"], cases=["self_basic"],
                                        isolate=False).to_json()["results"][0]


def test_a_cache_not_appended_fails_at_call_2_naming_it():
    r = mhaspec.check(GoldenRows("not appended"), dtypes=["float32"], cases=["decode_prefill_steps"]).results[0]
    assert r.verdict == "fail" and r.first_failing_stage == "k_proj", r.message
    assert r.message.startswith("call 2 of 7 (decode, cache 6): k_proj fail"), r.message
    assert "shape (2, 5, 12), expected (B, L_c, H_kv·D_k) = (2, 6, 12)" in r.message, r.message
    assert [c.verdict for c in r.calls] == ["pass"] + ["fail"] * 6
    assert r.stage("k_proj").message.startswith("call 2 of 7 (decode, cache 6): ")


def test_a_stale_decode_step_fails_at_its_call_on_its_values():
    r = mhaspec.check(GoldenRows("stale output"), dtypes=["float64"], cases=["decode_prefill_steps"],
                      isolate=False).results[0]
    assert r.verdict == "fail" and r.first_failing_stage == "output"
    assert r.message.startswith("call 4 of 7 (decode, cache 8): output fail"), r.message
    assert [c.call for c in r.calls if c.verdict == "fail"] == [4]


def test_an_adapter_without_decode_is_unsupported_on_a_schedule_case_and_run_is_never_called():
    report = mhaspec.check(NoDecode(), dtypes=["float32"], cases=["decode_prefill_steps", "decode_with_past"])
    assert {(r.verdict, r.message) for r in report.results} == {
        ("unsupported", "the adapter has no decode(case) method (docs/serving.md)")}


class Malformed(GoldenRows):
    def __init__(self, reply) -> None:
        super().__init__()
        self.reply = reply

    def decode(self, case):
        return self.reply(super().decode(case))


@pytest.mark.parametrize("reply, words", [
    (lambda calls: calls[0], "decode() returned dict, expected a list of 7 mappings"),
    (lambda calls: calls[:-1], "decode() returned 6 mapping(s), the schedule has 7 calls"),
    (lambda calls: [*calls[:2], 3.0, *calls[3:]], "decode(): call 3 of 7 (decode, cache 7): float, expected a mapping"),
    (lambda calls: [*calls[:4], {**calls[4], "d_query": calls[4]["output"]}, *calls[5:]],
     "decode(): call 5 of 7 (decode, cache 9): unknown stage(s) d_query"),
    (lambda calls: [*calls[:6], {k: v for k, v in calls[6].items() if k != "output"}],
     "decode(): call 7 of 7 (decode, cache 11): the required stage 'output' is missing"),
])
def test_a_malformed_decode_reply_is_an_error_naming_the_call(reply, words):
    r = mhaspec.check(Malformed(reply), dtypes=["float32"], cases=["decode_prefill_steps"]).results[0]
    assert r.verdict == "error" and r.message.startswith(words), r.message


def test_an_exec_client_is_not_judged_on_a_schedule_case():
    from mhaspec.protocol.transports.program import Program

    assert "decode is not in mhaspec-wire/1 yet" in Program.decode_refusal


# -- run --catalog: schedule cases of any size --------------------------------------------------


def _long_schedule(case_id: str = "long_decode", prefill: int = 33, steps: int = 37) -> CaseSpec:
    return CaseSpec.model_validate(_spec(id=case_id, tgt_len=prefill + steps, src_len=prefill + steps,
                                         schedule=[prefill] + [1] * steps, batch=1))


def test_a_call_view_of_a_golden_made_one_block_at_a_time_is_the_whole_golden_s(monkeypatch):
    """A large --catalog case's golden is computed one block of rows at a time (fixtures.RowBlocks, blocks
    at multiples of block_rows); each call's view, made from the block around its rows, holds the same
    numbers as the view of the golden computed whole."""
    from mhaspec.conformance.decode import call_view
    from mhaspec.reference import onthefly

    spec = _long_schedule()
    whole = onthefly.golden_case(spec)
    monkeypatch.setattr(onthefly, "ROW_BLOCK_ELEMENTS", 1)  # the smallest blocks: FAST_ROWS rows
    blocks = onthefly.row_blocks(spec)
    assert hasattr(blocks, "block") and 0 < blocks.block_rows < spec.tgt_len
    for call in spec.calls()[:3] + spec.calls()[30:33]:  # blocks 0/1 and 1/2 (block_rows 32): 32, 33 … 63, 64
        a, b = call_view(whole, 0, call), call_view(blocks, 0, call)
        assert (a.row_offset, a.whole_tgt_len, a.spec.src_len) == (b.row_offset, b.whole_tgt_len, b.spec.src_len) \
            == (call.t0, call.t1, call.cache)
        assert a.stages.keys() == b.stages.keys() and np.array_equal(a.visible, b.visible)
        for stage in a.stages:
            np.testing.assert_array_equal(a.stages[stage], b.stages[stage], err_msg=f"{call} {stage}")
            assert a.stages[stage].shape == expected_view_shape(spec, call, stage)


def expected_view_shape(spec: CaseSpec, call, stage: str) -> tuple[int, ...]:
    return REGISTRY[stage].shape(spec.config, 1, call.rows, call.cache)


def test_run_catalog_judges_a_schedule_case_and_reports_its_calls(tmp_path, capsys):
    path, report = tmp_path / "decode.json", tmp_path / "report.json"
    path.write_text(json.dumps([json.loads(_long_schedule("decode_steps", prefill=6, steps=9).model_dump_json())]))
    code = main(["run", f"{__file__}:GoldenRows", "--catalog", str(path), "--dtype", "float32",
                 "--report", str(report)])
    assert code == 0, capsys.readouterr()
    result = json.loads(report.read_text())["results"][0]
    assert result["verdict"] == "pass" and len(result["calls"]) == 10
    assert result["calls"][-1] == {"call": 10, "of": 10, "kind": "decode", "rows": [14, 15], "cache": 15,
                                   "verdict": "pass", "first_failing_stage": None,
                                   "worst_ratio": result["calls"][-1]["worst_ratio"], "message": ""}


def test_the_matrix_and_the_pytest_failure_text_name_the_failing_call(tmp_path):
    from mhaspec.conformance import matrix
    from mhaspec.conformance.plugin import judge_stage

    from mhaspec.conformance import Session

    session = Session(GoldenRows("not appended"), isolate=False)
    try:
        report = mhaspec.check(session, dtypes=["float32"], cases=["decode_prefill_steps"])
        with pytest.raises(pytest.fail.Exception) as failed:
            judge_stage(session, "decode_prefill_steps", "float32", "k_proj")
    finally:
        session.close()
    assert "decode_prefill_steps [float32] k_proj: call 2 of 7 (decode, cache 6): shape" in str(failed.value)
    report.write_json(tmp_path / "r.json")
    m = matrix.build([tmp_path / "r.json"])
    key = m.keys[0]
    assert "reason: call 2 of 7 (decode, cache 6): k_proj fail" in matrix.hover_text(m, key, "decode_prefill_steps",
                                                                                       "float32")
    assert "| call 2 of 7 (decode, cache 6): k_proj fail" in matrix.to_markdown(m)


class AsksFirst(GoldenRows):
    """With supports(): the worker runs supports+decode in one round trip, and sends cases ahead."""

    name = "golden-rows-supports"

    def supports(self, case):
        return True if case.id != "decode_window" else "no sliding window in this cache"


def test_supports_then_decode_and_cases_sent_ahead_through_the_worker():
    cases = ["decode_prefill_steps", "self_basic", "decode_window", "decode_with_past", "decode_chunked_prefill"]
    report = mhaspec.check(AsksFirst(), dtypes=["float32", "float64"], cases=cases)
    verdicts = {(r.case, r.dtype): (r.verdict, r.message) for r in report.results}
    assert verdicts.pop(("self_basic", "float32"))[0] == verdicts.pop(("self_basic", "float64"))[0] == "error"  # run()
    for dtype in ("float32", "float64"):
        assert verdicts.pop(("decode_window", dtype)) == ("unsupported", "no sliding window in this cache")
    assert {v for v in verdicts.values()} == {("pass", "")}, verdicts


def test_a_long_call_is_judged_in_blocks_of_rows_with_the_same_verdicts(monkeypatch):
    """A chunk too large for one block (memory-bounded judging) gets the same per-call verdicts and
    worst ratios as judged at once; a bug in its last rows is found there."""
    from mhaspec.conformance import Session, decode

    golden = GoldenSet().load("decode_chunked_prefill")
    calls = golden.spec.calls()
    case = golden.case("float32")
    session = Session(GoldenRows(), isolate=False)
    judge = lambda view, mapping: session.judge_stages(view, "float32", mapping)  # noqa: E731
    try:
        for bug in ("", "stale"):
            returned = GoldenRows().decode(case)
            if bug:
                returned[1]["output"] = returned[1]["output"].copy()
                returned[1]["output"][:, -1] += 1.0  # the last row of the 4-row chunk
            once = [decode.judge_call(golden, call, m, judge) for call, m in zip(calls, returned)]
            assert decode.row_chunks(golden, calls[1]) == [(4, 8)]
            small = 4 * calls[1].cache  # H · rows · L_c = 4 · 1 · 8: one row per block
            assert decode.row_chunks(golden, calls[1], small) == [(4, 5), (5, 6), (6, 7), (7, 8)]
            with monkeypatch.context() as patch:
                patch.setattr(decode, "MAX_BLOCK_ELEMENTS", small)
                blocked = [decode.judge_call(golden, call, m, judge) for call, m in zip(calls, returned)]
            for a, b in zip(once, blocked):  # (the bounds' own float64 roundings follow the blocks: ratios to 1e-6)
                assert [(s.stage, s.verdict, s.worst_index) for s in a] == [(s.stage, s.verdict, s.worst_index) for s in b]
                assert [s.worst_ratio for s in b] == pytest.approx([s.worst_ratio for s in a], rel=1e-6)
            verdicts = [decode.verdict_of(stages) for stages in blocked]
            assert verdicts == (["pass", "fail", "pass"] if bug else ["pass"] * 3), verdicts
            if bug:
                assert next(s for s in blocked[1] if s.stage == "output").worst_index[1] == 7  # case row 7
    finally:
        session.close()


def test_a_bias_shared_by_the_batch_reaches_every_batch_entry_s_calls(tmp_path):
    """Found by `mhaspec fuzz --serving`: the view of batch entry b >= 1 cut a (1, H|1, T, S) bias to no
    entry at all, and judging the call raised."""
    from mhaspec.reference.onthefly import OnTheFlyGolden
    from mhaspec.spec.case import input_rows

    bias = np.arange(2 * 3 * 4, dtype=np.float64).reshape(1, 2, 3, 4)
    assert np.array_equal(input_rows("bias", bias, 1, 1, 3), bias[:, :, 1:3])
    spec = {"id": "shared_bias_decode", "config": {"d_model": 8, "num_heads": 2, "causal": True,
            "causal_alignment": "bottom_right"}, "batch": 2, "tgt_len": 3, "src_len": 5, "seed": 1,
            "inputs": "distinct", "bias": {"per_batch": False, "per_head": True}, "schedule": [2, 1]}
    path = tmp_path / "case.json"
    path.write_text(json.dumps([spec]))
    report = mhaspec.check("numpy", dtypes=["float32"], golden=OnTheFlyGolden(path), timeout=None)
    assert [r.verdict for r in report.results] == ["pass"], report.results[0].message
