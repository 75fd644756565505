"""What LoRA (``peft.method: lora``) changes on the CPU: time per optimizer step and checkpoint size, against
training every parameter of the same GPT-2.

Each arm runs in a fresh process (one thread): a GPT-2 built from its config (``--layers`` blocks of width
``--width``, a vocabulary of 4,000, sequences of 64 tokens, batch 8, AdamW), trained ``--steps`` optimizer steps by
the Trainer, with a checkpoint at the end. Arms:

- ``full``       every parameter trains; the checkpoint holds the model and AdamW's two moments of every parameter
- ``lora``       rank-8 adapters on every Linear-like layer but the output layer; the checkpoint holds the adapters,
                 their AdamW state and the base's identity
- ``lora-bf16``  the same, the frozen base kept in bf16 (``peft.base_dtype: bf16``, ``precision: bf16``)

Measured: the median time of a step after the first ``--warmup`` steps (wall, one thread), the checkpoint folder's
bytes (``model.safetensors``, ``state.pt``, the rest) and the parameters that train. The ratios are LoRA / full.
Usage: ``python benchmarks/finetune.py [--layers 4] [--width 128] [--steps 30] [--runs 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "finetune"
VOCAB, LENGTH, BATCH = 4000, 64, 8


def _arm(p: dict) -> dict:
    c.pin_threads()
    import torch

    sys.path.insert(0, str(c.HERE.parent / "src"))
    from transformers import GPT2Config, GPT2LMHeadModel

    from torchrig import Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=p["layers"], n_embd=p["width"], n_head=4, vocab_size=VOCAB,
                                       n_positions=LENGTH, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, use_cache=False))
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, VOCAB, (BATCH * p["steps"], LENGTH), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    extra = {} if p["arm"] == "full" else {"peft": "lora"}
    if p["arm"] == "lora-bf16":
        extra.update(precision="bf16", **{"peft.base_dtype": "bf16"})
    stamps: list[float] = []

    class Stamp:
        def on_step_end(self, trainer, values):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="torchrig-bench-") as run:
        trainer = Trainer(model, optimizer="adamw", lr=1e-3, batch_size=BATCH, epochs=1, metrics=[], threads=1,
                          num_workers=0, run_dir=run, plot=False, tensorboard=False, progress="none", summary=False,
                          callbacks=[Stamp()], **{"checkpoint.async_save": False}, **extra)
        trainer.fit(data)
        folder = Path(run) / "checkpoints" / "latest"
        files = {f.name: f.stat().st_size for f in folder.resolve().rglob("*") if f.is_file()}
    steps = [b - a for a, b in zip(stamps, stamps[1:])][p["warmup"]:]
    return {"step_s": steps, "checkpoint_bytes": sum(files.values()), "files": files,
            "trainable": sum(q.numel() for q in model.parameters() if q.requires_grad),
            "parameters": sum(q.numel() for q in {id(q): q for q in model.parameters()}.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a 2-block model of width 64, 8 steps, one run")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.steps, args.warmup, args.runs = 2, 64, 8, 2, 1
    base = {"layers": args.layers, "width": args.width, "steps": args.steps, "warmup": args.warmup}
    arms = {name: dict(base, arm=name) for name in ("full", "lora", "lora-bf16")}
    runs = c.alternate(Path(__file__), arms, args.runs, warmup=not args.quick)
    summary = {}
    for name, results in runs.items():
        steps = [s for r in results for s in r["step_s"]]
        summary[name] = {"median_step_s": c.median(steps), "step_spread": c.spread(steps),
                         "checkpoint_bytes": results[0]["checkpoint_bytes"], "files": results[0]["files"],
                         "trainable": results[0]["trainable"], "parameters": results[0]["parameters"]}
    full = summary["full"]
    for s in summary.values():
        s["step_ratio"] = s["median_step_s"] / full["median_step_s"]
        s["checkpoint_ratio"] = s["checkpoint_bytes"] / full["checkpoint_bytes"]
    rows = [[n, f"{s['trainable']:,} of {s['parameters']:,}", f"{s['median_step_s'] * 1e3:.1f}",
             f"{s['step_ratio']:.2f}", f"{s['checkpoint_bytes'] / 2**20:.2f}", f"{s['checkpoint_ratio']:.3f}"]
            for n, s in summary.items()]
    print(c.table(["arm", "parameters that train", "ms/step", "step / full", "checkpoint (MiB)",
                   "checkpoint / full"], rows))
    path = c.write_result(NAME, {"arms": summary, "settings": base, "target": "measured", "meets_target": True},
                          quick=args.quick)
    print(f"written to {path}")


if __name__ == "__main__":
    if not c.child_main({"full": _arm, "lora": _arm, "lora-bf16": _arm}):
        main()
