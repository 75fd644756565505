"""The defaults a CUDA run gets, checked on CPU where the setting itself can be observed.

cuDNN autotuning, TF32 matmuls, channels_last, fused optimizers, DDP buffer broadcasts, loader
workers, pinned / on-device fast-path batches and metric states on the run's device. Settings that
need a GPU to be observed are in the ``gpu``-marked tests at the end.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from torchrig.config import DistConfig
from torchrig.data import ResumableSampler, TensorBatches, prefetch_to_device
from torchrig.data import workers
from torchrig.metrics import Metric, get_metrics
from torchrig.runtime import configure_backends, tf32_in_force, wants_channels_last
from torchrig.parallel.wrap import broadcast_buffers
from torchrig.optim.optimizers import build_optimizer

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture
def backend_flags():
    """Restore every global switch configure_backends may touch."""
    matmul = torch.backends.cuda.matmul
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, matmul.fp32_precision,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.backends.cudnn.benchmark = False
    matmul.fp32_precision = "none"  # untouched: PyTorch's default (full fp32), no choice made
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[0], saved[1]
    matmul.fp32_precision = saved[2]
    torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])


def test_cuda_run_autotunes_and_uses_tf32(backend_flags):
    configure_backends(False, "auto", CUDA)
    assert torch.backends.cudnn.benchmark is True
    assert torch.get_float32_matmul_precision() == "high"


def test_deterministic_cuda_run_keeps_exact_settings(backend_flags):
    configure_backends(True, "auto", CUDA)
    assert torch.backends.cudnn.benchmark is False and torch.backends.cudnn.deterministic
    assert torch.get_float32_matmul_precision() == "highest"


def test_user_choices_are_kept(backend_flags):
    configure_backends(False, False, CUDA)  # cudnn_benchmark=false in the config
    assert torch.backends.cudnn.benchmark is False
    torch.set_float32_matmul_precision("medium")  # the user's script chose before the Trainer
    configure_backends(False, "auto", CUDA)
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("choose", ["new", "legacy"])
def test_a_user_who_asked_for_full_fp32_keeps_it(backend_flags, choose):
    """``torch.backends.cuda.matmul.fp32_precision = "ieee"`` (PyTorch's newer switch) or an explicit
    ``set_float32_matmul_precision("highest")`` before the Trainer: TF32 stays off, and is reported so."""
    if choose == "new":
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.set_float32_matmul_precision("highest")
    configure_backends(False, "auto", CUDA)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee" and not tf32_in_force()


def test_cpu_run_changes_nothing_by_default(backend_flags):
    configure_backends(False, "auto", CPU)
    assert torch.backends.cudnn.benchmark is False
    assert torch.get_float32_matmul_precision() == "highest"
    configure_backends(False, True, CPU)  # asked for explicitly: applied as given
    assert torch.backends.cudnn.benchmark is True


def test_channels_last_for_conv_models_on_cuda():
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    mlp = nn.Sequential(nn.Linear(3, 4))
    assert wants_channels_last(conv, "auto", CUDA)
    assert not wants_channels_last(conv, "auto", CPU)
    assert not wants_channels_last(mlp, "auto", CUDA)
    assert wants_channels_last(mlp, True, CPU) and not wants_channels_last(conv, False, CUDA)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_fused_optimizers_on_cuda(name):
    model = nn.Linear(4, 2)
    assert build_optimizer(name, model, 0.1, device=CUDA).defaults["fused"] is True
    assert not build_optimizer(name, model, 0.1, device=CPU).defaults.get("fused")
    # the user's options win
    assert not build_optimizer(name, model, 0.1, device=CUDA, options={"fused": False}).defaults["fused"]


def test_broadcast_buffers_off_with_sync_batchnorm():
    bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert broadcast_buffers(DistConfig(), bn) is False
    assert broadcast_buffers(DistConfig(), plain) is True
    assert broadcast_buffers(DistConfig(broadcast_buffers=False), plain) is False
    assert broadcast_buffers(DistConfig(broadcast_buffers=True), bn) is True


@pytest.mark.parametrize("cores, local_ranks, expected", [(32, 1, 16), (32, 2, 15), (16, 4, 3), (8, 8, 0), (2, 1, 1)])
def test_loader_workers_scale_with_the_cores_of_each_rank(monkeypatch, cores, local_ranks, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert workers.most_workers(local_ranks) == expected


def test_fast_path_batches_kept_on_their_device():
    """Tensors already on an accelerator are indexed there (``meta`` stands in for it): no host copy."""
    x, y = torch.randn(10, 3), torch.arange(10)
    sampler = ResumableSampler(10, shuffle=True, seed=3)
    on_cpu = list(TensorBatches((x, y), sampler, 4, False))
    on_dev = list(TensorBatches((x.to("meta"), y.to("meta")), sampler, 4, False))
    assert [b[1].tolist() for b in on_cpu] and all(t.device.type == "meta" for b in on_dev for t in b)
    assert [tuple(t.shape) for b in on_cpu for t in b] == [tuple(t.shape) for b in on_dev for t in b]
    assert list(prefetch_to_device(on_cpu, CPU)) == on_cpu  # no device copy to overlap on CPU


class Count(Metric):
    """Counts only: its only state comes from Python numbers."""

    name = "count"

    def update(self, output, target):
        self._add("n", len(target))

    def compute(self):
        return float(self.states["n"])


def test_count_only_states_live_on_the_run_device():
    meta = torch.device("meta")
    count, acc = get_metrics([Count(), "accuracy"], device=meta)
    count.update(None, [1, 2, 3])
    acc.update(torch.eye(3, device=meta), torch.arange(3, device=meta))
    assert count.states["n"].device == meta
    assert {v.device for v in acc.states.values()} == {meta}


@pytest.mark.gpu
def test_pinned_fast_path_and_overlapped_copy():
    x, y = torch.randn(64, 3), torch.arange(64)
    batches = TensorBatches((x, y), ResumableSampler(64, seed=1), 16, False, pin=True)
    host = list(batches)
    assert all(t.is_pinned() for b in host for t in b)
    moved = list(prefetch_to_device(batches, CUDA))
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for m, h in zip(moved, host) for a, b in zip(m, h))


SELECTIONS = [("cuda:{last}", None), ("cuda", "last"), ("auto", "last")]  # (device, local_rank)


def _watch_set_device(monkeypatch, real) -> list:
    """Record every torch.cuda.set_device call (and pass it on to ``real``): on one GPU the current device is cuda:0
    whether or not it was set, so only the call shows that it was."""
    calls: list = []

    def set_device(d):
        calls.append(torch.device("cuda", d) if isinstance(d, int) else torch.device(d))
        real(d)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    return calls


@pytest.mark.parametrize("name, local_rank", SELECTIONS)
def test_select_device_makes_the_chosen_gpu_current_on_a_stand_in(monkeypatch, name, local_rank):
    """On the CPU, a stand-in for two GPUs (torch.cuda's availability, count and current device): whichever way
    cuda:1 is chosen (by name, by the local rank, by ``auto``), it becomes the current device."""
    from torchrig.runtime import select_device

    current = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    calls = _watch_set_device(monkeypatch, lambda d: current.__setitem__(0, torch.device(d).index if not
                                                                          isinstance(d, int) else d))
    dev = select_device(name.format(last=1), 1 if local_rank else None)
    assert dev == torch.device("cuda", 1)
    assert calls == [dev] and torch.cuda.current_device() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name, local_rank", SELECTIONS)
def test_select_device_sets_the_current_device(monkeypatch, name, local_rank):
    """The chosen GPU becomes the current device (collectives, NCCL barriers and torch.cuda calls without an index
    use it). The current device starts at cuda:0 and the last GPU is chosen; on a one-GPU machine that is cuda:0
    too, and the watched torch.cuda.set_device call is what can fail."""
    from torchrig.runtime import select_device

    real = torch.cuda.set_device
    last = torch.cuda.device_count() - 1
    before = torch.cuda.current_device()
    try:
        real(0)
        calls = _watch_set_device(monkeypatch, real)
        dev = select_device(name.format(last=last), last if local_rank else None)
        assert dev == torch.device("cuda", last)
        assert calls == [dev] and torch.cuda.current_device() == last
    finally:
        real(before)


def test_ddp_gets_the_buffer_switch(tmp_path):
    import warnings

    import torch.distributed as dist

    from torchrig.parallel import wrap_model

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no deprecation warning from the switch's name
            off = wrap_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "ddp", CPU,
                             DistConfig(broadcast_buffers=False))
            on = wrap_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), "ddp", CPU, DistConfig())
        flag = "forward_sync_buffers" if hasattr(off, "forward_sync_buffers") else "broadcast_buffers"
        assert getattr(off, flag) is False and getattr(on, flag) is True
    finally:
        dist.destroy_process_group()
