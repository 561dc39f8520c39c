"""Training as components: the loop (``loop.Trainer``) composes its configuration
(``config``), what a run is built from (``build``: corpus, batches, optimizer), one
optimisation step (``step``), a learning-rate schedule (``schedule``), the components with
their own state (``state``) and the checkpoint manager they are handed to
(``checkpoint_manager``), validation and the final evaluation (``evaluation``), what the run
reports (``metrics``), which positions the loss counts (``objective``), bf16 compute
weights (``precision``), signal handling (``signals``), ``run.deterministic``
(``determinism``) and a run started from a checkpoint's model (``init``: fine-tuning)."""

from txlm.errors import TrainingError
from txlm.training.loop import Trainer
from txlm.training.objective import OBJECTIVES
from txlm.training.sample import sample_text
from txlm.training.schedule import learning_rate

__all__ = ["OBJECTIVES", "Trainer", "TrainingError", "learning_rate", "sample_text"]
