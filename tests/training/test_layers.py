"""The training package's layering (the import graph of ``test_imports``, function-level and
``TYPE_CHECKING`` imports included): the loop composes the components and none of them
reaches the loop; the persistence layer imports nothing of training."""

from __future__ import annotations

from tests.test_imports import import_graph

LOOP = "txlm.training.loop"
PERSISTENCE = (
    "txlm.checkpoints.checkpoint",
    "txlm.checkpoints.safe_unpickle",
    "txlm.checkpoints.convert",
    "txlm.checkpoints.hub",
)


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


def test_no_component_reaches_the_loop():
    graph = import_graph()
    components = [m for m in graph if m.startswith("txlm.training.") and m != LOOP]
    assert {"txlm.training.state", "txlm.training.checkpoint_manager"} <= set(components)
    assert [m for m in components if _reaches(graph, m, LOOP)] == []


def test_persistence_imports_nothing_of_training():
    graph = import_graph()
    for m in PERSISTENCE:
        assert not any(_reaches(graph, m, t) for t in graph if t.startswith("txlm.training")), m


def test_the_loop_knows_tasks_only_through_the_protocol():
    """The trainer is given its task (txlm.training.tasks: TASKS, Task): it imports no task's
    module and nothing of classification, so it cannot ask which task it runs."""
    direct = import_graph()[LOOP]
    assert "txlm.training.tasks" in direct
    named = {"txlm.training.tasks.lm", "txlm.training.tasks.classify"}
    assert not direct & named and not [m for m in direct if m.startswith("txlm.classify")]
