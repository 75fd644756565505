"""``torchrig.tune(...)`` / ``torchrig tune``: create or resume a study, run its trials, report.

One process runs the trials one after another; under torchrun every rank runs each trial together
(rank 0 asks the study, ``runtime.broadcast`` tells the others); ``parallel=K`` starts K worker
processes (``python -m torchrig.tune.worker``), each running one-process trials from the same storage.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .. import config as C
from .. import runtime
from ..errors import TorchrigError
from .space import TuneError
from .study import Session, open_study, require_optuna
from .trial import PruningCallback, run_trial


@dataclass
class TuneResult:
    """What a study found: the best trial, its value and config, and where the files are."""

    study_dir: Path
    best_trial: Optional[int]
    best_value: Optional[float]
    best_params: dict
    best_config: Optional[C.Config] = field(repr=False)
    monitor: str
    table: str = field(repr=False)
    files: dict = field(default_factory=dict)  # "best", "csv", "plot" -> Path
    study: Any = field(default=None, repr=False)  # the Optuna Study (its storage stays the study's)


def tune(config: Union[None, str, Path, C.Config] = None, space: Union[None, str, Path, dict] = None,
         trials: Optional[int] = None, *, sampler: Optional[str] = None, pruner: Optional[str] = None,
         study_dir: Union[None, str, Path] = None, storage: Optional[str] = None, resume: bool = False,
         parallel: int = 1, overrides: Optional[list[str]] = None, recipe: Optional[str] = None,
         out: Callable[[str], None] = print) -> Optional[TuneResult]:
    """Search ``space`` (a YAML file or a mapping of config keys) over runs of ``config`` (a YAML file, a
    Config, or None for the default digits job; ``overrides`` as ``--set``), ``trials`` trials.

    ``sampler``: tpe (default), random or grid; ``pruner``: median (default), hyperband, sha or none;
    ``study_dir`` (default a new ``runs/tune/N``; with ``resume`` the newest) holds the study; ``storage`` an
    Optuna storage URL instead of its SQLite file. Returns the result on rank 0 (None on other ranks).
    """
    require_optuna()
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise TuneError(f"--parallel {parallel!r}: expected an integer >= 1, the trials run at once")
    base = _base_config(config, overrides, recipe)
    from ..recipes.run import join_process_group

    owns_group = join_process_group(base if base is not None else C.Config())  # for the whole study
    try:
        if parallel > 1 and runtime.get_world_size() > 1:
            raise TuneError(f"--parallel {parallel}: under torchrun each trial uses every process, one trial at a time; "
                            f"run parallel trials without torchrun (each trial then uses one process)")
        where: list[str] = []  # which numbered folder: said once the study opened (one that fails is removed)
        folder = _study_dir(study_dir, resume, where.append)
        # a resume without a config file takes the study's config, with the --set overrides on top
        whole = base if not resume or config is not None or recipe is not None else None
        try:
            session = _open(folder, whole, space, trials, sampler, pruner, storage, resume, out, parallel, overrides)
            for line in where:
                out(line)
            if base is not None and base.run_dir and runtime.get_rank() == 0:  # each trial has its own folder
                out(f"tune: run_dir {base.run_dir} is not used: each trial is a run in {folder / 'trials'}/N, and the "
                    f"study's folder is --study-dir (study_dir=)")
        except BaseException:
            if study_dir is None and runtime.get_rank() == 0 and not (folder / "study.json").exists():
                from ..checkpoint.rundir import discard_unused

                discard_unused(folder)  # a study that never started leaves no numbered directory behind
            raise
        try:
            if parallel > 1:
                run_workers(session, parallel)
            else:
                drive(session)
            return finish(session) if session is not None else None
        finally:
            if session is not None:
                session.lock.release()
    finally:
        if owns_group:
            runtime.destroy_process_group()


def _base_config(config: Any, overrides: Optional[list[str]], recipe: Optional[str]) -> Optional[C.Config]:
    """The study's base config, or None when nothing was given (a resumed study then uses its own)."""
    import copy

    from ..recipes.run import build_config

    if isinstance(config, C.Config):
        cfg = copy.deepcopy(config)
        for item in overrides or []:
            key, _, raw = item.partition("=")
            C.set_key(cfg, key.strip(), raw)
        return C.validate(cfg)
    if config is not None and not isinstance(config, (str, Path)):
        raise TuneError(f"the study's config must be a YAML file, a torchrig.Config or None (the default job), got "
                        f"a {type(config).__name__}")
    if config is None and not overrides and recipe is None:
        return None
    return build_config(str(config) if config is not None else None, list(overrides or []), recipe)


