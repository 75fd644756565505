"""Context parallelism (``parallel.cp``): each sequence split over the ``cp`` ranks, its attention run as a ring.

PyTorch does the work. ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...)``, entered with
a batch's sequence tensors, shards them in place along the sequence with its head-tail load balancer (the sequence
cut into ``2 × cp`` chunks, rank ``r`` holding chunks ``r`` and ``2·cp − 1 − r``, so that every rank has the same
share of causal attention), and runs each ``F.scaled_dot_product_attention`` inside it as ring attention over the
``cp`` ranks. ``context_parallel_unshard`` gathers a split output back in sequence order. What torchrig adds:

* the sequence tensors of a dict batch (``input_ids``, the labels, every tensor of the same batch × sequence shape)
  are copied before the split (the loaded batch is left whole: an out-of-memory retry runs it again), and
  ``position_ids`` are added when the batch has none, so that positions stay those of the whole sequence;
* a causal LM that shifts its labels inside its own loss (a Hugging Face ``...ForCausalLM``) gets them shifted
  before the split (``labels[:, 1:]`` then -100) and passed as ``shift_labels`` too, which its loss then reads as
  they are: a shift inside a rank's chunks would pair tokens that are not neighbours;
* one line for what the ring cannot run: attention that is not SDPA (``nn.MultiheadAttention``, a Hugging Face
  model loaded with another ``attn_implementation``), a forward without ``position_ids``, a sequence length that
  ``2 × cp`` does not divide, a padding mask.

The training step, evaluation and prediction call :meth:`ContextParallel.sharded` around each micro-batch: the
forward and the backward run inside PyTorch's context. Its attention entry (``attention``) is one function of
``(mesh, buffers, seq_dims)`` returning that context, so that a test can run everything around the kernel where
PyTorch's ring has no kernel (the CPU, see docs/scaling-out.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import runtime
from .errors import ParallelConfigError

KEY = "parallel.cp"
IGNORE_INDEX = -100  # the label value PyTorch's cross_entropy and Hugging Face losses skip


def torch_context_parallel(mesh: Any, buffers: list, seq_dims: list) -> Any:
    """PyTorch's ``context_parallel`` over ``mesh``: ``buffers`` split in place along ``seq_dims`` (load-balanced),
    SDPA as ring attention; the buffers are this step's copies, so nothing is restored at the end."""
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers))


def nearest_lengths(length: int, cp: int) -> tuple[int, int]:
    """The sequence lengths nearest ``length`` (below, above) that ``2 × cp`` divides."""
    unit = 2 * cp
    below = length - length % unit
    return (below if below > 0 else unit), below + unit


