"""The sampler's static variants (SamplingInputs.filter_topk_topp, .top_logprobs): a row's token
and log-prob are the same bits whichever variant the step ran, as long as the variant serves the
row (filter on for a row that filters; top log-probs when asked). Greedy, plain-temperature and
top-k/top-p rows, alone and batched, in "tp" and "none", on the CPU's sampler and on the GPU's
(the platform patched: the filter is a select there, not a cond).

Negative control: a deliberately broken variant whose filter touches rows that do not ask for it
(every row cut to its top 3) makes a plain-temperature row batched with a top-p row differ from
the same row in the lean variant.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet.sampling as sampling_mod
from jdet.exec_key import args_signature
from jdet.ops import Ops
from jdet.sampling import MAX_LOGIT_BIAS, NUM_TOP, LogitsInputs, SamplingInputs, sample

V = 320
# (temperature, top_k, top_p): greedy, plain temperature, and filtering rows, interleaved
ROWS = [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 5, 1.0), (0.0, 0, 1.0), (0.9, 0, 0.7),
        (1.3, 0, 1.0), (0.7, 40, 0.9), (1.0, 0, 1.0), (1.1, 0, 1.0)]  # fmt: skip
PLAIN = [i for i, (_, k, p) in enumerate(ROWS) if k == 0 and p == 1.0]
GREEDY = [i for i, (t, _, _) in enumerate(ROWS) if t == 0.0]
VARIANTS = [(f, t) for f in (False, True) for t in (0, NUM_TOP)]  # all four


N = len(ROWS)  # every batch has N slots: a row "alone" is a row among padding rows, as in a step


def inputs(rows: list[int], filt: bool = True, top: int = NUM_TOP, draw: bool = True,
           logits: LogitsInputs | None = None) -> SamplingInputs:  # fmt: skip
    """Slot j samples as ROWS[rows[j]] (seed and position of that row); slots past len(rows)
    are padding (greedy, no filter), as the engine pads a step's rows."""
    pad = N - len(rows)
    t, k, p = (np.array([ROWS[i][j] for i in rows] + [(0.0, 0, 1.0)[j]] * pad) for j in range(3))
    return SamplingInputs(
        temperature=jnp.asarray(t, jnp.float32), top_k=jnp.asarray(k, jnp.int32),
        top_p=jnp.asarray(p, jnp.float32),
        seed=jnp.asarray(np.array(rows + [0] * pad) * 7 + 3, jnp.uint32),
        position=jnp.asarray(np.array(rows + [0] * pad) + 40, jnp.int32), filter_topk_topp=filt,
        top_logprobs=top, draw=draw, logits=logits,
    )  # fmt: skip


@pytest.fixture(scope="module")
def logits() -> jax.Array:
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(0, 3, (len(ROWS), V)).astype(np.float32))


@functools.cache
def sampler(mode: str, platform: str, patched: bool = False) -> Callable:
    """One jit per (mode, platform, patch): a variant or a row count is a retrace of it."""
    ops = Ops(invariance=mode)
    return jax.jit(lambda lg, inp: sample(lg, inp, ops))


def run(logits: jax.Array, rows: list[int], mode: str, filt: bool, top: int,
        patched: bool = False, draw: bool = True, transforms: LogitsInputs | None = None,
        ) -> dict:  # fmt: skip
    from pallas_kernels import _platform

    fn = sampler(mode, _platform.platform(), patched)
    lg = jnp.zeros_like(logits).at[: len(rows)].set(logits[np.array(rows)])  # padding: zeros
    out = fn(lg, inputs(rows, filt, top, draw, transforms))
    return {k: np.asarray(v)[: len(rows)] for k, v in dataclasses.asdict(out).items()}


def same(a: dict, b: dict, with_top: bool) -> bool:
    keys = ["tokens", "logprobs"] + (["top_ids", "top_logprobs"] if with_top else [])
    return all(np.array_equal(a[k], b[k]) for k in keys)


