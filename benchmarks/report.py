"""BENCHMARKS.md's current tables, rendered from the JSON records the benchmarks wrote.

    python -m benchmarks.report [--check] [--results benchmarks/results] [--file BENCHMARKS.md]

Why: a figure copied by hand drifts from its record; a rendered one cannot. A benchmark run's
JSON (what it wrote to $OUT, unchanged) is committed under `benchmarks/results/`, named for its
module: `user_bench.json`, or `user_bench*.json` for a run split over several commands (merged
part by part, in name order, as notebooks/06 merges them). Each table sits in BENCHMARKS.md
between `<!-- report:NAME -->` and `<!-- /report:NAME -->`, NAME one of `RENDERERS`; a table
whose benchmark has no record yet is left as it is. `--check` rewrites nothing and exits 1 when
the file differs from its rendering (tests/test_benchmarks_report.py runs it in CI).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.user_bench import joined

ROOT = Path(__file__).resolve().parents[1]


def _num(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def _ok(rec: dict, part: str) -> list[dict]:
    return [r for r in rec.get(part, []) if "error" not in r]


def _failed(rec: dict, part: str) -> list[str]:
    """A line naming the rows of `part` that recorded an error instead of a figure, if any: their
    settings where they have some, and the first error's last line."""
    bad = [r for r in rec.get(part, []) if "error" in r]
    if not bad:
        return []
    first = bad[0]["error"].strip().splitlines()[-1][:160] if bad[0]["error"].strip() else "?"
    which = [json.dumps(r["settings"]) for r in bad if r.get("settings")]
    named = f" ({', '.join(f'`{w}`' for w in which)})" if which else ""
    return ["", f"`{part}`: {len(bad)} row(s) not measured{named}; first error: `{first}`."]


def _torch(rec: dict) -> dict[int, dict]:
    """Compiled PyTorch's decode row per context (benchmarks/torch_decode.py)."""
    return {r["ctx"]: r for r in _ok(rec, "torch") if r.get("mode", "compile") == "compile"}


def _source(rec: dict, part: str) -> str:
    """What the record measured, on what: shape, devices, JAX, tree (the part's own where a
    joined record says, `trees`), date."""
    env = rec.get("env", {})
    tree = rec.get("trees", {}).get(part) or env.get("commit", "?")
    devs = env.get("devices") or ["device not recorded"]
    kinds = sorted(set(devs))
    on = ", ".join(f"{devs.count(k)}× {k}" if devs.count(k) > 1 else k for k in kinds)
    date = str(env.get("date", "date not recorded")).split(" ")[0]
    return (f"`user_bench`, `{rec.get('shape', '?')}` shape (random bf16), {on}, "
            f"JAX {env.get('jax', '?')}, tree `{tree}`, {date}")  # fmt: skip


def user_decode(rec: dict) -> list[str]:
    """Batch-1 decode through `LLM.generate` at the defaults, per context, against compiled
    PyTorch at the same context in the same run."""
    bar = _torch(rec)
    rows = []
    for r in sorted((r for r in _ok(rec, "decode") if not r["settings"]), key=lambda r: r["ctx"]):
        t = bar.get(r["ctx"], {})
        torch_ms = (f"{_num(t['pipelined_step_s'] * 1e3)} / {_num(t['step_s'] * 1e3)}"
                    if t.get("pipelined_step_s") else "not in the record")  # fmt: skip
        ratio = f"**{r['vs_torch_compile']:.2f}×**" if "vs_torch_compile" in r else "—"
        rows.append([f"{r['ctx']:,}", f"**{_num(r['decode_ms'])}**", torch_ms, ratio,
                     f"{r['num_pages']:,}"])  # fmt: skip
    head = ["context", 'jdet `"tp"` ms/token', "compiled PyTorch ms (pipelined / synced)",
            "jdet / PyTorch", "KV pool (pages)"]  # fmt: skip
    return [_source(rec, "decode"), "", *_table(head, rows), *_failed(rec, "decode"),
            *_failed(rec, "torch")]  # fmt: skip


def user_sweep(rec: dict) -> list[str]:
    """Batch-1 decode at the shortest context across max_num_seqs x pool: a cliff is a bug."""
    rows = _ok(rec, "decode")
    if not rows:
        return [_source(rec, "decode"), "", "No decode rows in the record.",
                *_failed(rec, "decode")]  # fmt: skip
    ctx = min(r["ctx"] for r in rows)
    grid = {(r["settings"].get("max_num_seqs", r["max_num_seqs"]),
             r["settings"].get("num_pages")): r for r in rows if r["ctx"] == ctx}  # fmt: skip
    seqs = sorted({s for s, _ in grid})
    pools = sorted({p for _, p in grid}, key=lambda p: -1 if p is None else p)
    head = ["`max_num_seqs`"] + [
        "pool sized by the engine" if p is None else f"{p:,} pages" for p in pools
    ]
    body = [[f"{s:,}"] + [_num(grid[s, p]["decode_ms"]) if (s, p) in grid else "—" for p in pools]
            for s in seqs]  # fmt: skip
    ms = [r["decode_ms"] for r in grid.values()]
    bar = _torch(rec).get(ctx, {}).get("pipelined_step_s")
    worst = f"; slowest / compiled PyTorch {max(ms) / (bar * 1e3):.2f}×" if bar else ""
    return [f"{_source(rec, 'decode')}; ms/token at context {ctx:,}", "", *_table(head, body), "",
            f"Spread (slowest / fastest cell): {max(ms) / min(ms):.3f}{worst}.",
            *_failed(rec, "decode")]  # fmt: skip


