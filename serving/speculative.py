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

Rejection mode (seed 001, `verify="rejection"`, `rejection_sample`): accept draft d with
probability min(1, p(d)/q(d)), else draw from norm(max(0, p - q)), randomness keyed by (seed,
position) on streams of its own. It preserves the target's distribution, not its bits (an
accepted draft is the draft's draw), so it alone changes the system fingerprint. For n-gram
drafts q is one-hot: the rule accepts with probability p(d), exactly exact mode's acceptance,
which also keeps the bits (docs/speculative.md).
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
        self.rejection = config.verify == "rejection"
        self._q: dict[Sequence, list] = {}  # rejection mode, model drafts: q of each draft
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
        shape set); in rejection mode, replace the runner's step by the rejection step."""
        if self.config.method != "ngram":
            self.model_draft = ModelDraft(self.config, runner, invariance)
        if self.rejection:
            fn = rejection_step(runner.cfg, invariance, _mesh_of(runner), False)
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
        import jax

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
        self.rejection = config.verify == "rejection"
        cfg = runner.cfg
        self.vocab_size = cfg.vocab_size
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
            if self.rejection:  # the passes also return q, the draft's distribution
                fn = rejection_step(cfg, invariance, _mesh_of(runner), True)
                self.step_fn = RejectionStep(fn, cfg.vocab_size, False)
        else:
            from jdet.kv_cache import init_kv_cache
            from jdet.loader import Model, load
            from serving.model_runner import cached_step_fn

            dm = config.draft_model
            if dm == "default":  # the embedded model's trained draft (examples/train_draft.py)
                from jdet.loader import DEFAULT_MODEL_DIR

                dm = DEFAULT_MODEL_DIR / "draft"
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
            mode = "batch" if invariance == "tp" else invariance
            self.step_fn = cached_step_fn(model.cfg, mode)
            if self.rejection:  # the passes also return q (the mirror ignores it)
                fn = rejection_step(model.cfg, mode, None, True)
                self.step_fn = RejectionStep(fn, model.cfg.vocab_size, False)

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
        if isinstance(sampling, SpecSampling):
            sampling = sampling.inputs
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

    def draft(self, items: list[tuple[Sequence, int]]) -> tuple[dict, dict]:
        """k draft tokens for each (sequence, k), sampled as the sequence samples: pass j feeds
        every sequence with k > j its token at position num_tokens - 1 + j (its last token,
        then its drafts)."""
        import jax

        from jdet.batch import StepBatch

        r = self.runner
        B = r.page_size
        got: dict[Sequence, list[int]] = {seq: [] for seq, _ in items}
        dists: dict[Sequence, list[np.ndarray]] = {seq: [] for seq, _ in items}
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
            if self.rejection:  # q of each draft token (rejection mode needs the distribution)
                probs = np.asarray(jax.device_get(out.probs))[:S]
                for seq, q in zip(active, probs, strict=True):
                    dists[seq].append(q)
        return got, dists


def _placed(token_ids: Any, runner: Any) -> Any:
    """Host token ids placed as the target's step expects them (ModelRunner.dispatch)."""
    import jax

    if isinstance(token_ids, np.ndarray):
        return jax.device_put(token_ids, runner.token_sharding)
    return token_ids



# ---------------------------------------------------------------------- rejection verification
def _pytree(cls: type) -> type:
    import jax

    return jax.tree_util.register_dataclass(dataclasses.dataclass(cls))


@_pytree
class SpecSampling:
    """A rejection-mode step's sampling inputs: the usual ones, plus per sampled row the draft
    token the row judges (-1: none) and, for a model draft, the draft's distribution q there
    (None for n-gram drafts: q is one-hot at the draft token)."""

    inputs: Any  # SamplingInputs [S]
    draft: Any  # i32[S]
    q: Any = None  # f32[S, V] or None


@_pytree
class SpecSampleOut:
    """SampleOut's fields (the rows' own samples: the bonus token) plus, per row, the rejection
    rule's outcome for its draft and the processed distribution (`probs`, drafts only)."""

    tokens: Any
    logprobs: Any
    top_ids: Any
    top_logprobs: Any
    accept: Any  # bool[S]: u < p(d) / q(d), u keyed by (seed, position, 1)
    resid: Any  # i32[S]: a draw from norm(max(0, p - q)), Gumbel keyed by (seed, position, 2)
    resid_lp: Any  # f32[S]: raw log-prob of `resid`
    draft_lp: Any  # f32[S]: raw log-prob of the draft token
    probs: Any = None  # f32[S, V]: p, the processed distribution (when asked: a draft's q)


