"""Per-rank memory of tensor and pipeline parallelism, and the pipeline's bubble.

**Memory**: bytes of parameters + gradients + optimizer state held by one rank at tp=2 and at pp=2 against one
process, for a stack of transformer blocks trained by ``Trainer.fit`` with AdamW. The bytes are counted, not
sampled from the allocator: for every parameter this rank holds, its piece (a DTensor's local tensor), its
gradient's piece and the optimizer's state tensors for it, at the end of an optimizer step (before the next
step frees the gradients). With every linear layer of a block planned (q, k, v, MLP up: ``colwise``; attention
output, MLP down: ``rowwise``), tp=2 holds a little over half: the norms, the biases of the row-split layers and
the head stay whole on every rank. pp=2 cuts the blocks in two halves (``parallel.pp_split: auto``); the head
goes to the second stage, which holds a little over half.

**Logits**: the bytes of the output layer's output that the loss reads on one rank, for a language model's head
(an output layer over a vocabulary of ``VOCAB`` classes for every token) with ``parallel.loss_parallel`` on at tp=2
against tp=2 with it off and one process. The head is planned ``colwise_loss_parallel`` in both tp=2 arms: with
loss parallelism its output stays split by class and the cross-entropy reads each rank's half (a DTensor's local
tensor); without it torchrig gathers the whole logits before the loss. Beside them, the bytes the loss keeps for
its backward (autograd's saved tensors of the loss's forward, each rank's piece).

**Bubble**: the fraction of a pipeline step a stage waits, measured against the schedule's theory
``(p − 1) / (m + p − 1)`` for GPipe and 1F1B (p stages, m micro-batches of equal cost). Each rank times its
stage's forward and backward calls (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``) and the whole
schedule step (``Pipeline.train``); a step lasts until its slowest rank is done, and a rank's bubble is
``1 − busy / step``, over the steps after the first (which learns the shapes); the mean of the two ranks is
reported. The blocks have equal cost and no head, so the stages are equal; the time the activations take from one
process to the other counts as bubble too.

Two gloo processes on the CPU, one thread each (speed itself is not a goal: only the ratios).
Usage: ``python benchmarks/model_parallel.py [--quick] [--logits]`` (``--logits``: the logits arms alone).
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
VOCAB = 32768  # the output layer of the logits arms: a small language model's vocabulary (--quick: QUICK_VOCAB)
QUICK_VOCAB = 4096
LOGITS_TARGET = 0.55  # logits bytes per rank with loss parallelism / one process


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


def build_lm(vocab: int = VOCAB):
    """The blocks of :func:`build_model` under a per-token output layer over ``vocab`` classes: logits of
    ``tokens × vocab`` (the tokens flattened first, so the loss is the plain cross-entropy of 2-D logits)."""
    import torch
    from torch import nn

    blocks = build_model().blocks

    class LM(nn.Module):
        tp_plan = dict(build_model().tp_plan, head="colwise_loss_parallel")

        def __init__(self):
            super().__init__()
            self.blocks = blocks
            self.head = nn.Linear(DIM, vocab)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x.reshape(-1, DIM))

    torch.manual_seed(0)
    return LM()


class LogitsCount:
    """The loss of the logits arms: ``F.cross_entropy`` of the logits and the tokens' targets, counting the bytes
    of the logits it reads (the local piece of split logits) and of what its forward saves for the backward."""

    def __init__(self):
        self.found: dict = {"logits": 0, "loss_saved": 0}

    def __call__(self, logits, target):
        import torch
        import torch.nn.functional as F

        saved = []

        def pack(t):
            saved.append(_bytes(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(logits, target.reshape(-1))
        self.found["logits"] = max(self.found["logits"], _bytes(logits))
        self.found["loss_saved"] = max(self.found["loss_saved"], sum(saved))
        return loss


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


QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False, "checkpoint.save_final": False}
# arm -> the layout's keys and its processes
ARMS = {"one": ({}, 1), "tp2": ({"parallel.tp": 2, "parallel.tp_plan": "auto"}, 2),
        "pp2": ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, 2),
        "logits-one": ({}, 1),
        "logits-tp2": ({"parallel.tp": 2, "parallel.tp_plan": "auto", "parallel.loss_parallel": False}, 2),
        "logits-tp2-lp": ({"parallel.tp": 2, "parallel.tp_plan": "auto", "parallel.loss_parallel": True}, 2)}


def child(arm: str, rank: int, out: Path, init: str, vocab: int = VOCAB) -> None:
    import torch
    from torch.utils.data import TensorDataset

    import torchrig

    c.pin_threads()
    keys, world = ARMS[arm]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, SEQ, DIM, generator=g)
    lm = arm.startswith("logits")
    target = torch.randint(0, vocab, (16, SEQ), generator=g) if lm else torch.randint(0, CLASSES, (16,), generator=g)
    count, logits = Count(), LogitsCount()
    group = {"init_method": init, "rank": rank, "world_size": world} if world > 1 else {}
    extra = {"loss": logits} if lm else {}
    with tempfile.TemporaryDirectory() as run_dir:  # 2 steps of 2 micro-batches of 4 (a pipeline's window)
        t = torchrig.Trainer(build_lm(vocab) if lm else build_model(), optimizer="adamw", lr=1e-3, batch_size=4,
                             accumulate=2, max_steps=2, metrics=[], run_dir=run_dir, callbacks=[count], num_workers=0,
                             **QUIET, **group, **keys, **extra)
        count.watch(t.optimizers["default"])
        t.fit(TensorDataset(x, target))
        found = dict(count.found, **logits.found, loss_parallel=t.step.loss_parallel) if lm else count.found
        t.close()
    (out / f"{arm}-rank{rank}.json").write_text(json.dumps(found))


def run(arm: str, out: Path, extra: tuple = ()) -> list[dict]:
    world = ARMS[arm][1] if arm in ARMS else 2
    store = out / f"store-{arm}"
    procs = [subprocess.Popen([sys.executable, __file__, "--child", arm, str(rank), str(out), f"file://{store}",
                               *extra], env=dict(os.environ, OMP_NUM_THREADS="1")) for rank in range(world)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"benchmarks/{NAME}.py: a {arm} process failed (exit {p.returncode})")
    return [json.loads((out / f"{arm}-rank{rank}.json").read_text()) for rank in range(world)]


# ----------------------------------------------------------------------------- the bubble
BUBBLE_BLOCKS, BUBBLE_BATCH, BUBBLE_STEPS = 8, 8, 6


def bubble_child(schedule: str, m: int, steps: int, rank: int, out: Path, init: str) -> None:
    """pp=2 over equal blocks (no head): per step, this rank's busy seconds (its stage's forward and backward
    calls) and the schedule step's seconds."""
    import time

    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.utils.data import TensorDataset

    import torchrig
    from torchrig.parallel import Pipeline

    c.pin_threads()
    busy, steps_s = [0.0], []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t0
        return wrapper

    PipelineStage.forward_one_chunk = timed(PipelineStage.forward_one_chunk)
    PipelineStage.backward_one_chunk = timed(PipelineStage.backward_one_chunk)
    train = Pipeline.train

    def train_timed(self, micro_batches):
        busy[0] = 0.0
        t0 = time.perf_counter()
        train(self, micro_batches)
        steps_s.append((busy[0], time.perf_counter() - t0))

    Pipeline.train = train_timed
    torch.manual_seed(0)
    blocks = build_model().blocks[0].__class__
    model = nn.Sequential(*(blocks() for _ in range(BUBBLE_BLOCKS)))
    n = BUBBLE_BATCH * m * steps
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, SEQ, DIM, generator=g), torch.randn(n, SEQ, DIM, generator=g))
    with tempfile.TemporaryDirectory() as run_dir:
        t = torchrig.Trainer(model, optimizer="adamw", lr=1e-4, batch_size=BUBBLE_BATCH, accumulate=m, loss="mse",
                             metrics=[], run_dir=run_dir, num_workers=0, epochs=1, **QUIET,
                             init_method=init, rank=rank, world_size=2,
                             **{"parallel.pp": 2, "parallel.pp_schedule": schedule})
        t.fit(data)
        t.close()
    (out / f"bubble-{schedule}-{m}-rank{rank}.json").write_text(json.dumps(steps_s[1:]))


