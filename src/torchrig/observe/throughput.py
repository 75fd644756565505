"""Throughput of the training loop: samples/s, tokens/s, FLOP/s and model FLOPs utilisation (MFU).

Samples and tokens are counted by the metrics logger per micro-batch without reading anything on the
host (a token count stays a tensor until the log step). With ``log.flops=true`` the FLOPs of one
training step (forward and backward of the first batch of the fit) are counted once with
``torch.utils.flop_counter.FlopCounterMode`` (:class:`FlopCount`); every interval row then carries ``flops_per_s``
(achieved, all processes together) and, on a GPU of :data:`PEAK_TFLOPS`, ``mfu`` = achieved FLOP/s
over the peak of all processes' GPUs. Only the operators PyTorch has FLOP formulas for count
(matrix products, convolutions, attention): element-wise work is left out, as MFU conventionally does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..runtime.accel import tf32_in_force

# Dense peak throughput in TFLOP/s of common GPUs, from the vendors' data sheets (sparse figures halved):
# (bf16 / fp16 tensor cores, fp32 without TF32, TF32 tensor cores or None where the GPU has none). Matched
# against torch.cuda.get_device_name, first match wins, so a longer name comes before its prefix.
PEAK_TFLOPS: dict[str, tuple[float, float, Optional[float]]] = {
    "B200": (2250.0, 80.0, 1100.0), "GH200": (989.4, 66.9, 494.7), "H200": (989.4, 66.9, 494.7),
    "H100 NVL": (835.5, 60.0, 417.5), "H100 PCIe": (756.0, 51.2, 378.0), "H100": (989.4, 66.9, 494.7),
    "H800 PCIe": (756.0, 51.2, 378.0), "H800": (989.4, 66.9, 494.7),
    "A100": (312.0, 19.5, 156.0), "A800": (312.0, 19.5, 156.0), "L40S": (362.1, 91.6, 183.0),
    "L40": (181.0, 90.5, 90.5), "L4": (121.0, 30.3, 60.0), "A10G": (70.0, 31.2, 35.0), "A10": (125.0, 31.2, 62.5),
    "RTX 6000 Ada": (364.2, 91.1, 182.1), "RTX 4090": (165.2, 82.6, 82.6), "RTX 3090": (71.0, 35.6, 35.6),
    "V100": (125.0, 15.7, None), "T4": (65.0, 8.1, None),
}


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one ``device`` at ``precision`` (fp32, bf16, fp16); None on CPU or an unknown GPU. fp32
    counts TF32 tensor cores when they are in force (the matrix products are then TF32's)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single, tf32) in PEAK_TFLOPS.items():
        if key in name:
            if precision != "fp32":
                return half * 1e12
            return (tf32 if tf32 is not None and tf32_in_force() else single) * 1e12
    return None


def tokens_of(batch: Any) -> Any:
    """Tokens in a batch of token ids (an int or a 0-dim tensor), None for other data.

    A dict with ``input_ids`` (and ``attention_mask``), or a tuple whose first item is a 2-D integer
    tensor of ids and whose second, of the same shape, is taken as the attention mask. Padding is
    not counted where a mask says which positions are real.
    """
    if isinstance(batch, dict):
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
    elif isinstance(batch, (list, tuple)) and batch:
        ids = batch[0]
        mask = batch[1] if len(batch) > 2 else None  # (ids, mask, …, target); (ids, target) has no mask
    else:
        return None
    if not (isinstance(ids, torch.Tensor) and ids.ndim == 2 and not ids.is_floating_point()):
        return None
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape and not mask.is_floating_point():
        return mask.sum()
    return ids.numel()


def rates(samples: int, tokens: Any, elapsed: float, world_size: int, flops_per_sample: Optional[float],
          peak: Optional[float], cp: int = 1) -> dict:
    """The throughput values of an interval row (counts are this process's; ranks run alike). ``world_size``: the
    ranks of different samples; ``cp``: the context-parallel ranks each sample's sequence is split over, each
    counting the sample once but only its share of the tokens and of the FLOPs."""
    out = {"samples_per_s": samples * world_size / elapsed}
    if tokens is not None:
        out["tokens_per_s"] = float(tokens) * world_size * cp / elapsed
    if flops_per_sample:
        out["flops_per_s"] = flops_per_sample * cp * out["samples_per_s"]
        if peak:
            out["mfu"] = out["flops_per_s"] / (peak * world_size * cp)
    return out


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under ``FlopCounterMode``; returns (its result, the FLOPs it ran)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn()
    return result, counter.get_total_flops()


def meta_flops(module: torch.nn.Module, inputs: Any, input_keys: Optional[tuple] = None) -> int:
    """FLOPs of one forward and backward of ``module`` on ``inputs``, counted on the meta device: the module is
    called with meta stand-ins of its weights (``torch.func.functional_call``), so nothing is computed, nothing
    is allocated, and every operator runs in this thread. For ``nn.DataParallel``, whose replicas run in threads
    that ``FlopCounterMode`` (a per-thread mode) does not see."""
    from torch.func import functional_call
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.flop_counter import FlopCounterMode

    from ..data.batches import forward_arguments

    state = {n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad) for n, p in module.named_parameters()}
    state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers()})
    if isinstance(inputs, dict):
        args, kwargs = forward_arguments(module, inputs, input_keys)
    else:
        args, kwargs = (tuple(inputs) if isinstance(inputs, tuple) else (inputs,)), {}
    args, kwargs = tree_map(lambda t: t.detach().to("meta") if isinstance(t, torch.Tensor) else t, (args, kwargs))
    with FlopCounterMode(display=False) as counter:
        out = functional_call(module, state, tuple(args), kwargs)
        grads = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if grads:
            torch.stack([t.float().sum() for t in grads]).sum().backward()
    return counter.get_total_flops()


class FlopCount:
    """``log.flops``: the FLOPs of the fit's first training batch, counted while it trains (no extra forward or
    backward: the numbers of that step are those of any other). The loop hands that batch's run to
    :meth:`measure`; every interval row then carries ``flops_per_s`` and, on a GPU of :data:`PEAK_TFLOPS`, ``mfu``.
    """

    def __init__(self, log: Any, device: torch.device, precision: str, say: Callable[[str], None]) -> None:
        self.log, self.device, self.precision, self.say = log, device, precision, say
        self.flops_per_sample: Optional[float] = None

    def measure(self, run: Callable[[], Any], batch: Any, model: Any, step: Any) -> Any:
        """``run()`` (the first batch's training) under ``FlopCounterMode``, or beside a count on the meta device
        for ``nn.DataParallel`` (whose replicas run in threads the counter does not see); returns its result."""
        from ..data.batches import batch_size_of

        if isinstance(model, torch.nn.DataParallel):
            values = run()
            flops = meta_flops(model.module, step.split(batch)[0], step.io.input_keys)
        else:
            values, flops = count_flops(run)
        if not flops:  # e.g. a compiled model, whose operators the counter does not see
            self.say("torchrig: log.flops: no FLOPs counted in the first step (a compiled model hides its operators "
                     "from FlopCounterMode); rows carry no flops_per_s. Set model.compile=false to count them")
            return values
        self.flops_per_sample = flops / max(1, batch_size_of(batch))
        self.log.flops_per_sample = self.flops_per_sample
        self.log.peak_flops = peak_flops(self.device, self.precision)
        self.say(f"torchrig: {self.flops_per_sample:.4g} FLOPs per sample (forward + backward)"
                 + ("" if self.log.peak_flops else f"; no peak FLOP/s known for {self.device}: rows get flops_per_s, "
                                                     f"no mfu"))
        return values


def fit_callbacks(cfg: Any) -> list:
    """torchrig's own callbacks that the config turns on: the profiler."""
    out: list = []
    if cfg.profile.steps:
        from .profiling import Profiler

        out.append(Profiler(cfg.profile.steps, cfg.profile.memory_snapshot))
    return out
