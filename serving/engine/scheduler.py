"""Sarathi-Serve stall-free scheduling: a token budget per step, decodes first, chunked prefills.

A step that carries decodes gets `stall_free_budget` tokens (Sarathi-Serve's budget: it bounds
how long a running sequence waits between two of its tokens); a step without decodes (prompts
arriving at an idle engine, `prefill_first`'s prefill steps) gets up to `max_num_batched_tokens`,
rounded down to a token bucket of the pending prompt tokens (`_budget`), since no one waits on it
and a long prompt's time to first token falls with the chunk size. In order:
  1. every running sequence that is decoding gets its one token (oldest first);
  2. running sequences still prefilling get a chunk of what is left of the budget (oldest first);
  3. waiting sequences are admitted first-come-first-served while the budget, `max_num_seqs` and
     the free pages (above the watermark) allow, each with a prefill chunk.
When a running sequence needs a page and none is free, the newest running sequence is preempted
by recomputation: its pages are released (their prefix hashes survive, so the recompute is mostly
a cache hit) and it goes back to the head of the waiting queue.

A score request (`Sequence.is_score`: prefill-only, log-probs on every row) is scheduled like any
prompt, in the same steps, budget and page pool as sampling requests; it reads from the prefix
cache only the rows it has already scored (after a preemption), since every other row's log-prob
needs that row computed.

Chunk boundaries may fall anywhere: output bits do not depend on them, because the kernels are
chunk- and batch-invariant (README.md) — the scheduler is free to optimise latency alone.

Speculative rejection mode (`verify_tokens` = K + 1; serving/speculative/speculator.py): which
positions are rejection-sampled is part of the bits, so a sequence's verify is never cut to what the
budget or the free pages leave. A decode with drafts is scheduled whole, oldest first among the
decodes (pages as a decode gets them, newest preempted first), or deferred to a later step when the
budget cannot hold it; and a recompute after preemption leaves its last token to a decode step,
where the sequence drafts as it would have without the preemption (docs/speculative.md).

`policy="prefill_first"` is the baseline Sarathi-Serve improves on (vLLM v0): whenever a waiting
sequence can be admitted, the step holds prefills only and running decodes stall.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from serving.engine.page_manager import PageManager
from serving.sequence import Sequence, Status

POLICIES = ("stall_free", "prefill_first")


class Scheduler:
    def __init__(
        self,
        page_manager: PageManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        policy: str = "stall_free",
        verify_tokens: int | None = None,
        stall_free_budget: int | None = None,
        token_buckets: tuple[int, ...] = (),
    ) -> None:
        """`verify_tokens`: K + 1 in speculative rejection mode (whole verifies, module
        docstring); None otherwise (exact mode cuts drafts to what fits: no bit depends on it).
        `stall_free_budget`: tokens of a step that carries decodes or score rows (None:
        max_num_batched_tokens); `token_buckets`: the engine's T buckets, to which a step
        without decodes rounds its budget down (empty: no rounding)."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        stall = min(stall_free_budget or max_num_batched_tokens, max_num_batched_tokens)
        if verify_tokens is not None and verify_tokens > stall:
            raise ValueError(
                f"speculative verify='rejection' schedules a verify whole ({verify_tokens} "
                f"tokens: num_tokens + 1), but a step with decodes holds {stall} tokens "
                f"(max_num_batched_tokens {max_num_batched_tokens}, stall_free_budget "
                f"{stall_free_budget}); raise max_num_batched_tokens to at least "
                f"{verify_tokens} (and stall_free_budget) or lower num_tokens"
            )
        self.verify_tokens = verify_tokens
        self.num_deferred_verifies = 0  # rejection mode: verifies left to a later step
        self.num_held_recomputes = 0  # rejection mode: recomputes that left their last token
        self.pm = page_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stall_free_budget = stall
        self.token_buckets = token_buckets
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()  # admission order: oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and return its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pm.release(seq)
        seq.status = Status.FINISHED

    # ------------------------------------------------------------------ the step plan
    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step: (sequence, number of its tokens to compute) pairs, within budget."""
        plan: dict[Sequence, int] = {}
        budget = [self._budget()]
        passes = (True, False)
        if self.policy == "prefill_first" and self.waiting:
            self._schedule_running_pass(False, plan, budget)
            self._admit_waiting(plan, budget)
            if plan:
                return list(plan.items())
            passes = (True,)
        for decoding in passes:
            self._schedule_running_pass(decoding, plan, budget)
            if decoding and self.verify_tokens is None:
                self._add_drafts(plan, budget)  # speculative decoding, exact mode
        self._admit_waiting(plan, budget)
        return list(plan.items())

    def _budget(self) -> int:
        """This step's token budget (module docstring): the stall-free budget while a running
        sequence decodes or a score request is anywhere (a step's score rows stay within it:
        their f32 logits are counted at that size, serving/engine/memory.py); otherwise the
        largest token bucket within max_num_batched_tokens that the pending prompt tokens fill
        (a step padded to a larger bucket would compute its padding)."""
        cap, stall = self.max_num_batched_tokens, self.stall_free_budget
        if stall == cap:
            return cap
        # prefill_first with a sequence waiting: a prefill-only step, whoever decodes
        decodes_wait = self.policy == "prefill_first" and bool(self.waiting)
        pending = 0
        for seq in self.running:
            decoding = seq.status is Status.RUNNING and seq.num_uncomputed == 1
            if seq.is_score or (decoding and not decodes_wait):
                return stall
            pending += 0 if decoding else seq.num_uncomputed
        for seq in self.waiting:
            if seq.is_score:
                return stall
            pending += seq.num_tokens - seq.num_computed_tokens
        fits = [b for b in self.token_buckets if b <= min(pending, cap)]
        return max([stall, *fits]) if self.token_buckets else cap

    def steady(
        self, plan: list[tuple[Sequence, int]], max_model_len: int, also: Callable | None = None
    ) -> bool:
        """Whether the step after `plan` is known on the host before `plan`'s tokens are: no
        sequence waits, `plan` holds every running sequence, `also(plan)` agrees (speculative
        decoding's `can_run_ahead`, asked at this point of the checks), each sequence computes
        its last token (it samples), and none is certain to end after one more (max_tokens,
        max_model_len)."""
        if self.waiting or len(plan) != len(self.running):
            return False
        if also is not None and not also(plan):
            return False
        for seq, n in plan:
            o = seq.options
            if seq.status is not Status.RUNNING or n != seq.num_uncomputed:
                return False
            if seq.num_tokens + 2 > max_model_len or (
                o.max_tokens is not None and seq.num_output_tokens + 2 > o.max_tokens
            ):
                return False
        return True

    def _add_drafts(self, plan: dict, budget: list[int]) -> None:
        """Speculative decoding (serving/speculative/speculator.py): once every decode has its
        token, each decode (oldest first) also computes its draft tokens, within the budget and the
        free pages (a draft never preempts anyone; it shrinks to what fits)."""
        for seq, n in list(plan.items()):
            k = min(len(seq.draft_token_ids), budget[0])
            if k < 1 or n != 1 or seq.num_uncomputed != 1 or seq.is_score:
                continue
            k = min(k, self.pm.tokens_fitting(seq, self.pm.num_free) - 1)
            if k >= 1 and self.pm.grow(seq, 1 + k):
                plan[seq] = 1 + k
                budget[0] -= k

    def _schedule_running_pass(self, decoding: bool, plan: dict, budget: list[int]) -> None:
        """Decodes (one token each) or running prefills (a chunk each), oldest first."""
        for seq in list(self.running):
            if budget[0] == 0:
                break
            if seq.status is not Status.RUNNING or seq in plan:
                continue  # preempted earlier in this pass
            if (seq.num_uncomputed == 1) == decoding:
                if decoding and self.verify_tokens is not None and seq.draft_token_ids:
                    self._schedule_verify(seq, plan, budget)  # rejection mode
                else:
                    self._schedule_running(seq, plan, budget)

    def _schedule_verify(self, seq: Sequence, plan: dict, budget: list[int]) -> None:
        """Rejection mode: a decode with k drafts computes its token and all k, or waits for a
        later step (deferring changes no bit; a shorter verify would rejection-sample other
        positions). Its pages come as a decode's do: the newest running sequence is preempted
        while they do not fit, so the oldest always progresses (the pool holds max_model_len
        tokens and `Speculator.room` keeps a verify within it)."""
        want = 1 + len(seq.draft_token_ids)
        if want > budget[0]:
            self.num_deferred_verifies += 1
            return
        self._schedule_running(seq, plan, budget, want)  # a decode: never shrunk to fit

    def holds_last_token(self, seq: Sequence) -> bool:
        """Rejection mode: whether `seq`'s prefill must stop before its last token, a recompute
        after preemption (it has output tokens): the step that computes that token is then a
        decode, drafting as it would have without the preemption, instead of a prefill row that
        samples the next position plainly."""
        return self.verify_tokens is not None and seq.num_output_tokens > 0 and not seq.is_score

    def _schedule_running(
        self, seq: Sequence, plan: dict, budget: list[int], want: int | None = None
    ) -> None:
        """`want` tokens of `seq` (default: its next chunk within the budget), preempting the
        newest running sequence while its pages do not fit; a prefill chunk shrinks to fit."""
        if want is None:
            hold = int(seq.num_uncomputed > 1 and self.holds_last_token(seq))
            want = min(seq.num_uncomputed - hold, budget[0])
        while not self.pm.grow(seq, want):
            fit = self.pm.tokens_fitting(seq, self.pm.num_free)
            if fit >= 1 and seq.num_uncomputed > 1:  # a prefill chunk may shrink to fit
                want = fit
                continue
            victim = self.running[-1]
            self._preempt(victim, plan, budget)
            if victim is seq:
                return
        plan[seq] = want
        budget[0] -= want

    def _admit_waiting(self, plan: dict, budget: list[int]) -> None:
        while self.waiting and budget[0] > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.pm.match_prefix(seq)
            if seq.is_score:  # a row's log-prob needs its logits: only rows already scored
                cached = cached[: seq.num_scored // self.pm.page_size]  # (kept over preemption)
            hold = int(self.holds_last_token(seq))  # rejection mode: at least 1 token to compute
            if hold:
                cached = cached[: (seq.num_tokens - 2) // self.pm.page_size]
            revived = sum(1 for p in cached if self.pm.ref_count[p] == 0)
            avail = self.pm.num_free - revived - self.pm.watermark_pages
            uncomputed = seq.num_tokens - len(cached) * self.pm.page_size - hold
            want = min(uncomputed, budget[0], avail * self.pm.page_size)
            if want < 1:
                break  # strict FCFS: the head waits for pages, nobody overtakes it
            self.waiting.popleft()
            self.num_held_recomputes += hold
            self.pm.admit(seq, cached)
            assert self.pm.grow(seq, want)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan[seq] = want
            budget[0] -= want

    def _preempt(self, seq: Sequence, plan: dict, budget: list[int]) -> None:
        """Recompute preemption: drop the K/V, requeue at the head of `waiting`."""
        if seq in plan:
            budget[0] += plan.pop(seq)
        self.running.remove(seq)
        self.pm.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ after the step
    def advance(self, plan: list[tuple[Sequence, int]]) -> None:
        """Account the K/V the step wrote and publish newly full pages to the prefix cache."""
        for seq, n in plan:
            if seq.status is Status.RUNNING:
                seq.num_computed_tokens += n
                self.pm.register_full_pages(seq)
