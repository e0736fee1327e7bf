"""Adapters that are programs (``exec:PROGRAM ARGS…``, docs/protocol.md): a program speaking mhaspec-wire/1
conforms through every entry point; every protocol fault costs one case with a clear message; bad names
and handshakes are usage errors (exit 2); stdout and stderr reach the user; no process is left behind.

The program is tests/exec_client.py, which frames its messages by hand as a program in another language
would (the C, Rust and JavaScript clients: tests/test_exec_clients.py, tox env ``exec``).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mhaspec
from mhaspec.cli import main
from mhaspec.conformance import ERROR, FAIL, PASS, UNSUPPORTED, Session
from mhaspec.errors import AdapterError, MhaspecError
from mhaspec.protocol.transports import Program

from .test_protocol import _check_all, captured  # noqa: F401 (a fixture)

CLIENT = Path(__file__).with_name("exec_client.py")
CASES = ["gqa", "mqa", "batch_one"]


def program(fault: str = "none", on: str = "gqa") -> str:
    return f"exec:{shlex.quote(sys.executable)} {shlex.quote(str(CLIENT))} --fault {fault} --on {on}"


def test_a_program_conforms_and_every_message_matches_the_schema(captured):  # noqa: F811
    report = mhaspec.check(program(), dtypes=["float64", "bfloat16"],
                           cases=["gqa", "self_basic", "cross_shared_kv", "key_padding", "no_bias"])
    assert report.ok and {r.verdict for r in report.results} == {PASS}
    assert report.adapter == "py-client[none]"
    seen = _check_all(captured)
    assert {("ready", "ready"), ("case_request", "run"), ("returned", "run"), ("close", "close")} <= seen
    assert not any(h.get("op") == "load" for d, h, _ in captured if d == "request")  # a program is sent no load
    assert report.environment["process"] == "exec"
    assert report.environment["program"] == {"process": "exec", "language": "Python"}
    assert report.environment["blas"] is None  # the runner's numpy says nothing of the program's kernels


@pytest.mark.parametrize("fault, where, said", [
    ("garbage", "gqa", "the worker sent a message of"),
    ("not-json", "gqa", "the worker sent a header that is not JSON"),
    ("wrong-kind", "gqa", "the worker sent a reply of kind 'backward' where 'run' was due"),
    ("bad-payload", "gqa", "the worker sent a malformed reply during run() (SafetensorsError"),
    ("die", "gqa", "worker exited with status 3 without answering"),
    ("partial", "gqa", "in the middle of its reply (a partial write)"),
    ("hang", "gqa", "did not return within 4 s (per-case timeout)"),
    ("fail", "gqa", "no kernel for gqa"),
    # answered twice: the second reply (it echoes its request's number) is read where the next request's
    # reply is due, which it costs
    ("twice", "mqa", "(did it answer a request twice?)"),
])
def test_each_protocol_fault_costs_one_case(fault, where, said):
    report = mhaspec.check(program(fault), dtypes=["float32"], cases=CASES, timeout=4)
    verdicts = {r.case: r for r in report.results}
    assert verdicts[where].verdict == ERROR and said in verdicts[where].message, verdicts[where].message
    assert [verdicts[c].verdict for c in CASES if c != where] == [PASS, PASS], report.results
    assert not report.ok


def test_a_second_reply_without_a_number_never_passes_a_case():
    """Without seq the runner finds a duplicate only if it is already waiting when the next request is due
    (docs/protocol.md §3); otherwise it is read as the next reply — never as a pass: its stages are another
    case's."""
    # every request gets a reply here (none is awaited in vain), so the timeout only has to outlast a loaded
    # machine: at 4 s the first reply (the client's start included) timed out under load
    report = mhaspec.check(program("unnumbered"), dtypes=["float32"], cases=CASES, timeout=60)
    verdicts = {r.case: r.verdict for r in report.results}
    assert verdicts["gqa"] == PASS and verdicts["mqa"] in (ERROR, FAIL) and not report.ok


def test_the_process_is_killed_after_a_hang_and_none_is_left_at_the_end():
    with Session(program("hang"), timeout=3) as session:
        first = session._worker._process.pid
        mhaspec.check(session, dtypes=["float32"], cases=["gqa", "mqa"])
        second = session._worker._process.pid
        assert second != first and not _alive(first)
    assert not _alive(second)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    waited, _ = os.waitpid(pid, os.WNOHANG) if _is_child(pid) else (0, 0)
    return waited == 0


