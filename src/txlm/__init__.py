"""txlm: Transformer-XL language models.

import txlm
model = txlm.load("runs/shakespeare-char/best")        # a checkpoint `txlm train` wrote
vocab = txlm.load_vocab("runs/shakespeare-char/best")  # its vocabulary: text <-> ids
[new] = txlm.generate(model, vocab.encode("ROMEO:"), max_new_tokens=50, seed=0)
print(vocab.decode(new))

clf = txlm.load_classifier("runs/genre/best")  # `txlm train --task classify` wrote it
txlm.classify(clf, "To be, or not to be").label
"""

from txlm.checkpoints.checkpoint import load, load_classifier, load_vocab, save
from txlm.classify.predict import classify
from txlm.config import PRESETS, ModelConfig, preset_names
from txlm.errors import TxlmError
from txlm.inference.generate import generate
from txlm.inference.score import score
from txlm.model import TransformerXL, TransformerXLOutput
from txlm.model.lengths import Lengths

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "Lengths",
    "ModelConfig",
    "TransformerXL",
    "TransformerXLOutput",
    "TxlmError",
    "classify",
    "generate",
    "load",
    "load_classifier",
    "load_vocab",
    "preset_names",
    "save",
    "score",
]
