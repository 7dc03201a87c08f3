"""minihf.utils.host_memory: huge pages set on import, freed blocks reused after tune_malloc.

Both are process-wide, so each check runs in a fresh interpreter. The reuse check counts
minor page faults (``ru_minflt``), not time: a block served by a fresh mapping faults on
every page it touches, a reused one does not.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def run(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "MINIHF_MALLOC_TUNING")}
    out = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_import_sets_huge_pages_unless_set():
    code = "import os, minihf; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    assert run(code) == "1"
    assert run(code, THP_MEM_ALLOC_ENABLE="0") == "0"  # the user's opt-out stands


FAULTS = """
import resource, torch
from minihf.utils.host_memory import tune_malloc
applied = {tune}
if applied:
    assert tune_malloc()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 << 20)       # 64 MB: over glibc's largest mmap threshold (32 MB)
del x
before = faults()
for _ in range(10):
    x = torch.ones(16 << 20)   # touches every page
    del x
print((faults() - before) // 10)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_tune_malloc_reuses_freed_blocks():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")  # 16384 4 KB pages per 64 MB block
    # huge pages off in both, so each fresh 4 KB page is one fault
    fresh = int(run(FAULTS.format(tune=False), THP_MEM_ALLOC_ENABLE="0"))
    reused = int(run(FAULTS.format(tune=True), THP_MEM_ALLOC_ENABLE="0"))
    assert fresh > pages * 9 // 10, fresh   # default glibc: a new mapping per block
    # tuned: the heap keeps the freed block, so most allocations find their pages mapped
    # (glibc 2.36 here: one of the ten still grows the heap, as a page-aligned request
    # does not fit the freed block exactly)
    assert reused < pages // 4, reused


def test_tune_malloc_opt_out():
    code = "from minihf.utils.host_memory import tune_malloc; print(tune_malloc())"
    assert run(code, MINIHF_MALLOC_TUNING="0") == "False"
    assert run(code) == str(GLIBC)
