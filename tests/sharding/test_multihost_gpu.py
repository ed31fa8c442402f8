"""On a machine with 2 GPUs: two processes x 1 GPU as one JAX job, TP 2 across the processes,
bitwise equal to TP 1 and to TP 2 in one process (benchmarks/multihost_bench.py, which also times
its decode against single-process TP 2):

    python -m pytest tests/sharding/test_multihost_gpu.py -m gpu -q -p no:xdist

This pytest process has initialised JAX on the GPUs (tests/conftest.py asks for the backend),
which takes most of their memory; the jobs it starts therefore neither preallocate nor size
their KV pool from the free memory (a fixed --num-pages).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


@pytest.mark.gpu
def test_tp2_over_two_gpu_processes_is_bitwise_tp1_and_in_process_tp2(tmp_path):
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "multihost_bench.json"
    cmd = [sys.executable, "-m", "benchmarks.multihost_bench", "--decode-tokens", "64",
           "--repeats", "3", "--num-pages", "1024", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print(proc.stdout)
    assert report["bits_equal_to_tp1"] == {"tp2": True, "mp2": True}, proc.stdout
    assert proc.returncode == 0
