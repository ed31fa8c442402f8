"""A request's one check, at admission: `Admission.check_request`.

Validation happens once, here (`Engine.admission`): every field within jdet/request_fields.py's
bounds (the one table of request fields), the prompt's token ids against the vocabulary and
max_model_len, the transforms and stop strings that need the tokenizer, structured output's
grammar; each failure an `InvalidRequest` naming the field. Why the engine's: the bounds are its
own (its max_model_len, vocabulary, tokenizer and grammar compiler), and every caller reaches the
engine: `Engine.add_request` runs the check unless the caller already did (`checked=True`). The
HTTP server runs it itself, in a worker thread, before it answers (serving/http/server.py), so a
bad request is its 400 before a stream starts and a grammar compile never stalls the engine
thread; it then adds the request with `checked=True`. Nothing that passes can fail inside the
model runner: the bounds are those of the step's arrays.
"""

from __future__ import annotations

from typing import Any

from serving.sampling_options import InvalidRequest, SamplingOptions, check_prompt_ids


class Admission:
    """The engine's checks of a request; reads nothing a step changes, so any thread may call."""

    def __init__(self, vocab_size: int, max_model_len: int, tokenizer: Any, transforms: Any):
        """`transforms`: the runner's LogitsRows (serving/constrained/logits_rows.py), whose
        `check` compiles a request's grammar and needs the tokenizer for bad_words."""
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.tokenizer, self.transforms = tokenizer, transforms

    def check_prompt(self, prompt: Any, field: str = "prompt") -> None:
        """The prompt's token ids: integers in the vocabulary, shorter than max_model_len."""
        check_prompt_ids(prompt, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                         field=field)  # fmt: skip

    def check_options(self, params: Any) -> SamplingOptions:
        """The sampling options of `params` (SamplingParams, SamplingOptions, a dict), checked."""
        o = SamplingOptions.from_any(params).check(self.vocab_size)
        self.transforms.check(o)  # structured output's grammar; bad_words need the tokenizer
        if o.stop and self.tokenizer is None:
            raise InvalidRequest("stop", "stop strings need a tokenizer")
        return o

    def check_request(self, prompt: Any, params: Any, field: str = "prompt") -> SamplingOptions:
        """The whole check of one request, prompt first; its options."""
        self.check_prompt(prompt, field)
        return self.check_options(params)
