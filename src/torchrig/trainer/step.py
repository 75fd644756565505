"""The training step, in one place.

``default_step`` is the whole step for "one model, one loss, one optimizer": forward under autocast,
loss, backward (scaled for accumulation), then — at the end of an accumulation window — unscale,
clip, optimizer step and zero_grad. A custom step (a GAN, multi-task losses) is an ordinary function
of ``(step, batch)`` that calls the same four primitives of :class:`Step`:
``step.autocast()``, ``step.backward(loss)``, ``step.optimizer_step(name)`` and returns the values to
log. Precision, accumulation, clipping, gradient sync, checkpoints and logging stay torchrig's job.

There is one step path. What a run needs is decided once per ``fit`` (:class:`StepOptions`, the loss's fast
case); the common case (a tensor output, a named loss, whole batches, one optimizer) costs a few attribute
reads more than a hand-written loop. Whether an update may be applied is :mod:`.nonfinite`'s decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import parallel, runtime
from ..data.batches import batch_size_of, label_keyword, label_of, split_batch
from ..optim import normalize
from ..optim.losses import tensor_loss
from ..optim.nonfinite import NonFiniteGuard, NonFiniteLossError, norm_over_ranks, prime_momentum, total_norm
from . import outputs
from .outputs import ModelIO, call_model
from .state import TrainState

GRADIENTS = "gradient averaging"  # the backward's reduction of the gradients over the ranks, as a hang names it

__all__ = ["Step", "StepOptions", "ModelCalls", "NonFiniteLossError", "default_step", "default_eval_step",
           "finite_parameters"]


@contextlib.contextmanager
def _offloaded(autocast: Any, device: torch.device) -> Any:
    with autocast, torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
        yield


def finite_parameters(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter is finite, on every rank (collective with several ranks; FSDP shards too)."""
    bad = torch.zeros(1, device=device)
    for p in model.parameters():
        t = runtime.local_tensor(p)
        if t.is_floating_point() and t.numel() and not torch.isfinite(t).all():
            bad.fill_(1)
            break
    return not runtime.all_reduce_max(bad).item()


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What a step does besides calling the model, fixed for a fit (the config keys of the same names)."""

    clip_grad_norm: Optional[float] = None
    clip_norm_type: float = 2.0
    clip_grad_value: Optional[float] = None
    on_nonfinite: str = "error"
    loss_normalization: str = "auto"
    scheduler_interval: str = "step"
    grad_ranks: int = 1          # ranks whose gradients DDP / FSDP2 average
    count_unit: float = 1.0      # a fixed scale (the per-rank batch size): loss × count / unit stays near loss
    cuts_batches: bool = False   # data.micro_batch_size cuts loaded batches: each piece weighs by its own count
    activation_offload: bool = False  # model.activation_offload: what the forward saves for backward waits on the host

    @classmethod
    def from_config(cls, cfg: Any, grad_ranks: int, batch_size: int, scheduler_interval: str = "step",
                    micro_batch_size: Any = None) -> "StepOptions":
        """The step's options of ``cfg``; ``batch_size``: the per-process batch (``data.batch_size``, or the share
        of ``data.global_batch_size`` the run plan gave this process)."""
        return cls(clip_grad_norm=cfg.clip_grad_norm, clip_norm_type=cfg.clip_norm_type,
                   clip_grad_value=cfg.clip_grad_value,
                   on_nonfinite="skip" if cfg.on_spike == "rollback" else cfg.on_nonfinite,  # rolled back
                   loss_normalization=cfg.loss_normalization, scheduler_interval=scheduler_interval,
                   grad_ranks=grad_ranks, count_unit=float(batch_size), cuts_batches=micro_batch_size is not None,
                   activation_offload=cfg.model.activation_offload)


class ModelCalls:
    """Calling the model and scoring its output: what training and evaluation steps share.

    ``model`` is what to call (DDP / FSDP wrapped in training; the bare module in evaluation), ``models`` the
    named sub-models of an ``nn.ModuleDict`` (a GAN's), ``io`` the batch and output conventions
    (``output_key``, ``data.input_keys``, ``data.label_key``: see ``trainer/outputs.py``).
    """

    def __init__(self, model: nn.Module, precision: Any, device: torch.device, *, loss_fn: Optional[Callable] = None,
                 models: Optional[dict] = None, metrics: Optional[list] = None, io: Optional[ModelIO] = None,
                 loss_parallel: bool = False, fresh_batches: bool = False, activation: Optional[Callable] = None,
                 predict_outputs: str = "prediction", class_dim: Any = "auto", fused_head: Any = None,
                 cp: Any = None):
        self.model, self.models, self.loss_fn = model, models or {}, loss_fn
        self.fused_head = fused_head  # model.fused_head (optim/fused_head.py): its loss is computed in its forward
        self.precision, self.device = precision, device
        self.metrics = metrics or []
        self._float32_metrics = any(getattr(m, "float32_scores", True) for m in self.metrics)
        self.io = io or ModelIO()
        self.shift_labels = normalize.shifts_labels(model)
        self.hugging_face = normalize.is_hugging_face(model)  # token logits (B, T, classes), not PyTorch's (B, C, T)
        # where the prediction's classes are (the config key class_dim): 1 or -1, decided on the first batch
        # under auto (outputs.class_dim); None until then
        self.class_dim_setting = class_dim
        self.class_dim: Optional[int] = class_dim if class_dim in (1, -1) else None
        # a class-index loss of PyTorch's (cross_entropy, nll, by name or object) reads class-last logits flattened
        self._class_index_loss = outputs.reads_class_indices(loss_fn)
        # a model the user spread over several devices: targets go to its output's device (parallel/placement.py)
        self.spread = len(parallel.devices_of(runtime.unwrap(model))) > 1
        self.weight = 1                 # 0 for a rank's filler micro-batch (its metrics count nothing)
        self.fresh_batches = fresh_batches  # each batch's tensors are made for it: the metrics may keep them
        self._tensor_loss = tensor_loss(loss_fn) if loss_fn is not None else None
        self._loss_checked = False  # check_loss_fit runs on the first batch only
        self.activation = activation  # in predict: the activation asked for (see inference.predict)
        self.predict_outputs = predict_outputs  # in predict: "prediction" or "all" (see inference.predict)
        self.loss_parallel = loss_parallel  # the training loss of split logits runs split (parallel.loss_parallel)
        # parallel.cp: each batch's sequences split over the context-parallel ranks (parallel.context); the labels then
        # line up with the logits: a model whose own loss shifts them gets them shifted before the split
        self.cp = cp
        self._pre_shift = cp is not None and self.shift_labels and outputs.uses_model_loss(loss_fn)
        if cp is not None:
            self.shift_labels = False

    def autocast(self):
        return self.precision.autocast()

    def stop_counting(self) -> None:
        """The forwards from here on are padding (an evaluation rank whose shard ended makes as many forwards as the
        others): the metrics count nothing of them."""
        self.weight = 0

    def sharded(self, batch: Any) -> Any:
        """``parallel.cp``: the context in which ``batch``'s sequences are split over the context-parallel ranks and
        attention runs over them; it yields this rank's share of the batch (``parallel.context``)."""
        label = label_of(batch, self.io.label_key) if isinstance(batch, dict) else None
        return self.cp.sharded(batch, label, self._pre_shift)

    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)`` of a batch (a dict's target under ``data.label_key``)."""
        if type(batch) is list and len(batch) == 2:  # what a DataLoader collates from (x, y) samples
            return batch[0], batch[1]
        return split_batch(batch, self.io.label_key)

    def forward(self, inputs: Any, model: Optional[Callable] = None, target: Any = None) -> Any:
        """Call the model on ``inputs`` (dict keys chosen by ``forward``'s signature or ``data.input_keys``).

        With ``loss="auto"`` a dict batch's ``target`` goes to ``forward`` too when ``forward`` takes it
        (``labels=`` for Hugging Face models, which then return their loss; see ``data.batches.label_keyword``).
        With ``model.fused_head`` a training forward given ``target`` computes the loss in the head."""
        if self.fused_head is not None and target is not None and torch.is_grad_enabled():
            with self.fused_head.expecting(target):
                return self._forward(inputs, model, target)
        return self._forward(inputs, model, target)

    def _forward(self, inputs: Any, model: Optional[Callable], target: Any) -> Any:
        model = model or self.model
        if type(inputs) is torch.Tensor and self.io.input_keys is None:  # the common case, as call_model does it
            try:
                out = model(inputs)
            except RuntimeError as exc:
                raise outputs.explain_forward_error(exc, model, inputs) or exc
            return out if type(out) is torch.Tensor else self._output(out)
        labels = None
        if target is not None and isinstance(inputs, dict) and outputs.uses_model_loss(self.loss_fn):
            name = label_keyword(model, self.io.label_key)
            labels = (name, target) if name is not None and name not in inputs else None
        return self._output(call_model(model, inputs, self.io.input_keys, labels))

    def _output(self, out: Any) -> Any:
        """Logits left split over the tensor-parallel ranks (a DTensor) stay split for the loss under
        ``parallel.loss_parallel``; otherwise they are gathered whole here (``parallel/loss.py``)."""
        if isinstance(out, torch.Tensor) and not self.loss_parallel:
            return parallel.loss.whole(out)
        return out

    def loss(self, output: Any, target: Any) -> tuple[Any, torch.Tensor]:
        """``(prediction, loss)``: the user's loss of the prediction, or the model's own (``loss="auto"``)."""
        if self.fused_head is not None and torch.is_grad_enabled():
            return output, self.fused_head.loss_for(output if type(output) is torch.Tensor else
                                                    outputs.unpack(output, self.io.output_key)[0], self.model)
        if self.spread:
            target = parallel.to_output_device(output, target)
        if self.loss_parallel and parallel.loss.is_split(output):  # split logits, cross-entropy split likewise
            return output, parallel.loss.split_loss(self._tensor_loss or self.loss_fn,
                                                     *self._loss_layout(output, target))
        if not self._loss_checked:  # the first batch: an output the loss cannot take is said now, in one line
            self._check_loss_fit(output, target)
        if type(output) is torch.Tensor and self._tensor_loss is not None and self.io.output_key is None:
            prediction, target = self._loss_layout(output, target)
            try:  # a tensor output and a named loss: the loss function itself, without the wrappers' calls
                return output, self._tensor_loss(prediction, target)
            except (RuntimeError, IndexError, ValueError) as exc:
                raise outputs.explain_loss_error(exc, self._tensor_loss, prediction, target) or exc
        return outputs.prediction_and_loss(output, target, self.loss_fn, self.io.output_key, self._loss_layout)

    def _loss_layout(self, prediction: Any, target: Any) -> tuple[Any, Any]:
        """``(prediction, target)`` as the loss takes them: a class-index loss of PyTorch's reads the classes in
        dimension 1, so class-last logits ``(B, T, C)`` go to it as ``(B·T, C)`` against ``(B·T,)``. The user's own
        loss gets the output as the model returned it."""
        if self._class_index_loss and getattr(prediction, "ndim", 0) >= 3 \
                and self.classes_at(prediction, target) == -1:
            return outputs.classes_last(prediction, target)
        return prediction, target

    def classes_at(self, prediction: Any, target: Any) -> int:
        """Where the classes of the model's predictions are (1 or -1): ``class_dim``, decided under auto by the first
        prediction with ``target`` (integer class indices) that needs it (``outputs.class_dim``)."""
        if self.class_dim is None:
            self.class_dim = outputs.class_dim(self.class_dim_setting, prediction, target, self.hugging_face)
        return self.class_dim

    def predict_class_dim(self, prediction: Any, inputs: Any) -> int:
        """The class dimension for predict's softmax: that of the fit or evaluation before (or ``class_dim``); else
        decided from the inputs: a token model given ids ``(B, T)`` returns ``(B, T, C)``."""
        if self.class_dim is None:
            ids = inputs[0] if isinstance(inputs, tuple) and len(inputs) == 1 else inputs
            prediction = prediction if isinstance(prediction, torch.Tensor) else \
                outputs.unpack(prediction, self.io.output_key)[0]
            self.class_dim = outputs.class_dim(self.class_dim_setting, prediction, ids, self.hugging_face,
                                               what="input ids")
        return self.class_dim

    def _check_loss_fit(self, output: Any, target: Any) -> None:
        self._loss_checked = True
        if self.loss_fn is None or (type(output) is not torch.Tensor and outputs.uses_model_loss(self.loss_fn)):
            return  # no loss of ours, or the model's own loss may train
        prediction = output if type(output) is torch.Tensor else outputs.unpack(output, self.io.output_key)[0]
        outputs.check_loss_fit(self.loss_fn, *self._loss_layout(prediction, target))

    def update_metrics(self, output: Any, target: Any, weight: Optional[int] = None) -> None:
        """Update the metrics with the prediction of ``output`` (any model output, see ``unpack``); ``weight``: that
        of the micro-batch it came from when not the current one (a pipeline's, fed later; 0: a filler)."""
        if target is None or not self.metrics or (self.weight if weight is None else weight) == 0:
            return
        if self.loss_parallel:  # the metrics read the whole logits
            output = parallel.loss.whole(output)
        if self.spread:
            target = parallel.to_output_device(output, target)
        out = output if type(output) is torch.Tensor else outputs.unpack(output, self.io.output_key)[0]
        if not isinstance(out, torch.Tensor):
            raise outputs.OutputError(f"metrics need a tensor prediction, got {type(out).__name__}; set "
                                      f"output_key to the prediction's index or key, or metrics=[]")
        out = out.detach()
        if out.is_floating_point() and out.dtype != torch.float32 and self._float32_metrics:
            out = out.float()  # a metric that reads scores in float32 (an argmax reads them in any dtype alike)
        if out.ndim >= 3 and isinstance(target, torch.Tensor) and target.ndim == out.ndim - 1 \
                and self.classes_at(out, target) == -1:
            out, target = self._token_layout(out, target)
        for m in self.metrics:  # a batch made for this step: nothing writes its target later, the metrics may keep it
            m.feed(out, target, self.fresh_batches)

    def _token_layout(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class-last token logits ``(B, T, C)`` as PyTorch's ``(B, C, T)`` for the metrics; a Hugging Face causal
        LM that computes its own loss predicts ``labels[:, 1:]`` from ``logits[:, :-1]``, so its metrics compare
        those."""
        if logits.shape[:-1] != target.shape:
            return logits, target
        if self.shift_labels and outputs.uses_model_loss(self.loss_fn):
            logits, target = logits[:, :-1], target[:, 1:]
        return logits.movedim(-1, 1), target


class Step(ModelCalls):
    """What a step function sees, and the owner of each optimizer step's bookkeeping.

    One object per ``fit``. Its state changes only through its own methods, which the accumulation window
    (``trainer/window.py``) calls in order: :meth:`begin_window` before the first micro-batch of an
    accumulation window (the micro-batches of one optimizer step), :meth:`begin_micro_batch` before the step
    function runs on each micro-batch, and :meth:`end_window` after the last: GradScaler update, skip counting,
    the step counter and per-step schedulers live there, in one place.

    ``groups``: the process groups of the fit's layout (the data-parallel ranks whose counts make the global
    batch's; the pipeline whose stages' gradients make the norm clipped by). ``before_update(optimizer)``: called
    before each update (``data.micro_batch_size=auto`` on several ranks agrees there that none ran out of memory).
    """

    def __init__(self, model: nn.Module, optimizers: dict, loss_fn: Optional[Callable], precision: Any,
                 device: torch.device, options: StepOptions = StepOptions(), *, models: Optional[dict] = None,
                 metrics: Optional[list] = None, state: Optional[TrainState] = None,
                 schedulers: Optional[dict] = None, io: Optional[ModelIO] = None,
                 groups: runtime.Groups = runtime.WORLD, before_update: Optional[Callable] = None,
                 loss_parallel: bool = False, fresh_batches: bool = False, class_dim: Any = "auto",
                 fused_head: Any = None, replicas: Any = None, cp: Any = None):
        super().__init__(model, precision, device, loss_fn=loss_fn, models=models, metrics=metrics, io=io,
                         loss_parallel=loss_parallel, fresh_batches=fresh_batches, class_dim=class_dim,
                         fused_head=fused_head, cp=cp)
        self.optimizers = optimizers    # name -> optimizer ("default" for a single one)
        self.options = o = options
        self.clip_grad_norm, self.clip_norm_type, self.clip_grad_value = o.clip_grad_norm, o.clip_norm_type, \
            o.clip_grad_value
        self.on_nonfinite, self.loss_normalization = o.on_nonfinite, o.loss_normalization
        self.grad_ranks, self.count_unit, self.cuts_batches = o.grad_ranks, o.count_unit, o.cuts_batches
        self.state = state if state is not None else TrainState()
        self.schedulers = schedulers or {}
        self.per_step_schedulers = list(self.schedulers.values()) if o.scheduler_interval == "step" else []
        self.world_size = runtime.get_world_size()
        self.groups = groups
        # ranks whose gradients differ after the all-reduce (tensor parallel: each holds its shard) agree on the
        # host; a model spread over several devices has one flag per device, not one kernel's: decided on the host
        self.guard = NonFiniteGuard(o.on_nonfinite, device, self.world_size, model,
                                    agree=groups.dp_size() < self.world_size, host=self.spread or None)
        self.before_update = before_update
        self.replicas = replicas  # dist.fault_tolerance=torchft: parallel.Replicas weighs and commits each step
        self._reduce_op = "all_reduce" if isinstance(model, nn.parallel.DistributedDataParallel) else "reduce_scatter"
        self.norm_group = groups.pipeline if groups.pipelined else None  # stages' norms make the norm clipped by
        # the micro-batch under way (begin_micro_batch)
        self.batch: Any = None
        self.batch_size = 1             # its samples (batch_size_of; 1 for no batch)
        self.count: normalize.Count = 0  # its items (set by its first backward)
        self._counted = False
        self.sync_gradients = True      # True on the window's last micro-batch: gradients are reduced, the step made
        self.batch_index = 0            # the loaded batch it comes from, in the epoch
        # the window under way (begin_window)
        self.window_size = 1
        self.window_samples: Optional[int] = None  # its global sample count, when the sampler knows it
        self.epoch = 0
        self.want_grad_norm = False     # this step measures the gradient norm (a log step, the spike check)
        self._window_count: Optional[normalize.Count] = None  # None: no backward counted in this window
        self._factor, self._whole, self._samples_only = None, False, True
        self.grad_norm: Optional[torch.Tensor] = None  # per window, read by the loop
        self.stepped = False            # an optimizer step was applied (or left to the device) in this window

    def autocast(self):
        """The training forward's context: autocast, and with ``model.activation_offload`` PyTorch's
        ``save_on_cpu`` (each tensor saved for backward copied to host memory, pinned on CUDA, and back in
        backward)."""
        if not self.options.activation_offload:
            return self.precision.autocast()
        return _offloaded(self.precision.autocast(), self.device)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.global_step

    @property
    def host_checks(self) -> bool:
        """Whether the non-finite decision is read on the host at once (a CPU run) or left to the device."""
        return self.guard.host

    @host_checks.setter
    def host_checks(self, value: bool) -> None:
        self.guard.host = bool(value)

    # -- the accumulation window -----------------------------------------------------------------
    def begin_window(self, size: int, samples: Optional[int] = None, *, epoch: int = 0,
                     grad_norm: bool = False) -> None:
        """Before the first of the ``size`` micro-batches of one optimizer step, in ``epoch``. ``samples``: the
        window's samples over all ranks when the sampler knows them; when every micro-batch of the window is
        counted by its samples (``count_of``'s default for class targets, whichever step function runs), the
        global count needs no all-reduce and a full window no rescaling at all. ``grad_norm``: measure the
        gradient norm even without clipping."""
        self.window_size, self.window_samples, self.epoch, self.want_grad_norm = size, samples, epoch, grad_norm
        if self.replicas is not None:  # torchft: the replica groups of this step, a replacement healed before it
            self.replicas.begin_step()
        self.restart_window()

    def restart_window(self) -> None:
        """The window begins again, nothing of it counted yet (after an out-of-memory error under ``auto``)."""
        self._window_count, self._factor, self._samples_only = None, None, True
        # One whole micro-batch on one process: the window's count is its own, so its loss weighs exactly 1
        # and the gradients need no rescaling (no op; bitwise what a hand-written loop computes).
        self._whole = (self.window_size == 1 and self.grad_ranks == 1 and not self.cuts_batches
                       and self.replicas is None)
        self.grad_norm, self.stepped = None, False
        self.guard.begin_window()

    def begin_micro_batch(self, batch: Any, weight: int = 1, *, last: bool = True, index: Optional[int] = None) -> None:
        """Before the step function runs on ``batch`` (``weight`` 0: a filler that must count nothing); ``last``:
        the window's last micro-batch, whose backward reduces the gradients and whose step function steps;
        ``index``: the loaded batch it comes from in the epoch (for messages)."""
        self.batch, self.weight = batch, weight
        self.batch_size = batch_size_of(batch)  # samples of this micro-batch (read several times per step)
        self.count, self._counted = 0, False
        self.sync_gradients = last
        if index is not None:
            self.batch_index = index

    def end_window(self) -> bool:
        """After the window's last micro-batch: count the optimizer step. True: the loop goes on to the step's end.

        One rule wherever the decision is taken (see :mod:`.nonfinite`): every window is an optimizer step
        (``global_step`` counts it, per-step schedulers step, ``on_step_end`` runs), and a window whose update
        was not applied (non-finite values, an fp16 overflow) is also counted in ``skipped_steps`` and leaves
        the weights and the EMA as they were.
        """
        scaler = self.precision.scaler
        if scaler is not None and self.stepped:
            scaler.update()  # lowers the scale after an overflow, on the device (nothing read here)
        if self.guard.end_window(self.stepped):
            self.state.skipped_steps += 1
        self.state.global_step += 1
        if self.per_step_schedulers:
            if self.stepped:
                for sch in self.per_step_schedulers:
                    sch.step()
            else:
                with warnings.catch_warnings():  # a first window skipped on the host never called optimizer.step
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                    for sch in self.per_step_schedulers:
                        sch.step()
        if self.want_grad_norm:  # a log step reads the device anyway
            self.settle(self.state.global_step)
        return True

    @property
    def window_skipped(self) -> Any:
        """Whether the last window's update was not applied: a bool when the host decided, else a 0-d float
        tensor on the device (1.0: skipped), so that what follows (the EMA) can depend on it without a read."""
        return self.guard.skipped(self.stepped)

    def settle(self, upto: Optional[int] = None) -> None:
        """Count the windows skipped on the device since the last call (one host read), or raise under
        ``on_nonfinite=error``. The loop calls it at log steps and before each checkpoint."""
        self.state.skipped_steps += self.guard.settle(upto or self.state.global_step)

    def count_of(self, target: Any = None) -> normalize.Count:
        """Items (samples or valid tokens, as ``loss_normalization`` says) of the current micro-batch's
        ``target`` (its own target when None); a device tensor for tokens, so nothing waits."""
        if target is None:
            target = self.split(self.batch)[1]
        mode = self.loss_normalization
        if mode == "micro_batches":
            return 1
        if mode == "samples" or (mode == "auto" and type(target) is torch.Tensor and target.ndim < 2):
            return self.batch_size
        return normalize.count_items(mode, target, self.batch_size, self.shift_labels)

    @property
    def log_weight(self) -> normalize.Count:
        """How much the current micro-batch's logged values weigh: its count (the samples of the batch when
        the step function did not call :meth:`backward`), or 1 per micro-batch with ``micro_batches``. Counts of
        samples are given in full batches (``count / data.batch_size``); only the ratios matter."""
        if self.loss_normalization == "micro_batches":
            return self.weight
        count = self.count if self._counted else self.batch_size * self.weight
        if isinstance(count, torch.Tensor):
            return count
        # in units of a full batch: a full batch weighs 1, and the logger then needs no multiply per step
        return 1 if count == self.count_unit else count / self.count_unit

    # -- the primitives ----------------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return next(iter(self.optimizers.values()))

    def backward(self, loss: torch.Tensor, count: Optional[normalize.Count] = None, *,
                 retain_graph: bool = False) -> None:
        """Backward of ``loss``, a mean over ``count`` items (samples or valid tokens; by default those of
        the current micro-batch, see :meth:`count_of`), weighted so that the optimizer step sees the mean
        over the whole global batch (and scaled for fp16). The first backward of a micro-batch adds its
        count to the window; further ones (a GAN's second loss) reuse the batch's count."""
        self.guard.note_loss(loss)
        scaled = self._weighted(loss, count)
        if self.precision.scaler is not None:
            scaled = self.precision.scaler.scale(scaled)
        # the window's last backward reduces the gradients over the ranks (DDP, FSDP2): numbered for a hang's watch
        reduces = runtime.enter_collective(self._reduce_op, GRADIENTS) if self.sync_gradients and self.grad_ranks > 1 \
            else 0
        if self.loss_parallel:  # the split cross-entropy's backward runs split too
            with parallel.loss.context(True):
                scaled.backward(retain_graph=retain_graph)
        else:
            scaled.backward(retain_graph=retain_graph)
        runtime.leave_collective(reduces)

    def _weighted(self, loss: torch.Tensor, count: Optional[normalize.Count]) -> torch.Tensor:
        if self.loss_normalization == "micro_batches":
            return self.weigh(loss, 1, self.weight)
        default = count is None
        if default:
            count = self.count if self._counted else self.count_of()
        count = count * self.weight
        first = not self._counted
        if first:
            self._count_in(count)
        if self._whole and not (first or default):  # a further loss with a count of its own weighs count / the
            n = self._window_count                   # micro-batch's count
            return loss * (count / (n.clamp_min(1) if isinstance(n, torch.Tensor) else max(n, 1)))
        return self.weigh(loss, count, self.weight)

    def _count_in(self, count: normalize.Count) -> None:
        self.count, self._counted = count, True
        self._window_count = count if self._window_count is None else self._window_count + count
        if self._samples_only and (isinstance(count, torch.Tensor) or count != self.batch_size * self.weight):
            self._samples_only = False  # an item that is not a sample: the sampler's count is not the window's

    def count_micro_batch(self, target: Any) -> normalize.Count:
        """Count the current micro-batch (``target``: its target) into the window, as its first :meth:`backward`
        does, and return its count (items × weight). A pipeline counts every micro-batch of its window so before
        it runs them together, then weighs each loss with :meth:`weigh`."""
        if self.loss_normalization == "micro_batches":
            return 1
        count = self.count_of(target) * self.weight
        self._count_in(count)
        return count

    def weigh(self, loss: torch.Tensor, count: normalize.Count, weight: int = 1) -> torch.Tensor:
        """``loss`` (a mean over ``count`` items, a micro-batch of ``weight`` 0 or 1) as the window's step weighs
        it: ``loss × count / unit`` (see ``optim/normalize.py``), or as it is for a whole window on one process."""
        if self.loss_normalization == "micro_batches":
            if weight == 0:
                return loss * 0.0
            return loss / self.window_size if self.window_size > 1 else loss
        if self._whole or (not isinstance(count, torch.Tensor) and count == self.count_unit):
            return loss  # a full batch of samples: nothing to weigh (and no extra op per micro-batch)
        return loss * (count / self.count_unit)  # a float32 factor even for a bf16 loss (counts stay exact)

    def _window_factor(self) -> Any:
        """What turns the window's summed gradients into the global-batch mean; one all-reduce of the
        count per window, made by every rank before any may reject the window (no rank left waiting).
        None (gradients left as they are) when no loss went through :meth:`backward` in this window, or
        when the window is one whole micro-batch on one process (its count is the global one)."""
        if (self._factor is None and self.loss_normalization != "micro_batches" and self._window_count is not None
                and not self._whole):
            if self.replicas is not None:  # the groups that took part in this step, counted by torchft's manager
                self._factor = self.replicas.window_factor(self._window_count, self.count_unit, self.device,
                                                           self.global_step + 1, self._where())
            elif self.window_samples is not None and self._samples_only:
                # sample counts whose global sum the sampler knows: the factor is a Python number (1.0, no op,
                # for full batches), the same on every rank, with no all-reduce and no copy to the device
                self._factor = self.grad_ranks * self.count_unit / max(self.window_samples, 1)
            else:
                self._factor = normalize.window_factor(self._window_count, self.grad_ranks, self.count_unit,
                                                       self.device, self.groups.data)
        return self._factor

    def optimizer_step(self, name: Optional[str] = None) -> bool:
        """At the end of a window: unscale, check, clip, step, zero_grad. Returns whether a step was taken.

        Nothing non-finite is applied: a NaN / inf gradient skips the step or raises, as ``on_nonfinite``
        says; see :mod:`.nonfinite` for where that is decided (on the host, or on the device by the fused
        kernel, counted at the next log step). Under fp16 the GradScaler finds inf gradients itself and lowers
        its scale instead (counted as a skipped step).
        """
        if not self.sync_gradients:
            return False
        opt = self.optimizers[name] if name is not None else self.optimizer
        if self.before_update is not None:
            self.before_update(opt)
        factor = self._window_factor()  # its all-reduce runs before any rank may reject the window
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if self.replicas is not None:  # torchft: the mean over the replica groups of this step
            self.replicas.average([p.grad for p in params])
        if factor is not None:  # before unscale (linear: the same result), clipping and the finite check
            normalize.scale_gradients([p.grad for p in params], factor)
        scaler = self.precision.scaler
        if scaler is not None:
            if self.clip_grad_norm or self.clip_grad_value or self.want_grad_norm:
                scaler.unscale_(opt)
                self._clip(params)
            prime_momentum(opt)
            scaler.step(opt)  # skips the update itself when the gradients hold inf / NaN
            self.guard.note_scaler(scaler, opt)
        elif not self.guard.apply(opt, params, self._clip(params), self._where):
            return False
        applied = self.replicas is None or self.replicas.committed(self._where())  # torchft may drop the update
        opt.zero_grad(set_to_none=True)
        self.stepped = applied
        return applied

    def _where(self) -> str:
        return f"optimizer step {self.global_step + 1} (epoch {self.epoch + 1}, batch {self.batch_index + 1})"

    def _clip(self, params: list) -> Optional[torch.Tensor]:
        """Clip (unscaled) gradients by value and/or norm; the total norm when one is measured (clipping by
        norm, or a log step), else None. A non-finite norm leaves the gradients non-finite, never hidden."""
        if self.clip_grad_value:
            torch.nn.utils.clip_grad_value_(params, self.clip_grad_value)
        if not (self.clip_grad_norm or self.want_grad_norm):
            return None
        norm = total_norm([p.grad for p in params], self.clip_norm_type)
        if self.norm_group is not None:  # pipeline stages hold different parameters: the norm of them all
            norm = norm_over_ranks(norm, self.clip_norm_type, self.norm_group)
        meshes = {id(getattr(p.grad, "device_mesh", None)) for p in params}
        if self.clip_grad_norm and len(meshes) > 1:  # tensor parallel: DTensors of several meshes and plain tensors
            normalize.scale_gradients([p.grad for p in params],  # torch's coefficient, on each local piece
                                      (self.clip_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        elif self.clip_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad_norm, norm)
        self.grad_norm = norm
        return norm

    # -- conveniences --------------------------------------------------------------------------
    def frozen(self, *models: Any):
        """``with step.frozen("D") as D:`` — no gradient reaches these models' parameters in the block.

        For a loss that goes through a network it must not train (a GAN's generator loss through D):
        without it that backward leaves gradients in D which D's next optimizer step would add to its
        own. Takes names of ``step.models`` or modules, and yields the plain module (a tuple for
        several), without its DDP wrapper: call that one inside, since a DDP module whose parameters
        get no gradient would wait for their all-reduce.
        """
        from ..optim.freeze import frozen

        return frozen(self.models, models)


MISSING_TARGET = ("training batches carry no target: give (inputs, target) pairs, a dict with a 'labels' key (or "
                  "set data.label_key), or a custom step function")


def default_step(step: Step, batch: Any) -> dict:
    """zero_grad (after the previous step) → forward under autocast → loss → metrics → backward → step.

    The metrics read the prediction before backward and keep none of it: nothing of the forward outlives backward.
    """
    inputs, target = step.split(batch)
    if target is None:
        raise ValueError(MISSING_TARGET)
    with step.autocast():
        output = step.forward(inputs, target=target)
        prediction, loss = step.loss(output, target)
    step.update_metrics(prediction, target)
    del output, prediction  # autograd frees the output (an LM's logits) during backward, as in a hand loop
    step.backward(loss, step.count_of(target))
    step.optimizer_step()
    return {"loss": loss.detach()}


def default_eval_step(step: ModelCalls, batch: Any) -> tuple[Any, Any, Optional[torch.Tensor]]:
    """``(prediction, target, loss)`` of one evaluation batch (called under ``inference_mode``)."""
    inputs, target = step.split(batch)
    with step.autocast():
        output = step.forward(inputs, target=target)
        if target is None:
            return outputs.unpack(output, step.io.output_key)[0], None, None
        prediction, loss = step.loss(output, target)
    return prediction, target, loss
