"""The torch.distributed ranks (issue 33): the gloo launcher (protocol/transports/torch_ranks.py) and the
built-in adapters torch-tp (DTensor), torch-ring, torch-ring-zigzag, torch-ulysses (adapters/torch_ranks.py),
each rank's stages against its exact golden (mhaspec.reference.ranks.rank_stages), the collectives each rank
issued against the ones its layout promises, bugs of the kill list caught, and ranks that raise, die or hang.

Tolerances: each rank's stage is held to the tolerance the suite gives the unsharded stage in the dtype
(conformance.tolerance.stage_tolerances, sliced to the rank as its golden is); ``o_partial`` (a product of
fewer terms than ``output``) to the output's, and a ring's steps ``ring_out[k]`` / ``ring_lse[k]`` (a softmax
over fewer keys) to ``head_outputs``'s / ``lse``'s.  The launcher starts a fresh group per adapter and world
(module-scoped fixtures: a start costs 5–25 s of two shared cores)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import require
from tests.frameworks.helpers import GOLDEN

require("torch")

from mhaspec.conformance.tolerance import stage_tolerances  # noqa: E402
from mhaspec.protocol.transports.torch_ranks import TorchLauncher  # noqa: E402
from mhaspec.reference.ranks import rank_stages  # noqa: E402
from mhaspec.spec.ranks import Layout, parse_ring_stage  # noqa: E402

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
def launchers():
    """One started launcher per (adapter, world), closed at the end of the module."""
    started: dict[tuple[str, int], TorchLauncher] = {}

    def get(adapter: str, world: int) -> TorchLauncher:
        if (adapter, world) not in started:
            launcher = TorchLauncher()
            launcher.start(adapter, world)
            started[adapter, world] = launcher
        return started[adapter, world]

    yield get
    for launcher in started.values():
        launcher.close()


def base_stage(name: str) -> str:
    """The unsharded stage whose tolerance a rank stage is held to (module docstring)."""
    ring = parse_ring_stage(name)
    if ring is not None:
        return "head_outputs" if ring[0] == "out" else "lse"
    return "output" if name == "o_partial" else name


def rank_tolerances(golden, dtype: str, layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """The unsharded stages' tolerances in ``dtype``, sliced to rank ``rank`` (the ring's slices are the
    all-gather's: its steps are not slices)."""
    tolerances = stage_tolerances(golden, dtype, reference_error=True)
    slicing = dataclasses.replace(layout, strategy="allgather") if layout.strategy == "ring" else layout
    return rank_stages(tolerances, golden.visible, golden.weights, golden.spec.config, slicing, rank)


def failures(replies, golden, dtype: str, layout: Layout) -> list[str]:
    """``rank R stage S: …`` for every rank stage off its golden by more than its tolerance (or of another
    shape, or finite where the golden is not); an error reply is one failure."""
    out = []
    for reply in replies:
        if reply.error:
            out.append(reply.error)
            continue
        gold = rank_stages(golden.stages, golden.visible, golden.weights, golden.spec.config, layout, reply.rank)
        tol = rank_tolerances(golden, dtype, layout, reply.rank)
        for name, value in reply.stages.items():
            want = gold[name]
            value = np.asarray(value, dtype=np.float64)
            if value.shape != want.shape:
                out.append(f"rank {reply.rank} {name}: shape {value.shape}, golden {want.shape}")
                continue
            finite = np.isfinite(want)
            if not np.array_equal(np.isfinite(value), finite) or not np.array_equal(value[~finite], want[~finite]):
                out.append(f"rank {reply.rank} {name}: not finite where the golden is (or the other way)")
                continue
            excess = np.abs(value[finite] - want[finite]) - tol[base_stage(name)][finite]
            if excess.size and excess.max() > 0:
                out.append(f"rank {reply.rank} {name}: {int((excess > 0).sum())} elements past the tolerance")
    return out


