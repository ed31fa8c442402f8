"""Request-level sampling settings and outputs of the offline API."""

from __future__ import annotations

import dataclasses

import numpy as np

from serving.sampling_options import SamplingOptions


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated at construction: bad values never reach the engine.
    Frozen: a request's settings cannot change after the check (use dataclasses.replace)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top log-probs to return per generated token
    # Logits transforms, row-local so a request's bits never depend on its batch (jdet/sampling.py
    # gives the order). Names and meanings as in the OpenAI API and vLLM.
    presence_penalty: float = 0.0  # [-2, 2]: minus this for each token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's generated count
    repetition_penalty: float = 1.0  # (0, 100]: prompt + generated tokens; > 1 discourages
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids banned until this many (stop strings apply)
    bad_words: list[str] | None = None  # words never generated (vLLM's token-sequence rule)
    allowed_token_ids: list[int] | None = None  # only these tokens may be generated
    prompt_logprobs: int | None = None  # 0: also return the prompt tokens' log-probs
    # Structured output (at most one): a JSON schema (dict or JSON text), any JSON object,
    # a regular expression, one of a list of strings, or a Lark grammar (llguidance syntax).
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        # One validation for every entry point (LLM, server, CLI, engine): the bounds are those
        # of the arrays the step receives, so a value that passes cannot fail inside a step.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        SamplingOptions.from_any(self).check()


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: np.ndarray  # f32[len(token_ids)]: log-prob of each generated token
    text: str
    finish_reason: str  # "stop" or "length"
    top_logprobs: list[dict[int, float]] | None = None
    seed: int | None = None


@dataclasses.dataclass
class RequestOutput:
    """One prompt's result. `token_ids`, `logprobs`, `text` are those of the first sample;
    `outputs` holds all `n` samples."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # with SamplingParams(prompt_logprobs=0): log p(prompt[i] | prompt[:i]) for i >= 1, the
    # same plan as score(); entry 0 (the first prompt token has no context) is None
    prompt_logprobs: list[float | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> np.ndarray:
        return self.outputs[0].logprobs

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason
