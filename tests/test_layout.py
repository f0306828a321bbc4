"""The package's layout: no import circles (module-level or inside functions, between modules
or between top-level folders), the trainer base module imports none of its subclasses, the
plugin registry none of the hooks it checks, and every top-level folder of the package named in
the README's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "sglang_dspark"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from package import submodule` imports the submodule (and runs the
                # package's __init__, as any submodule import does: not counted as an edge)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "sglang_dspark":
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components larger than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 50
    assert cycles(graph) == []
    # the check itself finds a circle
    graph["sglang_dspark.scheduling.sps"].add("sglang_dspark.serving.embedded")
    graph["sglang_dspark.serving.embedded"].add("sglang_dspark.scheduling.sps")
    assert cycles(graph)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded to the package's top-level folders (cli.py and __init__ apart)."""

    def top(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 else module

    folded: dict[str, set[str]] = {top(m): set() for m in graph}
    for m, targets in graph.items():
        folded[top(m)] |= {top(t) for t in targets} - {top(m)}
    return folded


def test_no_circles_between_top_level_folders():
    """A folder either uses another or is used by it: drafter never reaches back to v4 or
    serving, serving never to evaluation."""
    graph = import_graph()
    folded = package_graph(graph)
    assert {"drafter", "serving", "evaluation", "v4"} <= set(folded)
    assert cycles(folded) == []
    # the folding itself finds a circle two modules apart
    graph["sglang_dspark.serving.client"].add("sglang_dspark.evaluation.benchmarks")
    assert cycles(package_graph(graph))


def test_base_trainer_and_plugin_registry_import_no_subclass_or_hook():
    graph = import_graph()
    train = graph["sglang_dspark.drafter.training.train"]
    assert not {m for m in train if m.endswith(("train_mtp", "train_v4"))}
    registry = graph["sglang_dspark.plugin.registry"]
    assert not {m for m in registry if m.startswith("sglang_dspark.plugin.")}


def test_train_module_stays_small():
    lines = (PKG / "drafter" / "training" / "train.py").read_text().count("\n")
    assert lines < 600, f"drafter/training/train.py has {lines} lines"


def test_every_package_folder_is_in_the_readme_table():
    readme = (REPO / "README.md").read_text()
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    missing = [f for f in folders if not re.search(rf"`sglang_dspark/{f}/", readme)]
    assert not missing, f"README's table does not name {missing}"
