"""Drafts from a model for speculative decoding: the target's first layers ("self") or a small model
sharing its vocabulary ("draft"); see `ModelDraft`. Speculator (serving/speculative/speculator.py)
owns one when SpeculativeConfig.method is "self" or "draft".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.batch import decode_batch
from jdet.kv_cache import init_kv_cache
from jdet.loader import DEFAULT_MODEL_DIR, Model, load
from jdet.ops import Ops
from jdet.spec_config import SpeculativeConfig
from jdet.step import SamplingInputs, make_step_fn
from serving.sequence import Sequence
from serving.speculative.rejection import RejectionStep, SpecSampling, mesh_of, rejection_step


class ModelDraft:
    """Drafts from a model, k single-token passes per step, batched over the verifying
    sequences, each pass one shape of the target's shape set (so warm-up covers it):

    - "self": the target's first L layers + its final norm and LM head. The target's step function
      runs on the parameters with the layer stack cut to L; it shares the target's KV cache,
      whose layers < L already hold exactly the K/V the draft needs (same weights, same inputs).
      Its writes at the drafted positions are overwritten by the verify step before anyone reads
      them (K/V are written before attention).
    - "draft": a separate small model sharing the vocabulary, with its own KV cache laid out on the
      target's page tables (same page ids and page size: no second page manager). `mirror` runs
      it on every target step's batch, so its cache holds its K/V for every computed token,
      prefix-cache pages and recomputed (preempted) sequences included.

    A draft's bits never reach an output in exact mode: it only decides how many rows are used.
    """

    def __init__(self, config: SpeculativeConfig, runner: Any, invariance: str) -> None:
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
                fn = rejection_step(cfg, invariance, mesh_of(runner), True)
                self.step_fn = RejectionStep(fn, cfg.vocab_size, False)
        else:
            dm = config.draft_model
            if dm == "default":  # the embedded model's trained draft (examples/train_draft.py)
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
            kv = init_kv_cache(model.cfg, num_pages, runner.page_size, model.dtype)
            self.device = jax.devices()[0]
            self.kv = jax.device_put(kv, self.device)  # committed, as after a step (`_run`)
            one = jax.sharding.SingleDeviceSharding(self.device)
            self._put = jax.jit(lambda t: t, out_shardings=one)  # host token ids (`_run`)
            # the draft's own bits do not matter (exact mode): the simplest runtime, one device
            mode = "batch" if invariance == "tp" else invariance
            self.step_fn = make_step_fn(model.cfg, Ops(invariance=mode))
            if self.rejection:  # the passes also return q (the mirror ignores it)
                fn = rejection_step(model.cfg, mode, None, True)
                self.step_fn = RejectionStep(fn, model.cfg.vocab_size, False)

    # ------------------------------------------------------------------ device calls
    def _run(self, batch: Any, sampling: Any) -> Any:
        r = self.runner
        if self.kv is None:  # "self": the target's cache, donated and replaced as by a step
            r.kv, out = self.step_fn(self.params, r.kv, r.place_tokens(batch), sampling)
        else:
            if any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.kv)):
                # a failed step consumed the donated cache (Engine.recover): start it afresh;
                # only acceptance can suffer until the pages are recomputed, never the bits
                self.kv = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), self.kv)
            # token ids always on the draft's device, host ids or a dispatched-ahead step's
            # device tokens (adaptive K): one placement, so one executable per shape. Host ids
            # through a jitted identity (as ModelRunner.place_tokens: far less host time than
            # jax.device_put), device tokens moved by device_put (no new executable).
            tok = batch.token_ids
            host = isinstance(tok, np.ndarray)
            tok = self._put(tok) if host else jax.device_put(tok, self.device)
            batch = dataclasses.replace(batch, token_ids=tok)
            self.kv, out = self.step_fn(self.params, self.kv, batch, sampling)
        return out

    def _sampling(self, Sp: int, Pp: int, position: np.ndarray, seqs: list = ()) -> Any:
        """Row i samples as `seqs[i]` does, with its (seed, position) key: the draft shares the
        target's randomness, so where the two distributions are close the Gumbel-max draws agree
        (greedy rows: argmax). Other rows are greedy."""
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
        r = self.runner
        got: dict[Sequence, list[int]] = {seq: [] for seq, _ in items}
        dists: dict[Sequence, list[np.ndarray]] = {seq: [] for seq, _ in items}
        for j in range(max(k for _, k in items)):
            active = [seq for seq, k in items if k > j]
            S = len(active)
            Tp, Sp, Pp = r.shapes.fit(S, S, max(len(s.page_table) for s in active))
            batch = decode_batch(
                [got[seq][-1] if j else seq.token_ids[-1] for seq in active],
                [seq.num_tokens - 1 + j for seq in active],
                [seq.page_table for seq in active],
                r.page_size, pad_tokens=Tp, pad_seqs=Sp, pad_pages=Pp,
            )  # fmt: skip
            r.shapes_seen.add((Tp, Sp, Pp))
            out = self._run(batch, self._sampling(Sp, Pp, batch.context_lens.copy(), active))
            toks = np.asarray(jax.device_get(out.tokens))[:S]
            for seq, t in zip(active, toks, strict=True):
                got[seq].append(int(t))
            if self.rejection:  # q of each draft token (rejection mode needs the distribution)
                probs = np.asarray(jax.device_get(out.probs))[:S]
                for seq, q in zip(active, probs, strict=True):
                    dists[seq].append(q)
        return got, dists

