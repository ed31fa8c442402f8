"""Shared fixtures: tiny random-weight Hugging Face checkpoints written with save_pretrained.

Why through save_pretrained: the tests exercise the real loading path (config.json +
safetensors with HF names), never a shortcut.
"""

import os

# Eight host devices let the tensor-parallel tests run on a CPU; harmless elsewhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# torch (transformers references, checkpoint writers) on one OpenMP thread, here and in the
# subprocesses and notebook kernels that inherit this environment. Why: the tests' models are tiny,
# so torch's threads cost more than they give, and under the README's `-n 2` on a 2-core machine
# each worker's spinning OpenMP threads take the other worker's core. Measured on the 2-core box
# (notebook 01's transformers cell, 8 batched generates): 26-35 CPU s with torch's default 2
# threads, 5-9 CPU s with one. jdet's own invariant steps already compile for one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# jdet's persistent compilation cache goes to a temporary directory, never the user's
# ~/.cache/jdet: one per pytest run, since subprocesses inherit it and so do xdist's workers (the
# controller loads this file before it starts them; checked under -n 2: both workers named the
# same directory), so a step shape one worker compiled is a cache hit for the other. jdet.LLM's
# start-up compile of every shape is off (tests that check it turn it on), since compiles are
# slow on the CI's CPU.
if "JDET_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JDET_CACHE_DIR"] = tempfile.mkdtemp(prefix="jdet-xla-test-")
    atexit.register(shutil.rmtree, os.environ["JDET_CACHE_DIR"], True)
os.environ.setdefault("JDET_WARMUP", "0")

import gc  # noqa: E402

# Python's cyclic GC less often in the test processes: (700, 10, 10) -> (20000, 50, 100). Why:
# tracing and compiling build a large heap of long-lived objects (jaxprs, lowerings, executables
# in JAX's caches), and every full collection walks all of it: under the README's command each
# xdist worker ran ~30 full collections of ~0.4 s (12.5 s a worker, 2.4 % of the suite's CPU
# time, session 14: tests/ + a gc.callbacks timer). With these thresholds, test_invariance +
# test_engine_invariance ran 8 full collections instead of 18 (2.3 s instead of 4.7) at the same
# peak memory (1.21 vs 1.19 GB). Reference counting still frees acyclic garbage at once; the
# library leaves the GC as the caller set it.
gc.set_threshold(20000, 50, 100)

import jax  # noqa: E402
import pytest  # noqa: E402

# Test engines run the product's sampler variants (serving/engine/sampler_variants.py
# `engine_variants`: GREEDY and FULL on a CPU, LEAN and FULL on a GPU). The other sets and their
# bit equality with FULL have their own tests, whose engines name their set
# (EngineConfig.sampler_variants: tests/serving/engine/test_sampler_variants.py,
# test_host_path.py; tests/jdet/test_sampler_variants.py calls the sampler directly), and
# `jdet generate` runs "on-demand" (jdet/cli.py).

TINY = dict(
    vocab_size=283,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
)

