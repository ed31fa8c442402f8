"""Where a decode step's time goes, from a device trace: kernels by name, device idle gaps, and the
host thread's waits, for the device step and the whole `Engine.step` (sync and async).

Why: the decode benchmark reports one number per row; to decide what to fix we need the
timeline. `jax.profiler.trace` records an XSpace (CUPTI kernels per stream + host threads);
`jax.profiler.ProfileData` (in jaxlib, no TensorBoard needed) reads it back, and this module
reduces it to a few tables:
- per trace: device busy time per step, the idle gaps between kernels (count, total, largest),
  the top kernels by total time;
- host events whose names say the host waited on the device (memcpy D2H, synchronize,
  conditional/while predicate copies), by name;
- the compiled step's HLO: counts of `conditional`, `while`, and copies of buffers > 64 MB (a
  copy of the stacked KV cache would be one).

    PYTHONPATH=. python -m benchmarks.profile_step --out OUT [--shape llama3-8b] [--modes tp,none]
Writes `profile_step.json` and the compiled HLO text per mode (gzip).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

WAIT_WORDS = ("memcpy", "synchron", "d2h", "devicetohost", "transferfrom", "conditional",
              "while", "block_until", "await", "wait")  # fmt: skip


def _events(trace_dir: str) -> tuple[list, list]:
    """(device events, host events) as (line name, event name, start_ns, dur_ns)."""
    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    dev, host = [], []
    for p in paths:
        pd = jax.profiler.ProfileData.from_file(p)
        for plane in pd.planes:
            is_dev = plane.name.startswith("/device:GPU")
            is_host = plane.name.startswith("/host:CPU")
            if not (is_dev or is_host):
                continue
            for line in plane.lines:
                for e in line.events:
                    row = (line.name, e.name, float(e.start_ns), float(e.duration_ns))
                    (dev if is_dev else host).append(row)
    return dev, host


def summarize(trace_dir: str, steps: int) -> dict:
    dev, host = _events(trace_dir)
    out: dict[str, Any] = {"n_device_events": len(dev), "n_host_events": len(host)}
    # kernels live on "Stream" lines; other device lines are summaries (XLA Ops/Modules)
    lines = defaultdict(list)
    for ln, name, s, d in dev:
        lines[ln].append((s, d, name))
    out["device_lines"] = {ln: len(v) for ln, v in lines.items()}
    streams = {ln: v for ln, v in lines.items() if "stream" in ln.lower()}
    kern = sorted((s, d, n) for v in streams.values() for s, d, n in v)
    if kern:
        t0, t1 = kern[0][0], max(s + d for s, d, _ in kern)
        busy, end, gaps = 0.0, t0, []
        for s, d, _ in kern:
            if s > end:
                gaps.append(s - end)
            busy += max(0.0, s + d - max(s, end))
            end = max(end, s + d)
        gaps = np.array(gaps or [0.0])
        out["device"] = {
            "span_ms": (t1 - t0) / 1e6, "busy_ms": busy / 1e6,
            "busy_ms_per_step": busy / 1e6 / steps, "span_ms_per_step": (t1 - t0) / 1e6 / steps,
            "kernels_per_step": len(kern) / steps, "gaps": int((gaps > 0).sum()),
            "gap_total_ms_per_step": float(gaps.sum()) / 1e6 / steps,
            "gaps_over_100us": int((gaps > 1e5).sum()), "largest_gaps_us":
            sorted((gaps / 1e3).round(1).tolist())[-8:],
        }  # fmt: skip
        by = defaultdict(lambda: [0, 0.0])
        for _, d, n in kern:
            short = re.sub(r"\d+", "#", n)[:90]
            by[short][0] += 1
            by[short][1] += d
        top = sorted(by.items(), key=lambda kv: -kv[1][1])[:30]
        # One step's kernels in launch order (from the middle of the trace), to read the per-layer
        # pattern: which launches a fusion would remove.
        per = len(kern) // steps
        mid = kern[per * (steps // 2) : per * (steps // 2) + per]
        out["sequence"] = [(round((s - mid[0][0]) / 1e3, 1), round(d / 1e3, 2), n[:80])
                           for s, d, n in mid]  # fmt: skip
        out["top_kernels"] = [{"name": n, "per_step": c / steps, "us_per_step": t / 1e3 / steps}
                              for n, (c, t) in top]  # fmt: skip
    hb = defaultdict(lambda: [0, 0.0])
    for ln, name, _, d in host:
        low = name.lower()
        if any(w in low for w in WAIT_WORDS):
            key = (ln[:40] + " | " + re.sub(r"\d+", "#", name))[:140]
            hb[key][0] += 1
            hb[key][1] += d
    out["host_waits"] = [{"name": n, "per_step": c / steps, "us_per_step": t / 1e3 / steps}
                         for n, (c, t) in sorted(hb.items(), key=lambda kv: -kv[1][1])[:25]]
    hp = defaultdict(lambda: [0, 0.0])
    for ln, name, _, d in host:
        if ln == "python" or "python" in ln.lower():
            hp[re.sub(r"\d+", "#", name)[:120]][0] += 1
            hp[re.sub(r"\d+", "#", name)[:120]][1] += d
    out["host_python_top"] = [{"name": n, "per_step": c / steps, "us_per_step": t / 1e3 / steps}
                              for n, (c, t) in sorted(hp.items(), key=lambda kv: -kv[1][1])[:25]]
    return out


def hlo_facts(compiled_text: str) -> dict:
    big = []
    for m in re.finditer(r"(\S+) = (\w+)\[([\d,]*)\][^\n]*? copy\(", compiled_text):
        dims = [int(x) for x in m.group(3).split(",") if x]
        n = int(np.prod(dims)) if dims else 1
        if n * 2 > 64 << 20:
            big.append(f"{m.group(2)}[{m.group(3)}]")
    return {
        "conditionals": len(re.findall(r" conditional\(", compiled_text)),
        "whiles": len(re.findall(r" while\(", compiled_text)),
        "copies": len(re.findall(r" copy\(", compiled_text)),
        "big_copies": big[:20],
        "custom_calls": len(re.findall(r" custom-call\(", compiled_text)),
        "fusions": len(re.findall(r" fusion\(", compiled_text)),
    }


def trace_loop(fn: Any, steps: int) -> dict:
    d = tempfile.mkdtemp(prefix="jdet_prof_")
    import jax

    fn()
    fn()
    jax.effects_barrier()
    t0 = time.perf_counter()
    with jax.profiler.trace(d):
        for _ in range(steps):
            fn()
        jax.effects_barrier()
    wall = time.perf_counter() - t0
    s = summarize(d, steps)
    s["wall_ms_per_step_traced"] = wall * 1e3 / steps
    return s


def profile_mode(model: Any, mode: str, a: argparse.Namespace, out: Path) -> dict:
    import jax

    from benchmarks.decode_bench import decode_inputs, make_engine, pages_for

    ctx, steps = a.ctx, a.steps
    num_pages = pages_for(ctx, 4 * steps + 64) + 4 * steps // 16 + 16
    eng = make_engine(model, mode, ctx + 8 * steps + 64, num_pages)
    runner = eng.runner
    res: dict[str, Any] = {"mode": mode}
    sb, si = decode_inputs(runner.cfg, 1, ctx, pages_for(ctx, steps))
    sb, si = jax.device_put(sb), jax.device_put(si)
    try:
        comp = runner.step_fn.lower(runner.params, runner.kv, sb, si).compile()
        txt = comp.as_text()
        res["hlo"] = hlo_facts(txt)
        with gzip.open(out / f"step_hlo_{mode}.txt.gz", "wt") as f:
            f.write(txt)
    except Exception:  # noqa: BLE001
        res["hlo_error"] = traceback.format_exc()[-1500:]

    def dev_once() -> None:
        runner.kv, o = runner.step_fn(runner.params, runner.kv, sb, si)
        o.tokens.block_until_ready()

    res["device_step"] = trace_loop(dev_once, steps)
    print(mode, "device", json.dumps(res["device_step"].get("device")), flush=True)
    if mode in a.engine_modes:
        for asyn in (False, True):
            eng.async_scheduling = asyn
            ids = np.random.default_rng(1).integers(1, model.cfg.vocab_size, ctx - 1).tolist()
            eng.add_request(f"p{asyn}", ids, dict(temperature=0.0, max_tokens=4 * steps,
                                                 ignore_eos=True))  # fmt: skip
            for _ in range(6):  # prefill chunk(s) + first decode steps outside the trace
                eng.step()
            key = "engine_async" if asyn else "engine_sync"
            res[key] = trace_loop(eng.step, steps)
            print(mode, key, json.dumps(res[key].get("device")),
                  res[key]["wall_ms_per_step_traced"], flush=True)  # fmt: skip
            while eng.has_unfinished():
                eng.step()
        eng.async_scheduling = False
    eng.runner = None
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--modes", default="tp,none")
    p.add_argument("--engine-modes", default="tp")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args(argv)
    a.engine_modes = a.engine_modes.split(",")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    from benchmarks.decode_bench import random_model

    res: dict[str, Any] = {"args": vars(a), "jax": jax.__version__,
                           "device": jax.devices()[0].device_kind, "modes": {}}  # fmt: skip
    model = random_model(a.shape, a.ctx + 8 * a.steps + 128)
    for mode in a.modes.split(","):
        try:
            res["modes"][mode] = profile_mode(model, mode, a, out)
        except Exception:  # noqa: BLE001
            res["modes"][mode] = {"error": traceback.format_exc()[-3000:]}
            print(res["modes"][mode]["error"], file=sys.stderr, flush=True)
        (out / "profile_step.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
