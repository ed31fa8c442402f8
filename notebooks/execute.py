"""Execute notebooks' code cells in plain Python processes and store their outputs.

Why: the GPU machine the notebooks' committed outputs come from has no Jupyter kernel (no ipykernel,
nbclient or nbformat), and nothing can be installed there beyond carried wheels. This runs each code
cell with `exec` in one namespace, captures stdout/stderr as stream outputs and every matplotlib
figure as a PNG display output, and rewrites the notebook (plain JSON, nbformat 4) after every
cell, so a run cut short still keeps what it computed. IPython magics (`%...` lines) are skipped.
CI executes the notebooks with nbclient instead (tests/test_notebooks.py).

One notebook (the form tests/test_notebooks.py checks):

    PYTHONPATH=. JDET_NB_SCALE=gpu python notebooks/execute.py notebooks/03_on_policy_rl.ipynb x.ipynb

Several, each in a fresh process (its JAX and GPU memory gone before the next starts), into a
folder, with each cell's time printed as it ends; a notebook that fails is recorded (its error in
its cell) and the next one runs; the exit status is 1 if any failed:

    PYTHONPATH=. python notebooks/execute.py --scale gpu --out $OUT notebooks/01_nondeterminism.ipynb ...

`--scale` sets JDET_NB_SCALE for them (default: gpu). JDET_NB_COMMIT, the commit the notebooks
state (notebooks/nbenv.py), is set from `git rev-parse` here unless given: a copy of the tree
without .git states "unknown" otherwise.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _stream(name: str, text: str) -> dict:
    return {"output_type": "stream", "name": name, "text": text.splitlines(keepends=True)}


def _figures() -> list[dict]:
    import matplotlib.pyplot as plt

    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", bbox_inches="tight", dpi=100)
        png = base64.b64encode(buf.getvalue()).decode()
        out.append({"output_type": "display_data", "metadata": {},
                    "data": {"image/png": png, "text/plain": ["<Figure>"]}})  # fmt: skip
    plt.close("all")
    return out


def execute(src: str, dst: str) -> bool:
    """Run `src`'s code cells top to bottom, writing `dst` after each; False on the first error."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    if str(ROOT) not in sys.path:  # `from notebooks.nbenv import ...`, `benchmarks.*`
        sys.path.insert(0, str(ROOT))
    with open(src) as f:
        nb = json.load(f)
    ns: dict = {"__name__": "__main__"}
    count = 0
    ok = True
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        code = "".join(cell["source"])
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith("%"))
        count += 1
        out, err = io.StringIO(), io.StringIO()
        errors: list[dict] = []
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(code, f"<cell {count}>", "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - recorded in the notebook, then stop
            ok = False
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            errors.append({"output_type": "error", "ename": type(e).__name__,
                           "evalue": str(e), "traceback": tb})  # fmt: skip
        finally:
            streams = [_stream(n, b.getvalue()) for n, b in (("stdout", out), ("stderr", err))
                       if b.getvalue()]  # fmt: skip
            cell["outputs"], cell["execution_count"] = streams + _figures() + errors, count
            with open(dst, "w") as f:
                json.dump(nb, f, indent=1)
            status = "ok" if ok else "FAILED"
            dt = time.perf_counter() - t0
            print(f"{src}: cell {count} {status} ({dt:.1f} s)", file=sys.__stderr__, flush=True)
            if not ok:
                print("".join(errors[0]["traceback"])[-3000:], file=sys.__stderr__, flush=True)
        if not ok:
            break
    return ok


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
        return head.stdout.strip() if head.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def run_many(paths: list[str], out_dir: str, scale: str) -> int:
    """Each notebook in its own process, into out_dir; 1 if any failed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JDET_NB_SCALE": scale, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if not env.get("JDET_NB_COMMIT") and _commit():
        env["JDET_NB_COMMIT"] = _commit()
    t_all = time.perf_counter()
    failed = []
    for p in paths:
        t0 = time.perf_counter()
        print(f"== {p} (scale {scale}) starts at {time.perf_counter() - t_all:.0f} s", flush=True)
        dst = out / Path(p).name
        rc = subprocess.run([sys.executable, __file__, p, str(dst)], cwd=ROOT, env=env).returncode
        print(f"== {p}: {'ok' if rc == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s -> {dst}",
              flush=True)  # fmt: skip
        if rc != 0:
            failed.append(p)
    print(f"== {len(paths) - len(failed)} of {len(paths)} notebooks ran in "
          f"{time.perf_counter() - t_all:.0f} s" + (f"; failed: {failed}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and not argv[0].startswith("-"):  # IN.ipynb OUT.ipynb, in this process
        return 0 if execute(argv[0], argv[1]) else 1
    ap = argparse.ArgumentParser(description="execute notebooks into a folder (module docstring)")
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--out", required=True, help="folder for the executed notebooks")
    ap.add_argument("--scale", default="gpu", choices=["gpu", "ci"])
    a = ap.parse_args(argv)
    return run_many(a.notebooks, a.out, a.scale)


if __name__ == "__main__":
    sys.exit(main())
