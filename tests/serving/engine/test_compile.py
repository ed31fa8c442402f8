"""No compile stalls: after warm-up, no request mix compiles anything; the server is not ready
before it is warm; the persistent compilation cache changes no bits across processes.

Compilations are counted from `jax.monitoring` events (jdet/compile_cache.py).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jdet
from jdet import compile_cache, exec_cache
from jdet.plan import backend
from serving.engine import sampler_variants
from serving.engine.host_inputs import SplitScore, split_step_here

# One xdist worker for the whole module (tests/conftest.py: --dist loadgroup): the warm-up tests
# compile the same step shapes (SETTINGS, 10 pages), which the server test then finds compiled
# in its process (serial, CPU s at load ~9: 47 for the first warm-up test, 1.3 for the server
# test after it; alone on a worker it builds them itself: compiles, or loads from the run's
# shared compile cache if the other worker got there first).
pytestmark = pytest.mark.xdist_group("compile")

ROOT = Path(__file__).resolve().parents[3]
MODE = "tp"  # the default mode, on the sharded runtime
# A small shape set: T in {16, 32}, S = T capped at 4, Pmax in {4, 8} pages of 8, T = 32 (above
# the stall-free budget: steps without decodes) at Pmax 8 only -> 3 step shapes, 2 score shapes.
SETTINGS = dict(
    invariance=MODE,
    min_tokens_bucket=16,  # pinned (a CPU's default is 8: serving/engine/shapes.py)
    max_num_batched_tokens=32,
    stall_free_budget=16,
    max_num_seqs=4,
    max_model_len=64,
    page_size=8,
    min_pages_bucket=4,
)


def workload(llm: jdet.LLM, with_score: bool = True) -> list:
    """Lengths 1..max_model_len, batches of 1..max_num_seqs, prefix hits, preemption (the pool
    holds 1.25 full sequences), n > 1, logprobs, stop strings, seeded and greedy, scoring."""
    rng = np.random.default_rng(0)
    V = llm.cfg.vocab_size
    prompts = [rng.integers(1, V, n).tolist() for n in (1, 2, 7, 9, 17, 30, 33, 47, 55)]
    outs = []
    sp = [
        jdet.SamplingParams(temperature=0.0, max_tokens=min(8, 63 - len(p)), ignore_eos=True)
        for p in prompts
    ]
    outs += llm.generate(prompts, sp)  # up to 4 at a time, long ones preempted (pool of 10 pages)
    outs += llm.generate(prompts[6], sp[6])  # batch 1, prefix-cache hit
    outs += llm.generate(
        [prompts[3], prompts[1]],
        jdet.SamplingParams(temperature=0.9, top_p=0.8, top_k=5, n=3, seed=3, max_tokens=9,
                            logprobs=5),
    )  # fmt: skip
    outs += llm.generate("Tell me about", jdet.SamplingParams(max_tokens=20, stop=["e"]))
    # per-request logits transforms and structured output (issue 19), batched with plain rows
    opts = [
        dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
        dict(logit_bias={5: 10.0, 6: -100.0}, min_p=0.1, temperature=1.0, seed=1),
        dict(min_tokens=4, stop_token_ids=[7], bad_words=["the"]),
        dict(allowed_token_ids=[10, 11, 12]),
        dict(regex="[a-z]{1,5}"),
        dict(choice=["yes", "no"]),
        dict(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}),
    ]
    outs += llm.generate(
        [prompts[i % len(prompts)] for i in range(len(opts))] + [prompts[0]],
        [jdet.SamplingParams(max_tokens=8, **o) for o in opts] + [sp[0]],
    )
    if not with_score:
        return outs
    scores = llm.score([p + [1, 2] for p in prompts[2:]] + [prompts[-1] * 1])
    return outs + scores


def test_after_warmup_no_request_mix_compiles(serving_model, capsys):
    llm = jdet.LLM(serving_model, **SETTINGS, num_pages=10, warmup=True)
    shapes = llm.engine.runner.shapes.all()
    assert sorted(shapes) == [(16, 4, 4), (16, 4, 8), (32, 4, 8)]
    assert llm.engine.runner.shapes.all("score") == [(16, 4, 4), (16, 4, 8)]
    llm.engine.warmup("score")  # score() warms on first use too; done here to count after
    llm.generate([1, 2, 3], jdet.SamplingParams(max_tokens=2))  # first use: step warm-up
    assert "shape 3/3" in capsys.readouterr().err  # the progress bar names shape k of n
    assert llm.engine.warm == {"step", "score"}
    before = compile_cache.stats()
    workload(llm)
    assert llm.engine.scheduler.num_preemptions > 0  # the mix did include preemption
    assert llm.engine.page_manager.prefix_hits > 0
    assert compile_cache.stats().compiles == before.compiles

    # Negative control: a request on an engine whose shapes were not compiled (another KV pool
    # size is another executable) does compile, so the counter sees a request's compiles.
    cold = jdet.LLM(serving_model, **SETTINGS, num_pages=12, warmup=False)
    before = compile_cache.stats()
    cold.generate([1, 2, 3], jdet.SamplingParams(max_tokens=2))
    assert compile_cache.stats().compiles > before.compiles


def test_after_warmup_speculative_traffic_compiles_nothing(serving_model):
    """Speculative verifies (K + 1 sampled rows per sequence) run only shapes of the set, which
    a speculative engine widens in S (max_num_seqs * (K + 1) rows) and warms up. One token
    bucket (T = 32) and both page buckets: 2 shapes to compile, not 4 (the test above covers
    a set that varies in T too); S is still widened."""
    spec = jdet.SpeculativeConfig(method="ngram", num_tokens=4)
    settings = {**SETTINGS, "min_tokens_bucket": 32}
    llm = jdet.LLM(serving_model, **settings, num_pages=10, warmup=True, speculative=spec)
    assert llm.engine.runner.shapes.max_seqs == 4 * 5
    assert sorted(llm.engine.runner.shapes.all()) == [(32, 20, 4), (32, 20, 8)]
    llm.generate([1, 2, 3], jdet.SamplingParams(max_tokens=2))  # first use: step warm-up
    before = compile_cache.stats()
    copy = [5, 6, 7, 8, 9, 10] * 4  # n-gram drafts that the model accepts now and then
    outs = llm.generate([copy, copy[:13]], jdet.SamplingParams(temperature=0.0, max_tokens=30,
                                                               ignore_eos=True))  # fmt: skip
    outs += workload(llm, with_score=False)
    assert llm.engine.speculator.stats()["draft_tokens"] > 0
    assert llm.engine.scheduler.num_preemptions > 0
    assert compile_cache.stats().compiles == before.compiles
    assert len(outs) > 10


def test_server_reports_warming_up_until_every_shape_is_compiled(serving_model):
    from fastapi.testclient import TestClient

    from serving.engine.engine import Engine
    from serving.http.server import build_app

    eng = Engine(serving_model, **SETTINGS, num_pages=10)
    gate = threading.Event()
    real = eng.runner.warmup

    def gated(*a, **kw):
        gate.wait(60)
        return real(*a, **kw)

    eng.runner.warmup = gated
    with TestClient(build_app(eng, model_name="m", fingerprint="fp")) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "warming up"})
        assert "jdet_warm 0.0" in c.get("/metrics").text
        gate.set()
        deadline = time.time() + 300
        while c.get("/health").status_code != 200 and time.time() < deadline:
            time.sleep(0.2)
        assert c.get("/health").json()["status"] == "ok"
        text = c.get("/metrics").text
        assert "jdet_warm 1.0" in text and "jdet_compilations_total" in text
        assert eng.runner.shapes_seen == set(eng.runner.shapes.all())
        before = compile_cache.stats()
        r = c.post("/v1/completions", json={"model": "m", "prompt": "Tell me", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert compile_cache.stats().compiles == before.compiles


_RUN = r"""
import json, sys
import numpy as np
import jdet
from jdet import compile_cache, exec_cache
cache = sys.argv[2] if sys.argv[2] != "off" else False
llm = jdet.LLM(jdet.load(sys.argv[1], dtype="float32"), invariance="tp", max_num_batched_tokens=16,
               max_num_seqs=4, max_model_len=48, page_size=8, min_pages_bucket=6,
               min_tokens_bucket=16, compile_cache=cache, warmup=True)
