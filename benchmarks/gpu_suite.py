"""One entry point for the GPU machine: the `-m gpu` tests, then the benchmarks, JSON to $OUT.

    PYTHONPATH=. python -m benchmarks.gpu_suite [--only tests,matmul,serve,tp,...] [--tar]

`--tar`: every file is written to a scratch folder and $OUT holds one gzipped tarball of it,
rewritten after each part (the device machine sends back at most 8 files, and a call cut short
keeps what its finished parts wrote).

Each benchmark module exposes `run(out_dir) -> dict` and measures its XLA baseline and the
hardware ceilings in the same run, so every figure is a ratio taken on one machine at one time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

PARTS = {
    "user": "benchmarks.user_bench",
    "matmul": "benchmarks.matmul_bench",
    "attention": "benchmarks.attention_bench",
    "serve": "benchmarks.serve_bench",
    "tp": "benchmarks.tp_bench",
    "tiles": "benchmarks.tile_probe",
    "decode": "benchmarks.decode_bench",
    "moe": "benchmarks.moe_bench",
}


def environment() -> dict:
    import jax

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "jax": jax.__version__,
        "devices": [d.device_kind for d in jax.devices()],
        "backend": jax.default_backend(),
        "commit": commit or "unknown",
    }


def run_tests(out: Path, extra: list[str]) -> dict:
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        # CPU-only test modules import packages the GPU machine may lack (nbformat, jsonschema):
        # their collection errors must not stop the GPU tests
        "--continue-on-collection-errors",
        f"--junitxml={out / 'gpu_tests.xml'}",
        *extra,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    tail = (r.stdout + r.stderr)[-6000:]
    (out / "gpu_tests.log").write_text(r.stdout + r.stderr)
    return {"returncode": r.returncode, "seconds": round(time.time() - t0, 1), "tail": tail}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="tests,matmul,attention,serve")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--pytest-args", default="")
    ap.add_argument(
        "--serve-args",
        default="--shape 0.6b --parts offline,decode --n-requests 1000",
        help="arguments for benchmarks.serve_bench (the full default run exceeds 10 minutes)",
    )
    ap.add_argument("--tar", action="store_true",
                    help="$OUT gets one tarball, gpu_suite.tgz, rewritten after each part")
    a = ap.parse_args(argv)
    dest = Path(a.out)
    dest.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="gpu-suite-")) if a.tar else dest
    results: dict = {"env": environment()}
    print(json.dumps(results["env"]), flush=True)
    for part in a.only.split(","):
        t0 = time.time()
        try:
            if part == "tests":
                results[part] = run_tests(out, a.pytest_args.split())
            elif part == "serve":
                results[part] = importlib.import_module(PARTS[part]).run(
                    out, argv=a.serve_args.split()
                )
            else:
                results[part] = importlib.import_module(PARTS[part]).run(out)
        except Exception:
            results[part] = {"error": traceback.format_exc()[-3000:]}
        results[part + "_seconds"] = round(time.time() - t0, 1)
        print(f"== {part} ({results[part + '_seconds']} s)", flush=True)
        print(json.dumps(results[part], default=str)[:4000], flush=True)
        (out / "gpu_suite.json").write_text(json.dumps(results, indent=1, default=str))
        if a.tar:
            _pack(out, dest / "gpu_suite.tgz")
    return 0


def _pack(folder: Path, tarball: Path) -> None:
    """`folder`'s files as one gzipped tarball, written whole or not at all."""
    tmp = tarball.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname="gpu_suite")
    os.replace(tmp, tarball)


if __name__ == "__main__":
    sys.exit(main())
