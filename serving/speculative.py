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
are chunk-invariant (computing positions p..p+k in one forward = one at a time; DESIGN §1, the
same property that makes chunked prefill exact), and its sample is keyed by (seed, position),
not by the step or row. So t_i and its log-probs (raw log_softmax of those logits) are the
non-speculative ones; the draft only decides how many rows of the step are usable. A wrong draft
costs rows, never bits.

K/V of rejected positions. The step writes K/V for positions p..p+k; only p..p+a hold accepted
tokens and are counted as computed (`num_computed_tokens` advances by a + 1). Slots p+a+1..p+k
hold junk that no attention reads (a sequence's attention stops at its context length) and that
the next steps overwrite before they read it (K/V are written before attention). The pages stay
the sequence's own: they were never full of computed K/V, so never published to the prefix cache,
and they are released with the sequence like any other (the block manager's accounting returns
to zero). A preempted sequence recomputes from its tokens, which are all target samples.

Finishing inside an accepted run: tokens are emitted one at a time with the engine's own checks
(EOS, stop token, max_tokens, max_model_len: `num_emitted` stops at the first that ends the
sequence) and stop strings are matched token by token (engine `_detokenize`), so a sequence ends at
the same token as without speculation; its later accepted tokens are dropped.

Budget and shapes: draft tokens count against the step's token budget; they are scheduled after
every decode got its one token and before prefill chunks (scheduler `_add_drafts`). A verifying
sequence uses k + 1 sampled rows, so a speculative engine's shape set allows
max_num_seqs * (K + 1) rows (S); T and Pmax buckets are unchanged, and every step shape is still
one of the set that warm-up compiles.

Not drafted (decoded one token at a time, as without speculation): requests with logits
transforms or structured output (`needs_logits_inputs`: their per-row inputs depend on the
tokens before the row, which the draft has not confirmed yet).

Rejection mode (seed 001, `verify="rejection"`: not implemented in this version) accepts a
draft with probability min(1, p/q) and resamples from norm(max(0, p - q)); it preserves the
target's distribution, not its bits: the emitted token can be a draft the target would not have
drawn with its own key. Hence exact mode is the default and the only one whose outputs carry the
non-speculative system fingerprint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from jdet.spec_config import SpeculativeConfig
from serving.sequence import Sequence, Status


def num_rows(seq: Sequence, n: int) -> int:
    """Sampled rows of `seq` in a step computing `n` of its tokens: k + 1 for a verify of k
    drafts, else 1 (a prefill chunk's row is sampled and dropped, as before)."""
    return 1 + max(0, n - seq.num_uncomputed)


def step_tokens(seq: Sequence, n: int) -> list[int]:
    """The `n` input tokens of `seq` this step: its uncomputed tokens, then its drafts."""
    start = seq.num_computed_tokens
    have = seq.token_ids[start : start + n]
    return have + seq.draft_token_ids[: n - len(have)]


def ngram_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: for n = n_max..n_min, the (up to) k tokens that followed the latest earlier
    occurrence of the last n tokens; [] when none occurs."""
    L = len(tokens)
    if k < 1 or L < 2:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n :]
        win = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((win == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the token after the latest match
            return arr[start : start + k].tolist()
    return []


class Speculator:
    """Drafts for the running sequences and the acceptance rule; counts acceptance."""

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self.k = config.num_tokens
        self.max_model_len = max_model_len
        self.reset_stats()
        self.model_draft: ModelDraft | None = None  # "self" / "draft" (`attach`)

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
        shape set)."""
        if self.config.method != "ngram":
            self.model_draft = ModelDraft(self.config, runner, invariance)

    def propose(self, running: Iterable[Sequence]) -> None:
        """Before scheduling: set `draft_token_ids` of every running sequence (empty where it
        does not decode). A model draft reserves its room with placeholders here (the scheduler
        sizes the step by them) and drafts in `fill`, for the sequences that got the room."""
        c = self.config
        for seq in running:
            seq.draft_token_ids = []
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1:
                continue
            if seq.options.needs_logits_inputs:
                continue  # module docstring: rows depend on unconfirmed tokens
            k = self.room(seq)
            if k > 0 and self.model_draft is not None:
                seq.draft_token_ids = [-1] * k
            elif k > 0:
                seq.draft_token_ids = ngram_draft(seq.token_ids, k, c.ngram_min, c.ngram_max)

    def fill(self, plan: list[tuple[Sequence, int]]) -> None:
        """After scheduling: a model draft's tokens for each verify in `plan` (k = n - 1)."""
        if self.model_draft is None:
            return
        items = [(seq, n - 1) for seq, n in plan if n > 1 and seq.num_uncomputed == 1]
        if items:
            got = self.model_draft.draft(items)
            for seq, k in items:
                seq.draft_token_ids = got[seq][:k]

    def mirror(self, prepared: Any) -> None:
        """After the target's step is dispatched: a separate draft model computes its own K/V of
        the same tokens (so its cache follows the target's, page for page)."""
        if self.model_draft is not None:
            self.model_draft.mirror(prepared)

    def warmup(self) -> None:
        if self.model_draft is not None:
            self.model_draft.warmup()

    def num_emitted(
        self, seq: Sequence, drafts: list[int], tokens: list[int], ends: Callable[[int, int], bool]
    ) -> int:
        """Tokens of `tokens` (the target's samples t_0..t_k of one verify) to emit: up to and
        including the first mismatch with `drafts` or the first token that ends the sequence
        (`ends(tok, m)`: whether `tok` as the m-th new token finishes it). Exact rule."""
        m = accepted = 0
        while True:
            tok = tokens[m]
            m += 1
            if m > len(drafts):
                break  # every draft accepted: the target's bonus token
            if tok != drafts[m - 1]:
                self.num_rejected_tokens += 1
                break  # the target's own token in place of the rejected draft
            accepted += 1
            if ends(tok, m):
                break
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


class SpecCollector:
    """Prometheus collector for `/metrics` (read at scrape time): drafts proposed and accepted,
    verify rows, the acceptance rate and the mean tokens a verify emits."""

    def __init__(self, speculator: Speculator) -> None:
        self.spec = speculator

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.spec.stats()
        yield CounterMetricFamily(
            "jdet_spec_draft_tokens", "Draft tokens verified", st["draft_tokens"]
        )
        yield CounterMetricFamily(
            "jdet_spec_accepted_tokens", "Draft tokens accepted", st["accepted_tokens"]
        )
        yield CounterMetricFamily("jdet_spec_verifies", "Sequence verifies", st["verifies"])
        yield GaugeMetricFamily(
            "jdet_spec_acceptance_rate", "Accepted / verified draft tokens", st["acceptance_rate"]
        )
        yield GaugeMetricFamily(
            "jdet_spec_mean_accepted_length",
            "Mean tokens emitted per verify (accepted drafts + the target's own)",
            st["mean_accepted_length"],
        )


class ModelDraft:
    """Drafts from a model, k single-token passes per step, batched over the verifying
    sequences, each pass one shape of the target's shape set (so warm-up covers it):

    - "self": the target's first L layers + its final norm and LM head. The target's step function
      runs on the parameters with the layer stack cut to L; it shares the target's KV cache,
      whose layers < L already hold exactly the K/V the draft needs (same weights, same inputs).
      Its writes at the drafted positions are overwritten by the verify step before anyone reads
      them (K/V are written before attention).
    - "draft": a separate small model sharing the vocabulary, with its own KV cache laid out on the
      target's page tables (same page ids and page size: no second block manager). `mirror` runs
      it on every target step's batch, so its cache holds its K/V for every computed token,
      prefix-cache pages and recomputed (preempted) sequences included.

    A draft's bits never reach an output in exact mode: it only decides how many rows are used.
    """

    def __init__(self, config: SpeculativeConfig, runner: Any, invariance: str) -> None:
        import jax

        self.runner = runner
        self.method = config.method
        cfg = runner.cfg
        if config.method == "self":
            L = config.draft_layers or max(1, cfg.num_layers // 2)
            if L >= cfg.num_layers:
                raise ValueError(
                    f"draft_layers={L} must be below the model's {cfg.num_layers} layers"
                )
            self.num_layers = L

            def cut(x: Any) -> Any:
                return jax.device_put(x[:L], x.sharding)

            self.params = dict(runner.params)
            self.params["layers"] = jax.tree_util.tree_map(cut, runner.params["layers"])
            self.step_fn = runner.step_fn
            self.kv = None  # the target's cache (runner.kv)
        else:
            from jdet.kv_cache import init_kv_cache
            from jdet.loader import Model, load
            from serving.model_runner import cached_step_fn

            dm = config.draft_model
            model = dm if isinstance(dm, Model) else load(dm, dtype=runner.kv_dtype)
            if model.cfg.vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"the draft model's vocabulary ({model.cfg.vocab_size}) differs from the "
                    f"target's ({cfg.vocab_size}); a draft must share the tokenizer"
                )
            self.cfg = model.cfg
            self.num_layers = model.cfg.num_layers
            self.params = model.params
            num_pages = jax.tree_util.tree_leaves(runner.kv)[0].shape[2]
            self.kv = init_kv_cache(model.cfg, num_pages, runner.page_size, model.dtype)
            # the draft's own bits do not matter (exact mode): the simplest runtime, one device
            self.step_fn = cached_step_fn(model.cfg, "batch" if invariance == "tp" else invariance)

    # ------------------------------------------------------------------ device calls
    def _run(self, batch: Any, sampling: Any) -> Any:
        r = self.runner
        if self.kv is None:  # "self": the target's cache, donated and replaced as by a step
            batch = dataclasses.replace(batch, token_ids=_placed(batch.token_ids, r))
            r.kv, out = self.step_fn(self.params, r.kv, batch, sampling)
        else:
            import jax
            import jax.numpy as jnp

            if any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.kv)):
                # a failed step consumed the donated cache (Engine.recover): start it afresh;
                # only acceptance can suffer until the pages are recomputed, never the bits
                self.kv = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), self.kv)
            self.kv, out = self.step_fn(self.params, self.kv, batch, sampling)
        return out

    def _sampling(self, Sp: int, Pp: int, position: np.ndarray, seqs: list = ()) -> Any:
        """Row i samples as `seqs[i]` does, with its (seed, position) key: the draft shares the
        target's randomness, so where the two distributions are close the Gumbel-max draws agree
        (greedy rows: argmax). Other rows are greedy."""
        from jdet.step import SamplingInputs

        temp = np.zeros(Sp, np.float32)
        top_k = np.zeros(Sp, np.int32)
        top_p = np.ones(Sp, np.float32)
        seed = np.zeros(Sp, np.uint32)
        for i, seq in enumerate(seqs):
            o = seq.options
            temp[i], top_k[i], top_p[i], seed[i] = o.temperature, o.top_k, o.top_p, seq.seed
        logits = self.runner.logits_rows.neutral(Sp, Pp * self.runner.page_size)
        return SamplingInputs(
            temperature=temp, top_k=top_k, top_p=top_p, seed=seed, position=position,
            logits=logits if self.kv is None else None,
        )  # fmt: skip

    def mirror(self, prepared: Any) -> None:
        if self.kv is None:
            return  # "self" shares the target's cache, written by the target's step
        batch, sampling = prepared
        Sp = sampling.temperature.shape[0]
        Pp = batch.page_table.shape[1]
        self._run(batch, self._sampling(Sp, Pp, np.zeros(Sp, np.int32)))

    def warmup(self) -> None:
        """Compile the draft's passes (and a draft model's mirror) for every shape of the set."""
        import jax

        r = self.runner
        for shape in r.shapes.all():
            batch, sampling = r.warmup_batch(shape, "step")
            Sp, Pp = shape[1], shape[2]
            out = self._run(batch, self._sampling(Sp, Pp, np.asarray(sampling.position)))
            jax.block_until_ready(out)

    def draft(self, items: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """k draft tokens for each (sequence, k), sampled as the sequence samples: pass j feeds
        every sequence with k > j its token at position num_tokens - 1 + j (its last token,
        then its drafts)."""
        import jax

        from jdet.batch import StepBatch

        r = self.runner
        B = r.page_size
        got: dict[Sequence, list[int]] = {seq: [] for seq, _ in items}
        for j in range(max(k for _, k in items)):
            active = [seq for seq, k in items if k > j]
            S = len(active)
            Tp, Sp, Pp = r.shapes.fit(S, S, max(len(s.block_table) for s in active))
            tok = np.zeros(Tp, np.int32)
            pos = np.zeros(Tp, np.int32)
            slot = np.full(Tp, -1, np.int32)
            qs = np.full(Sp + 1, S, np.int32)
            qs[: S + 1] = np.arange(S + 1, dtype=np.int32)
            cl = np.zeros(Sp, np.int32)
            pt = np.zeros((Sp, Pp), np.int32)
            rows = np.zeros(Sp, np.int32)
            rows[:S] = np.arange(S, dtype=np.int32)
            for i, seq in enumerate(active):
                p = seq.num_tokens - 1 + j
                pages = np.asarray(seq.block_table, np.int32)
                tok[i] = got[seq][-1] if j else seq.token_ids[-1]
                pos[i] = p
                slot[i] = pages[p // B] * B + p % B
                cl[i] = p + 1
                pt[i, : len(pages)] = pages
            r.shapes_seen.add((Tp, Sp, Pp))
            out = self._run(StepBatch(tok, pos, slot, qs, cl, pt, rows),
                            self._sampling(Sp, Pp, cl.copy(), active))  # fmt: skip
            toks = np.asarray(jax.device_get(out.tokens))[:S]
            for seq, t in zip(active, toks, strict=True):
                got[seq].append(int(t))
        return got


def _placed(token_ids: Any, runner: Any) -> Any:
    """Host token ids placed as the target's step expects them (ModelRunner.dispatch)."""
    import jax

    if isinstance(token_ids, np.ndarray):
        return jax.device_put(token_ids, runner.token_sharding)
    return token_ids
