"""Throughput of the training loop: samples/s, tokens/s, FLOP/s and model FLOPs utilisation (MFU).

Samples and tokens are counted by the metrics logger per micro-batch without reading anything on the
host (a token count stays a tensor until the log step). With ``log.flops=true`` the FLOPs of one
training step (forward and backward of the first micro-batch of the fit) are counted once with
``torch.utils.flop_counter.FlopCounterMode``; every interval row then carries ``flops_per_s``
(achieved, all processes together) and, on a GPU of :data:`PEAK_TFLOPS`, ``mfu`` = achieved FLOP/s
over the peak of all processes' GPUs. Only the operators PyTorch has FLOP formulas for count
(matrix products, convolutions, attention): element-wise work is left out, as MFU conventionally does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

# Dense peak throughput in TFLOP/s of common GPUs: (bf16 / fp16 tensor cores, fp32 without TF32),
# from the vendors' data sheets; matched against torch.cuda.get_device_name, first match wins.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 80.0), "H200": (989.4, 66.9), "H100 PCIe": (756.0, 51.2), "H100": (989.4, 66.9),
    "GH200": (989.4, 66.9), "A100": (312.0, 19.5), "A800": (312.0, 19.5), "L40S": (362.1, 91.6),
    "L40": (181.0, 90.5), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "A10": (125.0, 31.2),
    "RTX 6000 Ada": (364.2, 91.1), "RTX 4090": (165.2, 82.6), "RTX 3090": (71.0, 35.6),
    "V100": (125.0, 15.7), "T4": (65.0, 8.1),
}


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """Peak FLOP/s of one ``device`` at ``precision`` (fp32, bf16, fp16); None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in name:
            return (single if precision == "fp32" else half) * 1e12
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
          peak: Optional[float]) -> dict:
    """The throughput values of an interval row (counts are this process's; ranks run alike)."""
    out = {"samples_per_s": samples * world_size / elapsed}
    if tokens is not None:
        out["tokens_per_s"] = float(tokens) * world_size / elapsed
    if flops_per_sample:
        out["flops_per_s"] = flops_per_sample * out["samples_per_s"]
        if peak:
            out["mfu"] = out["flops_per_s"] / (peak * world_size)
    return out


def count_flops(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under ``FlopCounterMode``; returns (its result, the FLOPs it ran)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn()
    return result, counter.get_total_flops()


class FlopCounter:
    """Counts the FLOPs of the fit's first training micro-batch, then gets out of the way.

    It wraps ``trainer.step_fn`` for exactly one call: the numbers of that step are those of any other
    (counting does not change what runs), and no extra forward or backward is spent.
    """

    def __init__(self) -> None:
        self.flops_per_sample: Optional[float] = None

    def on_fit_start(self, trainer: Any) -> None:
        from .step import batch_size_of

        original = trainer.step_fn

        def counted(step: Any, batch: Any) -> Any:
            trainer.step_fn = original
            values, flops = count_flops(lambda: original(step, batch))
            if not flops:  # e.g. a compiled model, whose operators the counter does not see
                trainer.print("torchrig: log.flops: no FLOPs counted in the first step (a compiled model hides its "
                              "operators from FlopCounterMode); rows carry no flops_per_s. Set model.compile=false "
                              "to count them")
                return values
            self.flops_per_sample = flops / max(1, batch_size_of(batch))
            log = trainer.metrics_log
            log.flops_per_sample = self.flops_per_sample
            log.peak_flops = peak_flops(trainer.device, trainer.precision.name)
            trainer.print(f"torchrig: {self.flops_per_sample:.4g} FLOPs per sample (forward + backward)"
                          + ("" if log.peak_flops else f"; no peak FLOP/s known for {trainer.device}: "
                                                        f"rows get flops_per_s, no mfu"))
            return values

        self._restore = lambda: setattr(trainer, "step_fn", original)
        trainer.step_fn = counted

    def on_fit_end(self, trainer: Any) -> None:
        self._restore()

    def on_exception(self, trainer: Any, exc: BaseException) -> None:
        self._restore()


def fit_callbacks(cfg: Any) -> list:
    """torchrig's own callbacks that the config turns on: the FLOP counter and the profiler."""
    out: list = []
    if cfg.log.flops:
        out.append(FlopCounter())
    if cfg.profile.steps:
        from .profiling import Profiler

        out.append(Profiler(cfg.profile.steps, cfg.profile.memory_snapshot))
    return out
