"""Workers of the elastic tests: one global batch on any number of processes, resumed on another.

    python tests/helpers/elastic_worker.py OUT NAME[=CHECKPOINT] …   # fits in one process group, one after another

Started by ``dist_procs.group`` (``TEST_INIT``, ``TEST_RANK``, ``TEST_WORLD``: any world size). Each fit trains
``dist_worker``'s 93 samples for 2 epochs at ``data.global_batch_size`` 12 (8 steps per epoch, the last of 9
samples) under DDP, with a one-cycle schedule and a checkpoint at step 11 (epoch 2, 3 of its 8 steps done);
``NAME=CHECKPOINT`` resumes from a copy of CHECKPOINT in the fit's run directory (made by the caller, or
here by rank 0 when the fit runs in one process).
``MICRO`` (environment) sets ``data.micro_batch_size``. A fit named ``fsdp…`` trains ``token_model`` on
``token_data`` under FSDP2 (in one process: unwrapped) with micro-batches of 3 and the loss over the valid tokens.
A fit named ``mix…`` trains on them as a ``Mixture`` of two sources (``mixture``). A fit named ``spike…`` trains on data whose sample 50 is
scaled by -1000, not shuffled, with ``on_spike: rollback`` (``spike…fsdp``: under FSDP2); one named ``stream…`` on them as a stream (``Stream``; ``streamw…``: read by a DataLoader worker); one named ``clean…`` on the data without the 12 samples
of that sample's step, not shuffled. ``l1spike…`` and ``l1clean…`` do the same for a regression under the L1 loss
whose sample 58 has a poisoned target (``targets``): a loss spike on one rank alone. Each rank writes the samples of each step it trained
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


VOCAB, LENGTH = 128, 8


def token_data():
    """93 sequences of up to 8 tokens (sequence i starts with token i: its name in the recorded rows), labelled
    per token, -100 after each one's length (2 … 8): the loss is normalised over the valid tokens."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (W.N_TRAIN, LENGTH), generator=g)
    x[:, 0] = torch.arange(W.N_TRAIN)
    lengths = torch.randint(2, LENGTH + 1, (W.N_TRAIN, 1), generator=g)
    y = torch.where(torch.arange(LENGTH) < lengths, (x * 7 + 3) % 5, -100)
    return x, y


def token_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Tanh(), torch.nn.Linear(16, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 5))


def token_loss(logits, labels):
    """The mean cross-entropy over the valid tokens."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)


def relu_model() -> torch.nn.Module:
    """Its logits and gradients grow with the input (a tanh layer would saturate): a scaled sample spikes."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(W.FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, W.CLASSES))


def poisoned():
    x, y = W.train_data()
    x = x.clone()
    x[POISON] *= -1000.0
    return x, y


def targets(poison: bool) -> torch.Tensor:
    """Regression targets of the 93 samples (4 numbers each); ``poison``: sample 58's first one is off by 1e4. Not
    shuffled, on 2 ranks of 3 × 2 accumulated, sample 58 is in rank 1's second micro-batch of step 5 only: under
    the L1 loss that micro-batch's loss spikes, while its gradient (the sign of each error) is that of any sample,
    so the gradient norm over the ranks does not."""
    x, _ = W.train_data()
    y = x @ torch.randn(W.FEATURES, W.CLASSES, generator=torch.Generator().manual_seed(7))
    if poison:
        y[58, 0] += 1e4
    return y


MIX_SPLIT = 60  # source "a" holds samples 0 … 59, "b" samples 60 … 92


def mixture():
    """``dist_worker``'s 93 samples as a Mixture of "a" (the first 60) and "b" (the 33 others) weighed 1 : 3: "b" is
    walked about twice an epoch, "a" a little more than once every three."""
    from torchrig.data import Mixture

    x, y = W.train_data()
    return Mixture({"a": (x[:MIX_SPLIT], y[:MIX_SPLIT]), "b": (x[MIX_SPLIT:], y[MIX_SPLIT:])},
                   weights={"a": 1, "b": 3}, samples_per_epoch=W.N_TRAIN)


def settings(run_dir: Path, **extra) -> dict:
    kw = W.settings(run_dir, global_batch_size=GLOBAL_BATCH, scheduler="onecycle",
                    **{"scheduler.max_lr": 0.1, "checkpoint.every_steps": CUT, "log.every_steps": 4})
    kw.pop("batch_size")
    kw.update(extra)
    return kw


