"""What a decode step's jit call costs the host, argument by argument (issue 11, host side).

The engine's decode-step arguments are captured from a real engine (embedded model, batch 1,
`host_bench`'s null step: same arguments, negligible device work), then one call is timed in
variants that isolate the cost: the step as the engine calls it, trivial functions of the
same arguments, of only the batch + sampling pytrees (with their small numpy arrays as they
are, or moved to the device first), of one packed uint32 array, and `jax.device_put` itself.
Median µs per call (dispatch only, not waited for). BENCHMARKS.md run 8 has the H100 host's.

    PYTHONPATH=. python -m benchmarks.dispatch_probe [--out dispatch_probe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def per_call_us(f: Callable[[], Any], n: int = 300) -> float:
    import jax

    f()
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    jax.effects_barrier()
    return round(statistics.median(ts) * 1e6, 1)


def captured_step_args() -> tuple[Any, Any, tuple]:
    """(engine, its step callable, (params, batch, sampling) of one steady decode step)."""
    import jdet
    from benchmarks import host_bench

    eng = host_bench.make_engine(jdet.load(), "null", 1)
    r = eng.runner
    cap: dict = {}
    step = r.step_fn

    def spy(*a: Any) -> Any:
        cap["args"] = a  # the last step: a steady decode step
        return step(*a)

    r.step_fn = spy
    eng.add_request("x", list(range(1, 65)), dict(temperature=0.0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    r.step_fn = step
    params, _, batch, sampling = cap["args"]
    return eng, step, (params, r.place_tokens(batch), sampling)


def probe() -> dict:
    import jax
    import jax.numpy as jnp

    from serving.engine.host_inputs import pack

    eng, step, (params, batch, sampling) = captured_step_args()
    r = eng.runner
    leaves, tdef = jax.tree_util.tree_flatten((batch, sampling))
    host = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    res: dict = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                 "host_leaves": [(list(leaves[i].shape), str(leaves[i].dtype)) for i in host],
                 "device_leaves": len(leaves) - len(host)}  # fmt: skip
    state = {"kv": r.kv}

    def engine_call() -> None:
        state["kv"], _ = step(params, state["kv"], batch, sampling)

    res["step_as_engine_calls_it"] = per_call_us(engine_call)
    body = lambda b, s: b.positions[0] + 1  # noqa: E731 - a trivial use of the arguments
    f_mixed = jax.jit(body, keep_unused=True)
    res["batch_sampling_as_built"] = per_call_us(lambda: f_mixed(batch, sampling))
    on_dev = list(leaves)
    for i in host:
        on_dev[i] = jax.device_put(leaves[i], r.token_sharding)
    b2, s2 = jax.tree_util.tree_unflatten(tdef, on_dev)
    f_dev = jax.jit(body, keep_unused=True)
    res["batch_sampling_on_device"] = per_call_us(lambda: f_dev(b2, s2))
    words = pack(batch, sampling)[2]
    f_words = jax.jit(lambda w: w[0] + 1)
    res["one_packed_numpy_arg"] = per_call_us(lambda: f_words(words))
    res["packed_words"] = int(words.size)
    arrays = [leaves[i] for i in host]
    if arrays:
        res["device_put_one"] = per_call_us(lambda: jax.device_put(arrays[0]))
        res["device_put_list"] = per_call_us(lambda: jax.device_put(arrays))
    x = jnp.ones(4)
    f_one = jax.jit(lambda x: x + 1)
    res["trivial_jit_one_device_arg"] = per_call_us(lambda: f_one(x))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="dispatch_probe.json")
    a = p.parse_args(argv)
    res = probe()
    print(json.dumps(res, indent=1))
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