def _is_child(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
        return True
    except ChildProcessError:
        return False


def test_what_the_program_prints_reaches_the_user_and_not_the_report(capfd):
    assert main(["run", program("stdout", "*"), "--dtype", "float32", "-k", "gqa"]) == 0
    out, err = capfd.readouterr()
    assert "hello from the program's stdout" in err and "hello" not in out
    assert main(["run", program("stderr", "*"), "--dtype", "float32", "-k", "gqa"]) == 0
    out, err = capfd.readouterr()
    assert "exec_client: computing gqa" in err and "CONFORMS" in out


def test_unsupported_rules_in_the_handshake_answer_without_a_round_trip(captured):  # noqa: F811
    report = mhaspec.check(program("unsupported"), dtypes=["float32", "float16"], cases=["gqa", "mqa"])
    verdicts = {(r.case, r.dtype): (r.verdict, r.message) for r in report.results}
    assert verdicts[("gqa", "float16")] == (UNSUPPORTED, "no 16-bit GQA kernel")
    assert ("ready", "ready") in _check_all(captured)  # the schema knows the rules
    assert {v for k, (v, _) in verdicts.items() if k != ("gqa", "float16")} == {PASS}
    ids = [h["case"]["scalars"]["id"] + "/" + h["case"]["scalars"]["dtype"]
           for d, h, _ in captured if d == "request" and "case" in h]
    assert "gqa/float16" not in ids and all(h.get("op") != "supports+run" for d, h, _ in captured if d == "request")


@pytest.mark.parametrize("fault, said", [
    ("version", "speaks 'mhaspec-wire/2'; this mhaspec speaks 'mhaspec-wire/1' (docs/protocol.md)"),
    ("bad-ready", "a 'ready' whose dtypes is not a non-empty list of dtype names"),
])
def test_a_bad_handshake_is_a_usage_error(fault, said, capfd):
    assert main(["run", program(fault), "--dtype", "float32"]) == 2
    err = capfd.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_program_that_never_says_ready_is_stopped():
    transport = Program(program("no-ready"), load_timeout=2)
    start = time.monotonic()
    with pytest.raises(AdapterError, match=r"loading it took more than 2 s"):
        transport.wait_loaded()
    assert time.monotonic() - start < 10
    assert transport._process is None


@pytest.mark.parametrize("name, said", [
    ("exec:", "no program after 'exec:'"),
    ("exec:   ", "no program after 'exec:'"),
    ("exec:no-such-program-anywhere --x", "no program 'no-such-program-anywhere' on PATH"),
    ("exec:./no/such/file", "no program './no/such/file'"),
    ("exec:prog 'unclosed", "cannot split the command line"),
])
def test_a_bad_program_name_is_a_usage_error(name, said, capfd):
    assert main(["run", name]) == 2
    err = capfd.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_a_file_that_is_not_executable_is_named(tmp_path, capfd):
    script = tmp_path / "mha.js"
    script.write_text("// not executable\n")
    assert main(["run", f"exec:{script}"]) == 2
    assert "is not executable (chmod +x, or name its interpreter: exec:node mha.js)" in capfd.readouterr().err


def test_a_program_that_exits_before_ready_is_a_usage_error(capfd):
    assert main(["run", f"exec:{shlex.quote(sys.executable)} -c 'import sys; sys.exit(7)'"]) == 2
    err = capfd.readouterr().err
    assert "worker exited with status 7" in err and "while loading the adapter" in err, err


def test_no_isolate_and_options_do_not_apply_to_a_program(capfd):
    assert main(["run", program(), "--no-isolate"]) == 2
    assert "always runs in its own process" in capfd.readouterr().err
    with pytest.raises(MhaspecError, match="always runs in its own process"):
        mhaspec.check(program(), isolate=False)
    with pytest.raises(MhaspecError, match=r"a program takes no adapter options \(device\)"):
        mhaspec.check(program(), device="cuda")


def test_a_program_runs_a_catalog_and_is_fuzzed(tmp_path, capfd):
    catalog = tmp_path / "mine.json"
    catalog.write_text(json.dumps([
        {"id": "wide", "config": {"d_model": 16, "num_heads": 2, "causal": True, "causal_alignment": "bottom_right"},
         "batch": 1, "tgt_len": 3, "src_len": 4, "seed": 1}]))
    assert main(["run", program(), "--catalog", str(catalog), "--dtype", "float32"]) == 0
    assert "wide" in capfd.readouterr().out
    assert main(["fuzz", program(), "--examples", "3", "--dtype", "float32"]) == 0
    assert "no non-conformance found" in capfd.readouterr().out
    assert main(["fuzz", program("fail", "*"), "--examples", "2", "--dtype", "float32"]) == 1


def test_the_pytest_plugin_runs_a_program(tmp_path):
    junit = tmp_path / "junit.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "mhaspec.conformance",
                           f"--mha-adapter={program()}", "--mha-dtype=float32", "-k", "gqa", f"--junitxml={junit}", "-q"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    suite = junit.read_text()
    assert 'tests="' in suite and "gqa-float32-output" in suite and "failures=\"0\"" in suite
