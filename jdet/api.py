"""The public offline API: `jdet.LLM` (generate, score) and `jdet.serve`.

`LLM` owns the model, the invariance mode and the engine settings. Generation runs through the
serving engine when it is available; `_simple_generate` below is the batched prefill-then-decode
loop that backs the API until then and that the engine's tests compare against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.batch import bucket, build_batch
from jdet.loader import Model, load
from jdet.ops import Ops, check_mode
from jdet.sampling import NUM_TOP, SamplingInputs
from jdet.sampling_params import CompletionOutput, RequestOutput, SamplingParams
from jdet.step import init_kv_cache, make_score_fn, make_step_fn

Prompt = str | Sequence[int]


class LLM:
    """Offline, engine-backed generation and teacher-forced scoring with one reduction plan."""

    def __init__(
        self,
        model: Model | str | Path | None = None,
        *,
        tp: int = 1,
        invariance: str = "tp",
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str = "bfloat16",
    ) -> None:
        self.model = model if isinstance(model, Model) else load(model, dtype=dtype)
        self.cfg = self.model.cfg
        self.invariance = check_mode(invariance)
        if tp < 1 or tp & (tp - 1):
            raise ValueError(f"tp must be a power of two >= 1, got {tp}")
        if tp > len(jax.devices()):
            raise ValueError(f"tp={tp} but only {len(jax.devices())} devices are visible")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.tp = tp
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        limit = self.cfg.max_position_embeddings
        if self.cfg.sliding_window:
            limit = min(limit, self.cfg.sliding_window)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's limit of {limit} "
                "(max_position_embeddings, or the sliding window, which jdet does not apply)"
            )
        self.max_model_len = max_model_len or limit
        self.page_size = page_size
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ops = Ops(self.invariance)
        self._step = make_step_fn(self.cfg, self.ops)
        self._score = make_score_fn(self.cfg, self.ops)

    # -- input handling -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return (
            "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)
        )

    def _check_len(self, n: int, what: str) -> None:
        if n > self.max_model_len:
            raise ValueError(
                f"{what} has {n} tokens but max_model_len is {self.max_model_len}; shorten it or "
                f"raise max_model_len"
            )

    # -- API ------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        sps = sampling_params or SamplingParams()
        sp_list = list(sps) if isinstance(sps, Sequence) else [sps] * len(prompts)
        if len(sp_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sp_list)} sampling params")
        ids = [self.encode(p) for p in prompts]
        for i, (p, sp) in enumerate(zip(ids, sp_list, strict=True)):
            self._check_len(len(p) + sp.max_tokens, f"prompt {i} plus max_tokens={sp.max_tokens}")
        return _simple_generate(self, list(prompts), ids, sp_list)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None):
        """Yield the text of one completion as it is generated (incremental detokenisation)."""
        import queue
        import threading

        q: queue.Queue = queue.Queue()
        sp = sampling_params or SamplingParams()
        ids = self.encode(prompt)
        self._check_len(len(ids) + sp.max_tokens, f"prompt plus max_tokens={sp.max_tokens}")

        def work() -> None:
            try:
                _simple_generate(
                    self, [prompt], [ids], [sp], on_token=lambda s, t: s == 0 and q.put(("tok", t))
                )
                q.put(("end", None))
            except BaseException as e:  # surfaced in the consumer
                q.put(("err", e))

        threading.Thread(target=work, daemon=True).start()
        toks: list[int] = []
        sent = ""
        while True:
            kind, val = q.get()
            if kind == "err":
                raise val
            if kind == "end":
                break
            toks.append(val)
            text = self.decode(toks)
            if text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            yield text[len(sent) :]
            sent = text
        tail = self.decode(toks)[len(sent) :]
        if tail:
            yield tail

    def score(self, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs: out[b][i - 1] = log p(tokens[i] | tokens[:i]), i >= 1.

        The same reduction plan as sampling, so these equal the sampler's `logprobs` bitwise in
        the invariant modes.
        """
        if token_ids and isinstance(token_ids[0], int):
            raise TypeError("score() takes a list of token-id lists")
        seqs = [self.encode(t) for t in token_ids]
        for i, s in enumerate(seqs):
            self._check_len(len(s), f"sequence {i}")
        return _simple_score(self, seqs)

    def fingerprint(self) -> str:
        from jdet.fingerprint import fingerprint

        return fingerprint(
            self.model,
            self.invariance,
            page_size=self.page_size,
            tp=self.tp,
            attn_partition=self.ops.attn_partition,
        )


