"""Workers of the elastic tests: one global batch on any number of processes, resumed on another.

    python tests/helpers/elastic_worker.py OUT NAME[=CHECKPOINT] …   # fits in one process group, one after another

Started by ``dist_procs.group`` (``TEST_INIT``, ``TEST_RANK``, ``TEST_WORLD``: any world size). Each fit trains
``dist_worker``'s 93 samples for 2 epochs at ``data.global_batch_size`` 12 (8 steps per epoch, the last of 9
samples) under DDP, with a one-cycle schedule and a checkpoint at step 11 (epoch 2, 3 of its 8 steps done);
``NAME=CHECKPOINT`` resumes from a copy of CHECKPOINT in the fit's run directory (made by the caller, or
here by rank 0 when the fit runs in one process).
``MICRO`` (environment) sets ``data.micro_batch_size``. Each rank writes the samples of each step it trained
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

GLOBAL_BATCH, CUT = 12, 11


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
    rows: list = []
    strategy = "ddp" if kw.get("world_size", 1) > 1 else "none"
    with Trainer(W.make_model(), step_fn=W.recording_step(rows), **settings(run, strategy=strategy, **extra),
                 **kw) as t:
        t.fit(W.train_data())
        rank = t.rank
        sched = t.schedulers["default"]  # the one-cycle schedule: its horizon and where it stands
        (out / f"{name}-rows-{rank}.json").write_text(json.dumps(
            {"rows": rows, "step": t.global_step, "schedule": [sched.total_steps, sched.last_epoch, t._lr()]}))
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
