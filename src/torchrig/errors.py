"""The base class of every torchrig error, and the "did you mean" hint every message shares.

This module imports nothing but the standard library, so every layer (config, runtime, models,
data, metrics, checkpoint, trainer, recipes, cli) may import it without pulling in another.

Each torchrig error also keeps a built-in base that says what kind of problem it is
(``ConfigError`` is a ``ValueError``, ``CheckpointError`` a ``RuntimeError`` …), so code that
catches ``ValueError`` keeps working, and ``except torchrig.TorchrigError`` catches all of them:
a bad input that the message explains, as opposed to a bug.
"""

from __future__ import annotations

import difflib
import os
from typing import Iterable


class TorchrigError(Exception):
    """A problem with the user's input or environment; the message names it, the bad value and the fix."""


def suggest(name: str, options: Iterable[str], *, listing: str = "", n: int = 1, cutoff: float = 0.6,
            prefix: str = "") -> str:
    """The end of an "unknown ``name``" message, worded the same everywhere.

    ``"; did you mean 'adam'?"`` when one of ``options`` is close to ``name`` (up to ``n`` of them:
    ``"; did you mean 'a', 'b' or 'c'?"``), else ``""``; each shown with ``prefix`` before it (the section of a
    key: ``'optim.lr'`` for ``optim.lrr``, matched among the section's own names). A ``listing`` sentence (e.g.
    ``"Valid names: sgd, adam"``) follows the hint, or ends the message on its own:
    ``"; did you mean 'adam'? Valid names: sgd, adam"`` / ``". Valid names: sgd, adam"``.
    """
    close = difflib.get_close_matches(str(name), [str(o) for o in options], n=n, cutoff=cutoff)
    hint = ""
    if close:
        quoted = [f"'{prefix}{c}'" for c in close]
        shown = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        hint = f"; did you mean {shown}?"
    if not listing:
        return hint
    return f"{hint or '.'} {listing}"


_COMMAND_LINE: list = []  # the torchrig commands running ("train" ...): messages name settings as their --set does


class command_line:
    """``with command_line("train"):`` the torchrig command ``train`` is running; :func:`setting` speaks its
    syntax, and :func:`continue_run` names its short resume command."""

    def __init__(self, command: str = "") -> None:
        self.command = command

    def __enter__(self) -> "command_line":
        _COMMAND_LINE.append(self.command)
        return self

    def __exit__(self, *exc: object) -> None:
        _COMMAND_LINE.pop()


def same_run() -> str:
    """How to run the same job again where the user is: the same command, or the same Trainer arguments and."""
    return "the same command and" if _COMMAND_LINE else "the same Trainer arguments and"


def short_resume(run_dir: object) -> str:
    """``torchrig train --set run_dir=R --set resume=latest`` while ``torchrig train`` runs in one process (it reads
    the run's settings back from its checkpoint), else "". Under a launcher (torchrun sets WORLD_SIZE, srun
    SLURM_NTASKS) the layout's keys (``parallel``, ``dist``) are the command's own, so the same command is named."""
    launched = any(os.environ.get(k, "1").strip() not in ("", "0", "1") for k in ("WORLD_SIZE", "SLURM_NTASKS"))
    if not _COMMAND_LINE or _COMMAND_LINE[-1] != "train" or launched:
        return ""
    return f"torchrig train {settings(('run_dir', str(run_dir)), ('resume', 'latest'))}"


def continue_run(run_dir: object) -> str:
    """How to continue the run in ``run_dir`` where the user is: :func:`short_resume` on the command line of
    ``torchrig train``, else the same command (or Trainer arguments) with ``run_dir`` and ``resume=latest``."""
    return short_resume(run_dir) or f"{same_run()} {settings(('run_dir', str(run_dir)), ('resume', 'latest'))}"


def setting(key: str, value: object) -> str:
    """How the user sets ``key`` to ``value`` where they are: ``--set resume=latest`` on the command line,
    ``resume="latest"`` / ``overwrite=True`` as a Trainer keyword in Python (``**{"a.b": 1}`` for a dotted key)."""
    if _COMMAND_LINE:
        shown = str(value).lower() if isinstance(value, bool) else value
        return f"--set {key}={shown}"
    python = f'"{value}"' if isinstance(value, str) else repr(value)
    return f"**{{\"{key}\": {python}}}" if "." in key else f"{key}={python}"


def argument(name: str, value: str) -> str:
    """How the user passes an argument of a command that is also a Python keyword: ``--activation none`` on the
    command line, ``activation="none"`` in Python."""
    return f"--{name.replace('_', '-')} {value}" if _COMMAND_LINE else f'{name}="{value}"'


def settings(*pairs: tuple[str, object]) -> str:
    """Several settings as the user gives them together: ``--set a=1 --set b=2`` or ``a=1, b=2``."""
    return (" " if _COMMAND_LINE else ", ").join(setting(k, v) for k, v in pairs)


__all__ = ["TorchrigError", "argument", "command_line", "continue_run", "same_run", "setting", "settings",
           "short_resume", "suggest"]
