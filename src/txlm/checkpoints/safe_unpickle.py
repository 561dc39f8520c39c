"""A restricted reader for legacy pickled vocabularies (``vocab.bin`` / ``vocab.pkl``).

Unpickling runs whatever callables the file names: a pickle is a program, not data. That is
why Hugging Face deprecated TransfoXL, whose tokenizer stores its vocabulary as a pickled
``__dict__``. txlm never writes pickles; to *import* such a vocabulary it runs the pickle
program with a global table that holds only plain containers and scalars:

    dict, list, tuple, set, frozenset, OrderedDict, Counter, str, int, float, bool

(Not ``bytes``: a vocabulary holds none, and ``bytes(2**62)`` asks for an exabyte. None of
the callables left allocates in proportion to an int argument; a MemoryError or
OverflowError from a crafted file is still reported as a CheckpointError.)

(None, True, False, numbers, strings, lists, tuples and dicts need no global at all.) Any
other global (``os.system``, ``builtins.eval``, a class whose ``__reduce__`` would run code,
``re._compile``, ...) is refused *before* it is looked up, so nothing it names is imported or
called. Persistent ids (torch tensor storages) are refused too: a vocabulary has none.

Three container layouts are accepted, the ones TransfoXL vocabularies were written in:
- a plain pickle (``TransfoXLTokenizer.save_vocabulary``'s ``vocab.pkl``);
- legacy ``torch.save`` (the published ``vocab.bin``): a run of pickles, magic number,
  protocol, system info, then the object;
- zip ``torch.save`` (torch >= 1.6): the object in ``<archive>/data.pkl``.
"""

from __future__ import annotations

import io

# The one sanctioned use of the pickle module in src/: its Unpickler is subclassed below so
# that ``find_class`` admits only the plain containers listed above. Nothing here calls
# pickle.load / pickle.loads, whose unrestricted global lookup is exactly what we avoid.
import pickle as _pickle  # restricted loader only
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from txlm.errors import CheckpointError

# (module, name) -> the object the pickle may reference. Names outside this table are refused.
# No ``bytes``: its int argument is a size (``bytes(2**62)``), a memory bomb in a 30-byte file.
_PLAIN_BUILTINS = (dict, list, tuple, set, frozenset, str, int, float, bool)
_ALLOWED: dict[tuple[str, str], Any] = {
    # Protocols 0-2 spell builtins the Python 2 way (__builtin__), also when Python 3 writes.
    **{(module, t.__name__): t for t in _PLAIN_BUILTINS for module in ("builtins", "__builtin__")},
    ("__builtin__", "unicode"): str,
    ("collections", "OrderedDict"): OrderedDict,
    ("collections", "Counter"): Counter,
}

# First object of a legacy torch.save file (torch/serialization.py's MAGIC_NUMBER).
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


class RefusedPickleError(CheckpointError):
    """A pickle asked for something other than plain containers."""


class RestrictedUnpickler(_pickle.Unpickler):
    """An Unpickler whose global table is ``_ALLOWED`` and nothing else."""

    def __init__(self, file: io.BufferedIOBase, *, source: str = "pickle") -> None:
        super().__init__(file, encoding="utf-8")
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise RefusedPickleError(
                f"{self._source}: refused to load global {module}.{name} "
                "(only plain containers are read from pickled files)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickleError(
            f"{self._source}: refused a persistent reference (tensor storage?) in a vocabulary"
        )


def _load_one(stream: io.BufferedIOBase, source: str) -> Any:
    try:
        return RestrictedUnpickler(stream, source=source).load()
    except RefusedPickleError:
        raise
    except (_pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as exc:
        # TypeError/ValueError: an allowed constructor called with odd arguments.
        raise CheckpointError(f"{source}: not a readable pickle ({exc})") from None
    except (MemoryError, OverflowError, RecursionError) as exc:
        # A crafted file asking for more than it holds (a huge size, deep nesting).
        raise CheckpointError(
            f"{source}: refused a pickle that asks for too much memory or depth "
            f"({type(exc).__name__})"
        ) from None


def restricted_loads(data: bytes, *, source: str = "pickle") -> Any:
    """Decode pickled bytes, refusing every global but plain containers."""
    return _load_one(io.BytesIO(data), source)


def load_pickled_object(path: str | Path) -> Any:
    """The object stored in ``path``: a plain pickle or a (legacy or zip) ``torch.save``."""
    path = Path(path)
    source = str(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None

    if zipfile.is_zipfile(io.BytesIO(raw)):
        with zipfile.ZipFile(io.BytesIO(raw)) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise CheckpointError(f"{path}: a zip file without one data.pkl (not torch.save)")
            return restricted_loads(zf.read(names[0]), source=f"{source}:{names[0]}")

    stream = io.BytesIO(raw)
    first = _load_one(stream, source)
    if isinstance(first, int) and not isinstance(first, bool) and first == _TORCH_LEGACY_MAGIC:
        _load_one(stream, source)  # protocol version
        _load_one(stream, source)  # system info (endianness, type sizes)
        return _load_one(stream, source)
    return first
