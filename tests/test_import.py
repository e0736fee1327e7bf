"""`import mhaspec` imports no ML framework."""

from __future__ import annotations

import json
import subprocess
import sys

# and numba: the compiled tolerance loop (the fast extra) is imported only when a large case is judged
FRAMEWORKS = ["torch", "tensorflow", "keras", "jax", "jaxlib", "flax", "ml_dtypes", "onnx", "onnxruntime", "onnxscript",
              "numba"]


def _frameworks_loaded_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; which frameworks did it import?"""
    probe = f"{code}\nimport sys, json\nprint(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_mhaspec_imports_no_framework():
    code = ("import mhaspec, mhaspec.spec, mhaspec.reference, mhaspec.adapters, mhaspec.conformance, "
            "mhaspec.cli, mhaspec.conformance.plugin")
    assert _frameworks_loaded_after(code) == []


def test_listing_adapters_imports_no_framework():
    code = ("import io, contextlib\nfrom mhaspec.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['adapters'])")
    assert _frameworks_loaded_after(code) == []
