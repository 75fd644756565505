"""Long sequences: tokens/s and peak memory of a causal LM at sequence lengths up to 32 k, padded against packed
documents, and one process against context parallelism (``parallel.cp=2``).

The model is ``benchmarks/lm.py``'s plain-PyTorch GPT, taking ``position_ids`` as packed rows need: attention
through ``F.scaled_dot_product_attention``, causal over the row, or masked per document when the row is packed
(``torchrig.data.document_mask``: the dense boolean mask on the CPU, where FlexAttention has no backward with
torch 2.14; FlexAttention's ``BlockMask`` under ``torch.compile`` on CUDA). Every arm trains through ``Trainer``
(AdamW, clipping at 1.0, bf16 autocast on CUDA, the loss over the valid tokens) in a fresh process. The documents
are the same for every arm of a length: token documents whose lengths follow a log-normal law (median an eighth
of the row, cut to 8 … the row), as web text does. Arms, for each sequence length ``T``:

- ``padded@T``: one document per row, padded to ``T`` (labels -100 on the padding): what a loader without packing
  does; ``packed@T``: the same documents packed by ``torchrig.data.PackedDocuments`` (``data.pack``);
- ``stream@T``: the documents joined and cut into rows of ``T`` (every token used, attention crossing documents:
  the long-context pre-training layout) in one process, and ``cp2@T``: the same under ``parallel.cp=2`` with two
  processes (``torchrig launch``), whose per-rank activation memory should be about half. PyTorch's ring attention
  has no CPU kernel (torch 2.14), and one GPU cannot hold two NCCL ranks: ``cp2`` runs with two or more GPUs and is
  reported as not run otherwise.

Per arm: valid tokens trained per second (labels that are not -100) over the steps after the first, the share of
the rows' tokens that are valid (for ``packed``, over the whole corpus of at least 32 rows), and peak memory (CUDA: ``max_memory_allocated``; CPU: peak RSS less the RSS before
the model was built). Sizes: on the CPU a tiny model (2 layers, d=64, vocabulary 512) at 2 k, 4 k, 8 k and 16 k
tokens, about 16 k tokens a step, 4 steps; on CUDA GPT-2 small's shape at 2 k … 32 k, 64 k tokens a step.
``--quick``: 128 and 256 tokens, 3 steps, one run.

Usage: ``python benchmarks/long_context.py [--runs 1] [--lengths 2048,8192] [--quick]``. Writes
``results/long_context.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import lm  # noqa: E402

NAME = "long_context"
CPU = dict(layers=2, dim=64, heads=2, vocab=512, tokens_per_step=16384, steps=4, lengths=[2048, 4096, 8192, 16384])
CUDA = dict(layers=12, dim=768, heads=12, vocab=50257, tokens_per_step=65536, steps=8,
            lengths=[2048, 4096, 8192, 16384, 32768])
QUICK = dict(CPU, tokens_per_step=1024, steps=3, lengths=[128, 256])
LAYOUTS = ("padded", "packed", "stream", "cp2")


def documents(p: dict, seq: int, tokens: int) -> list:
    """Token documents of ``tokens`` tokens in all, log-normal lengths (median seq / 8, cut to 8 … seq)."""
    import torch

    g = torch.Generator().manual_seed(seq)
    docs, total = [], 0
    while total < tokens:
        n = int(min(seq, max(8, math.exp(math.log(seq / 8) + 0.9 * float(torch.randn((), generator=g))))))
        docs.append(torch.randint(1, p["vocab"], (n,), generator=g))
        total += n
    return docs


def rows(layout: str, p: dict, seq: int):
    """The training rows of ``layout`` as ``{"input_ids", "labels"[, "position_ids"]}`` samples."""
    import torch

    from torchrig.data import PackedDocuments

    batch = max(1, p["tokens_per_step"] // seq)
    # the same documents for every layout of a length: a corpus of at least 32 rows, so that packing has documents
    # to fill its rows with (the rows trained are the first ones)
    docs = documents(p, seq, max(batch * p["steps"], 32) * seq)
    if layout == "packed":
        return PackedDocuments(docs, seq)
    if layout == "padded":
        docs = docs[:batch * p["steps"]]
        ids = torch.zeros(len(docs), seq, dtype=torch.long)
        labels = torch.full((len(docs), seq), -100, dtype=torch.long)
        for i, d in enumerate(docs):
            ids[i, :len(d)], labels[i, 1:len(d)] = d, d[1:]
        return [{"input_ids": ids[i], "labels": labels[i]} for i in range(len(docs))]
    stream = torch.cat(docs)[:batch * p["steps"] * seq].view(-1, seq)
    return [{"input_ids": r, "labels": r} for r in stream]


def build_model(p: dict, seq: int):
    """lm.py's GPT with ``forward(input_ids, position_ids=None)``: positions from the row when given (packed rows
    restart them with each document, and then attention is masked per document)."""
    import torch
    import torch.nn.functional as F

    from torchrig.data import document_mask

    gpt = lm.build_model(dict(p, seq=seq))
    attend = torch.compile(_flex()) if torch.cuda.is_available() else None

    def block_forward(block, x, mask):
        b, t, d = x.shape
        q, k, v = block.qkv(block.ln1(x)).view(b, t, 3, p["heads"], d // p["heads"]).permute(2, 0, 3, 1, 4)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif attend is not None:
            y = attend(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + block.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + block.mlp(block.ln2(x))

    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = gpt

        def forward(self, input_ids, position_ids=None):
            m, mask = self.gpt, None
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            elif bool((position_ids[:, 1:] == 0).any()):  # documents packed in the row
                mask = document_mask(position_ids, dense=attend is None)
            x = m.tokens(input_ids) + m.positions(position_ids)
            for block in m.blocks:
                x = block_forward(block, x, mask)
            return m.head(m.ln_f(x))

    return Positions()


def _flex():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def lm_loss(logits, labels):
    """Position t predicts label t + 1; the mean over the valid ones (torchrig weighs windows by that count)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def child(arm: str, p: dict) -> dict:
    import torch
    from torch.utils.data import DataLoader, default_collate

    import torchrig

    layout, seq = arm.split("@")[0], int(arm.split("@")[1])
    c.pin_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rss0 = lm._rss_mib()
    data = rows(layout, p, seq)
    batch = max(1, p["tokens_per_step"] // seq)
    stamps: list = []

    def collate(samples):
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return default_collate(samples)

    valid = sum(int((r["labels"][1:] != -100).sum()) for r in (data[i] for i in range(batch * p["steps"])))
    torch.manual_seed(0)
    model = build_model(p, seq)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = torchrig.Trainer(model, optimizer="adamw", lr=lm.LR, loss=lm_loss, metrics=[], clip_grad_norm=1.0,
                                   precision="bf16" if device.type == "cuda" else "fp32", epochs=1, max_steps=p["steps"],
                                   run_dir=run_dir, seed=0, threads=1, plot=False, checkpoint_every_epochs=0,
                                   shuffle=False, cp=2 if layout == "cp2" else 1)
        trainer.fit(DataLoader(data, batch_size=batch, collate_fn=collate))
        loss = trainer.history[-1].get("train/loss") if trainer.history else None
        trainer.close()
    timed = stamps[1:p["steps"] + 1]  # collation of step 2 … the end of the last step (the loader's next call)
    per_step = valid / p["steps"]
    tokens_s = (len(timed) - 1) * per_step / (timed[-1] - timed[0]) if len(timed) > 1 else float("nan")
    memory = (torch.cuda.max_memory_allocated() / lm.MIB if device.type == "cuda" else lm._peak_rss_mib() - rss0)
    used = data.used if hasattr(data, "used") else valid / (batch * p["steps"] * (seq - 1))
    return {"valid_tokens_per_s": tokens_s, "tokens_used": used, "peak_memory_mib": memory, "batch": batch,
            "loss": loss, "device": str(device)}


HANDLERS = {f"{layout}@{seq}": (lambda params, a=f"{layout}@{seq}": child(a, params))
            for layout in LAYOUTS for seq in sorted({*CPU["lengths"], *CUDA["lengths"], *QUICK["lengths"]})}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run_cp2(p: dict, seq: int) -> dict:
    """``cp2@seq`` in two processes (``torchrig launch``; rank 0's figures)."""
    argv = [sys.executable, "-m", "torchrig", "launch", "--nproc-per-node", "2", "--", str(Path(__file__)),
            "--child-cp", f"cp2@{seq}", json.dumps(p)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=str(Path(__file__).parent.parent))
    if out.returncode != 0:
        raise RuntimeError(f"cp2@{seq} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child-cp":
        result = child(sys.argv[2], json.loads(sys.argv[3]))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    if c.child_main(HANDLERS):
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default: per device)")
    ap.add_argument("--quick", action="store_true", help="128 and 256 tokens, 3 steps, one run")
    a = ap.parse_args()
    gpus = 0 if a.quick else _gpus()
    p = dict(QUICK if a.quick else CUDA if gpus else CPU)
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else p.pop("lengths")
    p.pop("lengths", None)
    arms = {f"{layout}@{seq}": p for seq in lengths for layout in LAYOUTS[:3]}
    runs = c.alternate(Path(__file__), arms, 1 if a.quick else a.runs, warmup=False)
    results = {name: _median(rs) for name, rs in runs.items()}
    for seq in lengths:
        results[f"cp2@{seq}"] = run_cp2(p, seq) if gpus >= 2 else {
            "not_run": "parallel.cp=2 needs two GPUs here: PyTorch's ring attention has no CPU kernel (torch 2.14)"}
    summary = _summary(results, lengths)
    _print(results, summary, lengths, p)
    path = c.write_result(NAME, {"config": p, "lengths": lengths, "runs": a.runs, "arms": results, "summary": summary,
                                 "target": "packed/padded valid tokens/s > 1; cp2/stream memory per rank < 1",
                                 "meets_target": all(s["packed_vs_padded"] > 1 for s in summary.values())},
                          quick=a.quick)
    print(f"wrote {path}")


def _median(rs: list) -> dict:
    out = dict(rs[0])
    out["valid_tokens_per_s"] = c.median([r["valid_tokens_per_s"] for r in rs])
    out["peak_memory_mib"] = c.median([r["peak_memory_mib"] for r in rs])
    return out


def _summary(results: dict, lengths: list) -> dict:
    out = {}
    for seq in lengths:
        padded, packed, stream, cp2 = (results[f"{k}@{seq}"] for k in LAYOUTS)
        out[str(seq)] = {"packed_vs_padded": packed["valid_tokens_per_s"] / padded["valid_tokens_per_s"],
                         "padded_tokens_used": padded["tokens_used"], "packed_tokens_used": packed["tokens_used"],
                         "cp2_memory_vs_stream": (cp2["peak_memory_mib"] / stream["peak_memory_mib"]
                                                  if "peak_memory_mib" in cp2 else None)}
    return out


def _print(results: dict, summary: dict, lengths: list, p: dict) -> None:
    device = results[f"padded@{lengths[0]}"]["device"]
    print(f"{p['layers']} layers, d={p['dim']}, vocab {p['vocab']}, ~{p['tokens_per_step']} tokens a step, "
          f"{p['steps']} steps on {device}")
    rows_ = [[name, r.get("batch", "-"), r.get("valid_tokens_per_s", "-"), r.get("tokens_used", "-"),
              r.get("peak_memory_mib", "-") if "not_run" not in r else "not run"] for name, r in results.items()]
    print(c.table(["arm", "rows/step", "valid tokens/s", "tokens used", "peak MiB"], rows_))
    for seq in lengths:
        s = summary[str(seq)]
        print(f"{seq} tokens: packed / padded valid tokens/s {s['packed_vs_padded']:.2f}× "
              f"(tokens used {s['packed_tokens_used']:.1%} against {s['padded_tokens_used']:.1%})")


if __name__ == "__main__":
    main()
