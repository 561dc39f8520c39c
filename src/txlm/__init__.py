"""txlm: Transformer-XL language models.

import txlm
model = txlm.TransformerXL(txlm.ModelConfig.from_preset("debug"))
txlm.save(model, "ckpt")
model = txlm.load("ckpt")
"""

from txlm.checkpoint import load, save
from txlm.config import PRESETS, ModelConfig, preset_names
from txlm.errors import TxlmError
from txlm.generate import generate
from txlm.model import TransformerXL, TransformerXLOutput
from txlm.score import score

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ModelConfig",
    "TransformerXL",
    "TransformerXLOutput",
    "TxlmError",
    "generate",
    "load",
    "preset_names",
    "save",
    "score",
]
