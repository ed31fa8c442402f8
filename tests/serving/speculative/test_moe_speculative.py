"""Exact speculative decoding on a mixture-of-experts model: `jdet.LLM(model, speculative=...)`
with n-gram drafts and verify="exact" gives bitwise the tokens and log-probs of plain decoding,
greedy and seeded sampling, on the shared tiny random Qwen3-MoE (layer 0: top-2 of 8 experts,
layer 1 dense; float32). (Speculation under TP is tests/sharding/test_spec_tp.py's cell, and the
MoE's TP sizes tests/sharding/test_moe_tp_invariance.py's.)

Why MoE needs its own cell: a verify step runs K + 1 rows of each drafting sequence where plain
decoding runs one, so every expert serves more tokens in a verify than in a decode step. The
experts' grouped matmul must give a row the same bits whatever its expert serves. The prompts
repeat a pattern, so drafts are both accepted and rejected (checked: a run whose drafts were never
accepted, or always, would prove little).

Negative control: the same two engines with the gate/up grouped matmul of "tp" replaced by one
that splits K into two halves (each through the invariant kernel, added in f32) for the rows of
an expert that serves 4 or more rows of the step, as a kernel whose tiling follows the tokens per
expert would. A decode step of the three prompts never gives an expert 4 rows; verifies of up
to K + 1 = 4 rows per sequence do (prefill chunks do in both runs, chunked alike until verify rows
share a step's budget with them). The control must differ from its own plain run; with the
threshold out of reach it does not (checked by hand: the split path alone changes no bit).

Every engine has one step shape (T = S = 16): one compile per grouped matmul.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jdet
from jdet.spec_config import SpeculativeConfig
from pallas_kernels import grouped_layout as gl

KW = dict(invariance="tp", max_num_batched_tokens=16, max_num_seqs=16, max_model_len=64,
          min_tokens_bucket=16, min_seqs_bucket=16)  # fmt: skip
SPEC = SpeculativeConfig(method="ngram", num_tokens=3, verify="exact", min_alpha=0.0)
SPLIT_MIN_ROWS = 4


def _prompts(vocab: int) -> tuple[list[list[int]], list[jdet.SamplingParams]]:
    rng = np.random.default_rng(5)
    motif = rng.integers(1, vocab, 5).tolist()
    prompts = [motif * 4 + [7], (motif[2:] + motif[:2]) * 3, rng.integers(1, vocab, 11).tolist()]
    params = [
        jdet.SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        jdet.SamplingParams(temperature=0.8, seed=3, max_tokens=14, ignore_eos=True),
        jdet.SamplingParams(temperature=1.0, seed=9, max_tokens=14, ignore_eos=True),
    ]
    return prompts, params


def _generate(model, spec: SpeculativeConfig | None) -> tuple[list, dict]:
    llm = jdet.LLM(model, speculative=spec, **KW)
    prompts, params = _prompts(model.cfg.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    bits = [(o.outputs[0].token_ids, np.asarray(o.outputs[0].logprobs)) for o in outs]
    return bits, (llm.engine.speculator.stats() if spec else {})


def _same(a: list, b: list) -> bool:
    return all(ta == tb and np.array_equal(la, lb) for (ta, la), (tb, lb) in zip(a, b, strict=True))


def _drafts_mattered(stats: dict) -> None:
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"], stats


@pytest.fixture(scope="module")
def moe_model(hf_checkpoints):
    return jdet.load(hf_checkpoints["qwen3_moe"], dtype="float32")


def test_exact_speculative_decoding_of_a_moe_gives_the_plain_bits(moe_model):
    plain, _ = _generate(moe_model, None)
    spec, stats = _generate(moe_model, SPEC)
    _drafts_mattered(stats)
    assert _same(plain, spec), "speculative decoding changed the MoE's tokens or log-probs"


def _split_k_by_expert_rows(original):
    """The control's gate/up grouped matmul (module docstring)."""

    def grouped_gate_up(self, x, w_gate, w_up, tiles, per_src, live=None, layer=None):
        whole = original(self, x, w_gate, w_up, tiles, per_src, live, layer)
        if not self.invariant:
            return whole
        h = x.shape[1] // 2
        f32 = jnp.float32
        lo = original(self, x[:, :h], w_gate[..., :h, :], w_up[..., :h, :], tiles, per_src, live,
                      layer)  # fmt: skip
        hi = original(self, x[:, h:], w_gate[..., h:, :], w_up[..., h:, :], tiles, per_src, live,
                      layer)  # fmt: skip
        # the real rows each expert serves in this step (a row left out has group -1)
        g = gl.row_groups(tiles)
        rows = jnp.zeros(w_gate.shape[-3] + 1, jnp.int32).at[g].add(1, mode="drop")
        many = (rows[jnp.maximum(g, 0)] >= SPLIT_MIN_ROWS)[:, None]
        return tuple(jnp.where(many, (a.astype(f32) + b.astype(f32)).astype(w.dtype), w)
                     for a, b, w in zip(lo, hi, whole, strict=True))  # fmt: skip

    return grouped_gate_up


def test_negative_control_expert_tiling_by_tokens_per_expert_breaks_exact_speculation(
    moe_model, monkeypatch
):
    import jdet.ops
    import jdet.step
    import serving.engine.host_inputs

    monkeypatch.setattr(jdet.ops.Ops, "grouped_gate_up",
                        _split_k_by_expert_rows(jdet.ops.Ops.grouped_gate_up))  # fmt: skip
    # traced afresh (the patch must not reach the steps other tests share, nor theirs this one)
    monkeypatch.setattr(jdet.step, "make_step_fn", jdet.step.make_step_fn.__wrapped__)
    monkeypatch.setattr(jdet.step, "make_score_fn", jdet.step.make_score_fn.__wrapped__)
    monkeypatch.setattr(serving.engine.host_inputs, "_split_step_fn",
                        serving.engine.host_inputs._split_step_fn.__wrapped__)  # fmt: skip
    plain, _ = _generate(moe_model, None)
    spec, stats = _generate(moe_model, SPEC)
    _drafts_mattered(stats)
    assert not _same(plain, spec), "negative control: split-K by expert rows changed no bit"
