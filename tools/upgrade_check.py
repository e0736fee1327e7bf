"""The upgrade route: what changes when the frameworks move past the pinned versions.

The declared deviations and the tests' facts were measured on the versions in ``constraints.txt``.
For one or more framework groups (``jax``: jax, jaxlib, flax; ``tensorflow``: tensorflow-cpu,
keras; ``torch``: torch, onnx, onnxruntime, onnxscript — the tox envs' grouping) this script, in
the environment it runs in:

1. installs the pinned versions (``pip install -c constraints.txt …``; torch from the CPU index
   of ``--torch-index-url`` when given — on a machine without a CPU wheel of torch at hand, give it,
   or pip takes PyPI's CUDA build);
2. runs every built-in adapter of the group on the whole catalog as a user does,
   ``mhaspec run ADAPTER [--backward] --report DIR/pinned/ADAPTER.json`` (``--backward`` where the
   adapter has a backward);
3. installs the newest releases pip serves (``pip install --upgrade …``; torch only from the CPU
   wheel index given with ``--torch-index-url https://download.pytorch.org/whl/cpu``, else it stays
   at its pin: a plain upgrade of torch pulls a CUDA build of several GB);
4. runs the same reports again into ``DIR/newest/`` — unless no version changed, where the result
   would be the same runs again (``--rerun-unchanged`` runs them anyway);
5. prints what changed: the versions, declared deviations that no longer occur, new failures
   (case/dtype/stage), and every other verdict that changed; or ``no change``.

It changes the packages of the environment it runs in, so it refuses to run outside tox unless
``--this-env`` is given.  Use it through tox (``tox -e upgrade-jax``, ``upgrade-tensorflow``,
``upgrade-torch``: envs of their own, not in ``tox -p``).  ``compare PINNED_DIR NEWEST_DIR``
compares two folders of reports made before (e.g. ``.tox/reports`` of a ``tox -p``).

Exit codes: 0 no verdict changed (versions may have), 1 a verdict, failure, deviation or warning
changed, 2 something could not be run (a pip install, an adapter run without a report).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

#: group -> (the distributions constraints.txt pins for it, the mhaspec extras its adapters need)
GROUPS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "jax": (("jax", "jaxlib", "flax"), frozenset({"jax"})),
    "tensorflow": (("tensorflow-cpu", "keras"), frozenset({"tensorflow"})),
    "torch": (("torch", "onnx", "onnxruntime", "onnxscript"), frozenset({"torch", "onnx"})),
    "serving": (("keras-hub", "transformers"), frozenset({"serving"})),
}
#: dependencies of the frameworks that the pins leave to pip: shown when they move
ALSO_SHOWN = ("numpy", "ml_dtypes", "onnx-ir", "protobuf", "scipy")
#: lines shown per category and adapter (the rest is counted)
SHOWN = 12
FAILING = ("fail", "error")


# -- running -----------------------------------------------------------------------------------
def _sub(args: list[str], log: Path | None = None, timeout: float | None = None) -> int:
    """Run ``args``; its output goes to ``log`` (or is shown on failure)."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        if log is not None:
            log.write_text(f"timed out after {timeout:g} s\n{exc.stdout or ''}{exc.stderr or ''}")
        return 124
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    elif proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    return proc.returncode


def _pip(args: list[str]) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    print("  $ pip install " + " ".join(args), flush=True)
    if _sub(command):
        raise SystemExit(2)


def pins() -> dict[str, str]:
    """constraints.txt as {distribution: version}."""
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


VERSIONS = """
import importlib.metadata as m, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def installed(names: list[str]) -> dict[str, str | None]:
    """The installed versions, read in a fresh interpreter (pip has just changed them)."""
    proc = subprocess.run([sys.executable, "-c", VERSIONS, *names], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


BACKWARDS = """
import importlib, json, sys
from mhaspec.adapters import BUILTINS
out = {}
for name in sys.argv[1:]:
    module, attr = BUILTINS[name].target.split(":")
    out[name] = callable(getattr(getattr(importlib.import_module(module), attr), "backward", None))
print(json.dumps(out))
"""


def group_adapters(groups: list[str]) -> list[str]:
    """The built-in adapters whose extras the groups install (``mhaspec adapters`` lists them)."""
    from mhaspec.adapters import BUILTINS

    extras = frozenset().union(*(GROUPS[g][1] for g in groups))
    return [b.name for b in BUILTINS.values() if b.name != "numpy" and set(b.extra.split(",")) <= extras]


def run_reports(adapters: list[str], folder: Path, backward: dict[str, bool], timeout: float,
                dists: list[str]) -> dict[str, int]:
    """Each adapter's whole-catalog report into ``folder`` (its output into ``ADAPTER.log``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.json"):
        stale.unlink()
    (folder / "versions.json").write_text(json.dumps(installed(dists), indent=1) + "\n")
    codes = {}
    for name in adapters:
        start = time.perf_counter()
        args = [sys.executable, "-m", "mhaspec", "run", name, "--report", str(folder / f"{name}.json")]
        codes[name] = _sub(args + (["--backward"] if backward[name] else []), folder / f"{name}.log", timeout)
        report = _load(folder / f"{name}.json")
        counts = ", ".join(f"{v} {k}" for k, v in (report or {}).get("counts", {}).items() if v)
        print(f"  {name:<18} exit {codes[name]}  {counts or 'no report'}  ({time.perf_counter() - start:.0f} s)",
              flush=True)
    return codes


