"""Per-layer time of the mixture-of-experts FFN (router, top-k, layout, grouped gate/up, SwiGLU,
down, combine) on one GPU at the Qwen3-30B-A3B shape (random bf16), the previous plan against
the current one, "tp" and "none", and the bits of "tp" old against new.

Variants, each over `--layers` layers of their own weights (so no layer's experts sit in L2 for
the next), every layer reading the same step's h, timed as one jitted call (benchmarks/timing.py)
and divided by the layers:
- tp-new: `jdet.moe.ffn_forward` with Ops("tp") (the experts padded 768 -> 1024 as the "tp"
  layout holds them; h carries the Hopper matmuls' row padding, `Ops.row_pad`), unrolled;
- tp-old: the composition and Pallas kernel this tree replaced, copied here (`_old_moe_block`):
  the layout over every row the residual stream carries, the rows copied into the layout's
  slots, one launch each for gate and up, SwiGLU and the down projection over every slot, the
  rows gathered back;
- none-new: Ops("none") (width 768): the same grouped kernels, BIO down, unrolled;
- none-old: XLA's `ragged_dot` (jdet.train's ops, the path "none" ran on a GPU before), in a
  layer loop as the model ran it (unrolled, XLA would hold every layer's dense temporaries).
Cases (tokens of the step's bucket, tokens that are real): (1, 1) a batch-1 decode step as
`decode_bench.device_step` runs it, (16, 1) the engine's batch-1 step (its smallest GPU bucket
is 16 tokens), (32, 32), (64, 64).

Bits: tp-new's output of every layer is compared with tp-old's (np.array_equal): the new layout,
gathers and launches must not change a bit. none-new and tp-new are compared with a pure-jnp f32
reference of layer 0 (max error relative to the largest value).

Kernels: tp-new's grouped gate|up and down launches timed alone over the layers (GB/s of the
chosen experts' live bytes), the row-order kernel and the slot-order one (`_slots`, with its
copies into and out of the slots; bits checked against the row-order kernel's), and with the
Triton pipeline depth `num_stages` in --stages (bits checked against the default: the depth
never changes an MMA or its order).

    PYTHONPATH=. python -m benchmarks.moe_layer_probe --out OUT [--layers 4] [--smoke]

`--smoke`: the tiny shape, 2 layers, two cases; on a CPU with JDET_PALLAS_INTERPRET=1 it runs
the Pallas kernels in interpret mode (their bits: old against new there too).

Writes OUT/moe_layer_probe.json (after every case) and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.moe_bench import SHAPES
from benchmarks.timing import median_seconds
from jdet.config import ModelConfig
from jdet.moe import combine_slots, ffn_forward, route
from jdet.ops import Ops, swiglu_act
from jdet.tp_layout import ffn_padded
from pallas_kernels import _platform
from pallas_kernels import grouped_layout as gl
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.tree_matmul import tree_plan

CASES = ((1, 1), (16, 1), (32, 32), (64, 64))


# -- the previous plan, kept here to check bits and time against -----------------------------------
def _old_kernel(tg_ref, l_ref, x_ref, w_ref, o_ref, *, cfg, k_first: int, num_leaves: int,
                precision, live_tiles: int, live_nb: int):  # fmt: skip
    t = pl.program_id(0)
    g = tg_ref[t]
    layer = l_ref[0]
    bk = cfg.block_k
    run = (g >= 0) & (pl.program_id(1) < live_nb)

    @pl.when(run)
    def _run():
        def leaf(first: int) -> jax.Array:
            n = max(0, min(k_first, live_tiles - first))

            def body(i, acc):
                start = pl.multiple_of((first + i) * bk, bk)
                a = x_ref[:, pl.ds(start, bk)]
                b = w_ref[layer, g, pl.ds(start, bk), :]
                return acc + jnp.dot(a, b, preferred_element_type=jnp.float32,
                                     precision=precision)  # fmt: skip

            acc0 = jnp.zeros((x_ref.shape[0], w_ref.shape[3]), jnp.float32)
            return lax.fori_loop(0, n, body, acc0) if n else acc0

        stack: list[tuple[int, jax.Array]] = []
        for j in range(num_leaves):
            node, height = leaf(j * k_first), 0
            while stack and stack[-1][0] == height:
                node = stack.pop()[1] + node
                height += 1
            stack.append((height, node))
        o_ref[...] = stack[0][1].astype(o_ref.dtype)

    @pl.when(jnp.logical_not(run))
    def _skip():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("leaf_k", "num_leaves", "out_dtype", "live_k",
                                             "live_n"))
def _old_pallas(xs, w, layer, tile_group, *, leaf_k: int, num_leaves: int, out_dtype,
                live_k: int | None = None, live_n: int | None = None):  # fmt: skip
    """The previous grouped kernel: xs in the layout's slots, [P, N] out, every tile written."""
    from jax.experimental.pallas import triton as pltriton

    mm = gm._mm
    dtype = jnp.promote_types(xs.dtype, w.dtype)
    xs, w = xs.astype(dtype), w.astype(dtype)
    cfg = mm.tile_config(leaf_k * num_leaves, w.shape[3], dtype)
    k_first = -(-leaf_k // cfg.block_k)
    p, n = xs.shape[0], w.shape[3]
    kp = num_leaves * k_first * cfg.block_k
    xs = mm._pad_to(xs, 1, kp)
    w = mm._pad_to(mm._pad_to(w, 2, kp), 3, cfg.block_n)
    nb = w.shape[3] // cfg.block_n
    bm = p // tile_group.shape[0]
    live_tiles = -(-(kp if live_k is None else live_k) // cfg.block_k)
    live_nb = -(-(nb * cfg.block_n if live_n is None else live_n) // cfg.block_n)
    kernel = functools.partial(_old_kernel, cfg=cfg, k_first=k_first, num_leaves=num_leaves,
                               precision=mm._precision(dtype), live_tiles=live_tiles,
                               live_nb=live_nb)  # fmt: skip
    interpret = _platform.interpret_default()
    params = None
    if not interpret:
        params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p, nb * cfg.block_n), out_dtype),
        grid=(tile_group.shape[0], nb),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda t, j: (0,)),
            pl.BlockSpec((1,), lambda t, j: (0,)),
            pl.BlockSpec((bm, kp), lambda t, j: (t, 0)),
            pl.BlockSpec((*w.shape[:2], kp, cfg.block_n), lambda t, j: (0, 0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, cfg.block_n), lambda t, j: (t, j)),
        interpret=interpret,
        compiler_params=params,
        name="grouped_matmul_old",
    )(tile_group, layer, xs, w)
    return out[:, :n]


