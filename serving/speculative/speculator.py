"""Speculative decoding that changes no bit: drafts, verification rows and the acceptance rule.

How a step verifies (exact mode). A decoding sequence has one uncomputed token x at position p
(its last sample). A draft proposes d_1..d_k (k <= K). The step computes the k + 1 tokens
[x, d_1, ..., d_k] at positions p..p+k, like a prefill chunk, and samples one row per token:
row i gives t_i, the target's token for position p+1+i, drawn with the key (seed, p+1+i).
Draft d_{i+1} is accepted iff d_{i+1} == t_i, for i = 0, 1, ... until the first mismatch; with a
accepted, the sequence gets t_0..t_a (a + 1 tokens: the accepted drafts, which are t_0..t_{a-1},
and the target's own next token t_a).

Why the bits equal non-speculative decoding. Every emitted token is a target sample t_i, not a
draft. Row i's input is x, d_1..d_i = x, t_0..t_{i-1}: exactly the context the i-th of a+1 single
decode steps would have. Its logits are bitwise those of that decode step, because the kernels
are chunk-invariant (computing positions p..p+k in one forward = one at a time; README.md; the
same property that makes chunked prefill exact), and its sample is keyed by (seed, position),
not by the step or row. So t_i and its log-probs (raw log_softmax of those logits) are the
non-speculative ones; the draft only decides how many rows of the step are usable. A wrong draft
costs rows, never bits.

K/V of rejected positions. The step writes K/V for positions p..p+k; only p..p+a hold accepted
tokens and are counted as computed (`num_computed_tokens` advances by a + 1). Slots p+a+1..p+k
hold junk that no attention reads (a sequence's attention stops at its context length) and that
the next steps overwrite before they read it (K/V are written before attention). The pages stay
the sequence's own: they were never full of computed K/V, so never published to the prefix cache,
and they are released with the sequence like any other (the page manager's accounting returns
to zero). A preempted sequence recomputes from its tokens, which are all target samples.

Finishing inside an accepted run: tokens are emitted one at a time with the engine's own checks
(EOS, stop token, max_tokens, max_model_len: `num_emitted` stops at the first that ends the
sequence) and stop strings are matched token by token (serving/engine/outputs.py `detokenize`), so a
sequence ends at the same token as without speculation; its later accepted tokens are dropped.

Budget and shapes: draft tokens count against the step's token budget; they are scheduled after
every decode got its one token and before prefill chunks (scheduler `_add_drafts`); in rejection
mode a verify is scheduled whole or deferred instead (scheduler `_schedule_verify`). A verifying
sequence uses k + 1 sampled rows, so a speculative engine's shape set allows
max_num_seqs * (K + 1) rows (S); T and Pmax buckets are unchanged, and every step shape is still
one of the set that warm-up compiles.

Not drafted (decoded one token at a time, as without speculation): requests with logits
transforms or structured output (`needs_logits_inputs`: their per-row inputs depend on the
tokens before the row, which the draft has not confirmed yet).

Rejection mode (`verify="rejection"`, serving/speculative/rejection.py `rejection_sample`):
accept draft d with probability min(1, p(d)/q(d)), else draw from norm(max(0, p - q)), randomness
keyed by (seed, position) on streams of its own. It preserves the target's distribution, not its
bits (an accepted draft is the draft's draw), so it alone changes the system fingerprint. For
n-gram drafts q is one-hot: the rule accepts with probability p(d), exactly exact mode's
acceptance, which also keeps the bits (docs/speculative.md). Its bits do not depend on the load: a
verify's draft count is the request's own (never cut by the scheduler), a recompute drafts where
the unpreempted sequence did, and drafting starts at the first output token (`may_draft`; why, in
docs/speculative.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jdet.spec_config import SpeculativeConfig
from serving.sequence import Sequence, Status, num_rows
from serving.speculative.adaptive import AdaptiveK
from serving.speculative.draft_model import ModelDraft
from serving.speculative.rejection import RejectionStep, SpecSampling, mesh_of, rejection_step


def ngram_draft(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n = n_max..n_min, the (up to) k tokens that followed the latest earlier
    occurrence of the last n tokens; [] when none occurs.

    It runs for every drafting sequence on every step, on the host between two device steps, so
    it is one vectorised pass over the tokens (the earlier positions e holding the last token)
    and then, latest e first, how far back each match goes, stopping at the first of full length
    min(n_max, L - 1); the longest length n wins, the latest e of that length gives the draft
    (tokens e+1..e+k). Same result as trying n = n_max..n_min over sliding windows
    (tests/serving/speculative/test_spec_adaptive.py), several times faster."""
    L = len(tokens)
    if k < 1 or L < 2:
        return []
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, np.int64)
    n_hi = min(n_max, L - 1)
    best, at = 0, -1
    for e in np.flatnonzero(arr[: L - 1] == arr[L - 1])[::-1].tolist():  # a match's last position
        m = 1
        while m < n_hi and e >= m and tokens[e - m] == tokens[L - 1 - m]:
            m += 1
        if m > best:  # an earlier e replaces a later one only with a longer match
            best, at = m, e
            if m == n_hi:
                break
    if best < n_min:
        return []
    return arr[at + 1 : at + 1 + k].tolist()


