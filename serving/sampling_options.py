"""How one request samples: `SamplingOptions`, the engine's form of a request's sampling fields.

Its fields are the engine's rows of jdet/request_fields.py `FIELDS` (the one declaration of every
request field, shared with `jdet.SamplingParams` and the server's schemas); `from_any` builds it
from `jdet.SamplingParams`, a dict or any object with those attribute names, and `check()` is the
one boundary check (jdet/request_fields.py `check`), raising `InvalidRequest` naming the field.
Bounds are those of the arrays the step receives, so nothing that passes them can fail inside the
model runner.
"""

from __future__ import annotations

import dataclasses

from jdet.request_fields import (
    ENGINE_DEFAULTS,
    ENGINE_FIELDS,
    INT32_MAX,
    InvalidRequest,
    check,
    check_int,
    check_prompt_ids,
    engine_annotation,
    engine_values,
)

__all__ = ["INT32_MAX", "InvalidRequest", "SamplingOptions", "check_int", "check_prompt_ids",
           "check_request"]  # fmt: skip


class _Options:
    """SamplingOptions' methods (its fields come from the table)."""

    @property
    def needs_logits_inputs(self) -> bool:
        """Whether this request's rows need the step's LogitsInputs (not the neutral ones)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.min_p or self.min_tokens or self.logit_bias or self.bad_words
            or self.allowed_token_ids is not None or self.structured
        )  # fmt: skip

    @classmethod
    def from_any(cls, p: object | None) -> SamplingOptions:
        """The engine's options from any params object (or dict), unconverted: `check()` then
        names any value of the wrong type instead of a bare `int()` error."""
        if p is None:
            return cls()
        if isinstance(p, cls):
            return p
        return cls(**engine_values(p))

    def check(self, vocab_size: int | None = None) -> SamplingOptions:
        """Raise InvalidRequest naming the first bad field; return self (for chaining).

        Model-dependent bounds (token ids < vocab) apply when `vocab_size` is given.
        """
        check(self, vocab_size)
        return self


# What the engine needs to know about how to sample one request. `seed=None` means "pick one at
# admission and record it"; `max_tokens=None` "up to max_model_len". Frozen and hashable (tuples).
SamplingOptions = dataclasses.make_dataclass(
    "SamplingOptions",
    [(f.name, engine_annotation(f), dataclasses.field(default=ENGINE_DEFAULTS[f.name]))
     for f in ENGINE_FIELDS],
    bases=(_Options,),
    frozen=True,
)  # fmt: skip
SamplingOptions.__module__ = __name__  # make_dataclass's `module=` needs Python 3.12


def check_request(
    prompt: object, opts: SamplingOptions, *, vocab_size: int, max_model_len: int
) -> None:
    """The whole boundary check of one request: its prompt ids and its sampling options."""
    check_prompt_ids(prompt, vocab_size=vocab_size, max_model_len=max_model_len, field="prompt")
    opts.check(vocab_size)
