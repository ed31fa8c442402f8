"""Train jdet's embedded default model: a small Qwen3-architecture LM on the stdlib's docstrings.

Pipeline (reproducible from the fixed seed; JAX + optax only, no PyTorch):
  1. `examples/make_corpus.py` builds the corpus (stdlib docstrings + pydoc topics, every 20th
     document held out) and the byte-level BPE tokenizer (vocab 8192) *on the machine that runs it*.
     The shipped model's corpus and tokenizer were built on the CPU box (CPython 3.11.7) and carried
     to the GPU machine as `build/tiny/*.npy`; only the training ran on the GPU.
  2. This script trains the model with its own JAX forward of the Qwen3 architecture (dense causal
     attention, q/k RMSNorm over the head dim, rotate-half RoPE exactly as HF, RMSNorm in f32 as HF,
     SwiGLU MLP, tied embeddings), AdamW with linear warmup + cosine decay, bf16 matmuls with f32
     master weights, residual dropout (the corpus is small: ~0.6M tokens, so training runs many
     epochs and keeps the checkpoint with the lowest held-out loss).
  3. It exports Hugging Face format: config.json, generation_config.json, model.safetensors (bf16,
     HF tensor names, torch [out, in] layout), training_log.json and loss_curve.png.

The export is checked by `tests/jdet/test_default_model.py`: a tiny random config exported by
`export()` loads in transformers' AutoModelForCausalLM and its f32 logits match `forward()` here.

Usage:
  python examples/make_corpus.py --out build/tiny --model-dir jdet/default_model
  python examples/train_tiny.py --data build/tiny --out jdet/default_model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EOT_ID = 0  # make_corpus.py trains the tokenizer with <|endoftext|>, <|im_start|>, <|im_end|> first
IM_END_ID = 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The Qwen3 hyperparameters; D = hidden, H/K query/kv heads, E head dim, F ffn dim."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 5
    num_heads: int = 8
    num_kv_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1024


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    seq_len: int = 512
    batch_size: int = 32
    steps: int = 900
    warmup_steps: int = 100
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    dropout: float = 0.3
    grad_clip: float = 1.0
    eval_every: int = 25
    time_limit_s: float = 330.0  # safety stop on the device; the log records if it triggered


# Every weight, in one place: name -> (shape, HF name with {i} for the layer, transpose for HF).
# JAX layout is [in, out] (x @ w); HF/torch Linear stores [out, in].
def weight_spec(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    d, h, k, e, f = (
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    return {
        "embed": ((cfg.vocab_size, d), "model.embed_tokens.weight", False),
        "final_norm": ((d,), "model.norm.weight", False),
        "attn_norm": ((d,), "model.layers.{i}.input_layernorm.weight", False),
        "wq": ((d, h * e), "model.layers.{i}.self_attn.q_proj.weight", True),
        "wk": ((d, k * e), "model.layers.{i}.self_attn.k_proj.weight", True),
        "wv": ((d, k * e), "model.layers.{i}.self_attn.v_proj.weight", True),
        "q_norm": ((e,), "model.layers.{i}.self_attn.q_norm.weight", False),
        "k_norm": ((e,), "model.layers.{i}.self_attn.k_norm.weight", False),
        "wo": ((h * e, d), "model.layers.{i}.self_attn.o_proj.weight", True),
        "mlp_norm": ((d,), "model.layers.{i}.post_attention_layernorm.weight", False),
        "w_gate": ((d, f), "model.layers.{i}.mlp.gate_proj.weight", True),
        "w_up": ((d, f), "model.layers.{i}.mlp.up_proj.weight", True),
        "w_down": ((f, d), "model.layers.{i}.mlp.down_proj.weight", True),
    }


GLOBAL_WEIGHTS = ("embed", "final_norm")


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """HF-style init: normal(0.02) matrices, ones for norms; per-layer leaves stacked on axis 0."""
    params: dict = {"layers": {}}
    for idx, (name, (shape, _, _)) in enumerate(sorted(weight_spec(cfg).items())):
        sub = jax.random.fold_in(key, idx)
        full = shape if name in GLOBAL_WEIGHTS else (cfg.num_layers, *shape)
        if name.endswith("norm"):
            leaf = jnp.ones(full, jnp.float32)
        else:
            leaf = 0.02 * jax.random.normal(sub, full, jnp.float32)
        if name in GLOBAL_WEIGHTS:
            params[name] = leaf
        else:
            params["layers"][name] = leaf
    return params


def param_count(params: dict) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """As HF Qwen3RMSNorm: normalise in f32, cast back, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * xf.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE as HF: cos/sin of cat(freqs, freqs); x*cos + rotate_half(x)*sin.

    x: [B, T, N, E]; positions: [B, T].
    """
    e = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, E/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : e // 2], x[..., e // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    *,
    dtype=jnp.float32,
    dropout: float = 0.0,
    key: jax.Array | None = None,
) -> jax.Array:
    """tokens [B, T] -> logits f32 [B, T, V]. Dense causal attention; dropout only in training."""
    b, t = tokens.shape
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = h // k
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    eps = cfg.rms_norm_eps

    def drop(x: jax.Array, sub: jax.Array | None) -> jax.Array:
        if dropout == 0.0 or sub is None:
            return x
        keep = jax.random.bernoulli(sub, 1.0 - dropout, x.shape)
        return jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)

    x = params["embed"].astype(dtype)[tokens]  # [B, T, D]

    def layer(x: jax.Array, scan_in: tuple) -> tuple[jax.Array, None]:
        lp, lkey = scan_in
        lp = jax.tree_util.tree_map(lambda w: w.astype(dtype), lp)
        k1 = k2 = None
        if lkey is not None:
            k1, k2 = jax.random.split(lkey)
        hn = rms_norm(x, lp["attn_norm"], eps)
        q = jnp.einsum("BTD,DX->BTX", hn, lp["wq"]).reshape(b, t, h, e)
        kk = jnp.einsum("BTD,DX->BTX", hn, lp["wk"]).reshape(b, t, k, e)
        v = jnp.einsum("BTD,DX->BTX", hn, lp["wv"]).reshape(b, t, k, e)
        q = rope(rms_norm(q, lp["q_norm"], eps), positions, cfg.rope_theta)
        kk = rope(rms_norm(kk, lp["k_norm"], eps), positions, cfg.rope_theta)
        q = q.reshape(b, t, k, g, e)
        s = jnp.einsum("BTKGE,BSKE->BKGTS", q, kk).astype(jnp.float32) / math.sqrt(e)
        s = jnp.where(causal, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(dtype)
        o = jnp.einsum("BKGTS,BSKE->BTKGE", p, v).reshape(b, t, h * e)
        x = x + drop(jnp.einsum("BTX,XD->BTD", o, lp["wo"]), k1)
        hn = rms_norm(x, lp["mlp_norm"], eps)
        gate = jnp.einsum("BTD,DF->BTF", hn, lp["w_gate"])
        up = jnp.einsum("BTD,DF->BTF", hn, lp["w_up"])
        mlp = jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, lp["w_down"])
        x = x + drop(mlp, k2)
        return x, None

    keys = None if key is None or dropout == 0.0 else jax.random.split(key, cfg.num_layers)
    x, _ = jax.lax.scan(layer, x, (params["layers"], keys))
    x = rms_norm(x, params["final_norm"].astype(dtype), eps)
    return jnp.einsum("BTD,VD->BTV", x, params["embed"].astype(dtype)).astype(jnp.float32)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token negative log-likelihood (nats)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ---------------------------------------------------------------------------------------------
# Export to Hugging Face format


def hf_config(cfg: ModelConfig) -> dict:
    """A complete Qwen3Config as config.json (rope_theta both legacy and as rope_parameters)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": EOT_ID,
        "eos_token_id": EOT_ID,
        "pad_token_id": EOT_ID,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": cfg.vocab_size,
    }