class Speculator:
    """Drafts for the running sequences and the acceptance rule; counts acceptance."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_tokens
        self.max_model_len = max_model_len
        self.rejection = config.verify == "rejection"
        # rejection mode: a verify is scheduled whole (K + 1 tokens) or deferred (scheduler.py)
        self.verify_tokens = self.k + 1 if self.rejection else None
        self._q: dict[Sequence, list] = {}  # rejection mode, model drafts: q of each draft
        self.reset_stats()
        self.model_draft: ModelDraft | None = None  # "self" / "draft" (`attach`)
        self._arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # `_tokens`
        self.adaptive: AdaptiveK | None = None  # K = 0 at low acceptance: spec_adaptive.py
        if config.min_alpha > 0:
            look = None if config.method != "ngram" else self._lookup
            lag = int(self.rejection)  # rejection mode: blind to the latest token (its bits)
            self.adaptive = AdaptiveK(config.min_alpha, config.probe_every, look, lag)

    def _lookup(self, seq: Sequence, i: int) -> int | None:
        """The n-gram draft's first token for the context of `seq`'s first i tokens (adaptive K's
        host measure)."""
        d = ngram_draft(self._tokens(seq)[:i], 1, self.config.ngram_min, self.config.ngram_max)
        return d[0] if d else None

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """`seq.token_ids` as an int64 array, kept per sequence and extended by the tokens appended
        since the last call (the lookup runs every step: converting the whole list each time
        was most of its cost at long contexts)."""
        ids = seq.token_ids
        buf, n = self._arrays.get(seq, (None, 0))
        L = len(ids)
        if buf is None or L < n or (n and buf[n - 1] != ids[n - 1]):
            buf, n = None, 0  # first call, or the tokens changed (never appended only)
        if buf is None or len(buf) < L:
            grown = np.empty(max(64, 2 * L), np.int64)
            if n:
                grown[:n] = buf[:n]
            buf = grown
        buf[n:L] = ids[n:L]
        self._arrays[seq] = (buf, L)
        return buf[:L]

    def can_run_ahead(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Whether the step after `plan` may be dispatched before `plan`'s tokens reach the host
        (`Engine._dispatch_ahead`; a verify's successor depends on how many drafts it accepts,
        so `plan` must verify nothing): with adaptive K on, when every sequence of it decodes
        without drafts next step anyway, because it has fallen back, or (n-gram) because its
        lookups ran dry (the last DRY found nothing, the one on its latest tokens on the host,
        run here, included: serving/speculative/adaptive.py). That lookup lags one token (the
        input of the step in flight is known, its output is not): a match that appears with
        that output is drafted one step later. min_alpha=0 (always draft) never goes ahead."""
        a = self.adaptive
        if a is None:
            return False
        seqs = [seq for seq, n in plan]
        if any(n != 1 for _, n in plan):
            return False
        a.observe(seqs)  # host work while the device runs `plan`
        ok = [a.fallen_back(seq) or self._dry(seq) for seq in seqs]  # every streak counted
        return all(ok)

    def _dry(self, seq: Sequence) -> bool:
        """n-gram: whether the lookup on `seq`'s tokens so far proposes nothing, as the last
        DRY - 1 did (serving/speculative/adaptive.py). A model draft always proposes. Exact mode
        only: in rejection mode which positions verify is part of the bits, and this lookup's lag
        would make them depend on async scheduling, which the fingerprint does not hold."""
        if self.model_draft is not None or self.adaptive is None or self.rejection:
            return False
        c = self.config
        found = bool(ngram_draft(self._tokens(seq), 1, c.ngram_min, c.ngram_max))
        self.adaptive.record_lookup(seq, found)
        return self.adaptive.dry(seq)

    def ahead(self, plan: list[tuple[Sequence, int]], prepared: tuple) -> tuple:
        """A dispatched-ahead decode step's inputs (rejection mode: its step's, no draft) and a
        draft model's mirror of it, so its cache holds these tokens' K/V when it drafts again."""
        prepared = self.verify_inputs(plan, prepared)
        self.mirror(prepared)
        return prepared

    def reset_stats(self) -> None:
        """Counters (metrics): verifies, drafts proposed, accepted, rejected (a verify that
        ended on a draft the target did not draw)."""
        self.num_verifies = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_rejected_tokens = 0

    def room(self, seq: Sequence) -> int:
        """Most drafts worth verifying for `seq`: K, less what max_tokens / max_model_len leave
        (the last row's sample goes at position num_tokens + k)."""
        o = seq.options
        k = min(self.k, self.max_model_len - 1 - seq.num_tokens)
        if o.max_tokens is not None:
            k = min(k, o.max_tokens - seq.num_output_tokens - 1)
        return max(0, k)

    def attach(self, runner: Any, invariance: str) -> None:
        """Give a model draft ("self", "draft") the target's runner (its params, KV cache and
        shape set); in rejection mode, replace the runner's step by the rejection step."""
        if self.config.method != "ngram":
            self.model_draft = ModelDraft(self.config, runner, invariance)
        if self.rejection:
            fn = rejection_step(runner.cfg, invariance, mesh_of(runner), False)
            runner.step_fn = RejectionStep(fn, runner.cfg.vocab_size, self.model_draft is not None)

    def verify_inputs(self, plan: list[tuple[Sequence, int]], prepared: tuple) -> tuple:
        """Rejection mode: the step's SpecSampling (each verify row's draft token, and q for a
        model draft), rows laid out as `ModelRunner.prepare` lays them out."""
        if not self.rejection:
            return prepared
        batch, sampling = prepared
        S = sampling.temperature.shape[0]
        draft = np.full(S, -1, np.int32)
        q = None
        if self.model_draft is not None:
            q = np.zeros((S, self.model_draft.vocab_size), np.float32)
        r0 = 0
        for seq, n in plan:
            r = num_rows(seq, n)
            if r > 1:
                draft[r0 : r0 + r - 1] = seq.draft_token_ids[: r - 1]
                if q is not None:
                    q[r0 : r0 + r - 1] = np.stack(self._q[seq][: r - 1])
            r0 += r
        return batch, SpecSampling(sampling, draft, q)

    def fetch_extra(self, out: Any, rows: int) -> dict[str, np.ndarray]:
        """Rejection mode: the rule's per-row outcome, brought to the host."""
        names = ["accept", "resid", "resid_lp", "draft_lp"]
        got = jax.device_get([getattr(out, k) for k in names])
        return {k: np.asarray(v)[:rows] for k, v in zip(names, got, strict=True)}

    def rewrite(self, res: dict, r0: int, drafts: list[int]) -> None:
        """Rejection mode: row r0 + i (i < len(drafts)) emits the draft where the rule accepts
        it, else its residual draw (never the draft: p(d) < q(d) there, so max(0, p - q) is 0
        at d). The exact rule (`num_emitted`) then stops at the first residual, as the seed's
        rule does; the last row keeps the target's own sample (the bonus)."""
        for k in ("tokens", "logprobs"):
            if not res[k].flags.writeable:
                res[k] = res[k].copy()
        for i, d in enumerate(drafts):
            j = r0 + i
            if res["accept"][j]:
                res["tokens"][j], res["logprobs"][j] = d, res["draft_lp"][j]
            else:
                res["tokens"][j], res["logprobs"][j] = res["resid"][j], res["resid_lp"][j]

    def propose(self, running: Iterable[Sequence]) -> None:
        """Before scheduling: set `draft_token_ids` of every running sequence (empty where it
        does not decode). A model draft reserves its room with placeholders here (the scheduler
        sizes the step by them) and drafts in `fill`, for the sequences that got the room."""
        c = self.config
        for seq in running:
            seq.draft_token_ids = []
            if not self.may_draft(seq):
                continue
            k = self.room(seq)
            if k > 0 and self.adaptive is not None and not self.adaptive.drafts(seq):
                continue  # low acceptance: K = 0, a plain decode (serving/speculative/adaptive.py)
            if k > 0 and self.model_draft is not None:
                seq.draft_token_ids = [-1] * k
            elif k > 0:
                seq.draft_token_ids = ngram_draft(self._tokens(seq), k, c.ngram_min, c.ngram_max)
                if self.adaptive is not None:  # none found: a plain decode, not a miss
                    self.adaptive.record_lookup(seq, bool(seq.draft_token_ids))

    def may_draft(self, seq: Sequence) -> bool:
        """Whether `seq` may draft in the step being planned: it decodes (one uncomputed token),
        its rows do not depend on unconfirmed tokens (no logits transforms: module docstring),
        and, in rejection mode, that token is an output token. The prompt's last token is
        computed in a prefill chunk or, when a chunk boundary falls just before it, in a decode
        step: drafting in the latter would rejection-sample the first output position where the
        former samples it plainly, so its bits would depend on the chunking (the budget)."""
        if seq.status is not Status.RUNNING or seq.num_uncomputed != 1:
            return False
        if seq.options.needs_logits_inputs:
            return False
        return not (self.rejection and seq.num_output_tokens == 0)

    def fill(self, plan: list[tuple[Sequence, int]]) -> None:
        """After scheduling: a model draft's tokens for each verify in `plan` (k = n - 1)."""
        if self.model_draft is None:
            return
        items = [(seq, n - 1) for seq, n in plan if n > 1 and seq.num_uncomputed == 1]
        self._q = {}
        if items:
            got, qs = self.model_draft.draft(items)
            for seq, k in items:
                seq.draft_token_ids = got[seq][:k]
            self._q = qs

    def mirror(self, prepared: Any) -> None:
        """After the target's step is dispatched: a separate draft model computes its own K/V of
        the same tokens (so its cache follows the target's, page for page)."""
        if self.model_draft is not None:
            self.model_draft.mirror(prepared)

    def warmup(self) -> None:
        if self.model_draft is not None:
            self.model_draft.warmup()

    def accept_drafts(
        self,
        plan: list[tuple[Sequence, int]],
        res: dict,
        nrows: list[int],
        append: Callable[[Sequence, dict, int], int],
        ends: Callable[[Sequence, int, int], bool],
    ) -> tuple[list, list]:
        """After a step (the engine's `_apply`): for each verify in `plan`, append the accepted
        drafts now (`append(seq, res, row)`, before `advance`, so that pages they fill hash the
        right tokens; `ends(seq, tok, m)`: the engine's finishing checks). Returns the plan with
        each verify cut to its computed tokens (x and the accepted drafts) and each entry's row
        holding its next token (for a verify, the target's own)."""
        out, rows, r0 = [], [], 0
        for (seq, n), r in zip(plan, nrows, strict=True):  # r: the rows `prepare` gave it
            last = r0 + r - 1
            if r > 1 and seq.status is Status.RUNNING:
                drafts = seq.draft_token_ids[: r - 1]
                if self.rejection:  # rows emit accepted drafts / residual draws
                    self.rewrite(res, r0, drafts)
                toks = [int(t) for t in res["tokens"][r0 : r0 + r]]
                m = self.num_emitted(seq, drafts, toks, lambda t, j, s=seq: ends(s, t, j))
                for i in range(r0, r0 + m - 1):
                    append(seq, res, i)
                n, last = m, r0 + m - 1
            seq.draft_token_ids = []
            out.append((seq, n))
            rows.append(last)
            r0 += r
        return out, rows

    def num_emitted(
        self, seq: Sequence, drafts: list[int], tokens: list[int], ends: Callable[[int, int], bool]
    ) -> int:
        """Tokens of `tokens` (the target's samples t_0..t_k of one verify) to emit: up to and
        including the first mismatch with `drafts` or the first token that ends the sequence
        (`ends(tok, m)`: whether `tok` as the m-th new token finishes it). Exact rule."""
        m = accepted = rejected = 0
        while True:
            tok = tokens[m]
            m += 1
            if m > len(drafts):
                break  # every draft accepted: the target's bonus token
            if tok != drafts[m - 1]:
                rejected = 1
                break  # the target's own token in place of the rejected draft
            accepted += 1
            if ends(tok, m):
                break
        self.num_rejected_tokens += rejected
        if self.adaptive is not None:
            self.adaptive.record_verify(seq, accepted, rejected)
        self.num_verifies += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        return m

    def stats(self) -> dict[str, float]:
        """Acceptance rate (accepted / proposed drafts), the per-position acceptance alpha
        (accepted / drafts that were reached: accepted + rejected; the seed's alpha, for which
        a verify of K drafts emits (1 - alpha^(K+1)) / (1 - alpha) tokens on average) and the
        mean tokens per verify."""
        d, a, v = self.num_draft_tokens, self.num_accepted_tokens, self.num_verifies
        r = self.num_rejected_tokens
        return {
            "verifies": v,
            "draft_tokens": d,
            "accepted_tokens": a,
            "rejected_tokens": r,
            "acceptance_rate": a / d if d else 0.0,
            "alpha": a / (a + r) if a + r else 0.0,
            "mean_accepted_length": (a + v) / v if v else 0.0,
        }
