"""Structured output (issue 19): JSON schemas, regexes, choices through llguidance masks.

The target: 100 % schema-valid JSON over a set of >= 20 schemas on the embedded model
(`jdet.load()`), checked with `jsonschema`; then the same bits for a constrained request alone and
batched with others, and the server's `response_format` / `guided_*` fields.
Negative control for validity: the same requests without the constraint produce invalid JSON,
so the validity check is not vacuous.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import jdet

# One xdist worker for the whole module: its tests share the module's engine and compiled steps
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("structured")

S = {"type": "string", "maxLength": 8}
I = {"type": "integer", "minimum": -50, "maximum": 999}  # noqa: E741
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "array", "items": I, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 10},
     "y": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["x", "y"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": I,
     "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\\\.com$"}},
     "required": ["id", "email"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 1, "maximum": 100},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "object", "properties": {"a": {"const": 1}, "b": {"type": ["integer", "null"],
     "maximum": 9, "minimum": 0}}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [I, S]}}, "required": ["v"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": S}, "required": ["k"],
     "additionalProperties": False}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"date": {"type": "string",
     "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}, "required": ["date"],
     "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "number",
     "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 3}}, "required": ["scores"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "done": {"type": "boolean"},
     "priority": {"enum": [1, 2, 3]}}, "required": ["title", "done", "priority"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"point": {"type": "array", "items": I, "minItems": 2,
     "maxItems": 2}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer",
     "minimum": 1, "maximum": 9}}, "required": ["kind", "r"], "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {},
     "additionalProperties": False}}, "required": ["meta"], "additionalProperties": False},
    {"type": "string", "maxLength": 5, "minLength": 1},
]  # fmt: skip
PROMPTS = ["Person:", "JSON:", "Data", "The answer is", "{", "Output:", "Here", "Result ="]


@pytest.fixture(scope="module")
def llm():
    # "none" (plain XLA ops) keeps this CPU test fast; validity does not depend on the mode,
    # and the invariance test below runs in the default "tp" mode. One step shape (T = S = 32,
    # 16 pages), compiled once: with T and S free, the batch went through 4 step shapes as the
    # 22 requests finished.
    return jdet.LLM(jdet.load(dtype="float32"), invariance="none", max_num_batched_tokens=32,
                    max_num_seqs=32, max_model_len=256, page_size=16, min_tokens_bucket=32,
                    min_seqs_bucket=32, min_pages_bucket=16)  # fmt: skip


def test_every_schema_gives_valid_json(llm):
    assert len(SCHEMAS) >= 20
    sps = [
        jdet.SamplingParams(temperature=0.8, seed=i, max_tokens=120, json_schema=schema)
        for i, schema in enumerate(SCHEMAS)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    outs = llm.generate(prompts, sps)
    for schema, o in zip(SCHEMAS, outs, strict=True):
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    # negative control: unconstrained, the same requests do not give valid JSON
    free = llm.generate(prompts, [jdet.SamplingParams(temperature=0.8, seed=i, max_tokens=30)
                                  for i in range(len(SCHEMAS))])  # fmt: skip
    valid = 0
    for schema, o in zip(SCHEMAS, free, strict=True):
        try:
            jsonschema.validate(json.loads(o.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid < len(SCHEMAS) // 2


def test_regex_choice_and_json_object(llm):
    outs = llm.generate(
        ["Code:", "Pick one:", "Object:"],
        [
            jdet.SamplingParams(temperature=1.0, seed=1, max_tokens=30, regex=r"[A-Z]{2}-[0-9]{3}"),
            jdet.SamplingParams(temperature=1.0, seed=2, max_tokens=30, choice=["alpha", "beta"]),
            jdet.SamplingParams(temperature=0.0, max_tokens=120, json_object=True),
        ],
    )
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", outs[0].text)
    assert outs[1].text in ("alpha", "beta")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    else:  # an unbounded object may run out of tokens; what there is must be a JSON prefix
        assert outs[2].text.startswith("{")


def test_bad_constraints_are_refused_by_name(llm):
    for kw, field in [
        (dict(json_schema={"type": "objec"}), "json_schema"),
        (dict(regex="a("), "regex"),
        (dict(json_schema="{not json"), "json_schema"),
        (dict(regex="a", choice=["x"]), "structured_outputs"),
        (dict(regex="a", ignore_eos=True), "ignore_eos"),
    ]:
        with pytest.raises(ValueError) as e:
            llm.generate("x", jdet.SamplingParams(max_tokens=4, **kw))
        assert getattr(e.value, "field", None) == field, (kw, e.value)


def test_constrained_bits_alone_and_batched():
    llm = jdet.LLM(jdet.load(dtype="float32"), max_num_batched_tokens=64, max_num_seqs=8,
                   max_model_len=128, page_size=16, min_tokens_bucket=64,
                   min_seqs_bucket=8)  # fmt: skip
    constrained = {
        2: ("Person:", jdet.SamplingParams(temperature=0.9, seed=7, max_tokens=40, logprobs=2,
                                           json_schema=SCHEMAS[0])),
        4: ("Code:", jdet.SamplingParams(temperature=1.0, seed=8, max_tokens=20, logprobs=2,
                                         regex=r"[a-z]{2,6}-[0-9]{2}")),
        5: ("Pick:", jdet.SamplingParams(temperature=1.0, seed=9, max_tokens=20, logprobs=2,
                                         choice=["north", "south", "east"])),
    }  # fmt: skip
    sps = [jdet.SamplingParams(temperature=0.7, seed=i, max_tokens=12) for i in range(7)]
    prompts = ["a", "bb", "", "the cat", "", "", "JSON"]
    for i, (p, sp) in constrained.items():
        prompts[i], sps[i] = p, sp
    batched = llm.generate(prompts, sps)
    for i, (p, sp) in constrained.items():
        alone = llm.generate(p, sp)[0]
        assert alone.token_ids == batched[i].token_ids, i
        assert np.array_equal(alone.logprobs, batched[i].logprobs), i
        assert alone.outputs[0].top_logprobs == batched[i].outputs[0].top_logprobs, i
    jsonschema.validate(json.loads(batched[2].text), SCHEMAS[0])
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", batched[4].text)
    assert batched[5].text in ("north", "south", "east")


def test_server_fields(serving_model):
    """response_format / guided_* / penalties / logit_bias / echo over HTTP (tiny model)."""
    from fastapi.testclient import TestClient

    from serving.engine.engine import Engine
    from serving.http.server import build_app

    eng = Engine(serving_model, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                 page_size=16, min_tokens_bucket=64)  # fmt: skip
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    msgs = [{"role": "user", "content": "a number"}]
    with TestClient(build_app(eng, model_name="m", fingerprint="fp", warmup=False)) as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": msgs, "max_tokens": 40, "seed": 1, "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "num", "schema": schema}}})  # fmt: skip
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
        assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
        choice = {"model": "m", "prompt": "hi", "max_tokens": 20, "seed": 3,
                  "guided_choice": ["one", "two"]}  # fmt: skip
        r = c.post("/v1/completions", json=choice)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("one", "two"), r.text
        body = {"model": "m", "prompt": "hello", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        plain = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        r = c.post("/v1/completions", json={**body, "echo": True})
        assert r.json()["choices"][0]["text"] == "hello" + plain
        first = serving_model.tokenizer(plain)["input_ids"][0]
        r = c.post("/v1/completions", json={
            **body, "logit_bias": {str(first): -100}, "presence_penalty": 1.0,
            "frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_p": 0.1,
            "min_tokens": 2, "bad_words": ["xyz"], "allowed_token_ids": list(range(1, 300))})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_regex": "a("})
        assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text


def test_server_chat_template_override(serving_model, tmp_path):
    from fastapi.testclient import TestClient

    from serving.engine.engine import Engine
    from serving.http.launch import read_chat_template
    from serving.http.server import build_app

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    template = read_chat_template(str(f))
    eng = Engine(serving_model, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256,
                 page_size=16, min_tokens_bucket=64)  # fmt: skip
    app = build_app(eng, model_name="m", fingerprint="fp", warmup=False, chat_template=template)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        want = len(serving_model.tokenizer("[hi]", add_special_tokens=False)["input_ids"])
        assert r.json()["usage"]["prompt_tokens"] == want
    with pytest.raises(ValueError, match="neither a file"):
        read_chat_template("no-such-file.jinja")
