"""Request-level sampling settings and outputs of the offline API."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request. Validated at construction: bad values never reach the engine."""

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

    def __post_init__(self) -> None:
        # One validation for every entry point (LLM, server, CLI, engine): the bounds are those
        # of the arrays the step receives, so a value that passes cannot fail inside a step.
        from serving.sequence import SamplingOptions

        if isinstance(self.stop, str):
            self.stop = [self.stop]
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
