"""Model wrapping by strategy: none, DataParallel, DistributedDataParallel or FSDP2 (fully_shard)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.device import RuntimeSetupError
from ..runtime.dist import enter_collective, leave_collective
from ..runtime.modules import is_compiled, local_tensor

STRATEGIES = ("auto", "none", "ddp", "dp", "fsdp")


def resolve_strategy(name: str, world_size: int, device: torch.device) -> str:
    name = (name or "auto").lower()
    if name not in STRATEGIES:
        raise RuntimeSetupError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
    if name == "auto":
        return "ddp" if world_size > 1 else "none"
    if name in ("ddp", "fsdp") and world_size == 1:
        return name  # a one-rank group is legal (useful for tests); wrapping still happens if a group exists
    if name == "dp" and world_size > 1:
        raise RuntimeSetupError("strategy 'dp' (nn.DataParallel) runs in one process; use strategy=ddp under torchrun")
    return name


def wrap_model(model: nn.Module, strategy: str, device: torch.device, dist_cfg: Any = None,
               precision_dtype: Optional[torch.dtype] = None, group: Any = None) -> nn.Module:
    """Return the module the loop calls. The user's ``model`` object stays the one holding weights. ``group``: the
    ranks DDP averages over (None: every rank)."""
    import torch.distributed as dist

    if dist_cfg is not None and dist_cfg.sync_batchnorm and strategy in ("ddp", "fsdp"):
        if device.type == "cpu":
            # torch's SyncBatchNorm has no CPU kernel (it raises on the first forward); keep plain BatchNorm.
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
                warnings.warn("dist.sync_batchnorm=true is ignored on CPU: torch's SyncBatchNorm runs on GPUs "
                              "only, so each process normalises with its own batch statistics")
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if strategy == "none":
        return model
    if strategy == "dp":
        advice = ("strategy=ddp under torchrig launch (one process per GPU) is the recommended path: "
                  "nn.DataParallel runs in one process, copies the model to every GPU at each step and is "
                  "slower than DistributedDataParallel even on one machine")
        if device.type != "cuda" or torch.cuda.device_count() < 2:
            warnings.warn(f"strategy 'dp' needs two or more visible GPUs, found "
                          f"{torch.cuda.device_count() if device.type == 'cuda' else 0}; running on {device} "
                          f"without wrapping. {advice}")
            return model
        warnings.warn(f"strategy 'dp': {advice}")
        # the run's device first: DataParallel gathers outputs on (and keeps the model on) device_ids[0]
        first = device.index if device.index is not None else torch.cuda.current_device()
        ids = [first] + [i for i in range(torch.cuda.device_count()) if i != first]
        return nn.DataParallel(model, device_ids=ids, output_device=first)
    if not dist.is_initialized():
        raise RuntimeSetupError(f"strategy {strategy!r} needs a process group; start with torchrig launch or torchrun")
    if strategy == "ddp":
        kwargs: dict[str, Any] = {}
        if dist_cfg is not None:
            kwargs.update(find_unused_parameters=dist_cfg.find_unused_parameters,
                          static_graph=dist_cfg.static_graph,
                          gradient_as_bucket_view=dist_cfg.gradient_as_bucket_view)
            if not broadcast_buffers(dist_cfg, model):
                kwargs[_DDP_BUFFER_SYNC] = False
            if dist_cfg.bucket_cap_mb is not None:
                kwargs["bucket_cap_mb"] = dist_cfg.bucket_cap_mb
        if not any(p.requires_grad for p in model.parameters()):
            return model
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group, **kwargs)
    if strategy == "fsdp":
        return shard_model(model, device, dist_cfg, precision_dtype)
    raise RuntimeSetupError(f"unknown strategy {strategy!r}")


# DDP's switch for the buffer broadcast before each forward: ``forward_sync_buffers`` in newer torch (which
# deprecates ``broadcast_buffers``; both still copy rank 0's buffers once, at wrapping), else the old name.
_DDP_BUFFER_SYNC = ("forward_sync_buffers" if "forward_sync_buffers" in
                    inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters else "broadcast_buffers")


def broadcast_buffers(dist_cfg: Any, model: nn.Module) -> bool:
    """``dist.broadcast_buffers``: as given, or ``auto``: off when SyncBatchNorm keeps the ranks' statistics
    equal already (a broadcast of rank 0's buffers at every forward would only cost time), else on."""
    value = getattr(dist_cfg, "broadcast_buffers", "auto")
    if value == "auto":
        return not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    return bool(value)


def shard_model(model: nn.Module, device: torch.device, dist_cfg: Any, dtype: Optional[torch.dtype],
                mesh: Any = None) -> nn.Module:
    """FSDP2: shard chosen blocks (by class name or parameter count), then the root; over ``mesh`` (a data-parallel
    sub-mesh: 1-D shards, 2-D replicas × shards) when the model is also split otherwise, else every rank."""
    try:
        from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy
    except ImportError:  # torch < 2.6 kept it under _composable
        try:
            from torch.distributed._composable.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy
        except ImportError:
            raise RuntimeSetupError(f"strategy 'fsdp' needs FSDP2 (fully_shard), not in torch {torch.__version__}") from None
    kwargs: dict[str, Any] = {} if mesh is None else {"mesh": mesh}
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if dist_cfg is not None and dist_cfg.fsdp_cpu_offload:
        if device.type == "cpu":
            warnings.warn("dist.fsdp_cpu_offload=true is ignored when training on CPU: the parameters already live "
                          "in CPU memory (the option moves GPU shards and optimizer state to the host)")
        else:
            if dist.is_initialized() and not ("gloo" in str(dist.get_backend()) or "mpi" in str(dist.get_backend())):
                raise RuntimeSetupError(
                    f"dist.fsdp_cpu_offload=true keeps the gradients on the CPU, which the backend "
                    f"{dist.get_backend()!r} cannot reduce; set dist.backend='cpu:gloo,cuda:nccl' (the default)")
            kwargs["offload_policy"] = CPUOffloadPolicy()
    reshard = True if dist_cfg is None else dist_cfg.fsdp_reshard_after_forward
    names = set(dist_cfg.fsdp_wrap) if dist_cfg is not None else set()
    min_params = dist_cfg.fsdp_min_params if dist_cfg is not None else 0
    for name, sub in list(model.named_modules())[::-1]:  # children before parents
        if sub is model:
            continue
        by_class = type(sub).__name__ in names
        by_size = min_params > 0 and sum(p.numel() for p in sub.parameters()) >= min_params
        if by_class or by_size:
            fully_shard(sub, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    return model


def no_sync(model: nn.Module, skip: bool):
    """Skip gradient all-reduce for a micro-batch that does not end an accumulation window."""
    if not skip:
        return contextlib.nullcontext()
    while is_compiled(model):  # torch.compile(DDP(model)): the DDP inside decides
        model = model._orig_mod
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


_NULL = contextlib.nullcontext()  # reusable: the training loop needs no new object per micro-batch


def no_sync_all(models: list, skip: bool, world_size: int):
    """``no_sync`` of several wrapped models at once (a GAN's networks), or a no-op context."""
    if not skip or world_size == 1:
        return _NULL
    stack = contextlib.ExitStack()
    for m in models:
        stack.enter_context(no_sync(m, True))
    return stack


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket: the most extra memory averaging the gradients takes


def buckets(tensors: list, limit: int = BUCKET_BYTES) -> list:
    """``tensors`` grouped by (device, dtype), each group cut into runs of at most ``limit`` bytes (a tensor
    larger than that on its own)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    out = []
    for group in groups.values():
        run, size = [], 0
        for t in group:
            if run and size + t.numel() * t.element_size() > limit:
                out.append(run)
                run, size = [], 0
            run.append(t)
            size += t.numel() * t.element_size()
        out.append(run)
    return out


def flat_collective(tensors: list, collective: Callable[[torch.Tensor], Any]) -> None:
    """``collective(flat)`` (in place) on ``tensors`` one flat bucket of :func:`buckets` at a time, the result
    written back into them: one call per bucket instead of one per tensor, no buffer larger than a bucket."""
    for bucket in buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collective(flat)
        torch._foreach_copy_(bucket, [part.view_as(t) for t, part in zip(bucket, flat.split([t.numel() for t in bucket]))])


def average_gradients(params: list, group: Any = None) -> None:
    """The mean of the dense gradients over the ranks of ``group`` (None: every rank), as DDP makes it, where DDP
    cannot (a window whose backward a rank may have to run again; a pipeline stage's, whose micro-batches run in
    schedule steps of their own): one flat all-reduce per bucket of at most :data:`BUCKET_BYTES`, summed and
    divided in place, so the update never needs a gradient-sized buffer."""
    size = dist.get_world_size(group)
    grads = [local_tensor(p.grad) for p in params  # a tensor-parallel piece: its replicas average alike
             if p.grad is not None and not p.grad.is_sparse]

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat.div_(size)

    n = enter_collective("all_reduce", "gradient averaging")
    flat_collective(grads, mean)
    leave_collective(n)
