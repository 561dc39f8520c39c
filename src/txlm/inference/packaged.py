"""The decoding step compiled ahead of time: exported, packaged by AOTInductor, kept on disk.

Dimension legend
    K  the bucket's rows     N  layers     H  heads     S  cache slots     Dh  head dim
    V  vocabulary

``Decoder(compile="package")`` (``txlm generate --compile package``) runs its one-token
step from a package: ``torch.export`` of the step (the decoder's own ``_token``: the
model's forward over the static cache, the output layer, the draw), compiled by
AOTInductor (``torch._inductor.aoti_compile_and_package``) into one shared library in a
``.pt2`` file, opened by torch's C++ loader (``torch._C._aoti.AOTIModelPackageLoader``),
which needs neither the compiler nor dynamo: a later process opens a kept package in a
fraction of a second, where a ``torch.compile``d step still pays dynamo's trace of the
step (docs/performance-cpu.md, "Compiled ahead of time").

Inputs and constants. The package's inputs are the ids [K], the draw's random numbers (none
for greedy or log-probabilities) and the cache's tensors a step writes, in place, as the
eager step writes them: keys and values kv [N, 2, K, H, S, Dh], slot positions pos [S],
document ids doc [K, S] and open_doc [K], the next position next_pos []. Its constants are
the weights (in the decoder's precision) and the cache's position tables.

Kernels (``options``, ``weights_as_reductions``). The weights are frozen into the package.
A one-row step traces the attention's products (each row's query against its own keys and
values) as reductions fused with what surrounds them (txlm.inference.reductions); it
multiplies float32 and int8 weights by inductor's C++ template over packed weights, and
traces bf16 ones as reductions too, each weight read along contiguous rows. A step of more
rows runs the library's packed products. A bf16 or int8 decoder's package reads a bf16 cache
(half the bytes of keys and values).

Kept where, and under what name. ``TXLM_HOME/packages/<model>/<step>.pt2``: ``model`` a
sha256 over everything the compiled code depends on beyond its step (every weight and
buffer of the decoder's layers and head, the lengths, the precision and cache dtype, torch's
version, the CPU's vector ISA, txlm's own source), ``step`` the step's setting
(``package_name``: a digest of the sampling setting, then the bucket and whether the mask is
per row). A package is written atomically
(a scratch file, ``.<step>.pt2``, renamed into place), so a reader never sees half of one,
and made under a lock file beside it (``filelock``): of processes wanting the same package
at once (two servers started together on one checkpoint), one compiles it and the others
wait for it and open it, rather than each compiling it, in inductor's one build folder that
the first to finish removes (``_drop_build``).

When. ``compile="auto"`` (the commands' default) runs the packaged step on a CPU where this
decoder's model has a package of the sampling setting at hand kept (a run with ``--compile
package`` made it), else the eager step: a kept package opens in a fraction of a second and
measured faster than the eager step at batch 1 and 16 (docs/performance-cpu.md), so its
set-up pays back from the first tokens; making one takes tens of seconds (minutes at
wt103-base's size), which only a request for it pays. So "auto" never makes a package: a
setting with none kept runs the plain eager step (a new ``--temperature`` compiles nothing),
and a bucket with none kept of a setting with some runs the eager step over the packaged
step's cache (a server whose batch grows into a new bucket does not stall its clients while
one compiles). A decoder decides for a setting at its first prefill (``Decoder._choose``),
where some package of its model was kept as it was made. On a GPU "auto" is the eager step
replayed from a CUDA graph.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from torch import Tensor, nn

from txlm.inference.sampling import SamplingConfig
from txlm.model.cache import KVCache

STATE = ("kv", "pos", "doc", "open_doc", "next_pos")  # the cache's tensors a step writes
log = logging.getLogger(__name__)


def weights_as_reductions(precision: str) -> bool:
    """Whether a one-row package traces the weight products of ``precision`` as reductions
    fused with the layer around them (txlm.inference.reductions, ``frozen``), rather than as
    products for ``options``' kernels: bf16's, which those loops read faster than the
    library's packed bf16 product and than inductor's template, at the decoding issue's shape
    and at wt103-base's; float32's and int8's measured faster through the template
    (docs/performance-cpu.md, "The packaged step's settings")."""
    return precision == "bf16"


def options(bucket: int, precision: str) -> dict:
    """AOTInductor's settings for a step of ``bucket`` rows in ``precision``: the weights
    frozen into the package and packed for its kernels. One row multiplies float32 and int8
    weights by inductor's C++ template (vector micro-kernels over blocked weights; int8 on
    bf16 inputs), which measured faster there than the library's packed product (bf16
    weights are reductions there: ``weights_as_reductions``); more rows, by the library's
    packed product, which measured as fast as the template there and compiles for every
    bucket. Each choice is fixed, not timed as the package is made (docs/performance-cpu.md,
    "The packaged step's settings"). The template's outputs are not fused with what follows
    them: torch 2.13 fails to lower some fused views of a template's output ("wrong ndim":
    an int8 one in an adaptive softmax's tail cluster, a bf16 one), so a package could not
    be made for every model."""
    if bucket > 1 or weights_as_reductions(precision):
        return {"freezing": True}
    return {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP",
        "epilogue_fusion": False,
    }


@dataclass(frozen=True)
class Source:
    """What a decoder's packaged step is made of: its ``token`` step ((ids, noise,
    sampling) -> next ids or log-probabilities, over the cache ``cache()`` gives), the
    ``modules`` whose weights it multiplies, their ``precision`` ("fp32", "bf16", "int8"),
    and the ``setting`` beyond them that its code depends on (lengths, cache dtype)."""

    token: Callable[[Tensor, Tensor | None, SamplingConfig | None], Tensor]
    cache: Callable[[], KVCache | None]
    modules: Sequence[nn.Module]
    precision: str
    setting: tuple


def folder() -> Path:
    """Where packages are kept: TXLM_HOME/packages."""
    from txlm.checkpoints.checkpoint import home

    return home() / "packages"


def _source_digest() -> str:
    """sha256 of txlm's own source: the step's code is part of what a package holds."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def kept(source: Source) -> str | None:
    """The name of ``source``'s packages where some are kept, else None: where
    ``compile="auto"`` looks for a sampling setting's (``kept_for``)."""
    if not folder().is_dir() or not any(folder().iterdir()):
        return None  # (no package of any model: nothing to hash the weights for)
    key = model_key(source)
    where = folder() / key
    # (not a package being written: its scratch file's name starts with a dot)
    return key if where.is_dir() and any(where.glob("[!.]*.pt2")) else None


