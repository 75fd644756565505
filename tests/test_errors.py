"""One error base class for every torchrig error, one "did you mean" wording, and the CLI's use of both."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import torchrig
from torchrig import cli
from torchrig.errors import TorchrigError, suggest


@pytest.mark.parametrize("name,options,kw,expected", [
    ("adamx", ["sgd", "adam", "adamw"], {}, "; did you mean 'adam'?"),
    ("zzz", ["sgd", "adam"], {}, ""),
    ("layer", ["layers", "layer1", "layer2", "head"], {"n": 3}, "; did you mean 'layers', 'layer2' or 'layer1'?"),
    ("adamx", ["sgd", "adam"], {"listing": "Valid names: sgd, adam"}, "; did you mean 'adam'? Valid names: sgd, adam"),
    ("zzz", ["sgd", "adam"], {"listing": "Valid names: sgd, adam"}, ". Valid names: sgd, adam"),
    ("nproc", ["--nproc-per-node"], {"cutoff": 0.0}, "; did you mean '--nproc-per-node'?"),
])
def test_suggest_wording(name, options, kw, expected):
    assert suggest(name, options, **kw) == expected


def _torchrig_exception_classes() -> list[type]:
    found = {}
    for info in pkgutil.walk_packages(torchrig.__path__, "torchrig."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            # errors, not exits: RunStopped is a SystemExit that ends a signalled run with its exit code
            if isinstance(value, type) and issubclass(value, Exception) and value.__module__.startswith("torchrig"):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


def test_every_torchrig_error_is_a_torchrig_error_with_its_builtin_kind():
    classes = _torchrig_exception_classes()
    names = {c.__name__ for c in classes}
    assert {"ConfigError", "CheckpointError", "RuntimeSetupError", "NonFiniteLossError", "DataError",
            "RecipeError", "MetricError", "PlotError", "LaunchError", "InitError", "UnknownNameError"} <= names
    for cls in classes:
        assert issubclass(cls, TorchrigError), f"{cls.__module__}.{cls.__name__} does not derive from TorchrigError"
        if cls is not TorchrigError:  # and keeps a built-in kind, so `except ValueError` callers still work
            kinds = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
            assert kinds, f"{cls.__name__} has no built-in base such as ValueError or RuntimeError"


def test_builtin_bases_are_kept():
    from torchrig.checkpoint import CheckpointError
    from torchrig.config import ConfigError
    from torchrig.trainer import NonFiniteLossError

    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, RuntimeError)
    assert issubclass(NonFiniteLossError, FloatingPointError)
    assert torchrig.TorchrigError is TorchrigError


def test_cli_reports_any_torchrig_error_as_one_plain_line(monkeypatch, capsys):
    class NewKindOfError(TorchrigError, ValueError):
        pass

    def fails(args):
        raise NewKindOfError("widget 'x' is broken; use another widget")

    monkeypatch.setitem(cli.COMMANDS, "doctor", fails)
    assert cli.main(["doctor"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == "torchrig: error: widget 'x' is broken; use another widget\n"


def test_cli_names_the_type_of_an_unexpected_error(monkeypatch, capsys):
    def fails(args):
        raise ValueError("internal")

    monkeypatch.setitem(cli.COMMANDS, "doctor", fails)
    assert cli.main(["doctor"]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == \
        "torchrig: error: ValueError: internal (run with --debug for the traceback)\n"


@pytest.mark.parametrize("command, env, expected", [
    ("train", {}, "torchrig train --set run_dir=runs/x --set resume=latest"),  # the run's settings are read back
    ("train", {"WORLD_SIZE": "2"}, "the same command and --set run_dir=runs/x --set resume=latest"),  # a launcher's
    ("train", {"SLURM_NTASKS": "4"}, "the same command and --set run_dir=runs/x --set resume=latest"),  # layout keys
    ("tune", {}, "the same command and --set run_dir=runs/x --set resume=latest"),
    (None, {}, 'the same Trainer arguments and run_dir="runs/x", resume="latest"'),
])
def test_how_to_continue_a_run_where_the_user_is(monkeypatch, command, env, expected):
    from torchrig.errors import command_line, continue_run

    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if command is None:
        assert continue_run("runs/x") == expected
    else:
        with command_line(command):
            assert continue_run("runs/x") == expected