def _study_dir(study_dir: Union[None, str, Path], resume: bool, out: Callable[[str], None]) -> Path:
    if study_dir is not None:
        return Path(study_dir)
    from ..checkpoint.rundir import numbered_run_dir

    return numbered_run_dir(Path("runs") / "tune", say=out, resume=resume)


def _open(folder: Path, base: Optional[C.Config], space: Any, trials: Optional[int], sampler: Optional[str],
          pruner: Optional[str], storage: Optional[str], resume: bool, out: Callable[[str], None],
          parallel: int, overrides: Optional[list[str]]) -> Optional[Session]:
    """Rank 0 opens the study; an error there reaches every rank (none waits for a trial that never comes)."""
    session, error = None, None
    if runtime.get_rank() == 0:
        try:
            session = open_study(folder, base=base, space=space, trials=trials, sampler=sampler, pruner=pruner,
                                 storage=storage, resume=resume, out=out, parallel=parallel, overrides=overrides)
        except Exception as exc:
            error = exc
    message = runtime.broadcast(str(error) if error is not None else None)
    if error is not None:
        raise error
    if message is not None:
        raise TuneError(message)
    if session is not None and session.pending:
        out(f"tune: resuming the study in {folder}: {len(session.study.trials)} trial(s) so far, "
            f"{len(session.pending)} to continue from its latest checkpoint")
    return session


def drive(session: Optional[Session]) -> None:
    """Run trials until the study has its number: every rank trains each trial; rank 0 (``session``) asks
    and tells the study. An error on rank 0 alone (the storage, the study's end of a trial) reaches the other
    ranks with the next trial's plan, so none waits for a trial that never comes."""
    error: Optional[BaseException] = None
    while True:
        plan = None
        if session is not None and error is None:
            try:
                plan = session.next_plan()
            except Exception as exc:
                error = exc
        plan = runtime.broadcast({"error": str(error)} if error is not None else plan)
        if error is not None:
            raise error
        if plan is None:
            return
        if "error" in plan:
            raise TuneError(plan["error"])
        error = run_planned(session, plan)


def run_planned(session: Optional[Session], plan: dict) -> Optional[BaseException]:
    """Train the planned trial on this rank; rank 0 then tells the study (its error, if any, is returned)."""
    number = plan["number"]
    cfg = C.from_dict(plan["config"])
    trial = session.live[number] if session is not None else None
    clock = session.clocks[number] if session is not None else None
    callback = PruningCallback(trial, cfg.checkpoint.monitor, plan["reported"], clock)
    try:
        outcome = run_trial(cfg, callback)
    except Exception as exc:
        storage_error = environment_error(exc)
        if session is not None and storage_error is not None:  # not the trial's fault: it stays running, and
            raise TuneError(stopped_message(exc, storage_error, number, session.dir)) from exc  # --resume goes on
        if session is not None:
            session.fail(number)  # an error that ends the study: this trial is not resumed later
        raise
    except BaseException:  # a stop signal: the trial stays running, and --resume continues it from its checkpoint
        if session is not None:
            session.out(f"tune: the study stopped during trial {number}; continue it with: torchrig tune "
                        f"--study-dir {session.dir} --resume")
        raise
    if session is not None:
        try:
            session.finish(number, outcome)
        except Exception as exc:
            return exc
    return None


