"""Contract C44 (ARCHITECTURE.md), the packaged decoding step (txlm.inference.packaged):
exported, compiled ahead of time by AOTInductor, kept in TXLM_HOME/packages, opened by
torch's C++ loader. It draws the eager step's tokens (sampling with the draw's random
numbers as an input, through the pruned adaptive softmax, three rows in the bucket of four);
a new decoder of the same model opens the kept package without compiling, and "auto" runs
it (and the eager step for a bucket with none kept, making none), as does one that waited on
the lock while another process made it; neither the package's making nor its opening leaves
a copy of it behind; a model of other weights has no package, and "auto" is then the eager
step."""

from __future__ import annotations

import logging
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from tests.helpers.models import debug_model
from txlm.errors import ConfigError
from txlm.inference import packaged
from txlm.inference.compiled import PACKAGE
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8, 7], [3]]  # left padding, 3 rows
SAMPLING = SamplingConfig(top_k=5)
STEPS = 60  # the debug preset's memory of 16 wraps several times
# the largest log-probability difference of a one-row package from its eager decoder: fp32,
# the same products summed in another order by the C++ template (measured 1e-6); bf16, keys
# and values rounded to bf16 in its cache where the eager one keeps float32, its weight
# products summed in float32 by fused reductions (measured 0.0049); int8, its cache in bf16
# too and the same bf16 products summed by another kernel (measured 0.0031)
TOLERANCE = {"fp32": 1e-5, "bf16": 0.03, "int8": 0.03}
PRODUCTS = {"mm", "addmm", "linear", "_weight_int8pack_mm"}  # aten's, int8's last


def _model(seed: int = 5):
    # one layer (what a package takes to compile grows with the kernels); weights far from
    # uniform (the norms drawn too): seed 5's draws reach every tail cluster
    return debug_model(seed, std=1.0, n_layer=1, vocab_size=64, cutoffs=[8, 24, 40], div_val=2)


def _cluster(token: int) -> int:
    return sum(token >= cut for cut in (8, 24, 40))


def _key(decoder: Decoder) -> str:
    return packaged.model_key(decoder._source())


def _draws(decoder: Decoder, rows: int = 3, sampling: SamplingConfig = SAMPLING) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = decoder.prefill(PROMPTS[:rows], sampling=sampling, generator=g)
    out = [ids]
    for _ in range(STEPS):
        ids = decoder.step(ids, sampling, g)
        out.append(ids)
    return torch.stack(out)


