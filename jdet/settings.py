"""The engine's and the server's settings, each written once, with their defaults and help text.

`EngineConfig` holds every setting of a serving engine (`jdet.LLM`, `serving.engine.engine.Engine`,
`jdet serve`); `ServerConfig` those of the HTTP server. The CLI's flags (jdet/cli.py) are generated
from these fields — name, type, default, choices and help — so a setting added here appears in
`jdet serve --help` and `jdet generate --help` with nothing else to edit, and the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jdet.ops import MODES
from jdet.plan import backend


def _opt(default: Any, help: str, **cli: Any) -> Any:
    """A field with its CLI help (and `choices`, `flag` for a differently named flag)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs a model. Values are checked where they are used (LLM, Engine, Plan)."""

    invariance: str = _opt(
        "tp", "reduction plan: 'tp' (same bits at any batch and TP size), 'batch' (any batch), "
        "'none' (XLA's own kernels, the fast baseline)", choices=MODES,
    )  # fmt: skip
    tp: int = _opt(1, "tensor-parallel size: devices the model is split over (1, 2, 4 or 8)")
    dtype: str = _opt("bfloat16", "weight and KV-cache dtype", choices=("bfloat16", "float32"))
    max_num_batched_tokens: int | None = _opt(
        None, "most tokens in one step, the largest compiled step shape: what a step without "
        "decodes (prompts at an idle engine) may take (default: 8192 on a GPU, 512 on a CPU)",
    )  # fmt: skip
    stall_free_budget: int = _opt(
        512, "tokens of a step that carries decodes (Sarathi-Serve's token budget: it bounds how "
        "long a running sequence waits for others' prompt chunks between two of its tokens); at "
        "most max_num_batched_tokens",
    )  # fmt: skip
    max_num_seqs: int = _opt(256, "most sequences in one step")
    max_model_len: int | None = _opt(
        None, "longest prompt + completion (default: the model's, capped by the KV pool)"
    )
    page_size: int = _opt(16, "tokens per KV-cache page (a power of two)")
    num_pages: int | None = _opt(
        None, "KV-cache pages (default: on a GPU what gpu_memory_utilization leaves once the "
        "weights and the largest step's peak are counted; on a CPU enough for a full batch, at "
        "most 1024)",
    )  # fmt: skip
    gpu_memory_utilization: float = _opt(
        0.9, "fraction of the device memory JAX may use (its limit: XLA_PYTHON_CLIENT_MEM_FRACTION "
        "of the GPU, 0.75 by default) that the weights, the KV cache and the largest step take "
        "together; the cache gets what the others leave",
    )  # fmt: skip
    enable_prefix_caching: bool = _opt(
        True, "reuse the KV pages of shared prompt prefixes", flag="--no-prefix-caching"
    )
    scheduling: str = _opt(
        "stall_free", "'stall_free' (decodes first, prefill chunks fill the budget) or "
        "'prefill_first'", choices=("stall_free", "prefill_first"),
    )  # fmt: skip
    min_tokens_bucket: int | None = _opt(
        None, "smallest padded token count (default: 8 on a CPU, the rows of its fixed-shape "
        "dots, with a 1-token bucket below it for batch-1 decode; 16 elsewhere; set it: no "
        "1-token bucket; raise it: fewer compiles)",
    )  # fmt: skip
    donate_weights: bool = _opt(
        False, "let the engine free the model's weight arrays it lays out anew (padding, "
        "fusing, TP shards) as it copies them, so a model near the device's memory is never "
        "held twice; the Model passed in cannot run afterwards (compute its weights_hash "
        "first if it is to be fingerprinted)",
    )  # fmt: skip
    min_seqs_bucket: int = _opt(1, "smallest padded sequence count")
    min_pages_bucket: int = _opt(32, "smallest padded page-table width")
    compile_cache: bool | str = _opt(
        True, "persistent XLA compilation cache: --compile-cache-dir DIR (default "
        "$JDET_CACHE_DIR or ~/.cache/jdet/xla) or --no-compile-cache", flag="--compile-cache-dir",
    )  # fmt: skip
    exec_cache_on_call: bool = _opt(
        False, "load each step shape's executable from jdet's executable cache, or compile it and "
        "write it there, at the shape's first call rather than only at warm-up: for a run that "
        "warms nothing up, whose next run then neither traces nor compiles (jdet generate sets "
        "it; jdet/exec_cache.py)",
    )  # fmt: skip
    sampler_variants: str = _opt(
        "auto", "the sampler variants steps may run, each its own executable that warm-up "
        "compiles (serving/engine/sampler_variants.py): 'auto' (lean and full on a GPU, greedy "
        "and full on a CPU), 'on-demand' (each compiled at its first step, as `jdet generate` "
        "runs), "
        "'lean-full', 'greedy-full' or 'full'",
        choices=("auto", "on-demand", "lean-full", "greedy-full", "full"),
    )  # fmt: skip
    step_programs: str = _opt(
        "auto", "the step as 'split' (the forward, then the sampler: each forward shape traced "
        "once for every sampler variant, so warm-up compiles less) or 'fused' (one program per "
        "shape and variant), the same bits either way; 'auto': split",
        choices=("auto", "split", "fused"),
    )  # fmt: skip
    async_scheduling: bool | str = _opt(
        "auto", "dispatch each steady decode step before the previous one's tokens reach the host "
        "(same bits): 'auto' (on a GPU or CPU), 'on' or 'off'", choices=("auto", "on", "off"),
    )  # fmt: skip
    num_processes: int = _opt(
        1, "processes of a multi-host job, one per host, the model split over all their devices "
        "(default: $JAX_NUM_PROCESSES, else 1; sharding/distributed.py)",
    )  # fmt: skip
    process_id: int | None = _opt(
        None, "this process's id in a multi-host job, 0 = the one that serves (default: "
        "$JAX_PROCESS_ID)",
    )  # fmt: skip
    coordinator_address: str | None = _opt(
        None, "host:port of process 0's JAX coordination service in a multi-host job (default: "
        "$JAX_COORDINATOR_ADDRESS)",
    )  # fmt: skip
    heartbeat_timeout: int = _opt(
        10, "seconds without a heartbeat after which a multi-host job counts a process as lost "
        "(a process that dies is noticed at once; this covers a host that vanishes)",
    )  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server's own settings (serving/http/server.py)."""

    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8000, "port to listen on")
    api_key: str | None = _opt(
        None, "require this bearer key (default: $JDET_API_KEY, which unlike a flag is not "
        "visible in ps)",
    )  # fmt: skip
    public_metrics: bool = _opt(False, "serve /metrics without the API key")
    max_body_bytes: int = _opt(4 << 20, "request body limit in bytes (larger: 413)")
    served_model_name: str | None = _opt(None, "model name in responses (default: its directory)")
    chat_template: str | None = _opt(
        None, "Jinja chat template (a file or the text) replacing the tokenizer's"
    )
    log_level: str = _opt("info", "uvicorn log level")
    data_parallel: int = _opt(
        1, "engine replicas, each on its own tp devices, behind this one endpoint: requests "
        "routed by a hash of the prompt's prefix (serving/http/router.py)",
    )  # fmt: skip


