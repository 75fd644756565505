"""Peak memory of one training step with and without ``model.activation_checkpointing``.

A stack of residual MLP blocks (``--blocks``, width ``--width``, batch ``--batch``) trains one step
with torchrig's checkpointing of every block (``apply_activation_checkpointing``, the function behind
the config key) and without. Both arms run in this process, one after the other, from the same
weights and batch, and the gradients are checked equal.

Measured:

- ``saved_activation_mib``: bytes autograd keeps for backward after the forward (every device; an
  outer ``saved_tensors_hooks`` sees what the checkpointed regions keep, i.e. only their inputs);
- ``peak_allocated_mib`` (CUDA only): ``torch.cuda.max_memory_allocated`` over forward + backward.

Usage: ``python benchmarks/activation_checkpointing.py [--device cuda] [--blocks 16] [--width 1024]
[--batch 256] [--quick]``. Writes ``results/activation_checkpointing.json``.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "activation_checkpointing"
MIB = 1024 * 1024


def _model(blocks: int, width: int):
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x):
            return x + self.net(x)

    return nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(width, 10))


def _step(model, x, y, device) -> dict:
    import torch

    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    out = {"saved_activation_mib": saved[0] / MIB}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--quick", action="store_true", help="a tiny model on CPU: a smoke run of the script")
    a = p.parse_args()
    import torch

    from torchrig.runtime import apply_activation_checkpointing

    if a.quick:
        a.device, a.blocks, a.width, a.batch = "cpu", 4, 64, 32
    device = torch.device(a.device if a.device != "cuda" or torch.cuda.is_available() else "cpu")
    c.pin_threads()
    torch.manual_seed(0)
    plain = _model(a.blocks, a.width).to(device)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, [str(i) for i in range(a.blocks)])
    x = torch.randn(a.batch, a.width, device=device)
    y = torch.randint(0, 10, (a.batch,), device=device)
    arms = {"plain": _step(plain, x, y, device), "checkpointed": _step(ckpt, x, y, device)}
    same = all(torch.allclose(p1.grad, p2.grad, rtol=1e-5, atol=1e-6)
               for p1, p2 in zip(plain.parameters(), ckpt.parameters()))
    keys = [k for k in arms["plain"]]
    ratios = {k: arms["checkpointed"][k] / arms["plain"][k] for k in keys}
    print(c.table(["arm", *keys], [[arm, *[v[k] for k in keys]] for arm, v in arms.items()]))
    print("checkpointed / plain: " + ", ".join(f"{k} {r:.3f}×" for k, r in ratios.items())
          + f"; gradients equal: {same}")
    path = c.write_result(NAME, {"device": str(device), "blocks": a.blocks, "width": a.width, "batch": a.batch,
                                 "arms": arms, "ratios": ratios, "gradients_equal": same}, quick=a.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