def kept_for(key: str, sampling: SamplingConfig | None) -> bool:
    """Whether a package of the step of ``sampling`` is kept under ``key``, for any bucket."""
    return any((folder() / key).glob(f"{_setting(sampling)}-*.pt2"))


def _setting(sampling: SamplingConfig | None) -> str:
    """The part of a package's name its sampling setting gives (None: log-probabilities)."""
    return hashlib.sha256(repr(sampling).encode()).hexdigest()[:16]


def package_name(sampling: SamplingConfig | None, rows: int, per_row: bool) -> str:
    """The file name of the package of the step of ``sampling`` for buckets of ``rows``, its
    mask per row or not: the setting's digest, then the bucket."""
    return f"{_setting(sampling)}-{rows}{'-per-row' if per_row else ''}.pt2"


def model_key(source: Source) -> str:
    """The digest naming a decoder's packages (see the module docstring)."""
    h = hashlib.sha256()
    for module in source.modules:
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    h.update(f"{source.precision}:{source.setting!r}:{torch.__version__}".encode())
    h.update(str(torch.backends.cpu.get_cpu_capability()).encode())
    h.update(_source_digest().encode())
    return h.hexdigest()[:32]


class _Step(nn.Module):
    """The step as a module of the cache's tensors: the cache's tensors are the given ones
    for the call (what torch.export traces)."""

    def __init__(self, source: Source, sampling: SamplingConfig | None) -> None:
        super().__init__()
        self.held = nn.ModuleList(source.modules)  # (their weights: the constants)
        self.source, self.sampling = source, sampling

    def forward(self, ids: Tensor, noise: Tensor | None, *state: Tensor) -> Tensor:
        cache = self.source.cache()
        held = [getattr(cache, name) for name in STATE]
        for name, t in zip(STATE, state, strict=True):
            setattr(cache, name, t)
        try:
            return self.source.token(ids, noise, self.sampling)
        finally:
            for name, t in zip(STATE, held, strict=True):
                setattr(cache, name, t)


# the packages opened in this process, by path: each opened once (its constants loaded once)
_OPEN: dict[Path, torch._C._aoti.AOTIModelPackageLoader] = {}


