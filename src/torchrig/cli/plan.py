"""``torchrig plan CONFIG --nproc N --set parallel.tp=8 …``: a layout planned on one machine, before the launch.

A layout of 64 or 1,024 processes fails at its launch for reasons one process could have told: a degree that does
not divide the world size, a hidden size the tensor-parallel degree does not divide, more pipeline stages than
blocks, a global batch the data-parallel ranks cannot share; or it runs out of memory on the first step. The plan
builds CONFIG's model on the meta device (no memory, no weights) and, for one rank of every pipeline stage, the
layout the real run would build, on PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``:
every collective returns at once; torchtitan's dry runs use it the same way): the device mesh, the tensor-parallel
plan, the pipeline's cut, FSDP2's shards and the optimizer, through the same functions a run calls
(``parallel.build_layout``, ``parallel.split_pipeline`` / ``split_model``, ``trainer.build.build_optimizers``). Then it
prints per rank the bytes of weights, gradients and optimizer state (what the run's summary prints, from the local
pieces each rank holds), an estimate of the activations, the collectives of one optimizer step and their sizes, and
every error the launch would hit, each in its own line.

The activations are those autograd keeps for the backward in one forward of one micro-batch on the meta device
(``saved_tensors_hooks``, parameters left out, ``model.activation_checkpointing`` applied), in the autocast dtype,
divided by ``tp`` and, under a pipeline, scaled by the share of the model each stage holds and the micro-batches
it holds at once (all of a window's under gpipe, ``pp - stage`` under 1F1B): an estimate (norms and residual
streams are not split by ``tp``; the allocator's own overhead is not counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

from ..errors import TorchrigError
from . import add_common, register_command, run_args, set_arg

MAX_WORLD = 1 << 16


class PlanError(TorchrigError, ValueError):
    """A plan that cannot be made as asked; the message says what to change."""


@dataclasses.dataclass
class Stage:
    """What one rank of a pipeline stage (every rank without a pipeline) holds."""

    index: int
    ranks: list
    memory: dict                 # summary.memory_figures: weights, gradients, optimizer, ema, total
    activations: Optional[float] = None
    in_flight: int = 1


@dataclasses.dataclass
class Planned:
    world: int
    layout: str = ""
    strategy: str = ""
    model: str = ""
    parameters: int = 0
    micro: int = 0                # rows per micro-batch, per process
    micro_batches: int = 1        # micro-batches per optimizer step, per process
    stages: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    built: Any = None             # the layout of stage 1's first rank (parallel.Layout)


# ----------------------------------------------------------------------------- the fake world


@contextlib.contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """This process as ``rank`` of ``world`` on PyTorch's fake process group, for the block."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise PlanError("torchrig plan runs in one plain process (it makes a fake process group of its own); run it "
                        "without torchrig launch or torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_model(recipe: Any, cfg: Any) -> Any:
    import torch

    from ..recipes import factory

    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        return factory.build_model(recipe, cfg)


def _errors(out: list, exc: BaseException) -> None:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text if isinstance(exc, TorchrigError) else f"{type(exc).__name__}: {text}"
    if text not in out:
        out.append(text)


# ----------------------------------------------------------------------------- one stage's rank


