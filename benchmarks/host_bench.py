"""Host work of one engine decode step (issue 11: engine step - device step <= 0.3 ms at batch 1).

What it measures: steady greedy decode through `Engine.step` (async scheduling on unless
--async-scheduling off, "tp", page 16, the default smallest token bucket, a 64-token budget),
B requests of a 64-token prompt, the median over --steps decode steps of
- `step`: the whole `Engine.step` call;
- each host phase inside it, timed with perf_counter around the engine's own methods:
  `schedule` (scheduler), `prepare` (a step built from the host's tokens), `ahead` (the next
  step's inputs built before this one's tokens reach the host: `ModelRunner.prepare_ahead`),
  `dispatch` (the jitted call: argument handling, host->device copies, the launch), `report`
  (detokenisation, stop strings, streaming outputs, latency metrics), `fetch` (block on the step
  in flight and copy its tokens to the host), `apply` (append tokens, finish checks, page
  accounting), `gauges` (Prometheus gauges); `other` = step minus the phases;
- `host` = step - fetch: the work the host does per step besides waiting for the device.

`--device null` (the default) removes the device work: the runner's step is replaced by a jitted
function with the same arguments (the engine's real params, KV cache, StepBatch and
SamplingInputs, placed as the real step's; nothing pruned, so the call handles every argument as
the real one does) that returns a token per row computed from its input token and position. So
`step` is host work plus a negligible launch, on a CPU as on a GPU host. `--device real` runs the
model's own step (on a GPU: what the device overlaps; `host` then is the host's part, valid
while the host is faster than the device). The null step's executable is kept out of jdet's
executable cache (its own directory in a temporary folder), so it can never be loaded as a real
step.

    python -m benchmarks.host_bench [--device null|real] [--batches 1,8] [--steps 300]
        [--async-scheduling on|off] [--repeats 3] [--shape qwen3-0.6b | --model DIR]
        [--out host_bench.json]

On a CPU a step is noisy under load: each figure is the best of --repeats runs of the median,
and the JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import numpy as np

PHASES = ("schedule", "prepare", "ahead", "dispatch", "report", "fetch", "apply", "gauges")
PROMPT_TOKENS = 64


def null_step(vocab: int) -> Any:
    """A jitted step of the real step's signature whose device work is negligible: token =
    (7 * input token + position + 1) mod V per sampled row (a varied, valid token stream, so
    detokenisation does real work), zero log-probs. KV donated and returned as is."""
    import jax
    import jax.numpy as jnp

    from jdet.sampling import NUM_TOP, SampleOut

    @functools.partial(jax.jit, donate_argnums=(1,), keep_unused=True)
    def step(params: Any, kv: Any, batch: Any, sampling: Any) -> tuple[Any, Any]:
        rows = batch.logits_rows
        tok = (batch.token_ids[rows] * 7 + batch.positions[rows] + 1) % vocab
        n = rows.shape[0]
        return kv, SampleOut(
            tok.astype(jnp.int32), jnp.zeros(n, jnp.float32),
            jnp.zeros((n, NUM_TOP), jnp.int32), jnp.zeros((n, NUM_TOP), jnp.float32),
        )  # fmt: skip

    return step


class PhaseTimer:
    """perf_counter around named callables of the engine, summed per engine step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)
        cur = self.current

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[phase] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def step(self, eng: Any) -> None:
        self.current.clear()
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        row = {p: self.current.get(p, 0.0) for p in PHASES}
        row["step"] = dt
        row["host"] = dt - row["fetch"]
        row["other"] = dt - sum(row[p] for p in PHASES)
        self.steps.append(row)


BUDGET = 64  # token budget: few step shapes to compile (T = 8/16 .. 64, one page bucket)
MAX_LEN = 1024


def make_engine(model: Any, device: str, max_batch: int, async_scheduling: str = "on") -> Any:
    """One engine for every batch size of the run, with a KV pool just large enough (not the
    GPU's free memory) and few shapes, so a GPU run compiles the real step only a few times."""
    import jax

    from jdet import exec_cache
    from serving.engine.engine import Engine
    from serving.engine.host_inputs import PackedStep, packed

    pages = MAX_LEN // 16
    eng = Engine(model, max_num_seqs=max(8, max_batch), max_num_batched_tokens=BUDGET,
                 max_model_len=MAX_LEN, page_size=16, num_pages=max(8, max_batch) * pages + 8,
                 min_pages_bucket=pages, async_scheduling=async_scheduling)  # fmt: skip
    if device == "null":
        r = eng.runner
        d = tempfile.mkdtemp(prefix="jdet-host-bench-")
        # host inputs packed as the real step's (serving/engine/host_inputs.py)
        run = packed(null_step(model.cfg.vocab_size),
                     functools.partial(jax.jit, donate_argnums=(1,), keep_unused=True))
        r.step_fn = PackedStep(exec_cache.CachedFn(
            run, name="benchmarks.host_bench.null_step",
            static={"cfg": repr(model.cfg)}, devices=r.token_sharding.device_set, directory=d,
        ))  # fmt: skip
    elif device != "real":
        raise ValueError(f"--device must be 'null' or 'real', got {device!r}")
    eng.warmup()
    return eng


