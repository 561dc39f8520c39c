"""One exception type for everything a user can get wrong.

The CLI turns a ``TxlmError`` into one line on stderr and exit code 2; anything else is a bug
and keeps its traceback. Library code raises the most specific subclass it can.
"""

from __future__ import annotations


class TxlmError(Exception):
    """Bad input: a missing corpus, a foreign checkpoint, an impossible length, ..."""


class ConfigError(TxlmError, ValueError):
    """A configuration value or key that cannot be used."""


class CheckpointError(TxlmError):
    """A checkpoint directory that is missing, truncated, foreign or inconsistent."""


class DataError(TxlmError):
    """A corpus, split or vocabulary that cannot be used."""


class TrainingError(TxlmError):
    """A run that cannot go on: it diverged, or a resume that does not fit the run."""
