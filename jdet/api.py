"""The public offline API: `jdet.LLM` (generate, stream, score).

`LLM` owns the model, the invariance mode and the engine settings; it validates input at the
boundary and runs everything through one serving engine (serving/engine/engine.py), so offline
generation, scoring and the server share the scheduler, the prefix cache and the compiled steps.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jdet.fingerprint import fingerprint
from jdet.loader import Model, load
from jdet.request_fields import InvalidRequest, check_prompt_ids
from jdet.sampling import NUM_TOP
from jdet.sampling_params import RequestOutput, SamplingParams
from jdet.settings import EngineConfig
from jdet.spec_config import SpeculativeConfig
from serving.engine import llm_backend, multihost
from serving.engine.engine import Engine
from sharding import distributed

Prompt = str | Sequence[int]


class LLM:
    """Offline, engine-backed generation and teacher-forced scoring with one reduction plan."""

    def __init__(
        self,
        model: Model | str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        warmup: bool | None = None,
        speculative: SpeculativeConfig | dict | None = None,
        **settings: Any,
    ) -> None:
        """`config`: the engine settings, a `jdet.settings.EngineConfig` (every field, default and
        help text there: tp, invariance, max_num_batched_tokens, max_num_seqs, max_model_len,
        page_size, num_pages, enable_prefix_caching, scheduling, dtype, compile_cache,
        min_*_bucket, async_scheduling), passed whole to the engine; keyword `settings` replace
        single fields (`LLM(model, tp=2)`). `warmup`: compile every step shape on the first
        generate/stream (and every score shape on the first score), with a progress bar, so no
        call meets a compile halfway; default on, `$JDET_WARMUP=0` turns it off (shapes then
        compile when first met). `speculative`: a `jdet.SpeculativeConfig` (or dict of its
        fields) to draft and verify several tokens per step; with verify="exact" the outputs are
        bitwise those without it (serving/speculative/speculator.py)."""
        config = dataclasses.replace(config or EngineConfig(), **settings)
        tp, max_model_len = config.tp, config.max_model_len
        # a multi-host job (num_processes > 1) starts before the model touches a device
        self.cluster = distributed.initialize(
            distributed.resolve(config.num_processes, config.process_id,
                                config.coordinator_address),
            heartbeat_timeout=config.heartbeat_timeout,
        )  # fmt: skip
        self.model = model if isinstance(model, Model) else load(model, dtype=config.dtype)
        self.cfg = self.model.cfg
        self.speculative = SpeculativeConfig.from_any(speculative)
        if tp > len(jax.devices()):
            raise ValueError(f"tp={tp} but only {len(jax.devices())} devices are visible")
        window = self.cfg.sliding_window
        if window and window < self.cfg.max_position_embeddings:
            if max_model_len is not None and max_model_len > window:
                raise ValueError(
                    f"max_model_len={max_model_len} exceeds the sliding window ({window}), which "
                    "jdet does not apply; use max_model_len <= the window"
                )
            max_model_len = max_model_len or window
        # The engine validates the remaining settings and allocates the KV cache now, so a bad
        # configuration fails here rather than at the first request.
        self.config = dataclasses.replace(config, max_model_len=max_model_len)
        self.engine = Engine(self.model, self.config, speculative=self.speculative)
        multihost.check_same_pool(self.engine)  # a multi-host job: one KV pool size everywhere
        self.plan = self.engine.plan  # the reduction plan, validated once (jdet/plan.py)
        self.invariance = self.plan.invariance
        if warmup is None:
            warmup = os.environ.get("JDET_WARMUP", "1") != "0"
        self.warmup = warmup
        self.tp = tp
        self.page_size = config.page_size
        self.max_model_len = self.engine.max_model_len

    # -- input handling -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> checked token ids (the engine's shared boundary check; the
        length against max_model_len is checked by the caller, with max_tokens)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token-id lists")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest("prompt", "prompt is not valid Unicode text (a lone "
                                     "surrogate such as \\ud800); pass UTF-8 text") from None
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = list(prompt)  # ints only: 1.5 or "7" is refused, not truncated or parsed
        check_prompt_ids(ids, vocab_size=self.cfg.vocab_size, max_model_len=2**31, field="prompt")
        return [int(t) for t in ids]

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
        sp_list = multihost.spmd_inputs(ids, sp_list)  # every process the same; one seed each
        strs = [p if isinstance(p, str) else None for p in prompts]
        self._warm("step")
        outs = llm_backend.generate(self.engine, ids, sp_list, prompts=strs, use_tqdm=use_tqdm)
        want = [i for i, sp in enumerate(sp_list) if getattr(sp, "prompt_logprobs", None) == 0]
        if want:  # the score() plan: bitwise what the sampler reports for these tokens
            self._warm("score")
            lps = llm_backend.score(self.engine, [ids[i] for i in want])
            for i, lp in zip(want, lps, strict=True):
                outs[i].prompt_logprobs = [None] + [float(x) for x in lp]
        return outs

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or to
        a list of conversations, through the model's chat template (or `chat_template`, a Jinja
        template string), as vLLM's `LLM.chat`. The rendered text is each output's `prompt`."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; chat() needs one (use generate)")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass chat_template='...' (Jinja)"
            )
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise TypeError("chat() takes a list of messages or a list of conversations")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = []
        for i, conv in enumerate(convs):
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError(
                    f"conversation {i}: give a non-empty list of {{'role': ..., 'content': ...}}"
                )
            texts.append(self.tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=template))  # fmt: skip
        # the template already holds the special tokens (BOS and the like): none added again
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        outs = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        for o, t in zip(outs, texts, strict=True):
            o.prompt = t
        return outs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None):
        """Yield the text of one completion as it is generated (stop strings applied)."""
        sp = sampling_params or SamplingParams()
        ids = self.encode(prompt)
        self._check_len(len(ids) + sp.max_tokens, f"prompt plus max_tokens={sp.max_tokens}")
        (sp,) = multihost.spmd_inputs([ids], [sp])
        self._warm("step")
        yield from llm_backend.stream(self.engine, ids, sp)

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
        multihost.spmd_inputs(seqs, None)
        self._warm("score")
        return llm_backend.score(self.engine, seqs)

    def _warm(self, kind: str) -> None:
        """First use of an entry point: compile all its shapes now (progress bar on stderr)."""
        if self.warmup and kind not in self.engine.warm:
            self.engine.warmup(kind, progress=True)

    def fingerprint(self) -> str:
        return fingerprint(
            self.model, self.plan, page_size=self.page_size, speculative=self.speculative
        )


__all__ = ["LLM", "SamplingParams", "NUM_TOP"]
