"""Checkpoints for FSDP2 (and loading them at any world size).

An FSDP run holds each parameter in pieces, one per rank, so a checkpoint is written by every rank:
the model and optimizer shards go to ``sharded/`` with ``torch.distributed.checkpoint`` (DCP:
one file per rank plus a ``.metadata`` index). Beside them rank 0 writes what every torchrig
checkpoint holds: ``model.safetensors`` (the full weights, gathered once at save time, so
single-process ``evaluate`` / ``predict`` and plain ``load_state_dict`` work), ``state.pt``
(schedulers, counters, RNG; the optimizers live in ``sharded/``), ``config.yaml`` and
``meta.json``. The directory is renamed into place and ``latest`` swapped by rank 0 only after
every rank's shard is written, so ``latest`` never names a half-written checkpoint. With asynchronous
saves (``checkpoint.async_save``) the shards go through DCP's ``async_save`` into a temporary folder
and rank 0's writer thread moves them into the checkpoint once every rank's are written.

DCP reshards on load: a checkpoint written by 4 ranks loads into 2, into 1, or into a plain
(non-FSDP) model and optimizer; the keys are parameter names, not positions. The same holds across
layouts: a tensor-parallel or FSDP2 × TP checkpoint loads into one process or under DDP, and a plain
checkpoint (one process, DDP) loads into a split model, its optimizer state (saved by position) renamed
to the parameters' names and cut into the new pieces by ``set_optimizer_state_dict``. Every rank must be
able to read and write the run directory (a shared file system when the ranks are on several machines).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import runtime
from .io import CheckpointError, check_keys, load_weights_file, read_meta, trainable_state
from .layout import checkpoint_name, weight_files


SHARDS = "sharded"


def _dsd():
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:  # pragma: no cover - torch < 2.2
        raise CheckpointError(f"sharded checkpoints need torch.distributed.checkpoint (torch >= 2.2), "
                              f"this is torch {torch.__version__}") from None
    return dsd


def _options(flat: bool, frozen_kept: bool = False) -> Any:
    """DCP's state-dict options. Pipeline stages hold different parameters, so each optimizer value is saved under
    its parameter's name (``state.<name>.exp_avg``, ``param_groups.<name>.lr``: ``flat``) rather than in lists by
    position, which every stage would write differently under the same key. ``frozen_kept``: the frozen parameters
    (an adapted model's base) are neither saved nor loaded."""
    dsd = _dsd()
    return dsd.StateDictOptions(flatten_optimizer_state_dict=flat, ignore_frozen_params=frozen_kept,
                                strict=not frozen_kept)


def _layout(meta: dict, pipeline: Any) -> dict:
    """What a sharded checkpoint's ``meta.json`` records beside ``sharded``: how its optimizer state is keyed."""
    return dict(meta, sharded=True, strategy=meta.get("strategy", "fsdp"),
                **({"optimizer_keys": "by_name"} if pipeline is not None else {}))


def _sharded_state(model: torch.nn.Module, optimizers: dict, flat: bool, frozen_kept: bool = False) -> dict[str, Any]:
    """Model and optimizer state as DCP wants it: DTensor shards under FSDP (a pipeline stage's own tensors), keyed
    by parameter name; ``flat`` (a pipeline's) the optimizer's values by parameter name too; ``frozen_kept``: the
    trainable parameters only."""
    dsd = _dsd()
    options = _options(flat, frozen_kept)
    return _plain_pieces({"model": dsd.get_model_state_dict(model, options=options),
                          "optim": {name: dsd.get_optimizer_state_dict(model, opt, options=options)
                                    for name, opt in optimizers.items()}})


def _plain_pieces(value: Any) -> Any:
    """``value`` (nested dicts and lists) with each DTensor whose local piece is a tensor subclass wrapping a plain
    tensor of its own shape and dtype (torchao's float8 weights under FSDP2, whose all-gather hooks cast to float8)
    as a DTensor of that plain tensor, sharing its memory. Such a wrapper holds no memory of its own: DCP's
    ``async_save`` stages it as a new empty plain tensor and writes those uninitialised bytes. Loads into the plain
    tensor land in the parameter itself."""
    if isinstance(value, dict):
        return {k: _plain_pieces(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_pieces(v) for v in value]
    local = getattr(value, "_local_tensor", None)
    if local is None or type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
        return value
    inner = getattr(local, local.__tensor_flatten__()[0][0])
    if type(inner) is not torch.Tensor or inner.shape != local.shape or inner.dtype != local.dtype:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride())


def full_weights(model: torch.nn.Module, pipeline: Any = None, frozen_kept: bool = False) -> dict[str, torch.Tensor]:
    """The whole model on rank 0 as plain CPU tensors (other ranks get ``{}``; ``frozen_kept``: its trainable
    parameters and buffers). Collective: every rank calls it.

    A pipeline stage holds plain tensors of its own part: the stages of rank 0's ``pipeline`` (its group) send
    theirs to rank 0."""
    group = pipeline
    if group is None:
        dsd = _dsd()
        return dsd.get_model_state_dict(model, options=dsd.StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen_kept))
    import torch.distributed as dist

    own = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()  # FSDP2 shards of the stages:
           for k, v in model.state_dict().items()}  # gathered over their data-parallel ranks (every rank takes part)
    if 0 not in dist.get_process_group_ranks(group):
        return {}  # another replica of the stages: rank 0's pipeline holds the same weights
    parts = runtime.gather_to_first(own, group)
    if parts is None:
        return {}
    whole: dict[str, torch.Tensor] = {}
    for part in parts:  # buffers of modules without parameters (every stage runs them) come from each: alike
        whole.update(part)
    return whole