def _job(name: str, extra: dict) -> tuple:
    """The data and model of the fit named ``name`` (see the module's text); settings it needs go into ``extra``."""
    data, model = W.train_data(), W.make_model()
    if name.startswith(("spike", "l1spike")):  # a poisoned sample, rolled back (see SPIKE)
        extra.update(SPIKE)
    if name.startswith("spike"):
        data, model = poisoned(), relu_model()
    if name.startswith("stream"):  # a stream, read here (re-split exactly) or by a worker process (it cannot be)
        data = Stream()
        extra.update(scheduler=None, num_workers=1 if name.startswith("streamw") else 0)
    if name.startswith(("l1spike", "l1clean")):  # a regression under the L1 loss (see targets)
        data = (data[0], targets(poison=name.startswith("l1spike")))
        extra.update(loss="l1", metrics=[])
    if name.startswith(("clean", "l1clean")):  # the data set without the poisoned step's samples
        keep = [i for i in range(W.N_TRAIN) if i not in POISONED_STEP]
        data = tuple(t[keep] for t in data)
        extra.update(shuffle=False, scheduler=None)
    if name.startswith("clean"):
        model = relu_model()
    if name.startswith("mix"):  # two sources of the 93 samples drawn by weight
        data = mixture()
    if name.startswith("fsdp"):
        data, model = token_data(), token_model()
        extra.update(loss=token_loss, loss_normalization="tokens", micro_batch_size=3, metrics=[],
                     **{"dist.fsdp_min_params": 500})
    return data, model


def fit(out: Path, name: str, checkpoint: str | None, micro: int | None = None, step_fn=None, **kw) -> dict:
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
    data, model = _job(name, extra)
    rows: list = []
    strategy = "ddp" if kw.get("world_size", 1) > 1 else "none"
    if name.startswith("fsdp"):  # FSDP2 on tokens: accumulation of micro-batches of 3, loss over the valid tokens
        strategy = "fsdp" if kw.get("world_size", 1) > 1 else "none"
    if name.startswith("spike") and name.endswith("fsdp") and kw.get("world_size", 1) > 1:
        strategy = "fsdp"  # the rollback's snapshot and restore of sharded parameters and optimizer state
    if kw.get("world_size", 1) == 1 and "WORLD_SIZE" in os.environ:  # under torchrun: its processes
        strategy = "ddp" if int(os.environ["WORLD_SIZE"]) > 1 else "none"
    step = W.recording_step(rows)
    if step_fn is not None:  # the same rows, around the caller's step
        def step(s, b, inner=step_fn):
            if s.weight:
                rows.append([s.epoch, s.global_step + 1, b[0][:, 0].tolist()])
            return inner(s, b)
    with Trainer(model, step_fn=step, **settings(run, strategy=strategy, **extra),
                 **kw) as t:
        t.fit(data)
        rank = t.rank
        sched = t.schedulers.get("default")  # the one-cycle schedule: its horizon and where it stands
        schedule = [sched.total_steps, sched.last_epoch, t._lr()] if sched is not None else []
        (out / f"{name}-rows-{rank}.json").write_text(json.dumps(
            {"rows": rows, "step": t.global_step, "schedule": schedule, "strategy": t.strategy}))
        params = W.params(t.model)  # collective under FSDP2: every rank gathers
        if rank == 0:
            torch.save(params, out / f"{name}.pt")
    return {"rows": rows, "step": t.global_step}


def launched(argv: list[str]) -> None:
    """``elastic_worker.py --launched OUT NAME --start STEP``, started by ``torchrig launch`` (torchrun's environment):
    the fit NAME; in the first attempt the worker of the node started with ``KILL_NODE=1`` SIGKILLs its agent (the
    whole node) and itself before optimizer step STEP. ``--start`` is this script's: torchrun must not read it as
    its ``--start-method``."""
    import signal

    from torchrig.trainer.step import default_step

    out, name = Path(argv[0]), argv[1]
    start = int(argv[argv.index("--start") + 1])

    def node_dies(step, batch):
        if step.global_step + 1 == start and os.environ.get("KILL_NODE") and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            (out / "killed").write_text(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} before step {start}\n")
            os.kill(os.getppid(), signal.SIGKILL)  # the node's torchrun agent: it will not come back
            os.kill(os.getpid(), signal.SIGKILL)
        return default_step(step, batch)

    fit(out, name, None, step_fn=node_dies)


def main(out: Path, specs: list[str]) -> None:
    W.fits_in_one_group(out, specs, fit)


if __name__ == "__main__":
    if sys.argv[1] == "--launched":
        launched(sys.argv[2:])
    else:
        main(Path(sys.argv[1]), sys.argv[2:])
