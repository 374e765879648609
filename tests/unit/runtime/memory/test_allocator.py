"""CPU ranks give freed weight-sized blocks back to the system (glibc's mmap threshold fixed)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from pipecut.runtime.memory.allocator import return_large_frees

GLIBC = ctypes.util.find_library("c") is not None and sys.platform.startswith("linux")

# Free one 16 MiB block (glibc then raises its threshold past 16 MiB), make eight more, free all
# but the last (which pins the top of the heap), and report how much RSS the freed seven still hold.
_PROBE = """
import sys, torch
from pathlib import Path
from pipecut.runtime.memory.allocator import return_large_frees
def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024
if sys.argv[1] == "fixed":
    assert return_large_frees()
first = torch.ones(4 << 20)
del first
blocks = [torch.ones(4 << 20) for _ in range(8)]
before = rss()
del blocks[:7]
print((before - rss()) / (16 << 20))
"""


def _released(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         check=True, env={"PATH": "", "OMP_NUM_THREADS": "1"})
    return float(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_freed_blocks_go_back_to_the_system_once_the_threshold_is_fixed() -> None:
    assert _released("fixed") > 6.5  # the seven freed 16 MiB blocks are returned
    assert _released("dynamic") < 1.0  # glibc's default keeps them in its heap


def test_the_users_choice_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    assert return_large_frees() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("PIPECUT_KEEP_MALLOC", "1")
    assert return_large_frees() is False
