"""The host-read counter in each rank of a 2-process DDP run (tests/trainer/test_host_syncs.py).

    python tests/helpers/host_reads_worker.py ddp OUT   # a file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD)

Runs the census configurations that matter under DDP with the host checks off, as on a GPU, and writes each
rank's reads in quiet steps (strictly between log steps) to ``OUT/reads-RANK.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder: ``helpers``

import torch  # noqa: E402

import torchrig  # noqa: E402
import torchrig.runtime  # noqa: E402
from helpers import fp16_precision  # noqa: E402
from helpers import step_configs as C  # noqa: E402
from helpers.host_reads import count_host_reads  # noqa: E402

DDP_CONFIGS = ("bf16-adamw", "accumulate4", "f1", "tokens", "micro-auto", "skip", "everything-fp16",
               "everything-bf16-tokens")


class DeviceLikeSteps:
    def __init__(self, calls: list):
        self.calls, self.quiet, self.log = calls, [], []

    def on_fit_start(self, trainer):
        trainer.step.host_checks = trainer.metrics_log.host = False
        self.calls.clear()

    def on_step_end(self, trainer, values):
        (self.log if trainer.global_step % C.EVERY == 0 else self.quiet).append(list(self.calls))
        self.calls.clear()

    def on_log(self, trainer, values, kind):
        self.calls.clear()


def ddp(out: Path) -> None:
    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": int(os.environ["TEST_WORLD"])}
    real = torchrig.runtime.make_precision
    torchrig.runtime.make_precision = lambda p, device: fp16_precision() if p == "fp16" else real(p, device)
    report, first = {}, None
    for name in DDP_CONFIGS:
        with count_host_reads() as calls:
            watch = DeviceLikeSteps(calls)
            opts, model, data = C.build(name, out / name, "cpu", ranks=2, callbacks=[watch], strategy="ddp",
                                         **group)
            t = torchrig.Trainer(model, **opts)
            first = first or t
            t.fit(data)
        report[name] = {"quiet": watch.quiet, "steps": t.global_step,
                        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
    (out / f"reads-{rank}.json").write_text(json.dumps(report))
    first.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"ddp": ddp}[sys.argv[1]](target)
