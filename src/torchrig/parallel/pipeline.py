"""Pipeline parallelism: the user's model cut into stages at its blocks, run by ``torch.distributed.pipelining``.

The model is not rewritten and not traced. Its **blocks** are the top-level sequence the forward calls one after
another: the model itself when it is an ``nn.Sequential``, else its longest ``nn.ModuleList`` / ``nn.Sequential``
(not one inside a block: a block's own ``mlp`` Sequential never competes)
(``transformer.h`` of a Hugging Face GPT-2, ``model.layers`` of a Llama, ``blocks`` of your own). Stage ``k``
owns a run of consecutive blocks (``parallel.pp_split`` names where stages 2, 3, ... begin; ``auto`` balances
the parameter counts), the first stage also what the forward calls before the blocks (embeddings), the last
what it calls after them (final norm, head, loss). Every rank keeps the user's own module object and deletes what
its stages do not own, so its ``state_dict()`` has the whole model's names (``transformer.h.6.attn.c_attn.weight``)
for the parts it holds: DCP checkpoints and the consolidated ``model.safetensors`` are the whole model's.

Each stage runs **the model's own forward** on the micro-batch (every rank of a pipeline loads the same batches):

* the blocks container iterates only the stage's blocks (the others are out of its ``_modules``);
* on a stage after the first, a forward pre-hook on its first block replaces that block's first positional
  argument with the activation received from the previous stage; the modules around the blocks that the running
  stage does not own answer with zeros of the shape they would give (their outputs only feed what that hook
  replaces), those of the rank's other stages too while it runs (with several stages per rank: the embedding of
  stage 1 is not computed again for stage 3, and under FSDP2 it is stage 1's shards, not gathered for stage 3);
* on a stage before the last, a forward hook on its last block stops the forward there, and that block's output
  (or the first element of a tuple output) is sent on.

How the forward stops is the one place where control flow goes by an exception, because the code after the last
block is the user's and cannot be skipped otherwise: the hook raises :class:`StageOutput` (a ``BaseException``,
so that an ``except Exception`` in the model's own code does not catch it), which :meth:`Pipeline.run_stage`
catches right around the forward call and turns into the stage's output. Any other error raised inside a stage
(the user's code, a block's own forward) comes out as :class:`PipelineStageError`, one line naming the stage, the
rank and the block that was running, with the original error chained.

So the supported forwards are: ``pre-code → block_0 → block_1 → … → block_n-1 → post-code``, where each block's
first positional argument is the previous block's output (or its first element), other block arguments (masks,
position embeddings, flags) are computed in the pre-code from the inputs alone, and the post-code reads only the
last block's output and the inputs (labels). On each stage's first training step the autograd graph of its output
is checked: anything it depends on other than the stage's own parameters and the received activation (a value of
a module another stage owns, an operation between two blocks) is refused in one line, so a forward of another
shape fails at once instead of training something else. Parameters shared by two stages (tied input and output
embeddings) are refused when the stages are built.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import TorchrigError, suggest
from ..runtime.modules import longest_blocks
from .errors import ParallelConfigError
from .tp import out_of_place

KEY = "parallel.pp_split"
CACHED_SCHEDULES = 4  # schedules (with their receive buffers) kept for micro-batch shapes seen lately


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch of a window: ``batch`` as loaded (the schedule is chosen by its tensors' shapes), its
    ``index`` in the window, and whatever the forward function needs (``data``)."""

    batch: Any
    index: int
    data: Any = None


class StageOutput(BaseException):
    """Raised by a stage's last block to end the model's forward there; carries the tensor to send on. Not an
    ``Exception``: an ``except Exception`` in the model's own code must not catch it. Caught by
    :meth:`Pipeline.run_stage` around the forward call and never seen outside it."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage output")
        self.hidden = hidden


class PipelineStageError(TorchrigError, RuntimeError):
    """An error raised inside a pipeline stage's forward, named by stage, rank and block (the original chained)."""


# ---------------------------------------------------------------------------------------------- the split
@dataclasses.dataclass
class Unit:
    """A module (or an ancestor's own parameter) outside the blocks, owned by the first or the last stage."""

    name: str
    parent: nn.Module
    attr: str
    value: Any             # the nn.Module, or the nn.Parameter of an ancestor
    pre: bool              # called before the blocks (first stage) or after them (last stage)


