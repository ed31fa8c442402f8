"""Adaptive K for speculative decoding: a request whose drafts keep being rejected stops drafting
(K = 0) and decodes as a plain request, so the engine can dispatch ahead again (async scheduling).

Why. A speculative step must reach the host before the next one is built (the next input tokens
depend on how many drafts were accepted), so speculation costs the engine its async dispatch:
the host's work for a step no longer hides behind the device's. A request whose
drafts are mostly rejected pays that and gets ~1 token per step back: it decodes faster without
drafts. When every running sequence has stopped drafting, the steps are plain decode steps and the
engine dispatches each before the previous one's tokens reach the host (`Engine._dispatch_ahead`).

Why it changes no bit (exact mode). How many drafts a step verifies for a sequence, zero
included, never changes a token: every emitted token is the target's keyed sample at its
position (serving/speculative/speculator.py), and a dispatched-ahead step is the same decode step
with its input token on the device (tests/serving/engine/test_async.py).
tests/serving/speculative/test_spec_adaptive.py compares with np.array_equal.

The estimate: per sequence, a decayed count of accepted drafts over drafts reached (the seed's
per-position alpha), updated by every verify (`record_verify`). An n-gram lookup that finds no
draft is not a miss: it says nothing about how good the drafts are (a copy-heavy request has
stretches of new text between copies), and such a step costs nothing to speculation; the
sequence decodes plainly in it, and once DRY lookups in a row found nothing its steps may go
ahead while the lookup on its latest tokens still finds nothing (`Speculator.can_run_ahead`;
a streak, not one lookup: a single empty lookup in natural text is often followed by a useful
one, which an ahead step would skip). Counting those lookups as misses made a
copying request fall back between copies and miss the next copy's drafts. Below
`min_alpha` (after `WARMUP` reached drafts) the sequence falls back. While it is fallen back its
alpha keeps being measured:
  - n-gram drafts, on the host, for free: for each token it got where the lookup on the tokens
    before it proposes something, whether it proposed that token (`observe`, run while the
    device computes a step; positions without a proposal are skipped, as above);
  - model drafts (a pass of the draft costs device time): every `probe_every` tokens it verifies
    one step's drafts again (a probe), whose outcome updates the estimate.
It drafts again as soon as its estimate reaches `min_alpha`.

Rejection mode (`lag=1`): which positions are rejection-sampled is part of the bits there, so
the decision for a step must not depend on when the host learns a token. A step dispatched ahead
is decided before the token it feeds has reached the host; a synchronous step after it has. So
in rejection mode every decision for the step whose input is token j looks at tokens[:j] only
(`drafts` ignores the latest token; `can_run_ahead`'s look, made while that token is computed,
sees exactly tokens[:j] too): the same state at the same decision with async scheduling on or
off (tests/serving/speculative/test_spec_adaptive.py). Exact mode looks at every token (its bits
never depend on the decision).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable

from serving.sequence import Sequence

DECAY = 0.8  # weight of the past per verify (or observed token): about the last 5 count
WARMUP = 4  # drafts reached before a sequence may fall back
DRY = 3  # lookups in a row that found nothing before a sequence's steps go ahead (n-gram)


@dataclasses.dataclass
class Acceptance:
    """One sequence's decayed acceptance counts and where the host's look at its tokens is."""

    accepted: float = 0.0
    reached: float = 0.0
    num_reached: int = 0  # undecayed, for WARMUP
    seen: int | None = None  # tokens already accounted for (None: sync at the next look)
    idle: int = 0  # tokens decoded without drafts since the last verify (model drafts' probe)
    dry: int = 0  # consecutive n-gram lookups on its latest tokens that found nothing

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached if self.reached else 1.0

    def add(self, accepted: int, reached: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.reached = DECAY * self.reached + reached
        self.num_reached += reached


class AdaptiveK:
    """Decides per sequence whether it drafts this step (`drafts`); see the module docstring.
    `lookup(seq, i)`: the n-gram draft's first token for the context of seq's first i tokens, or
    None (None for model drafts: they are probed instead). `lag`: latest tokens `drafts` does not
    look at (1 in rejection mode, module docstring)."""

    def __init__(
        self,
        min_alpha: float,
        probe_every: int,
        lookup: Callable[[Sequence, int], int | None] | None,
        lag: int = 0,
    ) -> None:
        self.min_alpha = min_alpha
        self.lag = lag
        self.probe_every = probe_every
        self.lookup = lookup
        self.state: weakref.WeakKeyDictionary[Sequence, Acceptance] = weakref.WeakKeyDictionary()
        self.num_fallback_steps = 0  # sequence-steps decoded without drafts by this policy
        self.num_shadow_checks = 0  # tokens measured on the host while fallen back

    def _of(self, seq: Sequence) -> Acceptance:
        st = self.state.get(seq)
        if st is None:
            st = self.state[seq] = Acceptance()  # seen=None: synced at its first look
        return st

    def fallen_back(self, seq: Sequence) -> bool:
        """Whether `seq` decodes without drafts now (estimate below min_alpha, no probe due)."""
        st = self._of(seq)
        if st.num_reached < WARMUP or st.alpha >= self.min_alpha:
            return False
        return self.lookup is not None or st.idle < self.probe_every

    def observe(self, seqs: Iterable[Sequence], lag: int = 0) -> None:
        """Account the tokens each sequence got since the last look, its latest `lag` tokens
        left for a later look: while it is fallen back, n-gram drafts measure whether the lookup
        would have proposed each token, model drafts count the tokens towards the next probe.
        Host work only; the engine runs it while the device computes a step."""
        for seq in seqs:
            st = self._of(seq)
            n = len(seq.token_ids) - lag
            if st.seen is None or n <= st.seen or not self.fallen_back(seq):
                st.seen = n if st.seen is None else max(st.seen, n)  # a lagging look: no rewind
                continue
            for i in range(st.seen, n):
                if self.lookup is None:
                    st.idle += 1
                    continue
                d = self.lookup(seq, i)
                if d is None:
                    continue  # no proposal there: not a miss (module docstring)
                self.num_shadow_checks += 1
                st.add(int(d == seq.token_ids[i]), 1)
                if not self.fallen_back(seq):
                    break  # drafting again: later tokens are the verifies' to count
            st.seen = n

    def drafts(self, seq: Sequence) -> bool:
        """Whether `seq` should get drafts this step (False counts a fallback step); its latest
        `lag` tokens unseen (rejection mode: the module docstring)."""
        self.observe([seq], self.lag)
        if self.fallen_back(seq):
            self.num_fallback_steps += 1
            return False
        return True

    def record_lookup(self, seq: Sequence, found: bool) -> None:
        """An n-gram lookup on `seq`'s latest tokens (for its drafts, or before an ahead step)
        found a draft or not: counts the dry streak (`dry`)."""
        st = self._of(seq)
        st.dry = 0 if found else st.dry + 1

    def dry(self, seq: Sequence) -> bool:
        """Whether `seq`'s last DRY lookups all found nothing: its next step may go ahead
        without drafts (module docstring)."""
        return self._of(seq).dry >= DRY

    def record_verify(self, seq: Sequence, accepted: int, rejected: int) -> None:
        """A verify's outcome. The tokens it brings are not observed again."""
        st = self._of(seq)
        st.add(accepted, accepted + rejected)
        st.idle = 0
        st.seen = None
