"""The KV pool's size on a device with a memory limit (serving/engine/memory.py).

A CPU reports no memory limit, so the GPU's sizing runs here under a simulated one: the device's
limit and bytes in use are stated, the step's peak is XLA's memory analysis of the real compiled
step (the CPU's). tests/serving/engine/test_memory_gpu.py builds a default engine on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from serving.engine import memory
from serving.engine.engine import Engine

SETTINGS = dict(max_num_batched_tokens=16, max_num_seqs=4, invariance="tp")


@pytest.fixture
def limit(monkeypatch, serving_model):
    """`set_pool(pages, utilization)` makes the device report a limit and bytes in use that leave
    exactly `pages` pages to the pool, as a GPU would report them (the engine's own headroom
    counted in, so the tiny model's pool stays small); returns (limit, in_use, peak)."""
    from jdet import compile_cache

    value = [0, 0]
    fake = lambda: tuple(value)  # noqa: E731
    monkeypatch.setattr(memory, "device_limit", fake)
    probe = Engine(serving_model, num_pages=48, **SETTINGS).runner
    peak = memory.step_peak(probe, compile_cache.exec_dir())  # what the engines will read
    page = memory.page_bytes_per_device(probe)

    def set_pool(pages: int, utilization: float = 0.5, in_use: int = 64 << 20) -> tuple:
        need = in_use + peak + memory.HEADROOM_BYTES + pages * page
        value[:] = [int(need / utilization) + 1, in_use]
        return value[0], value[1], peak

    return set_pool


def test_step_peak_does_not_grow_with_the_pool(serving_model):
    """The cache is donated and updated in place: the step's working memory is the same for a
    pool 16x larger, and the pool is aliased input to output (no second pool-sized array)."""
    eng = Engine(serving_model, num_pages=64, **SETTINGS)
    r = eng.runner
    batch, sampling = r.warmup_batch(r.shapes.all()[-1], "step")
    temps, aliases = [], []
    for pages in (64, 1024):
        kv = r.abstract_kv(pages)
        m = r.step_fn.lower(r.params, kv, batch, sampling).compile().memory_analysis()
        temps.append(m.temp_size_in_bytes)
        aliases.append(m.alias_size_in_bytes)
        pool = sum(a.size * a.dtype.itemsize for a in kv.values())
        assert m.alias_size_in_bytes >= pool, (m.alias_size_in_bytes, pool)
    assert temps[0] == temps[1], temps
    assert aliases[1] > aliases[0]


def test_pool_is_what_the_limit_leaves_after_weights_peak_and_headroom(serving_model, limit):
    lim, in_use, peak = limit(48)
    eng = Engine(serving_model, gpu_memory_utilization=0.5, **SETTINGS)
    b = eng.memory_budget
    assert (b.limit, b.in_use, b.utilization, b.peak) == (lim, in_use, 0.5, peak)
    assert peak > 0 and b.headroom == memory.HEADROOM_BYTES
    page = memory.page_bytes_per_device(eng.runner)
    assert b.for_pool // page == 48
    assert eng.page_manager.num_pages == eng.runner.num_pages == eng.runner.kv["k"].shape[2] == 48
    # the model's own length fits: max_model_len stays the model's
    assert eng.max_model_len == serving_model.cfg.max_position_embeddings


def test_pool_shorter_than_the_model_shortens_max_model_len(serving_model, limit):
    limit(20)  # 320 tokens: fewer than the model's 512 positions
    eng = Engine(serving_model, gpu_memory_utilization=0.5, **SETTINGS)
    assert eng.page_manager.num_pages == 20
    assert eng.max_model_len == 20 * 16 < serving_model.cfg.max_position_embeddings
    assert eng.runner.shapes.pages[-1] == 20


def test_a_model_that_does_not_fit_names_the_bytes_and_the_settings(serving_model, limit):
    limit(20, utilization=0.9)
    with pytest.raises(ValueError) as e:
        Engine(serving_model, gpu_memory_utilization=0.9, max_model_len=512, **SETTINGS)
    msg = str(e.value)
    for words in ("does not fit", "gpu_memory_utilization 0.9", "weights and other buffers in use",
                  "largest step's peak", "max_model_len=512", "tp"):  # fmt: skip
        assert words in msg, msg
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        Engine(serving_model, gpu_memory_utilization=1.5, **SETTINGS)


def test_a_sized_pool_gives_the_bits_of_an_explicit_one(serving_model, limit):
    sp = dict(max_tokens=6, temperature=0.0)
    ref = Engine(serving_model, num_pages=48, **SETTINGS)
    ref.add_request("a", [5, 6, 7, 8, 9, 10, 11], sp)
    (want,) = ref.run()
    limit(48)
    eng = Engine(serving_model, gpu_memory_utilization=0.5, **SETTINGS)
    eng.add_request("a", [5, 6, 7, 8, 9, 10, 11], sp)
    (got,) = eng.run()
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert np.array_equal(got.outputs[0].logprobs, want.outputs[0].logprobs)


def test_a_failed_try_frees_its_pool_before_the_next_smaller_one(monkeypatch):
    """A pool that fails to allocate is deleted at once (its error's traceback would keep it in a
    reference cycle), so the next, 10 % smaller try has the memory back; the tries stop at the
    first pool that fits."""
    import jax
    import jax.numpy as jnp

    made = []

    class Runner:
        kv = None

        def allocate_kv(self, num_pages):
            self.kv = {"k": jnp.zeros(4), "v": jnp.zeros(4)}
            made.append(self.kv)
            if num_pages > 50:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

    monkeypatch.setattr(memory, "largest_free_block", lambda: None)
    runner = Runner()
    assert memory.allocate_to_fit(runner, 100, keep_free=0) == 45  # 100, 90, ..., 51, 45
    assert len(made) == 8
    assert all(a.is_deleted() for kv in made[:-1] for a in kv.values())
    assert not any(a.is_deleted() for a in runner.kv.values())


def test_a_pool_that_never_fits_names_every_try_in_its_error(monkeypatch):
    """When no try fits, the error says what each met (the allocator's error, or the free block
    left beside an allocated pool), so a failure on a GPU explains itself."""
    import jax
    import jax.numpy as jnp

    class Runner:
        kv = None

        def allocate_kv(self, num_pages):
            self.kv = {"k": jnp.zeros(4), "v": jnp.zeros(4)}
            if num_pages > 5:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating")

    monkeypatch.setattr(memory, "largest_free_block", lambda: 1 << 20)  # 1 MiB: never enough
    with pytest.raises(MemoryError) as err:
        memory.allocate_to_fit(Runner(), 10, keep_free=1 << 30)
    msg = str(err.value)
    assert "10 pages: RESOURCE_EXHAUSTED: Out of memory allocating" in msg
    assert "1 pages: allocated, then a largest free block of 0.00 GiB" in msg  # the last try
    assert "10 tries:" in msg  # 10, 9, ..., 2, 1 pages, then 0 stops it


def test_a_deleted_llm_leaves_none_of_its_device_arrays(serving_model):
    """A second engine in one process sizes its pool from what the device has free, so the
    first must hand back all of its memory when it is deleted: weights it placed, the KV pool,
    sampling rows, executables' arguments. The control: while it lives, its arrays are live."""
    import gc

    import jax

    import jdet

    def new_arrays() -> list:
        return [a for a in jax.live_arrays() if id(a) not in before]

    gc.collect()
    before = {id(a) for a in jax.live_arrays()}
    llm = jdet.LLM(serving_model, num_pages=48, **SETTINGS)
    llm.generate([[5, 6, 7, 8], [9, 10]], jdet.SamplingParams(max_tokens=4, temperature=0.0))
    llm.generate([[5, 6, 7]], jdet.SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9,
                                                  seed=1, logprobs=2))  # fmt: skip
    llm.score([[5, 6, 7, 8, 9]])
    pool = llm.engine.runner.kv["k"]
    held = new_arrays()
    assert any(a is pool for a in held)  # the control: the check sees a live engine's arrays
    del llm, pool, held
    gc.collect()
    left = new_arrays()
    assert not left, [(a.shape, a.dtype) for a in left]


