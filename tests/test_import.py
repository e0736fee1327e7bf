"""`import mhaspec` imports no ML framework."""

from __future__ import annotations

import json
import subprocess
import sys

FRAMEWORKS = ["torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "ml_dtypes"]


def test_importing_mhaspec_imports_no_framework():
    code = (
        "import sys, json, mhaspec, mhaspec.spec, mhaspec.reference, mhaspec.adapters, "
        "mhaspec.conformance, mhaspec.cli, mhaspec.conformance.plugin\n"
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_adapters_list_imports_no_framework():
    code = (
        "import sys, json, io, contextlib\nfrom mhaspec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['adapters'])\n"
        f"print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
