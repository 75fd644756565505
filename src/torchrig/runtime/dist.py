"""Process group set-up and the collective helpers a custom step may need.

Ranks come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), from an ``srun`` step's (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
first host of the node list), or from an explicit ``init_method`` (``tcp://host:port``,
``file:///path``).
All helpers work (as no-ops) when no process group exists, so single-process code calls them freely.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import gc
import io
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .device import RuntimeSetupError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    source: str = "single"  # single, torchrun, slurm, init_method

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``node[03-05,07],gpu1`` → ``node03``."""
    nodelist = nodelist.strip()
    m = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist)
    if not m:
        return nodelist
    prefix, ranges, suffix = m.groups()
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def detect(init_method: Optional[str] = None, rank: Optional[int] = None,
           world_size: Optional[int] = None) -> DistInfo:
    """Work out rank and world size from explicit arguments, torchrun or Slurm, in that order."""
    env = os.environ
    if init_method is not None:
        if rank is None or world_size is None:
            raise RuntimeSetupError(
                f"dist.init_method={init_method!r} needs dist.rank and dist.world_size as well")
        local = int(env.get("LOCAL_RANK", rank))
        return DistInfo(rank, world_size, local, int(env.get("LOCAL_WORLD_SIZE", world_size)), "init_method")
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", 1)), "torchrun")
    slurm = slurm_info(env)
    if slurm is not None:
        return slurm
    return DistInfo()


def _leading_int(text: str, default: int) -> int:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else default


def slurm_info(env: Optional[dict] = None) -> Optional[DistInfo]:
    """Rank and world size of an ``srun`` task (one task per GPU), or None outside a multi-task step.

    Only ``srun`` job steps count: ``SLURM_STEP_NUM_TASKS`` (or a step id) says the process is one task
    of a step. A plain ``python train.py`` in an ``sbatch`` script or an ``salloc`` shell sees the
    allocation's ``SLURM_NTASKS`` too, but it is one process whose "peers" would never start.
    """
    env = os.environ if env is None else env
    if "SLURM_PROCID" not in env:
        return None
    world = env.get("SLURM_STEP_NUM_TASKS")
    if world is None:
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
        if step is None or not step.isdigit() or int(step) >= 0xFFFFFFF0:  # no step, or the batch/extern step
            return None
        world = env.get("SLURM_NTASKS")
    if world is None or _leading_int(world, 1) <= 1:
        return None
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") \
        or env.get("SLURM_NTASKS_PER_NODE") or "1"
    return DistInfo(int(env["SLURM_PROCID"]), _leading_int(world, 1), int(env.get("SLURM_LOCALID", 0)),
                    _leading_int(per_node, 1), "slurm")


def slurm_master(env: Optional[dict] = None) -> tuple[str, int]:
    """(address, port) of rank 0 for a Slurm step: the first host of the step's node list and a port
    derived from the job id (20000-29999), so two jobs sharing a node do not collide."""
    env = os.environ if env is None else env
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    port = 20000 + int(job) % 10000 if job.isdigit() else 29500
    return first_slurm_host(nodes), port


def default_backend(device: torch.device) -> str:
    """NCCL for GPU tensors with gloo beside it for CPU ones (FSDP2's offloaded shards, the flags ranks agree on
    without touching the GPU), as ``init_process_group`` itself defaults to; gloo on CPU."""
    if device.type == "cuda" and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl" if dist.is_gloo_available() else "nccl"
    return "gloo"


def backend_name() -> str:
    """The default group's backend (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``), or "" without a group."""
    return str(dist.get_backend()) if is_initialized() else ""


def host_collectives() -> bool:
    """Whether the default group takes CPU tensors (gloo or MPI in its backend): then a flag the ranks agree on
    is all-reduced from host memory, and nothing waits for a GPU."""
    if not is_initialized():
        return True
    backend = str(dist.get_backend())
    return "gloo" in backend or "mpi" in backend


LAUNCHER_WATCH = "torchrig-launcher-watch"  # the watching thread's name: one per process, however many fits