@dataclasses.dataclass
class Plan:
    """Where the model is cut: the blocks container, each stage's block range, the modules around the blocks."""

    container_name: str
    container: nn.Module
    keys: list            # the container's child names, in order (block i is container._modules[keys[i]])
    ranges: list          # [(lo, hi)] block indices of each stage
    units: list           # [Unit]

    def block_name(self, i: int) -> str:
        return f"{self.container_name}.{self.keys[i]}" if self.container_name else self.keys[i]

    def describe(self) -> str:
        return ", ".join(f"stage {k + 1}: {self.block_name(lo)}" + (f"…{self.keys[hi - 1]}" if hi - lo > 1 else "")
                         for k, (lo, hi) in enumerate(self.ranges))


def find_blocks(model: nn.Module) -> tuple[str, nn.Module]:
    """The model's top-level sequence of blocks: the model itself (an ``nn.Sequential``), else its longest
    ``nn.ModuleList`` / ``nn.Sequential`` not inside another one (the first of equal length)."""
    best = longest_blocks(model)
    if best is None:
        raise ParallelConfigError(
            f"config key 'parallel.pp': {type(model).__name__} has no sequence of blocks to cut into stages (the "
            f"model an nn.Sequential, or an nn.ModuleList of blocks its forward calls one after another); use "
            f"parallel.tp or dist.strategy=fsdp for this model")
    return best


def plan_stages(model: nn.Module, split: Any, stages: int) -> Plan:
    """Cut ``model`` into ``stages`` stages: at the blocks ``split`` names, or balanced by parameter count
    (``auto``). Every bad split is one line naming ``parallel.pp_split`` (or ``parallel.pp``)."""
    if split == "auto":
        name, container = find_blocks(model)
    else:
        name, container = _container_of(model, list(split), stages)
    keys = list(container._modules)
    n = len(keys)
    pre, post = _units(model, name, container)
    if stages > n:
        raise ParallelConfigError(
            f"config key 'parallel.pp': {_stages_text(stages)}, but {type(model).__name__}"
            f"{' ' + repr(name) if name else ''} has {n} blocks; a stage needs one at least: lower parallel.pp "
            f"(or parallel.pp_stages_per_rank)")
    if split == "auto":
        weights = [_numel(container._modules[k]) for k in keys]
        starts = _balanced(weights, stages, sum(_numel(u.value) for u in pre), sum(_numel(u.value) for u in post))
    else:
        starts = [keys.index(s.rpartition(".")[2]) for s in split]
    bounds = [0, *starts, n]
    plan = Plan(name, container, keys, [(bounds[k], bounds[k + 1]) for k in range(stages)], pre + post)
    _check_tied(model, plan)
    return plan


def _stages_text(stages: int) -> str:
    return f"{stages} stage{'s' if stages != 1 else ''}"


def _container_of(model: nn.Module, names: list, stages: int) -> tuple[str, nn.Module]:
    """The blocks container of the ``parallel.pp_split`` names (their common parent), every name checked."""
    if len(names) != stages - 1:
        raise ParallelConfigError(
            f"config key '{KEY}': {len(names)} name{'s' if len(names) != 1 else ''} ({', '.join(names)}) begin "
            f"{len(names) + 1} stages, but the pipeline has {_stages_text(stages)} (parallel.pp × "
            f"parallel.pp_stages_per_rank); give {stages - 1}, the first block of stages 2 to {stages}, or auto")
    modules = dict(model.named_modules())
    blocks = [n for n in modules if n and isinstance(modules.get(n.rpartition(".")[0]), (nn.ModuleList, nn.Sequential))]
    parent = None
    for s in names:
        if s not in blocks:
            what = "is not a module of" if s not in modules else "is not a block (a child of an nn.ModuleList or " \
                                                                 "nn.Sequential) of"
            hint = suggest(s, blocks, n=3)
            more = " …" if len(blocks) > 4 else ""
            listing = "" if hint or not blocks else f". Blocks: {', '.join(blocks[:4])}{more}"
            raise ParallelConfigError(f"config key '{KEY}': {s!r} {what} {type(model).__name__}{hint}{listing}")
        if parent is not None and s.rpartition(".")[0] != parent:
            raise ParallelConfigError(f"config key '{KEY}': {s!r} is not in {parent or 'the model'!r} like "
                                      f"{names[0]!r}; the stages begin at blocks of one sequence")
        parent = s.rpartition(".")[0]
    container = modules[parent]
    keys = list(container._modules)
    order = [keys.index(s.rpartition(".")[2]) for s in names]
    if order[0] == 0 or any(b <= a for a, b in zip(order, order[1:])):
        raise ParallelConfigError(f"config key '{KEY}': {', '.join(names)} must be blocks after the first, in "
                                  f"increasing order (each begins a stage; stage 1 begins at "
                                  f"{parent + '.' if parent else ''}{keys[0]})")
    return parent, container


