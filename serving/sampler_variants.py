"""Which sampler variant a step runs, and which variants warm-up compiles.

`jdet.sampling.SamplingInputs` carries two static flags: `filter_topk_topp` (build the top-k/top-p
filter: on a GPU a sort of the [S, V] logits every step, ~0.085 ms at S = 1, V = 128k) and
`top_logprobs` (0 or NUM_TOP: the top-20 log-probs, a `top_k` over the vocabulary). A step may
run any variant that *covers* its rows (filter on if some row has top_k > 0 or top_p < 1; top
log-probs if some request asked for them), with the same bits for every row (jdet/sampling.py
says why; tests/jdet/test_sampler_variants.py checks it). Each variant is another executable
per step shape, so the engine runs only the variants of `engine_variants()` (both on a GPU, FULL
alone on a CPU once warmed up) and warm-up compiles exactly those: a step takes the first
(cheapest) that covers it.

Why two, not all four: every variant multiplies the executables warm-up compiles (~5 s a shape
on a CPU for the embedded model, ~3 s on an H100 for an 8B model). "lean" serves what needs
neither — greedy and plain-temperature decoding, log-probs without top log-probs (the RL and
evaluation cases) — and "full" the rest, as every step ran before. A step that needs only one
of the two (top-p chat without log-probs) pays for the other, as it did before.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jdet.sampling import NUM_TOP


@dataclasses.dataclass(frozen=True)
class Variant:
    """The static sampler flags of a step (SamplingInputs' fields of the same names)."""

    filter_topk_topp: bool
    top_logprobs: int

    def covers(self, needs_filter: bool, needs_top: bool) -> bool:
        return (self.filter_topk_topp or not needs_filter) and (
            self.top_logprobs > 0 or not needs_top
        )

    @property
    def name(self) -> str:
        names = {LEAN_FIELDS: "lean", FULL_FIELDS: "full"}
        key = (self.filter_topk_topp, self.top_logprobs)
        return names.get(key, f"filter={self.filter_topk_topp} top={self.top_logprobs}")

    def fields(self) -> dict:
        """SamplingInputs keyword arguments."""
        return {"filter_topk_topp": self.filter_topk_topp, "top_logprobs": self.top_logprobs}


LEAN_FIELDS, FULL_FIELDS = (False, 0), (True, NUM_TOP)
LEAN = Variant(*LEAN_FIELDS)
FULL = Variant(*FULL_FIELDS)
# The variants the engine runs, cheapest first, FULL last (it covers any step); None: by platform
# (`engine_variants`). Tests set it to run both variants on a CPU.
VARIANTS: tuple[Variant, ...] | None = None


def engine_variants(warmed: bool = False) -> tuple[Variant, ...]:
    """`VARIANTS`, or by platform: (LEAN, FULL) on an accelerator; on a CPU (LEAN, FULL) for an
    engine that compiles as it goes (`jdet generate`: its one executable is smaller lean, cold
    generate 5.8-6.8 s full vs 4.9-5.7 s lean, load 0.5-1.7) and FULL alone once it warms up.
    Why not LEAN after a CPU warm-up: there it saves ~0.03 ms of a ~5 ms embedded-model step
    (sampler alone 0.161 -> 0.134 ms at batch 1), while warm-up compiles every shape once per
    variant (cold warm-up 1.5-1.8x on the 2-core machine, BENCHMARKS "the sampler's lean
    variant"), and a CPU is where compile time hurts (issue 17). On a GPU the sort it skips is
    ~0.085 ms a step."""
    if VARIANTS is not None:
        return VARIANTS
    from pallas_kernels import _platform

    if warmed and _platform.platform() == "cpu":
        return (FULL,)
    return (LEAN, FULL)


def needs_filter(top_k: np.ndarray, top_p: np.ndarray) -> bool:
    """Whether some row of the step filters (padding rows are top_k 0, top_p 1: they do not)."""
    return bool((top_k > 0).any() or (top_p < 1.0).any())


def choose(
    needs_filter: bool, needs_top: bool, variants: tuple[Variant, ...] | None = None
) -> Variant:
    """The first variant of `variants` (default `engine_variants()`) that covers a step with
    these needs."""
    variants = variants or engine_variants()
    for v in variants:
        if v.covers(needs_filter, needs_top):
            return v
    raise AssertionError(f"no sampler variant in {variants} covers filter={needs_filter}, "
                         f"top log-probs={needs_top}")  # fmt: skip


def for_step(
    top_k: np.ndarray, top_p: np.ndarray, want_top: bool,
    variants: tuple[Variant, ...] | None = None,
) -> dict:  # fmt: skip
    """SamplingInputs keyword arguments of the variant a step with these rows runs (among the
    engine's `variants`); `want_top`: some sequence of the step reports top log-probs
    (`options.logprobs` > 0)."""
    return choose(needs_filter(top_k, top_p), want_top, variants).fields()
