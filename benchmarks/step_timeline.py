"""One decode step's timeline: device kernels and host events interleaved, in time order.

Why: `profile_step` reduces a trace to totals and gaps; a gap's cause (a host-side command-buffer
update, a predicate copy, an allocation, a launch) shows only next to what the host was doing at
that moment. This records a few back-to-back device steps, each inside a
`jax.profiler.TraceAnnotation`, and writes every device kernel and every host event of one
middle step with its start (µs from the step's annotation), its duration and its thread, plus the
device gaps over a threshold with the host events that overlap each gap.

    XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true \\
    PYTHONPATH=. python -m benchmarks.step_timeline --out OUT [--shape qwen3-0.6b] [--mode tp]
Writes `step_timeline_<shape>_<mode>.json` and the compiled step's HLO text (gzip).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.profile_step import _events


def timeline(fn: Any, steps: int, pick: int, gap_us: float) -> dict:
    import jax

    d = tempfile.mkdtemp(prefix="jdet_tl_")
    fn()
    fn()
    with jax.profiler.trace(d):
        for i in range(steps):
            with jax.profiler.TraceAnnotation(f"jdet_step_{i}"):
                fn()
    dev, host = _events(d)  # benchmarks/profile_step.py's reader of the trace
    marks = sorted((s, s + du) for ln, n, s, du in host if n == f"jdet_step_{pick}")
    if not marks:
        return {"error": "no step annotation in the trace", "host_names":
                sorted({n for _, n, _, _ in host})[:200]}  # fmt: skip
    t0, t1 = marks[0]
    kern = sorted((s, du, n, ln) for ln, n, s, du in dev
                  if "stream" in ln.lower() and t0 <= s <= t1)  # fmt: skip
    hev = sorted((s, du, n, ln) for ln, n, s, du in host
                 if t0 <= s <= t1 and not n.startswith("jdet_step_"))  # fmt: skip
    rows = [("D", round((s - t0) / 1e3, 2), round(du / 1e3, 2), n[:100], ln[:40])
            for s, du, n, ln in kern]  # fmt: skip
    rows += [("H", round((s - t0) / 1e3, 2), round(du / 1e3, 2), n[:100], ln[:40])
             for s, du, n, ln in hev]  # fmt: skip
    rows.sort(key=lambda r: r[1])
    gaps, end = [], None
    for s, du, n, _ in kern:
        if end is not None and s - end > gap_us * 1e3:
            over = [(round((hs - t0) / 1e3, 2), round(hd / 1e3, 2), hn[:100], hl[:40])
                    for hs, hd, hn, hl in hev if hs < s and hs + hd > end]  # fmt: skip
            gaps.append({"from_us": round((end - t0) / 1e3, 2), "to_us": round((s - t0) / 1e3, 2),
                         "next_kernel": n[:100], "host_overlapping": over[:60]})  # fmt: skip
        end = s + du if end is None else max(end, s + du)
    busy = 0.0
    e2 = None
    for s, du, _, _ in kern:
        busy += max(0.0, s + du - max(s, e2 if e2 is not None else s))
        e2 = s + du if e2 is None else max(e2, s + du)
    return {"step_wall_us": round((t1 - t0) / 1e3, 1), "kernels": len(kern),
            "first_kernel_us": rows and next((r[1] for r in rows if r[0] == "D"), None),
            "busy_us": round(busy / 1e3, 1), "gaps_over": gaps, "rows": rows[:4000]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--mode", default="tp")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--gap-us", type=float, default=8.0)
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    from benchmarks.decode_bench import decode_inputs, make_engine, pages_for, random_model
    from benchmarks.timing import median_seconds

    model = random_model(a.shape, a.ctx + 256)
    num_pages = pages_for(a.ctx, 64) + 32
    eng = make_engine(model, a.mode, a.ctx + 192, num_pages)
    r = eng.runner
    hsb, hsi = decode_inputs(r.cfg, 1, a.ctx, pages_for(a.ctx, 16))
    dsb, dsi = jax.device_put(hsb), jax.device_put(hsi)
    from sharding.mesh import make_tp_mesh
    from sharding.tp import make_tp_step

    # the runner's own step (PackedStep: host inputs packed into one buffer, as the engine calls
    # it) and the plain step on device inputs (decode_bench's variant rows)
    cases = [("packed", r.step_fn, hsb, hsi)]
    if a.mode != "none":
        cases.append(("plain", make_tp_step(model.cfg, a.mode, make_tp_mesh(1)), dsb, dsi))
    res = {"shape": a.shape, "mode": a.mode, "tag": a.tag, "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": {}}  # fmt: skip
    for case, fn, sb, si in cases:
        name = f"{a.shape}_{a.mode}_{case}{a.tag}"
        try:
            txt = fn.lower(r.params, r.kv, sb, si).compile().as_text()
            with gzip.open(out / f"step_hlo_{name}.txt.gz", "wt") as f:
                f.write(txt)
        except Exception as e:  # noqa: BLE001 - the PackedStep may not expose lower()
            print(name, "no HLO:", repr(e)[:200], flush=True)

        def once(fn: Any = fn, sb: Any = sb, si: Any = si) -> None:
            r.kv, o = fn(r.params, r.kv, sb, si)
            o.tokens.block_until_ready()

        def one(sb: Any, si: Any, fn: Any = fn) -> Any:
            r.kv, o = fn(r.params, r.kv, sb, si)
            return o.tokens

        med = median_seconds(one, sb, si, iters=16, reps=5, warmup=2)
        tl = timeline(once, a.steps, a.steps // 2, a.gap_us)
        res["cases"][case] = {"device_step_ms": med * 1e3, "timeline": tl}
        print(name, "step", round(med * 1e3, 3), "ms; traced wall", tl.get("step_wall_us"),
              "busy", tl.get("busy_us"), "kernels", tl.get("kernels"), "gaps>", a.gap_us, "us:",
              [(g["from_us"], g["to_us"], g["next_kernel"][:40]) for g in tl.get("gaps_over", [])],
              flush=True)  # fmt: skip
        (out / f"step_timeline_{a.shape}_{a.mode}{a.tag}.json").write_text(
            json.dumps(res, indent=0, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
