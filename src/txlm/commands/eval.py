"""``txlm eval CKPT``: stream a split through a checkpoint with memory, report the metric.

The split is cut into --batch-size contiguous rows (1: one stream, memory empty only at its
very start; default: the batch size the run evaluated with, so the numbers agree with the
run's); each row carries its memory across segments. --mem-len may exceed the
training memory: the relative encoding has no absolute positions to run out of.
"""

from __future__ import annotations

import argparse
import json
import sys

from txlm.commands import eval_file
from txlm.commands.options import add_device_options, apply_threads, use_precision
from txlm.devices import resolve_device


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint on a split (loss, bpc or perplexity, tokens/s)",
        description="Evaluate a checkpoint on its dataset's split, memory carried across segments.",
    )
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (e.g. runs/x/best)")
    p.add_argument(
        "--split", default="test", choices=["train", "valid", "test"], help="default test"
    )
    # each length's default: the one the run evaluated with, else the model's (Checkpoint.lengths)
    p.add_argument("--tgt-len", type=int, default=None, help="segment length (default: the run's)")
    p.add_argument("--mem-len", type=int, default=None, help="memory length (default: the run's)")
    p.add_argument("--clamp-len", type=int, default=None, help="clamp relative distances (-1: off)")
    p.add_argument(
        "--same-length", action=argparse.BooleanOptionalAction, default=None,
        help="every query sees the same number of keys (default: the run's)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=int, default=None,
        help="contiguous rows, each with memory empty at its start "
        "(default: the run's eval.batch_size, else 1)",
    )  # fmt: skip
    p.add_argument("--max-steps", type=int, default=None, help="stop after N segments")
    p.add_argument(
        "--dataset", default=None,
        help="dataset name (default: the one the checkpoint records, found from any directory)",
    )  # fmt: skip
    p.add_argument(
        "--data-dir", default=None,
        help="default: $TXLM_DATA_DIR or ./data when it holds the checkpoint's corpus, else "
        "the folder it was prepared in",
    )  # fmt: skip
    add_device_options(p, precision=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--kv-cache", action="store_true",
        help="keep the memory's projected keys/values between segments (faster, same numbers)",
    )  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help="torch.compile the forward (a one-off compile time; pays on long runs and GPUs)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    eval_file.add_arguments(p)
    p.set_defaults(func=run)


def _note(message: str) -> None:
    print(message, file=sys.stderr)


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    from txlm.errors import ConfigError

    if value is not None and value < minimum:
        raise ConfigError(f"--{name} must be >= {minimum}, got {value}")


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    if args.file is not None:  # any text file instead of a prepared split
        return eval_file.run(args)

    from txlm import resources
    from txlm.checkpoints.checkpoint import Checkpoint
    from txlm.checkpoints.dataset import dataset_of
    from txlm.data import open_corpus
    from txlm.errors import CheckpointError
    from txlm.inference.evaluate import evaluate_tokens

    _positive("tgt-len", args.tgt_len)
    _positive("mem-len", args.mem_len, 0)
    _positive("batch-size", args.batch_size)
    _positive("max-steps", args.max_steps)
    device = resolve_device(args.device)
    use_precision(args.precision, device)

    ckpt = Checkpoint.open(args.checkpoint)
    if ckpt.data.get("task") == "classify":  # accuracy, per-class scores: eval_classifier
        from txlm.commands import eval_classifier

        return eval_classifier.run(args, ckpt)
    train = ckpt.train_config or {}
    ref = dataset_of(ckpt, dataset=args.dataset, data_dir=args.data_dir)
    if ref is None:
        raise CheckpointError(f"{ckpt.path} does not name its dataset: pass --dataset")
    dataset = ref.name
    fingerprint = ckpt.vocab_fingerprint
    if fingerprint is None:
        raise CheckpointError(
            f"{ckpt.path} records no vocabulary (no vocab.json, no fingerprint): nothing says "
            f"its token ids are those of {dataset}"
        )
    lengths = ckpt.lengths(args.tgt_len, args.mem_len, args.clamp_len, args.same_length)
    # a bar on a terminal, a line per tenth in a log (stderr); --json: stdout's one object
    show = not args.no_progress and not args.json
    corpus = open_corpus(
        ref.source,
        ref.data_dir,
        level=ref.level,
        vocab=ref.vocab,  # a fine-tune's corpus: encoded with the checkpoint's vocabulary
        lower_case=ref.lower_case,
        fingerprint=fingerprint,
        owner=str(ckpt.path),
        log=_note,  # on stderr, so --json output stays one object
        progress=show and sys.stderr.isatty(),
    )
    model = ckpt.load_model(device, task="lm")
    recorded_rows = (train.get("eval") or {}).get("batch_size")
    batch_size = args.batch_size or recorded_rows or 1
    # A memory or cache that cannot fit is refused before it is allocated (a lower bound,
    # txlm.resources); the loaded weights are already taken from what is available.
    tokens = corpus.split(args.split)
    resources.check_evaluation(
        ckpt.model_config, device, weights=0, rows=min(batch_size, max(len(tokens) - 1, 1)),
        tgt_len=lengths.tgt_len, mem_len=lengths.mem_len,
        precision=args.precision, kv_cache=args.kv_cache,
    )  # fmt: skip
    result = evaluate_tokens(
        model,
        tokens,
        batch_size=batch_size,
        lengths=lengths,
        max_steps=args.max_steps,
        precision=args.precision,
        metric=corpus.metric,
        tokens_per_byte=corpus.tokens_per_byte(args.split),
        progress=show,
        desc=args.split,
        kv_cache=args.kv_cache,
        compile=args.compile,
    )
    result.update(checkpoint=str(ckpt.path), split=args.split, dataset=dataset)
    if corpus.vocab.unk is not None:
        result["unk_tokens"] = corpus.unk_tokens(args.split)
    if args.json:
        print(json.dumps(result))
    else:
        from txlm.commands.eval_file import summary_line

        unk = result.get("unk_tokens")
        note = f", <unk> {unk:,} tokens in the split" if unk is not None else ""
        print(f"{args.split}: {summary_line(result)}{note}")
    return 0
