"""``txlm.train``: the training entry point; the components live in ``txlm.training``."""

from txlm.training import Trainer, TrainingError, learning_rate, sample_text

__all__ = ["Trainer", "TrainingError", "learning_rate", "sample_text"]
