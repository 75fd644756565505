"""``torchrig summary [CONFIG]``: the model summary a run of CONFIG prints at its start, without training."""

from __future__ import annotations

from . import add_common, register_command, set_arg


def cmd_summary(args) -> int:
    from ..recipes.run import build_config, build_run

    factories = [f"{key}={spec}" for key, spec in (("model.factory", args.model), ("data.factory", args.data)) if spec]
    import tempfile

    cfg = build_config(args.config, args.overrides + factories, args.recipe)
    with tempfile.TemporaryDirectory() as unused:  # a recipe may name files in the run directory; none is written
        cfg.run_dir = cfg.run_dir or unused
        _, _, trainer = build_run(cfg)
        try:
            print(trainer.summary())
        finally:
            trainer.close()
    return 0


@register_command
def _add(sub) -> None:
    p = sub.add_parser("summary", help="the model's top-level modules, parameters and memory estimate, without training",
                       description="Build CONFIG's model and optimizer as torchrig train would and print the summary a "
                                   "run prints at its start (log.summary): each top-level module, its parameters "
                                   "(trainable, frozen) and size; the totals; the memory of weights, gradients and "
                                   "optimizer state per process.")
    p.add_argument("config", nargs="?", help="YAML config file (optional: the default digits job)")
    p.add_argument("--recipe", help="recipe name (overrides the config's 'recipe')")
    p.add_argument("--model", metavar="MODULE:FN", help="your model, as for torchrig train")
    p.add_argument("--data", metavar="MODULE:FN", help="your data, as for torchrig train")
    set_arg(p)
    add_common(p)
    p.set_defaults(handler=cmd_summary)
