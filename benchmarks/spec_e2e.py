"""spec_bench's end-to-end part: batch-1 generation through `Engine.step`, several engines side
by side in one process (they share the compiled steps and, `shared_weights`, one placed copy of
the weights), `reps` rounds in rotated order, median and spread; bits asserted equal across all.

Engines (`--engines`, `--replay-alphas` in benchmarks/spec_bench.py):
- adaptive: n-gram drafts, adaptive K (the default: steps where no request drafts go ahead);
- always_drafting: n-gram drafts, `min_alpha=0` (every step verifies, synchronously);
- plain_async (the GPU default) and plain_sync: no speculation;
- replay_A: the replay draft (tests/serving/speculative/replay_draft.py) right with probability A at
  each position, always drafting: a controlled alpha on random weights, where no real draft has one.
  It replays the first plain engine's output, recorded by a reference run before the rounds.

Each run records tokens/s over the whole request and over its decode (from the first output
token on: the 1023-token prompt's prefill is ~16 steps of the run and the same in every engine),
its steps (decode steps apart), steps dispatched ahead, device->host fetches (the sync points)
and compiles (0 expected: warm-up compiled every shape met).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

from tests.serving.speculative.replay_draft import ReplayDraft, attach_replay

BASE_ENGINES = ("adaptive", "always_drafting", "plain_async", "plain_sync")


@contextlib.contextmanager
def shared_weights() -> Iterator[dict]:
    """Engines built inside place the model's weights once instead of once each. Why: in "tp"
    mode every ModelRunner pads and places its own copy (sharding.tp.shard_params); four 8B
    engines' copies (~16 GB each) beside the model's own did not fit in an 80 GB H100 (session
    6). The step never donates its params, so engines may share them. Benchmark only."""
    import sharding.tp as tp

    real, memo = tp.shard_params, {}

    def shared(params: dict, cfg: Any, mesh: Any, **kw: Any) -> dict:
        key = (id(params), cfg, tuple(d.id for d in mesh.devices.flat), tuple(sorted(kw.items())))
        if key not in memo:
            memo[key] = real(params, cfg, mesh, **kw)
        return memo[key]

    tp.shard_params = shared
    try:
        yield memo
    finally:
        tp.shard_params = real
        memo.clear()


def settings(name: str, spec: Any) -> dict:
    """The Engine keywords of engine `name` (module docstring)."""
    always = dataclasses.replace(spec, min_alpha=0.0)
    if name == "adaptive":
        return {"speculative": spec, "async_scheduling": "on"}
    if name == "always_drafting" or name.startswith("replay_"):
        return {"speculative": always, "async_scheduling": "on"}
    if name == "plain_async":
        return {"async_scheduling": "on"}
    if name == "plain_sync":
        return {"async_scheduling": "off"}
    raise ValueError(f"unknown spec_bench engine {name!r}; use {', '.join(BASE_ENGINES)}, replay_A")


def timed_run(eng: Any, prompt: list[int], params: dict) -> dict:
    """One request through `eng.step()`: its output, wall seconds, and from its first output
    token on (the decode) seconds, tokens and steps."""
    eng.add_request("r", prompt, params)
    seq = eng.requests["r"].seqs[0]
    t0 = time.perf_counter()
    steps0, t1, n1, s1, final = eng.num_steps, None, 0, 0, None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final = o
        if t1 is None and seq.num_output_tokens > 0:
            t1, n1, s1 = time.perf_counter(), seq.num_output_tokens, eng.num_steps
    t2 = time.perf_counter()
    n = len(final.outputs[0].token_ids)
    return {"out": final, "seconds": t2 - t0, "tokens": n, "steps": eng.num_steps - steps0,
            "decode_seconds": t2 - t1, "decode_tokens": n - n1,
            "decode_steps": eng.num_steps - s1}  # fmt: skip


def e2e(model: Any, kw: dict, spec: Any, prompt: list[int], params: dict, reps: int,
        names: list[str], bits: Any) -> list[dict]:  # fmt: skip
    """Build the engines (each warmed on a short request), record the plain output (a reference
    run of the first plain engine: the replay drafts' script and the bits every run must give),
    then `reps` rounds over the engines in rotated order (one run of the embedded model is
    ~0.2 s: host jitter moved single runs by up to 1.6x in session 5)."""
    from jdet import compile_cache as cc
    from serving.engine.engine import Engine

    engines = {}
    for name in names:
        engines[name] = eng = Engine(model, **{**kw, **settings(name, spec)})
        eng.add_request("warm", prompt[:40], dict(params, max_tokens=8))
        eng.run()  # compile the shapes met
    plain = next((n for n in names if n.startswith("plain")), None)
    if plain is None:
        raise ValueError("spec_bench's end-to-end part needs a plain engine (the reference)")
    ref = timed_run(engines[plain], prompt, params)["out"]
    want = bits([ref])
    script = list(prompt) + list(ref.outputs[0].token_ids)
    for name in names:
        if name.startswith("replay_"):
            alpha = float(name.split("_", 1)[1])
            attach_replay(engines[name], ReplayDraft([script], alpha, model.cfg.vocab_size))
    rows = []
    for rep in range(reps):
        for j in range(len(names)):
            name = names[(j + rep) % len(names)]
            rows.append(one_run(engines[name], name, rep, prompt, params, spec, want, bits, cc))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def one_run(eng: Any, name: str, rep: int, prompt: list[int], params: dict, spec: Any,
            want: Any, bits: Any, cc: Any) -> dict:  # fmt: skip
    """One measured run of `eng`: counters around `timed_run`, bits checked against `want`."""
    fetches = [0]
    real = eng.runner.fetch

    def counted(*args: Any) -> Any:
        fetches[0] += 1
        return real(*args)

    eng.runner.fetch = counted
    if eng.speculator is not None:
        eng.speculator.reset_stats()
    ahead0, comp0 = eng.num_steps_ahead, cc.stats().compiles
    r = timed_run(eng, prompt, params)
    del eng.runner.fetch  # the class's again
    assert bits([r["out"]]) == want, f"{name}: bits differ from the plain run"
    n, dn = r["tokens"], r["decode_tokens"]
    row = {"run": name, "rep": rep, "K": spec.num_tokens if eng.speculator else 0,
           "tok_per_s": n / r["seconds"], "decode_tok_per_s": dn / r["decode_seconds"],
           "seconds": r["seconds"], "tokens": n, "async": bool(eng.async_scheduling),
           "steps": r["steps"], "decode_steps": r["decode_steps"],
           "tokens_per_decode_step": dn / max(1, r["decode_steps"]),
           "steps_ahead": eng.num_steps_ahead - ahead0,
           "ms_per_step": r["seconds"] / r["steps"] * 1e3, "fetches": fetches[0],
           "compiles": cc.stats().compiles - comp0}  # fmt: skip
    if eng.speculator is not None:
        row.update(eng.speculator.stats())
    if name.startswith("replay_"):
        row["target_alpha"] = float(name.split("_", 1)[1])
    return row


def summarize(rows: list[dict], names: list[str]) -> dict[str, dict]:
    """Per engine: the run of median decode tok/s (the upper one for an even count; its
    counters with it) and the spread over reps of both rates."""
    out = {}
    for name in names:
        mine = sorted((r for r in rows if r["run"] == name), key=lambda r: r["decode_tok_per_s"])
        if not mine:
            continue
        med = dict(mine[len(mine) // 2])
        med["decode_tok_per_s_min"] = mine[0]["decode_tok_per_s"]
        med["decode_tok_per_s_max"] = mine[-1]["decode_tok_per_s"]
        whole = sorted(r["tok_per_s"] for r in mine)
        med["tok_per_s_median"] = whole[len(whole) // 2]
        med["tok_per_s_min"], med["tok_per_s_max"] = whole[0], whole[-1]
        med["reps"] = len(mine)
        out[name] = med
    return out
