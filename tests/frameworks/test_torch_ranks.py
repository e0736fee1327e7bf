"""The torch.distributed ranks (issue 33): the gloo launcher (protocol/transports/torch_ranks.py) and the
built-in adapters torch-tp (DTensor), torch-ring, torch-ring-zigzag, torch-ulysses (adapters/torch_ranks.py),
judged by the rank judge (conformance/ranks.py: each rank's stages against its slice of the golden, the
collectives each rank issued against the ones its layout promises), bugs of the kill list caught at the right
rank and stage, ranks that raise, die or hang, and ``python -m mhaspec.dist`` under torchrun.  One session
(one group of ranks) per adapter and world, shared by the module: a start costs 5–25 s of two shared cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require
from tests.frameworks.helpers import GOLDEN

require("torch")

from mhaspec.conformance import Session  # noqa: E402
from mhaspec.protocol.transports.torch_ranks import TorchLauncher  # noqa: E402
from mhaspec.reference.ranks import rank_stages  # noqa: E402
from mhaspec.spec.ranks import Layout  # noqa: E402

pytestmark = pytest.mark.distributed

ZOO = str(Path(__file__).with_name("torch_rank_zoo.py"))
#: seconds a case may take on every rank (the first collective of a fresh group connects it: up to ~20 s here)
TIMEOUT = 120.0

#: (adapter, world) -> catalog cases that fit its layout (Layout.problem), chosen for their variants
CASES = {
    ("torch-tp", 2): ["mqa", "key_padding", "llama3_rope"],  # mqa: H_kv = 1 < tp, replicated; a mask (B, 1, 1, S)
    ("torch-tp", 4): ["gqa", "gpt_oss_sinks_window"],  # gqa: H_kv = 2 < tp = 4
    ("torch-ring", 2): ["causal_and_mask", "gpt_oss_sinks_window", "bloom_alibi"],
    ("torch-ring-zigzag", 4): ["long_sequence"],
    ("torch-ulysses", 2): ["self_masked_rows", "softcap_large_logits"],
}
#: float64 (tight) and bfloat16 (the widest tolerance, the all-reduce in the dtype); every dtype of every
#: catalog case that fits is judged by `mhaspec run ADAPTER --world N` (docs/distributed.md, the figures)
DTYPES = ("float64", "bfloat16")


@pytest.fixture(scope="module")
def sessions():
    """One session (its ranks started once) per (adapter, world), closed at the end of the module."""
    started: dict[tuple[str, int], Session] = {}

    def get(adapter: str, world: int) -> Session:
        if (adapter, world) not in started:
            started[adapter, world] = Session(adapter, timeout=TIMEOUT, isolate=False, world=world)
        return started[adapter, world]

    yield get
    for session in started.values():
        session.close()


def judged(sessions, adapter: str, world: int, case_id: str, dtype: str):
    """The verdict on ``case_id`` in ``dtype``; the case fits the layout (else the test is wrong)."""
    session = sessions(adapter, world)
    spec = GOLDEN.load(case_id).spec
    assert session.layout.problem(spec.config, spec.tgt_len, spec.src_len) is None, case_id
    return session.result(case_id, dtype)


def stage_verdicts(rank) -> dict[str, str]:
    return {st.stage: st.verdict for st in rank.stages}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("adapter", "world"), list(CASES))
def test_every_rank_conforms(sessions, adapter, world, dtype):
    """Every rank passes (gloo reduces bfloat16 on the CPU), each having issued exactly the collectives its
    layout promises."""
    for case_id in CASES[adapter, world]:
        result = judged(sessions, adapter, world, case_id, dtype)
        assert result.verdict == "pass", (case_id, dtype, result.message)
        assert [r.rank for r in result.ranks] == list(range(world))
        assert all(r.verdict == "pass" and r.collectives == "" and r.issued for r in result.ranks), case_id


def test_judged_stages(sessions):
    """The rank stages each adapter has, judged: o_partial for tp, every ring step for the rings, no
    attn_weights in a ring (it never normalises a row over every key at once)."""
    tp = judged(sessions, "torch-tp", 2, "mqa", "float64").ranks[0]
    assert {"o_partial", "attn_weights", "output"} <= set(stage_verdicts(tp))
    ring = stage_verdicts(judged(sessions, "torch-ring-zigzag", 4, "long_sequence", "float64").ranks[2])
    assert {f"ring_{kind}[{k}]" for kind in ("out", "lse") for k in range(4)} <= set(ring)
    assert ring["attn_weights"] == "not exposed" and "o_partial" not in ring


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_on_every_rank_is_caught(sessions, dtype):
    """The output bias added on every rank: every rank's output fails, every stage before it passes."""
    result = judged(sessions, f"{ZOO}:BiasOnEveryRank", 2, "gqa", dtype)
    assert result.verdict == "fail" and result.first_failing_stage == "output"
    for rank in result.ranks:
        verdicts = stage_verdicts(rank)
        assert rank.first_failing_stage == "output" and verdicts["o_partial"] == "pass", verdicts


