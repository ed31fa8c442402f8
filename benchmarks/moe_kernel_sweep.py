"""Launch settings of the grouped matmul's kernels (pallas_kernels/grouped_launch.py) timed at a
mixture-of-experts step's row counts on one GPU (Qwen3-30B-A3B shape, random bf16, the "tp"
layout's experts padded 768 -> 1024), each candidate's bits against the default launch's.

Cases (tokens of the step, tokens real): (1, 1) 8 rows in `row_tiles`; (16, 1) the engine's
batch-1 decode step, 128 rows of which 8 are real, in `group_tiles`; (32, 32) and (64, 64),
256 and 512 rows, where the slot-order kernel runs. Per case, the kernel `grouped_matmul`
picks for that row count (row order below SLOT_ORDER_MIN_ROWS, slot order from it, copies in
and out included), gate|up (one launch, BIO over D) and down (the tree over the padded F), over
`--layers` layers of their own weights, timed as one jitted call: us per layer, GB/s of the
chosen experts' live bytes (768 columns), and `bits_equal` (np.array_equal with the default
launch over every layer's output; a candidate whose bits differ is reported, never chosen).
Then the whole MoE layer (`jdet.moe.ffn_forward`, Ops("tp"), unrolled) at the default launch
(`before`: this tree's launch and kernel choice) and with `grouped_launch.DEFAULTS` set to each
kind's fastest bit-equal candidate of that case (`best`), its bits against `before`'s. Below
SLOT_ORDER_MIN_ROWS the slot-order kernel is a candidate too where the layout has few slots
(8 rows: 512), as Launch(order="slot").

Work runs most important first ((16, 1), then (1, 1), 512, 256 rows); past `--budget-s` the
rest is skipped (the JSON so far stays written).

    PYTHONPATH=. python -m benchmarks.moe_kernel_sweep --out OUT [--layers 4] [--budget-s 120]

`--smoke`: the tiny shape, 2 layers, on a CPU in interpret mode (JDET_PALLAS_INTERPRET=1).
Writes OUT/moe_kernel_sweep.json after every row; prints one line per row and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.moe_layer_probe import _config, _unrolled, _weights, layouts
from benchmarks.timing import median_seconds
from jdet.moe import ffn_forward
from jdet.ops import Ops
from jdet.tp_layout import ffn_padded
from pallas_kernels import grouped_launch as glaunch
from pallas_kernels import grouped_layout as gl
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_slots import SLOT_ORDER_MIN_ROWS, grouped_pallas_slots
from pallas_kernels.tree_matmul import tree_plan

L = glaunch.Launch
CASES = ((16, 1), (1, 1), (64, 64), (32, 32))
ROW_PAIR = (L(), L(block_n=64), L(block_n=32), L(block_n=64, num_warps=8))
ROW_TREE = (L(), L(k_split=2), L(k_split=4), L(block_n=64, k_split=4))
SLOT = (L(), L(block_n=64))
# below SLOT_ORDER_MIN_ROWS, where the layout has at most this many slots: slot order too
SMALL_SLOTS, SLOT_SMALL = 1024, (L(order="slot"), L(order="slot", block_n=64))


def _name(launch: glaunch.Launch) -> str:
    parts = [f"bn{launch.block_n}" if launch.block_n else "",
             f"w{launch.num_warps}" if launch.num_warps else "",
             f"s{launch.num_stages}" if launch.num_stages else "",
             f"ks{launch.k_split}" if launch.k_split > 1 else "",
             launch.order or ""]  # fmt: skip
    return " ".join(p for p in parts if p) or "default"


def _kernel_fn(kind: str, tiles, cfg, act_width: int, launch: glaunch.Launch):
    """(ffn, x) -> every layer's outputs, the kernel `_subtree` runs at this row count."""
    k, d, f = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    plan = tree_plan(act_width, jnp.bfloat16)
    if kind == "gate_up":
        names, per_src, kw = ("expert_gate", "expert_up"), k, dict(
            leaf_k=d, num_leaves=1, out_dtype=jnp.dtype(jnp.bfloat16), live_n=f)
    else:
        names, per_src, kw = ("expert_down",), 1, dict(
            leaf_k=plan.leaf_k, num_leaves=plan.num_leaves, out_dtype=jnp.dtype(jnp.float32),
            live_k=f)
    kw.update(block_n=launch.block_n, num_warps=launch.num_warps, num_stages=launch.num_stages)
    slot_order = glaunch.slot_order(launch, tiles[0].num_rows, SLOT_ORDER_MIN_ROWS)

    def run(ffn, x):
        outs = []
        for i, tl in enumerate(tiles):
            ws, lw = tuple(ffn[n] for n in names), jnp.int32(i).reshape(1)
            if slot_order:
                o = grouped_pallas_slots(gl.gather_rows(x, tl, per_src), ws, lw, tl.tile_group,
                                         **kw)  # fmt: skip
                outs += [gl.scatter_rows(y, tl) for y in o]
            else:
                outs += list(gm._grouped_pallas(x, ws, lw, tl.tile_group, tl.slot_row,
                                                tl.row_slot, per_src=per_src,
                                                k_split=launch.k_split, **kw))  # fmt: skip
        return outs

    return jax.jit(run), ("slot" if slot_order else "row")