# -- the simple loop --------------------------------------------------------------------------


def _new_cache(llm: LLM, pages: int) -> dict:
    n = llm.num_pages or bucket(pages, 16)
    if n < pages:
        raise ValueError(f"num_pages={n} is too small: this batch needs {pages} pages")
    return init_kv_cache(llm.cfg, n, llm.page_size, llm.model.dtype)


def _pad_batch(llm: LLM, items: list[tuple[list[int], int, list[int]]], logits: str) -> tuple:
    T = sum(len(t) for t, _, _ in items)
    N = T if logits == "all" else len(items)
    Pm = max(len(p) for _, _, p in items)
    b, nrows = build_batch(
        items,
        llm.page_size,
        logits=logits,
        pad_tokens=bucket(T),
        pad_seqs=bucket(len(items), 4),
        pad_pages=bucket(Pm, 4),
    )
    rows = np.zeros(bucket(N, 4), np.int32)
    rows[:N] = b.logits_rows
    b.logits_rows = rows
    return jax.tree_util.tree_map(jnp.asarray, b), nrows


def _chunks(llm: LLM, work: list[tuple[int, list[int], int]]) -> list[list[tuple]]:
    """Split (seq index, tokens, start position) work into steps of <= budget tokens."""
    steps, cur, used = [], [], 0
    budget = llm.max_num_batched_tokens
    for s, toks, start in work:
        off = 0
        while off < len(toks):
            n = min(len(toks) - off, budget - used)
            cur.append((s, toks[off : off + n], start + off, off + n == len(toks)))
            used += n
            off += n
            if used == budget:
                steps.append(cur)
                cur, used = [], 0
    if cur:
        steps.append(cur)
    return steps


