"""One process of test_multihost's two-process job: `jdet.LLM` at TP 8 over both processes'
4 CPU devices each, generate and score (each process writes what it got to OUT.PID.npz), then
the same job serves HTTP (`jdet serve`'s entry point: process 0 serves on HTTP_PORT, process 1
follows) until it is stopped.

usage: python multihost_worker.py PORT PROCESS_ID MODEL_DIR OUT HTTP_PORT
"""

from __future__ import annotations

import sys

import numpy as np

import jdet
from serving.http.launch import serve

# one step shape (T = 8: no 1-token decode bucket), so each process compiles one forward
SHAPES = dict(max_num_batched_tokens=8, min_tokens_bucket=8)
PROMPTS = ([3, 17, 42, 5, 99, 23, 7, 64, 12, 31, 8], [250, 1, 77])


def requests() -> tuple[list[list[int]], list[jdet.SamplingParams]]:
    """The prompts and sampling parameters both the job and the reference run."""
    sps = [
        jdet.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        jdet.SamplingParams(temperature=0.8, max_tokens=6, seed=3, ignore_eos=True),
    ]
    return [list(p) for p in PROMPTS], sps


def run(llm: jdet.LLM) -> dict[str, np.ndarray]:
    prompts, sps = requests()
    outs = llm.generate(prompts, sps)
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    got = {}
    for i, (o, s) in enumerate(zip(outs, scores, strict=True)):
        got[f"tokens{i}"] = np.asarray(o.token_ids)
        got[f"logprobs{i}"] = np.asarray(o.logprobs)
        got[f"scores{i}"] = s
    # an unseeded request: process 0's seed reaches both processes (no hang, one answer)
    unseeded = jdet.SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    got["unseeded"] = np.asarray(llm.generate([prompts[1]], unseeded)[0].token_ids)
    return got


def main() -> None:
    port, pid, model_dir, out, http = sys.argv[1:6]
    job = dict(num_processes=2, process_id=int(pid), coordinator_address=f"127.0.0.1:{port}")
    llm = jdet.LLM(model_dir, dtype="float32", tp=8, **SHAPES, **job)
    got = run(llm)
    np.savez(f"{out}.{pid}.npz", **got)  # every process: each reads the replicated outputs
    # the same job, now as a server (its steps are compiled already: the same shapes)
    serve(model_dir, port=int(http), dtype="float32", log_level="warning", tp=8, **SHAPES, **job)


if __name__ == "__main__":
    main()
