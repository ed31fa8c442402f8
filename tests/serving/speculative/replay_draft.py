"""A draft with a controlled acceptance rate (speculative benchmarks and tests): `ReplayDraft`.

Why. The issue's GPU target (8B shape, >= 1.8x batch-1 tok/s at alpha >= 0.7, K = 4) needs a
draft that the target accepts at a known rate, and random 8B weights have none: an n-gram or
model draft gets alpha ~ 0 on them. A replay draft knows the target's own non-speculative output
for the prompt (recorded by a first plain run of the benchmark) and proposes the token at each
position correctly with probability alpha, else a wrong token. In exact mode a draft only decides
how many rows of a verify are usable (serving/speculative/speculator.py), so the speculative output
is still bitwise the plain one: the benchmark asserts it, and a replay draft that drifted from the
target's tokens would be caught by that assertion (and refused here first).

Whether position j's draft is right is a seeded coin of (seed, j), so a run is deterministic and
every reached draft is accepted independently with probability alpha: a verify of K drafts then
emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average (the seed's formula), which the benchmark
checks against the measured counts.

It plugs in where a model draft does (`Speculator.model_draft`: `draft(items)`, `mirror`,
`warmup`; serving/speculative/draft_model.py `ModelDraft`): the engine runs it like any model draft,
no special path. Exact mode only (rejection mode would need its q vectors); not for serving.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np


class ReplayDraft:
    """Proposes the recorded target tokens, each right with probability `alpha` (module
    docstring). `references`: the full token lists (prompt + plain output) of the prompts the
    benchmark sends; a sequence is matched to the one its tokens are a prefix of."""

    def __init__(
        self, references: Seq[Seq[int]], alpha: float, vocab_size: int, seed: int = 0
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"replay draft alpha must be in [0, 1], got {alpha!r}")
        if not references:
            raise ValueError("a replay draft needs the plain run's token lists (references)")
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.seed = seed
        self.refs = [np.asarray(r, np.int64) for r in references]
        n = max(len(r) for r in self.refs) + 64
        self.coins = np.random.default_rng([seed, 13]).random(n)  # position j: coins[j]

    def _reference(self, tokens: list[int]) -> np.ndarray:
        for r in self.refs:
            if len(r) >= len(tokens) and np.array_equal(r[: len(tokens)], tokens):
                return r
        raise ValueError(
            f"replay draft: a sequence's {len(tokens)} tokens are no prefix of any recorded "
            "plain run; the replay draft only serves the benchmark's own prompts, in exact mode"
        )

    def draft(self, items: list[tuple[Any, int]]) -> tuple[dict, dict]:
        """k tokens for each (sequence, k): position j gets the recorded token where the coin
        of j is below alpha, else that token + 1 (mod V); past the recording, a wrong token."""
        got: dict[Any, list[int]] = {}
        for seq, k in items:
            ref = self._reference(seq.token_ids)
            n = seq.num_tokens
            out = []
            for j in range(n, n + k):
                right = int(ref[j]) if j < len(ref) else 0
                ok = j < len(ref) and j < len(self.coins) and self.coins[j] < self.alpha
                out.append(right if ok else (right + 1) % self.vocab_size)
            got[seq] = out
        return got, {}

    def mirror(self, prepared: Any) -> None:
        """No cache of its own to follow."""

    def warmup(self) -> None:
        """No device passes to compile."""


def attach_replay(engine: Any, draft: ReplayDraft) -> None:
    """Make `draft` the speculative engine's draft (the model-draft slot). The engine must be
    speculative, in exact mode; an adaptive policy probes it as it probes a model draft."""
    sp = getattr(engine, "speculator", None)
    if sp is None:
        raise ValueError("attach_replay needs an engine built with speculative=...")
    if sp.config.verify != "exact":
        raise ValueError(
            f"the replay draft has no distribution q, so it runs in verify='exact' only, "
            f"not {sp.config.verify!r}"
        )
    if sp.model_draft is not None:
        raise ValueError("the engine already has a model draft; build it with method='ngram'")
    sp.model_draft = draft
    if sp.adaptive is not None:
        sp.adaptive.lookup = None  # measured by probe verifies, as a model draft is
