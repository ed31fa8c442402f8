"""Rejection mode's bits do not depend on the load (serving/engine/scheduler.py,
serving/speculative/speculator.py).

In `verify="rejection"` which positions are rejection-sampled is part of the bits, so each of a
request's verifies must hold the drafts its own state asks for, whatever else runs. Each test
runs sampled requests (self draft or a random draft model, always drafting) batched under the
token budget and compares every request's tokens and log-probs with the request run alone,
`np.array_equal`, checking that the load actually reached them (verifies deferred, sequences
preempted and recomputed). Negative controls, one per rule: drafts cut to the budget (the policy
before session 8), a recompute that samples its next position in its prefill, and drafting at
the prompt's last token when a chunk boundary falls just before it: each gives some request
other tokens.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jdet.spec_config import SpeculativeConfig
from serving.engine.engine import Engine
from serving.engine.scheduler import Scheduler
from serving.sequence import Status
from serving.speculative.speculator import Speculator
from tests.serving.speculative.test_speculative import (
    PROMPTS,
    make_engine,
    random_draft,  # noqa: F401 - a fixture: a random draft model
    run,
)

# the module shares test_speculative's compiled steps (same shapes): the same xdist worker
pytestmark = pytest.mark.xdist_group("speculative")

SPEC = SpeculativeConfig(method="self", draft_layers=1, verify="rejection", num_tokens=4,
                         min_alpha=0.0)  # fmt: skip


def spec_of(method: str, request: pytest.FixtureRequest) -> SpeculativeConfig:
    """The "self" draft (SPEC) or a random draft model (own cache, mirrored; mostly residual
    draws)."""
    if method == "self":
        return SPEC
    dm = request.getfixturevalue("random_draft")
    return SpeculativeConfig(method="draft", draft_model=dm, verify="rejection", num_tokens=4,
                             min_alpha=0.0)  # fmt: skip


_rng = random.Random(8)
_PROMPTS = {**PROMPTS, "r33": [_rng.randrange(1, 320) for _ in range(33)]}  # 32 + 1 chunks


def requests(max_tokens: int = 24) -> list[tuple[str, list[int], dict]]:
    """Two seeded sampled requests per prompt, one with n = 2: 9 sequences drafting K = 4, so
    their verifies (5 tokens each) do not all fit the budget of 32 tokens."""
    out = []
    for i, (name, prompt) in enumerate(_PROMPTS.items()):
        for j in range(2):
            p = dict(temperature=1.0, top_p=0.95, seed=100 * i + j, max_tokens=max_tokens,
                     ignore_eos=True, n=2 if (i, j) == (0, 1) else 1)  # fmt: skip
            out.append((f"{name}/{j}", prompt, p))
    return out


def fillers() -> list[tuple[str, list[int], dict]]:
    """Long requests added first (so the oldest): the checked ones, newer, are preempted."""
    p = dict(temperature=1.0, seed=5, max_tokens=96, ignore_eos=True)
    return [(f"filler/{i}", PROMPTS["random"][i:], p) for i in range(4)]


_ALONE: dict = {}


def alone_of(model, spec: SpeculativeConfig) -> dict:
    """Each request alone in its engine (no deferral, no preemption); kept per draft method."""
    if spec.method not in _ALONE:
        out = {}
        for req in requests():
            e = make_engine(model, spec)
            out.update(run(e, [req]))
            assert e.scheduler.num_deferred_verifies == e.scheduler.num_preemptions == 0
        _ALONE[spec.method] = out
    return _ALONE[spec.method]


@pytest.fixture(scope="module")
def alone(serving_model) -> dict:
    return alone_of(serving_model, SPEC)


def differing(got: dict, ref: dict) -> list[str]:
    """Requests whose tokens or log-probs (any of its n outputs) differ from `ref`'s."""
    return [
        rid
        for rid in ref
        for x, y in zip(got[rid].outputs, ref[rid].outputs, strict=True)
        if not np.array_equal(x.token_ids, y.token_ids)
        or not np.array_equal(np.asarray(x.logprobs), np.asarray(y.logprobs))
    ]


