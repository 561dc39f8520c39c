"""The package's modules import each other without a cycle (ARCHITECTURE.md, layers).

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING``. An
import moved into a function still couples two modules; it only hides the cycle until the
order of first use changes. The walk reads the source (ast), so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import txlm

SRC = Path(txlm.__file__).parent
ROOT = SRC.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The txlm module ``name`` means: itself, else the package that defines it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_in(source: str, module: str, modules, *, is_package: bool = False) -> set[str]:
    """The txlm modules (of ``modules``) that ``source``, the text of ``module``, imports."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets = [s if s in modules else base for s in subs]
        else:
            continue
        for target in targets:
            if target == "txlm" or target.startswith("txlm."):
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    found.add(resolved)
    return found


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    source = path.read_text(encoding="utf-8")
    return imports_in(source, module, MODULES, is_package=path.name == "__init__.py")


def import_graph() -> dict[str, set[str]]:
    return {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete cycle inside ``component``, as a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    trail = [start]
    seen = {start}
    while True:
        nxt = sorted(graph[trail[-1]] & members)
        back = [w for w in nxt if w == start]
        if back and len(trail) > 1:
            return " -> ".join([*trail, start])
        fresh = [w for w in nxt if w not in seen]
        if not fresh:  # walk on from a member already seen: it closes a loop
            w = nxt[0]
            return " -> ".join([*trail[trail.index(w) :], w])
        trail.append(fresh[0])
        seen.add(fresh[0])


WALKED = """
from __future__ import annotations
from typing import TYPE_CHECKING
import numpy as np
from txlm.pkg import sub, NAME
from . import sibling
if TYPE_CHECKING:
    from txlm.typed import Thing
def f():
    import txlm.late.deep
    from txlm.pkg.sub import helper
"""


def test_the_walk_sees_every_import():
    modules = {"txlm.pkg", "txlm.pkg.sub", "txlm.pkg.sibling", "txlm.typed", "txlm.late", "txlm.x"}
    found = imports_in(WALKED, "txlm.pkg.me", modules)
    # a submodule, a package's name, a relative import, TYPE_CHECKING, inside a function
    # (txlm.late.deep is not a module: its package is what runs)
    assert found == {"txlm.pkg.sub", "txlm.pkg", "txlm.pkg.sibling", "txlm.typed", "txlm.late"}
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(fake) == [["a", "b", "c"]]
    assert _path(fake, ["a", "b", "c"]) == "a -> b -> c -> a"
    assert "txlm.data.vocab" in import_graph()["txlm.data.bpe"]  # the real tree is read


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_path(graph, c) for c in found)


# ARCHITECTURE.md, layers: the packages (or modules) of each layer, in the table's order; a
# module imports only its own layer and those before it. Classification spans three layers.
LAYERS = [
    ("txlm.errors", "txlm.devices", "txlm.atomic"),
    ("txlm.config", "txlm.resources"),
    ("txlm.model", "txlm.classify.classifier"),
    ("txlm.data", "txlm.classify.classes", "txlm.classify.documents"),
    ("txlm.checkpoints",),
    ("txlm.inference", "txlm.classify"),
    ("txlm.serve",),
    ("txlm.training",),
    ("txlm.analysis",),
    ("txlm.commands", "txlm.cli"),
]


def _layer(module: str) -> int | None:
    """The layer of ``module``: its longest matching entry's."""
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def test_the_package_root_holds_few_modules():
    root = sorted(p.name for p in SRC.glob("*.py") if not p.name.startswith("__"))
    assert len(root) + 2 <= 8, root  # __init__ and __main__ count too


def test_no_layer_imports_a_later_one():
    """data imports nothing of the checkpoints, the model nothing of data, and so on down the
    table; an arrow back up is a layer that knows what is built on it."""
    graph = import_graph()
    up = []
    for module, imported in graph.items():
        mine = _layer(module)
        for other in imported:
            theirs = _layer(other)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(f"{module} -> {other}")
    assert not up, "imports back up the layers:\n" + "\n".join(sorted(up))