def test_a_failed_try_frees_a_half_pool_held_elsewhere(monkeypatch):
    """A try whose K half was made and whose V half failed leaves K referenced from outside the
    runner (here a list, on a GPU the error's traceback): it is deleted before the next try, and
    arrays of other shapes made meanwhile are left alone."""
    import jax
    import jax.numpy as jnp

    held, other = [], []

    class Runner:
        kv = None

        def abstract_kv(self, num_pages):
            return {n: jax.ShapeDtypeStruct((2, num_pages, 4), jnp.float32) for n in "kv"}

        def allocate_kv(self, num_pages):
            other.append(jnp.ones(3))  # not pool-shaped: never a stray
            held.append(jnp.zeros((2, num_pages, 4)))  # K, held outside the runner
            if num_pages > 50:
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (V)")
            self.kv = {"k": held[-1], "v": jnp.zeros((2, num_pages, 4))}

    monkeypatch.setattr(memory, "largest_free_block", lambda: None)
    runner = Runner()
    assert memory.allocate_to_fit(runner, 100, keep_free=0) == 45
    assert all(a.is_deleted() for a in held[:-1])  # every failed try's K
    assert not held[-1].is_deleted() and held[-1] is runner.kv["k"]
    assert not any(a.is_deleted() for a in other)


def test_a_pool_half_whose_partner_fails_is_deleted_before_the_error_leaves():
    """The pool's halves are made one at a time (jdet/kv_cache.py `make_halves`): when V's
    allocation fails, the K already made is deleted before the error propagates, so nothing of a
    failed try stays allocated; when both succeed, both are kept."""
    import jax
    import jax.numpy as jnp

    from jdet.kv_cache import make_halves

    made = []

    def make_then_fail():
        if made:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory (V)")
        made.append(jnp.zeros(8))
        return made[-1]

    with pytest.raises(jax.errors.JaxRuntimeError):
        make_halves(make_then_fail)
    assert len(made) == 1 and made[0].is_deleted()
    pool = make_halves(lambda: jnp.zeros(8))
    assert set(pool) == {"k", "v"} and not any(a.is_deleted() for a in pool.values())


def test_each_try_fits_a_half_to_the_largest_free_block(monkeypatch):
    """A half is one array, so the first try asks for no more pages than the allocator's largest
    free block holds (here 30 of the 100 the budget allows), not for 100, 90, ... in turn."""
    import jax
    import jax.numpy as jnp

    asked = []

    class Runner:
        kv = None
        kv_devices = 1

        def abstract_kv(self, num_pages):  # one page: 2 x 4 f32 = 32 bytes a half
            return {n: jax.ShapeDtypeStruct((2, num_pages, 4), jnp.float32) for n in "kv"}

        def allocate_kv(self, num_pages):
            asked.append(num_pages)
            self.kv = {n: jnp.zeros((2, num_pages, 4)) for n in "kv"}

    monkeypatch.setattr(memory, "largest_free_block", lambda: 30 * 32 + 5)
    assert memory.allocate_to_fit(Runner(), 100, keep_free=0) == 30
    assert asked == [30]
