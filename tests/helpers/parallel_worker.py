"""Models, data and the multi-rank runs of the model-parallel tests (tests/parallel/test_tensor_parallel.py).

    python tests/helpers/parallel_worker.py tp OUT     # a file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD)

Each run trains 20 AdamW steps with the ``parallel`` settings of its entry in :func:`runs` and saves the
full parameters (rank 0), for the test to compare with one process trained on the same batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}
FEATURES, CLASSES, SEQ, VOCAB = 8, 4, 6, 64
STEPS, BATCH = 20, 4  # optimizer steps of every run; samples per rank and step


class PlannedMLP(nn.Module):
    """An MLP that declares its own tensor-parallel plan (what ``tp_plan: auto`` reads)."""

    tp_plan = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(FEATURES, 32), nn.Linear(32, 16), nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared by every key), so
        # AdamW would turn rounding noise into steps of size lr, in one process and under TP alike
        self.q, self.v, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, n, _ = x.shape
        # -1 heads: under tensor parallelism q / k / v hold this rank's heads only
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP) and a classification head over the mean token."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.ModuleDict({"up": nn.Linear(dim, 4 * dim), "down": nn.Linear(4 * dim, dim)})
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp["down"](F.gelu(self.mlp["up"](self.norm2(x))))
        return self.head(x.mean(dim=1))


class TokenBlock(Block):
    """The block with a prediction per token: with labels of -100 on some positions, a step's loss is the mean
    over the valid tokens of every data-parallel rank (counts all-reduced over those ranks only)."""

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return self.head(x + self.mlp["down"](F.gelu(self.mlp["up"](self.norm2(x)))))


def token_loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=-100)


def token_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, SEQ, 16, generator=g)
    y = torch.randint(0, CLASSES, (n, SEQ), generator=g)
    y[torch.rand(n, SEQ, generator=g) < 0.4] = -100  # a different number of valid tokens in every batch
    return TensorDataset(x, y)


BLOCK_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "rowwise",
              "mlp.up": "colwise", "mlp.down": "rowwise"}


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Tokens(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def features(n: int, *shape: int) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y)


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def runs(samples: int, scenario: str = "tp") -> dict:
    """name -> (model factory, its data of ``samples`` samples, settings: the tensor-parallel plan ...). The
    four-process scenario trains only the block per token (its counts are what the data-parallel ranks sum),
    without the Hugging Face model (its import in four processes costs more than it tests)."""
    if scenario != "tp":
        return {"tokens": (TokenBlock, token_data(samples), {"parallel.tp_plan": BLOCK_PLAN, "loss": token_loss})}
    out = {"mlp": (PlannedMLP, features(samples, FEATURES), {"parallel.tp_plan": "auto"}),
           # clipped: the norm over split (DTensor) and whole gradients together
           "block": (Block, features(samples, SEQ, 16), {"parallel.tp_plan": BLOCK_PLAN, "clip_grad_norm": 0.5})}
    if has_transformers():
        out["llama"] = (llama, Tokens(samples), {"parallel.tp_plan": "auto"})
    return out


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="adamw", lr=0.01, batch_size=BATCH, epochs=1, seed=0, run_dir=str(run_dir), metrics=[],
              threads=1, num_workers=0, shuffle=False, **QUIET)
    kw.update(extra)
    return kw


def params(model: nn.Module) -> dict:
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in full.items()}


def build(make_model):
    torch.manual_seed(0)
    return make_model()


# scenario -> (the parallel degrees and other settings, the processes it takes). AdamW does not see a gradient's
# scale, which the data-parallel reductions decide; the four-process run takes SGD, which does.
SCENARIOS = {"tp": ({"parallel.tp": 2}, 2),
             "fsdp_tp": ({"parallel.tp": 2, "parallel.dp_shard": 2, "optimizer": "sgd", "lr": 0.1}, 4)}


def inference(t, data) -> tuple[dict, Any]:
    """``Trainer.evaluate`` of the first 10 samples (split over the data-parallel ranks: 5 and 5) and the
    predictions for them (tensor outputs only), on every rank."""
    from torch.utils.data import Subset

    ev = t.evaluate(Subset(data, range(10)))
    x = data.tensors[0][:10] if isinstance(data, TensorDataset) else None
    return ev, (t.predict(x) if x is not None else None)


def local_fraction(model: nn.Module) -> float:
    """This rank's share of the parameters' elements (0.5 when half of them are split in two)."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return local / sum(p.numel() for p in model.parameters())