ARCH_CONFIGS = {
    "llama": dict(
        model_type="llama",
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(model_type="mistral", head_dim=16, sliding_window=None),
    "qwen2": dict(
        model_type="qwen2",
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    # mixture of experts: layer 0 sparse, layer 1 dense (mlp_only_layers), top-2 of 8 experts,
    # the top-k weights not renormalised; Mixtral renormalises, every layer sparse
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        model_type="mixtral", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=None,
    ),  # fmt: skip
}


def pytest_configure(config):
    """Under xdist (`-n 2`, the README's command), distribute as `--dist loadgroup`: tests one by
    one as `load` does, but a module marked `xdist_group(...)` runs on one worker. Why: such a
    module's tests share minutes of module-scoped fixtures and compiled steps, which `load` would
    build on both workers. An explicit `--dist` is kept; without xdist this does nothing."""
    explicit = any(a.startswith("--dist") for a in config.invocation_params.args)
    if config.pluginmanager.hasplugin("xdist") and not explicit:
        if config.getoption("dist", "no") == "load":
            config.option.dist = "loadgroup"
        if hasattr(config, "workerinput"):
            # A worker: xdist set its `loadgroup` flag (whether to tag each test's node id with
            # its group, what the controller's scheduler groups by) from the command line's
            # --dist before this hook ran (xdist/remote.py `setup_config`, xdist 3.8), so the
            # switch above never reached it and no group was kept together: the README run
            # (sessions 9-12) built each grouped module's fixtures and compiles on both workers.
            config.option.loadgroup = True


# Modules whose single (ungrouped) tests are long, longest first (CPU seconds per test, measured
# at session 6: the README blocks, each notebook, test_llm_tp ~1-2 min; the others 20-60 s).
LONG_SINGLE_TESTS_FIRST = (
    "tests/test_readme.py",
    "tests/test_notebooks.py",
    "tests/sharding/test_llm_tp.py",
    "tests/serving/http/test_data_parallel.py",  # ~45 CPU s: a router, two replicas, a reference
    "tests/sharding/test_multihost.py",  # ~35 CPU s: a two-process job and a reference
    "tests/serving/speculative/test_spec_adaptive.py",
    "tests/serving/engine/test_scoring.py",
    "tests/jdet/test_golden.py",
    "tests/jdet/test_parity.py",
    "tests/jdet/test_checkpoint_roundtrip.py",
    "tests/jdet/test_tokenizer.py",
    "tests/jdet/test_cli.py",
    "tests/serving/engine/test_async.py",
)


def _long_first(items: list) -> None:
    """On an xdist worker, collect `LONG_SINGLE_TESTS_FIRST`'s modules first (whole modules, in
    that order; the rest keep theirs). Why: `--dist loadgroup` sends the xdist groups first
    (most tests first), then every other test as its own unit in collection order, each worker
    taking the next unit when it runs low. A long test sent last (the README's blocks and the
    notebooks are collected last) leaves the other worker idle while it runs; sent early, the
    short tests fill in at the end. Every worker sorts alike, as xdist requires."""
    rank = {path: i for i, path in enumerate(LONG_SINGLE_TESTS_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    skip_gpu = pytest.mark.skip(reason="needs a GPU (run on the device: -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
    if hasattr(config, "workerinput"):  # an xdist worker (the README's `-n 2`)
        _long_first(items)


def write_hf_checkpoint(path, arch: str, seed: int = 0, **overrides):
    """Write a random-weight checkpoint of `arch` with transformers and return its directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**TINY, **ARCH_CONFIGS[arch], **overrides}
    mt = kw.pop("model_type")
    cfg = AutoConfig.for_model(mt, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # norms and biases random too, so every weight is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn_like(p))  # logits of std ~8: peaked, stable greedy paths
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> directory of a tiny float32 checkpoint (written once per session)."""
    root = tmp_path_factory.mktemp("hf")
    return {a: write_hf_checkpoint(root / a, a) for a in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def tiny_model_dir(hf_checkpoints):
    return hf_checkpoints["qwen3"]


def _batch_dependent_attention(self, q, kv, layer, batch, scale):
    """Attention whose rounding follows the batch, a different one for every step size: with n
    the step's real token count and c = 2n + 1, q is multiplied by c * scale (rounded to q's
    dtype) before the q.k dot and the scores by 1/c after it. The negative-control variant.

    Why every n its own c: a variant that picks one of two plans from n (it used n % 5 % 2)
    can give a probe the same plan in both runs it compares (alone: a 13-token prefill and
    decodes of n = 1; among 6 requests: decodes of n = 6, same parity), and then only XLA's
    threaded dots made the control differ. With c injective in n, two schedules that give the
    probe a different step size in any step round its q and scores differently there, whatever
    the threading. c is odd and > 1, never a power of two (which would scale exactly)."""
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention_xla

    n = batch.query_start[-1].astype(jnp.float32)
    c = 2.0 * n + 1.0
    return paged_attention_xla(  # "none"'s own attention, which takes a traced scale
        (q.astype(jnp.float32) * (c * scale)).astype(q.dtype), kv["k"], kv["v"],
        batch.page_table, batch.context_lens, batch.query_start, batch.positions,
        scale=1.0 / c, layer=layer,
    )  # fmt: skip


@pytest.fixture
def batch_dependent_none(monkeypatch):
    """Make `invariance="none"` batch dependent for certain on a CPU, for negative controls.

    Why: at the test models' sizes XLA's own CPU ops can happen to give the same bits whatever
    the batch, so a control in plain "none" proves nothing there. With this fixture, "none"
    attention orders its scaling by the step's real token count, so probe bits change with
    batch composition, budget, chunking and prefix hits, and each invariance comparison is
    shown to detect it. The step caches are bypassed so the variant is traced afresh (and does
    not leak into other tests). Its steps are compiled on one CPU thread, as the invariant
    modes' are, so that no control leans on a threaded dot's rounding. On a GPU it does
    nothing: XLA there differs by itself.
    """
    if jax.default_backend() != "cpu":
        return
    import jdet.ops
    import jdet.step
    import serving.engine.host_inputs

    original = jdet.ops.Ops.attention

    def attention(self, q, kv, layer, batch, scale, meta=None, out_rows=None):
        if self.invariance != "none":
            return original(self, q, kv, layer, batch, scale, meta=meta, out_rows=out_rows)
        from pallas_kernels.paged_attention import _pad_rows

        return _pad_rows(_batch_dependent_attention(self, q, kv, layer, batch, scale), out_rows)

    monkeypatch.setattr(jdet.ops.Ops, "attention", attention)
    options = jdet.step.xla_options
    monkeypatch.setattr(
        jdet.step, "xla_options",
        lambda ops: options(ops) if ops.invariant else dict(jdet.step.CPU_XLA_OPTIONS),
    )  # fmt: skip
    monkeypatch.setattr(jdet.step, "make_step_fn", jdet.step.make_step_fn.__wrapped__)
    monkeypatch.setattr(jdet.step, "make_score_fn", jdet.step.make_score_fn.__wrapped__)
    # a CPU engine's step is a forward and a sampler (serving/engine/host_inputs.py), cached apart
    monkeypatch.setattr(serving.engine.host_inputs, "_split_step_fn",
                        serving.engine.host_inputs._split_step_fn.__wrapped__)  # fmt: skip