def packaged(
    source: Source, key: str, sampling: SamplingConfig | None, make: bool = True
) -> Callable[..., Tensor]:
    """The step of ``sampling`` run from the packages named ``key``, one per bucket: ids [K]
    (+ noise) -> the next ids [K], or log-probabilities [K, V]. A package not yet kept is
    made at its bucket's first step (exported from the cache as it is then) and kept, or
    with ``make`` False (``compile="auto"``) that bucket's step runs eagerly."""
    where = folder() / key
    # (K, per row) -> its package's loader, or None: the eager step
    loaders: dict[tuple[int, bool], torch._C._aoti.AOTIModelPackageLoader | None] = {}

    def run(ids: Tensor, noise: Tensor | None = None) -> Tensor:
        cache = source.cache()
        assert cache is not None
        state = [getattr(cache, name) for name in STATE]
        bucket = (ids.size(0), cache.per_row)
        if bucket not in loaders:  # (a bucket's first step here: named, opened, made if asked)
            path = where / package_name(sampling, ids.size(0), cache.per_row)
            loader = _OPEN.get(path)
            if loader is None and (make or path.is_file()):
                if not path.is_file():
                    with _making(path):
                        if not path.is_file():  # (else made while this process waited)
                            _package(source, sampling, ids, noise, state, path)
                loader = _OPEN[path] = _open(path)
            loaders[bucket] = loader
        loader = loaders[bucket]
        if loader is None:
            return source.token(ids, noise, sampling)
        (out,) = loader.run([ids, *([] if noise is None else [noise]), *state])
        return out

    return run


def _making(package: Path) -> FileLock:
    """The lock held while ``package`` is made, across processes and threads (an advisory
    ``flock`` on a file beside it, which the system releases if its holder dies)."""
    package.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(package.with_suffix(".lock"))


def _open(path: Path) -> torch._C._aoti.AOTIModelPackageLoader:
    """The loader of the package at ``path``, its extracted files already removed.

    torch's loader extracts a package (its library, the weights frozen inside it) into a
    folder under TMPDIR, which it removes only when it is freed: a process killed with a
    package open leaves that copy behind (gigabytes at wt103-base). Once the loader has
    mapped the library nothing reads those files again, and on Linux a mapping outlives its
    file, so the folder is removed at once: the folders whose library this process mapped
    in this call."""
    before = _mapped_extractions()
    loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    for folder in _mapped_extractions() - before:
        shutil.rmtree(folder, ignore_errors=True)
    return loader


def _mapped_extractions() -> set[Path]:
    """The loader's extraction folders (``<TMPDIR>/aotinductor_*``) whose files this process
    has mapped, read from /proc/self/maps (none where there is no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    found = set()
    for line in maps.splitlines():
        file = Path(line.split(maxsplit=5)[-1])
        for parent in file.parents:  # (the nearest: the folder the loader made)
            if parent.name.startswith("aotinductor_"):
                found.add(parent)
                break
    return found


def _package(
    source: Source,
    sampling: SamplingConfig | None,
    ids: Tensor,
    noise: Tensor | None,
    state: list[Tensor],
    path: Path,
) -> None:
    """Export the step over copies of the cache's tensors and package it at ``path``."""
    log.info(
        "making the decoding step's package for batches of %d row(s), once (it is kept in %s)",
        ids.size(0), path.parent,
    )  # fmt: skip
    with torch.inference_mode(False), torch.no_grad():
        copies = [t.clone() for t in state]  # (ordinary tensors: export writes into them)
        args = (ids.clone(), None if noise is None else noise.clone(), *copies)
        program = torch.export.export(_Step(source, sampling), args, strict=False)
    # One name per package, not a fresh one: its lock held, one process writes it at a time,
    # so a scratch file a killed compile left is overwritten by the next, not kept beside
    # it (gigabytes at wt103-base). It ends in .pt2, AOTInductor's rule.
    scratch = path.with_name(f".{path.name}")
    try:
        with warnings.catch_warnings():  # (torch's own, from inside its packaging)
            warnings.filterwarnings("ignore", r".*LeafSpec.* is deprecated", FutureWarning)
            warnings.filterwarnings("ignore", r"TypedStorage is deprecated", UserWarning)
            torch._inductor.aoti_compile_and_package(
                program,
                package_path=str(scratch),
                inductor_configs=options(ids.size(0), source.precision),
            )
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    _drop_build(path)


def _drop_build(package: Path) -> None:
    """Remove the folder in inductor's cache where the library of ``package`` was built: a
    copy of it, the weights frozen inside, which nothing reads once the package holds it
    (a package made again is compiled again) and which doubled the disk a package takes."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # (the compiler's: here only)

    with zipfile.ZipFile(package) as archive:
        names = [Path(n).name for n in archive.namelist() if n.endswith(".wrapper.so")]
    for name in names:
        for built in Path(cache_dir()).glob(f"*/{name}"):
            shutil.rmtree(built.parent, ignore_errors=True)
