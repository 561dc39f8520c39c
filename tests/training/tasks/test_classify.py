"""``txlm.training.tasks.classify``: what a ``task: classify`` run gives the trainer. Its
documents split and encoded with the init checkpoint's vocabulary; a chunk's loss is the
summed cross-entropy of its documents and carries no memory; N counts documents; a split's
evaluation reads every document whatever ``full``; misconfigured runs are refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.classify import marker_documents, tiny_lm
from txlm.checkpoints.checkpoint import Checkpoint
from txlm.config import ModelConfig
from txlm.errors import ConfigError
from txlm.model import TransformerXL
from txlm.training import distributed as dist
from txlm.training.config import resolve
from txlm.training.tasks import TASKS, ClassifyTask

ONE = dist.DistInfo()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def setup(tmp_path):
    """(the run's configuration, the init checkpoint) on the marker documents."""
    marker_documents(tmp_path / "ds", {"train": 6, "valid": 3, "test": 2})
    ckpt = Checkpoint.open(tiny_lm(tmp_path / "lm"))
    sets = [f"data.dataset=classes:{tmp_path / 'ds'}", f"data.data_dir={tmp_path / 'data'}",
            "data.batch_size=4", "eval.batch_size=5"]  # fmt: skip
    config = resolve("debug", None, sets, init=ckpt)
    config.task = "classify"
    return config, ckpt


def test_the_task_is_the_registrys_classify():
    assert TASKS["classify"] is ClassifyTask


def test_a_chunks_loss_is_its_documents_cross_entropy_and_carries_no_memory(setup, one_thread):
    config, ckpt = setup
    task = ClassifyTask(config, ckpt.vocab(), ONE, echo=False)
    assert [len(task.dataset.split(s)) for s in ("train", "valid", "test")] == [12, 6, 4]
    model_config = config.model_config(len(task.vocab))
    torch.manual_seed(0)
    model = task.build_model(model_config, None).eval()
    assert task.body(model) is model.body and isinstance(model.body, TransformerXL)
    batch = next(iter(task.batches(model_config, ONE, torch.device("cpu"))))
    labels = task.labels(batch)
    assert torch.equal(labels, batch.labels) and labels.shape == (4,)  # N: documents
    loss, carry = task.loss(model, batch, labels, slice(1, 3), (None, None))
    assert carry is None
    out = model(batch.input_ids[1:3], batch.start[1:3])
    want = -out.log_probs.gather(1, batch.labels[1:3, None]).sum()
    torch.testing.assert_close(loss, want.float(), atol=1e-5, rtol=0)


def test_a_split_is_every_document_and_its_metric_bits(setup, one_thread):
    config, ckpt = setup
    task = ClassifyTask(config, ckpt.vocab(), ONE, echo=False)
    torch.manual_seed(0)
    model = task.build_model(config.model_config(len(task.vocab)), None).eval()
    quick = task.evaluate_split(model, "valid", full=False)
    full = task.evaluate_split(model, "valid", full=True)
    assert quick["documents"] == full["documents"] == 6
    assert quick["loss"] == full["loss"]
    assert full["bits"] == pytest.approx(full["loss"] / math.log(2))
    assert task.metric_value(math.log(2)) == pytest.approx(1.0)
    assert {"accuracy"} == set(task.reported) and task.compiles is False


def test_the_shape_has_the_bodys_and_a_heads_names():
    """What ``optim.freeze`` names are counted on before the task exists (body.*, head.*)."""
    with torch.device("meta"):
        shaped = ClassifyTask.shaped(TransformerXL(ModelConfig.from_preset("debug")))
    tops = {n.split(".")[0] for n, _ in shaped.named_parameters()}
    assert tops == {"body", "head"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dataset": "shakespeare"}, "classes:DIR"),
        ({"compile": True}, "run.compile=true"),
        ({"vocab": None}, "pass --init CKPT"),
    ],
    ids=["not-classes", "compile", "no-init"],
)
def test_a_misconfigured_run_is_refused_by_name(setup, change, message):
    config, ckpt = setup
    if "dataset" in change:
        config.data.dataset = change["dataset"]
    if "compile" in change:
        config.run.compile = True
    vocab = change["vocab"] if "vocab" in change else ckpt.vocab()
    with pytest.raises(ConfigError, match=message):
        ClassifyTask(config, vocab, ONE, echo=False)
