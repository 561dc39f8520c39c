"""Reading checkpoints: a directory of JSON and safetensors files (``txlm.checkpoints.files``:
the files, and ``save``, which writes one atomically). No pickle.

A checkpoint is written with ``txlm.atomic.directory``: filled in a temp directory beside it
and swapped into place, so at every instant the old or the new checkpoint is whole on disk;
``resolve`` reads ``NAME.old`` after a crash between the two renames of the swap.

Reading goes through ``Checkpoint.open``: the directory resolved once, config.json parsed
once, and the model, its vocabulary and its evaluation lengths all from that one copy:

    ckpt = Checkpoint.open("runs/shakespeare-char/best")
    model, vocab = ckpt.load_model("cpu"), ckpt.vocab()
    lengths = ckpt.lengths(mem_len=512)     # the run's evaluation lengths, one changed
    Checkpoint.open("transfo-xl/transfo-xl-wt103")  # a Hub repository, converted once

A checkpoint holds a language model (``task`` "lm": ``TransformerXL``'s tensors) or a
document classifier (``task`` "classify", written by ``txlm train --task classify``: its
config.json adds a ``classifier`` section, the labels in id order, the pooling; its weights
are ``body.*``, the language model's tensors, and ``head.*``). ``load_model`` builds either
through the one weights reader: the header's shapes checked against config.json before any
tensor is allocated, every file read from the copy that was opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model

from txlm import atomic, devices
from txlm.checkpoints.files import (
    BUILD_DIRECTLY_BELOW,
    CONFIG_FILE,
    FORMAT,
    FORMAT_VERSION,
    TOKENIZER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    ensure_writable,
    estimate_checkpoint_bytes,
    rough_parameter_count,
    save,
)
from txlm.classify.classifier import Classifier, ClassifierConfig
from txlm.config import ModelConfig
from txlm.data.vocab import Vocab, check_fingerprint
from txlm.errors import CheckpointError, ConfigError, DataError
from txlm.model import TransformerXL
from txlm.model.align import Stored
from txlm.model.lengths import Lengths

M = TypeVar("M", bound=torch.nn.Module)

# what the package reaches through this module: the files' names and the writers with them
__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "TOKENIZER_FILE",
    "VOCAB_FILE",
    "WEIGHTS_FILE",
    "Checkpoint",
    "ensure_writable",
    "estimate_checkpoint_bytes",
    "fill_weights",
    "home",
    "hub_checkpoint",
    "load",
    "load_classifier",
    "load_vocab",
    "read_config",
    "resolve",
    "save",
]

TASKS = ("lm", "classify")  # config.json's "task": what the weights are (absent: "lm")
# what a Hub repository id (org/name) looks like: a relative path of exactly two parts
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(path: str | Path) -> Path:
    """The checkpoint directory to read: ``path``, or ``path.old`` after an interrupted swap;
    a Hugging Face repository id (``org/name``) that names no folder: its conversion in
    ``TXLM_HOME`` (``hub_checkpoint``)."""
    path = atomic.resolve(path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a checkpoint directory")
    if _HUB_NAME.match(str(path)):
        return hub_checkpoint(str(path))
    raise CheckpointError(f"checkpoint {path} does not exist")


def home() -> Path:
    """Where txlm keeps what it makes for its user: ``TXLM_HOME``, else ``txlm`` in the
    user's cache directory (``XDG_CACHE_HOME``, default ``~/.cache``)."""
    if os.environ.get("TXLM_HOME"):
        return Path(os.environ["TXLM_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "txlm"


def hub_checkpoint(repo_id: str) -> Path:
    """The txlm checkpoint of the Hugging Face repository ``repo_id``: converted once, on
    first use, into ``home()/hub/ORG--NAME`` and read from there afterwards (no network).
    The repository's files come through ``txlm.checkpoints.hub`` (its cache, HF_ENDPOINT,
    HF_HUB_OFFLINE); the conversion is ``txlm convert --from hf``'s, written atomically."""
    folder = home() / "hub" / repo_id.replace("/", "--")
    found = atomic.resolve(folder)
    if found.is_dir():
        return found
    from txlm.checkpoints import hub
    from txlm.checkpoints.convert import convert_hf

    try:
        source = hub.download(repo_id, progress=False)
    except CheckpointError:
        if not hub.offline():
            raise
        raise CheckpointError(
            f"checkpoint {repo_id} does not exist, and as a Hugging Face repository it is "
            f"neither converted in {folder} nor cached (HF_HUB_OFFLINE is set): convert a "
            f"local copy of it with txlm convert --from hf DIR --out {folder}"
        ) from None
    convert_hf(source, folder, source=f"hf-hub:{repo_id}")
    return folder


def _parse_config(directory: Path) -> dict[str, Any]:
    """config.json of ``directory``, parsed and checked to be a txlm checkpoint's."""
    path = directory / CONFIG_FILE
    try:
        text = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(
            f"{directory} has no {CONFIG_FILE}: not a txlm checkpoint{_run_folder_hint(directory)}"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is not a txlm checkpoint config (foreign checkpoints: txlm convert)"
        )
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {data.get('format_version')!r}; "
            f"this txlm reads version {FORMAT_VERSION}"
        )
    return data


def _run_folder_hint(directory: Path) -> str:
    """``txlm train --out`` folders hold their checkpoints in ``best`` and ``last``."""
    inside = [n for n in ("best", "last") if (directory / n / CONFIG_FILE).is_file()]
    if not inside:
        return ""
    return f" (a run folder: did you mean {directory / inside[0]}?)"


def _identity(directory: Path) -> tuple[int, int] | None:
    """Which directory ``directory`` names now (device, inode); None when it names none."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# train.eval's keys (txlm.training.config.EvalConfig) for each of Lengths' fields
_EVAL_KEYS = {
    "tgt_len": "eval_tgt_len",
    "mem_len": "eval_mem_len",
    "clamp_len": "eval_clamp_len",
    "same_length": "same_length",
}


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """One checkpoint directory, opened once.

    ``open`` picks NAME or NAME.old once and parses config.json once; every later read
    (``vocab``, ``load_model``, ``weights_sha256``) takes its file from that same directory.
    An atomic save over NAME moves the opened copy aside and deletes it, so a read that finds
    another directory at ``path`` than the one opened raises ``CheckpointError`` instead of
    mixing the configuration of one copy with the weights or vocabulary of another.
    """

    path: Path  # the resolved directory: NAME, or NAME.old after an interrupted swap
    data: dict[str, Any]  # config.json as parsed
    model_config: ModelConfig  # the language model's, a classifier's body's
    has_vocab: bool  # vocab.json present when opened
    task: str  # "lm" or "classify"
    classifier: ClassifierConfig | None  # a classifier's labels and pooling
    _identity: tuple[int, int] | None = field(repr=False)
    _recorded: Lengths = field(repr=False)  # the lengths the run evaluated with, else the model's
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Open the checkpoint at ``path``; ``CheckpointError`` (one line) if it is not one."""
        directory = resolve(path)
        identity = _identity(directory)
        data = _parse_config(directory)
        config_file = directory / CONFIG_FILE
        try:
            config = ModelConfig.from_dict(data.get("model"))  # type: ignore[arg-type]
        except ConfigError as exc:
            raise CheckpointError(f"{config_file}: {exc}") from None
        train = data.get("train")
        saved = train.get("eval") if isinstance(train, dict) else None
        saved = saved if isinstance(saved, dict) else {}
        try:
            recorded = Lengths.of(config, **{f: saved.get(k) for f, k in _EVAL_KEYS.items()})
        except ConfigError as exc:
            raise CheckpointError(f"{config_file}: train.eval: {exc}") from None
        task = data.get("task", "lm")
        if task not in TASKS:
            raise CheckpointError(f"{config_file}: task {task!r} is none of {', '.join(TASKS)}")
        classifier = None
        if task == "classify":
            try:
                classifier = ClassifierConfig.from_dict(data.get("classifier"))  # type: ignore[arg-type]
            except (ConfigError, TypeError) as exc:
                raise CheckpointError(f"{config_file}: {exc}") from None
        ckpt = cls(
            path=directory,
            data=data,
            model_config=config,
            has_vocab=(directory / VOCAB_FILE).is_file(),
            task=task,
            classifier=classifier,
            _identity=identity,
            _recorded=recorded,
        )
        ckpt._unchanged()  # config.json came from the directory identified above
        return ckpt

    @property
    def train_config(self) -> dict[str, Any] | None:
        """The saved "train" section (the run's TrainConfig as written), None without one."""
        train = self.data.get("train")
        return train if isinstance(train, dict) else None

    def lengths(
        self,
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
    ) -> Lengths:
        """The lengths to read text with: each one given (not None), else the one the run
        evaluated with (``train.eval`` in config.json), else the model's. The one place
        where ``txlm eval``, ``eval --file`` and ``generate`` choose their lengths."""
        return self._recorded.replace(
            tgt_len=tgt_len, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length
        )

    @property
    def vocab_fingerprint(self) -> str | None:
        """The fingerprint of the vocabulary the model was trained with: the one config.json
        records, else its vocab.json's; None when it has neither (converted weights without
        a vocabulary)."""
        recorded = self.data.get("vocab_fingerprint")
        if recorded is not None or not self.has_vocab:
            return recorded
        return self.vocab().fingerprint

    def vocab(self) -> Vocab:
        """The vocabulary saved with the checkpoint, read once: vocab.json (and a bpe
        vocabulary's tokenizer.json) must give the fingerprint config.json records and as
        many symbols as the model has. The one reader of a checkpoint's vocabulary."""
        if "vocab" not in self._cache:
            self._cache["vocab"] = self._read_vocab()
        return self._cache["vocab"]

    def _read_vocab(self) -> Vocab:
        path = self.path / VOCAB_FILE
        if not self.has_vocab:
            raise CheckpointError(f"{self.path} has no {VOCAB_FILE}: cannot encode text")
        with self._reading():
            try:
                vocab = Vocab.load(path)
            except DataError as exc:  # the checkpoint is what is damaged, not a dataset
                raise CheckpointError(str(exc)) from None
        what = TOKENIZER_FILE if vocab.level == "bpe" else VOCAB_FILE
        check_fingerprint(
            vocab,
            self.data.get("vocab_fingerprint"),
            what=str(self.path / what),
            against="the checkpoint's config.json",
            error=CheckpointError,
        )
        if len(vocab) != self.model_config.vocab_size:
            raise CheckpointError(
                f"{path} has {len(vocab)} symbols but the model {self.model_config.vocab_size}"
            )
        return vocab

    def load_model(
        self,
        device: str | torch.device = "cpu",
        align_heads: bool | str = "auto",
        *,
        task: str | None = None,
    ) -> Any:
        """A new model in eval mode with the checkpoint's weights: a ``TransformerXL``, or a
        ``Classifier`` (its vocabulary, when the checkpoint has one, as ``.vocab``).
        ``task``: the kind the caller needs ("lm", "classify"; None: either), another one
        refused in one line. ``align_heads``: store the heads, widths and keys padded to
        multiples of 8 (``txlm.model.align``; auto: on CUDA, where it pays)."""
        if task is not None and task != self.task:
            raise CheckpointError(_WRONG_TASK[task].format(path=self.path, task=self.task))
        aligned = devices.wanted(align_heads, device)
        stored = Stored.aligned(self.model_config) if aligned else None
        if self.classifier is None:
            with self._reading():
                return _load_weights(self.path, self.model_config, device, stored).eval()
        with self._reading():
            model = _load_weights(
                self.path, self.model_config, device, stored, classifier=self.classifier
            )
        model.vocab = self.vocab() if self.has_vocab else None
        return model.eval()

    def weights_sha256(self) -> str:
        """The hex SHA-256 of model.safetensors (identifies the weights, whatever the path)."""
        if "sha256" not in self._cache:
            weights = self.path / WEIGHTS_FILE
            with self._reading():
                try:
                    with open(weights, "rb") as f:
                        digest = hashlib.file_digest(f, "sha256").hexdigest()
                except OSError as exc:
                    raise CheckpointError(f"cannot read {weights}: {exc.strerror or exc}") from None
            self._cache["sha256"] = digest
        return self._cache["sha256"]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Around a read of the checkpoint's files: the directory at ``path`` is the one opened
        before and after it, so what was read came from that copy. A file that a save over it
        removed mid-read is reported as the save, not as a damaged checkpoint."""
        self._unchanged()
        try:
            yield
        except CheckpointError:
            self._unchanged()
            raise
        self._unchanged()

    def _unchanged(self) -> None:
        """Refuse to read on when ``path`` no longer names the directory that was opened."""
        if _identity(self.path) != self._identity:
            raise CheckpointError(
                f"{self.path} was moved or replaced after it was opened (a save over it?): "
                "open it again"
            )


# what ``load_model(task=...)`` says when the checkpoint holds the other kind of model
_WRONG_TASK = {
    "lm": "{path} is a {task} checkpoint, not a language model: use txlm classify or "
    "txlm.load_classifier",
    "classify": "{path} is a language model, not a classifier: train one with txlm train "
    "--init {path} --task classify",
}


def _header_shapes(weights: Path, config: ModelConfig, prefix: str = "") -> dict[str, list[int]]:
    """Tensor shapes from the weights file's header (no tensor data is read).

    Also checks the layer count against config.json before any model is built: a config
    claiming a million layers must not cost a million module constructions to refuse.
    ``prefix``: where the language model's tensors are (a classifier's body: "body.").
    """
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file: {str(exc).splitlines()[0]}"
        ) from None
    start = prefix + "layers."
    layers = {k[len(start) :].split(".")[0] for k in shapes if k.startswith(start)}
    if len(layers) != config.n_layer:
        raise CheckpointError(
            f"{weights} does not match its config.json: it holds {len(layers)} layers, "
            f"the config says n_layer={config.n_layer}"
        )
    return shapes


def _check_shapes(weights: Path, shapes: dict[str, list[int]], model: torch.nn.Module) -> None:
    """Compare the header's shapes with the model (on the meta device: still unallocated).

    config.json decides how much memory ``to_empty`` allocates; a config that claims a huge
    vocabulary or width next to a small weights file must be refused here, from the header
    alone, not by exhausting memory. Missing/unexpected tensors are reported after loading.
    """
    wanted = model.state_dict()
    for key, shape in sorted(shapes.items()):
        if key in wanted and list(wanted[key].shape) != shape:
            raise CheckpointError(
                f"{weights} does not match its config.json: {key} has shape {shape}, "
                f"the config needs {list(wanted[key].shape)}"
            )


def _load_weights(
    directory: Path,
    config: ModelConfig,
    device: str | torch.device,
    stored: Stored | None = None,
    *,
    classifier: ClassifierConfig | None = None,
) -> Any:
    """``config``'s model, stored with ``stored`` (txlm.model.align), with the weights of
    ``directory``, checked against the header first; ``classifier``: that classifier with
    ``config``'s model as its body."""
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS_FILE}")
    shapes = _header_shapes(weights, config, prefix="" if classifier is None else "body.")

    def build() -> Any:
        body = TransformerXL(config, stored)
        return body if classifier is None else Classifier(body, classifier)

    if rough_parameter_count(config) <= BUILD_DIRECTLY_BELOW:
        # A small model is cheaper to build for real (its random init is quick) than on the
        # meta device, whose first use imports torch's Python reference kernels, a start-up
        # cost every `txlm eval/generate` would pay. fork_rng: loading must not advance the
        # caller's random stream (a resumed run restores its own RNG state afterwards).
        with torch.random.fork_rng(devices=[]):
            model = build()
        _check_shapes(weights, shapes, model)
        model = model.to(device)
    else:
        with torch.device("meta"):
            model = build()
        _check_shapes(weights, shapes, model)  # before allocating what config.json claims
        model = model.to_empty(device=device)
        (model if classifier is None else model.body).tie_weights()
    return fill_weights(model, weights, device)


