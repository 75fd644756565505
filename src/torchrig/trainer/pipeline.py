"""The step of a pipeline-parallel run (``parallel.pp``): the step function, evaluation and prediction.

A pipeline needs every micro-batch of an optimizer step at once (its schedule interleaves their forwards and
backwards over the stages), so :class:`PipelineStep` is a :class:`~.window.WholeWindowStep`: the accumulation
window (``accumulate`` loaded batches, each cut into ``data.micro_batch_size`` pieces) hands it each micro-batch
(:meth:`PipelineStep.add`: counted into the window with ``Step.count_micro_batch``, what ``default_step``'s
backward does, and kept), then has it run them (:meth:`PipelineStep.run`: the schedule, ``parallel.Pipeline.train``
— forward on every stage; on the last one the loss, weighted as ``default_step`` weighs it, and the metrics;
backward —, the gradients averaged over the data-parallel replicas, and ``step.optimizer_step()``, like
``default_step``). It returns the values of every micro-batch of the window (their losses, sent from the last
stage to every rank), which the window logs micro-batch by micro-batch, so the logs, the loss normalisation and
the optimizer step are those of one process that accumulates the same micro-batches.

Evaluation and prediction run each batch through the stages as one micro-batch without backward, stage by stage
(``parallel.Pipeline.forward``; ``default_eval_step`` / ``default_predict_step`` on the last stage); ranks that
hold no last stage return nothing, and metric states and predictions reach every rank from the last stage
(``runtime.Groups.from_last_stage``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import parallel
from .step import MISSING_TARGET, ModelCalls, Step, default_eval_step
from .window import WholeWindowStep


class PipelineStep(WholeWindowStep):
    """The step function of a pipeline-parallel run (see the module's text)."""

    def __init__(self, pipe: parallel.Pipeline, dp_group: Any = None):
        self.pipe = pipe
        self.dp_group = dp_group  # replicas of this rank's stages (parallel.dp_replicate), or None
        self.window: list = []
        self._fed: Any = None  # the micro-batch the metrics took last in this window, and their states before it
        self._before: list = []

    # -- training ----------------------------------------------------------------------------------
    def add(self, step: Step, batch: Any) -> None:
        """One micro-batch of the window: counted, and kept until :meth:`run`."""
        inputs, target = step.split(batch)
        if target is None:
            raise ValueError(MISSING_TARGET)
        count = step.count_micro_batch(target)
        self.window.append(parallel.MicroBatch(batch, len(self.window), (inputs, target, count, step.weight)))

    def run(self, step: Step) -> list:
        """The window's micro-batches through the schedule, then the optimizer step; every micro-batch's values."""
        window, self.window = self.window, []
        losses = torch.zeros(len(window), device=step.device)
        self._fed, self._before = None, []
        with parallel.loss.context(step.loss_parallel):  # split logits: the last stage's loss and its backward
            self.pipe.train(window, self._training_forward(step, losses))
        self._before = []
        losses = step.groups.from_last_stage(losses)
        if self.dp_group is not None:
            parallel.average_gradients([p for opt in step.optimizers.values() for g in opt.param_groups
                                        for p in g["params"]], self.dp_group)
        step.optimizer_step()
        return [{"loss": loss} for loss in losses]

    def _training_forward(self, step: Step, losses: torch.Tensor) -> Callable:
        scaler = step.precision.scaler

        def forward(model: Any, mb: parallel.MicroBatch) -> torch.Tensor:
            inputs, target, count, weight = mb.data
            with step.autocast():
                output = step.forward(inputs, model=model, target=target)
                prediction, loss = step.loss(output, target)  # the last stage only gets here
            losses[mb.index] = loss.detach()
            if step.metrics and weight:
                self._feed(step, mb.index, prediction, target, weight)
            del output, prediction  # autograd frees the output during the schedule's backward
            weighted = step.weigh(loss, count, weight)
            return scaler.scale(weighted) if scaler is not None else weighted

        return forward

    def _feed(self, step: Step, index: int, prediction: Any, target: Any, weight: int) -> None:
        """The metrics take a micro-batch's prediction at once and keep none of it (nothing of the forward outlives
        its backward). A schedule's first step may run its first micro-batch once more first, to learn the stages'
        shapes (``Pipeline.rehearsal``): the states before it are kept, and put back when the micro-batch comes
        again, so that call counts for nothing."""
        if index == self._fed:
            for metric, states in zip(step.metrics, self._before):
                metric.restore(states)
        elif index == self.pipe.rehearsal:
            self._before = [metric.snapshot() for metric in step.metrics]
        self._fed = index
        step.update_metrics(prediction, target, weight)

    # -- evaluation and prediction ----------------------------------------------------------------------
    def evaluate(self, step: ModelCalls, batch: Any) -> tuple:
        """``default_eval_step`` of one batch through the stages: ``(prediction, target, loss)`` on the last stage,
        ``(None, None, None)`` elsewhere."""
        return self._forward_only(batch, lambda: default_eval_step(step, batch), (None, None, None), step.device)

    def predict(self, step: ModelCalls, batch: Any) -> Any:
        """``default_predict_step`` of one batch through the stages: the prediction on the last stage, else None."""
        from .inference import default_predict_step

        return self._forward_only(batch, lambda: default_predict_step(step, batch, step.activation), None,
                                  step.device)

    def _forward_only(self, batch: Any, last_stage: Callable[[], Any], elsewhere: Any, device: torch.device) -> Any:
        result = [elsewhere]

        def forward(model: Any, mb: parallel.MicroBatch) -> torch.Tensor:
            result[0] = last_stage()  # other stages stop at their last block, inside it
            return torch.zeros((), device=device)

        self.pipe.forward(parallel.MicroBatch(batch, 0), forward)
        return result[0] if self.pipe.holds_last else elsewhere
