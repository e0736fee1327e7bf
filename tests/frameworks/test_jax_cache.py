"""JAX's persistent compilation cache, switched on by the JAX/Flax adapters (``backends.jax.use_compilation_cache``):
bit-identical stages with the cache off, cold and warm; entries in ``MHASPEC_CACHE_DIR/jax``; nothing written
with ``MHASPEC_CACHE_DIR=off``; a user's own cache left alone.

The cache is process-wide and set up once per process, so every run here is a fresh Python process
(:data:`SCRIPT`) with its own environment; cache folders, HOME and XDG_CACHE_HOME all lie in tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

pytestmark = pytest.mark.jax

require("jax")
require("flax")

#: Runs a plan of (adapter, case, dtype, "forward"|"backward"[, adapter options]) and prints, as JSON, a digest of every stage
#: (dtype, shape, sha256 of the bytes), how many XLA programs were obtained (compiled or loaded), how many
#: came from the persistent cache and how many were written to it, and JAX's cache settings at the end.
SCRIPT = r"""
import hashlib, json, os, sys
import numpy as np
import jax
if os.environ.get("TEST_USER_CACHE"):  # a user who set up JAX's cache before using mhaspec
    jax.config.update("jax_compilation_cache_dir", os.environ["TEST_USER_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from mhaspec.adapters import load_adapter
from mhaspec.fixtures import GoldenSet

count = {"programs": 0, "hits": 0, "writes": 0}
def event(name, **kwargs):
    if name == "/jax/compilation_cache/cache_hits":
        count["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":  # recorded as an entry is written
        count["writes"] += 1
def duration(name, secs, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":  # XLA compilation or persistent-cache load
        count["programs"] += 1
jax.monitoring.register_event_listener(event)
jax.monitoring.register_event_duration_secs_listener(duration)

golden, adapters, digests = GoldenSet(), {}, {}
for name, case_id, dtype, direction, *options in json.loads(sys.argv[1]):
    options = options[0] if options else {}
    key = (name, json.dumps(options, sort_keys=True))
    adapter = adapters.get(key) or adapters.setdefault(key, load_adapter(name, **options))
    case = golden.load(case_id).case(dtype)
    if getattr(adapter, "supports", lambda case: True)(case) is not True:
        continue
    stages = adapter.backward(case) if direction == "backward" else adapter.run(case)
    for stage, a in stages.items():
        a = np.ascontiguousarray(a)
        digests["/".join((*key, case_id, dtype, direction, stage))] = [str(a.dtype), list(a.shape),
                                                                       hashlib.sha256(a.tobytes()).hexdigest()]
print(json.dumps({**count, "digests": digests, "cache_dir": jax.config.jax_compilation_cache_dir,
                  "min_compile_time": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "min_entry_size": jax.config.jax_persistent_cache_min_entry_size_bytes}))
"""

DTYPES = ["float64", "float32", "float16", "bfloat16"]
ADAPTERS = ["jax", "jax-dpa", "flax-linen", "flax-nnx", "flax-nnx-fast"]
#: Every adapter's forward on a masked causal case, the ``jax`` adapter also on cross-attention with one memory
#: tensor; backward through jax-dpa (float16 through the precision fallback) and flax-linen; all four dtypes.
PLAN = [
    *[(name, "causal_and_mask", dtype, "forward") for name in ADAPTERS for dtype in DTYPES],
    *[("jax", "cross_shared_kv", dtype, "forward") for dtype in DTYPES],
    *[(name, "causal_and_mask", dtype, "backward") for name in ("jax-dpa", "flax-linen") for dtype in DTYPES],
]


def run(plan: list, tmp_path: Path, cache: str, **extra: str) -> dict:
    """:data:`SCRIPT` in a fresh process with ``MHASPEC_CACHE_DIR=cache``, HOME and XDG_CACHE_HOME in tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update({"MHASPEC_CACHE_DIR": cache, "HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
                **extra})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(plan)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-cache")) if folder.is_dir() else []


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_stages_are_bit_identical_with_the_cache_off_cold_and_warm(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    off = run(PLAN, tmp_path, "off")
    # off: JAX's cache is not switched on, and nothing is written anywhere (HOME, XDG_CACHE_HOME: tmp_path)
    assert off["cache_dir"] is None and off["hits"] == off["writes"] == 0
    assert files_under(tmp_path) == []
    assert len(off["digests"]) >= 150  # every adapter's stages, forward and backward, four dtypes

    cold = run(PLAN, tmp_path, str(folder))
    assert cold["cache_dir"] == str(folder / "jax")
    # every program compiled and written, but for the few a process makes twice (eager ops outside the layer's
    # program, the same in every dtype), which the second time come from the cache
    assert cold["writes"] > 0 and cold["hits"] + cold["writes"] == cold["programs"]
    assert len(entries(folder / "jax")) == cold["writes"]
    assert files_under(tmp_path / "home") == files_under(tmp_path / "xdg") == []

    warm = run(PLAN, tmp_path, str(folder))
    assert warm["programs"] == cold["programs"]
    assert warm["hits"] == warm["programs"] and warm["writes"] == 0  # every program loaded, none compiled
    assert len(entries(folder / "jax")) == cold["writes"]

    assert cold["digests"] == off["digests"]
    assert warm["digests"] == off["digests"]


def test_a_precision_is_never_served_another_precisions_program(tmp_path: Path) -> None:
    """The key is JAX's (the lowered program, compile options, versions): float32 after float64 of the same
    case, or the default XLA pipeline after the fast-compile one, compiles anew."""
    folder = str(tmp_path / "cache")
    first = run([("jax", "self_basic", "float64", "forward")], tmp_path, folder)
    assert first["programs"] == first["writes"] >= 1
    then = run([("jax", "self_basic", "float64", "forward"), ("jax", "self_basic", "float32", "forward"),
                ("jax", "self_basic", "float64", "forward", {"fast_compile": False})], tmp_path, folder)
    assert then["hits"] == first["programs"]  # the same float64 program(s): loaded
    assert then["writes"] == then["programs"] - then["hits"] == 2  # float32, and float64 with XLA's default options
    assert len(entries(tmp_path / "cache" / "jax")) == first["programs"] + 2


def test_a_damaged_entry_is_compiled_anew_never_loaded(tmp_path: Path) -> None:
    """An entry cut short (a process interrupted while JAX wrote it) fails to decompress: JAX warns and compiles."""
    folder = tmp_path / "cache"
    plan = [("jax", "self_basic", "float32", "forward")]
    first = run(plan, tmp_path, str(folder))
    assert entries(folder / "jax")
    for entry in entries(folder / "jax"):
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2])
    again = run(plan, tmp_path, str(folder))
    assert again["hits"] == 0 and again["programs"] == first["programs"]
    assert again["digests"] == first["digests"]


def test_a_users_own_jax_cache_is_left_alone(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    plan = [("jax", "self_basic", "float32", "forward")]
    # set in the config before the adapter is made: used as the user set it, thresholds untouched
    got = run(plan, tmp_path, str(ours), TEST_USER_CACHE=str(theirs))
    assert got["cache_dir"] == str(theirs)
    assert got["min_compile_time"] == 0 and got["min_entry_size"] == 0  # the user's and JAX's default, not ours (-1)
    assert got["writes"] == 1 and len(entries(theirs)) == 1
    assert not ours.exists()
    # JAX_COMPILATION_CACHE_DIR: JAX's default thresholds stay (1 s: nothing this small is written)
    env_dir = tmp_path / "from-env"
    got = run(plan, tmp_path, str(ours), JAX_COMPILATION_CACHE_DIR=str(env_dir))
    assert got["cache_dir"] == str(env_dir)
    assert got["min_compile_time"] == 1.0 and got["min_entry_size"] == 0
    assert not ours.exists()


def test_a_cache_folder_that_cannot_be_made_costs_the_cache_not_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    got = run([("jax", "self_basic", "float32", "forward")], tmp_path, str(blocker / "cache"))
    assert got["cache_dir"] is None and got["programs"] == 1 and got["hits"] == got["writes"] == 0
    assert got["digests"]
