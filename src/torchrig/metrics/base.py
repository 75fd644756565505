"""The metric object: states that are sums, so a reduction across ranks is exact.

A metric keeps tensors of counts or sums (``states``); ``sync`` all-reduces them once at the end of an
evaluation (over the data-parallel ranks of the fit's layout), so distributed evaluation gives the same numbers
as one process.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ..errors import TorchrigError
from ..runtime.dist import WORLD, Groups, all_reduce_sum

IGNORE_INDEX = -100  # a token / pixel target PyTorch's cross_entropy and Hugging Face models skip


class MetricError(TorchrigError, ValueError):
    """An unknown metric name or an output / target pair a metric cannot score."""


class Metric:
    """Base: subclasses create sum-reducible tensors in ``states`` and implement update / compute.

    A subclass whose states are integer counts (correct predictions, confusion cells) may set
    ``batchable = True``: one ``update`` on several batches concatenated then adds exactly what an update
    per batch adds. A subclass that overrides ``update`` is not batchable unless it says so.
    """

    name = "metric"
    higher_is_better = True
    # ``update`` is given float32 scores (a bf16 / fp16 prediction is cast first, a copy); a metric that reads its
    # prediction alike in any float dtype (an argmax, a top-k, a sum in float64) sets False and is spared the copy
    float32_scores = True
    device: Optional[torch.device] = None  # where new states live: the run's device (set by the trainer)
    batchable = False
    QUEUE_LIMIT = 64, 1 << 20  # batches and tensor elements ``feed`` holds before it updates
    FEED_LIMIT = 1 << 16  # a batch with more elements (token logits …) is updated at once, not copied

    def __init__(self) -> None:
        self.states = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``batchable`` vouches for the ``update`` of the class that set it (or one it inherits): an update
        # defined by a subclass of it, or by a mixin before it in the MRO, is not batchable unless it says so
        if "batchable" not in cls.__dict__:
            owner = next(k for k in cls.__mro__ if "update" in k.__dict__)
            declared = next(k for k in cls.__mro__ if "batchable" in k.__dict__)
            if not issubclass(declared, owner):
                cls.batchable = False

    # ``states`` maps names to float64 tensors. Two kinds of update wait instead of costing tensor ops on
    # every training step, and are applied whenever ``states`` is read, so every reader (compute, sync,
    # checkpoints) sees exact totals: Python numbers given to ``_add`` (sample counts) in ``_pending``, and
    # the CPU batches ``feed`` queues for a batchable metric in ``_queue``.
    @property
    def states(self) -> dict[str, torch.Tensor]:
        if self._queue:
            self._update_queued()
        if self._pending:
            # a new count lives beside the metric's other states (on the GPU for a GPU run), so that
            # one all-reduce backend (NCCL) can sum them all
            device = self.device or (next(iter(self._states.values())).device if self._states else None)
            for key, n in self._pending.items():
                if key in self._states:
                    self._states[key] += n
                else:  # a fill kernel: torch.tensor(n, device=cuda) would copy from pageable memory and wait
                    self._states[key] = torch.full((), float(n), dtype=torch.float64, device=device)
            self._pending = {}
        return self._states

    @states.setter
    def states(self, value: dict[str, torch.Tensor]) -> None:
        self._states, self._pending, self._queue, self._queued = value, {}, [], 0

    def reset(self) -> None:
        self.states = {}

    def snapshot(self) -> tuple:
        """The states as they stand, to :meth:`restore` later, without folding in what waits (no tensor op for
        the pending counts, no update of the queued batches): a copy per state tensor, nothing read back."""
        return ({k: v.clone() for k, v in self._states.items()}, dict(self._pending), list(self._queue),
                self._queued, getattr(self, "_queue_inference", False))

    def restore(self, snap: tuple) -> None:
        states, pending, queue, queued, inference = snap
        self._states = {k: v.clone() for k, v in states.items()}
        self._pending, self._queue, self._queued, self._queue_inference = dict(pending), list(queue), queued, inference

    def feed(self, output: Any, target: Any, owned: bool = False) -> None:
        """``update(output, target)``, now or together with the next batches.

        A batchable metric queues CPU tensors and updates once on the concatenated batches when ``states`` is
        read (at log steps, epoch ends, checkpoints) or the queue is full: one ``argmax`` / ``==`` / ``sum``
        per log interval instead of one per step, which is a tenth of a small model's step on one CPU core.
        The first batch after a reset is updated at once, so a bad output or target is reported there.
        The output is queued as a copy: the forward's own memory is left to autograd, which frees it during
        backward (a model may also reuse its output buffer). The target is copied too (a loader may reuse its
        buffers), unless ``owned``: the caller vouches that nothing writes it later (a batch collated for this
        step). Batches are queued under the autograd mode of the call (evaluation's states are inference
        tensors); batches over :data:`FEED_LIMIT` elements are updated at once. Accelerator tensors are never
        held: their ops are queued by the device anyway."""
        if (not self.batchable or type(output) is not torch.Tensor or type(target) is not torch.Tensor
                or not output.is_cpu or not target.is_cpu or not (self._queue or self._states)
                or (size := output.numel() + target.numel()) > self.FEED_LIMIT):
            self.update(output, target)
            return
        inference = torch.is_inference_mode_enabled()
        if self._queue and inference != self._queue_inference:
            self._update_queued()
        self._queue_inference = inference
        self._queue.append(((output.detach() if output.requires_grad else output).clone(),
                            target if owned else target.clone()))
        self._queued += size
        if len(self._queue) >= self.QUEUE_LIMIT[0] or self._queued >= self.QUEUE_LIMIT[1]:
            self._update_queued()

    def _update_queued(self) -> None:
        """One ``update`` on the queued batches concatenated, or one per batch when they do not concatenate
        (other trailing shapes, or a batch whose output and target differ in rows: its own update reports it)."""
        queue, self._queue, self._queued = self._queue, [], 0
        with torch.inference_mode(self._queue_inference):  # as fed: evaluation's states are inference tensors
            if all(o.ndim and t.ndim and o.shape[0] == t.shape[0] for o, t in queue):
                try:
                    output, target = torch.cat([o for o, _ in queue]), torch.cat([t for _, t in queue])
                except RuntimeError:  # trailing shapes differ
                    pass
                else:
                    self.update(output, target)
                    return
            for pair in queue:
                self.update(*pair)

    def _add(self, key: str, value: Union[torch.Tensor, int, float]) -> None:
        """Add to a float64 state (exact counts); a Python number (a count) needs no tensor op."""
        if not isinstance(value, torch.Tensor):
            self._pending[key] = self._pending.get(key, 0) + value
            return
        if value.requires_grad:
            value = value.detach()
        state = self._states.get(key)
        if state is None:
            self._states[key] = value.to(self.device or value.device, torch.float64, copy=True)
        else:  # in place, promoted to float64 by the add itself: one op per update on the training path
            state += value if value.device == state.device else value.to(state.device)

    def update(self, output: Any, target: Any) -> None:
        raise NotImplementedError

    def compute(self) -> Union[float, dict]:
        raise NotImplementedError

    def sync(self, groups: Groups = WORLD) -> None:
        """Sum every state over the data-parallel ranks of ``groups`` (no-op in one process), and take the sums of a
        pipeline's last stage, where the model's outputs are (``Groups.from_last_stage``). Every rank must call it."""
        for key in sorted(self.states):
            self.states[key] = all_reduce_sum(self.states[key], groups.data, name="metrics")
        if groups.pipelined:
            device = self.device
            self.states = {k: v.to(device or v.device) for k, v in groups.from_last_stage(dict(self.states)).items()}
