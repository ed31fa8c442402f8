"""Two processes x 4 CPU devices on 127.0.0.1 as one JAX multi-controller job (gloo collectives):
TP 8 across the processes gives bitwise TP 1's tokens, log-probs and scores, offline (jdet.LLM)
and served (process 0 serves, process 1 replays its requests), and a process that dies ends the
other within seconds, naming it. One job does all three: each start costs two processes'
imports, loads and compiles."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import jdet
from serving.engine import multihost
from serving.sampling_options import SamplingOptions
from sharding.distributed import EXIT_PEER_LOST, Cluster, ProcessSpec, resolve
from tests.sharding.multihost_worker import PROMPTS, SHAPES, requests, run

WORKER = Path(__file__).with_name("multihost_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds for a job to start, compile and finish on the 2-core CI machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    """Each process: 4 CPU devices (8 in the job), the CPU path, jdet's test cache dir."""
    return {
        **os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
    }  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The shared tiny Qwen3 with 8 query heads (TP 8 splits them) and embeddings scaled down so
    that greedy and sampled tokens vary and their log-probs are not 0."""
    from safetensors.numpy import load_file, save_file

    from tests.conftest import write_hf_checkpoint

    d = write_hf_checkpoint(tmp_path_factory.mktemp("mh") / "qwen3", "qwen3", num_attention_heads=8)
    f = d / "model.safetensors"
    w = load_file(f)
    w["model.embed_tokens.weight"] *= np.float32(0.15)
    save_file(w, f, metadata={"format": "pt"})
    return d


@functools.cache
def reference(model_dir: Path) -> dict[str, np.ndarray]:
    """TP 1 in this one process, the same requests (multihost_worker.run)."""
    return run(jdet.LLM(model_dir, dtype="float32", tp=1, **SHAPES))


def test_resolve_reads_the_usual_environment_and_names_what_is_missing():
    env = {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "h:1234"}
    spec = resolve(env=env)
    assert (spec.num_processes, spec.process_id, spec.coordinator_host) == (2, 1, "h")
    assert resolve(env={}) is None and resolve(1, env=env) is not None  # 1 = "not given"
    assert resolve(4, 3, "[::1]:99", env={}).coordinator_host == "::1"
    with pytest.raises(ValueError, match="--process-id"):
        resolve(2, env={})
    with pytest.raises(ValueError, match="--coordinator-address"):
        resolve(2, 0, env={})


def test_a_request_reaches_the_followers_with_every_sampling_field_intact():
    """What process 0 sends for a request is what it added (a follower that rebuilt other
    options would schedule and sample other steps, and hang or corrupt the job)."""
    sp = jdet.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=2**32 - 1, max_tokens=9, n=2, stop=["x", "y"],
        stop_token_ids=[3], logprobs=3, presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, min_p=0.05, min_tokens=2, logit_bias={5: -1.5, 7: 2.0},
        bad_words=["ab"], allowed_token_ids=[1, 2, 3], regex="[a-z]+",
    )  # fmt: skip
    opts = SamplingOptions.from_any(sp)
    sent = json.loads(json.dumps(multihost._opts_json(opts)))  # over the wire
    assert multihost._opts_from_json(sent) == opts


class Watched(Cluster):
    """A Cluster whose 'exit' is recorded instead of ending the test process."""

    def __init__(self, *a) -> None:
        self.exits: list[int] = []
        super().__init__(*a)
        atexit.unregister(self.close)

    def _exit_process(self, status: int) -> None:
        self.exits.append(status)


def pair() -> tuple[Watched, Watched]:
    a, b = socket.socketpair()
    spec = ProcessSpec(2, 0, "127.0.0.1:1")
    return Watched(spec, {1: a}), Watched(dataclasses.replace(spec, process_id=1), {0: b})


def wait_for(cond, timeout: float = 5.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline
        time.sleep(0.01)


def test_the_watch_tells_a_goodbye_from_a_failure_and_a_lost_connection(capfd):
    hook = sys.excepthook
    try:
        leader, follower = pair()
        for i in range(3):  # process 0's messages, in order
            leader.broadcast(f"m{i}".encode())
        assert [follower.receive() for _ in range(3)] == [b"m0", b"m1", b"m2"]
        follower.close()  # a clean exit: no one is lost
        leader.close()
        assert follower.receive() is None  # process 0 left: a follower's loop ends
        time.sleep(0.2)
        assert leader.exits == [] and follower.exits == []

        leader, follower = pair()
        follower._failure = "ValueError: no such file"  # an uncaught exception, then exit
        follower.close()
        wait_for(lambda: leader.exits == [EXIT_PEER_LOST])
        assert "lost process 1 of 2 (it failed: ValueError: no such file)" in capfd.readouterr().err

        leader, follower = pair()
        for conn in follower._conns.values():  # killed: the kernel closes its socket
            conn.shutdown(socket.SHUT_RDWR)
        wait_for(lambda: leader.exits == [EXIT_PEER_LOST])
        assert "lost process 1 of 2 (its connection closed)" in capfd.readouterr().err
    finally:
        sys.excepthook = hook


def test_tp8_over_two_processes_is_bitwise_tp1_offline_and_served_and_a_lost_one_ends_it(
    model_dir, tmp_path
):
    coord, http, out = free_port(), free_port(), tmp_path / "job.npz"
    logs = [tmp_path / f"process{pid}.log" for pid in (0, 1)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(coord), str(pid), str(model_dir), str(out),
             str(http)],
            env=job_env(), stdout=logs[pid].open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        for pid in (0, 1)
    ]
    try:
        ref = reference(model_dir)  # while the job starts
        base = f"http://127.0.0.1:{http}"
        deadline = time.time() + TIMEOUT
        while True:  # jdet.LLM's generate and score, then the server's warm-up
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            assert time.time() < deadline, f"the job did not serve within {TIMEOUT} s"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        got = dict(np.load(f"{out}.0.npz"))  # jdet.LLM over the two processes
        other = dict(np.load(f"{out}.1.npz"))
        assert len(got["unseeded"]) == 3  # drawn once, on process 0: both read the same tokens
        assert all(np.array_equal(got[k], other[k]) for k in got)
        for k, v in ref.items():
            if k != "unseeded":
                assert np.array_equal(got[k], v), k
        assert len(set(ref["tokens0"].tolist())) > 1 and (ref["logprobs1"] != 0).all()

        _, sps = requests()  # the server over the two processes: request 1 again
        body = {"model": Path(model_dir).name, "prompt": list(PROMPTS[1]), "max_tokens": 6,
                "temperature": 0.8, "seed": 3, "logprobs": 0, "ignore_eos": True}  # fmt: skip
        assert sps[1].seed == body["seed"] and sps[1].temperature == body["temperature"]
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        lps = np.asarray(r.json()["choices"][0]["logprobs"]["token_logprobs"], np.float32)
        assert np.array_equal(lps, ref["logprobs1"])

        procs[1].kill()  # process 1 dies; process 0 must notice and exit, not hang
        t0 = time.time()
        procs[0].wait(timeout=20)
        took = time.time() - t0
        out0 = logs[0].read_text()
        assert procs[0].returncode == EXIT_PEER_LOST, out0[-3000:]
        assert "lost process 1 of 2" in out0
        assert took < 10, took
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
