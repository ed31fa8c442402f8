"""Bitwise invariance of a mixture-of-experts model in the serving engine: the cells of
test_engine_invariance.py (its probes, engines and comparisons) on a tiny random Qwen3-MoE
(layer 0: top-2 of 8 experts, layer 1 dense), plus `jdet.train.logprobs` against `score()`.

One engine per mode serves every cell (a fresh page manager per cell, so no cell sees another's
prefix cache): each engine is one compiled step shape. Batch size and composition: the probes
among 12 other requests; chunked prefill: score() packs the probes' 39 and 31 tokens with six
other sequences into 64-token steps (chunks), against the sampler's one-shot prefill and decode.

Negative control, MoE-specific: "none" mode with the experts' grouped matmul replaced by one that
splits the input width into 8 f32 partial sums when an expert serves 16 or more rows of the step
and reduces it whole otherwise (a kernel that picks split-K from the tokens per expert). Nothing
else changes in "none", so a control that differs shows that the comparison sees the experts'
arithmetic follow the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet import train
from serving.engine.llm_backend import score
from serving.engine.page_manager import PageManager
from tests.conftest import write_hf_checkpoint
from tests.serving.engine.test_engine_invariance import (
    NUM_PAGES,
    PAGE,
    PROBES,
    make_engine,
    others,
    probe_bits_equal,
    run,
    with_probes,
)

pytestmark = pytest.mark.xdist_group("moe_engine_invariance")

MODES = ["tp", "none"]
SPLIT_MIN_ROWS = 16


def _split_by_expert_rows(x, w, tiles, per_src, layer=None):
    """The control's grouped matmul (module docstring), over the layout's slots."""
    from pallas_kernels import grouped_layout as gl

    w = w if layer is None else w[layer]
    g = jnp.maximum(jnp.repeat(tiles.tile_group, tiles.block_m), 0)
    wg = w[g].astype(jnp.float32)
    xs = gl.gather_rows(x, tiles, per_src).astype(jnp.float32)
    whole = jnp.einsum("pk,pkn->pn", xs, wg)
    parts = jnp.einsum("pck,pckn->pcn", xs.reshape(xs.shape[0], 8, -1),
                       wg.reshape(wg.shape[0], 8, -1, wg.shape[-1]))  # fmt: skip
    split = parts[:, 0]
    for c in range(1, 8):
        split = split + parts[:, c]
    many = (tiles.group_sizes[g] >= SPLIT_MIN_ROWS)[:, None]
    return gl.scatter_rows(jnp.where(many, split, whole).astype(x.dtype), tiles)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    import jdet

    d = write_hf_checkpoint(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=4,
                            vocab_size=320, max_position_embeddings=512)  # fmt: skip
    # f32: the control's split-K changes the f32 sums by an ulp or so, which bf16 outputs would
    # mostly round away at this size; the invariant mode's claim is the same in either dtype
    return jdet.load(d, dtype="float32")


@pytest.fixture(scope="module")
def engines(moe_model):
    """mode -> (engine, reference probe outputs alone). "none" runs the control's experts."""
    import jdet.ops
    import jdet.step
    import serving.engine.host_inputs

    mp = pytest.MonkeyPatch()
    original = jdet.ops.Ops.grouped_gate_up

    def grouped_gate_up(self, x, w_gate, w_up, tiles, per_src, live=None, layer=None):
        if self.invariant:
            return original(self, x, w_gate, w_up, tiles, per_src, live, layer)
        return tuple(_split_by_expert_rows(x, w, tiles, per_src, layer) for w in (w_gate, w_up))

    mp.setattr(jdet.ops.Ops, "grouped_gate_up", grouped_gate_up)
    # traced afresh for this module (the patch must not leak into cached steps elsewhere)
    mp.setattr(jdet.step, "make_step_fn", jdet.step.make_step_fn.__wrapped__)
    mp.setattr(jdet.step, "make_score_fn", jdet.step.make_score_fn.__wrapped__)
    mp.setattr(serving.engine.host_inputs, "_split_step_fn",
               serving.engine.host_inputs._split_step_fn.__wrapped__)  # fmt: skip
    out = {}
    for mode in MODES:
        eng = make_engine(moe_model, mode)
        ref = {}
        for name, (ids, params) in PROBES.items():
            _fresh_pages(eng)
            ref.update(run(eng, [(name, ids, params)]))
        out[mode] = (eng, ref)
    yield out
    mp.undo()


