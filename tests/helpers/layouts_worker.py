"""The multi-rank runs of the checkpoint-across-layouts and loss-parallel tests (tests/parallel/test_layouts.py).

    python tests/helpers/layouts_worker.py SCENARIO OUT     # TEST_INIT, TEST_RANK, TEST_WORLD as dist_procs.group sets

``pair`` (2 processes): an uninterrupted DDP run and a tp=2 run, each saving every 7 steps; the one-process
checkpoint of step 7 (written by the test beforehand) resumed at tp=2; a tp=2 run with the output layer split
by class and ``parallel.loss_parallel``. ``fsdp_tp`` (4 processes): the DDP checkpoint of step 7 resumed at
dp_shard=2 × tp=2, saving at step 14. ``to_ddp`` (2 processes): that step-14 checkpoint resumed under DDP.
Every run saves its final full parameters (rank 0) for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the models by their importable names, as the test
from helpers.parallel_worker import (BATCH, BLOCK_PLAN, SEQ, STEPS, Block, TokenBlock, build, features,  # noqa: E402
                                     params, settings, token_data, token_loss)

VOCAB = 64
EVERY = {"checkpoint.every_steps": 7, "checkpoint.keep_last": 4, "checkpoint.save_final": True, "epochs": 2}
TP = {"parallel.tp": 2, "parallel.tp_plan": BLOCK_PLAN}
FSDP_TP = {"parallel.tp": 2, "parallel.dp_shard": 2, "parallel.tp_plan": BLOCK_PLAN}
LM_PLAN = dict(BLOCK_PLAN, head="colwise_loss_parallel")


class VocabBlock(Block):
    """The block with an output layer over a vocabulary of 64 classes (an LM head's shape, one token per sample)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, VOCAB)


def vocab_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(6)
    return TensorDataset(torch.randn(n, SEQ, 16, generator=g), torch.randint(0, VOCAB, (n,), generator=g))


def tokens(dp: int) -> TensorDataset:
    return token_data(BATCH * STEPS // 2 * dp)  # 10 steps an epoch at 4 samples per data-parallel rank


def blocks() -> TensorDataset:
    return features(BATCH * STEPS // 2, SEQ, 16)


def logit_bytes(model: nn.Module) -> list:
    """Bytes of the output layer's logits this rank holds, per forward (a split DTensor: its local piece)."""
    seen: list = []

    def hook(module, args, out):
        local = out.to_local() if hasattr(out, "to_local") else out
        seen.append(local.untyped_storage().nbytes())

    model.head.register_forward_hook(hook)
    return seen


def fit(make_model, data, run_dir: Path, group: dict, **kw):
    from torchrig import Trainer

    t = Trainer(build(make_model), **settings(run_dir, **kw), **group)
    t.fit(data)
    return t


def save(rank: int, value, path: Path) -> None:
    if rank == 0:
        torch.save(value, path)


def pair(out: Path, group: dict) -> None:
    rank = group["rank"]
    t = fit(TokenBlock, tokens(2), out / "ddp", group, loss=token_loss, **EVERY)
    save(rank, params(t.model), out / "ddp-whole.pt")
    t = fit(Block, blocks(), out / "tp", group, **TP, **EVERY)
    save(rank, params(t.model), out / "tp-whole.pt")
    t = fit(Block, blocks(), out / "one-to-tp", group, **TP, epochs=2, resume=str(out / "one" / "checkpoints" / "step-00000007"))
    save(rank, (params(t.model), t.global_step), out / "one-to-tp.pt")
    from torchrig import Trainer

    t = Trainer(build(VocabBlock), **settings(out / "lp", loss="cross_entropy", metrics=["accuracy"],
                                              **{"parallel.tp": 2, "parallel.tp_plan": LM_PLAN}), **group)
    seen = logit_bytes(t.model)
    t.fit(vocab_data(BATCH * STEPS))
    p, accuracy = params(t.model), t.evaluate(vocab_data(16))["accuracy"]  # collective, both
    if rank == 0:
        torch.save(p, out / "lp.pt")
        (out / "lp.json").write_text(json.dumps({"on": t.step.loss_parallel, "bytes": seen[0], "accuracy": accuracy}))


def fsdp_tp(out: Path, group: dict) -> None:
    t = fit(TokenBlock, tokens(2), out / "fsdp_tp", group, loss=token_loss, **FSDP_TP, **EVERY,
            resume=str(out / "ddp" / "checkpoints" / "step-00000007"))
    save(group["rank"], (params(t.model), t.global_step), out / "ddp-to-fsdp_tp.pt")


def to_ddp(out: Path, group: dict) -> None:
    t = fit(TokenBlock, tokens(2), out / "to_ddp", group, loss=token_loss, epochs=2,
            resume=str(out / "fsdp_tp" / "checkpoints" / "step-00000014"))
    save(group["rank"], (params(t.model), t.global_step), out / "fsdp_tp-to-ddp.pt")


if __name__ == "__main__":
    scenario, target = sys.argv[1], Path(sys.argv[2])
    group = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
             "world_size": int(os.environ["TEST_WORLD"])}
    {"pair": pair, "fsdp_tp": fsdp_tp, "to_ddp": to_ddp}[scenario](target, group)
