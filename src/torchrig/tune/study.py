"""``torchrig tune``: a hyperparameter search whose trials are torchrig runs, built on Optuna.

A study lives in one directory: ``study.json`` (what was asked: the base config, the space, sampler,
pruner, seed, monitor, trials), ``study.db`` (Optuna's SQLite storage, unless a storage URL is given),
``trials/N`` (trial N's run directory: checkpoints, metrics, plots, ``trial.json``), and at the end
``trials.csv``, ``best.yaml`` and ``tune.png``. Global rank 0 holds the study directory's lock and alone
talks to the storage; it tells every rank the next trial's config (``runtime.broadcast``), so under
torchrun the ranks train each trial together, one trial at a time.

Exact pause: trials are asked and told one at a time (``Study.ask`` / ``Study.tell``), and the sampler
of trial N is seeded by ``(seed, N)`` (``PerTrialSeed``), so trial N's parameters depend only on the seed
and the trials before it. A study killed at any point and resumed keeps its finished and pruned trials,
continues a trial that was running from its own ``latest`` checkpoint (exactly, as any torchrig run), and
then asks the same trials an uninterrupted study would have asked.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .. import config as C
from .. import recipes as _recipes  # noqa: F401  (their config sections: a study's config may hold them)
from ..checkpoint.io import write_bytes_atomic
from ..checkpoint.rundir import RunLock, reached_step
from ..config.files import open_own, refuse_link
from .manifest import (DATABASE, MANIFEST, PRUNERS, SAMPLERS, check_same, check_searched, check_trial_folder, checked,
                       database, read_manifest, resumed_config, trial_dir)
from .space import Space, TuneError, load_space, value_of
from .trial import Clock, Outcome, best_of, seconds_of

STUDY_NAME = "torchrig"


def require_optuna() -> Any:
    """Optuna, or one line saying how to install it (it is the optional extra ``torchrig[tune]``)."""
    try:
        import optuna
    except ImportError:
        raise TuneError("torchrig tune needs Optuna, which is not installed: pip install 'torchrig[tune]' "
                        "(or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # torchrig prints its own line per trial
    return optuna


def startup_trials(trials: int, most: int) -> int:
    """Trials before the sampler models (TPE) or the pruner compares (median): a third of the study, at
    least 2 and at most Optuna's own default ``most`` — so a 12-trial study is not 10 random trials."""
    return max(2, min(most, trials // 3))


def make_sampler(name: str, seed: int, space: Space, trials: int, parallel: bool) -> Any:
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_trials(trials, 10),
                                          constant_liar=parallel)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.GridSampler(space.grid(), seed=seed)


def make_pruner(name: str, trials: int, epochs: int) -> Any:
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials(trials, 5))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(epochs, 1))
    if name == "sha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
    return optuna.pruners.NopPruner()


def _per_trial_seed_class() -> type:
    import optuna

    class PerTrialSeed(optuna.samplers.BaseSampler):
        """A sampler made afresh for each trial, seeded by ``(seed, trial number)``: trial N's parameters
        depend on the seed and the finished trials only, not on how many samples this process drew
        before (a resumed study asks what an uninterrupted one would)."""

        def __init__(self, make: Callable[[int], Any], seed: int):
            self._make, self._seed = make, seed
            self._inner = make(seed)

        def before_trial(self, study: Any, trial: Any) -> None:
            if not isinstance(self._inner, optuna.samplers.GridSampler):  # a grid's order is the seed's, once
                self._inner = self._make((self._seed * 1_000_003 + trial.number) % 2 ** 32)
            self._inner.before_trial(study, trial)

        def infer_relative_search_space(self, study: Any, trial: Any) -> dict:
            return self._inner.infer_relative_search_space(study, trial)

        def sample_relative(self, study: Any, trial: Any, search_space: dict) -> dict:
            return self._inner.sample_relative(study, trial, search_space)

        def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
            return self._inner.sample_independent(study, trial, name, distribution)

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            if not isinstance(self._inner, optuna.samplers.GridSampler):  # its after_trial only stops optimize()
                self._inner.after_trial(study, trial, state, values)

        def reseed_rng(self) -> None:
            pass

    return PerTrialSeed


