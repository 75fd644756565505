"""A GPT-2-style language model: a hand loop against ``Trainer`` at its defaults and with each speed key.

The model is plain PyTorch (token and position embeddings, a ``ModuleList`` of pre-LayerNorm blocks with causal
self-attention through ``F.scaled_dot_product_attention`` and a GELU MLP, a final LayerNorm, an ``nn.Linear``
vocabulary head named ``head``), trained on random tokens from a ``DataLoader`` with AdamW (fused on CUDA), the
gradient norm clipped at 1.0, bf16 autocast on CUDA (fp32 on the CPU). Arms, each in a fresh process:

- ``hand``: the hand loop; ``trainer``: ``Trainer`` at its defaults (``metrics=[]``; no plot and no per-epoch
  checkpoint, which come after the timed steps);
- ``trainer`` with one key each: ``fused_head`` (``model.fused_head=head``), ``float8``
  (``float8.recipe=tensorwise``; emulated by torchao on the CPU: slow), ``compile`` (``model.compile=true``),
  ``selective_ac`` / ``full_ac`` (``model.activation_checkpointing``), ``offload`` (``model.activation_offload``).

Per arm: tokens/s over the steps after the warm-up (timed at each batch's collation, after a CUDA synchronisation,
so every arm is timed alike), MFU (FLOPs per token ``6·N + 12·L·T·d``, N the parameters outside the embedding
tables, L layers, T the sequence length, d the width: the PaLM count, attention included; against the GPU's bf16
peak from ``torchrig.observe.throughput``; null on the CPU, where no peak is known), peak memory (CUDA:
``torch.cuda.max_memory_allocated``; CPU: the process's peak RSS, ``ru_maxrss``, less its RSS before the model was
built), and the loss of the trained model on a fixed held-out batch (so that a key that changes the numbers shows).

Sizes: GPT-2 small (124 M parameters, batch 16 × 1024 tokens) on CUDA; on the CPU a tiny model (2 layers, d=64,
vocabulary 512, sequence 64, batch 8, 20 steps). ``--quick``: the tiny model, one run of a few steps, arms hand,
trainer, fused_head and selective_ac.

Usage: ``python benchmarks/lm.py [--runs 3] [--steps N] [--quick]``. Writes ``results/lm.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "lm"
MIB = 1024 * 1024
GPT2_SMALL = dict(layers=12, dim=768, heads=12, vocab=50257, seq=1024, batch=16, steps=30, skip=10)
TINY = dict(layers=2, dim=64, heads=2, vocab=512, seq=64, batch=8, steps=20, skip=5)
LR = 6e-4
ARMS = {"hand": {}, "trainer": {}, "fused_head": {"fused_head": "head"}, "float8": {"float8": "tensorwise"},
        "compile": {"compile": True}, "selective_ac": {"activation_checkpointing": "selective"},
        "full_ac": {"activation_checkpointing": "full"}, "offload": {"activation_offload": True}}
QUICK_ARMS = ("hand", "trainer", "fused_head", "selective_ac")


def build_model(p: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            d = p["dim"]
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, p["heads"], d // p["heads"]).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(p["vocab"], p["dim"]), nn.Embedding(p["seq"], p["dim"])
            self.blocks = nn.ModuleList(Block() for _ in range(p["layers"]))
            self.ln_f = nn.LayerNorm(p["dim"])
            self.head = nn.Linear(p["dim"], p["vocab"], bias=False)

        def forward(self, ids):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return GPT()


def flops_per_token(model, p: dict) -> float:
    """``6·N + 12·L·T·d``: N the parameters outside the embedding tables (the head counted)."""
    n = sum(q.numel() for name, q in model.named_parameters() if not name.startswith(("tokens.", "positions.")))
    return 6.0 * n + 12.0 * p["layers"] * p["seq"] * p["dim"]


def _tokens(p: dict, n: int, seed: int):
    import torch

    return torch.randint(0, p["vocab"], (n, p["seq"] + 1), generator=torch.Generator().manual_seed(seed))


def make_loader(p: dict, stamps: list):
    """Random tokens, ``steps`` batches in order; each collation records the time (after a CUDA sync)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def collate(rows):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        ids = torch.stack([r[0] for r in rows])
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return DataLoader(TensorDataset(_tokens(p, p["steps"] * p["batch"], 0)), batch_size=p["batch"], shuffle=False,
                      collate_fn=collate)


def _autocast(device):
    import contextlib

    import torch

    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def hand_fit(model, loader, device) -> None:
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=device.type == "cuda")
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with _autocast(device):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def trainer_fit(model, loader, device, key: dict, run_dir: str) -> None:
    import torchrig

    trainer = torchrig.Trainer(model, optimizer="adamw", lr=LR, loss="cross_entropy", metrics=[], clip_grad_norm=1.0,
                               precision="bf16" if device.type == "cuda" else "fp32", epochs=1, run_dir=run_dir,
                               seed=0, threads=1, plot=False, checkpoint_every_epochs=0, **key)
    trainer.fit(loader)
    trainer.close()