def bits(seed):
    sp = jdet.SamplingParams(temperature=0.8, seed=seed, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8, 9], [11, 3]], sp)
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [np.asarray(o.outputs[0].logprobs, np.float32).tobytes().hex() for o in outs],
    }
res = bits(5)
res["score"] = np.asarray(llm.score([[5, 6, 7, 8, 9, 1, 2]])[0], np.float32).tobytes().hex()
s = compile_cache.stats()
res.update(compiles=s.compiles, hits=s.cache_hits, traced=compile_cache.traced(),
           exec=exec_cache.stats())
if sys.argv[3] == "control":
    res["other_seed"] = bits(6)
print(json.dumps(res))
"""


def test_bits_are_the_same_with_and_without_the_cache_and_after_a_restart(
    serving_model_dir, tmp_path
):
    """Three starts: cold (empty caches), off (no cache at all; run beside the cold one: both
    compile), warm (the caches the cold one wrote; jdet's executable cache skips tracing). The
    warm start finds its score entry corrupt: it falls back to a compile, with a warning."""
    cache = tmp_path / "xla"

    def start(setting: str, control: bool = False) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("JDET_EXEC_CACHE", None)
        args = [str(serving_model_dir), setting, "control" if control else "-"]
        return subprocess.Popen(
            [sys.executable, "-c", _RUN, *args], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def result(p: subprocess.Popen) -> dict:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        return {**json.loads(out.strip().splitlines()[-1]), "stderr": err}

    cold_p, off_p = start(str(cache), control=True), start("off")
    cold, off = result(cold_p), result(off_p)
    assert any(cache.iterdir()), "the first process wrote no cache entries"
    entries, files = {}, sorted((cache / "exec").glob("*.jdetexe"))
    for f in files:
        entries[json.loads(pickle.loads(f.read_bytes())["parts"])["fn"].split("_")[-1]] = f
    # one shape each in this set: the step in each sampler variant
    # (serving/engine/sampler_variants.py), or split (serving/engine/host_inputs.py `SplitStep`)
    # one forward for every variant and a sampler for each
    split = split_step_here()
    variants = len(sampler_variants.engine_variants())
    n_step = 1 + variants if split else variants
    names = ["forward", "sampler"] if split else ["step"]
    assert sorted(entries) == sorted(["score", *names]) and len(files) == n_step + 1
    entries["score"].write_bytes(b"corrupt")
    warm = result(start(str(cache)))
    assert cold["hits"] == 0 and off["hits"] == 0
    # the restart compiled nothing: every executable came from a cache
    assert warm["hits"] > 0 and warm["compiles"] == warm["hits"]
    # ... and traced no step and no sampler: their executables came from jdet's cache (the cold
    # start traced them). Split, the score is the step's forward, a jit named `step`
    # (`SplitScore`): there the corrupt score entry below is its one trace
    assert cold["traced"].get("step", 0) >= 1 and cold["exec"]["writes"] == n_step + 1
    assert warm["traced"].get("step", 0) == (1 if split else 0)
    assert warm["traced"].get("sampler", 0) == 0
    assert warm["exec"]["loads"] == n_step
    # the corrupt score entry: a warning, a compile (an XLA cache hit), the entry rewritten
    # (on a CPU the entry is not rewritten: an executable JAX's persistent cache loaded fails
    # when run after a round trip, jdet/exec_cache.py `warm`; elsewhere it is)
    assert warm["exec"]["errors"] == 1
    assert warm["exec"]["writes"] == (0 if jax.default_backend() == "cpu" else 1)
    assert "jdet exec cache: could not use" in warm["stderr"]
    assert warm["traced"].get("step" if split else "score", 0) == 1
    assert [off["exec"][k] for k in ("loads", "writes", "errors")] == [0, 0, 0]
    for other in (warm, off):
        assert other["tokens"] == cold["tokens"]
        assert other["logprobs"] == cold["logprobs"] and other["score"] == cold["score"]
    # Negative control of the comparison: another seed does change the bits it compares.
    assert cold["other_seed"]["tokens"] != cold["tokens"]
    assert cold["other_seed"]["logprobs"] != cold["logprobs"]


def test_the_engine_config_decides_whether_a_first_call_loads_the_executable(serving_model):
    """`EngineConfig.exec_cache_on_call` (what `jdet generate` sets) reaches the cached step and
    score functions; off by default, where only warm-up loads (jdet/exec_cache.py)."""
    from serving.engine.engine import Engine

    for on in (False, True):
        runner = Engine(serving_model, **SETTINGS, num_pages=10, exec_cache_on_call=on).runner
        score = runner.score_step()  # a CachedFn, or on a CPU a SplitScore around one
        cached = [runner.step_fn.fn, score.fn if isinstance(score, SplitScore) else score]
        assert all(isinstance(f, exec_cache.CachedFn) for f in cached), cached
        assert [f.load_on_call for f in cached] == [on, on]


def test_shape_set_is_bounded_and_covers_every_step():
    from serving.engine.shapes import ShapeSet

    s = ShapeSet.build(max_num_batched_tokens=512, max_num_seqs=256, max_pages=512,
                       min_tokens_bucket=16)  # fmt: skip
    assert s.tokens == (16, 32, 64, 128, 256, 512) and s.pages == (32, 128, 512)
    # the default smallest bucket: the CPU kernels' 8-row dot block on a CPU, with a 1-token
    # bucket below it (batch-1 decode: serving/engine/shapes.py single_token_bucket), 16 elsewhere
    # (no 1-token bucket where the small row blocks are not verified: pallas_kernels/xla_fixed.py)
    cpu = jax.default_backend() == "cpu"
    single = backend().small_row_blocks
    d = ShapeSet.build(max_num_batched_tokens=512, max_num_seqs=256, max_pages=512)
    assert d.tokens == ((1,) if single else ()) + ((8,) if cpu else ()) + (16, 32, 64, 128, 256,
                                                                          512)  # fmt: skip
    assert d.fit(1, 1, 1) == ((1, 1, 32) if single else (8, 8, 32) if cpu else (16, 16, 32))
    assert len(s.all()) == 18
    assert s.fit(1, 1, 1) == (16, 16, 32)
    assert s.fit(300, 256, 129) == (512, 256, 512)
    assert ShapeSet.build(max_num_batched_tokens=512, max_num_seqs=8, max_pages=2560).pages == (
        32, 128, 512, 2560,
    )  # fmt: skip
    with pytest.raises(ValueError, match="outside the engine's shape set"):
        s.fit(513, 1, 1)
    with pytest.raises(ValueError, match="min_pages_bucket must be >= 1"):
        ShapeSet.build(max_num_batched_tokens=8, max_num_seqs=8, max_pages=8, min_pages_bucket=0)


def test_after_warmup_every_sampler_call_runs_its_warmed_executable(serving_model):
    """Warm-up makes each sampler from the logits' shape and placement alone (host_inputs.py
    `SplitStep.warm`), never running the forward: if that stand-in differed from the forward's
    real output, every step would miss the executable and run the plain jit (a trace per
    process). Control: with the warmed executables dropped, the same call runs the plain jit."""
    from jdet.exec_cache import CachedFn

    llm = jdet.LLM(serving_model, **SETTINGS, num_pages=10, warmup=True)
    sampler = getattr(llm.engine.runner.step_fn, "sampler", None)
    if not isinstance(sampler, CachedFn):
        pytest.skip("the step is one program, or the executable cache is off")

    class Spy:
        def __init__(self, fn):
            self.fn, self.calls = fn, 0

        def __call__(self, *a):
            self.calls += 1
            return self.fn(*a)

        def __getattr__(self, name):
            return getattr(self.fn, name)

    sampler.fn = spy = Spy(sampler.fn)
    sp = [jdet.SamplingParams(max_tokens=4, temperature=0.0),
          jdet.SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1, logprobs=2)]
    want = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9]], sp)  # warm-up, then the requests
    assert spy.calls == 0
    sampler._exes.clear()  # the control
    got = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9]], sp)
    assert spy.calls > 0
    for w, g in zip(want, got, strict=True):  # and the plain jit gives the same bits
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        assert np.array_equal(w.outputs[0].logprobs, g.outputs[0].logprobs)


def test_step_programs_chooses_split_or_fused_and_refuses_other_values():
    """EngineConfig.step_programs picks the step's programs; "auto" is split (on every
    backend); anything else is refused by name rather than read as either."""
    assert split_step_here("auto") and split_step_here()  # the default
    assert split_step_here("split")
    assert not split_step_here("fused")
    with pytest.raises(ValueError, match="step_programs='1'"):
        split_step_here("1")


def test_the_fused_step_gives_the_split_steps_bits(serving_model):
    """The fused step (one program per shape and variant) and the default split one (the
    forward, then the sampler) on one model: equal tokens, log-probs and top log-probs, greedy
    and sampled, and equal score(). Control: the comparison sees a changed seed."""
    import dataclasses

    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    greedy = jdet.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    sampled = jdet.SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6, logprobs=3,
                                  ignore_eos=True)  # fmt: skip

    def run(step_programs: str, seed: int = 3) -> tuple:
        llm = jdet.LLM(serving_model, **SETTINGS, num_pages=10, warmup=False,
                       step_programs=step_programs)  # fmt: skip
        got = llm.generate(prompts, [greedy, dataclasses.replace(sampled, seed=seed)])
        outs = [(o.token_ids, np.asarray(o.outputs[0].logprobs), o.outputs[0].top_logprobs)
                for o in got]  # fmt: skip
        return outs, [np.asarray(x) for x in llm.score([p + [3, 4] for p in prompts])]

    split, fused = run("split"), run("fused")
    for (ta, la, pa), (tb, lb, pb) in zip(split[0], fused[0], strict=True):
        assert ta == tb and np.array_equal(la, lb) and pa == pb
    assert all(np.array_equal(a, b) for a, b in zip(split[1], fused[1], strict=True))
    other = run("fused", seed=4)[0][1]
    assert (other[0], other[1].tobytes()) != (fused[0][1][0], fused[0][1][1].tobytes())
