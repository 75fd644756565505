"""The model, data, attention stand-in and multi-rank runs of the context-parallel tests (tests/parallel/test_cp.py).

    python tests/helpers/cp_worker.py SCENARIO OUT     # TEST_INIT, TEST_RANK, TEST_WORLD as dist_procs.group sets

PyTorch's ring attention has no CPU kernel (SDPA inside ``context_parallel`` on gloo: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"), so these
runs enter PyTorch's own ``context_parallel`` (its load-balanced in-place sharding) with only its SDPA dispatch
swapped for :func:`whole_sequence_attention`: each rank gathers the keys and values of the whole sequence over the
cp group and attends with its own queries, under the causal mask of the positions it holds. Everything around the
kernel is torchrig's and PyTorch's own: the sharding and load balancing, positions, loss normalisation, gradient
reduction, gathering, checkpoints.

``pair`` (2 processes, cp=2): 20 AdamW steps saving every 7; the one-process checkpoint of step 7 (written by the
test) resumed at cp=2; evaluate and predict; the split / gather round trip. ``four`` (4 processes):
dp_shard=2 × cp=2 and dp_replicate=2 × cp=2, 20 steps each.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCAB, SEQ, DIM, HEADS = 32, 24, 16, 2
BATCH, STEPS = 4, 20  # samples per optimizer step (the global batch) and steps; 2 epochs of 10
EVERY = {"checkpoint.every_steps": 7, "checkpoint.keep_last": 4, "checkpoint.save_final": False, "epochs": 2}


class TinyLM(nn.Module):
    """A causal LM whose attention is ``F.scaled_dot_product_attention`` and whose positions come from the batch."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared by every key), so
        # AdamW would turn rounding noise into steps of size lr, in one process and under cp alike
        self.q, self.v, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tokens(input_ids) + self.positions(position_ids)
        b, n, _ = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, n, HEADS, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, DIM))
        return self.head(x + self.down(F.gelu(self.up(self.norm2(x)))))


class Tokens(Dataset):
    """``{"input_ids", "labels"}`` rows of SEQ tokens; the labels are the next tokens (-100 after the last and on
    about a fifth of the positions: a different number of valid tokens on every rank)."""

    def __init__(self, n: int, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        self.ids, self.labels = ids[:, :-1].clone(), ids[:, 1:].clone()
        self.labels[torch.rand(n, SEQ, generator=g) < 0.2] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def build() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="adamw", lr=0.01, batch_size=BATCH, epochs=1, seed=0, run_dir=str(run_dir), metrics=[],
              loss="cross_entropy", threads=1, num_workers=0, shuffle=False, **{
                  "log.progress": "none", "log.tensorboard": False, "log.plot": False, "log.summary": False,
                  "checkpoint.save_final": False, "log.every_steps": 1})
    kw.update(extra)
    return kw


def params(model: nn.Module) -> dict:
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in full.items()}


class Losses:
    """A callback keeping each logged row's ``train/loss`` (one row per step with log.every_steps=1)."""

    def __init__(self):
        self.seen: list = []

    def on_log(self, trainer, values, kind):
        if kind == "interval" and "train/loss" in values:
            self.seen.append(float(values["train/loss"]))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dimension 2 (the sequence of (batch, heads, sequence, dim)); backward: the summed gradient
    of this rank's part."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n = grad.shape[2] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[:, :, rank * n:(rank + 1) * n], None