def stage_rank(stage: int, world: int, pp: int) -> int:
    """The global rank of the first rank of pipeline stage ``stage`` (``pp`` is the mesh's outermost dimension)."""
    return stage * (world // pp)


def plan_stage(cfg: Any, recipe: Any, world: int, rank: int, run: Any, errors: list) -> tuple[Any, dict]:
    """(the layout, memory figures) of ``rank`` of ``world``: the run's own split and optimizer, on the meta
    device and the fake process group; an error that leaves the layout whole joins ``errors``."""
    import torch

    from .. import parallel, runtime
    from ..observe.summary import memory_figures
    from ..trainer import build

    meta, host = torch.device("meta"), torch.device("cpu")
    dtype = runtime.make_precision(cfg.precision, host).dtype
    with fake_group(rank, world):
        model = _meta_model(recipe, cfg)
        runtime.apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
        layout = parallel.build_layout(cfg.parallel, cfg.dist.strategy, world, host)
        if layout.pp > 1:
            model = parallel.split_pipeline(model, layout, cfg.parallel, meta)
            try:
                layout.pipeline.check_microbatches(run.micro_batches_per_window, "accumulate")
            except TorchrigError as exc:
                _errors(errors, exc)
        if layout.mesh is not None:
            parallel.split_model(model, layout, cfg, meta, dtype)
        elif layout.strategy == "fsdp":
            parallel.wrap_model(model, "fsdp", meta, cfg.dist, dtype)
        optimizers = build.build_optimizers(cfg.optim.name, model, cfg, layout.strategy, meta, split=layout.sharded)
        return layout, memory_figures(model, optimizers, ema=bool(getattr(cfg, "ema_decay", None)))


# ----------------------------------------------------------------------------- activations and messages


def _bytes_of(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_bytes_of(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes_of(o) for o in obj.values())
    return sum(_bytes_of(v) for v in getattr(obj, "__dict__", {}).values()) if hasattr(obj, "to_tuple") else 0


def forward_bytes(cfg: Any, recipe: Any, micro: int, watched: list) -> tuple[float, dict]:
    """(bytes autograd keeps for one micro-batch of ``micro`` rows, {module name: (input, output) bytes} of the
    ``watched`` modules) from one forward of the unsplit model on the meta device."""
    import torch

    from .. import runtime
    from ..data import prepare_train, to_device
    from ..recipes import factory
    from ..trainer.outputs import ModelIO
    from ..trainer.step import ModelCalls

    model = _meta_model(recipe, cfg)
    if getattr(getattr(model, "config", None), "use_cache", None) is False:
        # without a cache transformers reads the position ids to find packed documents, a data-dependent read the
        # meta device cannot make; the cache holds only keys and values that autograd keeps anyway
        model.config.use_cache = True
    runtime.apply_activation_checkpointing(model, cfg.model.activation_checkpointing)
    half = runtime.make_precision(cfg.precision, torch.device("cpu")).dtype
    batches = prepare_train(factory.build_data(recipe, cfg)["train"], batch_size=micro, seed=cfg.seed, rank=0,
                            world_size=1, device=torch.device("cpu"), num_workers=0, shuffle=False)
    batches.set_epoch(0)
    batch = to_device(next(iter(batches)), torch.device("meta"))
    calls = ModelCalls(model, runtime.make_precision("fp32", torch.device("cpu")), torch.device("meta"),
                       io=ModelIO.from_config(cfg))
    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        if id(t) not in params and id(getattr(t, "_base", None)) not in params:
            scale = 2 if half is not None and t.is_floating_point() and t.element_size() == 4 else 1
            saved[id(t)] = t.numel() * t.element_size() // scale
        return t

    sizes: dict[str, tuple] = {}
    hooks = [dict(model.named_modules())[n].register_forward_hook(
        lambda m, a, o, n=n: sizes.__setitem__(n, (_bytes_of(a), _bytes_of(o)))) for n in watched]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs, _ = calls.split(batch)
            calls.forward(inputs)
    finally:
        for h in hooks:
            h.remove()
    return float(sum(saved.values())), sizes


def in_flight(schedule: str, stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once: every one of a window's under gpipe, ``pp - stage``
    (from 0) under the 1F1B family."""
    return micro_batches if schedule == "gpipe" else max(1, min(micro_batches, pp - stage))


# ----------------------------------------------------------------------------- collectives


def collectives(p: Planned, cfg: Any, layout: Any, memory: dict, tp_sizes: dict, boundaries: list) -> list:
    """(what, count per optimizer step, bytes each, over how many ranks) of the collectives of one rank of the
    first stage in one optimizer step."""
    from ..observe.summary import size

    out, m = [], p.micro_batches
    shards = layout.dp_shard * layout.cp  # FSDP2 shards over (dp_shard, cp): the cp ranks hold the same parameters
    full = memory["weights"] * (shards if layout.strategy == "fsdp" else 1)  # this stage's, unsharded
    grads = memory["gradients"] * (shards if layout.strategy == "fsdp" else 1)
    if layout.strategy == "ddp" and layout.dp * layout.cp > 1:
        bucket = (cfg.dist.bucket_cap_mb or 25) * 2 ** 20
        out.append(("gradient all_reduce (DDP buckets)", max(1, -(-grads // bucket)), min(grads, bucket),
                    layout.dp * layout.cp))
    if layout.strategy == "fsdp" and shards > 1:
        again = 2 if cfg.dist.fsdp_reshard_after_forward else 1
        out.append(("parameter all_gather (FSDP2, forward" + (" and backward)" if again == 2 else ")"), again * m, full,
                    shards))
        out.append(("gradient reduce_scatter (FSDP2)", 1, grads, shards))
        if layout.dp_replicate > 1:
            out.append(("gradient all_reduce over replicas (HSDP)", 1, grads // shards, layout.dp_replicate))
    rows = [s for n, s in tp_sizes.items() if layout.plan.get(n, "").startswith("rowwise")]
    cols = [s for n, s in tp_sizes.items() if layout.plan.get(n, "").startswith("colwise")]
    if layout.tp > 1 and rows:
        out.append((f"activation all_reduce ({len(rows)} rowwise layer(s), forward)", m * len(rows),
                    max(o for _, o in rows), layout.tp))
    if layout.tp > 1 and cols:
        out.append((f"input-gradient all_reduce ({len(cols)} colwise layer(s), backward)", m * len(cols),
                    max(i for i, _ in cols), layout.tp))
    for k, b in enumerate(boundaries):
        out.append((f"activation send/recv, stage {k + 1} → {k + 2} (forward; its gradient back)", 2 * m, b, 2))
    out.append(("loss count, stop agreement, gradient norm (torchrig)", 3, 8, p.world))
    return [f"{what}: {n} × {size(b)} over {ranks} ranks" for what, n, b, ranks in out]


# ----------------------------------------------------------------------------- the plan


def plan(cfg: Any, world: int) -> Planned:
    """The plan of ``cfg`` on ``world`` processes; errors the launch would hit are collected, not raised."""
    from .. import parallel
    from ..recipes import get_recipe
    from ..trainer.plan import RunPlan

    if not 1 <= world <= MAX_WORLD:
        raise PlanError(f"--nproc {world}: give the job's processes in all, 1 … {MAX_WORLD}")
    p = Planned(world)
    recipe = get_recipe(cfg.recipe)
    _split_checks(p, cfg, recipe)
    try:
        degrees = parallel.resolve_degrees(cfg.parallel, cfg.dist.strategy, world)
    except TorchrigError as exc:
        _errors(p.errors, exc)
        return p
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    run = RunPlan.derive(cfg, dp, world, pipelined=degrees["pp"] > 1)
    p.micro = run.micro_batch_size if isinstance(run.micro_batch_size, int) else run.batch_size
    p.micro_batches = run.micro_batches_per_window
    _stages(p, cfg, recipe, run, degrees)
    if p.stages:
        _activations(p, cfg, recipe, degrees)
    return p


def _split_checks(p: Planned, cfg: Any, recipe: Any) -> None:
    """The checks of the model's split that need no world size: the tensor-parallel plan against the model's sizes,
    the pipeline's cut against its blocks (so that a wrong world size does not hide them)."""
    from .. import parallel

    c = cfg.parallel
    checks = [lambda m: parallel.tensor_parallel.resolve(m, c.tp_plan, c.tp)] if c.tp > 1 else []
    if c.pp > 1:
        checks.append(lambda m: parallel.plan_stages(m, c.pp_split, c.pp * c.pp_stages_per_rank))
    for check in checks:
        try:
            check(_meta_model(recipe, cfg))
        except (TorchrigError, ValueError) as exc:
            _errors(p.errors, exc)


def _stages(p: Planned, cfg: Any, recipe: Any, run: Any, degrees: dict) -> None:
    pp, per = degrees["pp"], cfg.parallel.pp_stages_per_rank if degrees["pp"] > 1 else 1
    for stage in range(pp):
        rank = stage_rank(stage, p.world, pp)
        try:
            layout, memory = plan_stage(cfg, recipe, p.world, rank, run, p.errors)
        except (TorchrigError, ValueError, RuntimeError, TypeError) as exc:
            _errors(p.errors, exc)
            return
        ranks = [r for r in range(p.world) if r // (p.world // pp) == stage]
        p.stages.append(Stage(stage, ranks, memory))
        p.layout, p.strategy = layout.describe(), layout.strategy
        p.built = p.built or layout
    if per > 1:
        p.notes.append(f"{per} stages per rank (parallel.pp_stages_per_rank): each row is one rank's, all its stages")


def _activations(p: Planned, cfg: Any, recipe: Any, degrees: dict) -> None:
    from .. import parallel

    layout = p.built
    pp, tp = degrees["pp"], degrees["tp"]
    model = _meta_model(recipe, cfg)
    p.model, p.parameters = type(model).__name__, sum(t.numel() for t in model.parameters())
    cut = parallel.plan_stages(model, cfg.parallel.pp_split, pp * cfg.parallel.pp_stages_per_rank) if pp > 1 else None
    ends = [cut.block_name(hi - 1) for _, hi in cut.ranges[:-1]] if cut is not None else []
    try:
        total, sizes = forward_bytes(cfg, recipe, p.micro, [*layout.plan, *ends])
    except Exception as exc:  # a forward the meta device cannot run, data that cannot be read here
        p.notes.append(f"activations not estimated: a forward on the meta device failed ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:160] if str(exc) else ''})")
        p.collectives = collectives(p, cfg, layout, p.stages[0].memory, {}, [])
        return
    held = sum(s.memory["weights"] for s in p.stages) or 1
    for s in p.stages:
        share = s.memory["weights"] / held if pp > 1 else 1.0
        s.in_flight = in_flight(cfg.parallel.pp_schedule, s.index, pp, p.micro_batches) if pp > 1 else 1
        s.activations = total * share * s.in_flight / tp / layout.cp  # a cp rank holds its share of the sequence
    tp_sizes = {n: sizes[n] for n in layout.plan if n in sizes}
    if layout.cp > 1:
        p.notes.append(f"parallel.cp={layout.cp}: the ring attention's exchange of each attention layer's keys and "
                       f"values over the {layout.cp} cp ranks is not listed")
    p.collectives = collectives(p, cfg, layout, p.stages[0].memory, tp_sizes, [sizes[e][1] for e in ends if e in sizes])


# ----------------------------------------------------------------------------- the report


def report(p: Planned) -> str:
    from ..runtime.hang import ranks_text
    from ..observe.summary import size

    head = f"torchrig plan: {p.world} processes · " + (f"{p.layout} · strategy {p.strategy}" if p.layout else
                                                        "no layout built (see the errors)")
    if p.model:
        head += f" · {p.model}, {p.parameters:,} parameters · micro-batch {p.micro} × {p.micro_batches} per step"
    lines = [head]
    if p.stages:
        lines.append("per rank:")
    for s in p.stages:
        m = s.memory
        state = f"{m['optimizer_name']} state {size(m['optimizer'])}" if m["optimizer"] is not None else \
            f"{m['optimizer_name']} state not known"
        act = "activations not estimated" if s.activations is None else \
            f"activations ≈ {size(s.activations)}" + (f" ({s.in_flight} micro-batches in flight)" if s.in_flight > 1 else "")
        total = m["total"] + (s.activations or 0)
        where = f"stage {s.index + 1}, " if len(p.stages) > 1 else ""
        lines.append(f"  {where}{ranks_text(s.ranks)}: weights {size(m['weights'])} · gradients {size(m['gradients'])}"
                     f" · {state}" + (f" · EMA {size(m['ema'])}" if m["ema"] else "") + f" · {act} · total ≈ {size(total)}")
    if p.collectives:
        lines.append("collectives per optimizer step and rank (a pipeline's tensor-parallel layers are spread over "
                     "its stages):")
        lines += [f"  {c}" for c in p.collectives]
    lines += [f"note: {n}" for n in p.notes]
    lines.append("errors the launch would hit: " + ("none" if not p.errors else f"{len(p.errors)}"))
    lines += [f"  - {e}" for e in p.errors]
    return "\n".join(lines)


def cmd_plan(args: Any) -> int:
    from ..recipes.run import build_config

    factories = [f"{key}={spec}" for key, spec in (("model.factory", args.model), ("data.factory", args.data)) if spec]
    cfg = build_config(args.config, args.overrides + factories, args.recipe)
    p = plan(cfg, args.nproc)
    print(report(p))
    return 1 if p.errors else 0


@register_command
def _add(sub: Any) -> None:
    parser = sub.add_parser("plan", help="plan a layout of N processes on this machine: memory per rank, collectives, "
                                         "errors the launch would hit",
                            description="Build CONFIG's model on the meta device and its layout on PyTorch's fake "
                                        "process group, as a run of --nproc processes would, and print per rank the "
                                        "weights, gradients, optimizer state and estimated activations, the "
                                        "collectives of one optimizer step and their sizes, and every error the "
                                        "launch would hit. Nothing is trained; no GPU is needed.")
    parser.add_argument("config", nargs="?", help="YAML config file (optional: the default digits job)")
    parser.add_argument("--nproc", type=int, required=True, metavar="N",
                        help="processes of the job in all (every machine's --nproc-per-node together)")
    run_args(parser)
    set_arg(parser)
    add_common(parser)
    parser.set_defaults(handler=cmd_plan)
