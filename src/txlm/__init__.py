"""txlm: Transformer-XL language models."""

__version__ = "0.1.0"
