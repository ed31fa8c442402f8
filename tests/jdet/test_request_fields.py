"""Each request field is declared once (jdet/request_fields.py FIELDS) and the Python API, the
server's schemas and the engine's options follow from it; near misses are named."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

import jdet
from jdet.request_fields import API_FIELDS, ENGINE_FIELDS, FIELDS, http_fields
from serving.http.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from serving.http.request_parsing import COMPLETIONS_MAX_TOKENS, parse, sampling_options
from serving.sampling_options import SamplingOptions

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_the_schemas_and_the_engine_options_follow_the_table():
    names = [f.name for f in dataclasses.fields(jdet.SamplingParams)]
    assert names == [f.name for f in API_FIELDS]
    assert [f.name for f in dataclasses.fields(SamplingOptions)] == [f.name for f in ENGINE_FIELDS]
    for schema, endpoint in ((CompletionRequest, "completions"), (ChatCompletionRequest, "chat")):
        for f in http_fields(endpoint):
            assert f.http in schema.model_fields, (endpoint, f.name)
    assert "logprobs" in CompletionRequest.model_fields  # chat's is its own (a bool)
    assert len({f.name for f in FIELDS}) == len(FIELDS)


def test_the_step_limits_are_defined_once():
    src = [p for d in ("jdet", "serving", "sharding", "pallas_kernels")
           for p in (ROOT / d).rglob("*.py")]  # fmt: skip
    for name in ("NUM_TOP", "MAX_LOGIT_BIAS"):
        where = [p for p in src if re.search(rf"^{name}\s*=", p.read_text(), flags=re.M)]
        assert [p.relative_to(ROOT).as_posix() for p in where] == ["jdet/sampling.py"], name


def test_a_misspelled_keyword_names_the_near_field():
    with pytest.raises(TypeError, match="did you mean 'max_tokens'"):
        jdet.SamplingParams(max_token=8)
    with pytest.raises(ValueError, match="top_k"):  # bounds: the shared check
        jdet.SamplingParams(top_k=-5)


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
def test_a_misspelled_request_field_is_a_400_naming_the_near_field(schema):
    body = {"model": "m", "max_token": 8, "prompt": "hi", "messages": [{"role": "user",
                                                                      "content": "hi"}]}
    body.pop("messages" if schema is CompletionRequest else "prompt")
    with pytest.raises(RequestError) as e:
        parse(json.dumps(body).encode(), schema)
    assert e.value.status == 400 and e.value.param == "max_token"
    assert "did you mean 'max_tokens'?" in e.value.message


def test_defaults_are_openais_completions_16_and_chat_the_rest_of_the_context():
    cmpl = parse(b'{"model": "m", "prompt": "hi"}', CompletionRequest)
    opts = sampling_options(cmpl, prompt_len=10, max_model_len=100)
    assert opts.max_tokens == COMPLETIONS_MAX_TOKENS == 16
    short = sampling_options(cmpl, prompt_len=95, max_model_len=100)
    assert short.max_tokens == 5  # what the context leaves
    chat = parse(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}',
                 ChatCompletionRequest)  # fmt: skip
    assert sampling_options(chat, prompt_len=10, max_model_len=100).max_tokens == 90
