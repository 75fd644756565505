"""``Trainer``: fit / evaluate / predict for a plain ``nn.Module``.

Reading order: ``__init__`` sets up the runtime (device, threads, seed, process group, precision, the
layout and its process groups, the run plan, wrapping); ``fit`` runs named phases: prepare the data, build
the schedules, set up the run (metrics, step, accumulation windows, callbacks, checkpoints, logs), restore a
checkpoint, loop over epochs, finish. ``_run_epoch`` is the loop: fetch a batch, hand it to the accumulation
window (``window.py``: its micro-batches through the step function, the optimizer step at its end), then log
and maybe checkpoint. The step itself is ``step.default_step``; a checkpoint is the ``{name: Stateful}``
mapping of ``saving.states``. The validated config is never written to: what the run derives from it is the
:class:`~.plan.RunPlan` (``self.plan``).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import config as C
from .. import parallel, runtime
from ..checkpoint import CheckpointManager, finish_saves
from ..checkpoint.rundir import RunDir
from ..config.files import atomic_file, make_dir
from ..data import Batches, check_same_data, prefetch_to_device, prepare_eval, prepare_train, to_device
from ..data.common import is_iterable_source
from ..data.packing import check_model, is_packed
from ..data.split import describe as describe_split
from ..metrics import Metric, get_metrics
from ..observe.finish import end_of_run, finished_where, start_of_run
from ..observe.metrics_logger import MetricsLogger
from ..observe.run_logger import RunLogger
from ..observe.stragglers import Stragglers
from ..observe.throughput import FlopCount, fit_callbacks
from ..optim import adapters, float8, losses, qat
from ..optim.ema import build_ema, ema_weights
from . import build, inference, saving
from . import outputs as O
from .callbacks import BestCheckpoint, Callbacks, EarlyStopping, Monitor
from .context import FitContext
from .microbatch import Retry, check_auto, chunks
from .options import resolve_options
from .pipeline import PipelineStep
from .plan import FitPlan, RunPlan, keep_horizon, run_length
from .shares import SourceShares
from .state import MetricStates, TrainState
from .spikes import Rollback, SpikeGuard, keep_ledger, replan
from .step import ModelCalls, Step, StepOptions, default_step
from .window import Window, Windows


def _known_warnings_quiet(method: Callable) -> Callable:
    """``fit`` / ``evaluate`` / ``predict`` / ``find_lr`` without the warnings torch gives for what torchrig does on
    purpose (``parallel.tensor_parallel.quiet_cpu_alltoall``)."""
    import functools

    @functools.wraps(method)
    def call(self: "Trainer", *args: Any, **kwargs: Any) -> Any:
        with parallel.tensor_parallel.quiet_cpu_alltoall(self.layout.tp > 1 and self.device.type == "cpu"):
            return method(self, *args, **kwargs)
    return call


class Trainer:
    """Train, evaluate and predict with the user's model, data and optimizer, unchanged.

    ``optimizer``, ``loss``, ``scheduler`` and ``metrics`` take names or objects; every other
    keyword is a config key (see ``torchrig.config.Config``) or a short alias (``lr``,
    ``batch_size``, ``strategy`` …). ``step_fn(step, batch) -> dict`` replaces the training step for
    models that are not "one loss, one optimizer"; ``eval_fn`` and ``predict_fn`` likewise.
    ``callbacks`` are plain objects with any of the hooks listed in ``torchrig.trainer.callbacks``.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, loss: Any = None, metrics: Any = None,
                 scheduler: Any = None, callbacks: Optional[list] = None, step_fn: Optional[Callable] = None,
                 eval_fn: Optional[Callable] = None, predict_fn: Optional[Callable] = None,
                 config: Optional[C.Config] = None, **kwargs: Any):
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer needs an nn.Module, got {type(model).__name__}")
        given = {"optimizer": optimizer, "loss": loss, "scheduler": scheduler, "metrics": metrics}
        self.cfg, self._objects = resolve_options(config, given, kwargs)
        self.model = model
        self.step_fn = step_fn or default_step
        self.config_builds_model = False  # True when the config rebuilds `model` (the CLI); else its class is saved
        self.eval_fn, self.predict_fn = eval_fn, predict_fn
        self.callbacks = Callbacks(callbacks)
        self._run_callbacks = self.callbacks  # with early stopping and best-checkpoint tracking during fit
        self.state = TrainState()
        self.history: list[dict] = []
        self.schedulers: dict[str, Any] = {}
        self.total_steps: Optional[int] = None  # the optimizer steps of the fit under way (set before its schedulers)
        self.sched_interval = "step"
        self.train_metrics: list[Metric] = []
        self.step: Optional[Step] = None
        self.windows: Optional[Windows] = None  # the accumulation windows of the fit under way
        self.monitor = Monitor(None)
        self.early_stopping = EarlyStopping(self.monitor, None)
        self.checkpoints: Optional[CheckpointManager] = None
        self.metrics_log: Optional[MetricsLogger] = None
        self.resumed_from: Optional[Path] = None
        self.plots: list = []  # the end-of-run plot's PNG paths
        self._activation_said = False  # predict's line saying which activation auto chose: once
        self._val_loader: Optional[tuple] = None  # during fit: (val_data, its batches once built, its length)
        self._signals = runtime.StopSignal()
        self._spikes: Optional[SpikeGuard] = None  # on_spike: rollback, during fit
        self._owns_group = False
        self._names: Optional[list] = None  # every rank's (host, device), once asked (_rank_names)
        self._run = RunDir()
        self._run_dir: Optional[Path] = Path(self.cfg.run_dir) if self.cfg.run_dir else None
        try:
            self._setup_runtime()
            self._place(model)
            # in place before any wrapping: peft's LoRA adapters (the rest frozen), torchao's QAT or float8 layers
            self.adapted = adapters.prepare(model, self.cfg, self.device)
            self._start_lines = [qat.prepare(model, self.cfg.quantize),
                                 float8.prepare(model, self.cfg, self.device, fsdp=self.strategy == "fsdp")]
            check_auto(self.cfg, model, self.world_size)
            self.wrapped, self.models = build.wrap_models(model, self.cfg, self.strategy, self.device,
                                                          self.precision.dtype, self.layout)
            # channels_last weights: the first batch's forward is tried once with them (see _check_layout)
            self._layout_probe = runtime.wants_channels_last(model, self.cfg.model.channels_last, self.device)
            if self.layout.pipeline is not None:
                self._use_pipeline(step_fn, eval_fn, predict_fn)
            self.optimizers = build.build_optimizers(self._objects.get("optimizer"), model, self.cfg,
                                                     self.strategy, self.device, split=self.layout.sharded)
            self.loss_fn = losses.build_loss(self._objects.get("loss", self.cfg.loss), self.cfg.label_smoothing)
            self.fused_head = build.fused_head(model, self.cfg, self.loss_fn, self.layout, self.device)
            metrics = get_metrics(self._objects.get("metrics", self.cfg.metrics))  # a misspelt name fails here
            self._start_lines += build.speed_lines(model, self.cfg, self.device, self.fused_head, metrics)
            self.ema = build_ema(self.cfg, self.model)  # None unless ema_decay is set
        except BaseException:
            self.close()  # a failed set-up must not leave a process group (and its peers) waiting
            raise

    def _setup_runtime(self) -> None:
        cfg, d = self.cfg, self.cfg.dist
        self.dist_info = runtime.detect(d.init_method, d.rank, d.world_size)
        self.device = runtime.select_device(cfg.device, self.dist_info.local_rank)
        self._owns_group = runtime.init_process_group(self.dist_info, self.device, d.backend, d.init_method, d.timeout,
                                                      flight_recorder=d.hang_timeout > 0)
        self.rank = runtime.get_rank()
        self.world_size = runtime.get_world_size()
        self.is_main = self.rank == 0
        self.threads = runtime.configure_threads(cfg.threads, cfg.interop_threads)
        runtime.configure_backends(cfg.deterministic, cfg.cudnn_benchmark, self.device)
        runtime.seed_everything(cfg.seed)
        self.precision = runtime.make_precision(cfg.precision, self.device)
        self.layout = parallel.build_layout(cfg.parallel, d.strategy, self.world_size, self.device)
        self.strategy = self.layout.strategy
        groups = self.layout.groups  # the pipeline's last stage joins them once the model is cut (_use_pipeline)
        # the sampler's shard: context-parallel ranks (parallel.cp) split the sequences of one shard's samples
        self.dp_rank, self.dp_size = groups.sample_rank(), groups.sample_ranks()
        self.replicas = self._replica_group()
        if self.replicas is not None:  # the data is split over the replica groups; only group 0 writes
            self.dp_rank, self.dp_size = self.replicas.group, self.replicas.groups
            self.is_main = self.is_main and self.replicas.group == 0
        self.state.world_size = self.world_size
        self.plan = RunPlan.derive(cfg, self.dp_size, self.world_size, pipelined=self.layout.pp > 1,
                                   cuda=self.device.type == "cuda")

    def _replica_group(self) -> Optional[parallel.Replicas]:
        """``dist.fault_tolerance=torchft``: this process's replica group (``parallel/replicas.py``), else None."""
        d = self.cfg.dist
        if d.fault_tolerance != "torchft":
            if os.environ.get("TORCHRIG_REPLICA_GROUPS"):  # set by torchrig launch --replica-groups
                raise parallel.ReplicaGroupError(
                    "torchrig launch --replica-groups started this process as one of several replica groups, but "
                    "dist.fault_tolerance is none: set dist.fault_tolerance=torchft, or launch without --replica-groups")
            return None
        parallel.replicas.check_composition(self.world_size, self.strategy, self.layout, self.cfg)
        group, groups, lighthouse = parallel.replicas.from_environment()
        say = print if self.rank == 0 else (lambda _line: None)
        return parallel.Replicas(group, groups, lighthouse, self.device, d.timeout, say)

    def _use_pipeline(self, step_fn: Optional[Callable], eval_fn: Optional[Callable],
                      predict_fn: Optional[Callable]) -> None:
        """``parallel.pp``: the pipeline's step, evaluation and prediction (trainer/pipeline.py) replace the default
        ones; the user's own cannot run on a model cut into stages."""
        given = [name for name, fn in (("step_fn", step_fn), ("eval_fn", eval_fn), ("predict_fn", predict_fn)) if fn]
        if given:
            raise parallel.ParallelConfigError(
                f"config key 'parallel.pp': {self.layout.pp} cuts the model into stages that only the default step "
                f"can run (each rank calls the model's forward up to its stage's last block), so Trainer("
                f"{given[0]}=...) cannot be pipelined; leave {given[0]} out, or set parallel.pp=1")
        if self.cfg.log.flops:
            self.print("torchrig: log.flops is not measured under parallel.pp (the first step's FLOPs are spread "
                       "over the stages); rows carry no flops_per_s")
        self._layout_probe = False  # the stages' forwards are the pipeline's to run
        self.layout.pipeline.check_microbatches(self.plan.micro_batches_per_window, "accumulate")
        replicas = self.dp_size > 1 and self.layout.strategy == "ddp"  # FSDP2 stages reduce their own gradients
        steps = PipelineStep(self.layout.pipeline, self.layout.dp_group if replicas else None)
        self.step_fn, self.eval_fn, self.predict_fn = steps, steps.evaluate, steps.predict

    def _place(self, model: nn.Module) -> None:
        """A model the user spread over several devices is trained where it is: its inputs go to the device of
        its first parameter (``parallel/placement.py``)."""
        placed = parallel.placed_device(model)
        if placed is None:
            return
        if self.world_size > 1:
            raise parallel.ParallelConfigError(
                f"the model's parameters are on {', '.join(map(str, parallel.devices_of(model)))}: a model spread over "
                f"several devices trains in one process; start one process, or put the model on one device and use "
                f"parallel.tp / dist.strategy=fsdp")
        self.device = placed
        self.print(f"torchrig: the model is spread over {', '.join(map(str, parallel.devices_of(model)))}; it stays "
                   f"where it is, inputs go to {placed} and targets to the device of its output")

    # ------------------------------------------------------------------------------ helpers
    run_dir = property(lambda self: self._run_dir,
                       doc="where this run writes; None until the first fit when run_dir was not given")
    global_step = property(lambda self: self.state.global_step, doc="optimizer steps taken")
    skipped_steps = property(lambda self: self.state.skipped_steps, doc="windows not applied (non-finite / overflow)")
    epoch = property(lambda self: self.state.epoch, doc="0-based epoch of the next micro-batch")
    logger = property(lambda self: self.metrics_log.out if self.metrics_log else None)

    def open_run(self) -> Path:
        """Claim, lock and check the run directory (``fit`` does this first; call it to write files there
        before). Without ``run_dir`` a new numbered directory ``runs/default/N`` is used."""
        new_run = self.cfg.resume is None and runtime.restart_count() == 0
        run_dir = self.cfg.run_dir
        if self.replicas is not None and self.replicas.group > 0:  # group 0 writes the run; the others lock their own
            run_dir = str(Path(run_dir) / "replicas" / str(self.replicas.group))
        path = self._run.open(run_dir, "runs/default", new_run, self.cfg.overwrite, say=self.print,
                              newest=self.cfg.resume in ("latest", "best"))
        self._run_dir = path
        return path

    def _loader_kwargs(self, eval_: bool = False) -> dict:
        d, p = self.cfg.data, self.plan
        return dict(batch_size=(d.eval_batch_size or p.batch_size) if eval_ else p.batch_size, seed=self.cfg.seed,
                    rank=self.dp_rank, world_size=self.dp_size, device=self.device, num_workers=d.num_workers,
                    pin_memory=d.pin_memory, persistent_workers=d.persistent_workers,
                    prefetch_factor=d.prefetch_factor, fast_path=d.fast_path,
                    local_world_size=self.dist_info.local_world_size,
                    **({} if eval_ else dict(shuffle=d.shuffle, drop_last=p.drop_last, max_steps=self.cfg.max_steps,
                                             steps_per_epoch=d.steps_per_epoch, accumulate=p.accumulate)))

    def _make_step(self, metrics: list, before_update: Optional[Callable], fresh_batches: bool) -> Step:
        grad_ranks = self.layout.groups.dp_size() if self.strategy in ("ddp", "fsdp") else 1  # cp ranks too
        if self.replicas is not None:  # torchft averages over the groups of each step
            grad_ranks = self.replicas.groups
        p = self.plan
        optimizers = self.optimizers
        if self.replicas is not None:  # torchft applies or drops each step's update
            if len(optimizers) > 1:
                raise parallel.ReplicaGroupError(f"dist.fault_tolerance=torchft: {len(optimizers)} optimizers; torchft "
                                                 f"commits one optimizer step per step: use one optimizer")
            optimizers = {k: self.replicas.wrap_optimizer(o) for k, o in optimizers.items()}
        return Step(self.wrapped, optimizers, self.loss_fn, self.precision, self.device,
                    StepOptions.from_config(self.cfg, grad_ranks, p.batch_size, self.sched_interval,
                                            p.micro_batch_size),
                    models=self.models, metrics=metrics, state=self.state, schedulers=self.schedulers,
                    io=O.ModelIO.from_config(self.cfg), groups=self.layout.groups, before_update=before_update,
                    loss_parallel=parallel.loss.resolve(self.cfg.parallel.loss_parallel, self.layout.plan,
                                                        self.loss_fn),
                    fresh_batches=fresh_batches, class_dim=self.cfg.class_dim, fused_head=self.fused_head,
                    replicas=self.replicas, cp=self.layout.context)

    def _synced(self) -> list:
        """The wrapped modules whose gradient reduction ``no_sync`` defers to a window's last micro-batch."""
        return [self.wrapped] if not self.models or self.wrapped is not self.model else list(self.models.values())

    def _make_windows(self, fresh_batches: bool) -> Windows:
        """The step of this fit and its accumulation windows (with the out-of-memory retry of ``auto``)."""
        p, synced = self.plan, self._synced()
        retry = Retry(model=runtime.unwrap(self.model), synced=synced, metrics=self.train_metrics,
                      logger=self.metrics_log, optimizers=self.optimizers, precision=self.precision,
                      device=self.device, agree=self.world_size > 1 and self.strategy == "ddp",
                      batch_size=p.batch_size, accumulate=p.accumulate, say=self.print) \
            if p.micro_batch_size == "auto" else None
        metrics = [] if self.fused_head is not None else self.train_metrics  # no logits in training: evaluation's
        self.step = self._make_step(metrics, retry.before_update if retry and retry.agreeing else None, fresh_batches)
        return Windows(self.step, self.step_fn, micro_batch_size=p.micro_batch_size, batch_size=p.batch_size,
                       synced=synced, logger=self.metrics_log, retry=retry,
                       observe=self._spikes.observe if self._spikes is not None else None)

    def _metric_objects(self) -> list[Metric]:
        return get_metrics(self._objects.get("metrics", self.cfg.metrics), device=self.device)

    def _lr(self) -> float:
        return float(self.optimizers[next(iter(self.optimizers))].param_groups[-1]["lr"])

    @runtime.explain_collective_errors
    @_known_warnings_quiet
    def find_lr(self, data: Any, start_lr: float = 1e-7, end_lr: float = 10.0, steps: int = 200,
                smooth: float = 0.9, diverge: float = 4.0, plot: Any = None) -> Any:
        """An exponential learning-rate sweep (``steps`` batches from ``start_lr`` to ``end_lr``) on a copy of the
        model and optimizer, which are left unchanged, bitwise (see ``trainer/lrfind.py``). Returns the curve and
        a suggested learning rate with its rule; rank 0 draws loss against lr as a PNG (``plot``: its path;
        default RUN_DIR/plots/lr_find.png, or ./lr_find.png without a run_dir; False: none)."""
        from . import lrfind

        result = lrfind.sweep(self, data, self._loader_kwargs(), start_lr, end_lr, steps, smooth, diverge)
        if plot is not False and self.is_main:
            where = Path(plot) if plot else (self.run_dir / "plots" if self.run_dir else Path(".")) / "lr_find.png"
            result.plot = lrfind.plot(result, where, root=self.run_dir if self.run_dir and not plot else where.parent)
        self.print(result.describe())
        return result

    def summary(self) -> str:
        """The model summary: each top-level module's parameters (trainable, frozen) and size, and the memory of
        the weights, gradients and optimizer state one process holds (``fit`` prints it unless log.summary=false)."""
        from ..observe.summary import model_summary

        shards = ((self.layout.dp_shard if self.layout.pp > 1 else self.world_size)  # a pipeline: this rank's stages
                  if self.strategy == "fsdp" else 1)
        split = self.layout.describe() if self.layout.tp > 1 or self.layout.pp > 1 else ""
        whole = self.layout.pipeline.whole_parameters if self.layout.pipeline is not None else None
        return model_summary(runtime.unwrap(self.model), self.optimizers, self.precision.name, shards,
                             self.ema is not None, split, whole)

    def print(self, text: str) -> None:
        """Print from the main process only (through the progress bar when one is shown)."""
        if self.metrics_log is not None and self.metrics_log.out.enabled:
            self.metrics_log.out.print(text)
        elif self.is_main:
            print(text, flush=True)

    # ------------------------------------------------------------------------------ fit
    @runtime.explain_collective_errors
    @_known_warnings_quiet
    def fit(self, train_data: Any, val_data: Any = None) -> dict:
        """Train for ``epochs`` (or ``max_steps``); returns the last validation metrics (or {}); a stop signal
        raises ``RunStopped``, in the loop after the step under way and its checkpoint (``runtime.signals``)."""
        with runtime.StopSignal(self.world_size, self.cfg.dist.stop_timeout) as self._signals:
            self._health_check()
            self.open_run()
            start_of_run(self)  # matplotlib imported meanwhile when the run ends with its plot
            self._val_loader = (val_data, None, None)
            try:
                plan = self._prepare_data(train_data, val_data)
                self._build_schedules(plan)
                self._set_up_run(val_data)
                result = {} if self._restore(plan) else self._train(plan)
            except runtime.RunStopped as stop:  # a kernel interrupt reaches a notebook as a KeyboardInterrupt
                interrupted = runtime.as_notebook_stop(stop)
                if interrupted is stop:
                    raise
                raise interrupted from None
            finally:  # the save in flight is written (or its error raised) before the run directory is let go
                self._val_loader = None  # its loader's workers stop with it
                with self._signals.saving():
                    finish_saves(self.checkpoints, self._run.close)
        return result

    def _eval_batches(self, data: Any) -> Any:
        """``data``'s evaluation batches. During ``fit``, when the validation data's loader has persistent
        worker processes, it is built once, so that they serve every epoch instead of starting anew (again
        if the data set's length changes)."""
        kept = self._val_loader
        if kept is not None and kept[0] is data and kept[1] is not None and kept[2] == len(data):
            return kept[1]
        batches = prepare_eval(data, **self._loader_kwargs(eval_=True))
        if (kept is not None and kept[0] is data and type(batches) is Batches  # a stream keeps no position
                and getattr(batches.source, "num_workers", 0) > 0
                and getattr(batches.source, "persistent_workers", False)):
            self._val_loader = (data, batches, len(data))
        return batches

    def _train(self, plan: FitPlan) -> dict:
        self._check_val_data(plan.val_data)
        self._run_callbacks.call("on_fit_start", self)
        self._signals.stop_at_steps()
        watch = self._watch_hangs()
        try:
            val_metrics, stopped = self._loop(plan)
        except BaseException as exc:
            if watch is not None and runtime.peer_lost(exc):  # name the ranks that are gone, before the error
                line = watch.lost()
                if line:
                    self.print(f"torchrig: {line}")
            self._run_callbacks.call("on_exception", self, exc)
            raise
        finally:
            if watch is not None:
                watch.stop()
            if self.metrics_log.ranks is not None:
                self.metrics_log.ranks.detach()
            self.metrics_log.out.close()
        self._finish(stopped)
        return val_metrics

    def _rank_names(self) -> list:
        """Every rank's (host, device), in rank order (one collective, the first time)."""
        if self._names is None:
            self._names = runtime.gather((socket.gethostname(), str(self.device)), name="rank names")
        return self._names

    def _health_check(self) -> None:
        """``dist.health_check``: every device's matmul, memory and link, before training; a rank far below the
        others stops the run on every rank with the same line (``runtime/health.py``)."""
        if not self.cfg.dist.health_check:
            return
        from ..observe.throughput import peak_flops
        from ..runtime import health

        dtype = self.precision.dtype or torch.float32
        problems = health.check_ranks(self.device, dtype, self._rank_names(), self.print,
                                      peak_flops(self.device, self.precision.name))
        if problems:
            raise runtime.RuntimeSetupError(
                f"dist.health_check: {'; '.join(problems)}; nothing was trained. Replace or free that device or host "
                f"(torchrig doctor --gpus on it), or set dist.health_check=false to train anyway")

    def _straggler_check(self) -> Optional[Stragglers]:
        """Several ranks logging rows: each rank's data wait and forward at log steps, a straggler named
        (``observe/stragglers.py``); one collective now for every rank's host and device."""
        if self.world_size < 2 or not self.cfg.log.every_steps:
            return None
        d = self.cfg.dist
        check = Stragglers(d.straggler_factor, d.straggler_steps, self._rank_names(), self.print, self.device)
        return check if self.layout.pipeline is not None else check.attach(self.wrapped)  # stages: data wait only

    def _watch_hangs(self) -> Optional[runtime.HangWatch]:
        """``dist.hang_timeout``: the watchdog of this rank over the loop (``runtime/hang.py``), several ranks only."""
        d = self.cfg.dist
        if self.world_size < 2 or not d.hang_timeout:
            return None
        signals, state = self._signals, self.state
        progress = runtime.Progress(beat=lambda: signals.beat, busy=lambda: signals.saving_now,
                                    steps=lambda: state.global_step)
        return runtime.HangWatch(d.hang_timeout, d.timeout, _dump_writer(self.run_dir), progress, rank=self.rank,
                                 world_size=self.world_size, device=self.device, where=str(self.run_dir),
                                 nccl="nccl" in runtime.backend_name(), store=runtime.default_store(),
                                 settle=self.checkpoints.wait).start()

    def _check_packed(self, *datas: Any) -> None:
        """Packed documents (``torchrig.data.PackedDocuments``) reach a model that keeps them apart, or stop here in
        one line; a step function of the user's calls the model its own way (a pipeline's is torchrig's)."""
        pipelined, cp = self.layout.pp > 1, self.layout.cp
        if any(is_packed(d) for d in datas) and (pipelined or cp > 1 or self.step_fn is default_step):
            check_model(self.model, pipelined, self.cfg.data.input_keys, cp=cp)

    def _prepare_data(self, train_data: Any, val_data: Any) -> FitPlan:
        self._check_packed(train_data, val_data)
        self._data = prepare_train(train_data, **self._loader_kwargs())  # saved in checkpoints as "data"
        self._data.say = self.print  # a stream's notes go through the progress display
        self._data.position = lambda: self.state.batch_in_epoch  # what the loop trained (a prefetcher reads ahead)
        self._shares = SourceShares(self._data)
        if self.world_size > 1:
            check_same_data(self._data, val_data, self.device)  # one all-reduce: ranks that differ stop now
        return FitPlan.for_data(self._data, self.cfg, self.plan, val_data)

    def _build_schedules(self, plan: FitPlan) -> None:
        """The schedulers; a factory gets ``total_steps``, this fit's optimizer steps (also ``self.total_steps``)."""
        self.total_steps = plan.total_steps
        self.schedulers, self.sched_interval, note = build.build_schedulers(
            self._objects.get("scheduler"), self.optimizers, self.cfg, plan.total_steps,
            plan.describe(self.cfg, self.plan), unknown=plan.unknown)
        if note:
            self.print(note)
        if plan.total_steps is not None:
            plan.total_steps += self.global_step  # a second fit() of this Trainer trains as long again
        self.state.total_steps, self.state.run_length = plan.total_steps or 0, run_length(self.cfg)  # the horizon

    def _set_up_run(self, val_data: Any) -> None:
        """Metrics, logs, checkpoints, the spike check, the step and its windows, monitoring callbacks, and the
        context that saving and resuming read."""
        cfg = self.cfg
        self.train_metrics = self._metric_objects()
        ck = cfg.checkpoint
        self.checkpoints = CheckpointManager(self.run_dir, ck.keep_last, ck.keep_best, writes=self.is_main,
                                             sharded=self.layout.sharded, async_save=ck.async_save,
                                             pipeline=self.layout.groups.pipeline,
                                             trainable_only=self.adapted is not None and not ck.include_base)
        self.metrics_log = MetricsLogger(RunLogger(self.run_dir, enabled=False), cfg.log.every_steps,
                                         self.layout.groups, self.device,
                                         staged=cfg.on_nonfinite == "skip",  # a skipped window's loss: not logged
                                         ranks=self._straggler_check())
        self._spikes = SpikeGuard(cfg.spike, state=self.state, data=self._data, checkpoints=self.checkpoints,
                                  run_dir=self.run_dir, device=self.device, rank=self.rank,
                                  world_size=self.world_size, say=self.print, verify=cfg.checkpoint.verify) \
            if cfg.on_spike == "rollback" else None
        self.windows = self._make_windows(fresh_batches=getattr(self._data, "fresh", False))
        name = cfg.checkpoint.monitor
        if name is None and val_data is not None:
            name = f"val/{self.train_metrics[0].name if self.train_metrics else 'loss'}"
        self.monitor = Monitor(name, cfg.checkpoint.mode, self.train_metrics)
        self.early_stopping = EarlyStopping(self.monitor, cfg.early_stop_patience)
        best = BestCheckpoint(self.monitor, explicit=cfg.checkpoint.monitor is not None)
        self._run_callbacks = Callbacks([self.early_stopping, best, *fit_callbacks(cfg), *self.callbacks.items])
        self.flops = FlopCount(self.metrics_log, self.device, self.precision.name, self.print) if self.plan.flops \
            else None
        self.resumed_from = None
        self.fit_context = FitContext(
            cfg=cfg, plan=self.plan, layout=self.layout, device=self.device, rank=self.rank,
            world_size=self.world_size, model=runtime.unwrap(self.model), optimizers=self.optimizers,
            schedulers=self.schedulers, precision=self.precision, state=self.state, step=self.step,
            windows=self.windows, train_metrics=self.train_metrics, metrics_log=self.metrics_log,
            checkpoints=self.checkpoints, early_stopping=self.early_stopping, callbacks=self.callbacks,
            data=self._data, ema=self.ema, spikes=self._spikes, signals=self._signals, run_dir=self.run_dir,
            config_builds_model=self.config_builds_model, say=self.print,
            notify=lambda hook, *args: self._run_callbacks.call(hook, self, *args),
            base=self.adapted.base if self.adapted is not None else None, replicas=self.replicas)
        if self.replicas is not None:  # what a replacement replica group copies from a live one
            self.replicas.serve(lambda: saving.live_state(self.fit_context),
                                lambda state: saving.load_live_state(self.fit_context, state))

    def _restore(self, plan: FitPlan) -> bool:
        """Resume from a checkpoint if asked (or after a torchrun restart); True if the run already finished."""
        cfg = self.cfg
        resume = cfg.resume
        restarts = runtime.restart_count()
        if resume is None and restarts > 0:  # torchrun restarted the group, or Slurm requeued the job: carry on
            resume = "latest"
        if self.is_main:
            self.checkpoints.clean_partial()  # before resuming: a killed save may have left `latest` mid-swap
        if resume and self.world_size > 1:
            runtime.barrier()  # no rank resolves `latest` while rank 0 finishes such a swap
        if resume:
            plan.start = self._resume(resume)
            if self.resumed_from is not None and (note := keep_horizon(self.state, plan, run_length(cfg))):
                self.print(note)
            if restarts > 0 and self.resumed_from is not None:
                self.print(f"torchrig: restart {restarts} by torchrun; resumed from {self.resumed_from}")
        if self.replicas is not None:
            plan.start = self._join_replicas(plan.start)
        if self.is_main:  # the rollbacks of the state resumed (none on a fresh start): see spikes.keep_ledger
            excluded = getattr(getattr(plan.batches, "sampler", None), "excluded", None)  # no collective, no read
            keep_ledger(self.run_dir, [] if excluded is None else excluded.tolist())
        if self.resumed_from is not None and (plan.ends_by(self.global_step) or plan.start[0] >= cfg.epochs
                                              or self.early_stopping.should_stop):
            self.print(f"torchrig: the run in {self.run_dir} already finished at step {self.global_step} "
                       f"({self.resumed_from.name}); nothing to train. To train further, raise epochs or "
                       f"max_steps, or start a new run")
            return True
        self.metrics_log.out = RunLogger(self.run_dir, enabled=self.is_main, progress=cfg.log.progress,
                                         start_step=self.global_step, config=cfg)  # and the trackers
        if cfg.log.summary:
            self.print(self.summary())
        # what trains, what is quantised, what runs faster
        for line in (self.adapted.line() if self.adapted else None, *self._start_lines):
            if line:
                self.print(line)
        p = self.plan
        split = f" · {self.layout.describe()}" if self.layout.mesh is not None else ""
        if self.layout.pipeline is not None:  # the schedule, and the stages a rank holds when more than one
            per = len(self.layout.pipeline.stages)
            split += f" ({cfg.parallel.pp_schedule}{f', {per} stages per rank' if per > 1 else ''})"
        self.print(f"torchrig: {self.world_size} process(es) on {self.device} · strategy {self.strategy}{split} · "
                   f"precision {self.precision.name} · "
                   f"{describe_split(p.batch_size, p.dp_size, p.accumulate, p.global_batch_size)} · "
                   + (f"{plan.steps_per_epoch} steps/epoch" if plan.steps_per_epoch is not None else
                      "epochs end with the stream")
                   + ((" · fp32 matmuls on TF32" if runtime.tf32_in_force() else " · fp32 matmuls in full fp32")
                      if self.device.type == "cuda" else "")
                   + (f" · resumed at step {self.global_step}" if self.global_step else ""))
        return False

    def _join_replicas(self, start: tuple[int, int]) -> tuple[int, int]:
        """The first quorum of the replica groups: a group behind the live ones copies their state there and goes
        on from their position; one line says so."""
        before = self.global_step
        if self.replicas.join() is None or self.global_step == before:  # step 0: torchft's first weight sync
            return start
        epoch, batch = saving.live_position(self.fit_context)
        print(f"torchrig: replica group {self.replicas.group} joined the live replica group(s) at step "
              f"{self.global_step} (epoch {epoch + 1}, batch {batch}): copied their model, optimizer, schedules, "
              f"counters and data position (it had reached step {before})", flush=True)
        return epoch, batch

    def _loop(self, plan: FitPlan) -> tuple[dict, str]:
        """Epochs until the end, ``max_steps``, early stop or a signal; returns (last val metrics, why stopped).
        ``on_spike: rollback`` may send the loop back to a snapshot, from where it goes on (trainer/spikes.py)."""
        while True:
            try:
                return self._epochs(plan)
            except Rollback as back:
                plan.start = (back.epoch, back.batch)
                replan(plan, self.cfg, self.plan.accumulate)

    def _epochs(self, plan: FitPlan) -> tuple[dict, str]:
        val_metrics: dict = {}
        start_epoch, start_batch = plan.start
        for epoch in range(start_epoch, self.cfg.epochs):
            skip = start_batch if epoch == start_epoch else 0
            plan.batches.set_epoch(epoch)
            if skip:
                plan.batches.skip_batches(skip)
            else:
                for m in self.train_metrics:
                    m.reset()
            self.metrics_log.start_epoch(resumed=bool(skip))
            if self._spikes is not None:
                self._spikes.maybe_snapshot(saving.states(self.fit_context))
            stopped = self._run_epoch(plan, epoch, skip)
            if stopped:  # max_steps reached mid-epoch, or a signal
                return val_metrics, stopped
            val_metrics = self._end_epoch(epoch, plan.val_data) or val_metrics  # eval_every_epochs > 1
            if self.early_stopping.should_stop:
                return val_metrics, "early_stop"
            if self._signals.check_now():
                return val_metrics, "signal"
            if plan.ends_by(self.global_step):
                break
        return val_metrics, "signal" if self._signals.check_now() else ""

    def _finish(self, stopped: str) -> None:
        """The signal's exit, or the final checkpoint, the end-of-run plot and the callbacks' end."""
        if stopped == "signal":
            self._stop_by_signal()
        if self.cfg.checkpoint.save_final and self.checkpoints.last_step != self.global_step:
            self._save(final=True)
        self._signals.immediately(finished_where(self))  # no step left to finish: a signal now stops at once
        if stopped == "early_stop":
            self.print(f"torchrig: early stop after epoch {self.epoch} ({self.monitor.name} did not improve "
                       f"for {self.cfg.early_stop_patience} epochs)")
        if self.is_main:
            self.plots = end_of_run(self)
        self._run_callbacks.call("on_fit_end", self)

    def _run_epoch(self, plan: FitPlan, epoch: int, start: int) -> str:
        """One epoch from micro-batch ``start``; returns why it stopped early ("max_steps", "signal") or ""."""
        log, out, state, signals, device = self.metrics_log, self.metrics_log.out, self.state, self._signals, self.device
        ckpt_every = self.cfg.checkpoint.every_steps
        on_step_end = self._run_callbacks.hooks["on_step_end"]
        ema, flops, shares = self.ema, self.flops, self._shares
        for m in (self.wrapped, *self.models.values()):
            m.train()
        # the bar counts optimizer steps, as the epoch's line does (a window starts at a multiple of accumulate)
        out.start_epoch(epoch, self.cfg.epochs, plan.epoch_len, initial=start, steps=plan.steps_per_epoch,
                        steps_done=-(-start // self.plan.accumulate))
        it = prefetch_to_device(plan.batches, device)  # CUDA: the next batch's copy overlaps this step
        i = start
        state.epoch, state.batch_in_epoch = epoch, i
        window: Optional[Window] = None
        while plan.epoch_len is None or i < plan.epoch_len:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            log.wait += now - t0
            signals.beat = now  # progress, for a stop signal's watchdog
            if self._layout_probe:
                self._check_layout(batch)
            batch = to_device(batch, device)
            if window is None or window.full:
                window = self._open_window(plan, epoch, i)
            if flops is not None:  # log.flops: the fit's first batch is counted as it trains
                flops.measure(lambda: window.add(batch, plan.batches.weight(i), i), batch, self.wrapped, self.step)
                flops = self.flops = None
            else:
                window.add(batch, plan.batches.weight(i), i)
            i += 1
            state.batch_in_epoch = i
            if not window.full:  # inside an accumulation window
                continue
            values = window.finish()  # the optimizer step is counted
            out.advance()
            shares.add(epoch, window.first, window.size)  # a Mixture's sources, for the logged row
            if self._spikes is not None:  # a spike: back to the snapshot, leaving Rollback for _loop
                self._spikes.check(window.first, window.size, self.step.grad_norm, saving.states(self.fit_context))
            if ema is not None:
                ema.update(self.step.window_skipped)
            for fn in on_step_end:
                fn(self, values)
            if log.should_log(state.global_step):
                self._log_interval(epoch, i)
            if ckpt_every and state.global_step % ckpt_every == 0:
                self._save()
            if self._spikes is not None:
                self._spikes.maybe_snapshot(saving.states(self.fit_context))
            signalled = signals.check()
            if plan.ends_by(state.global_step) or signalled:
                out.end_epoch()
                return "signal" if signalled else ("" if plan.epoch_len is not None and i >= plan.epoch_len
                                                   else "max_steps")
        out.end_epoch()
        return ""

    def _check_layout(self, batch: Any) -> None:
        """Before the first step with channels_last weights: a forward that cannot take them (a ``.view`` after a
        convolution) turns them off under ``auto`` in one process, with one line, and is refused otherwise."""
        self._layout_probe = False
        row = chunks(self.step.split(to_device(batch, self.device))[0], 1)[0]
        # the bare module: a compiled one would compile again for a one-row, eval-mode call (and then take the
        # batch size as dynamic, slower, for the rest of the run); a DDP one would sync its buffers
        bare = runtime.unwrap(self.wrapped)
        with self.precision.autocast():
            error = runtime.channels_last_breaks(bare, lambda: self.step.forward(row, model=bare), self.device)
        if error is None:
            return
        model = type(runtime.unwrap(self.model)).__name__
        if self.cfg.model.channels_last is True or self.world_size > 1 or self.cfg.model.compile:
            raise C.ConfigError(f"config key 'model.channels_last': {model}'s forward fails with channels_last "
                                f"weights ({error}); set model.channels_last=false, or use .reshape / .flatten "
                                f"instead of .view in the forward")
        runtime.unwrap(self.model).to(memory_format=torch.contiguous_format)
        self.print(f"torchrig: model.channels_last=auto turned off: {model}'s forward needs the default memory "
                   f"format ({error}); set model.channels_last=false to skip this check, or use .reshape instead "
                   f"of .view to keep the faster layout")

    def _open_window(self, plan: FitPlan, epoch: int, first: int) -> Window:
        """The accumulation window that loaded batch ``first`` of ``epoch`` begins: up to the next multiple of
        ``accumulate`` or the epoch's end (a stream yields whole windows)."""
        A, epoch_len = self.plan.accumulate, plan.epoch_len
        end = first - first % A + A
        size = end - first if epoch_len is None else min(end, epoch_len) - first
        # the window's global sample count, from the sampler: needed to weigh several micro-batches or ranks, not a
        # whole batch on one process (the step uses it when every micro-batch is counted by its samples)
        known = size > 1 or self.step.grad_ranks > 1 or self.step.cuts_batches
        return self.windows.open(size, epoch=epoch, first=first,
                                 samples=plan.batches.global_samples(first, size) if known else None,
                                 grad_norm=self.metrics_log.should_log(self.state.global_step + 1)
                                 or self._spikes is not None)

    def _log_interval(self, epoch: int, batch: int) -> None:
        extra = MetricStates(self.train_metrics, self.layout.groups).values()
        extra["lr"] = self._lr()
        if self.step.grad_norm is not None:
            extra["grad_norm"] = float(self.step.grad_norm)
        if self.skipped_steps:
            extra["skipped_steps"] = self.skipped_steps
        extra.update(self._shares.take())  # data/share/NAME of a Mixture: from the sampler's positions, no collective
        values = self.metrics_log.flush(self.global_step, epoch + 1, extra)  # epochs 1-based, as printed
        self.metrics_log.out.progress(batch, values)
        self._run_callbacks.call("on_log", self, values, "interval")

    def _end_epoch(self, epoch: int, val_data: Any) -> dict:
        cfg = self.cfg
        row = self.metrics_log.epoch_means()
        row.update(MetricStates(self.train_metrics, self.layout.groups).values())
        val_metrics: dict = {}
        if val_data is not None and (epoch + 1) % max(1, cfg.eval_every_epochs) == 0:
            val_metrics = {f"val/{k}": v for k, v in self.evaluate(val_data).items()}
            row.update(val_metrics)
        if self.sched_interval == "epoch":
            build.step_epoch_schedulers(self.schedulers, row, self.monitor.name)
        row["lr"] = self._lr()
        self.step.settle()  # the windows skipped on the device: one read per epoch
        if self.skipped_steps:
            row["skipped_steps"] = self.skipped_steps
        self.state.epoch, self.state.batch_in_epoch = epoch + 1, 0
        self.history.append(dict(row, epoch=epoch + 1, step=self.global_step))
        self.metrics_log.log_epoch(self.global_step, epoch + 1, row)
        self.metrics_log.out.epoch_summary(epoch + 1, cfg.epochs, self.global_step, row)
        self._run_callbacks.call("on_log", self, row, "epoch")
        if cfg.checkpoint.every_epochs and (epoch + 1) % cfg.checkpoint.every_epochs == 0:
            self._save(metrics=row)
        return val_metrics

    def _stop_by_signal(self) -> None:
        """Save where the loop stopped, say how to continue, requeue on Slurm, and exit 128 + signal."""
        signum = self._signals.check_now()
        if self.checkpoints.last_step != self.global_step:
            self._save()
        stop = runtime.RunStopped.at_step(signum, self.global_step, self.run_dir)
        self.print(str(runtime.as_notebook_stop(stop)))
        if self.cfg.dist.requeue and self.is_main:
            self.print(runtime.requeue_slurm_job() or "torchrig: dist.requeue=true but SLURM_JOB_ID is not set")
        raise stop

    # ------------------------------------------------------------------------------ checkpoints (saving.py)
    def _save(self, metrics: Optional[dict] = None, final: bool = False) -> Optional[Path]:
        return saving.save(self.fit_context, metrics, final)

    def _resume(self, spec: str) -> tuple[int, int]:
        self.resumed_from, epoch, batch = saving.resume(self.fit_context, spec)
        return epoch, batch

    # ------------------------------------------------------------------------------ evaluate / predict
    @runtime.explain_collective_errors
    @_known_warnings_quiet
    def evaluate(self, data: Any, ema: bool = True) -> dict:
        """Loss (per-sample mean) and metrics over every sample once, reduced across ranks; with the EMA
        weights when the run keeps an EMA (``ema_decay``) and ``ema`` is true."""
        with ema_weights(self.ema, ema, self.print):
            results = inference.evaluate(self._eval_run(data, self._metric_objects()), self.eval_fn)
        self.callbacks.call("on_eval_end", self, results)
        return results

    @runtime.explain_collective_errors
    @_known_warnings_quiet
    def predict(self, data: Any, activation: str = "auto", outputs: str = "prediction") -> Any:
        """Model outputs for every sample, in data order, on every rank (CPU tensors).

        ``outputs="prediction"``: one tensor, the prediction (the field the loss and the metrics use: a
        tuple's element ``output_key``, a dict's or ``ModelOutput``'s ``logits``) whatever the output's
        structure. ``outputs="all"``: a tuple / dict of per-sample fields for tuple / dict / ``ModelOutput``
        outputs. ``activation="auto"`` turns the prediction into probabilities for the classification losses,
        by name or object (softmax for cross_entropy and the default auto, exp for nll, sigmoid for
        bce_with_logits), and keeps any other loss's raw outputs; the first such call says which in one line.
        ``"softmax"``, ``"sigmoid"``, ``"exp"`` or ``"none"`` choose. The softmax runs over the classes: dimension
        1, or the last of a token model's ``(batch, positions, classes)`` (``class_dim``).
        """
        if outputs not in ("prediction", "all"):  # the parameter hides the outputs module here
            raise ValueError(f"predict(outputs={outputs!r}): expected \"prediction\" (the prediction tensor, the "
                             f"default) or \"all\" (the model's whole output, field by field)")
        act = inference.activation_for(activation, self._objects.get("loss", self.cfg.loss))
        if activation == "auto" and not self._activation_said and (self.predict_fn is None or self.layout.pp > 1):
            self._activation_said = True  # the default predict step applies it: said once
            self.print(inference.activation_line(act, O.loss_words(self._objects.get("loss"), self.cfg.loss)))
        return inference.predict(self._eval_run(data, [], act, outputs), act, self.predict_fn, outputs)

    def _eval_run(self, data: Any, metrics: list, activation: Optional[Callable] = None,
                  outputs: str = "prediction") -> inference.EvalRun:
        """One pass over ``data`` in evaluation: its batches, and what ``eval_fn`` / ``predict_fn`` see (the bare
        model: DDP adds nothing to a forward without backward, and ranks may run different batch counts; FSDP's
        own module, whose forward gathers the shards)."""
        self._check_packed(data)
        return inference.EvalRun(self._eval_batches(data), self._eval_calls(metrics, activation, outputs),
                                 [self.wrapped, *self.models.values()], self.device, self.dp_size,
                                 self.layout.lockstep and self.world_size > 1, lambda: self._first_samples(data),
                                 self._signals.beat_now, self.layout.groups)

    def _eval_calls(self, metrics: list, activation: Optional[Callable] = None,
                    outputs: str = "prediction") -> ModelCalls:
        model = self.wrapped if self.strategy == "fsdp" else runtime.unwrap(self.wrapped)
        seen = self.step.class_dim if self.step is not None else None  # the class dimension this fit found
        return ModelCalls(model, self.precision, self.device, loss_fn=self.loss_fn, models=self.models,
                          metrics=metrics, io=O.ModelIO.from_config(self.cfg), activation=activation,
                          predict_outputs=outputs, class_dim=seen or self.cfg.class_dim, cp=self.layout.context)

    def _first_samples(self, data: Any, n: int = 1) -> Any:
        """The first ``n`` samples of ``data`` as one evaluation batch on the device (padding forwards of a rank
        without a sample; the validation data's check before training)."""
        one = prepare_eval(data, **dict(self._loader_kwargs(eval_=True), rank=0, world_size=1, batch_size=n,
                                        num_workers=0, persistent_workers=False))  # no worker for n samples
        return to_device(next(iter(one)), self.device)

    def _check_val_data(self, val_data: Any) -> None:
        """Validation data that does not fit the model fails before training, not after the first epoch: the model's
        forward on its first two samples (two: a forward that squeezes its batch dimension would fail on one alone), on every rank (a tensor-parallel or FSDP forward is collective). A stream is not read ahead (it may
        not be read twice), a pipeline's stages are not probed (their forward is the schedule's), and an ``eval_fn``
        of the user's is not called an extra time (it may count, write samples …)."""
        if val_data is None or self.eval_fn is not None or self.layout.pipeline is not None \
                or isinstance(val_data, Batches) or is_iterable_source(val_data):
            return
        inference.probe(self._eval_calls([]), lambda: self._first_samples(val_data, 2),
                        [self.wrapped, *self.models.values()])

    # ------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release the run directory and destroy the process group this Trainer created (also done at exit)."""
        self._run.close()
        if getattr(self, "replicas", None) is not None:
            self.replicas.close()
            self.replicas = None
        if self.metrics_log is not None:  # the tracker runs end here: test metrics may follow fit
            self.metrics_log.out.finish()
        if self._owns_group:
            runtime.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _dump_writer(run_dir: Path) -> Callable[[str, Callable[[Any], None]], None]:
    """``save(name, fill)``: RUN_DIR/hang/NAME written whole by ``fill(binary file)`` through the run folder's writer
    (a hang's dumps, ``runtime/hang.py``)."""
    folder = run_dir / runtime.hang.FOLDER

    def save(name: str, fill: Callable[[Any], None]) -> None:
        make_dir(folder, root=run_dir)
        with atomic_file(folder / name, root=run_dir) as fh:
            fill(fh)

    return save