def _old_moe_block(lp: dict, h, cfg, ops: Ops, slot_mapping, layer):
    """The previous `moe_block` ("tp", one shard), with the previous kernel."""
    t, d = h.shape
    k = cfg.num_experts_per_tok
    real = jnp.pad(slot_mapping >= 0, (0, t - slot_mapping.shape[0]))
    router = lax.dynamic_index_in_dim(lp["router"], layer, keepdims=False)
    logits = ops.matmul(h, router, out_dtype=jnp.float32)
    w, ids = route(logits, k, cfg.norm_topk_prob)
    w = w.astype(h.dtype).astype(jnp.float32)  # qwen3_moe
    ids = jnp.where(real[:, None], ids, cfg.num_experts)
    tiles = gl._layout_by_sort(jnp.minimum(ids.reshape(-1), cfg.num_experts), cfg.num_experts,
                               gm.tile_rows())  # fmt: skip
    hz = jnp.concatenate([h, jnp.zeros((1, d), h.dtype)])
    xs = hz[tiles.slot_row // k]
    live = cfg.moe_intermediate_size
    lw = jnp.asarray(layer, jnp.int32).reshape(1)
    wg = lp["expert_gate"]
    kw = dict(leaf_k=d, num_leaves=1, out_dtype=h.dtype, live_n=live)
    gate = _old_pallas(xs, wg, lw, tiles.tile_group, **kw)
    up = _old_pallas(xs, lp["expert_up"], lw, tiles.tile_group, **kw)
    act = swiglu_act(gate, up, h.dtype)
    plan = tree_plan(act.shape[1], act.dtype)
    y = _old_pallas(act, lp["expert_down"], lw, tiles.tile_group, leaf_k=plan.leaf_k,
                    num_leaves=plan.num_leaves, out_dtype=jnp.dtype(jnp.float32),
                    live_k=live)  # fmt: skip
    y = gl.scatter_rows(y, tiles).astype(h.dtype)
    return combine_slots(w, y.reshape(t, k, d), h.dtype, True)


# -- the variants ----------------------------------------------------------------------------------
def _config(shape: str, layers: int) -> ModelConfig:
    raw = dict(SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=4096)
    return ModelConfig.from_hf(raw)


def _weights(cfg: ModelConfig, f: int, seed: int) -> dict:
    """Random bf16 expert stacks over every layer, width f (zero past the model's width)."""
    L, D, E, F = cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(key, shape, scale):
        x = jax.random.normal(key, shape, jnp.float32) * scale
        return x.astype(jnp.bfloat16)

    def padded(key, shape, axis):
        x = draw(key, shape, 0.02)
        if f == F:
            return x
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, f - F)
        return jnp.pad(x, pad)

    return {"router": draw(keys[0], (L, D, E), 0.05),
            "expert_gate": padded(keys[1], (L, E, D, F), 3),
            "expert_up": padded(keys[2], (L, E, D, F), 3),
            "expert_down": padded(keys[3], (L, E, F, D), 2)}  # fmt: skip


