"""Counting what would make a GPU wait, on the CPU: the host-read counter of the sync tests.

``count_host_reads()`` spies on tensor reads (``item``, ``tolist`` …), on ``torch.tensor`` / ``as_tensor`` of
Python numbers onto a device and on ``GradScaler.get_scale``, whenever torchrig code is on the stack. Used by
``tests/trainer/test_host_syncs.py`` in the test process and by ``host_reads_worker.py`` in each DDP rank.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from pathlib import Path

import torch

import torchrig

SRC = str(Path(torchrig.__file__).resolve().parent)
DATA_LAYER = str(Path(SRC) / "data")
# Functions whose reads are of host memory by construction: the flags ranks agree on through gloo (beside NCCL
# on a GPU), and the stop-signal agreement, which always runs on a gloo group.
HOST_MEMORY = {(str(Path(SRC) / "runtime" / "dist.py"), "agree_max"), (str(Path(SRC) / "runtime" / "signals.py"), None)}


def _host_memory(frame) -> bool:
    name = frame.f_code.co_filename
    return (name, frame.f_code.co_name) in HOST_MEMORY or (name, None) in HOST_MEMORY
READS = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy")


def _torchrig_frame(depth: int = 2):
    """The innermost torchrig frame on the stack above the spy (torch's own code called by torchrig counts too),
    or None when torchrig is not on the stack."""
    frame = sys._getframe(depth)
    while frame is not None:
        if frame.f_code.co_filename.startswith(SRC):
            return frame
        frame = frame.f_back
    return None


def _scalar_data(data) -> bool:
    """A Python number, or a (nested) list of them: what ``torch.tensor`` must copy from host memory."""
    if isinstance(data, (bool, int, float)):
        return True
    return isinstance(data, (list, tuple)) and bool(data) and all(_scalar_data(v) for v in data)


@contextlib.contextmanager
def count_host_reads():
    """Count what would make a GPU wait, when torchrig (at any depth of the stack) asks for it:

    * a tensor read on the host (``item``, ``__bool__``, ``tolist`` …); reads in the data layer count only for
      tensors made for the run's device (there it reads its own CPU index tensors, which wait for nothing);
    * ``torch.tensor`` / ``torch.as_tensor`` of Python numbers with a ``device``: a copy from pageable host
      memory, which on CUDA waits for the GPU;
    * ``GradScaler.get_scale``: a read of the fp16 scale.

    Yields the list the counts go to (``"what at file:line"``).
    """
    calls: list[str] = []
    device_born = weakref.WeakSet()  # tensors made by torch.tensor(..., device=…) from Python numbers
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    factories = {"tensor": torch.tensor, "as_tensor": torch.as_tensor}
    get_scale = torch.amp.GradScaler.get_scale

    def where(frame) -> str:
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"

    def spy(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            frame = _torchrig_frame()
            if (frame is not None and not _host_memory(frame)
                    and (not frame.f_code.co_filename.startswith(DATA_LAYER) or self in device_born)):
                calls.append(f"{name} at {where(frame)}")
            return original(self, *args, **kwargs)

        return read

    def factory(name):
        original = factories[name]

        def make(data, *args, **kwargs):
            out = original(data, *args, **kwargs)
            frame = _torchrig_frame()
            if frame is not None and kwargs.get("device") is not None and _scalar_data(data):
                calls.append(f"torch.{name}(number, device=…) at {where(frame)}")
                device_born.add(out)
            return out

        return make

    def scale(self):
        frame = _torchrig_frame()
        if frame is not None:
            calls.append(f"GradScaler.get_scale at {where(frame)}")
        return get_scale(self)

    for name in READS:
        setattr(torch.Tensor, name, spy(name))
    for name in factories:
        setattr(torch, name, factory(name))
    torch.amp.GradScaler.get_scale = scale
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for name, original in factories.items():
            setattr(torch, name, original)
        torch.amp.GradScaler.get_scale = get_scale
