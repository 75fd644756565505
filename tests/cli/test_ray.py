"""``torchrig launch --ray auto --workers 2 -- train …`` on a local Ray (2 CPUs, started by the test):
Ray Train's workers, their process group made by Ray, train what 2 torchrun processes train (within
1e-6), with the checkpoints in the run directory."""

from __future__ import annotations

import signal

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

from helpers import dist_procs  # noqa: E402

from torchrig.cli import main  # noqa: E402

TRAIN = ["train", "--set", "max_steps=6", "--set", "log.plot=false", "--set", "log.tensorboard=false",
         "--set", "log.progress=none", "--set", "data.num_workers=0"]


def weights(run) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "checkpoints" / "latest" / "model.safetensors"))


@pytest.mark.slow
def test_two_ray_workers_train_what_two_torchrun_processes_train(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torchrun = dist_procs.torchrig(["launch", "--nproc-per-node", "2", "--", *TRAIN, "--set", "run_dir=torchrun"],
                                   timeout=240, cwd=tmp_path)
    assert torchrun.returncode == 0, torchrun.output[-3000:]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False)  # installs its own SIGTERM handler in this (pytest's) process
    try:
        # a relative run_dir: the workers run in this directory, not in Ray's session folder
        assert main(["launch", "--ray", "auto", "--workers", "2", "--", *TRAIN, "--set", "run_dir=on-ray"]) == 0
        assert main(["launch", "--ray", "auto", "--workers", "2", "--", "plot", "x"]) == 1
        assert "--ray runs a torchrig command (train, evaluate, predict) on each worker, got 'plot'" in \
            capsys.readouterr().err
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():  # the later tests of this process expect Python's own handlers
            signal.signal(sig, handler)
    a, b = weights(tmp_path / "on-ray"), weights(tmp_path / "torchrun")
    assert a.keys() == b.keys()
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= 1e-6
    assert (tmp_path / "on-ray" / "checkpoints" / "step-00000006").is_dir()
    assert (tmp_path / "on-ray" / "ray").is_dir()  # Ray's own bookkeeping, beside the run's files


def test_ray_options_are_checked_before_ray_starts(capsys):
    assert main(["launch", "--ray", "auto", "--", "train"]) == 2
    assert "--ray needs --workers N" in capsys.readouterr().err
    assert main(["launch", "--workers", "2", "--", "train"]) == 2
    assert "--workers goes with --ray; torchrun's processes are --nproc-per-node" in capsys.readouterr().err
    assert main(["launch", "--ray", "auto", "--workers", "0", "--", "train"]) == 1
    assert "--workers 0: give the number of Ray workers" in capsys.readouterr().err
