"""The judge of sharded runs (conformance/ranks.py, docs/distributed.md), through a fake launcher whose ranks
return their exact golden (reference/ranks.py) rounded to the dtype — correct — or that with one bug each:
each bug fails at the rank, step and stage where it is; a crashed rank is an error naming it; a rank that
breaks its layout's promise of collectives fails; ``--world`` on an adapter that is not distributed is a
usage error (exit 2)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from mhaspec.cli import main
from mhaspec.conformance import check
from mhaspec.conformance import ranks as judge_module
from mhaspec.conformance.compare import FAIL, PASS, round_to_bfloat16
from mhaspec.conformance.report import ERROR, UNSUPPORTED
from mhaspec.fixtures import GoldenSet
from mhaspec.protocol.contract import describe_adapter
from mhaspec.protocol.loading import load_adapter
from mhaspec.protocol.ranks import RankReply
from mhaspec.reference.ranks import rank_stages
from mhaspec.reference import mha
from mhaspec.spec.ranks import Layout, attention_heads, attention_rows, chunks, ring_source, ring_stage
from mhaspec.spec.variants import VARIANTS

DTYPES = ("float64", "float32", "float16", "bfloat16")
GOLDEN = GoldenSet()


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` stored in ``dtype`` (the one rounding of a correct rank's result), back in float64."""
    return round_to_bfloat16(x) if dtype == "bfloat16" else x.astype(dtype).astype(np.float64)


class FakeRanks:
    """A distributed adapter whose ranks the fake launcher computes (run_rank is never called)."""

    name = "fake-ranks"
    launcher = "threads"
    dtypes = DTYPES
    variants = VARIANTS

    def __init__(self, layout: Layout) -> None:
        self._layout = layout

    def layout(self, world: int) -> Layout:
        return self._layout

    def run_rank(self, ctx: Any, case: Any) -> dict[str, Any]:  # pragma: no cover - the fake launcher computes
        raise AssertionError("the fake launcher computes the ranks")


def _bug(name: str, stages: dict[str, np.ndarray], golden: Any, layout: Layout, rank: int) -> None:
    """Apply bug ``name`` to rank ``rank``'s exact stages, in place."""
    b_o = golden.weights["b_o"]
    if name == "bias on every rank":  # each rank adds b_o before the all-reduce: (tp − 1)·b_o too much
        stages["output"] = stages["output"] + (layout.tp - 1) * b_o
    elif name == "missing all-reduce":  # the rank's partial, with b_o, is its output
        stages["output"] = stages["o_partial"] + b_o
    elif name == "lse merged by addition" and layout.coords(rank).cp == 0:  # step 1: l_old + l_blk
        for k in range(1, layout.cp):
            before = stages[ring_stage("lse", k - 1)]
            stages[ring_stage("lse", k)] = before + before  # (a sum of LSEs where a log-sum-exp is needed)
    elif name == "rank 1's partial off by 1e-2" and rank == 1:
        stages["o_partial"] = stages["o_partial"] * (1 + 1e-2)


