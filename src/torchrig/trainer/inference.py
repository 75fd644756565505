"""One inference loop for ``evaluate`` and ``predict``: every sample once, in data order, on every rank.

Each rank runs its shard of the data under ``inference_mode`` and the model's eval mode. Under FSDP
the ranks also make the same number of forward passes (extra passes on a dummy batch, discarded),
because each forward all-gathers parameters. ``evaluate`` then sums metric states over ranks;
``predict`` gathers the outputs and puts them back in data order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch

from .. import parallel, runtime
from ..data import padding_batches, to_device
from ..data.batches import batch_size_of, predict_inputs
from ..data.iterable_eval import IterableEvalBatches
from ..metrics import MeanValue, Metric
from . import outputs as O
from .step import ModelCalls, default_eval_step

ACTIVATIONS: dict[str, O.Activation] = {name: O.Activation(name, fn) for name, fn in (
    ("softmax", None), ("sigmoid", torch.sigmoid), ("exp", torch.exp), ("none", lambda t: t))}


@dataclasses.dataclass
class EvalRun:
    """What one pass of evaluation or prediction needs (built by the Trainer for each call)."""

    batches: Any                        # this rank's evaluation batches (``data.prepare_eval``)
    step: ModelCalls                    # what ``eval_fn`` / ``predict_fn`` see: the bare model (FSDP's under FSDP)
    modules: list                       # put in eval mode for the pass
    device: torch.device
    world_size: int                     # data-parallel ranks: those holding different samples
    lockstep: bool                      # FSDP on several ranks: every rank makes as many forwards
    first_batch: Callable[[], Any]      # a batch for the padding forwards of a rank without a sample
    beat: Callable[[], None]            # progress, for a stop signal's watchdog
    groups: runtime.Groups = runtime.WORLD  # the layout's groups: data-parallel ranks, pipeline and last stage


@contextlib.contextmanager
def _eval_mode(modules: list, grad_off: Callable = torch.inference_mode):
    was = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        with grad_off():
            yield
    finally:
        for m, w in zip(modules, was):
            m.train(w)


def probe(step: ModelCalls, first_batch: Callable[[], Any], modules: list) -> None:
    """The model's forward on ``first_batch()`` (the validation data's first samples) before training, so that inputs
    the model cannot take fail now rather than after the first epoch (the loss is left to the training step, which
    says what does not fit on a training batch). Eval mode under ``no_grad`` (not ``inference_mode``: a cache the
    forward fills must stay usable in training), and every random generator left as it was, those the loader draws
    from included: an exact resume draws what an unbroken run draws."""
    from ..errors import TorchrigError

    state = runtime.rng_state()
    try:
        batch = first_batch()
        with _eval_mode(modules, torch.no_grad):
            _one(step, batch, _probe_forward)
    except TorchrigError as exc:
        raise type(exc)(f"checking the validation data before training: {exc}") from None
    finally:
        runtime.set_rng_state(state)


def run(r: EvalRun, forward: Callable[[ModelCalls, Any], Any],
        consume: Callable[[ModelCalls, Any, Any], None]) -> Any:
    """``consume(step, batch, forward(step, batch))`` for each batch of this rank's shard; returns the
    batches iterated (for a stream: with the stream positions of this rank's samples)."""
    batches, step = r.batches, r.step
    streamed = isinstance(batches, IterableEvalBatches)
    if streamed:
        batches.lockstep = r.lockstep  # a stream's length is known only at its end: agree batch by batch
    pad = padding_batches(len(batches), r.device) if r.lockstep and not streamed else 0
    batch = None
    with _eval_mode(r.modules):
        for got in batches:
            if got is None:  # FSDP: another rank's stream still has a batch; forward a discarded one
                batch = batch if batch is not None else r.first_batch()
                step.stop_counting()
                _one(step, batch, forward)
                continue
            batch = to_device(got, r.device)
            _one(step, batch, forward, consume)
            r.beat()
        if pad:
            dummy = batch if batch is not None else r.first_batch()
            step.stop_counting()
            for _ in range(pad):  # results discarded: every sample still counts once
                _one(step, dummy, forward)
    return batches


def _one(step: ModelCalls, batch: Any, forward: Callable[[ModelCalls, Any], Any],
         consume: Optional[Callable[[ModelCalls, Any, Any], None]] = None) -> None:
    """``consume(step, batch, forward(step, batch))``; under ``parallel.cp`` on this rank's share of the batch's
    sequences, inside PyTorch's context parallelism."""
    if step.cp is None:
        out = forward(step, batch)
        if consume is not None:
            consume(step, batch, out)
        return
    with step.sharded(batch) as local:
        out = forward(step, local)
        if consume is not None:
            consume(step, local, out)


def _probe_forward(step: ModelCalls, batch: Any) -> Any:
    inputs, target = step.split(batch)
    with step.autocast():
        return step.forward(inputs, target=target)


def evaluate(r: EvalRun, eval_fn: Optional[Callable] = None) -> dict:
    """Loss (per-sample mean) and metrics (``r.step.metrics``) over every sample once, reduced across ranks."""
    metrics = list(r.step.metrics)
    means: dict[str, MeanValue] = {}
    fn = eval_fn or default_eval_step

    def consume(step: ModelCalls, batch: Any, out: Any) -> None:
        n = batch_size_of(batch)
        if isinstance(out, dict):  # a custom eval step: batch means to average per sample
            for k, v in out.items():
                mean = means.setdefault(k, MeanValue(k))
                mean.device = r.device  # a Python float too: on the device, where NCCL sums it
                mean.update(torch.as_tensor(v, dtype=torch.float64, device=r.device), n)
            return
        output, target, loss = out
        if loss is not None:
            if step.cp is not None:  # the mean over the whole sequences' tokens, the same on their cp ranks
                loss = step.cp.sequence_mean(loss, target)
            mean = means.setdefault("loss", MeanValue("loss"))
            mean.device = r.device
            mean.update(loss.float(), n)
        step.update_metrics(output, target)

    run(r, fn, consume)
    return _sync_results(r, means, metrics)


def _sync_results(r: EvalRun, means: dict, metrics: list) -> dict:
    """Sum every metric state over ranks; ranks that saw no sample of a state (or no output: a pipeline's first
    stages) contribute zeros."""
    if r.world_size * r.groups.cp_size() > 1 or r.groups.pipelined:
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
                m.states.setdefault(k, torch.zeros(shape, dtype=torch.float64, device=r.device))
    results = {}
    for m in [means[k] for k in sorted(means)] + metrics:
        m.sync(r.groups)
        if m.states:
            results[m.name] = m.compute()
    return dict(sorted(results.items(), key=lambda kv: kv[0] != "loss"))  # loss first


def predict(r: EvalRun, act: Callable, predict_fn: Optional[Callable] = None, outputs: str = "prediction") -> Any:
    """Model outputs for every sample, in data order, on every rank (CPU tensors).

    ``outputs="prediction"``: the prediction field of any output (a tensor's, a tuple's element
    ``output_key``, a dict's or ``ModelOutput``'s ``logits``), the activation (probabilities) applied, stacked
    over samples. ``outputs="all"``: for tuple / dict / ``ModelOutput`` outputs the same structure (a tuple, a
    dict) with each per-sample field stacked, the activation applied to the prediction field only. Batches
    are inputs only: see ``data.batches.predict_inputs`` for which tuple elements and dict keys reach
    ``forward``.
    """
    results: list = []

    def forward(step: ModelCalls, batch: Any) -> Any:
        if predict_fn is not None:  # step.activation: what predict(activation=...) asked for, for it to apply
            return predict_fn(step, batch)
        return default_predict_step(step, batch, act)

    def consume(step: ModelCalls, batch: Any, out: Any) -> None:
        if step.cp is not None:  # parallel.cp: the whole sequences, in order
            out = step.cp.gather(out, batch)
        results.append(out.cpu() if isinstance(out, torch.Tensor) else out)

    batches = run(r, forward, consume)
    # a pipeline's last stage holds the predictions (its other stages ran their part of each forward)
    local = r.groups.from_last_stage([O.stack(results)] if r.groups.is_last_stage() else None)[0]
    every = r.groups.cp_size()  # the context-parallel ranks of a shard hold the same (gathered) outputs: one counts
    if isinstance(batches, IterableEvalBatches):  # a stream: outputs back at their samples' positions
        parts = runtime.gather((batches.stream_positions(), local), r.groups.data)[::every]
        return O.merge_ranks([p for _, p in parts], r.world_size, [q for q, _ in parts])
    if r.world_size == 1:
        return local
    return O.merge_ranks(runtime.gather(local, r.groups.data)[::every], r.world_size)


def default_predict_step(step: ModelCalls, batch: Any, activation: Callable, outputs: Optional[str] = None) -> Any:
    """The model's prediction for one batch of inputs, ``activation`` applied to the prediction field
    (called under ``inference_mode``); a ``predict_fn`` that changes the batch can end with this, passing
    ``step.activation`` (the one ``predict(activation=...)`` chose). ``outputs``: ``"prediction"`` (that
    field alone) or ``"all"`` (the output's structure); None: what ``predict(outputs=...)`` asked for."""
    inputs = predict_inputs(step.model, batch, step.io.label_key)
    with step.autocast():
        out = parallel.loss.whole(O.call_model(step.model, inputs, step.io.input_keys))  # split logits: whole
    # softmax over the classes: dimension 1, or the last of a token model's (batch, positions, classes)
    dim = step.predict_class_dim(out, inputs) if getattr(activation, "over_classes", False) else None
    if (outputs or getattr(step, "predict_outputs", "prediction")) == "prediction":
        return O.predict_prediction(out, step.io.output_key, activation, dim)
    return O.predict_fields(out, step.io.output_key, activation, batch_size_of(batch), dim)


# Probabilities for the known classification losses, given by name or as a loss object; "auto" is
# cross-entropy when the model returns no loss of its own.
_LOSS_ACTIVATIONS = {"cross_entropy": "softmax", "auto": "softmax", "nll": "exp", "bce_with_logits": "sigmoid",
                     "CrossEntropyLoss": "softmax", "NLLLoss": "exp", "BCEWithLogitsLoss": "sigmoid"}


def activation_for(name: str, loss: Any) -> O.Activation:
    """``auto``: probabilities for the known classification losses (by name, or an ``nn.CrossEntropyLoss``,
    ``nn.NLLLoss`` or ``nn.BCEWithLogitsLoss`` object) of ``loss`` (the run's), raw outputs otherwise."""
    if name == "auto":
        return activation_for_loss(loss)
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of auto, {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def activation_for_loss(loss: Any) -> O.Activation:
    """What ``activation="auto"`` applies for ``loss`` (a name or a loss object)."""
    if isinstance(loss, torch.nn.Module):
        key = type(loss).__name__ if type(loss) in (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss,
                                                    torch.nn.BCEWithLogitsLoss) else ""
    else:
        key = loss if isinstance(loss, str) else ""
    return ACTIVATIONS[_LOSS_ACTIVATIONS.get(key, "none")]


_APPLIED = {"softmax": "softmax over the classes", "sigmoid": "sigmoid of each output",
            "exp": "exp of each output (probabilities from log-probabilities)"}


def activation_line(activation: O.Activation, loss: str) -> str:
    """The one line saying what ``activation="auto"`` chose for the run's ``loss`` (as the user named it), and how
    to choose otherwise (``--activation`` on the command line, ``activation=`` in Python)."""
    from ..errors import argument

    if activation.name == "none":
        return (f"predict: raw outputs (loss={loss} is no classification loss torchrig knows); "
                f"{argument('activation', 'softmax')} for probabilities over the classes")
    return f"predict: {_APPLIED[activation.name]} (from loss={loss}); {argument('activation', 'none')} for raw outputs"
