"""The training configurations whose steps must read nothing back from the device between log steps.

Shared by the CPU host-read counter (``tests/trainer/test_host_syncs.py``) and the CUDA sync census
(``tests/trainer/test_gpu_syncs.py``): each entry is ``name -> (Trainer keywords, what to build)``.
Every configuration logs every ``EVERY`` optimizer steps over ``STEPS`` steps in one epoch, so that the
steps strictly between log steps ("quiet" steps) are the ones checked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from helpers import QUIET, TinyNet, make_classification

EVERY = 4    # log.every_steps
STEPS = 12   # optimizer steps in the one epoch
BATCH = 4    # per micro-batch
SEQ, VOCAB = 6, 5


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, fused=True)


def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


class TokenNet(nn.Module):
    """Token ids (B, T) -> logits (B, C, T), PyTorch's layout for a per-position cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        return self.head(self.embed(x)).transpose(1, 2)


def token_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.roll(x, 1, dims=1)
    y[torch.rand(n, SEQ, generator=g) < 0.3] = -100  # padding: a different token count in every batch
    return x, y


class NaNAt:
    """A step function wrapper: the micro-batch ``bad`` gets NaN inputs (a skipped window)."""

    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, step, batch):
        from torchrig.trainer.step import default_step

        if step.batch_index == self.bad:
            batch = [batch[0] * float("nan"), batch[1]]
        return default_step(step, batch)


BASE: dict = {"optimizer": fused_adamw, "precision": "bf16", "metrics": ["accuracy"], "accumulate": 1}

CONFIGS: dict[str, dict] = {
    "bf16-adamw": {},
    "fp16-adamw": {"precision": "fp16"},
    "bf16-sgd": {"optimizer": fused_sgd},
    "fp16-sgd": {"precision": "fp16", "optimizer": fused_sgd},
    "f1": {"metrics": ["accuracy", "f1", "precision", "recall"]},
    "accumulate4": {"accumulate": 4},
    "tokens": {"data": "tokens", "loss_normalization": "tokens"},
    "clip": {"clip_grad_norm": 1.0},
    "ema": {"ema_decay": 0.9},
    "skip": {"on_nonfinite": "skip", "step_fn": NaNAt(2 * 1 + 1)},  # micro-batch 3: step 2's window
    "micro-auto": {"data.micro_batch_size": "auto"},
    "micro-2": {"data.micro_batch_size": 2},
    "everything-fp16": {"precision": "fp16", "optimizer": fused_sgd, "metrics": ["accuracy", "f1"], "accumulate": 4,
                        "clip_grad_norm": 1.0, "ema_decay": 0.9, "on_nonfinite": "skip", "step_fn": NaNAt(9)},
    "everything-bf16-tokens": {"data": "tokens", "loss_normalization": "tokens", "accumulate": 4,
                               "clip_grad_norm": 1.0, "ema_decay": 0.9, "data.micro_batch_size": 2},
}


def build(name: str, run_dir: Any, device: str, ranks: int = 1, **extra: Any):
    """``(trainer keywords, model, data)`` of configuration ``name`` on ``device``, sized for ``ranks`` processes
    (each takes ``STEPS`` optimizer steps)."""
    kw = dict(BASE, **CONFIGS[name])
    kind = kw.pop("data", "classes")
    accumulate = kw["accumulate"]
    n = STEPS * accumulate * BATCH * ranks
    torch.manual_seed(0)
    if kind == "tokens":
        model, data = TokenNet(), TensorDataset(*token_data(n))
    else:
        model, data = TinyNet(), TensorDataset(*make_classification(n))
    opts = dict(QUIET, run_dir=str(run_dir), device=device, batch_size=BATCH, epochs=1, num_workers=0, shuffle=False,
                log={"every_steps": EVERY}, checkpoint={"every_epochs": 0, "save_final": False})
    opts.update(kw)
    opts.update(extra)
    return opts, model, data
