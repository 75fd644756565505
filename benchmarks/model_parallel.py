"""Per-rank memory of tensor parallelism: bytes of parameters + gradients + optimizer state held by one rank
at tp=2 against one process, for a stack of transformer blocks trained by ``Trainer.fit`` with AdamW.

The bytes are counted, not sampled from the allocator: for every parameter, this rank's piece (a DTensor's
local tensor), its gradient's piece and the optimizer's state tensors for it, at the end of an optimizer step
(an ``on_step_end`` callback, before the next step frees the gradients). With every linear layer of a block
planned (q, k, v, MLP up: ``colwise``; attention output, MLP down: ``rowwise``), tp=2 should hold a little
over half: the norms, the biases of the row-split layers and the head stay whole on every rank.

Two gloo processes on the CPU; speed is not measured (tensor parallelism on a CPU only costs time).
Usage: ``python benchmarks/model_parallel.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "model_parallel"
DIM, HEADS, BLOCKS, SEQ, CLASSES = 256, 8, 4, 16, 10
TARGET = 0.6  # tp=2 bytes per rank / one process


def build_model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (f(x).view(b, n, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
            return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2, self.attn = nn.LayerNorm(DIM), nn.LayerNorm(DIM), Attention()
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Model(nn.Module):
        tp_plan = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
                   "blocks.*.attn.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(dim=1))

    torch.manual_seed(0)
    return Model()


def _bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Count:
    """Bytes this rank holds, by kind: the gradients just before the optimizer's step (a pre-step hook: the step
    frees them), parameters and optimizer state after it."""

    def __init__(self):
        self.found: dict = {}

    def watch(self, opt) -> None:
        def before_step(opt, args, kwargs):
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            self.found["gradients"] = sum(_bytes(x) for x in grads)

        opt.register_step_pre_hook(before_step)

    def on_step_end(self, trainer, values) -> None:
        opt = trainer.optimizers["default"]
        self.found["parameters"] = sum(_bytes(p) for p in trainer.model.parameters())
        self.found["optimizer"] = sum(_bytes(v) for s in opt.state.values() for v in s.values()
                                      if hasattr(v, "numel") and v.ndim > 0)


def child(tp: int, rank: int, out: Path, init: str) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import torchrig

    c.pin_threads()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, SEQ, DIM, generator=g), torch.randint(0, CLASSES, (16,), generator=g))
    count = Count()
    group = {"init_method": init, "rank": rank, "world_size": tp} if tp > 1 else {}
    kw = {"parallel.tp": tp, "parallel.tp_plan": "auto"} if tp > 1 else {}
    with tempfile.TemporaryDirectory() as run_dir:
        t = torchrig.Trainer(build_model(), optimizer="adamw", lr=1e-3, batch_size=8, max_steps=2, metrics=[],
                             run_dir=run_dir, callbacks=[count], num_workers=0, **{"log.progress": "none",
                             "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}, **group, **kw)
        count.watch(t.optimizers["default"])
        t.fit(data)
        t.close()
    (out / f"tp{tp}-rank{rank}.json").write_text(json.dumps(count.found))


def run(tp: int, out: Path) -> list[dict]:
    store = out / f"store{tp}"
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(tp), str(rank), str(out), f"file://{store}"],
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for rank in range(tp)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"benchmarks/{NAME}.py: a tp={tp} process failed (exit {p.returncode})")
    return [json.loads((out / f"tp{tp}-rank{rank}.json").read_text()) for rank in range(tp)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=4)
    args = ap.parse_args()
    if args.child:
        tp, rank, out, init = args.child
        return child(int(tp), int(rank), Path(out), init)
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, Path(tmp))[0]
        ranks = run(2, Path(tmp))
    kinds = ("parameters", "gradients", "optimizer")
    total_one = sum(one[k] for k in kinds)
    rows, per_rank = [], []
    for k in kinds:
        rows.append([k, f"{one[k] / 2**20:.2f}", *(f"{r[k] / 2**20:.2f}" for r in ranks),
                     f"{max(r[k] for r in ranks) / one[k]:.3f}"])
    per_rank = [sum(r[k] for k in kinds) for r in ranks]
    ratio = max(per_rank) / total_one
    rows.append(["total", f"{total_one / 2**20:.2f}", *(f"{b / 2**20:.2f}" for b in per_rank), f"{ratio:.3f}"])
    print(f"tensor parallelism, {BLOCKS} transformer blocks of width {DIM} ({HEADS} heads), AdamW: MiB held per rank")
    print(c.table(["", "one process", "tp=2 rank 0", "tp=2 rank 1", "tp=2 / one"], rows))
    print(f"largest rank at tp=2 / one process: {ratio:.3f} (target <= {TARGET}: {c.verdict(ratio, TARGET)})")
    c.write_result(NAME, {"one_process": one, "tp2_ranks": ranks, "ratio": ratio, "target": TARGET,
                          "meets_target": ratio <= TARGET,
                          "model": {"blocks": BLOCKS, "dim": DIM, "heads": HEADS}}, quick=args.quick)


if __name__ == "__main__":
    main()