def train(scenario: str, out: Path) -> None:
    from torchrig import Trainer, runtime

    degrees, world = SCENARIOS[scenario]
    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": world}
    first, seen = None, {}
    dp = world // degrees["parallel.tp"]
    for name, (make_model, data, plan) in runs(BATCH * STEPS * dp, scenario).items():
        t = Trainer(build(make_model), **settings(out / name, **degrees, **plan), **group)
        first = first or t
        t.fit(data)
        ev, predicted = inference(t, data)
        seen[name] = {"dp": t.layout.groups.dp_size(), "local": local_fraction(t.model), "eval": ev}
        p = params(t.model)  # collective for DTensors: every rank gathers
        if rank == 0:
            torch.save(predicted, out / f"{name}-predicted.pt")
            torch.save(p, out / f"{name}.pt")
    if rank == 0:
        (out / "seen.json").write_text(json.dumps(seen))
    if scenario == "tp":  # the same processes go on with the non-finite decision, the checkpoints, a reshard
        nonfinite(out, group)
        resume(out, group)
        reshards(out, group)
    first.close()


def nonfinite(out: Path, group: dict) -> None:
    """tp=2, on_nonfinite=skip: rank 1's piece of fc1's gradient is NaN in the third step (rank 0's is finite).
    Every rank must skip that step, or the whole layers (fc2's bias, the head) would part ways."""
    from torchrig import Trainer

    rank = group["rank"]
    t = Trainer(build(PlannedMLP), **settings(out / "nonfinite", **{"parallel.tp": 2, "parallel.tp_plan": "auto",
                                                                     "on_nonfinite": "skip", "max_steps": 6}), **group)
    calls = [0]

    def poison(grad):
        calls[0] += 1
        return grad * float("nan") if rank == 1 and calls[0] == 3 else grad

    t.model.fc1.weight.register_hook(poison)
    t.fit(features(4 * 6, FEATURES))
    head = t.model.head.weight.detach().clone()
    (out / f"nonfinite-{rank}.json").write_text(json.dumps({"skipped": t.skipped_steps, "steps": t.global_step,
                                                            "head": head.flatten().tolist()}))


def resume(out: Path, group: dict) -> None:
    """tp=2: the block trained 20 steps (2 epochs) with a checkpoint every 7 (sharded through DCP), then again
    from the checkpoint of step 7 (mid-epoch) in the same layout; both final parameter sets saved (rank 0)."""
    from torchrig import Trainer

    rank = group["rank"]
    kw = {"parallel.tp": 2, "parallel.tp_plan": BLOCK_PLAN, "checkpoint.save_final": True,
          "checkpoint.every_steps": 7, "checkpoint.keep_last": 4, "checkpoint.async_save": True, "epochs": 2}
    data = features(BATCH * STEPS // 2, SEQ, 16)  # 10 steps an epoch
    t = Trainer(build(Block), **settings(out / "whole", **kw), **group)
    t.fit(data)
    whole = params(t.model)
    ckpt = out / "whole" / "checkpoints" / "step-00000007"
    kw.update({"checkpoint.every_steps": 0, "resume": str(ckpt)})
    t2 = Trainer(build(Block), **settings(out / "resumed", **kw), **group)
    t2.fit(data)
    resumed = params(t2.model)
    if rank == 0:
        torch.save({"whole": whole, "resumed": resumed, "steps": (t.global_step, t2.global_step)}, out / "resume.pt")


class Reshards(nn.Module):
    """A forward that moves a split activation from one dimension to another (batch-split to feature-split and
    back): on a CPU mesh torch's DTensor does it by an all-gather, and warns that gloo has no all-to-all."""

    tp_plan = {"fc": "colwise"}

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.fc.weight.device_mesh
        h = DTensor.from_local(self.fc(x), mesh, [Shard(1)]).redistribute(mesh, [Shard(0)])
        return self.head(h.redistribute(mesh, [Shard(1)]).full_tensor())


def reshards(out: Path, group: dict) -> None:
    """tp=2 with a forward that reshards (fit, evaluate, predict): the test reads this run's warnings in the logs."""
    from torchrig import Trainer

    data = features(BATCH * 2, FEATURES)
    t = Trainer(build(Reshards), **settings(out / "reshards", **{"parallel.tp": 2, "parallel.tp_plan": "auto"}),
                **group)
    t.fit(data)
    t.evaluate(data)
    t.predict(data.tensors[0])
    (out / f"reshards-{group['rank']}").write_text("done")


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    train(sys.argv[1], target)
