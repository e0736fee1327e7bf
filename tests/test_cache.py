"""mhaspec.protocol.contract.cache_dir & co.: where rebuildable things are kept, and that the cache can never cost a run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mhaspec.protocol import contract as cache


def test_the_cache_folder_follows_the_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "mhaspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "mhaspec"
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    folder = cache.cache_dir("torch-onnx")
    assert folder == tmp_path / "mine" / "torch-onnx" and folder.is_dir()


@pytest.mark.parametrize("value", ["off", "OFF", "0", "none", "false", "no", ""])
def test_the_cache_can_be_switched_off(tmp_path, monkeypatch, value: str) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, value)
    monkeypatch.chdir(tmp_path)
    assert cache.cache_root() is None and cache.cache_dir("jax") is None
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_written_is_no_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    real = os.access
    monkeypatch.setattr(cache.os, "access", lambda p, mode: False if mode == os.W_OK else real(p, mode))
    assert cache.cache_dir("torch-onnx") is None


def test_a_folder_that_cannot_be_made_is_no_cache(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setenv(cache.CACHE_ENV, str(blocker))
    assert cache.cache_dir("torch-onnx") is None


def test_writes_are_whole_or_nothing(tmp_path) -> None:
    path = tmp_path / "entry.onnx"
    assert cache.cache_write(path, b"first") and cache.cache_read(path) == b"first"
    assert cache.cache_write(path, b"second") and cache.cache_read(path) == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["entry.onnx"], "no temporary file left behind"
    assert cache.cache_read(tmp_path / "missing") is None
    assert not cache.cache_write(tmp_path / "no-such-folder" / "x", b"data")
    assert [p.name for p in tmp_path.iterdir()] == ["entry.onnx"]


def test_keys_change_with_every_part_and_source_byte(tmp_path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    digest = cache.source_digest(a, b)
    assert digest == cache.source_digest(Path(a), Path(b))
    a.write_text("x = 2\n")
    assert cache.source_digest(a, b) != digest
    assert cache.key_digest("torch-onnx", (1, 2)) == cache.key_digest("torch-onnx", (1, 2))
    assert cache.key_digest("torch-onnx", (1, 2)) != cache.key_digest("torch-onnx", (2, 1))
    assert cache.key_digest("x").isalnum()
