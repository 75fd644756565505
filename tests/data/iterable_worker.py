"""One rank of the two-process iterable-data tests (started twice by tests/data/test_iterable.py).

    python tests/data/iterable_worker.py OUT

Every run trains 2 epochs on a stream of (x, y, id) samples read by 2 loader workers per rank:
``even``: 40 samples, a data set with ``__len__``; ``uneven``: 35 samples, no length, a nominal 100
steps per epoch; ``full`` / ``cut`` / ``resumed``: 40 samples through torchdata's StatefulDataLoader
over a data set that reports its position, trained once without a break and once stopped after step 2
and resumed; ``eval_ddp`` / ``eval_fsdp``: evaluate and predict (no training) over a stream of 35
``(x, y)`` samples without a length, 2 loader workers per rank (uneven shards: 9, 9, 9 and 8
samples). One process group serves them all (process start-up is the slow part). Writes
``OUT/rank-R.json``: per training run, the sample ids this rank trained on in each epoch, the step
count and the final parameters; per evaluation run, the metrics and the predictions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import QUIET, TinyNet, make_classification  # noqa: E402

import torchrig  # noqa: E402
from torchrig.trainer.step import default_step  # noqa: E402


class Stream(IterableDataset):
    def __init__(self, n: int):
        self.x, self.y = make_classification(n=n)

    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i], i


class PairStream(Stream):
    def __iter__(self):
        for i in range(len(self.x)):
            yield self.x[i], self.y[i]


class SizedStream(Stream):
    def __len__(self) -> int:
        return len(self.x)


class PositionStream(Stream):
    def __init__(self, n: int):
        super().__init__(n)
        self.pos, self.resume_at = 0, 0

    def __iter__(self):
        self.pos, self.resume_at = self.resume_at, 0
        while self.pos < len(self.x):
            self.pos += 1
            yield self.x[self.pos - 1], self.y[self.pos - 1], self.pos - 1

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["pos"]


class Interrupted(Exception):
    pass


class StopAfterSave:
    def on_save(self, trainer, path, metrics):
        if trainer.global_step == 2:
            raise Interrupted


def fit(out: Path, name: str, data, workers: int, **kw) -> dict:
    seen: dict = {}

    def step_fn(step, batch):
        x, y, ids = batch
        seen.setdefault(step.epoch, []).extend(ids.tolist())
        return default_step(step, [x, y])

    torch.manual_seed(0)
    rank = int(os.environ["TEST_RANK"])
    trainer = torchrig.Trainer(TinyNet(dropout=0.2), step_fn=step_fn, optimizer="sgd", lr=0.05, batch_size=4,
                               epochs=2, num_workers=workers, threads=1, run_dir=str(out / name), **QUIET,
                               **{"dist.init_method": os.environ["TEST_INIT"], "dist.rank": rank,
                                  "dist.world_size": 2, "checkpoint.save_final": False}, **kw)
    try:
        trainer.fit(data)
    except Interrupted:
        pass
    return {"seen": seen, "steps": trainer.global_step,
            "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()]}


def infer(out: Path, strategy: str) -> dict:
    torch.manual_seed(0)
    rank = int(os.environ["TEST_RANK"])
    trainer = torchrig.Trainer(TinyNet(), metrics=["accuracy"], batch_size=4, num_workers=2, threads=1,
                               strategy=strategy, run_dir=str(out / strategy), **QUIET,
                               **{"dist.init_method": os.environ["TEST_INIT"], "dist.rank": rank,
                                  "dist.world_size": 2, "dist.fsdp_min_params": 1})
    metrics = trainer.evaluate(PairStream(35))
    return {"metrics": metrics, "predict": trainer.predict(PairStream(35)).tolist()}


def main() -> None:
    out, workers = Path(sys.argv[1]), 2
    rank = int(os.environ["TEST_RANK"])
    dist.init_process_group("gloo", init_method=os.environ["TEST_INIT"], rank=rank, world_size=2)
    from torchdata.stateful_dataloader import StatefulDataLoader

    def data():
        return StatefulDataLoader(PositionStream(40), batch_size=4, num_workers=workers, persistent_workers=True)

    kw = {"data.steps_per_epoch": 4}
    runs = {"even": fit(out, "even", SizedStream(40), workers),
            "uneven": fit(out, "uneven", Stream(35), workers, **{"data.steps_per_epoch": 100}),
            "full": fit(out, "full", data(), workers, **kw),
            "cut": fit(out, "cut", data(), workers, callbacks=[StopAfterSave()], checkpoint_every=1, **kw),
            "resumed": fit(out, "cut", data(), workers, resume="latest", **kw),
            "eval_ddp": infer(out, "ddp"), "eval_fsdp": infer(out, "fsdp")}
    (out / f"rank-{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
