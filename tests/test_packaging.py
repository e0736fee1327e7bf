"""Packaging for an index (issue: a package ready for an index): the README's links work where the README is
shown on a package index (absolute, into the project's Source URL, each naming a file or heading that
exists); the sdist carries the licence, the docs, the examples and a test suite that collects from it.

The wheel route — build the wheel and the sdist, install the wheel in a fresh venv, run the quick start
outside the checkout, run tests from the unpacked sdist — is .ci/run's (a venv per run is too slow here).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SOURCE = PYPROJECT["project"]["urls"]["Source"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in markdown.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")}


def test_every_readme_link_is_absolute_or_in_page_and_names_what_exists():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = LINK.findall(readme)
    assert len(links) > 20
    own = _anchors(ROOT / "README.md")
    for link in links:
        if link.startswith("#"):
            assert link[1:] in own, f"README: no heading for {link}"
            continue
        assert link.startswith(("https://", "http://")), f"README: relative link {link!r} (dead on an index)"
        if not link.startswith(SOURCE + "/"):
            continue
        kind, branch, path = link[len(SOURCE) + 1:].split("/", 2)
        assert (kind, branch) in {("blob", "main"), ("tree", "main")}, link
        path, _, anchor = path.partition("#")
        target = ROOT / path
        assert target.exists(), f"README: {link} names {path}, which the checkout does not have"
        assert (kind == "tree") == target.is_dir(), f"README: {link}: use /tree/ for a folder, /blob/ for a file"
        if anchor:
            assert anchor in _anchors(target), f"README: {link}: {path} has no heading #{anchor}"


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    done = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"building the sdist failed:\n{done.stderr[-3000:]}")
    name = done.stdout.strip().splitlines()[-1]
    return out / name


def test_the_sdist_carries_the_licence_docs_examples_and_the_tests(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {"LICENSE", "README.md", "pyproject.toml", "tox.ini", "toxfile.py", "constraints.txt", "MANIFEST.in",
              "docs/spec.md", "docs/protocol.md", "docs/usage.md", "examples/numpy_adapter.py",
              "examples/exec/README.md", "examples/exec/c/mha.c", "examples/exec/rust/Cargo.toml",
              "examples/exec/js/mha.js", "tests/__init__.py", "tests/conftest.py", "tests/zoo.py", "tests/variants.py",
              "tests/exec_client.py", "tests/frameworks/helpers.py", "src/mhaspec/golden/manifest.json"}
    assert wanted <= names, sorted(wanted - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc") or "/target/" in n]
    # every example and doc the README and the docs name is in it
    named = set()
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= set(re.findall(r"\b((?:examples|docs)/[\w./-]+\.(?:py|md|json|c|js|rs|toml))\b", md.read_text(encoding="utf-8")))
    named = {n for n in named if (ROOT / n).is_file()}
    assert named and named <= names, sorted(named - names)


def test_the_test_suite_collects_from_the_unpacked_sdist(sdist, tmp_path):
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    top = next(tmp_path.iterdir())
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=top, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\d{3,} tests? collected", done.stdout), done.stdout[-500:]
