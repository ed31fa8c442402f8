"""Which sampler variant a step runs, and which variants warm-up compiles.

`jdet.sampling.SamplingInputs` carries two static flags: `filter_topk_topp` (build the top-k/top-p
filter: on a GPU a sort of the [S, V] logits every step) and
`top_logprobs` (0 or NUM_TOP: the top-20 log-probs, a `top_k` over the vocabulary). A step may
run any variant that *covers* its rows (filter on if some row has top_k > 0 or top_p < 1; top
log-probs if some request asked for them), with the same bits for every row (jdet/sampling.py
says why; tests/jdet/test_sampler_variants.py checks it). Each variant is another executable
(a sampler per row bucket: the step's forward is shared, serving/engine/host_inputs.py
`SplitStep`; with the step as one program, `step_programs="fused"`, a step per shape and
variant), so the engine runs only the variants of `engine_variants()` (LEAN and FULL on a GPU,
GREEDY and FULL on a CPU) and warm-up compiles exactly those: a step takes the first (cheapest)
that covers it.

Why two, not all four, on a GPU: every variant adds executables to warm-up. "lean" serves what
needs neither — greedy and plain-temperature decoding, log-probs without top log-probs (the RL and
evaluation cases) — and "full" the rest, as every step ran before. A step that needs only one
of the two (top-p chat without log-probs) pays for the other, as it did before.

A third, "greedy" (`GREEDY`: no draw, no logits transforms either: SamplingInputs.draw False,
logits None), is the smallest step; it serves steps whose rows are all greedy without
penalties, bias, masks or min-p. A CPU engine runs it beside FULL (`engine_variants` says why);
`jdet generate` compiles the variants it meets, one at a time (`ON_DEMAND`: its first step
compiles faster than the lean one on a CPU).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jdet.plan import backend
from jdet.sampling import NUM_TOP


@dataclasses.dataclass(frozen=True)
class Variant:
    """The static sampler flags of a step (SamplingInputs' fields of the same names)."""

    filter_topk_topp: bool
    top_logprobs: int
    draw: bool = True  # False: no Gumbel draw (every row greedy)
    transforms: bool = True  # False: no logits transforms (SamplingInputs.logits is None)

    def covers(
        self, needs_filter: bool, needs_top: bool, needs_draw: bool = True,
        needs_transforms: bool = True,
    ) -> bool:  # fmt: skip
        return (
            (self.filter_topk_topp or not needs_filter)
            and (self.top_logprobs > 0 or not needs_top)
            and (self.draw or not needs_draw)
            and (self.transforms or not needs_transforms)
        )

    @property
    def name(self) -> str:
        names = {LEAN: "lean", FULL: "full", GREEDY: "greedy"}
        return names.get(self, f"filter={self.filter_topk_topp} top={self.top_logprobs} "
                               f"draw={self.draw} transforms={self.transforms}")  # fmt: skip

    def fields(self) -> dict:
        """SamplingInputs keyword arguments, but `logits`, which the caller sets: None where
        `transforms` is False."""
        return {"filter_topk_topp": self.filter_topk_topp, "top_logprobs": self.top_logprobs,
                "draw": self.draw}  # fmt: skip


LEAN_FIELDS, FULL_FIELDS = (False, 0), (True, NUM_TOP)
LEAN = Variant(*LEAN_FIELDS)
FULL = Variant(*FULL_FIELDS)
GREEDY = Variant(False, 0, draw=False, transforms=False)
# The variants of an engine that compiles each at its first step (`jdet generate`), cheapest
# first: a greedy prompt compiles GREEDY alone, a sampled one LEAN or FULL, never more than it
# meets.
ON_DEMAND = (GREEDY, LEAN, FULL)
CPU_VARIANTS = (GREEDY, FULL)
# The sets an engine may run (EngineConfig.sampler_variants), cheapest first, FULL last (it
# covers any step); "auto": by platform (`engine_variants`).
SETS = {"on-demand": ON_DEMAND, "lean-full": (LEAN, FULL), "greedy-full": CPU_VARIANTS,
        "full": (FULL,)}  # fmt: skip


def engine_variants(choice: str = "auto") -> tuple[Variant, ...]:
    """The set `choice` names (`SETS`; EngineConfig.sampler_variants), or for "auto" by
    platform: (LEAN, FULL) on an accelerator, `CPU_VARIANTS` (GREEDY, FULL) on a CPU, warmed up
    or compiling as it goes (`jdet generate` runs "on-demand").

    Why GREEDY and FULL on a CPU: there the sampler is an executable of its own per (rows,
    vocabulary, variant) (serving/engine/host_inputs.py `SplitStep`), so a variant costs its
    sampler's compile per row bucket, not a step per shape. GREEDY's is a small fraction of
    FULL's and LEAN's (benchmarks/sampler_compile.py) and it runs every step whose rows are all
    greedy without transforms, the common case, at a third of FULL's time; LEAN would add its
    compile for little a step. On a GPU LEAN saves the filter's sort every step (the FULL
    sampler's cost: BENCHMARKS.md, Defaults and memory), for one sampler compile per row bucket."""
    if choice != "auto":
        if choice not in SETS:
            raise ValueError(f"sampler_variants={choice!r}: use 'auto' or one of {list(SETS)}")
        return SETS[choice]
    if backend().cpu:
        return CPU_VARIANTS
    return (LEAN, FULL)


def needs_filter(top_k: np.ndarray, top_p: np.ndarray) -> bool:
    """Whether some row of the step filters (padding rows are top_k 0, top_p 1: they do not)."""
    return bool((top_k > 0).any() or (top_p < 1.0).any())


def choose(
    needs_filter: bool, needs_top: bool, variants: tuple[Variant, ...] | None = None,
    needs_draw: bool = True, needs_transforms: bool = True,
) -> Variant:  # fmt: skip
    """The first variant of `variants` (default `engine_variants()`) that covers a step with
    these needs."""
    variants = variants or engine_variants()
    for v in variants:
        if v.covers(needs_filter, needs_top, needs_draw, needs_transforms):
            return v
    raise AssertionError(f"no sampler variant in {variants} covers filter={needs_filter}, "
                         f"top log-probs={needs_top}, draw={needs_draw}, "
                         f"transforms={needs_transforms}")  # fmt: skip


def for_step(
    top_k: np.ndarray, top_p: np.ndarray, want_top: bool,
    variants: tuple[Variant, ...] | None = None,
) -> dict:  # fmt: skip
    """SamplingInputs keyword arguments of the variant a step with these rows runs (among the
    engine's `variants`); `want_top`: some sequence of the step reports top log-probs
    (`options.logprobs` > 0). Never GREEDY: its `logits` must be None (`step_variant`)."""
    return choose(needs_filter(top_k, top_p), want_top, variants).fields()


def step_variant(
    temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, want_top: bool,
    transforms: bool, variants: tuple[Variant, ...] | None = None,
) -> Variant:  # fmt: skip
    """The variant a step with these rows runs (among the engine's `variants`): the engine's
    policy. `transforms`: some row of the step has logits transforms (penalties, bias, masks,
    min-p: `SamplingOptions.needs_logits_inputs`)."""
    needs_draw = bool((temperature > 0).any())
    return choose(needs_filter(top_k, top_p), want_top, variants, needs_draw, transforms)