def _bits(outs) -> np.ndarray:
    return np.concatenate([np.asarray(o.astype(jnp.float32)).ravel() for o in outs])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--cases", default="16/1,1/1,64/64,32/32", help="tokens/real, in order")
    p.add_argument("--smoke", action="store_true", help="tiny shape, 2 layers, 2 cases")
    a = p.parse_args(argv)
    smoke = a.smoke
    shape = "tiny-moe" if smoke else "qwen3-30b-a3b"
    layers = 2 if a.smoke else a.layers
    cases = [tuple(int(v) for v in c.split("/")) for c in a.cases.split(",") if c]
    if a.smoke and a.cases == p.get_default("cases"):
        cases = [(16, 1), (1, 1)]
    t0 = time.perf_counter()
    left = lambda: a.budget_s - (time.perf_counter() - t0)  # noqa: E731
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "layers": layers, "shape": shape, "rows": []}  # fmt: skip

    def say(row: dict) -> None:
        res["rows"].append(row)
        (out / "moe_kernel_sweep.json").write_text(json.dumps(res, indent=2))
        print(json.dumps(row), flush=True)

    cfg = _config(shape, layers)
    f_pad = ffn_padded(cfg.moe_intermediate_size, jnp.bfloat16)
    ffn = jax.block_until_ready(_weights(cfg, f_pad, 0))
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    tp = Ops(invariance="tp")
    for tokens, real in cases:
        if left() < 5:
            say({"tokens": tokens, "real": real, "skipped": "budget"})
            continue
        key = jax.random.PRNGKey(tokens * 100 + real)
        slots = jnp.where(jnp.arange(tokens) < real, jnp.arange(tokens), -1).astype(jnp.int32)
        h = jax.random.normal(key, (tp.row_pad(tokens), d), jnp.bfloat16)
        tiles = layouts(cfg, ffn, h, slots, layers)
        rows = tiles[0].num_rows
        distinct = float(np.mean([len(set(np.asarray(gl.row_groups(t)).tolist()) - {-1})
                                  for t in tiles]))  # fmt: skip
        act = jnp.asarray(np.random.default_rng(0).standard_normal((rows, f_pad)), jnp.bfloat16)
        best: dict[str, tuple[float, glaunch.Launch]] = {}
        for kind, x, nproj in (("gate_up", h, 2), ("down", act, 1)):
            if rows >= SLOT_ORDER_MIN_ROWS:
                cands = SLOT
            else:
                cands = ROW_PAIR if kind == "gate_up" else ROW_TREE
                cands = cands[:2] + cands[-1:] if smoke else cands
                cands += SLOT_SMALL if tiles[0].num_slots <= SMALL_SLOTS else ()
            base = None
            for launch in cands:
                order = "slot" if glaunch.slot_order(launch, rows, SLOT_ORDER_MIN_ROWS) else "row"
                row = {"tokens": tokens, "real": real, "rows": rows, "kernel": kind,
                       "order": order, "launch": _name(launch), "experts": distinct}  # fmt: skip
                if left() < 3:
                    say({**row, "skipped": "budget"})
                    continue
                try:
                    fn, _ = _kernel_fn(kind, tiles, cfg, f_pad, launch)
                    t1 = time.perf_counter()
                    bits = _bits(jax.block_until_ready(fn(ffn, x)))
                    row["compile_s"] = round(time.perf_counter() - t1, 2)
                    s = median_seconds(fn, ffn, x, iters=10, reps=5, warmup=1) / layers
                    row["us_per_layer"] = round(s * 1e6, 2)
                    row["GBps"] = round(distinct * nproj * d * f * 2 / s / 1e9, 1)
                    base = bits if base is None else base
                    row["bits_equal"] = bool(np.array_equal(bits, base))
                    if row["bits_equal"] and s < best.get(kind, (np.inf, None))[0]:
                        best[kind] = (s, launch)
                except Exception:  # noqa: BLE001 - a launch Triton rejects: keep the others
                    row["error"] = traceback.format_exc()[-1200:]
                say(row)
        _whole_layer(cfg, ffn, h, slots, tokens, real, rows, best, layers, left, say)
    _table(res["rows"])
    print(f"total: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _whole_layer(cfg, ffn, h, slots, tokens, real, rows, best, layers, left, say) -> None:
    """ffn_forward ("tp") at the default launch and with each kind's best launch as default."""
    tp = Ops(invariance="tp")
    rules = {"pair": (), "tree": (), "single": ()}
    for kind, key in (("gate_up", "pair"), ("down", "tree")):
        if kind in best:
            rules[key] = ((rows + 1, best[kind][1]),)
    saved, base = glaunch.DEFAULTS, None
    for label, table in (("before", saved), ("best", rules)):
        row = {"tokens": tokens, "real": real, "rows": rows, "kernel": "moe_layer",
               "launch": label, "gate_up": _name(best["gate_up"][1]) if "gate_up" in best else
               "default", "down": _name(best["down"][1]) if "down" in best else "default"}
        if left() < 8:
            say({**row, "skipped": "budget"})
            continue
        try:
            glaunch.DEFAULTS = table
            fn = _unrolled(lambda w, x, s, i: ffn_forward(w, x, i, cfg, tp, s))
            t1 = time.perf_counter()
            bits = _bits([jax.block_until_ready(fn(ffn, h, slots))])
            row["compile_s"] = round(time.perf_counter() - t1, 2)
            row["us_per_layer"] = round(median_seconds(fn, ffn, h, slots, iters=10, reps=5)
                                        / layers * 1e6, 2)  # fmt: skip
            base = bits if base is None else base
            row["bits_equal"] = bool(np.array_equal(bits, base))
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-1200:]
        finally:
            glaunch.DEFAULTS = saved
        say(row)


