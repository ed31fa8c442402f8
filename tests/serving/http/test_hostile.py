"""Hostile and malformed requests: each gets a 4xx that names the problem, none reaches or hurts
the engine, and a stream running through all of them ends with the bits it has alone.

The server runs in this process (uvicorn on a loopback port, a thread) on the tiny model, with a
256 KB body limit so the size cases are cheap. The table covers every field (types, bounds,
int32/u32 overflow, vocabulary), encodings (invalid UTF-8, lone surrogates), sizes, nesting
depth, unknown and unsupported parameters, methods, paths and headers.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import threading
import time

import httpx
import pytest

# One xdist worker for the whole module: its tests share one server (start-up and compiles)
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("hostile")

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 256 * 1024
C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
MSG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hostile_server(serving_model):
    import uvicorn

    from serving.engine.engine import Engine
    from serving.http.server import build_app

    eng = Engine(
        serving_model, invariance="tp", max_model_len=256, page_size=8, num_pages=128,
        max_num_seqs=16, max_num_batched_tokens=64, min_tokens_bucket=64, min_seqs_bucket=16,
        min_pages_bucket=32,
    )  # fmt: skip
    app = build_app(eng, model_name="tiny", fingerprint="fp_h", api_key=KEY, max_body_bytes=LIMIT)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started, "the in-process server did not start"
    deadline = time.time() + 600  # warm-up compiles the shape set in the background (503 meanwhile)
    while httpx.get(base + "/health", timeout=10).status_code != 200 and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(base + "/health", timeout=10).status_code == 200, "the server never got warm"
    yield base, eng
    server.should_exit = True
    thread.join(timeout=15)


def with_(base: dict, **kw) -> dict:
    return {**base, **kw}


def chat(**kw) -> dict:
    return with_(MSG, **kw)


def nested(depth: int) -> object:  # small depths only (json.dumps recurses)
    x: object = "deep"
    for _ in range(depth):
        x = [x]
    return x


# (id, method, path, body: dict | bytes | None, extra headers, expected status, words).
# `words`: each must appear (case-insensitive) in the error's message or param.
CASES: list[tuple] = []


def case(name, body, status=400, words=(), path=C, method="POST", headers=None):
    CASES.append((name, method, path, body, headers or {}, status, tuple(words)))


# --- body encoding and syntax
case("not_json", b"{not json", words=["not valid JSON"])
case("empty_body", b"", words=["not valid JSON"])
case("truncated_json", b'{"model": "tiny", "prompt": "hi"', words=["not valid JSON"])
case("array_body", b"[1, 2]", words=["JSON object"])
case("string_body", b'"hello"', words=["JSON object"])
case("null_body", b"null", words=["JSON object"])
case("number_body", b"42", words=["JSON object"])
case("invalid_utf8", b'{"model": "tiny", "prompt": "\xff\xfe"}', words=["not valid JSON"])
case("latin1_bytes", b'{"model": "tiny", "prompt": "caf\xe9"}', words=["not valid JSON"])
case("nan_temperature", b'{"model":"tiny","prompt":"hi","temperature":NaN}', words=["temperature"])
case("infinite_temperature", b'{"model":"tiny","prompt":"hi","temperature":1e999}',
     words=["temperature"])  # fmt: skip
case("duplicate_keys_last_wins_bad", b'{"model":"tiny","prompt":"hi","n":1,"n":0}', words=["n"])
# --- nesting depth
case("deep_brackets_100k", b"[" * 100_000, words=["nests deeper"])
case("deep_prompt_3000",
     b'{"model": "tiny", "prompt": ' + b"[" * 3000 + b"1" + b"]" * 3000 + b"}",
     words=["nests deeper"])  # fmt: skip
case("deep_objects_in_noop_field", with_(OK, metadata=nested(40)), words=["nests deeper"])
case("deep_message_content", chat(messages=[{"role": "user", "content": nested(40)}]),
     path=CH, words=["nests deeper"])  # fmt: skip
# --- lone surrogates (valid JSON, not text)
for i, (where, body, p) in enumerate([
    ("prompt", with_(OK, prompt="abc \ud800 def"), C),
    ("prompt", with_(OK, prompt="\udfff"), C),
    ("prompt", with_(OK, prompt=["ok", "bad \udc00"]), C),
    ("messages", chat(messages=[{"role": "user", "content": "hi \ud800"}]), CH),
    ("messages", chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]),
     CH),
    ("stop", with_(OK, stop=["\ud800"]), C),
    ("model", with_(OK, model="tiny\ud800"), C),
    ("user", with_(OK, user="\udfff"), C),
]):  # fmt: skip
    case(f"surrogate_{i}_{where}", body, words=[where, "surrogate"], path=p)
case("surrogate_in_key", {"model": "tiny", "prompt": "hi", "\ud800": 1}, words=["surrogate"])
# --- sizes
case("body_over_limit", with_(OK, prompt="a " * LIMIT), status=413, words=["exceeds"])
case("too_many_prompts", with_(OK, prompt=["a"] * 65), words=["prompt", "at most 64"])
case("prompt_ids_over_max_model_len", with_(OK, prompt=[5] * 300),
     words=["prompt", "max_model_len"])  # fmt: skip
case("prompt_text_over_max_model_len", with_(OK, prompt="hello world " * 300),
     words=["prompt", "max_model_len"])  # fmt: skip
case("max_tokens_over_room", with_(OK, max_tokens=10**6), words=["max_tokens", "max_model_len"])
case("too_many_stop_strings", with_(OK, stop=[f"s{i}" for i in range(17)]), words=["stop"])
case("too_many_stop_token_ids", with_(OK, stop_token_ids=list(range(65))),
     words=["stop_token_ids"])  # fmt: skip
case("model_name_100kb", with_(OK, model="m" * 100_000), status=404, words=["does not exist"])
# --- unknown and unsupported parameters
case("unknown_field", with_(OK, foo=1), words=["unknown field", "foo"])
case("unknown_fields_many", with_(OK, **{f"x{i}": i for i in range(9)}), words=["and 4 more"])
for name, value in [
    ("guided_decoding_backend", "xgrammar"), ("structured_outputs", {"regex": "a+"}),
    ("guided_whitespace_pattern", " "), ("prompt_logprobs", 1),
    ("use_beam_search", True), ("length_penalty", 0.5),
    ("truncate_prompt_tokens", 3), ("skip_special_tokens", False),
    ("include_stop_str_in_output", True), ("priority", 1), ("logits_processors", ["x"]),
]:  # fmt: skip
    case(f"unsupported_{name}", with_(OK, **{name: value}), words=[name, "not supported"])
case("unsupported_chat_template", chat(chat_template="{{x}}"), path=CH,
     words=["chat_template", "not supported"])  # fmt: skip
case("unsupported_tool_choice", chat(tool_choice="auto"), path=CH, words=["tool_choice"])
case("message_unknown_field", chat(messages=[{"role": "user", "content": "x", "foo": 1}]),
     path=CH, words=["messages.0.foo"])  # fmt: skip
case("text_part_unknown_field",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]),
     path=CH, words=["messages"])  # fmt: skip
case("stream_options_unknown_field", with_(OK, stream=True, stream_options={"x": 1}),
     words=["stream_options"])  # fmt: skip
# --- every field: types and bounds (completions)
for field, bad, words in [
    ("model", 5, ["model"]), ("model", None, ["model"]), ("model", "nope", ["does not exist"]),
    ("prompt", 5, ["prompt"]), ("prompt", {"a": 1}, ["prompt"]), ("prompt", [], ["prompt"]),
    ("prompt", [[]], ["prompt"]), ("prompt", [1, "a"], ["prompt"]), ("prompt", [1.5], ["prompt"]),
    ("prompt", [True], ["prompt"]), ("prompt", [2**31], ["prompt"]), ("prompt", [-1], ["prompt"]),
    ("prompt", [320], ["prompt", "vocabulary"]), ("prompt", [[1], [2**40]], ["prompt"]),
    ("prompt", "", ["prompt"]), ("prompt", None, ["prompt"]),
    ("max_tokens", 0, ["max_tokens"]), ("max_tokens", -1, ["max_tokens"]),
    ("max_tokens", 2**31, ["max_tokens"]), ("max_tokens", 2**63, ["max_tokens"]),
    ("max_tokens", "5", ["max_tokens"]), ("max_tokens", 1.5, ["max_tokens"]),
    ("max_tokens", True, ["max_tokens"]),
    ("temperature", -0.1, ["temperature"]), ("temperature", 2.5, ["temperature"]),
    ("temperature", "hot", ["temperature"]), ("temperature", [1], ["temperature"]),
    ("top_p", 0, ["top_p"]), ("top_p", 1.5, ["top_p"]), ("top_p", -0.1, ["top_p"]),
    ("top_p", "x", ["top_p"]),
    ("top_k", 2**31, ["top_k"]), ("top_k", 2**40, ["top_k"]), ("top_k", -2, ["top_k"]),
    ("top_k", 1.5, ["top_k"]), ("top_k", "5", ["top_k"]),
    ("n", 0, ["n"]), ("n", 17, ["n"]), ("n", -1, ["n"]), ("n", 2**31, ["n"]), ("n", "2", ["n"]),
    ("seed", 2**64, ["seed"]), ("seed", -(2**63) - 1, ["seed"]), ("seed", 1.5, ["seed"]),
    ("seed", "1", ["seed"]),
    ("stop", "", ["stop"]), ("stop", [""], ["stop"]), ("stop", [1], ["stop"]),
    ("stop", {"a": 1}, ["stop"]),
    ("stop_token_ids", [320], ["stop_token_ids"]), ("stop_token_ids", [-1], ["stop_token_ids"]),
    ("stop_token_ids", [2**31], ["stop_token_ids"]), ("stop_token_ids", ["a"], ["stop_token_ids"]),
    ("logprobs", 21, ["logprobs"]), ("logprobs", -1, ["logprobs"]),
    ("logprobs", True, ["logprobs"]),
    ("echo", "yes", ["echo"]), ("best_of", 2, ["best_of"]), ("suffix", "x", ["suffix"]),
    ("stream", "yes", ["stream"]), ("stream_options", {"include_usage": True}, ["stream_options"]),
    ("presence_penalty", 3, ["presence_penalty"]), ("frequency_penalty", -3, ["frequency_penalty"]),
    ("logit_bias", {"1": 500}, ["logit_bias"]), ("logit_bias", {"x": 1}, ["logit_bias"]),
    ("logit_bias", {"320": 1}, ["logit_bias"]), ("user", 5, ["user"]),
    ("min_p", 1.5, ["min_p"]), ("repetition_penalty", 0, ["repetition_penalty"]),
    ("min_tokens", -1, ["min_tokens"]), ("guided_json", 5, ["guided_json"]),
    ("guided_regex", "a(", ["regex"]), ("guided_choice", [], ["guided_choice"]),
    ("bad_words", [5], ["bad_words"]), ("allowed_token_ids", [320], ["allowed_token_ids"]),
    ("ignore_eos", "yes", ["ignore_eos"]),
]:  # fmt: skip
    case(f"completions_{field}_{bad!r:.20}", with_(OK, **{field: bad}), words=words,
         status=404 if bad == "nope" else 400)  # fmt: skip
# --- chat fields
for name, body, words in [
    ("messages_missing", {"model": "tiny"}, ["messages"]),
    ("messages_empty", chat(messages=[]), ["messages"]),
    ("messages_string", chat(messages="hi"), ["messages"]),
    ("message_empty_object", chat(messages=[{}]), ["messages"]),
    ("role_alien", chat(messages=[{"role": "alien", "content": "x"}]), ["messages"]),
    ("content_int", chat(messages=[{"role": "user", "content": 5}]), ["messages"]),
    ("content_image_part",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     ["messages"]),
    ("name_int", chat(messages=[{"role": "user", "content": "x", "name": 5}]), ["name"]),
    ("tools", chat(tools=[{"type": "function"}]), ["tools"]),
    ("response_format_xml", chat(response_format={"type": "xml"}), ["response_format"]),
    ("response_format_no_schema", chat(response_format={"type": "json_schema"}),
     ["response_format"]),
    ("top_logprobs_without_logprobs", chat(top_logprobs=2), ["top_logprobs"]),
    ("top_logprobs_21", chat(logprobs=True, top_logprobs=21), ["top_logprobs"]),
    ("logprobs_int", chat(logprobs=3), ["logprobs"]),
    ("max_completion_tokens_0", chat(max_completion_tokens=0), ["max_completion_tokens"]),
    ("max_completion_tokens_2_31", chat(max_completion_tokens=2**31), ["max_completion_tokens"]),
    ("chat_top_k_overflow", chat(top_k=2**31), ["top_k"]),
    ("chat_seed_overflow", chat(seed=2**64), ["seed"]),
    ("chat_prompt_too_long", chat(messages=[{"role": "user", "content": "hello " * 400}]),
     ["messages", "max_model_len"]),
]:  # fmt: skip
    case(f"chat_{name}", body, path=CH, words=words)
# --- methods, paths, headers
case("get_completions", None, status=405, method="GET", words=["method not allowed"])
case("put_chat", None, status=405, method="PUT", path=CH, words=["method not allowed"])
case("delete_completions", None, status=405, method="DELETE", words=["method not allowed"])
case("patch_chat", None, status=405, method="PATCH", path=CH, words=["method not allowed"])
case("post_models", OK, status=405, path="/v1/models", words=["method not allowed"])
case("post_health", OK, status=405, path="/health", words=["method not allowed"])
case("unknown_path", OK, status=404, path="/v1/engines", words=["not found"])
case("no_api_key", OK, status=401, headers={"Authorization": ""}, words=["api key"])
case("wrong_api_key", OK, status=401, headers={"Authorization": "Bearer nope"}, words=["api key"])
case("basic_auth", OK, status=401, headers={"Authorization": f"Basic {KEY}"}, words=["api key"])
case("key_with_suffix", OK, status=401, headers={"Authorization": f"Bearer {KEY}x"},
     words=["api key"])  # fmt: skip
case("docs_without_key", None, status=401, method="GET", path="/docs",
     headers={"Authorization": ""}, words=["api key"])  # fmt: skip
case("openapi_without_key", None, status=401, method="GET", path="/openapi.json",
     headers={"Authorization": ""}, words=["api key"])  # fmt: skip
case("metrics_without_key", None, status=401, method="GET", path="/metrics",
     headers={"Authorization": ""}, words=["api key"])  # fmt: skip
case("lowercase_bearer", OK, status=401, headers={"Authorization": f"bearer {KEY}x"},
     words=["api key"])  # fmt: skip
case("key_in_other_header", OK, status=401, headers={"Authorization": "", "X-Api-Key": KEY},
     words=["api key"])  # fmt: skip


def send(base: str, c: tuple) -> httpx.Response:
    name, method, path, body, headers, _, _ = c
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    h = {**AUTH, "Content-Type": "application/json", **headers}
    h = {k: v for k, v in h.items() if v}
    with httpx.Client(timeout=60) as cl:
        return cl.request(method, base + path, content=data, headers=h)


def check(c: tuple, r: httpx.Response) -> None:
    name, _, _, _, _, status, words = c
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    err = r.json()["error"]
    text = (err["message"] + " " + (err["param"] or "")).lower()
    for w in words:
        assert w.lower() in text, (name, w, err)
    assert len(r.content) < 2000, (name, "the error echoes too much", len(r.content))


PROBE = {"model": "tiny", "prompt": "Tell me a very long story", "max_tokens": 180,
         "ignore_eos": True, "seed": 9, "temperature": 0.9, "top_p": 0.95, "logprobs": 2,
         "stream": True}  # fmt: skip


def stream_probe(base: str) -> tuple[list, list]:
    """Text pieces and top log-prob dicts of one streamed completion (the bits we compare)."""
    texts, lps = [], []
    with httpx.stream("POST", base + C, json=PROBE, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                texts.append(ch["text"])
                if ch["logprobs"]:
                    lps.append((ch["logprobs"]["tokens"], ch["logprobs"]["token_logprobs"],
                                ch["logprobs"]["top_logprobs"]))  # fmt: skip
    return ["".join(texts)], lps


def test_the_table_has_at_least_a_hundred_hostile_requests():
    assert len(CASES) >= 100 and len({c[0] for c in CASES}) == len(CASES)


def test_hostile_requests_get_4xx_naming_the_problem_while_a_stream_keeps_its_bits(
    hostile_server,
):
    base, eng = hostile_server
    alone = stream_probe(base)
    assert len(alone[1]) >= 100  # tokens were streamed with log-probs
    done = threading.Event()
    during: list = []

    def keep_streaming() -> None:  # one probe stream after another until the table is through
        while not done.is_set():
            during.append(stream_probe(base))

    streamer = threading.Thread(target=keep_streaming)
    streamer.start()
    time.sleep(0.3)  # the first stream is under way
    try:
        with cf.ThreadPoolExecutor(4) as ex:
            responses = list(ex.map(lambda c: send(base, c), CASES))
    finally:
        done.set()
        streamer.join(timeout=300)
    for c, r in zip(CASES, responses, strict=True):
        check(c, r)
    assert during, "no probe stream ran during the hostile requests"
    for got in during:
        assert got == alone  # text, tokens and log-probs: the same bits as alone
    PROBE["seed"] += 1  # control: the comparison sees a different sample
    try:
        assert stream_probe(base) != alone
    finally:
        PROBE["seed"] -= 1
    deadline = time.time() + 10
    while eng.page_manager.num_used and time.time() < deadline:
        time.sleep(0.05)
    assert eng.page_manager.num_used == 0 and not eng.has_unfinished()
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_a_10mb_body_is_refused_at_once_and_does_not_stall_the_server(hostile_server):
    """Declared (Content-Length) and chunked (no length) alike: 413 after LIMIT bytes, while
    /health keeps answering at once."""
    base, _ = hostile_server
    t0 = time.perf_counter()
    r = httpx.post(base + C, content=b"x" * (10 << 20), headers=AUTH, timeout=60)
    assert r.status_code == 413 and time.perf_counter() - t0 < 5

    def chunks():
        for _ in range(160):
            yield b"y" * 65536  # 10 MB, no Content-Length

    results = {}

    def upload() -> None:
        results["r"] = httpx.post(base + C, content=chunks(), headers=AUTH, timeout=60)

    t = threading.Thread(target=upload)
    t.start()
    h0 = time.perf_counter()
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert time.perf_counter() - h0 < 2
    t.join(timeout=60)
    assert results["r"].status_code == 413 and "exceeds" in results["r"].json()["error"]["message"]


def test_a_valid_request_still_works_after_the_table(hostile_server):
    """The control for the table: the same server answers the well-formed bodies it was built
    from (so every 4xx above is the break's, not the server's)."""
    base, _ = hostile_server
    for path, body in ((C, OK), (CH, MSG)):
        r = httpx.post(base + path, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    body = with_(OK, user="me", metadata={"a": 1}, min_p=0, repetition_penalty=1.0)
    r = httpx.post(base + C, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text  # documented no-ops and jdet's own defaults pass


def test_a_request_is_checked_once_by_the_engines_admission(hostile_server, monkeypatch):
    """The server checks a request's values through the engine's admission, once (prompt, then
    options), and the engine takes it as checked: no second check in `add_request`. The
    control: a bad value is still refused by that one check (a 400 naming the field)."""
    base, eng = hostile_server
    calls: list[str] = []
    for name in ("check_prompt", "check_options"):
        real = getattr(eng.admission, name)
        monkeypatch.setattr(eng.admission, name,
                            lambda *a, _n=name, _f=real, **k: (calls.append(_n), _f(*a, **k))[1])
    r = httpx.post(base + C, json=OK, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert calls == ["check_prompt", "check_options"]
    calls.clear()
    r = httpx.post(base + C, json=with_(OK, guided_regex="a("), headers=AUTH, timeout=60)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"], r.text
    assert calls == ["check_prompt", "check_options"]


def test_api_key_comes_from_the_environment_and_metrics_can_be_opened(serving_model, monkeypatch):
    import uvicorn
    from fastapi.testclient import TestClient

    from serving.http import launch

    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setenv("JDET_API_KEY", "from-env")
    launch.serve(serving_model, invariance="none", max_model_len=64, page_size=8, num_pages=8,
                 public_metrics=True)  # fmt: skip
    with TestClient(apps[0]) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/openapi.json").status_code == 401
        ok = c.get("/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
        assert c.get("/metrics").status_code == 200  # opened by the flag
        assert c.get("/health").status_code in (200, 503)  # open (503 while warming up)


def test_a_request_failing_in_the_engine_gets_its_own_error_and_a_stream_keeps_its_bits(
    hostile_server,
):
    """Fault injection through the server: requests with seed 666 raise inside the step's batch
    build after 3 tokens. Each gets its own error (a 500, or an SSE error event ending the
    stream cleanly); a probe stream running beside them ends with the bits it has alone."""
    base, eng = hostile_server
    alone = stream_probe(base)

    def injector(seq):
        if seq.options.seed == 666 and seq.num_output_tokens >= 3:
            raise OverflowError("injected fault")

    eng.fault_injector = injector
    got: dict = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault("probe", stream_probe(base)))
        t.start()
        time.sleep(0.3)
        bad = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "seed": 666,
               "ignore_eos": True}  # fmt: skip
        r = httpx.post(base + C, json=bad, headers=AUTH, timeout=60)
        assert r.status_code == 500 and "OverflowError" in r.json()["error"]["message"]
        with httpx.stream("POST", base + C, json={**bad, "stream": True}, headers=AUTH,
                          timeout=60) as s:  # fmt: skip
            lines = [x for x in s.iter_lines() if x]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"
        assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"]
        t.join(timeout=120)
    finally:
        eng.fault_injector = None
    assert got["probe"] == alone
    deadline = time.time() + 10
    while eng.page_manager.num_used and time.time() < deadline:
        time.sleep(0.05)
    assert eng.page_manager.num_used == 0
