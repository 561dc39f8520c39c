"""``python -m torch.distributed.run ... tests/helpers/ddp_average.py OUT KEY=VALUE...``: a
``txlm train --preset debug`` run whose every rank, once done, writes its own weight average
to ``OUT/average.rankN.safetensors`` (``last`` holds rank 0's only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from txlm.training import distributed
from txlm.training.config import resolve
from txlm.training.loop import Trainer


def main(out: str, sets: list[str]) -> None:
    trainer = Trainer(resolve("debug", None, sets), out, echo=False)
    trainer.fit()
    assert trainer.average is not None
    rank = int(os.environ.get("RANK", "0"))
    save_file(trainer.average.state_dict(), str(Path(out) / f"average.rank{rank}.safetensors"))
    distributed.exit_rank(0)  # as txlm train ends a rank


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