def save(manager: Any, step: int, model: torch.nn.Module, optimizers: dict, others: dict,
         config: Optional[dict], meta: dict, metrics: Optional[dict] = None) -> Optional[Path]:
    """Write a checkpoint from every rank; returns its directory (on every rank)."""
    import torch.distributed.checkpoint as dcp

    kept = manager.trainable_only                         # an adapted model: its frozen base is not saved
    weights = full_weights(model, manager.pipeline, kept)  # collective: gathers the full tensors on rank 0
    shards = _sharded_state(model, optimizers, manager.pipeline is not None, kept)  # local: this rank's pieces
    state = {k: v.state_dict() for k, v in others.items()}  # collective (train metrics are summed over ranks)
    state["optimizers"] = {}                              # in sharded/, by parameter name

    files = weight_files(others)                          # collective: e.g. the EMA, gathered on rank 0
    if manager.async_save:
        return _save_async(manager, step, (weights, shards, state, files), config, meta, metrics)
    if not manager.writes:
        tmp = runtime.broadcast(None)                     # rank 0 names its temporary directory
        if not tmp:  # rank 0 failed before naming it (its own error says why)
            raise CheckpointError("rank 0 failed to start writing the checkpoint; see its log")
        dcp.save(shards, checkpoint_id=str(Path(tmp) / SHARDS))
        final_path = runtime.broadcast(None)              # rank 0 renamed it into place
        return Path(final_path) if final_path else None

    def write_shards(tmp: Path) -> None:
        runtime.broadcast(str(tmp))
        dcp.save(shards, checkpoint_id=str(tmp / SHARDS))  # returns once every rank's file is written

    meta = _layout(meta, manager.pipeline)
    path = None
    try:
        path = manager.write(step, weights, state, _plain(config), meta, metrics=metrics, extra_writer=write_shards,
                             files=files)
    finally:
        runtime.broadcast(str(path) if path is not None else "")
    return path


def _save_async(manager: Any, step: int, parts: tuple, config: Optional[dict], meta: dict,
                metrics: Optional[dict]) -> Path:
    """The shards through DCP's ``async_save`` (staged to host memory here, written by its thread over a
    gloo group of the checkpoints' own, so that training's collectives never meet them), into a
    temporary folder; rank 0's writer thread then writes the rest, waits for every shard, moves them
    into the checkpoint and publishes it. Returns the directory the checkpoint will have."""
    import os

    import torch.distributed.checkpoint as dcp

    from ..config.files import make_dir, make_temp_dir
    from .background import host_copy

    weights, shards, state, files = parts
    name = checkpoint_name(step)
    staging = ""
    if manager.writes:
        try:
            make_dir(manager.dir)  # DCP writes into a new folder of a real checkpoints folder, never through a link
            staging = str(make_temp_dir(manager.dir, f".tmp-shards-{name}-"))
        finally:
            runtime.broadcast(staging)                    # "" if the folder could not be made: every rank stops
    else:
        staging = runtime.broadcast(None)
        if not staging:
            raise CheckpointError("rank 0 failed to start writing the checkpoint; see its log")
    job = dcp.async_save(shards, checkpoint_id=staging, process_group=manager.checkpoint_group())
    if not manager.writes:
        manager.shard_job = (step, job)
        return manager.dir / name

    def move_shards(tmp: Path) -> None:
        job.result()                                      # every rank's shard written (DCP fails on all ranks)
        os.replace(staging, tmp / SHARDS)

    weights, state, files, metrics = host_copy((weights, state, files, metrics))
    manager.submit(manager.write, step, weights, state, _plain(config), _layout(meta, manager.pipeline),
                   metrics, extra_writer=move_shards, files=files)
    return manager.dir / name


def load_full_weights(model: torch.nn.Module, path: Path, verify: bool = True, pipeline: Any = None,
                      frozen_kept: bool = False) -> None:
    """The full weights of checkpoint ``path`` (``model.safetensors``) sharded into an FSDP2 model (a stage of
    ``pipeline`` takes its own part; ``frozen_kept``: the checkpoint holds what trains, the base stays)."""
    dsd = _dsd()
    full = load_weights_file(path, verify)
    own = trainable_state(model) if frozen_kept else model.state_dict()
    _check_keys(set(full), set(own), path, pipeline)
    if pipeline is not None:  # a pipeline stage takes its own part
        full = {k: v for k, v in full.items() if k in own}
    check_shapes({k: tuple(v.shape) for k, v in full.items()}, own, path)
    dsd.set_model_state_dict(model, full, options=dsd.StateDictOptions(full_state_dict=True, strict=not frozen_kept))


