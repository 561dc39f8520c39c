"""The data pipeline: vocabularies, prepared corpora on disk, and stream iterators.

The names below are the public API the training and evaluation code builds on.
"""

from txlm.data.prepare import open_corpus, prepare_dataset
from txlm.data.prepared import PreparedCorpus, default_data_dir, load_prepared
from txlm.data.streams import Batch, SentenceStreamIterator, StreamIterator
from txlm.data.vocab import Vocab

__all__ = [
    "Batch",
    "PreparedCorpus",
    "SentenceStreamIterator",
    "StreamIterator",
    "Vocab",
    "default_data_dir",
    "load_prepared",
    "open_corpus",
    "prepare_dataset",
]
