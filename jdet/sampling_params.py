"""Request-level sampling settings and outputs of the offline API."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from jdet.request_fields import API_FIELDS, check, did_you_mean, engine_values


class _Params:
    """SamplingParams' methods (its fields come from the table)."""

    def __post_init__(self) -> None:
        # One validation for every entry point (LLM, server, CLI, engine): the bounds are those
        # of the arrays the step receives, so a value that passes cannot fail inside a step.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        check(SimpleNamespace(**engine_values(self)))


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, f.annotation, dataclasses.field(default=f.default)) for f in API_FIELDS],
    bases=(_Params,),
    frozen=True,
)
SamplingParams.__module__ = __name__  # make_dataclass's `module=` needs Python 3.12
SamplingParams.__doc__ = (
    "How to sample one request (jdet/request_fields.py `FIELDS`: each field's meaning and bounds). "
    "Validated at construction: bad values never reach the engine. Frozen: a request's settings "
    "cannot change after the check (use dataclasses.replace).\n\n"
    + "\n".join(f"{f.name}: {f.annotation} = {f.default!r}  ({f.help})" for f in API_FIELDS)
)
_init = SamplingParams.__init__


@functools.wraps(_init)  # keeps the generated signature (help(), inspect)
def _init_naming_near_misses(self: Any, *args: Any, **kwargs: Any) -> None:
    unknown = [k for k in kwargs if k not in _NAMES]
    if unknown:
        k = unknown[0]
        raise TypeError(
            f"SamplingParams got an unexpected keyword argument {k!r}"
            f"{did_you_mean(k, _NAMES)}; its fields: {', '.join(_NAMES)}"
        )
    _init(self, *args, **kwargs)


_NAMES = tuple(f.name for f in API_FIELDS)
SamplingParams.__init__ = _init_naming_near_misses


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
