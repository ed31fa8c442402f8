"""Every notebook executes top to bottom on CPU at its CI scale (its cells assert what they show)
and states its device, date, jdet version and commit first; notebooks/execute.py, which produces
the committed outputs on a machine without Jupyter, records streams, figures and errors, and runs a
list of notebooks into a folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Notebooks 02 and 04 build engines of one step shape at the CI scale (the embedded model, T = 16,
# S = 8, 128 tokens, 64 pages) and run on one xdist worker in that order. They shared the run's
# compile cache, so that 04 loaded steps 02 had compiled; each kernel now has its own cache
# (test_notebook_runs says why). Notebook 01 runs `jdet serve` subprocesses on a model of its own.
SHARED_ENGINES = ("02_tp_invariance.ipynb", "04_serving.ipynb")


def _param(path: Path):
    if path.name in SHARED_ENGINES:
        return pytest.param(path, marks=pytest.mark.xdist_group("notebooks_embedded_t16"))
    return path


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch, tmp_path):
    monkeypatch.setenv("JDET_NB_SCALE", "ci")  # the small CPU setting, whatever the caller's env
    # Each notebook's kernel compiles into its own cache: on JAX 0.10.2 on an Intel AVX-512 host,
    # notebook 04 run after 01 and 02 on one shared cache failed in its first warm-up run with
    # "Function ... not found" (XLA:CPU running an executable another process cached); alone, or
    # twice on one cache, it passes. An open bug (BENCHMARKS.md, open gaps), not yet found.
    monkeypatch.setenv("JDET_CACHE_DIR", str(tmp_path / "jdet-cache"))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()  # fmt: skip


def test_execute_py_records_outputs_and_stops_at_an_error(tmp_path):
    cells = [
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nprint('hello')\nplt.plot([1, 2])",
        "x = 1 / 0",
        "print('never')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    src, dst = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(nb, src)
    script = ROOT / "notebooks" / "execute.py"
    run = subprocess.run([sys.executable, str(script), str(src), str(dst)], capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 1, run.stderr
    out = nbformat.reads(dst.read_text(), as_version=4)
    nbformat.validate(out)
    first, second, third = (c.outputs for c in out.cells)
    assert [o.output_type for o in first] == ["stream", "display_data"]
    assert first[0].text == "hello\n" and "image/png" in first[1].data
    assert second[0].output_type == "error" and second[0].ename == "ZeroDivisionError"
    assert third == []
    assert json.loads(dst.read_text())["nbformat"] == 4


def test_every_notebook_states_device_date_version_and_commit_first():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        first = next(c for c in nb.cells if c.cell_type == "code")
        assert "from notebooks.nbenv import header" in first.source, path.name
        assert "header(SCALE" in first.source, path.name


def test_execute_py_runs_a_list_into_a_folder_past_a_failure(tmp_path):
    bad = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('no')")])
    code = ("import os\nfrom notebooks import nbenv\n"
            "print(os.environ['JDET_NB_SCALE'], nbenv.commit())")
    good = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbformat.write(bad, tmp_path / "a.ipynb")
    nbformat.write(good, tmp_path / "b.ipynb")
    out = tmp_path / "out"
    script = ROOT / "notebooks" / "execute.py"
    env = {**os.environ, "JDET_NB_COMMIT": "abc1234"}
    run = subprocess.run([sys.executable, str(script), "--scale", "ci", "--out", str(out),
                          str(tmp_path / "a.ipynb"), str(tmp_path / "b.ipynb")],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 of 2 notebooks ran" in run.stdout
    a = nbformat.read(out / "a.ipynb", as_version=4)
    b = nbformat.read(out / "b.ipynb", as_version=4)
    assert a.cells[0].outputs[0].ename == "ValueError"
    assert b.cells[0].outputs[0].text == "ci abc1234\n"
