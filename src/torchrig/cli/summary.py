"""``torchrig summary [CONFIG]``: the model summary a run of CONFIG prints at its start, without training."""

from __future__ import annotations

from . import add_common, register_command, run_args, set_arg


def cmd_summary(args) -> int:
    from ..recipes.run import run_without_training

    with run_without_training(args.config, args.overrides, args.recipe, args.model, args.data) as (_, trainer):
        print(trainer.summary())
    return 0


@register_command
def _add(sub) -> None:
    p = sub.add_parser("summary", help="the model's top-level modules, parameters and memory estimate, without training",
                       description="Build CONFIG's model and optimizer as torchrig train would and print the summary a "
                                   "run prints at its start (log.summary): each top-level module, its parameters "
                                   "(trainable, frozen) and size; the totals; the memory of weights, gradients and "
                                   "optimizer state per process.")
    p.add_argument("config", nargs="?", help="YAML config file (optional: the default digits job)")
    run_args(p)
    set_arg(p)
    add_common(p)
    p.set_defaults(handler=cmd_summary)