def batched(model, spec: SpeculativeConfig = SPEC) -> tuple[Engine, dict]:
    e = make_engine(model, spec)
    return e, run(e, requests())


def preempted(model, spec: SpeculativeConfig = SPEC) -> tuple[Engine, dict]:
    e = make_engine(model, spec)
    got = run(e, fillers() + requests())
    return e, {rid: got[rid] for rid, _, _ in requests()}


@pytest.mark.parametrize("method", ["self", "draft"])
def test_rejection_bits_alone_equal_batched_under_a_tight_budget(serving_model, method, request):
    """9 drafting sequences, a budget of 32 tokens: verifies are deferred (never cut), chunk
    boundaries fall elsewhere; every request's bits equal its bits alone."""
    spec = spec_of(method, request)
    e, got = batched(serving_model, spec)
    assert e.scheduler.num_deferred_verifies > 0 and e.scheduler.num_preemptions == 0
    assert e.speculator.stats()["accepted_tokens"] > 0
    assert e.speculator.stats()["rejected_tokens"] > 0
    assert differing(got, alone_of(serving_model, spec)) == []


def test_negative_control_drafts_cut_to_the_budget_change_bits(serving_model, alone):
    """The policy before session 8 (exact mode's: a verify's drafts shrink to the budget left
    after the decodes) rejection-samples other positions of some request."""
    e = make_engine(serving_model, SPEC)
    e.scheduler.verify_tokens = None
    got = run(e, requests())
    assert differing(got, alone) != []


@pytest.mark.parametrize("method", ["self", "draft"])
def test_rejection_bits_with_and_without_preemption(serving_model, method, request):
    """Four long requests hold most of the 64 pages: the checked requests are preempted after
    they have output tokens and recomputed (their last token left to a decode step, which drafts
    as it would have; a draft model's cache follows the recompute); every one's bits equal its
    bits alone."""
    spec = spec_of(method, request)
    e, got = preempted(serving_model, spec)
    assert e.scheduler.num_preemptions > 0 and e.scheduler.num_held_recomputes > 0
    assert differing(got, alone_of(serving_model, spec)) == []


def test_negative_control_a_recompute_sampling_its_next_token_changes_bits(
    serving_model, alone, monkeypatch
):
    """The recompute before session 8: its prefill computes the last token too and samples the
    next position plainly where the unpreempted sequence rejection-sampled it."""
    monkeypatch.setattr(Scheduler, "holds_last_token", lambda self, seq: False)
    e, got = preempted(serving_model)
    assert e.scheduler.num_preemptions > 0
    assert differing(got, alone) != []


def test_negative_control_drafting_at_the_prompts_last_token_changes_bits(
    serving_model, monkeypatch
):
    """With drafts allowed at the prompt's last token, a prompt whose last token falls alone
    into a decode step (33 tokens, budget 32: alone) rejection-samples its first output
    position, while batched behind others its prefill ends in one chunk and samples it
    plainly."""

    def old(self, seq):  # may_draft without its rejection-mode rule
        decoding = seq.status is Status.RUNNING and seq.num_uncomputed == 1
        return decoding and not seq.options.needs_logits_inputs

    monkeypatch.setattr(Speculator, "may_draft", old)
    reqs = [r for r in requests() if r[0].startswith("r33/")]
    ref = {}
    for req in reqs:
        ref.update(run(make_engine(serving_model, SPEC), [req]))
    e, got = batched(serving_model)
    assert differing({r: got[r] for r in ref}, ref) != []


def test_a_verify_larger_than_the_budget_is_refused_by_name(serving_model):
    with pytest.raises(ValueError, match="max_num_batched_tokens to at least 5"):
        Engine(serving_model, max_num_batched_tokens=4, min_tokens_bucket=4,
               speculative=dict(verify="rejection", num_tokens=4))  # fmt: skip
