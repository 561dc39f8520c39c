"""``txlm.training.tasks.lm``: what a language-model run gives the trainer. A chunk's loss
is its rows' summed token losses read with their memory, and carries the memory the model
returns; the labels are the objective's; the tail buckets are sized on the host only where
the step is compiled or on CUDA; the checkpoints record the corpus."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.train import tiny_config
from txlm.training import distributed as dist
from txlm.training.objective import IGNORE
from txlm.training.tasks import TASKS, LanguageModelTask

ONE = dist.DistInfo()
CPU = torch.device("cpu")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _task(tmp_path, *sets: str) -> LanguageModelTask:
    return LanguageModelTask(tiny_config(tmp_path, *sets), None, ONE, echo=False)


def test_a_chunks_loss_reads_its_rows_with_their_memory(tmp_path, one_thread):
    task = _task(tmp_path, "data.batch_size=4", "model.dropout=0", "model.dropatt=0")
    assert TASKS["lm"] is LanguageModelTask and task.unknown is None  # no given vocabulary
    config = task.config.model_config(len(task.vocab))
    torch.manual_seed(0)
    model = task.build_model(config, None).eval()
    assert task.body(model) is model
    task.start(model, CPU, compiled=False)
    assert task.buckets is None  # eager CPU: the softmax counts its clusters itself
    batches = iter(task.batches(config, ONE, CPU))
    first, second = next(batches), next(batches)
    rows = slice(2, 4)
    loss, (mems, mask) = task.loss(model, first, task.labels(first), rows, (None, None))
    ref = model(first.input_ids[rows], labels=first.labels[rows])
    assert torch.equal(loss, ref.losses.float().sum())
    assert all(torch.equal(a, b) for a, b in zip(mems, ref.mems, strict=True))
    # the next segment continues each row: its loss is read over the carried memory
    loss2, _ = task.loss(model, second, task.labels(second), rows, (mems, mask))
    ref2 = model(second.input_ids[rows], mems=ref.mems, labels=second.labels[rows])
    assert torch.equal(loss2, ref2.losses.float().sum())
    info = task.run_info(model)["dataset"]
    assert info["level"] == task.level == "char" and info["metric"] == task.metric


def test_the_labels_are_the_objectives(tmp_path):
    task = _task(tmp_path, "optim.loss=half", "model.tgt_len=8")
    config = task.config.model_config(len(task.vocab))
    batch = next(iter(task.batches(config, ONE, CPU)))
    labels = task.labels(batch)
    assert (labels[:, :4] == IGNORE).all() and torch.equal(labels[:, 4:], batch.labels[:, 4:])


def test_buckets_are_sized_on_the_host_where_the_step_is_compiled(tmp_path):
    task = _task(tmp_path, "model.cutoffs=[20]", "model.div_val=2")
    config = task.config.model_config(len(task.vocab))
    model = task.build_model(config, None)
    task.start(model, CPU, compiled=True)
    assert task.buckets is not None
    batch = next(iter(task.batches(config, ONE, CPU)))
    batch.host_labels = None
    with pytest.raises(ValueError, match="labels on the host"):
        task.loss(model, batch, task.labels(batch), slice(0, 1), (None, None))