def instrument(eng: Any) -> PhaseTimer:
    t = PhaseTimer()
    r = eng.runner
    t.wrap(eng.scheduler, "schedule", "schedule")
    t.wrap(r, "prepare", "prepare")
    t.wrap(r, "prepare_ahead", "ahead")
    t.wrap(r, "dispatch", "dispatch")
    t.wrap(r, "fetch", "fetch")
    t.wrap(eng, "_report", "report")
    t.wrap(eng, "_apply", "apply")
    t.wrap(eng, "_update_gauges", "gauges")
    return t


def run_once(eng: Any, timer: PhaseTimer, batch: int, steps: int, tag: str) -> dict:
    rng = np.random.default_rng(0)
    V = eng.cfg.vocab_size
    for i in range(batch):
        ids = rng.integers(1, V, PROMPT_TOKENS).tolist()
        eng.add_request(f"{tag}-{i}", ids, dict(temperature=0.0, max_tokens=steps + 8,
                                                 ignore_eos=True))  # fmt: skip
    timer.steps.clear()
    ahead0 = eng.num_steps_ahead
    while eng.has_unfinished():
        timer.step(eng)
    skip = -(-batch * PROMPT_TOKENS // BUDGET) + 4  # the prefill and the first decodes
    rows = timer.steps[skip : skip + steps]
    med = {k: statistics.median(r[k] for r in rows) * 1e6 for k in rows[0]}
    med["steps_ahead"] = eng.num_steps_ahead - ahead0
    med["steps"] = len(timer.steps)
    return med


def bench(eng: Any, timer: PhaseTimer, batch: int, steps: int, repeats: int) -> dict:
    device = "null" if "null_step" in getattr(eng.runner.step_fn, "name", "") else "real"
    run_once(eng, timer, batch, 16, f"warm{batch}")
    runs = [run_once(eng, timer, batch, steps, f"r{batch}-{k}") for k in range(repeats)]
    best = min(runs, key=lambda r: r["step"])
    return {"device": device, "batch": batch, "steps": steps, "repeats": repeats,
            "us": {k: round(v, 1) for k, v in best.items()},
            "step_us_all_runs": [round(r["step"], 1) for r in runs]}  # fmt: skip


def table(rows: list[dict]) -> str:
    cols = ("step", "host", *PHASES, "other")
    out = ["device B | " + " ".join(f"{c:>8}" for c in cols) + "   (median us per decode step)"]
    for r in rows:
        u = r["us"]
        out.append(f"{r['device']:>6} {r['batch']} | " + " ".join(f"{u[c]:8.1f}" for c in cols))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="null", choices=("null", "real"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--async-scheduling", default="on", choices=("on", "off"),
                   help="off: the synchronous engine (a CPU's default), every step built from "
                   "the host's tokens")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="a model directory (default: the embedded one)")
    p.add_argument("--shape", default=None, help="random weights of a decode_bench shape instead "
                   "(e.g. qwen3-0.6b; no tokenizer, so no detokenisation)")  # fmt: skip
    p.add_argument("--out", default="host_bench.json")
    a = p.parse_args(argv)
    import jax

    import jdet

    if a.shape:
        from benchmarks.decode_bench import random_model

        model = random_model(a.shape, 1024)
    else:
        model = jdet.load(a.model) if a.model else jdet.load()
    load0 = os.getloadavg()
    batches = [int(b) for b in a.batches.split(",")]
    eng = make_engine(model, a.device, max(batches), a.async_scheduling)
    timer = instrument(eng)
    rows = [bench(eng, timer, b, a.steps, a.repeats) for b in batches]
    res = {"what": "Engine.step host phases, steady greedy decode",
           "async_scheduling": a.async_scheduling,
           "backend": jax.default_backend(), "devices": str(jax.devices()[0]),
           "jax": jax.__version__, "model": a.shape or a.model or "embedded",
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "rows": rows}  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(rows))
    print(f"load average before {load0}, after {res['loadavg_after']}; JSON: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