def _fresh_pages(eng, num_pages: int | None = None) -> None:
    """An empty page manager (no prefix cache), optionally fewer pages than compiled for. It
    carries on the old one's prefix-cache totals, which the engine's metrics count up from."""
    old = eng.page_manager
    pm = PageManager(num_pages or NUM_PAGES, PAGE)
    pm.prefix_queries, pm.prefix_hits = old.prefix_queries, old.prefix_hits
    eng.page_manager = eng.scheduler.pm = pm


def _expect(mode: str, ref: dict, got: dict, what: str) -> None:
    equal = probe_bits_equal(ref, got)
    if mode == "tp":
        assert equal, f"MoE probe bits changed {what}"
    else:
        assert not equal, f"negative control: split-K by expert rows did not change {what}"


@pytest.mark.parametrize("mode", MODES)
def test_moe_request_bits_do_not_depend_on_other_requests(engines, mode):
    eng, ref = engines[mode]
    _fresh_pages(eng)
    got = run(eng, with_probes(others(12, seed=12), at=5))
    _expect(mode, ref, got, "among 12 other requests")


@pytest.mark.parametrize("mode", MODES)
def test_moe_preemption_and_recompute_do_not_change_bits(engines, mode):
    eng, ref = engines[mode]
    _fresh_pages(eng, 20)
    got = run(eng, with_probes(others(4, seed=9, long=True), at=3))
    assert all(got[p].num_preemptions > 0 for p in PROBES), "the probes should be preempted"
    _expect(mode, ref, got, "after preemption and recompute")


@pytest.mark.parametrize("mode", MODES)
def test_moe_prefix_cache_hit_gives_the_cold_bits(engines, mode):
    eng, ref = engines[mode]
    _fresh_pages(eng)
    warm = [(f"warm-{n}", ids[:24] + [5, 6, 7], dict(max_tokens=2))
            for n, (ids, _) in PROBES.items()]  # fmt: skip
    # the warm-up requests beside the crowd: the cold prefix was computed among other rows
    run(eng, warm + others(10, seed=3))
    got = run(eng, with_probes([], 0))
    assert got["greedy"].num_cached_tokens == 24 and got["sampled"].num_cached_tokens == 16
    _expect(mode, ref, got, "with a prefix-cache hit")


def _probe_seqs(ref: dict) -> tuple[list[list[int]], list[np.ndarray]]:
    seqs, want = [], []
    for name, (ids, _) in PROBES.items():
        c = ref[name].outputs[0]
        seqs.append(ids + c.token_ids)
        want.append(np.asarray(c.logprobs, np.float32))
    return seqs, want


@pytest.mark.parametrize("mode", MODES)
def test_moe_score_returns_the_sampler_logprobs(engines, mode):
    eng, ref = engines[mode]
    _fresh_pages(eng)
    seqs, want = _probe_seqs(ref)
    # scored beside other sequences, so the experts serve other rows than when sampled
    extra = [ids for _, ids, _ in others(6, seed=21)]
    got = score(eng, extra[:3] + seqs + extra[3:])[3:5]
    equal = all(np.array_equal(g[-len(w) :], w) for g, w in zip(got, want, strict=True))
    if mode == "tp":
        assert equal, "score() differs from the sampler's log-probs"
    else:
        assert not equal, "negative control: split-K by expert rows matched the sampler"


def test_moe_train_logprobs_equal_score_bitwise_with_a_finite_gradient(engines, moe_model):
    eng, ref = engines["tp"]
    seqs, want = _probe_seqs(ref)
    tokens, mask = train.right_pad(seqs)
    w = np.random.default_rng(1).standard_normal((tokens.shape[0], tokens.shape[1] - 1))

    def loss(params):
        lp = train.logprobs(params, tokens, cfg=moe_model.cfg, mask=mask, page_size=PAGE)
        return jnp.sum(lp * w), lp

    (_, lp), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(moe_model.params)
    lp = np.asarray(lp)
    for b, (s, wnt) in enumerate(zip(seqs, want, strict=True)):
        assert np.array_equal(lp[b, len(s) - 1 - len(wnt) : len(s) - 1], wnt)
    layers = grad["layers"]
    for name in ("router", "expert_gate", "expert_up", "expert_down", "w_gate"):
        g = np.asarray(layers[name], np.float32)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name
