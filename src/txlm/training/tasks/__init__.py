"""The kinds of training a run can be (``task`` in the configuration), each a ``Task``
(``txlm.training.tasks.task``) the trainer is given: language modelling (``lm``) and
document classification (``classify``)."""

from txlm.training.tasks.classify import ClassifyTask
from txlm.training.tasks.lm import LanguageModelTask
from txlm.training.tasks.task import Task

TASKS: dict[str, type[LanguageModelTask] | type[ClassifyTask]] = {
    "lm": LanguageModelTask,
    "classify": ClassifyTask,
}

__all__ = ["TASKS", "ClassifyTask", "LanguageModelTask", "Task"]
