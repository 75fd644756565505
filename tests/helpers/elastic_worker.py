"""Workers of the elastic tests: one global batch on any number of processes, resumed on another.

    python tests/helpers/elastic_worker.py OUT NAME[=CHECKPOINT] …   # fits in one process group, one after another

Started by ``dist_procs.group`` (``TEST_INIT``, ``TEST_RANK``, ``TEST_WORLD``: any world size). Each fit trains
``dist_worker``'s 93 samples for 2 epochs at ``data.global_batch_size`` 12 (8 steps per epoch, the last of 9
samples) under DDP, with a one-cycle schedule and a checkpoint at step 11 (epoch 2, 3 of its 8 steps done);
``NAME=CHECKPOINT`` resumes from a copy of CHECKPOINT in the fit's run directory (made by the caller, or
here by rank 0 when the fit runs in one process).
``MICRO`` (environment) sets ``data.micro_batch_size``. A fit named ``spike…`` trains on data whose sample 50 is
scaled by -1000, not shuffled, with ``on_spike: rollback``; one named ``stream…`` on them as a stream (``Stream``; ``streamw…``: read by a DataLoader worker); one named ``clean…`` on the data without the 12 samples
of that sample's step, not shuffled. Each rank writes the samples of each step it trained
(``NAME-rows-RANK.json``); rank 0 writes the final parameters (``NAME.pt``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import dist_worker as W  # noqa: E402

import torchrig.recipes  # noqa: E402,F401  (their config sections, as in a test process that imported them: a
# checkpoint's config.yaml then holds the same sections whichever process wrote it)

GLOBAL_BATCH, CUT = 12, 11


POISON, POISONED_STEP = 50, list(range(48, 60))  # not shuffled: sample 50 is in step 5 (samples 48 … 59);
# scaled by -1000, so that its loss is huge from the first epoch on (× 1000 it is classified right, loss 0)
SPIKE = {"on_spike": "rollback", "spike.warmup_steps": 3, "spike.snapshot_every": 2, "shuffle": False,
         "scheduler": None}


class Stream(torch.utils.data.IterableDataset):
    """``dist_worker``'s 93 training samples as a stream that reports its position (``state_dict``)."""

    def __init__(self):
        self.x, self.y = W.train_data()
        self.pos, self.start = 0, 0

    def __iter__(self):
        self.pos, self.start = self.start, 0
        while self.pos < len(self.x):
            self.pos += 1
            yield self.x[self.pos - 1], self.y[self.pos - 1]

    def __len__(self) -> int:
        return len(self.x)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.start = int(state["pos"])


def relu_model() -> torch.nn.Module:
    """Its logits and gradients grow with the input (a tanh layer would saturate): a scaled sample spikes."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(W.FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, W.CLASSES))


def poisoned():
    x, y = W.train_data()
    x = x.clone()
    x[POISON] *= -1000.0
    return x, y


def settings(run_dir: Path, **extra) -> dict:
    kw = W.settings(run_dir, global_batch_size=GLOBAL_BATCH, scheduler="onecycle",
                    **{"scheduler.max_lr": 0.1, "checkpoint.every_steps": CUT, "log.every_steps": 4})
    kw.pop("batch_size")
    kw.update(extra)
    return kw


def fit(out: Path, name: str, checkpoint: str | None, micro: int | None = None, **kw) -> dict:
    from torchrig import Trainer

    run = out / name
    extra = {}
    if checkpoint:  # a checkpoint of another run: copied into this fit's run directory (by rank 0)
        saved = run / "checkpoints" / Path(checkpoint).name
        if kw.get("rank", 0) == 0 and not saved.exists():
            shutil.copytree(checkpoint, saved)
        extra["resume"] = str(saved)
    micro = micro or int(os.environ.get("MICRO") or 0)
    if micro:
        extra["micro_batch_size"] = micro
    data = W.train_data()
    if name.startswith("spike"):  # a poisoned sample, rolled back (see SPIKE)
        data = poisoned()
        extra.update(SPIKE)
    if name.startswith("stream"):  # a stream, read here (re-split exactly) or by a worker process (it cannot be)
        data = Stream()
        extra.update(scheduler=None, num_workers=1 if name.startswith("streamw") else 0)
    if name.startswith("clean"):  # the data set without the poisoned step's samples
        keep = [i for i in range(W.N_TRAIN) if i not in POISONED_STEP]
        data = tuple(t[keep] for t in data)
        extra.update(shuffle=False, scheduler=None)
    rows: list = []
    strategy = "ddp" if kw.get("world_size", 1) > 1 else "none"
    model = relu_model() if name.startswith(("spike", "clean")) else W.make_model()
    with Trainer(model, step_fn=W.recording_step(rows), **settings(run, strategy=strategy, **extra),
                 **kw) as t:
        t.fit(data)
        rank = t.rank
        sched = t.schedulers.get("default")  # the one-cycle schedule: its horizon and where it stands
        schedule = [sched.total_steps, sched.last_epoch, t._lr()] if sched is not None else []
        (out / f"{name}-rows-{rank}.json").write_text(json.dumps(
            {"rows": rows, "step": t.global_step, "schedule": schedule}))
        if rank == 0:
            torch.save(W.params(t.model), out / f"{name}.pt")
    return {"rows": rows, "step": t.global_step}


def main(out: Path, specs: list[str]) -> None:
    import torch.distributed as dist

    kw = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
          "world_size": int(os.environ["TEST_WORLD"]), "dist_timeout": 60.0}
    # one group for every fit (a file:// store is joined once): the Trainers find it and leave it open
    dist.init_process_group("gloo", init_method=kw["init_method"], rank=kw["rank"], world_size=kw["world_size"])
    for spec in specs:
        name, _, checkpoint = spec.partition("=")
        fit(out, name, checkpoint or None, **kw)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
