"""Soak: mixed traffic with random disconnects against `jdet serve` on loopback; writes soak.json.

What it checks (issue 18's targets): the server process's RSS stays flat (growth of the last
window over the first, after warm-up, <= 5 %), no KV page leaks (0 in use once traffic stops),
no 5xx, and the bits of one probe request (seeded sampling with log-probs) are re-checked every
`--probe-every` seconds against its first answer.

Traffic: `--clients` threads, each sending one request after another: completions and chat,
streaming and not, n=1..3, log-probs, stop strings, prompts of random length, and now and then a
malformed body (must be a 4xx). With probability `--disconnect`, a client walks away: a stream is
closed after a few chunks, a plain request is abandoned by a short read timeout. The server binds
127.0.0.1 only; the API key goes through JDET_API_KEY (not the command line).

    nice -n 10 python -m benchmarks.soak --minutes 30 --out out [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

KEY = "sk-soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = ("the quick brown fox jumps over the lazy dog while a deterministic engine serves "
         "requests and nobody can tell how busy it was").split()  # fmt: skip
PROBE = {"prompt": "Tell me a story about a fox", "max_tokens": 32, "seed": 1234,
         "temperature": 0.8, "top_p": 0.95, "logprobs": 2, "ignore_eos": True}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH, timeout=30).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: Counter = Counter()
        self.kinds: Counter = Counter()
        self.disconnects = 0
        self.errors: list[str] = []  # client-side exceptions other than our own timeouts
        self.bad_5xx: list[str] = []

    def record(self, kind: str, status: int | str, note: str = "") -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.status[str(status)] += 1
            if isinstance(status, int) and status >= 500:
                self.bad_5xx.append(f"{kind} {status} {note[:200]}")


def one_request(base: str, model: str, rng: random.Random, st: Stats, p_disc: float) -> None:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60)))
    common = {
        "model": model,
        "max_tokens": rng.randrange(1, 33),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(2**32),
        "n": rng.choice([1, 1, 1, 2]),
    }
    if rng.random() < 0.3:
        common["stop"] = [rng.choice(WORDS)]
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    walk_away = rng.random() < p_disc
    if rng.random() < 0.05:  # malformed: must be a 4xx, never a 5xx
        bad = rng.choice([{"top_k": 2**31}, {"min_p": 0.5}, {"max_tokens": -1}, {"foo": 1}])
        r = httpx.post(base + "/v1/completions", json={**common, "prompt": words, **bad},
                       headers=AUTH, timeout=900)  # fmt: skip
        st.record("malformed" if 400 <= r.status_code < 500 else "malformed-not-4xx",
                  r.status_code, r.text)  # fmt: skip
        return
    if chat:
        path, body = "/v1/chat/completions", {**common, "messages": [
            {"role": "user", "content": words}]}  # fmt: skip
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randrange(0, 4))
    else:
        path, body = "/v1/completions", {**common, "prompt": words}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randrange(0, 4)
    kind = ("chat" if chat else "cmpl") + ("-stream" if stream else "")
    if stream:
        body["stream"] = True
        with httpx.stream("POST", base + path, json=body, headers=AUTH, timeout=900) as r:
            if r.status_code != 200:
                r.read()
                st.record(kind, r.status_code, r.text)
                return
            cut = rng.randrange(1, 6) if walk_away else None
            for i, _ in enumerate(r.iter_lines()):
                if cut is not None and i >= cut:
                    with st.lock:
                        st.disconnects += 1
                    break  # closing the stream drops the connection
        st.record(kind, 200)
        return
    timeout = rng.uniform(0.02, 0.5) if walk_away else 900
    try:
        r = httpx.post(base + path, json=body, headers=AUTH, timeout=timeout)
        st.record(kind, r.status_code, r.text)
    except httpx.TimeoutException:
        if not walk_away:
            raise
        with st.lock:
            st.disconnects += 1
        st.record(kind, "client-gave-up")


def client_loop(base: str, model: str, seed: int, st: Stats, stop: threading.Event,
                p_disc: float) -> None:  # fmt: skip
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            one_request(base, model, rng, st, p_disc)
        except Exception as e:  # noqa: BLE001 - count it, keep the traffic going
            with st.lock:
                st.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            time.sleep(0.5)


def probe(base: str, model: str) -> tuple:
    r = httpx.post(base + "/v1/completions", json={**PROBE, "model": model}, headers=AUTH,
                   timeout=900)  # fmt: skip
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], r.json()["system_fingerprint"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="traffic duration")
    ap.add_argument("--model", default=None, help="model directory (default: embedded)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--disconnect", type=float, default=0.2, help="chance a client walks away")
    ap.add_argument("--probe-every", type=float, default=60.0, help="seconds between probes")
    ap.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup-minutes", type=float, default=2.0,
                    help="traffic before the RSS baseline window starts")  # fmt: skip
    ap.add_argument("--invariance", default="tp", choices=["tp", "batch", "none"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `jdet serve` flag (repeatable), e.g. --server-arg=--num-pages=256")
    a = ap.parse_args(argv)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jdet", "serve"] + ([a.model] if a.model else []) + [
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "soak",
        "--invariance", a.invariance, "--max-model-len", "512", "--max-num-seqs", "32",
        "--log-level", "warning", *a.server_arg,
    ]  # fmt: skip
    env = {**os.environ, "JDET_API_KEY": KEY, "PYTHONPATH": str(Path(__file__).parents[1])}
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "soak_server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {"cmd": cmd[1:], "args": vars(a)}
    try:
        t_start = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see soak_server.log")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t_start > 1800:
                raise RuntimeError("server not healthy after 30 minutes")
            time.sleep(1)
        result["startup_s"] = time.time() - t_start
        ref = probe(base, "soak")
        st, stop = Stats(), threading.Event()
        clients = [threading.Thread(target=client_loop, args=(base, "soak", i, st, stop,
                                                              a.disconnect), daemon=True)
                   for i in range(a.clients)]  # fmt: skip
        t0 = time.time()
        for c in clients:
            c.start()
        rss, probes = [], []

        def probe_loop() -> None:  # its own thread: a slow answer must not stop RSS sampling
            k = 1
            while not stop.wait(max(0.0, t0 + k * a.probe_every - time.time())):
                k = max(k + 1, int((time.time() - t0) // a.probe_every) + 1)  # fixed start times
                t = time.time()
                try:
                    got = probe(base, "soak")
                    probes.append({"t": round(t - t0, 1), "took_s": round(time.time() - t, 1),
                                   "same_bits": got == ref})  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a failed probe is a finding, not a crash
                    probes.append({"t": round(t - t0, 1), "same_bits": False, "error": str(e)})

        prober = threading.Thread(target=probe_loop, daemon=True)
        prober.start()
        next_rss, next_save = t0, t0 + 60
        while time.time() - t0 < a.minutes * 60:
            now = time.time()
            if proc.poll() is not None:
                raise RuntimeError(f"server died with {proc.returncode} after {now - t0:.0f} s")
            if now >= next_rss:
                rss.append((round(now - t0, 1), round(rss_mb(proc.pid), 1)))
                next_rss += a.rss_every
            if now >= next_save:
                save(out_dir, result, st, rss, probes, a, final=False)
                next_save += 60
            time.sleep(0.2)
        result["traffic_s"] = round(time.time() - t0, 1)
        stop.set()
        for c in clients + [prober]:
            c.join(timeout=900)
        final_probe = probe(base, "soak")
        probes.append({"t": round(time.time() - t0, 1), "same_bits": final_probe == ref})
        deadline = time.time() + 60
        while time.time() < deadline and metric(base, "jdet_kv_pages_in_use") > 0:
            time.sleep(0.5)
        result["leaked_pages"] = metric(base, "jdet_kv_pages_in_use")
        result["running_after"] = metric(base, "jdet_num_requests_running")
        rss.append((round(time.time() - t0, 1), round(rss_mb(proc.pid), 1)))
        return save(out_dir, result, st, rss, probes, a, final=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def save(out_dir: Path, result: dict, st: Stats, rss: list, probes: list,
         a: argparse.Namespace, final: bool) -> int:  # fmt: skip
    """Write soak.json (also mid-run, so a cut-off run leaves its figures); 0 if all targets met."""
    with st.lock:
        result.update(
            status=dict(st.status), kinds=dict(st.kinds), disconnects=st.disconnects,
            client_errors=st.errors[:50], num_client_errors=len(st.errors),
            five_xx=len(st.bad_5xx), five_xx_examples=st.bad_5xx[:20],
        )  # fmt: skip
    warm = a.warmup_minutes * 60
    after = [m for t, m in rss if t >= warm]
    window = max(1, len(after) // 5)
    if len(after) >= 2 * window and after:
        base_rss = sorted(after[:window])[window // 2]
        last_rss = sorted(after[-window:])[window // 2]
        result["rss_baseline_mb"], result["rss_last_mb"] = base_rss, last_rss
        result["rss_growth_pct"] = round(100 * (last_rss - base_rss) / base_rss, 2)
    result["rss_mb"] = rss
    result["probes"] = probes
    result["probe_mismatches"] = sum(not p["same_bits"] for p in probes)
    result["final"] = final
    checks = {
        "rss_growth_le_5pct": result.get("rss_growth_pct", float("inf")) <= 5,
        "no_leaked_pages": result.get("leaked_pages") == 0,
        "no_5xx": result["five_xx"] == 0,
        "probe_bits_stable": bool(probes) and result["probe_mismatches"] == 0,
    }
    result["checks"] = checks
    (out_dir / "soak.json").write_text(json.dumps(result, indent=1))
    if final:
        print(json.dumps({k: result.get(k) for k in (
            "checks", "rss_baseline_mb", "rss_last_mb", "rss_growth_pct", "leaked_pages",
            "five_xx", "status", "disconnects", "num_client_errors", "probe_mismatches")}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
