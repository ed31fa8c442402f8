"""The direction of dependencies (docs/ARCHITECTURE.md "Layers"): pyproject.toml's import-linter
contracts hold, every module of jdet has its layer, and no module imports itself through others.

Read from the source by grimp (import-linter's graph): no module is imported, and an import inside
a function counts like one at the top of the file. Negative controls: the same checks on the
graph with one import added against the direction must fail.
"""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jdet", "pallas_kernels", "sharding", "serving")


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _layers() -> list[list[str]]:
    (contract,) = [c for c in _contracts() if c["id"] == "layers"]
    return [[m.strip() for m in layer.replace("|", ":").split(":")] for layer in contract["layers"]]


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*LIBRARY, cache_dir=None)


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """A shortest import cycle through some module (a -> b -> ... -> a), or None."""
    for a in sorted(graph.modules):
        for b in sorted(graph.find_modules_directly_imported_by(a)):
            back = graph.find_shortest_chain(importer=b, imported=a)
            if back is not None:
                return [a, *back]
    return None


def _illegal(graph: grimp.ImportGraph) -> set:
    layers = [grimp.Layer(*layer, independent=False) for layer in _layers()]
    return graph.find_illegal_dependencies_for_layers(layers=layers)


def _serving_illegal(graph: grimp.ImportGraph, contract_id: str = "serving-layers") -> set:
    """Imports against the layers inside a package of serving/ (contract `contract_id`)."""
    (contract,) = [c for c in _contracts() if c["id"] == contract_id]
    layers = [
        grimp.Layer(*(m.strip() for m in layer.split("|")), independent=True)
        for layer in contract["layers"]
    ]
    containers = set(contract["containers"])
    return graph.find_illegal_dependencies_for_layers(layers=layers, containers=containers)


def test_import_linter_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(ROOT)
    # lint_imports configures logging with dictConfig, which disables every existing logger:
    # later tests of this process would then capture no jdet log records
    loggers = [x for x in logging.root.manager.loggerDict.values() if isinstance(x, logging.Logger)]
    enabled = [x for x in loggers if not x.disabled]
    try:
        assert lint_imports(no_cache=True) == 0, "lint-imports: see the broken contracts above"
    finally:
        for x in enabled:
            x.disabled = False


def test_architecture_md_names_every_contract():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [c["id"] for c in _contracts() if f"`{c['id']}`" not in text]
    assert not missing, f"docs/ARCHITECTURE.md's Layers section does not describe {missing}"


def test_every_jdet_module_has_one_layer():
    """A new module of jdet must say where it sits: entry point (above serving/) or core."""
    named = [m for layer in _layers() for m in layer]
    assert len(named) == len(set(named))
    graph = _graph()
    children = graph.find_children("jdet")
    missing = sorted(children - set(named))
    assert not missing, f"add {missing} to a layer of pyproject.toml's 'layers' contract"


def test_no_module_imports_itself_through_others():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert not _illegal(graph)
    # negative controls: a kernel that reads the model config, a core module that runs the engine
    graph.add_import(importer="pallas_kernels.matmul", imported="jdet.config")
    assert _illegal(graph)
    graph.add_import(importer="jdet.config", imported="serving.engine.engine")
    assert _cycle(graph) is not None


def test_serving_subpackages_import_only_downwards():
    """serving/'s subpackages (http > engine > speculative | constrained > sequence > options)
    import only below their own layer, and speculative decoding and constrained sampling not
    each other."""
    graph = _graph()
    assert not _serving_illegal(graph)
    # negative controls: the engine reaching into the server; the two engine collaborators
    # reaching into each other
    up = _graph()
    up.add_import(importer="serving.engine.engine", imported="serving.http.server")
    assert _serving_illegal(up)
    across = _graph()
    across.add_import(
        importer="serving.speculative.speculator", imported="serving.constrained.structured"
    )
    assert _serving_illegal(across)


def test_the_engines_collaborators_know_neither_it_nor_each_other():
    """Contract "engine-layers": the engine is one unit, its collaborators given what they need."""
    assert not _serving_illegal(_graph(), "engine-layers")
    # negative controls: a collaborator reaching back into the engine; the runner into scheduling
    back = _graph()
    back.add_import(importer="serving.engine.request_table", imported="serving.engine.engine")
    assert _serving_illegal(back, "engine-layers")
    across = _graph()
    across.add_import(importer="serving.engine.model_runner", imported="serving.engine.scheduler")
    assert _serving_illegal(across, "engine-layers")


