"""The direction of dependencies (docs/ARCHITECTURE.md "Layers"): pyproject.toml's import-linter
contracts hold, every module of jdet has its layer, and no module imports itself through others.

Read from the source by grimp (import-linter's graph): no module is imported, and an import inside
a function counts like one at the top of the file. Negative controls: the same checks on the
graph with one import added against the direction must fail.
"""

from __future__ import annotations

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
    assert lint_imports(no_cache=True) == 0, "lint-imports: see the broken contracts above"


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
