"""``torchrig lr-find [CONFIG]``: the learning-rate finder on CONFIG's model, optimizer and training data."""

from __future__ import annotations

from . import add_common, register_command, run_args, set_arg


def cmd_lr_find(args) -> int:
    from ..recipes.run import run_without_training

    with run_without_training(args.config, args.overrides, args.recipe, args.model, args.data) as (data, trainer):
        result = trainer.find_lr(data["train"], start_lr=args.start_lr, end_lr=args.end_lr, steps=args.steps,
                                 plot=args.out)
    if result.suggestion is not None and trainer.is_main:
        print(f"torchrig: train with it: --set optim.lr={result.suggestion:.3g}")
    return 0


@register_command
def _add(sub) -> None:
    p = sub.add_parser("lr-find", help="the learning-rate finder: an exponential lr sweep, a plot and a suggested lr",
                       description="Train STEPS batches of CONFIG's training data at learning rates growing "
                                   "exponentially from --start-lr to --end-lr, on a copy of the model and optimizer, and "
                                   "suggest a learning rate (rule: where the smoothed loss falls fastest, before its "
                                   "minimum). Writes the loss-against-lr curve as a PNG. Runs under torchrig launch "
                                   "(DDP) too.")
    p.add_argument("config", nargs="?", help="YAML config file (optional: the default digits job)")
    p.add_argument("--start-lr", type=float, default=1e-7, metavar="LR", help="the first learning rate (default 1e-7)")
    p.add_argument("--end-lr", type=float, default=10.0, metavar="LR", help="the last learning rate (default 10)")
    p.add_argument("--steps", type=int, default=200, metavar="N", help="batches in the sweep (default 200)")
    p.add_argument("--out", default="lr_find.png", metavar="FILE.png", help="the plot (default ./lr_find.png)")
    run_args(p)
    set_arg(p)
    add_common(p)
    p.set_defaults(handler=cmd_lr_find)
