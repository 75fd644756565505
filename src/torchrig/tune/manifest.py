"""What ``torchrig tune --resume`` takes from a study folder: a stranger's files, like a checkpoint's.

A study folder may come from anyone, so ``study.json`` and ``study.db`` are read back as a checkpoint's
``config.yaml`` is. A resume takes from ``study.json`` only what it needs, each field by a rule
(:data:`FIELDS`): the search space (checked by the config keys' own rules), the number of trials, the
sampler's and the pruner's names, the seed, the monitored value and the study's name. The study's config
passes the rules of a checkpoint's ``config.yaml`` (``recipes.run``): the keys of ``THIS_RUN`` (process
group, devices, threads, trackers and their URIs, run directory ...), the keys that say how to start
(``trainer.changes.NOT_COMPARED``: ``resume_changes`` ...) and those that decide which checkpoints a trial
removes (:data:`FROM_THIS_COMMAND`) take this command line's values; a factory is imported only when this
command line names it. What the command line gives now is then compared with the study's as a run's resume
compares a checkpoint's settings (``trainer.changes``), and a change is refused in one line. The storage is
never read from the folder: the folder's own ``study.db`` (a regular file, not a link), or the URL given on
this command line. Every trial read back from the storage sets exactly the space's keys to values in it
(``Space.check_values``), and a trial's run folder ``trials/N`` is a folder the study made, never a link.
The table of every field and its rule is in docs/reliability.md ("What a study folder may decide").
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .. import config as C
from ..config.files import JSON_LIMIT, file_kind, read_regular
from ..errors import TorchrigError
from ..recipes.factory import naming
from ..recipes.run import THIS_RUN, factories_read_back, joining_note, recipe_config, without_keys
from ..trainer.changes import NOT_COMPARED, changed
from .space import Space, TuneError

MANIFEST = "study.json"
DATABASE = "study.db"
DEPTH_LIMIT = 64  # levels of nested lists and mappings in study.json (torchrig writes 4 or 5)
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "hyperband", "sha", "none")
# Keys of a study's config that a resume takes from its own command line (the default, or --set), never from
# study.json: those a checkpoint's config.yaml may not decide, those that say how to start, and the number of
# checkpoints a trial keeps (which decides what it removes).
FROM_THIS_COMMAND = (*THIS_RUN, *sorted(NOT_COMPARED - set(THIS_RUN)), "checkpoint.keep_last", "checkpoint.keep_best")


def _integer(low: int, high: Optional[int] = None) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v and (high is None or v <= high)


def _name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 1000 and v.isprintable()


# The fields of study.json a resume reads: field -> (rule, what it must be).
FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "version": (lambda v: type(v) is int and v == 1, "1"),
    "study_name": (_name, "the study's name in its storage"),
    "storage": (lambda v: v is None or isinstance(v, str), "null or the storage URL the study was started with"),
    "monitor": (_name, "a logged value such as val/accuracy"),
    "mode": (lambda v: v in ("min", "max"), "min or max"),
    "sampler": (lambda v: v in SAMPLERS, f"one of {', '.join(SAMPLERS)}"),
    "pruner": (lambda v: v in PRUNERS, f"one of {', '.join(PRUNERS)}"),
    "seed": (_integer(0, 2 ** 32 - 1), "an integer in [0, 2**32)"),
    "trials": (_integer(1), "an integer >= 1"),
    "space": (lambda v: isinstance(v, dict) and bool(v), "a mapping of config keys to their ranges"),
    "config": (lambda v: isinstance(v, dict), "a mapping of config keys"),
}


def trial_dir(study_dir: Path, number: int) -> Path:
    return Path(study_dir) / "trials" / str(number)


def read_manifest(folder: Path) -> Optional[dict]:
    """``study.json`` as it was written (a regular file of at most 16 MiB holding a JSON mapping), or None."""
    path = Path(folder) / MANIFEST
    if not (path.exists() or path.is_symlink()):
        return None
    todo = "start a new study in another --study-dir"
    raw = read_regular(path, JSON_LIMIT, "study manifest", todo, TuneError)
    deep = f"its values nest more than {DEPTH_LIMIT} levels deep"
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TuneError(f"'{path}' is not a torchrig study manifest "
                        f"({deep if isinstance(exc, RecursionError) else exc}); {todo}") from None
    if not isinstance(manifest, dict):
        raise TuneError(f"'{path}' holds a {type(manifest).__name__}, not a torchrig study manifest; {todo}")
    if _depth(manifest) > DEPTH_LIMIT:
        raise TuneError(f"'{path}' is not a torchrig study manifest ({deep}); {todo}")
    return manifest


def _depth(value: Any) -> int:
    """How deep lists and mappings nest in ``value``, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def checked(manifest: dict, path: Path) -> dict:
    """The fields a resume takes from ``manifest`` (read from ``path``), each by its rule in :data:`FIELDS`."""
    out = {}
    for field, (rule, what) in FIELDS.items():
        value = manifest.get(field)
        if not rule(value):
            shown = json.dumps(value)[:80] if field not in ("space", "config") else type(value).__name__
            raise TuneError(f"'{path}': field '{field}' is {shown}, expected {what}; it is not a study this torchrig "
                            f"can resume: start a new study in another --study-dir")
        out[field] = value
    return out