@pytest.mark.slow
def test_a_packaged_step_draws_the_eager_tokens_and_is_opened_again_without_compiling(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    want = _draws(Decoder(model))
    # every cluster drawn from: none pruned throughout
    assert {_cluster(t) for t in want.flatten().tolist()} == {0, 1, 2, 3}
    caplog.set_level(logging.INFO, logger="txlm")
    first = Decoder(model, compile="package")
    assert torch.equal(_draws(first), want)
    # the one package made said so (a command shows it: tests/cli/test_basics.py)
    notes = [r.getMessage() for r in caplog.records if r.name == packaged.__name__]
    assert len(notes) == 1
    assert notes[0].startswith("making the decoding step's package for batches of 4 row(s)")
    kept = list((tmp_path / "packages").glob("*/*.pt2"))
    assert len(kept) == 1  # one step setting, one bucket
    # inductor's own copy of the library (where it was built, the weights inside) removed
    with zipfile.ZipFile(kept[0]) as archive:
        (library,) = [Path(n).name for n in archive.namelist() if n.endswith(".wrapper.so")]
    assert list(Path(cache_dir()).glob(f"*/{library}")) == []

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    # opened again as by a new process, torch's loader extracting it under a TMPDIR of the
    # test's own (Python's temporary folder held as it is)
    monkeypatch.setattr(packaged, "_OPEN", {})
    monkeypatch.setattr(tempfile, "tempdir", tempfile.gettempdir())
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    again = Decoder(model, compile="auto")  # a kept package: auto runs it
    assert torch.equal(_draws(again), want)
    assert again.compile == PACKAGE and again.static
    # the package open, its library mapped from the extracted folder, that folder removed
    # already: a process killed now leaves no copy behind
    assert list((tmp_path / "tmp").iterdir()) == []
    assert f"{tmp_path / 'tmp'}/aotinductor_" in Path("/proc/self/maps").read_text()
    # auto never makes a package (the compiler refused above): a bucket with none kept (one
    # row) runs the eager step over the packaged step's cache, a sampling setting with none
    # (three rows) the plain eager step
    auto = Decoder(model, compile="auto")
    assert torch.equal(_draws(auto, rows=1), _draws(Decoder(model), rows=1))
    assert auto.compile == PACKAGE and auto.static
    other = SamplingConfig(top_k=3)
    assert torch.equal(_draws(auto, sampling=other), _draws(Decoder(model), sampling=other))
    assert auto.compile is None and not auto.static
    assert len(list((tmp_path / "packages").glob("*/*.pt2"))) == 1
    assert [r.getMessage() for r in caplog.records if r.name == packaged.__name__] == notes
    # a process that found no package and waited on the lock while another made it opens
    # that one (the compiler refused above): the package is put back as the lock is taken
    monkeypatch.setattr(packaged, "_OPEN", {})
    aside = kept[0].with_suffix(".aside")
    kept[0].rename(aside)
    lock = packaged._making

    def made_meanwhile(package):
        aside.rename(package)
        return lock(package)

    monkeypatch.setattr(packaged, "_making", made_meanwhile)
    assert torch.equal(_draws(Decoder(model, compile="package")), want)
    assert kept[0].is_file()
    # another model's weights: no package of its own, so auto is the eager step
    other = Decoder(_model(seed=6), compile="auto")
    assert other.compile is None and not other.static
    assert packaged.kept(other._source()) is None


def test_a_package_being_written_is_not_a_kept_one(tmp_path, monkeypatch):
    """A package's scratch file (a process compiling it now, or one killed while it did) does
    not make "auto" take the packaged step."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    where = tmp_path / "packages" / _key(Decoder(model))
    where.mkdir(parents=True)
    name = packaged.package_name(None, 1, False)  # (the log-probabilities step's)
    (where / f".{name}").write_bytes(b"")
    assert Decoder(model, compile="auto").compile is None
    (where / name).write_bytes(b"")
    assert Decoder(model, compile="auto").compile == PACKAGE


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_auto_takes_the_packaged_step_per_sampling_setting(tmp_path, monkeypatch, int8: bool):
    """ "auto" decides at each prefill: the packaged step's cache (static; bf16 for int8) for
    a sampling setting with a package kept, of any bucket, the eager step's (float32) for
    one with none, whose steps are then the plain eager decoder's."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    decoder = Decoder(model, compile="auto", int8=int8)
    assert decoder.compile is None  # (no package of this model)
    where = tmp_path / "packages" / _key(Decoder(model, compile="package", int8=int8))
    where.mkdir(parents=True)
    (where / packaged.package_name(SAMPLING, 4, True)).write_bytes(b"")  # (not opened here)
    decoder = Decoder(model, compile="auto", int8=int8)
    assert decoder.compile is None and not decoder.static  # (the log-probabilities step's)
    decoder.prefill(PROMPTS[:1], sampling=SAMPLING)
    assert decoder.compile == PACKAGE and decoder.cache.static
    assert decoder.cache.kv.dtype == (torch.bfloat16 if int8 else torch.float32)
    other = SamplingConfig(top_k=3)
    plain = Decoder(model, int8=int8)
    assert torch.equal(_draws(decoder, sampling=other), _draws(plain, sampling=other))
    assert decoder.compile is None and not decoder.cache.static
    assert decoder.cache.kv.dtype == torch.float32
    # decided once per setting: a package of it kept meanwhile changes nothing (a server's
    # caches, spliced into one batch, stay of one kind)
    (where / packaged.package_name(other, 1, False)).write_bytes(b"")
    decoder.prefill(PROMPTS[:1], sampling=other)
    assert decoder.compile is None and not decoder.cache.static


def test_a_scratch_file_left_by_a_killed_compile_is_overwritten(tmp_path, monkeypatch):
    """A package is written under one scratch name beside it (.NAME.pt2), then renamed: the
    scratch file of a compile killed before it ended is written over, not kept beside a
    second one (the compiler here a stand-in that writes a zip)."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    decoder = Decoder(_model(), compile="package")
    decoder.prefill(PROMPTS[:1])
    decoder._narrow()  # (the one-token steps' cache, as a step packages it)
    where = tmp_path / "model"
    where.mkdir()
    (where / ".step.pt2").write_bytes(b"left by a killed compile")
    written = []

    def stand_in(program, package_path, inductor_configs):
        written.append(package_path)
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("model/made.txt", "made")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", stand_in)
    state = [getattr(decoder.cache, name) for name in packaged.STATE]
    with torch.inference_mode():
        ids = torch.tensor([1])
        packaged._package(decoder._source(), None, ids, None, state, where / "step.pt2")
    assert written == [str(where / ".step.pt2")]
    assert [p.name for p in where.iterdir()] == ["step.pt2"]
    with zipfile.ZipFile(where / "step.pt2") as archive:
        assert archive.read("model/made.txt") == b"made"


def test_auto_without_kept_packages_hashes_nothing(tmp_path, monkeypatch):
    """With no package of any model kept, "auto" decides without reading the weights."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))

    def unread(source):
        raise AssertionError("weights hashed")

    monkeypatch.setattr(packaged, "model_key", unread)
    decoder = Decoder(_model(), compile="auto")
    assert decoder.compile is None


def test_a_package_is_named_by_the_weights_and_the_precision(tmp_path, monkeypatch):
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    key = _key(Decoder(model))
    assert _key(Decoder(model)) == key  # the same decoder again
    assert _key(Decoder(model, int8=True)) != key
    bias = next(p for name, p in model.named_parameters() if name.endswith("bias"))
    with torch.no_grad():
        bias[0] += 1e-3  # one entry of one bias
    assert _key(Decoder(model)) != key


def test_a_packaged_step_off_a_cpu_is_refused(monkeypatch):
    model = _model()
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device: False)  # (no meta autocast)
    with pytest.raises(ConfigError, match="runs on a CPU"):
        Decoder(model.to("meta"), compile="package")


