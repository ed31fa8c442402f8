"""A mixture-of-experts layer's working memory follows its tokens, not its experts' weights: the
GPU path traced on the CPU (the platform faked, nothing compiled) at the Qwen3-30B-A3B shape.

Why traced: on a GPU the grouped kernel is a Triton call, which takes whole buffers, and XLA
rewrites "none"'s `ragged_dot` into a dense dot over every expert; a layer's expert weights
handed over as an array [E, D, F] are then a copy of every expert, and with the layers unrolled
XLA may hold all layers' copies at once (a 16-token decode step asked for 71 GiB). The jaxpr
shows every array a step makes, so the bound below is checked without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

from jdet.config import ModelConfig
from jdet.moe import ffn_forward
from jdet.ops import Ops
from pallas_kernels import _platform
from pallas_kernels import grouped_layout as gl
from pallas_kernels import grouped_matmul as gm

# Qwen3-30B-A3B's MoE block; 4 of its 48 layers (the stacks' depth does not enter the bound)
SHAPE = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=2048, intermediate_size=6144,
             num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             norm_topk_prob=True)  # fmt: skip
F_PADDED = 1024  # the "tp" layout's expert width (jdet/plan.py pad_params)


@pytest.fixture
def gpu(monkeypatch):
    """The Triton GPU backend, as a GPU process would pick it (nothing runs: trace only)."""
    monkeypatch.delenv(_platform.INTERPRET_ENV, raising=False)
    monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    monkeypatch.setattr(_platform, "is_hopper", lambda: False)
    monkeypatch.setattr(_platform, "interpret_default", lambda: False)


def _arrays(jaxpr) -> list:
    """Every array the jaxpr (and the jaxprs inside it: jit, loops, shard_map, pallas_call's
    operands) makes."""
    return [v.aval for e in _all_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")]


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize


def _trace_layer(mode: str, f: int, tokens: int = 16):
    cfg = ModelConfig.from_hf(SHAPE)
    L, D, E = cfg.num_layers, cfg.hidden_size, cfg.num_experts
    bf = jnp.bfloat16
    ffn = {"router": jax.ShapeDtypeStruct((L, D, E), bf),
           "expert_gate": jax.ShapeDtypeStruct((L, E, D, f), bf),
           "expert_up": jax.ShapeDtypeStruct((L, E, D, f), bf),
           "expert_down": jax.ShapeDtypeStruct((L, E, f, D), bf)}  # fmt: skip
    h = jax.ShapeDtypeStruct((tokens, D), bf)
    slots = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    ops = Ops(invariance=mode)

    def layer(ffn, h, slots):
        return ffn_forward(ffn, h, jnp.int32(1), cfg, ops, slots)

    return cfg, ffn, jax.make_jaxpr(layer)(ffn, h, slots).jaxpr


@pytest.mark.parametrize("mode", ["tp", "batch", "none"])
def test_moe_layer_arrays_scale_with_tokens_not_expert_weights(gpu, mode):
    f = F_PADDED if mode == "tp" else SHAPE["moe_intermediate_size"]
    cfg, ffn, jaxpr = _trace_layer(mode, f)
    t, k = 16, cfg.num_experts_per_tok
    bm = gm.tile_rows()
    # the grouped layout's slots (each of the k*T rows, and up to one partial tile per expert)
    # times the widest row (D or F) in f32: what a 16-token layer may hold, experts aside
    slots = gl.num_tiles(t * k, cfg.num_experts, bm) * bm
    bound = slots * max(cfg.hidden_size, f) * 4
    one_layer_experts = _nbytes(ffn["expert_gate"]) // cfg.num_layers  # [E, D, F] bf16
    assert bound < one_layer_experts // 4  # the bound tells the two apart
    arrays = _arrays(jaxpr)
    made = [a for a in arrays if _nbytes(a) > bound]
    assert not made, f"arrays past {bound / 2**20:.0f} MiB: {[a.str_short() for a in made]}"
    # and no values in the layout's slots: the kernels gather and scatter rows themselves, so
    # a float array holds at most the k*T rows (gate|up in f32, or the down projection's f32
    # subtrees side by side where its launch splits the leaves: grouped_launch), or the
    # router's weight
    from pallas_kernels import grouped_launch

    ks = max([1] + [launch.k_split for _, launch in grouped_launch.DEFAULTS["tree"]])
    rows = t * k * max(ks * cfg.hidden_size, 2 * f) * 4
    assert rows < slots * cfg.hidden_size * 4 // 4  # still far below the slots' values
    floats = [a for a in arrays if jnp.issubdtype(a.dtype, jnp.floating) and _nbytes(a) > rows]
    assert not floats, f"past {rows / 2**20:.1f} MiB: {[a.str_short() for a in floats]}"


def _forward_jaxpr(ops):
    from jdet.batch import StepBatch
    from jdet.model import forward
    from jdet.params import abstract_params

    cfg = ModelConfig.from_hf({**SHAPE, "num_hidden_layers": 2, "hidden_size": 256,
                               "num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64})  # fmt: skip
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    batch = StepBatch(i32(4), i32(4), i32(4), i32(2), i32(1), i32(1, 4), i32(1))  # a decode
    kv = {n: jax.ShapeDtypeStruct((2, 2, 16, 16, 64), jnp.bfloat16) for n in "kv"}
    step = lambda p, kv, b: forward(p, cfg, kv, b, ops)  # noqa: E731
    return jax.make_jaxpr(step)(abstract_params(cfg), kv, batch).jaxpr


def test_none_mode_moe_layers_read_the_experts_in_place_unrolled_on_a_gpu(gpu):
    """"none" on a GPU runs the grouped Pallas kernels (gate|up in one launch), which read the
    chosen experts in place, so its layers unroll as the invariant modes' do (jdet/model.py):
    no `ragged_dot` (a dense dot over every expert there), no layer loop."""
    jaxpr = _forward_jaxpr(Ops(invariance="none"))
    names = [e.primitive.name for e in _all_eqns(jaxpr)]
    assert "ragged_dot_general" not in names
    kernels = [e.params.get("name") for e in _all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
    assert "grouped_matmul_pair" in str(kernels), kernels
    assert not [e for e in jaxpr.eqns if e.primitive.name in ("scan", "while")]


def test_train_ops_keep_ragged_dot_in_a_layer_loop_on_a_gpu(gpu):
    """jdet.train's "none" forward (differentiable) keeps `ragged_dot`, which XLA on a GPU turns
    into a dense dot over every expert (its layer's weights as an array, the rows masked per
    expert): in a loop only one layer's are alive, so those layers are not unrolled."""
    from jdet.train import _XlaOps

    jaxpr = _forward_jaxpr(_XlaOps("none"))
    loops = [e for e in _all_eqns(jaxpr) if e.primitive.name in ("scan", "while")]
    inside = [e for loop in loops for e in _all_eqns(_body(loop))]
    ragged = [e for e in _all_eqns(jaxpr) if e.primitive.name == "ragged_dot_general"]
    assert ragged and all(any(e is r for e in inside) for r in ragged)


def _all_eqns(jaxpr) -> list:
    """Every equation of the jaxpr and of the jaxprs inside it."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for p in e.params.values():
            for s in p if isinstance(p, (list, tuple)) else [p]:
                if isinstance(s, jcore.ClosedJaxpr):
                    out += _all_eqns(s.jaxpr)
                elif isinstance(s, jcore.Jaxpr):
                    out += _all_eqns(s)
    return out


def _body(loop) -> jcore.Jaxpr:
    body = loop.params.get("jaxpr", loop.params.get("body_jaxpr"))
    return body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