@contextlib.contextmanager
def whole_sequence_attention(mesh, buffers, seq_dims):
    """PyTorch's ``context_parallel`` (its load balancer, its in-place sharding of ``buffers``) with its SDPA
    dispatch replaced: keys and values gathered over the cp group, this rank's queries attending to every position
    at or before their own (the load balancer's order says which global position each slot holds)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer

    length = buffers[0].shape[seq_dims[0]]
    order = _create_default_load_balancer(length, mesh.size(), buffers[0].device)._generate_indices()[0]
    group, original = mesh.get_group(), F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and dropout_p == 0.0
        n = q.shape[2]
        mine = order[dist.get_rank(group) * n:(dist.get_rank(group) + 1) * n]
        mask = order[None, :] <= mine[:, None] if is_causal else None
        return original(q, _GatherSequence.apply(k, group), _GatherSequence.apply(v, group), attn_mask=mask,
                        scale=scale)

    def enable(seq_dim, mesh):
        F.scaled_dot_product_attention = sdpa

    def disable():
        F.scaled_dot_product_attention = original

    with mock.patch.object(A, "_enable_context_parallel_dispatcher_impl", enable), \
            mock.patch.object(A, "_disable_context_parallel_dispatcher_impl", disable), \
            A.context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)):
        yield


def trainer(run_dir: Path, group: dict, losses=None, **kw):
    from torchrig import Trainer

    t = Trainer(build(), callbacks=[losses] if losses is not None else None, **settings(run_dir, **kw), **group)
    t.layout.context.set_attention(whole_sequence_attention)
    return t


def save(rank: int, value, path: Path) -> None:
    if rank == 0:
        torch.save(value, path)


def round_trip(t, rank: int) -> dict:
    """A batch split over the cp ranks (each rank's positions, as PyTorch's load balancer placed them) and its
    input ids gathered back."""
    cp = t.layout.context
    batch = {"input_ids": torch.arange(2 * SEQ).view(2, SEQ), "labels": torch.arange(2 * SEQ).view(2, SEQ)}
    with cp.sharded(batch, "labels") as local:
        whole = cp.gather(local["input_ids"] * 1, local)
        seen = {"positions": local["position_ids"][0].tolist(), "ids": local["input_ids"].tolist(),
                "whole_equal": torch.equal(whole, batch["input_ids"]), "loaded_left": batch["input_ids"].shape[1]}
    return seen


def pair(out: Path, group: dict) -> None:
    rank = group["rank"]
    cp = {"parallel.cp": 2}
    losses = Losses()
    t = trainer(out / "cp2", group, losses, **cp, **EVERY)
    t.fit(Tokens(BATCH * STEPS // 2))
    ev = t.evaluate(Tokens(6, seed=8))
    predicted = t.predict(Tokens(6, seed=8).ids)
    p = params(t.model)
    seen = {"losses": losses.seen, "eval": ev, "steps": t.global_step, "round_trip": round_trip(t, rank),
            "sample_rank": t.dp_rank, "sample_ranks": t.dp_size, "strategy": t.strategy}
    (out / f"pair-{rank}.json").write_text(json.dumps(seen))
    save(rank, (p, predicted), out / "cp2.pt")
    t = trainer(out / "one-to-cp2", group, **cp, epochs=2, resume=str(out / "one" / "checkpoints" / "step-00000007"))
    t.fit(Tokens(BATCH * STEPS // 2))
    save(rank, (params(t.model), t.global_step), out / "one-to-cp2.pt")
    t.close()


def four(out: Path, group: dict) -> None:
    rank = group["rank"]
    for name, degrees in (("fsdp", {"parallel.dp_shard": 2}), ("ddp", {"parallel.dp_replicate": 2})):
        losses = Losses()
        t = trainer(out / f"four-{name}", group, losses, batch_size=BATCH // 2, epochs=2, **{"parallel.cp": 2},
                    **degrees)
        t.fit(Tokens(BATCH * STEPS // 2))
        p = params(t.model)
        save(rank, (p, losses.seen, t.strategy, t.layout.describe()), out / f"four-{name}.pt")
    t.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the model by its importable name, as the test's
    from helpers import cp_worker as named

    scenario, target = sys.argv[1], Path(sys.argv[2])
    group = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
             "world_size": int(os.environ["TEST_WORLD"])}
    {"pair": named.pair, "four": named.four}[scenario](target, group)
