"""The PyTorch bar for batch-1 decode: a gpt-fast-style Llama with a static KV cache, timed eager
and under `torch.compile(mode="reduce-overhead")` (CUDA graphs), on the same shapes as
`benchmarks.decode_bench`. Prints one JSON line per mode and writes `torch_decode.json`.

Why a separate process: JAX preallocates most of the GPU, and timing two frameworks at once would
interfere. `decode_bench` runs this first, then itself, so both are measured on one machine in one
run. The model follows gpt-fast's `model.py` (fused wqkv and w1/w3 stay separate as there, SDPA
with an explicit causal-mask row, RoPE on interleaved-free halves as HF Llama, a static
[B, K, S_max, E] cache updated by `index_copy_`); random bf16 weights (std 0.02).

    python -m benchmarks.torch_decode --shape llama3-8b --ctx 1024 --out out
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# (layers, D, F, H, K, E, V, rope_theta): the HF configs of these models.
SHAPES = {
    "llama3-8b": (32, 4096, 14336, 32, 8, 128, 128256, 500000.0),
    "qwen3-8b": (36, 4096, 12288, 32, 8, 128, 151936, 1000000.0),
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151936, 1000000.0),
}


def build(shape: str, max_seq: int):  # noqa: ANN201 - torch types
    import torch
    from torch import nn
    from torch.nn import functional as F

    L, D, Fd, H, K, E, V, theta = SHAPES[shape]

    class RMSNorm(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):  # noqa: ANN001, ANN202
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
            return y.type_as(x) * self.weight

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wqkv = nn.Linear(D, (H + 2 * K) * E, bias=False)
            self.wo = nn.Linear(H * E, D, bias=False)
            self.w1 = nn.Linear(D, Fd, bias=False)
            self.w3 = nn.Linear(D, Fd, bias=False)
            self.w2 = nn.Linear(Fd, D, bias=False)
            self.n1, self.n2 = RMSNorm(D), RMSNorm(D)
            self.register_buffer("k_cache", torch.zeros(1, K, max_seq, E))
            self.register_buffer("v_cache", torch.zeros(1, K, max_seq, E))

        def forward(self, x, cos, sin, mask, pos):  # noqa: ANN001, ANN202
            b, t, _ = x.shape
            q, k, v = self.wqkv(self.n1(x)).split([H * E, K * E, K * E], dim=-1)
            q = q.view(b, t, H, E).transpose(1, 2)
            k = k.view(b, t, K, E).transpose(1, 2)
            v = v.view(b, t, K, E).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v)
            y = F.scaled_dot_product_attention(
                q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True
            )
            x = x + self.wo(y.transpose(1, 2).reshape(b, t, H * E))
            h = self.n2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def rope(x, cos, sin):  # noqa: ANN001, ANN202
        xf = x.float()
        half = E // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rot * sin).type_as(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(V, D)
            self.layers = nn.ModuleList([Block() for _ in range(L)])
            self.norm = RMSNorm(D)
            self.out = nn.Linear(D, V, bias=False)
            inv = 1.0 / theta ** (torch.arange(0, E, 2, dtype=torch.float32) / E)
            f = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv)
            emb = torch.cat([f, f], dim=-1)
            self.register_buffer("cos", emb.cos())
            self.register_buffer("sin", emb.sin())
            causal = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool))
            self.register_buffer("causal", causal)

        def forward(self, idx, pos):  # noqa: ANN001, ANN202
            x = self.embed(idx)
            cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
            mask = self.causal[None, None, pos]
            for blk in self.layers:
                x = blk(x, cos, sin, mask, pos)
            return self.out(self.norm(x)).float()

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        m = Model()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    return m.eval()


def run(shape: str, ctx: int, steps: int, modes: list[str]) -> list[dict]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    L, D, Fd, H, K, E, V, _ = SHAPES[shape]
    max_seq = ctx + steps + 64
    model = build(shape, max_seq)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed.weight.numel() * model.embed.weight.element_size()
    kv_bytes = 2 * L * K * E * 2 * ctx  # K and V, bf16, the context read once
    rows = []

    def decode_one(idx, pos):  # noqa: ANN001, ANN202
        logits = model(idx, pos)
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True)

    for mode in modes:
        fn = decode_one
        if mode == "compile":
            compiled = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)

            def fn(idx, pos, compiled=compiled):  # noqa: ANN001, ANN202
                # each call replays the CUDA graph into the same output buffer: copy it out
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(idx, pos).clone()

        row = {"framework": "torch", "torch": torch.__version__, "shape": shape, "mode": mode,
               "batch": 1, "ctx": ctx, "bytes_per_step": weight_bytes + kv_bytes}  # fmt: skip
        try:
            with torch.no_grad():
                prompt = torch.randint(1, V, (1, ctx), device="cuda")
                pos = torch.arange(ctx, device="cuda")
                model(prompt, pos)  # prefill (eager), fills the cache
                tok = torch.randint(1, V, (1, 1), device="cuda")
                t_compile = time.perf_counter()
                warm = 5 if mode == "compile" else 2
                for i in range(warm):
                    tok = fn(tok, torch.tensor([ctx + i], device="cuda"))
                torch.cuda.synchronize()
                row["warmup_s"] = time.perf_counter() - t_compile
                n = steps if mode == "compile" else max(10, steps // 5)
                times = []
                for i in range(n):
                    p = torch.tensor([ctx + warm + i], device="cuda")
                    t0 = time.perf_counter()
                    tok = fn(tok, p)
                    torch.cuda.synchronize()  # the token must reach the host, as in generation
                    times.append(time.perf_counter() - t0)
            times.sort()
            step = times[len(times) // 2]
            row.update(step_s=step, tok_per_s=1 / step, GBps=row["bytes_per_step"] / step / 1e9)
            # gpt-fast's own habit: the steps queued back to back, one sync at the end
            with torch.no_grad():
                t0 = time.perf_counter()
                for i in range(n):
                    tok = fn(tok, torch.tensor([ctx + warm + i], device="cuda"))
                torch.cuda.synchronize()
            row["pipelined_step_s"] = (time.perf_counter() - t0) / n
        except Exception as e:  # noqa: BLE001 - report why the bar is missing, keep the run
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args(argv)
    rows = run(a.shape, a.ctx, a.steps, a.modes.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"torch_decode_{a.shape}_{a.ctx}.json"
    path.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
