"""The memory guard: a tiny Transformer-XL trained by ``txlm train``'s trainer copies from
two segments back, which only its memory holds; the same model without memory cannot.

Every copy in this task lies exactly 16 tokens after its source, and segments are 8 tokens
long: no copy's source is ever in the segment being read. So the test fails if the trainer
dropped the memory, fed it stale or misplaced states, or the attention put memory keys at the
wrong relative positions while training (the evaluation path, which is separate, would then
not find what training taught). Each of those defects was planted once and seen to fail it.
Every setting is pinned here (the recall preset's init_std moved on; these were verified).
"""

from __future__ import annotations

import numpy as np
import pytest

from txlm.analysis.memory import copy_profile
from txlm.data.recall import copy_distances
from txlm.training import Trainer
from txlm.training.config import apply_set, parse_set, preset_config

TASK = (
    "recall:alphabet=64,span=8,min_dist=16,max_dist=16,train_max_dist=16,"
    "train=60000,valid=4096,test=4096"
)
SEGMENT, DISTANCE = 8, 16


def _train_and_score(tmp_path, mem_len: int) -> tuple[float, int]:
    config = preset_config("recall")
    for item in (
        f"data.dataset={TASK}", f"data.data_dir={tmp_path / 'data'}", "data.batch_size=32",
        "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.d_head=16",
        "model.d_inner=128", f"model.tgt_len={SEGMENT}", f"model.mem_len={mem_len}",
        "model.init_std=0.02",
        "optim.max_steps=400", "optim.warmup_steps=20", "optim.lr=2e-3", "run.threads=1",
        "run.progress=false", "run.tensorboard=false", "eval.final_eval=false",
        "eval.max_eval_steps=2",
    ):  # fmt: skip
        apply_set(config, *parse_set(item))
    trainer = Trainer(config, tmp_path / f"mem{mem_len}", echo=False)
    trainer.fit()
    corpus = trainer.task.corpus
    tokens = np.asarray(corpus.split("valid"), dtype=np.int64)
    distances = np.asarray(copy_distances(corpus.path, "valid"))
    assert set(np.unique(distances)) == {0, DISTANCE}
    profile = copy_profile(
        trainer.model.eval(), tokens, distances, [DISTANCE, DISTANCE + 1], mem_len=mem_len
    )
    return profile.accuracy[0], profile.count[0]


@pytest.mark.slow
def test_xl_copies_from_memory_and_without_memory_it_cannot(tmp_path):
    with_memory, n = _train_and_score(tmp_path, mem_len=2 * SEGMENT)
    without, _ = _train_and_score(tmp_path, mem_len=0)
    assert n > 1000
    chance = 1 / 64
    assert with_memory > 0.9, f"XL with memory copied {with_memory:.3f} of {n} tokens"
    assert without < 5 * chance, f"without memory {without:.3f}: it cannot see the source"