def _unrolled(block):
    """(ffn, h, slots) -> [L, T', D]: `block(ffn, h, slots, layer)` for every layer."""

    def run(ffn, h, slots):
        n = ffn["router"].shape[0]
        return jnp.stack([block(ffn, h, slots, jnp.int32(i)) for i in range(n)])

    return jax.jit(run)


def _looped(block):
    """As `_unrolled`, the layers in a scan (as the model ran "none"'s ragged_dot layers)."""

    def run(ffn, h, slots):
        n = ffn["router"].shape[0]
        _, out = lax.scan(lambda c, i: (c, block(ffn, h, slots, i)), 0, jnp.arange(n))
        return out

    return jax.jit(run)


def _variants(cfg: ModelConfig) -> dict:
    from jdet.train import _XlaOps

    tp, none, ragged = Ops(invariance="tp"), Ops(invariance="none"), _XlaOps("none")

    def new(ops):
        return lambda ffn, h, slots, i: ffn_forward(ffn, h, i, cfg, ops, slots)

    return {
        "tp-new": (_unrolled(new(tp)), "tp"),
        "tp-old": (_unrolled(lambda ffn, h, slots, i: _old_moe_block(ffn, h, cfg, tp, slots, i)),
                   "tp"),
        "none-new": (_unrolled(new(none)), "none"),
        "none-old": (_looped(new(ragged)), "none"),
    }  # fmt: skip


def _reference(ffn: dict, h, slots, cfg: ModelConfig) -> np.ndarray:
    """Layer 0 in f32 from the weights (pure jnp): routing as `route`, each row's expert MLP."""
    k, F = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    t = slots.shape[0]
    f32 = jnp.float32
    hf = h[:t].astype(f32)
    hi = lax.Precision.HIGHEST  # no TF32 passes: the reference is f32
    logits = jnp.dot(hf, ffn["router"][0].astype(f32), precision=hi)
    w, ids = route(logits, k, cfg.norm_topk_prob)
    w = w.astype(h.dtype).astype(f32)
    rows = jnp.repeat(hf, k, axis=0)
    e = ids.reshape(-1)
    g = jnp.einsum("rd,rdf->rf", rows, ffn["expert_gate"][0, e, :, :F].astype(f32), precision=hi)
    u = jnp.einsum("rd,rdf->rf", rows, ffn["expert_up"][0, e, :, :F].astype(f32), precision=hi)
    a = jax.nn.silu(g) * u
    y = jnp.einsum("rf,rfd->rd", a, ffn["expert_down"][0, e, :F, :].astype(f32), precision=hi)
    out = jnp.sum(w[:, :, None] * y.reshape(t, k, -1), axis=1)
    return np.asarray(jnp.where((slots >= 0)[:, None], out, 0.0))


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float32) - ref).max() / max(np.abs(ref).max(), 1e-30))


# -- the kernels alone -----------------------------------------------------------------------------
def layouts(cfg, ffn, h, slots, layers: int) -> list:
    """Each layer's grouped layout ("tp" routing of h; padding rows, slot -1, left out)."""
    tp = Ops(invariance="tp")
    k, t = cfg.num_experts_per_tok, slots.shape[0]

    @jax.jit
    def run(ffn, h, slots):
        out = []
        for i in range(layers):
            logits = tp.matmul(h, ffn["router"][i], out_dtype=jnp.float32)[:t]
            _, ids = route(logits, k, cfg.norm_topk_prob)
            ids = jnp.where((slots >= 0)[:, None], ids, cfg.num_experts)
            out.append(tp.grouped_tiles(ids.reshape(-1), cfg.num_experts))
        return out

    return run(ffn, h, slots)


