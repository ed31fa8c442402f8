"""The host side of a decode step (issue 11) changes no placement and no bit: host token ids go
to the device as a committed array placed like the step's sampled tokens (one executable for
both), and prepare_ahead's cached sampling rows are those of a fresh build."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.engine import Engine
from serving.engine.sampler_variants import FULL, LEAN
from tests.serving.engine.test_async import SETTINGS as ASYNC_SETTINGS

# test_async.py's engine with a token budget of 16 (32 there): the step shapes this module runs
# (T = 4, 8, 16) are three of test_async's, one executable each for the run (the same process's
# jit cache, or the run's compile cache on the other xdist worker), not three more compiles
# (~7 CPU s). Nothing here depends on the KV pool's size.
SETTINGS = {**ASYNC_SETTINGS, "max_num_batched_tokens": 16}


def test_placed_tokens_are_device_puts_and_share_one_executable(serving_model):
    r = Engine(serving_model, **SETTINGS).runner
    x = np.arange(8, dtype=np.int32)
    from jdet.batch import StepBatch

    z = np.zeros(8, np.int32)
    got = r.place_tokens(StepBatch(x, z, z, z, z, z.reshape(8, 1), z)).token_ids
    want = jax.device_put(x, r.token_sharding)
    assert np.array_equal(np.asarray(got), x)
    assert got.sharding == want.sharding and got.committed and want.committed

    f = jax.jit(lambda t: t * 3)
    f(want)
    f(got)
    assert f._cache_size() == 1  # the step keyed on the placement: one executable for both
    # Negative control: an uncommitted device array is another placement to jit: a second entry
    f(jnp.asarray(x))
    assert f._cache_size() == 2


def test_ahead_sampling_rows_are_rebuilt_for_another_plan(serving_model, monkeypatch):
    """The rows prepare_ahead keeps belong to one plan; another plan (other sequences or order)
    gets its own, each row that of its sequence."""
    from serving.engine import step_inputs

    eng = Engine(serving_model, **SETTINGS, sampler_variants="lean-full")  # a GPU's set, anywhere
    params = [dict(temperature=0.5, top_k=3, top_p=0.9, seed=7),
              dict(temperature=0.0), dict(temperature=1.3, top_p=0.5, seed=2)]  # fmt: skip
    for i, p in enumerate(params):
        eng.add_request(f"r{i}", [1, 2, 3], dict(p, max_tokens=4))
    seqs = [eng.requests[f"r{i}"].seqs[0] for i in range(3)]
    r = eng.runner

    def rows(order):
        plan = [(seqs[i], 1) for i in order]
        *arrays, variant = step_inputs.ahead_rows(r, plan, 4)  # and the step's sampler variant
        # the variant of its rows: only the greedy sequence alone needs no top-k/top-p filter
        assert variant == (LEAN if order == [1] else FULL), order
        return [np.asarray(a).copy() for a in arrays]

    def expect(order):
        o = [seqs[i].options for i in order]
        pad = 4 - len(order)
        return [np.asarray([x.temperature for x in o] + [0] * pad, np.float32),
                np.asarray([x.top_k for x in o] + [0] * pad, np.int32),
                np.asarray([x.top_p for x in o] + [1] * pad, np.float32),
                np.asarray([seqs[i].seed for i in order] + [0] * pad, np.uint32)]  # fmt: skip

    for order in ([0, 1, 2], [0, 1, 2], [2, 0], [1], [0, 1, 2]):
        got, want = rows(order), expect(order)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and np.array_equal(g, w)
    # Negative control: the rows of one order are not those of another
    other = zip(rows([0, 1, 2]), expect([2, 1, 0]), strict=True)
    assert not all(np.array_equal(g, w) for g, w in other)


def _generate(model, monkeypatch, decode_path) -> dict:
    """Outputs of a mixed request set through the synchronous engine, with `decode_path`
    standing in for step_inputs.decode_inputs (None: the general build_batch path)."""
    from serving.engine import step_inputs

    if decode_path is not None:
        monkeypatch.setattr(step_inputs, "decode_inputs", decode_path)
    eng = Engine(model, **SETTINGS, async_scheduling="off")
    rng = np.random.default_rng(3)
    reqs = [dict(temperature=0.0, max_tokens=9, logprobs=2),
            dict(temperature=0.9, seed=4, max_tokens=12, n=2),
            dict(temperature=0.7, top_k=5, top_p=0.8, seed=1, max_tokens=10, ignore_eos=True),
            dict(temperature=1.0, seed=8, max_tokens=7, presence_penalty=0.5)]  # fmt: skip
    for i, p in enumerate(reqs):
        eng.add_request(f"r{i}", rng.integers(1, model.cfg.vocab_size, 5 + 3 * i).tolist(), p)
    out = {}
    for o in eng.run():
        for c in o.outputs:
            lp = np.asarray(c.logprobs, np.float32).tobytes()
            out[(o.request_id, c.index)] = (list(c.token_ids), lp, c.top_logprobs)
    monkeypatch.undo()
    return out


def test_decode_fast_path_gives_the_general_paths_bits(serving_model, monkeypatch):
    """The synchronous engine's decode steps (decode_batch + the plan's kept sampling rows) give
    the bits of build_batch's general path: tokens, log-probs, top log-probs, greedy and seeded,
    top-k/top-p, n > 1, and a penalised row (which takes the general path itself)."""
    from serving.engine import step_inputs

    real = step_inputs.decode_inputs
    calls = []

    def counted(self, *a):
        got = real(self, *a)
        calls.append(got is not None)
        return got

    fast = _generate(serving_model, monkeypatch, counted)
    assert sum(calls) > 5 and not all(calls)  # fast decode steps, and the penalised row's
    general = _generate(serving_model, monkeypatch, lambda self, *a: None)
    assert fast == general

    # Negative control: a fast path whose sampled position is one off changes seeded rows
    def off_by_one(self, *a):
        got = real(self, *a)
        if got is not None:
            got[1].position = got[1].position + 1
        return got

    assert _generate(serving_model, monkeypatch, off_by_one) != general
