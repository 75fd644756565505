"""``Trainer``: fit / evaluate / predict for a plain ``nn.Module``.

Reading order: ``__init__`` sets up the runtime (device, threads, seed, process group, precision,
wrapping), ``fit`` prepares data, schedules and resume state, and ``_run_epoch`` is the loop: fetch
a batch, run the step function, and at the end of each accumulation window do the bookkeeping
(schedule, log, checkpoint). The step itself is ``step.default_step``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .. import config as C
from .. import runtime
from ..checkpoint import CheckpointError, CheckpointManager, load_into, load_weights_file, read_checkpoint, resolve
from ..checkpoint.rundir import RunDir
from ..data import prepare_eval, prepare_train, to_device
from ..metrics import MeanValue, Metric, get_metric, higher_is_better
from . import registry
from .progress import RunLogger
from .step import NonFiniteLossError, Step, batch_size_of, call_model, default_eval_step, default_step, split_batch

# Trainer keyword -> config key, for the keywords that are not top-level config keys.
KWARG_KEYS = {
    "lr": "optim.lr", "weight_decay": "optim.weight_decay", "momentum": "optim.momentum",
    "nesterov": "optim.nesterov", "betas": "optim.betas", "group_lr": "optim.group_lr",
    "batch_size": "data.batch_size", "eval_batch_size": "data.eval_batch_size",
    "num_workers": "data.num_workers", "pin_memory": "data.pin_memory", "shuffle": "data.shuffle",
    "drop_last": "data.drop_last", "fast_path": "data.fast_path",
    "checkpoint_every": "checkpoint.every_steps", "checkpoint_every_epochs": "checkpoint.every_epochs",
    "keep_last": "checkpoint.keep_last", "keep_best": "checkpoint.keep_best", "monitor": "checkpoint.monitor",
    "monitor_mode": "checkpoint.mode", "log_every": "log.every_steps", "progress": "log.progress",
    "tensorboard": "log.tensorboard", "plot": "log.plot", "strategy": "dist.strategy",
    "sync_batchnorm": "dist.sync_batchnorm", "backend": "dist.backend", "init_method": "dist.init_method",
    "rank": "dist.rank", "world_size": "dist.world_size", "dist_timeout": "dist.timeout",
    "find_unused_parameters": "dist.find_unused_parameters", "static_graph": "dist.static_graph",
    "bucket_cap_mb": "dist.bucket_cap_mb", "fsdp_wrap": "dist.fsdp_wrap", "warmup_steps": "scheduler.warmup_steps",
    "scheduler_interval": "scheduler.interval", "channels_last": "model.channels_last", "compile": "model.compile",
}


def _apply_kwargs(cfg: C.Config, kwargs: dict) -> None:
    top = {f.name for f in dataclasses.fields(cfg)}
    for key, value in kwargs.items():
        dotted = KWARG_KEYS.get(key, key)
        if dotted not in top and dotted == key:
            import difflib

            options = sorted(top | set(KWARG_KEYS))
            close = difflib.get_close_matches(key, options, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise TypeError(f"Trainer got an unexpected keyword argument '{key}'{hint}")
        C._set_path(cfg, dotted, value if not isinstance(value, str) else value)
    C.validate(cfg)


def _explain_collective_errors(method: Callable) -> Callable:
    """Turn a backend's low-level failure of a collective (a timeout, a lost peer) into one clear error."""

    @functools.wraps(method)
    def wrapper(self: "Trainer", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            err = runtime.collective_error(exc, self.cfg.dist.timeout)
            if err is None:
                raise
            raise err from exc

    return wrapper


class Trainer:
    """Train, evaluate and predict with the user's model, data and optimizer, unchanged.

    ``optimizer``, ``loss``, ``scheduler`` and ``metrics`` take names or objects; every other
    keyword is a config key (see ``torchrig.config.Config``) or a short alias (``lr``,
    ``batch_size``, ``strategy`` …). ``step_fn(step, batch) -> dict`` replaces the training step for
    models that are not "one loss, one optimizer"; ``eval_fn`` and ``predict_fn`` likewise.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, loss: Any = None, metrics: Any = None,
                 scheduler: Any = None, step_fn: Optional[Callable] = None, eval_fn: Optional[Callable] = None,
                 predict_fn: Optional[Callable] = None, config: Optional[C.Config] = None, **kwargs: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs an nn.Module, got {type(model).__name__}")
        cfg = copy.deepcopy(config) if config is not None else C.Config()
        objects: dict[str, Any] = {}
        for key, value in (("optimizer", optimizer), ("loss", loss), ("scheduler", scheduler), ("metrics", metrics)):
            if value is None:
                continue
            if key == "optimizer" and isinstance(value, str):
                kwargs["optim.name"] = value
            elif key == "loss" and isinstance(value, str):
                kwargs["loss"] = value
            elif key == "scheduler" and (isinstance(value, str)):
                kwargs["scheduler.name"] = value
            elif key == "metrics" and isinstance(value, (list, tuple)) and all(isinstance(m, str) for m in value):
                kwargs["metrics"] = list(value)
            else:
                objects[key] = value
        dotted = {k: kwargs.pop(k) for k in list(kwargs) if "." in k}
        _apply_kwargs(cfg, kwargs)
        for k, v in dotted.items():
            C._set_path(cfg, k, v)
        self.cfg = C.validate(cfg)
        self.model = model
        self.step_fn = step_fn or default_step
        self.eval_fn = eval_fn
        self.predict_fn = predict_fn
        self._objects = objects
        self._owns_group = False
        self._run = RunDir()
        try:
            self._setup_runtime()
            self._setup_model_and_optim()
            self.loss_fn = registry.build_loss(objects.get("loss", cfg.loss), cfg.label_smoothing)
        except BaseException:
            self.close()  # a failed set-up must not leave a process group (and its peers) waiting
            raise
        self.history: list[dict] = []
        self.global_step = 0
        self.epoch = 0
        self.skipped_steps = 0

    # ------------------------------------------------------------------------------ setup
    def _setup_runtime(self) -> None:
        cfg = self.cfg
        d = cfg.dist
        self.dist_info = runtime.detect(d.init_method, d.rank, d.world_size)
        self.device = runtime.select_device(cfg.device, self.dist_info.local_rank)
        self._owns_group = runtime.init_process_group(self.dist_info, self.device, d.backend, d.init_method, d.timeout)
        self.rank = runtime.get_rank()
        self.world_size = runtime.get_world_size()
        self.is_main = self.rank == 0
        self.threads = runtime.configure_threads(cfg.threads, cfg.interop_threads)
        runtime.configure_backends(cfg.deterministic, cfg.cudnn_benchmark)
        runtime.seed_everything(cfg.seed)
        self.precision = runtime.make_precision(cfg.precision, self.device)
        self.strategy = runtime.resolve_strategy(d.strategy, self.world_size, self.device)

    def _setup_model_and_optim(self) -> None:
        cfg = self.cfg
        model = self.model.to(self.device)
        if cfg.model.channels_last:
            model = model.to(memory_format=torch.channels_last)
        dtype = self.precision.dtype
        if isinstance(model, nn.ModuleDict) and self.strategy in ("ddp", "fsdp", "dp"):
            # Several networks (a GAN): wrap each so that each forward does its own gradient sync.
            self.models = {k: runtime.wrap_model(m, self.strategy, self.device, cfg.dist, dtype) for k, m in model.items()}
            self.wrapped = model
        else:
            self.wrapped = runtime.wrap_model(model, self.strategy, self.device, cfg.dist, dtype)
            self.models = dict(model.items()) if isinstance(model, nn.ModuleDict) else {}
        if cfg.model.compile:
            self.wrapped = torch.compile(self.wrapped)
        self.optimizers = self._build_optimizers(self._objects.get("optimizer"))

    def _build_optimizers(self, spec: Any) -> dict[str, torch.optim.Optimizer]:
        cfg, o = self.cfg, self.cfg.optim
        base = runtime.unwrap(self.model)

        def by_name(name: str, module: nn.Module) -> torch.optim.Optimizer:
            return registry.build_optimizer(name, module, o.lr, weight_decay=o.weight_decay, momentum=o.momentum,
                                            nesterov=o.nesterov, betas=o.betas, eps=o.eps, group_lr=o.group_lr,
                                            device=self.device, options=o.options)

        def one(key: str, value: Any) -> torch.optim.Optimizer:
            module = base[key] if isinstance(base, nn.ModuleDict) and key in base else base
            if isinstance(value, str):
                return by_name(value, module)
            if isinstance(value, torch.optim.Optimizer):
                if self.strategy == "fsdp":
                    raise runtime.RuntimeSetupError(
                        "strategy 'fsdp' replaces the parameters with sharded ones, so an optimizer built before "
                        "the Trainer cannot be used; pass the optimizer by name or as a factory "
                        "(a callable taking the parameters)")
                return value
            if callable(value):
                return value(module.parameters())
            raise TypeError(f"optimizer {key!r} must be a name, a torch.optim.Optimizer or a callable(params), "
                            f"got {type(value).__name__}")

        if spec is None:
            return {"default": by_name(cfg.optim.name, base)}
        if isinstance(spec, dict):
            return {k: one(k, v) for k, v in spec.items()}
        return {"default": one("default", spec)}

    # ------------------------------------------------------------------------------ helpers
    @property
    def run_dir(self) -> Optional[Path]:
        """Where this run writes; None until the first ``fit`` when ``run_dir`` was not given."""
        return Path(self.cfg.run_dir) if self.cfg.run_dir else None

    def open_run(self) -> Path:
        """Claim, lock and check the run directory (``fit`` does this first; call it to write files there
        before). Without ``run_dir`` a new numbered directory ``runs/default/N`` is used."""
        new_run = self.cfg.resume is None and runtime.restart_count() == 0
        path = self._run.open(self.cfg.run_dir, "runs/default", new_run, self.cfg.overwrite, say=self.print)
        self.cfg.run_dir = str(path)
        return path

    def _loader_kwargs(self, eval_: bool = False) -> dict:
        d = self.cfg.data
        return dict(batch_size=(d.eval_batch_size or d.batch_size) if eval_ else d.batch_size, seed=self.cfg.seed,
                    rank=self.rank, world_size=self.world_size, device=self.device, num_workers=d.num_workers,
                    pin_memory=d.pin_memory, persistent_workers=d.persistent_workers,
                    prefetch_factor=d.prefetch_factor, fast_path=d.fast_path,
                    local_world_size=self.dist_info.local_world_size,
                    **({} if eval_ else dict(shuffle=d.shuffle, drop_last=d.drop_last)))

    def _make_step(self, metrics: list) -> Step:
        c = self.cfg
        return Step(model=self.wrapped, models=self.models, optimizers=self.optimizers, loss_fn=self.loss_fn,
                    precision=self.precision, device=self.device, clip_grad_norm=c.clip_grad_norm,
                    clip_norm_type=c.clip_norm_type, clip_grad_value=c.clip_grad_value,
                    on_nonfinite=c.on_nonfinite, metrics=metrics)

    def _metric_objects(self) -> list[Metric]:
        specs = self._objects.get("metrics", self.cfg.metrics)
        if isinstance(specs, (str, Metric)):
            specs = [specs]
        return [get_metric(copy.deepcopy(s) if isinstance(s, Metric) else s) for s in specs]

    def _no_sync(self, skip: bool):
        if not skip or self.world_size == 1:
            return _NULL_CONTEXT
        stack = contextlib.ExitStack()
        for m in ([self.wrapped] if not self.models or self.wrapped is not self.model else self.models.values()):
            stack.enter_context(runtime.no_sync(m, True))
        return stack

    def _lr(self) -> float:
        return float(self.optimizers[next(iter(self.optimizers))].param_groups[-1]["lr"])

    def print(self, text: str) -> None:
        """Print from the main process only (through the progress bar when one is shown)."""
        if getattr(self, "logger", None) is not None:
            self.logger.print(text)
        elif self.is_main:
            print(text, flush=True)

    # ------------------------------------------------------------------------------ fit
    @_explain_collective_errors
    def fit(self, train_data: Any, val_data: Any = None) -> dict:
        """Train for ``epochs`` (or ``max_steps``); returns the last validation metrics (or {})."""
        self.open_run()
        try:
            return self._fit(train_data, val_data)
        finally:
            self._run.close()

    def _fit(self, train_data: Any, val_data: Any = None) -> dict:
        cfg = self.cfg
        batches = prepare_train(train_data, **self._loader_kwargs())
        batches.set_epoch(0)
        epoch_len = len(batches)
        if epoch_len == 0:
            raise ValueError(f"the training data gives no batch (batch_size={cfg.data.batch_size}, "
                             f"drop_last={cfg.data.drop_last}); lower data.batch_size")
        A = cfg.accumulate
        steps_per_epoch = math.ceil(epoch_len / A)
        total_steps = cfg.epochs * steps_per_epoch
        if cfg.max_steps is not None:
            total_steps = min(total_steps, cfg.max_steps)
        s = cfg.scheduler
        self.schedulers: dict[str, Any] = {}
        self.sched_interval = s.interval or "step"
        user_sched = self._objects.get("scheduler")
        if user_sched is not None:
            self.schedulers = user_sched if isinstance(user_sched, dict) else {"default": user_sched}
        else:
            for k, opt in self.optimizers.items():
                sch, self.sched_interval = registry.build_scheduler(
                    s.name, opt, interval=s.interval, total_steps=total_steps, epochs=cfg.epochs,
                    step_size=s.step_size, gamma=s.gamma, milestones=s.milestones, warmup_steps=s.warmup_steps,
                    min_lr=s.min_lr, max_lr=s.max_lr, pct_start=s.pct_start)
                if sch is not None:
                    self.schedulers[k] = sch
        total_steps += self.global_step  # a second fit() of this Trainer trains as long again
        self._stop_position = None
        self.train_metrics = self._metric_objects()
        self.step = self._make_step(self.train_metrics)
        monitor = cfg.checkpoint.monitor
        if monitor is None and val_data is not None:
            first = self.train_metrics[0].name if self.train_metrics else "loss"
            monitor = f"val/{first}"
        mode = cfg.checkpoint.mode or ("max" if monitor and higher_is_better(monitor) else "min")
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_best, monitor, mode) \
            if self.is_main or self.strategy == "fsdp" else None
        self._monitor, self._mode = monitor, mode
        self._best, self._bad_epochs = None, 0
        start_epoch, start_batch = 0, 0
        self._restored_window: Optional[dict] = None
        resume = cfg.resume
        restarts = runtime.restart_count()
        if resume is None and restarts > 0:  # torchrun restarted the group after a failure: carry on
            resume = "latest"
        if resume:
            start_epoch, start_batch = self._resume(resume)
            if restarts > 0 and getattr(self, "resumed_from", None) is not None:
                self.print(f"torchrig: restart {restarts} by torchrun; resumed from {self.resumed_from}")
        if self.ckpt is not None and self.is_main:
            self.ckpt.clean_partial()
        self.logger = RunLogger(self.run_dir, enabled=self.is_main, progress=cfg.log.progress,
                                tensorboard=cfg.log.tensorboard, start_step=self.global_step)
        global_batch = cfg.data.batch_size * self.world_size * A
        self.print(f"torchrig: {self.world_size} process(es) on {self.device} · strategy {self.strategy} · "
                   f"precision {self.precision.name} · batch {cfg.data.batch_size}/process × {self.world_size} × "
                   f"{A} accumulation = {global_batch} global · {steps_per_epoch} steps/epoch"
                   + (f" · resumed at step {self.global_step}" if self.global_step else ""))
        val_metrics: dict = {}
        stopped = ""
        try:
            for epoch in range(start_epoch, cfg.epochs):
                self.epoch = epoch
                batches.set_epoch(epoch)
                skip = start_batch if epoch == start_epoch else 0
                if skip:
                    batches.skip_batches(skip)
                else:
                    for m in self.train_metrics:
                        m.reset()
                self._window = _Window.restore(self._restored_window if skip else None)
                done = self._run_epoch(batches, epoch, epoch_len, skip, total_steps)
                if not done:  # max_steps reached mid-epoch
                    stopped = "max_steps"
                    break
                val_metrics = self._end_epoch(epoch, val_data)
                if self._should_stop():
                    stopped = "early_stop"
                    break
                if self.global_step >= total_steps:
                    break
            if cfg.checkpoint.save_final:
                self._save(final=True, metrics=val_metrics)
        finally:
            self.logger.close()
        if self.is_main and cfg.log.plot and self.run_dir is not None:
            try:
                from .plot import plot_run

                self.plots = plot_run(self.run_dir)
            except Exception as exc:  # plotting is a convenience: never fail a finished run on it
                self.print(f"torchrig: no plots written ({exc})")
        if stopped == "early_stop":
            self.print(f"torchrig: early stop after epoch {self.epoch + 1} ({self._monitor} did not improve "
                       f"for {cfg.early_stop_patience} epochs)")
        return val_metrics

    def _run_epoch(self, batches, epoch: int, epoch_len: int, start: int, total_steps: int) -> bool:
        """One epoch from micro-batch ``start``; returns False if ``max_steps`` stopped it early."""
        cfg, step, logger = self.cfg, self.step, self.logger
        A, log_every, device = cfg.accumulate, cfg.log.every_steps, self.device
        ckpt_every = cfg.checkpoint.every_steps
        scaler = self.precision.scaler
        self.wrapped.train()
        for m in self.models.values():
            m.train()
        logger.start_epoch(epoch, cfg.epochs, epoch_len, initial=start)
        acc = self._window
        it = iter(batches)
        i = start
        t_last = time.perf_counter()
        while i < epoch_len:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            acc.wait += time.perf_counter() - t0
            batch = to_device(batch, device)
            w_start = (i // A) * A
            step.window_size = min(A, epoch_len - w_start)
            step.sync_gradients = i == w_start + step.window_size - 1
            step.epoch, step.batch_index = epoch, i
            if i == w_start:
                step._begin_window()
                step.want_grad_norm = log_every > 0 and (self.global_step + 1) % log_every == 0
            with self._no_sync(not step.sync_gradients):
                out = self.step_fn(step, batch)
            acc.add(out, batch_size_of(batch))
            i += 1
            logger.advance()
            if not step.sync_gradients:
                continue
            if scaler is not None and step.stepped:
                before = scaler.get_scale()
                scaler.update()
                if scaler.get_scale() < before:
                    self.skipped_steps += 1  # fp16 overflow: GradScaler skipped this step
            if not step.stepped:  # a non-finite window skipped (one count, however many optimizers)
                self.skipped_steps += 1
                continue
            self.global_step += 1
            step.global_step = self.global_step
            if self.sched_interval == "step":
                for sch in self.schedulers.values():
                    sch.step()
            if log_every and self.global_step % log_every == 0:
                now = time.perf_counter()
                values = acc.flush(now - t_last, self.world_size, self.device)
                values.update({f"train/{m.name}": m.compute() for m in self._synced(self.train_metrics) if m.states})
                values["lr"] = self._lr()
                if step.grad_norm is not None:
                    values["grad_norm"] = float(step.grad_norm)
                if self.skipped_steps:
                    values["skipped_steps"] = self.skipped_steps
                t_last = now
                logger.log(self.global_step, values, epoch=epoch + 1)  # 1-based, as printed
                logger.progress(i, values)
            if ckpt_every and self.global_step % ckpt_every == 0:
                self._save(position=(epoch, i))
            if self.global_step >= total_steps:
                self._stop_position = (epoch, i)
                logger.end_epoch()
                return i >= epoch_len
        logger.end_epoch()
        return True

    def _end_epoch(self, epoch: int, val_data: Any) -> dict:
        cfg = self.cfg
        row = self._window.epoch_means(self.world_size, self.device) if getattr(self, "_window", None) else {}
        row.update({f"train/{m.name}": m.compute() for m in self._synced(self.train_metrics) if m.states})
        val_metrics: dict = {}
        if val_data is not None and (epoch + 1) % max(1, cfg.eval_every_epochs) == 0:
            val_metrics = {f"val/{k}": v for k, v in self.evaluate(val_data).items()}
            row.update(val_metrics)
        if self.sched_interval == "epoch":
            for sch in self.schedulers.values():
                sch.step()
        row["lr"] = self._lr()
        self.history.append(dict(row, epoch=epoch + 1, step=self.global_step))
        self.logger.log(self.global_step, row, epoch=epoch + 1)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in row.items() if isinstance(v, float))
        self.print(f"epoch {epoch + 1}/{cfg.epochs} · step {self.global_step} · {shown}")
        if self._monitor and self._monitor in row:
            value = row[self._monitor]
            better = self._best is None or (value > self._best if self._mode == "max" else value < self._best)
            if better:
                self._best, self._bad_epochs = value, 0
            else:
                self._bad_epochs += 1
        if cfg.checkpoint.every_epochs and (epoch + 1) % cfg.checkpoint.every_epochs == 0:
            self._save(position=(epoch + 1, 0), metrics=row)
        if cfg.checkpoint.monitor and val_metrics and self._monitor not in row:  # a typo would keep no best
            raise C.ConfigError(f"config key 'checkpoint.monitor': {self._monitor!r} is not a logged value; choose "
                                f"one of {', '.join(k for k in row if k != 'lr')} (the run is saved: resume=latest)")
        return val_metrics

    def _should_stop(self) -> bool:
        p = self.cfg.early_stop_patience
        return bool(p) and self._bad_epochs >= p

    # ------------------------------------------------------------------------------ checkpoints
    def _state(self, position: tuple[int, int]) -> dict:
        return {
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "schedulers": {k: s.state_dict() for k, s in self.schedulers.items()},
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler is not None else None,
            "counters": {"global_step": self.global_step, "epoch": position[0], "batch_in_epoch": position[1],
                         "skipped_steps": self.skipped_steps, "world_size": self.world_size},
            "tracker": {"best": self._best, "bad_epochs": self._bad_epochs},
            # summed over ranks; on resume rank 0 takes the sums and the other ranks start from zero
            "train_metrics": {m.name: dict(m.states) for m in self._synced(self.train_metrics)},
            "window": self._window.state(self.world_size, self.device) if getattr(self, "_window", None) else None,
            "rng": runtime.rng_state(),
        }

    def _synced(self, metrics: list) -> list:
        """Copies of ``metrics`` with states summed over ranks (the originals keep their local sums)."""
        if self.world_size == 1:
            return metrics
        out = []
        for m in metrics:
            c = copy.copy(m)
            c.states = dict(m.states)
            c.sync()
            out.append(c)
        return out

    def _save(self, position: Optional[tuple[int, int]] = None, metrics: Optional[dict] = None,
              final: bool = False) -> Optional[Path]:
        if position is None:  # final: where the run stopped
            position = getattr(self, "_stop_position", None) or (self.epoch + 1, 0)
            if self._last_saved_step() == self.global_step:
                return None
        if self.strategy == "fsdp":
            from ..checkpoint import sharded

            return sharded.save(self, position, metrics, final)
        state = self._state(position)  # on every rank: it sums the train metrics over ranks
        self._saved_step = self.global_step
        if not self.is_main:
            return None
        weights = runtime.unwrap(self.model).state_dict()
        meta = {"step": self.global_step, "epoch": position[0], "batch_in_epoch": position[1], "final": final,
                "torch": torch.__version__, "world_size": self.world_size, "precision": self.precision.name}
        path = self.ckpt.save(self.global_step, weights, state, C.to_dict(self.cfg), meta,
                              metrics=metrics)
        self._saved_step = self.global_step
        return path

    def _last_saved_step(self) -> Optional[int]:
        return getattr(self, "_saved_step", None)

    def _resume(self, spec: str) -> tuple[int, int]:
        try:
            path, problem = resolve(spec, self.run_dir), None
        except CheckpointError as exc:
            path, problem = None, exc
        if self.world_size > 1:  # every rank must resume from the same checkpoint, or none may start
            seen = runtime.gather(path.name if path is not None else None)
            if len(set(seen)) > 1:
                ranks = [r for r, name in enumerate(seen) if name != seen[0]]
                raise CheckpointError(
                    f"resume={spec!r}: rank 0 found {seen[0] or 'no checkpoint'} but rank(s) "
                    f"{', '.join(map(str, ranks))} found {seen[ranks[0]] or 'none'}; every rank reads the checkpoint, "
                    f"so run_dir must be on a file system shared by all machines (or hold the same copy on each)")
        if problem is not None:
            raise problem
        if path is None:  # resume="latest" with nothing saved yet: a fresh start
            return 0, 0
        state, meta, _ = read_checkpoint(path)
        if self.strategy == "fsdp" or (path / "sharded").exists():
            from ..checkpoint import sharded

            sharded.load_model(self, path)
        else:
            load_into(runtime.unwrap(self.model), load_weights_file(path), source=f"checkpoint '{path}'")
        try:
            for k, opt in self.optimizers.items():
                if k in state.get("optimizers", {}):
                    opt.load_state_dict(state["optimizers"][k])
                    opt._opt_called = True  # it has stepped before: no "scheduler.step() before optimizer.step()"
            for k, sch in self.schedulers.items():
                if k in state.get("schedulers", {}):
                    sch.load_state_dict(state["schedulers"][k])
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"checkpoint '{path}' optimizer/scheduler state does not fit this run ({exc}); "
                                  f"was it made with a different optimizer or model?") from None
        if self.precision.scaler is not None and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])
        counters = state.get("counters", {})
        self.global_step = int(counters.get("global_step", meta.get("step", 0)))
        self.step.global_step = self.global_step
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self.step.skipped_steps = self.skipped_steps
        tracker = state.get("tracker", {})
        self._best, self._bad_epochs = tracker.get("best"), int(tracker.get("bad_epochs", 0))
        self._restored_window = state.get("window")
        for m in self.train_metrics:
            if m.name in state.get("train_metrics", {}):
                m.states = {k: (v if self.rank == 0 else torch.zeros_like(v)).to(torch.float64)
                            for k, v in state["train_metrics"][m.name].items()}
        if "rng" in state:
            runtime.set_rng_state(state["rng"])
        self._saved_step = self.global_step
        self.resumed_from = path
        saved_world = counters.get("world_size", self.world_size)
        epoch, batch = int(counters.get("epoch", 0)), int(counters.get("batch_in_epoch", 0))
        if batch and saved_world != self.world_size:
            self.print(f"torchrig: checkpoint was saved with {saved_world} process(es), now {self.world_size}; "
                       f"resuming at the start of epoch {epoch + 1} (mid-epoch position depends on world size)")
            batch = 0
        return epoch, batch

    # ------------------------------------------------------------------------------ evaluate / predict
    def _eval_model(self) -> nn.Module:
        # DDP adds nothing to a forward without backward, and ranks may see different batch counts.
        return self.wrapped if self.strategy == "fsdp" else runtime.unwrap(self.wrapped)

    @contextlib.contextmanager
    def _eval_mode(self):
        modules = [self.wrapped, *self.models.values()]
        was = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            for m, w in zip(modules, was):
                m.train(w)

    def _padding(self, local_batches: int) -> int:
        """Extra forward passes this rank must make so that every rank makes the same number.

        Evaluation shards hold every sample once, so they differ by up to one batch between ranks. That
        is harmless for DDP (evaluation calls the bare module), but every FSDP forward all-gathers the
        parameters, and a rank with one batch less would leave the others waiting forever.
        """
        if self.strategy != "fsdp" or self.world_size == 1:
            return 0
        most = runtime.all_reduce_max(torch.tensor([local_batches], device=self.device))
        return int(most.item()) - local_batches

    def _dummy_batch(self, data: Any, last: Any) -> Any:
        """A batch to feed padding forwards: this rank's last one, or the data's first when the rank has none."""
        if last is not None:
            return last
        one = prepare_eval(data, **dict(self._loader_kwargs(eval_=True), rank=0, world_size=1, batch_size=1))
        return to_device(next(iter(one)), self.device)

    def _sync_results(self, means: dict, metrics: list) -> dict:
        """Sum every metric state over ranks; ranks that saw no sample of a state contribute zeros."""
        if self.world_size > 1:
            def layout(m: Metric) -> dict:
                return {k: tuple(v.shape) for k, v in m.states.items()}

            mine = {("mean", name): layout(m) for name, m in means.items()}
            mine.update({("metric", i): layout(m) for i, m in enumerate(metrics)})
            union: dict[tuple, dict] = {}
            for part in runtime.gather(mine):
                for key, shapes in part.items():
                    union.setdefault(key, {}).update(shapes)
            for (kind, name), shapes in union.items():
                m = means.setdefault(name, MeanValue(name)) if kind == "mean" else metrics[name]
                for k, shape in shapes.items():
                    m.states.setdefault(k, torch.zeros(shape, dtype=torch.float64, device=self.device))
        results = {}
        for m in [means[k] for k in sorted(means)] + metrics:
            m.sync()
            if m.states:
                results[m.name] = m.compute()
        return dict(sorted(results.items(), key=lambda kv: kv[0] != "loss"))  # loss first, as before

    @_explain_collective_errors
    def evaluate(self, data: Any) -> dict:
        """Loss (per-sample mean) and metrics over every sample once, reduced across ranks."""
        batches = prepare_eval(data, **self._loader_kwargs(eval_=True))
        metrics = self._metric_objects()
        means: dict[str, MeanValue] = {}
        step = self._make_step(metrics)
        step.model = self._eval_model()
        fn = self.eval_fn or default_eval_step
        pad = self._padding(len(batches))
        batch = None
        with self._eval_mode():
            for batch in batches:
                batch = to_device(batch, self.device)
                n = batch_size_of(batch)
                out = fn(step, batch)
                if isinstance(out, dict):  # a custom eval step: batch means to average per sample
                    for k, v in out.items():
                        means.setdefault(k, MeanValue(k)).update(torch.as_tensor(v, dtype=torch.float64), n)
                    continue
                output, target, loss = out
                if loss is not None:
                    means.setdefault("loss", MeanValue("loss")).update(loss.float(), n)
                if target is not None:
                    step.update_metrics(output, target)
            if pad:
                dummy, step.metrics = self._dummy_batch(data, batch), []
                for _ in range(pad):  # results discarded: every sample still counts once
                    fn(step, dummy)
                step.metrics = metrics
        return self._sync_results(means, metrics)

    @_explain_collective_errors
    def predict(self, data: Any, activation: str = "auto") -> Any:
        """Model outputs for every sample, in data order, on every rank (CPU tensors).

        ``activation="auto"`` turns logits into probabilities for the named classification losses
        (softmax for cross_entropy / nll, sigmoid for bce_with_logits); ``"none"`` keeps raw outputs.
        """
        batches = prepare_eval(data, **self._loader_kwargs(eval_=True))
        step = self._make_step([])
        step.model = self._eval_model()
        act = self._activation(activation)
        outputs = []

        def run(batch: Any) -> Any:
            if self.predict_fn is not None:
                return self.predict_fn(step, batch)
            inputs = batch[0] if isinstance(batch, (list, tuple)) and len(batch) == 1 else split_batch(batch)[0]
            with step.autocast():
                out = call_model(step.model, inputs)
            return act(out.float()) if isinstance(out, torch.Tensor) else out

        pad = self._padding(len(batches))
        batch = None
        with self._eval_mode():
            for batch in batches:
                batch = to_device(batch, self.device)
                out = run(batch)
                outputs.append(out.cpu() if isinstance(out, torch.Tensor) else out)
            if pad:
                dummy = self._dummy_batch(data, batch)
                for _ in range(pad):  # FSDP: keep the ranks' forwards in step; outputs discarded
                    run(dummy)
        if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
            local = torch.cat(outputs)
        else:
            local = [x for o in outputs for x in (o if isinstance(o, list) else [o])]
        if self.world_size == 1:
            return local
        parts = runtime.gather(local)
        total = sum(len(p) for p in parts)
        order = [None] * total
        for r, part in enumerate(parts):  # rank r holds samples r, r+W, r+2W, …
            for j, item in enumerate(part):
                order[r + j * self.world_size] = item
        tensors = any(isinstance(p, torch.Tensor) for p in parts)  # a rank without samples sends []
        return torch.stack(order) if tensors and total else order

    def _activation(self, name: str) -> Callable:
        loss = self.cfg.loss if "loss" not in self._objects else None
        if name == "auto":
            name = {"cross_entropy": "softmax", "nll": "exp", "bce_with_logits": "sigmoid"}.get(loss or "", "none")
        table = {"softmax": lambda t: t.softmax(dim=-1), "sigmoid": torch.sigmoid, "exp": torch.exp,
                 "none": lambda t: t}
        if name not in table:
            raise ValueError(f"activation {name!r} is not one of auto, {', '.join(table)}")
        return table[name]

    # ------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the run directory and destroy the process group this Trainer created (also done at exit)."""
        self._run.close()
        if self._owns_group:
            runtime.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_NULL_CONTEXT = contextlib.nullcontext()  # reusable: the loop needs no new object per step


class _Window:
    """Running sums between two log steps; ``.item()`` happens only in ``flush``."""

    __slots__ = ("sums", "count", "samples", "wait", "epoch_sums", "epoch_count")

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.count = 0
        self.samples = 0
        self.wait = 0.0
        self.epoch_sums: dict[str, float] = {}  # folded in at each flush, so per step costs nothing extra
        self.epoch_count = 0

    def add(self, out: Optional[dict], n: int) -> None:
        self.count += 1
        self.samples += n
        if out:
            for k, v in out.items():
                if isinstance(v, torch.Tensor) and v.requires_grad:
                    v = v.detach()
                self.sums[k] = self.sums[k] + v if k in self.sums else v

    def state(self, world_size: int, device: Optional[torch.device] = None) -> dict:
        """Logged-value sums for a checkpoint, averaged over ranks (every rank must call it)."""
        flat = {f"i/{k}": float(v) for k, v in self.sums.items()}
        flat.update({f"e/{k}": v for k, v in self.epoch_sums.items()})
        flat = _mean_over_ranks(flat, world_size, device)
        return {"sums": {k[2:]: v for k, v in flat.items() if k.startswith("i/")}, "count": self.count,
                "epoch_sums": {k[2:]: v for k, v in flat.items() if k.startswith("e/")},
                "epoch_count": self.epoch_count}

    @classmethod
    def restore(cls, state: Optional[dict]) -> "_Window":
        """A window that goes on from a checkpoint's sums, so resumed logs match an unbroken run."""
        w = cls()
        if state:
            w.sums, w.count = dict(state["sums"]), int(state["count"])
            w.epoch_sums, w.epoch_count = dict(state["epoch_sums"]), int(state["epoch_count"])
        return w

    def _fold(self) -> dict:
        """Interval sums as floats, added to the epoch totals."""
        sums = {k: float(v) for k, v in self.sums.items()}
        for k, v in sums.items():
            self.epoch_sums[k] = self.epoch_sums.get(k, 0.0) + v
        self.epoch_count += self.count
        return sums

    def epoch_means(self, world_size: int, device: Optional[torch.device] = None) -> dict:
        """Epoch averages of the step's logged values (``train/loss`` …) since this epoch (re)started."""
        self._fold()
        self.sums, self.count = {}, 0
        values = {f"train/{k}": v / max(1, self.epoch_count) for k, v in self.epoch_sums.items()}
        return _mean_over_ranks(values, world_size, device)

    def flush(self, elapsed: float, world_size: int, device: Optional[torch.device] = None) -> dict:
        values = {f"train/{k}": v / max(1, self.count) for k, v in self._fold().items()}
        values = _mean_over_ranks(values, world_size, device)
        values["samples_per_s"] = self.samples * world_size / max(elapsed, 1e-9)
        values["data_wait"] = self.wait / max(elapsed, 1e-9)
        self.sums, self.count, self.samples, self.wait = {}, 0, 0, 0.0
        return values


def _mean_over_ranks(values: dict, world_size: int, device: Optional[torch.device]) -> dict:
    """The mean over ranks (every rank runs the same number of micro-batches); all ranks must call it."""
    if world_size == 1 or not values:
        return values
    keys = sorted(values)
    mean = runtime.all_reduce_mean(torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device))
    return dict(zip(keys, mean.tolist()))