class ContextParallel:
    """The ``cp`` sub-mesh of a layout, and how one batch is split over it and gathered back.

    ``attention(mesh, buffers, seq_dims)``: the context that splits ``buffers`` in place and runs attention over the
    ranks (PyTorch's ``context_parallel`` by default)."""

    def __init__(self, mesh: Any, attention: Optional[Callable[[Any, list, list], Any]] = None):
        self.mesh = mesh
        self.size = mesh.size()
        self.group = mesh.get_group()
        self.attention = attention or torch_context_parallel

    def set_attention(self, attention: Callable[[Any, list, list], Any]) -> None:
        """Run the attention through ``attention(mesh, buffers, seq_dims)`` instead of PyTorch's context (a test's
        stand-in where PyTorch's ring has no kernel)."""
        self.attention = attention

    def check_model(self, model: nn.Module, loss_normalization: str, takes_positions: bool) -> None:
        """One line for a model (or setting) the ring cannot run exactly, before anything runs; ``takes_positions``:
        whether the model's forward takes ``position_ids``."""
        model = runtime.unwrap(model)
        for name, sub in model.named_modules():
            where = name or type(model).__name__
            if isinstance(sub, nn.MultiheadAttention):
                raise ParallelConfigError(
                    f"config key '{KEY}': {self.size}, but {where} is an nn.MultiheadAttention, whose attention "
                    f"PyTorch's context parallelism cannot split; use F.scaled_dot_product_attention in the model, "
                    f"or set {KEY}=1")
            impl = getattr(getattr(sub, "config", None), "_attn_implementation", None)
            if isinstance(impl, str) and impl != "sdpa":
                raise ParallelConfigError(
                    f"config key '{KEY}': {self.size}, but {where} runs attention_implementation={impl!r}; the ring "
                    f"splits F.scaled_dot_product_attention only: load the model with attn_implementation='sdpa', "
                    f"or set {KEY}=1")
        if not takes_positions:
            raise ParallelConfigError(
                f"config key '{KEY}': {self.size}, but {type(model).__name__}.forward takes no position_ids: each "
                f"rank holds positions from all over the sequence, so the model must read them from the batch; add "
                f"a position_ids argument to forward (positions of the whole sequence), or set {KEY}=1")
        if loss_normalization in ("samples", "micro_batches"):
            raise ParallelConfigError(
                f"config key 'loss_normalization': {loss_normalization} under {KEY}={self.size}, whose ranks each hold "
                f"part of every sample's tokens; use loss_normalization=tokens (or auto)")

    @contextlib.contextmanager
    def sharded(self, batch: Any, label: Optional[str] = None, shift: bool = False) -> Iterator[Any]:
        """``batch`` with its sequence tensors split over the ranks (this rank's share, a new dict), inside PyTorch's
        context: run the forward and the backward in it. ``label``: the target's key; ``shift``: pre-shift the
        labels (see the module's text)."""
        local, buffers = self.prepare(batch, label, shift)
        with self.attention(self.mesh, buffers, [1] * len(buffers)):
            yield local

    def prepare(self, batch: Any, label: Optional[str] = None, shift: bool = False) -> tuple[dict, list]:
        """``(new batch, its tensors to split)``: copies of the sequence tensors, positions added, labels shifted. A
        batch of ids alone (a tensor, or a list of one: prediction's inputs) is taken as ``{"input_ids": ids}``."""
        if isinstance(batch, (list, tuple)) and len(batch) == 1:
            batch = batch[0]
        if isinstance(batch, torch.Tensor):
            batch = {"input_ids": batch}
        ids = self._sequence(batch)
        rows, length = ids.shape[:2]
        local: dict = {}
        for key, value in batch.items():
            if key == "attention_mask":
                self._check_mask(value)
            elif isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (rows, length):
                local[key] = value.clone(memory_format=torch.contiguous_format)
            else:
                local[key] = value
        if "position_ids" not in local:
            local["position_ids"] = torch.arange(length, device=ids.device).expand(rows, length).clone()
        if shift and label in local:
            local[label] = local["shift_labels"] = F.pad(local[label][:, 1:], (0, 1), value=IGNORE_INDEX)
        buffers = list({id(v): v for v in local.values() if isinstance(v, torch.Tensor) and v.ndim >= 2
                        and tuple(v.shape[:2]) == (rows, length)}.values())
        return local, buffers

    def _sequence(self, batch: Any) -> torch.Tensor:
        """The batch's ``input_ids`` (batch × sequence), its length checked."""
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            raise ParallelConfigError(
                f"config key '{KEY}': {self.size} splits the sequences of dict batches with an 'input_ids' tensor "
                f"(batch × sequence), but the batch is {_describe(batch)}; give dict batches "
                f"{{'input_ids', 'labels'}}, or set {KEY}=1")
        length = ids.shape[1]
        if length % (2 * self.size):
            below, above = nearest_lengths(length, self.size)
            raise ParallelConfigError(
                f"config key '{KEY}': {self.size} cuts each sequence into 2 × {self.size} equal chunks (the "
                f"load-balanced ring), but the sequences are {length} tokens long; make them {below} or {above} "
                f"tokens long (a multiple of {2 * self.size}), or set {KEY}=1")
        return ids

    def _check_mask(self, mask: Any) -> None:
        """An attention mask that masks nothing is dropped (the ring's causal attention is the same); one that
        masks padding cannot be carried by the ring: refused (one host read per batch)."""
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise ParallelConfigError(
                f"config key '{KEY}': the batch's attention_mask masks padding, which the ring attention of "
                f"PyTorch's context parallelism cannot carry; give full rows without padding (pack or cut the "
                f"documents to the sequence length), or set {KEY}=1")

    def gather(self, output: Any, local: dict) -> Any:
        """``output`` (the outputs of ``local``, this rank's share of a batch: a tensor, or a tuple / dict of them)
        with every tensor whose dimension 1 is this rank's positions gathered back over the ranks, in sequence
        order (PyTorch's ``context_parallel_unshard``)."""
        return self._gather(output, local["input_ids"].shape[1])

    def _gather(self, output: Any, length: int) -> Any:
        from torch.distributed.tensor.experimental._context_parallel import context_parallel_unshard

        if isinstance(output, torch.Tensor):
            if output.ndim >= 2 and output.shape[1] == length:
                return context_parallel_unshard(self.mesh, [output], [1])[0]
            return output
        if isinstance(output, (tuple, list)):
            return type(output)(self._gather(v, length) for v in output)
        if isinstance(output, dict):
            return type(output)({k: self._gather(v, length) for k, v in output.items()})
        return output

    def sequence_mean(self, loss: torch.Tensor, target: Any) -> torch.Tensor:
        """The mean over the whole sequences' valid tokens of a loss that is the mean over this rank's share of
        ``target`` (an evaluation batch's): one all-reduce of two numbers over the ``cp`` ranks."""
        if not isinstance(target, torch.Tensor):
            return loss
        count = (target != IGNORE_INDEX).sum().to(torch.float64) if not target.is_floating_point() else \
            torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device)
        both = runtime.all_reduce_sum(torch.stack([loss.detach().to(torch.float64) * count, count]), self.group,
                                      name="context-parallel loss")
        return (both[0] / both[1].clamp_min(1)).to(loss.dtype)


def _describe(batch: Any) -> str:
    if isinstance(batch, dict):
        return "a dict with keys " + str(list(batch))
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)}"
    return type(batch).__name__
