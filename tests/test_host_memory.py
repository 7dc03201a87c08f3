"""minihf.utils.host_memory: huge pages set on import, freed blocks reused after tune_malloc.

Both are process-wide, so each check runs in a fresh interpreter. The malloc check reads
glibc's own counters (``mallinfo2``), not time.
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


MMAPPED = """
import ctypes, torch
from minihf.utils.host_memory import tune_malloc
class Info(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t counters
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if {tune}:
    assert tune_malloc()
x = torch.ones(16 << 20)  # 64 MB: over glibc's largest mmap threshold (32 MB)
print(libc.mallinfo2().hblkhd)  # bytes in blocks malloc mapped on their own
"""

# a pool thread (where rank 0's worker runs its commands) allocates from the main arena:
# glibc's malloc_info lists every arena as a <heap nr=...>
IN_A_THREAD = """
import ctypes, re, tempfile, torch
from concurrent.futures import ThreadPoolExecutor
from minihf.utils.host_memory import tune_malloc
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
if {tune}:
    assert tune_malloc()
def step():
    x = torch.ones(3540096)  # a 14 MB block, as FSDP's per-block buffers for SmolLM2
    with tempfile.NamedTemporaryFile("r") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        return len(re.findall(r'<heap nr="\\d+">', f.read()))
with ThreadPoolExecutor(1) as ex:
    print(ex.submit(step).result())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_tune_malloc_serves_large_blocks_from_the_heap():
    # default glibc maps a 64 MB block on its own and unmaps it on free (its pages fault
    # again on the next step); tuned, it comes from the heap, which keeps it when freed
    assert int(run(MMAPPED.format(tune=False))) >= 64 << 20
    assert int(run(MMAPPED.format(tune=True))) < 64 << 20


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_tune_malloc_serves_other_threads_from_the_main_heap():
    # untuned glibc gives the thread an arena of its own (whose heaps, mmap being off once
    # tuned, were grown and shrunk every step); tuned, there is one arena
    assert int(run(IN_A_THREAD.format(tune=False))) >= 2
    assert int(run(IN_A_THREAD.format(tune=True))) == 1


def test_tune_malloc_opt_out():
    code = "from minihf.utils.host_memory import tune_malloc; print(tune_malloc())"
    assert run(code, MINIHF_MALLOC_TUNING="0") == "False"
    assert run(code) == str(GLIBC)
