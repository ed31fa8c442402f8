"""`jdet serve --data-parallel 2`: two CPU replicas behind one endpoint serve concurrent mixed
requests (completions and chat, greedy and seeded sampling, streamed and not), each bitwise what
one engine gives; a replica killed mid-load costs no request (the router retries what it lost on
the other replica, same bits) and the endpoint keeps serving.

JDET_DP_REQUESTS sets the number of concurrent requests (CI: 24)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from serving.http.router import ranking, route_key
from serving.http.router_metrics import label_series, merge_families

ROOT = Path(__file__).resolve().parents[3]
NAME = "tiny"
# one step shape (tokens 32, sequences 16, pages 32): a replica compiles little
ENGINE = dict(max_model_len=256, page_size=8, num_pages=256, max_num_seqs=16,
              max_num_batched_tokens=32, min_tokens_bucket=32, min_seqs_bucket=16,
              min_pages_bucket=32)  # fmt: skip
WORDS = ["The quick brown fox", "Tell me about Richard", "Deterministic inference means",
         "hello world, hello", "general kenobi", "0123456789 +-*/", "the lazy dog jumps",
         "safecracking and bongo"]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mixed_requests(n: int) -> list[tuple[str, dict]]:
    """(path, body) pairs: completions and chat, greedy and seeded, streamed and not."""
    out = []
    for i in range(n):
        sampling = {"temperature": 0.0} if i % 3 == 0 else {"temperature": 0.9, "seed": 100 + i}
        stream = i % 4 == 1
        if i % 5 == 4:
            body = {"model": NAME, "messages": [{"role": "user", "content": WORDS[i % 8]}],
                    "max_tokens": 6 + i % 5, "logprobs": True, **sampling}  # fmt: skip
            path = "/v1/chat/completions"
        else:
            prompt = f"{WORDS[i % 8]} {WORDS[(i * 3 + 1) % 8]}"
            body = {"model": NAME, "prompt": prompt, "max_tokens": 6 + i % 7, "logprobs": 1,
                    **sampling}  # fmt: skip
            path = "/v1/completions"
        if stream:
            body["stream"] = True
        out.append((path, body))
    return out


def send(client: httpx.Client, base: str, path: str, body: dict) -> tuple[str, list[float]]:
    """The completion's text and its tokens' log-probs (streamed or not)."""
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        r = client.post(base + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        if chat:
            return c["message"]["content"], [t["logprob"] for t in c["logprobs"]["content"]]
        return c["text"], c["logprobs"]["token_logprobs"]
    text, lps = "", []
    with client.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                if chat:
                    text += c["delta"].get("content") or ""
                    lps += [t["logprob"] for t in (c.get("logprobs") or {}).get("content") or []]
                else:
                    text += c["text"]
                    lps += (c.get("logprobs") or {}).get("token_logprobs") or []
    return text, lps


def reference(llm, requests: list[tuple[str, dict]]) -> list[tuple[str, np.ndarray]]:
    """One engine's answers to `requests` (jdet.LLM in this process)."""
    import jdet

    out = []
    for path, body in requests:
        sp = jdet.SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                                 seed=body.get("seed"))  # fmt: skip
        if path.endswith("chat/completions"):
            o = llm.chat(body["messages"], sp)[0]
        else:
            o = llm.generate(body["prompt"], sp)[0]
        out.append((o.text, np.asarray(o.logprobs, np.float32)))
    return out


def check(got: tuple[str, list[float]], want: tuple[str, np.ndarray], what: object) -> None:
    assert got[0] == want[0], what
    assert np.array_equal(np.asarray(got[1], np.float32), want[1]), what


