"""The 2-rank runs of the LoRA tests (tests/optim/test_adapters_distributed.py).

    python tests/helpers/finetune_worker.py lora OUT   # a file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD)

Under DDP and under FSDP2 (the frozen base sharded), with SGD and momentum (Adam would magnify the order of float
sums in its first steps past 1e-6 against one process), each rank trains a LoRA GPT-2 to the end, then again stopped
right after the checkpoint of step 3 and resumed from it. Rank 0 writes the adapters of every run (``NAME.pt``) and
``checks.json``: whether the base stayed bitwise as built, whether a frozen parameter ever held a gradient, and the
keys of the last checkpoint's ``model.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

VOCAB, LENGTH, SAMPLES = 50, 12, 26
QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False}
STOP = 3  # the checkpoint a run is stopped after (mid-epoch: 7 steps of 2 × 2 samples per epoch)


def gpt2() -> torch.nn.Module:
    """A 2-layer GPT-2 (n_embd 32) without dropout, the same on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def tokens() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(peft="lora", optimizer="sgd", lr=0.1, batch_size=2, epochs=1, seed=0, metrics=[], threads=1,
              num_workers=0, clip_grad_norm=0.5, checkpoint_every=1, resume="latest", run_dir=str(run_dir), **QUIET)
    kw.update(extra)
    return kw


def full(model: torch.nn.Module, trainable: bool) -> dict:
    """Whole tensors of the trainable (or frozen) parameters; a collective under FSDP2 (every rank gathers)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad == trainable:
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
    return out


def train(run_dir: Path, group: dict, stop: bool = False, **extra):
    from torchrig import Trainer

    model = gpt2()
    trainer = Trainer(model, **settings(run_dir, **extra), **group)
    if stop:
        real = trainer._save

        def save(metrics=None, final=False):
            path = real(metrics=metrics, final=final)
            if trainer.global_step == STOP:
                raise KeyboardInterrupt
            return path

        trainer._save = save
    try:
        trainer.fit(tokens())
    except KeyboardInterrupt:
        return trainer, None
    return trainer, full(model, True)


def lora(out: Path) -> None:
    from safetensors.torch import load_file

    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": int(os.environ["TEST_WORLD"])}
    base = {k.replace(".base_layer.", "."): v for k, v in full(gpt2(), True).items()}  # before any adapter
    checks, first = {}, None
    for strategy in ("ddp", "fsdp"):
        trainer, whole = train(out / strategy / "whole", group, strategy=strategy)
        first = first or trainer
        frozen = {k.replace(".base_layer.", "."): v for k, v in full(trainer.model, False).items()}
        train(out / strategy / "cut", group, stop=True, strategy=strategy)
        resumed_trainer, resumed = train(out / strategy / "cut", group, strategy=strategy)
        if rank == 0:
            torch.save({"whole": whole, "resumed": resumed}, out / f"{strategy}.pt")
            saved = load_file(out / strategy / "cut" / "checkpoints" / "latest" / "model.safetensors")
            checks[strategy] = {
                "base_unchanged": frozen.keys() == base.keys() and all(torch.equal(frozen[k], base[k]) for k in base),
                "frozen_grads": sum(p.grad is not None for p in trainer.model.parameters() if not p.requires_grad),
                "saved": sorted(saved), "trainable": sorted(whole), "resumed_at": resumed_trainer.resumed_from.name,
                "sharded": (out / strategy / "cut" / "checkpoints" / "latest" / "sharded").is_dir()}
    if rank == 0:
        (out / "checks.json").write_text(json.dumps(checks))
    first.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"lora": lora}[sys.argv[1]](target)