def pick(out: dict, idx: list[int]) -> dict:
    return {k: v[np.array(idx)] for k, v in out.items()}


def check_variants(logits: jax.Array, mode: str) -> None:
    """Every row's bits in every variant that serves it are those of the full sampler."""
    every = list(range(N))
    full = run(logits, every, mode, True, NUM_TOP)  # the sampler as every step ran it before
    assert full["top_ids"].shape == (N, NUM_TOP)
    for f, t in VARIANTS:
        if f:  # a variant that filters serves every row: the whole batch
            assert same(run(logits, every, mode, f, t), full, with_top=t > 0), (f, t)
        # the greedy and plain-temperature rows without the filtering ones (they move to the
        # first slots; padding after), in every variant
        out = run(logits, PLAIN, mode, f, t)
        assert out["top_ids"].shape == (len(PLAIN), t)
        assert same(out, pick(full, PLAIN), with_top=t > 0), (f, t)
    # each row alone (slot 0, padding after) in the cheapest variant that serves it
    for i in every:
        f = i not in PLAIN
        assert same(run(logits, [i], mode, f, 0), pick(full, [i]), with_top=False), i


@pytest.mark.parametrize(
    "mode,code",
    [("tp", "native"), ("none", "native"), ("none", "gpu"),
     # the "tp" kernels under the GPU's sampler code need a GPU: deselected on a CPU, not skipped
     pytest.param("tp", "gpu", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_row_bits_do_not_depend_on_the_sampler_variant(
    logits: jax.Array, mode: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`code` "gpu": the GPU's sampler code (the filter a select, the draw unconditional) on
    this platform, in "none" (the "tp" kernels need a GPU there)."""
    from pallas_kernels import _platform

    if code == "gpu" and _platform.platform() != "gpu":
        assert mode == "none", "the 'tp' kernels with the GPU's sampler code need a GPU"
        monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    check_variants(logits, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tp", "none"])
def test_gpu_row_bits_do_not_depend_on_the_sampler_variant_at_a_real_vocabulary(mode: str) -> None:
    """The same on the device at Qwen3's vocabulary (the cub sort and top_k of a real width)."""
    rng = np.random.default_rng(1)
    check_variants(jnp.asarray(rng.normal(0, 3, (N, 151936)).astype(np.float32)), mode)


def test_negative_control_a_variant_that_filters_other_rows_changes_bits(
    logits: jax.Array, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broken: with the filter on, every row is cut to its top 3 (not only the rows that ask).
    A plain-temperature row batched with filtering rows then leaves the lean variant's bits."""
    every = list(range(N))
    lean = run(logits, PLAIN, "tp", False, 0)
    assert same(pick(run(logits, every, "tp", True, 0), PLAIN), lean, with_top=False)  # sound
    real = sampling_mod._top_k_top_p
    monkeypatch.setattr(sampling_mod, "_top_k_top_p",
                        lambda s, k, p, ops: real(s, jnp.full_like(k, 3), p, ops))  # fmt: skip
    broken = pick(run(logits, every, "tp", True, 0, patched=True), PLAIN)
    assert not np.array_equal(broken["tokens"], lean["tokens"])
    assert not np.array_equal(broken["logprobs"], lean["logprobs"])


def test_variants_are_distinct_executables_and_keys() -> None:
    """The flags are static (part of the pytree structure): another jit trace and another
    executable-cache key (jdet/exec_key.py), never a silent reuse of the other variant."""
    lean, full = inputs(PLAIN, False, 0), inputs(PLAIN, True, NUM_TOP)
    assert jax.tree_util.tree_structure(lean) != jax.tree_util.tree_structure(full)
    assert len(jax.tree_util.tree_leaves(lean)) == len(jax.tree_util.tree_leaves(full))
    assert args_signature([lean]) != args_signature([full])
    assert args_signature([lean]) == args_signature([inputs(PLAIN, False, 0)])
    assert args_signature([full]) != args_signature([inputs(PLAIN, True, 0)])


@pytest.mark.parametrize("top", [1, 5, 21, True, -1])
def test_unsupported_top_logprobs_bucket_is_refused_by_name(top: int) -> None:
    with pytest.raises(ValueError, match="top_logprobs must be 0 or NUM_TOP"):
        inputs(PLAIN, True, top)
    with pytest.raises(TypeError, match="filter_topk_topp must be a bool"):
        inputs(PLAIN, np.bool_(True), 0)  # type: ignore[arg-type]


def neutral_transforms(bias: float = 0.0) -> LogitsInputs:
    """LogitsInputs that change nothing (the engine's cached neutral rows), or, with `bias`,
    a logit bias on token 7 of every row."""
    f = lambda v: jnp.full(N, v, jnp.float32)  # noqa: E731
    bias_ids = np.full((N, MAX_LOGIT_BIAS), -1, np.int32)
    bias_ids[:, 0] = 7 if bias else -1
    return LogitsInputs(
        min_p=f(0.0), presence=f(0.0), frequency=f(0.0), repetition=f(1.0),
        pen_ids=jnp.full((N, 64), -1, jnp.int32), pen_counts=jnp.zeros((N, 64), jnp.int32),
        bias_ids=jnp.asarray(bias_ids),
        bias_vals=jnp.zeros((N, MAX_LOGIT_BIAS), jnp.float32).at[:, 0].set(bias),
        mask=jnp.full((N, -(-V // 32)), -1, jnp.int32),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["tp", "none"])
def test_greedy_rows_have_the_same_bits_without_draw_and_transforms(
    logits: jax.Array, mode: str
) -> None:
    """The GREEDY variant (serving/engine/sampler_variants.py: draw=False, logits None, no filter,
    no top log-probs) gives a greedy row the bits of the full sampler with neutral transforms,
    alone and with the other greedy rows, whatever the rows batched with it in the full step."""
    every = list(range(N))
    full = run(logits, every, mode, True, NUM_TOP, transforms=neutral_transforms())
    lean = run(logits, GREEDY, mode, False, 0, transforms=neutral_transforms())
    greedy = run(logits, GREEDY, mode, False, 0, draw=False)
    assert greedy["top_ids"].shape == (len(GREEDY), 0)
    assert same(greedy, pick(full, GREEDY), with_top=False)
    assert same(greedy, lean, with_top=False)
    for i in GREEDY:
        assert same(run(logits, [i], mode, False, 0, draw=False), pick(full, [i]), with_top=False)


def test_negative_control_greedy_variant_for_rows_it_does_not_serve_changes_bits(
    logits: jax.Array,
) -> None:
    """A policy that ran GREEDY for rows it does not serve would be caught: a temperature row
    without the draw (its argmax instead of its draw), and a greedy row with a logit bias
    without its transforms, each change their tokens."""
    temp = [i for i in PLAIN if ROWS[i][0] > 0]
    drawn = run(logits, temp, "tp", False, 0)
    assert not np.array_equal(run(logits, temp, "tp", False, 0, draw=False)["tokens"],
                              drawn["tokens"])  # fmt: skip
    biased = run(logits, GREEDY, "tp", False, 0, transforms=neutral_transforms(100.0))
    plain = run(logits, GREEDY, "tp", False, 0, draw=False)
    assert not np.array_equal(plain["tokens"], biased["tokens"])
    assert np.array_equal(plain["tokens"], run(logits, GREEDY, "tp", False, 0)["tokens"])


def test_draw_flag_is_static_and_refused_unless_a_bool() -> None:
    """draw is part of the pytree structure (another trace, another executable-cache key), as
    the other two flags; a non-bool is refused by name."""
    on, off = inputs(GREEDY, False, 0), inputs(GREEDY, False, 0, draw=False)
    assert jax.tree_util.tree_structure(on) != jax.tree_util.tree_structure(off)
    assert args_signature([on]) != args_signature([off])
    with pytest.raises(TypeError, match="draw must be a bool"):
        inputs(GREEDY, False, 0, draw=1)  # type: ignore[arg-type]
