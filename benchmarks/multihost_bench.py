"""Tensor parallelism across processes (jax.distributed) against one process: bits and decode.

Runs three jobs on the same model and requests and compares them:
  tp1      one process, one device: the reference bits
  tp2      one process, two devices (TP 2 inside a process)
  mp2      two processes, one device each, TP 2 across them (127.0.0.1 coordinator), the layout of
           two hosts; on one host the cross-process all-reduce goes through NCCL like the
           in-process one, so the difference between tp2 and mp2 is the multi-controller
           runtime's own cost (per-step request stream, dispatch in two processes)
Each job: greedy and seeded generate, score() of the prompts plus completions (bits), then a
batch-1 greedy decode of --decode-tokens tokens, timed after a warm run (median of --repeats):
engine ms per token, the wall clock a user sees through jdet.LLM.

    python -m benchmarks.multihost_bench                      # 2 GPUs: CUDA_VISIBLE_DEVICES 0,1
    python -m benchmarks.multihost_bench --platform cpu       # the same on CPU devices

Writes JSON (--out, default multihost_bench.json) and exits 1 if mp2's or tp2's bits differ
from tp1's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ([3, 17, 42, 5, 99, 23, 7, 64, 12, 31, 8, 77, 4], [250, 1, 77, 9])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(a: argparse.Namespace) -> None:
    """One process of a job: run the requests, time decode; process 0 writes the results."""
    import jax
    import numpy as np

    import jdet

    # warmup=False: only the shapes these requests meet compile; every shape of the set (step and
    # score executables) kept a GPU job past its time limit (BENCHMARKS.md, "Open gaps")
    kw = dict(dtype=a.dtype, tp=a.tp, invariance="tp", num_pages=a.num_pages, warmup=False)
    if a.num_processes > 1:
        kw.update(num_processes=a.num_processes, process_id=a.process_id,
                  coordinator_address=a.coordinator)  # fmt: skip
    llm = jdet.LLM(a.model, **kw)
    V = llm.cfg.vocab_size
    prompts = [[t % V for t in p] for p in PROMPTS]
    sps = [jdet.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
           jdet.SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)]
    outs = llm.generate(prompts, sps)
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    decode = jdet.SamplingParams(temperature=0.0, max_tokens=a.decode_tokens, ignore_eos=True)
    llm.generate([prompts[0]], decode)  # warm: every shape of the timed run compiled
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        o = llm.generate([prompts[0]], decode)[0]
        times.append((time.perf_counter() - t0) / len(o.token_ids) * 1e3)
    if a.process_id == 0:
        res = {
            "tokens": [o.token_ids for o in outs],
            "logprobs": [np.asarray(o.logprobs).tobytes().hex() for o in outs],
            "scores": [np.asarray(s).tobytes().hex() for s in scores],
            "decode_ms_per_token": statistics.median(times),
            "decode_ms_all": times,
            "fingerprint": llm.fingerprint(),
            "devices": [str(d) for d in jax.devices()],
        }
        Path(a.result).write_text(json.dumps(res))


def _env(platform: str, devices: list[int], job_devices: int, multi: bool) -> dict[str, str]:
    """A process's environment: its devices. In a multi-process GPU job every process sees all
    the job's GPUs (NCCL's peer-to-peer paths need that) and JAX takes its own one
    (JAX_LOCAL_DEVICE_IDS, read by jax.distributed.initialize)."""
    env = dict(os.environ)
    # Indices count within the GPUs this process was given (CUDA_VISIBLE_DEVICES), so the
    # benchmark can run beside other jobs on a many-GPU host.
    given = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    phys = (lambda i: given[i]) if given else str
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={len(devices)}"
    elif multi:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(phys(i) for i in range(job_devices))
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(map(str, devices))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(phys(i) for i in devices)
    return env


def run_job(a: argparse.Namespace, name: str, tp: int, procs: int, tmp: Path) -> dict:
    result = tmp / f"{name}.json"
    coord = f"127.0.0.1:{_free_port()}"
    base = [sys.executable, "-m", "benchmarks.multihost_bench", "--worker", "--tp", str(tp),
            "--num-processes", str(procs), "--coordinator", coord, "--result", str(result),
            "--dtype", a.dtype, "--decode-tokens", str(a.decode_tokens),
            "--repeats", str(a.repeats)] + (["--model", a.model] if a.model else [])  # fmt: skip
    if a.num_pages is not None:
        base += ["--num-pages", str(a.num_pages)]
    per = tp // procs
    ps = [
        subprocess.Popen(base + ["--process-id", str(i)],
                         env=_env(a.platform, list(range(i * per, (i + 1) * per)), tp, procs > 1))
        for i in range(procs)
    ]
    rcs = [p.wait(timeout=a.timeout) for p in ps]
    if any(rcs):
        raise SystemExit(f"job {name} failed: exit statuses {rcs}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pool pages (default: sized from each device's memory)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default="multihost_bench.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        jobs = {name: run_job(a, name, tp, procs, Path(d))
                for name, tp, procs in (("tp1", 1, 1), ("tp2", 2, 1), ("mp2", 2, 2))}  # fmt: skip
    keys = ("tokens", "logprobs", "scores")
    same = {n: all(jobs[n][k] == jobs["tp1"][k] for k in keys) for n in ("tp2", "mp2")}
    report = {
        "platform": a.platform, "model": a.model or "embedded", "dtype": a.dtype,
        "bits_equal_to_tp1": same,
        "decode_ms_per_token": {n: j["decode_ms_per_token"] for n, j in jobs.items()},
        "mp2_over_tp2": jobs["mp2"]["decode_ms_per_token"] / jobs["tp2"]["decode_ms_per_token"],
        "fingerprints": {n: j["fingerprint"] for n, j in jobs.items()},
        "jobs": jobs,
    }  # fmt: skip
    Path(a.out).write_text(json.dumps(report, indent=1))
    for n, j in jobs.items():
        eq = "reference" if n == "tp1" else f"bits equal to tp1: {same[n]}"
        print(f"{n}: batch-1 greedy decode {j['decode_ms_per_token']:.3f} ms/token "
              f"({a.decode_tokens} tokens, median of {a.repeats}); {eq}")  # fmt: skip
    print(f"mp2 / tp2 decode time: {report['mp2_over_tp2']:.3f}  ->  {a.out}")
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