def test_missing_all_reduce_is_caught(sessions):
    """No all-reduce: every rank issued none of the promised one, and its output fails."""
    result = judged(sessions, f"{ZOO}:MissingAllReduce", 2, "gqa", "float32")
    assert result.verdict == "fail"
    for rank in result.ranks:
        assert rank.issued == {} and "promised all_reduce 1" in rank.collectives, rank.collectives
        assert stage_verdicts(rank)["output"] == "fail"


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_merged_by_addition_is_caught(sessions, dtype):
    """An LSE merged by addition: ring_lse[1] fails on every rank, step 0 (merged into nothing) passes."""
    result = judged(sessions, f"{ZOO}:AddedLse", 2, "self_masked_rows", dtype)
    assert result.verdict == "fail"
    for rank in result.ranks:
        verdicts = stage_verdicts(rank)
        assert verdicts["ring_lse[1]"] == "fail" and verdicts["ring_lse[0]"] == verdicts["ring_out[0]"] == "pass"


def _children() -> set[int]:
    """The pids of this process's children (Linux /proc)."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(entry.name))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts children in /proc")
def test_a_rank_that_raises_dies_or_hangs_costs_one_case():
    """Rank 1 raises, is killed, hangs: each costs that case with replies naming the rank; the ranks are
    restarted for the next case, which conforms; close() leaves no process behind."""
    before = _children()
    launcher = TorchLauncher()
    launcher.start(f"{ZOO}:Faulty", 2)
    layout = Layout(**launcher.info["layout"])
    ok = GOLDEN.load("self_masked_rows")
    stages = set(rank_stages(ok.stages, ok.visible, ok.weights, ok.spec.config, layout, 0)) - {"attn_weights"}
    try:
        raised = launcher.run(GOLDEN.load("long_sequence").case("float64"), TIMEOUT)
        assert raised[1].error.startswith("rank 1: run_rank() raised ValueError: rank 1 refuses"), raised[1].error
        died = launcher.run(GOLDEN.load("bloom_alibi").case("float64"), TIMEOUT)
        assert died[1].error == "rank 1: worker killed by SIGKILL; every rank was killed", died[1].error
        hung = launcher.run(GOLDEN.load("gpt_oss_sinks_window").case("float64"), 10.0)  # rank 1 sleeps an hour
        assert all(r.error and r.error.startswith(f"rank {r.rank}: ") for r in hung), hung
        assert "did not answer within 10 s" in hung[1].error
        assert launcher.restarts == 2
        assert all(r.error is None and set(r.stages) == stages for r in launcher.run(ok.case("float64"), TIMEOUT))
        assert launcher.restarts == 3
        running = {p.pid for p in launcher.processes}
        assert len(running) == 2 and running <= _children()
    finally:
        launcher.close()
    assert launcher.processes == [] and _children() <= before



def _dist(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` with this tree's mhaspec, outside any job (no RANK, WORLD_SIZE, SLURM_* of ours)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_python_m_mhaspec_dist_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m mhaspec.dist torch-tp …`: rank 0 judges every rank, writes the report,
    and both processes exit with its status (0: conforms)."""
    report = tmp_path / "tp.json"
    done = _dist(["-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "mhaspec.dist", "torch-tp",
                  "-k", "mqa", "--dtype", "float64,bfloat16", "--report", str(report)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ranks: world 2 · tp 2" in done.stdout and "torch-tp: CONFORMS" in done.stdout
    judged = [r for r in json.loads(report.read_text())["results"] if r["verdict"] == "pass"]
    assert judged and all(len(r["ranks"]) == 2 for r in judged)


def test_python_m_mhaspec_dist_outside_a_job_is_a_usage_error(tmp_path):
    done = _dist(["-m", "mhaspec.dist", "torch-tp"], tmp_path)
    assert done.returncode == 2
    assert "RANK and WORLD_SIZE are not set: run under torchrun" in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts children in /proc")
def test_an_adapter_that_is_not_distributed_is_refused_by_every_rank_and_none_is_left():
    from mhaspec.errors import AdapterError

    before = _children()
    launcher = TorchLauncher()
    with pytest.raises(AdapterError, match=r"rank 0: adapter 'numpy' has no run_rank\(ctx, case\)"):
        launcher.start("numpy", 2)
    assert launcher.processes == [] and _children() <= before