def resolve_monitor(cfg: C.Config) -> tuple[str, str]:
    """(``checkpoint.monitor``, its mode) as the Trainer resolves them: the first validation metric by default."""
    from ..metrics import get_metrics, higher_is_better
    from ..recipes.factory import trainer_objects

    name = cfg.checkpoint.monitor
    if name is None:  # metrics named MODULE:NAME imported as the trials import them
        metrics = get_metrics(trainer_objects(cfg).get("metrics", cfg.metrics)) if cfg.metrics else []
        name = f"val/{metrics[0].name}" if metrics else "val/loss"
    mode = cfg.checkpoint.mode or ("max" if higher_is_better(name) else "min")
    return name, mode


class Session:
    """Rank 0's handle on a study: its directory, manifest (the fields ``manifest.checked`` takes), space, base
    config (the config of this command, see ``manifest.resumed_config``) and the Optuna study."""

    def __init__(self, folder: Path, manifest: dict, base: C.Config, storage: Optional[str],
                 out: Callable[[str], None], parallel: int = 1):
        self.dir, self.manifest, self.out, self.parallel = folder, manifest, out, parallel
        self.base, self.storage = base, storage
        self.space = load_space(manifest["space"], self.base, source=f"the search space of '{folder / MANIFEST}'")
        self.monitor, self.mode = manifest["monitor"], manifest["mode"]
        self.direction = "maximize" if self.mode == "max" else "minimize"
        self.target = int(manifest["trials"])
        if manifest["sampler"] == "grid":
            self.target = min(self.target, self.space.grid_size())
        seed, name = int(manifest["seed"]), manifest["sampler"]
        sampler = _per_trial_seed_class()(
            lambda s: make_sampler(name, s, self.space, self.target, parallel > 1), seed)
        self.where = f"--storage '{storage}'" if storage else f"'{folder / DATABASE}'"
        self.study = load_study(manifest["study_name"], open_storage(storage, folder), sampler,
                                make_pruner(manifest["pruner"], self.target, self.base.epochs), self.where)
        self.live: dict[int, Any] = {}  # trial number -> optuna Trial, for the trials this process runs
        self.pending: list[int] = []  # running trials to continue first (a resumed study)
        self.clocks: dict[int, Clock] = {}
        self.summarised = False  # the model summary was printed by a trial of this process

    # -- the next trial ----------------------------------------------------------------------------
    def next_plan(self) -> Optional[dict]:
        """The next trial for every rank: ``{"number", "config", "reported", "seconds"}``, or None at the end."""
        import optuna

        while True:
            new = not self.pending
            if self.pending:
                number = self.pending.pop(0)
                frozen = self.study.get_trials(deepcopy=False)[number]
                trial = optuna.trial.Trial(self.study, frozen._trial_id)
            else:
                with ask_lock(self.dir):
                    if len(self.study.get_trials(deepcopy=False)) >= self.target:
                        return None
                    trial = self.study.ask(self.space.distributions())
                number, frozen = trial.number, None
            frozen = frozen or self.study.get_trials(deepcopy=False)[number]
            try:
                cfg = self.trial_config(number, trial.params, new)
            except C.ConfigError as exc:  # a combination of values that the config refuses: this trial only
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                self.out(f"tune: trial {number} failed: {exc}")
                continue
            except TuneError:  # its folder is not the study's: never resumed into later
                if new:
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            self.live[number] = trial
            self.clocks[number] = Clock(seconds_of(frozen.user_attrs))
            resumed = cfg.resume is not None
            line = (f"tune: trial {number} ({number + 1} of {self.target})" + (" resumed" if resumed else "") + " · "
                    + " · ".join(f"{k}={_short(value_of(trial.params[k]))}" for k in self.space.keys))
            self.out("\n".join(textwrap.wrap(line, 80, subsequent_indent="  ", break_on_hyphens=False)))
            return {"number": number, "config": C.to_dict(cfg), "reported": dict(frozen.intermediate_values)}

    def found_config(self, number: int, params: dict) -> C.Config:
        """The base config with trial ``number``'s ``params`` set (exactly the space's keys, each to a value in
        it), monitoring what the study optimises."""
        self.space.check_values(params, f"trial {number} in {self.where}")
        cfg = self.space.apply(self.base, params)
        cfg.checkpoint.monitor, cfg.checkpoint.mode = self.monitor, self.mode
        return C.validate(cfg)

    def trial_config(self, number: int, params: dict, new: bool = True) -> C.Config:
        """Trial ``number``'s run: in ``trials/N``, a folder of the study's own (``new``: one it has not made yet)."""
        cfg = self.found_config(number, params)
        cfg.run_dir = str(check_trial_folder(self.dir, number, new))
        cfg.overwrite = False
        cfg.resume = "latest" if reached_step(cfg.run_dir) is not None else None
        if self.parallel > 1:
            cfg.log.progress = "none"  # trials side by side: their summary lines, not interleaved bars
        if self.summarised and not any(k.startswith("model.") for k in self.space.keys):
            cfg.log.summary = False  # the same model each trial: its summary once
        self.summarised = True
        return C.validate(cfg)

    # -- the end of a trial ------------------------------------------------------------------------
    def finish(self, number: int, outcome: Outcome) -> None:
        """Tell the study how trial ``number`` ended, and mark its directory (``trial.json``, ``PRUNED``)."""
        import optuna

        trial, State = self.live.pop(number), optuna.trial.TrialState
        value = best_of(outcome.values, self.direction)
        seconds = self.clocks.pop(number).seconds()
        trial.set_user_attr("seconds", round(seconds, 3))
        if outcome.state == "complete" and value is None:
            outcome = Outcome("failed", outcome.values, error=f"checkpoint.monitor '{self.monitor}' was never "
                              f"logged (no validation data?); set checkpoint.monitor to a logged value")
        if outcome.state == "complete":
            self.study.tell(trial, value)
        else:
            self.study.tell(trial, state=State.PRUNED if outcome.state == "pruned" else State.FAIL)
        folder = trial_dir(self.dir, number)
        record = {"number": number, "state": outcome.state, "value": value, "monitor": self.monitor,
                  "params": {k: value_of(v) for k, v in trial.params.items()}, "seconds": round(seconds, 3),
                  "epochs": max(outcome.values, default=0), "error": outcome.error or None}
        if folder.is_dir():
            write_bytes_atomic(folder / "trial.json", (json.dumps(record, indent=2) + "\n").encode())
            if outcome.state == "pruned":
                write_bytes_atomic(folder / "PRUNED", f"pruned by the {self.manifest['pruner']} pruner after epoch "
                                   f"{outcome.epoch} ({self.monitor} {_short(outcome.values.get(outcome.epoch))})\n"
                                   .encode())
        shown = f"{self.monitor} {value:.4f}" if value is not None else "no value"
        if outcome.state == "pruned":
            self.out(f"tune: trial {number} pruned after epoch {outcome.epoch} · {shown} · {seconds:.1f} s")
        elif outcome.state == "failed":
            self.out(f"tune: trial {number} failed: {outcome.error}")
        else:
            self.out(f"tune: trial {number} complete · {shown} · {seconds:.1f} s")
        if outcome.state == "failed" and "checkpoint.monitor" in outcome.error:
            raise TuneError(f"trial {number}: {outcome.error}")

    def check_trials(self) -> None:
        """Before anything is built: every trial the storage holds sets values of the space, and the folder of
        each running one (continued first) is the study's own."""
        for t in self.study.get_trials(deepcopy=False):
            self.space.check_values(t.params, f"trial {t.number} in {self.where}")
            if t.state.name == "RUNNING":
                check_trial_folder(self.dir, t.number, new=False)
                self.pending.append(t.number)

    def plan(self) -> dict:
        """What a ``--parallel`` worker needs to open this study as this process did (nothing read again)."""
        return {"manifest": self.manifest, "config": C.to_dict(self.base), "storage": self.storage}

    def fail(self, number: int) -> None:
        """Trial ``number`` ended by an error that ends the study: it is failed, not resumed later."""
        import optuna

        trial = self.live.pop(number, None)
        if trial is not None:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def open_storage(url: Optional[str], folder: Path) -> Any:
    """Optuna's storage: the study directory's SQLite file, or ``url``. SQLite waits up to 60 s for a lock
    (trials of ``--parallel`` workers write to it at once)."""
    import optuna

    if url is None:  # SQLite follows links: a link planted as the database or its journal is refused
        db = database(folder)
        for tail in ("-journal", "-wal", "-shm"):
            refuse_link(db.with_name(DATABASE + tail), "study file",
                        "remove it, or start a new study in another --study-dir", TuneError)
        url = f"sqlite:///{db}"
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except Exception as exc:  # a bad URL, a driver missing, a server not reachable
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TuneError(f"--storage '{url}': cannot open it as an Optuna storage ({text})") from None


