"""Models, data and the 2-rank runs of the loss-normalisation tests (tests/optim/test_loss_normalization.py).

    python tests/helpers/lossnorm_worker.py ddp OUT   # a file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD): DDP and FSDP2

Each DDP run saves its parameters (rank 0) and, per rank, which samples each micro-batch held and with
what weight, so the test can check that every sample is used exactly once per epoch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}
FEATURES, CLASSES = 8, 4
VOCAB, MAX_LEN = 100, 12


def mlp() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def classification(n: int):
    """``n`` samples; feature 0 is the sample's index, so a batch tells which samples it holds."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    x[:, 0] = torch.arange(n, dtype=torch.float32) / n
    return x, y


def gpt2() -> nn.Module:
    """A tiny GPT-2 without dropout (so one process and two ranks draw no random numbers)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=MAX_LEN, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class TokenLM(nn.Module):
    """Embedding, a layer, a vocabulary head (``model.fused_head: head``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(13)
        self.embed, self.body, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)

    def forward(self, ids):
        return self.head(torch.tanh(self.body(self.embed(ids))))


def padded_tokens():
    """21 sequences of 1 to MAX_LEN labelled tokens (the rest -100): (ids, labels)."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(6)
    ids, labels = torch.randint(0, VOCAB, (21, MAX_LEN), generator=g), torch.randint(0, VOCAB, (21, MAX_LEN), generator=g)
    labels[torch.arange(MAX_LEN)[None, :] >= torch.randint(1, MAX_LEN + 1, (21, 1), generator=g)] = -100
    return TensorDataset(ids, labels)


FUSED = dict(batch_size=3, accumulate=2, loss="cross_entropy", label_smoothing=0.1)


class Sequences(Dataset):
    """Sequences of 2 to MAX_LEN tokens, right-padded to MAX_LEN: labels are -100 on the padding."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(5)
        self.lengths = torch.randint(2, MAX_LEN + 1, (n,), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, MAX_LEN), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.arange(MAX_LEN) < self.lengths[i]
        ids = torch.where(mask, self.ids[i], 0)
        return {"input_ids": ids, "attention_mask": mask.long(), "labels": torch.where(mask, ids, -100)}


def next_token_loss(logits, labels):
    """The mean cross-entropy over the valid next-token predictions, as GPT-2 computes it given labels
    (a loss given to the Trainer receives the prediction: the output's ``logits``)."""
    logits = logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="sgd", lr=0.2, epochs=2, seed=0, run_dir=str(run_dir), metrics=[], threads=1,
              num_workers=0, **QUIET)
    kw.update(extra)
    return kw


def params(model: nn.Module) -> dict:
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# Runs on two ranks: (model, data, per-rank settings), each against one process with a batch twice as large.
# Only "gpt2" needs transformers: without it the others still run.
def runs() -> dict:
    return {
        "mlp37": (mlp, lambda: classification(37), dict(batch_size=4)),       # last global batch: 3 + 2 samples
        "mlp33": (mlp, lambda: classification(33), dict(batch_size=4)),       # 1 + 0: rank 1 runs a filler
        "mlp37_acc": (mlp, lambda: classification(37), dict(batch_size=2, accumulate=2)),  # a filler in a window
        "gpt2": (gpt2, lambda: Sequences(21), dict(batch_size=3, loss=next_token_loss)),
        "fsdp33_clip": (mlp, lambda: classification(33), dict(batch_size=4, clip_grad_norm=0.5)),  # sharded grads
        # the head and its cross-entropy in chunks: tokens counted over both ranks, a window of 2 micro-batches
        "fused_head": (TokenLM, padded_tokens, dict(FUSED, fused_head="head")),
    }


def ddp(out: Path) -> None:
    from torchrig import Trainer
    from torchrig.trainer.step import default_step

    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": int(os.environ["TEST_WORLD"])}
    seen: dict = {}
    first = None
    for name, (make_model, make_data, extra) in runs().items():
        if make_model is gpt2 and not has_transformers():
            continue
        rows, data = seen.setdefault(name, []), make_data()

        def recording_step(step, batch, rows=rows, n=len(data[0]) if isinstance(data, tuple) else 0):
            if n:  # (x, y): feature 0 holds the sample's index
                rows.append([step.epoch, step.weight, (batch[0][:, 0] * n).round().long().tolist()])
            return default_step(step, batch)

        strategy = "fsdp" if name.startswith("fsdp") else "ddp"
        t = Trainer(make_model(), step_fn=recording_step, strategy=strategy, **settings(out / name, **extra), **group)
        first = first or t
        t.fit(data)
        p = params(t.model)  # collective under FSDP2: every rank gathers
        if rank == 0:
            torch.save(p, out / f"{name}.pt")
    (out / f"seen-{rank}.json").write_text(json.dumps(seen))
    first.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"ddp": ddp}[sys.argv[1]](target)
