"""``torchrig launch --ray ADDRESS|auto --workers N -- train …``: the same run on Ray Train's workers.

Ray Train's ``TorchTrainer`` starts ``N`` workers on the Ray cluster (a local one, or a KubeRay cluster
on Kubernetes), sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT`` and
creates the process group (gloo on CPU, NCCL with GPUs) before the worker function runs. Each worker
then runs the torchrig command line in its own process, which finds the process group already made
and uses it: the data sharding, the gradient all-reduce, the checkpoints (written by rank 0 into the
run directory, ``run_dir``) and the resume are torchrig's, exactly as under torchrun. Ray keeps only
its own bookkeeping (``RUN_DIR/ray`` when the command names a run directory).

:func:`run_on_ray` is the Python entry point; the command line calls it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ..errors import TorchrigError

RAY_COMMANDS = ("train", "evaluate", "predict")


class RayLaunchError(TorchrigError, RuntimeError):
    """A Ray launch that cannot start or whose workers failed; the message says which and why."""


def _worker(config: dict) -> None:
    """One Ray Train worker: the torchrig command in this process, in the driver's working directory."""
    os.chdir(config["cwd"])  # Ray starts workers in its own session folder; relative paths are the user's
    from . import main

    code = main(list(config["argv"]))
    if code:
        raise RayLaunchError(f"torchrig {config['argv'][0]} exited with {code} on rank {os.environ.get('RANK')}; "
                             f"its error is in that worker's output above")


def _run_dir(argv: Sequence[str]) -> Optional[Path]:
    """The ``run_dir`` a torchrig command names with ``--set run_dir=…`` (None when it takes the default)."""
    args = list(argv)
    for i, a in enumerate(args):
        value = a if a.startswith("run_dir=") else (args[i + 1] if a == "--set" and i + 1 < len(args) else "")
        if value.startswith("run_dir="):
            return Path(value.split("=", 1)[1]).expanduser()
    return None


def run_on_ray(argv: Sequence[str], workers: int, address: Optional[str] = "auto", use_gpu: bool = False,
               cpus_per_worker: float = 1.0) -> int:
    """Run the torchrig command ``argv`` (e.g. ``["train", "--set", "epochs=3"]``) on ``workers`` Ray Train
    workers joined in one process group, and return 0, or raise :class:`RayLaunchError`.

    ``address`` is Ray's: ``"auto"`` (the cluster this machine belongs to: ``ray start`` or a KubeRay head),
    ``"ray://HEAD:10001"`` (Ray Client), or None to start a local Ray. A Ray already initialised in this
    process (``ray.init(...)``) is used as it is."""
    argv = list(argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv[:1] == ["torchrig"]:
        argv = argv[1:]
    if not argv or argv[0] not in RAY_COMMANDS:
        got = argv[0] if argv else "nothing"
        raise RayLaunchError(f"--ray runs a torchrig command ({', '.join(RAY_COMMANDS)}) on each worker, got {got!r}; "
                             f"e.g. torchrig launch --ray auto --workers 2 -- train --set epochs=3")
    if workers < 1:
        raise RayLaunchError(f"--workers {workers}: give the number of Ray workers (processes), 1 or more")
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        raise RayLaunchError("--ray needs Ray Train; pip install 'ray[train]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RayLaunchError(f"--ray {address}: cannot reach a Ray cluster ({first}); start one with `ray start "
                                 f"--head`, give the head's ray://HOST:10001, or run on a KubeRay head pod") from None
    run_dir = _run_dir(argv)
    storage = (run_dir.resolve() if run_dir else Path.cwd() / "runs") / "ray"
    trainer = TorchTrainer(
        _worker, train_loop_config={"argv": argv, "cwd": os.getcwd()},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(storage_path=str(storage), name=argv[0]))
    try:
        result = trainer.fit()
    except Exception as exc:
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise RayLaunchError(f"the Ray run failed: {first}") from exc
    if result.error is not None:
        raise RayLaunchError(f"the Ray run failed: {result.error}")
    return 0