def check(args: argparse.Namespace) -> int:
    groups = list(dict.fromkeys(args.groups))
    if not os.environ.get("TOX_ENV_NAME") and not args.this_env:
        print("upgrade_check: this installs and upgrades packages in the environment it runs in "
              f"({sys.prefix}); run it through tox (tox -e upgrade-{groups[0]}) or pass --this-env",
              file=sys.stderr)
        return 2
    pinned_versions = pins()
    dists = [d for g in groups for d in GROUPS[g][0]]
    upgraded = [d for d in dists if d != "torch"]  # torch: only from a CPU index (below)
    adapters = [a for a in group_adapters(groups) if not args.adapter or a in args.adapter]
    shown = dists + [d for d in ALSO_SHOWN if d not in dists]
    out = Path(args.out) / "-".join(groups)
    print(f"upgrade check of {', '.join(groups)}: {', '.join(adapters)}; reports in {out}", flush=True)

    cpu_index = ["--index-url", args.torch_index_url] if args.torch_index_url else []
    print("pinned versions (constraints.txt):", flush=True)
    _pip(["-c", str(CONSTRAINTS), *upgraded])
    if "torch" in dists:  # from the CPU index when one is given (the pin's CPU build, 2.13.0+cpu)
        _pip(["-c", str(CONSTRAINTS), *cpu_index, "torch"])
    have = installed(dists)
    wrong = {d: have[d] for d in dists if _base(have[d]) != pinned_versions.get(_norm(d))}
    if wrong:
        print(f"upgrade_check: after installing the pins: {wrong} (pins: {pinned_versions})", file=sys.stderr)
        return 2
    proc = subprocess.run([sys.executable, "-c", BACKWARDS, *adapters], capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        return 2
    backward = json.loads(proc.stdout)
    before = run_reports(adapters, out / "pinned", backward, args.timeout, shown)

    print("newest releases:", flush=True)
    _pip(["--upgrade", *upgraded])
    if "torch" in dists and args.torch_index_url:
        _pip(["--upgrade", *cpu_index, "torch"])  # from that index only: never a CUDA build
    elif "torch" in dists:
        print(f"  torch stays {pinned_versions['torch']}: give --torch-index-url {CPU_INDEX} to try its newest "
              "CPU build", flush=True)
    newest = installed(shown)
    if newest == _load(out / "pinned" / "versions.json") and not args.rerun_unchanged:
        print("\nno version changed: the newest releases are the pinned ones (--rerun-unchanged runs the reports "
              "again anyway)\nno change")
        return 0
    after = run_reports(adapters, out / "newest", backward, args.timeout, shown)
    print()
    return compare_folders(out / "pinned", out / "newest", codes=(before, after))


# -- comparing ---------------------------------------------------------------------------------
def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _base(version: str | None) -> str | None:
    return version.split("+")[0] if version else version  # 2.13.0+cpu is the pin 2.13.0


def _ratio(stage: dict[str, Any]) -> str:
    ratios = [stage.get(k) for k in ("worst_ratio", "local_worst_ratio", "rms_ratio")]
    ratios = [r for r in ratios if isinstance(r, (int, float))]
    return f" (worst ratio {max(ratios):.3g})" if ratios else ""


def compare_reports(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[str]]:
    """What changed from report ``old`` to report ``new``, by category."""
    found: dict[str, list[str]] = {"new failures": [], "deviations that no longer occur": [],
                                   "verdicts that changed": [], "warnings": []}
    results = lambda r: {(x["case"], x["dtype"]): x for x in r.get("results", [])}  # noqa: E731
    before, after = results(old), results(new)
    for key in sorted(before.keys() | after.keys()):
        where = "/".join(key)
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            found["verdicts that changed"].append(f"{where}: {'only in the newest run' if a is None else 'not run'}")
            continue
        stages_a = {s["stage"]: s for s in a.get("stages", [])}
        stages_b = {s["stage"]: s for s in b.get("stages", [])}
        stage_changes = False
        for stage in list(stages_a) + [s for s in stages_b if s not in stages_a]:
            sa, sb = stages_a.get(stage, {}), stages_b.get(stage, {})
            va, vb = sa.get("verdict", "absent"), sb.get("verdict", "absent")
            if va == vb:
                continue
            stage_changes = True
            line = f"{where}/{stage}: {va} -> {vb}"
            if vb == "fail":
                found["new failures"].append(line + _ratio(sb) + (f": {sb['message']}" if sb.get("message") else ""))
            elif va == "known deviation" and vb == "pass":
                found["deviations that no longer occur"].append(f"{line} ({sa.get('reason') or 'declared'})")
            else:
                found["verdicts that changed"].append(line + (f" ({sb['reason']})" if sb.get("reason") else ""))
        if a["verdict"] != b["verdict"]:
            line = f"{where}: {a['verdict']} -> {b['verdict']}"
            if b["verdict"] == "error":
                found["new failures"].append(f"{line}: {b.get('message', '')}")
            elif not (b["verdict"] == "fail" and stage_changes):  # its failing stages are listed above
                found["verdicts that changed"].append(line + (f": {b['message']}" if b.get("message") else ""))
    old_w, new_w = set(old.get("warnings", [])), set(new.get("warnings", []))
    for w in sorted(new_w - old_w):
        (found["deviations that no longer occur"] if "did not occur" in w else found["warnings"]).append(f"new: {w}")
    found["warnings"] += [f"gone: {w}" for w in sorted(old_w - new_w)]
    for key in ("ok", "exit_code", "partial"):
        if old.get(key) != new.get(key):
            found["verdicts that changed"].insert(0, f"report {key}: {old.get(key)} -> {new.get(key)}")
    return {k: v for k, v in found.items() if v}


def compare_folders(pinned: Path, newest: Path, codes: tuple[dict[str, int], dict[str, int]] | None = None) -> int:
    """Print what changed between two folders of reports; 0 nothing, 1 something, 2 a report missing."""
    versions_a, versions_b = _load(pinned / "versions.json") or {}, _load(newest / "versions.json") or {}
    moved = [f"  {d}: {versions_a.get(d)} -> {versions_b.get(d)}" for d in versions_a
             if versions_a.get(d) != versions_b.get(d)]
    print("versions that changed:" if moved else "versions: none changed", *moved, sep="\n")
    names = {p.stem for folder in (pinned, newest) for p in folder.glob("*.json")} | set(codes[0] if codes else ())
    names = sorted(names - {"versions"})
    changed, missing = [], []
    for name in names:
        old, new = _load(pinned / f"{name}.json"), _load(newest / f"{name}.json")
        if old is None or new is None:
            folder, side = (pinned, 0) if old is None else (newest, 1)
            code = codes[side].get(name) if codes else None
            detail = f" (exit {code}; its output: {folder / name}.log)" if code is not None else ""
            print(f"\n{name}: no {folder.name} report{detail}")
            missing.append(name)
            continue
        found = compare_reports(old, new)
        if not found:
            continue
        changed.append(name)
        print(f"\n{name}:")
        for category, lines in found.items():
            print(f"  {category}:")
            for line in lines[:SHOWN]:
                print(f"    {line}")
            if len(lines) > SHOWN:
                print(f"    … and {len(lines) - SHOWN} more")
    unchanged = [n for n in names if n not in changed and n not in missing]
    if not changed and not missing:
        print(f"\nno change: the verdicts of {', '.join(names) or 'no adapter'} are the same")
        return 0
    if unchanged:
        print(f"\nunchanged: {', '.join(unchanged)}")
    print(f"changed: {', '.join(changed) or 'none'}" + (f"; no report: {', '.join(missing)}" if missing else ""))
    return 2 if missing else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/upgrade_check.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit codes: 0 no verdict changed, 1 something changed, 2 could not run")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("check", help="pinned vs newest releases of framework groups, in this environment")
    run.add_argument("groups", nargs="+", choices=sorted(GROUPS), metavar="GROUP",
                     help=f"framework groups: {', '.join(GROUPS)}")
    default_out = Path(os.environ["TOX_WORK_DIR"]) / "upgrade" if os.environ.get("TOX_WORK_DIR") else Path("upgrade-check")
    run.add_argument("--out", default=str(default_out), help=f"folder for the reports (default {default_out})")
    run.add_argument("--adapter", action="append", metavar="NAME", help="only these adapters of the groups (repeat)")
    run.add_argument("--timeout", type=float, default=1200.0, metavar="SECONDS",
                     help="limit of one adapter's whole-catalog run (default 1200)")
    run.add_argument("--torch-index-url", metavar="URL",
                     help=f"upgrade torch from this index only (a CPU one: {CPU_INDEX}); without it torch stays pinned")
    run.add_argument("--rerun-unchanged", action="store_true",
                     help="run the newest reports even when no version changed")
    run.add_argument("--this-env", action="store_true",
                     help="allow changing the packages of this (non-tox) environment")
    cmp = sub.add_parser("compare", help="compare two folders of reports (ADAPTER.json, optional versions.json)")
    cmp.add_argument("pinned", type=Path)
    cmp.add_argument("newest", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "compare":
        return compare_folders(args.pinned, args.newest)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