def _kernel_rows(cfg, ffn, h, slots, t_real: int, stages: list[int], layers: int) -> list[dict]:
    """tp-new's gate|up and down launches over every layer (the layouts computed first)."""
    k, D, F = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    t = slots.shape[0]
    tiles = layouts(cfg, ffn, h, slots, layers)
    distinct = float(np.mean([len(set(np.asarray(gl.row_groups(tl)).tolist()) - {-1})
                              for tl in tiles]))  # fmt: skip
    lw = [jnp.int32(i).reshape(1) for i in range(layers)]
    act = jnp.asarray(np.random.default_rng(0).standard_normal((t * k, ffn_padded(F, h.dtype))),
                      h.dtype)  # fmt: skip
    plan = tree_plan(act.shape[1], act.dtype)

    def gate_up(ffn, h, stage):
        return [gm._grouped_pallas(h, (ffn["expert_gate"], ffn["expert_up"]), lw[i],
                                   tl.tile_group, tl.slot_row, tl.row_slot, per_src=k,
                                   leaf_k=D, num_leaves=1, out_dtype=h.dtype, live_n=F,
                                   num_stages=stage)
                for i, tl in enumerate(tiles)]  # fmt: skip

    def down(ffn, act, stage):
        return [gm._grouped_pallas(act, (ffn["expert_down"],), lw[i], tl.tile_group, tl.slot_row,
                                   tl.row_slot, per_src=1, leaf_k=plan.leaf_k,
                                   num_leaves=plan.num_leaves, out_dtype=jnp.float32, live_k=F,
                                   num_stages=stage)
                for i, tl in enumerate(tiles)]  # fmt: skip

    from pallas_kernels.grouped_slots import grouped_pallas_slots

    def gate_up_slots(ffn, h, stage):  # the slot-order kernel, its copies in and out included
        return [tuple(gl.scatter_rows(o, tl) for o in grouped_pallas_slots(
            gl.gather_rows(h, tl, k), (ffn["expert_gate"], ffn["expert_up"]), lw[i],
            tl.tile_group, leaf_k=D, num_leaves=1, out_dtype=h.dtype, live_n=F,
            num_stages=stage)) for i, tl in enumerate(tiles)]  # fmt: skip

    def down_slots(ffn, act, stage):
        return [tuple(gl.scatter_rows(o, tl) for o in grouped_pallas_slots(
            gl.gather_rows(act, tl), (ffn["expert_down"],), lw[i], tl.tile_group,
            leaf_k=plan.leaf_k, num_leaves=plan.num_leaves, out_dtype=jnp.float32, live_k=F,
            num_stages=stage)) for i, tl in enumerate(tiles)]  # fmt: skip

    expert_bytes = D * F * 2  # one projection of one expert, its live part, bf16
    rows, base = [], {}
    for name, fn, arg, nproj in (("gate_up", gate_up, h, 2), ("down", down, act, 1),
                                 ("gate_up_slots", gate_up_slots, h, 2),
                                 ("down_slots", down_slots, act, 1)):  # fmt: skip
        for stage in [None, *stages]:
            row = {"kernel": name, "num_stages": stage or "default", "t_real": t_real,
                   "experts_per_layer": distinct}  # fmt: skip
            try:
                f = jax.jit(functools.partial(fn, stage=stage))
                out = jax.block_until_ready(f(ffn, arg))
                s = median_seconds(f, ffn, arg, iters=10, reps=5, warmup=1) / layers
                gbs = distinct * nproj * expert_bytes / s / 1e9
                row.update(us_per_layer=s * 1e6, live_expert_GBps=gbs)
                bits = np.concatenate([np.asarray(o[0].astype(jnp.float32)).ravel() for o in out])
                if stage is None and name.endswith("_slots"):  # the row-order kernel's bits
                    row["bits_equal_row_order"] = bool(np.array_equal(bits, base[name[:-6]]))
                if stage is None:
                    base[name] = bits
                else:
                    row["bits_equal_default"] = bool(np.array_equal(bits, base[name]))
            except Exception:  # noqa: BLE001 - a depth Triton cannot compile: keep the others
                row["error"] = traceback.format_exc()[-1500:]
            rows.append(row)
    return rows


