"""The global batch split over the processes: ``data.global_batch_size`` → per-process batch × accumulation.

The samples of one optimizer step are a run of consecutive positions of the epoch's order, whatever the
split (``ResumableSampler`` deals each loaded global batch out to the ranks in slices), so 8 processes
of 4, 4 of 8 and 1 process accumulating 8 batches of 4 train on the same 32 samples per step, with the
same loss normalised over them: the same mathematics, to float tolerance. Keeping the global batch the
user's number is what lets a checkpoint resume on another number of processes with the same steps.
"""

from __future__ import annotations

from typing import Optional, Union

from ..config import ConfigError


def split_global_batch(global_batch: int, world_size: int,
                       micro_batch: Union[int, str, None] = None) -> tuple[int, int]:
    """``(per-process batch, accumulation)`` with ``batch × world_size × accumulation == global_batch``.

    Without ``micro_batch`` (or with ``auto``) each process loads its whole share at once (accumulation 1;
    ``auto`` cuts it on a CUDA out-of-memory error); with an integer ``micro_batch`` each process loads
    batches of that size and accumulates as many as its share needs. A global batch that cannot be split
    so is refused with the nearest ones that can."""
    piece = world_size * (micro_batch if isinstance(micro_batch, int) else 1)
    if global_batch % piece == 0:
        share = global_batch // world_size
        if isinstance(micro_batch, int):
            return micro_batch, share // micro_batch
        return share, 1
    below, above = (global_batch // piece) * piece, (global_batch // piece + 1) * piece
    nearest = f"{below} and {above}" if below else f"{above}"
    over = f"{world_size} process(es)" + (f" × micro-batches of {micro_batch}" if isinstance(micro_batch, int) else "")
    raise ConfigError(f"config key 'data.global_batch_size': {global_batch} cannot be split evenly over {over} (it "
                      f"must be a multiple of {piece}); the nearest that can: {nearest}"
                      + _nearest_worlds(global_batch, world_size, micro_batch)
                      + ("; or change data.micro_batch_size" if isinstance(micro_batch, int) else ""))


def _nearest_worlds(global_batch: int, world_size: int, micro_batch: Union[int, str, None]) -> str:
    """The process counts nearest ``world_size`` that split ``global_batch`` evenly: what keeps a resumed run's
    global batch (and so its steps) the checkpoint's."""
    micro = micro_batch if isinstance(micro_batch, int) else 1
    fits = [w for w in range(1, global_batch // micro + 1) if global_batch % (w * micro) == 0]
    below = [w for w in fits if w < world_size][-1:]
    above = [w for w in fits if w > world_size][:1]
    if not below + above:
        return ""
    return f"; or keep {global_batch} on {' or '.join(str(w) for w in below + above)} processes"


def describe(batch: int, world_size: int, accumulate: int, global_batch: Optional[int] = None) -> str:
    """The start line's part that says how the global batch is made."""
    made = f"batch {batch}/process × {world_size} × {accumulate} accumulation = {batch * world_size * accumulate} global"
    return made + (" (data.global_batch_size)" if global_batch else "")
