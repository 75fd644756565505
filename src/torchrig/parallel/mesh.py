"""The layout of a run: how many ranks replicate, shard, and split the model, on one ``DeviceMesh``.

``parallel.dp_replicate × parallel.dp_shard × parallel.cp × parallel.tp × parallel.pp`` is the world size. One degree
may be ``-1`` (the ranks the others leave); ``auto`` on the data-parallel degrees gives the rest to the one
``dist.strategy`` names (``ddp``: replicas, ``fsdp``: shards), so ``dist.strategy=ddp|fsdp`` alone keep
meaning what they always did. A run that only replicates or only shards needs no mesh: DDP and FSDP2
use the default group, as before. Once the model itself is split (``tp > 1`` or ``pp > 1``) or data parallelism
has two levels (HSDP), or sequences are split (``cp > 1``), the mesh is built once, with the dimensions ``pp``,
``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (every one, size 1 included; ``pp`` outermost, so that a stage's
ranks are neighbours), and the group of the data-parallel and context-parallel ranks (those with the same ``pp``
and ``tp`` coordinates) becomes the one metrics and loss counts are reduced over (``Layout.groups.data``). The
``cp`` ranks of one sample shard hold the same parameters: FSDP2 shards over the flattened ``(dp_shard, cp)``
sub-mesh, DDP replicates over ``(dp_replicate, cp)`` (every rank, as ``cp`` composes with nothing else yet), and
the sampler gives them one shard (``Groups.sample_rank``); see ``parallel/context.py`` for the sequences. With ``pp > 1`` the ranks with the same data-parallel and
``tp`` coordinates form a pipeline (``Layout.groups.pipeline``), stage ``i`` on its ``i``-th rank. Beside a
pipeline, the data-parallel ranks of a stage replicate it (``dp_replicate`` alone: strategy ``ddp``, the pipeline's
step averages the gradients once per optimizer step), shard it (``dp_shard``: FSDP2 on each stage), or both (HSDP:
FSDP2 over the 2-D ``(dp_replicate, dp_shard)`` sub-mesh, which all-reduces over the replicas itself, so the step
does not average them again).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import runtime
from .context import ContextParallel
from .errors import ParallelConfigError
from .wrap import resolve_strategy

DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")


@dataclasses.dataclass
class Layout:
    """The resolved degrees, the data-parallel wrapper and (when needed) the device mesh."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    strategy: str = "none"              # the data-parallel wrapper: none, ddp, fsdp or dp
    mesh: Any = None                    # DeviceMesh (pp, dp_replicate, dp_shard, cp, tp), or None: the default group
    dp_group: Any = None                # the data-parallel ranks' group, or None: every rank
    plan: dict = dataclasses.field(default_factory=dict)  # {module: tensor-parallel style} once split
    pp_group: Any = None                # with pp > 1: this rank's pipeline (its stages' ranks, in stage order)
    pipeline: Any = None                # with pp > 1: this rank's stages of the model (parallel.pipeline.Pipeline)
    groups: runtime.Groups = runtime.WORLD  # what the fit reduces over: data-parallel ranks, pipeline, last stage
    context: Any = None                 # with cp > 1: the sequences' split (parallel.context.ContextParallel)

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        """Whether no rank holds the whole model as plain tensors (FSDP2, tensor parallel: DTensors; a pipeline:
        each rank its stages): checkpoints go through DCP, every rank writing its part."""
        return self.strategy == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def lockstep(self) -> bool:
        """Whether every forward is a collective (FSDP2's all-gathers, tensor-parallel reductions): ranks with fewer
        evaluation batches must make as many forwards. A pipeline's forwards only pass activations along a
        pipeline, whose ranks see the same batches."""
        return self.strategy == "fsdp" or self.tp > 1

    def submesh(self, *names: str) -> Any:
        return self.mesh[names if len(names) > 1 else names[0]]

    def degrees(self) -> dict[str, int]:
        """The five degrees and the world size, as a checkpoint records them."""
        return {**{k: getattr(self, k) for k in DEGREES}, "world_size": self.dp * self.cp * self.tp * self.pp}

    def describe(self) -> str:
        return " × ".join(f"{k}={getattr(self, k)}" for k in DEGREES if getattr(self, k) > 1) or "one process"


def resolve_degrees(p: Any, strategy: str, world_size: int) -> dict[str, int]:
    """The five degrees as integers whose product is ``world_size``; one line naming the key otherwise."""
    given = {k: getattr(p, k, 1) for k in DEGREES}
    fixed = 1
    for k, v in given.items():
        if isinstance(v, int) and v > 0:
            fixed *= v
    named = " × ".join(f"{k}={v}" for k, v in given.items() if v not in ("auto", 1))
    exact = not any(v in ("auto", -1) for v in given.values())  # every degree given: no rank left to place
    if world_size % fixed:
        raise ParallelConfigError(
            f"config key 'parallel': {named} needs {'exactly' if exact else 'a multiple of'} {fixed} processes, but "
            f"the job has {world_size}; start {fixed}{'' if exact else ' (or a multiple)'} with torchrig launch "
            f"--nproc-per-node, or {'change' if exact else 'lower'} the degrees")
    rest = world_size // fixed
    out = {k: v for k, v in given.items() if isinstance(v, int) and v > 0}
    open_ = [k for k, v in given.items() if v == -1] or [k for k, v in given.items() if v == "auto"]
    if -1 in given.values():
        out.update({k: 1 for k, v in given.items() if v == "auto"})
        out[open_[0]] = rest
    elif open_:
        target = "dp_shard" if strategy == "fsdp" or "dp_replicate" not in open_ else "dp_replicate"
        out.update({k: 1 for k in open_})
        out[target] = rest
    elif rest != 1:
        product = " × ".join(str(given[k]) for k in DEGREES)
        raise ParallelConfigError(
            f"config key 'parallel': {' × '.join(DEGREES)} = {product} = {fixed} processes, but the job "
            f"has {world_size}; set one degree to -1 (e.g. parallel.dp_replicate=-1) to give it the rest")
    return {k: out[k] for k in DEGREES}


