"""Worker of the plan test (tests/cli/test_plan.py), started as a group of processes joined through ``file://``:

    python tests/helpers/plan_worker.py OUT     # one optimizer step of each layout in LAYOUTS; what each rank holds

For each layout it runs ``torchrig train``'s own set-up (the digits recipe's MLP) for one step, then writes the bytes
this rank really holds: its parameters' local pieces, their gradients, the optimizer's state tensors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMON = ["model.name=mlp", "max_steps=1", "epochs=1", "threads=1", "log.progress=none", "log.tensorboard=false",
          "log.plot=false", "log.summary=false", "checkpoint.save_final=false", "checkpoint.every_epochs=0"]
LAYOUTS = {"ddp": ["dist.strategy=ddp"], "fsdp": ["parallel.dp_shard=2"],
           "tp": ["parallel.tp=2", "parallel.tp_plan=auto"], "pp": ["parallel.pp=2", "accumulate=2"]}


def nbytes(t) -> int:
    from torchrig import runtime

    t = runtime.local_tensor(t)
    return t.numel() * t.element_size()


def held(trainer, grads: list) -> dict:
    """Weights and optimizer state after the step; the gradients as the optimizer step saw them (it clears them)."""
    import torch

    from torchrig import runtime

    params = list(runtime.unwrap(trainer.model).parameters())
    state = [t for opt in trainer.optimizers.values() for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.ndim > 0]  # Adam's step counter is a scalar
    return {"weights": sum(map(nbytes, params)), "gradients": grads[0], "optimizer": sum(map(nbytes, state))}


def grads_before_the_step(grads: list):
    def hook(opt, args, kwargs):
        grads[0] = sum(nbytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)
    return hook


def main(out: Path) -> None:
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from torchrig.recipes.run import build_config, build_run

    dist.init_process_group("gloo", init_method=os.environ["TEST_INIT"], rank=int(os.environ["TEST_RANK"]),
                            world_size=int(os.environ["TEST_WORLD"]))
    figures = {}
    for name, sets in LAYOUTS.items():
        cfg = build_config(None, [*COMMON, *sets, f"run_dir={out / name}"])
        _, data, trainer = build_run(cfg)
        grads = [0]
        handle = register_optimizer_step_pre_hook(grads_before_the_step(grads))
        with trainer:
            trainer.fit(data["train"])
            figures[name] = held(trainer, grads)
        handle.remove()
    (out / f"held-{dist.get_rank()}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    main(target)
