"""The OpenAI-compatible server as a real subprocess on a free loopback port, driven by the
official `openai` client (and raw HTTP for malformed input and disconnects)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# One xdist worker for the whole module: its tests share one server subprocess (start, compiles)
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("server")

KEY = "sk-test-jdet"
ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(serving_model_dir):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "jdet",
        "serve",
        str(serving_model_dir),
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--invariance",
        "tp",
        "--max-model-len",
        "256",
        "--page-size",
        "8",
        "--num-pages",
        "160",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "64",
        "--min-tokens-bucket",
        "64",
        "--min-seqs-bucket",
        "32",
        "--min-pages-bucket",
        "32",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        proc.kill()
        raise RuntimeError("server did not come up in 120 s")
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json()["status"] == "ok"
    r = httpx.get(server + "/v1/models")  # no key
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/nope"):  # all but /health
        assert httpx.get(server + path).status_code == 401, path
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server + "/metrics", headers=ok).status_code == 200  # the control


def test_completion_with_seed_and_logprobs_is_reproducible(client):
    kw = dict(
        model="tiny",
        prompt="Tell me about Richard Feynman",
        max_tokens=8,
        seed=7,
        temperature=0.8,
        logprobs=3,
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    c = client.completions.create(**{**kw, "seed": 8})
    ca, cb = a.choices[0], b.choices[0]
    assert ca.text == cb.text and ca.logprobs.token_logprobs == cb.logprobs.token_logprobs
    assert ca.logprobs.tokens != c.choices[0].logprobs.tokens or ca.logprobs.token_logprobs != (
        c.choices[0].logprobs.token_logprobs
    )
    assert len(ca.logprobs.token_logprobs) == a.usage.completion_tokens <= 8
    assert all(len(t) <= 3 for t in ca.logprobs.top_logprobs)
    assert a.system_fingerprint and a.system_fingerprint == b.system_fingerprint
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_chat_and_streaming_with_usage_agree(client):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_completion_tokens=10,
        seed=3,
        temperature=0.7,
    )
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, n=2)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content != full.choices[1].message.content
    # one logprobs entry (with its 2 alternatives) per generated token, for every choice
    assert sum(len(c.logprobs.content) for c in full.choices) == full.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for c in full.choices for t in c.logprobs.content)
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.prompt_tokens == full.usage.prompt_tokens
    # completions streaming: several prompts x n, indices prompt * n + sample
    chunks = list(
        client.completions.create(
            model="tiny", prompt=["a b", "c d"], n=2, max_tokens=4, seed=1, stream=True
        )
    )
    assert {c.index for ch in chunks for c in ch.choices} == {0, 1, 2, 3}


def test_same_request_under_16_concurrent_others_gives_the_same_text(server, client):
    probe = dict(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=12,
        seed=11,
        temperature=0.9,
        top_p=0.9,
        logprobs=2,
    )
    alone = client.completions.create(**probe).choices[0]

    def other(i: int):
        return client.completions.create(
            model="tiny",
            prompt=f"hello {i} " * (i % 5 + 1),
            max_tokens=8 + i % 7,
            seed=i,
            temperature=1.0,
        )

    steps0 = metric(server, "jdet_step_tokens_count")
    tokens0 = metric(server, "jdet_generation_tokens_total")
    with cf.ThreadPoolExecutor(17) as ex:
        futs = [ex.submit(other, i) for i in range(8)]
        fut = ex.submit(client.completions.create, **probe)
        futs += [ex.submit(other, i) for i in range(8, 16)]
        busy = fut.result().choices[0]
        for f in futs:
            f.result()
    # The requests shared steps (one at a time would take a step per generated token at least),
    # so the probe's bits were computed in batches with others.
    steps = metric(server, "jdet_step_tokens_count") - steps0
    tokens = metric(server, "jdet_generation_tokens_total") - tokens0
    assert 0 < steps < tokens / 2, f"{steps} steps for {tokens} tokens: requests did not share"
    assert busy.text == alone.text
    assert busy.logprobs.token_logprobs == alone.logprobs.token_logprobs


MALFORMED = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -0.1}, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 999999]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [-3]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 400}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": "x"}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 5}, "presence"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [5000]}, "stop_token"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "alien", "content": "x"}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 0,
        },
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
]


def test_malformed_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(server, client):
    probe = dict(model="tiny", prompt="hello world", max_tokens=6, seed=5, logprobs=1)
    before = client.completions.create(**probe).choices[0]
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body, field in MALFORMED:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server + path, content=data, headers=headers, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()["error"]
        if field is not None:
            assert field in (err["param"] or "") + err["message"], (body, err)
    assert len(MALFORMED) >= 20
    after = client.completions.create(**probe).choices[0]
    assert after.text == before.text
    assert after.logprobs.token_logprobs == before.logprobs.token_logprobs
    assert metric(server, "jdet_kv_pages_in_use") == 0


def test_a_disconnected_stream_is_aborted_and_frees_its_pages(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "tiny",
        "prompt": "Tell me a very long story",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "seed": 1,
    }
    aborted = metric(server, 'jdet_requests_finished_total{reason="abort"}')
    with httpx.stream(
        "POST", server + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens in: the request is running
        assert any(x.startswith("data: {") for x in got)
        assert metric(server, "jdet_kv_pages_in_use") > 0
    deadline = time.time() + 20
    while time.time() < deadline and metric(server, "jdet_kv_pages_in_use") > 0:
        time.sleep(0.1)
    assert metric(server, "jdet_kv_pages_in_use") == 0
    assert metric(server, "jdet_num_requests_running") == 0
    assert metric(server, 'jdet_requests_finished_total{reason="abort"}') == aborted + 1


def test_a_stream_ends_with_done(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", server + "/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


def test_chat_on_a_model_without_chat_template_is_a_400(serving_model):
    import copy

    from fastapi.testclient import TestClient

    from serving.engine.engine import Engine
    from serving.http.server import build_app

    model = copy.copy(serving_model)
    model.tokenizer = copy.deepcopy(serving_model.tokenizer)
    model.tokenizer.chat_template = None
    eng = Engine(model, invariance="none", max_model_len=64, page_size=8, num_pages=8)
    with TestClient(build_app(eng, model_name="m", fingerprint="fp_test")) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    assert not eng.has_unfinished()


def test_a_client_that_gives_up_on_a_plain_request_aborts_it_and_frees_its_pages(server):
    """Non-streaming: Starlette does not cancel the handler when the socket closes, so the server
    polls; the request must end as "abort" (not run to its length) and return every page."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "model": "tiny",
        "prompt": "Tell me a very long story",
        "max_tokens": 100,
        "n": 4,
        "ignore_eos": True,
        "seed": 2,
    }
    t0 = time.time()
    full = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60)
    took = time.time() - t0  # the whole request, run once to learn how long it takes here
    assert full.status_code == 200, full.text
    assert [c["finish_reason"] for c in full.json()["choices"]] == ["length"] * 4
    aborted = metric(server, 'jdet_requests_finished_total{reason="abort"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=took / 4)
    deadline = time.time() + 20
    while time.time() < deadline and metric(server, "jdet_kv_pages_in_use") > 0:
        time.sleep(0.1)
    assert metric(server, "jdet_kv_pages_in_use") == 0
    # one engine request carries the n = 4 samples
    assert metric(server, 'jdet_requests_finished_total{reason="abort"}') == aborted + 1
    assert httpx.get(server + "/health").json()["status"] == "ok"