def _units(model: nn.Module, name: str, container: nn.Module) -> tuple[list, list]:
    """The modules with parameters outside the blocks, before them (declared before the path to the blocks) or
    after, and the parameters the path's modules hold themselves (counted with the first stage)."""
    pre: list = []
    post: list = []
    path = name.split(".") if name else []
    node, prefix = model, ""
    for step in [*path, None]:
        for pname, p in node.named_parameters(recurse=False):
            pre.append(Unit(prefix + pname, node, pname, p, True))
        if step is None:
            break
        before = True
        for cname, child in node.named_children():
            if cname == step:
                before = False
                continue
            if any(True for _ in child.parameters()):
                (pre if before else post).append(Unit(prefix + cname, node, cname, child, before))
        node, prefix = node._modules[step], f"{prefix}{step}."
    return pre, post


def _numel(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    return sum(p.numel() for p in obj.parameters())


def _balanced(weights: list, stages: int, first: int, last: int) -> list:
    """Where stages 2.. begin, so that the largest stage (its blocks' parameters, plus ``first`` on the first stage
    and ``last`` on the last) is as small as it can be; contiguous, every stage one block at least."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(k: int, lo: int, hi: int) -> int:
        return prefix[hi] - prefix[lo] + (first if k == 0 else 0) + (last if k == stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: the first i blocks in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _check_tied(model: nn.Module, plan: Plan) -> None:
    """One parameter held by two stages (tied input and output embeddings) cannot be: each stage would train its
    own copy. Refused in one line naming both places."""
    owner: dict = {}
    stages = len(plan.ranges)
    for k, (lo, hi) in enumerate(plan.ranges):
        for i in range(lo, hi):
            block = plan.container._modules[plan.keys[i]]
            for pname, p in block.named_parameters(remove_duplicate=False):
                owner.setdefault(id(p), []).append((k, f"{plan.block_name(i)}.{pname}"))
    for u in plan.units:
        k = 0 if u.pre else stages - 1
        named = ([("", u.value)] if isinstance(u.value, torch.Tensor)
                 else u.value.named_parameters(remove_duplicate=False))
        for pname, p in named:
            owner.setdefault(id(p), []).append((k, u.name + (f".{pname}" if pname else "")))
    for places in owner.values():
        if len({k for k, _ in places}) > 1:
            (k1, a), (k2, b) = places[0], next(p for p in places if p[0] != places[0][0])
            raise ParallelConfigError(
                f"config key 'parallel.pp': {a} (stage {k1 + 1}) and {b} (stage {k2 + 1}) are one tied parameter; "
                f"stages cannot share a parameter: untie it (a Hugging Face config: tie_word_embeddings=False) or "
                f"keep both in one stage with {KEY}")


# ---------------------------------------------------------------------------------------------- the stages
def stages_of_rank(rank: int, pp: int, per_rank: int, v_shape: bool) -> list[int]:
    """The stage indices rank ``rank`` of ``pp`` holds: ``rank, rank + pp, …`` (loop), or ``rank`` and
    ``2·pp − 1 − rank`` (a V, ``zbv_zero_bubble``), as ``torch.distributed.pipelining`` maps them."""
    if v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


class _Elsewhere(nn.Module):
    """Stands in for a module another stage owns: no parameters; it returns zeros of the shape, dtype and device
    the module would give (worked out on a parameter-free copy on the meta device, without the module's forward
    hooks)."""

    summary_kind = "(other stage)"  # in the model summary's table

    def __init__(self, pipe: "Pipeline", name: str, module: nn.Module):
        super().__init__()
        memo: dict = {}
        for t in [*module.parameters(), *module.buffers()]:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        meta = copy.deepcopy(module, memo)
        for m in meta.modules():  # the module's hooks are for its real calls (they may read values)
            for hooks in (m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs,
                          m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called):
                hooks.clear()
        object.__setattr__(self, "_meta", meta)
        object.__setattr__(self, "_pipe", pipe)
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._pipe
        meta = self._meta(*_to_meta(args), **_to_meta(kwargs))
        return _tree_map(lambda t: pipe.placeholder(self.name, t), meta)

    def extra_repr(self) -> str:
        return f"{self.name}: held by another pipeline stage"


def _ancestors(name: str) -> list:
    """``a.b.c`` → ``[a.b.c, a.b, a]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _to_meta(obj: Any) -> Any:
    return _tree_map(lambda t: t.to("meta"), obj)


def _tree_map(fn: Callable, obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _tree_map(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_tree_map(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree_map(fn, v) for v in obj)
    return obj


def _tensors(obj: Any) -> list:
    out: list = []
    _tree_map(out.append, obj)
    return out


class StageModule(nn.Module):
    """One stage, as ``PipelineStage`` runs it: its parameters registered here (blocks, and on the first / last
    stage the modules before / after them), its forward the model's own (see the module's text)."""

    def __init__(self, pipe: "Pipeline", index: int, lo: int, hi: int, parts: list, own_params: list):
        super().__init__()
        self.index, self.lo, self.hi = index, lo, hi
        self.parts = nn.ModuleList(parts)
        self.own = nn.ParameterList(own_params)  # an ancestor's own parameters (first stage)
        object.__setattr__(self, "_pipe", pipe)
        self.first, self.last = index == 0, index == pipe.num_stages - 1
        self.received: Optional[torch.Tensor] = None
        self.checked = False  # the first training forward checks the stage's graph

    def forward(self, *received: torch.Tensor, mb: Any = None) -> Any:
        return self._pipe.run_stage(self, received, mb)


class Pipeline:
    """This rank's stages of the model (``parallel.pp``) and the schedules that run them.

    ``model`` is the user's module with only this rank's parts left (what the loop, the optimizer and checkpoints
    see). :meth:`train` and :meth:`forward` take ``forward_fn(model, micro_batch)``: it calls the model on a
    micro-batch and, on the last stage, returns the tensor to back-propagate (training) or any tensor (inference).
    """

    def __init__(self, model: nn.Module, plan: Plan, *, rank: int, pp: int, per_rank: int, schedule: str,
                 group: Any, device: torch.device):
        self.model, self.plan, self.device, self.group = model, plan, device, group
        self.whole_parameters = sum(p.numel() for p in model.parameters())  # the whole model's, before the cut
        self.schedule_name = schedule
        self.num_stages = len(plan.ranges)
        self.v_shape = schedule == "zbv_zero_bubble"
        self.single = schedule in ("gpipe", "1f1b")
        self.splits_backward = schedule in ("interleaved_zero_bubble", "zbv_zero_bubble")  # input, then weights
        self._forward_fn: Optional[Callable[[nn.Module, Any], Any]] = None  # during train() / forward()
        self.active: Optional[StageModule] = None
        self._block: Optional[int] = None  # the block running in the active stage (for an error's message)
        self._done: Optional[int] = None   # the block that ran last in it
        self._leaves: Optional[dict] = None  # while a stage's first training forward runs: placeholder leaves
        self._last_output: Any = None  # the output of the block that ran last in the stage's forward
        self._schedules: collections.OrderedDict = collections.OrderedDict()
        self._target = torch.zeros((), device=device)  # the schedules' loss gets the stage's output as it is
        # while a schedule's first step runs: the micro-batch it runs once more first, to learn the stages' shapes
        # (torch.distributed.pipelining's metadata inference, a real forward and backward whose values count for
        # nothing); None otherwise
        self.rehearsal: Optional[int] = None
        ids = stages_of_rank(rank, pp, per_rank, self.v_shape)
        self.rank_of = {k: r for r in range(pp) for k in stages_of_rank(r, pp, per_rank, self.v_shape)}
        self.last_rank = self.rank_of[self.num_stages - 1]  # the pipeline rank of the last stage
        last = self.num_stages - 1
        container = plan.container
        owned = {i for k in ids for i in range(*plan.ranges[k])}
        blocks = {i: container._modules[plan.keys[i]] for i in range(len(plan.keys))}
        self.block_index = {id(blocks[i]): i for i in owned}
        self.stages = []
        for k in ids:
            lo, hi = plan.ranges[k]
            units = [u for u in plan.units if (u.pre and k == 0) or (not u.pre and k == last)]
            self.stages.append(StageModule(self, k, lo, hi, [blocks[i] for i in range(lo, hi)]
                                           + [u.value for u in units if isinstance(u.value, nn.Module)],
                                           [u.value for u in units if not isinstance(u.value, nn.Module)]))
        # what this rank holds: its blocks, and the modules around them its stages own; the rest is let go
        self.rest_view = {plan.keys[i]: blocks[i] for i in sorted(owned)}
        self.views = {st.index: {plan.keys[i]: blocks[i] for i in range(st.lo, st.hi)} for st in self.stages}
        object.__setattr__(container, "_modules", self.rest_view)
        self.swaps = self._stand_ins(plan, ids, device)  # stage -> [(parent, attr, stand-in, the module)]
        for i in owned:
            blocks[i].register_forward_pre_hook(self._enter_block, with_kwargs=True)
        for st in self.stages:  # the activation a stage receives is a leaf, which autograd keeps unchanged: an
            if not st.first:    # in-place ReLU (nn.ReLU(inplace=True)) beginning the stage computes out of place
                out_of_place(blocks[st.lo])
        self._owned = [blocks[i] for i in sorted(owned)]  # their forward hooks: at the first run (_hook_outputs)

    def _stand_ins(self, plan: Plan, ids: list, device: torch.device) -> dict:
        """Stand-ins for the modules around the blocks that this rank's stages do not own: set in their place, or
        swapped in while another stage of this rank runs; returns the swaps per stage."""
        # the modules around the blocks a stage does not own answer as stand-ins while it runs, those of this rank's
        # other stages too (under FSDP2 they are another stage's shards, and their outputs are not used anyway)
        swaps: dict = {st.index: [] for st in self.stages}
        last = self.num_stages - 1
        for u in plan.units:
            if not isinstance(u.value, nn.Module):
                if not ((0 in ids) if u.pre else (last in ids)):  # an ancestor's own parameter another rank holds:
                    # a plain zero tensor of its shape (not trained, not saved here)
                    del u.parent._parameters[u.attr]
                    object.__setattr__(u.parent, u.attr,
                                       torch.zeros_like(u.value, device=device).requires_grad_(False))
                continue
            stand_in = _Elsewhere(self, u.name, u.value)
            if not ((0 in ids) if u.pre else (last in ids)):
                setattr(u.parent, u.attr, stand_in)
                continue
            for st in self.stages:
                if not (st.first if u.pre else st.last):
                    swaps[st.index].append((u.parent, u.attr, stand_in, u.value))
        return swaps

    def held(self, plan: dict) -> dict:
        """The entries of ``plan`` (``{module name: value}`` over the whole model) for the modules this rank's
        stages hold (a tensor-parallel plan is applied to them alone)."""
        modules = dict(self.model.named_modules())
        return {name: v for name, v in plan.items()
                if name in modules and not any(isinstance(modules.get(a), _Elsewhere) for a in _ancestors(name))}

    @property
    def holds_last(self) -> bool:
        return any(st.last for st in self.stages)

    # -- one stage's forward ---------------------------------------------------------------------
    def _hook_outputs(self) -> None:
        """The hook that ends a stage at its last block's output, registered once the model is wrapped, after the
        hooks tensor parallelism and FSDP2 put on a block (a layer split by ``parallel.tp_plan`` hands on a local
        tensor from its own forward hook; FSDP2 reshards in one), so that it sends what the next block would
        get."""
        for block in self._owned:
            block.register_forward_hook(self._leave_block)
        self._owned = []

    def run_stage(self, stage: StageModule, received: tuple, mb: Any) -> Any:
        if self._owned:
            self._hook_outputs()
        container = self.plan.container
        check = not stage.checked and torch.is_grad_enabled()
        stage.received = received[0] if received else None
        self.active, self._last_output, self._leaves = stage, None, ({} if check else None)
        object.__setattr__(container, "_modules", self.views[stage.index])
        swaps = self.swaps[stage.index]
        for parent, attr, stand_in, _ in swaps:
            parent._modules[attr] = stand_in
        try:
            out = self._forward_fn(self.model, mb)
        except StageOutput as done:
            out = done.hidden
        except (TorchrigError, torch.cuda.OutOfMemoryError):  # torchrig's own one-line errors; OOM: auto retries
            raise
        except Exception as exc:
            raise self._stage_error(stage, exc) from exc
        else:
            if not stage.last:
                raise ParallelConfigError(
                    f"config key '{KEY}': {type(self.model).__name__}'s forward returned without calling "
                    f"{self.plan.block_name(stage.hi - 1)}, the last block of stage {stage.index + 1}; the pipeline "
                    f"cuts a forward that calls every block of {self.plan.container_name or 'the model'} in turn")
        finally:
            object.__setattr__(container, "_modules", self.rest_view)
            for parent, attr, _, module in swaps:
                parent._modules[attr] = module
            # the last block's output (the model's, on the last stage) is let go: autograd frees it in backward
            self.active, self._block, self._done, self._last_output = None, None, None, None
        if stage.received is not None:
            raise ParallelConfigError(
                f"config key '{KEY}': {type(self.model).__name__}'s forward did not call "
                f"{self.plan.block_name(stage.lo)}, where stage {stage.index + 1} begins")
        if check:
            self._check_graph(stage, received, out)
            stage.checked = True
        self._leaves = None
        return out

    def _stage_error(self, stage: StageModule, exc: Exception) -> Exception:
        """The one line for an error raised inside ``stage``'s forward: where it was raised, what it was."""
        import torch.distributed as dist

        if (not stage.first and isinstance(exc, RuntimeError)
                and "leaf Variable that requires grad is being used in an in-place" in str(exc)):
            return ParallelConfigError(
                f"config key '{KEY}': stage {stage.index + 1} changes the activation it receives in place (in "
                f"{self.plan.block_name(stage.lo)!r}, where it begins), which autograd forbids; compute that "
                f"operation out of place (x = x + y, not x += y), or begin the stage at another block")
        running = self.views[stage.index].get(self.plan.keys[self._block]) if self._block is not None else None
        where = (f"in block {self.plan.block_name(self._block)!r} ({type(running).__name__})" if running is not None else
                 f"after {self.plan.block_name(self._done)}" if self._done is not None else
                 f"before {self.plan.block_name(stage.lo)}")
        rank = f" (rank {dist.get_rank()})" if dist.is_initialized() else ""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return PipelineStageError(f"pipeline stage {stage.index + 1} of {self.num_stages}{rank} failed {where}: "
                                  f"{type(exc).__name__}: {text}")

    def placeholder(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The zeros a module of another stage answers with. In a stage's first training forward they are leaves
        that require gradients, so that the graph check sees whether anything of the output depends on them."""
        zeros = torch.zeros(like.shape, dtype=like.dtype, device=self.device)
        if self._leaves is None or not zeros.is_floating_point():
            return zeros
        zeros.requires_grad_(True)
        self._leaves[id(zeros)] = (zeros, name)
        return zeros.clone()  # not a leaf: the model's own code may change it in place

    def _enter_block(self, block: nn.Module, args: tuple, kwargs: dict) -> Any:
        stage = self.active
        if stage is None:
            return None
        i = self.block_index[id(block)]
        self._block = i
        if i == stage.lo and stage.received is not None:
            if not args:
                raise ParallelConfigError(
                    f"config key '{KEY}': {self.plan.block_name(i)} is called without a positional argument; the "
                    f"pipeline hands a block's first positional argument (the hidden state) from stage to stage")
            x, stage.received = stage.received, None
            return (x, *args[1:]), kwargs
        if self._leaves is not None and i > stage.lo and args and not _is_output_of(args[0], self._last_output):
            raise ParallelConfigError(
                f"config key '{KEY}': {type(self.model).__name__}'s forward changes the output of "
                f"{self.plan.block_name(i - 1)} before it reaches {self.plan.block_name(i)}; the pipeline cuts a "
                f"forward whose blocks are chained (each block's first input is the previous block's output)")
        return None

    def _leave_block(self, block: nn.Module, args: tuple, output: Any) -> None:
        stage = self.active
        if stage is None:
            return
        self._last_output = output
        self._block, self._done = None, self.block_index[id(block)]
        if self.block_index[id(block)] == stage.hi - 1 and not stage.last:
            hidden = output if isinstance(output, torch.Tensor) else (
                output[0] if isinstance(output, (tuple, list)) and output else None)
            if not isinstance(hidden, torch.Tensor):
                raise ParallelConfigError(
                    f"config key '{KEY}': {self.plan.block_name(stage.hi - 1)} returns a {type(output).__name__}; "
                    f"a stage sends on its last block's output, a tensor or a tuple whose first element is one")
            raise StageOutput(hidden)

    def _check_graph(self, stage: StageModule, received: tuple, out: Any) -> None:
        """What the stage's output depends on may be its own parameters and the activation it received only."""
        allowed = {id(p) for p in stage.parameters()} | {id(t) for t in received}
        # FSDP2's pre-forward hook hands the stage the received activation through a function of its own: the
        # activation's graph ends there
        ends = {t.grad_fn for t in received if t.grad_fn is not None}
        names = {id(p): n for n, p in self.model.named_parameters()}
        leaves = self._leaves or {}
        seen, todo = set(), [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen or fn in ends:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None and id(var) not in allowed:
                what = (f"{leaves[id(var)][1]} (held by another stage)" if id(var) in leaves else
                        f"{names.get(id(var), 'a parameter')} (of another stage)")
                raise ParallelConfigError(
                    f"config key '{KEY}': stage {stage.index + 1}'s result depends on {what}; a stage may use only "
                    f"its own modules and the previous stage's last block output, so "
                    f"{type(self.model).__name__}'s forward cannot be cut as {self.plan.describe()}")
            todo.extend(f for f, _ in fn.next_functions)

    # -- running micro-batches -------------------------------------------------------------------
    def train(self, micro_batches: list, forward_fn: Callable[[nn.Module, Any], Any]) -> None:
        """Every micro-batch of a window through this rank's stages, forward (``forward_fn``) and backward, by the
        configured schedule; the gradients add up in the parameters. Micro-batches of one shape run as one schedule
        step; a change of shape (a short last batch) starts another, in order."""
        with self.running(forward_fn):
            self._train(micro_batches)

    @contextlib.contextmanager
    def running(self, forward_fn: Callable[[nn.Module, Any], Any]):
        """The stages' forward while in the block: ``forward_fn(model, micro_batch)``."""
        self._forward_fn = forward_fn
        try:
            yield self
        finally:
            self._forward_fn = None

    def _train(self, micro_batches: list) -> None:
        start = 0
        while start < len(micro_batches):
            shape = _shape(micro_batches[start].batch)
            end = start + 1
            while end < len(micro_batches) and _shape(micro_batches[end].batch) == shape:
                end += 1
            n = end - start
            kept = self._take_sharded_grads() if start else []
            new = (n, shape) not in self._schedules
            schedule = self._schedule(n, shape)
            self.rehearsal = micro_batches[start].index if new else None
            try:
                schedule.step(arg_mbs=[()] * n, kwarg_mbs=[{"mb": mb} for mb in micro_batches[start:end]],
                              target_mbs=[self._target] * n, return_outputs=False)
            finally:
                self.rehearsal = None
            for param, grad in kept:
                param.grad = grad if param.grad is None else param.grad.add_(grad)
            start = end

    def _take_sharded_grads(self) -> list:
        """The gradients of this rank's FSDP2 stages, taken off them: a new schedule's first step clears the
        gradients of FSDP modules (its shape inference runs a real backward), which would lose what the window's
        earlier schedule steps added up; given back once the step is done."""
        kept = []
        for st in self.stages:
            if hasattr(st, "set_requires_gradient_sync"):  # an FSDPModule (parallel.dp_shard)
                for param in st.parameters():
                    if param.grad is not None:
                        kept.append((param, param.grad))
                        param.grad = None
        return kept

    def _schedule(self, n: int, shape: tuple) -> Any:
        """The schedule for ``n`` micro-batches of ``shape`` (built once, kept for the last few shapes: its stages
        hold receive buffers of that shape)."""
        key = (n, shape)
        schedule = self._schedules.get(key)
        if schedule is not None:
            self._schedules.move_to_end(key)
            return schedule
        schedule = self.make_schedule(n)
        self._schedules[key] = schedule
        while len(self._schedules) > CACHED_SCHEDULES:
            self._schedules.popitem(last=False)
        return schedule

    def make_schedule(self, n: int) -> Any:
        """A schedule over new ``PipelineStage`` objects of this rank's stages: the configured one, or for a run of
        micro-batches it cannot take (fewer than it needs: a short last window) the fill-drain one (GPipe, or
        looped BFS for several stages per rank), whose result is the same."""
        from torch.distributed import pipelining as P

        stages = self._new_stages()
        try:
            return self._build(_schedule_classes()[self.schedule_name], stages, n, _passthrough)
        except ValueError:
            if self.v_shape:
                raise
            return self._build(P.ScheduleGPipe if self.single else P.ScheduleLoopedBFS, stages, n, _passthrough)

    def forward(self, mb: MicroBatch, forward_fn: Callable[[nn.Module, Any], Any]) -> None:
        """One micro-batch through the stages without backward (evaluation, prediction), stage by stage: each rank
        runs its stages in order (their forward: ``forward_fn``), receiving the activation from the previous stage's
        rank and sending its output to the next's. No schedule: nothing to overlap, and no shape to learn first."""
        with self.running(forward_fn):
            self._forward(mb)

    def _forward(self, mb: MicroBatch) -> None:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(self.group)
        me = dist.get_rank()
        kept: Optional[torch.Tensor] = None
        for st in self.stages:
            received: tuple = ()
            if not st.first:
                src = ranks[self.rank_of[st.index - 1]]
                received = (kept if src == me else _recv(src, self.group, self.device),)
            out = st(*received, mb=mb)
            if not st.last:
                dst = ranks[self.rank_of[st.index + 1]]
                if dst == me:
                    kept = out
                else:
                    _send(out, dst, self.group)

    def check_microbatches(self, n: int, what: str) -> None:
        """Refuse, in one line naming the key ``what``, a window of ``n`` micro-batches the configured schedule
        cannot run (``1f1b`` needs one per stage at least)."""
        try:
            self._build(_schedule_classes()[self.schedule_name], self._new_stages(), n, _passthrough)
        except ValueError as exc:
            reason = str(exc).strip().splitlines()[0]
            raise ParallelConfigError(
                f"config key '{what}': {n} micro-batch{'es' if n != 1 else ''} per optimizer step, which "
                f"parallel.pp_schedule={self.schedule_name} cannot run over {_stages_text(self.num_stages)} "
                f"({' '.join(reason.split())}); raise {what} (the accumulation window's micro-batches are the "
                f"pipeline's) or set parallel.pp_schedule=gpipe") from None

    def _new_stages(self) -> list:
        from torch.distributed.pipelining import PipelineStage

        return [PipelineStage(st, st.index, self.num_stages, self.device, group=self.group) for st in self.stages]

    @staticmethod
    def _build(cls: Any, stages: list, n: int, loss: Optional[Callable]) -> Any:
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n, loss_fn=loss, scale_grads=False)
        return cls(stages, n, loss_fn=loss, scale_grads=False)


def _schedule_classes() -> dict:
    from torch.distributed import pipelining as P

    return {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved_1f1b": P.ScheduleInterleaved1F1B,
            "interleaved_zero_bubble": P.ScheduleInterleavedZeroBubble, "zbv_zero_bubble": P.ScheduleZBVZeroBubble}


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)
_HEADER = 16  # int64s: the dtype, the number of dimensions, the shape


def _send(t: torch.Tensor, dst: int, group: Any) -> None:
    import torch.distributed as dist

    if not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or t.ndim > _HEADER - 2:
        raise ParallelConfigError(f"config key '{KEY}': a stage's output is a {getattr(t, 'dtype', type(t))} "
                                  f"tensor of {getattr(t, 'ndim', '?')} dimensions; a stage sends one tensor of "
                                  f"{', '.join(str(d).replace('torch.', '') for d in _DTYPES)}")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.ndim
    header[2:2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header.to(t.device), dst, group=group)
    dist.send(t.detach().contiguous(), dst, group=group)


def _recv(src: int, group: Any, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    code, ndim, *shape = header.tolist()
    out = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(out, src, group=group)
    return out


def _passthrough(output: Any, target: Any) -> torch.Tensor:
    """The schedules' loss function: the last stage's forward already returns the tensor to back-propagate."""
    return output[0] if isinstance(output, tuple) else output


def _is_output_of(x: Any, output: Any) -> bool:
    if output is None:
        return True  # nothing ran before this block in the stage (the received activation)
    return x is output or (isinstance(output, (tuple, list)) and bool(output) and x is output[0])


def _shape(batch: Any) -> tuple:
    """The shapes and dtypes of a batch's tensors: micro-batches that share them share a schedule."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors(batch))
