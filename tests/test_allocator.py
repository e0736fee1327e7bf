"""mhaspec.allocator: the CLI and the worker keep freed temporaries for reuse (glibc only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mhaspec import allocator


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_thresholds_take_effect_and_freed_pages_are_reused():
    """In a fresh process: after keep_freed_pages, allocating and freeing the same 48 MB array (above
    glibc's largest dynamic mmap threshold, 32 MiB) twenty times page-faults it in about once; by
    default glibc mmaps it and faults it in anew each time."""
    code = """
import resource, sys
import numpy as np
from mhaspec import allocator
if sys.argv[1] == "keep":
    assert allocator.keep_freed_pages()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(6 << 20)
before = faults()
for _ in range(20):
    a = np.ones(6 << 20)  # 48 MB
    del a
print(faults() - before)
"""
    counts = {how: int(subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                                      check=True).stdout) for how in ("default", "keep")}
    pages = (48 << 20) // 4096
    assert counts["keep"] < pages and 10 * counts["keep"] < counts["default"], counts  # (huge pages: fewer faults)
    allocator.release_freed_memory()  # gives the heap's free pages back; no error


def test_importing_mhaspec_changes_no_allocator_setting():
    out = subprocess.run([sys.executable, "-c", "import mhaspec, sys; print('mhaspec.allocator' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_no_huge_page_advice_turns_numpys_advice_off():
    """In a fresh process: numpy advises huge pages by default (Linux), and no longer once asked."""
    code = """
import numpy as np
from mhaspec import allocator
get = np._core.multiarray._get_madvise_hugepage
before = get()
print(before, allocator.no_huge_page_advice(), get())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "NUMPY_MADVISE_HUGEPAGE": "1"}).stdout.split()
    assert out == ["True", "True", "False"], out