def fill_weights(model: M, weights: Path, device: str | torch.device) -> M:
    """``model`` with every tensor read from the safetensors file ``weights`` (on ``device``);
    a file that is unreadable, or holds other tensors than the model, is one CheckpointError."""
    try:
        missing, unexpected = load_model(model, str(weights), strict=False, device=str(device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(
            f"{weights} is unreadable or does not fit its config: {str(exc).splitlines()[0]}"
        ) from None
    if missing or unexpected:
        detail = ", ".join(sorted(missing)[:3] or sorted(unexpected)[:3])
        raise CheckpointError(
            f"{weights} does not match its config.json "
            f"({len(missing)} missing, {len(unexpected)} unexpected tensors: {detail})"
        )
    return model


# -- the public one-liners, each one Checkpoint.open -----------------------------------------


def load(
    directory: str | Path, *, device: str | torch.device = "cpu", align_heads: bool | str = "auto"
) -> TransformerXL:
    """A language model in eval mode from a checkpoint directory (``Checkpoint.load_model``;
    a classifier's is refused: ``load_classifier``)."""
    return Checkpoint.open(directory).load_model(device, align_heads, task="lm")


def load_classifier(directory: str | Path, *, device: str | torch.device = "cpu") -> Classifier:
    """A classifier in eval mode from a checkpoint directory, with its vocabulary (when the
    checkpoint has one) as ``.vocab`` (``Checkpoint.load_model``; a language model's is
    refused)."""
    return Checkpoint.open(directory).load_model(device, align_heads=False, task="classify")


def load_vocab(directory: str | Path) -> Vocab:
    """The vocabulary saved with a checkpoint, checked against it (``Checkpoint.vocab``);
    ``CheckpointError`` when it has none."""
    return Checkpoint.open(directory).vocab()


def read_config(directory: str | Path) -> dict[str, Any]:
    """The parsed config.json of a txlm checkpoint, checked to be ours (``Checkpoint.data``)."""
    return Checkpoint.open(directory).data
