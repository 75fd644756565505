"""``torchrig tune CONFIG --space space.yaml --trials N``: a hyperparameter search whose trials are torchrig runs."""

from __future__ import annotations

from . import add_common, register_command, run_args, set_arg


def cmd_tune(args) -> int:
    from ..tune import tune

    factories = [f"{key}={spec}" for key, spec in (("model.factory", args.model), ("data.factory", args.data)) if spec]
    result = tune(args.config, args.space, args.trials, sampler=args.sampler, pruner=args.pruner,
                  study_dir=args.study_dir, storage=args.storage, resume=args.resume, parallel=args.parallel,
                  overrides=args.overrides + factories or None, recipe=args.recipe)
    return 0 if result is None or result.best_trial is not None else 1


@register_command
def _add(sub) -> None:
    p = sub.add_parser(
        "tune", help="search hyperparameters with Optuna: each trial a torchrig run, pruned, resumable",
        description="Search the config keys of a space file (optim.lr: {log_uniform: [1e-5, 1e-1]}, data.batch_size: "
                    "{choice: [32, 64]}, model.options.width: {int: [16, 64]}) over runs of CONFIG. Each trial is a "
                    "torchrig run in STUDY_DIR/trials/N; the study is an Optuna SQLite file in STUDY_DIR. At the end: "
                    "a table of trials, STUDY_DIR/best.yaml (torchrig train takes it as it is) and STUDY_DIR/tune.png. "
                    "Needs Optuna: pip install 'torchrig[tune]'.")
    p.add_argument("config", nargs="?", help="YAML config file (optional: the default digits job)")
    p.add_argument("--space", metavar="SPACE.yaml", help="the search space: config keys (as --set names them) and "
                   "their ranges: uniform, log_uniform, int, log_int ([low, high], step optional) or choice")
    p.add_argument("--trials", type=int, metavar="N", help="trials in the study (on --resume: the new total)")
    p.add_argument("--sampler", choices=("tpe", "random", "grid"), help="how trials are chosen (default tpe)")
    p.add_argument("--pruner", choices=("median", "hyperband", "sha", "none"),
                   help="how trials are stopped early, by checkpoint.monitor after each epoch (default median; sha: "
                        "successive halving)")
    p.add_argument("--study-dir", metavar="DIR", help="where the study lives (default a new runs/tune/N; with "
                   "--resume the newest)")
    p.add_argument("--storage", metavar="URL", help="an Optuna storage URL (e.g. postgresql://…) instead of "
                   "STUDY_DIR/study.db")
    p.add_argument("--resume", action="store_true", help="continue the study: finished and pruned trials are kept, "
                   "a trial that was running continues from its latest checkpoint")
    p.add_argument("--parallel", type=int, default=1, metavar="K",
                   help="run K one-process trials at once on this machine (not under torchrun, where each trial "
                        "uses every process)")
    run_args(p)
    set_arg(p)
    add_common(p)
    p.set_defaults(handler=cmd_tune)