def end_with_launcher() -> None:
    """Under torchrun (``torchrig launch``), send this worker SIGTERM once its launcher is gone.

    A launcher killed with SIGKILL cannot stop its workers; left alone they train on until a collective
    or the lost rendezvous store fails them, tens of seconds later. With the signal they stop as torchrun
    would have stopped them: after the step under way, with a checkpoint. A thread watches the parent
    process (twice a second): Linux's PR_SET_PDEATHSIG fires again for each thread of the dying launcher
    that a worker is handed to, and a second SIGTERM means "exit at once, without a checkpoint".
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or any(t.name == LAUNCHER_WATCH for t in threading.enumerate()):
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name=LAUNCHER_WATCH).start()


def init_process_group(info: DistInfo, device: torch.device, backend: Optional[str] = None,
                       init_method: Optional[str] = None, timeout_s: float = 1800.0,
                       flight_recorder: bool = False) -> bool:
    """Join the process group described by ``info``; returns True when this call created it. ``flight_recorder``:
    an NCCL group keeps its last collectives for a hang's dump (``TORCH_NCCL_TRACE_BUFFER_SIZE``, unless set)."""
    end_with_launcher()
    if not info.is_distributed or dist.is_initialized():
        return False
    if not dist.is_available():
        raise RuntimeSetupError("this torch build has no torch.distributed support; install a standard torch wheel")
    backend = backend or default_backend(device)
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available()}
    if backend in available and not available[backend]:
        ok = [b for b, v in available.items() if v]
        raise RuntimeSetupError(f"dist.backend {backend!r} is not built into this torch; available: {', '.join(ok)}")
    if "nccl" in backend and device.type != "cuda":
        raise RuntimeSetupError(f"dist.backend {backend!r} needs CUDA devices; use gloo on CPU")
    if "nccl" in backend and flight_recorder:
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=info.rank, world_size=info.world_size)
    elif info.source == "slurm":
        addr, port = slurm_master()
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", str(port))
        kwargs.update(init_method="env://", rank=info.rank, world_size=info.world_size)
    else:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeSetupError(
                    f"{var} is not set but RANK/WORLD_SIZE are; start the job with torchrun or torchrig launch")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
            # worker can read the address a dead worker of the previous attempt published, and hang.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                                  False, timeout=kwargs["timeout"])
            kwargs.update(store=dist.PrefixStore(f"torchrig/attempt_{restart_count()}", store),
                          rank=info.rank, world_size=info.world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if "nccl" in backend:
            kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    atexit.register(destroy_process_group)  # scripts that never call Trainer.close still leave cleanly
    return True


class CollectiveLog:
    """torchrig's own collectives in this process, numbered in the order they are entered: the last one entered (its
    number, operation and call site's name) and the highest number completed. Every rank runs the same collectives
    in the same order, so the numbers agree across ranks; a hang's watch (``runtime/hang.py``) reads them from its
    own thread to say which collective a rank waits in, and which one another never reached. A collective that
    raises stays entered. Per call: two attribute writes and an int, no lock, no allocation, no device work."""

    __slots__ = ("entered", "op", "name", "completed")

    def __init__(self) -> None:
        self.entered, self.op, self.name, self.completed = 0, "", "", 0


COLLECTIVES = CollectiveLog()


def enter_collective(op: str, name: str) -> int:
    """Mark the collective ``op`` (all_reduce, broadcast …) of the call site ``name`` as entered; its number."""
    log = COLLECTIVES
    log.entered += 1
    log.op, log.name = op, name
    return log.entered


def leave_collective(number: int) -> None:
    """Mark collective ``number`` (from :func:`enter_collective`) as completed."""
    if number > COLLECTIVES.completed:
        COLLECTIVES.completed = number


class DistributedError(RuntimeSetupError):
    """A collective failed because another rank stopped taking part (it hung, was slow or died)."""


_TIMEOUT_MARKS = ("timed out", "timeout", "watchdog caught collective")
_LOST_MARKS = ("connection reset", "connection closed", "broken pipe", "connection refused", "socket closed",
               "end of file", "communicator was aborted", "remote process exited", "no route to host")


def collective_error(exc: BaseException, timeout_s: float) -> Optional[DistributedError]:
    """A clear error for a collective that failed because of another rank; None for any other error.

    gloo and nccl report these as ``RuntimeError`` / ``DistBackendError`` with a low-level text
    (``Timed out waiting 5000ms for recv``, ``Connection reset by peer``); the user needs to know
    which setting bounded the wait and where to look.
    """
    if isinstance(exc, DistributedError) or not is_initialized() or dist.get_world_size() < 2:
        return None
    return explain_collective_failure(exc, timeout_s, dist.get_rank())


def explain_collective_failure(exc: BaseException, timeout_s: float, rank: int) -> Optional[DistributedError]:
    """The message of :func:`collective_error`, from the exception alone (no process group needed)."""
    text = str(exc)
    low = text.lower()
    from_backend = isinstance(exc, getattr(dist, "DistError", ())) or any(
        k in low for k in ("gloo", "nccl", "c10d", "processgroup"))
    if not from_backend:
        return None
    detail = text.strip().splitlines()[0][:240] if text.strip() else type(exc).__name__
    if any(k in low for k in _TIMEOUT_MARKS):
        return DistributedError(
            f"rank {rank}: a collective operation (gradient all-reduce, all-gather or barrier) did not complete "
            f"within dist.timeout={timeout_s:g}s: another rank stopped taking part (it hangs, crashed, is stuck "
            f"loading data, or is much slower). Check the other ranks' logs; if one is legitimately slow (a long "
            f"evaluation or checkpoint on rank 0), raise dist.timeout. [{detail}]")
    if any(k in low for k in _LOST_MARKS):
        return DistributedError(
            f"rank {rank}: lost the connection to another rank during a collective operation: a peer process "
            f"died or was killed (out of memory, SIGKILL, an exception; see its log) or the network between "
            f"the machines failed. With torchrig launch --max-restarts K the group restarts and resumes from "
            f"the latest checkpoint. [{detail}]")
    return None


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's failure of a collective because a peer's process or connection is gone."""
    low = str(exc).lower()
    return any(k in low for k in _LOST_MARKS) and not any(k in low for k in _TIMEOUT_MARKS)


def destroy_process_group() -> None:
    """Leave and destroy the default group (a no-op without one); never raises."""
    if dist.is_available() and dist.is_initialized():
        try:
            if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
                gc.collect()  # DDP wrappers left in reference cycles let go of the group now, not at exit
                # A gloo worker thread drops its last finished work (and the Python tensors in it) a moment
                # after the caller saw the work complete. The group usually outlives this call (DDP's hooks
                # keep it), so an interpreter that starts exiting in that moment aborts with "terminate
                # called without an active exception". Give the threads that moment first.
                time.sleep(0.1)
            dist.destroy_process_group()
        except Exception:  # a broken group (peer died) must not mask the original error
            pass


# ----------------------------------------------------------------------------- public helpers


def restart_count() -> int:
    """How many times this job was started again: by torchrun (``torchrig launch --max-restarts``) after
    a failure, or by Slurm after a requeue (``SLURM_RESTART_COUNT``). A restarted job resumes its run."""
    total = 0
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        try:
            total += int(os.environ.get(name, "0"))
        except ValueError:
            pass
    return total


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    """Global rank 0, or a single process: the one that prints and writes.

    Before the process group exists (a recipe reading its data before the Trainer starts) the rank
    comes from the launcher's environment, torchrun's ``RANK`` or an ``srun`` step's.
    """
    if is_initialized():
        return dist.get_rank() == 0
    try:
        return detect().rank == 0
    except ValueError:  # a malformed launcher variable; init_process_group reports it
        return True


def barrier(name: str = "barrier") -> None:
    """Wait for every rank. Under NCCL the barrier runs on this rank's GPU (the current device, which
    ``select_device`` set), not on a guess that NCCL would otherwise make and warn about."""
    if is_initialized() and get_world_size() > 1:
        n = enter_collective("barrier", name)
        if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
        leave_collective(n)


@dataclasses.dataclass(frozen=True)
class Groups:
    """The process groups one fit reduces over, made once by its layout (``parallel.Layout.groups``) and handed
    to whatever reduces: the loss counts, the metrics, the logged values, the checkpoints, evaluation. Nothing of
    it is process-wide, so two fits in one process (a notebook, lr-find then fit, trials side by side) each reduce
    over their own ranks.

    ``data``: the data-parallel ranks, over which samples are split (a sub-mesh's group when tensor or pipeline
    parallelism splits the model; None: every rank holds different samples). Ranks of one tensor-parallel group
    see the same samples: summing their counts would count each sample once per rank of that group, so those
    reductions run over the ranks that hold different samples only.

    ``cp``: the context-parallel ranks of this rank (``parallel.cp``: they split each sequence of the same samples),
    or None. They are part of ``data`` (innermost: the ranks of one sample shard are neighbours in it), because each
    holds different tokens: loss counts and metric states are summed over them too, while the sampler gives them one
    shard (:meth:`sample_rank`, :meth:`sample_ranks`).

    ``pipeline``: this rank's pipeline (the ranks holding the stages of one copy of the model, ``parallel.pp``),
    whose last stage, global rank ``last_stage``, computes the loss, the metrics and the predictions; None: no
    pipeline. What is computed from the model's output reaches the other stages with :meth:`from_last_stage`.
    """

    data: Any = None
    pipeline: Any = None
    last_stage: int = 0
    cp: Any = None

    def dp_size(self) -> int:
        """Ranks that hold different items, samples or a sequence's tokens (the world size unless a mesh splits the
        model): what loss counts, metrics and gradients are reduced over."""
        return dist.get_world_size(self.data) if is_initialized() else 1

    def dp_rank(self) -> int:
        """This rank's place among the ranks of :meth:`dp_size`."""
        return dist.get_rank(self.data) if is_initialized() else 0

    def cp_size(self) -> int:
        """Ranks that split each sequence (``parallel.cp``); 1 without."""
        return dist.get_world_size(self.cp) if self.cp is not None and is_initialized() else 1

    def sample_ranks(self) -> int:
        """Ranks that hold different samples (the sampler's world size): the data-parallel ranks."""
        return self.dp_size() // self.cp_size()

    def sample_rank(self) -> int:
        """This rank's data-parallel index (its shard of every batch, the same on the ranks of one sequence)."""
        return self.dp_rank() // self.cp_size()

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None and is_initialized()

    def is_last_stage(self) -> bool:
        """Whether this rank computes the model's output (the last pipeline stage; every rank without a pipeline)."""
        return not self.pipelined or get_rank() == self.last_stage

    def from_last_stage(self, obj: Any) -> Any:
        """``obj`` as the last pipeline stage has it (plain data: see :func:`gather`; the other stages may pass
        anything, None), on every rank of the pipeline; ``obj`` itself without a pipeline. Collective over the
        pipeline's ranks. A tensor of the same shape and dtype on every rank is filled in place instead."""
        return broadcast(obj, self.last_stage, self.pipeline) if self.pipelined else obj


