"""A tiny random Qwen3-style model shaped to exercise every tensor-parallel corner on CPU.

f32 weights (the tree kernel's block_k is 32): H*E = 8*128 = 1024 = 32 K tiles of o_proj (8
leaves), so every TP <= 8 shard is a whole subtree; F = 700 pads to 768 = 24 tiles (k_first = 3,
a non-power-of-two tile count); V = 301 does not divide by 8 (padded to 1024, sliced back); K = 2
kv heads, so TP 4 and 8 replicate kv heads; q/k/v and o biases and qk-norm are all on.
head_dim = 128 (as in real models) keeps every column-parallel shard >= 128 wide: the BIO
matmul's block_n is 128 there, while a narrower shard would get a narrower block_n, and on CPU
that changes the bits of a dot (pallas_kernels.matmul.tile_config picks block_n from N).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jdet.batch import build_batch
from jdet.config import ModelConfig
from jdet.params import init_params
from jdet.sampling import SamplingInputs
from sharding.mesh import make_tp_mesh
from sharding.tp import init_tp_kv_cache, make_tp_runtime, make_tp_step, shard_params

BASE = ModelConfig(
    model_type="qwen3",
    vocab_size=301,
    hidden_size=64,
    intermediate_size=700,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    qkv_bias=True,
    o_bias=True,
    qk_norm=True,
)
PAGE = 4


def tiny_cfg(**overrides) -> ModelConfig:
    return dataclasses.replace(BASE, **overrides)


def tiny_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.08, dtype=jnp.float32) -> dict:
    """Random f32 weights; norms and biases random too (never the ones/zeros of a fresh init)."""
    params = init_params(cfg, seed=seed, dtype=dtype, scale=scale)
    rng = np.random.default_rng(seed + 1)

    def jitter(a, base: float, s: float):
        return jnp.asarray(base + s * rng.standard_normal(a.shape), dtype)

    layers = dict(params["layers"])
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        layers[name] = jitter(layers[name], 1.0, 0.2)
    for name in ("bq", "bk", "bv", "bo"):
        if name in layers:
            layers[name] = jitter(layers[name], 0.0, 0.1)
    return {**params, "layers": layers, "final_norm": jitter(params["final_norm"], 1.0, 0.2)}


def prompts(cfg: ModelConfig, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]


def pages_for(num_tokens_per_seq: list[int], page: int = PAGE) -> list[list[int]]:
    """Disjoint page lists, deliberately not in order, so page tables are exercised."""
    out, nxt = [], 0
    for n in num_tokens_per_seq:
        k = -(-n // page)
        out.append(list(range(nxt + k - 1, nxt - 1, -1)))
        nxt += k
    return out


def batch(seqs, page: int = PAGE, **kw):
    return build_batch(seqs, page, **kw)[0]


def run_score(
    cfg, params, tp: int, mode: str, prompt_lens, dtype=jnp.float32, page: int = PAGE
) -> np.ndarray:
    """Teacher-forced log p(next token) of every prompt position, on `tp` devices."""
    toks = prompts(cfg, prompt_lens, seed=1)
    pages = pages_for([len(t) for t in toks], page)
    b = batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], page, logits="all")
    targets = np.concatenate([np.roll(t, -1) for t in toks]).astype(np.int32)
    rt = make_tp_runtime(params, cfg, tp, mode)
    kv = rt.init_kv(sum(map(len, pages)), page, dtype)
    _, lp = rt.score(rt.params, kv, b, targets)
    out = np.full(targets.shape, np.nan, np.float32)  # poison
    out[...] = np.asarray(lp)
    return out


def run_greedy(
    cfg,
    params,
    tp: int,
    mode: str,
    prompt_lens,
    decode_steps: int,
    dtype=jnp.float32,
    page: int = PAGE,
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill both prompts in one step, then decode_steps batched greedy decode steps."""
    mesh = make_tp_mesh(tp)
    step = make_tp_step(cfg, mode, mesh)
    sp = shard_params(params, cfg, mesh)
    toks = prompts(cfg, prompt_lens, seed=2)
    pages = pages_for([len(t) + decode_steps for t in toks], page)
    kv = init_tp_kv_cache(cfg, mesh, sum(map(len, pages)), page, dtype)
    n = len(toks)

    def greedy_inputs(positions):
        return SamplingInputs(
            temperature=np.zeros(n, np.float32),
            top_k=np.zeros(n, np.int32),
            top_p=np.ones(n, np.float32),
            seed=np.arange(n, dtype=np.uint32),
            position=np.asarray(positions, np.int32),
        )

    # one padded shape for prefill and decode: one compile per TP size
    pad = {"pad_tokens": sum(prompt_lens), "pad_pages": max(len(p) for p in pages)}
    b = batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], page, logits="last", **pad)
    pos = [len(t) for t in toks]
    kv, out = step(sp, kv, b, greedy_inputs(pos))
    tokens, logprobs = [np.asarray(out.tokens)], [np.asarray(out.logprobs)]
    for _ in range(decode_steps):
        last = tokens[-1]
        b = batch(
            [([int(last[i])], pos[i], pages[i]) for i in range(n)], page, logits="last", **pad
        )
        pos = [p + 1 for p in pos]
        kv, out = step(sp, kv, b, greedy_inputs(pos))
        tokens.append(np.asarray(out.tokens))
        logprobs.append(np.asarray(out.logprobs))
    return np.stack(tokens), np.stack(logprobs)
