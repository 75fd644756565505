"""One inference loop for ``evaluate`` and ``predict``: every sample once, in data order, on every rank.

Each rank runs its shard of the data under ``inference_mode`` and the model's eval mode. Under FSDP
the ranks also make the same number of forward passes (extra passes on a dummy batch, discarded),
because each forward all-gathers parameters. ``evaluate`` then sums metric states over ranks;
``predict`` gathers the outputs and puts them back in data order.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from .. import runtime
from ..data import padding_batches, prepare_eval, to_device
from ..data.iterable_eval import IterableEvalBatches
from ..metrics import MeanValue, Metric
from . import outputs as O
from .step import Step, batch_size_of, default_eval_step
from .ema import ema_weights

if TYPE_CHECKING:
    from .trainer import Trainer

ACTIVATIONS: dict[str, Callable] = {"softmax": lambda t: t.softmax(dim=-1), "sigmoid": torch.sigmoid,
                                    "exp": torch.exp, "none": lambda t: t}


@contextlib.contextmanager
def _eval_mode(trainer: "Trainer"):
    modules = [trainer.wrapped, *trainer.models.values()]
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        for m, w in zip(modules, was):
            m.train(w)


def run(trainer: "Trainer", data: Any, metrics: list, forward: Callable[[Step, Any], Any],
        consume: Callable[[Step, Any, Any], None]) -> Any:
    """``consume(step, batch, forward(step, batch))`` for each batch of this rank's shard; returns the
    batches iterated (for a stream: with the stream positions of this rank's samples)."""
    batches = trainer._eval_batches(data)
    step = trainer._make_step(metrics)
    # DDP adds nothing to a forward without backward, and ranks may see different batch counts.
    step.model = trainer.wrapped if trainer.strategy == "fsdp" else runtime.unwrap(trainer.wrapped)
    lockstep = trainer.strategy == "fsdp" and trainer.world_size > 1
    streamed = isinstance(batches, IterableEvalBatches)
    if streamed:
        batches.lockstep = lockstep  # a stream's length is known only at its end: agree batch by batch
    pad = padding_batches(len(batches), trainer.device) if lockstep and not streamed else 0
    batch = None
    with _eval_mode(trainer):
        for got in batches:
            if got is None:  # FSDP: another rank's stream still has a batch; forward a discarded one
                batch = batch if batch is not None else _first_batch(trainer, data)
                step.metrics = []
                forward(step, batch)
                continue
            batch = to_device(got, trainer.device)
            consume(step, batch, forward(step, batch))
            trainer._signals.beat = time.perf_counter()  # progress, for a stop signal's watchdog
        if pad:
            dummy = batch if batch is not None else _first_batch(trainer, data)
            step.metrics = []
            for _ in range(pad):  # results discarded: every sample still counts once
                forward(step, dummy)
    return batches


def _first_batch(trainer: "Trainer", data: Any) -> Any:
    """A batch for padding forwards on a rank that has no sample: the data's first."""
    one = prepare_eval(data, **dict(trainer._loader_kwargs(eval_=True), rank=0, world_size=1, batch_size=1))
    return to_device(next(iter(one)), trainer.device)


def evaluate(trainer: "Trainer", data: Any, ema: bool = True) -> dict:
    """Loss (per-sample mean) and metrics over every sample once, reduced across ranks; with the EMA
    weights when the trainer keeps an EMA (``ema_decay``) and ``ema`` is true."""
    metrics = trainer._metric_objects()
    means: dict[str, MeanValue] = {}
    fn = trainer.eval_fn or default_eval_step

    def consume(step: Step, batch: Any, out: Any) -> None:
        n = batch_size_of(batch)
        if isinstance(out, dict):  # a custom eval step: batch means to average per sample
            for k, v in out.items():
                mean = means.setdefault(k, MeanValue(k))
                mean.device = trainer.device  # a Python float too: on the device, where NCCL sums it
                mean.update(torch.as_tensor(v, dtype=torch.float64, device=trainer.device), n)
            return
        output, target, loss = out
        if loss is not None:
            mean = means.setdefault("loss", MeanValue("loss"))
            mean.device = trainer.device
            mean.update(loss.float(), n)
        step.update_metrics(output, target)

    with ema_weights(trainer, ema):
        run(trainer, data, metrics, fn, consume)
    return _sync_results(trainer, means, metrics)


def _sync_results(trainer: "Trainer", means: dict, metrics: list) -> dict:
    """Sum every metric state over ranks; ranks that saw no sample of a state contribute zeros."""
    if trainer.world_size > 1:
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
                m.states.setdefault(k, torch.zeros(shape, dtype=torch.float64, device=trainer.device))
    results = {}
    for m in [means[k] for k in sorted(means)] + metrics:
        m.sync()
        if m.states:
            results[m.name] = m.compute()
    return dict(sorted(results.items(), key=lambda kv: kv[0] != "loss"))  # loss first


def predict(trainer: "Trainer", data: Any, activation: str = "auto") -> Any:
    """Model outputs for every sample, in data order, on every rank (CPU tensors).

    One item per sample: a tensor stacked over samples, or for tuple / dict / ``ModelOutput``
    outputs the same structure (a tuple, a dict) with each per-sample field stacked; the activation
    (probabilities) applies to the prediction field only. Batches are inputs only: see
    ``outputs.predict_inputs`` for which tuple elements and dict keys reach ``forward``.
    """
    act = activation_for(trainer, activation)
    results: list = []

    def forward(step: Step, batch: Any) -> Any:
        if trainer.predict_fn is not None:
            step.activation = act  # what predict(activation=...) asked for, for a predict_fn to apply
            return trainer.predict_fn(step, batch)
        return default_predict_step(step, batch, act)

    def consume(step: Step, batch: Any, out: Any) -> None:
        results.append(out.cpu() if isinstance(out, torch.Tensor) else out)

    batches = run(trainer, data, [], forward, consume)
    local = O.stack(results)
    if isinstance(batches, IterableEvalBatches):  # a stream: outputs back at their samples' positions
        parts = runtime.gather((batches.stream_positions(), local))
        return O.merge_ranks([p for _, p in parts], trainer.world_size, [q for q, _ in parts])
    if trainer.world_size == 1:
        return local
    return O.merge_ranks(runtime.gather(local), trainer.world_size)


def default_predict_step(step: Step, batch: Any, activation: Callable) -> Any:
    """The model's prediction for one batch of inputs, ``activation`` applied to the prediction field
    (called under ``inference_mode``); a ``predict_fn`` that changes the batch can end with this, passing
    ``step.activation`` (the one ``predict(activation=...)`` chose)."""
    inputs = O.predict_inputs(step.model, batch, step.io.label_key)
    with step.autocast():
        out = O.call_model(step.model, inputs, step.io.input_keys)
    return O.predict_fields(out, step.io.output_key, activation, batch_size_of(batch))


# Probabilities for the known classification losses, given by name or as a loss object; "auto" is
# cross-entropy when the model returns no loss of its own.
_LOSS_ACTIVATIONS = {"cross_entropy": "softmax", "auto": "softmax", "nll": "exp", "bce_with_logits": "sigmoid",
                     "CrossEntropyLoss": "softmax", "NLLLoss": "exp", "BCEWithLogitsLoss": "sigmoid"}


def activation_for(trainer: "Trainer", name: str) -> Callable:
    """``auto``: probabilities for the known classification losses (by name, or an ``nn.CrossEntropyLoss``,
    ``nn.NLLLoss`` or ``nn.BCEWithLogitsLoss`` object), raw outputs otherwise."""
    if name == "auto":
        return activation_for_loss(trainer._objects.get("loss", trainer.cfg.loss))
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of auto, {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def activation_for_loss(loss: Any) -> Callable:
    """What ``activation="auto"`` applies for ``loss`` (a name or a loss object)."""
    if isinstance(loss, torch.nn.Module):
        key = type(loss).__name__ if type(loss) in (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss,
                                                    torch.nn.BCEWithLogitsLoss) else ""
    else:
        key = loss if isinstance(loss, str) else ""
    return ACTIVATIONS[_LOSS_ACTIVATIONS.get(key, "none")]
