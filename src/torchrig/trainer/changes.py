"""Which settings may change when a run resumes: exact, or it refuses.

A checkpoint holds a position (step, epoch, micro-batch in the epoch) and the state of a computation;
both mean something only under the settings they were made with. Another ``seed`` draws another data
order, another ``data.batch_size`` puts the saved micro-batch count somewhere else in the epoch, another
``optim.lr`` is another computation. So a resume compares the checkpoint's ``config.yaml`` with the
run's settings, key by key, and refuses any change outside ``HARMLESS`` with one line that names the
keys (old → new). ``resume_changes=allow`` resumes anyway and says what is no longer exact.

``HARMLESS`` is the one table: keys (or prefixes ending in ".") that change where and how the run
goes, what it logs and when it saves or stops, but not what it computes. Every other key, a recipe's
own included, is refused: a key added later is refused until someone decides it is harmless.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .. import config as C
from .. import runtime
from ..errors import setting, short_resume

HARMLESS = frozenset({
    # how long (see RUN_LENGTH_SCHEDULES), where, with how many threads and processes (the world size is
    # handled by the resume itself)
    "epochs", "max_steps", "early_stop_patience", "run_dir", "device", "threads", "interop_threads",
    "deterministic", "cudnn_benchmark", "on_nonfinite", "on_spike", "spike.",
    "dist.strategy", "dist.backend", "dist.init_method", "dist.rank", "dist.world_size", "dist.timeout",
    "dist.find_unused_parameters", "dist.static_graph", "dist.bucket_cap_mb", "dist.gradient_as_bucket_view",
    "dist.fsdp_wrap", "dist.fsdp_min_params", "dist.fsdp_cpu_offload", "dist.fsdp_reshard_after_forward",
    "dist.requeue", "dist.stop_timeout",
    # the layout: how the model is spread over the processes (checkpoints are resharded on load, see
    # checkpoint/sharded.py; the same computation up to the order of float sums)
    "parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.tp", "parallel.pp", "parallel.tp_plan",
    "parallel.tp_plan.", "parallel.loss_parallel", "parallel.pp_split", "parallel.pp_schedule",
    "parallel.pp_stages_per_rank",
    # how batches are delivered (the same samples in the same order), and what is evaluated when
    "data.num_workers", "data.pin_memory", "data.persistent_workers", "data.prefetch_factor", "data.fast_path",
    "data.eval_batch_size", "data.val_path", "data.test_path", "eval_every_epochs",
    # when checkpoints are written and how many are kept (not what the best one is measured by)
    "checkpoint.every_steps", "checkpoint.every_epochs", "checkpoint.keep_last", "checkpoint.keep_best",
    "checkpoint.save_final", "checkpoint.async_save", "checkpoint.include_base",
    # what is logged and shown
    "log.", "profile.",
})
# What a run started from that a checkpoint's own state replaces: not compared when resuming from one (a study's
# next trial, which starts afresh, compares it).
REPLACED_ON_RESUME = frozenset({"model.weights"})
# Keys that say how to start, not what to compute: never compared.
NOT_COMPARED = frozenset({"resume", "resume_weights_only", "resume_changes", "overwrite", "checkpoint.verify"})
# Schedules whose length is the run's length (epochs, max_steps): a new length passes (a longer run is how a
# finished run is continued), but it is said, since the learning rates from there on are not exact.
RUN_LENGTH_SCHEDULES = frozenset({"cosine", "onecycle", "warmup_cosine"})


def _harmless(key: str) -> bool:
    return key in HARMLESS or any(key.startswith(p) for p in HARMLESS if p.endswith("."))


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(not set)"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


_MISSING = object()


def changed(saved: dict, now: dict, worlds: tuple[int, int] = (1, 1)) -> tuple[list[tuple], list[tuple]]:
    """``(refused, length)``: ``(key, old, new, note)`` for each setting that differs and is not harmless,
    and for each change of the run's length (``epochs``, ``max_steps``). ``worlds`` are the saved and the
    current number of data-parallel ranks (processes that see different samples): ``data.batch_size`` is per
    such rank, so what must stay is the global batch (2 ranks of 4 resume exactly as 1 of 8; tensor-parallel
    ranks share their samples). A key that this torchrig declares and the checkpoint lacks
    (saved by an older version) is not compared, nor a key of a section one side has not at all (a recipe's
    section, registered only in a process that imported the recipe: a run cannot read a section its process
    does not have)."""
    old, new = C.flat_keys(saved), C.flat_keys(now)
    declared = set(C.flat_keys(C.to_dict(C.Config())))
    refused, length = [], []
    # the same data.global_batch_size: how each process makes its share (batch, micro-batches, accumulation) is
    # derived from the world size and changes nothing computed
    global_batch = old.get("data.global_batch_size") or None
    derived = {"data.batch_size", "accumulate", "data.micro_batch_size"} if global_batch and global_batch == new.get("data.global_batch_size") \
        else set()
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        # the batch per rank on another number of ranks: the global batch changes even where the key does not.
        # A job restarted with fewer or more processes (torchrun, a Slurm requeue: the same command line) goes
        # on as before; a resume asked for by hand is held to the global batch (or data.global_batch_size)
        per_rank = key == "data.batch_size" and worlds[0] != worlds[1] and key not in derived \
            and isinstance(a, int) and isinstance(b, int) and (a != b or runtime.restart_count() == 0)
        if (a == b and not per_rank) or key in NOT_COMPARED or key in derived or (key in declared and _MISSING in (a, b)):
            continue
        section = key.split(".")[0]
        if "." in key and (section not in saved or section not in now):
            continue
        if key == "model.python_class" and (a is None or b is None or str(a).startswith("torch.distributed.fsdp")):
            continue  # one side built from the config (a recipe, --model), the other in Python: maybe the same;
            # or saved under FSDP2 before its own subclass was seen through: not known
        if key == "recipe" and (old.get("model.python_class") or new.get("model.python_class")):
            continue  # a model built in Python trains on data from Python: the recipe (custom; digits before it
            # was recorded so) names none of it
        note = ""
        if per_rank:
            if a * worlds[0] == b * worlds[1]:
                continue
            acc = [w if isinstance(w, int) else 1 for w in (old.get("accumulate", 1), new.get("accumulate", 1))]
            note = (f" (global batch {a * worlds[0] * acc[0]} → {b * worlds[1] * acc[1]} over {worlds[0]} → "
                    f"{worlds[1]} data-parallel ranks)")
        if key in ("epochs", "max_steps"):
            length.append((key, a, b, note))
        elif not _harmless(key):
            refused.append((key, a, b, note))
    return refused, length


def check(saved: dict | None, now: dict, checkpoint: Path, allow: bool, say: Callable[[str], None],
          worlds: tuple[int, int] = (1, 1), run_dir: Any = None) -> None:
    """Refuse to resume from ``checkpoint`` (whose config is ``saved``; ``worlds``: the saved and the
    current number of processes; ``run_dir``: the run it continues) with changed settings, or, with ``allow``,
    say in one line what is no longer exact. A new run length passes; when the schedule follows it, one line says
    that the learning rates from here on are not those of a run this long."""
    if not isinstance(saved, dict):
        return
    refused, length = changed(saved, now, worlds)
    refused = [diff for diff in refused if diff[0] not in REPLACED_ON_RESUME]
    schedule = str((now.get("scheduler") or {}).get("name") or "").lower().replace("-", "_")
    if length and schedule in RUN_LENGTH_SCHEDULES:  # re-planned on load (optim.follow_new_length)
        say(f"torchrig: the {schedule} schedule follows the run's length, which changed ({_list(length)}): from here "
            f"on its learning rates are those of a schedule of the new length (the steps so far followed the old one)")
    if not refused:
        return
    if allow:
        say(f"torchrig: resume_changes=allow: resuming from '{checkpoint}' with changed settings, so the run is no "
            f"longer exact: {_list(refused)}")
        return
    short = short_resume(run_dir) if run_dir is not None else ""
    back = f"set them back ({short} takes the run's own settings)" if short else "set them back"
    raise C.ConfigError(f"resuming from '{checkpoint}' with changed settings would not be exact: {_list(refused)}; "
                        f"{back}, start a new run (another run_dir, or {setting('overwrite', True)}), or "
                        f"resume anyway with {setting('resume_changes', 'allow')}")


def _list(diffs: list[tuple]) -> str:
    return ", ".join(f"{k} {_show(a)} → {_show(b)}{note}" for k, a, b, note in diffs)
