"""Contract C44 (ARCHITECTURE.md), the packaged decoding step (txlm.inference.packaged):
exported, compiled ahead of time by AOTInductor, kept in TXLM_HOME/packages, opened by
torch's C++ loader. It draws the eager step's tokens (sampling with the draw's random
numbers as an input, through the pruned adaptive softmax, three rows in the bucket of four);
a new decoder of the same model opens the kept package without compiling, and "auto" runs
it; a model of other weights has no package, and "auto" is then the eager step."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import debug_model
from txlm.errors import ConfigError
from txlm.inference import packaged
from txlm.inference.compiled import PACKAGE
from txlm.inference.decode import Decoder
from txlm.inference.sampling import SamplingConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8, 7], [3]]  # left padding, 3 rows
SAMPLING = SamplingConfig(top_k=5)
STEPS = 60  # the debug preset's memory of 16 wraps several times


def _model(seed: int = 5):
    # one layer (what a package takes to compile grows with the kernels); weights far from
    # uniform (the norms drawn too): seed 5's draws reach every tail cluster
    return debug_model(seed, std=1.0, n_layer=1, vocab_size=64, cutoffs=[8, 24, 40], div_val=2)


def _cluster(token: int) -> int:
    return sum(token >= cut for cut in (8, 24, 40))


def _key(decoder: Decoder) -> str:
    return packaged.model_key(decoder._source())


def _draws(decoder: Decoder) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = decoder.prefill(PROMPTS, sampling=SAMPLING, generator=g)
    out = [ids]
    for _ in range(STEPS):
        ids = decoder.step(ids, SAMPLING, g)
        out.append(ids)
    return torch.stack(out)


@pytest.mark.slow
def test_a_packaged_step_draws_the_eager_tokens_and_is_opened_again_without_compiling(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TXLM_HOME", str(tmp_path))
    model = _model()
    want = _draws(Decoder(model))
    # every cluster drawn from: none pruned throughout
    assert {_cluster(t) for t in want.flatten().tolist()} == {0, 1, 2, 3}
    first = Decoder(model, compile="package")
    assert torch.equal(_draws(first), want)
    kept = list((tmp_path / "packages").glob("*/*.pt2"))
    assert len(kept) == 1  # one step setting, one bucket

    def refuse(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    again = Decoder(model, compile="auto")  # a kept package: auto runs it
    assert again.compile == PACKAGE and again.static
    assert torch.equal(_draws(again), want)
    # another model's weights: no package of its own, so auto is the eager step
    other = Decoder(_model(seed=6), compile="auto")
    assert other.compile is None and not other.static
    assert packaged.kept(other._source()) is None


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