@pytest.mark.slow
def test_a_one_row_package_draws_the_eager_tokens(tmp_path, monkeypatch):
    """One row, its float32 products through inductor's C++ template: a draw's tail clusters
    are branches in the package's code (``torch.cond``), whose products the template cannot
    take (a branch's weights are its inputs, not constants); the eager decoder's tokens, tail
    clusters drawn from and skipped."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    want = _draws(Decoder(model), rows=1)
    assert {_cluster(t) for t in want.flatten().tolist()} == {0, 1, 2, 3}
    assert torch.equal(_draws(Decoder(model, compile="package"), rows=1), want)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_one_row_package_follows_the_eager_decoder_of_its_precision(
    tmp_path, monkeypatch, precision: str
):
    """A one-row package (``packaged.options``: float32 and int8 weights through inductor's
    C++ template, bf16 ones traced as reductions read along the weights' rows); a bf16
    package reads a bf16 cache, its eager decoder a float32 one. Teacher-forced
    log-probabilities over a memory that wraps stay within the two's rounding of each other,
    and keep the float32 decoder's choice where it is clear."""
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    made = []
    real = torch._inductor.aoti_compile_and_package

    layer_products = []  # the exported step's products that read a layer's weight

    def recorded(program, **kwargs):
        made.append(dict(kwargs["inductor_configs"]))  # (a copy: torch adds its own)
        sig = program.graph_signature
        names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        for node in program.graph.nodes:
            op = str(node.target).split(".")  # e.g. aten.mm.default
            if len(op) > 1 and op[1] in PRODUCTS:
                reads = [names.get(getattr(a, "name", None), "") for a in node.args]
                layer_products.extend(r for r in reads if ".layers." in r)
        return real(program, **kwargs)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", recorded)
    # (weights of a trained model's size: _model's, drawn wide for its draws, give logits in
    # the hundreds, where bf16 moves them by whole units)
    model = debug_model(7, std=0.1, n_layer=1, vocab_size=64, cutoffs=[8, 24, 40], div_val=2)
    kw = {"fp32": {}, "bf16": {"dtype": torch.bfloat16}, "int8": {"int8": True}}[precision]
    g = torch.Generator().manual_seed(3)
    cont = torch.randint(0, 64, (STEPS,), generator=g).tolist()

    def log_probs(decoder: Decoder) -> torch.Tensor:
        rows = [decoder.prefill(PROMPTS[:1])[0]]
        rows += [decoder.step(torch.tensor([t]))[0] for t in cont[:-1]]
        return torch.stack(rows)

    packed = Decoder(model, compile="package", **kw)
    eager = Decoder(model, **kw)
    assert eager.cache_dtype == torch.float32
    assert packed.cache_dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
    got, want, full = log_probs(packed), log_probs(eager), log_probs(Decoder(model))
    assert made == [packaged.options(1, precision)]
    # float32, int8: inductor's C++ template; bf16: the layers' products traced as
    # reductions, the output layer's alone left a product
    template = made[0].get("max_autotune_gemm_backends") == "CPP"
    assert template == (precision != "bf16")
    assert (layer_products == []) == (precision == "bf16"), layer_products
    diff = (got - want).abs().max()
    assert 0 < diff < TOLERANCE[precision], diff
    clear = (full.topk(2).values[:, 0] - full.topk(2).values[:, 1]) > 0.2
    assert torch.equal(got.argmax(-1)[clear], full.argmax(-1)[clear])
