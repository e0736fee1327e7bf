"""toxfile.py, tox's inline plugin: a bare `tox -p` runs as many envs at once as there are CPUs.

tox is not installed in the test envs, so the plugin is loaded here with stand-ins for the two tox
modules it imports (its hook marker and tox's own CPU count); what it reads and writes of tox's
state (``state.args``, ``state.conf.options.parallel``) is the real tox 4 state's.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

CPUS = 7  # what the stand-in for tox's CPU count answers


@pytest.fixture
def toxfile(monkeypatch):
    plugin = types.ModuleType("tox.plugin")
    plugin.impl = lambda f: f
    cpu = types.ModuleType("tox.util.cpu")
    cpu.auto_detect_cpus = lambda: CPUS
    for name, module in {"tox": types.ModuleType("tox"), "tox.plugin": plugin,
                         "tox.util": types.ModuleType("tox.util"), "tox.util.cpu": cpu}.items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location("toxfile", Path(__file__).resolve().parents[1] / "toxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def state(args: list[str], parallel):
    """tox's state after parsing ``args``: ``parallel`` None for a bare -p (and for -p all), 0 without -p."""
    return types.SimpleNamespace(args=args, conf=types.SimpleNamespace(options=types.SimpleNamespace(parallel=parallel)))


@pytest.mark.parametrize("args", [["-p"], ["-p", "-e", "core,jax"], ["--parallel"], ["-p", "-o"]])
def test_a_bare_p_runs_as_many_envs_as_cpus(toxfile, args):
    s = state(args, None)
    toxfile.tox_add_core_config(None, s)
    assert s.conf.options.parallel == CPUS


@pytest.mark.parametrize("args, parallel", [
    (["-p", "all"], None), (["--parallel", "all"], None), (["--parallel=all"], None), (["-pall"], None),
    (["-p", "3"], 3), (["-p", "auto"], 2), ([], 0), (["-e", "core"], 0),
])
def test_anything_else_is_left_as_given(toxfile, args, parallel):
    s = state(args, parallel)
    toxfile.tox_add_core_config(None, s)
    assert s.conf.options.parallel == parallel