# -- one place per decision: the kernel backend ---------------------------------------------------
# Ways of asking "which platform is this" that belong to pallas_kernels/ and jdet/plan.py only:
# everything else asks `jdet.plan.backend()` / `Plan.backend` (jdet/ops.py, which the plan
# imports, asks `pallas_kernels.backend()`, the function the plan wraps).
BACKEND_CHECK = re.compile(
    r"jax\.default_backend\("
    r"|\b_platform\.(platform|interpret_default|xla_fixed_default|is_hopper|resolve|"
    r"pallas_interpret_forced|small_row_blocks)\b"
    r"|\bresolve_backend\("
    r"|\.platform\s*(==|!=|in\b|not\s+in\b)"
    r"|\bSMALL_ROW_BLOCKS\b"
)
BACKEND_DECIDERS = ("pallas_kernels/", "jdet/plan.py")


def _library_files() -> list[Path]:
    return sorted(p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py"))


def _backend_checks(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if BACKEND_CHECK.search(ln)]


def test_the_backend_is_decided_in_the_plan_only():
    found = {}
    for path in _library_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(BACKEND_DECIDERS):
            continue
        if hits := _backend_checks(path.read_text()):
            found[rel] = hits
    assert not found, f"ask jdet.plan.backend() instead of probing the platform: {found}"


def test_negative_control_the_backend_grep_sees_each_idiom():
    for line in ('if jax.default_backend() == "cpu":', 'if _platform.platform() != "gpu":',
                 "x = _platform.xla_fixed_default()", "if _platform.is_hopper():",
                 'if _platform.resolve(None, "rms_norm") != "pallas":',
                 'resolve_backend(None) == "mosaic"', 'all(d.platform == "cpu" for d in devs)',
                 "if xla_fixed.SMALL_ROW_BLOCKS:"):  # fmt: skip
        assert _backend_checks(line), line
    assert not _backend_checks("if backend().cpu:")


# -- the library's size and its comments -----------------------------------------------------------
MAX_LINES = 400


def test_no_library_file_is_over_400_lines():
    long = {p.relative_to(ROOT).as_posix(): n for p in _library_files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"split these by what they hold: {long}"


# History belongs to git and figures to BENCHMARKS.md: a comment cites no work period, issue,
# benchmark run or date, states no before -> after timing and quotes no measured time (a
# sub-second unit, or an approximate "~N s"); a design constant in seconds ("1 s") stays.
HISTORY = re.compile(
    r"\bsessions? \d|\bturn \d|\bissues? #?\d|#\d{2,}\b|\bseed 0\d\d\b|BENCHMARKS(\.md)? run \d"
    r"|\b20\d\d-\d\d-\d\d\b|\d ?-> ?~?\d+(\.\d+)?(-\d+(\.\d+)?)? ?(CPU )?(ms|us|µs|s|tok/s)\b"
    r"|(?<![\w.])\d+(\.\d+)?(-\d+(\.\d+)?)? ?(CPU )?(ms|us|µs)\b"
    r"|~ ?\d+(\.\d+)?(-\d+(\.\d+)?)? ?(CPU )?s\b",
    re.IGNORECASE,
)


def _history(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if HISTORY.search(ln)]


def test_library_comments_cite_no_history():
    found = {}
    for path in _library_files():
        rel = path.relative_to(ROOT).as_posix()
        if hits := _history(path.read_text()):
            found[rel] = hits
    assert not found, f"history in library comments (git and BENCHMARKS.md hold it): {found}"


def test_negative_control_the_history_grep_sees_each_form():
    for line in ("# until session 11 the bucket", "(issue 17)", "see #35", "seed 003's scheme",
                 "(BENCHMARKS run 13)", "measured 2026-11-02", "step 9.58 -> 8.76 ms",
                 "load 5-7: 99 -> 140 tok/s", "167-171 -> 234-259 tok/s",
                 "10.9 -> 7.2 CPU s", "a step of 12.3 ms", "53 µs per call", "~2.5 us a layer",
                 "~0.15 s to import", "in ~2-3 CPU s", "0.1 ms of the host's step"):  # fmt: skip
        assert _history(line), line
    for line in ("a 2-row dot for 1-2 rows; 64 -> 128 columns", "compiles longer than 1 s",
                 "ends the running requests with 500s", "f\"{dt * 1e3:.1f} ms\"",
                 "heads, then k heads; 16 bits"):  # fmt: skip
        assert not _history(line), line


def test_negative_control_a_test_importing_benchmarks_breaks_tests_standalone():
    """The `tests-standalone` contract (tests import nothing from benchmarks) sees such an
    import: tests build what they need from the library or from tests/ itself."""
    graph = grimp.build_graph("tests", "benchmarks", cache_dir=None)
    assert not graph.find_shortest_chain(importer="tests", imported="benchmarks", as_packages=True)
    graph.add_import(importer="tests.jdet.test_golden", imported="benchmarks.decode_bench")
    assert graph.find_shortest_chain(importer="tests", imported="benchmarks", as_packages=True)
