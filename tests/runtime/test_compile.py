"""``model.compile``: torch.compile (inductor, on CPU with the system C compiler) through the Trainer.

Compiled models train like eager ones; a ``ModuleDict`` of networks is compiled network by network;
``no_sync`` and ``unwrap`` see through the compiled wrapper, so gradient accumulation under DDP skips
the all-reduce of every micro-batch but the window's last.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from helpers import QUIET, TinyNet, make_classification
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from torchrig import parallel, runtime

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                    reason="inductor on CPU needs a C compiler")


def _fit(run_dir, compile_):
    x, y = make_classification(32)
    torch.manual_seed(0)
    model = TinyNet()
    trainer = torchrig.Trainer(model, "sgd", **QUIET, run_dir=str(run_dir), batch_size=8, epochs=1, lr=0.05,
                               num_workers=0, compile=compile_, checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(x, y))
    return trainer, model


@pytest.mark.slow
@needs_compiler
def test_compiled_model_trains_like_eager(tmp_path):
    torch._dynamo.reset()
    compiled, model_c = _fit(tmp_path / "c", True)
    _, model_e = _fit(tmp_path / "e", False)
    assert isinstance(compiled.wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert runtime.unwrap(compiled.wrapped) is model_c
    for (name, a), b in zip(model_c.state_dict().items(), model_e.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert compiled.global_step == 4


def test_each_network_of_a_module_dict_is_compiled():
    nets = nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)})
    wrapped, models = runtime.compile_models(nets, dict(nets.items()), nets)
    assert wrapped is nets  # the container holds the weights; it has no forward to compile
    assert set(models) == {"g", "d"}
    assert all(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in models.values())
    assert runtime.unwrap(models["g"]) is nets["g"]


def test_no_sync_reaches_ddp_inside_compile(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Linear(4, 2)
        ddp = nn.parallel.DistributedDataParallel(model)
        compiled = torch.compile(ddp)
        assert runtime.unwrap(compiled) is model
        with parallel.no_sync(compiled, True):
            assert ddp.require_backward_grad_sync is False  # accumulation: this micro-batch does not all-reduce
        assert ddp.require_backward_grad_sync is True
        with parallel.no_sync_all([compiled], True, world_size=2):
            assert ddp.require_backward_grad_sync is False
    finally:
        dist.destroy_process_group()


def _record_compile(monkeypatch) -> list:
    """torch.compile replaced by a recorder that returns the module as it is (no compilation)."""
    calls = []

    def fake(module, **kwargs):
        calls.append(kwargs)
        return module
    monkeypatch.setattr(torch, "compile", fake)
    return calls


@pytest.mark.parametrize("mode, passed", [("max-autotune", {"mode": "max-autotune"}),
                                          ("reduce-overhead", {"mode": "reduce-overhead"}), ("default", {})])
def test_compile_mode_reaches_torch_compile(monkeypatch, tmp_path, mode, passed):
    calls = _record_compile(monkeypatch)
    torchrig.Trainer(TinyNet(), "sgd", **QUIET, run_dir=str(tmp_path), compile=True, compile_mode=mode)
    assert calls == [passed]


def test_each_network_of_a_module_dict_gets_the_mode(monkeypatch):
    calls = _record_compile(monkeypatch)
    nets = nn.ModuleDict({"g": nn.Linear(4, 4), "d": nn.Linear(4, 1)})
    runtime.compile_models(nets, dict(nets.items()), nets, "max-autotune-no-cudagraphs")
    assert calls == [{"mode": "max-autotune-no-cudagraphs"}] * 2


def test_cuda_graphs_drop_the_short_last_batch_on_cuda_only():
    from torchrig.trainer.plan import RunPlan

    cfg = torchrig.load_config(overrides=["model.compile=true", "model.compile_mode=reduce-overhead"])
    assert RunPlan.derive(cfg, 1, 1, cuda=True).drop_last is True
    assert RunPlan.derive(cfg, 1, 1, cuda=False).drop_last is False
    plain = torchrig.load_config(overrides=["model.compile=true", "model.compile_mode=max-autotune"])
    assert RunPlan.derive(plain, 1, 1, cuda=True).drop_last is False
    assert runtime.compile_line("reduce-overhead", "cuda", drop_last=False) == (
        "torchrig: model.compile_mode=reduce-overhead replays CUDA graphs of one batch shape, so the short last "
        "training batch of each epoch is dropped (data.drop_last=true)")
    assert runtime.compile_line("reduce-overhead", "cuda", drop_last=True) is None
    assert runtime.compile_line("max-autotune", "cuda", drop_last=False) is None


def test_cuda_graphs_off_cuda_say_so_and_keep_every_batch(monkeypatch, tmp_path, capsys):
    calls = _record_compile(monkeypatch)
    x, y = make_classification(20)
    trainer = torchrig.Trainer(TinyNet(), "sgd", **QUIET, run_dir=str(tmp_path), batch_size=8, epochs=1,
                               num_workers=0, compile=True, compile_mode="reduce-overhead",
                               checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(x, y))
    assert calls == [{"mode": "reduce-overhead"}]
    assert trainer.global_step == 3  # 8 + 8 + 4: the short batch trains on the CPU
    assert ("torchrig: model.compile_mode=reduce-overhead: CUDA graphs only apply on CUDA; on cpu the model is "
            "compiled without them") in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graphs_drop_the_short_last_batch_of_a_cuda_run(monkeypatch, tmp_path):
    _record_compile(monkeypatch)
    x, y = make_classification(20)
    trainer = torchrig.Trainer(TinyNet(), "sgd", **QUIET, run_dir=str(tmp_path), batch_size=8, epochs=1,
                               num_workers=0, device="cuda", compile=True, compile_mode="reduce-overhead",
                               checkpoint={"every_epochs": 0, "save_final": False})
    trainer.fit(TensorDataset(x, y))
    assert trainer.plan.drop_last is True and trainer.global_step == 2  # 8 + 8; the 4 left are dropped