def _ring_in_the_dtype(golden: Any, layout: Layout, rank: int, dtype: str) -> dict[str, np.ndarray]:
    """``ring_out[k]``, ``ring_lse[k]`` of a ring computed as a kernel would: each step's block attention in
    float32 from the dtype's scores and values, the LSE merge in float32, the running output and LSE stored in
    the dtype after every step (no sinks: a case without them)."""
    cfg = golden.spec.config
    h0, h1 = attention_heads(layout, cfg, rank)
    rows = attention_rows(layout, golden.spec.tgt_len, rank)
    s = _rounded(golden.stages["scores"][:, h0:h1][:, :, rows], dtype).astype(np.float32)  # (B, h, t, S)
    visible = golden.visible[:, h0:h1][:, :, rows]
    V = mha.repeat_kv(mha.split_heads(golden.stages["v_proj"], cfg.H_kv), cfg.group_size)[:, h0:h1]
    V = _rounded(V, dtype).astype(np.float32)  # (B, h, S, D_v)
    out: dict[str, np.ndarray] = {}
    o = lse = None
    for k in range(layout.cp):
        block = np.zeros(s.shape[-1], dtype=bool)
        for a, b in chunks(s.shape[-1], layout, ring_source(layout, layout.coords(rank).cp, k)):
            block[a:b] = True
        seen = visible & block
        top = np.max(np.where(seen, s, -np.inf), axis=-1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0).astype(np.float32)
        e = np.where(seen, np.exp(s - top), 0).astype(np.float32)
        total = e.sum(axis=-1, keepdims=True)
        o_blk = np.divide(e, total, out=np.zeros_like(e), where=total > 0) @ V
        with np.errstate(divide="ignore"):
            l_blk = (np.log(total) + top)[..., 0]
        if o is None:
            o, lse = o_blk, l_blk
        else:
            with np.errstate(invalid="ignore"):
                new = np.logaddexp(lse, l_blk).astype(np.float32)
                base = np.where(np.isfinite(new), new, 0)
                a = np.where(np.isfinite(lse), np.exp(lse - base), 0).astype(np.float32)
                b = np.where(np.isfinite(l_blk), np.exp(l_blk - base), 0).astype(np.float32)
            o, lse = a[..., None] * o + b[..., None] * o_blk, new
        o = _rounded(o, dtype).astype(np.float32)
        lse = _rounded(lse, dtype).astype(np.float32)
        out[ring_stage("out", k)], out[ring_stage("lse", k)] = o.astype(np.float64), lse.astype(np.float64)
    return out


class FakeLauncher:
    """Runs every rank of a case as its exact golden rounded to the case's dtype, with ``bug`` applied;
    ``crash``: that rank replies an error; ``issued``: the collectives each rank reports."""

    def __init__(self, bug: str = "", crash: int | None = None, issued: dict[str, int] | None = None,
                 promised: dict[str, int] | None = None) -> None:
        self.bug, self.crash, self.issued, self.promised = bug, crash, issued, promised
        self.closed = False

    def start(self, adapter: Any, world: int) -> dict[str, Any]:
        adapter = load_adapter(adapter) if isinstance(adapter, str) else adapter  # (a name, as a real launcher gets)
        self.layout = adapter.layout(world)
        return {"name": adapter.name, "layout": self.layout.as_dict(), "collectives": self.promised}

    def run(self, case: Any, timeout: float) -> list[RankReply]:
        golden = GOLDEN.load(case.id)
        out = []
        for rank in range(self.layout.world):
            if rank == self.crash:
                out.append(RankReply(rank, None, error="run_rank() raised RuntimeError: boom"))
                continue
            exact = rank_stages(golden.stages, golden.visible, golden.weights, golden.spec.config, self.layout, rank)
            _bug(self.bug, exact, golden, self.layout, rank)
            stages = {k: _rounded(v, case.dtype) for k, v in exact.items()}
            if self.bug == "computed in the dtype" and self.layout.cp > 1:
                stages.update(_ring_in_the_dtype(golden, self.layout, rank, case.dtype))
            out.append(RankReply(rank, stages, issued=self.issued))
        if self.bug == "computed in the dtype" and self.layout.tp > 1 and self.layout.cp == 1:
            total = out[0].stages["o_partial"]  # the all-reduce in the dtype, rank by rank, then b_o once
            for reply in out[1:]:
                total = _rounded(total + reply.stages["o_partial"], case.dtype)
            for reply in out:
                reply.stages["output"] = _rounded(total + golden.weights["b_o"], case.dtype)
        return out

    def close(self) -> None:
        self.closed = True


def _run(monkeypatch: pytest.MonkeyPatch, layout: Layout, case: str, dtypes: Any, launcher: FakeLauncher | None = None,
         **options: Any) -> Any:
    launcher = launcher or FakeLauncher()
    monkeypatch.setattr(judge_module, "launcher_for", lambda name: launcher)
    return check(FakeRanks(layout), dtypes=dtypes, cases=[case], isolate=False, world=layout.world, **options)


