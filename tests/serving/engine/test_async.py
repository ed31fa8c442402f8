"""Asynchronous scheduling: the engine dispatches decode step n+1 before step n's tokens reach
the host (its input tokens are step n's device output). Outputs must be bitwise those of the
synchronous engine: tokens, log-probs, top log-probs, text and finish reasons, for greedy and
seeded sampling with stop strings, stop tokens, EOS and max_tokens."""

from __future__ import annotations

import numpy as np
import pytest

from jdet import compile_cache
from serving.engine.engine import Engine

# Every step's S bucket equals the decode step's T bucket (S = min(T, 4) = 4 for T >= 4), so
# every decode step can go ahead. test_host_path.py runs this engine with a budget of 16 (its
# SETTINGS derive from these), sharing its step executables.
SETTINGS = dict(
    invariance="tp", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, page_size=8,
    num_pages=40, min_tokens_bucket=4, min_pages_bucket=8,
)  # fmt: skip


def requests(vocab: int) -> list[tuple[list[int], dict]]:
    rng = np.random.default_rng(1)
    p = [rng.integers(1, vocab, n).tolist() for n in (3, 11, 20, 6, 29, 9)]
    return [
        (p[0], dict(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)),
        (p[1], dict(temperature=0.9, seed=11, max_tokens=17, n=2)),  # EOS may end it
        (p[2], dict(temperature=0.7, top_p=0.9, seed=5, max_tokens=30, stop=["e", "a"])),
        (p[3], dict(temperature=1.0, top_k=7, seed=2, max_tokens=25, ignore_eos=True,
                    stop_token_ids=[int(t) for t in range(40, 80)])),  # fmt: skip
        (p[4], dict(temperature=0.0, max_tokens=2)),
        (p[5], dict(temperature=0.5, seed=9, max_tokens=33, ignore_eos=True, logprobs=2)),
    ]


def run(eng: Engine, reqs) -> dict:
    for i, (ids, params) in enumerate(reqs):
        eng.add_request(f"r{i}", ids, params)
    streamed: dict = {}
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            for c in o.outputs:
                streamed.setdefault((o.request_id, c.index), []).extend(c.delta_token_ids)
            if o.finished:
                final[o.request_id] = o
    out = {}
    for rid, o in final.items():
        for c in o.outputs:
            out[(rid, c.index)] = (
                list(c.token_ids), np.asarray(c.logprobs, np.float32).tobytes(), c.top_logprobs,
                c.text, c.finish_reason, c.stop_reason,
            )  # fmt: skip
            assert streamed[(rid, c.index)] == list(c.token_ids)  # streaming missed nothing
    return out


def test_async_scheduling_gives_the_synchronous_bits(serving_model, monkeypatch):
    sync = Engine(serving_model, **SETTINGS, async_scheduling=False)
    eng = Engine(serving_model, **SETTINGS, async_scheduling=True)
    eng.warmup()
    reqs = requests(serving_model.cfg.vocab_size)
    before = compile_cache.stats()
    got = run(eng, reqs)
    assert compile_cache.stats().compiles == before.compiles  # the async path is in the shape set
    assert eng.num_steps_ahead > 20  # most decode steps went ahead
    want = run(sync, reqs)
    assert sync.num_steps_ahead == 0
    assert got == want
    reasons = {v[4] for v in want.values()}
    assert {"stop", "length"} <= reasons
    eng.page_manager.check()
    assert eng.page_manager.num_used == 0  # every page came back

    # Negative control: feed each ahead step the wrong rows' tokens; the comparison sees it.
    bad = Engine(serving_model, **SETTINGS, async_scheduling=True)
    real = bad.runner.prepare_ahead

    def shifted(plan, tokens):
        import jax.numpy as jnp

        return real(plan, jnp.roll(tokens, 1))

    monkeypatch.setattr(bad.runner, "prepare_ahead", shifted)
    assert run(bad, reqs) != want


def test_async_scheduling_setting_resolves_by_backend(monkeypatch):
    """'auto' (the default) dispatches ahead on a GPU and a CPU (not on a TPU: not measured);
    'on'/'off' and bools force it; any other value is refused by name."""
    from jdet.settings import resolve_async
    from pallas_kernels import _platform

    assert resolve_async("auto") is True  # this CPU
    assert resolve_async("on") is True and resolve_async(True) is True
    assert resolve_async("off") is False and resolve_async(False) is False
    monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    assert resolve_async("auto") is True
    monkeypatch.setattr(_platform, "platform", lambda: "tpu")
    assert resolve_async("auto") is False
    with pytest.raises(ValueError, match="async_scheduling"):
        resolve_async("sometimes")


def test_decode_goes_ahead_when_fewer_sequences_than_the_token_bucket(serving_model):
    """max_num_seqs below the smallest token bucket (S bucket 2, T bucket 4): the sampled tokens
    are padded to T on the device, so decode still goes ahead, with the synchronous bits. Before,
    every such decode step waited for the host (max_num_seqs=8 under a 16-token bucket on a GPU:
    1.35x slower per token)."""
    settings = {**SETTINGS, "max_num_seqs": 2}
    reqs = requests(serving_model.cfg.vocab_size)[:2]
    eng = Engine(serving_model, **settings, async_scheduling=True)
    assert eng.runner.shapes.fit(2, 2, 1)[:2] == (4, 2)  # T bucket above the S bucket
    got = run(eng, reqs)
    assert eng.num_steps_ahead > 10
    sync = Engine(serving_model, **settings, async_scheduling=False)
    assert run(sync, reqs) == got and sync.num_steps_ahead == 0
