"""A user's own small causal LM over packed documents, and the fits of the packed-resume tests.

    python tests/helpers/packed_lm.py OUT NAME[=CHECKPOINT] …   # fits in one file:// process group (dist_procs)

``DocLM.forward(input_ids, position_ids)`` masks its attention with ``torchrig.data.document_mask`` (the dense
mask for ``scaled_dot_product_attention``, which trains on the CPU; ``flex=True``: FlexAttention's BlockMask,
forward only on the CPU). ``corpus()`` is 60 documents of 1 … 40 tokens (a few longer than a row), packed into
rows of ``LENGTH``; ``fit`` trains on them for 2 epochs at a global batch of ``GLOBAL_BATCH`` rows with a
checkpoint at step ``CUT`` (mid epoch 2), recording which rows each step trained (``NAME-rows-RANK.json``:
``[epoch, step, [row, …]]``) and the final parameters (``NAME.pt``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import dist_worker as W  # noqa: E402

from torchrig.data import PackedDocuments, document_mask  # noqa: E402

VOCAB, LENGTH, GLOBAL_BATCH, CUT = 97, 24, 8, 9


def corpus(n: int = 60, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]


def packed() -> PackedDocuments:
    return PackedDocuments(corpus(), LENGTH)


class DocLM(nn.Module):
    """ids ``(B, T)`` and their position ids -> next-token logits ``(B, T, VOCAB)``; one attention block."""

    def __init__(self, flex: bool = False, dim: int = 16, heads: int = 2):
        super().__init__()
        self.flex, self.heads = flex, heads
        self.embed, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(LENGTH, dim)
        self.qkv, self.out, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, VOCAB)

    def forward(self, input_ids, position_ids):
        x = self.embed(input_ids) + self.pos(position_ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.flex:
            from torch.nn.attention.flex_attention import flex_attention

            a = flex_attention(q, k, v, block_mask=document_mask(position_ids))
        else:
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(position_ids, dense=True))
        return self.head(x + self.out(a.transpose(1, 2).reshape(b, t, d)))


def lm_loss(logits, labels):
    """Each position predicts the next label; the mean over the valid (not -100) ones."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def make_model(flex: bool = False) -> DocLM:
    torch.manual_seed(1234)
    return DocLM(flex)


def fit(out: Path, name: str, checkpoint: str | None = None, **kw) -> dict:
    from torchrig import Trainer
    from torchrig.trainer.step import default_step

    run, extra = out / name, {}
    if checkpoint:  # a copy of another run's checkpoint in this run's directory (rank 0 copies)
        saved = run / "checkpoints" / Path(checkpoint).name
        if kw.get("rank", 0) == 0 and not saved.exists():
            shutil.copytree(checkpoint, saved)
        extra["resume"] = str(saved)
    data, rows = packed(), []
    index = {tuple(r.tolist()): i for i, r in enumerate(data.input_ids)}

    def step_fn(step, batch):
        if step.weight:
            rows.append([step.epoch, step.global_step + 1, [index[tuple(r.tolist())] for r in batch["input_ids"]]])
        return default_step(step, batch)

    settings = W.settings(run, lr=0.5, global_batch_size=GLOBAL_BATCH, metrics=[], loss=lm_loss,
                          strategy="ddp" if kw.get("world_size", 1) > 1 else "none",
                          **{"checkpoint.every_steps": CUT, "log.every_steps": 4}, **extra)
    settings.pop("batch_size")
    with Trainer(make_model(), step_fn=step_fn, **settings, **kw) as t:
        t.fit(data)
        (out / f"{name}-rows-{t.rank}.json").write_text(json.dumps({"rows": rows, "step": t.global_step}))
        if t.rank == 0:
            torch.save(W.params(t.model), out / f"{name}.pt")
    return {"rows": rows, "step": t.global_step}


def main(out: Path, specs: list[str]) -> None:
    W.fits_in_one_group(out, specs, fit)


if __name__ == "__main__":  # the model's class as the test process names it (a checkpoint records it)
    from helpers import packed_lm

    packed_lm.main(Path(sys.argv[1]), sys.argv[2:])
