"""An adapter whose optional dependency is missing says which module is missing and which extra
installs it — when it is run (exit 2, one line) and in ``mhaspec adapters`` — with a pip command
that never pulls a CUDA build of torch.  A missing module is simulated: ``sys.modules[name] = None``
(``import name`` then raises ModuleNotFoundError and ``find_spec`` answers None), a stand-in
``find_spec``, or a module on ``PYTHONPATH`` that raises ModuleNotFoundError when imported.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import require

import mhaspec
from mhaspec.adapters import BUILTINS, BuiltinAdapter, builtin_status, load_adapter
from mhaspec.adapters.base import TORCH_CPU_INDEX, install_command, missing_hint
from mhaspec.cli import main
from mhaspec.errors import AdapterError

ROOT = Path(__file__).resolve().parents[1]


FRAMEWORK_MODULES = {m for b in BUILTINS.values() for m in b.modules}


def _only_missing(monkeypatch, *absent: str) -> None:
    """``find_spec`` finds every built-in adapter's module but ``absent``, also the frameworks this
    env lacks (the adapters are never imported: the tests stop before)."""
    real = importlib.util.find_spec

    def find_spec(name, package=None):
        if name in absent:
            return None
        if name in FRAMEWORK_MODULES:
            return real("json")
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_extras_commands_name_the_extra_and_never_a_cuda_torch():
    assert install_command(["onnx"]) == "pip install 'mhaspec[onnx]'"
    assert install_command(["serving"]) == f"pip install 'mhaspec[serving]' --extra-index-url {TORCH_CPU_INDEX}"
    assert install_command(["jax", "jax"]) == "pip install 'mhaspec[jax]'"
    # torch from PyTorch's CPU index: pip prefers 2.13.0+cpu there to PyPI's CUDA 2.13.0
    assert install_command(["torch", "onnx"]) == (
        f"pip install 'mhaspec[torch,onnx]' --extra-index-url {TORCH_CPU_INDEX}")
    assert TORCH_CPU_INDEX == "https://download.pytorch.org/whl/cpu"
    assert missing_hint(["onnxscript"]) == "missing onnxscript: pip install 'mhaspec[onnx]'"
    assert missing_hint(["keras", "jaxlib"]) == "missing keras, jaxlib: pip install 'mhaspec[tensorflow,jax]'"
    # a module no extra names (a dependency of a dependency): the adapter's own extras bring it back
    assert missing_hint(["sympy"], BUILTINS["torch"]) == (
        f"missing sympy: pip install 'mhaspec[torch]' --extra-index-url {TORCH_CPU_INDEX}")
    assert missing_hint(["sympy"]) == "missing sympy"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_adapters_modules_map_to_an_extra_that_exists(name):
    """Each module a built-in adapter declares is installed by the extra its hint names."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    builtin = BUILTINS[name]
    for module in builtin.modules:
        hint = missing_hint([module], builtin)
        extra = hint.split("mhaspec[")[1].split("]")[0]
        assert extra in extras, (module, hint)
        distribution = {"tensorflow": "tensorflow-cpu", "keras_hub": "keras-hub"}.get(module, module)
        if module != "numpy":  # numpy is a core dependency; bf16 is ml_dtypes for its bfloat16
            assert any(req.split("=")[0].split(">")[0].split("<")[0].split("[")[0] == distribution
                       for req in extras[extra]), (module, extra, extras[extra])


