"""`make gpu-check` on a machine without CUDA: a clear message and exit status 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_gpu_check_skips_cleanly_without_cuda() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("gpu-check: skipped: "), r.stdout + r.stderr
    assert "nothing to check here" in r.stdout
