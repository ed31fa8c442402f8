"""What every notebook's first output states: device, date, jdet version, git commit, scale.

    from notebooks.nbenv import header
    DEVICE = header(SCALE)   # prints the line, returns the device description for plot titles

The commit is `$JDET_NB_COMMIT` when set (notebooks/execute.py sets it for the notebooks it runs),
else `git rev-parse --short HEAD` with "+changes" when the working tree differs from it, else
"unknown" (a copy of the tree without .git). `devices=False` names the device without starting a
JAX backend in this process (nvidia-smi, else the CPU), for a notebook whose GPU work runs in
other processes (01's servers): JAX would preallocate most of the GPU here.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    if os.environ.get("JDET_NB_COMMIT"):
        return os.environ["JDET_NB_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device(devices: bool = True) -> str:
    """'NVIDIA H200 (gpu, 1 device(s))' or 'CPU (2-core), 8 JAX device(s)'."""
    if devices:
        import jax

        if jax.default_backend() == "cpu":
            return f"CPU ({os.cpu_count()}-core), {len(jax.devices())} JAX device(s)"
        kinds = [d.device_kind for d in jax.devices()]
        return f"{kinds[0]} ({jax.default_backend()}, {len(kinds)} device(s))"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        names = [n.strip() for n in smi.stdout.splitlines() if n.strip()]
        if smi.returncode == 0 and names:
            return f"{names[0]} (gpu, {len(names)} device(s))"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"CPU ({os.cpu_count()}-core)"


def header(scale: str, devices: bool = True) -> str:
    """Print the run's record line; return the device description."""
    import jax

    import jdet

    dev = device(devices)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"device: {dev}; date: {now:%Y-%m-%d %H:%M} UTC; jdet {jdet.__version__} "
          f"(commit {commit()}), jax {jax.__version__}; scale={scale}")  # fmt: skip
    return dev
