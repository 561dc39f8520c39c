"""The training package and the persistence layer import without cycles (function-level
imports included): the loop composes the components, none of them imports the loop, and
``txlm.checkpoint`` knows nothing of training runs."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _imports(path: Path) -> set[str]:
    """Every txlm module ``path`` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("txlm")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("txlm"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for f in (SRC / "txlm").rglob("*.py"):
        name = ".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = f
    return {
        name: {m for m in _imports(f) if m in modules and m != name} for name, f in modules.items()
    }


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return False


def test_no_training_or_persistence_module_is_on_an_import_cycle():
    graph = _graph()
    ours = [m for m in graph if m.startswith("txlm.training") or m in PERSISTENCE]
    assert "txlm.training.checkpoint_manager" in ours
    on_cycle = [m for m in ours if _reaches(graph, m, m)]
    assert on_cycle == []


def test_the_components_do_not_import_the_loop_and_persistence_not_training():
    graph = _graph()
    components = [m for m in graph if m.startswith("txlm.training.") and m != LOOP]
    assert {"txlm.training.state", "txlm.training.config"} <= set(components)
    assert [m for m in components if _reaches(graph, m, LOOP)] == []
    for m in PERSISTENCE:
        assert not any(d.startswith("txlm.training") for d in graph[m]), m


LOOP = "txlm.training.loop"
PERSISTENCE = ("txlm.checkpoint", "txlm.safe_unpickle", "txlm.convert", "txlm.hub")