CORRECT = [
    (Layout(tp=2), "bloom_alibi", DTYPES),
    (Layout(tp=4), "gqa", DTYPES),  # H_kv = 2 < tp = 4: replicated
    (Layout(cp=2), "bloom_alibi", DTYPES),  # causal ring, contiguous
    (Layout(cp=2, partition="zigzag"), "bloom_alibi", DTYPES),
    (Layout(tp=2, cp=2), "bloom_alibi", ("float32", "bfloat16")),
    (Layout(cp=2, strategy="ulysses"), "gpt_oss_sinks_window", ("float32", "float16")),
    (Layout(cp=2, strategy="allgather"), "self_masked_rows", ("float32", "bfloat16")),
]


@pytest.mark.parametrize("layout,case,dtypes", CORRECT, ids=[f"{l.describe()}-{c}" for l, c, _ in CORRECT])
def test_correct_ranks_pass_in_every_dtype(monkeypatch: pytest.MonkeyPatch, layout: Layout, case: str,
                                           dtypes: tuple[str, ...]) -> None:
    report = _run(monkeypatch, layout, case, list(dtypes))
    for res in report.results:
        assert res.verdict == PASS, (res.dtype, res.message, [r.message for r in res.ranks])
        assert [r.rank for r in res.ranks] == list(range(layout.world))
        assert all(r.verdict == PASS for r in res.ranks)
        judged = {st.stage for r in res.ranks for st in r.stages if st.verdict == PASS}
        assert "output" in judged
        if layout.tp > 1:
            assert "o_partial" in judged
        if layout.cp > 1 and layout.strategy == "ring":
            assert {ring_stage(kind, k) for kind in ("out", "lse") for k in range(layout.cp)} <= judged
    assert report.layout == {**layout.as_dict(), "world": layout.world}


COMPUTED = [(Layout(cp=2, partition="zigzag"), "bloom_alibi"), (Layout(cp=4), "bloom_alibi"), (Layout(tp=4), "gqa")]


@pytest.mark.parametrize("layout,case", COMPUTED, ids=[f"{l.describe()}-{c}" for l, c in COMPUTED])
def test_a_ring_and_an_all_reduce_computed_in_the_dtype_pass(monkeypatch: pytest.MonkeyPatch, layout: Layout,
                                                               case: str) -> None:
    """The merge and all-reduce terms (model/ranks.py) are wide enough for a kernel's way: float32 blocks and
    merges, the running values stored in the dtype; partials summed in the dtype."""
    report = _run(monkeypatch, layout, case, ["float32", "float16", "bfloat16"], FakeLauncher("computed in the dtype"))
    for res in report.results:
        assert res.verdict == PASS, (res.dtype, res.message)
        assert res.worst_ratio is not None and res.worst_ratio < 0.5, (res.dtype, res.worst_ratio)


def test_correct_ranks_pass_the_worst_case_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    # (float16: the worst-case bound of some ranks' rows of the output is at least |output| — uninformative,
    # rank by rank, as it would be for those rows of the unsharded case)
    report = _run(monkeypatch, Layout(tp=2, cp=2), "bloom_alibi", ["float64", "float32"], precision="worst-case")
    assert [r.verdict for r in report.results] == [PASS, PASS], [r.message for r in report.results]


BUGS = [  # (bug, layout, case, the first failing rank, its stage)
    ("bias on every rank", Layout(tp=2), "bloom_alibi", 0, "output"),
    ("missing all-reduce", Layout(tp=2, cp=2), "bloom_alibi", 0, "output"),
    ("rank 1's partial off by 1e-2", Layout(tp=2), "bloom_alibi", 1, "o_partial"),
    ("lse merged by addition", Layout(cp=2, partition="zigzag"), "bloom_alibi", 0, "ring_lse[1]"),
]