def user_ttft(rec: dict) -> list[str]:
    """Time to first token of one prompt against transformers' SDPA at the same length."""
    sdpa = {r["prompt"]: r["ttft_ms"] for r in _ok(rec, "sdpa")}
    rows = []
    for r in sorted(_ok(rec, "ttft"), key=lambda r: (r["prompt"], r["max_num_batched_tokens"])):
        s = sdpa.get(r["prompt"])
        rows.append([f"{r['prompt']:,}", f"{r['max_num_batched_tokens']:,}", _num(r["ttft_ms"], 1),
                     _num(s, 1), f"**{r['ttft_ms'] / s:.2f}×**" if s else "—"])  # fmt: skip
    dev = sorted({str(r.get("device", "?")) for r in _ok(rec, "sdpa")})
    head = ["prompt tokens", "`max_num_batched_tokens`", 'jdet `"tp"` ms', "transformers SDPA ms",
            "jdet / SDPA"]  # fmt: skip
    return [_source(rec, "ttft") + (f"; SDPA on {', '.join(dev)}" if dev else ""), "",
            *_table(head, rows), *_failed(rec, "ttft"), *_failed(rec, "sdpa")]  # fmt: skip


def _executables(r: dict) -> str:
    """A start row's step executables: a count (older records), or its shapes x sampler variants
    and the step's kind (benchmarks/start_bench.py's rows)."""
    if "executables" in r:
        return str(r["executables"])
    shapes, variants = r.get("shapes", "?"), r.get("variants", "?")
    return f"{shapes} shapes × {variants} variants ({r.get('step', '?')})"


def user_start(rec: dict) -> list[str]:
    """A fresh process: `jdet.LLM(model)` and one token, cold (empty cache) and warm."""
    rows = []
    for r in _ok(rec, "start"):
        loads = r.get("exec_cache", {}).get("loads", "—")
        rows.append([r.get("cache", "?"), _num(r["engine_s"], 1),
                     _num(r["first_token_after_engine_s"], 1), f"**{_num(r['ready_s'], 1)}**",
                     _executables(r), str(loads)])  # fmt: skip
    head = ["start", "engine s", "warm-up + first token s", "ready s (weights placed → token)",
            "executables", "executable-cache loads"]  # fmt: skip
    if not rows:
        return [_source(rec, "start"), "", "Not measured in this run.", *_failed(rec, "start")]
    return [_source(rec, "start"), "", *_table(head, rows), *_failed(rec, "start")]


# NAME in the markers -> (the benchmark whose records it reads, the renderer)
RENDERERS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "user-decode": ("user_bench", user_decode),
    "user-sweep": ("user_bench", user_sweep),
    "user-ttft": ("user_bench", user_ttft),
    "user-start": ("user_bench", user_start),
}
MARKER = re.compile(r"(<!-- report:([\w-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.DOTALL)


def load(results: Path, bench: str) -> dict | None:
    """The joined record of `bench` (user_bench.py `joined`: each part's rows from every file, in
    name order), or None when none is committed."""
    paths = sorted(results.glob(f"{bench}*.json"))
    if not paths:
        return None
    return joined([json.loads(p.read_text()) for p in paths], [str(p) for p in paths])


def render(text: str, results: Path) -> str:
    """`text` with each marked table rendered from its record (left as it is without one)."""
    records: dict[str, dict | None] = {}

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in RENDERERS:
            raise ValueError(f"BENCHMARKS.md marks a table {name!r}; known: {sorted(RENDERERS)}")
        bench, fn = RENDERERS[name]
        if bench not in records:
            records[bench] = load(results, bench)
        if records[bench] is None:
            return m.group(0)
        return m.group(1) + "\n".join(fn(records[bench])) + "\n" + m.group(4)

    return MARKER.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is not up to date")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--file", type=Path, default=ROOT / "BENCHMARKS.md")
    a = ap.parse_args(argv)
    text = a.file.read_text()
    new = render(text, a.results)
    if a.check:
        if new != text:
            msg = f"{a.file}: its tables differ from the records in {a.results}; run "
            print(msg + "`python -m benchmarks.report` and commit the result", file=sys.stderr)
            return 1
        return 0
    if new != text:
        a.file.write_text(new)
    print(f"{a.file}: {'rewritten' if new != text else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