def build_layout(p: Any, strategy_name: str, world_size: int, device: torch.device) -> Layout:
    """The run's layout: resolved degrees, wrapper and mesh. Collective when it builds a mesh."""
    d = resolve_degrees(p, strategy_name, world_size)
    layout = Layout(**d)
    if layout.cp > 1:
        return _context_parallel_layout(layout, strategy_name, device)
    if d["tp"] == 1 and d["pp"] == 1 and (d["dp_replicate"] == 1 or d["dp_shard"] == 1):
        strategy = resolve_strategy(strategy_name, world_size, device)
        if strategy == "ddp" and d["dp_shard"] > 1:  # auto with parallel.dp_shard: shards
            strategy = "fsdp"
        layout.strategy = strategy
        return layout
    if strategy_name in ("dp", "none") and layout.dp > 1:
        raise ParallelConfigError(f"config key 'dist.strategy': {strategy_name!r} cannot share the data-parallel "
                                  f"ranks of {layout.describe()}; use dist.strategy=auto")
    # with TP, data parallelism is FSDP2 (as PyTorch's 2-D); beside a pipeline, FSDP2 shards of each stage
    # (parallel.dp_shard; with parallel.dp_replicate too, HSDP: FSDP2 also all-reduces over the replicas), or
    # replicas alone, whose gradients the pipeline averages once per optimizer step
    layout.strategy = "none" if layout.dp == 1 else "ddp" if layout.pp > 1 and layout.dp_shard == 1 else "fsdp"
    layout.mesh = _mesh(layout, device)
    layout.dp_group = _data_parallel_group(layout.mesh)
    layout.groups = runtime.Groups(data=layout.dp_group)
    if layout.pp > 1:  # the pipeline's ranks; the last stage's rank is known once the stages are placed on them
        layout.pp_group = layout.submesh("pp").get_group()
    return layout


def _context_parallel_layout(layout: Layout, strategy_name: str, device: torch.device) -> Layout:
    """``parallel.cp > 1``: the mesh, the data-parallel wrapper over ``(dp_replicate | dp_shard) × cp`` (the cp ranks
    hold the same parameters, so their gradients are averaged like data-parallel ranks') and the sequences' split.
    The compositions that are not tested with it are refused in one line."""
    other = [f"{k}={getattr(layout, k)}" for k in ("tp", "pp") if getattr(layout, k) > 1]
    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        other.append(f"dp_replicate={layout.dp_replicate} with dp_shard={layout.dp_shard} (HSDP)")
    if other:
        raise ParallelConfigError(f"config key 'parallel.cp': {layout.cp} with {other[0]} is not supported yet (cp "
                                  f"composes with dp_replicate or dp_shard); set parallel.cp=1 or leave that degree 1")
    if strategy_name in ("dp", "none"):
        raise ParallelConfigError(f"config key 'dist.strategy': {strategy_name!r} cannot average the gradients of the "
                                  f"parallel.cp={layout.cp} ranks; use dist.strategy=auto, ddp or fsdp")
    layout.strategy = "fsdp" if layout.dp_shard > 1 or strategy_name == "fsdp" else "ddp"
    layout.mesh = _mesh(layout, device)
    layout.dp_group = _data_parallel_group(layout.mesh)
    layout.context = ContextParallel(layout.submesh("cp"))
    layout.groups = runtime.Groups(data=layout.dp_group, cp=layout.context.group)
    return layout


def _mesh(layout: Layout, device: torch.device) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ParallelConfigError(f"config key 'parallel': {layout.describe()} needs a process group; start the job "
                                  f"with torchrig launch or torchrun")
    return init_device_mesh(device.type, (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))


def _data_parallel_group(mesh: Any) -> Any:
    """The group of the ranks with this rank's ``pp`` and ``tp`` coordinates, ``cp`` innermost (every rank takes part
    in making them all)."""
    ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) tensor of global ranks
    columns = [ranks[s, ..., t].flatten().tolist() for s in range(ranks.shape[0]) for t in range(ranks.shape[-1])]
    group, _ = dist.new_subgroups_by_enumeration(columns)
    return group


def data_parallel_mesh(layout: Layout) -> Optional[Any]:
    """The (sub-)mesh FSDP2 shards and replicates over: 2-D (HSDP) with replicas, else the shard dimension."""
    if layout.mesh is None:
        return None
    if layout.cp > 1:  # the cp ranks hold the same parameters: FSDP2 shards over them too, as torchtitan does
        return layout.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if layout.dp_replicate > 1:
        return layout.submesh("dp_replicate", "dp_shard")
    return layout.submesh("dp_shard")
