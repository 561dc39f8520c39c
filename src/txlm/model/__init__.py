"""The Transformer-XL model: attention, memory, adaptive embeddings and softmax."""

from txlm.model.attention import RelativeAttention, rel_shift
from txlm.model.transformer import DecoderLayer, TransformerXL, TransformerXLOutput

__all__ = ["DecoderLayer", "RelativeAttention", "TransformerXL", "TransformerXLOutput", "rel_shift"]
