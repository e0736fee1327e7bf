"""The adapter runs in a worker process: whatever it does to its process costs one case.

Each fault of issue #10 is provoked by a real adapter (a file loaded by name,
so the worker is spawned, or an object, so it is forked) and must give the
verdict ``error`` naming the cause, with the other cases still judged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import ERROR, PASS, UNSUPPORTED, Session
from mhaspec.conformance import runner as runner_module
from mhaspec.errors import MhaspecError
from mhaspec.spec import CATALOG, SPEC_VERSION

FAULTY = textwrap.dedent(
    '''
    """Adapters that misbehave in every way a process can."""
    import ctypes
    import os
    import sys
    import threading
    import time

    from mhaspec.adapters.numpy_mha import NumpyMHA

    FAULTS = {
        "self_basic": "sys_exit",
        "no_bias": "os_exit",
        "one_head": "abort",
        "head_dim_1": "segfault",
        "gqa": "hang",
        "mqa": "native_hang",
        "custom_scale": "stray_thread",
    }


    class Faulty:
        name = "faulty"

        def run(self, case):
            fault = FAULTS.get(case.id)
            if fault == "sys_exit":
                sys.exit(0)
            if fault == "os_exit":
                os._exit(0)
            if fault == "abort":
                os.abort()
            if fault == "segfault":
                ctypes.string_at(0)
            if fault == "hang":
                time.sleep(600)
            if fault == "native_hang":
                ctypes.PyDLL(None).sleep(600)  # C code holding the GIL: a thread-based timeout cannot stop it
            if fault == "stray_thread":
                threading.Thread(target=time.sleep, args=(600,)).start()  # non-daemon, never ends
            return NumpyMHA().run(case)


    class Slow:
        """Correct, but takes a while on one case (for Ctrl-C)."""
        name = "slow"

        def run(self, case):
            if case.id == "large_logits":
                time.sleep(600)
            return NumpyMHA().run(case)


    class Declines:
        name = "declines"

        def supports(self, case):
            return "declines everything"

        def run(self, case):
            raise AssertionError("never called")


    class Scribbler:
        """Writes garbage to every pipe it can find, the worker's own included."""
        name = "scribbler"

        def run(self, case):
            import stat

            if case.id == "gqa":
                for fd in range(3, 256):
                    try:
                        if stat.S_ISFIFO(os.fstat(fd).st_mode):
                            os.write(fd, bytes([255]) * 64)
                    except OSError:
                        pass
            return NumpyMHA().run(case)


    class Identity:
        """Fails unless the inputs that are one array in the runner are one array here too."""
        name = "identity"

        def run(self, case):
            x = case.inputs
            from mhaspec.spec import CATALOG

            kind = CATALOG[case.id].inputs  # as the catalog says
            self_attention, key_is_value = kind == "self", kind in ("self", "shared_kv")
            assert (case.self_attention, case.key_is_value) == (self_attention, key_is_value), case.id
            assert (x.query is x.key is x.value) == self_attention, case.id
            assert (x.key is x.value) == key_is_value, case.id
            assert not x.query.flags.writeable and not case.weights.w_q.flags.writeable
            return NumpyMHA().run(case)


    class Cheat:
        """Looks for the golden stages in its own process, as an adapter that wants to pass would."""
        name = "cheat"

        def run(self, case):
            import gc

            for obj in gc.get_objects():
                try:
                    stages, found = obj.stages, obj.id
                except Exception:
                    continue
                if isinstance(stages, dict) and "output" in stages and found == case.id:
                    from mhaspec.spec import STAGES  # the forward stages (a golden also holds gradients)

                    return {k: stages[k].astype(case.dtype) for k in STAGES}
            raise LookupError("the golden stages are not in this process")
    '''
)

FAULT_CASES = ["self_basic", "no_bias", "one_head", "head_dim_1", "gqa", "mqa", "custom_scale"]
CASES = FAULT_CASES + ["batch_one", "causal_square", "cross_attention", "custom_mask", "key_padding", "single_token",
                       "large_logits", "long_sequence"]
EXPECTED = {
    "self_basic": "adapter called sys.exit(0) in run()",
    "no_bias": "worker exited with status 0 without answering",
    "one_head": "worker killed by SIGABRT",
    "head_dim_1": "worker killed by SIGSEGV",
    "gqa": "did not return within 2 s (per-case timeout) in run(); its worker process was killed",
    "mqa": "did not return within 2 s (per-case timeout) in run(); its worker process was killed",
}


@pytest.fixture
def faulty(tmp_path):
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    return path


def _module(path):
    spec = importlib.util.spec_from_file_location("faulty_adapters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_faults(results):
    by_case = {r.case: r for r in results}
    for case, cause in EXPECTED.items():
        assert by_case[case].verdict == ERROR and cause in by_case[case].message, (case, by_case[case].message)
    judged = [c for c in by_case if c not in EXPECTED]
    assert judged and all(by_case[c].verdict == PASS for c in judged), {c: by_case[c].message for c in judged}
    order = [r.verdict for r in results]  # catalog order: each fault is followed by a judged case
    assert all(PASS in order[i:] for i, v in enumerate(order) if v == ERROR), order


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_every_process_fault_costs_one_case_through_the_cli(faulty, tmp_path, start):
    """Adapter named by file: the worker loads it (spawned, or forked from the clean CLI process);
    the CLI must finish despite the stray thread, and write the report."""
    report = tmp_path / "report.json"
    start_time = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mhaspec", "run", f"{faulty}:Faulty", "--dtype", "float64", "--timeout", "2",
         "-k", ",".join(f"[{c[0]}]{c[1:]}" for c in CASES),  # globs match whole names: not gqa_self
         "--report", str(report)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, MHASPEC_WORKER_START=start),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start_time < 60
    rep = json.loads(report.read_text())
    assert rep["partial"] is False and rep["exit_code"] == 2 and rep["ok"] is False
    results = [mhaspec.conformance.CaseResult(r["case"], r["dtype"], r["verdict"], message=r["message"])
               for r in rep["results"]]
    assert set(CASES) <= {r.case for r in results}  # -k matches substrings: e.g. gqa_self too
    _assert_faults(results)
    assert "faulty: ERROR" in proc.stdout


def test_every_process_fault_costs_one_case_through_check_with_an_object(faulty):
    """Forked worker (adapter given as an object), through mhaspec.check()."""
    report = mhaspec.check(_module(faulty).Faulty(), dtypes=["float64"], cases=CASES, timeout=2)
    _assert_faults(report.results)
    assert report.exit_code == 2 and not report.ok


def test_sys_exit_is_an_error_also_in_process(faulty):
    report = mhaspec.check(_module(faulty).Faulty(), dtypes=["float64"], cases=["self_basic", "batch_one"],
                           isolate=False)
    assert report.result("self_basic", "float64").message == "adapter called sys.exit(0) in run()"
    assert report.result("batch_one", "float64").verdict == PASS


def test_the_worker_gets_the_same_case(faulty):
    cases = ["self_basic", "cross_shared_kv", "cross_attention", "key_padding"]
    assert {CATALOG[c].inputs for c in cases} == {"self", "shared_kv", "distinct"}
    report = mhaspec.check(f"{faulty}:Identity", cases=cases, dtypes=["float64", "bfloat16"])
    assert [r.verdict for r in report.results] == [PASS] * 8, [r.message for r in report.results]


def test_garbage_on_the_workers_pipe_costs_one_case(faulty, monkeypatch):
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")  # a fresh process: its only pipes are the worker's
    report = mhaspec.check(f"{faulty}:Scribbler", dtypes=["float32"], cases=["gqa", "mqa", "batch_one"], timeout=5)
    gqa = report.result("gqa", "float32")
    assert gqa.verdict == ERROR and "the worker sent" in gqa.message, gqa.message
    assert [report.result(c, "float32").verdict for c in ("mqa", "batch_one")] == [PASS, PASS]


def test_cases_with_the_same_id_are_never_confused():
    """Two Case objects of one id in turn (fuzz names every case "fuzz"): each must reach the worker."""
    import gc

    import numpy as np

    from mhaspec.protocol.transports import Worker
    from mhaspec.spec import CaseSpec

    class Echo:
        name = "echo"

        def run(self, case):
            return {"output": np.full((case.batch, case.tgt_len, case.config.out_dim), case.weights.w_q[0, 0])}

    worker = Worker(Echo())
    try:
        seen = []
        for seed in range(6):
            spec = CaseSpec.model_validate({"id": "same", "config": {"d_model": 4, "num_heads": 2}, "batch": 1,
                                            "tgt_len": 2, "src_len": 2, "seed": seed})
            case = spec.case("float64")
            returned, _ = worker.run(case, timeout=30)
            seen.append((float(returned["output"][0, 0, 0]), float(case.weights.w_q[0, 0])))
            del case, returned
            gc.collect()  # the next Case may get the freed one's id()
        assert all(got == want for got, want in seen), seen
        assert len({want for _, want in seen}) > 1
    finally:
        worker.close()


def test_the_golden_is_not_reachable_from_the_worker(faulty):
    cheat = _module(faulty).Cheat()
    isolated = mhaspec.check(cheat, dtypes=["float32"], cases=["gqa"])
    assert isolated.result("gqa", "float32").verdict == ERROR
    assert "the golden stages are not in this process" in isolated.result("gqa", "float32").message
    by_name = mhaspec.check(f"{faulty}:Cheat", dtypes=["float32"], cases=["gqa"])
    assert by_name.result("gqa", "float32").verdict == ERROR
    # Control: in the runner's own process the same adapter does find them (why isolation is the default).
    in_process = mhaspec.check(cheat, dtypes=["float32"], cases=["gqa"], isolate=False)
    assert in_process.result("gqa", "float32").verdict == PASS


def test_hung_adapters_stop_being_called_after_a_few_timeouts(faulty, monkeypatch):
    monkeypatch.setattr(runner_module, "MAX_TIMEOUTS", 2)
    report = mhaspec.check(_module(faulty).Faulty(), dtypes=["float64", "float32"], cases=["gqa", "mqa"],
                           timeout=0.5)
    messages = [r.message for r in report.results]
    assert [r.verdict for r in report.results] == [ERROR] * 4
    assert ["did not return within 0.5 s" in m for m in messages] == [True, True, False, False], messages
    assert all(m.startswith("not run: the adapter already timed out on 2 case×dtype") for m in messages[2:])


def test_bfloat16_results_survive_the_trip():
    from mhaspec.io.safetensors import decode as decode_arrays, encode as encode_arrays
    import ml_dtypes
    import numpy as np

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
              "b": np.array([1.5, -2.0], dtype=">f8"), "c": np.zeros((0, 3), np.float16), "d": np.array(True)}
    back = decode_arrays(encode_arrays(arrays))
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype.newbyteorder("=") and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name].astype(np.float64), value.astype(np.float64))
    report = mhaspec.check("numpy", dtypes=["bfloat16"], cases=["gqa"])
    assert report.ok and report.result("gqa", "bfloat16").stage("output").compared > 0


def test_returned_values_are_judged_the_same_in_and_out_of_process():
    import numpy as np

    class Odd:
        name = "odd"

        def run(self, case):
            shape = (case.batch, case.tgt_len, case.config.out_dim)
            return {"output": np.zeros(shape, complex), "scores": object(), "q_proj": np.zeros(shape, int),
                    "concat": [[1, 2], [3]]}

    outside = mhaspec.check(Odd(), dtypes=["float64"], cases=["gqa"]).result("gqa", "float64")
    inside = mhaspec.check(Odd(), dtypes=["float64"], cases=["gqa"], isolate=False).result("gqa", "float64")
    assert [(s.stage, s.verdict, s.message) for s in outside.stages] == [
        (s.stage, s.verdict, s.message) for s in inside.stages]
    assert "dtype complex128 is not a floating-point dtype" in outside.stage("output").message

    class NotAMapping:
        name = "list"

        def run(self, case):
            return [1, 2]

    result = mhaspec.check(NotAMapping(), dtypes=["float64"], cases=["gqa"]).result("gqa", "float64")
    assert result.verdict == ERROR and "run() returned list, expected a mapping" in result.message


def test_nothing_judged_is_never_a_pass(faulty, tmp_path, capsys):
    assert main(["run", "--dtype", "", "-k", "gqa"]) == 2
    assert "nothing was judged: no case × dtype was selected" in capsys.readouterr().out
    report = mhaspec.check(f"{faulty}:Declines", dtypes=["float32"], cases=["gqa", "mqa"])
    assert [r.verdict for r in report.results] == [UNSUPPORTED, UNSUPPORTED]
    assert not report.ok and report.exit_code == 2
    assert "does not support any of the 2 selected" in report.nothing_judged
    assert main(["run", f"{faulty}:Declines", "-k", "gqa"]) == 2
    assert "NOTHING JUDGED" in capsys.readouterr().out

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps({"format": "mhaspec-golden", "spec_version": SPEC_VERSION, "cases": []}))
    assert main(["run", "--golden", str(empty)]) == 2
    assert "nothing was judged" in capsys.readouterr().out
    assert not mhaspec.check("numpy", golden=empty).ok


def test_a_broken_fixture_costs_one_case_and_the_report_is_written(tmp_path, capsys):
    import shutil

    from mhaspec.fixtures import DEFAULT_GOLDEN

    folder = tmp_path / "g"
    shutil.copytree(DEFAULT_GOLDEN, folder)
    data = bytearray((folder / "gqa.safetensors").read_bytes())
    data[-3] ^= 0x10
    (folder / "gqa.safetensors").write_bytes(bytes(data))
    report = tmp_path / "r.json"
    assert main(["run", "--golden", str(folder), "--dtype", "float32", "--report", str(report)]) == 2
    out = capsys.readouterr().out
    assert "gqa [float32] error: fixture: " in out and "gqa.safetensors: corrupted fixture" in out
    rep = json.loads(report.read_text())
    verdicts = {r["case"]: r["verdict"] for r in rep["results"]}
    assert verdicts.pop("gqa") == ERROR and len(verdicts) >= 20
    # (a case with a schedule: judged through decode(case), unsupported by an adapter without it)
    assert {v for c, v in verdicts.items() if CATALOG[c].schedule is None} == {PASS}


def test_a_fatal_fixture_problem_still_writes_a_partial_report(tmp_path, capsys):
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "manifest.json").write_text("{ broken")
    report = tmp_path / "r.json"
    assert main(["run", "--golden", str(folder), "--report", str(report)]) == 2
    assert "manifest.json: invalid JSON" in capsys.readouterr().err
    rep = json.loads(report.read_text())
    assert rep["partial"] is True and "invalid JSON" in rep["partial_reason"]
    assert rep["ok"] is False and rep["exit_code"] == 2 and rep["results"] == []


def test_ctrl_c_writes_a_partial_report_with_what_was_judged(faulty, tmp_path):
    report = tmp_path / "r.json"
    # A background job (`tox -p &` in a script) runs with Ctrl-C ignored, and a child inherits SIG_IGN
    # across exec: then Python installs no KeyboardInterrupt and the run rightly goes on. Give the child
    # a terminal's Ctrl-C (a handler is reset to the default at exec).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mhaspec", "run", f"{faulty}:Slow", "--dtype", "float64", "--report", str(report)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    lines = []
    for line in proc.stdout:  # wait until most cases are judged: large_logits comes after them and hangs
        lines.append(line)
        if line.startswith("batch_one"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "mhaspec: interrupted" in err
    rep = json.loads(report.read_text())
    assert rep["partial"] is True and rep["partial_reason"].startswith("interrupted (Ctrl-C) after")
    assert rep["exit_code"] == 130 and rep["ok"] is False
    assert any(r["case"] == "batch_one" and r["verdict"] == PASS for r in rep["results"])


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_bad_timeouts_are_usage_errors(value, capsys):
    assert main(["run", "--timeout", value]) == 2
    assert "--timeout: " in capsys.readouterr().err
    with pytest.raises(MhaspecError, match="timeout"):
        Session("numpy", timeout=float(value) if value != "soon" else value)


def test_unwritable_reports_are_refused_before_the_run(tmp_path, capsys):
    assert main(["run", "--report", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["run", "--report", str(blocker / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_golden_pointing_to_a_file_is_named(tmp_path, capsys):
    path = tmp_path / "manifest.json"
    path.write_text("{}")
    assert main(["run", "--golden", str(path)]) == 2
    assert "is a file; a golden folder (holding manifest.json) is expected" in capsys.readouterr().err


def test_the_pytest_plugin_survives_a_crashing_adapter(faulty, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
         f"--mha-adapter={faulty}:Faulty", "--mha-dtype=float64", "--mha-timeout=2", "-q",
         "-k", "head_dim_1 or one_head or batch_one"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "worker killed by SIGSEGV" in proc.stdout and "worker killed by SIGABRT" in proc.stdout
    assert "8 passed" in proc.stdout  # batch_one's eight stages


def test_an_adapter_that_kills_its_worker_while_loading_is_one_line(tmp_path, capsys):
    path = tmp_path / "dies.py"
    path.write_text("import os\nos._exit(3)\n")
    assert main(["run", f"{path}:X", "--report", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "worker exited with status 3 without answering" in err and "while loading the adapter" in err
    assert err.count("mhaspec: error:") == 1 and "Traceback" not in err
    assert json.loads((tmp_path / "r.json").read_text())["partial"] is True


def test_named_adapters_are_forked_only_from_a_process_without_frameworks(monkeypatch):
    import types

    from mhaspec.protocol.transports import start_method

    monkeypatch.delenv("MHASPEC_WORKER_START", raising=False)
    assert start_method(by_name=False) == "fork"  # an object can only be inherited
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert start_method(by_name=True) == "spawn"
    monkeypatch.setenv("MHASPEC_WORKER_START", "fork")
    assert start_method(by_name=True) == "fork"


def test_the_default_timeout_is_minutes_for_the_whole_catalog():
    from mhaspec import cli

    assert (cli.DEFAULT_TIMEOUT, cli.MAX_TIMEOUTS) == (runner_module.DEFAULT_TIMEOUT, runner_module.MAX_TIMEOUTS)
    # a hung adapter costs MAX_TIMEOUTS timeouts, then the other cases are reported "not run"
    assert runner_module.DEFAULT_TIMEOUT * runner_module.MAX_TIMEOUTS <= 5 * 60


def _results(report) -> list[dict]:
    """Every case×dtype result as JSON, without the adapter's seconds (the one thing that differs)."""
    out = []
    for res in report.results:
        j = res.to_json()
        j.pop("adapter_seconds")
        out.append(j)
    return out


def test_variants_get_the_same_report_in_a_worker_and_in_this_process():
    """The two-sided proofs judge tests/variants.py in this process (tests/reports.py); a worker
    gives every kind of variant the same report, result for result, stage for stage: correct, native
    accumulation, a bug in every stage, one that computes in the wrong dtype, NaN rows, output only,
    and a backward bug."""
    from .backward_variants import BUGS as BACKWARD_BUGS
    from .variants import BUGS, CORRECT, NATIVE, OUTPUT_ONLY_BUGS

    forward = [CORRECT["tiled_online_softmax"], NATIVE["native_low_precision_accumulation"],
               BUGS["float16_when_float32_asked"][0], BUGS["nan_on_fully_masked_rows"][0],
               BUGS["causal_wrong_alignment"][0], OUTPUT_ONLY_BUGS["heads_merged_without_transpose+output_only"][0]]
    for adapter, backward in [*((v, False) for v in forward), (BACKWARD_BUGS["gqa_not_summed"][0], True)]:
        worker = mhaspec.check(adapter, timeout=None, backward=backward)
        here = mhaspec.check(adapter, timeout=None, backward=backward, isolate=False)
        assert _results(worker) == _results(here), adapter.name
        assert worker.exit_code == here.exit_code


def test_a_forked_worker_asks_no_object_but_the_goldens_anything(tmp_path):
    """Emptying the inherited goldens walks every object of the process: it must not touch what an
    object computes on access (``__class__`` here, as torch's deprecated-module proxies do, which
    printed a FutureWarning from mhaspec's own code whenever torch was imported)."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import warnings
        import mhaspec
        from mhaspec.adapters.numpy_mha import NumpyMHA

        class Proxy:
            @property
            def __class__(self):
                warnings.warn("asked for __class__", FutureWarning)
                return Proxy

        kept = [Proxy() for _ in range(3)]
        report = mhaspec.check(NumpyMHA(), dtypes=["float64"], cases=["self_basic"])
        print("ok" if report.ok else "not ok")
    """))
    done = subprocess.run([sys.executable, "-W", "default", str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert "asked for __class__" not in done.stderr, done.stderr[-2000:]
