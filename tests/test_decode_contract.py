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