def run_case(launchers, adapter: str, world: int, case_id: str, dtype: str):
    launcher = launchers(adapter, world)
    layout = Layout(**launcher.info["layout"])
    golden = GOLDEN.load(case_id)
    assert layout.problem(golden.spec.config, golden.spec.tgt_len, golden.spec.src_len) is None, case_id
    return launcher, layout, golden, launcher.run(golden.case(dtype), TIMEOUT)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("adapter", "world"), list(CASES))
def test_every_rank_conforms(launchers, adapter, world, dtype):
    """Every stage of every rank within the tolerance (gloo reduces bfloat16 on the CPU); every rank issued
    exactly the collectives the layout promises."""
    for case_id in CASES[adapter, world]:
        launcher, layout, golden, replies = run_case(launchers, adapter, world, case_id, dtype)
        assert [r.rank for r in replies] == list(range(world))
        assert failures(replies, golden, dtype, layout) == [], (case_id, dtype)
        promised = launcher.info["collectives"]
        assert all(r.issued == promised for r in replies), (case_id, [r.issued for r in replies], promised)


def test_returned_stages(launchers):
    """The rank stages each adapter has: o_partial for tp, every ring step for the rings, no attn_weights in a
    ring (it never normalises a row over every key at once)."""
    _, _, _, tp = run_case(launchers, "torch-tp", 2, "mqa", "float64")
    assert "o_partial" in tp[0].stages and "attn_weights" in tp[0].stages
    _, _, _, ring = run_case(launchers, "torch-ring-zigzag", 4, "long_sequence", "float64")
    assert {f"ring_{kind}[{k}]" for kind in ("out", "lse") for k in range(4)} <= set(ring[2].stages)
    assert "attn_weights" not in ring[2].stages and "o_partial" not in ring[2].stages


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_on_every_rank_is_caught(launchers, dtype):
    """The output bias added on every rank: every rank's output fails, nothing before it does."""
    launcher, layout, golden, replies = run_case(launchers, f"{ZOO}:BiasOnEveryRank", 2, "gqa", dtype)
    found = failures(replies, golden, dtype, layout)
    assert found and all(f.split(":")[0].endswith("output") for f in found), found
    assert {f.split()[1] for f in found} == {"0", "1"}


def test_missing_all_reduce_is_caught(launchers):
    """No all-reduce: the collectives issued differ from the promised, and the output fails on every rank."""
    launcher, layout, golden, replies = run_case(launchers, f"{ZOO}:MissingAllReduce", 2, "gqa", "float32")
    assert all(r.issued == {} for r in replies) and launcher.info["collectives"] == {"all_reduce": 1}
    found = failures(replies, golden, "float32", layout)
    assert {f.split(":")[0] for f in found} == {"rank 0 output", "rank 1 output"}, found


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_merged_by_addition_is_caught(launchers, dtype):
    """An LSE merged by addition: ring_lse[1] fails (step 0 merges into nothing and passes)."""
    launcher, layout, golden, replies = run_case(launchers, f"{ZOO}:AddedLse", 2, "self_masked_rows", dtype)
    found = failures(replies, golden, dtype, layout)
    assert any("ring_lse[1]" in f for f in found), found
    assert not any("ring_lse[0]" in f or "ring_out[0]" in f for f in found), found


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
    try:
        raised = launcher.run(GOLDEN.load("long_sequence").case("float64"), TIMEOUT)
        assert raised[1].error.startswith("rank 1: run_rank() raised ValueError: rank 1 refuses"), raised[1].error
        died = launcher.run(GOLDEN.load("bloom_alibi").case("float64"), TIMEOUT)
        assert died[1].error == "rank 1: worker killed by SIGKILL; every rank was killed", died[1].error
        start = time.monotonic()
        hung = launcher.run(GOLDEN.load("gpt_oss_sinks_window").case("float64"), 10.0)
        assert time.monotonic() - start < 20
        assert all(r.error and r.error.startswith(f"rank {r.rank}: ") for r in hung), hung
        assert "did not answer within 10 s" in hung[1].error
        assert launcher.restarts == 2 and failures(launcher.run(ok.case("float64"), TIMEOUT), ok, "float64", layout) == []
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