@pytest.mark.parametrize("bug,layout,case,rank,stage", BUGS, ids=[b[0] for b in BUGS])
def test_each_bug_fails_at_its_rank_step_and_stage(monkeypatch: pytest.MonkeyPatch, bug: str, layout: Layout,
                                                   case: str, rank: int, stage: str) -> None:
    report = _run(monkeypatch, layout, case, list(DTYPES), FakeLauncher(bug))
    tp, cp = layout.coords(rank)
    for res in report.results:
        assert res.verdict == FAIL, (res.dtype, res.message)
        assert res.first_failing_stage == stage, (res.dtype, res.message)
        failing = next(r for r in res.ranks if r.verdict == FAIL)
        assert (failing.rank, failing.first_failing_stage) == (rank, stage)
        label = f"rank {rank} of {layout.world} (tp {tp}, cp {cp})"
        if stage.startswith("ring_"):
            assert failing.step == 1
            assert res.message.startswith(f"{label}, step 2 of {layout.cp}: {stage} fails — ")
        else:
            assert failing.step is None and res.message.startswith(f"{label}: {stage} fails — ")
        assert res.stage(stage).message.startswith(label)


def test_a_crashed_rank_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _run(monkeypatch, Layout(tp=2), "bloom_alibi", ["float32"], FakeLauncher(crash=1))
    (res,) = report.results
    assert res.verdict == ERROR
    assert res.message == "rank 1 of 2 (tp 1, cp 0): run_rank() raised RuntimeError: boom"
    assert [r.verdict for r in res.ranks] == [PASS, ERROR]
    assert report.exit_code == 2


def test_collectives_other_than_promised_fail_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = FakeLauncher(promised={"all_reduce": 1}, issued={"all_gather": 3})
    report = _run(monkeypatch, Layout(tp=2), "bloom_alibi", ["float32"], launcher)
    (res,) = report.results
    assert res.verdict == FAIL
    assert res.ranks[0].collectives == ("collectives: promised all_reduce 1, issued all_gather 3 "
                                        "(falls back to gathering everything?)")
    assert res.message.startswith("rank 0 of 2 (tp 0, cp 0): collectives: promised all_reduce 1")
    kept = _run(monkeypatch, Layout(tp=2), "bloom_alibi", ["float32"],
                FakeLauncher(promised={"all_reduce": 1, "all_gather": 0}, issued={"all_reduce": 1}))
    assert kept.results[0].verdict == PASS


def test_cases_a_layout_cannot_shard_are_unsupported_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    report = _run(monkeypatch, Layout(tp=4), "mqa", ["float32"])  # H = 6 heads over tp = 4
    (res,) = report.results
    assert res.verdict == UNSUPPORTED
    assert res.message == "layout tp 4: H = 6 heads do not split over tp = 4 ranks"


def test_the_json_report_and_the_matrix_carry_each_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    report = _run(monkeypatch, Layout(cp=2), "bloom_alibi", ["float32"], FakeLauncher("lse merged by addition"))
    path = tmp_path / "report.json"
    report.write_json(path)
    data = json.loads(path.read_text())
    (res,) = data["results"]
    assert [r["rank"] for r in res["ranks"]] == [0, 1]
    assert res["ranks"][0]["first_failing_stage"] == "ring_lse[1]" and res["ranks"][0]["step"] == 1
    assert data["adapter"]["layout"]["cp"] == 2 and data["adapter"]["layout"]["world"] == 2

    from mhaspec.conformance import matrix

    m = matrix.build([path])
    (row,) = m.rows
    assert row.framework == "world 2: cp 2 (ring, contiguous)"
    hover = matrix.hover_text(m, row.key, "bloom_alibi", "float32")
    assert "rank 0 (tp 0, cp 0): fail at ring_lse[1] (step 2)" in hover


def test_a_distributed_adapter_says_so() -> None:
    assert describe_adapter(FakeRanks(Layout(tp=2)))["distributed"] == {"launcher": "threads"}