def add_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of the dataclass `cls`, with its default, choices and help."""
    for f in dataclasses.fields(cls):
        meta, name = f.metadata, "--" + f.name.replace("_", "-")
        help_ = meta["help"]
        if "default" not in help_ and f.default not in (None, False):
            help_ += f" (default: {f.default})"
        if f.name == "compile_cache":
            p.add_argument(meta["flag"], dest="compile_cache_dir", default=None, help=help_)
            p.add_argument("--no-compile-cache", action="store_true", help="no persistent cache")
        elif f.type in ("bool", bool) and f.default is True:
            off = f"turn off (default on): {meta['help']}"
            p.add_argument(meta.get("flag", name), dest=f.name, action="store_false", help=off)
        elif f.type in ("bool", bool):
            p.add_argument(name, dest=f.name, action="store_true", help=help_)
        else:
            t = str(f.type)
            kind = int if t.startswith("int") else float if t.startswith("float") else str
            p.add_argument(
                name, dest=f.name, type=kind, default=f.default, choices=meta.get("choices"),
                help=help_,
            )  # fmt: skip


def from_args(cls: type, a: argparse.Namespace) -> Any:
    """The dataclass `cls` from parsed flags (add_flags)."""
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(cls) if f.name != "compile_cache"}
    if any(f.name == "compile_cache" for f in dataclasses.fields(cls)):
        if a.no_compile_cache and a.compile_cache_dir:
            raise ValueError("give --compile-cache-dir or --no-compile-cache, not both")
        kw["compile_cache"] = False if a.no_compile_cache else (a.compile_cache_dir or True)
    return cls(**kw)


def resolve_async(value: bool | str) -> bool:
    """EngineConfig.async_scheduling: "auto" (default) is on where the device runs the step
    asynchronously to the host: a GPU (the host's work for a step then hides behind the device's)
    and a CPU, where XLA runs the step on its own thread, so on a machine with a core to spare
    the host's work for step n overlaps step n + 1 (BENCHMARKS.md). True/"on" and False/"off"
    force it; same bits either way (tests/serving/engine/test_async.py)."""
    if value in (True, "on"):
        return True
    if value in (False, "off"):
        return False
    if value == "auto":
        return backend().gpu or backend().cpu
    raise ValueError(f"async_scheduling={value!r}: use 'auto', 'on' or 'off' (or a bool)")


GPU_STEP_TOKENS, CPU_STEP_TOKENS = 8192, 512


def default_step_tokens() -> int:
    """EngineConfig.max_num_batched_tokens when unset. On a GPU 8192: a step without decodes
    takes a long prompt in chunks of up to 8192 tokens, which keeps an 8B's matmuls at their full
    rate and the chunks few (BENCHMARKS.md, Headline: time to first token at both budgets), while
    steps that carry decodes keep the stall-free budget of 512. On a CPU 512: every bucket is
    compiled before serving and a CPU step of 512 tokens already takes seconds."""
    return GPU_STEP_TOKENS if backend().gpu else CPU_STEP_TOKENS


def with_step_tokens(config: EngineConfig) -> EngineConfig:
    """`config` with max_num_batched_tokens set: `default_step_tokens()` where it is unset."""
    if config.max_num_batched_tokens is not None:
        return config
    return dataclasses.replace(config, max_num_batched_tokens=default_step_tokens())