def load_study(name: str, storage: Any, sampler: Any, pruner: Any, where: str) -> Any:
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    except KeyError:  # Optuna's 'Record does not exist.'
        raise TuneError(f"{where} holds no study named '{name}'; resume a study with the storage it was started "
                        f"with, or start a new study in another --study-dir") from None


@contextlib.contextmanager
def ask_lock(folder: Path):
    """One process at a time counts the study's trials and asks the next one (``--parallel`` workers), so
    the study gets exactly the trials it was asked for."""
    try:
        import fcntl
    except ImportError:  # not POSIX: one process per study
        yield
        return
    path = Path(folder) / ".ask.lock"
    fd = open_own(path, True, lambda what: TuneError(
        f"'{path}' is {what}; torchrig never follows a link in a study folder: remove it and continue with "
        f"torchrig tune --study-dir {folder} --resume"))
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- creating or resuming a study


def write_manifest(folder: Path, manifest: dict) -> None:
    write_bytes_atomic(Path(folder) / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def new_manifest(base: C.Config, space: Space, trials: int, sampler: str, pruner: str,
                 storage: Optional[str], study_name: str = STUDY_NAME) -> dict:
    monitor, mode = resolve_monitor(base)
    return {"version": 1, "study_name": study_name, "storage": storage, "monitor": monitor, "mode": mode,
            "sampler": sampler, "pruner": pruner, "seed": base.seed, "trials": trials, "space": space.to_dict(),
            "config": C.to_dict(base)}


def open_study(folder: Path, *, base: Optional[C.Config], space: Union[None, str, Path, dict], trials: Optional[int],
               sampler: Optional[str], pruner: Optional[str], storage: Optional[str], resume: bool,
               out: Callable[[str], None], parallel: int = 1, overrides: Optional[list[str]] = None) -> Session:
    """Rank 0: lock ``folder``, create the study or check the one to resume, and open it. On resume, ``base`` is
    the whole config given on the command line (None: the study's, with ``overrides`` on top)."""
    optuna = require_optuna()
    lock = RunLock(folder)
    lock.acquire()  # one tune process per study (its --parallel workers are its own children)
    try:
        manifest = read_manifest(folder)
        if resume and manifest is None:
            raise TuneError(f"--resume: '{folder}' holds no study ({MANIFEST} is missing); start it without --resume")
        if not resume and manifest is not None:
            raise TuneError(f"--study-dir '{folder}' holds a study already; continue it with --resume, or choose "
                            f"another --study-dir")
        for what, given, names in (("--sampler", sampler, SAMPLERS), ("--pruner", pruner, PRUNERS)):
            if given is not None and given not in names:
                raise TuneError(f"{what} '{given}': choose one of {', '.join(names)}")
        if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
            raise TuneError(f"--trials {trials!r}: expected an integer >= 1")
        if manifest is None:
            manifest = _create(folder, base, space, trials, sampler, pruner, storage, optuna)
            config = C.from_dict(manifest["config"])
        else:
            manifest, config = _resume(folder, manifest, base, space, trials, sampler, pruner, storage, overrides)
        session = Session(folder, manifest, config, storage, out, parallel)
        session.check_trials()
    except BaseException:
        lock.release()
        raise
    session.lock = lock
    return session


def _resume(folder: Path, raw: dict, base: Optional[C.Config], space: Any, trials: Optional[int],
            sampler: Optional[str], pruner: Optional[str], storage: Optional[str],
            overrides: Optional[list[str]]) -> tuple[dict, C.Config]:
    """The study's fields as ``manifest.checked`` takes them and this command's config, checked to ask what the
    study asked before; ``--trials`` changes the study's total."""
    path = Path(folder) / MANIFEST
    manifest = checked(raw, path)
    config = resumed_config(manifest, path, base, overrides)
    check_searched(load_space(manifest["space"], config, source=f"the search space of '{path}'"), path,
                   given=space is not None)
    check_same(manifest, folder, load_space(space, config) if space is not None else None, sampler, pruner, storage)
    if trials is not None and trials != manifest["trials"]:
        manifest["trials"] = trials
        write_manifest(folder, dict(raw, trials=trials))
    return manifest, config


def _create(folder: Path, base: Optional[C.Config], space: Any, trials: Optional[int], sampler: Optional[str],
            pruner: Optional[str], storage: Optional[str], optuna: Any) -> dict:
    if space is None:
        raise TuneError("a new study needs a search space: --space space.yaml (config keys such as "
                        "'optim.lr: {log_uniform: [1e-5, 1e-1]}')")
    if trials is None:
        raise TuneError("a new study needs --trials N, the number of trials to run")
    if base is None:  # the default digits job, as torchrig train runs it (its recipe's defaults: validation split …)
        from ..recipes.run import build_config

        base = build_config()
    else:
        base = copy.deepcopy(base)
    parsed = load_space(space, base)
    check_model_options(base, parsed)
    # a storage of the user's may hold several studies: each is named by its directory
    name = STUDY_NAME if storage is None else f"torchrig:{folder.resolve()}"
    manifest = new_manifest(base, parsed, trials, sampler or "tpe", pruner or "median", storage, name)
    if manifest["sampler"] == "grid":
        parsed.grid_size()  # a space without a grid, or too large a one, is refused now, not at the first trial
    folder.mkdir(parents=True, exist_ok=True)
    direction = "maximize" if manifest["mode"] == "max" else "minimize"
    try:
        optuna.create_study(study_name=name, storage=open_storage(storage, folder), direction=direction)
    except optuna.exceptions.DuplicatedStudyError:
        raise TuneError(f"--storage '{storage}' holds a study named '{name}' already; resume it with --resume, or "
                        f"choose another --study-dir") from None
    write_manifest(folder, manifest)
    return manifest


def check_model_options(base: C.Config, space: Space) -> None:
    """Searched ``model.options.*`` keys have no rule of their own: the model is built once with the space's first
    values (on the meta device: no memory, no time), so an option the model does not take is refused now."""
    import torch

    from ..recipes import factory, get_recipe

    searched = [p for p in space.params if p.key.startswith("model.options.")]
    if not searched or base.model.factory:  # a factory of the user's is called by the first trial, not here
        return
    cfg = space.apply(base, {p.key: p.choices[0] if p.kind == "choice" else p.low for p in searched})
    try:
        with torch.device("meta"):
            factory.build_model(get_recipe(cfg.recipe), cfg)
    except C.ConfigError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        keys = ", ".join(f"'{p.key}'" for p in searched)
        raise TuneError(f"{space.source}: {keys}: {text}") from None