def test_world_on_an_adapter_that_is_not_distributed_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "numpy", "--no-isolate", "--world", "2", "-k", "self_basic", "--dtype", "float64"])
    assert code == 2
    assert "--world 2: adapter numpy is not distributed" in capsys.readouterr().err


@pytest.mark.parametrize("world", ["0", "-1"])
def test_a_world_below_one_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            world: str) -> None:
    monkeypatch.setattr(judge_module, "launcher_for", lambda name: FakeLauncher())
    code = main(["run", f"{__file__}:FAKE_TP2", "--no-isolate", "--world", world, "-k", "self_basic"])
    assert code == 2
    assert f"--world: a number of ranks >= 1, got {int(world)}" in capsys.readouterr().err


FAKE_TP2 = FakeRanks(Layout(tp=2))



PLUGIN = '''
from mhaspec.conformance import ranks
from mhaspec.spec.ranks import Layout
from tests.test_ranks_judge import FakeLauncher, FakeRanks

ranks.launcher_for = lambda name: FakeLauncher("bias on every rank", promised={"all_reduce": 1},
                                               issued={"all_reduce": 1})
ADAPTER = FakeRanks(Layout(tp=2))
'''


def test_the_pytest_plugin_gives_each_rank_stage_a_test(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    from pathlib import Path

    (tmp_path / "fake_ranks.py").write_text(PLUGIN)
    root = Path(__file__).resolve().parents[1]
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "fake_ranks", "--pyargs", "mhaspec.conformance",
         "--mha-adapter=fake_ranks:ADAPTER", "--mha-no-isolate", "--mha-world=2", "--mha-dtype=float32",
         "-k", "bloom_alibi", f"--junitxml={junit}", "-q"], capture_output=True, text=True, cwd=tmp_path, env=env)
    outcomes = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in tc}
        outcomes[tc.get("name").split("[", 1)[1].rstrip("]")] = (
            "fail" if kinds & {"failure", "error"} else "skip" if "skipped" in kinds else "pass")
    assert outcomes["bloom_alibi-float32-output"] == "fail", done.stdout[-2000:]
    assert outcomes["bloom_alibi-float32-o_partial"] == "pass"
    assert outcomes["bloom_alibi-float32-concat"] == "pass"
    assert outcomes["bloom_alibi-float32-collectives"] == "pass"
    assert "rank 0 of 2 (tp 0, cp 0): " in done.stdout


def test_a_distributed_adapter_by_name_is_described_by_a_worker_then_run_by_its_launcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = FakeLauncher()
    monkeypatch.setattr(judge_module, "launcher_for", lambda name: launcher)
    report = check(f"{__file__}:FAKE_TP2", dtypes=["float32"], cases=["bloom_alibi"], world=2)
    assert [r.verdict for r in report.results] == [PASS], report.results[0].message
    assert launcher.closed  # (the session closed its launcher)


def test_a_case_made_one_block_of_rows_at_a_time_is_judged_whole_per_rank() -> None:
    """(``--catalog``'s large cases: fixtures.RowBlocks) a rank's views are of the whole case, not its blocks."""
    from mhaspec.conformance.runner import Session
    from mhaspec.reference.onthefly import row_blocks
    from mhaspec.spec.catalog import CATALOG

    spec = CATALOG["bloom_alibi"]
    golden, layout = row_blocks(spec), Layout(cp=2, partition="zigzag")
    session = Session("numpy", isolate=False)
    try:
        replies = []
        for rank in range(layout.world):
            exact = rank_stages(golden.stages, golden.visible, golden.weights, spec.config, layout, rank)
            _bug("lse merged by addition", exact, golden, layout, rank)
            replies.append(RankReply(rank, {k: _rounded(v, "float32") for k, v in exact.items()}))
        verdict, _, results, message = judge_module.judge_ranks(
            golden, layout, replies, lambda view, mapping: session.judge_stages(view, "float32", mapping), "float32")
    finally:
        session.close()
    assert verdict == FAIL and results[0].first_failing_stage == "ring_lse[1]", message
    assert all(st.verdict == PASS for st in results[1].stages), results[1].message
