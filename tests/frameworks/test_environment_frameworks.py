"""The environment of a framework adapter's report is its worker's: the framework's oneDNN state,
kernel dispatch, threads and version as the process that computed saw them (tests/test_environment.py
has the rest)."""

from __future__ import annotations

import pytest

import mhaspec
from tests.conftest import require


@pytest.mark.torch
def test_torch_reports_its_workers_dispatch_and_onednn(monkeypatch):
    torch = require("torch")
    # only the worker starts with this (this process's torch, if any, has long chosen its kernels)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("MHASPEC_WORKER_START", "spawn")
    report = mhaspec.check("torch", dtypes=["float32"], cases=["self_basic"])
    env = report.to_json()["environment"]
    assert env["process"] == "worker" and env["frameworks"]["torch"] == torch.__version__
    assert env["cpu_dispatch"]["torch"] == "DEFAULT" and env["variables"]["ATEN_CPU_CAPABILITY"] == "default"
    assert env["onednn"]["torch"] is bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    assert isinstance(env["threads"]["torch"], int) and env["threads"]["torch"] >= 1
    assert env["onednn"]["tensorflow"] is None  # not imported there
    assert "torch oneDNN" in report.header() and f"torch {torch.__version__}" in report.header()


@pytest.mark.tensorflow
def test_tensorflow_reports_its_workers_onednn_state(monkeypatch):
    require("tensorflow")
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")  # read by TensorFlow in the worker when it starts
    report = mhaspec.check("tensorflow", dtypes=["float32"], cases=["self_basic"])
    env = report.to_json()["environment"]
    assert env["process"] == "worker" and env["onednn"] == {"TF_ENABLE_ONEDNN_OPTS": "1", "tensorflow": True,
                                                            "torch": None}
    assert any(name.startswith("tensorflow") for name in env["frameworks"])
    assert isinstance(env["threads"]["tensorflow_intra_op"], int)
    assert "oneDNN on" in report.header()
