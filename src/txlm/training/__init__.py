"""Training as components: the loop (``loop.Trainer``) composes a learning-rate schedule
(``schedule``), the run's state with its save/restore (``state``, ``checkpointing``), what the
run reports (``metrics``), which positions the loss counts (``objective``) and signal
handling (``signals``)."""

from txlm.training.checkpointing import TrainingError
from txlm.training.loop import Trainer
from txlm.training.objective import OBJECTIVES
from txlm.training.sample import sample_text
from txlm.training.schedule import learning_rate

__all__ = ["OBJECTIVES", "Trainer", "TrainingError", "learning_rate", "sample_text"]
