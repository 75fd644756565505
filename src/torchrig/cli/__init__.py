"""The ``torchrig`` command: train, evaluate, predict, export, plot, doctor, launch, data, config, tune.

Every error ends in one line on stderr and a non-zero exit; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from ..errors import command_line

EXIT_USAGE = 2
EXIT_ERROR = 1


def add_common(p: argparse.ArgumentParser, root: bool = False) -> None:
    # A sub-command's default must not override `torchrig --debug COMMAND`: only the root sets False.
    p.add_argument("--debug", action="store_true", default=False if root else argparse.SUPPRESS,
                   help="show the full traceback on errors")


def set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=0.01 (repeatable)")


def run_args(p: argparse.ArgumentParser, detailed: bool = False) -> None:
    """What a command that builds a run takes besides its config: the recipe, the user's model and data."""
    p.add_argument("--recipe", help="recipe name (overrides the config's 'recipe')")
    if detailed:
        p.add_argument("--model", metavar="MODULE:FN", help="your model: FN(config) returns an nn.Module, imported "
                       "from MODULE with the current directory on sys.path (config key model.factory)")
        p.add_argument("--data", metavar="MODULE:FN", help="your data: FN(config) returns the training data, "
                       "(train, val) or (train, val, test) (config key data.factory; recipe 'custom' unless one is "
                       "named)")
    else:
        p.add_argument("--model", metavar="MODULE:FN", help="your model, as for torchrig train")
        p.add_argument("--data", metavar="MODULE:FN", help="your data, as for torchrig train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrig", description="Train PyTorch models on one CPU, one GPU, many GPUs or many machines.")
    add_common(parser, root=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("train", help="train a recipe (default: a small CNN on the embedded digits)",
                       description="Train from a YAML config and --set overrides. With no arguments, trains the "
                                   "embedded default job (a small CNN on the 8x8 digits).")
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    run_args(p, detailed=True)
    p.add_argument("--profile", action="store_true",
                   help="profile optimizer steps 10-15 (or profile.steps) with torch.profiler; writes RUN_DIR/profile")
    set_arg(p)
    add_common(p)

    p = sub.add_parser("evaluate", help="evaluate a checkpoint on its recipe's test split",
                       description="Rebuild the model from the checkpoint's config, load its weights and evaluate.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, run directory or .../latest")
    p.add_argument("--split", default="test", help="data split to evaluate (default: test)")
    p.add_argument("--json", action="store_true", help="print one JSON object of metrics")
    set_arg(p)
    add_common(p)

    _add_predict(sub)

    p = sub.add_parser("plot", help="write the loss / metric / lr curves of a run (or several, overlaid) as PNG",
                       description="One panel per metric family, train and validation together, lr on its own "
                                   "panel. Several run directories are overlaid for comparison.")
    p.add_argument("run_dir", nargs="+", help="run directory holding metrics.jsonl (several: overlay them)")
    p.add_argument("--out", help="output .png file or folder (default RUN_DIR/plots/curves.png; several runs: "
                                 "./compare.png)")
    add_common(p)

    p = sub.add_parser("doctor", help="report versions, devices, backends and known problems")
    p.add_argument("--hang", metavar="RUN_DIR", help="read the dumps a hang left in RUN_DIR/hang (dist.hang_timeout): "
                                                     "the summary, and where each rank was, with its frames")
    p.add_argument("--gpus", action="store_true", help="time a matmul and an allocation on every device (and, under "
                                                       "torchrig launch, each rank's links) and name one far below the "
                                                       "others; exit 1 if one is")
    add_common(p)

    _register_extra(sub)
    return parser


def _add_predict(sub) -> None:
    p = sub.add_parser("predict", help="predict with a checkpoint on files or a folder",
                       description="Batched inference under inference_mode; honours --set threads=N and "
                                   "TORCH_THREAD_NUM for CPU serving.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, run directory or .../latest")
    p.add_argument("--input", required=True, help="input file or folder")
    p.add_argument("--output", required=True, help="output file (.csv or .json for classes)")
    p.add_argument("--topk", type=int, default=5, help="classes to report per input (default 5)")
    p.add_argument("--activation", choices=("auto", "softmax", "sigmoid", "exp", "none"), default="auto",
                   help="applied to the prediction: softmax over the classes (dimension 1, or the last of a token "
                        "model's (batch, positions, classes)), sigmoid or exp of each output, none for raw outputs; "
                        "auto (default): from the loss (softmax for cross_entropy, sigmoid for bce_with_logits, exp "
                        "for nll, none for a loss of your own), said in one line")
    p.add_argument("--all-outputs", action="store_true",
                   help="write the model's whole output (every per-sample field of a tuple, dict or ModelOutput, "
                        "the prediction as probabilities) to OUTPUT.npz or OUTPUT.safetensors, one array per field")
    p.add_argument("--features", action="append", default=[], metavar="LAYER",
                   help="also save the outputs of this module (a model.named_modules() name, e.g. layers.2) "
                        "as OUTPUT.features.LAYER.npy, through a forward hook (repeatable)")
    set_arg(p)
    add_common(p)


_EXTRA: list[Callable] = []


def register_command(fn: Callable) -> Callable:
    """Let other modules (launch, data) add sub-commands: ``fn(subparsers)`` returns nothing."""
    _EXTRA.append(fn)
    return fn


def _register_extra(sub) -> None:
    for module in ("torchrig.cli.launch", "torchrig.cli.data", "torchrig.cli.config", "torchrig.cli.export",
                   "torchrig.cli.tune", "torchrig.cli.summary", "torchrig.cli.lrfind", "torchrig.cli.plan"):
        try:
            __import__(module)
        except ImportError:
            pass
    for fn in _EXTRA:
        fn(sub)


def cmd_train(args) -> int:
    from ..recipes.run import build_config, run_train

    factories = [f"{key}={spec}" for key, spec in (("model.factory", args.model), ("data.factory", args.data)) if spec]
    cfg = build_config(args.config, args.overrides + factories, args.recipe)
    if args.profile and not cfg.profile.steps:
        cfg.profile.steps = [10, 15]
    run_train(cfg)
    return 0


def cmd_evaluate(args) -> int:
    import json

    from ..recipes.run import run_evaluate

    results = run_evaluate(args.checkpoint, args.split, args.overrides)
    if args.json:
        print(json.dumps(results, sort_keys=True))
    else:
        for k, v in results.items():
            print(f"{k}: {v:.6f}")
    return 0


def cmd_predict(args) -> int:
    from ..recipes.run import run_predict

    out = run_predict(args.checkpoint, args.input, args.output, args.topk, args.overrides, features=args.features,
                      all_outputs=args.all_outputs, activation=args.activation)
    print(f"predictions written to {out}")
    return 0


def cmd_plot(args) -> int:
    from ..observe.plot import plot_runs

    print(plot_runs(args.run_dir, args.out))
    return 0


def cmd_doctor(args) -> int:
    from .doctor import gpus_report, hang_report, report

    if args.gpus:
        text, bad = gpus_report()
        print(text)
        return EXIT_ERROR if bad else 0
    print(hang_report(args.hang) if args.hang else report())
    return 0


COMMANDS = {"train": cmd_train, "evaluate": cmd_evaluate, "predict": cmd_predict, "plot": cmd_plot,
            "doctor": cmd_doctor}


def main(argv: Optional[list[str]] = None, *, until_exit: bool = False) -> int:
    """Run the ``torchrig`` command ``argv`` and return its exit code. A stop signal (SIGTERM, SIGINT,
    SIGUSR1) ends it with one line and ``128 + signal`` (``RunStopped``, a ``SystemExit``) whatever it is
    doing; ``until_exit`` (the program's entry point) keeps that handler for the interpreter's exit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        argv = ["train"]  # `torchrig` alone runs the default job, like `torchrig train`
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    debug = getattr(args, "debug", False) or os.environ.get("TORCHRIG_DEBUG") == "1"
    if args.command != "launch":
        warn_once_per_job()
        _one_line_warnings()
    handler = COMMANDS.get(args.command) or getattr(args, "handler", None)
    stop = _stop_signal(args.command)
    try:
        with command_line(args.command):  # messages name settings as --set does
            return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("torchrig: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torchrig ... | head`: the reader has what it wanted; end quietly
        _quiet_stdout()
        return 0
    except SystemExit:
        raise
    except BaseException as exc:  # one clear line; --debug for the traceback
        if debug:
            raise
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kind = "" if _is_user_error(exc) else f"{type(exc).__name__}: "
        if _is_user_error(exc):
            _after_rank_zero()
        print(f"torchrig: error: {kind}{msg}" + ("" if _is_user_error(exc) else " (run with --debug for the traceback)"),
              file=sys.stderr)
        return EXIT_ERROR
    finally:
        if stop is not None:
            stop.at_exit() if until_exit else stop.uninstall()


def warn_once_per_job() -> None:
    """torchrig's own warnings (a setting ignored on the CPU, a deprecated key) from the first process only: under
    ``torchrig launch``, torchrun or Slurm every process would print the same line. Errors still come from every
    rank, and other libraries' warnings are left as they are."""
    import warnings

    if _rank_from_env() > 0:
        warnings.filterwarnings("ignore", module=r"torchrig(\.|$)")


def _rank_from_env() -> int:
    """This process's rank as torchrun (``RANK``) or srun (``SLURM_PROCID``) gives it, before any process group;
    0 when neither does."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(rank) if rank.isdigit() else 0


WAIT_FOR_RANK_ZERO_S = 3.0


def _after_rank_zero() -> None:
    """Under torchrun (``torchrig launch``), a process other than rank 0 waits a moment before printing its error:
    a setting every process refuses alike is then said once, by rank 0, whose exit makes torchrun end the others
    (a SIGTERM that now ends this one at once, silently); an error of this process alone is still printed after
    the wait, while the others wait for it."""
    import signal
    import time

    if "TORCHELASTIC_RUN_ID" not in os.environ or _rank_from_env() == 0:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(WAIT_FOR_RANK_ZERO_S)


def _one_line_warnings() -> None:
    """torchrig's warnings on the command line as one line, ``torchrig: warning: …``, without the file and the source
    line Python adds (which speak of torchrig's insides, not of the user's settings)."""
    import warnings

    plain = warnings.formatwarning
    if getattr(plain, "torchrig", False):  # installed by an earlier command of this process
        return

    def formatwarning(message, category, filename, lineno, line=None):  # noqa: ANN001 (warnings' own signature)
        if "torchrig" in Path(filename).parts and category is UserWarning:
            return f"torchrig: warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    formatwarning.torchrig = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def entry() -> None:
    """The ``torchrig`` program (console script, ``python -m torchrig``)."""
    sys.exit(main(until_exit=True))


def _stop_signal(command: str):
    """The command's stop handler (training installs its own for the loop, inside this one); ``launch``
    leaves signals to torchrun, which passes them on to its workers."""
    if command == "launch":
        return None
    from ..runtime.signals import STARTING, StopSignal

    where = {"train": STARTING, "tune": "during torchrig tune, between trials; continue the study with "
                                        "torchrig tune --study-dir DIR --resume"}
    return StopSignal(where=where.get(command, f"during torchrig {command}; run it again")).install()


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _is_user_error(exc: BaseException) -> bool:
    """Errors whose message is the whole story: torchrig's own, and files that are missing or
    not readable (the message names the file)."""
    from ..errors import TorchrigError

    return isinstance(exc, (TorchrigError, FileNotFoundError, PermissionError))


if __name__ == "__main__":
    sys.exit(main())