# Errors of the storage under a trial (a full disk, a quota, a failing device): the trial is continued later.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def environment_error(exc: BaseException) -> Optional[OSError]:
    """The OSError of the storage behind ``exc`` (itself, or what it was raised from or during), or None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def stopped_message(exc: BaseException, error: OSError, number: int, folder: Path) -> str:
    """Trial ``number`` stopped by the storage: what happened (the first clause of torchrig's own line), that
    the trial is kept, and tune's way on."""
    from ..checkpoint.rundir import describe_os_error

    text = str(exc).strip().splitlines()[0].split("; ")[0] if isinstance(exc, TorchrigError) and str(exc).strip() \
        else describe_os_error(error) + (f" ('{error.filename}')" if error.filename else "")
    todo = "free some space" if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "fix the storage"
    return (f"trial {number} stopped: {text}; it is kept as running and continues from its latest checkpoint: "
            f"{todo}, then continue the study with torchrig tune --study-dir {folder} --resume")


# ----------------------------------------------------------------------------- --parallel K


def run_workers(session: Session, parallel: int) -> None:
    """K worker processes run one-process trials side by side; the trials running when a study stopped are
    shared out first. A stop signal here reaches every worker once (they save and stop as a run does)."""
    pending = session.pending
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent.parent)  # this torchrig, in every worker
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    procs, plan = [], json.dumps(session.plan()).encode()
    for i in range(parallel):
        mine = ",".join(str(n) for n in pending[i::parallel])
        cmd = [sys.executable, "-m", "torchrig.tune.worker", str(session.dir.resolve()), str(parallel), mine]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.PIPE))
        procs[-1].stdin.write(plan)  # the study as this process opened and checked it: nothing is read again
        procs[-1].stdin.close()
    session.out(f"tune: {parallel} workers, one trial each at a time (PIDs {', '.join(str(p.pid) for p in procs)})")
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
    except BaseException as exc:  # RunStopped, KeyboardInterrupt: pass the signal on once, wait for the saves
        signum = getattr(exc, "signum", signal.SIGINT)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
        for p in procs:
            p.wait()
        raise
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        shown = ", ".join(f"worker {i} exited {code}" for i, code in failed)
        raise TuneError(f"{shown}; its error is above. The study is kept: continue it with torchrig tune "
                        f"--study-dir {session.dir} --resume")


def worker_main(argv: list[str], plan: dict) -> int:
    """A ``--parallel`` worker: ``python -m torchrig.tune.worker STUDY_DIR K RUNNING`` (RUNNING: trial numbers to
    continue first, comma-separated), ``plan`` (``Session.plan``, on its stdin) the study as its parent opened it."""
    folder, parallel, mine = Path(argv[0]), int(argv[1]), argv[2] if len(argv) > 2 else ""
    stop = runtime.StopSignal(where=f"during a trial's start-up; continue with torchrig tune --study-dir {folder} "
                                    f"--resume").install()
    try:
        session = Session(folder, plan["manifest"], C.from_dict(plan["config"]), plan["storage"],
                          lambda s: print(s, flush=True), parallel)
        session.pending = [int(n) for n in mine.split(",") if n]
        drive(session)
    finally:
        stop.uninstall()
    return 0


# ----------------------------------------------------------------------------- the end


def finish(session: Session) -> TuneResult:
    """The table, ``trials.csv``, ``best.yaml`` and ``tune.png``; the result."""
    from . import report

    study, folder = session.study, session.dir
    trial_rows = report.rows(study)
    keys = session.space.keys
    complete = [r for r in trial_rows if r["state"] == "complete"]
    best = study.best_trial if complete else None
    text = report.table(trial_rows, keys, session.monitor, best.number if best else None)
    files = {"csv": folder / "trials.csv", "plot": folder / "tune.png"}
    report.write_csv(files["csv"], trial_rows, keys)
    report.plot(files["plot"], trial_rows, report.importances(study, session.base.seed), session.monitor,
                session.direction)
    counts = {s: sum(r["state"] == s for r in trial_rows) for s in ("complete", "pruned", "failed")}
    session.out(text)
    session.out(f"tune: {len(trial_rows)} trials · {counts['complete']} complete · {counts['pruned']} pruned · "
                f"{counts['failed']} failed")
    best_cfg = None
    if best is not None:
        best_cfg = session.found_config(best.number, best.params)
        files["best"] = folder / "best.yaml"
        from ..checkpoint.io import write_bytes_atomic

        header = (f"torchrig tune: the best of {len(trial_rows)} trials in {folder}: trial {best.number}, "
                  f"{session.monitor} {best.value:.6g}\ntrain it: torchrig train {files['best']}")
        write_bytes_atomic(files["best"], report.best_yaml(best_cfg, header).encode())
        session.out(f"tune: best trial {best.number} · {session.monitor} {best.value:.4f} · config {files['best']}")
    else:
        session.out("tune: no trial completed, so there is no best config; see the trials above")
    session.out(f"tune: plot {files['plot']} · table {files['csv']}")
    return TuneResult(folder, best.number if best else None, best.value if best else None,
                      dict(best.params) if best else {}, best_cfg, session.monitor, text, files, study)
