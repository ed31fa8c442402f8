"""Tensor-parallel decode step time: TP 1 vs 2 (vs 4) with the all-reduce jdet runs ("auto": the
one-launch "pull" kernel for decode sizes on Hopper) and with it forced onto the XLA/NCCL
schedules ("xla_auto"), for a Llama-3-8B-shaped random bf16 model in "tp" mode.

Each row: `batch` sequences at context `ctx`, one token each (T = max(16, batch) rows, as the
engine pads a decode step), the step `make_tp_step` compiles (the engine's TP step), dispatched
back to back; step_ms is the mean over `steps` steps after two warm ones. Rows run most
informative first (TP 2 vs TP 1 at batch 1, then batch 32, then TP 4) and stop at the deadline;
the JSON is rewritten after every row, so a run cut short keeps what it measured.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python -m benchmarks.tp_step_probe --out OUT [--deadline-s 220] [--layers 32]
--smoke runs a tiny model on CPU host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4):
a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import jax

from benchmarks.decode_bench import SHAPES
from benchmarks.tp_bench import decode_bench, random_sharded_params
from jdet.config import ModelConfig
from sharding.mesh import make_tp_mesh
from sharding.tree_allreduce import PULL_MAX_BYTES, pull_runs_here


def llama3_8b(layers: int) -> ModelConfig:
    raw = dict(SHAPES["llama3-8b"], max_position_embeddings=8192, attention_bias=False)
    return dataclasses.replace(ModelConfig.from_hf(raw), num_layers=layers)


def plan(num_devices: int, batches: tuple[int, ...]) -> list[tuple[int, str, int]]:
    """(tp, allreduce, batch) rows, most informative first; TP 1 has no all-reduce."""
    rows = []
    for b in batches:
        rows += [(2, "auto", b), (1, "auto", b), (2, "xla_auto", b)]
    rows += [(4, a, b) for b in batches for a in ("auto", "xla_auto")]
    return [r for r in rows if r[0] <= num_devices]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--deadline-s", type=float, default=220.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama3_8b(a.layers)
    batches = tuple(int(b) for b in a.batches.split(","))
    if a.smoke:
        from tests.sharding.tiny import tiny_cfg

        cfg, batches, a.ctx, a.steps = tiny_cfg(head_dim=128), (1, 2), 8, 2
    res: dict = {
        "what": "decode step ms, Llama-3-8B shape (random bf16), 'tp' mode, make_tp_step",
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
        "jax": jax.__version__,
        "layers": cfg.num_layers,
        "ctx": a.ctx,
        "pull_runs_here": pull_runs_here(),
        "pull_max_bytes": PULL_MAX_BYTES,
        "rows": [],
    }

    def save() -> None:
        (out / "tp_step_probe.json").write_text(json.dumps(res, indent=1))

    params: dict = {}
    est = 60.0  # seconds a row takes (compile + timing); updated as rows run
    for tp, allreduce, batch in plan(jax.device_count(), batches):
        row: dict = {"tp": tp, "allreduce": allreduce, "batch": batch}
        if a.deadline_s - (time.time() - t_start) < est:
            row["skipped"] = "deadline"
        else:
            t0 = time.time()
            try:
                mesh = make_tp_mesh(tp)
                if tp not in params:
                    params[tp] = (mesh, random_sharded_params(cfg, mesh))
                mesh, p = params[tp]
                row.update(decode_bench(cfg, mesh, p, "tp", batch, a.ctx, steps=a.steps,
                                        allreduce=allreduce))  # fmt: skip
                row["allreduce"] = allreduce
                est = max(30.0, time.time() - t0)
            except Exception:  # noqa: BLE001 - recorded in the row, the next one runs
                row["error"] = traceback.format_exc()[-3000:]
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        save()
    ms = {(r["tp"], r["allreduce"], r["batch"]): r["step_ms"] for r in res["rows"]
          if "step_ms" in r}  # fmt: skip
    res["over_tp1"] = {
        f"tp{tp}_{al}_B{b}": round(v / ms[(1, "auto", b)], 3)
        for (tp, al, b), v in ms.items()
        if tp > 1 and (1, "auto", b) in ms
    }
    res["seconds"] = round(time.time() - t_start, 1)
    save()
    print(json.dumps({"over_tp1": res["over_tp1"], "seconds": res["seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
