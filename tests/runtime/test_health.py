"""The health check before a run (``dist.health_check``, ``torchrig doctor --gpus``; runtime/health.py).

Two gloo processes, rank 1's matrix product made ten times slower on purpose: every rank stops before training
with the same line naming rank 1, its host and device, and nothing is trained. The judgement on figures given by
hand, and ``torchrig doctor --gpus`` on this machine's CPU.
"""

from __future__ import annotations

import socket

from helpers import dist_procs
from helpers.dist_procs import HELPERS

from torchrig.runtime import health


def test_a_rank_with_a_slow_device_is_named_before_training_on_every_rank(tmp_path):
    results = dist_procs.pair("health", tmp_path / "health", tmp_path / "store", timeout=120,
                              worker=HELPERS / "hang_worker.py")
    assert [r.returncode for r in results] == [1, 1], results[0].output[-3000:]
    for r in results:
        line = next(line for line in r.stderr.splitlines() if "dist.health_check: " in line)
        assert f"dist.health_check: rank 1 (host {socket.gethostname()}, cpu): matmul " in line, line
        assert "the other ranks' median" in line and "nothing was trained" in line
        assert "rank 0 (" not in line
    assert "torchrig: health check, rank 1 (host " in results[0].output  # rank 0 says every rank's figures
    assert not (tmp_path / "health" / "run" / "checkpoints").exists() or \
        not any((tmp_path / "health" / "run" / "checkpoints").iterdir())


def test_far_below_names_each_figure_under_half_the_others_median():
    names = [("a", "cuda:0"), ("a", "cuda:1"), ("b", "cuda:0"), ("b", "cuda:1")]
    ok = [400e12, 80 * 2 ** 30, 20 * 2 ** 30, 0.0]
    figures = [ok, list(ok), [150e12, 80 * 2 ** 30, 20 * 2 ** 30, 0.0], [400e12, 30 * 2 ** 30, 9 * 2 ** 30, 0.0]]
    assert health.far_below(figures, names) == [
        "rank 2 (host b, cuda:0): matmul 150 TFLOP/s, 0.38× the other ranks' median 400 TFLOP/s",
        "rank 3 (host b, cuda:1): memory 30 GiB, 0.38× the other ranks' median 80 GiB",
        "rank 3 (host b, cuda:1): ring link 9 GiB/s, 0.45× the other ranks' median 20 GiB/s"]
    assert health.far_below([ok, [250e12, *ok[1:]]], names[:2]) == []  # 0.62×: slower, not far below


def test_doctor_gpus_probes_this_machines_devices(capsys):
    from torchrig.cli import main

    import torch

    rc = main(["doctor", "--gpus"])
    out = capsys.readouterr().out.splitlines()
    first = "cuda:0: matmul bfloat16 " if torch.cuda.is_available() else "cpu: matmul float32 "
    assert out[0].startswith(first) and out[0].endswith(" GiB allocatable"), out
    assert len(out) == max(1, torch.cuda.device_count()) + 1
    assert (rc, out[-1]) == (0, "health: no device far below the others"), out
