"""Tensor parallelism of a mixture-of-experts model: score() log-probs are bitwise the same for
TP = 1, 2, 4, 8 (tests/sharding/test_tp_invariance.py's tiny model and helpers, with experts).

Layer 0 runs 4 experts (top 2) of F = 1024: 32 f32 K tiles, 8 leaves of 4 tiles. Each device
holds F / tp of every expert and computes its subtree of the down projection (`Ops.row_shards`);
a shard that planned its own tree over F / tp instead would cut 16 tiles (TP 2) into 8 leaves of
2 and differ. Layer 1 is dense, so the layer-kind `lax.cond` runs with the tree all-reduce in
both branches. The negative control is "batch" mode (sequential-K partials + psum).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from tests.sharding import tiny

pytestmark = [
    pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices"),
    pytest.mark.xdist_group("moe_tp_invariance"),
]

PROMPT_LENS = (7, 4)


@functools.cache
def _model():
    cfg = tiny.tiny_cfg(model_type="qwen3_moe", moe="qwen3_moe", num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=1024,
                        sparse_layers=(0,))  # fmt: skip
    return cfg, tiny.tiny_params(cfg, seed=0, scale=0.08)


@functools.cache
def _scores(mode: str, tp: int) -> np.ndarray:
    cfg, params = _model()
    return tiny.run_score(cfg, params, tp, mode, PROMPT_LENS)


def test_moe_score_logprobs_are_bitwise_identical_for_tp_1_2_4_8():
    ref = _scores("tp", 1)
    assert np.isfinite(ref).all()
    for tp in (2, 4, 8):
        assert np.array_equal(_scores("tp", tp), ref), f"TP={tp} MoE log-probs differ from TP=1"


def test_moe_negative_control_batch_mode_psum_changes_bits_between_tp_sizes():
    assert not np.array_equal(_scores("batch", 8), _scores("batch", 1)), (
        "batch mode (psum) happened to match TP=1 at TP=8"
    )


def test_moe_under_tp_with_padded_rows_keeps_the_bits_and_sends_only_the_steps_rows(monkeypatch):
    """The residual stream padded as on Hopper (Ops.row_pad, here to 16 rows): under TP the
    FFN runs on the step's 11 rows (jdet/moe.py ffn_forward), so the experts' all-reduce sends
    their 11 x 2 slots, not the padding's; the log-probs stay TP 1's."""
    import sharding.tp
    from jdet.ops import Ops

    ref = _scores("tp", 1)
    cfg, params = _model()
    seen = []
    reduce = sharding.tp.tree_allreduce_parts

    def spy(parts, axis_name, **kw):
        seen.append(parts.shape[1])
        return reduce(parts, axis_name, **kw)

    monkeypatch.setattr(sharding.tp, "tree_allreduce_parts", spy)
    monkeypatch.setattr(Ops, "row_pad", lambda self, t: -(-t // 16) * 16 if self.pad_rows else t)
    for name in ("make_tp_step", "make_tp_score"):  # uncached: traced with the padding
        monkeypatch.setattr(sharding.tp, name, getattr(sharding.tp, name).__wrapped__)
    for tp in (1, 2):
        seen.clear()
        got = tiny.run_score(cfg, params, tp, "tp", PROMPT_LENS)
        assert np.array_equal(got, ref), f"TP={tp}"
    # at TP 2: o_proj's 16 rows (11 reduced), the experts' 11 x 2 slots, never 16 x 2
    assert 16 in seen and sum(PROMPT_LENS) * 2 in seen and 32 not in seen, seen
