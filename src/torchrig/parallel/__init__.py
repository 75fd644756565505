"""How one model is spread over the processes: the device mesh of the run (``parallel`` config section),
tensor-parallel plans, pipeline stages and schedules, context parallelism (``parallel/context.py``), and the
data-parallel wrapper (DDP / FSDP2 / DataParallel, SyncBatchNorm, gradient synchronisation across an accumulation
window), applied after the split the way PyTorch documents composing them (``parallelize_module`` first, then
``fully_shard`` over the data-parallel sub-mesh)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .. import runtime
from . import loss
from . import tp as tensor_parallel
from .context import ContextParallel
from .placement import devices_of, placed_device, to_output_device
from .errors import ParallelConfigError
from .mesh import DEGREES, Layout, build_layout, data_parallel_mesh, resolve_degrees
from .pipeline import MicroBatch, Pipeline, PipelineStageError, StageOutput, plan_stages
from .replicas import Replicas, ReplicaGroupError
from .wrap import average_gradients, buckets, flat_collective, no_sync, no_sync_all, resolve_strategy, shard_model, wrap_model

__all__ = ["wrap_model", "resolve_strategy", "no_sync", "no_sync_all", "DEGREES", "Layout", "ParallelConfigError",
           "build_layout", "resolve_degrees", "split_model", "split_pipeline", "shard_stages", "data_parallel_mesh",
           "tensor_parallel", "devices_of", "placed_device", "to_output_device", "average_gradients", "buckets", "flat_collective",
           "MicroBatch", "Pipeline", "PipelineStageError", "StageOutput", "plan_stages", "loss",
           "Replicas", "ReplicaGroupError", "replicas", "ContextParallel"]


def split_pipeline(model: nn.Module, layout: Layout, p: Any, device: torch.device) -> nn.Module:
    """``parallel.pp``: cut ``model`` (the user's, on any device) into its stages and keep this rank's (in place:
    the rest is let go before anything moves to ``device``); ``layout.pipeline`` runs them. Returns the model."""
    import torch.distributed as dist

    if isinstance(model, nn.ModuleDict):
        raise ParallelConfigError("config key 'parallel.pp': a pipeline cuts one model's forward; a dict of models "
                                  "(a GAN's networks) is not supported")
    if layout.tp > 1:  # the plan is checked against the whole model, on every rank alike, before it is cut
        layout.plan = tensor_parallel.resolve(model, p.tp_plan, layout.tp)
    plan = plan_stages(model, p.pp_split, layout.pp * p.pp_stages_per_rank)
    layout.pipeline = pipe = Pipeline(model, plan, rank=dist.get_rank(layout.pp_group), pp=layout.pp,
                                      per_rank=p.pp_stages_per_rank, schedule=p.pp_schedule, group=layout.pp_group,
                                      device=device)
    layout.groups = runtime.Groups(layout.dp_group, layout.pp_group,
                                   dist.get_process_group_ranks(layout.pp_group)[pipe.last_rank])
    return model

def split_model(model: nn.Module, layout: Layout, cfg: Any, device: torch.device,
                dtype: Optional[torch.dtype]) -> nn.Module:
    """Apply the layout to ``model`` (already on ``device``), in place: the tensor-parallel plan over the
    ``tp`` sub-mesh (under a pipeline: on the modules of this rank's stages, the plan resolved on the whole model
    before the cut), then FSDP2 over the data-parallel sub-mesh (or, with ``parallel.cp`` alone, DDP over the data-
    and context-parallel ranks). Returns the module the loop calls."""
    if layout.tp > 1:
        if isinstance(model, nn.ModuleDict):
            raise ParallelConfigError("config key 'parallel.tp': tensor parallelism splits one model; a dict of "
                                      "models (a GAN's networks) is not supported")
        if layout.pipeline is not None:
            tensor_parallel.apply(model, layout.pipeline.held(layout.plan), layout.submesh("tp"), resolved=True)
        else:
            layout.plan = tensor_parallel.apply(model, cfg.parallel.tp_plan, layout.submesh("tp"))
    if layout.strategy == "ddp" and layout.pipeline is None:  # parallel.cp: replicas over (dp_replicate, cp)
        return wrap_model(model, "ddp", device, cfg.dist, dtype, group=layout.dp_group)
    if layout.strategy == "fsdp" and layout.pipeline is not None:
        shard_stages(layout.pipeline, device, cfg.dist, dtype, data_parallel_mesh(layout))
    elif layout.strategy == "fsdp":
        return shard_model(model, device, cfg.dist, dtype, mesh=data_parallel_mesh(layout))
    return model


def shard_stages(pipe: Pipeline, device: torch.device, dist_cfg: Any, dtype: Optional[torch.dtype],
                 mesh: Any) -> None:
    """``parallel.pp`` × ``parallel.dp_shard``: FSDP2 over the data-parallel sub-mesh on each of this rank's stages
    (its blocks first, as ``dist.fsdp_wrap`` / ``dist.fsdp_min_params`` choose, then the stage), so that
    ``torch.distributed.pipelining`` sees FSDP modules: it skips the gradient reduce-scatter on every micro-batch's
    backward but the last of a schedule step, which reduces the accumulated gradients once. Under the zero-bubble
    schedules (a backward split into an input and a weight part) the stages keep their gathered parameters from
    forward to backward (``dist.fsdp_reshard_after_forward`` off, said in one warning): resharded after the forward,
    their weight gradients come out wrong (0.44 from one process on the pipeline tests' model, against 2.4e-7)."""
    if pipe.splits_backward and dist_cfg is not None and dist_cfg.fsdp_reshard_after_forward:
        import dataclasses
        import warnings

        warnings.warn(f"dist.fsdp_reshard_after_forward=true is ignored under parallel.pp_schedule="
                      f"{pipe.schedule_name}: its weight gradients, computed apart from the input gradients, come out "
                      f"wrong from stages resharded after the forward, so FSDP2 keeps each stage's parameters "
                      f"gathered through each schedule step")
        dist_cfg = dataclasses.replace(dist_cfg, fsdp_reshard_after_forward=False)
    for st in pipe.stages:
        if len(st.own):
            names = {id(p): n for n, p in pipe.model.named_parameters()}
            raise ParallelConfigError(
                f"config key 'parallel.dp_shard': {names.get(id(st.own[0]), 'a parameter')} belongs to "
                f"{type(pipe.model).__name__} itself (outside its blocks and submodules), which FSDP2 cannot shard "
                f"inside pipeline stage {st.index + 1}; move it into a submodule, or use parallel.dp_replicate")
        shard_model(st, device, dist_cfg, dtype, mesh=mesh)