def load(model: torch.nn.Module, optimizers: dict, path: Path, print_fn: Callable[[str], None] = print,
         verify: bool = True, pipeline: Any = None, frozen_kept: bool = False) -> None:
    """Load model and optimizer state of checkpoint ``path``, at any world size (``pipeline``: the group of this
    rank's pipeline, whose stages each load their own part).

    With ``sharded/`` (an FSDP checkpoint) every rank reads the pieces it needs through DCP, for an
    FSDP model as for a plain one. Without it (a checkpoint from a DDP or single-process run loaded
    into FSDP) the full weights of ``model.safetensors`` are sharded into the model; optimizer state
    then comes from ``state.pt`` as usual.
    """
    dsd = _dsd()
    path = Path(path)
    if not (path / SHARDS).exists():
        load_full_weights(model, path, verify, pipeline, frozen_kept)
        return
    from . import safe_dcp

    try:
        saved = safe_dcp.read_metadata_file(path / SHARDS / ".metadata", verify).state_dict_metadata
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"sharded checkpoint '{path / SHARDS}' is unreadable ({exc}); use another "
                              f"checkpoint, or its model.safetensors for the weights alone") from None
    flat = read_meta(path).get("optimizer_keys") == "by_name"  # saved by a pipeline
    target = _sharded_state(model, optimizers, flat, frozen_kept)
    shapes = {k[len("model."):]: tuple(v.size) for k, v in saved.items() if k.startswith("model.") and hasattr(v, "size")}
    _check_keys({k[len("model."):] for k in saved if k.startswith("model.")}, set(target["model"]), path, pipeline)
    check_shapes(shapes, target["model"], path)
    missing_optim = [name for name in target["optim"] if not any(k.startswith(f"optim.{name}.") for k in saved)]
    for name in missing_optim:  # a different optimizer set-up: keep those fresh, say so
        print_fn(f"torchrig: checkpoint '{path}' has no state for optimizer '{name}'; it starts fresh")
        del target["optim"][name]
    try:
        with warnings.catch_warnings():  # one process loading shards is intended, not a mistake to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_dcp.load(target, path / SHARDS, no_dist=not runtime.is_initialized(), verify=verify)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"sharded checkpoint '{path / SHARDS}' does not fit this model or optimizer "
                              f"({str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__}); "
                              f"was it saved from a different model or optimizer?") from None
    options = _options(flat, frozen_kept)
    dsd.set_model_state_dict(model, target["model"], options=options)
    for name, opt in optimizers.items():
        if name in target["optim"]:
            dsd.set_optimizer_state_dict(model, opt, target["optim"][name], options=options)


def load_full_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> None:
    """An optimizer's plain ``state_dict()`` (from ``state.pt`` of a DDP or single-process run) into the optimizer of
    an FSDP2 model: its states keyed by parameter names, then sharded like the parameters (DCP's state-dict
    helpers), so momentum and Adam moments carry over to another layout."""
    if not saved.get("state"):  # no tensors (plain SGD): the hyperparameters alone, as any optimizer takes them
        opt.load_state_dict(saved)
        return
    sizes = [len(g["params"]) for g in opt.param_groups], [len(g["params"]) for g in saved["param_groups"]]
    if sizes[0] != sizes[1]:  # another model or optimizer set-up: said in one line, with the path, by the caller
        raise ValueError(f"its optimizer holds parameter groups of {sizes[1]} parameters, this run's {sizes[0]}")
    dsd = _dsd()
    names = {id(p): name for name, p in model.named_parameters()}
    groups, state = [], {}
    for mine, theirs in zip(opt.param_groups, saved["param_groups"]):
        fqns = [names[id(p)] for p in mine["params"]]
        for fqn, index in zip(fqns, theirs["params"]):
            if index in saved["state"]:
                state[fqn] = saved["state"][index]
        groups.append({**theirs, "params": fqns})
    dsd.set_optimizer_state_dict(model, opt, {"state": state, "param_groups": groups},
                                 options=dsd.StateDictOptions(full_state_dict=True))


def _plain(value: Any) -> Any:
    """The config as YAML-safe builtins (tuples become lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _check_keys(saved: set, expected: set, path: Path, pipeline: Any) -> None:
    """Every key of this rank's model in the checkpoint, and (but for a pipeline stage, which holds a part of the
    model) no other."""
    if pipeline is not None:
        saved = saved & expected
    check_keys(saved, expected, f"checkpoint '{path}'")


def check_shapes(saved: dict[str, tuple], model_state: dict[str, Any], path: Path) -> None:
    """One line naming the first parameter whose whole shape in the checkpoint differs from the model's (a split
    parameter's whole shape: a DTensor's ``shape`` is the global one, whatever the layout)."""
    for key in sorted(saved):
        own = model_state.get(key)
        if own is not None and hasattr(own, "shape") and tuple(own.shape) != tuple(saved[key]):
            raise CheckpointError(f"checkpoint '{path}' does not fit the model: parameter '{key}' has shape "
                                  f"{tuple(saved[key])} in the checkpoint and {tuple(own.shape)} in the model; "
                                  f"was it saved from a different model or config?")