WORLD = Groups()  # no mesh: every rank holds different samples, no pipeline


def _all_reduce(out: torch.Tensor, op: Any, group: Any, name: str) -> None:
    n = enter_collective("all_reduce", name)
    dist.all_reduce(out, op=op, group=group)
    leave_collective(n)


def all_reduce_sum(t: torch.Tensor, group: Any = None, name: str = "all_reduce_sum") -> torch.Tensor:
    """Sum of ``t`` over the ranks of ``group`` (None: every rank); a new tensor, the input is left alone.
    ``name``: what the collective is for, as a hang's summary names it."""
    out = t.detach().clone()
    if is_initialized() and dist.get_world_size(group) > 1:
        _all_reduce(out, dist.ReduceOp.SUM, group, name)
    return out


def all_reduce_max(t: torch.Tensor, name: str = "all_reduce_max") -> torch.Tensor:
    """Element-wise maximum of ``t`` over ranks (a new tensor)."""
    out = t.detach().clone()
    if is_initialized() and get_world_size() > 1:
        _all_reduce(out, dist.ReduceOp.MAX, None, name)
    return out


def agree_max(values: list, device: Optional[torch.device] = None, name: str = "agreement") -> list:
    """The element-wise maximum of a few Python numbers over the ranks (flags the ranks must agree on), as
    Python floats. In host memory when the group takes CPU tensors (gloo, or gloo beside NCCL: the default), so
    nothing waits for a GPU; else on ``device`` (an NCCL-only group), which then waits for it once."""
    if not (is_initialized() and get_world_size() > 1):
        return [float(v) for v in values]
    flags = torch.tensor([float(v) for v in values], device=None if host_collectives() else device)
    _all_reduce(flags, dist.ReduceOp.MAX, None, name)
    return flags.tolist()


