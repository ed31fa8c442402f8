"""BENCHMARKS.md's rendered tables match the committed benchmark records (benchmarks/report.py).

The renderer runs as a command, as CI and a developer run it: tests import nothing from
benchmarks (the `tests-standalone` contract). The fixture is user_bench's CPU smoke record
(notebooks/data/), rendered into a copy of BENCHMARKS.md.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "notebooks" / "data" / "user_bench_cpu_smoke.json"
BLOCK = re.compile(r"<!-- report:([\w-]+) -->\n.*?<!-- /report:\1 -->", re.DOTALL)


def _report(*args: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.report", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def test_benchmarks_md_matches_the_committed_records():
    p = _report("--check")
    assert p.returncode == 0, p.stderr


def test_a_record_renders_its_tables_and_check_sees_a_changed_figure(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(SMOKE, results / "user_bench.json")
    md = tmp_path / "BENCHMARKS.md"
    before = (ROOT / "BENCHMARKS.md").read_text()
    md.write_text(before)
    paths = ("--results", results, "--file", md)
    # negative control: the committed placeholders are not the record's rendering
    assert _report("--check", *paths).returncode == 1
    p = _report(*paths)
    assert p.returncode == 0, p.stderr
    assert _report("--check", *paths).returncode == 0
    after = md.read_text()
    assert BLOCK.sub("", after) == BLOCK.sub("", before), "text outside the markers changed"
    rec = json.loads(SMOKE.read_text())
    default = next(r for r in rec["decode"] if not r["settings"])
    figure = f"**{default['decode_ms']:.2f}**"
    assert figure in after
    for r in rec["start"]:
        assert f"**{r['ready_s']:.1f}**" in after
    # negative control: a figure edited by hand no longer matches its record
    md.write_text(after.replace(figure, "**1.00**", 1))
    assert _report("--check", *paths).returncode == 1


def test_benchmarks_md_is_at_most_400_lines():
    """The current state fits on one page; the log of how it got there is git's."""
    n = len((ROOT / "BENCHMARKS.md").read_text().splitlines())
    assert n <= 400, f"BENCHMARKS.md has {n} lines: drop what a rendered table now says"


def test_records_of_one_run_in_several_files_join_their_rows(tmp_path):
    """The sweep's shards (user_bench --shard I/N, one file each) add up: every file's decode rows
    are rendered, none replaces another's. Control: one file alone renders only its own."""
    rec = json.loads(SMOKE.read_text())
    decode = [r for r in rec["decode"] if "error" not in r]
    assert len(decode) >= 2
    results = tmp_path / "results"
    results.mkdir()
    (results / "user_bench-1.json").write_text(json.dumps({**rec, "decode": decode[:1]}))
    (results / "user_bench-2.json").write_text(json.dumps(
        {"shape": rec["shape"], "env": rec["env"], "decode": decode[1:]}))  # fmt: skip
    md = tmp_path / "BENCHMARKS.md"

    def sweep() -> str:
        md.write_text((ROOT / "BENCHMARKS.md").read_text())
        p = _report("--results", results, "--file", md)
        assert p.returncode == 0, p.stderr
        return md.read_text().split("<!-- report:user-sweep -->")[1].split("<!-- /report")[0]

    both = sweep()
    assert all(f"{r['decode_ms']:.2f}" in both for r in decode)
    (results / "user_bench-2.json").unlink()
    alone = sweep()
    assert not all(f"{r['decode_ms']:.2f}" in alone for r in decode)


def test_a_joined_record_names_each_parts_tree(tmp_path):
    """Runs of different trees joined (`user_bench --merge`): each table names its own part's
    tree(s), not only the first run's. Control: runs of one tree record no `trees`."""
    rec = json.loads(SMOKE.read_text())
    a = {k: v for k, v in rec.items() if k != "ttft"}
    a["env"] = {**rec["env"], "commit": "aaaaaaa"}
    b = {"shape": rec["shape"], "env": {**rec["env"], "commit": "bbbbbbb"},
         "ttft": rec["ttft"], "decode": rec["decode"][:1]}  # fmt: skip

    def merged(*recs: dict) -> dict:
        paths = []
        for i, r in enumerate(recs):
            paths.append(tmp_path / f"in{i}.json")
            paths[-1].write_text(json.dumps(r))
        out = tmp_path / "results"
        cmd = [sys.executable, "-m", "benchmarks.user_bench", "--merge", *map(str, paths),
               "--out", str(out)]  # fmt: skip
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        return json.loads((out / "user_bench.json").read_text())

    got = merged(a, b)
    assert got["trees"]["ttft"] == "bbbbbbb" and got["trees"]["decode"] == "aaaaaaa + bbbbbbb"
    md = tmp_path / "BENCHMARKS.md"
    md.write_text((ROOT / "BENCHMARKS.md").read_text())
    p = _report("--results", tmp_path / "results", "--file", md)
    assert p.returncode == 0, p.stderr
    ttft = md.read_text().split("<!-- report:user-ttft -->")[1].split("<!-- /report")[0]
    assert "tree `bbbbbbb`" in ttft
    assert "trees" not in merged(a, {**b, "env": a["env"]})
