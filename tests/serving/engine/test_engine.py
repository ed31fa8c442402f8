"""Engine behaviour on a tiny random Qwen3: stop strings across token boundaries, streaming deltas,
max_tokens / stop tokens, abort, validation, metrics, the offline backend, scheduling policy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.engine.llm_backend import generate
from tests.serving.engine.test_engine_invariance import PROBES, make_engine, run

MODE = "none"  # behaviour, not bits: the fast plain-XLA mode keeps these tests cheap


def pieces(tok, ids: list[int]) -> list[str]:
    """The text each token adds (what incremental detokenisation yields)."""
    out, prev = [], ""
    for i in range(len(ids)):
        cur = tok.decode(ids[: i + 1], skip_special_tokens=True)
        out.append(cur[len(prev) :])
        prev = cur
    return out


def find_boundary(tok, ids: list[int]) -> int | None:
    ps = pieces(tok, ids)
    for k in range(len(ps) - 1):
        a, b = ps[k], ps[k + 1]
        if a and b and (a + b).isprintable() and (a + b).isascii():
            return k
    return None


def test_stop_string_across_a_token_boundary_ends_and_is_removed(serving_model):
    eng = make_engine(serving_model, MODE)
    tok = serving_model.tokenizer
    rng = random.Random(0)
    for attempt in range(20):
        prompt = tok(f"The quick brown fox {attempt}")["input_ids"]
        params = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
        base = run(eng, [("base", prompt, params)])["base"].outputs[0]
        k = find_boundary(tok, base.token_ids)
        if k is not None:
            break
        rng.random()
    else:
        pytest.skip("no two adjacent printable tokens in 20 greedy outputs of the random model")
    ps = pieces(tok, base.token_ids)
    stop = ps[k][-1] + ps[k + 1][0]  # spans the boundary between tokens k and k+1
    cut = base.text.find(stop)
    got = run(eng, [("s", prompt, {**params, "stop": ["\x00never", stop]})])["s"].outputs[0]
    assert got.text == base.text[:cut] and stop not in got.text
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.token_ids == base.token_ids[: len(got.token_ids)]
    assert len(got.token_ids) < len(base.token_ids)


def test_streamed_deltas_add_up_to_the_final_text_and_never_leak_the_stop(serving_model):
    eng = make_engine(serving_model, MODE)
    tok = serving_model.tokenizer
    prompt = tok("hello world, hello")["input_ids"]
    base = run(eng, [("b", prompt, dict(temperature=0, max_tokens=30))])["b"].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 2] or "zz"
    eng.add_request("s", prompt, dict(temperature=0, max_tokens=30, stop=stop, logprobs=1))
    text, ids, lps, last = "", [], [], None
    while eng.has_unfinished():
        for o in eng.step():
            c = o.outputs[0]
            text += c.delta_text
            ids += c.delta_token_ids
            lps += c.logprobs[c.delta_start : len(c.token_ids)]
            last = o
    c = last.outputs[0]
    assert last.finished and text == c.text and ids == c.token_ids and lps == c.logprobs
    assert stop not in text


def test_max_tokens_and_stop_token_ids_end_the_sequence(serving_model):
    eng = make_engine(serving_model, MODE)
    ids, _ = PROBES["greedy"]
    a = run(eng, [("a", ids, dict(temperature=0, max_tokens=5, ignore_eos=True))])["a"]
    assert len(a.outputs[0].token_ids) == 5 and a.outputs[0].finish_reason == "length"
    third = a.outputs[0].token_ids[2]
    first_hit = a.outputs[0].token_ids.index(third)
    b = run(eng, [("b", ids, dict(temperature=0, max_tokens=5, stop_token_ids=[third]))])["b"]
    out = b.outputs[0]
    assert out.token_ids == a.outputs[0].token_ids[: first_hit + 1]
    assert out.finish_reason == "stop" and out.stop_reason == third


def test_generation_stops_at_max_model_len(serving_model):
    eng = make_engine(serving_model, MODE)
    prompt = [random.Random(1).randrange(1, 320) for _ in range(120)]
    o = run(eng, [("a", prompt, dict(temperature=0, max_tokens=None, ignore_eos=True))])["a"]
    assert len(o.outputs[0].token_ids) == 128 - 120 and o.outputs[0].finish_reason == "length"


def test_abort_in_any_state_returns_every_page(serving_model):
    eng = make_engine(serving_model, MODE, budget=16)
    rng = random.Random(2)
    for i in range(6):
        prompt = [rng.randrange(1, 320) for _ in range(rng.randrange(5, 40))]
        eng.add_request(f"r{i}", prompt, dict(max_tokens=30, ignore_eos=True, seed=i))
    assert eng.abort("r5")  # still waiting
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 3:
            assert eng.abort("r0")  # running (decoding) and in flight
        if steps == 4:
            assert eng.abort("r3")  # mid-prefill
        live = [s for r in eng.requests.values() for s in r.seqs if not s.is_finished]
        eng.page_manager.check(live)
    assert not eng.abort("r0") and not eng.abort("nope")
    eng.page_manager.check([])
    assert eng.page_manager.num_used == 0


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ([], {}, "empty"),
        ([1, 2, 320], {}, "vocabulary"),
        (list(range(1, 129)), {}, "max_model_len"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"logprobs": 21}, "logprobs"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"n": 0}, "n must"),
        ([1, 2], {"stop": [""]}, "stop"),
    ],
)
def test_bad_requests_are_refused_before_the_scheduler(serving_model, prompt, params, words):
    eng = make_engine(serving_model, MODE)
    with pytest.raises(ValueError, match=words):
        eng.add_request("x", prompt, params)
    assert not eng.has_unfinished() and not eng.scheduler.has_work()


def test_metrics_report_latency_tokens_pages_preemptions_and_prefix_hits(serving_model):
    eng = make_engine(serving_model, MODE, keep_raw_metrics=True)  # benchmarks opt in to raw
    ids, params = PROBES["greedy"]
    run(eng, [("a", ids, params)])
    run(eng, [("b", ids, params)])  # prefix hit
    text = eng.metrics.render().decode()
    for name in [
        "jdet_time_to_first_token_seconds_count 2.0",
        "jdet_inter_token_latency_seconds",
        "jdet_queue_time_seconds",
        "jdet_step_tokens",
        "jdet_kv_pages_in_use 0.0",
        "jdet_preemptions_total",
        "jdet_prefix_cache_hits_total 24.0",
    ]:
        assert name in text, name
    assert len(eng.metrics.raw.itl) == 2 * 11 and len(eng.metrics.raw.ttft) == 2


def test_an_engine_keeps_no_per_token_samples_by_default(serving_model):
    """Memory must not grow with the tokens served: the default engine keeps histograms only.
    Control: the opt-in engine of the test above keeps one sample per token."""
    eng = make_engine(serving_model, MODE)
    ids, params = PROBES["greedy"]
    run(eng, [("a", ids, params)])
    assert eng.metrics.raw is None
    assert "jdet_inter_token_latency_seconds_count 11.0" in eng.metrics.render().decode()


def test_offline_backend_returns_jdet_outputs_equal_to_the_engine(serving_model):
    import jdet

    eng = make_engine(serving_model, MODE)
    ids, params = PROBES["sampled"]
    direct = run(eng, [("d", ids, params)])["d"].outputs[0]
    sp = jdet.SamplingParams(**{k: v for k, v in params.items()})
    outs = generate(eng, [ids, ids], [sp, jdet.SamplingParams(temperature=0, max_tokens=3)])
    assert isinstance(outs[0], jdet.RequestOutput)
    assert outs[0].token_ids == direct.token_ids
    assert np.array_equal(outs[0].logprobs, np.asarray(direct.logprobs, np.float32))
    assert outs[0].outputs[0].seed == 1234 and len(outs[1].token_ids) == 3


def test_prefill_first_scheduling_gives_the_same_bits(serving_model):
    ids, params = PROBES["sampled"]
    a = run(make_engine(serving_model, MODE), [("p", ids, params)])["p"].outputs[0]
    b_eng = make_engine(serving_model, MODE, scheduling="prefill_first")
    reqs = [(f"o{i}", [i + 1] * (5 + i), dict(max_tokens=4)) for i in range(4)]
    b = run(b_eng, reqs + [("p", ids, params)])["p"].outputs[0]
    assert a.token_ids == b.token_ids and np.array_equal(a.logprobs, b.logprobs)


def test_stream_backend_yields_deltas_of_the_generate_text_and_frees_pages_when_dropped(
    serving_model,
):
    import jdet
    from serving.engine.llm_backend import stream

    eng = make_engine(serving_model, MODE)
    ids = serving_model.tokenizer("hello world")["input_ids"]
    sp = jdet.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = generate(eng, [ids], [sp])[0].text
    assert "".join(stream(eng, ids, sp)) == full
    it = stream(eng, ids, sp)
    next(it)
    it.close()  # the consumer walks away
    assert not eng.has_unfinished() and eng.page_manager.num_used == 0


@pytest.mark.parametrize("mode", ["tp", "batch", "none"])
def test_engines_on_one_model_share_one_compiled_step(serving_model, mode):
    """A second engine (or LLM) on the same model must not recompile every token bucket: the
    "tp" runtime once built a fresh jitted step per engine, costing minutes per engine on a GPU."""
    a, b = make_engine(serving_model, mode), make_engine(serving_model, mode, budget=16)

    def jitted(fn):  # each runner wraps the shared jit in its own fronts: the executable
        from jdet.exec_cache import CachedFn  # cache's, and the step's packed host inputs'
        from serving.engine.host_inputs import PackedStep

        fn = fn.fn if isinstance(fn, PackedStep) else fn
        return fn.fn if isinstance(fn, CachedFn) else fn

    assert jitted(a.runner.step_fn) is jitted(b.runner.step_fn)
    assert jitted(a.runner.score_step()) is jitted(b.runner.score_step())


def _fault_scenario(model):
    """Eight requests share the steps; "bad" raises inside the batch build once it has 2 tokens."""
    from tests.serving.engine.test_engine_invariance import others

    eng = make_engine(model, "tp")
    reqs = others(7, seed=31, long=True)
    bad_prompt = [random.Random(7).randrange(1, 320) for _ in range(30)]
    reqs.insert(3, ("bad", bad_prompt, dict(max_tokens=20, ignore_eos=True, seed=1)))
    fired = []

    def injector(seq):
        if seq.request_id == "bad" and seq.num_output_tokens >= 2:
            fired.append(sorted(r for r in eng.requests if r != "bad"))  # who was running too
            raise OverflowError("injected: a value the step's int32 arrays cannot hold")

    eng.fault_injector = injector
    for rid, ids, params in reqs:
        eng.add_request(rid, ids, params)
    return eng, reqs, fired


def test_a_fault_in_one_request_ends_it_alone_and_the_others_keep_their_bits(serving_model):
    from tests.serving.engine.test_engine_invariance import bits

    eng, reqs, fired = _fault_scenario(serving_model)
    got = {o.request_id: o for o in eng.run()}
    assert fired and len(fired[0]) == 7  # it fired mid-flight, with all seven others running
    bad = got["bad"]
    assert bad.finished and bad.error and "OverflowError" in bad.error
    assert bad.outputs[0].finish_reason == "error" and len(bad.outputs[0].token_ids) == 2
    eng.page_manager.check([])
    assert eng.page_manager.num_used == 0  # every page came back, the failed request's too
    assert 'jdet_requests_finished_total{reason="error"} 1.0' in eng.metrics.render().decode()
    ref = run(make_engine(serving_model, "tp"), [r for r in reqs if r[0] != "bad"])
    for rid in ref:
        assert got[rid].outputs[0].finish_reason == "length"
        for (t1, l1, k1), (t2, l2, k2) in zip(bits(ref[rid]), bits(got[rid]), strict=True):
            assert np.array_equal(t1, t2) and np.array_equal(l1, l2) and k1 == k2, rid


def test_negative_control_without_attribution_the_fault_ends_every_request(
    serving_model, monkeypatch
):
    """The same fault, with culprit-finding disabled: the step fails for all, which the test
    above would see as missing outputs. The engine still recovers to a clean, usable state."""
    from serving.engine import faults
    from serving.engine.faults import EngineStepError

    # the broken variant: no attribution, so the fault is the whole step's
    monkeypatch.setattr(faults, "raises", lambda build, item: False)
    eng, reqs, fired = _fault_scenario(serving_model)
    with pytest.raises(EngineStepError, match="OverflowError"):
        eng.run()
    assert fired and not eng.has_unfinished()
    eng.page_manager.check([])
    assert eng.page_manager.num_used == 0
    eng.fault_injector = None
    out = run(eng, reqs[:1])  # and it serves again
    assert out[reqs[0][0]].outputs[0].finish_reason == "length"


def test_an_unattributable_device_failure_resets_the_engine_which_serves_again(serving_model):
    """A failing device step (here: the dispatch raises) is nobody's fault: every request ends,
    the pages and prefix cache are reset, and later requests get the same bits as before."""
    from serving.engine.faults import EngineStepError
    from tests.serving.engine.test_engine_invariance import bits

    eng = make_engine(serving_model, "tp")
    ids, params = PROBES["sampled"]
    before = run(eng, [("p", ids, params)])["p"]
    real = eng.runner.dispatch
    eng.runner.dispatch = lambda *a: (_ for _ in ()).throw(RuntimeError("injected device error"))
    eng.add_request("q", ids, params)
    with pytest.raises(EngineStepError, match="injected device error"):
        eng.step()
    assert not eng.has_unfinished() and eng.page_manager.num_used == 0
    assert not eng.page_manager.hash_to_page  # K/V of a failed step is not trusted
    eng.runner.dispatch = real
    after = run(eng, [("p", ids, params)])["p"]
    for (t1, l1, k1), (t2, l2, k2) in zip(bits(before), bits(after), strict=True):
        assert np.array_equal(t1, t2) and np.array_equal(l1, l2) and k1 == k2


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"n": True}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": [320]}, "stop_token_ids"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop": ["a\ud800"]}, "stop"),
        ({"ignore_eos": "no"}, "ignore_eos"),
    ],
)
def test_values_the_step_arrays_cannot_hold_are_refused_at_admission(serving_model, params, field):
    """Each of these used to reach `ModelRunner.prepare` (an int32 overflow there ended every
    running request); now the shared check names the field and nothing is queued."""
    from serving.sampling_options import InvalidRequest

    eng = make_engine(serving_model, MODE)
    with pytest.raises(InvalidRequest, match=field) as e:
        eng.add_request("x", [1, 2, 3], params)
    assert e.value.field == field
    assert not eng.has_unfinished() and not eng.scheduler.has_work()


def test_llm_sampling_params_share_the_engine_bounds():
    import jdet
    from serving.sampling_options import InvalidRequest

    with pytest.raises(InvalidRequest, match="top_k"):
        jdet.SamplingParams(top_k=2**31)
    with pytest.raises(InvalidRequest, match="seed"):
        jdet.SamplingParams(seed=2**64)
    assert jdet.SamplingParams(top_k=2**31 - 1, seed=2**64 - 1).top_k == 2**31 - 1