def held_out_loss(model, p: dict, device) -> float:
    import torch
    import torch.nn.functional as F

    ids = _tokens(p, p["batch"], 1).to(device)
    model.eval()
    with torch.no_grad(), _autocast(device):
        logits = model(ids[:, :-1])
    return float(F.cross_entropy(logits.float().reshape(-1, p["vocab"]), ids[:, 1:].reshape(-1)))


def _rss_mib() -> float:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def child(arm: str, p: dict) -> dict:
    import torch

    c.pin_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rss0 = _rss_mib()
    model = build_model(p).to(device)
    fpt = flops_per_token(model, p)
    initial = held_out_loss(model, p, device)
    stamps: list = []
    loader = make_loader(p, stamps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        if arm == "hand":
            hand_fit(model, loader, device)
        else:
            trainer_fit(model, loader, device, ARMS[arm], run_dir)
        wall = time.perf_counter() - t0
    timed = stamps[-1 - (p["steps"] - p["skip"] - 1):]  # the collations after the warm-up steps
    tokens_s = (len(timed) - 1) * p["batch"] * p["seq"] / (timed[-1] - timed[0])
    if device.type == "cuda":
        memory = {"peak_memory_mib": torch.cuda.max_memory_allocated() / MIB, "memory_kind": "cuda_max_allocated"}
    else:
        memory = {"peak_memory_mib": _peak_rss_mib() - rss0, "memory_kind": "cpu_peak_rss_delta"}
    from torchrig.observe.throughput import peak_flops

    peak = peak_flops(device, "bf16")
    return {"tokens_per_s": tokens_s, "mfu": fpt * tokens_s / peak if peak else None, "flops_per_token": fpt,
            "loss": held_out_loss(model, p, device), "initial_loss": initial, "wall_s": wall, "device": str(device), **memory}


HANDLERS = {arm: (lambda params, arm=arm: child(arm, params)) for arm in ARMS}


def summarise(runs: dict, p: dict) -> dict:
    arms = {}
    for arm, rs in runs.items():
        tps = [r["tokens_per_s"] for r in rs]
        mfus = [r["mfu"] for r in rs if r["mfu"] is not None]
        arms[arm] = {"median_tokens_per_s": c.median(tps), "spread": c.spread(tps),
                     "mfu": c.median(mfus) if mfus else None,
                     "peak_memory_mib": c.median([r["peak_memory_mib"] for r in rs]),
                     "memory_kind": rs[0]["memory_kind"], "loss": rs[0]["loss"], "initial_loss": rs[0]["initial_loss"], "losses": [r["loss"] for r in rs],
                     "device": rs[0]["device"]}
    hand = arms["hand"]
    for a in arms.values():
        a["tokens_per_s_vs_hand"] = a["median_tokens_per_s"] / hand["median_tokens_per_s"]
        a["memory_vs_hand"] = a["peak_memory_mib"] / hand["peak_memory_mib"] if hand["peak_memory_mib"] > 0 else None
    return arms


def main() -> None:
    if c.child_main(HANDLERS):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 1 run of 6 steps, 4 arms")
    a = ap.parse_args()
    cuda = not a.quick and _cuda_available()  # --quick: the parent imports no torch
    p = dict(GPT2_SMALL if cuda and not a.quick else TINY)
    names = list(ARMS)
    if a.quick:
        a.runs, names = 1, list(QUICK_ARMS)
        p.update(steps=6, skip=2)
    if a.steps:
        p["steps"] = a.steps
    runs = c.alternate(Path(__file__), {n: p for n in names}, a.runs, warmup=not a.quick)
    arms = summarise(runs, p)
    _print(arms, p)
    same = abs(arms["fused_head"]["loss"] - arms["trainer"]["loss"])
    path = c.write_result(NAME, {"config": p, "runs": a.runs, "arms": arms, "fused_head_loss_diff": same,
                                 "mfu_formula": "6*N + 12*L*T*d FLOPs per token, N without the embedding tables",
                                 "target": "none: reported figures",
                                 "meets_target": True}, quick=a.quick)
    print(f"wrote {path}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _print(arms: dict, p: dict) -> None:
    rows = [[n, a["median_tokens_per_s"], a["tokens_per_s_vs_hand"], "-" if a["mfu"] is None else a["mfu"],
             a["peak_memory_mib"], a["loss"]] for n, a in arms.items()]
    print(f"{p['layers']} layers, d={p['dim']}, vocab {p['vocab']}, {p['batch']}×{p['seq']} tokens, "
          f"{p['steps']} steps ({p['skip']} warm-up) on {next(iter(arms.values()))['device']}")
    print(c.table(["arm", "tokens/s", "× hand", "MFU", f"peak MiB ({next(iter(arms.values()))['memory_kind']})",
                   "held-out loss"], rows))
    bad = [n for n, a in arms.items() if not math.isfinite(a["loss"])]
    if bad:
        print(f"non-finite loss: {', '.join(bad)}")


if __name__ == "__main__":
    main()
