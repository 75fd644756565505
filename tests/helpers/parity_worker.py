"""One rank of the two-rank checks of tests/trainer/test_parity.py (gloo on CPU).

    python tests/helpers/parity_worker.py RANK INIT OUT

Joins a two-rank group through ``INIT`` (a ``file://`` URL) and runs, in order: the hand-written DDP
loop and the same training through ``Trainer`` (weights saved for a bitwise comparison); a NaN on
rank 1 only, with ``on_nonfinite=skip`` and ``error``; a mid-epoch resume with metrics and an
``eval_fn`` of Python floats, while a spy on ``all_reduce`` records the device of every tensor it
sums. Writes ``OUT/rank{RANK}.json`` and, on rank 0, the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

torch.set_num_threads(1)

SEED, N, FEATURES, CLASSES, BATCH, EPOCHS, LR = 0, 48, 8, 4, 6, 2, 0.05
QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False}


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def make_data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, FEATURES, generator=g)
    return x, (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)


def epoch_order(epoch: int) -> torch.Tensor:
    """The documented data order: a permutation drawn from (seed, epoch), cut into global batches of
    W × BATCH samples; rank r takes the r-th slice of BATCH of each."""
    g = torch.Generator()
    g.manual_seed(SEED + epoch)
    return torch.randperm(N, generator=g)


def hand_loop(rank: int, world: int) -> nn.Module:
    """The loop of the PyTorch DDP tutorial, written out: what Trainer must reproduce bit for bit."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    x, y = make_data()
    for epoch in range(EPOCHS):
        order = epoch_order(epoch)
        for start in range(0, N, world * BATCH):  # N divides by world × BATCH here
            idx = order[start + rank * BATCH:start + (rank + 1) * BATCH]
            loss = nn.functional.cross_entropy(ddp(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model


def trainer_run(out: Path, **extra):
    from torchrig import Trainer

    kw = dict(optimizer="sgd", lr=LR, momentum=0.9, epochs=EPOCHS, batch_size=BATCH, seed=SEED, threads=1,
              run_dir=str(out), metrics=["accuracy"], num_workers=0, **QUIET,
              **{"checkpoint.every_epochs": 0, "checkpoint.save_final": False, "log.every_steps": 2})
    kw.update(extra)
    model = make_model()
    return Trainer(model, **kw), model


def checksum(model: nn.Module) -> list:
    """Every rank's parameter sum, gathered: equal entries mean the ranks hold the same weights."""
    s = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    parts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, s)
    return [float(p) for p in parts]


def nan_on_rank1(kind: str):
    from torchrig.trainer.step import default_step

    def step_fn(step, batch):
        x, y = batch
        if dist.get_rank() == 1 and step.batch_index == 2:
            if kind == "input":  # NaN gradients on rank 1, all-reduced to both
                x = x * float("nan")
            else:  # a NaN loss whose gradients are finite: only rank 1 sees anything wrong
                out = step.model(x)
                loss = nn.functional.cross_entropy(out, y) + float("nan") * out.detach().sum()
                step.backward(loss)
                step.optimizer_step()
                return {"loss": loss.detach()}
        return default_step(step, [x, y])

    return step_fn


def nonfinite_checks(out: Path) -> dict:
    from torchrig.trainer import NonFiniteLossError

    res: dict = {}
    for kind in ("input", "loss"):
        t, model = trainer_run(out / f"skip_{kind}", step_fn=nan_on_rank1(kind), on_nonfinite="skip", epochs=1)
        t.fit(make_data())
        res[f"skip_{kind}"] = {"checksums": checksum(model), "skipped": t.skipped_steps, "step": t.global_step}
    t, _ = trainer_run(out / "error", step_fn=nan_on_rank1("input"), on_nonfinite="error", epochs=1)
    try:
        t.fit(make_data())
        res["error"] = "no error"
    except NonFiniteLossError as exc:
        res["error"] = str(exc)
    return res


def device_spy_checks(out: Path) -> dict:
    """Mid-epoch resume with train metrics, then evaluate with an eval_fn giving Python floats."""
    seen: list = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(str(tensor.device))
        return original(tensor, *args, **kwargs)

    first, _ = trainer_run(out / "resume", max_steps=3, **{"checkpoint.every_steps": 3})
    first.fit(make_data())
    dist.all_reduce = spy
    try:
        again, _ = trainer_run(out / "resume", resume="latest", eval_fn=lambda step, batch: {"score": 0.5})
        again.fit(make_data())
        scores = again.evaluate(make_data())
    finally:
        dist.all_reduce = original
    return {"devices": sorted(set(seen)), "reductions": len(seen), "device": str(again.device),
            "score": scores.get("score"), "resumed_step": again.global_step}


def main() -> None:
    rank, init, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    hand = hand_loop(rank, 2)
    trainer, model = trainer_run(out / "parity", strategy="ddp")
    trainer.fit(make_data())
    if rank == 0:
        torch.save({"hand": hand.state_dict(), "trainer": model.state_dict()}, out / "parity.pt")
    res = {"parity_steps": trainer.global_step}
    res.update(nonfinite_checks(out))
    res.update(device_spy_checks(out))
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    from torchrig import runtime

    runtime.destroy_process_group()  # gives gloo's threads a moment before the interpreter exits


if __name__ == "__main__":
    main()