def hf_tensors(params: dict, cfg: ModelConfig, dtype=jnp.bfloat16) -> dict[str, np.ndarray]:
    """HF-named tensors (torch [out, in] layout for Linear weights)."""
    out: dict[str, np.ndarray] = {}
    for name, (_, hf_name, transpose) in weight_spec(cfg).items():
        if name in GLOBAL_WEIGHTS:
            out[hf_name] = np.asarray(jnp.asarray(params[name], dtype))
            continue
        for i in range(cfg.num_layers):
            w = jnp.asarray(params["layers"][name][i], dtype)
            out[hf_name.format(i=i)] = np.ascontiguousarray(np.asarray(w.T if transpose else w))
    return out


def export(params: dict, cfg: ModelConfig, out_dir: Path, dtype=jnp.bfloat16) -> None:
    """Write config.json, generation_config.json and model.safetensors into out_dir."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg)
    if dtype != jnp.bfloat16:
        config["torch_dtype"] = config["dtype"] = jnp.dtype(dtype).name
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {
        "bos_token_id": EOT_ID,
        "eos_token_id": [EOT_ID, IM_END_ID],
        "pad_token_id": EOT_ID,
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(
        hf_tensors(params, cfg, dtype),
        str(out_dir / "model.safetensors"),
        {"format": "pt"},
    )


# ---------------------------------------------------------------------------------------------
# Training


def lr_schedule(tc: TrainConfig):
    import optax

    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tc.lr,
        warmup_steps=tc.warmup_steps,
        decay_steps=tc.steps,
        end_value=tc.lr * tc.min_lr_ratio,
    )


def make_optimizer(tc: TrainConfig):
    import optax

    def decay_mask(params: dict) -> dict:
        # No weight decay on norm weights (they are gains around 1).
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not str(path[-1].key).endswith("norm"), params
        )

    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.adamw(
            lr_schedule(tc),
            b1=0.9,
            b2=0.95,
            weight_decay=tc.weight_decay,
            mask=decay_mask,
        ),
    )


def windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping [N, seq_len + 1] windows (inputs and shifted targets) covering ids."""
    n = (ids.size - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return ids[idx].astype(np.int32)


def train(data_dir: Path, out_dir: Path, cfg: ModelConfig, tc: TrainConfig) -> dict:
    import optax

    t_start = time.time()
    train_ids = np.load(data_dir / "train_ids.npy").astype(np.int32)
    heldout_ids = np.load(data_dir / "heldout_ids.npy").astype(np.int32)
    heldout = windows(heldout_ids, tc.seq_len)
    train_probe = windows(train_ids, tc.seq_len)[:: max(1, train_ids.size // tc.seq_len // 64)]
    rng = np.random.default_rng(tc.seed)

    key = jax.random.PRNGKey(tc.seed)
    params = init_params(cfg, jax.random.fold_in(key, 1))
    n_params = param_count(params)
    opt = make_optimizer(tc)
    opt_state = opt.init(params)
    sched = lr_schedule(tc)

    @jax.jit
    def step(params, opt_state, batch, step_key):
        def loss_fn(p):
            logits = forward(
                p,
                cfg,
                batch[:, :-1],
                dtype=jnp.bfloat16,
                dropout=tc.dropout,
                key=step_key,
            )
            return token_nll(logits, batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            loss,
            optax.global_norm(grads),
        )

    @jax.jit
    def eval_loss(params, batch):
        logits = forward(params, cfg, batch[:, :-1], dtype=jnp.bfloat16)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))

    def mean_loss(params, data: np.ndarray) -> float:
        total, count = 0.0, 0
        for i in range(0, len(data), tc.batch_size):
            chunk = data[i : i + tc.batch_size]
            total += float(eval_loss(params, jnp.asarray(chunk)))
            count += chunk.shape[0] * (chunk.shape[1] - 1)
        return total / count

    log: list[dict] = []
    best = {"heldout_loss": float("inf"), "step": -1}
    best_params = params
    recent: list[float] = []
    stopped_early = False
    t_train = time.time()
    for s in range(1, tc.steps + 1):
        starts = rng.integers(0, train_ids.size - tc.seq_len - 1, size=tc.batch_size)
        batch = train_ids[starts[:, None] + np.arange(tc.seq_len + 1)[None, :]]
        params, opt_state, loss, gnorm = step(
            params, opt_state, jnp.asarray(batch), jax.random.fold_in(key, 1000 + s)
        )
        recent.append(float(loss))
        if s % tc.eval_every == 0 or s == tc.steps:
            held = mean_loss(params, heldout)
            probe = mean_loss(params, train_probe)
            entry = {
                "step": s,
                "tokens_seen": s * tc.batch_size * tc.seq_len,
                "epochs": s * tc.batch_size * tc.seq_len / train_ids.size,
                "lr": float(sched(s)),
                "train_loss": float(np.mean(recent)),
                "train_eval_loss": probe,
                "heldout_loss": held,
                "grad_norm": float(gnorm),
                "elapsed_s": time.time() - t_train,
            }
            recent = []
            log.append(entry)
            print(json.dumps(entry), flush=True)
            if held < best["heldout_loss"]:
                best = {"heldout_loss": held, "train_eval_loss": probe, "step": s}
                best_params = jax.tree_util.tree_map(jnp.copy, params)
            if time.time() - t_start > tc.time_limit_s:
                stopped_early = True
                break
    train_time = time.time() - t_train

    export(best_params, cfg, out_dir)
    summary = {
        "model": dataclasses.asdict(cfg),
        "train": dataclasses.asdict(tc),
        "params": n_params,
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        "best": best,
        "final": log[-1],
        "uniform_baseline_nats": math.log(cfg.vocab_size),
        "train_time_s": train_time,
        "total_time_s": time.time() - t_start,
        "stopped_early_by_time_limit": stopped_early,
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "log": log,
    }
    (out_dir / "training_log.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(log, best, out_dir / "loss_curve.png", math.log(cfg.vocab_size))
    return summary


def plot(log: list[dict], best: dict, path: Path, uniform: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in log]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    ax.plot(steps, [e["train_loss"] for e in log], label="train (batch mean, dropout on)")
    ax.plot(steps, [e["train_eval_loss"] for e in log], label="train sample (eval)")
    ax.plot(steps, [e["heldout_loss"] for e in log], label="held-out (every 20th doc)")
    ax.axvline(best["step"], color="gray", ls=":", label=f"exported: step {best['step']}")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(f"jdet default model (uniform baseline ln V = {uniform:.2f})")
    ax.set_ylim(0, min(uniform + 0.5, max(e["train_loss"] for e in log) + 0.5))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("build/tiny"))
    ap.add_argument("--out", type=Path, default=Path("jdet/default_model"))
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    ap.add_argument("--time-limit", type=float, default=TrainConfig.time_limit_s)
    ap.add_argument("--dropout", type=float, default=TrainConfig.dropout)
    ap.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="XLA deterministic GPU ops (the embedding gradient is a scatter-add)",
    )
    args = ap.parse_args()
    if args.deterministic:  # read when the backend starts, i.e. at the first computation below
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()
    tc = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        warmup_steps=min(TrainConfig.warmup_steps, max(1, args.steps // 10)),
        time_limit_s=args.time_limit,
        dropout=args.dropout,
    )
    summary = train(args.data, args.out, ModelConfig(), tc)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=2))


if __name__ == "__main__":
    main()