def all_gather_numbers(values: list, name: str = "all_gather") -> list:
    """Every rank's list of a few Python numbers (the same length on every rank), in rank order, on every rank: one
    small all-gather, in host memory when the group takes CPU tensors."""
    if not (is_initialized() and get_world_size() > 1):
        return [[float(v) for v in values]]
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_numbers_device())
    every = torch.empty(get_world_size() * len(values), dtype=torch.float64, device=mine.device)
    n = enter_collective("all_gather", name)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(every, mine)  # the new name, or 2.x's
    leave_collective(n)
    return every.view(-1, len(values)).tolist()


def _numbers_device() -> Optional[torch.device]:
    """Where a few numbers the ranks exchange live: the host when the group takes CPU tensors, else this GPU."""
    if host_collectives() or not torch.cuda.is_available():
        return None
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce_mean(t: torch.Tensor, group: Any = None, name: str = "all_reduce_mean") -> torch.Tensor:
    out = all_reduce_sum(t, group, name)
    n = dist.get_world_size(group) if is_initialized() else 1
    return out / n if out.is_floating_point() else out.double() / n


def broadcast(obj: Any, src: int = 0, group: Any = None, name: str = "broadcast") -> Any:
    """Broadcast a tensor (in place, returned) or plain data (see :func:`gather`) from global rank ``src`` over
    ``group`` (None: every rank)."""
    if not (is_initialized() and dist.get_world_size(group) > 1):
        return obj
    n = enter_collective("broadcast", name)
    if isinstance(obj, torch.Tensor):
        dist.broadcast(obj, src, group=group)
    else:
        obj = _broadcast_object(obj, src, group)
    leave_collective(n)
    return obj