def _simple_generate(
    llm: LLM, prompts: list, ids: list[list[int]], sps: list[SamplingParams], on_token: Any = None
) -> list[RequestOutput]:
    # One sequence per (prompt, sample); each reserves its pages up front.
    seqs = [(p, j) for p in range(len(ids)) for j in range(sps[p].n)]
    B = llm.page_size
    pages, next_page = [], 0
    for p, _ in seqs:
        n = math.ceil((len(ids[p]) + sps[p].max_tokens) / B)
        pages.append(list(range(next_page, next_page + n)))
        next_page += n
    kv = _new_cache(llm, next_page)
    rng = np.random.default_rng()
    seeds = []
    for p, j in seqs:
        base = sps[p].seed if sps[p].seed is not None else int(rng.integers(2**31))
        seeds.append((base + 1_000_003 * j) % 2**32)
    out_tok: list[list[int]] = [[] for _ in seqs]
    out_lp: list[list[float]] = [[] for _ in seqs]
    out_top: list[list[dict]] = [[] for _ in seqs]
    done = [False] * len(seqs)
    reason = ["length"] * len(seqs)
    eos = set(llm.cfg.eos_token_ids)

    def run(items: list[tuple[int, list[int], int]], sample_rows: list[int]) -> None:
        nonlocal kv
        batch, _ = _pad_batch(llm, [(t, st, pages[s]) for s, t, st in items], "last")
        N = batch.logits_rows.shape[0]
        sp_in = _sampling_inputs(
            [sps[seqs[s][0]] for s, _, _ in items],
            [seeds[s] for s, _, _ in items],
            [st + len(t) for _, t, st in items],
            N,
        )
        kv, res = llm._step(llm.model.params, kv, batch, sp_in)
        res = jax.device_get(res)
        for r, (s, _, _) in enumerate(items):
            if r in sample_rows:
                _accept(
                    s,
                    int(res.tokens[r]),
                    float(res.logprobs[r]),
                    res.top_ids[r],
                    res.top_logprobs[r],
                )

    def _accept(s: int, tok: int, lp: float, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        sp = sps[seqs[s][0]]
        out_tok[s].append(tok)
        if on_token is not None:
            on_token(s, tok)
        out_lp[s].append(lp)
        if sp.logprobs:
            out_top[s].append(
                {
                    int(i): float(v)
                    for i, v in zip(top_ids[: sp.logprobs], top_lp[: sp.logprobs], strict=True)
                }
            )
        stop_ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else eos)
        if tok in stop_ids:
            done[s], reason[s] = True, "stop"
        elif len(out_tok[s]) >= sp.max_tokens:
            done[s] = True

    # prefill (chunked by the token budget); the last chunk of each prompt samples token 1
    work = [(s, ids[seqs[s][0]], 0) for s in range(len(seqs))]
    for step in _chunks(llm, work):
        items = [(s, t, st) for s, t, st, _ in step]
        run(items, [r for r, (_, _, _, last) in enumerate(step) if last])
    # decode
    while not all(done):
        live = [s for s in range(len(seqs)) if not done[s]][: llm.max_num_seqs]
        items = [(s, [out_tok[s][-1]], len(ids[seqs[s][0]]) + len(out_tok[s]) - 1) for s in live]
        run(items, list(range(len(items))))

    results = []
    for p in range(len(ids)):
        comps = []
        for s, (pp, j) in enumerate(seqs):
            if pp != p:
                continue
            toks = out_tok[s]
            text = llm.decode(toks)
            fin = reason[s]
            for stop in sps[p].stop or ():
                k = text.find(stop)
                if k >= 0:
                    text, fin = text[:k], "stop"
            comps.append(
                CompletionOutput(
                    j,
                    toks,
                    np.asarray(out_lp[s], np.float32),
                    text,
                    fin,
                    out_top[s] if sps[p].logprobs else None,
                    seeds[s],
                )
            )
        results.append(
            RequestOutput(prompts[p] if isinstance(prompts[p], str) else None, ids[p], comps)
        )
    return results


def _sampling_inputs(
    sps: list[SamplingParams], seeds: list[int], positions: list[int], N: int
) -> SamplingInputs:
    def col(vals: list, fill: Any, dt: Any) -> jax.Array:
        a = np.full(N, fill, dt)
        a[: len(vals)] = vals
        return jnp.asarray(a)

    return SamplingInputs(
        temperature=col([s.temperature for s in sps], 0.0, np.float32),
        top_k=col([s.top_k for s in sps], 0, np.int32),
        top_p=col([s.top_p for s in sps], 1.0, np.float32),
        seed=col(seeds, 0, np.uint32),
        position=col(positions, 0, np.int32),
    )


def _simple_score(llm: LLM, seqs: list[list[int]]) -> list[np.ndarray]:
    B = llm.page_size
    pages, nxt = [], 0
    for s in seqs:
        n = math.ceil(len(s) / B)
        pages.append(list(range(nxt, nxt + n)))
        nxt += n
    kv = _new_cache(llm, nxt)
    out = [np.zeros(max(len(s) - 1, 0), np.float32) for s in seqs]
    work = [(i, s, 0) for i, s in enumerate(seqs)]
    for step in _chunks(llm, work):
        items = [(pages[i], t, st, i) for i, t, st, _ in step]
        batch, _ = _pad_batch(llm, [(t, st, pg) for pg, t, st, _ in items], "all")
        targets = np.zeros(batch.logits_rows.shape[0], np.int32)
        r = 0
        spans = []
        for _, t, st, i in items:
            for k in range(len(t)):
                pos = st + k
                if pos + 1 < len(seqs[i]):
                    targets[r] = seqs[i][pos + 1]
                    spans.append((r, i, pos))
                r += 1
        kv, lp = llm._score(llm.model.params, kv, batch, jnp.asarray(targets))
        lp = np.asarray(jax.device_get(lp))
        for r, i, pos in spans:
            out[i][pos] = lp[r]
    return out


__all__ = ["LLM", "SamplingParams", "NUM_TOP"]