def _table(rows: list[dict]) -> None:
    print(f"{'tok/real':>8} {'rows':>4} {'kernel':>9} {'ord':>4} {'launch':>14} {'us/layer':>9} "
          f"{'GB/s':>7} {'bits':>5} {'comp_s':>6}")  # fmt: skip
    for r in rows:
        if "kernel" not in r:
            continue
        bits = {True: "same", False: "DIFF"}.get(r.get("bits_equal"), "-")
        note = " skipped" if "skipped" in r else " ERROR" if "error" in r else ""
        print(f"{r['tokens']:>4}/{r['real']:<3} {r['rows']:>4} {r['kernel']:>9} "
              f"{r.get('order', ''):>4} {r['launch']:>14} {r.get('us_per_layer', 0):>9.1f} "
              f"{r.get('GBps', 0):>7.0f} {bits:>5} {r.get('compile_s', 0):>6.1f}{note}")
        if r["kernel"] == "moe_layer" and r["launch"] == "best":
            print(f"{'':>14} best: gate_up {r['gate_up']}, down {r['down']}")
    errs = [r for r in rows if "error" in r]
    for r in errs[:2]:
        print("error", r["kernel"], r["launch"], r["error"][-400:].replace("\n", " | "))


if __name__ == "__main__":
    sys.exit(main())