def _broadcast_object(obj: Any, src: int, group: Any) -> Any:
    device = _object_device()
    data = _encode(obj, device) if get_rank() == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    if data is None:
        data = torch.empty(receivable(int(size.item()), src, device), dtype=torch.uint8, device=device)
    dist.broadcast(data, src, group=group)
    return obj if get_rank() == src else _decode(data, src)


def gather_to_first(obj: Any, group: Any, name: str = "gather") -> Optional[list]:
    """Every rank's ``obj`` (plain data, see :func:`gather`), in ``group``'s rank order, on the group's first rank
    only (None on the others): what one writer needs of each rank, without a copy of all of it on every rank."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return [obj]
    n = enter_collective("gather", name)
    out = _gather_to_first(obj, group, ranks)
    leave_collective(n)
    return out


def _gather_to_first(obj: Any, group: Any, ranks: list) -> Optional[list]:
    device = _object_device()
    me = get_rank()
    if me != ranks[0]:
        data = _encode(obj, device)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), ranks[0], group=group)
        dist.send(data, ranks[0], group=group)
        return None
    out = [obj]
    for src in ranks[1:]:
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, src, group=group)
        data = torch.empty(receivable(int(size.item()), src, device), dtype=torch.uint8, device=device)
        dist.recv(data, src, group=group)
        out.append(_decode(data, src))
    return out


def gather(obj: Any, group: Any = None, name: str = "all_gather") -> list:
    """Every rank's ``obj`` (of ``group``; None: every rank), in rank order, on every rank.

    ``obj`` is plain data: tensors, numbers, strings, None, and lists, tuples, sets and dicts of them.
    It travels as the bytes of ``torch.save`` in a tensor and is read back with
    ``torch.load(weights_only=True)``, never with a free unpickler (``all_gather_object``): what
    another process sends can never make this one run code.
    """
    if not (is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    n = enter_collective("all_gather", name)
    out = _gather(obj, group)
    leave_collective(n)
    return out


def _gather(obj: Any, group: Any) -> list:
    device = _object_device()
    data = _encode(obj, device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    counts = torch.cat(sizes).tolist()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(counts)))
    longest = max(receivable(n, r, device, len(counts)) for r, n in zip(ranks, counts))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    rank = dist.get_rank(group)
    return [obj if r == rank else _decode(part[:n], r) for r, (part, n) in enumerate(zip(parts, counts))]


def receivable(length: int, rank: int, device: torch.device, copies: int = 1) -> int:
    """``length``, the bytes another rank declares it sends, if this process could hold ``copies`` of them: at most
    the memory of the device they arrive on (the host's RAM; the GPU's under NCCL). A longer (or negative)
    length is no object a rank could have sent, only a buffer that would exhaust the memory: one line instead."""
    limit = device_memory(device)
    if 0 <= length and length * copies <= limit:
        return length
    where = "this GPU" if device.type == "cuda" else "this machine"
    what = f"more than the {limit / (1 << 30):.3g} GiB of memory of {where}" if length >= 0 else "a negative length"
    raise DistributedError(f"rank {get_rank()}: rank {rank} declared {length} bytes of data to send, {what}; "
                           f"ranks exchange only plain data of their own that fits. Check that every rank runs your "
                           f"own program")


def device_memory(device: torch.device) -> int:
    """Bytes of memory of ``device``: the GPU's total, or the host's physical memory (no limit where unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return 1 << 62


def _object_device() -> torch.device:
    """Where the bytes of exchanged objects travel: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor, rank: int) -> Any:
    try:
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)
    except Exception as exc:
        text = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f"pickles '{found.group(1)}'" if found else f"cannot be read as plain data ({type(exc).__name__})"
        raise DistributedError(
            f"rank {get_rank()}: the object rank {rank} sent {what}; ranks exchange only plain data (tensors, "
            f"numbers, strings, lists, tuples, dicts), so that no process can make another run code. Check that "
            f"every rank runs your own program (and gather / broadcast plain values)") from None


def explain_collective_errors(method: Callable) -> Callable:
    """Decorate a method of an object with ``cfg.dist.timeout``: a backend's low-level failure of a
    collective (a timeout, a lost peer) becomes one clear error."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            err = collective_error(exc, self.cfg.dist.timeout)
            if err is None:
                raise
            raise err from exc

    return wrapper