def bubble(schedule: str, m: int, steps: int, out: Path) -> dict:
    arm = f"bubble-{schedule}-{m}"
    parts = run(arm, out, (schedule, str(m), str(steps)))
    # a step lasts until its last stage is done (the ranks start it together: the previous step ended with an
    # all-reduce); each rank's bubble is the part of that it did not compute
    total = sum(max(p[i][1] for p in parts) for i in range(len(parts[0])))
    waits = [1 - sum(b for b, _ in p) / total for p in parts]
    return {"measured": sum(waits) / len(waits), "ranks": waits, "theory": (2 - 1) / (m + 2 - 1),
            "step_ms": 1e3 * total / len(parts[0])}


def logits_part(out: Path, vocab: int) -> dict:
    """The logits arms: one process, tp=2 with loss parallelism off and on; printed, and returned for the results."""
    logits = {arm: run(arm, out, (str(vocab),)) for arm in ("logits-one", "logits-tp2", "logits-tp2-lp")}
    one = logits["logits-one"][0]
    assert not one["loss_parallel"] and all(r["loss_parallel"] for r in logits["logits-tp2-lp"]) \
        and not any(r["loss_parallel"] for r in logits["logits-tp2"]), "loss parallelism was not on (only) where set"
    ratios = {arm: {k: max(r[k] for r in logits[arm]) / one[k] for k in ("logits", "loss_saved")}
              for arm in ("logits-tp2", "logits-tp2-lp")}
    tokens = 4 * SEQ
    print(f"logits of an output layer over {vocab} classes for {tokens} tokens a micro-batch (AdamW, 2 steps): MiB "
          f"held per rank (the largest rank) and against one process")
    names = {"logits-one": "one process", "logits-tp2": "tp=2, loss_parallel off",
             "logits-tp2-lp": "tp=2, loss_parallel on"}
    print(c.table(["", "logits the loss reads", "/ one", "saved by the loss for backward", "/ one"],
                  [[names[arm], f"{max(r['logits'] for r in ranks) / 2**20:.2f}",
                    f"{ratios.get(arm, {}).get('logits', 1.0):.3f}",
                    f"{max(r['loss_saved'] for r in ranks) / 2**20:.2f}",
                    f"{ratios.get(arm, {}).get('loss_saved', 1.0):.3f}"] for arm, ranks in logits.items()]))
    ratio = ratios["logits-tp2-lp"]["logits"]
    print(f"logits per rank with loss parallelism / one process: {ratio:.3f} (target <= {LOGITS_TARGET}: "
          f"{c.verdict(ratio, LOGITS_TARGET)})\n")
    return {"vocab": vocab, "tokens_per_micro_batch": tokens, "one_process": one, "tp2_ranks": logits["logits-tp2"],
            "tp2_loss_parallel_ranks": logits["logits-tp2-lp"], "ratios": ratios, "ratio": ratio,
            "target": LOGITS_TARGET, "meets_target": ratio <= LOGITS_TARGET}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--logits", action="store_true", help="only the logits arms (results: model_parallel_logits)")
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        arm, rank, out, init, *extra = args.child
        if arm.startswith("bubble-"):
            schedule, m, steps = extra
            return bubble_child(schedule, int(m), int(steps), int(rank), Path(out), init)
        return child(arm, int(rank), Path(out), init, *map(int, extra))
    vocab = QUICK_VOCAB if args.quick else VOCAB
    if args.logits:
        with tempfile.TemporaryDirectory() as tmp:
            part = logits_part(Path(tmp), vocab)
        c.write_result(f"{NAME}_logits", part, quick=args.quick)
        return
    with tempfile.TemporaryDirectory() as tmp:
        one = run("one", Path(tmp))[0]
        tp_ranks = run("tp2", Path(tmp))
        pp_ranks = run("pp2", Path(tmp))
        logits = logits_part(Path(tmp), vocab)
        steps = 3 if args.quick else BUBBLE_STEPS
        bubbles = {f"{schedule} m={m}": bubble(schedule, m, steps, Path(tmp))
                   for schedule in ("gpipe", "1f1b") for m in ((4,) if args.quick else (4, 8))}
    kinds = ("parameters", "gradients", "optimizer")
    total_one = sum(one[k] for k in kinds)
    ratios = {}
    for arm, ranks in (("tp=2", tp_ranks), ("pp=2", pp_ranks)):
        rows = [[k, f"{one[k] / 2**20:.2f}", *(f"{r[k] / 2**20:.2f}" for r in ranks),
                 f"{max(r[k] for r in ranks) / one[k]:.3f}"] for k in kinds]
        per_rank = [sum(r[k] for k in kinds) for r in ranks]
        ratios[arm] = max(per_rank) / total_one
        rows.append(["total", f"{total_one / 2**20:.2f}", *(f"{b / 2**20:.2f}" for b in per_rank),
                     f"{ratios[arm]:.3f}"])
        print(f"{arm}, {BLOCKS} transformer blocks of width {DIM} ({HEADS} heads), AdamW: MiB held per rank")
        print(c.table(["", "one process", f"{arm} rank 0", f"{arm} rank 1", f"{arm} / one"], rows))
        print(f"largest rank at {arm} / one process: {ratios[arm]:.3f} (target <= {TARGET}: "
              f"{c.verdict(ratios[arm], TARGET)})\n")
    print(f"pipeline bubble, pp=2 over {BUBBLE_BLOCKS} equal blocks, micro-batches of {BUBBLE_BATCH}: the fraction "
          f"of a step a stage waits (mean of the two)")
    print(c.table(["schedule", "measured", "theory (p-1)/(m+p-1)", "ms per step"],
                  [[k, f"{v['measured']:.3f}", f"{v['theory']:.3f}", f"{v['step_ms']:.1f}"]
                   for k, v in bubbles.items()]))
    ratio = max(ratios.values())
    c.write_result(NAME, {"one_process": one, "tp2_ranks": tp_ranks, "pp2_ranks": pp_ranks, "ratio": ratios["tp=2"],
                          "pp_ratio": ratios["pp=2"], "bubble": bubbles, "target": TARGET,
                          "meets_target": ratio <= TARGET and logits["meets_target"], "logits": logits,
                          "model": {"blocks": BLOCKS, "dim": DIM, "heads": HEADS}}, quick=args.quick)


if __name__ == "__main__":
    main()
