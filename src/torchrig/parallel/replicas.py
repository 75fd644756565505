"""``dist.fault_tolerance: torchft``: data-parallel replica groups that train on when one is lost.

torchft (``pip install "torchrig[ft]"``) owns the protocol: its lighthouse (started by ``torchrig launch
--replica-groups N``) forms a quorum of the live replica groups before every step; its ``Manager`` reconfigures
the groups' process group, averages the gradients over the groups that take part (its ``allreduce``, which divides by
the participants) and decides whether a step may be applied (its ``OptimizerWrapper``: ``should_commit``);
a replacement copies a live replica's state over torchft's HTTP transport before its first step. torchrig hands it
the state to copy (the model, optimizer, schedules, step counters and data position: what a checkpoint holds),
counts each step's participants to weigh the loss, and says in one line which batches a step did not train.

The semantics, exactly: every replica group reads its own share of each global batch (the sampler's rank is the
group's, its world the number of groups). Step ``s`` trains on the batches of the groups in its quorum, the
gradient being the mean over their items (samples or tokens): a group that is not in the quorum (lost, or not yet
back) skips its share of batch ``s``, and nothing replaces it. A step during which a group is lost (its all-reduce
fails) is applied by no group: it is counted as a skipped step, its batches are skipped, the data moves on. A
replacement group copies the live state at the start of a step and trains that step with the others.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from .errors import ParallelConfigError

ENV_GROUP = "REPLICA_GROUP_ID"        # torchft's convention: this process's replica group, 0 … N-1
ENV_GROUPS = "NUM_REPLICA_GROUPS"     # the number of replica groups the data is split over
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # the lighthouse's address, http://HOST:PORT
STATE_KEY = "torchrig"                # the Manager's name for the state a replacement copies


class ReplicaGroupError(ParallelConfigError):
    """A replica-group setting that cannot work (or a group that must restart to copy the others' state)."""


def _env_int(name: str, lo: int) -> int:
    text = os.environ.get(name, "")
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if value < lo:
        raise ReplicaGroupError(f"dist.fault_tolerance=torchft: environment variable {name}={text!r} is not an "
                                f"integer >= {lo}; start the run with torchrig launch --replica-groups N")
    return value


def from_environment() -> tuple[int, int, str]:
    """``(group, groups, lighthouse)`` of this process, from torchft's variables; one line when one is missing."""
    lighthouse = os.environ.get(ENV_LIGHTHOUSE, "")
    if not lighthouse or ENV_GROUP not in os.environ:
        raise ReplicaGroupError(
            f"dist.fault_tolerance=torchft needs torchft's lighthouse and a replica group: start the run with "
            f"torchrig launch --replica-groups N -- … (it sets {ENV_LIGHTHOUSE}, {ENV_GROUP} and {ENV_GROUPS}), or "
            f"set dist.fault_tolerance=none")
    groups = _env_int(ENV_GROUPS, 1)
    group = _env_int(ENV_GROUP, 0)
    if group >= groups:
        raise ReplicaGroupError(f"{ENV_GROUP}={group} is not below {ENV_GROUPS}={groups}")
    return group, groups, lighthouse


def check_composition(world_size: int, strategy: str, layout: Any, cfg: Any) -> None:
    """What replica groups do not compose with yet, refused in one line each."""
    if world_size > 1:
        raise ReplicaGroupError(
            f"dist.fault_tolerance=torchft: {world_size} processes in one replica group; each group is one process "
            f"here (FSDP2 / tensor parallelism inside a group is not supported yet): launch with --nproc-per-node 1 "
            f"--replica-groups N")
    if layout.tp > 1 or layout.pp > 1 or strategy == "fsdp":
        raise ReplicaGroupError("dist.fault_tolerance=torchft trains plain data-parallel replicas: set "
                                "parallel.tp=1, parallel.pp=1 and dist.strategy=ddp (or auto)")
    why = {"on_nonfinite": cfg.on_nonfinite == "skip", "on_spike": cfg.on_spike == "rollback",
           "precision": cfg.precision == "fp16", "run_dir": not cfg.run_dir}
    for key, bad in why.items():
        if bad:
            value = getattr(cfg, key)
            hint = "give every replica group the same run_dir" if key == "run_dir" else \
                "each step's update is torchft's to apply or drop; choose another value"
            raise ReplicaGroupError(f"config key '{key}': {value!r} does not go with dist.fault_tolerance=torchft; "
                                    f"{hint}")


def _advertise(lighthouse: str) -> dict:
    """A lighthouse on loopback (one machine): the managers tell each other 127.0.0.1, not the host's name."""
    host = lighthouse.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return {"hostname": "127.0.0.1"} if host in ("127.0.0.1", "localhost", "::1") else {}


def _tensors_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP transport of a live group's state, read back with ``weights_only=True``: a replacement
    copies tensors, numbers, strings and containers of them (what torchrig's state dicts hold) and unpickles nothing
    else, so a peer that serves a crafted state cannot run code in it (torchft's own reader unpickles anything)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class TensorsOnly(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return TensorsOnly(timeout=timeout, num_chunks=0)


class Replicas:
    """This process's replica group under torchft: its ``Manager`` (one per process, its process group
    reconfigured at each quorum), the wrappers that route the gradients and the update through it, and the record
    of which groups took part in each step (``records``: ``(step, groups, applied)``).

    ``say``: one line for the user (this group's first process; a missing group's batch is reported by the
    lowest-numbered group that took part). ``timeout``: seconds a collective, a quorum or a state copy may wait.
    """

    def __init__(self, group: int, groups: int, lighthouse: str, device: torch.device, timeout: float,
                 say: Callable[[str], None] = print):
        try:
            import torchft
        except ImportError:
            raise ReplicaGroupError('dist.fault_tolerance=torchft needs torchft: pip install "torchrig[ft]"') \
                from None
        self.group, self.groups, self.say = group, groups, say
        wait = timedelta(seconds=timeout)
        pg = torchft.ProcessGroupNCCL(wait) if device.type == "cuda" else torchft.ProcessGroupGloo(wait)
        self.manager = torchft.Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
                                       checkpoint_transport=_tensors_only_transport(wait),
                                       use_async_quorum=False, timeout=wait, quorum_timeout=wait,
                                       connect_timeout=wait, lighthouse_addr=lighthouse,
                                       replica_id=f"torchrig_replica_{group}", **_advertise(lighthouse))
        self.records: list[tuple[int, tuple, bool]] = []
        self.joined = False
        self.healed_at: Optional[int] = None  # the step this group copied the live state at, if it did
        self._step_before = 0
        self._served = False
        self._quorum_ready = False  # join's quorum serves the first step

    # -- what torchft wraps ------------------------------------------------------------------------
    def average(self, grads: list) -> None:
        """The mean of ``grads`` over the groups of the step's quorum, by the manager's all-reduce (the call torchft's
        DDP wrapper makes in its communication hook; that hook fails on an assertion in torchft 0.2.0 when a peer is
        lost inside the all-reduce, the very case it is for, so torchrig calls the manager after the backward, one flat
        bucket at a time). A failed all-reduce is the manager's to note: the step is then not committed."""
        from .wrap import flat_collective

        flat_collective([g for g in grads if g is not None and not g.is_sparse],
                        lambda flat: self.manager.allreduce(flat).wait())

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """torchft's optimizer wrapper: ``step`` applies the update only when the groups agree that it may
        (``should_commit``). Its ``zero_grad`` would also form the next step's quorum; torchrig zeroes the gradients
        at the end of a step, before the step is counted, so the quorum is formed at the start of the next one
        (:meth:`begin_step`), where the state a replacement copies is that of a step boundary."""
        import torchft

        class Committing(torchft.Optimizer):
            def zero_grad(self, set_to_none: bool = True) -> None:
                self.optim.zero_grad(set_to_none)

        return Committing(self.manager, optimizer)

    def begin_step(self) -> None:
        """The quorum of the step about to begin (after :meth:`join`'s, which is the first step's)."""
        if self._quorum_ready:
            self._quorum_ready = False
            return
        self.manager.start_quorum()

    def serve(self, state: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a replacement copies (``state()``) and how it takes it (``load``), registered once."""
        if self._served:
            return
        self._served = True

        def take(copied: dict) -> None:
            if self.joined:  # a live group behind the others cannot jump inside its loop: restart it to copy
                raise ReplicaGroupError(
                    f"replica group {self.group} fell behind the other groups (its step {self._step_before} was not "
                    f"theirs); it stops so that torchrun restarts it (torchrig launch --max-restarts) and it copies "
                    f"their state")
            load(copied)
            self.healed_at = self.manager.current_step()

        self.manager.register_state_dict_fn(STATE_KEY, take, state)

    def join(self) -> Optional[int]:
        """The first quorum, before the loop: a group behind the live ones copies their state here. Returns the
        manager's step it copied at, or None when it started with the others."""
        self.manager.start_quorum()
        self.joined, self._quorum_ready = True, True
        self._step_before = self.manager.current_step()
        return self.healed_at

    # -- one step ----------------------------------------------------------------------------------
    def window_factor(self, count: Any, unit: float, device: torch.device, step: int, where: str) -> torch.Tensor:
        """``P × unit / N``: what turns the window's gradients, averaged by torchft over the ``P`` groups of the
        step, into the mean over their ``N`` items; ``count``: this group's items. One all-reduce (sum) of the count
        and of which groups took part, through the manager (a group outside the quorum adds nothing). ``step``: the
        optimizer step (1-based) this window makes, ``where``: it in words."""
        t = torch.zeros(self.groups + 1, dtype=torch.float64, device=device)
        t[0] = count if not isinstance(count, torch.Tensor) else count.to(device, torch.float64)
        t[1 + self.group] = 1.0
        self.manager.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        taking = tuple(g for g in range(self.groups) if float(t[1 + g]) > 0.5) or (self.group,)
        self._taking, self._step = taking, step
        missing = [g for g in range(self.groups) if g not in taking]
        if missing and self.group == taking[0] and not self.manager.errored():  # an error: committed() says it
            self.say(f"torchrig: {where}: replica group(s) {', '.join(map(str, missing))} of {self.groups} did not "
                     f"take part (lost, or not yet back): their share of this batch is skipped; the step trains on "
                     f"the {int(float(t[0]))} items of group(s) {', '.join(map(str, taking))}")
        participants = max(self.manager.num_participants(), 1)
        return ((participants * unit) / t[0].clamp_min(1)).float().reshape(())

    def committed(self, where: str) -> bool:
        """Whether the update of the step just ended was applied (torchft's ``should_commit``, made in the wrapped
        optimizer's ``step``); said in one line when it was not."""
        done = self.manager.current_step() > self._step_before
        self._step_before = self.manager.current_step()
        taking = getattr(self, "_taking", (self.group,))
        self.records.append((getattr(self, "_step", 0), taking, done))
        if not done and self.group == taking[0]:
            self.say(f"torchrig: {where} was not applied: a replica group was lost during it (torchft did not "
                     f"commit it); the batches of group(s) {', '.join(map(str, taking))} for this step are skipped")
        return done

    # -- Stateful: the manager's counters, in torchrig's checkpoints --------------------------------
    def state_dict(self) -> dict:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})

    def close(self) -> None:
        self.manager.shutdown(wait=False)
