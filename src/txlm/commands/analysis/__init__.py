"""The paper's analysis tools on the command line, one module per subcommand.

    txlm bench eval-speed   Table 9: per-token evaluation time, Transformer-XL vs vanilla
    txlm bench memory       does the memory work? Table 6's variants on the recall task,
                            copy accuracy against distance at 1x, 2x, 4x training memory
    txlm recl               Appendix C: relative effective context length of a model group
    txlm attention          Appendix D: attention over relative distance, per head and term
    txlm ablate             Table 6 on data we have: encodings x recurrence, equal budget

Each prints a table, or one JSON object with ``--json``, and writes PNG figures to
``--out-dir`` (default: no figures). Shared options and output: common.py.
"""

from __future__ import annotations

import argparse

from txlm.commands.analysis import ablate, attention, eval_speed, memory, recl


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: evaluation speed (paper Table 9), does the memory work",
        description="Benchmarks. eval-speed: the paper's Table 9. memory: copy accuracy "
        "against distance on the recall task.",
    )
    bench_sub = bench.add_subparsers(dest="what", metavar="WHAT", parser_class=type(bench))
    bench_sub.required = True
    eval_speed.register(bench_sub)
    memory.register(bench_sub)
    attention.register(subparsers)
    recl.register(subparsers)
    ablate.register(subparsers)