def target_probs(logits: Any, inp: Any, ops: Any) -> Any:
    """p per row: the distribution `jdet.sampling.sample` draws from (temperature, top-k, top-p;
    greedy rows one-hot at the argmax). Rows with logits transforms are never drafted."""
    import jax.numpy as jnp

    from jdet.sampling import _filter_top_k_top_p

    temp = jnp.where(inp.temperature > 0, inp.temperature, 1.0)
    scaled = _filter_top_k_top_p(logits / temp[:, None], inp.top_k, inp.top_p, ops)
    p = jnp.exp(ops.log_softmax(scaled))
    greedy = jnp.argmax(logits, axis=-1)
    onehot = jnp.arange(logits.shape[-1])[None, :] == greedy[:, None]
    return jnp.where((inp.temperature > 0)[:, None], p, onehot.astype(p.dtype))


def rejection_sample(logits: Any, s: SpecSampling, ops: Any, want_probs: bool) -> SpecSampleOut:
    """The seed's rule per row: accept draft d with probability min(1, p(d) / q(d)), else draw
    from norm(max(0, p - q)); randomness keyed by (seed, position) on streams of its own."""
    import jax
    import jax.numpy as jnp

    from jdet.sampling import row_keys, sample

    logits = logits.astype(jnp.float32)
    out = sample(logits, s.inputs, ops)
    inp = s.inputs
    N, V = logits.shape
    logp = ops.log_softmax(logits)
    p = target_probs(logits, inp, ops)
    d = jnp.maximum(s.draft, 0)
    onehot = (jnp.arange(V)[None, :] == d[:, None]).astype(jnp.float32)
    q = onehot if s.q is None else s.q.astype(jnp.float32)
    pd = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    qd = jnp.take_along_axis(q, d[:, None], axis=-1)[:, 0]
    keys = row_keys(inp.seed, inp.position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), ()))(keys)
    accept = (u * qd < pd) & (s.draft >= 0)
    resid = jnp.maximum(p - q, 0.0)
    g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 2), (V,)))(keys)
    score = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)) + g, -jnp.inf)
    rtok = jnp.argmax(score, axis=-1).astype(jnp.int32)
    take = lambda t: jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0]  # noqa: E731
    return SpecSampleOut(
        out.tokens, out.logprobs, out.top_ids, out.top_logprobs, accept, rtok, take(rtok),
        take(d), p if want_probs else None,
    )  # fmt: skip


_REJ_FNS: dict = {}


def rejection_step(cfg: Any, invariance: str, mesh: Any, want_probs: bool) -> Callable:
    """step(params, kv, batch, SpecSampling) -> (kv, SpecSampleOut): the target's forward (its
    runtime: `mesh` for the sharded one, else one device) and `rejection_sample`."""
    key = (cfg, invariance, mesh, want_probs)
    if key in _REJ_FNS:
        return _REJ_FNS[key]
    import functools

    import jax

    from jdet.model import forward

    if mesh is None:
        from jdet.ops import Ops

        ops, gather = Ops(invariance=invariance), None
    else:
        from sharding.mesh import tp_size
        from sharding.tp import _gather_vocab, make_tp_ops

        ops, gather = make_tp_ops(invariance, tp_size(mesh)), _gather_vocab

    def body(params: dict, kv: dict, batch: Any, s: SpecSampling) -> tuple:
        kv, logits = forward(params, cfg, kv, batch, ops)
        if gather is not None:
            logits = gather(logits)[:, : cfg.vocab_size]
        return kv, rejection_sample(logits, s, ops, want_probs)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params: dict, kv: dict, batch: Any, s: SpecSampling) -> tuple:
        if mesh is None:
            return body(params, kv, batch, s)
        from sharding.tp import _wrap

        return _wrap(cfg, mesh, params, kv, body, 1)(params, kv, batch, s)

    _REJ_FNS[key] = step
    return step


class RejectionStep:
    """The runner's step in rejection mode: takes plain SamplingInputs too (warm-up, steps with
    no verify), as rows without a draft (and q = 0 rows for a model draft's engine)."""

    def __init__(self, fn: Callable, vocab_size: int, with_q: bool) -> None:
        self.fn, self.V, self.with_q = fn, vocab_size, with_q

    def __call__(self, params: dict, kv: dict, batch: Any, sampling: Any) -> tuple:
        if not isinstance(sampling, SpecSampling):
            S = sampling.temperature.shape[0]
            q = np.zeros((S, self.V), np.float32) if self.with_q else None
            sampling = SpecSampling(sampling, np.full(S, -1, np.int32), q)
        return self.fn(params, kv, batch, sampling)


def _mesh_of(runner: Any) -> Any:
    """The runner's mesh (sharded runtime), or None (one device)."""
    return getattr(runner.token_sharding, "mesh", None)