def metric(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def endpoint(serving_model_dir, tmp_path_factory):
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    cmd = [sys.executable, "-m", "jdet", "serve", str(serving_model_dir), "--data-parallel", "2",
           "--port", str(port), "--served-model-name", NAME, "--dtype", "float32",
           "--log-level", "warning", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    log = tmp_path_factory.mktemp("dp") / "router.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    try:
        yield proc, base
    finally:
        try:
            pids = [r["pid"] for r in health(base)["replicas"] if r["pid"]]
        except (httpx.HTTPError, ValueError):
            pids = []
        proc.send_signal(signal.SIGTERM)  # drains, then stops the replicas
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for pid in pids:
                try:
                    os.waitpid(pid, os.WNOHANG)
                    os.kill(pid, 0)
                except (OSError, ChildProcessError):
                    continue
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"replica pid {pid} outlived the router")


def log_tail(proc: subprocess.Popen) -> str:
    """The router's and its replicas' log lines, progress bars left out."""
    lines = proc.log.read_text(errors="replace").splitlines()  # type: ignore[attr-defined]
    return "\n".join(x for x in lines if "compiling step shapes" not in x)[-4000:]


def wait_ready(proc: subprocess.Popen, base: str, ready=lambda h: h["status"] == "ok",
               timeout: float = 300) -> dict:  # fmt: skip
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log_tail(proc)
        try:
            h = health(base)
            if ready(h):
                return h
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the endpoint did not come up in {timeout} s")


def test_routing_is_by_prefix_and_moves_only_a_lost_replicas_share():
    a = route_key({"prompt": "x" * 5000 + "tail one"})
    assert a == route_key({"prompt": "x" * 5000 + "tail two"})  # same prefix: same replica
    assert route_key({"prompt": [1, 2, 3]}) != route_key({"prompt": [1, 2, 4]})
    keys = [route_key({"prompt": f"prompt {i}"}) for i in range(200)]
    firsts = [ranking(k, [0, 1, 2])[0] for k in keys]
    assert {0, 1, 2} == set(firsts)  # spread over the replicas
    for k, f in zip(keys, firsts, strict=True):  # replica 1 gone: only its keys move
        if f != 1:
            assert ranking(k, [0, 2])[0] == f


def test_metrics_get_a_replica_label_and_one_family_block():
    a = "# HELP m x\n# TYPE m counter\nm 1.0\n# HELP h y\n# TYPE h histogram\n"
    a += 'h_bucket{le="1"} 2.0\nh_count 2.0\n'
    merged = merge_families([label_series(a, 0), label_series(a, 1)])
    assert 'm{replica="0"} 1.0\nm{replica="1"} 1.0' in merged
    assert 'h_bucket{replica="1",le="1"} 2.0' in merged and merged.count("# TYPE m") == 1


def test_two_replicas_serve_mixed_load_bitwise_and_survive_a_killed_replica(
    endpoint, serving_model_dir
):
    proc, base = endpoint
    try:
        serve_mixed_load_then_kill_a_replica(proc, base, serving_model_dir)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- router log ---\n{log_tail(proc)}") from e


def serve_mixed_load_then_kill_a_replica(proc, base, serving_model_dir):
    import jdet

    n = int(os.environ.get("JDET_DP_REQUESTS", "24"))
    reqs = mixed_requests(n)
    # once replica 0 is warm: its compiled steps are then in the caches for this process too
    wait_ready(proc, base, lambda h: h["replicas"][0]["ready"])
    llm = jdet.LLM(serving_model_dir, dtype="float32", **ENGINE)
    want = reference(llm, reqs)
    h = wait_ready(proc, base)
    assert h["system_fingerprint"] == llm.fingerprint()  # every replica's, checked by the router
    assert {r["system_fingerprint"] for r in h["replicas"]} == {llm.fingerprint()}

    with httpx.Client() as client, cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda r: send(client, base, *r), reqs))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        check(g, w, (i, reqs[i]))
    text = httpx.get(base + "/metrics").text
    for i in (0, 1):  # both replicas served, and their own series come through labelled
        assert metric(base, f'jdet_router_requests_total{{replica="{i}"}}') > 0
        assert f'jdet_requests_finished_total{{replica="{i}",reason="length"}}' in text

    # the router alone in front of replicas it did not start (an orchestrator's pods)
    urls = ",".join(f"http://127.0.0.1:{r['port']}" for r in h["replicas"])
    port = free_port()
    alone = subprocess.Popen([sys.executable, "-m", "serving.http.router", "--replicas", urls,
                              "--port", str(port), "--log-level", "warning"],
                             env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        other = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(other + "/health", timeout=5).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and alone.poll() is None, "router alone did not start"
            time.sleep(0.3)
        with httpx.Client() as client:
            for r, w in zip(reqs[:3], want[:3], strict=True):
                check(send(client, other, *r), w, "router alone")
    finally:
        alone.terminate()
        alone.wait(timeout=30)

    # kill replica 0 while it holds requests: they are retried on replica 1, same bits
    long = [("/v1/completions", {"model": NAME, "prompt": f"{WORDS[i]} {i}", "max_tokens": 96,
                                 "temperature": 0.9, "seed": i, "logprobs": 1})
            for i in range(6)]  # fmt: skip
    want_long = reference(llm, long)
    victim = h["replicas"][0]["pid"]
    with httpx.Client() as client, cf.ThreadPoolExecutor(6) as pool:
        futs = [pool.submit(send, client, base, *r) for r in long]
        deadline = time.time() + 60
        while health(base)["replicas"][0]["in_flight"] == 0:
            assert time.time() < deadline, "replica 0 never got one of the long requests"
            time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        got_long = [f.result(timeout=180) for f in futs]
    for i, (g, w) in enumerate(zip(got_long, want_long, strict=True)):
        check(g, w, ("after kill", i))
    assert metric(base, "jdet_router_retries_total") >= 1
    after = health(base)
    assert after["replicas"][0]["pid"] != victim or after["replicas"][0]["status"] != "ok"
    # and it keeps serving
    with httpx.Client() as client:
        for r, w in zip(reqs[:4], want[:4], strict=True):
            check(send(client, base, *r), w, "after kill")