def resumed_config(manifest: dict, path: Path, given: Optional[C.Config], overrides: Optional[list[str]],
                   say: Optional[Callable[[str], None]] = None) -> C.Config:
    """The config the resumed study's trials run. ``given``: the whole config given on this command line (a file,
    a Config), compared with the study's; else the study's config less :data:`FROM_THIS_COMMAND`, with this
    command line's ``overrides`` on top. A factory only study.json names is refused; so is any change of a
    setting a resumed run would refuse (``trainer.changes``), or of the trials' length."""
    saved = manifest["config"]
    if given is None:
        note = joining_note(saved, f"'{path}'")
        if note:
            (say or (lambda text: print(text, file=sys.stderr)))(note)
        try:  # the keys study.json may not decide take the defaults of the study's recipe (a name in a table)
            given = recipe_config(str(saved.get("recipe") or C.Config().recipe), without_keys(saved, FROM_THIS_COMMAND))
        except TorchrigError as exc:
            raise TuneError(f"'{path}': its config: {exc}; start a new study in another --study-dir") from None
        for item in overrides or []:
            key, _, raw = item.partition("=")
            C.set_key(given, key.strip(), raw)
        given = C.validate(given)
        for key, spec in factories_read_back(given, overrides):
            option = {"model.factory": f"--model {spec}", "data.factory": f"--data {spec}"}.get(key) \
                or naming(key, spec)
            raise TuneError(f"--resume: '{path}' names {key} '{spec}', code that torchrig imports only when this "
                            f"command line names it: add {option} if it is yours, or start a new study")
    refused, length = changed(saved, C.to_dict(given))
    if refused or length:
        shown = ", ".join(f"{k}={_plain(b)!r} (was {_plain(a)!r})" for k, a, b, _ in (refused + length)[:3])
        taken = [k for k, *_ in refused if from_this_command(k)]
        how = (f"give {taken[0]} on the command line (study.json does not decide it)" if taken
               else "resume with the same config (or none)")
        raise TuneError(f"--resume: the config differs from the one the study in '{path.parent}' started with: "
                        f"{shown}; {how}, or start a new study with another --study-dir")
    return given


def from_this_command(key: str) -> bool:
    """Whether ``key`` (dotted) is one of :data:`FROM_THIS_COMMAND`, or inside one of its sections."""
    return any(key == t or key.startswith(t + ".") for t in FROM_THIS_COMMAND)


def check_searched(space: Space, path: Path, given: bool) -> None:
    """The space read back from study.json searches no key that study.json may not decide (``dist.init_method``,
    ``log.mlflow_uri``, ``checkpoint.keep_last`` ...), unless ``--space`` gives that space again (``given``)."""
    taken = [k for k in space.keys if from_this_command(k)]
    if taken and not given:
        raise TuneError(f"--resume: the search space in '{path}' searches '{taken[0]}', a key that a study folder may "
                        f"not decide (this command line does); add --space FILE if that space is yours, or start a "
                        f"new study with another --study-dir")


def _plain(value: Any) -> Any:
    """A value of ``changes.changed`` as shown: a key one side does not set is None."""
    return value if value is None or isinstance(value, (bool, int, float, str, list, dict, tuple)) else None


def check_same(manifest: dict, folder: Path, space: Optional[Space], sampler: Optional[str], pruner: Optional[str],
               storage: Optional[str]) -> None:
    """A resumed study asks what it asked before: another space, sampler, pruner or storage is refused; a storage
    named by study.json alone is never opened."""
    def differ(what: str, given: Any, saved: Any) -> None:
        raise TuneError(f"--resume: the study in '{folder}' was started with {what} {saved}, not {given}; resume it "
                        f"with the same (or leave it out), or start a new study with another --study-dir")

    if manifest["storage"] is not None and storage is None:
        raise TuneError(f"--resume: '{Path(folder) / MANIFEST}' says the study's trials are in the storage "
                        f"'{manifest['storage']}'; torchrig opens only a storage this command line names: add "
                        f"--storage URL if that storage is yours, or start a new study with another --study-dir")
    for what, given, saved in (("--sampler", sampler, manifest["sampler"]), ("--pruner", pruner, manifest["pruner"]),
                               ("--storage", storage, manifest["storage"])):
        if given is not None and given != saved:
            differ(what, given, saved)
    if space is not None and space.to_dict() != manifest["space"]:
        differ("the search space", json.dumps(space.to_dict()), json.dumps(manifest["space"]))


def check_trial_folder(folder: Path, number: int, new: bool) -> Path:
    """``trials/N`` of the study in ``folder``: refused when it (or ``trials``) is a symbolic link or not a folder,
    or, for a trial just asked (``new``), when it exists at all: the study did not make it."""
    run = trial_dir(folder, number)
    for path in (run.parent, run):
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return run
        if stat.S_ISLNK(mode):
            raise TuneError(f"'{path}' is a symbolic link (to '{os.readlink(path)}'), not a folder the study made; "
                            f"torchrig never trains a trial through a link: remove it, or start a new study with "
                            f"another --study-dir")
        if not stat.S_ISDIR(mode):
            kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
            raise TuneError(f"'{path}' is {kind}, not a folder the study made; remove it, or start a new study with "
                            f"another --study-dir")
    if new:
        raise TuneError(f"'{run}' exists, but trial {number} has just started: it is not a folder the study made; "
                        f"remove it, or start a new study with another --study-dir")
    return run


def database(folder: Path) -> Path:
    """The study folder's own ``study.db``: a regular file or none yet, never a link (SQLite would write where
    it leads)."""
    path = Path(folder).resolve() / DATABASE
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(mode):
        raise TuneError(f"'{Path(folder) / DATABASE}' is {file_kind(mode)}, not the study's own database file; "
                        f"start a new study in another --study-dir")
    return path
