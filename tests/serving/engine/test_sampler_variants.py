"""The engine picks the sampler variant of each step from its rows
(serving/engine/sampler_variants.py): the lean one (no top-k/top-p filter, no top log-probs) when no
row needs either, else the full one. A request's tokens, log-probs and top log-probs are bitwise the
same alone (its own variant) and batched with requests that need the other (np.array_equal), greedy
and seeded, synchronous and asynchronous (ahead) steps, with the variant switching mid-generation.

Negative control: a policy that runs every step lean (the filter dropped for a top-p row) makes
the top-p request's output differ from its own; a step that drops the top log-probs a request
asked for is refused by name rather than answered without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.engine import sampler_variants
from serving.engine.engine import Engine
from serving.engine.faults import EngineStepError
from serving.engine.sampler_variants import FULL, GREEDY, LEAN, ON_DEMAND

# One shape: T = S = 32 (a decode step's S bucket = its T bucket: it can go ahead), Pmax 8; so
# two executables, lean and full.
SETTINGS = dict(
    invariance="tp", max_num_batched_tokens=32, max_num_seqs=32, max_model_len=64, page_size=8,
    num_pages=48, min_tokens_bucket=32, min_pages_bucket=8,
)  # fmt: skip


def requests(vocab: int) -> dict[str, tuple[list[int], dict]]:
    rng = np.random.default_rng(3)
    p = [rng.integers(1, vocab, n).tolist() for n in (5, 12, 3, 9, 7)]
    common = dict(ignore_eos=True, max_tokens=12)
    return {
        "greedy": (p[0], dict(common, temperature=0.0)),
        "temperature": (p[1], dict(common, temperature=0.9, seed=3)),
        # these two end early: the batched run's later steps need neither (lean)
        "top_p": (p[2], dict(common, temperature=1.0, top_p=0.8, top_k=30, seed=4, max_tokens=5)),
        "top_logprobs": (p[3], dict(common, temperature=0.7, seed=5, logprobs=4, max_tokens=6)),
        "logprobs_only": (p[4], dict(common, temperature=1.0, seed=6, logprobs=0)),
    }


def spy(eng: Engine) -> list[sampler_variants.Variant]:
    """Record the variant of every step the engine dispatches."""
    seen: list[sampler_variants.Variant] = []
    inner = eng.runner.step_fn

    def step(params, kv, batch, sampling):  # noqa: ANN001, ANN202
        seen.append(sampler_variants.Variant(sampling.filter_topk_topp, sampling.top_logprobs,
                                             sampling.draw, sampling.logits is not None))
        return inner(params, kv, batch, sampling)

    eng.runner.step_fn = step
    return seen


def run(eng: Engine, reqs: dict) -> dict:
    for rid, (ids, params) in reqs.items():
        eng.add_request(rid, ids, params)
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    out = {}
    for rid, o in final.items():
        c = o.outputs[0]
        out[rid] = (list(c.token_ids), np.asarray(c.logprobs, np.float32), c.top_logprobs)
    return out


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.fixture(scope="module")
def engine(serving_model) -> Engine:
    """An engine runs `engine_variants()` (GREEDY and FULL on a CPU, LEAN and FULL on a GPU);
    these tests run LEAN and FULL on every platform, the pair whose bits they compare."""
    return Engine(serving_model, **SETTINGS, async_scheduling=True, sampler_variants="lean-full")


def test_a_request_has_the_same_bits_in_every_variant_that_serves_it(engine: Engine) -> None:
    reqs = requests(engine.cfg.vocab_size)
    seen = spy(engine)
    alone, used = {}, {}
    for rid, r in reqs.items():
        seen.clear()
        alone[rid] = run(engine, {rid: r})[rid]
        used[rid] = set(seen)
    assert used["greedy"] == used["temperature"] == used["logprobs_only"] == {LEAN}
    assert used["top_p"] == used["top_logprobs"] == {FULL}
    assert alone["top_logprobs"][2] is not None and len(alone["top_logprobs"][2][0]) == 4
    for async_scheduling in (True, False):
        engine.async_scheduling = async_scheduling
        ahead0 = engine.num_steps_ahead
        seen.clear()
        batched = run(engine, reqs)
        assert set(seen) == {LEAN, FULL} and seen[0] == FULL and seen[-1] == LEAN
        assert (engine.num_steps_ahead > ahead0) == async_scheduling
        for rid in reqs:
            assert same(batched[rid], alone[rid]), (rid, async_scheduling)
    engine.async_scheduling = True


def test_negative_control_a_step_run_lean_for_a_top_p_row_changes_its_bits(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = requests(engine.cfg.vocab_size)
    keep = ("greedy", "temperature", "top_p")
    want = run(engine, {rid: reqs[rid] for rid in keep})
    monkeypatch.setattr(sampler_variants, "step_variant", lambda *a: LEAN)  # broken
    got = run(engine, {rid: reqs[rid] for rid in keep})
    assert same(got["greedy"], want["greedy"]) and same(got["temperature"], want["temperature"])
    assert not same(got["top_p"], want["top_p"])
    # top log-probs asked for but not computed: refused, never answered without them
    engine.add_request("no-top", *reqs["top_logprobs"])
    with pytest.raises(EngineStepError, match="without top log-probs"):
        while engine.has_unfinished():
            engine.step()


def test_on_demand_greedy_steps_have_the_bits_of_every_other_variant(
    serving_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`jdet generate`'s set (ON_DEMAND: GREEDY first): a greedy request alone runs GREEDY (no
    draw, no transforms), and its bits equal those it gets batched with a temperature request
    and a greedy request with a logit bias (LEAN: draw and transforms built), sync and async.
    Control: a policy that runs GREEDY for every step drops the bias and the draw, and both
    other requests' outputs change."""
    eng = Engine(serving_model, **SETTINGS, async_scheduling=True, sampler_variants="on-demand")
    assert eng.runner.variants == ON_DEMAND
    reqs = requests(eng.cfg.vocab_size)
    greedy, common = reqs["greedy"], dict(ignore_eos=True, max_tokens=12)
    alone_tokens = run(eng, {"greedy": greedy})["greedy"][0]
    biased = (reqs["temperature"][0], dict(common, temperature=0.0,
                                           logit_bias={alone_tokens[3]: 4.0}))  # fmt: skip
    mix = {"greedy": greedy, "temperature": reqs["temperature"], "biased": biased}
    seen = spy(eng)
    alone = {rid: run(eng, {rid: r})[rid] for rid, r in mix.items()}
    assert seen[0] == GREEDY and set(seen) == {GREEDY, LEAN}  # greedy alone: GREEDY only
    for async_scheduling in (True, False):
        eng.async_scheduling = async_scheduling
        seen.clear()
        batched = run(eng, mix)
        assert set(seen) == {LEAN}
        for rid in mix:
            assert same(batched[rid], alone[rid]), (rid, async_scheduling)
    monkeypatch.setattr(sampler_variants, "step_variant", lambda *a: GREEDY)  # broken
    broken = run(eng, mix)
    assert same(broken["greedy"], alone["greedy"])
    assert not same(broken["temperature"], alone["temperature"])
    assert not same(broken["biased"], alone["biased"])
