"""Execute a notebook's code cells in one plain Python process and store their outputs.

Why: the GPU machine the notebooks' committed outputs come from has no Jupyter kernel (no ipykernel,
nbclient or nbformat), and nothing can be installed there beyond carried wheels. This runs each code
cell with `exec` in one namespace, captures stdout/stderr as stream outputs and every matplotlib
figure as a PNG display output, and rewrites the notebook (plain JSON, nbformat 4) after every
cell, so a run cut short still keeps what it computed. IPython magics (`%...` lines) are skipped.
CI executes the notebooks with nbclient instead (tests/test_notebooks.py).

    PYTHONPATH=. JDET_NB_SCALE=gpu python notebooks/execute.py notebooks/03_on_policy_rl.ipynb x
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import sys
import traceback


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
            print(f"{src}: cell {count} {status}", file=sys.__stderr__, flush=True)
        if not ok:
            break
    return ok


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python notebooks/execute.py IN.ipynb OUT.ipynb")
    sys.exit(0 if execute(sys.argv[1], sys.argv[2]) else 1)
