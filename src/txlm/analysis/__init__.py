"""The paper's analysis tools, one concept per module.

- ``speed``: evaluation speed, Transformer-XL with memory vs the vanilla Transformer (Table 9)
- ``recl``: relative effective context length of a model group (Sec. 4.3, Appendix C)
- ``attention_maps``: attention over relative distance per head and per term (Appendix D)
- ``ablation``: the recurrence x positional-encoding ablation on a small corpus (Table 6)

Each exposes pure functions returning dataclasses, ``format_table`` and ``plot_*`` functions
(PNG, matplotlib's Agg backend). The command line is ``txlm.commands.analysis``.
"""
