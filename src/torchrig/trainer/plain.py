"""The plain step: one model, one loss, one optimizer, one batch per optimizer step, fp32, one CPU process.

The general training step (the loop's window bookkeeping, :class:`~.microbatch.MicroBatcher` and
:func:`~.step.default_step` through :class:`~.step.Step`'s primitives) handles accumulation,
micro-batches, mixed precision, several ranks, several optimizers, custom step functions and token
counts. Its Python costs some 30 µs per step more than this one: a twentieth of a small model's step
on one CPU core.

When a run needs none of that, the loop gives each ordinary batch to :class:`PlainStep` instead: the
same operations in the same order, in one function (forward, the user's loss, backward, the metrics,
the finite check of the loss and of the gradients, ``optimizer.step``, ``zero_grad``, the logged sums,
the step counter and the per-step schedulers). Weights, logs, metrics and checkpoints are bitwise those of
the general step; ``tests/trainer/test_plain.py`` runs both and compares. A log step measures the
gradient norm, as the general step does; a short last batch is a whole window on one process, which
the general step does not reweigh either (``Step.begin_window``). Token targets take the general step;
a non-finite loss or gradient is raised or skipped by the general step's own ``Step._reject``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from . import normalize, outputs
from .losses import tensor_loss
from .step import _finite, _total_norm, default_step

GENERAL = object()  # what PlainStep returns for a batch the general step must take


class PlainStep:
    """``plain(batch, epoch, index)``: the step's values, None for a skipped step, or ``GENERAL``."""

    def __init__(self, trainer: Any) -> None:
        step = trainer.step
        self.trainer, self.step, self.state, self.log = trainer, step, step.state, trainer.metrics_log
        self.device = trainer.device  # a batch already there needs no to_device: a no-op that costs ~1 µs
        self.cpu = self.device.type == "cpu"  # is_cpu reads a flag; .device makes an object
        self.model, self.loss_fn, self.key = step.model, step.loss_fn, step.io.output_key
        self.tensor_loss = tensor_loss(step.loss_fn)  # the same function, without the wrappers' calls
        self.optimizer = step.optimizer
        self.metrics = step.metrics
        self.schedulers = step.per_step_schedulers
        # a logged loss weighs its samples: a full batch 1, a short one its share of one (micro_batches: 1)
        self.unit = step.count_unit if step.loss_normalization != "micro_batches" else None
        self.tokens_possible = step.loss_normalization == "auto"  # integer (B, T) targets count tokens
        self.fresh_batches = False  # the loop sets Batches.fresh: the metrics may then keep targets uncopied

    @classmethod
    def for_trainer(cls, trainer: Any) -> Optional["PlainStep"]:
        """A PlainStep when the whole run suits it (decided at each epoch's start), else None."""
        step, micro = trainer.step, trainer.micro
        plain = (trainer.world_size == 1 and trainer.cfg.accumulate == 1 and step.host_checks
                 and micro.size is None and not micro.auto and step.before_update is None
                 and step.precision.dtype is None and step.precision.scaler is None
                 and not step.clip_grad_norm and not step.clip_grad_value
                 and len(step.optimizers) == 1 and not step.class_last
                 and step.loss_normalization != "tokens"
                 # a skipped step restores BatchNorm-like buffers from a copy the general step takes
                 and (step.on_nonfinite == "error" or next(step.model.buffers(), None) is None))
        return cls(trainer) if plain else None

    def __call__(self, batch: Any, epoch: int, index: int) -> Any:
        if (type(batch) is not list and type(batch) is not tuple) or len(batch) != 2:
            return GENERAL
        inputs, target = batch
        state = self.state
        if (type(inputs) is not torch.Tensor or type(target) is not torch.Tensor or not inputs.ndim
                or not (inputs.is_cpu and target.is_cpu if self.cpu else  # the loop moves the others
                        inputs.device == target.device == self.device)
                or self.trainer.step_fn is not default_step
                or (self.tokens_possible and target.ndim > 1 and normalize.is_sequence_target(target))):
            return GENERAL
        step, opt = self.step, self.optimizer
        step.epoch, step.batch_index, step.batch, step.batch_size = epoch, index, batch, inputs.shape[0]
        output = self.model(inputs)
        if type(output) is torch.Tensor and self.tensor_loss is not None:
            prediction, loss = output, self.tensor_loss(output, target)
        else:
            prediction, loss = outputs.prediction_and_loss(output, target, self.loss_fn, self.key)
        value = loss.item() if loss.numel() == 1 else None  # read once: the finite check and the logged sum
        bad_loss = value is not None and not math.isfinite(value)
        loss.backward()
        # the metrics see the predictions before the update, as in default_step (a model's output may be a
        # view of its parameters)
        if self.metrics:
            if type(prediction) is torch.Tensor and prediction.dtype == torch.float32:
                # computed by this forward, not a view (of a parameter, of the input) nor written in place (a
                # buffer the model fills): nothing writes it later
                owned = (self.fresh_batches and prediction.grad_fn is not None and not prediction._is_view()
                         and prediction._version == 0)
                prediction = prediction.detach()
                for m in self.metrics:
                    m.feed(prediction, target, owned)
            else:
                step.update_metrics(prediction, target)  # conversions and errors in one place
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if self.log.should_log(state.global_step + 1):  # a log step: the gradient norm, which carries the check
            norm = step.grad_norm = _total_norm(grads, step.clip_norm_type)
            taken = not bad_loss and _finite(norm)
        else:
            taken = not bad_loss and step._check.finite(grads, id(opt))
        if taken:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:  # raises under on_nonfinite=error; the metrics (above) and the logs still count a skipped batch
            step._reject(opt, "loss is not finite" if bad_loss else "gradients are not finite (the loss is)")
        values = {"loss": loss.detach()}
        # the float read above is what the logger's host sum would read again; float inputs are no token ids,
        # so the logger need not look for tokens to count
        n = step.batch_size
        self.log.record({"loss": value} if self.log.host and loss.ndim == 0 else values, n,
                        1 if n == self.unit or self.unit is None else n / self.unit,
                        None if inputs.is_floating_point() else batch)
        step.stepped = taken
        step.end_window()  # the step counter, the skip count and the per-step schedulers, by the general rule
        return values