def test_adapters_lists_the_missing_module_and_its_extra(monkeypatch, capsys):
    _only_missing(monkeypatch, "onnxscript")
    status = {b.name: (usable, why) for b, usable, why in builtin_status()}
    assert status["torch-onnx"] == (False, "missing onnxscript: pip install 'mhaspec[onnx]'")
    assert status["torch-onnx-legacy"] == (True, "")  # it does not need onnxscript
    assert main(["adapters"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("torch-onnx "))
    assert "not usable" in lines[at]
    assert lines[at + 1].strip() == "missing onnxscript: pip install 'mhaspec[onnx]'"
    assert lines[at + 2].startswith("torch-onnx-legacy ") and " usable " in lines[at + 2]


def test_adapters_names_torchs_cpu_index_when_torch_is_missing(monkeypatch, capsys):
    _only_missing(monkeypatch, "torch", "onnxscript")
    status = {b.name: (usable, why) for b, usable, why in builtin_status()}
    cpu = f"--extra-index-url {TORCH_CPU_INDEX}"
    assert status["torch-sdpa"] == (False, f"missing torch: pip install 'mhaspec[torch]' {cpu}")
    assert status["torch-onnx"] == (False, f"missing torch, onnxscript: pip install 'mhaspec[torch,onnx]' {cpu}")
    assert status["jax"] == (True, "")


def test_run_refuses_a_builtin_whose_module_is_missing_before_importing_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    _only_missing(monkeypatch, "onnxscript")
    with pytest.raises(AdapterError) as err:
        load_adapter("torch-onnx")
    assert str(err.value) == ("built-in adapter 'torch-onnx' is not usable here: "
                              "missing onnxscript: pip install 'mhaspec[onnx]'")
    assert main(["run", "torch-onnx", "--no-isolate", "-k", "self_attention", "--dtype", "float32"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mhaspec: error: built-in adapter 'torch-onnx' is not usable here: "
        "missing onnxscript: pip install 'mhaspec[onnx]'")


def _fake_builtin(monkeypatch, tmp_path: Path, source: str, framework: str = "numpy",
                  module: str = "mhaspec_fake_adapter") -> str:
    """A built-in adapter ``fake`` whose module (in ``tmp_path``) is ``source``."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(BUILTINS, "fake", BuiltinAdapter("fake", f"{module}:Fake", framework, "a test's"))
    return "fake"


def test_a_module_missing_while_importing_a_builtin_names_its_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "jaxlib", None)
    name = _fake_builtin(monkeypatch, tmp_path, "import jaxlib\nclass Fake: ...\n")
    with pytest.raises(AdapterError) as err:
        load_adapter(name)
    message = str(err.value)
    assert message.startswith("built-in adapter 'fake' is not usable here: importing mhaspec_fake_adapter raised "
                              "ModuleNotFoundError: "), message
    assert message.endswith("; missing jaxlib: pip install 'mhaspec[jax]'"), message


def test_a_module_missing_while_constructing_a_builtin_names_its_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnx_ir", None)
    name = _fake_builtin(monkeypatch, tmp_path, """
        class Fake:
            name = "fake"
            def __init__(self):
                import onnx_ir  # what onnxscript needs: a dependency of a dependency
            def run(self, case): ...
        """, framework="torch")
    monkeypatch.setattr(BuiltinAdapter, "missing", lambda self: [])  # its framework "is installed"
    with pytest.raises(AdapterError) as err:
        load_adapter(name)
    assert str(err.value) == (
        "built-in adapter 'fake' is not usable here: constructing it raised ModuleNotFoundError: "
        "import of onnx_ir halted; None in sys.modules; missing onnx_ir: pip install 'mhaspec[onnx]'")
    # a module no extra names: the adapter's own extra, torch from the CPU index
    monkeypatch.setitem(sys.modules, "some_helper_lib", None)
    _fake_builtin(monkeypatch, tmp_path, """
        class Fake:
            name = "fake"
            def __init__(self):
                import some_helper_lib
            def run(self, case): ...
        """, framework="torch", module="mhaspec_fake_adapter_2")
    with pytest.raises(AdapterError, match=r"; missing some_helper_lib: pip install 'mhaspec\[torch\]' "
                       r"--extra-index-url https://download\.pytorch\.org/whl/cpu$"):
        load_adapter(name)


def test_a_user_adapter_names_the_missing_module_and_no_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "my_private_kernels", None)
    (tmp_path / "imports.py").write_text("import my_private_kernels\nclass A: ...\n")
    with pytest.raises(AdapterError) as err:
        load_adapter(f"{tmp_path / 'imports.py'}:A")
    assert "my_private_kernels" in str(err.value) and "mhaspec[" not in str(err.value)
    (tmp_path / "constructs.py").write_text(
        "class B:\n    name = 'b'\n    def __init__(self):\n        import my_private_kernels\n"
        "    def run(self, case): ...\n")
    with pytest.raises(AdapterError) as err:
        load_adapter(f"{tmp_path / 'constructs.py'}:B")
    assert "constructing it failed: missing module 'my_private_kernels'" in str(err.value)
    assert "mhaspec[" not in str(err.value)
    with pytest.raises(AdapterError, match="my_private_kernels"):
        mhaspec.check(f"{tmp_path / 'constructs.py'}:B", isolate=False)


BLOCK_AND_RUN = """
import sys
sys.modules["onnxscript"] = None  # as if it were not installed: the worker (forked) inherits it
from mhaspec.cli import main
sys.exit(main(["run", "torch-onnx", "-k", "self_attention", "--dtype", "float32"]))
"""


def test_cli_run_torch_onnx_without_onnxscript_exits_2_naming_the_extra():
    """The CLI as a user runs it (the adapter loaded in its worker process), in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_AND_RUN], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mhaspec: error: built-in adapter 'torch-onnx' is not usable here: missing "), last
    assert "onnxscript" in last and "pip install 'mhaspec[" in last and "onnx" in last.split("mhaspec[")[1]


@pytest.mark.onnx
def test_a_broken_onnxscript_found_but_failing_to_import_names_the_extra(tmp_path):
    """onnxscript is found (a module of that name is on the path) but importing it fails as an
    install missing a file would: the real torch-onnx adapter, constructed in its worker."""
    for module in ("torch", "onnx", "onnxruntime"):
        require(module)
    (tmp_path / "onnxscript.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'onnxscript'\", name='onnxscript')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "mhaspec", "run", "torch-onnx", "-k", "self_attention",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "mhaspec: error: built-in adapter 'torch-onnx' is not usable here: constructing it raised "
        "ModuleNotFoundError: No module named 'onnxscript'; missing onnxscript: pip install 'mhaspec[onnx]'")