# -- the run ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stages", default="2,4", help="num_stages to time the kernels at ('' none)")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape, 2 layers, cases (1, 1) and (16, 1)")
    a = p.parse_args(argv)
    if a.smoke:
        a.shape = "tiny-moe"
    cases = CASES[:2] if a.smoke else CASES
    layers = 2 if a.smoke else a.layers
    stages = [int(s) for s in a.stages.split(",") if s]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    res: dict[str, Any] = {"device": dev.device_kind, "jax": jax.__version__, "layers": layers,
                           "shape": a.shape, "rows": []}  # fmt: skip

    def save() -> None:
        (out / "moe_layer_probe.json").write_text(json.dumps(res, indent=2))

    def say(row: dict) -> None:
        res["rows"].append(row)
        save()
        print(json.dumps(row), flush=True)

    t0 = time.perf_counter()
    cfg = _config(a.shape, layers)
    tp_f = ffn_padded(cfg.moe_intermediate_size, jnp.bfloat16)
    weights = {"tp": _weights(cfg, tp_f, 0)}
    # "none" holds the model's own width; the same values
    weights["none"] = {n: (w if n == "router" else
                           w[..., :cfg.moe_intermediate_size] if n != "expert_down" else
                           w[..., :cfg.moe_intermediate_size, :])
                       for n, w in weights["tp"].items()}  # fmt: skip
    jax.block_until_ready(weights)
    print(f"weights: {time.perf_counter() - t0:.1f} s", flush=True)
    variants = _variants(cfg)
    tp_rows = Ops(invariance="tp").row_pad
    for bucket, real in cases:
        key = jax.random.PRNGKey(bucket * 100 + real)
        slots = jnp.where(jnp.arange(bucket) < real, jnp.arange(bucket), -1).astype(jnp.int32)
        h_tp = jax.random.normal(key, (tp_rows(bucket), cfg.hidden_size), jnp.bfloat16)
        h = {"tp": h_tp, "none": h_tp[:bucket]}
        line = {"tokens": bucket, "real": real, "rows_carried_tp": int(h_tp.shape[0])}
        ref = None
        try:
            ref = _reference(weights["tp"], h_tp, slots, cfg) if real <= 32 else None
        except Exception:  # noqa: BLE001 - the timings stand without it
            line["reference_error"] = traceback.format_exc()[-1500:]
        outs: dict[str, np.ndarray] = {}
        for name, (fn, mode) in variants.items():
            try:
                t1 = time.perf_counter()
                o = jax.block_until_ready(fn(weights[mode], h[mode], slots))
                compile_s = time.perf_counter() - t1
                s = median_seconds(fn, weights[mode], h[mode], slots, iters=10, reps=5)
                outs[name] = np.asarray(o.astype(jnp.float32))
                line[f"{name}_us_per_layer"] = s / layers * 1e6
                line[f"{name}_first_call_s"] = compile_s
                if ref is not None:
                    line[f"{name}_rel_err_layer0"] = _rel_err(outs[name][0, :bucket], ref)
            except Exception:  # noqa: BLE001 - keep the other variants
                line[f"{name}_error"] = traceback.format_exc()[-2000:]
        if "tp-new" in outs and "tp-old" in outs:
            line["tp_new_equals_old_bitwise"] = bool(np.array_equal(outs["tp-new"],
                                                                    outs["tp-old"]))  # fmt: skip
            line["tp_rows_past_real_zero"] = bool(not outs["tp-new"][:, real:].any())
        for v in ("tp", "none"):
            if f"{v}-old_us_per_layer" in line and f"{v}-new_us_per_layer" in line:
                line[f"{v}_old_over_new"] = (line[f"{v}-old_us_per_layer"]
                                             / line[f"{v}-new_us_per_layer"])  # fmt: skip
        say(line)
        if bucket in (1, 64) and not a.smoke or a.smoke and bucket == 1:
            try:
                for row in _kernel_rows(cfg, weights["tp"], h_tp, slots, real, stages, layers):
                    say({"tokens": bucket, **row})
            except Exception:  # noqa: BLE001 - keep the cases after it
                say({"tokens": bucket, "kernel": "all", "error": traceback.format_exc()[-2000:]})
    print(f"total: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
